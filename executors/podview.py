"""The pod view (`xidstream execute --scope cluster --pod-view-port`): each GPU node's pods, served
to that node only, so that the node pods' service account needs no pod read of its own.

The cluster executor already lists pods in every namespace (a drain finds the pods bound to a
node). Here it keeps a watch of them (`PodWatch` -> `PodIndex`, by node) and answers
``GET /v1/pods`` with the pods bound to the caller's node. The caller is named by the API server,
as the Node authorizer names a kubelet: it sends a service-account token of audience
``xidstream-pod-view`` (transport.podview: a projected token bound to its pod), and a TokenReview
of it for that audience says whose it is and, for a pod-bound token, the pod's node
(``authentication.kubernetes.io/node-name``, Kubernetes 1.30+; transport.identity relies on the
same extra for enrollment). Only the node pods' service account (--node-service-account) is
answered; the node comes from the review, never from the request.

What an adversary controls: whatever it sends (a stolen or forged token, another audience's,
another service account's: 401/403 with the reason), and, from a compromised node, that node's
own token: it then reads its own node's pods, no others. Answers are trimmed to what the node's
callers read (`project`): no environment, volumes or other annotations of tenants' pods.

Bounds: TokenReview answers are cached for a short time by a hash of the token (thousands of
nodes poll every few seconds; a kubelet-rotated token changes its key), at most `max_entries`,
oldest dropped first. The index holds each pod of the cluster once, trimmed (bounded by the
cluster's own pod count). Until the first list is in, and while the watch is broken, the view
answers 503: an empty answer would read as "drained" to the node executor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from transport.identity import _sa_user
from transport.podview import AUDIENCE

__all__ = ["project", "PodIndex", "PodWatch", "TokenCheck", "PodViewServer", "NODE_NAME_EXTRA", "review_with"]

log = logging.getLogger(__name__)

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


# -- what a node is shown of a pod ----------------------------------------------------------------
def _container(c: dict) -> dict:
    # image, command and args: kured's pod is known by its image and its --period flag
    # (executors.reboot); resources: whether the pod asks for a GPU (executors.kube.requests_gpu)
    return {k: c[k] for k in ("name", "image", "command", "args", "resources") if c.get(k) is not None}


def project(pod: dict) -> dict:
    """The fields the node's callers read (executors.kube, executors.node, executors.operands,
    executors.reboot, collectors.sources.kubernetes), nothing else of a tenant's pod."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    m = {k: meta[k] for k in ("name", "namespace", "uid", "labels", "ownerReferences", "deletionTimestamp",
                              "creationTimestamp") if meta.get(k) is not None}
    mirror = (meta.get("annotations") or {}).get(MIRROR_ANNOTATION)
    if mirror is not None:  # a static pod's mirror: a drain cannot evict it (executors.kube.is_mirror_pod)
        m["annotations"] = {MIRROR_ANNOTATION: mirror}
    s: dict[str, Any] = {"containers": [_container(c) for c in spec.get("containers") or []]}
    if spec.get("initContainers"):
        s["initContainers"] = [_container(c) for c in spec["initContainers"]]
    for k in ("nodeName", "nodeSelector", "resourceClaims"):
        if spec.get(k) is not None:
            s[k] = spec[k]
    st = {k: status[k] for k in ("phase", "containerStatuses") if status.get(k) is not None}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": m, "spec": s, "status": st}


class PodIndex:
    """Pods by node, each kept as its projection's JSON. Thread-safe: the watch writes, the server's
    threads read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_node: dict[str, dict[str, bytes]] = {}
        self._node_of: dict[str, str] = {}  # uid -> node
        self.synced = False

    def _put(self, pod: dict) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
        self._drop(uid)
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            return  # not bound yet: on no node's list
        self._by_node.setdefault(node, {})[uid] = json.dumps(project(pod), separators=(",", ":")).encode()
        self._node_of[uid] = node

    def _drop(self, uid: str) -> None:
        node = self._node_of.pop(uid, None)
        if node is not None:
            pods = self._by_node.get(node, {})
            pods.pop(uid, None)
            if not pods:
                self._by_node.pop(node, None)

    def replace(self, pods: list[dict]) -> None:
        """A fresh listing: what it lacks was deleted while we were not watching."""
        with self._lock:
            self._by_node, self._node_of = {}, {}
            for p in pods:
                self._put(p)
            self.synced = True

    def apply(self, kind: str, pod: dict) -> None:
        with self._lock:
            if kind == "DELETED":
                meta = pod.get("metadata") or {}
                self._drop(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
            elif kind in ("ADDED", "MODIFIED"):
                self._put(pod)

    def unsynced(self) -> None:
        with self._lock:
            self.synced = False

    def on_node(self, node: str) -> list[bytes] | None:
        """The node's pods (JSON each); None while the index is not in step with the API server."""
        with self._lock:
            if not self.synced:
                return None
            return list(self._by_node.get(node, {}).values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._node_of)


