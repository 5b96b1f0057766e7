"""NvmlReader over the pynvml look-alike: every contract field, and NVML errors as data."""

from __future__ import annotations

import pytest

from xidstream.collectors.fakes import FakeGpu, FakeProcess, FakePynvml
from xidstream.collectors.nvml import NvmlReader, NvmlUnavailable


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
        "temperature_c": 49, "memory_reserved_mib": 0.0, "recovery_action": 0, "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0, "remapped_rows_pending": False, "remapped_rows_failure": False,
        "ecc_dbe_volatile": 0,
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


def test_fake_errors_are_pynvml_errors():
    """The fake raises pynvml's own classes: what an `except` written for the real module catches."""
    import pynvml

    fake = _fake()
    assert fake.NVMLError is pynvml.NVMLError and fake.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    err = fake.NVMLError(15)
    assert isinstance(err, pynvml.NVMLError_GpuIsLost) and isinstance(err, pynvml.NVMLError) and err.value == 15
    fake.nvmlInit()
    fake.gpu(1).status = "reset_required"
    with pytest.raises(pynvml.NVMLError_ResetRequired) as raised:
        fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(1))
    assert (raised.value.value, str(raised.value)) == (pynvml.NVML_ERROR_RESET_REQUIRED, "GPU requires restart")
    fake.gpu(1).status = "lost"
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(1)  # real NVML refuses the handle of a GPU off the bus


# -- NVML and kernel-log defects ------------------------------------------------------------
def test_memory_from_the_v2_call_reports_reserved_separately():
    """Defect 4: v1's `used` includes what the driver reserves; v2 reports it apart."""
    fake = _fake(memory_used_mib=0, memory_reserved_mib=512)
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    assert gpu.memory_info_version == 2 and gpu.notes == ()
    s = reader.sample(gpu)
    assert (s.values["memory_used_mib"], s.values["memory_reserved_mib"]) == (0.0, 512.0)


def test_memory_falls_back_to_v1_with_a_note_when_the_driver_has_no_v2():
    fake = _fake(memory_used_mib=0, memory_reserved_mib=512, memory_v2=False)
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    assert gpu.memory_info_version == 1
    assert any("v1" in n and "reserved" in n for n in gpu.notes)
    s = reader.sample(gpu)
    assert (s.values["memory_used_mib"], s.values["memory_reserved_mib"]) == (512.0, None)
    assert reader.error_count == 0


def test_normal_absence_answers_are_not_counted_as_errors():
    """Defect 5: NotSupported / NoData / FunctionNotFound are normal on a healthy idle GPU."""
    fake = _fake()
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    g = fake.gpu(0)
    g.errors = {"nvmlDeviceGetProcessUtilization": 21, "nvmlDeviceGetPowerUsage": 21,
                "nvmlDeviceGetTemperature": 13, "nvmlDeviceGetRemappedRows": 3}
    for _ in range(3):
        s = reader.sample(gpu)
        assert reader.pmon(gpu) == []
    assert s.values["power_w"] is None and s.values["temperature_c"] is None and s.errors == 0
    assert reader.error_count == 0
    g.errors = {"nvmlDeviceGetClockInfo": 999}  # a real error still counts
    s = reader.sample(gpu)
    assert s.errors == 2 and reader.error_count == 2


def test_new_signals_recovery_action_remapped_rows_and_volatile_dbe():
    fake = _fake(recovery_action=1, remapped_rows=(3, 2, 1, 0), ecc_dbe_volatile=4)
    reader = NvmlReader(fake)
    s = reader.sample(reader.init()[0])
    assert {k: s.values[k] for k in ("recovery_action", "remapped_rows_correctable", "remapped_rows_uncorrectable",
                                     "remapped_rows_pending", "remapped_rows_failure", "ecc_dbe_volatile")} == {
        "recovery_action": 1, "remapped_rows_correctable": 3, "remapped_rows_uncorrectable": 2,
        "remapped_rows_pending": True, "remapped_rows_failure": False, "ecc_dbe_volatile": 4}


def test_new_signals_unsupported_are_null_never_an_error_count():
    fake = _fake(recovery_action=None, remapped_rows=None, ecc_dbe_volatile=None)  # e.g. a GeForce board
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    s = reader.sample(gpu)
    for k in ("recovery_action", "remapped_rows_correctable", "remapped_rows_uncorrectable",
              "remapped_rows_pending", "remapped_rows_failure", "ecc_dbe_volatile"):
        assert s.values[k] is None, k
    assert s.errors == 0 and reader.error_count == 0 and s.status == "ok"


