"""Classification as a fold: ``step(state, key, record, policy) -> (state, outputs, changed)``.

Pure: no faust, no clock, no I/O. Time is the records' own `ts` (event time), bounded by the GPU's
clock (streams.evidence), so a replay or a backfill gives the same verdicts as live traffic.

The fold has four parts, one module each:
- `xidstream.streams.evidence`: the per-GPU facts (`GpuState`), folded by event time;
- `xidstream.streams.verdict`: the rules, facts -> verdict and plan (the verdict table is there and in the
  README);
- `xidstream.streams.incident`: the typed incident, its ladder that only climbs, results matched to commands;
- `xidstream.streams.render`: alert text, evidence and command records.
This module wires them: each record updates the facts, asks the rules, and opens, escalates or
resolves the incident through `_raise`, `_climb` and `_check_resolved`.

The guard is absolute: a node-level action (cordon, drain, reset, reboot, replace) needs evidence
that is not an application-class Xid (NVIDIA's hardware resolution, NVML lost / reset required /
recovery action, or a sustained pinned state without compute); `_guard_allows` checks the
evidence itself, never the policy's thresholds.
"""

from __future__ import annotations

import sys
import zlib

from xidstream.schemas.base import Record
from xidstream.schemas.models import (
    GpuCounters,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
)
from xidstream.schemas.vocab import NODE_ACTIONS, Action, Classification, SampleStatus
from xidstream.streams.evidence import (
    EMPTY_DICT,
    EMPTY_LIST,
    GpuState,
    added,
    entry,
    event_time,
    fold_processes,
    fold_sample_pin,
    fold_workload,
    name_by_deaths,
    pending,
    prune,
    sample_stats,
    sustained_pin,
    workload_of,
)
from xidstream.streams.degrade import degrading_now, fold_counters, note_gap
from xidstream.streams.hardware import QUARANTINE, REBOOT, RECORD, RESET
from xidstream.streams.incident import Incident
from xidstream.streams.repair import REPAIR_ACTIONS, answer_milestones, reached, step_time
from xidstream.streams.policy import Policy, is_app_class
from xidstream.streams.render import alert, command, describe_xid, dt, hid
from xidstream.streams import rules as R
from xidstream.streams.rules import facts, rule_ref
from xidstream.streams.verdict import (
    PLANS,
    PSHC_DISENGAGED,
    PSHC_REENGAGED,
    RANK,
    XID45,
    Verdict,
    app_occurrence_verdict,
    cancelled_disengagement,
    hardware_xid_verdict,
    pinned_verdicts,
    recovery_action_verdict,
    earliest_suspect,
    reengaged_by,
    remap_failure_verdict,
    workload_label,
)

__all__ = ["GpuState", "step", "Output", "RANK", "PLANS"]

Output = tuple[str, object]  # ("alert" | "command" | "workload_fault", record or dict)

_DISRUPTIVE = NODE_ACTIONS | {Action.RESET_GPU}
# Incidents whose closing steps are kept until answered (streams.classify._on_closing_result).
_CLOSING_KEPT = 4
# A resolution is stamped when it held, at most this long before the sample that showed it; the
# closing steps' TTL (command_ttl_s, 15 min by default) outlives it.
RESOLVE_STAMP_SLACK_S = 300.0
# How an executor's dry-run answer begins (executors.gate DRY_RUN_PREFIX, "dry run: would ...").
DRY_RUN = "dry run"
_DEGRADING = Classification.GPU_DEGRADING.value
_OWN_CLOCK = frozenset({GpuSample, GpuProcesses, GpuInventory})
_STATUS = {m: m.value for m in SampleStatus}


