"""Classification as a fold: ``step(state, record, policy) -> (state, outputs, changed)``.

Pure: no faust, no clock, no I/O. Time is the records' own `ts` (event time), so a replay or a
backfill gives the same verdicts as live traffic. One `GpuState` per input key (a GPU UUID, or
``node/pci`` for an Xid whose GPU the collector could not resolve).

Verdicts (issue 4, after ../shared/reference/incident.md "The escalation policy"):

- APP_FAULT (info): an application-class Xid *occurrence* (lines from one PID within
  `burst_seconds` count once). RECORD only.
- GPU_SUSPECT (warning): >= 3 occurrences in 10 min, or >= 2 distinct PIDs in 10 min, or pinned
  utilization with no compute after an app-class Xid but no Xid 43. QUARANTINE_GPU.
- GPU_WEDGED (critical): Xid 43 in the last 30 min, and >= 60 s of samples at >= 95% utilization
  with <= 1% memory used, every process snapshot in that time without a compute app.
  CORDON_NODE, DRAIN_NODE, RESET_GPU; a failed reset -> REBOOT_NODE -> REPLACE_NODE.
- GPU_HARDWARE_FAULT (critical): by NVIDIA's resolution (streams.hardware), or NVML lost /
  reset_required.
- PHANTOM_LOAD (warning): pinned with no compute app and no Xid at all. RECORD only.

A single application-class Xid never leads to a node-level action, whatever the policy says:
`_guard_node_actions` checks the evidence itself, not the thresholds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from schemas.models import (
    Alert,
    Evidence,
    EvidenceEntry,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    RemediationCommand,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
)
from schemas.base import Record
from schemas.vocab import NODE_ACTIONS, Action, Classification, Severity
from streams.hardware import QUARANTINE, REBOOT, RECORD, RESET, remedy_for_xid
from streams.policy import Policy

__all__ = ["GpuState", "step", "Output", "RANK", "PLANS"]

UTC = timezone.utc

RANK = {
    Classification.APP_FAULT: 1,
    Classification.PHANTOM_LOAD: 2,
    Classification.GPU_SUSPECT: 3,
    Classification.GPU_WEDGED: 4,
    Classification.GPU_HARDWARE_FAULT: 4,
}
SEVERITY = {
    Classification.APP_FAULT: Severity.info,
    Classification.PHANTOM_LOAD: Severity.warning,
    Classification.GPU_SUSPECT: Severity.warning,
    Classification.GPU_WEDGED: Severity.critical,
    Classification.GPU_HARDWARE_FAULT: Severity.critical,
}
PLANS = {
    RECORD: [Action.RECORD],
    QUARANTINE: [Action.QUARANTINE_GPU],
    RESET: [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU],
    REBOOT: [Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE],
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
# Node-level actions need evidence beyond application-class Xids: this floor on the pinned
# evidence is not a policy setting (issue 4: "whatever else is configured").
GUARD_MIN_PINNED_SAMPLES = 2
GUARD_MIN_PINNED_SPAN_S = 10.0

Output = tuple[str, Record]  # ("alert" | "command", record)


def _ts(dt: datetime) -> float:
    return dt.timestamp()


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _hid(*parts: Any) -> str:
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()[:24]


@dataclass(slots=True)
class GpuState:
    key: str
    node: str = ""
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None
    gpu_index: int | None = None
    memory_total_mib: float | None = None
    status: str = "ok"
    pinned_since: float | None = None
    pinned_samples: int = 0
    pinned_last: float | None = None
    pin_stats: dict = field(default_factory=dict)
    proc_snapshots: int = 0  # snapshots since pinned_since
    last_processes: dict | None = None
    occurrences: list = field(default_factory=list)
    xids: list = field(default_factory=list)
    workload_failures: list = field(default_factory=list)
    healthy_since: float | None = None
    last_xid_ts: float | None = None
    incident: dict | None = None
    announced: bool = False
    resolved_incidents: int = 0
    pending_notes: list = field(default_factory=list)  # evidence seen before an incident opened
    last_sample_ts: float | None = None
    last_compute_ts: float | None = None  # newest process snapshot that had a compute app
    last_nocompute_ts: float | None = None  # newest process snapshot that had none

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in _STATE_FIELDS}

    @classmethod
    def from_dict(cls, data: dict) -> "GpuState":
        return cls(**{k: v for k, v in data.items() if k in _STATE_FIELDS})


_STATE_FIELDS = tuple(GpuState.__dataclass_fields__)


# -- evidence helpers ---------------------------------------------------------------------------
def _pod_of(state: GpuState, pid: int | None) -> str | None:
    if pid is None or not state.last_processes:
        return None
    for app in state.last_processes.get("compute", []):
        if app.get("pid") == pid:
            return app.get("pod_uid")
    return None


def _entry(ts: float, kind: str, summary: str, **data: Any) -> dict:
    return {"ts": ts, "kind": kind, "summary": summary, "data": data}


def _note(state: GpuState, entry: dict, policy: Policy) -> None:
    inc = state.incident
    if inc is None:
        return
    tl = inc["timeline"]
    tl.append(entry)
    if len(tl) > policy.evidence_limit:
        # keep how it started and how it is going
        del tl[10: len(tl) - policy.evidence_limit + 10]


def _sample_stats(state: GpuState) -> dict:
    s = state.pin_stats
    if not s:
        return {}
    out = {
        "pinned_seconds": round((state.pinned_last or 0) - (state.pinned_since or 0), 1),
        "samples": state.pinned_samples,
        "utilization_gpu_pct_min": s.get("util_min"),
        "memory_used_mib_max": s.get("mem_max"),
        "power_w_avg": round(s["power_sum"] / s["power_n"], 1) if s.get("power_n") else None,
        "sm_clock_mhz_max": s.get("sm_max"),
        "mem_clock_mhz_max": s.get("memclk_max"),
        "process_snapshots_without_compute": state.proc_snapshots,
        "seconds_without_compute": round((state.pinned_last or 0) - (_nocompute_start(state) or state.pinned_last or 0), 1),
    }
    return out


# -- commands and alerts ------------------------------------------------------------------------
def _command(state: GpuState, inc: dict, action: Action, ts: float, policy: Policy, reason: str) -> RemediationCommand:
    step_no = len(inc["emitted"])
    cid = _hid(inc["id"], step_no, action.value)
    inc["emitted"].append({"step": step_no, "action": action.value, "command_id": cid, "ts": ts})
    pre = list(PRECONDITIONS.get(action, []))
    return RemediationCommand(
        ts=_dt(ts), node=state.node, command_id=cid, incident_id=inc["id"], gpu_uuid=state.gpu_uuid,
        gpu_index=state.gpu_index, action=action, step=step_no, reason=reason, preconditions=pre,
        expires_at=_dt(ts + policy.command_ttl_s), requires_approval=False, dry_run=policy.dry_run,
    )


def _steps_text(state: GpuState, actions: list[str]) -> list[str]:
    idx = state.gpu_index if state.gpu_index is not None else "<index>"
    return [STEP_TEXT[Action(a)].format(index=idx) for a in actions]


def _alert(state: GpuState, inc: dict, ts: float, summary: str, alert_state: str, policy: Policy) -> Alert:
    inc["alerts"] += 1
    inc["last_alert_at"] = ts
    cls = Classification(inc["classification"])
    counts: dict[str, int] = {}
    pids: list[int] = []
    for x in state.xids:
        if x.get("xid") is not None:
            counts[str(x["xid"])] = counts.get(str(x["xid"]), 0) + 1
        if x.get("pid") is not None and x["pid"] not in pids:
            pids.append(x["pid"])
    pods = sorted({p for p in (_pod_of(state, pid) for pid in pids) if p} |
                  {w["pod_uid"] for w in state.workload_failures if w.get("pod_uid")})
    evidence = Evidence(
        node=state.node, gpu_uuid=state.gpu_uuid, gpu_index=state.gpu_index, pci_bus_id=state.pci_bus_id,
        timeline=[EvidenceEntry(ts=_dt(e["ts"]), kind=e["kind"], summary=e["summary"], data=e["data"]) for e in inc["timeline"]],
        sample_stats=inc.get("sample_stats") or _sample_stats(state), xid_counts=counts, distinct_pids=pids, pod_uids=pods,
    )
    steps = _steps_text(state, [e["action"] for e in inc["emitted"]] or inc["plan"])
    if inc.get("recommendation"):
        steps.append(inc["recommendation"])
    return Alert(
        ts=_dt(ts), node=state.node, alert_id=_hid(inc["id"], "alert", inc["alerts"]), incident_id=inc["id"],
        gpu_uuid=state.gpu_uuid, pci_bus_id=state.pci_bus_id, classification=cls, severity=SEVERITY[cls],
        state=alert_state, summary=summary, evidence=evidence, recommended_steps=steps,
    )


def _nocompute_start(state: GpuState) -> float | None:
    """Start of the current pinned run without a compute app in any process snapshot, or None.

    Built from maxima (newest snapshot with / without compute), so it does not depend on the order
    in which the samples and process topics were read."""
    if state.pinned_since is None:
        return None
    start = state.pinned_since
    if state.last_compute_ts is not None and state.last_compute_ts >= start:
        start = state.last_compute_ts
    if state.last_nocompute_ts is None or state.last_nocompute_ts <= start:
        return None
    return start


def _has_node_evidence(state: GpuState, inc: dict) -> bool:
    """Evidence that is not an application-class Xid: hardware Xids, NVML lost/reset, or a
    sustained pinned state without compute."""
    if inc.get("hardware"):
        return True
    start = _nocompute_start(state)
    return (start is not None and state.pinned_samples >= GUARD_MIN_PINNED_SAMPLES
            and (state.pinned_last or 0) - start >= GUARD_MIN_PINNED_SPAN_S)


def _raise(state: GpuState, cls: Classification, ts: float, summary: str, remedy: str, policy: Policy,
           outputs: list, *, hardware: bool = False, recommendation: str | None = None,
           entry: dict | None = None) -> None:
    """Open an incident, or escalate/update the open one, and emit what it newly needs."""
    inc = state.incident
    plan = [a.value for a in PLANS[remedy]]
    if remedy == RESET and state.gpu_uuid is None:
        # Without a GPU identity a GPU reset cannot be aimed: downgrade to the node (NVSentinel).
        plan = [Action.CORDON_NODE.value, Action.DRAIN_NODE.value, Action.REBOOT_NODE.value]
    if inc is None:
        inc = state.incident = {
            "id": _hid(state.key, ts, cls.value), "classification": cls.value, "opened_at": ts, "plan": plan,
            "emitted": [], "timeline": [], "alerts": 0, "last_alert_at": None, "hardware": hardware,
            "remedy": remedy, "remediated": False, "reboot_ok_at": None, "reset_ok_at": None,
            "recommendation": recommendation, "sample_stats": None, "closing": False,
        }
        for note in state.pending_notes:
            _note(state, note, policy)
        state.pending_notes = []
        if entry:
            _note(state, entry, policy)
        alert_state = "open"
    else:
        inc["hardware"] = inc["hardware"] or hardware
        if recommendation:
            inc["recommendation"] = recommendation
        old = Classification(inc["classification"])
        escalates = RANK[cls] > RANK[old] or (RANK[cls] == RANK[old] and cls != old) or \
            (cls == old and remedy == REBOOT and inc["remedy"] == RESET)
        if escalates:
            inc["classification"] = cls.value
            inc["remedy"] = remedy
            for a in plan:
                if a not in inc["plan"]:
                    inc["plan"].append(a)
        elif cls == Classification.APP_FAULT and remedy == RECORD:
            pass  # every new application-fault occurrence is recorded
        else:
            return  # the same verdict again, or a lesser one: the open incident already says it
        if entry:
            _note(state, entry, policy)
        alert_state = "updated"
    if cls in (Classification.GPU_WEDGED, Classification.PHANTOM_LOAD):
        inc["sample_stats"] = _sample_stats(state)
    emitted = {e["action"] for e in inc["emitted"]}
    new_actions = [Action(a) for a in plan if a not in emitted or a == Action.RECORD.value]
    if any(a in NODE_ACTIONS or a == Action.RESET_GPU for a in new_actions) and not _has_node_evidence(state, inc):
        new_actions = [a for a in new_actions if a not in NODE_ACTIONS and a != Action.RESET_GPU]
    commands = [_command(state, inc, a, ts, policy, summary) for a in new_actions]
    quiet = (alert_state == "updated" and not any(a != Action.RECORD for a in new_actions)
             and inc["last_alert_at"] is not None and ts - inc["last_alert_at"] < policy.alert_cooldown_s)
    if not quiet:
        outputs.append(("alert", _alert(state, inc, ts, summary, alert_state, policy)))
    outputs.extend(("command", c) for c in commands)


# -- the fold -----------------------------------------------------------------------------------
def step(state: GpuState | None, key: str, record: Record, policy: Policy) -> tuple[GpuState, list[Output], bool]:
    """Fold one record into the GPU's state; return the new state, the outputs, and whether
    the state changed in a way worth persisting."""
    if state is None:
        state = GpuState(key=key)
    before = _material(state)
    outputs: list[Output] = []
    ts = _ts(record.ts)
    state.node = record.node or state.node
    uuid = getattr(record, "gpu_uuid", None)
    if uuid and not state.gpu_uuid and not key.count("/"):
        state.gpu_uuid = uuid
    pci = getattr(record, "pci_bus_id", None)
    if pci:
        state.pci_bus_id = pci
    if getattr(record, "gpu_index", None) is not None:
        state.gpu_index = record.gpu_index  # type: ignore[attr-defined]
    if isinstance(record, GpuSample):
        _on_sample(state, record, ts, policy, outputs)
    elif isinstance(record, GpuProcesses):
        _on_processes(state, record, ts, policy, outputs)
    elif isinstance(record, XidEvent):
        _on_xid(state, record, ts, policy, outputs)
        if state.pinned_since is not None and state.pinned_last is not None and state.pinned_last > ts:
            # Samples after this Xid were read first (topics are read in parallel): decide now.
            _check_pinned(state, state.pinned_last, policy, outputs)
    elif isinstance(record, WorkloadEvent):
        _on_workload(state, record, ts, policy, outputs)
    elif isinstance(record, GpuInventory):
        state.memory_total_mib = record.memory_total_mib or state.memory_total_mib
    elif isinstance(record, RemediationResult):
        _on_result(state, record, ts, policy, outputs)
    changed = bool(outputs) or _material(state) != before
    return state, outputs, changed


def _material(state: GpuState) -> tuple:
    """What must survive a restart; counters that only feed statistics are left out."""
    inc = state.incident
    return (
        state.node, state.gpu_uuid, state.pci_bus_id, state.gpu_index, state.memory_total_mib, state.status,
        state.pinned_since, min(state.pinned_samples, GUARD_MIN_PINNED_SAMPLES),
        state.pinned_since is not None and state.last_compute_ts is not None and state.last_compute_ts >= state.pinned_since,
        state.last_nocompute_ts is not None and state.pinned_since is not None
        and state.last_nocompute_ts > state.pinned_since, len(state.occurrences), len(state.xids), len(state.workload_failures),
        state.healthy_since is None, state.last_xid_ts, state.announced,
        None if inc is None else (inc["id"], inc["classification"], len(inc["emitted"]), len(inc["timeline"]),
                                  inc["remediated"], inc["closing"]),
    )


def _prune(state: GpuState, ts: float, policy: Policy) -> None:
    keep = max(policy.app_xid_lookback_s, policy.wedged_xid43_lookback_s, policy.suspect_window_s)
    state.occurrences = [o for o in state.occurrences if ts - o["last_ts"] <= keep]
    state.xids = [x for x in state.xids if ts - x["ts"] <= keep][-200:]
    state.workload_failures = [w for w in state.workload_failures if ts - w["ts"] <= policy.workload_failure_lookback_s]


def _on_sample(state: GpuState, s: GpuSample, ts: float, policy: Policy, outputs: list) -> None:
    state.last_sample_ts = max(ts, state.last_sample_ts or ts)
    if s.memory_total_mib:
        state.memory_total_mib = s.memory_total_mib
    status = s.status.value
    if status in ("lost", "reset_required") and state.status != status:
        state.status = status
        remedy = REBOOT if status == "lost" else RESET
        what = "GPU is lost (NVML_ERROR_GPU_IS_LOST)" if status == "lost" else "GPU requires a reset (NVML_ERROR_RESET_REQUIRED)"
        state.healthy_since = None
        _raise(state, Classification.GPU_HARDWARE_FAULT, ts, f"GPU {state.gpu_index} on {state.node}: {what}",
               remedy, policy, outputs, hardware=True, entry=_entry(ts, "sample", what, status=status, error=s.error))
        return
    if status != "ok":
        state.status = status
        return
    state.status = "ok"
    util, mem = s.utilization_gpu_pct, s.memory_used_mib
    total = s.memory_total_mib or state.memory_total_mib
    pinned = (util is not None and util >= policy.pinned_util_pct and mem is not None and total
              and mem <= policy.pinned_mem_fraction * total)
    if pinned:
        if state.pinned_since is None:
            state.pinned_since, state.pinned_samples, state.proc_snapshots, state.pin_stats = ts, 0, 0, {}
        state.pinned_samples += 1
        state.pinned_last = ts
        st = state.pin_stats
        st["util_min"] = min(st.get("util_min", 100.0), util)
        st["mem_max"] = max(st.get("mem_max", 0.0), mem)
        if s.power_w is not None:
            st["power_sum"] = st.get("power_sum", 0.0) + s.power_w
            st["power_n"] = st.get("power_n", 0) + 1
        if s.sm_clock_mhz is not None:
            st["sm_max"] = max(st.get("sm_max", 0), s.sm_clock_mhz)
        if s.mem_clock_mhz is not None:
            st["memclk_max"] = max(st.get("memclk_max", 0), s.mem_clock_mhz)
        state.healthy_since = None
        _check_pinned(state, ts, policy, outputs)
    else:
        state.pinned_since = None
        state.pinned_samples = 0
        if not pinned and state.healthy_since is None:
            state.healthy_since = ts
        _check_resolved(state, ts, policy, outputs)


def _check_pinned(state: GpuState, ts: float, policy: Policy, outputs: list) -> None:
    start = _nocompute_start(state)
    if start is None or ts - start < policy.pinned_seconds:
        return
    _prune(state, ts, policy)
    secs = ts - start
    x43 = [x for x in state.xids if x.get("xid") == 43 and ts - x["ts"] <= policy.wedged_xid43_lookback_s]
    app = [x for x in state.xids if x.get("app") and ts - x["ts"] <= policy.app_xid_lookback_s]
    failures = [w for w in state.workload_failures if w["ts"] >= (x43[0]["ts"] if x43 else 0)]
    util = state.pin_stats.get("util_min")
    base = (f"GPU {state.gpu_index} ({state.gpu_uuid}) on {state.node}: utilization >= {util:.0f}% with "
            f"{state.pin_stats.get('mem_max', 0):.0f} MiB used and no compute process for {secs:.0f} s")
    if x43:
        if policy.wedged_requires_workload_failure and not failures:
            return
        inc = state.incident
        if inc is not None and inc.get("reboot_ok_at") is not None and start > inc["reboot_ok_at"]:
            _climb(state, inc, ts, Action.REPLACE_NODE, f"GPU {state.gpu_index} wedged again after the node reboot", policy, outputs)
            return
        if inc is not None and inc.get("reset_ok_at") is not None and start > inc["reset_ok_at"]:
            _climb(state, inc, ts, Action.REBOOT_NODE, f"GPU {state.gpu_index} wedged again after the GPU reset", policy, outputs)
            return
        summary = (f"{base} after Xid 43 at {_dt(x43[-1]['ts']).strftime('%H:%M:%S')}Z: GPU context wedged"
                   + (f"; {len(failures)} later workload failure(s)" if failures else ""))
        _raise(state, Classification.GPU_WEDGED, ts, summary, RESET, policy, outputs,
               entry=_entry(ts, "sample_stats", f"pinned {secs:.0f} s without compute", **_sample_stats(state)))
    elif app:
        _raise(state, Classification.GPU_SUSPECT, ts, f"{base} after application-class Xid {app[-1]['xid']} (no Xid 43)",
               QUARANTINE, policy, outputs,
               entry=_entry(ts, "sample_stats", f"pinned {secs:.0f} s without compute", **_sample_stats(state)))
    elif not state.xids:
        _raise(state, Classification.PHANTOM_LOAD, ts, f"{base} and no Xid: phantom load", RECORD, policy, outputs,
               entry=_entry(ts, "sample_stats", f"pinned {secs:.0f} s without compute", **_sample_stats(state)))


def _on_processes(state: GpuState, p: GpuProcesses, ts: float, policy: Policy, outputs: list) -> None:
    # Topics are read in parallel: a snapshot may arrive after samples newer than it. Keep maxima
    # (newest snapshot with and without a compute app), which do not care about arrival order.
    compute = p.compute_apps
    if state.last_processes is None or ts >= state.last_processes["ts"]:
        # Kept small (it is in every GPU's table row): who computes, and how many merely hold the device.
        state.last_processes = {
            "ts": ts, "compute": [{"pid": a.pid, "process_name": a.process_name, "pod_uid": a.pod_uid} for a in p.compute_apps],
            "pmon": len(p.pmon), "holders": len(p.device_holders),
        }
    if compute:
        # A process NVML registered as compute: it is probably really running (incident.md).
        state.last_compute_ts = max(ts, state.last_compute_ts or ts)
    else:
        state.last_nocompute_ts = max(ts, state.last_nocompute_ts or ts)
        if state.pinned_since is not None and ts >= state.pinned_since:
            state.proc_snapshots += 1
    if state.pinned_last is not None:
        _check_pinned(state, state.pinned_last, policy, outputs)


def _on_workload(state: GpuState, w: WorkloadEvent, ts: float, policy: Policy, outputs: list) -> None:
    if w.event.value not in ("failed", "restarted"):
        return
    item = {"ts": ts, "pod_uid": w.pod_uid, "pod": w.pod, "namespace": w.namespace, "reason": w.reason,
            "exit_code": w.exit_code, "event": w.event.value}
    state.workload_failures.append(item)
    _prune(state, ts, policy)
    entry = _entry(ts, "workload", f"pod {w.namespace}/{w.pod} {w.event.value} ({w.reason}, exit {w.exit_code})",
                   **{k: v for k, v in item.items() if k != "ts"})
    if state.incident is not None:
        _note(state, entry, policy)
    if policy.wedged_requires_workload_failure and state.pinned_last is not None:
        _check_pinned(state, state.pinned_last, policy, outputs)


def _on_xid(state: GpuState, x: XidEvent, ts: float, policy: Policy, outputs: list) -> None:
    kind = x.kind.value
    pod = _pod_of(state, x.pid)
    if kind in ("gpu_identity", "gsp_rate_limit", "sxid"):
        if kind == "gsp_rate_limit" and state.incident is not None:
            _note(state, _entry(ts, "note", "driver rate-limits GSP RPC error prints: later Xid counts are undercounted", raw=x.raw), policy)
        return
    state.healthy_since = None
    state.last_xid_ts = ts
    if kind == "recovery_failure":
        state.xids.append({"ts": ts, "xid": None, "kind": kind, "pid": None, "app": False})
        entry = _entry(ts, "xid", f"driver failed to recover the GPU: {x.message}", raw=x.raw)
        if state.incident is not None:
            _note(state, entry, policy)
        else:
            state.pending_notes = (state.pending_notes + [entry])[-5:]
        return
    if kind == "fallen_off_bus":
        state.xids.append({"ts": ts, "xid": 79, "kind": kind, "pid": None, "app": False})
        _raise(state, Classification.GPU_HARDWARE_FAULT, ts, f"GPU on {state.node} ({x.pci_bus_id}) has fallen off the bus",
               REBOOT, policy, outputs, hardware=True, entry=_entry(ts, "xid", "GPU has fallen off the bus", raw=x.raw))
        return
    if x.xid is None:
        return
    app = policy.is_app_class(x.xid)
    state.xids.append({"ts": ts, "xid": x.xid, "kind": kind, "pid": x.pid, "app": app})
    _prune(state, ts, policy)
    entry = _entry(ts, "xid", f"Xid {x.xid} {x.xid_name or ''} pid={x.pid} name={x.process_name}",
                   xid=x.xid, name=x.xid_name, pid=x.pid, process_name=x.process_name, pod_uid=pod,
                   raw=x.raw, sources=[s.value for s in x.sources] or [x.source.value])
    inc = state.incident
    if inc is not None and not app and inc.get("reboot_ok_at") is not None and ts > inc["reboot_ok_at"]:
        # A GPU-level Xid persisting after the reboot: the last rung. (An application's Xid after
        # the reboot is that application's, and goes the usual way.)
        _note(state, entry, policy)
        _climb(state, inc, ts, Action.REPLACE_NODE, f"Xid {x.xid} on GPU {state.gpu_index} after the node was rebooted", policy, outputs)
        return
    if not app:
        remedy, resolution, why = remedy_for_xid(x.xid, x.message)
        if remedy == RECORD:
            if inc is not None:
                _note(state, entry, policy)
            return
        if inc is not None and inc.get("reset_ok_at") is not None and ts > inc["reset_ok_at"] and remedy == RESET:
            _note(state, entry, policy)
            _climb(state, inc, ts, Action.REBOOT_NODE, f"Xid {x.xid} again after the GPU reset", policy, outputs)
            return
        rec = ("Open an NVIDIA support case with this evidence (nvidia-bug-report.sh)"
               if remedy == QUARANTINE else None)
        _raise(state, Classification.GPU_HARDWARE_FAULT, ts,
               f"Xid {x.xid} ({x.xid_name}) on GPU {state.gpu_index} ({state.gpu_uuid or x.pci_bus_id}) on {state.node}: {why}",
               remedy, policy, outputs, hardware=True, recommendation=rec, entry=entry)
        return
    # application class: collapse bursts into occurrences
    occ = None
    for o in reversed(state.occurrences):
        if ts - o["ts"] <= policy.burst_seconds and (o["pid"] == x.pid or o["pid"] is None or x.pid is None):
            occ = o
            break
    if occ is not None:
        occ["last_ts"] = ts
        if x.xid not in occ["codes"]:
            occ["codes"].append(x.xid)
        if occ["pid"] is None:
            occ["pid"] = x.pid
        _note(state, entry, policy)
        return
    state.occurrences.append({"ts": ts, "last_ts": ts, "pid": x.pid, "codes": [x.xid], "pod": pod})
    recent = [o for o in state.occurrences if ts - o["ts"] <= policy.suspect_window_s]
    pids = {o["pid"] for o in recent if o["pid"] is not None}
    who = f"pid {x.pid} ({x.process_name})" if x.pid is not None else "an unknown process"
    _raise(state, Classification.APP_FAULT, ts,
           f"Xid {x.xid} ({x.xid_name}) from {who} on GPU {state.gpu_index} on {state.node}: application fault, recorded",
           RECORD, policy, outputs, entry=entry)
    if len(recent) >= policy.suspect_occurrences or len(pids) >= policy.suspect_distinct_pids:
        why = (f"{len(recent)} application-class Xid occurrences" if len(recent) >= policy.suspect_occurrences
               else f"{len(pids)} different processes ({', '.join(str(p) for p in sorted(pids))}) faulted it")
        _raise(state, Classification.GPU_SUSPECT, ts,
               f"GPU {state.gpu_index} ({state.gpu_uuid}) on {state.node}: {why} within "
               f"{policy.suspect_window_s / 60:.0f} min: stop scheduling onto it", QUARANTINE, policy, outputs)


def _climb(state: GpuState, inc: dict, ts: float, action: Action, why: str, policy: Policy, outputs: list) -> None:
    if any(e["action"] == action.value for e in inc["emitted"]):
        return
    if action in NODE_ACTIONS and not inc.get("hardware") and not _has_node_evidence(state, inc) \
            and Classification(inc["classification"]) not in (Classification.GPU_WEDGED, Classification.GPU_HARDWARE_FAULT):
        return
    inc["plan"].append(action.value)
    _note(state, _entry(ts, "remediation", f"next rung: {action.value}: {why}"), policy)
    cmd = _command(state, inc, action, ts, policy, why)
    outputs.append(("alert", _alert(state, inc, ts, f"{why}: {action.value}", "updated", policy)))
    outputs.append(("command", cmd))


def _on_result(state: GpuState, r: RemediationResult, ts: float, policy: Policy, outputs: list) -> None:
    inc = state.incident
    if inc is None:
        return
    outcome, action = r.outcome.value, r.action
    _note(state, _entry(ts, "remediation", f"{action.value} {outcome}" + (f": {r.detail}" if r.detail else ""),
                        command_id=r.command_id, action=action.value, outcome=outcome, detail=r.detail), policy)
    if outcome == "succeeded":
        if action in (Action.RESET_GPU, Action.REBOOT_NODE, Action.REPLACE_NODE):
            inc["remediated"] = True
            inc["reset_ok_at" if action == Action.RESET_GPU else "reboot_ok_at"] = ts
            # Healthy time counts from the repair; samples already read after it still count.
            if state.pinned_since is not None and (state.pinned_last or 0) <= ts:
                state.pinned_since = None
            if state.healthy_since is not None and state.healthy_since < ts:
                state.healthy_since = ts if (state.last_sample_ts or 0) >= ts else None
            if state.last_sample_ts is not None:
                _check_resolved(state, state.last_sample_ts, policy, outputs)
        return
    if outcome == "failed":
        if action == Action.RESET_GPU:
            _climb(state, inc, ts, Action.REBOOT_NODE, f"GPU reset failed ({r.detail or 'no detail'})", policy, outputs)
            return
        if action == Action.REBOOT_NODE:
            _climb(state, inc, ts, Action.REPLACE_NODE, f"node reboot failed ({r.detail or 'no detail'})", policy, outputs)
            return
    # refused, expired, or another step failed: report it, never drop it silently
    outputs.append(("alert", _alert(state, inc, ts,
                                    f"{action.value} {outcome} on {state.node}" + (f": {r.detail}" if r.detail else "")
                                    + "; operator attention needed", "updated", policy)))


def _check_resolved(state: GpuState, ts: float, policy: Policy, outputs: list) -> None:
    inc = state.incident
    if inc is None or state.healthy_since is None or ts - state.healthy_since < policy.resolve_after_s:
        return
    if state.last_xid_ts is not None and ts - state.last_xid_ts < policy.resolve_after_s:
        return
    cls = Classification(inc["classification"])
    if cls in (Classification.GPU_WEDGED, Classification.GPU_HARDWARE_FAULT) and not inc["remediated"]:
        return
    emitted = {e["action"] for e in inc["emitted"]}
    closing = []
    if Action.CORDON_NODE.value in emitted:
        closing.append(Action.UNCORDON_NODE)
    if Action.QUARANTINE_GPU.value in emitted:
        closing.append(Action.RELEASE_GPU)
    _note(state, _entry(ts, "note", f"healthy for {ts - state.healthy_since:.0f} s with no new Xid: resolved"), policy)
    outputs.append(("alert", _alert(state, inc, ts, f"GPU {state.gpu_index} on {state.node} healthy again: incident resolved",
                                    "resolved", policy)))
    for a in closing:
        outputs.append(("command", _command(state, inc, a, ts, policy, "incident resolved")))
    state.incident = None
    state.resolved_incidents += 1
    state.occurrences = []
    state.xids = []
    state.workload_failures = []


