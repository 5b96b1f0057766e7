"""`xidstream e2e` (`make e2e`): the chart on a real node, from a kernel line to a drained node.

    the image built (buildah, Containerfile) -> `xidstream node up` (kubelet + containerd) -> the
    broker on the node's bridge -> `helm install` of deploy/helm/xidstream -> tenants' pods ->
    an Xid 79 written to the host's real /dev/kmsg -> the collector (DaemonSet) -> Kafka -> the
    processor (Deployment) -> signed commands -> the cluster executor (Deployment) cordons and
    drains through the API server, the real kubelet stops the evicted pods -> results

Checked on the API server and the topics, each a step of the printed timeline; any missed step
ends the run non-zero. The collector runs with `--accept-injected-kmsg`: a line root writes to
/dev/kmsg has facility 1 (user), which the collector refuses without that test-only switch.

Each run starts on a fresh cluster (etcd wiped) and a fresh broker; `--runs N` repeats the Xid 79
part N times on one cluster (uncordoning and restoring the tenants in between) and prints the
median time from the kernel line to the cordon and to the last eviction.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from xidstream.schemas.errors import XidstreamError
from workshop.demo_cluster import _ok  # an API answer or a XidstreamError naming what failed
from workshop.localbroker import REPO_ROOT, LocalBroker, default_cache_dir
from workshop.localnode import BRIDGE_IP, BROKER_PORT, PAUSE_IMAGE, PROJECT_IMAGE, LocalNode

__all__ = ["register", "run_e2e"]

RUNTIME_CLASS = "xidstream-e2e"
NAMESPACE = "xidstream"        # processor, cluster executor, topics Job: Pod Security `restricted`
NODE_NAMESPACE = "xidstream-node"  # the node DaemonSet: `privileged` (hostPID, hostPath, /dev/kmsg)
TENANT = "tenant"
CHART = REPO_ROOT / "deploy" / "helm" / "xidstream"
HELM_VERSION = "v3.16.4"  # the Makefile's
# The incident: GPU 0 falls off the bus (NVIDIA's Xid catalog: 79, RESTART_BM). The first line is
# the driver's own PCI -> UUID line, which keys the record without NVML. {bus} differs per run.
XID79 = ["NVRM: GPU at PCI:0000:{bus}:00: GPU-e2e{bus}00-0000-4000-8000-00000000{bus}{bus}",
         "NVRM: Xid (PCI:0000:{bus}:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
         "NVRM: GPU 0000:{bus}:00.0: GPU has fallen off the bus."]


# The fake NVML's GPUs (collect --fake-nvml, on the host in the collector's state folder): the
# motivating incident's two GPUs, GPU 1 the one that wedges (../shared/reference/incident.md).
GPU0 = {"index": 0, "uuid": "GPU-3f1a9c2e-7b44-4d1e-9e0a-5c2b8d7f6a10", "pci_bus_id": "00000000:01:00.0",
        "name": "NVIDIA GeForce RTX 5090 D", "memory_total_mib": 32607}
GPU1 = {"index": 1, "uuid": "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81", "pci_bus_id": "00000000:02:00.0",
        "name": "NVIDIA GeForce RTX 5090 D", "memory_total_mib": 32607}
# Two more GPUs for the reset runs on a node shaped like the GPU Operator's (reset_runs): each
# wedges once, so each run has an incident of its own.
GPU2 = {"index": 2, "uuid": "GPU-5c0e2f11-9a3d-4e6b-8f27-1d4c6b8e2a93", "pci_bus_id": "00000000:03:00.0",
        "name": "NVIDIA GeForce RTX 5090 D", "memory_total_mib": 32607}
GPU3 = {"index": 3, "uuid": "GPU-7e4a1b22-3c5d-4f8e-9a01-2b6d8f0c4e57", "pci_bus_id": "00000000:04:00.0",
        "name": "NVIDIA GeForce RTX 5090 D", "memory_total_mib": 32607}
BUSY = {"utilization_gpu_pct": 92, "utilization_memory_pct": 55, "memory_used_mib": 21004, "power_w": 420}
IDLE = {"utilization_gpu_pct": 0, "utilization_memory_pct": 0, "memory_used_mib": 0, "power_w": 30, "processes": []}
# The motivating incident's kernel lines (scenarios/motivating-incident.yaml), as the driver prints them.
NAMING = ["NVRM: GPU at PCI:0000:01:00: GPU-3f1a9c2e-7b44-4d1e-9e0a-5c2b8d7f6a10",
          "NVRM: GPU at PCI:0000:02:00: GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"]
WEDGE = [
    "NVRM: Xid (PCI:0000:02:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on (GPC 2, TPC 1, SM 0): Out Of Range Address",
    "NVRM: Xid (PCI:0000:02:00): 13, pid=4242, name=python3, Graphics SM Global Exception on (GPC 2, TPC 1, SM 0): Multiple Warp Errors",
    "NVRM: Xid (PCI:0000:02:00): 31, pid=4242, name=python3, channel 0x00000018, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC2 "
    "GPCCLIENT_T1_3 faulted @ 0x7f2e_1c000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE",
    "NVRM: Xid (PCI:0000:02:00): 43, pid=4242, name=python3, Ch 00000018",
    "NVRM: GPU1 refcntRequestReference_IMPL: Failed to enter state 1",
]
MMU_FAULT = ("NVRM: Xid (PCI:0000:01:00): 31, pid={pid}, name=python, channel 0x00000012, intr 00000000. MMU Fault: "
             "ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f1e_4a000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ")


class FakeNvml:
    """The JSON file the collector's --fake-nvml reads (collectors.fakes.FilePynvml)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.gpus = {0: dict(GPU0, **BUSY, processes=[{"pid": 3101, "name": "python3", "used_memory_mib": 14000}]),
                     1: dict(GPU1, **BUSY, processes=[{"pid": 4242, "name": "python3", "used_memory_mib": 20480}]),
                     2: dict(GPU2, **IDLE), 3: dict(GPU3, **IDLE)}
        self.write()

    def set(self, index: int, **values: Any) -> None:
        # the fake nvidia-smi rewrites the file on a reset: start from what is there now
        try:
            self.gpus = {g["index"]: g for g in json.loads(self.path.read_text())["gpus"]}
        except (OSError, ValueError, KeyError):
            pass
        self.gpus[index].update(values)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": [self.gpus[i] for i in sorted(self.gpus)]}))
        tmp.rename(self.path)  # the collector never reads half a file


# The reset runs' nvidia-smi (nodeExecutor.nvidiaSmi): every call logged in order beside it; persistence
# mode per UUID (Enabled until set); --gpu-reset clears the GPU in the fake NVML file, as a reset
# clears a wedged context. Run by the node executor in its container (the image's python3).
FAKE_SMI = """#!/usr/bin/env python3
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
args = sys.argv[1:]
with open(os.path.join(here, "fake-nvidia-smi.log"), "a") as log:
    log.write(json.dumps({"at": time.time(), "args": args}) + "\\n")
state_path = os.path.join(here, "fake-nvidia-smi.json")
try:
    state = json.load(open(state_path))
except (OSError, ValueError):
    state = {}
uuid = args[-1]
if args[0].startswith("--query-gpu=persistence_mode"):
    print(state.get(uuid, "Enabled"))
elif args[0] == "-pm":
    state[uuid] = "Enabled" if args[1] == "1" else "Disabled"
    json.dump(state, open(state_path + ".tmp", "w"))
    os.replace(state_path + ".tmp", state_path)
    print("Persistence mode set to %s for GPU %s." % (state[uuid], uuid))
elif args[0] == "--gpu-reset":
    nvml_path = os.path.join(here, "fake-nvml.json")
    doc = json.load(open(nvml_path))
    for g in doc["gpus"]:
        if g["uuid"] == uuid:
            g.update(utilization_gpu_pct=0, utilization_memory_pct=0, memory_used_mib=0, power_w=30, processes=[])
            pci = g["pci_bus_id"]
    json.dump(doc, open(nvml_path + ".tmp", "w"))
    os.replace(nvml_path + ".tmp", nvml_path)
    print("GPU %s was successfully reset." % pci)
else:
    print("unexpected call: %s" % args)
    sys.exit(2)
"""
# How long the paused operands may take to leave (nodeExecutor.operandWait), and another
# controller's pause to end: here the operands' pods go in a second or two.
OPERAND_WAIT = 20
OPERATOR_NAMESPACE = "gpu-operator"
# The GPU Operator's operands as its DaemonSets select them (gpu-reset.md 1.1): each pod holds the
# reset runs' GPUs' /dev/nvidia2 and /dev/nvidia3 open, as the device plugin's NVML event set, GFD's
# NVML loop and dcgm-exporter's embedded nv-hostengine hold every GPU.
OPERANDS = ("device-plugin", "gpu-feature-discovery", "dcgm-exporter")
DEPLOY = "nvidia.com/gpu.deploy."


