"""REPLACE_NODE's backends (executors/replace.py, --replace-backend) on the real API server, with
the real CRDs: Cluster API's Machine and Karpenter's NodeClaim, as their Go modules ship them
(tests/executors/crds.py fetches them once into ~/.cache/xidstream/crds/).

No Cluster API or Karpenter controller runs: the tests check what xidstream hands over (the
Machine's annotation, the NodeClaim's deletion, the Node condition), the result's outcome and
detail, that a re-delivered command writes nothing twice, and that each backend works with only
the RBAC that docs/operations.md gives it.
"""

from __future__ import annotations

import uuid

import pytest
import yaml

from xidstream.executors.cluster import REPLACE_LABEL, ClusterActions
from xidstream.executors.kube import make_client
from xidstream.executors.replace import REMEDIATE_ANNOTATION, SKIP_REMEDIATION_ANNOTATION
from xidstream.executors.runner import Executor
from xidstream.schemas.vocab import Outcome
from tests.executors.crds import install_crd
from tests.executors.helpers import command, keypair
from tests.integration.test_executors_cluster import condition, get_node, node_events

pytestmark = pytest.mark.kube

RUN = uuid.uuid4().hex[:6]
MACHINES = "machines.cluster.x-k8s.io"
NODECLAIMS = "nodeclaims.karpenter.sh"


@pytest.fixture(scope="module")
def capi(kube):
    """The Machine CRD installed; the namespace its Machines live in."""
    install_crd(kube, MACHINES)
    ns = f"xs-capi-{RUN}"
    kube.ensure_namespace(ns)
    return ns


@pytest.fixture(scope="module")
def karpenter(kube):
    install_crd(kube, NODECLAIMS)


@pytest.fixture
def keys(tmp_path):
    key, verify, _, _ = keypair(tmp_path)
    return key, verify


def executor_for(kube, keys, state, backend: str, kubeconfig=None) -> Executor:
    actions = ClusterActions(make_client(kubeconfig or kube.kubeconfig), replace_backend=backend)
    return Executor(scope="cluster", keys=keys[1], actions=actions, state_dir=state, apply=True)


def make_node(kube, suffix: str, *, annotations: dict | None = None, labels: dict | None = None,
              provider_id: str | None = None) -> str:
    name = f"gpu-{RUN}-{suffix}"
    body = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": annotations or {},
                         "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true", **(labels or {})}}}
    if provider_id:
        body["spec"] = {"providerID": provider_id}
    status, got = kube.request("POST", "/api/v1/nodes", body)
    assert status == 201, got
    return name


def capi_node(kube, ns: str, suffix: str, machine: str) -> str:
    """A Node as Cluster API's Machine controller leaves it: annotations naming its Machine."""
    return make_node(kube, suffix, annotations={"cluster.x-k8s.io/machine": machine,
                                                "cluster.x-k8s.io/cluster-namespace": ns,
                                                "cluster.x-k8s.io/cluster-name": "gpu-cluster"})


def make_machine(kube, ns: str, name: str, node: str | None, *, annotations: dict | None = None) -> dict:
    """A v1beta2 Machine (the storage version of the CRD) whose status.nodeRef names `node`."""
    status, body = kube.request("POST", f"/apis/cluster.x-k8s.io/v1beta2/namespaces/{ns}/machines", {
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": name, "annotations": annotations or {},
                     "labels": {"cluster.x-k8s.io/cluster-name": "gpu-cluster"}},
        "spec": {"clusterName": "gpu-cluster", "bootstrap": {"dataSecretName": f"{name}-bootstrap"},
                 "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "DockerMachine",
                                       "name": name}}})
    assert status == 201, body
    if node:
        status, body = kube.request("PATCH", f"/apis/cluster.x-k8s.io/v1beta2/namespaces/{ns}/machines/{name}/status",
                                    {"status": {"nodeRef": {"name": node}}},
                                    content_type="application/merge-patch+json")
        assert status == 200, body
    return body


