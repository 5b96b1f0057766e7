"""Processor failover on the real broker.

Both tests feed the motivating incident (`scenarios/motivating-incident.yaml`, through the real
collector code into a `MemorySink`) in two halves split at scenario time `CUT_S`: the first half
opens the incident (Xid 13 at +120 s: APP_FAULT, `RECORD`) and holds the wedge evidence (Xid 43 and
the driver's recovery failure at +122 s, pinned samples from +123 s); the second half carries the
rest of the pinned minute, after which the same incident becomes GPU_WEDGED (+183 s) with
`CORDON_NODE`, `DRAIN_NODE`, `RESET_GPU`. A worker that lost the GPU's table row in between would
open a new incident (its id is derived from the opening record, `xidstream.streams.classify`) or, missing the
Xid 43 and the first 27 pinned seconds, not call the GPU wedged at all.

The worker is stopped only after the group committed the first half (`WorkerProcess.wait_idle`):
what comes after must come from the table state, not from re-reading the inputs (which, the ids
being deterministic, would hide a lost row).

The reference is the pure path (`xidstream.streams.engine.Engine`, the same decisions as a single worker's
replay): the same incident id, the same `command_id` for every step.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from aiokafka.partitioner import DefaultPartitioner
from confluent_kafka import (Consumer, ConsumerGroupState, ConsumerGroupTopicPartitions, KafkaException, Producer,
                             TopicPartition)
import pytest

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import encode, load_scenario
from xidstream.schemas.models import Alert, DeadLetter, RemediationCommand
from xidstream.schemas.topics import INPUT_TOPICS
from xidstream.schemas.vocab import Action, Classification
from xidstream.streams.app import internal_topics
from xidstream.streams.engine import Engine
from xidstream.transport.kafka import admin, consume_records, consumer_config, producer_config
from xidstream.runner import WorkerProcess

# slow (make test-all only): workers killed and restarted over their changelogs
pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "scenarios" / "motivating-incident.yaml"
GPU1 = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"  # the GPU that wedges
GPU0 = "GPU-3f1a9c2e-7b44-4d1e-9e0a-5c2b8d7f6a10"  # healthy throughout
CUT_S = 150  # scenario seconds: after the APP_FAULT and its RECORD (+120 s), before the wedge verdict (+183 s)
PLAN = [Action.RECORD, Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]


def _scenario():
    """The scenario's records (what the collectors publish), its two halves and the reference."""
    sc = load_scenario(SCENARIO)
    sink = MemorySink()
    ScenarioRunner(sc, sink).run()
    cut = sc.start.timestamp() + CUT_S
    first = [r for r in sink.records if r.ts.timestamp() < cut]
    rest = [r for r in sink.records if r.ts.timestamp() >= cut]
    return first, rest, Engine().run(list(sink.records))


def _healthy_fleet(records, n):
    """One sample each of `n` other GPUs (nodes of their own), at the time of `records`' first."""
    from xidstream.schemas.models import GpuSample

    first = next(r for r in records if isinstance(r, GpuSample))
    return [first.model_copy(update={"gpu_uuid": f"GPU-{i:08d}-7777-7777-7777-777777777777", "node": f"filler-{i}",
                                     "event_id": f"filler-{i}"}) for i in range(n)]


def _publish(settings, records) -> None:
    p = Producer(producer_config(settings))
    for r in records:
        topic, key = settings.topics.for_record(r)
        p.produce(topic, key=key, value=encode(r))
    assert p.flush(30) == 0


def _partition(settings, gpu: str) -> int:
    # aiokafka's own partitioner: the partition faust's producers and our murmur2 ones pick
    parts = list(range(settings.partitions))
    return DefaultPartitioner()(gpu.encode(), parts, parts)


def _watched(settings) -> list[str]:
    """Every topic the processor consumes: idle means all of them are committed."""
    reg = settings.topics
    return [reg.name(n) for n in INPUT_TOPICS] + [reg.name("gpu.remediation.results"), *internal_topics(settings)]


