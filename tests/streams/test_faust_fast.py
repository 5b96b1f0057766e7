"""xidstream.streams.faust_fast: the cuts in faust's per-message path keep faust's behaviour (no broker)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP
from intervaltree import IntervalTree
from mode import Service

from xidstream.streams.faust_fast import FastConsumer, RawSchema, deliver, wait_for_room


class _Svc(Service):
    pass


def test_a_delivery_that_does_not_wait_runs_inline_and_one_that_waits_is_abandoned_on_a_rebalance():
    async def run():
        svc = _Svc()
        await svc.start()
        got = []
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        suspend = asyncio.Event()

        async def put(x):
            await queue.put(x)
            got.append(x)

        await deliver(put(1), suspend, svc.wait_first)  # room: done before deliver returns
        assert got == [1]
        waiting = asyncio.ensure_future(deliver(put(2), suspend, svc.wait_first))  # full: waits
        await asyncio.sleep(0.05)
        assert not waiting.done()
        queue.get_nowait()
        await asyncio.sleep(0.05)
        assert waiting.done() and got == [1, 2]  # finished once there was room, as faust's would
        waiting = asyncio.ensure_future(deliver(put(3), suspend, svc.wait_first))
        await asyncio.sleep(0.05)
        suspend.set()  # a rebalance begins: the blocked delivery is dropped, as faust drops it
        await asyncio.sleep(0.05)
        assert waiting.done() and got == [1, 2] and queue.qsize() == 1
        await svc.stop()

    asyncio.run(run())


def test_the_wait_for_room_ends_at_half_a_buffer_or_at_a_rebalance():
    async def run():
        queue: asyncio.Queue = asyncio.Queue(maxsize=8)
        for i in range(8):
            queue.put_nowait(i)
        suspend = asyncio.Event()
        waiting = asyncio.ensure_future(wait_for_room([queue], suspend))
        for _ in range(3):
            queue.get_nowait()
        await asyncio.sleep(0.02)
        assert not waiting.done()  # 5 of 8: more than half
        queue.get_nowait()
        await asyncio.sleep(0.02)
        assert waiting.done()
        queue.put_nowait(0), queue.put_nowait(0), queue.put_nowait(0), queue.put_nowait(0)
        waiting = asyncio.ensure_future(wait_for_room([queue], suspend))
        await asyncio.sleep(0.02)
        suspend.set()
        await asyncio.sleep(0.02)
        assert waiting.done()

    asyncio.run(run())


def _offsets(cls):
    """A consumer of `cls` holding only the offset bookkeeping faust's `_new_offset` reads."""
    consumer = cls.__new__(cls)
    consumer._acked, consumer._acked_index = defaultdict(list), defaultdict(set)
    consumer._gap, consumer._committed_offset = defaultdict(IntervalTree), defaultdict(lambda: None)
    consumer._rewound, consumer.seeks = {}, []
    consumer.log = __import__("logging").getLogger("test")

    async def seek(tp, offset):
        consumer.seeks.append((tp, offset))

    consumer.seek = seek
    return consumer


def _ack(consumer, tp, offset):
    # faust's Consumer.ack, the bookkeeping part
    if offset not in consumer._acked_index[tp]:
        consumer._acked_index[tp].add(offset)
        consumer._acked[tp].append(offset)


def test_offsets_in_a_gap_that_are_read_later_do_not_stall_the_commits():
    """After a failover the survivor's commits of a taken-over partition advanced one offset per
    commit interval: a gap recorded for offsets 151-220, then those records read (and acked)
    after all, put every offset in faust's acked list twice."""
    tp = TP("t.gpu.samples", 0)
    commits = {}
    for cls in (faust_aiokafka.Consumer, FastConsumer):
        c = _offsets(cls)
        c._committed_offset[tp] = 151
        c._gap[tp].addi(151, 221)
        _ack(c, tp, 220)
        assert c._new_offset(tp) == 221
        c._committed_offset[tp] = 221
        c._gap[tp].addi(221, 300)  # a second gap, then its records after all
        for offset in range(221, 300):
            _ack(c, tp, offset)
        commits[cls.__name__] = c._new_offset(tp)
    assert commits["FastConsumer"] == 300
    assert commits["Consumer"] < 230, "faust's own bookkeeping no longer stalls: drop the override"


def test_raw_schema_hands_over_the_bytes():
    class App:
        def create_event(self, key, value, headers, message):
            return (key, value, message)

    class Message:
        key, value, headers = b"GPU-1", b'{"x": 1}', []

    decode, message = RawSchema().compile(App()), Message()
    assert asyncio.run(decode(message)) == (b"GPU-1", b'{"x": 1}', message)


def test_a_partition_the_group_never_committed_is_read_from_its_beginning_after_a_rebalance():
    """aiokafka seeks only to a committed offset above 0; a partition with none kept the position
    its fetches had reached, and the records a rebalance dropped from faust's buffers were never
    read again (16 of 333 fatal Xids lost over 10 failovers). Such partitions start again at their
    beginning; committed ones are left at their commit, and so are changelog partitions (never
    committed: table recovery places them, and reading a standby's changelog from its beginning
    at every rebalance would undo what a rocksdb store saves)."""
    from types import SimpleNamespace

    from aiokafka.structs import TopicPartition

    committed = {TopicPartition("t.gpu.xid", 0): None, TopicPartition("t.gpu.xid", 1): 0,
                 TopicPartition("t.gpu.xid", 2): 17, TopicPartition("t.xidstream-processor-gpu-state-changelog", 0): None}
    rewound = {}
    app = SimpleNamespace(topics=SimpleNamespace(acks_enabled_for=lambda topic: not topic.endswith("-changelog")))

    class Thread:
        async def seek_to_committed(self):
            return dict(committed)

        async def seek_to_beginning(self, *partitions):
            rewound[type_name] = set(partitions)

    for cls in (faust_aiokafka.Consumer, FastConsumer):
        type_name = cls.__name__
        consumer = cls.__new__(cls)
        consumer._thread, consumer.app = Thread(), app
        assert asyncio.run(consumer.seek_to_committed()) == committed
    assert rewound == {"FastConsumer": {TopicPartition("t.gpu.xid", 0), TopicPartition("t.gpu.xid", 1)}}


