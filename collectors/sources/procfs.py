"""What /proc says about GPU processes: who holds /dev/nvidia*, and which pod a PID belongs to.

Holders only prove that a process opened the device (DCGM, gpud, the device plugin and idle
Python processes all do; incident.md "How the diagnosis must be made", step 4), so they are
published apart from compute apps and never count as compute.

PID -> container id -> pod UID from /proc/<pid>/cgroup, for cgroup v1 and v2 and the naming of
containerd, CRI-O and Docker under the kubelet's systemd and cgroupfs drivers, e.g.:
  0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c_3d4e.slice/cri-containerd-<id>.scope
  12:memory:/kubepods/besteffort/pod1b2c-3d4e/<id>
  0::/kubepods.slice/kubepods-pod1b2c_3d4e.slice/crio-<id>.scope
  0::/system.slice/docker-<id>.scope
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PodRef", "parse_cgroup", "ProcFs"]

_POD = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")
_CONTAINER = re.compile(r"(?:cri-containerd-|crio-|docker-|containerd-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class PodRef:
    pod_uid: str | None
    container_id: str | None


def parse_cgroup(text: str) -> PodRef:
    """Pod UID and container id from the contents of /proc/<pid>/cgroup (pure)."""
    pod = container = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2].strip()
        if not path or path == "/":
            continue
        m = _POD.search(path)
        if m and pod is None:
            # systemd driver writes the UID with underscores (kubepods-pod1b2c_3d4e.slice)
            pod = m.group(1).replace("_", "-").lower()
        last = path.rstrip("/").rsplit("/", 1)[-1]
        c = _CONTAINER.search(last)
        if c and container is None:
            container = c.group(1)
        if pod and container:
            break
    return PodRef(pod, container)


class ProcFs:
    """Reads /proc (or a copy of it under `root`, for tests)."""

    def __init__(self, root: str | Path = "/proc", dev_prefix: str = "/dev/nvidia") -> None:
        self.root = Path(root)
        self.dev_prefix = dev_prefix
        self._pods: dict[int, tuple[float, PodRef]] = {}

    def pod_of(self, pid: int) -> PodRef:
        """Cached per PID start time, so a reused PID is read again."""
        try:
            start = (self.root / str(pid) / "stat").stat().st_mtime
        except OSError:
            start = 0.0
        hit = self._pods.get(pid)
        if hit and hit[0] == start:
            return hit[1]
        try:
            ref = parse_cgroup((self.root / str(pid) / "cgroup").read_text(errors="replace"))
        except OSError:
            ref = PodRef(None, None)
        if len(self._pods) > 50_000:
            self._pods.clear()
        self._pods[pid] = (start, ref)
        return ref

    def comm(self, pid: int) -> str | None:
        try:
            return (self.root / str(pid) / "comm").read_text().strip() or None
        except OSError:
            return None

    def device_holders(self) -> dict[str, list[int]]:
        """Device path (/dev/nvidia0, /dev/nvidiactl, ...) -> PIDs that hold it open."""
        holders: dict[str, set[int]] = {}
        try:
            pids = [int(e) for e in os.listdir(self.root) if e.isdigit()]
        except OSError:
            return {}
        for pid in pids:
            fd_dir = self.root / str(pid) / "fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:  # gone, or not ours to read
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd_dir / fd)
                except OSError:
                    continue
                if target.startswith(self.dev_prefix):
                    holders.setdefault(target, set()).add(pid)
        return {dev: sorted(p) for dev, p in holders.items()}
