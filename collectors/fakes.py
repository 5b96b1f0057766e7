"""In-memory twins of the collector's I/O, driven by the scenario format.

`FakePynvml` mimics the surface of NVIDIA's `pynvml` module that `xidstream.collectors.nvml.NvmlReader` uses:
the same function names and arguments, return objects with the same attributes, and pynvml's own
`NVMLError` with its per-code subclasses (`pynvml.NVMLError_GpuIsLost`, ...; `.value` is the NVML
return code): the fake raises the very classes the real module raises. A GPU
whose status is `lost` or `reset_required` raises those from every per-device read, as a real
one does; a `lost` GPU also refuses a handle (`nvmlDeviceGetHandleByIndex`), as real NVML does for
a GPU that fell off the bus. Xid and recovery-action events are queued for `nvmlEventSetWait_v2`;
an event set with a lost GPU registered answers GpuIsLost at once and stays broken (Unknown) until
it is freed and created again, so a caller that does not back off spins.

Knobs per GPU for the v2 sample fields: `memory_reserved_mib` (v2 reports it apart; v1's `used` includes it),
`memory_v2=False` (a driver without nvmlDeviceGetMemoryInfo_v2: FunctionNotFound),
`recovery_action` / `remapped_rows` / `ecc_dbe_volatile` (None: NotSupported), `errors`
(function name -> NVML return code it raises), `lose_on_call` ((function, n): the GPU falls off the
bus at the n-th call of that function).

Knobs per GPU for the counters (`NvmlReader.counters`): `nvlinks` (a `FakeNvLink` per link; None: no
NVLink, every link answers NotSupported; a link number past the list answers InvalidArgument, as
NVML does), `nvlink_counter_errors` (nvmlNvLinkErrorCounter_t -> the code every link raises for it),
`pcie_replay_count`, `pcie_link_gen` / `pcie_link_width` ((current, max)), the ECC counts (None
`ecc_dbe_volatile`: no ECC, all four NotSupported), `retired_pages` ((single-bit, double-bit) page
counts; None: NotSupported, as on Ampere and later), `clock_event_reasons` (the bitmask),
`clocks_event_api=False` (a driver before R535: only the Throttle call), `fabric` (a `FakeFabric`;
None: NotSupported), `fabric_v=False` (a driver without nvmlDeviceGetGpuFabricInfoV). The fabric
calls fill the caller's struct through `ctypes.byref`, as pynvml's do, and use pynvml's own struct
classes, so the reader's real path (struct, version, by reference) is the one tested.

Driver knobs (on `FakePynvml`): `compute_versions`, the nvmlDeviceGetComputeRunningProcesses_v<n>
symbols the driver library exports (R510+ has _v3; R470 and the other pre-R510 branches only _v2).
The versioned functions raise `NVMLError_FunctionNotFound` for a missing symbol and the unversioned
one raises pynvml's own `NVMLLibraryMismatchError`, exactly as nvidia-ml-py does
(`_nvmlGetFunctionPointer`, `throwOnVersionMismatch`). `pmon_no_sample`: what the pmon size probe
answers when no sample is newer than the cursor: NotFound (6, as nvml.h documents), or Success (0),
which pynvml's nvmlDeviceGetProcessUtilization raises as `NVMLError(NVML_SUCCESS)` because its size
probe expects InsufficientSize. Per GPU, `still_answers`: functions that keep answering while the GPU
is lost or needs a reset (the driver still knows its UUID and PCI address, say), so a test can have
the rest of an inventory read fail with GpuIsLost / ResetRequired.
"""

from __future__ import annotations

import collections
import threading
import uuid as uuidlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
from pynvml import NVMLLibraryMismatchError  # a plain Exception in nvidia-ml-py, not an NVMLError

__all__ = ["FakePynvml", "FakeGpu", "FakeProcess", "FakeNvLink", "FakeFabric", "FilePynvml"]


def _nvml_error(value: int) -> pynvml.NVMLError:
    """The error pynvml raises for NVML return code `value`: pynvml's own `NVMLError`, which maps
    the code to its subclass (`NVMLError_GpuIsLost` for 15, ...), with its `.value` and its text.
    The fake raises these very classes, so an `except pynvml.NVMLError_GpuIsLost` written for the
    real module catches the fake's errors too, and the reader's real path is the one tested."""
    return pynvml.NVMLError(value)


