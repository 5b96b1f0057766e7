"""A tenant (threat T1: an unprivileged process in a pod, no capabilities, no credentials) must not
be able to forge a driver record through the kernel's own log.

tests/data/kernel-forgeries.tsv holds real /dev/kmsg records: the kernel's traps:/segfault reports
quote the file name of the faulting mapping unescaped, so a process crashing inside a file named
``NVRM: Xid (PCI:0000:ee:00): 79, ...`` makes the kernel print that text in a genuine record
(facility 0); and driver lines written to /dev/kmsg from userspace (facility 1). Every one of them
parsed as a live Xid 79 or fallen-off-the-bus before the parser anchored the marker, which got the
shared node cordoned, drained and rebooted. Each is tried in every form a collector reads: the kmsg
record, the journal record (with ``_TRANSPORT=kernel``, as journald stores the kernel's own
message), a dmesg file line and a syslog file line.
"""

from __future__ import annotations

import csv
from datetime import datetime, timezone
from pathlib import Path

import orjson
import pytest

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.metrics import CollectorMetrics
from xidstream.collectors.parse import parse_line, parse_line_checked
from xidstream.collectors.parse.kernel import split_prefix
from xidstream.collectors.sink import MemorySink
from xidstream.collectors.sources.kernel import MemoryKernelSource
from xidstream.schemas import XidEvent

DATA = Path(__file__).resolve().parents[1] / "data"
T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)


def _forgeries() -> list[tuple[str, str]]:
    with (DATA / "kernel-forgeries.tsv").open(encoding="utf-8") as fh:
        return [tuple(line.rstrip("\n").split("\t")) for line in fh if line.strip() and not line.startswith("#")]


FORGED = _forgeries()
KERNEL_MADE = [rec for rec, how in FORGED if not rec.startswith(("12,", "8,"))]
USERSPACE = [rec for rec, how in FORGED if rec.startswith(("12,", "8,"))]


def _real_rows() -> list[list[str]]:
    with (DATA / "kernel-log-lines.tsv").open(newline="") as fh:
        reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(reader)
        return list(reader)


def test_the_capture_holds_both_kinds_of_forgery():
    assert len(KERNEL_MADE) >= 6 and len(USERSPACE) >= 2
    # The captures are what the kernel really printed: quoted driver text, facility 0.
    assert all(rec.startswith("6,") and "NVRM: " in rec for rec in KERNEL_MADE)


def _forms(record: str) -> dict[str, tuple[str, str]]:
    """The same kernel message as each source would deliver it: (line, LogLine.source)."""
    body, meta = split_prefix(record)
    secs = meta["mono_us"] / 1e6
    journal = orjson.dumps({"MESSAGE": body, "_TRANSPORT": "kernel", "SYSLOG_FACILITY": "0",
                            "__REALTIME_TIMESTAMP": "1764298922500000", "__CURSOR": "s=1"}).decode()
    return {
        "kmsg": (record, "kmsg"),
        "journal": (journal, "journal"),
        "dmesg file": (f"[{secs:12.6f}] {body}", "file"),
        "syslog file": (f"Dec  2 03:40:01 gpu-node-1 kernel: [{secs:12.6f}] {body}", "file"),
        "rfc3339 syslog file": (f"2026-12-02T03:40:01.123456+00:00 gpu-node-1 kernel: {body}", "file"),
        "no source given": (f"[{secs:12.6f}] {body}", None),
    }


@pytest.mark.parametrize("record", KERNEL_MADE, ids=[f"kernel{i}" for i in range(len(KERNEL_MADE))])
@pytest.mark.parametrize("form", ["kmsg", "journal", "dmesg file", "syslog file", "rfc3339 syslog file",
                                  "no source given"])
def test_a_driver_line_quoted_by_the_kernel_is_no_record(record, form):
    line, source = _forms(record)[form]
    parsed = parse_line_checked(line, source)
    assert parsed.records == [], parsed.records
    if split_prefix(record)[0].startswith("NVRM: ") and split_prefix(record)[0].count("NVRM") == 1:
        # A task name "NVRM: GPU" opens the report: an unknown driver-like message with nothing
        # quoted in it, skipped like the driver's own chatter ("NVRM: GPU Board Serial Number").
        assert parsed.refused is None
    else:
        assert parsed.refused == "quoted"


