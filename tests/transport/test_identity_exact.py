"""IdentityDirectory's reader thread without a broker (found by `make mutate
MODULES=transport/identity.py`: its whole loop survived, no fast test ran it).

A scripted consumer stands in for confluent-kafka's: it answers `list_topics` with the partitions
given, hands out the records, end-of-partition events and errors of its script one `poll` at a
time, notes at each `poll` whether the directory already says it is loaded, and stops the
directory when its script is done. What is checked is what the thread does with each: the
consumer it asks for, where it starts reading, which enrollments count, what it logs, and the
moment it says the topic was read to its end."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import confluent_kafka
import pytest
from confluent_kafka import KafkaError

from schemas.codec import encode
from schemas.models import NodeEnrollment
from schemas.signing import SigningKey, VerifyKeys, generate_keys
from transport.config import KafkaConfig
from transport.identity import IdentityDirectory, NodeIdentity, ProcessorIdentity, RecordVerifier

PREFIX = "run7-"
TOPIC = PREFIX + "xidstream.identities"
LOGGER = "transport.identity"


class _Msg:
    def __init__(self, value=None, partition=0, offset=0, error=None):
        self._value, self._partition, self._offset, self._error = value, partition, offset, error

    def value(self):
        return self._value

    def partition(self):
        return self._partition

    def offset(self):
        return self._offset

    def error(self):
        return self._error


class _Err:
    def __init__(self, code, text):
        self._code, self._text = code, text

    def code(self):
        return self._code

    def __str__(self):
        return self._text


def _eof(partition):
    return _Msg(partition=partition, error=_Err(KafkaError._PARTITION_EOF, "Broker: No more messages"))


class _Consumer:
    """One scripted consumer per test (`made` keeps it for the checks)."""

    made: list["_Consumer"] = []

    def __init__(self, config):
        self.config = config
        self.thread = threading.current_thread()
        self.list_topics_calls: list[tuple] = []
        self.assigned = None
        self.polls: list[tuple[float, bool]] = []  # (timeout, loaded when polled)
        self.closed = False
        _Consumer.made.append(self)

    def list_topics(self, *args, **kwargs):
        self.list_topics_calls.append((args, kwargs))
        return self.metadata

    def assign(self, partitions):
        self.assigned = [(tp.topic, tp.partition, tp.offset) for tp in partitions]

    def poll(self, *args, **kwargs):
        self.polls.append(((args, kwargs), self.directory.wait_loaded(0)))
        if self.script:
            return self.script.pop(0)
        self.directory.stop()
        return None

    def close(self):
        self.closed = True


@pytest.fixture
def world(tmp_path, monkeypatch):
    priv, pub, _ = generate_keys(tmp_path / "enroller")
    enroller = SigningKey.load(priv)
    ppriv, _, _ = generate_keys(tmp_path / "proc")
    processor = ProcessorIdentity(SigningKey.load(ppriv))
    nodes = {n: NodeIdentity.load_or_create(tmp_path / n, n) for n in ("gpu-a", "gpu-b", "gpu-c")}

    def enrollment(node, *, signed=True):
        rec = NodeEnrollment(node=node, x25519_public=nodes[node].x25519_public,
                             ed25519_public=nodes[node].ed25519_public, csr_name=f"csr-{node}", csr_uid=f"u-{node}")
        return encode(enroller.sign(rec) if signed else rec)

    _Consumer.made = []
    monkeypatch.setattr(confluent_kafka, "Consumer", _Consumer)

    def run(script, metadata, settings=None):
        verifier = RecordVerifier(processor)
        settings = settings or KafkaConfig(bootstrap="broker-1:9093", topic_prefix=PREFIX,
                                           kafka_extra={"security.protocol": "SASL_SSL"})
        d = IdentityDirectory(settings, VerifyKeys.load([pub], purpose="enrollments"), verifier)
        _Consumer.script, _Consumer.metadata, _Consumer.directory = list(script), metadata, d
        assert d.start() is d
        assert d.wait_loaded(timeout=5)
        [consumer] = _Consumer.made
        consumer.thread.join(timeout=5)
        assert not consumer.thread.is_alive(), "the reader did not stop"
        return d, verifier, consumer

    return SimpleNamespace(enrollment=enrollment, run=run, nodes=nodes)


def _metadata(partitions=(2, 0, 1), error=None, present=True):
    topics = {TOPIC: SimpleNamespace(partitions={p: object() for p in partitions}, error=error)} if present else {}
    return SimpleNamespace(topics={"other": SimpleNamespace(partitions={0: object()}, error=None), **topics})


def _records(caplog):
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER or r.name == "root"]


def test_the_reader_reads_every_partition_from_the_beginning_and_is_loaded_at_the_end_of_all(world, caplog):
    e = world.enrollment
    script = [
        None,                                        # nothing yet: not loaded (0 of 3 partitions at their end)
        _Msg(e("gpu-a"), partition=0, offset=0),     # counts
        _Msg(e("gpu-c", signed=False), partition=1, offset=3),  # refused, logged with where it was
        _eof(0),                                     # 1 of 3 at the end
        _Msg(error=_Err(KafkaError._TRANSPORT, "broker-1:9093: Disconnected")),  # logged, not an end
        None,                                        # still 1 of 3: not loaded
        _eof(0),                                     # the same partition again: still 1 of 3
        _eof(2),                                     # 2 of 3
        _eof(1),                                     # 3 of 3: loaded
        _Msg(e("gpu-b"), partition=1, offset=5),     # read on after loading: a node enrolled later
    ]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        d, verifier, consumer = world.run(script, _metadata())
    assert consumer.config == {"bootstrap.servers": "broker-1:9093", "group.id": "run7-xidstream-identities-reader",
                               "auto.offset.reset": "earliest", "enable.auto.commit": False,
                               "security.protocol": "SASL_SSL", "enable.partition.eof": True}
    assert consumer.list_topics_calls == [((TOPIC,), {"timeout": 30})]
    assert consumer.assigned == [(TOPIC, 0, confluent_kafka.OFFSET_BEGINNING), (TOPIC, 1, -2), (TOPIC, 2, -2)]
    assert [call for call, _ in consumer.polls] == [((0.5,), {})] * 11
    assert [loaded for _, loaded in consumer.polls] == [False] * 9 + [True, True]
    assert verifier.identities == ["gpu-a", "gpu-b"]
    assert d.refused == 1
    assert _records(caplog) == [
        (LOGGER, "WARNING", f"{TOPIC}[1]@3: enrollment refused: unsigned: no signature or key_id"),
        (LOGGER, "WARNING", f"{TOPIC}: broker-1:9093: Disconnected"),
    ]
    assert consumer.closed
    assert consumer.thread.name == "xidstream-identities" and consumer.thread.daemon  # never holds up an exit


@pytest.mark.parametrize("metadata", [_metadata(present=False), _metadata(error=_Err(3, "Unknown topic")),
                                      _metadata(partitions=())], ids=["missing", "error", "no partitions"])
def test_a_topic_that_does_not_exist_is_an_error_and_loaded_at_once(world, caplog, metadata):
    """Nothing to read: a starting worker is not held up, and the log says why no record is believed."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        d, verifier, consumer = world.run([None, None], metadata)
    assert consumer.assigned == []
    assert [loaded for _, loaded in consumer.polls] == [False, True, True]
    assert _records(caplog) == [(LOGGER, "ERROR", f"{TOPIC} does not exist: no record can be believed until it "
                                                  f"does (xidstream topics create)")]
    assert d.wait_loaded(0) and verifier.identities == [] and consumer.closed


def test_one_partition_at_its_end_is_loaded_at_once_and_read_on(world):
    e = world.enrollment
    _, verifier, consumer = world.run([_eof(0), _Msg(e("gpu-a"), partition=0, offset=1)], _metadata(partitions=(0,)))
    assert [loaded for _, loaded in consumer.polls] == [False, True, True]
    assert verifier.identities == ["gpu-a"]


def test_wait_loaded_waits_a_minute_by_default(world, monkeypatch):
    waits: list = []

    class Recording(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(threading, "Event", Recording)
    d, _, _ = world.run([_eof(0)], _metadata(partitions=(0,)))
    assert d.wait_loaded() is True
    assert waits[-1] == 60.0
    fresh = IdentityDirectory(None, None, None)  # never started: not loaded, the timeout is honoured
    assert fresh.wait_loaded(0.01) is False and waits[-1] == 0.01
