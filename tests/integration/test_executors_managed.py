"""The cluster executor acts only on managed GPU nodes, never on a control-plane node, whatever
signed the command (threats T1-T3: what the processor signs rests on what nodes sent). On the real
kube-apiserver (the `kube` fixture); on 1484261 the cluster executor cordoned and drained any node."""

from __future__ import annotations

import uuid

import pytest

from xidstream.executors.cluster import ClusterActions
from xidstream.executors.kube import make_client
from xidstream.executors.runner import Executor
from tests.executors.helpers import command, keypair

pytestmark = pytest.mark.kube

RUN = uuid.uuid4().hex[:6]


def _node(kube, name: str, labels: dict) -> dict:
    status, body = kube.request("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}})
    assert status == 201, body
    return body


def _get(kube, name: str) -> dict:
    status, body = kube.request("GET", f"/api/v1/nodes/{name}")
    assert status == 200, body
    return body


@pytest.fixture
def executor(kube, tmp_path):
    key, verify, _, _ = keypair(tmp_path)
    ex = Executor(scope="cluster", keys=verify, actions=ClusterActions(make_client(kube.kubeconfig), drain_timeout=2.0),
                  state_dir=tmp_path / "state", apply=True)
    return key, ex


@pytest.mark.parametrize("labels, why", [
    ({"node-role.kubernetes.io/control-plane": ""}, "control-plane node"),
    ({"node-role.kubernetes.io/control-plane": "", "nvidia.com/gpu.present": "true"}, "control-plane node"),
    ({}, "not a managed GPU node"),
    ({"nvidia.com/gpu.present": "false"}, "not a managed GPU node"),
])
def test_signed_commands_for_unmanaged_or_control_plane_nodes_are_refused_and_change_nothing(kube, executor, labels, why):
    key, ex = executor
    name = f"cp-{RUN}-{uuid.uuid4().hex[:4]}"
    _node(kube, name, labels)
    before = _get(kube, name)["metadata"]["resourceVersion"]
    for action in ("CORDON_NODE", "DRAIN_NODE", "QUARANTINE_GPU", "REPLACE_NODE", "RECORD"):
        result = ex.handle(key.sign(command(name, action)))
        assert result.outcome.value == "refused" and why in result.detail, (action, result.detail)
    after = _get(kube, name)
    assert after["metadata"]["resourceVersion"] == before  # nothing was written
    assert not after["spec"].get("unschedulable")


@pytest.mark.parametrize("label", ["nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"])
def test_a_gpu_node_with_either_label_is_acted_on(kube, executor, label):
    key, ex = executor
    name = f"gpu-{RUN}-{uuid.uuid4().hex[:4]}"
    _node(kube, name, {label: "true"})
    result = ex.handle(key.sign(command(name, "CORDON_NODE")))
    assert result.outcome.value == "succeeded", result.detail
    assert _get(kube, name)["spec"]["unschedulable"] is True
