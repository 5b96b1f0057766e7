"""`xidstream.streams.classify._on_xid` exactly: the Xid fact, the timeline line, the occurrence and the
fleet message an application fault leaves, the climb a hardware Xid makes after a reset or a
reboot that succeeded, and the boundaries of both. Each test kills mutants of `make mutate
streams/classify.py` that only the slow property tests (test_order_free, test_persisted_material,
test_flood) caught, or none did; these run in well under a second."""

from __future__ import annotations

import copy

import pytest

from xidstream.schemas import Action, Classification
from xidstream.streams.classify import step
from xidstream.streams.engine import Engine
from xidstream.streams.policy import Policy
from xidstream.streams.render import describe_xid
from tests.streams.builders import GPU, NODE, PCI, at, feed, inventory, procs, sample, xid

P = Policy()


def _running(*pids):
    """A GPU with a live process list naming each PID's pod (pod-<pid>)."""
    return feed(Engine(), [inventory(0), sample(0), procs(0, *pids)])


def _step(e, record):
    state, outputs, _ = step(copy.deepcopy(e.states[GPU]), GPU, record, e.policy)
    return state, outputs


def test_an_application_xid_leaves_its_fact_line_occurrence_and_fleet_message_exactly():
    e = _running(4242)
    line = xid(10, 13, pid=4242, message="Graphics Exception")
    state, outputs = _step(e, line)
    t = at(10).timestamp()
    assert state.xids[-1] == {"ts": t, "xid": 13, "kind": "xid", "pid": 4242, "app": True, "id": line.event_id}
    assert state.occurrences[-1] == {"ts": t, "last_ts": t, "pid": 4242, "wl": "pod:pod-4242", "codes": [13],
                                     "pod": "pod-4242", "id": line.event_id}
    assert state.incident is not None and state.incident.classification == Classification.APP_FAULT.value
    assert {"ts": t, "kind": "xid", "summary": f"{describe_xid(13)} pid=4242 name=python3",
            "data": {"xid": 13, "name": line.xid_name, "pid": 4242, "process_name": "python3", "pod_uid": "pod-4242",
                     "raw": line.raw, "sources": ["kmsg"], "workload_occurrences": 1}} in state.incident.timeline
    (fault,) = [m for kind, m in outputs if kind == "workload_fault"]
    assert fault == {"pod_uid": "pod-4242", "gpu_uuid": GPU, "node": NODE, "ts": t, "xid": 13,
                     "incident_id": state.incident.id}


def test_a_pid_no_process_list_names_is_its_own_workload_and_sends_no_fleet_message():
    e = _running(4242)
    state, outputs = _step(e, xid(10, 13, pid=999))
    assert state.occurrences[-1]["wl"] == "pid:999" and state.occurrences[-1]["pod"] is None
    assert [k for k, _ in outputs if k == "workload_fault"] == []


def test_lines_of_one_fault_within_the_burst_are_one_occurrence_at_exactly_the_burst():
    e = _running(4242)
    b = P.burst_seconds
    e.process(xid(10, 13, pid=4242))
    e.process(xid(10 + b, 31, pid=4242))  # at exactly burst_seconds: the same fault
    (occ,) = e.states[GPU].occurrences
    assert occ["codes"] == [13, 31] and occ["last_ts"] == at(10 + b).timestamp()
    e.process(xid(10 + b, 31, pid=4242))  # the same code again adds no code
    assert e.states[GPU].occurrences[0]["codes"] == [13, 31]
    e.process(xid(10 + 2 * b + 0.5, 13, pid=4242))  # past the burst from the last occurrence's start
    assert len(e.states[GPU].occurrences) == 2


def test_an_occurrence_of_one_workload_does_not_swallow_another_workloads_fault():
    e = _running(4242, 5151)
    e.process(xid(10, 13, pid=4242))
    e.process(xid(11, 13, pid=5151))
    assert [o["wl"] for o in e.states[GPU].occurrences] == ["pod:pod-4242", "pod:pod-5151"]


