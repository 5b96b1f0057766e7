"""Early warning on a simulated fleet: how many degradations GPU_DEGRADING warned of before the
fault, how long before, and how often it warned of a healthy GPU. Prints figures.

    .venv/bin/python bench/degrade_eval.py [--gpus 320] [--days 14] [--per-kind 20] [--seed 1]

The decision path without Kafka (`xidstream.streams.engine.Engine`: the processor's own fold and fleet agent)
over weeks of event time: every GPU publishes a `gpu.counters` reading every `--interval` s (300;
the collector's default is 60, which only makes the trends smoother) and a sample every 600 s (the
samples only keep the GPU's clock and let incidents resolve; 1 Hz over weeks would be 10^9 records).

Degradations (each on `--per-kind` GPUs, a ramp of 2 to 6 days ending in the fault):
- nvlink: NVLink recoveries on one link rising from 0.5/h to 8/h, then Xid 149 (NVLink fatal
  error; marin-community/marin#9086: 505 recoveries, rising, five days before the Xid 149);
- sbe: corrected ECC errors rising from 2/h to 40/h, then Xid 48 (double-bit error);
- pcie: PCIe replays rising from 10/h to 200/h and the link dropping to x8, then Xid 79;
- silence: the GPU's samples missing (its process lists still published) from 0.2 to 3 times an
  hour, then Xid 79 (GWDG, arXiv 2603.28781: missing samples before fallen-off-bus incidents).
Healthy noise on every other GPU: NVLink replays and CRC errors, PCIe replays and corrected ECC
errors at random (Poisson) rates well under the limits; a one-off jump of a counter (a link
retrained, 50 to 5,000 at once) on 20% of them; a driver reload (the counters restart at 0) on
10%; idle spells (the PCIe generation drops, the idle clock reason) and thermal slowdowns at full
load for 10 to 40 minutes; a sample missing now and then (under 0.1/h) and a collector restart
(samples and process lists both missing) about once a week.

Scored: per kind, the share of degraded GPUs warned before their fault and the lead time
(p10/p50/p90, hours); false warnings (GPU_DEGRADING incidents opened on healthy GPUs) per 1,000
GPU-days; node-level commands issued before a fault or on a healthy GPU (must be 0); with the
default policy (RECORD) and with `degrade_quarantine` (QUARANTINE_GPU, counted).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xidstream.collectors.parse.kernel import parse_line  # noqa: E402
from xidstream.collectors.agent import xid_fields  # noqa: E402
from xidstream.schemas.models import GpuCounters, GpuProcesses, GpuSample, NvLinkCounters, XidEvent  # noqa: E402
from xidstream.schemas.vocab import NODE_ACTIONS, Action, Classification  # noqa: E402
from xidstream.streams.engine import Engine  # noqa: E402
from xidstream.streams.policy import Policy  # noqa: E402

H = 3600.0
DAY = 86400.0
LINKS = 4
START = datetime(2026, 11, 1, tzinfo=timezone.utc)
FAULT_LINES = {
    "nvlink": (149, "NETIR_LINK_EVT  Fatal XC0 i0 Link 00 (0x0041c000 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"),
    "sbe": (48, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 1, subpartition 0."),
    "pcie": (79, "GPU has fallen off the bus."),
    "silence": (79, "GPU has fallen off the bus."),
}
# the ramp of each kind: (the counter's rate at its start, at the fault), per hour
RAMPS = {"nvlink": (0.5, 8.0), "sbe": (2.0, 40.0), "pcie": (10.0, 200.0), "silence": (0.2, 3.0)}
KINDS = tuple(RAMPS)


class Gpu:
    def __init__(self, i: int, rnd: random.Random, days: float) -> None:
        self.node = f"deg-node-{i // 8:04d}"
        self.index = i % 8
        self.uuid = f"GPU-{rnd.getrandbits(128):032x}"
        self.uuid = f"GPU-{self.uuid[4:12]}-{self.uuid[12:16]}-{self.uuid[16:20]}-{self.uuid[20:24]}-{self.uuid[24:36]}"
        self.pci = f"0000:{0x10 + self.index * 0x10:02x}:00"
        self.kind = "healthy"
        self.fault_at = None  # s into the run
        self.ramp_from = None
        # healthy noise rates per hour (well under the limits: 60, 60, 10, 60)
        self.noise = {"replay": rnd.uniform(0, 2), "crc": rnd.uniform(0, 2), "sbe": rnd.uniform(0, 0.3),
                      "pcie": rnd.uniform(0, 3), "gaps": rnd.uniform(0, 0.1)}
        self.jump = (rnd.uniform(0, days * DAY), rnd.choice(["recovery", "sbe", "pcie"]), rnd.randint(50, 5000)) \
            if rnd.random() < 0.2 else None
        self.reload_at = rnd.uniform(0, days * DAY) if rnd.random() < 0.1 else None
        self.c = {"recovery": 0, "replay": 0, "crc": 0, "sbe": 0, "pcie": 0}
        self.frac = dict.fromkeys(self.c, 0.0)

    def rate(self, what: str, t: float) -> float:
        """The counter's rate per hour at t (the ramp's, or the noise's)."""
        base = {"recovery": 0.0, "replay": self.noise["replay"], "crc": self.noise["crc"], "sbe": self.noise["sbe"],
                "pcie": self.noise["pcie"], "gaps": self.noise["gaps"]}[what]
        ramped = {"nvlink": "recovery", "sbe": "sbe", "pcie": "pcie", "silence": "gaps"}.get(self.kind)
        if ramped == what and self.ramp_from is not None and self.ramp_from <= t <= self.fault_at:
            lo, hi = RAMPS[self.kind]
            return base + lo + (hi - lo) * (t - self.ramp_from) / (self.fault_at - self.ramp_from)
        return base


