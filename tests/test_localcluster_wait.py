"""`LocalCluster.wait` asks each node it launched for its own word that it serves, not only the
other nodes' metadata: a fresh secure cluster's start once returned while node 3 had not
registered, and the first CreateTopics at replication 3 failed ("only 2 broker(s) are
registered"). No JVM here: the processes are stand-ins that write a node's log lines."""

from __future__ import annotations

import subprocess
import sys

import pytest

from schemas.errors import BrokerError
from xidstream.localcluster import LocalCluster


def _cluster(tmp_path) -> LocalCluster:
    c = LocalCluster(brokers=3, state_dir=tmp_path / "cluster")
    for n in c.nodes:
        n.state_dir.mkdir(parents=True)
    return c


def _launched(node, earlier: str = "") -> None:
    """What `launch` records: the log's end when this run's process started."""
    node.log_file.write_text(earlier)
    with node.log_file.open("a") as fh:
        node.launched_at = fh.tell()


def test_a_node_is_running_only_once_this_run_logged_it(tmp_path):
    node = _cluster(tmp_path).nodes[2]
    # the previous run's start line is in the same log: not this run's
    _launched(node, "[2026-12-03 21:00:00,000] INFO [KafkaRaftServer nodeId=3] Kafka Server started\n")
    assert not node.running()
    with node.log_file.open("a") as fh:
        fh.write("[2026-12-03 21:32:41,416] INFO Recorded new KRaft controller\n")
    assert not node.running()
    with node.log_file.open("a") as fh:
        fh.write("[2026-12-03 21:32:43,000] INFO [KafkaRaftServer nodeId=3] Kafka Server started\n")
    assert node.running()


def test_wait_does_not_return_while_a_launched_node_has_not_started(tmp_path, monkeypatch):
    c = _cluster(tmp_path)
    procs = {}
    for n in c.nodes:
        _launched(n)
        procs[n.node_id] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        n.pid_file.write_text(str(procs[n.node_id].pid))
    try:
        # every node "runs" and the metadata of all three lists all three (what the race saw) ...
        monkeypatch.setattr(type(c.nodes[0]), "pid", lambda self: procs[self.node_id].pid)
        monkeypatch.setattr(LocalCluster, "answering", lambda self: {1, 2, 3})
        for n in c.nodes[:2]:
            n.log_file.write_text(n.log_file.read_text() + "INFO Kafka Server started\n")
        # ... but node 3 never said it serves: wait gives up, naming it, instead of returning
        with pytest.raises(BrokerError, match="did not"):
            c.wait(1.5, procs)
        c.nodes[2].log_file.write_text("INFO Kafka Server started\n")
        c.wait(1.5, procs)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
