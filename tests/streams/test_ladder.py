"""Nothing waits forever: an executor's final refusal climbs the ladder like a failure; a plain
refusal waits for a person; a dry run's answer never climbs. The climbed command passes the
fleet breaker like any other (held for approval while it holds node-level commands)."""

from __future__ import annotations

import pytest

from xidstream.schemas import Action, RemediationResult
from xidstream.streams.engine import Engine
from tests.streams.builders import GPU, NODE, at, feed, wedge, xid
from tests.streams.test_classify import _storm, _topic_major, actions

MIG = "GPU 1 is in MIG mode: nvidia-smi --gpu-reset answered 3 (not available on target device)"
NO_KURED = "no kured pod runs on node-a: nothing would reboot it"


def _wedged(records=None) -> Engine:
    return feed(Engine(), sorted(records or wedge(), key=lambda r: r.ts))


def _newest(e: Engine, action: Action, node: str = NODE):
    return next(c for c in reversed(e.commands) if c.action == action and c.node == node)


def _answer(cmd, outcome: str, t: float, detail: str = "", final: bool = False) -> RemediationResult:
    return RemediationResult(ts=at(t), node=cmd.node, gpu_uuid=cmd.gpu_uuid, pci_bus_id=cmd.pci_bus_id,
                             command_id=cmd.command_id, incident_id=cmd.incident_id, action=cmd.action,
                             outcome=outcome, detail=detail, final=final)


def test_a_reset_refused_for_good_climbs_to_a_reboot_saying_why():
    e = _wedged()
    e.process(_answer(_newest(e, Action.RESET_GPU), "refused", 310, detail=MIG, final=True))
    reboot = e.commands[-1]
    assert reboot.action == Action.REBOOT_NODE and reboot.ts == at(310)
    assert reboot.reason == f"GPU reset refused for good ({MIG})"
    assert e.alerts[-1].summary == f"GPU reset refused for good ({MIG}): REBOOT_NODE"
    assert e.states[GPU].incident.timeline[-1]["summary"] == f"next rung: REBOOT_NODE: GPU reset refused for good ({MIG})"


def test_a_reboot_refused_for_good_climbs_to_replace():
    e = _wedged()
    e.process(_answer(_newest(e, Action.RESET_GPU), "refused", 310, detail=MIG, final=True))
    e.process(_answer(_newest(e, Action.REBOOT_NODE), "refused", 320, detail=NO_KURED, final=True))
    assert actions(e)[-2:] == [Action.REBOOT_NODE, Action.REPLACE_NODE]
    assert e.commands[-1].reason == f"node reboot refused for good ({NO_KURED})"
    assert e.alerts[-1].summary == f"node reboot refused for good ({NO_KURED}): REPLACE_NODE"


@pytest.mark.parametrize("action", [Action.RESET_GPU, Action.REBOOT_NODE])
def test_a_plain_refusal_asks_a_person_and_does_not_climb(action):
    e = _wedged()
    if action == Action.REBOOT_NODE:
        e.process(_answer(_newest(e, Action.RESET_GPU), "failed", 310, detail="in use by another client"))
    n = len(e.commands)
    e.process(_answer(_newest(e, action), "refused", 330, detail="maintenance window closed"))
    assert len(e.commands) == n
    assert e.alerts[-1].summary == f"{action.value} refused on {NODE}: maintenance window closed; operator attention needed"


@pytest.mark.parametrize("action, outcome, final", [
    (Action.RESET_GPU, "failed", False),
    (Action.RESET_GPU, "refused", True),
    (Action.REBOOT_NODE, "failed", False),
    (Action.REBOOT_NODE, "refused", True),
])
def test_a_dry_run_answer_never_climbs(action, outcome, final):
    e = _wedged()
    if action == Action.REBOOT_NODE:
        e.process(_answer(_newest(e, Action.RESET_GPU), "failed", 310, detail="in use by another client"))
    n = len(e.commands)
    detail = f"dry run: would {action.value.lower().replace('_', ' ')} on {NODE}"
    e.process(_answer(_newest(e, action), outcome, 330, detail=detail, final=final))
    assert len(e.commands) == n  # nothing was done: nothing to climb from
    assert e.alerts[-1].summary == f"{action.value} {outcome} on {NODE}: {detail}; operator attention needed"


def test_a_climbed_reboot_is_held_while_the_breaker_holds_node_level_commands():
    e = _storm(10, 5)  # tripped: every further node-level command needs an approval
    gpu, node = "GPU-00000009-0000-0000-0000-000000000000", "node-9"
    e.process(xid(300, 119, pid=None, gpu=gpu, node=node))
    reset = _newest(e, Action.RESET_GPU, node)
    assert reset.requires_approval
    e.process(_answer(reset, "refused", 400, detail=MIG, final=True))
    reboot = e.commands[-1]
    assert (reboot.action, reboot.node, reboot.requires_approval) == (Action.REBOOT_NODE, node, True)
    assert reboot.reason == f"GPU reset refused for good ({MIG}) [held: fleet circuit breaker tripped]"
    e.reset_breaker()
    e.process(_answer(reboot, "refused", 500, detail=NO_KURED, final=True))
    assert (e.commands[-1].action, e.commands[-1].requires_approval) == (Action.REPLACE_NODE, False)


@pytest.mark.parametrize("order", [
    ["GpuSample", "GpuProcesses", "XidEvent"],
    ["XidEvent", "GpuSample", "GpuProcesses"],
    ["GpuProcesses", "XidEvent", "GpuSample"],
])
def test_the_climb_on_a_final_refusal_comes_at_the_answers_time_whatever_the_read_order(order):
    e = Engine()
    for r in _topic_major(wedge(), order):
        e.process(r)
    e.process(_answer(_newest(e, Action.RESET_GPU), "refused", 310, detail=MIG, final=True))
    reboot = e.commands[-1]
    assert (reboot.action, reboot.ts, reboot.expires_at) == (Action.REBOOT_NODE, at(310), at(310 + 900))

