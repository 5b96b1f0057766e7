"""faust-streaming 0.15.3: a partition the group never committed keeps the position of its fetches
after a rebalance, so the records its stream buffers held were never read again.

After a rebalance faust drops what its stream buffers held and calls `seek_to_committed`
(`AIOKafkaConsumerThread.seek_to_committed`, faust/transport/drivers/aiokafka.py), which is
aiokafka's `AIOKafkaConsumer.seek_to_committed`: that seeks a partition only when its committed
offset is above 0. A partition the group never committed keeps the position its fetches had
reached; the dropped records are never read again and the next commit goes past them (16 of 333
fatal Xids without a command over 10 failovers, on quiet gpu.xid partitions). No upstream issue
found; `patches/never_committed_from_beginning.patch` seeks such partitions of the acked topics to
their beginning in faust's `seek_to_committed`.

Here: such a partition of a topic faust commits (acks enabled: changelog partitions are never
committed, table recovery places them itself) starts at its beginning, as
auto.offset.reset=earliest says: nothing of it is known to be processed.
"""

from __future__ import annotations

from typing import Any


class NeverCommittedFromBeginning:
    """Mixin for faust's aiokafka `Consumer`."""

    async def seek_to_committed(self) -> Any:
        committed = await super().seek_to_committed()
        fresh = [tp for tp, offset in committed.items()
                 if (not offset or offset <= 0) and self.app.topics.acks_enabled_for(tp.topic)]
        if fresh:
            await self._thread.seek_to_beginning(*fresh)
        return committed
