"""A processor worker is either whole or gone.

A faust agent that dies (an exception escapes its loop) must take the worker down with a non-zero
exit code, so an orchestrator restarts it; a worker that runs on without its fleet agent would
never release another command. And the tables' changelog topics must be known, with the partition
counts faust checks, before an agent writes its first table row (faust's PartitionsMismatch
"... has 0 partitions" was a changelog whose metadata the consumer did not have yet).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import ConfigResource, NewTopic
from confluent_kafka import Producer

from xidstream.schemas import decode_any, encode
from xidstream.schemas.errors import TopicError
from xidstream.streams.app import changelog_topics, internal_topics, wait_for_partitions
from tests.streams.builders import inventory, sample, xid
from xidstream.transport.kafka import admin, ensure_processor_topics, producer_config, read_all

ROOT = Path(__file__).resolve().parents[2]

# A real `xidstream process` worker whose fleet agent fails when it sends its first command: an
# exception that escapes the agent's loop (what faust's PartitionsMismatch did).
CRASHING_WORKER = """
import sys
import xidstream.streams.app as app_module

real = app_module.create_app

def create_app(*args, **kwargs):
    proc = real(*args, **kwargs)

    async def broken_send(*a, **k):
        raise RuntimeError("injected: gpu.remediation is unwritable")

    proc.remediation.send = broken_send
    return proc

app_module.create_app = create_app
from xidstream.cli import main
sys.exit(main(sys.argv[1:]))
"""


# A real worker whose consumer learns the changelogs' partition counts late: for its first DELAY
# seconds, faust's count of any changelog is 0, as when its metadata has not arrived (defect 7).
LATE_METADATA_WORKER = """
import sys, time
import faust.transport.drivers.aiokafka as driver

DELAY = float(sys.argv[1])
real = driver.AIOKafkaConsumerThread.topic_partitions
t0 = time.monotonic()

def late(self, topic):
    if topic.endswith("-changelog") and time.monotonic() - t0 < DELAY:
        return 0
    return real(self, topic)

driver.AIOKafkaConsumerThread.topic_partitions = late
from xidstream.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _worker_args(s, tmp_path):
    return ["process", "--bootstrap", s.bootstrap, "--topic-prefix", s.topic_prefix, "--partitions",
            str(s.partitions), "--fast-rebalance", "--data-dir", str(tmp_path / "data"), "--loglevel", "warning"]


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _fatal_xid(s):
    g = "GPU-00000001-0000-0000-0000-000000000000"
    p = Producer(producer_config(s))
    for r in (inventory(0, gpu=g), sample(0, gpu=g), xid(100, 79, pid=None, gpu=g)):
        topic, key = s.topics.for_record(r)
        p.produce(topic, key=key, value=encode(r))
    assert p.flush(30) == 0


@pytest.mark.broker
def test_a_worker_whose_agent_dies_exits_non_zero(kafka_settings, tmp_path):
    s = kafka_settings
    log = tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_WORKER, *_worker_args(s, tmp_path)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        _fatal_xid(s)  # -> CORDON/DRAIN/REBOOT commands -> the fleet agent's send raises
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker ran on for 90 s after its fleet agent died:\n" + log.read_text()[-3000:])
    finally:
        _stop(proc)
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert "agent fleet died" in text and "injected: gpu.remediation is unwritable" in text, text[-3000:]


def _topics(s):
    md = admin(s).list_topics(timeout=10)
    return {name: len(t.partitions) for name, t in md.topics.items() if not t.error}


@pytest.mark.broker
def test_changelogs_exist_with_faust_partition_counts_before_the_worker_starts(kafka_settings):
    s = kafka_settings
    app_id = f"{s.topic_prefix}xidstream-processor"
    wanted = changelog_topics(s, app_id)
    assert wanted == {f"{app_id}-gpu-state-changelog": s.partitions, f"{app_id}-fleet-state-changelog": 1}
    ensure_processor_topics(s, internal_topics(s), compacted=wanted)
    have = _topics(s)
    for name, parts in {**internal_topics(s), **wanted}.items():
        assert have.get(name) == parts, (name, have.get(name))
    # compacted like faust's own changelogs: the latest row per key survives retention
    res = ConfigResource(ConfigResource.Type.TOPIC, f"{app_id}-fleet-state-changelog")
    client = admin(s)
    conf = client.describe_configs([res])[res].result()
    assert conf["cleanup.policy"].value == "compact"


@pytest.mark.broker
def test_a_changelog_with_the_wrong_partition_count_stops_the_worker_with_a_clear_error(kafka_settings, tmp_path):
    s = kafka_settings
    bad = f"{s.topic_prefix}xidstream-processor-fleet-state-changelog"
    client = admin(s)  # kept: a collected client cancels its futures
    client.create_topics([NewTopic(bad, num_partitions=2, replication_factor=1)])[bad].result()
    log = tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-m", "xidstream.cli", *_worker_args(s, tmp_path)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        _fatal_xid(s)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker ran on with a changelog it cannot write:\n" + log.read_text()[-3000:])
    finally:
        _stop(proc)
    text = log.read_text()
    assert rc != 0
    assert bad in text and "has 2 partitions, needs 1" in text, text[-3000:]
    with pytest.raises(TopicError, match="has 2 partitions, needs 1"):
        ensure_processor_topics(s, internal_topics(s), compacted=changelog_topics(s, f"{s.topic_prefix}xidstream-processor"))


def test_an_agent_waits_until_the_changelog_partitions_are_known():
    """faust reports 0 partitions for a subscribed topic whose metadata has not arrived; the wait
    asks for fresh metadata until every topic has a count, and gives up with the topic's name."""
    counts = iter([0, 0, 8])
    refreshes = []

    async def refresh():
        refreshes.append(1)

    async def run(lookup, timeout):
        return await wait_for_partitions(lookup, refresh, ["a-gpu-state-changelog"], timeout=timeout, poll=0.01)

    t0 = time.monotonic()
    asyncio.run(run(lambda t: next(counts), 5))
    assert len(refreshes) == 2 and time.monotonic() - t0 < 2
    with pytest.raises(TopicError, match="a-gpu-state-changelog.*0 partitions after 0.2 s"):
        asyncio.run(run(lambda t: 0, 0.2))
    # None: no consumer (agent.test_context()); nothing to wait for
    asyncio.run(run(lambda t: None, 0.2))


@pytest.mark.broker
@pytest.mark.slow
def test_a_changelog_whose_metadata_arrives_late_delays_the_first_write_not_the_commands(kafka_settings, tmp_path):
    s = kafka_settings
    _fatal_xid(s)  # already there when the worker starts: its first table writes come at once
    log = tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-c", LATE_METADATA_WORKER, "15", *_worker_args(s, tmp_path)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        commands = []
        while time.monotonic() < deadline and len(commands) < 3 and proc.poll() is None:
            msgs = read_all(s, [s.topics.name("gpu.remediation")], timeout=5, idle=1)
            commands = [decode_any(m.value()) for m in msgs]
        alive = proc.poll() is None
        # the rows are written after the batch that released the commands: the wait comes then
        while time.monotonic() < deadline and "-changelog before its first write" not in log.read_text():
            time.sleep(0.5)
    finally:
        _stop(proc)
    text = log.read_text()
    assert "PartitionsMismatch" not in text, text[-3000:]
    assert alive, text[-3000:]
    assert sorted(c.action.value for c in commands) == ["CORDON_NODE", "DRAIN_NODE", "REBOOT_NODE"], text[-3000:]
    assert "waited" in text and "-changelog before its first write" in text, text[-3000:]
