"""Work per record stays bounded by design (issue: right at fleet volume): the suspect rule is one
pass over the occurrences that can count, and Xid 45-only occurrences (a teardown prints one per
process) are capped. The fast rule is checked against the rule read at every occurrence (the
code on 1484261) on generated histories."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from streams.evidence import GpuState
from streams.policy import Policy
from streams.verdict import XID45, earliest_suspect, suspect_verdict
from tests.streams.builders import procs, run, sample, xid, inventory


def _reference(state, policy):
    """earliest_suspect as it was: the rule asked at every occurrence's time, in time order."""
    for o in sorted(state.occurrences, key=lambda o: o["ts"]):
        verdict = suspect_verdict(state, o["ts"], policy)
        if verdict is not None:
            return o["ts"], verdict
    return None


_occ = st.fixed_dictionaries({
    "ts": st.integers(0, 4000).map(float),
    "codes": st.lists(st.sampled_from([13, 31, 43, XID45]), min_size=1, max_size=3, unique=True),
    "wl": st.one_of(st.none(), st.sampled_from([f"pid:{p}" for p in range(1, 9)] + ["pod:a", "pod:b"])),
})


@settings(max_examples=300, deadline=None)
@given(st.lists(_occ, max_size=40), st.sampled_from([None, 500.0, 2000.0]),
       st.integers(2, 4), st.integers(2, 5), st.integers(60, 1800))
def test_the_one_pass_suspect_rule_equals_the_rule_read_at_every_occurrence(occs, procs_ts, distinct, count, window):
    policy = Policy(suspect_distinct_pids=distinct, suspect_occurrences=count, suspect_window_s=float(window))
    state = GpuState(key="GPU-x", node="n", gpu_uuid="GPU-x", gpu_index=0, procs_ts=procs_ts)
    state.occurrences = [{**o, "last_ts": o["ts"], "pid": None, "pod": None, "id": f"e{i}", "codes": list(o["codes"])}
                         for i, o in enumerate(occs)]
    fast, ref = earliest_suspect(state, policy), _reference(state, policy)
    assert (fast is None) == (ref is None)
    if fast is not None:
        assert fast[0] == ref[0]
        assert (fast[1].classification, fast[1].summary, fast[1].evidence_ids) == (
            ref[1].classification, ref[1].summary, ref[1].evidence_ids)


def test_a_teardown_of_2000_processes_keeps_64_occurrences_and_changes_no_verdict(monkeypatch):
    import streams.verdict as verdict
    from streams.evidence import _XID45_OCCURRENCES_KEPT

    recs = [inventory(0), sample(0), procs(0, *range(1000, 3000))]
    recs += [xid(10 + i * 0.01, 45, pid=1000 + i) for i in range(2000)]
    engine = run(recs)
    (state,) = engine.states.values()
    assert len(state.occurrences) <= _XID45_OCCURRENCES_KEPT + 1  # the cap, and the line just added
    assert all(c.action.value == "RECORD" for c in engine.commands)
    # The work per further line does not grow with the lines already seen: the suspect rule is
    # not re-read per occurrence kept (it was: 2,000 reads of a 2,000-long list per line).
    calls = []
    real = verdict.suspect_verdict
    monkeypatch.setattr(verdict, "suspect_verdict", lambda *a, **k: calls.append(1) or real(*a, **k))
    for i in range(200):
        engine.process(xid(40 + i * 0.01, 45, pid=5000 + i))
    assert len(state.occurrences) <= _XID45_OCCURRENCES_KEPT + 1
    assert len(calls) <= 200
