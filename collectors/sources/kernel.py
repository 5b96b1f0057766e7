"""Kernel log sources: /dev/kmsg (default), journald, plain files with rotation, stdin, memory.

Each yields `LogLine`s without blocking and keeps a cursor that the collector commits only after
Kafka acknowledged every event of the lines before it (collectors.agent), so a restart neither loses
nor re-sends records:

- kmsg: ``{"boot_id": ..., "seq": N}``; after a reboot (new boot id) the whole ring is read again.
  When the ring buffer overwrote records before we read them, the kernel answers EPIPE: counted as
  `lost` and logged, never fatal.
- journal: journalctl's ``__CURSOR``; ``journalctl -k -o json -f --after-cursor=...``.
- file (and stdin): text, whose writer no line can prove (a crash report's second line reads as a
  driver line there: FORGEABLE_TEXT); `open_kernel_source` opens them only when the operator
  accepts that, and their records are published with source ``file``, which the processor never
  acts on alone. ``{"inode": ..., "offset": ...}``; follows renames and truncation (logrotate): on a rename
  the old file is read to its end before the new one, and a restart whose
  cursor names a file rotated meanwhile reads that file's tail first. On the very first start it
  reads rotated ``.N`` and ``.N.gz`` files first (backfill), skipping those last written before
  `since` (the collector's look-back: the current boot unless ``--backfill`` widens it).

Lines read at a first start that were written before it are marked `history` (published as
`backfilled`: evidence, never a reason to act now); file lines carry the file's mtime (`ref_ts`),
from which the collector infers the year of a syslog time stamp.
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from xidstream.collectors.parse.kernel import INJECTED_KMSG
from xidstream.collectors.spool import write_durably

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
    history: bool = False  # read at a first start, written before it (backfill)
    ref_ts: float | None = None  # epoch seconds: the file's mtime, anchors a year-less syslog time
    # how the parser checks the line's writer (parse_line_checked's source), when not `source`:
    # "memory" for text a scenario or a test wrote, trusted as a file's
    parse_as: str | None = None


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
    write_durably(path, orjson.dumps(data))  # write, fsync, rename, fsync the directory


def _load_json(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = orjson.loads(path.read_bytes())
        return data if isinstance(data, dict) else {}
    except (OSError, orjson.JSONDecodeError):
        return {}


_KMSG_SEQ = re.compile(r"^\d+,(\d+),(\d+)")


class KmsgSource:
    """Reads /dev/kmsg records (or a file/FIFO holding records in the same format)."""

    name = "kmsg"

    def __init__(self, path: str | Path = "/dev/kmsg", cursor_file: Path | None = None,
                 boot_id_path: str | Path = "/proc/sys/kernel/random/boot_id", accept_injected: bool = False) -> None:
        self.path = Path(path)
        # Tests only: lines a root harness writes to /dev/kmsg (facility 1) count as the kernel's.
        self.parse_as = INJECTED_KMSG if accept_injected else None
        self.cursor_file = cursor_file
        try:
            self.boot_id = Path(boot_id_path).read_text().strip()
        except OSError:
            self.boot_id = "unknown"
        saved = _load_json(cursor_file)
        self.skip_through = int(saved.get("seq", -1)) if saved.get("boot_id") == self.boot_id else -1
        # A first start (no cursor at all): records stamped before now (kmsg stamps are CLOCK_MONOTONIC
        # microseconds, like time.monotonic) are history. After a reboot with an old cursor they are not:
        # they are this boot's, unseen, and published as live.
        self._history_before_us = int(time.monotonic() * 1e6) if not saved else -1
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
            history = m is not None and int(m.group(2)) < self._history_before_us
            lines.append(LogLine(text, seq, "kmsg", history, parse_as=self.parse_as))
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


# Where journald keeps its files: persistent, then volatile (systemd-journald.service(8)).
JOURNAL_DIRS = ("/var/log/journal", "/run/log/journal")


def _has_journal_files(dirs: tuple[str, ...]) -> bool:
    """True when one of `dirs` holds a *.journal file (directly or in a machine-id folder)."""
    for top in dirs:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(".journal"):
                return True
            if entry.is_dir(follow_symlinks=False):
                try:
                    if any(e.name.endswith(".journal") for e in os.scandir(entry.path)):
                        return True
                except OSError:
                    continue
    return False


class JournalSource:
    """``journalctl -k -o json -f`` with its cursor."""

    name = "journal"

    def __init__(self, cursor_file: Path | None = None, journalctl: str = "journalctl",
                 extra_args: list[str] | None = None, since: float | None = None,
                 journal_dirs: tuple[str, ...] | None = JOURNAL_DIRS) -> None:
        """`since`: on a first start, look back to this epoch time instead of the current boot's
        start (``--backfill``); 0 reads the whole kernel journal. `journal_dirs`: where journald
        keeps its files (None: not checked, e.g. with --directory in extra_args)."""
        self.journal_dirs = journal_dirs
        exe = shutil.which(journalctl)
        if exe is None:
            raise OSError(errno.ENOENT, f"{journalctl} not found: use --kernel-log kmsg or file:PATH")
        self.cursor_file = cursor_file
        self.lost = 0
        saved = _load_json(cursor_file).get("cursor")
        cmd = [exe, "-k", "-o", "json", "--no-pager", "-f", *(extra_args or [])]
        if saved:
            cmd += [f"--after-cursor={saved}"]
        elif since is None:
            cmd += ["-b"]  # the current boot only (NVSentinel starts at the tail for the same reason)
        elif since > 0:
            cmd += [f"--since=@{int(since)}"]
        # A first start: entries stamped before now are history.
        self._history_before_us = None if saved else int(time.time() * 1e6)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self._lines = _ThreadedLines(self.proc.stdout, "journalctl-reader")

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        out = []
        for text in self._lines.drain(max_lines):
            history = False
            try:
                rec = orjson.loads(text)
                cursor = rec.get("__CURSOR")
                if self._history_before_us is not None:
                    history = int(rec.get("__REALTIME_TIMESTAMP", 0)) < self._history_before_us
            except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                cursor = None
            out.append(LogLine(text, cursor, "journal", history))
        return out

    @property
    def failed(self) -> str | None:
        """Why no lines come (journalctl exited and its output is read, or there is no journal to
        read), else None: the collector's readiness and `xidstream_collector_source_up`."""
        rc = self.proc.poll()
        if rc is not None and self._lines.eof:
            return f"journalctl exited with status {rc}"
        if self.journal_dirs is not None and not _has_journal_files(self.journal_dirs):
            # journalctl -f on a host without journal files waits forever, printing nothing: seen
            # with the chart's journal mode on a node that logs the kernel elsewhere (its hostPath
            # volumes are DirectoryOrCreate, so the folders exist, empty). Checked on every call:
            # journald may start writing later.
            return (f"no journal files under {' or '.join(self.journal_dirs)}: this host does not keep kernel "
                    f"messages in journald (use --kernel-log kmsg, or collector.kernelLog kmsg in the chart)")
        return None

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
                 follow: bool = True, since: float | None = None) -> None:
        self.path = Path(path)
        self.cursor_file = cursor_file
        self.follow = follow
        self.lost = 0
        saved = _load_json(cursor_file)
        self._backlog: list[Path] = []
        if backfill and not saved:
            for old in _rotated(self.path):
                try:
                    mtime = old.stat().st_mtime
                except OSError:
                    continue
                if since is not None and mtime < since:
                    continue  # last written before the look-back: every line in it is older
                self._backlog.append(old)
        self._fh = None
        self._inode: int | None = None
        self._offset = 0
        self._buf = b""
        self.done = False
        # First start: the bytes of the current file that exist now were written before us.
        self._first_start = not saved
        self._history_end = 0
        self._first_stat = None
        if not saved:
            try:
                st = self.path.stat()
                self._first_stat = (st.st_ino, st.st_size)
            except OSError:
                pass
        if saved:
            self._inode, self._offset = saved.get("inode"), int(saved.get("offset", 0))
            self._resume_rotated()

    def _resume_rotated(self) -> None:
        """The cursor names a file that was rotated while we were stopped: read its tail first."""
        try:
            if self.path.stat().st_ino == self._inode:
                return
        except FileNotFoundError:
            pass
        for old in reversed(_rotated(self.path)):  # newest first: kern.log.1
            if old.suffix == ".gz":
                continue
            try:
                st = old.stat()
            except OSError:
                continue
            if st.st_ino == self._inode and st.st_size >= self._offset:
                self._fh = old.open("rb")
                self._fh.seek(self._offset)
                log.info("%s: resuming in the rotated %s at offset %d", self.path, old.name, self._offset)
                return

    def _lines(self, chunk: bytes, final: bool, history_end: int, ref: float | None) -> list[LogLine]:
        """Split what was read into lines with their cursors; `final`: the file is complete, so a
        last line without a newline is a line too."""
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        if final and self._buf:
            lines.append(self._buf)
            self._buf = b""
            trailing = True
        else:
            trailing = False
        out = []
        pos = self._offset
        for i, raw in enumerate(lines):
            pos += len(raw) + (0 if trailing and i == len(lines) - 1 else 1)
            out.append(LogLine(raw.decode("utf-8", "replace"), {"inode": self._inode, "offset": pos}, "file",
                               history=pos <= history_end, ref_ts=ref))
        self._offset = pos
        return out

    def _drain_rotated(self) -> list[LogLine]:
        """Read the rest of the file we had open (renamed away) to its end, then let it go."""
        out: list[LogLine] = []
        ref = None
        try:
            ref = os.fstat(self._fh.fileno()).st_mtime
            while True:
                chunk = self._fh.read(1 << 20)
                if not chunk:
                    break
                out += self._lines(chunk, False, self._history_end, ref)
        except OSError as exc:
            log.warning("%s: cannot read the rest of the rotated file: %s", self.path, exc)
        out += self._lines(b"", True, self._history_end, ref)
        self._fh.close()
        self._fh = None
        self._history_end = 0
        return out

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        out: list[LogLine] = []
        while self._backlog and len(out) < max_lines:
            old = self._backlog.pop(0)
            opener = gzip.open if old.suffix == ".gz" else open
            try:
                ref = old.stat().st_mtime
                with opener(old, "rb") as fh:
                    for raw in fh:
                        out.append(LogLine(raw.decode("utf-8", "replace").rstrip("\n"), None, "file",
                                           history=True, ref_ts=ref))
            except (OSError, EOFError) as exc:
                log.warning("cannot read rotated log %s: %s", old, exc)
        try:
            st = self.path.stat()
        except FileNotFoundError:
            st = None
        if self._fh is not None and (st is None or st.st_ino != self._inode):
            if st is None and self.follow:
                return out + self._read_open(None)  # renamed, no new file yet: keep reading the old one
            # Rotated: the old file (still open) is read to its end before switching.
            log.info("%s was rotated; finishing the old file, then reading the new one", self.path)
            out += self._drain_rotated()
        if st is None:
            self.done = not self.follow
            return out
        if self._fh is not None and st.st_size < self._offset:  # truncated (copytruncate)
            log.info("%s was truncated; reading it from its start", self.path)
            self._fh.close()
            self._fh = None
            self._inode = None
        if self._fh is None:
            same = st.st_ino == self._inode and st.st_size >= self._offset
            self._fh = self.path.open("rb")
            if same:
                self._fh.seek(self._offset)
            else:
                self._offset = 0
                self._buf = b""
            self._inode = st.st_ino
            if self._first_start:
                first = self._first_stat
                self._history_end = first[1] if first and first[0] == st.st_ino else 0
                self._first_start = False
        return out + self._read_open(st.st_mtime)

    def _read_open(self, ref: float | None) -> list[LogLine]:
        chunk = self._fh.read(1 << 20)
        if not chunk:
            self.done = not self.follow
        return self._lines(chunk, not self.follow and not chunk, self._history_end, ref)

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
    """Lines pushed by a scenario or a test, published as from `source`. Their text is the test's
    or the scenario author's, trusted as a file's is (a scenario line carries no kmsg record
    header); `checked=True` has the parser check them as the real `source` reader's lines are
    (a kmsg line without its header, or with a facility other than 0, is refused)."""

    def __init__(self, source: str = "kmsg", *, checked: bool = False, scenario: bool = False) -> None:
        # scenario: a scenario's lines, read as `xidstream parse` reads text (its author's), except
        # those shaped as a live source's record (collectors.parse.kernel.parse_scenario_line)
        self.parse_as = None if checked else "scenario" if scenario else "memory"
        self.name = source
        self.lost = 0
        self._lines: list[LogLine] = []
        self.committed: list[Any] = []
        self._seq = 0

    def feed(self, lines: list[str]) -> None:
        for text in lines:
            self._seq += 1
            self._lines.append(LogLine(text, self._seq, self.name, parse_as=self.parse_as))

    def read(self, max_lines: int = 10_000) -> list[LogLine]:
        out, self._lines = self._lines[:max_lines], self._lines[max_lines:]
        return out

    def commit(self, cursor: Any) -> None:
        self.committed.append(cursor)

    def close(self) -> None:
        pass


