"""A newline in a tenant's file name (threat T1) read from kernel-log text.

tests/data/kernel-newline-forgery.tsv holds two real crash reports as each kernel-log interface
gives them: an unprivileged process crashing inside a file named ``x<newline>NVRM: Xid
(PCI:0000:ee:00): 79, ...``. The kernel copies the name raw, so one record holds the newline.
/dev/kmsg escapes it (one record, the driver text quoted: refused, as test_kernel_forgery.py
checks for every quoting report). The syslog(2) interface that rsyslog's imklog reads (so
kern.log) and ``dmesg -S`` prints splits the record and gives the second line the same
``<prio>[ts]`` prefix as any kernel line: a driver line, to anyone who reads text. ``dmesg``
indents it instead, as the continuation of the record above it.

So an indented continuation is never a record of its own, and a driver line read from a text file
or stdin is believed by nothing that acts: live collection refuses those modes unless told
(``--accept-forgeable-kernel-log``), and the processor never takes an Xid that only text names for
the driver's own.
"""

from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
import pytest

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakePynvml
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.parse import parse_line, parse_line_checked
from xidstream.collectors.sink import MemorySink
from xidstream.collectors.sources.kernel import FileSource, StdinSource
from xidstream.schemas import XidEvent
from xidstream.schemas.codec import decode_any
from xidstream.streams.engine import Engine
from xidstream.cli import main

DATA = Path(__file__).resolve().parents[1] / "data"
T = datetime(2026, 12, 6, 6, 19, 44, tzinfo=timezone.utc)  # when the capture was made


def _capture() -> dict[str, list[str]]:
    """interface -> its lines, in order."""
    out: dict[str, list[str]] = {}
    with (DATA / "kernel-newline-forgery.tsv").open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip() and not line.startswith("#"):
                interface, text = line.rstrip("\n").split("\t", 1)
                out.setdefault(interface, []).append(text)
    return out


CAPTURE = _capture()
TEXT_FORMS = ["syslog(2)", "kern.log", "kern.log rfc3339"]  # the split record, each line prefixed
DMESG_FORMS = ["dmesg", "dmesg -r", "dmesg -T"]  # the continuation indented


def test_the_capture_is_one_record_that_text_interfaces_split_in_two():
    assert len(CAPTURE["kmsg"]) == 2
    assert all(r.startswith("6,") and "\\x0aNVRM: Xid (PCI:0000:ee:00): 79, " in r for r in CAPTURE["kmsg"])
    for form in TEXT_FORMS + DMESG_FORMS:
        lines = CAPTURE[form]
        assert len(lines) == 4, form
        assert [ln.rstrip().endswith((" in x", " in y")) for ln in lines] == [True, False, True, False], form
    for form in TEXT_FORMS:  # the second line of each report has a prefix of its own
        assert all("] NVRM: Xid (PCI:0000:ee:00): 79, pid=1" in ln for ln in CAPTURE[form][1::2]), form
    for form in DMESG_FORMS:  # dmesg indents it to its prefix's width instead
        first, cont = CAPTURE[form][:2]
        indent = len(cont) - len(cont.lstrip(" "))
        assert indent >= 15 and first[indent - 1] == " " and first[indent - 2] == "]", form


def test_the_kmsg_record_quotes_the_driver_and_is_refused():
    for record in CAPTURE["kmsg"]:
        parsed = parse_line_checked(record, "kmsg")
        assert (parsed.records, parsed.refused) == ([], "quoted")


def test_the_journal_keeps_the_record_one_message_and_it_is_refused():
    """journald reads /dev/kmsg and unescapes the record: one MESSAGE holding the newline (built
    here from the capture's kmsg records; no journald where it was made)."""
    for record in CAPTURE["kmsg"]:
        body = record.split(";", 1)[1].replace("\\x0a", "\n")
        assert "\nNVRM: Xid (PCI:0000:ee:00): 79" in body
        line = orjson.dumps({"MESSAGE": body, "_TRANSPORT": "kernel", "SYSLOG_FACILITY": "0",
                             "__REALTIME_TIMESTAMP": "1796537984528772", "__CURSOR": "s=1"}).decode()
        parsed = parse_line_checked(line, "journal")
        assert (parsed.records, parsed.refused) == ([], "quoted")


@pytest.mark.parametrize("form", DMESG_FORMS)
@pytest.mark.parametrize("source", ["file", None])
def test_a_continuation_line_indented_by_dmesg_is_not_stripped_into_a_record(form, source):
    """`dmesg` prints a record's second line indented to the width of its prefix: it belongs to
    the record above (here a segfault report), it is no message of its own. Stripping the indent
    made it a fresh driver record: a live Xid 79."""
    lines = CAPTURE[form]
    for cont in lines[1::2]:
        parsed = parse_line_checked(cont, source)
        assert (parsed.records, parsed.refused) == ([], "quoted"), cont
    assert [r for ln in lines for r in parse_line(ln, source)] == []


