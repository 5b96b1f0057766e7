"""The kernel-log parser exactly: what each prefix says about time (every field of `split_prefix`'s
meta, and a malformed stamp that gives the text but no time), the driver's Xid line field by field,
each refusal and its reason, and the SXid grouping at its one-second edge. The real captures are in
test_parse_kernel.py and test_kernel_forgery.py; these pin the rules a capture may not reach."""

from __future__ import annotations

from datetime import datetime, timezone

import orjson
import pytest

from xidstream.collectors.parse.kernel import (
    INJECTED_KMSG, REFUSALS, SXID_EVENT_SPAN_US, KernelRecord, Parsed, extract_pci, merge_sxid, parse_line,
    parse_line_checked, split_prefix, sxid_continues,
)

BODY = "NVRM: Xid (PCI:0000:01:00): 13, pid=7, name=python3, Graphics Exception"
UTC = timezone.utc


def journal(**rec) -> str:
    return orjson.dumps(rec).decode()


# -- split_prefix: each prefix and what it says about time ---------------------------------


@pytest.mark.parametrize("line, meta", [
    # /dev/kmsg: "prio,seq,us,flags;" - the facility is prio >> 3 (4 = kern.warning, 12 = user.warning)
    (f"4,1234,5678901,-;{BODY}",
     dict(facility=0, seq=1234, mono_us=5678901, kernel_ts="5678901", ts_kind="kmsg")),
    (f"12,9,15,c;{BODY}", dict(facility=1, seq=9, mono_us=15, kernel_ts="15", ts_kind="kmsg")),
    (f"30,9,15,-;{BODY}", dict(facility=3, seq=9, mono_us=15, kernel_ts="15", ts_kind="kmsg")),
    # dmesg: seconds since boot, to the microsecond
    (f"[ 1843.308145] {BODY}", dict(kernel_ts="1843.308145", mono_us=1_843_308_145, ts_kind="mono")),
    (f"[1843.308145]{BODY}", dict(kernel_ts="1843.308145", mono_us=1_843_308_145, ts_kind="mono")),
    # a stamp that a float times 1e6 turns into ...580: the microseconds are read as digits
    (f"[4397034.486581] {BODY}", dict(kernel_ts="4397034.486581", mono_us=4_397_034_486_581, ts_kind="mono")),
    (f"[   12.5] {BODY}", dict(kernel_ts="12.5", mono_us=12_500_000, ts_kind="mono")),
    # dmesg -r: the priority's facility, then dmesg's stamp
    (f"<4>[ 1.000002] {BODY}", dict(facility=0, kernel_ts="1.000002", mono_us=1_000_002, ts_kind="mono")),
    (f"<14>{BODY}", dict(facility=1)),
    # dmesg -T: local time of day, no zone
    (f"[Wed Mar  1 17:44:21 2023] {BODY}",
     dict(kernel_ts="Wed Mar  1 17:44:21 2023", local_ts=datetime(2023, 3, 1, 17, 44, 21), ts_kind="ctime")),
    (f"[Sun Dec 31 23:59:58 2023]{BODY}",
     dict(kernel_ts="Sun Dec 31 23:59:58 2023", local_ts=datetime(2023, 12, 31, 23, 59, 58), ts_kind="ctime")),
    # syslog: month, day and time without a year, maybe dmesg's stamp after "kernel:"
    (f"Dec  6 17:49:03 host kernel: [  12.000007] {BODY}",
     dict(kernel_ts="Dec  6 17:49:03", mono_us=12_000_007, syslog_ts=(12, 6, 17, 49, 3), ts_kind="syslog")),
    (f"Jan 16 01:02:09 gpu-node-1 kernel: {BODY}",
     dict(kernel_ts="Jan 16 01:02:09", syslog_ts=(1, 16, 1, 2, 9), ts_kind="syslog")),
    # rsyslog's RFC 3339 stamp, in UTC whatever zone it was written in
    (f"2025-05-27T06:18:56.089671+02:00 h kernel: [680111.646286] {BODY}",
     dict(kernel_ts="2025-05-27T06:18:56.089671+02:00", mono_us=680_111_646_286,
          wall_ts=datetime(2025, 5, 27, 4, 18, 56, 89671, tzinfo=UTC), ts_kind="iso")),
    (f"2025-05-27T04:18:56Z h kernel: {BODY}",
     dict(kernel_ts="2025-05-27T04:18:56Z", wall_ts=datetime(2025, 5, 27, 4, 18, 56, tzinfo=UTC), ts_kind="iso")),
    # dmesg --time-format iso (with -x: facility and level first), a comma before the fraction
    (f"kern  :warn  : 2023-03-01T17:44:21,308145+00:00 {BODY}",
     dict(kernel_ts="2023-03-01T17:44:21,308145+00:00", wall_ts=datetime(2023, 3, 1, 17, 44, 21, 308145, tzinfo=UTC),
          ts_kind="iso")),
    (f"kern:err:2023-03-01T18:44:21+0100 {BODY}",
     dict(kernel_ts="2023-03-01T18:44:21+0100", wall_ts=datetime(2023, 3, 1, 17, 44, 21, tzinfo=UTC), ts_kind="iso")),
    # a monitoring system's wrapper around a syslog line
    (f"Xid errors on instance: ip-10-0-0-1.ec2, Error: May 19 07:08:57 ip-10 kernel: [ 3.25] {BODY}",
     dict(kernel_ts="May 19 07:08:57", mono_us=3_250_000, syslog_ts=(5, 19, 7, 8, 57), ts_kind="syslog")),
    # no prefix at all
    (BODY, {}),
    (f"{BODY}\r\n", {}),
])
def test_each_prefix_is_cut_and_says_what_it_knows_of_time(line, meta):
    assert split_prefix(line) == (BODY, meta)


