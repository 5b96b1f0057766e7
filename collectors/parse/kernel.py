"""Kernel log line -> Xid and related driver records. A pure function of one line.

Accepts every prefix of ../shared/data/README.md: none (bare ``NVRM:``), dmesg ``[ 1843.308145]``,
``dmesg -T`` ``[Wed Mar  1 17:44:21 2023]``, ``dmesg --time-format iso``, syslog
``Dec  6 17:49:03 host kernel:`` (with or without an embedded ``[ts]``), ``<4>[ts]``, ``/dev/kmsg``
records (``4,1234,5678901,-;NVRM: ...``) and ``journalctl -o json`` records (the ``MESSAGE`` field).

The driver's Xid print (open-gpu-kernel-modules, ``kernel_rc.c``):
``NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u[ GPU-CI:%02u]]): %d, pid=%s, name=%s, %s``;
very old drivers print ``Xid (0000:01:00): 13, 0005 0000 ...`` (no ``PCI:``, no pid), some print a
pid and no name; an unknown pid is ``pid='<unknown>'`` and an unknown name ``name=<unknown>``.

Only the driver's own records are believed (everything a node sends is untrusted input, the kernel
log included). The kernel copies text that an unprivileged process chooses into its own records: the
x86 ``traps:`` and ``segfault`` reports print the faulting mapping's file name unescaped, so a tenant
that crashes inside a file named ``NVRM: Xid (PCI:0000:ee:00): 79, ...`` gets a genuine kernel record
(facility 0) that quotes a driver line. So:

- a record counts only where the driver writes it: its marker (``NVRM: `` or
  ``nvidia-nvswitchN: SXid``) opens the message body, right after the known prefixes; a marker
  anywhere else is quoted text, refused with the reason ``quoted``;
- no blank is stripped before the marker: ``dmesg`` prints the second line of a record (a newline in
  a tenant's file name, which /dev/kmsg escapes as ``\\x0a``) indented to the width of its own
  prefix, as part of the record above it, so an indented line is never a message of its own;
- every accepted shape is anchored and has at least 16 fixed characters before its first free-form
  field. A tenant controls the start of a kernel message only through a task name (``comm``,
  TASK_COMM_LEN 16: at most 15 characters, as in ``python3[5030]: segfault at ...``) or an interface
  name (IFNAMSIZ 16), so it cannot complete one;
- /dev/kmsg records must carry facility 0 (kernel): a userspace write to /dev/kmsg arrives with
  facility 1 (``devkmsg_write`` defaults it to LOG_USER and never lets a writer choose 0). A
  ``<N>`` priority prefix (``dmesg -r``) is held to the same rule;
- journal records must carry ``_TRANSPORT=kernel`` (``journalctl -k`` selects those; a record fed
  from elsewhere may not);
- two messages glued onto one line (a log pipeline that lost a newline; never in kmsg or journal
  records, which are one message each) are split only at a second marker that follows a timestamp
  prefix of its own (``[ 1.1] NVRM: ...``), and only after a driver message: a driver line inside a
  ``traps:`` report is not a glued line.

What a line of text (a file, stdin) says about its writer stops at its prefix: the syslog(2)
interface that rsyslog's imklog (kern.log) and ``dmesg -S`` read splits a record at an embedded
newline and gives each line a ``<prio>[ts]`` prefix of its own, so the second line of a tenant's
crash report is, as text, the driver's own print (tests/data/kernel-newline-forgery.tsv). No
parser can refuse it; records from text are marked as such by the collector
(``XidSource.file``), and the processor never acts on them alone.

A forensic mode (``parse_line_checked(..., forensic=True)``, for ``xidstream parse``) reads text as
people paste it with the same grammar: every driver message wherever it sits in a line, each record
saying in ``refused`` why a live source would not believe it. Only lines shaped as a live source's
records (a /dev/kmsg record, a journal JSON record) can be believed there; the live path never
passes the flag.

`parse_line` never raises: a parser bug costs the line, but `parse_line_checked` says so (reason
``error``) and the collector counts and logs it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone

import orjson

__all__ = ["KernelRecord", "Parsed", "parse_line", "parse_line_checked", "extract_pci", "split_prefix",
           "sxid_continues", "merge_sxid", "continues_fallen", "merge_more", "parse_scenario_line", "SCENARIO_TEXT", "REFUSALS"]


@dataclass(frozen=True, slots=True)
class KernelRecord:
    """One record found in a kernel log line. `kind` is a `schemas.XidKind` value."""

    kind: str
    raw: str
    message: str = ""
    xid: int | None = None
    pci: str | None = None  # normalised dddd:bb:dd
    # SXid records: the PCI ids (normalised dddd:bb:dd) of the NVSwitches that printed the event's
    # lines, in the order first seen. Never in `pci`: an NVSwitch is no GPU.
    nvswitch_pcis: tuple[str, ...] = ()
    pid: int | None = None
    process_name: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    gpu_uuid: str | None = None  # identity lines
    gpu_ref: int | None = None  # "GPU1 ..." lines name the GPU by the driver's number
    kernel_ts: str | None = None  # the prefix's own timestamp text
    # What the prefix says about time: "iso", "journal" (absolute, in
    # `wall_ts`), "ctime" (`dmesg -T`: local time in `local_ts`), "syslog" (local time without a
    # year in `syslog_ts`), "kmsg" / "mono" (microseconds since some boot in `mono_us`), or None.
    ts_kind: str | None = None
    wall_ts: datetime | None = None  # when the prefix gives an absolute time (iso, journal)
    local_ts: datetime | None = None  # naive local time (dmesg -T)
    syslog_ts: tuple[int, int, int, int, int] | None = None  # month, day, hour, minute, second
    mono_us: int | None = None  # microseconds since boot (kmsg, journal, dmesg)
    seq: int | None = None  # /dev/kmsg sequence number
    device: str | None = None  # NVSwitch device for SXid records
    # Forensic mode only (`parse_line_checked(..., forensic=True)`): why a live source would not
    # believe this record (a REFUSALS key); None: it would. Always None in strict mode, which
    # returns only what it believes.
    refused: str | None = None


_HEX_PCI = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"

_MARKER = re.compile(r"NVRM: |nvidia-nvswitch\d*: SXid ")
# A glued second message starts with a timestamp prefix of its own: dmesg's, or dmesg -r's.
_GLUE = re.compile(r"(?:<\d+>)?\[\s*\d+\.\d+\]\s?(?=NVRM: |nvidia-nvswitch\d*: SXid )")
_XID = re.compile(
    rf"NVRM: Xid \((?:PCI:)?(?P<pci>{_HEX_PCI})(?:\.\d)?(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?\): "
    r"(?P<xid>\d+)(?:,\s*(?P<rest>.*))?$"
)
_PID_NAME = re.compile(r"^pid=(?P<pid>'?<unknown>'?|\d+)(?:, name=(?P<name>.*?))?(?:, (?P<msg>.*))?$")
# The UUID has NVML's shape (nvmlDeviceGetUUID, which the driver's line prints): "GPU-" and 8-4-4-4-12
# hex digits. Any other string names no GPU (a "GPU-123" would key a GPU's records and its reset),
# and the line is no identity record.
_IDENTITY = re.compile(
    rf"NVRM: GPU at PCI:(?P<pci>{_HEX_PCI})(?:\.\d)?: "
    r"(?P<uuid>GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})(?![0-9a-zA-Z-])")
_RATE_LIMIT = re.compile(rf"NVRM: Rate limiting GSP RPC error prints for GPU at PCI:(?P<pci>{_HEX_PCI})")
_RECOVERY = re.compile(
    r"NVRM: (?:GPU(?P<ref>\d+) )?(?:(?P<fn>\w*refcnt\w*): Failed to enter state \d+|"
    rf"GPU (?P<pci>{_HEX_PCI})(?:\.\d)?: RmInitAdapter failed)"
)
_SXID = re.compile(
    rf"(?P<dev>nvidia-nvswitch\d*): SXid \((?:PCI:)?(?P<pci>{_HEX_PCI})(?:\.\d)?\): (?P<code>\d+),?\s*(?P<msg>.*)$"
)
# The driver's fallen-off-the-bus prints: "NVRM: GPU 0000:91:00.0: GPU has fallen off the bus." (after
# an Xid 79), and the probe-time message of open-gpu-kernel-modules (kernel-open/nvidia/nv.c, when RM
# cannot read the GPU at probe; no Xid 79 comes with it), one print of three lines:
#   "NVRM: The NVIDIA GPU %04x:%02x:%02x.%x\n"
#   "NVRM: (PCI ID: %04x:%04x) installed in this system has\n"
#   "NVRM: fallen off the bus and is not responding to commands.\n"
# The first line names the GPU and is the record; the other two name none (`_PROBE_MORE`: pieces the
# caller joins to the record above, never records of their own). /dev/kmsg keeps one print as one
# record with the newlines escaped (\x0a) and journald keeps it whole: the whole record is one match.
# A line that also carries "(PCI ID: ...) installed in this system has" is taken too (earlier
# versions of this parser expected it there). Anchored: a substring test let any NVRM-opened text
# that a tenant's file name completes ("NVRM: x[5030]: segfault ... in GPU has fallen off the bus
# 0000:ee:00") pass.
_NL = r"(?:\\x0a|\n)"
_PCI_ID = r"\(PCI ID: [0-9a-fA-F]{4}:[0-9a-fA-F]{4}\) installed in this system has"
_FALLEN = re.compile(
    rf"NVRM: (?:GPU (?P<pci>{_HEX_PCI})(?:\.\d)?: GPU has fallen off the bus\.?|"
    rf"The NVIDIA GPU (?P<pci2>{_HEX_PCI})(?:\.\d)?(?:(?: |{_NL}NVRM: ){_PCI_ID}"
    rf"(?:(?: |{_NL}NVRM: )fallen off the bus(?: and is not responding to commands\.)?)?)?)\s*$"
)
_PROBE_MORE = re.compile(
    rf"NVRM: (?:{_PCI_ID}|fallen off the bus and is not responding to commands\.)\s*$")
_ANY_PCI = re.compile(rf"(?<![0-9a-fA-F:]){_HEX_PCI}(?:\.\d)?(?![0-9a-fA-F])")

# Prefixes, tried in order at the start of the line.
_KMSG = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<us>\d+),[^;]*;")
# rsyslog's RFC 3339 high-precision stamp (RSYSLOG_FileFormat): "2025-05-27T04:18:56.089671+00:00 host kernel: "
_RFC3339 = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)) \S+ kernel: (?:\[\s*(?P<mono>\d+\.\d+)\]\s?)?"
)
# A monitoring system's wrapper around a syslog line (../shared/data: "Xid errors on instance: ip-..,
# Error: May 19 07:08:57 ip-.. kernel: [..] NVRM: Xid ..."). A prefix of 33 fixed characters: no
# kernel message that a tenant can start opens with it.
_WRAPPER = re.compile(r"^Xid errors on instance: [\w.-]+, Error: ")
_ISO = re.compile(r"^\w+\s*:\s*\w+\s*:\s*(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d+)?(?:[+-]\d\d:?\d\d|Z))\s")
_PRIO = re.compile(r"^<\d+>")
_DMESG = re.compile(r"^\[\s*(?P<ts>\d+\.\d+)\]\s?")
_CTIME = re.compile(r"^\[(?P<ts>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s?")
_MONTHS = {m: i + 1 for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"))}
_SYSLOG = re.compile(r"^(?P<ts>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d) \S+ kernel: (?:\[\s*(?P<mono>\d+\.\d+)\]\s?)?")


@functools.lru_cache(maxsize=4096)
def _norm(pci: str) -> str | None:
    domain, bus, dev = pci.split(":")
    try:
        return f"{int(domain, 16) & 0xFFFF:04x}:{int(bus, 16):02x}:{int(dev.split('.')[0], 16):02x}"
    except ValueError:
        return None


def _us(seconds: str) -> int:
    """Microseconds of a "1843.308145" stamp, read as digits: float("4397034.486581") * 1e6 is
    4397034486580.99..., which int() cut to ...580, one microsecond early for about 2% of stamps."""
    whole, _, frac = seconds.partition(".")
    return int(whole) * 1_000_000 + int((frac + "000000")[:6])


def split_prefix(line: str) -> tuple[str, dict]:
    """Strip a known prefix; return the body and what the prefix said about time."""
    meta: dict = {}
    body = line.rstrip("\r\n")
    if body.startswith("Xid errors on instance: "):
        m = _WRAPPER.match(body)
        if m:
            body = body[m.end():]
    if body.startswith("{"):
        try:
            rec = orjson.loads(body)
        except orjson.JSONDecodeError:
            rec = None
        if isinstance(rec, dict) and "MESSAGE" in rec:
            msg = rec["MESSAGE"]
            if isinstance(msg, list):  # journald writes non-UTF-8 messages as a byte array
                try:
                    msg = bytes(msg).decode("utf-8", "replace")
                except (TypeError, ValueError):
                    msg = ""
            body = msg if isinstance(msg, str) else ""
            transport = rec.get("_TRANSPORT")
            meta["transport"] = transport if isinstance(transport, str) else None
            try:
                if "__REALTIME_TIMESTAMP" in rec:
                    us = int(rec["__REALTIME_TIMESTAMP"])
                    meta["wall_ts"] = datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=us)
                    meta["kernel_ts"] = str(rec["__REALTIME_TIMESTAMP"])
                    meta["ts_kind"] = "journal"
                mono = rec.get("_SOURCE_MONOTONIC_TIMESTAMP") or rec.get("__MONOTONIC_TIMESTAMP")
                if mono is not None:
                    meta["mono_us"] = int(mono)
            except (TypeError, ValueError, OverflowError, OSError):
                pass
            return body, meta
    first = body[:1]
    if first.isdigit():
        m = _KMSG.match(body)
        if m:
            meta["facility"] = int(m["prio"]) >> 3
            meta["seq"] = int(m["seq"])
            meta["mono_us"] = int(m["us"])
            meta["kernel_ts"] = m["us"]
            meta["ts_kind"] = "kmsg"
            return body[m.end():], meta
        m = _RFC3339.match(body)
        if m:
            meta["kernel_ts"] = m["ts"]
            if m["mono"]:
                meta["mono_us"] = _us(m["mono"])
            try:
                meta["wall_ts"] = datetime.fromisoformat(m["ts"]).astimezone(timezone.utc)
                meta["ts_kind"] = "iso"
            except ValueError:
                pass
            return body[m.end():], meta
    elif first == "<":
        m = _PRIO.match(body)
        if m:
            meta["facility"] = int(body[1:m.end() - 1]) >> 3
            body = body[m.end():]
            first = body[:1]
    elif first.isalpha() and not body.startswith("NVRM"):
        m = _ISO.match(body)
        if m:
            meta["kernel_ts"] = m["ts"]
            try:
                meta["wall_ts"] = datetime.fromisoformat(m["ts"].replace(",", ".")).astimezone(timezone.utc)
                meta["ts_kind"] = "iso"
            except ValueError:
                pass
            return body[m.end():], meta
        m = _SYSLOG.match(body)
        if m:
            meta["kernel_ts"] = m["ts"]
            if m["mono"]:
                meta["mono_us"] = _us(m["mono"])
            month = _MONTHS.get(m["ts"][:3])
            if month:
                hh, mm, ss = m["ts"][7:].split(":")
                meta["syslog_ts"] = (month, int(m["ts"][4:6]), int(hh), int(mm), int(ss))
                meta["ts_kind"] = "syslog"
            return body[m.end():], meta
    if first == "[":
        m = _DMESG.match(body)
        if m:
            meta["kernel_ts"] = m["ts"]
            meta["mono_us"] = _us(m["ts"])
            meta["ts_kind"] = "mono"
            return body[m.end():], meta
        m = _CTIME.match(body)
        if m:
            meta["kernel_ts"] = m["ts"]
            t = m["ts"]  # "Wed Mar  1 17:44:21 2023"
            month = _MONTHS.get(t[4:7])
            try:
                hh, mm, ss = t[11:19].split(":")
                if month:
                    meta["local_ts"] = datetime(int(t[20:24]), month, int(t[8:10]), int(hh), int(mm), int(ss))
                    meta["ts_kind"] = "ctime"
            except ValueError:
                pass
            return body[m.end():], meta
    return body, meta


def _segments(body: str, glue: bool = True) -> list[str]:
    """The driver messages of a body: none unless a marker opens it (anything else only quotes a
    driver line); with `glue`, a second message glued on after its own timestamp prefix too. A
    body that opens with blanks is not the start of a message: it is `dmesg`'s indent of a
    record's second line, text of the record above it."""
    if _MARKER.match(body) is None:
        return []
    if not glue:
        return [body.rstrip()]
    cuts = [(m.start(), m.end()) for m in _GLUE.finditer(body, 1)]
    if not cuts:  # the usual case: one message on the line
        return [body.rstrip()]
    out, at = [], 0
    for start, text_at in cuts:
        out.append(body[at:start].rstrip())
        at = text_at
    out.append(body[at:].rstrip())
    return out


