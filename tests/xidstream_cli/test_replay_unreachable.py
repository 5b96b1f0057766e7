"""`xidstream replay --bootstrap ADDR` with no broker at ADDR: one clear line and exit 2, before any
topic or worker, instead of a minute of librdkafka "Connection refused" lines every 50 ms (its
topic creation's 30 s, then its clean-up's 30 s) ending in "cannot reach Kafka to list topics"."""

from __future__ import annotations

import functools
import socket
from pathlib import Path

import pytest

import xidstream.transport.kafka as tk
from xidstream.schemas.errors import TopicError
from xidstream.cli import main as cli
from xidstream.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on: bound, then closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reachable_names_the_address_within_its_bound_and_prints_nothing_of_librdkafka(capfd):
    addr = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(TopicError) as err:
        tk.reachable(Settings(bootstrap=addr), timeout=1.0)
    assert str(err.value).startswith(f"no Kafka broker answers at {addr} within 1 s (")
    assert "is it running (`xidstream broker status`)" in str(err.value)
    assert "Connection refused" not in capfd.readouterr().err


def test_replay_with_no_broker_at_its_bootstrap_fails_at_once_with_one_line(capfd, monkeypatch):
    monkeypatch.setattr(tk, "reachable", functools.partial(tk.reachable, timeout=1.0))
    addr = f"127.0.0.1:{_closed_port()}"
    rc = cli(["replay", str(ROOT / "scenarios" / "lone-xid13.yaml"), "--check", "--bootstrap", addr])
    err = capfd.readouterr().err
    assert rc == 2
    assert err.startswith(f"xidstream: error: no Kafka broker answers at {addr} within 1 s"), err
    assert "Connection refused" not in err and "feeding" not in err, err