def test_a_record_missing_at_the_head_is_read_again_not_committed_past():
    """faust committed past one unacked record at the head (committed 3, acked 4 and 5 -> 6): the
    record a rebalance dropped from the stream buffer was never processed. Now nothing is
    committed, and the partition is read again from the hole, once."""
    tp = TP("t.gpu.xid", 6)
    results = {}

    async def run(cls):
        c = _offsets(cls)
        c._committed_offset[tp] = 3
        for offset in (4, 5):
            _ack(c, tp, offset)
        first, second = c._new_offset(tp), c._new_offset(tp)
        await asyncio.sleep(0)
        results[cls.__name__] = (first, second, c.seeks)
        if cls is FastConsumer:  # the hole read again: 3 acked, then the run commits
            _ack(c, tp, 3)
            results["after"] = c._new_offset(tp)

    for cls in (faust_aiokafka.Consumer, FastConsumer):
        asyncio.run(run(cls))
    assert results["Consumer"][0] == 6, "faust no longer commits past the hole: drop the override"
    assert results["FastConsumer"] == (None, None, [(tp, 3)])
    assert results["after"] == 6


def test_a_delivered_record_that_vanished_with_nothing_after_it_is_read_again():
    """The last Xid on a quiet gpu.xid partition, delivered and then dropped in a rebalance, left
    no hole to see (nothing acked after it): the partition stalled until its next record, maybe
    hours later. A partition read past its commit, with nothing acked and no message of it held
    anywhere, is read again from its commit; one still being processed is left alone."""
    from weakref import WeakSet

    quiet, busy, after_seek = TP("t.gpu.xid", 1), TP("t.gpu.xid", 2), TP("t.gpu.xid", 3)

    class Message:
        def __init__(self, tp):
            self.tp = tp

    class Topics:
        @staticmethod
        def acks_enabled_for(topic):
            return True

    class App:
        topics = Topics()

    async def run():
        c = _offsets(FastConsumer)
        c.app = App()
        c._delivered = {}
        in_flight = Message(busy)  # held by the agent
        c._unacked_messages = WeakSet([in_flight])
        for tp in (quiet, busy, after_seek):
            c._committed_offset[tp] = 3
        c._delivered[quiet] = c._delivered[busy] = 3  # offset 3 handed to the streams; after_seek: none yet
        c._read_dropped_tails_again()
        c._read_dropped_tails_again()  # once, not at every commit
        await asyncio.sleep(0)
        return c.seeks, in_flight

    seeks, _ = asyncio.run(run())
    assert seeks == [(quiet, 3)]


def _drainer(batches, committed, commit_every=None, *, tp=TP("t.xidstream.fleet", 0), channels=None,
             producer_pending=0, producer_threaded=False, message=None):
    """A FastConsumer whose fetches give `batches` (each a list of offsets of one partition, or a
    callable: a seek landing between two records, as a rebalance's does while the loop waits),
    with the streams' side reduced to a list of the offsets the conductor's callback delivered;
    `_drain_messages` runs until the batches are used up. `channels`: the conductor's channels of
    `tp` (none: every message goes to the callback); `producer_pending`: messages waiting in the
    producer's buffer (of at most 100); `producer_threaded`: faust's setting of that name;
    `message(offset, tp)`: the fetched message."""
    import logging
    from collections import deque
    from types import SimpleNamespace

    import faust
    from mode.utils.queues import FlowControlEvent

    message = message or (lambda offset, tp: SimpleNamespace(offset=offset, topic=tp.topic, tp=tp))
    c = FastConsumer.__new__(FastConsumer)
    c._acked, c._acked_index = defaultdict(list), defaultdict(set)
    c._gap, c._committed_offset = defaultdict(IntervalTree), defaultdict(lambda: None)
    c._read_offset = defaultdict(lambda: None)
    c._committed_offset[tp] = c._read_offset[tp] = committed  # as perform_seek leaves them
    c._rewound, c._delivered, c._seeks, c._seeks_total, c._seek_done = {}, {}, {}, 0, None
    c._commit_every, c._n_acked, c.log = commit_every, 0, logging.getLogger("test")
    c.log.dev = c.log.debug  # faust's logger has a level below debug
    c.diag = SimpleNamespace(set_flag=lambda flag: None, unset_flag=lambda flag: None)
    flow_control = FlowControlEvent(initially_suspended=False)
    producer = SimpleNamespace(buffer=SimpleNamespace(max_messages=100, pending=SimpleNamespace(
        _queue=deque(range(producer_pending)))))
    c.app = SimpleNamespace(
        topics=SimpleNamespace(acks_enabled_for=lambda topic: True, _tp_index={tp: channels} if channels else {},
                               _tp_to_callback_lock=asyncio.Lock()),
        conf=SimpleNamespace(Event=faust.Event, producer_threaded=producer_threaded), flow_control=flow_control,
        producer=producer)
    sought, delivered = [], []

    class Thread:
        def seek(self, partition, offset):
            sought.append(offset)

        def _ensure_consumer(self):  # aiokafka's consumer: its seek is the one recorded
            return self

        async def call_thread(self, fun, *args):  # aiokafka's thread: a hop, here a few loop turns
            for _ in range(3):
                await asyncio.sleep(0)
            return await fun(*args)

        async def seek_to_beginning(self, *partitions):
            sought.append("beginning")

    c._thread = Thread()

    async def callback(message):
        delivered.append(message.offset)

    c.callback = callback
    fetcher = SimpleNamespace()
    pending = list(batches)

    def getmany(timeout):
        async def records():
            for item in pending.pop(0):
                if callable(item):
                    await item(c, tp)
                else:
                    yield tp, message(item, tp)
            if not pending:
                fetcher._stopped.set()
        return records()

    c.getmany = getmany

    async def run():
        c._stopped, c._crashed, fetcher._stopped = asyncio.Event(), asyncio.Event(), asyncio.Event()
        c.suspend_flow = asyncio.Event()
        c.wait_first = None  # every delivery here finishes inline
        await c._drain_messages(fetcher)

    asyncio.run(run())
    return c, tp, delivered, sought


