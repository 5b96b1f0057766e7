"""How REBOOT_NODE reboots a node (`xidstream execute --scope node --reboot-backend ...`), and how
the node executor knows it happened: the Node's ``status.nodeInfo.bootID`` changed (the kubelet
reports the kernel's /proc/sys/kernel/random/boot_id, new at every boot), the node is Ready again,
and NVML shows the GPU back. Until then the command has no answer; a reboot not seen within the
backend's bound is answered `failed`, and the processor climbs to REPLACE_NODE.

- ``kured`` (the default): writes kured's sentinel (``/var/run/reboot-required``, its
  ``--reboot-sentinel`` default; kubereboot/kured cmd/kured/main.go). Refused, for good, when no
  kured pod runs on the node: the file would never be read. kured checks the sentinel every
  ``--period`` (1 h by default), reboots only inside its window (``--start-time``/``--end-time``/
  ``--reboot-days``), one node at a time under its lock, and drains the node itself under PDBs. It
  uncordons after the reboot only a node that was schedulable when it took its lock, so a node
  xidstream cordoned stays cordoned until the incident's closing UNCORDON_NODE. Time to repair:
  up to one period plus the reboot, which is why its bound is 90 minutes.
- ``logind``: asks the host's systemd-logind to reboot now, over the host's D-Bus system socket
  (``org.freedesktop.login1.Manager.Reboot``; busctl, from the image's systemd package). Privilege:
  uid 0 and that one socket mounted (read-write) into the node pod; no privileged container, no
  capability, but uid 0 on the host's system bus can ask systemd for anything (a transient unit runs
  as host root): host root in all but name, so it is not the default. Safe
  because it runs only for an authentic, fresh REBOOT_NODE of this node, only once the node is
  cordoned and drained (checked on the API server at the moment of acting, as for a reset), and
  logind runs the host's ordinary shutdown (services stopped, filesystems synced). Bound: 15 min.

Each records the bootID before acting in a journal in the executor's state dir (the node pod's
hostPath, which outlives the reboot), so the executor that starts after the reboot answers the
command it had carried out.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

from xidstream.collectors.spool import write_durably
from xidstream.executors.kube import pods_on_node

__all__ = ["REBOOT_BACKENDS", "DEFAULT_REBOOT_BACKEND", "KuredReboot", "LogindReboot", "RebootJournal",
           "kured_on_node", "local_boot_id", "LOGIND_REBOOT", "DEFAULT_CONFIRM_S"]

log = logging.getLogger(__name__)

REBOOT_BACKENDS = ("kured", "logind")
DEFAULT_REBOOT_BACKEND = "kured"
# How long a reboot may take to be seen (bootID changed, node Ready, GPU back) before REBOOT_NODE
# is answered failed: kured's default --period (1 h) plus a reboot of a GPU node (BIOS, driver
# load, up to ~15 min on 8-GPU boards) and margin; logind reboots at once.
DEFAULT_CONFIRM_S = {"kured": 5400.0, "logind": 900.0}
# busctl comes with the image's systemd package (installed for journalctl); the system bus is the
# host's socket mounted at its usual path (/run/dbus/system_bus_socket). Reboot(interactive=false).
LOGIND_REBOOT = ["busctl", "--system", "call", "org.freedesktop.login1", "/org/freedesktop/login1",
                 "org.freedesktop.login1.Manager", "Reboot", "b", "false"]
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def local_boot_id(path: str = BOOT_ID) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


_KURED_IMAGE = re.compile(r"(^|/)kured(:|@|$)")


def kured_on_node(client: Any, node: str, view: Any = None) -> tuple[Any | None, str]:
    """kured's pod on `node` (pod label name=kured or app.kubernetes.io/name=kured, or an image named
    kured: the manifest's and the Helm chart's), and its check period in words. `view`: the pod
    view (transport.podview) instead of a pod list on the API server."""
    for p in pods_on_node(client, node, view):
        labels = p.metadata.labels or {}
        images = [c.image or "" for c in (p.spec.containers if p.spec else [])]
        if labels.get("name") == "kured" or labels.get("app.kubernetes.io/name") == "kured" or \
                any(_KURED_IMAGE.search(i.split("@")[0]) for i in images):
            period = "1h (its default)"
            for c in p.spec.containers:
                for a in (c.command or []) + (c.args or []):
                    if a.startswith("--period="):
                        period = a.split("=", 1)[1]
            return p, period
    return None, ""


@dataclass(frozen=True)
class Requested:
    ok: bool
    text: str


class KuredReboot:
    name = "kured"

    def __init__(self, sentinel: str | Path = "/var/run/reboot-required", pod_view: Any = None) -> None:
        self.sentinel = Path(sentinel)
        self.pod_view = pod_view

    def unavailable(self, client: Any, node: str) -> str | None:
        """Why this backend cannot reboot `node` (a refusal for good), or None."""
        if client is None:
            return "no Kubernetes API to see whether kured runs on the node (--kubeconfig)"
        pod, self.period = kured_on_node(client, node, self.pod_view)
        if pod is None:
            return (f"kured is not running on node {node}: its sentinel would never be read. Install kured, or run "
                    f"the node executor with --reboot-backend logind")
        return None

    def describe(self) -> str:
        return f"write kured's sentinel {self.sentinel} (kured checks it every {getattr(self, 'period', '1h')})"

    def request(self, line: str) -> Requested:
        try:
            self.sentinel.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.sentinel.with_name(self.sentinel.name + ".xidstream-tmp")
            tmp.write_text(line + "\n")
            os.replace(tmp, self.sentinel)
        except OSError as exc:
            return Requested(False, f"cannot write the reboot sentinel {self.sentinel}: {exc.strerror}")
        return Requested(True, f"wrote the reboot sentinel {self.sentinel}: kured reboots the node at its next check "
                               f"(every {getattr(self, 'period', '1h')}) inside its reboot window")

    def withdraw(self) -> str:
        """The reboot was not seen in time: the sentinel goes, so kured does not reboot the node
        later, after it was handed over for replacement or put back into service."""
        try:
            self.sentinel.unlink()
        except FileNotFoundError:
            return f"the sentinel {self.sentinel} was already gone"
        except OSError as exc:
            return f"the sentinel {self.sentinel} could not be removed: {exc.strerror}"
        return f"removed the sentinel {self.sentinel}"


class LogindReboot:
    name = "logind"
    needs_drain = True  # kured drains itself; logind reboots at once

    def __init__(self, argv: list[str] | None = None,
                 run: Callable[[list[str]], tuple[int, str]] | None = None) -> None:
        self.argv = list(argv or LOGIND_REBOOT)
        self.run = run or _run

    def unavailable(self, client: Any, node: str) -> str | None:
        return None

    def describe(self) -> str:
        return f"ask the host's systemd-logind to reboot now ({' '.join(self.argv)})"

    def request(self, line: str) -> Requested:
        code, text = self.run(self.argv)
        if code != 0:
            return Requested(False, f"{' '.join(self.argv[:1])} exit {code}: {text}")
        return Requested(True, f"systemd-logind asked to reboot the node ({self.argv[0]} exit 0)")


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return p.returncode, (p.stdout + p.stderr).strip().replace("\n", " ")[:300]


class RebootJournal:
    """The reboots this node executor asked for and has not answered yet, by command_id: the
    command itself, the bootID before, when it asked and the bound. One JSON file, replaced
    atomically and fsynced, in the executor's state dir."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.clock = clock

    def entries(self) -> dict[str, dict]:
        try:
            doc = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, orjson.JSONDecodeError) as exc:
            log.error("reboot journal %s unreadable (%s): its reboots are not confirmed", self.path, exc)
            return {}
        return doc if isinstance(doc, dict) else {}

    def _write(self, doc: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(self.path, orjson.dumps(doc))

    def add(self, command_id: str, entry: dict) -> None:
        doc = self.entries()
        doc[command_id] = entry
        self._write(doc)

    def remove(self, command_id: str) -> None:
        doc = self.entries()
        if doc.pop(command_id, None) is not None:
            self._write(doc)
