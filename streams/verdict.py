"""The rules, as pure functions of a GPU's facts: facts -> verdict (classification, plan, why).

After ../shared/reference/incident.md "The escalation policy" (docs/architecture.md "Verdicts"):

- APP_FAULT (info): an application-class Xid occurrence (the lines of one fault within
  `burst_seconds` count once). RECORD only. Application-class is NVIDIA's word (catalog resolution
  RESTART_APP / IGNORE, the device plugin's 13, 31, 43, 45, 68, 109), never the policy's.
- GPU_SUSPECT (warning): >= `suspect_distinct_pids` different workloads (pod UID, else PID) in
  `suspect_window_s`, or >= `suspect_occurrences` occurrences counting each workload once (a
  crash-looping pod is one workload), or pinned utilization with no compute after an
  application-class Xid other than 45 with no wedge evidence. QUARANTINE_GPU. The faults of a
  resolved incident still count in the window beside a new one, never alone (`earliest_suspect`).
- GPU_WEDGED (critical): wedge evidence (Xid 43, or the driver's failure to recover the GPU,
  e.g. ``refcntRequestReference_IMPL ... Failed to enter state``) in the lookback, and pinned
  utilization with no compute process for `pinned_seconds` (never less than the guard's span).
  CORDON_NODE, DRAIN_NODE, RESET_GPU; wedged again after a reset -> REBOOT_NODE, after a reboot ->
  REPLACE_NODE.
- GPU_HARDWARE_FAULT (critical): by NVIDIA's resolution (streams.hardware), NVML lost /
  reset_required, NVML's recovery action, a row-remap failure.
- PHANTOM_LOAD (warning): pinned with no compute and no wedge evidence or recent application
  Xid (other records, such as Xid 154 "to 0x0" or a non-fatal NVLink Xid, do not hide it). RECORD.
- Power smoothing: Xid 163 (PSHC_DISENGAGED) raises, Xid 162 (PSHC_REENGAGED) clears. A 163 is a
  GPU_HARDWARE_FAULT by NVIDIA's catalog (no bucket: quarantine); a 162 of the same GPU within
  `pshc_cancel_s` after it cancels it (`cancelled_disengagement`, `reengaged_by`); a 162 is never a
  fault by itself.

Xid 45 (preemptive cleanup: one job's teardown logs it on every rank at once) is never more than
RECORD. A live compute process keeps a GPU out of GPU_WEDGED and PHANTOM_LOAD.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from xidstream.schemas.vocab import RECOVERY_ACTIONS, Action, Classification
from xidstream.streams.evidence import GpuState, entry, pin_onset, sample_stats, settled, workload_of
from xidstream.streams.hardware import QUARANTINE, REBOOT, RECORD, RESET, remedy_for_xid, _XID154_ACTIONS
from xidstream.streams.policy import GUARD_MIN_PINNED_SPAN_S, Policy
from xidstream.streams.render import app_xid_verdict_text, describe_xid, dt
from xidstream.streams import rules as R
from xidstream.streams.rules import Rule, facts

__all__ = ["Verdict", "RANK", "PLANS", "pinned_verdicts", "suspect_verdict", "earliest_suspect", "hardware_xid_verdict",
           "recovery_action_verdict", "XID45", "PSHC_REENGAGED", "PSHC_DISENGAGED", "reengaged_by",
           "cancelled_disengagement"]

RANK = {
    Classification.APP_FAULT: 1,
    Classification.PHANTOM_LOAD: 2,
    Classification.GPU_DEGRADING: 2,
    Classification.GPU_SUSPECT: 3,
    Classification.GPU_WEDGED: 4,
    Classification.GPU_HARDWARE_FAULT: 4,
}
PLANS = {
    RECORD: [Action.RECORD],
    QUARANTINE: [Action.QUARANTINE_GPU],
    RESET: [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU],
    REBOOT: [Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE],
}
XID45 = 45  # preemptive cleanup (NVIDIA catalog: ROBUST_CHANNEL_PREEMPTIVE_REMOVAL)
# NVIDIA's Xid catalog (analyzing-xid-catalog.html): 162 PSHC_REENGAGED "Power Smoothing HW Circuitry
# capability reengaged", 163 PSHC_DISENGAGED "... capability disengaged", whose trigger conditions say
# "No GPU reset required. If power smoothing functionality is desired, the customer needs to resolve
# the thermal events. If disabled due to timeout, reload the driver or reset the GPU." NVIDIA's GPU
# Operational Events report both from one module (GPU-PSHC: "power-smoothing controller engagement,
# disengagement"). A state and its end: the 163 raises, the 162 clears it. (NVSentinel maps 162 to
# RESET_GPU; NVIDIA's catalog gives neither code a bucket.)
PSHC_REENGAGED, PSHC_DISENGAGED = 162, 163
PSHC_ADVICE = ("NVIDIA: no GPU reset required; power smoothing stays off until the thermal events are resolved; "
               "if it was disabled by a timeout, reload the driver or reset the GPU")


@dataclass(slots=True)
class Verdict:
    classification: Classification
    remedy: str
    summary: str
    evidence_ids: list = field(default_factory=list)
    hardware: bool = False
    recommendation: str | None = None
    entry: dict | None = None
    climb: Action | None = None  # a next rung of the open incident's ladder instead of a plan
    # the rule that held (streams.rules) and the evidence fields it read (streams.rules.facts); not part
    # of a verdict's equality: which verdict it is stays its class, remedy, words and evidence
    rule: Rule | None = field(default=None, compare=False)
    facts: dict = field(default_factory=dict, compare=False)


def _is_wedge(x: dict) -> bool:
    """Xid 43 or a driver recovery failure, read live (the recovery failure is wedge
    evidence exactly like Xid 43)."""
    return (x.get("xid") == 43 or x.get("kind") == "recovery_failure") and not x.get("backfilled")


def _is_app(x: dict) -> bool:
    return bool(x.get("app")) and x.get("xid") != XID45 and not x.get("backfilled")


def _in_window(items: list[dict], t: float, window: float) -> list[dict]:
    return [x for x in items if 0 <= t - x["ts"] <= window]


def pinned_verdicts(state: GpuState, policy: Policy) -> list[tuple[float, Verdict]]:
    """The verdicts of a GPU pinned near 100% with no compute process, each at the earliest time
    its rule held (`xidstream.streams.evidence.pin_onset`), oldest first; empty when none holds (yet).

    Each verdict is stamped as of its evidence, not when the last of it was read: a phantom load,
    then the wedge once Xid 43 is in, come out at the same times whichever topic a worker reads
    first. (A verdict that rests on an absence, phantom load or "no wedge evidence", is read as of
    the records read so far: an Xid read after it adds the wedge, it does not take the first back.)"""
    needed = max(policy.pinned_seconds, GUARD_MIN_PINNED_SPAN_S)
    base_onset = pin_onset(state, needed)
    if base_onset is None:
        return []
    # pin_onset never moves earlier as its floor moves later: over evidence sorted by time, the
    # first piece that holds gives the earliest verdict, and evidence too old for the earliest
    # possible onset is skipped by bisection (a pinned GPU with 200 Xid 43 lines cost 7-15 ms a
    # record when every piece was tried and every window scanned).
    xids = sorted(state.xids, key=lambda x: x["ts"])
    wedges = [x for x in xids if _is_wedge(x)]
    wedge_ts = [x["ts"] for x in wedges]
    apps = [x for x in xids if _is_app(x)]
    app_ts = [x["ts"] for x in apps]
    failure_ts = sorted(w["ts"] for w in state.workload_failures)
    wedge_window = policy.wedged_xid43_lookback_s

    def wedge_at(t: float) -> bool:
        return bisect_right(wedge_ts, t) > bisect_left(wedge_ts, t - wedge_window)

    earliest = base_onset[0]
    found: list[tuple[float, Verdict]] = []
    for x in wedges[bisect_left(wedge_ts, earliest - wedge_window):]:
        floor = x["ts"]
        if policy.wedged_requires_workload_failure:
            i = bisect_left(failure_ts, x["ts"])
            if i == len(failure_ts):
                break  # no failure after this piece, nor after any later one
            floor = max(floor, failure_ts[i])
        onset = pin_onset(state, needed, floor)
        if onset is None:
            break
        if onset[0] - x["ts"] <= wedge_window:
            t = onset[0]
            found.append((t, _wedged(state, t, onset[1], _in_window(wedges, t, wedge_window), policy)))
            break
    i = first = bisect_left(app_ts, earliest - policy.app_xid_lookback_s)
    while i < len(apps):
        x = apps[i]
        onset = pin_onset(state, needed, x["ts"])
        if onset is None:
            break
        if onset[0] - x["ts"] > policy.app_xid_lookback_s:
            i += 1  # too old by then
            continue
        if wedge_at(onset[0]):
            # Wedge evidence: the wedge rule decides (or waits for its workload failure). It blocks
            # until `until`; every later piece no newer than that has its onset there too (blocked),
            # or at the first onset past it, which the newest of them reaches first: try that one.
            until = wedge_ts[bisect_right(wedge_ts, onset[0]) - 1] + wedge_window
            j = bisect_right(app_ts, until)
            if j - 1 > i:
                i = j - 1
                continue
            i = max(j, i + 1)
            continue
        t, start = onset
        if i > first:
            # A jump past blocked pieces may land on a later piece of the same onset: the suspect is
            # the first piece that holds at `t` (onsets rise with the piece's time, and so does
            # being recent enough), whichever piece the jump tried.
            lo, hi = first, i
            while lo < hi:
                mid = (lo + hi) // 2
                m = apps[mid]
                o = pin_onset(state, needed, m["ts"]) if m["ts"] >= t - policy.app_xid_lookback_s else None
                if o is not None and o[0] >= t:
                    hi = mid
                else:
                    lo = mid + 1
            x = apps[lo]
        found.append((t, Verdict(Classification.GPU_SUSPECT, QUARANTINE,
                                 f"{_pinned_base(state, t, start)} after application-class {describe_xid(x['xid'])} "
                                 f"(no wedge evidence)", [*_pin_ids(state), x.get("id")],
                                 entry=_stats_entry(state, t, start), rule=R.SUSPECT_PINNED_AFTER_APP_XID,
                                 facts=_pin_facts(state, t, start, policy, app_xid=x["xid"],
                                                  app_xid_lookback_s=policy.app_xid_lookback_s))))
        break
    t, start = base_onset
    if not wedge_at(t) and not bisect_right(app_ts, t) > bisect_left(app_ts, t - policy.app_xid_lookback_s):
        found.append((t, Verdict(Classification.PHANTOM_LOAD, RECORD,
                                 f"{_pinned_base(state, t, start)} and no application or wedge Xid: phantom load",
                                 _pin_ids(state), entry=_stats_entry(state, t, start), rule=R.PHANTOM_PINNED,
                                 facts=_pin_facts(state, t, start, policy))))
    found.sort(key=lambda f: f[0])
    return found


def _pinned_base(state: GpuState, t: float, start: float) -> str:
    util = state.pin_stats.get("util_min", 100.0)
    return (f"GPU {state.gpu_index} ({state.gpu_uuid}) on {state.node}: utilization >= {util:.0f}% with "
            f"{state.pin_stats.get('mem_max', 0):.0f} MiB used and no compute process for {t - start:.0f} s")


def _pin_ids(state: GpuState) -> list:
    return [*state.pin_ids, state.nocompute_id]


def _pin_facts(state: GpuState, t: float, start: float, policy: Policy, **more) -> dict:
    """What every pinned rule read: the span, the utilization floor and memory ceiling over it,
    the compute processes listed (none), and the policy's span and threshold."""
    return facts(pinned_s=t - start, util_min_pct=state.pin_stats.get("util_min", 100.0),
                 mem_max_mib=state.pin_stats.get("mem_max", 0), compute_processes=0,
                 pinned_seconds=max(policy.pinned_seconds, GUARD_MIN_PINNED_SPAN_S),
                 pinned_util_pct=policy.pinned_util_pct, **more)


