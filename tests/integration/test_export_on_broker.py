"""`xidstream export` on the real broker: findings out as OCSF/ECS, telemetry landed as Parquet and
read back with pyarrow and DuckDB, and a SIGKILLed exporter restarted loses no record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import duckdb
import orjson
import pyarrow.dataset as ds
import pytest
from confluent_kafka import Producer

from xidstream.exporters.parquet import TELEMETRY_TOPICS
from xidstream.exporters.pipeline import Exporter, KafkaTopicSink, ParquetSink
from xidstream.exporters.parquet import ParquetLander
from xidstream.schemas import GpuProcesses, GpuSample, WorkloadEvent, WorkloadEventType, XidEvent, XidSource
from xidstream.schemas.codec import encode
from xidstream.schemas.topics import spec_for_model
from tests.exporters.helpers import alerts, commands_and_results, ocsf_errors
from tests.factories import T0
from xidstream.schemas.errors import ConfigError
from xidstream.transport.kafka import admin, producer_config, read_all
from confluent_kafka.admin import NewTopic

pytestmark = pytest.mark.broker
ROOT = Path(__file__).resolve().parents[2]


def _produce(settings, records) -> None:
    p = Producer(producer_config(settings))
    for r in records:
        spec = spec_for_model(type(r))
        while True:
            try:
                p.produce(settings.topics.name(spec.name), encode(r), key=spec.key_for(r))
                break
            except BufferError:
                p.poll(0.1)
        p.poll(0)
    assert p.flush(60) == 0


def _telemetry(n_samples: int) -> list:
    out = []
    for i in range(n_samples):
        g = f"GPU-{i % 16:08d}-0000-0000-0000-000000000000"
        ts = T0 + timedelta(seconds=i)
        out.append(GpuSample(ts=ts, node=f"node-{i % 4}", gpu_uuid=g, gpu_index=i % 8, pci_bus_id="0000:01:00",
                             utilization_gpu_pct=50.0, power_w=200.0))
        if i % 50 == 0:
            out.append(XidEvent(ts=ts, node=f"node-{i % 4}", gpu_uuid=g, xid=13, source=XidSource.kmsg, resolved=True))
            out.append(GpuProcesses(ts=ts, node=f"node-{i % 4}", gpu_uuid=g))
            out.append(WorkloadEvent(ts=ts, node=f"node-{i % 4}", gpu_uuid=g, event=WorkloadEventType.failed))
    return out


def _counts(records) -> dict[str, int]:
    c: dict[str, int] = {}
    for r in records:
        t = spec_for_model(type(r)).name
        c[t] = c.get(t, 0) + 1
    return c


@pytest.mark.slow
def test_findings_exported_to_a_kafka_topic_as_valid_ocsf(kafka_settings):
    from xidstream.exporters import ocsf

    produced = alerts() + commands_and_results()
    _produce(kafka_settings, produced)
    recs = [r for r in produced if ocsf.to_ocsf(r) is not None]  # RECORD commands and their results map to none
    out_topic = kafka_settings.topics.name("gpu.alerts") + ".ocsf"
    with pytest.raises(ConfigError, match="does not exist"):
        KafkaTopicSink(kafka_settings, out_topic)
    client = admin(kafka_settings)
    client.create_topics([NewTopic(out_topic, num_partitions=3, replication_factor=1)])[out_topic].result(30)
    time.sleep(1.0)
    exporter = Exporter("ocsf", KafkaTopicSink(kafka_settings, out_topic))
    stats = exporter.run_kafka(kafka_settings, f"{kafka_settings.topic_prefix}export-test", telemetry=False,
                               idle_exit=3.0)
    assert stats.exported == len(recs)
    msgs = read_all(kafka_settings, [out_topic], expected=len(recs), timeout=30)
    events = [orjson.loads(m.value()) for m in msgs]
    assert sorted(e["metadata"]["original_event_uid"] for e in events) == sorted(r.event_id for r in recs)
    # each document's Kafka timestamp is its event's time (what a Splunk connector takes as it)
    by_id = {r.event_id: r for r in recs}
    assert all(m.timestamp()[1] == int(by_id[orjson.loads(m.value())["metadata"]["original_event_uid"]].ts.timestamp() * 1000)
               for m in msgs)
    assert all(ocsf_errors(e) == [] for e in events)
    # the group committed: a second run finds nothing new
    again = Exporter("ocsf", KafkaTopicSink(kafka_settings, out_topic)).run_kafka(
        kafka_settings, f"{kafka_settings.topic_prefix}export-test", telemetry=False, idle_exit=3.0)
    assert again.consumed == 0


def _read_back(root: Path, table: str) -> tuple[int, int, int, int]:
    """(rows, distinct event_ids) with pyarrow, and the same with DuckDB. A table whose folder holds
    only a file still being written (hidden, `.part-*.tmp`: what a kill can leave) has no rows."""
    if not list((root / f"topic={table}").glob("dt=*/hour=*/[!.]*.parquet")):
        return 0, 0, 0, 0
    t = ds.dataset(root / f"topic={table}", format="parquet", partitioning="hive").to_table(columns=["event_id"])
    ids = t.column("event_id").to_pylist()
    glob = f"{root}/topic={table}/dt=*/hour=*/*.parquet"
    (n, d), = duckdb.sql(f"select count(*), count(distinct event_id) from read_parquet('{glob}', "
                         "hive_partitioning=true)").fetchall()
    return len(ids), len(set(ids)), n, d


def test_telemetry_landed_as_parquet_row_counts_equal_records_produced(kafka_settings, tmp_path):
    recs = _telemetry(3000)
    _produce(kafka_settings, recs + alerts())
    lander = ParquetLander(tmp_path, max_bytes=256 << 10, max_seconds=2)
    stats = Exporter("ecs", ParquetSink(lander, "ecs"), lander=lander).run_kafka(
        kafka_settings, f"{kafka_settings.topic_prefix}export-pq", telemetry=True, idle_exit=3.0)
    assert stats.files > 4  # rolled by size
    for table, n in _counts(recs).items():
        assert _read_back(tmp_path, table) == (n, n, n, n), table
    assert _read_back(tmp_path, "findings.ecs") == (len(alerts()),) * 4
    per_model = duckdb.sql(f"select x.xid, count(*) from read_parquet('{tmp_path}/topic=gpu.xid/*/*/*.parquet', "
                           "hive_partitioning=true) x group by x.xid").fetchall()
    assert per_model == [(13, 60)]


def _export_proc(settings, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "xidstream.cli", "export", "--to", f"parquet:{out}", "--bootstrap", settings.bootstrap,
           "--topic-prefix", settings.topic_prefix, "--roll-mb", "0.1", "--roll-seconds", "1", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_a_killed_exporter_restarted_loses_no_record(kafka_settings, tmp_path):
    recs = _telemetry(20000)
    _produce(kafka_settings, recs)
    want = _counts(recs)
    proc = _export_proc(kafka_settings, tmp_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(tmp_path.rglob("*.parquet"))) < 5:
        time.sleep(0.05)
    landed_before = len(list(tmp_path.rglob("*.parquet")))
    proc.send_signal(signal.SIGKILL)  # mid-run: files landed, later batches buffered, offsets partly committed
    proc.wait(10)
    assert landed_before >= 5, proc.stderr.read().decode()[-2000:]
    before = sum(_read_back(tmp_path, t)[1] for t in TELEMETRY_TOPICS if (tmp_path / f"topic={t}").exists())
    assert before < len(recs), "the exporter had finished before it was killed: nothing tested"
    proc = _export_proc(kafka_settings, tmp_path, "--idle-exit", "4")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()[-2000:]
    for table, n in want.items():
        rows, distinct, d_rows, d_distinct = _read_back(tmp_path, table)
        assert distinct == d_distinct == n, table  # nothing lost
        assert rows == d_rows >= n  # at-least-once: duplicates only of what was not yet committed
    assert not list(tmp_path.rglob("*.tmp")) or all(p.name.startswith(".") for p in tmp_path.rglob("*.tmp"))


@pytest.mark.slow
def test_a_document_over_the_topics_size_limit_is_shrunk_or_skipped_and_the_export_goes_on(kafka_settings, capfd):
    """A document bigger than the output topic takes killed the exporter (MSG_SIZE_TOO_LARGE failed
    durable()), and its uncommitted offset killed the restarted one again. Now it is shrunk (its
    timeline cut) or, too big however cut, skipped with an error naming it; the rest goes on and
    the group commits."""
    import base64

    from xidstream.schemas import EvidenceEntry

    def noise(n: int) -> str:  # incompressible: the broker's limit applies to the lz4 batch
        return base64.b64encode(os.urandom(n)).decode()

    small = alerts()[:6]
    a = small[0]
    timeline = [EvidenceEntry(ts=a.ts + timedelta(milliseconds=i), kind="xid", summary=noise(150), data={"xid": 13})
                for i in range(2000)]
    long_timeline = a.model_copy(update={"alert_id": "big-timeline", "event_id": "ev-big-timeline",
                                         "evidence": a.evidence.model_copy(update={"timeline": timeline})})
    # 300 steps of 1,000 random characters stay about 300 kB however cut
    uncuttable = a.model_copy(update={"alert_id": "big-steps", "event_id": "ev-big-steps",
                                      "recommended_steps": [noise(750) for _ in range(300)]})
    recs = small[:3] + [long_timeline, uncuttable] + small[3:]
    _produce(kafka_settings, recs)
    out_topic = kafka_settings.topics.name("gpu.alerts") + ".ocsf"
    client = admin(kafka_settings)
    client.create_topics([NewTopic(out_topic, num_partitions=1, replication_factor=1,
                                   config={"max.message.bytes": "65536"})])[out_topic].result(30)
    deadline = time.monotonic() + 30  # until it has a leader
    while time.monotonic() < deadline and any(
            t.error or any(p.leader < 0 for p in t.partitions.values())
            for t in [client.list_topics(out_topic, timeout=10).topics[out_topic]]):
        time.sleep(0.2)
    group = f"{kafka_settings.topic_prefix}export-size"
    exporter = Exporter("ocsf", KafkaTopicSink(kafka_settings, out_topic))
    stats = exporter.run_kafka(kafka_settings, group, telemetry=False, idle_exit=3.0)
    assert (stats.consumed, stats.truncated, stats.too_large) == (len(recs), 1, 1)
    assert "too large (skipped)" in stats.line()
    assert "skipped the document of event ev-big-steps" in capfd.readouterr().err
    msgs = read_all(kafka_settings, [out_topic], expected=len(recs) - 1, timeout=30)
    docs = {orjson.loads(m.value())["metadata"]["original_event_uid"]: orjson.loads(m.value()) for m in msgs}
    assert set(docs) == {r.event_id for r in recs} - {"ev-big-steps"}
    cut = docs["ev-big-timeline"]["unmapped"]
    assert cut["truncated"] is True and len(cut.get("timeline", [])) <= 5
    assert not any("truncated" in d["unmapped"] for uid, d in docs.items() if uid != "ev-big-timeline")
    # committed past both: a restart has nothing to read, and nothing to die on
    again = Exporter("ocsf", KafkaTopicSink(kafka_settings, out_topic)).run_kafka(
        kafka_settings, group, telemetry=False, idle_exit=3.0)
    assert again.consumed == 0