def get_machine(kube, ns: str, name: str, version: str = "v1beta2") -> dict:
    status, body = kube.request("GET", f"/apis/cluster.x-k8s.io/{version}/namespaces/{ns}/machines/{name}")
    assert status == 200, body
    return body


def make_nodeclaim(kube, name: str, *, node: str | None = None, provider_id: str | None = None,
                   finalizer: bool = True) -> dict:
    """A NodeClaim as Karpenter leaves it once its node registered; with Karpenter's termination
    finalizer a delete only marks it (deletionTimestamp), as on a real cluster."""
    meta = {"name": name, "labels": {"karpenter.sh/nodepool": "gpu"}}
    if finalizer:
        meta["finalizers"] = ["karpenter.sh/termination"]
    status, body = kube.request("POST", "/apis/karpenter.sh/v1/nodeclaims", {
        "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "metadata": meta,
        "spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                 "requirements": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}]}})
    assert status == 201, body
    st = {k: v for k, v in (("nodeName", node), ("providerID", provider_id)) if v}
    status, body = kube.request("PATCH", f"/apis/karpenter.sh/v1/nodeclaims/{name}/status", {"status": st},
                                content_type="application/merge-patch+json")
    assert status == 200, body
    return body


def release_nodeclaim(kube, name: str) -> None:
    """Karpenter's part once the node is gone: drop the finalizer (and so the claim)."""
    kube.request("PATCH", f"/apis/karpenter.sh/v1/nodeclaims/{name}", {"metadata": {"finalizers": None}},
                 content_type="application/merge-patch+json")


# -- Cluster API ---------------------------------------------------------------------------------------
def test_cluster_api_annotates_the_nodes_machine_once(kube, capi, keys, tmp_path):
    key, _ = keys
    machine = f"gpu-md-{RUN}-a"
    node = capi_node(kube, capi, "capi", machine)
    make_machine(kube, capi, machine, node)
    ex = executor_for(kube, keys, tmp_path / "state", "cluster-api")
    cmd = key.sign(command(node, "REPLACE_NODE"))
    r = ex.handle(cmd)
    assert r.outcome == Outcome.succeeded, r.detail
    # the version found by discovery: the CRD serves v1beta1 and v1beta2, v1beta2 preferred
    assert r.detail.startswith(f"annotated Machine {capi}/{machine} (cluster.x-k8s.io/v1beta2) of node {node} "
                               f"with {REMEDIATE_ANNOTATION}"), r.detail
    m = get_machine(kube, capi, machine)
    assert m["metadata"]["annotations"][REMEDIATE_ANNOTATION] == ""
    assert cmd.incident_id in m["metadata"]["annotations"]["xidstream.io/replace-reason"]
    # the same annotation through the older version (no conversion webhook: metadata is shared)
    assert REMEDIATE_ANNOTATION in get_machine(kube, capi, machine, "v1beta1")["metadata"]["annotations"]
    n = get_node(kube, node)
    assert REPLACE_LABEL not in n["metadata"]["labels"]  # the label is the label backend's
    assert [e["reason"] for e in node_events(kube, node)] == ["XidstreamReplaceNode"]
    assert (condition(kube, node)["status"], condition(kube, node)["reason"]) == ("False", "GPUFaultReplaceNode")

    rv = m["metadata"]["resourceVersion"]
    r = ex.handle(cmd)  # re-delivered: the journal answers
    assert r.outcome == Outcome.succeeded and r.detail.startswith("already carried out (journal)"), r.detail
    # the journal lost (a new pod on an emptyDir) and the processor sending the rung again: found done
    again = executor_for(kube, keys, tmp_path / "fresh", "cluster-api").handle(
        key.sign(command(node, "REPLACE_NODE", incident_id=cmd.incident_id)))
    assert again.outcome == Outcome.succeeded and "already carries" in again.detail, again.detail
    assert get_machine(kube, capi, machine)["metadata"]["resourceVersion"] == rv
    assert len(node_events(kube, node)) == 1


def test_cluster_api_says_what_is_missing_and_writes_nothing(kube, capi, keys, tmp_path):
    key, _ = keys
    ex = executor_for(kube, keys, tmp_path / "state", "cluster-api")

    def refused_or_failed(node: str, outcome: Outcome, *words: str) -> None:
        before = get_node(kube, node)["metadata"]["resourceVersion"]
        r = ex.handle(key.sign(command(node, "REPLACE_NODE")))
        assert r.outcome == outcome, r.detail
        for w in (*words, "nothing was done"):
            assert w in r.detail, (w, r.detail)
        assert get_node(kube, node)["metadata"]["resourceVersion"] == before and node_events(kube, node) == []

    plain = make_node(kube, "noanno")
    refused_or_failed(plain, Outcome.failed, "has no annotation cluster.x-k8s.io/machine and "
                                             "cluster.x-k8s.io/cluster-namespace", "--replace-backend")
    gone = capi_node(kube, capi, "nomachine", f"gone-{RUN}")
    refused_or_failed(gone, Outcome.failed, f"Machine {capi}/gone-{RUN}", "does not exist", "--replace-kubeconfig")

    # a node whose annotation names another node's Machine (a kubelet can write its own annotations)
    other = f"cp-{RUN}"
    make_machine(kube, capi, other, "kube-control-plane-1")
    liar = capi_node(kube, capi, "liar", other)
    refused_or_failed(liar, Outcome.refused, "names node kube-control-plane-1 in status.nodeRef", f"not node {liar}")
    assert REMEDIATE_ANNOTATION not in (get_machine(kube, capi, other)["metadata"].get("annotations") or {})

    paused = f"paused-{RUN}"
    node = capi_node(kube, capi, "paused", paused)
    make_machine(kube, capi, paused, node, annotations={SKIP_REMEDIATION_ANNOTATION: ""})
    refused_or_failed(node, Outcome.refused, SKIP_REMEDIATION_ANNOTATION)
    assert REMEDIATE_ANNOTATION not in get_machine(kube, capi, paused)["metadata"]["annotations"]


def test_cluster_api_dry_run_describes_and_writes_nothing(kube, capi, keys, tmp_path):
    key, verify = keys
    machine = f"dry-{RUN}"
    node = capi_node(kube, capi, "capidry", machine)
    rv = make_machine(kube, capi, machine, node)["metadata"]["resourceVersion"]
    ex = Executor(scope="cluster", keys=verify, state_dir=tmp_path / "dry",
                  actions=ClusterActions(make_client(kube.kubeconfig), replace_backend="cluster-api"))
    r = ex.handle(key.sign(command(node, "REPLACE_NODE")))
    assert r.outcome == Outcome.refused and r.detail.startswith(
        f"dry run: would annotate Machine {capi}/{machine}"), r.detail
    assert get_machine(kube, capi, machine)["metadata"]["resourceVersion"] == rv and node_events(kube, node) == []


# -- Karpenter -----------------------------------------------------------------------------------------
def test_karpenter_deletes_the_nodes_nodeclaim_once(kube, karpenter, keys, tmp_path):
    key, _ = keys
    node = make_node(kube, "karp", labels={"karpenter.sh/nodepool": "gpu"})
    claim, bystander = f"gpu-{RUN}-a", f"gpu-{RUN}-b"
    make_nodeclaim(kube, claim, node=node)
    make_nodeclaim(kube, bystander, node=f"{node}-other")
    ex = executor_for(kube, keys, tmp_path / "state", "karpenter")
    cmd = key.sign(command(node, "REPLACE_NODE"))
    r = ex.handle(cmd)
    assert r.outcome == Outcome.succeeded, r.detail
    assert r.detail.startswith(f"deleted NodeClaim {claim} (karpenter.sh/v1) of node {node}"), r.detail
    status, got = kube.request("GET", f"/apis/karpenter.sh/v1/nodeclaims/{claim}")
    assert status == 200 and got["metadata"]["deletionTimestamp"]  # Karpenter's finalizer holds it, as live
    status, other = kube.request("GET", f"/apis/karpenter.sh/v1/nodeclaims/{bystander}")
    assert status == 200 and not other["metadata"].get("deletionTimestamp")
    assert [e["reason"] for e in node_events(kube, node)] == ["XidstreamReplaceNode"]

    again = executor_for(kube, keys, tmp_path / "fresh", "karpenter").handle(
        key.sign(command(node, "REPLACE_NODE", incident_id=cmd.incident_id)))
    assert again.outcome == Outcome.succeeded and "already being deleted" in again.detail, again.detail
    status, still = kube.request("GET", f"/apis/karpenter.sh/v1/nodeclaims/{claim}")
    assert still["metadata"]["resourceVersion"] == got["metadata"]["resourceVersion"]
    assert len(node_events(kube, node)) == 1
    for name in (claim, bystander):
        release_nodeclaim(kube, name)
        kube.request("DELETE", f"/apis/karpenter.sh/v1/nodeclaims/{name}")


def test_karpenter_finds_the_nodeclaim_by_provider_id(kube, karpenter, keys, tmp_path):
    """A NodeClaim launched but whose status.nodeName is not written yet: Karpenter itself relates
    a Node and its NodeClaim through the provider ID."""
    key, _ = keys
    pid = f"aws:///us-east-1a/i-{RUN}0123"
    node = make_node(kube, "karpid", labels={"karpenter.sh/nodepool": "gpu"}, provider_id=pid)
    claim = f"gpu-{RUN}-pid"
    make_nodeclaim(kube, claim, provider_id=pid, finalizer=False)
    r = executor_for(kube, keys, tmp_path / "state", "karpenter").handle(key.sign(command(node, "REPLACE_NODE")))
    assert r.outcome == Outcome.succeeded and f"NodeClaim {claim}" in r.detail, r.detail
    assert kube.request("GET", f"/apis/karpenter.sh/v1/nodeclaims/{claim}")[0] == 404


def test_karpenter_without_a_nodeclaim_fails_saying_so(kube, karpenter, keys, tmp_path):
    key, _ = keys
    ex = executor_for(kube, keys, tmp_path / "state", "karpenter")
    for suffix, labels, words in (
            ("karpnone", {}, "the node has no karpenter.sh/nodepool label"),
            ("karplost", {"karpenter.sh/nodepool": "gpu"}, "has the label karpenter.sh/nodepool=gpu")):
        node = make_node(kube, suffix, labels=labels)
        before = get_node(kube, node)["metadata"]["resourceVersion"]
        r = ex.handle(key.sign(command(node, "REPLACE_NODE")))
        assert r.outcome == Outcome.failed, r.detail
        assert f"no NodeClaim (karpenter.sh/v1) has status.nodeName {node}" in r.detail and words in r.detail, r.detail
        assert r.detail.endswith("nothing was done")
        assert get_node(kube, node)["metadata"]["resourceVersion"] == before and node_events(kube, node) == []


# -- the Node condition --------------------------------------------------------------------------------
def test_condition_backend_sets_gpu_healthy_false_replacement_requested_once(kube, keys, tmp_path):
    key, _ = keys
    node = make_node(kube, "cond")
    ex = executor_for(kube, keys, tmp_path / "state", "condition")
    cmd = key.sign(command(node, "REPLACE_NODE"))
    r = ex.handle(cmd)
    assert r.outcome == Outcome.succeeded and "ReplacementRequested" in r.detail, r.detail
    c = condition(kube, node)
    assert (c["status"], c["reason"]) == ("False", "ReplacementRequested") and cmd.incident_id in c["message"]
    # the condition a type-and-status consumer (MachineHealthCheck, NodeHealthCheck) is pointed at
    asks = replacement(kube, node)
    assert (asks["status"], asks["reason"]) == ("True", "ReplacementRequested") and cmd.incident_id in asks["message"]
    n = get_node(kube, node)
    assert REPLACE_LABEL not in n["metadata"]["labels"]
    assert [e["reason"] for e in node_events(kube, node)] == ["XidstreamReplaceNode"]
    again = executor_for(kube, keys, tmp_path / "fresh", "condition").handle(
        key.sign(command(node, "REPLACE_NODE", incident_id=cmd.incident_id)))
    assert again.outcome == Outcome.succeeded and "already says ReplacementRequested" in again.detail, again.detail
    assert get_node(kube, node)["metadata"]["resourceVersion"] == n["metadata"]["resourceVersion"]

    # the incident's closing step takes the request back with the rest of its hold
    r = ex.handle(key.sign(command(node, "UNCORDON_NODE", incident_id=cmd.incident_id)))
    assert condition(kube, node)["status"] == "True", r.detail
    assert replacement(kube, node)["status"] == "False", r.detail


def replacement(kube, node: str) -> dict | None:
    return next((c for c in get_node(kube, node)["status"].get("conditions") or []
                 if c["type"] == "GPUReplacementRequired"), None)


def test_label_backend_is_the_default(kube, keys, tmp_path):
    assert ClusterActions(make_client(kube.kubeconfig)).replace_backend == "label"


# -- each backend with only the RBAC the docs give it ----------------------------------------------------
BASE_RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
              {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
              {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
BACKEND_RULES = {
    "cluster-api": [{"apiGroups": ["cluster.x-k8s.io"], "resources": ["machines"], "verbs": ["get", "patch"]}],
    "karpenter": [{"apiGroups": ["karpenter.sh"], "resources": ["nodeclaims"], "verbs": ["list", "delete"]}],
}


def kubeconfig_as(kube, tmp_path, backend: str, rules: list[dict]) -> str:
    """A kubeconfig whose token is a service account's bound to exactly `rules`."""
    ns, sa = f"xs-rbac-{RUN}", f"cx-{backend}"
    kube.ensure_namespace(ns)
    assert kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})[0] == 201
    name = f"xs-rbac-{RUN}-{backend}"
    assert kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
        "rules": rules})[0] == 201
    assert kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})[0] == 201
    status, tr = kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}})
    assert status == 201, tr
    cfg = yaml.safe_load(kube.kubeconfig.read_text())
    for user in cfg["users"]:
        user["user"] = {"token": tr["status"]["token"]}
    path = tmp_path / f"kubeconfig-{backend}"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("backend", ["cluster-api", "karpenter", "condition"])
