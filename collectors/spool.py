"""An ordered, crash-safe, bounded on-disk spool: the collector's write-ahead log to Kafka.

Every record is appended here first and handed to the producer from here, so a broker that is
away, a full producer queue or a collector crash loses nothing: on restart, everything after the
acknowledged cursor is sent again (at-least-once; consumers deduplicate by `event_id`).

Layout of the directory:
  <first_seq>.seg   records, each ``<u32 length><u32 crc32><u64 seq>`` + payload
  cursor            the highest seq such that it and everything before it were acknowledged;
                    written to cursor.tmp, fsynced, renamed, and the directory fsynced, so a
                    power loss leaves the old or the new value, never an empty file. Segments
                    are deleted only once every record in them is acknowledged, so the oldest
                    segment's first seq - 1 is a lower bound that open() trusts when the cursor
                    file is missing, empty or older.

A torn tail (a crash mid-write, or zeros where a power loss kept the size but not the blocks) is
detected by length and CRC and cut off on open. When the spool grows past `max_bytes`, its oldest
segment is deleted: the records lost are counted and logged (the bound protects the node's disk;
see docs/architecture.md "The collector" for sizing).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["Spool", "SpoolRecord", "write_durably"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIQ")  # payload length, crc32(payload), seq
_PAYLOAD = struct.Struct("<HI")  # topic length, key length (0xFFFFFFFF: no key)
_NO_KEY = 0xFFFFFFFF


def write_durably(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a power loss leaves the old or the new content, never an
    empty file: write <path>.tmp, fsync it, rename it over `path`, fsync the directory (the rename
    never reaches the disk before the bytes it points at; ext4/xfs may otherwise reorder them).
    The spool's cursor and the kernel sources' cursors (collectors.sources.kernel) use it."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    seq: int
    topic: str
    key: bytes | None
    value: bytes


def _encode(topic: str, key: bytes | None, value: bytes) -> bytes:
    t = topic.encode()
    return _PAYLOAD.pack(len(t), _NO_KEY if key is None else len(key)) + t + (key or b"") + value


def _decode(seq: int, payload: bytes) -> SpoolRecord:
    tlen, klen = _PAYLOAD.unpack_from(payload)
    pos = _PAYLOAD.size
    topic = payload[pos:pos + tlen].decode()
    pos += tlen
    key = None
    if klen != _NO_KEY:
        key = payload[pos:pos + klen]
        pos += klen
    return SpoolRecord(seq, topic, key, payload[pos:])


class Spool:
    def __init__(self, directory: str | Path, max_bytes: int = 256 << 20, segment_bytes: int = 8 << 20,
                 name: str = "spool") -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.max_bytes = max_bytes
        self.segment_bytes = min(segment_bytes, max(max_bytes // 4, 4096))
        self.dropped = 0
        self.torn = 0
        self._acked = self._read_cursor()
        self._done: set[int] = set()  # acknowledged seqs above the contiguous cursor
        self._segments: list[tuple[int, Path]] = self._scan()
        if self._segments and self._segments[0][0] - 1 > self._acked:
            # The cursor file lost its last writes (power loss before it was on disk) but the
            # acknowledged segments were already deleted: what is gone was acknowledged.
            log.warning("%s: cursor %d is behind the oldest segment (first seq %d); recovered from the segments",
                        self.name, self._acked, self._segments[0][0])
            self._acked = self._segments[0][0] - 1
            self._cursor_dirty = True
        self._next_seq = self._last_seq() + 1
        if self._next_seq <= self._acked:
            self._next_seq = self._acked + 1
        self._total_bytes = sum(p.stat().st_size for _, p in self._segments)
        # The newest records, kept in memory so that the sender need not re-read segments.
        self._recent: deque[SpoolRecord] = deque(maxlen=50_000)
        self._writer = None
        self._writer_bytes = 0
        self._unsynced = False
        self._cursor_dirty = getattr(self, "_cursor_dirty", False)

    # -- opening ---------------------------------------------------------------------------
    def _read_cursor(self) -> int:
        try:
            return int((self.dir / "cursor").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _scan(self) -> list[tuple[int, Path]]:
        segs = []
        for p in self.dir.glob("*.seg"):
            try:
                segs.append((int(p.stem), p))
            except ValueError:
                log.warning("%s: ignoring stray file %s", self.name, p)
        segs.sort()
        if segs:
            self._repair(segs[-1][1])
        return segs

    def _repair(self, path: Path) -> None:
        """Cut a torn tail off the last segment."""
        good = 0
        with path.open("rb") as fh:
            data = fh.read()
        pos = 0
        while pos + _HEADER.size <= len(data):
            length, crc, _seq = _HEADER.unpack_from(data, pos)
            end = pos + _HEADER.size + length
            # A payload is never shorter than its own header: a zero-filled tail (a power loss can
            # keep a file's size without its blocks) reads as length 0 and crc32(b"") == 0.
            if length < _PAYLOAD.size or end > len(data) or zlib.crc32(data[pos + _HEADER.size:end]) != crc:
                break
            pos = good = end
        if good < len(data):
            self.torn += 1
            log.warning("%s: cutting a torn tail of %d bytes off %s (crash during a write)",
                        self.name, len(data) - good, path.name)
            with path.open("r+b") as fh:
                fh.truncate(good)

    def _iter_segment(self, path: Path) -> Iterator[SpoolRecord]:
        try:
            with path.open("rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return
        pos = 0
        while pos + _HEADER.size <= len(data):
            length, crc, seq = _HEADER.unpack_from(data, pos)
            start, end = pos + _HEADER.size, pos + _HEADER.size + length
            if length < _PAYLOAD.size or end > len(data) or zlib.crc32(data[start:end]) != crc:
                return
            yield _decode(seq, data[start:end])
            pos = end

    def _last_seq(self) -> int:
        for _, path in reversed(self._segments):
            last = 0
            for rec in self._iter_segment(path):
                last = rec.seq
            if last:
                return last
        return self._acked

    # -- writing ---------------------------------------------------------------------------
    def append(self, topic: str, key: bytes | None, value: bytes) -> int:
        seq = self._next_seq
        payload = _encode(topic, key, value)
        if self._writer is None or self._writer_bytes >= self.segment_bytes:
            self._roll(seq)
        self._writer.write(_HEADER.pack(len(payload), zlib.crc32(payload), seq) + payload)
        self._writer.flush()  # in the OS page cache: survives a crash of this process
        self._writer_bytes += _HEADER.size + len(payload)
        self._total_bytes += _HEADER.size + len(payload)
        self._recent.append(SpoolRecord(seq, topic, key, value))
        self._unsynced = True
        self._next_seq += 1
        self._enforce_bound()
        return seq

    def _roll(self, first_seq: int) -> None:
        if self._writer is not None:
            os.fsync(self._writer.fileno())
            self._writer.close()
        path = self.dir / f"{first_seq:020d}.seg"
        self._writer = path.open("ab")
        self._writer_bytes = path.stat().st_size
        self._segments.append((first_seq, path))

    def sync(self) -> None:
        """fsync the open segment and persist the cursor (call about once a second)."""
        if self._writer is not None and self._unsynced:
            os.fsync(self._writer.fileno())
            self._unsynced = False
        if self._cursor_dirty:
            self._write_cursor()
            self._cursor_dirty = False
            self._gc()

    def _write_cursor(self) -> None:
        write_durably(self.dir / "cursor", str(self._acked).encode())

    def _unlink(self, path: Path) -> None:
        try:
            self._total_bytes -= path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            pass

    def _enforce_bound(self) -> None:
        while len(self._segments) > 1 and self._total_bytes > self.max_bytes:
            first, path = self._segments.pop(0)
            next_first = self._segments[0][0]
            lost = [r.seq for r in self._iter_segment(path) if r.seq > self._acked and r.seq not in self._done]
            self._unlink(path)
            if lost:
                self.dropped += len(lost)
                log.error("%s: spool over its bound of %d bytes: dropped %d unsent records (seq %d-%d)",
                          self.name, self.max_bytes, len(lost), lost[0], lost[-1])
            # Everything in the deleted segment now counts as done for the cursor.
            for s in range(self._acked + 1, next_first):
                self._done.add(s)
            self._advance()

    def _gc(self) -> None:
        """Delete segments whose every record is acknowledged (never the open one)."""
        while len(self._segments) > 1 and self._segments[1][0] <= self._acked + 1:
            _, path = self._segments.pop(0)
            self._unlink(path)

    # -- reading and acknowledging ---------------------------------------------------------
    def pending(self, after: int = 0, limit: int = 10_000) -> list[SpoolRecord]:
        """Up to `limit` unacknowledged records with seq > max(after, cursor), in order."""
        floor = max(after, self._acked)
        out: list[SpoolRecord] = []
        if floor >= self.last_seq:
            return out
        recent = self._recent
        if recent and recent[0].seq <= floor + 1:
            for rec in recent:
                if rec.seq > floor and rec.seq not in self._done:
                    out.append(rec)
                    if len(out) >= limit:
                        break
            return out
        segs = self._segments
        for i, (first, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if nxt is not None and nxt <= floor + 1:
                continue
            for rec in self._iter_segment(path):
                if rec.seq > floor and rec.seq not in self._done:
                    out.append(rec)
                    if len(out) >= limit:
                        return out
        return out

    def ack(self, seq: int) -> None:
        if seq <= self._acked:
            return
        self._done.add(seq)
        self._advance()

    def _advance(self) -> None:
        moved = False
        while self._acked + 1 in self._done:
            self._done.discard(self._acked + 1)
            self._acked += 1
            moved = True
        if moved:
            self._cursor_dirty = True
            recent = self._recent
            while recent and recent[0].seq <= self._acked:
                recent.popleft()

    @property
    def acked_through(self) -> int:
        return self._acked

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    @property
    def depth(self) -> int:
        """Records written and not yet acknowledged."""
        return max(0, self.last_seq - self._acked - len(self._done))

    def close(self) -> None:
        self.sync()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
