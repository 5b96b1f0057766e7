"""The reset's pure parts: the platform's scope rules (nvidia-smi(1) "GPU reset"), who holds a GPU,
nvidia-smi's answers read by their documented return codes, kured found on a node."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from xidstream.collectors.sources.procfs import PodRef
from xidstream.executors.gpureset import AMPERE, HOPPER, NvidiaSmi, Platform, classify_holders, read_platform, reset_scope
from xidstream.executors.operands import PAUSABLE, LABEL_PREFIX, Operands, PAUSE_VALUE
from xidstream.executors.reboot import kured_on_node

PAUSE = tuple(LABEL_PREFIX + p for p in PAUSABLE)


@pytest.mark.parametrize("platform,words", [
    (Platform(name="NVIDIA H100 80GB HBM3", arch=HOPPER, nvswitch=True, fabric_manager=False), None),
    (Platform(name="NVIDIA A100-SXM4-80GB", arch=AMPERE, nvswitch=True, fabric_manager=True), None),
    (Platform(name="NVIDIA GeForce RTX 5090 D", arch=10), None),
    (Platform(), None),  # nothing known: the reset itself answers (exit 3 is then a final refusal)
    (Platform(name="NVIDIA A100-SXM4-80GB", arch=AMPERE, nvswitch=True, fabric_manager=False), "Fabric Manager not running"),
    (Platform(name="NVIDIA A100-SXM4-80GB", arch=AMPERE, nvswitch=True, fabric_manager=None), "cannot see whether Fabric"),
    (Platform(name="Tesla V100-SXM2-32GB", arch=5, nvlink_peers=True), "before Ampere with NVLink peers"),
    (Platform(name="Tesla V100-PCIE-32GB", arch=5, nvlink_peers=False), None),
    (Platform(arch=HOPPER, mig=True), "MIG mode"),
    (Platform(arch=HOPPER, virtualization=2), "vGPU guest"),
    (Platform(name="NVIDIA GB200", arch=10), "NVL72"),
])
def test_reset_scope_follows_the_platform_rules(platform, words):
    why = reset_scope(platform)
    assert (why is None) if words is None else (words in why), why


class FakeNvml:
    NVML_NVLINK_MAX_LINKS = 4
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    def __init__(self, arch, mig=(0, 0), links=(1, 1, 0, 0), remote=2, virt=0):
        self.arch, self.mig, self.links, self.remote, self.virt = arch, mig, links, remote, virt

    def nvmlDeviceGetArchitecture(self, h):
        return self.arch

    def nvmlDeviceGetMigMode(self, h):
        if self.mig is None:
            raise RuntimeError("NotSupported")
        return list(self.mig)

    def nvmlDeviceGetNvLinkState(self, h, link):
        return self.links[link]

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self.remote

    def nvmlDeviceGetVirtualizationMode(self, h):
        return self.virt


def test_read_platform_sees_nvswitch_links_mig_pending_and_tolerates_unsupported_calls():
    p = read_platform(FakeNvml(AMPERE), object(), "NVIDIA A100-SXM4-80GB", False)
    assert (p.arch, p.nvswitch, p.nvlink_peers, p.mig) == (AMPERE, True, True, False)
    assert "Fabric Manager not running" in reset_scope(p)
    assert read_platform(FakeNvml(HOPPER, mig=(0, 1)), object(), "H100", True).mig is True  # pending counts
    p = read_platform(FakeNvml(AMPERE, mig=None, links=(0, 0, 0, 0)), object(), "A10", None)
    assert p.mig is None and p.nvswitch is False and reset_scope(p) is None


def _pod(ns, name, uid, selector=None):
    return NS(metadata=NS(namespace=ns, name=name, uid=uid), spec=NS(nodeSelector=selector))


class Proc:
    def __init__(self, table):
        self.table = table

    def comm(self, pid):
        return self.table[pid][0]

    def pod_of(self, pid):
        return PodRef(self.table[pid][1], None)


def test_holders_are_classified_by_task_name_and_their_pods_selector():
    pods = [_pod("gpu-operator", "nvidia-dcgm-exporter-x", "u1", {LABEL_PREFIX + "dcgm-exporter": "true"}),
            _pod("gpu-operator", "nvidia-driver-daemonset-y", "u2", {LABEL_PREFIX + "driver": "true"}),
            _pod("team-a", "trainer", "u3"),
            _pod("monitoring", "vendor-agent", "u4", {LABEL_PREFIX + "client": "true"})]
    proc = Proc({10: ("nvidia-persiste", "u2"), 11: ("nv-hostengine", "u1"), 12: ("python3", "u3"),
                 13: ("nv-fabricmanage", None), 14: ("nvidia-driver", "u2"), 15: ("agent", "u4"), 16: ("mystery", None)})
    got = {h.pid: h for h in classify_holders([10, 11, 12, 13, 14, 15, 16], proc, pods, PAUSE)}
    assert got[10].kind == "persistenced" and not got[10].blocks  # persistence mode off, wherever it runs
    assert got[11].kind == "operand" and got[11].labels == (LABEL_PREFIX + "dcgm-exporter",) and not got[11].blocks
    assert got[12].kind == "workload" and got[12].blocks and "pod team-a/trainer" in got[12].what
    assert got[13].kind == "fabricmanager" and not got[13].blocks and "never stopped" in got[13].what
    assert got[14].blocks and "we never pause (driver)" in got[14].what  # the driver pod's own process
    assert got[15].kind == "operand"  # a third-party client on the gpu.deploy.client contract
    assert got[16].kind == "unknown" and got[16].blocks and "the host" in got[16].what


def test_a_tenant_naming_its_process_after_a_gpu_daemon_is_not_taken_for_one():
    """/proc/<pid>/comm is the process's own choice: a workload's process called nvidia-persiste or
    nv-fabricmanage is still the workload that holds the GPU; the daemons count only on the host
    or in the GPU Operator's driver pod."""
    pods = [_pod("team-a", "agent", "u3"), _pod("team-b", "job", "u5", {LABEL_PREFIX + "dcgm-exporter": "true"})]
    proc = Proc({20: ("nvidia-persiste", "u3"), 21: ("nv-fabricmanage", "u3"), 22: ("nvidia-persiste", "u9"),
                 23: ("nvidia-persiste", "u5")})
    got = {h.pid: h for h in classify_holders([20, 21, 22, 23], proc, pods, PAUSE)}
    assert got[20].kind == "workload" and got[20].blocks and "pod team-a/agent" in got[20].what
    assert got[21].kind == "workload" and got[21].blocks
    assert got[22].kind == "unknown" and got[22].blocks  # a pod this node's API view does not have
    assert got[23].kind == "operand"  # paused with its operand, not trusted as persistenced


