"""A node executor is in no consumer group (each assigns itself every partition and keeps its own
cursor), so nothing hands it a partition added to `gpu.remediation` while it runs: on d12c2de a
command on a new partition was read only after a restart. It now looks for new partitions every
`relist_s` and reads them from their beginning."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import NewPartitions

from xidstream.schemas import decode_any
from xidstream.schemas.codec import encode
from tests.executors.helpers import command, keypair

# slow (make test-all only): a partition added while a node executor runs
pytestmark = pytest.mark.slow


@pytest.mark.broker
def test_a_node_executor_reads_a_partition_added_while_it_runs(kafka_settings, tmp_path):
    from xidstream.executors.node import NodeActions
    from xidstream.executors.runner import Executor, run_kafka
    from xidstream.transport.kafka import admin, producer_config, read_all

    settings = kafka_settings
    reg = settings.topics
    cmd_topic, res_topic = reg.name("gpu.remediation"), reg.name("gpu.remediation.results")
    key, verify, _, _ = keypair(tmp_path)
    me = "node-grows"
    ex = Executor(scope="node", node=me, keys=verify, state_dir=tmp_path / "state",
                  actions=NodeActions(None, me, None, tmp_path / "reboot-required"))
    stop = threading.Event()
    t = threading.Thread(target=run_kafka, args=(ex, settings), kwargs={"stop": stop, "poll": 0.2, "relist_s": 1.0},
                         daemon=True)
    t.start()
    try:
        time.sleep(2)  # assigned the topic's partitions as it started
        client = admin(settings)
        before = len(client.list_topics(cmd_topic, timeout=10).topics[cmd_topic].partitions)
        for f in client.create_partitions([NewPartitions(cmd_topic, before + 2)]).values():
            f.result(timeout=30)
        cmd = key.sign(command(me, "REBOOT_NODE"))
        producer = Producer(producer_config(settings))
        producer.produce(cmd_topic, key=me.encode(), value=encode(cmd), partition=before + 1)  # a new one
        assert producer.flush(10) == 0
        answers: list = []
        deadline = time.monotonic() + 30
        while not answers and time.monotonic() < deadline:
            answers = [r for r in (decode_any(m.value()) for m in read_all(settings, [res_topic], timeout=3))
                       if r.command_id == cmd.command_id]
        assert len(answers) == 1, "the command on the new partition was never answered"
        assert answers[0].detail.startswith("dry run: would"), answers[0].detail
    finally:
        stop.set()
        t.join(20)
    assert not t.is_alive()
