"""The rules of streams.verdict, exactly, on hand-built GPU rows (mutants of the pinned
rules, the suspect rule and the verdict texts survived tests that only checked that some verdict
came). Each window is tried at its bound, just inside and just past it; each verdict is compared
whole (classification, plan, text, evidence ids, timeline entry)."""

from __future__ import annotations

import dataclasses

import pytest

from xidstream.schemas.vocab import Action, Classification
from xidstream.streams.evidence import COMPUTE, NO_PROCESS, UNKNOWN, GpuState, entry
from xidstream.streams.hardware import QUARANTINE, REBOOT, RECORD, RESET
from xidstream.streams.incident import Incident
from xidstream.streams.policy import Policy
from xidstream.streams.verdict import (
    PLANS,
    RANK,
    XID45,
    Verdict,
    app_occurrence_verdict,
    earliest_suspect,
    hardware_xid_verdict,
    pinned_verdicts,
    recovery_action_verdict,
    remap_failure_verdict,
    suspect_verdict,
    workload_label,
)

P = Policy()  # pinned 60 s, wedge and application lookbacks 1800 s, suspect window 600 s
UUID = "GPU-x"
X13 = "Xid 13 (ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY; NVIDIA: RESTART_APP)"


def policy(**changes) -> Policy:
    return dataclasses.replace(P, **changes)


# -- pinned verdicts -------------------------------------------------------------------------------
def pinned(since=1000.0, last=2000.0, procs_ts=2000.0, runs=None, xids=(), failures=(), stats=None, **kw) -> GpuState:
    """GPU 3 pinned from `since` through `last`, process lists read through `procs_ts` (none with a
    compute process unless `runs` says so)."""
    return GpuState(key=UUID, node="n1", gpu_uuid=UUID, gpu_index=3, pinned_since=since, pinned_last=last,
                    pinned_samples=10, procs_ts=procs_ts,
                    proc_runs=[list(r) for r in runs] if runs is not None else [[NO_PROCESS, since, procs_ts]],
                    pin_stats={"util_min": 99.0, "mem_max": 12.0} if stats is None else stats,
                    pin_ids=["s-first", "s-last"], nocompute_id="p-last", xids=[dict(x) for x in xids],
                    workload_failures=[dict(w) for w in failures], **kw)


def x43(ts, id="x43", **kw):
    return {"ts": ts, "xid": 43, "kind": "xid", "pid": 7, "app": True, "id": id, **kw}


def x13(ts, id="x13", **kw):
    return {"ts": ts, "xid": 13, "kind": "xid", "pid": 7, "app": True, "id": id, **kw}


def recovery_failure(ts, id="rf"):
    return {"ts": ts, "xid": None, "kind": "recovery_failure", "pid": None, "app": False, "id": id}


def stats_entry(state, t, start):
    return entry(t, "sample_stats", f"pinned {t - start:.0f} s without compute",
                 pinned_seconds=1000.0, samples=10, utilization_gpu_pct_min=99.0, memory_used_mib_max=12.0,
                 power_w_avg=None, sm_clock_mhz_max=None, mem_clock_mhz_max=None,
                 process_snapshots_without_compute=0, seconds_without_compute=1000.0)


def base(seconds):
    return f"GPU 3 (GPU-x) on n1: utilization >= 99% with 12 MiB used and no compute process for {seconds} s"


def phantom(t=1060.0, start=1000.0, seconds=60):
    state = pinned()
    return (t, Verdict(Classification.PHANTOM_LOAD, RECORD,
                       f"{base(seconds)} and no application or wedge Xid: phantom load",
                       ["s-first", "s-last", "p-last"], entry=stats_entry(state, t, start)))


def wedged(t, seconds, what, ids, start=1000.0):
    return (t, Verdict(Classification.GPU_WEDGED, RESET, f"{base(seconds)} after {what}: GPU context wedged",
                       ["s-first", "s-last", "p-last", *ids], entry=stats_entry(None, t, start)))


def suspect(t, seconds, x_id="x13", start=1000.0, code_text=X13):
    return (t, Verdict(Classification.GPU_SUSPECT, QUARANTINE,
                       f"{base(seconds)} after application-class {code_text} (no wedge evidence)",
                       ["s-first", "s-last", "p-last", x_id], entry=stats_entry(None, t, start)))


def test_a_pin_with_nothing_to_explain_it_is_phantom_load_after_exactly_pinned_seconds():
    assert pinned_verdicts(pinned(), P) == [phantom()]


@pytest.mark.parametrize("seconds", [10.0, 25.0])
def test_the_pinned_span_is_the_policys(seconds):
    got = pinned_verdicts(pinned(), policy(pinned_seconds=seconds))
    assert [(t, v.summary) for t, v in got] == [
        (1000.0 + seconds, f"{base(int(seconds))} and no application or wedge Xid: phantom load")]


@pytest.mark.parametrize("last, procs_ts, expected", [
    (1060.0, 1060.0, [1060.0]), (1059.0, 2000.0, []), (2000.0, 1059.0, []),
])
def test_the_pin_is_decided_only_once_samples_and_process_lists_were_both_read_through_it(last, procs_ts, expected):
    state = pinned(last=last, procs_ts=procs_ts, runs=[[NO_PROCESS, 1000.0, 1030.0]])
    assert [t for t, _ in pinned_verdicts(state, P)] == expected