# The driver prints the code, the pid and the instance ids with %d / %u (kernel_rc.c): a number past
# 32 bits is no print of the driver's, and past 64 bits it would not even encode for Kafka.
_INT_MAX = 2**32 - 1


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() and len(text) <= 10 and int(text) <= _INT_MAX else None


def _parse_segment(seg: str, raw: str, meta: dict) -> KernelRecord | None:
    if seg.startswith("NVRM: Xid"):
        m = _XID.match(seg)
        if not m or _int(m["xid"]) is None:
            return None
        pid = name = None
        message = m["rest"] or ""
        pm = _PID_NAME.match(message)
        if pm:
            pid = _int(pm["pid"])
            name = pm["name"]
            if name == "<unknown>":
                name = None
            message = pm["msg"] or ""
        return KernelRecord(
            kind="xid", raw=raw, message=message, xid=int(m["xid"]), pci=_norm(m["pci"]), pid=pid,
            process_name=name or None,
            gpu_instance=_int(m["gi"]), compute_instance=_int(m["ci"]), **meta,
        )
    if seg.startswith("nvidia-nvswitch"):
        m = _SXID.match(seg)
        if not m or _int(m["code"]) is None:
            return None
        # The NVSwitch's own PCI id goes in `nvswitch_pcis`, not in `pci`: it names no GPU, and
        # the collector would otherwise try to resolve it to one (and key the record by it).
        switch = _norm(m["pci"])
        return KernelRecord(kind="sxid", raw=raw, message=m["msg"], xid=int(m["code"]), device=m["dev"],
                            nvswitch_pcis=(switch,) if switch else (), **meta)
    m = _IDENTITY.match(seg)
    if m:
        return KernelRecord(kind="gpu_identity", raw=raw, message=seg[6:], pci=_norm(m["pci"]),
                            gpu_uuid=m["uuid"], **meta)
    m = _RATE_LIMIT.match(seg)
    if m:
        return KernelRecord(kind="gsp_rate_limit", raw=raw, message=seg[6:], pci=_norm(m["pci"]), **meta)
    m = _FALLEN.match(seg)
    if m:
        return KernelRecord(kind="fallen_off_bus", raw=raw, message=seg[6:], pci=_norm(m["pci"] or m["pci2"]), **meta)
    if _PROBE_MORE.match(seg):
        # The probe-time message's second or third line: a piece of the record above (`Parsed.more`).
        return KernelRecord(kind=_MORE, raw=raw, message=seg[6:], **meta)
    m = _RECOVERY.match(seg)
    if m:
        return KernelRecord(kind="recovery_failure", raw=raw, message=seg[6:],
                            pci=_norm(m["pci"]) if m["pci"] else None,
                            gpu_ref=int(m["ref"]) if m["ref"] else None, **meta)
    return None


