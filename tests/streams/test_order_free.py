"""Verdicts whatever the read order: the same records folded in many interleavings of their topics
give the same verdicts at the same event times.

A worker reads its topics in parallel; Kafka keeps only each partition's order, and a GPU's records
of one kind are in one partition. So an interleaving keeps each (record type, GPU) sequence in order
and mixes the sequences freely: one GPU's samples may all be read before its process lists, or its
Xids minutes after the samples that followed them.

What must not depend on that (any interleaving): every node-level command and GPU reset (action,
GPU, time, expiry, the rule that decided it) and the time each GPU was first found wedged or faulty
by each rule. What holds when no topic
is read more than a minute of event time behind another (a worker that keeps up): every command and
the first time of every verdict. A verdict that rests on an absence ("no Xid explains this pin",
"healthy with no new Xid") is read as of the records read so far, so an Xid read many minutes late
can add a phantom-load record or a quarantine before the wedge (docs/architecture.md "Known limits"); the fleet
breaker decides in the order commands reach it (README, ditto), so its storm alert is not compared.
"""

from __future__ import annotations

import random
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import Classification, load_scenario
from xidstream.schemas.vocab import NODE_ACTIONS, Action
from xidstream.streams.engine import Engine
from tests.streams.builders import GPU, NODE, PCI, at, inventory, procs, sample, xid, workload
from xidstream.schemas import ComputeApp, GpuProcesses, WorkloadEvent, XidEvent
from tests.tools import examples

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
# Every library scenario the pure engine can run alone (the others answer commands through
# `xidstream replay`'s command lookup, tests/integration/test_replay_scenarios.py).
NAMES = sorted(p.stem for p in SCENARIOS.glob("*.yaml")
               if "remediation_result" not in p.read_text())
_DISRUPTIVE = {a.value for a in NODE_ACTIONS} | {Action.RESET_GPU.value}
_SEVERE = {Classification.GPU_WEDGED.value, Classification.GPU_HARDWARE_FAULT.value}


def _collected(name: str) -> list:
    sink = MemorySink()
    ScenarioRunner(load_scenario(SCENARIOS / f"{name}.yaml"), sink).run()
    return list(sink.records)


_RECORDS: dict[str, list] = {}


def records_of(name: str) -> list:
    if name not in _RECORDS:
        _RECORDS[name] = _collected(name)
    return _RECORDS[name]


def _read_at(r):
    """When the collector read it: a line stamped by a drifting clock is read with its neighbours."""
    return getattr(r, "observed_at", None) or r.ts


def interleave(records: list, rng: random.Random, *, max_lag_s: float | None = None) -> list:
    """The records in a random read order that keeps each (type, GPU) sequence in order. With
    `max_lag_s`, a sequence is read at most that many seconds of event time ahead of the others."""
    queues: dict = defaultdict(list)
    for r in records:
        queues[(type(r).__name__, getattr(r, "gpu_uuid", None) or r.node)].append(r)
    heads = {k: 0 for k in queues}
    out: list = []
    while heads:
        keys = sorted(heads, key=str)
        if max_lag_s is not None:
            oldest = min(_read_at(queues[k][heads[k]]) for k in keys)
            keys = [k for k in keys if (_read_at(queues[k][heads[k]]) - oldest).total_seconds() <= max_lag_s]
        k = rng.choice(keys)
        n = rng.randint(1, 300 if max_lag_s is None else 5)
        seq, i = queues[k], heads[k]
        take = seq[i:i + n]
        if max_lag_s is not None:
            limit = min(_read_at(queues[j][heads[j]]) for j in heads)
            take = [r for r in take if (_read_at(r) - limit).total_seconds() <= max_lag_s] or take[:1]
        out.extend(take)
        heads[k] = i + len(take)
        if heads[k] >= len(seq):
            del heads[k]
    return out


def fold(records: list) -> Engine:
    engine = Engine()
    for r in records:
        engine.process(r)
    return engine


def decisions(engine: Engine, *, everything: bool) -> tuple:
    """What must not depend on the read order: commands (all, or the disruptive ones) with their
    times and expiry, and the first time of each verdict of each GPU (all, or the severe ones)."""
    # each with the rule that made it (streams.rules): which rule decided is as order-free as the verdict
    cmds = sorted((c.node, c.gpu_uuid or "", c.action.value, c.ts, c.expires_at, c.rule and c.rule.id)
                  for c in engine.commands if everything or c.action.value in _DISRUPTIVE)
    first: dict = {}
    for a in engine.alerts:
        cls = str(getattr(a.classification, "value", a.classification))
        state = str(getattr(a.state, "value", a.state))
        if a.gpu_uuid is None or state == "resolved" or not (everything or cls in _SEVERE):
            continue
        key = (a.node, a.gpu_uuid, cls, a.rule and a.rule.id)
        first[key] = min(first.get(key, a.ts), a.ts)
    return cmds, sorted(first.items())


