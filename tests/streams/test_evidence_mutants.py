"""xidstream.streams.evidence, the cases its surviving mutants showed no test held (make mutate
streams/evidence.py): the compute floor in the pin's start, the runs a process list records, a
closed fault's name, the window `pending` reads, and the guards of `nocompute_start`."""

from __future__ import annotations

import orjson

from xidstream.streams.classify import step
from xidstream.streams.evidence import (
    COMPUTE,
    NO_PROCESS,
    GpuState,
    fold_processes,
    fold_run,
    fold_sample_pin,
    name_by_deaths,
    nocompute_start,
    pending,
    pin_onset,
)
from tests.streams.builders import GPU, inventory, procs, sample
from tests.streams.test_evidence_exact import P, failure, gpu, occ, pin, plist, smp


# -- the runs of snapshot kinds, through a process list ---------------------------------------------
def test_each_process_list_of_another_kind_starts_a_run_of_its_own():
    # the lists at 1 s and 2 s: a run's first time equal to a kind's number (COMPUTE is 1) must not
    # read as that kind
    state = gpu()
    fold_processes(state, plist(1), 1.0)
    fold_processes(state, plist(2, [(7, "uid-7")]), 2.0)
    fold_processes(state, plist(3), 3.0)
    fold_processes(state, plist(4), 4.0)
    assert state.proc_runs == [[NO_PROCESS, 1.0, 1.0], [COMPUTE, 2.0, 2.0], [NO_PROCESS, 3.0, 4.0]]


def test_a_snapshot_at_the_newest_runs_end_of_another_kind_is_the_newest_run():
    # read at the same instant as the newest run's end, after it: the newest kind read is last
    # (the row's material and the pin's start read runs[-1]), even where an older run of its kind
    # covers that instant
    state = gpu(proc_runs=[[NO_PROCESS, 0.0, 10.0], [COMPUTE, 10.0, 10.0]])
    fold_run(state, NO_PROCESS, 10.0)
    assert state.proc_runs == [[NO_PROCESS, 0.0, 10.0], [COMPUTE, 10.0, 10.0], [NO_PROCESS, 10.0, 10.0]]


def test_a_compute_list_at_an_instant_already_read_takes_the_rows_float_for_it():
    # A row read back has one float object per field; a compute list at the newest compute time
    # (a repeat after a failover) stores the clock's float for it, as max(ts, last) did: one float
    # per reading again (memory per GPU)
    state = step(None, GPU, inventory(0), P)[0]
    for r in (sample(10), procs(10, 7)):
        state = step(state, GPU, r, P)[0]
    state = GpuState.from_dict(orjson.loads(orjson.dumps(state.to_dict())))
    assert state.last_compute_ts == state.clock and state.last_compute_ts is not state.clock
    state = step(state, GPU, procs(10, 7), P)[0]
    assert state.last_compute_ts is state.clock


# -- a closed fault --------------------------------------------------------------------------------
def test_a_closed_fault_keeps_the_name_it_had_whatever_the_deaths():
    # its incident resolved: the death that named it is forgotten with it, and a death read now
    # names only an open fault (a crash loop's closed faults renamed by PID were several workloads)
    named = occ(99.0, "pod:old", by_death=True, closed=True, id="c")
    named["pod"] = "old"
    state = gpu(occurrences=[named])
    name_by_deaths(state, P)
    assert (named["wl"], named["pod"], named["by_death"]) == ("pod:old", "old", True)
    state = gpu(occurrences=[occ(95.0, "pid:7", closed=True, id="c"), occ(96.0, "pid:8", pid=8, id="open")],
                workload_failures=[failure(100.0)])
    name_by_deaths(state, P)
    assert [(o["wl"], o["pod"]) for o in state.occurrences] == [("pid:7", None), ("pod:uid-a", "uid-a")]
    alone = gpu(occurrences=[occ(95.0, "pid:7", closed=True, id="c")], workload_failures=[failure(100.0)])
    name_by_deaths(alone, P)
    assert alone.occurrences[0]["wl"] == "pid:7"


# -- pending ---------------------------------------------------------------------------------------
def test_pending_reads_only_the_newest_16_occurrences():
    # kept in time order (one topic), an older fault settles before the newer ones: the 17th from
    # the end is not looked at
    settled_ones = [occ(100.0 + i, "pod:a", id=f"s{i}") for i in range(16)]
    state = gpu(procs_ts=150.0, clock=150.0, occurrences=[occ(99.0, "pid:7", id="old"), *settled_ones])
    assert pending(state) is False
    state.occurrences = [occ(99.0, "pid:7", id="old"), *settled_ones[1:]]
    assert pending(state) is True


# -- the pin's start -------------------------------------------------------------------------------
def test_nocompute_start_needs_a_pin_its_newest_sample_and_a_process_list():
    assert nocompute_start(pin()) == 0.0
    assert nocompute_start(pin(since=None)) is None
    assert nocompute_start(pin(last=None)) is None
    assert nocompute_start(pin(procs_ts=None)) is None


def test_a_dropped_compute_runs_end_is_the_floor_of_the_pins_start():
    # a compute run forgotten (the run cap) still ended at 40 s: the span without compute counts
    # from there, never from the pin's start before it
    assert nocompute_start(pin(compute_floor=40.0)) == 40.0
    assert pin_onset(pin(compute_floor=40.0), 30.0) == (70.0, 40.0)
    assert pin_onset(pin(compute_floor=40.0), 60.0) == (100.0, 40.0)  # read through 100 s
    assert pin_onset(pin(compute_floor=40.0), 60.5) is None
    # a floor before the pin's start leaves the start
    assert nocompute_start(pin(since=10.0, compute_floor=5.0)) == 10.0
    assert pin_onset(pin(since=10.0, compute_floor=5.0), 30.0) == (40.0, 10.0)


# -- statistics ------------------------------------------------------------------------------------
def test_the_minimum_utilization_of_a_pin_never_reads_over_100_percent():
    # NVML reads 0-100; the sample schema does not bound it: a reading over 100 leaves the minimum at 100
    state = gpu()
    fold_sample_pin(state, smp(10, util=100.5), 10.0, P)
    assert state.pin_stats["util_min"] == 100.0
    fold_sample_pin(state, smp(20, util=99.5), 20.0, P)
    assert state.pin_stats["util_min"] == 99.5
