"""Broker failover benchmark on the local three-broker cluster: prints figures; not a test.

    .venv/bin/python bench/broker_failover.py [--kills 10] [--rate 200] [--latency-records 2000]
        [--worker-runs 3] [--worker-gpus 2000] [--worker-seconds 20]

Uses the cluster of `xidstream broker start --brokers 3` (started for the run and stopped after,
unless one runs already). One topic of 3 partitions, replication 3, min.insync.replicas 2.

1. acks=all vs acks=1: the publish latency (produce() to delivery report) of `--latency-records`
   records at `--rate` per second on the healthy cluster, with the project's producer settings
   (`xidstream.transport.kafka.producer_config`: acks=all, idempotence, lz4, linger.ms 5) and the same with
   acks=1 (idempotence off: it needs acks=all). p50, p99.
2. `--kills` times: while a producer writes `--rate` records per second, round robin over the
   partitions, and a consumer reads them, the leader of partition 0 is SIGKILLed. Measured from
   the kill: the first record acknowledged again on each partition the dead node led (producer
   side), and the first record produced after the kill that the consumer reads on them. The node
   is then started again and the next kill waits until every replica is back in sync.
   p50 and worst of each.
3. At the end every record acknowledged must be on the topic: lost (acknowledged, not read back;
   must be 0) and duplicated (read back twice, by event id; idempotence makes it 0), and how many
   produce() calls never got an acknowledgement (must be 0 with delivery.timeout.ms at its
   default of 2 min).
4. The worker's throughput with its producer (table changelogs, alerts, commands, the fleet
   topic) at acks=all and at acks=1 (`XIDSTREAM_PROCESSOR_ACKS=1`, for this measurement only),
   alternating, `--worker-runs` times each: the method of `bench/processor_bench.py` figure 1 (a
   `--worker-gpus` x `--worker-seconds` simulated fleet loaded first, then one worker from the
   start; records / time from its first commit to committed lag 0) on topics of 3 partitions,
   replication 3 and min.insync.replicas 2. `--worker-runs 0` leaves it out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import NewTopic  # noqa: E402

from xidstream.transport.config import KafkaConfig  # noqa: E402
from xidstream.transport.kafka import admin, consumer_config, producer_config  # noqa: E402
from workshop.localcluster import LocalCluster  # noqa: E402

PARTITIONS = 3


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def make_topic(settings: KafkaConfig, name: str) -> None:
    client = admin(settings)
    futs = client.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=3,
                                          config={"min.insync.replicas": "2"})], operation_timeout=30)
    for f in futs.values():
        f.result()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        md = client.list_topics(name, timeout=5)
        if name in md.topics and len(md.topics[name].partitions) == PARTITIONS and all(
                p.leader >= 0 for p in md.topics[name].partitions.values()):
            return
        time.sleep(0.2)
    raise SystemExit(f"topic {name} not ready")


def publish_latency(settings: KafkaConfig, topic: str, acks: str, n: int, rate: float) -> list[float]:
    over = {"acks": acks} if acks == "all" else {"acks": acks, "enable.idempotence": False}
    producer = Producer(producer_config(settings, **over))
    # Not timed: a new idempotent producer first gets its producer id (on a fresh cluster the
    # coordinator may still be loading: "Coordinator load in progress", up to a second), and
    # the first records waited for it: the p99 of acks=all was that wait, not the protocol.
    producer.produce(topic, value=f"lat-{acks}-warm".encode(), key=b"warm")
    producer.flush(30)
    lat: list[float] = []

    def done(sent: float):
        def cb(err, msg):
            if err is None:
                lat.append((time.perf_counter() - sent) * 1000)
        return cb

    gap = 1.0 / rate
    nxt = time.perf_counter()
    for i in range(n):
        producer.produce(topic, value=f"lat-{acks}-{i}".encode(), key=str(i).encode(), on_delivery=done(time.perf_counter()))
        producer.poll(0)
        nxt += gap
        pause = nxt - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    producer.flush(30)
    return lat


class Load:
    """A producer writing `rate` records/s round robin over the partitions, and a consumer reading
    them; both keep what they saw with monotonic times."""

    def __init__(self, settings: KafkaConfig, topic: str, rate: float) -> None:
        self.settings, self.topic, self.rate = settings, topic, rate
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent: dict[str, float] = {}  # event id -> produce time
        self.acked: dict[str, tuple[int, float]] = {}  # event id -> (partition, ack time)
        self.failed: list[str] = []
        self.read: list[tuple[str, int, float]] = []  # (event id, partition, read time)
        self.producer = Producer(producer_config(settings, **{"client.id": "bench-failover", "log_level": 0}))
        self.threads = [threading.Thread(target=self._produce, daemon=True),
                        threading.Thread(target=self._consume, daemon=True)]

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def _produce(self) -> None:
        gap = 1.0 / self.rate
        nxt = time.monotonic()
        i = 0
        while not self.stop.is_set():
            eid = uuid.uuid4().hex
            part = i % PARTITIONS

            def cb(err, msg, eid=eid):
                now = time.monotonic()
                with self.lock:
                    if err is None:
                        self.acked[eid] = (msg.partition(), now)
                    else:
                        self.failed.append(eid)

            with self.lock:
                self.sent[eid] = time.monotonic()
            self.producer.produce(self.topic, value=eid.encode(), partition=part, on_delivery=cb)
            self.producer.poll(0)
            i += 1
            nxt += gap
            pause = nxt - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                nxt = time.monotonic()
        self.producer.flush(150)

    def _consume(self) -> None:
        c = Consumer(consumer_config(self.settings, f"bench-failover-{uuid.uuid4().hex[:8]}", **{"log_level": 0}))
        c.assign([TopicPartition(self.topic, p, 0) for p in range(PARTITIONS)])
        try:
            while not self.stop.is_set():
                for m in c.consume(num_messages=500, timeout=0.1):
                    if m.error() is None:
                        now = time.monotonic()
                        with self.lock:
                            self.read.append((m.value().decode(), m.partition(), now))
        finally:
            c.close()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def recovery(load: Load, parts: list[int], t0: float, timeout: float) -> tuple[float | None, float | None]:
    """Seconds from `t0` to the first ack on every partition of `parts`, and to the first read of
    a record produced after `t0` on every one of them (the worst partition of each)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with load.lock:
            # a record produced after the kill: an ack of one sent before may still come from the
            # dead leader's socket buffer, and would time nothing
            acks = {p: min((t for eid, (p2, t) in load.acked.items() if p2 == p and load.sent.get(eid, 0) > t0),
                           default=None) for p in parts}
            reads = {p: min((t for eid, p2, t in load.read[-20000:] if p2 == p and load.sent.get(eid, 0) > t0),
                            default=None) for p in parts}
        if all(v is not None for v in acks.values()) and all(v is not None for v in reads.values()):
            return max(acks.values()) - t0, max(reads.values()) - t0
        time.sleep(0.05)
    return None, None


