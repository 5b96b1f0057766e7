"""The local Kubernetes API server (xidstream/localkube.py): a real kube-apiserver on a real etcd.

Everything the executors will do is tried here on the `kube` fixture (started once per run,
stopped at the end; XIDSTREAM_KUBECONFIG points it at another cluster): nodes, pods bound by
nodeName and made Running/Ready through the status subresource, the Eviction API refusing what a
PodDisruptionBudget protects, DeviceTaintRule (resource.k8s.io/v1alpha3), authentication and RBAC.

No Kubernetes client library is a dependency yet (the executor work picks one), so these tests
speak plain HTTPS through `KubeHandle.request` (urllib + ssl, the kubeconfig's CA and token).
"""

from __future__ import annotations

import os
import shutil
import ssl
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from workshop.localkube import KubeHandle, LocalKube, LocalKubeError

pytestmark = pytest.mark.kube

RUN = uuid.uuid4().hex[:8]
LOCAL_ONLY = pytest.mark.skipif(bool(os.environ.get("XIDSTREAM_KUBECONFIG")),
                                reason="XIDSTREAM_KUBECONFIG: not provisioning a local server")


@pytest.fixture(scope="module")
def ns(kube: KubeHandle) -> str:
    name = f"xs-kube-{RUN}"
    kube.ensure_namespace(name)  # + its `default` ServiceAccount: no controller-manager makes it
    return name


def _node(kube: KubeHandle, name: str) -> dict:
    status, body = kube.request("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "xidstream.test/run": RUN}},
    })
    assert status == 201, body
    return body


def _pod(kube: KubeHandle, ns: str, name: str, node: str, labels: dict | None = None) -> dict:
    status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]},
    })
    assert status == 201, body
    return body


def _evict(kube: KubeHandle, ns: str, pod: str) -> tuple[int, dict]:
    return kube.request("POST", f"/api/v1/namespaces/{ns}/pods/{pod}/eviction", {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": ns},
    })


def test_server_is_ready_and_serves_the_apis_the_executors_need(kube):
    status, body = kube.request("GET", "/readyz")
    assert status == 200, body
    status, version = kube.request("GET", "/version")
    assert status == 200 and version["gitVersion"].startswith("v1.")
    if not os.environ.get("XIDSTREAM_KUBECONFIG"):
        assert version["gitVersion"] == "v1.34.3"
    status, group = kube.request("GET", "/apis/resource.k8s.io/v1alpha3")
    assert status == 200, group
    assert "devicetaintrules" in [r["name"] for r in group["resources"]]
    status, group = kube.request("GET", "/apis/policy/v1")
    assert "poddisruptionbudgets" in [r["name"] for r in group["resources"]]
    status, pods = kube.request("GET", "/api/v1")
    assert "pods/eviction" in [r["name"] for r in pods["resources"]]
    assert Path(kube.kubeconfig).exists()


def test_unauthenticated_and_unauthorized_requests_are_refused(kube):
    status, body = kube.request("GET", "/api/v1/nodes", token=None)
    assert status == 401, body
    status, body = kube.request("GET", "/api/v1/nodes", token="not-a-token")
    assert status == 401, body
    # and TLS is verified against the kubeconfig's CA only: the system's roots do not know this server
    if not os.environ.get("XIDSTREAM_KUBECONFIG"):
        with pytest.raises(urllib.error.URLError) as info:
            urllib.request.urlopen(kube.server + "/readyz", context=ssl.create_default_context(), timeout=5)
        assert isinstance(info.value.reason, ssl.SSLCertVerificationError)
    if kube.nobody_token:  # authenticated, no role binding: RBAC says no
        status, body = kube.request("GET", "/api/v1/nodes", token=kube.nobody_token)
        assert status == 403, body
        assert "cannot list resource \"nodes\"" in body["message"]


