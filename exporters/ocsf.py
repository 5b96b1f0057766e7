"""xidstream records -> OCSF events (pure functions of one record).

OCSF version `OCSF_VERSION` (named in every event's `metadata.version`); every event validates
against the class's JSON schema generated offline from the `ocsf-json-schema` package's embedded
copy of that version (tests/exporters/test_ocsf.py).

- Alert (any classification but FLEET_STORM) -> Detection Finding, class 2004. One
  `finding_info.uid` per incident (the incident id); activity Create (1) for an `open` alert,
  Update (2) for `updated`, Close (3) for `resolved`. The GPU is `resources[]` with its UUID as
  `uid` (OCSF's `gpu_info` has no UUID field), the node is `device`; Xid codes, PIDs, pods and
  sample statistics are `evidences[]`.
- FLEET_STORM -> Incident Finding, class 2005 (`finding_info_list`: the storm's incident).
- RemediationCommand / RemediationResult -> Remediation Activity, class 7001, `command_uid` the
  command id (a command and its results share it); activity Isolate (1) / Evict (2) / Restore (3) /
  Detect (5) / Other (99) by the action.

`metadata.uid` is the source record's `event_id` (and `metadata.original_event_uid` too), so a
re-delivered record exports an event with the same uid that a SIEM can de-duplicate.
"""

from __future__ import annotations

from typing import Any

from schemas.base import Record
from schemas.models import Alert, RemediationCommand, RemediationResult
from schemas.vocab import Action, Classification, Outcome, Severity

__all__ = ["OCSF_VERSION", "PRODUCT", "to_ocsf", "alert_to_ocsf", "command_to_ocsf", "result_to_ocsf",
           "CLASS_DETECTION_FINDING", "CLASS_INCIDENT_FINDING", "CLASS_REMEDIATION_ACTIVITY",
           "class_name_of"]

OCSF_VERSION = "1.8.0"
PRODUCT = {"name": "xidstream", "vendor_name": "xidstream", "version": "0.1.0"}

CLASS_DETECTION_FINDING = 2004
CLASS_INCIDENT_FINDING = 2005
CLASS_REMEDIATION_ACTIVITY = 7001
_CATEGORY = {2004: (2, "Findings"), 2005: (2, "Findings"), 7001: (7, "Remediation")}
_CLASS_NAME = {2004: "Detection Finding", 2005: "Incident Finding", 7001: "Remediation Activity"}
# the class's name in the OCSF schema's dictionary (`ocsf_json_schema` looks classes up by it)
_CLASS_KEY = {2004: "detection_finding", 2005: "incident_finding", 7001: "remediation_activity"}

# severity_id: 1 Informational, 3 Medium, 5 Critical
_SEVERITY = {Severity.info: (1, "Informational"), Severity.warning: (3, "Medium"), Severity.critical: (5, "Critical")}
# finding activity_id by the alert's state
_FINDING_ACTIVITY = {"open": (1, "Create"), "updated": (2, "Update"), "resolved": (3, "Close")}
# Detection Finding status_id: 1 New, 2 In Progress, 4 Resolved
_DETECTION_STATUS = {"open": (1, "New"), "updated": (2, "In Progress"), "resolved": (4, "Resolved")}
# Incident Finding status_id: 1 New, 2 In Progress, 5 Closed
_INCIDENT_STATUS = {"open": (1, "New"), "updated": (2, "In Progress"), "resolved": (5, "Closed")}
# Remediation Activity activity_id: 1 Isolate, 2 Evict, 3 Restore, 5 Detect, 99 Other
_REMEDIATION_ACTIVITY: dict[Action, tuple[int, str]] = {
    Action.RECORD: (5, "Detect"),
    Action.QUARANTINE_GPU: (1, "Isolate"),
    Action.CORDON_NODE: (1, "Isolate"),
    Action.DRAIN_NODE: (2, "Evict"),
    Action.RELEASE_GPU: (3, "Restore"),
    Action.UNCORDON_NODE: (3, "Restore"),
    Action.RESET_GPU: (3, "Restore"),
    Action.REBOOT_NODE: (3, "Restore"),
    Action.REPLACE_NODE: (99, "Other"),
}
# Remediation Activity status_id: 1 Success, 2 Failure, 99 Other
_RESULT_STATUS = {Outcome.succeeded: (1, "Success"), Outcome.failed: (2, "Failure"),
                  Outcome.refused: (99, "Refused"), Outcome.expired: (99, "Expired")}
# the severity of a remediation step: node actions matter more than a GPU's
_ACTION_SEVERITY = {Action.RECORD: 1, Action.QUARANTINE_GPU: 3, Action.RELEASE_GPU: 1, Action.CORDON_NODE: 4,
                    Action.UNCORDON_NODE: 1, Action.DRAIN_NODE: 4, Action.RESET_GPU: 4, Action.REBOOT_NODE: 4,
                    Action.REPLACE_NODE: 4}