def test_the_library_scenarios_are_all_here():
    # the scenarios this property runs: a rename or a new result-answering scenario shows up here
    assert {"motivating-incident", "recovery-failure-pinned", "busy-after-xid43", "phantom-load",
            "skewed-dmesg-before-wedge", "xid31-three-pids", "crash-looping-pod", "power-smoothing-cancel"} <= set(NAMES)


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), seed=st.integers(0, 2**32 - 1))
def test_any_read_order_gives_the_same_disruptive_commands_and_severe_verdicts_at_the_same_times(name, seed):
    records = records_of(name)
    published = decisions(fold(records), everything=False)
    read = decisions(fold(interleave(records, random.Random(seed))), everything=False)
    assert read == published


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from([n for n in NAMES if n != "fleet-storm-xid119"]), seed=st.integers(0, 2**32 - 1))
def test_a_worker_that_keeps_up_gives_every_verdict_and_command_at_the_same_times(name, seed):
    records = records_of(name)
    published = decisions(fold(records), everything=True)
    read = decisions(fold(interleave(records, random.Random(seed), max_lag_s=60)), everything=True)
    assert read == published



@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["motivating-incident", "crash-looping-pod", "xid31-three-pids"]),
       seed=st.integers(0, 2**32 - 1), lag=st.sampled_from([None, 120, 240]))
def test_any_read_order_records_each_application_fault_once(name, seed, lag):
    """One RECORD per application fault whichever topic is read ahead: the pod's death, the process
    lists or the Xid lines (16f55ff's CI run: the death read before the lines made one fault two)."""
    def records(engine: Engine) -> list:
        return sorted((c.gpu_uuid, c.ts) for c in engine.commands
                      if c.action == Action.RECORD and "application fault" in c.reason)
    recs = records_of(name)
    assert records(fold(interleave(recs, random.Random(seed), max_lag_s=lag))) == records(fold(recs))


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), lag=st.sampled_from([None, 60]))
def test_the_power_smoothing_pair_holds_in_any_read_order(seed, lag):
    """Xid 163 re-engaged by 162 within pshc_cancel_s (GPU 0: quarantined, then cancelled and
    released) and past it (GPU 1: quarantined, kept), with the GPUs' samples and process lists read
    ahead or behind: every command and first verdict at the same times, and each GPU's last alert
    in the same state."""
    recs = records_of("power-smoothing-cancel")

    def last_states(engine: Engine) -> dict:
        return {a.gpu_uuid: str(a.state) for a in engine.alerts}

    published = fold(recs)
    read = fold(interleave(recs, random.Random(seed), max_lag_s=lag))
    assert decisions(read, everything=True) == decisions(published, everything=True)
    assert last_states(read) == last_states(published) == {
        "GPU-c1620000-0000-4000-8000-000000000000": "resolved", "GPU-c1630000-0000-4000-8000-000000000000": "open"}
    assert [c.action.value for c in published.commands] == ["QUARANTINE_GPU", "QUARANTINE_GPU", "RELEASE_GPU"]


# -- the case: GPU 7 of 8 wedges while its neighbours run healthy jobs -------------------
def _eight_gpus(seconds: int = 780):
    """The motivating sequence on GPU 7 (Xid 13 x3, 31, 43 at +120..+122 s, then 100% with 0 MiB and
    no process) while GPUs 0-6 run healthy jobs; one sample and process list per GPU per 3 s."""
    gpus = [f"GPU-70000000-0000-4000-8000-00000000000{i}" for i in range(8)]
    recs = [inventory(gpu=g, index=i) for i, g in enumerate(gpus)]
    sick = gpus[7]
    for t in range(0, seconds + 1, 3):
        for i, g in enumerate(gpus):
            if g == sick and t >= 123:
                recs.append(sample(t, util=100, mem=0, gpu=g, power=110))
                recs.append(GpuProcesses(ts=at(t), node="node-a", gpu_uuid=g, gpu_index=i, compute_apps=[]))
            else:
                recs.append(sample(t, util=70, mem=20000, gpu=g))
                recs.append(procs(t, 4000 + i, gpu=g))
    recs += [xid(120, 13, pid=4007, gpu=sick), xid(120.5, 13, pid=4007, gpu=sick), xid(121, 31, pid=4007, gpu=sick),
             xid(122, 43, pid=4007, gpu=sick), workload(200, gpu=sick), workload(260, gpu=sick, pod="vllm-2")]
    return sorted(recs, key=lambda r: r.ts), sick