def test_each_backend_works_with_only_its_documented_rbac(kube, capi, karpenter, keys, tmp_path, backend):
    key, _ = keys
    if backend == "cluster-api":
        machine = f"rbac-{RUN}"
        node = capi_node(kube, capi, "rbac-capi", machine)
        make_machine(kube, capi, machine, node)
    else:
        node = make_node(kube, f"rbac-{backend}")
        if backend == "karpenter":
            make_nodeclaim(kube, f"rbac-{RUN}", node=node, finalizer=False)
    cfg = kubeconfig_as(kube, tmp_path, backend, BASE_RULES + BACKEND_RULES.get(backend, []))
    r = executor_for(kube, keys, tmp_path / "state", backend, kubeconfig=cfg).handle(
        key.sign(command(node, "REPLACE_NODE")))
    assert r.outcome == Outcome.succeeded and "not updated" not in r.detail, r.detail
    assert [e["reason"] for e in node_events(kube, node)] == ["XidstreamReplaceNode"]  # the Event went through

    if backend in BACKEND_RULES:  # without its backend rules: a failed result naming the missing grant
        other = (capi_node(kube, capi, "norbac-capi", machine) if backend == "cluster-api"
                 else make_node(kube, f"norbac-{backend}"))
        cfg = kubeconfig_as(kube, tmp_path, f"{backend}-bare", BASE_RULES)
        r = executor_for(kube, keys, tmp_path / "bare", backend, kubeconfig=cfg).handle(
            key.sign(command(other, "REPLACE_NODE")))
        assert r.outcome == Outcome.failed and "HTTP 403" in r.detail and "service account needs" in r.detail, r.detail