class Outputs:
    """gpu.alerts, gpu.remediation and xidstream.deadletter from the beginning, read by a consumer
    that joins no group (assign(), like the replay's scripted executor)."""

    def __init__(self, settings) -> None:
        reg = settings.topics
        topics = [reg.name(n) for n in ("gpu.alerts", "gpu.remediation", "xidstream.deadletter")]
        md = admin(settings).list_topics(timeout=10)
        self.consumer = Consumer(consumer_config(settings, f"{settings.topic_prefix}failover-reader"))
        self.consumer.assign([TopicPartition(t, p, 0) for t in topics for p in md.topics[t].partitions])
        self.records: list = []

    def read(self, timeout: float = 0.5) -> None:
        self.records += list(consume_records(self.consumer, timeout))

    def until(self, done, timeout: float, workers=()) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read()
            if done(self):
                return True
            for w in workers:
                assert w.alive(), f"worker {w.name} exited (code {w.proc.returncode}):\n{w.tail()}"
        return False

    def settle(self, quiet: float = 3.0, timeout: float = 30.0) -> None:
        """Until nothing new arrived for `quiet` seconds (late re-emissions)."""
        deadline, n, since = time.monotonic() + timeout, len(self.records), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < quiet:
            self.read()
            if len(self.records) != n:
                n, since = len(self.records), time.monotonic()

    def alerts(self, gpu: str) -> list[Alert]:
        return [r for r in self.records if isinstance(r, Alert) and r.gpu_uuid == gpu]

    def commands(self, gpu: str) -> list[RemediationCommand]:
        return [r for r in self.records if isinstance(r, RemediationCommand) and r.gpu_uuid == gpu]

    def dead(self) -> list[DeadLetter]:
        return [r for r in self.records if isinstance(r, DeadLetter)]

    def close(self) -> None:
        self.consumer.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metric(port: int, name: str) -> int:
    """A worker's `xidstream_processor_<name>_total` from its /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return int(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                    if line.startswith(f"xidstream_processor_{name}_total ")))


def _idle(worker: WorkerProcess, settings, timeout: float = 60) -> None:
    """The group committed everything the processor reads (`WorkerProcess.wait_idle`); else fail
    naming the partitions behind."""
    topics = _watched(settings)
    if worker.wait_idle(topics, timeout=timeout):
        return
    client = admin(settings)
    md = client.list_topics(timeout=10)
    tps = [TopicPartition(t, p) for t in topics for p in md.topics[t].partitions]
    fut = client.list_consumer_group_offsets([ConsumerGroupTopicPartitions(worker.group, tps)])[worker.group]
    committed = {(tp.topic, tp.partition): tp.offset for tp in fut.result().topic_partitions}
    consumer = Consumer(consumer_config(settings, f"{settings.topic_prefix}failover-lag"))
    try:
        behind = {}
        for tp in tps:
            high = consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
            if high > max(committed.get((tp.topic, tp.partition), 0), 0):
                behind[f"{tp.topic}[{tp.partition}]"] = (committed.get((tp.topic, tp.partition)), high)
    finally:
        consumer.close()
    raise AssertionError(f"group {worker.group} has not committed what it read within {timeout:g} s; "
                         f"(committed, end offset) of the partitions behind: {behind}\n{worker.tail()}")


def _members(client, group: str) -> dict[str, set[tuple[str, int]]] | None:
    """member id -> assigned (topic, partition), while the group is stable; None otherwise."""
    try:
        desc = client.describe_consumer_groups([group], request_timeout=10)[group].result()
    except KafkaException:
        return None
    if desc.state != ConsumerGroupState.STABLE:
        return None
    return {m.member_id: {(tp.topic, tp.partition) for tp in m.assignment.topic_partitions} for m in desc.members}


def _wait_members(client, group: str, n: int, topic: str, partitions: int, timeout: float, workers=()):
    """Until the group is stable with `n` members that between them own every partition of `topic`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        members = _members(client, group)
        if members and len(members) == n:
            owned = {p for tps in members.values() for t, p in tps if t == topic}
            if owned == set(range(partitions)):
                return members
        for w in workers:
            assert w.alive(), f"worker {w.name} exited (code {w.proc.returncode}):\n{w.tail()}"
        time.sleep(0.3)
    raise AssertionError(f"{group} not stable with {n} member(s) owning {topic} within {timeout:g} s: "
                         f"{_members(client, group)}\n" + "\n".join(w.tail(15) for w in workers))


