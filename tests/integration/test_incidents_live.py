"""`xidstream incidents` on the real broker: a bounded read of the contract topics from `--since`
(Kafka's time index) to the end offsets it found, no consumer group."""

from __future__ import annotations

import time

import orjson
import pytest
from confluent_kafka import Producer

from schemas.codec import encode
from transport.kafka import producer_config
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
