"""The node executor's actions (`xidstream execute --scope node --node NAME`): what needs the node's
own hands. RESET_GPU through nvidia-smi, in the order a real GPU node needs (docs/operations.md
"Reset on a real node"; ../shared/reference/gpu-reset.md section 8), each step reported in the
result's `steps`:

1. the node cordoned and drained (waited for, bounded: CORDON_NODE and DRAIN_NODE leave the
   processor with the reset), no compute process on the GPU, the collector's NVML released;
2. every holder of /dev/nvidia<minor> classified (`xidstream.executors.gpureset.classify_holders`): a workload
   or an unknown process refuses the reset for good, naming it;
3. the platform's reset scope (`reset_scope`): MIG, vGPU guests, NVL72, pre-Ampere NVLink and
   Ampere NVSwitch without Fabric Manager refuse for good, naming the rule;
4. the GPU Operator's operands paused through their node labels (`xidstream.executors.operands`: snapshot in
   a journal, never over another controller's pause) and waited for until their pods are gone;
5. persistence mode turned off where it was on; `nvidia-smi --gpu-reset -i <uuid>`;
6. verified: NVML reads the GPU by UUID, its recovery action is none, no row remap pending or
   failed, and a short window of samples is clean (not pinned, not lost);
7. persistence mode and every label restored exactly, on every path; an executor that died
   between pause and restore restores them when it starts again.

A refusal that will not go away by itself (`final`) makes the processor climb to REBOOT_NODE.
REBOOT_NODE goes through a backend (`xidstream.executors.reboot`: kured's sentinel, or systemd-logind) and is
answered only when the node's bootID changed, the node is Ready and the GPU is back, or `failed`
when that was not seen in time.

The GPU side is behind `GpuOps` so tests drive it with the collector's fakes (FakePynvml, a /proc
copy) and a recorded nvidia-smi; `NvmlGpuOps` is the real one, built from the collector's own
`NvmlReader` and `ProcFs`.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Protocol

from lightkube import Client

from xidstream.collectors.nvml import GpuIdentity, NvmlReader, NvmlRelease, NvmlUnavailable
from xidstream.collectors.sources.procfs import ProcFs
from xidstream.executors.gate import DRY_RUN_PREFIX, PENDING, Answer
from xidstream.executors.gpureset import FABRIC_MANAGER, NvidiaSmi, Platform, SmiAnswer, classify_holders, read_platform, reset_scope
from xidstream.executors.kube import kept_by_drain, node_or_none, pods_on_node, record_event
from xidstream.executors.operands import PAUSE_VALUE as PAUSE, PODS_UNKNOWN, Operands, OperandError
from xidstream.executors.reboot import DEFAULT_CONFIRM_S, KuredReboot, RebootJournal, local_boot_id
from xidstream.schemas.base import normalize_pci, plain_text
from xidstream.schemas.codec import encode
from xidstream.schemas.models import RemediationCommand, ResultStep
from xidstream.schemas.vocab import Action
from xidstream.transport.podview import PodViewClient, PodViewError

__all__ = ["GpuOps", "NvmlGpuOps", "NodeActions", "DEFAULT_REBOOT_SENTINEL", "DEFAULT_PRECONDITION_WAIT",
           "DEFAULT_OPERAND_WAIT"]

log = logging.getLogger(__name__)

DEFAULT_REBOOT_SENTINEL = "/var/run/reboot-required"
# CORDON_NODE, DRAIN_NODE and RESET_GPU leave the processor together; the cluster executor's drain
# takes up to its --drain-timeout (120 s by default). RESET_GPU waits this long for the node to be
# cordoned and drained before checking the rest.
DEFAULT_PRECONDITION_WAIT = 150.0
# How long the operands' pods may take to leave once their labels are paused: 5 minutes, what the
# GPU Operator's driver-upgrade manager and mig-manager allow per operand (gpu-reset.md 1.2).
DEFAULT_OPERAND_WAIT = 300.0
# After the reset: this many samples, this far apart, must read clean (not lost, not pinned at
# >= 95% SM with no memory in use: the wedge's own signature, ../shared/reference/incident.md).
VERIFY_SAMPLES, VERIFY_INTERVAL_S = 3, 1.0
Outcome = tuple[str, str]


class GpuOps(Protocol):
    def find(self, uuid: str | None, index: int | None, pci: str | None) -> GpuIdentity | None: ...
    def release(self) -> None: ...  # our own NVML handles, before the holder scan and the reset
    def compute_pids(self, gpu: GpuIdentity) -> list[int] | None: ...  # None: NVML could not say
    def holders(self, gpu: GpuIdentity) -> list[int]: ...  # PIDs holding /dev/nvidia<minor>
    def platform(self, gpu: GpuIdentity) -> Platform: ...
    def persistence(self, uuid: str) -> bool | None: ...
    def set_persistence(self, uuid: str, on: bool) -> SmiAnswer: ...
    def reset(self, gpu: GpuIdentity) -> SmiAnswer: ...
    def verify(self, gpu: GpuIdentity) -> tuple[bool, str]: ...  # re-read after the reset


class NvmlGpuOps:
    """The collector's NVML reader and /proc holder scan (their public functions), and nvidia-smi."""

    def __init__(self, nvml: Any, procfs: ProcFs | None = None, smi: NvidiaSmi | None = None, *,
                 verify_samples: int = VERIFY_SAMPLES, verify_interval: float = VERIFY_INTERVAL_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.nvml = nvml
        self.reader = NvmlReader(nvml)
        self.procfs = procfs or ProcFs()
        self.smi = smi or NvidiaSmi()
        self.verify_samples, self.verify_interval, self.sleep = verify_samples, verify_interval, sleep
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
        if pci and normalize_pci(pci).startswith("ffff:"):
            pci = None  # the collector's stand-in for a GPU NVML refused on a first start: its index names it
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
        """A full scan (a fresh ProcFs: the collector's incremental one can miss a descriptor
        re-pointed with dup2 until its periodic full read); it decides whether a reset may run."""
        minor = gpu.minor if gpu.minor is not None else gpu.index
        self.procfs = ProcFs(root=self.procfs.root, dev_prefix=self.procfs.dev_prefix)
        return sorted(self.procfs.device_holders().get(f"/dev/nvidia{minor}", []))

    def unreadable(self) -> list[int]:
        """PIDs the last holder scan could not look into (their /proc/<pid>/fd refused)."""
        return sorted(self.procfs.unreadable)

    def fabric_manager_running(self) -> bool | None:
        """nv-fabricmanager among the host's processes (the node pod has hostPID); None: /proc
        shows no host process at all (no hostPID), so nothing can be said."""
        root = self.procfs.root
        try:
            pids = [e for e in os.listdir(root) if e.isdigit()]
        except OSError:
            return None
        if "1" not in pids:
            return None
        # a task name is the process's own choice: only a host process (no pod in its cgroup) counts
        return any(self.procfs.comm(int(p)) == FABRIC_MANAGER and self.procfs.pod_of(int(p)).pod_uid is None
                   for p in pids)

    def platform(self, gpu: GpuIdentity) -> Platform:
        try:
            self._ensure()
            handle = self.reader._device(gpu).handle  # noqa: SLF001 - the reader's own device handle
        except Exception:  # noqa: BLE001 - a GPU NVML refuses: nothing known, the rules decide on None
            return Platform(name=gpu.name, fabric_manager=self.fabric_manager_running())
        return read_platform(self.nvml, handle, gpu.name, self.fabric_manager_running())

    def persistence(self, uuid: str) -> bool | None:
        return self.smi.persistence(uuid)

    def set_persistence(self, uuid: str, on: bool) -> SmiAnswer:
        return self.smi.set_persistence(uuid, on)

    def reset(self, gpu: GpuIdentity) -> SmiAnswer:
        return self.smi.reset(gpu.uuid or gpu.pci_bus_id or str(gpu.index))

    def verify(self, gpu: GpuIdentity) -> tuple[bool, str]:
        """Healthy after the reset: found by UUID, recovery action none, no row remap pending or
        failed (a remap pending at the reset happens at it: NVIDIA, "GPU Memory Error Management"),
        and VERIFY_SAMPLES samples clean. A fresh NVML session: handles from before are stale."""
        try:
            self.reader = NvmlReader(self.nvml)
            self._up = False
            self._ensure()
        except NvmlUnavailable as exc:
            return False, f"NVML unavailable: {exc}"
        again = next((g for g in self.reader.gpus if g.uuid == gpu.uuid), None)
        if again is None:
            return False, f"GPU {gpu.uuid} not found through NVML after the reset"
        seen = []
        for i in range(self.verify_samples):
            if i:
                self.sleep(self.verify_interval)
            r = self.reader.sample(again)
            v = r.values
            if r.status != "ok":
                return False, f"sample {i + 1}: NVML answers {r.status} ({r.error})"
            action = v.get("recovery_action")
            if action not in (None, 0):
                return False, f"sample {i + 1}: NVML's recovery action is still {action} (not none)"
            if v.get("remapped_rows_pending") or v.get("remapped_rows_failure"):
                return False, (f"sample {i + 1}: row remapping {'failed' if v.get('remapped_rows_failure') else 'still pending'}")
            util, used, total = v.get("utilization_gpu_pct"), v.get("memory_used_mib"), v.get("memory_total_mib")
            if util is not None and util >= 95 and used is not None and total and used <= 0.01 * total:
                return False, f"sample {i + 1}: pinned again ({util:.0f}% SM, {used:.0f} MiB used)"
            seen.append(util)
        action_note = "recovery action none" if v.get("recovery_action") == 0 else "recovery action unreadable"
        return True, (f"NVML reads GPU {again.index} ({again.uuid}) healthy: {action_note}, no row remap pending, "
                      f"{len(seen)} clean sample(s)")


def _now() -> datetime:
    return datetime.now(timezone.utc)


class _Steps:
    """The steps of one command, each stamped when it ended."""

    def __init__(self) -> None:
        self.items: list[ResultStep] = []

    def add(self, step: str, ok: bool = True, detail: str = "") -> None:
        self.items.append(ResultStep(step=step, at=_now(), ok=ok, detail=detail[:1000]))
        log.info("step %s %s%s", step, "ok" if ok else "FAILED", f": {detail}" if detail else "")

    def answer(self, outcome: str, detail: str, final: bool = False) -> Answer:
        return Answer(outcome, detail, tuple(self.items), final)


class NodeActions:
    def __init__(self, client: Client | None, node: str, gpu_ops: GpuOps | None,
                 reboot_sentinel: str | Path = DEFAULT_REBOOT_SENTINEL, *,
                 collector_release: NvmlRelease | None = None, release_timeout: float = 10.0,
                 release_hold: float | None = None, precondition_wait: float = DEFAULT_PRECONDITION_WAIT,
                 precondition_poll: float = 2.0, keep_namespaces: tuple[str, ...] = (),
                 state_dir: str | Path | None = None, operand_wait: float = DEFAULT_OPERAND_WAIT,
                 reboot_backend: Any = None, reboot_confirm_s: float | None = None,
                 pod_view: PodViewClient | None = None, clock: Callable[[], float] = time.time) -> None:
        """`pod_view`: ask the cluster executor's pod view for this node's pods (the chart's node
        pods may not list pods); None: list them on the API server with `client`."""
        self.client = client
        self.pod_view = pod_view
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
        # the collector stays released at most this long: the longest reset fits in it (another
        # controller's pause and the operands' leaving, each up to operand_wait; four nvidia-smi
        # calls of up to 120 s; the verification), else its NVML handles would come back mid-reset
        self.release_hold = release_hold if release_hold is not None else 2 * operand_wait + 4 * 120 + 60
        # RESET_GPU waits up to this long (polling every precondition_poll s) for the node to be
        # cordoned and drained: the commands that do it leave the processor with it.
        self.precondition_wait = precondition_wait
        self.precondition_poll = precondition_poll
        # Journals in the executor's state dir (the node pod's hostPath: it outlives a crash and a
        # reboot): the operands paused, the reboots asked for.
        state = Path(state_dir) if state_dir is not None else self.reboot_sentinel.parent / "xidstream-node-executor"
        self.operands = Operands(client, node, state / f"operands-{node}.json", wait_s=operand_wait,
                                 poll_s=precondition_poll, pod_view=pod_view) if client is not None else None
        self.reboot_backend = reboot_backend or KuredReboot(self.reboot_sentinel, pod_view=pod_view)
        self.reboot_confirm_s = reboot_confirm_s if reboot_confirm_s is not None else \
            DEFAULT_CONFIRM_S.get(self.reboot_backend.name, 5400.0)
        self.reboots = RebootJournal(state / f"reboots-{node}.json", clock=clock)
        self.clock = clock
        self._next_due = 0.0
        self._notes: list[str] = []
        self._requested: str | None = None  # the GPU whose release we asked for, until done

    def execute(self, cmd: RemediationCommand, dry_run: bool) -> Answer:
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

    # -- crash recovery --------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Restore what an executor that died mid-reset left paused (persistence mode, then the
        operand labels), from the journal. Returns what could not be restored, in words."""
        if self.operands is None:
            return []
        pause = self.operands.pending()
        if pause is None:
            return []
        log.warning("node %s: a reset (command %s) left operands paused %s and persistence mode off on %s; restoring",
                    self.node, pause.command_id or "?", sorted(pause.before), pause.persistence_off or "none")
        problems = self._restore_persistence(pause)
        problems += self.operands.restore(pause)
        return problems

    def _restore_persistence(self, pause: Any) -> list[str]:
        problems = []
        for uuid in list(pause.persistence_off):
            if self.gpu_ops is None:
                problems.append(f"persistence mode of {uuid} left off: no GPU access here")
                break
            a = self.gpu_ops.set_persistence(uuid, True)
            if a.ok:
                self.operands.note_persistence_restored(pause, uuid)
            else:
                problems.append(f"persistence mode of {uuid} not restored: {a.text}")
        return problems

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
        try:
            pods = pods_on_node(self.client, self.node, self.pod_view)
        except PodViewError as exc:  # cannot tell is not drained: wait for the view as for the drain
            why.append(f"not known to be drained ({exc})")
            return why
        if any(not kept_by_drain(p, self.keep_namespaces) for p in pods):
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
                log.info("%s on %s: node %s; waiting up to %g s for the cordon and drain", "node action",
                         self.node, " and ".join(why), self.precondition_wait)
                waited = True
            time.sleep(min(self.precondition_poll, left))
        return time.monotonic() - started if waited else None

    def _node_checks(self, failed: list[str]) -> None:
        if self.client is None:
            failed.append("no Kubernetes API to check that the node is cordoned and drained (--kubeconfig)")
            return
        node = node_or_none(self.client, self.node)
        if node is None:
            failed.append(f"node {self.node} does not exist on the API server")
            return
        if not node.spec.unschedulable:
            failed.append(f"node {self.node} is not cordoned")
        # an evicted pod still terminating counts: its processes may hold the GPU until the kubelet
        # has stopped them
        try:
            pods = pods_on_node(self.client, self.node, self.pod_view)
        except PodViewError as exc:  # never taken for drained
            failed.append(f"cannot tell whether node {self.node} is drained: {exc}")
            return
        left = [f"{p.metadata.namespace}/{p.metadata.name}" + (" (terminating)" if p.metadata.deletionTimestamp else "")
                for p in pods if not kept_by_drain(p, self.keep_namespaces)]
        if left:
            failed.append(f"node {self.node} is not drained: {len(left)} pod(s) still on it: {', '.join(left[:10])}")

    def _preconditions(self, cmd: RemediationCommand, dry_run: bool = False) -> tuple[list[str], GpuIdentity | None]:
        """Every precondition that fails now, in words (empty: all hold)."""
        failed: list[str] = []
        notes = self._notes = []
        self._node_checks(failed)
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
                    # then classifies whoever holds it.
                    notes.append(f"NVML could not list GPU {gpu.index}'s compute processes "
                                 f"({'; '.join(gpu.notes) or 'unreadable'}): the /dev/nvidia holder scan decided")
                elif pids:
                    failed.append(f"compute process(es) on GPU {gpu.index}: pid {', '.join(map(str, pids))}")
                self.gpu_ops.release()  # our own handles must not count as holders, nor block the reset
                if not failed:
                    self._collector_releases(cmd, gpu, dry_run, failed, notes)
        return failed, gpu

    def _blind(self) -> str | None:
        """What the last holder scan could not look into, in words (None: it read every process).
        Unknown is not "none": a process whose descriptors we cannot read may hold the GPU."""
        blind = getattr(self.gpu_ops, "unreadable", lambda: [])()
        if not blind:
            return None
        return (f"the /dev/nvidia holder scan could not read /proc/<pid>/fd of {len(blind)} process(es) "
                f"(pid {', '.join(map(str, blind[:10]))}): the node executor needs CAP_DAC_READ_SEARCH "
                f"or a privileged container")

    def _holders(self, gpu: GpuIdentity, again: bool = True) -> list:
        pids = [p for p in self.gpu_ops.holders(gpu) if p != os.getpid()]
        procfs = getattr(self.gpu_ops, "procfs", None)
        pods = pods_on_node(self.client, self.node, self.pod_view) if self.client is not None and pids else []
        pausable = self.operands.pausable if self.operands is not None else ()
        if procfs is None:
            from xidstream.executors.gpureset import Holder
            return [Holder(p, None, "unknown", f"pid {p}: not classified (no /proc access)") for p in pids]
        found = classify_holders(pids, procfs, pods, pausable)
        if again and any(h.blocks and h.comm is None for h in found):
            # A holder with no readable name is one exiting as we read it (its /proc entry half
            # gone): looked at again, once, rather than refuse the reset for good over it.
            time.sleep(0.5)
            return self._holders(gpu, again=False)
        return found

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

    def _reset(self, cmd: RemediationCommand, dry_run: bool) -> Answer:
        if not dry_run:
            left = self.recover()
            if self.operands is not None and self.operands.pending() is not None:  # something of ours is still out
                detail = ("an earlier reset's operands or persistence mode could not be restored: " + "; ".join(left)
                          + "; the GPU was not reset")
                self._event(cmd, "XidstreamGpuResetRefused", detail)
                return Answer("refused", detail)
        try:
            return self._reset_released(cmd, dry_run)
        finally:
            self._collector_resumes()  # whatever happened, the collector samples again

    def _refuse(self, cmd: RemediationCommand, steps: _Steps, detail: str, dry_run: bool, final: bool = False) -> Answer:
        detail += "; the GPU was not reset"
        if dry_run:
            return steps.answer("refused", "dry run: " + detail)
        if final:
            detail += " (final: the processor climbs to a reboot)"
        self._event(cmd, "XidstreamGpuResetRefused", detail)
        # refused, not failed: the reset never started. A final refusal makes the processor climb.
        return steps.answer("refused", detail, final=final)

    def _reset_released(self, cmd: RemediationCommand, dry_run: bool) -> Answer:
        steps = _Steps()
        # A dry run describes the node as it is now; an applied reset first waits for the cordon
        # and drain that left the processor with it.
        waited = None if dry_run else self._await_cordon_and_drain()
        failed, gpu = self._preconditions(cmd, dry_run)
        if failed:
            after = (f" (after waiting {self.precondition_wait:g} s for the node to be cordoned and drained)"
                     if waited is not None and waited >= self.precondition_wait else "")
            return self._refuse(cmd, steps, f"precondition failed{after}: " + "; ".join(failed), dry_run)
        assert gpu is not None and self.gpu_ops is not None
        # Who holds the GPU (one scan, after our own NVML handles and the collector's were let go):
        # a workload or an unknown process will not go away by itself.
        try:
            holders = self._holders(gpu)
        except PodViewError as exc:  # whose pods hold it cannot be told: asked again, not final
            return self._refuse(cmd, steps, f"precondition failed: cannot tell who holds GPU {gpu.index}: {exc}",
                                dry_run)
        blind = self._blind()
        if blind:
            return self._refuse(cmd, steps, f"precondition failed: {blind}", dry_run)
        steps.add("cordoned_drained", detail=f"node {self.node} cordoned and drained; no compute process on GPU {gpu.index}")
        blocking = [h for h in holders if h.blocks]
        steps.add("holders_classified", ok=not blocking,
                  detail="; ".join(h.what for h in holders) or f"nobody holds /dev/nvidia{gpu.minor if gpu.minor is not None else gpu.index}")
        if blocking:
            return self._refuse(cmd, steps, f"GPU {gpu.index} is held by what the reset may not stop: "
                                + "; ".join(h.what for h in blocking), dry_run, final=True)
        why = reset_scope(self.gpu_ops.platform(gpu))
        if why:
            return self._refuse(cmd, steps, f"GPU {gpu.index} cannot be reset alone: {why}", dry_run, final=True)
        ops = self.operands
        labels = ops.labels() if ops is not None else {}
        conflicts = ops.conflicts(labels) if ops is not None else []
        if conflicts and not dry_run:
            conflicts, labels = self._wait_conflicts(conflicts)
        if conflicts:
            return self._refuse(cmd, steps, "another controller is changing this node's GPU stack: "
                                + "; ".join(conflicts) + "; retry when it is done", dry_run)
        extra = {k for h in holders for k in h.labels}
        keys = ops.to_pause(labels, extra) if ops is not None else []
        if dry_run:
            plan = (f"pause {', '.join(keys)}" if keys else "no GPU Operator operand to pause") + \
                   "; persistence mode off where on; nvidia-smi --gpu-reset -i " + (gpu.uuid or str(gpu.index))
            return steps.answer("refused", f"{DRY_RUN_PREFIX}reset GPU {gpu.index} ({gpu.uuid}): every precondition "
                                           f"holds now; {plan}" + "".join(f"; {n}" for n in self._notes))
        try:
            pause = ops.pause(keys, cmd.command_id)
        except OperandError as exc:
            steps.add("operands_paused", ok=False, detail=str(exc))
            return self._refuse(cmd, steps, f"the operands could not be paused: {exc}", dry_run)
        try:
            answer = self._reset_paused(cmd, gpu, steps, keys, pause)
        finally:  # on every path, an exception's too: persistence mode first, then the labels
            left = self._restore_persistence(pause)
            if any(s.step == "persistence_off" for s in steps.items):
                steps.add("persistence_restored", ok=not left, detail="; ".join(left) or "persistence mode on again")
            problems = ops.restore(pause)
            if keys or problems:
                steps.add("operands_restored", ok=not problems,
                          detail="; ".join(problems) or ", ".join(f"{k}={v}" for k, v in pause.before.items()))
            if problems or left:
                self._event(cmd, "XidstreamOperandsNotRestored", "; ".join(left + problems))
        unrestored = "".join(f"; NOT RESTORED: {p}" for p in left + problems)
        return Answer(answer.outcome, answer.detail + unrestored, tuple(steps.items), answer.final)

    def _wait_conflicts(self, conflicts: list[str]) -> tuple[list[str], dict[str, str]]:
        """Another controller's pause or upgrade: wait for it, bounded by the operands' wait.
        Returns what is still in the way and the labels as they are now (what to pause is decided
        on these: an operand the upgrade brought back is "true" again and must be paused too)."""
        deadline = time.monotonic() + self.operands.wait_s
        labels = self.operands.labels()
        while conflicts and time.monotonic() < deadline:
            time.sleep(min(self.precondition_poll, max(0.0, deadline - time.monotonic())))
            labels = self.operands.labels()
            conflicts = self.operands.conflicts(labels)
        return [c + f" (still after {self.operands.wait_s:g} s)" for c in conflicts], labels

    def _reset_paused(self, cmd: RemediationCommand, gpu: GpuIdentity, steps: _Steps, keys: list[str],
                      pause: Any) -> Answer:
        ops = self.operands
        if keys:
            steps.add("operands_paused", detail=", ".join(f"{k}: true -> {PAUSE}" for k in keys))
            left = ops.wait_gone(keys)
            steps.add("operands_gone", ok=not left, detail=f"still there: {', '.join(left)}" if left else
                      "their pods left the node")
            if left:
                # The view down (the cluster executor restarting, or flooded) is not an operand
                # that will not leave: asked again later, never a climb to a reboot for it.
                unknown = all(x.startswith(PODS_UNKNOWN) for x in left)
                why = "could not tell whether" if unknown else "did not leave within"
                return self._refuse(cmd, steps, f"the GPU Operator's operands: {why} {ops.wait_s:g} s: "
                                    + ", ".join(left), False, final=not unknown)
        # Anything still holding the GPU now is not ours to stop.
        try:
            holders = [h for h in self._holders(gpu) if h.kind not in ("persistenced", "fabricmanager")]
        except PodViewError as exc:
            return self._refuse(cmd, steps, f"cannot tell who holds GPU {gpu.index} now: {exc}", False)
        if holders:
            steps.add("holders_classified", ok=False, detail="; ".join(h.what for h in holders))
            return self._refuse(cmd, steps, f"GPU {gpu.index} is still held after the operands left: "
                                + "; ".join(h.what for h in holders), False, final=True)
        uuid = gpu.uuid or cmd.gpu_uuid
        if uuid:
            mode = self.gpu_ops.persistence(uuid)
            if mode:
                a = self.gpu_ops.set_persistence(uuid, False)
                if a.ok:
                    ops.note_persistence_off(pause, uuid)
                steps.add("persistence_off", ok=a.ok, detail=a.text)
                if not a.ok:
                    return steps.answer("failed", f"persistence mode could not be turned off: {a.text}")
            elif mode is None:
                self._notes.append("persistence mode unreadable: left as it is")
        a = self.gpu_ops.reset(gpu)
        steps.add("reset", ok=a.ok, detail=a.text)
        noted = "".join(f"; {n}" for n in self._notes)
        if a.unsupported:
            return self._refuse(cmd, steps, f"nvidia-smi says a reset is not available on GPU {gpu.index}: {a.text}",
                                False, final=True)
        if not a.ok:
            detail = f"reset of GPU {gpu.index} ({gpu.uuid}) failed: {a.text}" + \
                (" (the GPU has fallen off the bus)" if a.off_the_bus else "")
            self._event(cmd, "XidstreamGpuResetFailed", detail)
            return steps.answer("failed", detail)
        ok, health = self.gpu_ops.verify(gpu)
        steps.add("verified", ok=ok, detail=health)
        if not ok:
            detail = f"reset of GPU {gpu.index} ({gpu.uuid}) ran but it is not healthy: {health}"
            self._event(cmd, "XidstreamGpuResetFailed", detail)
            return steps.answer("failed", detail)
        detail = f"reset GPU {gpu.index} ({gpu.uuid}): {a.text}; {health}{noted}"
        self._event(cmd, "XidstreamGpuReset", detail, warning=False)
        return steps.answer("succeeded", detail)

    # -- REBOOT_NODE ---------------------------------------------------------------------------
    def _boot_id(self) -> str | None:
        """The node's bootID as the kubelet reports it; the kernel's own where no API answers."""
        if self.client is not None:
            node = node_or_none(self.client, self.node)
            info = node.status.nodeInfo if node is not None and node.status else None
            if info is not None and info.bootID:
                return info.bootID
        return local_boot_id()

    def _reboot(self, cmd: RemediationCommand, dry_run: bool) -> Answer:
        steps = _Steps()
        backend = self.reboot_backend
        try:
            why = backend.unavailable(self.client, self.node)
        except PodViewError as exc:
            # Whether kured runs here cannot be told (the pod view is down): not the final "no
            # kured", which climbs to REPLACE_NODE; the reboot is asked again.
            detail = f"cannot tell whether node {self.node} can be rebooted with the {backend.name} backend: {exc}"
            return Answer("refused", (DRY_RUN_PREFIX if dry_run else "") + detail)
        if dry_run:
            return Answer("refused", f"{DRY_RUN_PREFIX}{backend.describe()}; then wait up to {self.reboot_confirm_s:g} s "
                                     f"for the node's bootID to change" + (f"; but now: {why}" if why else ""))
        if why:
            detail = f"cannot reboot node {self.node} with the {backend.name} backend: {why}"
            self._event(cmd, "XidstreamRebootRefused", detail)
            return Answer("refused", detail + " (final: the processor climbs to REPLACE_NODE)", final=True)
        if getattr(backend, "needs_drain", False):
            self._await_cordon_and_drain()
            failed: list[str] = []
            self._node_checks(failed)
            if failed:
                detail = "precondition failed: " + "; ".join(failed) + "; the node was not rebooted"
                self._event(cmd, "XidstreamRebootRefused", detail)
                return Answer("refused", detail)
        boot = self._boot_id()
        if boot is None:
            return Answer("refused", "the node's bootID is unknown (no API answer, no /proc/sys/kernel/random/boot_id): "
                                     "a reboot could not be confirmed; nothing was done", final=True)
        steps.add("boot_id_recorded", detail=boot)
        entry = {"command": encode(cmd).decode(), "boot_id": boot, "asked_at": self.clock(),
                 "bound_s": self.reboot_confirm_s, "backend": backend.name,
                 "steps": [s.model_dump(mode="json") for s in steps.items]}
        self.reboots.add(cmd.command_id, entry)  # before asking: the executor after the reboot answers it
        got = backend.request(f"xidstream {_now().isoformat()} incident {cmd.incident_id} command {cmd.command_id}: "
                              f"{plain_text(cmd.reason)}")
        steps.add("reboot_requested", ok=got.ok, detail=got.text)
        if not got.ok:
            self.reboots.remove(cmd.command_id)
            self._event(cmd, "XidstreamRebootFailed", got.text)
            return steps.answer("failed", got.text)
        entry["steps"] = [s.model_dump(mode="json") for s in steps.items]
        self.reboots.add(cmd.command_id, entry)
        self._event(cmd, "XidstreamReboot", f"{got.text}; bootID before: {boot}; confirmed when it changes", warning=False)
        return steps.answer(PENDING, got.text)

    def pending_ids(self) -> set[str]:
        return set(self.reboots.entries())

    def due(self, *, force: bool = False) -> list[tuple[RemediationCommand, Answer]]:
        """Reboots asked for that have their answer now: the bootID changed, the node is Ready and
        the GPU back (succeeded), or not within the bound (failed). Checked every 10 s at most."""
        now = self.clock()
        if not force and now < self._next_due:
            return []
        self._next_due = now + 10.0
        if self.operands is not None and self.operands.journal.exists():
            try:
                self.recover()  # a restore an API error cut short: tried again until it is done
            except Exception as exc:  # noqa: BLE001 - the next round tries again; never the loop's end
                log.warning("node %s: restoring the operands again failed: %s", self.node, exc)
        out = []
        for cid, e in self.reboots.entries().items():
            try:
                cmd = RemediationCommand.model_validate_json(e["command"])
            except (KeyError, ValueError) as exc:
                log.error("reboot journal: entry %s unreadable (%s); dropped", cid, exc)
                self.reboots.remove(cid)
                continue
            steps = _Steps()
            steps.items = [ResultStep.model_validate(s) for s in e.get("steps", [])]
            waited = now - float(e.get("asked_at", now))
            late = waited >= float(e.get("bound_s", self.reboot_confirm_s))
            answer = self._confirm(cmd, e, steps, late, waited)
            if answer is not None:
                self.reboots.remove(cid)
                out.append((cmd, answer))
        return out

    def _confirm(self, cmd: RemediationCommand, e: dict, steps: _Steps, late: bool, waited: float) -> Answer | None:
        boot = self._boot_id()
        if boot is None or boot == e.get("boot_id"):
            if not late:
                return None
            detail = (f"node {self.node} was not seen to reboot within {waited:.0f} s: its bootID is still "
                      f"{e.get('boot_id')} ({e.get('backend')} backend)")
            withdraw = getattr(self.reboot_backend, "withdraw", None)
            if withdraw is not None:  # a request left standing would reboot the node later, unasked
                detail += "; " + withdraw()
            self._event(cmd, "XidstreamRebootFailed", detail)
            return steps.answer("failed", detail)
        if not any(s.step == "rebooted" for s in steps.items):
            steps.add("rebooted", detail=f"bootID {e.get('boot_id')} -> {boot}")
        ready = self._ready()
        if self.gpu_ops is not None:
            self.gpu_ops.release()  # a fresh NVML session: a GPU that came up after our first read counts
        gpu = self.gpu_ops.find(cmd.gpu_uuid, cmd.gpu_index, cmd.pci_bus_id) if self.gpu_ops is not None else None
        back = gpu is not None and gpu.status == "ok"
        if not (ready and back):
            if not late:
                return None
            detail = (f"node {self.node} rebooted (bootID {boot}) but " + ("is not Ready" if not ready else
                      f"GPU {cmd.gpu_uuid or cmd.gpu_index} is not back through NVML") + f" after {waited:.0f} s")
            self._event(cmd, "XidstreamRebootFailed", detail)
            return steps.answer("failed", detail)
        if self.gpu_ops is not None:
            self.gpu_ops.release()
        steps.add("node_ready", detail=f"node {self.node} Ready")
        steps.add("gpu_back", detail=f"GPU {gpu.index} ({gpu.uuid}) read through NVML")
        detail = f"node {self.node} rebooted (bootID {e.get('boot_id')} -> {boot}), Ready, GPU {gpu.index} back"
        self._event(cmd, "XidstreamRebooted", detail, warning=False)
        return steps.answer("succeeded", detail)

    def _ready(self) -> bool:
        if self.client is None:
            return False
        node = node_or_none(self.client, self.node)
        conds = (node.status.conditions or []) if node is not None and node.status else []
        return any(c.type == "Ready" and c.status == "True" for c in conds)
