"""The gate's answers, field by field: what an operator and the processor read in a refusal (found
by `make mutate MODULES=executors/gate.py`: these survived with the answer's wording, node or
boundary changed)."""

from __future__ import annotations

import re
import shlex
from datetime import timedelta

import pytest

from xidstream.executors.gate import Approvals, Journal, Limits, decide, result_for, separate_trust
from xidstream.schemas.errors import ConfigError
from xidstream.schemas.signing import VerifyKeys
from xidstream.schemas.vocab import Outcome
from tests.executors.helpers import approval, command, keypair
from tests.executors.test_gate_trust import NOW
from tests.shell import HOSTILE, interpreted


@pytest.fixture
def env(tmp_path):
    key, verify, _, pub = keypair(tmp_path, "proc")
    ops, ops_verify, _, ops_pub = keypair(tmp_path, "ops")
    return key, verify, ops, ops_verify, tmp_path, pub, ops_pub


def _decide(cmd, verify, journal, approvals=None, *, scope="cluster", node=None, now=NOW):
    return decide(cmd, keys=verify, now=now, scope=scope, node=node, journal=journal,
                  approvals=approvals or Approvals(VerifyKeys({})))


def test_an_answer_from_the_journal_is_a_new_record_with_the_original_outcome(env):
    key, verify, _, _, tmp, *_ = env
    journal = Journal(tmp / "j.jsonl")
    cmd = key.sign(command("n1", "RESET_GPU", now=NOW))
    first = result_for(cmd, Outcome.failed, "GPU busy", node="n1")
    journal.done(first)
    later = NOW + timedelta(seconds=30)
    d = _decide(cmd, verify, journal, scope="node", node="n1", now=later)
    assert (d.proceed, d.reason, d.from_journal) == (False, "duplicate", True)
    r = d.result
    assert r.outcome == Outcome.failed and r.detail == "already carried out (journal): GPU busy"
    assert r.event_id != first.event_id and re.fullmatch(r"[0-9a-f]{32}", r.event_id)
    assert r.ts == later and r.node == "n1" and r.command_id == cmd.command_id


def test_a_refusal_names_the_executor_that_refused(env):
    key, verify, _, _, tmp, *_ = env
    d = _decide(key.sign(command("n2", "RESET_GPU", now=NOW)), verify, Journal(tmp / "j.jsonl"), scope="node", node="n1")
    assert d.reason == "node" and d.result.node == "n1"  # the answer is the refusing executor's
    assert d.result.detail == ("refused: command is for node n2, this executor acts only on n1; nothing was done")


@pytest.mark.parametrize("scope, node, action, other", [("cluster", None, "RESET_GPU", "node"),
                                                         ("node", "n1", "CORDON_NODE", "cluster")])
def test_a_scope_refusal_says_which_executor_does_it(env, scope, node, action, other):
    key, verify, _, _, tmp, *_ = env
    d = _decide(key.sign(command("n1", action, now=NOW)), verify, Journal(tmp / "j.jsonl"), scope=scope, node=node)
    assert d.reason == "scope"
    assert d.result.detail == (f"refused: the {scope} executor does not carry out {action} (the {other} executor "
                               f"does); nothing was done")


def test_an_unapproved_command_says_how_to_approve_it(env):
    key, verify, _, _, tmp, *_ = env
    cmd = key.sign(command("n1", "DRAIN_NODE", now=NOW, requires_approval=True))
    d = _decide(cmd, verify, Journal(tmp / "j.jsonl"))
    assert d.awaiting_approval and d.result.detail == (
        f"refused: requires approval and no authentic approval names it (xidstream approve {cmd.command_id} "
        f"--key FILE --node n1); nothing was done")


def test_rejected_approvals_are_kept_with_their_reason(env):
    key, _, ops, ops_verify, *_ = env
    cmd = command("n1", "DRAIN_NODE", now=NOW)
    appr = Approvals(ops_verify)
    forged = approval(key, cmd, now=NOW)
    long = approval(ops, cmd, now=NOW, ttl=2 * 86400)
    assert appr.add(forged) is not None and appr.add(long) is not None
    assert [a for a, _ in appr.rejected] == [forged.approval_id, long.approval_id]
    assert "unknown key" in appr.rejected[0][1] and "an approval may live" in appr.rejected[1][1]