def _stats_entry(state: GpuState, t: float, start: float) -> dict:
    return entry(t, "sample_stats", f"pinned {t - start:.0f} s without compute", **sample_stats(state))


def _wedged(state: GpuState, t: float, start: float, wedge: list[dict], policy: Policy) -> Verdict:
    since = wedge[0]["ts"]
    failures = [w for w in state.workload_failures if since <= w["ts"] <= t]
    ids = _pin_ids(state) + [x.get("id") for x in wedge] + [w.get("id") for w in failures]
    inc = state.incident
    # "Again after the reboot" needs the GPU seen healthy since: a REBOOT_NODE result only says
    # kured's sentinel was written; until the node really rebooted, it is the same wedge.
    x43 = [x for x in wedge if x.get("xid") == 43]
    failed = [x for x in wedge if x.get("kind") == "recovery_failure"]
    why = _pin_facts(state, t, start, policy, xid43=len(x43), recovery_failures=len(failed),
                     workload_failures=len(failures), wedged_xid43_lookback_s=policy.wedged_xid43_lookback_s)
    if inc is not None and inc.reboot_ok_at is not None and start > inc.reboot_ok_at \
            and state.came_back_after(inc.reboot_ok_at):
        return Verdict(Classification.GPU_WEDGED, REBOOT, f"GPU {state.gpu_index} wedged again after the node reboot",
                       ids, climb=Action.REPLACE_NODE, rule=R.WEDGED_AGAIN_AFTER_REBOOT, facts=why)
    if inc is not None and inc.reset_ok_at is not None and start > inc.reset_ok_at:
        return Verdict(Classification.GPU_WEDGED, RESET, f"GPU {state.gpu_index} wedged again after the GPU reset",
                       ids, climb=Action.REBOOT_NODE, rule=R.WEDGED_AGAIN_AFTER_RESET, facts=why)
    parts = []
    if x43:
        parts.append(f"Xid 43 at {dt(x43[-1]['ts']).strftime('%H:%M:%S')}Z")
    if failed:
        parts.append(f"the driver's failure to recover the GPU at {dt(failed[-1]['ts']).strftime('%H:%M:%S')}Z")
    summary = (f"{_pinned_base(state, t, start)} after {' and '.join(parts)}: GPU context wedged"
               + (f"; {len(failures)} later workload failure(s)" if failures else ""))
    return Verdict(Classification.GPU_WEDGED, RESET, summary, ids, entry=_stats_entry(state, t, start),
                   rule=R.WEDGED_PINNED, facts=why)