@pytest.mark.parametrize("line, kernel_ts", [
    # the stamp has the prefix's shape but names no real time: the text is kept, no time is made up
    (f"[Wed Foo  1 17:44:21 2023] {BODY}", "Wed Foo  1 17:44:21 2023"),
    (f"[Wed Feb 30 17:44:21 2023] {BODY}", "Wed Feb 30 17:44:21 2023"),
    (f"[Wed Feb 28 25:44:21 2023] {BODY}", "Wed Feb 28 25:44:21 2023"),
    (f"Foo  6 17:49:03 host kernel: {BODY}", "Foo  6 17:49:03"),
    (f"2025-13-27T04:18:56Z h kernel: {BODY}", "2025-13-27T04:18:56Z"),
    (f"kern  :warn  : 2023-02-30T17:44:21+00:00 {BODY}", "2023-02-30T17:44:21+00:00"),
])
def test_a_stamp_that_names_no_real_time_gives_its_text_and_no_time(line, kernel_ts):
    assert split_prefix(line) == (BODY, {"kernel_ts": kernel_ts})
    (rec,) = parse_line(line)
    assert (rec.kernel_ts, rec.ts_kind, rec.wall_ts, rec.local_ts, rec.syslog_ts) == (kernel_ts, None, None, None, None)


@pytest.mark.parametrize("line", [
    "Xid errors on instance: two words, Error: " + BODY,  # not the wrapper's shape: kept whole
    "NVRM Dec  6 17:49:03 host kernel: x",  # a body that starts with NVRM is never a syslog line
    "[ 12] " + BODY,  # no fraction: no dmesg stamp
    "1234,5678901,-;" + BODY,  # a kmsg header lacks its prio
    "<x>" + BODY,
])
def test_what_is_not_a_known_prefix_stays_in_the_body(line):
    assert split_prefix(line) == (line, {})


# -- split_prefix: journal records ---------------------------------------------------------


def test_a_journal_record_gives_its_message_transport_and_both_clocks():
    line = journal(MESSAGE=BODY, _TRANSPORT="kernel", __REALTIME_TIMESTAMP="1764298922500001",
                   _SOURCE_MONOTONIC_TIMESTAMP="99000001", __MONOTONIC_TIMESTAMP="5")
    assert split_prefix(line) == (BODY, {
        "transport": "kernel", "kernel_ts": "1764298922500001", "ts_kind": "journal", "mono_us": 99_000_001,
        "wall_ts": datetime(2025, 11, 28, 3, 2, 2, 500001, tzinfo=UTC)})