# Why a line that mentions the driver gave no record (parse_line_checked's `refused`).
REFUSALS = {
    "quoted": "a driver marker inside another message (e.g. a traps:/segfault report quoting a file name), "
              "or on a line indented as the continuation of another message (dmesg)",
    "facility": "a /dev/kmsg record or <N> prefix with a facility other than 0 (kernel): a userspace write; "
                "or a kmsg line without its record header (its writer cannot be checked)",
    "transport": "a journal record whose _TRANSPORT is not kernel, or a journal line that is not a JSON record",
    "error": "the parser raised (a bug): the line is skipped and counted",
    # Forensic mode only (`xidstream parse`): the driver's line as text prints it, where no live
    # source reads it. Text says nothing about its writer: the syslog(2) interface (kern.log,
    # dmesg -S) gives the second line of a tenant's crash report its own prefix, byte for byte a
    # driver line (tests/data/kernel-newline-forgery.tsv). Live collection reads /dev/kmsg records
    # (facility 0) and journal records (_TRANSPORT=kernel).
    "text": "a line of text (dmesg, syslog, kern.log, a paste): its writer cannot be checked; "
            "a live source believes only /dev/kmsg records of facility 0 and journal records of transport kernel",
}

# The kind of a piece that continues the record above it and names no GPU (the probe-time
# fallen-off-the-bus message's second and third lines). Never a record: `Parsed.more`.
_MORE = "more"