def test_node_and_a_pod_bound_to_it_running_and_ready(kube, ns):
    node = f"gpu-node-{RUN}-a"
    _node(kube, node)
    _pod(kube, ns, "trainer", node)
    status, pod = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/trainer")
    assert status == 200
    assert pod["spec"]["nodeName"] == node
    assert pod["spec"]["serviceAccountName"] == "default"  # the ServiceAccount admission plugin ran
    assert pod["status"].get("phase") == "Pending"  # no kubelet
    kube.mark_pod_running_ready(ns, "trainer")
    status, pod = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/trainer")
    assert pod["status"]["phase"] == "Running"
    assert {"type": "Ready", "status": "True"}.items() <= next(
        c for c in pod["status"]["conditions"] if c["type"] == "Ready").items()
    status, pods = kube.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}")
    assert [p["metadata"]["name"] for p in pods["items"]] == ["trainer"]


def test_pod_disruption_budget_makes_the_eviction_api_refuse_a_ready_pod(kube, ns):
    node = f"gpu-node-{RUN}-b"
    _node(kube, node)
    for name in ("guarded", "spare"):
        _pod(kube, ns, name, node, labels={"app": name})
        kube.mark_pod_running_ready(ns, name)
    status, body = kube.request("POST", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "guarded"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
    })
    assert status == 201, body
    # No disruption controller runs: until a PDB's status is written, every eviction it selects is
    # refused as "still being processed", whatever the budget. A 429 alone proves nothing.
    status, body = _evict(kube, ns, "guarded")
    assert status == 429, body
    assert "still being processed" in body["details"]["causes"][0]["message"], body
    # What the disruption controller would compute: 1 healthy of 1 desired, no disruption allowed.
    kube.set_pdb_status(ns, "guarded", disruptions_allowed=0, current_healthy=1, desired_healthy=1, expected_pods=1)

    status, body = _evict(kube, ns, "guarded")
    assert status == 429, body
    assert body["details"]["causes"][0] == {
        "reason": "DisruptionBudget",
        "message": "The disruption budget guarded needs 1 healthy pods and has 1 currently"}, body
    status, pod = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/guarded")
    assert status == 200 and not pod["metadata"].get("deletionTimestamp")

    # The refusal is the budget's: the unguarded pod on the same node is evicted ...
    status, body = _evict(kube, ns, "spare")
    assert status == 201, body
    status, pod = kube.request("GET", f"/api/v1/namespaces/{ns}/pods/spare")
    assert status == 404 or pod["metadata"].get("deletionTimestamp")
    # ... and the guarded one as soon as the budget allows one disruption.
    kube.set_pdb_status(ns, "guarded", disruptions_allowed=1, current_healthy=2, desired_healthy=1, expected_pods=2)
    status, body = _evict(kube, ns, "guarded")
    assert status == 201, body


def test_eviction_ignores_the_budget_for_a_pending_pod(kube, ns):
    """Why test pods must be marked Running and Ready: a Pending pod is evicted whatever its PDB."""
    node = f"gpu-node-{RUN}-c"
    _node(kube, node)
    _pod(kube, ns, "pending", node, labels={"app": "pending"})
    status, body = kube.request("POST", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "pending"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "pending"}}},
    })
    assert status == 201, body
    kube.set_pdb_status(ns, "pending", disruptions_allowed=0, current_healthy=0, desired_healthy=1, expected_pods=1)
    status, body = _evict(kube, ns, "pending")
    assert status == 201, body


def test_device_taint_rule_created_and_deleted(kube):
    name = f"xidstream-quarantine-{RUN}"
    path = "/apis/resource.k8s.io/v1alpha3/devicetaintrules"
    status, body = kube.request("POST", path, {
        "apiVersion": "resource.k8s.io/v1alpha3", "kind": "DeviceTaintRule",
        "metadata": {"name": name, "labels": {"xidstream.io/incident": "dbe7164b27ea"}},
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "gpu-node-7", "device": "gpu-1"},
            "taint": {"key": "xidstream.io/gpu-wedged", "value": "GPU-8d2e4b7a", "effect": "NoSchedule"},
        },
    })
    assert status == 201, body
    status, rule = kube.request("GET", f"{path}/{name}")
    assert status == 200
    assert rule["spec"]["deviceSelector"]["device"] == "gpu-1"
    assert rule["spec"]["taint"]["effect"] == "NoSchedule"
    status, listed = kube.request("GET", f"{path}?labelSelector=xidstream.io%2Fincident%3Ddbe7164b27ea")
    assert name in [r["metadata"]["name"] for r in listed["items"]]
    status, body = kube.request("DELETE", f"{path}/{name}")
    assert status == 200, body
    status, body = kube.request("GET", f"{path}/{name}")
    assert status == 404, body