def test_a_journal_record_without_the_sources_monotonic_stamp_uses_journalds():
    line = journal(MESSAGE=BODY, _TRANSPORT="kernel", __MONOTONIC_TIMESTAMP="42")
    assert split_prefix(line) == (BODY, {"transport": "kernel", "mono_us": 42})


@pytest.mark.parametrize("rec, meta", [
    (dict(MESSAGE=BODY), {"transport": None}),
    (dict(MESSAGE=BODY, _TRANSPORT=7), {"transport": None}),
    (dict(MESSAGE=BODY, _TRANSPORT="kernel", __REALTIME_TIMESTAMP="soon", _SOURCE_MONOTONIC_TIMESTAMP="5"),
     {"transport": "kernel"}),
    # a realtime stamp past datetime's range: no time, and no exception
    (dict(MESSAGE=BODY, _TRANSPORT="kernel", __REALTIME_TIMESTAMP="9" * 30), {"transport": "kernel"}),
    (dict(MESSAGE=BODY, _TRANSPORT="kernel", __REALTIME_TIMESTAMP=None), {"transport": "kernel"}),
])
def test_a_journal_record_with_a_missing_or_bad_field_still_gives_its_message(rec, meta):
    assert split_prefix(journal(**rec)) == (BODY, meta)


@pytest.mark.parametrize("message, body", [
    (list(b"NVRM: caf\xc3\xa9"), "NVRM: caf\u00e9"),  # journald's byte array: UTF-8
    (list(b"NVRM: caf\xe9"), "NVRM: caf\ufffd"),  # not UTF-8: replaced, not refused
    ([78, 300], ""),  # not bytes
    (["N", "V"], ""),
    (17, ""),
    (None, ""),
])
def test_a_journal_message_that_is_not_text(message, body):
    assert split_prefix(journal(MESSAGE=message, _TRANSPORT="kernel")) == (body, {"transport": "kernel"})


@pytest.mark.parametrize("line", ['{"_TRANSPORT": "kernel"}', "{not json", '["MESSAGE"]', '{"MESSAGE" NVRM'])
def test_a_brace_line_that_is_no_journal_record_is_plain_text(line):
    assert split_prefix(line) == (line, {})


# -- the Xid line, field by field ----------------------------------------------------------


def test_an_xid_line_gives_every_field():
    line = f"4,1234,5678901,-;{BODY}\n"
    assert parse_line(line) == [KernelRecord(
        kind="xid", raw=line.rstrip("\n"), message="Graphics Exception", xid=13, pci="0000:01:00", pid=7,
        process_name="python3", kernel_ts="5678901", ts_kind="kmsg", mono_us=5678901, seq=1234)]


@pytest.mark.parametrize("rest, pid, name, message", [
    ("pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", None, None, "GPU has fallen off the bus."),
    ("pid=<unknown>, name=x, m", None, "x", "m"),
    ("pid=42, name=, m", 42, None, "m"),  # an empty name is no name
    ("pid=42, m, n", 42, None, "m, n"),  # a pid and no name (some drivers)
    ("pid=42", 42, None, ""),
    ("pid=42, name=a, b, c", 42, "a", "b, c"),  # the name ends at the first ", "
    ("pid=4x, name=a, m", None, None, "pid=4x, name=a, m"),  # no pid: all of it is the message
    ("0005 0000 00009097", None, None, "0005 0000 00009097"),
])
def test_the_pid_name_and_message_of_an_xid(rest, pid, name, message):
    (rec,) = parse_line(f"NVRM: Xid (PCI:0000:01:00): 13, {rest}")
    assert (rec.pid, rec.process_name, rec.message) == (pid, name, message)


@pytest.mark.parametrize("pci, want", [
    ("0000:01:00", "0000:01:00"),
    ("00000002:10:1C", "0002:10:1c"),  # an 8-digit domain keeps its low 16 bits; lower case
    ("0001ABCD:0a:1f.0", "abcd:0a:1f"),  # the function is dropped
    ("ABCD:FF:1f.7", "abcd:ff:1f"),
])
def test_the_pci_id_is_normalised(pci, want):
    (rec,) = parse_line(f"NVRM: Xid (PCI:{pci}): 79, pid=1, name=a, m")
    assert rec.pci == want


