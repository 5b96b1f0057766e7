"""Evidence that stands in for evidence the collector could not read (docs/architecture.md "Verdicts": which
evidence substitutes for which), and the answers to closing steps that come after their incident.

- A crash-looping pod whose PIDs never reach a process list is one workload: its failures and
  restarts on `gpu.workloads` name the pod.
- A compute list NVML cannot read, while the `/dev/nvidia*` holder scan ran and found nobody, is
  "no process" for the wedge (RESET_GPU's own precondition is that holder check).
- A failed UNCORDON_NODE / RELEASE_GPU, answered after its incident resolved, raises an alert.
"""

from __future__ import annotations

import pytest

from xidstream.schemas import Action, Classification, ComputeApp, DeviceHolder, GpuProcesses, RemediationResult
from xidstream.streams.engine import Engine
from tests.streams.builders import GPU, NODE, PCI, at, inventory, procs, sample, workload, xid

DISRUPTIVE = {Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU, Action.REBOOT_NODE, Action.REPLACE_NODE}


def run(records) -> Engine:
    e = Engine()
    for r in records:
        e.process(r)
    return e


def classes(e: Engine) -> list:
    return [a.classification for a in e.alerts]


def actions(e: Engine) -> list:
    return [c.action for c in e.commands]


def empty_list(t, **kw):
    return GpuProcesses(ts=at(t), node=NODE, gpu_uuid=GPU, gpu_index=1, pci_bus_id=PCI, compute_apps=[], **kw)


# -- restart events name the pod ------------------------------------------------------------------
def _crash_loop(with_restarts: bool):
    """The issue's pod: each restart dies on Xid 13 before the next process list (every 5 s), five
    times in 40 s, each with a new PID."""
    recs = [inventory(), sample(0), procs(0)]
    for i, pid in enumerate((52011, 52144, 52301, 52467, 52590)):
        t = 5 + 8 * i
        recs.append(xid(t, 13, pid=pid))
        if with_restarts:
            recs.append(workload(t + 2, event="failed" if i == 0 else "restarted", pod="trainer-0"))
    recs += [empty_list(t) for t in range(5, 150, 5)] + [sample(t) for t in range(5, 150, 5)]
    return sorted(recs, key=lambda r: r.ts)


def test_a_crash_looping_pod_named_only_by_its_restarts_is_one_workload():
    e = run(_crash_loop(with_restarts=True))
    assert Classification.GPU_SUSPECT not in classes(e)
    assert Action.QUARANTINE_GPU not in actions(e)
    assert set(actions(e)) == {Action.RECORD}
    assert {o["wl"] for o in e.states[GPU].occurrences} == {"pod:uid-trainer-0"}


def test_without_restart_events_distinct_pids_still_count():
    # the substitution needs the pod named: five PIDs nobody can tie together are five workloads
    e = run(_crash_loop(with_restarts=False))
    assert Classification.GPU_SUSPECT in classes(e)


def test_two_pods_dying_after_two_faults_are_two_workloads():
    recs = [inventory(), sample(0), procs(0), xid(5, 13, pid=1), workload(7, pod="a"), xid(13, 13, pid=2),
            workload(15, pod="b"), *[empty_list(t) for t in range(5, 110, 5)], *[sample(t) for t in range(5, 110, 5)]]
    e = run(sorted(recs, key=lambda r: r.ts))
    assert Action.QUARANTINE_GPU in actions(e)


def test_the_failure_read_before_its_fault_names_it_too():
    # topics are read in parallel: the pod's death may be folded before the fault that caused it
    recs = _crash_loop(with_restarts=True)
    workloads = [r for r in recs if type(r).__name__ == "WorkloadEvent"]
    others = [r for r in recs if type(r).__name__ != "WorkloadEvent"]
    e = run(others[:3] + workloads + others[3:])
    assert Action.QUARANTINE_GPU not in actions(e)


def test_a_fault_no_one_names_counts_on_its_own_once_its_wait_is_over():
    # a death more than 30 s after the fault names nothing: the PIDs count 90 s on, stamped at their time
    recs = [inventory(), sample(0), procs(0), xid(5, 13, pid=1), xid(13, 13, pid=2), workload(80, pod="a"),
            *[empty_list(t) for t in range(5, 100, 5)], *[sample(t) for t in range(5, 100, 5)]]
    e = run(sorted(recs, key=lambda r: r.ts))
    assert Action.QUARANTINE_GPU not in actions(e)  # +95: the second still waits for a death to name it
    e = run(sorted(recs + [sample(103)], key=lambda r: r.ts))
    quarantine = next(c for c in e.commands if c.action == Action.QUARANTINE_GPU)
    assert quarantine.ts == at(13)