def worker_throughput(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, list[float]]:
    """Figure 4: `bench/processor_bench.py`'s throughput run on the cluster, acks=all and acks=1
    alternating (the same machine load for both); the worker's rates by acks."""
    import tempfile

    from bench import processor_bench as pb

    rates: dict[str, list[float]] = {"all": [], "1": []}
    tmp = Path(tempfile.mkdtemp(prefix="xs-failover-bench-"))
    b = pb.Bench(cluster.bootstrap, PARTITIONS, tmp, replication=3)
    ns = argparse.Namespace(gpus=args.worker_gpus, seconds=args.worker_seconds)
    try:
        for i in range(1, args.worker_runs + 1):
            for acks in ("all", "1"):
                b.worker_env = {"XIDSTREAM_PROCESSOR_ACKS": acks}
                say(f"worker throughput, run {i}/{args.worker_runs}, acks={acks}")
                rates[acks].append(pb.throughput_run(b, ns, i)["rate"])
    finally:
        b.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10, help="leader SIGKILLs (default 10)")
    ap.add_argument("--rate", type=float, default=200.0, help="records per second during the kills (default 200)")
    ap.add_argument("--latency-records", type=int, default=2000, help="records per acks setting (default 2000)")
    ap.add_argument("--worker-runs", type=int, default=3, help="worker throughput runs per acks setting (default 3; 0: none)")
    ap.add_argument("--worker-gpus", type=int, default=2000, help="worker throughput: simulated GPUs (default 2000)")
    ap.add_argument("--worker-seconds", type=int, default=20, help="worker throughput: seconds of 1 Hz telemetry (default 20)")
    args = ap.parse_args()

    t_start = time.monotonic()
    cluster = LocalCluster(brokers=3)
    ours = not any(n.pid() for n in cluster.nodes)
    say("starting the local 3-broker cluster" if ours else "using the running local 3-broker cluster")
    cluster.start()
    settings = KafkaConfig(bootstrap=cluster.bootstrap, node="bench")
    topic = f"bench-failover-{uuid.uuid4().hex[:8]}"
    try:
        make_topic(settings, topic)
        say(f"topic {topic}: {PARTITIONS} partitions, replication 3, min.insync.replicas 2")

        lat = {}
        for acks in ("all", "1", "all", "1"):  # twice each, interleaved: the second of each counts
            lat[acks] = publish_latency(settings, topic, acks, args.latency_records, args.rate)
            say(f"acks={acks:3}: publish latency p50 {pct(lat[acks], .5):.2f} ms, p99 {pct(lat[acks], .99):.2f} ms "
                f"({len(lat[acks])} records at {args.rate:g}/s)")

        load = Load(settings, topic, args.rate).start()
        time.sleep(2)
        to_write: list[float] = []
        to_read: list[float] = []
        for k in range(args.kills):
            leaders = cluster.leaders([topic])
            node = leaders[(topic, 0)]
            parts = sorted(p for (t, p), lid in leaders.items() if lid == node)
            t0 = time.monotonic()
            cluster.stop_one(node, kill=True)
            w, r = recovery(load, parts, t0, timeout=60)
            if w is None:
                say(f"kill {k + 1}/{args.kills}: node {node} (led partitions {parts}): no recovery within 60 s")
            else:
                to_write.append(w)
                to_read.append(r)
                say(f"kill {k + 1}/{args.kills}: node {node} (led partitions {parts}): writes accepted again after "
                    f"{w:.2f} s, read again after {r:.2f} s")
            t1 = time.monotonic()
            cluster.start_one(node)
            cluster.wait_in_sync(120, [topic, "__consumer_offsets"])
            say(f"  node {node} back and in sync after {time.monotonic() - t1:.1f} s")
        load.finish()

        # everything acknowledged must be there, once
        from xidstream.transport.kafka import read_all

        got = [m.value().decode() for m in read_all(settings, [topic], timeout=120, idle=3)
               if not m.value().startswith(b"lat-")]
        counts: dict[str, int] = {}
        for eid in got:
            counts[eid] = counts.get(eid, 0) + 1
        lost = [e for e in load.acked if e not in counts]
        dup = sum(n - 1 for n in counts.values() if n > 1)
        unacked = len(load.sent) - len(load.acked) - len(load.failed)
        say(f"records: {len(load.sent)} produced, {len(load.acked)} acknowledged, {len(load.failed)} failed, "
            f"{unacked} never answered; read back {len(got)}: lost {len(lost)}, duplicated {dup}")

        print()
        print(f"broker failover, {len(to_write)} leader SIGKILLs, 3 brokers (combined KRaft), replication 3, "
              f"min.insync.replicas 2, {args.rate:g} records/s:")
        if to_write:
            print(f"  kill -> first write accepted on its partitions: p50 {statistics.median(to_write):.2f} s, "
                  f"worst {max(to_write):.2f} s")
            print(f"  kill -> consumer reading again:                  p50 {statistics.median(to_read):.2f} s, "
                  f"worst {max(to_read):.2f} s")
        print(f"  records lost {len(lost)}, duplicated {dup} (acknowledged {len(load.acked)})")
        print(f"  publish latency acks=all p50 {pct(lat['all'], .5):.2f} ms p99 {pct(lat['all'], .99):.2f} ms; "
              f"acks=1 p50 {pct(lat['1'], .5):.2f} ms p99 {pct(lat['1'], .99):.2f} ms")
        if args.worker_runs > 0:
            rates = worker_throughput(cluster, args)
            print(f"  worker throughput ({args.worker_gpus:,} GPUs x {args.worker_seconds} s, median of {args.worker_runs}): "
                  f"acks=all {statistics.median(rates['all']):,.0f}/s, acks=1 {statistics.median(rates['1']):,.0f}/s "
                  f"(runs: all {', '.join(f'{r:,.0f}' for r in rates['all'])}; 1 {', '.join(f'{r:,.0f}' for r in rates['1'])})")
        print(f"  run took {time.monotonic() - t_start:.0f} s")
        return 0 if not lost and not dup and len(to_write) == args.kills else 1
    finally:
        try:
            for fut in admin(settings).delete_topics([topic], operation_timeout=30).values():
                fut.result()
        except Exception:  # noqa: BLE001 - best effort
            pass
        if ours:
            say("stopping the cluster")
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
