"""A scenario's `remediation_result` is a scripted executor's answer to a command (the
contract's results carry the `command_id` and `incident_id` of the command they answer)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from xidstream.collectors.scenario import ScenarioRunner, pick_command
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import Action, RemediationCommand, RemediationResult, load_scenario
from xidstream.schemas.errors import ScenarioError
from xidstream.streams.engine import Engine
from tests.streams.builders import at
from xidstream.replay import EngineCommandLookup

ROOT = Path(__file__).resolve().parents[2]
LADDER = ROOT / "scenarios" / "failed-reset-ladder.yaml"


def test_a_scenario_with_results_needs_a_command_lookup():
    with pytest.raises(ScenarioError, match=r"failed-reset-ladder.*timeline\[\d+\] has a remediation_result.*command_lookup"):
        ScenarioRunner(load_scenario(LADDER), MemorySink())
    # scenarios without results run as before
    ScenarioRunner(load_scenario(ROOT / "scenarios" / "lone-xid13.yaml"), MemorySink())


def test_results_answer_the_commands_the_processor_gave():
    sc = load_scenario(LADDER)
    sink = MemorySink()
    ScenarioRunner(sc, sink, command_lookup=EngineCommandLookup(lambda: sink.records)).run()
    results = [r for r in sink.records if isinstance(r, RemediationResult)]
    assert [(r.action, r.outcome.value) for r in results] == [(Action.RESET_GPU, "failed"), (Action.REBOOT_NODE, "failed")]
    commands = {c.command_id: c for c in Engine().run(sink.records).commands}
    gpu = sc.gpu("node-i", 0)
    for r in results:
        cmd = commands[r.command_id]  # each answers a command the decision path really emitted
        assert (cmd.incident_id, cmd.action, cmd.node) == (r.incident_id, r.action, r.node)
        assert r.gpu_uuid == cmd.gpu_uuid == gpu.uuid
        assert r.ts > cmd.ts


def test_a_result_with_no_command_to_answer_names_its_entry():
    sc = load_scenario(LADDER)
    asked = []

    def nothing(node, gpu_uuid, pci_bus_id, action, exclude):
        asked.append((node, gpu_uuid, action))
        return None

    with pytest.raises(ScenarioError, match=r"failed-reset-ladder.* timeline\[\d+\] \(at 300, node node-i, GPU 0\): "
                                            r"remediation_result RESET_GPU answers a RESET_GPU command"):
        ScenarioRunner(sc, MemorySink(), command_lookup=nothing).run()
    assert asked == [("node-i", sc.gpu("node-i", 0).uuid, Action.RESET_GPU)]


def _cmd(cid, action=Action.RESET_GPU, node="n", gpu="GPU-a", pci=None, t=0):
    return RemediationCommand(ts=at(t), node=node, command_id=cid, incident_id="i", gpu_uuid=gpu, pci_bus_id=pci,
                              action=action, step=1, expires_at=at(t) + timedelta(minutes=15))


def test_pick_command_takes_the_newest_unanswered_match():
    cmds = [_cmd("1"), _cmd("2", t=5), _cmd("3", action=Action.REBOOT_NODE), _cmd("4", node="m"), _cmd("5", gpu="GPU-b")]
    assert pick_command(cmds, "n", "GPU-a", None, Action.RESET_GPU, set()).command_id == "2"
    assert pick_command(cmds, "n", "GPU-a", None, Action.RESET_GPU, {"2"}).command_id == "1"
    assert pick_command(cmds, "n", "GPU-a", None, Action.RESET_GPU, {"1", "2"}) is None
    # a GPU whose UUID was never resolved: its command names the PCI id, in any spelling
    unresolved = [_cmd("6", gpu=None, pci="0000:91:00")]
    assert pick_command(unresolved, "n", "GPU-x", "00000000:91:00.0", Action.RESET_GPU, set()).command_id == "6"
    assert pick_command(unresolved, "n", "GPU-x", "0000:17:00", Action.RESET_GPU, set()) is None
