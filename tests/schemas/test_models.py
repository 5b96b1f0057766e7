from __future__ import annotations

from datetime import datetime, timezone

import orjson
import pydantic
import pytest

from xidstream.schemas import (
    ALL_MODELS,
    Action,
    Classification,
    DecodeError,
    GpuProcesses,
    GpuSample,
    Severity,
    XidEvent,
    decode,
    decode_any,
    encode,
    normalize_pci,
)
from tests.factories import NODE, T0, one_of_each


def test_factories_cover_every_model():
    assert {type(r) for r in one_of_each()} == set(ALL_MODELS)


@pytest.mark.parametrize("record", one_of_each(), ids=lambda r: type(r).__name__)
def test_every_model_round_trips_through_bytes(record):
    raw = encode(record)
    assert decode(type(record), raw) == record
    assert decode_any(raw) == record
    doc = orjson.loads(raw)
    assert doc["schema"] == type(record).SCHEMA
    assert doc["node"] == "node-a"
    assert len(doc["event_id"]) == 32
    assert doc["ts"] == "2026-11-28T03:00:00.000000Z"


def test_event_ids_are_unique():
    a, b = (GpuSample(node="n", gpu_uuid="GPU-1", gpu_index=0, pci_bus_id="0000:01:00") for _ in range(2))
    assert a.event_id != b.event_id


def test_timestamps_are_converted_to_utc_and_naive_ones_refused():
    from datetime import timedelta

    cet = timezone(timedelta(hours=1))
    s = GpuSample(ts=datetime(2026, 11, 28, 4, 0, tzinfo=cet), node="n", gpu_uuid="GPU-1", gpu_index=0,
                  pci_bus_id="0000:01:00")
    assert orjson.loads(encode(s))["ts"] == "2026-11-28T03:00:00.000000Z"
    with pytest.raises(ValueError, match="time zone"):
        GpuSample(ts=datetime(2026, 11, 28), node="n", gpu_uuid="GPU-1", gpu_index=0, pci_bus_id="0000:01:00")


def test_exact_vocabularies():
    assert [c.value for c in Classification] == [
        "APP_FAULT", "GPU_SUSPECT", "GPU_WEDGED", "GPU_HARDWARE_FAULT", "PHANTOM_LOAD", "GPU_DEGRADING", "FLEET_STORM",
        "GPU_CLAIM_CONFLICT"]
    assert [a.value for a in Action] == [
        "RECORD", "QUARANTINE_GPU", "RELEASE_GPU", "CORDON_NODE", "UNCORDON_NODE", "DRAIN_NODE",
        "RESET_GPU", "REBOOT_NODE", "REPLACE_NODE"]
    assert [s.value for s in Severity] == ["info", "warning", "critical"]


CONTRACT_FIELDS = {
    "xidstream.gpu_inventory/4": "gpu_uuid gpu_index pci_bus_id name serial memory_total_mib driver_version cuda_version "
    "status memory_info_version notes rack",
    "xidstream.gpu_sample/3": "gpu_uuid gpu_index pci_bus_id utilization_gpu_pct utilization_memory_pct "
    "memory_used_mib memory_total_mib power_w sm_clock_mhz mem_clock_mhz temperature_c status "
    "memory_reserved_mib recovery_action remapped_rows_correctable remapped_rows_uncorrectable "
    "remapped_rows_pending remapped_rows_failure ecc_dbe_volatile",
    "xidstream.gpu_processes/3": "gpu_uuid compute_apps pmon device_holders error",
    "xidstream.xid/4": "gpu_uuid pci_bus_id xid pid process_name message raw source xid_name ts_source backfilled "
    "nvswitch_pci_bus_ids",
    "xidstream.workload/3": "gpu_uuid pod_uid namespace pod container event reason exit_code job",
    "xidstream.gpu_counters/1": "gpu_uuid gpu_index pci_bus_id nvlinks pcie_replay_count pcie_link_gen_current "
    "pcie_link_gen_max pcie_link_width_current pcie_link_width_max ecc_corrected_volatile ecc_uncorrected_volatile "
    "ecc_corrected_aggregate ecc_uncorrected_aggregate retired_pages_single_bit retired_pages_double_bit "
    "retired_pages_pending clock_event_reasons clock_event_reason_names temperature_c fabric_cluster_uuid "
    "fabric_clique_id fabric_state fabric_status fabric_health_mask unsupported errors",
    "xidstream.alert/2": "alert_id incident_id gpu_uuid pci_bus_id classification severity summary evidence recommended_steps rule",
    "xidstream.remediation_command/3": "rule command_id incident_id gpu_uuid pci_bus_id action step preconditions expires_at "
    "requires_approval dry_run evidence_ids key_id signature",
    "xidstream.remediation_result/4": "command_id incident_id gpu_uuid pci_bus_id action outcome detail steps final",
    "xidstream.approval/1": "approval_id command_id approved_by reason expires_at key_id signature",
    "xidstream.deadletter/1": "original source_topic source_partition source_offset error",
    "xidstream.node_enrollment/1": "x25519_public ed25519_public csr_name csr_uid vouched revoked key_id signature",
}


