"""The spool at its edges: every threshold at, just below and just above it, and each point where a
crash or a power loss can leave the directory (a torn or zero-filled tail, an empty new segment, a
cursor behind or ahead of the segments). What must hold at each: the first unacknowledged record
is never skipped, a segment whose last record is unacknowledged is never deleted, the open segment
is fsynced, and the records read back are the ones written, topic, key and value."""

from __future__ import annotations

import logging
import os
import struct
import zlib

import pytest

import xidstream.collectors.spool as spool_mod
from xidstream.collectors.spool import Spool, write_durably

# A record of exactly 128 bytes on disk: 16 header + 6 payload header + 1 topic + 105 value.
REC = 128
VALUE = b"x" * 105


def fill(sp: Spool, n: int) -> list[int]:
    return [sp.append("t", None, VALUE) for _ in range(n)]


def segs(directory) -> list[int]:
    return sorted(int(p.stem) for p in directory.glob("*.seg"))


def last_seg(directory):
    return max(directory.glob("*.seg"), key=lambda p: int(p.stem))


class Reads:
    """Which segments pending() reads from disk."""

    def __init__(self, sp: Spool, monkeypatch) -> None:
        self.paths: list[int] = []
        real = sp._iter_segment

        def iter_segment(path):
            self.paths.append(int(path.stem))
            return real(path)

        monkeypatch.setattr(sp, "_iter_segment", iter_segment)


# -- settings ------------------------------------------------------------------------------


def test_defaults_and_the_segment_size_derived_from_the_bound(tmp_path):
    sp = Spool(tmp_path / "a" / "b")  # parents are created
    assert sp.dir.is_dir() and sp.name == "spool"
    assert sp.max_bytes == 256 << 20 and sp.segment_bytes == 8 << 20
    assert Spool(tmp_path / "c", max_bytes=40_000).segment_bytes == 10_000  # a quarter of the bound
    assert Spool(tmp_path / "d", max_bytes=20_002, segment_bytes=1 << 20).segment_bytes == 5_000
    assert isinstance(Spool(tmp_path / "e", max_bytes=20_002).segment_bytes, int)
    assert Spool(tmp_path / "f", max_bytes=1_000).segment_bytes == 4096  # never below 4 KiB
    assert Spool(tmp_path / "g", max_bytes=16_384 * 4, segment_bytes=9000).segment_bytes == 9000


def test_topic_key_and_value_come_back_exactly_from_memory_and_from_disk(tmp_path):
    sp = Spool(tmp_path)
    sp.append("gpu.xid", b"GPU-1", b"value-1")
    sp.append("gpu.samples", None, b"value-2")
    sp.append("t", b"", b"value-3")  # an empty key is a key, not "no key"
    want = [(1, "gpu.xid", b"GPU-1", b"value-1"), (2, "gpu.samples", None, b"value-2"), (3, "t", b"", b"value-3")]
    assert [(r.seq, r.topic, r.key, r.value) for r in sp.pending()] == want
    sp.close()
    assert [(r.seq, r.topic, r.key, r.value) for r in Spool(tmp_path).pending()] == want


def test_the_segment_rolls_at_exactly_segment_bytes(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 32)  # 32 x 128 = 4096: full, not over
    assert segs(tmp_path) == [1]
    fill(sp, 1)
    assert segs(tmp_path) == [1, 33]
    assert (tmp_path / f"{1:020d}.seg").stat().st_size == 4096


def test_the_in_memory_window_is_bounded(tmp_path):
    sp = Spool(tmp_path)
    for _ in range(50_001):
        sp.append("t", None, b"v")
    assert len(sp._recent) == 50_000 and sp._recent[0].seq == 2
    assert sp.pending(limit=1)[0].seq == 1  # the oldest comes from disk


def test_pending_returns_at_most_limit_records(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=8 << 20)
    fill(sp, 10_001)
    assert len(sp.pending()) == 10_000
    assert [r.seq for r in sp.pending(limit=2)] == [1, 2]  # from memory
    assert [r.seq for r in sp.pending(after=40, limit=3)] == [41, 42, 43]
    fresh = Spool(tmp_path, segment_bytes=4096, max_bytes=8 << 20)
    assert [r.seq for r in fresh.pending(limit=2)] == [1, 2]  # from disk
    assert [r.seq for r in fresh.pending(after=40, limit=3)] == [41, 42, 43]


