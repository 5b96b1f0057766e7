"""The cluster executor on a real kube-apiserver (the `kube` fixture: started once per run).

Every test makes its own node(s) and pods, drives `Executor.handle` with signed commands, and
reads the server's state back over plain HTTPS (`KubeHandle.request`), not through the client
under test. Refusals are checked to leave the node, its pods and its Events exactly as they were
(same resourceVersion: nothing was written at all).
"""

from __future__ import annotations

import json
import uuid

import pytest

from xidstream.executors.cluster import (CONDITION_ANNOTATION, CONDITION_TYPE, CORDON_ANNOTATION, TAINT_KEY, ClusterActions,
                               quarantine_rule_name)
from xidstream.executors.kube import make_client
from xidstream.executors.runner import Executor
from xidstream.schemas.vocab import Outcome
from tests.executors.helpers import approval, command, keypair

pytestmark = pytest.mark.kube

RUN = uuid.uuid4().hex[:6]


@pytest.fixture(scope="module")
def ns(kube):
    name = f"xs-exec-{RUN}"
    kube.ensure_namespace(name)
    return name


@pytest.fixture
def keys(tmp_path):
    key, verify, _, _ = keypair(tmp_path)
    return key, verify


@pytest.fixture
def executor(kube, keys, tmp_path):
    _, verify = keys
    actions = ClusterActions(make_client(kube.kubeconfig), drain_timeout=3.0, eviction_retry=0.5)
    return Executor(scope="cluster", keys=verify, actions=actions, state_dir=tmp_path / "state", apply=True)


def make_node(kube, suffix: str) -> str:
    name = f"gpu-{RUN}-{suffix}"
    status, body = kube.request("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        # a GPU node: the cluster executor refuses nodes without the GPU-node labels (test_executors_managed)
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true"}}})
    assert status == 201, body
    return name


def make_pod(kube, ns: str, name: str, node: str, *, labels: dict | None = None, daemonset: bool = False) -> None:
    meta: dict = {"name": name, "labels": labels or {"app": name}}
    if daemonset:  # what the DaemonSet controller would set; the executor must leave such pods
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "collector",
                                    "uid": str(uuid.uuid4()), "controller": True}]
    status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
    assert status == 201, body
    kube.mark_pod_running_ready(ns, name)  # a Pending pod is evicted whatever its PDB


def ours(n: dict) -> list[dict]:
    return [t for t in n["spec"].get("taints") or [] if t["key"] == TAINT_KEY]


def get_node(kube, name: str) -> dict:
    status, body = kube.request("GET", f"/api/v1/nodes/{name}")
    assert status == 200, body
    return body


def node_events(kube, name: str) -> list[dict]:
    status, body = kube.request("GET", f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{name}")
    assert status == 200, body
    return body["items"]


def snapshot(kube, node: str, ns: str | None = None) -> dict:
    """Everything a refusal must leave as it was."""
    snap = {"node": get_node(kube, node)["metadata"]["resourceVersion"], "events": len(node_events(kube, node))}
    if ns:
        status, pods = kube.request("GET", f"/api/v1/namespaces/{ns}/pods?fieldSelector=spec.nodeName%3D{node}")
        snap["pods"] = sorted((p["metadata"]["name"], p["metadata"]["resourceVersion"],
                               bool(p["metadata"].get("deletionTimestamp"))) for p in pods["items"])
    return snap


def cordon(kube, executor, key, node):
    r = executor.handle(key.sign(command(node, "CORDON_NODE")))
    assert r.outcome == Outcome.succeeded, r.detail
    return r


# -- cordon / uncordon --------------------------------------------------------------------------------
def test_cordon_sets_unschedulable_taint_annotation_and_an_event_then_uncordon_undoes_it(kube, executor, keys):
    key, _ = keys
    node = make_node(kube, "cordon")
    cmd = key.sign(command(node, "CORDON_NODE"))
    r = executor.handle(cmd)
    assert r.outcome == Outcome.succeeded, r.detail
    assert (r.command_id, r.incident_id, r.gpu_uuid, r.pci_bus_id) == (cmd.command_id, cmd.incident_id, cmd.gpu_uuid,
                                                                       cmd.pci_bus_id)
    n = get_node(kube, node)
    assert n["spec"]["unschedulable"] is True
    assert [t for t in n["spec"]["taints"] if t["key"] == TAINT_KEY][0]["effect"] == "NoSchedule"
    note = json.loads(n["metadata"]["annotations"][CORDON_ANNOTATION])
    assert note["incident"] == cmd.incident_id and note["was_unschedulable"] is False
    events = node_events(kube, node)
    assert [e["reason"] for e in events] == ["XidstreamCordon"] and cmd.incident_id in events[0]["message"]

    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=cmd.incident_id)))
    assert r.outcome == Outcome.succeeded, r.detail
    n = get_node(kube, node)
    assert not n["spec"].get("unschedulable") and ours(n) == []
    # others' taints are kept (the API server's own admission adds not-ready to a new node)
    assert {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"} in n["spec"]["taints"]
    assert CORDON_ANNOTATION not in (n["metadata"].get("annotations") or {})


def test_uncordon_leaves_a_node_someone_else_cordoned(kube, executor, keys):
    key, _ = keys
    node = make_node(kube, "theirs")
    status, _ = kube.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}},
                             content_type="application/merge-patch+json")
    assert status == 200
    before = snapshot(kube, node)
    r = executor.handle(key.sign(command(node, "UNCORDON_NODE")))
    assert r.outcome == Outcome.refused and "cordoned by someone else" in r.detail
    assert snapshot(kube, node) == before and get_node(kube, node)["spec"]["unschedulable"] is True

    # xidstream cordons it too, then uncordons: our taint goes, their cordon stays
    ours_cmd = cordon(kube, executor, key, node)
    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=ours_cmd.incident_id)))
    assert r.outcome == Outcome.succeeded and "stays unschedulable" in r.detail
    n = get_node(kube, node)
    assert n["spec"]["unschedulable"] is True and ours(n) == []


