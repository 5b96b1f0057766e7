"""faust-streaming 0.15.3: a seek runs on the event loop's thread, inside aiokafka's hand-over.

`ThreadDelegateConsumer._seek` (faust/transport/consumer.py) calls ``self._thread.seek(...)``
directly, so aiokafka's `AIOKafkaConsumer.seek` runs on the event loop's thread while aiokafka's
own thread (faust's consumer thread) may be in the middle of `Fetcher.fetched_records` for that
partition: it then met a partition the seek had just removed (a KeyError that stopped a worker,
latency bench), or set the position past the seek's offset as it handed a batch over (records
skipped). Every other call into the aiokafka consumer goes through `call_thread`. No upstream
issue found; `patches/seek_on_consumer_thread.patch` makes `_seek` hop to the consumer thread.

Here: the seek runs on aiokafka's thread (`call_thread`), between two of its steps. So never call
`seek` from aiokafka's thread: it would wait there for itself.
"""

from __future__ import annotations

from typing import Any


class SeekOnConsumerThread:
    """Mixin for faust's aiokafka `Consumer` (a `ThreadDelegateConsumer`)."""

    async def _seek(self, partition: Any, offset: int) -> None:
        await self._thread.call_thread(self._seek_on_thread, partition, offset)

    async def _seek_on_thread(self, partition: Any, offset: int) -> None:
        self._thread._ensure_consumer().seek(partition, offset)