class E2eError(XidstreamError):
    """A step of the end-to-end run did not happen."""


@dataclass
class Timeline:
    t0: float = field(default_factory=time.time)
    steps: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, text: str, at: float | None = None) -> float:
        at = time.time() if at is None else at
        self.steps.append((at, text))
        print(f"  +{at - self.t0:7.2f}s  {text}", flush=True)
        return at


def _helm() -> str:
    cached = default_cache_dir() / f"helm-{HELM_VERSION}" / "helm"
    helm = str(cached) if cached.exists() else shutil.which("helm")
    if not helm:
        raise E2eError("helm not found: `make helm` builds it into ~/.cache/xidstream")
    return helm


def _wait(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise E2eError(f"{what}: not within {timeout:g}s")
        time.sleep(poll)


def check_image_commands(image: str = PROJECT_IMAGE) -> list[str]:
    """Every `xidstream` subcommand's --help inside the built image (an import missing from the
    image, like exporters/ once, fails here). Returns the commands checked."""
    from xidstream.cli import build_parser

    commands = sorted(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse has no API
    ctr = subprocess.run(["buildah", "from", "--pull-never", image], capture_output=True, text=True)
    if ctr.returncode != 0:
        raise E2eError(f"buildah from {image}: {ctr.stderr.strip()}")
    name = ctr.stdout.strip()
    try:
        script = "set -e; " + "; ".join(f"xidstream {c} --help >/dev/null || {{ echo FAILED {c}; exit 1; }}"
                                        for c in commands)
        run = subprocess.run(["buildah", "run", "--network", "none", name, "--", "sh", "-c", script],
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise E2eError(f"a subcommand fails in {image}: {(run.stdout + run.stderr)[-1500:]}")
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)
    return commands


POD_VIEW_IP = "10.0.0.66"


def _values(node: LocalNode, workdir: Path) -> Path:
    host = workdir / "host"  # what the chart would put in the host's /var/lib and /var/run
    values = {
        "image": {"repository": PROJECT_IMAGE.rsplit(":", 1)[0], "tag": PROJECT_IMAGE.rsplit(":", 1)[1],
                  "pullPolicy": "Never"},
        "kafka": {"bootstrap": f"{BRIDGE_IP}:{BROKER_PORT}", "partitions": 2},
        # NVML from the fake file (no GPU here); the RuntimeClass mode with a class whose handler is
        # plain runc, as the NVIDIA one would be on a GPU node
        "nvml": {"mode": "runtimeClass", "runtimeClassName": RUNTIME_CLASS},
        "collector": {"kernelLog": "kmsg", "privileged": True,
                      "extraArgs": ["--accept-injected-kmsg", "--fake-nvml", "/var/lib/xidstream/fake-nvml.json"],
                      "stateHostPath": str(host / "var-lib-xidstream"), "podResourcesPath": str(node.pod_resources)},
        # privileged: false as in values-secure.yaml (no GPU here to reset)
        # GPUs from the same fake file as the collector's, and a recorded nvidia-smi (FAKE_SMI) on the
        # state volume; the operands' wait short (the e2e's operands leave in a second or two)
        "nodeExecutor": {"apply": True, "privileged": False, "preconditionWait": 30,
                         "rebootSentinelHostDir": str(host / "var-run-xidstream"), "operandWait": OPERAND_WAIT,
                         "nvidiaSmi": "/var/lib/xidstream/fake-nvidia-smi",
                         "extraArgs": ["--fake-nvml", "/var/lib/xidstream/fake-nvml.json"]},
        "nodeNamespace": {"name": NODE_NAMESPACE},
        # resolve_after_s 150 (default 300): the quarantine's release within the run. Not below the
        # 90 s the suspect rule waits to name a fault's workload (streams.evidence.NAME_WAIT_S): the
        # quarantine is decided that long after the faults, and with 60 it was released the moment
        # it was raised (the GPU had been healthy for 60 s since its last fault by then).
        "processor": {"replicas": 1, "policy": {"dry_run": False, "resolve_after_s": 150},
                      "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
        # this node has no cluster DNS: the node pods reach the pod view by a pinned ClusterIP of the
        # API server's Service range (10.0.0.0/24, localkube), through kube-proxy
        "clusterExecutor": {"apply": True, "drainTimeout": 20, "podViewClusterIP": POD_VIEW_IP},
        "metrics": {"serviceMonitor": {"enabled": False}},
    }
    (host / "var-lib-xidstream").mkdir(parents=True, exist_ok=True)
    smi = host / "var-lib-xidstream" / "fake-nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    path = workdir / "values-e2e.yaml"
    path.write_text(json.dumps(values, indent=2))  # JSON is YAML
    return path


def _secret(name: str, files: dict[str, Path]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
            "data": {k: base64.b64encode(p.read_bytes()).decode() for k, p in files.items()}}


def _helm_cmd(node: LocalNode, workdir: Path, verb: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [_helm(), verb, "xidstream", *([str(CHART)] if verb in ("install", "upgrade") else []),
           "--namespace", NAMESPACE, "--kubeconfig", str(node.kubeconfig), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with (workdir / "helm.log").open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    return proc


def check_runtime_class_refused(node: LocalNode, workdir: Path, tl: Timeline) -> None:
    """The chart's default nvml.mode (runtimeClass) on a cluster without that RuntimeClass fails at
    install, naming the value to set, instead of leaving every node pod unstartable."""
    # identity off here only: no Secret exists yet, and the identity preflight's own refusal is
    # tested in tests/deploy (this check is about the RuntimeClass alone)
    proc = _helm_cmd(node, workdir, "install", "-f", str(_values(node, workdir)), "--set", "nvml.mode=runtimeClass",
                     "--set", "nvml.runtimeClassName=nvidia", "--set", "identity.enabled=false", "--dry-run=server")
    out = proc.stdout + proc.stderr
    if proc.returncode == 0 or 'no RuntimeClass "nvidia"' not in out or "nvml.mode=none" not in out:
        raise E2eError(f"helm install with nvml.mode runtimeClass and no RuntimeClass did not fail as it should "
                       f"(exit {proc.returncode}): {out[-800:]}")
    tl.mark("helm install with the default nvml.mode on a cluster without the nvidia RuntimeClass: refused "
            "(names nvml.runtimeClassName / hostLibrary / none)")


def _pod_of(kube: Any, component: str) -> dict | None:
    ns = NODE_NAMESPACE if component == "node" else NAMESPACE
    body = _ok(*kube.request("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector="
                                    f"app.kubernetes.io%2Fcomponent%3D{component}"), f"{component} pods")
    live = [p for p in body["items"] if not p["metadata"].get("deletionTimestamp")]
    return live[0] if len(live) == 1 else None


def check_upgrade(node: LocalNode, workdir: Path, tl: Timeline) -> None:
    """`helm upgrade` to a changed policy rolls the processor; the journal kernel-log mode on this
    host, which keeps no journal files, leaves the collector Running but not Ready, saying why."""
    kube = node.kube.handle()
    processor = _pod_of(kube, "processor")
    proc = _helm_cmd(node, workdir, "upgrade", "--reuse-values", "--set", "processor.policy.suspect_occurrences=4",
                     "--set", "collector.kernelLog=journal", "--set", "collector.privileged=false",
                     "--set-json", "collector.extraArgs=[]")  # --accept-injected-kmsg is for kmsg only
    if proc.returncode != 0:
        raise E2eError(f"helm upgrade failed: {(proc.stdout + proc.stderr)[-1500:]}")

    def rolled() -> dict | None:
        pod = _pod_of(kube, "processor")
        ready = pod and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
        return pod if ready and pod["metadata"]["name"] != processor["metadata"]["name"] else None

    new = _wait("the processor rolled after a policy change", rolled, 180, 1)
    tl.mark(f"helm upgrade of the policy: processor {processor['metadata']['name']} replaced by "
            f"{new['metadata']['name']} (checksum/policy)")

    def blind_collector() -> str | None:
        pod = _pod_of(kube, "node")
        if not pod or pod["status"].get("phase") != "Running" or not pod["status"].get("podIP"):
            return None
        args = next(c["args"] for c in pod["spec"]["containers"] if c["name"] == "collector")
        if "journal" not in args:
            return None
        try:
            import urllib.error
            import urllib.request

            urllib.request.urlopen(f"http://{pod['status']['podIP']}:9464/readyz", timeout=2)
        except urllib.error.HTTPError as exc:  # 503: not ready, the body says why
            body = exc.read().decode()
            return body if "no journal files" in body else None
        except OSError:
            return None
        return None

    why = _wait("the journal-mode collector not Ready on a host without journal files", blind_collector, 180, 1)
    reason = next(line for line in why.splitlines() if "no journal files" in line)
    tl.mark(f"collector in journal mode on this journal-less host: Running, not Ready: {reason[:120]}")


def _container(pod: dict, name: str) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


# What the chart grants the node executor when it carries commands out (values.yaml says why), and
# their numbers in the kernel's capability sets (linux/capability.h).
NODE_EXECUTOR_CAPS = ("SYS_PTRACE", "DAC_READ_SEARCH", "SYS_ADMIN")
CAP_NUMBERS = {"DAC_READ_SEARCH": 2, "SYS_PTRACE": 19, "SYS_ADMIN": 21}


def check_privileges(node: LocalNode, tl: Timeline) -> None:
    """What each container runs with, read back from the live pods, and the real admission and
    kernel refusing what the chart does not grant."""
    kube = node.kube.handle()
    problems = []
    for component, container in (("processor", "processor"), ("cluster-executor", "executor")):
        pod = _pod_of(kube, component)
        psc, csc = pod["spec"].get("securityContext") or {}, _container(pod, container).get("securityContext") or {}
        want = {"runAsNonRoot": psc.get("runAsNonRoot") is True, "seccomp RuntimeDefault":
                (psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault",
                "no privilege escalation": csc.get("allowPrivilegeEscalation") is False,
                "capabilities drop ALL": (csc.get("capabilities") or {}).get("drop") == ["ALL"]
                and not (csc.get("capabilities") or {}).get("add"),
                "read-only root": csc.get("readOnlyRootFilesystem") is True}
        problems += [f"{component}: not {k}" for k, ok in want.items() if not ok]
    node_pod = _pod_of(kube, "node")
    nsc = _container(node_pod, "node-executor").get("securityContext") or {}
    # The chart's default: unprivileged, the capabilities named (SYS_ADMIN since this run carries
    # commands out: nvidia-smi --gpu-reset is the driver's administrator call).
    if nsc.get("privileged") or (nsc.get("capabilities") or {}).get("add") != list(NODE_EXECUTOR_CAPS) or \
            (node_pod["spec"].get("securityContext") or {}).get("seccompProfile", {}).get("type") != "RuntimeDefault":
        problems.append(f"node-executor: expected unprivileged, {', '.join(NODE_EXECUTOR_CAPS)} only, RuntimeDefault "
                        f"seccomp: {nsc}")
    if any(v["hostPath"]["path"] in ("/var/run", "/run") for v in node_pod["spec"]["volumes"] if "hostPath" in v):
        problems.append("the node pod mounts the host's /var/run (the container runtime's socket)")
    if problems:
        raise E2eError("; ".join(problems))
    tl.mark("live pods: processor and cluster executor non-root, RuntimeDefault seccomp, no capabilities, read-only "
            f"root; node executor unprivileged with {', '.join(NODE_EXECUTOR_CAPS)} only; no host /var/run mounted")

    # Pod Security admission on the release's namespace refuses what the node pod needs.
    status, body = kube.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wants-host-pid"},
        "spec": {"hostPID": True, "containers": [{"name": "c", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}]}})
    if status != 403 or 'violates PodSecurity "restricted' not in str((body or {}).get("message")):
        raise E2eError(f"a hostPID pod in {NAMESPACE} was not refused by Pod Security: HTTP {status}: {body}")
    tl.mark(f"Pod Security admission refused a hostPID pod in {NAMESPACE} (restricted)")

    # The kernel refuses /dev/kmsg to a container with the node executor's privileges (the device
    # cgroup), as the collector's kmsg mode needs its privileged container for.
    done = _probe(node, node_pod, "kmsg-probe", nsc, "open('/dev/kmsg', 'rb').read(1)", kmsg=True)
    if done.get("exitCode") == 0 or "Operation not permitted" not in (done.get("message") or ""):
        raise E2eError(f"a container with the node executor's privileges could open /dev/kmsg: {done}")
    tl.mark("a container with the node executor's privileges cannot open /dev/kmsg: "
            + (done.get("message") or "").strip().splitlines()[-1][:100])
    # The holder scan with those privileges sees into another user's process (the processor and the
    # cluster executor run as uid 10001), and without DAC_READ_SEARCH it would not: then every such process looked like
    # one that holds no GPU (now: the scan says it could not read them, and RESET_GPU is refused).
    # A process may exit between the listing of /proc and its stat (a probe's short-lived exec: CI's
    # run failed on FileNotFoundError once); one that vanished is skipped, a refusal still raises.
    scan = ("import os\n"
            "def gone(f, *a):\n"
            "    try:\n"
            "        return f(*a)\n"
            "    except FileNotFoundError:\n"
            "        return None\n"
            "uid = lambda p: os.stat('/proc/' + p).st_uid\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit() and gone(uid, p) == 10001]\n"
            "assert pids, 'no process of uid 10001'\n"
            "fds = [n for n in (gone(lambda p: len(os.listdir(f'/proc/{p}/fd')), p) for p in pids) if n is not None]\n"
            "assert fds, 'every process of uid 10001 exited during the scan'\n"
            "print(len(fds), sorted(fds))")
    done = _probe(node, node_pod, "fd-probe", nsc, scan)
    if done.get("exitCode") != 0:
        raise E2eError(f"the node executor's privileges cannot list a non-root process's /proc/<pid>/fd: {done}")
    ptrace_only = dict(nsc, capabilities={"drop": ["ALL"], "add": ["SYS_PTRACE"]})
    blind = _probe(node, node_pod, "fd-probe-ptrace", ptrace_only, scan)
    if blind.get("exitCode") == 0 or "Permission denied" not in (blind.get("message") or ""):
        raise E2eError(f"SYS_PTRACE alone listed a non-root process's /proc/<pid>/fd: {blind}")
    tl.mark("the holder scan with the node executor's privileges lists non-root processes' /proc/<pid>/fd; with "
            "SYS_PTRACE alone: PermissionError")
    # ... and reads where each descriptor points (what the scan matches against /dev/nvidia*), which
    # DAC_READ_SEARCH alone does not: the link is ptrace-guarded (proc_fd_access_allowed).
    links = scan.replace("print(len(fds), sorted(fds))",
                         "n = 0\n"
                         "for p in pids:\n"
                         "    for fd in gone(os.listdir, f'/proc/{p}/fd') or []:\n"
                         "        if gone(os.readlink, f'/proc/{p}/fd/{fd}') is not None:\n"
                         "            n += 1\n"
                         "assert n, 'no descriptor link read'\n"
                         "print('links read', n)")
    done = _probe(node, node_pod, "link-probe", nsc, links)
    if done.get("exitCode") != 0:
        raise E2eError(f"the node executor's privileges cannot read a non-root process's fd links: {done}")
    dac_only = dict(nsc, capabilities={"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]})
    blind = _probe(node, node_pod, "link-probe-dac", dac_only, links)
    if blind.get("exitCode") == 0 or "Permission denied" not in (blind.get("message") or ""):
        raise E2eError(f"DAC_READ_SEARCH alone read a non-root process's fd links: {blind}")
    tl.mark("the holder scan reads non-root processes' descriptor links with the node executor's privileges; with "
            "DAC_READ_SEARCH alone: PermissionError")
    # The runtime grants exactly what the chart names: the container's effective set, read back.
    caps = _probe(node, node_pod, "caps-probe", nsc,
                  # the termination message: a pod that succeeded has no log fallback
                  "open('/dev/termination-log', 'w').write("
                  "next(l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')))")
    want = sum(1 << CAP_NUMBERS[c] for c in NODE_EXECUTOR_CAPS)
    got = (caps.get("message") or "").strip().splitlines()[-1:]
    if caps.get("exitCode") != 0 or not got or int(got[0], 16) != want:
        raise E2eError(f"the node executor's effective capabilities are not exactly {NODE_EXECUTOR_CAPS} "
                       f"({want:#x}): {caps}")
    tl.mark(f"the node executor's effective capabilities read back: {int(got[0], 16):#x} = "
            f"{', '.join(NODE_EXECUTOR_CAPS)}, nothing else")


def check_pod_view(node: LocalNode, tl: Timeline) -> None:
    """The node pods' service account reads no pod on the API server (the chart's node ClusterRole
    has no pods rule), and reads its own node's pods through the cluster executor's pod view: a
    token bound to the running node pod, as its kubelet-projected one is, asked both ways. Call
    after the tenants run (their pods are what the view must list)."""
    kube = node.kube.handle()
    node_pod, cx_pod = _pod_of(kube, "node"), _pod_of(kube, "cluster-executor")
    if node_pod is None or cx_pod is None or not cx_pod["status"].get("podIP"):
        raise E2eError("pod view check: no running node pod or cluster executor pod")
    sa = node_pod["spec"]["serviceAccountName"]

    def token(audiences: list[str]) -> str:
        spec = {"expirationSeconds": 600, "audiences": audiences,
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": node_pod["metadata"]["name"],
                                   "uid": node_pod["metadata"]["uid"]}}
        return _ok(*kube.request("POST", f"/api/v1/namespaces/{NODE_NAMESPACE}/serviceaccounts/{sa}/token",
                                 {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}),
                   "a token of the node pods' service account")["status"]["token"]

    api = token([])  # the API server's own audience
    for path in ("/api/v1/pods", f"/api/v1/pods?fieldSelector=spec.nodeName={node.node}",
                 f"/api/v1/namespaces/{TENANT}/pods"):
        status, body = kube.request("GET", path, token=api)
        if status != 403:
            raise E2eError(f"the node pods' service account read pods on the API server: GET {path}: HTTP {status}")
    import urllib.error
    import urllib.request

    url = f"http://{cx_pod['status']['podIP']}:9466/v1/pods"

    def ask(bearer: str) -> tuple[int, Any]:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {bearer}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def answered() -> tuple[int, Any] | None:
        got = ask(token(["xidstream-pod-view"]))
        return got if got[0] == 200 else None  # 503 until the view's first list is in

    _, body = _wait("the pod view answering the node pod", answered, 60, 1)
    listed = {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in body["items"]}
    wanted = {f"{NODE_NAMESPACE}/{node_pod['metadata']['name']}", *(f"{TENANT}/{n}" for n in tenant_pods(kube))}
    if body["node"] != node.node or not wanted <= listed:
        raise E2eError(f"pod view answered node {body['node']!r} with {sorted(listed)}; wanted {node.node!r} and "
                       f"{sorted(wanted - listed)}")
    status, why = ask(api)
    if status != 401:
        raise E2eError(f"pod view answered a token of the API's audience: HTTP {status}: {why}")
    tl.mark(f"node pods' service account: pods list/get refused by the API server (403); its own node's "
            f"{len(listed)} pod(s) through the pod view; a token of another audience refused (401)")


def _probe(node: LocalNode, node_pod: dict, name: str, security: dict, code: str, kmsg: bool = False) -> dict:
    """A one-shot pod on the node with the node pod's hostPID and pod security context and the
    given container security context, running `python3 -c code`; returns its terminated state
    (the message carries the log's tail: FallbackToLogsOnError, no kubelet API needed)."""
    kube = node.kube.handle()
    container: dict = {"name": "probe", "image": PROJECT_IMAGE, "imagePullPolicy": "Never",
                       "command": ["python3", "-c", code], "securityContext": security,
                       "terminationMessagePolicy": "FallbackToLogsOnError"}
    spec: dict = {"restartPolicy": "Never", "hostPID": True, "nodeName": node.node, "tolerations": [{"operator": "Exists"}],
                  "securityContext": node_pod["spec"].get("securityContext") or {}, "containers": [container]}
    if kmsg:
        container["volumeMounts"] = [{"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True}]
        spec["volumes"] = [{"name": "kmsg", "hostPath": {"path": "/dev/kmsg", "type": "CharDevice"}}]
    _ok(*kube.request("POST", f"/api/v1/namespaces/{NODE_NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}), f"probe pod {name}")

    def finished() -> dict | None:
        pod = _ok(*kube.request("GET", f"/api/v1/namespaces/{NODE_NAMESPACE}/pods/{name}"), f"probe pod {name}")
        return ((pod["status"].get("containerStatuses") or [{}])[0].get("state") or {}).get("terminated")

    try:
        return _wait(f"the probe pod {name} to finish", finished, 90, 0.5)
    finally:
        kube.request("DELETE", f"/api/v1/namespaces/{NODE_NAMESPACE}/pods/{name}?gracePeriodSeconds=0")


def _keys_generate(out: Path) -> None:
    """`xidstream keys generate --out DIR`, the command the install steps give an operator."""
    proc = subprocess.run([sys.executable, "-m", "xidstream.cli", "keys", "generate", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise E2eError(f"xidstream keys generate --out {out} failed: {proc.stderr[-800:]}")


def install(node: LocalNode, workdir: Path, tl: Timeline) -> None:
    kube = node.kube.handle()
    # As README "Install on Kubernetes" says: the processor's keys (signing.key, signing.pub and
    # identity.pub) and the enroller's; per-node identity is on by the chart's defaults.
    keys, enroller = workdir / "keys", workdir / "enroller"
    _keys_generate(keys)
    _keys_generate(enroller)
    verify = {"signing.pub": keys / "signing.pub", "identity.pub": keys / "identity.pub",
              "enroller.pub": enroller / "signing.pub"}
    for ns, level in ((NAMESPACE, "restricted"), (NODE_NAMESPACE, "privileged")):
        _ok(*kube.request("POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns, "labels": {f"pod-security.kubernetes.io/{m}": level
                                                for m in ("enforce", "warn", "audit")}}}), f"namespace {ns}")
        _ok(*kube.request("POST", f"/api/v1/namespaces/{ns}/secrets", _secret("xidstream-verify", verify)),
            "verify secret")
    _ok(*kube.request("POST", f"/api/v1/namespaces/{NAMESPACE}/secrets",
                      _secret("xidstream-signing", {"signing.key": keys / "signing.key"})), "signing secret")
    _ok(*kube.request("POST", f"/api/v1/namespaces/{NAMESPACE}/secrets",
                      _secret("xidstream-enroller", {"enroller.key": enroller / "signing.key"})), "enroller secret")
    _ok(*kube.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", {
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": RUNTIME_CLASS}, "handler": "runc"}),
        "runtime class")
    proc = _helm_cmd(node, workdir, "install", "-f", str(_values(node, workdir)), "--wait", "--timeout", "5m")
    if proc.returncode != 0:
        raise E2eError(f"helm install failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}\n"
                       f"{_pods_report(kube)}")
    tl.mark(f"helm install: the DaemonSet ({NODE_NAMESPACE}, Pod Security privileged) and both Deployments "
            f"({NAMESPACE}, restricted) Ready")
    check_enrolled(node, workdir, tl, f"{BRIDGE_IP}:{BROKER_PORT}", {})


def check_enrolled(node: LocalNode, workdir: Path, tl: Timeline, bootstrap: str, kafka_extra: dict) -> None:
    """Per-node identity is on by the chart's defaults and works: the node's key and the cluster
    executor's are enrolled on xidstream.identities, signed by the enroller's key, the node's with
    the key the node pod made (its CSR, made with the pod's bound token, names this node), and the
    processor runs with --enroller-key. The later runs then show the processor
    believing the node's records (a record without the node's MAC is dead-lettered, not acted on)."""
    from confluent_kafka import Consumer

    from xidstream.schemas.codec import decode_any
    from xidstream.schemas.signing import VerifyKeys
    from xidstream.transport.identity import CLUSTER_IDENTITY
    from xidstream.transport.kafka import consumer_config
    from xidstream.settings import Settings

    settings = Settings(bootstrap=bootstrap, partitions=2, node=node.node, kafka_extra=dict(kafka_extra))
    verify = VerifyKeys.load([workdir / "enroller" / "signing.pub"])
    consumer = Consumer({**consumer_config(settings, f"xidstream-e2e-enrolled-{uuid.uuid4().hex[:6]}"),
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([settings.topics.name("xidstream.identities")])
    got: dict[str, Any] = {}

    def enrolled() -> bool:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            rec = decode_any(msg.value())
            verify.verify(rec)  # an enrollment not signed by the enroller's key fails the run
            got[rec.node] = rec
        return {node.node, CLUSTER_IDENTITY} <= set(got)

    try:
        _wait(f"enrollments of {node.node} and {CLUSTER_IDENTITY} on xidstream.identities", enrolled, 120, 0)
    finally:
        consumer.close()
    if f"on node {node.node}" not in got[node.node].vouched:
        raise E2eError(f"{node.node}'s enrollment is not vouched for by its node: {got[node.node].vouched!r}")
    proc = _pod_of(node.kube.handle(), "processor") or {}
    args = next((c["args"] for c in proc.get("spec", {}).get("containers", []) if c["name"] == "processor"), [])
    if "--enroller-key" not in args or "--records-not-tied-to-nodes" in args:
        raise E2eError(f"the processor does not check enrollments by the chart's defaults: args {args}")
    tl.mark(f"per-node identity on (chart defaults): {node.node} enrolled by its pod's CSR "
            f"({got[node.node].vouched[:120]}), and {CLUSTER_IDENTITY}; both signed by the enroller's key")


def _pods_report(kube: Any) -> str:
    status, body = kube.request("GET", "/api/v1/pods")
    if status != 200:
        return ""
    lines = []
    for p in body["items"]:
        cs = p["status"].get("containerStatuses") or []
        waiting = "; ".join(f"{c['name']}: {json.dumps(c.get('state'))[:200]}" for c in cs if not c.get("ready"))
        lines.append(f"  {p['metadata']['namespace']}/{p['metadata']['name']}: {p['status'].get('phase')} {waiting}")
    return "pods:\n" + "\n".join(lines)


def tenants(kube: Any) -> None:
    """Other tenants' work on the node: a trainer whose PodDisruptionBudget blocks any eviction, a
    notebook that nothing protects, and a DaemonSet pod (a drain keeps it)."""
    kube.ensure_namespace(TENANT)
    spec = {"containers": [{"name": "main", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}],
            "terminationGracePeriodSeconds": 5}
    for name in ("trainer", "notebook"):
        _ok(*kube.request("POST", f"/apis/apps/v1/namespaces/{TENANT}/deployments", {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}), f"deployment {name}")
    _ok(*kube.request("POST", f"/apis/apps/v1/namespaces/{TENANT}/daemonsets", {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "node-agent"},
        "spec": {"selector": {"matchLabels": {"app": "node-agent"}},
                 "template": {"metadata": {"labels": {"app": "node-agent"}}, "spec": spec}}}), "daemonset")
    _ok(*kube.request("POST", f"/apis/policy/v1/namespaces/{TENANT}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "trainer"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "trainer"}}}}), "pdb")


def tenant_pods(kube: Any) -> dict[str, dict]:
    body = _ok(*kube.request("GET", f"/api/v1/namespaces/{TENANT}/pods"), "tenant pods")
    return {p["metadata"]["name"]: p for p in body["items"]}


def _running(kube: Any) -> dict[str, dict] | None:
    pods = {p["metadata"]["labels"]["app"]: p for p in tenant_pods(kube).values()
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}
    return pods if len(pods) == 3 else None


def write_kmsg(lines: list[str], path: str = "/dev/kmsg") -> float:
    """Each line one write, as the kernel's printk would emit them; returns the wall clock."""
    at = time.time()
    with open(path, "w") as fh:  # noqa: PTH123 - one write() per record
        for line in lines:
            fh.write(f"<3>{line}\n")  # facility 0 asked; the kernel makes it 1 (user) for a write
            fh.flush()
    return at


@dataclass
class Run:
    kernel_at: float
    cordoned_at: float | None = None
    last_eviction_at: float | None = None


class _Topics:
    """Commands, results and alerts of the run, read from the topics (no consumer group), each
    stamped with when it was read; only what arrived after `mark()` counts as this run's."""

    def __init__(self, bootstrap: str, node: str, kafka_extra: dict | None = None) -> None:
        from workshop.demo_cluster import ClosedLoop, _Reader
        from xidstream.settings import Settings

        self.loop = ClosedLoop(node=node, namespace=TENANT, t0=time.time())
        settings = Settings(bootstrap=bootstrap, partitions=2, node=node, kafka_extra=dict(kafka_extra or {}))
        self.reader = _Reader(settings, self.loop)
        self.seen: set[str] = set()

    def mark(self) -> None:
        self.reader.read(0.5)
        self.seen = {r.event_id for r in (*self.loop.results, *self.loop.commands, *self.loop.alerts)}

    def fresh(self, recs: list) -> list:
        return [r for r in recs if r.event_id not in self.seen]

    def result(self, action: Any, gpu_uuid: str | None = None) -> Callable[[], Any]:
        """A check for this run's first result of `action` (of that GPU, if named)."""
        def check() -> Any:
            self.reader.read(0.2)
            return next((r for r in self.fresh(self.loop.results)
                         if r.action == action and (gpu_uuid is None or r.gpu_uuid == gpu_uuid)), None)
        return check

    def timeline(self, tl: Timeline, extra: list[tuple[float, str]]) -> None:
        lines = [(self.loop.arrived[c.event_id], f"command {c.action.value} (step {c.step}) read on gpu.remediation, "
                                                 f"signed by {c.key_id}") for c in self.fresh(self.loop.commands)]
        lines += [(self.loop.arrived[r.event_id], f"result {r.action.value}: {r.outcome.value.upper()} ({r.detail[:160]})")
                  for r in self.fresh(self.loop.results)]
        for at, text in sorted(lines + extra):
            tl.mark(text, at)

    def close(self) -> None:
        self.reader.close()


def node_run(node: LocalNode, topics: _Topics, tl: Timeline, what: str, inject: Callable[[], float],
             actions: tuple[str, ...], timeout: float = 90.0) -> Run:
    """One incident whose plan cordons and drains the node: `inject()` writes its evidence (kernel
    lines, fake NVML) and returns when the kernel line went out; waits for the cordon, the eviction
    done by the kubelet and a result for each of `actions`; checks what the drain kept."""
    from xidstream.schemas.vocab import Action

    kube = node.kube.handle()
    before = _wait("the tenants' three pods Running", lambda: _running(kube), 120, 0.5)
    topics.mark()
    run = Run(kernel_at=inject())
    tl.mark(what, run.kernel_at)

    def cordoned() -> float | None:
        topics.reader.read(0.05)
        node_obj = _ok(*kube.request("GET", f"/api/v1/nodes/{node.node}"), "node")
        return time.time() if node_obj["spec"].get("unschedulable") else None

    run.cordoned_at = _wait("the node cordoned (spec.unschedulable)", cordoned, timeout, 0)
    notebook = before["notebook"]["metadata"]["name"]

    def evicted() -> float | None:
        topics.reader.read(0.05)
        return time.time() if notebook not in tenant_pods(kube) else None

    run.last_eviction_at = _wait("the notebook pod evicted and stopped by the kubelet", evicted, timeout, 0)
    for action in actions:
        _wait(f"a result for {action}", topics.result(Action(action)), timeout, 0)
    topics.timeline(tl, [(run.cordoned_at, f"node {node.node} cordoned on the API server (seen by polling it)"),
                         (run.last_eviction_at, f"tenant pod {notebook} evicted, stopped by the kubelet and gone")])
    results = {r.action.value: r for r in topics.fresh(topics.loop.results)}
    drain = results["DRAIN_NODE"]
    trainer = before["trainer"]["metadata"]["name"]
    agent = before["node-agent"]["metadata"]["name"]
    pods = tenant_pods(kube)
    problems = []
    if drain.outcome.value != "failed" or trainer not in (drain.detail or ""):
        problems.append(f"the drain's result does not name the PDB-blocked pod {trainer} as failed: {drain.detail}")
    if trainer not in pods:
        problems.append(f"the PDB-protected pod {trainer} was removed")
    if agent not in pods or pods[agent]["metadata"].get("deletionTimestamp"):
        problems.append(f"the DaemonSet pod {agent} was not kept")
    own = _ok(*kube.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods"), "xidstream pods")["items"]
    lost = [p["metadata"]["name"] for p in own
            if p["status"].get("phase") != "Running" or p["metadata"].get("deletionTimestamp")]
    if lost:
        problems.append(f"xidstream's own pods did not outlive the drain: {', '.join(lost)}")
    reset = results.get("RESET_GPU")
    if "RESET_GPU" in actions and (reset.outcome.value != "refused" or "not drained" not in (reset.detail or "")
                                   or trainer not in (reset.detail or "")):
        problems.append(f"RESET_GPU was not refused on its drained precondition naming {trainer}: {reset.detail}")
    events = _ok(*kube.request("GET", f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3D{node.node}"),
                 "events")["items"]
    reasons = sorted({e.get("reason", "") for e in events if e.get("reason", "").startswith("Xidstream")})
    if not reasons:
        problems.append("no xidstream Event on the Node")
    else:
        tl.mark(f"Events on node {node.node}: {', '.join(reasons)}")
    if problems:
        raise E2eError("; ".join(problems))
    return run


def wedge_run(node: LocalNode, topics: _Topics, tl: Timeline, fake: FakeNvml) -> Run:
    """The motivating incident on GPU 1: Xid 13 -> 31 -> 43 from pid 4242, the driver's failed
    recovery, then 100% SM, 0 MiB and no process (the fake NVML) for the policy's 60 s."""
    def inject() -> float:
        write_kmsg(NAMING)
        at = write_kmsg(WEDGE)
        fake.set(1, utilization_gpu_pct=100, utilization_memory_pct=0, memory_used_mib=0, power_w=110, processes=[])
        return at

    run = node_run(node, topics, tl, "the motivating incident's Xid 13/31/43 of GPU 1 written to /dev/kmsg; NVML "
                   "then shows 100% SM, 0 MiB, no process", inject, ("CORDON_NODE", "DRAIN_NODE", "RESET_GPU"), 180)
    wedged = [a for a in topics.fresh(topics.loop.alerts) if a.classification.value == "GPU_WEDGED"]
    if not wedged:
        raise E2eError("no GPU_WEDGED alert for GPU 1")
    tl.mark(f"alert GPU_WEDGED: {wedged[-1].summary[:150]}", topics.loop.arrived[wedged[0].event_id])
    return run


def xid79_run(node: LocalNode, topics: _Topics, tl: Timeline, bus: str) -> Run:
    """An Xid 79 (fallen off the bus) of a GPU at PCI bus `bus`: cordon, drain, reboot."""
    return node_run(node, topics, tl, f"Xid 79 of GPU at PCI 0000:{bus}:00 written to /dev/kmsg",
                    lambda: write_kmsg([line.format(bus=bus) for line in XID79]),
                    ("CORDON_NODE", "DRAIN_NODE", "REBOOT_NODE"))


def _device_taint_rules(kube: Any) -> tuple[str, list[dict]]:
    from xidstream.executors.kube import discover_version, make_client

    version = discover_version(make_client(str(kube.kubeconfig)), "resource.k8s.io", "devicetaintrules")
    if not version:
        raise E2eError("the API server serves no resource.k8s.io DeviceTaintRule version")
    body = _ok(*kube.request("GET", f"/apis/resource.k8s.io/{version}/devicetaintrules"), "device taint rules")
    return version, [r for r in body["items"] if r["metadata"]["name"].startswith("xidstream")]


def _gpu_condition(kube, name: str) -> tuple[dict | None, dict]:
    """(the node's GPUHealthy condition, the incidents holding it), from one read of the node."""
    node_obj = _ok(*kube.request("GET", f"/api/v1/nodes/{name}"), "node")
    cond = next((c for c in node_obj.get("status", {}).get("conditions") or [] if c["type"] == "GPUHealthy"), None)
    return cond, json.loads((node_obj["metadata"].get("annotations") or {}).get("xidstream.io/gpu-incidents") or "{}")


def quarantine_run(node: LocalNode, topics: _Topics, tl: Timeline, fake: FakeNvml) -> None:
    """Three processes fault GPU 0 (Xid 31), one after another: the GPU is quarantined with a
    DeviceTaintRule of the served resource.k8s.io version, the node keeps working; once GPU 0 is
    healthy for the policy's resolve_after_s the rule is deleted (RELEASE_GPU)."""
    from xidstream.schemas.vocab import Action

    kube = node.kube.handle()
    topics.mark()
    started = time.time()
    for pid in (5101, 5102, 5103):
        fake.set(0, **BUSY, processes=[{"pid": pid, "name": "python", "used_memory_mib": 9000}])
        time.sleep(2.5)  # a process list names the PID before it faults, as NVML would have
        write_kmsg([MMU_FAULT.format(pid=pid)])
        tl.mark(f"Xid 31 of GPU 0 from pid {pid} written to /dev/kmsg")
        time.sleep(4)  # apart by more than the policy's burst_seconds (5): separate faults, not one burst
    fake.set(0, **IDLE)
    quarantined = _wait("a result for QUARANTINE_GPU", topics.result(Action.QUARANTINE_GPU), 150, 0)
    version, rules = _device_taint_rules(kube)
    if quarantined.outcome.value != "succeeded" or not rules:
        raise E2eError(f"QUARANTINE_GPU: {quarantined.outcome.value}: {quarantined.detail}; rules {rules}")
    node_obj = _ok(*kube.request("GET", f"/api/v1/nodes/{node.node}"), "node")
    if node_obj["spec"].get("unschedulable"):
        raise E2eError("a quarantine of one GPU cordoned the node")
    selector = rules[0]["spec"]["deviceSelector"]
    # The GPUHealthy Node condition (node-problem-detector's convention), written by the cluster
    # executor under the chart's RBAC: False, GPU 0's quarantine among the incidents in its message.
    mine = f"incident {quarantined.incident_id}: GPU 0 ("

    def holds() -> bool:
        cond, _ = _gpu_condition(kube, node.node)
        return cond is not None and cond["status"] == "False" and mine in cond["message"] \
            and "GPUQuarantined" in cond["message"]

    try:
        if "condition GPUHealthy=False" not in quarantined.detail:
            raise E2eError("the QUARANTINE_GPU result says no condition was written")
        _wait("GPU 0's quarantine in the GPUHealthy condition", holds, 10, 1)
    except E2eError:
        cond, held = _gpu_condition(kube, node.node)
        raise E2eError(f"after QUARANTINE_GPU the node's GPUHealthy condition is {cond}; held by {sorted(held)} "
                       f"({quarantined.detail})")
    released = _wait("a result for RELEASE_GPU after GPU 0 was healthy", topics.result(Action.RELEASE_GPU), 300, 0)
    _, left = _device_taint_rules(kube)
    # Every incident still holding it (the runs before left theirs open, with no real GPU to
    # reset) is in its message, minutes of the kubelet's own status updates after they were
    # written: the kubelet's patch keeps conditions it does not own.
    def consistent() -> tuple[bool, Any, dict]:
        cond, held = _gpu_condition(kube, node.node)
        ok = cond is not None and quarantined.incident_id not in held and quarantined.incident_id not in cond["message"] \
            and cond["status"] == ("False" if held else "True") and all(i in cond["message"] for i in held)
        return ok, cond, held

    try:
        _wait("GPU 0's quarantine gone from the GPUHealthy condition", lambda: consistent()[0], 20, 1)
    except E2eError:
        _, cond, held = consistent()
        raise E2eError(f"after RELEASE_GPU the node's GPUHealthy condition is {cond}, held by {sorted(held)} "
                       f"({released.detail})")
    _, cond, held = consistent()
    tl.mark(f"after RELEASE_GPU: GPUHealthy={cond['status']} ({cond['reason']}), GPU 0's quarantine no longer in it; "
            f"still held by {len(held)} earlier incident(s), as written minutes before (kubelet status updates since)")
    topics.timeline(tl, [(quarantined_at := topics.loop.arrived[quarantined.event_id],
                          f"DeviceTaintRule {rules[0]['metadata']['name']} ({version}) on the API server: "
                          f"device {selector.get('device')} of pool {selector.get('pool')}; node still schedulable")])
    if released.outcome.value != "succeeded" or left:
        raise E2eError(f"RELEASE_GPU: {released.outcome.value}: {released.detail}; rules left {left}")
    tl.mark(f"quarantine {quarantined_at - started:.1f}s after the first fault, release "
            f"{topics.loop.arrived[released.event_id] - quarantined_at:.1f}s later (resolve_after_s 150)")


# -- the reset on a node shaped like the GPU Operator's ----------------------------------------------

def install_operands(node: LocalNode, tl: Timeline) -> None:
    """DaemonSets shaped like the GPU Operator's operands (OPERANDS): each selects its node by its
    nvidia.com/gpu.deploy.<operand> label ("true"), and its pod holds /dev/nvidia2 and /dev/nvidia3
    open (files in the pod's own /dev: the node executor's holder scan reads the link's path).
    They tolerate every taint, as the Operator's own do for the GPU taints, so they come back on a
    node that is still cordoned once their labels are restored."""
    kube = node.kube.handle()
    kube.ensure_namespace(OPERATOR_NAMESPACE)
    for op in OPERANDS:
        spec = {"nodeSelector": {DEPLOY + op: "true"}, "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": op, "image": PROJECT_IMAGE, "imagePullPolicy": "Never",
                                "securityContext": {"runAsUser": 0},
                                "command": ["sh", "-c", "touch /dev/nvidia2 /dev/nvidia3 && exec 3</dev/nvidia2 "
                                                        "4</dev/nvidia3 && exec sleep 2147483647"]}]}
        _ok(*kube.request("POST", f"/apis/apps/v1/namespaces/{OPERATOR_NAMESPACE}/daemonsets", {
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": f"nvidia-{op}"},
            "spec": {"selector": {"matchLabels": {"app": f"nvidia-{op}"}},
                     "template": {"metadata": {"labels": {"app": f"nvidia-{op}"}}, "spec": spec}}}), f"daemonset {op}")
    labels = {DEPLOY + op: "true" for op in OPERANDS}
    labels.update({DEPLOY + "driver": "true", DEPLOY + "dcgm": "false"})  # never paused; off: left as it is
    _ok(*kube.request("PATCH", f"/api/v1/nodes/{node.node}", {"metadata": {"labels": labels}},
                      content_type="application/merge-patch+json"), "operand labels")
    _wait("the GPU Operator's three operand pods Running", lambda: len(_operand_pods(kube)) == len(OPERANDS), 120, 0.5)
    tl.mark(f"GPU Operator operands running: {', '.join(sorted(_operand_pods(kube)))} (each holding /dev/nvidia2 and "
            f"/dev/nvidia3); node labels {DEPLOY}{{{','.join(OPERANDS)}}}=true, driver=true, dcgm=false")


def _operand_pods(kube: Any) -> dict[str, str]:
    """app -> pod name of the operand pods Running and not terminating."""
    body = _ok(*kube.request("GET", f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/pods"), "operand pods")
    return {p["metadata"]["labels"]["app"]: p["metadata"]["name"] for p in body["items"]
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}


def _deploy_labels(kube: Any, node: str) -> dict[str, str]:
    labels = _ok(*kube.request("GET", f"/api/v1/nodes/{node}"), "node")["metadata"].get("labels") or {}
    return {k: v for k, v in labels.items() if k.startswith(DEPLOY)}


def _smi_calls(path: Path, since: int) -> list[str]:
    """The fake nvidia-smi's calls logged after byte `since`, as "args..." strings."""
    try:
        data = path.read_bytes()[since:]
    except OSError:
        return []
    return [" ".join(json.loads(line)["args"]) for line in data.splitlines() if line.strip()]


def _wedge_lines(gpu: dict) -> list[str]:
    """The motivating incident's kernel lines (WEDGE) moved to `gpu`: its PCI address and index."""
    bus = gpu["pci_bus_id"][9:11]
    return [f"NVRM: GPU at PCI:0000:{bus}:00: {gpu['uuid']}"] + \
        [line.replace("PCI:0000:02:00", f"PCI:0000:{bus}:00").replace("GPU1 ", f"GPU{gpu['index']} ") for line in WEDGE]


def stage_times(alert_ts: float, results: dict[str, Any]) -> list[dict[str, Any]]:
    """The repair's milestones (streams.repair, as `xidstream incident` and the processor's
    histograms count them) from the verdict's alert and the executors' answers and steps."""
    from xidstream.streams.repair import answer_milestones, durations, step_time

    milestones = {"detection": alert_ts}
    for r in results.values():
        answered = r.ts.timestamp()
        steps = [(st.step, step_time(st.at.timestamp(), answered), st.ok) for st in r.steps]
        for stage, at in answer_milestones(r.action.value, r.outcome.value, answered, steps).items():
            milestones.setdefault(stage, at)
    return durations(milestones)


def reset_runs(node: LocalNode, topics: _Topics, tl: Timeline, fake: FakeNvml, workdir: Path) -> dict[str, int]:
    """The wedge on a node run by the GPU Operator, twice (issue 41):

    1. GPU 2 wedges: cordon, drain (the trainer's PDB lifted, so the drain completes), then the node
       executor pauses the three operands through their labels, waits for their pods to go, turns
       persistence mode off, resets, verifies, turns it back on and restores every label exactly;
       the incident resolves and the node is uncordoned. The time per stage is printed.
    2. GPU 3 wedges while a driver upgrade holds dcgm-exporter (``paused-for-driver-upgrade``): the
       reset is refused naming that pause, not final, and no label is touched.

    Returns the count of RESET_GPU outcomes seen here."""
    from xidstream.schemas.vocab import Action

    kube = node.kube.handle()
    smi_log = workdir / "host" / "var-lib-xidstream" / "fake-nvidia-smi.log"
    install_operands(node, tl)
    # the runs above check that the trainer's PDB blocks the drain; a reset needs a drained node
    _ok(*kube.request("DELETE", f"/apis/policy/v1/namespaces/{TENANT}/poddisruptionbudgets/trainer"), "delete pdb")
    outcomes: dict[str, int] = {}

    # 1. GPU 2: the whole ladder on an Operator node
    _wait("the tenants' three pods Running", lambda: _running(kube), 120, 0.5)
    before = _deploy_labels(kube, node.node)
    since = smi_log.stat().st_size if smi_log.exists() else 0
    topics.mark()
    kernel_at = write_kmsg(_wedge_lines(GPU2))
    fake.set(2, utilization_gpu_pct=100, utilization_memory_pct=0, memory_used_mib=0, power_w=110, processes=[])
    tl.mark("reset run 1: the motivating incident's Xid 13/31/43 on GPU 2 (/dev/kmsg); NVML: 100% SM, 0 MiB, no process",
            kernel_at)
    reset = _wait("a result for GPU 2's RESET_GPU", topics.result(Action.RESET_GPU, GPU2["uuid"]), 300, 0)
    outcomes[reset.outcome.value] = outcomes.get(reset.outcome.value, 0) + 1
    steps = [st.step for st in reset.steps]
    for st in reset.steps:
        tl.mark(f"  step {st.step}{'' if st.ok else ' FAILED'}: {st.detail[:150]}", st.at.timestamp())
    want = ["cordoned_drained", "holders_classified", "operands_paused", "operands_gone", "persistence_off", "reset",
            "verified", "persistence_restored", "operands_restored"]
    if reset.outcome.value != "succeeded" or steps != want:
        raise E2eError(f"GPU 2's RESET_GPU: {reset.outcome.value}: {reset.detail}; steps {steps}")
    if _deploy_labels(kube, node.node) != before:
        raise E2eError(f"the operand labels are not back as they were: {_deploy_labels(kube, node.node)} != {before}")
    uuid = GPU2["uuid"]
    calls = [c for c in _smi_calls(smi_log, since) if c.endswith(uuid)]
    expected = [f"--query-gpu=persistence_mode --format=csv,noheader -i {uuid}", f"-pm 0 -i {uuid}",
                f"--gpu-reset -i {uuid}", f"-pm 1 -i {uuid}"]
    if calls != expected:
        raise E2eError(f"nvidia-smi calls for GPU 2: {calls}, expected {expected}")
    tl.mark(f"nvidia-smi called in order: {'; '.join(c.rsplit(' -i ', 1)[0] for c in calls)}")
    _wait("the operand pods Running again", lambda: len(_operand_pods(kube)) == len(OPERANDS), 120, 0.5)
    tl.mark(f"operand labels back exactly ({', '.join(f'{k.removeprefix(DEPLOY)}={v}' for k, v in sorted(before.items()))}); "
            f"operand pods Running again")
    uncordon = _wait("GPU 2's UNCORDON_NODE once it was healthy for resolve_after_s (150 s)",
                     topics.result(Action.UNCORDON_NODE, uuid), 400, 0)
    if uncordon.outcome.value != "succeeded":
        raise E2eError(f"UNCORDON_NODE: {uncordon.outcome.value}: {uncordon.detail}")
    fresh = [r for r in topics.fresh(topics.loop.results) if r.gpu_uuid == uuid]
    results = {r.action.value: r for r in fresh}
    wedged = [a for a in topics.fresh(topics.loop.alerts) if a.gpu_uuid == uuid and a.classification.value == "GPU_WEDGED"]
    if not wedged:
        raise E2eError("no GPU_WEDGED alert for GPU 2")
    from xidstream.streams.repair import STAGES

    rows = stage_times(wedged[0].ts.timestamp(), results)
    missing = [st for st in STAGES if st not in {r["stage"] for r in rows}]
    if missing:
        raise E2eError(f"stages not seen: {missing} ({rows})")
    print("\n== time to repair per stage, GPU 2 on a GPU Operator node (the kernel line at +0.00 s):", flush=True)
    for r in rows:
        print(f"   {r['stage']:16s} +{r['at'] - kernel_at:7.2f}s" + (f"  stage {r['seconds']:7.2f}s"
                                                                    if r["seconds"] is not None else ""), flush=True)

    # 2. GPU 3 while a driver upgrade pauses dcgm-exporter
    _wait("the tenants' three pods Running", lambda: _running(kube), 120, 0.5)
    _ok(*kube.request("PATCH", f"/api/v1/nodes/{node.node}", {"metadata": {"labels": {
        DEPLOY + "dcgm-exporter": "paused-for-driver-upgrade"}}}, content_type="application/merge-patch+json"), "upgrade")
    before = _deploy_labels(kube, node.node)
    since = smi_log.stat().st_size if smi_log.exists() else 0
    topics.mark()
    kernel_at = write_kmsg(_wedge_lines(GPU3))
    fake.set(3, utilization_gpu_pct=100, utilization_memory_pct=0, memory_used_mib=0, power_w=110, processes=[])
    tl.mark("reset run 2: GPU 3 wedges while nvidia.com/gpu.deploy.dcgm-exporter=paused-for-driver-upgrade", kernel_at)
    reset = _wait("a result for GPU 3's RESET_GPU", topics.result(Action.RESET_GPU, GPU3["uuid"]), 300, 0)
    outcomes[reset.outcome.value] = outcomes.get(reset.outcome.value, 0) + 1
    if reset.outcome.value != "refused" or reset.final or "paused-for-driver-upgrade (another controller's pause)" \
            not in reset.detail:
        raise E2eError(f"GPU 3's RESET_GPU under a driver upgrade: {reset.outcome.value} (final {reset.final}): "
                       f"{reset.detail}")
    if _deploy_labels(kube, node.node) != before or _smi_calls(smi_log, since):
        raise E2eError(f"the reset under a driver upgrade touched something: labels {_deploy_labels(kube, node.node)}, "
                       f"nvidia-smi {_smi_calls(smi_log, since)}")
    tl.mark(f"RESET_GPU refused, not final, the upgrade's label left as it was: {reset.detail[:200]}",
            topics.loop.arrived[reset.event_id])
    # the upgrade ends; the operator's part: uncordon, and the trainer's PDB back for the runs after
    _ok(*kube.request("PATCH", f"/api/v1/nodes/{node.node}", {"metadata": {"labels": {DEPLOY + "dcgm-exporter": "true"}}},
                      content_type="application/merge-patch+json"), "upgrade done")
    restore(node)
    _ok(*kube.request("POST", f"/apis/policy/v1/namespaces/{TENANT}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "trainer"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "trainer"}}}}), "pdb")
    return outcomes


def restore(node: LocalNode) -> None:
    """Between runs, the operator's part: lift xidstream's cordon (unschedulable, its NoSchedule
    taint and its annotation) so the evicted tenant comes back."""
    from xidstream.executors.cluster import CORDON_ANNOTATION, TAINT_KEY

    kube = node.kube.handle()
    node_obj = _ok(*kube.request("GET", f"/api/v1/nodes/{node.node}"), "node")
    taints = [t for t in node_obj["spec"].get("taints") or [] if t["key"] != TAINT_KEY]
    _ok(*kube.request("PATCH", f"/api/v1/nodes/{node.node}",
                      {"metadata": {"annotations": {CORDON_ANNOTATION: None}},
                       "spec": {"unschedulable": None, "taints": taints}},
                      content_type="application/merge-patch+json"), "uncordon")


SECURE_PORT = BROKER_PORT + 300
SECURE_VALUES = CHART / "values-secure.yaml"
KAFKA_SECRETS = {"collector": NODE_NAMESPACE, "executor": NODE_NAMESPACE, "processor": NAMESPACE,
                 "cluster-executor": NAMESPACE, "admin": NAMESPACE}


def _gone(kube: Any, namespaces: tuple[str, ...]) -> bool:
    return all(not _ok(*kube.request("GET", f"/api/v1/namespaces/{ns}/pods"), "pods")["items"] for ns in namespaces)


def secure_phase(node: LocalNode, workdir: Path, tl: Timeline) -> LocalBroker:
    """`helm uninstall`, then the chart again with values-secure.yaml on the SASL_SSL broker (TLS,
    a SCRAM user and ACLs per role, each role's librdkafka file in a Secret), and one Xid 79 through it."""
    kube = node.kube.handle()
    proc = _helm_cmd(node, workdir, "uninstall", "--wait", "--timeout", "3m")
    if proc.returncode != 0:
        raise E2eError(f"helm uninstall failed: {(proc.stdout + proc.stderr)[-1500:]}")
    _wait("xidstream's pods gone after helm uninstall", lambda: _gone(kube, (NAMESPACE, NODE_NAMESPACE)), 120, 1)
    _, rules = _device_taint_rules(kube)
    node_obj = _ok(*kube.request("GET", f"/api/v1/nodes/{node.node}"), "node")
    tl.mark(f"helm uninstall: every xidstream pod gone; left on the cluster: {len(rules)} DeviceTaintRule(s), "
            f"node {'cordoned' if node_obj['spec'].get('unschedulable') else 'schedulable'}")
    secure = LocalBroker(host=BRIDGE_IP, port=SECURE_PORT, secure=True, state_dir=node.state_dir / "broker-secure")
    secure.reset()  # a fresh CA and users: the certificate names the bridge's address
    secure.start()
    tl.mark(f"SASL_SSL broker up on {secure.bootstrap} (TLS, SCRAM-SHA-512 user and ACLs per role)")
    for role, ns in KAFKA_SECRETS.items():
        props = dict(secure.client_config(role), **{"ssl.ca.location": "/etc/xidstream/kafka/ca.crt"})
        files = {"client.properties": "".join(f"{k}={v}\n" for k, v in props.items()).encode(),
                 "ca.crt": secure.ca_file.read_bytes()}
        _ok(*kube.request("POST", f"/api/v1/namespaces/{ns}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"xidstream-kafka-{role}"},
            "data": {k: base64.b64encode(v).decode() for k, v in files.items()}}), f"kafka secret {role}")
    # values-secure.yaml as a platform team would start from it, then this node's values; a single
    # broker cannot hold 3 replicas, and this host keeps no journal (kmsg, as the plain run)
    proc = _helm_cmd(node, workdir, "install", "-f", str(SECURE_VALUES), "-f", str(workdir / "values-e2e.yaml"),
                     "--set", f"kafka.bootstrap={secure.bootstrap}", "--set", "kafka.replicationFactor=null",
                     "--set", "kafka.minInsyncReplicas=null", "--wait", "--timeout", "5m")
    if proc.returncode != 0:
        raise E2eError(f"helm install with values-secure.yaml failed: {(proc.stdout + proc.stderr)[-2000:]}\n"
                       f"{_pods_report(kube)}")
    tl.mark("helm install with values-secure.yaml: every component Ready on the SASL_SSL broker")
    check_enrolled(node, workdir, tl, secure.bootstrap,
                   {k: v for k, v in secure.client_config("admin").items() if k != "bootstrap.servers"})
    return secure


def run_e2e(runs: int = 1, keep: bool = False) -> int:
    tl = Timeline()
    node = LocalNode()
    workdir = node.state_dir / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"== xidstream e2e: the chart on a real node (work: {workdir})", flush=True)
    archive = node.build_image()
    tl.mark(f"image {PROJECT_IMAGE} built from the Containerfile")
    checked = check_image_commands()
    tl.mark(f"every subcommand's --help ran inside the image ({len(checked)}: {', '.join(checked)})")
    node.down()  # a fresh cluster: etcd is wiped by the API server's start
    broker = LocalBroker(host=BRIDGE_IP, port=BROKER_PORT, state_dir=node.state_dir / "broker")
    try:
        node.up(images=[(archive, PROJECT_IMAGE)])
        tl.mark(f"node {node.node} Ready (kubelet, containerd, API server on {node.kube.server})")
        broker.fetch()
        broker.reset()
        broker.start()
        tl.mark(f"broker up on {broker.bootstrap}")
        check_runtime_class_refused(node, workdir, tl)
        fake = FakeNvml(workdir / "host" / "var-lib-xidstream" / "fake-nvml.json")
        install(node, workdir, tl)
        check_privileges(node, tl)
        kube = node.kube.handle()
        tenants(kube)
        _wait("the tenants' three pods Running", lambda: _running(kube), 120, 0.5)
        tl.mark("tenants running: trainer (PDB minAvailable 1), notebook, node-agent (DaemonSet)")
        check_pod_view(node, tl)
        topics = _Topics(broker.bootstrap, node.node)
        try:
            wedge_run(node, topics, tl, fake)
            restore(node)
            done: list[Run] = []
            for i in range(runs):
                done.append(xid79_run(node, topics, tl, f"{0x3b + i:02x}"))
                restore(node)
            quarantine_run(node, topics, tl, fake)
            reset_outcomes = reset_runs(node, topics, tl, fake, workdir)
            reset_outcomes["refused"] = reset_outcomes.get("refused", 0) + 1  # the first wedge's (PDB)
        finally:
            topics.close()
        check_upgrade(node, workdir, tl)
        secure = secure_phase(node, workdir, tl)
        extra = {k: v for k, v in secure.client_config("admin").items() if k != "bootstrap.servers"}
        topics = _Topics(secure.bootstrap, node.node, extra)
        try:
            xid79_run(node, topics, tl, "5e")
            restore(node)
        finally:
            topics.close()
        cordon = [r.cordoned_at - r.kernel_at for r in done]
        evict = [r.last_eviction_at - r.kernel_at for r in done]
        print(f"\n== RESET_GPU outcomes in this run: {', '.join(f'{k} {v}' for k, v in sorted(reset_outcomes.items()))}",
              flush=True)
        print(f"\n== {len(done)} run(s) of an Xid 79: kernel line -> node cordoned p50 {statistics.median(cordon):.2f}s "
              f"(min {min(cordon):.2f}, max {max(cordon):.2f}); -> last eviction done p50 "
              f"{statistics.median(evict):.2f}s (min {min(evict):.2f}, max {max(evict):.2f})", flush=True)
        return 0
    except XidstreamError as exc:
        print(f"\nE2E FAILED: {exc}", file=sys.stderr)
        try:
            print(_pods_report(node.kube.handle()), file=sys.stderr)
        except Exception:  # noqa: BLE001 - a report only
            pass
        print(f"logs: {node.state_dir}/*.log, {workdir}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            broker.stop()
            node.down()  # also the secure broker


def _e2e_command(args: argparse.Namespace, settings: Any) -> int:
    return run_e2e(runs=args.runs, keep=args.keep)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("e2e", help="the chart on a real single-node cluster, an Xid 79 through /dev/kmsg (root)")
    p.add_argument("--runs", type=lambda v: max(1, int(v)), default=1,
                   help="Xid 79 runs on one cluster (at least 1); prints the median latencies")
    p.add_argument("--keep", action="store_true", help="leave the node and the broker running afterwards")
    p.set_defaults(handler=_e2e_command)
