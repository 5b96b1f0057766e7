"""Where topics are created (`topics create`, `simulate --create-topics`, `collect --create-topics`,
the processor's internal and changelog topics), they are replicated as the cluster can hold unless
told otherwise (`xidstream.transport.kafka.choose_replication`): 3 replicas with min.insync.replicas 2, or one
per broker when there are fewer; one broker is the only case for one. Unreplicated topics on three
brokers lost partitions with one broker down (readers got `Unknown partition`, a simulated fleet
exited 1 with 5,795 records still queued).

The cluster is an in-memory admin client here (what it lists, what it is asked to create); the
single real broker's answer is in tests/integration/test_contract_on_broker.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import xidstream.transport.kafka as kafka
from xidstream.schemas.errors import ConfigError
from xidstream.schemas.topics import TOPICS
from xidstream.transport.kafka import choose_replication, create_topics, ensure_processor_topics, settle_replication
from xidstream.settings import Settings


@pytest.mark.parametrize("brokers, expected", [(1, (1, None)), (2, (2, 1)), (3, (3, 2)), (5, (3, 2))])
def test_replication_is_what_the_cluster_can_hold(brokers, expected):
    assert choose_replication(brokers) == expected


def test_an_explicit_replication_factor_or_min_insync_replicas_wins():
    assert choose_replication(5, 1) == (1, None)  # told: a single replica, even on five brokers
    assert choose_replication(1, 3) == (3, 2)  # told more than there are: the broker says no, naming both
    assert choose_replication(3, 3, 1) == (3, 1)
    assert choose_replication(3, None, 3) == (3, 3)
    assert choose_replication(5, 5) == (5, 2)


class FakeCluster:
    """An AdminClient's answers: `brokers` live broker ids, the topics that exist (name -> replica
    lists per partition), and the NewTopic objects it was asked to create."""

    def __init__(self, brokers, topics=None):
        self.brokers = list(brokers)
        self.topics = dict(topics or {})
        self.created = []
        self.listed = 0

    def list_topics(self, timeout=None):
        self.listed += 1
        topics = {name: SimpleNamespace(error=None, partitions={
            i: SimpleNamespace(id=i, replicas=list(r)) for i, r in enumerate(parts)}) for name, parts in self.topics.items()}
        return SimpleNamespace(brokers={b: SimpleNamespace(id=b) for b in self.brokers}, topics=topics)

    def create_topics(self, new, **kwargs):
        out = {}
        for t in new:
            self.created.append(t)
            self.topics[t.topic] = [list(range(1, t.replication_factor + 1))] * t.num_partitions
            out[t.topic] = SimpleNamespace(result=lambda timeout=None: None)
        return out

    def describe_configs(self, resources, **kwargs):
        return {}

    def describe_topics(self, *a, **kw):
        raise RuntimeError("not asked here")

    def poll(self, timeout):
        return 0


@pytest.fixture
def cluster(monkeypatch):
    def make(brokers, topics=None):
        fake = FakeCluster(brokers, topics)
        monkeypatch.setattr(kafka, "admin", lambda settings, **kw: fake)
        return fake
    return make


def _made(fake) -> set[tuple[int, str | None]]:
    return {(t.replication_factor, t.config.get("min.insync.replicas")) for t in fake.created}


@pytest.mark.parametrize("brokers, made", [(1, {(1, None)}), (2, {(2, "1")}), (3, {(3, "2")}), (5, {(3, "2")})])
def test_create_topics_with_the_default_settings_replicates_as_the_cluster_can_hold(cluster, brokers, made):
    fake = cluster(range(1, brokers + 1))
    result = create_topics(Settings(topic_prefix="p.", node="n1"))
    assert set(result.values()) == {"created"} and len(fake.created) == len(TOPICS)
    assert _made(fake) == made


def test_the_processor_topics_with_the_default_settings_are_replicated_the_same(cluster):
    s = Settings(topic_prefix="p.", node="n1", partitions=2)
    fake = cluster([1, 2, 3], {s.topics.name(n): [[1, 2, 3]] * 2 for n in TOPICS})
    ensure_processor_topics(s, {"p.xidstream.fleet": 1}, compacted={"p.app-gpus-changelog": 2})
    assert [t.topic for t in fake.created] == ["p.xidstream.fleet", "p.app-gpus-changelog"]
    assert _made(fake) == {(3, "2")}


def test_a_broker_down_for_a_restart_still_counts(cluster):
    """The metadata lists only live brokers; one that holds a replica of a listed topic is one of
    the cluster's too, or a topic created during a rolling restart would get two replicas."""
    fake = cluster([1, 2], {"__consumer_offsets": [[1, 2, 3]]})
    settled, line = settle_replication(Settings(node="n1"))
    assert (settled.replication_factor, settled.min_insync_replicas) == (3, 2)
    assert line == "replication factor 3 (chosen: 3 brokers in the cluster), min.insync.replicas 2"
    assert fake.listed == 1


