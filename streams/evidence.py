"""The per-GPU facts, folded by event time: what the verdict rules read.

`GpuState` is one table row (one GPU UUID, or ``node/pci`` for an Xid whose GPU the collector
could not resolve). The functions here only gather facts; `xidstream.streams.verdict` decides what they
mean and `xidstream.streams.classify` runs the fold.

Topics are read in parallel, so records of one GPU arrive out of event-time order. Facts are kept
as maxima and event-stamped lists (newest snapshot with and without a compute app, Xids with their
times), which do not depend on arrival order.

The GPU's clock is the newest time a record of it was taken at; its collector's own readings
(samples, process lists, inventory: published every interval) always move it. A record stamped by
another clock (a kernel line's own time, an executor's, kubelet's) more than `max_clock_skew_s`
ahead of it is kept but taken at the GPU's clock, and the skew is noted
(`dmesg -T` drifts after suspend/resume; an RTC can be wrong), so one bad stamp cannot blind the
windows, the pinned span or the incident timers to the correctly stamped records that follow.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from xidstream.schemas.models import GpuProcesses, GpuSample, WorkloadEvent
from xidstream.streams.incident import Incident
from xidstream.streams.policy import GUARD_MIN_PINNED_SAMPLES, GUARD_MIN_PINNED_SPAN_S, Policy

__all__ = ["GpuState", "settled", "entry", "name_by_deaths", "DEATH_AFTER_FAULT_S", "NAME_WAIT_S", "pending", "nocompute_start", "sustained_pin", "pin_onset", "sample_stats", "prune",
           "workload_of", "fold_sample_pin", "fold_processes", "fold_workload", "event_time", "added", "EMPTY_LIST", "EMPTY_DICT"]

# pid -> pod UID pairs kept per GPU past the newest compute-process list: enough for the PIDs of
# the current suspect window on one GPU (a crash-looping pod gets a new PID each restart). The
# pairs of the PIDs in the newest list are always kept (bounded by the contract's list cap): a pod
# with 40 processes on one GPU had its first 8 forgotten, and three of their faults were three
# workloads, a quarantine.
_PODS_KEPT = 32
_XIDS_KEPT = 200


# -- the shared empty containers ------------------------------------------------------------------
# A healthy GPU's lists and dicts are empty, and were one object each per GPU: 7 objects, ~400 B of
# its ~1.5 KiB of Python objects (memory per GPU). Empty ones are now these two shared,
# read-only objects: a list or dict as every reader expects (len, iteration, .get, ==, orjson), that
# refuses to change; whoever adds to one assigns a list or dict of the GPU's own (`added`).
def _refuse(self, *args: Any, **kwargs: Any) -> None:
    raise TypeError("a GpuState's shared empty container is read-only: assign a new one (streams.evidence.added)")


def _init_empty(self, *args: Any, **kwargs: Any) -> None:
    # type(x)(items) (dataclasses.asdict, copy by type) may make another empty one, never fill one
    if kwargs or len(args) > 1 or (args and any(True for _ in args[0])):
        _refuse(self)


class _EmptyList(list):
    __slots__ = ()
    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    __init__ = _init_empty

    def __reduce_ex__(self, protocol: Any) -> str:  # copy and pickle give the one shared object
        return "EMPTY_LIST"


class _EmptyDict(dict):
    __slots__ = ()
    __setitem__ = __delitem__ = pop = popitem = clear = update = setdefault = __ior__ = _refuse
    __init__ = _init_empty

    def __reduce_ex__(self, protocol: Any) -> str:
        return "EMPTY_DICT"


EMPTY_LIST: list = list.__new__(_EmptyList)
EMPTY_DICT: dict = dict.__new__(_EmptyDict)


def _empty_list() -> list:
    return EMPTY_LIST


def _empty_dict() -> dict:
    return EMPTY_DICT


def added(items: list, item: Any) -> list:
    """`items` with `item` appended: in place, or a new list when `items` is the shared empty one.
    (Assign the result: ``state.xids = added(state.xids, x)``.) Any read-only list counts, not only
    the shared one: a copy made by its type (``dataclasses.asdict``) is read-only too."""
    if type(items) is not list:
        return [*items, item]
    items.append(item)
    return items


@dataclass(slots=True)
class GpuState:
    key: str
    node: str = ""
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None
    gpu_index: int | None = None
    memory_total_mib: float | None = None
    status: str = "ok"
    clock: float | None = None  # the newest time a record was taken at: the GPU's clock
    sampled: bool = False  # a sample, process list or inventory was seen: the clock can be trusted
    pinned_since: float | None = None
    pinned_samples: int = 0
    pinned_last: float | None = None
    pin_stats: dict = field(default_factory=_empty_dict)
    pin_ids: list = field(default_factory=_empty_list)  # event_ids of the first and newest pinned sample
    proc_snapshots: int = 0  # snapshots without compute since pinned_since
    pods: dict = field(default_factory=_empty_dict)  # str(pid) -> pod UID, from compute-process lists
    procs_ts: float | None = None  # newest process snapshot read (known or not)
    occurrences: list = field(default_factory=_empty_list)
    xids: list = field(default_factory=_empty_list)
    workload_failures: list = field(default_factory=_empty_list)
    healthy_since: float | None = None
    last_unpinned_ts: float | None = None  # newest ok sample that was not pinned: the GPU came back
    last_xid_ts: float | None = None
    incident: Incident | None = None
    # resolved incidents' closing steps not answered yet, the newest 4: {incident_id: {"classification",
    # "alerts", "commands": {command_id: action}}} (streams.classify._on_closing_result)
    closing: dict | None = None
    announced: bool = False
    resolved_incidents: int = 0
    pending_notes: list = field(default_factory=_empty_list)  # evidence seen before an incident opened
    last_sample_ts: float | None = None
    last_compute_ts: float | None = None  # newest process snapshot that had a compute app
    last_nocompute_ts: float | None = None  # newest process snapshot that had none
    nocompute_id: str | None = None  # its event_id
    # [kind, first ts, last ts] of consecutive process snapshots of one kind (COMPUTE, NO_PROCESS,
    # UNKNOWN), oldest first: when a GPU had a compute process, whatever topic was read first.
    proc_runs: list = field(default_factory=_empty_list)
    compute_floor: float | None = None  # the end of the newest compute run dropped from proc_runs
    recovery_action: int = 0  # NVML's GPU recovery action, last seen in a sample
    remap_failure: bool = False
    # The blast-radius groups the fleet agent sees this GPU in (streams.storms): the node's rack and
    # driver from its inventory, the job of the newest pod a workload event named. What the node says.
    rack: str | None = None
    driver_version: str | None = None
    job: str | None = None
    # Per counter of `gpu.counters`, a fixed-size summary of its increments (streams.degrade); and
    # the NVLink domain the GPU last reported ("<fabric cluster UUID>/<clique id>").
    trends: dict = field(default_factory=_empty_dict)
    fabric_domain: str | None = None
    # Bumped at each counters reading folded: a reading changes `trends`, which `_material` does
    # not copy (a row's summaries are 150 numbers). Not persisted.
    trends_rev: int = field(default=0, repr=False, compare=False)
    silent_procs_ts: float | None = None  # a process list read while the samples had stopped (classify._on_gap)
    # What must survive a restart as of the end of the last fold (streams.classify._material): the
    # next fold's "before", so each record computes it once, not twice. Not persisted.
    material: tuple | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """The persisted row: fields at their default are left out (`from_dict` restores them),
        so a healthy GPU's row is a third of its full size (memory per GPU). An empty
        list or dict is at its default, whichever object it is."""
        out = {}
        for k in _STATE_FIELDS:
            v = getattr(self, k)
            d = _DEFAULTS.get(k, _REQUIRED)
            if k in _CONTAINERS:
                if v:
                    out[k] = v
            elif d is _REQUIRED or type(v) is not type(d) or v != d:
                out[k] = v
        if self.incident is not None:
            out["incident"] = self.incident.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "GpuState":
        # An empty list or dict (rows written before the shared empty ones) loads as its default.
        state = cls(**{k: v for k, v in data.items() if k in _STATE_FIELDS and (v or k not in _CONTAINERS)})
        if isinstance(state.incident, dict):
            state.incident = Incident.from_dict(state.incident)
        # Rows written before 99b60f0 lack these keys: fill them as that code meant them.
        for o in state.occurrences:
            if "wl" not in o:
                o["wl"] = f"pid:{o['pid']}" if o.get("pid") is not None else None
        if state.incident is not None:
            for e in state.incident.emitted:
                e.setdefault("outcome", None)
        return state

    def came_back_after(self, ts: float | None) -> bool:
        """An ok, unpinned sample after `ts`: the GPU was seen healthy since (a repair took effect)."""
        return ts is not None and self.last_unpinned_ts is not None and self.last_unpinned_ts > ts


_STATE_FIELDS = tuple(k for k in GpuState.__dataclass_fields__ if k not in ("material", "trends_rev"))
_REQUIRED = object()
_DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()
             for f in fields(GpuState) if f.default is not MISSING or f.default_factory is not MISSING}
_CONTAINERS = frozenset(k for k, d in _DEFAULTS.items() if d is EMPTY_LIST or d is EMPTY_DICT)


# A timeline line's text is bounded: it is kept in the GPU's row and copied into every alert of
# the incident, and it quotes what a node sent (four 350 KB `raw` fields from one collector made
# rows and alerts of megabytes on 1484261). A kernel record is at most 1 KiB of text (printk's
# PRINTKRB_RECORD_MAX) plus its prefix; the rest is words of ours around node-sent values.
ENTRY_RAW_CHARS = 2048
ENTRY_TEXT_CHARS = 512


def _bounded(value: Any, limit: int) -> Any:
    if type(value) is str and len(value) > limit:
        return f"{value[:limit]}... [{len(value) - limit} more characters]"
    return value


def entry(ts: float, kind: str, summary: str, **data: Any) -> dict:
    """One timeline line (becomes a schemas.EvidenceEntry in an alert), its texts bounded."""
    return {"ts": ts, "kind": kind, "summary": _bounded(summary, ENTRY_TEXT_CHARS),
            "data": {k: _bounded(v, ENTRY_RAW_CHARS if k == "raw" else ENTRY_TEXT_CHARS) for k, v in data.items()}}


def event_time(state: GpuState, ts: float, own_clock: bool, policy: Policy,
               observed: float | None = None) -> tuple[float, float]:
    """(the time a record is taken at, how far it was stamped from it: 0 when not skewed).

    A record that says when the collector read it (`observed`, live Xid records) is judged by that:
    whatever the order the processor reads topics in, a line stamped more than the bound from its
    reading, ahead or behind, is taken at the reading. Otherwise only a GPU whose collector readings
    were seen has a clock to judge by (a row keyed ``node/pci`` gets Xids only), and only a stamp
    ahead of it is bounded; the collector's own readings always move the clock."""
    if observed is not None:
        if abs(ts - observed) > policy.max_clock_skew_s:
            skew = ts - observed
            ts = observed
        else:
            skew = 0.0
        state.clock = ts if state.clock is None else max(state.clock, ts)
        return ts, skew
    if not own_clock and state.sampled and state.clock is not None and ts - state.clock > policy.max_clock_skew_s:
        return state.clock, ts - state.clock
    state.clock = ts if state.clock is None else max(state.clock, ts)
    state.sampled = state.sampled or own_clock
    return ts, 0.0


