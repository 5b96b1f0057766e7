"""Pure decision path throughput: `xidstream.streams.classify.step` over decoded records, no Kafka.

    .venv/bin/python bench/pure_path_bench.py [--gpus 2000] [--seconds 60] [--runs 3]

Builds the records first (samples and process lists every second per GPU, an Xid 13 -> 31 -> 43
wedge on 1% of the GPUs), then times only the fold: events/s, best and median of the runs. The
figure is what one worker could do if faust cost nothing (the processor bench compares against it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timedelta, timezone

from xidstream.schemas import ComputeApp, GpuProcesses, GpuSample, XidEvent
from xidstream.streams.classify import step
from xidstream.streams.policy import Policy

T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)


def build(gpus: int, seconds: int) -> list:
    recs = []
    for s in range(seconds):
        ts = T0 + timedelta(seconds=s)
        for g in range(gpus):
            uuid = f"GPU-{g:08d}-0000-0000-0000-000000000000"
            wedged = g % 100 == 0 and s > 10
            recs.append(GpuSample(ts=ts, node=f"node-{g // 8}", gpu_uuid=uuid, gpu_index=g % 8, pci_bus_id="0000:01:00",
                                  utilization_gpu_pct=100.0 if wedged else 40.0, memory_used_mib=0.0 if wedged else 9000.0,
                                  memory_total_mib=32607.0, power_w=110.0, sm_clock_mhz=2400, mem_clock_mhz=14000))
            apps = [] if wedged else [ComputeApp(pid=1000 + g, process_name="python3", pod_uid=f"pod-{g}")]
            recs.append(GpuProcesses(ts=ts, node=f"node-{g // 8}", gpu_uuid=uuid, gpu_index=g % 8, compute_apps=apps))
            if g % 100 == 0 and s in (8, 9, 10):
                code = {8: 13, 9: 31, 10: 43}[s]
                recs.append(XidEvent(ts=ts, node=f"node-{g // 8}", gpu_uuid=uuid, gpu_index=g % 8, pci_bus_id="0000:01:00",
                                     resolved=True, xid=code, pid=1000 + g, process_name="python3", source="kmsg"))
    return recs


def fold(recs: list, policy: Policy) -> tuple[float, int]:
    states: dict = {}
    outputs = 0
    t = time.perf_counter()
    for r in recs:
        key = r.gpu_uuid
        state, out, _ = step(states.get(key), key, r, policy)
        states[key] = state
        outputs += len(out)
    return time.perf_counter() - t, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2000)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    recs = build(args.gpus, args.seconds)
    print(f"{len(recs):,} records ({args.gpus} GPUs x {args.seconds} s), {args.runs} runs", flush=True)
    rates = []
    for i in range(args.runs):
        secs, outs = fold(recs, Policy())
        rates.append(len(recs) / secs)
        print(f"  run {i + 1}: {secs:.2f} s, {rates[-1]:,.0f} events/s, {outs} outputs", flush=True)
    print(f"pure path: best {max(rates):,.0f} events/s, median {statistics.median(rates):,.0f} events/s")


if __name__ == "__main__":
    main()
