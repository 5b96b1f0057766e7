"""Kernel log sources: /dev/kmsg (default), journald, plain files with rotation, stdin, memory.

Each yields `LogLine`s without blocking and keeps a cursor that the collector commits only after
Kafka acknowledged every event of the lines before it (collectors.agent), so a restart neither loses
nor re-sends records:

- kmsg: ``{"boot_id": ..., "seq": N}``; after a reboot (new boot id) the whole ring is read again.
  When the ring buffer overwrote records before we read them, the kernel answers EPIPE: counted as
  `lost` and logged, never fatal.
- journal: journalctl's ``__CURSOR``; ``journalctl -k -o json -f --after-cursor=...``.
- file: ``{"inode": ..., "offset": ...}``; follows renames and truncation (logrotate), reads rotated
  ``.1`` and ``.gz`` files first on the very first start (backfill).
"""

from __future__ import annotations

import errno
import gzip
import logging
import os
import queue
import re
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

__all__ = [
    "LogLine", "KernelSource", "KmsgSource", "JournalSource", "FileSource", "StdinSource",
    "MemoryKernelSource", "open_kernel_source",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LogLine:
    text: str
    cursor: Any  # what `commit` takes; None: nothing to commit
    source: str  # a schemas.XidSource value: kmsg | journal | file


class KernelSource(Protocol):
    name: str
    lost: int

    def read(self, max_lines: int = 10_000) -> list[LogLine]: ...
    def commit(self, cursor: Any) -> None: ...
    def close(self) -> None: ...


def _save_json(path: Path | None, data: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(orjson.dumps(data))
    os.replace(tmp, path)


def _load_json(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = orjson.loads(path.read_bytes())
        return data if isinstance(data, dict) else {}
    except (OSError, orjson.JSONDecodeError):
        return {}


_KMSG_SEQ = re.compile(r"^\d+,(\d+),")


class KmsgSource:
    """Reads /dev/kmsg records (or a file/FIFO holding records in the same format)."""

    name = "kmsg"

    def __init__(self, path: str | Path = "/dev/kmsg", cursor_file: Path | None = None,
                 boot_id_path: str | Path = "/proc/sys/kernel/random/boot_id") -> None:
        self.path = Path(path)
        self.cursor_file = cursor_file
        try:
            self.boot_id = Path(boot_id_path).read_text().strip()
        except OSError:
            self.boot_id = "unknown"
        saved = _load_json(cursor_file)
        self.skip_through = int(saved.get("seq", -1)) if saved.get("boot_id") == self.boot_id else -1
        self.lost = 0
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open {self.path}: {exc.strerror} "
                          f"(the collector needs read access to the kernel log; run as root or "
                          f"with CAP_SYSLOG, or use --kernel-log journal)") from None
        self.record_mode = stat.S_ISCHR(os.fstat(self.fd).st_mode)
        self._buf = b""

    def _records(self, max_lines: int) -> list[str]:
        out: list[str] = []
        while len(out) < max_lines:
            try:
                chunk = os.read(self.fd, 8192 if self.record_mode else 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    # The ring buffer overwrote records we had not read; the next read goes on.
                    self.lost += 1
                    log.warning("kmsg: kernel ring buffer overwrote unread records (%d times so far)", self.lost)
                    continue
                if exc.errno == errno.EINVAL:
                    break
                raise
            if not chunk:
                break
            if self.record_mode:
                # One record per read; continuation lines (" KEY=value") follow the first line.
                out.append(chunk.decode("utf-8", "replace").split("\n", 1)[0])
            else:
                self._buf += chunk
                *lines, self._buf = self._buf.split(b"\n")
                out.extend(ln.decode("utf-8", "replace") for ln in lines if ln and not ln.startswith(b" "))
        return out

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        lines = []
        for text in self._records(max_lines):
            m = _KMSG_SEQ.match(text)
            seq = int(m.group(1)) if m else None
            if seq is not None:
                if seq <= self.skip_through:
                    continue
            lines.append(LogLine(text, seq, "kmsg"))
        return lines

    def commit(self, cursor: Any) -> None:
        if cursor is None:
            return
        self.skip_through = max(self.skip_through, int(cursor))
        _save_json(self.cursor_file, {"boot_id": self.boot_id, "seq": self.skip_through})

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class _ThreadedLines:
    """Reads a blocking text stream in a daemon thread into a queue."""

    def __init__(self, stream, name: str) -> None:
        self.q: queue.Queue[str | None] = queue.Queue(maxsize=100_000)
        self.eof = False
        self._t = threading.Thread(target=self._run, args=(stream,), name=name, daemon=True)
        self._t.start()

    def _run(self, stream) -> None:
        for line in stream:
            self.q.put(line.decode("utf-8", "replace") if isinstance(line, bytes) else line)
        self.q.put(None)

    def drain(self, max_lines: int) -> list[str]:
        out = []
        while len(out) < max_lines:
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.eof = True
                break
            out.append(item.rstrip("\n"))
        return out


class JournalSource:
    """``journalctl -k -o json -f`` with its cursor."""

    name = "journal"

    def __init__(self, cursor_file: Path | None = None, journalctl: str = "journalctl",
                 extra_args: list[str] | None = None) -> None:
        exe = shutil.which(journalctl)
        if exe is None:
            raise OSError(errno.ENOENT, f"{journalctl} not found: use --kernel-log kmsg or file:PATH")
        self.cursor_file = cursor_file
        self.lost = 0
        saved = _load_json(cursor_file).get("cursor")
        cmd = [exe, "-k", "-o", "json", "--no-pager", "-f", *(extra_args or [])]
        cmd += [f"--after-cursor={saved}"] if saved else ["-b"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self._lines = _ThreadedLines(self.proc.stdout, "journalctl-reader")

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        out = []
        for text in self._lines.drain(max_lines):
            try:
                cursor = orjson.loads(text).get("__CURSOR")
            except (orjson.JSONDecodeError, AttributeError):
                cursor = None
            out.append(LogLine(text, cursor, "journal"))
        return out

    def commit(self, cursor: Any) -> None:
        if cursor:
            _save_json(self.cursor_file, {"cursor": cursor})

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _rotated(path: Path) -> list[Path]:
    """kern.log.N[.gz], oldest first."""
    found = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1:].removesuffix(".gz")
        if suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found, reverse=True)]


class FileSource:
    """Follows a log file across rotation; on a first start, backfills rotated files."""

    name = "file"

    def __init__(self, path: str | Path, cursor_file: Path | None = None, backfill: bool = True,
                 follow: bool = True) -> None:
        self.path = Path(path)
        self.cursor_file = cursor_file
        self.follow = follow
        self.lost = 0
        saved = _load_json(cursor_file)
        self._backlog: list[Path] = _rotated(self.path) if backfill and not saved else []
        self._fh = None
        self._inode: int | None = None
        self._offset = 0
        self._buf = b""
        self.done = False
        if saved:
            self._inode, self._offset = saved.get("inode"), int(saved.get("offset", 0))

    def _open_current(self) -> bool:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        if self._fh is not None and st.st_ino == self._inode and st.st_size >= self._offset:
            return True
        if self._fh is not None:
            self._fh.close()
        same = st.st_ino == self._inode and st.st_size >= self._offset
        self._fh = self.path.open("rb")
        if same:
            self._fh.seek(self._offset)
        else:  # rotated or truncated: read the new file from its start
            if self._inode is not None:
                log.info("%s was rotated or truncated; reading the new file", self.path)
            self._offset = 0
            self._buf = b""
        self._inode = st.st_ino
        return True

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        out: list[LogLine] = []
        while self._backlog and len(out) < max_lines:
            old = self._backlog.pop(0)
            opener = gzip.open if old.suffix == ".gz" else open
            try:
                with opener(old, "rb") as fh:
                    for raw in fh:
                        out.append(LogLine(raw.decode("utf-8", "replace").rstrip("\n"), None, "file"))
            except (OSError, EOFError) as exc:
                log.warning("cannot read rotated log %s: %s", old, exc)
        if not self._open_current():
            self.done = not self.follow
            return out
        # A rotation may have happened while we read: finish the old file before switching.
        chunk = self._fh.read(1 << 20)
        if not chunk:
            self.done = not self.follow
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        pos = self._offset
        for raw in lines:
            pos += len(raw) + 1
            out.append(LogLine(raw.decode("utf-8", "replace"), {"inode": self._inode, "offset": pos}, "file"))
        self._offset = pos
        if not self.follow and not chunk and self._buf:
            out.append(LogLine(self._buf.decode("utf-8", "replace"), {"inode": self._inode, "offset": pos + len(self._buf)}, "file"))
            self._buf = b""
        return out

    def commit(self, cursor: Any) -> None:
        if cursor:
            _save_json(self.cursor_file, cursor)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


class StdinSource:
    name = "file"

    def __init__(self, stream=None) -> None:
        self.lost = 0
        self._lines = _ThreadedLines(stream or sys.stdin, "stdin-reader")

    @property
    def done(self) -> bool:
        return self._lines.eof

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        return [LogLine(t, None, "file") for t in self._lines.drain(max_lines)]

    def commit(self, cursor: Any) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryKernelSource:
    """Lines pushed by a scenario or a test; reads them as /dev/kmsg would deliver them."""

    def __init__(self, source: str = "kmsg") -> None:
        self.name = source
        self.lost = 0
        self._lines: list[LogLine] = []
        self.committed: list[Any] = []
        self._seq = 0

    def feed(self, lines: list[str]) -> None:
        for text in lines:
            self._seq += 1
            self._lines.append(LogLine(text, self._seq, self.name))

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        out, self._lines = self._lines[:max_lines], self._lines[max_lines:]
        return out

    def commit(self, cursor: Any) -> None:
        self.committed.append(cursor)

    def close(self) -> None:
        pass


def open_kernel_source(spec: str, state_dir: Path) -> KernelSource:
    """`kmsg`, `journal`, `file:PATH` or `-` (stdin), as given to --kernel-log."""
    if spec == "kmsg":
        return KmsgSource(cursor_file=state_dir / "kmsg.cursor")
    if spec.startswith("kmsg:"):
        return KmsgSource(spec[5:], cursor_file=state_dir / "kmsg.cursor")
    if spec == "journal":
        return JournalSource(cursor_file=state_dir / "journal.cursor")
    if spec.startswith("file:"):
        path = Path(spec[5:])
        return FileSource(path, cursor_file=state_dir / f"file-{path.name}.cursor")
    if spec == "-":
        return StdinSource()
    raise ValueError(f"unknown --kernel-log {spec!r}: use kmsg, journal, file:PATH or -")
