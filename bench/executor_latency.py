"""Xid line -> node cordoned on the API server: prints figures; not a test.

    .venv/bin/python bench/executor_latency.py [--incidents 20] [--gap 1.5]

On the local broker and the local kube-apiserver (each started if not running, left as found):
one `xidstream process --signing-key` worker and one `xidstream execute --scope cluster --apply`
(the real commands, as subprocesses). 200 nodes publish one sample each first (so the fleet
breaker's 20% is not reached by the incidents), then `--incidents` nodes each get a fatal Xid 79
("fallen off the bus": GPU_HARDWARE_FAULT at once, CORDON_NODE first), one every `--gap` s. The
latency is from producing the Xid record to the API server's watch showing the node
`spec.unschedulable` (a lightkube list-then-watch on the Nodes, started before the first Xid).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Producer  # noqa: E402
from lightkube.resources.core_v1 import Node  # noqa: E402

from xidstream.executors.kube import list_then_watch, make_client  # noqa: E402
from xidstream.schemas import GpuInventory, GpuSample, XidEvent, encode  # noqa: E402
from xidstream.schemas.signing import generate_keys  # noqa: E402
from xidstream.schemas.xid_catalog import lookup  # noqa: E402
from xidstream.transport.kafka import create_topics, delete_run, producer_config  # noqa: E402
from workshop.localbroker import LocalBroker  # noqa: E402
from workshop.localkube import LocalKube  # noqa: E402
from xidstream.runner import WorkerProcess  # noqa: E402
from xidstream.settings import Settings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--incidents", type=int, default=20)
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between two incidents")
    ap.add_argument("--fleet", type=int, default=200, help="nodes seen before the incidents (fleet breaker: 20%%)")
    args = ap.parse_args()
    broker = LocalBroker()
    bootstrap = broker.start()
    kube = LocalKube().start()
    run = uuid.uuid4().hex[:6]
    s = Settings(bootstrap=bootstrap, topic_prefix=f"xlat-{run}.", partitions=4)
    create_topics(s)
    tmp = Path(tempfile.mkdtemp(prefix="xidstream-exec-lat-"))
    priv, pub, _ = generate_keys(tmp / "keys")
    nodes = [f"lat-{run}-{i:03d}" for i in range(args.fleet)]
    hit = nodes[: args.incidents]
    for n in hit:
        status, body = kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                              "metadata": {"name": n, "labels": {"xidstream.bench/run": run, "nvidia.com/gpu.present": "true"}}})
        assert status == 201, body
    gpus = {n: f"GPU-{uuid.uuid4()}" for n in nodes}

    # Records not tied to nodes, deliberately: this measures the cluster executor's latency from a
    # command to its API call; the bench's synthetic nodes have no pods to enroll an identity with,
    # and per-record identity cost is measured apart (bench/identity_cost.py).
    worker = WorkerProcess(s, tmp, name="lat", extra_args=["--signing-key", str(priv),
                                                           "--records-not-tied-to-nodes"]).start()
    exe_log = (tmp / "executor.log").open("w")
    executor = subprocess.Popen(
        [sys.executable, "-m", "xidstream.cli", "execute", "--scope", "cluster", "--apply", "--verify-key", str(pub),
         "--kubeconfig", str(kube.kubeconfig), "--bootstrap", bootstrap, "--topic-prefix", s.topic_prefix,
         "--state-dir", str(tmp / "executor")], stdout=exe_log, stderr=subprocess.STDOUT, cwd=ROOT,
        start_new_session=True)

    cordoned: dict[str, float] = {}
    stop = threading.Event()

    def on_event(typ: str, node: object) -> bool:
        if node.spec.unschedulable and node.metadata.name not in cordoned:
            cordoned[node.metadata.name] = time.time()
        return not stop.is_set() and len(cordoned) < len(hit)

    client = make_client(kube.kubeconfig)
    watcher = threading.Thread(target=list_then_watch, args=(client, Node, on_event),
                               kwargs={"labels": {"xidstream.bench/run": run}}, daemon=True)
    watcher.start()
    p = Producer(producer_config(s))
    now = datetime.now(timezone.utc)
    for i, n in enumerate(nodes):
        # an inventory makes the node a known GPU node (the fleet's size; capacity is taken without
        # approval only from a node that published one)
        inv = GpuInventory(ts=now, node=n, gpu_uuid=gpus[n], gpu_index=0, pci_bus_id="0000:17:00", memory_total_mib=81559)
        rec = GpuSample(ts=now, node=n, gpu_uuid=gpus[n], gpu_index=0, pci_bus_id="0000:17:00", utilization_gpu_pct=30.0,
                        memory_used_mib=1000.0, memory_total_mib=81559, power_w=200.0, status="ok")
        for r in (inv, rec):
            topic, key = s.topics.for_record(r)
            p.produce(topic, key=key, value=encode(r))
    p.flush(30)
    print(f"{args.fleet} nodes seen; waiting 15 s for the worker and the executor to join ...", flush=True)
    time.sleep(15)
    sent: dict[str, float] = {}
    info = lookup(79)
    for n in hit:
        x = XidEvent(ts=datetime.now(timezone.utc), node=n, gpu_uuid=gpus[n], gpu_index=0, pci_bus_id="0000:17:00",
                     resolved=True, xid=79, xid_name=info.name, xid_resolution=info.resolution,
                     message="GPU has fallen off the bus.", raw="NVRM: Xid (PCI:0000:17:00): 79, GPU has fallen off the bus.",
                     source="kmsg", sources=["kmsg"])
        topic, key = s.topics.for_record(x)
        sent[n] = time.time()
        p.produce(topic, key=key, value=encode(x))
        p.flush(5)
        time.sleep(args.gap)
    deadline = time.time() + 60
    while len(cordoned) < len(hit) and time.time() < deadline:
        time.sleep(0.2)
    stop.set()
    lat = sorted(1000 * (cordoned[n] - sent[n]) for n in hit if n in cordoned)
    if lat:
        print(f"Xid line -> node cordoned on the API server: n={len(lat)} of {len(hit)}, p50 {statistics.median(lat):.0f} ms, "
              f"p99 {lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.0f} ms, min {lat[0]:.0f} ms, max {lat[-1]:.0f} ms")
    else:
        print(f"no node was cordoned of {len(hit)}; logs in {tmp}")
    executor.terminate()
    executor.wait(20)
    worker.stop()
    delete_run(s)
    for n in hit:
        kube.request("DELETE", f"/api/v1/nodes/{n}")
    return 0 if len(lat) == len(hit) else 1


if __name__ == "__main__":
    raise SystemExit(main())
