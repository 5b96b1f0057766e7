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

The fixes (failover bench). Those that mend one upstream defect each are in `xidstream.streams.faust_mends`
(a module, an upstream-ready patch file and a test that fails once upstream fixes it, per defect),
composed here as bases of `FastConsumer` and `FastConsumerThread` and in `mend_aiokafka`: a
partition the group never committed is read from its beginning after a rebalance
(`never_committed_from_beginning`); gap offsets are kept once, so commits do not stall
(`gap_offsets_acked_twice`); a record missing at the head of a partition, or dropped with nothing
after it, is read again instead of committed past (`dropped_records_committed_past`); a seek runs on
aiokafka's thread, never from the event loop's thread in the middle of aiokafka's hand-over of that
partition's records (`seek_on_consumer_thread`); faust's livelock check passes over a partition
waiting for its offset reset (`livelock_check_without_position`); a fetch from before a rebalance no
longer takes every partition's records once faust's set of active partitions is empty, and what a
fetch returns after the flow stopped is put back, not dropped (`fetch_across_rebalance`); and, on
aiokafka's consumer (`mend_aiokafka`, three-broker tier: the worker stopped folding for minutes
after leadership moved), an offset reset that meets a stale leader refreshes metadata
(`offset_reset_stale_leader`) and an OffsetFetch answered with a group-level error is that retriable
error (`offset_fetch_group_error`).

Two fixes stay here, woven into the drain loop that replaces faust's: records fetched before a seek
of their partition are not delivered after it, where faust took the offsets they jumped over for a
gap and committed past them; and offsets absent at the committed offset count as processed
(`_drain_messages`, `_add_absent`, `_seek_to_expected`). A watch, not a mend: a table recovery that
waits for changelog records aiokafka has already read past reads them again (`_watch_recovery`).
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

from xidstream.streams.faust_mends import offset_fetch_group_error, offset_reset_stale_leader
from xidstream.streams.faust_mends.dropped_records_committed_past import DroppedRecordsCommittedPast
from xidstream.streams.faust_mends.fetch_across_rebalance import FetchAcrossRebalance
from xidstream.streams.faust_mends.gap_offsets_acked_twice import GapOffsetsAckedTwice
from xidstream.streams.faust_mends.livelock_check_without_position import LivelockCheckWithoutPosition
from xidstream.streams.faust_mends.never_committed_from_beginning import NeverCommittedFromBeginning
from xidstream.streams.faust_mends.seek_on_consumer_thread import SeekOnConsumerThread

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
                       "_gap", "_waiting_for_ack", "_active_partitions")


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
    processors = stream.info()["processors"]  # the stream's own list (faust's clone reads it so)
    app = stream.app
    flow_active, acks_enabled_for = app.flow_control.is_active, app.topics.acks_enabled_for
    track = app.consumer._unacked_messages.add
    ack_all = getattr(app.consumer, "ack_events", None) or _ack_each
    loop = asyncio.get_running_loop()
    stopping = asyncio.ensure_future(stream.wait_until_stopped())
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
        if not message.tracked:
            topic = message.topic
            try:
                acks = acking[topic]
            except KeyError:
                acks = acking[topic] = acks_enabled_for(topic)
            if acks:
                message.tracked = True
                track(message)
        return True

    async def took(event: Any) -> Any:
        for processor in processors:
            await maybe_async(processor(event.value))
        return event

    # the conductor's answer per topic, asked once per batch: `acks_enabled_for` is a method call
    # per event where faust's own loop looks the topic up in the set behind it (~50 ns more, twice
    # per record with `ack_events`); the set changes only when the app's topics do
    acking: dict = {}
    try:
        while not (ended or stream.should_stop):
            acking.clear()
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


def mend_aiokafka(consumer: Any) -> None:
    """The aiokafka mends (`xidstream.streams.faust_mends`), on a started aiokafka consumer (its fetcher and
    group coordinator): an offset reset that meets a stale leader refreshes the metadata, and an
    OffsetFetch answered with a group-level error is that retriable error, not "nothing committed"."""
    offset_reset_stale_leader.mend(consumer)
    offset_fetch_group_error.mend(consumer)


