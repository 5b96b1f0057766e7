"""The pure decision path (streams.classify + streams.fleet through streams.engine.Engine)."""

from __future__ import annotations

import pytest

from schemas import Action, Classification
from streams.engine import Engine
from streams.policy import Policy, load_policy
from tests.streams.builders import GPU, at, feed, inventory, procs, result, run, sample, wedge, workload, xid


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
    from schemas.xid_catalog import XID_CATALOG

    code = min(x for x, i in XID_CATALOG.items() if i.resolution == "CONTACT_SUPPORT" and not Policy().is_app_class(x))
    e = run([sample(0), xid(10, code, pid=None)])
    assert classes(e) == [Classification.GPU_HARDWARE_FAULT]
    assert actions(e) == [Action.QUARANTINE_GPU]
    assert any("support case" in s for s in e.alerts[0].recommended_steps)


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
    from schemas import ConfigError

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
