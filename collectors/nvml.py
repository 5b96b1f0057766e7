"""NVML behind one small class, `NvmlReader`, over a pynvml-like module.

The real module is `pynvml` from NVIDIA's `nvidia-ml-py`; tests, the demo and replay pass
`collectors.fakes.FakePynvml`, which mimics pynvml's surface (functions, return objects,
`NVMLError_*` classes), so both run this same code.

Every read is wrapped (runtime-notes section 4; gpud treats lost/reset as health, not crashes):
- NotSupported / NoPermission -> the field is null;
- GpuIsLost / ResetRequired -> the sample's `status` says so and the collector publishes it;
- anything else -> the field is null and the error is counted; never an exception out of here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from schemas.base import normalize_pci

__all__ = ["NvmlReader", "NvmlUnavailable", "GpuIdentity", "SampleReading", "XidNotice"]

log = logging.getLogger(__name__)

# NVML return codes (nvml.h); pynvml exposes them as NVML_ERROR_* too.
NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, TIMEOUT, GPU_IS_LOST, RESET_REQUIRED = 3, 4, 6, 10, 15, 16
_NULL_FIELD = {NOT_SUPPORTED, NO_PERMISSION}
_HEALTH = {GPU_IS_LOST: "lost", RESET_REQUIRED: "reset_required"}


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


@dataclass
class SampleReading:
    values: dict[str, Any]
    status: str = "ok"
    error: str | None = None
    errors: int = 0  # reads that failed for another reason than NotSupported


@dataclass(frozen=True)
class XidNotice:
    """An Xid seen through NVML's event set (how the k8s device plugin sees Xids)."""

    uuid: str | None
    pci_bus_id: str | None
    xid: int
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass
class _Device:
    handle: Any
    ident: GpuIdentity
    pmon_cursor: int = 0  # highest per-process utilization timestamp seen (microseconds)
    handle_by_uuid: dict = field(default_factory=dict)


