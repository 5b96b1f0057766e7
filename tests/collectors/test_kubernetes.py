"""Workload sources against real local servers: a kubelet-like gRPC pod-resources server on a unix
socket and the real local kube-apiserver (the `kube` fixture) for the pod watch."""

from __future__ import annotations

import copy
import time
import uuid
from concurrent import futures

import grpc
import pytest

from xidstream.collectors.sources.kubernetes import (
    KubernetesWorkloads,
    PodResourcesClient,
    PodWatcher,
    decode_pod_resources,
    from_environment,
    job_of,
    pod_transitions,
)


def _v(n: int) -> bytes:
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _ld(field: int, payload: bytes) -> bytes:
    return _v(field << 3 | 2) + _v(len(payload)) + payload


def encode_list_response(pods) -> bytes:
    out = b""
    for ns, name, containers in pods:
        body = _ld(1, name.encode()) + _ld(2, ns.encode())
        for cname, resource, ids in containers:
            dev = _ld(1, resource.encode()) + b"".join(_ld(2, i.encode()) for i in ids)
            # cpu_ids (field 3, varint-packed) must be skipped
            body += _ld(3, _ld(1, cname.encode()) + _ld(2, dev) + _ld(3, _v(1) + _v(2)))
        out += _ld(1, body)
    return out


PODS = [("ml", "vllm-0", [("vllm", "nvidia.com/gpu", ["GPU-bbbb"])]),
        ("ml", "trainer", [("main", "nvidia.com/gpu", ["GPU-aaaa", "GPU-cccc"]), ("side", "cpu", [])])]


def test_decode_pod_resources():
    got = decode_pod_resources(encode_list_response(PODS))
    assert [(c.namespace, c.pod, c.container, c.resource, c.device_ids) for c in got] == [
        ("ml", "vllm-0", "vllm", "nvidia.com/gpu", ("GPU-bbbb",)),
        ("ml", "trainer", "main", "nvidia.com/gpu", ("GPU-aaaa", "GPU-cccc")),
        ("ml", "trainer", "side", "cpu", ()),
    ]
    with pytest.raises(ValueError):
        decode_pod_resources(b"\x0a\xff")


@pytest.fixture
def kubelet_socket(tmp_path):
    path = tmp_path / "kubelet.sock"

    def handle(request, context):
        assert request == b""
        return encode_list_response(PODS)

    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(handle)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    yield str(path)
    server.stop(0)


def test_pod_resources_client_over_a_real_grpc_socket(kubelet_socket):
    client = PodResourcesClient(kubelet_socket)
    assert {(c.pod, c.device_ids) for c in client.list() if c.resource == "nvidia.com/gpu"} == {
        ("vllm-0", ("GPU-bbbb",)), ("trainer", ("GPU-aaaa", "GPU-cccc"))}
    client.close()


def _pod(state, restarts=0, last=None, uid="u1", name="vllm-0"):
    cs = {"name": "vllm", "restartCount": restarts, "state": state}
    if last:
        cs["lastState"] = {"terminated": last}
    return {"metadata": {"uid": uid, "namespace": "ml", "name": name}, "status": {"containerStatuses": [cs]}}