def _wedged_at(engine: Engine, gpu: str):
    return min(a.ts for a in engine.alerts if a.gpu_uuid == gpu and a.classification == Classification.GPU_WEDGED)


def test_the_wedge_is_decided_at_the_same_time_whichever_topic_is_read_first():
    records, sick = _eight_gpus()
    kinds = ("GpuInventory", "XidEvent", "WorkloadEvent")
    by_kind = lambda names: [r for n in names for r in records if type(r).__name__ == n]  # noqa: E731
    processes_first = by_kind(kinds + ("GpuProcesses", "GpuSample"))
    samples_first = by_kind(kinds + ("GpuSample", "GpuProcesses"))
    in_order = _wedged_at(fold(records), sick)
    # 123 s pinned start + 60 s without a compute process (on 1484261: +363 s one way, +780 s the other)
    assert in_order == at(183)
    assert _wedged_at(fold(processes_first), sick) == in_order
    assert _wedged_at(fold(samples_first), sick) == in_order


def test_a_compute_snapshot_read_ahead_does_not_move_an_earlier_wedge():
    """A compute process seen after the wedge was decided (read before the samples) does not push
    the decision past it: at +183 s nothing had run on the GPU for 60 s."""
    records, sick = _eight_gpus(seconds=400)
    late_job = GpuProcesses(ts=at(300), node="node-a", gpu_uuid=sick, gpu_index=7,
                            compute_apps=[ComputeApp(pid=9, process_name="python3")])
    records = [r for r in records if not (type(r) is GpuProcesses and r.gpu_uuid == sick and r.ts == at(300))]
    records = sorted(records + [late_job], key=lambda r: r.ts)
    procs_first = [r for r in records if type(r) is not type(late_job) and type(r).__name__ != "GpuSample"] + \
        [r for r in records if type(r) is GpuProcesses] + [r for r in records if type(r).__name__ == "GpuSample"]
    assert _wedged_at(fold(records), sick) == at(183)
    assert _wedged_at(fold(procs_first), sick) == at(183)


def test_a_compute_process_during_the_pin_restarts_its_span_in_any_order():
    records, sick = _eight_gpus(seconds=400)
    job = GpuProcesses(ts=at(150), node="node-a", gpu_uuid=sick, gpu_index=7,
                       compute_apps=[ComputeApp(pid=9, process_name="python3")])
    records = [r for r in records if not (type(r) is GpuProcesses and r.gpu_uuid == sick and r.ts == at(150))]
    records = sorted(records + [job], key=lambda r: r.ts)
    samples_first = [r for r in records if type(r).__name__ != "GpuProcesses"] + \
        [r for r in records if type(r).__name__ == "GpuProcesses"]
    # the span restarts at the compute snapshot (+150): wedged at +210, not +183
    assert _wedged_at(fold(records), sick) == at(210)
    assert _wedged_at(fold(samples_first), sick) == at(210)


@pytest.mark.parametrize("order", ["published", "samples first", "xids last"])
def test_resolution_is_stamped_when_it_held(order):
    """Healthy for 5 min with no new Xid: resolved at the later of the healthy run's start and the
    newest Xid, plus 5 min (+230 + 300 s), whichever was read first; a resolution is decided on a
    sample, so when the Xids come last it waits for the next one (+700 s) and is stamped +530 s."""
    recs = [inventory(), *[sample(t) for t in range(0, 700, 10)], *[procs(t, 7) for t in range(0, 700, 10)],
            xid(100, 13, pid=7), xid(230, 13, pid=7)]
    recs.sort(key=lambda r: r.ts)
    if order == "samples first":
        recs = [r for r in recs if type(r).__name__ == "GpuSample"] + [r for r in recs if type(r).__name__ != "GpuSample"]
    elif order == "xids last":
        recs = [r for r in recs if type(r).__name__ != "XidEvent"] + [r for r in recs if type(r).__name__ == "XidEvent"]
    if order != "published":
        recs.append(sample(700))
    e = fold(recs)
    resolved = [a.ts for a in e.alerts if str(getattr(a.state, "value", a.state)) == "resolved"]
    assert resolved == [at(530)]