def test_no_pin_no_process_list_or_no_no_process_snapshot_is_no_verdict():
    assert pinned_verdicts(pinned(since=None), P) == []
    assert pinned_verdicts(pinned(last=None), P) == []
    assert pinned_verdicts(dataclasses.replace(pinned(), procs_ts=None), P) == []
    assert pinned_verdicts(pinned(runs=[[UNKNOWN, 1000.0, 2000.0]]), P) == []


def test_a_pin_without_statistics_says_100_percent_and_0_mib():
    state = pinned(stats={})
    ((t, v),) = pinned_verdicts(state, P)
    assert t == 1060.0 and v.summary == ("GPU 3 (GPU-x) on n1: utilization >= 100% with 0 MiB used and no compute "
                                         "process for 60 s and no application or wedge Xid: phantom load")
    assert v.entry == entry(1060.0, "sample_stats", "pinned 60 s without compute")


def test_xid_43_during_the_pin_adds_the_wedge_at_its_time_and_leaves_the_phantom_load_before_it():
    got = pinned_verdicts(pinned(xids=[x43(1100.0)]), P)
    assert got == [phantom(), wedged(1100.0, 100, "Xid 43 at 00:18:20Z", ["x43"])]


def test_the_driver_failing_to_recover_the_gpu_is_wedge_evidence_like_xid_43():
    got = pinned_verdicts(pinned(xids=[recovery_failure(1100.0)]), P)
    assert got == [phantom(), wedged(1100.0, 100, "the driver's failure to recover the GPU at 00:18:20Z", ["rf"])]


def test_both_kinds_of_wedge_evidence_are_named_each_by_its_newest():
    xids = [x43(900.0, "a"), recovery_failure(910.0, "r1"), x43(950.0, "b"), recovery_failure(955.0, "r2")]
    got = pinned_verdicts(pinned(xids=xids), P)
    assert got == [wedged(1060.0, 60, "Xid 43 at 00:15:50Z and the driver's failure to recover the GPU at 00:15:55Z",
                          ["a", "r1", "b", "r2"])]


def test_backfilled_wedge_evidence_and_other_xids_are_not_wedge_evidence():
    xids = [x43(1100.0, backfilled=True), {"ts": 1100.0, "xid": 44, "kind": "xid", "app": False, "id": "x44"},
            {**recovery_failure(1100.0), "backfilled": True}]
    assert pinned_verdicts(pinned(xids=xids), P) == [phantom()]


@pytest.mark.parametrize("xid_ts, is_wedged", [(1060.0 - 1800.0, True), (1060.0 - 1801.0, False)])
def test_the_wedge_lookback_at_its_bound(xid_ts, is_wedged):
    got = pinned_verdicts(pinned(xids=[x43(xid_ts)]), P)
    if is_wedged:
        assert [(t, v.classification) for t, v in got] == [(1060.0, Classification.GPU_WEDGED)]
    else:  # too old to be this pin's wedge, and too old to hide the phantom load or make a suspect
        assert got == [phantom()]


def test_the_wedge_lookback_is_the_policys():
    got = pinned_verdicts(pinned(xids=[x43(1060.0 - 700.0)]), policy(wedged_xid43_lookback_s=700.0))
    assert [v.classification for _, v in got] == [Classification.GPU_WEDGED]
    got = pinned_verdicts(pinned(xids=[x43(1060.0 - 701.0)]), policy(wedged_xid43_lookback_s=700.0,
                                                                       app_xid_lookback_s=700.0))
    assert got == [phantom()]


def test_the_earliest_piece_of_wedge_evidence_decides_when_the_wedge_held():
    got = pinned_verdicts(pinned(xids=[x43(1200.0, "b"), x43(1100.0, "a")]), P)
    assert got == [phantom(), wedged(1100.0, 100, "Xid 43 at 00:18:20Z", ["a"])]
    # the later one is in the lookback of the first's onset only once it happened: it is not evidence yet


def test_a_wedge_whose_evidence_left_the_lookback_holds_at_the_earliest_time_of_the_newer_one():
    # the first Xid 43 is 1801 s before the pin's onset; the second one makes the wedge at the onset
    got = pinned_verdicts(pinned(xids=[x43(1060.0 - 1801.0, "old"), x43(1100.0, "new")]), P)
    assert got == [phantom(), wedged(1100.0, 100, "Xid 43 at 00:18:20Z", ["new"])]


