"""The journal's internals, entry by entry (found by `make mutate MODULES=executors/gate.py`: these
survived with the journal's file handling, its held/released bookkeeping or its membership changed).

Every file here is written by the test byte for byte, and read back byte for byte: what a restarted
executor finds on disk is the whole contract of the journal."""

from __future__ import annotations

import os

import orjson
import pytest

from xidstream.executors.gate import Journal, result_for
from xidstream.schemas.base import format_ts
from xidstream.schemas.vocab import Outcome
from tests.executors.helpers import keypair
from tests.executors.test_gate_trust import NOW
from tests.executors.test_gate import command

# An old, fixed modification time: a journal that was only read keeps it to the nanosecond.
OLD_NS = 1_600_000_000_123_456_789


def _line(entry: dict) -> bytes:
    return orjson.dumps(entry) + b"\n"


@pytest.fixture
def signed(tmp_path):
    key, _, _, _ = keypair(tmp_path, "proc")
    return lambda node="n1", action="CORDON_NODE": key.sign(command(node, action, now=NOW))


def _started(cmd) -> dict:
    stub = orjson.loads(result_for(cmd, Outcome.failed, "").model_dump_json(by_alias=True))
    return {"kind": "started", "command_id": cmd.command_id, "at": format_ts(NOW), "stub": stub}


def _done(cmd, detail="cordoned node n1") -> dict:
    return {"kind": "done", "command_id": cmd.command_id,
            "result": orjson.loads(result_for(cmd, Outcome.succeeded, detail).model_dump_json(by_alias=True))}


def _interrupted() -> str:
    return (f"interrupted: the executor stopped while carrying it out (started {format_ts(NOW)}); "
            f"outcome unknown, not run again")


def test_a_journal_in_a_state_dir_not_made_yet_makes_its_parents(tmp_path, signed):
    path = tmp_path / "state" / "executor" / "journal.jsonl"
    journal = Journal(path)
    cmd = signed()
    journal.started(cmd, NOW)
    assert path.read_bytes().count(b"\n") == 1
    assert Journal(path).answer(cmd.command_id).outcome == Outcome.failed


def test_a_blank_line_or_an_unreadable_line_mid_file_is_skipped_not_the_end_of_the_journal(tmp_path, signed):
    """An unreadable line inside the file (a torn entry an executor before the tail repair glued the
    next one onto) costs that line only: every entry after it still counts, or a command carried
    out after it would be run again."""
    a, b, c = signed(), signed(), signed()
    path = tmp_path / "journal.jsonl"
    glued = b'{"kind":"done","command_id":"' + a.command_id.encode() + b'","res' + orjson.dumps(_started(a))
    path.write_bytes(_line(_started(a)) + b"\n" + b"   \n" + _line(_started(b)) + glued + b"\n" + _line(_done(c)))
    journal = Journal(path)
    assert journal.answer(a.command_id).detail == _interrupted()
    assert journal.answer(b.command_id).detail == _interrupted()  # after the blank lines
    done = journal.answer(c.command_id)  # after the unreadable line
    assert (done.outcome, done.detail) == (Outcome.succeeded, "cordoned node n1")
    assert sorted(journal.ids()) == [c.command_id]


def test_membership_is_started_or_done_and_ids_are_the_done_ones(tmp_path, signed):
    started_only, both, done_only, unknown = signed(), signed(), signed(), signed()
    path = tmp_path / "journal.jsonl"
    path.write_bytes(_line(_started(started_only)) + _line(_started(both)) + _line(_done(both)) + _line(_done(done_only)))
    journal = Journal(path)
    assert started_only.command_id in journal
    assert both.command_id in journal
    assert done_only.command_id in journal
    assert unknown.command_id not in journal
    assert journal.ids() == [both.command_id, done_only.command_id]
    assert Journal(tmp_path / "empty.jsonl").ids() == []


def test_a_hold_is_written_once_and_a_release_ends_it_also_after_a_restart(tmp_path, signed):
    cmd = signed(action="DRAIN_NODE")
    raw = {"command_id": cmd.command_id, "anything": [1, 2]}
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.hold(cmd.command_id, raw)
    journal.hold(cmd.command_id, raw)  # held again (re-read after a restart): one entry
    held_line = _line({"kind": "held", "command_id": cmd.command_id, "command": raw})
    assert path.read_bytes() == held_line
    assert journal.held == {cmd.command_id: raw}
    assert Journal(path).held == {cmd.command_id: raw}

    journal.release("cmd-never-held")  # nothing to release: nothing written
    assert path.read_bytes() == held_line
    journal.release(cmd.command_id)
    assert journal.held == {}
    assert path.read_bytes() == held_line + b'{"kind":"released","command_id":"' + cmd.command_id.encode() + b'"}\n'
    assert Journal(path).held == {}  # the release is read back as one
    journal.release(cmd.command_id)  # released already: nothing more written
    assert path.read_bytes().count(b"\n") == 2