@dataclass(frozen=True, slots=True)
class Parsed:
    records: list[KernelRecord]
    refused: str | None = None  # a REFUSALS key, when a line naming the driver gave nothing
    error: str | None = None  # the exception's text, for refused == "error"
    # Pieces of the record above this line (the probe-time fallen-off-the-bus message's later
    # lines, when the print reached the reader as several lines): `continues_fallen` and
    # `merge_more` join them to it; alone (its first line lost) they name no GPU and say nothing.
    more: tuple[KernelRecord, ...] = ()
    # Forensic mode: the live source whose record the line is shaped as ("kmsg", "journal"), and
    # whose rules it was held to; None: text.
    live: str | None = None


_NOTHING = Parsed([])


# The parse_as of kmsg lines from a collector started with --accept-injected-kmsg (tests only).
INJECTED_KMSG = "kmsg-accept-injected"


def parse_line_checked(line: str, source: str | None = None, *, forensic: bool = False) -> Parsed:
    """`parse_line`, saying why a line that names the driver gave no record. `source` is the
    `LogLine.source` the line came from: "kmsg" and "journal" lines are single kernel records (no
    glued messages; kmsg's facility and the journal's transport checked); anything else (files,
    stdin, tests) is text whose writer the host trusts, so glued messages are split.

    `forensic` (``xidstream parse``: text as people paste it, never a live source): the same
    grammar, and every driver record wherever it sits in the line, each saying in `refused` why a
    live source would not believe it (None: it would). A line shaped as a live source's record (a
    /dev/kmsg record, a journal JSON record) is held to that source's rules; any other line is
    text (`source` is ignored). `Parsed.refused` is then the reason of the line's first record
    that is not believed, or why the strict rules gave none."""
    if not forensic:
        return _checked(line, source)
    try:
        return _forensic(line)
    except Exception as exc:  # noqa: BLE001 - as `_checked`: a parser bug costs the line, counted
        return Parsed([], "error", f"{type(exc).__name__}: {exc}")