@pytest.mark.parametrize("record", one_of_each(), ids=lambda r: type(r).__name__)
def test_contract_field_names_exist(record):
    doc = orjson.loads(encode(record))
    missing = [f for f in CONTRACT_FIELDS[record.SCHEMA].split() if f not in doc]
    assert not missing
    for common in ("schema", "event_id", "ts", "node"):
        assert common in doc


def test_process_entries_have_contract_fields():
    procs = next(r for r in one_of_each() if isinstance(r, GpuProcesses))
    doc = orjson.loads(encode(procs))
    assert set(doc["compute_apps"][0]) >= {"pid", "process_name", "used_memory_mib", "pod_uid", "container_id"}
    assert set(doc["pmon"][0]) >= {"pid", "sm_util_pct", "mem_util_pct"}
    assert set(doc["device_holders"][0]) >= {"pid", "process_name"}


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"\x00\xff\xfe garbage", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (None, "empty record"),
        (b'{"schema": "xidstream.gpu_sample/9"}', "schema is 'xidstream.gpu_sample/9'"),
        (b'{"schema": "xidstream.gpu_sample/1", "node": "n", "gpu_index": 0, "pci_bus_id": "0000:01:00"}',
         "gpu_uuid: Field required"),
        (b'{"schema": "xidstream.gpu_sample/1", "node": "n", "gpu_uuid": "G", "gpu_index": 0, '
         b'"pci_bus_id": "0000:01:00", "status": "melted"}', "status"),
    ],
)
def test_undecodable_bytes_give_a_clear_decode_error(raw, needle):
    with pytest.raises(DecodeError) as info:
        decode(GpuSample, raw)
    assert needle in str(info.value)
    assert info.value.raw == raw


def test_decode_any_names_an_unknown_schema():
    with pytest.raises(DecodeError, match="unknown schema 'nope/1'"):
        decode_any(b'{"schema": "nope/1"}')


@pytest.mark.parametrize("raw", [b'{"schema": []}', b'{"schema": {"a": 1}}', b'{"schema": 3}', b'{}'])
def test_decode_any_raises_only_decode_error_whatever_the_schema_field_holds(raw):
    # a list is unhashable; the lookup raised TypeError
    with pytest.raises(DecodeError, match="unknown schema"):
        decode_any(raw)


def test_a_version_1_record_still_decodes_into_the_current_model():
    v1 = (b'{"schema": "xidstream.gpu_sample/1", "node": "n", "ts": "2026-11-28T03:00:00Z", "gpu_uuid": "G", '
          b'"gpu_index": 0, "pci_bus_id": "0000:01:00", "utilization_gpu_pct": 100.0}')
    for rec in (decode(GpuSample, v1), decode_any(v1)):
        assert isinstance(rec, GpuSample) and rec.SCHEMA == "xidstream.gpu_sample/3"
        assert rec.utilization_gpu_pct == 100.0 and rec.memory_reserved_mib is None


SXID_RAW = "[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"


def test_an_sxid_record_names_its_nvswitches_apart_from_any_gpu():
    rec = XidEvent(ts=T0, node="n", kind="sxid", xid=20034, source="kmsg", raw=SXID_RAW,
                   nvswitch_pci_bus_ids=["0000:06:00", "0000:05:00"])
    doc = orjson.loads(encode(rec))
    assert (doc["schema"], doc["nvswitch_pci_bus_ids"], doc["pci_bus_id"]) == (
        "xidstream.xid/4", ["0000:06:00", "0000:05:00"], None)
    assert decode_any(encode(rec)) == rec
    # a GPU's Xid names no switch
    assert orjson.loads(encode(XidEvent(ts=T0, node="n", xid=13, source="kmsg")))["nvswitch_pci_bus_ids"] == []


