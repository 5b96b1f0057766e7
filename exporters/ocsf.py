"""xidstream records -> OCSF events (pure functions of one record).

OCSF version `OCSF_VERSION` (named in every event's `metadata.version`); every event validates
against the class's JSON schema generated offline from the `ocsf-json-schema` package's embedded
copy of that version, and its semantics (captions, which events page) are checked against the same
schema source (tests/exporters/test_ocsf.py, test_semantics.py).

- Alert (any classification but FLEET_STORM) -> Detection Finding, class 2004. One
  `finding_info.uid` per incident (the incident id); activity Create (1) for an `open` alert,
  Update (2) for `updated`, Close (3) for `resolved`. The GPU is `resources[]` with its UUID as
  `uid` (OCSF's `gpu_info` has no UUID field), the node is `device`; Xid codes, PIDs, pods and
  sample statistics are `evidences[]`. `is_alert` only on an open or updated finding that asks
  someone to act: never on a Close (OCSF: a Close "likely would not" be alertable), never on a
  record-only APP_FAULT. (Incident Finding and Remediation Activity have no `is_alert` without
  OCSF's security_control profile, which these events do not claim.)
- FLEET_STORM -> Incident Finding, class 2005: `finding_info_list` is the storm's own finding, then
  one per incident it groups (each `uid` is that incident's Detection Finding `finding_info.uid`),
  and every affected node is a Hostname observable.
- RemediationCommand / RemediationResult -> Remediation Activity, class 7001, `command_uid` the
  command id (a command and its results share it); activity Isolate (1) / Evict (2) / Restore (3) /
  Other (99) by the action. RECORD is no remediation (the class's own text: Detect is not one): it
  is not exported. A command not yet answered is status Unknown (0), `status_detail` Issued or
  Requires approval; a signed command names its key (`actor.user.credential_uid`).
- Approval -> Remediation Activity, activity Other (99) "Approve", with the held command's
  `command_uid`, the approver as `actor.user.name` and their key as `actor.user.credential_uid`.

`status` is always the caption of `status_id`, except for 99 Other, where it is our own word
(Refused, Expired, Approved). Severity by verdict and scope (`severity_of`): APP_FAULT
Informational (1), PHANTOM_LOAD / GPU_SUSPECT Medium (3), one GPU wedged or failed High (4: action
required, one node), FLEET_STORM Critical (5: OCSF's "action required immediately and the scope is
broad"). Every event carries `observables`: the node (Hostname), the GPU UUID (Resource UID) and,
where there is one, the signing key (User Credential ID) and the approver (User Name).

`metadata.original_event_uid` is the source record's `event_id`; `metadata.uid`, the OCSF event's
own id, is derived from it (a UUID v5, distinct from the source's id as OCSF asks), so a
re-delivered record exports an event with the same uid that a SIEM can de-duplicate.
`metadata.log_source` is the topic the record came from, `metadata.log_version` its contract
version; `log_name` is left to the consumer (its index or bucket). A Detection Finding's
`status_id` is the consumer's (its analysts' workflow): it is New on Create and Resolved on Close,
and an Update leaves it out rather than overwrite what an analyst set.
"""

from __future__ import annotations

import uuid
from typing import Any

from xidstream.schemas.base import Record
from xidstream.schemas.models import Alert, Approval, RemediationCommand, RemediationResult
from xidstream.schemas.topics import spec_for_model
from xidstream.schemas.vocab import Action, Classification, Outcome, Severity

__all__ = ["OCSF_VERSION", "PRODUCT", "to_ocsf", "alert_to_ocsf", "command_to_ocsf", "result_to_ocsf",
           "approval_to_ocsf", "severity_of", "CLASS_DETECTION_FINDING", "CLASS_INCIDENT_FINDING",
           "CLASS_REMEDIATION_ACTIVITY", "class_name_of"]

OCSF_VERSION = "1.8.0"
PRODUCT = {"name": "xidstream", "vendor_name": "xidstream", "version": "0.1.0"}