def test_mig_instances_are_numbers():
    (rec,) = parse_line("NVRM: Xid (PCI:0000:41:00 GPU-I:10 GPU-CI:0): 31, pid=77, name=a, MMU Fault")
    assert (rec.gpu_instance, rec.compute_instance) == (10, 0)
    (rec,) = parse_line("NVRM: Xid (PCI:0000:41:00): 31, pid=77, name=a, MMU Fault")
    assert (rec.gpu_instance, rec.compute_instance) == (None, None)


@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:0000:01:00) 13, pid=1",  # no colon after the PCI id
    "NVRM: Xid (PCI:0000:01:00): x13",
    "NVRM: Xid: something else",
    "nvidia-nvswitch0: SXid 12",
])
def test_a_marker_line_of_the_wrong_shape_is_no_record(line):
    assert parse_line_checked(line) == Parsed([])


# -- the other driver records --------------------------------------------------------------


def test_an_identity_line_gives_the_pci_id_and_the_uuid():
    uuid = "GPU-509665ad-b600-ac93-3616-d754b23d636d"
    (rec,) = parse_line(f"[ 1.5] NVRM: GPU at PCI:0000:9B:00.0: {uuid}")
    assert (rec.kind, rec.pci, rec.gpu_uuid, rec.message) == ("gpu_identity", "0000:9b:00", uuid,
                                                              f"GPU at PCI:0000:9B:00.0: {uuid}")


@pytest.mark.parametrize("uuid", [
    "GPU-123",  # any length from one character was taken
    "GPU-509665ad-b600-ac93-3616-d754b23d636",  # one hex digit short of NVML's last group
    "GPU-509665ad-b600-ac93-3616-d754b23d636d0",  # one too many (no shorter prefix of it is taken)
    "GPU-509665adb600ac933616d754b23d636d",  # 32 hex digits without NVML's dashes
    "GPU-509665ad-b600-ac93-3616-d754b23d636d-aaaa",  # a fifth dash: no UUID NVML prints
    "GPU-509665ad-b600ac93-3616-d754b23d636d-",  # dashes in the wrong places
    "GPU-509665ag-b600-ac93-3616-d754b23d636d",  # not hex
    "GPU-" + "a" * 92,  # under the contract's cap (GPU_UUID_MAX), but no NVML UUID
])
def test_an_identity_line_needs_a_uuid_of_nvmls_shape(uuid):
    """NVML's GPU UUID is ``GPU-`` and 8-4-4-4-12 hex digits (nvmlDeviceGetUUID; the driver's
    ``GPU at PCI`` line prints the same string): anything else names no GPU, and the collector
    would key a GPU's records, and its GPU reset, by it."""
    assert [r.kind for r in parse_line(f"[ 1.5] NVRM: GPU at PCI:0000:9b:00: {uuid}")] == []


@pytest.mark.parametrize("uuid", ["GPU-509665ad-b600-ac93-3616-d754b23d636d", "GPU-509665AD-B600-AC93-3616-D754B23D636D"])
def test_an_identity_line_of_nvmls_shape_is_taken_as_printed(uuid):
    (rec,) = parse_line(f"NVRM: GPU at PCI:0000:9b:00: {uuid}")
    assert (rec.kind, rec.gpu_uuid) == ("gpu_identity", uuid)


def test_a_rate_limit_line_names_its_gpu():
    (rec,) = parse_line("NVRM: Rate limiting GSP RPC error prints for GPU at PCI:0000:9b:00")
    assert (rec.kind, rec.pci, rec.message) == ("gsp_rate_limit", "0000:9b:00",
                                                "Rate limiting GSP RPC error prints for GPU at PCI:0000:9b:00")


