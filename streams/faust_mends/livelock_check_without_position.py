"""faust-streaming 0.15.3: the livelock check crashes the consumer on a partition waiting for its
offset reset.

`AIOKafkaConsumerThread.verify_event_path` (faust/transport/drivers/aiokafka.py, run every few
seconds for each assigned partition) reads aiokafka's ``TopicPartitionState.position``, which
asserts that the position is valid. A partition waiting for its offset reset (just assigned, or
sought to its beginning: `never_committed_from_beginning`) has none: the AssertionError crashed
the consumer, and the survivor of a failover exited (failover bench, a kill during start-up: 45
fatal Xids without a command). No upstream issue found;
`patches/livelock_check_without_position.patch` skips such a partition in faust's check.

Here: a partition without a valid position has nothing to check yet; any other is checked by
faust as before.
"""

from __future__ import annotations

from typing import Any

from aiokafka.structs import TopicPartition


class LivelockCheckWithoutPosition:
    """Mixin for faust's aiokafka `Consumer`."""

    def verify_event_path(self, now: float, tp: Any) -> None:
        state = self._partition_state(tp)
        if state is not None and not state.has_valid_position:
            return None
        return super().verify_event_path(now, tp)

    def _partition_state(self, tp: Any) -> Any:
        """aiokafka's state of `tp` (its position, ...); None when it is not assigned. (aiokafka has
        no public reader that does not wait or assert; faust's own check reads it this way.)"""
        subscription = self._thread._ensure_consumer()._fetcher._subscriptions.subscription
        if subscription is None:
            return None
        return subscription.assignment.state_value(TopicPartition(tp.topic, tp.partition))