def test_records_fetched_before_a_seek_are_not_delivered_after_it_nor_taken_for_a_gap():
    """The fleet partition moved in a failover: the new owner had delivered 1021-1026 when a seek
    took it back to its commit (1021: a re-read of records the rebalance dropped from the stream
    buffer, 1026 among them, as `_read_again` asks; a rebalance's perform_seek does the same); faust
    went on with the batch it had fetched before the seek, took 1027 after the seek's 1021 for a
    gap of compacted records, and committed past 1026, which was never processed: a fatal Xid
    whose command was never sent (failover bench). Records fetched before a seek are
    skipped now, the partition read again from where its streams expect, and nothing is a gap."""
    async def rebalance(c, tp):
        await c.seek(tp, 1021)

    c, tp, delivered, sought = _drainer([[1021, 1022, 1023, 1024, 1025, 1026, rebalance, 1027, 1028],
                                         list(range(1021, 1030))], committed=1021)
    after_seek = delivered[6:]
    assert delivered[:6] == list(range(1021, 1027))
    assert after_seek == list(range(1021, 1030)), "a record fetched before the seek was delivered after it"
    assert not c._gap[tp], "offsets that exist were taken for a gap"
    assert sought == [1021, 1021]  # the rebalance's seek, and the one after the stale batch
    for offset in after_seek:  # the streams process and ack what they were given after the seek
        _ack(c, tp, offset)
    assert c._new_offset(tp) == 1030


def test_a_record_compacted_away_at_the_commit_does_not_hold_the_partition_for_ever():
    """After a seek to the commit (10) the partition's first record was 12: 10 and 11 are not in
    the log (a compacted topic: gpu.inventory). faust counted the gap from 11, so 10 stayed a hole
    at the head and the partition was read again every 10 s, its commit stuck. The gap starts at
    the seek's offset: 12 and 13 processed commit 14."""
    c, tp, delivered, sought = _drainer([[12, 13]], committed=10)
    assert delivered == [12, 13]
    for offset in delivered:
        _ack(c, tp, offset)

    async def commit():
        return c._new_offset(tp)

    assert asyncio.run(commit()) == 14
    assert sought == [] and c._rewound == {}


def test_a_stale_fetch_during_a_rebalance_seek_waits_for_that_seek_not_the_beginning():
    """A fetch that overlapped a rebalance's seek of every partition (FastConsumer.perform_seek)
    is skipped; while that seek runs, the revoke has cleared the partition's read and committed
    offsets. The partition is sought again once the rebalance's seek has ended, to the commit it
    found (700), not from the beginning of the partition (a replay of everything)."""
    async def rebalance(c, tp):
        c._read_offset.pop(tp, None)  # the revoke cleared the partition's offsets
        c._committed_offset.pop(tp, None)
        thread = c._thread

        async def seek_to_committed():  # the group coordinator answers a moment later
            await asyncio.sleep(0.05)
            thread.seek(tp, 700)
            return {tp: 700}

        thread.seek_to_committed = seek_to_committed
        asyncio.ensure_future(c.perform_seek())
        await asyncio.sleep(0)  # the seek has begun

    c, tp, delivered, sought = _drainer([[690, rebalance, 691], list(range(700, 703))], committed=690)
    assert sought == [700, 700], "sought before the rebalance's seek ended"  # the rebalance's, then ours
    assert delivered == [690, 700, 701, 702]


def test_a_record_whose_commit_wait_saw_a_seek_is_not_delivered_after_it():
    """A commit inside the loop can itself seek a partition back (a hole at the head: read again);
    the record the loop was about to deliver was fetched before that seek: it is skipped, and read
    again from the seek's offset like the rest."""
    async def arm(c, tp):  # the next record's commit seeks the partition back to its commit
        async def commit():
            await c.seek(tp, 50)

        c._n_acked, c.commit = 1, commit

    c, tp, delivered, sought = _drainer([[50, 51, arm, 52, 53], [50, 51, 52, 53]], committed=50, commit_every=1)
    assert delivered == [50, 51, 50, 51, 52, 53], "a record fetched before the seek was delivered after it"
    assert not c._gap[tp]


def test_the_livelock_check_passes_over_a_partition_waiting_for_its_offset_reset():
    """A partition the group never committed is sought to its beginning after a rebalance; until
    aiokafka has reset it, its position is None and asserts when read. faust's livelock check read
    it: the consumer crashed and the survivor of a failover exited (failover bench, a kill during
    start-up: 45 fatal Xids without a command). Such a partition has no position to check yet; one
    with a position is checked by faust as before."""
    from types import SimpleNamespace

    from aiokafka.consumer.subscription_state import Assignment
    from aiokafka.structs import TopicPartition

    resetting, placed = TopicPartition("t.gpu.xid", 6), TopicPartition("t.gpu.xid", 7)

    async def make():  # aiokafka's partition states hold futures of a running loop
        return Assignment({resetting, placed})

    assignment = asyncio.run(make())
    assignment.state_value(resetting).await_reset("earliest")  # what seek_to_beginning does
    assignment.state_value(placed).seek(40)
    checked = []

    class Thread:
        def _ensure_consumer(self):
            subscription = SimpleNamespace(assignment=assignment)
            return SimpleNamespace(_fetcher=SimpleNamespace(_subscriptions=SimpleNamespace(subscription=subscription)))

        def verify_event_path(self, now, tp):  # faust's check reads the position first
            assignment.state_value(TopicPartition(tp.topic, tp.partition)).position
            checked.append(tp.partition)

    c = FastConsumer.__new__(FastConsumer)
    c._thread = Thread()
    for tp in (TP("t.gpu.xid", 6), TP("t.gpu.xid", 7)):
        c.verify_event_path(0.0, tp)
    assert checked == [7]