def test_pod_transitions():
    waiting = _pod({"waiting": {"reason": "ContainerCreating"}})
    running = _pod({"running": {"startedAt": "t1"}})
    failed = _pod({"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "t2"}})
    restarted = _pod({"waiting": {"reason": "CrashLoopBackOff"}}, restarts=1, last={"exitCode": 139, "reason": "Error"})
    done = _pod({"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": "t3"}})
    assert pod_transitions(None, waiting) == []
    assert [e["event"] for e in pod_transitions(waiting, running)] == ["started"]
    (f,) = pod_transitions(running, failed)
    assert (f["event"], f["exit_code"], f["reason"], f["pod_uid"], f["container"]) == ("failed", 1, "Error", "u1", "vllm")
    assert pod_transitions(failed, failed) == []
    (r,) = pod_transitions(failed, restarted)
    assert (r["event"], r["exit_code"]) == ("restarted", 139)
    assert [e["event"] for e in pod_transitions(running, done)] == ["succeeded"]


def _serve_pod_resources(path, pods):
    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister", {"List": grpc.unary_unary_rpc_method_handler(lambda req, ctx: encode_list_response(pods))})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def _set_container(kube, ns, name, state, restarts=0):
    """What the kubelet would write: the pod's container status."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cs = {"name": "vllm", "image": "registry.k8s.io/pause:3.10", "imageID": "", "ready": "running" in state,
          "restartCount": restarts, "state": {k: dict(v, **({"startedAt": now} if k != "waiting" else {}))
                                              for k, v in state.items()}}
    status, body = kube.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                                {"status": {"phase": "Running", "containerStatuses": [cs]}},
                                content_type="application/merge-patch+json")
    assert status == 200, body


def test_watch_on_the_real_api_server_gives_workload_events_per_gpu(kube, tmp_path):
    """The collector's pod watch through transport.kube (lightkube) on the real kube-apiserver: a
    pod already there is listed (joined late: no event), a new one's start and failure are events,
    each attributed to the GPU the kubelet's pod-resources gave it; pods on other nodes are unseen."""
    from xidstream.collectors.sources.kubernetes import from_environment
    from xidstream.transport.kube import make_client

    run = uuid.uuid4().hex[:6]
    node, ns = f"wl-node-{run}", f"wl-{run}"
    kube.ensure_namespace(ns)
    assert kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})[0] == 201

    def pod(name, on=node):
        status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": on, "containers": [{"name": "vllm", "image": "registry.k8s.io/pause:3.10"}]}})
        assert status == 201, body

    pod("trainer")
    _set_container(kube, ns, "trainer", {"running": {}})
    server = _serve_pod_resources(tmp_path / "kubelet.sock", [
        (ns, "vllm-0", [("vllm", "nvidia.com/gpu", ["GPU-bbbb"])]), (ns, "trainer", [("main", "nvidia.com/gpu", ["GPU-aaaa"])])])
    watcher = PodWatcher(make_client(kube.kubeconfig), node)
    source = KubernetesWorkloads(watcher, PodResourcesClient(str(tmp_path / "kubelet.sock")))
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while watcher.q.empty() and time.monotonic() < deadline:  # the listing is in: the watch resumes from it
            time.sleep(0.05)
        assert source.read() == []  # the trainer was running before we looked: no transition
        pod("vllm-0")
        pod("elsewhere", on=f"other-{run}")
        _set_container(kube, ns, "vllm-0", {"waiting": {"reason": "ContainerCreating"}})
        _set_container(kube, ns, "vllm-0", {"running": {}})
        _set_container(kube, ns, "vllm-0", {"terminated": {"exitCode": 1, "reason": "Error",
                                                           "finishedAt": "2026-12-01T00:00:00Z"}})
        got: list = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(got) < 2:
            got += source.read()
            time.sleep(0.05)
    finally:
        watcher.stop()
        server.stop(0)
    assert [(e["event"], e["gpu_uuid"], e["pod"], e["exit_code"]) for e in got] == [
        ("started", "GPU-bbbb", "vllm-0", None), ("failed", "GPU-bbbb", "vllm-0", 1)]
    # without the kubelet's pod-resources socket the source is off, even with an API to watch
    assert from_environment({}, node, socket_path=str(tmp_path / "none"), kubeconfig=str(kube.kubeconfig)) is None


def test_off_cleanly_when_not_on_kubernetes(tmp_path):
    assert from_environment({}, "n") is None
    assert from_environment({"KUBERNETES_SERVICE_HOST": "127.0.0.1"}, "n", socket_path=str(tmp_path / "none")) is None


def test_a_pod_copy_is_not_a_transition():
    p = _pod({"running": {}})
    assert pod_transitions(p, copy.deepcopy(p)) == []


