"""The node executor's actions (`xidstream execute --scope node --node NAME`): what needs the node's
own hands. RESET_GPU through nvidia-smi after checking its preconditions at the moment of acting;
REBOOT_NODE by writing the sentinel kured watches (kured then drains and reboots one node at a time).
RESET_GPU leaves the processor together with the CORDON_NODE and DRAIN_NODE the cluster executor
carries out, so it first waits (bounded, `precondition_wait`) for the node to be cordoned and
drained; a precondition that still fails then is answered `refused` (the reset never started).

The GPU side is behind `GpuOps` so tests drive it with the collector's fakes (FakePynvml, a /proc
copy); `NvmlGpuOps` is the real one, built from the collector's own `NvmlReader` and `ProcFs`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Protocol

from lightkube import Client

from collectors.nvml import GpuIdentity, NvmlReader, NvmlRelease, NvmlUnavailable
from collectors.sources.procfs import ProcFs
from executors.gate import DRY_RUN_PREFIX
from executors.kube import kept_by_drain, node_or_none, pods_on_node, record_event
from schemas.base import normalize_pci, plain_text
from schemas.models import RemediationCommand
from schemas.vocab import Action

__all__ = ["GpuOps", "NvmlGpuOps", "NodeActions", "DEFAULT_REBOOT_SENTINEL", "DEFAULT_PRECONDITION_WAIT",
           "nvidia_smi_reset"]

log = logging.getLogger(__name__)

DEFAULT_REBOOT_SENTINEL = "/var/run/reboot-required"
# CORDON_NODE, DRAIN_NODE and RESET_GPU leave the processor together; the cluster executor's drain
# takes up to its --drain-timeout (120 s by default). RESET_GPU waits this long for the node to be
# cordoned and drained before checking the rest; with the reset's own bound (nvidia-smi 120 s) and the
# collector's release (10 s) it stays under Kafka's max.poll.interval.ms (300 s).
DEFAULT_PRECONDITION_WAIT = 150.0
Outcome = tuple[str, str]


class GpuOps(Protocol):
    def find(self, uuid: str | None, index: int | None, pci: str | None) -> GpuIdentity | None: ...
    def release(self) -> None: ...  # our own NVML handles, before the holder scan and the reset
    def compute_pids(self, gpu: GpuIdentity) -> list[int] | None: ...  # None: NVML could not say
    def holders(self, gpu: GpuIdentity) -> list[int]: ...  # PIDs holding /dev/nvidia<minor>
    def reset(self, gpu: GpuIdentity) -> tuple[bool, str]: ...
    def health(self, gpu: GpuIdentity) -> str: ...  # re-read after the reset: "ok", "lost", ...


def nvidia_smi_reset(index: int) -> tuple[bool, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False, "nvidia-smi not found on the PATH"
    proc = subprocess.run([exe, "--gpu-reset", "-i", str(index)], capture_output=True, text=True, timeout=120)
    text = (proc.stdout + proc.stderr).strip().replace("\n", " ")[:500]
    return proc.returncode == 0, f"nvidia-smi --gpu-reset -i {index} exit {proc.returncode}: {text}"


class NvmlGpuOps:
    """The collector's NVML reader and /proc holder scan (their public functions), and nvidia-smi."""

    def __init__(self, nvml: Any, procfs: ProcFs | None = None,
                 reset_fn: Callable[[int], tuple[bool, str]] = nvidia_smi_reset) -> None:
        self.nvml = nvml
        self.reader = NvmlReader(nvml)
        self.procfs = procfs or ProcFs()
        self.reset_fn = reset_fn
        self._up = False

    def _ensure(self) -> None:
        if not self._up:
            self.reader.init()
            self._up = True

    def find(self, uuid: str | None, index: int | None, pci: str | None) -> GpuIdentity | None:
        try:
            self._ensure()
        except NvmlUnavailable:
            return None
        for g in self.reader.gpus:
            if (uuid and g.uuid == uuid) or (not uuid and pci and g.pci_bus_id == normalize_pci(pci)) or \
                    (not uuid and not pci and index is not None and g.index == index):
                return g
        # A GPU that needs the reset often refuses its identity (ResetRequired, GpuIsLost): NVML
        # still counts it at its index, and the command names that index (and UUID, PCI id).
        if index is not None and index in self.reader.refused:
            return GpuIdentity(index=index, uuid=uuid or "", pci_bus_id=normalize_pci(pci) or "", name=None,
                               serial=None, memory_total_mib=None, driver_version=None, cuda_version=None,
                               minor=index, notes=(f"NVML refuses it: {self.reader.refused[index]}",),
                               status="lost")
        return None

    def compute_pids(self, gpu: GpuIdentity) -> list[int] | None:
        self._ensure()
        if gpu.status != "ok":
            return None  # NVML refuses the GPU: its process list is unknown
        apps = self.reader.compute_apps(gpu)
        return None if apps is None else [pid for pid, _ in apps]

    def release(self) -> None:
        if self._up:
            self.reader.shutdown()
            self._up = False

    def holders(self, gpu: GpuIdentity) -> list[int]:
        minor = gpu.minor if gpu.minor is not None else gpu.index
        return sorted(self.procfs.device_holders().get(f"/dev/nvidia{minor}", []))

    def unreadable(self) -> list[int]:
        """PIDs the last holder scan could not look into (their /proc/<pid>/fd refused)."""
        return sorted(self.procfs.unreadable)

    def reset(self, gpu: GpuIdentity) -> tuple[bool, str]:
        return self.reset_fn(gpu.index)

    def health(self, gpu: GpuIdentity) -> str:
        try:
            self.reader = NvmlReader(self.nvml)  # a fresh read: handles from before the reset are stale
            self._up = False
            self._ensure()
        except NvmlUnavailable as exc:
            return f"NVML unavailable: {exc}"
        again = next((g for g in self.reader.gpus if g.uuid == gpu.uuid), None)
        if again is None:
            return "not found after the reset"
        return self.reader.sample(again).status