class FastConsumerThread(FetchAcrossRebalance, faust_aiokafka.AIOKafkaConsumerThread):
    async def on_start(self) -> None:
        await super().on_start()
        mend_aiokafka(self._consumer)


class FastConsumer(SeekOnConsumerThread, NeverCommittedFromBeginning, LivelockCheckWithoutPosition,
                   GapOffsetsAckedTwice, DroppedRecordsCommittedPast, faust_aiokafka.Consumer):
    """faust's aiokafka consumer with the cuts of this module (`_drain_messages`, `ack_events`,
    `on_buffer_full`), the recovery watch (`_watch_recovery`), the fixes woven into the drain loop
    (stale records after a seek, absent offsets) and the mends of `xidstream.streams.faust_mends` (the bases
    before faust's: `GapOffsetsAckedTwice` before `DroppedRecordsCommittedPast`, as the hole at
    the head is judged on distinct offsets)."""

    def _new_consumer_thread(self) -> Any:
        return FastConsumerThread(self, loop=self.loop, beacon=self.beacon)

    def __post_init__(self) -> None:
        super().__post_init__()
        # tp -> offset of the last record handed to the streams since the last seek (faust's read
        # offset cannot tell: a seek sets it to the next offset to read, a delivery to the last read)
        self._delivered: dict = {}
        # Seeks so far: tp -> count for one partition's (`seek`), None -> count for every
        # partition's (`perform_seek`). Each is counted as it begins and as it ends, so a fetch
        # that overlapped a seek in any way is seen as older than it (`_drain_messages`).
        self._seeks: dict = {}
        self._seeks_total = 0  # all of them: the drain loop's one comparison per record
        self._seek_done: asyncio.Event | None = None  # set when the newest perform_seek ends

    def _positions(self, tps: Any) -> dict:
        """aiokafka's next offset to fetch for each of `tps` that has a valid one. Read on the event
        loop's thread while aiokafka's thread writes it: a check that tolerates a stale value, and
        `_seek_if_stalled` checks it again on aiokafka's thread before it acts."""
        out = {}
        for tp in tps:
            state = self._partition_state(tp)
            if state is not None and state.has_valid_position:  # `.position` asserts it is valid
                out[tp] = state.position
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
        recovery = self.app.tables.recovery
        if self.app.consumer_generation_id != generation or not recovery.in_recovery:
            return {}
        consumer = self._thread._ensure_consumer()
        sought = {}
        for tp, offset in stalled.items():
            state = self._partition_state(tp)  # None: revoked meanwhile
            if state is None or not state.has_valid_position or state.position <= offset + 1:
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
        # faust's table manager's one Recovery (made on first use; the manager starts it)
        recovery = self.app.tables.recovery
        if not recovery.in_recovery or not self.flow_active:
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
        # Service.should_stop: faust's loop reads the stopped events themselves; should_stop
        # also ends the loop once the consumer or the fetcher crashed, when it has nothing to do
        def consumer_should_stop() -> bool:
            return self.should_stop

        def fetcher_should_stop() -> bool:
            return fetcher.should_stop

        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        set_flag, unset_flag = self.diag.set_flag, self.diag.unset_flag
        commit_every = self.app.conf.broker_commit_every  # what faust's Consumer keeps as _commit_every
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
        acks_enabled_for = self.app.topics.acks_enabled_for
        acking: dict = {}  # its answer per topic, asked once per batch (as in `take_batches`)
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
                    topic = message.topic
                    try:
                        acks = acking[topic]
                    except KeyError:
                        acks = acking[topic] = acks_enabled_for(topic)
                    if not acks:
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
    if app.monitor in app.sensors:
        app.sensors.remove(app.monitor)
    app.sensors.add(_QuietSensor())
