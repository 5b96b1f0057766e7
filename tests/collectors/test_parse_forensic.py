"""`xidstream parse` reads text as people paste it (the parser's forensic mode), and believes only
what a live source would; the driver's probe-time fallen-off-the-bus message is one record."""

from __future__ import annotations

import csv
from pathlib import Path

import orjson
import pytest

from xidstream.collectors.parse.kernel import REFUSALS, parse_line, parse_line_checked, split_prefix
from xidstream.cli import main

DATA = Path(__file__).resolve().parents[1] / "data"


def rows(name: str) -> list[list[str]]:
    with (DATA / name).open(newline="") as fh:
        return [r for r in csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE) if r and not r[0].startswith("#")]


WRAPPERS = rows("kernel-wrapper-shapes.tsv")
FORGERIES = [r[0] for r in rows("kernel-forgeries.tsv")] + [r[1] for r in rows("kernel-newline-forgery.tsv")]


def parse(tmp_path, capsys, lines: list[str], *flags: str) -> tuple[list[dict], str]:
    log = tmp_path / "paste.txt"
    log.write_text("\n".join(lines) + "\n")
    assert main(["parse", str(log), "--node", "n1", *flags]) == 0
    out, err = capsys.readouterr()
    return [orjson.loads(line) for line in out.splitlines()], err


def test_the_fixture_holds_every_wrapper_shape_people_paste():
    assert [r[0] for r in WRAPPERS] == [
        "syslog tag only", "syslog tag and dmesg stamp", "journalctl in a non-English locale", "talosctl dmesg",
        "quoted in an issue", "health tool", "ticket field"]


@pytest.mark.parametrize("shape, line, kind, xid, pci, refused", WRAPPERS, ids=[r[0] for r in WRAPPERS])
def test_every_wrapper_shape_parses_in_the_default_mode_and_says_why_it_is_not_believed(
        tmp_path, capsys, shape, line, kind, xid, pci, refused):
    (rec,), err = parse(tmp_path, capsys, [line])
    assert (rec["kind"], rec["xid"], rec["pci_bus_id"], rec["raw"]) == (kind, int(xid), pci, line)
    assert (rec["believed"], rec["refused"], rec["refused_why"]) == (False, refused, REFUSALS[refused])
    assert f"1 lines refused by a live source's rules (1 {refused})" in err
    # --strict prints only what a live source would believe: none of these
    records, err = parse(tmp_path, capsys, [line], "--strict")
    assert records == [] and f"(1 {refused})" in err


def test_a_stamp_before_the_marker_gives_the_record_its_time(tmp_path, capsys):
    by_shape = {r[0]: r[1] for r in WRAPPERS}
    (rec,), _ = parse(tmp_path, capsys, [by_shape["talosctl dmesg"]])
    assert (rec["ts"], rec["ts_source"]) == ("2026-04-22T21:25:20.505406Z", "line")
    (rec,) = parse_line_checked(by_shape["syslog tag and dmesg stamp"], forensic=True).records
    assert (rec.mono_us, rec.kernel_ts) == (16450076435595, "16450076.435595")


def test_a_live_sources_record_is_believed_and_text_is_not(tmp_path, capsys):
    body = "NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python3, Graphics Exception"
    journal = orjson.dumps({"MESSAGE": body, "_TRANSPORT": "kernel", "__REALTIME_TIMESTAMP": "1764000000000000"}).decode()
    user_journal = orjson.dumps({"MESSAGE": body, "_TRANSPORT": "stdout"}).decode()
    records, err = parse(tmp_path, capsys, [f"6,1,2,-;{body}", journal, f"[ 1.5] {body}", f"12,3,4,-;{body}", user_journal])
    assert [(r["believed"], r.get("refused")) for r in records] == [
        (True, None), (True, None), (False, "text"), (False, "facility"), (False, "transport")]
    assert "3 lines refused by a live source's rules (1 facility, 1 text, 1 transport); -v names each" in err
    records, err = parse(tmp_path, capsys, [f"6,1,2,-;{body}", journal, f"[ 1.5] {body}"], "--strict", "-v")
    assert [r["believed"] for r in records] == [True, True]
    assert f":3: refused (text: {REFUSALS['text']}): '[ 1.5] {body}'" in err