def app_occurrence_verdict(state: GpuState, occ: dict, x_code: int, who: str, xentry: dict) -> Verdict:
    """An application-class occurrence; a workload's repeats are counted in the evidence, not
    towards a quarantine."""
    repeats = sum(1 for o in state.occurrences if o["wl"] is not None and o["wl"] == occ["wl"])
    again = f" ({repeats} occurrences of this workload in the window)" if repeats > 1 else ""
    xentry["data"]["workload_occurrences"] = max(repeats, 1)
    return Verdict(Classification.APP_FAULT, RECORD,
                   f"{describe_xid(x_code)} from {who} on GPU {state.gpu_index} on {state.node}: "
                   f"{app_xid_verdict_text(x_code)}{again}", [occ.get("id")], entry=xentry, rule=R.APP_FAULT_XID,
                   facts=facts(xid=x_code, pid=occ.get("pid"), workload_occurrences=max(repeats, 1)))


def suspect_verdict(state: GpuState, ts: float, policy: Policy) -> Verdict | None:
    """Repeats or several workloads faulting one GPU, counted per workload; Xid 45 never counts.
    `ts` is the newest occurrence's time (the verdict is as of the evidence, whenever it settles)."""
    recent = [o for o in state.occurrences if 0 <= ts - o["ts"] <= policy.suspect_window_s
              and any(c != XID45 for c in o["codes"])]
    # A workload counts once its identity is settled (the process list of its time was read).
    workloads = sorted({o["wl"] for o in recent if o["wl"] is not None and settled(state, o)})
    unidentified = [o for o in recent if o["wl"] is None]
    counted = len(workloads) + len(unidentified)
    if len(workloads) >= policy.suspect_distinct_pids:
        names = ", ".join(w.split(":", 1)[1] if w.startswith("pid:") else w for w in workloads)
        why = f"{len(workloads)} different processes or pods ({names}) faulted it"
        rule = R.SUSPECT_WORKLOADS
    elif counted >= policy.suspect_occurrences:
        why = f"{counted} application-class Xid occurrences"
        rule = R.SUSPECT_OCCURRENCES
    else:
        return None
    return Verdict(Classification.GPU_SUSPECT, QUARANTINE,
                   f"GPU {state.gpu_index} ({state.gpu_uuid}) on {state.node}: {why} within "
                   f"{policy.suspect_window_s / 60:.0f} min: stop scheduling onto it",
                   [o.get("id") for o in recent], rule=rule,
                   facts=facts(workloads=len(workloads), occurrences=counted,
                               xids=sorted({c for o in recent for c in o["codes"]}),
                               suspect_window_s=policy.suspect_window_s,
                               suspect_distinct_pids=policy.suspect_distinct_pids,
                               suspect_occurrences=policy.suspect_occurrences))