def _suspects(engine: Engine, gpu: str) -> list:
    return sorted(a.ts for a in engine.alerts
                  if a.gpu_uuid == gpu and a.classification == Classification.GPU_SUSPECT
                  and str(getattr(a.state, "value", a.state)) != "resolved")


def test_a_fault_read_after_the_samples_resolved_the_first_one_still_counts_with_it():
    """The clean-clone CI run of 92b0288 failed on xid31-three-pids: the worker read GPU 1's samples
    ~290 s of event time ahead of its Xids, the first fault's APP_FAULT incident resolved (healthy
    5 min, no Xid read yet), its fault was forgotten, and the second process's fault at +200 counted
    alone: GPU_SUSPECT only at +380, with the third. In time order it holds at +200."""
    records = records_of("xid31-three-pids")
    gpu = "GPU-0c000001-0000-4000-8000-000000000000"
    start = records[0].ts
    late = [r for r in records if isinstance(r, XidEvent) and (r.ts - start).total_seconds() > 60]
    head = [r for r in records if r not in late and (r.ts - start).total_seconds() <= 500]
    lagged = head + late + [r for r in records if r not in late and r not in head]
    assert _suspects(fold(records), gpu)[0] == start + timedelta(seconds=200)
    assert _suspects(fold(lagged), gpu)[0] == start + timedelta(seconds=200)


def test_a_resolved_quarantine_is_not_raised_again_by_its_own_faults_but_a_new_one_counts_with_them():
    """Two processes fault the GPU (GPU_SUSPECT at +100); healthy 5 min: resolved and released. The
    closed faults alone never quarantine it again; a third process's fault inside the suspect
    window (10 min from the first) does, at its own time."""
    recs = [inventory(), *[sample(t) for t in range(0, 1200, 10)], *[procs(t, 7) for t in range(0, 1200, 10)],
            xid(50, 13, pid=5), xid(100, 13, pid=6)]
    recs.sort(key=lambda r: r.ts)
    quiet = fold(recs)
    assert _suspects(quiet, GPU) == [at(100)]
    released = [c for c in quiet.commands if c.action == Action.RELEASE_GPU]
    assert [c.ts for c in released] == [at(400)]
    assert [c.action for c in quiet.commands].count(Action.QUARANTINE_GPU) == 1
    recs.append(xid(590, 13, pid=8))
    recs.sort(key=lambda r: r.ts)
    again = fold(recs)
    assert _suspects(again, GPU) == [at(100), at(590)]
    assert [c.action for c in again.commands].count(Action.QUARANTINE_GPU) == 2


def test_a_crash_looping_pods_closed_faults_stay_one_workload():
    """Found by review of the closed faults: a crash-looping pod faults every ~5 min (its
    CrashLoopBackOff), each fault named by the pod's death, each APP_FAULT incident resolving before
    the next. The deaths are forgotten with the incident; renamed by their PIDs, the closed faults
    counted as three workloads beside the pod's next fault, and one tenant's crash loop quarantined
    the GPU."""
    recs = [inventory(), *[sample(t) for t in range(0, 1300, 10)], *[procs(t) for t in range(0, 1300, 10)]]
    for i, t in enumerate((100, 420, 740, 1060)):
        recs += [xid(t, 13, pid=101 + i), workload(t + 2, pod="crashy")]
    recs.sort(key=lambda r: r.ts)
    e = fold(recs)
    assert _suspects(e, GPU) == []
    resolved = [a for a in e.alerts if str(getattr(a.state, "value", a.state)) == "resolved"]
    assert len(resolved) >= 3  # each fault's incident resolved before the next: the faults were closed


def test_an_open_fault_read_late_counts_with_a_newer_closed_one():
    """The rule holds at the newer closed fault's time when an older open fault (read late) is in
    its window: in time order both were open and it held there."""
    from xidstream.streams.evidence import GpuState
    from xidstream.streams.policy import Policy
    from xidstream.streams.verdict import earliest_suspect

    state = GpuState(key="k", gpu_index=0, node="n")
    state.occurrences = [
        {"ts": 1100.0, "last_ts": 1100.0, "pid": 1, "wl": "pid:1", "codes": [13], "pod": None, "id": "a", "closed": True},
        {"ts": 1000.0, "last_ts": 1000.0, "pid": 2, "wl": "pid:2", "codes": [13], "pod": None, "id": "c"},
    ]
    found = earliest_suspect(state, Policy())
    assert found is not None and found[0] == 1100.0
    state.occurrences[1]["closed"] = True  # both closed: never again
    assert earliest_suspect(state, Policy()) is None


