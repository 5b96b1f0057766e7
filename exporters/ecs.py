"""xidstream records -> Elastic Common Schema documents (pure functions of one record).

Every field outside the custom `xidstream.*` namespace is an ECS field and carries the ECS type
listed in `ECS_FIELD_TYPES` (tests/exporters/test_ecs.py checks every document against it).

`event.id` is the source record's `event_id`: a re-delivered record gives a document with the same
id (use it as the Elasticsearch `_id` to de-duplicate).

A field ECS defines as one value holds one: `process.pid` is the first process of the evidence and
`orchestrator.resource.id` its first pod, all of them under `xidstream.pids` / `xidstream.pod_uids`.
Only the fields ECS itself normalizes to arrays (`ECS_ARRAY_FIELDS`) hold lists. A FLEET_STORM has
no `host` (the fleet is no host): its nodes are `related.hosts` and the incidents it groups
`xidstream.members`. An approval names its approver in `user.name` and their key in
`xidstream.key_id`; a signed command its key in `xidstream.key_id`. Every alert is `event.kind:
alert`, Closes and record-only app faults too: page on `xidstream.is_alert` (OCSF's `is_alert`).
"""

from __future__ import annotations

from typing import Any

from xidstream.schemas.base import Record, format_ts
from xidstream.schemas.models import Alert, Approval, RemediationCommand, RemediationResult
from xidstream.schemas.vocab import Classification, Outcome, Severity

__all__ = ["ECS_VERSION", "ECS_FIELD_TYPES", "ECS_ARRAY_FIELDS", "CUSTOM_NAMESPACE", "to_ecs", "alert_to_ecs",
           "command_to_ecs", "result_to_ecs", "approval_to_ecs"]

ECS_VERSION = "8.17.0"
CUSTOM_NAMESPACE = "xidstream"

# The ECS fields these documents use and their ECS data types, as the ECS field reference
# (elastic/ecs, generated/ecs/ecs_flat.yml of ECS 8.17) defines them. `device.*` arrived in ECS
# 8.7 (beta). A field holding a list is an array of that type (ECS fields may hold arrays).
ECS_FIELD_TYPES: dict[str, str] = {
    "@timestamp": "date",
    "message": "match_only_text",
    "tags": "keyword",
    "labels": "object",
    "ecs.version": "keyword",
    "event.id": "keyword",
    "event.kind": "keyword",
    "event.category": "keyword",
    "event.type": "keyword",
    "event.code": "keyword",
    "event.action": "keyword",
    "event.outcome": "keyword",
    "event.reason": "keyword",
    "event.severity": "long",
    "event.risk_score": "float",
    "event.dataset": "keyword",
    "event.module": "keyword",
    "event.provider": "keyword",
    "event.start": "date",
    "event.end": "date",
    "host.name": "keyword",
    "host.hostname": "keyword",
    "device.id": "keyword",
    "rule.name": "keyword",
    "rule.id": "keyword",
    "rule.category": "keyword",
    "rule.ruleset": "keyword",
    "process.pid": "long",
    "orchestrator.type": "keyword",
    "orchestrator.resource.type": "keyword",
    "orchestrator.resource.id": "keyword",
    "observer.vendor": "keyword",
    "observer.product": "keyword",
    "observer.type": "keyword",
    "related.hosts": "keyword",
    "user.name": "keyword",
}

# The fields of the table that ECS normalizes to arrays (`normalize: [array]` in ecs_flat.yml);
# every other field holds a single value.
ECS_ARRAY_FIELDS = frozenset({"tags", "event.category", "event.type", "related.hosts"})

_EVENT_SEVERITY = {Severity.info: 21, Severity.warning: 47, Severity.critical: 99}
_RISK = {Severity.info: 21.0, Severity.warning: 47.0, Severity.critical: 99.0}
_OUTCOME = {Outcome.succeeded: "success", Outcome.failed: "failure", Outcome.refused: "failure",
            Outcome.expired: "failure"}


def _common(record: Record, kind: str, dataset: str, hosts: list[str] | None = None) -> dict[str, Any]:
    """The fields every document has; `hosts` for a record about several nodes (then no `host`)."""
    doc: dict[str, Any] = {
        "@timestamp": format_ts(record.ts),
        "ecs": {"version": ECS_VERSION},
        "event": {"id": record.event_id, "kind": kind, "module": "xidstream", "dataset": dataset,
                  "provider": record.SCHEMA},
        "observer": {"vendor": "xidstream", "product": "xidstream", "type": "gpu-health"},
        "related": {"hosts": hosts if hosts is not None else [record.node]},
    }
    if hosts is None:
        doc["host"] = {"name": record.node, "hostname": record.node}
    return doc


def _storm_members(alert: Alert) -> list[dict[str, str]]:
    seen = {(m["node"], m["incident_id"]) for e in alert.evidence.timeline for m in e.data.get("members") or []
            if isinstance(m, dict) and isinstance(m.get("node"), str) and isinstance(m.get("incident_id"), str)}
    return [{"node": n, "incident_id": i} for n, i in sorted(seen, key=lambda m: (m[1], m[0]))]


