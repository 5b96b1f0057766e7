import io

from xidstream.collectors.fakes import FakeGpu, FakePynvml
from xidstream.collectors.gpucheck import run_gpu_check
from xidstream.cli import main


def test_gpu_check_prints_every_field_through_a_pynvml_surface():
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="123")])
    assert run_gpu_check(fake, out, wait_events=0.01) == 0
    text = out.getvalue()
    for field in ("utilization_gpu_pct", "memory_used_mib", "power_w", "sm_clock_mhz", "mem_clock_mhz",
                  "temperature_c", "pci_bus_id", "'0000:01:00'", "Xid event registration: ok"):
        assert field in text


def test_gpu_check_without_a_driver_says_so():
    out = io.StringIO()
    assert run_gpu_check(FakePynvml([], available=False), out) == 1
    assert "NVML unavailable" in out.getvalue()


def test_gpu_check_command_on_a_machine_without_a_gpu_says_so(capsys):
    import pynvml
    import pytest

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a GPU: run `xidstream gpu-check` instead")
    # No GPU and no driver: the real pynvml path must fail clearly, not crash.
    assert main(["gpu-check", "--wait-events", "0"]) == 1
    assert "NVML unavailable" in capsys.readouterr().out


def test_gpu_check_on_a_gpu_lost_at_start_prints_it_as_lost():
    """Defect 1: a GPU that refuses a handle is printed as lost, exit code 3 (faults found)."""
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", status="lost")])
    assert run_gpu_check(fake, out, wait_events=0.01) == 3
    text = out.getvalue()
    assert "GPU 1: lost" in text and "GPU is lost" in text


def test_gpu_check_on_a_gpu_lost_during_the_check_has_no_traceback():
    """Defect 1: the raw busId read of a GPU that falls off the bus mid-check is wrapped."""
    out = io.StringIO()
    gpu = FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", lose_on_call=("nvmlDeviceGetPciInfo_v3", 2))
    assert run_gpu_check(FakePynvml([gpu]), out, wait_events=0.01) == 3
    text = out.getvalue()
    assert "status=lost" in text and "raw busId" in text


def test_gpu_check_reports_every_new_field():
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="1", memory_reserved_mib=300,
                               recovery_action=0, remapped_rows=(0, 0, 0, 0), ecc_dbe_volatile=0)])
    assert run_gpu_check(fake, out, wait_events=0.01) == 0
    text = out.getvalue()
    for field in ("memory_reserved_mib", "recovery_action", "remapped_rows_correctable", "remapped_rows_uncorrectable",
                  "remapped_rows_pending", "remapped_rows_failure", "ecc_dbe_volatile", "memory_info_version",
                  "recovery action events"):
        assert field in text, field


def test_gpu_check_on_a_driver_without_compute_processes_v3_falls_back_and_exits_0():
    """R470 has no nvmlDeviceGetComputeRunningProcesses_v3: the unversioned pynvml call raises
    NVMLLibraryMismatchError; gpu-check reads _v2 instead, no traceback."""
    from xidstream.collectors.fakes import FakeProcess

    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="1", processes=[FakeProcess(4242, used_memory_mib=100)])],
                      driver_version="470.256.02", compute_versions=(2,))
    assert run_gpu_check(fake, out, wait_events=0.01) == 0
    assert "[(4242, 100.0)]" in out.getvalue()


def test_gpu_check_on_a_driver_without_any_versioned_compute_call_says_not_supported():
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="1")], compute_versions=())
    assert run_gpu_check(fake, out, wait_events=0.01) == 0  # not supported is an answer, not a fault
    (line,) = [ln for ln in out.getvalue().splitlines() if "compute apps" in ln]
    assert "unknown (not supported" in line


def test_gpu_check_on_healthy_gpus_whose_pmon_probe_answers_success_exits_0():
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="1")], pmon_no_sample=0)
    assert run_gpu_check(fake, out, wait_events=0.01) == 0
    assert "NVML errors other than NotSupported/NotFound/NoData: 0" in out.getvalue()


def test_gpu_check_shows_every_pending_xid_event():
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="1"),
                       FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", serial="2")])
    for ref, xid in ((0, 13), (1, 31), (0, 43)):
        fake.inject_xid(ref, xid)
    run_gpu_check(fake, out, wait_events=0.01)
    text = out.getvalue()
    for uuid, xid in (("GPU-aaaa", 13), ("GPU-bbbb", 31), ("GPU-aaaa", 43)):
        assert f"uuid='{uuid}'" in text and f"xid={xid}," in text, (uuid, xid)
    assert text.count("xid=") == 3


def test_gpu_check_prints_every_counter_and_what_the_board_does_not_support():
    from xidstream.collectors.fakes import FakeFabric, FakeNvLink
    from xidstream.collectors.nvml import COUNTER_FIELDS

    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", nvlinks=[FakeNvLink(recovery=505)],
                               fabric=FakeFabric("5f0c3a8e-1b2d-4c6e-9a7f-0d1e2f3a4b5c", 7)),
                       FakeGpu(1, "GPU-bbbb", "00000000:02:00.0", retired_pages=None)])
    assert run_gpu_check(fake, out, wait_events=0.01) == 0
    text = out.getvalue()
    assert text.count("counters (first read") == 2 and "link  0 active=True replay_errors=0 recovery_errors=505" in text
    for section in text.split("counters (first read")[1:]:
        for field in COUNTER_FIELDS:
            assert f"\n    {field} " in section.split("\nGPU ")[0].split("\nXid event")[0], field
    assert "fabric_cluster_uuid          '5f0c3a8e-1b2d-4c6e-9a7f-0d1e2f3a4b5c'" in text
    assert "unsupported                  none" in text
    assert "unsupported                  fabric, nvlink, retired_pages_double_bit" in text


def test_gpu_check_counts_a_failed_counter_read_as_a_fault():
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", errors={"nvmlDeviceGetPcieReplayCounter": 999})])
    assert run_gpu_check(fake, out, wait_events=0.01) == 3
    assert "pcie_replay_count            None" in out.getvalue()


def test_gpu_check_initialises_nvml_again_as_the_release_for_a_reset_does():
    """The collector shuts NVML down for a GPU reset and initialises it again in the same process:
    gpu-check runs that path on the machine's driver and shows that a recovery action known only
    from an event is not carried across it."""
    out = io.StringIO()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", serial="1", recovery_action=None)])
    fake.inject_recovery_action(0, 1)  # by event only: the field is not readable on this board
    assert run_gpu_check(fake, out, wait_events=0.01) == 0
    text = out.getvalue()
    assert "recovery_action=1" in text  # the event, as it came
    assert "re-initialisation (the collector's release for a reset)" in text and "the same GPUs" in text
    assert "GPU 0: recovery_action None (read now" in text
    assert fake.calls["nvmlInit"] == 2 and not fake.initialized
