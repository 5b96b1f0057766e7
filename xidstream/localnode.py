"""A real single-node Kubernetes on this machine, for `make e2e` (`xidstream node`).

The local API server of `xidstream kube` gives the executors an API; this gives them a node: a
kubelet that runs pods in containerd, so a drain's evictions are carried out by a real kubelet,
the chart's DaemonSet reads the host's real /dev/kmsg, and Pod Security admission judges real pods.

    etcd (127.0.0.1) + kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy,
    kubelet and containerd (runc, Debian's CNI bridge plugin) on a bridge `xsbr0` (10.77.0.1/24)
    that `up` creates: pods cannot reach the host's loopback, so what they talk to (the API
    server, the broker) listens on the bridge's address, reachable from this host and its pods only.

Steps, each idempotent, each logging under `.xidstream/node/` (one log per daemon):

- fetch: the Debian packages it needs (containerd, runc, buildah, debootstrap, the CNI plugins,
  iptables; installed with apt-get as root, or named with the command that installs them), the
  node binary (kubelet, controller-manager, scheduler and kube-proxy in one, built from the
  k8s.io/kubernetes module in deploy/local/node/ like the API server: about 2-3 min after the API
  server's build, 7-8 min from an empty Go cache), a pause image (a 20-line static C program) and
  a Debian base image with Python (debootstrap, about 90 s): no registry is needed. Everything is
  kept in ~/.cache/xidstream/ (binaries, the base rootfs tarball) and containerd's image store in
  ~/.cache/xidstream/node/containerd.
- image: builds the project's image from the Containerfile on that base (buildah) and imports it
  into containerd as localhost/xidstream/xidstream:e2e.
- up:    the bridge, the control plane, containerd and the kubelet; waits for the node to be Ready.
- down:  every pod's container killed, the daemons stopped by PID (kubelet first), the pods' mounts
         and network namespaces removed, kube-proxy's iptables rules cleaned, the bridge deleted.

Needs root (a kubelet does), cgroups (v1 or v2) and no other kubelet on this machine. Facts that cost
time to find are in the code where they matter (root here lacks CAP_SYS_RESOURCE; no systemd).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xidstream.schemas.errors import XidstreamError
from workshop.localbroker import DEPLOY_DIR, REPO_ROOT, default_cache_dir
from workshop.localkube import LocalKube, build_go_binary, kube_version

__all__ = ["LocalNode", "LocalNodeError", "NODE_NAME", "BRIDGE_IP", "register"]

NODE_DIR = DEPLOY_DIR / "node"
BRIDGE = "xsbr0"
BRIDGE_CIDR = "10.77.0.1/24"
BRIDGE_IP = BRIDGE_CIDR.split("/")[0]
POD_CIDR = str(ipaddress.ip_network(BRIDGE_CIDR, strict=False))
NODE_NAME = "xs-gpu-node-0"
# Labels the chart's DaemonSet selects (values.yaml gpuNodeLabels) and the cluster executor requires.
NODE_LABELS = {"nvidia.com/gpu.present": "true"}

PAUSE_IMAGE = "localhost/xidstream/pause:1"
BASE_IMAGE = "localhost/xidstream/debian-python:bookworm"
PROJECT_IMAGE = "localhost/xidstream/xidstream:e2e"

# Ports off the defaults, so that a real kubelet or API server on this machine is untouched.
APISERVER_PORT = 26443
ETCD_PORT = 22379
KUBELET_PORT = 20250
BROKER_PORT = 29092

# What each command comes from, for the message that says how to install it (Debian 12).
PACKAGES = {
    "containerd": "containerd", "runc": "runc", "ctr": "containerd", "buildah": "buildah",
    "debootstrap": "debootstrap", "/usr/lib/cni/bridge": "containernetworking-plugins",
    "/usr/lib/cni/host-local": "containernetworking-plugins", "/usr/lib/cni/loopback": "containernetworking-plugins",
    "iptables": "iptables", "ip": "iproute2", "gcc": "gcc", "openssl": "openssl", "mount": "mount",
}

PAUSE_C = r"""
/* The pod sandbox process: waits, reaps children, exits on SIGINT/SIGTERM (what k8s' pause does). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
    struct sigaction a = {0};
    a.sa_handler = stop; sigaction(SIGINT, &a, NULL); sigaction(SIGTERM, &a, NULL);
    a.sa_handler = reap; a.sa_flags = SA_NOCLDSTOP; sigaction(SIGCHLD, &a, NULL);
    for (;;) pause();
}
"""


class LocalNodeError(XidstreamError):
    """The single-node cluster could not be provisioned, started or stopped."""


def default_state_dir() -> Path:
    return REPO_ROOT / ".xidstream" / "node"


def mounts_under(mounts: str, *roots: Path) -> list[str]:
    """The mount points of `mounts` (/proc/self/mounts text) at or below `roots`, deepest first.
    The roots themselves too: the kubelet bind-mounts its own root folder onto itself (to make it
    a shared mount), and leaving that one left a mount behind each `node down`, under a folder
    that could then not be deleted."""
    roots_ = tuple(str(r.resolve()) for r in roots)
    found = []
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        target = parts[1].replace("\\040", " ")
        if any(target == r or target.startswith(r + "/") for r in roots_):
            found.append(target)
    return sorted(found, key=len, reverse=True)


@dataclass
class LocalNode:
    node: str = NODE_NAME
    state_dir: Path = None  # type: ignore[assignment]
    cache_dir: Path = None  # type: ignore[assignment]
    kube: LocalKube = field(init=False)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir or default_state_dir())
        self.cache_dir = Path(self.cache_dir or default_cache_dir())
        self.kube = LocalKube(host=BRIDGE_IP, port=APISERVER_PORT, etcd_port=ETCD_PORT, etcd_peer_port=ETCD_PORT + 1,
                              etcd_host="127.0.0.1", state_dir=self.state_dir,
                              extra_users=((f"system:node:{self.node}", ("system:nodes",)),))

    # -- paths ------------------------------------------------------------------------------
    @property
    def node_cache(self) -> Path:
        return self.cache_dir / "node"

    @property
    def binary(self) -> Path:
        return self.cache_dir / f"kube-{kube_version()}" / "kube-node"

    @property
    def containerd_root(self) -> Path:
        return self.node_cache / "containerd"  # the image store: kept between runs

    @property
    def containerd_socket(self) -> Path:
        return self.state_dir / "containerd" / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.state_dir / "kubelet"

    @property
    def pod_resources(self) -> Path:
        return self.kubelet_root / "pod-resources"

    @property
    def kubeconfig(self) -> Path:
        return self.kube.kubeconfig

    def _log(self, text: str) -> None:
        self.kube._log(text)

    # -- fetch ------------------------------------------------------------------------------
    def missing_tools(self) -> list[str]:
        return [tool for tool in PACKAGES if not (Path(tool).exists() if tool.startswith("/") else shutil.which(tool))]

    def _tools(self) -> None:
        missing = self.missing_tools()
        if not missing:
            return
        packages = sorted({PACKAGES[t] for t in missing})
        apt = shutil.which("apt-get")
        if not apt or os.geteuid() != 0:
            raise LocalNodeError(f"missing {', '.join(missing)}: install them with "
                                 f"`sudo apt-get install --no-install-recommends {shlex.join(packages)}`")
        print(f"installing {' '.join(packages)} (apt-get, once) ...", file=sys.stderr, flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = [apt, "install", "-y", "-q", "--no-install-recommends", *packages]
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            subprocess.run([apt, "update", "-q"], capture_output=True, text=True, env=env)
            proc = subprocess.run(install, capture_output=True, text=True, env=env)
        self._log(proc.stdout + proc.stderr)
        still = self.missing_tools()
        if proc.returncode != 0 or still:
            raise LocalNodeError(f"apt-get install {' '.join(packages)} failed (exit {proc.returncode}); still "
                                 f"missing {', '.join(still)}:\n{(proc.stdout + proc.stderr)[-1500:]}")

    def _run(self, cmd: list[str], what: str, **kw: Any) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
        self._log(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            raise LocalNodeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                                 f"{(proc.stdout + proc.stderr)[-2000:]}")
        return proc

    def _buildah_has(self, image: str) -> bool:
        return subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True).returncode == 0

    def _pause_archive(self) -> Path:
        """The sandbox image: a static C program in an image from scratch, as an OCI archive."""
        archive = self.node_cache / "pause.oci.tar"
        if archive.exists():
            return archive
        self.node_cache.mkdir(parents=True, exist_ok=True)
        src, exe = self.node_cache / "pause.c", self.node_cache / "pause"
        src.write_text(PAUSE_C)
        self._run(["gcc", "-static", "-Os", "-o", str(exe), str(src)], "compiling the pause program")
        ctr = self._run(["buildah", "from", "scratch"], "buildah from scratch").stdout.strip()
        try:
            self._run(["buildah", "copy", ctr, str(exe), "/pause"], "buildah copy")
            self._run(["buildah", "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr], "buildah config")
            self._run(["buildah", "commit", "-q", ctr, PAUSE_IMAGE], "buildah commit")
        finally:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
        tmp = archive.with_suffix(".tmp")
        self._run(["buildah", "push", "-q", PAUSE_IMAGE, f"oci-archive:{tmp}:{PAUSE_IMAGE}"], "buildah push")
        tmp.rename(archive)
        return archive

    def base_image(self) -> str:
        """Debian 12 with Python 3.11 and pip, from debootstrap (no registry), in buildah's store."""
        if self._buildah_has(BASE_IMAGE):
            return BASE_IMAGE
        tarball = self.node_cache / "debian-python-bookworm.tar"
        if not tarball.exists():
            rootfs = self.node_cache / "rootfs.tmp"
            shutil.rmtree(rootfs, ignore_errors=True)
            print("making a Debian base image with debootstrap (once; about 90 s) ...", file=sys.stderr, flush=True)
            self._run(["debootstrap", "--variant=minbase", "--include=python3,python3-pip,ca-certificates",
                       "bookworm", str(rootfs), "http://deb.debian.org/debian"], "debootstrap")
            for junk in ("var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale", "var/cache/apt"):
                shutil.rmtree(rootfs / junk, ignore_errors=True)
            (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
            tmp = tarball.with_suffix(".tmp")
            self._run(["tar", "-C", str(rootfs), "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*",
                       "-cf", str(tmp), "."], "packing the base rootfs")
            tmp.rename(tarball)
            shutil.rmtree(rootfs, ignore_errors=True)
        ctr = self._run(["buildah", "from", "scratch"], "buildah from scratch").stdout.strip()
        try:
            self._run(["buildah", "add", ctr, str(tarball), "/"], "buildah add")
            # PEP 668: Debian's pip refuses system installs without it; the image is the environment.
            self._run(["buildah", "config", "--env", "PIP_BREAK_SYSTEM_PACKAGES=1", "--cmd", '["python3"]', ctr],
                      "buildah config")
            self._run(["buildah", "commit", "-q", ctr, BASE_IMAGE], "buildah commit")
        finally:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
        return BASE_IMAGE

    def fetch(self) -> None:
        """Packages, binaries and the two small images; each only once."""
        self._tools()
        self.kube.fetch()
        build_go_binary(NODE_DIR, self.binary, "kubelet, kube-controller-manager, kube-scheduler and kube-proxy",
                        self._log)
        self._pause_archive()
        self.base_image()

    def build_image(self, image: str = PROJECT_IMAGE) -> Path:
        """The project's image from the Containerfile on the debootstrap base, as an OCI archive."""
        self.fetch()
        print(f"building {image} from the Containerfile (buildah; 1-3 min) ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        # --network host: RUN steps (pip, apt-get) use the host's network and resolver. No --layers:
        # buildah 1.28 keys a cached RUN by its text, not by what `--mount=type=bind,from=build`
        # brings, so a code change would reinstall the previous build's wheel (seen here).
        ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
        secret = ["--secret", f"id=ca,src={ca}"] if Path(ca).is_file() else []
        self._run(["buildah", "build", "--network", "host", "--build-arg", f"BASE={BASE_IMAGE}", *secret,
                   "-f", str(REPO_ROOT / "Containerfile"), "-t", image, str(REPO_ROOT)], "buildah build")
        archive = self.node_cache / "xidstream-e2e.oci.tar"
        tmp = archive.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        self._run(["buildah", "push", "-q", image, f"oci-archive:{tmp}:{image}"], "buildah push")
        tmp.rename(archive)
        self._log(f"built {image} in {time.monotonic() - started:.0f}s")
        return archive

    # -- up -----------------------------------------------------------------------------------
    def _bridge(self) -> None:
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
            self._run(["ip", "link", "add", BRIDGE, "type", "bridge"], "creating the bridge")
        addrs = subprocess.run(["ip", "-4", "addr", "show", BRIDGE], capture_output=True, text=True).stdout
        if BRIDGE_CIDR not in addrs:
            self._run(["ip", "addr", "add", BRIDGE_CIDR, "dev", BRIDGE], "addressing the bridge")
        self._run(["ip", "link", "set", BRIDGE, "up"], "raising the bridge")
        # Pods reach the API server's Service address through kube-proxy's DNAT and the outside
        # world through the bridge plugin's masquerade: both need forwarding.
        self._save_sysctls()
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")

    # The host settings `up` changes: forwarding (here), and what the kubelet sets at start
    # (kernel.panic=10, panic_on_oops=1, vm.overcommit_memory=1: its "kernel defaults") and
    # kube-proxy (conntrack). Saved once before the first change, put back by `down`.
    SYSCTLS = ("net/ipv4/ip_forward", "kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory",
               "net/netfilter/nf_conntrack_tcp_timeout_established", "net/netfilter/nf_conntrack_tcp_timeout_close_wait")

    @property
    def _sysctl_file(self) -> Path:
        return self.state_dir / "host-sysctls.json"

    def _save_sysctls(self) -> None:
        if self._sysctl_file.exists():  # saved by an earlier `up` not yet undone: that is the original
            return
        saved = {}
        for key in self.SYSCTLS:
            try:
                saved[key] = (Path("/proc/sys") / key).read_text().strip()
            except OSError:
                continue
        self._sysctl_file.write_text(json.dumps(saved, indent=1))

    def _restore_sysctls(self) -> None:
        try:
            saved = json.loads(self._sysctl_file.read_text())
        except (OSError, ValueError):
            return
        for key, value in saved.items():
            try:
                (Path("/proc/sys") / key).write_text(value)
            except OSError as exc:
                self._log(f"could not restore /proc/sys/{key} to {value}: {exc}")
        self._sysctl_file.unlink(missing_ok=True)

    def _containerd_config(self) -> Path:
        cni_dir = self.state_dir / "cni"
        cni_dir.mkdir(parents=True, exist_ok=True)
        (cni_dir / "10-xidstream.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "xidstream",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": BRIDGE_IP,
                                                              "rangeStart": str(ipaddress.ip_address(BRIDGE_IP) + 9)}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.state_dir / "cni-ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }, indent=2))
        conf = self.state_dir / "containerd" / "config.toml"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(f"""version = 2
root = "{self.containerd_root}"
state = "{self.state_dir / 'containerd' / 'state'}"
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{self.containerd_socket}.ttrpc"
[debug]
  address = "{self.containerd_socket}.debug"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Root in this kind of VM lacks CAP_SYS_RESOURCE: the kubelet's oom_score_adj of -998 for the
  # sandbox makes runc fail every pod ("can't get final child's PID from pipe: EOF") unless clamped.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_dir}"
""")
        return conf

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io", *args]
        if check:
            return self._run(cmd, "ctr " + args[0])
        return subprocess.run(cmd, capture_output=True, text=True)

    def _start_containerd(self) -> None:
        if self.kube.pid("containerd"):
            return
        conf = self._containerd_config()
        self.containerd_root.mkdir(parents=True, exist_ok=True)
        proc = self.kube._spawn("containerd", ["containerd", "--config", str(conf)],
                                self.state_dir / "containerd.log")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise LocalNodeError(f"containerd exited ({proc.returncode}); see {self.state_dir / 'containerd.log'}:\n"
                                     f"{self.kube._tail(self.state_dir / 'containerd.log')}")
            if self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.3)
        raise LocalNodeError(f"containerd did not answer on {self.containerd_socket} within 30s")

    def import_image(self, archive: Path, name: str) -> None:
        self._log(f"importing {archive} as {name}")
        self.ctr("images", "import", str(archive))
        if name not in self.ctr("images", "ls", "-q").stdout.split():
            raise LocalNodeError(f"containerd has no {name} after importing {archive}")

    def _kubeconfig_for(self, user: str, path: Path) -> Path:
        token = self.kube._tokens()[user]
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: local\n  cluster:\n    server: {self.kube.server}\n"
            f"    certificate-authority: {self.kube.pki_dir / 'ca.crt'}\n"
            f"users:\n- name: {user}\n  user:\n    token: {token}\n"
            f"contexts:\n- name: local\n  context: {{cluster: local, user: \"{user}\"}}\ncurrent-context: local\n")
        os.chmod(path, 0o600)
        return path

    def _kubelet_config(self) -> Path:
        conf = self.state_dir / "kubelet.yaml"
        conf.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": BRIDGE_IP, "port": KUBELET_PORT, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": KUBELET_PORT - 2,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.kube.pki_dir / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            # No systemd runs here; cgroup v1 works with kubelet 1.34 (`failCgroupV1` turns true in 1.35).
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "podCIDR": POD_CIDR, "maxPods": 40, "resolvConf": "/etc/resolv.conf",
            # This node is a test machine with a shared disk: never evict our pods for disk pressure.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "rotateCertificates": False,
        }, indent=2))
        return conf

    def _wait(self, what: str, check: Any, timeout: float, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.5)
        tail = f"; last lines of {log}:\n{self.kube._tail(log)}" if log else ""
        raise LocalNodeError(f"{what} not within {timeout:.0f}s{tail}")

    def node_ready(self) -> bool:
        status, body = self.kube.handle().request("GET", f"/api/v1/nodes/{self.node}")
        if status != 200:
            return False
        return any(c["type"] == "Ready" and c["status"] == "True" for c in body.get("status", {}).get("conditions", []))

    def up(self, images: list[tuple[Path, str]] | None = None, timeout: float = 180.0) -> None:
        """Bring the node up (idempotent); `images`: OCI archives to import, with their names."""
        if os.geteuid() != 0:
            raise LocalNodeError("a kubelet needs root: run `xidstream node up` (or `make e2e`) as root")
        self.fetch()
        started = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._bridge()
        try:
            self.kube.start()
            admin = self.kubeconfig
            self._start_containerd()
            self.import_image(self._pause_archive(), PAUSE_IMAGE)
            for archive, name in images or []:
                self.import_image(archive, name)
            pki, node_bin = self.kube.pki_dir, str(self.binary)
            if not self.kube.pid("kube-controller-manager"):
                self.kube._spawn("kube-controller-manager", [
                    node_bin, "kube-controller-manager", f"--kubeconfig={admin}",
                    "--bind-address=127.0.0.1", "--secure-port=20257", "--leader-elect=false",
                    f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                    "--use-service-account-credentials=false",
                    # the CSR signer: node identity enrollment (docs/security.md) on this node
                    f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
                    "--v=1",
                ], self.state_dir / "kube-controller-manager.log")
            if not self.kube.pid("kube-scheduler"):
                self.kube._spawn("kube-scheduler", [
                    node_bin, "kube-scheduler", f"--kubeconfig={admin}", "--bind-address=127.0.0.1",
                    "--secure-port=20259", "--leader-elect=false", f"--authentication-kubeconfig={admin}",
                    f"--authorization-kubeconfig={admin}", "--v=1", f"--cert-dir={self.state_dir / 'scheduler'}",
                ], self.state_dir / "kube-scheduler.log")
            if not self.kube.pid("kube-proxy"):
                self.kube._spawn("kube-proxy", [
                    node_bin, "kube-proxy", f"--kubeconfig={admin}", f"--hostname-override={self.node}",
                    f"--cluster-cidr={POD_CIDR}", "--proxy-mode=iptables", "--conntrack-max-per-core=0",
                    "--metrics-bind-address=127.0.0.1:20249", "--healthz-bind-address=127.0.0.1:20256",
                    "--v=1", f"--bind-address={BRIDGE_IP}", f"--nodeport-addresses={POD_CIDR}",
                ], self.state_dir / "kube-proxy.log")
            if not self.kube.pid("kubelet"):
                kubeconfig = self._kubeconfig_for(f"system:node:{self.node}", self.state_dir / "kubelet.kubeconfig")
                labels = ",".join(f"{k}={v}" for k, v in NODE_LABELS.items())
                self.kube._spawn("kubelet", [
                    node_bin, "kubelet", f"--config={self._kubelet_config()}", f"--kubeconfig={kubeconfig}",
                    f"--hostname-override={self.node}", f"--node-ip={BRIDGE_IP}", f"--root-dir={self.kubelet_root}",
                    f"--cert-dir={self.state_dir / 'kubelet-pki'}", f"--node-labels={labels}", "--v=1",
                ], self.state_dir / "kubelet.log")
            self._wait(f"node {self.node} Ready", self.node_ready, timeout, self.state_dir / "kubelet.log")
        except BaseException:
            self.down()
            raise
        self._log(f"node {self.node} Ready in {time.monotonic() - started:.1f}s")

    # -- down ---------------------------------------------------------------------------------
    def _kill_containers(self) -> None:
        if not self.kube.pid("containerd"):
            return
        tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for task in tasks:
            self.ctr("tasks", "kill", "-s", "SIGKILL", "--all", task, check=False)
        deadline = time.monotonic() + 15
        for task in tasks:
            while time.monotonic() < deadline and self.ctr("tasks", "delete", task, check=False).returncode != 0:
                time.sleep(0.3)
        for container in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("containers", "delete", container, check=False)

    def _unmount_under(self, *roots: Path) -> None:
        """Every mount at or below these folders (pod volumes, rootfs overlays, shm), deepest first."""
        for target in mounts_under(Path("/proc/self/mounts").read_text(), *roots):
            subprocess.run(["umount", "-l", target], capture_output=True)

    def down(self) -> bool:
        """Stop everything `up` started and undo what it changed on the host; True if anything ran."""
        ran = False
        if self.kube.pid("kubelet"):  # first: it would restart what we kill
            ran |= self.kube._stop_one("kubelet")
        self._kill_containers()
        for name in ("kube-proxy", "kube-scheduler", "kube-controller-manager", "containerd"):
            ran |= self.kube._stop_one(name)
        # The shims outlive containerd by design; with their tasks deleted they have exited, but a
        # shim of a task that would not die is ours to end.
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmdline = (proc / "cmdline").read_bytes()
                except OSError:
                    continue
                if b"containerd-shim" in cmdline and str(self.containerd_socket).encode() in cmdline:
                    try:
                        os.kill(int(proc.name), signal.SIGKILL)
                    except OSError:
                        pass
        ran |= self.kube.stop()
        from workshop.localbroker import LocalBroker  # `xidstream e2e --keep` leaves its broker on the bridge

        for name in ("broker", "broker-secure"):
            ran |= LocalBroker(host=BRIDGE_IP, state_dir=self.state_dir / name, secure=name.endswith("secure")).stop()
        self._unmount_under(self.kubelet_root, self.state_dir / "containerd", self.containerd_root)
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
        for line in netns:
            name = line.split(" ")[0]
            if name.startswith("cni-"):
                subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        if self.binary.exists():
            subprocess.run([str(self.binary), "kube-proxy", "--cleanup"], capture_output=True)
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
            subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
            ran = True
        self._restore_sysctls()
        shutil.rmtree(self.state_dir / "cni-ipam", ignore_errors=True)
        return ran

    def status(self) -> dict[str, Any]:
        names = ("etcd", "kube-apiserver", "containerd", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet")
        st: dict[str, Any] = {name: self.kube.pid(name) for name in names}
        st["ready"] = bool(st["kubelet"]) and self.kube.ready() and self.node_ready()
        st["kubeconfig"] = str(self.kubeconfig)
        return st


# -- `xidstream node` -------------------------------------------------------------------------------
def _node_command(args: argparse.Namespace, settings: Any) -> int:
    node = LocalNode()
    if args.action == "fetch":
        node.fetch()
        print(f"node binary: {node.binary}\nbase image: {BASE_IMAGE}\npause image: {node._pause_archive()}")
    elif args.action == "image":
        print(f"{PROJECT_IMAGE}: {node.build_image()}")
    elif args.action == "up":
        started = time.monotonic()
        archive = node.node_cache / "xidstream-e2e.oci.tar"
        node.up(images=[(archive, PROJECT_IMAGE)] if archive.exists() else [])
        print(f"node {node.node} is Ready ({time.monotonic() - started:.1f}s); API server {node.kube.server}\n"
              f"kubeconfig: {node.kubeconfig}\n  e.g. kubectl --kubeconfig {shlex.quote(str(node.kubeconfig))} get pods -A\n"
              f"logs: {node.state_dir}/*.log; stop it with `xidstream node down`")
    elif args.action == "down":
        print("stopped" if node.down() else "not running")
    elif args.action == "status":
        st = node.status()
        print(json.dumps(st, indent=2))
        return 0 if st["ready"] else 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="a real single-node Kubernetes here (kubelet + containerd) for `make e2e`")
    p.add_argument("action", choices=["fetch", "image", "up", "down", "status"])
    p.set_defaults(handler=_node_command)