CLASS_DETECTION_FINDING = 2004
CLASS_INCIDENT_FINDING = 2005
CLASS_REMEDIATION_ACTIVITY = 7001
_CATEGORY = {2004: (2, "Findings"), 2005: (2, "Findings"), 7001: (7, "Remediation")}
_CLASS_NAME = {2004: "Detection Finding", 2005: "Incident Finding", 7001: "Remediation Activity"}
# the class's name in the OCSF schema's dictionary (`ocsf_json_schema` looks classes up by it)
_CLASS_KEY = {2004: "detection_finding", 2005: "incident_finding", 7001: "remediation_activity"}

# severity_id by the alert's severity: 1 Informational, 3 Medium, 4 High; a critical verdict is
# Critical (5) only when its scope is broad (the fleet), as OCSF's caption for 5 says
_SEVERITY = {Severity.info: 1, Severity.warning: 3, Severity.critical: 4}
_BROAD = frozenset({Classification.FLEET_STORM})
# finding activity_id by the alert's state
_FINDING_ACTIVITY = {"open": (1, "Create"), "updated": (2, "Update"), "resolved": (3, "Close")}
# Detection Finding status_id: 1 New, 2 In Progress, 4 Resolved
# (an Update has none: OCSF's status_id is "set by the consumer", an analyst's, not ours to overwrite)
_DETECTION_STATUS = {"open": (1, "New"), "resolved": (4, "Resolved")}
# Incident Finding status_id: 1 New, 2 In Progress, 5 Closed
_INCIDENT_STATUS = {"open": (1, "New"), "updated": (2, "In Progress"), "resolved": (5, "Closed")}
# Remediation Activity activity_id: 1 Isolate, 2 Evict, 3 Restore, 5 Detect, 99 Other
# (RECORD is none of them: it is not exported)
_REMEDIATION_ACTIVITY: dict[Action, tuple[int, str]] = {
    Action.QUARANTINE_GPU: (1, "Isolate"),
    Action.CORDON_NODE: (1, "Isolate"),
    Action.DRAIN_NODE: (2, "Evict"),
    Action.RELEASE_GPU: (3, "Restore"),
    Action.UNCORDON_NODE: (3, "Restore"),
    Action.RESET_GPU: (3, "Restore"),
    Action.REBOOT_NODE: (3, "Restore"),
    Action.REPLACE_NODE: (99, "Other"),
}
_APPROVE = (99, "Approve")
# Remediation Activity status_id: 1 Success, 2 Failure, 99 Other (`status` our own word)
_RESULT_STATUS = {Outcome.succeeded: (1, "Success"), Outcome.failed: (2, "Failure"),
                  Outcome.refused: (99, "Refused"), Outcome.expired: (99, "Expired")}
# a command not answered yet: its outcome is unknown (0), the detail says whether it waits for approval
_COMMAND_STATUS = (0, "Unknown")
# observable type_id: 1 Hostname, 4 User Name, 10 Resource UID, 19 User Credential ID
_OBSERVABLE = {1: "Hostname", 4: "User Name", 10: "Resource UID", 19: "User Credential ID"}
# the severity of a remediation step: node actions matter more than a GPU's
_ACTION_SEVERITY = {Action.QUARANTINE_GPU: 3, Action.RELEASE_GPU: 1, Action.CORDON_NODE: 4,
                    Action.UNCORDON_NODE: 1, Action.DRAIN_NODE: 4, Action.RESET_GPU: 4, Action.REBOOT_NODE: 4,
                    Action.REPLACE_NODE: 4}
_SEVERITY_NAME = {0: "Unknown", 1: "Informational", 2: "Low", 3: "Medium", 4: "High", 5: "Critical", 6: "Fatal"}


def class_name_of(class_uid: int) -> str:
    """The OCSF dictionary name of a class this module emits (e.g. ``detection_finding``)."""
    return _CLASS_KEY[class_uid]


# the namespace of the OCSF events' own uids (uuid5 of "ocsf:<event_id>"): fixed, so a re-delivered
# record's event has the same uid
_UID_NAMESPACE = uuid.UUID("6f1d2c3b-8a4e-5f60-9b7a-0c1d2e3f4a5b")


def severity_of(alert: Alert) -> int:
    """The OCSF severity_id of an alert: by its verdict's severity, Critical only for a broad scope."""
    sev = _SEVERITY[alert.severity]
    return 5 if sev == 4 and alert.classification in _BROAD else sev