@pytest.mark.parametrize("line", FORGERIES)
def test_no_tenant_injection_line_is_believed_by_any_live_source(line):
    for source in ("kmsg", "journal"):
        assert parse_line(line, source) == []


@pytest.mark.parametrize("line", FORGERIES)
def test_no_tenant_injection_line_is_believed_under_strict(tmp_path, capsys, line):
    parsed = parse_line_checked(line, forensic=True)
    assert all(r.refused is not None for r in parsed.records)
    records, _ = parse(tmp_path, capsys, [line], "--strict")
    assert records == []


def test_the_forensic_mode_changes_nothing_for_a_live_source():
    """The collector calls without `forensic`: a wrapper shape is refused as before."""
    for _, line, *_ in WRAPPERS:
        assert parse_line_checked(line, "file").records == []
        assert parse_line_checked(line, "file").refused == "quoted"


# -- the probe-time lost-GPU message ------------------------------------------------------------

PROBE = ["[   15.880436] NVRM: The NVIDIA GPU 0000:2a:00.0",
         "[   15.880436] NVRM: (PCI ID: 10de:2330) installed in this system has",
         "[   15.880436] NVRM: fallen off the bus and is not responding to commands."]


def test_the_probe_time_message_is_one_record_on_its_gpu(tmp_path, capsys):
    (rec,), err = parse(tmp_path, capsys, PROBE)
    assert (rec["kind"], rec["pci_bus_id"], rec["raw"]) == ("fallen_off_bus", "0000:2a:00", "\n".join(PROBE))
    assert rec["message"] == ("The NVIDIA GPU 0000:2a:00.0 (PCI ID: 10de:2330) installed in this system has "
                              "fallen off the bus and is not responding to commands.")
    assert "1 records (1 fallen_off_bus)" in err


def test_the_probe_time_messages_first_line_alone_is_a_record(tmp_path, capsys):
    (rec,) = parse_line(PROBE[0])
    assert (rec.kind, rec.pci) == ("fallen_off_bus", "0000:2a:00")
    (rec,), _ = parse(tmp_path, capsys, PROBE[:1])
    assert (rec["kind"], rec["pci_bus_id"]) == ("fallen_off_bus", "0000:2a:00")
    # its later lines alone name no GPU: nothing
    records, _ = parse(tmp_path, capsys, PROBE[1:])
    assert records == []


def test_the_probe_time_message_as_one_kmsg_or_journal_record_is_one_record():
    """/dev/kmsg escapes the print's newlines (\\x0a) and keeps it one record; journald unescapes them."""
    body = "\\x0a".join(split_prefix(p)[0] for p in PROBE)
    (rec,) = parse_line(f"3,512,15880436,-;{body}", "kmsg")
    assert (rec.kind, rec.pci) == ("fallen_off_bus", "0000:2a:00")
    journal = orjson.dumps({"MESSAGE": "\n".join(split_prefix(p)[0] for p in PROBE), "_TRANSPORT": "kernel"}).decode()
    (rec,) = parse_line(journal, "journal")
    assert (rec.kind, rec.pci) == ("fallen_off_bus", "0000:2a:00")


def test_the_collector_publishes_the_probe_time_message_once():
    from xidstream.collectors.scenario import ScenarioRunner
    from xidstream.collectors.sink import MemorySink
    from xidstream.schemas import XidEvent, load_scenario

    sc = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "probe-fallen-off-bus.yaml")
    sink = MemorySink()
    ScenarioRunner(sc, sink).run()
    fallen = [r for r in sink.records if isinstance(r, XidEvent) and r.kind == "fallen_off_bus"]
    assert [(r.pci_bus_id, r.gpu_uuid) for r in fallen] == [("0000:2a:00", "GPU-7a1d3c5e-2b4f-4d6a-8c9e-0f1a2b3c4d5e")]
    assert fallen[0].raw.count("\n") == 2 and "not responding to commands." in fallen[0].message


