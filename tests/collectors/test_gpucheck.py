import io

from collectors.fakes import FakeGpu, FakePynvml
from collectors.gpucheck import run_gpu_check
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