# -- acknowledging -------------------------------------------------------------------------


def test_depth_is_exact_through_out_of_order_and_repeated_acks(tmp_path):
    sp = Spool(tmp_path)
    fill(sp, 5)
    sp.ack(2)
    sp.ack(4)
    assert sp.acked_through == 0 and sp.depth == 3
    sp.ack(1)
    assert sp.acked_through == 2 and sp.depth == 2
    sp.ack(2)  # a second report of the same record
    sp.ack(1)
    assert sp.acked_through == 2 and sp.depth == 2
    sp.ack(3)
    assert sp.acked_through == 4 and sp.depth == 1
    sp.ack(5)
    assert sp.depth == 0 and sp.pending() == []


def test_acknowledged_records_leave_memory(tmp_path):
    sp = Spool(tmp_path)
    fill(sp, 3)
    sp.ack(1)
    assert [r.seq for r in sp._recent] == [2, 3]
    sp.ack(3)
    assert [r.seq for r in sp._recent] == [2, 3]
    sp.ack(2)
    assert len(sp._recent) == 0


def test_an_out_of_order_ack_does_not_rewrite_the_cursor(tmp_path):
    sp = Spool(tmp_path)
    fill(sp, 3)
    sp.sync()
    assert not (tmp_path / "cursor").exists()  # nothing acknowledged: nothing to write
    sp.ack(2)
    sp.sync()
    assert not (tmp_path / "cursor").exists()
    sp.ack(1)
    sp.sync()
    assert (tmp_path / "cursor").read_text() == "2"


# -- syncing -------------------------------------------------------------------------------


@pytest.fixture
def fsyncs(monkeypatch):
    seen: list[str] = []
    real = os.fsync

    def fsync(fd):
        seen.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(spool_mod.os, "fsync", fsync)
    return seen


def test_sync_fsyncs_the_open_segment_once_per_batch_of_writes(tmp_path, fsyncs):
    sp = Spool(tmp_path)
    sp.sync()
    assert fsyncs == []
    fill(sp, 2)
    sp.sync()
    assert fsyncs == [f"{1:020d}.seg"]
    sp.sync()  # nothing new
    assert fsyncs == [f"{1:020d}.seg"]
    fill(sp, 1)
    sp.sync()
    assert fsyncs == [f"{1:020d}.seg"] * 2


def test_the_cursor_is_rewritten_only_when_it_moved(tmp_path, monkeypatch):
    sp = Spool(tmp_path)
    fill(sp, 2)
    writes = []
    monkeypatch.setattr(spool_mod, "write_durably", lambda path, data: writes.append(data))
    sp.ack(1)
    sp.sync()
    sp.sync()
    assert writes == [b"1"]
    sp.ack(2)
    sp.sync()
    assert writes == [b"1", b"2"]


def test_a_reopened_spool_does_not_rewrite_a_cursor_that_is_right(tmp_path, monkeypatch, caplog):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 40)
    for s in range(1, 33):
        sp.ack(s)
    sp.sync()  # the first segment (1-32) is deleted, the cursor says 32
    assert segs(tmp_path) == [33]
    writes = []
    monkeypatch.setattr(spool_mod, "write_durably", lambda path, data: writes.append(data))
    again = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    again.sync()
    assert writes == [] and again.acked_through == 32
    assert "behind the oldest segment" not in caplog.text


def test_close_fsyncs_and_closes_the_segment_and_the_spool_can_go_on(tmp_path, fsyncs):
    sp = Spool(tmp_path)
    fill(sp, 1)
    writer = sp._writer
    sp.close()
    assert writer.closed and fsyncs == [f"{1:020d}.seg"]
    sp.close()  # twice is fine
    assert sp.append("t", None, b"after") == 2
    assert [r.value for r in Spool(tmp_path).pending()] == [VALUE, b"after"]


def test_write_durably_leaves_a_0644_file_with_exactly_the_new_bytes(tmp_path, monkeypatch):
    target = tmp_path / "cursor"
    (tmp_path / "cursor.tmp").write_bytes(b"9" * 64)  # left by a crash: must not leak into the new value
    chunks = []
    real_write = os.write

    def short_write(fd, data):  # the kernel may take fewer bytes than asked
        n = real_write(fd, bytes(data[:3]))
        chunks.append(n)
        return n

    monkeypatch.setattr(spool_mod.os, "write", short_write)
    old = os.umask(0o022)
    try:
        write_durably(target, b"1234567")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"1234567" and chunks == [3, 3, 1]
    assert not (tmp_path / "cursor.tmp").exists()