def test_requiring_a_workload_failure_waits_for_the_first_one_at_or_after_the_wedge_evidence():
    req = policy(wedged_requires_workload_failure=True)
    # nothing, not even phantom load: wedge evidence is there, the wedge waits for its failure
    assert pinned_verdicts(pinned(xids=[x43(900.0)]), req) == []
    before = {"ts": 899.0, "id": "w-before"}
    assert pinned_verdicts(pinned(xids=[x43(900.0)], failures=[before]), req) == []
    failures = [before, {"ts": 1300.0, "id": "w2"}, {"ts": 1200.0, "id": "w1"}]
    got = pinned_verdicts(pinned(xids=[x43(900.0)], failures=failures), req)
    assert got == [(1200.0, Verdict(Classification.GPU_WEDGED, RESET,
                                    f"{base(200)} after Xid 43 at 00:15:00Z: GPU context wedged; "
                                    f"1 later workload failure(s)",
                                    ["s-first", "s-last", "p-last", "x43", "w1"],
                                    entry=stats_entry(None, 1200.0, 1000.0)))]
    at_once = pinned_verdicts(pinned(xids=[x43(900.0)], failures=[{"ts": 900.0, "id": "w0"}]), req)
    assert [(t, v.evidence_ids[-1]) for t, v in at_once] == [(1060.0, "w0")]
    # without the requirement the same rows are wedged at the onset
    assert [t for t, _ in pinned_verdicts(pinned(xids=[x43(900.0)], failures=failures), P)] == [1060.0]


def test_workload_failures_between_the_wedge_evidence_and_the_verdict_are_its_evidence():
    failures = [{"ts": 899.0, "id": "w-before"}, {"ts": 900.0, "id": "w-at"}, {"ts": 1060.0, "id": "w-t"},
                {"ts": 1060.5, "id": "w-after"}]
    ((t, v),) = pinned_verdicts(pinned(xids=[x43(900.0)], failures=failures), P)
    assert t == 1060.0 and v.evidence_ids == ["s-first", "s-last", "p-last", "x43", "w-at", "w-t"]
    assert v.summary == f"{base(60)} after Xid 43 at 00:15:00Z: GPU context wedged; 2 later workload failure(s)"


def test_a_wedge_after_a_successful_reset_climbs_to_a_reboot():
    inc = Incident(id="i", classification="GPU_WEDGED", opened_at=0.0, remedy=RESET, reset_ok_at=999.0)
    got = pinned_verdicts(pinned(xids=[x43(1100.0)], incident=inc), P)
    assert got[1] == (1100.0, Verdict(Classification.GPU_WEDGED, RESET, "GPU 3 wedged again after the GPU reset",
                                      ["s-first", "s-last", "p-last", "x43"], climb=Action.REBOOT_NODE))


def test_a_pin_that_started_when_the_reset_succeeded_is_the_same_wedge():
    inc = Incident(id="i", classification="GPU_WEDGED", opened_at=0.0, remedy=RESET, reset_ok_at=1000.0)
    got = pinned_verdicts(pinned(xids=[x43(1100.0)], incident=inc), P)
    assert got == [phantom(), wedged(1100.0, 100, "Xid 43 at 00:18:20Z", ["x43"])]


@pytest.mark.parametrize("reboot_ok_at, last_unpinned, climb", [
    (999.0, 999.5, Action.REPLACE_NODE),  # seen healthy after the reboot: wedged again
    (999.0, 999.0, None),  # not seen healthy since: the same wedge
    (999.0, None, None),
    (1000.0, 1000.5, None),  # the pin started at the reboot's success: the same wedge
])
def test_a_wedge_after_the_reboot_climbs_to_replace_only_once_the_gpu_came_back(reboot_ok_at, last_unpinned, climb):
    inc = Incident(id="i", classification="GPU_WEDGED", opened_at=0.0, remedy=REBOOT, reboot_ok_at=reboot_ok_at)
    got = pinned_verdicts(pinned(xids=[x43(1100.0)], incident=inc, last_unpinned_ts=last_unpinned), P)
    if climb is None:
        assert got == [phantom(), wedged(1100.0, 100, "Xid 43 at 00:18:20Z", ["x43"])]
    else:
        assert got[1] == (1100.0, Verdict(Classification.GPU_WEDGED, REBOOT,
                                          "GPU 3 wedged again after the node reboot",
                                          ["s-first", "s-last", "p-last", "x43"], climb=climb))


def test_after_a_reboot_not_yet_seen_a_wedge_after_the_earlier_reset_still_climbs_to_a_reboot():
    inc = Incident(id="i", classification="GPU_WEDGED", opened_at=0.0, remedy=RESET, reset_ok_at=990.0,
                   reboot_ok_at=995.0)
    ((_, v),) = pinned_verdicts(pinned(xids=[x43(1100.0)], incident=inc, last_unpinned_ts=994.0), P)[1:]
    assert (v.remedy, v.climb, v.summary) == (RESET, Action.REBOOT_NODE, "GPU 3 wedged again after the GPU reset")


def test_an_application_xid_then_the_pin_is_a_suspect_at_the_onset_and_hides_the_phantom_load():
    got = pinned_verdicts(pinned(xids=[x13(900.0)]), P)
    assert got == [suspect(1060.0, 60)]


def test_an_application_xid_during_the_pin_makes_the_suspect_at_its_time_after_the_phantom_load():
    assert pinned_verdicts(pinned(xids=[x13(1100.0)]), P) == [phantom(), suspect(1100.0, 100)]


@pytest.mark.parametrize("xid_ts, hides", [(1060.0, True), (1061.0, False)])
def test_an_application_xid_at_the_phantom_onset_hides_it_one_after_does_not(xid_ts, hides):
    got = pinned_verdicts(pinned(xids=[x13(xid_ts)]), P)
    assert [v.classification for _, v in got] == (
        [Classification.GPU_SUSPECT] if hides else [Classification.PHANTOM_LOAD, Classification.GPU_SUSPECT])