def test_a_stream_buffer_under_pressure_keeps_its_partitions_in_the_next_fetch():
    """faust takes a partition out of the fetch while its stream buffer is 80% full, and puts it
    back only when the buffer is empty; the next fetch asked the broker for the other partitions
    (the empty gpu.xid, gpu.workloads, ...) alone and waited its whole 1 s timeout for them while
    the agent emptied the buffer and idled (catch-up profile: the worker's main thread idle for a
    third of a catch-up, 0.85 cores). The drain loop's own back-pressure (`wait_for_room`) is what
    holds a full buffer now: the fetch still asks for every assigned partition."""
    import logging
    from types import SimpleNamespace

    samples, xid = TP("t.gpu.samples", 0), TP("t.gpu.xid", 0)
    c = FastConsumer.__new__(FastConsumer)
    c._active_partitions, c._paused_partitions, c._buffered_partitions = {samples, xid}, set(), set()
    c.app = SimpleNamespace(in_recovery=False, client_only=False)
    c.flow_active, c.log = True, logging.getLogger("test")
    asked = []

    async def _getmany(active_partitions, timeout):
        asked.append(set(active_partitions))
        return {}

    c._getmany = _getmany

    async def run():
        c.not_waiting_next_records = asyncio.Event()
        c.on_buffer_full(samples)  # the conductor, as the samples' stream buffer passes 80%
        await c._wait_next_records(1.0)

    asyncio.run(run())
    assert asked == [{samples, xid}], "the fetch left out the partition whose buffer was under pressure"


class _Message:
    """What `take_batches` reads of a faust message (a class: faust tracks messages in a WeakSet)."""

    def __init__(self, generation_id, topic="t.gpu.samples"):
        self.topic, self.generation_id, self.tracked = topic, generation_id, False


class _Event:
    """What `take_batches` uses of a faust Event: its message, its value (for processors), its ack."""

    def __init__(self, value, acked, message):
        self.value, self._acked, self.message = value, acked, message

    def ack(self):
        self._acked.append(self.value)
        return True


def _batches(run_body, *, max_=5, within=0.2):
    """Run `run_body(put, batches, acked, stream)` against `take_batches` over a real faust stream
    of an in-memory channel (the queue the conductor fills in a worker); the batches are the
    values each loop body saw. `put(*values, generation=None)`: events of the app's current
    consumer generation unless told otherwise."""
    import faust

    from xidstream.streams.faust_fast import take_batches

    async def run():
        app = faust.App("take-batches-test", broker="kafka://127.0.0.1:1", autodiscover=False)  # never connected
        app.topics._acking_topics.add("t.gpu.samples")
        app.flow_control.resume()  # a worker resumes it once its partitions are assigned
        stream = app.stream(app.channel(maxsize=100))
        acked: list = []

        def put(*values, generation=None):
            gen = app.consumer_generation_id if generation is None else generation
            for v in values:
                stream.channel.queue.put_nowait(_Event(v, acked, _Message(gen)))

        return await run_body(put, take_batches(stream, max_, within), acked, stream)

    return asyncio.run(run())


def test_take_batches_hands_over_what_is_queued_up_to_max_and_acks_each_batch_after_its_body():
    async def body(put, batches, acked, stream):
        put(*range(7))
        seen = []
        async for batch in batches:
            seen.append([e.value for e in batch])
            assert acked == [v for b in seen[:-1] for v in b], "acked before its loop body ran"
            if len(seen) == 2:
                break
        return seen, acked

    seen, acked = _batches(body, max_=5)
    assert seen == [[0, 1, 2, 3, 4], [5, 6]]
    assert acked == [0, 1, 2, 3, 4]  # the body of the second batch never finished (break)


def test_a_short_batch_waits_up_to_within_for_more_then_goes_without_them():
    import time

    async def body(put, batches, acked, stream):
        put("lone")
        t0 = time.monotonic()
        seen = []
        async for batch in batches:
            seen.append(([e.value for e in batch], time.monotonic() - t0))
            if len(seen) == 1:
                put("a")  # then two more arrive while the next batch waits
                asyncio.get_running_loop().call_later(0.05, put, "b")
            else:
                break
        return seen

    (first, t_first), (second, t_second) = _batches(body, max_=5, within=0.3)
    assert first == ["lone"] and 0.25 <= t_first < 2.0  # no more came: handed over after `within`
    assert second == ["a", "b"], "an event arriving while a short batch waits joins it"


def test_the_events_of_a_batch_whose_body_raised_are_not_acked():
    """faust's take_events acks a batch in a ``finally``, also when the body raised: the worker
    could commit past records whose rows were never written. The agents' bodies that raise stop
    the worker (`xidstream.streams.app.guarded`); their records must be read again."""
    async def body(put, batches, acked, stream):
        put(1, 2, 3)
        try:
            async for batch in batches:
                raise RuntimeError("the fold failed")
        except RuntimeError:
            pass
        await batches.aclose()
        return acked

    assert _batches(body) == []


def test_a_stopping_stream_hands_over_the_events_taken_so_far_and_ends():
    async def body(put, batches, acked, stream):
        put(1, 2)
        asyncio.get_running_loop().call_later(0.1, stream._stopped.set)

        async def collect():
            return [[e.value for e in batch] async for batch in batches]

        return await asyncio.wait_for(collect(), 5.0)

    assert _batches(body, max_=10, within=30.0) == [[1, 2]]  # not 30 s later: at the stop


def test_a_streams_processors_see_each_event_as_it_is_taken():
    """agent.test_context() counts the events its agent took with a stream processor; its put()
    returns when that ran."""
    async def body(put, batches, acked, stream):
        taken = []
        stream.add_processor(lambda value: taken.append(value) or value)
        put(1, 2, 3)
        async for batch in batches:
            return taken, [e.value for e in batch]

    assert _batches(body, max_=3) == ([1, 2, 3], [1, 2, 3])


