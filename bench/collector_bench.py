"""Collector benchmark: prints figures; not a test.

    .venv/bin/python bench/collector_bench.py [--seconds 180] [--gpus 8] [--bootstrap HOST:PORT] [--fds 50000]
                                              [--counters-interval 60]

1. Runs the real collector loop for `--seconds` at 1 Hz: `--gpus` fake GPUs (pynvml look-alike)
   with two compute processes each, the kernel tail read from a file another thread appends real
   kernel lines to (tests/data/kernel-log-lines.tsv), the real KafkaSink and spool to the local
   broker (started if needed). Prints average CPU (% of one core), peak RSS, tick time p50/p99.
   Each GPU has 18 NVLinks (an H100 SXM's) in an NVLink fabric, and the collector reads its
   counters (gpu.counters) every `--counters-interval` seconds (default 60, as `xidstream collect`;
   0: off). Also prints the time of one counters round over every GPU on its own, and that round's
   share of a core at the interval.
2. Parser throughput on (a) the real capture, almost all NVRM lines, and (b) a realistic mix where
   1 line in 20 is the driver's.

With `--fds N` the holders of /dev/nvidia* come from the real `ProcFs` over a synthetic
proc tree of N descriptors (8 trainer processes holding /dev/nvidia<i> with most of them, many small
ones), churned by a separate process (its CPU is not counted): trainers open and close 20
descriptors a second, a small process exits and another starts every 5 s. It also prints the cost
of one cold and one warm holder scan and the readlink calls per scan. A symlink in a tmpfs/disk
tree is cheaper to readlink than a /proc/PID/fd entry (about 8.6 us each on a real node),
so the readlink count is the figure that carries over: multiply by 8.6 us for a real node.

Targets: CPU <= 1% of one core, peak RSS <= 60 MiB, p99 tick <= 50 ms, parser
>= 200k lines/s; the same CPU and RSS with --fds 50000.
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

from xidstream.collectors.agent import Collector, CollectorConfig  # noqa: E402
from xidstream.collectors.fakes import FakeFabric, FakeGpu, FakeNvLink, FakeProcess, FakePynvml  # noqa: E402
from xidstream.collectors.nvml import NvmlReader  # noqa: E402
from xidstream.collectors.parse.kernel import parse_line  # noqa: E402
from xidstream.collectors.sink import KafkaSink  # noqa: E402
from xidstream.collectors.sources.kernel import FileSource  # noqa: E402
from xidstream.collectors.scenario import FakeProcFs  # noqa: E402
from xidstream.collectors.sources.procfs import ProcFs  # noqa: E402
from xidstream.transport.kafka import create_topics  # noqa: E402
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


def bench_counters_round(fake: FakePynvml, gpus: int, rounds: int = 50) -> float:
    """Milliseconds of one NvmlReader.counters round over every GPU, after the first (which probes
    the NVLinks), median of `rounds`; NVML itself is the look-alike, so this is the reader's cost."""
    fake.nvmlInit()
    reader = NvmlReader(fake)
    gpus_read = reader.init()
    for g in gpus_read:
        reader.counters(g)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for g in gpus_read:
            reader.counters(g)
        times.append(time.perf_counter() - t0)
    reader.shutdown()
    return 1000 * statistics.median(times)


TRAINERS = 8