def test_write_durably_creates_a_file_readable_by_all_writable_by_its_owner(tmp_path):
    old = os.umask(0o022)
    try:
        write_durably(tmp_path / "cursor", b"1")
    finally:
        os.umask(old)
    assert (tmp_path / "cursor").stat().st_mode & 0o777 == 0o644


# -- the bound -----------------------------------------------------------------------------

BOUND = 4096 + 4 * REC  # one full segment of 32 records and 4 records of the next


def test_the_bound_is_kept_at_exactly_max_bytes_and_enforced_one_byte_over(tmp_path, caplog):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=BOUND)
    fill(sp, 36)  # 36 x 128 = BOUND exactly
    assert sp.dropped == 0 and segs(tmp_path) == [1, 33]
    fill(sp, 1)
    assert sp.dropped == 32 and segs(tmp_path) == [33]
    assert sp.depth == 5 and [r.seq for r in sp.pending()] == [33, 34, 35, 36, 37]
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert msg == f"spool: spool over its bound of {BOUND} bytes: dropped 32 unsent records (seq 1-32)"
    fill(sp, 27)  # the second segment fills to 4096 with the bound kept: nothing else goes
    assert sp.dropped == 32


def test_records_already_acknowledged_are_not_counted_as_dropped(tmp_path, caplog):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=BOUND, name="spool/critical")
    fill(sp, 36)
    for s in (1, 2, 3, 5, 7):  # 1-3 acknowledged in order, 5 and 7 out of order
        sp.ack(s)
    assert sp.acked_through == 3 and sp.depth == 31
    fill(sp, 1)
    # 4, 6 and 8-32 were never sent: 27 records
    assert sp.dropped == 27
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert msg == f"spool/critical: spool over its bound of {BOUND} bytes: dropped 27 unsent records (seq 4-32)"
    assert sp.acked_through == 32 and sp.depth == 5  # what was deleted counts as done for the cursor
    sp.sync()
    assert (tmp_path / "cursor").read_text() == "32"
    for s in range(33, 38):
        sp.ack(s)
    assert sp.acked_through == 37 and sp.depth == 0


def test_a_drop_counts_exactly_when_the_cursor_is_inside_the_dropped_segment(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=BOUND)
    fill(sp, 36)
    for s in range(1, 11):
        sp.ack(s)
    fill(sp, 1)
    assert sp.dropped == 22 and sp.depth == 5 and sp.acked_through == 32


def test_a_single_segment_over_the_bound_is_never_deleted(tmp_path):
    sp = Spool(tmp_path, max_bytes=1_000)  # segments of 4096: one segment outgrows the bound
    fill(sp, 20)
    assert sp.dropped == 0 and segs(tmp_path) == [1] and len(sp.pending()) == 20


def test_segments_deleted_by_gc_leave_room_under_the_bound(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=BOUND)
    fill(sp, 34)  # 1-32 and 33-34: 4352 bytes
    for s in range(1, 33):
        sp.ack(s)
    sp.sync()  # GC deletes 1-32: 256 bytes left
    assert segs(tmp_path) == [33]
    fill(sp, 31)  # 33-64 full, 65 opens a new segment: 4224 bytes, under the bound
    assert segs(tmp_path) == [33, 65] and sp.dropped == 0 and sp.depth == 33


# -- garbage collection --------------------------------------------------------------------


def test_gc_deletes_a_segment_exactly_when_its_last_record_is_acknowledged(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 70)  # segments 1-32, 33-64, 65-70
    for s in range(1, 32):
        sp.ack(s)
    sp.sync()
    assert segs(tmp_path) == [1, 33, 65]  # record 32 is not acknowledged: its segment stays
    again = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    assert again.pending(limit=1)[0].seq == 32
    sp.ack(32)
    sp.sync()
    assert segs(tmp_path) == [33, 65]
    sp.ack(33)
    sp.sync()
    assert segs(tmp_path) == [33, 65]


# -- pending: memory and disk --------------------------------------------------------------


def test_a_caught_up_sender_does_not_read_the_disk(tmp_path, monkeypatch):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 40)
    sp.close()
    fresh = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    reads = Reads(fresh, monkeypatch)
    assert fresh.pending(after=40) == [] and reads.paths == []