def workload_of(state: GpuState, pid: int | None) -> tuple[str | None, str | None]:
    """(workload identity, pod UID): the pod when the process lists know the PID's pod, else the
    PID (`name_by_deaths` may name its pod later)."""
    if pid is None:
        return None, None
    pod = state.pods.get(str(pid))
    return (f"pod:{pod}" if pod else f"pid:{pid}"), pod


# How long after its fault a pod's death (a failure or a restart, exit code not 0) still names the
# faulting pod: the process exits on the CUDA error at once, the kubelet sees the container exit at
# its next PLEG relist (1 s) and the pod watch reports it within seconds; 30 s leaves room for a
# loaded kubelet.
DEATH_AFTER_FAULT_S = 30.0
# How long a fault no process list named waits, on the GPU's clock, before its workload counts:
# the death that may name it (30 s), read up to a minute behind the samples (a worker that keeps up).
NAME_WAIT_S = 90.0
# How long after its fault a process list that first names the fault's PID still names its pod:
# the collector lists every GPU's processes at each sample (1 s by default), so a faulting process
# that was listed at all is listed within seconds; a PID first listed later may be a new process
# that reused it (pid_max 32768 wraps on a busy node).
LIST_AFTER_FAULT_S = 30.0


def _named_by_lists(o: dict) -> bool:
    """An occurrence whose pod a process list named: a death never takes that name back (a list
    read after a death takes the death's name back, `fold_processes`)."""
    return (o["wl"] or "").startswith("pod:") and not o.get("by_death")


