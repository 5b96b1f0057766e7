"""The node side of the pod view: the pods bound to this node, asked of the cluster executor.

Why a view and not the API: the node pods' service account is shared by every GPU node, and RBAC
cannot confine a pod list to one node (a field selector is the client's choice, not the grant's),
so a grant to list pods let any one compromised node read every pod of every namespace. The
cluster executor already lists pods cluster-wide for its drains; it keeps a watch of them and
answers ``GET /v1/pods`` with the pods bound to the caller's node only, the node named by the API
server itself: the caller sends a service-account token of audience ``xidstream-pod-view``
(a projected token the kubelet rotates, bound to the caller's pod) and the view checks it with a
TokenReview, whose answer carries the pod's node (``authentication.kubernetes.io/node-name``).
This is what the Node authorizer does for kubelets (executors.podview is the server).

What an adversary controls: a compromised node holds its own token, so it reads its own node's
pods, as its kubelet does; the answers are the API server's objects, trimmed to what the node's
callers read (no env, no volumes). A caller that cannot tell (view unreachable, not yet in step
with the API server, token refused) gets `PodViewError`, never an empty list: for the node
executor an empty list means "drained".

The token file is read at each request: the kubelet rewrites it before it expires.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from xidstream.schemas.errors import XidstreamError

__all__ = ["AUDIENCE", "DEFAULT_PORT", "TOKEN_PATH", "PodViewClient", "PodViewError"]

AUDIENCE = "xidstream-pod-view"
DEFAULT_PORT = 9466
TOKEN_PATH = "/var/run/secrets/xidstream/pod-view/token"  # where the chart mounts the projected token
MAX_BYTES = 64 << 20  # a node runs at most a few hundred pods; far over that is not a pod list


class PodViewError(XidstreamError):
    """The pod view could not say which pods are on this node (unreachable, refused, not in step)."""


class PodViewClient:
    """GET the view with this pod's token. `dicts()` for the collector (plain pod dicts),
    `pods()` for the executors (lightkube Pod objects, as `client.list(Pod, ...)` gives them)."""

    def __init__(self, url: str, token_path: str | Path = TOKEN_PATH, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/") + "/v1/pods"
        self.token_path = Path(token_path)
        self.timeout = timeout

    def _token(self) -> str:
        try:
            token = self.token_path.read_text().strip()
        except OSError as exc:
            raise PodViewError(f"cannot read the pod-view token {self.token_path}: {exc.strerror or exc} "
                               f"(the chart mounts a projected token of audience {AUDIENCE} there)") from None
        if not token:
            raise PodViewError(f"the pod-view token {self.token_path} is empty")
        return token

    def fetch(self) -> tuple[str, list[dict]]:
        """(the node the view answered for, its pods as dicts). PodViewError when it cannot say."""
        req = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self._token()}",
                                                        "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 - the URL is the operator's flag
                raw = resp.read(MAX_BYTES + 1)
        except urllib.error.HTTPError as exc:
            why = exc.read(2000).decode("utf-8", "replace").strip()
            raise PodViewError(f"pod view {self.url} answered HTTP {exc.code}: {why or exc.reason}") from None
        except (OSError, ValueError) as exc:  # refused, DNS, timeout, a malformed URL
            raise PodViewError(f"pod view {self.url} unreachable: {getattr(exc, 'reason', None) or exc}") from None
        if len(raw) > MAX_BYTES:
            raise PodViewError(f"pod view {self.url} answered over {MAX_BYTES} bytes")
        try:
            doc = json.loads(raw)
            node, items = doc["node"], doc["items"]
            if not isinstance(node, str) or not isinstance(items, list) or \
                    not all(isinstance(p, dict) for p in items):
                raise TypeError("node is not a string or items not a list of objects")
        except (ValueError, KeyError, TypeError) as exc:
            raise PodViewError(f"pod view {self.url} answered something that is not a pod list: {exc}") from None
        return node, items

    def dicts(self, node: str) -> list[dict]:
        """The pods on `node`. The view answers for the caller's own node, whatever it asks:
        another node's name here is a misconfiguration (--node not this pod's node), said loudly."""
        answered, items = self.fetch()
        if answered != node:
            raise PodViewError(f"pod view answered for node {answered!r}, this is {node!r}: the token is of a pod "
                               f"on another node (check --node / spec.nodeName)")
        return items

    def pods(self, node: str) -> list[Any]:
        from lightkube.resources.core_v1 import Pod

        out = []
        for item in self.dicts(node):
            try:
                out.append(Pod.from_dict(item))
            except Exception as exc:  # noqa: BLE001 - lightkube raises several kinds for a bad object
                raise PodViewError(f"pod view answered an object that is not a Pod: {exc}") from None
        return out