def test_nvidia_smi_is_called_by_uuid_and_its_answers_read_by_return_code():
    calls = []
    answers = {"--query-gpu=persistence_mode": (0, "Enabled"), "-pm": (0, "ok"), "--gpu-reset": (3, "not available")}

    def run(argv, timeout):
        calls.append(argv[1:])
        return answers[argv[1]]

    smi = NvidiaSmi("/x/nvidia-smi", run=run)
    assert smi.persistence("GPU-1") is True
    answers["--query-gpu=persistence_mode"] = (0, "Disabled")
    assert smi.persistence("GPU-1") is False
    answers["--query-gpu=persistence_mode"] = (9, "NVML: GPU is lost")
    assert smi.persistence("GPU-1") is None  # unknown, never "off"
    a = smi.reset("GPU-1")
    assert not a.ok and a.unsupported and not a.off_the_bus and "exit 3" in a.text
    answers["--gpu-reset"] = (15, "GPU has fallen off the bus")
    assert smi.reset("GPU-1").off_the_bus
    assert smi.set_persistence("GPU-1", False).ok
    assert calls[-1] == ["-pm", "0", "-i", "GPU-1"] and calls[-2] == ["--gpu-reset", "-i", "GPU-1"]
    assert NvidiaSmi("/nonexistent/nvidia-smi").reset("GPU-1").code == 127  # not found: an answer, not a crash


def test_conflicts_name_another_controllers_pause_an_upgrade_and_a_pending_mig_change(tmp_path):
    ops = Operands(client=None, node="n", journal=tmp_path / "j.json")
    labels = {LABEL_PREFIX + "device-plugin": "true", LABEL_PREFIX + "dcgm": "paused-for-mig-change",
              LABEL_PREFIX + "gpu-feature-discovery": "true_paused-for-driver-upgrade",
              "nvidia.com/gpu-driver-upgrade-state": "pod-restart-required", "nvidia.com/mig.config.state": "pending"}
    why = " | ".join(ops.conflicts(labels))
    for words in ("dcgm=paused-for-mig-change", "gpu-feature-discovery=true_paused-for-driver-upgrade",
                  "a driver upgrade is in progress", "mig-manager is changing"):
        assert words in why, why
    assert ops.conflicts({LABEL_PREFIX + "dcgm": "true", "nvidia.com/gpu-driver-upgrade-state": "upgrade-done"}) == []
    # our own value with no journal: the value before is unknown, so nothing is guessed
    assert "no journal of ours" in ops.conflicts({LABEL_PREFIX + "dcgm": PAUSE_VALUE})[0]
    # only "true" is paused; "false" and others' values are left alone; the driver never
    assert ops.to_pause({LABEL_PREFIX + "dcgm": "false", LABEL_PREFIX + "device-plugin": "true",
                         LABEL_PREFIX + "driver": "true"}) == [LABEL_PREFIX + "device-plugin"]


