"""Mends of upstream defects in faust-streaming 0.15.3 and aiokafka 0.14.0, one module per defect.

Each module's docstring names the defect (where it is in upstream's code, how it showed here, the
upstream issue where one is known); `patches/<module>.patch` is the same fix as a unified diff
against the pinned upstream file (``patch -p1`` in site-packages), ready to send upstream; and
tests/streams/test_faust_mends.py shows each defect on plain upstream code (so a test fails,
naming the module to remove, once an upgrade fixes it) and that each patch still applies.

`xidstream.streams.faust_fast` composes them into the worker's consumer: the faust mends are mixins of
`FastConsumer` / `FastConsumerThread`, the aiokafka ones mend a started aiokafka consumer
(`mend_aiokafka`). Nothing here registers anything on import.
"""

from __future__ import annotations

MODULES = (
    "offset_reset_stale_leader",  # aiokafka
    "offset_fetch_group_error",  # aiokafka
    "seek_on_consumer_thread",  # faust
    "never_committed_from_beginning",  # faust
    "livelock_check_without_position",  # faust
    "fetch_across_rebalance",  # faust
    "gap_offsets_acked_twice",  # faust
    "dropped_records_committed_past",  # faust
)
