"""`LocalCluster.wait` asks each node it launched for its own word that it serves, not only the
other nodes' metadata: a fresh secure cluster's start once returned while node 3 had not
registered, and the first CreateTopics at replication 3 failed ("only 2 broker(s) are
registered"). No JVM here: the processes are stand-ins that write a node's log lines."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xidstream.schemas.errors import BrokerError
from workshop.localcluster import LocalCluster


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


# A stand-in for a combined node on SIGTERM: it logs its two request handler pools' last lines (as
# Kafka 4.0.2's does 2-3 s into its controlled shutdown) and then never exits, as the JVM did.
_HANGS_AFTER_SHUTDOWN = """
import signal, sys, time
log = sys.argv[1]
def term(*_):
    with open(log, "a") as fh:
        for _ in range(2):
            fh.write("INFO [data-plane Kafka Request Handler on Broker 2], shut down completely\\n")
signal.signal(signal.SIGTERM, term)
open(sys.argv[2], "w").close()
while True:
    time.sleep(0.1)
"""


def _gone(proc) -> None:
    """The stop reaped it (its exit status is the stop's): no such process any more."""
    import os

    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def _hanging_node(tmp_path, node):
    _launched(node)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _HANGS_AFTER_SHUTDOWN, str(node.log_file), str(ready)])
    while not ready.exists():
        pass
    node.pid_file.write_text(str(proc.pid))
    return proc


def test_a_node_that_shut_down_but_does_not_exit_is_killed_soon_after_not_at_the_grace(tmp_path, monkeypatch):
    """Every stop of a cluster node waited out its 30 s grace (90 s of each rolling restart): the
    JVM finished its controlled shutdown and did not exit. Once both pools said so, the node gets
    EXIT_AFTER_DONE_S more, then SIGKILL; the log says which."""
    node = _cluster(tmp_path).nodes[1]
    monkeypatch.setattr(type(node), "pid", lambda self: int(self.pid_file.read_text()))
    monkeypatch.setattr(type(node), "EXIT_AFTER_DONE_S", 0.3)
    proc = _hanging_node(tmp_path, node)
    try:
        assert node.stop(grace=600)  # returns: killed, not at the 600 s grace
        _gone(proc)
        assert "node 2 shut down but its JVM did not exit within 0 s; killing it" in node.log_file.read_text()
        assert not node.pid_file.exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_node_whose_shutdown_is_not_logged_keeps_its_grace(tmp_path, monkeypatch):
    """One pool's line is not the end of the shutdown: the node keeps the whole grace."""
    node = _cluster(tmp_path).nodes[1]
    monkeypatch.setattr(type(node), "pid", lambda self: int(self.pid_file.read_text()))
    monkeypatch.setattr(type(node), "EXIT_AFTER_DONE_S", 0.0)
    node.log_file.parent.mkdir(parents=True, exist_ok=True)
    # one pool's line, and one of an earlier stop (before this stop began: not this one's)
    node.log_file.write_text("INFO [data-plane Kafka Request Handler on Broker 2], shut down completely\n")
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                             "open(sys.argv[1], 'w').close()\ntime.sleep(60)", str(ready)])
    while not ready.exists():
        pass
    node.pid_file.write_text(str(proc.pid))
    try:
        assert node.stop(grace=1.0)
        _gone(proc)
        log = node.log_file.read_text()
        assert "node 2 did not stop within its grace; killing it" in log and "JVM did not exit" not in log
    finally:
        proc.kill()
        proc.wait()
