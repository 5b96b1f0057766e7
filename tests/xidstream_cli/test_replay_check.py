"""Scenario checking (expect/forbid) and the scenario library through the pure decision path:
the collector code on the fakes, then streams.engine (no broker; the broker tier replays them all
through Kafka and a real worker in tests/integration/test_replay_scenarios.py)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import Alert, load_scenario, parse_scenario
from xidstream.streams.engine import Engine
from xidstream.replay import EngineCommandLookup, ReplayResult, check_scenario, render_timeline

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = sorted((ROOT / "scenarios").glob("*.yaml"))


def run_pure(sc):
    sink = MemorySink()
    # a remediation_result answers a command the engine gave for what was published before it
    ScenarioRunner(sc, sink, command_lookup=EngineCommandLookup(lambda: sink.records)).run()
    e = Engine().run(sink.records)
    recs = sorted(e.alerts + e.commands, key=lambda r: (r.ts, 0 if isinstance(r, Alert) else 1))
    return ReplayResult(sc, sc.start, records=[("gpu.alerts" if isinstance(r, Alert) else "gpu.remediation", "", r) for r in recs])


@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_library_scenario_holds_on_the_pure_path(path):
    result = run_pure(load_scenario(path))
    assert check_scenario(result) == []
    out = io.StringIO()
    render_timeline(result, out)
    assert result.scenario.name in out.getvalue()


def test_the_library_covers_every_classification():
    seen = {e.classification.value for p in LIBRARY for e in load_scenario(p).expect}
    assert seen == {"APP_FAULT", "GPU_SUSPECT", "GPU_WEDGED", "GPU_HARDWARE_FAULT", "PHANTOM_LOAD", "FLEET_STORM"}


def _sc(expect=(), forbid=()):
    return parse_scenario({
        "scenario": 1, "name": "t", "start": "2026-11-28T03:00:00Z", "duration": 600,
        "nodes": [{"name": "n", "gpus": [{"index": 0, "uuid": "GPU-aaaa", "pci_bus_id": "0000:01:00"}]}],
        "timeline": [
            {"at": 0, "node": "n", "gpu": 0, "sample": {"utilization_gpu_pct": 30, "memory_used_mib": 9000}, "processes": [{"pid": 7}]},
            {"at": 100, "node": "n", "kernel": "NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."},
        ],
        "expect": list(expect), "forbid": list(forbid)})


def test_check_names_what_failed():
    ok = {"node": "n", "gpu": 0, "classification": "GPU_HARDWARE_FAULT", "actions": ["CORDON_NODE", "REBOOT_NODE"],
          "after": 100, "within": 5}
    assert check_scenario(run_pure(_sc(expect=[ok]))) == []
    fails = check_scenario(run_pure(_sc(
        expect=[dict(ok, actions=["REBOOT_NODE", "CORDON_NODE"]), dict(ok, after=200, within=10),
                {"node": "n", "gpu": 0, "classification": "GPU_WEDGED"}],
        forbid=[{"node": "n", "actions": ["DRAIN_NODE"]}, {"gpu": "GPU-aaaa", "actions": ["RESET_GPU"]}])))
    assert any(f.startswith("expect[0]") and "not commanded in that order" in f for f in fails)
    assert any(f.startswith("expect[1]") and "first alert at +100.0 s, expected between +200 and +210 s" in f for f in fails)
    assert any(f.startswith("expect[2]") and "no such alert (alerts there: GPU_HARDWARE_FAULT)" in f for f in fails)
    assert any(f.startswith("forbid[0] on n") and "DRAIN_NODE at +100 s" in f for f in fails)
    assert not any(f.startswith("forbid[1]") for f in fails)
    assert len(fails) == 4
