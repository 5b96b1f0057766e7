"""`read_since` (the operator's bounded reads: `xidstream incidents`) asks again when a partition's
leader is moving: in CI, `offsets_for_times` on a topic a moment old failed with
NOT_LEADER_FOR_PARTITION and `xidstream incidents` exited with the error."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

import xidstream.transport.kafka as tk
from xidstream.transport.config import KafkaConfig


class _Meta:
    def __init__(self, topics):
        self.topics = {t: type("T", (), {"error": None, "partitions": {0: None}})() for t in topics}


class _Consumer:
    def __init__(self, fail_with, times):
        self.fail_with, self.times, self.calls = fail_with, times, 0

    def list_topics(self, timeout=None):
        return _Meta(["p.gpu.alerts"])

    def offsets_for_times(self, tps, timeout=None):
        self.calls += 1
        if self.calls <= self.times:
            raise KafkaException(KafkaError(self.fail_with, "Failed to get offsets: Broker: Not leader for partition"))
        return [TopicPartition(tp.topic, tp.partition, -1) for tp in tps]  # nothing since then

    def get_watermark_offsets(self, tp, timeout=None):
        return 0, 0

    def close(self):
        pass


def test_a_moving_leader_is_asked_again(monkeypatch):
    c = _Consumer(KafkaError.NOT_LEADER_FOR_PARTITION, 2)
    monkeypatch.setattr(tk, "_reader", lambda settings, **kw: c)
    assert list(tk.read_since(KafkaConfig(topic_prefix="p."), ["p.gpu.alerts"], 0)) == []
    assert c.calls == 3


def test_any_other_error_is_raised_at_once(monkeypatch):
    c = _Consumer(KafkaError.TOPIC_AUTHORIZATION_FAILED, 5)
    monkeypatch.setattr(tk, "_reader", lambda settings, **kw: c)
    with pytest.raises(KafkaException):
        list(tk.read_since(KafkaConfig(topic_prefix="p."), ["p.gpu.alerts"], 0))
    assert c.calls == 1