# Every NVMLError_* subclass pynvml defines (one per NVML_ERROR_* code), offered on the fake as on the module.
_ERROR_CLASSES = {name: getattr(pynvml, name) for name in dir(pynvml)
                  if name.startswith("NVMLError_") and isinstance(getattr(pynvml, name), type)
                  and issubclass(getattr(pynvml, name), pynvml.NVMLError)}


@dataclass
class FakeProcess:
    pid: int
    name: str = "python3"
    used_memory_mib: float | None = None
    sm_util_pct: float | None = None  # None: not seen by pmon


@dataclass
class FakeNvLink:
    """One NVLink: its state and data-link error counters (nvmlDeviceGetNvLinkErrorCounter)."""

    active: bool = True
    replay: int = 0
    recovery: int = 0
    crc_flit: int = 0
    crc_data: int = 0


@dataclass
class FakeFabric:
    """What nvmlDeviceGetGpuFabricInfo(V) fills in."""

    cluster_uuid: str = "00000000-0000-0000-0000-000000000000"
    clique_id: int = 0
    state: int = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = 0  # NVML_SUCCESS
    health_mask: int = 0


@dataclass
class FakeGpu:
    index: int
    uuid: str
    pci_bus_id: str  # as NVML says it: 00000000:01:00.0
    name: str = "NVIDIA GPU"
    serial: str | None = None
    memory_total_mib: int = 32607
    status: str = "ok"  # ok | lost | reset_required
    utilization_gpu_pct: float = 0.0
    utilization_memory_pct: float = 0.0
    memory_used_mib: float = 0.0
    power_w: float = 30.0
    sm_clock_mhz: int = 210
    mem_clock_mhz: int = 405
    temperature_c: int = 35
    processes: list[FakeProcess] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # function names that raise NotSupported
    memory_reserved_mib: float = 0.0  # driver/firmware reserved; inside v1's `used`
    memory_v2: bool = True  # the driver has nvmlDeviceGetMemoryInfo_v2
    recovery_action: int | None = 0  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; None: NotSupported
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corr, unc, pending, failure
    ecc_dbe_volatile: int | None = 0  # None: no ECC on this board (NotSupported)
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML code it raises
    lose_on_call: tuple[str, int] | None = None  # (function, n): lost from its n-th call on
    still_answers: set[str] = field(default_factory=set)  # functions that answer even while lost/reset_required
    # counters (module docstring)
    nvlinks: list[FakeNvLink] | None = None
    nvlink_counter_errors: dict[int, int] = field(default_factory=dict)
    pcie_replay_count: int = 0
    pcie_link_gen: tuple[int, int] = (4, 4)
    pcie_link_width: tuple[int, int] = (16, 16)
    ecc_sbe_volatile: int = 0
    ecc_sbe_aggregate: int = 0
    ecc_dbe_aggregate: int = 0
    retired_pages: tuple[int, int] | None = (0, 0)
    retired_pages_pending: bool = False
    clock_event_reasons: int = 0
    clocks_event_api: bool = True
    fabric: FakeFabric | None = None
    fabric_v: bool = True


class _FakeEventSet:
    def __init__(self) -> None:
        self.gpus: dict[int, FakeGpu] = {}
        self.broken = False


