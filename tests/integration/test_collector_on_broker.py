"""The collector against the real broker: a scenario's records published, and the spool keeping
every record (Xids, samples, counters) through a broker outage."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakeNvLink, FakePynvml
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.sink import KafkaSink
from xidstream.collectors.sources.kernel import MemoryKernelSource
from xidstream.schemas import decode_any
from xidstream.cli import main as cli
from xidstream.transport.kafka import create_topics, read_all
from xidstream.settings import Settings

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]


def test_collect_scenario_publishes_to_the_broker(kafka_settings, tmp_path, capsys):
    s = kafka_settings
    rc = cli(["collect", "--scenario", str(ROOT / "scenarios" / "motivating-incident.yaml"),
              "--bootstrap", s.bootstrap, "--topic-prefix", s.topic_prefix, "--state-dir", str(tmp_path)])
    assert rc == 0
    reg = s.topics
    msgs = read_all(s, [reg.name(t) for t in ("gpu.xid", "gpu.workloads", "gpu.inventory")], expected=13, timeout=30)
    by_topic = {}
    for m in msgs:
        by_topic.setdefault(m.topic(), []).append(decode_any(m.value()))
    xids = by_topic[reg.name("gpu.xid")]
    assert [x.xid for x in xids if x.kind == "xid"] == [13, 13, 13, 31, 43]
    assert {m.key() for m in msgs if m.topic() == reg.name("gpu.xid")} == {
        b"GPU-3f1a9c2e-7b44-4d1e-9e0a-5c2b8d7f6a10", b"GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"}
    assert [w.event.value for w in by_topic[reg.name("gpu.workloads")]] == ["failed", "started", "failed"]
    assert len(by_topic[reg.name("gpu.inventory")]) == 2
    assert "published" in capsys.readouterr().err


@pytest.fixture
def own_broker(tmp_path):
    """A second broker of our own, so that stopping it does not disturb the session's."""
    from workshop.localbroker import LocalBroker

    broker = LocalBroker(port=19192, controller_port=19193, state_dir=tmp_path / "broker")
    broker.start()
    yield broker
    broker.stop()


@pytest.mark.broker
@pytest.mark.slow
def test_spool_keeps_every_record_through_a_broker_outage(own_broker, tmp_path):
    settings = Settings(bootstrap=own_broker.bootstrap, topic_prefix="spool.", partitions=4, node="node-a")
    create_topics(settings)
    fake = FakePynvml([FakeGpu(i, f"GPU-{i:04d}", f"00000000:{i + 1:02x}:00.0", nvlinks=[FakeNvLink(recovery=i)])
                       for i in range(4)])
    kernel = MemoryKernelSource()
    sink = KafkaSink(settings, tmp_path / "spool", producer_overrides={"reconnect.backoff.max.ms": 500})
    ticks = 0
    # the loop's clock counts ticks: counters at ticks 1, 11, ..., 71, four of them while the broker is away
    c = Collector(CollectorConfig(node="node-a", xid_merge_window=0, counters_interval=10), sink,
                  nvml=NvmlReader(fake), kernel=kernel, nvml_events_thread=False, clock=lambda: float(ticks))
    c.start(datetime.now(timezone.utc))

    def run(n):
        nonlocal ticks
        for _ in range(n):
            ticks += 1
            kernel.feed([f"NVRM: Xid (PCI:0000:0{ticks % 4 + 1}:00): 13, pid={ticks}, name=t, tick {ticks}"])
            c.tick(datetime.now(timezone.utc))
            time.sleep(0.05)

    run(20)
    assert sink.flush(20)
    own_broker.stop()
    run(40)  # broker away: everything goes to the spool
    depth = sink.stats()["spool_depth"]
    assert depth["critical"] >= 40 and depth["telemetry"] >= 40 * 8
    own_broker.start()
    run(20)
    assert sink.flush(60), sink.stats()
    sink.close()

    xid_topic = settings.topics.name("gpu.xid")
    msgs = read_all(settings, [xid_topic], expected=80, timeout=60)
    pids = [decode_any(m.value()).pid for m in msgs]
    assert sorted(pids) == list(range(1, 81))  # every record arrived, once
    per_key: dict = {}
    for m in msgs:
        per_key.setdefault(m.key(), []).append(decode_any(m.value()).pid)
    assert all(v == sorted(v) for v in per_key.values())  # in order per key
    samples = read_all(settings, [settings.topics.name("gpu.samples")], expected=80 * 4, timeout=60)
    assert len(samples) == 80 * 4 and len({decode_any(m.value()).event_id for m in samples}) == 320
    counters = read_all(settings, [settings.topics.name("gpu.counters")], expected=8 * 4, timeout=60)
    assert len(counters) == 8 * 4 and len({decode_any(m.value()).event_id for m in counters}) == 32
    for m in counters:
        rec = decode_any(m.value())
        assert m.key() == rec.gpu_uuid.encode() and rec.nvlinks[0].recovery_errors == int(rec.gpu_uuid[-1])
