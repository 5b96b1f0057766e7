"""The pure decision path (streams.classify + streams.fleet through streams.engine.Engine)."""

from __future__ import annotations

import pytest

from xidstream.schemas import Action, Classification, RemediationResult
from xidstream.streams.classify import _phase, step
from xidstream.streams.engine import Engine
from xidstream.streams.evidence import GpuState
from xidstream.streams.policy import Policy, load_policy
from xidstream.streams.render import STEP_TEXT, hid
from tests.streams.builders import GPU, NODE, PCI, at, feed, inventory, procs, result, run, sample, wedge, workload, xid


def run_with(policy, records):
    return run(records, policy)

NODE_LEVEL = {Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE, Action.REPLACE_NODE}


def actions(engine, gpu=GPU):
    return [c.action for c in engine.commands if c.gpu_uuid == gpu]


def classes(engine):
    return [a.classification for a in engine.alerts]


def test_motivating_incident_is_one_wedged_incident_with_the_reset_plan():
    e = run(wedge())
    assert classes(e) == [Classification.APP_FAULT, Classification.GPU_WEDGED]
    assert actions(e) == [Action.RECORD, Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]
    assert len({a.incident_id for a in e.alerts} | {c.incident_id for c in e.commands}) == 1
    wedged = e.alerts[-1]
    assert wedged.ts >= at(122 + 60)  # >= 60 s of pinned samples after the Xid 43
    assert wedged.evidence.xid_counts == {"13": 2, "31": 1, "43": 1}
    assert wedged.evidence.sample_stats["utilization_gpu_pct_min"] == 100
    assert any("--gpu-reset -i 1" in s for s in wedged.recommended_steps)
    reset = e.commands[-1]
    assert reset.preconditions[0].startswith("no process on the GPU") and not reset.requires_approval


def test_one_fault_printing_many_lines_is_one_occurrence():
    e = run([sample(0), xid(10, 13), xid(10.1, 13), xid(10.2, 13), xid(11, 31), xid(12, 43)])
    assert classes(e) == [Classification.APP_FAULT]
    assert actions(e) == [Action.RECORD]


def test_a_lone_xid_13_is_recorded_only():
    e = run([sample(0), procs(0, 4242), xid(60, 13), sample(61), procs(61, 4242)])
    assert classes(e) == [Classification.APP_FAULT]
    assert e.alerts[0].evidence.pod_uids == ["pod-4242"]
    assert actions(e) == [Action.RECORD]


def test_three_occurrences_in_ten_minutes_make_a_suspect():
    # Old drivers print no pid: each unidentified occurrence counts on its own.
    e = run([sample(0), xid(10, 13, pid=None), xid(200, 31, pid=None), xid(400, 13, pid=None)])
    assert classes(e)[-1] == Classification.GPU_SUSPECT
    assert actions(e) == [Action.RECORD, Action.RECORD, Action.RECORD, Action.QUARANTINE_GPU]
    assert not NODE_LEVEL & set(actions(e))


def test_one_process_repeating_is_one_workload_recorded_with_its_repeat_count():
    e = run([sample(0), xid(10, 13), xid(200, 31), xid(400, 13)])
    assert set(classes(e)) == {Classification.APP_FAULT}
    assert actions(e) == [Action.RECORD] * 3
    assert "3 occurrences of this workload" in e.alerts[-1].summary


def test_two_pids_in_ten_minutes_make_a_suspect():
    # the process list published after the second fault, and 90 s without a pod's death naming it
    # (evidence.NAME_WAIT_S), settle who faulted (neither in a pod)
    e = run([sample(0), xid(10, 31, pid=1), xid(100, 31, pid=2), procs(101), sample(189)])
    assert Classification.GPU_SUSPECT not in classes(e)
    e = run([sample(0), xid(10, 31, pid=1), xid(100, 31, pid=2), procs(101), sample(190)])
    assert classes(e)[-1] == Classification.GPU_SUSPECT
    assert "2 different processes" in e.alerts[-1].summary


def test_occurrences_outside_the_window_do_not_add_up():
    e = run([sample(0), xid(0, 13), xid(700, 13), xid(1400, 13)])
    assert Classification.GPU_SUSPECT not in classes(e)


def test_phantom_load_without_any_xid_is_only_recorded():
    recs = [inventory(), sample(0), procs(0)]
    recs += [r for t in range(5, 200, 5) for r in (sample(t, util=100, mem=0), procs(t))]
    e = run(recs)
    assert classes(e) == [Classification.PHANTOM_LOAD]
    assert actions(e) == [Action.RECORD]


def test_pinned_with_a_compute_app_is_not_phantom():
    recs = [r for t in range(0, 200, 5) for r in (sample(t, util=100, mem=0), procs(t, 99))]
    assert run(recs).alerts == []


def test_pinned_after_an_app_xid_without_xid_43_is_a_suspect():
    recs = [sample(0), procs(0, 7), xid(10, 13, pid=7)]
    recs += [r for t in range(15, 200, 5) for r in (sample(t, util=100, mem=0), procs(t))]
    e = run(recs)
    assert classes(e) == [Classification.APP_FAULT, Classification.GPU_SUSPECT]
    assert actions(e) == [Action.RECORD, Action.QUARANTINE_GPU]