def name_by_deaths(state: GpuState, policy: Policy) -> None:
    """Name the faults no process list named by the pods that died right after them. A crash-looping
    pod dies before the next process list each time, so its PIDs never reach one, but each death
    names the pod. One death names one fault, the newest before it (within `DEATH_AFTER_FAULT_S`,
    `burst_seconds` of clock difference after): one pod's restart cannot claim other pods' faults,
    and two pods dying after two faults are two workloads. Read again from all deaths and faults
    each time one is read, so the names do not depend on which was read first."""
    # A closed fault (its incident resolved) keeps the name it had: the deaths that named it are
    # forgotten with the incident, and renamed by PID a crash-looping pod's closed faults would
    # count as several workloads beside its next fault (one tenant's crash loop -> GPU_SUSPECT).
    faults = [o for o in state.occurrences if o["pid"] is not None and not _named_by_lists(o) and not o.get("closed")]
    if not faults:
        return
    for o in faults:
        if o.get("by_death"):
            o["wl"], o["pod"], o["by_death"] = f"pid:{o['pid']}", None, False
    deaths = sorted((w for w in state.workload_failures if w.get("pod_uid") and w.get("exit_code") != 0),
                    key=lambda w: (w["ts"], w.get("id") or ""))
    named: set[int] = set()
    for w in deaths:
        near = [o for o in faults if id(o) not in named
                and -policy.burst_seconds <= w["ts"] - o["ts"] <= DEATH_AFTER_FAULT_S]
        if near:
            # the newest fault before the death; else (clocks apart) the first just after it
            o = max(near, key=lambda o: (o["ts"] <= w["ts"], o["ts"] if o["ts"] <= w["ts"] else -o["ts"],
                                         o.get("id") or ""))
            named.add(id(o))
            o["wl"], o["pod"], o["by_death"] = f"pod:{w['pod_uid']}", w["pod_uid"], True


