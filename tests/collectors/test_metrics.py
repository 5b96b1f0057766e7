import socket
import urllib.request
from datetime import datetime, timezone

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakePynvml
from xidstream.collectors.metrics import CollectorMetrics
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.sink import MemorySink
from xidstream.collectors.sources.kernel import MemoryKernelSource


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_self_metrics_are_served_on_loopback():
    metrics = CollectorMetrics()
    port = _free_port()
    metrics.serve(port)  # default address: 127.0.0.1
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0")])
    kernel = MemoryKernelSource()
    c = Collector(CollectorConfig(node="n", xid_merge_window=0), MemorySink(), nvml=NvmlReader(fake), kernel=kernel,
                  metrics=metrics, nvml_events_thread=False)
    c.start(datetime.now(timezone.utc))
    kernel.feed(["NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m", "noise",
                 "NVRM: Xid (PCI:0000:01:00): 4242, pid=1, name=a, m"])
    fake.gpu(0).unsupported = set()
    fake.gpu(0).status = "lost"
    c.tick(datetime.now(timezone.utc))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "xidstream_collector_kernel_lines_total 3.0" in body
    assert 'xidstream_collector_kernel_records_total{kind="xid"} 2.0' in body
    # by code, a code outside NVIDIA's catalog as "other" (no label value per forged code)
    assert 'xidstream_collector_xids_total{xid="13"} 1.0' in body
    assert 'xidstream_collector_xids_total{xid="other"} 1.0' in body
    assert 'xidstream_collector_gpu_status{gpu_uuid="GPU-aaaa",status="lost"} 1.0' in body
    assert "xidstream_collector_loop_seconds_count 1.0" in body
    assert 'xidstream_collector_records_published{topic="memory"}' in body


# -- health endpoints: the kubelet's liveness (/healthz) and readiness (/readyz) probes -------------

import stat  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402

from xidstream.collectors.sources.kernel import JournalSource  # noqa: E402


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _served(metrics: CollectorMetrics) -> int:
    port = _free_port()
    metrics.serve(port)
    return port


def test_ready_only_after_a_tick_with_nvml_and_kernel_log_open():
    metrics = CollectorMetrics()
    port = _served(metrics)
    try:
        fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0")])
        c = Collector(CollectorConfig(node="n"), MemorySink(), nvml=NvmlReader(fake), kernel=MemoryKernelSource(),
                      metrics=metrics, nvml_events_thread=False)
        assert _get(port, "/healthz")[0] == 200          # just started: alive
        status, body = _get(port, "/readyz")
        assert status == 503 and "no collection tick yet" in body
        c.start(datetime.now(timezone.utc))
        c.tick(datetime.now(timezone.utc))
        status, body = _get(port, "/readyz")
        assert status == 200, body
        assert "nvml: up" in body and "kernel_log: up" in body
        text = _get(port, "/metrics")[1]
        assert 'xidstream_collector_source_up{source="nvml"} 1.0' in text
        assert 'xidstream_collector_source_up{source="kernel_log"} 1.0' in text
    finally:
        metrics.close()


def test_nvml_unavailable_is_alive_but_not_ready_and_says_why():
    metrics = CollectorMetrics()
    port = _served(metrics)
    try:
        fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0")])
        fake.available = False                           # nvmlInit fails (no driver library, no device)
        c = Collector(CollectorConfig(node="n"), MemorySink(), nvml=NvmlReader(fake), kernel=MemoryKernelSource(),
                      metrics=metrics, nvml_events_thread=False)
        c.start(datetime.now(timezone.utc))
        c.tick(datetime.now(timezone.utc))
        assert _get(port, "/healthz")[0] == 200          # the kernel log is still read: no restart loop
        status, body = _get(port, "/readyz")
        assert status == 503
        assert "nvml: down (NVML could not be initialised" in body and "kernel_log: up" in body
        assert 'xidstream_collector_source_up{source="nvml"} 0.0' in _get(port, "/metrics")[1]
    finally:
        metrics.close()