def test_a_batchs_messages_are_tracked_as_unacked_until_its_body_ran():
    """faust's stream iterator tracks each message it takes until its ack; the rebalance waits for
    them (`wait_empty`), and `_read_dropped_tails_again` takes a partition whose delivered records
    are neither acked nor tracked for one that lost them. Untracked, every batch being folded looked
    lost: 143 "never processed ... reading them again" in a 90 s run of one worker, and one of those
    seeks crashed a worker (the latency bench, 10,000 GPUs on two workers)."""
    async def body(put, batches, acked, stream):
        unacked = stream.app.consumer._unacked_messages
        put(1, 2)
        async for batch in batches:
            during = sorted(id(e.message) in {id(m) for m in unacked} for e in batch)
            return during, all(e.message.tracked for e in batch)

    assert _batches(body) == ([True, True], True)


def test_an_event_fetched_before_a_rebalance_is_dropped_not_processed():
    """As faust's stream iterator: an event of an earlier consumer generation belongs to a
    partition that may have moved; it is read again from its commit by its owner."""
    async def body(put, batches, acked, stream):
        put(1, generation=stream.app.consumer_generation_id - 1)
        put(2)
        async for batch in batches:
            return [e.value for e in batch], acked

    assert _batches(body) == ([2], [])



def test_a_record_waiting_in_its_stream_buffer_is_not_taken_for_a_dropped_one():
    """Delivered records wait in their channel's queue until the agent takes them (and tracks
    them); a commit in between saw them neither acked nor tracked and read the partition again:
    45 needless re-reads in a 90 s run of two workers (latency bench, 10,000 GPUs), each a
    seek and a re-fold, and the fatal Xids behind them waited up to 1.5 s (p99 1,439 ms)."""
    from types import SimpleNamespace
    from weakref import WeakSet

    queued, lost = TP("t.gpu.samples", 4), TP("t.gpu.samples", 5)

    def event(tp):
        return SimpleNamespace(message=SimpleNamespace(tp=tp))

    queue = asyncio.Queue()
    queue.put_nowait(event(queued))
    channel = SimpleNamespace(queue=queue)

    async def run():
        c = _offsets(FastConsumer)
        c.app = SimpleNamespace(topics=SimpleNamespace(acks_enabled_for=lambda topic: True,
                                                       _tp_index={queued: [channel], lost: [channel]}))
        c._delivered, c._unacked_messages = {}, WeakSet()
        for tp in (queued, lost):
            c._committed_offset[tp] = 23104
            c._delivered[tp] = 23110
        c._read_dropped_tails_again()
        await asyncio.sleep(0)
        return c.seeks

    assert asyncio.run(run()) == [(lost, 23104)]


def _watching(applied: dict, high: dict, positions: dict, *, queued: int = 0, fetching=None, in_recovery=True):
    """A stand-in for the consumer `FastConsumer._stalled_recovery` reads: faust's recovery (its
    applied offsets and highwaters), recovery's queue, the partitions being fetched, aiokafka's
    positions."""
    from types import SimpleNamespace

    recovery = SimpleNamespace(in_recovery=in_recovery, active_tps=set(applied), active_offsets=applied,
                               active_highwaters=high)
    queue = SimpleNamespace(qsize=lambda: queued)
    return SimpleNamespace(app=SimpleNamespace(tables=SimpleNamespace(_recovery=recovery, changelog_queue=queue)),
                           flow_active=True, _active_partitions=set(applied) if fetching is None else fetching,
                           _positions=lambda tps: {tp: positions[tp] for tp in tps if tp in positions})


def test_a_recovery_is_taken_for_stalled_only_when_aiokafka_read_past_what_it_applied_and_nothing_moved():
    from xidstream.streams.faust_fast import RECOVERY_STALL_S

    stalled = FastConsumer._stalled_recovery
    a, b = TP("gpu-state-changelog", 0), TP("gpu-state-changelog", 1)
    applied, high = {a: -1, b: 40}, {a: 99, b: 99}
    # aiokafka read both to their end (position 100), recovery applied nothing of a and b up to 40
    me = _watching(applied, high, {a: 100, b: 100})
    progress: dict = {}
    assert stalled(me, progress, 0.0) == {}  # first look: the clock starts
    assert stalled(me, progress, RECOVERY_STALL_S - 0.1) == {}
    assert stalled(me, progress, RECOVERY_STALL_S) == {a: 0, b: 40}  # -1 (nothing applied): from the start

    # recovery moving on is progress: b's clock starts again
    progress = {}
    stalled(me, progress, 0.0)
    applied[b] = 60
    assert stalled(me, progress, RECOVERY_STALL_S) == {a: 0}
    # records waiting in recovery's queue are progress too
    assert stalled(_watching(applied, high, {a: 100, b: 100}, queued=5), progress, 10 * RECOVERY_STALL_S) == {}
    assert stalled(me, progress, 11 * RECOVERY_STALL_S - 0.1) == {}
    assert stalled(me, progress, 11 * RECOVERY_STALL_S) == {a: 0, b: 60}
    # after a seek at that offset (the watch doubles its wait), the same offset waits twice as long
    progress[a] = (-1, 0.0, 2 * RECOVERY_STALL_S)
    assert a not in stalled(me, progress, 2 * RECOVERY_STALL_S - 0.1)
    assert a in stalled(me, progress, 2 * RECOVERY_STALL_S)

    # not stalled: aiokafka has not read past the next record (a fetch is still on its way), the
    # partition is not being fetched (paused: before recovery's own seek), or it is complete
    for me in (_watching(applied, high, {a: 0, b: 61}),
               _watching(applied, high, {a: 100, b: 100}, fetching=set()),
               _watching({a: 99, b: 99}, high, {a: 100, b: 100}),
               _watching(applied, high, {a: 100, b: 100}, in_recovery=False)):
        progress = {}
        stalled(me, progress, 0.0)
        assert stalled(me, progress, 10 * RECOVERY_STALL_S) == {}


def _consumer_message(tp, offset, *, key=b"GPU-1", value=b'{"v": 1}', headers=None):
    from faust.types.tuples import ConsumerMessage

    return ConsumerMessage(tp.topic, tp.partition, offset, 1.0, 0, headers or [], key, value, None, len(key),
                           len(value), tp, generation_id=1)


