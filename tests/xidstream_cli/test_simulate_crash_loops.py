"""The simulator's crash-looping workloads and Xid 45 teardowns, and their scoring, without a
broker: the simulated records go into a `MemorySink`, `xidstream.streams.engine.Engine` folds them in publish
order, and `score` reports on its alerts and commands (what `xidstream evaluate` does with the
records it reads back from Kafka; the broker tier is tests/integration/test_simulate_evaluate.py).
"""

from __future__ import annotations

import io
from dataclasses import astuple

import pytest

from xidstream.collectors.sink import MemorySink
from xidstream.schemas import GpuProcesses, WorkloadEvent, XidEvent
from xidstream.schemas.errors import ConfigError
from xidstream.streams.engine import Engine
from xidstream.cli import main as cli
from xidstream.settings import Settings
from xidstream.simulate import CRASH_FAULTS, FaultRates, Simulator, read_truth, score

RATES = FaultRates(app_fault=0.1, repeat=0.05, wedge=0.05, hardware=0.05, phantom=0.05)


def simulate(tmp_path, rates=RATES, **kw):
    sim = Simulator(Settings(topic_prefix="t."), kw.pop("nodes", 25), kw.pop("gpus", 4), duration=420, seed=3,
                    rates=rates, **kw)
    sink = MemorySink()
    sim.run(sink, progress=None)
    sim.write_truth(tmp_path / "truth.jsonl")
    return sim, sink.records


def test_the_added_patterns_leave_the_default_fault_mix_as_it_was(tmp_path):
    base = Simulator(Settings(), 25, 4, duration=420, seed=3, rates=RATES)
    mixed = Simulator(Settings(), 25, 4, duration=420, seed=3, rates=RATES, crash_loops=8, xid45_teardowns=1)
    for a, b in zip(base.gpus, mixed.gpus):
        if b.fault in ("crash_loop", "xid45_teardown"):
            assert a.fault == "none"  # only fault-free GPUs are taken
        else:
            assert astuple(a) == astuple(b)
    assert sum(g.fault == "crash_loop" for g in mixed.gpus) == 8
    assert sum(g.fault == "xid45_teardown" for g in mixed.gpus) == 12  # 6 nodes x 2 GPUs


def test_a_crash_loop_is_one_pod_whose_every_restart_is_a_new_pid_faulting_the_same_gpu(tmp_path):
    sim, records = simulate(tmp_path, crash_loops=3)
    loops = [g for g in sim.gpus if g.fault == "crash_loop"]
    assert len(loops) == 3  # the checks below run for every one of them, never for none
    assert len(CRASH_FAULTS) > 1  # a loop is several restarts
    for gpu in loops:
        faults = [r for r in records if r.SCHEMA == XidEvent.SCHEMA and r.gpu_uuid == gpu.uuid]
        assert [x.xid for x in faults] == [13] * len(CRASH_FAULTS)
        assert len({x.pid for x in faults}) == len(CRASH_FAULTS)
        assert (faults[-1].ts - faults[0].ts).total_seconds() < 600  # all in one suspect window
        for x in faults:
            # The faulting PID was listed by compute-apps, under the pod's UID, the second before.
            listed = [a for p in records if p.SCHEMA == GpuProcesses.SCHEMA and p.gpu_uuid == gpu.uuid
                      and p.ts < x.ts for a in p.compute_apps or [] if a.pid == x.pid]
            assert listed and {a.pod_uid for a in listed} == {gpu.pod_uid}
        events = [r for r in records if r.SCHEMA == WorkloadEvent.SCHEMA and r.gpu_uuid == gpu.uuid]
        assert {e.pod_uid for e in events} == {gpu.pod_uid}
        assert [e.event.value for e in events].count("failed") == len(CRASH_FAULTS)
        assert [e.event.value for e in events].count("restarted") == len(CRASH_FAULTS) - 1