def _check_incident(out: Outputs, reference: Engine) -> None:
    """One incident for the wedged GPU, every step of the plan under the reference's command ids,
    nothing for the healthy GPU, no dead letter."""
    ref_cmds = {c.command_id: c.action for c in reference.commands if c.gpu_uuid == GPU1}
    (ref_incident,) = {c.incident_id for c in reference.commands if c.gpu_uuid == GPU1}
    assert sorted(ref_cmds.values(), key=PLAN.index) == PLAN  # the reference itself is the scenario's plan
    alerts, commands = out.alerts(GPU1), out.commands(GPU1)
    assert {a.incident_id for a in alerts} | {c.incident_id for c in commands} == {ref_incident}, \
        [(type(r).__name__, r.incident_id) for r in alerts + commands]
    assert Classification.GPU_WEDGED in {a.classification for a in alerts}
    # at-least-once: a step may be re-emitted, but only under the command_id of its first emission
    seen = {}
    for c in commands:
        assert seen.setdefault(c.command_id, c.action) == c.action, c
    assert seen == ref_cmds, (seen, ref_cmds)
    assert not out.alerts(GPU0) and not out.commands(GPU0)
    assert not out.dead(), out.dead()


def _wedged(out: Outputs) -> bool:
    return any(a.classification == Classification.GPU_WEDGED for a in out.alerts(GPU1))


def _log_tables(text: str, title: str) -> list[dict[tuple[str, int], int]]:
    """faust's recovery tables titled `title` in a worker's log, in order: (topic, partition) ->
    offset. faust logs them at INFO (`faust.tables.recovery`), a ditto mark for a repeated topic:

        +Reading Starts At - Active---------------+-----------+--------+
        | topic                                   | partition | offset |
        +-----------------------------------------+-----------+--------+
        | t1.xidstream-processor-gpu-state-changelog | 0      | 161    |
        | 〃                                      | 1         | -1     |
        +-----------------------------------------+-----------+--------+
    """
    lines = text.splitlines()
    tables = []
    for i, line in enumerate(lines):
        if not line.startswith(f"+{title}-"):
            continue
        rows: dict[tuple[str, int], int] = {}
        topic = None
        for row in lines[i + 1:]:
            if not row.startswith("|"):
                if rows:
                    break  # the rule under the last row (the one under the header comes first)
                continue
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            if len(cells) != 3 or not cells[1].isdigit():
                continue  # the header
            topic = topic if cells[0] == "〃" else cells[0]
            rows[(topic, int(cells[1]))] = int(cells[2])
        tables.append(rows)
    return tables


def _log_times(text: str, message: str) -> list[float]:
    """Epoch seconds of a worker's log lines that contain `message` (faust stamps local time)."""
    return [datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for line in text.splitlines() if message in line and line.startswith("[")]


