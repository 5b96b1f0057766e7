"""faust-streaming 0.15.3: a fetch that spans a rebalance takes every partition's records and
drops them, changelog records table recovery waits for included.

faust hands aiokafka's `Fetcher.fetched_records(partitions, ...)` its live set of active partitions
(`AIOKafkaConsumerThread._fetch_records`, faust/transport/drivers/aiokafka.py). aiokafka takes an
empty set for "every partition" (``if partitions and tp not in partitions``), and a rebalance
empties faust's set (revoked, then every partition paused while the tables recover) while a fetch
from before it still waits: faust checks the set is not empty before it fetches
(`Consumer._wait_next_records`), not after. That fetch then took every partition's records, the
changelog partitions table recovery had just sought included, and faust's `Consumer.getmany`
dropped them (flow stopped, or a new consumer generation); nothing reads them again, and recovery
waited for them for good (failover bench: the survivor's stall, 3 of about 80 kills). No upstream
issue found (faust-streaming issue #74 is an older hang of the same recovery);
`patches/fetch_across_rebalance.patch` keeps an empty live set from meaning "all" and seeks what
such a fetch returns back to its first record.

Here: the partitions a fetch asks for are the live set, never "none" (`Wanted`); what a fetch
returns after the flow stopped or the generation changed is put back (each partition sought to its
first record, on aiokafka's thread right after the fetch: nothing has moved them since).
"""

from __future__ import annotations

from typing import Any


class Wanted:
    """faust's live set of active partitions as the partitions a fetch asks for: never empty to
    aiokafka (an empty set would mean every partition), and still live (a partition paused during
    the fetch is not taken)."""

    __slots__ = ("live",)

    def __init__(self, live: Any) -> None:
        self.live = live

    def __bool__(self) -> bool:
        return True

    def __contains__(self, tp: Any) -> bool:
        return tp in self.live


def put_back(consumer: Any, records: dict) -> None:
    """Seek each partition of `records` (aiokafka's, just handed over and not to be delivered) back
    to its first record, so that they are fetched again rather than lost."""
    for tp, batch in records.items():
        if batch:
            try:
                consumer.seek(tp, batch[0].offset)
            except Exception:  # noqa: BLE001 - revoked meanwhile: its next owner reads it from its commit
                pass


class FetchAcrossRebalance:
    """Mixin for faust's `AIOKafkaConsumerThread`."""

    async def _fetch_records(self, consumer: Any, active_partitions: Any, timeout: float | None = None,
                             max_records: int | None = None) -> Any:
        app = self.consumer.app
        generation = app.consumer_generation_id
        records = await super()._fetch_records(consumer, Wanted(active_partitions), timeout=timeout,
                                               max_records=max_records)
        if records and (not self.consumer.flow_active or app.consumer_generation_id != generation):
            put_back(consumer, records)
            return {}
        return records