def test_fallen_off_the_bus_records_name_their_gpu_from_either_print():
    (rec,) = parse_line("NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.")
    assert (rec.kind, rec.pci, rec.message) == ("fallen_off_bus", "0000:91:00", "GPU 0000:91:00.0: GPU has fallen off the bus.")
    (rec,) = parse_line("NVRM: The NVIDIA GPU 0000:B3:00.0 (PCI ID: 10de:26b5) installed in this system has")
    assert (rec.kind, rec.pci) == ("fallen_off_bus", "0000:b3:00")


def test_a_recovery_failure_names_its_gpu_by_number_or_by_pci_id():
    (rec,) = parse_line("NVRM: GPU12 refcntRequestReference_IMPL: Failed to enter state 3")
    assert (rec.kind, rec.gpu_ref, rec.pci, rec.message) == (
        "recovery_failure", 12, None, "GPU12 refcntRequestReference_IMPL: Failed to enter state 3")
    (rec,) = parse_line("NVRM: refcntRequestReference_IMPL: Failed to enter state 1")
    assert (rec.gpu_ref, rec.pci) == (None, None)
    (rec,) = parse_line("NVRM: GPU 0000:3B:00.0: RmInitAdapter failed! (0x26:0x56:1474)")
    assert (rec.gpu_ref, rec.pci) == (None, "0000:3b:00")


def test_an_sxid_keeps_its_device_and_message_and_names_no_gpu():
    line = "[ 5.5] nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 20034, Fatal, Link 29 LTSSM Fault Up"
    (rec,) = parse_line(line)
    assert (rec.kind, rec.xid, rec.device, rec.pci, rec.message) == (
        "sxid", 20034, "nvidia-nvswitch3", None, "Fatal, Link 29 LTSSM Fault Up")
    assert (rec.mono_us, rec.ts_kind, rec.raw) == (5_500_000, "mono", line)
    # the switch's own PCI id, normalised as a GPU's is (dddd:bb:dd): never in `pci`, which names a GPU
    assert rec.nvswitch_pcis == ("0000:c8:00",)


@pytest.mark.parametrize("line, pcis", [
    ("nvidia-nvswitch0: SXid (PCI:0000:C8:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
     ("0000:c8:00",)),
    ("nvidia-nvswitch0: SXid (0000:c8:00.0): 12028, x", ("0000:c8:00",)),  # accepted without `PCI:` too
    ("nvidia-nvswitch1: SXid (PCI:00000018:07:00.0): 20034, Fatal, Link 2 LTSSM Fault Up", ("0018:07:00",)),
])
def test_an_sxid_names_its_nvswitch_by_pci_in_every_print_shape(line, pcis):
    (rec,) = parse_line(line)
    assert (rec.kind, rec.nvswitch_pcis, rec.pci) == ("sxid", pcis, None)


# -- extract_pci ---------------------------------------------------------------------------


@pytest.mark.parametrize("line, pci", [
    (f"[ 1.0] {BODY}", "0000:01:00"),  # a record's own
    ("NVRM: GPU 0000:3B:00.0: RmInitAdapter failed!", "0000:3b:00"),
    ("NVRM: GPU1 refcnt_IMPL: Failed to enter state 1", None),  # a record that names no PCI id
    ("NVRM: GPU 0000:AA:00.0: something the parser does not know", "0000:aa:00"),  # any id in a driver line
    ("NVRM: osInitNvMapping: *** Cannot attach gpu", None),
    ("nvidia-nvswitch0: SXid (PCI:0000:c8:00.0): 12, x", None),  # an NVSwitch is no GPU
    ("kernel: pci 0000:01:00.0: something", None),  # not the driver's line
    ("NVRM: GPU 00010002:01:00.0 is gone", "0002:01:00"),  # an 8-digit domain: its low 16 bits
    ("NVRM: GPU 100010002:01:00.0 is gone", None),  # nine digits: no PCI id, nor a tail of one
])
def test_extract_pci_finds_the_one_gpu_a_driver_line_names(line, pci):
    assert extract_pci(line) == pci


# -- refusals ------------------------------------------------------------------------------


