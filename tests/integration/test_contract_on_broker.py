"""The wire contract against the real broker: every model round-trips, keys land where faust
expects them, bad bytes give a clear error."""

from __future__ import annotations

import uuid

import pytest
from aiokafka.partitioner import DefaultPartitioner
from confluent_kafka import Producer
from confluent_kafka.admin import ConfigResource

from xidstream.schemas import DecodeError, GpuSample, TopicError, decode, decode_any, encode
from xidstream.schemas.topics import TOPICS
from tests.factories import one_of_each
from xidstream.cli import main as cli
from xidstream.transport.kafka import admin, create_topics, delete_topics, producer_config, read_all

pytestmark = pytest.mark.broker


def _produce(settings, items):
    producer = Producer(producer_config(settings))
    delivered = []

    def on_delivery(err, msg):
        assert err is None, err
        delivered.append((msg.topic(), msg.partition(), msg.key()))

    for topic, key, value in items:
        producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
    assert producer.flush(15) == 0
    return delivered


def test_every_model_round_trips_through_the_broker(kafka_settings):
    reg = kafka_settings.topics
    records = one_of_each()
    items = [(*reg.for_record(r), encode(r)) for r in records]
    _produce(kafka_settings, items)
    msgs = read_all(kafka_settings, sorted({t for t, _, _ in items}), expected=len(records), timeout=30)
    got = {decode_any(m.value()).event_id: (m.topic(), m.key(), decode_any(m.value())) for m in msgs}
    assert len(got) == len(records)
    for record in records:
        topic, key, back = got[record.event_id]
        assert back == record
        assert topic == reg.name(next(n for n, s in TOPICS.items() if s.model is type(record)))
        assert key == reg.for_record(record)[1]


def test_project_producer_partitions_gpu_keys_like_aiokafka(kafka_settings):
    topic = kafka_settings.topics.name("gpu.samples")
    keys = [f"GPU-{uuid.uuid4()}".encode() for _ in range(64)]
    delivered = _produce(kafka_settings, [(topic, k, b"{}") for k in keys])
    partitions = list(range(kafka_settings.partitions))
    aiokafka_choice = {k: DefaultPartitioner()(k, partitions, partitions) for k in keys}
    mismatched = [k for _, p, k in delivered if aiokafka_choice[k] != p]
    assert not mismatched, f"{len(mismatched)} of {len(keys)} keys on another partition than aiokafka's"

    # The check can fail: librdkafka's default partitioner (CRC32) disagrees for most keys.
    default = Producer({"bootstrap.servers": kafka_settings.bootstrap})
    seen = []
    for k in keys:
        default.produce(topic, value=b"{}", key=k, on_delivery=lambda e, m: seen.append((m.key(), m.partition())))
    default.flush(15)
    assert sum(aiokafka_choice[k] != p for k, p in seen) > len(keys) // 2


def test_undecodable_bytes_on_a_topic_give_a_clear_error(kafka_settings):
    topic = kafka_settings.topics.name("gpu.samples")
    good = GpuSample(node="node-a", gpu_uuid="GPU-1", gpu_index=0, pci_bus_id="0000:01:00")
    _produce(kafka_settings, [(topic, b"GPU-1", b"\x00\x01 not json"), (topic, b"GPU-1", encode(good))])
    msgs = read_all(kafka_settings, [topic], expected=2, timeout=30)
    decoded, errors = [], []
    for m in msgs:
        try:
            decoded.append(decode(GpuSample, m.value()))
        except DecodeError as exc:
            errors.append(exc)
    assert decoded == [good]
    assert len(errors) == 1 and "not JSON" in str(errors[0]) and errors[0].raw == b"\x00\x01 not json"


def test_topics_create_is_idempotent_and_uses_configured_partitions(kafka_bootstrap, capsys):
    prefix = f"c{uuid.uuid4().hex[:8]}."
    args = ["topics", "create", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "3"]
    assert cli(args) == 0
    first = capsys.readouterr().out
    assert first.count("created") == len(TOPICS)
    assert cli(args) == 0
    assert capsys.readouterr().out.count("exists") == len(TOPICS)

    client = admin(_settings(kafka_bootstrap, prefix, 3))
    md = client.list_topics(timeout=10)
    for name in TOPICS:
        assert len(md.topics[prefix + name].partitions) == 3
    futures = client.describe_configs([ConfigResource("topic", prefix + "gpu.inventory"),
                                       ConfigResource("topic", prefix + "gpu.xid")])
    policy = {res.name: f.result()["cleanup.policy"].value for res, f in futures.items()}
    assert policy == {prefix + "gpu.inventory": "compact", prefix + "gpu.xid": "delete"}


def test_topics_create_refuses_broken_copartitioning(kafka_bootstrap, capsys):
    prefix = f"m{uuid.uuid4().hex[:8]}."
    create_topics(_settings(kafka_bootstrap, prefix, 2), names=["gpu.xid"])
    with pytest.raises(TopicError, match=rf"{prefix}gpu\.xid has 2"):
        create_topics(_settings(kafka_bootstrap, prefix, 4))
    assert cli(["topics", "create", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "4"]) == 2
    err = capsys.readouterr().err
    assert "co-partitioned" in err and f"{prefix}gpu.xid has 2" in err


def _settings(bootstrap, prefix, partitions):
    from xidstream.settings import Settings

    return Settings(bootstrap=bootstrap, topic_prefix=prefix, partitions=partitions)


def test_topics_create_chooses_one_replica_on_the_single_broker_and_says_so(kafka_bootstrap, capsys, monkeypatch):
    """No replication given: the cluster is asked how many brokers it has, and a single broker
    is the one case for one replica (transport.kafka.choose_replication); the flag still wins."""
    monkeypatch.delenv("XIDSTREAM_REPLICATION", raising=False)
    monkeypatch.delenv("XIDSTREAM_MIN_INSYNC_REPLICAS", raising=False)
    prefix = f"r{uuid.uuid4().hex[:8]}."
    args = ["topics", "create", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix, "--partitions", "2"]
    assert cli(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("topics: replication factor 1 (chosen: 1 broker in the cluster), "
                      "min.insync.replicas: the broker's default")
    assert sum(line.endswith(" created") for line in out) == len(TOPICS)
    md = admin(_settings(kafka_bootstrap, prefix, 2)).list_topics(timeout=10)
    assert {len(p.replicas) for n in TOPICS for p in md.topics[prefix + n].partitions.values()} == {1}
    # told three on one broker: taken as told, and the broker's refusal names it
    other = f"r{uuid.uuid4().hex[:8]}."
    assert cli(["topics", "create", "--bootstrap", kafka_bootstrap, "--topic-prefix", other, "--partitions", "2",
                "--replication-factor", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("topics: replication factor 3 (--replication-factor), min.insync.replicas 2")
    assert "cannot create topic" in captured.err and "eplication factor" in captured.err
    delete_topics(_settings(kafka_bootstrap, prefix, 2))