def test_recovery_action_field_missing_from_an_older_pynvml_is_null():
    fake = _fake(recovery_action=2)
    del fake.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION  # nvidia-ml-py older than the field
    reader = NvmlReader(fake)
    s = reader.sample(reader.init()[0])
    assert s.values["recovery_action"] is None and reader.error_count == 0


def test_recovery_action_event_is_read_beside_xid_events():
    fake = _fake(recovery_action=None)  # the field is not readable, the event is
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    assert reader.register_xid_events()
    fake.inject_recovery_action(0, 2)
    n = reader.wait_xid(100)
    assert (n.uuid, n.recovery_action) == ("GPU-aaaa", 2)
    assert reader.sample(gpu).values["recovery_action"] == 2


def test_a_recovery_action_event_does_not_outlive_a_reinitialisation():
    """The event's action stands in for an unreadable NVML_FI_DEV_GET_GPU_RECOVERY_ACTION only
    within the NVML session that delivered it: after nvmlShutdown and nvmlInit (the collector's
    release for a GPU reset) a stale "reset required" must not keep the repaired GPU looking sick."""
    fake = _fake(recovery_action=None)  # the field is not readable, the event is
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    assert reader.register_xid_events()
    fake.inject_recovery_action(0, 1)  # NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert reader.wait_xid(100).recovery_action == 1
    reader.refresh_inventory()  # the same session: the event still stands
    assert reader.sample(gpu).values["recovery_action"] == 1
    reader.shutdown()
    gpu = reader.init()[0]
    assert reader.sample(gpu).values["recovery_action"] is None  # unknown, never the old session's 1


def test_a_gpu_that_refuses_a_handle_is_reported_as_refused():
    """Defect 2 (reader side): real NVML refuses a handle for a GPU that fell off the bus."""
    fake = _fake()
    fake.gpu(1).status = "lost"
    reader = NvmlReader(fake)
    assert [g.uuid for g in reader.init()] == ["GPU-aaaa"]
    assert reader.refused == {1: "GPU is lost"}


def test_the_fake_uses_only_the_real_pynvml_surface():
    """Keeps the look-alike honest: every pynvml function and constant the reader reaches through
    the fake exists in NVIDIA's pynvml with parameters of the same names (no GPU needed)."""
    import inspect

    import pynvml

    fake = FakePynvml([])
    for name in dir(fake):
        if not (name.startswith("nvml") or name.startswith("NVML")):
            continue
        assert hasattr(pynvml, name), f"pynvml has no {name}"
        ours = getattr(fake, name)
        if callable(ours) and not isinstance(ours, type):
            real = list(inspect.signature(getattr(pynvml, name)).parameters)
            mine = list(inspect.signature(ours).parameters)
            assert len(mine) == len(real), f"{name}{tuple(mine)} vs pynvml {tuple(real)}"
        elif isinstance(ours, int):
            assert getattr(pynvml, name) == ours, name
    assert "version" in inspect.signature(pynvml.nvmlDeviceGetMemoryInfo).parameters
    assert {"nvmlReturn", "valueType", "value"} <= {f for f, _ in pynvml.c_nvmlFieldValue_t._fields_}
    assert {"reserved", "used", "total"} <= {f for f, _ in pynvml.c_nvmlMemory_v2_t._fields_}


# -- every driver --------------------------------------------------------------------------------
class _StubNvmlLib:
    """Stands in for libnvidia-ml.so under the real pynvml: only the symbols named exist, as in a
    driver library that predates the others; each answers NVML_SUCCESS with nothing to report."""

    def __init__(self, *symbols: str) -> None:
        for name in symbols:
            setattr(self, name, lambda *args: 0)


def test_the_fake_raises_what_pynvml_raises_on_a_driver_without_compute_processes_v3(monkeypatch):
    """Pins the fake to nvidia-ml-py itself: on a driver library without the _v3 symbol (R470),
    the real pynvml's unversioned call raises NVMLLibraryMismatchError (a plain Exception), _v3
    raises NVMLError_FunctionNotFound, and _v2 answers; the fake does the same."""
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlLib", _StubNvmlLib("nvmlDeviceGetComputeRunningProcesses_v2",
                                                        "nvmlDeviceGetProcessUtilization"))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0")], compute_versions=(2,), pmon_no_sample=0)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    for module, handle in ((pynvml, None), (fake, h)):
        with pytest.raises(pynvml.NVMLLibraryMismatchError):
            module.nvmlDeviceGetComputeRunningProcesses(handle)
        with pytest.raises(module.NVMLError) as lookup:
            module.nvmlDeviceGetComputeRunningProcesses_v3(handle)
        assert type(lookup.value).__name__ == "NVMLError_FunctionNotFound" and lookup.value.value == 13
        assert module.nvmlDeviceGetComputeRunningProcesses_v2(handle) == []
        # the pmon size probe answering Success is raised as NVMLError(NVML_SUCCESS)
        with pytest.raises(module.NVMLError) as probe:
            module.nvmlDeviceGetProcessUtilization(handle, 0)
        assert probe.value.value == pynvml.NVML_SUCCESS
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)


