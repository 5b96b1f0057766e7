"""xidstream.streams.incident exactly: the ladder, the step counter, the RECORD cap, results matched to
commands and the timeline's head-and-tail cap, each at its size and one past it."""

from __future__ import annotations

import pytest

from xidstream.schemas.vocab import Action
from xidstream.streams.incident import CLOSING, LADDER, RUNG, Incident


def incident(**kw) -> Incident:
    return Incident(id="inc-1", classification="GPU_WEDGED", opened_at=10.0, remedy="reset", **kw)


def emitted(inc: Incident) -> list[tuple[int, str]]:
    return [(e["step"], e["action"]) for e in inc.emitted]


def test_the_ladder_and_the_closing_steps():
    assert [a.value for a in LADDER] == ["RECORD", "QUARANTINE_GPU", "CORDON_NODE", "DRAIN_NODE", "RESET_GPU",
                                         "REBOOT_NODE", "REPLACE_NODE"]
    assert RUNG == {a.value: i for i, a in enumerate(LADDER)}
    assert CLOSING == {"UNCORDON_NODE", "RELEASE_GPU"}


def test_a_new_incident_is_at_the_bottom_and_may_take_any_rung():
    inc = incident()
    assert inc.top_rung() == 0 and inc.next_step() == 0
    assert all(inc.may_emit(a) for a in (*LADDER, Action.UNCORDON_NODE, Action.RELEASE_GPU))
    assert not inc.has_emitted(Action.RECORD)


def test_a_ladder_only_climbs():
    inc = incident()
    assert inc.emit(Action.RECORD, "c0", 11.0) == 0
    assert inc.top_rung() == 0 and inc.may_emit(Action.QUARANTINE_GPU)
    assert inc.emit(Action.CORDON_NODE, "c1", 12.0) == 1
    assert inc.top_rung() == 2
    assert not inc.may_emit(Action.CORDON_NODE) and not inc.may_emit(Action.QUARANTINE_GPU)
    assert inc.may_emit(Action.DRAIN_NODE) and inc.may_emit(Action.REPLACE_NODE) and inc.may_emit(Action.RECORD)
    inc.emit(Action.REBOOT_NODE, "c2", 13.0)
    assert inc.top_rung() == 5 and not inc.may_emit(Action.RESET_GPU) and inc.may_emit(Action.REPLACE_NODE)
    inc.emit(Action.RECORD, "c3", 14.0)  # RECORD is always allowed and never lowers the top
    assert inc.top_rung() == 5 and inc.may_emit(Action.RECORD)
    assert inc.has_emitted(Action.REBOOT_NODE) and not inc.has_emitted(Action.RESET_GPU)


def test_closing_steps_come_once_each_and_are_no_rung():
    inc = incident()
    inc.emit(Action.REPLACE_NODE, "c0", 11.0)
    assert inc.may_emit(Action.UNCORDON_NODE) and inc.may_emit(Action.RELEASE_GPU)
    inc.emit(Action.UNCORDON_NODE, "c1", 12.0)
    assert not inc.may_emit(Action.UNCORDON_NODE) and inc.may_emit(Action.RELEASE_GPU)
    assert inc.top_rung() == 6
    closing_only = incident()
    closing_only.emit(Action.RELEASE_GPU, "c0", 11.0)
    assert closing_only.top_rung() == 0 and closing_only.may_emit(Action.QUARANTINE_GPU)


def test_a_rung_already_emitted_is_refused_even_at_the_top():
    # a row edited by hand, or an older one, may hold a rung without a higher one
    inc = incident(emitted=[{"step": 0, "action": "QUARANTINE_GPU", "command_id": "c", "ts": 1.0, "outcome": None}])
    assert not inc.may_emit(Action.QUARANTINE_GPU) and inc.may_emit(Action.CORDON_NODE)


def test_an_emitted_command_is_recorded_whole():
    inc = incident()
    assert inc.emit(Action.QUARANTINE_GPU, "cmd-a", 12.5) == 0
    assert inc.emitted == [{"step": 0, "action": "QUARANTINE_GPU", "command_id": "cmd-a", "ts": 12.5, "outcome": None}]
    assert inc.steps == 1 and inc.next_step() == 1


def test_records_are_capped_at_16_and_steps_keep_counting():
    inc = incident()
    inc.emit(Action.QUARANTINE_GPU, "q", 1.0)
    for i in range(16):
        inc.emit(Action.RECORD, f"r{i}", 2.0 + i)
    assert len(inc.emitted) == 17 and inc.next_step() == 17
    assert inc.emit(Action.RECORD, "r16", 20.0) == 17
    assert len(inc.emitted) == 17 and inc.steps == 18
    assert emitted(inc)[:2] == [(0, "QUARANTINE_GPU"), (2, "RECORD")]  # the oldest RECORD went, never a rung
    assert inc.emitted[-1]["command_id"] == "r16"
    assert inc.emit(Action.CORDON_NODE, "c", 21.0) == 18 and len(inc.emitted) == 18
    assert inc.emit(Action.RECORD, "r17", 22.0) == 19
    assert [e["step"] for e in inc.emitted if e["action"] == "RECORD"] == [*range(3, 18), 19]
    records = [e["command_id"] for e in inc.emitted if e["action"] == "RECORD"]
    assert len(records) == 16 and records[0] == "r2" and records[-1] == "r17"
    assert inc.has_emitted(Action.QUARANTINE_GPU) and inc.has_emitted(Action.CORDON_NODE)


