"""aiokafka 0.14.0: an offset reset that meets a stale leader never refreshes the metadata.

A partition whose position is reset asks its leader for offsets (ListOffsets).
`Fetcher._update_fetch_positions` (aiokafka/consumer/fetcher.py) catches the error of
`_proc_offset_request`, logs "Failed fetch offsets", sleeps `retry_backoff_ms` (100 ms) and asks
the same cached leader again: when that broker is no longer the leader (NotLeaderForPartition: a
broker restarted, or the preferred leader took the partition back) nothing refreshes the metadata
(its fetch path and `_retrieve_offsets` do), so the consumer asks the old leader every 100 ms until
the periodic metadata refresh. Found by the three-broker tier: the worker stopped folding for
minutes after leadership moved. No upstream issue found; `patches/offset_reset_stale_leader.patch`
makes `_update_fetch_positions` refresh metadata on an error that says it is stale.

Here: an offset request that fails on stale metadata (``invalid_metadata``, or a node not ready)
asks the client for a metadata update before the error goes on to aiokafka's own handling.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable


def mend(consumer: Any) -> None:
    """Wrap the offset requests of a started aiokafka consumer's fetcher (none: nothing to do)."""
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is not None:
        fetcher._proc_offset_request = refreshing(fetcher, fetcher._proc_offset_request)


def refreshing(fetcher: Any, request: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    from aiokafka.errors import KafkaError, NodeNotReadyError

    async def proc_offset_request(node_id: Any, topic_data: Any) -> Any:
        try:
            return await request(node_id, topic_data)
        except KafkaError as exc:
            if getattr(exc, "invalid_metadata", False) or isinstance(exc, NodeNotReadyError):
                fetcher._client.force_metadata_update()
            raise

    return proc_offset_request
