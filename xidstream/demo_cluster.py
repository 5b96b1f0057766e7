"""`xidstream demo-cluster` (`make demo-cluster`): the motivating incident through the closed loop.

    collectors (the scenario's fakes, the real collector code) -> Kafka -> `xidstream process
    --signing-key` -> gpu.remediation (signed) -> `xidstream execute --scope cluster --apply` and
    `xidstream execute --scope node --apply` -> the local kube-apiserver -> gpu.remediation.results
    -> the processor matches each result to its command -> the incident's timeline shows it

Everything is real but the GPU: the local broker, the local API server (`xidstream kube`), the
processor and both executors run as the real commands (subprocesses). The node `gpu-node-7` is
created on the API server with a Running/Ready vLLM pod (evicted by the drain) and the collector's
DaemonSet pod (kept). The node executor finds no GPU here (no NVML), so RESET_GPU is refused on its
precondition and says which (the reset never started); the processor reports it for an operator.
Should the processor command REBOOT_NODE, the node executor (kured backend) refuses it for good:
no kured pod runs on the demo's node, so its sentinel (a file in the run's folder, not /var/run)
would never be read; the processor then climbs to REPLACE_NODE.

Both executors start together, as they run in a cluster: CORDON_NODE, DRAIN_NODE and RESET_GPU
leave the processor together, and the node executor waits (`--precondition-wait`) for the node to
be cordoned and drained before checking RESET_GPU's other preconditions. No kubelet runs, so an
evicted pod stays terminating; the loop plays the kubelet's part and deletes it once the drain is
answered (`finish_evictions`).

Per-node identity is on, as in the chart: the collector's DaemonSet pod runs as the node service
account `xidstream-node`, and its pod-bound token (a TokenRequest bound to that pod, what the
kubelet projects) creates the node's CertificateSigningRequest; the API server marks it with the
pod's node. The cluster executor enrolls it (`--enroll-key`) and itself, the processor starts once
both enrollments are on `xidstream.identities` and believes only records and results carrying the
enrolled MAC (`--enroller-key`); the scenario's records carry the node's MAC.

`run_closed_loop` is also what tests/integration/test_closed_loop.py runs and checks.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, TextIO

from xidstream.schemas.errors import XidstreamError
from xidstream.schemas.models import Alert, RemediationCommand, RemediationResult
from xidstream.schemas.scenario import Scenario, load_scenario, parse_scenario
from xidstream.schemas.vocab import Action

__all__ = ["ClosedLoop", "run_closed_loop", "render", "register", "SCENARIO"]

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "scenarios" / "motivating-incident.yaml"
NODE = "gpu-node-7"
NODE_SA = "xidstream-node"  # the chart's node service account (its name without the release prefix)
NODE_ACTIONS = (Action.RESET_GPU, Action.REBOOT_NODE)


@dataclass
class ClosedLoop:
    node: str
    namespace: str
    t0: float  # wall clock (time.time()) when the collectors started
    commands: list[RemediationCommand] = field(default_factory=list)
    results: list[RemediationResult] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    arrived: dict[str, float] = field(default_factory=dict)  # event_id -> wall clock it was read
    node_obj: dict = field(default_factory=dict)
    pods: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)  # namespace/name: terminating after the drain
    sentinel: Path | None = None
    seconds: float = 0.0

    def result(self, action: Action) -> RemediationResult | None:
        return next((r for r in self.results if r.action == action), None)

    def timeline_alert(self) -> Alert | None:
        """The last alert whose timeline carries a matched outcome for each of cordon, drain, reset."""
        for a in reversed(self.alerts):
            if {Action.CORDON_NODE.value, Action.DRAIN_NODE.value, Action.RESET_GPU.value} <= _matched(a):
                return a
        return None


def _matched(alert: Alert) -> set[str]:
    return {e.data.get("action") for e in alert.evidence.timeline
            if e.kind == "remediation" and e.data.get("matched") is True}


def _scenario_for(node: str, start: datetime) -> Scenario:
    sc = load_scenario(SCENARIO)
    raw = sc.model_dump(mode="json", by_alias=True, exclude_none=True)
    for part in ("nodes", "timeline", "expect", "forbid"):
        for item in raw.get(part, []):
            key = "name" if part == "nodes" else "node"
            if item.get(key) == NODE:
                item[key] = node
    raw["start"] = start.isoformat()
    return parse_scenario(raw)


def _ok(status: int, body: Any, what: str, allowed: tuple[int, ...] = (200, 201)) -> Any:
    if status not in allowed:
        raise XidstreamError(f"{what}: HTTP {status}: {body}")
    return body


def prepare_node(kube: Any, node: str, namespace: str) -> None:
    """A fresh `node` with a Running/Ready vLLM pod in `namespace` (the drain evicts it) and the
    collector's DaemonSet pod (the drain keeps it); what a kubelet and controllers would report."""
    status, _ = kube.request("GET", f"/api/v1/nodes/{node}")
    if status == 200:  # a previous run's node: start from a clean one
        kube.request("DELETE", f"/api/v1/nodes/{node}")
    kube.ensure_namespace(namespace)
    for name in (f"vllm-1-{node}", f"xidstream-collector-{node}"):
        kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and kube.request("GET", f"/api/v1/nodes/{node}")[0] == 200:
        time.sleep(0.1)
    _ok(*kube.request("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "nvidia.com/gpu.present": "true"}}}),
        f"creating node {node}")
    # The node service account the collector's pod runs as, allowed to create CSRs (the chart's node
    # ClusterRole grants the same): its pod-bound token enrolls the node's identity.
    if kube.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{NODE_SA}")[0] == 404:
        _ok(*kube.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NODE_SA}}),
            f"creating service account {namespace}/{NODE_SA}")
    role = f"xidstream-demo-node-csr-{namespace}"
    for path, obj in (("clusterroles", {"metadata": {"name": role}, "kind": "ClusterRole",
                                        "rules": [{"apiGroups": ["certificates.k8s.io"],
                                                   "resources": ["certificatesigningrequests"], "verbs": ["create"]}]}),
                      ("clusterrolebindings", {"metadata": {"name": role}, "kind": "ClusterRoleBinding",
                                               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                           "name": role},
                                               "subjects": [{"kind": "ServiceAccount", "name": NODE_SA,
                                                             "namespace": namespace}]})):
        status, body = kube.request("POST", f"/apis/rbac.authorization.k8s.io/v1/{path}",
                                    {"apiVersion": "rbac.authorization.k8s.io/v1", **obj})
        if status != 409:
            _ok(status, body, f"creating {path[:-1]} {role}")
    pods = [(f"vllm-1-{node}", {"app": "vllm"}, None),
            (f"xidstream-collector-{node}", {"app": "xidstream-collector"},
             [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "xidstream-collector",
               "uid": str(uuid.uuid4()), "controller": True}])]
    for name, labels, owners in pods:
        meta: dict = {"name": name, "labels": labels}
        if owners:
            meta["ownerReferences"] = owners
        for _ in range(50):  # the previous run's pod of that name may still be going away
            status, body = kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
                         **({"serviceAccountName": NODE_SA} if owners else {})}})
            if status != 409:
                break
            time.sleep(0.1)
        _ok(status, body, f"creating pod {namespace}/{name}")
        kube.mark_pod_running_ready(namespace, name)


