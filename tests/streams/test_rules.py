"""Every defect a review found, and every rule of the README's verdict table, on the
pure decision path (streams.engine.Engine through tests.streams.builders.run)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xidstream.schemas import (
    Action,
    Classification,
    ComputeApp,
    ConfigError,
    GpuProcesses,
    RemediationResult,
    XidEvent,
)
from xidstream.schemas.xid_catalog import XID_CATALOG
from xidstream.streams.classify import _climb, _raise
from xidstream.streams.engine import Engine
from xidstream.streams.hardware import RESET
from xidstream.streams.policy import GUARD_MIN_PINNED_SPAN_S, Policy, is_app_class, load_policy
from xidstream.streams.routing import state_key
from xidstream.streams.verdict import Verdict
from tests.streams.builders import GPU, NODE, PCI, at, feed, inventory, procs, result, run, sample, wedge, xid
from tests.tools import examples

NODE_LEVEL = {Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE, Action.REPLACE_NODE}
DISRUPTIVE = NODE_LEVEL | {Action.RESET_GPU}
RESET_PLAN = [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]


def actions(e, gpu=GPU):
    return [c.action for c in e.commands if c.gpu_uuid == gpu]


def classes(e):
    return [a.classification for a in e.alerts]


def pinned(t0, t1, step=5, gpu=GPU, node=NODE, mem=0.0, compute=()):
    out = []
    for t in range(t0, t1, step):
        out += [sample(t, util=100, mem=mem, power=110, gpu=gpu, node=node), procs(t, *compute, gpu=gpu, node=node)]
    return out


def healthy(t0, t1, step=10):
    return [r for t in range(t0, t1, step) for r in (sample(t, util=0, mem=0), procs(t))]


def pod_procs(t, pid, pod, gpu=GPU, node=NODE):
    return GpuProcesses(ts=at(t), node=node, gpu_uuid=gpu, gpu_index=1, pci_bus_id=PCI,
                        compute_apps=[ComputeApp(pid=pid, process_name="python3", pod_uid=pod)])


def recovery_failure(t, gpu=GPU):
    return XidEvent(ts=at(t), node=NODE, gpu_uuid=gpu, gpu_index=1, pci_bus_id=PCI, resolved=True,
                    kind="recovery_failure", message="GPU1 refcntRequestReference_IMPL: Failed to enter state 1",
                    raw="NVRM: GPU1 refcntRequestReference_IMPL: Failed to enter state 1", source="kmsg")


# -- defect 1: PHANTOM_LOAD hidden by any non-application record ---------------------------------
@pytest.mark.parametrize("other", [
    xid(10, 154, pid=None, message="GPU recovery action changed from 0x4 (Drain and Reset) to 0x0 (None)"),
    xid(10, 145, pid=None, message="RLW_SRC_TRACK Nonfatal XC1 i0 Link 03 (0x040868e2 0x00000002 0x00000000 "
                                   "0x00000000 0x00000000 0x00000000)"),
], ids=["xid154-to-none", "nonfatal-nvlink5"])
def test_a_record_only_xid_does_not_hide_phantom_load(other):
    e = run([inventory(), sample(0), procs(0), other] + pinned(15, 200))
    assert classes(e) == [Classification.PHANTOM_LOAD]
    assert actions(e) == [Action.RECORD]


# -- defect 2 and the guard's span: no silent wedge ------------------------------------------------
@pytest.mark.parametrize("seconds", [0, 5, GUARD_MIN_PINNED_SPAN_S - 1])
def test_pinned_seconds_below_the_guard_span_is_refused_at_load(seconds):
    with pytest.raises(ConfigError, match="pinned_seconds must be >= 10"):
        load_policy({"pinned_seconds": seconds})
    with pytest.raises(ConfigError, match="pinned_seconds"):
        Policy(pinned_seconds=seconds)


def test_the_shortest_accepted_pinned_span_still_emits_the_plan():
    e = run(wedge(), load_policy({"pinned_seconds": GUARD_MIN_PINNED_SPAN_S}))
    wedged = [a for a in e.alerts if a.classification == Classification.GPU_WEDGED]
    assert wedged and actions(e)[-3:] == RESET_PLAN
    cordon = next(c for c in e.commands if c.action == Action.CORDON_NODE)
    assert cordon.ts == wedged[0].ts  # the verdict and its plan come together: never a silent wedge


# -- defect 3: the guard is absolute --------------------------------------------------------------
@pytest.mark.parametrize("code", [13, 31, 43, 45, 68, 109, 63, 92])
def test_a_policy_cannot_make_an_application_class_xid_hardware(code):
    with pytest.raises(ConfigError, match=f"hardware_xids lists application-class Xid {code}"):
        load_policy({"hardware_xids": [code]})


@pytest.mark.parametrize("settings, field", [({"pinned_util_pct": 0}, "pinned_util_pct"),
                                             ({"pinned_util_pct": 89}, "pinned_util_pct"),
                                             ({"pinned_mem_fraction": 0.5}, "pinned_mem_fraction")])
def test_a_policy_cannot_redefine_pinned_as_an_ordinary_gpu(settings, field):
    # found by the property test below: with pinned_util_pct 0 and pinned_mem_fraction 0.5, a
    # GPU at 30% with 12 GiB resident counted as pinned, and one Xid 43 cordoned the node
    with pytest.raises(ConfigError, match=field):
        load_policy(settings)


@pytest.mark.parametrize("field", ["app_class_xids", "app_class_resolutions"])
def test_application_class_is_not_a_policy_setting(field):
    with pytest.raises(ConfigError, match=f"{field} is not a policy setting"):
        load_policy({field: [13]})


APP_CODES = sorted(c for c in XID_CATALOG if is_app_class(c))

policies = st.builds(
    lambda **kw: load_policy(kw),
    burst_seconds=st.floats(0, 60),
    suspect_occurrences=st.integers(2, 10),
    suspect_window_s=st.floats(0, 7200),
    suspect_distinct_pids=st.integers(2, 10),
    app_xid_lookback_s=st.floats(0, 7200),
    wedged_xid43_lookback_s=st.floats(600, 7200),
    pinned_util_pct=st.floats(90, 100),
    pinned_mem_fraction=st.floats(0, 0.05),
    pinned_seconds=st.floats(GUARD_MIN_PINNED_SPAN_S, 600),
    wedged_requires_workload_failure=st.booleans(),
    alert_cooldown_s=st.floats(0, 600),
    resolve_after_s=st.floats(0, 600),
    command_ttl_s=st.floats(1, 7200),
    max_clock_skew_s=st.floats(0, 3600),
    hardware_xids=st.lists(st.sampled_from(sorted(c for c in XID_CATALOG if not is_app_class(c))), max_size=5),
)


def _propose_reset(state, policy):
    """What a rule proposing the wedge's reset plan on this state gets past the guard.

    No rule proposes a disruptive plan without the guard's evidence today (`pinned_verdict`
    checks the sustained pin itself), so records alone never make the guard refuse: a GPU_WEDGED
    verdict without hardware evidence, offered to both of the guard's callers, stands in for a
    rule that would (`_raise` for a new plan, `_climb` for the next rung of an open incident)."""
    outputs = []
    ts = state.clock
    _raise(state, Verdict(Classification.GPU_WEDGED, RESET, "a rule proposing a reset", []), ts, policy, outputs)
    inc = state.incident
    if inc is not None and inc.classification not in (Classification.GPU_WEDGED, Classification.GPU_HARDWARE_FAULT):
        _climb(state, inc, ts, Action.REBOOT_NODE, "a rule proposing a reboot", policy, outputs, [], None)
    return outputs


# Pinned without compute, but short of the guard's floor (2 samples >= 10 s apart): one sample,
# or several within under 10 s. (A record's stamp keeps microseconds: 9.9999999 s would be 10.)
short_pins = st.lists(st.floats(0, GUARD_MIN_PINNED_SPAN_S - 0.001), max_size=4)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies,
       faults=st.lists(st.tuples(st.integers(1, 3000), st.sampled_from(APP_CODES), st.one_of(st.none(), st.integers(1, 9))),
                       min_size=1, max_size=12),
       busy=st.booleans(), pin=short_pins)
def test_guard_holds_for_any_accepted_policy(policy, faults, busy, pin):
    """Application-class Xids from any workloads, on a GPU that is healthy or busy with a live
    compute process and then pinned without compute for less than the guard's span: never a
    node-level command, whatever the policy, and the guard refuses one a rule would propose."""
    recs = [inventory()]
    for t in range(0, 3100, 20):
        recs += [sample(t, util=100 if busy else 20, mem=9000), procs(t, 4242)]
    recs += [xid(t, code, pid=pid) for t, code, pid in faults]
    recs += [r for d in pin for r in (sample(3100 + d, util=100, mem=0), procs(3100 + d))]
    e = run(recs, policy)
    assert not DISRUPTIVE & set(actions(e))
    assert _propose_reset(e.states[GPU], policy) == []


@settings(max_examples=examples(60), deadline=None)
@given(policy=policies, code=st.sampled_from(APP_CODES), later=st.floats(0, 600))
def test_a_single_app_xid_then_one_pinned_sample_never_acts(policy, code, later):
    e = run([inventory(), sample(0), procs(0), xid(10, code), sample(11 + later, util=100, mem=0), procs(11 + later)],
            policy)
    assert not DISRUPTIVE & set(actions(e))
    state = e.states[GPU]
    assert state.pinned_samples == 1  # the guard's evidence is one sample short
    assert _propose_reset(state, policy) == []


def test_the_guard_lets_a_reset_through_on_its_own_evidence():
    # the other side of the two tests above: the same proposal passes with a sustained pin
    e = run([inventory(), sample(0), procs(0), xid(10, 13)]
            + [r for t in (11, 11 + GUARD_MIN_PINNED_SPAN_S) for r in (sample(t, util=100, mem=0), procs(t))])
    assert [c.action for _, c in _propose_reset(e.states[GPU], Policy()) if _ == "command"] == RESET_PLAN


# -- defect 4: results are matched to the commands they answer -------------------------------------
def _foreign(t, action, outcome, incident="0" * 24, command="f" * 24):
    return RemediationResult(ts=at(t), node=NODE, gpu_uuid=GPU, command_id=command, incident_id=incident,
                             action=action, outcome=outcome, detail="from another incident")


def test_a_foreign_failed_reset_does_not_climb_the_ladder():
    e = run(wedge() + [_foreign(310, Action.RESET_GPU, "failed")])
    assert Action.REBOOT_NODE not in actions(e)
    notes = [t for t in run(wedge() + [_foreign(310, Action.RESET_GPU, "failed"), result(320, Action.RESET_GPU, "refused")])
             .alerts[-1].evidence.timeline if t.kind == "remediation"]
    assert any("answers no command of this incident" in t.summary for t in notes)


def test_a_stale_success_does_not_mark_the_incident_repaired():
    e = run(wedge() + [_foreign(310, Action.RESET_GPU, "succeeded")] + healthy(320, 1000))
    assert all(a.state != "resolved" for a in e.alerts)
    assert Action.UNCORDON_NODE not in actions(e)


def test_a_result_of_the_right_command_id_but_another_action_is_not_acted_on():
    e = run(wedge())
    reset = e.commands[-1]
    feed(e, [_foreign(310, Action.REBOOT_NODE, "failed", incident=reset.incident_id, command=reset.command_id)])
    assert Action.REPLACE_NODE not in actions(e)


def test_a_repeated_answer_counts_once():
    # A refused command asks for an operator once; the same answer delivered again (an executor's
    # retry, a re-read partition) must not page again. (A repeated "failed" would not show it:
    # the ladder's `may_emit` holds its rung anyway.)
    e = run(wedge() + [result(310, Action.RESET_GPU, "refused", detail="GPU busy")])
    reset = next(c for c in e.commands if c.action == Action.RESET_GPU)
    paged = [a for a in e.alerts if "operator attention needed" in a.summary]
    assert len(paged) == 1
    alerts, commands = len(e.alerts), len(e.commands)
    again = RemediationResult(ts=at(311), node=NODE, gpu_uuid=GPU, command_id=reset.command_id,
                              incident_id=reset.incident_id, action=Action.RESET_GPU, outcome="refused",
                              detail="GPU busy")
    feed(e, [again])
    assert (len(e.alerts), len(e.commands)) == (alerts, commands)
    # recorded, not acted on: the next alert's timeline says so
    feed(e, [xid(400, 79, pid=None)])
    notes = [t for t in e.alerts[-1].evidence.timeline if t.kind == "remediation"]
    assert [t.data["matched"] for t in notes] == [True, False]
    assert f"repeats the answer to command {reset.command_id} (first: refused)" in notes[-1].summary


def test_results_of_an_unresolved_gpu_reach_its_incident():
    e = run([xid(10, 119, gpu=None, pid=None)])
    reboot = e.commands[-1]
    assert reboot.action == Action.REBOOT_NODE and reboot.gpu_uuid is None and reboot.pci_bus_id == PCI
    failed = RemediationResult(ts=at(400), node=NODE, gpu_uuid=None, pci_bus_id=reboot.pci_bus_id,
                               command_id=reboot.command_id, incident_id=reboot.incident_id,
                               action=Action.REBOOT_NODE, outcome="failed")
    assert state_key(failed) == f"{NODE}/{PCI}" == state_key(xid(10, 119, gpu=None))
    feed(e, [failed])
    assert e.commands[-1].action == Action.REPLACE_NODE


# -- defect 5: the ladder only climbs ----------------------------------------------------------------
def test_no_gpu_reset_after_a_node_reboot_was_ordered():
    recs = [inventory(), sample(0), procs(0, 4242), xid(5, 79, pid=None)] + wedge()[3:]
    e = run(recs)
    acts = actions(e)
    assert Action.REBOOT_NODE in acts
    assert Action.RESET_GPU not in acts[acts.index(Action.REBOOT_NODE):]


# -- defect 9: NVIDIA's names -----------------------------------------------------------------------
@pytest.mark.parametrize("code, name", [(63, "INFOROM_DRAM_RETIREMENT_EVENT"), (92, "EXCESSIVE_SBE_INTERRUPTS")])
def test_memory_events_nvidia_ignores_are_not_called_application_faults(code, name):
    e = run([sample(0), xid(10, code, pid=None)])
    summary = e.alerts[0].summary
    assert "application fault" not in summary and name in summary and "NVIDIA: IGNORE" in summary


# -- rule: count workloads, not PIDs ------------------------------------------------------------------
def crash_loop(pod="pod-crashy", gpu=GPU, restarts=5, start=10, every=60, pid0=100):
    recs = []
    for i in range(restarts):
        t = start + i * every
        recs += [pod_procs(t, pid0 + i, pod, gpu=gpu), xid(t + 2, 13, pid=pid0 + i, gpu=gpu)]
    return recs


def test_a_crash_looping_pod_is_one_workload_recorded_never_quarantined():
    e = run([inventory(), sample(0)] + crash_loop())
    assert set(classes(e)) == {Classification.APP_FAULT}
    assert set(actions(e)) == {Action.RECORD}
    # alerts after the first are held by the cooldown; every occurrence is a RECORD with its count
    assert "5 occurrences of this workload" in e.commands[-1].reason
    e = run([inventory(), sample(0)] + crash_loop() + [sample(400)], load_policy({"alert_cooldown_s": 0}))
    assert e.alerts[-1].evidence.timeline[-1].data["workload_occurrences"] == 5


def test_two_pods_faulting_one_gpu_still_make_a_suspect():
    recs = [inventory(), sample(0), pod_procs(10, 1, "pod-a"), xid(12, 13, pid=1), pod_procs(50, 2, "pod-b"),
            xid(52, 13, pid=2)]
    # Until a process list as new as the second fault is read, its PID's pod is not known for sure
    assert Classification.GPU_SUSPECT not in classes(run(recs))
    e = run(recs + [procs(55)])
    assert classes(e)[-1] == Classification.GPU_SUSPECT and actions(e)[-1] == Action.QUARANTINE_GPU
    assert e.commands[-1].ts == at(52)  # as of the evidence, not of the list that settled it


def test_a_crash_loop_read_before_its_process_lists_is_still_one_workload():
    recs = [inventory(), sample(0), procs(0)] + crash_loop() + [procs(400)]
    xids_first = [r for r in recs if isinstance(r, XidEvent)] + [r for r in recs if not isinstance(r, XidEvent)]
    e = feed(Engine(), xids_first)
    assert not {c.action for c in e.commands} - {Action.RECORD}


def test_a_workload_faulting_two_gpus_is_said_to_follow_the_workload():
    other = "GPU-99999999-2222-3333-4444-555555555555"
    e = run([inventory(), sample(0), sample(0, gpu=other)] + crash_loop(restarts=1)
            + crash_loop(gpu=other, restarts=1, start=30, pid0=200))
    follows = [a for a in e.alerts if "follows the workload" in a.summary]
    assert len(follows) == 1 and "pod-crashy" in follows[0].summary
    assert follows[0].classification == Classification.APP_FAULT
    assert not [c for c in e.commands if c.action != Action.RECORD]


# -- rule: a driver recovery failure is wedge evidence like Xid 43 -------------------------------------
def test_recovery_failure_plus_pinned_without_compute_is_wedged():
    recs = [inventory(), sample(0), procs(0, 4242), xid(100, 13), recovery_failure(102)] + pinned(105, 200)
    e = run(recs)
    assert classes(e)[-1] == Classification.GPU_WEDGED
    assert actions(e)[-3:] == RESET_PLAN
    assert "failure to recover" in e.alerts[-1].summary


# -- rule: a live compute process keeps a GPU out of GPU_WEDGED and PHANTOM_LOAD ------------------------
@pytest.mark.parametrize("mem", [20000.0, 0.0], ids=["memory-resident", "memory-unreadable-as-0"])
def test_a_busy_job_after_another_ranks_xid_43_is_not_wedged(mem):
    recs = [inventory(), sample(0), procs(0, 7), xid(10, 43, pid=8)] + pinned(12, 400, mem=mem, compute=(7,))
    e = run(recs)
    assert not {Classification.GPU_WEDGED, Classification.PHANTOM_LOAD} & set(classes(e))
    assert not DISRUPTIVE & set(actions(e))


def test_an_unreadable_process_list_is_never_no_process():
    unknown = [GpuProcesses(ts=at(t), node=NODE, gpu_uuid=GPU, gpu_index=1, pci_bus_id=PCI, compute_apps=None,
                            error="NVML_ERROR_UNKNOWN") for t in range(15, 400, 5)]
    recs = [inventory(), sample(0), procs(0, 7), xid(10, 43, pid=7)]
    recs += [sample(t, util=100, mem=0) for t in range(15, 400, 5)] + unknown
    e = run(recs)
    assert Classification.GPU_WEDGED not in classes(e) and not DISRUPTIVE & set(actions(e))


# -- rule: Xid 45 alone is never more than RECORD --------------------------------------------------------
def test_xid_45_teardown_across_nodes_is_only_recorded():
    recs = []
    for n in range(8):
        node = f"node-{n}"
        for g in range(2):
            gpu = f"GPU-{n:04d}{g:04d}-0000-0000-0000-000000000000"
            recs += [inventory(0, gpu=gpu, node=node), sample(0, gpu=gpu, node=node)]
            recs += [xid(100 + 0.01 * p, 45, pid=1000 + p, gpu=gpu, node=node) for p in range(3)]
            recs += [xid(110 + 0.01 * p, 45, pid=2000 + p, gpu=gpu, node=node) for p in range(3)]
    e = run(recs)
    assert set(classes(e)) == {Classification.APP_FAULT}
    assert {c.action for c in e.commands} == {Action.RECORD}


def test_xid_45_then_pinned_is_at_most_recorded():
    e = run([inventory(), sample(0), procs(0, 7), xid(10, 45, pid=7)] + pinned(15, 200))
    assert set(actions(e)) == {Action.RECORD}


# -- rule: event time survives bad clocks -------------------------------------------------------------------
def test_a_line_stamped_hours_ahead_does_not_blind_the_gpu():
    skewed = xid(0, 13, pid=777).model_copy(update={"ts": at(5 * 3600)})
    recs = [inventory(), sample(0), procs(0, 4242), sample(50), procs(50, 4242)]
    e = feed(Engine(), recs + [skewed])
    feed(e, sorted(wedge()[3:], key=lambda r: r.ts))
    feed(e, [result(310, Action.RESET_GPU, "succeeded")] + healthy(320, 1000))
    # the real Xid 13 was an occurrence of its own, the wedge was found, and the incident resolved
    assert [c.action for c in e.commands if "pid 4242" in c.reason] == [Action.RECORD]
    assert Classification.GPU_WEDGED in classes(e)
    assert e.alerts[-1].state == "resolved" and Action.UNCORDON_NODE in actions(e)[-2:]
    notes = [t.summary for a in e.alerts for t in a.evidence.timeline if t.kind == "note"]
    assert any("ahead of this GPU's clock" in n for n in notes)


def test_a_skew_within_the_bound_is_taken_as_stamped():
    e = run([inventory(), sample(0), procs(0, 7), xid(200, 13, pid=7)])
    assert e.alerts[0].ts == at(200)


# -- rule: history never acts now ---------------------------------------------------------------------------
def test_commands_expire_a_ttl_after_their_evidence_and_name_it():
    recs = wedge()
    e = run(recs, load_policy({"command_ttl_s": 600}))
    x43 = next(r for r in recs if getattr(r, "xid", None) == 43)
    for c in e.commands:
        assert c.expires_at - c.ts == timedelta(seconds=600)
        assert c.evidence_ids
    reset = e.commands[-1]
    assert x43.event_id in reset.evidence_ids
    assert {r.event_id for r in recs} >= set(reset.evidence_ids)
    assert Policy().command_ttl_s == 900


def test_backfilled_history_is_evidence_never_an_action():
    old = xid(10, 79, pid=None).model_copy(update={"backfilled": True})
    e = run([sample(0), old, sample(20)])
    assert e.alerts == [] and e.commands == []
    e = run([sample(0), old, xid(30, 119, pid=None)])
    assert any(t.data.get("backfilled") for t in e.alerts[0].evidence.timeline)


def test_a_result_stamped_hours_ahead_does_not_hide_a_second_wedge():
    """An executor whose clock is 5 h fast reports the reset: the GPU wedging again 90 s later
    must still climb to a reboot (before the fix, the reset counted from 5 h ahead and every
    later wedge was read as older than it)."""
    e = run(wedge())
    ok = result(310, Action.RESET_GPU, "succeeded").to_result(e).model_copy(update={"ts": at(5 * 3600)})
    again = healthy(320, 330, 5) + pinned(400, 500)
    feed(e, [ok] + again)
    assert actions(e)[-1] == Action.REBOOT_NODE


# -- the collector's NVML signals on the processor side ----------------------------------------------------------
@pytest.mark.parametrize("value, last", [(1, Action.RESET_GPU), (4, Action.RESET_GPU), (6, Action.RESET_GPU),
                                         (2, Action.REBOOT_NODE), (7, Action.REBOOT_NODE), (3, Action.QUARANTINE_GPU)])
def test_nvml_recovery_action_is_hardware_evidence_like_xid_154(value, last):
    hw = sample(10).model_copy(update={"recovery_action": value})
    e = run([inventory(), sample(0), procs(0, 7), hw, sample(11).model_copy(update={"recovery_action": value})])
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT]  # once, not per sample
    assert actions(e)[-1] == last
    assert "recovery action" in e.alerts[0].summary


def test_recovery_action_none_is_not_a_fault():
    e = run([inventory(), sample(0).model_copy(update={"recovery_action": 0}), sample(1)])
    assert e.alerts == []


def test_a_row_remap_failure_follows_nvidias_xid_64_resolution_and_asks_for_an_rma():
    bad = sample(10).model_copy(update={"remapped_rows_failure": True, "remapped_rows_uncorrectable": 8})
    e = run([inventory(), sample(0), procs(0, 7), bad, sample(11).model_copy(update={"remapped_rows_failure": True})])
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT]
    assert actions(e) == RESET_PLAN
    assert any("RMA" in s for s in e.alerts[0].recommended_steps)


def test_two_workloads_make_a_suspect_in_whichever_order_their_faults_are_read():
    a, b = xid(12, 13, pid=1), xid(52, 13, pid=2)
    base = [inventory(), sample(0), procs(0), procs(60), sample(142)]  # +142: 90 s after the second, unnamed
    for order in ([a, b], [b, a]):
        e = feed(Engine(), base + order)
        quarantine = [c for c in e.commands if c.action == Action.QUARANTINE_GPU]
        assert len(quarantine) == 1 and quarantine[0].ts == at(52)



# -- review findings (independent review after the first landing) ------------------------------------
def _rebooted(extra):
    return run(wedge() + [result(310, Action.RESET_GPU, "failed"), result(320, Action.REBOOT_NODE, "succeeded")] + extra)


def test_a_reboot_that_has_not_happened_yet_is_not_a_second_wedge():
    # REBOOT_NODE "succeeded" means kured's sentinel was written; the GPU pinned on is the same wedge
    e = _rebooted(pinned(325, 500))
    assert Action.REPLACE_NODE not in actions(e)
    # once the node came back healthy, a new wedge is the last rung
    e = _rebooted(healthy(400, 420, 10) + pinned(430, 600))
    assert actions(e)[-1] == Action.REPLACE_NODE


@pytest.mark.parametrize("record_only", [
    xid(700, 154, pid=None, message="GPU recovery action changed from 0x4 (Drain and Reset) to 0x0 (None)"),
    xid(700, 145, pid=None, message="RLW_SRC_TRACK Nonfatal XC1 i0 Link 03 (0x040868e2 0x00000002 0x00000000 "
                                     "0x00000000 0x00000000 0x00000000)"),
], ids=["xid154-to-none", "nonfatal-nvlink5"])
def test_a_record_only_xid_after_the_reboot_is_not_a_reason_to_replace(record_only):
    e = _rebooted(healthy(400, 690, 10) + [record_only])
    assert Action.REPLACE_NODE not in actions(e)


def _restarted_every_record(records, policy=None):
    """The fold as the faust table runs it: the row is written only when `step` says it changed,
    and read back (orjson) for every record, as after a restart or a rebalance."""
    import orjson

    from xidstream.streams.classify import GpuState, step
    from xidstream.streams.routing import state_key

    table, outs = {}, []
    for r in sorted(records, key=lambda r: r.ts):
        key = state_key(r)
        stored = table.get(key)
        state = GpuState.from_dict(orjson.loads(stored)) if stored else None
        state, out, changed = step(state, key, r, policy or Policy())
        if changed:
            table[key] = orjson.dumps(state.to_dict())
        outs += [(k, getattr(o, "action", None) or getattr(o, "classification", None), o.ts)
                 for k, o in out if k != "workload_fault"]
    return outs


def _live(records, policy=None):
    from xidstream.streams.classify import step
    from xidstream.streams.routing import state_key

    states, outs = {}, []
    for r in sorted(records, key=lambda r: r.ts):
        key = state_key(r)
        state, out, _ = step(states.get(key), key, r, policy or Policy())
        states[key] = state
        outs += [(k, getattr(o, "action", None) or getattr(o, "classification", None), o.ts)
                 for k, o in out if k != "workload_fault"]
    return outs


@pytest.mark.parametrize("case", ["job-leaves-a-pinned-gpu", "two-hours-healthy-then-wedge"])
def test_what_is_persisted_decides_as_live_does(case):
    """Every fact a verdict needs survives the table (found by review: the GPU's clock and the
    newest compute snapshot were not persisted, so a restart changed the verdict)."""
    if case == "job-leaves-a-pinned-gpu":
        recs = [inventory(), sample(0), procs(0, 4242), recovery_failure(11)] + pinned(15, 120, compute=(4242,))
        recs += pinned(120, 200)
    else:
        recs = [inventory()] + [r for t in range(0, 7200, 30) for r in (sample(t), procs(t, 7))]
        recs += [xid(7210, 13, pid=7), xid(7211, 31, pid=7), xid(7212, 43, pid=7)] + pinned(7215, 7400)
    assert _restarted_every_record(recs) == _live(recs)


def test_rows_written_before_issue_8_still_fold():
    from xidstream.streams.classify import GpuState

    old = {"key": GPU, "node": NODE, "gpu_uuid": GPU, "occurrences": [{"ts": 1.0, "last_ts": 1.0, "pid": 7, "codes": [13],
                                                                     "pod": None}],
           "incident": {"id": "i", "classification": "GPU_WEDGED", "opened_at": 1.0, "remedy": "reset",
                        "plan": ["CORDON_NODE"], "emitted": [{"step": 0, "action": "CORDON_NODE", "command_id": "c",
                                                              "ts": 1.0}], "timeline": []}}
    state = GpuState.from_dict(old)
    assert state.occurrences[0]["wl"] == "pid:7" and state.incident.emitted[0]["outcome"] is None
    from xidstream.streams.classify import step

    step(state, GPU, sample(5), Policy())  # no KeyError


def test_a_persisting_remap_failure_keeps_the_incident_open_after_the_reset():
    bad = {"remapped_rows_failure": True}
    recs = [inventory(), sample(0), procs(0, 7), sample(10).model_copy(update=bad)]
    recs += [r for t in range(20, 1200, 10) for r in (sample(t, util=0, mem=0).model_copy(update=bad), procs(t))]
    e = run(recs + [result(15, Action.RESET_GPU, "succeeded")])
    assert all(a.state != "resolved" for a in e.alerts)
    assert Action.UNCORDON_NODE not in actions(e)


def test_a_multi_gpu_teardown_does_not_say_the_fault_follows_the_workload():
    recs = [inventory()]
    for g in range(8):
        gpu = f"GPU-{g:08d}-2222-3333-4444-555555555555"
        recs += [sample(0, gpu=gpu), pod_procs(5, 100 + g, "pod-job", gpu=gpu), xid(10, 45, pid=100 + g, gpu=gpu),
                 procs(11, gpu=gpu)]
    e = run(recs)
    assert not [a for a in e.alerts if "follows the workload" in a.summary]


@pytest.mark.parametrize("setting", [{"fleet_window_s": float("nan")}, {"resolve_after_s": float("nan")},
                                     {"max_clock_skew_s": float("nan")}, {"command_ttl_s": float("inf")},
                                     {"command_ttl_s": 1e12}, {"fleet_min_nodes": -5},
                                     {"hardware_xids": [1.9]}, {"hardware_xids": [True]},
                                     {"wedged_xid43_lookback_s": 0}])
def test_hostile_policies_that_used_to_load_are_refused(setting):
    with pytest.raises(ConfigError):
        load_policy(setting)



@pytest.mark.parametrize("drift_s", [6 * 3600, -40 * 60], ids=["6h-ahead", "40min-behind-after-suspend"])
def test_a_live_line_is_bounded_by_when_the_collector_read_it_whatever_the_read_order(drift_s):
    """Found by review: the bound was "ahead of the newest sample read so far", so a backlog with
    gpu.xid read far ahead of gpu.samples clamped correct stamps, and a `dmesg -T` stamp drifted
    40 min early (the printk clock stops in suspend) was not bounded at all and the wedge was missed."""
    chain = [xid(7210, 13, pid=7), xid(7211, 31, pid=7), xid(7212, 43, pid=7)]
    chain = [x.model_copy(update={"observed_at": x.ts, "ts": at(7210 + i + drift_s)}) for i, x in enumerate(chain)]
    telemetry = [inventory()] + [r for t in range(0, 7200, 30) for r in (sample(t), procs(t, 7))] + pinned(7215, 7400)
    # the worst order: every Xid read before any sample (a backlog drained topic by topic)
    e = feed(Engine(), chain + telemetry)
    assert Classification.GPU_WEDGED in classes(e)
    assert actions(e)[-3:] == RESET_PLAN
    notes = [t.summary for a in e.alerts for t in a.evidence.timeline if t.kind == "note"]
    assert any("when it was read" in n for n in notes)


def test_a_backfilled_line_keeps_its_own_time():
    old = xid(10, 79, pid=None).model_copy(update={"backfilled": True, "observed_at": at(99999)})
    e = run([sample(0), old, xid(30, 119, pid=None)])
    assert [t.ts for t in e.alerts[0].evidence.timeline if t.data.get("backfilled")] == [at(10)]



def test_a_result_about_another_node_does_not_move_the_incident():
    e = run(wedge())
    reset = e.commands[-1]
    feed(e, [RemediationResult(ts=at(310), node="some-other-node", gpu_uuid=GPU, command_id=reset.command_id,
                               incident_id=reset.incident_id, action=Action.RESET_GPU, outcome="failed")])
    assert Action.REBOOT_NODE not in actions(e)
    feed(e, [result(320, Action.RESET_GPU, "failed")])  # the real answer still counts
    assert actions(e)[-1] == Action.REBOOT_NODE


def test_a_row_leaves_out_what_is_at_its_default_and_reads_back_the_same_state():
    """Memory per GPU: the row omits fields at their default; reading it back gives
    the same state, for a healthy GPU and through a whole wedge with its incident."""
    import orjson

    from xidstream.streams.classify import GpuState, step

    healthy = [inventory()] + [r for t in range(0, 60, 10) for r in (sample(t), procs(t, 7))]
    for recs in (healthy, wedge()):
        state = None
        for r in recs:
            state, _, _ = step(state, state_key(r), r, Policy())
            row = orjson.dumps(state.to_dict())
            assert GpuState.from_dict(orjson.loads(row)) == state
    healthy_state = None
    for r in healthy:
        healthy_state, _, _ = step(healthy_state, state_key(r), r, Policy())
    full = {k: getattr(healthy_state, k) for k in GpuState.__dataclass_fields__}
    assert len(orjson.dumps(healthy_state.to_dict())) < 0.6 * len(orjson.dumps(full))


# -- power smoothing: Xid 163 raises, 162 clears it (rule and scenario power-smoothing-cancel) ----
def test_a_power_smoothing_disengagement_re_engaged_within_the_bound_is_cancelled():
    e = run([sample(0), xid(10, 163, pid=None), sample(20), xid(70, 162, pid=None), sample(80)])
    assert actions(e) == [Action.QUARANTINE_GPU, Action.RELEASE_GPU]
    assert not DISRUPTIVE & set(actions(e))
    opened, cancelled = e.alerts
    assert (opened.classification, opened.state) == (Classification.GPU_HARDWARE_FAULT, "open")
    assert "thermal events" in " ".join(opened.recommended_steps)  # NVIDIA's words for 163, not a support case
    assert (cancelled.incident_id, cancelled.state, cancelled.ts) == (opened.incident_id, "resolved", at(70))
    assert "Xid 163 (PSHC_DISENGAGED" in cancelled.summary and "cancelled by Xid 162 (PSHC_REENGAGED" in cancelled.summary
    assert "60 s later" in cancelled.summary and "cancelled" in cancelled.evidence.timeline[-1].summary
    release = e.commands[-1]
    assert (release.incident_id, release.ts) == (opened.incident_id, at(70))
    assert e.states[GPU].incident is None


def test_a_power_smoothing_disengagement_read_after_its_re_engagement_raises_nothing():
    """The two by their own times: a 163 read after the 162 that re-engaged it (within the bound)
    is the same cancelled disengagement, with nothing to close."""
    e = feed(Engine(), [sample(0), xid(70, 162, pid=None), xid(10, 163, pid=None), sample(80)])
    assert e.alerts == [] and e.commands == []
    notes = [n["summary"] for n in e.states[GPU].pending_notes]
    assert any("Xid 163 (PSHC_DISENGAGED" in n and "cancelled by Xid 162" in n and "60 s later" in n for n in notes)


def test_a_late_copy_of_a_cancelled_disengagement_raises_nothing():
    """The same 163 published again after the cancel (an NVML event past the collector's merge
    window): the 162 that cancelled it still stands."""
    e = run([sample(0), xid(10, 163, pid=None), xid(70, 162, pid=None), sample(80)])
    feed(e, [xid(10, 163, pid=None, message="(from NVML event; no kernel log line seen)"), sample(90)])
    assert actions(e) == [Action.QUARANTINE_GPU, Action.RELEASE_GPU] and e.states[GPU].incident is None


def test_a_power_smoothing_re_engagement_alone_is_only_evidence():
    e = run([sample(0), xid(10, 162, pid=None), sample(20)])
    assert e.alerts == [] and e.commands == []
    assert [n["data"]["xid"] for n in e.states[GPU].pending_notes if n["kind"] == "xid"] == [162]


def test_a_power_smoothing_disengagement_re_engaged_past_the_bound_stays_open_for_a_person():
    e = run([sample(0), xid(10, 163, pid=None), sample(150), sample(300), xid(10 + 301, 162, pid=None), sample(400)])
    assert actions(e) == [Action.QUARANTINE_GPU] and [a.state for a in e.alerts] == ["open"]
    inc = e.states[GPU].incident
    assert inc is not None and any("past pshc_cancel_s (300 s)" in n["summary"] for n in inc.timeline)


@pytest.mark.parametrize("other", [
    xid(20, 167, pid=None),  # PCIE_FATAL_TIMEOUT: another hardware Xid into the same quarantine
    xid(20, 999, pid=None),  # a code outside the catalog
    xid(20, 13, pid=4242),  # an application fault on the GPU meanwhile
])
def test_a_power_smoothing_disengagement_with_other_evidence_is_not_cancelled(other):
    e = run([sample(0), xid(10, 163, pid=None), other, xid(70, 162, pid=None), sample(80)])
    assert Action.RELEASE_GPU not in actions(e) and e.states[GPU].incident is not None
    assert not any(a.state == "resolved" for a in e.alerts)


def test_a_re_engagement_cancels_no_incident_it_did_not_open():
    """A 163 that joined an incident opened before it (a wedge's reset here) closes nothing when
    power smoothing re-engages: the incident rests on other evidence."""
    e = run(wedge() + [xid(250, 163, pid=None), xid(260, 162, pid=None)])
    assert Action.RESET_GPU in actions(e) and Action.RELEASE_GPU not in actions(e)
    assert e.states[GPU].incident is not None


def test_the_power_smoothing_pair_as_the_policy_lists_it():
    """A code the policy lists in hardware_xids is taken as the operator says: never cancelled."""
    policy = load_policy({"hardware_xids": [162, 163]})
    e = run([sample(0), xid(10, 163, pid=None), xid(70, 162, pid=None)], policy)
    assert actions(e) == [Action.QUARANTINE_GPU] and e.states[GPU].incident is not None
    e = run([sample(0), xid(10, 163, pid=None), xid(70, 162, pid=None)], load_policy({"pshc_cancel_s": 30}))
    assert actions(e) == [Action.QUARANTINE_GPU]  # 60 s is past a bound of 30
