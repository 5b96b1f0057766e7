"""`xidstream incidents` on the real broker: a bounded read of the contract topics from `--since`
(Kafka's time index) to the end offsets it found, no consumer group."""

from __future__ import annotations

import re
import time

import orjson
import pytest
from confluent_kafka import Producer

from xidstream.schemas.codec import encode
from xidstream.transport.kafka import producer_config
from tests.streams.builders import run, wedge
from xidstream.cli import main as cli

pytestmark = pytest.mark.broker


def test_incidents_reads_only_what_is_within_since_and_ends_by_itself(kafka_settings, capsys):
    engine = run(wedge())
    reg = kafka_settings.topics
    p = Producer(producer_config(kafka_settings))
    now_ms = int(time.time() * 1000)
    # an incident whose only alert was written 10 days ago (broker time): outside the default 7 days
    old = engine.alerts[0].model_copy(update={"incident_id": "old-incident-0001"})
    p.produce(reg.name("gpu.alerts"), encode(old), key=b"k", timestamp=now_ms - 10 * 86400 * 1000)
    for a in engine.alerts:
        p.produce(reg.name("gpu.alerts"), encode(a), key=(a.gpu_uuid or a.node).encode())
    for c in engine.commands:
        p.produce(reg.name("gpu.remediation"), encode(c), key=c.node.encode())
    assert p.flush(30) == 0
    args = ["--bootstrap", kafka_settings.bootstrap, "--topic-prefix", kafka_settings.topic_prefix, "--json"]
    t0 = time.monotonic()
    assert cli(["incidents", *args]) == 0
    took = time.monotonic() - t0
    data = orjson.loads(capsys.readouterr().out)
    assert [r["classification"] for r in data["open"]] == ["GPU_WEDGED"]
    assert data["read"]["alert"] == len(engine.alerts) and data["read"]["command"] == len(engine.commands)
    assert took < 30  # it ends at the end offsets it found, not after a silence (a timeout would be 120 s)
    assert cli(["incidents", *args, "--since", "30d"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert {r["incident_id"] for r in data["open"]} == {engine.alerts[0].incident_id, "old-incident-0001"}
    # a topic that is not there is a clear error, not a hang
    assert cli(["incidents", "--bootstrap", kafka_settings.bootstrap, "--topic-prefix", "nothere.", "--json"]) == 2
    assert "topic nothere.gpu.alerts does not exist" in capsys.readouterr().err


def test_our_murmur2_names_the_partition_librdkafka_put_each_key_on(kafka_settings):
    from xidstream.transport.kafka import murmur2_partition

    topic = kafka_settings.topics.name("gpu.samples")
    p = Producer(producer_config(kafka_settings))
    landed: dict[bytes, int] = {}
    keys = [f"GPU-{i:08x}-1111-4000-8000-000000000000".encode() for i in range(40)]
    for k in keys:
        p.produce(topic, b"{}", key=k, on_delivery=lambda err, m: landed.__setitem__(m.key(), m.partition()))
    assert p.flush(30) == 0
    assert {k: murmur2_partition(k, 8) for k in keys} == landed
    assert len(set(landed.values())) > 4  # the keys spread: the check is not trivially one partition


def test_incident_html_charts_the_gpus_own_samples_read_from_its_partition(kafka_settings, capsys, tmp_path):
    from tests.streams.builders import GPU, sample

    engine = run(wedge())
    reg = kafka_settings.topics
    p = Producer(producer_config(kafka_settings))
    for a in engine.alerts:
        p.produce(reg.name("gpu.alerts"), encode(a), key=(a.gpu_uuid or a.node).encode())
    for c in engine.commands:
        p.produce(reg.name("gpu.remediation"), encode(c), key=c.node.encode())
    assert p.flush(30) == 0
    # published as a collector does, moments after it read each (the broker's timestamp is the
    # sample's time), keyed by GPU UUID; before, during and long after the incident's span
    ours = [sample(t) for t in range(-900, 1800, 5)]  # the builders' wedge spans +120..+300 s
    theirs = [sample(t, gpu=f"GPU-99999999-0000-4000-8000-{i:012d}") for t in range(-900, 1800, 5) for i in range(3)]
    for r in sorted([*ours, *theirs], key=lambda r: r.ts):
        p.produce(reg.name("gpu.samples"), encode(r), key=r.gpu_uuid.encode(), timestamp=int(r.ts.timestamp() * 1000))
    assert p.flush(30) == 0
    first = min(min(a.ts for a in engine.alerts), min(c.ts for c in engine.commands)).timestamp()
    last = max(max(a.ts for a in engine.alerts), max(c.ts for c in engine.commands)).timestamp()
    charted = [r for r in ours if first - 600 <= r.ts.timestamp() <= last + 300]
    out = tmp_path / "report.html"
    iid = engine.alerts[0].incident_id
    assert cli(["incident", iid, "--html", str(out), "--since", "3650d", "--bootstrap", kafka_settings.bootstrap,
                "--topic-prefix", kafka_settings.topic_prefix]) == 0
    page = out.read_text()
    # the span: 10 min before the first record to 5 min after the last; this GPU's only, none of theirs
    assert 50 < len(charted) < len(ours)
    shown = re.search(r"&middot; (\d+) samples charted", page)
    # on a mismatch, what the report read: once 193 expected and something else charted, in a whole
    # run beside a three-broker cluster (2026-12-04); not seen in runs of this test alone
    assert shown and int(shown.group(1)) == len(charted), (
        f"charted {shown and shown.group(1)}, expected {len(charted)} (span {first - 600:.0f}..{last + 300:.0f}; "
        f"ours {ours[0].ts}..{ours[-1].ts}; the report's text: {re.sub(r'<[^>]+>', ' ', page)[:1500]})")
    assert GPU in page