class NodeActions:
    def __init__(self, client: Client | None, node: str, gpu_ops: GpuOps | None,
                 reboot_sentinel: str | Path = DEFAULT_REBOOT_SENTINEL, *,
                 collector_release: NvmlRelease | None = None, release_timeout: float = 10.0,
                 release_hold: float = 300.0, precondition_wait: float = DEFAULT_PRECONDITION_WAIT,
                 precondition_poll: float = 2.0, keep_namespaces: tuple[str, ...] = ()) -> None:
        self.client = client
        # the cluster executor's --drain-keep-namespace: its pods do not make the node "not drained"
        self.keep_namespaces = tuple(keep_namespaces)
        self.node = node
        self.gpu_ops = gpu_ops
        self.reboot_sentinel = Path(reboot_sentinel)
        # The collector's side of the reset handshake (collectors.nvml.NvmlRelease): its state dir,
        # shared with this executor in the node's pod. None, or a dir that does not exist: not asked
        # (the holder scan still finds a collector that holds /dev/nvidia<minor>).
        self.collector_release = collector_release
        self.release_timeout = release_timeout
        self.release_hold = release_hold
        # RESET_GPU waits up to this long (polling every precondition_poll s) for the node to be
        # cordoned and drained: the commands that do it leave the processor with it.
        self.precondition_wait = precondition_wait
        self.precondition_poll = precondition_poll
        self._notes: list[str] = []
        self._requested: str | None = None  # the GPU whose release we asked for, until done

    def execute(self, cmd: RemediationCommand, dry_run: bool) -> Outcome:
        if cmd.action == Action.RESET_GPU:
            return self._reset(cmd, dry_run)
        return self._reboot(cmd, dry_run)

    def _event(self, cmd: RemediationCommand, reason: str, message: str, warning: bool = True) -> None:
        if self.client is None:
            return
        node = node_or_none(self.client, self.node)
        if node is not None:
            record_event(self.client, node, reason=reason, type_="Warning" if warning else "Normal",
                         message=f"xidstream {cmd.action.value} (incident {cmd.incident_id}, command "
                                 f"{cmd.command_id}): {message}")

    # -- RESET_GPU -----------------------------------------------------------------------------
    def _node_not_ready(self) -> list[str] | None:
        """What keeps the node from being cordoned and drained now (empty: both hold); None when
        there is nothing to wait for (no API server, no such node)."""
        if self.client is None:
            return None
        node = node_or_none(self.client, self.node)
        if node is None:
            return None
        why = [] if node.spec.unschedulable else ["not cordoned"]
        # an evicted pod still terminating counts: its processes may hold the GPU until the kubelet
        # has stopped them
        if any(not kept_by_drain(p, self.keep_namespaces) for p in pods_on_node(self.client, self.node)):
            why.append("not drained")
        return why

    def _await_cordon_and_drain(self) -> float | None:
        """Wait (bounded by precondition_wait) until the node is cordoned and drained. Returns the
        seconds waited when it had to wait, None when it was ready at once (or there is nothing to
        wait for). The full check follows either way, so a node that never gets there fails it."""
        started = time.monotonic()
        deadline = started + self.precondition_wait
        waited = False
        while True:
            why = self._node_not_ready()
            if not why:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not waited:
                log.info("RESET_GPU on %s: node %s; waiting up to %g s for the cordon and drain",
                         self.node, " and ".join(why), self.precondition_wait)
                waited = True
            time.sleep(min(self.precondition_poll, left))
        return time.monotonic() - started if waited else None

    def _preconditions(self, cmd: RemediationCommand, dry_run: bool = False) -> tuple[list[str], GpuIdentity | None]:
        """Every precondition that fails now, in words (empty: all hold)."""
        failed: list[str] = []
        notes = self._notes = []
        if self.client is None:
            failed.append("no Kubernetes API to check that the node is cordoned and drained (--kubeconfig)")
        else:
            node = node_or_none(self.client, self.node)
            if node is None:
                failed.append(f"node {self.node} does not exist on the API server")
            else:
                if not node.spec.unschedulable:
                    failed.append(f"node {self.node} is not cordoned")
                # an evicted pod still terminating counts: its processes may hold the GPU until
                # the kubelet has stopped them
                left = [f"{p.metadata.namespace}/{p.metadata.name}"
                        + (" (terminating)" if p.metadata.deletionTimestamp else "")
                        for p in pods_on_node(self.client, self.node) if not kept_by_drain(p, self.keep_namespaces)]
                if left:
                    failed.append(f"node {self.node} is not drained: {len(left)} pod(s) still on it: {', '.join(left[:10])}")
        gpu = None
        if self.gpu_ops is None:
            failed.append("no NVML on this executor")
        else:
            gpu = self.gpu_ops.find(cmd.gpu_uuid, cmd.gpu_index, cmd.pci_bus_id)
            if gpu is None:
                failed.append(f"GPU {cmd.gpu_uuid or cmd.pci_bus_id or cmd.gpu_index} not found through NVML")
            else:
                pids = self.gpu_ops.compute_pids(gpu)
                if pids is None:
                    # Unknown is not "none", so it is not taken as such: every process that
                    # computes on a GPU holds its /dev/nvidia<minor> open, and the holder scan
                    # below must then find nobody. The detail says which check decided.
                    notes.append(f"NVML could not list GPU {gpu.index}'s compute processes "
                                 f"({'; '.join(gpu.notes) or 'unreadable'}): the /dev/nvidia holder scan decided")
                elif pids:
                    failed.append(f"compute process(es) on GPU {gpu.index}: pid {', '.join(map(str, pids))}")
                self.gpu_ops.release()  # our own handles must not count as holders, nor block the reset
                if not failed:
                    self._collector_releases(cmd, gpu, dry_run, failed, notes)
                holders = [p for p in self.gpu_ops.holders(gpu) if p != os.getpid()]
                if holders:
                    failed.append(f"/dev/nvidia{gpu.minor if gpu.minor is not None else gpu.index} is held open by "
                                  f"pid {', '.join(map(str, holders))}")
                blind = getattr(self.gpu_ops, "unreadable", lambda: [])()
                if blind:
                    # Unknown is not "none": a process whose descriptors we cannot read may hold the GPU.
                    failed.append(f"the /dev/nvidia holder scan could not read /proc/<pid>/fd of {len(blind)} process(es) "
                                  f"(pid {', '.join(map(str, blind[:10]))}): the node executor needs CAP_DAC_READ_SEARCH "
                                  f"or a privileged container")
        return failed, gpu

    def _collector_releases(self, cmd: RemediationCommand, gpu: GpuIdentity, dry_run: bool, failed: list[str],
                            notes: list[str]) -> None:
        """Ask the collector to shut NVML down and wait (bounded) for its acknowledgement: its
        handles hold /dev/nvidia*, and nvidia-smi --gpu-reset refuses a GPU any process holds."""
        rel = self.collector_release
        uuid = gpu.uuid or cmd.gpu_uuid
        if rel is None or not rel.dir.parent.is_dir() or not uuid:
            notes.append("the collector was not asked to release NVML (no collector state dir here); "
                         "the /dev/nvidia holder scan decided")
            return
        if dry_run:
            notes.append(f"would ask the collector to release NVML ({rel.dir})")
            return
        rel.request(uuid, command_id=cmd.command_id, hold_s=self.release_hold)
        self._requested = uuid
        ack = rel.wait_released(uuid, self.release_timeout)
        if ack is None:
            failed.append(f"the collector did not release its NVML handles within {self.release_timeout:g} s "
                          f"(no acknowledgement in {rel.dir})")
        else:
            notes.append(f"the collector (pid {ack.get('pid')}) released its NVML handles")

    def _collector_resumes(self) -> None:
        if self._requested is not None and self.collector_release is not None:
            self.collector_release.done(self._requested)
        self._requested = None

    def _reset(self, cmd: RemediationCommand, dry_run: bool) -> Outcome:
        try:
            return self._reset_released(cmd, dry_run)
        finally:
            self._collector_resumes()  # whatever happened, the collector samples again

    def _reset_released(self, cmd: RemediationCommand, dry_run: bool) -> Outcome:
        # A dry run describes the node as it is now; an applied reset first waits for the cordon
        # and drain that left the processor with it.
        waited = None if dry_run else self._await_cordon_and_drain()
        failed, gpu = self._preconditions(cmd, dry_run)
        if failed:
            after = (f" (after waiting {self.precondition_wait:g} s for the node to be cordoned and drained)"
                     if waited is not None and waited >= self.precondition_wait else "")
            detail = f"precondition failed{after}: " + "; ".join(failed) + "; the GPU was not reset"
            if not dry_run:
                self._event(cmd, "XidstreamGpuResetRefused", detail)
            # refused, not failed: the reset never started. A failed RESET_GPU makes the processor
            # climb to REBOOT_NODE; a refused one is reported for an operator.
            return "refused", ("dry run: " + detail) if dry_run else detail
        assert gpu is not None and self.gpu_ops is not None
        if dry_run:
            return "refused", (f"{DRY_RUN_PREFIX}reset GPU {gpu.index} ({gpu.uuid}) with nvidia-smi --gpu-reset -i "
                               f"{gpu.index}: every precondition holds now" + "".join(f"; {n}" for n in self._notes))
        ok, text = self.gpu_ops.reset(gpu)
        health = self.gpu_ops.health(gpu)
        noted = "".join(f"; {n}" for n in self._notes)
        if ok and health == "ok":
            detail = f"reset GPU {gpu.index} ({gpu.uuid}): {text}; NVML reads it again: {health}{noted}"
            self._event(cmd, "XidstreamGpuReset", detail, warning=False)
            return "succeeded", detail
        detail = f"reset of GPU {gpu.index} ({gpu.uuid}) failed: {text}; NVML after it: {health}"
        self._event(cmd, "XidstreamGpuResetFailed", detail)
        return "failed", detail

    # -- REBOOT_NODE ---------------------------------------------------------------------------
    def _reboot(self, cmd: RemediationCommand, dry_run: bool) -> Outcome:
        path = self.reboot_sentinel
        if dry_run:
            return "refused", f"{DRY_RUN_PREFIX}write the reboot sentinel {path} (kured drains and reboots the node)"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".xidstream-tmp")
            tmp.write_text(f"xidstream {datetime.now(timezone.utc).isoformat()} incident {cmd.incident_id} "
                           f"command {cmd.command_id}: {plain_text(cmd.reason)}\n")  # one line, whatever signed it
            os.replace(tmp, path)
        except OSError as exc:
            detail = f"cannot write the reboot sentinel {path}: {exc.strerror}"
            self._event(cmd, "XidstreamRebootFailed", detail)
            return "failed", detail
        detail = f"wrote the reboot sentinel {path}: kured will drain and reboot node {self.node}"
        self._event(cmd, "XidstreamReboot", detail)
        return "succeeded", detail
