"""`verdict.pinned_verdicts` skips evidence by bisection and stops at the first piece that holds
(a pinned GPU with 200 Xid 43 lines cost 7-15 ms a record when every piece was tried and every
window scanned). The answer must be the rule's: here it is checked against the rule read piece by
piece, on generated pinned GPUs (compute and no-process snapshots, unreadable lists, Xid 13/31/43,
recovery failures, workload failures, either policy on failures)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from xidstream.streams.evidence import COMPUTE, NO_PROCESS, UNKNOWN, GpuState, pin_onset
from xidstream.streams.policy import GUARD_MIN_PINNED_SPAN_S, Policy
from xidstream.streams.verdict import _is_app, _is_wedge, pinned_verdicts
from tests.tools import examples


def _window(items, t, w):
    return [x for x in items if 0 <= t - x["ts"] <= w]


def reference(state: GpuState, policy: Policy) -> list[tuple[float, str]]:
    """The rule read at every piece of evidence: (time, classification) of each pinned verdict."""
    needed = max(policy.pinned_seconds, GUARD_MIN_PINNED_SPAN_S)
    base = pin_onset(state, needed)
    if base is None:
        return []
    xids = sorted(state.xids, key=lambda x: x["ts"])
    wedges, apps = [x for x in xids if _is_wedge(x)], [x for x in xids if _is_app(x)]
    out = []
    best = None
    for x in wedges:
        floor = x["ts"]
        if policy.wedged_requires_workload_failure:
            later = [w["ts"] for w in state.workload_failures if w["ts"] >= x["ts"]]
            if not later:
                continue
            floor = max(floor, min(later))
        on = pin_onset(state, needed, floor)
        if on is not None and on[0] - x["ts"] <= policy.wedged_xid43_lookback_s and (best is None or on[0] < best):
            best = on[0]
    if best is not None:
        out.append((best, "GPU_WEDGED"))
    best = None
    for x in apps:
        on = pin_onset(state, needed, x["ts"])
        if on is None or on[0] - x["ts"] > policy.app_xid_lookback_s:
            continue
        if _window(wedges, on[0], policy.wedged_xid43_lookback_s):
            continue
        if best is None or on[0] < best:
            best = on[0]
    if best is not None:
        out.append((best, "GPU_SUSPECT"))
    t = base[0]
    if not _window(wedges, t, policy.wedged_xid43_lookback_s) and not _window(apps, t, policy.app_xid_lookback_s):
        out.append((t, "PHANTOM_LOAD"))
    return sorted(out)


_xid = st.tuples(st.floats(0, 3000, allow_nan=False).map(lambda t: round(t, 1)),
                 st.sampled_from([13, 31, 43, 43, 43, None]))
_run = st.tuples(st.sampled_from([COMPUTE, NO_PROCESS, NO_PROCESS, UNKNOWN]), st.floats(1, 400, allow_nan=False))


@settings(max_examples=examples(300), deadline=None)
@given(since=st.floats(0, 1500, allow_nan=False), length=st.floats(0, 2500, allow_nan=False),
       runs=st.lists(_run, max_size=8), xids=st.lists(_xid, max_size=40),
       failures=st.lists(st.floats(0, 3000, allow_nan=False), max_size=6), require=st.booleans(),
       lookback=st.sampled_from([60.0, 600.0, 1800.0]))
def test_the_one_pass_rule_equals_the_rule_read_at_every_piece(since, length, runs, xids, failures, require, lookback):
    policy = Policy(wedged_requires_workload_failure=require, wedged_xid43_lookback_s=lookback,
                    app_xid_lookback_s=1800.0 if lookback == 60.0 else lookback)
    t, proc_runs = 0.0, []
    for kind, span in runs:
        proc_runs.append([kind, t, t + span])
        t += span + 1
    state = GpuState(key="GPU-x", node="n", gpu_uuid="GPU-x", gpu_index=0, pinned_since=since,
                     pinned_last=since + length, pinned_samples=100, procs_ts=t or None, proc_runs=proc_runs,
                     xids=[{"ts": ts, "xid": code, "kind": "xid" if code else "recovery_failure", "pid": 1,
                            "app": code in (13, 31, 43), "id": f"x{i}"} for i, (ts, code) in enumerate(xids)],
                     workload_failures=[{"ts": f, "pod_uid": "p", "id": f"w{i}"} for i, f in enumerate(failures)])
    got = [(t, v.classification.value) for t, v in pinned_verdicts(state, policy)]
    assert got == reference(state, policy)
