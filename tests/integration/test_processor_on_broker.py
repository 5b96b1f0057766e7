"""The stream processor as a real faust worker process on the real broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import KafkaSink
from xidstream.schemas import Action, Classification, decode_any, encode, load_scenario
from tests.streams.builders import GPU, wedge
from xidstream.transport.kafka import producer_config, read_all

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
GPU1 = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"
GPU0 = "GPU-3f1a9c2e-7b44-4d1e-9e0a-5c2b8d7f6a10"


def start_worker(settings, tmp_path, name="w"):
    log = open(tmp_path / f"{name}.log", "w")
    cmd = [sys.executable, "-m", "xidstream.cli", "process", "--bootstrap", settings.bootstrap,
           "--topic-prefix", settings.topic_prefix, "--partitions", str(settings.partitions),
           "--fast-rebalance", "--data-dir", str(tmp_path / f"data-{name}"), "--loglevel", "warning"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def stop_worker(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def outputs(settings, expected=None, timeout=60):
    reg = settings.topics
    msgs = read_all(settings, [reg.name("gpu.alerts"), reg.name("gpu.remediation"), reg.name("xidstream.deadletter")],
                    expected=expected, timeout=timeout, idle=3)
    return [(m.topic().removeprefix(settings.topic_prefix), decode_any(m.value())) for m in msgs]


def wait_for(settings, predicate, timeout=90):
    deadline = time.monotonic() + timeout
    got = []
    while time.monotonic() < deadline:
        got = outputs(settings, timeout=8)
        if predicate(got):
            return got
        time.sleep(1)
    return got


def produce(settings, records, extra=()):
    p = Producer(producer_config(settings))
    for r in records:
        topic, key = settings.topics.for_record(r)
        p.produce(topic, key=key, value=encode(r))
    for topic, key, value in extra:
        p.produce(topic, key=key, value=value)
    assert p.flush(30) == 0


def test_motivating_incident_end_to_end(kafka_settings, tmp_path):
    s = kafka_settings
    sink = KafkaSink(s, tmp_path / "spool")
    ScenarioRunner(load_scenario(ROOT / "scenarios" / "motivating-incident.yaml"), sink).run()
    assert sink.flush(30)
    sink.close()
    produce(s, [], extra=[(s.topics.name("gpu.samples"), GPU1.encode(), b"\xffnot json")])
    worker = start_worker(s, tmp_path)
    try:
        got = wait_for(s, lambda g: sum(1 for t, r in g if t == "gpu.remediation") >= 4 and any(t == "xidstream.deadletter" for t, _ in g))
    finally:
        stop_worker(worker)
    alerts = [r for t, r in got if t == "gpu.alerts"]
    commands = [r for t, r in got if t == "gpu.remediation"]
    wedged = [a for a in alerts if a.classification == Classification.GPU_WEDGED]
    assert len({a.incident_id for a in wedged}) == 1 and wedged[0].gpu_uuid == GPU1
    gpu1 = [c.action for c in commands if c.gpu_uuid == GPU1]
    assert gpu1 == [Action.RECORD, Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]
    assert [c for c in commands if c.gpu_uuid == GPU0] == []
    assert not [a for a in alerts if a.gpu_uuid == GPU0]
    (dead,) = [r for t, r in got if t == "xidstream.deadletter"]
    assert dead.original == b"\xffnot json" and dead.source_topic == s.topics.name("gpu.samples")
    assert "not JSON" in dead.error


@pytest.mark.slow
def test_worker_killed_mid_incident_resumes_it_without_losing_a_command(kafka_settings, tmp_path):
    s = kafka_settings
    records = wedge(start=120, pinned_until=400)
    first = [r for r in records if r.ts.timestamp() < records[0].ts.timestamp() + 150]  # app fault, 25 s pinned
    rest = records[len(first):]
    produce(s, first)
    worker = start_worker(s, tmp_path, "first")
    try:
        got = wait_for(s, lambda g: any(t == "gpu.alerts" for t, _ in g))
        app_fault = [r for t, r in got if t == "gpu.alerts"]
        assert [a.classification for a in app_fault] == [Classification.APP_FAULT]
        time.sleep(3)  # let the worker commit its offsets and changelog
    finally:
        stop_worker(worker, signal.SIGKILL)
    produce(s, rest)
    worker = start_worker(s, tmp_path, "second")
    try:
        got = wait_for(s, lambda g: any(t == "gpu.remediation" and r.action == Action.RESET_GPU for t, r in g), timeout=120)
    finally:
        stop_worker(worker)
    alerts = [r for t, r in got if t == "gpu.alerts"]
    wedged = [a for a in alerts if a.classification == Classification.GPU_WEDGED]
    assert wedged, (tmp_path / "second.log").read_text()[-3000:]
    # the same incident continued: its id came back from the changelog
    assert wedged[0].incident_id == app_fault[0].incident_id
    commands = [r for t, r in got if t == "gpu.remediation" and r.gpu_uuid == GPU]
    ids = {}
    for c in commands:
        ids.setdefault(c.command_id, c.action)
    assert sorted(ids.values(), key=lambda a: a.value) == sorted(
        [Action.RECORD, Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU], key=lambda a: a.value)
    # a re-emitted command (at-least-once) carries the same id, so nothing is ambiguous
    assert len(commands) >= 4 and all(ids[c.command_id] == c.action for c in commands)


@pytest.mark.slow
def test_fleet_storm_then_breaker_reset_on_a_real_worker(kafka_settings, tmp_path, capsys):
    from tests.streams.builders import inventory, sample, xid
    from xidstream.cli import main as cli

    s = kafka_settings
    recs = []
    for i in range(10):
        g = f"GPU-{i:08d}-0000-0000-0000-000000000000"
        recs += [inventory(0, gpu=g, node=f"node-{i}"), sample(0, gpu=g, node=f"node-{i}")]
    storm = [xid(100 + 10 * i, 79, pid=None, gpu=f"GPU-{i:08d}-0000-0000-0000-000000000000", node=f"node-{i}")
             for i in range(4)]
    produce(s, recs)
    worker = start_worker(s, tmp_path)
    try:
        time.sleep(2)
        produce(s, storm)
        got = wait_for(s, lambda g: any(t == "gpu.alerts" and r.classification == Classification.FLEET_STORM for t, r in g)
                       and sum(1 for t, r in g if t == "gpu.remediation") >= 12)
        assert cli(["breaker", "reset", "--bootstrap", s.bootstrap, "--topic-prefix", s.topic_prefix, "--by", "test"]) == 0
        produce(s, [xid(400, 79, pid=None, gpu="GPU-00000009-0000-0000-0000-000000000000", node="node-9")])
        got = wait_for(s, lambda g: any(t == "gpu.remediation" and r.node == "node-9" for t, r in g))
    finally:
        stop_worker(worker)
    node_cmds = [(r.node, r.action, r.requires_approval) for t, r in got if t == "gpu.remediation" and r.action in (
        Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE)]
    held = {n for n, a, h in node_cmds if h}
    assert held and "node-9" not in held  # held during the storm, free again after the reset
    # the storm's incident resolves with the reset (`xidstream incidents` no longer shows it tripped)
    storms = [r for t, r in got if t == "gpu.alerts" and r.classification == Classification.FLEET_STORM]
    assert [a.state for a in storms] == ["open", "resolved"] and len({a.incident_id for a in storms}) == 1
    assert ("node-9", Action.CORDON_NODE, False) in node_cmds
    assert "breaker reset sent" in capsys.readouterr().out