def _collect(form: str, mode: str, tmp_path: Path, nvml: bool) -> list:
    """The capture's `form` lines read live by the collector in file or stdin mode."""
    text = "".join(ln + "\n" for ln in CAPTURE[form])
    log = tmp_path / "kern.log"
    log.write_text("")
    kernel = FileSource(log, cursor_file=tmp_path / "cursor") if mode == "file" else StdinSource(io.StringIO(text))
    sink = MemorySink()
    reader = NvmlReader(FakePynvml([FakeGpu(0, "GPU-eeeeeeee-0000-0000-0000-000000000001", "00000000:EE:00.0")])) \
        if nvml else None
    c = Collector(CollectorConfig(node="gpu-node-1", kmsg_wall_clock=False, xid_merge_window=0), sink,
                  nvml=reader, kernel=kernel, nvml_events_thread=False, clock=lambda: 0.0)
    c.start(T)
    c.tick(T)
    if mode == "file":
        with log.open("a") as fh:  # written after the collector started: live lines, not history
            fh.write(text)
    for i in range(1, 40):
        c.tick(T + timedelta(seconds=i))
        if sum(isinstance(r, XidEvent) for r in sink.records) >= 2:
            break
    c.stop()
    return list(sink.records)


@pytest.mark.parametrize("nvml", [True, False], ids=["nvml", "no-nvml"])
@pytest.mark.parametrize("mode", ["file", "stdin"])
@pytest.mark.parametrize("form", TEXT_FORMS)
def test_the_split_record_read_as_text_gets_no_node_level_action(form, mode, nvml, tmp_path):
    """The second line of the split record is, as text, exactly the driver's Xid 79 print: the
    parser cannot refuse it. Read from a file or stdin it reached the processor as a live Xid 79,
    and the chain ended in CORDON_NODE, DRAIN_NODE, REBOOT_NODE for a process that crashed."""
    records = _collect(form, mode, tmp_path, nvml)
    xids = [r for r in records if isinstance(r, XidEvent)]
    assert [(x.xid, x.pci_bus_id, x.backfilled) for x in xids] == [(79, "0000:ee:00", False)] * 2
    assert all([s.value for s in x.sources] == ["file"] for x in xids)  # text, and so said
    engine = Engine()
    for r in records:
        engine.process(r)
    assert [c.action.value for c in engine.commands] == []
    assert [a.classification.value for a in engine.alerts] == []


def _cli(args: list[str], stdin: str, tmp_path: Path, monkeypatch, capsys) -> tuple[int, list, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(["collect", "--sink", "stdout", "--no-nvml", "--no-kubernetes", "--node", "gpu-node-1",
                 "--state-dir", str(tmp_path / "state"), "--interval", "0.02", *args])
    out, err = capsys.readouterr()
    return code, [decode_any(orjson.dumps(orjson.loads(ln)["value"])) for ln in out.splitlines()], err


@pytest.mark.parametrize("mode", ["file", "stdin"])
def test_collect_refuses_a_text_kernel_log_without_the_flag_that_names_the_danger(mode, tmp_path, monkeypatch,
                                                                                    capsys):
    log = tmp_path / "kern.log"
    log.write_text("")
    # --once: a file is followed for good (stdin ends at its end)
    spec = ["--kernel-log", f"file:{log}", "--once"] if mode == "file" else ["--kernel-log", "-"]
    code, records, err = _cli(spec, "\n".join(CAPTURE["kern.log"]) + "\n", tmp_path,
                              monkeypatch, capsys)
    assert code == 2 and records == []
    assert "--accept-forgeable-kernel-log" in err and "forge" in err


def test_with_the_flag_text_records_are_published_as_such_and_never_acted_on(tmp_path, monkeypatch, capsys,
                                                                              caplog):
    code, records, _ = _cli(["--kernel-log", "-", "--accept-forgeable-kernel-log"],
                              "\n".join(CAPTURE["kern.log"]) + "\n", tmp_path, monkeypatch, capsys)
    assert code == 0
    xids = [r for r in records if isinstance(r, XidEvent)]
    assert [(x.xid, [s.value for s in x.sources], x.backfilled) for x in xids] == [(79, ["file"], False)] * 2
    assert "--accept-forgeable-kernel-log" in caplog.text  # the warning at start says what it gives up
    engine = Engine()
    for r in records:
        engine.process(r)
    assert engine.commands == [] and engine.alerts == []
