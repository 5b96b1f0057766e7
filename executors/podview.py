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
import io
import json
import logging
import socket
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from xidstream.transport.identity import _sa_user
from xidstream.transport.podview import AUDIENCE

__all__ = ["project", "PodIndex", "PodWatch", "TokenCheck", "PodViewServer", "NODE_NAME_EXTRA", "review_with"]

log = logging.getLogger(__name__)

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


# -- what a node is shown of a pod ----------------------------------------------------------------
MAX_ARGS = 32  # items of a container's command, and of its args, kept in the index
MAX_ARG_CHARS = 256  # characters of each item kept
MAX_IMAGE_CHARS = 1024


def _cut(items: Any) -> list[str]:
    """At most MAX_ARGS items of at most MAX_ARG_CHARS characters each, the cut noted (a tenant's
    pod may carry megabytes of args: the index holds every pod of the cluster)."""
    items = items if isinstance(items, list) else [items]
    out = [s if len(s) <= MAX_ARG_CHARS else s[:MAX_ARG_CHARS] + "...(cut)"
           for s in (str(i) for i in items[:MAX_ARGS])]
    if len(items) > MAX_ARGS:
        out.append(f"...({len(items) - MAX_ARGS} more cut)")
    return out


def _container(c: dict) -> dict:
    # image, command and args: kured's pod is known by its image and its --period flag
    # (executors.reboot); resources: whether the pod asks for a GPU (executors.kube.requests_gpu).
    # command and args are cut (MAX_ARGS, MAX_ARG_CHARS): kured's flags are short and few
    got = {k: c[k] for k in ("name", "image", "command", "args", "resources") if c.get(k) is not None}
    for k in ("command", "args"):
        if k in got:
            got[k] = _cut(got[k])
    if isinstance(got.get("image"), str) and len(got["image"]) > MAX_IMAGE_CHARS:
        got["image"] = got["image"][:MAX_IMAGE_CHARS]
    return got


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
    threads read.

    `stale_after`: seconds without a sign of life from the watch (a listing, an event, a watch the
    API server ended on time) after which the index answers None as when not synced: a half-open
    watch connection (lightkube turns the watch's read timeout off) would otherwise serve old pods
    forever (PodWatch relists then)."""

    def __init__(self, *, stale_after: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._by_node: dict[str, dict[str, bytes]] = {}
        self._node_of: dict[str, str] = {}  # uid -> node
        self.synced = False
        self.stale_after, self.clock = stale_after, clock
        self.alive_at = clock()

    @staticmethod
    def _uid(pod: dict) -> str:
        meta = pod.get("metadata") or {}
        return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"

    @staticmethod
    def _put_into(by_node: dict[str, dict[str, bytes]], node_of: dict[str, str], pod: dict) -> None:
        uid = PodIndex._uid(pod)
        PodIndex._drop_from(by_node, node_of, uid)
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            return  # not bound yet: on no node's list
        by_node.setdefault(node, {})[uid] = json.dumps(project(pod), separators=(",", ":")).encode()
        node_of[uid] = node

    @staticmethod
    def _drop_from(by_node: dict[str, dict[str, bytes]], node_of: dict[str, str], uid: str) -> None:
        node = node_of.pop(uid, None)
        if node is not None:
            pods = by_node.get(node, {})
            pods.pop(uid, None)
            if not pods:
                by_node.pop(node, None)

    def alive(self) -> None:
        """The watch is in step (a listing, an event, a watch ended by the API server on time)."""
        self.alive_at = self.clock()

    def stale(self) -> bool:
        return self.stale_after is not None and self.clock() - self.alive_at > self.stale_after

    def replace(self, pods: Any) -> None:
        """A fresh listing (an iterable of pod dicts, projected one by one as it comes, chunk by
        chunk): what it lacks was deleted while we were not watching."""
        by_node: dict[str, dict[str, bytes]] = {}
        node_of: dict[str, str] = {}
        for p in pods:
            self._put_into(by_node, node_of, p)
            self.alive()
        with self._lock:
            self._by_node, self._node_of = by_node, node_of
            self.synced = True
        self.alive()

    def apply(self, kind: str, pod: dict) -> None:
        with self._lock:
            if kind == "DELETED":
                self._drop_from(self._by_node, self._node_of, self._uid(pod))
            elif kind in ("ADDED", "MODIFIED"):
                self._put_into(self._by_node, self._node_of, pod)
        self.alive()

    def unsynced(self) -> None:
        with self._lock:
            self.synced = False

    def on_node(self, node: str) -> list[bytes] | None:
        """The node's pods (JSON each); None while the index is not in step with the API server
        (not listed yet, the watch broken, or silent past `stale_after`)."""
        with self._lock:
            if not self.synced or self.stale():
                return None
            return list(self._by_node.get(node, {}).values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._node_of)


class PodWatch:
    """List every pod (in chunks of `chunk_size`), then watch from the list's resourceVersion, into
    `index`, in a thread. The API server ends each watch after `watch_timeout` s (timeoutSeconds):
    it lists again then, so a watch is never trusted for longer. On 410 Gone, and after any other
    failure (with a back-off), it lists again; between a failure and the next list the index says
    it is not in step. A watch that stays silent past `stale_after` (a half-open connection: no
    read timeout on a watch) is abandoned: the index answers 503 and a fresh worker lists again
    (the stuck one, if it ever wakes, writes nothing)."""

    def __init__(self, client: Any, index: PodIndex, *, watch_timeout: int = 300, chunk_size: int = 500,
                 stale_after: float | None = None, check_every: float = 10.0) -> None:
        self.client, self.index = client, index
        self.watch_timeout, self.chunk_size, self.check_every = watch_timeout, chunk_size, check_every
        if index.stale_after is None:
            index.stale_after = stale_after if stale_after is not None else 2.0 * watch_timeout + 60.0
        self._stop = threading.Event()
        self._gen = 0
        self.restarts = 0  # workers abandoned as stuck (for tests)
        self._thread = threading.Thread(target=self._supervise, name="pod-view-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # seen at the next event (the threads are daemons)

    def _current(self, gen: int) -> bool:
        return gen == self._gen and not self._stop.is_set()

    def _once(self, gen: int) -> None:
        from lightkube import ApiError
        from lightkube.resources.core_v1 import Pod

        listing = self.client.list(Pod, namespace="*", chunk_size=self.chunk_size)
        pods = (p.to_dict() for p in listing)  # one chunk at a time, projected as it comes
        if not self._current(gen):
            return
        self.index.replace(pods)
        log.info("pod view: %d pods listed", len(self.index))
        try:
            for kind, pod in self.client.watch(Pod, namespace="*", resource_version=listing.resourceVersion,
                                               server_timeout=self.watch_timeout):
                if not self._current(gen):
                    return
                self.index.apply(kind, pod.to_dict())
            self.index.alive()  # the API server ended the watch on time: list again
        except ApiError as exc:
            if exc.status.code != 410:
                raise
            log.info("pod view: the watch's resourceVersion is gone (410); listing again")

    def _run(self, gen: int) -> None:
        backoff = 1.0
        while self._current(gen):
            try:
                self._once(gen)
                backoff = 1.0
            except Exception as exc:  # noqa: BLE001 - API restarts and timeouts are routine
                if not self._current(gen):
                    return
                self.index.unsynced()
                log.warning("pod view: the pod watch failed (%s); answering 503 until the next list, in %.0f s",
                            exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _spawn(self) -> None:
        self._gen += 1
        self.index.alive()  # the new worker's own time to list
        threading.Thread(target=self._run, args=(self._gen,), name=f"pod-view-watch-{self._gen}", daemon=True).start()

    def _supervise(self) -> None:
        self._spawn()
        while not self._stop.wait(self.check_every):
            if self.index.stale():
                self.restarts += 1
                log.warning("pod view: the pod watch was silent for over %.0f s; answering 503 and listing again",
                            self.index.stale_after)
                self.index.unsynced()
                self._spawn()


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
class _RequestTooLarge(Exception):
    """A connection sent more than its byte budget before its request was complete."""


class _BudgetedSocket(io.RawIOBase):
    """A connection's reads, bounded as a whole: at most `budget` bytes, and nothing past
    `deadline` (time.monotonic()); the socket's timeout is set to the time left before each read,
    so a client trickling a byte at a time cannot hold its slot past the deadline, nor make the
    stdlib buffer 100 header lines of 64 KiB."""

    def __init__(self, sock: socket.socket, budget: int, deadline: float) -> None:
        super().__init__()
        self.sock, self.budget, self.deadline = sock, budget, deadline
        self.count = 0  # bytes read from the socket

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.count >= self.budget:
            raise _RequestTooLarge(f"over {self.budget} bytes")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the connection's deadline passed")
        self.sock.settimeout(left)
        view = memoryview(b)[: min(len(b), self.budget - self.count)]
        n = self.sock.recv_into(view)
        self.count += n
        return n


class _BoundedServer(ThreadingHTTPServer):
    """A thread per request, at most `limit` at once: one more is answered 503 at once (the node
    side takes that as "cannot tell" and asks again), so a node holding connections open cannot
    grow the executor's threads without bound; each connection has a deadline and a byte budget
    for its request (`_BudgetedSocket`)."""

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

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client gone mid-answer is routine: no traceback per connection (stdlib prints one)
        log.debug("pod view: connection from %s ended with an error", client_address, exc_info=True)


class PodViewServer:
    """``GET /v1/pods`` on a daemon thread: {"node": <the caller's node>, "items": [pod, ...]}.

    Each connection has `request_timeout` s from its accept to send its request, and at most
    `max_request_bytes` for its request line and headers (the view takes no body): past either it
    is closed (431 for the too large), so neither slow nor huge requests hold a slot or memory."""

    def __init__(self, index: PodIndex, tokens: TokenCheck, *, max_requests: int = 64,
                 request_timeout: float = 10.0, max_request_bytes: int = 16 * 1024) -> None:
        self.index, self.tokens = index, tokens
        self.max_requests, self.request_timeout, self.max_request_bytes = max_requests, request_timeout, max_request_bytes
        self.most_read = 0  # the most bytes any connection's request read (for tests)
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

            def setup(self) -> None:
                super().setup()
                self.rfile.close()
                self._raw = _BudgetedSocket(self.connection, view.max_request_bytes,
                                            time.monotonic() + view.request_timeout)
                self.rfile = io.BufferedReader(self._raw, 4096)

            def handle(self) -> None:
                try:
                    super().handle()
                except _RequestTooLarge:
                    log.debug("pod view: %s sent a request over %d bytes; closed", self.client_address,
                              view.max_request_bytes)
                    try:
                        self.connection.settimeout(1.0)
                        self.connection.sendall(b"HTTP/1.0 431 Request Header Fields Too Large\r\n"
                                                b"Content-Length: 0\r\nConnection: close\r\n\r\n")
                    except OSError:
                        pass
                    self.close_connection = True
                except OSError as exc:  # the deadline (TimeoutError), a reset: close quietly
                    log.debug("pod view: connection from %s closed: %s", self.client_address, exc)
                    self.close_connection = True
                finally:
                    view.most_read = max(view.most_read, self._raw.count)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.connection.settimeout(view.request_timeout)  # for the answer: the request is in
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
