"""The Parquet landing without Kafka: schemas from the models, partitions, rolling, atomic files,
read back with pyarrow and DuckDB."""

from __future__ import annotations

from datetime import timedelta

import duckdb
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from xidstream.exporters.parquet import LANDED_MODELS, ParquetLander, arrow_schema
from xidstream.schemas import GpuSample
from tests.factories import T0, UUID1, one_of_each


def _samples(n: int, start=T0):
    return [GpuSample(ts=start + timedelta(minutes=i), node="node-a", gpu_uuid=UUID1, gpu_index=1,
                      pci_bus_id="0000:01:00", utilization_gpu_pct=float(i % 100), power_w=100.0 + i)
            for i in range(n)]


def test_every_model_field_is_a_column():
    for topic, model in LANDED_MODELS.items():
        cols = arrow_schema(model).names
        assert cols == [f.alias or n for n, f in model.model_fields.items()] + ["_kafka_partition", "_kafka_offset"]


def test_one_of_each_round_trips_with_its_types(tmp_path):
    lander = ParquetLander(tmp_path)
    recs = {t: r for r in one_of_each() for t, m in LANDED_MODELS.items() if isinstance(r, m)}
    for i, (t, r) in enumerate(recs.items()):
        lander.add(t, r, partition=0, offset=i)
    files = lander.flush()
    assert len(files) == len(LANDED_MODELS)
    xid = pq.read_table(next(f.path for f in files if f.table == "gpu.xid")).to_pylist()[0]
    assert xid["xid"] == 43 and xid["sources"] == ["kmsg", "nvml"] and xid["ts"] == T0
    procs = pq.read_table(next(f.path for f in files if f.table == "gpu.processes")).to_pylist()[0]
    assert procs["compute_apps"][0]["pid"] == 4242 and procs["device_holders"][0]["process_name"] == "dcgm-exporter"


def test_partitioned_by_the_records_own_hour_and_read_by_duckdb(tmp_path):
    lander = ParquetLander(tmp_path)
    for i, s in enumerate(_samples(150)):  # 2.5 hours of one sample a minute
        lander.add("gpu.samples", s, partition=0, offset=i)
    files = lander.flush()
    # no leading zero: DuckDB guessed "03" as text but "13" as a number
    assert sorted(p.path.parent.name for p in files) == ["hour=3", "hour=4", "hour=5"]
    assert all(p.path.parent.parent.name == "dt=2026-11-28" for p in files)
    table = ds.dataset(tmp_path / "topic=gpu.samples", format="parquet", partitioning="hive").to_table()
    assert table.num_rows == 150
    rows = duckdb.sql(f"select hour, count(*) from read_parquet('{tmp_path}/topic=*/dt=*/hour=*/*.parquet', "
                      "hive_partitioning=true) group by hour order by hour").fetchall()
    assert rows == [(3, 60), (4, 60), (5, 30)]


def test_rolls_by_size_and_by_age(tmp_path):
    now = [0.0]
    lander = ParquetLander(tmp_path, max_bytes=1000, max_seconds=60, clock=lambda: now[0])
    assert not lander.should_roll()
    for s in _samples(3):
        lander.add("gpu.samples", s, size=300)
    assert not lander.should_roll()
    lander.add("gpu.samples", _samples(1)[0], size=300)
    assert lander.should_roll()
    lander.flush()
    lander.add("gpu.samples", _samples(1)[0], size=10)
    assert not lander.should_roll()
    now[0] = 61.0
    assert lander.should_roll()


def test_no_temporary_or_partial_file_is_left_visible(tmp_path):
    lander = ParquetLander(tmp_path)
    for s in _samples(10):
        lander.add("gpu.samples", s)
    files = lander.flush()
    every = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert sorted(every) == sorted(f.path for f in files)
    # a crashed writer's temp file is hidden from readers: dot-name, no .parquet suffix
    (files[0].path.parent / ".part-x.parquet.tmp").write_bytes(b"PAR1 half")
    assert ds.dataset(tmp_path / "topic=gpu.samples", format="parquet", partitioning="hive").count_rows() == 10
    assert duckdb.sql(f"select count(*) from '{tmp_path}/topic=*/dt=*/hour=*/*.parquet'").fetchall() == [(10,)]


def test_a_counters_record_lands_with_typed_columns_and_its_values(tmp_path):
    import pyarrow as pa

    from xidstream.schemas import GpuCounters

    rec = next(r for r in one_of_each() if isinstance(r, GpuCounters))
    lander = ParquetLander(tmp_path)
    lander.add("gpu.counters", rec, partition=5, offset=9)
    (landed,) = lander.flush()
    assert landed.path.parent == tmp_path / "topic=gpu.counters" / "dt=2026-11-28" / "hour=3"
    table = pq.read_table(landed.path)
    types = {f.name: f.type for f in table.schema}
    assert types["nvlinks"] == pa.list_(pa.struct([
        ("link", pa.int64()), ("active", pa.bool_()), ("replay_errors", pa.int64()), ("recovery_errors", pa.int64()),
        ("crc_flit_errors", pa.int64()), ("crc_data_errors", pa.int64())]))
    assert {types[c] for c in ("pcie_replay_count", "pcie_link_width_current", "ecc_corrected_aggregate",
                               "clock_event_reasons", "fabric_clique_id", "errors")} == {pa.int64()}
    assert types["retired_pages_pending"] == pa.bool_() and types["ts"] == pa.timestamp("us", tz="UTC")
    assert types["clock_event_reason_names"] == types["unsupported"] == pa.list_(pa.string())
    (row,) = table.to_pylist()
    assert row == {**rec.model_dump(by_alias=True), "_kafka_partition": 5, "_kafka_offset": 9}
    assert row["nvlinks"][0] == {"link": 0, "active": True, "replay_errors": 2, "recovery_errors": 505,
                                 "crc_flit_errors": 7, "crc_data_errors": None}
    assert (row["pcie_link_width_current"], row["pcie_link_width_max"], row["fabric_cluster_uuid"]) == (
        8, 16, "5f0c3a8e-1b2d-4c6e-9a7f-0d1e2f3a4b5c")
    assert row["clock_event_reason_names"] == ["hw_slowdown", "hw_thermal_slowdown"] and row["errors"] == 1