def test_app_crash_then_recovery_resolves_with_no_action_beyond_record():
    recs = [sample(0), procs(0, 7), xid(10, 31, pid=7), procs(12)]
    recs += [sample(t, util=0, mem=0) for t in range(15, 1000, 10)]
    e = run(recs)
    assert classes(e) == [Classification.APP_FAULT, Classification.APP_FAULT]
    assert [a.state for a in e.alerts] == ["open", "resolved"]
    assert actions(e) == [Action.RECORD]


@pytest.mark.parametrize("overrides", [
    {},
    # the most eager policy the loader accepts
    {"pinned_seconds": 10, "suspect_occurrences": 2, "suspect_distinct_pids": 2, "burst_seconds": 0,
     "wedged_requires_workload_failure": False, "hardware_xids": [48, 119, 79]},
])
def test_a_single_app_class_xid_never_leads_to_a_node_action(overrides):
    policy = load_policy(overrides)
    for code in (13, 31, 43, 45, 68, 109, 94, 63):
        # one Xid, and one pinned sample right after it: nothing sustained
        e = run_with(policy, [inventory(), sample(0), procs(0), xid(10, code), sample(11, util=100, mem=0),
                              procs(11), sample(12, util=100, mem=0)])
        assert not NODE_LEVEL & set(actions(e)), (code, overrides, actions(e))
        assert Action.RESET_GPU not in actions(e)


def test_wedged_can_require_a_workload_failure():
    policy = load_policy({"wedged_requires_workload_failure": True})
    e = run_with(policy, wedge(pinned_until=400))
    assert Classification.GPU_WEDGED not in classes(e)
    e = run_with(policy, wedge(pinned_until=400) + [workload(250), sample(255, util=100, mem=0)])
    assert Classification.GPU_WEDGED in classes(e)
    assert any(t.kind == "workload" for t in e.alerts[-1].evidence.timeline)


def test_a_later_workload_failure_is_evidence_on_the_incident():
    e = run(wedge(pinned_until=400) + [workload(350), sample(351, util=100, mem=0)])
    e2 = run(wedge(pinned_until=400) + [workload(350), result(360, Action.RESET_GPU, "refused", detail="busy")])
    assert "workload" in [t.kind for t in e2.alerts[-1].evidence.timeline]
    assert e.alerts[-1].classification == Classification.GPU_WEDGED


def test_failed_reset_climbs_to_reboot_then_replace():
    e = run(wedge() + [result(310, Action.RESET_GPU, "failed", detail="GPU busy"),
                                result(900, Action.REBOOT_NODE, "failed")])
    assert actions(e) == [Action.RECORD, Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU,
                          Action.REBOOT_NODE, Action.REPLACE_NODE]
    assert [c.step for c in e.commands] == [0, 1, 2, 3, 4, 5]
    assert len({c.incident_id for c in e.commands}) == 1


def test_gpu_xids_persisting_after_a_reboot_mean_replace():
    # the node came back from its reboot (a healthy sample), then the GPU faults again
    e = run(wedge() + [result(310, Action.RESET_GPU, "failed"), result(600, Action.REBOOT_NODE, "succeeded"),
                       sample(650, util=0, mem=0), xid(700, 119, pid=None)])
    assert actions(e)[-2:] == [Action.REBOOT_NODE, Action.REPLACE_NODE]


def test_an_application_xid_after_the_reboot_is_not_a_reason_to_replace():
    e = run(wedge() + [result(310, Action.RESET_GPU, "failed"), result(600, Action.REBOOT_NODE, "succeeded"),
                                sample(610), procs(610, 77), xid(700, 13, pid=77)])
    assert Action.REPLACE_NODE not in actions(e)


def test_wedged_again_after_a_successful_reset_climbs_to_reboot():
    again = [r for t in range(400, 500, 5) for r in (sample(t, util=100, mem=0), procs(t))]
    e = run(wedge() + [result(310, Action.RESET_GPU, "succeeded"), sample(320, util=0, mem=0)] + again)
    assert actions(e)[-1] == Action.REBOOT_NODE


@pytest.mark.parametrize("outcome", ["refused", "expired"])
def test_refused_or_expired_commands_are_reported(outcome):
    e = run(wedge() + [result(310, Action.RESET_GPU, outcome, detail="window closed")])
    last = e.alerts[-1]
    assert last.state == "updated" and f"RESET_GPU {outcome}" in last.summary and "window closed" in last.summary
    assert Action.REBOOT_NODE not in actions(e)


def test_successful_reset_then_healthy_resolves_with_closing_steps():
    recs = wedge() + [result(310, Action.RESET_GPU, "succeeded")]
    recs += [r for t in range(320, 1000, 10) for r in (sample(t, util=0, mem=0), procs(t))]
    e = run(recs)
    assert e.alerts[-1].state == "resolved"
    assert actions(e)[-1] == Action.UNCORDON_NODE
    # a new fault later is a new incident
    e.process(xid(2000, 13, pid=5))
    assert e.alerts[-1].incident_id != e.alerts[0].incident_id


@pytest.mark.parametrize("code, plan", [
    (79, [Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE]),
    (48, [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]),
    (95, [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]),
    (119, [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]),
    (64, [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]),
    (140, [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]),
])
def test_hardware_xids_follow_nvidia_resolution(code, plan):
    e = run([sample(0), xid(10, code, pid=None)])
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT]
    assert e.alerts[0].severity.value == "critical"
    assert actions(e) == plan