class NvmlReader:
    """Reads identity, samples, processes and Xid events through a pynvml-like module."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._devices: list[_Device] = []
        self._event_set: Any = None
        self._by_handle: dict[int, _Device] = {}
        self._identity_failed: set[int] = set()
        self.error_count = 0

    # -- set-up ----------------------------------------------------------------------------
    def init(self) -> list[GpuIdentity]:
        """nvmlInit once, then read every GPU's identity. Raises `NvmlUnavailable`."""
        n = self.nvml
        try:
            n.nvmlInit()
        except n.NVMLError as exc:
            raise NvmlUnavailable(f"NVML could not be initialised: {exc}") from None
        return self.refresh_inventory()

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
        for i in range(count):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(n.nvmlDeviceGetUUID(h))
                pci = normalize_pci(n.nvmlDeviceGetPciInfo_v3(h).busId)
            except n.NVMLError as exc:
                # A lost GPU cannot say who it is; keep what we knew, or skip it. Said once.
                if i not in self._identity_failed:
                    log.warning("GPU %d: cannot read identity: %s", i, exc)
                    self._identity_failed.add(i)
                prev = next((d for d in self._devices if d.ident.index == i), None)
                if prev is not None:
                    devices.append(prev)
                continue
            mem = self._call(n.nvmlDeviceGetMemoryInfo, h)
            ident = GpuIdentity(
                index=i, uuid=uuid, pci_bus_id=pci or "0000:00:00",
                name=_text(self._call(n.nvmlDeviceGetName, h)),
                serial=_text(self._call(n.nvmlDeviceGetSerial, h)),
                memory_total_mib=int(mem.total // (1024 * 1024)) if mem is not None else None,
                driver_version=_text(driver), cuda_version=cuda,
                minor=self._call(n.nvmlDeviceGetMinorNumber, h),
            )
            self._identity_failed.discard(i)
            dev = old.get(uuid) or _Device(handle=h, ident=ident)
            dev.handle, dev.ident = h, ident
            devices.append(dev)
        self._devices = devices
        self._by_handle = {_handle_key(d.handle): d for d in devices}
        return [d.ident for d in devices]

    @property
    def gpus(self) -> list[GpuIdentity]:
        return [d.ident for d in self._devices]

    def shutdown(self) -> None:
        n = self.nvml
        try:
            if self._event_set is not None:
                n.nvmlEventSetFree(self._event_set)
            n.nvmlShutdown()
        except n.NVMLError:
            pass

    # -- reads -----------------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> Any:
        """One read; None on any NVML error (counted unless NotSupported/NoPermission/NotFound)."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) not in _NULL_FIELD | {NOT_FOUND}:
                self.error_count += 1
            return None

    def sample(self, gpu: GpuIdentity) -> SampleReading:
        n = self.nvml
        h = self._device(gpu).handle
        values: dict[str, Any] = {}
        reading = SampleReading(values)

        def read(name: str, fn: Any, *args: Any, convert: Any = None) -> None:
            try:
                value = fn(h, *args)
            except n.NVMLError as exc:
                code = getattr(exc, "value", None)
                values[name] = None
                if code in _HEALTH and reading.status == "ok":
                    reading.status, reading.error = _HEALTH[code], str(exc)
                elif code not in _NULL_FIELD:
                    reading.errors += 1
                    self.error_count += 1
                return
            values[name] = convert(value) if convert else value

        read("util", n.nvmlDeviceGetUtilizationRates)
        util = values.pop("util")
        values["utilization_gpu_pct"] = float(util.gpu) if util is not None else None
        values["utilization_memory_pct"] = float(util.memory) if util is not None else None
        read("mem", n.nvmlDeviceGetMemoryInfo)
        mem = values.pop("mem")
        values["memory_used_mib"] = round(mem.used / 1048576, 1) if mem is not None else None
        values["memory_total_mib"] = round(mem.total / 1048576, 1) if mem is not None else None
        read("power_w", n.nvmlDeviceGetPowerUsage, convert=lambda mw: round(mw / 1000.0, 1))
        read("sm_clock_mhz", n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM)
        read("mem_clock_mhz", n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_MEM)
        read("temperature_c", n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)
        return reading

    def compute_apps(self, gpu: GpuIdentity) -> list[tuple[int, float | None]] | None:
        """(pid, used MiB) of compute processes; None when NVML could not say."""
        procs = self._call(self.nvml.nvmlDeviceGetComputeRunningProcesses, self._device(gpu).handle)
        if procs is None:
            return None
        return [(int(p.pid), round(p.usedGpuMemory / 1048576, 1) if p.usedGpuMemory is not None else None)
                for p in procs]

    def pmon(self, gpu: GpuIdentity) -> list[tuple[int, float, float]]:
        """Per-process (pid, SM%, mem%) since the last call, like `nvidia-smi pmon`."""
        n = self.nvml
        dev = self._device(gpu)
        try:
            samples = n.nvmlDeviceGetProcessUtilization(dev.handle, dev.pmon_cursor)
        except n.NVMLError as exc:
            # NotFound is the normal "no sample newer than the cursor" answer.
            if getattr(exc, "value", None) not in _NULL_FIELD | {NOT_FOUND}:
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

    # -- Xid events ------------------------------------------------------------------------
    def register_xid_events(self) -> bool:
        n = self.nvml
        try:
            self._event_set = n.nvmlEventSetCreate()
        except n.NVMLError as exc:
            log.warning("NVML events unavailable: %s", exc)
            return False
        registered = 0
        for dev in self._devices:
            try:
                n.nvmlDeviceRegisterEvents(dev.handle, n.nvmlEventTypeXidCriticalError, self._event_set)
                registered += 1
            except n.NVMLError as exc:
                log.warning("GPU %s: cannot register Xid events: %s", dev.ident.uuid, exc)
        return registered > 0

    def wait_xid(self, timeout_ms: int) -> XidNotice | None:
        """One Xid event, or None after `timeout_ms` (NVML's Timeout is the normal case)."""
        n = self.nvml
        if self._event_set is None:
            return None
        try:
            data = n.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except n.NVMLError as exc:
            if getattr(exc, "value", None) != TIMEOUT:
                self.error_count += 1
            return None
        if not data.eventType & n.nvmlEventTypeXidCriticalError:
            return None
        dev = self._by_handle.get(_handle_key(data.device))
        gi = getattr(data, "gpuInstanceId", None)
        ci = getattr(data, "computeInstanceId", None)
        # 0xFFFFFFFF means "not a MIG instance" in nvmlEventData_t.
        return XidNotice(
            uuid=dev.ident.uuid if dev else None, pci_bus_id=dev.ident.pci_bus_id if dev else None,
            xid=int(data.eventData),
            gpu_instance=gi if isinstance(gi, int) and gi != 0xFFFFFFFF else None,
            compute_instance=ci if isinstance(ci, int) and ci != 0xFFFFFFFF else None,
        )

    def _device(self, gpu: GpuIdentity) -> _Device:
        for dev in self._devices:
            if dev.ident.uuid == gpu.uuid:
                return dev
        raise KeyError(gpu.uuid)


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
