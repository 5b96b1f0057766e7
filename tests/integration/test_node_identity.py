"""Per-node identity on the real kube-apiserver: a node pod's bound service-account token enrolls
its node's key and no other node's; the processor then believes a record about a node only with
that node's MAC (threat T2: one compromised node's credentials, 1484261 believed any node's
records from any node)."""

from __future__ import annotations

import uuid

import pytest
import yaml

from xidstream.executors.enroll import Enroller, request_enrollment
from xidstream.executors.kube import make_client
from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys
from xidstream.transport.identity import CLUSTER_IDENTITY, AuthError, NodeIdentity, ProcessorIdentity, RecordVerifier

pytestmark = pytest.mark.kube

RUN = uuid.uuid4().hex[:6]
NS = f"xs-id-{RUN}"


@pytest.fixture(scope="module")
def cluster(kube):
    """Two GPU nodes, the chart-like node service account (may create CSRs), a tenant's service
    account (may create CSRs too, to show it is the identity that is checked, not RBAC), and a pod
    of each on each node."""
    kube.ensure_namespace(NS)
    nodes = [f"gpu-{RUN}-a", f"gpu-{RUN}-b"]
    for n in nodes:
        status, body = kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                             "metadata": {"name": n, "labels": {"nvidia.com/gpu.present": "true"}}})
        assert status == 201, body
    for sa in ("xidstream-node", "tenant"):
        status, body = kube.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts",
                                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
        assert status == 201, body
    role = f"xs-id-csr-{RUN}"
    assert kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
        "rules": [{"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"],
                   "verbs": ["create"]}]})[0] == 201
    assert kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": NS} for sa in ("xidstream-node", "tenant")]})[0] == 201
    pods = {}
    for n in nodes:
        for sa in ("xidstream-node", "tenant"):
            name = f"{sa}-{n}"
            status, body = kube.request("POST", f"/api/v1/namespaces/{NS}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"nodeName": n, "serviceAccountName": sa, "containers": [{"name": "c", "image": "x"}]}})
            assert status == 201, body
            pods[(n, sa)] = body["metadata"]["uid"]
    return kube, nodes, pods


def _pod_client(kube, tmp_path, node, sa, pods):
    """A client holding what that pod holds: its bound service-account token (TokenRequest bound
    to the pod, as the kubelet projects it)."""
    name = f"{sa}-{node}"
    status, body = kube.request("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": ["https://kubernetes.default.svc.cluster.local"], "expirationSeconds": 600,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": name, "uid": pods[(node, sa)]}}})
    assert status == 201, body
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "k", "cluster": {"server": kube.server, "certificate-authority": str(kube.ca_file)}}],
           "users": [{"name": "u", "user": {"token": body["status"]["token"]}}],
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}
    path = tmp_path / f"{name}.kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return make_client(path)


@pytest.fixture
def enroller(cluster, tmp_path):
    kube, *_ = cluster
    priv, pub, _ = generate_keys(tmp_path / "enroller")
    published = []
    e = Enroller(make_client(kube.kubeconfig), SigningKey.load(priv), published.append,
                 node_service_account=f"{NS}/xidstream-node")
    return e, published, VerifyKeys.load([pub])


def _mine(published, nodes):
    return {r.node: r for r in published if r.node in nodes}


def test_a_node_pod_enrolls_its_own_node_and_the_enrollment_is_signed(cluster, enroller, tmp_path):
    kube, nodes, pods = cluster
    e, published, verify = enroller
    ident = NodeIdentity.load_or_create(tmp_path / "a", nodes[0])
    request_enrollment(_pod_client(kube, tmp_path, nodes[0], "xidstream-node", pods), ident)
    request_enrollment(_pod_client(kube, tmp_path, nodes[0], "xidstream-node", pods), ident)  # again: idempotent
    e.poll_once()
    got = _mine(published, nodes)
    assert set(got) == {nodes[0]}
    rec = got[nodes[0]]
    verify.verify(rec)
    assert rec.x25519_public == ident.x25519_public and rec.ed25519_public == ident.ed25519_public
    assert f"on node {nodes[0]}" in rec.vouched
    e.poll_once()  # nothing new: nothing published again
    assert len(_mine(published, nodes)) == 1 and sum(1 for r in published if r.node in nodes) == 1


