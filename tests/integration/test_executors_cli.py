"""The executor through the real `xidstream` command: keys generate / sign, approve, execute
--stdin on the real API server, and one run through the real Kafka broker (commands on
gpu.remediation and an approval on gpu.remediation.approvals -> results on gpu.remediation.results)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import orjson
import pytest
from confluent_kafka import Producer

from xidstream.schemas.codec import decode, encode
from xidstream.schemas.models import RemediationResult
from tests.executors.helpers import command
from tests.integration.test_executors_cluster import get_node, make_node, snapshot

RUN = uuid.uuid4().hex[:6]


def xidstream(*args: str, stdin: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xidstream.cli", *args], input=stdin, capture_output=True,
                          timeout=timeout)


@pytest.fixture
def keydir(tmp_path):
    out = tmp_path / "keys"
    p = xidstream("keys", "generate", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert b"key id " in p.stdout and (out / "signing.key").stat().st_mode & 0o777 == 0o600
    return out


@pytest.fixture
def opsdir(tmp_path):
    """An approver's own key pair: approvals are verified with --approver-key, never the processor's."""
    out = tmp_path / "ops"
    assert xidstream("keys", "generate", "--out", str(out)).returncode == 0
    return out


def sign(keydir, *cmds) -> bytes:
    p = xidstream("keys", "sign", "--key", str(keydir / "signing.key"),
                  stdin=b"".join(encode(c) + b"\n" for c in cmds))
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.kube
def test_execute_stdin_through_the_cli_dry_run_then_apply(kube, keydir, opsdir, tmp_path):
    node = make_node(kube, "cli")
    cordon = command(node, "CORDON_NODE")
    held = command(node, "REPLACE_NODE", requires_approval=True)
    unsigned = encode(command(node, "DRAIN_NODE")) + b"\n"
    signed = sign(keydir, cordon, held)
    base = ["execute", "--scope", "cluster", "--verify-key", str(keydir / "signing.pub"), "--approver-key",
            str(opsdir / "signing.pub"), "--kubeconfig", str(kube.kubeconfig), "--stdin", "--state-dir", str(tmp_path / "state")]

    before = snapshot(kube, node)
    p = xidstream(*base, stdin=signed + unsigned)
    assert p.returncode == 0, p.stderr
    results = [decode(RemediationResult, line) for line in p.stdout.splitlines()]
    # one result per command; the held one is answered at the end of the input (no approval came)
    assert len(results) == 3 and results[2].command_id == held.command_id
    assert results[0].command_id == cordon.command_id and results[0].detail.startswith("dry run: would cordon")
    assert results[1].outcome.value == "refused" and "unsigned" in results[1].detail
    assert "requires approval" in results[2].detail and b"dry run" in p.stderr
    assert snapshot(kube, node) == before  # a dry run writes nothing

    # the processor's own key cannot approve what it held
    self_appr = xidstream("approve", held.command_id, "--key", str(keydir / "signing.key"), "--node", node, "--by", "proc")
    p = xidstream(*base, "--apply", "--state-dir", str(tmp_path / "state-self"), stdin=signed + self_appr.stdout)
    by_id = {r.command_id: r for r in (decode(RemediationResult, x) for x in p.stdout.splitlines())}
    assert by_id[held.command_id].outcome.value == "refused", by_id[held.command_id].detail
    # --apply, with the operator's approval for the held command on the same input
    appr = xidstream("approve", held.command_id, "--key", str(opsdir / "signing.key"), "--node", node, "--by", "ops")
    assert appr.returncode == 0, appr.stderr
    p = xidstream(*base, "--apply", stdin=signed + appr.stdout)
    assert p.returncode == 0, p.stderr
    by_id = {r.command_id: r for r in (decode(RemediationResult, x) for x in p.stdout.splitlines())}
    assert by_id[cordon.command_id].outcome.value == "succeeded", by_id[cordon.command_id].detail
    assert by_id[held.command_id].outcome.value == "succeeded", by_id[held.command_id].detail
    n = get_node(kube, node)
    assert n["spec"]["unschedulable"] is True and n["metadata"]["labels"]["xidstream.io/replace"] == "true"


def test_execute_clear_errors(tmp_path, keydir):
    p = xidstream("execute", "--scope", "cluster", "--stdin")
    assert p.returncode == 2 and b"no verify key given" in p.stderr
    p = xidstream("execute", "--scope", "node", "--verify-key", str(keydir / "signing.pub"), "--stdin")
    assert p.returncode == 2 and b"--node NAME" in p.stderr
    p = xidstream("execute", "--scope", "cluster", "--verify-key", str(keydir / "signing.pub"), "--stdin",
                  "--kubeconfig", str(tmp_path / "missing"))
    assert p.returncode == 2 and b"cannot load a Kubernetes config" in p.stderr


@pytest.mark.broker
@pytest.mark.kube
def test_commands_through_kafka_to_results(kube, kafka_settings, keydir, opsdir, tmp_path):
    from xidstream.executors.cluster import ClusterActions
    from xidstream.executors.kube import make_client
    from xidstream.executors.runner import Executor, run_kafka
    from xidstream.schemas.models import Approval
    from xidstream.schemas.signing import SigningKey, VerifyKeys
    from xidstream.transport.kafka import producer_config, read_all

    settings = kafka_settings
    node = make_node(kube, "kafka")
    key = SigningKey.load(keydir / "signing.key")
    cordon = key.sign(command(node, "CORDON_NODE"))
    held = key.sign(command(node, "DRAIN_NODE", requires_approval=True))
    forged = key.sign(command(node, "UNCORDON_NODE")).model_copy(update={"step": 9})
    reset = key.sign(command(node, "RESET_GPU"))  # the node executor's: this one leaves it alone
    reg = settings.topics
    producer = Producer(producer_config(settings))
    for c in (cordon, held, forged, reset):
        producer.produce(reg.name("gpu.remediation"), key=node.encode(), value=encode(c))
    assert producer.flush(10) == 0

    ex = Executor(scope="cluster", keys=VerifyKeys.load([keydir / "signing.pub"]), apply=True,
                  approval_keys=VerifyKeys.load([opsdir / "signing.pub"], purpose="approvals"),
                  actions=ClusterActions(make_client(kube.kubeconfig), drain_timeout=2),
                  state_dir=tmp_path / "state")
    stop = threading.Event()
    t = threading.Thread(target=run_kafka, args=(ex, settings), kwargs={"stop": stop, "poll": 0.2}, daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        results = read_all(settings, [reg.name("gpu.remediation.results")], expected=2, timeout=60)
        first = {decode(RemediationResult, m.value()).command_id: decode(RemediationResult, m.value()) for m in results}
        assert set(first) == {cordon.command_id, forged.command_id}, first  # held: no answer yet; reset: not ours
        assert first[cordon.command_id].outcome.value == "succeeded"
        assert "forged or altered" in first[forged.command_id].detail
        assert results[0].key() == node.encode()
        latency = time.monotonic() - t0
        # the operator approves the held drain; the running executor carries it out
        approval = SigningKey.load(opsdir / "signing.key").sign(Approval(node=node, approval_id=uuid.uuid4().hex, command_id=held.command_id,
                                     approved_by="ops", expires_at=held.expires_at))
        producer.produce(reg.name("gpu.remediation.approvals"), key=node.encode(), value=encode(approval))
        assert producer.flush(10) == 0
        results = read_all(settings, [reg.name("gpu.remediation.results")], expected=3, timeout=60)
        answers = {decode(RemediationResult, m.value()).command_id: decode(RemediationResult, m.value()) for m in results}
        assert answers[held.command_id].outcome.value == "succeeded", answers[held.command_id].detail
        assert reset.command_id not in answers and len(results) == 3
    finally:
        stop.set()
        t.join(15)
    assert get_node(kube, node)["spec"]["unschedulable"] is True
    print(f"first two results on the results topic {latency:.2f}s after the executor started")