def _raw_app():
    import faust

    return faust.App("direct-delivery-test", broker="kafka://127.0.0.1:1", autodiscover=False)  # never connected


def test_a_partition_with_one_raw_channel_gets_its_events_without_the_conductors_callback():
    """The conductor's delivery per message (flow-control and producer waits, the channel's decode,
    the queue's pressure bookkeeping, all from a coroutine per message) was about a seventh of a
    catching-up worker's CPU (catch-up profile). For the input topics (one channel, raw bytes:
    `RawSchema`) the drain loop makes the same event and puts it in the same queue itself."""
    samples = TP("t.gpu.samples", 3)
    channel = _raw_app().topic(samples.topic, schema=RawSchema())
    fetched = {}

    def message(offset, tp):
        fetched[offset] = _consumer_message(tp, offset, key=f"GPU-{offset}".encode(), headers=[("h", b"1")])
        return fetched[offset]

    c, tp, delivered, sought = _drainer([[5, 6, 7]], committed=5, tp=samples, channels={channel}, message=message)
    events = [channel.queue.get_nowait() for _ in range(channel.queue.qsize())]
    assert delivered == [], "the conductor's callback was called for a raw channel's partition"
    assert [e.message for e in events] == [fetched[5], fetched[6], fetched[7]]
    assert [(e.key, e.value, e.headers) for e in events] == [(f"GPU-{o}".encode(), b'{"v": 1}', {"h": b"1"})
                                                            for o in (5, 6, 7)]
    assert [e.message.refcount for e in events] == [1, 1, 1]  # as the conductor's incref: one channel
    assert c._delivered[samples] == 7 and c._read_offset[samples] == 7


def test_the_conductor_still_delivers_what_the_direct_path_cannot():
    """Every other case goes to the conductor's callback, as before: a partition read by two
    channels, a channel that decodes (not raw), the producer's buffer over its limit (the
    conductor waits for it to ebb), a threaded producer (its buffer is elsewhere), and, from the
    next message on, flow control suspended (a rebalance) or the conductor's callbacks being
    rebuilt (its lock held: a resubscription)."""
    samples = TP("t.gpu.samples", 3)
    app = _raw_app()
    raw, raw2 = app.topic(samples.topic, schema=RawSchema()), app.topic(samples.topic, schema=RawSchema())
    decoding = app.topic(samples.topic, key_type=bytes, value_type=bytes)

    def message(offset, tp):
        return _consumer_message(tp, offset)

    cases = {"two channels": dict(channels={raw, raw2}), "a decoding channel": dict(channels={decoding}),
             "producer buffer over its limit": dict(channels={raw}, producer_pending=101),
             "threaded producer": dict(channels={raw}, producer_threaded=True)}
    for case, kwargs in cases.items():
        c, tp, delivered, sought = _drainer([[5, 6]], committed=5, tp=samples, message=message, **kwargs)
        assert delivered == [5, 6], case

    c, tp, delivered, sought = _drainer([[5, 6]], committed=5, tp=samples, message=message, channels={raw},
                                        producer_pending=100)
    assert delivered == [] and raw.queue.qsize() == 2, "a producer buffer at its limit is not over it"
    raw.queue.clear()

    async def suspend(c, tp):
        c.app.flow_control.suspend()

    async def resubscribe(c, tp):
        await c.app.topics._tp_to_callback_lock.acquire()

    for case, change in (("flow control suspended", suspend), ("callbacks being rebuilt", resubscribe)):
        c, tp, delivered, sought = _drainer([[5, change, 6]], committed=5, tp=samples, channels={raw},
                                            message=message)
        assert delivered == [6], f"{case}: a message went straight into a stream buffer"
        assert raw.queue.qsize() == 1 and raw.queue.get_nowait().message.offset == 5, case


def test_acking_a_batch_at_once_leaves_the_consumer_as_faust_acking_each_event():
    """`FastConsumer.ack_events` against faust's `Event.ack` per event, on the same messages: the
    committable offsets, the unacked set, the count towards the next commit and each message's
    state must be the same (a message on two channels, one acked already, one below the commit,
    the same offset twice, one never counted, a topic without commits, a message not from a
    consumer)."""
    from types import SimpleNamespace
    from weakref import WeakSet

    import faust
    from faust.types.tuples import Message

    samples, changelog = TP("t.gpu.samples", 0), TP("app-gpu-state-changelog", 0)

    def run(ack):
        c = _offsets(FastConsumer)
        c._unacked_messages, c._n_acked, c._waiting_for_ack = WeakSet(), 0, None
        c._committed_offset[samples] = 10
        app = SimpleNamespace(consumer=c, topics=SimpleNamespace(_acking_topics={samples.topic}))
        app.topics.acks_enabled_for = lambda topic: topic in app.topics._acking_topics
        c.app = app
        messages = [_consumer_message(samples, o) for o in (9, 10, 11, 12, 12, 13, 15)]
        messages.append(_consumer_message(changelog, 4))
        messages.append(Message(samples.topic, 0, 14, 1.0, 0, [], b"k", b"v", None, 1, 1, tp=samples))
        for m in messages:
            m.refcount = 1
            c._unacked_messages.add(m)
        messages[2].refcount = 2  # on two channels: acked by the second
        messages[3].acked = True
        messages[6].refcount = 0  # never counted (acked by its first ack all the same)
        events = [faust.Event(app, m.key, m.value, m.headers, m) for m in messages]
        ack(c, events)
        return (dict(c._acked), dict(c._acked_index), c._n_acked, sorted(m.offset for m in c._unacked_messages),
                [(m.acked, m.refcount) for m in messages])

    def each(c, events):
        for event in events:
            event.ack()

    faust_way = run(each)
    assert faust_way[0] == {samples: [10, 12, 13, 15]}  # the test's premise: faust's bookkeeping as known
    assert run(lambda c, events: c.ack_events(events)) == faust_way