@pytest.mark.parametrize("code", [94, 63])
def test_contained_or_informational_xids_are_app_class(code):
    e = run([sample(0), xid(10, code)])
    assert classes(e) == [Classification.APP_FAULT] and actions(e) == [Action.RECORD]


def test_contact_support_xids_quarantine_and_recommend_a_case():
    from xidstream.schemas.xid_catalog import XID_CATALOG

    code = min(x for x, i in XID_CATALOG.items() if i.resolution == "CONTACT_SUPPORT" and not Policy().is_app_class(x))
    e = run([sample(0), xid(10, code, pid=None)])
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT]
    assert actions(e) == [Action.QUARANTINE_GPU]
    assert any("support case" in s for s in e.alerts[0].recommended_steps)


@pytest.mark.parametrize("code", [173, 999, 2**31 - 1])
def test_a_code_outside_the_catalog_is_kept_with_its_raw_text(code):
    """A code NVIDIA's catalog does not name (a newer driver's, or one no source publishes) is never
    dropped: a GPU-level verdict that names it as unknown, a quarantine and a support case (no
    node-level action: nothing says the node is at fault), and the driver's line in the evidence."""
    from xidstream.schemas.xid_catalog import XID_CATALOG

    assert code not in XID_CATALOG
    e = run([sample(0), xid(10, code, pid=None, message="a message no catalog explains")])
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT] and actions(e) == [Action.QUARANTINE_GPU]
    (a,) = e.alerts
    assert f"Xid {code} (unknown" in a.summary
    assert [(t.data["xid"], t.data["raw"]) for t in a.evidence.timeline if t.kind == "xid"] == [
        (code, f"NVRM: Xid (PCI:{PCI}): {code}, pid=None, a message no catalog explains")]
    assert a.evidence.xid_counts == {str(code): 1}


@pytest.mark.parametrize("message, plan_end", [
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", Action.RESET_GPU),
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", Action.REBOOT_NODE),
])
def test_xid_154_follows_the_recovery_action_it_names(message, plan_end):
    e = run([sample(0), xid(10, 154, pid=None, message=message)])
    assert actions(e)[-1] == plan_end


def test_xid_154_to_none_is_only_evidence():
    assert run([sample(0), xid(10, 154, pid=None, message="changed from 0x4 (x) to 0x0 (None)")]).alerts == []


def test_nvlink5_xids_go_through_the_decode_table():
    fatal = "RLW_SRC_TRACK Nonfatal XC1 i0 Link 03 (0x040868e2 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)"
    benign = "RLW_SRC_TRACK Nonfatal XC1 i0 Link 03 (0x040868e2 0x00000002 0x00000000 0x00000000 0x00000000 0x00000000)"
    assert actions(run([sample(0), xid(10, 145, pid=None, message=fatal)]))[-1] == Action.RESET_GPU
    assert run([sample(0), xid(10, 145, pid=None, message=benign)]).alerts == []


@pytest.mark.parametrize("status, last", [("lost", Action.REBOOT_NODE), ("reset_required", Action.RESET_GPU)])
def test_nvml_status_is_hardware_evidence(status, last):
    e = run([sample(0), sample(5, status=status)])
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT] and actions(e)[-1] == last
    assert status in e.alerts[0].summary or "reset" in e.alerts[0].summary


def test_an_unresolved_gpu_reset_is_downgraded_to_a_node_reboot():
    e = run([xid(10, 119, gpu=None, pid=None)])
    assert [c.action for c in e.commands] == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE]
    assert e.commands[0].gpu_uuid is None


def test_replay_gives_the_same_verdicts_and_command_ids():
    a = run(wedge() + [result(310, Action.RESET_GPU, "failed")])
    b = run(wedge() + [result(310, Action.RESET_GPU, "failed")])
    assert [c.command_id for c in a.commands] == [c.command_id for c in b.commands]
    assert [x.alert_id for x in a.alerts] == [x.alert_id for x in b.alerts]


def test_a_long_wedge_is_one_wedged_alert():
    # the same verdict again on every pinned sample: the open incident already says it
    e = run(wedge(pinned_until=900))
    wedged = [a for a in e.alerts if a.classification == Classification.GPU_WEDGED]
    assert len(wedged) == 1


def test_alert_cooldown_keeps_repeats_from_spamming():
    # One workload faulting again and again: every occurrence is a new RECORD that `_raise` passes
    # on (not the same verdict again), so only the cooldown holds its "updated" alerts back.
    repeats = [sample(0), procs(0, 4242), xid(10, 13), xid(100, 13), xid(200, 13)]
    e = run(repeats)
    assert actions(e) == [Action.RECORD] * 3  # every occurrence is still recorded
    assert [a.state for a in e.alerts] == ["open"]  # 90 s and 190 s after it: within 300 s
    # the same repeats without a cooldown: one alert each
    assert [a.state for a in run_with(load_policy({"alert_cooldown_s": 0}), repeats).alerts] == \
        ["open", "updated", "updated"]
    # once the cooldown has passed since the last alert, the next repeat is said again
    e = run(repeats + [xid(310, 13)])
    assert [(a.state, a.ts) for a in e.alerts] == [("open", at(10)), ("updated", at(310))]
    assert "4 occurrences of this workload" in e.alerts[-1].summary


