"""`xidstream replay` plays a scenario's `remediation_result` as a scripted executor on the real
broker: it waits for the processor's command on the run's `gpu.remediation` and answers it with the
command's ids, or fails naming the scenario entry when no such command comes."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from xidstream.schemas import Action, RemediationResult, decode_any, load_scenario, parse_scenario
from xidstream.schemas.errors import ScenarioError
from xidstream.transport.kafka import admin, delete_run, read_all
from xidstream.replay import replay_scenario
from xidstream.settings import Settings

# slow (make test-all only): replays with an executor answering
pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_replay_answers_the_processors_command(kafka_bootstrap, tmp_path):
    sc = load_scenario(ROOT / "scenarios" / "xid79-fallen-off-bus.yaml")
    sc = sc.model_copy(update={"name": f"executor-{uuid.uuid4().hex[:8]}"})
    result = replay_scenario(sc, kafka_bootstrap, workdir=tmp_path, keep=True)
    s = Settings(bootstrap=kafka_bootstrap, topic_prefix=result.topic_prefix)
    try:
        msgs = read_all(s, [s.topics.name("gpu.remediation.results")], expected=1, timeout=20)
        (res,) = [decode_any(m.value()) for m in msgs]
    finally:
        delete_run(s)
    assert isinstance(res, RemediationResult) and res.action == Action.REBOOT_NODE
    reboots = {c.command_id: c for c in result.commands if c.action == Action.REBOOT_NODE}
    cmd = reboots[res.command_id]  # it answers the command the processor released
    assert (res.incident_id, res.gpu_uuid, res.node) == (cmd.incident_id, cmd.gpu_uuid, cmd.node)
    assert not result.dead


def test_a_result_no_command_asked_for_fails_naming_its_entry(kafka_bootstrap, tmp_path):
    raw = load_scenario(ROOT / "scenarios" / "lone-xid13.yaml").model_dump(mode="json", by_alias=True, exclude_none=True)
    name = f"noanswer-{uuid.uuid4().hex[:8]}"
    raw["name"] = name
    raw["timeline"].append({"at": 300, "node": "node-b", "gpu": 0,
                            "remediation_result": {"action": "RESET_GPU", "outcome": "succeeded"}})
    raw["expect"], raw["forbid"] = [], []
    sc = parse_scenario(raw)
    with pytest.raises(ScenarioError) as err:
        replay_scenario(sc, kafka_bootstrap, workdir=tmp_path, command_timeout=5)
    text = str(err.value)
    assert f"scenario {name!r} timeline[{len(raw['timeline']) - 1}] (at 300, node node-b, GPU 0)" in text
    assert "no RESET_GPU command for node node-b" in text and "within 5 s" in text
    left = [t for t in admin(Settings(bootstrap=kafka_bootstrap)).list_topics(timeout=10).topics
            if t.startswith(f"replay-{name}-")]
    assert left == []
