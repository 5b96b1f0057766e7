"""The pod view's parts without an API server: the index (never "no pods" before the list is in),
the TokenReview cache (bounded, keyed by a hash of the token), the answers' codes. The whole view
on the real API server, with the chart's RBAC: tests/integration/test_pod_view.py."""

from __future__ import annotations

import pytest

from xidstream.executors.podview import NODE_NAME_EXTRA, PodIndex, PodViewServer, TokenCheck, project
from xidstream.schemas.errors import ConfigError
from xidstream.transport.podview import AUDIENCE


def pod(name: str, node: str | None, uid: str | None = None, **spec) -> dict:
    return {"metadata": {"name": name, "namespace": "ml", "uid": uid or name, "annotations": {"a": "b"}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i", "env": [{"name": "K", "value": "v"}]}],
                     **spec}, "status": {"phase": "Running"}}


def node_sa(node: str, user: str = "system:serviceaccount:xs:xs-xidstream-node") -> dict:
    return {"authenticated": True, "audiences": [AUDIENCE], "user": {"username": user, "extra": {NODE_NAME_EXTRA: [node]}}}


def test_the_index_answers_nothing_until_the_list_is_in_and_a_relist_forgets_the_deleted():
    index = PodIndex()
    assert index.on_node("a") is None  # not "no pods": for the node executor that reads "drained"
    index.replace([pod("p1", "a"), pod("p2", "b"), pod("pending", None)])
    assert len(index.on_node("a")) == 1 and len(index) == 2
    index.apply("MODIFIED", pod("p2", "a"))  # (a pod never moves; the index would follow if it did)
    assert len(index.on_node("a")) == 2 and index.on_node("b") == []
    index.apply("DELETED", pod("p1", "a"))
    index.replace([pod("p3", "a")])  # p2 was deleted while the watch was down
    assert [b"p3" in p for p in index.on_node("a")] == [True]
    index.unsynced()
    assert index.on_node("a") is None


def test_a_node_is_shown_only_what_its_callers_read():
    p = pod("p", "a", nodeSelector={"nvidia.com/gpu.deploy.dcgm": "true"}, volumes=[{"name": "secret"}])
    p["metadata"]["annotations"]["kubernetes.io/config.mirror"] = "x"
    got = project(p)
    assert got["metadata"]["annotations"] == {"kubernetes.io/config.mirror": "x"}
    assert got["spec"] == {"containers": [{"name": "c", "image": "i"}], "nodeName": "a",
                           "nodeSelector": {"nvidia.com/gpu.deploy.dcgm": "true"}}


def test_token_reviews_are_cached_by_hash_and_the_cache_is_bounded():
    asked = []

    def review(token):
        asked.append(token)
        return node_sa(token.split("-")[0]) if token.startswith("node") else {"authenticated": False, "error": "bad"}

    now = [0.0]
    check = TokenCheck(review, "xs/xs-xidstream-node", ttl=30, refused_ttl=5, max_entries=3, clock=lambda: now[0])
    assert check.check("nodeA-1") == (200, "nodeA") and check.check("nodeA-1") == (200, "nodeA")
    assert asked == ["nodeA-1"]
    assert check.check("junk")[0] == 401 and check.check("junk")[0] == 401 and asked.count("junk") == 1
    now[0] = 6.0
    check.check("junk")  # a refusal is kept a short time only
    assert asked.count("junk") == 2
    for t in ("nodeB-1", "nodeC-1", "nodeD-1"):
        check.check(t)
    assert len(check._cache) == 3  # the oldest went
    assert all(isinstance(k, bytes) and len(k) == 32 for k in check._cache)  # a hash, never the token
    now[0] = 40.0
    check.check("nodeA-1")
    assert asked.count("nodeA-1") == 2  # expired: asked again (a deleted pod's token stops working)


