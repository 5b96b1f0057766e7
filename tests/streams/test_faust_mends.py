"""streams/faust_mends: each upstream defect still shows on the installed faust-streaming/aiokafka
(a test here fails once an upgrade fixes it: remove that mend), each patch file still applies to
the installed upstream file, and the file it makes no longer shows the defect (no broker).

Each defect is a check run against a module of upstream's: the installed one, or a copy with the
patch applied (loaded under another name; faust and aiokafka themselves stay as installed)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from intervaltree import IntervalTree

from xidstream.streams import faust_mends

PATCHES = Path(faust_mends.__file__).parent / "patches"
SITE = Path(importlib.import_module("faust").__file__).parents[1]


def _concrete(cls):
    """A subclass of `cls` whose instances can be made without its abstract methods or __init__."""
    sub = type(f"Bare{cls.__name__}", (cls,), {})
    sub.__abstractmethods__ = frozenset()
    return sub.__new__(sub)


class _Recorder:
    def __init__(self):
        self.refreshes = self.dead = 0

    def force_metadata_update(self):
        self.refreshes += 1

    def coordinator_dead(self):
        self.dead += 1


# -- each defect, as a check: True when `module` (upstream's, installed or patched) shows it -------

def _offset_reset_stale_leader(fetcher_module) -> bool:
    """An offset reset whose leader answers NotLeaderForPartition: is the metadata left stale?"""
    from aiokafka.consumer.fetcher import OffsetResetStrategy
    from aiokafka.structs import TopicPartition

    Fetcher = fetcher_module.Fetcher
    tp = TopicPartition("gpu.samples", 0)
    client = _Recorder()

    async def send(node_id, request):  # the old leader: NOT_LEADER_FOR_PARTITION (6)
        return SimpleNamespace(API_VERSION=1, topics=[(tp.topic, [(tp.partition, 6, -1, -1)])])

    client.send = send
    fetcher = SimpleNamespace(_client=client, _retry_backoff=0, _isolation_level=0)
    fetcher._proc_offset_request = lambda node_id, data: Fetcher._proc_offset_request(fetcher, node_id, data)
    state = SimpleNamespace(has_valid_position=False, awaiting_reset=True, reset_strategy=OffsetResetStrategy.EARLIEST)
    asyncio.run(Fetcher._update_fetch_positions(fetcher, SimpleNamespace(state_value=lambda _: state), 1, [tp]))
    assert state.awaiting_reset, "the reset failed and waits for the next try"
    return client.refreshes == 0


def _offset_fetch_group_error(coordinator_module) -> bool:
    """OffsetFetch v3 answered NOT_COORDINATOR at the group level: read as "nothing committed"?"""
    from aiokafka.protocol.commit import OffsetFetchResponse_v3
    from aiokafka.structs import TopicPartition

    coordinator = _Recorder()
    coordinator.group_id = "g"

    async def send_req(request):
        return OffsetFetchResponse_v3(0, [], 16)

    coordinator._send_req = send_req
    try:
        offsets = asyncio.run(coordinator_module.GroupCoordinator._do_fetch_commit_offsets(
            coordinator, [TopicPartition("gpu.samples", 0)]))
    except Exception:  # noqa: BLE001 - any error is not "nothing committed"
        return False
    return offsets == {}


def _seek_on_consumer_thread(consumer_module) -> bool:
    """Does faust's seek call aiokafka's from the caller's (the event loop's) thread?"""
    consumer = _concrete(consumer_module.ThreadDelegateConsumer)
    seeks = []
    on_thread = [False]

    class Thread:
        def seek(self, partition, offset):
            seeks.append(on_thread[0])

        async def call_thread(self, fun, *args):
            on_thread[0] = True
            try:
                return await fun(*args)
            finally:
                on_thread[0] = False

    consumer._thread = Thread()
    asyncio.run(consumer._seek(("gpu.xid", 0), 5))
    assert len(seeks) == 1
    return seeks == [False]


def _never_committed_from_beginning(driver_module) -> bool:
    """After a rebalance, does a partition the group never committed keep its fetch position?"""
    from aiokafka.structs import TopicPartition

    thread = _concrete(driver_module.AIOKafkaConsumerThread)
    fresh, placed = TopicPartition("gpu.xid", 0), TopicPartition("gpu.xid", 1)
    rewound = []

    class AioConsumer:  # aiokafka's seek_to_committed: None for a partition never committed
        async def seek_to_committed(self):
            return {fresh: None, placed: 42}

    async def call_thread(fun, *args):
        return await fun(*args)

    async def seek_to_beginning(*partitions):
        rewound.extend(partitions)

    thread.call_thread, thread.seek_to_beginning = call_thread, seek_to_beginning
    thread._ensure_consumer = AioConsumer
    thread.consumer = SimpleNamespace(app=SimpleNamespace(topics=SimpleNamespace(acks_enabled_for=lambda t: True)))
    assert asyncio.run(thread.seek_to_committed()) == {fresh: None, placed: 42}
    assert placed not in rewound
    return fresh not in rewound


def _livelock_check_without_position(driver_module) -> bool:
    """Does faust's livelock check crash on a partition waiting for its offset reset?"""
    import time

    from aiokafka.consumer.subscription_state import Assignment
    from aiokafka.structs import TopicPartition
    from faust.types import TP

    tp = TopicPartition("gpu.xid", 6)

    async def make():  # aiokafka's partition states hold futures of a running loop
        return Assignment({tp})

    assignment = asyncio.run(make())
    now = time.monotonic()
    state = assignment.state_value(tp)
    state.await_reset("earliest")  # what seek_to_beginning does
    state.timestamp = now * 1000  # fetched just now: faust's own fetch check passes
    thread = _concrete(driver_module.AIOKafkaConsumerThread)
    subscription = SimpleNamespace(assignment=assignment)
    aio = SimpleNamespace(_fetcher=SimpleNamespace(_subscriptions=SimpleNamespace(subscription=subscription)))
    thread._ensure_consumer = lambda: aio
    thread.time_started, thread.tp_fetch_request_timeout_secs, thread.tp_stream_timeout_secs = now, 60.0, 60.0
    thread.consumer = SimpleNamespace(app=SimpleNamespace(
        monitor=SimpleNamespace(stream_inbound_time={}), topics=SimpleNamespace(acks_enabled_for=lambda t: True)))
    try:
        thread.verify_event_path(now, TP(tp.topic, tp.partition))
    except AssertionError:
        return True
    return False


