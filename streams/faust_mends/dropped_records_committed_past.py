"""faust-streaming 0.15.3: records a rebalance dropped from a stream buffer are committed past.

`Consumer._new_offset` (faust/transport/consumer.py) commits the first run of consecutive acked
offsets when it starts at most one past the committed offset (the next one to read): with offset
3 never acked and 4, 5 acked, it commits 6, and record 3 is never processed. A partition's records
are acked in order, so acked offsets past a hole at the head mean the hole's records were dropped
(a rebalance empties the stream buffers): 16 of 333 fatal Xids without a command over 10
failovers. No upstream issue found; `patches/dropped_records_committed_past.patch` makes faust's
`_new_offset` commit nothing and seek the partition back to the hole.

A partition whose dropped records have nothing acked after them shows no hole; on a quiet gpu.xid
partition the next record may be hours away. That half needs to know what was delivered since the
last seek, which only `xidstream.streams.faust_fast`'s drain loop records (``self._delivered``: tp -> offset
of the last record handed to the streams since the last seek), so it is not in the patch file.

Here: a hole at the head commits nothing and reads the partition again from the commit (once per
`REREAD_AFTER_S`); before each commit, a partition read past its commit with nothing acked, no
message of it held and none waiting in a stream buffer is read again from its commit.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

REREAD_AFTER_S = 10.0  # a partition read again from its commit is read again once more after this


class DroppedRecordsCommittedPast:
    """Mixin for faust's `Consumer`; needs ``self._delivered`` (`xidstream.streams.faust_fast.FastConsumer`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._rewound: dict = {}  # tp -> (the committed offset it was last read again from, when)

    def _new_offset(self, tp: Any) -> Any:
        acked = self._acked[tp]
        committed = self._committed_offset[tp]
        if acked and committed is not None and min(acked) > committed:
            self._read_again(tp, committed)
            return None
        return super()._new_offset(tp)

    async def force_commit(self, topics: Any = None, start_new_transaction: bool = True) -> bool:
        self._read_dropped_tails_again()
        return await super().force_commit(topics, start_new_transaction=start_new_transaction)

    def _read_dropped_tails_again(self) -> None:
        """A partition whose records from its committed offset on were delivered (its read offset
        is past the commit) but are neither acked nor held anywhere (no live message of it, none
        waiting in a stream buffer) lost them in a rebalance, like a hole at the head; with
        nothing acked after them there is no hole to see. Read them again now."""
        pending = None
        for tp, read in list(self._delivered.items()):
            committed = self._committed_offset[tp]
            if read is None or committed is None or read < committed or self._acked.get(tp):
                continue
            if not self.app.topics.acks_enabled_for(tp.topic):
                continue
            if pending is None:
                pending = {m.tp for m in list(self._unacked_messages)}
            if tp not in pending and not self._queued(tp):
                self._read_again(tp, committed)

    def _queued(self, tp: Any) -> bool:
        """An event of `tp` still waits in a stream buffer: delivered, not yet taken by its agent,
        so neither acked nor tracked (taken for lost, 45 needless re-reads in 90 s)."""
        for channel in getattr(self.app.topics, "_tp_index", {}).get(tp, ()):
            if any(event.message.tp == tp for event in list(channel.queue._queue)):
                return True
        return False

    def _read_again(self, tp: Any, committed: int) -> None:
        last = self._rewound.get(tp)
        now = time.monotonic()
        if last is not None and last[0] == committed and now - last[1] < REREAD_AFTER_S:
            return  # already being read again
        self._rewound[tp] = (committed, now)
        self.log.warning("%s: offsets from %d were never processed (dropped in a rebalance?); "
                         "reading them again", tp, committed)
        asyncio.ensure_future(self.seek(tp, committed))