# Xid 45-only occurrences kept per GPU (the newest). Xid 45 is the driver cleaning up a preempted
# or killed job's channels (NVIDIA catalog: ROBUST_CHANNEL_PREEMPTIVE_REMOVAL): it never counts
# towards a verdict (streams.verdict), but a teardown prints one per process, and 2,000 of them
# from distinct PIDs were kept for 30 min with every one scanned on each further line.
_XID45_OCCURRENCES_KEPT = 64
# Application occurrences and workload failures kept per GPU (the newest), past the time windows:
# a fleet-wide burst of faults from distinct pods grew one GPU's row without end. Two workloads in
# the window decide the suspect rule, so it has decided long before 128 occurrences; the newest 64
# failures reach back past any fault a death names (DEATH_AFTER_FAULT_S) and any wedge.
_OCCURRENCES_KEPT = 128
_FAILURES_KEPT = 64


def prune(state: GpuState, ts: float, policy: Policy) -> None:
    keep = max(policy.app_xid_lookback_s, policy.wedged_xid43_lookback_s, policy.suspect_window_s)
    occ = [o for o in state.occurrences if ts - o["last_ts"] <= keep]
    only45 = [o for o in occ if all(c == 45 for c in o["codes"])]
    if len(only45) > _XID45_OCCURRENCES_KEPT:
        # the newest by their own times (not by arrival), so any read order keeps the same ones
        only45.sort(key=lambda o: (o["last_ts"], o["ts"], o.get("id") or ""))
        drop = {id(o) for o in only45[:-_XID45_OCCURRENCES_KEPT]}
        occ = [o for o in occ if id(o) not in drop]
    if len(occ) > _OCCURRENCES_KEPT:
        occ.sort(key=lambda o: (o["last_ts"], o["ts"], o.get("id") or ""))
        del occ[:-_OCCURRENCES_KEPT]
    state.occurrences = occ or EMPTY_LIST
    # an Xid 163 is kept while a 162 may still cancel it (streams.verdict, power smoothing)
    keep = max(keep, policy.pshc_cancel_s)
    state.xids = [x for x in state.xids if ts - x["ts"] <= keep][-_XIDS_KEPT:] or EMPTY_LIST
    state.workload_failures = [w for w in state.workload_failures
                               if ts - w["ts"] <= policy.workload_failure_lookback_s][-_FAILURES_KEPT:] or EMPTY_LIST


