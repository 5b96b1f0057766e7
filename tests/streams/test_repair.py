"""Time to repair, per stage (streams.repair), as the processor folds it: each step an executor
reports is a timeline line of the incident, each stage that ends is a "repair_stage" output the
worker's histograms count (streams.metrics), and a reboot that is never answered is counted on
/metrics once `reboot_confirm_s` has passed (streams.app.unconfirmed_reboots)."""

from __future__ import annotations

import orjson

from xidstream.schemas import Action, RemediationResult
from xidstream.schemas.models import ResultStep
from xidstream.streams.app import unconfirmed_reboots
from xidstream.streams.engine import Engine
from xidstream.streams.metrics import LabelledCounts, metrics_text
from xidstream.streams.repair import answer_milestones, durations, reached
from tests.streams.builders import GPU, at, feed, procs, sample, wedge

RESET_STEPS = [("cordoned_drained", 255), ("holders_classified", 256), ("operands_paused", 258),
               ("operands_gone", 270), ("persistence_off", 271), ("reset", 280), ("verified", 290),
               ("persistence_restored", 295), ("operands_restored", 305)]


def _wedged() -> Engine:
    return feed(Engine(), sorted(wedge(), key=lambda r: r.ts))


def _newest(e: Engine, action: Action):
    return next(c for c in reversed(e.commands) if c.action == action)


def _answer(cmd, outcome: str, t: float, steps=(), detail: str = "") -> RemediationResult:
    return RemediationResult(ts=at(t), node=cmd.node, gpu_uuid=cmd.gpu_uuid, pci_bus_id=cmd.pci_bus_id,
                             command_id=cmd.command_id, incident_id=cmd.incident_id, action=cmd.action,
                             outcome=outcome, detail=detail,
                             steps=[ResultStep(step=n, at=at(t_), ok=ok, detail=d) for n, t_, ok, d in steps])


def _ok(steps):
    return [(n, t, True, "") for n, t in steps]


def _repaired() -> tuple[Engine, float]:
    e = _wedged()
    detected = _newest(e, Action.RESET_GPU).ts
    e.process(_answer(_newest(e, Action.CORDON_NODE), "succeeded", 190))
    e.process(_answer(_newest(e, Action.DRAIN_NODE), "succeeded", 250))
    e.process(_answer(_newest(e, Action.RESET_GPU), "succeeded", 310, _ok(RESET_STEPS)))
    return e, (detected - at(0)).total_seconds()


def test_each_step_of_a_reset_is_a_timeline_line_at_its_own_time():
    e = _wedged()
    reset = _newest(e, Action.RESET_GPU)
    e.process(_answer(reset, "failed", 310, [("operands_gone", 270, True, "4 operand pods gone"),
                                             ("persistence_off", 271, True, ""),
                                             ("reset", 280, False, "nvidia-smi --gpu-reset answered 15"),
                                             ("operands_restored", 300, True, "")], detail="reset failed"))
    tl = e.states[GPU].incident.timeline
    lines = [line for line in tl if "step" in line["data"]]
    assert lines == [
        {"ts": at(270).timestamp(), "kind": "remediation", "summary": "RESET_GPU step operands_gone: 4 operand pods gone",
         "data": {"command_id": reset.command_id, "action": "RESET_GPU", "step": "operands_gone", "ok": True,
                  "detail": "4 operand pods gone"}},
        {"ts": at(271).timestamp(), "kind": "remediation", "summary": "RESET_GPU step persistence_off",
         "data": {"command_id": reset.command_id, "action": "RESET_GPU", "step": "persistence_off", "ok": True,
                  "detail": ""}},
        {"ts": at(280).timestamp(), "kind": "remediation",
         "summary": "RESET_GPU step reset FAILED: nvidia-smi --gpu-reset answered 15",
         "data": {"command_id": reset.command_id, "action": "RESET_GPU", "step": "reset", "ok": False,
                  "detail": "nvidia-smi --gpu-reset answered 15"}},
        {"ts": at(300).timestamp(), "kind": "remediation", "summary": "RESET_GPU step operands_restored",
         "data": {"command_id": reset.command_id, "action": "RESET_GPU", "step": "operands_restored", "ok": True,
                  "detail": ""}},
    ]
    # the steps come before the answer that reports them, and the alert of the climb carries them
    assert tl.index(lines[-1]) < tl.index(next(x for x in tl if x["summary"] == "RESET_GPU failed: reset failed"))
    assert "RESET_GPU step reset FAILED: nvidia-smi --gpu-reset answered 15" in [
        x.summary for x in e.alerts[-1].evidence.timeline]


