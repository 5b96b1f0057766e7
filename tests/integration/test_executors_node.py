"""The node executor: RESET_GPU preconditions checked at the moment of acting against the real API
server (cordoned, drained) and the collector's fakes for the GPU side (FakePynvml through the
collector's own NvmlReader; a /proc copy through its ProcFs holder scan); REBOOT_NODE's sentinel."""

from __future__ import annotations

import os
import uuid

import pytest

from xidstream.collectors.fakes import FakeGpu, FakeProcess, FakePynvml
from xidstream.collectors.sources.procfs import ProcFs
from xidstream.executors.gpureset import NvidiaSmi
from xidstream.executors.kube import make_client
from xidstream.executors.node import NodeActions, NvmlGpuOps
from xidstream.executors.runner import Executor
from xidstream.schemas.vocab import Outcome
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
        self.smi = FakeSmi(self)
        self.ops = NvmlGpuOps(self.nvml, ProcFs(root=self.proc), smi=NvidiaSmi("/usr/bin/nvidia-smi", run=self.smi),
                              verify_interval=0.0)
        self.sentinel = tmp_path / "run" / "reboot-required"
        self.actions = NodeActions(make_client(kube.kubeconfig), node, self.ops, reboot_sentinel=self.sentinel,
                                   state_dir=tmp_path / "s", precondition_poll=0.1, operand_wait=5.0)
        self.ex = Executor(scope="node", node=node, keys=verify, actions=self.actions, state_dir=tmp_path / "s",
                           apply=True)

    def hold_device(self, pid: int, dev: str, comm: str | None = None, pod_uid: str | None = None) -> None:
        fd = self.proc / str(pid) / "fd"
        fd.mkdir(parents=True)
        os.symlink(dev, fd / "5")
        if comm:
            (self.proc / str(pid) / "comm").write_text(comm + "\n")
        if pod_uid:
            (self.proc / str(pid) / "cgroup").write_text(
                f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice/"
                f"cri-containerd-{'a' * 64}.scope\n")

    def release_device(self, pid: int) -> None:
        """The process exits: its /proc entry goes at once (renamed away, then removed), never half
        (a scan that met a half-removed entry saw a holder with no name and no pod)."""
        import shutil

        gone = self.proc.parent / f"gone-{pid}-{uuid.uuid4().hex[:6]}"
        os.rename(self.proc / str(pid), gone)
        shutil.rmtree(gone)


class FakeSmi:
    """A recorded nvidia-smi: every call's arguments, in order; the reset's exit code and
    persistence mode as a test sets them."""

    def __init__(self, rig: "Rig") -> None:
        self.rig, self.calls = rig, []
        self.persistence = {UUID1: "Enabled"}
        self.reset_code, self.reset_text = 0, "GPU 00000000:02:00.0 was successfully reset."

    def __call__(self, argv: list[str], timeout: float) -> tuple[int, str]:
        args = argv[1:]
        self.calls.append(" ".join(args))
        uuid_ = args[-1]
        if args[0].startswith("--query-gpu=persistence_mode"):
            return 0, self.persistence.get(uuid_, "Disabled")
        if args[0] == "-pm":
            self.persistence[uuid_] = "Enabled" if args[1] == "1" else "Disabled"
            return 0, f"Persistence mode set to {self.persistence[uuid_]} for GPU {uuid_}."
        if args[0] == "--gpu-reset":
            if self.reset_code == 0:
                self.rig.resets.append(1)
                self.rig.gpu.status = "ok"  # what a successful reset does: the wedged context is gone
                self.rig.gpu.utilization_gpu_pct = 0.0
            return self.reset_code, self.reset_text
        return 2, f"unexpected call {args}"


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
    assert r.outcome == Outcome.refused and not r.final, r.detail  # it may hold later: an operator's
    assert "after waiting 0.6 s for the node to be cordoned and drained" in r.detail
    for words in (f"node {node} is not cordoned", f"not drained: 1 pod(s) still on it: {ns}/still-{RUN}",
                  "compute process(es) on GPU 1: pid 4242"):
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
    assert rig.resets == [1] and "healthy: recovery action" in r.detail and "3 clean sample(s)" in r.detail
    assert "the /dev/nvidia holder scan decided" in r.detail
    assert "XidstreamGpuReset" in [e["reason"] for e in node_events(kube, node)]
    assert rig.ex.handle(cmd).detail.startswith("already carried out") and rig.resets == [1]


