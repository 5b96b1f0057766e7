"""A real Kubernetes API server (kube-apiserver + etcd) for the executors' tests and the demo.

No kubelet, no controller-manager, no scheduler: only the API. Pods are bound by `nodeName` and
their status is set through the status subresource; the `default` ServiceAccount of a namespace
must be created by whoever uses it (`KubeHandle.ensure_namespace`).

Steps, each idempotent and each logging to `<state>/kube.log` (etcd: `etcd.log`, the API server:
`apiserver.log`):

- fetch:  builds kube-apiserver once from the k8s.io/kubernetes Go module (the wrapper module in
          deploy/local/kube/) into ~/.cache/xidstream/kube-<version>/ (3-5 min on 2 cores,
          needs the Go toolchain and, on a cold module cache, network); installs Debian's
          `etcd-server` when no `etcd` is on the PATH (as root, with apt-get).
- start:  writes a CA, a serving cert for 127.0.0.1/localhost, a service-account key pair
          (openssl) and a static token file once; starts etcd on 127.0.0.1 (data under
          `<state>/etcd`, fresh on each start unless keep_data) and kube-apiserver on
          127.0.0.1:16443 with RBAC, PodSecurity and the DRA device-taint API
          (resource.k8s.io/v1alpha3 DeviceTaintRule); waits for /readyz; writes an admin
          kubeconfig `<state>/kubeconfig`. A second start finds it running and returns.
- stop:   SIGTERM (then SIGKILL after a grace period) to the API server, then etcd.

Ports are not the defaults (6443, 2379/2380), so a developer's own cluster or a system etcd
(Debian's package enables one on 2379) is untouched.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xidstream.schemas.errors import XidstreamError
from workshop.localbroker import DEPLOY_DIR, REPO_ROOT, default_cache_dir

__all__ = ["LocalKube", "KubeHandle", "LocalKubeError", "KUBE_DIR", "register"]

KUBE_DIR = DEPLOY_DIR / "kube"

ADMIN_USER = "xidstream-admin"
# A user with a valid token and no role binding: RBAC refuses it everything but discovery.
NOBODY_USER = "xidstream-nobody"


class LocalKubeError(XidstreamError):
    """The local API server could not be provisioned, started or reached."""


def default_state_dir() -> Path:
    return REPO_ROOT / ".xidstream" / "kube"


def kube_version() -> str:
    """The k8s.io/kubernetes version the wrapper module requires (e.g. v1.34.3)."""
    gomod = (KUBE_DIR / "go.mod").read_text()
    match = re.search(r"^\s*k8s\.io/kubernetes\s+(v\d+\.\d+\.\d+)\s*$", gomod, re.M)
    if not match:
        raise LocalKubeError(f"{KUBE_DIR / 'go.mod'} does not require k8s.io/kubernetes vX.Y.Z")
    return match.group(1)


def build_go_binary(module_dir: Path, binary: Path, what: str, log: Any) -> Path:
    """`go build` of a wrapper module of k8s.io/kubernetes (deploy/local/kube or node) into binary,
    once, with the version stamped as upstream's release builds do. `log(text)` records output."""
    if binary.exists():
        return binary
    go = shutil.which("go")
    if not go:
        raise LocalKubeError(f"go not found: the Go toolchain (1.24+) is needed once to build {what} "
                             "(https://go.dev/dl/, or `apt-get install golang-go` where it is 1.24+)")
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", out)
    if match and (int(match.group(1)), int(match.group(2))) < (1, 24):
        raise LocalKubeError(f"{what} {kube_version()} needs Go 1.24+, found {out} ({go})")
    binary.parent.mkdir(parents=True, exist_ok=True)
    with (binary.parent / f".{binary.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time: the second waits, then finds it
        if binary.exists():
            return binary
        version = kube_version()
        major, minor = version.lstrip("v").split(".")[:2]
        ldflags = " ".join([
            "-s", "-w",
            f"-X k8s.io/component-base/version.gitVersion={version}",
            f"-X k8s.io/component-base/version.gitMajor={major}",
            f"-X k8s.io/component-base/version.gitMinor={minor}",
            "-X k8s.io/component-base/version.gitTreeState=clean",
            f"-X k8s.io/component-base/version.buildDate={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        ])
        tmp = binary.with_suffix(".tmp")
        cmd = [go, "build", "-trimpath", "-buildvcs=false", "-o", str(tmp), "-ldflags", ldflags, "."]
        log(f"building {what} {version} into {binary}: {' '.join(cmd)}")
        print(f"building {what} {version} from source (once; 2-8 min on 2 cores) ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "GOFLAGS"}
        proc = subprocess.run(cmd, cwd=module_dir, capture_output=True, text=True, env=env)
        log(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise LocalKubeError(f"building {what} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
        tmp.rename(binary)
        log(f"built {binary} in {time.monotonic() - started:.0f}s, {binary.stat().st_size / 1e6:.0f} MB")
    return binary


# -- a handle on a running API server -------------------------------------------------------------
@dataclass
class KubeHandle:
    """What a test or the demo needs to talk to the API server: a kubeconfig file, the server URL,
    a bearer token and the CA file. `request` is a minimal JSON client over urllib (the executors
    bring their own Kubernetes client)."""

    kubeconfig: Path
    server: str
    token: str
    ca_file: Path | None = None
    nobody_token: str | None = None

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike) -> "KubeHandle":
        """Reads the current context's server, CA and bearer token (a token, not client certs or
        exec plugins: enough for the local server and for a test cluster's admin token)."""
        import yaml

        path = Path(path)
        cfg = yaml.safe_load(path.read_text())
        ctx_name = cfg.get("current-context")
        ctx = next((c["context"] for c in cfg.get("contexts", []) if c["name"] == ctx_name), None)
        if ctx is None:
            raise LocalKubeError(f"{path}: no current-context")
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        token = user.get("token") or (Path(user["tokenFile"]).read_text().strip() if user.get("tokenFile") else "")
        if not token:
            raise LocalKubeError(f"{path}: the current user has no bearer token")
        ca = cluster.get("certificate-authority")
        if not ca and cluster.get("certificate-authority-data"):
            import base64
            import tempfile

            fd, tmp = tempfile.mkstemp(prefix="xidstream-ca-", suffix=".crt")
            os.write(fd, base64.b64decode(cluster["certificate-authority-data"]))
            os.close(fd)
            ca = tmp
        if ca and not Path(ca).is_absolute():  # kubectl reads relative paths from the file's folder
            ca = str(path.parent / ca)
        return cls(kubeconfig=path, server=cluster["server"].rstrip("/"), token=token,
                   ca_file=Path(ca) if ca else None)

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = "",
                content_type: str = "application/json", timeout: float = 10.0) -> tuple[int, Any]:
        """One API request; returns (HTTP status, decoded JSON body or text). Never raises for an
        HTTP error status. token="" uses the admin token, None sends no Authorization header."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        bearer = self.token if token == "" else token
        if bearer:
            req.add_header("Authorization", f"Bearer {bearer}")
        try:
            with urllib.request.urlopen(req, context=self.ssl_context(), timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def mark_pod_running_ready(self, namespace: str, name: str) -> dict:
        """What a kubelet would report: phase Running, PodScheduled/Initialized/ContainersReady/
        Ready True (the Eviction API ignores PodDisruptionBudgets for Pending pods)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
        status, body = self.request(
            "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            {"status": {"phase": "Running", "conditions": conditions, "startTime": now}},
            content_type="application/merge-patch+json")
        if status != 200:
            raise LocalKubeError(f"marking pod {namespace}/{name} Running and Ready: HTTP {status}: {body}")
        return body

    def set_pdb_status(self, namespace: str, name: str, *, disruptions_allowed: int, current_healthy: int,
                       desired_healthy: int, expected_pods: int) -> dict:
        """What the disruption controller (kube-controller-manager, not running here) would write.
        Without it a PDB's status.observedGeneration stays behind its generation and the Eviction API
        answers 429 for every pod it selects, whatever the budget: a test must set the status."""
        status, pdb = self.request("GET", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}")
        if status != 200:
            raise LocalKubeError(f"reading PodDisruptionBudget {namespace}/{name}: HTTP {status}: {pdb}")
        pdb["status"] = {
            "observedGeneration": pdb["metadata"]["generation"],
            "disruptionsAllowed": disruptions_allowed, "currentHealthy": current_healthy,
            "desiredHealthy": desired_healthy, "expectedPods": expected_pods,
        }
        status, body = self.request(
            "PUT", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}/status", pdb)
        if status != 200:
            raise LocalKubeError(f"writing PodDisruptionBudget {namespace}/{name} status: HTTP {status}: {body}")
        return body

    def ensure_namespace(self, name: str) -> None:
        """Create the namespace and its `default` ServiceAccount (no controller-manager runs, so
        nothing else creates it, and the ServiceAccount admission plugin refuses pods without)."""
        for path, obj in (
            ("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
            (f"/api/v1/namespaces/{name}/serviceaccounts",
             {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}),
        ):
            status, body = self.request("POST", path, obj)
            if status not in (201, 409):
                raise LocalKubeError(f"creating {path} {obj['metadata']['name']}: HTTP {status}: {body}")


# -- the local server -----------------------------------------------------------------------------
@dataclass
class LocalKube:
    """etcd + kube-apiserver on loopback."""

    port: int = 16443
    etcd_port: int = 12379
    etcd_peer_port: int = 12380
    host: str = "127.0.0.1"
    state_dir: Path = None  # type: ignore[assignment]
    etcd_host: str = "127.0.0.1"  # etcd has no authentication here: loopback only, whatever `host` is
    cache_dir: Path = None  # type: ignore[assignment]
    # (user, groups) given a static token too, e.g. a kubelet's ("system:node:NAME", ("system:nodes",))
    extra_users: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir or default_state_dir())
        self.cache_dir = Path(self.cache_dir or default_cache_dir())

    # -- paths ------------------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://{self.etcd_host}:{self.etcd_port}"

    @property
    def binary(self) -> Path:
        return self.cache_dir / f"kube-{kube_version()}" / "kube-apiserver"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "kube.log"

    @property
    def etcd_log(self) -> Path:
        return self.state_dir / "etcd.log"

    @property
    def apiserver_log(self) -> Path:
        return self.state_dir / "apiserver.log"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def etcd_data(self) -> Path:
        return self.state_dir / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def token_file(self) -> Path:
        return self.pki_dir / "tokens.csv"

    def _pid_file(self, name: str) -> Path:
        return self.state_dir / f"{name}.pid"

    def _log(self, text: str) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("a") as fh:
            fh.write(f"[xidstream {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")

    # -- fetch ------------------------------------------------------------------------------
    def fetch(self) -> Path:
        """Build kube-apiserver once and make sure etcd is installed; returns the binary."""
        self._etcd()
        if self.binary.exists():
            return self.binary
        return build_go_binary(KUBE_DIR, self.binary, "kube-apiserver", self._log)

    def _etcd(self) -> str:
        etcd = shutil.which("etcd")
        if etcd:
            return etcd
        apt = shutil.which("apt-get")
        if not apt or os.geteuid() != 0:
            raise LocalKubeError(
                "etcd not found: install Debian's etcd-server package (`sudo apt-get install etcd-server`) "
                "or put an etcd 3.4+ binary on the PATH"
            )
        self._log("etcd not found; installing Debian's etcd-server")
        print("installing etcd (apt-get install etcd-server) ...", file=sys.stderr, flush=True)
        # The package's postinst may try to start a system etcd on 2379/2380; we use other ports.
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = [apt, "install", "-y", "-q", "--no-install-recommends", "etcd-server"]
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            self._log(proc.stdout + proc.stderr)
            subprocess.run([apt, "update", "-q"], capture_output=True, text=True, env=env)
            proc = subprocess.run(install, capture_output=True, text=True, env=env)
        self._log(proc.stdout + proc.stderr)
        etcd = shutil.which("etcd")
        if proc.returncode != 0 or not etcd:
            raise LocalKubeError(f"installing etcd-server failed (exit {proc.returncode}); see {self.log_file}:\n"
                                 f"{(proc.stdout + proc.stderr)[-1500:]}")
        return etcd

    # -- credentials ------------------------------------------------------------------------
    def _openssl(self, *args: str) -> None:
        openssl = shutil.which("openssl")
        if not openssl:
            raise LocalKubeError("openssl not found: it makes the local API server's certificates "
                                 "(`apt-get install openssl`)")
        proc = subprocess.run([openssl, *args], capture_output=True, text=True, cwd=self.pki_dir)
        if proc.returncode != 0:
            raise LocalKubeError(f"openssl {' '.join(args[:2])} failed: {proc.stderr[-1500:]}")

    def _credentials(self) -> None:
        """CA, serving cert, service-account key pair and token file; made once, then reused."""
        pki = self.pki_dir
        pki.mkdir(parents=True, exist_ok=True)
        os.chmod(pki, 0o700)
        if not (pki / "server.crt").exists():
            self._log(f"writing a CA, a serving cert and a service-account key pair into {pki}")
            (pki / "ext.cnf").write_text(
                "[ca]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n"
                "subjectKeyIdentifier=hash\n"
                "[server]\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
                "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.0.0.1"
                + ("" if self.host == "127.0.0.1" else f",IP:{self.host}") + "\n"
            )
            self._openssl("genrsa", "-out", "ca.key", "2048")
            self._openssl("req", "-x509", "-new", "-key", "ca.key", "-sha256", "-days", "3650",
                          "-subj", "/CN=xidstream-local-ca", "-extensions", "ca", "-config", "ext.cnf",
                          "-out", "ca.crt")
            self._openssl("genrsa", "-out", "server.key", "2048")
            self._openssl("req", "-new", "-key", "server.key", "-subj", "/CN=kube-apiserver", "-out", "server.csr")
            self._openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                          "-CAcreateserial", "-sha256", "-days", "3650", "-extfile", "ext.cnf",
                          "-extensions", "server", "-out", "server.crt.tmp")
            self._openssl("genrsa", "-out", "sa.key", "2048")
            self._openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
            (pki / "server.crt.tmp").rename(pki / "server.crt")
        if not self.token_file.exists():
            extra = "".join(f'{secrets.token_hex(24)},{user},{user},"{",".join(groups)}"\n'
                            for user, groups in self.extra_users)
            self.token_file.write_text(
                f'{secrets.token_hex(24)},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
                f"{secrets.token_hex(24)},{NOBODY_USER},{NOBODY_USER}\n" + extra
            )
            os.chmod(self.token_file, 0o600)

    def _tokens(self) -> dict[str, str]:
        tokens = {}
        for line in self.token_file.read_text().splitlines():
            parts = line.split(",")
            if len(parts) >= 2:
                tokens[parts[1]] = parts[0]
        return tokens

    def _write_kubeconfig(self) -> None:
        token = self._tokens()[ADMIN_USER]
        tmp = self.kubeconfig.with_suffix(".tmp")
        tmp.write_text(
            "apiVersion: v1\nkind: Config\n"
            "clusters:\n- name: xidstream-local\n  cluster:\n"
            f"    server: {self.server}\n    certificate-authority: {self.pki_dir / 'ca.crt'}\n"
            f"users:\n- name: {ADMIN_USER}\n  user:\n    token: {token}\n"
            "contexts:\n- name: xidstream-local\n  context:\n    cluster: xidstream-local\n"
            f"    user: {ADMIN_USER}\n    namespace: default\n"
            "current-context: xidstream-local\n"
        )
        os.chmod(tmp, 0o600)
        tmp.rename(self.kubeconfig)

    def handle(self) -> KubeHandle:
        tokens = self._tokens()
        return KubeHandle(kubeconfig=self.kubeconfig, server=self.server, token=tokens[ADMIN_USER],
                          ca_file=self.pki_dir / "ca.crt", nobody_token=tokens.get(NOBODY_USER))

    # -- processes --------------------------------------------------------------------------
    def pid(self, name: str) -> int | None:
        """The pid of our `etcd` or `kube-apiserver` if it still runs."""
        try:
            pid = int(self._pid_file(name).read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        try:  # a recycled pid is not ours: ours runs that binary with our state dir
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if name.encode() not in cmdline or str(self.state_dir).encode() not in cmdline:
                return None
        except OSError:
            pass
        return pid

    def _port_in_use(self, port: int, host: str | None = None) -> bool:
        try:
            with socket.create_connection((host or self.host, port), timeout=0.5):
                return True
        except OSError:
            return False

    def etcd_healthy(self, timeout: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(self.etcd_url + "/health", timeout=timeout) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def ready(self, timeout: float = 2.0) -> bool:
        """True when /readyz answers ok to the admin token."""
        if not self.token_file.exists() or not (self.pki_dir / "ca.crt").exists():
            return False
        try:
            status, body = self.handle().request("GET", "/readyz", timeout=timeout)
        except (OSError, ssl.SSLError):
            return False
        return status == 200

    def _tail(self, path: Path, lines: int = 25) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _spawn(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        self._log(f"starting {name}: {' '.join(cmd)}")
        with log.open("a") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)  # `stop` ends it, not the shell
        self._pid_file(name).write_text(str(proc.pid))
        return proc

    def _start_etcd(self, keep_data: bool, timeout: float) -> None:
        if self.pid("etcd") and self.etcd_healthy():
            return
        etcd = self._etcd()
        for port in (self.etcd_port, self.etcd_peer_port):
            if self._port_in_use(port, self.etcd_host):
                raise LocalKubeError(f"port {self.etcd_host}:{port} is in use by another process (not our etcd); "
                                     f"stop it or choose other ports (--etcd-port)")
        if not keep_data:
            shutil.rmtree(self.etcd_data, ignore_errors=True)
        # ETCD_* variables (e.g. from /etc/default/etcd in a shell) would override our flags.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        peer = f"http://{self.etcd_host}:{self.etcd_peer_port}"
        proc = self._spawn("etcd", [
            etcd, "--name", "xidstream", "--data-dir", str(self.etcd_data),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"xidstream={peer}", "--initial-cluster-state", "new",
            "--initial-cluster-token", "xidstream-local", "--log-level", "warn", "--logger", "zap",
            "--quota-backend-bytes", str(2 * 1024**3),
        ], self.etcd_log, env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._pid_file("etcd").unlink(missing_ok=True)
                raise LocalKubeError(f"etcd failed to start (exit {proc.returncode}); last lines of "
                                     f"{self.etcd_log}:\n{self._tail(self.etcd_log)}")
            if self.etcd_healthy():
                return
            time.sleep(0.2)
        self._stop_one("etcd")
        raise LocalKubeError(f"etcd failed to start: not healthy on {self.etcd_url} within {timeout:.0f}s; "
                             f"last lines of {self.etcd_log}:\n{self._tail(self.etcd_log)}")

    def apiserver_args(self) -> list[str]:
        pki = self.pki_dir
        return [
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.host}", f"--advertise-address={self.host}", f"--secure-port={self.port}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={self.token_file}",
            "--anonymous-auth=false",
            "--allow-privileged=true",  # like real clusters: the collector DaemonSet is privileged
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.0.0.0/24",
            # on top of the default set (NamespaceLifecycle, ServiceAccount, PodSecurity, ...)
            "--enable-admission-plugins=NodeRestriction,PodSecurity",
            "--feature-gates=DRADeviceTaints=true",
            "--runtime-config=resource.k8s.io/v1alpha3=true",
            # The kubernetes Service cannot have a loopback endpoint; on a bridge address (a real
            # node's, `xidstream node`) pods reach the API server through it.
            "--endpoint-reconciler-type=" + ("none" if self.host == "127.0.0.1" else "lease"),
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
            "--v=1",
        ]

    def _start_apiserver(self, timeout: float) -> None:
        if self.pid("kube-apiserver"):
            if self._wait_ready(None, timeout):
                return
        if self._port_in_use(self.port):
            raise LocalKubeError(f"port {self.host}:{self.port} is in use by another process (not our "
                                 f"kube-apiserver); stop it or choose another port (--port)")
        proc = self._spawn("kube-apiserver", [str(self.binary), *self.apiserver_args()], self.apiserver_log)
        if not self._wait_ready(proc, timeout):
            self._stop_one("kube-apiserver")
            raise LocalKubeError(f"kube-apiserver did not become ready on {self.server} within {timeout:.0f}s; "
                                 f"last lines of {self.apiserver_log}:\n{self._tail(self.apiserver_log)}")

    def _wait_ready(self, proc: subprocess.Popen | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self._pid_file("kube-apiserver").unlink(missing_ok=True)
                raise LocalKubeError(f"kube-apiserver exited with code {proc.returncode} while starting; "
                                     f"last lines of {self.apiserver_log}:\n{self._tail(self.apiserver_log)}")
            if self.ready():
                return True
            time.sleep(0.3)
        return False

    def start(self, timeout: float = 90.0, keep_data: bool = False) -> KubeHandle:
        """Start etcd and kube-apiserver unless they run; return a handle once /readyz is ok.

        A fresh start wipes etcd's data (a new, empty cluster) unless keep_data."""
        if self.pid("kube-apiserver") and self.pid("etcd") and self.ready():
            return self.handle()
        self.fetch()
        self._credentials()
        started = time.monotonic()
        try:
            self._start_etcd(keep_data=keep_data or bool(self.pid("kube-apiserver")), timeout=min(timeout, 30.0))
            self._start_apiserver(timeout)
        except BaseException:
            self.stop()
            raise
        self._write_kubeconfig()
        self._log(f"ready on {self.server} in {time.monotonic() - started:.1f}s; kubeconfig {self.kubeconfig}")
        return self.handle()

    def _stop_one(self, name: str, grace: float = 20.0) -> bool:
        pid = self.pid(name)
        if pid is None:
            self._pid_file(name).unlink(missing_ok=True)
            return False
        self._log(f"stopping {name} (pid {pid})")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)  # reap our child so it does not linger as a zombie
            except ChildProcessError:
                pass
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            self._log(f"{name} did not stop within {grace:.0f}s; killing it")
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self._pid_file(name).unlink(missing_ok=True)
        return True

    def stop(self) -> bool:
        """Stop the API server, then etcd; True if either was running."""
        api = self._stop_one("kube-apiserver")
        etcd = self._stop_one("etcd")
        return api or etcd

    def status(self) -> dict[str, Any]:
        etcd_pid, api_pid = self.pid("etcd"), self.pid("kube-apiserver")
        return {
            "etcd": {"pid": etcd_pid, "url": self.etcd_url, "healthy": bool(etcd_pid) and self.etcd_healthy()},
            "kube-apiserver": {"pid": api_pid, "server": self.server, "ready": bool(api_pid) and self.ready()},
            "kubeconfig": str(self.kubeconfig) if self.kubeconfig.exists() else None,
            "binary": str(self.binary) if self.binary.exists() else None,
        }


# -- `xidstream kube` -------------------------------------------------------------------------------
def _kube_command(args: argparse.Namespace, settings: Any) -> int:
    kube = LocalKube(port=args.port, etcd_port=args.etcd_port, etcd_peer_port=args.etcd_port + 1)
    if args.action == "fetch":
        print(f"kube-apiserver: {kube.fetch()}\netcd: {shutil.which('etcd')}")
    elif args.action == "start":
        print(f"starting etcd and kube-apiserver (logs: {kube.state_dir}) ...", file=sys.stderr)
        started = time.monotonic()
        handle = kube.start(keep_data=args.keep_data)
        print(f"kube-apiserver is up on {handle.server} ({time.monotonic() - started:.1f}s)\n"
              f"kubeconfig: {handle.kubeconfig}\n"
              f"  e.g. kubectl --kubeconfig {shlex.quote(str(handle.kubeconfig))} get --raw /readyz")
    elif args.action == "stop":
        print("stopped" if kube.stop() else "not running")
    elif args.action == "status":
        st = kube.status()
        print(json.dumps(st, indent=2))
        return 0 if st["kube-apiserver"]["ready"] and st["etcd"]["healthy"] else 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kube", help="the local Kubernetes API server (etcd + kube-apiserver) for the executors' tests")
    p.add_argument("action", choices=["fetch", "start", "stop", "status"])
    p.add_argument("--port", type=int, default=16443, help="kube-apiserver's secure port (default 16443)")
    p.add_argument("--etcd-port", type=int, default=12379, help="etcd's client port (peer: port+1); default 12379")
    p.add_argument("--keep-data", action="store_true", help="start on the previous etcd data instead of an empty cluster")
    p.set_defaults(handler=_kube_command)