# Forensic mode: a stamp just before a driver marker found inside other text ("kernel: [16450076.435595] ",
# talosctl's "[2026-04-22T21:25:20.505406921Z]: "), for the record's time.
_STAMP_BEFORE = re.compile(r"\[\s*(?:(?P<mono>\d+\.\d+)|(?P<iso>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)))\]:?\s?$")


def _forensic(line: str) -> Parsed:
    body, meta = split_prefix(line)
    if "seq" in meta:
        live = "kmsg"
    elif "transport" in meta:
        live = "journal"
    else:
        live = None
    meta.pop("facility", None)
    meta.pop("transport", None)
    strict = _checked(line, live)
    if strict.records or strict.more:
        if live is not None:
            return replace(strict, live=live)
        recs = [replace(r, refused="text") for r in strict.records]
        more = tuple(replace(r, refused="text") for r in strict.more)
        return Parsed(recs, "text" if recs else None, more=more)
    if strict.refused is None and _MARKER.match(body) is not None:
        return replace(strict, live=live)  # the driver's line, of a message this parser does not know
    # Refused by the strict rules, or a marker inside other text: every driver message in the body.
    starts = [m.start() for m in _MARKER.finditer(body)]
    if not starts and strict.refused is None:
        return replace(strict, live=live)  # no driver message anywhere in it: nothing refused
    why = strict.refused or "quoted"
    raw = line.rstrip("\r\n")
    recs: list[KernelRecord] = []
    more: list[KernelRecord] = []
    for i, at in enumerate(starts):
        seg = body[at:starts[i + 1] if i + 1 < len(starts) else len(body)].rstrip()
        here = dict(meta)
        stamp = _STAMP_BEFORE.search(body, 0, at)
        if stamp and not here.get("ts_kind"):
            if stamp["mono"]:
                here.update(kernel_ts=stamp["mono"], mono_us=_us(stamp["mono"]), ts_kind="mono")
            else:
                try:
                    wall = datetime.fromisoformat(stamp["iso"])
                    here.update(kernel_ts=stamp["iso"], wall_ts=wall.astimezone(timezone.utc), ts_kind="iso")
                except ValueError:
                    pass
        rec = _parse_segment(seg, raw, here)
        if rec is None:
            continue
        (more if rec.kind == _MORE else recs).append(replace(rec, refused=why))
    return Parsed(recs, why, more=tuple(more), live=live)