def test_one_pods_restart_cannot_claim_other_tenants_faults():
    """Review finding: two tenants' PID-only faults, then a third pod on the time-sliced GPU restarts
    once: it named both, and the GPU's two faulting workloads became one. One death names one fault."""
    recs = [inventory(), sample(0), procs(0), xid(100, 13, pid=601), xid(115, 31, pid=702),
            workload(118, event="restarted", pod="mallory"),
            *[empty_list(t) for t in range(5, 260, 5)], *[sample(t) for t in range(5, 260, 5)]]
    e = run(sorted(recs, key=lambda r: r.ts))
    assert Action.QUARANTINE_GPU in actions(e)
    assert sorted(o["wl"] for o in e.states[GPU].occurrences) == ["pid:601", "pod:uid-mallory"]


def test_a_clean_exit_names_no_fault():
    recs = [inventory(), sample(0), procs(0), xid(100, 13, pid=601), xid(115, 31, pid=702),
            workload(117, event="restarted", pod="mallory").model_copy(update={"exit_code": 0}),
            workload(118, event="restarted", pod="mallory").model_copy(update={"exit_code": 0}),
            *[empty_list(t) for t in range(5, 260, 5)], *[sample(t) for t in range(5, 260, 5)]]
    e = run(sorted(recs, key=lambda r: r.ts))
    assert sorted(o["wl"] for o in e.states[GPU].occurrences) == ["pid:601", "pid:702"]


@pytest.mark.parametrize("lag", [0, 25, 45, 60])
def test_deaths_read_up_to_a_minute_late_still_name_a_crash_loop(lag):
    """Review finding: with the pod's deaths read 35 s behind the rest, the crash loop was a
    quarantine (the wait was 30 s)."""
    recs = _crash_loop(with_restarts=True)
    deaths = [r for r in recs if type(r).__name__ == "WorkloadEvent"]
    others = [r for r in recs if type(r).__name__ != "WorkloadEvent"]
    others += [sample(t) for t in range(150, 250, 5)]
    order = sorted(others + deaths, key=lambda r: r.ts.timestamp() + (lag if r in deaths else 0))
    e = run(order)
    assert Action.QUARANTINE_GPU not in actions(e)


# -- collect --no-nvml: no process list will come --------------------------------------------------
def _no_nvml(x):
    return x.model_copy(update={"process_lists": False})


def test_without_nvml_several_pids_faulting_a_gpu_are_a_suspect():
    # xid31-three-pids without NVML: no sample or process list of the GPU ever comes
    recs = [_no_nvml(xid(60, 31, pid=601)), _no_nvml(xid(200, 31, pid=702)), _no_nvml(xid(380, 31, pid=803))]
    e = run(recs)
    quarantine = [c for c in e.commands if c.action == Action.QUARANTINE_GPU]
    assert len(quarantine) == 1 and quarantine[0].ts == at(200)  # stamped when two had faulted it
    assert not DISRUPTIVE & set(actions(e))


def test_without_nvml_a_crash_looping_pod_named_by_its_deaths_is_one_workload():
    recs = []
    for i, pid in enumerate((52011, 52144, 52301, 52467, 52590)):
        recs += [_no_nvml(xid(5 + 40 * i, 13, pid=pid)), workload(7 + 40 * i, event="restarted", pod="trainer-0")]
    e = run(recs)
    assert Action.QUARANTINE_GPU not in actions(e)


def test_with_process_lists_a_fault_waits_for_them():
    # the same three faults from a collector with NVML whose process lists were not read yet
    e = run([xid(60, 31, pid=601), xid(200, 31, pid=702), xid(380, 31, pid=803)])
    assert Action.QUARANTINE_GPU not in actions(e)


# -- holders for an unreadable compute list ------------------------------------------------------
def _wedge_with_unreadable_compute(holders):
    unreadable = [GpuProcesses(ts=at(t), node=NODE, gpu_uuid=GPU, gpu_index=1, pci_bus_id=PCI, compute_apps=None,
                               error="NVML_ERROR_UNKNOWN", device_holders=holders) for t in range(15, 200, 5)]
    recs = [inventory(), sample(0), procs(0, 7), xid(10, 43, pid=7), workload(40), workload(90, pod="vllm-2")]
    recs += [sample(t, util=100, mem=0) for t in range(15, 200, 5)] + unreadable
    return run(sorted(recs, key=lambda r: r.ts))


