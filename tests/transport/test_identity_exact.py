"""IdentityDirectory without a broker (found by `make mutate MODULES=transport/identity.py`: its
whole loop survived, no fast test ran it).

The fold (`apply`) is fed records directly. The reader loop (`_run`) is given a scripted consumer
through the directory's `consumer` parameter, in place of confluent-kafka's: it answers
`list_topics` with the partitions given, hands out the records, end-of-partition events and errors
of its script one `poll` at a time, notes at each `poll` whether the directory already says it is
loaded, and stops the directory when its script is done, so `_run` returns and is called in the
test's own thread (no waiting on a thread but in the one test of `start`). What is checked is what
the loop does with each: the consumer it asks for, where it starts reading, which enrollments count,
what it logs, and the moment it says the topic was read to its end. The broker tier reads the real
topic."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import confluent_kafka
import pytest
from confluent_kafka import KafkaError

from xidstream.schemas.codec import decode, encode
from xidstream.schemas.models import NodeEnrollment
from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys
from xidstream.transport.config import KafkaConfig
from xidstream.transport.identity import AuthError, IdentityDirectory, NodeIdentity, ProcessorIdentity, RecordVerifier
from xidstream.transport.kafka_log import KAFKA_LOG

PREFIX = "run7-"
TOPIC = PREFIX + "xidstream.identities"
LOGGER = "xidstream.transport.identity"
NOT_ENROLLED = "'{}' is not enrolled (no NodeEnrollment for it on xidstream.identities)"


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
    """One scripted consumer per test (`made` keeps it for the checks); the class is the factory."""

    made: list["_Consumer"] = []
    script: list = []
    metadata = None
    directory = None

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


class _NotHere:
    """confluent-kafka's Consumer while a test runs: made only where no consumer is given."""

    def __init__(self, config):
        raise AssertionError(f"the real consumer was made ({config})")


@pytest.fixture
def world(tmp_path, monkeypatch):
    priv, pub, _ = generate_keys(tmp_path / "enroller")
    enroller = SigningKey.load(priv)
    ppriv, _, _ = generate_keys(tmp_path / "proc")
    processor = ProcessorIdentity(SigningKey.load(ppriv))
    nodes = {n: NodeIdentity.load_or_create(tmp_path / n, n) for n in ("gpu-a", "gpu-b", "gpu-c")}
    trusted = VerifyKeys.load([pub], purpose="enrollments")

    def enrollment(node, *, signed=True, key=None, **fields):
        who = key or nodes[node]
        rec = NodeEnrollment(node=node, x25519_public=who.x25519_public, ed25519_public=who.ed25519_public,
                             csr_name=f"csr-{node}", csr_uid=f"u-{node}", **fields)
        return encode(enroller.sign(rec) if signed else rec)

    _Consumer.made = []
    monkeypatch.setattr(confluent_kafka, "Consumer", _NotHere)

    def directory(settings=None, **kw):
        settings = settings or KafkaConfig(bootstrap="broker-1:9093", topic_prefix=PREFIX,
                                           kafka_extra={"security.protocol": "SASL_SSL"})
        return IdentityDirectory(settings, trusted, RecordVerifier(processor), **kw)

    def run(script, metadata, settings=None):
        """`_run` in this thread, to the end of `script`."""
        d = directory(settings, consumer=_Consumer)
        _Consumer.script, _Consumer.metadata, _Consumer.directory = list(script), metadata, d
        d._run()
        [consumer] = _Consumer.made
        return d, d.verifier, consumer

    def says(verifier, node, key=None):
        """Whom the verifier names for a record of `node` MACed with `key` (`node`'s own by default)."""
        h = (key or nodes[node]).record_auth(processor.public).header("t", b"k", b"v")
        try:
            return verifier.sender([h], "t", b"k", b"v")
        except AuthError as exc:
            return str(exc)

    return SimpleNamespace(enrollment=enrollment, run=run, directory=directory, nodes=nodes, says=says,
                           processor=processor, enroller=enroller)


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
                               "security.protocol": "SASL_SSL", "enable.partition.eof": True,
                               "logger": KAFKA_LOG}
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


def test_start_reads_in_a_daemon_thread_of_its_own_with_confluent_kafkas_consumer_by_default(world, monkeypatch):
    monkeypatch.setattr(confluent_kafka, "Consumer", _Consumer)
    d = world.directory()
    _Consumer.script, _Consumer.metadata, _Consumer.directory = [_eof(0)], _metadata(partitions=(0,)), d
    assert d.wait_loaded(0) is False
    assert d.start() is d
    assert d.wait_loaded(timeout=10)
    [consumer] = _Consumer.made
    consumer.thread.join(timeout=10)
    assert not consumer.thread.is_alive(), "the reader did not stop"
    assert consumer.thread is not threading.current_thread()
    assert consumer.thread.name == "xidstream-identities" and consumer.thread.daemon  # never holds up an exit
    assert consumer.closed