def test_uncordon_of_one_incident_keeps_the_cordon_another_incident_still_holds(kube, executor, keys):
    """Two wedged GPUs on one node: GPU 1's incident resolves (UNCORDON) while GPU 2's still needs
    the node cordoned. The annotation keeps every incident holding the cordon; the last one out
    uncordons."""
    key, _ = keys
    node = make_node(kube, "two")
    first = key.sign(command(node, "CORDON_NODE", gpu_index=1))
    second = key.sign(command(node, "CORDON_NODE", gpu_index=2, gpu_uuid="GPU-22222222-2222-3333-4444-555555555555"))
    assert executor.handle(first).outcome == Outcome.succeeded
    r = executor.handle(second)
    assert r.outcome == Outcome.succeeded, r.detail
    n = get_node(kube, node)
    note = json.loads(n["metadata"]["annotations"][CORDON_ANNOTATION])
    assert set(note["incidents"]) == {first.incident_id, second.incident_id}
    assert len(ours(n)) == 1 and note["was_unschedulable"] is False

    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=first.incident_id)))
    assert r.outcome == Outcome.succeeded, r.detail
    assert "stays cordoned" in r.detail and second.incident_id in r.detail
    n = get_node(kube, node)
    assert n["spec"]["unschedulable"] is True and len(ours(n)) == 1
    assert set(json.loads(n["metadata"]["annotations"][CORDON_ANNOTATION])["incidents"]) == {second.incident_id}

    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=second.incident_id)))
    assert r.outcome == Outcome.succeeded and "uncordoned" in r.detail, r.detail
    n = get_node(kube, node)
    assert not n["spec"].get("unschedulable") and ours(n) == []
    assert CORDON_ANNOTATION not in (n["metadata"].get("annotations") or {})


def test_a_cordon_annotated_in_the_single_incident_format_is_still_understood(kube, executor, keys):
    """The annotation as earlier versions wrote it ({"incident": ...}): that incident holds the cordon."""
    key, _ = keys
    node = make_node(kube, "legacy")
    old_incident = "inc-legacy"
    old = {"incident": old_incident, "command": "c-old", "gpu": "GPU-1", "at": "2026-11-30T00:00:00Z",
           "was_unschedulable": False}
    status, body = kube.request("PATCH", f"/api/v1/nodes/{node}", {
        "spec": {"unschedulable": True, "taints": [{"key": TAINT_KEY, "value": "GPU-1", "effect": "NoSchedule"}]},
        "metadata": {"annotations": {CORDON_ANNOTATION: json.dumps(old)}}}, content_type="application/merge-patch+json")
    assert status == 200, body
    second = key.sign(command(node, "CORDON_NODE"))
    assert executor.handle(second).outcome == Outcome.succeeded
    note = json.loads(get_node(kube, node)["metadata"]["annotations"][CORDON_ANNOTATION])
    assert set(note["incidents"]) == {old_incident, second.incident_id}

    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=second.incident_id)))
    assert r.outcome == Outcome.succeeded and old_incident in r.detail, r.detail
    assert get_node(kube, node)["spec"]["unschedulable"] is True
    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=old_incident)))
    assert r.outcome == Outcome.succeeded, r.detail
    n = get_node(kube, node)
    assert not n["spec"].get("unschedulable") and ours(n) == []