# Why text is refused for live collection unless the operator accepts it (`open_kernel_source`).
FORGEABLE_TEXT = (
    "a line of text says nothing about who wrote it: the syslog(2) interface that rsyslog (kern.log) and "
    "`dmesg -S` read splits a kernel record at a newline in a file name and gives the rest a kernel prefix of "
    "its own, so any process that crashes inside a file it names can forge a driver Xid line there")


def open_kernel_source(spec: str, state_dir: Path, since: float | None = None,
                       accept_injected: bool = False, accept_forgeable: bool = False) -> KernelSource:
    """`kmsg`, `journal`, `file:PATH` or `-` (stdin), as given to --kernel-log. `since`: how far a
    first start looks back (epoch seconds; None: the current boot; 0: everything, ``--backfill``).
    `accept_injected` (kmsg only, end-to-end tests only): userspace writes to /dev/kmsg count.
    `accept_forgeable`: a file or stdin may be read (``--accept-forgeable-kernel-log``); refused
    otherwise (FORGEABLE_TEXT). Their records are published with source ``file``, which the
    processor never acts on alone (schemas.vocab.ATTESTED_XID_SOURCES)."""
    if accept_injected and not spec.startswith("kmsg"):
        raise ValueError("--accept-injected-kmsg works with --kernel-log kmsg only")
    if (spec.startswith("file:") or spec == "-") and not accept_forgeable:
        raise ValueError(f"--kernel-log {spec}: {FORGEABLE_TEXT}. Read kmsg or journal, whose records carry "
                         f"their writer; or give --accept-forgeable-kernel-log, and the processor records these "
                         f"lines but never acts on them alone (`xidstream parse` reads saved logs for a look back)")
    if spec == "kmsg":
        return KmsgSource(cursor_file=state_dir / "kmsg.cursor", accept_injected=accept_injected)
    if spec.startswith("kmsg:"):
        return KmsgSource(spec[5:], cursor_file=state_dir / "kmsg.cursor", accept_injected=accept_injected)
    if spec == "journal":
        return JournalSource(cursor_file=state_dir / "journal.cursor", since=since)
    if spec.startswith("file:"):
        path = Path(spec[5:])
        boot = time.time() - time.monotonic()
        return FileSource(path, cursor_file=state_dir / f"file-{path.name}.cursor",
                          since=boot if since is None else since)
    if spec == "-":
        return StdinSource()
    raise ValueError(f"unknown --kernel-log {spec!r}: use kmsg, journal, file:PATH or -")