def _observable(type_id: int, name: str, value: str) -> dict[str, Any]:
    return {"name": name, "type_id": type_id, "type": _OBSERVABLE[type_id], "value": value}


def _ms(record_ts) -> int:
    return int(record_ts.timestamp() * 1000)


def _base(record: Record, class_uid: int, activity: tuple[int, str], severity_id: int, *,
          correlation: str | None = None, profiles: list[str] | None = None) -> dict[str, Any]:
    cat_uid, cat_name = _CATEGORY[class_uid]
    metadata: dict[str, Any] = {
        "version": OCSF_VERSION,
        "product": dict(PRODUCT),
        "uid": str(uuid.uuid5(_UID_NAMESPACE, f"ocsf:{record.event_id}")),
        "original_event_uid": record.event_id,
        "log_source": spec_for_model(type(record)).name,
        "log_version": record.SCHEMA,
    }
    if correlation:
        metadata["correlation_uid"] = correlation
    if profiles:
        metadata["profiles"] = list(profiles)
    return {
        "class_uid": class_uid,
        "class_name": _CLASS_NAME[class_uid],
        "category_uid": cat_uid,
        "category_name": cat_name,
        "activity_id": activity[0],
        "activity_name": activity[1],
        "type_uid": class_uid * 100 + activity[0],
        "type_name": f"{_CLASS_NAME[class_uid]}: {activity[1]}",
        "severity_id": severity_id,
        "severity": _SEVERITY_NAME.get(severity_id, "Other"),
        "time": _ms(record.ts),
        "metadata": metadata,
    }


def _device(node: str) -> dict[str, Any]:
    return {"type_id": 1, "type": "Server", "hostname": node, "name": node}


def _gpu_resource(alert: Alert) -> dict[str, Any] | None:
    ev = alert.evidence
    uuid = alert.gpu_uuid or ev.gpu_uuid
    if not uuid and not (alert.pci_bus_id or ev.pci_bus_id):
        return None
    data = {k: v for k, v in {"gpu_index": ev.gpu_index, "pci_bus_id": alert.pci_bus_id or ev.pci_bus_id}.items()
            if v is not None}
    res: dict[str, Any] = {"type": "GPU", "hostname": alert.node,
                           "name": f"GPU {ev.gpu_index}" if ev.gpu_index is not None else (uuid or data["pci_bus_id"])}
    if uuid:
        res["uid"] = uuid
    if data:
        res["data"] = data
    return res


def _evidences(alert: Alert) -> list[dict[str, Any]]:
    ev = alert.evidence
    out: list[dict[str, Any]] = []
    for code, count in sorted(ev.xid_counts.items(), key=lambda kv: (len(kv[0]), kv[0])):
        xid = int(code) if str(code).isdigit() else code
        out.append({"name": f"Xid {code}", "data": {"xid": xid, "count": count}})
    for pid in ev.distinct_pids:
        out.append({"name": "process", "process": {"pid": pid}})
    for pod in ev.pod_uids:
        out.append({"name": "pod", "data": {"pod_uid": pod}})
    if ev.sample_stats:
        out.append({"name": "sample_stats", "data": dict(ev.sample_stats)})
    return out


def _timeline(alert: Alert) -> list[dict[str, Any]]:
    return [{"ts": e.ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "kind": e.kind, "summary": e.summary, "data": e.data}
            for e in alert.evidence.timeline]