def test_job_of_a_pod_label_then_controller_namespace_qualified():
    meta = {"namespace": "team-a", "labels": {"job-name": "old", "batch.kubernetes.io/job-name": "train"}}
    assert job_of(meta) == "team-a/train"  # the first label of JOB_LABELS wins
    assert job_of({"namespace": "team-b", "labels": {"jobset.sigs.k8s.io/jobset-name": "train"}}) == "team-b/train"
    owned = {"namespace": "n", "ownerReferences": [{"kind": "ReplicaSet", "name": "web-5d4", "controller": False},
                                                   {"kind": "StatefulSet", "name": "db", "controller": True}]}
    assert job_of(owned) == "n/StatefulSet/db"
    assert job_of({"namespace": "n", "labels": {"job-name": ""}}) is None and job_of({}) is None


def test_pod_transitions_carry_the_job():
    pod = {"metadata": {"uid": "u", "namespace": "n", "name": "p", "labels": {"job-name": "j"}},
           "status": {"containerStatuses": [{"name": "c", "state": {"running": {}}}]}}
    (e,) = pod_transitions(None, pod)
    assert (e["event"], e["job"]) == ("started", "n/j")


def test_a_job_name_over_the_bound_is_no_job_rather_than_a_cut_one():
    # cut to JOB_MAX, two long owner names that differ only at the end were one job (review)
    from xidstream.collectors.sources.kubernetes import job_of
    from xidstream.schemas.limits import JOB_MAX

    ns = "n" * 63
    long_a = {"namespace": ns, "ownerReferences": [{"controller": True, "kind": "JobSet", "name": "x" * 253}]}
    assert len(f"{ns}/JobSet/{'x' * 253}") > JOB_MAX
    assert job_of(long_a) is None
    assert job_of({"namespace": "ml", "labels": {"job-name": "train"}}) == "ml/train"


class _View:
    """The pod view's in-memory twin: each poll answers the next list, or raises."""

    def __init__(self, answers) -> None:
        self.answers = list(answers)

    def dicts(self, node):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_two_consecutive_views_make_the_transitions_and_a_pod_gone_between_them_is_no_failure(caplog):
    from xidstream.collectors.sources.kubernetes import PodViewPoller
    from xidstream.transport.podview import PodViewError

    running = _pod({"running": {"startedAt": "t1"}})
    other = _pod({"running": {"startedAt": "t1"}}, uid="u2", name="trainer")
    failed = _pod({"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "t2"}})
    fresh = _pod({"running": {"startedAt": "t3"}}, uid="u3", name="new-0")
    down = PodViewError("pod view http://x/v1/pods unreachable: refused")
    poller = PodViewPoller(_View([[running, other], down, down, [failed, fresh], [failed, fresh]]), "n")
    source = KubernetesWorkloads(poller, None)
    source._devices = {("ml", "vllm-0"): ["GPU-aaaa"], ("ml", "trainer"): ["GPU-cccc"], ("ml", "new-0"): ["GPU-bbbb"]}
    source._last_refresh = float("inf")  # no pod-resources socket here: the devices above stand
    with caplog.at_level("INFO"):
        assert poller.poll_once() and source.read() == []  # the first view: a state joined late
        assert not poller.poll_once() and not poller.poll_once() and source.read() == []
        assert poller.poll_once()
        got = source.read()
        assert poller.poll_once() and source.read() == []  # nothing changed: nothing to say
    # vllm-0 failed while the view was away (seen at the next answer); the trainer was deleted
    # meanwhile: no event; new-0 is new and running
    assert sorted((e["event"], e["pod"], e["gpu_uuid"]) for e in got) == [
        ("failed", "vllm-0", "GPU-aaaa"), ("started", "new-0", "GPU-bbbb")]
    warned = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"  # once, not at every poll
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_the_pod_view_source_needs_the_pod_resources_socket(tmp_path):
    assert from_environment({}, "n", socket_path=str(tmp_path / "none"), pod_view=_View([])) is None
