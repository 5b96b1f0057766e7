"""The rules of the verdicts through the pure decision path, on the five scenarios that state them and on
records built directly.

Each scenario's records come from the real collector code on the fakes (`ScenarioRunner` into a
`MemorySink`) and are folded by `xidstream.streams.engine.Engine` **in the order the collector published
them**, which is what a one-partition replay hands the worker. (`Engine.run` sorts by `ts` first:
that would fold a record stamped hours ahead last and hide exactly the defect the skew rule is
about; tests/xidstream_cli/test_replay_check.py runs every library scenario that way too.)

Every scenario test first checks that the scenario really contains what its rule is about (so a
later edit of the YAML cannot quietly turn it into a trivial case), then checks its expect/forbid.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import Action, Classification, GpuProcesses, GpuSample, XidEvent, load_scenario
from xidstream.streams.engine import Engine
from tests.streams.builders import at, inventory, procs, sample, workload, xid
from xidstream.replay import ReplayResult, check_scenario

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "scenarios"


def collected(name: str):
    """(scenario, records in publish order) for scenarios/NAME.yaml."""
    sc = load_scenario(SCENARIOS / f"{name}.yaml")
    sink = MemorySink()
    ScenarioRunner(sc, sink).run()
    return sc, list(sink.records)


def fold_in_arrival_order(records) -> Engine:
    engine = Engine()
    for r in records:
        engine.process(r)
    return engine


def failures(sc, engine: Engine) -> list[str]:
    recs = [("gpu.alerts", "", a) for a in engine.alerts] + [("gpu.remediation", "", c) for c in engine.commands]
    return check_scenario(ReplayResult(sc, sc.start, records=recs))


def xids(records, uuid=None, kind="xid"):
    return [r for r in records if r.SCHEMA == XidEvent.SCHEMA and r.kind.value == kind
            and (uuid is None or r.gpu_uuid == uuid)]


def of_gpu(records, model, uuid):
    return [r for r in records if r.SCHEMA == model.SCHEMA and r.gpu_uuid == uuid]


# -- Rule: count workloads, not PIDs ---------------------------------------------------------------
def test_crash_looping_pod_is_one_workload_recorded_never_quarantined():
    sc, records = collected("crash-looping-pod")
    gpu1 = sc.gpu("node-cl", 1).uuid
    faults = xids(records, gpu1)
    pids = {x.pid for x in faults if x.xid == 13}
    assert len(pids) >= 4, "the scenario must be a crash loop: a new PID per restart"
    # Before its fault, each PID was listed by compute-apps under one and the same pod UID.
    pods = set()
    for x in faults:
        listed = [a for p in of_gpu(records, GpuProcesses, gpu1) if p.ts <= x.ts
                  for a in (p.compute_apps or []) if a.pid == x.pid]
        assert listed, f"pid {x.pid} faulted without being listed first"
        pods |= {a.pod_uid for a in listed}
    assert len(pods) == 1
    assert failures(sc, fold_in_arrival_order(records)) == []


def test_crash_looping_pod_is_one_workload_whichever_topic_the_worker_reads_first():
    """Rule checked: "count workloads, not PIDs", as a worker sees it. A worker reads its five input
    topics independently: in a replay (everything published within a second) it may fold all of
    gpu.xid before the process lists that name each PID's pod. A fault whose PID is not yet known
    to belong to a pod must not make that pod look like several workloads once the process list
    arrives (`xidstream replay --check` of this scenario shows exactly this when it fails)."""
    sc, records = collected("crash-looping-pod")
    xid_first = [r for r in records if r.SCHEMA == XidEvent.SCHEMA] + [r for r in records if r.SCHEMA != XidEvent.SCHEMA]
    assert failures(sc, fold_in_arrival_order(xid_first)) == []


# -- Rule: a driver recovery failure is wedge evidence exactly like Xid 43 ------------------------
def test_recovery_failure_with_pinned_gpu_is_wedged_with_the_reset_plan():
    sc, records = collected("recovery-failure-pinned")
    gpu1 = sc.gpu("gpu-node-12", 1).uuid
    assert len(xids(records, gpu1, kind="recovery_failure")) == 1  # "GPU1" resolved to GPU 1's UUID
    assert 43 not in {x.xid for x in xids(records)}
    assert failures(sc, fold_in_arrival_order(records)) == []


# -- Rule: a live compute process keeps a GPU out of GPU_WEDGED and PHANTOM_LOAD ------------------
def test_busy_gpu_after_xid43_is_not_wedged_nor_phantom():
    sc, records = collected("busy-after-xid43")
    for idx in (2, 3):
        uuid = sc.gpu("node-mr", idx).uuid
        (x43,) = [x for x in xids(records, uuid) if x.xid == 43]
        after = [p for p in of_gpu(records, GpuProcesses, uuid) if p.ts > x43.ts]
        assert after and all(p.compute_apps for p in after), "a compute app stays listed after the Xid 43"
        samples = [s for s in of_gpu(records, GpuSample, uuid) if s.ts > x43.ts + timedelta(seconds=1)]
        assert samples and all(s.utilization_gpu_pct == 100 for s in samples)
    # On GPU 3 memory alone would look wedged (<= 1% used): only compute-apps tells them apart.
    gpu3 = sc.gpu("node-mr", 3)
    assert max(s.memory_used_mib for s in of_gpu(records, GpuSample, gpu3.uuid)[-5:]) <= 0.01 * gpu3.memory_total_mib
    assert failures(sc, fold_in_arrival_order(records)) == []


# -- Rule: Xid 45 alone is never more than RECORD -------------------------------------------------
def test_xid45_teardown_across_nodes_is_a_record_only():
    sc, records = collected("xid45-teardown-across-nodes")
    x45 = [x for x in xids(records) if x.xid == 45]
    assert len(x45) == 12 and len({x.node for x in x45}) == 6
    assert (max(x.ts for x in x45) - min(x.ts for x in x45)).total_seconds() <= 1.0
    engine = fold_in_arrival_order(records)
    assert failures(sc, engine) == []
    assert {c.action for c in engine.commands} <= {Action.RECORD}


# -- Rule: event time survives bad clocks ---------------------------------------------------------
def test_skewed_scenario_record_does_not_blind_the_wedge():
    sc, records = collected("skewed-dmesg-before-wedge")
    end = sc.start + timedelta(seconds=sc.duration + 120)
    skewed = [x for x in xids(records) if x.ts > end]
    # The scenario format can carry a line's own time: the collector keeps an iso prefix's stamp.
    assert len(skewed) == 1 and skewed[0].ts - sc.start >= timedelta(hours=6)
    # ... and it is published before the wedge's correctly stamped records.
    assert records.index(skewed[0]) < records.index(next(x for x in xids(records) if x.xid == 43))
    engine = fold_in_arrival_order(records)
    assert failures(sc, engine) == []
    wedge_cmds = [c for c in engine.commands if c.action in (Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU)]
    assert wedge_cmds and all(c.ts < skewed[0].ts - timedelta(hours=1) for c in wedge_cmds), \
        "the wedge plan must rest on the correctly stamped evidence, not on the skewed record's clock"


def test_record_stamped_hours_ahead_does_not_blind_the_gpu_to_the_wedge_that_follows():
    """Rule checked: "Event time survives bad clocks": one record stamped 6 h ahead,
    then the motivating wedge (Xid 13 -> 31 -> 43, pinned 100% / 0 MiB, no compute app) stamped
    correctly. Records are folded in arrival order, as a worker reads them."""
    skew = 6 * 3600
    recs = [inventory(0), sample(0), procs(0, 4100),
            xid(30 + skew, 13, pid=4100),  # logged at +30 s by a clock 6 h fast
            sample(31, util=0, mem=0), procs(31), sample(50), procs(50, 4242),
            xid(120, 13, pid=4242), xid(120.1, 13, pid=4242), xid(121, 31, pid=4242), xid(122, 43, pid=4242),
            workload(123)]
    t = 123
    while t <= 300:
        recs += [sample(t, util=100, mem=0, power=110), procs(t)]
        t += 5
    engine = fold_in_arrival_order(recs)
    wedged = [a for a in engine.alerts if a.classification == Classification.GPU_WEDGED]
    assert wedged, f"no GPU_WEDGED; alerts: {[a.classification.value for a in engine.alerts]}"
    incident = wedged[0].incident_id
    plan = [c.action for c in engine.commands if c.incident_id == incident]
    wanted = [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]
    assert [a for a in plan if a in wanted] == wanted
    # Stamped by the correctly timed evidence (within minutes of it), not 6 h ahead.
    assert all(c.ts < at(300 + 900) for c in engine.commands if c.action in wanted)


# -- Rule: a 162 cancels the 163 it re-engages within pshc_cancel_s --------------------------------
def test_power_smoothing_re_engaged_in_time_is_cancelled_and_later_is_kept():
    sc, records = collected("power-smoothing-cancel")
    bound = 300.0  # Policy().pshc_cancel_s
    for idx, cancelled in ((0, True), (1, False)):
        uuid = sc.gpu("gb200-tray-3", idx).uuid
        (off,) = [x for x in xids(records, uuid) if x.xid == 163]
        (on,) = [x for x in xids(records, uuid) if x.xid == 162]
        assert ((on.ts - off.ts).total_seconds() <= bound) is cancelled
    assert failures(sc, fold_in_arrival_order(records)) == []


@pytest.mark.parametrize("name", ["crash-looping-pod", "recovery-failure-pinned", "busy-after-xid43",
                                  "xid45-teardown-across-nodes", "skewed-dmesg-before-wedge", "power-smoothing-cancel"])
def test_rule_scenario_is_valid_and_says_what_it_proves(name):
    text = (SCENARIOS / f"{name}.yaml").read_text()
    assert text.startswith("#") and "What it proves (the rule \"" in text
    sc = load_scenario(SCENARIOS / f"{name}.yaml")
    assert sc.expect and sc.forbid


def test_an_incident_does_not_resolve_while_a_fault_still_waits_to_be_named():
    """Found on the real node (make e2e, resolve_after_s 60): three processes faulted GPU 0 6.5 s
    apart; each fault waits up to NAME_WAIT_S (90 s of the GPU's clock) for its workload to be named,
    the GPU looked healthy for 60 s first, the incident resolved, and the GPU_SUSPECT verdict and its
    quarantine were lost. A fault still pending now holds the resolution back."""
    import dataclasses

    from xidstream.schemas.scenario import parse_scenario
    from xidstream.streams.policy import Policy

    sc, _ = collected("xid31-three-pids")
    raw = sc.model_dump(mode="json", by_alias=True, exclude_none=True)
    faults = [e for e in raw["timeline"] if "kernel" in e]
    changes = [e for e in raw["timeline"] if e.get("processes") and e["at"] > 0]
    assert len(faults) == 3 and len(changes) == 2
    for i, fault in enumerate(faults):
        fault["at"] = 60 + 6.5 * i
    for i, change in enumerate(changes):
        change["at"] = 61 + 6.5 * i
    sc = parse_scenario(raw)
    sink = MemorySink()
    ScenarioRunner(sc, sink).run()
    engine = Engine(policy=dataclasses.replace(Policy(), resolve_after_s=60))
    for r in sink.records:
        engine.process(r)
    actions = [(c.action, round((c.ts - sc.start).total_seconds())) for c in engine.commands]
    quarantine = [t for a, t in actions if a == Action.QUARANTINE_GPU]
    release = [t for a, t in actions if a == Action.RELEASE_GPU]
    assert quarantine == [67], actions  # at the second process's fault, as with the default policy
    # emitted after the quarantine, stamped when "healthy for 60 s" held (the last fault + 60)
    assert release == [73 + 60], actions
    assert [a for a, _ in actions].index(Action.RELEASE_GPU) > [a for a, _ in actions].index(Action.QUARANTINE_GPU)
    assert [a.classification for a in engine.alerts if a.state == "resolved"] == [Classification.GPU_SUSPECT]
