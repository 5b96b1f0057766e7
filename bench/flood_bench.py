"""The pure decision path under a flood: per-record cost early and late, and the largest row and output.

    .venv/bin/python bench/flood_bench.py [--sizes 1000,10000,100000] [--gpus 256] [--hot 0.05]
                                          [--seconds 7200] [--text ordinary|max] [--runs 2]

Each flood (tests/streams/floods.py, the shape of tests/streams/test_flood.py's big case) runs on
`--gpus` GPUs, 8 to a node, a `--hot` share of it on one GPU: application Xids (13, 31, 43, 45)
from new processes, hardware Xids, pinned GPUs, failing pods, executors answering. It is folded
through `xidstream.streams.engine.Engine` record by record. Figures: the wall time per record in the first,
the middle (fifth) and the last tenth; the largest GPU row (`GpuState.to_dict()` as orjson, looked
at ten times along the way) and fleet row; the largest alert or command on the wire; the total.
Building the records is not timed. Each flood is folded `--runs` times and each tenth's time is
its best over the runs (on 2 shared cores a single run's tenths spread by +-25%).

Reading the times: a GPU's lists fill while its evidence windows do (30 min the longest), so the
first tenth of a flood is always the cheapest. Over the default 2 h the windows are full from the
third tenth on: bounded state shows as a last tenth that costs what the middle one does, state
that grows with the flood as a last tenth dearer than the middle one. (With `--seconds 1800` the
whole flood is one window and the cost rises to the end as the lists fill up to their caps.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.streams.floods import Flood, fleet_rows, fold, generate, gpu_rows, outputs  # noqa: E402


def run(records: int, gpus: int, hot: float, text: str, seed: int, seconds: float, runs: int) -> dict:
    spec = Flood(records, gpus=gpus, gpus_per_node=8, seconds=seconds, seed=seed, hot=hot, text=text)
    recs = generate(spec)
    best = None
    for _ in range(runs):
        r = _fold_timed(recs)
        best = r if best is None else {**r, **{k: min(r[k], best[k]) for k in ("first_us", "mid_us", "last_us",
                                                                               "total_s")}}
    return best


def _fold_timed(recs: list) -> dict:
    n = len(recs)
    bounds = [n * k // 10 for k in range(1, 11)]  # the records that end each tenth
    marks: list[float] = []  # the clock at the end of each tenth, less the time spent looking
    looked = [0.0]
    largest_row = [0]

    def each(i: int, engine) -> None:
        if i + 1 == bounds[len(marks)]:
            now = time.perf_counter()
            marks.append(now - looked[0])
            largest_row[0] = max(largest_row[0], max(len(row) for _, row in gpu_rows(engine)))
            looked[0] += time.perf_counter() - now

    t0 = time.perf_counter()
    engine = fold(recs, each=each)
    def per_record(k: int) -> float:  # in the k-th tenth (1-10), in us
        return ((marks[k - 1] - (marks[k - 2] if k > 1 else t0)) / (bounds[k - 1] - (bounds[k - 2] if k > 1 else 0))
                * 1e6)

    return {
        "records": n,
        "first_us": per_record(1),
        "mid_us": per_record(5),
        "last_us": per_record(10),
        "row": largest_row[0],
        "fleet_row": max(len(row) for _, row in fleet_rows(engine)),
        "output": max(len(v) for _, v in outputs(engine)),
        "alerts": len(engine.alerts),
        "commands": len(engine.commands),
        "total_s": marks[9] - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--hot", type=float, default=0.05, help="share of the records on one GPU")
    ap.add_argument("--text", choices=("ordinary", "max"), default="ordinary")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--seconds", type=float, default=7200.0, help="event time the flood spans")
    ap.add_argument("--runs", type=int, default=2, help="folds of each flood; each tenth's best counts")
    args = ap.parse_args()
    print(f"flood over {args.seconds / 60:.0f} min of event time, {args.gpus} GPUs (8 a node), {args.hot:.0%} on one "
          f"GPU, {args.text} text; Engine, one record at a time; us per record in the first, fifth and last tenth "
          f"(best of {args.runs} runs)",
          flush=True)
    print(f"{'records':>8} {'first 10%':>10} {'mid 10%':>10} {'last 10%':>10} {'largest row':>12} {'fleet row':>10} "
          f"{'largest output':>15} {'alerts':>7} {'commands':>9} {'total':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        r = run(size, args.gpus, args.hot, args.text, args.seed, args.seconds, args.runs)
        print(f"{r['records']:>8,} {r['first_us']:>8.1f}us {r['mid_us']:>8.1f}us {r['last_us']:>8.1f}us "
              f"{r['row']:>10,} B {r['fleet_row']:>8,} B {r['output']:>13,} B {r['alerts']:>7,} {r['commands']:>9,} "
              f"{r['total_s']:>7.2f}s", flush=True)


if __name__ == "__main__":
    main()
