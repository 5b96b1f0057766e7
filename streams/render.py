"""What people read: alert summaries, the evidence block, the recommended steps, command records.

Every Xid is described by NVIDIA's own catalog (schemas.xid_catalog): its mnemonic and NVIDIA's
resolution, never a label of ours (Xid 63 and 92 are memory events NVIDIA
resolves with IGNORE, not application faults).
"""

from __future__ import annotations

import hashlib
import shlex
from datetime import datetime, timezone
from typing import Any

from xidstream.schemas.base import plain_text
from xidstream.schemas.models import Alert, Evidence, EvidenceEntry, RemediationCommand
from xidstream.schemas.vocab import Action, Classification, Severity
from xidstream.schemas.xid_catalog import lookup
from xidstream.streams.evidence import GpuState, sample_stats
from xidstream.streams.incident import Incident
from xidstream.streams.policy import Policy

__all__ = ["SEVERITY", "PRECONDITIONS", "STEP_TEXT", "hid", "dt", "describe_xid", "app_xid_verdict_text",
           "command", "alert"]

UTC = timezone.utc
# A command's reason is signed, then written into Node annotations, Events and kured's sentinel.
REASON_LIMIT = 500

SEVERITY = {
    Classification.APP_FAULT: Severity.info,
    Classification.PHANTOM_LOAD: Severity.warning,
    Classification.GPU_DEGRADING: Severity.warning,
    Classification.GPU_SUSPECT: Severity.warning,
    Classification.GPU_WEDGED: Severity.critical,
    Classification.GPU_HARDWARE_FAULT: Severity.critical,
}
PRECONDITIONS = {
    Action.DRAIN_NODE: ["node cordoned", "drain through the cluster's normal process (PodDisruptionBudgets, spare capacity)"],
    Action.RESET_GPU: ["no process on the GPU (compute apps and /dev/nvidia* holders)", "node drained",
                       "maintenance window open"],
    Action.REBOOT_NODE: ["node drained"],
    Action.REPLACE_NODE: ["node drained"],
    Action.RELEASE_GPU: ["GPU healthy (normal samples, no new Xid)"],
    Action.UNCORDON_NODE: ["GPU healthy (normal samples, no new Xid)", "bring work back gradually"],
}
STEP_TEXT = {
    Action.RECORD: "Record the fault with PID, GPU UUID, pod UID and the raw kernel line; let the workload restart itself.",
    Action.QUARANTINE_GPU: "Stop scheduling new work onto this GPU (quarantine it); running work continues.",
    Action.CORDON_NODE: "Cordon the node so nothing new is scheduled on it.",
    Action.DRAIN_NODE: "Drain the GPU workloads through the cluster's normal process (PDBs, spare capacity, change approval); never kill -9 a process holding /dev/nvidia*.",
    Action.RESET_GPU: "When the GPU has no processes and the maintenance window holds: nvidia-smi --gpu-reset -i {index}. Never force-unload the kernel module.",
    Action.REBOOT_NODE: "Reboot the node; afterwards check nvidia-smi, pmon and that the kernel log since boot has no new Xid.",
    Action.REPLACE_NODE: "Replace the node (or the GPU) and open a hardware case with the evidence timeline.",
    Action.RELEASE_GPU: "Release the GPU for scheduling again.",
    Action.UNCORDON_NODE: "Uncordon the node and bring work back gradually, a small share first.",
}


def hid(*parts: Any) -> str:
    """A deterministic id: the same evidence replayed gives the same incident, alert and command ids."""
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()[:24]


def dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def describe_xid(code: int) -> str:
    """``Xid 63 (INFOROM_DRAM_RETIREMENT_EVENT; NVIDIA: IGNORE)``: the catalog's name and resolution."""
    info = lookup(code)
    return f"Xid {code} ({info.name}; NVIDIA: {info.resolution})"


def app_xid_verdict_text(code: int) -> str:
    """What an application-class Xid means, in NVIDIA's terms."""
    resolution = lookup(code).resolution
    if resolution == "RESTART_APP":
        return "application fault (NVIDIA: restart the application), recorded"
    if resolution == "IGNORE":
        return "NVIDIA: no action needed, recorded"
    return f"application-class by the device plugin's list (NVIDIA: {resolution}), recorded"


def command(state: GpuState, inc: Incident, action: Action, ts: float, policy: Policy, reason: str,
            evidence_ids: list[str], rule: dict | None = None) -> RemediationCommand:
    cid = hid(inc.id, inc.next_step(), action.value)
    step = inc.emit(action, cid, ts)
    return RemediationCommand(
        ts=dt(ts), node=state.node, command_id=cid, incident_id=inc.id, gpu_uuid=state.gpu_uuid,
        gpu_index=state.gpu_index, pci_bus_id=state.pci_bus_id, action=action, step=step,
        reason=plain_text(reason, REASON_LIMIT),  # it may quote a node's text (a result's detail)
        preconditions=list(PRECONDITIONS.get(action, [])),
        # Evidence time + TTL, not the processor's clock: a replay decides as live did, and an
        # executor refuses by its own wall clock what arrives too late.
        expires_at=dt(ts + policy.command_ttl_s), requires_approval=False, dry_run=policy.dry_run,
        evidence_ids=list(dict.fromkeys(i for i in evidence_ids if i)), rule=rule,
    )


def _steps_text(state: GpuState, actions: list[str]) -> list[str]:
    # the index ends a command line a person may paste (nvidia-smi --gpu-reset -i N): quoted
    idx = shlex.quote(str(state.gpu_index) if state.gpu_index is not None else "<index>")
    return [STEP_TEXT[Action(a)].format(index=idx) for a in actions]


def alert(state: GpuState, inc: Incident, ts: float, summary: str, alert_state: str) -> Alert:
    """The incident's alert as of `ts`; its rule is the one behind the incident's classification."""
    inc.alerts += 1
    inc.last_alert_at = ts
    cls = Classification(inc.classification)
    counts: dict[str, int] = {}
    pids: list[int] = []
    for x in state.xids:
        if x.get("xid") is not None:
            counts[str(x["xid"])] = counts.get(str(x["xid"]), 0) + 1
        if x.get("pid") is not None and x["pid"] not in pids:
            pids.append(x["pid"])
    pods = sorted({state.pods[str(p)] for p in pids if str(p) in state.pods} |
                  {w["pod_uid"] for w in state.workload_failures if w.get("pod_uid")})
    evidence = Evidence(
        node=state.node, gpu_uuid=state.gpu_uuid, gpu_index=state.gpu_index, pci_bus_id=state.pci_bus_id,
        timeline=[EvidenceEntry(ts=dt(e["ts"]), kind=e["kind"], summary=e["summary"], data=e["data"]) for e in inc.timeline],
        sample_stats=inc.sample_stats or sample_stats(state), xid_counts=counts, distinct_pids=pids, pod_uids=pods,
    )
    steps = _steps_text(state, list(dict.fromkeys(e["action"] for e in inc.emitted)) or inc.plan)
    if inc.recommendation:
        steps.append(inc.recommendation)
    return Alert(
        ts=dt(ts), node=state.node, alert_id=hid(inc.id, "alert", inc.alerts), incident_id=inc.id,
        gpu_uuid=state.gpu_uuid, pci_bus_id=state.pci_bus_id, classification=cls, severity=SEVERITY[cls],
        state=alert_state, summary=summary, evidence=evidence, recommended_steps=steps, rule=inc.rule,
    )
