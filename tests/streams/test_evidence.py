"""xidstream.streams.evidence: the per-GPU row's in-memory and persisted form (memory per GPU)."""

from __future__ import annotations

import copy

import orjson
import pytest

from xidstream.streams.classify import GpuState, step
from xidstream.streams.evidence import EMPTY_DICT, EMPTY_LIST, added
from xidstream.streams.policy import Policy
from xidstream.streams.routing import state_key
from tests.streams.builders import GPU, NODE, inventory, procs, sample, wedge, workload, xid

CONTAINERS = ("pin_stats", "pin_ids", "pods", "occurrences", "xids", "workload_failures", "pending_notes")


def fold(records, state=None):
    for r in records:
        state, _, _ = step(state, state_key(r), r, Policy())
    return state


def test_a_healthy_gpu_shares_its_empty_containers():
    state = fold([inventory()] + [r for t in range(0, 60, 10) for r in (sample(t), procs(t, 7))])
    assert state.pods == {"7": "pod-7"}  # a process list named the pod: a dict of its own
    for name in set(CONTAINERS) - {"pods"}:
        value = getattr(state, name)
        assert value == ([] if isinstance(value, list) else {}), name
        assert value is EMPTY_LIST or value is EMPTY_DICT, name


def test_the_shared_empty_containers_refuse_to_change():
    for change in (lambda: EMPTY_LIST.append(1), lambda: EMPTY_LIST.extend([1]), lambda: EMPTY_LIST.insert(0, 1),
                   lambda: EMPTY_LIST.__iadd__([1]), lambda: EMPTY_LIST.__setitem__(slice(0, 0), [1]),
                   lambda: EMPTY_DICT.__setitem__("a", 1), lambda: EMPTY_DICT.update(a=1),
                   lambda: EMPTY_DICT.setdefault("a", 1)):
        with pytest.raises(TypeError):
            change()
    assert EMPTY_LIST == [] and EMPTY_DICT == {} and not EMPTY_LIST and not EMPTY_DICT
    assert copy.copy(EMPTY_LIST) is EMPTY_LIST and copy.deepcopy(EMPTY_DICT) is EMPTY_DICT
    assert orjson.dumps({"l": EMPTY_LIST, "d": EMPTY_DICT}) == b'{"l":[],"d":{}}'


def test_added_gives_a_list_of_its_own():
    first = added(EMPTY_LIST, 1)
    assert first == [1] and first is not EMPTY_LIST and EMPTY_LIST == []
    assert added(first, 2) is first and first == [1, 2]


def test_facts_still_gather_on_a_gpu_that_starts_empty():
    state = fold([inventory(), sample(0), procs(0, 7), xid(10, 13, pid=7), xid(11, 31, pid=7),
                  workload(12, "failed")])
    assert [x["xid"] for x in state.xids] == [13, 31]
    assert len(state.occurrences) == 1 and len(state.workload_failures) == 1
    assert EMPTY_LIST == [] and EMPTY_DICT == {}


def test_an_empty_container_is_left_out_of_the_row_and_an_older_row_with_one_still_loads():
    state = fold([inventory(), sample(0), procs(0)])
    state.xids = []  # a list of its own that became empty
    row = state.to_dict()
    assert not set(CONTAINERS) & set(row)
    old = {"key": GPU, "node": NODE, "gpu_uuid": GPU, "pin_stats": {}, "pin_ids": [], "pods": {}, "occurrences": [],
           "xids": [], "workload_failures": [], "pending_notes": []}
    loaded = GpuState.from_dict(old)
    assert all(getattr(loaded, n) is EMPTY_LIST or getattr(loaded, n) is EMPTY_DICT for n in CONTAINERS)
    assert loaded == GpuState(key=GPU, node=NODE, gpu_uuid=GPU)


def test_a_wedge_reads_back_the_same_through_every_row():
    state = None
    for r in wedge():
        state = fold([r], state)
        assert GpuState.from_dict(orjson.loads(orjson.dumps(state.to_dict()))) == state
    assert state.incident is not None and state.pin_ids and state.pin_stats


def test_one_reading_leaves_one_float_for_its_stamps():
    """The sample and the process list of one reading carry the same time: the row keeps one float
    object for it; an unchanged memory total keeps its float (memory per GPU)."""
    state = fold([inventory(), sample(0), procs(0, 7)])
    total = state.memory_total_mib
    assert state.procs_ts == state.clock and state.procs_ts is state.clock
    assert state.last_compute_ts is state.clock and state.last_sample_ts is state.clock
    state = fold([sample(10), procs(10, 7)], state)
    assert state.procs_ts is state.clock and state.memory_total_mib is total


def test_a_read_only_copy_made_by_type_takes_an_item_and_cannot_be_filled_in_place():
    """dataclasses.asdict (or any type(x)(items)) makes another read-only empty list: `added`
    gives a list of its own for it too, and no constructor call fills a read-only one."""
    import dataclasses

    copied = dataclasses.asdict(GpuState(key=GPU))
    assert copied["xids"] is not EMPTY_LIST and copied["xids"] == []
    assert added(copied["xids"], 1) == [1]
    for fill in (lambda: EMPTY_LIST.__init__([1]), lambda: EMPTY_DICT.__init__({"a": 1}), lambda: EMPTY_DICT.__init__(a=1)):
        with pytest.raises(TypeError):
            fill()
    assert EMPTY_LIST == [] and EMPTY_DICT == {}


def test_a_row_pinned_without_statistics_still_takes_its_pinned_samples():
    """A row with `pinned_since` set and no `pin_stats` (hand-made, or from an older writer) left
    the shared empty dict in place, and every pinned sample of that GPU raised TypeError: the
    wedge's own evidence dead-lettered."""
    row = orjson.dumps({"key": GPU, "node": NODE, "gpu_uuid": GPU, "memory_total_mib": 32607.0, "clock": 60.0,
                        "sampled": True, "pinned_since": 60.0, "pinned_samples": 1, "pinned_last": 60.0})
    state = GpuState.from_dict(orjson.loads(row))
    state, _, _ = step(state, GPU, sample(61, util=100.0, mem=0.0), Policy())
    assert state.pinned_samples == 2 and state.pin_stats["util_min"] == 100.0