def test_every_stage_of_a_reset_is_timed_from_the_milestone_before_it():
    e, detected = _repaired()
    assert e.stages == [("cordon", 190 - detected), ("drained", 60.0), ("operands_paused", 20.0), ("reset", 10.0),
                        ("verified", 10.0), ("operands_back", 15.0)]
    assert e.states[GPU].incident.repair == {"detection": at(detected).timestamp(), "cordon": at(190).timestamp(),
                                             "drained": at(250).timestamp(), "operands_paused": at(270).timestamp(),
                                             "reset": at(280).timestamp(), "verified": at(290).timestamp(),
                                             "operands_back": at(305).timestamp()}


def test_the_uncordon_after_the_incident_resolved_ends_the_last_stage():
    e, _ = _repaired()
    for t in range(320, 1000, 10):
        e.process(sample(t, util=0, mem=0))
        e.process(procs(t))
    uncordon = _newest(e, Action.UNCORDON_NODE)
    assert e.states[GPU].incident is None  # resolved: the uncordon is a closing step
    e.process(_answer(uncordon, "succeeded", 1000))
    assert e.stages[-1] == ("uncordon", 1000.0 - 305)
    e.process(_answer(uncordon, "succeeded", 1010))  # a repeat ends nothing again
    assert [s for s, _ in e.stages].count("uncordon") == 1


def test_a_step_that_did_not_hold_is_no_milestone_and_a_later_stage_counts_from_the_one_before():
    e = _wedged()
    e.process(_answer(_newest(e, Action.DRAIN_NODE), "succeeded", 250))
    e.process(_answer(_newest(e, Action.RESET_GPU), "failed", 310, [("reset", 280, False, "exit 15"),
                                                                   ("operands_restored", 300, True, "")]))
    # no cordon answered, no operands paused, the reset failed: operands back counts from drained
    assert [s for s, _ in e.stages] == ["drained", "operands_back"] and e.stages[-1][1] == 50.0


def test_a_step_stamped_after_its_answer_is_taken_at_the_answer():
    e = _wedged()
    e.process(_answer(_newest(e, Action.DRAIN_NODE), "succeeded", 250))
    e.process(_answer(_newest(e, Action.RESET_GPU), "succeeded", 310, _ok([("reset", 280), ("verified", 9000)])))
    assert e.states[GPU].incident.repair["verified"] == at(310).timestamp()
    assert [line["ts"] for line in e.states[GPU].incident.timeline if line["data"].get("step") == "verified"] == \
        [at(310).timestamp()]


def test_the_milestones_of_an_answer():
    steps = [("operands_paused", 1.0, True), ("operands_gone", 2.0, True), ("reset", 3.0, False), ("reset", 4.0, True)]
    assert answer_milestones("RESET_GPU", "failed", 9.0, steps) == {"operands_paused": 2.0, "reset": 4.0}
    assert answer_milestones("RESET_GPU", "succeeded", 9.0, [("operands_paused", 1.0, True)]) == {"operands_paused": 1.0}
    assert answer_milestones("CORDON_NODE", "succeeded", 5.0) == {"cordon": 5.0}
    assert answer_milestones("DRAIN_NODE", "refused", 5.0) == {}
    assert answer_milestones("UNCORDON_NODE", "succeeded", 7.0) == {"uncordon": 7.0}
    assert answer_milestones("REBOOT_NODE", "succeeded", 7.0, [("rebooted", 6.0, True)]) == {}