_SEVERITY_NAME = {0: "Unknown", 1: "Informational", 2: "Low", 3: "Medium", 4: "High", 5: "Critical", 6: "Fatal"}


def class_name_of(class_uid: int) -> str:
    """The OCSF dictionary name of a class this module emits (e.g. ``detection_finding``)."""
    return _CLASS_KEY[class_uid]


def _ms(record_ts) -> int:
    return int(record_ts.timestamp() * 1000)


def _base(record: Record, class_uid: int, activity: tuple[int, str], severity_id: int, *,
          correlation: str | None = None, profiles: list[str] | None = None) -> dict[str, Any]:
    cat_uid, cat_name = _CATEGORY[class_uid]
    metadata: dict[str, Any] = {
        "version": OCSF_VERSION,
        "product": dict(PRODUCT),
        "uid": record.event_id,
        "original_event_uid": record.event_id,
        "log_name": record.SCHEMA,
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
    sev_id = _SEVERITY[alert.severity][0]
    state = alert.state
    unmapped = {"classification": alert.classification.value, "state": state,
                "recommended_steps": list(alert.recommended_steps), "timeline": _timeline(alert),
                "alert_id": alert.alert_id}
    finding = {"uid": alert.incident_id, "uid_alt": alert.alert_id, "title": alert.summary,
               "types": [alert.classification.value], "data_sources": ["NVML", "kernel log", "Kubernetes"]}
    if alert.evidence.timeline:
        finding["first_seen_time"] = _ms(min(e.ts for e in alert.evidence.timeline))
        finding["last_seen_time"] = _ms(max(e.ts for e in alert.evidence.timeline))
    if alert.classification is Classification.FLEET_STORM:
        status = _INCIDENT_STATUS[state]
        out = _base(alert, CLASS_INCIDENT_FINDING, _FINDING_ACTIVITY[state], sev_id, correlation=alert.incident_id)
        out.update({
            "finding_info_list": [finding],
            "status_id": status[0], "status": status[1],
            "assignee_group": {"name": "gpu-fleet-operators"},
            "desc": alert.summary,
            "message": alert.summary,
            "is_suspected_breach": False,
            "unmapped": {**unmapped, "node": alert.node},
        })
        return out
    status = _DETECTION_STATUS[state]
    out = _base(alert, CLASS_DETECTION_FINDING, _FINDING_ACTIVITY[state], sev_id, correlation=alert.incident_id)
    out.update({
        "finding_info": finding,
        "status_id": status[0], "status": status[1],
        "message": alert.summary,
        "is_alert": True,
        "device": _device(alert.node),
        "evidences": _evidences(alert),
        "unmapped": unmapped,
    })
    res = _gpu_resource(alert)
    if res:
        out["resources"] = [res]
    if alert.recommended_steps:
        out["remediation"] = {"desc": "; ".join(alert.recommended_steps)}
    return out


def _remediation_unmapped(rec: RemediationCommand | RemediationResult) -> dict[str, Any]:
    d = {"incident_id": rec.incident_id, "action": rec.action.value, "gpu_uuid": rec.gpu_uuid,
         "pci_bus_id": rec.pci_bus_id}
    return {k: v for k, v in d.items() if v is not None}


def command_to_ocsf(cmd: RemediationCommand) -> dict[str, Any]:
    """A decided remediation step as a Remediation Activity (7001), status Unknown until a result."""
    out = _base(cmd, CLASS_REMEDIATION_ACTIVITY, _REMEDIATION_ACTIVITY[cmd.action], _ACTION_SEVERITY[cmd.action],
                correlation=cmd.incident_id, profiles=["host"])
    out.update({
        "command_uid": cmd.command_id,
        "status_id": 0, "status": "Requires approval" if cmd.requires_approval else "Issued",
        "message": f"{cmd.action.value} step {cmd.step} on {cmd.node}" + (f": {cmd.reason}" if cmd.reason else ""),
        "device": _device(cmd.node),
        "remediation": {"desc": cmd.reason or cmd.action.value},
        "unmapped": {**_remediation_unmapped(cmd), "step": cmd.step, "preconditions": list(cmd.preconditions),
                     "expires_at": cmd.expires_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "dry_run": cmd.dry_run,
                     "requires_approval": cmd.requires_approval, "evidence_ids": list(cmd.evidence_ids)},
    })
    return out


def result_to_ocsf(res: RemediationResult) -> dict[str, Any]:
    """An executor's result for a command as a Remediation Activity with the same `command_uid`."""
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
    })
    return out


def to_ocsf(record: Record) -> dict[str, Any] | None:
    """The OCSF event of an alert, command or result; None for any other record."""
    if isinstance(record, Alert):
        return alert_to_ocsf(record)
    if isinstance(record, RemediationCommand):
        return command_to_ocsf(record)
    if isinstance(record, RemediationResult):
        return result_to_ocsf(record)
    return None