def test_sigkill_of_the_incident_gpus_worker_mid_incident(kafka_settings, tmp_path):
    """Two workers in one group; the one that owns the wedged GPU's partition is SIGKILLed after
    the incident opened (RECORD emitted) and before its wedge verdict (CORDON, DRAIN, RESET). The
    survivor must take the partition, find the incident's row, finish the plan under the same
    incident and command ids, and start within a bounded time.

    What carries the row is the changelog. With the memory store a table partition has no persisted
    offset (faust's `MemoryStore.persisted_offset` is None), so when the survivor's standby replica
    of that partition (table_standby_replicas=1) becomes active, faust's recovery reads the
    changelog partition again from its start (the survivor's log: "Reading Starts At - Active" at
    -1 for it, printed below). The standby copy is current, but recovery does not start from it.
    """
    s = kafka_settings
    first, rest, reference = _scenario()
    p = _partition(s, GPU1)
    samples = s.topics.name("gpu.samples")
    changelog = f"{s.topic_prefix}xidstream-processor-gpu-state-changelog"
    client = admin(s)
    # The processor's own group timeouts (session 6 s, heartbeats 1 s, rebalance 10 s; create_app),
    # not the one-broker test ones: the failover figure is the one a deployment gets.
    ports = {"a": _free_port(), "b": _free_port()}  # /metrics: records folded per worker
    a, b = (WorkerProcess(s, tmp_path, name=n, loglevel="info", fast_rebalance=False,
                          extra_args=["--web-port", str(ports[n])]) for n in ("a", "b"))
    out = None
    try:
        # One at a time, so each member id is known to be its process's: a member keeps its id
        # across rebalances, so the member that is not a's is b's.
        a.start()
        (a_id,) = _wait_members(client, a.group, 1, samples, s.partitions, 60, [a])
        b.start()
        members = _wait_members(client, a.group, 2, samples, s.partitions, 60, [a, b])
        assert a_id in members, f"worker a rejoined under a new member id: {members}"
        (b_id,) = set(members) - {a_id}
        workers = {a_id: a, b_id: b}
        owner_id = next(m for m, tps in members.items() if (samples, p) in tps)
        (survivor_id,) = set(workers) - {owner_id}
        owner, survivor = workers[owner_id], workers[survivor_id]
        fleet_owner = next(workers[m].name for m, tps in members.items() if (f"{s.topic_prefix}xidstream.fleet", 0) in tps)

        _publish(s, first)
        out = Outputs(s)
        assert out.until(lambda o: Action.RECORD in {c.action for c in o.commands(GPU1)}, 60, [a, b]), \
            f"no RECORD for the incident:\n{a.tail()}\n{b.tail()}"
        # committed, so the survivor starts after the first half and needs the row (see the module doc)
        _idle(survivor, s)
        out.read()
        # mid-incident: the rest is to come (a rebalance may re-emit, under the same command_id)
        assert {(c.command_id, c.action) for c in out.commands(GPU1)} == {(out.commands(GPU1)[0].command_id, Action.RECORD)}
        assert not _wedged(out)

        folded_by_owner = _metric(ports[owner.name], "events")
        assert folded_by_owner + _metric(ports[survivor.name], "events") >= len(first)
        t_kill, wall_kill = time.monotonic(), time.time()
        owner.stop(signal.SIGKILL)
        _publish(s, rest)  # waits on the broker for the survivor
        t_assigned = None
        while time.monotonic() - t_kill < 90 and not _wedged(out):
            if t_assigned is None:
                now = _members(client, a.group)
                if now and set(now) == {survivor_id} and (samples, p) in now[survivor_id]:
                    t_assigned = time.monotonic() - t_kill
            out.read()
            assert survivor.alive(), survivor.tail()
        t_processed = time.monotonic() - t_kill
        assert _wedged(out), f"no GPU_WEDGED alert from the survivor within 90 s:\n{survivor.tail()}"
        text = survivor.log_path.read_text(errors="replace")
        recovered = _log_tables(text, "Reading Starts At - Active")[-1]
        ready = [t - wall_kill for t in _log_times(text, "Worker ready") if t >= wall_kill]
        print(f"\nfailover: SIGKILLed worker {owner.name} (it owned the wedged GPU's partition {p}; the fleet "
              f"partition was on {fleet_owner}); survivor {survivor.name}: assigned the partition "
              f"{'?' if t_assigned is None else f'{t_assigned:.1f}'} s after the kill, recovered it (reading "
              f"changelog partition {p} from offset {recovered.get((changelog, p))}) and ready "
              f"{f'{ready[0]:.1f}' if ready else '?'} s after, its wedge verdict seen {t_processed:.1f} s after")

        assert out.until(lambda o: {c.action for c in o.commands(GPU1)} >= set(PLAN), 60, [survivor]), \
            f"commands: {[c.action.value for c in out.commands(GPU1)]}\n{survivor.tail()}"
        out.settle()
        _check_incident(out, reference)
        # every input record was folded: the dead worker's count up to the kill, the survivor's in all
        folded = folded_by_owner + _metric(ports[survivor.name], "events")
        print(f"folded {folded} input records for {len(first) + len(rest)} published")
        assert folded >= len(first) + len(rest), (folded, len(first) + len(rest))
        # the goal is <= 10 s (6 s session + a heartbeat + the rebalance + the changelog); 30 s is
        # for a loaded 2-core test machine, and still far from faust's own 60 s session
        assert t_processed <= 30, f"the survivor took {t_processed:.1f} s to process the dead worker's partition"
        # Last: the group commits what the survivor folded, so lag reads 0 again (what an operator's
        # lag alert, `WorkerProcess.wait_idle` and a later failover rely on).
        t_commit = time.monotonic()
        _idle(survivor, s, timeout=30)
        print(f"the group committed every input {time.monotonic() - t_commit:.1f} s after the last command")
    finally:
        if out is not None:
            out.close()
        a.stop()
        b.stop()