def alert_to_ocsf(alert: Alert) -> dict[str, Any]:
    """An alert as a Detection Finding (2004), or a FLEET_STORM as an Incident Finding (2005)."""
    sev_id = severity_of(alert)
    state = alert.state
    # pages only while open and when someone must act: a Close, or a record-only app fault, does not
    alertable = state != "resolved" and alert.classification is not Classification.APP_FAULT
    unmapped = {"classification": alert.classification.value, "state": state,
                "recommended_steps": list(alert.recommended_steps), "timeline": _timeline(alert),
                "alert_id": alert.alert_id}
    finding = {"uid": alert.incident_id, "uid_alt": alert.alert_id, "title": alert.summary,
               "types": [alert.classification.value], "data_sources": ["NVML", "kernel log", "Kubernetes"]}
    if alert.rule is not None:
        # which rule made the verdict (streams.rules, docs/architecture.md "Decision index"): OCSF's
        # analytic, type Rule; the facts it read ride in unmapped (OCSF has no place for them)
        finding["analytic"] = {"uid": alert.rule.id, "name": alert.rule.name or alert.rule.id,
                               "type_id": 1, "type": "Rule", "category": "xidstream"}
        unmapped["rule_facts"] = dict(alert.rule.facts)
    if alert.evidence.timeline:
        finding["first_seen_time"] = _ms(min(e.ts for e in alert.evidence.timeline))
        finding["last_seen_time"] = _ms(max(e.ts for e in alert.evidence.timeline))
    if alert.classification is Classification.FLEET_STORM:
        status = _INCIDENT_STATUS[state]
        members = _storm_members(alert)
        out = _base(alert, CLASS_INCIDENT_FINDING, _FINDING_ACTIVITY[state], sev_id, correlation=alert.incident_id)
        out.update({
            # the storm's own finding, then each incident it groups, by the uid of its Detection Finding
            "finding_info_list": [finding] + [{"uid": inc, "title": f"node-level remediation on {node}",
                                               "types": ["FLEET_STORM member"]} for node, inc in members],
            "status_id": status[0], "status": status[1],
            "assignee_group": {"name": "gpu-fleet-operators"},
            "desc": alert.summary,
            "message": alert.summary,
            "is_suspected_breach": False,
            "unmapped": {**unmapped, "node": alert.node},
        })
        nodes = sorted({node for node, _ in members} | set(_storm_nodes(alert)))
        if nodes:  # every affected node, where the observables point
            out["unmapped"]["nodes"] = nodes
            out["observables"] = [_observable(1, "unmapped.nodes", n) for n in nodes]
        return out
    out = _base(alert, CLASS_DETECTION_FINDING, _FINDING_ACTIVITY[state], sev_id, correlation=alert.incident_id)
    out["finding_info"] = finding
    if state in _DETECTION_STATUS:
        out["status_id"], out["status"] = _DETECTION_STATUS[state]
    out.update({
        "message": alert.summary,
        "is_alert": alertable,
        "device": _device(alert.node),
        "evidences": _evidences(alert),
        "unmapped": unmapped,
    })
    res = _gpu_resource(alert)
    observables = [_observable(1, "device.hostname", alert.node)]
    if res:
        out["resources"] = [res]
        if "uid" in res:
            observables.append(_observable(10, "resources.uid", res["uid"]))
    out["observables"] = observables
    if alert.recommended_steps:
        out["remediation"] = {"desc": "; ".join(alert.recommended_steps)}
    return out


def _storm_members(alert: Alert) -> list[tuple[str, str]]:
    """(node, incident id) of each start the storm groups, from its evidence (streams.fleet)."""
    out = set()
    for e in alert.evidence.timeline:
        for m in e.data.get("members") or []:
            if isinstance(m, dict) and isinstance(m.get("node"), str) and isinstance(m.get("incident_id"), str):
                out.add((m["node"], m["incident_id"]))
    return sorted(out, key=lambda m: (m[1], m[0]))


def _storm_nodes(alert: Alert) -> list[str]:
    return [n for e in alert.evidence.timeline for n in e.data.get("nodes") or [] if isinstance(n, str)]


def _remediation_observables(rec: RemediationCommand | RemediationResult | Approval) -> list[dict[str, Any]]:
    out = [_observable(1, "device.hostname", rec.node)]
    if getattr(rec, "gpu_uuid", None):
        out.append(_observable(10, "unmapped.gpu_uuid", rec.gpu_uuid))
    if isinstance(rec, Approval):
        out.append(_observable(4, "actor.user.name", rec.approved_by))
    if getattr(rec, "key_id", None):
        out.append(_observable(19, "actor.user.credential_uid", rec.key_id))
    return out


def _remediation_unmapped(rec: RemediationCommand | RemediationResult) -> dict[str, Any]:
    d = {"incident_id": rec.incident_id, "action": rec.action.value, "gpu_uuid": rec.gpu_uuid,
         "pci_bus_id": rec.pci_bus_id}
    return {k: v for k, v in d.items() if v is not None}


