"""The Helm chart (deploy/helm/xidstream): what `helm template` renders with the default and the
secure values, checked three ways:

- by content: the objects a platform team needs, and the chart's refusals (more processor replicas
  than partitions; kmsg without a privileged container);
- by `kubernetes-validate --strict` (its Python API, the same schemas) against Kubernetes 1.30-1.34;
- by the real local kube-apiserver (the `kube` fixture): `kubectl apply --dry-run=server` of every
  object into a namespace carrying the chart's Pod Security labels, and each workload's pod template
  created as a Pod with dryRun=All, so Pod Security Admission enforces the labels on it.

Helm is built once by `make helm` (~/.cache/xidstream/helm-v3.16.4/helm); a `helm` on the PATH or
XIDSTREAM_HELM=FILE is used instead when there. ServiceMonitor's CRD is absent on the local server:
the server checks render without it (as `helm install` does where the operator is not installed).
"""

from __future__ import annotations

import copy
import json
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.tools import find_tool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "xidstream"
SECURE = CHART / "values-secure.yaml"
HELM_CACHE = Path.home() / ".cache" / "xidstream" / "helm-v3.16.4" / "helm"
KUBE_VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"]
RUN = uuid.uuid4().hex[:6]


@pytest.fixture(scope="session")
def helm() -> str:
    return find_tool("XIDSTREAM_HELM", cached=HELM_CACHE, names=("helm",),
                     hint="run `make helm` (builds helm v3.16.4 into ~/.cache/xidstream once)")