def test_no_holder_of_the_device_stands_in_for_an_unreadable_compute_list():
    e = _wedge_with_unreadable_compute([])
    assert Classification.GPU_WEDGED in classes(e)
    assert [a for a in actions(e) if a in DISRUPTIVE] == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]
    wedged = next(a for a in e.alerts if a.classification == Classification.GPU_WEDGED)
    assert wedged.ts == at(75)  # pinned from +15 s, no holder since: 60 s later


def test_a_holder_of_the_device_keeps_an_unreadable_compute_list_unknown():
    e = _wedge_with_unreadable_compute([DeviceHolder(pid=4242, process_name="python3")])
    assert Classification.GPU_WEDGED not in classes(e) and not DISRUPTIVE & set(actions(e))


def test_a_holder_scan_that_did_not_run_is_unknown():
    e = _wedge_with_unreadable_compute(None)
    assert Classification.GPU_WEDGED not in classes(e) and not DISRUPTIVE & set(actions(e))


def test_a_live_compute_list_outranks_the_holders():
    # NVML lists a compute app: a process runs, whatever the holder scan said
    busy = [GpuProcesses(ts=at(t), node=NODE, gpu_uuid=GPU, gpu_index=1, pci_bus_id=PCI, device_holders=[],
                         compute_apps=[ComputeApp(pid=9, process_name="python3")]) for t in range(15, 200, 5)]
    recs = [inventory(), sample(0), xid(10, 43, pid=7), workload(40)] + busy
    recs += [sample(t, util=100, mem=0) for t in range(15, 200, 5)]
    e = run(sorted(recs, key=lambda r: r.ts))
    assert Classification.GPU_WEDGED not in classes(e)


# -- closing steps answered after the incident closed -------------------------------------------
def _resolved_quarantine() -> tuple[Engine, object]:
    recs = [inventory(), sample(0), procs(0, 1, 2, 3)]
    recs += [xid(10, 31, pid=1), xid(20, 31, pid=2)]
    recs += [procs(t, 1, 2, 3) for t in range(25, 700, 10)] + [sample(t) for t in range(25, 700, 10)]
    e = run(sorted(recs, key=lambda r: r.ts))
    release = next(c for c in e.commands if c.action == Action.RELEASE_GPU)
    return e, release


def _answer(cmd, outcome, t=710, **kw):
    return RemediationResult(ts=at(t), node=cmd.node, gpu_uuid=cmd.gpu_uuid, pci_bus_id=cmd.pci_bus_id,
                             command_id=cmd.command_id, incident_id=cmd.incident_id, action=cmd.action,
                             outcome=outcome, detail=kw.get("detail", ""))


def test_a_failed_release_after_the_incident_closed_raises_an_alert():
    e, release = _resolved_quarantine()
    before = len(e.alerts)
    e.process(_answer(release, "failed", detail="taint not found: node changed"))
    new = e.alerts[before:]
    assert len(new) == 1
    assert new[0].incident_id == release.incident_id and new[0].state == "updated"
    assert "RELEASE_GPU failed after the incident resolved" in new[0].summary
    assert "may still be quarantined" in new[0].summary and "taint not found" in new[0].summary
    # answered once: a repeat of the same answer says nothing more
    e.process(_answer(release, "failed", t=720))
    assert len(e.alerts) == before + 1


def test_a_refused_release_is_reported_and_a_succeeded_one_is_quiet():
    e, release = _resolved_quarantine()
    before = len(e.alerts)
    e.process(_answer(release, "succeeded"))
    assert len(e.alerts) == before
    e2, release2 = _resolved_quarantine()
    e2.process(_answer(release2, "refused"))
    assert "RELEASE_GPU refused" in e2.alerts[-1].summary


def test_a_closing_answer_from_another_node_or_for_another_step_is_not_acted_on():
    e, release = _resolved_quarantine()
    before = len(e.alerts)
    foreign = _answer(release, "failed").model_copy(update={"node": "node-b"})
    e.process(foreign)
    wrong_step = _answer(release, "failed").model_copy(update={"action": Action.UNCORDON_NODE})
    e.process(wrong_step)
    assert len(e.alerts) == before


def test_a_dry_runs_answer_to_a_closing_step_says_nothing():
    # review finding: executors default to dry run, so every resolved quarantine asked for a hand fix
    e, release = _resolved_quarantine()
    before = len(e.alerts)
    e.process(_answer(release, "refused", detail="dry run: would delete the DeviceTaintRule"))
    assert len(e.alerts) == before


