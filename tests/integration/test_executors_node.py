"""The node executor: RESET_GPU preconditions checked at the moment of acting against the real API
server (cordoned, drained) and the collector's fakes for the GPU side (FakePynvml through the
collector's own NvmlReader; a /proc copy through its ProcFs holder scan); REBOOT_NODE's sentinel."""

from __future__ import annotations

import os
import uuid

import pytest

from collectors.fakes import FakeGpu, FakeProcess, FakePynvml
from collectors.sources.procfs import ProcFs
from executors.kube import make_client
from executors.node import NodeActions, NvmlGpuOps
from executors.runner import Executor
from schemas.vocab import Outcome
from tests.executors.helpers import UUID1, command, keypair
from tests.integration.test_executors_cluster import get_node, make_node, make_pod, node_events, snapshot

pytestmark = pytest.mark.kube

RUN = uuid.uuid4().hex[:6]


@pytest.fixture(scope="module")
def ns(kube):
    name = f"xs-node-{RUN}"
    kube.ensure_namespace(name)
    return name


class Rig:
    def __init__(self, kube, tmp_path, node: str):
        self.key, verify, _, _ = keypair(tmp_path)
        # wedged (Xid 43): NVML still answers, utilization pinned
        self.gpu = FakeGpu(index=1, uuid=UUID1, pci_bus_id="00000000:02:00.0", utilization_gpu_pct=100.0)
        self.nvml = FakePynvml([FakeGpu(index=0, uuid="GPU-00000000-aaaa-bbbb-cccc-000000000000",
                                        pci_bus_id="00000000:01:00.0"), self.gpu])
        self.proc = tmp_path / "proc"
        self.proc.mkdir()
        self.resets: list[int] = []

        def reset(index: int) -> tuple[bool, str]:
            self.resets.append(index)
            self.gpu.status = "ok"  # what a successful reset does
            return True, f"GPU {index} reset"

        self.ops = NvmlGpuOps(self.nvml, ProcFs(root=self.proc), reset_fn=reset)
        self.sentinel = tmp_path / "run" / "reboot-required"
        self.actions = NodeActions(make_client(kube.kubeconfig), node, self.ops, reboot_sentinel=self.sentinel)
        self.ex = Executor(scope="node", node=node, keys=verify, actions=self.actions, state_dir=tmp_path / "s",
                           apply=True)

    def hold_device(self, pid: int, dev: str) -> None:
        fd = self.proc / str(pid) / "fd"
        fd.mkdir(parents=True)
        os.symlink(dev, fd / "5")


def test_reset_refused_while_any_precondition_fails_naming_each(kube, ns, tmp_path):
    node = make_node(kube, "reset-no")
    rig = Rig(kube, tmp_path, node)
    make_pod(kube, ns, f"still-{RUN}", node)
    rig.gpu.processes = [FakeProcess(pid=4242, used_memory_mib=0.0)]
    rig.hold_device(777, "/dev/nvidia1")
    rig.hold_device(778, "/dev/nvidia0")  # another GPU's holder is no reason
    rig.actions.precondition_wait, rig.actions.precondition_poll = 0.6, 0.2  # never cordoned here
    before = snapshot(kube, node, ns)
    r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
    # refused, not failed: the reset never started, and a failed reset climbs to a reboot
    assert r.outcome == Outcome.refused, r.detail
    assert "after waiting 0.6 s for the node to be cordoned and drained" in r.detail
    for words in (f"node {node} is not cordoned", f"not drained: 1 pod(s) still on it: {ns}/still-{RUN}",
                  "compute process(es) on GPU 1: pid 4242", "/dev/nvidia1 is held open by pid 777"):
        assert words in r.detail, (words, r.detail)
    assert "778" not in r.detail and rig.resets == []
    after = snapshot(kube, node, ns)
    assert after["pods"] == before["pods"] and after["events"] == before["events"] + 1  # the refusal's Event


def test_reset_refused_when_the_holder_scan_could_not_read_a_process(kube, tmp_path, monkeypatch):
    """Found by review: an unprivileged node executor (SYS_PTRACE only) cannot list a non-root
    process's /proc/<pid>/fd, and the scan took that process for one that holds nothing."""
    node = make_node(kube, "reset-blind")
    kube.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}},
                 content_type="application/merge-patch+json")
    rig = Rig(kube, tmp_path, node)
    rig.hold_device(905, "/dev/nvidia1")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: (_ for _ in ()).throw(PermissionError(13, "denied"))
                        if str(p).endswith("/905/fd/") else real(p))
    r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
    assert r.outcome == Outcome.refused, r.detail
    assert "could not read /proc/<pid>/fd of 1 process(es) (pid 905)" in r.detail and "CAP_DAC_READ_SEARCH" in r.detail
    assert rig.resets == []