def test_a_seek_runs_on_aiokafkas_thread():
    """faust seeks aiokafka from the event loop's thread, while aiokafka's own thread may be handing
    out that partition's fetched records (a KeyError in `Fetcher.fetched_records` stopped a worker
    once). The seek is handed to aiokafka's thread, as faust already does with `seek_wait`."""
    import threading

    seeks = []

    class Consumer:  # aiokafka's consumer, as the thread holds it
        def seek(self, tp, offset):
            seeks.append((tp, offset, threading.get_ident()))

    class Thread:  # a consumer thread: its own event loop on its own OS thread
        def __init__(self):
            self.loop = asyncio.new_event_loop()
            self.os_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.os_thread.start()

        def _ensure_consumer(self):
            return Consumer()

        def seek(self, tp, offset):  # faust's way: aiokafka's seek right here
            self._ensure_consumer().seek(tp, offset)

        async def call_thread(self, fun, *args):
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fun(*args), self.loop))

    c = FastConsumer.__new__(FastConsumer)
    c._thread = thread = Thread()
    tp = TP("t.gpu.xid", 2)
    try:
        asyncio.run(c._seek(tp, 40))
    finally:
        thread.loop.call_soon_threadsafe(thread.loop.stop)
    assert seeks == [(tp, 40, thread.os_thread.ident)], "aiokafka's seek ran outside its own thread"


def test_a_seek_still_on_its_way_to_aiokafkas_thread_is_not_undone_by_the_stale_batchs_seek():
    """A seek waits for its hop to aiokafka's thread. A re-read (`_read_again`: seek to the commit,
    900) that begins while the loop delivers a batch fetched before it makes the loop skip the rest
    of that batch and seek the partition to the offset the last seek left; read before the re-read's
    hop ended, that was the last offset delivered (1000), and that seek, landing second, undid the
    re-read: 900-999 waited for the next hole check, 10 s later (review of the seek change)."""
    async def reread(c, tp):
        asyncio.ensure_future(c.seek(tp, 900))
        await asyncio.sleep(0)  # the re-read has begun; its hop has not ended

    c, tp, delivered, sought = _drainer([[1000, reread, 1001, 1002], list(range(900, 903))], committed=900)
    assert sought == [900, 900], "the stale batch's seek undid the re-read"
    assert delivered == [1000, 900, 901, 902]


def test_the_liveness_watch_sees_a_batch_held_in_a_body_and_nothing_once_it_returns():
    """/livez (streams.app): a batch that stays in an agent's body past the stall limit makes the
    worker not live; an idle worker, or one whose bodies return, is live (a wedged
    worker still answered /metrics, the probe the chart used)."""
    from xidstream.streams.faust_fast import BATCHES

    async def body(put, batches, acked, stream):
        put(1, 2, 3)
        states = []
        async for batch in batches:
            states.append((BATCHES.stalled(60.0), BATCHES.stalled(0.0, now=time.monotonic() + 1)))
            if len(states) == 2:
                break
            put(4)
        return states

    import time

    states = _batches(body, max_=5)
    assert states[0][0] is None  # held, but not yet past the limit
    assert states[0][1].startswith("stalled: agent") and "batch of 3 record(s)" in states[0][1], states[0][1]
    assert "batch of 1 record(s)" in states[1][1]  # the first came back: only the second is held
    assert BATCHES.stalled(0.0, now=time.monotonic() + 1) is None  # the stream ended: nothing held


def test_the_liveness_watch_reports_the_oldest_batch():
    from xidstream.streams.faust_fast import BatchWatch

    w = BatchWatch()
    assert w.stalled(10, now=100) is None
    w.begin(1, 500, "gpus", now=50)
    w.begin(2, 3, "fleet", now=80)
    assert w.stalled(50, now=100) is None  # 50 s held: at the limit, still live
    assert w.stalled(49, now=100) == "stalled: agent gpus has held a batch of 500 record(s) for 50 s (limit 49 s)"
    w.end(1)
    assert w.stalled(10, now=100).startswith("stalled: agent fleet")
    w.end(2)
    w.end(2)  # ending twice is harmless (the generator's finally)
    assert w.stalled(0, now=1000) is None


def test_the_workers_producer_is_idempotent_with_acks_all():
    """faust asks aiokafka for idempotence only inside a transaction; the processor's producer
    must have it at-least-once too, or a send retried to a new leader after the old one wrote it
    and died is on the topic twice (the three-broker failover test saw a command twice)."""
    from xidstream.streams.app import create_app
    from xidstream.transport.config import KafkaConfig

    async def made() -> tuple:
        app = create_app(KafkaConfig(bootstrap="127.0.0.1:1")).app
        producer = app.producer._new_producer()
        try:
            return producer._txn_manager is not None, app.producer._settings_extra()
        finally:
            await producer.stop()  # never started: closes its client

    idempotent, extra = asyncio.run(made())
    assert idempotent, "aiokafka made no transaction manager: idempotence is off"
    assert extra == {"acks": "all", "enable_idempotence": True}


def test_acks_1_only_when_the_measurement_asks_for_it_and_nothing_else_is_taken(monkeypatch):
    """bench/broker_failover.py sets XIDSTREAM_PROCESSOR_ACKS=1 to measure what acks=all costs the
    worker: then acks=1 and no idempotence (aiokafka refuses idempotence without acks=all). Any
    other value is refused by name, not read as one of the two."""
    from xidstream.streams import faust_fast
    from xidstream.streams.app import create_app
    from xidstream.transport.config import KafkaConfig

    def extra() -> tuple:
        app = create_app(KafkaConfig(bootstrap="127.0.0.1:1")).app
        return app.conf.producer_acks, app.producer._settings_extra()

    monkeypatch.setenv("XIDSTREAM_PROCESSOR_ACKS", "1")
    assert extra() == (1, {"acks": 1, "enable_idempotence": False})
    monkeypatch.setenv("XIDSTREAM_PROCESSOR_ACKS", "ALL")
    assert extra() == (-1, {"acks": "all", "enable_idempotence": True})
    for bad in ("0", "-1", "one", ""):
        monkeypatch.setenv("XIDSTREAM_PROCESSOR_ACKS", bad)
        with pytest.raises(ValueError, match="XIDSTREAM_PROCESSOR_ACKS"):
            faust_fast.processor_acks()


