"""The gate (executors/gate.py) and the journal: pure, no server, no broker."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import orjson
import pytest

from xidstream.executors.gate import Approvals, Journal, decide, result_for
from xidstream.executors.runner import Executor
from xidstream.schemas.models import Approval, RemediationCommand
from xidstream.schemas.vocab import Outcome
from tests.executors import helpers
from tests.executors.helpers import keypair

# The one clock of these tests: every command, approval and decision is stamped from it, never
# from the machine's clock (a record stamped by the real clock and judged at a fixed time is
# expired, or from the future, depending on the day the tests run).
NOW = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


def command(node, action, *, now=NOW, **kw) -> RemediationCommand:
    return helpers.command(node, action, now=now, **kw)


def approval(key, cmd, *, ttl=600.0, now=NOW) -> Approval:
    return helpers.approval(key, cmd, ttl=ttl, now=now)


@pytest.fixture
def env(tmp_path):
    key, keys, _, _ = keypair(tmp_path)
    return key, keys, Journal(tmp_path / "journal.jsonl"), Approvals(keys)


def _decide(cmd, keys, journal, approvals, *, scope="cluster", node=None, now=NOW):
    return decide(cmd, keys=keys, now=now, scope=scope, node=node, journal=journal, approvals=approvals)


def test_a_signed_fresh_command_in_scope_proceeds(env):
    key, keys, journal, approvals = env
    assert _decide(key.sign(command("n1", "CORDON_NODE", now=NOW)), keys, journal, approvals).proceed


def test_unsigned_forged_and_unknown_key_are_refused_with_the_reason(env, tmp_path):
    key, keys, journal, approvals = env
    cmd = command("n1", "CORDON_NODE", now=NOW)
    d = _decide(cmd, keys, journal, approvals)
    assert not d.proceed and d.result.outcome == Outcome.refused and "unsigned" in d.result.detail
    forged = key.sign(cmd).model_copy(update={"node": "n2"})  # altered after signing
    d = _decide(forged, keys, journal, approvals)
    assert d.reason == "signature" and "forged or altered" in d.result.detail
    other, _, _, _ = keypair(tmp_path, "other")
    d = _decide(other.sign(cmd), keys, journal, approvals)
    assert "unknown key" in d.result.detail
    # the answer echoes the command's identity so the processor can match it
    assert (d.result.command_id, d.result.incident_id, d.result.gpu_uuid, d.result.pci_bus_id) == \
        (cmd.command_id, cmd.incident_id, cmd.gpu_uuid, cmd.pci_bus_id)


def test_expired_by_the_executor_clock(env):
    key, keys, journal, approvals = env
    cmd = key.sign(command("n1", "DRAIN_NODE", now=NOW, ttl=60))
    assert _decide(cmd, keys, journal, approvals, now=NOW + timedelta(seconds=59)).proceed
    d = _decide(cmd, keys, journal, approvals, now=NOW + timedelta(seconds=60))  # expires_at <= now
    assert d.result.outcome == Outcome.expired and "expired at" in d.result.detail


def test_node_executor_refuses_another_nodes_command_and_scopes_are_kept(env):
    key, keys, journal, approvals = env
    d = _decide(key.sign(command("n2", "RESET_GPU", now=NOW)), keys, journal, approvals, scope="node", node="n1")
    assert d.reason == "node" and "for node n2" in d.result.detail
    d = _decide(key.sign(command("n1", "RESET_GPU", now=NOW)), keys, journal, approvals)
    assert d.reason == "scope" and "cluster executor does not carry out RESET_GPU" in d.result.detail
    d = _decide(key.sign(command("n1", "CORDON_NODE", now=NOW)), keys, journal, approvals, scope="node", node="n1")
    assert d.reason == "scope"


def test_requires_approval_needs_an_authentic_unexpired_approval(env, tmp_path):
    key, keys, journal, approvals = env
    cmd = key.sign(command("n1", "DRAIN_NODE", requires_approval=True))  # valid until NOW + 10 min
    d = _decide(cmd, keys, journal, approvals)
    assert d.reason == "approval" and d.awaiting_approval and "no authentic approval" in d.result.detail
    intruder, _, _, _ = keypair(tmp_path, "intruder")
    assert "unknown key" in approvals.add(approval(intruder, cmd))
    assert not _decide(cmd, keys, journal, approvals).proceed
    approvals.add(approval(key, cmd, ttl=-1))  # authentic but already expired
    d = _decide(cmd, keys, journal, approvals)
    assert "expired" in d.result.detail and not d.proceed
    approvals.add(approval(key, cmd, ttl=60))
    assert _decide(cmd, keys, journal, approvals).proceed
    assert _decide(cmd, keys, journal, approvals, now=NOW + timedelta(seconds=59)).proceed
    # the approval lapses at its expires_at, while the command itself is still valid
    d = _decide(cmd, keys, journal, approvals, now=NOW + timedelta(seconds=60))
    assert d.reason == "approval" and not d.proceed and "expired" in d.result.detail


def test_journal_answers_a_duplicate_and_survives_a_restart(env, tmp_path):
    key, keys, journal, approvals = env
    cmd = key.sign(command("n1", "CORDON_NODE", now=NOW))
    journal.started(cmd, NOW)
    journal.done(result_for(cmd, Outcome.succeeded, "cordoned node n1"))
    again = Journal(journal.path)  # a restarted executor
    d = _decide(cmd, keys, again, approvals, now=NOW + timedelta(days=1))  # even once expired
    assert d.from_journal and d.result.outcome == Outcome.succeeded
    assert d.result.detail == "already carried out (journal): cordoned node n1"


def test_a_command_interrupted_mid_action_is_never_run_again(env):
    key, keys, journal, approvals = env
    cmd = key.sign(command("n1", "DRAIN_NODE", now=NOW))
    journal.started(cmd, NOW)  # ... and the executor died
    d = _decide(cmd, keys, Journal(journal.path), approvals)
    assert d.result.outcome == Outcome.failed and d.result.detail.startswith("already carried out (journal): interrupted")


def test_a_torn_last_line_is_cut_off_so_the_next_entry_is_not_glued_onto_it(env):
    """A crash mid-write leaves a line without its newline; the next start must not append onto it
    (the glued line would be unreadable, and a command started after it run again after a second crash)."""
    key, keys, journal, approvals = env
    first = key.sign(command("n1", "CORDON_NODE", now=NOW))
    journal.started(first, NOW)
    with journal.path.open("ab") as fh:  # the executor died while writing "done"
        fh.write(b'{"kind":"done","command_id":"' + first.command_id.encode() + b'","res')
    restarted = Journal(journal.path)
    assert restarted.answer(first.command_id).outcome == Outcome.failed  # interrupted
    second = key.sign(command("n1", "DRAIN_NODE", now=NOW))
    restarted.started(second, NOW)  # ... and the executor died again, mid-drain
    d = _decide(second, keys, Journal(journal.path), approvals)
    assert not d.proceed and d.result.outcome == Outcome.failed
    assert d.result.detail.startswith("already carried out (journal): interrupted")
    assert journal.path.read_bytes().endswith(b"\n")
    assert all(line.startswith(b"{") and line.endswith(b"}") for line in journal.path.read_bytes().splitlines())


class _Recorder:
    def __init__(self):
        self.calls: list[tuple[str, bool]] = []

    def execute(self, cmd: RemediationCommand, dry_run: bool):
        self.calls.append((cmd.command_id, dry_run))
        return ("refused", "dry run: would cordon") if dry_run else ("succeeded", "cordoned")


def test_dry_run_is_the_default_and_is_not_journaled(tmp_path):
    key, keys, _, _ = keypair(tmp_path)
    rec = _Recorder()
    cmd = key.sign(command("n1", "CORDON_NODE"))
    dry = Executor(scope="cluster", keys=keys, actions=rec, state_dir=tmp_path / "s", clock=lambda: NOW)
    r = dry.handle(cmd)
    assert r.outcome == Outcome.refused and r.detail.startswith("dry run: would ")
    applying = Executor(scope="cluster", keys=keys, actions=rec, state_dir=tmp_path / "s", apply=True, clock=lambda: NOW)
    assert applying.handle(cmd).outcome == Outcome.succeeded  # the dry run did not block it
    assert applying.handle(cmd).detail.startswith("already carried out")
    assert rec.calls == [(cmd.command_id, True), (cmd.command_id, False)]  # carried out once
    # a command marked dry_run by the processor's policy stays a dry run under --apply
    marked = key.sign(command("n1", "CORDON_NODE", dry_run=True))
    assert applying.handle(marked).detail.endswith("(the command itself is marked dry_run)")


def test_held_command_is_released_by_an_approval_or_expires(tmp_path):
    key, keys, _, _ = keypair(tmp_path)
    approver, approver_keys, _, _ = keypair(tmp_path, "approver")  # approvals have a trust set of their own
    rec = _Recorder()
    clock = [NOW]
    ex = Executor(scope="cluster", keys=keys, approval_keys=approver_keys, actions=rec, state_dir=tmp_path / "s",
                  apply=True, clock=lambda: clock[0])
    held = key.sign(command("n1", "DRAIN_NODE", requires_approval=True))
    assert ex.handle(held, hold=True) is None and ex.held == [held.command_id]
    assert Executor(scope="cluster", keys=keys, actions=rec, state_dir=tmp_path / "s",
                    clock=lambda: clock[0]).held == [held.command_id]
    assert ex.approve(approval(approver, held)) is None
    [r] = ex.due()
    assert r.outcome == Outcome.succeeded and rec.calls == [(held.command_id, False)]
    late = key.sign(command("n1", "DRAIN_NODE", requires_approval=True, ttl=30))
    assert ex.handle(late, hold=True) is None
    clock[0] += timedelta(seconds=31)
    [r] = ex.due()
    assert r.outcome == Outcome.expired and "never came" in r.detail
    assert len(rec.calls) == 1


@pytest.mark.parametrize("result", [None, [], "ok", {"outcome": "nonsense"}])
def test_a_done_line_whose_result_is_unreadable_leaves_the_command_interrupted(env, caplog, result):
    # a complete JSON line that is no result (a disk error, a hand edit): the executor used to die
    # at start (AttributeError on a list); it must start, and never run the command again
    key, keys, journal, approvals = env
    cmd = key.sign(command("n1", "DRAIN_NODE", now=NOW))
    journal.started(cmd, NOW)
    with journal.path.open("ab") as fh:
        fh.write(orjson.dumps({"kind": "done", "command_id": cmd.command_id, "result": result}) + b"\n")
    with caplog.at_level("ERROR", logger="xidstream.executors.gate"):
        restarted = Journal(journal.path)
    assert f"the result of command {cmd.command_id} is unreadable" in caplog.text
    d = _decide(cmd, keys, restarted, approvals)
    assert not d.proceed and d.result.detail.startswith("already carried out (journal): interrupted")


@pytest.mark.parametrize("line", [b"[]", b"1", b'"text"', b'{"kind": "held", "command_id": "c1"}',
                                  b'{"kind": "started", "command_id": "c2"}'])
def test_a_journal_line_that_is_no_entry_is_skipped_and_the_executor_starts(env, caplog, line):
    key, keys, journal, approvals = env
    cmd = key.sign(command("n1", "CORDON_NODE", now=NOW))
    journal.started(cmd, NOW)
    with journal.path.open("ab") as fh:
        fh.write(line + b"\n")
    with caplog.at_level("ERROR", logger="xidstream.executors.gate"):
        restarted = Journal(journal.path)
    assert "a line that is no entry, skipped" in caplog.text
    assert restarted.answer(cmd.command_id).detail.startswith("interrupted")  # the good lines still count