@pytest.mark.parametrize("xid_ts, is_suspect", [(1060.0 - 1800.0, True), (1060.0 - 1801.0, False)])
def test_the_application_lookback_at_its_bound(xid_ts, is_suspect):
    got = pinned_verdicts(pinned(xids=[x13(xid_ts)]), P)
    assert got == ([suspect(1060.0, 60)] if is_suspect else [phantom()])


def test_the_application_lookback_is_the_policys():
    p = policy(app_xid_lookback_s=100.0)
    assert pinned_verdicts(pinned(xids=[x13(960.0)]), p) == [suspect(1060.0, 60)]
    assert pinned_verdicts(pinned(xids=[x13(959.0)]), p) == [phantom()]


def test_the_first_application_xid_names_the_suspect_when_two_hold_at_once():
    got = pinned_verdicts(pinned(xids=[x13(950.0, "second"), x13(900.0, "first")]), P)
    assert got == [suspect(1060.0, 60, "first")]


def test_the_earliest_suspect_wins_whatever_order_the_xids_are_listed_in():
    got = pinned_verdicts(pinned(xids=[x13(1200.0, "later"), x13(1100.0, "earlier")]), P)
    assert got == [phantom(), suspect(1100.0, 100, "earlier")]


def test_xid_45_and_backfilled_application_xids_are_not_application_evidence():
    xids = [{**x13(900.0), "xid": XID45, "id": "x45"}, x13(900.0, "old", backfilled=True),
            {**x13(900.0, "not-app"), "app": False}]
    assert pinned_verdicts(pinned(xids=xids), P) == [phantom()]


def test_wedge_evidence_in_the_lookback_leaves_the_application_xid_to_the_wedge_rule():
    got = pinned_verdicts(pinned(xids=[x13(900.0), x43(950.0)]), P)
    assert [(t, v.classification) for t, v in got] == [(1060.0, Classification.GPU_WEDGED)]
    # ... and waits for its workload failure, never a suspect instead
    assert pinned_verdicts(pinned(xids=[x13(900.0), x43(950.0)]), policy(wedged_requires_workload_failure=True)) == []


def test_wedge_evidence_after_the_suspect_held_does_not_take_it_back():
    got = pinned_verdicts(pinned(xids=[x13(1100.0), x43(1200.0)]), P)
    assert got == [phantom(), suspect(1100.0, 100), wedged(1200.0, 200, "Xid 43 at 00:20:00Z", ["x43"])]


def test_wedge_evidence_older_than_its_lookback_does_not_keep_the_application_xid_from_a_suspect():
    p = policy(wedged_xid43_lookback_s=100.0)
    got = pinned_verdicts(pinned(xids=[recovery_failure(900.0), x13(950.0)]), p)
    assert got == [suspect(1060.0, 60)]
    got = pinned_verdicts(pinned(xids=[recovery_failure(960.0), x13(950.0)]), p)
    assert [(t, v.classification) for t, v in got] == [(1060.0, Classification.GPU_WEDGED)]


def test_a_compute_snapshot_moves_the_start_of_the_pin():
    runs = [[NO_PROCESS, 1000.0, 1010.0], [COMPUTE, 1020.0, 1030.0], [NO_PROCESS, 1040.0, 2000.0]]
    ((t, v),) = pinned_verdicts(pinned(runs=runs), P)
    assert t == 1090.0 and v.summary == f"{base(60)} and no application or wedge Xid: phantom load"
    assert v.entry["summary"] == "pinned 60 s without compute"


# -- the application fault -------------------------------------------------------------------------
def occ(ts, wl, id="o", codes=(13,), pid=7, **kw):
    return {"ts": ts, "last_ts": ts, "pid": pid, "wl": wl, "codes": list(codes), "pod": None, "id": id, **kw}


def gpu(occurrences=(), procs_ts=None, clock=None, uuid=UUID, pods=None):
    return GpuState(key=UUID, node="n1", gpu_uuid=uuid, gpu_index=3, procs_ts=procs_ts, clock=clock,
                    occurrences=[dict(o) for o in occurrences], pods=pods or {})


@pytest.mark.parametrize("repeats, again", [
    (0, ""), (1, ""), (2, " (2 occurrences of this workload in the window)"),
    (3, " (3 occurrences of this workload in the window)"),
])
def test_an_application_fault_counts_the_workloads_repeats_in_its_evidence(repeats, again):
    others = [occ(50.0, "pod:b", "b"), occ(60.0, None, "n")] + [occ(100.0 + i, "pod:a", f"o{i}") for i in range(repeats)]
    state = gpu(others)
    new = state.occurrences[-1] if repeats else occ(200.0, "pod:a", "new")
    xentry = entry(200.0, "xid", "line", xid=13)
    v = app_occurrence_verdict(state, new, 13, "pid 7 (python3)", xentry)
    assert v == Verdict(Classification.APP_FAULT, RECORD,
                        f"{X13} from pid 7 (python3) on GPU 3 on n1: application fault (NVIDIA: restart the "
                        f"application), recorded{again}", [new["id"]], entry=xentry)
    assert xentry["data"] == {"xid": 13, "workload_occurrences": max(repeats, 1)}