def simulate(args: argparse.Namespace) -> tuple[list[Gpu], list]:
    rnd = random.Random(args.seed)
    days = args.days
    gpus = [Gpu(i, rnd, days) for i in range(args.gpus)]
    degraded = rnd.sample(gpus, len(KINDS) * args.per_kind)
    for k, kind in enumerate(KINDS):
        for g in degraded[k * args.per_kind:(k + 1) * args.per_kind]:
            g.kind = kind
            g.fault_at = rnd.uniform(7 * DAY, days * DAY - H)
            g.ramp_from = g.fault_at - rnd.uniform(2, 6) * DAY
            g.jump = None
            g.reload_at = None
    return gpus, []


def records(g: Gpu, args: argparse.Namespace, rnd: random.Random):
    """(t, record) of one GPU over the run, in time order."""
    end = args.days * DAY if g.fault_at is None else g.fault_at
    t = 0.0
    dt = args.interval
    thermal_until = -1.0
    idle_until = -1.0
    next_sample = 0.0
    while t <= end:
        if t >= next_sample:
            next_sample = t + 600
            # the process list always; the sample missing now and then (NVML stalls on this GPU: the
            # silence kind's gaps rise, a healthy GPU's are rare), or both missing (a collector
            # restart, about one a week: not silence)
            if rnd.random() < 600 / (7 * DAY):
                t += dt
                continue
            yield t, GpuProcesses(ts=START + timedelta(seconds=t), node=g.node, gpu_uuid=g.uuid, gpu_index=g.index,
                                  pci_bus_id=g.pci)
            if rnd.random() < g.rate("gaps", t) * 600 / H:
                t += dt
                continue
            yield t, GpuSample(
                ts=START + timedelta(seconds=t), node=g.node, gpu_uuid=g.uuid, gpu_index=g.index, pci_bus_id=g.pci,
                utilization_gpu_pct=0.0 if t < idle_until else 80.0, memory_used_mib=30000.0, memory_total_mib=81559.0,
                status="ok")
        if g.reload_at is not None and t >= g.reload_at:
            g.c = dict.fromkeys(g.c, 0)  # the driver reloaded: the volatile counters restart at 0
            g.reload_at = None
        for what in g.c:
            # Poisson increments at the counter's rate over this interval
            lam = g.rate(what, t) * dt / H
            g.c[what] += _poisson(rnd, lam)
        if g.jump is not None and t >= g.jump[0]:
            g.c[g.jump[1]] += g.jump[2]
            g.jump = None
        if rnd.random() < dt / (2 * DAY):  # a thermal event at full load every other day, 10-40 min
            thermal_until = t + rnd.uniform(600, 2400)
        if rnd.random() < dt / (0.5 * DAY):  # idle spells
            idle_until = t + rnd.uniform(600, 4 * H)
        idle = t < idle_until
        reasons = 0x1 if idle else 0
        if t < thermal_until and not idle:
            reasons |= 0x40
        width = 8 if g.kind == "pcie" and g.ramp_from is not None and t >= g.fault_at - 6 * H else 16
        links = [NvLinkCounters(link=k, active=True, replay_errors=g.c["replay"] if k == 1 else 0,
                                                recovery_errors=g.c["recovery"] if k == 0 else 0,
                                                crc_flit_errors=g.c["crc"] if k == 2 else 0, crc_data_errors=0)
                 for k in range(LINKS)]
        yield t, GpuCounters(
            ts=START + timedelta(seconds=t), node=g.node, gpu_uuid=g.uuid, gpu_index=g.index, pci_bus_id=g.pci,
            nvlinks=links, pcie_replay_count=g.c["pcie"], pcie_link_gen_current=1 if idle else 5, pcie_link_gen_max=5,
            pcie_link_width_current=width, pcie_link_width_max=16, ecc_corrected_volatile=g.c["sbe"],
            ecc_uncorrected_volatile=0, clock_event_reasons=reasons, retired_pages_pending=False)
        t += dt
    if g.fault_at is not None:
        code, msg = FAULT_LINES[g.kind]
        for rec in parse_line(f"NVRM: Xid (PCI:{g.pci}): {code}, pid='<unknown>', name=<unknown>, {msg}"):
            yield g.fault_at, XidEvent(**xid_fields(rec, node=g.node, ts=START + timedelta(seconds=g.fault_at),
                                                    gpu_uuid=g.uuid, gpu_index=g.index, pci_bus_id=rec.pci),
                                       source="kmsg", sources=["kmsg"])


