"""Storms by blast radius, measured: a simulated fleet through the Kafka-free Engine
(streams.engine), and per storm the incidents opened, their members and the node-level actions.

    .venv/bin/python bench/storm_eval.py [--nodes 144] [--rack-size 18] [--teardown-nodes 77]

Storms: one Xid 45 teardown of a job on `--teardown-nodes` nodes x 2 GPUs (the goal: one incident
for the job, zero node-level actions), and one NVLink-domain fault (more than half of one rack's
nodes get a hardware Xid within a minute: one storm for the rack, the commands after it held).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xidstream.collectors.sink import MemorySink  # noqa: E402
from xidstream.schemas.vocab import BREAKER_ACTIONS, Classification  # noqa: E402
from xidstream.streams.engine import Engine  # noqa: E402
from xidstream.settings import Settings  # noqa: E402
from xidstream.simulate import FaultRates, Simulator  # noqa: E402


def storms(nodes: int = 144, gpus: int = 2, rack_size: int = 18, teardown_nodes: int = 77, duration: float = 600.0,
           rate: float = 0.2, seed: int = 1, rates: FaultRates = FaultRates(0, 0, 0, 0, 0)) -> dict:
    """Run the fleet; per storm: {"incidents", "members", "node_actions", "held"} and the fleet's totals."""
    sim = Simulator(Settings(), nodes, gpus, rate=rate, duration=duration, seed=seed, rates=rates,
                    xid45_teardowns=1, teardown_nodes=teardown_nodes, rack_size=rack_size, nvlink_domain_faults=1)
    sink = MemorySink()
    sim.run(sink, progress=None)
    engine = Engine().run(list(sink.records))
    teardown = {g.node for g in sim.gpus if g.fault == "xid45_teardown"}
    domain = {g.node for g in sim.gpus if g.fault == "hardware" and g.detail == "79"}
    out = {}
    for name, members in (("teardown", teardown), ("nvlink_domain", domain)):
        group = [a for a in engine.alerts if a.node == "fleet" and a.evidence.timeline
                 and {m["node"] for m in a.evidence.timeline[0].data.get("members", [])} & members]
        incidents = sorted({a.incident_id for a in group})
        listed = {m["node"] for a in group for m in a.evidence.timeline[0].data["members"]}
        actions = [c for c in engine.commands if c.node in members and c.action in BREAKER_ACTIONS]
        out[name] = {"nodes": len(members), "incidents": len(incidents), "members": len(listed),
                     "kinds": sorted({a.evidence.timeline[0].data.get("group_kind", "fleet") for a in group}),
                     "node_actions": len(actions), "held": sum(c.requires_approval for c in actions),
                     "gpu_alerts": sum(1 for a in engine.alerts if a.node in members),
                     "fleet_storms": sum(1 for a in group if a.classification == Classification.FLEET_STORM)}
    out["records"] = len(sink.records)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=144)
    ap.add_argument("--rack-size", type=int, default=18)
    ap.add_argument("--teardown-nodes", type=int, default=77)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = storms(nodes=args.nodes, rack_size=args.rack_size, teardown_nodes=args.teardown_nodes, seed=args.seed)
    print(f"storm_eval: {args.nodes} nodes x 2 GPUs, racks of {args.rack_size}, {res['records']:,} records, "
          f"{time.perf_counter() - t0:.1f} s")
    for name in ("teardown", "nvlink_domain"):
        r = res[name]
        print(f"  {name:<14} nodes {r['nodes']:>3}  storm incidents {r['incidents']} ({', '.join(r['kinds']) or '-'})  "
              f"members {r['members']:>3}  node-level actions {r['node_actions']:>3} (held {r['held']})  "
              f"per-GPU/node alerts {r['gpu_alerts']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