def test_recent_records_are_served_from_memory(tmp_path, monkeypatch):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 70)
    reads = Reads(sp, monkeypatch)
    assert [r.seq for r in sp.pending(after=68)] == [69, 70]
    assert [r.seq for r in sp.pending()][:2] == [1, 2]
    for s in range(1, 11):
        sp.ack(s)
    assert sp.pending(limit=1)[0].seq == 11  # memory now starts at exactly the cursor + 1
    assert reads.paths == []


def test_the_disk_path_skips_segments_that_are_all_below_the_floor(tmp_path, monkeypatch):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 100)  # segments 1, 33, 65, 97
    sp.close()
    fresh = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    reads = Reads(fresh, monkeypatch)
    assert fresh.pending(after=64, limit=1)[0].seq == 65
    assert reads.paths == [65]  # 1-32 and 33-64 are not read
    reads.paths.clear()
    assert [r.seq for r in fresh.pending(after=63, limit=2)] == [64, 65]
    assert reads.paths == [33, 65]
    reads.paths.clear()
    assert [r.seq for r in fresh.pending(after=95)] == [96, 97, 98, 99, 100]
    assert reads.paths == [65, 97]
    reads.paths.clear()
    assert [r.seq for r in fresh.pending(after=96)] == [97, 98, 99, 100]
    assert reads.paths == [97]


def test_memory_that_starts_after_the_floor_is_not_trusted(tmp_path):
    """After a restart memory holds only what was appended since: the records before it are on
    disk, and one of them must not be skipped."""
    sp = Spool(tmp_path)
    fill(sp, 5)
    sp.close()
    again = Spool(tmp_path)
    again.append("t", None, b"new")
    assert [r.seq for r in again.pending(after=4)] == [5, 6]
    assert [r.seq for r in again.pending(after=3)] == [4, 5, 6]


# -- crash points --------------------------------------------------------------------------


def test_an_empty_cursor_file_means_nothing_acknowledged(tmp_path):
    sp = Spool(tmp_path)
    fill(sp, 3)
    sp.close()
    (tmp_path / "cursor").write_text("")  # a power loss before the first cursor reached the disk
    again = Spool(tmp_path)
    assert again.acked_through == 0 and [r.seq for r in again.pending()] == [1, 2, 3]


def test_a_cursor_at_the_oldest_segments_first_record_is_kept(tmp_path):
    sp = Spool(tmp_path)
    fill(sp, 3)
    sp.ack(1)
    sp.close()
    again = Spool(tmp_path)
    assert again.acked_through == 1 and [r.seq for r in again.pending()] == [2, 3]


@pytest.mark.parametrize("behind", [1, 2, 5])
def test_a_cursor_behind_the_oldest_segment_is_recovered_from_it(tmp_path, caplog, behind):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 70)
    for s in range(1, 65):
        sp.ack(s)
    sp.sync()
    assert segs(tmp_path) == [65]
    sp.close()
    (tmp_path / "cursor").write_text(str(64 - behind))  # the last cursor writes were lost
    again = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20, name="spool/critical")
    assert again.acked_through == 64 and again.pending(limit=1)[0].seq == 65
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msg == (f"spool/critical: cursor {64 - behind} is behind the oldest segment (first seq 65); "
                   "recovered from the segments")
    for s in range(65, 71):
        again.ack(s)
    assert again.acked_through == 70 and again.depth == 0


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_cursor_ahead_of_the_segments_never_reuses_an_acknowledged_seq(tmp_path, ahead):
    """A power loss can keep the fsynced cursor and lose the segment's unsynced tail: a new record
    must get a seq above the cursor, or it would count as acknowledged and never be sent."""
    sp = Spool(tmp_path)
    fill(sp, 4)
    sp.close()
    (tmp_path / "cursor").write_text(str(4 + ahead))
    again = Spool(tmp_path)
    seq = again.append("t", None, b"new")
    assert seq == 5 + ahead and again.last_seq == seq
    assert [r.value for r in again.pending()] == [b"new"]
    assert [r.value for r in Spool(tmp_path).pending()] == [b"new"]