def _poisson(rnd: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    if lam > 30:
        return max(0, int(round(rnd.gauss(lam, math.sqrt(lam)))))
    n, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rnd.random()
        if p <= limit:
            return n
        n += 1


def evaluate(gpus: list[Gpu], args: argparse.Namespace, policy: Policy) -> dict:
    import heapq

    rnd = random.Random(args.seed + 1)
    streams = [records(g, args, random.Random(rnd.getrandbits(64))) for g in gpus]
    engine = Engine(policy)
    n = 0
    t0 = time.monotonic()
    last = t0
    for _t, rec in heapq.merge(*streams, key=lambda x: x[0]):
        engine.process(rec)
        n += 1
        if time.monotonic() - last > 15:
            last = time.monotonic()
            print(f"  ... {n:,} records, day {_t / DAY:.1f} of {args.days:g}, {n / (last - t0):,.0f} records/s",
                  file=sys.stderr, flush=True)
    by_uuid = {g.uuid: g for g in gpus}
    first_warn: dict[str, float] = {}
    for a in engine.alerts:
        if a.classification == Classification.GPU_DEGRADING and a.gpu_uuid and a.state == "open":
            first_warn.setdefault(a.gpu_uuid, (a.ts - START).total_seconds())
    node_actions = 0
    quarantines = 0
    for c in engine.commands:
        g = by_uuid.get(c.gpu_uuid or "")
        at = (c.ts - START).total_seconds()
        # the fault's own commands are stamped with it (to the microsecond): not "before"
        before = g is not None and (g.fault_at is None or at < g.fault_at - 1)
        if c.action in NODE_ACTIONS and before:
            node_actions += 1
        if c.action == Action.QUARANTINE_GPU and before:
            quarantines += 1
    report = {"records": n, "seconds": time.monotonic() - t0, "kinds": {}, "node_actions_before_fault": node_actions,
              "quarantines_before_fault": quarantines}
    for kind in KINDS:
        members = [g for g in gpus if g.kind == kind]
        leads = sorted((g.fault_at - first_warn[g.uuid]) / H for g in members
                       if g.uuid in first_warn and first_warn[g.uuid] < g.fault_at)
        report["kinds"][kind] = {"gpus": len(members), "warned": len(leads), "lead_h": leads}
    healthy = [g for g in gpus if g.kind == "healthy"]
    false = sum(1 for g in healthy if g.uuid in first_warn)
    gpu_days = len(healthy) * args.days
    report["false"] = false
    report["healthy_gpu_days"] = gpu_days
    report["false_per_1000_gpu_days"] = 1000 * false / gpu_days if gpu_days else None
    return report


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def show(report: dict, title: str) -> None:
    print(f"\n{title}: {report['records']:,} records in {report['seconds']:.0f} s "
          f"({report['records'] / report['seconds']:,.0f}/s, the pure decision path)")
    print(f"{'degradation':12} {'GPUs':>5} {'warned':>7} {'share':>7}   lead time before the fault, hours p10 / p50 / p90")
    total = warned = 0
    for kind, r in report["kinds"].items():
        total += r["gpus"]
        warned += r["warned"]
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        share = r["warned"] / r["gpus"] if r["gpus"] else 0
        print(f"{kind:12} {r['gpus']:5} {r['warned']:7} {share:7.0%}   "
              f"{f(_pct(r['lead_h'], 10))} / {f(_pct(r['lead_h'], 50))} / {f(_pct(r['lead_h'], 90))}")
    all_leads = sorted(v for r in report["kinds"].values() for v in r["lead_h"])
    print(f"{'all':12} {total:5} {warned:7} {warned / total if total else 0:7.0%}   "
          f"median lead {_pct(all_leads, 50) or 0:.1f} h")
    print(f"false warnings: {report['false']} on {report['healthy_gpu_days']:,.0f} healthy GPU-days = "
          f"{report['false_per_1000_gpu_days']:.2f} per 1,000 GPU-days (goal <= 1)")
    print(f"node-level commands before a fault or on a healthy GPU: {report['node_actions_before_fault']} (goal 0); "
          f"GPU quarantines before a fault: {report['quarantines_before_fault']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=320)
    ap.add_argument("--days", type=float, default=14)
    ap.add_argument("--per-kind", type=int, default=20)
    ap.add_argument("--interval", type=float, default=300.0, help="seconds between counters readings (default 300)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quarantine", action="store_true", help="also run with degrade_quarantine (twice the time)")
    args = ap.parse_args()
    if args.days < 8:
        ap.error("--days must be >= 8: faults fall after day 7, after ramps of up to 6 days")
    if len(KINDS) * args.per_kind > args.gpus // 2:
        ap.error("--per-kind too large for --gpus: at most a sixth of the GPUs degrade")
    gpus, _ = simulate(args)
    print(f"fleet: {args.gpus} GPUs, {args.days:g} days, counters every {args.interval:g} s; degraded: "
          f"{args.per_kind} each of nvlink -> Xid 149, sbe -> Xid 48, pcie -> Xid 79, silence -> Xid 79", flush=True)
    show(evaluate(gpus, args, Policy()), "default policy (plan RECORD)")
    if args.quarantine:
        gpus, _ = simulate(args)
        show(evaluate(gpus, args, Policy(degrade_quarantine=True)), "degrade_quarantine: true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