# -- the fold -----------------------------------------------------------------------------------
def step(state: GpuState | None, key: str, record: Record, policy: Policy) -> tuple[GpuState, list[Output], bool]:
    """Fold one record into the GPU's state; return the new state, the outputs, and whether
    the state changed in a way worth persisting."""
    if state is None:
        state = GpuState(key=key)
    before = state.material
    if before is None:  # a row just loaded or made: nothing folded into it here yet
        before = _material(state)
    outputs: list[Output] = []
    kind = type(record)
    own = kind in _OWN_CLOCK
    # a fault no process list named waits on the GPU's clock (evidence.settled): read before it moves
    waiting = own and bool(state.occurrences) and pending(state)
    ts = record.ts.timestamp()
    skew = 0.0
    if own:  # the common case, inlined: the collector's readings move the clock
        clock = state.clock
        if clock is None or ts > clock:
            state.clock = ts
        elif ts == clock:
            # The sample and the process list of one reading share a time: the row keeps one float
            # object for all its stamps of it, not one per record (memory per GPU).
            ts = clock
        state.sampled = True
    else:
        observed = getattr(record, "observed_at", None)
        live = observed is not None and not getattr(record, "backfilled", False)
        ts, skew = event_time(state, ts, False, policy, observed.timestamp() if live else None)
    # A row keeps the strings it has while a record repeats them, and shares node and PCI names
    # (interned): not a fresh copy from every record, which left the strings of every row
    # scattered over the heap a catch-up had grown (memory per GPU).
    if kind is not RemediationResult:  # a result names a node; the GPU's node is its own
        if record.node and record.node != state.node:
            state.node = sys.intern(record.node)
    if own:  # a sample, process list and inventory all carry these three
        uuid, pci, index = record.gpu_uuid, record.pci_bus_id, record.gpu_index  # type: ignore[union-attr]
    else:
        uuid = getattr(record, "gpu_uuid", None)
        pci = getattr(record, "pci_bus_id", None)
        index = getattr(record, "gpu_index", None)
    if uuid and not state.gpu_uuid and not key.count("/"):
        state.gpu_uuid = key if uuid == key else uuid
    if pci and pci != state.pci_bus_id:
        state.pci_bus_id = sys.intern(pci)
    if index is not None:
        state.gpu_index = index
    if skew:
        against = "when it was read" if getattr(record, "observed_at", None) else "this GPU's clock"
        direction = "ahead of" if skew > 0 else "behind"
        _evidence(state, entry(ts, "note", f"{type(record).__name__} {record.event_id} is stamped "
                               f"{dt(record.ts.timestamp()).isoformat()}, {abs(skew):.0f} s {direction} {against}: "
                               f"taken at {dt(ts).isoformat()}", event_id=record.event_id, skew_s=round(skew, 1)),
                  policy)
    if kind is GpuSample:
        _on_sample(state, record, ts, policy, outputs)
        if waiting:  # the clock moved: a fault no process list named may count now
            _check_suspect(state, policy, outputs)
    elif kind is GpuProcesses:
        last = state.last_sample_ts
        if last is not None and ts - last > policy.degrade_sample_gap_s:
            # the collector publishes this GPU's process lists, not its samples: the first such list
            # of this gap is kept (a later one may be of the reading whose sample ends the gap)
            silent = state.silent_procs_ts
            if silent is None or silent <= last:
                state.silent_procs_ts = ts
        if (fold_processes(state, record, ts, policy) or waiting) and state.occurrences:
            _check_suspect(state, policy, outputs)
        if state.pinned_since is not None:
            _check_pinned(state, policy, outputs)
    elif isinstance(record, XidEvent):
        _on_xid(state, record, ts, policy, outputs)
        if state.pinned_since is not None:
            # Samples after this Xid may have been read first (topics are read in parallel)
            _check_pinned(state, policy, outputs)
    elif isinstance(record, WorkloadEvent):
        _on_workload(state, record, ts, policy, outputs)
        if record.job or record.event.value == "started":  # a new pod without a job clears it
            state.job = record.job and sys.intern(record.job)
    elif isinstance(record, GpuInventory):
        state.memory_total_mib = record.memory_total_mib or state.memory_total_mib
        state.rack = record.rack and sys.intern(record.rack)
        state.driver_version = record.driver_version and sys.intern(record.driver_version)
    elif isinstance(record, RemediationResult):
        _on_result(state, record, ts, policy, outputs)
    elif isinstance(record, GpuCounters):
        _on_counters(state, record, ts, policy, outputs)
    after = state.material = _material(state)
    changed = bool(outputs) or after != before
    return state, outputs, changed


def _phase(key: str) -> int:
    """The second of the minute at which this GPU's persisted minute starts: from its key, the
    same in every process (a replay or a restart writes rows at the same moments)."""
    return zlib.crc32(key.encode()) % 60


_PHASES: dict[str, int] = {}  # key -> _phase(key): two look-ups per record, not two CRCs