def test_a_line_without_a_pid_joins_the_fault_and_a_later_pid_names_it():
    e = _running(4242)
    e.process(xid(10, 13, pid=None))
    (occ,) = e.states[GPU].occurrences
    assert (occ["wl"], occ["pid"]) == (None, None)
    e.process(xid(11, 31, pid=4242))
    (occ,) = e.states[GPU].occurrences
    assert (occ["wl"], occ["pid"], occ["codes"]) == ("pod:pod-4242", 4242, [13, 31])


def test_a_hardware_xid_no_gpu_was_resolved_for_names_its_pci_bus():
    e = Engine()
    e.process(xid(10, 79, pid=None, gpu=None))
    (alert,) = e.alerts
    assert alert.classification == Classification.GPU_HARDWARE_FAULT
    assert f"({PCI}) on {NODE}" in alert.summary


def _actions(e):
    return [c.action for c in e.commands]


def test_a_hardware_xid_again_after_a_reset_that_succeeded_climbs_to_a_reboot_exactly():
    from tests.streams.builders import result, run

    e = run([inventory(0), sample(0), xid(10, 48, pid=None), result(20, Action.RESET_GPU, "succeeded"), sample(25),
             xid(30, 48, pid=None)])
    assert _actions(e) == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU, Action.REBOOT_NODE]
    assert e.commands[-1].reason == "Xid 48 again after the GPU reset"
    assert e.alerts[-1].summary == "Xid 48 again after the GPU reset: REBOOT_NODE"
    assert any(n["kind"] == "xid" and n["data"].get("xid") == 48 and n["ts"] == at(30).timestamp()
               for n in e.states[GPU].incident.timeline)  # the Xid is on the timeline
    # stamped at the very time the reset succeeded: not after it, no climb
    e = feed(Engine(), [inventory(0), sample(0), xid(10, 48, pid=None)])
    e.process(result(20, Action.RESET_GPU, "succeeded").to_result(e))
    e.process(xid(20, 48, pid=None))
    assert _actions(e) == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]


def test_a_hardware_xid_after_the_node_came_back_from_its_reboot_climbs_to_a_replacement_exactly():
    from tests.streams.builders import result

    e = feed(Engine(), [inventory(0), sample(0), xid(10, 79, pid=None)])
    e.process(result(20, Action.REBOOT_NODE, "succeeded").to_result(e))
    e.process(sample(25))  # the node came back
    e.process(xid(20, 79, pid=None))  # stamped at the reboot's own time: not after it
    assert _actions(e) == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE]
    e.process(xid(30, 79, pid=None))
    assert _actions(e)[-1] == Action.REPLACE_NODE
    assert e.commands[-1].reason == "Xid 79 on GPU 1 after the node was rebooted"
    assert e.alerts[-1].summary == "Xid 79 on GPU 1 after the node was rebooted: REPLACE_NODE"


def test_an_incident_opens_with_its_id_time_plan_and_remedy_exactly():
    from xidstream.streams.render import hid

    e = feed(Engine(), [inventory(0), sample(0), xid(10, 48, pid=None)])
    inc = e.states[GPU].incident
    t = at(10).timestamp()
    assert inc.id == hid(GPU, t, Classification.GPU_HARDWARE_FAULT.value) and inc.opened_at == t
    assert inc.plan == ["CORDON_NODE", "DRAIN_NODE", "RESET_GPU"] and inc.remedy == "reset" and inc.hardware
    assert inc.sample_stats is None  # only a wedge or phantom load carries the samples' statistics
    assert e.alerts[0].incident_id == inc.id