def test_an_xid45_teardown_is_every_rank_of_one_job_at_once_across_nodes(tmp_path):
    sim, records = simulate(tmp_path, xid45_teardowns=1)
    ranks = {g.uuid for g in sim.gpus if g.fault == "xid45_teardown"}
    x45 = [r for r in records if r.SCHEMA == XidEvent.SCHEMA and r.gpu_uuid in ranks]
    assert {x.xid for x in x45} == {45} and {x.gpu_uuid for x in x45} == ranks
    assert len({x.node for x in x45}) == 6 and len({x.ts for x in x45}) == 1


def test_too_many_crash_loops_for_the_fleet_is_a_clear_error():
    with pytest.raises(ConfigError, match="crash loops asked"):
        Simulator(Settings(), 2, 2, duration=420, crash_loops=5)
    assert cli(["simulate", "--nodes", "2", "--gpus", "2", "--crash-loops", "5", "--duration", "420"]) != 0


def test_score_reports_the_mix_per_class_and_per_fault(tmp_path):
    """Scoring only (the verdicts are the engine's): every figure the bench prints for the mix."""
    sim, records = simulate(tmp_path, crash_loops=6, xid45_teardowns=1)
    engine = Engine()
    for r in records:
        engine.process(r)
    out = io.StringIO()
    meta, truth = read_truth(tmp_path / "truth.jsonl")
    report = score(meta, truth, [(r, None) for r in engine.alerts + engine.commands], out)
    text = out.getvalue()
    assert report["by_fault"]["crash_loop"]["gpus"] == 6 and report["by_fault"]["xid45_teardown"]["gpus"] == 12
    # Crash loops and teardowns are application faults: they count in APP_FAULT's truth ...
    assert report["classes"]["APP_FAULT"]["truth"] == sum(
        t["fault"] in ("app_fault", "crash_loop", "xid45_teardown") for t in truth.values())
    # ... and their GPUs are among those on which a quarantine or a node action is counted as wrong.
    quarantined = sum(r["quarantined"] for f, r in report["by_fault"].items() if f in ("crash_loop", "xid45_teardown"))
    assert report["quarantines_on_app_fault_gpus"] >= quarantined
    for line in ("node-level actions (not held for approval) on GPUs whose only fault was an application fault or none: ",
                 "GPU quarantines on GPUs whose only fault was an application fault or none: ", "crash_loop ",
                 "xid45_teardown "):
        assert line in text


def test_crash_loops_and_teardowns_are_recorded_never_quarantined_nor_node_actions(tmp_path):
    """Rules checked: "count workloads, not PIDs" (a crash-looping pod is one workload:
    APP_FAULT, never GPU_SUSPECT / QUARANTINE_GPU) and "Xid 45 alone is never more than RECORD",
    over a simulated fleet that also carries single app faults, repeats and phantom loads. (No
    wedges or hardware faults here: on 25 nodes those alone may trip the fleet breaker, and a
    FLEET_STORM must be attributable to the patterns under test.)"""
    rates = FaultRates(app_fault=0.1, repeat=0.05, wedge=0.0, hardware=0.0, phantom=0.05)
    sim, records = simulate(tmp_path, rates, crash_loops=6, xid45_teardowns=1)
    engine = Engine()
    for r in records:
        engine.process(r)
    meta, truth = read_truth(tmp_path / "truth.jsonl")
    report = score(meta, truth, [(r, None) for r in engine.alerts + engine.commands], io.StringIO())
    assert report["node_actions_on_app_fault_gpus"] == 0
    assert report["quarantines_on_app_fault_gpus"] == 0
    # every one of their GPUs alerted, and only as APP_FAULT (a subset check would pass on none)
    assert report["by_fault"]["crash_loop"]["alerted"] == {"APP_FAULT": 6}
    assert report["by_fault"]["xid45_teardown"]["alerted"] == {"APP_FAULT": 12}  # 6 nodes x 2 GPUs
    assert report["classes"]["APP_FAULT"]["recall"] == 1.0
    assert report["classes"]["GPU_SUSPECT"]["precision"] == 1.0
    assert report["fleet_storms"] == 0
