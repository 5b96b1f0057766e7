"""The per-GPU facts of streams.evidence, exactly (mutants of the folds, the caps and
`pin_onset` survived tests that went through the whole engine and checked only a verdict). Each
threshold at, just below and just above its bound; each cap at its size and one past it."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from xidstream.schemas import ComputeApp, DeviceHolder, GpuProcesses, GpuSample, WorkloadEvent
from xidstream.streams.evidence import (
    COMPUTE,
    EMPTY_DICT,
    EMPTY_LIST,
    ENTRY_RAW_CHARS,
    ENTRY_TEXT_CHARS,
    DEATH_AFTER_FAULT_S,
    NAME_WAIT_S,
    NO_PROCESS,
    UNKNOWN,
    GpuState,
    added,
    entry,
    event_time,
    fold_processes,
    fold_run,
    fold_sample_pin,
    fold_workload,
    name_by_deaths,
    nocompute_start,
    pending,
    pin_onset,
    prune,
    sample_stats,
    settled,
    snapshot_kind,
    sustained_pin,
    workload_of,
)
from xidstream.streams.incident import Incident
from xidstream.streams.policy import Policy
from tests.streams.builders import at

P = Policy()  # burst 5 s, skew bound 300 s, lookbacks 1800 s, pinned at >= 95% and <= 1% of memory
UUID = "GPU-x"


def policy(**changes) -> Policy:
    return dataclasses.replace(P, **changes)


def gpu(**kw) -> GpuState:
    return GpuState(key=UUID, node="n1", gpu_uuid=UUID, gpu_index=3, **kw)


# -- the shared empty containers -------------------------------------------------------------------
def test_an_empty_container_may_be_made_again_by_its_type_but_never_filled():
    assert type(EMPTY_LIST)() == [] and type(EMPTY_LIST)([]) == [] and type(EMPTY_DICT)() == {}
    assert type(EMPTY_DICT)({}) == {}
    for make in (lambda: type(EMPTY_LIST)([1]), lambda: type(EMPTY_LIST)([], []), lambda: type(EMPTY_DICT)(a=1),
                 lambda: type(EMPTY_DICT)({"a": 1}), lambda: type(EMPTY_DICT)({}, {})):
        with pytest.raises(TypeError) as e:
            make()
        assert str(e.value) == ("a GpuState's shared empty container is read-only: assign a new one "
                                "(streams.evidence.added)")


def test_every_change_to_an_empty_container_is_refused():
    for change in (lambda: EMPTY_LIST.remove(1), lambda: EMPTY_LIST.pop(), lambda: EMPTY_LIST.clear(),
                   lambda: EMPTY_LIST.sort(), lambda: EMPTY_LIST.reverse(), lambda: EMPTY_LIST.__delitem__(0),
                   lambda: EMPTY_LIST.__imul__(2), lambda: EMPTY_DICT.__delitem__("a"), lambda: EMPTY_DICT.pop("a"),
                   lambda: EMPTY_DICT.popitem(), lambda: EMPTY_DICT.clear(), lambda: EMPTY_DICT.__ior__({"a": 1})):
        with pytest.raises(TypeError):
            change()
    assert EMPTY_LIST == [] and EMPTY_DICT == {}


def test_a_copy_or_pickle_of_an_empty_container_is_the_shared_one():
    for empty in (EMPTY_LIST, EMPTY_DICT):
        assert copy.copy(empty) is empty and copy.deepcopy(empty) is empty
        assert pickle.loads(pickle.dumps(empty)) is empty
    state = gpu()
    assert state.xids is EMPTY_LIST and state.pods is EMPTY_DICT and state.pin_stats is EMPTY_DICT


def test_added_copies_any_read_only_list_and_appends_to_a_plain_one():
    class Other(list):
        pass

    other = Other([1])
    got = added(other, 2)
    assert got == [1, 2] and type(got) is list and other == [1]
    plain = [1]
    assert added(plain, 2) is plain and plain == [1, 2]


# -- the persisted row -----------------------------------------------------------------------------
def test_a_row_keeps_only_what_differs_from_its_defaults():
    assert gpu().to_dict() == {"key": UUID, "node": "n1", "gpu_uuid": UUID, "gpu_index": 3}
    state = gpu(status="lost", recovery_action=0, remap_failure=False, xids=[{"ts": 1.0}], pods={}, sampled=True)
    assert state.to_dict() == {"key": UUID, "node": "n1", "gpu_uuid": UUID, "gpu_index": 3, "status": "lost",
                               "xids": [{"ts": 1.0}], "sampled": True}


def test_a_value_of_another_type_than_its_default_is_kept_even_when_equal():
    # 0 == False and 0.0 == 0: the row keeps what was set, by type, so it reads back the same
    state = gpu(remap_failure=0, recovery_action=0.0, pinned_samples=False)
    assert state.to_dict() == {"key": UUID, "node": "n1", "gpu_uuid": UUID, "gpu_index": 3, "remap_failure": 0,
                               "recovery_action": 0.0, "pinned_samples": False}


def test_the_key_is_always_kept_and_the_material_never():
    state = GpuState(key="")
    state.material = (1, 2)
    assert state.to_dict() == {"key": ""}


def test_a_row_with_an_incident_reads_back_the_same():
    inc = Incident(id="i", classification="GPU_WEDGED", opened_at=1.0, remedy="reset",
                   emitted=[{"step": 0, "action": "RECORD", "command_id": "c", "ts": 1.0, "outcome": "succeeded"}])
    state = gpu(incident=inc, occurrences=[{"ts": 1.0, "last_ts": 1.0, "pid": 7, "wl": "pod:a", "codes": [13]}])
    row = state.to_dict()
    assert row["incident"] == inc.to_dict() and row["incident"] is not inc
    back = GpuState.from_dict(row)
    assert back == state and isinstance(back.incident, Incident)


def test_an_older_row_is_filled_as_its_code_meant_it():
    row = {"key": UUID, "gpu_uuid": UUID, "unknown_field": 1, "xids": [], "pods": {}, "status": "ok",
           "occurrences": [{"ts": 1.0, "last_ts": 1.0, "pid": 7, "codes": [13]},
                           {"ts": 2.0, "last_ts": 2.0, "pid": None, "codes": [13]},
                           {"ts": 3.0, "last_ts": 3.0, "pid": 8, "wl": "pod:b", "codes": [13]}],
           "incident": {"id": "i", "classification": "GPU_WEDGED", "opened_at": 1.0, "remedy": "reset",
                        "emitted": [{"step": 0, "action": "RECORD", "command_id": "c", "ts": 1.0},
                                    {"step": 1, "action": "RECORD", "command_id": "d", "ts": 2.0,
                                     "outcome": "failed"}]}}
    state = GpuState.from_dict(row)
    assert state.xids is EMPTY_LIST and state.pods is EMPTY_DICT and state.status == "ok"
    assert [o["wl"] for o in state.occurrences] == ["pid:7", None, "pod:b"]
    assert [e["outcome"] for e in state.incident.emitted] == [None, "failed"]
    assert GpuState.from_dict({"key": "k"}).incident is None


@pytest.mark.parametrize("unpinned, ts, back", [
    (None, 10.0, False), (10.0, None, False), (10.0, 10.0, False), (10.5, 10.0, True), (9.0, 10.0, False),
])
def test_came_back_after_is_an_ok_unpinned_sample_strictly_after(unpinned, ts, back):
    assert gpu(last_unpinned_ts=unpinned).came_back_after(ts) is back


# -- timeline lines --------------------------------------------------------------------------------
def test_a_timeline_lines_texts_are_cut_at_their_bounds():
    raw_ok, raw_long = "r" * ENTRY_RAW_CHARS, "r" * (ENTRY_RAW_CHARS + 3)
    text_ok, text_long = "t" * ENTRY_TEXT_CHARS, "t" * (ENTRY_TEXT_CHARS + 1)
    assert (ENTRY_RAW_CHARS, ENTRY_TEXT_CHARS) == (2048, 512)
    got = entry(5.0, "xid", text_long, raw=raw_long, other=text_long, fine=text_ok, raw_fine=raw_ok, n=10 ** 600,
                b=b"x" * 600)
    assert got == {"ts": 5.0, "kind": "xid", "summary": "t" * 512 + "... [1 more characters]",
                   "data": {"raw": "r" * 2048 + "... [3 more characters]", "other": "t" * 512 + "... [1 more characters]",
                            "fine": text_ok, "raw_fine": "r" * 512 + "... [1536 more characters]", "n": 10 ** 600,
                            "b": b"x" * 600}}
    assert entry(1.0, "note", text_ok, raw=raw_ok) == {"ts": 1.0, "kind": "note", "summary": text_ok,
                                                       "data": {"raw": raw_ok}}


# -- event time ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ts, taken, skew", [
    (1300.0, 1300.0, 0.0), (700.0, 700.0, 0.0), (1300.5, 1000.0, 300.5), (699.0, 1000.0, -301.0),
])
def test_a_line_is_taken_at_its_reading_when_stamped_past_the_bound_from_it(ts, taken, skew):
    state = gpu(clock=5000.0, sampled=True)
    assert event_time(state, ts, False, P, observed=1000.0) == (taken, skew)
    assert state.clock == 5000.0  # the newest time stays
    fresh = gpu()
    assert event_time(fresh, ts, False, P, observed=1000.0) == (taken, skew)
    assert fresh.clock == taken and fresh.sampled is False


@pytest.mark.parametrize("ts, taken, skew", [(1300.0, 1300.0, 0.0), (1300.5, 1000.0, 300.5)])
def test_another_clocks_stamp_ahead_of_the_gpus_by_more_than_the_bound_is_taken_at_the_gpus(ts, taken, skew):
    state = gpu(clock=1000.0, sampled=True)
    assert event_time(state, ts, False, P) == (taken, skew)
    assert state.clock == taken


def test_the_collectors_own_readings_and_an_unsampled_gpu_are_taken_as_stamped():
    state = gpu(clock=1000.0, sampled=True)
    assert event_time(state, 5000.0, True, P) == (5000.0, 0.0) and state.clock == 5000.0
    assert event_time(state, 10.0, False, P) == (10.0, 0.0) and state.clock == 5000.0  # behind: as stamped
    xids_only = gpu(clock=1000.0)  # a node/pci row: no readings, no clock to judge by
    assert event_time(xids_only, 5000.0, False, P) == (5000.0, 0.0)
    assert (xids_only.clock, xids_only.sampled) == (5000.0, False)
    first = gpu()
    assert event_time(first, 7.0, True, P) == (7.0, 0.0) and (first.clock, first.sampled) == (7.0, True)
    assert event_time(first, 9.0, False, P) == (9.0, 0.0) and first.sampled is True
    assert event_time(gpu(clock=1000.0, sampled=True), 1100.0, False, policy(max_clock_skew_s=99.0)) == (1000.0, 100.0)


# -- whose fault -----------------------------------------------------------------------------------
def failure(ts, pod="uid-a", id=None):
    return {"ts": ts, "pod_uid": pod, "id": id}


def test_the_workload_of_a_pid():
    state = gpu(pods={"7": "pod-7", "8": ""}, workload_failures=[failure(105.0)])
    assert workload_of(state, None) == (None, None)
    assert workload_of(state, 7) == ("pod:pod-7", "pod-7")
    assert workload_of(state, 9) == ("pid:9", None)  # a death names it later (name_by_deaths), not here
    assert workload_of(state, 8) == ("pid:8", "")


def occ(ts, wl, pid=7, id="o", codes=(13,), last_ts=None, **kw):
    return {"ts": ts, "last_ts": ts if last_ts is None else last_ts, "pid": pid, "wl": wl, "codes": list(codes),
            "pod": None, "id": id, **kw}


def _named(state):
    return [(o["wl"], o["pod"]) for o in state.occurrences]


@pytest.mark.parametrize("fault_at, named", [(70.0, True), (69.9, False), (105.0, True), (105.1, False), (100.0, True)])
def test_a_death_names_the_fault_from_30_s_before_to_burst_after_it(fault_at, named):
    state = gpu(occurrences=[occ(fault_at, "pid:7")], workload_failures=[failure(100.0)])
    name_by_deaths(state, P)
    assert _named(state) == [("pod:uid-a", "uid-a") if named else ("pid:7", None)]
    assert DEATH_AFTER_FAULT_S == 30.0 and NAME_WAIT_S == 90.0


def test_one_death_names_one_fault_the_newest_before_it():
    state = gpu(occurrences=[occ(90.0, "pid:7", id="a"), occ(95.0, "pid:8", pid=8, id="b")],
                workload_failures=[failure(100.0)])
    name_by_deaths(state, P)
    assert _named(state) == [("pid:7", None), ("pod:uid-a", "uid-a")]
    two = gpu(occurrences=[occ(90.0, "pid:7", id="a"), occ(95.0, "pid:8", pid=8, id="b")],
              workload_failures=[failure(92.0, "uid-b"), failure(100.0)])
    name_by_deaths(two, P)  # deaths in time order: uid-b's (92) takes 90 (before it), uid-a's (100) takes 95
    assert _named(two) == [("pod:uid-b", "uid-b"), ("pod:uid-a", "uid-a")]


def test_names_come_only_from_deaths_of_a_pod_that_did_not_exit_cleanly():
    for death in (failure(101.0, None), failure(101.0, ""), {**failure(101.0), "exit_code": 0}):
        state = gpu(occurrences=[occ(100.0, "pid:7")], workload_failures=[death])
        name_by_deaths(state, P)
        assert _named(state) == [("pid:7", None)]
    state = gpu(occurrences=[occ(100.0, "pid:7")], workload_failures=[{**failure(101.0), "exit_code": 1}])
    name_by_deaths(state, P)
    assert _named(state) == [("pod:uid-a", "uid-a")]


def test_a_name_from_the_process_lists_is_never_taken_and_a_name_from_a_death_is_read_again():
    state = gpu(occurrences=[occ(100.0, "pod:p", id="a"), occ(100.0, None, pid=None, id="c"),
                             occ(99.0, "pod:old", by_death=True, id="d")],
                workload_failures=[failure(101.0)])
    name_by_deaths(state, P)
    assert [o["wl"] for o in state.occurrences] == ["pod:p", None, "pod:uid-a"]
    state.workload_failures = []
    name_by_deaths(state, P)  # its death gone (pruned): the name goes with it
    assert [o["wl"] for o in state.occurrences] == ["pod:p", None, "pid:7"]


# -- pruning and the caps --------------------------------------------------------------------------
def test_prune_keeps_the_longest_of_the_three_lookbacks():
    p = policy(app_xid_lookback_s=100.0, wedged_xid43_lookback_s=200.0, suspect_window_s=150.0, pshc_cancel_s=0.0)
    state = gpu(occurrences=[occ(0.0, "pod:a", id="old", last_ts=799.0), occ(0.0, "pod:a", id="in", last_ts=800.0)],
                xids=[{"ts": 799.0, "id": "x-old"}, {"ts": 800.0, "id": "x-in"}],
                workload_failures=[failure(899.0, id="w-old"), failure(900.0, id="w-in")])
    prune(state, 1000.0, dataclasses.replace(p, workload_failure_lookback_s=100.0))
    assert [o["id"] for o in state.occurrences] == ["in"]
    assert [x["id"] for x in state.xids] == ["x-in"]
    assert [w["id"] for w in state.workload_failures] == ["w-in"]
    for longest in ({"app_xid_lookback_s": 200.0, "wedged_xid43_lookback_s": 100.0},
                    {"suspect_window_s": 200.0, "wedged_xid43_lookback_s": 100.0}):
        state = gpu(occurrences=[occ(0.0, "pod:a", id="o", last_ts=800.0)], xids=[{"ts": 800.0}])
        prune(state, 1000.0, dataclasses.replace(p, **longest))
        assert len(state.occurrences) == 1 and len(state.xids) == 1


def test_prune_keeps_the_xids_while_a_162_may_still_cancel_a_163():
    """pshc_cancel_s past the three lookbacks keeps the GPU's Xids (not its occurrences) that long:
    an Xid 162 finds the 163 it re-engages (streams.verdict.reengaged_by)."""
    p = policy(app_xid_lookback_s=100.0, wedged_xid43_lookback_s=200.0, suspect_window_s=150.0, pshc_cancel_s=250.0)
    state = gpu(occurrences=[occ(0.0, "pod:a", id="o", last_ts=760.0)],
                xids=[{"ts": 749.0, "id": "x-old"}, {"ts": 750.0, "id": "x-in"}])
    prune(state, 1000.0, p)
    assert state.occurrences is EMPTY_LIST and [x["id"] for x in state.xids] == ["x-in"]


def test_prune_leaves_the_shared_empty_lists_when_nothing_is_left():
    state = gpu(occurrences=[occ(0.0, "pod:a")], xids=[{"ts": 0.0}], workload_failures=[failure(0.0)])
    prune(state, 10_000.0, P)
    assert state.occurrences is EMPTY_LIST and state.xids is EMPTY_LIST and state.workload_failures is EMPTY_LIST


def test_xid_45_only_occurrences_are_capped_at_64_the_newest_by_their_own_times():
    only45 = [occ(float(i), f"pid:{i}", pid=i, id=f"t{i:03}", codes=(45,)) for i in range(65)]
    mixed = occ(0.0, "pid:999", id="mixed", codes=(45, 13))
    state = gpu(occurrences=list(reversed(only45)) + [mixed])
    prune(state, 100.0, P)
    kept = {o["id"] for o in state.occurrences}
    assert len(kept) == 65 and "t000" not in kept and "mixed" in kept and "t064" in kept
    state = gpu(occurrences=only45[:64] + [mixed])
    prune(state, 100.0, P)
    assert len(state.occurrences) == 65


def test_the_45_cap_orders_by_last_time_then_time_then_id():
    # same last_ts: the older start goes first; same both: the smaller id
    a = occ(5.0, "pid:1", id="b", codes=(45,), last_ts=50.0)
    b = occ(6.0, "pid:2", id="a", codes=(45,), last_ts=50.0)
    c = occ(6.0, "pid:3", id="c", codes=(45,), last_ts=50.0)
    d = occ(7.0, "pid:4", id=None, codes=(45,), last_ts=50.0)
    rest = [occ(float(i), f"pid:{i}", pid=i, id=f"t{i:03}", codes=(45,), last_ts=60.0 + i) for i in range(61)]
    state = gpu(occurrences=[c, d, b, a] + rest)  # 65: one goes, the oldest by (last_ts, ts, id)
    prune(state, 100.0, P)
    assert "b" not in {o["id"] for o in state.occurrences} and len(state.occurrences) == 64
    state = gpu(occurrences=[c, d, b] + rest)  # 64 kept; add one more at 6.0 with id "a": it sorts before "c"
    state.occurrences.append(occ(6.0, "pid:9", id="0", codes=(45,), last_ts=50.0))
    prune(state, 100.0, P)
    assert {o["id"] for o in state.occurrences} >= {"a", "c", None} and "0" not in {o["id"] for o in state.occurrences}


def test_application_occurrences_are_capped_at_128_the_newest():
    occs = [occ(float(i), f"pid:{i}", pid=i, id=f"o{i:03}", last_ts=float(200 - i)) for i in range(129)]
    state = gpu(occurrences=occs)
    prune(state, 300.0, P)
    assert len(state.occurrences) == 128 and "o128" not in {o["id"] for o in state.occurrences}
    # same last_ts: by time, then by id (a missing id sorts as "")
    occs = [occ(float(i), f"pid:{i}", pid=i, id=f"o{i:03}", last_ts=250.0) for i in range(127)]
    occs += [occ(200.0, "pid:a", id="z", last_ts=100.0), occ(200.0, "pid:b", id=None, last_ts=100.0)]
    state = gpu(occurrences=occs)
    prune(state, 300.0, P)
    assert len(state.occurrences) == 128 and "z" in {o["id"] for o in state.occurrences}
    occs = [occ(float(i), f"pid:{i}", pid=i, id=f"o{i:03}", last_ts=250.0) for i in range(127)]
    occs += [occ(199.0, "pid:a", id="early", last_ts=100.0), occ(200.0, "pid:b", id="a", last_ts=100.0)]
    state = gpu(occurrences=occs)
    prune(state, 300.0, P)
    assert "early" not in {o["id"] for o in state.occurrences}
    state = gpu(occurrences=occs[:128])
    prune(state, 300.0, P)
    assert len(state.occurrences) == 128


def test_xids_are_capped_at_200_and_failures_at_64_the_newest_as_listed():
    state = gpu(xids=[{"ts": float(i), "id": i} for i in range(201)],
                workload_failures=[failure(float(i), id=i) for i in range(65)])
    prune(state, 300.0, P)
    assert [x["id"] for x in state.xids] == list(range(1, 201))
    assert [w["id"] for w in state.workload_failures] == list(range(1, 65))
    state = gpu(xids=[{"ts": float(i)} for i in range(200)], workload_failures=[failure(float(i)) for i in range(64)])
    prune(state, 300.0, P)
    assert len(state.xids) == 200 and len(state.workload_failures) == 64


# -- samples ---------------------------------------------------------------------------------------
def smp(t, util=100.0, mem=0.0, total=10_000.0, power=None, sm=None, memclk=None, id=None):
    return GpuSample(ts=at(t), node="n1", gpu_uuid=UUID, gpu_index=3, pci_bus_id="0000:02:00",
                     utilization_gpu_pct=util, memory_used_mib=mem, memory_total_mib=total, power_w=power,
                     sm_clock_mhz=sm, mem_clock_mhz=memclk, event_id=id or f"s{t:g}")


@pytest.mark.parametrize("util, mem, total, is_pinned", [
    (95.0, 100.0, 10_000.0, True), (94.9, 0.0, 10_000.0, False), (100.0, 100.1, 10_000.0, False),
    (None, 0.0, 10_000.0, False), (100.0, None, 10_000.0, False), (100.0, 0.0, None, False), (100.0, 0.0, 0.0, False),
])
def test_pinned_is_utilization_at_or_over_the_bound_and_memory_at_or_under_its_fraction(util, mem, total, is_pinned):
    state = gpu()
    assert fold_sample_pin(state, smp(10, util, mem, total), 10.0, P) is is_pinned
    assert (state.pinned_since, state.pinned_samples) == ((10.0, 1) if is_pinned else (None, 0))


def test_the_pinned_bounds_are_the_policys_and_the_total_may_come_from_the_inventory():
    p = policy(pinned_util_pct=98.0, pinned_mem_fraction=0.02)
    assert fold_sample_pin(gpu(), smp(1, 98.0, 200.0), 1.0, p) is True
    assert fold_sample_pin(gpu(), smp(1, 97.9, 0.0), 1.0, p) is False
    assert fold_sample_pin(gpu(), smp(1, 100.0, 200.1), 1.0, p) is False
    assert fold_sample_pin(gpu(memory_total_mib=10_000.0), smp(1, 100.0, 100.0, total=None), 1.0, P) is True
    assert fold_sample_pin(gpu(memory_total_mib=1000.0), smp(1, 100.0, 100.0, total=None), 1.0, P) is False


def test_a_pinned_run_gathers_its_statistics_and_an_unpinned_sample_ends_it():
    state = gpu(proc_snapshots=5)
    fold_sample_pin(state, smp(10, 99.0, 10.0, power=100.0, sm=1000, memclk=5000, id="a"), 10.0, P)
    assert (state.pinned_since, state.pinned_last, state.pinned_samples, state.proc_snapshots) == (10.0, 10.0, 1, 0)
    assert state.pin_ids == ["a", "a"] and state.pin_stats == {"util_min": 99.0, "mem_max": 10.0, "power_sum": 100.0,
                                                           "power_n": 1, "sm_max": 1000, "memclk_max": 5000}
    fold_sample_pin(state, smp(20, 97.0, 50.0, power=120.0, sm=900, memclk=6000, id="b"), 20.0, P)
    fold_sample_pin(state, smp(15, 100.0, 5.0, power=None, sm=None, memclk=None, id="c"), 15.0, P)  # read late
    assert (state.pinned_since, state.pinned_last, state.pinned_samples) == (10.0, 20.0, 3)
    assert state.pin_ids == ["a", "c"]
    assert state.pin_stats == {"util_min": 97.0, "mem_max": 50.0, "power_sum": 220.0, "power_n": 2, "sm_max": 1000,
                               "memclk_max": 6000}
    assert fold_sample_pin(state, smp(30, 50.0, 50.0), 30.0, P) is False
    assert (state.pinned_since, state.pinned_samples, state.pin_ids) == (None, 0, [])
    assert state.pin_ids is EMPTY_LIST and state.pin_stats  # the statistics stay until the next pin


def test_a_row_pinned_without_statistics_starts_them():
    state = gpu(pinned_since=5.0, pinned_last=5.0, pinned_samples=1, pin_ids=["x"])
    assert state.pin_stats is EMPTY_DICT
    fold_sample_pin(state, smp(10, 96.0, 1.0, id="y"), 10.0, P)
    assert state.pin_stats == {"util_min": 96.0, "mem_max": 1.0} and type(state.pin_stats) is dict
    assert (state.pinned_since, state.pinned_last, state.pinned_samples, state.pin_ids) == (5.0, 10.0, 2, ["x", "y"])
    late = gpu(pinned_since=5.0, pinned_last=None, pinned_samples=1, pin_ids=["x"])
    fold_sample_pin(late, smp(3, id="z"), 3.0, P)
    assert late.pinned_last == 3.0


# -- process snapshots -----------------------------------------------------------------------------
def plist(t, apps=(), holders=None, id=None, unreadable=False):
    return GpuProcesses(ts=at(t), node="n1", gpu_uuid=UUID, gpu_index=3,
                        compute_apps=None if unreadable else [ComputeApp(pid=p, pod_uid=pod) for p, pod in apps],
                        device_holders=None if holders is None else [DeviceHolder(pid=h) for h in holders],
                        event_id=id or f"p{t:g}")


def test_the_kind_of_a_snapshot():
    assert snapshot_kind(plist(1, [(7, None)])) == COMPUTE
    assert snapshot_kind(plist(1)) == NO_PROCESS
    assert snapshot_kind(plist(1, [(7, None)], holders=[8])) == COMPUTE
    assert snapshot_kind(plist(1, holders=[8])) == NO_PROCESS  # a readable empty list outranks the holders
    assert snapshot_kind(plist(1, unreadable=True, holders=[])) == NO_PROCESS
    assert snapshot_kind(plist(1, unreadable=True, holders=[8])) == UNKNOWN
    assert snapshot_kind(plist(1, unreadable=True)) == UNKNOWN
    assert (COMPUTE, NO_PROCESS, UNKNOWN) == (1, 0, -1)


def test_runs_of_snapshot_kinds():
    state = gpu()
    for kind, ts in ((NO_PROCESS, 10.0), (NO_PROCESS, 20.0), (NO_PROCESS, 20.0), (COMPUTE, 30.0), (COMPUTE, 40.0),
                     (NO_PROCESS, 50.0)):
        fold_run(state, kind, ts)
    assert state.proc_runs == [[NO_PROCESS, 10.0, 20.0], [COMPUTE, 30.0, 40.0], [NO_PROCESS, 50.0, 50.0]]
    fold_run(state, COMPUTE, 25.0)  # read out of order: a run of its own, in place
    assert state.proc_runs == [[NO_PROCESS, 10.0, 20.0], [COMPUTE, 25.0, 25.0], [COMPUTE, 30.0, 40.0],
                               [NO_PROCESS, 50.0, 50.0]]
    fold_run(state, NO_PROCESS, 49.0)
    assert state.proc_runs[-2:] == [[NO_PROCESS, 49.0, 49.0], [NO_PROCESS, 50.0, 50.0]]


def test_runs_are_capped_at_8_the_newest_in_order_and_out_of_order():
    state = gpu()
    for i in range(8):
        fold_run(state, i % 2, float(10 * i))
    assert len(state.proc_runs) == 8 and state.proc_runs[0] == [0, 0.0, 0.0]
    fold_run(state, 0, 80.0)
    assert len(state.proc_runs) == 8 and state.proc_runs[0] == [1, 10.0, 10.0] and state.proc_runs[-1] == [0, 80.0, 80.0]
    fold_run(state, 1, 15.0)  # out of order, in place; the oldest goes
    assert len(state.proc_runs) == 8 and state.proc_runs[:2] == [[1, 15.0, 15.0], [0, 20.0, 20.0]]
    fold_run(state, 0, 5.0)  # older than all kept: in, then the oldest (itself) goes
    assert len(state.proc_runs) == 8 and state.proc_runs[0] == [1, 15.0, 15.0]
    small = gpu(proc_runs=[[0, 10.0, 10.0]])
    fold_run(small, 1, 5.0)
    assert small.proc_runs == [[1, 5.0, 5.0], [0, 10.0, 10.0]]


def test_a_process_list_names_pods_and_records_its_kind():
    state = gpu(pinned_since=10.0)
    assert fold_processes(state, plist(10, [(7, "uid-7"), (8, None)], id="p1"), 10.0) is False
    assert state.pods == {"7": "uid-7"} and state.procs_ts == 10.0 and state.last_compute_ts == 10.0
    assert state.proc_runs == [[COMPUTE, 10.0, 10.0]] and state.proc_snapshots == 0
    assert (state.last_nocompute_ts, state.nocompute_id) == (None, None)
    fold_processes(state, plist(5, [(7, "uid-7")]), 5.0)  # read late: the newest stays
    assert state.procs_ts == 10.0 and state.last_compute_ts == 10.0
    fold_processes(state, plist(20, id="p2"), 20.0)
    assert (state.last_nocompute_ts, state.nocompute_id, state.proc_snapshots) == (20.0, "p2", 1)
    fold_processes(state, plist(15, id="p3"), 15.0)  # older than the newest: counted, not the newest
    assert (state.last_nocompute_ts, state.nocompute_id, state.proc_snapshots) == (20.0, "p2", 2)
    fold_processes(state, plist(20, id="p4"), 20.0)  # as new: it is the newest
    assert (state.nocompute_id, state.proc_snapshots) == ("p4", 3)
    fold_processes(state, plist(9, id="p5"), 9.0)  # before the pin: not one of its snapshots
    assert state.proc_snapshots == 3
    fold_processes(state, plist(30, unreadable=True, holders=[1]), 30.0)
    assert (state.procs_ts, state.last_nocompute_ts, state.proc_snapshots) == (30.0, 20.0, 3)
    fold_processes(state, plist(31, holders=[]), 31.0)  # no holder stands in for the unreadable list
    unpinned = gpu()
    fold_processes(unpinned, plist(1), 1.0)
    assert unpinned.proc_snapshots == 0 and unpinned.last_nocompute_ts == 1.0


def test_a_pid_changing_pod_is_relearned_and_the_pods_are_capped_at_32():
    state = gpu()
    fold_processes(state, plist(1, [(i, f"uid-{i}") for i in range(32)]), 1.0)
    assert len(state.pods) == 32 and state.pods["0"] == "uid-0"
    fold_processes(state, plist(2, [(0, "uid-new")]), 2.0)
    assert len(state.pods) == 32 and state.pods["0"] == "uid-new"
    fold_processes(state, plist(3, [(99, "uid-99")]), 3.0)
    assert len(state.pods) == 32 and "0" not in state.pods and state.pods["99"] == "uid-99" and "1" in state.pods


def test_a_process_list_names_the_pod_of_a_fault_read_before_it():
    occs = [occ(5.0, "pid:7", id="a"), occ(5.0, "pid:8", pid=8, id="b"), occ(5.0, "pod:x", id="c"),
            occ(5.0, None, pid=None, id="d"), occ(5.0, None, pid=7, id="e")]
    state = gpu(occurrences=occs)
    fold_processes(state, plist(4, [(7, "uid-7")]), 4.0)
    assert [(o["wl"], o["pod"]) for o in state.occurrences] == [
        ("pod:uid-7", "uid-7"), ("pid:8", None), ("pod:x", None), (None, None), (None, None)]
    # a list that names no new pod renames nothing, even a fault whose pod is known
    again = gpu(occurrences=[occ(5.0, "pid:7")], pods={"7": "uid-7"})
    fold_processes(again, plist(6, [(7, "uid-7")]), 6.0)
    assert again.occurrences[0]["wl"] == "pid:7"


@pytest.mark.parametrize("before, ts, settles", [
    (None, 5.0, True), (None, 4.0, False), (4.0, 5.0, True), (5.0, 6.0, False), (4.9, 4.95, False),
])
def test_a_process_list_settles_a_fault_when_it_is_the_first_as_new_as_it(before, ts, settles):
    state = gpu(procs_ts=before, occurrences=[occ(5.0, "pod:a")])
    assert fold_processes(state, plist(ts), ts) is settles
    unknown = gpu(procs_ts=before, occurrences=[occ(5.0, "pod:a")])
    assert fold_processes(unknown, plist(ts, unreadable=True), ts) is settles


def test_settled():
    assert settled(GpuState(key="node-a/0000:02:00"), occ(5.0, "pid:7")) is True
    assert settled(gpu(), occ(5.0, "pod:a")) is False
    assert settled(gpu(procs_ts=4.9), occ(5.0, "pod:a")) is False
    assert settled(gpu(procs_ts=5.0), occ(5.0, "pod:a")) is True
    assert settled(gpu(), occ(5.0, "pod:a", nolists=True)) is True
    assert settled(gpu(), occ(5.0, None, nolists=True)) is True
    assert settled(gpu(procs_ts=5.0, clock=94.9), occ(5.0, "pid:7")) is False
    assert settled(gpu(procs_ts=5.0, clock=95.0), occ(5.0, "pid:7")) is True
    assert settled(gpu(procs_ts=5.0, clock=94.9), occ(5.0, "pod:a", by_death=True)) is False  # a death's name may move
    assert settled(gpu(procs_ts=5.0), occ(5.0, "pid:7")) is False
    assert settled(gpu(procs_ts=5.0), occ(-90.0, "pid:7")) is True  # no clock reads as 0
    assert settled(gpu(clock=94.9), occ(5.0, "pid:7", nolists=True)) is False
    assert settled(gpu(clock=95.0), occ(5.0, "pid:7", nolists=True)) is True


def test_pending():
    assert pending(gpu()) is False
    assert pending(gpu(procs_ts=5.0, occurrences=[occ(5.0, "pod:a")])) is False
    assert pending(gpu(procs_ts=5.0, occurrences=[occ(5.0, "pod:a"), occ(6.0, "pod:b")])) is True


def wl_event(t, event="failed", pod_uid="uid-a"):
    return WorkloadEvent(ts=at(t), node="n1", gpu_uuid=UUID, pod_uid=pod_uid, namespace="ml", pod="vllm-1",
                         event=event, reason="Error", exit_code=1, event_id=f"w{t:g}")


def test_a_failure_or_restart_is_a_fact_and_names_the_faults_it_explains():
    state = gpu(occurrences=[occ(90.0, "pid:7")], workload_failures=[failure(0.0)])
    item = fold_workload(state, wl_event(100.0), 100.0, policy(workload_failure_lookback_s=99.0))
    assert item == {"ts": 100.0, "pod_uid": "uid-a", "pod": "vllm-1", "namespace": "ml", "reason": "Error",
                    "exit_code": 1, "event": "failed", "id": "w100"}
    assert state.workload_failures == [item]  # pruned by the lookback
    assert state.occurrences[0]["wl"] == "pod:uid-a"
    assert fold_workload(gpu(), wl_event(1.0, "restarted"), 1.0, P)["event"] == "restarted"
    started = gpu()
    assert fold_workload(started, wl_event(1.0, "started"), 1.0, P) is None and started.workload_failures is EMPTY_LIST


# -- the pinned run's onset ------------------------------------------------------------------------
def pin(since=0.0, last=100.0, procs_ts=100.0, runs=((NO_PROCESS, 0.0, 100.0),), samples=5, **kw):
    return gpu(pinned_since=since, pinned_last=last, procs_ts=procs_ts, proc_runs=[list(r) for r in runs],
               pinned_samples=samples, **kw)


def test_pin_onset_needs_a_pin_both_readings_and_a_no_process_snapshot_after_its_start():
    assert pin_onset(pin(), 60.0) == (60.0, 0.0)
    assert pin_onset(pin(since=None), 0.0) is None
    assert pin_onset(pin(last=None), 0.0) is None
    assert pin_onset(pin(procs_ts=None), 0.0) is None
    assert pin_onset(pin(runs=()), 0.0) is None
    assert pin_onset(pin(runs=((NO_PROCESS, -5.0, 0.0),)), 0.0) is None  # ended at the start: not after it
    assert pin_onset(pin(runs=((NO_PROCESS, -5.0, 0.5),)), 0.0) == (0.0, 0.0)
    assert pin_onset(pin(runs=((UNKNOWN, 0.0, 100.0),)), 0.0) is None


@pytest.mark.parametrize("last, procs_ts, needed, onset", [
    (60.0, 100.0, 60.0, (60.0, 0.0)), (59.9, 100.0, 60.0, None), (100.0, 59.9, 60.0, None), (100.0, 100.0, 100.0,
                                                                                             (100.0, 0.0)),
])
def test_pin_onset_waits_until_both_samples_and_lists_were_read_through_it(last, procs_ts, needed, onset):
    assert pin_onset(pin(last=last, procs_ts=procs_ts), needed) == onset


def test_pin_onset_is_not_before_its_floor():
    assert pin_onset(pin(), 60.0, 70.0) == (70.0, 0.0)
    assert pin_onset(pin(), 60.0, 50.0) == (60.0, 0.0)
    assert pin_onset(pin(), 60.0, 100.0) == (100.0, 0.0)
    assert pin_onset(pin(), 60.0, 100.5) is None


def test_the_first_no_process_snapshot_after_the_start_can_move_the_onset():
    runs = ((NO_PROCESS, 70.0, 100.0),)
    assert pin_onset(pin(runs=runs), 60.0) == (70.0, 0.0)
    assert pin_onset(pin(runs=((NO_PROCESS, 60.0, 100.0),)), 60.0) == (60.0, 0.0)
    assert pin_onset(pin(runs=((NO_PROCESS, 100.5, 101.0),)), 60.0) is None  # not read through yet
    assert pin_onset(pin(runs=((NO_PROCESS, 80.0, 90.0), (NO_PROCESS, 70.0, 75.0))), 60.0) == (70.0, 0.0)


def test_a_compute_snapshot_restarts_the_span_at_its_run_end():
    runs = ((NO_PROCESS, 0.0, 10.0), (COMPUTE, 20.0, 30.0), (NO_PROCESS, 40.0, 200.0))
    assert pin_onset(pin(last=200.0, procs_ts=200.0, runs=runs), 60.0) == (90.0, 30.0)
    # a compute run that starts after the onset does not move it
    runs = ((NO_PROCESS, 0.0, 60.0), (COMPUTE, 61.0, 70.0), (NO_PROCESS, 71.0, 200.0))
    assert pin_onset(pin(last=200.0, procs_ts=200.0, runs=runs), 60.0) == (60.0, 0.0)
    # one at the onset does: 60 s from its end
    runs = ((NO_PROCESS, 0.0, 59.0), (COMPUTE, 60.0, 70.0), (NO_PROCESS, 71.0, 200.0))
    assert pin_onset(pin(last=200.0, procs_ts=200.0, runs=runs), 60.0) == (130.0, 70.0)
    # a compute run that ended at the pin's start does not move it
    runs = ((COMPUTE, -10.0, 0.0), (NO_PROCESS, 1.0, 200.0))
    assert pin_onset(pin(last=200.0, procs_ts=200.0, runs=runs), 60.0) == (60.0, 0.0)
    # the newest compute run counts, in whichever order the runs are listed
    runs = ((COMPUTE, 40.0, 50.0), (COMPUTE, 20.0, 30.0), (NO_PROCESS, 51.0, 200.0))
    assert pin_onset(pin(last=200.0, procs_ts=200.0, runs=runs), 60.0) == (110.0, 50.0)
    # the no-process snapshot must come after the compute one
    runs = ((NO_PROCESS, 0.0, 10.0), (COMPUTE, 20.0, 200.0))
    assert pin_onset(pin(last=200.0, procs_ts=200.0, runs=runs), 60.0) is None


def test_each_compute_run_can_move_the_onset_again():
    runs = [(NO_PROCESS, 0.0, 5.0)]
    for i in range(6):  # a compute snapshot every 50 s: no 60 s span until the last one
        runs += [(COMPUTE, 50.0 * (i + 1), 50.0 * (i + 1)), (NO_PROCESS, 50.0 * (i + 1) + 1, 50.0 * (i + 1) + 40)]
    runs.append((NO_PROCESS, 341.0, 1000.0))
    got = pin_onset(pin(last=1000.0, procs_ts=1000.0, runs=runs), 60.0)
    assert got == (360.0, 300.0)


def test_nocompute_start_and_the_guards_sustained_pin():
    assert nocompute_start(pin()) == 0.0
    assert nocompute_start(pin(runs=((COMPUTE, 0.0, 30.0), (NO_PROCESS, 31.0, 100.0)))) == 30.0
    assert nocompute_start(pin(runs=((COMPUTE, 0.0, 100.0),))) is None
    assert sustained_pin(pin()) == 100.0
    assert sustained_pin(pin(samples=1)) == 0.0
    assert sustained_pin(pin(samples=2)) == 100.0
    assert sustained_pin(pin(last=9.9)) == 0.0
    assert sustained_pin(pin(last=10.0, procs_ts=10.0)) == 10.0
    assert sustained_pin(pin(last=50.0, procs_ts=40.0)) == 40.0
    assert sustained_pin(pin(last=40.0, procs_ts=50.0)) == 40.0
    runs = ((COMPUTE, 0.0, 30.0), (NO_PROCESS, 31.0, 100.0))
    assert sustained_pin(pin(runs=runs)) == 70.0
    assert sustained_pin(pin(runs=((COMPUTE, 0.0, 100.0),))) == 0.0


def test_sample_stats():
    assert sample_stats(gpu()) == {}
    state = pin(since=10.0, last=100.25, procs_ts=100.25, runs=((COMPUTE, 0.0, 30.0), (NO_PROCESS, 31.0, 100.25)),
                proc_snapshots=4, pin_stats={"util_min": 97.0, "mem_max": 3.0, "power_sum": 301.0, "power_n": 3,
                                              "sm_max": 1000, "memclk_max": 5000})
    assert sample_stats(state) == {
        "pinned_seconds": 90.2, "samples": 5, "utilization_gpu_pct_min": 97.0, "memory_used_mib_max": 3.0,
        "power_w_avg": 100.3, "sm_clock_mhz_max": 1000, "mem_clock_mhz_max": 5000,
        "process_snapshots_without_compute": 4, "seconds_without_compute": 70.2}
    bare = gpu(pin_stats={"util_min": 97.0}, pinned_samples=2)
    assert sample_stats(bare) == {
        "pinned_seconds": 0, "samples": 2, "utilization_gpu_pct_min": 97.0, "memory_used_mib_max": None,
        "power_w_avg": None, "sm_clock_mhz_max": None, "mem_clock_mhz_max": None,
        "process_snapshots_without_compute": 0, "seconds_without_compute": 0}
    no_power = pin(pin_stats={"util_min": 97.0, "power_sum": 5.0, "power_n": 0}, runs=((COMPUTE, 0.0, 100.0),))
    got = sample_stats(no_power)
    assert got["power_w_avg"] is None and got["seconds_without_compute"] == 0.0 and got["pinned_seconds"] == 100.0
    since_only = gpu(pin_stats={"util_min": 97.0}, pinned_since=None, pinned_last=30.0)
    assert sample_stats(since_only)["pinned_seconds"] == 30.0


# -- found by mutation testing -------------------------------------------------------------
def test_statistics_start_from_the_first_pinned_samples_own_values():
    # a wedged GPU reads 0 MiB, and may read 0 MHz: the first sample's values, not a floor of ours
    state = gpu()
    fold_sample_pin(state, smp(10, 100.0, 0.0, power=0.0, sm=0, memclk=0), 10.0, P)
    assert state.pin_stats == {"util_min": 100.0, "mem_max": 0.0, "power_sum": 0.0, "power_n": 1, "sm_max": 0,
                               "memclk_max": 0}


def test_the_clock_maxima_keep_the_highest_whatever_the_order():
    state = gpu()
    fold_sample_pin(state, smp(10, sm=2000, memclk=6000), 10.0, P)
    fold_sample_pin(state, smp(20, sm=1000, memclk=5000), 20.0, P)
    assert (state.pin_stats["sm_max"], state.pin_stats["memclk_max"]) == (2000, 6000)


def test_the_pods_cap_forgets_the_oldest_pid_no_longer_listed_never_a_listed_one():
    state = gpu()
    fold_processes(state, plist(1, [(i, f"uid-{i}") for i in range(32)]), 1.0)
    fold_processes(state, plist(2, [(0, "uid-0"), (99, "uid-99")]), 2.0)
    assert len(state.pods) == 32 and state.pods["0"] == "uid-0" and "1" not in state.pods and "2" in state.pods


def test_a_no_process_snapshot_at_the_pins_first_sample_is_one_of_its_snapshots():
    state = gpu(pinned_since=10.0)
    fold_processes(state, plist(10), 10.0)
    assert state.proc_snapshots == 1
    fold_processes(state, plist(9.5), 9.5)
    assert state.proc_snapshots == 1


def test_a_snapshot_read_out_of_order_inside_a_run_goes_after_the_run_it_falls_in():
    state = gpu(proc_runs=[[NO_PROCESS, 10.0, 50.0]])
    fold_run(state, COMPUTE, 30.0)  # starts later than the run it falls in, ends earlier: by start
    assert state.proc_runs == [[NO_PROCESS, 10.0, 50.0], [COMPUTE, 30.0, 30.0]]


def test_seconds_without_compute_count_from_the_newest_compute_snapshot_in_the_pin():
    state = pin(since=1000.0, last=1100.0, procs_ts=1100.0, pin_stats={"util_min": 100.0, "mem_max": 0.0},
                runs=((NO_PROCESS, 1000.0, 1000.5), (COMPUTE, 1001.0, 1005.0), (NO_PROCESS, 1006.0, 1100.0)))
    assert nocompute_start(state) == 1005.0
    assert sample_stats(state)["seconds_without_compute"] == 95.0


def test_a_dropped_compute_run_leaves_its_end_as_the_floor_and_no_other_run_does():
    state = gpu()
    fold_run(state, COMPUTE, 5.0)
    assert state.compute_floor is None  # nothing dropped yet
    for i in range(1, 8):
        fold_run(state, i % 2 == 0 and COMPUTE or NO_PROCESS, 10.0 * i)
    assert len(state.proc_runs) == 8 and state.compute_floor is None
    fold_run(state, COMPUTE, 80.0)  # the ninth run: the compute run at 5 s goes, its end stays
    assert state.compute_floor == 5.0 and state.proc_runs[0] == [NO_PROCESS, 10.0, 10.0]
    fold_run(state, NO_PROCESS, 90.0)  # a no-process run goes: the floor stays
    assert state.compute_floor == 5.0
    fold_run(state, COMPUTE, 25.0)  # read out of order, in place: the oldest (compute, 20 s) goes
    assert state.compute_floor == 20.0 and len(state.proc_runs) == 8


def test_a_snapshot_read_twice_inside_a_run_of_its_kind_adds_no_run():
    state = gpu(proc_runs=[[NO_PROCESS, 10.0, 20.0], [COMPUTE, 30.0, 40.0]])
    for ts in (10.0, 15.0, 20.0):
        fold_run(state, NO_PROCESS, ts)
    assert state.proc_runs == [[NO_PROCESS, 10.0, 20.0], [COMPUTE, 30.0, 40.0]]
    fold_run(state, COMPUTE, 15.0)  # inside a run of the other kind: a run of its own
    assert state.proc_runs == [[NO_PROCESS, 10.0, 20.0], [COMPUTE, 15.0, 15.0], [COMPUTE, 30.0, 40.0]]


def test_a_fault_a_process_list_names_is_the_lists_for_good():
    state = gpu(occurrences=[occ(5.0, "pid:7", id="a")])
    fold_processes(state, plist(4, [(7, "uid-7")]), 4.0)
    assert state.occurrences == [{"ts": 5.0, "last_ts": 5.0, "pid": 7, "wl": "pod:uid-7", "codes": [13], "pod": "uid-7",
                                  "id": "a", "by_death": False}]
    name_by_deaths(state, P)  # no death: a name from the lists is not taken back
    assert state.occurrences[0]["wl"] == "pod:uid-7"


def test_a_name_from_a_death_that_is_gone_is_taken_back_whole():
    state = gpu(occurrences=[occ(99.0, "pod:old", by_death=True, id="d")])
    state.occurrences[0]["pod"] = "old"
    name_by_deaths(state, P)
    assert state.occurrences == [{"ts": 99.0, "last_ts": 99.0, "pid": 7, "wl": "pid:7", "codes": [13], "pod": None,
                                  "id": "d", "by_death": False}]


def test_one_fault_is_named_by_one_death_only():
    state = gpu(occurrences=[occ(95.0, "pid:7", id="a")], workload_failures=[failure(100.0), failure(101.0, "uid-b")])
    name_by_deaths(state, P)
    assert _named(state) == [("pod:uid-a", "uid-a")]


def test_deaths_at_one_instant_name_faults_in_the_order_of_their_ids():
    for deaths in ([failure(100.0, "uid-b", "b"), failure(100.0, "uid-a", "a")],
                   [failure(100.0, "uid-a", "a"), failure(100.0, "uid-b", "b")]):
        state = gpu(occurrences=[occ(90.0, "pid:7", id="f90"), occ(95.0, "pid:8", pid=8, id="f95")],
                    workload_failures=deaths)
        name_by_deaths(state, P)  # "a" first takes the newest fault before it
        assert _named(state) == [("pod:uid-b", "uid-b"), ("pod:uid-a", "uid-a")]
    state = gpu(occurrences=[occ(90.0, "pid:7", id="f90"), occ(95.0, "pid:8", pid=8, id="f95")],
                workload_failures=[failure(100.0, "uid-a", "A"), failure(100.0, "uid-n", None)])
    name_by_deaths(state, P)  # a death without an id sorts first
    assert _named(state) == [("pod:uid-a", "uid-a"), ("pod:uid-n", "uid-n")]


def test_a_death_names_a_fault_at_its_own_instant_before_an_older_one():
    state = gpu(occurrences=[occ(95.0, "pid:7", id="older"), occ(100.0, "pid:8", pid=8, id="same")],
                workload_failures=[failure(100.0)])
    name_by_deaths(state, P)
    assert _named(state) == [("pid:7", None), ("pod:uid-a", "uid-a")]


def test_with_no_fault_before_it_a_death_names_the_first_just_after():
    state = gpu(occurrences=[occ(104.0, "pid:7", id="later"), occ(102.0, "pid:8", pid=8, id="first")],
                workload_failures=[failure(100.0)])
    name_by_deaths(state, P)
    assert _named(state) == [("pid:7", None), ("pod:uid-a", "uid-a")]


def test_faults_at_one_instant_are_named_in_the_order_of_their_ids():
    state = gpu(occurrences=[occ(95.0, "pid:7", id="a"), occ(95.0, "pid:8", pid=8, id="b")],
                workload_failures=[failure(100.0)])
    name_by_deaths(state, P)  # the greater id
    assert _named(state) == [("pid:7", None), ("pod:uid-a", "uid-a")]
    state = gpu(occurrences=[occ(95.0, "pid:7", id=None), occ(95.0, "pid:8", pid=8, id="A")],
                workload_failures=[failure(100.0)])
    name_by_deaths(state, P)  # a fault without an id is the least
    assert _named(state) == [("pid:7", None), ("pod:uid-a", "uid-a")]


def test_no_run_without_compute_now_when_the_newest_snapshot_read_has_a_compute_process():
    state = pin(last=100.0, procs_ts=100.0, runs=((NO_PROCESS, 0.0, 50.0), (COMPUTE, 100.0, 100.0)))
    assert nocompute_start(state) is None
    state = pin(last=100.0, procs_ts=100.0, runs=((COMPUTE, 0.0, 50.0), (NO_PROCESS, 100.0, 100.0)))
    assert nocompute_start(state) == 50.0  # a no-process snapshot at the newest read
    # a no-process snapshot only at the pin's first instant is not one after its start (as pin_onset)
    state = pin(since=0.0, runs=((NO_PROCESS, -10.0, 0.0),))
    assert nocompute_start(state) is None and pin_onset(state, 0.0) is None


def test_a_pin_read_through_the_instant_zero_counts_its_seconds():
    state = pin(since=-20.0, last=0.0, procs_ts=5.0, runs=((NO_PROCESS, -20.0, 5.0),))
    assert sustained_pin(state) == 20.0
    state = pin(since=-20.0, last=5.0, procs_ts=0.0, runs=((NO_PROCESS, -20.0, 0.0),))
    assert sustained_pin(state) == 20.0
    assert settled(gpu(procs_ts=5.0), occ(-89.5, "pid:7")) is False  # no clock reads as 0, not 1


def test_the_caps_break_ties_of_time_by_id_a_missing_id_first():
    tied = [occ(1.0, "pid:1", pid=1, id=None, codes=(45,)), occ(1.0, "pid:2", pid=2, id="A", codes=(45,))]
    rest = [occ(float(i), f"pid:{i}", pid=i, id=f"t{i:03}", codes=(45,)) for i in range(10, 73)]
    state = gpu(occurrences=tied + rest)  # 65 Xid 45-only: the one without an id goes
    prune(state, 100.0, P)
    assert [o["id"] for o in state.occurrences[:1]] == ["A"] and len(state.occurrences) == 64
    tied = [occ(1.0, "pid:1", pid=1, id=None), occ(1.0, "pid:2", pid=2, id="A")]
    rest = [occ(float(i), f"pid:{i}", pid=i, id=f"o{i:03}") for i in range(10, 137)]
    state = gpu(occurrences=tied + rest)  # 129 application occurrences
    prune(state, 200.0, P)
    assert state.occurrences[0]["id"] == "A" and len(state.occurrences) == 128


def test_at_the_cap_the_occurrences_keep_the_order_they_were_read_in():
    occs = [occ(float(200 - i), f"pid:{i}", pid=i, id=f"o{i:03}") for i in range(128)]
    state = gpu(occurrences=list(occs))
    prune(state, 250.0, P)
    assert [o["id"] for o in state.occurrences] == [o["id"] for o in occs]