def test_the_lines_of_one_fault_read_after_the_pods_death_are_one_occurrence():
    """The clean-clone CI run of 16f55ff failed on the three-broker incident test: the worker read
    the motivating incident's pod death (+123 s) before its Xid 13 lines (+120 s) and before any
    process list named PID 4242's pod. The first line's fault was named by the death (pod:...),
    the second line's PID was not (pid:4242), so the one fault became two occurrences and two
    RECORD commands. The lines of one PID within `burst_seconds` are one fault, however named."""
    records = records_of("motivating-incident")
    first = [r for r in records if isinstance(r, WorkloadEvent) and r.event.value == "failed"][:1]
    death_first = first + [r for r in records if r not in first and type(r) is not GpuProcesses] + \
        [r for r in records if type(r) is GpuProcesses]
    for order in (records, death_first):
        engine = fold(order)
        assert [c.action for c in engine.commands if c.action == Action.RECORD] == [Action.RECORD]
        apps = [a for a in engine.alerts if a.classification == Classification.APP_FAULT]
        assert [str(getattr(a.state, "value", a.state)) for a in apps][:1] == ["open"]


def test_a_process_list_read_late_names_its_pid_over_another_pods_death():
    """One pod's process faults twice; another pod on the GPU dies 2 s after the first fault. In
    time order the process list names both faults' pod (one workload: no quarantine). With the
    lists read last the death named the first fault, and the list that came after did not take it
    back: two workloads, GPU_SUSPECT and a QUARANTINE_GPU of a GPU one tenant faulted."""
    recs = [inventory(), *[sample(t) for t in range(0, 400, 10)], *[procs(t, 7) for t in range(0, 400, 10)],
            xid(100, 13, pid=7), workload(102, pod="other"), xid(200, 13, pid=7)]
    recs.sort(key=lambda r: r.ts)
    lists_last = [r for r in recs if type(r) is not GpuProcesses] + [r for r in recs if type(r) is GpuProcesses]
    for order in (recs, lists_last):
        engine = fold(order)
        assert [c.action for c in engine.commands] == [Action.RECORD, Action.RECORD]
        assert {a.classification for a in engine.alerts} == {Classification.APP_FAULT}


def _listing(t: float, *apps: tuple[int, str]) -> GpuProcesses:
    return GpuProcesses(ts=at(t), node=NODE, gpu_uuid=GPU, gpu_index=1, pci_bus_id=PCI,
                        compute_apps=[ComputeApp(pid=p, process_name="python3", pod_uid=u) for p, u in apps])


def test_a_death_a_late_process_list_took_back_names_the_fault_it_names_in_time_order():
    """Pod B's listed process (PID 7) and its unlisted child (PID 8) fault; then B dies. In time
    order the list names PID 7's fault and the death names PID 8's: one workload, two RECORDs. With
    the lists read last the death named PID 7's fault, the list took it back, and the death was
    never used again: PID 8's fault stayed `pid:8`, two workloads, a QUARANTINE_GPU (found by a
    review of the fix above)."""
    recs = sorted([inventory(), *[sample(t) for t in range(0, 400, 10)], *[_listing(t, (7, "uid-B")) for t in range(0, 400, 10)],
                   xid(100, 13, pid=8), xid(110, 13, pid=7), workload(112, pod="B")], key=lambda r: r.ts)
    lists_last = [r for r in recs if type(r) is not GpuProcesses] + [r for r in recs if type(r) is GpuProcesses]
    for order in (recs, lists_last):
        assert [c.action for c in fold(order).commands] == [Action.RECORD, Action.RECORD]


def test_a_pid_listed_long_after_its_fault_does_not_rename_it():
    """Pod B dies after each of three faults (PIDs 8, 9, 10): one workload. PID 8 is reused minutes
    later by pod C's process; the list that names it must not make the first fault pod C's (two
    workloads, a quarantine of a GPU pod C never faulted)."""
    recs = sorted([inventory(), *[sample(t) for t in range(0, 400, 10)],
                   *[_listing(t) for t in range(0, 300, 10)], *[_listing(t, (8, "uid-C")) for t in range(300, 400, 10)],
                   xid(100, 13, pid=8), workload(101, pod="B"), xid(200, 13, pid=9), workload(201, pod="B"),
                   xid(350, 13, pid=10), workload(351, pod="B")], key=lambda r: r.ts)
    engine = fold(recs)
    assert [c.action for c in engine.commands] == [Action.RECORD] * 3
    assert {a.classification for a in engine.alerts} == {Classification.APP_FAULT}