def _storm(n_nodes, hit):
    e = Engine()
    recs = []
    for i in range(n_nodes):
        g = f"GPU-{i:08d}-0000-0000-0000-000000000000"
        recs.append(inventory(0, gpu=g, node=f"node-{i}"))
        recs.append(sample(0, gpu=g, node=f"node-{i}"))
    for i in range(hit):
        recs.append(xid(100 + 10 * i, 119, pid=None, gpu=f"GPU-{i:08d}-0000-0000-0000-000000000000", node=f"node-{i}"))
    return e.run(recs)


def test_fleet_storm_holds_further_node_actions_for_approval():
    e = _storm(10, 5)
    storms = [a for a in e.alerts if a.classification == Classification.FLEET_STORM]
    assert len(storms) == 1 and storms[0].gpu_uuid is None
    by_node = {}
    for c in e.commands:
        if c.action in NODE_LEVEL:
            by_node.setdefault(c.node, []).append(c.requires_approval)
    assert by_node["node-0"] == [False] * 2 and by_node["node-1"] == [False] * 2
    assert set(by_node) == {f"node-{i}" for i in range(5)}
    assert all(all(v) for n, v in by_node.items() if n not in ("node-0", "node-1"))
    # A node faulting later while the breaker is tripped is held, every step of its plan; after an
    # operator's reset it is not. (Not only the last command: a breaker that held only some steps,
    # or none after a reset, must show.)
    node9 = xid(300, 119, pid=None, gpu="GPU-00000009-0000-0000-0000-000000000000", node="node-9")
    held = _storm(10, 5)
    held.process(node9)
    assert _node_commands(held, "node-9") == [(Action.CORDON_NODE, True), (Action.DRAIN_NODE, True),
                                              (Action.RESET_GPU, True)]
    e.reset_breaker()
    e.process(node9)
    assert _node_commands(e, "node-9") == [(Action.CORDON_NODE, False), (Action.DRAIN_NODE, False),
                                           (Action.RESET_GPU, False)]


def _node_commands(e, node):
    return [(c.action, c.requires_approval) for c in e.commands if c.node == node]


def test_fleet_breaker_needs_at_least_three_nodes():
    e = _storm(4, 2)  # 2 of 4 is over 20%, but under the 3-node floor
    assert Classification.FLEET_STORM not in classes(e)


def test_policy_file_errors_are_clear(tmp_path):
    from xidstream.schemas import ConfigError

    with pytest.raises(ConfigError, match="unknown setting\\(s\\) pinned_secs"):
        load_policy({"pinned_secs": 1})
    with pytest.raises(ConfigError, match="suspect_occurrences must be an integer"):
        load_policy({"suspect_occurrences": "many"})
    f = tmp_path / "p.yaml"
    f.write_text("pinned_seconds: 120\nhardware_xids: [119]\n")
    p = load_policy(f)
    assert p.pinned_seconds == 120 and p.hardware_xids == frozenset({119})
    assert p == Policy(pinned_seconds=120, hardware_xids=frozenset({119}))
    f.write_text("hardware_xids: [109]\n")
    with pytest.raises(ConfigError, match=f"{f}: hardware_xids lists application-class Xid 109"):
        load_policy(f)


def _topic_major(records, order):
    """Each topic's records in their own order, the topics one after another (parallel reads at
    their worst)."""
    by = {}
    for r in sorted(records, key=lambda r: r.ts):
        by.setdefault(type(r).__name__, []).append(r)
    out = []
    for name in order:
        out += by.pop(name, [])
    for rest in by.values():
        out += rest
    return out


@pytest.mark.parametrize("order", [
    ["GpuSample", "GpuProcesses", "XidEvent"],
    ["XidEvent", "GpuSample", "GpuProcesses"],
    ["GpuProcesses", "XidEvent", "GpuSample"],
    ["GpuSample", "XidEvent", "GpuProcesses"],
])
def test_verdicts_do_not_depend_on_how_topics_interleave(order):
    e = Engine()
    for r in _topic_major(wedge(), order):
        e.process(r)
    assert classes(e)[-1] == Classification.GPU_WEDGED
    # Read in the worst order, a quarantine may come first (the evidence then looked like that);
    # the plan is the same and nothing beyond the reset rung is commanded.
    assert actions(e)[-3:] == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]
    assert set(actions(e)) <= {Action.RECORD, Action.QUARANTINE_GPU, Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU}


@pytest.mark.parametrize("result_first", [True, False])
def test_resolution_does_not_depend_on_when_the_result_is_read(result_first):
    healthy = [r for t in range(320, 1000, 10) for r in (sample(t, util=0, mem=0), procs(t))]
    ok = result(310, Action.RESET_GPU, "succeeded")
    e = feed(Engine(), wedge())
    feed(e, ([ok] + healthy) if result_first else (healthy + [ok]))
    assert e.alerts[-1].state == "resolved" and actions(e)[-1] == Action.UNCORDON_NODE


# -- found by mutation testing (make mutate streams/classify.py) ----------------------------------
# Exact texts, fields and state of the result, closing-step, hardware-signal and workload paths:
# mutants that changed them survived tests that checked only which actions came.


def _wedged():
    return feed(Engine(), sorted(wedge(), key=lambda r: r.ts))


def _answer(cmd, outcome, t, detail="", **change):
    r = RemediationResult(ts=at(t), node=cmd.node, gpu_uuid=cmd.gpu_uuid, pci_bus_id=cmd.pci_bus_id,
                          command_id=cmd.command_id, incident_id=cmd.incident_id, action=cmd.action,
                          outcome=outcome, detail=detail)
    return r.model_copy(update=change) if change else r


