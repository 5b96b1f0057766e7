"""`xidstream node down` unmounts what the node left (workshop.localnode.mounts_under)."""

from __future__ import annotations

from pathlib import Path

from workshop.localnode import mounts_under


def test_the_kubelets_own_root_mount_is_unmounted_too_deepest_first(tmp_path):
    """Found at the end of the session: the kubelet bind-mounts its root folder onto itself; only
    mounts strictly below it were unmounted, so every `node down` left one behind and the
    checkout's .xidstream/node could not be deleted."""
    kubelet = tmp_path / "kubelet"
    other = tmp_path / "kubelet-other"
    text = "\n".join([
        f"/dev/vda {kubelet} ext4 rw 0 0",
        f"tmpfs {kubelet}/pods/uid/volumes/kubernetes.io~projected/token tmpfs rw 0 0",
        f"shm {kubelet}/pods/uid/shm tmpfs rw 0 0",
        f"/dev/vda {other} ext4 rw 0 0",  # a sibling whose name only starts the same: not ours
        "/dev/vda / ext4 rw 0 0",
        "",
    ])
    assert mounts_under(text, Path(kubelet)) == [
        f"{kubelet}/pods/uid/volumes/kubernetes.io~projected/token", f"{kubelet}/pods/uid/shm", str(kubelet)]
