"""The error and link counters (gpu.counters): NvmlReader.counters over the pynvml look-alike, the
collector's cadence, and the record against its contract. NotSupported is asked once; any other
NVML error costs a field of one GPU, never the read of the others."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import jsonschema
import orjson
import pytest

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeFabric, FakeGpu, FakeNvLink, FakePynvml
from xidstream.collectors.nvml import COUNTER_FIELDS, NvmlReader
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import GpuCounters, GpuSample, decode_any, encode
from xidstream.schemas.jsonschema import SCHEMA_DIR
from xidstream.cli import main

T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)
CLUSTER = "5f0c3a8e-1b2d-4c6e-9a7f-0d1e2f3a4b5c"
ALL_FIELDS = ["ecc_corrected_aggregate", "ecc_corrected_volatile", "ecc_uncorrected_aggregate",
              "ecc_uncorrected_volatile", "fabric", "nvlink", "retired_pages_double_bit", "retired_pages_pending",
              "retired_pages_single_bit"]


def _nvl72() -> FakeGpu:
    """A GB200-like GPU: NVLinks in a fabric, one link with rising recoveries, throttled."""
    return FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", temperature_c=87,
                   nvlinks=[FakeNvLink(replay=2, recovery=505, crc_flit=7, crc_data=1), FakeNvLink(active=False),
                            FakeNvLink(crc_flit=3)],
                   pcie_replay_count=11, pcie_link_gen=(4, 5), pcie_link_width=(8, 16),
                   ecc_sbe_volatile=12, ecc_dbe_volatile=0, ecc_sbe_aggregate=340, ecc_dbe_aggregate=1,
                   retired_pages=(2, 1), retired_pages_pending=True, clock_event_reasons=0x48 | 0x80 | 0x1,
                   fabric=FakeFabric(CLUSTER, clique_id=32766, health_mask=0x5))


def _pcie_card() -> FakeGpu:
    """A PCIe board: no NVLink, no fabric, no ECC, rows remapped rather than pages retired."""
    return FakeGpu(1, "GPU-bbbb", "00000000:17:00.0", ecc_dbe_volatile=None, retired_pages=None)


def _reader(*gpus: FakeGpu) -> tuple[NvmlReader, FakePynvml, list]:
    fake = FakePynvml(list(gpus))
    reader = NvmlReader(fake)
    return reader, fake, reader.init()


def test_every_counter_is_read_exactly():
    reader, fake, (gpu,) = _reader(_nvl72())
    got = reader.counters(gpu)
    assert (got.status, got.errors, got.unsupported) == ("ok", 0, [])
    assert got.values == {
        "nvlinks": [
            {"link": 0, "active": True, "replay_errors": 2, "recovery_errors": 505, "crc_flit_errors": 7,
             "crc_data_errors": 1},
            {"link": 1, "active": False, "replay_errors": 0, "recovery_errors": 0, "crc_flit_errors": 0,
             "crc_data_errors": 0},
            {"link": 2, "active": True, "replay_errors": 0, "recovery_errors": 0, "crc_flit_errors": 3,
             "crc_data_errors": 0},
        ],
        "pcie_replay_count": 11, "pcie_link_gen_current": 4, "pcie_link_gen_max": 5,
        "pcie_link_width_current": 8, "pcie_link_width_max": 16,
        "ecc_corrected_volatile": 12, "ecc_uncorrected_volatile": 0, "ecc_corrected_aggregate": 340,
        "ecc_uncorrected_aggregate": 1,
        "retired_pages_single_bit": 2, "retired_pages_double_bit": 1, "retired_pages_pending": True,
        "clock_event_reasons": 0xC9,
        "clock_event_reason_names": ["gpu_idle", "hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"],
        "temperature_c": 87,
        "fabric_cluster_uuid": CLUSTER, "fabric_clique_id": 32766, "fabric_state": 3, "fabric_status": 0,
        "fabric_health_mask": 5,
    }
    assert list(got.values) == list(COUNTER_FIELDS)
    # the probe asked links 0..3 (3 answered InvalidArgument: past the GPU's last link)
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 4 and reader.error_count == 0


def test_every_clock_event_reason_bit_of_pynvml_has_its_name():
    import pynvml

    reader, fake, (gpu,) = _reader(_nvl72())
    fake.gpu(0).clock_event_reasons = pynvml.nvmlClocksThrottleReasonAll
    assert reader.counters(gpu).values["clock_event_reason_names"] == [
        "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost", "sw_thermal_slowdown",
        "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting", "board_limit", "reliability"]
    fake.gpu(0).clock_event_reasons = 1 << 40  # a bit this pynvml has no name for: in the mask only
    got = reader.counters(gpu).values
    assert got["clock_event_reasons"] == 1 << 40 and got["clock_event_reason_names"] == []


def test_unsupported_counters_are_named_once_and_never_asked_again():
    reader, fake, (gpu,) = _reader(_pcie_card())
    first = reader.counters(gpu)
    assert first.unsupported == ALL_FIELDS and first.errors == 0 and reader.error_count == 0
    assert {k for k, v in first.values.items() if v is None} == {
        "nvlinks", "ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate",
        "ecc_uncorrected_aggregate", "retired_pages_single_bit", "retired_pages_double_bit", "retired_pages_pending",
        "fabric_cluster_uuid", "fabric_clique_id", "fabric_state", "fabric_status", "fabric_health_mask"}
    assert first.values["pcie_link_width_max"] == 16 and first.values["temperature_c"] == 35
    asked = dict(fake.calls)
    assert asked["nvmlDeviceGetNvLinkState"] == 36  # every link number once: none is this GPU's
    reader.refresh_inventory()  # unlike a sample's, a counter found unsupported stays so
    for _ in range(3):
        again = reader.counters(gpu)
        assert again.unsupported == ALL_FIELDS and again.values == first.values
    for fn in ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages",
               "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetGpuFabricInfoV"):
        assert fake.calls[fn] == asked[fn], fn
    assert fake.calls["nvmlDeviceGetPcieReplayCounter"] == asked["nvmlDeviceGetPcieReplayCounter"] + 3


def test_a_function_this_pynvml_lacks_is_unsupported_and_a_deprecated_call_is_the_fallback():
    gpu_spec = _nvl72()
    gpu_spec.clocks_event_api = False  # a driver before R535: only ...ClocksThrottleReasons
    gpu_spec.fabric_v = False  # a driver without nvmlDeviceGetGpuFabricInfoV
    reader, fake, (gpu,) = _reader(gpu_spec)
    fake.nvmlDeviceGetPcieReplayCounter = None  # an older nvidia-ml-py without the call
    for _ in range(3):
        got = reader.counters(gpu)
        assert got.values["clock_event_reasons"] == 0xC9 and got.values["pcie_replay_count"] is None
        assert got.values["fabric_cluster_uuid"] == CLUSTER and got.values["fabric_clique_id"] == 32766
        assert got.values["fabric_health_mask"] is None  # the older struct has none
        assert got.unsupported == ["pcie_replay_count"] and got.errors == 0
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1  # missing: not asked again
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 3
    assert fake.calls["nvmlDeviceGetGpuFabricInfoV"] == 1 and fake.calls["nvmlDeviceGetGpuFabricInfo"] == 3
    assert reader.error_count == 0


@pytest.mark.parametrize("fabric, want, unsupported", [
    (FakeFabric(CLUSTER, 7, state=0), {}, ["fabric"]),  # NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    (FakeFabric(CLUSTER, 7, state=2), {"fabric_state": 2, "fabric_health_mask": 0}, []),  # in progress: no ids yet
    (FakeFabric(CLUSTER, 7, state=3, status=999), {"fabric_state": 3, "fabric_status": 999, "fabric_health_mask": 0},
     []),  # completed with an error: the ids are not to be trusted
    (FakeFabric("00000000-0000-0000-0000-000000000000", 0), {"fabric_state": 3, "fabric_status": 0,
                                                             "fabric_health_mask": 0}, []),
])
def test_fabric_ids_only_once_registration_completed(fabric, want, unsupported):
    reader, _, (gpu,) = _reader(FakeGpu(0, "GPU-aaaa", "00000000:01:00.0", fabric=fabric))
    got = reader.counters(gpu)
    fabric_fields = {k: v for k, v in got.values.items() if k.startswith("fabric_") and v is not None}
    assert fabric_fields == want and [u for u in got.unsupported if u == "fabric"] == unsupported


def test_a_failing_link_counter_or_an_inactive_links_refusal_is_not_taken_for_unsupported():
    spec = _nvl72()
    spec.nvlink_counter_errors = {3: 999}  # CRC data: Unknown on every link
    reader, fake, (gpu,) = _reader(spec)
    got = reader.counters(gpu)
    assert [link["crc_data_errors"] for link in got.values["nvlinks"]] == [None, None, None]
    assert got.errors == 3 and "nvlink_crc_data_errors" not in got.unsupported
    spec.nvlink_counter_errors = {3: 3}  # NotSupported: link 1 is down, so only an active link's answer counts
    got = reader.counters(gpu)
    assert got.unsupported == ["nvlink_crc_data_errors"] and got.errors == 0
    before = fake.calls["nvmlDeviceGetNvLinkErrorCounter"]
    assert reader.counters(gpu).values["nvlinks"][0]["recovery_errors"] == 505
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] - before == 9  # 3 links x 3 counters: not CRC data
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 4 + 3 + 3  # the probe once, then the 3 links found


def test_an_error_on_one_gpu_costs_its_field_and_the_other_gpu_reads_on():
    broken = _nvl72()
    broken.errors = {"nvmlDeviceGetPcieReplayCounter": 999, "nvmlDeviceGetTemperature": 999}
    reader, fake, (a, b) = _reader(broken, _pcie_card())
    got_a, got_b = reader.counters(a), reader.counters(b)
    assert got_a.errors == 2 and got_a.values["pcie_replay_count"] is None and got_a.values["temperature_c"] is None
    assert got_a.values["nvlinks"][0]["recovery_errors"] == 505 and got_a.unsupported == []
    assert got_b.errors == 0 and got_b.values["pcie_replay_count"] == 0
    assert reader.error_count == 2
    broken.errors = {}
    assert reader.counters(a).values["pcie_replay_count"] == 11  # an error is asked again, unlike NotSupported


def test_a_gpu_lost_mid_read_is_a_status_with_nothing_read():
    spec = _nvl72()
    spec.lose_on_call = ("nvmlDeviceGetTotalEccErrors", 1)
    reader, _, (a, b) = _reader(spec, _pcie_card())
    got = reader.counters(a)
    assert (got.status, got.error) == ("lost", "GPU is lost") and not got.anything
    assert all(v is None for k, v in got.values.items() if k != "clock_event_reason_names")
    assert reader.counters(b).anything and reader.error_count == 0


# -- the collector ------------------------------------------------------------------------------

def _collector(sink, *gpus, every: float | None = 60.0):
    fake = FakePynvml(list(gpus) or [_nvl72(), _pcie_card()])
    clock = [0.0]
    c = Collector(CollectorConfig(node="node-a", counters_interval=every, kmsg_wall_clock=False), sink,
                  nvml=NvmlReader(fake), nvml_events_thread=False, clock=lambda: clock[0])
    c.start(T0)
    return c, fake, clock


def _counters(sink) -> list[GpuCounters]:
    return [r for r in sink.records if isinstance(r, GpuCounters)]


def test_counters_are_published_every_interval_and_not_between():
    sink = MemorySink()
    c, fake, clock = _collector(sink)
    for second in range(0, 181):
        clock[0] = float(second)
        c.tick(T0)
        if second in (0, 59, 60, 61, 119, 120, 180):
            assert len(_counters(sink)) == 2 * (1 + second // 60), second
    assert len([r for r in sink.records if isinstance(r, GpuSample)]) == 2 * 181
    assert fake.calls["nvmlDeviceGetPcieReplayCounter"] == 2 * 4
    first = _counters(sink)[0]
    assert (first.gpu_uuid, first.gpu_index, first.pci_bus_id, first.node) == ("GPU-aaaa", 0, "0000:01:00", "node-a")
    assert first.nvlinks[0].recovery_errors == 505 and first.fabric_clique_id == 32766
    pcie = _counters(sink)[1]
    assert pcie.nvlinks is None and pcie.unsupported == ALL_FIELDS and pcie.errors == 0


def test_no_interval_no_counters():
    sink = MemorySink()
    c, fake, clock = _collector(sink, every=None)
    for second in range(130):
        clock[0] = float(second)
        c.tick(T0)
    assert _counters(sink) == [] and fake.calls["nvmlDeviceGetPcieReplayCounter"] == 0


def test_a_lost_gpu_or_one_with_nothing_readable_publishes_no_counters():
    sink = MemorySink()
    bare = FakeGpu(1, "GPU-bbbb", "00000000:17:00.0", ecc_dbe_volatile=None, retired_pages=None,
                   unsupported={"nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetCurrPcieLinkGeneration",
                                "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
                                "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetCurrentClocksEventReasons",
                                "nvmlDeviceGetTemperature"})
    c, fake, clock = _collector(sink, _nvl72(), bare)
    fake.gpu(0).status = "lost"
    c.tick(T0)
    assert _counters(sink) == []
    assert [r.status.value for r in sink.records if isinstance(r, GpuSample)] == ["lost", "ok"]


def test_a_gpu_whose_counters_raise_costs_its_record_not_the_loop(caplog):
    sink = MemorySink()
    c, fake, clock = _collector(sink)
    real = c.nvml.counters

    def odd(gpu):
        if gpu.uuid == "GPU-aaaa":
            raise TypeError("an odd pynvml struct")
        return real(gpu)

    c.nvml.counters = odd
    for second in (0, 60, 120):
        clock[0] = float(second)
        c.tick(T0)
    assert [r.gpu_uuid for r in _counters(sink)] == ["GPU-bbbb"] * 3
    assert len([r for r in sink.records if isinstance(r, GpuSample)]) == 6
    assert sum("cannot read or publish its counters" in r.message for r in caplog.records) == 1  # once per GPU


def test_the_published_record_validates_against_its_json_schema_and_round_trips():
    sink = MemorySink()
    c, _, _ = _collector(sink)
    c.tick(T0)
    schema = orjson.loads((SCHEMA_DIR / "xidstream.gpu_counters.v1.json").read_bytes())
    for rec in _counters(sink):
        raw = encode(rec)
        jsonschema.validate(orjson.loads(raw), schema)
        assert decode_any(raw) == rec


def test_collect_once_publishes_counters_on_their_topic_keyed_by_gpu(tmp_path, capsys):
    """`xidstream collect --counters-interval` end to end, over `--fake-nvml` (collectors.fakes.FilePynvml)."""
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"index": 0, "uuid": "GPU-e2e", "pci_bus_id": "00000000:3B:00.0",
                                          "pcie_replay_count": 4, "nvlinks": [{"recovery": 9}, {"active": False}]}]}))
    args = ["collect", "--sink", "stdout", "--once", "--fake-nvml", str(path), "--kernel-log", "none",
            "--no-kubernetes", "--node", "n1", "--topic-prefix", "t."]
    assert main([*args, "--state-dir", str(tmp_path / "s1")]) == 0
    lines = [orjson.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    (line,) = [ln for ln in lines if ln["topic"] == "t.gpu.counters"]
    rec = decode_any(orjson.dumps(line["value"]))
    assert line["key"] == "GPU-e2e" and isinstance(rec, GpuCounters)
    assert rec.pcie_replay_count == 4 and [(link.link, link.active, link.recovery_errors) for link in rec.nvlinks] == [
        (0, True, 9), (1, False, 0)]
    assert main([*args, "--state-dir", str(tmp_path / "s2"), "--counters-interval", "0"]) == 0
    assert "t.gpu.counters" not in capsys.readouterr().out
    assert main([*args, "--state-dir", str(tmp_path / "s3"), "--counters-interval", "-1"]) == 2
