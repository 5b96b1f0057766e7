"""A wrong broker address: each command says once, in words, which address it cannot reach and
what it does meanwhile, with librdkafka's own lines folded through Python logging, not the
`%3|...|FAIL|` line it printed every 50 ms (583 of them in 40 s before `xidstream process` gave
up). The commands run as a user runs them (a subprocess), against a loopback port nothing listens
on; no broker is needed."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from xidstream.collectors.spool import Spool
from xidstream.transport.kafka_log import FoldingKafkaLog, readable

ROOT = Path(__file__).resolve().parents[2]
RAW = "%3|"  # librdkafka's own stderr format: %<syslog level>|<time>|<facility>|...
FAIL = ("[thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: "
        "Connection refused (after {ms}ms in state CONNECT)")


def _closed_port() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XIDSTREAM_")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's modules, whatever the venv's install points at
    return env


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xidstream.cli", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _assert_quiet(out: str, most: int) -> list[str]:
    lines = out.splitlines()
    assert RAW not in out, out[:2000]
    assert len(lines) <= most, out
    return lines


# -- the fold, on its own ------------------------------------------------------------------------
class _Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def _folder() -> tuple[FoldingKafkaLog, _Clock, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.levelname, record.getMessage()))

    target = logging.getLogger("test.kafka_log")
    target.handlers[:] = [Keep()]
    target.propagate, target.level = False, logging.DEBUG
    clock = _Clock()
    return FoldingKafkaLog(target, window_s=30, clock=clock), clock, seen


def _confluent(folder: FoldingKafkaLog, text: str, client: str = "rdkafka#producer-1") -> None:
    folder.log(logging.ERROR, "%s [%s] %s", "FAIL", client, text)  # as confluent-kafka calls it


def test_identical_errors_fold_into_one_line_with_a_count_and_a_new_error_gets_its_own():
    folder, clock, seen = _folder()
    for i in range(213):  # two clients, one broker: one count
        _confluent(folder, FAIL.format(ms=i % 3), client=f"rdkafka#producer-{1 + i % 2}")
        clock.t += 0.142
    assert seen == [("ERROR", "broker 127.0.0.1:1 unreachable: Connection refused"),
                    ("ERROR", "broker 127.0.0.1:1 unreachable: Connection refused (x212 in 30 s)")][:len(seen)]
    assert len(seen) == 2, seen
    seen.clear()
    _confluent(folder, FAIL.format(ms=0))
    _confluent(folder, "[thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap: Failed to resolve 'nohost:1': "
                       "Name or service not known (after 1ms in state CONNECT)")
    # the error changed: the old one's count since its last line, then the new one in words
    assert seen == [("ERROR", "broker 127.0.0.1:1 unreachable: Connection refused (x1 in 1 s)"),
                    ("ERROR", "broker 127.0.0.1:1 unreachable: cannot resolve its name: Name or service not known")]
    seen.clear()
    _confluent(folder, "[thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap: Failed to resolve 'nohost:1': "
                       "Name or service not known (after 3ms in state CONNECT, 4 identical error(s) suppressed)")
    folder.flush()  # at exit, or when the broker answers again
    assert seen == [("ERROR", "broker 127.0.0.1:1 unreachable: cannot resolve its name: Name or service not known (x1 in 1 s)")]
    seen.clear()
    _confluent(folder, FAIL.format(ms=0))  # after a flush the error is news again
    assert seen == [("ERROR", "broker 127.0.0.1:1 unreachable: Connection refused")]


def test_an_error_that_stops_is_summed_up_by_the_next_line_and_other_lines_pass_as_they_are():
    folder, clock, seen = _folder()
    for _ in range(5):
        _confluent(folder, FAIL.format(ms=0))
    clock.t += 31  # a window without a repeat: it cleared
    folder.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "[thrd:app]: Configuration property x is deprecated")
    assert seen == [("ERROR", "broker 127.0.0.1:1 unreachable: Connection refused"),
                    ("ERROR", "broker 127.0.0.1:1 unreachable: Connection refused (x4 in 1 s)"),
                    ("WARNING", "Configuration property x is deprecated")]
    assert readable("no broker here") == ("no broker here", None)
    assert readable("[thrd:sasl_ssl://b-1:9093/1]: sasl_ssl://b-1:9093/1: Connect to ipv4#10.0.0.1:9093 failed: "
                    "Connection refused (after 0ms in state CONNECT)") == (
        "broker b-1:9093 unreachable: Connection refused", "b-1:9093")
    assert folder.latest("127.0.0.1:1") == "broker 127.0.0.1:1 unreachable: Connection refused"
    assert folder.latest("127.0.0.1:2,other:9") is None  # another address: not its cause


# -- the commands --------------------------------------------------------------------------------
def test_process_with_a_closed_port_says_where_and_exits_2_without_librdkafka_lines():
    addr = _closed_port()
    t0 = time.monotonic()
    r = _run(["process", "--bootstrap", addr], timeout=40)
    out = r.stdout + r.stderr
    lines = _assert_quiet(out, 4)
    assert r.returncode == 2, out
    assert lines[-1] == (f"xidstream: error: cannot reach Kafka at {addr} to list topics: no broker answered within 10 s "
                         f"(broker {addr} unreachable: Connection refused); is the address right (--bootstrap, "
                         f"XIDSTREAM_BOOTSTRAP) and a broker running?"), out
    assert f"broker {addr} unreachable: Connection refused" in lines[0]
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_incidents_with_a_closed_port_is_a_sentence_not_a_traceback():
    addr = _closed_port()
    r = _run(["incidents", "--bootstrap", addr], timeout=40)
    out = r.stdout + r.stderr
    lines = _assert_quiet(out, 4)
    assert r.returncode == 2 and "Traceback" not in out, out
    assert lines[-1].startswith(f"xidstream: error: cannot reach Kafka at {addr} to read gpu.alerts"), out
    assert "no broker answered within 15 s" in lines[-1]


XID_LINE = ("NVRM: Xid (PCI:0000:3b:00): 43, pid=4242, name=python3, Ch 00000008")


@pytest.mark.slow
def test_collector_with_a_closed_port_spools_says_where_once_and_keeps_every_record(tmp_path):
    addr = _closed_port()
    kernel = tmp_path / "kern.log"
    kernel.write_text("")
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "xidstream.cli", "collect", "--bootstrap", addr, "--node", "node-a",
                             "--kernel-log", f"file:{kernel}", "--accept-forgeable-kernel-log", "--no-nvml",
                             "--no-kubernetes", "--state-dir", str(state)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(6.5)  # 5 s of the start-up topic check, then it follows the file from its end
    with kernel.open("a") as fh:
        fh.write(f"[  120.000000] {XID_LINE}\n")
    time.sleep(2.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]  # its last flush waits 10 + 5 s for the broker
    lines = _assert_quiet(out, 8)
    spooled = [l for l in lines if "Kafka unreachable at" in l]
    assert len(spooled) == 1, out
    assert (f"Kafka unreachable at {addr} (broker {addr} unreachable: Connection refused); spooling to "
            f"{state / 'spool'} until it returns, reconnecting every 10 s at most") in spooled[0]
    assert sum(f"broker {addr} unreachable: Connection refused" in l for l in lines) >= 2, out
    spool = Spool(state / "spool" / "critical")
    records = [orjson.loads(r.value) for r in spool.pending(limit=100)]
    spool.close()
    assert [r.get("xid") for r in records if "xid" in r] == [43], (records, out)


@pytest.mark.slow
def test_simulate_with_a_closed_port_says_where_it_spools_and_how_long_it_waits(tmp_path):
    addr = _closed_port()
    proc = subprocess.Popen([sys.executable, "-m", "xidstream.cli", "simulate", "--bootstrap", addr, "--nodes", "1",
                             "--gpus", "1", "--duration", "2", "--speed", "0", "--state-dir", str(tmp_path),
                             "--truth", str(tmp_path / "truth.jsonl")],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(9)  # the run is over at once (--speed 0); it waits for Kafka to take the spool
    proc.kill()  # not Ctrl-C: confluent-kafka can turn a KeyboardInterrupt in its log callback into a SystemError
    out = proc.communicate(timeout=30)[0]
    _assert_quiet(out, 6)
    assert out.count(f"Kafka unreachable at {addr} (broker {addr} unreachable: Connection refused); spooling to "
                     f"{tmp_path / 'spool'} until it returns") == 1, out
    assert (f"simulate: Kafka at {addr} has not taken everything yet; waiting up to 115 s more for what is spooled "
            f"in {tmp_path / 'spool'}, then exiting with code 1 with the rest kept there") in out, out
