"""The GPUHealthy condition's text (executors.cluster.condition_for), pure; its life on a real API
server is tests/integration/test_executors_cluster.py."""

from __future__ import annotations

from types import SimpleNamespace

from executors.cluster import condition_for


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