def _newest(e, action):
    return next(c for c in reversed(e.commands) if c.action == action)


def _last_note(e):
    return e.states[GPU].incident.timeline[-1]


def test_an_answer_to_no_command_is_noted_exactly_and_not_acted_on():
    e = _wedged()
    reset = _newest(e, Action.RESET_GPU)
    inc = reset.incident_id
    before = (len(e.alerts), len(e.commands))
    e.process(_answer(reset, "failed", 310, detail="d", command_id="nope"))
    assert (len(e.alerts), len(e.commands)) == before
    assert _last_note(e) == {
        "ts": at(310).timestamp(), "kind": "remediation",
        "summary": f"RESET_GPU failed (command nope of incident {inc}) answers no command of this incident: "
                   "recorded, not acted on",
        "data": {"command_id": "nope", "incident_id": inc, "action": "RESET_GPU", "outcome": "failed", "detail": "d",
                 "matched": False}}


@pytest.mark.parametrize("detail, said", [("GPU busy", "GPU busy"), ("", "no detail")])
def test_a_failed_reset_is_noted_and_climbs_to_a_reboot_saying_why(detail, said):
    e = _wedged()
    reset = _newest(e, Action.RESET_GPU)
    e.process(_answer(reset, "failed", 310, detail=detail))
    tl = e.states[GPU].incident.timeline
    assert tl[-2] == {"ts": at(310).timestamp(), "kind": "remediation",
                      "summary": "RESET_GPU failed" + (f": {detail}" if detail else ""),
                      "data": {"command_id": reset.command_id, "action": "RESET_GPU", "outcome": "failed",
                               "detail": detail, "matched": True}}
    assert tl[-1] == {"ts": at(310).timestamp(), "kind": "remediation",
                      "summary": f"next rung: REBOOT_NODE: GPU reset failed ({said})", "data": {}}
    assert e.states[GPU].incident.plan[-1] == "REBOOT_NODE"
    assert e.alerts[-1].summary == f"GPU reset failed ({said}): REBOOT_NODE" and e.alerts[-1].state == "updated"
    assert e.commands[-1].action == Action.REBOOT_NODE and e.commands[-1].reason == f"GPU reset failed ({said})"
    reboot = e.commands[-1]
    e.process(_answer(reboot, "failed", 900, detail=detail))
    assert e.alerts[-1].summary == f"node reboot failed ({said}): REPLACE_NODE"
    assert e.commands[-1].action == Action.REPLACE_NODE and e.commands[-1].reason == f"node reboot failed ({said})"


@pytest.mark.parametrize("detail, tail", [("window closed", ": window closed"), ("", "")])
def test_a_refused_step_asks_for_an_operator_in_so_many_words(detail, tail):
    e = _wedged()
    n = len(e.alerts)
    e.process(_answer(_newest(e, Action.RESET_GPU), "refused", 310, detail=detail))
    assert len(e.alerts) == n + 1
    assert e.alerts[-1].summary == f"RESET_GPU refused on {NODE}{tail}; operator attention needed"


@pytest.mark.parametrize("answered_at, unpinned", [(298, True), (310, True), (297, False)])
def test_a_successful_reset_ends_the_pin_only_when_no_pinned_sample_came_after_it(answered_at, unpinned):
    e = _wedged()  # pinned samples 123 s to 298 s
    e.process(_answer(_newest(e, Action.RESET_GPU), "succeeded", answered_at))
    assert (e.states[GPU].pinned_since is None) is unpinned
    assert e.states[GPU].pinned_since in (None, at(123).timestamp())


def test_a_successful_reboot_leaves_the_pin_it_may_not_have_ended():
    e = _wedged()
    e.process(_answer(_newest(e, Action.RESET_GPU), "failed", 305))
    e.process(_answer(_newest(e, Action.REBOOT_NODE), "succeeded", 310))
    assert e.states[GPU].pinned_since == at(123).timestamp()


@pytest.mark.parametrize("newest_sample, healthy_since", [(400, 310), (310, 310), (305, None)])
def test_healthy_time_counts_from_the_repair_when_a_sample_already_read_is_after_it(newest_sample, healthy_since):
    e = _wedged()
    for t in range(305, newest_sample + 1, 5):
        e.process(sample(t, util=0, mem=0))
    assert e.states[GPU].healthy_since == at(305).timestamp()
    e.process(_answer(_newest(e, Action.RESET_GPU), "succeeded", 310))
    want = None if healthy_since is None else at(healthy_since).timestamp()
    assert e.states[GPU].healthy_since == want


def _closing_state(commands):
    return GpuState(key=GPU, node=NODE, gpu_uuid=GPU, pci_bus_id=PCI, gpu_index=1, clock=at(1000).timestamp(),
                    sampled=True, closing={"inc-a": {"classification": "GPU_WEDGED", "alerts": 3, "commands": commands}})


def _closing_answer(cid, action, outcome, detail="", node=NODE, incident="inc-a"):
    return RemediationResult(ts=at(1010), node=node, gpu_uuid=GPU, pci_bus_id=PCI, command_id=cid,
                             incident_id=incident, action=action, outcome=outcome, detail=detail)


