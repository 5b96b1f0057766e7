"""A command whose records (or approval) name a node refuses at start a name that is not a
Kubernetes node name, saying which flag to set, rather than send records the processor would
dead-letter (schemas.base `is_node_name`)."""

from __future__ import annotations

import pytest

from xidstream.transport.config import KafkaConfig
from xidstream.cli import main

BAD = ["Gpu_Node_7", "gpu-node-9 --key /dev/null; curl x|sh; echo"]


@pytest.mark.parametrize("name", BAD)
def test_collect_parse_execute_and_approve_refuse_a_node_name_kubernetes_would_not_have(name, tmp_path, capsys):
    log = tmp_path / "kern.log"
    log.write_text("")
    assert main(["keys", "generate", "--out", str(tmp_path / "keys")]) == 0
    key = tmp_path / "keys" / "signing.key"
    capsys.readouterr()
    runs = [
        ["parse", str(log), "--node", name],
        ["collect", "--sink", "stdout", "--once", "--no-nvml", "--no-kubernetes", "--node", name,
         "--kernel-log", f"file:{log}", "--state-dir", str(tmp_path / "state")],
        ["execute", "--scope", "node", "--node", name, "--no-kube", "--stdin", "--state-dir", str(tmp_path / "x")],
        ["approve", "c-1", "--node", name, "--key", str(key)],
    ]
    for argv in runs:
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert "is not a Kubernetes node name" in err and "--node" in err and out == "", argv


def test_the_default_node_name_is_the_host_name_as_the_kubelet_writes_it(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: " GPU-Node-7.Example.COM\n")
    assert KafkaConfig().node == "gpu-node-7.example.com"