def test_faults_of_no_known_workload_are_not_each_others_repeats():
    state = gpu([occ(100.0, None, "a"), occ(110.0, None, "b")])
    xentry = entry(110.0, "xid", "line")
    v = app_occurrence_verdict(state, state.occurrences[1], 43, "an unknown process", xentry)
    assert v.summary == ("Xid 43 (ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR; NVIDIA: IGNORE) from an unknown process "
                         "on GPU 3 on n1: NVIDIA: no action needed, recorded")
    assert xentry["data"]["workload_occurrences"] == 1


def test_the_workload_label():
    state = gpu(pods={"7": "pod-7"})
    assert workload_label(state, None, "python3") == "an unknown process"
    assert workload_label(state, 7, "python3") == "pid 7 (python3) of pod pod-7"
    assert workload_label(state, 8, "python3") == "pid 8 (python3)"
    assert workload_label(state, 8, None) == "pid 8 (None)"


# -- the suspect rule ------------------------------------------------------------------------------
SETTLED = {"procs_ts": 10_000.0, "clock": 10_000.0}


def test_two_workloads_make_a_suspect_with_their_names():
    state = gpu([occ(100.0, "pod:uid-b", "o1"), occ(150.0, "pid:4242", "o2")], **SETTLED)
    assert suspect_verdict(state, 150.0, P) == Verdict(
        Classification.GPU_SUSPECT, QUARANTINE,
        "GPU 3 (GPU-x) on n1: 2 different processes or pods (4242, pod:uid-b) faulted it within 10 min: "
        "stop scheduling onto it", ["o1", "o2"])


@pytest.mark.parametrize("first_ts, counts", [(100.0, True), (99.0, False)])
def test_the_suspect_window_at_its_bound(first_ts, counts):
    state = gpu([occ(first_ts, "pod:a", "o1"), occ(700.0, "pod:b", "o2")], **SETTLED)
    v = suspect_verdict(state, 700.0, P)
    assert (v is not None) is counts
    assert earliest_suspect(state, P) == ((700.0, v) if counts else None)


def test_an_occurrence_after_the_time_asked_about_does_not_count():
    state = gpu([occ(100.0, "pod:a", "o1"), occ(101.0, "pod:b", "o2")], **SETTLED)
    assert suspect_verdict(state, 100.0, P) is None
    assert earliest_suspect(state, P)[0] == 101.0


def test_one_workload_repeating_is_no_suspect_and_unidentified_faults_count_each():
    repeats = [occ(100.0 + i, "pod:a", f"o{i}") for i in range(5)]
    assert suspect_verdict(gpu(repeats, **SETTLED), 104.0, P) is None
    assert earliest_suspect(gpu(repeats, **SETTLED), P) is None
    mixed = [occ(100.0, "pod:a", "o1"), occ(101.0, None, "n1"), occ(102.0, None, "n2")]
    v = suspect_verdict(gpu(mixed, **SETTLED), 102.0, P)
    assert v.summary == ("GPU 3 (GPU-x) on n1: 3 application-class Xid occurrences within 10 min: "
                         "stop scheduling onto it") and v.evidence_ids == ["o1", "n1", "n2"]
    assert suspect_verdict(gpu(mixed[:2], **SETTLED), 101.0, P) is None
    assert earliest_suspect(gpu(mixed, **SETTLED), P) == (102.0, v)


def test_the_thresholds_are_the_policys():
    three = [occ(100.0, "pod:a", "o1"), occ(101.0, "pod:b", "o2"), occ(102.0, "pod:c", "o3")]
    p = policy(suspect_distinct_pids=3, suspect_occurrences=4)
    assert suspect_verdict(gpu(three[:2], **SETTLED), 101.0, p) is None
    assert earliest_suspect(gpu(three[:2], **SETTLED), p) is None
    assert suspect_verdict(gpu(three, **SETTLED), 102.0, p).summary.startswith("GPU 3 (GPU-x) on n1: 3 different")
    assert earliest_suspect(gpu(three, **SETTLED), p)[0] == 102.0
    unknown = [occ(100.0 + i, None, f"n{i}") for i in range(4)]
    p = policy(suspect_occurrences=4)
    assert suspect_verdict(gpu(unknown[:3], **SETTLED), 102.0, p) is None
    assert earliest_suspect(gpu(unknown[:3], **SETTLED), p) is None
    assert earliest_suspect(gpu(unknown, **SETTLED), p)[0] == 103.0


def test_the_window_named_in_the_text_is_the_policys_in_minutes():
    state = gpu([occ(100.0, "pod:a", "o1"), occ(150.0, "pod:b", "o2")], **SETTLED)
    assert "within 59 min" in suspect_verdict(state, 150.0, policy(suspect_window_s=3540.0)).summary
    assert "within 60 min" in suspect_verdict(state, 150.0, policy(suspect_window_s=3600.0)).summary


