"""Who may sign what, and for how long (threat T3: one leaked signing key; T4: lying clocks).

On 1484261 one trust set verified both commands and approvals: the processor's key approved its own
held commands, every approver key could sign new commands, a command stamped to live 30 days was
accepted, and a leaked key could only be dropped by restarting every executor with new flags.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from xidstream.executors.gate import Approvals, Journal, Limits, decide
from xidstream.executors.runner import Executor
from xidstream.schemas.errors import ConfigError
from xidstream.schemas.signing import VerifyKeys
from tests.executors.helpers import approval, command, keypair

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


class Recorder:
    def __init__(self):
        self.done = []

    def execute(self, cmd, dry):
        self.done.append((cmd.command_id, dry))
        return "succeeded", "done"


@pytest.fixture
def keys(tmp_path):
    proc_key, proc_verify, _, proc_pub = keypair(tmp_path, "processor")
    ops_key, ops_verify, _, ops_pub = keypair(tmp_path, "ops")
    return proc_key, proc_verify, ops_key, ops_verify, proc_pub, ops_pub


def _executor(tmp_path, commands, approvals, **kw):
    return Executor(scope="cluster", keys=commands, approval_keys=approvals, actions=Recorder(),
                    state_dir=tmp_path / "state", apply=True, clock=lambda: NOW, **kw)


def test_the_processors_key_cannot_approve_a_command_it_held(tmp_path, keys):
    proc_key, proc_verify, ops_key, ops_verify, *_ = keys
    ex = _executor(tmp_path, proc_verify, ops_verify)
    held = proc_key.sign(command("n1", "DRAIN_NODE", now=NOW, requires_approval=True))
    assert ex.handle(held, hold=True) is None and ex.held == [held.command_id]
    why = ex.approve(approval(proc_key, held, now=NOW))
    assert why is not None and "unknown key" in why
    assert ex.due() == [] and ex.actions.done == []
    # The approver's own key releases it.
    assert ex.approve(approval(ops_key, held, now=NOW)) is None
    (result,) = ex.due()
    assert result.outcome.value == "succeeded" and ex.actions.done == [(held.command_id, False)]


def test_an_approvers_key_cannot_sign_a_command(tmp_path, keys):
    proc_key, proc_verify, ops_key, ops_verify, *_ = keys
    ex = _executor(tmp_path, proc_verify, ops_verify)
    result = ex.handle(ops_key.sign(command("n1", "CORDON_NODE", now=NOW)))
    assert result.outcome.value == "refused" and "unknown key" in result.detail
    assert ex.actions.done == []


def test_one_key_in_both_trust_sets_is_a_configuration_error(tmp_path, keys):
    _, proc_verify, _, _, proc_pub, ops_pub = keys
    both = VerifyKeys.load([proc_pub, ops_pub])
    with pytest.raises(ConfigError, match="both for commands"):
        _executor(tmp_path, proc_verify, both)


def test_without_approver_keys_a_held_command_waits_and_expires(tmp_path, keys):
    proc_key, proc_verify, *_ = keys
    clock = [NOW]
    ex = Executor(scope="cluster", keys=proc_verify, actions=Recorder(), state_dir=tmp_path / "s", apply=True,
                  clock=lambda: clock[0])
    held = proc_key.sign(command("n1", "DRAIN_NODE", now=NOW, ttl=600, requires_approval=True))
    assert ex.handle(held, hold=True) is None
    assert ex.approve(approval(proc_key, held, now=NOW)) is not None
    clock[0] = NOW + timedelta(seconds=601)
    (result,) = ex.due()
    assert result.outcome.value == "expired" and ex.actions.done == []


def _decide(cmd, verify, tmp_path, now=NOW, limits=None):
    return decide(cmd, keys=verify, now=now, scope="cluster", node=None, journal=Journal(tmp_path / "j.jsonl"),
                  approvals=Approvals(VerifyKeys({})), limits=limits)


@pytest.mark.parametrize("ttl, proceeds", [(3600, True), (3601, False), (30 * 86400, False)])
def test_a_command_may_live_an_hour_at_most(tmp_path, keys, ttl, proceeds):
    proc_key, proc_verify, *_ = keys
    d = _decide(proc_key.sign(command("n1", "CORDON_NODE", now=NOW, ttl=ttl)), proc_verify, tmp_path)
    assert d.proceed is proceeds
    if not proceeds:
        assert d.reason == "lifetime" and "more than the 3600 s a command may live" in d.result.detail


@pytest.mark.parametrize("ahead, proceeds", [(300, True), (301, False), (86400, False)])
def test_a_command_stamped_ahead_of_the_executor_clock_is_refused(tmp_path, keys, ahead, proceeds):
    proc_key, proc_verify, *_ = keys
    stamped = NOW + timedelta(seconds=ahead)
    d = _decide(proc_key.sign(command("n1", "CORDON_NODE", now=stamped, ttl=600)), proc_verify, tmp_path)
    assert d.proceed is proceeds
    if not proceeds:
        assert d.reason == "future"


def test_limits_are_configurable(tmp_path, keys):
    proc_key, proc_verify, *_ = keys
    cmd = proc_key.sign(command("n1", "CORDON_NODE", now=NOW, ttl=900))
    assert _decide(cmd, proc_verify, tmp_path).proceed
    assert _decide(cmd, proc_verify, tmp_path, limits=Limits(max_lifetime_s=600)).reason == "lifetime"


def test_the_checks_run_in_their_documented_order(tmp_path, keys):
    """signature, journal, expiry, lifetime/future, node, scope, approval: an unsigned 30-day
    command is answered "signature"; an expired one "expired" even when it also lived too long."""
    proc_key, proc_verify, *_ = keys
    unsigned = command("n1", "CORDON_NODE", now=NOW, ttl=30 * 86400)
    assert _decide(unsigned, proc_verify, tmp_path).reason == "signature"
    old = proc_key.sign(command("n1", "CORDON_NODE", now=NOW - timedelta(days=40), ttl=30 * 86400))
    assert _decide(old, proc_verify, tmp_path).reason == "expired"
    long_reset = proc_key.sign(command("n1", "RESET_GPU", now=NOW, ttl=30 * 86400))
    assert _decide(long_reset, proc_verify, tmp_path).reason == "lifetime"  # before scope


def test_an_approval_may_live_a_day_at_most(tmp_path, keys):
    proc_key, proc_verify, ops_key, ops_verify, *_ = keys
    ex = _executor(tmp_path, proc_verify, ops_verify)
    held = proc_key.sign(command("n1", "DRAIN_NODE", now=NOW, requires_approval=True))
    ex.handle(held, hold=True)
    why = ex.approve(approval(ops_key, held, now=NOW, ttl=86401))
    assert why is not None and "an approval may live" in why
    assert ex.approve(approval(ops_key, held, now=NOW, ttl=86400)) is None


def test_an_approval_stamped_in_the_future_does_not_release(tmp_path, keys):
    proc_key, proc_verify, ops_key, ops_verify, *_ = keys
    ex = _executor(tmp_path, proc_verify, ops_verify)
    held = proc_key.sign(command("n1", "DRAIN_NODE", now=NOW, requires_approval=True))
    ex.handle(held, hold=True)
    ex.approve(approval(ops_key, held, now=NOW + timedelta(hours=2), ttl=600))
    assert ex.due() == [] and ex.held == [held.command_id]


def test_a_revoked_key_is_refused_without_a_restart(tmp_path, keys):
    proc_key, _, ops_key, _, proc_pub, ops_pub = keys
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# none yet\n")
    ex = _executor(tmp_path, VerifyKeys.load([proc_pub], revoked), VerifyKeys.load([ops_pub], revoked, purpose="approvals"))
    first = proc_key.sign(command("n1", "CORDON_NODE", now=NOW))
    assert ex.handle(first).outcome.value == "succeeded"
    held = proc_key.sign(command("n1", "DRAIN_NODE", now=NOW, requires_approval=True))
    ex.handle(held, hold=True)
    assert ex.approve(approval(ops_key, held, now=NOW)) is None
    # The approver's key leaks before the held command is released: revoked, the approval it
    # already signed no longer counts, and the processor's key still works.
    revoked.write_text(f"# leaked 2026-12-01\n{ops_key.key_id}  # ops laptop\n")
    assert ex.due() == [] and ex.held == [held.command_id]
    second = proc_key.sign(command("n2", "CORDON_NODE", now=NOW))
    assert ex.handle(second).outcome.value == "succeeded"
    revoked.write_text(f"{ops_key.key_id}\n{proc_key.key_id}\n")
    third = ex.handle(proc_key.sign(command("n3", "CORDON_NODE", now=NOW)))
    assert third.outcome.value == "refused" and "revoked key" in third.detail


def test_an_unreadable_revocation_list_trusts_no_key(tmp_path, keys):
    proc_key, _, _, _, proc_pub, _ = keys
    verify = VerifyKeys.load([proc_pub], tmp_path / "missing.txt")
    d = _decide(proc_key.sign(command("n1", "CORDON_NODE", now=NOW)), verify, tmp_path)
    assert d.reason == "signature" and "cannot read the revocation list" in d.result.detail
