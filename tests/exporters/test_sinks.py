"""The export sinks' own behaviour, without a broker (exporters/pipeline.py)."""

from __future__ import annotations

import os
import time

import orjson

from xidstream.exporters.pipeline import JsonlSink, _event_ms
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


# -- documents over Kafka's size limit --------------------------------------------------------------
def _big_alert(entries: int = 3000, summary_chars: int = 100):
    from datetime import timedelta

    from xidstream.schemas import EvidenceEntry

    a = alerts()[0]
    timeline = [EvidenceEntry(ts=a.ts + timedelta(milliseconds=i), kind="xid", summary=f"Xid 13 #{i} " + "x" * 100,
                              data={"xid": 13, "pid": i}) for i in range(entries)]
    ev = a.evidence.model_copy(update={"timeline": timeline})
    return a.model_copy(update={"evidence": ev, "summary": "s" * summary_chars})


def test_a_document_over_the_limit_is_shrunk_and_marked_and_one_that_cannot_fit_is_refused():
    from xidstream.exporters import ecs, ocsf
    from xidstream.exporters.pipeline import fit_document

    big = _big_alert()
    for doc, flag_at, timeline in ((ocsf.to_ocsf(big), "unmapped", ("unmapped", "timeline")),
                                   (ecs.to_ecs(big), "xidstream", ("xidstream", "timeline"))):
        raw = orjson.dumps(doc)
        assert len(raw) > 300_000
        assert fit_document(doc, len(raw)) == (raw, False)  # what fits is sent as it is
        out, truncated = fit_document(doc, 20_000)
        assert truncated and len(out) <= 20_000
        got = orjson.loads(out)
        assert got[flag_at]["truncated"] is True and got[flag_at]["original_bytes"] == len(raw)
        assert len(got[timeline[0]][timeline[1]]) == 5  # the first few kept
        assert got["message"] == doc["message"]  # the rest as it was
        assert orjson.loads(orjson.dumps(doc)) == doc  # the caller's document untouched
        # a summary longer than the limit allows, even with every list dropped: strings are cut
        huge = _big_alert(entries=10, summary_chars=50_000)
        out, truncated = fit_document(ocsf.to_ocsf(huge), 20_000)
        assert truncated and len(out) <= 20_000 and orjson.loads(out)["unmapped"]["truncation"] == "strings"
        assert fit_document(doc, 100) == (None, True)  # too big however cut: the sink skips it


def test_the_progress_line_counts_truncated_and_skipped_documents():
    from xidstream.exporters.pipeline import ExportStats

    s = ExportStats(consumed=3, exported=3)
    assert "truncated" not in s.line()
    s.truncated, s.too_large = 2, 1
    assert s.line().endswith(", 2 truncated, 1 too large (skipped)")


# -- approvals ---------------------------------------------------------------------------------------
def test_approvals_are_read_as_findings(monkeypatch):
    """Signed approvals (gpu.remediation.approvals) were never exported: the topic was not read
    and an Approval was not taken for a finding."""
    from datetime import timedelta

    import exporters.ocsf
    from xidstream.exporters.pipeline import FINDING_TOPICS, Exporter
    from xidstream.schemas import Approval, encode

    assert "gpu.remediation.approvals" in FINDING_TOPICS
    from xidstream.transport.acls import EXPORT_READ_TOPICS

    assert set(EXPORT_READ_TOPICS) == set(FINDING_TOPICS)  # the exporter role may read what it reads

    class Collect:
        def __init__(self):
            self.records = []

        def write(self, record, doc, key, partition, offset):
            self.records.append(record)

        def durable(self):
            pass

        def close(self):
            pass

    a = alerts()[0]
    approval = Approval(ts=a.ts, node=a.node, approval_id="ap-1", command_id="cmd-1", approved_by="ops",
                        expires_at=a.ts + timedelta(minutes=15))
    # whatever OCSF mapping an approval has (none yet: map_record then skips it), it reaches it
    seen = []
    monkeypatch.setattr(exporters.ocsf, "to_ocsf", lambda r: (seen.append(r), {"class_uid": 0})[1])
    sink = Collect()
    Exporter("ocsf", sink).handle(encode(approval))
    assert [type(r).__name__ for r in seen] == ["Approval"] and sink.records == seen


# -- a consumer that is never assigned anything ------------------------------------------------------
def test_idle_exit_holds_when_no_partition_is_ever_assigned():
    """`--idle-exit` counted only from an assignment: where none ever came (a refused group, a
    broker that never answers) the exporter read 0 records for ever."""
    from xidstream.exporters.pipeline import Exporter, JsonlSink
    from xidstream.transport.config import KafkaConfig

    t0 = time.monotonic()
    exporter = Exporter("ocsf", JsonlSink("/dev/null"))
    stats = exporter.run_kafka(KafkaConfig(bootstrap="127.0.0.1:9"), "g", telemetry=False, idle_exit=0.5,
                               join_grace=1.0, should_stop=lambda: time.monotonic() - t0 > 20)
    assert stats.consumed == 0
    assert time.monotonic() - t0 < 8