def test_a_compromised_node_cannot_enroll_a_key_for_another_node(cluster, enroller, tmp_path, caplog):
    kube, nodes, pods = cluster
    e, published, _ = enroller
    # Node A's pod (its own token) asks for node B's identity; a tenant's pod on B asks for B.
    forged = NodeIdentity.load_or_create(tmp_path / "forged", nodes[1])
    request_enrollment(_pod_client(kube, tmp_path, nodes[0], "xidstream-node", pods), forged)
    tenant = NodeIdentity.load_or_create(tmp_path / "tenant", nodes[1])
    request_enrollment(_pod_client(kube, tmp_path, nodes[1], "tenant", pods), tenant)
    # The admin (no pod, no node) asking for B is refused too: only a pod on B vouches for B.
    admin_made = NodeIdentity.load_or_create(tmp_path / "admin", nodes[1])
    request_enrollment(make_client(kube.kubeconfig), admin_made)
    with caplog.at_level("WARNING"):
        e.poll_once()
    assert nodes[1] not in _mine(published, nodes)
    text = caplog.text
    assert f"asks for '{nodes[1]}' but was requested from a pod on '{nodes[0]}'" in text
    assert "not the node service account" in text


def test_the_processor_believes_a_record_about_a_node_only_with_that_nodes_mac(tmp_path):
    priv, _, _ = generate_keys(tmp_path / "proc")
    proc = ProcessorIdentity(SigningKey.load(priv))
    a = NodeIdentity.load_or_create(tmp_path / "a", "gpu-a")
    b = NodeIdentity.load_or_create(tmp_path / "b", "gpu-b")
    cl = NodeIdentity.load_or_create(tmp_path / "c", CLUSTER_IDENTITY)
    verifier = RecordVerifier(proc)
    for ident in (a, b, cl):
        verifier.enroll(ident.identity, ident.x25519_public)
    auth_a = a.record_auth(proc.public)
    value = b'{"node": "gpu-a"}'
    hdr = auth_a.header("gpu.xid", b"GPU-1", value)
    assert verifier.sender([hdr], "gpu.xid", b"GPU-1", value) == "gpu-a"
    # The same MAC on another value, key or topic does not hold.
    for topic, key, val in (("gpu.xid", b"GPU-1", b'{"node": "gpu-b"}'), ("gpu.xid", b"GPU-2", value),
                            ("gpu.samples", b"GPU-1", value)):
        with pytest.raises(AuthError, match="does not hold"):
            verifier.sender([hdr], topic, key, val)
    # Node A claiming to be node B in the header: A cannot compute B's MAC.
    forged = ("xidstream-auth", hdr[1].replace(b"gpu-a", b"gpu-b"))
    with pytest.raises(AuthError, match="does not hold for 'gpu-b'"):
        verifier.sender([forged], "gpu.xid", b"GPU-1", value)
    with pytest.raises(AuthError, match="no xidstream-auth header"):
        verifier.sender([], "gpu.xid", b"GPU-1", value)
    with pytest.raises(AuthError, match="not enrolled"):
        verifier.sender([NodeIdentity.load_or_create(tmp_path / "z", "gpu-z").record_auth(proc.public)
                         .header("gpu.xid", b"GPU-1", value)], "gpu.xid", b"GPU-1", value)
    # Keys made on each side agree, and differ per node.
    assert a.record_auth(proc.public).key == proc.record_key("gpu-a", a.x25519_public)
    assert a.record_auth(proc.public).key != b.record_auth(proc.public).key