def test_kured_is_found_on_the_node_by_its_label_or_image_with_its_period():
    def pod(labels, image, args=()):
        return NS(metadata=NS(labels=labels), status=NS(phase="Running"),
                  spec=NS(containers=[NS(image=image, command=["/usr/bin/kured", *args], args=None)]))

    class Client:
        def __init__(self, pods):
            self.pods = pods

        def list(self, *a, **kw):
            return self.pods

    assert kured_on_node(Client([pod({"app": "x"}, "nginx")]), "n") == (None, "")
    p, period = kured_on_node(Client([pod({"name": "kured"}, "ghcr.io/kubereboot/kured:1.17.1", ["--period=10m"])]), "n")
    assert p is not None and period == "10m"
    p, period = kured_on_node(Client([pod({}, "registry.example/mirror/kured@sha256:abc")]), "n")
    assert p is not None and period.startswith("1h")


def test_fabric_manager_counts_only_as_a_host_process(tmp_path):
    """nv-fabricmanager is seen through hostPID by its task name, which any process may take: a
    tenant's process in a pod named nv-fabricmanage is not Fabric Manager (else an HGX A100 without
    it would get a single-GPU reset that nvidia-smi(1) says needs every NVLink peer)."""
    from xidstream.collectors.fakes import FakePynvml
    from xidstream.collectors.sources.procfs import ProcFs
    from xidstream.executors.node import NvmlGpuOps

    def proc(pid, comm, pod=None):
        d = tmp_path / "proc" / str(pid)
        d.mkdir(parents=True)
        (d / "comm").write_text(comm + "\n")
        (d / "cgroup").write_text(f"0::/kubepods.slice/kubepods-pod{pod.replace('-', '_')}.slice/cri-containerd-{'b' * 64}.scope\n"
                                  if pod else "0::/system.slice/x.service\n")

    proc(1, "systemd")
    proc(400, "nv-fabricmanage", pod="11111111-2222-3333-4444-555555555555")
    ops = NvmlGpuOps(FakePynvml([]), ProcFs(root=tmp_path / "proc"))
    assert ops.fabric_manager_running() is False
    proc(401, "nv-fabricmanage")
    assert ops.fabric_manager_running() is True


def test_the_administrator_capability_is_read_from_the_effective_set():
    """nvidia-smi --gpu-reset and -pm are the driver's administrator calls (capable(CAP_SYS_ADMIN));
    root without the capability is refused them, so the effective set is what counts, not the uid."""
    from xidstream.executors.gpureset import lacks_admin

    status = "Name:\tpython3\nUid:\t0\t0\t0\t0\nCapEff:\t{}\n"
    assert lacks_admin(status.format("00000000a80425fb")) is True  # runc's default set: no SYS_ADMIN
    assert lacks_admin(status.format("0000000000280004")) is False  # SYS_PTRACE, DAC_READ_SEARCH, SYS_ADMIN
    assert lacks_admin(status.format("000001ffffffffff")) is False  # privileged
    assert lacks_admin("Name:\tpython3\n") is None and lacks_admin("CapEff:\tzz\n") is None


def test_an_applying_node_executor_without_cap_sys_admin_says_its_resets_will_fail(tmp_path, monkeypatch, capsys):
    """The default chart grants SYS_ADMIN only with apply; an executor started elsewhere without it
    would have failed every reset after the drain, and only then. Now it says so at start."""
    from xidstream.cli import main

    assert main(["keys", "generate", "--out", str(tmp_path / "keys")]) == 0
    status = tmp_path / "status"
    monkeypatch.setattr("xidstream.executors.gpureset.PROC_STATUS", str(status))
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    argv = ["execute", "--scope", "node", "--node", "gpu-node-1", "--no-kube", "--stdin", "--apply",
            "--verify-key", str(tmp_path / "keys" / "signing.pub"), "--state-dir", str(tmp_path / "x")]
    for caps, warned in (("0000000000080004", True), ("0000000000280004", False)):
        status.write_text(f"CapEff:\t{caps}\n")
        capsys.readouterr()
        main(argv)
        assert ("lacks CAP_SYS_ADMIN" in capsys.readouterr().err) is warned, caps
