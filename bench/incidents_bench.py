"""`xidstream incidents` on a month of a 10,000-GPU fleet's alerts: prints figures; not a test.

    .venv/bin/python bench/incidents_bench.py [--gpus 10000] [--days 30] [--bootstrap HOST:PORT]

Writes a month of outputs into fresh contract topics (8 partitions) on the local broker (started
if needed), each record stamped at its own time in the month (Kafka's record timestamp, which
`--since` reads by): per GPU-month 3 application faults (APP_FAULT: opened and resolved alerts, one
RECORD command, its result), and per 1,000 GPUs 20 wedges (the wedge's alerts, RECORD/CORDON/DRAIN/
RESET and their results; left open); the records are what the real fold publishes for such incidents (streams.Engine),
with fresh ids and times. Then times `xidstream incidents --json` for --since 1d, 7d (the default)
and 30d, and prints records read, seconds and peak RSS. The topics are deleted at the end.
"""

from __future__ import annotations

import argparse
import random
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Producer  # noqa: E402

from xidstream.schemas.codec import to_dict  # noqa: E402
from tests.streams.builders import run, wedge, xid, sample, procs, inventory  # noqa: E402
from xidstream.transport.kafka import create_topics, delete_topics, producer_config  # noqa: E402
from xidstream.settings import Settings  # noqa: E402


def templates():
    """(app fault outputs, wedge outputs) as the fold publishes them, as dicts."""
    # an application fault that resolves (5 min healthy): open and resolved alerts, one RECORD
    app = run([inventory(), *[sample(t) for t in range(0, 400, 5)], *[procs(t, 7) for t in range(0, 400, 5)],
               xid(30, 13, pid=7)])
    wedged = run(wedge())
    as_dicts = lambda e: [("gpu.alerts", to_dict(a)) for a in e.alerts] + [("gpu.remediation", to_dict(c)) for c in e.commands]  # noqa: E731
    return as_dicts(app), as_dicts(wedged)


def incident_records(tpl, t0: float, rng: random.Random, gpu: str, node: str):
    """One incident's records with fresh ids, shifted to start at t0; plus a result per command."""
    iid = uuid.uuid4().hex[:24]
    base = min(orjson_ts(v["ts"]) for _, v in tpl)
    out = []
    for topic, v in tpl:
        v = dict(v, incident_id=iid, node=node, gpu_uuid=gpu)
        t = t0 + orjson_ts(v["ts"]) - base
        v["ts"] = iso(t)
        if topic == "gpu.remediation":
            v["command_id"] = uuid.uuid4().hex[:24]
            v["expires_at"] = iso(t + 900)
            out.append((topic, v, t))
            out.append(("gpu.remediation.results", {
                "schema": "xidstream.remediation_result/4", "event_id": uuid.uuid4().hex, "ts": iso(t + rng.uniform(1, 30)),
                "node": node, "gpu_uuid": gpu, "command_id": v["command_id"], "incident_id": iid, "action": v["action"],
                "outcome": "succeeded", "detail": f"{v['action']} done on {node}"}, t + 5))
        else:
            v["alert_id"] = uuid.uuid4().hex[:24]
            out.append((topic, v, t))
    return out


def orjson_ts(text: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def iso(t: float) -> str:
    from datetime import datetime, timezone
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=10000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--bootstrap")
    args = ap.parse_args()
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from workshop.localbroker import LocalBroker

        broker = LocalBroker()
        if broker.pid() is not None:
            broker = None
            bootstrap = "127.0.0.1:19092"
        else:
            print("starting the local broker ...", file=sys.stderr)
            bootstrap = broker.start()
    settings = Settings(bootstrap=bootstrap, topic_prefix=f"bench-incidents-{uuid.uuid4().hex[:6]}.", partitions=8)
    create_topics(settings)
    try:
        rng = random.Random(7)
        app_tpl, wedge_tpl = templates()
        now = time.time()
        start = now - args.days * 86400
        nodes = max(1, args.gpus // 8)
        plan = [("app", 3 * args.gpus * args.days // 30), ("wedge", 20 * args.gpus // 1000 * args.days // 30)]
        p = Producer(producer_config(settings, **{"linger.ms": 50, "batch.num.messages": 10000,
                                                  "queue.buffering.max.messages": 500000}))
        n = size = 0
        t0 = time.monotonic()
        records = []
        for kind, count in plan:
            tpl = app_tpl if kind == "app" else wedge_tpl
            for i in range(count):
                g = rng.randrange(args.gpus)
                node, gpu = f"gpu-node-{g // 8:05d}", f"GPU-{g:08x}-0000-4000-8000-000000000000"
                records += [(t, topic, gpu, v) for topic, v, t in
                            incident_records(tpl, rng.uniform(start, now - 3600), rng, gpu, node)]
            print(f"  {kind}: {count:,} incidents", file=sys.stderr)
        records.sort(key=lambda r: r[0])  # written as they happened: a partition's stamps rise, as live
        for t, topic, gpu, v in records:
            raw = orjson.dumps(v)
            size += len(raw)
            while True:
                try:
                    p.produce(settings.topics.name(topic), raw, key=gpu.encode(), timestamp=int(t * 1000))
                    break
                except BufferError:
                    p.poll(0.1)
            n += 1
            p.poll(0)
        p.flush(120)
        del p
        took = time.monotonic() - t0
        print(f"wrote {n:,} records ({size / 1e6:.1f} MB) of {args.days} days, {args.gpus:,} GPUs on {nodes:,} nodes "
              f"in {took:.1f} s")
        for since in ("1d", "7d", f"{args.days}d"):
            cmd = [sys.executable, "-c",
                   "import resource,sys,time;from xidstream.cli import main;t=time.monotonic();"
                   "rc=main(sys.argv[1:]);print(f'TOOK {time.monotonic()-t:.2f} RSS '"
                   "f'{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024:.0f}',file=sys.stderr);sys.exit(rc)",
                   "incidents", "--json", "--since", since, "--bootstrap", bootstrap,
                   "--topic-prefix", settings.topic_prefix]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            data = orjson.loads(proc.stdout)
            took_s, rss = proc.stderr.strip().split()[1], proc.stderr.strip().split()[3]
            read = data["read"]
            print(f"incidents --since {since:>4}: {took_s} s, peak RSS {rss} MiB; read {read['alert']:,} alerts, "
                  f"{read['command']:,} commands, {read['result']:,} results; {len(data['open']):,} open incidents")
    finally:
        delete_topics(settings)
        if broker is not None:
            broker.stop()
    print(f"bench peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