@pytest.mark.parametrize("action, left", [
    (Action.UNCORDON_NODE, "the node may still be cordoned: check it (kubectl get node) and uncordon it by hand if so"),
    (Action.RELEASE_GPU, "the GPU may still be quarantined: check its taint and remove it by hand if so"),
])
def test_a_failed_closing_step_raises_one_alert_on_its_closed_incident(action, left):
    state = _closing_state({"c1": action.value, "c2": "RELEASE_GPU"})
    state, out, _ = step(state, GPU, _closing_answer("c1", action, "failed", "apiserver: 403"), Policy())
    assert [k for k, _ in out] == ["alert"]
    a = out[0][1]
    what = f"{action.value} failed after the incident resolved (apiserver: 403)"
    assert a.summary == f"GPU 1 on {NODE}: {what}; {left}"
    assert (a.incident_id, a.state, a.classification) == ("inc-a", "updated", Classification.GPU_WEDGED)
    assert a.recommended_steps == [STEP_TEXT[action]]
    assert [(e.kind, e.summary, e.data) for e in a.evidence.timeline] == [
        ("remediation", what, {"command_id": "c1", "action": action.value, "outcome": "failed",
                               "detail": "apiserver: 403", "matched": True})]
    # the alert is the closed incident's fourth: its count is kept for the step still unanswered
    assert state.closing == {"inc-a": {"classification": "GPU_WEDGED", "alerts": 4, "commands": {"c2": "RELEASE_GPU"}}}
    assert a.alert_id == hid("inc-a", "alert", 4)


def test_a_closing_step_without_detail_and_the_last_one_answered_forget_the_incident():
    state = _closing_state({"c1": "RELEASE_GPU"})
    state, out, _ = step(state, GPU, _closing_answer("c1", Action.RELEASE_GPU, "expired"), Policy())
    assert out[0][1].summary == (f"GPU 1 on {NODE}: RELEASE_GPU expired after the incident resolved; the GPU may still be "
                                 "quarantined: check its taint and remove it by hand if so")
    assert state.closing is None
    two = GpuState(key=GPU, node=NODE, gpu_uuid=GPU, gpu_index=1, closing={
        "inc-a": {"classification": "GPU_WEDGED", "alerts": 3, "commands": {"c1": "RELEASE_GPU"}},
        "inc-b": {"classification": "GPU_SUSPECT", "alerts": 2, "commands": {"c9": "RELEASE_GPU"}}})
    two, out, _ = step(two, GPU, _closing_answer("c1", Action.RELEASE_GPU, "succeeded"), Policy())
    assert out == [] and two.closing == {"inc-b": {"classification": "GPU_SUSPECT", "alerts": 2,
                                                  "commands": {"c9": "RELEASE_GPU"}}}


def test_a_closing_answer_is_its_own_incidents_even_while_another_is_open():
    e, _ = _wedged(), None
    for a in (Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU):
        e.process(_answer(_newest(e, a), "succeeded", 305))
    for t in range(310, 700, 10):
        e.process(sample(t)), e.process(procs(t, 4242))
    uncordon = _newest(e, Action.UNCORDON_NODE)
    e.process(xid(705, 13, pid=4242))  # a new incident opens: the uncordon's answer is still the old one's
    assert e.states[GPU].incident is not None and e.states[GPU].incident.id != uncordon.incident_id
    e.process(_answer(uncordon, "failed", 710, detail="apiserver: 403"))
    assert e.alerts[-1].incident_id == uncordon.incident_id
    assert e.alerts[-1].summary.startswith(f"GPU 1 on {NODE}: UNCORDON_NODE failed after the incident resolved")


def _hw(t, **change):
    return sample(t).model_copy(update={"event_id": f"s{t}", **change})


def test_a_recovery_action_and_a_remap_failure_name_their_sample_as_evidence():
    e = feed(Engine(), [inventory(0), sample(0), _hw(10, recovery_action=1)])
    assert {tuple(c.evidence_ids) for c in e.commands} == {("s10",)}
    e = feed(Engine(), [inventory(0), sample(0), _hw(10, remapped_rows_failure=True)])
    assert {tuple(c.evidence_ids) for c in e.commands} == {("s10",)}


def test_a_remap_failure_still_reported_keeps_the_gpu_unhealthy():
    e = feed(Engine(), [inventory(0), sample(0), _hw(10, remapped_rows_failure=True)]
             + [_hw(t, remapped_rows_failure=True) for t in range(20, 1000, 10)])
    state = e.states[GPU]
    assert state.remap_failure is True and state.healthy_since is None and state.incident is not None


def test_a_pending_row_remap_is_noted_on_the_open_incident_only():
    e = feed(Engine(), [inventory(0), sample(0), _hw(5, remapped_rows_pending=True)])  # no incident: nothing to note
    assert e.states[GPU].incident is None and e.states[GPU].pending_notes == []
    e = feed(Engine(), [inventory(0), sample(0), _hw(10, remapped_rows_failure=True)])
    n = len(e.states[GPU].incident.timeline)
    e.process(_hw(20, remapped_rows_failure=False))  # a change of the failure, no remap pending: no note
    assert len(e.states[GPU].incident.timeline) == n
    e.process(_hw(30, remapped_rows_pending=True))
    assert _last_note(e) == {"ts": at(30).timestamp(), "kind": "sample",
                             "summary": "a row remap is pending: it takes effect at the next GPU reset",
                             "data": {"remapped_rows_pending": True}}


