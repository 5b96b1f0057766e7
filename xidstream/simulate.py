"""`xidstream simulate` and `xidstream evaluate`: a fleet with known faults, and how well the
processor found them.

The simulator publishes what N nodes x G GPUs' collectors would: a sample and a process list per
GPU per tick, and kernel Xid lines turned into `gpu.xid` records by the collector's own parser
(`xidstream.collectors.parse.kernel.parse_line`), through the collector's own `KafkaSink` (spool, murmur2,
idempotent producer). Each GPU gets at most one fault, drawn with the configured rates; the
ground truth is written as JSON lines for `evaluate`.

Two workload patterns can be added on top, by count, on GPUs that drew no fault (the suspect rules):
- crash loops (`crash_loops`): one pod restarts with a new PID each time (CrashLoopBackOff's
  10/20/40/80 s back-off) and every PID hits Xid 13 on the same GPU: 5 faults in about 4 minutes,
  one pod UID in compute-apps and in the pod's workload events. Truth: APP_FAULT, nothing more;
- Xid 45 teardowns (`xid45_teardowns`): one job on up to 6 nodes x 2 GPUs ends and every rank logs
  Xid 45 (preemptive cleanup) in the same second, then the GPUs idle. Truth: APP_FAULT at most.
- NVLink-domain faults (`nvlink_domain_faults`, with racks): more than half of one rack's nodes
  (an NVL72 rack is one NVLink domain) get a hardware Xid (79) on their first GPU within a minute.
  Truth: GPU_HARDWARE_FAULT each, and one storm for the rack (streams.storms).
Racks (`rack_size`, off by default): node n is in rack ``rack-<n // rack_size>``, published in its
inventory. A teardown's job is ``sim/teardown-<k>`` on its pods' workload events (a "started" one
at the run's start names it), over `teardown_nodes` nodes (6 by default; 77 like NVSentinel#1629).
None of these changes how the default fault mix is drawn: the same seed gives the same default fleet.
"""

from __future__ import annotations

import random
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

import orjson

from xidstream.collectors.agent import xid_fields
from xidstream.collectors.parse.kernel import parse_line
from xidstream.collectors.sink import KafkaSink
from xidstream.schemas.models import (
    Alert,
    ComputeApp,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    PmonSample,
    WorkloadEvent,
    XidEvent,
)
from xidstream.schemas.errors import ConfigError
from xidstream.schemas.vocab import NODE_ACTIONS, Action, Classification
from xidstream.settings import Settings

__all__ = ["FaultRates", "Simulator", "evaluate", "read_truth", "score"]

# ground truth fault -> the classification the processor should raise (None: none at all)
EXPECTED = {
    "none": None,
    "app_fault": Classification.APP_FAULT,
    "repeat": Classification.GPU_SUSPECT,
    "wedge": Classification.GPU_WEDGED,
    "hardware": Classification.GPU_HARDWARE_FAULT,
    "phantom": Classification.PHANTOM_LOAD,
    "crash_loop": Classification.APP_FAULT,
    "xid45_teardown": Classification.APP_FAULT,
}
# Faults that are the application's only: no GPU quarantine and no node action is ever right there.
APP_ONLY = ("none", "app_fault", "crash_loop", "xid45_teardown")
HARDWARE_XIDS = (79, 48, 119, 95, 64)
# A crash loop: Xid 13 at these offsets from the onset; before fault k > 0 the pod was restarted
# (new PID) at CRASH_RESTARTS[k - 1], after CrashLoopBackOff's 10, 20, 40, 80 s and 25 s of start-up.
CRASH_FAULTS = (0.0, 35.0, 80.0, 145.0, 250.0)
CRASH_RESTARTS = (10.0, 55.0, 120.0, 225.0)
CRASH_PID_STEP = 137  # each restart's process gets a new PID
TEARDOWN_NODES, TEARDOWN_GPUS = 6, 2


