"""End to end on the real broker with a real `xidstream process` worker that believes records by
node identity (--enroller-key): with node A's credentials and keys, every forgery about node B
(telemetry, results, the fleet topic, a breaker reset) causes no command for node B, each is
dead-lettered with its reason, and node A's genuine Xid 79 still yields its plan. On 1484261 the
same forgeries came back as signed CORDON/DRAIN/REBOOT_NODE for node B."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from xidstream.schemas import Action, RemediationCommand, RemediationResult, encode, to_dict
from xidstream.schemas.models import NodeEnrollment
from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys
from tests.integration.test_processor_on_broker import outputs, stop_worker
from tests.streams.builders import inventory, sample, xid
from xidstream.transport.identity import CLUSTER_IDENTITY, NodeIdentity, ProcessorIdentity
from xidstream.transport.kafka import producer_config

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


def _send(settings, items):
    """(record or (topic, key, value), headers) pairs, produced as given."""
    p = Producer(producer_config(settings))
    for item, headers in items:
        if isinstance(item, tuple):
            topic, key, value = item
        else:
            topic, key = settings.topics.for_record(item)
            value = encode(item)
        hdrs = headers(topic, key, value) if callable(headers) else headers
        p.produce(topic, key=key, value=value, headers=hdrs)
    assert p.flush(30) == 0


def test_node_a_credentials_cannot_move_node_b(kafka_settings, tmp_path):
    s = kafka_settings
    run_forgeries(lambda role: s, lambda extra, files: _plain_worker(s, tmp_path, extra), tmp_path)


def _plain_worker(s, tmp_path, extra):
    log = open(tmp_path / "w.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "xidstream.cli", "process", "--bootstrap", s.bootstrap, "--topic-prefix", s.topic_prefix,
         "--partitions", str(s.partitions), "--fast-rebalance", "--data-dir", str(tmp_path / "data"),
         "--loglevel", "warning", *extra],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


# The processor's flags that decide what it believes and signs; the rest of its chart args (web
# port, store, data dir, policy file, Kafka file) are the pod's plumbing, given by the test harness.
TRUST_FLAGS = {"--signing-key": True, "--enroller-key": True, "--approver-key": True, "--records-not-tied-to-nodes": False}


def chart_trust_args(helm: str, files: dict[str, str], *values: str) -> list[str]:
    """The processor's trust flags as `helm template` renders them with the chart's DEFAULT values
    (plus `values`), each mounted file replaced by the test's own file (`files`: chart path -> local
    path; a path the test does not hold fails the test)."""
    from tests.deploy.test_helm_chart import by_kind, containers, render

    [dep] = [d for n, d in by_kind(render(helm, *values)[0])["Deployment"].items() if n.endswith("-processor")]
    args = containers(dep)["processor"]["args"]
    out, i = [], 0
    while i < len(args):
        flag = args[i]
        if flag in TRUST_FLAGS:
            out.append(flag)
            if TRUST_FLAGS[flag]:
                assert args[i + 1] in files, f"the chart's {flag} {args[i + 1]}: no such file in the test"
                out.append(files[args[i + 1]])
                i += 1
        i += 1
    return out


def run_forgeries(role, start_worker, tmp_path):
    """`role(name)`: the Settings (credentials) of a Kafka role; `start_worker(extra_args, files)`:
    a real processor worker with the processor's credentials and `extra_args` (or the chart's
    trust flags, `files` mapping the chart's mounted paths to this run's keys), its log in
    tmp_path/w.log. Node A holds the
    collector's and the node executor's credentials (every node does) and its own identity keys."""
    s = role("admin")
    # GPUs of this run only: the secure module's topics keep other runs' commands and rows
    tag = uuid.uuid4().hex[:8]
    GPU_A, GPU_B = f"GPU-aaaaaaaa-0000-0000-0000-{tag}0001", f"GPU-bbbbbbbb-0000-0000-0000-{tag}0002"  # noqa: N806
    sk_path, _, _ = generate_keys(tmp_path / "processor")
    en_path, en_pub, _ = generate_keys(tmp_path / "enroller")
    signing, enroller = SigningKey.load(sk_path), SigningKey.load(en_path)
    proc_id = ProcessorIdentity(signing)
    a = NodeIdentity.load_or_create(tmp_path / "node-a", "node-a")
    b = NodeIdentity.load_or_create(tmp_path / "node-b", "node-b")
    cl = NodeIdentity.load_or_create(tmp_path / "cluster", CLUSTER_IDENTITY)
    enrollments = [enroller.sign(NodeEnrollment(node=i.identity, x25519_public=i.x25519_public,
                                                ed25519_public=i.ed25519_public, csr_name=f"csr-{i.identity}",
                                                csr_uid=uuid.uuid4().hex)) for i in (a, b, cl)]
    # A forged enrollment of node B's identity with A's key, signed by A's own (untrusted) key.
    rogue = SigningKey.load(generate_keys(tmp_path / "rogue")[0]).sign(NodeEnrollment(
        node="node-b", x25519_public=a.x25519_public, ed25519_public=a.ed25519_public, csr_name="x", csr_uid="x"))
    _send(role("cluster-executor"), [(e, None) for e in enrollments + [rogue]])

    auth_a, auth_b = a.record_auth(proc_id.public), b.record_auth(proc_id.public)

    def mac(auth):
        return lambda topic, key, value: [auth.header(topic, key, value)]

    # what the processor's signing key and the enroller's public key are called where the chart mounts them
    worker = start_worker(["--signing-key", str(sk_path), "--enroller-key", str(en_pub)],
                          {"/etc/xidstream/signing/signing.key": str(sk_path),
                           "/etc/xidstream/verify/enroller.pub": str(en_pub)})
    try:
        # Node B's own inventory and healthy samples (so it is a known GPU node), genuinely MAC'd.
        collector, executor, processor = role("collector"), role("executor"), role("processor")
        _send(collector, [(inventory(0, gpu=GPU_B, node="node-b"), mac(auth_b)), (sample(0, gpu=GPU_B, node="node-b"), mac(auth_b)),
                  (inventory(0, gpu=GPU_A, node="node-a"), mac(auth_a)), (sample(0, gpu=GPU_A, node="node-a"), mac(auth_a))])
        now = datetime.now(timezone.utc)
        b79 = xid(100, 79, pid=None, gpu=GPU_B, node="node-b")
        forged_hdr = lambda topic, key, value: [("xidstream-auth", auth_a.header(topic, key, value)[1].replace(b"node-a", b"node-b"))]
        fake_cmd = RemediationCommand(ts=now, node="node-b", command_id=uuid.uuid4().hex, incident_id="i", gpu_uuid=GPU_B,
                                      gpu_index=1, pci_bus_id="0000:02:00", action="REBOOT_NODE", step=1, reason="forged",
                                      expires_at=now + timedelta(days=30))
        fleet = s.topics.prefix + "xidstream.fleet"
        forged_result = RemediationResult(node="node-b", command_id="c", incident_id="i", gpu_uuid=GPU_B,
                                          pci_bus_id="0000:02:00", action=Action.RESET_GPU, outcome="failed", detail="forged")
        cordon_result = RemediationResult(node="node-a", command_id="c", incident_id="i", gpu_uuid=GPU_A,
                                          pci_bus_id="0000:02:00", action=Action.CORDON_NODE, outcome="succeeded")
        # Node A naming node B's GPU as its own (GPU UUIDs are not secret: commands carry them).
        squat = sample(50, util=100, mem=0, gpu=GPU_B, node="node-a")
        _send(collector, [
            (squat, mac(auth_a)),
            (b79, mac(auth_a)),                     # about node B, MAC'd by node A
            (b79, forged_hdr),                      # node A's MAC relabelled as node B's
            (b79, None),                            # no MAC at all
        ])
        _send(executor, [
            (forged_result, mac(auth_a)),           # node B's RESET_GPU result, sent by node A
            (cordon_result, mac(auth_a)),           # a cluster action's result, sent by a node
        ])
        # The fleet topic: a node's users cannot write it at all (ACL); with the processor's Kafka
        # user but not its signing key (T3), an unsealed command and an unapproved reset.
        _send(processor, [
            ((fleet, b"fleet", orjson.dumps({"kind": "command", "command": to_dict(fake_cmd)})), None),
            ((fleet, b"fleet", orjson.dumps({"kind": "reset", "ts": time.time(), "by": "mallory"})), None),
        ])
        # Node A's own, genuine Xid 79.
        _send(collector, [(xid(120, 79, pid=None, gpu=GPU_A, node="node-a"), mac(auth_a))])
        deadline, got = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            assert worker.poll() is None, (tmp_path / "w.log").read_text()[-3000:]
            got = outputs(s, timeout=8)
            cmds = [r for t, r in got if t == "gpu.remediation"]
            if sum(1 for t, _ in got if t == "xidstream.deadletter") >= 8 and any(c.gpu_uuid == GPU_A for c in cmds):
                break
            time.sleep(1)
    finally:
        stop_worker(worker, signal.SIGTERM)
    cmds = [r for t, r in got if t == "gpu.remediation"]
    assert [c for c in cmds if c.node == "node-b"] == [], [(c.node, c.action) for c in cmds]
    # (the secure module's topics are shared with its other tests: only this run's GPU counts)
    mine = [c for c in cmds if c.gpu_uuid == GPU_A]
    a_actions = [c.action for c in mine]
    assert Action.CORDON_NODE in a_actions and Action.DRAIN_NODE in a_actions and Action.REBOOT_NODE in a_actions
    for c in mine:
        VerifyKeys.load([tmp_path / "processor" / "signing.pub"]).verify(c)
    dead = [r for t, r in got if t == "xidstream.deadletter"]
    errors = " | ".join(d.error for d in dead)
    assert "about node node-b sent by node-a" in errors
    assert f"GPU row {GPU_B} belongs to node node-b; node-a cannot speak for it" in errors
    assert [c for c in cmds if c.gpu_uuid == GPU_B] == []
    assert "does not hold for 'node-b'" in errors
    assert "no xidstream-auth header" in errors
    assert "must come from node-b; it was sent by node-a" in errors
    assert f"must come from {CLUSTER_IDENTITY}; it was sent by node-a" in errors
    assert "unsealed 'command' message" in errors
    assert "breaker reset refused" in errors
    alerts = [r for t, r in got if t == "gpu.alerts"]
    assert not [x for x in alerts if x.node == "node-b"]
    assert "enrollment refused" in (tmp_path / "w.log").read_text()  # the rogue enrollment, logged