def render(helm: str, *args: str, namespace: str = "xidstream", release: str = "xs", check: bool = True):
    """`helm template` -> (list of objects, completed process)."""
    # --kube-version: a helm built with `go install` has no ldflags and defaults to 1.20.
    cmd = [helm, "template", release, str(CHART), "-n", namespace, "--kube-version", "1.34.0", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    objs = [d for d in yaml.safe_load_all(proc.stdout) if d] if proc.returncode == 0 else []
    return objs, proc


def by_kind(objs: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    return out


def containers(obj: dict) -> dict[str, dict]:
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


EXPECTED_DEFAULT = {
    "ServiceAccount": {"xs-xidstream-node", "xs-xidstream-cluster-executor"},
    "ClusterRole": {"xs-xidstream-node", "xs-xidstream-cluster-executor", "xs-xidstream-events"},
    "ClusterRoleBinding": {"xs-xidstream-node", "xs-xidstream-cluster-executor"},
    "RoleBinding": {"xs-xidstream-node-events", "xs-xidstream-cluster-executor-events"},
    "ConfigMap": {"xs-xidstream-processor-policy", "xs-xidstream-dashboard"},
    "Service": {"xs-xidstream-collector-metrics", "xs-xidstream-pod-view"},
    "DaemonSet": {"xs-xidstream-node"},
    "Deployment": {"xs-xidstream-processor", "xs-xidstream-cluster-executor"},
    "PodDisruptionBudget": {"xs-xidstream-processor"},
    "Job": {"xs-xidstream-topics"},
    "NetworkPolicy": {"xs-xidstream-processor", "xs-xidstream-node", "xs-xidstream-cluster-executor"},
    "ValidatingAdmissionPolicy": {"xs-xidstream-cluster-executor-managed-nodes", "xs-xidstream-node-operand-labels"},
    "ValidatingAdmissionPolicyBinding": {"xs-xidstream-cluster-executor-managed-nodes", "xs-xidstream-node-operand-labels"},
}


# -- content -------------------------------------------------------------------------------------
def test_default_values_render_every_component(helm):
    objs, _ = render(helm)
    kinds = by_kind(objs)
    assert {k: set(v) for k, v in kinds.items()} == EXPECTED_DEFAULT

    ds = kinds["DaemonSet"]["xs-xidstream-node"]
    spec = pod_spec(ds)
    assert spec["hostPID"] is True
    assert spec["runtimeClassName"] == "nvidia"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # two terms = OR: either label schedules the collector
    assert [t["matchExpressions"][0]["key"] for t in terms] == [
        "nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"]
    assert {"operator": "Exists"} in spec["tolerations"]
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}

    c = containers(ds)
    col = c["collector"]
    # the host's journal, read by root with two named capabilities: no privileged container
    assert col["args"][:3] == ["collect", "--kernel-log", "journal"]
    assert col["securityContext"]["privileged"] is False
    assert col["resources"] == {"requests": {"cpu": "20m", "memory": "96Mi"}, "limits": {"cpu": "200m", "memory": "192Mi"}}
    assert col["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert col["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9464} in col["ports"]
    i = col["args"].index("--metrics-addr")
    assert col["args"][i + 1] == "0.0.0.0"
    env = {e["name"]: e for e in col["env"]}
    assert env["XIDSTREAM_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["XIDSTREAM_BOOTSTRAP"]["value"] == "kafka-kafka-bootstrap.kafka.svc:9092"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "--kafka-config" not in col["args"]  # plaintext by default

    nx = c["node-executor"]
    assert nx["args"][:5] == ["execute", "--scope", "node", "--node", "$(XIDSTREAM_NODE)"]
    assert "--apply" not in nx["args"]  # dry run by default
    # RESET_GPU asks the collector to release NVML through the state directory both containers mount
    assert nx["args"][nx["args"].index("--collector-state-dir") + 1] == col["args"][col["args"].index("--state-dir") + 1]
    assert {m["name"]: m["mountPath"] for m in nx["volumeMounts"]}["state"] == \
        {m["name"]: m["mountPath"] for m in col["volumeMounts"]}["state"]
    assert ["--verify-key", "/etc/xidstream/verify/signing.pub"] == nx["args"][nx["args"].index("--verify-key"):][:2]

    proc = kinds["Deployment"]["xs-xidstream-processor"]
    p = containers(proc)["processor"]
    assert proc["spec"]["replicas"] == 2
    assert p["args"][p["args"].index("--signing-key") + 1] == "/etc/xidstream/signing/signing.key"
    assert p["args"][p["args"].index("--store") + 1] == "memory://"
    assert pod_spec(proc)["securityContext"]["runAsNonRoot"] is True
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(p)
    pref = pod_spec(proc)["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert {e["key"] for e in pref["preference"]["matchExpressions"]} == {
        "nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    assert all(e["operator"] == "DoesNotExist" for e in pref["preference"]["matchExpressions"])
    assert kinds["PodDisruptionBudget"]["xs-xidstream-processor"]["spec"]["maxUnavailable"] == 1

    job = kinds["Job"]["xs-xidstream-topics"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert containers(job)["topics"]["args"] == ["topics", "create"]


def test_cluster_executor_rbac_is_exactly_the_calls_it_makes(helm):
    kinds = by_kind(render(helm)[0])
    rules = kinds["ClusterRole"]["xs-xidstream-cluster-executor"]["rules"]
    grants = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert grants == {
        ("", "nodes", "get"), ("", "nodes", "patch"), ("", "nodes/status", "patch"),
        ("", "pods", "list"), ("", "pods/eviction", "create"),
        ("resource.k8s.io", "devicetaintrules", "create"), ("resource.k8s.io", "devicetaintrules", "delete"),
        ("certificates.k8s.io", "certificatesigningrequests", "list"),  # the enroller (identity, on by default)
        # the pod view: its index of every pod (a watch), and who asks (a TokenReview names the node)
        ("", "pods", "watch"), ("authentication.k8s.io", "tokenreviews", "create"),
    }
    assert kinds["ClusterRole"]["xs-xidstream-events"]["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    for rb in kinds["RoleBinding"].values():  # Events only in `default`, where the executors write them
        assert rb["metadata"]["namespace"] == "default"
        assert rb["roleRef"]["name"] == "xs-xidstream-events"
    node_rules = kinds["ClusterRole"]["xs-xidstream-node"]["rules"]
    # nodes patch: the node executor pauses its own node's GPU Operator labels for a reset (held to
    # that by the admission policy node-operand-labels); without pauseOperands, get alone. No pods:
    # the node pods read their own node's pods through the cluster executor's pod view.
    # certificatesigningrequests create: the node's identity enrollment (identity, on by default)
    assert {(r["resources"][0], tuple(r["verbs"])) for r in node_rules} == {
        ("nodes", ("get", "patch")), ("certificatesigningrequests", ("create",))}
    kinds = by_kind(render(helm, "--set", "nodeExecutor.pauseOperands=false")[0])
    assert {(r["resources"][0], tuple(r["verbs"])) for r in kinds["ClusterRole"]["xs-xidstream-node"]["rules"]} == {
        ("nodes", ("get",)), ("certificatesigningrequests", ("create",))}
    assert "xs-xidstream-node-operand-labels" not in kinds["ValidatingAdmissionPolicy"]


@pytest.mark.parametrize("values, flag, nodes_get", [
    ([], "topology.kubernetes.io/rack", True),
    (["collector.rackLabel=example.com/rack"], "example.com/rack", True),
    (["nodeExecutor.enabled=false"], "topology.kubernetes.io/rack", True),  # the collector's rack alone needs it
    (["collector.rackLabel=", "nodeExecutor.enabled=false"], "", False),  # nobody reads a Node: no grant
    (["collector.rackLabel="], "", True),  # the node executor still reads its Node
])
# (pauseOperands off here: with it the node executor also patches its Node's operand labels,
# test_cluster_executor_rbac_is_exactly_the_calls_it_makes)
def test_the_rack_label_is_the_collectors_flag_and_grants_only_get_on_nodes(helm, values, flag, nodes_get):
    values = [*values, "nodeExecutor.pauseOperands=false"]
    kinds = by_kind(render(helm, *[a for v in values for a in ("--set", v)])[0])
    args = containers(kinds["DaemonSet"]["xs-xidstream-node"])["collector"]["args"]
    assert args[args.index("--rack-label") + 1] == flag
    rules = kinds["ClusterRole"]["xs-xidstream-node"]["rules"]
    node_rules = [r for r in rules if "nodes" in r["resources"]]
    assert node_rules == ([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}] if nodes_get else [])


@pytest.mark.parametrize("backend, extra", [
    ("label", set()), ("condition", set()),
    ("cluster-api", {("cluster.x-k8s.io", "machines", "get"), ("cluster.x-k8s.io", "machines", "patch")}),
    ("karpenter", {("karpenter.sh", "nodeclaims", "list"), ("karpenter.sh", "nodeclaims", "delete")}),
])
def test_each_replace_backend_adds_exactly_its_rules_and_its_flag(helm, backend, extra):
    kinds = by_kind(render(helm, "--set", f"clusterExecutor.replaceBackend={backend}")[0])
    rules = kinds["ClusterRole"]["xs-xidstream-cluster-executor"]["rules"]
    grants = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    base = {("", "nodes", "get"), ("", "nodes", "patch"), ("", "nodes/status", "patch"), ("", "pods", "list"),
            ("", "pods/eviction", "create"), ("resource.k8s.io", "devicetaintrules", "create"),
            ("resource.k8s.io", "devicetaintrules", "delete"), ("certificates.k8s.io", "certificatesigningrequests", "list"),
            ("", "pods", "watch"), ("authentication.k8s.io", "tokenreviews", "create")}  # the pod view
    assert grants == base | extra
    args = containers(kinds["Deployment"]["xs-xidstream-cluster-executor"])["executor"]["args"]
    assert args[args.index("--replace-backend") + 1] == backend and "--replace-kubeconfig" not in args


def test_cluster_api_with_a_management_kubeconfig_mounts_it_and_grants_nothing_here(helm):
    objs, _ = render(helm, "--set", "clusterExecutor.replaceBackend=cluster-api",
                     "--set", "clusterExecutor.replaceKubeconfig.secretName=mgmt")
    dep = by_kind(objs)["Deployment"]["xs-xidstream-cluster-executor"]
    args = containers(dep)["executor"]["args"]
    assert args[args.index("--replace-kubeconfig") + 1] == "/etc/xidstream/replace/kubeconfig"
    assert {"name": "replace-kubeconfig", "secret": {"secretName": "mgmt", "defaultMode": 0o440}} in pod_spec(dep)["volumes"]
    rules = by_kind(objs)["ClusterRole"]["xs-xidstream-cluster-executor"]["rules"]
    assert not any("cluster.x-k8s.io" in r["apiGroups"] for r in rules)


@pytest.mark.parametrize("values, why", [
    (("clusterExecutor.replaceBackend=machine",), "replaceBackend"),
    (("clusterExecutor.replaceKubeconfig.secretName=mgmt",), "replaceKubeconfig"),
])
def test_a_wrong_replace_backend_setting_is_refused_by_name(helm, values, why):
    _, proc = render(helm, *[a for v in values for a in ("--set", v)], check=False)
    assert proc.returncode != 0 and why in proc.stderr


def test_secure_values_render_sasl_ssl_journal_and_rocksdb(helm):
    objs, _ = render(helm, "-f", str(SECURE))
    kinds = by_kind(objs)
    assert {k: set(v) for k, v in kinds.items()} == EXPECTED_DEFAULT
    roles = {"collector": "xidstream-kafka-collector", "node-executor": "xidstream-kafka-executor",
             "processor": "xidstream-kafka-processor", "executor": "xidstream-kafka-cluster-executor",
             "topics": "xidstream-kafka-admin"}
    for obj in [*kinds["DaemonSet"].values(), *kinds["Deployment"].values(), *kinds["Job"].values()]:
        vols = {v["name"]: v for v in pod_spec(obj)["volumes"]}
        for name, c in containers(obj).items():
            args = c["args"]
            assert args[args.index("--kafka-config") + 1] == "/etc/xidstream/kafka/client.properties", name
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/xidstream/kafka")
            assert mount["readOnly"] is True
            assert vols[mount["name"]]["secret"]["secretName"] == roles[name]

    ds = kinds["DaemonSet"]["xs-xidstream-node"]
    col = containers(ds)["collector"]
    assert col["args"][:3] == ["collect", "--kernel-log", "journal"]
    sc = col["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    mounts = {m["mountPath"]: m for m in col["volumeMounts"]}
    for path in ("/var/log/journal", "/run/log/journal", "/etc/machine-id"):
        assert mounts[path]["readOnly"] is True
    assert "/dev/kmsg" not in mounts
    vols = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    assert vols[mounts["/var/log/journal"]["name"]]["hostPath"]["path"] == "/var/log/journal"

    proc = kinds["Deployment"]["xs-xidstream-processor"]
    p = containers(proc)["processor"]
    assert p["args"][p["args"].index("--store") + 1] == "rocksdb://"
    data = next(v for v in pod_spec(proc)["volumes"] if v["name"] == "data")
    assert data["emptyDir"]["sizeLimit"] == "20Gi"
    job = containers(kinds["Job"]["xs-xidstream-topics"])["topics"]["args"]
    assert job[:6] == ["topics", "create", "--replication-factor", "3", "--min-insync-replicas", "2"]


def test_more_processor_replicas_than_partitions_is_refused(helm):
    _, proc = render(helm, "--set", "processor.replicas=9", "--set", "kafka.partitions=8", check=False)
    assert proc.returncode != 0
    assert "processor.replicas (9) must not exceed kafka.partitions (8)" in proc.stderr
    objs, _ = render(helm, "--set", "processor.replicas=8", "--set", "kafka.partitions=8")
    assert by_kind(objs)["Deployment"]["xs-xidstream-processor"]["spec"]["replicas"] == 8


def _node_security(objs: list[dict]) -> dict[str, dict]:
    return {name: c.get("securityContext") or {}
            for name, c in containers(by_kind(objs)["DaemonSet"]["xs-xidstream-node"]).items()}


def test_a_default_install_runs_no_privileged_container_and_names_each_capability(helm):
    """Issue 42: the node pod was privileged by default (both containers), close to node root on every
    GPU node. Now: no privileged container anywhere, no privilege escalation, RuntimeDefault seccomp,
    and the node containers' capabilities exactly those their code needs (values.yaml says why)."""
    objs, _ = render(helm)
    for obj in objs:
        if obj["kind"] in ("DaemonSet", "Deployment", "Job"):
            for name, c in containers(obj).items():
                sc = c.get("securityContext") or {}
                assert not sc.get("privileged"), (obj["metadata"]["name"], name)
                assert sc.get("allowPrivilegeEscalation") is False, (obj["metadata"]["name"], name)
    ds = by_kind(objs)["DaemonSet"]["xs-xidstream-node"]
    assert pod_spec(ds)["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sec = _node_security(objs)
    assert sec["collector"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    # a dry run carries out nothing: no SYS_ADMIN for a reset it will not run
    assert sec["node-executor"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    assert "/dev/kmsg" not in {m["mountPath"] for m in containers(ds)["collector"]["volumeMounts"]}


def test_the_node_executor_gets_sys_admin_only_when_it_carries_out_commands(helm):
    """nvidia-smi --gpu-reset and -pm are the driver's administrator calls (capable(CAP_SYS_ADMIN)):
    granted with nodeExecutor.apply only, never to the collector."""
    objs, _ = render(helm, "--set", "nodeExecutor.apply=true")
    sec = _node_security(objs)
    assert sec["node-executor"]["capabilities"]["add"] == ["SYS_PTRACE", "DAC_READ_SEARCH", "SYS_ADMIN"]
    assert sec["node-executor"]["privileged"] is False
    assert "SYS_ADMIN" not in sec["collector"]["capabilities"]["add"]
    objs, _ = render(helm, "--set", "nodeExecutor.apply=true", "--set", "nodeExecutor.privileged=true")
    assert _node_security(objs)["node-executor"] == {"privileged": True, "runAsUser": 0, "readOnlyRootFilesystem": True}


def test_host_library_without_privileged_node_containers_is_refused_by_name(helm):
    """hostLibrary mounts the library only; the device cgroup admits the GPUs to a privileged container
    alone, so an unprivileged collector would run NVML-blind: refused, naming both values."""
    _, proc = render(helm, "--set", "nvml.mode=hostLibrary", check=False)
    assert proc.returncode != 0
    assert "nvml.mode hostLibrary needs collector.privileged true and nodeExecutor.privileged true" in proc.stderr
    render(helm, "--set", "nvml.mode=hostLibrary", "--set", "collector.privileged=true",
           "--set", "nodeExecutor.privileged=true")


def test_kmsg_without_privilege_is_refused_and_says_to_use_journal(helm):
    _, proc = render(helm, "--set", "collector.kernelLog=kmsg", check=False)
    assert proc.returncode != 0
    assert "kmsg needs collector.privileged true" in proc.stderr and "journal" in proc.stderr


@pytest.mark.parametrize("value", ["file:/var/log/kern.log", "-"])
def test_a_text_kernel_log_is_refused_and_says_why(helm, value):
    """kern.log and stdin are text a tenant can forge a driver line in (docs/security.md): the chart
    offers only the modes whose records carry their writer, and never the collector's
    --accept-forgeable-kernel-log."""
    _, proc = render(helm, "--set-string", f"collector.kernelLog={value}", check=False)
    assert proc.returncode != 0
    assert "use kmsg (privileged) or journal" in proc.stderr and "forge a driver Xid line" in proc.stderr
    for values in ((), ("-f", str(SECURE))):
        objs, _ = render(helm, *values)
        args = containers(by_kind(objs)["DaemonSet"]["xs-xidstream-node"])["collector"]["args"]
        assert args[args.index("--kernel-log") + 1] in ("kmsg", "journal")
        assert "--accept-forgeable-kernel-log" not in args


def test_host_library_mode_mounts_nvml_without_a_runtime_class(helm):
    objs, _ = render(helm, "--set", "nvml.mode=hostLibrary", "--set", "collector.privileged=true",
                     "--set", "nodeExecutor.privileged=true")
    ds = by_kind(objs)["DaemonSet"]["xs-xidstream-node"]
    assert "runtimeClassName" not in pod_spec(ds)
    col = containers(ds)["collector"]
    assert {"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"} in col["env"]
    vols = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    assert vols["libnvidia-ml"]["hostPath"] == {"path": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "type": "File"}


def test_service_monitor_only_where_the_operator_crd_is_served(helm):
    assert "ServiceMonitor" not in by_kind(render(helm)[0])
    kinds = by_kind(render(helm, "--api-versions", "monitoring.coreos.com/v1")[0])
    sm = kinds["ServiceMonitor"]["xs-xidstream-collector"]
    svc = kinds["Service"]["xs-xidstream-collector-metrics"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    ds = kinds["DaemonSet"]["xs-xidstream-node"]
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


# -- kubernetes-validate --strict ------------------------------------------------------------------
@pytest.mark.parametrize("values", ["default", "secure"])
def test_every_object_passes_kubernetes_validate_strict(helm, values):
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    shipped = set(all_versions())
    args = ["--set", "namespace.create=true"] + (["-f", str(SECURE)] if values == "secure" else [])
    objs, _ = render(helm, *args)
    # 17, the three NetworkPolicies, the two admission policies (the cluster executor's managed
    # nodes, the node pods' operand labels) and their bindings, the dashboard's ConfigMap, the pod
    # view's Service; secure: the node namespace
    expected = 26 + (values == "secure")
    assert len(objs) == expected
    checked = 0
    for version in KUBE_VERSIONS:
        assert version in shipped, f"kubernetes-validate ships no schemas for {version} (it would fall back)"
        for obj in objs:
            # raises ValidationError (with the path) on any schema error or unknown field
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked == expected * len(KUBE_VERSIONS)


# -- the real API server -------------------------------------------------------------------------------
def _kubectl(kube, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def _as_pod(obj: dict, namespace: str) -> dict:
    tmpl = copy.deepcopy(obj["spec"]["template"])
    name = f"{obj['metadata']['name']}-psa-check"[:63]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": tmpl["metadata"].get("labels", {})},
            "spec": tmpl["spec"]}


def _dry_run_pod(kube, pod: dict) -> tuple[int, dict]:
    ns = pod["metadata"]["namespace"]
    return kube.request("POST", f"/api/v1/namespaces/{ns}/pods?dryRun=All", pod)


def _prepare_namespace(kube, objs: list[dict], ns: str) -> None:
    """Create for real what the dry run of the rest needs: the chart's Namespace (with its Pod
    Security labels), its ServiceAccounts (and `default`, which no controller-manager makes here),
    and the RuntimeClass a GPU cluster's operator installs."""
    real = [o for o in objs if o["kind"] in ("Namespace", "ServiceAccount")]
    assert real[0]["kind"] == "Namespace"
    real.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})
    done = _kubectl(kube, "apply", "-f", "-", stdin=yaml.safe_dump_all(real))
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def runtime_class(kube) -> None:
    """The NVIDIA RuntimeClass a GPU cluster's operator installs (the RuntimeClass admission plugin
    refuses a pod that names a missing one)."""
    status, body = kube.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", {
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}, "handler": "nvidia"})
    assert status in (201, 409), body


@pytest.mark.parametrize("values", ["default", "secure", "identity"])
def test_every_object_is_accepted_by_a_server_side_dry_run_under_pod_security(kube, runtime_class, helm, values):
    ns = f"xs-chart-{values}-{RUN}"
    args = ["--set", "namespace.create=true"] + (["-f", str(SECURE)] if values == "secure" else [])
    if values == "identity":
        args += ["-f", str(SECURE), "--set", "identity.enabled=true", "--set", "identity.processorKey=" + "ab" * 32]
    objs, _ = render(helm, *args, namespace=ns, release=f"xs{values[0]}{RUN}")
    _prepare_namespace(kube, objs, ns)
    status, body = kube.request("GET", f"/api/v1/namespaces/{ns}")
    assert body["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"

    rest = [o for o in objs if o["kind"] != "Namespace"]
    out = _kubectl(kube, "apply", "--dry-run=server", "-o", "json", "-f", "-",
                   stdin=yaml.safe_dump_all(rest))
    assert out.returncode == 0, out.stderr
    accepted = json.loads(out.stdout)
    items = accepted["items"] if accepted.get("kind") == "List" else [accepted]
    assert sorted((i["kind"], i["metadata"]["name"]) for i in items) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in rest)
    assert "PodSecurity" not in out.stderr  # no Pod Security warning for any workload

    # Pod Security Admission enforces on Pods: every workload's pod, created (dry run) in this namespace.
    workloads = [o for o in rest if o["kind"] in ("DaemonSet", "Deployment", "Job")]
    assert len(workloads) == 4
    for w in workloads:  # values-secure.yaml puts the node pod in a namespace of its own
        status, body = _dry_run_pod(kube, _as_pod(w, w["metadata"]["namespace"]))
        assert status == 201, (w["metadata"]["name"], body.get("message"))


def test_pod_security_is_enforced_the_node_pod_needs_privileged_the_others_pass_restricted(kube, runtime_class, helm):
    """The labels matter: the node DaemonSet's pod is refused below `privileged` (in either kernel-log
    mode), while the processor, cluster executor and topics pods pass `restricted`."""
    objs, _ = render(helm, "-f", str(SECURE))  # journal mode: the least the node pod can ask for
    kinds = by_kind(objs)
    for level in ("baseline", "restricted"):
        ns = f"xs-chart-{level}-{RUN}"
        kube.ensure_namespace(ns)
        patch = {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": level}}}
        status, body = kube.request("PATCH", f"/api/v1/namespaces/{ns}", patch,
                                    content_type="application/merge-patch+json")
        assert status == 200, body
        for sa in ("xs-xidstream-node", "xs-xidstream-cluster-executor"):
            kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                         {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
        status, body = _dry_run_pod(kube, _as_pod(kinds["DaemonSet"]["xs-xidstream-node"], ns))
        assert status == 403, body
        assert f'violates PodSecurity "{level}:latest"' in body["message"]
        assert "hostPID" in body["message"] and "hostPath" in body["message"]
        if level == "restricted":
            for w in (kinds["Deployment"]["xs-xidstream-processor"], kinds["Deployment"]["xs-xidstream-cluster-executor"],
                      kinds["Job"]["xs-xidstream-topics"]):
                status, body = _dry_run_pod(kube, _as_pod(w, ns))
                assert status == 201, (w["metadata"]["name"], body.get("message"))


def test_strict_validation_is_not_a_rubber_stamp(helm):
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError

    ds = by_kind(render(helm)[0])["DaemonSet"]["xs-xidstream-node"]
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["priviliged"] = True  # a typo
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(bad, "1.34.0", strict=True)


def test_the_kubernetes_validate_command_agrees(helm, tmp_path):
    """The same check through the command a reviewer would run on the rendered files."""
    import sys

    exe = Path(sys.executable).with_name("kubernetes-validate")
    for values in ("default", "secure"):
        _, proc = render(helm, "--set", "namespace.create=true", *(["-f", str(SECURE)] if values == "secure" else []))
        f = tmp_path / f"{values}.yaml"
        f.write_text(proc.stdout)
        for version in (KUBE_VERSIONS[0], KUBE_VERSIONS[-1]):
            out = subprocess.run([str(exe), "--strict", "-k", version, f"{f}"], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
            assert out.stdout.count("INFO") == 26 + (values == "secure"), out.stdout


@pytest.mark.parametrize("values", ["default", "secure"])
def test_every_container_command_line_parses_with_the_real_cli(helm, values):
    """The chart's flags exist: each container's args go through xidstream's own argument parser."""
    from xidstream.cli import build_parser

    objs, _ = render(helm, *(["-f", str(SECURE)] if values == "secure" else []))
    seen = set()
    for obj in objs:
        if obj["kind"] not in ("DaemonSet", "Deployment", "Job"):
            continue
        for c in containers(obj).values():
            args = build_parser().parse_args(c["args"])  # SystemExit(2) on an unknown flag
            seen.add(c["args"][0] + (f" {args.scope}" if c["args"][0] == "execute" else ""))
            if "--kafka-config" in c["args"]:
                assert args.kafka_config == "/etc/xidstream/kafka/client.properties"
    assert seen == {"collect", "execute node", "execute cluster", "process", "topics"}


def test_identity_renders_enrollment_macs_and_the_processors_check(helm):
    """identity.processorKey given as hex: the node pod may create CSRs and MACs its records and
    results with that key; the cluster executor enrolls (lists CSRs, holds the enroller key) and
    MACs its results; the processor believes records by the enrollments."""
    objs, _ = render(helm, "--set", "identity.processorKey=" + "ab" * 32)
    kinds = by_kind(objs)
    node_rules = kinds["ClusterRole"]["xs-xidstream-node"]["rules"]
    assert {"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"], "verbs": ["create"]} in node_rules
    cx_rules = kinds["ClusterRole"]["xs-xidstream-cluster-executor"]["rules"]
    assert {"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"], "verbs": ["list"]} in cx_rules
    ds = containers(kinds["DaemonSet"]["xs-xidstream-node"])
    for name in ("collector", "node-executor"):
        args = ds[name]["args"]
        assert args[args.index("--identity-dir") + 1] == "/var/lib/xidstream/identity"
        assert args[args.index("--processor-identity") + 1] == "ab" * 32
    assert "--request-enrollment" in ds["collector"]["args"]
    cx = containers(kinds["Deployment"]["xs-xidstream-cluster-executor"])["executor"]["args"]
    assert cx[cx.index("--enroll-key") + 1] == "/etc/xidstream/enroller/enroller.key"
    assert cx[cx.index("--node-service-account") + 1] == "xidstream/xs-xidstream-node"
    proc = containers(kinds["Deployment"]["xs-xidstream-processor"])["processor"]["args"]
    assert proc[proc.index("--enroller-key") + 1] == "/etc/xidstream/verify/enroller.pub"


@pytest.mark.parametrize("values", [[], ["-f", str(SECURE)]], ids=["default", "secure"])
def test_default_and_secure_values_render_identity_on_from_the_verify_secret(helm, values):
    """Per-node identity is on by default (it was off, and one node's Kafka credentials could forge
    any node's records): every component gets its identity args with no hex copied by hand, the
    processor's X25519 key read from identity.pub in the verify Secret the node pods mount, and the
    processor checks the enrollments. identity.enabled=false renders the processor's flag that names
    what it gives up."""
    from xidstream.cli import build_parser

    kinds = by_kind(render(helm, *values)[0])
    ds = kinds["DaemonSet"]["xs-xidstream-node"]
    col = containers(ds)
    for name in ("collector", "node-executor"):
        args = col[name]["args"]
        assert args[args.index("--processor-identity") + 1] == "/etc/xidstream/verify/identity.pub"
        mounts = {m["name"]: m["mountPath"] for m in col[name]["volumeMounts"]}
        assert mounts["verify-keys"] == "/etc/xidstream/verify"
    assert {v["name"]: v.get("secret", {}).get("secretName") for v in pod_spec(ds)["volumes"]}["verify-keys"] == "xidstream-verify"
    cx = containers(kinds["Deployment"]["xs-xidstream-cluster-executor"])["executor"]["args"]
    assert cx[cx.index("--processor-identity") + 1] == "/etc/xidstream/verify/identity.pub" and "--enroll-key" in cx
    proc = containers(kinds["Deployment"]["xs-xidstream-processor"])["processor"]["args"]
    parsed = build_parser().parse_args(proc)
    assert parsed.enroller_key == ["/etc/xidstream/verify/enroller.pub"] and parsed.signing_key
    assert not parsed.records_not_tied_to_nodes
    off = by_kind(render(helm, *values, "--set", "identity.enabled=false")[0])
    proc = containers(off["Deployment"]["xs-xidstream-processor"])["processor"]["args"]
    assert "--records-not-tied-to-nodes" in proc and "--enroller-key" not in proc
    assert all("--identity-dir" not in c["args"] for c in containers(off["DaemonSet"]["xs-xidstream-node"]).values())


def test_network_policies_admit_only_the_served_ports(helm):
    """Ingress only on what each pod serves: the processor's web port (probes, /metrics; faust's
    /router and /table views are off), the collector's and the cluster executor's metrics ports;
    nothing to a cluster executor whose metrics are off."""
    objs, _ = render(helm)
    pols = by_kind(objs)["NetworkPolicy"]
    ports = {n: [p["port"] for rule in pol["spec"].get("ingress", []) for p in rule["ports"]] for n, pol in pols.items()}
    assert ports == {"xs-xidstream-processor": [6066], "xs-xidstream-node": [9464],
                     "xs-xidstream-cluster-executor": [9465, 9466]}
    # the pod view: from the node pods only, whatever networkPolicy.from admits to the metrics
    view = pols["xs-xidstream-cluster-executor"]["spec"]["ingress"][1]
    assert view["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "xidstream"}},
                             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "xidstream",
                                                             "app.kubernetes.io/instance": "xs",
                                                             "app.kubernetes.io/component": "node"}}}]
    off, _ = render(helm, "--set", "clusterExecutor.metricsPort=0", "--set", "collector.kubernetesWorkloads=false",
                    "--set", "nodeExecutor.enabled=false", "--set", "clusterExecutor.podViewPort=0")
    assert by_kind(off)["NetworkPolicy"]["xs-xidstream-cluster-executor"]["spec"]["ingress"] == []
    assert "ports" not in containers(by_kind(off)["Deployment"]["xs-xidstream-cluster-executor"])["executor"]
    for pol in pols.values():
        assert pol["spec"]["policyTypes"] == ["Ingress"]
    objs, _ = render(helm, "--set", "networkPolicy.enabled=false")
    assert "NetworkPolicy" not in by_kind(objs)


def _flag(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


VIEW_URL = "http://xs-xidstream-pod-view.xidstream.svc:9466"
VIEW_TOKEN = "/var/run/secrets/xidstream/pod-view/token"


@pytest.mark.parametrize("extra", [[], ["--set", "identity.enabled=true", "--set", "identity.processorKey=" + "ab" * 32],
                                   ["--set", "nodeNamespace.name=xs-node"]])
def test_the_node_pods_read_pods_only_through_the_cluster_executors_pod_view(helm, extra):
    """The node service account, every GPU node's, may not read pods (a list cannot be confined to
    one node); the collector and the node executor ask the cluster executor's pod view with a token
    of its own audience, and the cluster executor serves it for exactly that service account."""
    kinds = by_kind(render(helm, *extra)[0])
    node_ns = "xs-node" if "nodeNamespace.name=xs-node" in extra else "xidstream"
    rules = kinds["ClusterRole"]["xs-xidstream-node"]["rules"]
    assert [r for r in rules if any(res.startswith("pods") for res in r["resources"])] == []
    ds = kinds["DaemonSet"]["xs-xidstream-node"]
    for name, c in containers(ds).items():
        assert _flag(c["args"], "--pod-view") == [VIEW_URL], name
        assert _flag(c["args"], "--pod-view-token") == [VIEW_TOKEN], name
        assert {"name": "pod-view-token", "mountPath": "/var/run/secrets/xidstream/pod-view", "readOnly": True} \
            in c["volumeMounts"], name
    vols = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    assert vols["pod-view-token"]["projected"]["sources"] == [
        {"serviceAccountToken": {"audience": "xidstream-pod-view", "expirationSeconds": 3600, "path": "token"}}]
    cx = containers(kinds["Deployment"]["xs-xidstream-cluster-executor"])["executor"]
    assert _flag(cx["args"], "--pod-view-port") == ["9466"] and _flag(cx["args"], "--pod-view-addr") == ["0.0.0.0"]
    assert _flag(cx["args"], "--node-service-account") == [f"{node_ns}/xs-xidstream-node"]  # once, with identity too
    assert {"name": "pod-view", "containerPort": 9466} in cx["ports"]
    svc = kinds["Service"]["xs-xidstream-pod-view"]
    assert svc["metadata"]["namespace"] == "xidstream"
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "cluster-executor"
    assert svc["spec"]["ports"] == [{"name": "pod-view", "port": 9466, "targetPort": "pod-view"}]
    view_rule = kinds["NetworkPolicy"]["xs-xidstream-cluster-executor"]["spec"]["ingress"][1]
    assert view_rule["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": node_ns}}


@pytest.mark.parametrize("values", [["clusterExecutor.enabled=false"], ["clusterExecutor.podViewPort=0"],
                                    ["clusterExecutor.enabled=false", "nodeExecutor.enabled=false"],
                                    ["clusterExecutor.enabled=false", "collector.kubernetesWorkloads=false"]])
def test_without_the_pod_view_a_node_pod_that_needs_pods_is_refused_by_name(helm, values):
    """No view: the node executor could never tell that its node is drained (and must not be
    given the cluster-wide pod read back), the collector would have no workload events."""
    _, proc = render(helm, *[a for v in values for a in ("--set", v)], check=False)
    assert proc.returncode != 0 and "pod view" in proc.stderr and "collector.kubernetesWorkloads=false" in proc.stderr


def test_a_cluster_without_dns_reaches_the_view_by_a_pinned_cluster_ip(helm):
    kinds = by_kind(render(helm, "--set", "clusterExecutor.podViewClusterIP=10.0.0.66")[0])
    assert kinds["Service"]["xs-xidstream-pod-view"]["spec"]["clusterIP"] == "10.0.0.66"
    for c in containers(kinds["DaemonSet"]["xs-xidstream-node"]).values():
        assert _flag(c["args"], "--pod-view") == ["http://10.0.0.66:9466"]
    assert "clusterIP" not in by_kind(render(helm)[0])["Service"]["xs-xidstream-pod-view"]["spec"]


def test_a_node_pod_that_needs_no_pods_renders_without_the_view(helm):
    kinds = by_kind(render(helm, "--set", "clusterExecutor.enabled=false", "--set", "nodeExecutor.enabled=false",
                           "--set", "collector.kubernetesWorkloads=false")[0])
    ds = kinds["DaemonSet"]["xs-xidstream-node"]
    args = containers(ds)["collector"]["args"]
    assert "--no-kubernetes" in args and "--pod-view" not in args
    assert "pod-view-token" not in {v["name"] for v in pod_spec(ds)["volumes"]}
    assert "xs-xidstream-pod-view" not in kinds["Service"]
    assert [r for r in kinds["ClusterRole"]["xs-xidstream-node"]["rules"] if "pods" in r["resources"]] == []


@pytest.mark.kube
def _policy_and_node_patch_grant(kube, kinds: dict, policy: str, ns: str, sa: str, role: str) -> None:
    """The chart's admission policy `policy` and its binding on the API server, and service account
    `sa` in `ns` granted get and patch on nodes (what the chart's own ClusterRole gives it): what
    the policy alone must then hold back."""
    for kind, path in (("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
                       ("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings")):
        status, body = kube.request("POST", f"/apis/admissionregistration.k8s.io/v1/{path}", kinds[kind][policy])
        assert status == 201, body
    assert kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})[0] == 201
    assert kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]})[0] == 201
    assert kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})[0] == 201