# -- mend_aiokafka: aiokafka 0.14's consumer after leadership moves (three-broker tier) ----------
class _Recorder:
    def __init__(self):
        self.refreshes = 0
        self.dead = 0

    def force_metadata_update(self):
        self.refreshes += 1

    def coordinator_dead(self):
        self.dead += 1


def test_an_offset_reset_that_meets_a_stale_leader_refreshes_the_metadata():
    # aiokafka's own _update_fetch_positions, run over a fetcher whose cached leader answers
    # NotLeaderForPartition: unmended it waits 100 ms and asks that broker again, metadata never
    # refreshed (the worker asked the old leader every 100 ms for minutes)
    from types import SimpleNamespace

    from aiokafka.consumer.fetcher import Fetcher, OffsetResetStrategy
    from aiokafka.errors import NotLeaderForPartitionError
    from aiokafka.structs import TopicPartition

    from xidstream.streams.faust_fast import mend_aiokafka

    tp = TopicPartition("gpu.samples", 0)
    asked = []

    async def old_leader(node_id, topic_data):
        asked.append(node_id)
        raise NotLeaderForPartitionError(tp)

    client = _Recorder()
    state = SimpleNamespace(has_valid_position=False, awaiting_reset=True, reset_strategy=OffsetResetStrategy.EARLIEST)
    fetcher = SimpleNamespace(_client=client, _retry_backoff=0, _proc_offset_request=old_leader)
    mend_aiokafka(SimpleNamespace(_fetcher=fetcher, _coordinator=None))
    assignment = SimpleNamespace(state_value=lambda _: state)
    asyncio.run(Fetcher._update_fetch_positions(fetcher, assignment, 1, [tp]))
    assert asked == [1] and state.awaiting_reset, "the reset failed and waits for the next try"
    assert client.refreshes == 1, "the next try must go to the leader fresh metadata names"


def test_an_offset_fetch_that_answers_not_coordinator_is_a_retriable_group_error():
    # OffsetFetch v3: the group's error at the top, no partitions. Unmended, aiokafka returned {}
    # ("nothing committed"), and every partition of the group was read again from its beginning.
    from types import SimpleNamespace

    import pytest
    from aiokafka.consumer.group_coordinator import GroupCoordinator
    from aiokafka.errors import GroupLoadInProgressError, NotCoordinatorForGroupError
    from aiokafka.protocol.commit import OffsetFetchResponse_v1, OffsetFetchResponse_v3
    from aiokafka.structs import OffsetAndMetadata, TopicPartition

    from xidstream.streams.faust_fast import mend_aiokafka

    tp = TopicPartition("gpu.samples", 0)

    def coordinator_answering(response):
        async def send_req(request):
            return response

        coordinator = _Recorder()
        coordinator.group_id = "g"
        coordinator._send_req = send_req
        mend_aiokafka(SimpleNamespace(_fetcher=None, _coordinator=coordinator))
        return coordinator

    moved = coordinator_answering(OffsetFetchResponse_v3(0, [], 16))
    with pytest.raises(NotCoordinatorForGroupError):
        asyncio.run(GroupCoordinator._do_fetch_commit_offsets(moved, [tp]))
    assert moved.dead == 1, "the coordinator is looked up again"
    assert NotCoordinatorForGroupError.retriable

    loading = coordinator_answering(OffsetFetchResponse_v3(0, [], 14))
    with pytest.raises(GroupLoadInProgressError):
        asyncio.run(GroupCoordinator._do_fetch_commit_offsets(loading, [tp]))
    assert loading.dead == 0

    # at the partition level (v1), COORDINATOR_NOT_AVAILABLE: a retriable group error, not the
    # non-retriable KafkaError aiokafka made of it
    from aiokafka.errors import GroupCoordinatorNotAvailableError

    gone = coordinator_answering(OffsetFetchResponse_v1([("gpu.samples", [(0, -1, "", 15)])]))
    with pytest.raises(GroupCoordinatorNotAvailableError):
        asyncio.run(GroupCoordinator._do_fetch_commit_offsets(gone, [tp]))
    assert gone.dead == 1

    # any other error at the top (a group the user may not read) is that error, not "nothing committed"
    from aiokafka.errors import GroupAuthorizationFailedError

    refused = coordinator_answering(OffsetFetchResponse_v3(0, [], 30))
    with pytest.raises(GroupAuthorizationFailedError):
        asyncio.run(GroupCoordinator._do_fetch_commit_offsets(refused, [tp]))
    assert refused.dead == 0

    fine = coordinator_answering(OffsetFetchResponse_v3(0, [("gpu.samples", [(0, 42, "", 0)])], 0))
    assert asyncio.run(GroupCoordinator._do_fetch_commit_offsets(fine, [tp])) == {tp: OffsetAndMetadata(42, "")}


def test_the_worker_mends_each_consumer_it_starts(monkeypatch):
    from types import SimpleNamespace

    from xidstream.streams import faust_fast

    started = SimpleNamespace(_fetcher=None, _coordinator=None)

    async def on_start(self):
        self._consumer = started

    mended = []
    monkeypatch.setattr(faust_aiokafka.AIOKafkaConsumerThread, "on_start", on_start)
    monkeypatch.setattr(faust_fast, "mend_aiokafka", mended.append)
    thread = faust_fast.FastConsumerThread.__new__(faust_fast.FastConsumerThread)  # no service machinery
    asyncio.run(thread.on_start())
    assert mended == [started]


def test_the_workers_clients_refresh_metadata_every_ten_seconds():
    # faust's default is five minutes: a leader that moved with no error to say so (the preferred
    # leader taking its partitions back after a restart) was unknown to the worker that long
    from xidstream.streams.app import create_app
    from xidstream.transport.config import KafkaConfig

    conf = create_app(KafkaConfig(bootstrap="127.0.0.1:1")).app.conf
    assert conf.consumer_metadata_max_age_ms == conf.producer_metadata_max_age_ms == 10_000
