"""`LagProbe` on the real broker: a consumer whose answers say the group committed nothing is
replaced, so one stuck librdkafka consumer cannot make a committing worker look stalled.

On the three-broker cluster (2026-12-04) a probe made while the group's coordinator was about to
move read "nothing committed" for 75 s while the worker's DEBUG log showed a commit every 0.25 s,
and a new consumer read those commits at once. That state of librdkafka could not be brought
about on purpose here; the stand-in is a probe consumer of another group, which answers "nothing
committed" to every question the same way."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from xidstream.transport.kafka import LagProbe, consumer_config, producer_config

pytestmark = pytest.mark.broker


def _commit(settings, group: str, topic: str, offset: int) -> None:
    c = Consumer(consumer_config(settings, group))
    try:
        c.commit(offsets=[TopicPartition(topic, p, offset) for p in range(settings.partitions)], asynchronous=False)
    finally:
        c.close()


def test_a_probe_that_reads_nothing_committed_asks_again_with_a_new_consumer(kafka_settings):
    s = kafka_settings
    topic = s.topics.name("gpu.samples")
    p = Producer(producer_config(s))
    for part in range(s.partitions):
        for i in range(3):
            p.produce(topic, b"{}", key=b"k", partition=part)
    assert p.flush(30) == 0
    group = f"{s.topic_prefix}xidstream-processor"
    _commit(s, group, topic, 2)  # one record of each partition not committed
    probe = LagProbe(s, group, [topic], renew_after=0.5)
    try:
        assert probe.lag() == s.partitions
        # the stuck consumer: its every answer is "nothing committed"
        probe.probe.close()
        probe.probe = Consumer(consumer_config(s, f"{s.topic_prefix}another-group"))
        assert probe.lag() is None
        readings = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not readings or readings[-1] is None):
            time.sleep(0.2)
            readings.append(probe.lag())
        assert readings[-1] == s.partitions, readings
        assert probe.renewed == 1
        _commit(s, group, topic, 3)
        assert probe.lag() == 0
    finally:
        probe.close()


def test_a_probe_whose_committed_offsets_stand_still_under_new_messages_checks_with_a_new_consumer(kafka_settings):
    """By the committed offsets, not the lag: a stuck answer under a flowing topic gives a lag that
    changes at every reading."""
    s = kafka_settings
    topic = s.topics.name("gpu.samples")
    p = Producer(producer_config(s))
    p.produce(topic, b"{}", key=b"k", partition=0)
    assert p.flush(30) == 0
    group = f"{s.topic_prefix}xidstream-processor"
    _commit(s, group, topic, 0)
    probe = LagProbe(s, group, [topic], renew_after=2.0)
    try:
        assert probe.lag() == 1 and probe.renewed == 0
        p.produce(topic, b"{}", key=b"k", partition=0)  # the lag moves, the commits do not
        assert p.flush(30) == 0
        time.sleep(2.2)
        assert probe.lag() == 2 and probe.renewed == 1  # the same commits for 2 s: a new consumer next
        assert probe.lag() == 2 and probe.renewed == 1  # at most one per renew_after
        _commit(s, group, topic, 2)
        assert probe.lag() == 0 and probe.renewed == 1
    finally:
        probe.close()
