"""NVML behind one small class, `NvmlReader`, over a pynvml-like module.

The real module is `pynvml` from NVIDIA's `nvidia-ml-py`; tests, the demo and replay pass
`xidstream.collectors.fakes.FakePynvml`, which mimics pynvml's surface (functions, return objects,
`NVMLError_*` classes), so both run this same code.

Every read is wrapped (runtime-notes section 4; gpud treats lost/reset as health, not crashes):
- NotSupported, NoPermission, NotFound, NoData, FunctionNotFound -> the field is null and nothing
  is counted: on a healthy board these are normal answers (an idle GPU has no process sample, a
  GeForce has no ECC or row remapper, an old driver lacks the function), and counting them made the
  error metric rise on healthy nodes. A field found unsupported is not asked
  again until the next inventory refresh;
- GpuIsLost / ResetRequired -> the sample's `status` says so and the collector publishes it; the
  same answers during the inventory read give the GPU's identity that status (never `ok`);
- anything else -> the field is null and the error is counted; never an exception out of here.

Counters (`NvmlReader.counters`, read at a slower cadence than samples: `collect --counters-interval`):
NVLink state and data-link error counters per link, PCIe replays and link generation/width, ECC
counts, retired pages, clock event reasons, temperature and NVLink fabric registration. A counter
the driver answers NotSupported for (or a function the pynvml module or the driver lacks) is
recorded once per GPU in `unsupported` and never asked again for the life of the process, even
across inventory refreshes: these are properties of the board and driver, and a 60 s cadence
that re-probed them would cost most of the calls on a board that has none of them.

Versioned calls: nvidia-ml-py's unversioned wrappers call the newest symbol, and where the driver
library lacks it `throwOnVersionMismatch` raises `NVMLLibraryMismatchError`, a plain Exception and
not an NVMLError (pynvml.py). nvmlDeviceGetComputeRunningProcesses is one: it calls _v3, which
drivers before R510 (470 and the other pre-R510 branches) do not export. So the reader asks the
versioned functions itself, newest first, and takes a missing symbol (FunctionNotFound from
pynvml's `_nvmlGetFunctionPointer`) or that mismatch as "this driver has no such call".
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from xidstream.schemas.base import normalize_pci
from xidstream.schemas.limits import NVLINK_LINKS_MAX

__all__ = ["NvmlReader", "NvmlUnavailable", "EventWaitFailed", "GpuIdentity", "SampleReading", "CounterReading",
           "XidNotice", "NvmlRelease", "RELEASE_DIR", "COUNTER_FIELDS"]

log = logging.getLogger(__name__)

# NVML return codes (nvml.h); pynvml exposes them as NVML_ERROR_* too.
SUCCESS, INVALID_ARGUMENT = 0, 2
NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, TIMEOUT, GPU_IS_LOST, RESET_REQUIRED = 3, 4, 6, 10, 15, 16
FUNCTION_NOT_FOUND, NO_DATA, ARGUMENT_VERSION_MISMATCH, UNKNOWN = 13, 21, 25, 999
# Answers that mean "this board/driver has no such value (now)": null, never an error count.
# SUCCESS: pynvml's two-call readers (nvmlDeviceGetProcessUtilization) expect the size probe to
# answer InsufficientSize and raise NVMLError(ret) for anything else, Success included, which is
# what NVML answers when it has no sample newer than the timestamp: nothing to report, no error.
_ABSENT = frozenset({SUCCESS, NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, NO_DATA, FUNCTION_NOT_FOUND})
# Absent for good on this board and driver: not asked again until the next inventory refresh.
_UNSUPPORTED = frozenset({NOT_SUPPORTED, FUNCTION_NOT_FOUND})
_HEALTH = {GPU_IS_LOST: "lost", RESET_REQUIRED: "reset_required"}
# nvmlDeviceGetComputeRunningProcesses, newest first: _v3 (driver R510+), _v2 (R470 and other
# pre-R510 branches), then the unversioned name, which older nvidia-ml-py releases bound to the v1
# symbol (current ones bind it to _v3 again, raising NVMLLibraryMismatchError without it).
_COMPUTE_PROCESSES = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                      "nvmlDeviceGetComputeRunningProcesses")
# nvmlFieldValue_t.valueType -> the c_nvmlValue_t member that holds it (nvml.h nvmlValueType_t).
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_MIB = 1024 * 1024
# Sample fields of schema v2 (all null when the board cannot say).
NEW_SAMPLE_FIELDS = ("memory_reserved_mib", "recovery_action", "remapped_rows_correctable",
                     "remapped_rows_uncorrectable", "remapped_rows_pending", "remapped_rows_failure",
                     "ecc_dbe_volatile")


# -- counters ---------------------------------------------------------------------------------------
# nvmlDeviceGetNvLinkErrorCounter's counters (nvml.h nvmlNvLinkErrorCounter_t), by record field; the
# second item is nvml.h's value, for a pynvml look-alike without the constant.
_NVLINK_COUNTERS = (("replay_errors", "NVML_NVLINK_ERROR_DL_REPLAY", 0),
                    ("recovery_errors", "NVML_NVLINK_ERROR_DL_RECOVERY", 1),
                    ("crc_flit_errors", "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
                    ("crc_data_errors", "NVML_NVLINK_ERROR_DL_CRC_DATA", 3))
# Clock event reasons (nvml.h "Clocks Event Reasons"; pynvml nvmlClocksEventReason*, called
# ...ThrottleReason* before R535): bit constant suffix -> name in the record. BoardLimit and
# Reliability exist only under the Throttle names in nvidia-ml-py 13.
_CLOCK_EVENT_REASONS = (("GpuIdle", "gpu_idle"), ("ApplicationsClocksSetting", "applications_clocks_setting"),
                        ("SwPowerCap", "sw_power_cap"), ("HwSlowdown", "hw_slowdown"), ("SyncBoost", "sync_boost"),
                        ("SwThermalSlowdown", "sw_thermal_slowdown"), ("HwThermalSlowdown", "hw_thermal_slowdown"),
                        ("HwPowerBrakeSlowdown", "hw_power_brake_slowdown"),
                        ("DisplayClockSetting", "display_clock_setting"), ("BoardLimit", "board_limit"),
                        ("Reliability", "reliability"))
# The current clock event reasons call, newest first: nvidia-ml-py marks the Throttle one deprecated
# ("will be removed in CUDA 14.0"), and drivers before R535 have only it.
_CLOCK_EVENT_CALLS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
# Fabric info, newest first, with the struct each fills: the V call takes a versioned struct
# (c_nvmlGpuFabricInfoV_t is nvmlGpuFabricInfo_v2_t, which adds healthMask); drivers before it
# have only the deprecated call.
_FABRIC_CALLS = (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                 ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"))
_FABRIC_STATE_NOT_SUPPORTED, _FABRIC_STATE_COMPLETED = 0, 3  # nvml.h NVML_GPU_FABRIC_STATE_*
# Every field of a gpu.counters record that the reader fills (schemas.models.GpuCounters).
COUNTER_FIELDS = ("nvlinks", "pcie_replay_count", "pcie_link_gen_current", "pcie_link_gen_max",
                  "pcie_link_width_current", "pcie_link_width_max", "ecc_corrected_volatile",
                  "ecc_uncorrected_volatile", "ecc_corrected_aggregate", "ecc_uncorrected_aggregate",
                  "retired_pages_single_bit", "retired_pages_double_bit", "retired_pages_pending",
                  "clock_event_reasons", "clock_event_reason_names", "temperature_c", "fabric_cluster_uuid",
                  "fabric_clique_id", "fabric_state", "fabric_status", "fabric_health_mask")


class NvmlUnavailable(Exception):
    """NVML could not be initialised (no driver, no library, no permission)."""


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    pci_bus_id: str  # normalised dddd:bb:dd
    name: str | None
    serial: str | None
    memory_total_mib: int | None
    driver_version: str | None
    cuda_version: str | None
    minor: int | None = None  # /dev/nvidia<minor>
    memory_info_version: int | None = None  # 2: nvmlDeviceGetMemoryInfo_v2; 1: the v1 call
    notes: tuple[str, ...] = ()  # what could not be read, in words (inventory `notes`)
    # "lost" / "reset_required": it answered so during the inventory read; "lost" also for a GPU of
    # the saved inventory that NVML refuses a handle for (collectors.agent)
    status: str = "ok"


@dataclass
class SampleReading:
    values: dict[str, Any]
    status: str = "ok"
    error: str | None = None
    errors: int = 0  # reads that failed for a reason other than "absent" (see _ABSENT)


@dataclass
class CounterReading:
    """One `NvmlReader.counters` read: `values` (COUNTER_FIELDS; null where unread), the counters
    this GPU does not support (sorted), and how many reads failed otherwise."""

    values: dict[str, Any]
    unsupported: list[str] = field(default_factory=list)
    status: str = "ok"  # lost / reset_required: the GPU said so mid-read; nothing is published
    error: str | None = None
    errors: int = 0

    @property
    def anything(self) -> bool:
        """Something was read (a record is published only then)."""
        return self.status == "ok" and any(v is not None for k, v in self.values.items()
                                           if k != "clock_event_reason_names")


@dataclass(frozen=True)
class XidNotice:
    """An event from NVML's event set: an Xid (how the k8s device plugin sees Xids) or, where the
    driver has it, a GPU recovery action (`recovery_action` set, `xid` None)."""

    uuid: str | None
    pci_bus_id: str | None
    xid: int | None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    received: datetime | None = None  # wall-clock time the event was taken from NVML
    recovery_action: int | None = None


@dataclass
class _Device:
    handle: Any
    ident: GpuIdentity
    pmon_cursor: int = 0  # highest per-process utilization timestamp seen (microseconds)
    mem_version: int = 1
    unsupported: set = field(default_factory=set)  # reads this board answered NotSupported
    missing: set = field(default_factory=set)  # versioned functions this driver does not export
    # last action delivered by a recovery-action event in this NVML session (cleared at shutdown/init)
    event_recovery_action: int | None = None
    # Counters (NvmlReader.counters): kept across inventory refreshes, unlike `unsupported`.
    counters_unsupported: set = field(default_factory=set)  # counter names answered NotSupported
    counters_missing: set = field(default_factory=set)  # counter functions this pynvml/driver lacks
    nvlinks: list[int] | None = None  # the links this GPU has, once probed


class NvmlReader:
    """Reads identity, samples, processes and Xid events through a pynvml-like module."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._devices: list[_Device] = []
        self._event_set: Any = None
        self._event_set_error: str | None = None  # why the last re-creation of the event set failed
        self._event_mask = 0
        self._event_lock = threading.Lock()
        self._by_handle: dict[int, _Device] = {}
        self._identity_failed: set[int] = set()
        self.error_count = 0
        self.event_wait_failures = 0  # event waits that failed with something other than Timeout
        self.refused: dict[int, str] = {}  # NVML index -> why NVML refused its handle/identity
        self.last_error: str | None = None  # the error behind the last null `_call`
        # What an NVML read may raise: NVMLError, and nvidia-ml-py's NVMLLibraryMismatchError (a
        # plain Exception) from an unversioned wrapper whose symbol the driver lacks.
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        self._mismatch: tuple[type, ...] = (mismatch,) if isinstance(mismatch, type) else ()
        self._errors: tuple[type, ...] = (nvml.NVMLError, *self._mismatch)
        # clock event reason bits of this pynvml, by name (a bit it lacks stays only in the mask)
        self._reason_bits: list[tuple[int, str]] = []
        for suffix, name in _CLOCK_EVENT_REASONS:
            bit = getattr(nvml, f"nvmlClocksEventReason{suffix}", getattr(nvml, f"nvmlClocksThrottleReason{suffix}", None))
            if isinstance(bit, int) and bit:
                self._reason_bits.append((bit, name))

    # -- set-up ----------------------------------------------------------------------------
    def init(self) -> list[GpuIdentity]:
        """nvmlInit once, then read every GPU's identity. Raises `NvmlUnavailable`.

        Also the re-initialisation after `shutdown` (the collector's release for a GPU reset):
        what a recovery-action event of the earlier session said is forgotten (`_forget_events`)."""
        n = self.nvml
        self._forget_events()
        try:
            n.nvmlInit()
        except n.NVMLError as exc:
            raise NvmlUnavailable(f"NVML could not be initialised: {exc}") from None
        return self.refresh_inventory()

    def _forget_events(self) -> None:
        """Drop each GPU's last recovery action delivered by an event (the sample's fallback where
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION is unreadable). An event says what the driver asked for
        when it fired; the field, read through nvmlDeviceGetFieldValues, is the current state (NVML
        API Reference). The action asked for is what clears it: "Reset: ... reset the GPU using
        nvidia-smi -r, and the GPU can be used again" (NVIDIA, GPU Memory Error Management, "Error
        Recovery and Response Flags", https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/).
        NVML is shut down for exactly that reset (the collector's release, `NvmlRelease`), so
        after nvmlShutdown / nvmlInit the old event may be answered: kept, a stale "reset
        required" would keep the repaired GPU looking sick, or be read by a verification as the
        current state. Unknown (null) instead, until a new event or the field says."""
        for dev in self._devices:
            dev.event_recovery_action = None

    def refresh_inventory(self) -> list[GpuIdentity]:
        n = self.nvml
        driver = self._call(n.nvmlSystemGetDriverVersion)
        cuda_raw = self._call(n.nvmlSystemGetCudaDriverVersion)
        cuda = f"{cuda_raw // 1000}.{(cuda_raw % 1000) // 10}" if isinstance(cuda_raw, int) else None
        try:
            count = n.nvmlDeviceGetCount()
        except n.NVMLError as exc:
            raise NvmlUnavailable(f"cannot count GPUs: {exc}") from None
        old = {d.ident.uuid: d for d in self._devices}
        devices = []
        refused: dict[int, str] = {}
        for i in range(count):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(n.nvmlDeviceGetUUID(h))
                pci = normalize_pci(n.nvmlDeviceGetPciInfo_v3(h).busId)
            except n.NVMLError as exc:
                # A lost GPU cannot say who it is (real NVML refuses even the handle): keep what we
                # knew, and say which index was refused; the collector publishes it as lost from
                # its saved inventory. Logged once per index.
                refused[i] = str(exc)
                if i not in self._identity_failed:
                    log.warning("GPU %d: cannot read identity: %s", i, exc)
                    self._identity_failed.add(i)
                prev = next((d for d in self._devices if d.ident.index == i), None)
                if prev is not None:
                    devices.append(prev)
                continue
            health: list = []  # [text, code] once the GPU answers GpuIsLost / ResetRequired below
            mem, version, note = self._memory(h, health)
            name = _text(self._call(n.nvmlDeviceGetName, h, health=health))
            serial = _text(self._call(n.nvmlDeviceGetSerial, h, health=health))
            minor = self._call(n.nvmlDeviceGetMinorNumber, h, health=health)
            notes = (note,) if note else ()
            if health:
                # It gave its UUID and PCI id, then GpuIsLost ("fallen off the bus or otherwise
                # inaccessible") or ResetRequired ("requires a reset before it can be used again",
                # NVML API Reference, nvmlReturn_t): a health state, never an `ok` GPU with nulls.
                notes = (f"NVML answered {health[0]!r} during the inventory read; the fields after it are unread",)
            ident = GpuIdentity(
                index=i, uuid=uuid, pci_bus_id=pci or "0000:00:00",
                name=name, serial=serial,
                memory_total_mib=int(mem.total // _MIB) if mem is not None else None,
                driver_version=_text(driver), cuda_version=cuda,
                minor=minor,
                memory_info_version=version if mem is not None else None,
                notes=notes, status=_HEALTH[health[1]] if health else "ok",
            )
            self._identity_failed.discard(i)
            dev = old.get(uuid) or _Device(handle=h, ident=ident)
            dev.handle, dev.ident, dev.mem_version = h, ident, version
            dev.unsupported, dev.missing = set(), set()  # a driver update may add what was missing: ask again
            devices.append(dev)
        self._devices = devices
        self._by_handle = {_handle_key(d.handle): d for d in devices}
        self.refused = refused
        return [d.ident for d in devices]

    def _memory(self, h: Any, health: list) -> tuple[Any, int, str | None]:
        """(memory info, 2 or 1, note). v1's `used` is "reserved + allocated" (nvmlMemory_t), i.e.
        hundreds of MiB on an idle data-center GPU, more than the 1% the wedge and phantom rules
        allow; nvmlDeviceGetMemoryInfo_v2 (driver r510+) reports `reserved` apart (NVML API
        Reference, nvmlMemory_v2_t). Fall back to v1 where the driver or binding lacks v2.
        A GpuIsLost / ResetRequired answer is kept in `health` (see `_call`)."""
        n = self.nvml
        v2 = getattr(n, "nvmlMemory_v2", None)
        why = "the pynvml module has no nvmlMemory_v2"
        if v2 is not None:
            try:
                return n.nvmlDeviceGetMemoryInfo(h, version=v2), 2, None
            except TypeError:  # a binding whose nvmlDeviceGetMemoryInfo takes no version
                why = "the pynvml module's nvmlDeviceGetMemoryInfo takes no version"
            except n.NVMLError as exc:
                if getattr(exc, "value", None) in _HEALTH:
                    health.extend((str(exc), exc.value))
                    return None, 2, None
                why = f"nvmlDeviceGetMemoryInfo_v2: {exc}"
        note = f"memory from the v1 call: used includes driver-reserved memory ({why})"
        return self._call(n.nvmlDeviceGetMemoryInfo, h, health=health), 1, note

    @property
    def gpus(self) -> list[GpuIdentity]:
        return [d.ident for d in self._devices]

    def shutdown(self) -> None:
        """nvmlShutdown (the handles and the event set go); a later `init` starts a new session."""
        n = self.nvml
        self._forget_events()  # the session that delivered them ends here (`_forget_events`)
        try:
            if self._event_set is not None:
                n.nvmlEventSetFree(self._event_set)
            n.nvmlShutdown()
        except n.NVMLError:
            pass
        self._event_set = None  # freed: a later init (after a reset) registers a new one

    # -- reads -----------------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, health: list | None = None) -> Any:
        """One read; None on any NVML error (counted unless it means "absent", see _ABSENT).
        With `health` (the inventory read): a GpuIsLost / ResetRequired answer is kept there as
        [text, code] instead of counted, and once it holds one nothing more is asked."""
        if health:
            return None
        try:
            return fn(*args)
        except self._errors as exc:
            code = self._code(exc)
            self.last_error = str(exc)
            if health is not None and code in _HEALTH:
                health.extend((str(exc), code))
            elif code not in _ABSENT:
                self.error_count += 1
            return None

    def _code(self, exc: BaseException) -> int | None:
        """The NVML return code of an error; NVMLLibraryMismatchError is a missing function."""
        if self._mismatch and isinstance(exc, self._mismatch):
            return FUNCTION_NOT_FOUND
        return getattr(exc, "value", None)

    def sample(self, gpu: GpuIdentity) -> SampleReading:
        n = self.nvml
        dev = self._device(gpu)
        h = dev.handle
        values: dict[str, Any] = {}
        reading = SampleReading(values)

        def read(name: str, fn: Any, *args: Any, **kw: Any) -> Any:
            key = (name, fn)
            if key in dev.unsupported or reading.status != "ok":
                return None  # known unsupported, or the GPU already said it is lost: no more calls
            try:
                return fn(h, *args, **kw)
            except self._errors as exc:
                code = self._code(exc)
                if code in _HEALTH:
                    reading.status, reading.error = _HEALTH[code], str(exc)
                elif code in _UNSUPPORTED:
                    dev.unsupported.add(key)
                elif code not in _ABSENT:
                    reading.errors += 1
                    self.error_count += 1
                return None

        util = read("util", n.nvmlDeviceGetUtilizationRates)
        values["utilization_gpu_pct"] = float(util.gpu) if util is not None else None
        values["utilization_memory_pct"] = float(util.memory) if util is not None else None
        if dev.mem_version == 2:
            mem = read("mem", n.nvmlDeviceGetMemoryInfo, version=n.nvmlMemory_v2)
        else:
            mem = read("mem", n.nvmlDeviceGetMemoryInfo)
        values["memory_used_mib"] = round(mem.used / _MIB, 1) if mem is not None else None
        values["memory_total_mib"] = round(mem.total / _MIB, 1) if mem is not None else None
        reserved = getattr(mem, "reserved", None) if dev.mem_version == 2 else None
        values["memory_reserved_mib"] = round(reserved / _MIB, 1) if reserved is not None else None
        mw = read("power", n.nvmlDeviceGetPowerUsage)
        values["power_w"] = round(mw / 1000.0, 1) if mw is not None else None
        values["sm_clock_mhz"] = read("sm_clock", n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM)
        values["mem_clock_mhz"] = read("mem_clock", n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_MEM)
        values["temperature_c"] = read("temp", n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)
        values["recovery_action"] = self._recovery_action(dev, read)
        # Row remapping (Ampere+; NVIDIA "GPU Memory Error Management", row remapping): a pending
        # remap takes effect at the next GPU reset; a failure means the bank is out of spare rows.
        rows = read("rows", n.nvmlDeviceGetRemappedRows) if hasattr(n, "nvmlDeviceGetRemappedRows") else None
        corr, unc, pending, failure = rows if rows is not None else (None, None, None, None)
        values["remapped_rows_correctable"] = int(corr) if corr is not None else None
        values["remapped_rows_uncorrectable"] = int(unc) if unc is not None else None
        values["remapped_rows_pending"] = bool(pending) if pending is not None else None
        values["remapped_rows_failure"] = bool(failure) if failure is not None else None
        # Volatile (since the driver loaded) double-bit = uncorrected ECC errors; NotSupported on
        # boards without ECC or with ECC off.
        etype = getattr(n, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", None)
        ctype = getattr(n, "NVML_VOLATILE_ECC", None)
        dbe = read("dbe", n.nvmlDeviceGetTotalEccErrors, etype, ctype) if etype is not None and ctype is not None else None
        values["ecc_dbe_volatile"] = int(dbe) if dbe is not None else None
        if reading.status != "ok":
            for k in values:
                values[k] = None  # nothing read after a lost/reset answer is trustworthy
        return reading

    def _recovery_action(self, dev: _Device, read: Any) -> int | None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvmlDeviceGpuRecoveryAction_t, 0-7) through
        nvmlDeviceGetFieldValues; where the field is unreadable, the last recovery-action event of
        this NVML session (none after a re-initialisation: `_forget_events`)."""
        n = self.nvml
        fid = getattr(n, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)  # absent from older nvidia-ml-py
        value = None
        if fid is not None and hasattr(n, "nvmlDeviceGetFieldValues"):
            got = read("recovery_action", n.nvmlDeviceGetFieldValues, [fid])
            if got:
                fv = got[0]
                ret = getattr(fv, "nvmlReturn", 0)
                if ret == 0:
                    member = _VALUE_MEMBER.get(getattr(fv, "valueType", 1), "uiVal")
                    raw = getattr(fv.value, member, None)
                    value = int(raw) if raw is not None and 0 <= int(raw) <= 7 else None
                elif ret in _UNSUPPORTED:
                    dev.unsupported.add(("recovery_action", n.nvmlDeviceGetFieldValues))
                elif ret not in _ABSENT and ret not in _HEALTH:
                    self.error_count += 1
        return value if value is not None else dev.event_recovery_action

    # -- counters --------------------------------------------------------------------------
    def counters(self, gpu: GpuIdentity) -> CounterReading:
        """One read of every counter of COUNTER_FIELDS that this GPU supports (module docstring,
        Counters). NotSupported or a missing function: null, named in `unsupported`, never asked
        again; GpuIsLost / ResetRequired: the reading's status, nothing else asked; any other NVML
        error: null and counted. Never raises an NVML error."""
        n = self.nvml
        dev = self._device(gpu)
        h = dev.handle
        skip = dev.counters_unsupported
        values: dict[str, Any] = dict.fromkeys(COUNTER_FIELDS)
        values["clock_event_reason_names"] = []
        reading = CounterReading(values)

        def const(name: str, default: int | None = None) -> int | None:
            value = getattr(n, name, default)
            return value if isinstance(value, int) else None

        def call(name: str, fn_name: str, *args: Any) -> Any:
            """Counter `name` through `fn_name(handle, *args)`; None when it could not be read."""
            if name in skip or reading.status != "ok":
                return None
            fn = getattr(n, fn_name, None)
            if fn is None or any(a is None for a in args):  # an older pynvml: no such call or constant
                skip.add(name)
                return None
            try:
                return fn(h, *args)
            except self._errors as exc:
                self._counter_failed(reading, skip, name, exc)
                return None

        values["nvlinks"] = self._nvlinks(dev, reading, const)
        values["pcie_replay_count"] = call("pcie_replay_count", "nvmlDeviceGetPcieReplayCounter")
        values["pcie_link_gen_current"] = call("pcie_link_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration")
        values["pcie_link_gen_max"] = call("pcie_link_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration")
        values["pcie_link_width_current"] = call("pcie_link_width_current", "nvmlDeviceGetCurrPcieLinkWidth")
        values["pcie_link_width_max"] = call("pcie_link_width_max", "nvmlDeviceGetMaxPcieLinkWidth")
        # nvmlDeviceGetTotalEccErrors(handle, errorType, counterType) (NVML API Reference): corrected
        # = single-bit, uncorrected = double-bit; volatile since the driver loaded, aggregate for
        # the GPU's life (kept in its InfoROM). NotSupported on boards without ECC or with it off.
        corrected, uncorrected = const("NVML_MEMORY_ERROR_TYPE_CORRECTED"), const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED")
        volatile, aggregate = const("NVML_VOLATILE_ECC"), const("NVML_AGGREGATE_ECC")
        for name, etype, ctype in (("ecc_corrected_volatile", corrected, volatile),
                                   ("ecc_uncorrected_volatile", uncorrected, volatile),
                                   ("ecc_corrected_aggregate", corrected, aggregate),
                                   ("ecc_uncorrected_aggregate", uncorrected, aggregate)):
            values[name] = call(name, "nvmlDeviceGetTotalEccErrors", etype, ctype)
        # Dynamic page retirement (NVIDIA "GPU Memory Error Management"): pre-Ampere boards retire
        # a page after a double-bit error or repeated single-bit errors; Ampere and later remap
        # rows instead (gpu.samples) and answer NotSupported here. pynvml returns the addresses.
        for name, cause in (("retired_pages_single_bit", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
                            ("retired_pages_double_bit", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")):
            pages = call(name, "nvmlDeviceGetRetiredPages", const(cause))
            values[name] = len(pages) if pages is not None else None
        pending = call("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
        values["retired_pages_pending"] = (pending == const("NVML_FEATURE_ENABLED", 1)) if pending is not None else None
        mask = self._clock_event_reasons(dev, reading)
        if mask is not None:
            values["clock_event_reasons"] = int(mask)
            values["clock_event_reason_names"] = [name for bit, name in self._reason_bits if mask & bit]
        values["temperature_c"] = call("temperature_c", "nvmlDeviceGetTemperature", const("NVML_TEMPERATURE_GPU", 0))
        self._fabric(dev, reading)
        reading.unsupported = sorted(skip)
        if reading.status != "ok":
            values.update(dict.fromkeys(COUNTER_FIELDS), clock_event_reason_names=[])  # nothing after lost is trustworthy
        return reading

    def _counter_failed(self, reading: CounterReading, skip: set, name: str, exc: BaseException) -> None:
        code = self._code(exc)
        self.last_error = str(exc)
        if code in _HEALTH:
            reading.status, reading.error = _HEALTH[code], str(exc)
        elif code in _UNSUPPORTED:
            skip.add(name)
        elif code not in _ABSENT:
            reading.errors += 1
            self.error_count += 1

    def _nvlinks(self, dev: _Device, reading: CounterReading, const: Any) -> list[dict] | None:
        """Each NVLink's state and error counters. The first read probes links 0 up to
        NVML_NVLINK_MAX_LINKS: NVML numbers a GPU's links from 0 and answers InvalidArgument for a
        number past its last one (NVML API Reference, nvmlDeviceGetNvLinkState), which ends the
        probe; a link that answers NotSupported is not one of this GPU's. Later reads ask only the
        links found. No link at all: `nvlink` is unsupported."""
        n, skip = self.nvml, dev.counters_unsupported
        state_fn = getattr(n, "nvmlDeviceGetNvLinkState", None)
        counter_fn = getattr(n, "nvmlDeviceGetNvLinkErrorCounter", None)
        if "nvlink" in skip or reading.status != "ok":
            return None
        if state_fn is None:
            skip.add("nvlink")
            return None
        probing = dev.nvlinks is None
        links = range(min(const("NVML_NVLINK_MAX_LINKS", NVLINK_LINKS_MAX) or 0, NVLINK_LINKS_MAX)) if probing else dev.nvlinks
        enabled = const("NVML_FEATURE_ENABLED", 1)
        out: list[dict] = []
        for link in links:
            try:
                state = state_fn(dev.handle, link)
            except self._errors as exc:
                code = self._code(exc)
                if code in _HEALTH:
                    reading.status, reading.error = _HEALTH[code], str(exc)
                    return None
                if probing and code == INVALID_ARGUMENT:
                    break  # past the GPU's last link
                if probing and code in _ABSENT:
                    continue  # not one of this GPU's links
                if code not in _ABSENT:  # a link found earlier: null now, asked again next time
                    reading.errors += 1
                    self.error_count += 1
                    self.last_error = str(exc)
                state = None
            entry: dict[str, Any] = {"link": link, "active": state == enabled if state is not None else None}
            for name, const_name, default in _NVLINK_COUNTERS:
                entry[name] = None
                key = f"nvlink_{name}"
                counter = const(const_name, default)
                if key in skip or counter is None or reading.status != "ok":
                    continue
                if counter_fn is None:
                    skip.add(key)
                    continue
                try:
                    entry[name] = counter_fn(dev.handle, link, counter)
                except self._errors as exc:
                    if self._code(exc) in _UNSUPPORTED and not entry["active"]:
                        continue  # a link that is down may refuse its counters: ask again next time
                    self._counter_failed(reading, skip, key, exc)
            out.append(entry)
        if reading.status != "ok":
            return None
        if probing:
            dev.nvlinks = [e["link"] for e in out]
            if not out:
                skip.add("nvlink")
                return None
        return out

    def _clock_event_reasons(self, dev: _Device, reading: CounterReading) -> int | None:
        """The current clock event reasons bitmask, through the newest call this pynvml and driver
        have (`_CLOCK_EVENT_CALLS`); a missing one is not asked again."""
        skip, name = dev.counters_unsupported, "clock_event_reasons"
        if name in skip or reading.status != "ok":
            return None
        for fn_name in _CLOCK_EVENT_CALLS:
            fn = getattr(self.nvml, fn_name, None)
            if fn is None or fn_name in dev.counters_missing:
                continue
            try:
                return fn(dev.handle)
            except self._errors as exc:
                if self._code(exc) == FUNCTION_NOT_FOUND:  # this driver lacks the symbol: the older call
                    dev.counters_missing.add(fn_name)
                    continue
                self._counter_failed(reading, skip, name, exc)
                return None
        skip.add(name)
        return None

    def _fabric(self, dev: _Device, reading: CounterReading) -> None:
        """NVLink fabric registration (multi-node NVLink, e.g. GB200 NVL72): the cluster UUID and
        clique id that name the GPU's NVLink domain. nvml.h: `status` "must be checked only if
        state returns complete", and the UUID and clique are meaningful once it is Success. A GPU
        in no fabric answers NotSupported, or state NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: `fabric`
        is unsupported. The struct is passed by reference (pynvml hands it to the C call as given)."""
        n, skip, values = self.nvml, dev.counters_unsupported, reading.values
        if "fabric" in skip or reading.status != "ok":
            return
        info = None
        for fn_name, struct_name in _FABRIC_CALLS:
            fn, struct = getattr(n, fn_name, None), getattr(n, struct_name, None)
            if fn is None or struct is None or fn_name in dev.counters_missing:
                continue
            candidate = struct()  # the V struct's constructor sets its version (nvmlGpuFabricInfo_v2)
            try:
                fn(dev.handle, ctypes.byref(candidate))
            except self._errors as exc:
                if self._code(exc) in (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                    dev.counters_missing.add(fn_name)  # the driver lacks it, or this struct version
                    continue
                self._counter_failed(reading, skip, "fabric", exc)
                return
            info = candidate
            break
        if info is None:
            skip.add("fabric")
            return
        state = int(info.state)
        if state == _FABRIC_STATE_NOT_SUPPORTED:
            skip.add("fabric")
            return
        values["fabric_state"] = state
        if any(name == "healthMask" for name, *_ in type(info)._fields_):
            values["fabric_health_mask"] = int(info.healthMask)
        if state == _FABRIC_STATE_COMPLETED:
            values["fabric_status"] = int(info.status)
            raw = bytes(info.clusterUuid)
            if values["fabric_status"] == SUCCESS and any(raw):
                values["fabric_cluster_uuid"] = str(uuidlib.UUID(bytes=raw))
                values["fabric_clique_id"] = int(info.cliqueId)

    def compute_apps(self, gpu: GpuIdentity) -> list[tuple[int, float | None]] | None:
        """(pid, used MiB) of compute processes; None when NVML could not say (`last_error` says
        why: "not supported ..." where the driver has none of the calls). None is "unknown", never
        "no process". Asks the newest nvmlDeviceGetComputeRunningProcesses this
        driver exports (see `_COMPUTE_PROCESSES`); a missing one is not asked again until the next
        inventory refresh."""
        n = self.nvml
        dev = self._device(gpu)
        tried = []
        for name in _COMPUTE_PROCESSES:
            fn = getattr(n, name, None)
            if fn is None:
                continue  # not in this nvidia-ml-py
            tried.append(name)
            if name in dev.missing:
                continue
            try:
                procs = fn(dev.handle)
            except self._errors as exc:
                code = self._code(exc)
                if code == FUNCTION_NOT_FOUND:
                    dev.missing.add(name)
                    continue
                self.last_error = str(exc)
                if code not in _ABSENT:
                    self.error_count += 1
                return None
            return [(int(p.pid), round(p.usedGpuMemory / _MIB, 1) if p.usedGpuMemory is not None else None)
                    for p in procs]
        self.last_error = ("not supported: this driver exports none of " + ", ".join(tried) if tried
                           else "not supported: this pynvml has no nvmlDeviceGetComputeRunningProcesses")
        return None

    def pmon(self, gpu: GpuIdentity) -> list[tuple[int, float, float]]:
        """Per-process (pid, SM%, mem%) since the last call, like `nvidia-smi pmon`."""
        n = self.nvml
        dev = self._device(gpu)
        try:
            samples = n.nvmlDeviceGetProcessUtilization(dev.handle, dev.pmon_cursor)
        except self._errors as exc:
            # NotFound / NoData, or Success from pynvml's size probe (see _ABSENT), are the normal
            # "no sample newer than the cursor" answers.
            if self._code(exc) not in _ABSENT:
                self.error_count += 1
            return []
        best: dict[int, tuple[int, float, float]] = {}
        for s in samples:
            dev.pmon_cursor = max(dev.pmon_cursor, int(s.timeStamp))
            prev = best.get(int(s.pid))
            if prev is None or s.smUtil >= prev[1]:
                best[int(s.pid)] = (int(s.pid), float(s.smUtil), float(s.memUtil))
        return sorted(best.values())

    def process_name(self, pid: int) -> str | None:
        return _text(self._call(self.nvml.nvmlSystemGetProcessName, pid))

    # -- events ----------------------------------------------------------------------------
    def register_xid_events(self) -> bool:
        """Create an event set and register every GPU that accepts it for Xid events and, where
        the driver has them, recovery-action events. A GPU that refuses (lost) is skipped, so one
        lost GPU does not blind the others. Call again to re-create the set (a GPU came back)."""
        n = self.nvml
        with self._event_lock:
            if self._event_set is not None:
                try:
                    n.nvmlEventSetFree(self._event_set)
                except n.NVMLError:
                    pass
                self._event_set = None
            try:
                es = n.nvmlEventSetCreate()
            except n.NVMLError as exc:
                log.warning("NVML events unavailable: %s", exc)
                self._event_set_error = f"no NVML event set: nvmlEventSetCreate failed: {exc}"
                return False
            xid = n.nvmlEventTypeXidCriticalError
            recovery = getattr(n, "nvmlEventTypeGpuRecoveryAction", 0)
            registered = 0
            for dev in self._devices:
                for mask in ([xid | recovery, xid] if recovery else [xid]):
                    try:
                        n.nvmlDeviceRegisterEvents(dev.handle, mask, es)
                        registered += 1
                        break
                    except n.NVMLError as exc:
                        if getattr(exc, "value", None) in _UNSUPPORTED and mask != xid:
                            continue  # no recovery-action events on this driver: Xid only
                        log.warning("GPU %s: cannot register events: %s", dev.ident.uuid, exc)
                        break
            self._event_set = es
            self._event_set_error = None
            self._event_mask = xid | recovery
            return registered > 0

    def wait_xid(self, timeout_ms: int) -> XidNotice | None:
        """One event, or None after `timeout_ms` (NVML's Timeout is the normal case). Any other
        failure is counted in `event_wait_failures` and raises EventWaitFailed at once: the caller
        must back off (collectors.agent) and, once the GPU is back, re-register. No event set (its
        re-creation failed) is such a failure too: returning None at once would make the caller
        spin on a core without ever rebuilding it."""
        n = self.nvml
        es = self._event_set
        if es is None:
            why = self._event_set_error or "no NVML event set (not registered)"
            self.event_wait_failures += 1
            self.last_event_error = why
            raise EventWaitFailed(why)
        try:
            data = n.nvmlEventSetWait_v2(es, timeout_ms)
        except n.NVMLError as exc:
            if getattr(exc, "value", None) != TIMEOUT:
                self.event_wait_failures += 1
                self.last_event_error = str(exc)
                raise EventWaitFailed(str(exc)) from None
            return None
        received = datetime.now(timezone.utc)
        dev = self._by_handle.get(_handle_key(data.device))
        uuid = dev.ident.uuid if dev else None
        pci = dev.ident.pci_bus_id if dev else None
        recovery = getattr(n, "nvmlEventTypeGpuRecoveryAction", 0)
        if recovery and data.eventType & recovery:
            action = int(data.eventData)
            if dev is not None and 0 <= action <= 7:
                dev.event_recovery_action = action
            return XidNotice(uuid=uuid, pci_bus_id=pci, xid=None, received=received, recovery_action=action)
        if not data.eventType & n.nvmlEventTypeXidCriticalError:
            return None
        gi = getattr(data, "gpuInstanceId", None)
        ci = getattr(data, "computeInstanceId", None)
        # 0xFFFFFFFF means "not a MIG instance" in nvmlEventData_t.
        return XidNotice(
            uuid=uuid, pci_bus_id=pci, xid=int(data.eventData), received=received,
            gpu_instance=gi if isinstance(gi, int) and gi != 0xFFFFFFFF else None,
            compute_instance=ci if isinstance(ci, int) and ci != 0xFFFFFFFF else None,
        )

    def _device(self, gpu: GpuIdentity) -> _Device:
        for dev in self._devices:
            if dev.ident.uuid == gpu.uuid:
                return dev
        raise KeyError(gpu.uuid)


class EventWaitFailed(Exception):
    """nvmlEventSetWait failed with something other than Timeout (GPU lost, unknown error)."""


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _handle_key(handle: Any) -> int:
    """A hashable identity for an NVML device handle (a ctypes pointer in pynvml)."""
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or id(handle)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


# -- the reset handshake ----------------------------------------------------------------------------
RELEASE_DIR = "nvml-release"  # under the collector's state dir, which the node executor shares


class NvmlRelease:
    """The collector gives up its NVML handles for a GPU reset, on the node executor's request.

    Why: an NVML handle keeps /dev/nvidia<minor> (and /dev/nvidiactl) open, and `nvidia-smi
    --gpu-reset` refuses a GPU that any process holds open, the collector's own sampler included;
    the executor's holder scan would also (rightly) name the collector. NVML handles are per
    process, not per GPU, so the collector shuts NVML down altogether (nvmlShutdown) while any
    request stands; meanwhile it publishes each GPU's sample with status `unavailable`, which the
    processor never takes for healthy.

    Two files per GPU in `<state dir>/nvml-release/`, each written whole (temp file + rename):
      reset-<uuid>.request   the executor: {"gpu_uuid", "command_id", "until" (epoch seconds)}
      reset-<uuid>.released  the collector, once NVML is shut down: {"gpu_uuid", "pid", "at", "held_nvml"}
                             (held_nvml false: a collector without NVML, which had nothing to release)
    The executor waits (bounded) for `.released`, resets, re-reads the GPU, then deletes both
    (`done`). The collector resumes (nvmlInit, inventory re-read, event set re-created) when no
    request stands, or when a request's `until` passed: an executor that died mid-way cannot
    leave the node blind for good.
    """

    def __init__(self, state_dir: str | os.PathLike, clock=time.time) -> None:
        self.dir = Path(state_dir) / RELEASE_DIR
        self.clock = clock

    def _path(self, uuid: str, kind: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)
        return self.dir / f"reset-{safe}.{kind}"

    def _write(self, path: Path, doc: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    # -- the executor's side ----------------------------------------------------------------
    def request(self, uuid: str, *, command_id: str = "", hold_s: float = 300.0) -> None:
        self._write(self._path(uuid, "request"),
                    {"gpu_uuid": uuid, "command_id": command_id, "until": self.clock() + hold_s})

    def wait_released(self, uuid: str, timeout: float, poll: float = 0.1) -> dict | None:
        """The collector's acknowledgement, or None when none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        path = self._path(uuid, "released")
        while True:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll)

    def done(self, uuid: str) -> None:
        for kind in ("request", "released"):
            try:
                self._path(uuid, kind).unlink()
            except FileNotFoundError:
                pass

    # -- the collector's side ---------------------------------------------------------------
    def pending(self) -> dict[str, dict]:
        """Requests that stand now (not past their `until`), by GPU UUID."""
        out: dict[str, dict] = {}
        try:
            names = sorted(p for p in self.dir.iterdir() if p.name.endswith(".request"))
        except OSError:
            return out
        now = self.clock()
        for p in names:
            try:
                doc = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if float(doc.get("until", 0)) > now and doc.get("gpu_uuid"):
                out[doc["gpu_uuid"]] = doc
        return out

    def released(self, uuid: str, *, held_nvml: bool = True) -> None:
        self._write(self._path(uuid, "released"),
                    {"gpu_uuid": uuid, "pid": os.getpid(), "at": self.clock(), "held_nvml": held_nvml})

    def clear_released(self, uuid: str) -> None:
        try:
            self._path(uuid, "released").unlink()
        except FileNotFoundError:
            pass