def test_a_result_ends_a_hold_also_after_a_restart(tmp_path, signed):
    cmd, other = signed(action="DRAIN_NODE"), signed(action="DRAIN_NODE")
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.hold(cmd.command_id, {"c": 1})
    journal.hold(other.command_id, {"c": 2})
    journal.done(result_for(cmd, Outcome.succeeded, "drained node n1"))
    assert journal.held == {other.command_id: {"c": 2}}
    assert Journal(path).held == {other.command_id: {"c": 2}}


def test_a_release_of_a_command_no_longer_held_is_read_not_raised_on(tmp_path, signed):
    """Two executors on one state dir (the old pod still stopping while the new one starts) both
    release what they held: the second entry releases nothing, and the journal still loads."""
    cmd = signed(action="DRAIN_NODE")
    path = tmp_path / "journal.jsonl"
    first = Journal(path)
    first.hold(cmd.command_id, {"c": 1})
    second = Journal(path)
    first.release(cmd.command_id)
    second.release(cmd.command_id)
    assert path.read_bytes().count(b'"kind":"released"') == 2
    again = Journal(path)
    assert again.held == {}


def test_a_complete_last_entry_without_its_newline_gets_it_and_counts(tmp_path, signed):
    a, b = signed(), signed()
    path = tmp_path / "journal.jsonl"
    whole = _line(_started(a)) + orjson.dumps(_started(b))  # the write stopped just before the newline
    path.write_bytes(whole)
    journal = Journal(path)
    assert path.read_bytes() == whole + b"\n"  # its newline added at the end, nothing else changed
    assert journal.answer(b.command_id).detail == _interrupted()
    journal.done(result_for(a, Outcome.succeeded, "cordoned node n1"))
    assert [orjson.loads(ln)["kind"] for ln in path.read_bytes().splitlines()] == ["started", "started", "done"]
    restarted = Journal(path)
    assert restarted.answer(b.command_id).detail == _interrupted()
    assert restarted.answer(a.command_id).outcome == Outcome.succeeded


def test_a_torn_last_entry_is_cut_back_to_the_last_newline_not_the_first(tmp_path, signed):
    a, b = signed(), signed()
    path = tmp_path / "journal.jsonl"
    kept = _line(_started(a)) + _line(_started(b))
    path.write_bytes(kept + _line(_done(a))[:40])
    journal = Journal(path)
    assert path.read_bytes() == kept
    assert journal.answer(a.command_id).detail == _interrupted()
    assert journal.answer(b.command_id).detail == _interrupted()


@pytest.mark.parametrize("content", [b"", b"one entry", b"two entries"])
def test_a_journal_that_needs_no_repair_is_only_read(tmp_path, signed, content):
    """Loading an intact journal (empty, or every line ended) writes nothing to it, not even a
    truncation to its own length: its bytes and its modification time stay."""
    path = tmp_path / "journal.jsonl"
    entries = {b"": b"", b"one entry": _line(_started(signed())),
               b"two entries": _line(_started(signed())) + _line(_started(signed()))}[content]
    path.write_bytes(entries)
    os.utime(path, ns=(OLD_NS, OLD_NS))
    Journal(path)
    assert path.read_bytes() == entries
    assert path.stat().st_mtime_ns == OLD_NS


def test_an_interrupted_command_is_answered_by_the_executor_that_started_it(tmp_path, signed):
    """The stub kept at "started" is the answer's: it names the node given to `started` (the
    executor's own), not the command's."""
    cmd = signed(node="n1", action="CORDON_NODE")
    path = tmp_path / "journal.jsonl"
    Journal(path).started(cmd, NOW, node="cluster-executor-0")
    answer = Journal(path).answer(cmd.command_id)
    assert (answer.node, answer.outcome, answer.detail) == ("cluster-executor-0", Outcome.failed, _interrupted())
    assert answer.command_id == cmd.command_id and answer.incident_id == cmd.incident_id
    default = signed(node="n2")
    Journal(path).started(default, NOW)
    assert Journal(path).answer(default.command_id).node == "n2"