def test_the_same_hardware_fault_with_a_reboot_remedy_escalates_a_reset_incident_and_nothing_less_does():
    e = feed(Engine(), [inventory(0), sample(0), xid(10, 48, pid=None)])
    inc = e.states[GPU].incident
    noted = len(inc.timeline)
    e.process(xid(12, 48, pid=None))  # the same verdict again: the open incident already says it
    assert len(inc.timeline) == noted and len(e.alerts) == 1 and inc.remedy == "reset"
    e.process(xid(14, 79, pid=None))  # the same class, the next remedy: escalates
    assert inc.remedy == "reboot" and inc.plan == ["CORDON_NODE", "DRAIN_NODE", "RESET_GPU", "REBOOT_NODE"]
    assert inc.hardware and len(inc.timeline) == noted + 1
    assert e.commands[-1].action == Action.REBOOT_NODE and e.alerts[-1].state == "updated"


def test_an_application_fault_on_a_hardware_incident_keeps_it_hardware():
    e = feed(Engine(), [inventory(0), sample(0), procs(0, 4242), xid(10, 48, pid=None)])
    e.process(xid(20, 13, pid=4242))
    inc = e.states[GPU].incident
    assert inc.hardware is True and inc.classification == Classification.GPU_HARDWARE_FAULT.value


def test_a_fold_output_of_unknown_kind_is_refused_not_published_as_an_alert():
    import pytest

    from xidstream.streams.routing import fan_out

    state = feed(Engine(), [inventory(0)]).states[GPU]
    with pytest.raises(ValueError, match="unknown kind 'alerts'"):
        fan_out(state, sample(1), [("alerts", object())])


# -- _on_sample ----------------------------------------------------------------------------------
def test_a_sample_read_late_does_not_move_the_gpus_clock_back():
    e = feed(Engine(), [inventory(0), sample(20)])
    e.process(sample(10))
    assert e.states[GPU].last_sample_ts == at(20).timestamp()
    e.process(sample(30))
    assert e.states[GPU].last_sample_ts == at(30).timestamp()


def test_a_new_memory_total_is_kept():
    from tests.streams.builders import sample as base

    e = feed(Engine(), [inventory(0), sample(0)])
    s = base(5).model_copy(update={"memory_total_mib": 81559.0})
    e.process(s)
    assert e.states[GPU].memory_total_mib == 81559.0


def test_a_gpu_readable_again_after_nvml_was_unavailable_is_no_fault():
    e = feed(Engine(), [inventory(0), sample(0, status="unavailable")])
    assert e.states[GPU].status == "unavailable"
    e.process(sample(5))
    assert e.states[GPU].status == "ok" and e.alerts == [] and e.commands == []
    e.process(sample(6, status="reset_required"))
    e.process(sample(7, status="reset_required"))  # said once
    assert [a.classification for a in e.alerts] == [Classification.GPU_HARDWARE_FAULT]


@pytest.mark.parametrize("status, what, last", [
    ("lost", "GPU is lost (NVML_ERROR_GPU_IS_LOST)", Action.REBOOT_NODE),
    ("reset_required", "GPU requires a reset (NVML_ERROR_RESET_REQUIRED)", Action.RESET_GPU)])
def test_a_gpu_nvml_calls_lost_or_in_need_of_a_reset_is_a_hardware_fault_exactly(status, what, last):
    e = feed(Engine(), [inventory(0), sample(0)])
    s = sample(5, status=status).model_copy(update={"error": "nvmlDeviceGetUtilizationRates: GPU is lost"})
    e.process(s)
    state = e.states[GPU]
    assert state.status == status and state.healthy_since is None
    (alert,) = e.alerts
    assert alert.summary == f"GPU 1 on {NODE}: {what}" and alert.classification == Classification.GPU_HARDWARE_FAULT
    assert {"ts": at(5).timestamp(), "kind": "sample", "summary": what,
            "data": {"status": status, "error": "nvmlDeviceGetUtilizationRates: GPU is lost"}} in state.incident.timeline
    assert [c.action for c in e.commands][-1] == last and all(c.evidence_ids == [s.event_id] for c in e.commands)


def test_a_gpu_row_an_xid_made_takes_the_gpus_index_from_it():
    e = Engine()
    e.process(xid(10, 13, pid=None))
    assert e.states[GPU].gpu_index == 1 and e.states[GPU].pci_bus_id == PCI
