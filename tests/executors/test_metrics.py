"""The executors' metrics (executors/metrics.py) over a real Executor: results by action and
outcome, and the commands held for an approval, as Prometheus scrapes them over HTTP."""

from __future__ import annotations

import socket
import urllib.request
from datetime import timedelta

from xidstream.executors.metrics import ExecutorMetrics
from xidstream.executors.runner import Executor
from tests.executors.helpers import keypair
from tests.executors.test_gate import NOW, _Recorder, approval, command


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line.startswith("xidstream_executor_"))}


def test_results_by_action_and_outcome_and_the_oldest_held_command(tmp_path):
    key, keys, _, _ = keypair(tmp_path)
    approver, approver_keys, _, _ = keypair(tmp_path, "approver")
    clock = [NOW]
    ex = Executor(scope="cluster", keys=keys, approval_keys=approver_keys, actions=_Recorder(),
                  state_dir=tmp_path / "s", apply=True, clock=lambda: clock[0])
    m = ExecutorMetrics("cluster", ex.held_since, clock=lambda: clock[0].timestamp())
    ex.on_result = lambda cmd, r: m.result(cmd.action, r.outcome, r.detail)
    port = _port()
    m.serve(port)
    try:
        # every answer this executor can give exists at 0 before the first (increase() needs it)
        first = _scrape(port)
        assert first['xidstream_executor_results_total{action="DRAIN_NODE",dry_run="false",outcome="refused",scope="cluster"}'] == 0
        assert not any('action="RESET_GPU"' in k for k in first)  # the node executor's, not this one's
        ex.handle(key.sign(command("n1", "CORDON_NODE")))
        ex.handle(command("n1", "CORDON_NODE"))  # unsigned: refused
        ex.apply = False
        ex.handle(key.sign(command("n1", "RECORD")))  # a dry run's answer: refused, and said so
        ex.apply = True
        first = key.sign(command("n1", "DRAIN_NODE", requires_approval=True))
        assert ex.handle(first, hold=True) is None
        clock[0] += timedelta(seconds=200)
        second = key.sign(command("n2", "DRAIN_NODE", requires_approval=True, now=clock[0]))
        assert ex.handle(second, hold=True) is None
        clock[0] += timedelta(seconds=40)
        got = _scrape(port)
        assert got['xidstream_executor_results_total{action="CORDON_NODE",dry_run="false",outcome="succeeded",scope="cluster"}'] == 1
        assert got['xidstream_executor_results_total{action="CORDON_NODE",dry_run="false",outcome="refused",scope="cluster"}'] == 1
        assert got['xidstream_executor_results_total{action="RECORD",dry_run="true",outcome="refused",scope="cluster"}'] == 1
        assert got['xidstream_executor_held_commands{scope="cluster"}'] == 2
        assert got['xidstream_executor_oldest_held_age_seconds{scope="cluster"}'] == 240  # the first, not the newest
        assert ex.approve(approval(approver, first, now=clock[0])) is None
        [r] = ex.due()
        got = _scrape(port)
        assert got['xidstream_executor_results_total{action="DRAIN_NODE",dry_run="false",outcome="succeeded",scope="cluster"}'] == 1
        assert got['xidstream_executor_held_commands{scope="cluster"}'] == 1
        assert got['xidstream_executor_oldest_held_age_seconds{scope="cluster"}'] == 40
    finally:
        m.close()