# The parse_as of a scenario's kernel lines (collectors.scenario): its author's text.
SCENARIO_TEXT = "scenario"


def parse_scenario_line(line: str) -> Parsed:
    """A scenario's kernel line, as its author wrote it: every record the forensic mode finds is
    taken (the author's text is no tenant's), except in a line shaped as a live source's record (a
    /dev/kmsg record with its header, a journal JSON record), which is held to that source's
    rules, so a scenario of a tenant's injected line tests the strict path."""
    parsed = parse_line_checked(line, forensic=True)
    if parsed.live is not None:
        return replace(parsed, records=[r for r in parsed.records if r.refused is None],
                       more=tuple(r for r in parsed.more if r.refused is None))
    return Parsed([replace(r, refused=None) for r in parsed.records], parsed.refused if parsed.refused == "error" else None,
                  parsed.error, tuple(replace(r, refused=None) for r in parsed.more))


def _checked(line: str, source: str | None) -> Parsed:
    # Fast path: most kernel lines are not the driver's. A journal record may carry its message as
    # a byte array, so JSON lines always take the slow path.
    if "NVRM" not in line and "SXid" not in line and not line.startswith("{"):
        return _NOTHING
    try:
        body, meta = split_prefix(line)
        facility = meta.pop("facility", None)
        transport = meta.pop("transport", False)
        # The readers keep each record's header (kmsg "prio,seq,us,-;", the journal's JSON): a
        # line from them without one cannot have its writer checked, so it does not count.
        if source == "kmsg" and (facility is None or "seq" not in meta):
            # A "<N>" prefix is dmesg -r's or syslog(2)'s text, never the kmsg reader's record: its
            # second line of a tenant's crash report carries facility 0 too (kernel-newline-forgery.tsv).
            facility = -1
        if source == INJECTED_KMSG:
            # `collect --accept-injected-kmsg`, for end-to-end tests only: a root harness writes the
            # incident's lines to the real /dev/kmsg, which stamps them facility 1 (user).
            source, facility = "kmsg", (-1 if facility is None else 0 if facility in (0, 1) else facility)
        if source == "journal" and transport is False:
            transport = None
        if facility is not None and facility != 0:
            return Parsed([], "facility") if _MARKER.search(body) else _NOTHING
        if transport is not False and transport != "kernel":
            # A journal record (a JSON line) counts only when journald says the kernel wrote it.
            return Parsed([], "transport") if _MARKER.search(body) else _NOTHING
        raw = line.rstrip("\r\n")
        segs = _segments(body, glue=source not in ("kmsg", "journal"))
        if not segs:
            return Parsed([], "quoted") if _MARKER.search(body) else _NOTHING
        out = []
        for i, seg in enumerate(segs):
            rec = _parse_segment(seg, raw, meta)
            if rec is None:
                if i + 1 < len(segs):
                    # What follows an unparsed piece is not known to be a glued record: it may be
                    # text the piece quotes (a task name "NVRM: Xid (PCI:" opens a segfault report
                    # whose file name is "[ 1.1] NVRM: Xid ..."). A genuine glue follows a record.
                    return Parsed(out, "quoted")
                break
            out.append(rec)
        more = tuple(r for r in out if r.kind == _MORE)
        if more:
            out = [r for r in out if r.kind != _MORE]
        if not out and not more and _MARKER.search(body, 1):
            # An unknown message that opens with a marker and carries another: text it quotes.
            return Parsed(out, "quoted")
        return Parsed(out, more=more)
    except Exception as exc:  # noqa: BLE001 - a parser bug must not cost the collector, but it is counted
        return Parsed([], "error", f"{type(exc).__name__}: {exc}")


