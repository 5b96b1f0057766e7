"""xidstream records -> Elastic Common Schema documents (pure functions of one record).

Every field outside the custom `xidstream.*` namespace is an ECS field and carries the ECS type
listed in `ECS_FIELD_TYPES` (tests/exporters/test_ecs.py checks every document against it).

`event.id` is the source record's `event_id`: a re-delivered record gives a document with the same
id (use it as the Elasticsearch `_id` to de-duplicate).
"""

from __future__ import annotations

from typing import Any

from schemas.base import Record, format_ts
from schemas.models import Alert, RemediationCommand, RemediationResult
from schemas.vocab import Outcome, Severity

__all__ = ["ECS_VERSION", "ECS_FIELD_TYPES", "CUSTOM_NAMESPACE", "to_ecs", "alert_to_ecs", "command_to_ecs",
           "result_to_ecs"]

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
    "rule.description": "keyword",
    "process.pid": "long",
    "orchestrator.type": "keyword",
    "orchestrator.resource.type": "keyword",
    "orchestrator.resource.id": "keyword",
    "observer.vendor": "keyword",
    "observer.product": "keyword",
    "observer.type": "keyword",
    "related.hosts": "keyword",
}

_EVENT_SEVERITY = {Severity.info: 21, Severity.warning: 47, Severity.critical: 99}
_RISK = {Severity.info: 21.0, Severity.warning: 47.0, Severity.critical: 99.0}
_OUTCOME = {Outcome.succeeded: "success", Outcome.failed: "failure", Outcome.refused: "failure",
            Outcome.expired: "failure"}


def _common(record: Record, kind: str, dataset: str) -> dict[str, Any]:
    return {
        "@timestamp": format_ts(record.ts),
        "ecs": {"version": ECS_VERSION},
        "event": {"id": record.event_id, "kind": kind, "module": "xidstream", "dataset": dataset,
                  "provider": record.SCHEMA},
        "host": {"name": record.node, "hostname": record.node},
        "observer": {"vendor": "xidstream", "product": "xidstream", "type": "gpu-health"},
        "related": {"hosts": [record.node]},
    }


def alert_to_ecs(alert: Alert) -> dict[str, Any]:
    ev = alert.evidence
    doc = _common(alert, "alert", "xidstream.alerts")
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
    doc["rule"] = {"name": alert.classification.value, "id": alert.classification.value, "category": "gpu-health"}
    if alert.recommended_steps:
        doc["rule"]["description"] = "; ".join(alert.recommended_steps)
    if alert.gpu_uuid or ev.gpu_uuid:
        doc["device"] = {"id": alert.gpu_uuid or ev.gpu_uuid}
    if ev.distinct_pids:
        doc["process"] = {"pid": list(ev.distinct_pids)}
    if ev.pod_uids:
        doc["orchestrator"] = {"type": "kubernetes", "resource": {"type": "pod", "id": list(ev.pod_uids)}}
    doc["tags"] = ["xidstream", alert.classification.value, alert.severity.value]
    doc[CUSTOM_NAMESPACE] = {
        "incident_id": alert.incident_id, "alert_id": alert.alert_id, "state": alert.state,
        "severity": alert.severity.value, "gpu_index": ev.gpu_index, "pci_bus_id": alert.pci_bus_id or ev.pci_bus_id,
        "xid_counts": dict(ev.xid_counts), "xids": xids, "sample_stats": dict(ev.sample_stats),
        "recommended_steps": list(alert.recommended_steps),
        "timeline": [{"ts": format_ts(e.ts), "kind": e.kind, "summary": e.summary} for e in ev.timeline],
    }
    return doc


def _remediation(rec: RemediationCommand | RemediationResult, dataset: str) -> dict[str, Any]:
    doc = _common(rec, "event", dataset)
    doc["event"].update({"category": ["host"], "action": rec.action.value})
    if rec.gpu_uuid:
        doc["device"] = {"id": rec.gpu_uuid}
    doc[CUSTOM_NAMESPACE] = {"command_id": rec.command_id, "incident_id": rec.incident_id,
                             "action": rec.action.value, "pci_bus_id": rec.pci_bus_id}
    return doc


def command_to_ecs(cmd: RemediationCommand) -> dict[str, Any]:
    doc = _remediation(cmd, "xidstream.remediation")
    doc["event"]["type"] = ["change"]
    doc["message"] = f"{cmd.action.value} step {cmd.step} on {cmd.node}" + (f": {cmd.reason}" if cmd.reason else "")
    doc[CUSTOM_NAMESPACE].update({"step": cmd.step, "requires_approval": cmd.requires_approval,
                                  "dry_run": cmd.dry_run, "expires_at": format_ts(cmd.expires_at),
                                  "preconditions": list(cmd.preconditions)})
    return doc


def result_to_ecs(res: RemediationResult) -> dict[str, Any]:
    doc = _remediation(res, "xidstream.remediation_results")
    doc["event"].update({"type": ["change"], "outcome": _OUTCOME[res.outcome]})
    doc["message"] = f"{res.action.value} on {res.node}: {res.outcome.value}" + (f" ({res.detail})" if res.detail else "")
    doc[CUSTOM_NAMESPACE].update({"outcome": res.outcome.value, "detail": res.detail})
    return doc


def to_ecs(record: Record) -> dict[str, Any] | None:
    if isinstance(record, Alert):
        return alert_to_ecs(record)
    if isinstance(record, RemediationCommand):
        return command_to_ecs(record)
    if isinstance(record, RemediationResult):
        return result_to_ecs(record)
    return None