def test_an_empty_newest_segment_does_not_reset_the_sequence(tmp_path):
    """A crash right after a roll leaves an empty segment: the seqs go on from the one before."""
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 32)
    sp.close()
    (tmp_path / f"{33:020d}.seg").touch()
    again = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    assert again.torn == 0 and again.last_seq == 32
    assert again.append("t", None, b"new") == 33
    assert [r.seq for r in Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20).pending()][-2:] == [32, 33]


def test_a_torn_first_record_leaves_an_empty_segment_that_takes_new_records(tmp_path, caplog):
    sp = Spool(tmp_path)
    fill(sp, 1)
    sp.close()
    seg = last_seg(tmp_path)
    seg.write_bytes(seg.read_bytes()[:-1])  # the only record, one byte short
    again = Spool(tmp_path)
    assert again.torn == 1 and seg.stat().st_size == 0 and again.last_seq == 0
    assert again.append("t", None, b"new") == 1
    again.close()
    assert [r.value for r in Spool(tmp_path).pending()] == [b"new"]
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msg == f"spool: cutting a torn tail of {REC - 1} bytes off {seg.name} (crash during a write)"


def test_a_torn_header_past_the_end_is_cut(tmp_path, caplog):
    sp = Spool(tmp_path)
    fill(sp, 2)
    sp.close()
    seg = last_seg(tmp_path)
    with seg.open("ab") as fh:  # a whole header whose payload never reached the disk
        fh.write(struct.pack("<IIQ", 100, 0, 3) + b"abc")
    again = Spool(tmp_path, name="spool/critical")
    assert again.torn == 1 and seg.stat().st_size == 2 * REC
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msg == f"spool/critical: cutting a torn tail of 19 bytes off {seg.name} (crash during a write)"
    assert again.append("t", None, b"new") == 3
    again.close()
    assert [r.seq for r in Spool(tmp_path).pending()] == [1, 2, 3]


def test_a_record_with_a_bad_crc_is_cut_with_everything_after_it(tmp_path):
    sp = Spool(tmp_path)
    fill(sp, 3)
    sp.close()
    seg = last_seg(tmp_path)
    data = bytearray(seg.read_bytes())
    data[REC + 50] ^= 0xFF  # inside record 2's value: the length is right, the bytes are not
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path)
    assert again.torn == 1 and seg.stat().st_size == REC
    assert again.append("t", None, b"new") == 2
    again.close()
    assert [r.value for r in Spool(tmp_path).pending()] == [VALUE, b"new"]


def test_a_corrupt_record_in_an_older_segment_is_never_sent(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 40)
    sp.close()
    first = tmp_path / f"{1:020d}.seg"
    data = bytearray(first.read_bytes())
    data[4 * REC + 60] ^= 0xFF  # record 5's value
    first.write_bytes(bytes(data))
    again = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    assert again.torn == 0  # only the newest segment is repaired on open
    sent = again.pending(limit=100)
    assert all(r.value == VALUE for r in sent)
    assert [r.seq for r in sent] == [1, 2, 3, 4, *range(33, 41)]


def test_a_clean_reopen_cuts_nothing(tmp_path, caplog):
    sp = Spool(tmp_path)
    fill(sp, 3)
    sp.close()
    again = Spool(tmp_path)
    assert again.torn == 0 and last_seg(tmp_path).stat().st_size == 3 * REC
    assert "torn" not in caplog.text


@pytest.mark.parametrize("zeros", [16, 22, 4096])
def test_a_zero_filled_tail_is_cut_not_read_as_a_record(tmp_path, zeros):
    """A power loss can leave a file's new size on disk without its new blocks, which then read
    back as zeros. A zero header says length 0 and crc32(b"") == 0, so the CRC alone passes it,
    and decoding an empty payload raised: the spool, and so the collector, could not open."""
    sp = Spool(tmp_path)
    fill(sp, 3)
    sp.close()
    seg = last_seg(tmp_path)
    with seg.open("ab") as fh:
        fh.write(bytes(zeros))
    again = Spool(tmp_path)
    assert again.torn == 1 and seg.stat().st_size == 3 * REC
    assert again.last_seq == 3 and [r.seq for r in again.pending()] == [1, 2, 3]
    assert again.append("t", None, b"new") == 4
    again.close()
    assert [r.value for r in Spool(tmp_path).pending()][-1] == b"new"