def test_service_account_tokens_are_issued_and_accepted(kube, ns):
    """The service-account key pair and issuer are wired: a bound token authenticates as the SA."""
    status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/default/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 600},
    })
    assert status == 201, body
    token = body["status"]["token"]
    status, review = kube.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview",
    }, token=token)
    assert status == 201, review
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:default"
    status, body = kube.request("GET", "/api/v1/nodes", token=token)
    assert status == 403, body  # no role binding for it


def test_pod_security_admission_enforces_a_namespace_level(kube):
    name = f"xs-restricted-{RUN}"
    status, body = kube.request("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}},
    })
    assert status == 201, body
    kube.ensure_namespace(name)
    status, body = kube.request("POST", f"/api/v1/namespaces/{name}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root"},
        "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                 "securityContext": {"privileged": True}}]},
    })
    assert status == 403, body
    assert "violates PodSecurity" in body["message"]


# -- provisioning -----------------------------------------------------------------------------------
@LOCAL_ONLY
def test_start_is_idempotent_and_status_reports_the_running_server(kube):
    local = LocalKube()
    t0 = time.monotonic()
    again = local.start()
    assert time.monotonic() - t0 < 5
    assert again.server == kube.server and again.token == kube.token
    st = local.status()
    assert st["etcd"]["healthy"] and st["kube-apiserver"]["ready"]
    assert st["etcd"]["url"].startswith("http://127.0.0.1:")
    assert KubeHandle.from_kubeconfig(st["kubeconfig"]).token == kube.token


@LOCAL_ONLY
def test_a_second_server_starts_fresh_and_stop_ends_both_processes(kube, tmp_path):
    """Other ports and state dir, so it runs beside the session's server; an empty cluster."""
    local = LocalKube(port=16453, etcd_port=12389, etcd_peer_port=12390, state_dir=tmp_path / "kube")
    try:
        t0 = time.monotonic()
        handle = local.start()
        elapsed = time.monotonic() - t0
        assert elapsed < 60, elapsed
        status, nodes = handle.request("GET", "/api/v1/nodes")
        assert status == 200 and nodes["items"] == []
        pids = [local.pid("etcd"), local.pid("kube-apiserver")]
        assert all(pids)
        assert kube.request("GET", "/readyz")[0] == 200
    finally:
        assert local.stop()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()
    assert local.status()["kube-apiserver"]["pid"] is None and local.status()["etcd"]["pid"] is None
    assert not local.stop()
    # the session's server is untouched
    assert kube.request("GET", "/readyz")[0] == 200


@LOCAL_ONLY
def test_clear_errors_for_a_missing_go_and_an_etcd_that_cannot_start(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "etcd").symlink_to(shutil.which("etcd"))
    monkeypatch.setenv("PATH", str(bin_dir))
    local = LocalKube(cache_dir=tmp_path / "cache", state_dir=tmp_path / "kube",
                      port=16463, etcd_port=12399, etcd_peer_port=12400)
    with pytest.raises(LocalKubeError, match="go not found"):
        local.fetch()
    # An etcd that exits at once (an unwritable data dir): its own last log lines in the error.
    local.etcd_data.parent.mkdir(parents=True, exist_ok=True)
    local.etcd_data.write_text("not a directory")
    with pytest.raises(LocalKubeError, match=r"etcd failed to start \(exit \d+\)") as info:
        local._start_etcd(keep_data=True, timeout=20)
    assert "etcd.log" in str(info.value)
    assert local.pid("etcd") is None