def alert_to_ecs(alert: Alert) -> dict[str, Any]:
    ev = alert.evidence
    storm = alert.classification is Classification.FLEET_STORM
    members = _storm_members(alert) if storm else []
    hosts = None
    if storm:
        hosts = sorted({m["node"] for m in members} | {n for e in ev.timeline for n in e.data.get("nodes") or []
                                                       if isinstance(n, str)})
    doc = _common(alert, "alert", "xidstream.alerts", hosts)
    xids = sorted((int(c) for c in ev.xid_counts if str(c).isdigit()))
    doc["event"].update({
        "category": ["host"],
        "type": ["info"] if alert.state != "resolved" else ["end"],
        "action": alert.state,
        "severity": _EVENT_SEVERITY[alert.severity],
        "risk_score": _RISK[alert.severity],
        "reason": alert.summary,
    })
    if xids:
        # the Xid that the verdict rests on most: the last one on the timeline, else the highest
        last = [e.data.get("xid") for e in ev.timeline if e.kind == "xid" and isinstance(e.data.get("xid"), int)]
        doc["event"]["code"] = str(last[-1] if last else xids[-1])
    if ev.timeline:
        doc["event"]["start"] = format_ts(min(e.ts for e in ev.timeline))
        doc["event"]["end"] = format_ts(max(e.ts for e in ev.timeline))
    doc["message"] = alert.summary
    # rule.id is the rule that made the verdict (streams.rules); a /1 alert names none: its class stands in
    rule = alert.rule
    doc["rule"] = {"name": (rule.name or rule.id) if rule else alert.classification.value,
                   "id": rule.id if rule else alert.classification.value, "category": "gpu-health",
                   "ruleset": "xidstream"}
    if alert.gpu_uuid or ev.gpu_uuid:
        doc["device"] = {"id": alert.gpu_uuid or ev.gpu_uuid}
    if ev.distinct_pids:  # one value, as ECS defines it: the first; all of them under xidstream.pids
        doc["process"] = {"pid": ev.distinct_pids[0]}
    if ev.pod_uids:
        doc["orchestrator"] = {"type": "kubernetes", "resource": {"type": "pod", "id": ev.pod_uids[0]}}
    doc["tags"] = ["xidstream", alert.classification.value, alert.severity.value]
    doc[CUSTOM_NAMESPACE] = {
        "incident_id": alert.incident_id, "alert_id": alert.alert_id, "state": alert.state,
        # what pages: every alert document is event.kind alert, Closes and record-only app faults
        # included; this is OCSF's is_alert (exporters.ocsf)
        "is_alert": alert.state != "resolved" and alert.classification is not Classification.APP_FAULT,
        "severity": alert.severity.value, "gpu_index": ev.gpu_index, "pci_bus_id": alert.pci_bus_id or ev.pci_bus_id,
        "xid_counts": dict(ev.xid_counts), "xids": xids, "sample_stats": dict(ev.sample_stats),
        "recommended_steps": list(alert.recommended_steps),
        "rule_facts": dict(rule.facts) if rule else {},
        "pids": list(ev.distinct_pids), "pod_uids": list(ev.pod_uids),
        "timeline": [{"ts": format_ts(e.ts), "kind": e.kind, "summary": e.summary} for e in ev.timeline],
    }
    if storm:
        doc[CUSTOM_NAMESPACE]["members"] = members
    return doc


def _remediation(rec: RemediationCommand | RemediationResult, dataset: str) -> dict[str, Any]:
    doc = _common(rec, "event", dataset)
    doc["event"].update({"category": ["host"], "action": rec.action.value})
    if rec.gpu_uuid:
        doc["device"] = {"id": rec.gpu_uuid}
    doc[CUSTOM_NAMESPACE] = {"command_id": rec.command_id, "incident_id": rec.incident_id,
                             "action": rec.action.value, "pci_bus_id": rec.pci_bus_id}
    rule = getattr(rec, "rule", None)  # a command names the rule that decided it
    if rule is not None:
        doc["rule"] = {"id": rule.id, "name": rule.name or rule.id, "ruleset": "xidstream"}
        doc[CUSTOM_NAMESPACE]["rule_facts"] = dict(rule.facts)
    return doc


def command_to_ecs(cmd: RemediationCommand) -> dict[str, Any]:
    doc = _remediation(cmd, "xidstream.remediation")
    doc["event"]["type"] = ["change"]
    doc["message"] = f"{cmd.action.value} step {cmd.step} on {cmd.node}" + (f": {cmd.reason}" if cmd.reason else "")
    doc[CUSTOM_NAMESPACE].update({"step": cmd.step, "requires_approval": cmd.requires_approval,
                                  "dry_run": cmd.dry_run, "expires_at": format_ts(cmd.expires_at),
                                  "preconditions": list(cmd.preconditions), "key_id": cmd.key_id})
    return doc


def result_to_ecs(res: RemediationResult) -> dict[str, Any]:
    doc = _remediation(res, "xidstream.remediation_results")
    doc["event"].update({"type": ["change"], "outcome": _OUTCOME[res.outcome]})
    doc["message"] = f"{res.action.value} on {res.node}: {res.outcome.value}" + (f" ({res.detail})" if res.detail else "")
    doc[CUSTOM_NAMESPACE].update({"outcome": res.outcome.value, "detail": res.detail})
    return doc


def approval_to_ecs(appr: Approval) -> dict[str, Any]:
    """An operator's approval of a held command: who, with which key, for which command."""
    doc = _common(appr, "event", "xidstream.approvals")
    doc["event"].update({"category": ["configuration"], "type": ["change"], "action": "approve"})
    doc["user"] = {"name": appr.approved_by}
    doc["message"] = f"command {appr.command_id} approved by {appr.approved_by}" + (
        f": {appr.reason}" if appr.reason else "")
    doc[CUSTOM_NAMESPACE] = {"approval_id": appr.approval_id, "command_id": appr.command_id,
                             "key_id": appr.key_id, "reason": appr.reason, "expires_at": format_ts(appr.expires_at)}
    return doc


def to_ecs(record: Record) -> dict[str, Any] | None:
    if isinstance(record, Alert):
        return alert_to_ecs(record)
    if isinstance(record, RemediationCommand):
        return command_to_ecs(record)
    if isinstance(record, RemediationResult):
        return result_to_ecs(record)
    if isinstance(record, Approval):
        return approval_to_ecs(record)
    return None
