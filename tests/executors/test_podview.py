"""The pod view's parts without an API server: the index (never "no pods" before the list is in),
the TokenReview cache (bounded, keyed by a hash of the token), the answers' codes. The whole view
on the real API server, with the chart's RBAC: tests/integration/test_pod_view.py."""

from __future__ import annotations

import pytest

from executors.podview import NODE_NAME_EXTRA, PodIndex, PodViewServer, TokenCheck, project
from schemas.errors import ConfigError
from transport.podview import AUDIENCE


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
