"""The collector loop over fakes: identity resolution, merge with NVML, cursors, bad input."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakePynvml
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import MemorySink
from xidstream.collectors.sources.kernel import MemoryKernelSource
from xidstream.schemas import GpuInventory, GpuProcesses, GpuSample, XidEvent, load_scenario

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)


class LaterAckSink(MemorySink):
    """Acknowledges only when told to, like Kafka with a slow broker."""

    def __init__(self):
        super().__init__()
        self.waiting = []

    def publish(self, record, on_ack=None):
        self.records.append(record)
        if on_ack:
            self.waiting.append(on_ack)

    def ack_all(self):
        for cb in self.waiting:
            cb()
        self.waiting.clear()


def _rig(sink, gpus=None, window=2.0):
    fake = FakePynvml(gpus or [FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0")])
    kernel = MemoryKernelSource()
    clock = [0.0]
    c = Collector(CollectorConfig(node="node-a", xid_merge_window=window, kmsg_wall_clock=False), sink,
                  nvml=NvmlReader(fake), kernel=kernel, nvml_events_thread=False, clock=lambda: clock[0])
    c.start(T0)
    return c, fake, kernel, clock


def _xids(sink):
    return [r for r in sink.records if isinstance(r, XidEvent)]


def test_motivating_incident_records():
    sink = MemorySink()
    ScenarioRunner(load_scenario(ROOT / "scenarios" / "motivating-incident.yaml"), sink).run()
    xids = [r for r in _xids(sink) if r.kind == "xid"]
    assert [r.xid for r in xids] == [13, 13, 13, 31, 43]
    gpu1 = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"
    for r in xids:
        assert (r.gpu_uuid, r.gpu_index, r.pci_bus_id, r.resolved, r.pid) == (gpu1, 1, "0000:02:00", True, 4242)
        assert [s.value for s in r.sources] == ["kmsg", "nvml"]  # one record, both sources named
    assert xids[-1].xid_name == "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR"
    (failure,) = [r for r in _xids(sink) if r.kind == "recovery_failure"]
    assert failure.gpu_uuid == gpu1  # "GPU1 refcnt..." resolved through the driver's number
    samples = [r for r in sink.records if isinstance(r, GpuSample) and r.gpu_uuid == gpu1]
    late = [s for s in samples if s.ts >= datetime(2026, 11, 28, 3, 2, 3, tzinfo=timezone.utc)]
    assert late and all(s.utilization_gpu_pct == 100 and s.memory_used_mib == 0 and s.power_w == 110 for s in late)
    procs = [r for r in sink.records if isinstance(r, GpuProcesses) and r.gpu_uuid == gpu1]
    assert procs[0].compute_apps[0].pod_uid == "0c9d8e7f-1a2b-4c3d-8e5f-6a7b8c9d0e12"
    assert procs[-1].compute_apps == [] and procs[-1].device_holders[0].pid == 1188


def test_unresolved_pci_is_published_and_flagged():
    sink = MemorySink()
    c, _, kernel, clock = _rig(sink)
    kernel.feed(["NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."])
    c.tick(T0)
    clock[0] = 10
    c.tick(T0)
    (x,) = _xids(sink)
    assert (x.gpu_uuid, x.resolved, x.pci_bus_id) == (None, False, "0000:9b:00")
    from xidstream.schemas import TopicRegistry

    assert TopicRegistry().for_record(x) == ("gpu.xid", b"node-a/0000:9b:00")


# gpud's capture (tests/data/kernel-log-lines.tsv): one SXid event printed by three NVSwitches
GPUD_SXID = [
    "[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
    "[6781753.404848] nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Severity 1 Engine instance 60 Sub-engine instance 00",
    "[6781753.406566] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Data {0x10000000, 0x10000000, 0x00000000, "
    "0x10000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
]


def test_an_sxid_event_names_every_nvswitch_it_came_from_and_no_gpu():
    sink = MemorySink()
    c, _, kernel, clock = _rig(sink)
    kernel.feed(GPUD_SXID + [GPUD_SXID[0].replace("Link 48", "Link 49")])  # a switch seen again: named once
    c.tick(T0)
    clock[0] = 10
    c.tick(T0)
    (x,) = _xids(sink)
    assert (x.kind, x.xid, x.nvswitch_pci_bus_ids) == ("sxid", 20034, ["0000:06:00", "0000:07:00", "0000:05:00"])
    assert (x.pci_bus_id, x.gpu_uuid, x.resolved) == (None, None, False)
    # NVIDIA's name and class of the code (Fabric Manager guide); the guide gives no Xid-style bucket
    assert (x.xid_name, x.xid_category, x.xid_resolution) == ("LTSSM Fault Up", "fatal", None)
    from xidstream.schemas import TopicRegistry, decode_any, encode

    assert decode_any(encode(x)) == x
    assert TopicRegistry().for_record(x) == ("gpu.xid", b"node-a/unknown")  # no switch taken for a GPU


def test_an_sxid_event_from_more_switches_than_the_contract_holds_keeps_the_first():
    from xidstream.schemas.limits import NVSWITCHES_MAX

    sink = MemorySink()
    c, _, kernel, clock = _rig(sink)
    kernel.feed([f"[5.{i:06d}] nvidia-nvswitch{i}: SXid (PCI:0000:{i + 1:02x}:00.0): 20034, Fatal, Link 1 LTSSM Fault Up"
                 for i in range(NVSWITCHES_MAX + 4)])
    c.tick(T0)
    clock[0] = 10
    c.tick(T0)
    (x,) = _xids(sink)
    assert x.nvswitch_pci_bus_ids == [f"0000:{i + 1:02x}:00" for i in range(NVSWITCHES_MAX)]
    assert x.raw.count("\n") == NVSWITCHES_MAX + 3  # every line is still in the record


def test_an_sxid_code_the_table_lacks_is_published_as_unknown():
    sink = MemorySink()
    c, _, kernel, clock = _rig(sink)
    # NVSentinel's fault-injection line: a code NVIDIA's SXid tables do not list
    kernel.feed(["nvidia-nvswitch0: SXid (PCI:0000:ca:00.0): 10003, Fatal, unhandled interrupt"])
    c.tick(T0)
    clock[0] = 10
    c.tick(T0)
    (x,) = _xids(sink)
    assert (x.kind, x.xid, x.xid_name, x.xid_category, x.nvswitch_pci_bus_ids) == (
        "sxid", 10003, "unknown", "unknown", ["0000:ca:00"])


def test_a_gpu_xid_names_no_nvswitch():
    sink = MemorySink()
    c, _, kernel, clock = _rig(sink)
    kernel.feed(["NVRM: Xid (PCI:0000:01:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error"])
    c.tick(T0)
    clock[0] = 10
    c.tick(T0)
    (x,) = _xids(sink)
    assert (x.kind, x.gpu_uuid, x.nvswitch_pci_bus_ids) == ("xid", "GPU-aaaa", [])


def test_nvml_only_xid_is_published_once_with_its_source():
    sink = MemorySink()
    c, fake, _, clock = _rig(sink)
    fake.inject_xid(1, 48)
    c.tick(T0)
    assert _xids(sink) == []  # held for the merge window
    clock[0] = 3
    c.tick(T0)
    (x,) = _xids(sink)
    assert (x.xid, x.gpu_uuid, [s.value for s in x.sources]) == (48, "GPU-bbbb", ["nvml"])


def test_late_nvml_event_for_a_published_kernel_line_is_not_a_second_record():
    sink = MemorySink()
    c, fake, kernel, clock = _rig(sink, window=1.0)
    kernel.feed(["NVRM: Xid (PCI:0000:02:00): 48, pid=1, name=a, DBE"])
    c.tick(T0)
    clock[0] = 2
    c.tick(T0)
    fake.inject_xid(1, 48)
    clock[0] = 3
    c.tick(T0)
    clock[0] = 10
    c.tick(T0)
    assert [x.xid for x in _xids(sink)] == [48]


def test_kernel_cursor_advances_only_after_acknowledgement():
    sink = LaterAckSink()
    c, _, kernel, clock = _rig(sink, window=0.0)
    kernel.feed(["noise", "NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m", "more noise"])
    c.tick(T0)
    assert len(_xids(sink)) == 1
    assert kernel.committed == [1]  # the line before the Xid, not the Xid nor anything after it
    sink.ack_all()
    clock[0] = 1
    c.tick(T0)
    assert kernel.committed[-1] == 3


def test_gpu_lost_is_a_sample_status_and_the_loop_goes_on():
    sink = MemorySink()
    c, fake, _, clock = _rig(sink)
    fake.gpu(1).status = "lost"
    c.tick(T0)
    lost = [r for r in sink.records if isinstance(r, GpuSample) and r.gpu_uuid == "GPU-bbbb"]
    assert lost[-1].status.value == "lost" and lost[-1].utilization_gpu_pct is None
    procs = [r for r in sink.records if isinstance(r, GpuProcesses) and r.gpu_uuid == "GPU-bbbb"]
    assert procs[-1].compute_apps is None  # unknown, not "no process"
    ok = [r for r in sink.records if isinstance(r, GpuSample) and r.gpu_uuid == "GPU-aaaa"]
    assert ok[-1].status.value == "ok"


@pytest.mark.parametrize("line", ["\x00\xff garbage", "NVRM: Xid (PCI:0000:01:00): 99999999999999999999999, x",
                                  "{\"MESSAGE\": [1, 2, 999]}", "NVRM: " + "x" * 100_000])
def test_bad_lines_do_not_stop_the_collector(line):
    sink = MemorySink()
    c, _, kernel, clock = _rig(sink, window=0.0)
    kernel.feed([line, "NVRM: Xid (PCI:0000:01:00): 31, pid=1, name=a, m"])
    c.tick(T0)
    assert 31 in [x.xid for x in _xids(sink)]


@pytest.mark.parametrize("code", [173, 999])
def test_an_xid_code_outside_the_catalog_is_published_with_its_raw_text(code):
    """A code NVIDIA's catalog does not name is a record like any other: parsed, published with
    the driver's whole line and the catalog's word for it ('unknown', no resolution), through
    the codec the Kafka sink and the processor use, and counted under 'other' on the metrics."""
    from xidstream.schemas.codec import decode_any, encode

    sink = MemorySink()
    c, _, kernel, _ = _rig(sink, window=0.0)
    line = f"[ 12.5] NVRM: Xid (PCI:0000:01:00): {code}, pid=77, name=python3, a message no catalog explains"
    kernel.feed([line])
    c.tick(T0)
    (x,) = [decode_any(encode(r)) for r in _xids(sink)]
    assert (x.xid, x.xid_name, x.xid_category, x.xid_resolution, x.raw, x.message, x.gpu_uuid, x.pid) == (
        code, "unknown", "unknown", "NOT_ASSIGNED", line, "a message no catalog explains", "GPU-aaaa", 77)
    assert c.metrics.xids.labels("other")._value.get() == 1


def test_inventory_is_published_at_start_and_when_it_changes():
    sink = MemorySink()
    c, fake, _, clock = _rig(sink)
    inv = [r for r in sink.records if isinstance(r, GpuInventory)]
    assert [(r.gpu_index, r.gpu_uuid, r.pci_bus_id, r.driver_version, r.cuda_version) for r in inv] == [
        (0, "GPU-aaaa", "0000:01:00", "590.44.01", "13.1"), (1, "GPU-bbbb", "0000:02:00", "590.44.01", "13.1")]
    clock[0] = 61
    c.tick(T0)
    assert len([r for r in sink.records if isinstance(r, GpuInventory)]) == 2  # unchanged
    fake.driver_version = "590.48.01"
    clock[0] = 122
    c.tick(T0)
    assert len([r for r in sink.records if isinstance(r, GpuInventory)]) == 4


def test_no_nvml_means_kernel_records_only():
    sink = MemorySink()
    kernel = MemoryKernelSource()
    c = Collector(CollectorConfig(node="n", xid_merge_window=0), sink, nvml=NvmlReader(FakePynvml([], available=False)),
                  kernel=kernel, nvml_events_thread=False)
    c.start(T0)
    kernel.feed(["NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m"])
    c.tick(T0)
    assert [type(r).__name__ for r in sink.records] == ["XidEvent"]
    # and it says so: no process list of this GPU will come for the processor to wait for
    assert sink.records[0].process_lists is False


def test_with_nvml_xid_records_say_process_lists_come():
    sink = MemorySink()
    kernel = MemoryKernelSource()
    c = Collector(CollectorConfig(node="n", xid_merge_window=0), sink, nvml=NvmlReader(FakePynvml([FakeGpu(index=0, uuid="GPU-a", pci_bus_id="00000000:01:00.0")])),
                  kernel=kernel, nvml_events_thread=False)
    c.start(T0)
    kernel.feed(["NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m"])
    c.tick(T0)
    assert [r.process_lists for r in sink.records if isinstance(r, XidEvent)] == [True]


def test_a_restart_neither_loses_nor_resends_kernel_records(tmp_path):
    from xidstream.collectors.sources.kernel import FileSource

    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m\nnoise\n")

    def run_once():
        sink = MemorySink()
        # The first start's file is history of unknown time: published (backfilled) only with
        # --backfill; by default history that cannot be placed in the current boot is skipped.
        c = Collector(CollectorConfig(node="n", backfill_since=datetime(1970, 1, 1, tzinfo=timezone.utc)), sink,
                      kernel=FileSource(log, cursor_file=tmp_path / "cur"), nvml_events_thread=False)
        c.start(T0)
        c.tick(T0)
        c.stop()  # the merger still held the Xid: stop delivers it and saves the cursor
        return [(r.xid, r.backfilled) for r in _xids(sink)]

    assert run_once() == [(13, True)]
    with log.open("a") as fh:
        fh.write("NVRM: Xid (PCI:0000:01:00): 31, pid=2, name=b, m\n")
    assert run_once() == [(31, False)]
    assert run_once() == []


# -- NVML and kernel-log defects ------------------------------------------------------------
def _procs(sink, uuid):
    return [r for r in sink.records if isinstance(r, GpuProcesses) and r.gpu_uuid == uuid]


def _samples(sink, uuid):
    return [r for r in sink.records if isinstance(r, GpuSample) and r.gpu_uuid == uuid]


def _inventory(sink, uuid):
    return [r for r in sink.records if isinstance(r, GpuInventory) and r.gpu_uuid == uuid]


def test_nvml_only_xid_is_stamped_when_the_event_arrived_not_when_the_window_expired():
    """Defect 3."""
    sink = MemorySink()
    c, fake, _, clock = _rig(sink)
    fake.inject_xid(1, 48)
    c.tick(T0)
    clock[0] = 3
    c.tick(T0 + timedelta(seconds=3))
    (x,) = _xids(sink)
    assert x.ts == T0 and x.ts_source.value == "nvml"


def test_unreadable_compute_list_is_unknown_not_empty():
    """Defect 7: a list NVML could not read is null with the reason, never []."""
    sink = MemorySink()
    c, fake, _, clock = _rig(sink)
    fake.gpu(0).errors = {"nvmlDeviceGetComputeRunningProcesses": 999}
    fake.gpu(1).status = "lost"
    c.tick(T0)
    p0, p1 = _procs(sink, "GPU-aaaa")[-1], _procs(sink, "GPU-bbbb")[-1]
    assert p0.compute_apps is None and "Unknown Error" in p0.error
    assert p1.compute_apps is None and "lost" in p1.error
    fake.gpu(0).errors = {}
    clock[0] = 1
    c.tick(T0)
    assert _procs(sink, "GPU-aaaa")[-1].compute_apps == [] and _procs(sink, "GPU-aaaa")[-1].error is None


def test_gpu_lost_before_start_is_published_as_lost_from_the_saved_inventory(tmp_path):
    """Defect 2: a restart after Xid 79 finds NVML refusing the GPU's handle; the collector keeps
    publishing it from the inventory it saved, until it returns or an operator removes it."""
    gpus = [FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0")]

    def run(fake, forget=()):
        sink = MemorySink()
        c = Collector(CollectorConfig(node="n", kmsg_wall_clock=False), sink, nvml=NvmlReader(fake),
                      nvml_events_thread=False, state_dir=tmp_path, clock=lambda: 0.0)
        for uuid in forget:
            c.forget_gpu(uuid)
        c.start(T0)
        c.tick(T0)
        c.stop()
        return sink

    first = run(FakePynvml(gpus))
    assert [r.status.value for r in _inventory(first, "GPU-bbbb")] == ["ok"]
    gpus[1].status = "lost"
    again = run(FakePynvml(gpus))
    (inv,) = _inventory(again, "GPU-bbbb")
    assert (inv.status.value, inv.gpu_index, inv.pci_bus_id) == ("lost", 1, "0000:02:00")
    (s,) = _samples(again, "GPU-bbbb")
    assert s.status.value == "lost" and "refuses" in s.error
    assert _procs(again, "GPU-bbbb")[-1].compute_apps is None
    assert _samples(again, "GPU-aaaa")[-1].status.value == "ok"
    # still lost on the next start too: the saved inventory keeps it
    assert _inventory(run(FakePynvml(gpus)), "GPU-bbbb")[0].status.value == "lost"
    gpus[1].status = "ok"  # it came back
    back = run(FakePynvml(gpus))
    assert _inventory(back, "GPU-bbbb")[0].status.value == "ok" and _samples(back, "GPU-bbbb")[0].status.value == "ok"
    gpus[1].status = "lost"
    run(FakePynvml(gpus))
    gone = run(FakePynvml(gpus), forget=["GPU-bbbb"])  # the operator removed it
    assert _inventory(gone, "GPU-bbbb") == [] and _samples(gone, "GPU-bbbb") == []


def test_inventory_carries_the_memory_call_version_and_notes():
    sink = MemorySink()
    _rig(sink, gpus=[FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", memory_v2=False),
                     FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", memory_reserved_mib=400)])
    a, b = _inventory(sink, "GPU-aaaa")[0], _inventory(sink, "GPU-bbbb")[0]
    assert a.memory_info_version == 1 and "driver-reserved" in a.notes[0]
    assert b.memory_info_version == 2 and b.notes == []
    s = _samples(sink, "GPU-bbbb") or None
    assert s is None  # no tick yet


def test_failing_event_wait_backs_off_is_counted_and_the_event_set_is_recreated():
    """Defect 6: a fast-failing event wait must not spin; the set is re-created and works again."""
    import time as _time

    sink = MemorySink()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0")])
    c = Collector(CollectorConfig(node="n", xid_merge_window=0.0, event_backoff=(0.1, 0.4)), sink,
                  nvml=NvmlReader(fake), nvml_events_thread=True)
    c.start(T0)
    try:
        fake.gpu(1).status = "lost"  # the registered event set now fails at once, then stays broken
        _time.sleep(1.0)
        waits = fake.calls["nvmlEventSetWait_v2"]
        assert waits < 40, f"{waits} event waits in 1 s: the event thread spins"
        assert c.nvml.event_wait_failures >= 1
        assert c.metrics.nvml_event_failures._value.get() >= 1
        # the set was re-created without the lost GPU: GPU 0's events arrive
        fake.inject_xid(0, 13)
        deadline = _time.monotonic() + 3
        while _time.monotonic() < deadline and not _xids(sink):
            c.tick(T0)
            _time.sleep(0.05)
        assert [x.xid for x in _xids(sink)] == [13]
        # GPU 1 returns: the next sample sees it, the set is re-created with it
        fake.gpu(1).status = "ok"
        c.tick(T0)
        _time.sleep(0.6)
        fake.inject_xid(1, 79)
        deadline = _time.monotonic() + 3
        while _time.monotonic() < deadline and len(_xids(sink)) < 2:
            c.tick(T0)
            _time.sleep(0.05)
        assert [(x.xid, x.gpu_uuid) for x in _xids(sink)] == [(13, "GPU-aaaa"), (79, "GPU-bbbb")]
        assert fake.calls["nvmlEventSetCreate"] >= 3
    finally:
        c.stop()


def test_an_event_set_that_cannot_be_rebuilt_backs_off_and_is_retried_not_spun_on():
    """Review t11: once nvmlEventSetCreate fails, there is no event set; the wait must count that as
    a failure and back off (not return at once in a loop that burns a core), and keep retrying the
    rebuild until the driver accepts it again."""
    import time as _time

    import pynvml

    sink = MemorySink()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0")])
    c = Collector(CollectorConfig(node="n", xid_merge_window=0.0, event_backoff=(0.1, 0.4)), sink,
                  nvml=NvmlReader(fake), nvml_events_thread=True)
    waits = [0]
    real_wait = c.nvml.wait_xid

    def counted(timeout_ms):
        waits[0] += 1
        return real_wait(timeout_ms)

    c.nvml.wait_xid = counted
    real_create = fake.nvmlEventSetCreate

    def refuse():
        fake.calls["nvmlEventSetCreate"] += 1
        raise pynvml.NVMLError_Unknown(pynvml.NVML_ERROR_UNKNOWN)  # NVML_ERROR_UNKNOWN: the driver refuses new event sets

    c.start(T0)
    try:
        fake.nvmlEventSetCreate = refuse
        fake.gpu(1).status = "lost"  # the wait fails, the rebuild then fails: no event set at all
        _time.sleep(1.5)
        assert waits[0] < 40, f"{waits[0]} event waits in 1.5 s: the event thread spins"
        assert fake.calls["nvmlEventSetCreate"] >= 3, "the rebuild is not retried"
        assert c.metrics.nvml_event_failures._value.get() >= 2
        # the driver accepts event sets again: the set is rebuilt and GPU 0's events arrive
        fake.nvmlEventSetCreate = real_create
        _time.sleep(0.6)
        fake.inject_xid(0, 13)
        deadline = _time.monotonic() + 3
        while _time.monotonic() < deadline and not _xids(sink):
            c.tick(T0)
            _time.sleep(0.05)
        assert [x.xid for x in _xids(sink)] == [13]
    finally:
        c.stop()


def test_kernel_cursors_do_not_pile_up_while_kafka_is_down():
    """Defect 11: with one Xid unacknowledged, later lines must not each be kept in memory."""
    import tracemalloc

    sink = LaterAckSink()  # never acknowledges: Kafka is down
    c, _, kernel, clock = _rig(sink, window=0.0)
    kernel.feed(["NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m"])
    c.tick(T0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20):
        kernel.feed([f"usb 1-1: noise line {i}-{j}" for j in range(2000)])
        clock[0] = i + 1
        c.tick(T0)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 400_000, f"{grown} bytes kept for 40,000 lines"
    assert kernel.committed == []  # nothing at or past the unacknowledged Xid's line is committed
    sink.ack_all()
    clock[0] = 100
    c.tick(T0)
    assert kernel.committed[-1] == 40_001  # every line acknowledged: the cursor moves to the last


# -- a line's own time -------------------------------------------------------------
UTC = timezone.utc
X79 = "NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def _file_rig(tmp_path, since=None, boot=datetime(2026, 12, 30, tzinfo=UTC)):
    from xidstream.collectors.sources.kernel import FileSource

    sink = MemorySink()
    src = FileSource(tmp_path / "kern.log", cursor_file=tmp_path / "cur")
    c = Collector(CollectorConfig(node="n", xid_merge_window=0.0, log_tz=UTC, boot_time=boot, backfill_since=since),
                  sink, kernel=src, nvml_events_thread=False)
    c.start(T0)
    return c, sink


def _mtime(path, when):
    import os

    os.utime(path, (when.timestamp(), when.timestamp()))


def test_syslog_lines_get_their_own_time_with_the_year_from_the_files_mtime(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(f"Dec 31 23:59:58 gpu-node-7 kernel: {X79}\nJan  1 00:00:03 gpu-node-7 kernel: {X79}\n")
    _mtime(log, datetime(2027, 1, 1, 0, 0, 5, tzinfo=UTC))  # written across the new year
    c, sink = _file_rig(tmp_path)
    c.tick(datetime(2027, 1, 1, 0, 1, tzinfo=UTC))
    got = [(x.ts, x.ts_source.value, x.backfilled) for x in _xids(sink)]
    assert got == [(datetime(2026, 12, 31, 23, 59, 58, tzinfo=UTC), "line", True),
                   (datetime(2027, 1, 1, 0, 0, 3, tzinfo=UTC), "line", True)]


def test_backfill_of_rotated_logs_keeps_their_time_and_only_the_current_boot_by_default(tmp_path):
    import gzip

    old = tmp_path / "kern.log.2.gz"
    with gzip.open(old, "wt") as fh:
        fh.write(f"Aug 14 02:11:09 gpu-node-7 kernel: {X79}\n")
    _mtime(old, datetime(2026, 8, 20, tzinfo=UTC))
    (tmp_path / "kern.log.1").write_text(f"Dec 29 10:00:00 gpu-node-7 kernel: {X79}\n"  # before this boot
                                         f"Dec 30 10:00:00 gpu-node-7 kernel: {X79}\n")  # this boot
    _mtime(tmp_path / "kern.log.1", datetime(2026, 12, 30, 12, tzinfo=UTC))
    (tmp_path / "kern.log").write_text("")
    c, sink = _file_rig(tmp_path)  # default: look back over the current boot only
    c.tick(datetime(2026, 12, 31, tzinfo=UTC))
    assert [(x.ts, x.backfilled) for x in _xids(sink)] == [(datetime(2026, 12, 30, 10, tzinfo=UTC), True)]
    (tmp_path / "cur").unlink(missing_ok=True)
    c, sink = _file_rig(tmp_path, since=datetime(2026, 1, 1, tzinfo=UTC))  # --backfill
    c.tick(datetime(2026, 12, 31, tzinfo=UTC))
    assert [(x.ts.date().isoformat(), x.ts_source.value, x.backfilled) for x in _xids(sink)] == [
        ("2026-08-14", "line", True), ("2026-12-29", "line", True), ("2026-12-30", "line", True)]


def test_live_lines_are_not_backfilled_and_every_prefix_names_its_time_source(tmp_path):
    import json

    log = tmp_path / "kern.log"
    log.write_text("")
    c, sink = _file_rig(tmp_path)
    now = datetime(2026, 12, 31, 12, tzinfo=UTC)
    rec = {"MESSAGE": X79, "_TRANSPORT": "kernel", "__REALTIME_TIMESTAMP": str(int(datetime(2026, 12, 31, 11, 0, 1, tzinfo=UTC).timestamp() * 1e6))}
    with log.open("a") as fh:
        fh.write(f"[Thu Dec 31 11:00:00 2026] {X79}\n"
                 f"kern  :warn  : 2026-12-31T11:00:02,000000+00:00 {X79}\n"
                 f"{json.dumps(rec)}\n"
                 f"{X79}\n")
    _mtime(log, now)
    c.tick(now)
    assert [(x.ts, x.ts_source.value, x.backfilled) for x in _xids(sink)] == [
        (datetime(2026, 12, 31, 11, 0, 0, tzinfo=UTC), "line", False),
        (datetime(2026, 12, 31, 11, 0, 2, tzinfo=UTC), "line", False),
        (datetime(2026, 12, 31, 11, 0, 1, tzinfo=UTC), "journal", False),
        (now, "read", False)]


def test_kmsg_records_are_stamped_from_the_boot_time():
    sink = MemorySink()
    kernel = MemoryKernelSource()
    boot = datetime(2026, 12, 31, tzinfo=UTC)
    c = Collector(CollectorConfig(node="n", xid_merge_window=0.0, boot_time=boot), sink, kernel=kernel,
                  nvml_events_thread=False)
    c.start(T0)
    kernel.feed([f"4,7,1843308145,-;{X79}"])
    c.tick(boot + timedelta(hours=1))
    (x,) = _xids(sink)
    assert (x.ts, x.ts_source.value) == (boot + timedelta(microseconds=1843308145), "kmsg")


def test_replay_in_the_loops_own_time_keeps_only_absolute_line_times():
    """A scenario's lines are copied from other days: in replay mode (kmsg_wall_clock=False) a
    syslog or dmesg -T stamp must not move the record away from scenario time."""
    sink = MemorySink()
    c, _, kernel, clock = _rig(sink, window=0.0)  # kmsg_wall_clock=False, like the ScenarioRunner
    kernel.feed([f"Dec  6 17:49:03 node-e kernel: [  912.5] {X79}",
                 f"kern  :warn  : 2026-11-28T03:00:05,000000+00:00 {X79}"])
    c.tick(T0)
    assert [(x.ts, x.ts_source.value) for x in _xids(sink)] == [
        (T0, "read"), (T0 + timedelta(seconds=5), "line")]


# -- every driver -----------------------------------------------------------------------------------
@pytest.mark.parametrize("versions", [(2,), ()])
def test_a_driver_without_compute_processes_v3_does_not_stop_the_collector(versions):
    """R470 and other pre-R510 drivers lack nvmlDeviceGetComputeRunningProcesses_v3, where the
    unversioned pynvml call raises NVMLLibraryMismatchError: fall back to _v2, else unknown."""
    from xidstream.collectors.fakes import FakeProcess

    sink = MemorySink()
    c, fake, _, clock = _rig(sink, gpus=[FakeGpu(0, "GPU-aaaa", "00000000:01:00.0",
                                                 processes=[FakeProcess(4242, used_memory_mib=64)])])
    fake.compute_versions = versions
    c.tick(T0)
    clock[0] = 1
    c.tick(T0)
    (p, _p) = _procs(sink, "GPU-aaaa")
    if versions:
        assert [(a.pid, a.used_memory_mib) for a in p.compute_apps] == [(4242, 64.0)] and p.error is None
    else:
        assert p.compute_apps is None and "not supported" in p.error
    assert c.nvml.error_count == 0


def _rig_saved(tmp_path, fake, clock):
    sink = MemorySink()
    c = Collector(CollectorConfig(node="n", kmsg_wall_clock=False), sink, nvml=NvmlReader(fake),
                  nvml_events_thread=False, state_dir=tmp_path, clock=lambda: clock[0])
    c.start(T0)
    return c, sink


@pytest.mark.parametrize("status", ["lost", "reset_required"])
def test_a_gpu_unhealthy_during_the_inventory_read_is_not_ok_and_keeps_its_saved_fields(tmp_path, status):
    """NVML answers GpuIsLost / ResetRequired while the inventory is read (UUID and PCI id still
    answer): the GPU is published with that status, with the fields saved when it was healthy,
    and the nulls of the failed reads do not overwrite the saved entry."""
    import json

    gpus = [FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="111", name="NVIDIA H100 80GB HBM3", memory_total_mib=81559),
            FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", serial="222")]
    clock = [0.0]
    c, sink = _rig_saved(tmp_path, FakePynvml(gpus), clock)
    good = _inventory(sink, "GPU-aaaa")[0]
    assert good.status.value == "ok"

    def unhealthy(g):
        if status == "lost":
            g.lose_on_call = ("nvmlDeviceGetMemoryInfo_v2", 1)  # falls off the bus during the read
        else:
            g.status, g.still_answers = "reset_required", {"nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3"}

    unhealthy(gpus[0])
    clock[0] = 61  # the next inventory refresh
    c.tick(T0)
    inv = _inventory(sink, "GPU-aaaa")[-1]
    assert inv.status.value == status
    assert (inv.name, inv.serial, inv.memory_total_mib, inv.pci_bus_id) == ("NVIDIA H100 80GB HBM3", "111", 81559, "0000:01:00")
    assert _samples(sink, "GPU-aaaa")[-1].status.value == status
    c.stop()
    saved = {g["uuid"]: g for g in json.loads((tmp_path / "inventory.json").read_text())["gpus"]}
    assert (saved["GPU-aaaa"]["name"], saved["GPU-aaaa"]["serial"], saved["GPU-aaaa"]["memory_total_mib"],
            saved["GPU-aaaa"]["minor"]) == ("NVIDIA H100 80GB HBM3", "111", 81559, 0)

    # a restart while it is still unhealthy: never `ok`, the saved fields again
    gpus[0].lose_on_call = None
    if status == "reset_required":
        again, sink2 = _rig_saved(tmp_path, FakePynvml(gpus), clock)
        (inv2,) = _inventory(sink2, "GPU-aaaa")
        assert inv2.status.value == status and (inv2.name, inv2.serial) == ("NVIDIA H100 80GB HBM3", "111")
        again.stop()


def test_a_first_deployment_never_publishes_a_gpu_nvml_refuses_as_ok(tmp_path):
    """Nothing saved yet: a GPU that answers ResetRequired is published as such, with what NVML
    did answer (UUID, PCI id), never as `ok`."""
    gpus = [FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", status="reset_required",
                    still_answers={"nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3"}),
            FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", lose_on_call=("nvmlDeviceGetSerial", 1))]
    c, sink = _rig_saved(tmp_path, FakePynvml(gpus), [0.0])
    a, b = _inventory(sink, "GPU-aaaa"), _inventory(sink, "GPU-bbbb")
    assert [(r.status.value, r.pci_bus_id) for r in a] == [("reset_required", "0000:01:00")]
    assert [(r.status.value, r.pci_bus_id) for r in b] == [("lost", "0000:02:00")]
    c.stop()


@pytest.mark.parametrize("refusal", ["lost", "reset_required"])
def test_a_gpu_nvml_refuses_on_a_first_start_is_published_as_lost_and_counted(tmp_path, refusal):
    """Nothing saved from an earlier run (a first deployment, or a state dir lost with its pod) and
    NVML refuses GPU 1 (a lost GPU refuses its handle; one needing a reset, its UUID): NVML still
    counts it, so it is published as lost under its index: PCI id ffff:00:01 standing in (domain
    ffff has no GPU) and key `<node>/ffff:00:01`, the topics' key of a GPU without a UUID, so the
    results of its commands (no UUID, this PCI id) reach its row. Counted in
    xidstream_collector_lost_gpus, never saved as an identity, gone once NVML gives its UUID again."""
    import json

    from prometheus_client import generate_latest

    gpus = [FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", status=refusal)]
    clock = [0.0]
    c, sink = _rig_saved(tmp_path, FakePynvml(gpus), clock)
    c.tick(T0)
    key = "n/ffff:00:01"
    (inv,) = _inventory(sink, key)
    assert (inv.status.value, inv.gpu_index, inv.pci_bus_id, inv.name) == ("lost", 1, "ffff:00:01", None)
    assert key == f"{inv.node}/{inv.pci_bus_id}"  # streams.routing.state_key of its commands' results
    assert any("refuses" in note and "index 1" in note for note in inv.notes)
    (s,) = _samples(sink, key)
    want = "GPU is lost" if refusal == "lost" else "GPU requires restart"
    assert s.status.value == "lost" and want in s.error and s.utilization_gpu_pct is None
    (p,) = _procs(sink, key)
    assert p.compute_apps is None and p.device_holders is None  # its /dev/nvidia<minor> is unknown too
    assert _samples(sink, "GPU-aaaa")[-1].status.value == "ok"
    body = generate_latest(c.metrics.registry).decode()
    assert 'xidstream_collector_lost_gpus{identity="index"} 1.0' in body
    assert 'xidstream_collector_lost_gpus{identity="saved"} 0.0' in body
    assert 'xidstream_collector_gpu_status{gpu_uuid="n/ffff:00:01",status="lost"} 1.0' in body
    assert c.identity.resolve(None, 1) == (None, None, None)  # no made-up PCI id for the driver's GPU1
    saved = json.loads((tmp_path / "inventory.json").read_text())["gpus"]
    assert [g["uuid"] for g in saved] == ["GPU-aaaa"]  # a placeholder is no identity to keep

    gpus[1].status = "ok"  # it answers again: its own UUID, the placeholder goes
    clock[0] = 61
    n = len(sink.records)
    c.tick(T0)
    assert _samples(sink, "GPU-bbbb")[-1].status.value == "ok" and _samples(sink, key) == [s]
    body = generate_latest(c.metrics.registry).decode()
    assert 'xidstream_collector_lost_gpus{identity="index"} 0.0' in body
    assert 'gpu_uuid="n/ffff:00:01"' not in body
    assert not [r for r in sink.records[n:] if getattr(r, "gpu_uuid", None) == key]
    c.stop()


def test_the_key_of_a_gpu_known_only_by_its_index_fits_the_contract_on_any_node():
    from xidstream.collectors.agent import unidentified_key, unidentified_pci
    from xidstream.schemas.limits import GPU_UUID_MAX

    assert (unidentified_pci(1), unidentified_pci(300)) == ("ffff:00:01", "ffff:01:2c")
    assert unidentified_key("gpu-node-7", 1) == "gpu-node-7/ffff:00:01"
    # node names up to 253 characters (a DNS-1123 subdomain: labels of at most 63); GPU_UUID_MAX is 96
    a, b = (".".join(["n" * 63] * 3 + ["n" * 58 + end]) for end in ("-a", "-b"))
    assert len(a) == 252
    ka, kb = unidentified_key(a, 3), unidentified_key(b, 3)
    assert len(ka) <= GPU_UUID_MAX and len(kb) <= GPU_UUID_MAX and ka != kb and ka.endswith("/ffff:00:03")
    GpuSample(ts=T0, node=a, gpu_uuid=ka, gpu_index=3, pci_bus_id=unidentified_pci(3), status="lost")


def test_a_gpu_refused_at_start_and_known_from_the_saved_inventory_is_published_once(tmp_path):
    """Saved from an earlier run: published under its UUID as before, not a second time by index."""
    from prometheus_client import generate_latest

    gpus = [FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0")]
    first, _ = _rig_saved(tmp_path, FakePynvml(gpus), [0.0])
    first.stop()
    gpus[1].status = "lost"
    c, sink = _rig_saved(tmp_path, FakePynvml(gpus), [0.0])
    c.tick(T0)
    assert [r.gpu_uuid for r in sink.records if isinstance(r, GpuSample) and r.status.value == "lost"] == ["GPU-bbbb"]
    body = generate_latest(c.metrics.registry).decode()
    assert 'xidstream_collector_lost_gpus{identity="saved"} 1.0' in body
    assert 'xidstream_collector_lost_gpus{identity="index"} 0.0' in body
    c.stop()


# -- the reset handshake: planned, quiet ---------------------------------------------------------------
def _release_rig(tmp_path, nvml):
    from xidstream.collectors.nvml import NvmlRelease

    clock = [1000.0]
    rel = NvmlRelease(tmp_path / "collector", clock=lambda: clock[0])
    sink = MemorySink()
    c = Collector(CollectorConfig(node="n", kmsg_wall_clock=False), sink, nvml=nvml, kernel=MemoryKernelSource(),
                  nvml_events_thread=False, state_dir=tmp_path / "collector", nvml_release=rel,
                  clock=lambda: clock[0])
    c.start(T0)
    executor = NvmlRelease(tmp_path / "collector", clock=lambda: clock[0])  # the node executor's view
    return c, sink, executor, clock


@pytest.mark.parametrize("nvml", ["none", "unavailable"])
def test_a_collector_without_nvml_acknowledges_a_release_request(tmp_path, caplog, nvml):
    """`collect --no-nvml` (or NVML that failed to start) holds no NVML handle: it has nothing to
    release and says so at once, so the node executor does not wait it out and fail the reset."""
    import logging

    reader = None if nvml == "none" else NvmlReader(FakePynvml([], available=False))
    c, sink, executor, clock = _release_rig(tmp_path, reader)
    c.tick(T0)
    executor.request("GPU-bbbb", command_id="cmd-1", hold_s=60)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="collectors"):
        for i in range(3):
            clock[0] += 1
            c.tick(T0)
    ack = executor.wait_released("GPU-bbbb", 0)
    assert ack is not None and ack["gpu_uuid"] == "GPU-bbbb" and ack["held_nvml"] is False
    said = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(said) == 1 and said[0].levelno < logging.ERROR and "GPU-bbbb" in said[0].getMessage()
    assert [type(r).__name__ for r in sink.records] == []  # nothing else changes without NVML
    executor.done("GPU-bbbb")
    clock[0] += 1
    c.tick(T0)
    # an abandoned request expires; its acknowledgement is cleared with it
    executor.request("GPU-aaaa", hold_s=5)
    clock[0] += 1
    c.tick(T0)
    assert executor.wait_released("GPU-aaaa", 0) is not None
    clock[0] += 10
    c.tick(T0)
    assert list((tmp_path / "collector" / "nvml-release").glob("*.released")) == []
    c.stop()


def test_a_planned_release_on_an_8_gpu_node_logs_one_line_per_step_and_no_error(tmp_path, caplog):
    import logging

    fake = FakePynvml([FakeGpu(i, f"GPU-{i:04d}", f"00000000:{i + 1:02x}:00.0") for i in range(8)])
    c, sink, executor, clock = _release_rig(tmp_path, NvmlReader(fake))
    c.tick(T0)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="collectors"):
        executor.request("GPU-0003", command_id="cmd-1", hold_s=60)
        clock[0] += 1
        c.tick(T0)
        assert executor.wait_released("GPU-0003", 0) is not None and not fake.initialized
        released = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert len(released) == 1 and "released" in released[0].getMessage()
        clock[0] += 1
        c.tick(T0)
        caplog.clear()
        executor.done("GPU-0003")
        clock[0] += 1
        c.tick(T0)
        assert fake.initialized
        resumed = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert len(resumed) == 1 and "taken up again" in resumed[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    c.stop()


def test_a_gpu_already_lost_before_a_planned_release_is_not_announced_again(tmp_path, caplog):
    import logging

    fake = FakePynvml([FakeGpu(i, f"GPU-{i:04d}", f"00000000:{i + 1:02x}:00.0") for i in range(3)])
    c, sink, executor, clock = _release_rig(tmp_path, NvmlReader(fake))
    fake.gpu(2).status = "reset_required"  # known before the release: said once already
    c.tick(T0)
    with caplog.at_level(logging.DEBUG, logger="collectors"):
        caplog.clear()
        executor.request("GPU-0001", hold_s=60)
        clock[0] += 1
        c.tick(T0)
        executor.done("GPU-0001")
        fake.gpu(1).status = "lost"  # the reset went wrong: that one is news
        clock[0] += 1
        c.tick(T0)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "GPU-0001" in errors[0] and "lost" in errors[0]
    c.stop()


def test_an_unchanged_inventory_is_published_again_every_six_hours():
    """The processor forgets a node whose inventory it has not seen for a day (the fleet's size,
    and which nodes may have capacity taken without approval): a quiet node re-publishes."""
    from xidstream.collectors.agent import INVENTORY_HEARTBEAT_S

    sink = MemorySink()
    c, _, _, clock = _rig(sink)
    first = len([r for r in sink.records if isinstance(r, GpuInventory)])
    clock[0] = 61
    c.tick(T0 + timedelta(seconds=INVENTORY_HEARTBEAT_S - 1))
    assert len([r for r in sink.records if isinstance(r, GpuInventory)]) == first
    clock[0] = 122
    c.tick(T0 + timedelta(seconds=INVENTORY_HEARTBEAT_S))
    again = [r for r in sink.records if isinstance(r, GpuInventory)][first:]
    assert len(again) == first and all(r.ts == T0 + timedelta(seconds=INVENTORY_HEARTBEAT_S) for r in again)
