"""Every string and list a node or an executor sends is bounded (schemas.limits): a record at a cap
decodes, one past it is a DecodeError naming the field and the limit (the processor dead-letters
it); earlier versions still decode; `clip` cuts with a marker that counts what it left out."""

from __future__ import annotations

import re

import orjson
import pytest

from xidstream.schemas import (
    DecodeError,
    GpuCounters,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
    decode,
    decode_any,
    encode,
)
from xidstream.schemas.base import NodeRecord
from xidstream.schemas.limits import (
    CATALOG_TEXT_MAX,
    COUNTER_NAME_MAX,
    COUNTER_NAMES_MAX,
    DETAIL_MAX,
    GPU_UUID_MAX,
    ID_MAX,
    JOB_MAX,
    K8S_LABEL_MAX,
    KERNEL_MESSAGE_MAX,
    KERNEL_RAW_MAX,
    KERNEL_TS_MAX,
    NODE_NAME_MAX,
    NOTES_MAX,
    NVLINK_LINKS_MAX,
    NVML_STRING_MAX,
    NVSWITCHES_MAX,
    POD_NAME_MAX,
    PROCESS_NAME_MAX,
    PROCESSES_MAX,
    SHORT_TEXT_MAX,
    TASK_COMM_MAX,
    XID_SOURCES_MAX,
    clip,
)
from xidstream.schemas.models import ALL_MODELS
from tests.factories import one_of_each

NODE_SENT = (GpuInventory, GpuSample, GpuProcesses, XidEvent, WorkloadEvent, GpuCounters, RemediationResult)


def _doc(model) -> dict:
    return orjson.loads(encode(next(r for r in one_of_each() if isinstance(r, model))))


