"""The export sinks' own behaviour, without a broker (exporters/pipeline.py)."""

from __future__ import annotations

import os
import time

import orjson

from exporters.pipeline import JsonlSink, _event_ms
from tests.exporters.helpers import alerts


def test_jsonl_to_a_pipe_or_a_device_commits_without_fsync(tmp_path):
    """`--to jsonl:/dev/stdout` (a pipe or a terminal) crashed on its first commit: fsync of a
    non-regular file fails with EINVAL. A regular file is still fsynced."""
    r, w = os.pipe()
    try:
        sink = JsonlSink(f"/dev/fd/{w}")
        sink.write(None, {"a": 1}, None, None, None)
        sink.durable()  # raised OSError [Errno 22] before
        sink.close()
        assert os.read(r, 100) == b'{"a":1}\n'
    finally:
        os.close(r)
        os.close(w)
    dev = JsonlSink("/dev/null")
    dev.write(None, {"b": 2}, None, None, None)
    dev.close()
    f = tmp_path / "out.ndjson"
    sink = JsonlSink(str(f))
    assert sink._sync is True
    sink.write(None, {"c": 3}, None, None, None)
    sink.close()
    assert orjson.loads(f.read_bytes()) == {"c": 3}


def test_the_kafka_timestamp_is_the_events_time_never_ahead_of_now():
    a = alerts()[0]
    assert _event_ms(a) == int(a.ts.timestamp() * 1000)
    ahead = a.model_copy(update={"ts": a.ts.fromtimestamp(time.time() + 7200, a.ts.tzinfo)})
    assert abs(_event_ms(ahead) - time.time() * 1000) < 5000