def test_xid_45_alone_never_counts_but_an_occurrence_with_another_code_does():
    only45 = [occ(100.0, "pod:a", "o1", codes=(XID45,)), occ(101.0, "pod:b", "o2", codes=(XID45,)),
              occ(102.0, None, "o3", codes=(XID45,))]
    assert suspect_verdict(gpu(only45, **SETTLED), 102.0, P) is None
    assert earliest_suspect(gpu(only45, **SETTLED), P) is None
    mixed = [occ(100.0, "pod:a", "o1", codes=(XID45, 13)), occ(101.0, "pod:b", "o2", codes=(XID45,)),
             occ(102.0, "pod:c", "o3", codes=(13,))]
    v = suspect_verdict(gpu(mixed, **SETTLED), 102.0, P)
    assert v.evidence_ids == ["o1", "o3"] and "(pod:a, pod:c)" in v.summary
    assert earliest_suspect(gpu(mixed, **SETTLED), P) == (102.0, v)


def test_a_workload_counts_once_it_is_settled():
    occs = [occ(100.0, "pid:1", "o1"), occ(101.0, "pid:2", "o2")]
    # the process lists were read through 101 s, but a PID-only fault waits 90 s for a death that names its pod
    assert suspect_verdict(gpu(occs, procs_ts=101.0, clock=190.0), 101.0, P) is None
    assert earliest_suspect(gpu(occs, procs_ts=101.0, clock=190.0), P) is None
    assert earliest_suspect(gpu(occs, procs_ts=101.0, clock=191.0), P)[0] == 101.0
    pods = [occ(100.0, "pod:a", "o1"), occ(101.0, "pod:b", "o2")]
    assert earliest_suspect(gpu(pods, procs_ts=100.0, clock=500.0), P) is None  # o2's list not read yet
    assert earliest_suspect(gpu(pods, procs_ts=101.0, clock=101.0), P)[0] == 101.0
    # an unsettled workload is not listed, but its occurrence is evidence
    v = suspect_verdict(gpu([*pods, occ(102.0, "pod:c", "o3")], procs_ts=101.0, clock=101.0), 102.0, P)
    assert "2 different processes or pods (pod:a, pod:b)" in v.summary and v.evidence_ids == ["o1", "o2", "o3"]


def test_the_one_pass_rule_forgets_what_left_the_window():
    # A at 0 leaves the window at 601, but A again at 500 keeps A in it; B at 601 makes two.
    occs = [occ(0.0, "pod:a", "a0"), occ(500.0, "pod:a", "a1"), occ(601.0, "pod:b", "b")]
    found = earliest_suspect(gpu(occs, **SETTLED), P)
    assert found[0] == 601.0 and found[1].evidence_ids == ["a1", "b"]
    # ... and without the repeat, A is gone by then
    assert earliest_suspect(gpu([occs[0], occs[2]], **SETTLED), P) is None


def test_the_one_pass_rule_forgets_unidentified_faults_that_left_the_window():
    occs = [occ(0.0, None, "n0"), occ(100.0, None, "n1"), occ(650.0, None, "n2"), occ(660.0, None, "n3")]
    found = earliest_suspect(gpu(occs, **SETTLED), P)
    assert found[0] == 660.0 and found[1].evidence_ids == ["n1", "n2", "n3"]


def test_the_one_pass_rule_forgets_a_workload_only_when_its_last_occurrence_left():
    occs = [occ(0.0, "pod:a", "a0"), occ(10.0, "pod:a", "a1"), occ(20.0, "pod:b", "b0"), occ(605.0, "pod:c", "c")]
    # at 605 a0 has left; a1 (595 s before) and b0 are in: three workloads
    found = earliest_suspect(gpu(occs, **SETTLED), policy(suspect_distinct_pids=3))
    assert found[0] == 605.0
    occs[1]["ts"] = occs[1]["last_ts"] = 4.0  # a1 601 s before: gone with a0
    assert earliest_suspect(gpu(occs, **SETTLED), policy(suspect_distinct_pids=3)) is None


def test_the_one_pass_rule_counts_every_occurrence_of_one_instant():
    occs = [occ(100.0, "pod:a", "a"), occ(100.0, "pod:b", "b")]
    assert earliest_suspect(gpu(occs, **SETTLED), P)[0] == 100.0
    occs = [occ(100.0, None, "n0"), occ(200.0, None, "n1"), occ(200.0, None, "n2")]
    assert earliest_suspect(gpu(occs, **SETTLED), P)[0] == 200.0


def test_the_one_pass_rule_takes_occurrences_by_time_not_by_list_order():
    occs = [occ(700.0, "pod:b", "b"), occ(100.0, "pod:a", "a"), occ(650.0, "pod:c", "c")]
    found = earliest_suspect(gpu(occs, **SETTLED), P)
    assert found[0] == 650.0 and found[1].evidence_ids == ["a", "c"]


def test_an_unsettled_workload_leaving_the_window_was_never_counted():
    # no process list read yet: pod:a waits for one; b and c come from a GPU without them (nolists)
    occs = [occ(0.0, "pod:a", "a0"), occ(700.0, "pod:b", "b", nolists=True), occ(701.0, "pod:c", "c", nolists=True)]
    found = earliest_suspect(gpu(occs, clock=800.0), P)
    assert found[0] == 701.0 and found[1].evidence_ids == ["b", "c"]


def test_a_gpu_without_a_uuid_waits_for_no_process_list():
    occs = [occ(100.0, "pid:1", "o1"), occ(101.0, "pid:2", "o2")]
    assert earliest_suspect(gpu(occs, uuid=None), P)[0] == 101.0