class FakePynvml:
    """A pynvml look-alike over `FakeGpu`s. `clock_us()` gives per-process sample timestamps."""

    NVMLError = pynvml.NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_RESET_REQUIRED = 16
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0
    NVML_SUCCESS = 0
    NVML_VOLATILE_ECC = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    nvmlEventTypeXidCriticalError = 0x8
    nvmlMemory_v2 = 0x02000028
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_FEATURE_ENABLED = 1
    NVML_AGGREGATE_ECC = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    # pynvml's own values and struct classes for the counters: a name missing from nvidia-ml-py
    # fails here, at import, not on a GPU
    for _name in ("NVML_NVLINK_MAX_LINKS", "NVML_NVLINK_ERROR_DL_REPLAY", "NVML_NVLINK_ERROR_DL_RECOVERY",
                  "NVML_NVLINK_ERROR_DL_CRC_FLIT", "NVML_NVLINK_ERROR_DL_CRC_DATA",
                  "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
                  "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED",
                  "NVML_GPU_FABRIC_STATE_COMPLETED", "nvmlGpuFabricInfo_v2", "c_nvmlGpuFabricInfo_t",
                  "c_nvmlGpuFabricInfoV_t", *(n for n in dir(pynvml) if n.startswith(("nvmlClocksEventReason",
                                                                                          "nvmlClocksThrottleReason")))):
        locals()[_name] = getattr(pynvml, _name)
    del _name

    def __init__(self, gpus: list[FakeGpu], driver_version: str = "590.44.01", cuda_version: str = "13.1",
                 available: bool = True, recovery_events: bool = True,
                 compute_versions: tuple[int, ...] = (3, 2), pmon_no_sample: int = 6) -> None:
        for name, cls in _ERROR_CLASSES.items():
            setattr(self, name, cls)
        # Instance attributes, so a test can delete them like an older nvidia-ml-py lacks them.
        self.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
        self.nvmlEventTypeGpuRecoveryAction = 0x8000
        self.recovery_events = recovery_events  # the driver delivers recovery-action events
        self.compute_versions = tuple(compute_versions)  # nvmlDeviceGetComputeRunningProcesses_v<n> it exports
        self.pmon_no_sample = pmon_no_sample  # the pmon probe's answer when there is no newer sample
        self.gpus = list(gpus)
        self.driver_version = driver_version
        major, minor = (cuda_version.split(".") + ["0"])[:2]
        self.cuda_int = int(major) * 1000 + int(minor) * 10
        self.available = available
        self.initialized = False
        self.calls: collections.Counter = collections.Counter()
        self._events: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._pmon_ts = 0

    # -- control (what a scenario does) ----------------------------------------------------
    def gpu(self, ref: int | str) -> FakeGpu:
        for g in self.gpus:
            if ref in (g.index, g.uuid):
                return g
        raise KeyError(ref)

    def inject_xid(self, ref: int | str, xid: int) -> None:
        """Queue an Xid event as the driver would deliver it to a registered event set."""
        with self._cv:
            self._events.append((self.gpu(ref), self.nvmlEventTypeXidCriticalError, xid))
            self._cv.notify_all()

    def inject_recovery_action(self, ref: int | str, action: int) -> None:
        """The driver decided a recovery action: the field changes and an event is queued."""
        gpu = self.gpu(ref)
        if gpu.recovery_action is not None:
            gpu.recovery_action = action
        with self._cv:
            self._events.append((gpu, 0x8000, action))
            self._cv.notify_all()

    # -- internals -------------------------------------------------------------------------
    def _check(self, fn: str, gpu: FakeGpu | None = None) -> None:
        self.calls[fn] += 1
        if not self.available:
            raise _nvml_error(12)
        if not self.initialized:
            raise _nvml_error(1)
        if gpu is not None:
            if gpu.lose_on_call is not None and gpu.lose_on_call[0] == fn:
                left = gpu.lose_on_call[1] - 1
                gpu.lose_on_call = (fn, left)
                if left <= 0:
                    gpu.status, gpu.lose_on_call = "lost", None
            if fn in gpu.errors:
                raise _nvml_error(gpu.errors[fn])
            if fn in gpu.still_answers:
                return
            if gpu.status == "lost":
                raise _nvml_error(15)
            if gpu.status == "reset_required":
                raise _nvml_error(16)
            if fn in gpu.unsupported:
                raise _nvml_error(3)

    # -- pynvml surface --------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if not self.available:
            raise _nvml_error(12)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        return self.cuda_int

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._check("nvmlSystemGetProcessName")
        for g in self.gpus:
            for p in g.processes:
                if p.pid == pid:
                    return p.name
        raise _nvml_error(6)

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check("nvmlDeviceGetHandleByIndex")
        if self.gpus[index].status == "lost":
            raise _nvml_error(15)  # real NVML refuses a handle for a GPU that fell off the bus
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        self._check("nvmlDeviceGetUUID", h)
        return h.uuid

    def nvmlDeviceGetPciInfo_v3(self, h: FakeGpu) -> Any:
        self._check("nvmlDeviceGetPciInfo_v3", h)
        # Older nvidia-ml-py returned bytes here; keep the harder case.
        return SimpleNamespace(busId=h.pci_bus_id.upper().encode())

    def nvmlDeviceGetMinorNumber(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetMinorNumber", h)
        return h.index

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        self._check("nvmlDeviceGetName", h)
        return h.name

    def nvmlDeviceGetSerial(self, h: FakeGpu) -> str:
        self._check("nvmlDeviceGetSerial", h)
        if h.serial is None:
            raise _nvml_error(3)  # GeForce boards have no serial in NVML
        return h.serial

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu, version: int | None = None) -> Any:
        mib = 1024 * 1024
        total, used, reserved = h.memory_total_mib * mib, int(h.memory_used_mib * mib), int(h.memory_reserved_mib * mib)
        if version:  # pynvml calls nvmlDeviceGetMemoryInfo_v2, which an old driver does not have
            self._check("nvmlDeviceGetMemoryInfo_v2", h)
            if not h.memory_v2:
                raise _nvml_error(13)
            return SimpleNamespace(version=version, total=total, reserved=reserved, used=used,
                                   free=total - used - reserved)
        self._check("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=total, used=used + reserved, free=total - used - reserved)

    def nvmlDeviceGetFieldValues(self, h: FakeGpu, field_ids: list) -> list:
        self._check("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            value = h.recovery_action if fid == 230 else None
            out.append(SimpleNamespace(
                fieldId=fid, scopeId=0, timestamp=0, latencyUsec=0, valueType=1,  # NVML_VALUE_TYPE_UNSIGNED_INT
                nvmlReturn=3 if value is None else 0, value=SimpleNamespace(uiVal=value or 0)))
        return out

    def nvmlDeviceGetRemappedRows(self, h: FakeGpu) -> tuple:
        self._check("nvmlDeviceGetRemappedRows", h)
        if h.remapped_rows is None:
            raise _nvml_error(3)
        return tuple(h.remapped_rows)

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, error_type: int, counter_type: int) -> int:
        self._check("nvmlDeviceGetTotalEccErrors", h)
        if h.ecc_dbe_volatile is None:
            raise _nvml_error(3)
        # (NVML_MEMORY_ERROR_TYPE_*, NVML_*_ECC): corrected 0 / uncorrected 1, volatile 0 / aggregate 1
        return {(0, 0): h.ecc_sbe_volatile, (1, 0): h.ecc_dbe_volatile, (0, 1): h.ecc_sbe_aggregate,
                (1, 1): h.ecc_dbe_aggregate}[(error_type, counter_type)]

    # -- counters ----------------------------------------------------------------------------
    def _nvlink(self, h: FakeGpu, link: int) -> FakeNvLink:
        if h.nvlinks is None:
            raise _nvml_error(3)  # no NVLink on this board
        if not 0 <= link < len(h.nvlinks):
            raise _nvml_error(2)  # NVML: InvalidArgument for a link the GPU does not have
        entry = h.nvlinks[link]
        return FakeNvLink(**entry) if isinstance(entry, dict) else entry  # FilePynvml's JSON gives dicts

    def nvmlDeviceGetNvLinkState(self, h: FakeGpu, link: int) -> int:
        self._check("nvmlDeviceGetNvLinkState", h)
        return 1 if self._nvlink(h, link).active else 0  # NVML_FEATURE_ENABLED / DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: FakeGpu, link: int, counter: int) -> int:
        self._check("nvmlDeviceGetNvLinkErrorCounter", h)
        entry = self._nvlink(h, link)
        if counter in h.nvlink_counter_errors:
            raise _nvml_error(h.nvlink_counter_errors[counter])
        return (entry.replay, entry.recovery, entry.crc_flit, entry.crc_data)[counter]

    def nvmlDeviceGetPcieReplayCounter(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetPcieReplayCounter", h)
        return h.pcie_replay_count

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetCurrPcieLinkGeneration", h)
        return h.pcie_link_gen[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetMaxPcieLinkGeneration", h)
        return h.pcie_link_gen[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetCurrPcieLinkWidth", h)
        return h.pcie_link_width[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetMaxPcieLinkWidth", h)
        return h.pcie_link_width[1]

    def nvmlDeviceGetRetiredPages(self, h: FakeGpu, cause: int) -> list:
        self._check("nvmlDeviceGetRetiredPages", h)
        if h.retired_pages is None:
            raise _nvml_error(3)
        return [0x1000 * (i + 1) for i in range(h.retired_pages[cause])]  # pynvml returns the addresses

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetRetiredPagesPendingStatus", h)
        if h.retired_pages is None:
            raise _nvml_error(3)
        return 1 if h.retired_pages_pending else 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        if not h.clocks_event_api:
            self.calls["nvmlDeviceGetCurrentClocksEventReasons"] += 1
            raise _nvml_error(13)  # pynvml's _nvmlGetFunctionPointer: a driver before R535 lacks the symbol
        self._check("nvmlDeviceGetCurrentClocksEventReasons", h)
        return h.clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        return h.clock_event_reasons

    def _fabric_info(self, h: FakeGpu, ref: Any, fn: str) -> int:
        self._check(fn, h)
        if h.fabric is None:
            raise _nvml_error(3)
        info = ref._obj  # ctypes.byref(struct), as pynvml passes it on to the C call
        info.clusterUuid[:] = list(uuidlib.UUID(h.fabric.cluster_uuid).bytes)
        info.cliqueId, info.state, info.status = h.fabric.clique_id, h.fabric.state, h.fabric.status
        if hasattr(info, "healthMask"):
            info.healthMask = h.fabric.health_mask
        return 0

    def nvmlDeviceGetGpuFabricInfoV(self, h: FakeGpu, ref: Any) -> int:
        if not h.fabric_v:
            self.calls["nvmlDeviceGetGpuFabricInfoV"] += 1
            raise _nvml_error(13)
        if ref._obj.version != self.nvmlGpuFabricInfo_v2:
            raise _nvml_error(25)  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        return self._fabric_info(h, ref, "nvmlDeviceGetGpuFabricInfoV")

    def nvmlDeviceGetGpuFabricInfo(self, h: FakeGpu, ref: Any) -> int:
        return self._fabric_info(h, ref, "nvmlDeviceGetGpuFabricInfo")

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        self._check("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=int(h.utilization_gpu_pct), memory=int(h.utilization_memory_pct))

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._check("nvmlDeviceGetPowerUsage", h)
        return int(h.power_w * 1000)

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, clock: int) -> int:
        self._check("nvmlDeviceGetClockInfo", h)
        return h.sm_clock_mhz if clock == self.NVML_CLOCK_SM else h.mem_clock_mhz

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", h)
        return h.temperature_c

    def _compute_processes(self, h: FakeGpu, version: int) -> list:
        self._check(f"nvmlDeviceGetComputeRunningProcesses_v{version}")  # library loaded and initialised
        if version not in self.compute_versions:
            raise _nvml_error(13)  # pynvml's _nvmlGetFunctionPointer: the library lacks the symbol
        self._check("nvmlDeviceGetComputeRunningProcesses", h)
        mib = 1024 * 1024
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=int(p.used_memory_mib * mib) if p.used_memory_mib is not None else None,
                                gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                for p in h.processes]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeGpu) -> list:
        return self._compute_processes(handle, 3)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeGpu) -> list:
        return self._compute_processes(handle, 2)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list:
        # nvidia-ml-py's unversioned call is _v3 under @throwOnVersionMismatch, which turns the
        # missing symbol into NVMLLibraryMismatchError (not an NVMLError).
        try:
            return self._compute_processes(handle, 3)
        except pynvml.NVMLError_FunctionNotFound:
            raise NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML lib version. "
                "Either use matching pyNVML and NVML lib versions or use a versioned function such as "
                "nvmlDeviceGetComputeRunningProcesses_v2") from None

    def nvmlDeviceGetProcessUtilization(self, h: FakeGpu, last_seen_us: int) -> list:
        self._check("nvmlDeviceGetProcessUtilization", h)
        self._pmon_ts += 1_000_000
        samples = [SimpleNamespace(pid=p.pid, timeStamp=self._pmon_ts, smUtil=int(p.sm_util_pct),
                                   memUtil=0, encUtil=0, decUtil=0)
                   for p in h.processes if p.sm_util_pct is not None]
        samples = [s for s in samples if s.timeStamp > last_seen_us]
        if not samples:
            raise _nvml_error(self.pmon_no_sample)  # nothing newer than the cursor (NotFound, or Success)
        return samples

    def nvmlEventSetCreate(self) -> _FakeEventSet:
        self._check("nvmlEventSetCreate")
        return _FakeEventSet()

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, types: int, event_set: _FakeEventSet) -> None:
        self._check("nvmlDeviceRegisterEvents", h)
        if types & 0x8000 and not self.recovery_events:
            raise _nvml_error(3)  # a driver without recovery-action events refuses the whole mask
        event_set.gpus[id(h)] = h

    def nvmlEventSetWait_v2(self, event_set: _FakeEventSet, timeout_ms: int) -> Any:
        self._check("nvmlEventSetWait_v2")
        if event_set.broken:
            raise _nvml_error(999)
        if any(g.status == "lost" for g in event_set.gpus.values()):
            event_set.broken = True
            raise _nvml_error(15)  # answered at once, whatever the timeout
        with self._cv:
            if not self._events:
                self._cv.wait(timeout_ms / 1000.0)
            if not self._events:
                raise _nvml_error(10)
            gpu, kind, data = self._events.popleft()
        return SimpleNamespace(device=gpu, eventType=kind, eventData=data,
                               gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)

    def nvmlEventSetFree(self, event_set: _FakeEventSet) -> None:
        event_set.gpus.clear()


