"""faust-streaming 0.15.3: offsets of a gap that are read after all are acked twice, and the
commits of that partition crawl.

`Consumer._new_offset` (faust/transport/consumer.py) adds the offsets of a gap (offsets faust
never saw: compacted away, or records fetched before a rebalance's seek) to the partition's acked
list without marking them in `_acked_index`; a record of that range read later is acked once more.
With every offset in the list twice, its first run of consecutive offsets is one or two long, and
the partition's commits advanced one offset per commit interval (12 minutes to commit 272 records
after a failover). No upstream issue found; `patches/gap_offsets_acked_twice.patch` keeps each
offset once in `_new_offset`.

Here: before faust's `_new_offset`, the gap's spans below the highest acked offset are moved into
the acked list, and the list is made one of distinct offsets.
"""

from __future__ import annotations

from typing import Any


class GapOffsetsAckedTwice:
    """Mixin for faust's `Consumer` (before `DroppedRecordsCommittedPast` in the MRO, as the hole
    at the head is judged on the list of distinct offsets)."""

    def _new_offset(self, tp: Any) -> Any:
        acked, gap = self._acked[tp], self._gap[tp]
        if acked and gap:
            top = max(acked)
            spans = sorted(gap.overlap(0, top), key=lambda iv: iv.begin)
            if spans:
                acked.extend(o for iv in spans for o in range(iv.begin, iv.end))
                gap.chop(0, max(spans[-1].end - 1, top + 1))
        if len(acked) > 1:
            unique = sorted(set(acked))
            if len(unique) != len(acked):
                acked[:] = unique
        return super()._new_offset(tp)
