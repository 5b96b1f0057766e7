from __future__ import annotations

import pytest

from xidstream.collectors.spool import Spool


def _fill(spool, n, start=0):
    return [spool.append("gpu.xid", f"k{i % 3}".encode(), f"v{i}".encode()) for i in range(start, start + n)]


def test_records_come_back_in_order_until_acknowledged(tmp_path):
    sp = Spool(tmp_path)
    seqs = _fill(sp, 5)
    assert seqs == [1, 2, 3, 4, 5]
    assert [r.value for r in sp.pending()] == [b"v0", b"v1", b"v2", b"v3", b"v4"]
    assert [r.seq for r in sp.pending(after=3)] == [4, 5]
    sp.ack(2)  # out of order: the cursor waits for 1
    assert sp.acked_through == 0 and sp.depth == 4
    sp.ack(1)
    assert sp.acked_through == 2 and [r.seq for r in sp.pending()] == [3, 4, 5]


def test_survives_a_restart_without_losing_or_resending_acked(tmp_path):
    sp = Spool(tmp_path)
    _fill(sp, 10)
    for s in range(1, 7):
        sp.ack(s)
    sp.sync()
    del sp  # a crash: no close()
    sp2 = Spool(tmp_path)
    assert sp2.acked_through == 6
    assert [r.value for r in sp2.pending()] == [b"v6", b"v7", b"v8", b"v9"]
    assert sp2.append("gpu.xid", None, b"new") == 11
    assert sp2.pending()[-1].key is None


def test_a_torn_tail_is_cut_and_the_rest_kept(tmp_path):
    sp = Spool(tmp_path)
    _fill(sp, 3)
    sp.close()
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    with seg.open("ab") as fh:
        fh.write(b"\x10\x00\x00\x00garbage")  # half a record
    sp2 = Spool(tmp_path)
    assert sp2.torn == 1
    assert [r.value for r in sp2.pending()] == [b"v0", b"v1", b"v2"]
    assert sp2.append("t", b"k", b"after") == 4
    assert [r.value for r in Spool(tmp_path).pending()][-1] == b"after"


def test_bound_drops_oldest_and_counts(tmp_path, caplog):
    sp = Spool(tmp_path, max_bytes=16_384, segment_bytes=4096)
    _fill(sp, 2000)
    assert sp.dropped > 0
    assert sum(p.stat().st_size for p in tmp_path.glob("*.seg")) <= 16_384 + 4096
    pending = sp.pending(limit=100_000)
    assert pending[-1].value == b"v1999"
    assert len(pending) == 2000 - sp.dropped
    assert [r.seq for r in pending] == list(range(sp.dropped + 1, 2001))
    assert "dropped" in caplog.text


def test_acknowledged_segments_are_deleted(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    _fill(sp, 1000)
    assert len(list(tmp_path.glob("*.seg"))) > 3
    for s in range(1, 1001):
        sp.ack(s)
    sp.sync()
    assert len(list(tmp_path.glob("*.seg"))) == 1 and sp.depth == 0 and sp.pending() == []


@pytest.mark.parametrize("memory", [True, False])
def test_pending_reads_from_disk_when_memory_does_not_hold_it(tmp_path, memory):
    sp = Spool(tmp_path)
    _fill(sp, 20)
    if not memory:
        sp = Spool(tmp_path)  # fresh process: nothing in memory
    assert [r.seq for r in sp.pending(after=15)] == [16, 17, 18, 19, 20]


def test_an_emptied_cursor_is_recovered_from_the_segments(tmp_path):
    """Defect 10: a power loss that empties the cursor file must not pin the acknowledged position
    at 0 for good (segments would pile up and kernel cursors never advance)."""
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    _fill(sp, 1000)
    for s in range(1, 801):
        sp.ack(s)
    sp.sync()  # deletes the acknowledged segments
    first = min(int(p.stem) for p in tmp_path.glob("*.seg"))
    assert first > 1
    (tmp_path / "cursor").write_text("")  # what a power loss leaves of an unsynced cursor
    sp2 = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    # Everything before the oldest segment was acknowledged, and nothing in it: one more would
    # skip its first record, which was never sent.
    assert sp2.acked_through == first - 1
    assert sp2.pending(limit=1)[0].seq == first
    sp2.sync()
    assert (tmp_path / "cursor").read_text() == str(first - 1)  # the recovered cursor is kept
    for rec in sp2.pending(limit=100_000):  # re-sent and acknowledged: the cursor moves
        sp2.ack(rec.seq)
    assert sp2.acked_through == 1000 and sp2.depth == 0


def test_the_cursor_is_written_then_fsynced_then_renamed(tmp_path, monkeypatch):
    """Defect 10: write-rename-fsync; the rename must not land before the data is on disk."""
    import os

    import xidstream.collectors.spool as spool_mod

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(b)))
        real_replace(a, b)

    monkeypatch.setattr(spool_mod.os, "fsync", fsync)
    monkeypatch.setattr(spool_mod.os, "replace", replace)
    sp = Spool(tmp_path)
    _fill(sp, 3)
    sp.ack(1)
    sp.sync()
    cursor = str(tmp_path / "cursor")
    i = events.index(("replace", cursor))
    assert ("fsync", cursor + ".tmp") in events[:i]  # the new cursor's bytes are on disk first
    assert ("fsync", str(tmp_path)) in events[i:]  # then the rename itself
    assert (tmp_path / "cursor").read_text() == "1"