# -- drain ----------------------------------------------------------------------------------------------
def test_drain_evicts_workloads_and_keeps_the_daemonset_pod(kube, executor, keys, ns):
    key, _ = keys
    node = make_node(kube, "drain")
    make_pod(kube, ns, f"train-{RUN}", node)
    make_pod(kube, ns, f"infer-{RUN}", node)
    make_pod(kube, ns, f"collector-{RUN}", node, daemonset=True)
    cordon(kube, executor, key, node)
    r = executor.handle(key.sign(command(node, "DRAIN_NODE")))
    assert r.outcome == Outcome.succeeded, r.detail
    assert f"{ns}/train-{RUN}" in r.detail and f"kept 1 DaemonSet/mirror pod(s): {ns}/collector-{RUN}" in r.detail
    for name, gone in ((f"train-{RUN}", True), (f"infer-{RUN}", True), (f"collector-{RUN}", False)):
        status, pod = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
        evicted = status == 404 or bool(pod["metadata"].get("deletionTimestamp"))  # no kubelet finishes it
        assert evicted is gone, (name, status)
    assert "XidstreamDrain" in [e["reason"] for e in node_events(kube, node)]


def test_drain_keeps_the_pods_of_a_kept_namespace_and_the_reset_precondition_ignores_them(kube, keys, ns, tmp_path):
    """The chart runs its processor and cluster executor with --drain-keep-namespace <release ns>:
    on the real node of `make e2e` the executor evicted both, itself mid-drain, and on a one-node
    cluster they stayed Pending behind the cordon (nothing finished the incident)."""
    from xidstream.executors.node import NodeActions

    key, verify = keys
    own = f"xs-own-{RUN}"
    kube.ensure_namespace(own)
    actions = ClusterActions(make_client(kube.kubeconfig), drain_timeout=3.0, eviction_retry=0.5,
                             keep_namespaces=(own,))
    executor = Executor(scope="cluster", keys=verify, actions=actions, state_dir=tmp_path / "state", apply=True)
    node = make_node(kube, "keepns")
    make_pod(kube, ns, f"job-{RUN}", node)
    make_pod(kube, own, f"processor-{RUN}", node)
    # a GPU workload in the kept namespace (a release installed into a shared one) is not shielded
    status, body = kube.request("POST", f"/api/v1/namespaces/{own}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"tenant-gpu-{RUN}"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
    assert status == 201, body
    kube.mark_pod_running_ready(own, f"tenant-gpu-{RUN}")
    cordon(kube, executor, key, node)
    r = executor.handle(key.sign(command(node, "DRAIN_NODE")))
    assert r.outcome == Outcome.succeeded, r.detail
    assert r.detail.startswith(f"drained node {node}: evicted 2 pod(s): {ns}/job-{RUN}, {own}/tenant-gpu-{RUN}; "), \
        r.detail
    assert r.detail.endswith(f"; kept 1 pod(s) of namespace(s) {own} (--drain-keep-namespace): {own}/processor-{RUN}")
    status, pod = kube.request("GET", f"/api/v1/namespaces/{own}/pods/processor-{RUN}")
    assert status == 200 and not pod["metadata"].get("deletionTimestamp")
    for n, name in ((ns, f"job-{RUN}"), (own, f"tenant-gpu-{RUN}")):  # the kubelet's part
        kube.request("DELETE", f"/api/v1/namespaces/{n}/pods/{name}?gracePeriodSeconds=0")
    client = make_client(kube.kubeconfig)
    assert NodeActions(client, node, None, keep_namespaces=(own,))._node_not_ready() == []
    assert NodeActions(client, node, None)._node_not_ready() == ["not drained"]  # without it: the pod counts


def test_drain_blocked_by_a_pdb_fails_naming_the_pods_and_forces_nothing(kube, executor, keys, ns):
    key, _ = keys
    node = make_node(kube, "pdb")
    app = f"guarded-{RUN}"
    make_pod(kube, ns, app, node, labels={"app": app})
    make_pod(kube, ns, f"free-{RUN}", node)
    status, body = kube.request("POST", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": app},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}}})
    assert status == 201, body
    kube.set_pdb_status(ns, app, disruptions_allowed=0, current_healthy=1, desired_healthy=1, expected_pods=1)
    cordon(kube, executor, key, node)
    r = executor.handle(key.sign(command(node, "DRAIN_NODE")))
    assert r.outcome == Outcome.failed, r.detail
    assert f"{ns}/{app}" in r.detail and "disruption budget" in r.detail and "never forced" in r.detail
    status, pod = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/{app}")
    assert status == 200 and not pod["metadata"].get("deletionTimestamp")  # still running
    status, pod = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/free-{RUN}")
    assert status == 404 or pod["metadata"].get("deletionTimestamp")  # the unguarded one went


def test_drain_of_a_schedulable_node_fails_its_precondition_and_touches_nothing(kube, executor, keys, ns):
    key, _ = keys
    node = make_node(kube, "nocordon")
    make_pod(kube, ns, f"busy-{RUN}", node)
    before = snapshot(kube, node, ns)
    r = executor.handle(key.sign(command(node, "DRAIN_NODE")))
    assert r.outcome == Outcome.failed and "not cordoned" in r.detail
    assert snapshot(kube, node, ns) == before


# -- quarantine / release -----------------------------------------------------------------------------
def test_quarantine_creates_a_device_taint_rule_for_one_gpu_and_release_deletes_it(kube, executor, keys):
    key, _ = keys
    node = make_node(kube, "dtr")
    cmd = key.sign(command(node, "QUARANTINE_GPU", gpu_index=1))
    r = executor.handle(cmd)
    assert r.outcome == Outcome.succeeded, r.detail
    assert "resource.k8s.io/v1alpha3" in r.detail  # the version this server serves, found by discovery
    name = quarantine_rule_name(node, cmd.gpu_uuid)
    status, rule = kube.request("GET", f"/apis/resource.k8s.io/v1alpha3/devicetaintrules/{name}")
    assert status == 200, rule
    assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-1"}
    assert rule["spec"]["taint"]["effect"] == "NoSchedule" and rule["spec"]["taint"]["value"] == cmd.gpu_uuid
    # one GPU: nothing node-wide changed
    n = get_node(kube, node)
    assert not n["spec"].get("unschedulable") and ours(n) == []
    assert "XidstreamGpuQuarantine" in [e["reason"] for e in node_events(kube, node)]

    r = executor.handle(key.sign(command(node, "RELEASE_GPU", gpu_index=1, incident_id=cmd.incident_id)))
    assert r.outcome == Outcome.succeeded and "deleted DeviceTaintRule" in r.detail
    status, _ = kube.request("GET", f"/apis/resource.k8s.io/v1alpha3/devicetaintrules/{name}")
    assert status == 404


def test_replace_node_labels_it_and_records_an_event(kube, executor, keys):
    key, _ = keys
    node = make_node(kube, "replace")
    r = executor.handle(key.sign(command(node, "REPLACE_NODE")))
    assert r.outcome == Outcome.succeeded, r.detail
    assert get_node(kube, node)["metadata"]["labels"]["xidstream.io/replace"] == "true"
    assert "XidstreamReplaceNode" in [e["reason"] for e in node_events(kube, node)]


# -- refusals change nothing --------------------------------------------------------------------------
def test_forged_expired_unapproved_misrouted_and_duplicate_commands_change_nothing(kube, executor, keys, ns, tmp_path):
    key, _ = keys
    node = make_node(kube, "refuse")
    make_pod(kube, ns, f"job-{RUN}", node)
    intruder, _, _, _ = keypair(tmp_path, "intruder")
    forged = key.sign(command(node, "CORDON_NODE")).model_copy(update={"incident_id": "inc-other"})
    cases = {
        "unsigned": (command(node, "CORDON_NODE"), Outcome.refused, "unsigned"),
        "forged": (forged, Outcome.refused, "forged or altered"),
        "unknown key": (intruder.sign(command(node, "DRAIN_NODE")), Outcome.refused, "unknown key"),
        "expired": (key.sign(command(node, "CORDON_NODE", ttl=-1)), Outcome.expired, "expired at"),
        "unapproved": (key.sign(command(node, "CORDON_NODE", requires_approval=True)), Outcome.refused,
                       "requires approval"),
        "node action at cluster scope": (key.sign(command(node, "RESET_GPU")), Outcome.refused,
                                         "does not carry out RESET_GPU"),
    }
    before = snapshot(kube, node, ns)
    for label, (cmd, outcome, words) in cases.items():
        r = executor.handle(cmd)
        assert r.outcome == outcome and words in r.detail, (label, r.detail)
        assert snapshot(kube, node, ns) == before, label

    # duplicate: carried out once, answered from the journal after an uncordon by hand
    cmd = key.sign(command(node, "CORDON_NODE"))
    assert executor.handle(cmd).outcome == Outcome.succeeded
    kube.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": None}},
                 content_type="application/merge-patch+json")
    after_manual = snapshot(kube, node, ns)
    r = executor.handle(cmd)
    assert r.outcome == Outcome.succeeded and r.detail.startswith("already carried out (journal)")
    assert snapshot(kube, node, ns) == after_manual  # not cordoned again


def test_an_approval_releases_a_held_command(kube, keys, tmp_path):
    key, verify = keys
    ops, ops_verify, _, _ = keypair(tmp_path, "ops")  # an approver's own key: the processor's approves nothing
    executor = Executor(scope="cluster", keys=verify, approval_keys=ops_verify, apply=True, state_dir=tmp_path / "state",
                        actions=ClusterActions(make_client(kube.kubeconfig), drain_timeout=3.0, eviction_retry=0.5))
    node = make_node(kube, "held")
    cmd = key.sign(command(node, "CORDON_NODE", requires_approval=True))
    before = snapshot(kube, node)
    assert executor.handle(cmd, hold=True) is None  # held, nothing done
    assert executor.due() == [] and snapshot(kube, node) == before
    assert executor.approve(approval(key, cmd)) is not None  # the processor's own key: refused
    assert executor.due() == [] and snapshot(kube, node) == before
    executor.approve(approval(ops, cmd))
    [r] = executor.due()
    assert r.outcome == Outcome.succeeded and r.command_id == cmd.command_id, r.detail
    assert get_node(kube, node)["spec"]["unschedulable"] is True


def test_dry_run_describes_and_writes_nothing(kube, keys, tmp_path, ns):
    key, verify = keys
    node = make_node(kube, "dry")
    make_pod(kube, ns, f"dry-{RUN}", node)
    ex = Executor(scope="cluster", keys=verify, actions=ClusterActions(make_client(kube.kubeconfig)),
                  state_dir=tmp_path / "dry")  # no apply
    before = snapshot(kube, node, ns)
    for action in ("CORDON_NODE", "QUARANTINE_GPU", "REPLACE_NODE", "UNCORDON_NODE"):
        r = ex.handle(key.sign(command(node, action)))
        assert r.outcome == Outcome.refused and r.detail.startswith("dry run: would "), (action, r.detail)
    assert snapshot(kube, node, ns) == before


def test_quarantine_is_advisory_where_device_taints_are_not_served(kube, executor, keys):
    """What discovery answers on a server without DRA device taints (None): a node label and an
    Event naming the GPU, and the result says the quarantine is advisory."""
    key, _ = keys
    executor.actions._dtr_version = None  # as discover_version returns when no version serves it
    node = make_node(kube, "advisory")
    r = executor.handle(key.sign(command(node, "QUARANTINE_GPU", gpu_index=3)))
    assert r.outcome == Outcome.succeeded and r.detail.startswith("quarantine is advisory"), r.detail
    assert "gpu-quarantine.xidstream.io/gpu-3" in get_node(kube, node)["metadata"]["labels"]
    [ev] = [e for e in node_events(kube, node) if e["reason"] == "XidstreamGpuQuarantine"]
    assert "GPU-8d2e4b7a" in ev["message"]
    r = executor.handle(key.sign(command(node, "RELEASE_GPU", gpu_index=3)))
    assert r.outcome == Outcome.succeeded and "removed label" in r.detail
    assert "gpu-quarantine.xidstream.io/gpu-3" not in get_node(kube, node)["metadata"]["labels"]


# -- the GPUHealthy Node condition --------------------------------------------------------------------
def condition(kube, node: str) -> dict | None:
    return next((c for c in get_node(kube, node)["status"].get("conditions") or [] if c["type"] == CONDITION_TYPE), None)


def test_gpu_healthy_condition_is_false_while_any_incident_holds_it_and_true_after_the_last_closes(kube, executor, keys):
    """node-problem-detector's convention: `kubectl get/describe node` shows the GPU's state. A
    wedge's cordon and another GPU's quarantine both hold it; it turns True only when both closed."""
    key, _ = keys
    node = make_node(kube, "cond")
    assert condition(kube, node) is None  # nothing written before an incident
    wedge = key.sign(command(node, "CORDON_NODE", gpu_index=1, reason="GPU 1 wedged after Xid 43"))
    r = executor.handle(wedge)
    assert r.outcome == Outcome.succeeded and "condition GPUHealthy=False (GPUFaultCordonedNode)" in r.detail, r.detail
    c = condition(kube, node)
    assert (c["status"], c["reason"]) == ("False", "GPUFaultCordonedNode")
    assert wedge.incident_id in c["message"] and "GPU 1" in c["message"] and "wedged after Xid 43" in c["message"]
    first_transition = c["lastTransitionTime"]

    other = key.sign(command(node, "QUARANTINE_GPU", gpu_index=3, gpu_uuid="GPU-33333333-0000-4000-8000-000000000003",
                             reason="2 different processes faulted it"))
    assert executor.handle(other).outcome == Outcome.succeeded
    c = condition(kube, node)
    assert (c["status"], c["reason"]) == ("False", "GPUFaultCordonedNode")  # the strongest holder names it
    assert wedge.incident_id in c["message"] and other.incident_id in c["message"]
    assert c["lastTransitionTime"] == first_transition  # the status did not move
    held = json.loads(get_node(kube, node)["metadata"]["annotations"][CONDITION_ANNOTATION])
    assert set(held) == {wedge.incident_id, other.incident_id}

    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", gpu_index=1, incident_id=wedge.incident_id)))
    assert r.outcome == Outcome.succeeded, r.detail
    c = condition(kube, node)
    assert (c["status"], c["reason"]) == ("False", "GPUQuarantined")
    assert wedge.incident_id not in c["message"] and other.incident_id in c["message"]

    r = executor.handle(key.sign(command(node, "RELEASE_GPU", gpu_index=3, gpu_uuid=other.gpu_uuid,
                                         incident_id=other.incident_id)))
    assert r.outcome == Outcome.succeeded, r.detail
    c = condition(kube, node)
    assert (c["status"], c["reason"]) == ("True", "NoOpenGPUIncident")
    assert CONDITION_ANNOTATION not in (get_node(kube, node)["metadata"].get("annotations") or {})


def test_a_record_or_a_refused_command_leaves_the_condition_alone(kube, executor, keys):
    key, _ = keys
    node = make_node(kube, "condrec")
    assert executor.handle(key.sign(command(node, "RECORD"))).outcome == Outcome.succeeded
    # a closing step of an incident that never held the condition writes none
    assert executor.handle(key.sign(command(node, "RELEASE_GPU", gpu_index=1))).outcome == Outcome.succeeded
    assert condition(kube, node) is None


def test_a_refused_closing_step_still_takes_its_incidents_hold_off_the_condition(kube, executor, keys):
    """Found by review: the closing step is the processor saying the incident resolved; when the
    UNCORDON is refused (someone else took the cordon over), the incident's hold on GPUHealthy must
    go too, or the condition stays False for good."""
    key, _ = keys
    node = make_node(kube, "condref")
    cmd = key.sign(command(node, "CORDON_NODE"))
    assert executor.handle(cmd).outcome == Outcome.succeeded
    assert condition(kube, node)["status"] == "False"
    n = get_node(kube, node)  # an operator replaces our cordon with their own
    status, body = kube.request("PATCH", f"/api/v1/nodes/{node}", {
        "metadata": {"annotations": {CORDON_ANNOTATION: None}},
        "spec": {"taints": [t for t in n["spec"].get("taints") or [] if t["key"] != TAINT_KEY]}},
        content_type="application/merge-patch+json")
    assert status == 200, body
    r = executor.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=cmd.incident_id)))
    assert r.outcome == Outcome.refused and "cordoned by someone else" in r.detail, r.detail
    assert get_node(kube, node)["spec"]["unschedulable"] is True  # their cordon stays
    c = condition(kube, node)
    assert (c["status"], c["reason"]) == ("True", "NoOpenGPUIncident"), c
