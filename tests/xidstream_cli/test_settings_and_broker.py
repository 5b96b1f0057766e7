from __future__ import annotations

import pytest

from xidstream.schemas import BrokerError, ConfigError
from workshop.localbroker import LocalBroker, broker_for_run
from xidstream.settings import Settings


def test_settings_from_env_and_flags():
    s = Settings.from_env({
        "XIDSTREAM_BOOTSTRAP": "k1:9092,k2:9092",
        "XIDSTREAM_TOPIC_PREFIX": "prod.",
        "XIDSTREAM_PARTITIONS": "16",
        "XIDSTREAM_NODE": "gpu-node-7",
        "XIDSTREAM_KAFKA_SECURITY_PROTOCOL": "SSL",
    })
    assert (s.bootstrap, s.topic_prefix, s.partitions, s.node) == ("k1:9092,k2:9092", "prod.", 16, "gpu-node-7")
    assert s.kafka_extra == {"security.protocol": "SSL"}
    assert s.topics.name("gpu.xid") == "prod.gpu.xid"
    assert s.with_(partitions=4, bootstrap=None).partitions == 4
    assert s.with_(bootstrap=None).bootstrap == "k1:9092,k2:9092"


def test_settings_defaults_to_the_local_loopback_broker():
    s = Settings.from_env({})
    assert s.bootstrap == "127.0.0.1:19092" and s.topic_prefix == "" and s.partitions == 8


def test_settings_errors_are_clear():
    with pytest.raises(ConfigError, match="XIDSTREAM_PARTITIONS must be an integer, got 'eight'"):
        Settings.from_env({"XIDSTREAM_PARTITIONS": "eight"})
    with pytest.raises(ConfigError, match="partitions must be >= 1"):
        Settings(partitions=0).validate()


def test_missing_java_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    broker = LocalBroker(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    with pytest.raises(BrokerError, match="Java 17\\+ is needed"):
        broker.start()


def test_missing_maven_is_a_clear_error(monkeypatch, tmp_path):
    import shutil

    java = shutil.which("java")
    if java is None:
        pytest.skip("no java here")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "java").symlink_to(java)
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(bindir))
    broker = LocalBroker(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    with pytest.raises(BrokerError, match="Maven is needed"):
        broker.fetch()


def test_broker_config_binds_loopback_on_non_default_ports(tmp_path):
    broker = LocalBroker(port=29092, controller_port=29093, state_dir=tmp_path)
    text = broker._write_config().read_text()
    assert "listeners=PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093" in text
    assert "auto.create.topics.enable=false" in text
    assert broker.pid() is None and not broker.stop()


def test_a_benchmark_uses_a_given_or_running_broker_and_never_owns_it(kafka_bootstrap):
    """broker_for_run: a given address is used as it is; with none, the running local broker (the
    suite's) is used and not handed back to be stopped."""
    assert broker_for_run("10.0.0.1:9092") == ("10.0.0.1:9092", None)
    bootstrap, broker = broker_for_run(None)
    assert bootstrap == kafka_bootstrap and broker is None


def test_formatting_the_secure_broker_puts_no_password_on_a_command_line(tmp_path, monkeypatch):
    """Any local user reads /proc/PID/cmdline: the SCRAM passwords go to StorageTool in a 0600
    argument file (`java @file`), removed afterwards."""
    import subprocess

    import workshop.localbroker as lb

    seen = []

    def fake_run(argv, **kw):
        if not any(a.startswith("@") for a in argv):  # StorageTool random-uuid
            return subprocess.CompletedProcess(argv, 0, stdout="abcdefghijklmnopqrstuv", stderr="")
        argfile = next(a[1:] for a in argv if a.startswith("@"))
        from pathlib import Path

        p = Path(argfile)
        seen.append((list(argv), p.read_text(), oct(p.stat().st_mode & 0o777)))
        return subprocess.CompletedProcess(argv, 0, stdout="Formatting", stderr="")

    broker = LocalBroker(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", secure=True)
    monkeypatch.setattr(lb.subprocess, "run", fake_run)
    broker._format("java", tmp_path / "server.properties")
    ((argv, content, mode),) = [s for s in seen if "StorageTool" in s[1]]
    passwords = broker._passwords()
    assert all(pw not in " ".join(argv) for pw in passwords.values())
    assert all(f"password={pw}" in content for pw in passwords.values())
    assert mode == "0o600"
    assert not list((tmp_path / "state").glob("*.args"))  # removed after use
