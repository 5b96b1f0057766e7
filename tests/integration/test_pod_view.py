"""The pod view on the real API server (the `kube` fixture), with the chart's own RBAC: the cluster
executor's service account runs the view (its ClusterRole as rendered), the node pods' service
account asks it with pod-bound tokens of the view's audience (its ClusterRole as rendered: no pod
read at all). Node A's token is answered node A's pods only; every other token is refused with its
reason; the node executor's drained check and the collector's workload events work through it; a
view that cannot answer is never taken for "drained"."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import yaml

from xidstream.executors.kube import make_client, pods_on_node
from xidstream.executors.node import NodeActions
from xidstream.executors.podview import PodIndex, PodViewServer, PodWatch, TokenCheck, review_with
from xidstream.executors.runner import Executor
from xidstream.schemas.vocab import Outcome
from tests.deploy.test_helm_chart import by_kind, helm, render  # noqa: F401 - helm is a fixture
from tests.executors.helpers import command, keypair
from xidstream.transport.podview import AUDIENCE, PodViewClient, PodViewError

pytestmark = pytest.mark.kube

RUN = uuid.uuid4().hex[:6]


def _ok(result, *codes):
    status, body = result
    assert status in (codes or (200, 201)), body
    return body


def _kubeconfig(kube, token: str, path: Path) -> Path:
    """A kubeconfig that authenticates with `token` (a service account's, so its RBAC applies)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": kube.server, "certificate-authority": str(kube.ca_file)}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return path


class Cluster:
    """Two GPU nodes, the chart's two service accounts with their rendered ClusterRoles, a node pod
    of the node service account on each node, a tenant namespace with pods on both, and the view."""

    def __init__(self, kube, helm, tmp: Path) -> None:
        self.kube = kube
        self.ns, self.tenants, release = f"xs-pv-{RUN}", f"tenants-pv-{RUN}", f"pv{RUN}"
        for n in (self.ns, self.tenants):
            kube.ensure_namespace(n)
        kinds = by_kind(render(helm, namespace=self.ns, release=release)[0])
        self.node_sa, cx_sa = f"{release}-xidstream-node", f"{release}-xidstream-cluster-executor"
        for sa in (self.node_sa, cx_sa, "intruder"):
            _ok(kube.request("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts",
                             {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}}))
        for name in (self.node_sa, cx_sa, f"{release}-xidstream-events"):
            _ok(kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", kinds["ClusterRole"][name]))
        for name in (self.node_sa, cx_sa):
            _ok(kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
                             kinds["ClusterRoleBinding"][name]))
        for name, rb in kinds["RoleBinding"].items():
            _ok(kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings", rb))
        self.rules = kinds["ClusterRole"][self.node_sa]["rules"]
        self.a, self.b = f"pv-{RUN}-a", f"pv-{RUN}-b"
        for n in (self.a, self.b):
            _ok(kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": n, "labels": {"nvidia.com/gpu.present": "true"}}}))
        self.node_pod = {n: self.pod(self.ns, f"node-{n}", n, sa=self.node_sa) for n in (self.a, self.b)}
        self.intruder_pod = self.pod(self.ns, "intruder", self.a, sa="intruder")
        self.pod(self.tenants, "train-a", self.a, env=[{"name": "HF_TOKEN", "value": "hf_not_for_other_nodes"}],
                 annotations={"kubectl.kubernetes.io/last-applied-configuration": "{\"spec\": \"HF_TOKEN\"}"})
        self.pod(self.tenants, "train-b", self.b)
        # the cluster executor's own token, under the chart's ClusterRole for it
        cx_token = _ok(kube.request("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/{cx_sa}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}))
        cx_config = _kubeconfig(kube, cx_token["status"]["token"], tmp / "cx.kubeconfig")
        self.index = PodIndex()
        self.watch = PodWatch(make_client(cx_config), self.index)
        self.watch.start()
        self.tokens = TokenCheck(review_with(make_client(cx_config)), f"{self.ns}/{self.node_sa}")
        self.server = PodViewServer(self.index, self.tokens)
        self.url = f"http://127.0.0.1:{self.server.serve(0)}"
        self.tmp = tmp
        self.wait(lambda: self.index.synced)

    def pod(self, ns: str, name: str, node: str, *, sa: str | None = None, env=None, annotations=None) -> dict:
        c: dict = {"name": "main", "image": "registry.k8s.io/pause:3.10"}
        if env:
            c["env"] = env
        meta: dict = {"name": name}
        if annotations:
            meta["annotations"] = annotations
        spec: dict = {"nodeName": node, "containers": [c]}
        if sa:
            spec["serviceAccountName"] = sa
        return _ok(self.kube.request("POST", f"/api/v1/namespaces/{ns}/pods",
                                     {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}))

    def token(self, sa: str, *, pod: dict | None = None, audiences=(AUDIENCE,)) -> str:
        spec: dict = {"expirationSeconds": 3600}
        if audiences:
            spec["audiences"] = list(audiences)
        if pod is not None:  # what the kubelet's projected volume asks for: bound to the pod (and its node)
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        tr = _ok(self.kube.request("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token",
                                   {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}))
        return tr["status"]["token"]

    def client_for(self, token: str, name: str | None = None, url: str | None = None) -> PodViewClient:
        f = self.tmp / f"token-{name or uuid.uuid4().hex[:6]}"
        f.write_text(token)
        return PodViewClient(url or self.url, f, timeout=5.0)

    def node_client(self, node: str) -> PodViewClient:
        return self.client_for(self.token(self.node_sa, pod=self.node_pod[node]), node)

    @staticmethod
    def wait(cond, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            time.sleep(0.1)
        raise AssertionError("not within the time")

    def close(self) -> None:
        self.watch.stop()
        self.server.close()


@pytest.fixture(scope="module")
def cluster(kube, helm, tmp_path_factory):
    c = Cluster(kube, helm, tmp_path_factory.mktemp("podview"))
    yield c
    c.close()


def names(items: list[dict]) -> set[str]:
    return {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in items}


def test_a_node_pod_is_answered_its_own_nodes_pods_and_no_others(cluster):
    c = cluster
    mine = {f"{c.ns}/node-{c.a}", f"{c.ns}/intruder", f"{c.tenants}/train-a"}
    a = c.node_client(c.a)
    assert names(a.dicts(c.a)) == mine
    assert names(c.node_client(c.b).dicts(c.b)) == {f"{c.ns}/node-{c.b}", f"{c.tenants}/train-b"}
    # the node is the API server's word (the token's pod), never the caller's: asking for B with A's token
    with pytest.raises(PodViewError, match=f"answered for node '{c.a}'"):
        a.dicts(c.b)
    # what a node is shown of a tenant's pod: no environment, no annotation but a static pod's mirror
    raw = str(a.dicts(c.a))
    assert "hf_not_for_other_nodes" not in raw and "HF_TOKEN" not in raw and "last-applied" not in raw
    # as lightkube Pods, for the executors
    assert {p.metadata.name for p in a.pods(c.a)} == {f"node-{c.a}", "intruder", "train-a"}


@pytest.mark.parametrize("who, code, words", [
    ("another service account", 403, "may not read the pod view: only the node pods' service account"),
    ("the API's audience", 401, "refused the token for audience xidstream-pod-view"),
    ("no pod", 403, "names no node"),
    ("garbage", 401, "refused the token"),
    ("none", 401, "no bearer token"),
])
def test_every_other_caller_is_refused_with_its_reason(cluster, who, code, words):
    c = cluster
    token = {"another service account": lambda: c.token("intruder", pod=c.intruder_pod),
             "the API's audience": lambda: c.token(c.node_sa, pod=c.node_pod[c.a], audiences=()),
             "no pod": lambda: c.token(c.node_sa),
             "garbage": lambda: "not.a.token",
             "none": lambda: ""}[who]()
    got, body = c.server.answer("/v1/pods", f"Bearer {token}" if token else None)
    assert got == code and words in body.decode(), body
    if token:
        with pytest.raises(PodViewError, match=f"HTTP {code}"):
            c.client_for(token).dicts(c.a)


def test_the_view_follows_the_watch_and_reviews_a_token_once_per_ttl(cluster):
    c = cluster
    a = c.node_client(c.a)
    a.dicts(c.a)
    reviews = c.tokens.reviews
    c.pod(c.tenants, "late-a", c.a)
    c.wait(lambda: f"{c.tenants}/late-a" in names(a.dicts(c.a)))
    _ok(c.kube.request("DELETE", f"/api/v1/namespaces/{c.tenants}/pods/late-a?gracePeriodSeconds=0"))
    c.wait(lambda: f"{c.tenants}/late-a" not in names(a.dicts(c.a)))
    assert c.tokens.reviews == reviews  # every poll of one token since: from the cache


def test_the_node_service_account_may_not_read_pods_on_the_api_server(cluster, tmp_path):
    """The chart's node ClusterRole, on the real API server: no pod list, in any namespace or its
    own node's (the field selector is no grant), no pod get."""
    c = cluster
    token = c.token(c.node_sa, pod=c.node_pod[c.a], audiences=())
    for path in ("/api/v1/pods", f"/api/v1/pods?fieldSelector=spec.nodeName={c.a}",
                 f"/api/v1/namespaces/{c.tenants}/pods/train-a"):
        status, body = c.kube.request("GET", path, token=token)
        assert status == 403, (path, status, body)
    with pytest.raises(Exception, match="403|forbidden"):
        pods_on_node(make_client(_kubeconfig(c.kube, token, tmp_path / "node.kubeconfig")), c.a)


def _reset_detail(c, tmp_path, view: PodViewClient) -> str:
    """A RESET_GPU on node A through the node executor as the chart runs it: the node pods' own
    token for the API (its RBAC), `view` for the pods. No NVML here: the node checks are what is read."""
    tmp_path.mkdir(parents=True)
    token = c.token(c.node_sa, pod=c.node_pod[c.a], audiences=())
    client = make_client(_kubeconfig(c.kube, token, tmp_path / "node.kubeconfig"))
    key, verify, _, _ = keypair(tmp_path)
    actions = NodeActions(client, c.a, None, reboot_sentinel=tmp_path / "run" / "reboot-required",
                          state_dir=tmp_path / "s", precondition_wait=0.5, precondition_poll=0.1,
                          keep_namespaces=(c.ns,), pod_view=view)
    ex = Executor(scope="node", node=c.a, keys=verify, actions=actions, state_dir=tmp_path / "s", apply=True)
    r = ex.handle(key.sign(command(c.a, "RESET_GPU")))
    assert r.outcome == Outcome.refused, r.detail
    return r.detail


def test_the_node_executors_drained_check_reads_the_view_and_cannot_tell_is_not_drained(cluster, tmp_path):
    c = cluster
    _ok(c.kube.request("PATCH", f"/api/v1/nodes/{c.a}", {"spec": {"unschedulable": True}},
                       content_type="application/merge-patch+json"))
    view = c.node_client(c.a)
    detail = _reset_detail(c, tmp_path / "1", view)
    assert f"node {c.a} is not drained: 1 pod(s) still on it: {c.tenants}/train-a" in detail, detail
    # unreachable: waited for, then refused as not known to be drained
    dead = c.client_for(c.token(c.node_sa, pod=c.node_pod[c.a]), url="http://127.0.0.1:9")
    detail = _reset_detail(c, tmp_path / "2", dead)
    assert f"cannot tell whether node {c.a} is drained: pod view http://127.0.0.1:9/v1/pods unreachable" in detail
    assert "waiting 0.5 s for the node to be cordoned and drained" in detail, detail
    # refused by the view (a token of another audience): the same
    wrong = c.client_for(c.token(c.node_sa, pod=c.node_pod[c.a], audiences=()))
    assert "answered HTTP 401" in _reset_detail(c, tmp_path / "3", wrong)
    # a view not yet in step with the API server (listing): 503, not an empty list
    c.index.unsynced()
    try:
        assert "answered HTTP 503" in _reset_detail(c, tmp_path / "4", view)
    finally:
        c.index.synced = True  # the watch kept running meanwhile: its index is whole
    # the tenant's pod evicted: drained, as the view says
    _ok(c.kube.request("DELETE", f"/api/v1/namespaces/{c.tenants}/pods/train-a?gracePeriodSeconds=0"))
    c.wait(lambda: f"{c.tenants}/train-a" not in names(view.dicts(c.a)))
    detail = _reset_detail(c, tmp_path / "5", view)
    assert "drained" not in detail and "no NVML on this executor" in detail, detail


def test_the_collector_makes_workload_events_from_two_consecutive_views(cluster, tmp_path):
    """The collector's PodViewPoller over the real view: a pod's start and failure between two
    polls are events for the GPU the kubelet gave it; a pod deleted between two polls is none."""
    from xidstream.collectors.sources.kubernetes import KubernetesWorkloads, PodResourcesClient, PodViewPoller
    from tests.collectors.test_kubernetes import _serve_pod_resources, _set_container

    c = cluster
    view = c.node_client(c.b)
    grpc_server = _serve_pod_resources(tmp_path / "kubelet.sock", [
        (c.tenants, "vllm-b", [("vllm", "nvidia.com/gpu", ["GPU-bbbb"])]),
        (c.tenants, "gone-b", [("vllm", "nvidia.com/gpu", ["GPU-cccc"])])])
    poller = PodViewPoller(view, c.b, interval=3600)  # polled by hand here
    source = KubernetesWorkloads(poller, PodResourcesClient(str(tmp_path / "kubelet.sock")))
    try:
        c.pod(c.tenants, "gone-b", c.b)
        _set_container(c.kube, c.tenants, "gone-b", {"running": {}})
        c.wait(lambda: f"{c.tenants}/gone-b" in names(view.dicts(c.b)))
        assert poller.poll_once() and source.read() == []  # the first view: joined late, no transition
        c.pod(c.tenants, "vllm-b", c.b)
        _set_container(c.kube, c.tenants, "vllm-b", {"running": {}})
        _ok(c.kube.request("DELETE", f"/api/v1/namespaces/{c.tenants}/pods/gone-b?gracePeriodSeconds=0"))
        c.wait(lambda: f"{c.tenants}/vllm-b" in names(view.dicts(c.b)) and
               f"{c.tenants}/gone-b" not in names(view.dicts(c.b)))
        assert poller.poll_once()
        got = source.read()
        _set_container(c.kube, c.tenants, "vllm-b", {"terminated": {"exitCode": 1, "reason": "Error",
                                                                    "finishedAt": "2026-12-01T00:00:00Z"}})
        c.wait(lambda: any(p["metadata"]["name"] == "vllm-b" and "terminated" in str(p["status"])
                           for p in view.dicts(c.b)))
        assert poller.poll_once()
        got += source.read()
    finally:
        grpc_server.stop(0)
    assert [(e["event"], e["gpu_uuid"], e["pod"], e["exit_code"]) for e in got] == [
        ("started", "GPU-bbbb", "vllm-b", None), ("failed", "GPU-bbbb", "vllm-b", 1)]
