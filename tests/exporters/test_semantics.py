"""What a SIEM does with the exported events, beyond schema validity: which ones page, what a
status says, what a Remediation Activity is, which findings a storm groups, what an analyst can
pivot on, how severe a fault is, and single-valued ECS fields.

The OCSF captions and enums come from the OCSF 1.8.0 schema source itself (`ocsf-json-schema`,
offline), not from a table of ours, so a mapping that drifts from OCSF's meaning fails here."""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache

import pytest

from xidstream.exporters.ecs import to_ecs
from xidstream.exporters.ocsf import OCSF_VERSION, to_ocsf
from xidstream.schemas import Action, Alert, Classification, Evidence, EvidenceEntry, Outcome, RemediationCommand, \
    RemediationResult, Severity
from xidstream.schemas.models import Approval
from xidstream.schemas.signing import SigningKey


def _key() -> SigningKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return SigningKey(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
from xidstream.streams.fleet import FleetState, fleet_step
from xidstream.streams.policy import Policy
from tests.exporters.helpers import alerts, commands_and_results, ocsf_errors
from tests.exporters.test_ocsf import _meta
from tests.factories import NODE, T0, UUID1


@lru_cache(maxsize=None)
def _schema() -> dict:
    from ocsf_json_schema import get_ocsf_schema

    return get_ocsf_schema(version=OCSF_VERSION)


def _captions(class_name: str, attribute: str) -> dict[int, str]:
    enum = _schema()["classes"][class_name]["attributes"][attribute]["enum"]
    return {int(k): v["caption"] for k, v in enum.items()}


_CLASS = {2004: "detection_finding", 2005: "incident_finding", 7001: "remediation_activity"}


def _approval(**kw) -> Approval:
    base = dict(event_id="e-appr", ts=T0 + timedelta(minutes=2), node=NODE, approval_id="ap1", command_id="c1",
                approved_by="alice", reason="checked the rack", expires_at=T0 + timedelta(minutes=17))
    return Approval(**{**base, **kw})


def _every_event() -> list[dict]:
    recs = alerts() + commands_and_results() + [_approval()]
    return [e for e in map(to_ocsf, recs) if e is not None]


# -- 1. is_alert ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [c for c in Classification if c is not Classification.FLEET_STORM])
@pytest.mark.parametrize("state", ["open", "updated", "resolved"])
def test_only_an_open_or_updated_finding_that_asks_for_action_is_an_alert(cls, state):
    # OCSF on is_alert: a Create could be alertable, a Close "likely would not". A record-only app
    # fault asks nobody to act: a SIEM that pages on is_alert must not page on it.
    a = next(a for a in alerts() if a.classification is cls and a.state == state)
    e = to_ocsf(a)
    assert e["is_alert"] is (state != "resolved" and cls is not Classification.APP_FAULT)


# -- 2. status is the caption of status_id (except 99 Other) ---------------------------------------
def test_every_status_is_the_caption_of_its_status_id():
    seen = set()
    for e in _every_event():
        if "status_id" not in e:
            continue
        caption = _captions(_CLASS[e["class_uid"]], "status_id")[e["status_id"]]
        seen.add(e["status_id"])
        if e["status_id"] != 99:
            assert e["status"] == caption, e
        else:  # Other: the source's own word, never a caption that has its own id
            assert e["status"] not in set(_captions(_CLASS[e["class_uid"]], "status_id").values()) - {"Other"}, e
    assert {0, 1, 2, 99} <= seen


def test_a_command_not_yet_answered_is_unknown_and_says_whether_it_is_held():
    held = RemediationCommand(ts=T0, node=NODE, command_id="c", incident_id="i", action=Action.CORDON_NODE, step=1,
                              expires_at=T0, requires_approval=True)
    e = to_ocsf(held)
    assert (e["status_id"], e["status"], e["status_detail"]) == (0, "Unknown", "Requires approval")
    e = to_ocsf(held.model_copy(update={"requires_approval": False}))
    assert (e["status_id"], e["status"], e["status_detail"]) == (0, "Unknown", "Issued")


# -- 3. RECORD is no remediation ------------------------------------------------------------------------
def test_record_is_not_exported_as_a_remediation_activity():
    cmd = RemediationCommand(ts=T0, node=NODE, command_id="c", incident_id="i", action=Action.RECORD, step=0,
                             expires_at=T0)
    res = RemediationResult(ts=T0, node=NODE, command_id="c", incident_id="i", action=Action.RECORD,
                            outcome=Outcome.succeeded)
    assert to_ocsf(cmd) is None and to_ocsf(res) is None
    # every activity that is exported is one of the class's remediations, never Detect
    acts = {e["activity_id"] for e in _every_event() if e["class_uid"] == 7001}
    assert 5 not in acts and acts <= set(_captions("remediation_activity", "activity_id"))


# -- 4. the storm's incident lists its member findings and nodes ---------------------------------------
def _storm_alert():
    policy = Policy(fleet_fraction=0.3, fleet_min_nodes=3)
    state = FleetState()
    for n in range(10):
        state, _ = fleet_step(state, {"kind": "node_seen", "node": f"node-{n}", "ts": T0.timestamp()}, policy)
    out = []
    for n in range(4):
        cmd = RemediationCommand(ts=T0 + timedelta(seconds=n), node=f"node-{n}", command_id=f"c{n}",
                                 incident_id=f"inc-{n}", action=Action.CORDON_NODE, step=1,
                                 expires_at=T0 + timedelta(minutes=15))
        state, o = fleet_step(state, {"kind": "command", "command": cmd}, policy)
        out += [r for k, r in o if k == "alert"]
    assert len(out) == 1
    return out[0]


def test_the_storm_names_the_incidents_and_nodes_it_groups():
    storm = _storm_alert()
    e = to_ocsf(storm)
    assert e["class_uid"] == 2005 and ocsf_errors(e) == []
    uids = [f["uid"] for f in e["finding_info_list"]]
    # its own finding first, then each member: the uid a member's Detection Finding carries
    assert uids == [storm.incident_id, "inc-0", "inc-1", "inc-2", "inc-3"]
    hosts = sorted(o["value"] for o in e["observables"] if o["type_id"] == 1)
    assert hosts == ["node-0", "node-1", "node-2", "node-3"]
    doc = to_ecs(storm)
    assert "host" not in doc  # the fleet is no host
    assert doc["related"]["hosts"] == ["node-0", "node-1", "node-2", "node-3"]
    assert [m["incident_id"] for m in doc["xidstream"]["members"]] == ["inc-0", "inc-1", "inc-2", "inc-3"]


# -- 5. observables, the signing key, approvals --------------------------------------------------------
def _obs(e: dict) -> set[tuple[int, str, str]]:
    return {(o["type_id"], o["name"], o["value"]) for o in e.get("observables", [])}


def test_every_event_has_observables_to_pivot_on():
    captions = {int(k): v["caption"] for k, v in
                _schema()["objects"]["observable"]["attributes"]["type_id"]["enum"].items()}
    for e in _every_event():
        # (a storm's reset names no node: it groups nothing any more)
        if e["class_uid"] != 2005:
            assert e.get("observables"), e
        assert ocsf_errors(e) == [], e
        for o in e.get("observables", []):
            assert o["type"] == captions[o["type_id"]] and o["value"]


def test_a_finding_pivots_on_its_node_and_gpu():
    a = next(a for a in alerts() if a.classification is Classification.GPU_WEDGED)
    assert _obs(to_ocsf(a)) == {(1, "device.hostname", NODE), (10, "resources.uid", UUID1)}


def test_a_command_names_its_gpu_and_the_key_that_signed_it():
    key = _key()
    cmd = key.sign(RemediationCommand(ts=T0, node=NODE, command_id="c", incident_id="i", gpu_uuid=UUID1,
                                      action=Action.RESET_GPU, step=2, expires_at=T0))
    e = to_ocsf(cmd)
    assert _obs(e) == {(1, "device.hostname", NODE), (10, "unmapped.gpu_uuid", UUID1),
                       (19, "actor.user.credential_uid", key.key_id)}
    assert e["actor"]["user"]["credential_uid"] == key.key_id
    assert ocsf_errors(e) == []


def test_an_approval_is_exported_with_who_approved_and_their_key():
    key = _key()
    appr = key.sign(_approval())
    e = to_ocsf(appr)
    assert e["class_uid"] == 7001 and e["command_uid"] == "c1" and ocsf_errors(e) == []
    assert (e["activity_id"], e["activity_name"], e["type_uid"]) == (99, "Approve", 700199)
    assert e["actor"]["user"] == {"type_id": 1, "type": "User", "name": "alice", "credential_uid": key.key_id}
    assert (4, "actor.user.name", "alice") in _obs(e) and (19, "actor.user.credential_uid", key.key_id) in _obs(e)
    assert e["metadata"]["original_event_uid"] == "e-appr" and "is_alert" not in e
    doc = to_ecs(appr)
    assert doc["user"]["name"] == "alice" and doc["event"]["action"] == "approve"
    assert doc["xidstream"]["command_id"] == "c1" and doc["xidstream"]["key_id"] == key.key_id


# -- 6. severity by verdict and scope --------------------------------------------------------------------
def _alert(cls: Classification, sev: Severity) -> Alert:
    return Alert(ts=T0, node=NODE, alert_id="a", incident_id="i", gpu_uuid=UUID1, classification=cls, severity=sev,
                 summary="s", evidence=Evidence(node=NODE, gpu_uuid=UUID1,
                                                timeline=[EvidenceEntry(ts=T0, kind="note", summary="n")]))


@pytest.mark.parametrize("cls, sev, severity_id", [
    (Classification.APP_FAULT, Severity.info, 1),
    (Classification.PHANTOM_LOAD, Severity.warning, 3),
    (Classification.GPU_SUSPECT, Severity.warning, 3),
    # one GPU, one node: action required, but the scope is not broad (OCSF 5 is "broad")
    (Classification.GPU_WEDGED, Severity.critical, 4),
    (Classification.GPU_HARDWARE_FAULT, Severity.critical, 4),
    (Classification.FLEET_STORM, Severity.critical, 5),
])
def test_severity_is_decided_by_verdict_and_scope(cls, sev, severity_id):
    e = to_ocsf(_alert(cls, sev))
    assert e["severity_id"] == severity_id
    assert e["severity"] == _captions(_CLASS[e["class_uid"]], "severity_id")[severity_id]


# -- 7. ECS: single values where ECS defines one -------------------------------------------------------
def test_ecs_process_and_pod_are_single_values_with_the_rest_under_xidstream():
    a = next(a for a in alerts() if a.classification is Classification.GPU_WEDGED)
    doc = to_ecs(a)
    assert doc["process"]["pid"] == 4242 and doc["orchestrator"]["resource"]["id"] == "pod-1"
    assert doc["xidstream"]["pids"] == [4242, 4243] and doc["xidstream"]["pod_uids"] == ["pod-1"]


# -- every field of the new events, exactly (what a SIEM parser keys on) ------------------------------
def test_a_storm_incident_finding_in_full():
    storm = Alert(event_id="e-s", ts=T0, node="fleet", alert_id="s1", incident_id="inc-s", classification=Classification.FLEET_STORM,
                  severity=Severity.critical, summary="FLEET STORM", evidence=Evidence(node="fleet", timeline=[
                      EvidenceEntry(ts=T0, kind="note", summary="n", data={
                          # node-z started before its incident was kept (a previous release's state)
                          "nodes": ["node-b", "node-a", "node-z", 7],
                          "members": [{"node": "node-b", "incident_id": "inc-1"}, {"node": "node-a", "incident_id": "inc-2"},
                                      {"node": "node-c", "incident_id": "inc-1"}, {"node": "node-x"}, ["node-y", "inc-9"],
                                      {"node": 3, "incident_id": "inc-3"}]})]))
    e = to_ocsf(storm)
    assert [(f["uid"], f["title"], f["types"]) for f in e["finding_info_list"][1:]] == [
        ("inc-1", "node-level remediation on node-b", ["FLEET_STORM member"]),
        ("inc-1", "node-level remediation on node-c", ["FLEET_STORM member"]),
        ("inc-2", "node-level remediation on node-a", ["FLEET_STORM member"])]
    # every affected node (node-z's start predates incident ids), where the observables point
    assert e["unmapped"]["nodes"] == ["node-a", "node-b", "node-c", "node-z"]
    assert e["observables"] == [{"name": "unmapped.nodes", "type_id": 1, "type": "Hostname", "value": n}
                                for n in ("node-a", "node-b", "node-c", "node-z")]
    assert e["severity_id"] == 5 and ocsf_errors(e) == []
    doc = to_ecs(storm)
    assert doc["related"]["hosts"] == ["node-a", "node-b", "node-c", "node-z"]
    assert doc["xidstream"]["members"] == [{"node": "node-b", "incident_id": "inc-1"},
                                           {"node": "node-c", "incident_id": "inc-1"},
                                           {"node": "node-a", "incident_id": "inc-2"}]


def test_a_signed_command_names_the_processor_as_its_actor():
    key = _key()
    e = to_ocsf(key.sign(RemediationCommand(ts=T0, node=NODE, command_id="c", incident_id="i", action=Action.CORDON_NODE,
                                            step=1, expires_at=T0)))
    assert e["actor"] == {"app_name": "xidstream processor",
                          "user": {"type_id": 4, "type": "Service", "name": "xidstream-processor",
                                   "credential_uid": key.key_id}}


def test_an_approval_in_full():
    key = _key()
    appr = key.sign(_approval())
    assert to_ocsf(appr) == {
        "class_uid": 7001, "class_name": "Remediation Activity", "category_uid": 7, "category_name": "Remediation",
        "activity_id": 99, "activity_name": "Approve", "type_uid": 700199, "type_name": "Remediation Activity: Approve",
        "severity_id": 1, "severity": "Informational", "time": int((T0 + timedelta(minutes=2)).timestamp() * 1000),
        "metadata": _meta("e-appr", "xidstream.approval/1", None, ["host"]),
        "command_uid": "c1", "status_id": 99, "status": "Approved",
        "message": "command c1 approved by alice: checked the rack",
        "actor": {"user": {"type_id": 1, "type": "User", "name": "alice", "credential_uid": key.key_id}},
        "device": {"type_id": 1, "type": "Server", "hostname": NODE, "name": NODE},
        "unmapped": {"approval_id": "ap1", "reason": "checked the rack", "expires_at": "2026-11-28T03:17:00.000000Z"},
        "observables": [{"name": "device.hostname", "type_id": 1, "type": "Hostname", "value": NODE},
                        {"name": "actor.user.name", "type_id": 4, "type": "User Name", "value": "alice"},
                        {"name": "actor.user.credential_uid", "type_id": 19, "type": "User Credential ID",
                         "value": key.key_id}],
    }
    bare = to_ocsf(_approval(reason=""))  # unsigned, no reason: no key to name, the message ends
    assert bare["message"] == "command c1 approved by alice" and "credential_uid" not in bare["actor"]["user"]
    assert [o["type_id"] for o in bare["observables"]] == [1, 4]


@pytest.mark.parametrize("cls", list(Classification))
@pytest.mark.parametrize("state", ["open", "updated", "resolved"])
def test_ecs_says_what_pages_as_ocsf_does(cls, state):
    # ECS has no is_alert: every alert document is event.kind alert, Closes included
    a = next(a for a in alerts() if a.classification is cls and a.state == state)
    doc = to_ecs(a)
    assert doc["event"]["kind"] == "alert"
    assert doc["xidstream"]["is_alert"] is (state != "resolved" and cls is not Classification.APP_FAULT)
    assert "description" not in doc["rule"]  # the recommended steps describe no rule: xidstream.recommended_steps