def _persisted_offsets(data_dir: Path, table: str) -> dict[int, int]:
    """The changelog offset faust's rocksdb:// store keeps in each partition's database (its key
    `__faust\\0offset__`): the last changelog record the store holds. Read with the worker stopped."""
    from rocksdict import AccessType, Options, Rdict

    found = {}
    for path in data_dir.rglob(f"{table}-*.db"):
        db = Rdict(str(path), options=Options(raw_mode=True), access_type=AccessType.read_only())
        try:
            value = db.get(b"__faust\x00offset__")
        finally:
            db.close()
        if value is not None:
            found[int(path.name[len(table) + 1:-3])] = int(value)
    return found


def _end_offsets(settings, topic: str) -> dict[int, int]:
    client = admin(settings)
    parts = client.list_topics(topic, timeout=10).topics[topic].partitions
    consumer = Consumer(consumer_config(settings, f"{settings.topic_prefix}failover-offsets"))
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1] for p in parts}
    finally:
        consumer.close()


def _start_and_recover(worker: WorkerProcess, changelog: str) -> tuple[dict, dict]:
    """Start the worker, wait until faust's recovery is complete; the first recovery's highwaters
    and start offsets for `changelog` (partition -> offset)."""
    worker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = worker.log_path.read_text(errors="replace")
        if "Worker ready" in text:
            break
        assert worker.alive(), worker.tail()
        time.sleep(0.3)
    else:
        raise AssertionError(f"worker {worker.name} not ready within 60 s:\n{worker.tail()}")
    high = _log_tables(text, "Highwater - Active")[0]
    start = _log_tables(text, "Reading Starts At - Active")[0]
    return ({p: o for (t, p), o in high.items() if t == changelog}, {p: o for (t, p), o in start.items() if t == changelog})


def _first_half_then_stop(s, w: WorkerProcess, first, fillers: int) -> Outputs:
    """`w` (started) folds `fillers` healthy GPUs and the incident's first half up to its RECORD,
    commits it all and stops cleanly (SIGTERM); a reader of the outputs from their beginning."""
    _publish(s, _healthy_fleet(first, fillers))
    _publish(s, first)
    out = Outputs(s)
    try:
        assert out.until(lambda o: Action.RECORD in {c.action for c in o.commands(GPU1)}, 60, [w]), w.tail()
        _idle(w, s)
        w.stop()  # SIGTERM: faust flushes and closes its stores
        assert w.proc.returncode == 0, w.tail()
    except BaseException:
        out.close()
        raise
    return out


