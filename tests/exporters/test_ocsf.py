"""Every OCSF event validates against its class's JSON schema (OCSF 1.8.0, embedded offline by the
`ocsf-json-schema` package), and the mapping keeps the ids a SIEM correlates on."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from xidstream.exporters.ocsf import OCSF_VERSION, to_ocsf
from xidstream.schemas import Action, Alert, Classification, Evidence, EvidenceEntry, Outcome, RemediationCommand, RuleRef, \
    RemediationResult, Severity
from tests.exporters.helpers import alerts, commands_and_results, ocsf_errors
from tests.factories import NODE, T0, UUID1, one_of_each


def _cases():
    recs = [r for r in alerts() + commands_and_results() + one_of_each() if to_ocsf(r) is not None]
    return [pytest.param(r, id=f"{type(r).__name__}-{i}") for i, r in enumerate(recs)]


@pytest.mark.parametrize("record", _cases())
def test_every_event_validates_against_the_ocsf_schema_of_its_class(record):
    event = to_ocsf(record)
    assert event["metadata"]["version"] == OCSF_VERSION
    assert ocsf_errors(event) == []


def test_the_validator_rejects_a_broken_event():
    event = to_ocsf(alerts()[0])
    del event["finding_info"]["uid"]
    event["severity_id"] = 42
    errors = ocsf_errors(event)
    assert any("uid" in e for e in errors) and any("severity_id" in e for e in errors)


def test_an_incident_is_one_finding_created_updated_closed():
    by_state = {a.state: to_ocsf(a) for a in alerts() if a.incident_id == "inc-2"}
    assert {s: e["activity_id"] for s, e in by_state.items()} == {"open": 1, "updated": 2, "resolved": 3}
    assert {e["finding_info"]["uid"] for e in by_state.values()} == {"inc-2"}
    assert {e["class_uid"] for e in by_state.values()} == {2004}
    assert by_state["resolved"]["status_id"] == 4 and by_state["open"]["type_uid"] == 200401
    assert {s: e["severity_id"] for s, e in by_state.items()} == {"open": 1, "updated": 3, "resolved": 4}


def test_the_gpu_is_a_resource_with_its_uuid_and_the_node_the_device():
    a = next(a for a in alerts() if a.classification is Classification.GPU_WEDGED)
    e = to_ocsf(a)
    assert e["resources"] == [{"type": "GPU", "hostname": "node-a", "name": "GPU 1", "uid": UUID1,
                               "data": {"gpu_index": 1, "pci_bus_id": "0000:01:00"}}]
    assert e["device"]["hostname"] == "node-a"
    ev = e["evidences"]
    assert [x["data"]["xid"] for x in ev if x["name"].startswith("Xid")] == [13, 31, 43]
    assert [x["process"]["pid"] for x in ev if "process" in x] == [4242, 4243]
    assert [x["data"]["pod_uid"] for x in ev if x["name"] == "pod"] == ["pod-1"]
    assert next(x for x in ev if x["name"] == "sample_stats")["data"]["util_min"] == 100.0


def test_a_re_delivery_has_the_same_uid_distinct_from_the_source_records():
    # OCSF: metadata.uid is the OCSF event's own id, "distinct from the original event identifier"
    a = alerts()[0]
    e = to_ocsf(a)
    assert e["metadata"]["uid"] == to_ocsf(a.model_copy())["metadata"]["uid"] == ocsf_uid(a.event_id)
    assert e["metadata"]["original_event_uid"] == a.event_id != e["metadata"]["uid"]
    assert to_ocsf(alerts()[1])["metadata"]["uid"] != e["metadata"]["uid"]


def test_a_fleet_storm_is_an_incident_finding():
    e = to_ocsf(next(a for a in alerts() if a.classification is Classification.FLEET_STORM))
    assert e["class_uid"] == 2005 and e["finding_info_list"][0]["uid"].startswith("inc-")


def test_commands_and_results_correlate_by_command_uid():
    recs = [r for r in commands_and_results() if r.action is not Action.RECORD]
    events = [to_ocsf(r) for r in recs]
    assert {e["class_uid"] for e in events} == {7001}
    for r, e in zip(recs, events):
        assert e["command_uid"] == r.command_id
    acts = {r.action: to_ocsf(r)["activity_id"] for r in recs if isinstance(r, RemediationCommand)}
    assert acts[Action.CORDON_NODE] == acts[Action.QUARANTINE_GPU] == 1  # Isolate
    assert acts[Action.DRAIN_NODE] == 2  # Evict
    assert acts[Action.UNCORDON_NODE] == acts[Action.RELEASE_GPU] == acts[Action.RESET_GPU] == 3  # Restore
    statuses = {to_ocsf(r)["status_id"] for r in recs if not isinstance(r, RemediationCommand)}
    assert statuses == {1, 2, 99}


# -- every field of each kind of event, exactly --------------------------------------------------------
# What a SIEM parses is the whole event: the checks above let a renamed `unmapped` key, a lost
# correlation id or a wrong time unit through. T0 is 2026-11-28T03:00:00Z: 1795834800000 ms.
T0_MS = 1_795_834_800_000
PRODUCT = {"name": "xidstream", "vendor_name": "xidstream", "version": "0.1.0"}


def ocsf_uid(event_id: str) -> str:
    """The OCSF event's uid: UUID v5 of "ocsf:<event_id>" in xidstream's namespace."""
    return str(uuid.uuid5(uuid.UUID("6f1d2c3b-8a4e-5f60-9b7a-0c1d2e3f4a5b"), "ocsf:" + event_id))


_TOPIC = {"xidstream.alert/2": "gpu.alerts", "xidstream.remediation_command/3": "gpu.remediation",
          "xidstream.remediation_result/4": "gpu.remediation.results", "xidstream.approval/1": "gpu.remediation.approvals"}


def _meta(event_id, schema, correlation, profiles=None):
    m = {"version": "1.8.0", "product": PRODUCT, "uid": ocsf_uid(event_id), "original_event_uid": event_id,
         "log_source": _TOPIC[schema], "log_version": schema}
    if correlation:
        m["correlation_uid"] = correlation
    return {**m, "profiles": profiles} if profiles else m


def _wedged_alert():
    ev = Evidence(node=NODE, gpu_index=1,  # the GPU's ids only on the alert itself
                  timeline=[EvidenceEntry(ts=T0, kind="xid", summary="Xid 43", data={"xid": 43}),
                            EvidenceEntry(ts=T0 + timedelta(seconds=61, microseconds=5), kind="sample_stats",
                                          summary="pinned 61 s", data={"samples": 13})],
                  sample_stats={"util_min": 100.0}, xid_counts={"119": 1, "9": 2, "13": 1}, distinct_pids=[7],
                  pod_uids=["pod-1"])
    return Alert(event_id="e-alert", ts=T0 + timedelta(seconds=62), node=NODE, alert_id="a1", incident_id="inc-1",
                 gpu_uuid=UUID1, pci_bus_id="0000:01:00", classification=Classification.GPU_WEDGED,
                 severity=Severity.critical, state="updated", summary="GPU 1 wedged", evidence=ev,
                 recommended_steps=["cordon node-a", "drain node-a"],
                 rule=RuleRef(id="wedged.pinned_no_process_after_wedge_xid", name="Xid 43, then pinned idle",
                              facts={"xid43": 1, "pinned_s": 61, "compute_processes": 0}))


def test_a_detection_finding_in_full():
    assert to_ocsf(_wedged_alert()) == {
        "class_uid": 2004, "class_name": "Detection Finding", "category_uid": 2, "category_name": "Findings",
        "activity_id": 2, "activity_name": "Update", "type_uid": 200402, "type_name": "Detection Finding: Update",
        "severity_id": 4, "severity": "High", "time": T0_MS + 62_000,
        "metadata": _meta("e-alert", "xidstream.alert/2", "inc-1"),
        "finding_info": {"uid": "inc-1", "uid_alt": "a1", "title": "GPU 1 wedged", "types": ["GPU_WEDGED"],
                         "data_sources": ["NVML", "kernel log", "Kubernetes"],
                         "first_seen_time": T0_MS, "last_seen_time": T0_MS + 61_000,
                         # the rule that made the verdict, by its stable id (streams.rules)
                         "analytic": {"uid": "wedged.pinned_no_process_after_wedge_xid",
                                      "name": "Xid 43, then pinned idle", "type_id": 1, "type": "Rule",
                                      "category": "xidstream"}},
        "message": "GPU 1 wedged", "is_alert": True,  # an Update: no status_id (the analysts' own)
        "device": {"type_id": 1, "type": "Server", "hostname": NODE, "name": NODE},
        "evidences": [  # Xid codes in numeric order, not as strings ("119" < "13" < "9")
            {"name": "Xid 9", "data": {"xid": 9, "count": 2}},
            {"name": "Xid 13", "data": {"xid": 13, "count": 1}},
            {"name": "Xid 119", "data": {"xid": 119, "count": 1}},
            {"name": "process", "process": {"pid": 7}},
            {"name": "pod", "data": {"pod_uid": "pod-1"}},
            {"name": "sample_stats", "data": {"util_min": 100.0}},
        ],
        "unmapped": {"classification": "GPU_WEDGED", "state": "updated",
                     "recommended_steps": ["cordon node-a", "drain node-a"], "alert_id": "a1",
                     "rule_facts": {"xid43": 1, "pinned_s": 61, "compute_processes": 0},
                     "timeline": [{"ts": "2026-11-28T03:00:00.000000Z", "kind": "xid", "summary": "Xid 43",
                                   "data": {"xid": 43}},
                                  {"ts": "2026-11-28T03:01:01.000005Z", "kind": "sample_stats",
                                   "summary": "pinned 61 s", "data": {"samples": 13}}]},
        "resources": [{"type": "GPU", "hostname": NODE, "name": "GPU 1", "uid": UUID1,
                       "data": {"gpu_index": 1, "pci_bus_id": "0000:01:00"}}],
        "remediation": {"desc": "cordon node-a; drain node-a"},
        "observables": [{"name": "device.hostname", "type_id": 1, "type": "Hostname", "value": NODE},
                        {"name": "resources.uid", "type_id": 10, "type": "Resource UID", "value": UUID1}],
    }


def test_an_incident_finding_in_full():
    storm = Alert(event_id="e-storm", ts=T0, node="fleet", alert_id="s1", incident_id="inc-s", gpu_uuid=None,
                  pci_bus_id=None, classification=Classification.FLEET_STORM, severity=Severity.critical,
                  state="open", summary="FLEET STORM", evidence=Evidence(node="fleet"),
                  recommended_steps=["look for a common cause"])
    assert to_ocsf(storm) == {
        "class_uid": 2005, "class_name": "Incident Finding", "category_uid": 2, "category_name": "Findings",
        "activity_id": 1, "activity_name": "Create", "type_uid": 200501, "type_name": "Incident Finding: Create",
        "severity_id": 5, "severity": "Critical", "time": T0_MS,
        "metadata": _meta("e-storm", "xidstream.alert/2", "inc-s"),
        "finding_info_list": [{"uid": "inc-s", "uid_alt": "s1", "title": "FLEET STORM", "types": ["FLEET_STORM"],
                               "data_sources": ["NVML", "kernel log", "Kubernetes"]}],
        "status_id": 1, "status": "New", "assignee_group": {"name": "gpu-fleet-operators"},
        "desc": "FLEET STORM", "message": "FLEET STORM", "is_suspected_breach": False,
        "unmapped": {"classification": "FLEET_STORM", "state": "open", "recommended_steps": ["look for a common cause"],
                     "timeline": [], "alert_id": "s1", "node": "fleet"},
    }


@pytest.mark.parametrize("alert_ids, resource", [
    ({"gpu_uuid": UUID1}, {"type": "GPU", "hostname": NODE, "name": UUID1, "uid": UUID1}),
    ({"pci_bus_id": "0000:02:00"}, {"type": "GPU", "hostname": NODE, "name": "0000:02:00",
                                    "data": {"pci_bus_id": "0000:02:00"}}),
    ({}, None),
], ids=["uuid-only", "pci-only", "neither"])
def test_the_gpu_resource_is_whatever_identity_the_alert_has(alert_ids, resource):
    a = Alert(ts=T0, node=NODE, alert_id="a", incident_id="i", classification=Classification.GPU_SUSPECT,
              severity=Severity.warning, summary="s", evidence=Evidence(node=NODE), **alert_ids)
    e = to_ocsf(a)
    assert e.get("resources") == ([resource] if resource else None)
    assert ocsf_errors(e) == []


def test_a_remediation_command_in_full():
    cmd = RemediationCommand(event_id="e-cmd", ts=T0, node=NODE, command_id="c1", incident_id="inc-1",
                             gpu_uuid=UUID1, gpu_index=1, pci_bus_id="0000:01:00", action=Action.CORDON_NODE, step=1,
                             reason="GPU 1 wedged", preconditions=["no other cordon"], requires_approval=True,
                             expires_at=T0 + timedelta(minutes=15), evidence_ids=["x43"])
    assert to_ocsf(cmd) == {
        "class_uid": 7001, "class_name": "Remediation Activity", "category_uid": 7, "category_name": "Remediation",
        "activity_id": 1, "activity_name": "Isolate", "type_uid": 700101, "type_name": "Remediation Activity: Isolate",
        "severity_id": 4, "severity": "High", "time": T0_MS,
        "metadata": _meta("e-cmd", "xidstream.remediation_command/3", "inc-1", ["host"]),
        "command_uid": "c1", "status_id": 0, "status": "Unknown", "status_detail": "Requires approval",
        "message": "CORDON_NODE step 1 on node-a: GPU 1 wedged",
        "device": {"type_id": 1, "type": "Server", "hostname": NODE, "name": NODE},
        "remediation": {"desc": "GPU 1 wedged"},
        "unmapped": {"incident_id": "inc-1", "action": "CORDON_NODE", "gpu_uuid": UUID1, "pci_bus_id": "0000:01:00",
                     "step": 1, "preconditions": ["no other cordon"], "expires_at": "2026-11-28T03:15:00.000000Z",
                     "dry_run": False, "requires_approval": True, "evidence_ids": ["x43"]},
        "observables": [{"name": "device.hostname", "type_id": 1, "type": "Hostname", "value": NODE},
                        {"name": "unmapped.gpu_uuid", "type_id": 10, "type": "Resource UID", "value": UUID1}],
    }
    # no reason, no GPU ids, not held, a dry run: the action names itself, absent ids are left out
    bare = to_ocsf(RemediationCommand(event_id="e-2", ts=T0, node=NODE, command_id="c2", incident_id="inc-1",
                                      action=Action.REBOOT_NODE, step=3, expires_at=T0, dry_run=True))
    assert (bare["status_detail"], bare["message"], bare["remediation"]) == (
        "Issued", "REBOOT_NODE step 3 on node-a", {"desc": "REBOOT_NODE"})
    assert "actor" not in bare  # unsigned: no key to name
    assert bare["observables"] == [{"name": "device.hostname", "type_id": 1, "type": "Hostname", "value": NODE}]
    assert bare["unmapped"] == {"incident_id": "inc-1", "action": "REBOOT_NODE", "step": 3, "preconditions": [],
                                "expires_at": "2026-11-28T03:00:00.000000Z", "dry_run": True,
                                "requires_approval": False, "evidence_ids": []}


def test_a_remediation_result_in_full():
    res = RemediationResult(event_id="e-res", ts=T0 + timedelta(seconds=5), node=NODE, command_id="c1",
                            incident_id="inc-1", gpu_uuid=UUID1, pci_bus_id="0000:01:00", action=Action.RESET_GPU,
                            outcome=Outcome.refused, detail="GPU busy")
    assert to_ocsf(res) == {
        "class_uid": 7001, "class_name": "Remediation Activity", "category_uid": 7, "category_name": "Remediation",
        "activity_id": 3, "activity_name": "Restore", "type_uid": 700103, "type_name": "Remediation Activity: Restore",
        "severity_id": 4, "severity": "High", "time": T0_MS + 5_000,
        "metadata": _meta("e-res", "xidstream.remediation_result/4", "inc-1", ["host"]),
        "command_uid": "c1", "status_id": 99, "status": "Refused", "status_detail": "GPU busy",
        "message": "RESET_GPU on node-a: refused (GPU busy)",
        "device": {"type_id": 1, "type": "Server", "hostname": NODE, "name": NODE},
        "unmapped": {"incident_id": "inc-1", "action": "RESET_GPU", "gpu_uuid": UUID1, "pci_bus_id": "0000:01:00",
                     "outcome": "refused"},
        "observables": [{"name": "device.hostname", "type_id": 1, "type": "Hostname", "value": NODE},
                        {"name": "unmapped.gpu_uuid", "type_id": 10, "type": "Resource UID", "value": UUID1}],
    }
    bare = to_ocsf(res.model_copy(update={"detail": "", "outcome": Outcome.succeeded}))
    assert (bare["status_detail"], bare["message"]) == ("succeeded", "RESET_GPU on node-a: succeeded")


@pytest.mark.parametrize("outcome, status", [
    (Outcome.succeeded, (1, "Success")), (Outcome.failed, (2, "Failure")),
    (Outcome.refused, (99, "Refused")), (Outcome.expired, (99, "Expired")),
])
def test_each_outcome_has_its_own_status(outcome, status):
    # Only a success is Success: a refused or expired step did nothing, and a SIEM must not count
    # it as a remediation that happened.
    res = RemediationResult(ts=T0, node=NODE, command_id="c", incident_id="i", action=Action.DRAIN_NODE,
                            outcome=outcome)
    e = to_ocsf(res)
    assert (e["status_id"], e["status"]) == status and e["unmapped"]["outcome"] == outcome.value


ACTIONS = [
    (Action.QUARANTINE_GPU, (1, "Isolate"), 3),
    (Action.RELEASE_GPU, (3, "Restore"), 1), (Action.CORDON_NODE, (1, "Isolate"), 4),
    (Action.UNCORDON_NODE, (3, "Restore"), 1), (Action.DRAIN_NODE, (2, "Evict"), 4),
    (Action.RESET_GPU, (3, "Restore"), 4), (Action.REBOOT_NODE, (3, "Restore"), 4),
    (Action.REPLACE_NODE, (99, "Other"), 4),
]


def test_the_action_table_below_lists_every_action_but_record():
    assert sorted(a.value for a, _, _ in ACTIONS) == sorted(a.value for a in Action if a is not Action.RECORD)


@pytest.mark.parametrize("action, activity, severity", ACTIONS)
def test_each_action_has_its_activity_and_severity(action, activity, severity):
    cmd = RemediationCommand(ts=T0, node=NODE, command_id="c", incident_id="i", action=action, step=0, expires_at=T0)
    e = to_ocsf(cmd)
    assert (e["activity_id"], e["activity_name"], e["severity_id"]) == (*activity, severity)