def test_the_admission_policy_confines_the_cluster_executor_to_managed_gpu_nodes(kube, helm):
    """The chart's ValidatingAdmissionPolicy on the real API server: with the cluster executor's
    own service-account token, a cordon patch goes through on a GPU node and is denied by the API
    server on a control-plane node and on a node without a GPU-node label."""
    import time as _time

    ns, release = f"xs-vap-{RUN}", f"xv{RUN}"
    kube.ensure_namespace(ns)
    objs, _ = render(helm, namespace=ns, release=release)
    kinds = by_kind(objs)
    sa = f"{release}-xidstream-cluster-executor"
    _policy_and_node_patch_grant(kube, kinds, f"{release}-xidstream-cluster-executor-managed-nodes", ns, sa,
                                 f"xs-vap-{RUN}")
    status, tr = kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}})
    assert status == 201, tr
    token = tr["status"]["token"]
    nodes = {
        "gpu": {"nvidia.com/gpu.present": "true"},
        "nfd": {"feature.node.kubernetes.io/pci-10de.present": "true"},
        "cp": {"nvidia.com/gpu.present": "true", "node-role.kubernetes.io/control-plane": ""},
        "plain": {},
        "off": {"nvidia.com/gpu.present": "false"},
    }
    for n, labels in nodes.items():
        assert kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                      "metadata": {"name": f"vap-{RUN}-{n}", "labels": labels}})[0] == 201

    def cordon(n):
        return kube.request("PATCH", f"/api/v1/nodes/vap-{RUN}-{n}", {"spec": {"unschedulable": True}}, token=token,
                            content_type="application/merge-patch+json")

    deadline = _time.monotonic() + 30
    while _time.monotonic() < deadline and cordon("cp")[0] == 200:  # the policy takes a moment to be in force
        kube.request("PATCH", f"/api/v1/nodes/vap-{RUN}-cp", {"spec": {"unschedulable": False}},
                     content_type="application/merge-patch+json")
        _time.sleep(1)
    for n in ("cp", "plain", "off"):
        status, body = cordon(n)
        assert status in (403, 422) and "managed GPU nodes" in str(body), (n, status, body)
    for n in ("gpu", "nfd"):
        status, body = cordon(n)
        assert status == 200, (n, body)
    # The admin is not confined: the policy names only the executor's service account.
    assert kube.request("PATCH", f"/api/v1/nodes/vap-{RUN}-plain", {"spec": {"unschedulable": True}},
                        content_type="application/merge-patch+json")[0] == 200


