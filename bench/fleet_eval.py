"""A simulated fleet in real time, the processor on it, and the evaluation: prints figures.

    .venv/bin/python bench/fleet_eval.py [--nodes 125] [--gpus 8] [--duration 600] [--speed 1]
    .venv/bin/python bench/fleet_eval.py --crash-loops 40 --xid45-teardowns 2   # the crash-loop mix

Starts the local broker if none runs, a fresh topic prefix, one `xidstream process` worker; runs
`xidstream simulate`'s fleet (faults injected at its default rates) through the collector's
KafkaSink; samples the worker's consumer lag every 10 s; waits until it has caught up; then prints
`xidstream evaluate`'s report (precision/recall per classification, node actions on GPUs whose only
fault was an application fault, detection latency in event and wall time).

`--crash-loops N` adds N crash-looping pods (a new PID per restart, Xid 13 on the same GPU five
times in about four minutes) and `--xid45-teardowns N` N job teardowns (Xid 45 on every rank of
6 nodes x 2 GPUs at once) to the same fleet, on GPUs that drew no fault; their truth is APP_FAULT,
so a GPU_SUSPECT there is a false positive, and the report counts quarantines and node actions on
them with the other application-only GPUs (count workloads, not PIDs; Xid 45 alone is a
record). The default mix is drawn exactly as without them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xidstream.collectors.sink import KafkaSink  # noqa: E402
from xidstream.schemas.topics import INPUT_TOPICS  # noqa: E402
from xidstream.streams.app import internal_topics  # noqa: E402
from xidstream.transport.kafka import consumer_lag, create_topics  # noqa: E402
from xidstream.runner import WorkerProcess  # noqa: E402
from xidstream.settings import Settings  # noqa: E402
from xidstream.simulate import Simulator, evaluate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--crash-loops", type=int, default=0, metavar="N", help="crash-looping pods to add (default 0)")
    ap.add_argument("--xid45-teardowns", type=int, default=0, metavar="N",
                    help="multi-node job teardowns with Xid 45 on every rank to add (default 0)")
    args = ap.parse_args()
    from workshop.localbroker import broker_for_run

    bootstrap, broker = broker_for_run(args.bootstrap)  # broker: ours to stop, else None
    tmp = Path(tempfile.mkdtemp(prefix="xidstream-fleet-"))
    s = Settings(bootstrap=bootstrap, topic_prefix=f"fleet-{uuid.uuid4().hex[:6]}.", partitions=args.partitions)
    create_topics(s)
    worker = WorkerProcess(s, tmp).start()
    sim = Simulator(s, args.nodes, args.gpus, duration=args.duration, seed=args.seed,
                    crash_loops=args.crash_loops, xid45_teardowns=args.xid45_teardowns)
    faults: dict[str, int] = {}
    for g in sim.gpus:
        faults[g.fault] = faults.get(g.fault, 0) + 1
    print(f"fleet: {len(sim.gpus)} GPUs on {args.nodes} nodes at 1 Hz for {args.duration:.0f} s "
          f"(speed {args.speed}x); injected faults: {faults}", flush=True)
    lags: list[int] = []
    stop = threading.Event()
    inputs = [s.topics.name(n) for n in INPUT_TOPICS]

    def watch():
        while not stop.is_set():
            lag = consumer_lag(s, worker.group, inputs)
            if lag is not None:
                lags.append(lag)
            stop.wait(10)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    sink = KafkaSink(s, tmp / "spool", max_inflight=100_000)
    wall0 = time.monotonic()
    sim.run(sink, speed=args.speed)
    sink.flush(120)
    sink.close()
    produced_s = time.monotonic() - wall0
    caught = worker.wait_idle(inputs + list(internal_topics(s)), timeout=600)
    behind_s = time.monotonic() - wall0 - produced_s
    stop.set()
    worker.stop()
    print(f"published {sim.published:,} records in {produced_s:.0f} s; processor caught up {behind_s:.0f} s after the "
          f"last record{'' if caught else ' (NOT caught up within 600 s)'}; lag sampled every 10 s: "
          f"max {max(lags, default=0):,}, median {sorted(lags)[len(lags) // 2] if lags else 0:,} records", flush=True)
    truth = tmp / "truth.jsonl"
    sim.write_truth(truth)
    evaluate(truth, s)
    if broker is not None:
        broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