@pytest.mark.parametrize("record", USERSPACE, ids=[f"user{i}" for i in range(len(USERSPACE))])
def test_a_userspace_write_to_dev_kmsg_is_no_record(record):
    for source in ("kmsg", None):
        parsed = parse_line_checked(record, source)
        assert (parsed.records, parsed.refused) == ([], "facility")
    # The same text with facility 0, as the driver's own printk has it, is a record: the facility
    # alone decided.
    body, _ = split_prefix(record)
    assert [r.kind for r in parse_line("4,1,2,-;" + body, "kmsg")] == ["xid"]


@pytest.mark.parametrize("prio, believed", [("<4>", True), ("<3>", True), ("<12>", False), ("<8>", False)])
def test_a_priority_prefix_is_held_to_facility_zero(prio, believed):
    line = f"{prio}[ 1126.635824] NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    assert bool(parse_line(line, "file")) is believed


@pytest.mark.parametrize("transport", ["stdout", "syslog", "journal", None])
def test_a_journal_record_not_written_by_the_kernel_is_no_record(transport):
    rec = {"MESSAGE": "NVRM: Xid (PCI:0000:02:00): 79, pid=1, name=x, GPU has fallen off the bus.",
           "__REALTIME_TIMESTAMP": "1764298922500000"}
    if transport is not None:
        rec["_TRANSPORT"] = transport
    for source in ("journal", None, "file"):
        parsed = parse_line_checked(orjson.dumps(rec).decode(), source)
        assert (parsed.records, parsed.refused) == ([], "transport")
    rec["_TRANSPORT"] = "kernel"
    assert [r.xid for r in parse_line(orjson.dumps(rec).decode(), "journal")] == [79]


@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:0000:02:00): 79, pid=1, name=x, GPU has fallen off the bus.",
    "[ 1126.635824] NVRM: Xid (PCI:0000:02:00): 79, pid=1, name=x, GPU has fallen off the bus.",
])
def test_a_reader_line_without_its_record_header_is_no_record(line):
    """The /dev/kmsg reader keeps each record's "prio,seq,us,-;" header and the journal reader its
    JSON: on 43fa317 a kmsg- or journal-source line without one skipped the facility and
    transport checks. Now it is refused; as file text the same line is still a record."""
    assert (parse_line_checked(line, "kmsg").records, parse_line_checked(line, "kmsg").refused) == ([], "facility")
    assert (parse_line_checked(line, "journal").records, parse_line_checked(line, "journal").refused) == \
        ([], "transport")
    assert [r.xid for r in parse_line(line, "file")] == [79]
    assert [r.xid for r in parse_line("0,7,1000,-;" + line.split("] ")[-1], "kmsg")] == [79]


def _body(row: list[str]) -> str:
    return split_prefix(row[0])[0]


@pytest.mark.parametrize("row", _real_rows(), ids=lambda r: r[0][:40])
def test_every_real_driver_line_still_parses_in_every_source(row):
    """The anchoring refuses no genuine line of ../shared/data: each real line's message, delivered
    as a kmsg record, a journal record or a file line, gives the expected Xid."""
    line, xid, pci = row[0], row[1], row[2]
    body = _body(row)
    forms = {
        "as captured": (line, "file"),
        "kmsg": (f"4,7,1000,-;{body}", "kmsg"),
        "journal": (orjson.dumps({"MESSAGE": body, "_TRANSPORT": "kernel"}).decode(), "journal"),
    }
    for name, (text, source) in forms.items():
        xids = [r for r in parse_line(text, source) if r.kind == "xid"]
        if xid:
            assert [(r.xid, r.pci) for r in xids] == [(int(xid), pci)], name
        else:
            assert xids == [], name