def test_the_plain_fallen_off_the_bus_line_after_an_xid_79_stays_its_own_record(tmp_path, capsys):
    records, _ = parse(tmp_path, capsys, [
        "[6781741.548779] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "[6781741.548783] NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.",
        PROBE[1], PROBE[2]])  # pieces of no print of its: not joined to it
    assert [(r["kind"], r["xid"], r["raw"].count("\n")) for r in records] == [("xid", 79, 0), ("fallen_off_bus", None, 0)]


# -- scenarios: their author's text --------------------------------------------------------------


@pytest.mark.parametrize("shape, line, kind, xid, pci, refused", WRAPPERS, ids=[r[0] for r in WRAPPERS])
def test_a_scenarios_line_is_read_as_xidstream_parse_reads_it(shape, line, kind, xid, pci, refused):
    from xidstream.collectors.parse.kernel import parse_scenario_line

    (rec,) = parse_scenario_line(line).records
    assert (rec.kind, rec.xid, rec.pci, rec.refused) == (kind, int(xid), pci, None)


@pytest.mark.parametrize("line", [r[0] for r in rows("kernel-forgeries.tsv")]
                         + [r[1] for r in rows("kernel-newline-forgery.tsv") if r[0] == "kmsg"])
def test_a_scenarios_line_shaped_as_a_kmsg_record_is_held_to_the_live_rules(line):
    from xidstream.collectors.parse.kernel import parse_scenario_line

    assert parse_scenario_line(line).records == []


def test_a_fleet_storm_written_in_the_kernel_tag_shape_raises_its_alerts():
    from xidstream.collectors.scenario import ScenarioRunner
    from xidstream.collectors.sink import MemorySink
    from xidstream.schemas import XidEvent, load_scenario

    sc = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "fleet-storm-kernel-tag.yaml")
    assert all(line.startswith("kernel: [") for e in sc.timeline for line in e.kernel or [])
    sink = MemorySink()
    ScenarioRunner(sc, sink).run()
    xids = [r for r in sink.records if isinstance(r, XidEvent) and r.kind == "xid"]
    assert len(xids) == 6 and all(r.xid == 119 and r.resolved for r in xids)


@pytest.mark.parametrize("line", ["hello world", "Dec  6 17:49:03 host sshd[1]: Accepted publickey for root",
                                  "[ 12.345678] e1000e: eth0 NIC Link is Up", ""])
def test_a_line_that_names_no_driver_message_is_not_counted_as_refused(line):
    """`xidstream parse` counts the lines a live source would refuse; a line with no driver message
    in it was counted as refused ("quoted"), so a paste of a whole log read as mostly forged."""
    parsed = parse_line_checked(line, forensic=True)
    assert parsed.records == [] and parsed.refused is None


def test_a_number_no_driver_prints_gives_no_record_and_never_an_unencodable_one():
    """The driver prints the code and the pid with %d: a code past 32 bits is no driver line, and one
    past 64 bits made a record that failed to encode for Kafka outside the collector's error
    handling (and `xidstream parse`'s output)."""
    from xidstream.collectors.parse.kernel import parse_line

    huge = "9" * 25
    assert parse_line(f"NVRM: Xid (PCI:0000:3b:00): {huge}, pid=1, name=x, y") == []
    assert parse_line(f"nvidia-nvswitch0: SXid (PCI:0000:05:00.0): {huge}, Non-fatal, Link 1") == []
    [rec] = parse_line(f"NVRM: Xid (PCI:0000:3b:00): 13, pid={huge}, name=python3, Graphics Exception")
    assert rec.xid == 13 and rec.pid is None
    assert parse_line_checked(f"> kernel: NVRM: Xid (PCI:0000:3b:00): {huge}, pid=1, name=x, y", forensic=True).records == []
