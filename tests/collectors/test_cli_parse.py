from __future__ import annotations

import csv
import gzip
from pathlib import Path

import orjson

from xidstream.schemas.models import XidEvent
from xidstream.cli import main

DATA = Path(__file__).resolve().parents[1] / "data" / "kernel-log-lines.tsv"


def test_parse_turns_every_xid_line_into_the_expected_fields_and_nothing_else(tmp_path, capsys):
    with DATA.open(newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    log = tmp_path / "dmesg.txt.gz"
    with gzip.open(log, "wt") as fh:
        fh.write("\n".join(r[0] for r in rows) + "\n")
    assert main(["parse", str(log), "--node", "n1"]) == 0
    out, err = capsys.readouterr()
    records = [orjson.loads(line) for line in out.splitlines()]
    xids = [r for r in records if r["kind"] == "xid"]
    expected = [r for r in rows if r[1]]
    assert len(xids) == len(expected)
    for rec, row in zip(xids, expected):
        assert rec["raw"] == row[0].rstrip("\r\n")
        assert (rec["xid"], rec["pci_bus_id"], rec["pid"], rec["process_name"]) == (
            int(row[1]), row[2], int(row[3]) if row[3] else None, row[4] or None)
        assert rec["node"] == "n1" and rec["schema"] == XidEvent.SCHEMA and rec["xid_name"]
    # Xid 119 on 0000:9b:00 follows the driver's identity line: resolved to its UUID.
    x119 = [r for r in xids if r["xid"] == 119 and r["pci_bus_id"] == "0000:9b:00"]
    assert x119[0]["gpu_uuid"] == "GPU-509665ad-b600-ac93-3616-d754b23d636d" and x119[0]["resolved"]
    (sxid,) = [r for r in records if r["kind"] == "sxid"]  # three lines, one event
    # printed by three NVSwitches: each named, none taken for a GPU
    assert (sxid["nvswitch_pci_bus_ids"], sxid["pci_bus_id"]) == (["0000:06:00", "0000:07:00", "0000:05:00"], None)
    assert "records (" in err


def test_parse_missing_file_is_a_clear_error(capsys):
    assert main(["parse", "/nonexistent/kern.log"]) == 2
    assert "cannot read /nonexistent/kern.log" in capsys.readouterr().err


def test_collect_backfill_flag_publishes_history_marked_backfilled(tmp_path, capsys):
    import gzip as _gzip
    import os

    log = tmp_path / "kern.log"
    with _gzip.open(tmp_path / "kern.log.1.gz", "wt") as fh:
        fh.write("Aug 14 02:11:09 node kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=a, GPU has fallen off the bus.\n")
    os.utime(tmp_path / "kern.log.1.gz", (1_755_500_000, 1_755_500_000))  # 2025-08-18
    log.write_text("")
    args = ["collect", "--sink", "stdout", "--once", "--no-nvml", "--no-kubernetes", "--node", "n1",
            "--kernel-log", f"file:{log}", "--accept-forgeable-kernel-log", "--state-dir", str(tmp_path / "state")]
    assert main(args) == 0
    assert '"xid":79' not in capsys.readouterr().out  # default: the current boot only
    assert main(args[:-2] + ["--state-dir", str(tmp_path / "state2"), "--backfill"]) == 0
    (rec,) = [orjson.loads(ln)["value"] for ln in capsys.readouterr().out.splitlines() if '"xid":79' in ln]
    assert rec["backfilled"] is True and rec["ts"].startswith("2025-08-14") and rec["ts_source"] == "line"
    assert main(args[:-2] + ["--state-dir", str(tmp_path / "s3"), "--backfill", "nonsense"]) == 2


def test_parse_stamps_syslog_lines_with_their_own_time(tmp_path, capsys):
    """Defect 9 for saved logs: the year of a syslog stamp comes from the file's mtime."""
    import os

    log = tmp_path / "kern.log.1"
    log.write_text("Dec 31 23:59:58 node kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=a, GPU has fallen off the bus.\n")
    os.utime(log, (1_798_761_605, 1_798_761_605))  # 2027-01-01T00:00:05Z
    os.environ["TZ"] = "UTC"
    try:
        import time as _t

        _t.tzset()
        assert main(["parse", str(log), "--node", "n1"]) == 0
    finally:
        os.environ.pop("TZ")
        _t.tzset()
    (rec,) = [orjson.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert (rec["ts"], rec["ts_source"]) == ("2026-12-31T23:59:58.000000Z", "line")