def _material(s: GpuState) -> tuple:
    """What must survive a restart; counters that only feed statistics are left out. On the hot
    path (once per record), so it reads little on a quiet GPU: the facts of a pin, and those of
    faults, incidents and closing steps, are each one nested tuple, None while there are none
    (the pure path's speed; a healthy GPU's sample or process list reads 15 fields)."""
    ps = s.pinned_since
    runs = s.proc_runs
    ph = _PHASES.get(s.key)
    if ph is None:
        ph = _PHASES[s.key] = _phase(s.key)
    # the GPU's clock judges skewed stamps: kept to the minute (after a restart a record stamped
    # within a minute of the skew bound may be judged against a clock up to a minute older). Each
    # GPU's minute starts at its own second: on one shared minute every GPU's row changed in the
    # same second, a burst of one changelog record per GPU that stalled the agents behind faust's
    # producer buffer (latency outliers on the minute)
    clock = s.clock
    unpinned = s.last_unpinned_ts
    inc = s.incident
    occ = s.occurrences
    return (
        s.node, s.gpu_uuid, s.pci_bus_id, s.gpu_index, s.memory_total_mib, s.status, s.trends_rev, s.fabric_domain,
        s.rack, s.driver_version, s.job,
        None if clock is None else int((clock + ph) // 60),
        unpinned is not None and int((unpinned + ph) // 60),
        s.healthy_since is None, len(runs), runs[-1][0] if runs else None, s.announced, len(s.pods),
        # While pinned, every fact of the pin is kept exactly: the newest pinned sample and process
        # list read bound when the wedge is decided (evidence.pin_onset), and the evidence shows the
        # pin's counts. A pinned GPU is rare; its row is written at each of its records. (Left out
        # before, a restart decided a wedge a few records late and showed "samples: 4" for 61.)
        None if ps is None else (ps, s.pinned_last, s.procs_ts, s.pinned_samples, s.proc_snapshots,
                                 s.last_compute_ts, s.last_nocompute_ts, runs[-1][2] if runs else None),
        None if not (occ or s.xids or s.workload_failures or s.last_xid_ts is not None or s.pending_notes
                     or s.recovery_action or s.remap_failure or s.closing is not None
                     or s.compute_floor is not None) else (
            len(occ), len(s.xids), len(s.workload_failures), s.last_xid_ts, s.recovery_action, s.remap_failure,
            len(s.pending_notes),
            s.procs_ts if occ and not occ[-1].get("closed") else None,  # settles occurrences' workloads (evidence.settled)
            None if s.closing is None else sum(len(c["commands"]) for c in s.closing.values()), s.compute_floor),
        None if inc is None else (inc.id, inc.classification, inc.steps, inc.noted, inc.remediated,
                                  sum(1 for e in inc.emitted if e["outcome"] is not None)),
    )


def _evidence(state: GpuState, item: dict, policy: Policy) -> None:
    """A timeline line: on the open incident, or kept for the next one (the newest few)."""
    if state.incident is not None:
        state.incident.note(item, policy.evidence_limit)
    else:
        state.pending_notes = (state.pending_notes + [item])[-5:]


# -- records ------------------------------------------------------------------------------------
def _on_sample(state: GpuState, s: GpuSample, ts: float, policy: Policy, outputs: list) -> None:
    last = state.last_sample_ts
    if last is None or ts >= last:  # as max(ts, last) did: the newer float object when equal
        state.last_sample_ts = ts
        if last is not None and ts - last > policy.degrade_sample_gap_s:
            silent = state.silent_procs_ts
            if silent is not None and last < silent < ts:
                _on_gap(state, ts, ts - last, s, policy, outputs)
    if s.memory_total_mib and s.memory_total_mib != state.memory_total_mib:
        state.memory_total_mib = s.memory_total_mib  # a new float only when it changed
    status = _STATUS[s.status]  # the enum's .value is a descriptor call: a dict look-up is cheaper
    if status in ("lost", "reset_required") and state.status != status:
        state.status = status
        remedy = REBOOT if status == "lost" else RESET
        what = "GPU is lost (NVML_ERROR_GPU_IS_LOST)" if status == "lost" else "GPU requires a reset (NVML_ERROR_RESET_REQUIRED)"
        state.healthy_since = None
        _raise(state, Verdict(Classification.GPU_HARDWARE_FAULT, remedy, f"GPU {state.gpu_index} on {state.node}: {what}",
                              [s.event_id], hardware=True, entry=entry(ts, "sample", what, status=status, error=s.error),
                              rule=R.HARDWARE_NVML_LOST if status == "lost" else R.HARDWARE_NVML_RESET_REQUIRED,
                              facts=facts(nvml_status=status, remedy=remedy)),
               ts, policy, outputs)
        return
    if status != "ok":
        state.status = status
        return
    state.status = "ok"
    action = s.recovery_action
    if (action is not None and action != state.recovery_action) or bool(s.remapped_rows_failure) != state.remap_failure \
            or s.remapped_rows_pending:  # most samples change none of these: no call
        _hardware_signals(state, s, ts, policy, outputs)
    util = s.utilization_gpu_pct
    # A sample below the pin's utilization on a GPU with no pin to end is not pinned: no call
    if (util is not None and util >= policy.pinned_util_pct) or state.pinned_since is not None \
            or state.pinned_samples or state.pin_ids:
        pinned = fold_sample_pin(state, s, ts, policy)
    else:
        pinned = False
    if pinned:
        state.healthy_since = None
        _check_pinned(state, policy, outputs)
    else:
        last = state.last_unpinned_ts
        if last is None or ts > last:
            state.last_unpinned_ts = ts
        if state.remap_failure or state.recovery_action:
            state.healthy_since = None  # NVML still reports the fault: not healthy until it stops
        elif state.healthy_since is None:
            state.healthy_since = ts
        if state.incident is not None:
            _check_resolved(state, ts, policy, outputs)


def _on_counters(state: GpuState, c: GpuCounters, ts: float, policy: Policy, outputs: list) -> None:
    """A counters reading: its trends folded (streams.degrade), GPU_DEGRADING for each new finding.
    Stamped by the node like an Xid (not on the GPU's own clock: a reading a minute apart from the
    samples must not move it)."""
    if c.fabric_cluster_uuid:
        domain = f"{c.fabric_cluster_uuid}/{c.fabric_clique_id if c.fabric_clique_id is not None else '-'}"
        if domain != state.fabric_domain:
            state.fabric_domain = domain
    if state.trends is EMPTY_DICT:
        state.trends = {}  # the shared empty default is never written to
    before = state.trends_rev
    where = f"GPU {state.gpu_index} ({state.gpu_uuid or state.pci_bus_id}) on {state.node}"
    findings = fold_counters(state.trends, c, ts, policy, where)
    state.trends_rev = before + 1
    _degrading(state, findings, c.event_id, ts, policy, outputs)


def _degrading(state: GpuState, findings: list, event_id: str, ts: float, policy: Policy, outputs: list) -> None:
    """GPU_DEGRADING for each finding (streams.degrade): an incident opened, or the open one told."""
    remedy = QUARANTINE if policy.degrade_quarantine else RECORD
    for f in findings:
        line = entry(ts, "counters", f.summary, **f.data)
        inc = state.incident
        if inc is not None and inc.classification == _DEGRADING:
            # still rising a day later (degrade_realert_s), or another counter: the open incident's
            # alert, updated with the new figures
            inc.note(line, policy.evidence_limit)
            inc.rule = rule_ref(R.DEGRADING_TREND, _trend_facts(f, policy))
            outputs.append(("alert", alert(state, inc, ts, f.summary, "updated")))
        elif inc is not None and RANK[Classification(inc.classification)] > RANK[Classification.GPU_DEGRADING]:
            inc.note(line, policy.evidence_limit)  # evidence of the graver incident open: no alert of its own
        else:
            _raise(state, Verdict(Classification.GPU_DEGRADING, remedy, f.summary, [event_id],
                                  recommendation="A trend, not a fault: plan a maintenance window for this GPU "
                                                 "(reseat or replace the link, cable or board) before it fails; "
                                                 "nothing was done to the node",
                                  entry=line, rule=R.DEGRADING_TREND, facts=_trend_facts(f, policy)),
                   ts, policy, outputs)


_TREND_FACTS = ("counter", "count", "rate_per_h", "limit_per_h", "intervals", "window_s", "value", "link", "width",
                "width_max", "last_gap_s", "retired_pages_double_bit")


def _trend_facts(f, policy: Policy) -> dict:
    """A degrading finding's facts: which counter, how much, against which limit and window."""
    return facts(**{k: f.data[k] for k in _TREND_FACTS if k in f.data})


def _on_gap(state: GpuState, ts: float, gap: float, s: GpuSample, policy: Policy, outputs: list) -> None:
    """Samples came back after a gap during which the collector published this GPU's process
    lists: telemetry silence, trended (streams.degrade.note_gap)."""
    if state.trends is EMPTY_DICT:
        state.trends = {}
    state.trends_rev += 1
    where = f"GPU {state.gpu_index} ({state.gpu_uuid or state.pci_bus_id}) on {state.node}"
    f = note_gap(state.trends, ts, gap, policy, where)
    if f is not None:
        _degrading(state, [f], s.event_id, ts, policy, outputs)


def _hardware_signals(state: GpuState, s: GpuSample, ts: float, policy: Policy, outputs: list) -> None:
    """NVML's recovery action and row-remap failure: acted on when they change."""
    action = s.recovery_action
    if action is not None and action != state.recovery_action:
        state.recovery_action = action
        verdict = recovery_action_verdict(state, action, s.event_id, ts)
        if verdict is not None:
            state.healthy_since = None
            _raise(state, verdict, ts, policy, outputs)
    failure = bool(s.remapped_rows_failure)
    if failure != state.remap_failure:
        state.remap_failure = failure
        if failure:
            state.healthy_since = None
            _raise(state, remap_failure_verdict(state, s.event_id, ts), ts, policy, outputs)
    if s.remapped_rows_pending and state.incident is not None:
        state.incident.note(entry(ts, "sample", "a row remap is pending: it takes effect at the next GPU reset",
                                  remapped_rows_pending=True), policy.evidence_limit)


def _check_pinned(state: GpuState, policy: Policy, outputs: list) -> None:
    for ts, verdict in pinned_verdicts(state, policy):
        if verdict.climb is not None:
            inc = state.incident
            if inc is not None:
                _climb(state, inc, ts, verdict.climb, verdict.summary, policy, outputs, verdict.evidence_ids,
                       rule_ref(verdict.rule, verdict.facts))
            continue
        _raise(state, verdict, ts, policy, outputs)


def _on_workload(state: GpuState, w: WorkloadEvent, ts: float, policy: Policy, outputs: list) -> None:
    item = fold_workload(state, w, ts, policy)
    if item is None:
        return
    _evidence(state, entry(ts, "workload", f"pod {w.namespace}/{w.pod} {w.event.value} ({w.reason}, exit {w.exit_code})",
                           **{k: v for k, v in item.items() if k not in ("ts", "id")}), policy)
    if state.occurrences:  # the pod it names, or the clock it moved, may settle a fault's workload
        _check_suspect(state, policy, outputs)
    if state.pinned_since is not None:
        _check_pinned(state, policy, outputs)


def _on_xid(state: GpuState, x: XidEvent, ts: float, policy: Policy, outputs: list) -> None:
    kind = x.kind.value
    attested = x.attested
    if kind in ("gpu_identity", "gsp_rate_limit", "sxid"):
        if kind == "gsp_rate_limit" and state.incident is not None and attested:
            state.incident.note(entry(ts, "note", "driver rate-limits GSP RPC error prints: later Xid counts are undercounted",
                                      raw=x.raw), policy.evidence_limit)
        return
    if not attested:
        # Read from text only (a log file or stdin: `collect --accept-forgeable-kernel-log`), where a
        # tenant's crash report can print a driver line of its own: the syslog(2) interface splits a
        # record at a newline in a file name and prefixes the rest like any kernel line
        # (tests/data/kernel-newline-forgery.tsv). On the timeline, never a reason to act; the same
        # fault seen by NVML too is attested (its event names the GPU and the code).
        _evidence(state, entry(ts, "xid", f"(unattested: read from text) {x.message or x.raw}", xid=x.xid,
                               xid_kind=kind, raw=x.raw, sources=[s.value for s in x.sources] or [x.source.value],
                               unattested=True), policy)
        return
    if x.backfilled:
        # History read at the collector's first start: on the timeline, never a reason to act now.
        _evidence(state, entry(ts, "xid", f"(backfilled) {x.message or x.raw}", xid=x.xid, xid_kind=kind, raw=x.raw,
                               backfilled=True), policy)
        return
    # The newest Xid by its own time, not the last one read: healthy time counts from it
    # (`_check_resolved`), whichever was read first, the Xid or the samples after it.
    state.last_xid_ts = ts if state.last_xid_ts is None else max(state.last_xid_ts, ts)
    if kind == "recovery_failure":
        state.xids = added(state.xids, {"ts": ts, "xid": None, "kind": kind, "pid": None, "app": False, "id": x.event_id})
        _evidence(state, entry(ts, "xid", f"driver failed to recover the GPU: {x.message}", raw=x.raw), policy)
        return
    if kind == "fallen_off_bus":
        state.xids = added(state.xids, {"ts": ts, "xid": 79, "kind": kind, "pid": None, "app": False, "id": x.event_id})
        _raise(state, Verdict(Classification.GPU_HARDWARE_FAULT, REBOOT,
                              f"GPU on {state.node} ({x.pci_bus_id}) has fallen off the bus", [x.event_id], hardware=True,
                              entry=entry(ts, "xid", "GPU has fallen off the bus", raw=x.raw),
                              rule=R.HARDWARE_FALLEN_OFF_BUS, facts=facts(xid=79, remedy=REBOOT)), ts, policy, outputs)
        return
    if x.xid is None:
        return
    app = is_app_class(x.xid) and x.xid not in policy.hardware_xids
    wl, pod = workload_of(state, x.pid)
    fact = {"ts": ts, "xid": x.xid, "kind": kind, "pid": x.pid, "app": app, "id": x.event_id}
    state.xids = added(state.xids, fact)
    prune(state, ts, policy)
    xentry = entry(ts, "xid", f"{describe_xid(x.xid)} pid={x.pid} name={x.process_name}",
                   xid=x.xid, name=x.xid_name, pid=x.pid, process_name=x.process_name, pod_uid=pod,
                   raw=x.raw, sources=[s.value for s in x.sources] or [x.source.value])
    inc = state.incident
    if x.xid in (PSHC_DISENGAGED, PSHC_REENGAGED) and x.xid not in policy.hardware_xids \
            and _power_smoothing(state, fact, xentry, policy, outputs):
        return
    if not app:
        verdict = hardware_xid_verdict(state, x.xid, x.message, x.pci_bus_id, x.event_id, xentry)
        if verdict is None:
            # NVIDIA says record only (e.g. Xid 154 "to 0x0" after a recovery that worked)
            _evidence(state, xentry, policy)
            return
        if inc is not None and inc.reboot_ok_at is not None and ts > inc.reboot_ok_at \
                and state.came_back_after(inc.reboot_ok_at):
            # A GPU-level fault persisting after the node came back from its reboot: the last
            # rung. (An application's Xid after the reboot is that application's.)
            inc.note(xentry, policy.evidence_limit)
            _climb(state, inc, ts, Action.REPLACE_NODE, f"Xid {x.xid} on GPU {state.gpu_index} after the node was rebooted",
                   policy, outputs, [x.event_id], rule_ref(R.LADDER_XID_AFTER_REBOOT, facts(xid=x.xid)))
            return
        if inc is not None and inc.reset_ok_at is not None and ts > inc.reset_ok_at and verdict.remedy == RESET:
            inc.note(xentry, policy.evidence_limit)
            _climb(state, inc, ts, Action.REBOOT_NODE, f"Xid {x.xid} again after the GPU reset", policy, outputs, [x.event_id],
                   rule_ref(R.LADDER_XID_AFTER_RESET, facts(xid=x.xid, remedy=verdict.remedy)))
            return
        _raise(state, verdict, ts, policy, outputs)
        return
    # application class: the lines of one fault within burst_seconds are one occurrence, per workload
    occ = None
    for o in reversed(state.occurrences):
        # abs(): a line stamped ahead (within the skew bound) must not swallow the faults after it.
        # Lines of one PID within burst_seconds are one workload however it was named: a death
        # read before them names the first line's occurrence by pod (`name_by_deaths`), and not
        # the next line's PID.
        if abs(ts - o["ts"]) <= policy.burst_seconds and (o["wl"] == wl or o["wl"] is None or wl is None
                                                           or (x.pid is not None and o["pid"] == x.pid)):
            occ = o
            break
    if occ is not None:
        occ["last_ts"] = max(occ["last_ts"], ts)
        if x.xid not in occ["codes"]:
            occ["codes"].append(x.xid)
        if occ["wl"] is None:
            occ["wl"], occ["pid"] = wl, x.pid
        _evidence(state, xentry, policy)
        return
    occ = {"ts": ts, "last_ts": ts, "pid": x.pid, "wl": wl, "codes": [x.xid], "pod": pod, "id": x.event_id}
    if not x.process_lists:
        occ["nolists"] = True  # collect --no-nvml: no process list will name its pod
    state.occurrences = added(state.occurrences, occ)
    if not pod and x.pid is not None and state.workload_failures:
        name_by_deaths(state, policy)  # a death read before its fault (topics are read in parallel)
        wl, pod = occ["wl"], occ["pod"]
    _raise(state, app_occurrence_verdict(state, occ, x.xid, workload_label(state, x.pid, x.process_name), xentry),
           ts, policy, outputs)
    if pod and x.xid != XID45:
        # The fleet agent sees every GPU: one workload faulting several GPUs is the workload's fault.
        # (Not Xid 45: a multi-GPU job's normal teardown logs it on every GPU it used.)
        outputs.append(("workload_fault", {"pod_uid": pod, "gpu_uuid": state.gpu_uuid, "node": state.node, "ts": ts,
                                           "xid": x.xid, "incident_id": state.incident.id if state.incident else None}))
    _check_suspect(state, policy, outputs)


def _power_smoothing(state: GpuState, fact: dict, xentry: dict, policy: Policy, outputs: list) -> bool:
    """Xid 163 (power smoothing disengaged) and 162 (re-engaged), the pair of NVIDIA's catalog
    (streams.verdict): True when handled here. A 163 goes the hardware way (False) unless a 162 of
    this GPU already read re-engaged within `pshc_cancel_s` after it: then nothing is raised. A 162 is
    evidence, and closes the incident a 163 opened within `pshc_cancel_s` before it, alone: a
    quarantine released, an alert saying the disengagement was cancelled, never a node-level step.
    Both by their own times, so the pair holds in either read order."""
    code, ts = fact["xid"], fact["ts"]
    gpu = f"GPU {state.gpu_index} ({state.gpu_uuid or state.pci_bus_id}) on {state.node}"
    if code == PSHC_DISENGAGED:
        later = reengaged_by(state, ts, policy)
        if later is None:
            return False
        _evidence(state, xentry, policy)
        _evidence(state, entry(ts, "note", f"{describe_xid(PSHC_DISENGAGED)} cancelled by {describe_xid(PSHC_REENGAGED)} at "
                               f"{dt(later['ts']).strftime('%H:%M:%S')}Z, {later['ts'] - ts:.0f} s later: power smoothing "
                               f"re-engaged; nothing raised", cancelled_by=later.get("id")), policy)
        return True
    found = cancelled_disengagement(state, ts, policy)
    inc = state.incident
    _evidence(state, xentry, policy)
    if found is None:
        return True  # power smoothing re-engaged: not a fault
    opener, within = found
    since = f"{describe_xid(PSHC_DISENGAGED)} at {dt(opener['ts']).strftime('%H:%M:%S')}Z"
    if not within:
        inc.note(entry(ts, "note", f"power smoothing re-engaged {ts - opener['ts']:.0f} s after {since}, past "
                       f"pshc_cancel_s ({policy.pshc_cancel_s:.0f} s): the incident stays open for a person"),
                 policy.evidence_limit)
        return True
    what = (f"{since} cancelled by {describe_xid(PSHC_REENGAGED)} {ts - opener['ts']:.0f} s later: power smoothing "
            f"re-engaged")
    _close(state, inc, ts, entry(ts, "note", f"{what}: cancelled", cancelled=opener.get("id")),
           f"{gpu}: {what}; incident cancelled", policy, outputs,
           rule_ref(R.RESOLVE_PSHC_CANCELLED, facts(xid=PSHC_REENGAGED, after_s=ts - opener["ts"],
                                                    pshc_cancel_s=policy.pshc_cancel_s)))
    # kept past the close: a copy of the 163 published late (an NVML event after the merge window)
    # is then cancelled on arrival, not raised again
    state.xids = added(state.xids, fact)
    return True


def _check_suspect(state: GpuState, policy: Policy, outputs: list) -> None:
    found = earliest_suspect(state, policy)
    if found is not None:
        _raise(state, found[1], found[0], policy, outputs)


# -- incidents ----------------------------------------------------------------------------------
def _guard_allows(state: GpuState, inc: Incident | None, verdict: Verdict | None = None) -> bool:
    """Evidence beyond application-class Xids: hardware, or a sustained pinned state without compute."""
    if (verdict is not None and verdict.hardware) or (inc is not None and inc.hardware):
        return True
    return sustained_pin(state) > 0


def _raise(state: GpuState, verdict: Verdict, ts: float, policy: Policy, outputs: list,
           xentry: dict | None = None) -> None:
    """Open an incident, or escalate/update the open one, and emit what it newly needs."""
    cls, remedy = verdict.classification, verdict.remedy
    inc = state.incident
    plan = [a.value for a in PLANS[remedy]]
    if remedy == RESET and state.gpu_uuid is None:
        # Without a GPU identity a GPU reset cannot be aimed: downgrade to the node (NVSentinel).
        plan = [Action.CORDON_NODE.value, Action.DRAIN_NODE.value, Action.REBOOT_NODE.value]
    disruptive = [a for a in plan if Action(a) in _DISRUPTIVE]
    if disruptive and not _guard_allows(state, inc, verdict):
        # Never a node-level verdict without the evidence to act on it: no silent, unacted state
        #. The facts stay; a later record may complete them.
        return
    the_entry = verdict.entry or xentry
    ref = rule_ref(verdict.rule, verdict.facts)
    if inc is None:
        inc = state.incident = Incident(id=hid(state.key, ts, cls.value), classification=cls.value, opened_at=ts,
                                        remedy=remedy, plan=plan, hardware=verdict.hardware,
                                        recommendation=verdict.recommendation, rule=ref)
        for note in state.pending_notes:
            inc.note(note, policy.evidence_limit)
        state.pending_notes = EMPTY_LIST
        if the_entry:
            inc.note(the_entry, policy.evidence_limit)
        alert_state = "open"
    else:
        inc.hardware = inc.hardware or verdict.hardware
        if verdict.recommendation:
            inc.recommendation = verdict.recommendation
        old = Classification(inc.classification)
        escalates = RANK[cls] > RANK[old] or (RANK[cls] == RANK[old] and cls != old) or \
            (cls == old and remedy == REBOOT and inc.remedy == RESET)
        if escalates:
            inc.classification = cls.value
            inc.remedy = remedy
            inc.rule = ref
            for a in plan:
                if a not in inc.plan:
                    inc.plan.append(a)
        elif cls == Classification.APP_FAULT and remedy == RECORD:
            if cls == old:
                inc.rule = ref  # every new application-fault occurrence is recorded, with its own facts
        else:
            return  # the same verdict again, or a lesser one: the open incident already says it
        if the_entry:
            inc.note(the_entry, policy.evidence_limit)
        alert_state = "updated"
    if cls in (Classification.GPU_WEDGED, Classification.PHANTOM_LOAD):
        inc.sample_stats = sample_stats(state)
    new_actions = [Action(a) for a in plan if inc.may_emit(Action(a))]
    commands = [command(state, inc, a, ts, policy, verdict.summary, verdict.evidence_ids, ref) for a in new_actions]
    quiet = (alert_state == "updated" and not any(a != Action.RECORD for a in new_actions)
             and inc.last_alert_at is not None and ts - inc.last_alert_at < policy.alert_cooldown_s)
    if not quiet:
        outputs.append(("alert", alert(state, inc, ts, verdict.summary, alert_state)))
    outputs.extend(("command", c) for c in commands)


def _climb(state: GpuState, inc: Incident, ts: float, action: Action, why: str, policy: Policy, outputs: list,
           evidence_ids: list, rule: dict | None) -> None:
    if not inc.may_emit(action):
        return
    if action in _DISRUPTIVE and not _guard_allows(state, inc) \
            and Classification(inc.classification) not in (Classification.GPU_WEDGED, Classification.GPU_HARDWARE_FAULT):
        return
    inc.plan.append(action.value)
    inc.note(entry(ts, "remediation", f"next rung: {action.value}: {why}"), policy.evidence_limit)
    cmd = command(state, inc, action, ts, policy, why, evidence_ids, rule)
    outputs.append(("alert", alert(state, inc, ts, f"{why}: {action.value}", "updated")))
    outputs.append(("command", cmd))


def _on_result(state: GpuState, r: RemediationResult, ts: float, policy: Policy, outputs: list) -> None:
    inc = state.incident
    if state.closing and r.incident_id in state.closing and (inc is None or inc.id != r.incident_id):
        _on_closing_result(state, r, ts, policy, outputs)
        return
    if inc is None:
        return  # no open incident: nothing it could answer (a late result of a closed one)
    outcome, action = r.outcome.value, r.action
    cmd = inc.answered(r.incident_id, r.command_id, action)
    # An executor answers for the node its command names (results are not signed yet: at least a
    # result about another node cannot move this incident; review finding).
    foreign = cmd is not None and bool(state.node) and r.node != state.node
    if cmd is None or cmd["outcome"] is not None or foreign:
        why = ("answers no command of this incident" if cmd is None
               else f"names node {r.node}, but the command was for {state.node}" if foreign
               else f"repeats the answer to command {r.command_id} (first: {cmd['outcome']})")
        inc.note(entry(ts, "remediation", f"{action.value} {outcome} (command {r.command_id} of incident {r.incident_id}) "
                       f"{why}: recorded, not acted on", command_id=r.command_id, incident_id=r.incident_id,
                       action=action.value, outcome=outcome, detail=r.detail, matched=False), policy.evidence_limit)
        return
    cmd["outcome"] = outcome
    steps = _note_steps(inc, r, ts, policy)
    inc.note(entry(ts, "remediation", f"{action.value} {outcome}" + (f": {r.detail}" if r.detail else ""),
                   command_id=r.command_id, action=action.value, outcome=outcome, detail=r.detail, matched=True),
             policy.evidence_limit)
    new = answer_milestones(action.value, outcome, ts, steps)
    if new:
        if inc.repair is None:
            inc.repair = {}
        started = [e["ts"] for e in inc.emitted if e["action"] in REPAIR_ACTIONS]
        if started and "detection" not in inc.repair:
            new["detection"] = min(started)
        _stages(state, inc.id, reached(inc.repair, new), outputs)
    if outcome == "succeeded":
        if action in (Action.RESET_GPU, Action.REBOOT_NODE, Action.REPLACE_NODE):
            inc.remediated = True
            if action == Action.RESET_GPU:
                inc.reset_ok_at = ts
            else:
                inc.reboot_ok_at = ts
            # Healthy time counts from the repair; samples already read after it still count. (A
            # reset was re-read by the executor; a reboot is only ordered: its pinned run goes on.)
            if action == Action.RESET_GPU and state.pinned_since is not None and (state.pinned_last or 0) <= ts:
                state.pinned_since = None
            if state.healthy_since is not None and state.healthy_since < ts:
                state.healthy_since = ts if (state.last_sample_ts or 0) >= ts else None
            if state.last_sample_ts is not None:
                _check_resolved(state, state.last_sample_ts, policy, outputs)
        return
    # A failure, or a refusal the executor calls final (it will not go away by itself: the reset is
    # not supported here, MIG, a holder that is not ours, kured not running on the node), climbs to
    # the next rung; a plain refusal waits for a person. A dry run's answer did nothing and says
    # nothing about the GPU: it never climbs.
    climbs = (outcome == "failed" or (outcome == "refused" and r.final)) and not _dry_run(r)
    if climbs and action in (Action.RESET_GPU, Action.REBOOT_NODE):
        what = "failed" if outcome == "failed" else "refused for good"
        why = facts(action=action.value, outcome=outcome, final=r.final)
        if action == Action.RESET_GPU:
            _climb(state, inc, ts, Action.REBOOT_NODE, f"GPU reset {what} ({r.detail or 'no detail'})", policy, outputs,
                   [r.event_id], rule_ref(R.LADDER_RESET_FAILED, why))
        else:
            _climb(state, inc, ts, Action.REPLACE_NODE, f"node reboot {what} ({r.detail or 'no detail'})", policy,
                   outputs, [r.event_id], rule_ref(R.LADDER_REBOOT_FAILED, why))
        return
    # refused, expired, or another step failed: report it, never drop it silently
    outputs.append(("alert", alert(state, inc, ts, f"{action.value} {outcome} on {state.node}"
                                   + (f": {r.detail}" if r.detail else "") + "; operator attention needed", "updated")))


def _note_steps(inc: Incident, r: RemediationResult, ts: float, policy: Policy) -> list[tuple[str, float, bool]]:
    """Each step the executor reports, a timeline line at its time (taken no later than the answer,
    and moved as the answer's own stamp was: streams.repair.step_time); returns (step, time, ok)."""
    shift = r.ts.timestamp() - ts
    out = []
    for s in r.steps:
        at = step_time(s.at.timestamp(), ts, shift)
        out.append((s.step, at, s.ok))
        inc.note(entry(at, "remediation", f"{r.action.value} step {s.step}" + ("" if s.ok else " FAILED")
                       + (f": {s.detail}" if s.detail else ""), command_id=r.command_id, action=r.action.value,
                       step=s.step, ok=s.ok, detail=s.detail), policy.evidence_limit)
    return out


def _stages(state: GpuState, incident_id: str, ended: list[tuple[str, float]], outputs: list) -> None:
    """Stages of the repair that just ended: for the processor's histograms (streams.metrics)."""
    outputs.extend(("repair_stage", {"stage": stage, "seconds": seconds, "incident_id": incident_id, "node": state.node})
                   for stage, seconds in ended)


def _dry_run(r: RemediationResult) -> bool:
    """An executor in dry run answers with what it would have done (executors.gate DRY_RUN_PREFIX)."""
    return (r.detail or "").startswith(DRY_RUN)


def _on_closing_result(state: GpuState, r: RemediationResult, ts: float, policy: Policy, outputs: list) -> None:
    """The answer to a closing step (UNCORDON_NODE, RELEASE_GPU) of an incident that resolved: it
    arrives after its incident closed. Success ends it; anything else leaves capacity held that
    nobody is told of (the node stays cordoned, the GPU tainted), so it raises an alert on the
    closed incident naming the step and what is left to do."""
    closed = state.closing[r.incident_id]
    pending = closed["commands"]
    action = pending.get(r.command_id)
    if action is None or action != r.action.value or r.node != state.node:
        return  # answers no closing step of it (or a repeat): nothing to act on
    del pending[r.command_id]
    if not pending:
        del state.closing[r.incident_id]
        if not state.closing:
            state.closing = None
    if r.outcome.value == "succeeded" and closed.get("repair") is not None:
        ts_done = {"uncordon": ts} if action == Action.UNCORDON_NODE.value else {}
        _stages(state, r.incident_id, reached(dict(closed["repair"]), ts_done), outputs)
    if r.outcome.value == "succeeded" or _dry_run(r):
        return  # done, or a dry run's answer: nothing was done that is left to undo
    inc = Incident(id=r.incident_id, classification=closed["classification"], opened_at=ts, remedy=RECORD,
                   plan=[action], alerts=closed["alerts"], rule=closed.get("rule"))
    left = ("the node may still be cordoned: check it (kubectl get node) and uncordon it by hand if so"
            if action == Action.UNCORDON_NODE.value else
            "the GPU may still be quarantined: check its taint and remove it by hand if so")
    what = f"{action} {r.outcome.value} after the incident resolved" + (f" ({r.detail})" if r.detail else "")
    inc.note(entry(ts, "remediation", what, command_id=r.command_id, action=action, outcome=r.outcome.value,
                   detail=r.detail, matched=True), policy.evidence_limit)
    outputs.append(("alert", alert(state, inc, ts, f"GPU {state.gpu_index} on {state.node}: {what}; {left}", "updated")))
    if state.closing and r.incident_id in state.closing:
        state.closing[r.incident_id]["alerts"] = inc.alerts


def _check_resolved(state: GpuState, ts: float, policy: Policy, outputs: list) -> None:
    """Resolve the open incident once the GPU was healthy for `resolve_after_s` with no Xid: at the
    time that held (healthy since the later of the healthy run's start and the newest Xid), the
    same whichever was read first, the Xid or the samples after it; `ts` is the newest sample read."""
    inc = state.incident
    if inc is None or state.healthy_since is None:
        return
    since = state.healthy_since if state.last_xid_ts is None else max(state.healthy_since, state.last_xid_ts)
    if ts - since < policy.resolve_after_s:
        return
    if state.occurrences and pending(state):
        # A fault whose workload is not yet named (evidence.settled, up to NAME_WAIT_S) may still make
        # a verdict: with resolve_after_s below that wait (60 s against 90 s on the real node of
        # make e2e) three processes faulting GPU 0 resolved as healthy and the quarantine was lost.
        return
    # Stamped when it held, but never more than RESOLVE_STAMP_SLACK_S before the sample that showed
    # it: a gap in samples would otherwise send closing steps that expired before they were sent.
    ts = max(since + policy.resolve_after_s, ts - RESOLVE_STAMP_SLACK_S)
    cls = Classification(inc.classification)
    if cls in (Classification.GPU_WEDGED, Classification.GPU_HARDWARE_FAULT) and not inc.remediated:
        return
    if cls == Classification.GPU_DEGRADING and degrading_now(state.trends, ts, policy):
        return  # healthy samples do not make a link stop recovering: open while the trend holds
    if state.remap_failure or state.recovery_action:
        return  # NVML still reports the fault (a failed row remap, a pending recovery action)
    _close(state, inc, ts, entry(ts, "note", f"healthy for {ts - since:.0f} s with no new Xid: resolved"),
           f"GPU {state.gpu_index} on {state.node} healthy again: incident resolved", policy, outputs,
           rule_ref(R.RESOLVE_HEALTHY, facts(healthy_s=ts - since, resolve_after_s=policy.resolve_after_s)))


def _close(state: GpuState, inc: Incident, ts: float, note: dict, summary: str, policy: Policy, outputs: list,
           rule: dict | None) -> None:
    """Close the open incident at `ts`: its last timeline line, the resolved alert, and the closing
    steps of what it took (UNCORDON_NODE, RELEASE_GPU), kept until answered."""
    closing = []
    if inc.has_emitted(Action.CORDON_NODE):
        closing.append(Action.UNCORDON_NODE)
    if inc.has_emitted(Action.QUARANTINE_GPU):
        closing.append(Action.RELEASE_GPU)
    inc.note(note, policy.evidence_limit)
    outputs.append(("alert", alert(state, inc, ts, summary, "resolved")))
    cmds = [command(state, inc, a, ts, policy, "incident resolved", [], rule) for a in closing]
    outputs.extend(("command", c) for c in cmds)
    # the closing steps are answered after the incident closed: kept until they are, for the newest
    # few incidents (a later incident resolving must not forget an earlier one's unanswered step)
    if cmds:
        closing = dict(state.closing or {})
        closing[inc.id] = {"classification": inc.classification, "alerts": inc.alerts,
                           "commands": {c.command_id: c.action.value for c in cmds}}
        if inc.rule is not None:  # a closing step's failure is alerted under the incident's rule
            closing[inc.id]["rule"] = inc.rule
        if inc.repair:  # the uncordon's answer ends the repair's last stage
            closing[inc.id]["repair"] = inc.repair
        state.closing = dict(list(closing.items())[-_CLOSING_KEPT:])
    state.incident = None
    state.resolved_incidents += 1
    # The faults stay for the suspect rule's window, closed: a fault read late (its topic behind the
    # samples that resolved the incident) still counts with them, as it would have in time order
    # (verdict.earliest_suspect); a closed fault alone never raises a verdict again. Cleared, a
    # replay whose Xid topic was read 290 s of event time behind the samples lost GPU_SUSPECT.
    for o in state.occurrences:
        o["closed"] = True
    state.xids = state.workload_failures = EMPTY_LIST
