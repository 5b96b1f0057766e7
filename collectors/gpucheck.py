"""`xidstream gpu-check`: read every field through the real `pynvml` and print what came back.

Run it on a machine with an NVIDIA GPU and driver to check the real NVML path of the collector
(the tests use the pynvml look-alike). It prints, per GPU, the identity (with the memory call's
version and any notes), one sample with every contract field (memory reserved, recovery action,
remapped rows, volatile DBE included), compute apps, pmon samples and whether Xid and
recovery-action events can be registered, and every event already pending; then every counter of
gpu.counters (NVLink per link, PCIe, ECC, retired pages, clock event reasons, temperature, fabric),
which counters the board does not support, and the time of a first read (it probes the NVLinks)
and of a second one (what every `--counters-interval` costs). Last, NVML shut down and initialised
again in the same process, as the collector does for the node executor's GPU reset
(`xidstream.collectors.nvml.NvmlRelease`): how long it takes, whether the same GPUs come back, and each
GPU's recovery action after it (an action an event delivered before is not carried over). A GPU that NVML
refuses a handle for, or that is lost during the check, is printed as lost, never as a traceback.
A driver without a call (nvmlDeviceGetComputeRunningProcesses_v3 before R510)
is read through the older one, or printed as "not supported".

Exit code: 0 all read, 1 NVML unavailable, 3 faults found (a lost GPU, or reads that failed).
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["run_gpu_check"]

MAX_EVENTS = 256  # pending events printed at most: a node in an Xid storm must not flood the terminal


def run_gpu_check(nvml_module: Any = None, out=None, wait_events: float = 1.0) -> int:
    from xidstream.collectors.nvml import EventWaitFailed, NvmlReader, NvmlUnavailable

    out = out or sys.stdout
    if nvml_module is None:
        import pynvml as nvml_module  # NVIDIA's nvidia-ml-py

    def say(text: str) -> None:
        print(text, file=out)

    say(f"pynvml module: {getattr(nvml_module, '__file__', nvml_module)!s}")
    reader = NvmlReader(nvml_module)
    t0 = time.perf_counter()
    try:
        gpus = reader.init()
    except NvmlUnavailable as exc:
        say(f"NVML unavailable: {exc}")
        return 1
    say(f"nvmlInit + inventory: {1000 * (time.perf_counter() - t0):.1f} ms, {len(gpus)} GPU(s)"
        + (f", {len(reader.refused)} refused" if reader.refused else ""))
    faults = 0
    for index, why in sorted(reader.refused.items()):
        say(f"\nGPU {index}: lost (NVML refuses a handle or identity: {why})")
        faults += 1
    for gpu in gpus:
        say(f"\nGPU {gpu.index}: {gpu.uuid}")
        for key, value in gpu.__dict__.items():
            say(f"  {key:22} {value!r}")
        if gpu.status != "ok":  # answered GpuIsLost / ResetRequired while its identity was read
            faults += 1
        try:
            raw = nvml_module.nvmlDeviceGetPciInfo_v3(nvml_module.nvmlDeviceGetHandleByIndex(gpu.index)).busId
            say(f"  {'raw busId':22} {raw!r} ({type(raw).__name__})")
        except nvml_module.NVMLError as exc:
            say(f"  {'raw busId':22} not readable: {exc}")
        t0 = time.perf_counter()
        sample = reader.sample(gpu)
        took = 1000 * (time.perf_counter() - t0)
        say(f"  sample ({took:.2f} ms): status={sample.status} error={sample.error}")
        for key, value in sample.values.items():
            say(f"    {key:28} {value!r}")
        missing = [k for k, v in sample.values.items() if v is None]
        if missing:
            say(f"    (null: {', '.join(missing)}; not supported on this board, or an error)")
        if sample.status != "ok":
            faults += 1
            continue
        faults += sample.errors
        t0 = time.perf_counter()
        apps = reader.compute_apps(gpu)
        took = 1000 * (time.perf_counter() - t0)
        if apps is None:
            say(f"  compute apps ({took:.2f} ms): unknown ({reader.last_error})")
        else:
            say(f"  compute apps ({took:.2f} ms): {apps!r}")
        for pid, _ in apps or []:
            say(f"    pid {pid}: name {reader.process_name(pid)!r}")
        say(f"  pmon: {reader.pmon(gpu)!r}")
        faults += _say_counters(reader, gpu, say)
    registered = reader.register_xid_events()
    recovery = getattr(nvml_module, "nvmlEventTypeGpuRecoveryAction", None)
    say(f"\nXid event registration: {'ok' if registered else 'not available'}")
    say(f"recovery action events: {'asked for' if recovery is not None else 'not in this pynvml'}"
        + ("" if registered else " (no event set)"))
    if registered:
        # The first wait may block; then take what is already pending without waiting, so every
        # queued Xid is shown, not only the first.
        events, failed = [], None
        try:
            notice = reader.wait_xid(int(wait_events * 1000))
            while notice is not None and len(events) < MAX_EVENTS:
                events.append(notice)
                notice = reader.wait_xid(0)
        except EventWaitFailed as exc:
            failed = exc
        more = f" (the first {MAX_EVENTS} shown)" if len(events) >= MAX_EVENTS else ""
        say(f"waited {wait_events:.1f} s for events: {len(events)} pending{more}")
        for notice in events:
            say(f"  {notice!r}")
        if failed is not None:
            say(f"event wait failed: {failed}")
            faults += 1
    faults += _say_reinit(reader, gpus, say)
    say(f"NVML errors other than NotSupported/NotFound/NoData: {reader.error_count}")
    reader.shutdown()
    return 3 if faults or reader.error_count else 0


def _say_reinit(reader: Any, gpus: list, say: Any) -> int:
    """nvmlShutdown then nvmlInit in this process (the collector's release and resume around a GPU
    reset, on this driver and pynvml); 1 when NVML does not come back with the same GPUs."""
    from xidstream.collectors.nvml import NvmlUnavailable

    t0 = time.perf_counter()
    reader.shutdown()
    try:
        again = reader.init()
    except NvmlUnavailable as exc:
        say(f"\nNVML re-initialisation (the collector's release for a reset): failed: {exc}")
        return 1
    took = 1000 * (time.perf_counter() - t0)
    before, after = [g.uuid for g in gpus], [g.uuid for g in again]
    same = "the same GPUs" if after == before else f"NOT the same GPUs: {before} before, {after} after"
    say(f"\nNVML re-initialisation (the collector's release for a reset): {took:.1f} ms, {same}")
    for gpu in again:
        if gpu.status != "ok":
            say(f"  GPU {gpu.index}: {gpu.status}")
            continue
        action = reader.sample(gpu).values["recovery_action"]
        say(f"  GPU {gpu.index}: recovery_action {action!r} (read now; an earlier event's action is not carried over)")
    return 0 if after == before else 1


def _say_counters(reader: Any, gpu: Any, say: Any) -> int:
    """Print one counters read of `gpu` (NvmlReader.counters) and time a second; the faults found."""
    t0 = time.perf_counter()
    reading = reader.counters(gpu)
    first = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    reader.counters(gpu)
    again = 1000 * (time.perf_counter() - t0)
    say(f"  counters (first read {first:.2f} ms, then {again:.2f} ms): status={reading.status} "
        f"errors={reading.errors}" + (f" error={reading.error}" if reading.error else ""))
    for key, value in reading.values.items():
        if key == "nvlinks" and value:
            say(f"    {key:28} {len(value)} link(s)")
            for link in value:
                say(f"      link {link['link']:2} " + " ".join(f"{k}={v!r}" for k, v in link.items() if k != "link"))
        else:
            say(f"    {key:28} {value!r}")
    say(f"    {'unsupported':28} {', '.join(reading.unsupported) or 'none'}")
    return reading.errors + (reading.status != "ok")