def _put(doc: dict, path: str, value) -> dict:
    """`doc` with the value at a dotted path (list indexes as numbers) replaced."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = doc
    for p in parents:
        node = node[p]
    node[last] = value
    return doc


STRINGS = [
    (model, path, limit)
    for model in NODE_SENT
    for path, limit in (("node", NODE_NAME_MAX), ("event_id", ID_MAX))
] + [
    (GpuInventory, "gpu_uuid", GPU_UUID_MAX),
    (GpuInventory, "name", NVML_STRING_MAX),
    (GpuInventory, "serial", NVML_STRING_MAX),
    (GpuInventory, "driver_version", NVML_STRING_MAX),
    (GpuInventory, "cuda_version", NVML_STRING_MAX),
    (GpuSample, "gpu_uuid", GPU_UUID_MAX),
    (GpuSample, "error", SHORT_TEXT_MAX),
    (GpuProcesses, "gpu_uuid", GPU_UUID_MAX),
    (GpuProcesses, "error", SHORT_TEXT_MAX),
    (GpuProcesses, "compute_apps.0.process_name", PROCESS_NAME_MAX),
    (GpuProcesses, "compute_apps.0.pod_uid", ID_MAX),
    (GpuProcesses, "compute_apps.0.container_id", ID_MAX),
    (GpuProcesses, "device_holders.0.process_name", TASK_COMM_MAX),
    (XidEvent, "gpu_uuid", GPU_UUID_MAX),
    (XidEvent, "xid_name", CATALOG_TEXT_MAX),
    (XidEvent, "xid_category", CATALOG_TEXT_MAX),
    (XidEvent, "xid_resolution", CATALOG_TEXT_MAX),
    (XidEvent, "process_name", TASK_COMM_MAX),
    (XidEvent, "message", KERNEL_MESSAGE_MAX),
    (XidEvent, "raw", KERNEL_RAW_MAX),
    (XidEvent, "kernel_ts", KERNEL_TS_MAX),
    (WorkloadEvent, "gpu_uuid", GPU_UUID_MAX),
    (WorkloadEvent, "pod_uid", ID_MAX),
    (WorkloadEvent, "namespace", K8S_LABEL_MAX),
    (WorkloadEvent, "pod", POD_NAME_MAX),
    (WorkloadEvent, "container", K8S_LABEL_MAX),
    (WorkloadEvent, "reason", SHORT_TEXT_MAX),
    (WorkloadEvent, "job", JOB_MAX),
    (GpuInventory, "rack", K8S_LABEL_MAX),
    (GpuCounters, "gpu_uuid", GPU_UUID_MAX),
    (GpuCounters, "fabric_cluster_uuid", 36),
    (GpuCounters, "clock_event_reason_names.0", COUNTER_NAME_MAX),
    (GpuCounters, "unsupported.0", COUNTER_NAME_MAX),
    (RemediationResult, "command_id", ID_MAX),
    (RemediationResult, "incident_id", ID_MAX),
    (RemediationResult, "gpu_uuid", GPU_UUID_MAX),
    (RemediationResult, "detail", DETAIL_MAX),
]


def _text(path: str, n: int) -> str:
    """`n` characters for the field at `path`: a node name is a DNS-1123 subdomain as well (labels
    of at most 63 characters), so its cap is met with several labels."""
    if path != "node":
        return "x" * n
    full, rest = divmod(n, 64)
    return ".".join(["x" * 63] * full + ["x" * rest]) if rest else ".".join(["x" * 63] * (full - 1) + ["x" * 62, "x"])


@pytest.mark.parametrize("model, path, limit", STRINGS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_string_at_its_cap_decodes_and_one_past_it_is_refused_by_name(model, path, limit):
    at = orjson.dumps(_put(_doc(model), path, _text(path, limit)))
    assert isinstance(decode_any(at), model)
    over = orjson.dumps(_put(_doc(model), path, _text(path, limit + 1)))
    for decoder in (decode_any, lambda raw: decode(model, raw)):
        with pytest.raises(DecodeError) as refused:
            decoder(over)
        assert f"{path}: String should have at most {limit} characters" in str(refused.value)


def _item(path: str):
    return {"compute_apps": {"pid": 1}, "pmon": {"pid": 1}, "device_holders": {"pid": 1}, "notes": "n",
            "sources": "kmsg", "nvswitch_pci_bus_ids": "0000:06:00", "nvlinks": {"link": 1}, "unsupported": "n", "clock_event_reason_names": "n"}[path]


LISTS = [
    (GpuInventory, "notes", NOTES_MAX),
    (GpuProcesses, "compute_apps", PROCESSES_MAX),
    (GpuProcesses, "pmon", PROCESSES_MAX),
    (GpuProcesses, "device_holders", PROCESSES_MAX),
    (XidEvent, "sources", XID_SOURCES_MAX),
    (XidEvent, "nvswitch_pci_bus_ids", NVSWITCHES_MAX),
    (GpuCounters, "nvlinks", NVLINK_LINKS_MAX),
    (GpuCounters, "unsupported", COUNTER_NAMES_MAX),
    (GpuCounters, "clock_event_reason_names", COUNTER_NAMES_MAX),
]


@pytest.mark.parametrize("model, path, limit", LISTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_list_at_its_cap_decodes_and_one_past_it_is_refused_by_name(model, path, limit):
    assert len(decode_any(orjson.dumps(_put(_doc(model), path, [_item(path)] * limit)))
               .model_dump()[path]) == limit
    with pytest.raises(DecodeError) as refused:
        decode_any(orjson.dumps(_put(_doc(model), path, [_item(path)] * (limit + 1))))
    assert refused.value.reason.startswith(f"{path}: List should have at most {limit} items")


def test_a_note_past_its_cap_is_refused_by_name():
    with pytest.raises(DecodeError, match=rf"notes\.0: String should have at most {SHORT_TEXT_MAX} characters"):
        decode_any(orjson.dumps(_put(_doc(GpuInventory), "notes", ["x" * (SHORT_TEXT_MAX + 1)])))


def _unbounded(node, path: str, defs: dict):
    """Paths of strings without maxLength (or enum, const, pattern, format) and arrays without
    maxItems in a JSON Schema."""
    if isinstance(node, dict):
        if "$ref" in node:
            yield from _unbounded(defs[node["$ref"].rsplit("/", 1)[-1]], path, defs)
            return
        kind = node.get("type")
        if kind == "string" and not {"maxLength", "enum", "const", "pattern", "format"} & set(node):
            yield path
        if kind == "array" and "maxItems" not in node:
            yield path
        for key, sub in node.get("properties", {}).items():
            yield from _unbounded(sub, f"{path}.{key}".lstrip("."), defs)
        for sub in node.get("anyOf", []):
            yield from _unbounded(sub, path, defs)
        if "items" in node:
            yield from _unbounded(node["items"], f"{path}[]", defs)


@pytest.mark.parametrize("model", [m for m in ALL_MODELS if issubclass(m, NodeRecord)], ids=lambda m: m.__name__)
def test_nothing_a_node_sends_is_left_unbounded(model):
    doc = model.model_json_schema(by_alias=True)
    assert list(_unbounded(doc, "", doc.get("$defs", {}))) == []


def test_every_model_a_node_or_an_executor_sends_is_a_node_record():
    assert {m for m in ALL_MODELS if issubclass(m, NodeRecord)} == set(NODE_SENT)


def test_the_incident_record_is_refused_with_its_field_and_limit():
    # Four 350 KB `raw` fields from one collector crashed the processor's producer.
    doc = _put(_doc(XidEvent), "raw", "A" * 350_000)
    with pytest.raises(DecodeError) as refused:
        decode_any(orjson.dumps(doc))
    assert refused.value.reason == f"raw: String should have at most {KERNEL_RAW_MAX} characters"


# -- earlier versions --------------------------------------------------------------------------

PREVIOUS = {
    GpuInventory: "xidstream.gpu_inventory/3",
    GpuSample: "xidstream.gpu_sample/2",
    GpuProcesses: "xidstream.gpu_processes/2",
    XidEvent: "xidstream.xid/3",
    WorkloadEvent: "xidstream.workload/2",
    RemediationResult: "xidstream.remediation_result/3",
}


def test_every_node_record_with_an_earlier_version_is_listed():
    # GpuCounters is at its first version: nothing earlier to decode
    assert {m for m in NODE_SENT if m.LEGACY} == set(PREVIOUS)


@pytest.mark.parametrize("model", list(PREVIOUS), ids=lambda m: m.__name__)
def test_the_previous_version_still_decodes_into_the_current_model(model):
    assert PREVIOUS[model] in model.LEGACY and model.SCHEMA != PREVIOUS[model]
    doc = {**_doc(model), "schema": PREVIOUS[model]}
    for rec in (decode_any(orjson.dumps(doc)), decode(model, orjson.dumps(doc))):
        assert type(rec) is model and rec.SCHEMA == model.SCHEMA and rec.event_id == doc["event_id"]


def test_a_previous_version_past_a_cap_is_refused_too():
    doc = {**_put(_doc(XidEvent), "raw", "A" * (KERNEL_RAW_MAX + 1)), "schema": "xidstream.xid/2"}
    with pytest.raises(DecodeError) as refused:
        decode_any(orjson.dumps(doc))
    assert refused.value.reason == (f"raw: String should have at most {KERNEL_RAW_MAX} characters "
                                    f"(a xidstream.xid/2 record read as xidstream.xid/4)")


def test_device_holders_null_and_empty_round_trip_as_themselves():
    for holders in (None, []):
        rec = GpuProcesses(node="n", gpu_uuid="GPU-1", device_holders=holders)
        raw = encode(rec)
        assert orjson.loads(raw)["device_holders"] == holders
        assert decode(GpuProcesses, raw).device_holders == holders == decode_any(raw).device_holders
    assert GpuProcesses(node="n", gpu_uuid="GPU-1").device_holders is None  # not scanned, unless said


@pytest.mark.parametrize(
    "version, sent, read",
    [
        # Before v3 a collector without /proc sent [] too: unknown, not "nobody".
        ("xidstream.gpu_processes/2", [], None),
        ("xidstream.gpu_processes/2", [{"pid": 77, "process_name": "dcgm-exporter"}], [77]),
        ("xidstream.gpu_processes/1", [], None),
        ("xidstream.gpu_processes/3", [], []),
    ],
)
def test_an_earlier_empty_holder_list_reads_as_unknown(version, sent, read):
    raw = orjson.dumps({"schema": version, "node": "n", "gpu_uuid": "GPU-1", "device_holders": sent})
    got = decode_any(raw).device_holders
    assert (got if got is None else [h.pid for h in got]) == read


# -- clip --------------------------------------------------------------------------------------

_MARKER = re.compile(r"\.\.\. \[(\d+) more characters\]$")


@pytest.mark.parametrize("length", [4097, 4100, 10_000, 350_000, 10**7])
def test_clip_fits_the_cap_and_counts_what_it_left_out(length):
    text = "".join(chr(0x41 + i % 26) for i in range(length))
    out = clip(text, 4096)
    m = _MARKER.search(out)
    assert len(out) <= 4096 and m and text.startswith(out[:m.start()])
    assert m.start() + int(m.group(1)) == length
    assert len(out) >= 4096 - 2  # at most the marker's spare digits go unused


def test_clip_leaves_what_fits_alone_and_adds_what_was_left_out_before():
    assert clip(None, 10) is None
    assert clip("x" * 4096, 4096) == "x" * 4096
    assert clip("abc", 100, more=5) == "abc... [5 more characters]"
    assert clip("x" * 100, 10) == "x" * 10  # no room for a marker: a plain cut


COUNTER_INTS = ["pcie_replay_count", "ecc_corrected_volatile", "ecc_uncorrected_aggregate", "retired_pages_single_bit",
                "clock_event_reasons", "fabric_clique_id", "fabric_health_mask", "errors", "nvlinks.0.replay_errors",
                "nvlinks.0.crc_data_errors"]


@pytest.mark.parametrize("path", COUNTER_INTS)
def test_a_counter_past_a_signed_64_bit_integer_is_refused_by_name(path):
    # every node writes gpu.counters, and the lake's columns are Parquet int64: a forged 2**64 passed
    # validation, then failed the lander's conversion, and every flush after it, for every topic
    from xidstream.schemas.limits import INT64_MAX

    doc = _doc(GpuCounters)
    doc.setdefault("nvlinks", [{"link": 0}])
    if not doc["nvlinks"]:
        doc["nvlinks"] = [{"link": 0}]
    assert isinstance(decode_any(orjson.dumps(_put(doc, path, INT64_MAX))), GpuCounters)
    with pytest.raises(DecodeError) as refused:
        decode_any(orjson.dumps(_put(doc, path, INT64_MAX + 1)))
    assert f"{path}: Input should be less than or equal to {INT64_MAX}" in str(refused.value)


def test_a_counters_record_at_every_cap_lands(tmp_path):
    # what the schema lets through, the lake's int64 columns hold: a counter at INT64_MAX lands
    import pyarrow.parquet as pq

    from xidstream.exporters.parquet import ParquetLander
    from xidstream.schemas.limits import INT64_MAX

    doc = _doc(GpuCounters)
    for path in COUNTER_INTS:
        if path.startswith("nvlinks.") and not doc.get("nvlinks"):
            doc["nvlinks"] = [{"link": 0}]
        _put(doc, path, INT64_MAX)
    rec = decode_any(orjson.dumps(doc))
    lander = ParquetLander(tmp_path)
    lander.add("gpu.counters", rec, partition=0, offset=1)
    (landed,) = lander.flush()
    (row,) = pq.read_table(landed.path).to_pylist()
    assert row["pcie_replay_count"] == row["errors"] == row["nvlinks"][0]["crc_data_errors"] == INT64_MAX
