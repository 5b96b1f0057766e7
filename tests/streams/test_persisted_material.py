"""What `step` calls unchanged is really unchanged for every decision: a worker writes a GPU's row
only when `step` says it changed (`xidstream.streams.classify._material`), so a fact left out of that
comparison is lost at the next restart or rebalance. Folding with the row read back from its last
written bytes before every record must give exactly the outputs of folding in memory.

`_material` reads little on a quiet GPU (the pure path's speed); these tests are what
would notice a fact it stopped comparing. Scenarios of the library (in the order published and in
read orders mixed as a worker that keeps up reads its topics) and generated floods with executors
answering.

Kept to the minute, as the GPU's clock is: the newest process snapshot of a GPU that is not pinned
(its time and id, the end of its run of snapshot kinds). A healthy GPU's row is written about once a
minute, not at each process list; when one topic is read minutes ahead of another and the worker
restarts, the pin that follows may show that snapshot up to a minute old (docs/architecture.md "Known limits").
So the mixed orders here keep every topic within a minute of the others (`max_lag_s=60`).
"""

from __future__ import annotations

import random

import orjson
import pytest

from xidstream.streams.classify import GpuState, step
from xidstream.streams.policy import Policy
from xidstream.streams.routing import state_key
from tests.streams import floods
from tests.streams.test_order_free import NAMES, interleave, records_of


def _outputs(out: list) -> list:
    """The outputs as sent, less each message's own random `event_id`."""
    return [(kind, orjson.dumps({k: v for k, v in (o if isinstance(o, dict) else o.model_dump(mode="json")).items()
                                 if k != "event_id"}, option=orjson.OPT_SORT_KEYS)) for kind, o in out]


def fold_both(records: list) -> tuple[list, list]:
    """(outputs folded in memory, outputs folded from rows written only when `step` said changed)."""
    policy = Policy()
    live: dict = {}
    table: dict = {}
    a: list = []
    b: list = []
    newest: dict = {}
    for r in records:
        if isinstance(r, floods.Answer):
            r = floods.answer(newest, r)
            if r is None:
                continue
        key = state_key(r)
        if key is None:
            continue
        state, out, _ = step(live.get(key), key, r, policy)
        live[key] = state
        a += _outputs(out)
        for kind, o in out:
            if kind == "command":
                newest[o.gpu_uuid] = o
        row = table.get(key)
        stored = GpuState.from_dict(orjson.loads(row)) if row is not None else None
        stored, out, changed = step(stored, key, r, policy)
        if changed:
            table[key] = orjson.dumps(stored.to_dict())
        b += _outputs(out)
    return a, b


@pytest.mark.parametrize("name", NAMES)
def test_a_row_written_only_when_changed_decides_as_the_fold_in_memory(name):
    records = records_of(name)
    for order in (records, *(interleave(records, random.Random(seed), max_lag_s=60) for seed in (22, 23))):
        live, restarted = fold_both(order)
        assert any(kind == "alert" for kind, _ in live), "the scenario decides something"
        assert restarted == live


def test_a_flood_with_answers_decides_the_same_from_rows_written_only_when_changed():
    records = floods.generate(floods.Flood(4000, gpus=12, seconds=1200.0, seed=5, app_xid=4.0, workload=1.5,
                                           answer=1.0, wedging=0.3))
    live, restarted = fold_both(records)
    kinds = {kind for kind, _ in live}
    assert {"alert", "command"} <= kinds and any(isinstance(r, floods.Answer) for r in records)
    assert restarted == live