def test_a_later_incident_resolving_does_not_forget_an_earlier_closing_step():
    """Review finding: the failed UNCORDON of a wedge, answered after a later application-fault
    incident on the same GPU resolved, was dropped: the node stayed cordoned and nobody was told."""
    from tests.streams.builders import Answer, wedge

    e = Engine()
    for r in sorted(wedge(start=120, pinned_until=300), key=lambda r: r.ts):
        e.process(r)
    for a in (Answer(301, Action.CORDON_NODE, "succeeded"), Answer(302, Action.DRAIN_NODE, "succeeded"),
              Answer(310, Action.RESET_GPU, "succeeded")):
        e.process(a.to_result(e))
    for t in range(311, 701, 5):
        e.process(sample(t)), e.process(procs(t, 4242))
    uncordon = next(c for c in e.commands if c.action == Action.UNCORDON_NODE)
    e.process(xid(705, 13, pid=4242))
    for t in range(706, 1021, 5):
        e.process(sample(t)), e.process(procs(t, 4242))
    assert sum(1 for a in e.alerts if a.state == "resolved") == 2
    before = len(e.alerts)
    e.process(_answer(uncordon, "failed", t=1021, detail="apiserver: 403"))
    new = e.alerts[before:]
    assert len(new) == 1 and new[0].incident_id == uncordon.incident_id
    assert "UNCORDON_NODE failed after the incident resolved (apiserver: 403)" in new[0].summary


def test_a_resolution_waits_for_nvml_to_stop_reporting_the_fault():
    """Review finding: the GPU reported a recovery action until +3700 s; the resolution was stamped
    +405 s and its UNCORDON expired 40 min before it was sent."""
    from tests.streams.builders import Answer

    e = Engine()
    for r in (inventory(), sample(0), sample(10).model_copy(update={"recovery_action": 1})):
        e.process(r)
    for a in (Answer(20, Action.CORDON_NODE, "succeeded"), Answer(30, Action.DRAIN_NODE, "succeeded"),
              Answer(100, Action.RESET_GPU, "succeeded")):
        e.process(a.to_result(e))
    for t in range(105, 3700, 30):
        e.process(sample(t).model_copy(update={"recovery_action": 1}))
    for t in range(3700, 4100, 30):
        e.process(sample(t).model_copy(update={"recovery_action": 0}))
    uncordon = next(c for c in e.commands if c.action == Action.UNCORDON_NODE)
    assert uncordon.ts == at(4000)  # healthy from +3700 (the action cleared), 5 min later
    assert uncordon.expires_at > at(4080)  # alive when it is sent


def test_a_gap_in_samples_never_sends_a_closing_step_already_expired():
    e, _ = _resolved_quarantine()  # resolved during its samples: stamped when it held
    recs = [inventory(), sample(0), procs(0, 1, 2, 3), xid(10, 31, pid=1), xid(20, 31, pid=2),
            *[procs(t, 1, 2, 3) for t in range(25, 130, 10)], *[sample(t) for t in range(25, 130, 10)],
            procs(5000, 1, 2, 3), sample(5000)]  # then nothing for 80 min, then a healthy sample
    e = run(sorted(recs, key=lambda r: r.ts))
    release = next(c for c in e.commands if c.action == Action.RELEASE_GPU)
    assert release.ts == at(4700) and release.expires_at > at(5000)


def test_a_dropped_compute_run_never_starts_a_pin_earlier():
    """Review finding: pinned from 0, compute listed until +50 s, then lists alternately empty and
    unreadable: the oldest (compute) run was dropped from the 8 kept, and phantom load came at +60 s,
    40 s after compute was last seen (the rule holds at +110 s)."""
    def unknown(t):
        return GpuProcesses(ts=at(t), node=NODE, gpu_uuid=GPU, gpu_index=1, pci_bus_id=PCI, compute_apps=None,
                            error="NVML_ERROR_UNKNOWN")
    recs = [inventory()] + [sample(t, util=100, mem=0) for t in range(0, 200, 5)] + [procs(t, 7) for t in range(0, 51, 5)]
    recs += [(empty_list if (t // 5) % 2 else unknown)(t) for t in range(55, 200, 5)]
    e = run(sorted(recs, key=lambda r: r.ts))
    phantom = next(a for a in e.alerts if a.classification == Classification.PHANTOM_LOAD)
    assert phantom.ts == at(110)
    assert len(e.states[GPU].proc_runs) == 8 and e.states[GPU].compute_floor == at(50).timestamp()