# -- samples and processes ----------------------------------------------------------------------
def fold_sample_pin(state: GpuState, s: GpuSample, ts: float, policy: Policy) -> bool:
    """Fold an ok sample into the pinned-run facts; True when it is pinned."""
    util, mem = s.utilization_gpu_pct, s.memory_used_mib
    total = s.memory_total_mib or state.memory_total_mib
    pinned = bool(util is not None and util >= policy.pinned_util_pct and mem is not None and total
                  and mem <= policy.pinned_mem_fraction * total)
    if not pinned:
        state.pinned_since = None
        state.pinned_samples = 0
        state.pin_ids = EMPTY_LIST
        return False
    if state.pinned_since is None:
        state.pinned_since, state.pinned_samples, state.proc_snapshots, state.pin_stats = ts, 0, 0, {}
        state.pinned_last, state.pin_ids = ts, [s.event_id]
    state.pinned_samples += 1
    state.pinned_last = max(state.pinned_last or ts, ts)
    state.pin_ids = state.pin_ids[:1] + [s.event_id]
    st = state.pin_stats
    if type(st) is not dict:  # a row pinned without statistics (hand-made, or older): start them
        st = state.pin_stats = dict(st)
    st["util_min"] = min(st.get("util_min", 100.0), util)
    st["mem_max"] = max(st.get("mem_max", 0.0), mem)
    if s.power_w is not None:
        st["power_sum"] = st.get("power_sum", 0.0) + s.power_w
        st["power_n"] = st.get("power_n", 0) + 1
    if s.sm_clock_mhz is not None:
        st["sm_max"] = max(st.get("sm_max", 0), s.sm_clock_mhz)
    if s.mem_clock_mhz is not None:
        st["memclk_max"] = max(st.get("memclk_max", 0), s.mem_clock_mhz)
    return True


# The kinds of a process snapshot. NO_PROCESS is a compute list NVML read and found empty, or,
# when NVML could not read it, a /dev/nvidia* holder scan that ran and found nobody: RESET_GPU's own
# precondition is that holder check, and a process that could run a kernel on the GPU holds the
# device open (docs/architecture.md "Verdicts": which evidence substitutes for which).
COMPUTE, NO_PROCESS, UNKNOWN = 1, 0, -1
# Runs of snapshot kinds kept per GPU: a pinned GPU alternates kinds rarely (a compute process on
# a GPU at 100% with 0 MiB is itself rare); 8 runs reach back past any wedge window in practice.
# A compute run dropped leaves its end as a floor for the pin's start (`compute_floor`), so a
# dropped run makes a verdict later, never earlier.
_RUNS_KEPT = 8


def snapshot_kind(p: GpuProcesses) -> int:
    compute = p.compute_apps
    if compute is not None:
        return COMPUTE if compute else NO_PROCESS
    holders = p.device_holders
    if holders is not None and not holders:
        return NO_PROCESS
    return UNKNOWN


def fold_run(state: GpuState, kind: int, ts: float) -> None:
    """Extend the newest run of snapshot kinds, or start one. A GPU's process lists come in order
    (one partition); one read out of order (a collector restarted with its clock stepped back) is
    kept as a run of its own, in place, unless a run of its kind already covers it (a snapshot read
    twice after a failover)."""
    runs = state.proc_runs
    if runs:
        last = runs[-1]
        if ts >= last[2]:
            if last[0] == kind:
                last[2] = ts
                return
        else:
            if any(k == kind and first <= ts <= end for k, first, end in runs):
                return
            runs.append([kind, ts, ts])
            runs.sort(key=lambda r: (r[1], r[2]))
            _drop_runs(state, runs, len(runs) - _RUNS_KEPT)
            return
    runs = state.proc_runs = added(runs, [kind, ts, ts])
    _drop_runs(state, runs, len(runs) - _RUNS_KEPT)


def _drop_runs(state: GpuState, runs: list, n: int) -> None:
    """Drop the `n` oldest runs; a compute run dropped leaves its end as the floor of any pin's
    start (`compute_floor`): forgetting it must never start a pin earlier than it really started."""
    for kind, _first, last in runs[:max(n, 0)]:
        if kind == COMPUTE and (state.compute_floor is None or last > state.compute_floor):
            state.compute_floor = last
    del runs[:max(n, 0)]