def test_the_line_says_what_was_chosen_and_why(cluster):
    fake = cluster([1])
    settled, line = settle_replication(Settings(node="n1"))
    assert (settled.replication_factor, settled.min_insync_replicas) == (1, None)
    assert line == "replication factor 1 (chosen: 1 broker in the cluster), min.insync.replicas: the broker's default"
    # given: taken as it is, and the cluster is not asked
    settled, line = settle_replication(Settings(node="n1", replication_factor=3, min_insync_replicas=2))
    assert line == "replication factor 3 (--replication-factor), min.insync.replicas 2 (--min-insync-replicas)"
    assert fake.listed == 1
    with pytest.raises(ConfigError, match="--min-insync-replicas 2 is more than the 1 replica"):
        settle_replication(Settings(node="n1", min_insync_replicas=2))


def test_the_start_up_check_expects_what_creation_would_choose(cluster):
    """A collector or an executor with the default settings on three brokers: a topic of one
    replica is a finding, one of three with min.insync.replicas 2 is not."""
    s = Settings(node="n1")
    cluster([1, 2, 3], {"gpu.xid": [[1]], "gpu.samples": [[1, 2, 3]]})
    findings = kafka.check_replication(s, ["gpu.xid", "gpu.samples"])
    assert findings == ["topic gpu.xid: replication factor 1, expected 3 (--replication-factor)"]


def test_the_commands_take_an_explicit_replication_and_none_by_default(monkeypatch):
    from xidstream.cli import _settings, build_parser

    monkeypatch.delenv("XIDSTREAM_REPLICATION", raising=False)
    monkeypatch.delenv("XIDSTREAM_MIN_INSYNC_REPLICAS", raising=False)

    args = build_parser().parse_args(["topics", "create"])
    assert (_settings(args).replication_factor, _settings(args).min_insync_replicas) == (None, None)
    args = build_parser().parse_args(["simulate", "--create-topics", "--replication-factor", "1"])
    assert _settings(args).replication_factor == 1
    assert Settings.from_env({"XIDSTREAM_REPLICATION": "2"}).replication_factor == 2


def test_a_create_request_lost_with_its_broker_handle_is_asked_again(cluster):
    """librdkafka drops the bootstrap brokers' handles once the metadata names the real ones; a
    CreateTopics queued on one failed with _DESTROY_BROKER on a fresh three-broker cluster (the
    cluster tier's first test, in a clean-clone CI run). Creating is idempotent: asked again."""
    from confluent_kafka import KafkaError, KafkaException

    fake = cluster([1, 2, 3])
    inner = fake.create_topics
    calls = []

    def flaky(new, **kw):
        calls.append([t.topic for t in new])
        if len(calls) > 1:
            return inner(new, **kw)

        def lost(timeout=None):
            raise KafkaException(KafkaError(KafkaError._DESTROY_BROKER))
        return {t.topic: SimpleNamespace(result=lost) for t in new}

    fake.create_topics = flaky
    result = create_topics(Settings(topic_prefix="p.", node="n1"))
    assert set(result.values()) == {"created"} and len(calls) == 2 and len(fake.created) == len(TOPICS)
