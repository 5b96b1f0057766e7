"""The fleet agent's two texts and its workload memory, exactly (issue 28: mutants of
`_workload_fault` and `_storm_alert` survived every test, which checked only that an alert came).
Boundary tests at each bound: the suspect window, the sweep every quarter window, the 64 GPUs a
pod keeps, the 8 GPUs an alert names."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

import pytest

from schemas import Classification, Severity
from streams.fleet import FLEET_NODE, WORKLOAD_GPUS_KEPT, FleetState, fleet_step
from streams.handoff import Handoff, HandoffError
from streams.policy import Policy
from tests.streams.test_fleet_trust import T0, _cmd

P = Policy()
W = P.suspect_window_s  # 600 s


def fault(state, pod, gpu, ts, node="n1", incident="inc-1", now=None):
    msg = {"kind": "workload_fault", "pod_uid": pod, "gpu_uuid": gpu, "node": node, "incident_id": incident, "ts": ts}
    return fleet_step(state, msg, P, now=now)


def test_a_pod_faulting_a_second_gpu_gets_one_exact_alert():
    s = FleetState()
    s, out = fault(s, "pod-1", "GPU-a", 1000.0)
    assert out == [] and s.workload_gpus == {"pod-1": {"GPU-a": [1000.0, "n1", "inc-1"]}} and s.dirty_pods == {"pod-1"}
    s, out = fault(s, "pod-1", "GPU-b", 1010.0, node="n2", incident="inc-2")
    ((kind, a),) = out
    summary = ("the fault follows the workload: pod pod-1 hit application-class Xids on 2 GPUs within 10 min "
               "(GPU-a on n1, GPU-b on n2); look at the workload, not the GPUs")
    when = datetime.fromtimestamp(1010.0, tz=timezone.utc)
    assert kind == "alert"
    assert (a.ts, a.node, a.incident_id, a.gpu_uuid, a.pci_bus_id) == (when, "n2", "inc-2", "GPU-b", None)
    assert a.alert_id == hashlib.sha256(b"follows:inc-2:pod-1:2").hexdigest()[:24]
    assert (a.classification, a.severity, a.state, a.summary) == (Classification.APP_FAULT, Severity.info, "updated", summary)
    assert (a.evidence.node, a.evidence.gpu_uuid, a.evidence.pod_uids) == ("n2", "GPU-b", ["pod-1"])
    (entry,) = a.evidence.timeline
    assert (entry.ts, entry.kind, entry.summary) == (when, "workload", summary)
    assert entry.data == {"pod_uid": "pod-1", "gpus": ["GPU-a", "GPU-b"], "gpu_count": 2}
    assert len(a.recommended_steps) == 2 and "check its code" in a.recommended_steps[1]
    assert "PID, GPU UUID, pod UID" in a.recommended_steps[0]


def test_no_alert_for_the_same_gpu_again_without_an_incident_or_without_a_pod():
    s = FleetState()
    s, _ = fault(s, "pod-1", "GPU-a", 1000.0)
    s, out = fault(s, "pod-1", "GPU-a", 1001.0)
    assert out == [] and s.workload_gpus["pod-1"]["GPU-a"][0] == 1001.0  # refreshed, not new
    s, out = fault(s, "pod-1", "GPU-b", 1002.0, incident=None)
    assert out == [] and set(s.workload_gpus["pod-1"]) == {"GPU-a", "GPU-b"}  # remembered, nothing to update
    for pod, gpu in ((None, "GPU-c"), ("pod-1", None), ("", "GPU-c"), ("pod-1", "")):
        before = {p: dict(g) for p, g in s.workload_gpus.items()}
        s, out = fault(s, pod, gpu, 1003.0)
        assert out == [] and s.workload_gpus == before


def test_a_fault_without_a_node_is_the_fleets():
    s = FleetState()
    s, _ = fault(s, "pod-1", "GPU-a", 1000.0, node=None)
    s, ((_, a),) = fault(s, "pod-1", "GPU-b", 1001.0, node=None)
    assert a.node == FLEET_NODE and a.evidence.node == FLEET_NODE
    assert "(GPU-a on None, GPU-b on None)" in a.summary


@pytest.mark.parametrize("gap, same_workload", [(W, True), (W + 1, False)])
def test_the_suspect_window_bounds_what_a_pod_remembers(gap, same_workload):
    s = FleetState()
    s, _ = fault(s, "pod-1", "GPU-a", 1000.0)
    s, out = fault(s, "pod-1", "GPU-b", 1000.0 + gap)
    assert bool(out) is same_workload
    assert set(s.workload_gpus["pod-1"]) == ({"GPU-a", "GPU-b"} if same_workload else {"GPU-b"})


def test_pods_that_left_the_window_are_swept_every_quarter_window():
    s = FleetState()
    s, _ = fault(s, "old", "GPU-a", 1000.0)
    assert s.workload_swept_at == 1000.0
    s, _ = fault(s, "other", "GPU-b", 1000.0 + W + 1)  # first fault past the window: a sweep is due
    assert "old" not in s.workload_gpus and "old" in s.dirty_pods and s.workload_swept_at == 1000.0 + W + 1
    s.dirty_pods = set()
    t = s.workload_swept_at
    s, _ = fault(s, "p2", "GPU-c", t + W / 4 - 1)  # before the next quarter: no sweep
    assert s.workload_swept_at == t
    s, _ = fault(s, "p3", "GPU-d", t + W / 4)  # at it: a sweep
    assert s.workload_swept_at == t + W / 4
    s, _ = fault(s, "p4", "GPU-e", t - 5)  # a time before the last sweep (a reordered record): sweep again
    assert s.workload_swept_at == t - 5


def test_a_sweep_keeps_the_part_of_a_pod_still_in_the_window():
    s = FleetState()
    s, _ = fault(s, "pod-1", "GPU-a", 1000.0)
    s, _ = fault(s, "pod-1", "GPU-b", 1300.0)
    s.workload_swept_at = 1000.0
    s.dirty_pods = set()
    s, _ = fault(s, "pod-2", "GPU-z", 1000.0 + W + 1)
    assert s.workload_gpus["pod-1"] == {"GPU-b": [1300.0, "n1", "inc-1"]} and "pod-1" in s.dirty_pods


def test_a_pod_keeps_its_newest_64_gpus_and_an_alert_names_8():
    s = FleetState()
    for i in range(WORKLOAD_GPUS_KEPT + 6):
        s, out = fault(s, "big", f"GPU-{i:03d}", 1000.0 + (WORKLOAD_GPUS_KEPT + 6 - i) * 0.5)  # oldest last
    kept = s.workload_gpus["big"]
    assert len(kept) == WORKLOAD_GPUS_KEPT == 64
    assert set(kept) == {f"GPU-{i:03d}" for i in range(WORKLOAD_GPUS_KEPT)}  # by time, not by arrival
    s2 = FleetState()
    for i in range(10):
        s2, out = fault(s2, "p", f"GPU-{i}", 1000.0 + i)
    (_, a), = out
    assert "(GPU-0 on n1, GPU-1 on n1, GPU-2 on n1, GPU-3 on n1, GPU-4 on n1, GPU-5 on n1, GPU-6 on n1, GPU-7 on n1" \
           " and 2 more)" in a.summary
    assert " on 10 GPUs " in a.summary and a.evidence.timeline[0].data["gpus"] == [f"GPU-{i}" for i in range(8)]
    assert a.evidence.timeline[0].data["gpu_count"] == 10
    s3 = FleetState()
    for i in range(WORKLOAD_GPUS_KEPT):
        s3, out = fault(s3, "p", f"GPU-{i:03d}", 1000.0 + i)
    assert f" on {WORKLOAD_GPUS_KEPT}+ GPUs " in out[0][1].summary  # at the cap: "64+"
    s4 = FleetState()
    for i in range(WORKLOAD_GPUS_KEPT - 1):
        s4, out = fault(s4, "p", f"GPU-{i:03d}", 1000.0 + i)
    assert f" on {WORKLOAD_GPUS_KEPT - 1} GPUs " in out[0][1].summary


def test_the_storm_alert_says_what_tripped_and_what_to_do():
    state = FleetState(known_nodes={f"n{i}": T0.timestamp() for i in range(10)})
    out = []
    cmds = [_cmd(f"n{i}", "CORDON_NODE", T0) for i in range(3)]
    for c in cmds:
        state, o = fleet_step(state, {"kind": "command", "command": c}, P)
        out += o
    (a,) = [o for k, o in out if k == "alert"]
    inc = hashlib.sha256(f"fleet-storm:1:{T0.timestamp()}".encode()).hexdigest()[:24]
    summary = ("FLEET STORM: actions that take capacity away on 3 of 10 known nodes within 10 min (limit 20%, at "
               "least 3); every further such command needs approval until `xidstream breaker reset`")
    assert (a.ts, a.node, a.alert_id, a.incident_id, a.gpu_uuid, a.pci_bus_id) == (T0, FLEET_NODE, f"{inc}-storm", inc,
                                                                                   None, None)
    assert (a.classification, a.severity, a.summary) == (Classification.FLEET_STORM, Severity.critical, summary)
    assert a.evidence.node == FLEET_NODE
    (entry,) = a.evidence.timeline
    assert (entry.ts, entry.kind, entry.summary) == (T0, "note", summary)
    assert entry.data == {"nodes": ["n0", "n1", "n2"], "known_nodes": 10, "trigger_command": cmds[2].command_id}
    assert [s.split(" ")[0] for s in a.recommended_steps] == ["Look", "Approve"]
    assert "`xidstream breaker reset`" in a.recommended_steps[1]


@pytest.mark.parametrize("body, why", [(b"{not json", "^fleet-topic message is not JSON: "),
                                       (b"[1, 2]", "^fleet-topic message is not a JSON object$"),
                                       (b'"reset"', "^fleet-topic message is not a JSON object$")])
def test_a_fleet_message_that_is_not_a_json_object_is_refused_with_its_reason(body, why):
    with pytest.raises(HandoffError, match=why):
        Handoff(None).open(body, 0.0)
    sealed = Handoff(b"k" * 32)
    with pytest.raises(HandoffError, match=why):
        sealed.open(sealed.seal(body), 0.0)