def command_to_ocsf(cmd: RemediationCommand) -> dict[str, Any] | None:
    """A decided remediation step as a Remediation Activity (7001), status Unknown until a result;
    None for RECORD (no remediation)."""
    if cmd.action is Action.RECORD:
        return None
    out = _base(cmd, CLASS_REMEDIATION_ACTIVITY, _REMEDIATION_ACTIVITY[cmd.action], _ACTION_SEVERITY[cmd.action],
                correlation=cmd.incident_id, profiles=["host"])
    out.update({
        "command_uid": cmd.command_id,
        "status_id": _COMMAND_STATUS[0], "status": _COMMAND_STATUS[1],
        "status_detail": "Requires approval" if cmd.requires_approval else "Issued",
        "message": f"{cmd.action.value} step {cmd.step} on {cmd.node}" + (f": {cmd.reason}" if cmd.reason else ""),
        "device": _device(cmd.node),
        "remediation": {"desc": cmd.reason or cmd.action.value},
        "unmapped": {**_remediation_unmapped(cmd), "step": cmd.step, "preconditions": list(cmd.preconditions),
                     "expires_at": cmd.expires_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "dry_run": cmd.dry_run,
                     "requires_approval": cmd.requires_approval, "evidence_ids": list(cmd.evidence_ids),
                     **({"rule_id": cmd.rule.id, "rule_facts": dict(cmd.rule.facts)} if cmd.rule else {})},
        "observables": _remediation_observables(cmd),
    })
    if cmd.key_id:  # who decided it: the processor, by the key that signed it
        out["actor"] = {"app_name": "xidstream processor",
                        "user": {"type_id": 4, "type": "Service", "name": "xidstream-processor",
                                 "credential_uid": cmd.key_id}}
    return out


def result_to_ocsf(res: RemediationResult) -> dict[str, Any] | None:
    """An executor's result for a command as a Remediation Activity with the same `command_uid`;
    None for RECORD."""
    if res.action is Action.RECORD:
        return None
    status = _RESULT_STATUS[res.outcome]
    out = _base(res, CLASS_REMEDIATION_ACTIVITY, _REMEDIATION_ACTIVITY[res.action], _ACTION_SEVERITY[res.action],
                correlation=res.incident_id, profiles=["host"])
    out.update({
        "command_uid": res.command_id,
        "status_id": status[0], "status": status[1],
        "status_detail": res.detail or res.outcome.value,
        "message": f"{res.action.value} on {res.node}: {res.outcome.value}" + (f" ({res.detail})" if res.detail else ""),
        "device": _device(res.node),
        "unmapped": {**_remediation_unmapped(res), "outcome": res.outcome.value},
        "observables": _remediation_observables(res),
    })
    return out


def approval_to_ocsf(appr: Approval) -> dict[str, Any]:
    """An operator's approval of a held command: a Remediation Activity "Approve" with the command's
    `command_uid`, the approver and the key that signed it."""
    out = _base(appr, CLASS_REMEDIATION_ACTIVITY, _APPROVE, 1, profiles=["host"])
    user = {"type_id": 1, "type": "User", "name": appr.approved_by}
    if appr.key_id:
        user["credential_uid"] = appr.key_id
    out.update({
        "command_uid": appr.command_id,
        "status_id": 99, "status": "Approved",
        "message": f"command {appr.command_id} approved by {appr.approved_by}" + (f": {appr.reason}" if appr.reason else ""),
        "actor": {"user": user},
        "device": _device(appr.node),
        "unmapped": {"approval_id": appr.approval_id, "reason": appr.reason,
                     "expires_at": appr.expires_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")},
        "observables": _remediation_observables(appr),
    })
    return out


def to_ocsf(record: Record) -> dict[str, Any] | None:
    """The OCSF event of an alert, command, result or approval; None for any other record (and for
    RECORD, which is no remediation)."""
    if isinstance(record, Alert):
        return alert_to_ocsf(record)
    if isinstance(record, RemediationCommand):
        return command_to_ocsf(record)
    if isinstance(record, RemediationResult):
        return result_to_ocsf(record)
    if isinstance(record, Approval):
        return approval_to_ocsf(record)
    return None
