"""Every scenario of the library through the real path (`xidstream replay --check`): collectors ->
Kafka -> a real processor worker -> gpu.alerts / gpu.remediation, expect and forbid checked."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest

from xidstream.schemas import load_scenario
from xidstream.cli import main as cli
from xidstream.replay import run_replay

# slow (make test-all only): the whole scenario library through the real broker
pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_every_library_scenario_passes_check(kafka_bootstrap, capsys, tmp_path):
    """The whole library, three child replays at a time (`--jobs 3`), plus one scenario whose
    expectation cannot hold: its failure is counted and named, the others pass, and every
    scenario's output comes in the order the files were given."""
    files = sorted(str(p) for p in (ROOT / "scenarios").glob("*.yaml"))
    bad = tmp_path / "wrong.yaml"
    bad.write_text((ROOT / "scenarios" / "lone-xid13.yaml").read_text().replace(
        "name: lone-xid13", "name: lone-xid13-wrong").replace(
        "classification: APP_FAULT, actions: [RECORD]", "classification: GPU_WEDGED, actions: [RESET_GPU]"))
    files.insert(len(files) // 2, str(bad))
    rc = cli(["replay", *files, "--check", "--jobs", "3", "--bootstrap", kafka_bootstrap])
    cap = capsys.readouterr()
    assert rc == 1, cap.err
    assert f"replay --check: {len(files) - 1} passed, 1 failed" in cap.err
    assert "CHECK FAILED lone-xid13-wrong" in cap.err
    names = [load_scenario(f).name for f in files]
    checked = [line.split()[2].rstrip(":") for line in cap.err.splitlines() if line.startswith("CHECK ")]
    assert checked == names
    rendered = [line.split()[1].rstrip(":") for line in cap.out.splitlines() if line.startswith("== ")]
    assert rendered == names
    assert cap.err.count("replay --check: ") == 1  # the children's own sums are not printed


def test_replay_json_lines_and_a_failing_check(kafka_bootstrap, tmp_path, capsys):
    text = (ROOT / "scenarios" / "lone-xid13.yaml").read_text()
    # the same incident with an expectation it cannot meet
    bad = tmp_path / "wrong.yaml"
    bad.write_text(text.replace("name: lone-xid13", "name: lone-xid13-wrong").replace(
        "classification: APP_FAULT, actions: [RECORD]", "classification: GPU_WEDGED, actions: [RESET_GPU]"))
    out = io.StringIO()
    rc = run_replay([str(bad)], kafka_bootstrap, as_json=True, check=True, out=out)
    assert rc == 1
    lines = [orjson.loads(x) for x in out.getvalue().splitlines()]
    assert {x["topic"] for x in lines} == {"gpu.alerts", "gpu.remediation"}
    assert all(set(x) == {"topic", "key", "value"} for x in lines)
    assert lines[0]["value"]["classification"] == "APP_FAULT"
    err = capsys.readouterr().err
    assert "CHECK FAILED lone-xid13-wrong" in err and "expect[0] GPU_WEDGED on node-b GPU 0: no such alert" in err