def test_reset_waits_for_the_collectors_nvml_release_and_lets_it_resume(kube, tmp_path):
    """The handshake (collectors.nvml.NvmlRelease): the collector, ticking in its own thread with
    its own fake NVML, has shut NVML down when the reset runs, and samples again afterwards."""
    import threading
    import time
    from datetime import datetime, timezone

    from xidstream.collectors.agent import Collector, CollectorConfig
    from xidstream.collectors.nvml import NvmlReader, NvmlRelease
    from xidstream.collectors.sink import MemorySink

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
    inner = rig.ops.reset
    rig.ops.reset = lambda g: (seen.append(theirs.initialized), inner(g))[1]
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


# -- the reset on a node run by the GPU Operator (issue 41) ----------------------------------------

OPERANDS = {"device-plugin": "nvidia-device-plugin", "gpu-feature-discovery": "gpu-feature-discovery",
            "dcgm-exporter": "nv-hostengine"}  # label -> the task name its pod's process holds the GPU with
LABEL = "nvidia.com/gpu.deploy."


def label_node(kube, node: str, labels: dict) -> None:
    status, body = kube.request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": labels}},
                                content_type="application/merge-patch+json")
    assert status == 200, body


def cordon(kube, node: str) -> None:
    status, body = kube.request("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}},
                                content_type="application/merge-patch+json")
    assert status == 200, body