def _fetch_across_rebalance(driver_module) -> bool:
    """A fetch handed faust's live set of active partitions after a rebalance emptied it: does it
    take every partition's records?"""
    import contextlib

    from aiokafka.structs import TopicPartition

    tp = TopicPartition("gpu-state-changelog", 0)
    seeks = []

    class Fetcher:
        _closed = False
        _subscriptions = SimpleNamespace(fetch_context=contextlib.nullcontext)

        async def fetched_records(self, partitions, timeout=0, max_records=None):
            # aiokafka 0.14's Fetcher.fetched_records: ``if partitions and tp not in partitions``
            # skips a partition, so an empty set takes them all
            return {t: [SimpleNamespace(offset=7)] for t in (tp,) if not (partitions and t not in partitions)}

    aio = SimpleNamespace(_closed=False, _fetcher=Fetcher(), seek=lambda t, offset: seeks.append((t, offset)))
    thread = _concrete(driver_module.AIOKafkaConsumerThread)
    thread.consumer = SimpleNamespace(flow_active=True, app=SimpleNamespace(consumer_generation_id=1))
    live: set = set()  # emptied by the rebalance while the fetch waited
    records = asyncio.run(thread._fetch_records(aio, live, timeout=0.0))
    return bool(records)


def _gap_offsets_acked_twice(consumer_module) -> bool:
    """Offsets of a gap read after all: do the partition's commits crawl?"""
    from faust.types import TP

    c = _consumer_with_offsets(consumer_module)
    tp = TP("gpu.samples", 0)
    c._committed_offset[tp] = 151
    c._gap[tp].addi(151, 221)
    _ack(c, tp, 220)
    assert c._new_offset(tp) == 221
    c._committed_offset[tp] = 221
    c._gap[tp].addi(221, 300)  # a second gap, then its records after all
    for offset in range(221, 300):
        _ack(c, tp, offset)
    return c._new_offset(tp) != 300


def _dropped_records_committed_past(consumer_module) -> bool:
    """Committed 3 (the next to read), 4 and 5 acked: is record 3 committed past?"""
    from faust.types import TP

    c = _consumer_with_offsets(consumer_module)
    tp = TP("gpu.xid", 6)
    c._committed_offset[tp] = 3
    for offset in (4, 5):
        _ack(c, tp, offset)

    async def run():
        committed = c._new_offset(tp)
        await asyncio.sleep(0)
        return committed

    committed = asyncio.run(run())
    if committed is None:
        assert c.seeks == [(tp, 3)], "nothing committed, and the hole read again"
    return committed == 6