# --- the fold ----------------------------------------------------------------------------------

def test_a_re_enrollment_replaces_the_key_and_a_revocation_ends_it_for_that_node_only(world, tmp_path):
    d = world.directory()
    reimaged = NodeIdentity.load_or_create(tmp_path / "reimaged", "gpu-a")
    assert d.apply(world.enrollment("gpu-a")) is None
    assert d.apply(world.enrollment("gpu-b")) is None
    assert world.says(d.verifier, "gpu-a") == "gpu-a"
    assert d.apply(world.enrollment("gpu-a", key=reimaged)) is None
    assert world.says(d.verifier, "gpu-a") == \
        "the xidstream-auth MAC does not hold for 'gpu-a': altered, or sent by another node"
    assert world.says(d.verifier, "gpu-a", reimaged) == "gpu-a"
    assert d.apply(world.enrollment("gpu-a", key=reimaged, revoked=True)) is None
    assert world.says(d.verifier, "gpu-a", reimaged) == NOT_ENROLLED.format("gpu-a")
    assert d.verifier.identities == ["gpu-b"] and world.says(d.verifier, "gpu-b") == "gpu-b"
    assert d.refused == 0


def test_no_revocation_or_key_counts_unless_the_enroller_signed_it_for_that_node(world, tmp_path):
    d = world.directory()
    assert d.apply(world.enrollment("gpu-a")) is None
    assert d.apply(world.enrollment("gpu-a", revoked=True, signed=False)) == "unsigned: no signature or key_id"
    intruder = NodeIdentity.load_or_create(tmp_path / "intruder", "gpu-a")
    assert d.apply(world.enrollment("gpu-a", key=intruder, signed=False)) == "unsigned: no signature or key_id"
    # gpu-b's signed enrollment, its node changed to gpu-a: the signature covers the node
    forged = decode(NodeEnrollment, world.enrollment("gpu-b")).model_copy(update={"node": "gpu-a"})
    assert d.apply(encode(forged)) == f"forged or altered: the signature does not match key {world.enroller.key_id}"
    assert d.refused == 3
    assert d.verifier.identities == ["gpu-a"]
    assert world.says(d.verifier, "gpu-a") == "gpu-a"
    assert world.says(d.verifier, "gpu-b") == NOT_ENROLLED.format("gpu-b")


# Points of small order on Curve25519 (RFC 7748 section 6.1; the list of Bernstein's "Curve25519:
# new Diffie-Hellman speed records" checks): X25519 with any of them is all zeros.
LOW_ORDER = ["00" * 32, "01" + "00" * 31, "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"]


@pytest.mark.parametrize("point", LOW_ORDER)
def test_a_key_with_no_shared_secret_is_refused_and_ends_the_nodes_old_key(world, point):
    d = world.directory()
    assert d.apply(world.enrollment("gpu-a")) is None
    assert d.apply(world.enrollment("gpu-b")) is None
    bad = SimpleNamespace(x25519_public=point, ed25519_public=world.nodes["gpu-a"].ed25519_public)
    assert d.apply(world.enrollment("gpu-a", key=bad)) == (
        f"gpu-a: X25519 key {point} has no shared secret with ours (a low-order point); not believed until it "
        f"enrolls another")
    assert d.refused == 1
    assert d.verifier.identities == ["gpu-b"]
    assert world.says(d.verifier, "gpu-a") == NOT_ENROLLED.format("gpu-a")
    assert d.apply(world.enrollment("gpu-a")) is None  # a good key again
    assert world.says(d.verifier, "gpu-a") == "gpu-a" and d.refused == 1


def test_the_reader_reads_on_past_every_enrollment_it_refuses(world, caplog):
    """A tombstone or one node's bad key is logged, counted and skipped: the loop goes on, the topic is loaded."""
    bad = SimpleNamespace(x25519_public=LOW_ORDER[0], ed25519_public=world.nodes["gpu-a"].ed25519_public)
    script = [_Msg(None, partition=0, offset=7), _Msg(world.enrollment("gpu-a", key=bad), partition=0, offset=8),
              _Msg(world.enrollment("gpu-b"), partition=0, offset=9), _eof(0)]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        d, verifier, consumer = world.run(script, _metadata(partitions=(0,)))
    assert verifier.identities == ["gpu-b"] and d.refused == 2
    assert [loaded for _, loaded in consumer.polls] == [False, False, False, False, True]
    assert _records(caplog) == [
        (LOGGER, "WARNING", f"{TOPIC}[0]@7: enrollment refused: cannot decode record: empty record (null value, "
                            f"maybe a tombstone)"),
        (LOGGER, "WARNING", f"{TOPIC}[0]@8: enrollment refused: gpu-a: X25519 key {LOW_ORDER[0]} has no shared secret "
                            f"with ours (a low-order point); not believed until it enrolls another"),
    ]
    assert consumer.closed
