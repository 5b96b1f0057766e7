"""The fleet agent's two texts and its workload memory, exactly (mutants of
`_workload_fault` and `_storm_alert` survived every test, which checked only that an alert came).
Boundary tests at each bound: the suspect window, the sweep every quarter window, the 64 GPUs a
pod keeps, the 8 GPUs an alert names."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest

from xidstream.schemas import Classification, Severity
from xidstream.streams.fleet import FLEET_NODE, WORKLOAD_GPUS_KEPT, FleetState, fleet_step
from xidstream.streams.handoff import Handoff, HandoffError
from xidstream.streams.policy import Policy
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


def test_a_fault_at_the_instant_of_the_last_sweep_does_not_sweep_again():
    # one sweep per quarter window: a fault stamped when the last sweep ran has nothing new to
    # sweep for (what it left was kept under the window of then; a restart with a shorter
    # suspect_window_s drops it at the next quarter, not at every fault of that second)
    s = FleetState()
    s, _ = fault(s, "old", "GPU-a", 1000.0)
    s.workload_swept_at = 1000.0 + W + 1
    s.dirty_pods = set()
    s, _ = fault(s, "other", "GPU-b", 1000.0 + W + 1)
    assert "old" in s.workload_gpus and s.dirty_pods == {"other"}
    s, _ = fault(s, "other", "GPU-c", 1000.0 + W + 1 + W / 4)
    assert "old" not in s.workload_gpus and "old" in s.dirty_pods


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
    assert entry.data == {"nodes": ["n0", "n1", "n2"], "known_nodes": 10, "trigger_command": cmds[2].command_id,
                          "members": [{"node": c.node, "incident_id": c.incident_id} for c in cmds]}
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
        sealed.open(sealed.seal(body, 0.0), 0.0)


def _cmds(state, nodes, policy, ts=T0, action="CORDON_NODE", now=None):
    out = []
    for n in nodes:
        state, o = fleet_step(state, {"kind": "command", "command": _cmd(n, action, ts)}, policy, now=now)
        out += o
    return state, out


def _known(n):
    return FleetState(known_nodes={f"n{i}": T0.timestamp() for i in range(n)})


def test_the_breaker_trips_only_above_its_fraction():
    p = Policy(fleet_min_nodes=1)  # 20% of 10 known nodes: 2 nodes are at the limit, 3 above it
    s, out = _cmds(_known(10), ["n0", "n1"], p)
    assert not s.tripped and [c.requires_approval for _, c in out] == [False, False]
    s, out = _cmds(s, ["n2"], p)
    assert s.tripped and s.trips == 1
    p = Policy(fleet_min_nodes=1, fleet_fraction=0.6)
    s, out = _cmds(_known(1), ["n0"], p)  # 1 of 1 known is above 60%
    assert s.tripped


def test_held_commands_are_counted_and_say_why():
    s, out = _cmds(_known(10), ["n0", "n1", "n2", "n3"], Policy())
    held = [c for k, c in out if k == "command" and c.requires_approval]
    assert len(held) == 2 and s.held == 2
    assert held[0].reason == "test [held: fleet circuit breaker tripped]"
    s, out = _cmds(s, ["ghost-1", "ghost-2"], Policy())
    assert s.held == 4
    assert [c.reason for _, c in out] == ["test [held: node ghost-1 has published no GPU inventory]",
                                          "test [held: node ghost-2 has published no GPU inventory]"]


def test_a_second_storm_after_a_reset_is_the_second_trip():
    s, tripped = _cmds(_known(10), ["n0", "n1", "n2"], Policy())
    [storm] = [a for kind, a in tripped if kind == "alert"]
    s, out = fleet_step(s, {"kind": "reset", "approval_id": "a1", "by": "ops", "ts": 1_800_000_000.0}, Policy())
    # the storm's incident resolves with the reset (its last alert said "open" for good before)
    [(kind, done)] = out
    assert kind == "alert" and done.state == "resolved" and done.incident_id == storm.incident_id
    assert done.classification.value == "FLEET_STORM" and done.ts.timestamp() == 1_800_000_000.0
    assert done.summary == ("fleet circuit breaker reset by ops (approval a1): node-level commands are no longer held")
    assert s.tripped is False and s.tripped_at is None and s.starts == []
    s, out = fleet_step(s, {"kind": "reset", "approval_id": "a2"}, Policy())
    assert out == []  # not tripped: nothing to resolve
    s, _ = _cmds(s, ["n3", "n4", "n5"], Policy())
    assert s.trips == 2 and s.tripped is True
    for i in range(70):
        s, _ = fleet_step(s, {"kind": "reset", "approval_id": f"r{i}"}, Policy())
    assert len(s.resets_used) == 64 and s.resets_used[-1] == "r69"


def test_a_start_exactly_one_window_old_still_counts():
    p = Policy(fleet_min_nodes=1)
    s, _ = _cmds(_known(10), ["n0", "n1"], p)
    later = T0 + timedelta(seconds=p.fleet_window_s)
    s, _ = _cmds(s, ["n2"], p, ts=later)
    assert s.tripped  # n0 and n1, 600 s before, are inside the window: 3 nodes


def test_only_capacity_taking_commands_pass_the_breaker_as_commands():
    s, out = _cmds(_known(10), ["n0"], Policy(), action="RECORD")
    assert [k for k, _ in out] == ["command"] and s.starts == []


def test_membership_keeps_the_newest_inventory_and_bounds_a_lying_clock():
    s = FleetState()
    s, _ = fleet_step(s, {"kind": "inventory", "node": "n1", "ts": 2000.0}, P)
    s, _ = fleet_step(s, {"kind": "inventory", "node": "n1", "ts": 1000.0}, P)  # an older one read late
    assert s.known_nodes == {"n1": 2000.0}
    s, _ = fleet_step(s, {"kind": "inventory", "node": "n2", "ts": 9e9}, P, now=5000.0)  # stamped far ahead
    s, _ = fleet_step(s, {"kind": "node_seen", "node": "n3", "ts": 9e9}, P, now=5000.0)
    assert (s.known_nodes["n2"], s.known_nodes["n3"]) == (5000.0, 5000.0)


def test_a_workload_fault_is_timed_by_its_receipt_when_its_stamp_lies_and_at_zero_without_one():
    s = FleetState()
    s, _ = fleet_step(s, {"kind": "workload_fault", "pod_uid": "p", "gpu_uuid": "g1", "ts": 9e9}, P, now=5000.0)
    s, _ = fleet_step(s, {"kind": "workload_fault", "pod_uid": "q", "gpu_uuid": "g2"}, P)
    assert s.workload_gpus["p"]["g1"][0] == 5000.0 and s.workload_gpus["q"]["g2"][0] == 0.0


def test_an_alert_states_its_window_in_minutes():
    p = Policy(suspect_window_s=3600.0, fleet_window_s=3600.0)
    s = FleetState()
    s, _ = fleet_step(s, {"kind": "workload_fault", "pod_uid": "p", "gpu_uuid": "g1", "node": "n", "incident_id": "i",
                          "ts": 10.0}, p)
    s, ((_, a),) = fleet_step(s, {"kind": "workload_fault", "pod_uid": "p", "gpu_uuid": "g2", "node": "n",
                                  "incident_id": "i", "ts": 11.0}, p)
    assert " within 60 min " in a.summary
    s, out = _cmds(_known(10), ["n0", "n1", "n2"], p)
    (storm,) = [o for k, o in out if k == "alert"]
    assert " within 60 min " in storm.summary


def test_gpus_faulted_at_the_same_moment_are_kept_by_name_past_the_cap():
    s = FleetState()
    for i in range(WORKLOAD_GPUS_KEPT + 1):  # one too many, all at once: the first name goes
        s, _ = fault(s, "p", f"GPU-{i:03d}", 1000.0, node=f"n{WORKLOAD_GPUS_KEPT - i:03d}")
    assert "GPU-000" not in s.workload_gpus["p"] and "GPU-064" in s.workload_gpus["p"]


def test_the_workload_alerts_steps_exactly():
    s = FleetState()
    s, _ = fault(s, "p", "g1", 1.0)
    s, ((_, a),) = fault(s, "p", "g2", 2.0)
    assert a.recommended_steps == [
        "Record the fault with PID, GPU UUID, pod UID and the raw kernel line; let the workload restart itself.",
        "The same pod faulted several GPUs: check its code, inputs and CUDA/driver versions before suspecting the hardware."]


# --- the hand-off, exactly -----------------------------------------------------------------------

@pytest.fixture()
def approver(tmp_path):
    from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys

    priv, pub, _ = generate_keys(tmp_path / "ops")
    sk, _, _ = generate_keys(tmp_path / "signing")
    return SigningKey.load(priv), VerifyKeys.load([pub], purpose="approvals"), SigningKey.load(sk)


def _approval(key, *, ts=T0, ttl=300.0, command_id="breaker-reset"):
    import uuid

    from xidstream.schemas import to_dict
    from xidstream.schemas.models import Approval

    a = key.sign(Approval(ts=ts, node="fleet", approval_id=uuid.uuid4().hex, command_id=command_id, approved_by="ops",
                          expires_at=ts + timedelta(seconds=ttl)))
    return a, {"kind": "reset", "ts": ts.timestamp(), "by": "ops", "approval": to_dict(a)}


def test_the_seal_is_hmac_sha256_keyed_by_the_signing_keys_fleet_hand_off_secret(approver):
    import hmac as _hmac

    _, trusted, signing = approver
    h = Handoff.for_processor(signing, trusted)
    secret = signing.derive(b"fleet hand-off")
    body = b'{"kind":"node_seen"}'
    signed = b"1764579600123:" + body  # sealed at 2025-12-01T09:00:00.123Z, in ms
    assert h.seal(body, 1764579600.123) == (b"xs2:" + _hmac.new(secret, signed, hashlib.sha256).hexdigest().encode()
                                            + b":" + signed)
    assert h.open_sealed(h.seal(body, 1764579600.123), 1764579600.5) == ({"kind": "node_seen"}, 1764579600.123)
    assert Handoff.for_processor(None, trusted).key is None
    assert secret.hex() not in repr(h) and repr(secret) not in repr(h)  # a log line of it leaks nothing


@pytest.mark.parametrize("value, why", [
    (b"", "^empty fleet-topic message$"),
    (None, "^empty fleet-topic message$"),
])
def test_an_empty_message_is_refused(value, why):
    for h in (Handoff(None), Handoff(b"k" * 32)):
        with pytest.raises(HandoffError, match=why):
            h.open(value, 0.0)


def test_every_seal_refusal_says_exactly_why():
    keyed, other = Handoff(b"k" * 32), Handoff(b"o" * 32)
    body = b'{"kind":"node_seen","node":"n","ts":1}'
    with pytest.raises(HandoffError, match="^a sealed message, but this processor has no signing key to check it with$"):
        Handoff(None).open(keyed.seal(body, 0.0), 0.0)
    with pytest.raises(HandoffError, match="^unsealed message on a topic only this processor's agents write$"):
        keyed.unseal(body)
    broken = keyed.seal(body)
    broken = broken[:4 + 64] + b";" + broken[4 + 64 + 1:]  # the tag and a MAC, but no separator
    with pytest.raises(HandoffError, match="^unsealed message on a topic only this processor's agents write$"):
        keyed.unseal(broken)
    with pytest.raises(HandoffError, match="^message sealed with another key or altered: not from this processor's agents$"):
        keyed.unseal(other.seal(body))
    assert keyed.unseal(None) is None and Handoff(None).unseal(body) == body
    assert keyed.open(keyed.seal(body, 0.0), 0.0) == {"kind": "node_seen", "node": "n", "ts": 1}


def test_every_reset_refusal_says_exactly_why(approver):
    key, trusted, signing = approver
    now = T0.timestamp()
    with pytest.raises(HandoffError, match=r"^breaker reset refused: the processor trusts no approver key "
                                           r"\(--approver-key\), so no reset can be authenticated$"):
        Handoff(b"k" * 32).open(b'{"kind":"reset"}', now)
    h = Handoff(b"k" * 32, trusted)
    with pytest.raises(HandoffError, match=r"^breaker reset refused: it carries no signed approval "
                                           r"\(xidstream breaker reset --key APPROVER.key\)$"):
        h.open(b'{"kind":"reset"}', now)
    import orjson

    _, msg = _approval(key, ts=T0 - timedelta(seconds=300))
    with pytest.raises(HandoffError, match=r"^breaker reset refused: its approval expired at 2026-12-01T09:00:00\+00:00$"):
        h.open(orjson.dumps(msg), now)  # expiring exactly now is expired
    _, msg = _approval(key, ttl=86400.0 + 1)
    with pytest.raises(HandoffError, match="^breaker reset refused: its approval lives longer than a day$"):
        h.open(orjson.dumps(msg), now)
    a, msg = _approval(key, ttl=86400.0)  # exactly a day: accepted
    assert h.open(orjson.dumps(msg), now) == {"kind": "reset", "ts": now, "by": "ops", "approval_id": a.approval_id,
                                              "key_id": a.key_id}
    a, msg = _approval(key, ts=T0 + timedelta(seconds=300))  # at the skew bound: accepted
    assert h.open(orjson.dumps(msg), now)["approval_id"] == a.approval_id
    _, msg = _approval(key, ts=T0 + timedelta(seconds=301))
    with pytest.raises(HandoffError, match="^breaker reset refused: its approval is stamped ahead of the processor's clock$"):
        h.open(orjson.dumps(msg), now)
    assert Handoff(None).open(b'{"kind":"reset","by":"x"}', now) == {"kind": "reset", "by": "x"}  # a demo without keys


def test_a_state_kept_before_starts_named_their_incident_still_trips_and_names_what_it_knows():
    # A changelog written by the previous release holds [ts, node] starts: they still count
    # towards the storm, and its alert names the incidents it knows (the new start's).
    old = [[T0.timestamp(), "n0"], [T0.timestamp(), "n1"]]
    state = FleetState(known_nodes={f"n{i}": T0.timestamp() for i in range(10)}, starts=old)
    c = _cmd("n2", "CORDON_NODE", T0)
    state, out = fleet_step(state, {"kind": "command", "command": c}, P)
    (a,) = [o for k, o in out if k == "alert"]
    assert a.evidence.timeline[0].data["nodes"] == ["n0", "n1", "n2"]
    assert a.evidence.timeline[0].data["members"] == [{"node": "n2", "incident_id": c.incident_id}]
    assert state.starts[-1] == [T0.timestamp(), "n2", c.incident_id]


def _tripped():
    state = FleetState(known_nodes={f"n{i}": T0.timestamp() for i in range(10)})
    for i in range(3):
        state, _ = fleet_step(state, {"kind": "command", "command": _cmd(f"n{i}", "CORDON_NODE", T0)}, P)
    assert state.tripped
    return state


def test_a_reset_resolves_the_storm_with_who_and_which_approval():
    inc = hashlib.sha256(f"fleet-storm:1:{T0.timestamp()}".encode()).hexdigest()[:24]
    state, out = fleet_step(_tripped(), {"kind": "reset", "ts": T0.timestamp() + 60, "by": "alice",
                                         "approval_id": "ap-7"}, P, now=T0.timestamp() + 999)
    (kind, a), = out
    summary = ("fleet circuit breaker reset by alice (approval ap-7): node-level commands are no longer held")
    assert kind == "alert" and (a.ts, a.node, a.alert_id, a.incident_id) == (
        T0 + timedelta(seconds=60), FLEET_NODE, f"{inc}-reset-ap-7", inc)  # the reset's own time, not now
    assert (a.gpu_uuid, a.pci_bus_id, a.classification, a.severity, a.state, a.summary) == (
        None, None, Classification.FLEET_STORM, Severity.critical, "resolved", summary)
    (entry,) = a.evidence.timeline
    assert (entry.ts, entry.kind, entry.summary, entry.data) == (a.ts, "note", summary, {"approval_id": "ap-7"})
    assert a.evidence.node == FLEET_NODE


def test_a_local_reset_without_a_time_is_stamped_now_or_when_the_breaker_tripped():
    inc = hashlib.sha256(f"fleet-storm:1:{T0.timestamp()}".encode()).hexdigest()[:24]
    _, out = fleet_step(_tripped(), {"kind": "reset"}, P, now=T0.timestamp() + 30)
    a = out[0][1]
    assert (a.ts, a.alert_id) == (T0 + timedelta(seconds=30), f"{inc}-reset-local")
    assert a.summary == "fleet circuit breaker reset (approval -): node-level commands are no longer held"
    assert a.evidence.timeline[0].data == {"approval_id": None}
    _, out = fleet_step(_tripped(), {"kind": "reset", "ts": "soon"}, P)  # no time given, no now: when it tripped
    assert out[0][1].ts == T0
    # a long approval id is cut so the alert id stays within its bound
    _, out = fleet_step(_tripped(), {"kind": "reset", "approval_id": "x" * 200}, P, now=T0.timestamp())
    assert out[0][1].alert_id == f"{inc}-reset-{'x' * 200}"[:128] and len(out[0][1].alert_id) == 128
    # a breaker that tripped at the epoch itself (a replay of records stamped 0) keeps that time
    _, out = fleet_step(FleetState(tripped=True, tripped_at=0.0, trips=1), {"kind": "reset"}, P)
    assert out[0][1].ts == datetime.fromtimestamp(0, timezone.utc)
    # nothing tripped: a reset raises no alert
    assert fleet_step(FleetState(), {"kind": "reset"}, P)[1] == []


def test_each_node_is_named_by_its_newest_start_the_first_of_equal_times():
    from xidstream.streams.fleet import _newest_incidents

    starts = [[10.0, "n1", "i-a"], [5.0, "n1", "i-b"], [10.0, "n1", "i-c"], [3.0, "n2", "i-d"], [7.0, "n2", "i-e"],
              [20.0, "n3"]]  # a start kept before incident ids: names nothing
    assert _newest_incidents(starts) == {"n1": "i-a", "n2": "i-e"}


# -- a fleet message read twice ------------------------------------------------------------------
def _inventory(state, node, ts):
    return fleet_step(state, {"kind": "inventory", "node": node, "ts": ts}, P)[0]


def test_a_command_read_twice_is_released_and_counted_once():
    """The three-broker rolling restart: after the group coordinator moved, the consumer read the
    fleet topic again from its last commit and the agent put a command on gpu.remediation twice,
    and counted its node toward the breaker twice. The second reading passes nothing on."""
    s = FleetState()
    for i in range(10):
        s = _inventory(s, f"n{i}", T0.timestamp())
    cordon = _cmd("n1", "CORDON_NODE", T0)
    record = _cmd("n1", "RECORD", T0)
    s, out = fleet_step(s, {"kind": "command", "command": cordon}, P)
    assert out == [("command", cordon)] and len(s.starts) == 1
    s, out = fleet_step(s, {"kind": "command", "command": record}, P)
    assert out == [("command", record)]
    for c in (cordon, record):
        s, out = fleet_step(s, {"kind": "command", "command": c}, P)
        assert out == [] and len(s.starts) == 1
    # not in the main row: rows of their own (streams.app), read back by a restarted worker
    assert "released" not in s.to_dict() and "dirty_released" not in s.to_dict()
    assert FleetState.from_dict(s.to_dict()).released == {}
    assert s.dirty_released == {cordon.command_id, record.command_id}


def test_the_commands_remembered_are_the_newest_release_kept():
    from xidstream.streams.fleet import RELEASED_KEPT

    s = FleetState()
    first = _cmd("n1", "RECORD", T0)
    s, _ = fleet_step(s, {"kind": "command", "command": first}, P)
    ids = [first.command_id]
    for i in range(RELEASED_KEPT - 1):
        c = first.model_copy(update={"command_id": f"c-{i}"})
        s, _ = fleet_step(s, {"kind": "command", "command": c}, P)
        ids.append(c.command_id)
    assert list(s.released) == ids  # RELEASED_KEPT of them, oldest first: the first still known
    s, out = fleet_step(s, {"kind": "command", "command": first}, P)
    assert out == []
    s, _ = fleet_step(s, {"kind": "command", "command": first.model_copy(update={"command_id": "c-new"})}, P)
    assert len(s.released) == RELEASED_KEPT and first.command_id not in s.released
    s, out = fleet_step(s, {"kind": "command", "command": first}, P)
    assert out == [("command", first)]  # forgotten: passed on again


# -- the hand-off's bound on a copy --------------------------------------------------------------
def test_a_sealed_message_is_good_for_an_hour_and_never_for_a_seal_stamped_far_ahead():
    from xidstream.streams.handoff import MAX_AGE_S, MAX_FUTURE_S

    assert (MAX_AGE_S, MAX_FUTURE_S) == (3600.0, 300.0)
    h = Handoff(b"k" * 32)
    body = b'{"kind":"node_seen","node":"n","ts":1}'
    sealed_at = 1_800_000_000.0
    sealed = h.seal(body, sealed_at)
    for now in (sealed_at - 300, sealed_at, sealed_at + 3600):  # the bounds themselves are inside
        assert h.open_sealed(sealed, now) == ({"kind": "node_seen", "node": "n", "ts": 1}, sealed_at)
    with pytest.raises(HandoffError, match="^sealed 3601 s ago, more than the 3600 s a hand-off is good for: a copy "
                                           "written again, or a fleet agent that far behind$"):
        h.open(sealed, sealed_at + 3601)
    with pytest.raises(HandoffError, match="more than the 3600 s a hand-off is good for"):
        h.open(sealed, sealed_at + 3600.001)
    with pytest.raises(HandoffError, match="^sealed 301 s ahead of this worker's clock, more than 300 s: the clocks "
                                           "of the processor's workers disagree$"):
        h.open(sealed, sealed_at - 301)
    with pytest.raises(HandoffError, match="ahead of this worker's clock"):
        h.open(sealed, sealed_at - 300.001)


def test_a_message_of_the_format_without_a_seal_time_is_refused_on_the_fleet_topic_only():
    import hmac as _hmac

    key = b"k" * 32
    body = b'{"kind":"node_seen","node":"n","ts":1}'
    old = b"xs1:" + _hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b":" + body
    with pytest.raises(HandoffError, match=r"^sealed without a seal time \(hand-off format xs1, a worker of an earlier "
                                           r"release\): a copy of it cannot be told from it, so it is not folded$"):
        Handoff(key).open(old, 0.0)
    assert Handoff(key).unseal(old) == body  # a re-keyed result: its GPU's row takes each answer once
    with pytest.raises(HandoffError, match="another key or altered"):
        Handoff(b"o" * 32).unseal(old)
    # a seal time the MAC covers but that is none (only a bug could make one)
    signed = b"12x:" + body
    bad = b"xs2:" + _hmac.new(key, signed, hashlib.sha256).hexdigest().encode() + b":" + signed
    with pytest.raises(HandoffError, match="^sealed message without a seal time$"):
        Handoff(key).unseal(bad)


def _sealed_cmd(state, node, sealed_at, cid=None):
    c = _cmd(node, "RECORD", T0)
    if cid is not None:
        c = c.model_copy(update={"command_id": cid})
    return fleet_step(state, {"kind": "command", "command": c}, P, sealed_at=sealed_at), c


def test_released_commands_are_forgotten_once_a_copy_would_be_too_old_to_open():
    from xidstream.streams.fleet import forget_released

    s = FleetState()
    for i, t in enumerate((100.0, 200.0, 150.0, 300.0)):  # received a little out of the order sealed
        (s, _), _ = _sealed_cmd(s, "n1", t, cid=f"c{i}")
    s.dirty_released = set()
    forget_released(s, 200.0)  # sealed before 200: c0; c2 (150) waits behind c1 (200)
    assert s.released == {"c1": 200.0, "c2": 150.0, "c3": 300.0} and s.dirty_released == {"c0"}
    forget_released(s, 301.0)
    assert s.released == {} and s.dirty_released == {"c0", "c1", "c2", "c3"}
    unsealed = FleetState(released={"u": None, "c": 5.0})
    forget_released(unsealed, 1e12)  # not sealed (no signing key): kept by count only
    assert unsealed.released == {"u": None, "c": 5.0}


def test_a_sealed_command_older_than_the_oldest_forgotten_by_count_is_refused(monkeypatch):
    import xidstream.streams.fleet as fleet

    monkeypatch.setattr(fleet, "RELEASED_KEPT", 3)
    s = FleetState()
    for i, t in enumerate((10.0, 30.0, 20.0, 40.0)):
        (s, out), _ = _sealed_cmd(s, "n1", t, cid=f"c{i}")
        assert len(out) == 1
    assert list(s.released) == ["c1", "c2", "c3"] and s.released_floor == 10.0
    (s, out), _ = _sealed_cmd(s, "n1", 50.0, cid="c4")  # c1 (30) falls off: the floor is 30 now
    assert list(s.released) == ["c2", "c3", "c4"] and s.released_floor == 30.0
    (s, out), _ = _sealed_cmd(s, "n1", 60.0, cid="c5")  # c2 (20) falls off: the floor stays 30
    assert s.released_floor == 30.0
    with pytest.raises(fleet.ReplayError, match=r"^command c1 sealed at 30.000, not after 30.000, the newest seal time "
                                                r"of the commands this fleet agent no longer remembers \(3 released "
                                                r"since\): it cannot be told from a copy of one released then, so it "
                                                r"is not released$"):
        _sealed_cmd(s, "n1", 30.0, cid="c1")
    (s, out), _ = _sealed_cmd(s, "n1", 30.001, cid="late")  # sealed after the floor: released
    assert len(out) == 1
    (s, out), _ = _sealed_cmd(s, "n1", 10.0, cid="c4")  # still remembered: nothing, and no refusal
    assert out == []
    (s, out), _ = _sealed_cmd(s, "n1", None, cid="c0")  # not sealed (the pure Engine): count only
    assert len(out) == 1
    assert "released_floor" in s.to_dict() and FleetState.from_dict(s.to_dict()).released_floor == 50.0  # c3 (40), c4 (50) fell off since