def test_a_workload_failure_is_evidence_without_its_time_and_id():
    e = feed(Engine(), [inventory(0), sample(0), procs(0, 4242), xid(10, 13)])
    e.process(workload(12))
    assert _last_note(e) == {"ts": at(12).timestamp(), "kind": "workload", "summary": "pod ml/vllm-1 failed (Error, exit 1)",
                             "data": {"pod_uid": "uid-vllm-1", "pod": "vllm-1", "namespace": "ml", "reason": "Error",
                                      "exit_code": 1, "event": "failed"}}


def test_the_minute_phase_is_a_second_of_the_minute_fixed_by_the_key():
    phases = [_phase(f"GPU-{i}") for i in range(2000)]
    assert all(type(p) is int and 0 <= p < 60 for p in phases) and set(phases) == set(range(60))
    assert _phase("GPU-x") == _phase("GPU-x")


def test_wedged_again_after_a_reset_says_so_in_the_climb():
    again = [r for t in range(400, 500, 5) for r in (sample(t, util=100, mem=0), procs(t))]
    e = run(wedge() + [result(310, Action.RESET_GPU, "succeeded"), sample(320, util=0, mem=0)] + again)
    assert e.alerts[-1].summary == "GPU 1 wedged again after the GPU reset: REBOOT_NODE"
    assert e.commands[-1].reason == "GPU 1 wedged again after the GPU reset"


def test_a_workload_failure_read_last_decides_the_wedge_that_needs_it():
    # wedged_requires_workload_failure: the pinned samples were all read; the failure completes the
    # evidence at its own record, not at a later sample
    e = feed(Engine(load_policy({"wedged_requires_workload_failure": True})), sorted(wedge(pinned_until=400),
                                                                                     key=lambda r: r.ts))
    assert classes(e) == [Classification.APP_FAULT]
    e.process(workload(250))
    assert classes(e) == [Classification.APP_FAULT, Classification.GPU_WEDGED]


def _app_fault_healed(until):
    # an application fault at 10 s, healthy samples every 10 s from 0 s: healthy since the Xid
    return feed(Engine(), [inventory(0)] + sorted(
        [r for t in range(0, until + 1, 10) for r in (sample(t), procs(t, 4242))] + [xid(10, 13)], key=lambda r: r.ts))


def test_an_incident_resolves_when_healthy_for_exactly_resolve_after_s():
    e = _app_fault_healed(300)  # 290 s after the Xid: not yet
    assert e.alerts[-1].state == "open" and e.states[GPU].resolved_incidents == 0
    e.process(procs(310, 4242))
    e.process(sample(310))  # 300 s
    assert e.alerts[-1].state == "resolved"
    assert e.alerts[-1].summary == f"GPU 1 on {NODE} healthy again: incident resolved"
    assert e.alerts[-1].evidence.timeline[-1].kind == "note"
    assert e.alerts[-1].evidence.timeline[-1].summary == "healthy for 300 s with no new Xid: resolved"
    assert e.states[GPU].resolved_incidents == 1
    e.process(xid(400, 13))
    for t in range(410, 711, 10):
        e.process(procs(t, 4242)), e.process(sample(t))
    assert e.alerts[-1].state == "resolved" and e.states[GPU].resolved_incidents == 2


def test_a_closing_step_says_the_incident_resolved():
    healthy = [r for t in range(320, 1000, 10) for r in (sample(t, util=0, mem=0), procs(t))]
    e = feed(feed(Engine(), wedge()), [result(310, Action.RESET_GPU, "succeeded")] + healthy)
    uncordon = _newest(e, Action.UNCORDON_NODE)
    assert uncordon.reason == "incident resolved" and uncordon.evidence_ids == []


def test_a_row_that_still_has_nvmls_fault_does_not_resolve_on_a_repairs_answer():
    # NVML reports a recovery action or a failed remap: not resolved, whatever the healthy time
    # (a row read back with both a healthy run and the fault; the repair's answer resolves directly)
    for fault in ({"recovery_action": 1}, {"remap_failure": True}):
        e = _wedged()
        state = e.states[GPU]
        reset = _newest(e, Action.RESET_GPU)
        state.pinned_since, state.healthy_since, state.last_sample_ts = None, at(100).timestamp(), at(1000).timestamp()
        for k, v in fault.items():
            setattr(state, k, v)
        e.process(_answer(reset, "succeeded", 50))
        assert e.states[GPU].incident is not None and e.alerts[-1].state != "resolved"


def test_the_notes_kept_before_an_incident_are_the_newest_five():
    e = feed(Engine(), [inventory(0), sample(0)] + [workload(t, pod=f"p{t}") for t in range(1, 8)])
    assert [n["data"]["pod"] for n in e.states[GPU].pending_notes] == ["p3", "p4", "p5", "p6", "p7"]


@pytest.mark.parametrize("kind", ["gpu_identity", "gsp_rate_limit", "sxid"])
def test_a_kernel_line_that_is_no_gpu_fault_opens_nothing(kind):
    e = feed(Engine(), [inventory(0), sample(0), xid(10, 79, kind=kind)])
    assert e.alerts == [] and e.states[GPU].occurrences == [] and e.states[GPU].xids == []


