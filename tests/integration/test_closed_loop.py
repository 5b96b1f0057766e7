"""The motivating incident end to end, on the real broker and the real local API server:
collectors -> Kafka -> `xidstream process --signing-key` -> signed commands -> `xidstream execute
--scope cluster --apply` and `--scope node --apply` (the real commands) -> the API server ->
gpu.remediation.results -> the processor matches each result to its command, and the incident's
next alert shows each step's outcome on its timeline.

Both executors start together, as in a cluster: RESET_GPU reaches the node executor with CORDON_NODE
and DRAIN_NODE, and it waits for the node to be cordoned and drained before checking the rest. The
node executor has no GPU here (no NVML): RESET_GPU is answered `refused` with the precondition
named, never "not cordoned" or "not drained" (the node-executor tests drive a successful reset with
the collector's fake NVML). The API server state is read back over plain HTTPS, not through the
executors' client.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from xidstream.schemas.vocab import Action
from workshop.demo_cluster import run_closed_loop

pytestmark = [pytest.mark.broker, pytest.mark.kube]

RUN = uuid.uuid4().hex[:6]


def test_motivating_incident_closed_loop(kafka_bootstrap, kube, tmp_path):
    t0 = time.monotonic()
    # gpu-node-7 is the scenario's node; suffixed so runs sharing one API server never meet
    node, ns = f"gpu-node-7-{RUN}", f"ml-{RUN}"
    loop = run_closed_loop(kafka_bootstrap, kube, tmp_path, node=node, namespace=ns, timeout=40)
    took = time.monotonic() - t0

    # every command is signed by the processor and answered by the executor it belongs to
    cmds = {c.action: c for c in loop.commands}
    assert {Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU} <= set(cmds)
    assert all(c.signature and c.key_id for c in loop.commands)
    by_action = {r.action: r for r in loop.results}
    for action in (Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU):
        r = by_action[action]
        assert (r.command_id, r.incident_id, r.gpu_uuid) == (cmds[action].command_id, cmds[action].incident_id,
                                                              cmds[action].gpu_uuid), action
        assert r.node == node
    assert by_action[Action.CORDON_NODE].outcome.value == "succeeded", by_action[Action.CORDON_NODE].detail
    assert by_action[Action.DRAIN_NODE].outcome.value == "succeeded", by_action[Action.DRAIN_NODE].detail
    assert f"{ns}/vllm-1-{node}" in by_action[Action.DRAIN_NODE].detail
    reset = by_action[Action.RESET_GPU]
    # refused, not failed: the reset never started (a failed reset would make the processor climb)
    assert reset.outcome.value == "refused" and "precondition failed" in reset.detail, reset.detail
    assert "not reset" in reset.detail and "not drained" not in reset.detail and "not cordoned" not in reset.detail

    # the API server: cordoned (unschedulable + our NoSchedule taint + the ownership note), the
    # vLLM pod evicted, the DaemonSet pod kept
    status, n = kube.request("GET", f"/api/v1/nodes/{node}")
    assert status == 200
    assert n["spec"]["unschedulable"] is True
    assert [t["effect"] for t in n["spec"]["taints"] if t["key"] == "xidstream.io/gpu-fault"] == ["NoSchedule"]
    note = json.loads(n["metadata"]["annotations"]["xidstream.io/cordon"])
    assert note["command"] == cmds[Action.CORDON_NODE].command_id
    # evicted through the Eviction API (terminating), then deleted by the loop playing the kubelet
    assert loop.evicted == [f"{ns}/vllm-1-{node}"]
    assert kube.request("GET", f"/api/v1/namespaces/{ns}/pods/vllm-1-{node}")[0] == 404
    status, ds = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/xidstream-collector-{node}")
    assert status == 200 and not ds["metadata"].get("deletionTimestamp")
    reasons = {e["reason"] for e in loop.events}
    assert {"XidstreamCordon", "XidstreamDrain", "XidstreamGpuResetRefused"} <= reasons, reasons

    # the processor matched each result to its command: the incident's next alert carries them
    alert = loop.timeline_alert()
    assert alert is not None and alert.incident_id == cmds[Action.CORDON_NODE].incident_id
    entries = {e.data["action"]: e for e in alert.evidence.timeline
               if e.kind == "remediation" and e.data.get("matched") is True}
    for action in (Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU):
        assert entries[action.value].data["command_id"] == cmds[action].command_id
        assert entries[action.value].data["outcome"] == by_action[action].outcome.value
    # a refused reset is reported for an operator (a failed one would climb to the reboot rung);
    # a REBOOT_NODE, when commanded without approval, is refused for good: no kured runs on this
    # node, so its sentinel would never be read (never "succeeded" for a written file)
    assert any("RESET_GPU refused" in a.summary for a in loop.alerts), [a.summary for a in loop.alerts]
    reboot = [c for c in loop.commands if c.action == Action.REBOOT_NODE]
    if reboot and not reboot[0].requires_approval:
        r = by_action[Action.REBOOT_NODE]
        assert r.outcome.value == "refused" and r.final and "kured is not running" in r.detail, r.detail
        assert not loop.sentinel.exists()
    assert took < 90, f"closed loop took {took:.0f} s"
    print(f"closed loop in {took:.1f} s")
    kube.request("DELETE", f"/api/v1/nodes/{node}")