# -- hardware and NVML verdicts --------------------------------------------------------------------
def test_a_hardware_xid_by_nvidias_resolution():
    state = gpu()
    xentry = entry(5.0, "xid", "line")
    v = hardware_xid_verdict(state, 79, "fell off", "0000:02:00", "e79", xentry)
    assert v == Verdict(Classification.GPU_HARDWARE_FAULT, REBOOT,
                        "Xid 79 (ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS; NVIDIA: RESTART_BM) on GPU 3 (GPU-x) on n1: "
                        "NVIDIA catalog: Xid 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS -> RESTART_BM", ["e79"],
                        hardware=True, recommendation=None, entry=xentry)


def test_a_contact_support_xid_quarantines_and_asks_for_a_case_and_names_the_pci_without_a_uuid():
    v = hardware_xid_verdict(gpu(uuid=None), 1, "m", "0000:02:00", "e1", {})
    assert (v.remedy, v.recommendation, v.hardware) == (
        QUARANTINE, "Open an NVIDIA support case with this evidence (nvidia-bug-report.sh)", True)
    assert v.summary.startswith("Xid 1 (ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD; NVIDIA: CONTACT_SUPPORT) on GPU 3 "
                                "(0000:02:00) on n1: ")
    assert hardware_xid_verdict(gpu(), 46, "m", None, "e46", {}).recommendation is None


def test_a_record_only_xid_is_no_hardware_verdict():
    assert hardware_xid_verdict(gpu(), 63, "m", None, "e63", {}) is None


@pytest.mark.parametrize("action, remedy, name", [
    (1, RESET, "gpu_reset"), (2, REBOOT, "node_reboot"), (3, QUARANTINE, "drain_p2p"), (99, QUARANTINE, "0x63"),
])
def test_nvmls_recovery_action(action, remedy, name):
    what = f"NVML reports the GPU recovery action {action} ({name})"
    assert recovery_action_verdict(gpu(), action, "s1", 5.0) == Verdict(
        Classification.GPU_HARDWARE_FAULT, remedy, f"GPU 3 on n1: {what}", ["s1"], hardware=True,
        entry=entry(5.0, "sample", what, recovery_action=action))


def test_recovery_action_none_is_no_verdict():
    assert recovery_action_verdict(gpu(), 0, "s1", 5.0) is None


def test_a_row_remap_failure():
    what = "row remapping failed (nvmlDeviceGetRemappedRows: failure)"
    assert remap_failure_verdict(gpu(), "s1", 5.0) == Verdict(
        Classification.GPU_HARDWARE_FAULT, RESET, f"GPU 3 on n1: {what}", ["s1"], hardware=True,
        recommendation="If the remap failure persists after the reset, open an NVIDIA RMA case with this evidence",
        entry=entry(5.0, "sample", what, remapped_rows_failure=True))


# -- the tables ------------------------------------------------------------------------------------
def test_verdicts_rank_by_severity_and_hardware_ranks_with_the_wedge():
    C = Classification
    assert RANK[C.APP_FAULT] < RANK[C.PHANTOM_LOAD] < RANK[C.GPU_SUSPECT] < RANK[C.GPU_WEDGED]
    assert RANK[C.GPU_WEDGED] == RANK[C.GPU_HARDWARE_FAULT] and RANK[C.APP_FAULT] >= 1
    # the fold's verdicts of one GPU: a storm and a claim conflict are findings of the fleet agent and the identity check
    assert set(RANK) == set(C) - {C.FLEET_STORM, C.GPU_CLAIM_CONFLICT}


def test_each_remedy_has_its_plan():
    assert PLANS == {
        RECORD: [Action.RECORD],
        QUARANTINE: [Action.QUARANTINE_GPU],
        RESET: [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU],
        REBOOT: [Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE],
    }


# -- found by mutation testing -------------------------------------------------------------
def test_the_one_pass_rule_reads_the_rules_words_only_once_it_holds(monkeypatch):
    """The sliding window counts exactly what suspect_verdict would: it asks for the verdict's words
    once, at the occurrence where the rule holds, never at one where it does not (that was the
    quadratic cost the one pass removed)."""
    import xidstream.streams.verdict as verdict

    calls = []
    real = verdict.suspect_verdict

    def counting(state, ts, policy):
        calls.append(ts)
        return real(state, ts, policy)

    monkeypatch.setattr(verdict, "suspect_verdict", counting)
    quiet = [
        [occ(0.0, None, "n0"), occ(10.0, None, "n1")],  # two unidentified: one short of three
        [occ(0.0, None, "n0"), occ(700.0, None, "n1"), occ(710.0, None, "n2")],  # n0 left before n2
        [occ(0.0, "pod:a", "a"), occ(700.0, "pod:b", "b")],  # a left before b came
        [occ(0.0, "pod:a", "a0"), occ(1.0, "pod:a", "a1"), occ(700.0, "pod:b", "b")],  # a's two left
        [occ(0.0, "pod:a", "a"), occ(700.0, "pod:b", "b"), occ(1400.0, "pod:c", "c")],  # each left in turn
    ]
    for occs in quiet:
        calls.clear()
        assert earliest_suspect(gpu(occs, **SETTLED), P) is None
        assert calls == [], occs
    calls.clear()
    occs = [occ(0.0, "pod:a", "a"), occ(700.0, "pod:b", "b"), occ(1400.0, "pod:c", "c"), occ(1401.0, "pod:d", "d")]
    assert earliest_suspect(gpu(occs, **SETTLED), P)[0] == 1401.0 and calls == [1401.0]


