"""The pieces of a GPU reset on a real node that are not Kubernetes: who holds the GPU, what the
platform allows, and nvidia-smi (docs/operations.md "Reset on a real node";
../shared/reference/gpu-reset.md has every fact below with its source).

- `classify_holders`: each process holding /dev/nvidia<minor>, by its task name and the pod its
  cgroup names: a system client the reset works around (nvidia-persistenced: persistence mode off;
  nv-fabricmanager: never stopped, it hands off with nvidia-smi), an operand whose label we may
  pause, or a workload / unknown process, which refuses the reset naming it.
- `reset_scope`: whether this GPU can be reset alone (nvidia-smi(1), "GPU reset"): MIG mode, a vGPU
  guest, NVL72 (IMEX, no public single-GPU procedure), pre-Ampere NVLink and Ampere NVSwitch
  without a running Fabric Manager all refuse for good, naming the rule.
- `NvidiaSmi`: `--query-gpu=persistence_mode`, `-pm 0/1` and `--gpu-reset`, each by UUID, with
  nvidia-smi's return codes read as the manual documents them (3: not available on the target
  device; 15: fallen off the bus; 255: other, the in-use refusal among them).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from xidstream.executors.operands import LABEL_PREFIX, selected_labels

__all__ = ["Holder", "classify_holders", "Platform", "reset_scope", "NvidiaSmi", "SmiAnswer",
           "PERSISTENCED", "FABRIC_MANAGER", "read_platform"]

# Task names (/proc/<pid>/comm keeps 15 bytes) of the host daemons a reset works around.
PERSISTENCED = "nvidia-persiste"  # nvidia-persistenced: "persistence mode counts as a client" (NVSentinel #1690)
FABRIC_MANAGER = "nv-fabricmanage"  # nv-fabricmanager: hands off with nvidia-smi; never stop it (nvidia-smi(1))
# The GPU Operator's driver DaemonSet runs nvidia-persistenced (and Fabric Manager) in its container.
DRIVER_LABEL = LABEL_PREFIX + "driver"


@dataclass(frozen=True)
class Holder:
    pid: int
    comm: str | None
    kind: str  # "persistenced" | "fabricmanager" | "operand" | "workload" | "unknown"
    what: str  # in words, for the result's detail
    labels: tuple[str, ...] = ()  # an operand's gpu.deploy labels

    @property
    def blocks(self) -> bool:
        """Refuses the reset as it stands (an operand blocks until its label is paused)."""
        return self.kind in ("workload", "unknown")


def classify_holders(pids: list[int], procfs: Any, pods: list[Any], pausable: tuple[str, ...]) -> list[Holder]:
    """Each PID holding the GPU, classified. `procfs` gives `comm(pid)` and `pod_of(pid)` (the
    collector's ProcFs); `pods` are the node's pods (their uid names the holder's pod)."""
    by_uid = {p.metadata.uid: p for p in pods if p.metadata and p.metadata.uid}
    out = []
    for pid in pids:
        comm = procfs.comm(pid)
        ref = procfs.pod_of(pid)
        pod = by_uid.get(ref.pod_uid) if ref.pod_uid else None
        where = f"pod {pod.metadata.namespace}/{pod.metadata.name}" if pod is not None else \
            (f"pod uid {ref.pod_uid} (not on this node's API view)" if ref.pod_uid else "the host")
        name = f"pid {pid} ({comm or '?'}) in {where}"
        # A task name is the process's own choice (prctl PR_SET_NAME): a tenant's process may call
        # itself nvidia-persiste. The daemons are believed only where they run: on the host (no
        # pod in the cgroup) or in the GPU Operator's driver pod (which runs both).
        system = (pod is None and not ref.pod_uid) or (pod is not None and DRIVER_LABEL in selected_labels(pod))
        if comm == PERSISTENCED and system:
            out.append(Holder(pid, comm, "persistenced", f"{name}: nvidia-persistenced, persistence mode is turned "
                                                          f"off for the reset and back on after"))
        elif comm == FABRIC_MANAGER and system:
            out.append(Holder(pid, comm, "fabricmanager", f"{name}: Fabric Manager, never stopped (it hands off with "
                                                           f"nvidia-smi; nvidia-smi(1))"))
        elif pod is not None and (labels := selected_labels(pod) & set(pausable)):
            out.append(Holder(pid, comm, "operand", f"{name}: GPU Operator operand ({', '.join(sorted(labels))})",
                              tuple(sorted(labels))))
        elif pod is not None and selected_labels(pod):
            sel = ", ".join(sorted(k.removeprefix(LABEL_PREFIX) for k in selected_labels(pod)))
            out.append(Holder(pid, comm, "unknown", f"{name}: a GPU Operator operand we never pause ({sel})"))
        elif pod is not None:
            out.append(Holder(pid, comm, "workload", f"{name}: a workload"))
        else:
            out.append(Holder(pid, comm, "unknown", f"{name}: not a client the reset may stop (stop it, or let the "
                                                     f"node reboot)"))
    return out


@dataclass(frozen=True)
class Platform:
    """What decides a reset's scope; None where NVML could not say."""

    name: str | None = None
    arch: int | None = None  # NVML_DEVICE_ARCH_*: 7 Ampere, 9 Hopper, 10 Blackwell
    mig: bool | None = None  # MIG mode current or pending
    virtualization: int | None = None  # NVML_GPU_VIRTUALIZATION_MODE_*: 1 passthrough, 2 vGPU guest
    nvlink_peers: bool | None = None  # any active NVLink
    nvswitch: bool | None = None  # an active NVLink ends at an NVSwitch
    fabric_manager: bool | None = None  # nv-fabricmanager runs on the host


AMPERE, HOPPER = 7, 9
VGPU_GUEST = 2


def reset_scope(p: Platform) -> str | None:
    """None when this GPU can be reset alone; else why not, in words (a refusal for good: the
    processor climbs to a reboot). nvidia-smi(1), "-r, --gpu-reset" and its NVSwitch table."""
    if p.mig:
        return ("the GPU is in MIG mode: a reset destroys every GPU instance and nvidia-smi may answer 3 "
                "(not available on target device); a reboot restores the layout through mig-manager")
    if p.virtualization == VGPU_GUEST:
        return "a vGPU guest: GPU reset is not supported on MIG-enabled vGPU guests and is the host's to do (nvidia-smi(1))"
    name = (p.name or "").upper()
    if "GB200" in name or "GB300" in name:
        return ("an NVL72 system (GB200/GB300): no public procedure resets one GPU of an IMEX domain; NVML's recovery "
                "actions name RECOVER_IMEX_DOMAIN or a reboot")
    if p.arch is not None and p.arch < AMPERE and p.nvlink_peers:
        return ("a GPU before Ampere with NVLink peers: every peer must be reset in the same command "
                "(nvidia-smi(1)), and the node's other GPUs are not ours to reset")
    if p.arch == AMPERE and p.nvswitch:
        if p.fabric_manager is None:
            return ("an Ampere NVSwitch system (HGX A100) where this executor cannot see whether Fabric Manager runs "
                    "(hostPID is needed to see it): without it every NVLink peer must be reset together")
        if not p.fabric_manager:
            return ("an Ampere NVSwitch system (HGX A100) with Fabric Manager not running: every NVLink peer must be "
                    "reset in the same command (nvidia-smi(1)); start Fabric Manager, never stop it for a reset")
    return None


def read_platform(nvml: Any, handle: Any, name: str | None, fabric_manager: bool | None) -> Platform:
    """The reset-scope facts through pynvml; a call that fails leaves its field None."""
    def call(fn_name: str, *args: Any) -> Any:
        fn = getattr(nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(handle, *args)
        except Exception:  # noqa: BLE001 - NotSupported, an old driver: unknown, not fatal
            return None

    mig = call("nvmlDeviceGetMigMode")
    links = []
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = call("nvmlDeviceGetNvLinkState", link)
        if state is None:
            break
        if state:
            links.append(link)
    switch = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    nvswitch = any(call("nvmlDeviceGetNvLinkRemoteDeviceType", link) == switch for link in links) if links else False
    return Platform(name=name, arch=call("nvmlDeviceGetArchitecture"),
                    mig=bool(mig[0] or mig[1]) if isinstance(mig, (list, tuple)) and len(mig) == 2 else None,
                    virtualization=call("nvmlDeviceGetVirtualizationMode"), nvlink_peers=bool(links),
                    nvswitch=nvswitch, fabric_manager=fabric_manager)


@dataclass(frozen=True)
class SmiAnswer:
    ok: bool
    code: int
    text: str  # the command and what it printed, on one line

    @property
    def unsupported(self) -> bool:  # nvidia-smi(1): 3, "The requested operation is not available on target device"
        return self.code == 3

    @property
    def off_the_bus(self) -> bool:  # nvidia-smi(1): 15, "GPU has fallen off the bus"
        return self.code == 15


Runner = Callable[[list[str], float], tuple[int, str]]

# The driver's resource manager answers `--gpu-reset` and `-pm` only to an administrator, which on
# Linux is capable(CAP_SYS_ADMIN) (open-gpu-kernel-modules: osIsAdministrator() is NV_IS_SUSER());
# uid 0 without it gets "Insufficient Permissions". Bit 21 of the effective set (linux/capability.h).
CAP_SYS_ADMIN = 21
PROC_STATUS = "/proc/self/status"


def lacks_admin(status: str | None = None) -> bool | None:
    """True when this process's effective capabilities (the CapEff line of /proc/self/status, or
    `status`) lack CAP_SYS_ADMIN; None when they cannot be read."""
    if status is None:
        try:
            status = Path(PROC_STATUS).read_text()
        except OSError:
            return None
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            try:
                return not int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1
            except (IndexError, ValueError):
                return None
    return None


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {timeout:g} s"
    except OSError as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip().replace("\n", " ")[:500]


class NvidiaSmi:
    """nvidia-smi by GPU UUID (an index can name another GPU after a reset renumbers nothing, but a
    UUID never can). `exe` None: found on the PATH when first used."""

    def __init__(self, exe: str | None = None, run: Runner = _run, timeout: float = 120.0) -> None:
        self.exe, self.run, self.timeout = exe, run, timeout

    def _call(self, *args: str) -> SmiAnswer:
        exe = self.exe or shutil.which("nvidia-smi")
        if exe is None:
            return SmiAnswer(False, 127, "nvidia-smi not found on the PATH")
        argv = [exe, *args]
        code, text = self.run(argv, self.timeout)
        return SmiAnswer(code == 0, code, f"nvidia-smi {' '.join(args)} exit {code}: {text}")

    def persistence(self, uuid: str) -> bool | None:
        """Persistence mode now: True/False, None when nvidia-smi could not say. Read, never
        inferred from a running nvidia-persistenced (gpud PR #137: it can be on without one)."""
        a = self._call("--query-gpu=persistence_mode", "--format=csv,noheader", "-i", uuid)
        if not a.ok:
            return None
        word = a.text.rsplit(":", 1)[-1].strip().lower()
        return True if word.startswith("enabled") else False if word.startswith("disabled") else None

    def set_persistence(self, uuid: str, on: bool) -> SmiAnswer:
        return self._call("-pm", "1" if on else "0", "-i", uuid)

    def reset(self, uuid: str) -> SmiAnswer:
        return self._call("--gpu-reset", "-i", uuid)