def parse_line(line: str, source: str | None = None) -> list[KernelRecord]:
    """Every Xid or related record in one kernel log line (usually zero or one). Never raises;
    `parse_line_checked` says why a line naming the driver gave nothing."""
    return parse_line_checked(line, source).records


def extract_pci(line: str) -> str | None:
    """The one GPU PCI id an NVRM line names (Xid, identity, "GPU 0000:91:00.0: ..." lines)."""
    body, _ = split_prefix(line)
    for seg in _segments(body):
        if not seg.startswith("NVRM: "):
            continue
        rec = _parse_segment(seg, line, {})
        if rec is not None and rec.pci:
            return rec.pci
        m = _ANY_PCI.search(seg)
        if m:
            return _norm(m.group(0))
    return None


# One NVSwitch SXid event prints several lines with the same code, often from several switch
# devices within microseconds (gpud components/accelerator/nvidia/sxid/README.md): count events,
# not lines (shared/data/README.md).
SXID_EVENT_SPAN_US = 1_000_000


def sxid_continues(prev_code: int | None, prev_mono_us: int | None, rec: KernelRecord) -> bool:
    """True when `rec` is another line of the SXid event whose code and time are given."""
    if rec.kind != "sxid" or prev_code is None or rec.xid != prev_code:
        return False
    if prev_mono_us is None or rec.mono_us is None:
        return True
    return abs(rec.mono_us - prev_mono_us) <= SXID_EVENT_SPAN_US