def build_proc_tree(root: Path, total_fds: int, gpus: int) -> tuple[Path, dict]:
    """A /proc look-alike: TRAINERS processes with 64% of the descriptors, each holding
    /dev/nvidiactl and /dev/nvidia<i>; the rest in small processes of 90 descriptors."""
    import os

    proc, dev = root / "proc", root / "dev"
    dev.mkdir(parents=True)
    for name in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm", "null"]:
        (dev / name).write_text("")
    per_trainer = int(total_fds * 0.64) // TRAINERS
    small = max(1, (total_fds - per_trainer * TRAINERS) // 90)
    layout = {}
    pid = 1000
    for t in range(TRAINERS):
        layout[pid] = per_trainer
        fd_dir = proc / str(pid) / "fd"
        fd_dir.mkdir(parents=True)
        for fd in range(per_trainer):
            if fd < 3:
                target = str(dev / "null")
            elif fd == 3:
                target = str(dev / "nvidiactl")
            elif fd == 4:
                target = str(dev / f"nvidia{t % gpus}")
            elif fd == 5:
                target = str(dev / "nvidia-uvm")
            else:
                target = f"socket:[{pid * 100000 + fd}]" if fd % 3 else f"/data/shard-{fd}.bin"
            os.symlink(target, fd_dir / str(fd))
        (proc / str(pid) / "comm").write_text("python3\n")
        pid += 1
    for _ in range(small):
        fd_dir = proc / str(pid) / "fd"
        fd_dir.mkdir(parents=True)
        for fd in range(90):
            os.symlink(f"pipe:[{pid * 1000 + fd}]" if fd > 2 else str(dev / "null"), fd_dir / str(fd))
        (proc / str(pid) / "comm").write_text("worker\n")
        layout[pid] = 90
        pid += 1
    return proc, {"trainers": TRAINERS, "per_trainer": per_trainer, "small": small,
                  "total": per_trainer * TRAINERS + small * 90, "dev": str(dev)}


def churn_proc_tree(proc: Path, stop) -> None:
    """Runs in its own process: trainers replace 20 descriptors a second (new numbers, like a
    data loader's files and sockets); a small process exits and a new one starts every 5 s."""
    import os
    import random
    import shutil

    rnd = random.Random(1)
    trainers = sorted(int(p.name) for p in proc.iterdir())[:TRAINERS]
    high = {pid: max(int(f) for f in os.listdir(proc / str(pid) / "fd")) for pid in trainers}
    tick = 0
    while not stop.is_set():
        for _ in range(20):
            pid = rnd.choice(trainers)
            fds = os.listdir(proc / str(pid) / "fd")
            victim = rnd.choice([f for f in fds if int(f) > 5])
            os.unlink(proc / str(pid) / "fd" / victim)
            high[pid] += 1
            os.symlink(f"socket:[{rnd.getrandbits(40)}]", proc / str(pid) / "fd" / str(high[pid]))
        tick += 1
        if tick % 5 == 0:
            small = [int(p.name) for p in proc.iterdir() if int(p.name) not in high]
            gone = rnd.choice(small)
            shutil.rmtree(proc / str(gone))
            new = max(int(p.name) for p in proc.iterdir()) + 1
            (proc / str(new) / "fd").mkdir(parents=True)
            for fd in range(90):
                os.symlink(f"pipe:[{new * 1000 + fd}]", proc / str(new) / "fd" / str(fd))
        stop.wait(1.0)


def bench_scans(proc: Path, dev_prefix: str, total: int) -> ProcFs:
    fs = ProcFs(proc, dev_prefix=dev_prefix)
    t0 = time.process_time()
    cold = fs.device_holders()
    cold_s = time.process_time() - t0
    cold_links = getattr(fs, "readlinks", total)
    t0 = time.process_time()
    fs.device_holders()
    warm_s = time.process_time() - t0
    warm_links = getattr(fs, "readlinks", 2 * total) - cold_links
    print(f"holder scan, {total:,} descriptors: cold {1000 * cold_s:.1f} ms CPU ({cold_links:,} readlinks, "
          f"{1e6 * cold_s / max(1, total):.2f} us/descriptor), warm {1000 * warm_s:.1f} ms CPU ({warm_links:,} readlinks); "
          f"{len(cold)} devices held")
    return fs


def _hold_fds(n: int, ready, stop) -> None:
    """A child process that keeps `n` descriptors open (sockets, pipes, /dev/null) in the real /proc."""
    import os
    import socket

    held = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            held.append(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
        elif kind == 1:
            held.append(os.open("/dev/null", os.O_RDONLY))
        else:
            held.append(os.open(".", os.O_RDONLY))
    ready.set()
    stop.wait()


def bench_real_proc(total: int) -> None:
    """Holder scans over the real /proc with child processes holding `total` descriptors: the old
    full scan (a readlink per descriptor) against the incremental ProcFs."""
    import multiprocessing as mp
    import os

    per = 6250  # under the usual 20,000 RLIMIT_NOFILE
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    kids = []
    for _ in range(max(1, total // per)):
        ready = ctx.Event()
        kid = ctx.Process(target=_hold_fds, args=(per, ready, stop), daemon=True)
        kid.start()
        ready.wait(60)
        kids.append(kid)

    def full_scan() -> int:  # the pre-issue-9 algorithm
        n = 0
        for e in os.listdir("/proc"):
            if not e.isdigit():
                continue
            d = f"/proc/{e}/fd/"
            try:
                fds = os.listdir(d)
            except OSError:
                continue
            for fd in fds:
                try:
                    os.readlink(d + fd)
                    n += 1
                except OSError:
                    pass
        return n

    t0 = time.process_time()
    links = full_scan()
    full_s = time.process_time() - t0
    fs = ProcFs("/proc")
    t0 = time.process_time()
    fs.device_holders()
    cold_s = time.process_time() - t0
    warm = []
    for _ in range(5):
        t0 = time.process_time()
        fs.device_holders()
        warm.append(time.process_time() - t0)
    stop.set()
    for kid in kids:
        kid.join(5)
    per_scan = statistics.median(warm)
    print(f"real /proc, {links:,} descriptors: full scan {1000 * full_s:.1f} ms CPU ({1e6 * full_s / max(1, links):.2f} us/descriptor); "
          f"incremental: cold {1000 * cold_s:.1f} ms, warm {1000 * per_scan:.1f} ms CPU (median of 5) = "
          f"{100 * per_scan / 10:.2f}% of a core at one scan per 10 s (full scan: {100 * full_s / 10:.2f}%)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=180)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--bootstrap", default=None, help="default: the local broker, started if needed")
    ap.add_argument("--fds", type=int, default=0, help="holders from a synthetic proc tree of this many descriptors")
    ap.add_argument("--counters-interval", type=float, default=60.0,
                    help="seconds between counters reads, as `xidstream collect` (default 60; 0: off)")
    ap.add_argument("--real-proc", type=int, default=0, metavar="N",
                    help="only time holder scans of the real /proc with child processes holding N descriptors")
    args = ap.parse_args()
    if args.real_proc:
        bench_real_proc(args.real_proc)
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="xidstream-bench-"))
    churn_stop = churner = None
    procfs = FakeProcFs(holders={f"/dev/nvidia{i}": [1000 + i, 77] for i in range(args.gpus)})
    if args.fds:
        import multiprocessing as mp

        proc_root, info = build_proc_tree(tmp / "tree", args.fds, args.gpus)
        print(f"synthetic proc tree: {info['total']:,} descriptors ({info['trainers']} trainers x "
              f"{info['per_trainer']:,}, {info['small']} small processes x 90)")
        procfs = bench_scans(proc_root, info["dev"] + "/nvidia", info["total"])
        procfs = ProcFs(proc_root, dev_prefix=info["dev"] + "/nvidia")
        ctx = mp.get_context("fork")  # before librdkafka starts its threads
        churn_stop = ctx.Event()
        churner = ctx.Process(target=churn_proc_tree, args=(proc_root, churn_stop), daemon=True)
        churner.start()

    from workshop.localbroker import broker_for_run

    bootstrap, broker = broker_for_run(args.bootstrap)  # broker: ours to stop, else None
    settings = Settings(bootstrap=bootstrap, topic_prefix=f"bench{int(time.time())}.", node="bench-node")
    create_topics(settings)

    lines = real_lines()
    noise = [ln for ln in lines if "NVRM" not in ln and "SXid" not in ln] or ["usb 1-1: new device"]
    mixed = [noise[i % len(noise)] if i % 20 else lines[i % len(lines)] for i in range(2000)]
    print(f"parser, real capture ({len(lines)} distinct lines, mostly NVRM): {bench_parser(lines):,.0f} lines/s")
    print(f"parser, realistic mix (1 in 20 lines from the driver):      {bench_parser(mixed):,.0f} lines/s")

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
                               processes=[FakeProcess(1000 + i, "python3", 10000, 40), FakeProcess(2000 + i, "python3", 9000, 38)],
                               nvlinks=[FakeNvLink(recovery=link) for link in range(18)], retired_pages=None,
                               fabric=FakeFabric("5f0c3a8e-1b2d-4c6e-9a7f-0d1e2f3a4b5c", clique_id=1))
                       for i in range(args.gpus)])
    round_ms = bench_counters_round(fake, args.gpus)
    if args.counters_interval:
        print(f"counters: one round over {args.gpus} GPUs (18 NVLinks each) {round_ms:.2f} ms, read on its own: "
              f"{100 * round_ms / 1000 / args.counters_interval:.4f}% of a core at one round every "
              f"{args.counters_interval:g} s")
    sink = KafkaSink(settings, tmp / "spool")
    dev_prefix = (info["dev"] + "/nvidia") if args.fds else "/dev/nvidia"
    config = CollectorConfig(node="bench-node", dev_prefix=dev_prefix, counters_interval=args.counters_interval or None)
    collector = Collector(config, sink, nvml=NvmlReader(fake),
                          kernel=FileSource(kern, cursor_file=tmp / "cursor", backfill=False), procfs=procfs)
    threading.Thread(target=writer, daemon=True).start()
    import psutil

    proc = psutil.Process()
    collector.start(datetime.now(timezone.utc))
    # warm-up tick, then measure
    collector.tick(datetime.now(timezone.utc))
    links0, scans0 = getattr(procfs, "readlinks", 0), getattr(procfs, "scans", 0)  # after the cold scan
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
    if churner is not None:
        churn_stop.set()
        churner.join(5)
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
    if args.fds:
        links = getattr(procfs, "readlinks", 0) - links0
        scans = getattr(procfs, "scans", 0) - scans0
        if scans:
            print(f"holder scans in the measured window: {scans}, {links:,} readlinks ({links / scans:,.0f} per scan; "
                  f"the cold first scan, {links0:,}, was in the warm-up tick); at 8.6 us each on a real node: "
                  f"{100 * links * 8.6e-6 / wall:.3f}% of a core")
    if broker is not None:
        broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
