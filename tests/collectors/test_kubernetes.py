"""Workload sources against real local servers: a kubelet-like gRPC pod-resources server on a unix
socket and a Kubernetes-API-like HTTP server on 127.0.0.1."""

from __future__ import annotations

import copy
import http.server
import threading
import time
from concurrent import futures

import grpc
import orjson
import pytest

from collectors.sources.kubernetes import (
    KubernetesWorkloads,
    PodResourcesClient,
    PodWatcher,
    decode_pod_resources,
    from_environment,
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


class _FakeApi(http.server.BaseHTTPRequestHandler):
    events: list = []
    seen: list = []

    def do_GET(self):  # noqa: N802
        self.seen.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if "watch=1" in self.path:
            for ev in self.events:
                self.wfile.write(orjson.dumps(ev) + b"\n")
                self.wfile.flush()
            self.wfile.write(b"not json\n")
            time.sleep(0.2)
        else:
            self.wfile.write(orjson.dumps({"metadata": {"resourceVersion": "42"},
                                           "items": [_pod({"running": {}}, name="trainer", uid="u2")]}))

    def log_message(self, *args):
        pass


def test_watch_and_pod_resources_give_workload_events_per_gpu(kubelet_socket):
    waiting = _pod({"waiting": {}})
    running = _pod({"running": {}})
    failed = _pod({"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": "t"}})
    _FakeApi.events = [{"type": "ADDED", "object": waiting}, {"type": "MODIFIED", "object": running},
                       {"type": "MODIFIED", "object": failed}, {"type": "BOOKMARK", "object": {}}]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    watcher = PodWatcher(f"http://127.0.0.1:{server.server_port}", "gpu-node-7", token="t")
    source = KubernetesWorkloads(watcher, PodResourcesClient(kubelet_socket))
    watcher.start()
    got = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(got) < 2:
        got += source.read()
        time.sleep(0.05)
    watcher.stop()
    server.shutdown()
    assert [(e["event"], e["gpu_uuid"], e["pod"]) for e in got] == [
        ("started", "GPU-bbbb", "vllm-0"), ("failed", "GPU-bbbb", "vllm-0")]
    assert any("fieldSelector=spec.nodeName%3Dgpu-node-7" in p for p in _FakeApi.seen)
    assert any("resourceVersion=42" in p for p in _FakeApi.seen)


def test_off_cleanly_when_not_on_kubernetes(tmp_path):
    assert from_environment({}, "n") is None
    assert from_environment({"KUBERNETES_SERVICE_HOST": "127.0.0.1"}, "n", socket_path=str(tmp_path / "none"),
                            service_account=tmp_path) is None


def test_a_pod_copy_is_not_a_transition():
    p = _pod({"running": {}})
    assert pod_transitions(p, copy.deepcopy(p)) == []
