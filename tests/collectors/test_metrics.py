import socket
import urllib.request
from datetime import datetime, timezone

from collectors.agent import Collector, CollectorConfig
from collectors.fakes import FakeGpu, FakePynvml
from collectors.metrics import CollectorMetrics
from collectors.nvml import NvmlReader
from collectors.sink import MemorySink
from collectors.sources.kernel import MemoryKernelSource


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
    kernel.feed(["NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m", "noise"])
    fake.gpu(0).unsupported = set()
    fake.gpu(0).status = "lost"
    c.tick(datetime.now(timezone.utc))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "xidstream_collector_kernel_lines_total 2.0" in body
    assert 'xidstream_collector_kernel_records_total{kind="xid"} 1.0' in body
    assert 'xidstream_collector_gpu_status{gpu_uuid="GPU-aaaa",status="lost"} 1.0' in body
    assert "xidstream_collector_loop_seconds_count 1.0" in body
    assert 'xidstream_collector_records_published{topic="memory"}' in body