def test_an_application_xid_too_old_for_the_pin_does_not_hide_a_newer_one():
    got = pinned_verdicts(pinned(xids=[x13(1060.0 - 1801.0, "old"), x13(1100.0, "new")]), P)
    assert got == [phantom(), suspect(1100.0, 100, "new")]


def test_wedge_evidence_that_blocks_one_application_xid_does_not_block_a_later_one_past_its_lookback():
    p = policy(wedged_xid43_lookback_s=100.0)
    got = pinned_verdicts(pinned(xids=[recovery_failure(1000.0), x13(950.0, "blocked"), x13(1200.0, "later")]), p)
    assert [(t, v.classification, v.evidence_ids[-1]) for t, v in got] == [
        (1060.0, Classification.GPU_WEDGED, "rf"), (1200.0, Classification.GPU_SUSPECT, "later")]


# A compute process from 1300 to 1400 s restarts the pin's span: a piece of evidence read during it
# holds only at 1460 s, when the pin had 60 s without compute again.
GAP = [[NO_PROCESS, 1000.0, 1200.0], [COMPUTE, 1300.0, 1400.0], [NO_PROCESS, 1401.0, 2000.0]]


def test_an_application_xid_too_old_by_the_time_the_pin_held_again_is_skipped_for_a_newer_one():
    p = policy(app_xid_lookback_s=100.0)
    got = pinned_verdicts(pinned(runs=GAP, xids=[x13(1350.0, "old"), x13(1420.0, "new")]), p)
    assert [(t, v.classification, v.evidence_ids[-1]) for t, v in got] == [
        (1060.0, Classification.PHANTOM_LOAD, "p-last"), (1460.0, Classification.GPU_SUSPECT, "new")]
    got = pinned_verdicts(pinned(runs=GAP, xids=[x13(1320.0, "old"), x13(1350.0, "older")]), p)
    assert [(t, v.classification) for t, v in got] == [(1060.0, Classification.PHANTOM_LOAD)]


def test_wedge_evidence_too_old_by_the_time_the_pin_held_again_is_no_wedge():
    p = policy(wedged_xid43_lookback_s=100.0)
    got = pinned_verdicts(pinned(runs=GAP, xids=[recovery_failure(1350.0)]), p)
    assert [(t, v.classification) for t, v in got] == [(1060.0, Classification.PHANTOM_LOAD)]
    got = pinned_verdicts(pinned(runs=GAP, xids=[recovery_failure(1370.0)]), p)
    assert [(t, v.classification) for t, v in got] == [(1060.0, Classification.PHANTOM_LOAD),
                                                       (1460.0, Classification.GPU_WEDGED)]


def test_the_first_application_xid_that_holds_names_the_suspect_after_a_blocked_one():
    runs = [[NO_PROCESS, 1000.0, 1070.0], [COMPUTE, 1080.0, 1120.0], [NO_PROCESS, 1121.0, 2000.0]]
    p = policy(wedged_xid43_lookback_s=100.0)
    unblocked = pinned_verdicts(pinned(runs=runs, xids=[x13(1085.0, "c"), x13(1090.0, "b")]), p)
    assert [(t, v.evidence_ids[-1]) for t, v in unblocked] == [(1060.0, "p-last"), (1180.0, "c")]
    blocked = pinned_verdicts(pinned(runs=runs, xids=[recovery_failure(1000.0), x13(1050.0, "a"), x13(1085.0, "c"),
                                                      x13(1090.0, "b")]), p)
    assert [(t, v.evidence_ids[-1]) for t, v in blocked] == [(1060.0, "rf"), (1180.0, "c")]


def test_after_a_blocked_application_xid_the_next_one_that_holds_is_a_suspect_at_its_own_time():
    p = policy(wedged_xid43_lookback_s=100.0)
    # the block of wedge evidence at 1030 s ends at 1130 s; a later piece at 1500 s blocks only after it
    xids = [recovery_failure(1030.0, "rf1"), recovery_failure(1500.0, "rf2"), x13(1050.0, "a"), x13(1140.0, "c"),
            x13(1550.0, "z")]
    got = pinned_verdicts(pinned(xids=xids), p)
    assert [(t, v.classification, v.evidence_ids[-1]) for t, v in got] == [
        (1060.0, Classification.GPU_WEDGED, "rf1"), (1140.0, Classification.GPU_SUSPECT, "c")]
    # several blocked pieces up to the block's end, then one that holds once a compute run ended
    runs = [[NO_PROCESS, 1000.0, 1070.0], [COMPUTE, 1080.0, 1120.0], [NO_PROCESS, 1121.0, 2000.0]]
    xids = [recovery_failure(1000.0), x13(1050.0, "a"), x13(1085.0, "c"), x13(1090.0, "b")]
    got = pinned_verdicts(pinned(runs=runs, xids=xids), p)
    assert [(t, v.classification) for t, v in got] == [(1060.0, Classification.GPU_WEDGED),
                                                       (1180.0, Classification.GPU_SUSPECT)]