def test_only_a_gsp_rate_limit_line_is_noted_on_the_open_incident():
    e = feed(Engine(), [inventory(0), sample(0), procs(0, 4242), xid(10, 13)])
    n = len(e.states[GPU].incident.timeline)
    e.process(xid(11, 79, kind="gpu_identity"))
    e.process(xid(12, 79, kind="sxid"))
    assert len(e.states[GPU].incident.timeline) == n
    e.process(xid(13, 79, kind="gsp_rate_limit", message="rate limited"))
    assert _last_note(e) == {"ts": at(13).timestamp(), "kind": "note",
                             "summary": "driver rate-limits GSP RPC error prints: later Xid counts are undercounted",
                             "data": {"raw": f"NVRM: Xid (PCI:{PCI}): 79, pid=4242, rate limited"}}


def test_the_outputs_of_a_resolution_a_climb_and_a_refusal_are_alerts_by_name():
    # step's outputs are ("alert" | "command" | "workload_fault", record): the kind is the contract
    e = _app_fault_healed(300)
    e.process(procs(310, 4242))
    state, out, _ = step(e.states[GPU], GPU, sample(310), Policy())
    assert [k for k, _ in out] == ["alert"] and out[0][1].state == "resolved"
    e = _wedged()
    reset = _newest(e, Action.RESET_GPU)
    _, out, _ = step(e.states[GPU], GPU, _answer(reset, "failed", 310), Policy())
    assert [k for k, _ in out] == ["alert", "command"]
    e = _wedged()
    _, out, _ = step(e.states[GPU], GPU, _answer(_newest(e, Action.RESET_GPU), "refused", 310), Policy())
    assert [k for k, _ in out] == ["alert"]


def test_a_death_that_moves_the_clock_past_the_name_wait_can_make_a_suspect():
    # two faults no process list named (lists as new as them show no compute app) wait for a death
    # to name them; a workload event 180 s later moves the GPU's clock past NAME_WAIT_S: they are
    # two workloads now, a suspect decided at that record
    recs = [inventory(0), sample(0), procs(0), xid(10, 13, pid=7), xid(20, 13, pid=8), procs(20), sample(20)]
    e = feed(Engine(), recs)
    assert classes(e) == [Classification.APP_FAULT]
    e.process(workload(200, pod="other"))
    assert classes(e)[-1] == Classification.GPU_SUSPECT


def test_a_backfilled_xid_is_a_timeline_line_only():
    e = feed(Engine(), [inventory(0), sample(0), procs(0, 4242), xid(10, 13)])
    n_alerts = len(e.alerts)
    old = xid(5, 79, message="").model_copy(update={"backfilled": True})
    e.process(old)
    assert len(e.alerts) == n_alerts and len(e.states[GPU].occurrences) == 1
    assert _last_note(e) == {"ts": at(5).timestamp(), "kind": "xid", "summary": f"(backfilled) {old.raw}",
                             "data": {"xid": 79, "xid_kind": "xid", "raw": old.raw, "backfilled": True}}
    e.process(xid(6, 31, message="page fault").model_copy(update={"backfilled": True}))
    assert _last_note(e)["summary"] == "(backfilled) page fault"


def test_a_recovery_failure_is_an_xid_fact_of_no_code_and_no_application():
    e = feed(Engine(), [inventory(0), sample(0)])
    line = xid(10, 79, pid=None, kind="recovery_failure", message="Failed to enter state")
    e.process(line)
    assert e.states[GPU].xids == [{"ts": at(10).timestamp(), "xid": None, "kind": "recovery_failure", "pid": None,
                                   "app": False, "id": line.event_id}]


def test_a_recovery_failure_waits_on_the_timeline_exactly():
    # no incident yet: the line waits among the pending notes for the next one, with its kernel line
    e = feed(Engine(), [inventory(0), sample(0)])
    line = xid(10, 79, pid=None, kind="recovery_failure", message="Failed to enter state")
    e.process(line)
    assert e.states[GPU].pending_notes[-1] == {"ts": at(10).timestamp(), "kind": "xid",
                                               "summary": "driver failed to recover the GPU: Failed to enter state",
                                               "data": {"raw": line.raw}}
    assert e.alerts == [] and e.states[GPU].last_xid_ts == at(10).timestamp()


def test_a_gpu_fallen_off_the_bus_is_a_hardware_fault_with_the_reboot_plan_exactly():
    # the parser's "GPU has fallen off the bus" line (kind fallen_off_bus, no Xid code of its own):
    # recorded as an Xid 79 fact of no application, and the node rebooted (NVIDIA Xid catalog, 79)
    e = feed(Engine(), [inventory(0), sample(0), procs(0, 4242)])
    line = xid(10, 79, pid=None, kind="fallen_off_bus", message="GPU has fallen off the bus.")
    e.process(line)
    assert e.states[GPU].xids == [{"ts": at(10).timestamp(), "xid": 79, "kind": "fallen_off_bus", "pid": None,
                                   "app": False, "id": line.event_id}]
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT]
    alert = e.alerts[0]
    assert alert.summary == f"GPU on {NODE} ({PCI}) has fallen off the bus" and alert.severity.value == "critical"
    assert actions(e) == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE]
    assert all(c.evidence_ids == [line.event_id] for c in e.commands)
    assert {"ts": at(10).timestamp(), "kind": "xid", "summary": "GPU has fallen off the bus",
            "data": {"raw": line.raw}} in e.states[GPU].incident.timeline