def node_pod_kubeconfig(kube: Any, node: str, namespace: str, path: Path) -> Path:
    """A kubeconfig holding what the collector's pod on `node` holds: a service-account token bound
    to that pod (TokenRequest with boundObjectRef, as the kubelet projects it), which the API server
    marks with the pod's node in every request it authenticates."""
    import yaml

    pod = f"xidstream-collector-{node}"
    meta = _ok(*kube.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}"), f"reading pod {pod}")["metadata"]
    body = _ok(*kube.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{NODE_SA}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": ["https://kubernetes.default.svc.cluster.local"], "expirationSeconds": 600,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod, "uid": meta["uid"]}}}),
        f"a token bound to pod {pod}")
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "node",
        "clusters": [{"name": "k", "cluster": {"server": kube.server, "certificate-authority": str(kube.ca_file)}}],
        "users": [{"name": "node", "user": {"token": body["status"]["token"]}}],
        "contexts": [{"name": "node", "context": {"cluster": "k", "user": "node"}}]}))
    path.chmod(0o600)
    return path


def wait_enrolled(settings: Any, identities: set[str], timeout: float) -> None:
    """Until each identity has an enrollment on xidstream.identities (the processor started after
    reads them all before it folds a record, so none of the scenario's is dead-lettered as 'not
    enrolled')."""
    from confluent_kafka import Consumer

    from xidstream.schemas.codec import decode_any
    from xidstream.transport.kafka import consumer_config

    consumer = Consumer({**consumer_config(settings, f"{settings.topic_prefix}demo-enrolled-{uuid.uuid4().hex[:6]}"),
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([settings.topics.name("xidstream.identities")])
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while not identities <= seen:
            if time.monotonic() > deadline:
                raise XidstreamError(f"closed loop: enrollments of {sorted(identities - seen)} did not appear on "
                                     f"xidstream.identities within {timeout:g} s (see executor-cluster.log)")
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                seen.add(decode_any(msg.value()).node)
    finally:
        consumer.close()


def finish_evictions(kube: Any, node: str) -> list[str]:
    """The kubelet's part of an eviction, which no kubelet plays here: the Eviction API marked the
    pod terminating (deletionTimestamp); once its containers stop, the kubelet deletes it. Until
    then RESET_GPU's "node drained" precondition rightly fails: the pod's processes may still hold
    the GPU. Returns the pods it finished."""
    pods = _ok(*kube.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}"), "listing pods")
    done = []
    for p in pods["items"]:
        meta = p["metadata"]
        if meta.get("deletionTimestamp"):
            kube.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}?gracePeriodSeconds=0")
            done.append(f"{meta['namespace']}/{meta['name']}")
    return done


class _Reader:
    """Reads the run's commands, results and alerts from the beginning (assign(): no group)."""

    def __init__(self, settings: Any, loop: ClosedLoop) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from xidstream.transport.kafka import admin, consumer_config

        self.loop = loop
        names = [settings.topics.name(n) for n in ("gpu.remediation", "gpu.remediation.results", "gpu.alerts")]
        md = admin(settings).list_topics(timeout=10)
        self.consumer = Consumer(consumer_config(settings, f"{settings.topic_prefix}xidstream-demo-cluster"))
        self.consumer.assign([TopicPartition(t, p, 0) for t in names for p in sorted(md.topics[t].partitions)])

    def read(self, timeout: float = 0.3) -> None:
        from xidstream.transport.kafka import consume_records

        for rec in consume_records(self.consumer, timeout):
            self.loop.arrived[rec.event_id] = time.time()
            if isinstance(rec, RemediationCommand):
                self.loop.commands.append(rec)
            elif isinstance(rec, RemediationResult):
                self.loop.results.append(rec)
            elif isinstance(rec, Alert):
                self.loop.alerts.append(rec)

    def until(self, done: Callable[[], bool], timeout: float, what: str, alive: Callable[[], str | None]) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise XidstreamError(f"closed loop: {what} did not happen within {timeout:g} s "
                                     f"(results so far: {[(r.action.value, r.outcome.value) for r in self.loop.results]})")
            dead = alive()
            if dead:
                raise XidstreamError(f"closed loop: waiting for {what}: {dead}")
            self.read()

    def close(self) -> None:
        self.consumer.close()


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xidstream.cli", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def run_closed_loop(bootstrap: str, kube: Any, workdir: Path, *, node: str = NODE, namespace: str = "ml",
                    timeout: float = 40.0, log: Callable[[str], None] | None = None) -> ClosedLoop:
    """Run the motivating incident through the closed loop; return what the topics and the API
    server show. Everything it started is stopped and its topics deleted (the API objects stay)."""
    from xidstream.collectors.scenario import ScenarioRunner
    from xidstream.collectors.sink import KafkaSink
    from xidstream.executors.enroll import request_enrollment
    from xidstream.executors.kube import make_client
    from xidstream.schemas.signing import SigningKey, generate_keys
    from xidstream.transport.identity import CLUSTER_IDENTITY, NodeIdentity, ProcessorIdentity
    from xidstream.transport.kafka import create_topics, delete_run
    from xidstream.runner import WorkerProcess
    from xidstream.settings import Settings

    say = log or (lambda m: None)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    settings = Settings(bootstrap=bootstrap, topic_prefix=f"loop-{uuid.uuid4().hex[:8]}.", partitions=1, node=node)
    # The scenario ends now: its commands (which expire 900 s after their evidence) are fresh by
    # the executors' wall clock, and the results they stamp come after the evidence.
    sc = load_scenario(SCENARIO)
    start = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=sc.duration + 5)
    sc = _scenario_for(node, start)
    for stale in ("identity", "identity-cluster"):  # a new run is a new install: fresh identities
        shutil.rmtree(workdir / stale, ignore_errors=True)
    priv, pub, _ = generate_keys(workdir / "keys")
    en_priv, en_pub, _ = generate_keys(workdir / "enroller")
    processor_identity = ProcessorIdentity(SigningKey.load(priv)).public
    prepare_node(kube, node, namespace)
    # The node's identity, enrolled as the collector's pod does it (--request-enrollment)
    ident = NodeIdentity.load_or_create(workdir / "identity", node)
    request_enrollment(make_client(node_pod_kubeconfig(kube, node, namespace, workdir / "node-pod.kubeconfig")), ident)
    loop = ClosedLoop(node=node, namespace=namespace, t0=time.time(), sentinel=workdir / "reboot-required")
    kafka = ["--bootstrap", bootstrap, "--topic-prefix", settings.topic_prefix]
    execute = ["execute", "--apply", "--verify-key", str(pub), "--kubeconfig", str(kube.kubeconfig),
               "--processor-identity", processor_identity, *kafka]
    worker = cluster = nodex = None
    reader = None
    try:
        create_topics(settings)
        cluster = _spawn([*execute, "--scope", "cluster", "--drain-timeout", "10",
                          "--enroll-key", str(en_priv), "--node-service-account", f"{namespace}/{NODE_SA}",
                          "--identity-dir", str(workdir / "identity-cluster"),
                          "--state-dir", str(workdir / "executor-cluster")], workdir / "executor-cluster.log")
        wait_enrolled(settings, {node, CLUSTER_IDENTITY}, max(timeout, 30))
        say(f"node {node} and the cluster executor enrolled (a CSR from the collector pod's bound token)")
        worker = WorkerProcess(settings, workdir, name="processor",
                               extra_args=["--signing-key", str(priv), "--enroller-key", str(en_pub)]).start()
        # RESET_GPU arrives with CORDON_NODE and DRAIN_NODE: the node executor waits for them
        nodex = _spawn([*execute, "--scope", "node", "--node", node, "--reboot-sentinel", str(loop.sentinel),
                        "--precondition-wait", f"{max(timeout, 15):g}", "--identity-dir", str(workdir / "identity"),
                        "--state-dir", str(workdir / "executor-node")], workdir / "executor-node.log")
        say(f"processor (signing, per-node identity on), cluster and node executors started; feeding "
            f"{sc.duration:.0f} s of the incident through the collectors")

        def alive() -> str | None:
            for name, proc, path in (("the processor", worker.proc, worker.log_path),
                                     ("the cluster executor", cluster, workdir / "executor-cluster.log"),
                                     ("the node executor", nodex, workdir / "executor-node.log")):
                if proc is not None and proc.poll() is not None:
                    tail = "\n".join(path.read_text(errors="replace").splitlines()[-20:])
                    return f"{name} exited (code {proc.returncode}):\n{tail}"
            return None

        sink = KafkaSink(settings, workdir / "spool", auth=ident.record_auth(processor_identity))
        loop.t0 = time.time()
        ScenarioRunner(sc, sink, start=start).run()
        if not sink.flush(30):
            raise XidstreamError(f"Kafka did not acknowledge the collectors' records: {sink.stats()}")
        sink.close()
        reader = _Reader(settings, loop)
        reader.until(lambda: loop.result(Action.CORDON_NODE) is not None and loop.result(Action.DRAIN_NODE) is not None,
                     timeout, "CORDON_NODE and DRAIN_NODE answered", alive)
        loop.evicted = finish_evictions(kube, node)
        say(f"node cordoned and drained ({', '.join(loop.evicted) or 'nothing'} evicted); the node executor "
            f"checks RESET_GPU's other preconditions")
        reader.until(lambda: loop.result(Action.RESET_GPU) is not None and loop.timeline_alert() is not None,
                     timeout, "RESET_GPU answered and an alert showing every step's outcome", alive)
        # a rung after the reset (a failed one climbs), when commanded without approval, is the node executor's too
        reboot = [c for c in loop.commands if c.action == Action.REBOOT_NODE and not c.requires_approval]
        if reboot:
            reader.until(lambda: loop.result(Action.REBOOT_NODE) is not None, 15, "REBOOT_NODE answered", alive)
        reader.read(0.5)
    finally:
        if reader is not None:
            reader.close()
        for proc in (nodex, cluster):
            _stop(proc)
        if worker is not None:
            worker.stop()
        try:
            delete_run(settings)
        except XidstreamError as exc:
            say(f"could not delete the run's topics (prefix {settings.topic_prefix}): {exc}")
    loop.node_obj = _ok(*kube.request("GET", f"/api/v1/nodes/{node}"), f"reading node {node}")
    pods = _ok(*kube.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}"), "listing pods")
    loop.pods = pods["items"]
    ev = _ok(*kube.request("GET", f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{node}"),
             "listing events")
    loop.events = sorted(ev["items"], key=lambda e: int(e["metadata"]["resourceVersion"]))  # etcd's order
    loop.seconds = time.monotonic() - started
    return loop


# -- output -------------------------------------------------------------------------------------
def _short(text: str, n: int = 150) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def render(loop: ClosedLoop, out: TextIO) -> None:
    w = out.write
    rel = lambda rec: f"+{loop.arrived.get(rec.event_id, loop.t0) - loop.t0:5.1f}s"  # noqa: E731
    w(f"\n== closed loop: motivating-incident on {loop.node}: {len(loop.commands)} signed command(s), "
      f"{len(loop.results)} result(s), {len(loop.alerts)} alert(s) in {loop.seconds:.1f} s\n")
    w("\n   commands (gpu.remediation, signed by the processor) -> results (gpu.remediation.results)\n")
    by_id = {r.command_id: r for r in loop.results}
    for c in loop.commands:
        r = by_id.get(c.command_id)
        held = " [needs approval]" if c.requires_approval else ""
        w(f"   {rel(c)}  step {c.step}: {c.action.value:<12} command {c.command_id[:12]} key {c.key_id}{held}\n")
        if r is not None:
            w(f"   {rel(r)}      -> {r.outcome.value.upper()} ({r.node}): {_short(r.detail or '', 140)}\n")
        else:
            w("             -> no result\n")
    n = loop.node_obj
    w(f"\n   node {loop.node} on the API server: unschedulable={bool(n['spec'].get('unschedulable'))}\n")
    for t in n["spec"].get("taints") or []:
        w(f"     taint {t['key']}={t.get('value', '')}:{t['effect']}\n")
    note = (n["metadata"].get("annotations") or {}).get("xidstream.io/cordon")
    if note:
        w(f"     annotation xidstream.io/cordon: {note}\n")
    w("\n   pods:\n")
    for name in loop.evicted:
        w(f"     {name}: EVICTED through the Eviction API (then deleted as its kubelet would once stopped)\n")
    for p in loop.pods:
        owner = ", ".join(o["kind"] for o in p["metadata"].get("ownerReferences") or []) or "no owner"
        state = "terminating" if p["metadata"].get("deletionTimestamp") else f"still on the node ({owner} pod: kept)"
        w(f"     {p['metadata']['namespace']}/{p['metadata']['name']}: {state}\n")
    w(f"\n   Events on node {loop.node} (kubectl describe node):\n")
    for e in loop.events:
        w(f"     {e.get('type', ''):<8} {e.get('reason', ''):<26} {_short(e.get('message', ''), 110)}\n")
    if loop.sentinel is not None and loop.sentinel.exists():
        w(f"\n   reboot sentinel for kured: {_short(loop.sentinel.read_text(), 140)}\n")
    a = loop.timeline_alert()
    if a is not None:
        w(f"\n   the incident's timeline ({a.classification.value}, {a.state}: {_short(a.summary, 110)}):\n")
        for e in a.evidence.timeline:
            if e.kind == "remediation":
                mark = ("matched" if e.data["matched"] else "unmatched") if "matched" in e.data else "plan"
                w(f"     {e.ts:%H:%M:%S}  [{mark}] {_short(e.summary, 130)}\n")
    out.flush()


def _demo_cluster(args: argparse.Namespace, settings: Any) -> int:
    from workshop.localbroker import LocalBroker
    from workshop.localkube import LocalKube

    say = (lambda m: print(f"xidstream demo-cluster: {m}", file=sys.stderr, flush=True))
    broker = kube = None
    workdir = Path(tempfile.mkdtemp(prefix="xidstream-demo-cluster-"))
    try:
        bootstrap = args.bootstrap
        if not bootstrap:
            local_broker = LocalBroker()
            if local_broker.pid() is None:  # ours to stop; one already running is used and left running
                say("starting the local Kafka broker ...")
                broker = local_broker
            bootstrap = local_broker.start()
        local = LocalKube()
        if local.pid("kube-apiserver") is None:
            say("starting the local Kubernetes API server ...")
            kube = local
        handle = local.start()
        loop = run_closed_loop(bootstrap, handle, workdir, node=args.node, timeout=args.timeout, log=say)
        render(loop, sys.stdout)
        ok = loop.timeline_alert() is not None and bool(loop.node_obj["spec"].get("unschedulable"))
        return 0 if ok else 1
    finally:
        if kube is not None:
            say("stopping the local Kubernetes API server")
            kube.stop()
        if broker is not None:
            say("stopping the local Kafka broker")
            broker.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo-cluster", help="the motivating incident through the closed loop on the local broker and "
                                            "the local Kubernetes API server (make demo-cluster)")
    p.add_argument("--bootstrap", help="a running broker (default: the local one, started and stopped if not running)")
    p.add_argument("--node", default=NODE, help=f"the node's name on the API server (default {NODE})")
    p.add_argument("--timeout", type=float, default=40.0, help="seconds each wait may take (default 40)")
    p.add_argument("--keep", action="store_true", help="keep the run's folder (processor and executor logs)")
    p.set_defaults(handler=_demo_cluster)
