"""The start-up replication check (`xidstream.transport.kafka.replication_findings`): one line per topic,
naming the topic, what was found and what was expected."""

from __future__ import annotations

from xidstream.transport.kafka import replication_findings


def test_as_the_settings_assume_says_nothing():
    found = {"gpu.xid": (3, 2), "gpu.samples": (3, 2)}
    assert replication_findings(found, 3, 2, brokers=3) == []
    assert replication_findings({"gpu.xid": (1, 1)}, 1, None, brokers=1) == []  # the local broker


def test_a_replication_1_topic_on_a_3_broker_cluster():
    lines = replication_findings({"gpu.xid": (1, 1), "gpu.samples": (3, 2)}, 3, 2, brokers=3)
    assert lines == ["topic gpu.xid: replication factor 1, expected 3 (--replication-factor)",
                     "topic gpu.xid: min.insync.replicas 1, expected 2 (--min-insync-replicas)"]
    # settings left at their default of 1: still a single point of failure on 3 brokers
    [line] = replication_findings({"gpu.xid": (1, 1)}, 1, None, brokers=3)
    assert "gpu.xid" in line and "replication factor 1 on a cluster of 3 brokers, expected 3" in line
    assert "\n" not in line


def test_min_insync_replicas_other_than_expected():
    [line] = replication_findings({"gpu.remediation": (3, 1)}, 3, 2, brokers=3)
    assert line == "topic gpu.remediation: min.insync.replicas 1, expected 2 (--min-insync-replicas)"
    # unknown (no DescribeConfigs right): not reported
    assert replication_findings({"gpu.remediation": (3, None)}, 3, 2, brokers=3) == []


def test_min_insync_replicas_equal_to_replicas_blocks_writes_on_any_broker_down():
    [line] = replication_findings({"xidstream.fleet": (3, 3)}, 3, None, brokers=3)
    assert "min.insync.replicas 3 with 3 replicas, expected at most 2" in line


def test_one_line_per_finding_sorted_by_topic():
    lines = replication_findings({"b": (1, None), "a": (3, 3)}, 3, 2, brokers=3)
    assert [x.split(":")[0] for x in lines] == ["topic a", "topic b"]