def test_a_stage_that_ends_before_it_began_counts_zero_and_a_milestone_keeps_its_first_time():
    m = {"detection": 100.0}
    assert reached(m, {"cordon": 90.0}) == [("cordon", 0.0)]
    assert reached(m, {"cordon": 120.0, "drained": 130.0}) == [("drained", 40.0)]
    assert m == {"detection": 100.0, "cordon": 90.0, "drained": 130.0}
    assert durations(m) == [{"stage": "detection", "at": 100.0, "seconds": None, "since_detection": None},
                            {"stage": "cordon", "at": 90.0, "seconds": 0.0, "since_detection": 0.0},
                            {"stage": "drained", "at": 130.0, "seconds": 40.0, "since_detection": 30.0}]


def _samples(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


STATS = {"events": 0, "deadletters": 0, "alerts": 0, "commands": 0, "rows_written": 0, "outputs_refused": 0,
         "gpu_claims_refused": 0}


def test_the_stage_histograms_are_there_at_zero_and_count_each_stage_in_its_buckets():
    c = LabelledCounts()
    got = _samples(metrics_text(STATS, c))
    assert got['xidstream_processor_repair_stage_seconds_bucket{stage="reset",le="+Inf"}'] == 0
    assert got['xidstream_processor_repair_stage_seconds_count{stage="uncordon"}'] == 0
    assert got["xidstream_processor_reboots_unconfirmed"] == 0
    c.stage("drained", 45.0)
    c.stage("drained", 4000.0)
    c.stage("detection", 1.0)  # not a stage: nothing ends at detection
    c.unconfirmed = 2
    got = _samples(metrics_text(STATS, c))
    assert got['xidstream_processor_repair_stage_seconds_bucket{stage="drained",le="30"}'] == 0
    assert got['xidstream_processor_repair_stage_seconds_bucket{stage="drained",le="60"}'] == 1
    assert got['xidstream_processor_repair_stage_seconds_bucket{stage="drained",le="3600"}'] == 1
    assert got['xidstream_processor_repair_stage_seconds_bucket{stage="drained",le="7200"}'] == 2
    assert got['xidstream_processor_repair_stage_seconds_bucket{stage="drained",le="+Inf"}'] == 2
    assert got['xidstream_processor_repair_stage_seconds_sum{stage="drained"}'] == 4045.0
    assert got['xidstream_processor_repair_stage_seconds_count{stage="drained"}'] == 2
    assert got["xidstream_processor_reboots_unconfirmed"] == 2
    assert not any('stage="detection"' in k for k in got)


def _rebooting() -> Engine:
    e = _wedged()
    e.process(_answer(_newest(e, Action.RESET_GPU), "failed", 310, detail="in use by another client"))
    return e


def test_a_reboot_with_no_answer_past_the_bound_is_counted_from_the_cache_and_from_the_table():
    e = _rebooting()
    state = e.states[GPU]
    commanded = at(310).timestamp()
    row = orjson.dumps(state.to_dict())
    assert unconfirmed_reboots([], {GPU.encode(): state}, commanded + 5400, 5400) == 0  # at the bound: not yet
    assert unconfirmed_reboots([], {GPU.encode(): state}, commanded + 5401, 5400) == 1
    # a row no record touched since a restart (only in the table) counts too; the cache's is newer
    assert unconfirmed_reboots([(GPU.encode(), row)], {}, commanded + 5401, 5400) == 1
    assert unconfirmed_reboots([(GPU.encode(), row)], {GPU.encode(): state}, commanded + 5401, 5400) == 1
    assert unconfirmed_reboots([(b"other", None), (b"healthy", b'{"key": "x"}')], {}, commanded + 9999, 5400) == 0
    e.process(_answer(_newest(e, Action.REBOOT_NODE), "succeeded", 600))
    assert unconfirmed_reboots([], {GPU.encode(): e.states[GPU]}, commanded + 9999, 5400) == 0
