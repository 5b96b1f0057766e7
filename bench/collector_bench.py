"""Collector benchmark: prints figures; not a test.

    .venv/bin/python bench/collector_bench.py [--seconds 180] [--gpus 8] [--bootstrap HOST:PORT]

1. Runs the real collector loop for `--seconds` at 1 Hz: `--gpus` fake GPUs (pynvml look-alike)
   with two compute processes each, the kernel tail read from a file another thread appends real
   kernel lines to (tests/data/kernel-log-lines.tsv), the real KafkaSink and spool to the local
   broker (started if needed). Prints average CPU (% of one core), peak RSS, tick time p50/p99.
2. Parser throughput on (a) the real capture, almost all NVRM lines, and (b) a realistic mix where
   1 line in 20 is the driver's.

Targets (issue 3): CPU <= 1% of one core, peak RSS <= 60 MiB, p99 tick <= 50 ms, parser >= 200k lines/s.
"""

from __future__ import annotations

import argparse
import csv
import resource
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collectors.agent import Collector, CollectorConfig  # noqa: E402
from collectors.fakes import FakeGpu, FakeProcess, FakePynvml  # noqa: E402
from collectors.nvml import NvmlReader  # noqa: E402
from collectors.parse.kernel import parse_line  # noqa: E402
from collectors.sink import KafkaSink  # noqa: E402
from collectors.sources.kernel import FileSource  # noqa: E402
from collectors.scenario import FakeProcFs  # noqa: E402
from xidstream.kafka import create_topics  # noqa: E402
from xidstream.settings import Settings  # noqa: E402


def real_lines() -> list[str]:
    with (ROOT / "tests" / "data" / "kernel-log-lines.tsv").open(newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [r[0] for r in rows]


def bench_parser(lines: list[str], total: int = 400_000) -> float:
    batch = (lines * (total // len(lines) + 1))[:total]
    t0 = time.perf_counter()
    for line in batch:
        parse_line(line)
    return total / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=180)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--bootstrap", default=None, help="default: the local broker, started if needed")
    args = ap.parse_args()

    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from xidstream.localbroker import LocalBroker

        broker = LocalBroker()
        started_here = broker.pid() is None
        bootstrap = broker.start()
    settings = Settings(bootstrap=bootstrap, topic_prefix=f"bench{int(time.time())}.", node="bench-node")
    create_topics(settings)

    lines = real_lines()
    noise = [ln for ln in lines if "NVRM" not in ln and "SXid" not in ln] or ["usb 1-1: new device"]
    mixed = [noise[i % len(noise)] if i % 20 else lines[i % len(lines)] for i in range(2000)]
    print(f"parser, real capture ({len(lines)} distinct lines, mostly NVRM): {bench_parser(lines):,.0f} lines/s")
    print(f"parser, realistic mix (1 in 20 lines from the driver):      {bench_parser(mixed):,.0f} lines/s")

    tmp = Path(tempfile.mkdtemp(prefix="xidstream-bench-"))
    kern = tmp / "kern.log"
    kern.write_text("")
    stop = threading.Event()

    def writer():  # a busy kernel log: 20 lines a second, one in ten an Xid
        i = 0
        with kern.open("a") as fh:
            while not stop.is_set():
                for _ in range(20):
                    fh.write((lines[i % len(lines)] if i % 10 == 0 else noise[i % len(noise)]) + "\n")
                    i += 1
                fh.flush()
                stop.wait(1.0)

    fake = FakePynvml([FakeGpu(i, f"GPU-{i:08x}-0000-0000-0000-000000000000", f"00000000:{i + 1:02x}:00.0",
                               utilization_gpu_pct=80, memory_used_mib=20000, power_w=400,
                               processes=[FakeProcess(1000 + i, "python3", 10000, 40), FakeProcess(2000 + i, "python3", 9000, 38)])
                       for i in range(args.gpus)])
    procfs = FakeProcFs(holders={f"/dev/nvidia{i}": [1000 + i, 77] for i in range(args.gpus)})
    sink = KafkaSink(settings, tmp / "spool")
    collector = Collector(CollectorConfig(node="bench-node"), sink, nvml=NvmlReader(fake),
                          kernel=FileSource(kern, cursor_file=tmp / "cursor", backfill=False), procfs=procfs)
    threading.Thread(target=writer, daemon=True).start()
    import psutil

    proc = psutil.Process()
    collector.start(datetime.now(timezone.utc))
    # warm-up tick, then measure
    collector.tick(datetime.now(timezone.utc))
    cpu0 = proc.cpu_times()
    wall0 = time.monotonic()
    ticks = []
    print(f"collector: {args.gpus} GPUs at 1 Hz for {args.seconds} s ...", flush=True)
    for n in range(args.seconds):
        t0 = time.perf_counter()
        collector.tick(datetime.now(timezone.utc))
        ticks.append(time.perf_counter() - t0)
        if n and n % 30 == 0:
            print(f"  {n} s: {sink.stats()['published']}", flush=True)
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
    cpu1 = proc.cpu_times()
    wall = time.monotonic() - wall0
    stop.set()
    collector.stop()
    sink.flush(30)
    stats = sink.stats()
    sink.close()
    cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall * 100
    ticks.sort()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"average CPU: {cpu:.2f}% of one core (includes the pynvml look-alike and the librdkafka threads)")
    print(f"peak RSS: {peak_rss:.1f} MiB (process total: Python, pydantic, librdkafka)")
    print(f"tick time: p50 {1000 * statistics.median(ticks):.2f} ms, p99 {1000 * ticks[int(len(ticks) * 0.99) - 1]:.2f} ms, "
          f"max {1000 * ticks[-1]:.2f} ms")
    print(f"published: {stats['published']}, dropped: {stats['dropped']}")
    if broker is not None and started_here:
        broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