def fold_processes(state: GpuState, p: GpuProcesses, ts: float, policy: Policy | None = None) -> bool:
    """Fold a process snapshot; True when it settled or renamed an application occurrence's
    workload (see `settled`), so the suspect rule must look again. With `policy`, a death whose
    fault the list took back names again (`name_by_deaths`)."""
    before = state.procs_ts
    if before is None or ts > before:
        state.procs_ts = ts
    compute = p.compute_apps
    learned = False
    if compute is not None:
        pods = state.pods
        for app in compute:
            if app.pod_uid:
                k = str(app.pid)
                if pods.get(k) != app.pod_uid:
                    if type(pods) is not dict:
                        pods = state.pods = dict(pods)
                    pods[k] = app.pod_uid
                    learned = True
        if len(pods) > _PODS_KEPT:  # forget the oldest PIDs no longer listed
            live = {str(app.pid) for app in compute}
            excess = len(pods) - _PODS_KEPT
            for k in [k for k in pods if k not in live][:excess]:
                del pods[k]
    settling = freed = False
    for o in state.occurrences:
        # The fault was read before the process list that names its PID's pod. That list names
        # it over a death read first (the death may be another pod's; the list says whose the PID
        # was), but only a list of the fault's time: a PID listed later may be another process's.
        if learned and o["pid"] is not None and ts - o["ts"] <= LIST_AFTER_FAULT_S \
                and ((o["wl"] or "").startswith("pid:") or o.get("by_death")):
            pod = state.pods.get(str(o["pid"]))
            if pod and (o["wl"] != f"pod:{pod}" or o.get("by_death")):
                freed = freed or bool(o.get("by_death"))
                o["wl"], o["pod"], o["by_death"] = f"pod:{pod}", pod, False
                settling = True
        if (before is None or before < o["ts"]) and state.procs_ts >= o["ts"]:
            settling = True
    if freed and policy is not None:
        name_by_deaths(state, policy)  # the death the list took a fault from may name another
    kind = (COMPUTE if compute else NO_PROCESS) if compute is not None else snapshot_kind(p)
    runs = state.proc_runs
    if runs and runs[-1][0] == kind and ts >= runs[-1][2]:
        runs[-1][2] = ts  # fold_run's common case, inlined: the newest run goes on
    else:
        fold_run(state, kind, ts)
    if kind == UNKNOWN:
        # NVML could not list them and no holder scan says nobody has the device open: unknown is
        # neither "a job is running" nor "no compute process".
        return settling
    if kind == COMPUTE:
        # A process NVML registered as compute: it is probably really running (incident.md).
        last = state.last_compute_ts
        if last is None or ts >= last:  # as max(ts, last) did: the newer float object when equal
            state.last_compute_ts = ts
    else:
        if state.last_nocompute_ts is None or ts >= state.last_nocompute_ts:
            state.last_nocompute_ts, state.nocompute_id = ts, p.event_id
        if state.pinned_since is not None and ts >= state.pinned_since:
            state.proc_snapshots += 1
    return settling


def settled(state: GpuState, occ: dict) -> bool:
    """Whether an occurrence's workload is known for sure. Topics are read in parallel: a fault may
    be read before the process list, published earlier, that names its PID's pod. The process
    lists of a GPU come in order, so once one as new as the fault was read, the PID's pod is known
    (or there is none). A GPU without a resolved UUID gets no process lists: nothing to wait for."""
    if state.gpu_uuid is None:
        return True
    if not occ.get("nolists") and (state.procs_ts is None or state.procs_ts < occ["ts"]):
        return False  # the process list of its time may still name its pod
    # A fault no process list named waits for the death that may name it (`name_by_deaths`)
    return occ["pid"] is None or occ["wl"] is None or _named_by_lists(occ) \
        or (state.clock or 0) >= occ["ts"] + NAME_WAIT_S


def pending(state: GpuState) -> bool:
    """Whether an application occurrence still waits to be settled (`settled`). Asked of every
    sample of a GPU with occurrences, so only the newest few are looked at: they are kept in the
    order read, which is their time order (one topic), and an older one settles before them."""
    return any(not settled(state, o) for o in state.occurrences[-16:])


