"""The node executor's start-up look-up of its start offsets retries a broker answer that a
leader election or topics made a moment ago give (NOT_LEADER_FOR_PARTITION was seen right after
`topics create`: the executor exited "cannot look up start offsets"), and gives up on one that
asking again cannot change. The consumer here is a stand-in with the one method the look-up
calls; the broker path is tests/integration/test_node_executor_partitions.py."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from xidstream.executors import runner


class Answers:
    """offsets_for_times answering each of `answers` in turn: an exception, or per-partition errors."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = 0

    def offsets_for_times(self, tps, timeout):
        self.calls += 1
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a


class _Answered:
    """A partition's answer with an error, as librdkafka sets it (TopicPartition.error is read-only)."""

    def __init__(self, offset, error):
        self.topic, self.partition, self.offset, self.error = "t", 0, offset, error


def _tp(offset=5, error=None):
    return TopicPartition("t", 0, offset) if error is None else _Answered(offset, error)


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch):
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)


def test_not_leader_is_asked_again_until_it_answers():
    c = Answers(KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)),
                KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE)), [_tp(7)])
    found = runner._offsets_for_times(c, [_tp()], timeout=1, retry_s=30)
    assert c.calls == 3 and [tp.offset for tp in found] == [7]


def test_a_partition_answered_with_a_retriable_error_is_asked_again():
    c = Answers([_tp(error=KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))], [_tp(9)])
    found = runner._offsets_for_times(c, [_tp()], timeout=1, retry_s=30)
    assert c.calls == 2 and [tp.offset for tp in found] == [9]


def test_an_answer_asking_again_cannot_change_ends_at_once():
    c = Answers(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)), [_tp(7)])
    with pytest.raises(RuntimeError, match="cannot look up start offsets: .*TOPIC_AUTHORIZATION_FAILED"):
        runner._offsets_for_times(c, [_tp()], timeout=1, retry_s=30)
    assert c.calls == 1


def test_retries_end_after_their_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(runner.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    c = Answers(*[KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))] * 100)
    with pytest.raises(RuntimeError, match="NOT_LEADER_FOR_PARTITION"):
        runner._offsets_for_times(c, [_tp()], timeout=1, retry_s=30)
    assert 30 - 5 <= now[0] <= 30 and 5 <= c.calls < 20