class PodWatch:
    """List every pod, then watch from the list's resourceVersion, into `index`, in a thread. On
    410 Gone, and after any other failure (with a back-off), it lists again; between a failure and
    the next list the index says it is not in step."""

    def __init__(self, client: Any, index: PodIndex) -> None:
        self.client, self.index = client, index
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-view-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # seen at the next event (the thread is a daemon)

    def _once(self) -> None:
        from lightkube import ApiError
        from lightkube.resources.core_v1 import Pod

        listing = self.client.list(Pod, namespace="*")
        self.index.replace([p.to_dict() for p in listing])
        log.info("pod view: %d pods listed", len(self.index))
        try:
            for kind, pod in self.client.watch(Pod, namespace="*", resource_version=listing.resourceVersion):
                if self._stop.is_set():
                    return
                self.index.apply(kind, pod.to_dict())
        except ApiError as exc:
            if exc.status.code != 410:
                raise
            log.info("pod view: the watch's resourceVersion is gone (410); listing again")

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self._once()
                backoff = 1.0
            except Exception as exc:  # noqa: BLE001 - API restarts and timeouts are routine
                self.index.unsynced()
                if self._stop.is_set():
                    return
                log.warning("pod view: the pod watch failed (%s); answering 503 until the next list, in %.0f s",
                            exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)


# -- who asks ----------------------------------------------------------------------------------------
def review_with(client: Any) -> Callable[[str], dict]:
    """A TokenReview of a token for the view's audience, on `client`'s API server: its status dict."""
    from lightkube.models.authentication_v1 import TokenReviewSpec
    from lightkube.resources.authentication_v1 import TokenReview

    def review(token: str) -> dict:
        done = client.create(TokenReview(spec=TokenReviewSpec(token=token, audiences=[AUDIENCE])))
        return done.status.to_dict() if done.status else {}

    return review


class TokenCheck:
    """Which node a bearer token speaks for: (200, node), or (401 | 403 | 503, why)."""

    def __init__(self, review: Callable[[str], dict], node_service_account: str, *, ttl: float = 30.0,
                 refused_ttl: float = 5.0, max_entries: int = 20_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.review = review
        self.user = _sa_user(node_service_account)  # a malformed account is a ConfigError at start
        self.ttl, self.refused_ttl, self.max_entries, self.clock = ttl, refused_ttl, max_entries, clock
        self._cache: OrderedDict[bytes, tuple[float, int, str]] = OrderedDict()
        self._lock = threading.Lock()
        self.reviews = 0  # TokenReviews sent (the cache's effect, for tests and the benchmark)

    def check(self, token: str) -> tuple[int, str]:
        if not token:
            return 401, f"no bearer token: send a service-account token of audience {AUDIENCE}"
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                self._cache.move_to_end(key)
                return hit[1], hit[2]
        try:
            self.reviews += 1
            status = self.review(token)
        except Exception as exc:  # noqa: BLE001 - the API server away: say so, cache nothing
            log.warning("pod view: TokenReview failed: %s", exc)
            return 503, f"cannot check the token now (TokenReview failed: {str(exc)[:200]})"
        code, answer = self._decide(status)
        with self._lock:
            self._cache[key] = (now + (self.ttl if code == 200 else self.refused_ttl), code, answer)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return code, answer

    def _decide(self, status: dict) -> tuple[int, str]:
        if not status.get("authenticated"):
            return 401, f"the API server refused the token for audience {AUDIENCE}: {status.get('error') or 'not authenticated'}"
        if AUDIENCE not in (status.get("audiences") or []):
            return 401, f"the token is not for audience {AUDIENCE}"
        user = status.get("user") or {}
        name = user.get("username") or ""
        if name != self.user:
            return 403, f"{name[:200]!r} may not read the pod view: only the node pods' service account {self.user}"
        nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
        if len(nodes) != 1 or not nodes[0]:
            return 403, ("the token names no node: send the pod's projected token (bound to a pod on a node; "
                         "Kubernetes 1.30+ records its node)")
        return 200, nodes[0]


# -- the server ----------------------------------------------------------------------------------
class _BoundedServer(ThreadingHTTPServer):
    """A thread per request, at most `limit` at once: one more is answered 503 at once (the node
    side takes that as "cannot tell" and asks again), so a node holding connections open cannot
    grow the executor's threads without bound; each connection also times out (`Handler.timeout`)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, limit: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(limit)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class PodViewServer:
    """``GET /v1/pods`` on a daemon thread: {"node": <the caller's node>, "items": [pod, ...]}."""

    def __init__(self, index: PodIndex, tokens: TokenCheck, *, max_requests: int = 64,
                 request_timeout: float = 10.0) -> None:
        self.index, self.tokens = index, tokens
        self.max_requests, self.request_timeout = max_requests, request_timeout
        self._server: ThreadingHTTPServer | None = None

    def answer(self, path: str, authorization: str | None) -> tuple[int, bytes]:
        if path.split("?", 1)[0] != "/v1/pods":
            return 404, b"not found: the pod view serves GET /v1/pods\n"
        scheme, _, token = (authorization or "").partition(" ")
        code, what = self.tokens.check(token.strip() if scheme.lower() == "bearer" else "")
        if code != 200:
            return code, (what + "\n").encode()
        pods = self.index.on_node(what)
        if pods is None:
            return 503, b"the pod view is not in step with the API server yet (listing); ask again\n"
        return 200, b'{"node":' + json.dumps(what).encode() + b',"items":[' + b",".join(pods) + b"]}"

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start serving; returns the port (an ephemeral one when `port` is 0)."""
        view = self

        class Handler(BaseHTTPRequestHandler):
            timeout = view.request_timeout  # a connection that sends nothing is closed

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                code, body = view.answer(self.path, self.headers.get("Authorization"))
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if code == 200 else "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no access log per poll
                pass

        self._server = _BoundedServer((addr, port), Handler, self.max_requests)
        threading.Thread(target=self._server.serve_forever, name="pod-view-http", daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