def fold_workload(state: GpuState, w: WorkloadEvent, ts: float, policy: Policy) -> dict | None:
    """A failed or restarted workload, as a fact; None for other workload events."""
    if w.event.value not in ("failed", "restarted"):
        return None
    item = {"ts": ts, "pod_uid": w.pod_uid, "pod": w.pod, "namespace": w.namespace, "reason": w.reason,
            "exit_code": w.exit_code, "event": w.event.value, "id": w.event_id}
    state.workload_failures = added(state.workload_failures, item)
    prune(state, ts, policy)
    name_by_deaths(state, policy)
    return item


def pin_onset(state: GpuState, needed: float, floor: float | None = None) -> tuple[float, float] | None:
    """(T, start): the earliest time T, at or after `floor`, at which the current pinned run had
    lasted `needed` seconds since `start` without a compute process, with a snapshot of no process
    after `start`; None when it has not (yet). `start` is the pin's start, or the newest compute
    snapshot at or before T if later.

    Order-free: samples and process lists are each read in order, so T is decided only once both
    were read through it (the pinned run through T is then known, and so is every compute snapshot
    before T); it is the same T whichever topic was read first, and it is stamped on the verdict.
    Deciding at the newest sample read instead put the same wedge at +363 s or at +780 s."""
    since = state.pinned_since
    if since is None or state.pinned_last is None or state.procs_ts is None:
        return None
    read = min(state.pinned_last, state.procs_ts)
    runs = state.proc_runs
    cand = since + needed if floor is None else max(since + needed, floor)
    for _ in range(2 * len(runs) + 2):  # each turn passes a run: it ends
        if cand > read:
            return None
        start = since if state.compute_floor is None else max(since, state.compute_floor)
        for kind, first, last in runs:  # the newest compute snapshot by then (a run covering T: its end)
            if kind == COMPUTE and first <= cand and last > start:
                start = last
        if start + needed > cand:
            cand = start + needed
            continue
        after = [max(first, start) for kind, first, last in runs if kind == NO_PROCESS and last > start]
        if not after:
            return None
        first_none = min(after)
        if first_none > cand:
            cand = first_none
            continue
        return cand, start
    return None


def nocompute_start(state: GpuState) -> float | None:
    """Start of the current pinned run without a compute app in any process snapshot read so far
    (samples and process lists both read through it), or None: the pin's start, or the newest
    compute snapshot since, with a no-process snapshot after it. (Statistics only: the verdicts
    take their own start at their own time, `pin_onset`.)"""
    since = state.pinned_since
    if since is None or state.pinned_last is None or state.procs_ts is None:
        return None
    read = min(state.pinned_last, state.procs_ts)
    start = since if state.compute_floor is None else max(since, state.compute_floor)
    for kind, first, last in state.proc_runs:
        if kind == COMPUTE and first <= read:
            start = max(start, min(last, read))
    if not any(kind == NO_PROCESS and last > start and first <= read for kind, first, last in state.proc_runs):
        return None
    return start


def sustained_pin(state: GpuState) -> float:
    """Seconds of pinned samples without compute that the guard accepts (0 below its floor): at
    least two pinned samples and `GUARD_MIN_PINNED_SPAN_S` without a compute process."""
    if state.pinned_samples < GUARD_MIN_PINNED_SAMPLES:
        return 0.0
    onset = pin_onset(state, GUARD_MIN_PINNED_SPAN_S)
    if onset is None:
        return 0.0
    return max(min(state.pinned_last or 0, state.procs_ts or 0) - onset[1], GUARD_MIN_PINNED_SPAN_S)


def sample_stats(state: GpuState) -> dict:
    s = state.pin_stats
    if not s:
        return {}
    return {
        "pinned_seconds": round((state.pinned_last or 0) - (state.pinned_since or 0), 1),
        "samples": state.pinned_samples,
        "utilization_gpu_pct_min": s.get("util_min"),
        "memory_used_mib_max": s.get("mem_max"),
        "power_w_avg": round(s["power_sum"] / s["power_n"], 1) if s.get("power_n") else None,
        "sm_clock_mhz_max": s.get("sm_max"),
        "mem_clock_mhz_max": s.get("memclk_max"),
        "process_snapshots_without_compute": state.proc_snapshots,
        "seconds_without_compute": round((state.pinned_last or 0) - (nocompute_start(state) or state.pinned_last or 0), 1),
    }
