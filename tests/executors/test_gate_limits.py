"""An executor's results stay within the contract's caps (schemas.limits.DETAIL_MAX), and its
journal still reads what an executor of the previous schema version wrote."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import orjson

from xidstream.executors.gate import Approvals, Journal, decide, result_for
from xidstream.schemas import decode_any, encode
from xidstream.schemas.limits import DETAIL_MAX
from xidstream.schemas.vocab import Outcome
from tests.executors import helpers
from tests.executors.helpers import keypair

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


def test_a_long_detail_is_cut_with_a_marker_so_the_result_still_goes_out():
    # A drain names every pod it evicted: a node with thousands of pods (or pod names chosen to be
    # long) made a result the processor would refuse.
    cmd = helpers.command("n1", "DRAIN_NODE", now=NOW)
    detail = "drained node n1: evicted 5000 pod(s): " + ", ".join(f"ml/pod-{i:05d}" for i in range(5000))
    res = result_for(cmd, Outcome.succeeded, detail)
    assert len(res.detail) <= DETAIL_MAX
    m = re.search(r"\.\.\. \[(\d+) more characters\]$", res.detail)
    assert m and detail.startswith(res.detail[:m.start()]) and m.start() + int(m.group(1)) == len(detail)
    assert decode_any(encode(res)) == res


def test_a_journal_written_by_the_previous_version_is_read_and_its_answers_fit(tmp_path):
    key, keys, _, _ = keypair(tmp_path)
    done = key.sign(helpers.command("n1", "CORDON_NODE", now=NOW))
    started = key.sign(helpers.command("n1", "DRAIN_NODE", now=NOW))
    old = {**orjson.loads(encode(result_for(done, Outcome.succeeded, "x"))),
           "schema": "xidstream.remediation_result/2", "detail": "y" * DETAIL_MAX}

    def stub(cmd):
        return {**orjson.loads(encode(result_for(cmd, Outcome.failed, ""))), "schema": "xidstream.remediation_result/2"}

    path = tmp_path / "journal.jsonl"
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in (
        {"kind": "started", "command_id": done.command_id, "at": "2026-12-01T09:00:00.000000Z", "stub": stub(done)},
        {"kind": "done", "command_id": done.command_id, "result": old},
        {"kind": "started", "command_id": started.command_id, "at": "2026-12-01T09:00:00.000000Z",
         "stub": stub(started)},
    )))
    journal = Journal(path)  # an upgraded executor starts on the old journal
    for cmd, outcome in ((done, Outcome.succeeded), (started, Outcome.failed)):
        d = decide(cmd, keys=keys, now=NOW, scope="cluster", node=None, journal=journal, approvals=Approvals(keys))
        assert d.from_journal and d.result.outcome == outcome
        assert len(d.result.detail) <= DETAIL_MAX and decode_any(encode(d.result)) == d.result
