"""The kernel-log parser against real captures (tests/data/kernel-log-lines.tsv, a copy of
../shared/data/kernel-log-lines.tsv with each line's public source) and fixtures of our own."""

from __future__ import annotations

import csv
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from xidstream.collectors.parse import extract_pci, parse_line, parse_line_checked
from tests.tools import examples

DATA = Path(__file__).resolve().parents[1] / "data" / "kernel-log-lines.tsv"


def _rows():
    with DATA.open(newline="") as fh:
        reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(reader)
        return [row for row in reader]


ROWS = _rows()


def test_the_capture_has_xid_and_non_xid_lines():
    assert sum(1 for r in ROWS if r[1]) >= 25 and sum(1 for r in ROWS if not r[1]) >= 25


@pytest.mark.parametrize("row", ROWS, ids=[f"line{i}" for i in range(len(ROWS))])
def test_real_lines_give_the_expected_fields(row):
    line, xid, pci, pid, name = row[:5]
    xids = [r for r in parse_line(line) if r.kind == "xid"]
    if xid:
        assert len(xids) == 1
        rec = xids[0]
        assert (rec.xid, rec.pci, rec.pid, rec.process_name) == (
            int(xid), pci, int(pid) if pid else None, name or None)
        assert rec.raw == line.rstrip("\r\n")
    else:
        assert xids == []
    assert (extract_pci(line) or "") == pci


def test_typed_related_records_from_real_lines():
    kinds = {}
    for row in ROWS:
        for rec in parse_line(row[0]):
            kinds.setdefault(rec.kind, []).append(rec)
    ident = kinds["gpu_identity"][0]
    assert (ident.pci, ident.gpu_uuid) == ("0000:9b:00", "GPU-509665ad-b600-ac93-3616-d754b23d636d")
    assert kinds["gsp_rate_limit"][0].pci == "0000:9b:00"
    assert [r.pci for r in kinds["fallen_off_bus"]] == ["0000:91:00"]
    assert {r.xid for r in kinds["sxid"]} == {20034} and len(kinds["sxid"]) == 3


def test_real_sxid_lines_keep_their_nvswitch_pci_and_name_no_gpu():
    # gpud's capture: one event printed by three NVSwitches, each line naming its own switch. Both
    # peers (gpud's sxid, NVSentinel's syslog monitor) read the switch's PCI; it ties the SXid to
    # its switch and so to its NVLink domain.
    sxids = [r for row in ROWS for r in parse_line(row[0]) if r.kind == "sxid"]
    assert [(r.device, r.nvswitch_pcis, r.pci) for r in sxids] == [
        ("nvidia-nvswitch1", ("0000:06:00",), None),
        ("nvidia-nvswitch2", ("0000:07:00",), None),
        ("nvidia-nvswitch0", ("0000:05:00",), None),
    ]


@pytest.mark.parametrize(
    "line, expected",
    [
        # /dev/kmsg record
        ("4,1234,5678901,-;NVRM: Xid (PCI:0000:01:00): 13, pid=4242, name=python3, Graphics SM Warp Exception",
         dict(xid=13, pci="0000:01:00", pid=4242, process_name="python3", seq=1234, mono_us=5678901,
              message="Graphics SM Warp Exception")),
        # MIG, with both instance ids
        ("NVRM: Xid (PCI:0000:41:00 GPU-I:03 GPU-CI:01): 31, pid=77, name=pt_main_thread, MMU Fault",
         dict(xid=31, pci="0000:41:00", gpu_instance=3, compute_instance=1, pid=77)),
        ("NVRM: Xid (PCI:0000:41:00 GPU-I:05): 43, pid=77, name=x, Ch 0000001a",
         dict(xid=43, gpu_instance=5, compute_instance=None)),
        # very old driver: no PCI:, no pid
        ("NVRM: Xid (0000:01:00): 13, 0005 0000 00009097 00001b0c 00001000 00000000",
         dict(xid=13, pci="0000:01:00", pid=None, process_name=None, message="0005 0000 00009097 00001b0c 00001000 00000000")),
        # process names with :: and :[driver] and .exe
        ("NVRM: Xid (PCI:0000:17:00): 31, pid=1, name=ray::IDLE, msg", dict(process_name="ray::IDLE")),
        ("NVRM: Xid (PCI:0000:17:00): 31, pid=9, name=wine:[driver], m", dict(process_name="wine:[driver]")),
        ("NVRM: Xid (PCI:0000:17:00): 13, pid=9, name=app.exe, m", dict(process_name="app.exe")),
        # 8-digit domain, non-zero device, syslog with embedded dmesg time
        ("Dec  6 17:49:03 host kernel: [  12.5] NVRM: Xid (PCI:00000002:10:1c): 48, pid=1, name=a, DBE",
         dict(xid=48, pci="0002:10:1c", kernel_ts="Dec  6 17:49:03", mono_us=12_500_000)),
        # no message at all
        ("NVRM: Xid (PCI:0000:01:00): 79", dict(xid=79, message="")),
    ],
)
def test_own_fixtures(line, expected):
    (rec,) = [r for r in parse_line(line) if r.kind == "xid"]
    for key, value in expected.items():
        assert getattr(rec, key) == value, key