def earliest_suspect(state: GpuState, policy: Policy) -> tuple[float, Verdict] | None:
    """(when, verdict) at the first occurrence at which the suspect rule holds. Faults and process
    lists arrive in any order; asking at every occurrence's own time gives the same answer,
    stamped as of the evidence, whichever arrived last.

    One pass over the occurrences that can count (an Xid 45-only occurrence never does, and the
    rule first holds at the time of one that counts), with a sliding window, instead of the rule
    re-read at every occurrence: that was quadratic in the occurrences kept, 507 ms for one record
    on a GPU with 2,000 Xid 45 lines from distinct PIDs, stalling its whole partition."""
    cands = sorted((o for o in state.occurrences if any(c != XID45 for c in o["codes"])), key=lambda o: o["ts"])
    window = policy.suspect_window_s
    workloads: dict[str, int] = {}
    unidentified = 0
    fresh = 0  # open faults in the window: closed ones (a resolved incident's) count only beside one
    lo = i = 0
    n = len(cands)
    while i < n:
        t = cands[i]["ts"]
        while i < n and cands[i]["ts"] == t:  # every occurrence of this instant is in its window
            o = cands[i]
            fresh += not o.get("closed")
            if o["wl"] is None:
                unidentified += 1
            elif settled(state, o):
                workloads[o["wl"]] = workloads.get(o["wl"], 0) + 1
            i += 1
        while t - cands[lo]["ts"] > window:  # the same test as suspect_verdict's `ts - o["ts"] <= window`
            o = cands[lo]
            fresh -= not o.get("closed")
            if o["wl"] is None:
                unidentified -= 1
            elif settled(state, o):
                workloads[o["wl"]] -= 1
                if not workloads[o["wl"]]:
                    del workloads[o["wl"]]
            lo += 1
        if fresh > 0 and (len(workloads) >= policy.suspect_distinct_pids
                      or len(workloads) + unidentified >= policy.suspect_occurrences):
            verdict = suspect_verdict(state, t, policy)  # the words and evidence, read once
            if verdict is not None:
                return t, verdict
    return None