def _second_half(s, w: WorkerProcess, out: Outputs, rest, reference: Engine) -> None:
    """`w` gets the incident's second half and finishes it: every command of the plan, the same
    incident and command ids as the pure path."""
    _publish(s, rest)
    assert out.until(lambda o: {c.action for c in o.commands(GPU1)} >= set(PLAN), 60, [w]), \
        f"commands: {[c.action.value for c in out.commands(GPU1)]}\n{w.tail()}"
    _idle(w, s)
    out.read(1.0)
    _check_incident(out, reference)


def test_rocksdb_restart_reads_only_the_changelog_tail(kafka_settings, tmp_path):
    """A worker with `--store rocksdb://` folds the first half of the incident, stops cleanly
    (SIGTERM), and restarts on the same data dir: its recovery starts at the changelog offset its
    store kept on disk, so it reads none of the changelog again (a memory:// worker, or one whose
    data dir is gone, reads all of it), and it goes on with the same incident.

    The signal is faust's own recovery log (INFO): per changelog partition the highwater and the
    offset reading starts at. Before the restart, the offsets the store keeps are compared with the
    changelog's end offsets read from the broker. The last step wipes the data dir and restarts
    once more: reading then starts at -1 (the whole partition), so the signal tells the two apart.
    """
    s = kafka_settings
    first, rest, reference = _scenario()
    p = _partition(s, GPU1)
    changelog = f"{s.topic_prefix}xidstream-processor-gpu-state-changelog"
    w = WorkerProcess(s, tmp_path, name="rocks", loglevel="info", extra_args=["--store", "rocksdb://"])
    out = None
    try:
        w.start()
        # Rows are written once per batch and only when what they persist changes, so
        # the incident alone leaves a changelog of a few records: 400 more GPUs, one row each,
        # make one that a replay cannot hide in.
        out = _first_half_then_stop(s, w, first, 400)
        w.log_path.rename(tmp_path / "rocks-first.log")

        ends = _end_offsets(s, changelog)
        persisted = _persisted_offsets(w.data_dir, "gpu-state")
        assert ends[p] >= 20, f"a changelog too small to tell a replay from none: {ends}"
        # every partition with rows: the store holds its changelog up to the last record
        assert persisted == {q: end - 1 for q, end in ends.items() if end > 0}, (persisted, ends)

        high, start = _start_and_recover(w, changelog)
        remaining = {q: high[q] - start[q] for q in high}
        print(f"\nrocksdb restart: changelog end offsets {ends}; recovery highwaters {high}, reading starts at "
              f"{start}: {sum(remaining.values())} changelog records to read again")
        assert high[p] == ends[p] - 1, (high, ends)
        assert remaining == {q: 0 for q in high}, f"the restart reads the changelog again: {remaining}"

        # the same decisions after the restart: the second half finishes the incident
        _second_half(s, w, out, rest, reference)

        # the control: without the data dir the same restart reads the whole changelog
        w.stop()
        w.log_path.rename(tmp_path / "rocks-second.log")
        shutil.rmtree(w.data_dir)
        high, start = _start_and_recover(w, changelog)
        print(f"rocksdb restart without its data dir: reading starts at {start} (highwaters {high})")
        assert start[p] == -1 and high[p] >= ends[p] - 1, (start, high)
    finally:
        if out is not None:
            out.close()
        w.stop()