def continues_fallen(prev: KernelRecord | None, piece: KernelRecord) -> bool:
    """True when `piece` (from `Parsed.more`) is another line of `prev`'s print: the probe-time
    fallen-off-the-bus message, whose later lines come right after its first, within the span of
    one SXid event's lines (a print reaches the log at once)."""
    if prev is None or prev.kind != "fallen_off_bus" or not prev.message.startswith("The NVIDIA GPU "):
        return False
    if prev.message.rstrip().endswith(("commands.", "bus")):
        return False  # the print is complete
    if prev.mono_us is None or piece.mono_us is None:
        return True
    return abs(piece.mono_us - prev.mono_us) <= SXID_EVENT_SPAN_US


def merge_more(first: KernelRecord, more: KernelRecord) -> KernelRecord:
    """The record `first` with the later line `more` of its print: raw joined by a newline, the
    message by a blank (the driver's one sentence)."""
    return replace(first, raw=f"{first.raw}\n{more.raw}", message=f"{first.message} {more.message}")


def merge_sxid(first: KernelRecord, more: KernelRecord) -> KernelRecord:
    """One event of `first` and its continuation `more`: the first line's fields, raw and message
    joined, and every NVSwitch that printed a line of it, once each."""
    from dataclasses import replace

    switches = first.nvswitch_pcis + tuple(p for p in more.nvswitch_pcis if p not in first.nvswitch_pcis)
    return replace(first, raw=f"{first.raw}\n{more.raw}", message=f"{first.message} | {more.message}",
                   nvswitch_pcis=switches)