class OperatorNode:
    """What the GPU Operator's DaemonSet controller does for one node: an operand's pod runs while
    its nvidia.com/gpu.deploy.<operand> label is "true" and is deleted otherwise; each pod's process
    holds /dev/nvidia1 (the rig's /proc copy) while it runs. `leave=False`: pods that never leave."""

    def __init__(self, kube, rig: Rig, ns: str, node: str, operands: dict = OPERANDS, leave: bool = True):
        import threading

        self.kube, self.rig, self.ns, self.node, self.operands, self.leave = kube, rig, ns, node, operands, leave
        self.pods: dict[str, tuple[str, int]] = {}  # label -> (pod name, pid)
        self.next_pid = 3000
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.history: list[tuple[str, str]] = []  # (label, "gone" | "back")
        self.sync()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def labels(self) -> dict:
        return get_node(self.kube, self.node)["metadata"].get("labels") or {}

    def sync(self) -> None:
        with self.lock:
            labels = self.labels()
            for op, comm in self.operands.items():
                key = LABEL + op
                want = labels.get(key) == "true"
                if want and key not in self.pods:
                    name = f"{op}-{uuid.uuid4().hex[:5]}"
                    status, body = self.kube.request("POST", f"/api/v1/namespaces/{self.ns}/pods", {
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name, "labels": {"app": f"nvidia-{op}"},
                                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": op,
                                                          "uid": str(uuid.uuid4()), "controller": True}]},
                        "spec": {"nodeName": self.node, "nodeSelector": {key: "true"},
                                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
                    assert status == 201, body
                    self.kube.mark_pod_running_ready(self.ns, name)
                    self.next_pid += 1
                    self.rig.hold_device(self.next_pid, "/dev/nvidia1", comm=comm, pod_uid=body["metadata"]["uid"])
                    self.pods[key] = (name, self.next_pid)
                    self.history.append((op, "back"))
                elif not want and key in self.pods and self.leave:
                    name, pid = self.pods.pop(key)
                    # as the kubelet does: the pod's processes stop before the pod object goes
                    self.rig.release_device(pid)
                    self.kube.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}?gracePeriodSeconds=0")
                    self.history.append((op, "gone"))

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - the next round tries again
                pass
            self.stop.wait(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def operator_rig(kube, ns, tmp_path, suffix: str, labels: dict | None = None, leave: bool = True):
    node = make_node(kube, suffix)
    base = {LABEL + op: "true" for op in OPERANDS}
    base.update({LABEL + "driver": "true"})  # never paused: persistenced lives in the driver container
    base.update(labels or {})
    label_node(kube, node, base)
    cordon(kube, node)
    rig = Rig(kube, tmp_path, node)
    rig.hold_device(2001, "/dev/nvidia1", comm="nvidia-persiste")  # the driver container's persistenced
    return node, rig, OperatorNode(kube, rig, ns, node, leave=leave)


def test_reset_pauses_the_operator_operands_turns_persistence_off_and_restores_both_exactly(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-ok", {LABEL + "dcgm": "false"})
    try:
        before = op.labels()
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.succeeded, r.detail
        assert [s.step for s in r.steps] == ["cordoned_drained", "holders_classified", "operands_paused", "operands_gone",
                                             "persistence_off", "reset", "verified", "persistence_restored",
                                             "operands_restored"]
        assert all(s.ok for s in r.steps) and r.steps[0].at <= r.steps[-1].at
        # each operand's pod left before the reset and came back after; dcgm stayed "false"
        assert {o for o, what in op.history if what == "gone"} == set(OPERANDS)
        # persistence mode read, off, reset, on again: in that order, by UUID
        assert rig.smi.calls == [f"--query-gpu=persistence_mode --format=csv,noheader -i {UUID1}", f"-pm 0 -i {UUID1}",
                                 f"--gpu-reset -i {UUID1}", f"-pm 1 -i {UUID1}"]
        assert op.labels() == before  # exactly what was there, the "false" and the driver's "true" too
        assert "nvidia-persistenced" in r.steps[1].detail and "GPU Operator operand" in r.steps[1].detail
        assert not list((tmp_path / "s").glob("operands-*.json"))  # the journal is gone once all is back
    finally:
        op.close()


def test_reset_with_persistence_already_off_never_touches_it(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-pmoff")
    try:
        rig.smi.persistence[UUID1] = "Disabled"
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.succeeded, r.detail
        assert not [c for c in rig.smi.calls if c.startswith("-pm")]
        assert rig.smi.persistence[UUID1] == "Disabled"
    finally:
        op.close()


def test_reset_refused_while_a_driver_upgrade_pauses_an_operand_and_its_labels_are_left_alone(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-upgrade", {LABEL + "dcgm-exporter": "paused-for-driver-upgrade"})
    rig.actions.operands.wait_s = 0.5
    try:
        before = op.labels()
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.refused and not r.final, r.detail
        assert f"{LABEL}dcgm-exporter=paused-for-driver-upgrade (another controller's pause)" in r.detail
        assert op.labels() == before and rig.resets == [] and rig.smi.calls == []
    finally:
        op.close()


def test_an_operand_that_never_leaves_refuses_for_good_and_the_labels_come_back(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-stuck", leave=False)
    rig.actions.operands.wait_s = 0.6
    try:
        before = op.labels()
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.refused and r.final, r.detail
        assert "did not leave within 0.6 s" in r.detail and rig.resets == []
        assert op.labels() == before
        assert [s.step for s in r.steps][-2:] == ["operands_gone", "operands_restored"]
        assert not r.steps[-2].ok and r.steps[-1].ok
    finally:
        op.close()


def test_a_label_another_controller_changed_while_paused_is_left_to_it(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-changed")
    inner = rig.ops.reset

    def meanwhile(gpu):  # the driver-upgrade manager starts while the reset runs
        labels = op.labels()
        label_node(kube, node, {LABEL + "device-plugin": labels[LABEL + "device-plugin"] + "_paused-for-driver-upgrade",
                                LABEL + "gpu-feature-discovery": "false"})
        return inner(gpu)

    rig.ops.reset = meanwhile
    try:
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.succeeded, r.detail
        labels = op.labels()
        # ours with its suffix: what it would have written over "true"; the "false" is someone else's
        assert labels[LABEL + "device-plugin"] == "paused-for-driver-upgrade"
        assert labels[LABEL + "gpu-feature-discovery"] == "false"
        assert labels[LABEL + "dcgm-exporter"] == "true"
        last = r.steps[-1]
        assert last.step == "operands_restored" and not last.ok and "gpu-feature-discovery is 'false'" in last.detail
        assert "XidstreamOperandsNotRestored" in [e["reason"] for e in node_events(kube, node)]
    finally:
        op.close()


@pytest.mark.parametrize("code,text,outcome,final", [
    (3, "The requested operation is not available on target device", Outcome.refused, True),
    (15, "GPU has fallen off the bus", Outcome.failed, False),
    (255, "The following GPUs could not be reset: GPU 00000000:02:00.0: In use by another client", Outcome.failed, False),
])
def test_reset_exit_codes_and_everything_restored_after_them(kube, ns, tmp_path, code, text, outcome, final):
    node, rig, op = operator_rig(kube, ns, tmp_path, f"op-exit{code}")
    try:
        before = op.labels()
        rig.smi.reset_code, rig.smi.reset_text = code, text
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert (r.outcome, r.final) == (outcome, final), r.detail
        assert f"exit {code}" in r.detail
        assert rig.smi.calls[-1] == f"-pm 1 -i {UUID1}" and rig.smi.persistence[UUID1] == "Enabled"
        assert op.labels() == before
    finally:
        op.close()


def test_a_workload_holding_the_gpu_refuses_for_good_naming_its_pod(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-workload")
    try:
        status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"agent-{RUN}", "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": str(uuid.uuid4()), "controller": True}]},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
        assert status == 201, body
        rig.hold_device(4100, "/dev/nvidia1", comm="python3", pod_uid=body["metadata"]["uid"])
        before = op.labels()
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.refused and r.final, r.detail
        assert f"pid 4100 (python3) in pod {ns}/agent-{RUN}: a workload" in r.detail
        assert op.labels() == before and rig.smi.calls == []  # nothing was paused
    finally:
        op.close()


def test_an_executor_killed_between_pause_and_restore_restores_at_its_next_start(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-killed")
    try:
        before = op.labels()

        class Killed(BaseException):  # not an Exception: nothing in the executor catches it, as with SIGKILL
            pass

        def die(gpu):
            raise Killed()

        rig.ops.reset = die
        real_restore = rig.actions.operands.restore
        rig.actions.operands.restore = lambda pause: []  # the process is gone: no restore runs
        rig.actions._restore_persistence = lambda pause: []
        with pytest.raises(Killed):
            rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert op.labels()[LABEL + "device-plugin"] == "paused-for-gpu-reset"
        assert rig.smi.persistence[UUID1] == "Disabled"
        rig.actions.operands.restore = real_restore
        # a new executor on the same state dir: its start restores persistence mode, then the labels
        again = NodeActions(make_client(kube.kubeconfig), node, rig.ops, state_dir=tmp_path / "s")
        assert again.recover() == []
        assert op.labels() == before and rig.smi.persistence[UUID1] == "Enabled"
        assert again.recover() == []  # nothing left to do
    finally:
        op.close()


# -- REBOOT_NODE: backends, and a reboot confirmed by the node's bootID ------------------------------

def set_boot(kube, node: str, boot_id: str, ready: bool = True) -> None:
    now = __import__("time").strftime("%Y-%m-%dT%H:%M:%SZ", __import__("time").gmtime())
    status, body = kube.request("PATCH", f"/api/v1/nodes/{node}/status", {"status": {
        "nodeInfo": {"bootID": boot_id, "machineID": "m", "systemUUID": "s", "kernelVersion": "6", "osImage": "d",
                     "containerRuntimeVersion": "containerd://2", "kubeletVersion": "v1.34.3",
                     "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady",
                        "message": "", "lastHeartbeatTime": now, "lastTransitionTime": now}]}},
        content_type="application/merge-patch+json")
    assert status == 200, body


def test_kured_backend_refuses_for_good_when_no_kured_runs_on_the_node(kube, tmp_path):
    node = make_node(kube, "reboot-nokured")
    rig = Rig(kube, tmp_path, node)
    r = rig.ex.handle(rig.key.sign(command("some-other-node", "REBOOT_NODE")))
    assert r.outcome == Outcome.refused and "for node some-other-node" in r.detail
    r = rig.ex.handle(rig.key.sign(command(node, "REBOOT_NODE")))
    assert r.outcome == Outcome.refused and r.final, r.detail
    assert f"kured is not running on node {node}" in r.detail and not rig.sentinel.exists()


def test_kured_reboot_is_answered_only_once_the_boot_id_changed_the_node_is_ready_and_the_gpu_back(kube, ns, tmp_path):
    node = make_node(kube, "reboot-kured")
    set_boot(kube, node, "boot-1")
    status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"kured-{RUN}", "labels": {"name": "kured"}},
        "spec": {"nodeName": node, "containers": [{"name": "kured", "image": "ghcr.io/kubereboot/kured:1.17.1",
                                                   "command": ["/usr/bin/kured", "--period=10m"]}]}})
    assert status == 201, body
    rig = Rig(kube, tmp_path, node)
    clock = [1000.0]
    rig.actions = NodeActions(make_client(kube.kubeconfig), node, rig.ops, reboot_sentinel=rig.sentinel,
                              state_dir=tmp_path / "s", clock=lambda: clock[0])
    rig.ex.actions = rig.actions
    cmd = rig.key.sign(command(node, "REBOOT_NODE"))
    assert rig.ex.handle(cmd) is None  # asked: no answer until the reboot is seen
    assert rig.sentinel.exists() and "every 10m" in (tmp_path / "s" / f"reboots-{node}.json").read_text()
    assert rig.ex.handle(cmd) is None  # read again before the cursor moved: still no answer, not "interrupted"
    clock[0] += 60
    assert rig.ex.due() == []  # same bootID, within the bound
    # the executor restarts after the reboot (a new one on the same state dir) ...
    set_boot(kube, node, "boot-2", ready=False)
    rig.gpu.status = "ok"
    after = NodeActions(make_client(kube.kubeconfig), node, rig.ops, reboot_sentinel=rig.sentinel,
                        state_dir=tmp_path / "s", clock=lambda: clock[0])
    ex2 = Executor(scope="node", node=node, keys=rig.ex.keys, actions=after, state_dir=tmp_path / "s", apply=True)
    assert ex2.due() == []  # rebooted but not Ready yet
    set_boot(kube, node, "boot-2", ready=True)
    clock[0] += 20
    (r,) = ex2.due()
    assert r.outcome == Outcome.succeeded and r.command_id == cmd.command_id, r.detail
    assert [s.step for s in r.steps] == ["boot_id_recorded", "reboot_requested", "rebooted", "node_ready", "gpu_back"]
    assert "boot-1 -> boot-2" in r.detail
    assert ex2.due() == [] and ex2.handle(cmd).detail.startswith("already carried out")


def test_a_reboot_not_seen_within_its_bound_fails_so_the_ladder_climbs(kube, ns, tmp_path):
    from xidstream.executors.reboot import LogindReboot

    node = make_node(kube, "reboot-never")
    cordon(kube, node)
    set_boot(kube, node, "boot-1")
    rig = Rig(kube, tmp_path, node)
    asked: list = []
    clock = [5000.0]
    rig.actions = NodeActions(make_client(kube.kubeconfig), node, rig.ops, state_dir=tmp_path / "s",
                              reboot_backend=LogindReboot(run=lambda argv: (asked.append(argv), (0, ""))[1]),
                              clock=lambda: clock[0])
    rig.ex.actions = rig.actions
    assert rig.actions.reboot_confirm_s == 900.0
    assert rig.ex.handle(rig.key.sign(command(node, "REBOOT_NODE"))) is None
    assert asked and asked[0][-4:] == ["org.freedesktop.login1.Manager", "Reboot", "b", "false"]
    clock[0] += 899
    assert rig.ex.due() == []
    clock[0] += 11
    (r,) = rig.ex.due()
    assert r.outcome == Outcome.failed and "was not seen to reboot within 910 s" in r.detail and "boot-1" in r.detail


def test_logind_backend_waits_for_the_drain_and_refuses_without_it(kube, ns, tmp_path):
    from xidstream.executors.reboot import LogindReboot

    node = make_node(kube, "reboot-undrained")
    make_pod(kube, ns, f"busy-{RUN}", node)
    rig = Rig(kube, tmp_path, node)
    asked: list = []
    rig.actions = NodeActions(make_client(kube.kubeconfig), node, rig.ops, state_dir=tmp_path / "s",
                              reboot_backend=LogindReboot(run=lambda argv: (asked.append(argv), (0, ""))[1]),
                              precondition_wait=0.3, precondition_poll=0.1)
    rig.ex.actions = rig.actions
    r = rig.ex.handle(rig.key.sign(command(node, "REBOOT_NODE")))
    assert r.outcome == Outcome.refused and "not cordoned" in r.detail and f"busy-{RUN}" in r.detail, r.detail
    assert asked == []


# -- found by a review (attack) of the above --------------------------------------------------------

def test_an_operand_a_driver_upgrade_gives_back_while_the_reset_waits_is_paused_too(kube, ns, tmp_path):
    """The labels to pause are read after the wait for another controller, not before it: an operand
    the upgrade brings back to "true" meanwhile holds the GPU again and must be paused with the rest
    (read before, it was not, and the reset was refused for good: a reboot for nothing)."""
    import threading
    import time

    node, rig, op = operator_rig(kube, ns, tmp_path, "op-waited", {LABEL + "device-plugin": "paused-for-driver-upgrade"})
    done = threading.Timer(1.0, lambda: label_node(kube, node, {LABEL + "device-plugin": "true"}))
    try:
        done.start()
        t0 = time.monotonic()
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.succeeded, r.detail
        assert time.monotonic() - t0 >= 1.0
        assert LABEL + "device-plugin: true -> paused-for-gpu-reset" in next(s for s in r.steps if s.step == "operands_paused").detail
        assert op.labels()[LABEL + "device-plugin"] == "true"
    finally:
        done.cancel()
        op.close()


def test_a_label_taken_over_by_another_controller_does_not_keep_the_journal_or_refuse_the_next_reset(kube, ns, tmp_path):
    node, rig, op = operator_rig(kube, ns, tmp_path, "op-taken")
    inner = rig.ops.reset

    def meanwhile(gpu):
        label_node(kube, node, {LABEL + "gpu-feature-discovery": "false"})  # an admin turns GFD off
        return inner(gpu)

    rig.ops.reset = meanwhile
    try:
        r = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert r.outcome == Outcome.succeeded and "NOT RESTORED" in r.detail, r.detail
        assert not list((tmp_path / "s").glob("operands-*.json"))  # theirs now: nothing of ours is left out
        rig.ops.reset = inner
        rig.gpu.utilization_gpu_pct = 100.0
        again = rig.ex.handle(rig.key.sign(command(node, "RESET_GPU")))
        assert again.outcome == Outcome.succeeded, again.detail  # not refused over someone else's label
    finally:
        op.close()


def test_a_reboot_of_a_gpu_known_only_by_its_index_is_confirmed_by_that_index(kube, tmp_path):
    """The collector publishes a GPU NVML refused on a first start under a stand-in PCI id
    (ffff:00:<index>); the REBOOT_NODE planned for it names that id and no UUID. Matched by PCI, the
    GPU was never found after the reboot and a reboot that worked was answered failed."""
    node = make_node(kube, "reboot-index")
    set_boot(kube, node, "boot-1")
    rig = Rig(kube, tmp_path, node)
    clock = [1000.0]
    actions = NodeActions(make_client(kube.kubeconfig), node, rig.ops, state_dir=tmp_path / "s", clock=lambda: clock[0],
                          reboot_backend=__import__("xidstream.executors.reboot", fromlist=["x"]).LogindReboot(run=lambda argv: (0, "")))
    actions.precondition_wait = 0.0
    cordon(kube, node)
    rig.ex.actions = actions
    cmd = rig.key.sign(command(node, "REBOOT_NODE", gpu_uuid=None, pci_bus_id="ffff:00:01", gpu_index=1))
    assert rig.ex.handle(cmd) is None
    set_boot(kube, node, "boot-2")
    rig.gpu.status = "ok"
    clock[0] += 30
    (r,) = rig.ex.due()
    assert r.outcome == Outcome.succeeded and "GPU 1 back" in r.detail, r.detail


def test_a_kured_reboot_not_seen_in_time_takes_its_sentinel_back(kube, ns, tmp_path):
    node = make_node(kube, "reboot-kured-late")
    set_boot(kube, node, "boot-1")
    status, body = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"kured-late-{RUN}", "labels": {"name": "kured"}},
        "spec": {"nodeName": node, "containers": [{"name": "kured", "image": "ghcr.io/kubereboot/kured:1.17.1"}]}})
    assert status == 201, body
    rig = Rig(kube, tmp_path, node)
    clock = [1000.0]
    rig.ex.actions = NodeActions(make_client(kube.kubeconfig), node, rig.ops, reboot_sentinel=rig.sentinel,
                                 state_dir=tmp_path / "s", clock=lambda: clock[0])
    assert rig.ex.handle(rig.key.sign(command(node, "REBOOT_NODE"))) is None and rig.sentinel.exists()
    clock[0] += 5400
    (r,) = rig.ex.due()
    assert r.outcome == Outcome.failed and "removed the sentinel" in r.detail, r.detail
    assert not rig.sentinel.exists()  # kured must not reboot the node later, unasked