def test_recovery_reads_again_changelog_records_it_lost(kafka_settings, tmp_path):
    """In 3 of about 80 failover-bench kills the survivor's table recovery read nothing for
    good (aiokafka had read every changelog partition to its end; the records never reached
    recovery) and the worker processed nothing more. The worker that restarts here loses each
    changelog record once, right before recovery's queue (`lose_changelog_once/sitecustomize.py`):
    its recovery must notice that it waits for records already read past, read them again, finish,
    and go on with the same incident from the restored row. Before the watch
    (`FastConsumer._watch_recovery`), that worker never became ready."""
    s = kafka_settings
    first, rest, reference = _scenario()
    changelog = f"{s.topic_prefix}xidstream-processor-gpu-state-changelog"
    w = WorkerProcess(s, tmp_path, name="first", loglevel="info")
    out = None
    lossy = None
    try:
        w.start()
        out = _first_half_then_stop(s, w, first, 200)

        # the injector's folder first on the path, so that its sitecustomize is the one Python loads
        path = os.pathsep.join(p for p in (str(Path(__file__).parent / "lose_changelog_once"),
                                           os.environ.get("PYTHONPATH")) if p)
        lossy = WorkerProcess(s, tmp_path, name="lossy", loglevel="info",
                              env={"PYTHONPATH": path, "XIDSTREAM_TEST_LOSE_CHANGELOG_ONCE": "1"})
        high, start = _start_and_recover(lossy, changelog)
        text = lossy.log_path.read_text(errors="replace")
        assert sum(o + 1 for o in high.values() if o >= 0) >= 100 and set(start.values()) == {-1}, (high, start)
        assert "recovery (stalled); reading them again" in text, lossy.tail()

        _second_half(s, lossy, out, rest, reference)
    finally:
        if out is not None:
            out.close()
        w.stop()
        if lossy is not None:
            lossy.stop()


def test_a_fetch_over_an_emptied_partition_set_takes_nothing_and_records_put_back_are_read_again(kafka_settings):
    """The cause of the stall above, found with an in-process sampler on the failover bench: faust
    hands aiokafka its live set of active partitions; a rebalance empties it (every partition
    paused while tables recover) while a fetch from before it still waits, and aiokafka reads an
    empty set as "every partition": that fetch took the changelog records table recovery had just
    sought, and faust dropped them. On the real broker and aiokafka: the trap itself, that
    `faust_fast._Wanted` over an empty set takes nothing, and that `_put_back` makes records handed
    over (and not delivered) come again."""
    import asyncio

    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition as KTP

    from xidstream.streams.faust_fast import _put_back, _Wanted
    from xidstream.transport.kafka import create_topics

    s = kafka_settings
    create_topics(s, names=["gpu.xid"])
    topic = s.topics.name("gpu.xid")
    p = Producer(producer_config(s))
    for part in (0, 1):
        for i in range(3):
            p.produce(topic, key=f"k{i}".encode(), value=f"v{part}-{i}".encode(), partition=part)
    assert p.flush(30) == 0

    async def run():
        c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
        await c.start()
        try:
            tps = [KTP(topic, 0), KTP(topic, 1)]
            c.assign(tps)
            fetcher = c._fetcher
            live: set = set()  # faust's set, emptied by a rebalance
            assert await fetcher.fetched_records(_Wanted(live), timeout=3.0) == {}
            taken = await fetcher.fetched_records(set(), timeout=5.0)  # aiokafka: empty = every partition
            assert {tp.partition: [r.value for r in rs] for tp, rs in taken.items()} == \
                {0: [b"v0-0", b"v0-1", b"v0-2"], 1: [b"v1-0", b"v1-1", b"v1-2"]}
            assert [await c.position(tp) for tp in tps] == [3, 3]  # handed over: read past
            _put_back(c, taken)
            live.add(tps[1])
            again = await fetcher.fetched_records(_Wanted(live), timeout=5.0)
            assert {tp.partition: [r.offset for r in rs] for tp, rs in again.items()} == {1: [0, 1, 2]}
            assert await c.position(tps[0]) == 0  # put back, not asked for: waits where it was
        finally:
            await c.stop()

    asyncio.run(run())
