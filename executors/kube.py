"""The one Kubernetes client (lightkube) and the few things the executors need on top of it.

The client and the list-then-watch loop are `xidstream.transport.kube`'s (shared with the collector's pod
watch); `make_client` and `list_then_watch` are re-exported here.

Why lightkube ("One Kubernetes client"): it is small (pure Python over httpx, ~4 MB
with its models) where the official `kubernetes` package is a large generated client; its
in-cluster config authenticates with `BearerTokenFileAuth`, which re-reads the projected
service-account token when the server answers 401 (bound tokens are rotated by the kubelet and
expire within the hour; a client that reads the token once stops working); `list` returns the
collection's resourceVersion and `watch(resource_version=...)` resumes from it (on 410 Gone we
re-list, `list_then_watch`); the Eviction subresource is `Pod.Eviction`; and any resource, served
or not in its models, is reachable as a generic resource (`create_global_resource`), which is how
DeviceTaintRule is addressed in whichever resource.k8s.io version the server serves.

Everything here is a thin helper; the actions are in `xidstream.executors.cluster` and `xidstream.executors.node`.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from lightkube import ApiError, Client
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Event, Node, Pod

from xidstream.schemas.base import plain_text
from xidstream.transport.kube import list_then_watch
from xidstream.transport.kube import make_client as _make_client
from xidstream.transport.podview import PodViewClient

__all__ = ["make_client", "discover_version", "record_event", "pods_on_node", "is_daemonset_pod", "is_mirror_pod",
           "list_then_watch", "ApiError", "EVENT_NAMESPACE", "COMPONENT"]

log = logging.getLogger(__name__)

COMPONENT = "xidstream-executor"
# Events about cluster-scoped objects (Nodes) live in `default`: where `kubectl describe node` looks.
EVENT_NAMESPACE = "default"


def make_client(kubeconfig: str | Path | None = None, *, timeout: float = 15.0) -> Client:
    """xidstream.transport.kube's client, writing as the executor's field manager."""
    return _make_client(kubeconfig, timeout=timeout, field_manager=COMPONENT)


def discover_version(client: Client, group: str, resource: str, preferred: tuple[str, ...] = ()) -> str | None:
    """The version of `group` that serves `resource` (API discovery: GET /apis/<group>, then each
    version's resource list), the server's preferred version first; None when none serves it.

    lightkube has no discovery call, so this goes through its own HTTP client (same auth and TLS)."""
    http = client._client._client  # lightkube's httpx client; no public raw-GET exists
    resp = http.get(f"/apis/{group}")
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    doc = resp.json()
    versions = [v["version"] for v in doc.get("versions", [])]
    pref = (doc.get("preferredVersion") or {}).get("version")
    order = [v for v in (*preferred, pref, *versions) if v]
    seen: set[str] = set()
    for version in order:
        if version in seen or version not in versions:
            continue
        seen.add(version)
        r = http.get(f"/apis/{group}/{version}")
        if r.status_code == 200 and resource in [x.get("name") for x in r.json().get("resources", [])]:
            return version
    return None


def device_taint_rule_resource(version: str) -> Any:
    return create_global_resource("resource.k8s.io", version, "DeviceTaintRule", "devicetaintrules")


def record_event(client: Client, node: Any, *, reason: str, message: str, type_: str = "Normal",
                 action: str = "") -> None:
    """A core/v1 Event on the Node, so `kubectl describe node` shows why. Never fails the action it
    describes: a refused Event is logged (the result still carries the detail)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    name = node.metadata.name
    ev = Event.from_dict({
        "metadata": {"generateName": f"{name}.xidstream-", "namespace": EVENT_NAMESPACE},
        "involvedObject": {"kind": "Node", "name": name, "uid": node.metadata.uid, "apiVersion": "v1"},
        "reason": reason, "message": plain_text(message, 1024), "type": type_, "action": action or reason,
        "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    })
    try:
        client.create(ev, namespace=EVENT_NAMESPACE)
    except ApiError as exc:
        log.warning("could not record Event %s on node %s: %s", reason, name, exc)


def is_daemonset_pod(pod: Any) -> bool:
    return any(o.kind == "DaemonSet" for o in (pod.metadata.ownerReferences or []))


def is_mirror_pod(pod: Any) -> bool:
    # A static pod's API mirror: the kubelet owns it, the API cannot evict it.
    return "kubernetes.io/config.mirror" in (pod.metadata.annotations or {})


def requests_gpu(pod: Any) -> bool:
    """Whether the pod asks for a GPU: an extended resource of a GPU vendor (nvidia.com/gpu,
    nvidia.com/mig-*, amd.com/gpu, ...) in any container's requests or limits, or a DRA claim."""
    spec = pod.spec
    if spec is None:
        return False
    if getattr(spec, "resourceClaims", None):
        return True
    for c in [*(spec.containers or []), *(getattr(spec, "initContainers", None) or [])]:
        res = c.resources
        for amounts in (getattr(res, "requests", None) or {}, getattr(res, "limits", None) or {}) if res else ():
            if any(name.startswith(("nvidia.com/", "amd.com/gpu")) or "gpu" in name for name in amounts):
                return True
    return False


def kept_by_drain(pod: Any, keep_namespaces: tuple[str, ...] = ()) -> bool:
    """What a drain leaves on the node: DaemonSet pods (their controller ignores a cordon), mirror
    pods, and pods of `keep_namespaces` that request no GPU (--drain-keep-namespace: xidstream's own
    namespace in the chart, so a drain never evicts the processor and the cluster executor carrying
    out the incident; on a one-node cluster they would stay Pending behind the cordon and the loop
    would stop, as seen on the real node of `make e2e`). A pod there that asks for a GPU is drained
    like any other: a release installed into a shared namespace (`default`) must not shield tenants."""
    if is_daemonset_pod(pod) or is_mirror_pod(pod):
        return True
    return pod.metadata.namespace in keep_namespaces and not requests_gpu(pod)


def pods_on_node(client: Client | None, node: str, view: PodViewClient | None = None) -> list[Any]:
    """Pods bound to `node` that still run or may run (not Succeeded/Failed).

    With `view` (the chart's node pods: transport.podview), asked of the cluster executor's pod
    view, which answers for this pod's own node only; `PodViewError` when it cannot tell, never an
    empty list. Without, listed on the API server (a pod list in every namespace: the cluster
    executor's grant, or a kubeconfig's outside the chart)."""
    if view is not None:
        pods = view.pods(node)
    else:
        pods = client.list(Pod, namespace="*", fields={"spec.nodeName": node})
    return [p for p in pods if (p.status.phase if p.status else None) not in ("Succeeded", "Failed")]


def node_or_none(client: Client, name: str) -> Any:
    try:
        return client.get(Node, name)
    except ApiError as exc:
        if exc.status.code == 404:
            return None
        raise


def iter_names(pods: list[Any]) -> Iterator[str]:
    for p in pods:
        yield f"{p.metadata.namespace}/{p.metadata.name}"