@pytest.mark.parametrize("versions, v3_calls, v2_calls", [((3, 2), 3, 0), ((2,), 1, 3)])
def test_compute_apps_fall_back_through_the_versioned_calls(versions, v3_calls, v2_calls):
    """R510+ drivers have nvmlDeviceGetComputeRunningProcesses_v3; R470 and other pre-R510
    branches only _v2, where the unversioned pynvml call raises NVMLLibraryMismatchError."""
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", processes=[FakeProcess(4242, used_memory_mib=512)])],
                      compute_versions=versions)
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    for _ in range(3):
        assert reader.compute_apps(gpu) == [(4242, 512.0)]
    # a missing symbol is asked for once, not at every read
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == v3_calls
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == v2_calls
    assert reader.error_count == 0


def test_compute_apps_on_a_driver_without_any_versioned_call_are_unknown_not_supported():
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0")], compute_versions=())
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    assert reader.compute_apps(gpu) is None and reader.compute_apps(gpu) is None  # unknown, never []
    assert reader.last_error.startswith("not supported")
    assert reader.error_count == 0
    fake.compute_versions = (3, 2)  # a driver update: the next inventory refresh asks again
    reader.refresh_inventory()
    assert reader.compute_apps(gpu) == []


def test_pmon_probe_answering_success_is_no_sample_not_an_error():
    """pynvml's nvmlDeviceGetProcessUtilization raises NVMLError(NVML_SUCCESS) when the size probe
    finds no sample newer than the cursor: a healthy idle GPU, not an NVML error."""
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0")], pmon_no_sample=0)
    reader = NvmlReader(fake)
    gpu = reader.init()[0]
    for _ in range(5):
        assert reader.pmon(gpu) == []
    assert reader.error_count == 0


@pytest.mark.parametrize("status, gpu_kw", [
    ("lost", dict(lose_on_call=("nvmlDeviceGetName", 1))),  # falls off the bus mid-read
    ("reset_required", dict(status="reset_required", still_answers={"nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3"})),
])
def test_a_gpu_lost_or_needing_a_reset_during_the_inventory_read_is_not_ok(status, gpu_kw):
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="1", **gpu_kw),
                       FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", serial="2")])
    reader = NvmlReader(fake)
    a, b = reader.init()
    assert (a.uuid, a.pci_bus_id, a.status) == ("GPU-aaaa", "0000:01:00", status)
    assert a.name is None and any("inventory" in n for n in a.notes)
    assert b.status == "ok" and b.name == "NVIDIA GPU"
    assert reader.error_count == 0  # a health answer, said by the status, not counted as an error


def test_file_pynvml_follows_its_file_and_keeps_the_last_good_state(tmp_path):
    """`collect --fake-nvml FILE` (make e2e): the real NvmlReader over GPUs a JSON file describes;
    a rewrite shows at the next read, a torn or bad file keeps the last good state."""
    import json

    from xidstream.collectors.fakes import FilePynvml
    from xidstream.collectors.nvml import NvmlReader

    path = tmp_path / "fake-nvml.json"
    gpu = {"index": 0, "uuid": "GPU-e2e", "pci_bus_id": "00000000:3B:00.0", "utilization_gpu_pct": 40,
           "memory_used_mib": 900, "processes": [{"pid": 4242, "name": "python3", "used_memory_mib": 900}]}
    path.write_text(json.dumps({"gpus": [gpu]}))
    reader = NvmlReader(FilePynvml(str(path)))
    [ident] = reader.init()
    assert (ident.uuid, ident.pci_bus_id) == ("GPU-e2e", "0000:3b:00")
    first = reader.sample(ident).values
    assert first["utilization_gpu_pct"] == 40 and first["memory_used_mib"] == 900
    import os

    path.write_text(json.dumps({"gpus": [dict(gpu, utilization_gpu_pct=100, memory_used_mib=0, processes=[])]}))
    os.utime(path, ns=(1, 2))  # a new stamp even within the same mtime tick
    pinned = reader.sample(ident).values
    assert pinned["utilization_gpu_pct"] == 100 and pinned["memory_used_mib"] == 0
    path.write_text("{not json")
    assert reader.sample(ident).values["utilization_gpu_pct"] == 100  # the last good state
    assert reader.nvml.bad_reads >= 1
    empty = tmp_path / "empty.json"
    empty.write_text('{"gpus": []}')
    import pytest

    with pytest.raises(ValueError, match="no GPUs"):
        FilePynvml(str(empty))
