"""Real CustomResourceDefinitions for the replace backends' tests, taken from the Go modules that
ship them (Cluster API's Machine, Karpenter's NodeClaim), fetched once with the Go toolchain and
cached under ~/.cache/xidstream/crds/.

The manifests are what `kubectl apply -f` of each project's release installs (controller-gen's
output, committed in the module), so a test against them sees the real schema, versions and
subresources: a field the backend reads that the CRD does not have fails here.

A missing Go toolchain or module proxy fails the test (as a missing helm or kube-apiserver does):
on the project's machines both are present, and a silent skip would hide that the backends went
untested. Set XIDSTREAM_CRD_DIR to a folder that already holds the files (same layout) to run
without Go.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.tools import find_tool
from workshop.localbroker import default_cache_dir

__all__ = ["CRDS", "crd_file", "install_crd"]

# module, version, path in the module. Versions: the newest the module proxy serves whose go.mod
# this machine's Go (1.26.8) accepts (Karpenter v1.14.3 and v1.15.0 ask for a newer Go).
CRDS = {
    "machines.cluster.x-k8s.io": ("sigs.k8s.io/cluster-api", "v1.13.6",
                                  "config/crd/bases/cluster.x-k8s.io_machines.yaml"),
    "nodeclaims.karpenter.sh": ("sigs.k8s.io/karpenter", "v1.14.1", "pkg/apis/crds/karpenter.sh_nodeclaims.yaml"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("XIDSTREAM_CRD_DIR") or default_cache_dir() / "crds")


def crd_file(name: str) -> Path:
    """The cached manifest of CRD `name` (a key of CRDS), fetched on first use."""
    module, version, path = CRDS[name]
    dest = cache_dir() / f"{module.replace('/', '_')}@{version}" / Path(path).name
    if dest.is_file():
        return dest
    go = find_tool("XIDSTREAM_GO", names=("go",),
                   hint=f"the Go toolchain fetches {module}@{version} once for its CRD {path} (or set "
                        f"XIDSTREAM_CRD_DIR to a folder holding {dest.relative_to(cache_dir())})")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (dest.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel workers: one downloads, the others find it
        if dest.is_file():
            return dest
        started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "GOFLAGS"}
        with tempfile.TemporaryDirectory() as cwd:  # outside any go.mod: a plain module download
            proc = subprocess.run([go, "mod", "download", "-json", f"{module}@{version}"], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=600)
        try:
            info = json.loads(proc.stdout or "{}")
        except ValueError:
            info = {}
        if proc.returncode != 0 or info.get("Error") or not info.get("Dir"):
            pytest.fail(f"`go mod download {module}@{version}` failed (exit {proc.returncode}): "
                        f"{info.get('Error') or proc.stderr.strip()[-1500:]}; it needs the Go module proxy "
                        f"(GOPROXY={os.environ.get('GOPROXY', 'default')}) or a warm module cache")
        src = Path(info["Dir"]) / path
        if not src.is_file():
            pytest.fail(f"{module}@{version} has no {path}: the CRD moved; update tests/executors/crds.py")
        tmp = dest.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        tmp.rename(dest)
        print(f"fetched {name} from {module}@{version} in {time.monotonic() - started:.1f}s -> {dest}")
    return dest


def install_crd(kube, name: str, timeout: float = 60.0) -> dict:
    """Create CRD `name` on the API server (kept if there: the server is shared by the session) and
    wait until it is Established and its versions are served; returns the manifest."""
    crd = yaml.safe_load(crd_file(name).read_text())
    status, body = kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    assert status in (201, 409), body
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
    served = [v["name"] for v in crd["spec"]["versions"] if v.get("served")]
    deadline = time.monotonic() + timeout
    while True:
        status, got = kube.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        established = status == 200 and any(c["type"] == "Established" and c["status"] == "True"
                                             for c in (got.get("status") or {}).get("conditions") or [])
        if established and all(kube.request("GET", f"/apis/{group}/{v}/{plural}")[0] in (200,) for v in served):
            return crd
        assert time.monotonic() < deadline, f"CRD {name} not served within {timeout:.0f}s: {got}"
        time.sleep(0.2)
