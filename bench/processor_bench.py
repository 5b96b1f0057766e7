"""Stream-processor benchmark on the real broker: prints figures; not a test.

    .venv/bin/python bench/processor_bench.py [--gpus 10000] [--seconds 10] [--latency-seconds 60]

1. Throughput: `--gpus` simulated GPUs x `--seconds` of 1 Hz telemetry (a sample and a process list
   each, through the collector's KafkaSink) are loaded into fresh topics; then a raw
   confluent-kafka consumer reads them all (the ceiling), and one `xidstream process` worker
   processes them from the start; events/s = events / time until its committed lag is 0.
2. Latency: the simulator publishes `--gpus` GPUs at 1 Hz in real time for `--latency-seconds`
   while a fatal Xid (79, fallen off the bus) is injected on a random GPU every 2 s; the latency is
   from producing the Xid to its REBOOT_NODE command arriving on gpu.remediation.
3. Memory per tracked GPU: the worker's RSS after the load, minus its RSS with no GPU, over GPUs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from confluent_kafka import Consumer, Producer  # noqa: E402

from collectors.sink import KafkaSink  # noqa: E402
from schemas import INPUT_TOPICS, XidEvent, encode  # noqa: E402
from schemas.xid_catalog import lookup  # noqa: E402
from streams.app import internal_topics  # noqa: E402
from transport.kafka import LagProbe, consumer_config, consumer_lag, create_topics, delete_topics, producer_config  # noqa: E402
from xidstream.runner import WorkerProcess  # noqa: E402
from xidstream.settings import Settings  # noqa: E402
from xidstream.simulate import FaultRates, Simulator  # noqa: E402

NO_FAULTS = FaultRates(0, 0, 0, 0, 0)


def raw_consume(settings: Settings, topics: list[str], total: int) -> float:
    c = Consumer(consumer_config(settings, f"bench-raw-{uuid.uuid4().hex[:8]}"))
    c.subscribe(topics)
    n = 0
    t0 = None
    while n < total:
        batch = c.consume(num_messages=1000, timeout=1.0)
        if batch and t0 is None:
            t0 = time.perf_counter()
        n += sum(1 for m in batch if m.error() is None)
    dt = time.perf_counter() - t0
    c.close()
    return n / dt


def worker_rss(worker: WorkerProcess) -> float:
    proc = psutil.Process(worker.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 1048576


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--seconds", type=int, default=10, help="seconds of telemetry for the throughput run")
    ap.add_argument("--latency-seconds", type=int, default=60)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--no-latency", action="store_true", help="only the throughput and memory figures")
    args = ap.parse_args()
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from xidstream.localbroker import LocalBroker

        broker = LocalBroker()
        if broker.pid() is not None:
            broker = None
            bootstrap = "127.0.0.1:19092"
        else:
            bootstrap = broker.start()
    tmp = Path(tempfile.mkdtemp(prefix="xidstream-pbench-"))
    nodes = max(1, args.gpus // 8)

    # 1. throughput ------------------------------------------------------------------------------
    s = Settings(bootstrap=bootstrap, topic_prefix=f"pbench-{uuid.uuid4().hex[:6]}.", partitions=args.partitions)
    create_topics(s)
    sim = Simulator(s, nodes, 8, duration=args.seconds, rates=NO_FAULTS)
    sink = KafkaSink(s, tmp / "spool1", max_inflight=200_000)
    t0 = time.perf_counter()
    sim.run(sink, speed=0, progress=None)
    sink.flush(300)
    sink.close()
    events = sim.published + len(sim.gpus)
    print(f"loaded {events:,} events ({len(sim.gpus):,} GPUs x {args.seconds} s) in {time.perf_counter() - t0:.1f} s "
          f"({events / (time.perf_counter() - t0):,.0f}/s through KafkaSink)", flush=True)
    topics = [s.topics.name(n) for n in INPUT_TOPICS]
    raw = raw_consume(s, topics, events)
    print(f"raw confluent-kafka consumer: {raw:,.0f} msg/s", flush=True)
    worker = WorkerProcess(s, tmp, name="tput").start()
    lag_topics = topics + list(internal_topics(s))
    # time from the first commit to lag 0 excludes the worker's start-up and first rebalance
    first = None
    probe = LagProbe(s, worker.group, topics)
    while True:
        lag = probe.lag()
        if lag is not None and first is None:
            first = (time.perf_counter(), lag)
        if lag == 0:
            break
        if not worker.alive():
            print(worker.tail())
            return 1
        time.sleep(1.0)
    t_end = time.perf_counter()
    probe.close()
    done = first[1]
    rate = (events - 0) / (t_end - first[0]) if done == events else done / (t_end - first[0])
    print(f"processor, one worker: {done:,} events in {t_end - first[0]:.1f} s after its first commit = {rate:,.0f} events/s "
          f"({rate / raw:.1%} of the raw consumer)", flush=True)
    rss = worker_rss(worker)
    worker.wait_idle(lag_topics, timeout=60, settle=1)
    worker.stop()
    # baseline RSS: a worker with no GPU
    s0 = Settings(bootstrap=bootstrap, topic_prefix=f"pbench0-{uuid.uuid4().hex[:6]}.", partitions=args.partitions)
    create_topics(s0)
    base = WorkerProcess(s0, tmp, name="empty").start()
    time.sleep(12)
    rss0 = worker_rss(base)
    base.stop()
    print(f"worker RSS: {rss:.0f} MiB with {len(sim.gpus):,} GPUs tracked, {rss0:.0f} MiB with none -> "
          f"{(rss - rss0) * 1024 / len(sim.gpus):.2f} KiB per tracked GPU", flush=True)
    delete_topics(s0)
    delete_topics(s)

    if args.no_latency:
        return 0
    # 2. latency under load ------------------------------------------------------------------------
    s = Settings(bootstrap=bootstrap, topic_prefix=f"plat-{uuid.uuid4().hex[:6]}.", partitions=args.partitions)
    create_topics(s)
    worker = WorkerProcess(s, tmp, name="lat").start()
    sim = Simulator(s, nodes, 8, duration=args.latency_seconds, rates=NO_FAULTS)
    sink = KafkaSink(s, tmp / "spool2", max_inflight=200_000)
    print(f"latency: {len(sim.gpus):,} GPUs at 1 Hz in real time for {args.latency_seconds} s, a fatal Xid every 2 s ...", flush=True)
    sent: dict[str, float] = {}
    stop = threading.Event()

    def inject():
        p = Producer(producer_config(s))
        rnd = random.Random(7)
        time.sleep(10)  # let the worker join and catch up first
        while not stop.is_set():
            g = rnd.choice(sim.gpus)
            if g.uuid in sent:
                continue
            info = lookup(79)
            x = XidEvent(ts=datetime.now(timezone.utc), node=g.node, gpu_uuid=g.uuid, gpu_index=g.index, pci_bus_id=g.pci,
                         resolved=True, xid=79, xid_name=info.name, xid_resolution=info.resolution,
                         message="GPU has fallen off the bus.", raw="NVRM: Xid ...: 79, GPU has fallen off the bus.",
                         source="kmsg", sources=["kmsg"])
            topic, key = s.topics.for_record(x)
            sent[g.uuid] = time.time()
            p.produce(topic, key=key, value=encode(x))
            p.flush(5)
            stop.wait(2.0)

    got: dict[str, float] = {}

    def collect():
        c = Consumer(consumer_config(s, f"bench-lat-{uuid.uuid4().hex[:6]}", **{"auto.offset.reset": "earliest"}))
        c.subscribe([s.topics.name("gpu.remediation")])
        from schemas import decode_any

        while not stop.is_set() or len(got) < len(sent):
            for m in c.consume(num_messages=100, timeout=0.2):
                if m.error() is None:
                    cmd = decode_any(m.value())
                    if cmd.action.value == "REBOOT_NODE" and cmd.gpu_uuid in sent and cmd.gpu_uuid not in got:
                        got[cmd.gpu_uuid] = time.time()
            if stop.is_set() and time.time() - stop_time[0] > 20:
                break
        c.close()

    stop_time = [0.0]
    threads = [threading.Thread(target=inject), threading.Thread(target=collect)]
    for t in threads:
        t.start()
    lags = []

    def watch():
        while not stop.is_set():
            lag = consumer_lag(s, worker.group, [s.topics.name(n) for n in INPUT_TOPICS])
            if lag is not None:
                lags.append(lag)
            stop.wait(5)

    w = threading.Thread(target=watch)
    w.start()
    sim.run(sink, speed=1.0, progress=None)
    stop_time[0] = time.time()
    stop.set()
    for t in threads + [w]:
        t.join()
    sink.close()
    worker.stop()
    lat = sorted(1000 * (got[u] - sent[u]) for u in got)
    if lat:
        print(f"latency Xid -> REBOOT_NODE command: n={len(lat)} of {len(sent)}, p50 {statistics.median(lat):.0f} ms, "
              f"p99 {lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.0f} ms, max {lat[-1]:.0f} ms", flush=True)
    else:
        print(f"latency: no command arrived for {len(sent)} injected Xids", flush=True)
    print(f"processor lag (input topics) sampled every 5 s: max {max(lags, default=0):,}, last {lags[-1] if lags else 0:,}")
    delete_topics(s)
    if broker is not None:
        broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