@pytest.mark.parametrize("status, code, words", [
    ({"authenticated": False, "error": "token expired"}, 401, "token expired"),
    ({"authenticated": True, "audiences": ["https://kubernetes.default.svc"], "user": {}}, 401, "not for audience"),
    (node_sa("a", user="system:serviceaccount:xs:default"), 403, "only the node pods' service account"),
    ({"authenticated": True, "audiences": [AUDIENCE], "user": {"username": "system:serviceaccount:xs:xs-xidstream-node"}},
     403, "names no node"),
])
def test_each_refusal_says_why(status, code, words):
    check = TokenCheck(lambda t: status, "xs/xs-xidstream-node")
    got, why = check.check("t")
    assert got == code and words in why


def test_the_answers_codes():
    index = PodIndex()
    view = PodViewServer(index, TokenCheck(lambda t: node_sa("a"), "xs/xs-xidstream-node"))
    assert view.answer("/v1/pods", "Bearer t")[0] == 503  # listing not in yet
    index.replace([pod("p1", "a"), pod("p2", "b")])
    code, body = view.answer("/v1/pods?node=b", "Bearer t")  # the node is the token's, not the query's
    assert code == 200 and b'"node":"a"' in body and b"p1" in body and b"p2" not in body
    assert view.answer("/api/v1/pods", "Bearer t")[0] == 404
    assert view.answer("/v1/pods", "Basic dTpw")[0] == 401
    failing = PodViewServer(index, TokenCheck(lambda t: (_ for _ in ()).throw(OSError("refused")), "xs/xs-xidstream-node"))
    assert failing.answer("/v1/pods", "Bearer t")[0] == 503  # the API server away: cannot check, nothing cached


def test_a_malformed_service_account_is_refused_at_start():
    with pytest.raises(ConfigError):
        TokenCheck(lambda t: {}, "xidstream")


def test_requests_over_the_bound_are_answered_503_at_once_and_an_idle_connection_is_closed():
    import socket
    import time
    import urllib.error
    import urllib.request

    index = PodIndex()
    index.replace([pod("p1", "a")])
    view = PodViewServer(index, TokenCheck(lambda t: node_sa("a"), "xs/xs-xidstream-node"), max_requests=2,
                         request_timeout=1.0)
    port = view.serve(0)
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # send nothing: hold both slots
        time.sleep(0.2)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/pods", headers={"Authorization": "Bearer t"})
        with pytest.raises(urllib.error.HTTPError) as got:
            urllib.request.urlopen(req, timeout=5)
        assert got.value.code == 503
        time.sleep(1.5)  # the idle connections timed out: their slots are free again
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200 and b"p1" in resp.read()
        for s in idle:
            s.close()
    finally:
        view.close()


def _serve(**kw):
    index = PodIndex()
    index.replace([pod("p1", "a")])
    view = PodViewServer(index, TokenCheck(lambda t: node_sa("a"), "xs/xs-xidstream-node"), **kw)
    return view, view.serve(0)


def _get(port):
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/pods", headers={"Authorization": "Bearer t"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.status, resp.read()


def test_a_trickling_client_is_closed_at_the_deadline_and_frees_its_slot():
    """H2: the timeout is per connection from its accept, not per read: a byte every 0.3 s (under
    the 1 s per-read timeout) is still cut at 1 s, and its slot goes to the next caller."""
    import socket
    import time

    view, port = _serve(max_requests=1, request_timeout=1.0)
    try:
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(0.05)
        t0, closed_at = time.monotonic(), None
        s.sendall(b"GET /v1/pods HTTP/1.0\r\n")
        while time.monotonic() - t0 < 4.0:
            try:
                s.sendall(b"X")
                if s.recv(1024) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except socket.timeout:
                pass
            except OSError:
                closed_at = time.monotonic() - t0
                break
            time.sleep(0.3)
        s.close()
        assert closed_at is not None and closed_at < 1.0 + 0.8, closed_at
        time.sleep(0.1)
        status, body = _get(port)
        assert status == 200 and b"p1" in body
    finally:
        view.close()


