"""The processor's Prometheus /metrics on faust's web server (the chart probes and
scrapes it), with the motivating incident's records through a real worker."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from xidstream.collectors.sink import KafkaSink
from xidstream.runner import WorkerProcess
from tests.streams.builders import wedge

pytestmark = pytest.mark.broker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_count_what_the_worker_did(kafka_settings, tmp_path):
    port = _free_port()
    worker = WorkerProcess(kafka_settings, tmp_path, extra_args=["--web-port", str(port)]).start()
    try:
        sink = KafkaSink(kafka_settings, tmp_path / "spool")
        records = wedge()
        for r in records:
            sink.publish(r)
        assert sink.flush(30)
        sink.close()
        deadline, text = time.monotonic() + 90, ""
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3).read().decode()
            except OSError:
                text = ""
            counts = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
            if int(counts.get("xidstream_processor_events_total", 0)) >= len(records) and \
                    int(counts.get("xidstream_processor_commands_total", 0)) >= 3:
                break
            time.sleep(1)
        assert worker.alive(), worker.tail()
        assert "# TYPE xidstream_processor_events_total counter" in text, text or worker.tail()
        assert int(counts["xidstream_processor_events_total"]) >= len(records)
        assert int(counts["xidstream_processor_alerts_total"]) >= 2  # APP_FAULT, GPU_WEDGED
        assert int(counts["xidstream_processor_commands_total"]) >= 3  # cordon, drain, reset (and RECORD)
        # by verdict and action, what the chart's alert rules and dashboard read
        wedged = sum(int(v) for k, v in counts.items()
                     if k.startswith('xidstream_processor_verdict_alerts_total{classification="GPU_WEDGED",'))
        assert wedged >= 1, text
        assert int(counts['xidstream_processor_action_commands_total{action="RESET_GPU",held="false"}']) == 1, text
        assert counts["xidstream_processor_breaker_tripped"] == "0"
        live = urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=3)
        assert (live.status, live.read()) == (200, b"ok: folding records or idle\n")
    finally:
        worker.stop()