@dataclass(frozen=True)
class FaultRates:
    """Probability that a GPU gets each fault during the run."""

    app_fault: float = 0.04
    repeat: float = 0.01
    wedge: float = 0.01
    hardware: float = 0.01
    phantom: float = 0.005


@dataclass
class _Gpu:
    node: str
    index: int
    uuid: str
    pci: str
    fault: str = "none"
    onset: float = 0.0  # seconds into the run
    detail: str = ""
    pid: int = 0
    onset_wall: float | None = None
    pod_uid: str | None = None


def _xid_line(pci: str, code: int, pid: int | None, msg: str) -> str:
    who = f"pid={pid}, name=python3" if pid else "pid='<unknown>', name=<unknown>"
    return f"NVRM: Xid (PCI:{pci}): {code}, {who}, {msg}"


class Simulator:
    def __init__(self, settings: Settings, nodes: int, gpus: int, *, rate: float = 1.0, duration: float = 600.0,
                 rates: FaultRates = FaultRates(), seed: int = 1, start: datetime | None = None,
                 crash_loops: int = 0, xid45_teardowns: int = 0, teardown_nodes: int = 0, rack_size: int = 0,
                 nvlink_domain_faults: int = 0) -> None:
        self.settings = settings
        self.rate = rate
        self.duration = duration
        self.start = start or datetime.now(timezone.utc).replace(microsecond=0)
        rnd = random.Random(seed)
        self.rnd = rnd
        self.gpus: list[_Gpu] = []
        kinds = [("app_fault", rates.app_fault), ("repeat", rates.repeat), ("wedge", rates.wedge),
                 ("hardware", rates.hardware), ("phantom", rates.phantom)]
        for n in range(nodes):
            for g in range(gpus):
                gpu = _Gpu(f"sim-node-{n:04d}", g, f"GPU-{uuid.UUID(int=rnd.getrandbits(128))}", f"0000:{0x10 + g * 0x10:02x}:00")
                r = rnd.random()
                acc = 0.0
                for kind, p in kinds:
                    acc += p
                    if r < acc:
                        gpu.fault = kind
                        # leave time after the onset for the evidence the policy asks for
                        gpu.onset = round(rnd.uniform(0.1 * duration, max(0.1 * duration + 1, duration - 240)), 1)
                        gpu.pid = rnd.randint(1000, 4_000_000)
                        if kind == "hardware":
                            gpu.detail = str(rnd.choice(HARDWARE_XIDS))
                        break
                self.gpus.append(gpu)
        self.published = 0
        self.teardown_nodes = teardown_nodes or TEARDOWN_NODES
        self.rack_size = rack_size
        # The added patterns draw from their own generators so that the default mix stays the same.
        # Domain faults first: they need a whole rack, a teardown only free nodes.
        if nvlink_domain_faults:
            self._place_domain_faults(random.Random(seed * 7919 + 29), nodes, nvlink_domain_faults)
        self._place_workload_patterns(random.Random(seed * 7919 + 17), nodes, crash_loops, xid45_teardowns)

    def rack_of(self, node: str) -> str | None:
        """The simulated node's rack (one NVL72 NVLink domain each), or None without racks."""
        return f"rack-{int(node.rsplit('-', 1)[1]) // self.rack_size:03d}" if self.rack_size else None

    def _place_domain_faults(self, rnd: random.Random, nodes: int, count: int) -> None:
        if not self.rack_size:
            raise ConfigError("nvlink_domain_faults needs racks (rack_size)")
        d = self.duration
        racks = [list(range(r, min(r + self.rack_size, nodes))) for r in range(0, nodes, self.rack_size)]
        for k in range(count):
            # a rack whose nodes' first GPUs are fault-free, and more than half of its nodes in it
            free = [r for r in racks if len(r) >= 2 and all(self._node_gpus(n)[0].fault == "none" for n in r)]
            if not free:
                raise ConfigError(f"no fault-free rack left for NVLink-domain fault {k + 1} of {count}: use more nodes")
            rack = rnd.choice(free)
            onset = round(rnd.uniform(0.1 * d, max(0.1 * d + 1, d - 300)), 1)
            for n in sorted(rnd.sample(rack, len(rack) // 2 + 1)):
                g = self._node_gpus(n)[0]
                g.fault, g.onset, g.detail = "hardware", round(onset + rnd.uniform(0, 60), 1), "79"

    def _place_workload_patterns(self, rnd: random.Random, nodes: int, crash_loops: int, teardowns: int) -> None:
        d = self.duration
        for k in range(teardowns):
            # A job on up to 6 nodes whose first GPUs drew no fault: every rank's Xid 45 at one onset.
            free = [n for n in range(nodes) if all(g.fault == "none" for g in self._node_gpus(n)[:TEARDOWN_GPUS])]
            if not free:
                raise ConfigError(f"no fault-free nodes left for Xid 45 teardown {k + 1} of {teardowns}: use more nodes")
            onset = round(rnd.uniform(0.1 * d, max(0.1 * d + 1, d - 120)), 1)
            job = f"teardown-{k}"
            for n in sorted(rnd.sample(free, min(self.teardown_nodes, len(free)))):
                for g in self._node_gpus(n)[:TEARDOWN_GPUS]:
                    g.fault, g.onset, g.detail = "xid45_teardown", onset, job
                    g.pid = rnd.randint(1000, 4_000_000)
                    g.pod_uid = str(uuid.UUID(int=rnd.getrandbits(128)))
        free = [g for g in self.gpus if g.fault == "none"]
        if crash_loops > len(free):
            raise ConfigError(f"{crash_loops} crash loops asked, only {len(free)} GPUs without a fault")
        for g in rnd.sample(free, crash_loops):
            # Five faults need CRASH_FAULTS[-1] s after the onset.
            g.fault = "crash_loop"
            g.onset = round(rnd.uniform(0.1 * d, max(0.1 * d + 1, d - CRASH_FAULTS[-1] - 10)), 1)
            g.pid = rnd.randint(1000, 4_000_000)
            g.pod_uid = str(uuid.UUID(int=rnd.getrandbits(128)))
            g.detail = f"{len(CRASH_FAULTS)} restarts"

    def _node_gpus(self, n: int) -> list[_Gpu]:
        per = len(self.gpus) // max(1, len({g.node for g in self.gpus}))
        return self.gpus[n * per:(n + 1) * per]

    @staticmethod
    def _crash_phase(gpu: _Gpu, t: float) -> tuple[int, bool]:
        """(restart number, running?) of a crash-looping pod at run time t."""
        rel = t - gpu.onset
        if rel < 0:
            return 0, True
        k = sum(1 for f in CRASH_FAULTS if f <= rel)  # faults so far
        if k < len(CRASH_FAULTS) and k - 1 < len(CRASH_RESTARTS) and rel >= CRASH_RESTARTS[k - 1]:
            return k, True  # restarted after fault k-1 (k >= 1 here), not yet faulted again
        return k - 1, False

    # -- record makers ---------------------------------------------------------------------------
    def _xid_records(self, gpu: _Gpu, t: float, lines: list[str]) -> list[XidEvent]:
        out = []
        for line in lines:
            for rec in parse_line(line):
                out.append(XidEvent(**xid_fields(rec, node=gpu.node, ts=self.start + timedelta(seconds=t),
                                                 gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=rec.pci),
                                    source="kmsg", sources=["kmsg", "nvml"]))
        return out

    def _events(self, gpu: _Gpu, t: float, dt: float) -> list[str]:
        """Kernel lines due in [t, t + dt)."""
        if gpu.fault == "none" or not (t <= gpu.onset < t + dt or gpu.fault in ("repeat", "crash_loop")):
            return []
        o, pci = gpu.onset, gpu.pci
        if gpu.fault == "crash_loop":
            for k, off in enumerate(CRASH_FAULTS):
                if t <= o + off < t + dt:
                    return [_xid_line(pci, 13, gpu.pid + k * CRASH_PID_STEP,
                                      "Graphics SM Warp Exception on (GPC 3, TPC 0, SM 1): Out Of Range Address")]
            return []
        if gpu.fault == "xid45_teardown":
            return [_xid_line(pci, 45, gpu.pid, "Ch 00000008")]
        if gpu.fault == "app_fault" and t <= o < t + dt:
            return [_xid_line(pci, 13, gpu.pid, "Graphics SM Warp Exception on (GPC 1, TPC 0, SM 0): Out Of Range Address"),
                    _xid_line(pci, 31, gpu.pid, "MMU Fault: ENGINE GRAPHICS faulted. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE")]
        if gpu.fault == "repeat":
            for k, off in enumerate((0, 90, 180)):
                if t <= o + off < t + dt:
                    return [_xid_line(pci, 31, gpu.pid + k, "MMU Fault: ENGINE GRAPHICS faulted")]
            return []
        if gpu.fault == "wedge" and t <= o < t + dt:
            return [_xid_line(pci, 13, gpu.pid, "Graphics SM Warp Exception: Out Of Range Address"),
                    _xid_line(pci, 43, gpu.pid, "Ch 00000018")]
        if gpu.fault == "hardware" and t <= o < t + dt:
            code = int(gpu.detail)
            return [_xid_line(pci, code, None, {79: "GPU has fallen off the bus.", 48: "An uncorrectable double bit error (DBE)",
                                                 119: "Timeout after 6s of waiting for RPC response from GPU0 GSP!",
                                                 95: "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No",
                                                 64: "Row Remapper: Failed to remap row"}[code])]
        return []

    def _telemetry(self, gpu: _Gpu, t: float) -> list:
        ts = self.start + timedelta(seconds=t)
        after = gpu.fault in ("wedge", "phantom") and t >= gpu.onset
        crashed = gpu.fault in ("app_fault", "repeat") and gpu.onset <= t < gpu.onset + 20
        pid = gpu.pid or 1000 + gpu.index
        if gpu.fault == "crash_loop":
            k, running = self._crash_phase(gpu, t)
            crashed, pid = not running, gpu.pid + k * CRASH_PID_STEP
        elif gpu.fault == "xid45_teardown":
            crashed = t >= gpu.onset  # the job is gone: the GPU idles
        if after:
            util, mem, power, apps = 100.0, 0.0, 110.0, []
        elif crashed:
            util, mem, power, apps = 0.0, 0.0, 60.0, []
        else:
            util = min(100.0, max(0.0, self.rnd.gauss(70, 12)))
            mem, power = 20000.0 + self.rnd.random() * 2000, 150 + util * 3
            apps = [pid]
        sample = GpuSample(ts=ts, node=gpu.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci,
                           utilization_gpu_pct=round(util, 1), utilization_memory_pct=round(util * 0.6, 1),
                           memory_used_mib=round(mem, 1), memory_total_mib=81559.0, power_w=round(power, 1),
                           sm_clock_mhz=1980, mem_clock_mhz=2619, temperature_c=55)
        procs = GpuProcesses(ts=ts, node=gpu.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci,
                             compute_apps=[ComputeApp(pid=p, process_name="python3", used_memory_mib=mem, pod_uid=gpu.pod_uid)
                                           for p in apps],
                             pmon=[PmonSample(pid=p, sm_util_pct=round(util, 1), mem_util_pct=30.0) for p in apps])
        return [sample, procs]

    def _workload_events(self, gpu: _Gpu, t: float, dt: float) -> list[WorkloadEvent]:
        """The pod watch's view of a crash loop (and of a torn-down job): failures and restarts."""
        if gpu.fault not in ("crash_loop", "xid45_teardown"):
            return []
        ts = self.start + timedelta(seconds=t)
        pod = dict(node=gpu.node, gpu_uuid=gpu.uuid, pod_uid=gpu.pod_uid, namespace="sim",
                   pod=f"{gpu.fault.replace('_', '-')}-{gpu.node[-4:]}-{gpu.index}", container="main")
        out = []
        if gpu.fault == "xid45_teardown":
            pod["job"] = f"sim/{gpu.detail}"  # the pods' job label (batch.kubernetes.io/job-name)
            if t == 0.0:  # the pod watch saw the job's pods start: the job is known before it ends
                out.append(WorkloadEvent(ts=ts, event="started", **pod))
            if t <= gpu.onset + 1 < t + dt:
                out.append(WorkloadEvent(ts=ts, event="failed", reason="Error", exit_code=137, **pod))
            return out
        for off in CRASH_FAULTS:
            if t <= gpu.onset + off + 1 < t + dt:
                out.append(WorkloadEvent(ts=ts, event="failed", reason="Error", exit_code=1, **pod))
        for off in CRASH_RESTARTS:
            if t <= gpu.onset + off < t + dt:
                out.append(WorkloadEvent(ts=ts, event="restarted", reason="Error", exit_code=1, **pod))
        return out

    # -- run -------------------------------------------------------------------------------------
    def run(self, sink: KafkaSink, speed: float = 0.0, progress: TextIO | None = sys.stderr,
            on_tick: Callable[[float], None] | None = None) -> None:
        """Publish the fleet, tick by tick; `speed` 1.0 is real time (0: as fast as it goes).
        `on_tick(t)` runs after each tick's records were handed to the sink (a fault test's hook)."""
        dt = 1.0 / self.rate
        steps = int(self.duration * self.rate)
        wall0 = time.monotonic()
        for gpu in self.gpus:
            sink.publish(GpuInventory(ts=self.start, node=gpu.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index,
                                      pci_bus_id=gpu.pci, name="NVIDIA H100 80GB HBM3", memory_total_mib=81559,
                                      driver_version="590.44.01", cuda_version="13.1", rack=self.rack_of(gpu.node)))
        last_report = 0.0
        for i in range(steps):
            t = i * dt
            for gpu in self.gpus:
                for rec in self._telemetry(gpu, t):
                    sink.publish(rec)
                for rec in self._workload_events(gpu, t, dt):
                    sink.publish(rec)
                lines = self._events(gpu, t, dt)
                if lines:
                    if gpu.onset_wall is None:
                        gpu.onset_wall = time.time()
                    for rec in self._xid_records(gpu, t, lines):
                        sink.publish(rec)
                if gpu.fault == "phantom" and gpu.onset_wall is None and t >= gpu.onset:
                    gpu.onset_wall = time.time()
            self.published += 2 * len(self.gpus)
            sink.poll()
            if on_tick is not None:
                on_tick(t)
            if speed > 0:
                ahead = wall0 + (t + dt) / speed - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            if progress is not None and time.monotonic() - last_report >= 10:
                last_report = time.monotonic()
                st = sink.stats()
                print(f"simulate: t={t:.0f}/{self.duration:.0f} s, {self.published:,} records, "
                      f"spool depth {st['spool_depth']}, {(time.monotonic() - wall0):.0f} s wall", file=progress, flush=True)

    def write_truth(self, path: Path) -> None:
        with Path(path).open("wb") as fh:
            meta = {"meta": {"start": self.start.isoformat(), "duration": self.duration, "rate": self.rate,
                             "gpus": len(self.gpus), "topic_prefix": self.settings.topic_prefix}}
            fh.write(orjson.dumps(meta) + b"\n")
            for g in self.gpus:
                fh.write(orjson.dumps({"gpu_uuid": g.uuid, "node": g.node, "fault": g.fault, "onset": g.onset,
                                       "detail": g.detail, "onset_wall": g.onset_wall}) + b"\n")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def read_truth(truth_path: Path) -> tuple[dict, dict[str, dict]]:
    """(meta, truth per GPU UUID) from a simulation's ground-truth file."""
    lines = Path(truth_path).read_bytes().splitlines()
    meta = orjson.loads(lines[0])["meta"]
    return meta, {t["gpu_uuid"]: t for t in (orjson.loads(x) for x in lines[1:])}


def score(meta: dict, truth: dict[str, dict], outputs: Iterable[tuple[Any, float | None]],
          out: TextIO | None = None) -> dict:
    """Score the processor's alerts and commands against the ground truth and print the report.

    `outputs` are decoded `gpu.alerts` / `gpu.remediation` records, each with the wall time (s)
    at which it was published, or None where there is none (the pure path)."""
    # sys.stdout when called, not when imported: a redirected or captured stdout is honoured
    out = out or sys.stdout
    start = datetime.fromisoformat(meta["start"])
    predicted: dict[str, set] = {}
    first_alert: dict[tuple, tuple[datetime, float | None]] = {}
    node_actions: dict[str, list] = {}
    quarantines: dict[str, int] = {}
    storms = 0
    n = 0
    for rec, wall in outputs:
        n += 1
        if rec.SCHEMA == Alert.SCHEMA:
            if rec.classification == Classification.FLEET_STORM:
                storms += 1
                continue
            if rec.gpu_uuid:
                predicted.setdefault(rec.gpu_uuid, set()).add(rec.classification)
                key = (rec.gpu_uuid, rec.classification)
                if key not in first_alert:
                    first_alert[key] = (rec.ts, wall)
        elif rec.gpu_uuid and rec.action == Action.QUARANTINE_GPU:
            quarantines[rec.gpu_uuid] = quarantines.get(rec.gpu_uuid, 0) + 1
        elif rec.action in NODE_ACTIONS and not rec.requires_approval and rec.gpu_uuid:
            node_actions.setdefault(rec.gpu_uuid, []).append(rec.action.value)
    report: dict = {"classes": {}, "gpus": len(truth), "alerts": n, "fleet_storms": storms}
    w = out.write
    w(f"evaluation of {len(truth)} GPUs ({meta['duration']:.0f} s at {meta['rate']} Hz), prefix {meta['topic_prefix']!r}\n")
    w(f"{'classification':20} {'truth':>6} {'TP':>5} {'FP':>5} {'FN':>5} {'precision':>10} {'recall':>8}  latency event p50/p95/max s   wall p50/p95 s\n")
    for cls in (Classification.APP_FAULT, Classification.GPU_SUSPECT, Classification.GPU_WEDGED,
                Classification.GPU_HARDWARE_FAULT, Classification.PHANTOM_LOAD):
        want = {u for u, t in truth.items() if EXPECTED[t["fault"]] == cls}
        got = {u for u, cs in predicted.items() if cls in cs}
        # an app fault on the way to a suspect/wedge is expected evidence, not a false positive
        if cls == Classification.APP_FAULT:
            got_fp = {u for u in got - want if truth.get(u, {}).get("fault") not in ("repeat", "wedge")}
        else:
            got_fp = got - want
        tp, fp, fn = len(want & got), len(got_fp), len(want - got)
        ev, wall = [], []
        for u in want & got:
            ts, wts = first_alert[(u, cls)]
            onset = start + timedelta(seconds=truth[u]["onset"])
            ev.append((ts - onset).total_seconds())
            if truth[u].get("onset_wall") and wts is not None:
                wall.append(wts - truth[u]["onset_wall"])
        prec = tp / (tp + fp) if tp + fp else None
        rec_ = tp / (tp + fn) if tp + fn else None
        report["classes"][cls.value] = {"truth": len(want), "tp": tp, "fp": fp, "fn": fn, "precision": prec,
                                        "recall": rec_, "event_latency": [_pct(ev, 50), _pct(ev, 95), max(ev, default=None)],
                                        "wall_latency": [_pct(wall, 50), _pct(wall, 95)]}
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        w(f"{cls.value:20} {len(want):6} {tp:5} {fp:5} {fn:5} {f(prec):>10} {f(rec_):>8}  "
          f"{f(_pct(ev, 50)):>6}/{f(_pct(ev, 95)):>6}/{f(max(ev, default=None)):>6}      {f(_pct(wall, 50)):>6}/{f(_pct(wall, 95)):>6}\n")
    app_only = {u for u, t in truth.items() if t["fault"] in APP_ONLY}
    bad = {u: node_actions[u] for u in app_only if u in node_actions}
    report["node_actions_on_app_fault_gpus"] = sum(len(v) for v in bad.values())
    report["quarantines_on_app_fault_gpus"] = sum(quarantines.get(u, 0) for u in app_only)
    w(f"node-level actions (not held for approval) on GPUs whose only fault was an application fault or none: "
      f"{report['node_actions_on_app_fault_gpus']}\n")
    w(f"GPU quarantines on GPUs whose only fault was an application fault or none: "
      f"{report['quarantines_on_app_fault_gpus']}\n")
    w(f"fleet storm alerts: {storms}\n")
    # Per injected fault: what the GPUs were called and what was done to them. For the crash-loop
    # and Xid 45 mixes this is the figure that matters: one workload is never the GPU's fault.
    by_fault: dict[str, dict] = {}
    for u, t in truth.items():
        row = by_fault.setdefault(t["fault"], {"gpus": 0, "alerted": {}, "quarantined": 0, "node_actions": 0})
        row["gpus"] += 1
        for c in predicted.get(u, ()):
            row["alerted"][c.value] = row["alerted"].get(c.value, 0) + 1
        row["quarantined"] += bool(quarantines.get(u))
        row["node_actions"] += len(node_actions.get(u, ()))
    report["by_fault"] = by_fault
    w(f"{'injected fault':20} {'GPUs':>6}  {'quarantined':>11} {'node actions':>12}  alerted as (GPUs)\n")
    for fault in list(EXPECTED):
        row = by_fault.get(fault)
        if row is None:
            continue
        alerted = ", ".join(f"{c} {k}" for c, k in sorted(row["alerted"].items())) or "-"
        w(f"{fault:20} {row['gpus']:6}  {row['quarantined']:11} {row['node_actions']:12}  {alerted}\n")
    return report


def evaluate(truth_path: Path, settings: Settings, out: TextIO | None = None, timeout: float = 60.0) -> dict:
    """Precision and recall per classification, node actions on app-fault-only GPUs, latencies:
    the processor's output read back from Kafka, scored by `score`."""
    out = out or sys.stdout  # when called, not when imported (a captured stdout is honoured)
    from xidstream.schemas.codec import decode_any
    from xidstream.transport.kafka import read_all

    meta, truth = read_truth(truth_path)
    reg = settings.topics
    msgs = read_all(settings, [reg.name("gpu.alerts"), reg.name("gpu.remediation")], timeout=timeout, idle=3)
    report = score(meta, truth, ((decode_any(m.value()), m.timestamp()[1] / 1000.0) for m in msgs), out)
    w = out.write
    try:
        from xidstream.schemas.topics import INPUT_TOPICS
        from xidstream.transport.kafka import consumer_lag

        lag = consumer_lag(settings, f"{settings.topic_prefix}xidstream-processor",
                           [reg.name(n) for n in INPUT_TOPICS])
    except Exception:  # noqa: BLE001 - the report stands without it
        lag = None
    report["processor_lag"] = lag
    w(f"processor lag now (records not yet committed by {settings.topic_prefix}xidstream-processor): "
      f"{'unknown (no commit yet)' if lag is None else f'{lag:,}'}\n")
    return report