def test_approval_boundaries(env):
    _, _, ops, ops_verify, *_ = env
    cmd = command("n1", "DRAIN_NODE", now=NOW)
    appr = Approvals(ops_verify, Limits(max_future_skew_s=300))
    at_bound = approval(ops, cmd, now=NOW + timedelta(seconds=300), ttl=600)
    appr.add(at_bound)
    assert appr.valid_for(cmd.command_id, NOW) == at_bound  # stamped exactly at the bound: counts
    expiring = approval(ops, cmd, now=NOW - timedelta(seconds=600), ttl=600)  # expires exactly at NOW
    appr2 = Approvals(ops_verify)
    appr2.add(expiring)
    assert appr2.valid_for(cmd.command_id, NOW) is None and appr2.expired_for(cmd.command_id, NOW) == [expiring]


def test_a_later_approval_counts_when_an_earlier_one_does_not(env, tmp_path):
    _, _, ops, _, _, _, ops_pub = env
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("")
    cmd = command("n1", "DRAIN_NODE", now=NOW)
    ops2, _, _, ops2_pub = keypair(tmp_path, "ops2")
    appr = Approvals(VerifyKeys.load([ops_pub, ops2_pub], revoked, purpose="approvals"))
    first, second = approval(ops, cmd, now=NOW), approval(ops2, cmd, now=NOW)
    appr.add(first)
    appr.add(second)
    revoked.write_text(ops.key_id + "\n")  # the first approver's key is revoked: the second still counts
    assert appr.valid_for(cmd.command_id, NOW) == second


def test_the_trust_conflict_names_every_shared_key(env, tmp_path):
    _, _, _, _, _, pub, ops_pub = env
    both = VerifyKeys.load([pub, ops_pub])
    with pytest.raises(ConfigError) as exc:
        separate_trust(both, both)
    assert f"key(s) {', '.join(sorted(both.key_ids))} are trusted both" in str(exc.value)


def test_a_node_executors_cursor_survives_a_torn_write_and_never_moves_back(tmp_path):
    """The node executor's position (no consumer group: executors.runner): saved atomically, an
    unreadable file costs a re-read (never a skipped command), and a position never moves back."""
    from xidstream.executors.runner import Cursor

    c = Cursor(tmp_path / "cursor.json")
    assert c.get("t", 0) is None
    c.advance("t", 0, 5)
    c.advance("t", 0, 3)  # an older message re-read after a crash: the position stays
    c.advance("t", 1, 1)
    c.save()
    assert not (tmp_path / "cursor.json.tmp").exists()
    again = Cursor(tmp_path / "cursor.json")
    assert (again.get("t", 0), again.get("t", 1), again.get("u", 0)) == (5, 1, None)
    (tmp_path / "cursor.json").write_bytes(b'{"t:0": 5')  # torn
    assert Cursor(tmp_path / "cursor.json").positions == {}


@pytest.mark.parametrize("command_id", HOSTILE, ids=range(len(HOSTILE)))
def test_the_approve_line_in_a_refusal_is_one_shell_word_per_field(env, command_id):
    """The refusal quotes the line that approves the command; an operator may paste it, so the
    command's fields are shell-quoted, whatever the command id holds."""
    key, verify, _, _, tmp, *_ = env
    cmd = key.sign(command("n1", "DRAIN_NODE", now=NOW, requires_approval=True, command_id=command_id))
    detail = _decide(cmd, verify, Journal(tmp / "j.jsonl")).result.detail
    head, tail = "refused: requires approval and no authentic approval names it (", "); nothing was done"
    assert detail.startswith(head) and detail.endswith(tail)
    line = detail[len(head):-len(tail)]
    assert shlex.split(line) == ["xidstream", "approve", command_id, "--key", "FILE", "--node", "n1"]
    assert interpreted(line) == ""