class FilePynvml(FakePynvml):
    """`FakePynvml` whose GPUs a JSON file describes, re-read whenever it changes: what
    `collect --fake-nvml FILE` runs on, so that an end-to-end test on a machine without a GPU can
    drive the real collector in its pod (make e2e writes the file on the host, in the collector's
    state folder) while everything else, the kernel log included, is real. Tests only.

        {"gpus": [{"index": 0, "uuid": "GPU-...", "pci_bus_id": "00000000:3B:00.0",
                   "utilization_gpu_pct": 100, "memory_used_mib": 0, "power_w": 110,
                   "processes": [{"pid": 4242, "name": "python3", "used_memory_mib": 900}]}]}

    Any FakeGpu field may be given; a GPU keeps its handle across re-reads (matched by index).
    A file that cannot be read or parsed keeps the last good state and is counted in `bad_reads`."""

    def __init__(self, path: str, **kw: Any) -> None:
        from pathlib import Path

        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self.bad_reads = 0
        super().__init__([], **kw)
        self._reload()
        if not self.gpus:
            raise ValueError(f"--fake-nvml {path}: no GPUs in it ({{\"gpus\": [...]}})")

    def _reload(self) -> None:
        import json

        try:
            st = self.path.stat()
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # a rename (the harness's atomic write) is a new inode
            if stamp == self._stamp:
                return
            specs = json.loads(self.path.read_text())["gpus"]
            fields = set(FakeGpu.__dataclass_fields__)
            parsed = []
            for spec in specs:
                values = {k: v for k, v in spec.items() if k in fields}
                values["processes"] = [FakeProcess(**p) for p in spec.get("processes", [])]
                parsed.append(values)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.bad_reads += 1  # the last good state stays; the same bad file is counted again
            return
        self._stamp = stamp  # only once it parsed: a fixed file is read even at the same size
        known = {g.index: g for g in self.gpus}
        gpus = []
        for values in parsed:
            gpu = known.get(values.get("index"))
            if gpu is None:
                gpu = FakeGpu(**values)
            else:
                for key, value in values.items():
                    setattr(gpu, key, value)
            gpus.append(gpu)
        self.gpus = gpus
        for spec in specs:  # "xids": [43] queues NVML Xid events once per write of the file
            for xid in spec.get("xids", []):
                self.inject_xid(spec["index"], int(xid))

    def _check(self, fn: str, gpu: FakeGpu | None = None) -> None:
        self._reload()  # a stat() per call: the file's changes show at the next read, whichever it is
        super()._check(fn, gpu)
