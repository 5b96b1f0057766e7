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
from array import array
from dataclasses import dataclass, field
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


@dataclass
class _FdCache:
    """What one process's descriptors were at the last scan."""

    ident: int  # st_ctime_ns of /proc/<pid>: a PID reused by a new process gets a new directory inode
    count: int  # st_size of /proc/<pid>/fd: the open descriptors, on Linux 6.2+ procfs (else 0)
    fds: array  # every descriptor number seen (array of uint32: 4 bytes each, not ~60 for a set entry)
    devices: dict[int, str] = field(default_factory=dict)  # descriptor -> /dev/nvidia* it points at


class ProcFs:
    """Reads /proc (or a copy of it under `root`, for tests).

    Holder scans are incremental, for their cost: a readlink of /proc/<pid>/fd/<n> costs about
    8.6 us of CPU, so a training node with 50,000 descriptors paid ~0.4 s per scan, several percent
    of a core. Measured alternatives (bench/collector_bench.py --fds 50000): listing a process's
    fd directory is ~20x cheaper per descriptor than reading each link, and descriptors keep their
    target while open, so a scan lists every process's descriptors and readlinks only the numbers
    it has not seen in that process (keyed by PID and the /proc/<pid> inode time, so a reused PID
    starts over). The blind spot is a number closed and reopened on a /dev/nvidia* device between
    two scans (open() returns the lowest free number, so reuse is common: a process scanned while
    it held a transient file at fd 3 may later open /dev/nvidiactl as fd 3); every `verify_every`
    scans each process is read in full (staggered by PID, so one scan re-reads about
    1/verify_every of the descriptors), which bounds the blind spot to verify_every scans (2
    minutes at the collector's 10 s holder interval) for about 1/12 of the old cost per scan. Reading /proc/<pid>/maps or fdinfo instead
    costs as much as the links themselves.

    Listing is then most of what is left (17 of 20 ms for 50,000 descriptors in the real /proc).
    Since Linux 6.2, stat() of /proc/<pid>/fd gives the number of open descriptors as st_size:
    where that works (probed on /proc/self), a process whose count is unchanged is not listed;
    only the links it holds on /dev/nvidia* are read again, so a release is seen at once. A close
    and an open between two scans keep the count: that is the same blind spot as above, bounded
    by the same periodic full read. Elsewhere (older kernels, test trees) every process is listed.
    """

    def __init__(self, root: str | Path = "/proc", dev_prefix: str = "/dev/nvidia", verify_every: int = 12) -> None:
        self.root = Path(root)
        self.dev_prefix = dev_prefix
        self.verify_every = max(1, verify_every)
        self._pods: dict[int, tuple[float, PodRef]] = {}
        self._fds: dict[int, _FdCache] = {}
        self.scans = 0
        self.readlinks = 0  # links read, in all (the bench multiplies by the real per-link cost)
        self.listings = 0  # fd directories listed, in all
        # PIDs whose /proc/<pid>/fd the last scan was refused (EACCES/EPERM): it cannot say whether
        # they hold a device. Listing another user's fd directory needs CAP_DAC_READ_SEARCH; root
        # with only SYS_PTRACE (an unprivileged container) is refused and would see "no holder".
        self.unreadable: list[int] = []
        self.fd_count_works = self._probe_fd_count()

    def _probe_fd_count(self) -> bool:
        """True where stat(/proc/<pid>/fd).st_size is the number of open descriptors (procfs, 6.2+)."""
        try:
            fd_dir = self.root / "self" / "fd"
            fd = os.open(os.devnull, os.O_RDONLY)
            try:
                size = os.stat(fd_dir).st_size
                names = os.listdir(fd_dir)
            finally:
                os.close(fd)
            # listdir opens one more descriptor (the directory itself) while it lists
            return size > 0 and abs(size - len(names)) <= 1 and os.stat(fd_dir).st_size == size - 1
        except OSError:
            return False

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
        """The task name. Its owner sets it to any 15 bytes (prctl PR_SET_NAME), valid UTF-8 or not:
        an undecodable byte becomes U+FFFD rather than an exception in the collector's loop."""
        try:
            return (self.root / str(pid) / "comm").read_text(errors="replace").strip() or None
        except OSError:
            return None

    def device_holders(self) -> dict[str, list[int]]:
        """Device path (/dev/nvidia0, /dev/nvidiactl, ...) -> PIDs that hold it open."""
        self.scans += 1
        root = str(self.root)
        prefix = self.dev_prefix
        try:
            pids = [int(e) for e in os.listdir(root) if e.isdigit()]
        except OSError:
            return {}
        cache = self._fds
        fresh: dict[int, _FdCache] = {}
        holders: dict[str, set[int]] = {}
        unreadable: list[int] = []
        self.unreadable = unreadable
        readlink = os.readlink
        use_count = self.fd_count_works
        for pid in pids:
            pdir = f"{root}/{pid}"
            fd_dir = pdir + "/fd/"
            prev = cache.get(pid)
            try:
                ident = os.stat(pdir).st_ctime_ns
                count = os.stat(fd_dir).st_size if use_count else 0
                full = prev is None or prev.ident != ident or (pid + self.scans) % self.verify_every == 0
                if use_count and not full and count == prev.count:
                    # Nothing opened or closed (by the count): check only the device links it held.
                    devices = {}
                    for n, dev in prev.devices.items():
                        self.readlinks += 1
                        try:
                            if readlink(f"{fd_dir}{n}") == dev:
                                devices[n] = dev
                        except OSError:
                            pass
                    entry = prev if len(devices) == len(prev.devices) else _FdCache(ident, count, prev.fds, devices)
                    fresh[pid] = entry
                    for dev in devices.values():
                        holders.setdefault(dev, set()).add(pid)
                    continue
                names = os.listdir(fd_dir)
                self.listings += 1
            except PermissionError:  # not ours to read: unknown, not "holds nothing"
                unreadable.append(pid)
                continue
            except OSError:  # gone
                continue
            numbers = array("I", sorted(int(n) for n in names))
            if full:
                new_fds, devices = numbers, {}
            elif numbers == prev.fds:
                fresh[pid] = prev if prev.count == count else _FdCache(ident, count, prev.fds, prev.devices)
                for dev in prev.devices.values():
                    holders.setdefault(dev, set()).add(pid)
                continue
            else:
                seen = set(prev.fds)
                new_fds = [n for n in numbers if n not in seen]
                now = set(numbers)
                devices = {n: d for n, d in prev.devices.items() if n in now}
            for n in new_fds:
                try:
                    target = readlink(f"{fd_dir}{n}")
                except OSError:
                    continue
                finally:
                    self.readlinks += 1
                if target.startswith(prefix):
                    devices[n] = target
            fresh[pid] = _FdCache(ident, count, numbers, devices)
            for dev in devices.values():
                holders.setdefault(dev, set()).add(pid)
        self._fds = fresh  # exited processes drop out here
        return {dev: sorted(p) for dev, p in holders.items()}