def test_the_node_pods_may_patch_only_their_own_nodes_gpu_deploy_labels(kube, helm):
    """RESET_GPU pauses the GPU Operator's operands through their node labels, so the node pods may
    patch nodes; the chart's admission policy holds that grant to the pod's own node (named by its
    bound token) and to nvidia.com/gpu.deploy.* labels, on the real API server."""
    import time as _time

    ns, release = f"xs-vapn-{RUN}", f"xn{RUN}"
    kube.ensure_namespace(ns)
    objs, _ = render(helm, namespace=ns, release=release)
    kinds = by_kind(objs)
    sa = f"{release}-xidstream-node"
    assert "patch" in next(r for r in kinds["ClusterRole"][sa]["rules"] if r["resources"] == ["nodes"])["verbs"]
    _policy_and_node_patch_grant(kube, kinds, f"{release}-xidstream-node-operand-labels", ns, sa, f"xs-vapn-{RUN}")
    mine, other = f"vapn-{RUN}-a", f"vapn-{RUN}-b"
    for n in (mine, other):
        assert kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": n, "labels": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.deploy.dcgm-exporter": "true"}}})[0] == 201
    # the node pod on `mine`, and a token bound to it: the API server adds the pod's node to it
    status, pod = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "node-pod"},
        "spec": {"nodeName": mine, "serviceAccountName": sa,
                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
    assert status == 201, pod
    status, tr = kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "expirationSeconds": 600, "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "node-pod",
                                                        "uid": pod["metadata"]["uid"]}}})
    assert status == 201, tr
    token = tr["status"]["token"]

    def patch(node, body):
        return kube.request("PATCH", f"/api/v1/nodes/{node}", body, token=token,
                            content_type="application/merge-patch+json")

    pause = {"metadata": {"labels": {"nvidia.com/gpu.deploy.dcgm-exporter": "paused-for-gpu-reset"}}}
    deadline = _time.monotonic() + 30
    while _time.monotonic() < deadline and patch(other, pause)[0] == 200:  # the policy takes a moment
        kube.request("PATCH", f"/api/v1/nodes/{other}", {"metadata": {"labels": {"nvidia.com/gpu.deploy.dcgm-exporter": "true"}}},
                     content_type="application/merge-patch+json")
        _time.sleep(1)
    status, body = patch(other, pause)
    assert status in (403, 422) and "only their own Node" in str(body), (status, body)
    for denied in ({"metadata": {"labels": {"nvidia.com/gpu.present": "false"}}},
                   {"metadata": {"labels": {"feature.node.kubernetes.io/x": "y"}}},
                   {"metadata": {"annotations": {"a": "b"}}},
                   {"spec": {"unschedulable": True}},
                   # an owner that does not exist: the garbage collector would delete the Node
                   {"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "Namespace", "name": "x",
                                                      "uid": "00000000-0000-0000-0000-000000000001"}]}},
                   {"metadata": {"finalizers": ["example.com/keep"]}},  # would block its deletion
                   {"metadata": {"labels": {"nvidia.com/gpu.deploy.device-plugin": "false", "other": "x"}}}):
        status, body = patch(mine, denied)
        assert status in (403, 422) and "gpu.deploy" in str(body), (denied, status, body)
    status, body = patch(mine, pause)
    assert status == 200, body
    assert body["metadata"]["labels"]["nvidia.com/gpu.deploy.dcgm-exporter"] == "paused-for-gpu-reset"
    status, body = patch(mine, {"metadata": {"labels": {"nvidia.com/gpu.deploy.dcgm-exporter": "true"}}})
    assert status == 200, body