def test_oversized_headers_are_refused_and_read_only_up_to_the_budget():
    """H2: 99 header lines of 65,000 bytes without the final blank line: the stdlib would buffer
    them all (6 MiB per connection); the view reads at most its budget, answers 431 and closes."""
    import socket
    import threading

    view, port = _serve(max_request_bytes=16 * 1024)
    try:
        s = socket.create_connection(("127.0.0.1", port))

        def flood():
            try:
                s.sendall(b"GET /v1/pods HTTP/1.0\r\n")
                for i in range(99):
                    s.sendall(b"X-%d: " % i + b"a" * 65_000 + b"\r\n")
            except OSError:
                pass

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        s.settimeout(5)
        got = b""
        try:
            while chunk := s.recv(1024):
                got += chunk
        except OSError:
            pass
        assert got == b"" or got.startswith(b"HTTP/1.0 431"), got[:100]
        t.join(5)
        s.close()
        assert 0 < view.most_read <= 16 * 1024
        status, _ = _get(port)  # and the view still answers
        assert status == 200
    finally:
        view.close()


def test_huge_args_are_cut_in_the_index_and_kureds_period_is_still_read():
    """M1: a tenant's pod with megabytes of args costs the index a bounded few KiB."""
    from xidstream.executors.podview import MAX_ARG_CHARS, MAX_ARGS
    from xidstream.executors.reboot import kured_on_node

    big = pod("big", "a")
    big["spec"]["containers"][0]["args"] = ["x" * 1_000_000] + ["y"] * 10_000
    big["spec"]["containers"][0]["command"] = ["z" * 100_000]
    kured = pod("kured-abc", "a")
    kured["metadata"]["labels"] = {"name": "kured"}
    kured["spec"]["containers"][0].update(image="ghcr.io/kubereboot/kured:1.15.0", command=["/usr/bin/kured"],
                                          args=["--ds-name=kured", "--period=10m", "--reboot-sentinel=/sentinel/reboot-required"])
    index = PodIndex()
    index.replace([big, kured])
    pods = index.on_node("a")
    assert sum(len(p) for p in pods) < 20_000
    c = project(big)["spec"]["containers"][0]
    assert len(c["args"]) == MAX_ARGS + 1 and "more cut" in c["args"][-1]
    assert all(len(a) <= MAX_ARG_CHARS + 10 for a in c["args"] + c["command"])

    class View:
        def pods(self, node):
            from lightkube.resources.core_v1 import Pod
            import json
            return [Pod.from_dict(json.loads(p)) for p in index.on_node(node)]

    found, period = kured_on_node(None, "a", View())
    assert found is not None and found.metadata.name == "kured-abc" and period == "10m"


def test_a_silent_watch_goes_stale_answers_503_and_a_fresh_worker_lists_again():
    """M2: lightkube's watch has no read timeout; a half-open connection yields nothing forever.
    The index answers None past `stale_after`, the stuck worker is abandoned and a new one lists."""
    import threading
    import time
    from types import SimpleNamespace

    from xidstream.executors.podview import PodWatch

    class P(SimpleNamespace):
        def to_dict(self):
            return self.d

    class Listing(list):
        resourceVersion = "1"

    hang = threading.Event()
    calls = {"list": 0, "watch": []}

    class Client:
        def list(self, res, **kw):
            calls["list"] += 1
            assert kw.get("chunk_size")
            return Listing([P(d=pod(f"p{calls['list']}", "a"))])

        def watch(self, res, **kw):
            calls["watch"].append(kw.get("server_timeout"))
            hang.wait(30)  # a half-open connection: nothing, ever
            return iter(())

    now = [0.0]
    index = PodIndex(clock=lambda: now[0])
    watch = PodWatch(Client(), index, watch_timeout=300, stale_after=60, check_every=0.05)
    try:
        watch.start()
        deadline = time.monotonic() + 5
        while index.on_node("a") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [b"p1" in p for p in index.on_node("a")] == [True]
        assert calls["watch"] == [300]  # the API server ends every watch (timeoutSeconds)
        now[0] = 61.0  # a minute without a word from the watch
        assert index.on_node("a") is None  # 503, not old pods
        deadline = time.monotonic() + 5
        while calls["list"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        while index.on_node("a") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.restarts == 1 and [b"p2" in p for p in index.on_node("a")] == [True]
    finally:
        watch.stop()
        hang.set()
