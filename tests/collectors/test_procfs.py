from __future__ import annotations

import os

import pytest

from collectors.sources.procfs import ProcFs, parse_cgroup

POD = "1b2c3d4e-5f60-4718-9abc-def012345678"
CID = "a" * 40 + "0123456789abcdef01234567"


@pytest.mark.parametrize(
    "text, pod, container",
    [
        # cgroup v2, systemd driver, containerd
        (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
         POD, CID),
        # cgroup v2, CRI-O
        (f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope\n", POD, CID),
        # cgroup v1, cgroupfs driver (several controllers)
        (f"12:pids:/kubepods/besteffort/pod{POD}/{CID}\n11:memory:/kubepods/besteffort/pod{POD}/{CID}\n0::/\n",
         POD, CID),
        # plain Docker, no Kubernetes
        (f"0::/system.slice/docker-{CID}.scope\n", None, CID),
        # a host process
        ("0::/user.slice/user-0.slice/session-3.scope\n", None, None),
        ("", None, None),
        ("garbage without colons\n", None, None),
    ],
)
def test_parse_cgroup(text, pod, container):
    ref = parse_cgroup(text)
    assert (ref.pod_uid, ref.container_id) == (pod, container)


def test_device_holders_and_pod_lookup_from_a_proc_copy(tmp_path):
    proc = tmp_path / "proc"
    devs = tmp_path / "dev"
    devs.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "null"):
        (devs / name).write_text("")
    for pid, opened, cg in [
        (100, ["nvidia0", "nvidiactl", "null"], f"0::/kubepods/pod{POD}/{CID}\n"),
        (200, ["nvidia1"], "0::/system.slice/dcgm.service\n"),
        (300, ["null"], "0::/\n"),
    ]:
        fd = proc / str(pid) / "fd"
        fd.mkdir(parents=True)
        for i, name in enumerate(opened):
            os.symlink(devs / name, fd / str(i + 3))
        (proc / str(pid) / "cgroup").write_text(cg)
        (proc / str(pid) / "comm").write_text(f"proc{pid}\n")
        (proc / str(pid) / "stat").write_text("x")
    (proc / "self").mkdir()
    fs = ProcFs(proc, dev_prefix=str(devs / "nvidia"))
    assert fs.device_holders() == {
        str(devs / "nvidia0"): [100], str(devs / "nvidiactl"): [100], str(devs / "nvidia1"): [200]}
    assert fs.pod_of(100).pod_uid == POD and fs.pod_of(100).container_id == CID
    assert fs.pod_of(200).pod_uid is None
    assert fs.pod_of(999).pod_uid is None  # gone: no error
    assert fs.comm(100) == "proc100" and fs.comm(999) is None