def test_without_nvml_asked_for_readiness_needs_only_the_kernel_log():
    metrics = CollectorMetrics()
    c = Collector(CollectorConfig(node="n"), MemorySink(), kernel=MemoryKernelSource(), metrics=metrics)
    c.start(datetime.now(timezone.utc))
    c.tick(datetime.now(timezone.utc))
    ok, body = metrics.readiness()
    assert ok, body
    assert "nvml" not in body


def test_a_hung_loop_fails_liveness():
    now = [1000.0]
    metrics = CollectorMetrics(stale_after=60, clock=lambda: now[0])
    port = _served(metrics)
    try:
        c = Collector(CollectorConfig(node="n"), MemorySink(), kernel=MemoryKernelSource(), metrics=metrics)
        c.start(datetime.now(timezone.utc))
        c.tick(datetime.now(timezone.utc))
        now[0] += 59
        assert _get(port, "/healthz")[0] == 200
        now[0] += 2                                      # no tick for 61 s
        status, body = _get(port, "/healthz")
        assert status == 503 and "last tick 61.0 s ago" in body
        assert _get(port, "/readyz")[0] == 503
    finally:
        metrics.close()


def test_journalctl_exiting_makes_the_kernel_log_down(tmp_path):
    # A journalctl that prints one kernel record and exits 1, as the real one does when it cannot
    # read the journal files (e.g. the host's journal not mounted).
    exe = tmp_path / "journalctl"
    exe.write_text('#!/bin/sh\necho \'{"__CURSOR":"s=1","__REALTIME_TIMESTAMP":"1","MESSAGE":"hello"}\'\nexit 1\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    # journal_dirs=None: this is about the exit; whether the host keeps journal files is another test
    source = JournalSource(tmp_path / "cursor.json", journalctl=str(exe), journal_dirs=None)
    metrics = CollectorMetrics()
    c = Collector(CollectorConfig(node="n"), MemorySink(), kernel=source, metrics=metrics)
    c.start(datetime.now(timezone.utc))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        c.tick(datetime.now(timezone.utc))
        if source.failed:
            c.tick(datetime.now(timezone.utc))
            break
        time.sleep(0.05)
    ok, body = metrics.readiness()
    assert not ok
    assert "kernel_log: down (journalctl exited with status 1)" in body
    c.stop()


def test_a_journal_mode_collector_without_journal_files_is_not_ready(tmp_path):
    """With the chart's journal mode on a host that keeps no journal (the hostPath folders
    are created empty), `journalctl -f` runs forever printing nothing, and the collector said
    Ready while reading nothing. Readiness now means a journal to read."""
    exe = tmp_path / "journalctl"
    exe.write_text("#!/bin/sh\nexec sleep 30\n")  # what the real one does there: waits, prints nothing
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    persistent, volatile = tmp_path / "var-log-journal", tmp_path / "run-log-journal"
    persistent.mkdir()
    volatile.mkdir()
    source = JournalSource(tmp_path / "cursor.json", journalctl=str(exe),
                           journal_dirs=(str(persistent), str(volatile)))
    metrics = CollectorMetrics()
    c = Collector(CollectorConfig(node="n"), MemorySink(), kernel=source, metrics=metrics)
    try:
        c.start(datetime.now(timezone.utc))
        c.tick(datetime.now(timezone.utc))
        ok, body = metrics.readiness()
        assert not ok
        assert f"kernel_log: down (no journal files under {persistent} or {volatile}" in body
        (volatile / "0123456789abcdef").mkdir()
        (volatile / "0123456789abcdef" / "system.journal").write_bytes(b"LPKSHHRH")
        c.tick(datetime.now(timezone.utc))
        ok, body = metrics.readiness()
        assert "kernel_log: down" not in body
    finally:
        c.stop()