def test_each_refusal_is_explained_in_words_the_log_shows():
    """The collector logs these (collectors.agent: "refused a ... line (<reason>; n so far)")."""
    assert REFUSALS == {
        "quoted": "a driver marker inside another message (e.g. a traps:/segfault report quoting a file name), "
                  "or on a line indented as the continuation of another message (dmesg)",
        "facility": "a /dev/kmsg record or <N> prefix with a facility other than 0 (kernel): a userspace write; "
                    "or a kmsg line without its record header (its writer cannot be checked)",
        "transport": "a journal record whose _TRANSPORT is not kernel, or a journal line that is not a JSON record",
        "error": "the parser raised (a bug): the line is skipped and counted",
        "text": "a line of text (dmesg, syslog, kern.log, a paste): its writer cannot be checked; "
                "a live source believes only /dev/kmsg records of facility 0 and journal records of transport kernel",
    }


@pytest.mark.parametrize("line, source, refused", [
    (f"12,1,2,-;{BODY}", None, "facility"),
    (f"12,1,2,-;nvidia-nvswitch0: SXid (PCI:0000:c8:00.0): 12, x", None, "facility"),
    ("12,1,2,-;audit: NVRM without the marker's space", None, None),  # names the driver, no marker
    (BODY, "kmsg", "facility"),  # a kmsg line without its header
    (f"[ 1.0] {BODY}", "journal", "transport"),  # a journal line that is no record
    (journal(MESSAGE=BODY, _TRANSPORT="syslog"), None, "transport"),
    (journal(MESSAGE="audit: NVRM", _TRANSPORT="syslog"), None, None),
    (f"x[1]: segfault in {BODY}", None, "quoted"),
    ("x[1]: segfault in NVRM", None, None),
    # an unknown driver message that quotes a marker
    (f"NVRM: GPU Board Serial Number NVRM: Xid (PCI:0000:01:00): 79", None, "quoted"),
    ("NVRM: GPU Board Serial Number 1234", None, None),
])
def test_which_line_is_refused_and_why(line, source, refused):
    assert parse_line_checked(line, source) == Parsed([], refused)


@pytest.mark.parametrize("prefix, source, records", [
    ("12,1,2,-;", INJECTED_KMSG, 1),  # root's test writes: facility 1 counts as the kernel's
    ("4,1,2,-;", INJECTED_KMSG, 1),
    ("", INJECTED_KMSG, 0),  # still no line without its header
    ("28,1,2,-;", INJECTED_KMSG, 0),  # facility 3 (daemon) never
])
def test_injected_kmsg_lines_count_only_as_facility_zero_or_one(prefix, source, records):
    parsed = parse_line_checked(prefix + BODY, source)
    assert len(parsed.records) == records and parsed.refused == (None if records else "facility")


def test_a_record_after_an_unknown_glued_message_is_not_believed():
    line = f"[ 1.0] NVRM: GPU Board Serial Number 12[ 1.1] {BODY}"
    assert parse_line_checked(line, "file") == Parsed([], "quoted")


def test_an_unknown_message_after_a_record_ends_the_line():
    line = f"[ 1.0] {BODY}[ 1.1] NVRM: GPU Board Serial Number 12"
    parsed = parse_line_checked(line, "file")
    assert [r.xid for r in parsed.records] == [13] and parsed.refused is None
    assert parsed.records[0].message == "Graphics Exception"


def test_glued_records_each_keep_the_whole_line_as_raw_and_the_first_stamp():
    line = f"[ 1.0] {BODY}  <4>[ 1.1] nvidia-nvswitch0: SXid (PCI:0000:c8:00.0): 12, x  "
    recs = parse_line(line, "file")
    assert [(r.kind, r.message, r.raw, r.mono_us) for r in recs] == [
        ("xid", "Graphics Exception", line, 1_000_000), ("sxid", "x", line, 1_000_000)]


def test_a_line_the_fast_path_skips():
    assert parse_line_checked("kernel: usb 1-1: new device") is parse_line_checked("x")  # the shared empty result
    assert parse_line_checked("kernel: usb 1-1: new device") == Parsed([])


# -- SXid events ---------------------------------------------------------------------------