def test_journal_json_record():
    rec = {"MESSAGE": "NVRM: Xid (PCI:0000:02:00): 43, pid=4242, name=python3, Ch 00000018",
           "__REALTIME_TIMESTAMP": "1764298922500000", "_SOURCE_MONOTONIC_TIMESTAMP": "99000000",
           "__CURSOR": "s=abc;i=1", "_TRANSPORT": "kernel"}
    (out,) = parse_line(orjson.dumps(rec).decode())
    assert (out.xid, out.pid, out.mono_us) == (43, 4242, 99_000_000)
    assert out.wall_ts.isoformat() == "2025-11-28T03:02:02.500000+00:00"


def test_journal_message_as_byte_array():
    msg = list("NVRM: Xid (PCI:0000:02:00): 31, pid=1, name=\xe9, m".encode("latin-1"))
    (out,) = parse_line(orjson.dumps({"MESSAGE": msg, "_TRANSPORT": "kernel"}).decode())
    assert out.xid == 31


def test_recovery_failure_names_the_gpu_by_driver_number():
    (rec,) = parse_line("[ 99.1] NVRM: GPU1 refcntRequestReference_IMPL: Failed to enter state 1")
    assert (rec.kind, rec.gpu_ref, rec.pci) == ("recovery_failure", 1, None)
    (rec,) = parse_line("NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x26:0x56:1474)")
    assert (rec.kind, rec.pci) == ("recovery_failure", "0000:3b:00")


def test_glued_lines_give_both_records_and_nothing_false():
    glued = ("[ 1.0] NVRM: Xid (PCI:0000:01:00): 13, pid=5, name=a, Graphics Exception"
             "[ 1.1] NVRM: Xid (PCI:0000:01:00): 31, pid=5, name=a, MMU Fault")
    assert [(r.xid, r.pid) for r in parse_line(glued)] == [(13, 5), (31, 5)]
    assert parse_line(glued)[0].message.startswith("Graphics Exception")


@pytest.mark.parametrize(
    "line",
    [
        'audit: type=1400 audit(1.2:3): apparmor="DENIED" operation="open" pid=7092 comm="nvidia-smi" name="/dev/nvidia0"',
        "NVRM: Xid errors are reported below",
        "NVRM: Xid (PCI:zzzz:01:00): 13, pid=1, name=a, m",
        "NVRM:     -1    103  GSP_RM_ALLOC          0x0000000000002080",
        "kernel: pid=4242 name=python3 Xid 13 happened",
        "",
        "{not json but starts with a brace NVRM",
        '{"MESSAGE": 17}',
    ],
)
def test_no_false_xid(line):
    assert [r for r in parse_line(line) if r.kind == "xid"] == []


def _no_parser_error(line: str, source: str | None = None) -> None:
    # parse_line never raises, so "never raises" proves nothing: a parser bug must show as the
    # "error" refusal (counted and logged by the collector), and none may happen on any input.
    parsed = parse_line_checked(line, source)
    assert parsed.refused != "error", parsed.error


@settings(max_examples=examples(400), deadline=None)
@given(st.text(), st.sampled_from([None, "kmsg", "journal", "file"]))
def test_parser_never_fails_on_any_text(text, source):
    _no_parser_error(text, source)
    _no_parser_error("NVRM: Xid (PCI:0000:01:00): " + text, source)
    _no_parser_error("4,1,2,-;NVRM: " + text, source)
    _no_parser_error("[ 1.0] NVRM: Xid (PCI:0000:01:00): 13, x[ 2.0] NVRM: " + text, source)
    extract_pci("NVRM: GPU " + text)


@settings(max_examples=examples(200), deadline=None)
@given(st.binary())
def test_parser_never_fails_on_decoded_garbage(data):
    _no_parser_error(data.decode("utf-8", "replace"))
    _no_parser_error('{"MESSAGE": ' + data.decode("latin-1"))
    _no_parser_error('{"_TRANSPORT": "kernel", "MESSAGE": "NVRM: ' + data.decode("latin-1") + '"}', "journal")


def test_a_parser_error_is_reported_not_swallowed(monkeypatch):
    import xidstream.collectors.parse.kernel as kernel

    def broken(seg, raw, meta):
        raise RuntimeError("boom")

    monkeypatch.setattr(kernel, "_parse_segment", broken)
    parsed = parse_line_checked("NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m")
    assert (parsed.records, parsed.refused, parsed.error) == ([], "error", "RuntimeError: boom")
    assert parse_line("NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, m") == []