def test_pausing_operands_without_the_admission_policy_is_refused_by_name(helm):
    """patch on nodes is granted only under the policy that holds it to the pod's own node's
    gpu.deploy labels: without the policy, the chart refuses rather than let any GPU node rewrite
    any Node."""
    _, proc = render(helm, "--set", "admissionPolicy.enabled=false", check=False)
    assert proc.returncode != 0 and "nodeExecutor.pauseOperands needs admissionPolicy.enabled" in proc.stderr
    kinds = by_kind(render(helm, "--set", "admissionPolicy.enabled=false", "--set", "nodeExecutor.pauseOperands=false")[0])
    assert "ValidatingAdmissionPolicy" not in kinds
    assert all("patch" not in r["verbs"] for r in kinds["ClusterRole"]["xs-xidstream-node"]["rules"])


def test_node_namespace_moves_the_node_pods_and_lets_the_release_namespace_be_restricted(helm):
    """Pod Security cannot exempt one workload of a namespace; nodeNamespace.name puts the
    node DaemonSet (and what it uses) in a namespace of its own, privileged, so the release's can
    enforce `restricted`. Everything else stays in the release's namespace."""
    objs, _ = render(helm, "--set", "nodeNamespace.name=xs-node", "--set", "namespace.create=true",
                     "--set", "namespace.podSecurity.enforce=restricted", "--set", "identity.enabled=true",
                     "--set", "identity.processorKey=" + "ab" * 32)
    where = {(o["kind"], o["metadata"]["name"]): o["metadata"].get("namespace") for o in objs}
    node_side = {("ServiceAccount", "xs-xidstream-node"), ("DaemonSet", "xs-xidstream-node"),
                 ("Service", "xs-xidstream-collector-metrics"), ("NetworkPolicy", "xs-xidstream-node")}
    for key, ns in where.items():
        if key[0] in ("Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                      "ValidatingAdmissionPolicyBinding"):
            continue
        if key[0] == "RoleBinding":  # the Events' bindings: where Node events go
            assert ns == "default", key
            continue
        assert ns == ("xs-node" if key in node_side else "xidstream"), (key, ns)
    kinds = by_kind(objs)
    assert kinds["RoleBinding"]["xs-xidstream-node-events"]["subjects"][0]["namespace"] == "xs-node"
    subjects = kinds["ClusterRoleBinding"]["xs-xidstream-node"]["subjects"]
    assert subjects == [{"kind": "ServiceAccount", "name": "xs-xidstream-node", "namespace": "xs-node"}]
    args = containers(kinds["Deployment"]["xs-xidstream-cluster-executor"])["executor"]["args"]
    assert args[args.index("--node-service-account") + 1] == "xs-node/xs-xidstream-node"
    assert args[args.index("--drain-keep-namespace") + 1] == "xidstream"
    node_args = containers(kinds["DaemonSet"]["xs-xidstream-node"])["node-executor"]["args"]
    assert node_args[node_args.index("--drain-keep-namespace") + 1] == "xidstream"
    levels = {n: o["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] for n, o in kinds["Namespace"].items()}
    assert levels == {"xidstream": "restricted", "xs-node": "privileged"}


def test_the_reboot_sentinel_folder_is_xidstreams_own_not_the_hosts_var_run(helm):
    """the node executor mounted the host's /var/run read-write (the container runtime's
    socket is there) to write kured's sentinel; now a folder of its own, created if missing."""
    objs, _ = render(helm)
    ds = by_kind(objs)["DaemonSet"]["xs-xidstream-node"]
    host_paths = {v["name"]: v["hostPath"] for v in pod_spec(ds)["volumes"] if "hostPath" in v}
    assert host_paths["reboot-sentinel"] == {"path": "/var/run/xidstream", "type": "DirectoryOrCreate"}
    assert not {"/var/run", "/run"} & {hp["path"] for hp in host_paths.values()}
    assert pod_spec(ds)["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


def test_install_without_the_runtime_class_fails_naming_the_value_to_set(kube, helm, tmp_path):
    """the default nvml.mode runtimeClass on a cluster without that RuntimeClass left every
    node pod at `RuntimeClass "nvidia" not found`; an install now fails at once and says what to set.
    `helm template` (no cluster) still renders."""
    missing = f"xs-missing-{RUN}"
    # identity off: this namespace has no enroller Secret (that refusal is the next test's)
    cmd = [helm, "install", f"xsrc{RUN}", str(CHART), "-n", "default", "--kubeconfig", str(kube.kubeconfig),
           "--set", "identity.enabled=false", "--set", f"nvml.runtimeClassName={missing}", "--dry-run=server"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f'this cluster has no RuntimeClass "{missing}"' in proc.stderr
    assert "nvml.mode=hostLibrary" in proc.stderr and "nvml.mode=none" in proc.stderr
    proc = subprocess.run(cmd[:-1] + ["--set", "nvml.mode=none", "--dry-run=server"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    render(helm, "--set", f"nvml.runtimeClassName={missing}")  # no cluster: no lookup, renders


def test_install_with_identity_on_and_no_enroller_secret_fails_naming_the_commands(kube, runtime_class, helm, tmp_path):
    """Identity is on by default; on a cluster whose namespace lacks the enroller's Secret, or whose
    verify Secret lacks identity.pub or enroller.pub, the install fails at once and names the
    commands that make them (a pod would otherwise wait on a missing Secret). With them, it installs."""
    import base64

    ns = f"xs-idpre-{RUN}"
    kube.ensure_namespace(ns)
    cmd = [helm, "install", f"xsid{RUN}", str(CHART), "-n", ns, "--kubeconfig", str(kube.kubeconfig), "--dry-run=server"]

    def install() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    proc = install()
    assert proc.returncode != 0
    assert f'namespace {ns} has no Secret "xidstream-enroller"' in proc.stderr
    assert "xidstream keys generate --out enroller/" in proc.stderr and "identity.enabled=false" in proc.stderr

    def secret(name: str, files: dict[str, bytes]) -> None:
        status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
            "data": {k: base64.b64encode(v).decode() for k, v in files.items()}})
        assert status == 201, body

    secret("xidstream-enroller", {"enroller.key": b"k"})
    secret("xidstream-verify", {"signing.pub": b"p", "enroller.pub": b"e"})
    proc = install()
    assert proc.returncode != 0 and f'the verify Secret {ns}/xidstream-verify has no file "identity.pub"' in proc.stderr
    assert kube.request("DELETE", f"/api/v1/namespaces/{ns}/secrets/xidstream-verify")[0] == 200
    secret("xidstream-verify", {"signing.pub": b"p", "enroller.pub": b"e", "identity.pub": b"i"})
    proc = install()
    assert proc.returncode == 0, proc.stderr


def test_the_exporter_runs_as_the_exporter_role_ocsf_to_a_topic_and_parquet_to_a_claim(helm):
    """exporter.enabled (off by default): OCSF to `<prefix>xidstream.findings.ocsf`, the topic the
    exporter role may write, and Parquet to a PersistentVolumeClaim, each with the exporter role's
    Kafka Secret; restricted, no API token, no port. Parquet without a claim is refused (an
    emptyDir would lose files whose offsets are committed)."""
    import kubernetes_validate

    from xidstream.transport.acls import EXPORT_GROUP_PREFIX, EXPORT_TOPICS, export_group
    from xidstream.cli import build_parser
    from xidstream.export_cmd import _parse_to

    assert "xs-xidstream-exporter" not in by_kind(render(helm)[0])["Deployment"]
    on = ("-f", str(SECURE), "--set", "exporter.enabled=true", "--set", "exporter.parquet.enabled=true",
          "--set", "exporter.parquet.claimName=gpu-lake", "--set", "kafka.topicPrefix=staging.")
    objs, _ = render(helm, *on)
    kinds = by_kind(objs)
    dep = kinds["Deployment"]["xs-xidstream-exporter"]
    spec = pod_spec(dep)
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["lake"]["persistentVolumeClaim"] == {"claimName": "gpu-lake"}
    c = containers(dep)
    assert set(c) == {"ocsf", "parquet"}
    for name, ctr in c.items():
        args = build_parser().parse_args(ctr["args"])
        assert args.handler.__module__ == "xidstream.export_cmd" and args.group is None
        assert args.kafka_config == "/etc/xidstream/kafka/client.properties"
        mount = next(m for m in ctr["volumeMounts"] if m["mountPath"] == "/etc/xidstream/kafka")
        assert vols[mount["name"]]["secret"]["secretName"] == "xidstream-kafka-exporter"
        assert "ports" not in ctr and ctr["securityContext"]["readOnlyRootFilesystem"] is True
        env = {e["name"]: e.get("value") for e in ctr["env"]}
        kind, where = _parse_to(args.to)
        # its default group is one the exporter role's ACLs grant
        assert export_group(env["XIDSTREAM_TOPIC_PREFIX"], args.format, kind).startswith("staging." + EXPORT_GROUP_PREFIX)
    assert c["ocsf"]["args"][c["ocsf"]["args"].index("--to") + 1] == "kafka:staging.xidstream.findings.ocsf"
    assert "xidstream.findings.ocsf" in EXPORT_TOPICS
    assert c["parquet"]["args"][c["parquet"]["args"].index("--to") + 1] == "parquet:/var/lib/xidstream/lake"
    assert {"name": "lake", "mountPath": "/var/lib/xidstream/lake"} in c["parquet"]["volumeMounts"]
    assert kinds["NetworkPolicy"]["xs-xidstream-exporter"]["spec"]["ingress"] == []
    for obj in objs:
        if obj["kind"] in ("Deployment", "NetworkPolicy"):
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
    # OCSF only (the default when enabled); and what the chart refuses
    only, _ = render(helm, "--set", "exporter.enabled=true")
    assert set(containers(by_kind(only)["Deployment"]["xs-xidstream-exporter"])) == {"ocsf"}
    _, no_claim = render(helm, "--set", "exporter.enabled=true", "--set", "exporter.parquet.enabled=true", check=False)
    assert no_claim.returncode != 0 and "exporter.parquet.claimName is required" in no_claim.stderr
    _, nothing = render(helm, "--set", "exporter.enabled=true", "--set", "exporter.ocsf.enabled=false", check=False)
    assert nothing.returncode != 0 and "exporter.ocsf.enabled or exporter.parquet.enabled" in nothing.stderr
