"""The pod view down (the cluster executor restarting, or flooded by a compromised node) is "cannot
tell", never an answer that climbs the ladder: the reboot's kured check, the reset's holder
classification and its operand wait each answer refused, not final, and nothing fails."""

from __future__ import annotations

from types import SimpleNamespace as NS

from xidstream.executors.runner import Executor
from xidstream.executors.node import NodeActions, _Steps
from xidstream.executors.operands import PODS_UNKNOWN
from xidstream.schemas.vocab import Outcome
from tests.executors.helpers import command, keypair
from xidstream.transport.podview import PodViewClient

DEAD = "http://127.0.0.1:9"  # nothing listens: the view unreachable


class _NoNode:
    """An API client whose Node is not found (no Event recorded): only the view matters here."""

    def get(self, *a, **kw):
        return None


def _actions(tmp_path, **kw) -> NodeActions:
    tmp_path.mkdir(parents=True, exist_ok=True)
    token = tmp_path / "token"
    token.write_text("a-token")
    return NodeActions(_NoNode(), "gpu-node-1", None, reboot_sentinel=tmp_path / "run" / "reboot-required",
                       state_dir=tmp_path / "s", precondition_wait=0.2, precondition_poll=0.05,
                       pod_view=PodViewClient(DEAD, str(token), timeout=2.0), **kw)


def test_a_reboot_whose_kured_check_cannot_reach_the_view_is_refused_not_final(tmp_path):
    """Before: kured_on_node's PodViewError left the action as FAILED, and the processor climbed
    REBOOT_NODE to REPLACE_NODE, dry run included."""
    key, verify, _, _ = keypair(tmp_path)
    for apply in (False, True):
        ex = Executor(scope="node", node="gpu-node-1", keys=verify, actions=_actions(tmp_path / str(apply)),
                      state_dir=tmp_path / str(apply) / "s", apply=apply)
        r = ex.handle(key.sign(command("gpu-node-1", "REBOOT_NODE")))
        assert r.outcome == Outcome.refused and not r.final, (apply, r.outcome, r.detail)
        assert "cannot tell whether node gpu-node-1 can be rebooted" in r.detail and "unreachable" in r.detail
    assert not (tmp_path / "True" / "run" / "reboot-required").exists()  # nothing requested


def test_operands_whose_pods_cannot_be_seen_are_refused_not_final_and_a_real_stay_is_final(tmp_path):
    """Before: an operand wait that could not read the view ran to its deadline and refused for
    good (a reboot). An operand that really stays still refuses for good."""
    actions = _actions(tmp_path)
    cmd = command("gpu-node-1", "RESET_GPU")
    gpu = NS(index=2, uuid="GPU-1", minor=2)
    for left, final in (([f"{PODS_UNKNOWN}pod view {DEAD}/v1/pods unreachable)"], False),
                        (["gpu-operator/nvidia-dcgm-exporter-x"], True)):
        actions.operands = NS(wait_s=0.1, wait_gone=lambda keys, left=left: left)
        a = actions._reset_paused(cmd, gpu, _Steps(), ["nvidia.com/gpu.deploy.dcgm-exporter"], None)
        assert a.outcome == "refused" and a.final is final, (left, a.detail)


def test_holders_whose_pods_cannot_be_seen_refuse_the_reset_not_final(tmp_path):
    """Before: _holders' PodViewError left RESET_GPU FAILED (the processor climbs to a reboot)."""
    actions = _actions(tmp_path)
    actions.gpu_ops = NS(holders=lambda gpu: [4242], procfs=object(), release=lambda: None)
    actions.operands = NS(wait_s=0.1, wait_gone=lambda keys: [])
    a = actions._reset_paused(command("gpu-node-1", "RESET_GPU"), NS(index=2, uuid="GPU-1", minor=2), _Steps(),
                              [], None)
    assert a.outcome == "refused" and not a.final and "cannot tell who holds GPU 2" in a.detail, a.detail