def hardware_xid_verdict(state: GpuState, code: int, message: str, pci: str | None, event_id: str,
                         xentry: dict) -> Verdict | None:
    """A non-application Xid by NVIDIA's resolution; None when NVIDIA says record only."""
    remedy, _resolution, why = remedy_for_xid(code, message)
    if remedy == RECORD:
        return None
    rec = ("Open an NVIDIA support case with this evidence (nvidia-bug-report.sh)" if remedy == QUARANTINE else None)
    if code == PSHC_DISENGAGED:
        rec = PSHC_ADVICE
    return Verdict(Classification.GPU_HARDWARE_FAULT, remedy,
                   f"{describe_xid(code)} on GPU {state.gpu_index} ({state.gpu_uuid or pci}) on {state.node}: {why}",
                   [event_id], hardware=True, recommendation=rec, entry=xentry, rule=R.HARDWARE_XID,
                   facts=facts(xid=code, resolution=_resolution, remedy=remedy))


def reengaged_by(state: GpuState, disengaged_at: float, policy: Policy) -> dict | None:
    """The Xid 162 already read that re-engaged power smoothing within `pshc_cancel_s` after an Xid 163
    at `disengaged_at` (both by their own times: a 163 read after its 162 is cancelled too)."""
    for x in state.xids:
        if x.get("xid") == PSHC_REENGAGED and 0 <= x["ts"] - disengaged_at <= policy.pshc_cancel_s:
            return x
    return None