def test_a_row_written_before_the_step_counter_numbers_on_from_its_list():
    old = [{"step": i, "action": "RECORD", "command_id": f"r{i}", "ts": 1.0, "outcome": None} for i in range(3)]
    inc = incident(emitted=old)
    assert inc.steps == 0 and inc.next_step() == 3
    assert inc.emit(Action.RECORD, "r3", 2.0) == 3 and inc.steps == 4
    counted = incident(emitted=list(old), steps=40)
    assert counted.next_step() == 40


def test_a_result_answers_only_a_command_of_this_incident_with_its_action():
    inc = incident()
    inc.emit(Action.CORDON_NODE, "c1", 1.0)
    inc.emit(Action.DRAIN_NODE, "c2", 2.0)
    assert inc.answered("inc-1", "c2", Action.DRAIN_NODE) is inc.emitted[1]
    assert inc.answered("inc-1", "c1", Action.CORDON_NODE) is inc.emitted[0]
    assert inc.answered("inc-2", "c2", Action.DRAIN_NODE) is None
    assert inc.answered("inc-1", "c2", Action.CORDON_NODE) is None
    assert inc.answered("inc-1", "c3", Action.DRAIN_NODE) is None


@pytest.mark.parametrize("n, limit, kept", [
    (20, 20, list(range(20))),
    (21, 20, list(range(10)) + list(range(11, 21))),
    (25, 20, list(range(10)) + list(range(15, 25))),
    (12, 11, list(range(10)) + [11]),
])
def test_the_timeline_keeps_its_first_10_and_its_newest_lines(n, limit, kept):
    inc = incident()
    for i in range(n):
        inc.note({"i": i}, limit)
    assert [e["i"] for e in inc.timeline] == kept
    assert inc.noted == n  # counted past the limit: the row is written again (streams.classify._material)


def test_an_incident_reads_back_from_its_row():
    inc = incident(plan=["CORDON_NODE"], alerts=2, last_alert_at=5.0, hardware=True, remediated=True,
                   reset_ok_at=6.0, reboot_ok_at=7.0, recommendation="r", sample_stats={"samples": 2}, steps=3,
                   repair={"detection": 1.0, "cordon": 2.0}, rule={"id": "wedged.again_after_reset", "name": "n",
                                                                     "facts": {"xid43": 1}})
    inc.note({"i": 0}, 20)
    row = inc.to_dict()
    assert set(row) == {"id", "classification", "opened_at", "remedy", "plan", "emitted", "timeline", "alerts",
                        "last_alert_at", "hardware", "remediated", "reset_ok_at", "reboot_ok_at", "recommendation",
                        "sample_stats", "steps", "noted", "repair", "rule"}
    assert row["noted"] == 1
    assert Incident.from_dict({**row, "unknown": 1}) == inc


def test_a_new_incident_starts_empty_and_keeps_every_field_it_is_given():
    inc = incident()
    assert inc.to_dict() == {"id": "inc-1", "classification": "GPU_WEDGED", "opened_at": 10.0, "remedy": "reset",
                             "plan": [], "emitted": [], "timeline": [], "alerts": 0, "last_alert_at": None,
                             "hardware": False, "remediated": False, "reset_ok_at": None, "reboot_ok_at": None,
                             "recommendation": None, "sample_stats": None, "steps": 0, "noted": 0, "repair": None,
                             "rule": None}
    full = {"id": "i", "classification": "GPU_SUSPECT", "opened_at": 1.5, "remedy": "r", "plan": ["CORDON_NODE"],
            "emitted": [{"step": 0}], "timeline": [{"kind": "note"}], "alerts": 3, "last_alert_at": 2.5,
            "hardware": True, "remediated": True, "reset_ok_at": 3.5, "reboot_ok_at": 4.5, "recommendation": "x",
            "sample_stats": {"util_min": 1.0}, "steps": 7, "noted": 9, "repair": {"detection": 1.0},
            "rule": {"id": "suspect.distinct_workloads", "name": "n", "facts": {"workloads": 2}}}
    assert Incident(**full).to_dict() == full == Incident.from_dict(full).to_dict()
    assert Incident(**full) != incident() and Incident(**full) == Incident(**full)
    assert (Incident(**full) == "not an incident") is False


def test_the_repr_names_every_field():
    assert repr(incident()) == ("Incident(id='inc-1', classification='GPU_WEDGED', opened_at=10.0, remedy='reset', "
                                "plan=[], emitted=[], timeline=[], alerts=0, last_alert_at=None, hardware=False, "
                                "remediated=False, reset_ok_at=None, reboot_ok_at=None, recommendation=None, "
                                "sample_stats=None, steps=0, noted=0, repair=None, rule=None)")
