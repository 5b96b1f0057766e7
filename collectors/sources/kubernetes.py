"""Which pod holds which GPU, and pod failures on this node (`gpu.workloads`).

- The kubelet's pod-resources API (gRPC on ``/var/lib/kubelet/pod-resources/kubelet.sock``,
  ``v1.PodResourcesLister/List``) says which containers were given which devices; for
  ``nvidia.com/gpu`` the device ids are GPU (or MIG) UUIDs. The response is decoded here with a
  few lines of protobuf wire format instead of generated stubs: the three messages are stable (k8s
  ``kubelet/pkg/apis/podresources/v1/api.proto``).
- The pods on this node give the transitions: started, failed (exit code, reason), restarted,
  succeeded. In the chart they come from the cluster executor's pod view (``PodViewPoller``,
  transport.podview: every 10 s, the pods of this pod's own node, as the API server names it; the
  node pods may not read pods on the API server). Outside it, from a Kubernetes API watch
  (``PodWatcher``, ``fieldSelector=spec.nodeName=<node>``; lightkube through ``xidstream.transport.kube``).

Off cleanly when not on Kubernetes: `from_environment` returns None when there is no API or socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from xidstream.schemas.limits import JOB_MAX

__all__ = [
    "ContainerDevices", "decode_pod_resources", "PodResourcesClient", "pod_transitions",
    "PodWatcher", "PodViewPoller", "diff_pods", "KubernetesWorkloads", "from_environment", "job_of", "JOB_LABELS",
]

log = logging.getLogger(__name__)

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


# -- protobuf wire format (just what List's response needs) -------------------------------------
def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(data: bytes):
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field_no, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
            if pos > len(data):
                raise ValueError("truncated field")
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield field_no, wire, value


@dataclass(frozen=True)
class ContainerDevices:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


def decode_pod_resources(data: bytes) -> list[ContainerDevices]:
    """ListPodResourcesResponse{1: PodResources{1 name, 2 namespace, 3 ContainerResources{
    1 name, 2 ContainerDevices{1 resource_name, 2 device_ids}}}} -> flat list."""
    out = []
    for f, w, pod in _fields(data):
        if f != 1 or w != 2:
            continue
        name = namespace = ""
        containers = []
        for pf, pw, pv in _fields(pod):
            if pf == 1 and pw == 2:
                name = pv.decode()
            elif pf == 2 and pw == 2:
                namespace = pv.decode()
            elif pf == 3 and pw == 2:
                containers.append(pv)
        for c in containers:
            cname = ""
            devices = []
            for cf, cw, cv in _fields(c):
                if cf == 1 and cw == 2:
                    cname = cv.decode()
                elif cf == 2 and cw == 2:
                    resource, ids = "", []
                    for df, dw, dv in _fields(cv):
                        if df == 1 and dw == 2:
                            resource = dv.decode()
                        elif df == 2 and dw == 2:
                            ids.append(dv.decode())
                    devices.append((resource, tuple(ids)))
            for resource, ids in devices:
                out.append(ContainerDevices(namespace, name, cname, resource, ids))
    return out


class PodResourcesClient:
    def __init__(self, socket_path: str = POD_RESOURCES_SOCKET, timeout: float = 5.0) -> None:
        import grpc

        self._grpc = grpc
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        # No serializers: the request is empty and the response is decoded by hand.
        self._list = self.channel.unary_unary("/v1.PodResourcesLister/List")
        self.timeout = timeout

    def list(self) -> list[ContainerDevices]:
        return decode_pod_resources(self._list(b"", timeout=self.timeout))

    def close(self) -> None:
        self.channel.close()


# -- pod transitions (pure) ---------------------------------------------------------------------
def _statuses(pod: Mapping | None) -> dict[str, dict]:
    if not pod:
        return {}
    status = pod.get("status") or {}
    return {c.get("name", ""): c for c in (status.get("containerStatuses") or [])}


def _state(cs: Mapping) -> tuple[str, dict]:
    state = cs.get("state") or {}
    for kind in ("terminated", "running", "waiting"):
        if kind in state:
            return kind, state[kind] or {}
    return "unknown", {}


# Labels that name a pod's job, in order of preference: a batch Job's own, the older unprefixed one,
# Kubeflow training jobs, JobSet, LeaderWorkerSet. Whoever runs the pod sets them (untrusted): the
# fleet agent only groups alerts and holds by them (streams.storms).
JOB_LABELS = ("batch.kubernetes.io/job-name", "job-name", "training.kubeflow.org/job-name",
              "jobset.sigs.k8s.io/jobset-name", "leaderworkerset.sigs.k8s.io/name")


def job_of(meta: Mapping) -> str | None:
    """``namespace/name`` of the job a pod belongs to: a job label, else its controller owner
    (kind/name; a Deployment's pods name their ReplicaSet, which groups them as well), else None.
    Namespace-qualified so that two tenants' jobs of one name stay apart."""
    labels = meta.get("labels") or {}
    ns = meta.get("namespace") or ""
    job = None
    for label in JOB_LABELS:
        value = labels.get(label)
        if isinstance(value, str) and value:
            job = f"{ns}/{value}"
            break
    else:
        for owner in meta.get("ownerReferences") or meta.get("owner_references") or []:
            if owner.get("controller") and owner.get("name"):
                job = f"{ns}/{owner.get('kind') or '?'}/{owner['name']}"
                break
    # over the bound: no job rather than a cut one (two long names cut alike would merge two jobs)
    return job if job is None or len(job) <= JOB_MAX else None


def pod_transitions(old: Mapping | None, new: Mapping) -> list[dict]:
    """What changed for each container between two versions of a pod object."""
    meta = new.get("metadata") or {}
    base = {"pod_uid": meta.get("uid"), "namespace": meta.get("namespace"), "pod": meta.get("name"),
            "job": job_of(meta)}
    before, after = _statuses(old), _statuses(new)
    events = []
    for name, cs in after.items():
        prev = before.get(name, {})
        kind, detail = _state(cs)
        pkind, pdetail = _state(prev) if prev else ("none", {})
        restarts, prestarts = int(cs.get("restartCount") or 0), int(prev.get("restartCount") or 0)
        ev = dict(base, container=name)
        if prev and restarts > prestarts:
            last = (cs.get("lastState") or {}).get("terminated") or {}
            events.append(dict(ev, event="restarted", reason=last.get("reason"), exit_code=last.get("exitCode")))
            continue
        if kind == "running" and pkind != "running":
            events.append(dict(ev, event="started", reason=None, exit_code=None))
        elif kind == "terminated" and (pkind != "terminated" or pdetail.get("finishedAt") != detail.get("finishedAt")):
            code = detail.get("exitCode")
            events.append(dict(ev, event="succeeded" if code == 0 else "failed",
                               reason=detail.get("reason"), exit_code=code))
    return events


class PodWatcher:
    """Lists, then watches, the pods on one node through the Kubernetes API, in a thread.

    The client is lightkube's, through `xidstream.transport.kube` (the executors' too): the watch resumes
    from the list's resourceVersion, lists again on 410 Gone, and the in-cluster token is re-read
    when the API server answers 401 (bound service-account tokens are rotated). Other failures
    (the API server restarting) are retried with a backoff. Pods go on `q` as plain dicts."""

    def __init__(self, client: Any, node: str) -> None:
        self.client = client
        self.node = node
        self.q: queue.Queue[tuple[str, dict]] = queue.Queue(maxsize=100_000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # seen at the next event (the thread is a daemon)

    def _on_event(self, kind: str, pod: Any) -> bool:
        if self._stop.is_set():
            return False
        if kind in ("LISTED", "ADDED", "MODIFIED", "DELETED"):
            self.q.put((kind, pod.to_dict()))
        return True

    def _run(self) -> None:
        from lightkube.resources.core_v1 import Pod

        from xidstream.transport.kube import list_then_watch

        backoff = 1.0
        while not self._stop.is_set():
            try:
                list_then_watch(self.client, Pod, self._on_event, namespace="*",
                                fields={"spec.nodeName": self.node})
                return  # stopped
            except Exception as exc:  # noqa: BLE001 - API restarts and timeouts are routine
                if self._stop.is_set():
                    return
                log.warning("pod watch interrupted (%s); retrying in %.0f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)


def diff_pods(before: Mapping[str, dict] | None, after: list[dict]) -> list[tuple[str, dict]]:
    """Two consecutive views of a node's pods as watch events: LISTED for the first view (a state
    joined late), ADDED for a pod new since, MODIFIED for one that changed, DELETED for one gone. A
    pod gone between two polls was deleted: no transition is made of it."""
    now = {((p.get("metadata") or {}).get("uid") or ""): p for p in after}
    if before is None:
        return [("LISTED", p) for p in now.values()]
    events = [("ADDED", p) if uid not in before else ("MODIFIED", p) for uid, p in now.items()
              if before.get(uid) != p]
    events += [("DELETED", p) for uid, p in before.items() if uid not in now]
    return events


class PodViewPoller:
    """Polls the cluster executor's pod view (transport.podview) for this node's pods, in a thread,
    and puts what changed between two polls on `q` as watch events (`diff_pods`), as PodWatcher
    does. When the view cannot answer, the collector goes on with everything else: one warning,
    then quiet retries each poll, and a line when it answers again; the next answer is diffed
    against the last one seen."""

    def __init__(self, view: Any, node: str, interval: float = 10.0) -> None:
        self.view, self.node, self.interval = view, node, interval
        self.q: queue.Queue[tuple[str, dict]] = queue.Queue(maxsize=100_000)
        self._last: dict[str, dict] | None = None
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-view-poll", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self) -> bool:
        """One poll; False when the view could not answer."""
        try:
            pods = self.view.dicts(self.node)
        except Exception as exc:  # noqa: BLE001 - PodViewError, or anything else: the collector runs on
            if not self._failing:
                log.warning("pod view: %s; workload events wait for it (asking again every %.0f s)", exc, self.interval)
                self._failing = True
            return False
        if self._failing:
            log.info("pod view answers again: %d pod(s) on node %s", len(pods), self.node)
            self._failing = False
        for event in diff_pods(self._last, pods):
            self.q.put(event)
        self._last = {((p.get("metadata") or {}).get("uid") or ""): p for p in pods}
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval)


class KubernetesWorkloads:
    """`WorkloadSource` for the collector: pod transitions, each attributed to the GPUs the pod holds."""

    def __init__(self, watcher: PodWatcher | PodViewPoller | None, pod_resources: PodResourcesClient | None,
                 resources: tuple[str, ...] = ("nvidia.com/gpu",), refresh: float = 10.0) -> None:
        self.watcher = watcher
        self.pod_resources = pod_resources
        self.resources = resources
        self.refresh = refresh
        self._pods: dict[str, dict] = {}
        self._devices: dict[tuple[str, str], list[str]] = {}
        self._last_refresh = float("-inf")

    def _gpus_of(self, namespace: str, pod: str, force: bool = False) -> list[str]:
        now = time.monotonic()
        if self.pod_resources is not None and (force or now - self._last_refresh >= self.refresh):
            try:
                devices: dict[tuple[str, str], list[str]] = {}
                for c in self.pod_resources.list():
                    if c.resource in self.resources:
                        devices.setdefault((c.namespace, c.pod), []).extend(c.device_ids)
                self._devices = devices
            except Exception as exc:  # noqa: BLE001
                log.warning("pod-resources List failed: %s", exc)
            self._last_refresh = now
        return sorted(set(self._devices.get((namespace, pod), [])))

    def read(self) -> list[dict]:
        if self.watcher is None:
            return []
        out = []
        while True:
            try:
                kind, pod = self.watcher.q.get_nowait()
            except queue.Empty:
                break
            meta = pod.get("metadata") or {}
            uid = meta.get("uid", "")
            old = self._pods.get(uid)
            if kind == "DELETED":
                self._pods.pop(uid, None)
                continue
            self._pods[uid] = pod
            if kind == "LISTED" and old is None:
                continue  # a state we join late, not a transition we saw
            events = pod_transitions(old, pod)
            if not events:
                continue
            gpus = self._gpus_of(meta.get("namespace", ""), meta.get("name", ""))
            if not gpus:
                gpus = self._gpus_of(meta.get("namespace", ""), meta.get("name", ""), force=True)
            for gpu in gpus:
                out.extend(dict(e, gpu_uuid=gpu) for e in events)
        return out


def from_environment(env: Mapping[str, str], node: str, socket_path: str = POD_RESOURCES_SOCKET,
                     kubeconfig: str | None = None, pod_view: Any = None) -> KubernetesWorkloads | None:
    """The workload source when running in a Kubernetes pod (or given a kubeconfig, or a pod view:
    a transport.podview.PodViewClient), else None (and a log line)."""
    if pod_view is not None:
        if not Path(socket_path).exists():
            log.warning("%s missing: mount it to attribute pods to GPUs; workload events are off", socket_path)
            return None
        poller = PodViewPoller(pod_view, node)
        poller.start()
        return KubernetesWorkloads(poller, PodResourcesClient(socket_path))
    if not kubeconfig and not env.get("KUBERNETES_SERVICE_HOST"):
        log.info("not on Kubernetes (no KUBERNETES_SERVICE_HOST): workload events are off")
        return None
    if not Path(socket_path).exists():
        log.warning("%s missing: mount it to attribute pods to GPUs; workload events are off", socket_path)
        return None
    from xidstream.transport.kube import make_client

    try:
        client = make_client(kubeconfig, field_manager="xidstream-collector")
    except Exception as exc:  # noqa: BLE001 - the collector runs on without workload events
        log.warning("%s; workload events are off", exc)
        return None
    watcher = PodWatcher(client, node)
    watcher.start()
    return KubernetesWorkloads(watcher, PodResourcesClient(socket_path))