@pytest.mark.parametrize("pci", ["0000:06:00.0", "0000:6:00", "PCI:0000:06:00", "0000:0G:00", ""])
def test_an_nvswitch_pci_id_not_in_the_normalised_form_is_refused_by_name(pci):
    doc = orjson.loads(encode(XidEvent(ts=T0, node="n", kind="sxid", xid=20034, source="kmsg")))
    doc["nvswitch_pci_bus_ids"] = [pci]
    with pytest.raises(DecodeError, match=r"nvswitch_pci_bus_ids\.0: String should match pattern"):
        decode_any(orjson.dumps(doc))


def test_an_xid_3_sxid_record_decodes_naming_no_switch():
    # what a collector of the previous release sends during a rolling upgrade: the switch is only
    # in `raw`, which the processor does not parse again
    v3 = orjson.dumps({"schema": "xidstream.xid/3", "node": "n", "ts": "2026-11-28T03:00:00Z", "kind": "sxid",
                       "xid": 20034, "source": "kmsg", "raw": SXID_RAW})
    for rec in (decode_any(v3), decode(XidEvent, v3)):
        assert rec.SCHEMA == "xidstream.xid/4" and rec.nvswitch_pci_bus_ids == [] and rec.raw == SXID_RAW


def test_a_version_1_result_without_a_command_id_is_a_clear_decode_error():
    v1 = b'{"schema": "xidstream.remediation_result/1", "node": "n", "action": "RESET_GPU", "outcome": "failed"}'
    with pytest.raises(DecodeError, match="command_id: Field required"):
        decode_any(v1)


def test_an_unreadable_compute_list_is_null_not_empty():
    unknown = GpuProcesses(ts=T0, node="n", gpu_uuid="G", compute_apps=None, error="NVML_ERROR_UNKNOWN")
    assert orjson.loads(encode(unknown))["compute_apps"] is None
    assert decode(GpuProcesses, encode(unknown)).compute_apps is None


@pytest.mark.parametrize(
    "given, expected",
    [
        ("00000000:17:00.0", "0000:17:00"),
        (b"00000000:17:00.0", "0000:17:00"),
        ("0000:91:00.0", "0000:91:00"),
        ("PCI:0002:10:1c", "0002:10:1c"),
        ("0000:CB:00", "0000:cb:00"),
        ("0000:01:00 GPU-I:03", "0000:01:00"),
        ("01:00.0", "0000:01:00"),
        ("garbage", None),
        ("", None),
        (None, None),
    ],
)
def test_normalize_pci(given, expected):
    assert normalize_pci(given) == expected


@pytest.mark.parametrize("record", one_of_each(), ids=lambda r: type(r).__name__)
def test_records_are_immutable(record):
    # pydantic's frozen model refuses the assignment itself (error type "frozen_instance"); any
    # other exception (an AttributeError from a misspelt field, a TypeError) would not say that.
    with pytest.raises(pydantic.ValidationError) as refused:
        record.node = "another-node"  # type: ignore[misc]
    assert [e["type"] for e in refused.value.errors()] == ["frozen_instance"]
    assert record.node == NODE


@pytest.mark.parametrize("record", [r for r in one_of_each() if type(r).__name__ != "RemediationCommand"],
                         ids=lambda r: type(r).__name__)
def test_validating_a_record_runs_no_python_code_of_pydantic(record):
    # The worker validates every input record with pydantic-core (streams.app.decode_input); any
    # Python function of pydantic's that runs per record (a private attribute's set-up ran three
    # times per record, once per class of the hierarchy) is CPU on the worker's hot path. Only
    # RemediationCommand, whose signature depends on the version it was decoded from, keeps one.
    import sys

    raw = encode(record)
    root = pydantic.__file__.rsplit("/", 1)[0]
    entered = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            entered.append(frame.f_code.co_name)

    sys.setprofile(watch)
    try:
        got = type(record).model_validate_json(raw)
    finally:
        sys.setprofile(None)
    assert got == record
    assert [name for name in entered if name != "model_validate_json"] == []  # the call itself aside
