"""A SIGTERM whose `_Stopped` is raised inside a library's callback still stops the replay as a
stop (exit 128 + signal, "stopped by SIGTERM"), not as an error: in CI a child replay got the
signal while pydantic serialized a record's time stamp, pydantic wrapped `_Stopped` in a
PydanticSerializationError, and the child exited 1 instead of 143 (its clean-up had run)."""

from __future__ import annotations

import os
import signal
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, field_serializer

import xidstream.replay as replay

ROOT = Path(__file__).resolve().parents[2]


class _Stamped(BaseModel):
    ts: datetime

    @field_serializer("ts")
    def _format(self, v: datetime) -> str:
        os.kill(os.getpid(), signal.SIGTERM)  # the signal lands while pydantic runs this callback
        return v.isoformat()


def test_a_stop_signal_inside_a_serializer_callback_is_a_stop(monkeypatch, capsys):
    def fake_replay_all(*args, **kwargs):
        _Stamped(ts=datetime(2026, 12, 3, tzinfo=timezone.utc)).model_dump(mode="json")
        raise AssertionError("not reached: the signal stops the replay")

    monkeypatch.setattr(replay, "_replay_all", fake_replay_all)
    code = replay.run_replay([str(ROOT / "scenarios" / "lone-xid13.yaml")], "127.0.0.1:1")
    assert code == 128 + signal.SIGTERM
    assert "xidstream replay: stopped by SIGTERM (it was at: starting); exit code 143" in capsys.readouterr().err
    # the handlers are the process's own again afterwards
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
