"""NvmlReader over the pynvml look-alike: every contract field, and NVML errors as data."""

from __future__ import annotations

import pytest

from collectors.fakes import FakeGpu, FakeProcess, FakePynvml
from collectors.nvml import NvmlReader, NvmlUnavailable


def _fake(**kw) -> FakePynvml:
    return FakePynvml([
        FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", name="NVIDIA GeForce RTX 5090 D", **kw),
        FakeGpu(1, "GPU-bbbb", "00000000:17:00.0", serial="1650124014249"),
    ])


def test_identity_and_inventory():
    reader = NvmlReader(_fake())
    gpus = reader.init()
    assert [(g.index, g.uuid, g.pci_bus_id) for g in gpus] == [(0, "GPU-aaaa", "0000:01:00"), (1, "GPU-bbbb", "0000:17:00")]
    assert gpus[0].serial is None and gpus[1].serial == "1650124014249"  # NotSupported -> null
    assert (gpus[0].driver_version, gpus[0].cuda_version, gpus[0].memory_total_mib) == ("590.44.01", "13.1", 32607)
    assert reader.error_count == 0


def test_sample_reads_every_field():
    fake = _fake()
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    g = fake.gpu(0)
    g.utilization_gpu_pct, g.memory_used_mib, g.power_w, g.sm_clock_mhz, g.mem_clock_mhz, g.temperature_c = 100, 0, 110.25, 2407, 14001, 49
    s = reader.sample(gpu)
    assert s.status == "ok"
    assert s.values == {
        "utilization_gpu_pct": 100.0, "utilization_memory_pct": 0.0, "memory_used_mib": 0.0,
        "memory_total_mib": 32607.0, "power_w": 110.2, "sm_clock_mhz": 2407, "mem_clock_mhz": 14001,
        "temperature_c": 49,
    }


def test_not_supported_reads_are_null_not_errors():
    fake = _fake()
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    fake.gpu(0).unsupported = {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"}
    s = reader.sample(gpu)
    assert s.values["power_w"] is None and s.values["temperature_c"] is None
    assert s.values["sm_clock_mhz"] == 210 and s.status == "ok" and s.errors == 0


@pytest.mark.parametrize("status, text", [("lost", "GPU is lost"), ("reset_required", "GPU requires restart")])
def test_lost_or_reset_required_gpu_is_a_status_not_a_crash(status, text):
    fake = _fake()
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    fake.gpu(0).status = status
    s = reader.sample(gpu)
    assert (s.status, s.error) == (status, text)
    assert all(v is None for v in s.values.values())
    assert reader.compute_apps(gpu) is None and reader.pmon(gpu) == []
    # Inventory refresh keeps the lost GPU under its old identity.
    assert [g.uuid for g in reader.refresh_inventory()] == ["GPU-aaaa", "GPU-bbbb"]


def test_processes_and_pmon_cursor():
    fake = _fake()
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    fake.gpu(0).processes = [FakeProcess(4242, "python3", 20480, sm_util_pct=90), FakeProcess(7, "idle", None)]
    assert reader.compute_apps(gpu) == [(4242, 20480.0), (7, None)]
    assert reader.pmon(gpu) == [(4242, 90.0, 0.0)]
    assert reader.process_name(4242) == "python3" and reader.process_name(1) is None
    fake.gpu(0).processes = []
    assert reader.pmon(gpu) == []  # NotFound -> none, not an error
    assert reader.error_count == 0


def test_xid_events_map_to_the_gpu():
    fake = _fake()
    reader = NvmlReader(fake)
    reader.init()
    assert reader.register_xid_events()
    assert reader.wait_xid(10) is None  # Timeout is the normal case
    fake.inject_xid(1, 79)
    n = reader.wait_xid(100)
    assert (n.uuid, n.pci_bus_id, n.xid, n.gpu_instance) == ("GPU-bbbb", "0000:17:00", 79, None)


def test_no_driver_is_a_clear_error():
    with pytest.raises(NvmlUnavailable, match="NVML Shared Library Not Found"):
        NvmlReader(FakePynvml([], available=False)).init()


def test_fake_errors_behave_like_pynvml():
    fake = _fake()
    err = fake.NVMLError(15)
    assert isinstance(err, fake.NVMLError_GpuIsLost) and isinstance(err, fake.NVMLError) and err.value == 15