def _consumer_with_offsets(consumer_module):
    import logging

    c = _concrete(consumer_module.Consumer)
    c._acked, c._acked_index = defaultdict(list), defaultdict(set)
    c._gap, c._committed_offset = defaultdict(IntervalTree), defaultdict(lambda: None)
    c._rewound, c.seeks, c.log = {}, [], logging.getLogger("test")

    async def seek(tp, offset):
        c.seeks.append((tp, offset))

    c.seek = seek
    return c


def _ack(consumer, tp, offset):  # faust's Consumer.ack, the bookkeeping part
    if offset not in consumer._acked_index[tp]:
        consumer._acked_index[tp].add(offset)
        consumer._acked[tp].append(offset)


DEFECTS = {
    "offset_reset_stale_leader": ("aiokafka.consumer.fetcher", _offset_reset_stale_leader),
    "offset_fetch_group_error": ("aiokafka.consumer.group_coordinator", _offset_fetch_group_error),
    "seek_on_consumer_thread": ("faust.transport.consumer", _seek_on_consumer_thread),
    "never_committed_from_beginning": ("faust.transport.drivers.aiokafka", _never_committed_from_beginning),
    "livelock_check_without_position": ("faust.transport.drivers.aiokafka", _livelock_check_without_position),
    "fetch_across_rebalance": ("faust.transport.drivers.aiokafka", _fetch_across_rebalance),
    "gap_offsets_acked_twice": ("faust.transport.consumer", _gap_offsets_acked_twice),
    "dropped_records_committed_past": ("faust.transport.consumer", _dropped_records_committed_past),
}


def test_every_mend_has_a_defect_check_and_a_patch_and_nothing_else_is_there():
    assert set(DEFECTS) == set(faust_mends.MODULES)
    assert {p.stem for p in PATCHES.glob("*.patch")} == set(faust_mends.MODULES)
    for name in faust_mends.MODULES:
        doc = importlib.import_module(f"xidstream.streams.faust_mends.{name}").__doc__
        assert f"patches/{name}.patch" in doc, f"{name}'s docstring names its patch file"


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_the_upstream_defect_is_still_there(name):
    module, shows = DEFECTS[name]
    assert shows(importlib.import_module(module)), (
        f"the installed {module} no longer shows the defect streams/faust_mends/{name}.py mends: upstream "
        f"fixed it; remove the mend, its patch file and its entry here (and re-run bench/faust_surgery.py)")


def _apply(patch: str, tree: Path) -> None:
    """Apply a unified diff (``--- a/<path>``) to the files under `tree`: every hunk's context and
    removed lines must match exactly where the hunk says (no fuzz, no offset)."""
    path = tree / re.search(r"^\+\+\+ b/(\S+)", patch, re.M).group(1)
    old = path.read_text().splitlines(keepends=True)
    out, at = [], 0
    for hunk in re.split(r"^(?=@@ )", patch[patch.index("\n@@ ") + 1:], flags=re.M):
        if not hunk:
            continue
        head, *body = hunk.splitlines(keepends=True)
        start = int(re.match(r"@@ -(\d+)", head).group(1)) - 1
        out += old[at:start]
        at = start
        for line in body:
            tag, text = line[0], line[1:]
            if tag in " -":
                assert old[at] == text, f"{path.name}:{at + 1}: expected {text!r}, found {old[at]!r}"
                at += 1
            if tag in " +":
                out.append(text)
    path.write_text("".join(out + old[at:]))


def _patched(name: str, tmp_path: Path):
    """The upstream module of `name`'s defect with its patch applied, loaded under another name."""
    module = DEFECTS[name][0]
    rel = Path(*module.split(".")).with_suffix(".py")
    (tmp_path / rel).parent.mkdir(parents=True)
    shutil.copy(SITE / rel, tmp_path / rel)
    patch = (PATCHES / f"{name}.patch").read_text()
    assert f"--- a/{rel.as_posix()}\n" in patch, "the patch is against the module the defect is in"
    if shutil.which("patch"):  # GNU patch agrees that it applies as it is
        subprocess.run(["patch", "-p1", "--dry-run", "-F0", "-d", str(tmp_path)], input=patch, text=True,
                       check=True, capture_output=True)
    _apply(patch, tmp_path)
    spec = importlib.util.spec_from_file_location(f"_patched_{name}", tmp_path / rel)
    patched = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = patched  # dataclasses and typing look their module up
    try:
        spec.loader.exec_module(patched)
    finally:
        del sys.modules[spec.name]
    return patched


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_the_patch_applies_to_the_installed_upstream_file_and_mends_the_defect(name, tmp_path):
    module, shows = DEFECTS[name]
    assert not shows(_patched(name, tmp_path)), f"patches/{name}.patch applied, {module} still shows the defect"
