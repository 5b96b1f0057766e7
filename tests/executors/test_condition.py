"""The GPUHealthy condition's text (executors.cluster.condition_for), pure; its life on a real API
server is tests/integration/test_executors_cluster.py."""

from __future__ import annotations

from types import SimpleNamespace

from xidstream.executors.cluster import condition_for


def test_the_strongest_holder_names_it_and_a_gpu_without_an_index_is_named_by_its_uuid():
    held = {"b": {"gpu": "GPU-b", "gpu_index": 3, "action": "GPUQuarantined", "at": "t1", "why": "2 processes"},
            "a": {"gpu": "GPU-a", "gpu_index": None, "action": "GPUFaultCordonedNode", "at": "t0"}}
    c = condition_for(held)
    assert (c["type"], c["status"], c["reason"]) == ("GPUHealthy", "False", "GPUFaultCordonedNode")
    assert c["message"] == ("incident a: GPU GPU-a GPUFaultCordonedNode since t0; "
                            "incident b: GPU 3 (GPU-b) GPUQuarantined since t1: 2 processes")
    assert c["lastTransitionTime"] == c["lastHeartbeatTime"]  # new condition: it moved now


def test_true_when_none_holds_it_and_the_transition_time_moves_only_with_the_status():
    was = SimpleNamespace(status="False", lastTransitionTime="2026-12-01T00:00:00Z")
    c = condition_for({}, was)
    assert (c["status"], c["reason"]) == ("True", "NoOpenGPUIncident") and c["lastTransitionTime"] != was.lastTransitionTime
    same = condition_for({"x": {"gpu": "g", "gpu_index": 0, "action": "GPUQuarantined", "at": "t"}}, was)
    assert same["lastTransitionTime"] == "2026-12-01T00:00:00Z"


def test_a_holder_annotation_the_node_rewrote_never_crashes_the_executor():
    # The incidents annotation lives on the Node, which the node's own kubelet credentials may
    # write: an unknown reason, a number or a list as "action" must not raise (a TypeError from
    # comparing None with an int crashed the cluster executor on every later command for the node).
    from xidstream.executors.cluster import _condition_holders

    node = SimpleNamespace(metadata=SimpleNamespace(annotations={"xidstream.io/gpu-incidents": (
        '{"a": {"action": "SomethingNew"}, "b": {"action": 5}, "c": {"action": ["x"]}, '
        '"d": {"action": "GPUQuarantined", "gpu": "g", "gpu_index": 0, "at": "t"}, "e": 7}')}))
    held = _condition_holders(node)
    assert sorted(held) == ["a", "b", "c", "d"]
    assert {k: v["action"] for k, v in held.items()} == {"a": "SomethingNew", "b": "", "c": "", "d": "GPUQuarantined"}
    c = condition_for(held)
    assert (c["status"], c["reason"]) == ("False", "GPUQuarantined")


def test_the_replacement_condition_is_true_only_while_a_replace_holds_the_node():
    from xidstream.executors.cluster import replacement_condition_for

    cordon = {"a": {"gpu": "g", "gpu_index": 0, "action": "GPUFaultCordonedNode", "at": "t"}}
    c = replacement_condition_for(cordon)  # a cordon is no request to replace
    assert (c["type"], c["status"], c["reason"]) == ("GPUReplacementRequired", "False", "NoReplacementRequested")
    both = {**cordon, "z": {"action": "ReplacementRequested"}, "m": {"action": "ReplacementRequested"}}
    c = replacement_condition_for(both)
    assert (c["status"], c["reason"]) == ("True", "ReplacementRequested")
    assert c["message"].startswith("xidstream asks for this node's replacement: incident m, z (")
    was = SimpleNamespace(status="True", lastTransitionTime="2026-12-01T00:00:00Z")
    assert replacement_condition_for(both, was)["lastTransitionTime"] == "2026-12-01T00:00:00Z"
    assert replacement_condition_for(cordon, was)["lastTransitionTime"] != "2026-12-01T00:00:00Z"