def test_reset_that_arrives_before_the_cordon_and_drain_waits_for_them(kube, ns, tmp_path):
    """CORDON_NODE, DRAIN_NODE and RESET_GPU leave the processor together, and the cluster executor's
    drain takes a while: the node executor waits (bounded) for the node to be cordoned and drained
    before it checks the rest, instead of failing at once."""
    import threading
    import time

    node = make_node(kube, "reset-early")
    pod = f"early-{RUN}"
    make_pod(kube, ns, pod, node)
    rig = Rig(kube, tmp_path, node)
    rig.actions.precondition_wait, rig.actions.precondition_poll = 20.0, 0.2
    answer: list = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: answer.append(rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))))
    worker.start()  # the reset arrives first ...
    time.sleep(1.0)
    assert not answer and rig.resets == []  # ... and waits
    kube.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}},
                 content_type="application/merge-patch+json")  # the cordon ...
    time.sleep(0.5)
    assert not answer and rig.resets == []  # cordoned, not drained yet: still waiting
    status, _ = kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{pod}?gracePeriodSeconds=0")  # ... the drain
    assert status == 200
    worker.join(20)
    assert answer, "no answer within the wait"
    r = answer[0]
    assert r.outcome == Outcome.succeeded, r.detail
    assert rig.resets == [1] and time.monotonic() - t0 >= 1.5


def test_reset_runs_when_cordoned_drained_and_idle_and_rereads_the_gpu(kube, tmp_path):
    node = make_node(kube, "reset-ok")
    kube.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}},
                 content_type="application/merge-patch+json")
    rig = Rig(kube, tmp_path, node)
    rig.gpu.status = "reset_required"  # NVML refuses the GPU: its process list is unknown ...
    rig.hold_device(901, "/dev/nvidia0")  # ... and only GPU 0 is held: the holder scan decides
    cmd = rig.key.sign(command(node, "RESET_GPU"))
    r = rig.ex.handle(cmd)
    assert r.outcome == Outcome.succeeded, r.detail
    assert rig.resets == [1] and "NVML reads it again: ok" in r.detail
    assert "the /dev/nvidia holder scan decided" in r.detail
    assert "XidstreamGpuReset" in [e["reason"] for e in node_events(kube, node)]
    assert rig.ex.handle(cmd).detail.startswith("already carried out") and rig.resets == [1]


def test_reboot_writes_the_kured_sentinel_and_other_nodes_commands_are_refused(kube, tmp_path):
    node = make_node(kube, "reboot")
    rig = Rig(kube, tmp_path, node)
    r = rig.ex.handle(rig.key.sign(command("some-other-node", "REBOOT_NODE")))
    assert r.outcome == Outcome.refused and "for node some-other-node" in r.detail
    assert not rig.sentinel.exists()
    r = rig.ex.handle(rig.key.sign(command(node, "REBOOT_NODE")))
    assert r.outcome == Outcome.succeeded, r.detail
    assert rig.sentinel.exists() and "incident" in rig.sentinel.read_text()
    assert "XidstreamReboot" in [e["reason"] for e in node_events(kube, node)]
    assert not get_node(kube, node)["spec"].get("unschedulable")  # kured cordons, not us


def test_reset_waits_for_the_collectors_nvml_release_and_lets_it_resume(kube, tmp_path):
    """The handshake (collectors.nvml.NvmlRelease): the collector, ticking in its own thread with
    its own fake NVML, has shut NVML down when the reset runs, and samples again afterwards."""
    import threading
    import time
    from datetime import datetime, timezone

    from collectors.agent import Collector, CollectorConfig
    from collectors.nvml import NvmlReader, NvmlRelease
    from collectors.sink import MemorySink

    node = make_node(kube, "reset-handshake")
    kube.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}},
                 content_type="application/merge-patch+json")
    rig = Rig(kube, tmp_path, node)
    state = tmp_path / "collector"
    theirs = FakePynvml([FakeGpu(index=1, uuid=UUID1, pci_bus_id="00000000:02:00.0")])  # the collector's process
    collector = Collector(CollectorConfig(node=node), MemorySink(), nvml=NvmlReader(theirs), nvml_events_thread=False,
                          state_dir=state)
    collector.start(datetime.now(timezone.utc))
    stop = threading.Event()

    def ticking() -> None:
        while not stop.is_set():
            collector.tick(datetime.now(timezone.utc))
            stop.wait(0.05)

    seen: list[bool] = []
    inner = rig.ops.reset_fn
    rig.ops.reset_fn = lambda i: (seen.append(theirs.initialized), inner(i))[1]
    rig.actions.collector_release = NvmlRelease(state)
    t = threading.Thread(target=ticking, daemon=True)
    t.start()
    try:
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.succeeded, r.detail
        assert seen == [False]  # the collector held no NVML handle during the reset
        deadline = time.monotonic() + 5
        while not theirs.initialized and time.monotonic() < deadline:
            stop.wait(0.05)
        assert theirs.initialized and not collector.released_for  # sampling again
    finally:
        stop.set()
        t.join(5)
        collector.stop()

    # no collector answers: the reset is refused naming it, and the request is withdrawn
    rig2 = Rig(kube, tmp_path / "two", node)
    rig2.actions.collector_release = NvmlRelease(state)
    rig2.actions.release_timeout = 0.3
    r = rig2.ex.handle(rig2.key.sign(command(node, "RESET_GPU")))
    assert r.outcome == Outcome.refused and "did not release its NVML handles within 0.3 s" in r.detail, r.detail
    assert rig2.resets == [] and NvmlRelease(state).pending() == {}
