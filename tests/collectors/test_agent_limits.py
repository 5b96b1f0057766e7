"""The collector keeps every record within the contract's caps (schemas.limits): it cuts text with
a marker and lists to their cap rather than publish a record the processor would refuse, or lose it
to a validation error."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakePynvml
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.scenario import FakeProcFs, MemoryWorkloadSource
from xidstream.collectors.sink import MemorySink
from xidstream.collectors.sources.kernel import MemoryKernelSource
from xidstream.schemas import GpuInventory, GpuProcesses, WorkloadEvent, XidEvent, decode_any, encode
from xidstream.schemas.limits import (
    KERNEL_MESSAGE_MAX,
    KERNEL_RAW_MAX,
    NVML_STRING_MAX,
    PROCESSES_MAX,
    SHORT_TEXT_MAX,
)

T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)
_MARKER = re.compile(r"\.\.\. \[(\d+) more characters\]$")


def _rig(sink, *, procfs=None, workloads=None, gpus=None):
    fake = FakePynvml(gpus or [FakeGpu(0, "GPU-aaaa", "00000000:01:00.0")])
    kernel = MemoryKernelSource()
    clock = [0.0]
    c = Collector(CollectorConfig(node="node-a", xid_merge_window=2.0, kmsg_wall_clock=False), sink,
                  nvml=NvmlReader(fake), kernel=kernel, procfs=procfs, workloads=workloads,
                  nvml_events_thread=False, clock=lambda: clock[0])
    c.start(T0)
    return c, kernel, clock


def _flush(c, clock):
    c.tick(T0)
    clock[0] += 10
    c.tick(T0)


def _left_out(text: str, whole: str) -> None:
    """`text` is `whole` cut: a prefix of it, then the marker counting exactly what is missing."""
    m = _MARKER.search(text)
    assert m, text[-60:]
    kept = text[:m.start()]
    assert whole.startswith(kept) and len(kept) + int(m.group(1)) == len(whole)


def test_an_over_long_kernel_line_is_published_cut_not_dropped():
    # The incident: a 350 KB line became a record of 350 KB (and rows and alerts of megabytes).
    sink = MemorySink()
    c, kernel, clock = _rig(sink)
    line = "NVRM: Xid (PCI:0000:01:00): 13, pid=4242, name=python3, Graphics Exception " + "A" * 350_000
    kernel.feed([line])
    _flush(c, clock)
    (x,) = [r for r in sink.records if isinstance(r, XidEvent)]
    assert (x.xid, x.pid, x.process_name, x.gpu_uuid) == (13, 4242, "python3", "GPU-aaaa")
    assert len(x.raw) <= KERNEL_RAW_MAX and len(x.message) <= KERNEL_MESSAGE_MAX
    _left_out(x.raw, line)
    _left_out(x.message, line.split("name=python3, ", 1)[1])
    assert decode_any(encode(x)) == x  # the processor takes it


def test_a_long_sxid_event_is_one_record_within_its_caps():
    # One SXid event prints a line per NVSwitch port within a second; joined whole they passed the cap.
    sink = MemorySink()
    c, kernel, clock = _rig(sink)
    lines = [f"[6781753.{400000 + i:06d}] nvidia-nvswitch{i % 8}: SXid (PCI:0000:06:00.0): 20034, Fatal, "
             f"Link {i} LTSSM Fault Up" for i in range(300)]
    kernel.feed(lines)
    _flush(c, clock)
    (x,) = [r for r in sink.records if isinstance(r, XidEvent)]
    assert x.kind == "sxid" and x.xid == 20034
    assert len(x.raw) <= KERNEL_RAW_MAX and len(x.message) <= KERNEL_MESSAGE_MAX
    _left_out(x.raw, "\n".join(lines))
    assert x.raw.startswith(lines[0] + "\n" + lines[1] + "\n")
    assert decode_any(encode(x)) == x


def test_device_holders_are_null_without_a_scan_and_a_list_after_one():
    sink = MemorySink()
    c, _, clock = _rig(sink)  # no /proc: the holder scan never runs
    _flush(c, clock)
    assert {r.device_holders is None for r in sink.records if isinstance(r, GpuProcesses)} == {True}

    sink = MemorySink()
    c, _, clock = _rig(sink, procfs=FakeProcFs())  # scanned: nobody holds /dev/nvidia0
    _flush(c, clock)
    assert {r.device_holders == [] for r in sink.records if isinstance(r, GpuProcesses)} == {True}

    sink = MemorySink()
    c, _, clock = _rig(sink, procfs=FakeProcFs(holders={"/dev/nvidia0": [77]}, comms={77: "dcgm-exporter"}))
    _flush(c, clock)
    procs = [r for r in sink.records if isinstance(r, GpuProcesses)]
    assert procs and all([(h.pid, h.process_name) for h in p.device_holders] == [(77, "dcgm-exporter")] for p in procs)


def test_a_holder_flood_is_cut_to_its_cap_and_said_so():
    sink = MemorySink()
    pids = list(range(1000, 1000 + PROCESSES_MAX + 904))
    c, _, clock = _rig(sink, procfs=FakeProcFs(holders={"/dev/nvidia0": pids}))
    _flush(c, clock)
    p = [r for r in sink.records if isinstance(r, GpuProcesses)][-1]
    assert [h.pid for h in p.device_holders] == pids[:PROCESSES_MAX]
    assert p.error == f"device_holders cut to the first {PROCESSES_MAX} of {len(pids)}"
    assert decode_any(encode(p)) == p


def test_workload_and_inventory_text_is_cut_to_its_cap():
    sink = MemorySink()
    work = MemoryWorkloadSource()
    work.push(dict(gpu_uuid="GPU-aaaa", pod_uid="0c9d8e7f-1a2b-4c3d-8e5f-6a7b8c9d0e12", namespace="ml", pod="p-0",
                   container="main", event="failed", reason="R" * 50_000, exit_code=1))
    gpu = FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", name="N" * 500)
    c, _, clock = _rig(sink, workloads=work, gpus=[gpu])
    _flush(c, clock)
    (w,) = [r for r in sink.records if isinstance(r, WorkloadEvent)]
    assert len(w.reason) <= SHORT_TEXT_MAX and w.pod == "p-0"
    _left_out(w.reason, "R" * 50_000)
    inv = [r for r in sink.records if isinstance(r, GpuInventory)]
    assert inv and all(len(i.name) <= NVML_STRING_MAX for i in inv)
