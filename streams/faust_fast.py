"""Cuts in faust's per-message machinery, and fixes to its offset bookkeeping. The cuts were
measured on the profile of a worker catching up (py-spy, 2,000 GPUs x 60 s of samples and
process lists); each keeps faust's behaviour and is only what the processor needs. Written for
faust-streaming 0.15.x (pinned in pyproject.toml): `FastConsumer._drain_messages` follows
`faust.transport.consumer.Consumer`'s.

- `FastConsumer`: faust hands every fetched message to the conductor through
  ``Service.wait_first(callback(message), suspend_flow.wait())``, which creates two tasks and runs
  ``asyncio.wait`` per message, so that a rebalance can abandon a delivery blocked on a full
  stream buffer. Almost every delivery finishes without waiting; `deliver` runs it to its first
  wait inline and races only a delivery that does wait, as faust does. (About a third of the
  worker's CPU per message went to the two tasks.)
- `FastConsumer._drain_messages` (direct delivery): a message of a partition whose one channel
  takes raw bytes (the input topics) becomes its event and goes into that channel's queue right in
  the drain loop, with the checks the conductor's delivery makes (flow control, the producer's
  buffer, a free slot); anything else still goes through the conductor. With `ack_events` below,
  the worker's CPU from start to lag 0 fell from 7.8 to 5.95 s (2,000 GPUs x 60 s, two runs each).
- `DELIVER_BETWEEN_TURNS`: the drain loop delivers a whole fetch before the agent's turn, so the
  agent folds it while aiokafka's thread parses the next one, instead of idling through each fetch.
- `FastConsumer.ack_events`: a batch's acks in one pass under faust's ack lock, the steps of
  `Event.ack` per event (which takes the lock three times per event).
- `RawSchema`: the input topics carry bytes that the agents decode themselves (schemas.codec);
  faust's schema still ran each key and value through its serializer registry (``raw`` codec,
  settings look-ups, error wrapping) per message. This one hands the message's bytes over.
- `FastConsumer.on_buffer_full`: faust took a partition out of the fetch while its stream buffer
  was under pressure, and the next fetch waited its timeout for the other, quiet partitions.
- `take_batches`: the agents' batches straight from their channel's queue, instead of faust's
  `take_events` (a loop turn, a processor and an ack through the stream per event).
- `drop_monitor`: faust's Monitor sensor keeps per-event statistics for faust's own web views,
  which this worker does not serve (it has ``/metrics``); the sensor calls cost per event.

The fixes (failover bench), all in `FastConsumer`: a partition the group never committed
is read from its beginning after a rebalance (`seek_to_committed`); a record missing at the head of
a partition, or dropped with nothing after it, is read again instead of committed past
(`_new_offset`, `force_commit`); records fetched before a seek of their partition are not
delivered after it, where faust took the offsets they jumped over for a gap and committed past
them (`_drain_messages`); gap offsets are kept once, so commits do not stall; a table recovery that
waits for changelog records aiokafka has already read past reads them again (`_watch_recovery`);
and, the cause of that wait (`FastConsumerThread`), a fetch from before a rebalance no longer takes
every partition's records once faust's set of active partitions is empty, and what a fetch returns
after the flow stopped is put back, not dropped. A seek runs on aiokafka's thread (`_seek`), never
from the event loop's thread in the middle of aiokafka's hand-over of that partition's records.

`mend_aiokafka` (three-broker tier: the worker stopped folding for minutes after leadership moved),
on each consumer `FastConsumerThread` starts: an offset reset that meets a stale leader refreshes
metadata (aiokafka's `Fetcher._update_fetch_positions` asked the old leader every 100 ms), and an
OffsetFetch answered with a group-level error (a coordinator that moved) is that retriable error,
where aiokafka read it as "nothing committed" for every partition.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Mapping

from aiokafka.structs import TopicPartition
from faust import Schema, Sensor
from faust.transport.consumer import CONSUMER_FETCHING, ensure_TP
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types.tuples import ConsumerMessage, ack_lock
from mode import Service
from mode.utils.futures import maybe_async, notify

__all__ = ["FastTransport", "FastConsumer", "RawSchema", "deliver", "wait_for_room", "take_batches", "BatchWatch",
           "BATCHES", "IdempotentProducer", "faster_transport", "drop_monitor", "faust_drift", "WRITTEN_FOR", "MIRRORED",
           "mend_aiokafka"]


_UNKNOWN = object()

# -- what the cuts were written against ---------------------------------------------------------
# The versions, and a digest (sha256 of the source, 12 hex) of each faust, aiokafka-driver and mode
# function this module overrides or mirrors: on an upgrade `faust_drift()` names each one that
# changed, so its counterpart here is re-read against the new code (docs/development.md) before the
# digest is updated. The worker logs the drift at start; tests/streams/test_faust_version.py fails.
WRITTEN_FOR = {"faust-streaming": "0.15.3", "aiokafka": "0.14.0"}
MIRRORED = {
    "faust.transport.drivers.aiokafka.Consumer._new_consumer_thread": "0870ec53dea7",
    "faust.transport.consumer.Consumer.on_buffer_full": "c8961679e0bc",
    "faust.transport.consumer.Consumer.perform_seek": "0e8c130ff4b0",
    "faust.transport.consumer.ThreadDelegateConsumer._seek": "4f95c6314204",
    "faust.transport.consumer.Consumer.seek": "b86a9fe05f95",
    "faust.transport.consumer.Consumer._drain_messages": "44a2500309e8",
    "faust.transport.drivers.aiokafka.Consumer.verify_event_path": "a17e8f0610e1",
    "faust.transport.consumer.ThreadDelegateConsumer.seek_to_committed": "f1d483b861b0",
    "faust.transport.consumer.Consumer._new_offset": "1d2c7ea89a7a",
    "faust.transport.consumer.Consumer.force_commit": "cc094614d22c",
    "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread._fetch_records": "39a2c6c79fc1",
    "faust.transport.drivers.aiokafka.Transport.Consumer": "959f899e8ebf",  # the whole driver consumer class
    "faust.transport.consumer.Consumer.ack": "5fcf41cf4515",  # ack_events does its steps per event
    "faust.transport.drivers.aiokafka.Producer._settings_extra": "a4c7bc41b638",  # IdempotentProducer extends it
    "faust.events.Event.ack": "2d29a6eda87c",
    "faust.streams.Stream.take_events": "607d48aead11",  # take_batches replaces it
    "mode.services.Service.wait_first": "feade6a31f8a",  # deliver races as it does
    "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread.on_start": "38b4e8bd1e10",  # mend_aiokafka after it
    # mend_aiokafka: what the two fixes wrap, and the code that needed them
    "aiokafka.consumer.fetcher.Fetcher._update_fetch_positions": "d7774d8241dc",
    "aiokafka.consumer.fetcher.Fetcher._proc_offset_request": "40c09472da94",
    "aiokafka.consumer.group_coordinator.GroupCoordinator._do_fetch_commit_offsets": "b0f359813271",
    "aiokafka.consumer.group_coordinator.GroupCoordinator._send_req": "fa4b12e914ce",
}
# faust Consumer attributes the cuts read or write directly
CONSUMER_ATTRIBUTES = ("_read_offset", "_committed_offset", "_n_acked", "_acked", "_acked_index", "_unacked_messages",
                       "_gap", "_waiting_for_ack", "_commit_every", "_active_partitions")


def _resolve(path: str) -> Any:
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return obj


def faust_drift() -> list[str]:
    """What differs from what the cuts were written for, one sentence each; [] when nothing."""
    import hashlib
    import inspect
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist, wanted in WRITTEN_FOR.items():
        try:
            have = version(dist)
        except PackageNotFoundError:
            have = "not installed"
        if have != wanted:
            out.append(f"{dist} is {have}; streams/faust_fast.py was written for {wanted}")
    for path, digest in MIRRORED.items():
        try:
            got = hashlib.sha256(inspect.getsource(_resolve(path)).encode()).hexdigest()[:12]
        except (AttributeError, ImportError, OSError, TypeError) as exc:
            out.append(f"{path} is gone ({type(exc).__name__}: {exc})")
            continue
        if got != digest:
            out.append(f"{path} changed (source digest {got}, written against {digest})")
    import faust.transport.consumer as fc

    source = inspect.getsource(fc)
    out += [f"faust's Consumer no longer uses self.{a}" for a in CONSUMER_ATTRIBUTES if f"self.{a}" not in source]
    return out


class _RestOf:
    """The remainder of a coroutine that already ran up to its first wait on `pending`, as an
    awaitable a task can drive (sends, throws and cancellation pass through to the coroutine)."""

    __slots__ = ("coro", "pending")

    def __init__(self, coro: Coroutine, pending: Any) -> None:
        self.coro, self.pending = coro, pending

    def __await__(self):  # type: ignore[no-untyped-def]
        coro, pending = self.coro, self.pending
        try:
            while True:
                try:
                    sent = yield pending
                except BaseException as exc:  # noqa: BLE001 - the task's throw (cancellation) goes on to coro
                    pending = coro.throw(exc)
                else:
                    pending = coro.send(sent)
        except StopIteration as stop:
            return stop.value


async def deliver(coro: Coroutine, suspend: asyncio.Event,
                  wait_first: Callable[..., Awaitable[Any]]) -> None:
    """Run `coro` (the conductor's delivery of one message) inline; if it has to wait, finish it
    racing `suspend` (a rebalance) through `wait_first`, exactly as faust does for every message."""
    try:
        pending = coro.send(None)
    except StopIteration:
        return
    except BaseException:
        coro.close()
        raise
    await wait_first(_RestOf(coro, pending), suspend.wait())


async def wait_for_room(queues: Any, suspend: asyncio.Event) -> None:
    """Until every queue in `queues` is at most half full, or a rebalance begins. A stream buffer
    stays full while the agent is behind (a catch-up): one wait here lets half a buffer of
    messages through `deliver`'s inline path, instead of one raced delivery per message. Polled
    every millisecond: the agent draining the buffer is what is awaited, and it needs the time."""
    for queue in queues:
        while queue.qsize() > queue.maxsize // 2 and not suspend.is_set():
            await asyncio.sleep(0.001)


class BatchWatch:
    """Which batches an agent's body holds, and since when (monotonic s): the worker's liveness.

    A worker can wedge with its web server still answering: on 1484261 a send that could not
    complete left the GPU agent inside its body, no record folded, `/metrics` answering, so a
    probe on `/metrics` passed. Live means every batch handed to a body came back
    within `stall_s`; an idle worker holds none and is live."""

    def __init__(self) -> None:
        self._since: dict[int, tuple[float, int, str]] = {}

    def begin(self, key: int, size: int, name: str, now: float | None = None) -> None:
        self._since[key] = (time.monotonic() if now is None else now, size, name)

    def end(self, key: int) -> None:
        self._since.pop(key, None)

    def stalled(self, stall_s: float, now: float | None = None) -> str | None:
        """Why the worker is not live (the oldest batch held past `stall_s`), or None."""
        now = time.monotonic() if now is None else now
        if not self._since:
            return None
        began, size, name = min(self._since.values())
        if now - began <= stall_s:
            return None
        return f"stalled: agent {name} has held a batch of {size} record(s) for {now - began:.0f} s (limit {stall_s:g} s)"


BATCHES = BatchWatch()  # the process's agents (one faust app per worker process)


async def take_batches(stream: Any, max_: int, within: float, watch: BatchWatch = BATCHES) -> AsyncIterator[list]:
    """Lists of up to `max_` events from `stream`'s channel, for an agent that folds a batch at a
    time: faust's `Stream.take_events` without its per-event machinery. faust's runs every event
    through the stream's iterator (a turn of the event loop per event, sensors, a processor that
    fills the batch, a background task that drains the stream) and acks each through the stream;
    those were about a third of the worker's CPU per record (the catch-up profile). Here a batch is
    what the channel's queue holds, taken at once, topped up for up to `within` s after its first
    event while it is short of `max_`; when the stream stops, the events taken so far are handed
    over, as faust's are. The stream's processors run on each event as it is taken, for their
    effect only (a worker's agents have none; `agent.test_context()` counts events with one).

    Each event is acked (the same `Event.ack` faust's stream calls; the agents' streams have no
    sensors to tell) once the loop body that took the batch has run, and not when the body raised:
    faust's acks the batch in a ``finally``, so a batch that failed half way could be committed
    past and lost; here the worker stops (`guarded`) and its records are read again."""
    channel = aiter(stream.channel)  # app.stream made the stream's channel the conductor's iterator
    queue = channel.queue
    get_nowait, empty, get = queue.get_nowait, queue.empty, channel.__anext__
    processors = stream._processors
    app = stream.app
    flow_active, acking_topics = app.flow_control.is_active, app.topics._acking_topics
    track = app.consumer._unacked_messages.add
    ack_all = getattr(app.consumer, "ack_events", None) or _ack_each
    loop = asyncio.get_running_loop()
    stopping = asyncio.ensure_future(stream._stopped.wait())
    label = getattr(stream, "shortlabel", "") or str(getattr(stream, "channel", "?"))  # for /livez, once

    ended = False

    async def next_event(timeout: float | None) -> Any:
        """The next event, or None after `timeout` s or once the stream ends. Only when the queue
        is empty: a cancelled queue get leaves its item queued."""
        nonlocal ended
        getter = asyncio.ensure_future(get())
        try:
            done, _ = await asyncio.wait((getter, stopping), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter not in done:
            return None
        try:
            return getter.result()
        except StopAsyncIteration:  # faust's end of a stream, thrown into its channel
            ended = True
            return None

    def next_queued() -> Any:
        nonlocal ended
        try:
            return get_nowait()
        except StopAsyncIteration:
            ended = True
            return None

    def wanted(event: Any) -> bool:
        """What faust's stream iterator does as it takes an event: one fetched before the latest
        rebalance (another consumer generation) is dropped, not processed (its partition is read
        again from its commit, by whoever owns it now); the message of any other is tracked as
        unacked until its ack, which the rebalance (`wait_empty`) and `_read_dropped_tails_again`
        go by (untracked, a batch's records looked dropped and were read again)."""
        message = event.message
        if not flow_active() or message.generation_id != app.consumer_generation_id:
            return False
        if message.topic in acking_topics and not message.tracked:
            message.tracked = True
            track(message)
        return True

    async def took(event: Any) -> Any:
        for processor in processors:
            await maybe_async(processor(event.value))
        return event

    try:
        while not (ended or stream.should_stop):
            first = next_queued() if not empty() else await next_event(None)
            if first is None or not wanted(first):
                continue
            batch = [await took(first) if processors else first]
            deadline = loop.time() + within
            while len(batch) < max_ and not ended:
                event = next_queued() if not empty() else (
                    await next_event(deadline - loop.time()) if deadline > loop.time() and not stream.should_stop else None)
                if event is None:
                    break
                if wanted(event):
                    batch.append(await took(event) if processors else event)
            watch.begin(id(stream), len(batch), label)
            yield batch
            watch.end(id(stream))
            ack_all(batch)
    finally:
        watch.end(id(stream))
        stopping.cancel()


def _ack_each(events: list) -> None:
    for event in events:
        event.ack()


REREAD_AFTER_S = 10.0  # a partition read again from its commit is read again once more after this
# Table recovery: an active changelog partition that aiokafka has read past the last record recovery
# received, and that gave recovery nothing for this long, lost those records on their way (see
# `FastConsumer._watch_recovery`). Records flow within milliseconds while a recovery reads; 3 s is
# well clear of that and keeps a failover inside the goal of 10 s (6 s session timeout +
# recovery). A partition read again and stalled again at the same offset waits twice as long each
# time (a partition whose last offset holds no record, e.g. a transaction marker, also never
# completes in faust; this keeps that from a warning every few seconds).
RECOVERY_STALL_S = 3.0


# Messages the drain loop delivers before it gives the event loop a turn (faust: 100). With 100 the
# agent took each hundred as it came and had emptied the stream buffer by the time the drain loop
# waited for its next fetch (aiokafka's thread parsing the next 2,000 records, ~6 ms): the main
# thread idled through every fetch, 0.74-0.82 cores in a catch-up. With a whole fetch delivered
# (`xidstream.streams.app.MAX_POLL_RECORDS`) the agent folds it while the next one is parsed: 0.94 cores,
# 43-46k instead of 33-37k records/s (2,000 GPUs x 60 s, two runs each). The loop is held
# for ~5 ms per fetch of input records (direct delivery), longer for a fetch of 2,000 changelog or
# fleet records through the conductor (table recovery, a backlog); heartbeats run on aiokafka's own
# thread.
DELIVER_BETWEEN_TURNS = 2000


class _Wanted:
    """The partitions a fetch asks aiokafka for: faust's live set of active partitions, except that
    it is never "none". aiokafka's `Fetcher.fetched_records(partitions)` takes an empty set for
    "every partition" (``if partitions and tp not in partitions``), and faust hands it its live set,
    which a rebalance empties (revoked, then every partition paused while the tables recover) while
    a fetch from before it still waits. That fetch then took every partition's records, the
    changelog partitions table recovery had just sought included; faust dropped them (flow stopped)
    and recovery waited for them for good (failover bench: the survivor's stall)."""

    __slots__ = ("live",)

    def __init__(self, live: Any) -> None:
        self.live = live

    def __bool__(self) -> bool:
        return True

    def __contains__(self, tp: Any) -> bool:
        return tp in self.live


def _put_back(consumer: Any, records: dict) -> None:
    """Seek each partition of `records` (aiokafka's, just handed over and not to be delivered) back
    to its first record, so that they are fetched again rather than lost. On aiokafka's thread,
    right after the fetch that returned them: nothing has moved those partitions since."""
    for tp, batch in records.items():
        if batch:
            try:
                consumer.seek(tp, batch[0].offset)
            except Exception:  # noqa: BLE001 - revoked meanwhile: its next owner reads it from its commit
                pass


# -- aiokafka 0.14's consumer, mended --------------------------------------------------------------
# Found by the three-broker tier (a leader SIGKILLed, a rolling restart): the worker stopped folding
# for minutes after leadership moved. Applied per consumer, on its instance, by FastConsumerThread.
_GROUP_ERRORS = {14, 15, 16}  # COORDINATOR_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR
_OFFSET_FETCH = 9  # the OffsetFetch API key


def mend_aiokafka(consumer: Any) -> None:
    """Two fixes to a started aiokafka consumer (its fetcher and group coordinator).

    - A partition whose position is reset asks its leader for offsets (ListOffsets). When the
      cached leader is no longer the leader (NotLeaderForPartition: a broker restarted, or the
      preferred leader took the partition back), `Fetcher._update_fetch_positions` logs it, waits
      100 ms and asks the same broker again, never refreshing metadata (its fetch path and
      `_retrieve_offsets` do): the worker asked the old leader every 100 ms for minutes, until the
      periodic metadata refresh. Now an offset request that fails on stale metadata refreshes it.
    - OffsetFetch v2 and later carry a group-level error at the top of the response, with no
      partitions (a coordinator that moved answers NOT_COORDINATOR so). aiokafka reads only the
      partitions, so it took "no committed offset" for every partition, and they were read again
      from their beginning (or the reset sent them to ListOffsets, above); a partition-level
      COORDINATOR_NOT_AVAILABLE it raised as a non-retriable error. Now both mark the coordinator
      dead (a load in progress does not) and raise the retriable group error, which
      `fetch_committed_offsets` retries against the coordinator it finds again."""
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is not None:
        fetcher._proc_offset_request = _refreshing_offsets(fetcher, fetcher._proc_offset_request)
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is not None:
        coordinator._send_req = _group_errors_raised(coordinator, coordinator._send_req)


def _refreshing_offsets(fetcher: Any, request: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    from aiokafka.errors import KafkaError, NodeNotReadyError

    async def proc_offset_request(node_id: Any, topic_data: Any) -> Any:
        try:
            return await request(node_id, topic_data)
        except KafkaError as exc:
            if getattr(exc, "invalid_metadata", False) or isinstance(exc, NodeNotReadyError):
                fetcher._client.force_metadata_update()
            raise

    return proc_offset_request


def _group_errors_raised(coordinator: Any, send: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    from aiokafka.errors import for_code

    async def send_req(request: Any) -> Any:
        response = await send(request)
        if getattr(response, "API_KEY", None) != _OFFSET_FETCH:
            return response
        top = getattr(response, "error_code", 0)
        codes = [top] + [part[-1] for _, parts in response.topics for part in parts]
        group = next((c for c in codes if c in _GROUP_ERRORS), None)
        if group is not None:
            if group != 14:  # a coordinator loading its offsets is still the coordinator
                coordinator.coordinator_dead()
            raise for_code(group)()
        if top:  # any other group-level error (GROUP_AUTHORIZATION_FAILED): never "nothing committed"
            raise for_code(top)()
        return response

    return send_req


class FastConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    async def on_start(self) -> None:
        await super().on_start()
        mend_aiokafka(self._consumer)

    async def _fetch_records(self, consumer: Any, active_partitions: Any, timeout: float | None = None,
                             max_records: int | None = None) -> Any:
        # A fetch waits up to its timeout, and a rebalance can begin and end meanwhile (aiokafka
        # holds a fetch over the reassignment). faust drops what such a fetch returns: the stream
        # partitions are sought to their commits afterwards, but a changelog partition table
        # recovery sought in the meantime is not, and its records were gone for that recovery. They
        # are put back instead.
        app = self.consumer.app
        generation = app.consumer_generation_id
        records = await super()._fetch_records(consumer, _Wanted(active_partitions), timeout=timeout,
                                               max_records=max_records)
        if records and (not self.consumer.flow_active or app.consumer_generation_id != generation):
            _put_back(consumer, records)
            return {}
        return records


class FastConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> Any:
        return FastConsumerThread(self, loop=self.loop, beacon=self.beacon)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._rewound: dict = {}  # tp -> (the committed offset it was last read again from, when)
        # tp -> offset of the last record handed to the streams since the last seek (faust's read
        # offset cannot tell: a seek sets it to the next offset to read, a delivery to the last read)
        self._delivered: dict = {}
        # Seeks so far: tp -> count for one partition's (`seek`), None -> count for every
        # partition's (`perform_seek`). Each is counted as it begins and as it ends, so a fetch
        # that overlapped a seek in any way is seen as older than it (`_drain_messages`).
        self._seeks: dict = {}
        self._seeks_total = 0  # all of them: the drain loop's one comparison per record
        self._seek_done: asyncio.Event | None = None  # set when the newest perform_seek ends

    def _partition_state(self, tp: Any) -> Any:
        """aiokafka's state of `tp` (its position, ...); None when it is not assigned."""
        subscription = self._thread._ensure_consumer()._fetcher._subscriptions.subscription
        if subscription is None:
            return None
        return subscription.assignment.state_value(TopicPartition(tp.topic, tp.partition))

    def _positions(self, tps: Any) -> dict:
        """aiokafka's next offset to fetch for each of `tps` that has a valid one. Read on the event
        loop's thread while aiokafka's thread writes it: a check that tolerates a stale value, and
        `_seek_if_stalled` checks it again on aiokafka's thread before it acts."""
        out = {}
        for tp in tps:
            # the attribute: `.position` asserts it is valid
            position = getattr(self._partition_state(tp), "_position", None)
            if position is not None:
                out[tp] = position
        return out

    @Service.task
    async def _watch_recovery(self) -> None:
        """Table recovery that waits for changelog records aiokafka has already handed over.

        In 3 of about 80 failover kills (failover bench, start-up and rebalance kills) the survivor's
        recovery read nothing for good: faust logged "No event received for active tp ... since
        recovery start" for every changelog partition, while aiokafka's position of each was at the
        partition's end (in-process sampler, seed 77 run 2): the records were fetched and never
        reached recovery's queue, and nothing reads a changelog partition again once its position
        is past them. The worker then processed nothing (80 fatal Xids without a command in 40 s).
        The cause, found with this watch in place (it fired in 2 of 16 kills and the survivors went
        on after 13 s): a fetch from before the rebalance took those records and faust dropped
        them (`FastConsumerThread`, fixed). The watch stays, for any other way to lose them: faust's
        recovery has had hangs of this kind before (faust-streaming issue #74, a full stream buffer
        during recovery). The partition is sought back to the last record recovery received
        (recovery's own seek goes there too; recovery skips that one record as seen) and read
        again."""
        progress: dict = {}  # tp -> (last offset recovery received, since when, the wait before a seek)
        watched_generation = None
        while not self.should_stop:
            await self.sleep(1.0)
            try:
                generation = self.app.consumer_generation_id
                if generation != watched_generation:  # a rebalance: a new recovery, new clocks
                    progress.clear()
                    watched_generation = generation
                stalled = self._stalled_recovery(progress, time.monotonic())
                if stalled:
                    sought = await self._thread.call_thread(self._seek_if_stalled, stalled, generation)
                    if sought:
                        now = time.monotonic()
                        self.log.warning("table recovery: changelog records were fetched but never reached "
                                         "recovery (stalled); reading them again: %s", ", ".join(
                                             f"{tp.topic}[{tp.partition}] from {offset} (nothing for "
                                             f"{now - progress[tp][1]:.0f} s)" for tp, offset in sorted(sought.items())))
                        for tp in sought:  # the same offset stalling again waits twice as long
                            applied, _, wait = progress[tp]
                            progress[tp] = (applied, now, 2 * wait)
            except Exception as exc:  # noqa: BLE001 - a check that fails must not stop the worker; next second
                self.log.warning("table recovery watch: %r", exc)

    async def _seek_if_stalled(self, stalled: dict, generation: int) -> dict:
        """On aiokafka's thread: seek each of `stalled` (tp -> offset) that is still as it was
        judged (same consumer generation, still in recovery, position still past the offset + 1),
        the way faust's own `seek_wait` does; what was sought. Judged on the event loop's thread,
        a seek that lands after a rebalance would skip records of the next recovery."""
        recovery = getattr(self.app.tables, "_recovery", None)
        if self.app.consumer_generation_id != generation or recovery is None or not recovery.in_recovery:
            return {}
        consumer = self._thread._ensure_consumer()
        sought = {}
        for tp, offset in stalled.items():
            position = getattr(self._partition_state(tp), "_position", None)  # None: revoked meanwhile
            if position is None or position <= offset + 1:
                continue
            consumer.seek(TopicPartition(tp.topic, tp.partition), offset)
            if offset > 0:
                self._read_offset[tp] = offset
            else:
                self._read_offset.pop(tp, None)
            sought[tp] = offset
        return sought

    def _stalled_recovery(self, progress: dict, now: float) -> dict:
        """The active changelog partitions (tp -> offset to seek) of a recovery that is reading
        (flow on, the partition fetched) whose received offset stood still for its wait
        (`RECOVERY_STALL_S`, doubled after each seek at that offset) while aiokafka's position is
        past the next record; none while records wait in recovery's queue."""
        recovery = getattr(self.app.tables, "_recovery", None)
        if recovery is None or not recovery.in_recovery or not self.flow_active:
            return {}
        if self.app.tables.changelog_queue.qsize():
            for tp, (applied, _, wait) in progress.items():  # events on their way: progress
                progress[tp] = (applied, now, wait)
            return {}
        fetching = self._active_partitions or set()
        watched = {tp for tp in recovery.active_tps if tp in fetching}
        positions = self._positions(watched)
        stalled = {}
        for tp in watched:
            applied, high = recovery.active_offsets.get(tp), recovery.active_highwaters.get(tp)
            if applied is None or high is None or applied >= high:
                continue
            seen = progress.get(tp)
            if seen is None or seen[0] != applied:
                progress[tp] = (applied, now, RECOVERY_STALL_S)
                continue
            position = positions.get(tp)
            if now - seen[1] >= seen[2] and position is not None and position > applied + 1:
                stalled[tp] = max(applied, 0)
        return stalled

    def on_buffer_full(self, tp: Any) -> None:
        """faust's takes `tp` out of the fetch while its stream buffer is 80% full, until the
        buffer is empty; the next fetch then asks for the other partitions alone (a catch-up's
        quiet gpu.xid, gpu.workloads, ...) and waits up to its 1 s timeout, while the agent empties
        the buffer and idles: a third of the main thread's time in the catch-up profile. A full
        buffer is held back by the drain loop itself (`wait_for_room`), so every assigned
        partition stays in the fetch."""

    def _count_seek(self, tp: Any) -> None:
        self._seeks[tp] = self._seeks.get(tp, 0) + 1
        self._seeks_total += 1

    async def perform_seek(self) -> None:
        self._count_seek(None)
        self._delivered.clear()
        done = self._seek_done = asyncio.Event()
        try:
            await super().perform_seek()
        finally:
            self._count_seek(None)
            done.set()

    async def _seek(self, partition: Any, offset: int) -> None:
        # faust calls aiokafka's seek from the event loop's thread while aiokafka's own thread may be
        # handing out that partition's fetched records: its `fetched_records` then met a partition
        # the seek had just removed (a KeyError that stopped a worker, latency bench), or set the
        # position past the seek's offset as it handed over a batch. On aiokafka's thread, a seek
        # runs between two of its steps, never inside one.
        # (So never `seek` from aiokafka's thread: it would wait there for itself.)
        await self._thread.call_thread(self._seek_on_thread, partition, offset)

    async def _seek_on_thread(self, partition: Any, offset: int) -> None:
        self._thread._ensure_consumer().seek(partition, offset)

    async def seek(self, partition: Any, offset: int) -> None:
        self._count_seek(partition)
        self._delivered.pop(partition, None)
        # The read offset faust sets once the seek is done, set before it too: the seek waits for
        # its hop to aiokafka's thread (`_seek`), and meanwhile the drain loop may skip a stale batch
        # of this partition and seek it to its read offset (`_seek_to_expected`); the old one, read
        # there, undid this seek as it landed second (review of the seek change: a re-read put off
        # by 10 s).
        self._read_offset[ensure_TP(partition)] = offset if offset else None
        try:
            await super().seek(partition, offset)
        finally:
            self._count_seek(partition)

    async def _drain_messages(self, fetcher: Any) -> None:
        # faust 0.15's loop, but one delivery (`deliver`) per message instead of wait_first.
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        set_flag, unset_flag = self.diag.set_flag, self.diag.unset_flag
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for
        suspend_flow = self.suspend_flow
        channels_of = getattr(self.app.topics, "_tp_index", {}).get  # the conductor's tp -> channels
        wait_first = self.wait_first
        delivered = self._delivered
        seeks_get = self._seeks.get
        fetched_after: dict = {}  # the seek counts when the current fetch began

        def sought(tp: Any, topic: str) -> bool:
            """Sought since the current fetch began, and a partition whose commits are guarded."""
            return ((seeks_get(None) != fetched_after.get(None) or seeks_get(tp) != fetched_after.get(tp))
                    and acks_enabled_for(topic))

        app = self.app
        event_cls = app.conf.Event
        flow_active = app.flow_control.is_active
        callback_lock = app.topics._tp_to_callback_lock
        producer_buffer = app.producer.buffer
        # the producer's buffer, whose length `ProducerBuffer.size` gives (after a settings look-up
        # per call); None with a threaded producer, whose buffer is elsewhere: no direct delivery
        producer_pending = None if app.conf.producer_threaded else producer_buffer.pending._queue
        sleep = asyncio.sleep
        num_since_yield = 0
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(CONSUMER_FETCHING)
                # A batch fetched before a seek of its partition is stale: the seek set the read
                # offset to its own offset, and aiokafka reads the partition again from there.
                # faust went on delivering the rest of such a batch (its getmany yields one record
                # at a time, and a seek lands while a delivery, a commit or a full buffer waits),
                # so the next stale record counted as a "gap" after the seek's offset: faust fills
                # gaps as if the records were compacted away, and committed past records it never
                # processed (fatal Xids without a command after a failover, on the fleet
                # partition). Records of a committed (acked) topic sought since the fetch began are
                # skipped, and the partition is sought again, after the batch, to the offset the
                # seek left. Again, because when faust applied a seek from this thread, aiokafka's
                # own thread could be handing this batch over, and the batch's end overwrote the
                # position the seek set. Seeks run on aiokafka's thread now (`_seek`), so this is a
                # guard that costs a seek per stale batch (rare: rebalances and re-reads).
                # (Changelog partitions keep faust's way: table recovery tracks their offsets.)
                fetched_after = dict(self._seeks)
                direct: dict = {}  # tp -> the queue of its one raw channel, or None (`_direct_queue`)
                seeks_at_fetch = self._seeks_total
                skipped: dict = {}
                ait = getmany(timeout=1.0)
                # getmany can be called in a loop that never gives the event loop a turn
                await sleep(0)
                num_since_yield = 0
                if not self.should_stop:
                    async for tp, message in ait:
                        num_since_yield += 1
                        if num_since_yield > DELIVER_BETWEEN_TURNS:
                            await sleep(0)
                            num_since_yield = 0
                        if self._seeks_total != seeks_at_fetch and sought(tp, message.topic):
                            skipped[tp] = None
                            continue
                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is None or offset >= r_offset:
                            # The next offset this partition should give: after the last record
                            # delivered since the last seek, else the seek's own offset (faust's
                            # r_offset + 1 skipped that one, so a record compacted away right at
                            # the commit looked like a hole at the head for ever).
                            expected = r_offset if r_offset is None or tp not in delivered else delivered[tp] + 1
                            if expected is not None and offset > expected and acks_enabled_for(message.topic):
                                self._add_absent(tp, expected, offset - 1)
                            if commit_every is not None and self._n_acked >= commit_every:
                                self._n_acked = 0
                                await self.commit()
                            if suspend_flow.is_set():
                                await wait_first(callback(message), suspend_flow.wait())
                            else:
                                queue = direct.get(tp, _UNKNOWN)
                                if queue is _UNKNOWN:
                                    queue = direct[tp] = self._direct_queue(channels_of(tp, ()))
                                if queue is not None:
                                    if queue.full():
                                        await wait_for_room((queue,), suspend_flow)
                                else:
                                    channels = channels_of(tp, ())
                                    if any(chan.queue.full() for chan in channels):
                                        await wait_for_room([chan.queue for chan in channels], suspend_flow)
                                if self._seeks_total != seeks_at_fetch and sought(tp, message.topic):
                                    skipped[tp] = None  # sought while the commit or the buffer waited
                                    continue
                                if (queue is not None and producer_pending is not None and flow_active()
                                        and not suspend_flow.is_set()
                                        and not callback_lock.locked() and not queue.full()
                                        and len(producer_pending) <= producer_buffer.max_messages):
                                    # the conductor's delivery, for a partition with one raw
                                    # channel: its checks above (it would wait where they fail),
                                    # its incref and RawSchema's event. Not its pressure
                                    # callbacks: they tell `on_buffer_full` (a no-op here) and the
                                    # sensors (faust's Monitor is dropped) of a buffer under
                                    # pressure, which `wait_for_room` handles
                                    message.incref()
                                    queue.force_put_nowait(event_cls(app, message.key, message.value,
                                                                     message.headers, message))
                                else:
                                    await deliver(callback(message), suspend_flow, wait_first)
                            if self._seeks_total != seeks_at_fetch and sought(tp, message.topic):
                                continue  # sought while it was delivered: the read offset is the seek's
                            set_read_offset(tp, offset)
                            delivered[tp] = offset
                    if skipped:
                        await self._seek_to_expected(list(skipped))
                    unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(CONSUMER_FETCHING)

    def ack_events(self, events: list) -> None:
        """`Event.ack` of each of `events`, in one pass: faust's route per event (`Event.ack`,
        `Message.ack`, `ConsumerMessage.on_final_ack`, `Consumer.ack`) takes the ack lock three
        times and looks up the same things each time. The same steps, under the lock once. (They are
        faust's `Event.ack` and `Consumer.ack`: an app whose Event class overrides `ack` would be
        bypassed; this one's is faust's.)"""
        acking = self.app.topics._acking_topics
        committed_offsets, acked_index, acked, unacked = (self._committed_offset, self._acked_index,
                                                          self._acked, self._unacked_messages)
        with ack_lock:
            try:
                for event in events:
                    message = event.message
                    if type(message) is not ConsumerMessage:  # agent.test_context()'s: faust's own way
                        event.ack()
                        continue
                    if message.acked:
                        continue
                    message.refcount = refcount = max(message.refcount - 1, 0)
                    if refcount:
                        continue
                    message.acked = True  # Consumer.ack, for the message's final ack
                    if message.topic not in acking:
                        continue
                    tp, offset = message.tp, message.offset
                    committed = committed_offsets[tp]
                    if committed is None or offset >= committed:
                        index = acked_index[tp]
                        if offset not in index:
                            unacked.discard(message)
                            index.add(offset)
                            acked[tp].append(offset)
                            self._n_acked += 1
            finally:
                notify(self._waiting_for_ack)

    @staticmethod
    def _direct_queue(channels: Any) -> Any:
        """The stream buffer of a partition's one channel (`channels`: the conductor's channels of
        it) when that channel takes raw bytes (`RawSchema`), else None: such a message needs none
        of the conductor's decoding, only its event."""
        if len(channels) != 1:
            return None
        (channel,) = channels
        if not isinstance(getattr(channel, "schema", None), RawSchema):
            return None
        return channel.queue

    def _add_absent(self, tp: Any, first: int, last: int) -> None:
        """Offsets `first`..`last` are not in the partition (compacted away, transaction markers,
        deleted by retention): aiokafka read on from `first` and gave the record after `last`
        next. They count as processed, as faust's gaps do; unlike faust's `_add_gap`, the
        committed offset itself may be one of them (it is the next offset to read, not a read one)."""
        committed = self._committed_offset[tp]
        if committed is not None:
            first = max(first, committed)
        if first <= last:
            gap = self._gap[tp]
            gap.addi(first, last + 1)
            gap.merge_overlaps()

    async def _seek_to_expected(self, tps: list) -> None:
        """Seek each of `tps` to the offset its last seek left: that seek's own offset, or the
        commit a rebalance's seek found (a skipped partition has delivered nothing since). While
        every partition is being sought (a rebalance), that seek is awaited first: until it ends
        a partition's read offset is unknown, not "from the beginning"."""
        done = self._seek_done
        if self._seeks.get(None, 0) % 2 and done is not None:
            try:
                await asyncio.wait_for(done.wait(), timeout=30.0)
            except asyncio.TimeoutError:
                self.log.warning("a rebalance's seek did not end within 30 s; it places %s itself", tps)
                return
        for tp in tps:
            offset = self._read_offset.get(tp)
            if offset is None:
                offset = self._committed_offset.get(tp)
            try:
                if offset is None:  # never committed, nothing read: from its beginning, as seek_to_committed
                    await self._thread.seek_to_beginning(tp)
                else:
                    await self.seek(tp, offset)
            except Exception as exc:  # noqa: BLE001 - revoked meanwhile: its next owner reads it from the commit
                self.log.info("%s: not sought again after a stale fetch: %r", tp, exc)

    def verify_event_path(self, now: float, tp: Any) -> None:
        # faust's livelock check reads aiokafka's position of each partition, and that asserts
        # while a partition waits for its offset reset (`seek_to_committed` below sends a
        # never-committed one to its beginning): the consumer crashed and the survivor of a
        # failover exited (failover bench, a kill during start-up). No position, nothing to check.
        state = self._partition_state(tp)
        if state is not None and not state.has_valid_position:
            return None
        return super().verify_event_path(now, tp)

    async def seek_to_committed(self) -> Any:
        # aiokafka seeks a partition to its committed offset only when that is above 0. One the
        # group never committed keeps the position its fetches had reached: after a rebalance,
        # which drops what faust's stream buffers held, those records were never read again and
        # the next commit went past them (16 of 333 fatal Xids without a command over
        # 10 failovers, on quiet gpu.xid partitions). Such a partition starts at its beginning,
        # as auto.offset.reset=earliest says: nothing of it is known to be processed.
        committed = await super().seek_to_committed()
        # changelog partitions are never committed: table recovery places them itself
        fresh = [tp for tp, offset in committed.items()
                 if (not offset or offset <= 0) and self.app.topics.acks_enabled_for(tp.topic)]
        if fresh:
            await self._thread.seek_to_beginning(*fresh)
        return committed

    def _new_offset(self, tp: Any) -> Any:
        # faust adds the offsets of a gap (offsets it never saw, e.g. compacted away) to the acked
        # list without marking them acked, so a record of that range read later (records fetched
        # before a rebalance's seek) is acked once more: with every offset twice the list's first
        # run of consecutive offsets is one or two long, and the commits of that partition
        # advanced an offset per commit interval (12 minutes to commit 272 records
        # after a failover). Fill the gaps here, then keep each offset once.
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
        # faust commits the first run of consecutive acked offsets when it starts at most one past
        # the committed offset (the next one to read): with offset 3 never acked and 4, 5 acked,
        # it committed 6, and record 3 was never processed (a record a rebalance dropped
        # from the stream buffer; 16 of 333 fatal Xids without a command over 10 failovers). A
        # partition's records are acked in order, so acked offsets past a hole at the head mean
        # the hole's records were dropped: commit nothing, and read them again from there.
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
        nothing acked after them there is no hole to see, and on a quiet `gpu.xid` partition the
        next record may be hours away. Read them again now."""
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


class IdempotentProducer(faust_aiokafka.Producer):
    """faust's aiokafka producer with idempotence always on (faust turns it on only inside a
    transaction, which at-least-once does not use). A send whose answer was lost when its leader
    died (the leader wrote it, then a SIGKILL) is retried to the new leader; without a producer id
    and sequence numbers that retry is written again: the three-broker failover test saw a command
    twice on gpu.remediation with one command_id. acks=all goes with it (aiokafka requires it)."""

    def _settings_extra(self) -> Mapping[str, Any]:
        if processor_acks() == "1":  # measurement only (bench/broker_failover.py): idempotence needs acks=all
            return {**super()._settings_extra(), "acks": 1, "enable_idempotence": False}
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


# Not a setting to run with: `bench/broker_failover.py` sets it to 1 to measure what acks=all costs
# the worker (issue 25 asks for acks=all against acks=1 on the same cluster). With 1, a command or a
# table row a leader acknowledged and then lost with its SIGKILL is gone (docs/operations.md).
PROCESSOR_ACKS_ENV = "XIDSTREAM_PROCESSOR_ACKS"


def processor_acks() -> str:
    """The processor producer's acks: "all" (the default), or "1" when `XIDSTREAM_PROCESSOR_ACKS`
    says so; anything else is refused with what it may be."""
    value = os.environ.get(PROCESSOR_ACKS_ENV, "all").strip().lower()
    if value not in ("all", "1"):
        raise ValueError(f"{PROCESSOR_ACKS_ENV}={value!r}: 'all' (the default) or '1' (for measuring what acks=all "
                         f"costs; a leader's loss can lose acknowledged commands)")
    return value


class FastTransport(faust_aiokafka.Transport):
    Consumer = FastConsumer
    Producer = IdempotentProducer


def faster_transport(app: Any, transport: Any) -> Any:
    """`FastTransport` in place of faust's aiokafka transport; any other transport as it is."""
    if type(transport) is faust_aiokafka.Transport:
        return FastTransport(app.conf.broker_consumer, app)
    return transport


class RawSchema(Schema):
    """Key and value as the bytes on the wire; the agents decode them (schemas.codec)."""

    def compile(self, app: Any, *, on_key_decode_error: Any = None, on_value_decode_error: Any = None,
                default_propagate: bool = False) -> Callable[..., Awaitable[Any]]:
        create_event = app.create_event

        async def decode(message: Any, *, propagate: bool = default_propagate) -> Any:
            return create_event(message.key, message.value, message.headers, message)

        return decode


class _QuietSensor(Sensor):
    """A sensor that records nothing. One stays in the app's sensors: with none, faust warns
    "Missing sensor state" at every rebalance."""


def drop_monitor(app: Any) -> None:
    """Take faust's Monitor out of the app's sensors (see the module's docstring)."""
    app.sensors._sensors.discard(app.monitor)
    app.sensors.add(_QuietSensor())