def test_glued_messages_split_only_after_a_record_and_never_in_kmsg_or_journal():
    genuine = ("[ 1.0] NVRM: Xid (PCI:0000:01:00): 13, pid=5, name=a, Graphics Exception"
               "[ 1.1] NVRM: Xid (PCI:0000:01:00): 31, pid=5, name=a, MMU Fault")
    assert [r.xid for r in parse_line(genuine, "file")] == [13, 31]
    # A kmsg or journal record is one message: the second "record" can only be quoted text.
    body = split_prefix(genuine)[0]
    assert [r.xid for r in parse_line("4,1,2,-;" + body, "kmsg")] == [13]
    # A task name that opens with the marker is no record, so what its report quotes is not glued.
    forged = ("[ 9.9] NVRM: Xid (PCI:[1]: segfault at 0 ip 0 sp 0 error 4 in "
              "[ 1.1] NVRM: Xid (PCI:0000:ee:00): 79, pid=1, name=x, GPU has fallen off the bus[3,7f+1000]")
    parsed = parse_line_checked(forged, "file")
    assert (parsed.records, parsed.refused) == ([], "quoted")


@pytest.mark.parametrize("line", [
    "NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.",
    "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has",
])
def test_the_drivers_fallen_off_the_bus_prints_are_records(line):
    (rec,) = parse_line(line)
    assert rec.kind == "fallen_off_bus" and rec.pci in ("0000:91:00", "0000:b3:00")


@pytest.mark.parametrize("line", [
    # The second line of the two-line print names no GPU: never a GPU-less (node-wide) record.
    "[ 1843.308150]                NVRM: fallen off the bus and is not responding to commands.",
    "NVRM: fallen off the bus and is not responding to commands.",
    # A task name "NVRM: GPU" opens the segfault report; the file name completes the old substring test.
    "NVRM: GPU[14194]: segfault at 0 ip 0 sp 0 error 4 in x GPU 0000:ee:00.0: GPU has fallen off the bus.[3,7f+1000]",
    "NVRM: GPU 0000:91:00.0: GPU has fallen off the bus. And some text a tenant appended",
])
def test_text_that_only_mentions_the_bus_is_no_record(line):
    assert parse_line(line) == []


def test_rsyslog_rfc3339_stamps_are_read():
    line = "2025-05-27T04:18:56.089671+00:00 gpu-node-1 kernel: [680111.646286] NVRM: Xid (PCI:0000:04:00): 79, GPU has fallen off the bus"
    (rec,) = parse_line(line, "file")
    assert (rec.xid, rec.ts_kind, rec.mono_us) == (79, "iso", 680_111_646_286)
    assert rec.wall_ts == datetime(2025, 5, 27, 4, 18, 56, 89671, tzinfo=timezone.utc)
    (rec,) = parse_line("2025-05-27T06:18:56+02:00 h kernel: NVRM: Xid (PCI:0000:04:00): 13, pid=1, name=a, m", "file")
    assert rec.wall_ts == datetime(2025, 5, 27, 4, 18, 56, tzinfo=timezone.utc)


def test_the_collector_publishes_no_forgery_and_counts_each_refusal():
    sink, metrics = MemorySink(), CollectorMetrics()
    kernel = MemoryKernelSource("kmsg", checked=True)  # checked as the /dev/kmsg reader's lines are
    c = Collector(CollectorConfig(node="node-a", kmsg_wall_clock=False, xid_merge_window=0), sink, kernel=kernel,
                  metrics=metrics,
                  nvml_events_thread=False, clock=lambda: 0.0)
    c.start(T0)
    kernel.feed([rec for rec, _ in FORGED])
    kernel.feed(["6,400,400000000,-;NVRM: Xid (PCI:0000:01:00): 13, pid=7, name=python3, Graphics Exception"])
    c.tick(T0)
    xids = [r for r in sink.records if isinstance(r, XidEvent)]
    assert [(x.xid, x.pci_bus_id) for x in xids] == [(13, "0000:01:00")]

    def refused(reason):
        return metrics.registry.get_sample_value("xidstream_collector_kernel_refused_total", {"reason": reason})

    assert refused("quoted") == len(KERNEL_MADE) - 1  # all but the unknown "NVRM: GPU[...]" report
    assert refused("facility") == len(USERSPACE)