def sxid(code: int, mono_us: int | None, message: str = "m", raw: str = "r") -> KernelRecord:
    return KernelRecord(kind="sxid", raw=raw, message=message, xid=code, mono_us=mono_us)


def test_an_sxid_line_continues_an_event_of_its_code_within_one_second():
    assert SXID_EVENT_SPAN_US == 1_000_000
    assert sxid_continues(12, 5_000_000, sxid(12, 6_000_000))  # exactly one second later
    assert sxid_continues(12, 6_000_000, sxid(12, 5_000_000))  # or before
    assert not sxid_continues(12, 5_000_000, sxid(12, 6_000_001))
    assert not sxid_continues(12, 6_000_001, sxid(12, 5_000_000))
    assert not sxid_continues(13, 5_000_000, sxid(12, 5_000_000))  # another code
    assert not sxid_continues(None, 5_000_000, sxid(12, 5_000_000))  # no event yet
    assert sxid_continues(12, None, sxid(12, 5_000_000))  # without a clock, the code decides
    assert sxid_continues(12, 5_000_000, sxid(12, None))
    xid = KernelRecord(kind="xid", raw="r", xid=12, mono_us=5_000_000)
    assert not sxid_continues(12, 5_000_000, xid)


def test_merged_sxid_lines_keep_the_first_and_join_raw_and_message():
    first, more = sxid(12, 1, "Fatal, Link 1", "line 1"), sxid(12, 2, "Fatal, Link 2", "line 2")
    merged = merge_sxid(first, more)
    assert merged == KernelRecord(kind="sxid", raw="line 1\nline 2", message="Fatal, Link 1 | Fatal, Link 2", xid=12, mono_us=1)


def test_merged_sxid_lines_name_every_nvswitch_of_the_event_once_in_order():
    def on(pci: str, mono_us: int) -> KernelRecord:
        return KernelRecord(kind="sxid", raw=pci, xid=20034, mono_us=mono_us, nvswitch_pcis=(pci,))

    merged = on("0000:06:00", 1)
    for more in (on("0000:05:00", 2), on("0000:06:00", 3), on("0000:07:00", 4)):
        merged = merge_sxid(merged, more)
    assert merged.nvswitch_pcis == ("0000:06:00", "0000:05:00", "0000:07:00")


# -- edges the captures do not reach -------------------------------------------------------


@pytest.fixture
def host_zone(monkeypatch):
    """The host runs in +05:30: an absolute stamp must still come out in UTC, not in the host's zone."""
    import time

    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("line", [
    f"2025-05-27T04:18:56Z h kernel: {BODY}",
    f"kern  :warn  : 2025-05-27T04:18:56,5+00:00 {BODY}",
    journal(MESSAGE=BODY, _TRANSPORT="kernel", __REALTIME_TIMESTAMP="1748319536000000"),
])
def test_an_absolute_stamp_is_in_utc_whatever_the_hosts_zone(host_zone, line):
    wall = split_prefix(line)[1]["wall_ts"]
    assert wall.utcoffset().total_seconds() == 0 and (wall.hour, wall.minute) == (4, 18)


def test_a_body_that_opens_with_the_driver_is_never_read_as_a_stamp():
    # "NVRM: word: <iso stamp> " has the shape of dmesg --time-format iso's prefix
    line = "NVRM: osInit: 2023-03-01T17:44:21Z ready"
    assert split_prefix(line) == (line, {})


@pytest.mark.parametrize("line, body", [
    (f"{BODY}  \t\n", f"{BODY}  \t"),  # only the line's end goes; the message's own spaces stay
    (f"{BODY} X\r\n", f"{BODY} X"),
    (f"\n{BODY}", f"\n{BODY}"),
])
def test_only_the_newline_is_cut_off_a_line(line, body):
    assert split_prefix(line) == (body, {})
    assert [r.raw for r in parse_line(line)] == ([body] if body.startswith("NVRM") else [])


