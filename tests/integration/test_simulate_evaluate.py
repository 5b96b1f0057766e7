"""A small simulated fleet through a real worker, scored by `xidstream evaluate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from xidstream.schemas.topics import INPUT_TOPICS
from xidstream.streams.app import internal_topics
from xidstream.cli import main as cli
from xidstream.runner import WorkerProcess

# slow (make test-all only): a simulated fleet scored end to end
pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_simulated_fleet_is_found_with_no_node_action_on_app_faults(kafka_settings, tmp_path, capsys):
    s = kafka_settings
    truth = tmp_path / "truth.jsonl"
    worker = WorkerProcess(s, tmp_path).start()
    try:
        rc = cli(["simulate", "--nodes", "6", "--gpus", "4", "--duration", "400", "--speed", "0",
                  "--bootstrap", s.bootstrap, "--topic-prefix", s.topic_prefix, "--truth", str(truth),
                  "--state-dir", str(tmp_path / "sim"), "--app-fault-rate", "0.25", "--repeat-rate", "0.1",
                  "--wedge-rate", "0.1", "--hardware-rate", "0.1", "--phantom-rate", "0.1", "--seed", "3"])
        assert rc == 0
        topics = [s.topics.name(n) for n in INPUT_TOPICS] + list(internal_topics(s))
        assert worker.wait_idle(topics, timeout=180), worker.tail()
    finally:
        worker.stop()
    capsys.readouterr()
    rc = cli(["evaluate", "--truth", str(truth), "--bootstrap", s.bootstrap, "--topic-prefix", s.topic_prefix])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "node-level actions (not held for approval) on GPUs whose only fault was an application fault or none: 0" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("APP_FAULT", "GPU_", "PHANTOM"))}
    for cls, row in rows.items():
        truth_n, tp, fn = int(row[1]), int(row[2]), int(row[4])
        assert tp + fn == truth_n
        if truth_n:
            assert tp == truth_n, out  # every injected fault found
    assert "processor lag now (records not yet committed by" in out and "xidstream-processor): 0" in out
    assert Path(truth).read_bytes().count(b"\n") == 6 * 4 + 1