def test_a_stray_file_is_ignored_and_named(tmp_path, caplog):
    sp = Spool(tmp_path)
    fill(sp, 1)
    sp.close()
    stray = tmp_path / "notes.seg"
    stray.write_text("hello")
    again = Spool(tmp_path, name="spool/telemetry")
    assert [r.seq for r in again.pending()] == [1]
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msg == f"spool/telemetry: ignoring stray file {stray}"


def test_the_smallest_record_is_a_record(tmp_path):
    """No topic, no key, no value: a payload of exactly its 6-byte header, the shortest valid one."""
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 32)
    sp.append("", None, b"")  # the first record of segment 33
    sp.append("", None, b"")
    sp.close()
    again = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    assert again.torn == 0 and again.last_seq == 34
    assert [(r.seq, r.topic, r.key, r.value) for r in again.pending(after=32)] == [(33, "", None, b""), (34, "", None, b"")]


def test_a_zero_filled_tail_in_an_older_segment_ends_that_segment(tmp_path):
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 33)  # 1-32, 33
    sp.close()
    first = tmp_path / f"{1:020d}.seg"
    data = first.read_bytes()
    first.write_bytes(data[: 30 * REC] + bytes(2 * REC))  # 31 and 32 never reached the disk
    again = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    assert [r.seq for r in again.pending(limit=100)] == [*range(1, 31), 33]


# -- a crash inside write_durably: between write, fsync, rename and the directory's fsync ----


class Crash(Exception):
    """The process dies here: nothing after this step runs."""


def crash_at(monkeypatch, step: str, at_call: int = 1):
    """Make spool_mod.os.<step> raise Crash on its `at_call`-th call (the earlier ones run)."""
    real = getattr(os, step)
    calls = []

    def fake(*args, **kw):
        calls.append(args)
        if len(calls) == at_call:
            raise Crash(step)
        return real(*args, **kw)

    monkeypatch.setattr(spool_mod.os, step, fake)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("step", ["write", "fsync", "replace"])
def test_a_crash_before_the_rename_keeps_the_old_cursor(tmp_path, monkeypatch, step):
    target = tmp_path / "cursor"
    write_durably(target, b"41")
    fds = open_fds()
    crash_at(monkeypatch, step)
    with pytest.raises(Crash):
        write_durably(target, b"42")
    assert target.read_bytes() == b"41"  # the old value, never an empty or half-written file
    assert open_fds() == fds  # the temporary file's descriptor is closed on the way out
    monkeypatch.undo()
    write_durably(target, b"43")  # a .tmp left behind does not stop (or leak into) the next write
    assert target.read_bytes() == b"43" and not (tmp_path / "cursor.tmp").exists()


def test_a_crash_after_the_rename_keeps_the_new_cursor_and_closes_the_directory(tmp_path, monkeypatch):
    target = tmp_path / "cursor"
    write_durably(target, b"41")
    fds = open_fds()
    crash_at(monkeypatch, "fsync", at_call=2)  # the file's fsync runs, the directory's does not
    with pytest.raises(Crash):
        write_durably(target, b"42")
    assert target.read_bytes() == b"42" and not (tmp_path / "cursor.tmp").exists()
    assert open_fds() == fds


def test_a_cursor_write_that_failed_is_written_at_the_next_sync(tmp_path, monkeypatch):
    """The cursor stays dirty until a write succeeds: a failed write is not forgotten, and the
    segments it would free are kept until the cursor that frees them is on disk."""
    sp = Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    fill(sp, 33)  # segments 1-32 and 33
    for s in range(1, 33):
        sp.ack(s)
    crash_at(monkeypatch, "replace")
    with pytest.raises(Crash):
        sp.sync()
    assert segs(tmp_path) == [1, 33] and not (tmp_path / "cursor").exists()
    assert Spool(tmp_path, segment_bytes=4096, max_bytes=1 << 20).acked_through == 0  # a restart resends 1-32
    monkeypatch.undo()
    sp.sync()
    assert (tmp_path / "cursor").read_text() == "32" and segs(tmp_path) == [33]


def test_records_appended_and_never_synced_survive_a_crash_of_the_process(tmp_path):
    """append() flushes to the OS: a crash of the collector (not of the machine) loses nothing,
    synced or not, and the seqs go on after the last one written."""
    sp = Spool(tmp_path)
    fill(sp, 3)
    again = Spool(tmp_path)  # `sp` never synced nor closed: its process died
    assert [r.seq for r in again.pending()] == [1, 2, 3] and again.torn == 0
    assert again.append("t", None, b"new") == 4