def cancelled_disengagement(state: GpuState, reengaged_at: float, policy: Policy) -> tuple[dict, bool] | None:
    """(the Xid 163 that opened the GPU's open incident, whether an Xid 162 at `reengaged_at` is within
    `pshc_cancel_s` of it), when that incident rests on power smoothing alone: a GPU_HARDWARE_FAULT
    quarantine opened by the 163, with no other Xid, NVML fault, row-remap failure or recovery action
    since and no node-level step taken. None otherwise: other evidence keeps an incident open whatever
    a 162 says, and a 163 that only joined an incident opened before it did not open what it would close."""
    inc = state.incident
    if inc is None or inc.classification != Classification.GPU_HARDWARE_FAULT.value or inc.remedy != QUARANTINE:
        return None
    if reengaged_at < inc.opened_at or any(inc.has_emitted(a) for a in PLANS[RESET] + PLANS[REBOOT]):
        return None
    if state.status != "ok" or state.recovery_action or state.remap_failure:
        return None
    opener = None
    for x in state.xids:
        if x["ts"] < inc.opened_at:
            continue
        if x.get("xid") == PSHC_DISENGAGED:
            if x["ts"] == inc.opened_at and opener is None:
                opener = x
        elif x.get("xid") != PSHC_REENGAGED:
            return None  # other evidence since it opened
    if opener is None:
        return None
    return opener, reengaged_at - opener["ts"] <= policy.pshc_cancel_s


def recovery_action_verdict(state: GpuState, action: int, event_id: str, ts: float) -> Verdict | None:
    """NVML's GPU recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), read like Xid 154 names it."""
    remedy = _XID154_ACTIONS.get(action, QUARANTINE)
    if remedy == RECORD:
        return None
    name = RECOVERY_ACTIONS.get(action, f"0x{action:x}")
    what = f"NVML reports the GPU recovery action {action} ({name})"
    return Verdict(Classification.GPU_HARDWARE_FAULT, remedy, f"GPU {state.gpu_index} on {state.node}: {what}",
                   [event_id], hardware=True, entry=entry(ts, "sample", what, recovery_action=action),
                   rule=R.HARDWARE_RECOVERY_ACTION, facts=facts(recovery_action=action, name=name, remedy=remedy))


def remap_failure_verdict(state: GpuState, event_id: str, ts: float) -> Verdict:
    """A failed row remap: the GPU is out of spare rows. NVIDIA's memory error management guide
    treats it like Xid 64 (row remapper failure, catalog: RESET_GPU) and asks for an RMA if it
    persists after the reset."""
    what = "row remapping failed (nvmlDeviceGetRemappedRows: failure)"
    remedy, _res, _why = remedy_for_xid(64)
    return Verdict(Classification.GPU_HARDWARE_FAULT, remedy, f"GPU {state.gpu_index} on {state.node}: {what}",
                   [event_id], hardware=True,
                   recommendation="If the remap failure persists after the reset, open an NVIDIA RMA case with this evidence",
                   entry=entry(ts, "sample", what, remapped_rows_failure=True), rule=R.HARDWARE_ROW_REMAP_FAILURE,
                   facts=facts(remapped_rows_failure=True, as_xid=64, remedy=remedy))


def workload_label(state: GpuState, pid: int | None, process_name: str | None) -> str:
    wl, pod = workload_of(state, pid)
    if pid is None:
        return "an unknown process"
    return f"pid {pid} ({process_name})" + (f" of pod {pod}" if pod else "")