@pytest.mark.parametrize("source", [None, "file", "kmsg", "journal"])
def test_trailing_blanks_are_cut_off_the_message_but_kept_in_raw(source):
    text = "NVRM: Xid (PCI:0000:01:00): 13, pid=7, name=a, Graphics Exception X  \t"
    line = {"kmsg": f"4,1,2,-;{text}", "journal": journal(MESSAGE=text, _TRANSPORT="kernel")}.get(source, text)
    (rec,) = parse_line(line + "\n", source)
    assert (rec.message, rec.raw) == ("Graphics Exception X", line)


@pytest.mark.parametrize("indent, records", [
    (" ", 1),  # the one blank that ends a prefix
    ("", 1),
    ("   ", 0),  # more is an indent: dmesg's for a record's second line, text of the record above
    (" \t", 0),
    (" X", 0),
])
def test_only_the_prefixs_own_blank_may_come_before_the_marker(indent, records):
    parsed = parse_line_checked(f"[ 1.0]{indent}{BODY}", "file")
    assert (len(parsed.records), parsed.refused) == (records, None if records else "quoted")


@pytest.mark.parametrize("line", [
    "               " + BODY,  # dmesg: indented to the width of "[ 1764.528772] "
    "                  " + BODY,  # dmesg -r: "<6>[ 1764.528772] "
    " " + BODY,
])
def test_a_line_that_opens_with_blanks_is_no_record(line):
    assert parse_line_checked(line, "file") == Parsed([], "quoted")
    assert parse_line_checked(line) == Parsed([], "quoted")


def test_one_unknown_driver_message_indented_by_spaces_is_refused_as_a_continuation():
    assert parse_line_checked("[ 1.0]    NVRM: GPU Board Serial Number 1234", "file") == Parsed([], "quoted")


@pytest.mark.parametrize("source, xids", [
    ("file", [13, 31]), (None, [13, 31]), ("kmsg", [13]), (INJECTED_KMSG, [13]), ("journal", [13]),
])
def test_only_file_text_is_split_at_a_glued_message(source, xids):
    glued = f"[ 1.0] {BODY}[ 1.1] NVRM: Xid (PCI:0000:01:00): 31, pid=5, name=a, MMU Fault"
    body = split_prefix(glued)[0]
    line = {"kmsg": f"4,1,2,-;{body}", INJECTED_KMSG: f"12,1,2,-;{body}",
            "journal": journal(MESSAGE=body, _TRANSPORT="kernel")}.get(source, glued)
    assert [r.xid for r in parse_line(line, source)] == xids


def test_an_unknown_message_between_two_records_ends_the_line_as_quoted():
    line = (f"[ 1.0] {BODY}[ 1.1] NVRM: GPU Board Serial Number 12"
            "[ 1.2] NVRM: Xid (PCI:0000:ee:00): 79, pid=1, name=x, GPU has fallen off the bus.")
    parsed = parse_line_checked(line, "file")
    assert [r.xid for r in parsed.records] == [13] and parsed.refused == "quoted"


def test_extract_pci_looks_past_a_glued_nvswitch_message():
    line = ("[ 1.0] nvidia-nvswitch0: SXid (PCI:0000:c8:00.0): 12, x"
            "[ 1.1] NVRM: GPU 0000:3B:00.0: RmInitAdapter failed!")
    assert extract_pci(line) == "0000:3b:00"


@pytest.mark.parametrize("text, kind", [
    ("NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-b600-ac93-3616-d754b23d636d", "gpu_identity"),
    ("NVRM: Rate limiting GSP RPC error prints for GPU at PCI:0000:9b:00", "gsp_rate_limit"),
    ("NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.", "fallen_off_bus"),
    ("NVRM: GPU1 refcntRequestReference_IMPL: Failed to enter state 1", "recovery_failure"),
    ("nvidia-nvswitch2: SXid (PCI:0000:c8:00.0): 12, x", "sxid"),
])
def test_every_kind_keeps_the_line_and_its_stamp(text, kind):
    line = f"6,77,123456,-;{text}"
    (rec,) = parse_line(line + "\n", "kmsg")
    assert (rec.kind, rec.raw, rec.seq, rec.mono_us, rec.kernel_ts, rec.ts_kind) == (
        kind, line, 77, 123456, "123456", "kmsg")
    assert rec.message == (text[6:] if kind != "sxid" else "x")
