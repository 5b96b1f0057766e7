"""Parquet landing rate and memory: synthetic gpu.samples through `ParquetLander`, no Kafka.

    .venv/bin/python bench/lake_bench.py [--roll-mb 64 256] [--gpus 2000]

For each roll size a fresh child process lands just over one roll of input (the encoded record
size is what `xidstream export` counts against `--roll-mb`), flushing when `should_roll()` says
so, as the export loop does. Prints rows/s and input MB/s of the landing alone (building the
records is not timed), the files and their sizes, and the child's peak RSS: the figure that grew
with `--roll-mb` when rows were buffered as dicts until the flush. One child per roll size, so one
run's peak does not hide the next one's.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(roll_mb: float, gpus: int) -> int:
    from xidstream.exporters.parquet import ParquetLander
    from xidstream.schemas import GpuSample
    from xidstream.schemas.codec import encode

    def sample(i: int) -> GpuSample:
        g = i % gpus
        # one reading per GPU per second: the rows cross an hour boundary at the larger roll sizes
        return GpuSample(ts=T0 + timedelta(seconds=i // gpus), node=f"node-{g // 8}",
                         gpu_uuid=f"GPU-{g:08d}-0000-0000-0000-000000000000", gpu_index=g % 8,
                         pci_bus_id="0000:01:00", utilization_gpu_pct=float(i % 100), utilization_memory_pct=12.0,
                         memory_used_mib=9000.0 + i % 1000, memory_total_mib=32607.0, power_w=250.0 + i % 50,
                         sm_clock_mhz=2000, mem_clock_mhz=14000, temperature_c=60 + i % 20)

    size = len(encode(sample(0)))
    roll = int(roll_mb * (1 << 20))
    rows = roll // size + 10_000
    base = _rss_mib()
    with tempfile.TemporaryDirectory() as out:
        lander = ParquetLander(out, max_bytes=roll, max_seconds=3600)
        busy = 0.0
        flushes = 0
        step = max(rows // 10, 1)
        for i in range(rows):
            s = sample(i)
            t = time.perf_counter()
            lander.add("gpu.samples", s, partition=0, offset=i, size=size)
            if lander.should_roll():
                lander.flush()
                flushes += 1
            busy += time.perf_counter() - t
            if (i + 1) % step == 0:
                print(f"  roll {roll_mb:g} MB: {i + 1:,}/{rows:,} rows, peak RSS {_rss_mib():.0f} MiB",
                      file=sys.stderr, flush=True)
        t = time.perf_counter()
        lander.flush()
        busy += time.perf_counter() - t
        sizes = sorted(p.stat().st_size for p in Path(out).rglob("*.parquet"))
    peak = _rss_mib()
    mb_in = rows * size / 1e6
    print(f"roll {roll_mb:g} MB: {rows:,} rows ({mb_in:.0f} MB input, {size} B each) landed in {busy:.1f} s = "
          f"{rows / busy:,.0f} rows/s, {mb_in / busy:.1f} MB/s; {len(sizes)} files "
          f"(largest {sizes[-1] / 1e6:.1f} MB, total {sum(sizes) / 1e6:.1f} MB zstd), {flushes} roll(s); "
          f"peak RSS {peak:.0f} MiB ({base:.0f} MiB before landing)", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--roll-mb", type=float, nargs="+", default=[64.0, 256.0])
    ap.add_argument("--gpus", type=int, default=2000)
    ap.add_argument("--child", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, args.gpus)
    for roll in args.roll_mb:
        rc = subprocess.run([sys.executable, __file__, "--child", str(roll), "--gpus", str(args.gpus)]).returncode
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
