"""The lake as its readers see it: the shipped DuckDB query (read from docs/architecture.md, so the
docs and this test cannot drift) over lakes spanning midnight, written by an older release, landed
from skewed clocks; streaming row groups, bounded open files, compaction.

The names under test are imported inside each test: a missing one fails that test, not the module.
"""

from __future__ import annotations

import re
import tracemalloc
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from xidstream.exporters.parquet import ParquetLander, arrow_schema
from xidstream.schemas import GpuSample, XidEvent
from tests.factories import UUID1

ROOT = Path(__file__).resolve().parents[2]
D = datetime(2026, 11, 28, 23, 10, tzinfo=timezone.utc)  # midnight is 50 minutes later


def _shipped_sql(lake: Path) -> str:
    """The SQL blocks of the architecture guide's lake section, pointed at `lake`."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("### Export for SIEM and data lake"):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```sql\n(.*?)```", section, re.S)
    assert blocks, "docs/architecture.md: no ```sql block in 'Export for SIEM and data lake'"
    return "\n".join(blocks).replace("'/lake/", f"'{lake}/")


def _shipped(lake: Path) -> tuple[duckdb.DuckDBPyConnection, list[tuple]]:
    """A connection with the shipped views, and the shipped query's rows."""
    con = duckdb.connect()
    rows = con.execute(_shipped_sql(lake)).fetchall()
    return con, rows


def _xid(ts: datetime, n: int = 0, **kw) -> XidEvent:
    return XidEvent(ts=ts, node="node-a", gpu_uuid=UUID1, gpu_index=1, pci_bus_id="0000:01:00", resolved=True,
                    xid=79, source="kmsg", message=f"Xid 79 #{n}", **kw)


def _inventory(lander: ParquetLander, ts: datetime) -> None:
    from xidstream.schemas import GpuInventory
    lander.add("gpu.inventory", GpuInventory(ts=ts, node="node-a", gpu_uuid=UUID1, gpu_index=1,
                                             pci_bus_id="0000:01:00", name="NVIDIA H100 80GB HBM3"))


def _land_xids(root: Path, times: list[datetime]) -> list:
    lander = ParquetLander(root)
    _inventory(lander, times[0])
    for i, t in enumerate(times):
        lander.add("gpu.xid", _xid(t, i), partition=0, offset=i)
    return lander.flush()


def test_every_shipped_read_names_the_partition_types_and_matches_columns_by_name(tmp_path):
    from xidstream.exporters.parquet import HIVE_TYPES_SQL
    reads = re.findall(r"read_parquet\((.*?)\)", _shipped_sql(tmp_path), re.S)
    assert reads
    for args in reads:
        flat = " ".join(args.split())
        assert "hive_partitioning = true" in flat and f"hive_types = {HIVE_TYPES_SQL}" in flat, flat
        assert "union_by_name = true" in flat, flat


# -- 8: partition types stable over the day -------------------------------------------------------

def test_a_lake_spanning_midnight_reads_hour_as_one_integer_type(tmp_path):
    times = [D, D + timedelta(minutes=60), D + timedelta(minutes=61), D + timedelta(minutes=120)]  # 23, 0, 0, 1
    files = _land_xids(tmp_path, times)
    assert {f.path.parent.name for f in files if f.table == "gpu.xid"} == {"hour=23", "hour=0", "hour=1"}
    con, rows = _shipped(tmp_path)
    assert rows == [(D.date(), "NVIDIA H100 80GB HBM3", 79, 1), (D.date() + timedelta(days=1), "NVIDIA H100 80GB HBM3",
                                                                  79, 3)]
    assert con.sql("select count(*) from xid where hour = 1").fetchall() == [(1,)]
    assert con.sql("select count(*) from xid where hour = 0").fetchall() == [(2,)]
    assert con.sql("select count(*) from xid where dt = DATE '2026-11-29' and hour = 0").fetchall() == [(2,)]
    assert con.sql("select distinct typeof(dt), typeof(hour) from xid").fetchall() == [("DATE", "INTEGER")]


@pytest.mark.parametrize("hours", [[0], [1], [23], [0, 1], [9, 10], [0, 23]])
def test_hour_type_is_the_same_whichever_folders_exist(tmp_path, hours):
    # each lake holds only these hours: a reader's type for `hour` must not depend on which
    _land_xids(tmp_path, [D.replace(hour=h) for h in hours])
    con, _ = _shipped(tmp_path)
    assert con.sql("select distinct typeof(hour) from xid").fetchall() == [("INTEGER",)]
    # a reader that names no types (a plain `hive_partitioning = true`) sees a number too
    guessed = duckdb.sql(f"select distinct typeof(hour) from read_parquet('{tmp_path}/topic=gpu.xid/*/*/*.parquet', "
                         "hive_partitioning = true)").fetchall()
    assert guessed == [("BIGINT",)]


def _old_release_file(folder: Path, rows: list[dict],
                      drop=("observed_at", "process_lists", "nvswitch_pci_bus_ids")) -> Path:
    """A gpu.xid file as an earlier release wrote it: its schema had no `observed_at`, no
    `process_lists` (both xid/3) and no `nvswitch_pci_bus_ids` (xid/4)."""
    schema = arrow_schema(XidEvent)
    for name in drop:
        schema = schema.remove(schema.get_field_index(name))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "part-20261128T000000-0123456789ab.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def _old_row(ts: datetime, n: int) -> dict:
    row = _xid(ts, n).model_dump(by_alias=True, mode="json")
    row.update(ts=ts, schema="xidstream.xid/2", _kafka_partition=0, _kafka_offset=n)
    return row


def test_a_padded_hour_lake_from_an_earlier_release_reads_the_same(tmp_path):
    xid = tmp_path / "topic=gpu.xid"
    _old_release_file(xid / "dt=2026-11-28" / "hour=23", [_old_row(D, 1)])
    _old_release_file(xid / "dt=2026-11-29" / "hour=00", [_old_row(D + timedelta(hours=1), 2)])
    _old_release_file(xid / "dt=2026-11-29" / "hour=01", [_old_row(D + timedelta(hours=2), 3)])
    lander = ParquetLander(tmp_path)
    _inventory(lander, D)
    lander.flush()
    con, rows = _shipped(tmp_path)
    assert [r[3] for r in rows] == [1, 2]
    assert con.sql("select count(*) from xid where hour = 0").fetchall() == [(1,)]
    assert con.sql("select count(*) from xid where hour = 1").fetchall() == [(1,)]
    assert con.sql("select distinct typeof(hour) from xid").fetchall() == [("INTEGER",)]


# -- 9: a lake of two releases ----------------------------------------------------------------------

def test_a_lake_of_two_releases_reads_every_row_with_the_new_columns_null_for_old_rows(tmp_path):
    # the older release's file sorts first: it is the one a reader would take the columns from
    _old_release_file(tmp_path / "topic=gpu.xid" / "dt=2026-11-28" / "hour=23", [_old_row(D, 1)])
    seen = D + timedelta(hours=1)
    lander = ParquetLander(tmp_path)
    _inventory(lander, D)
    lander.add("gpu.xid", _xid(seen, 2, observed_at=seen, process_lists=False))
    lander.flush()
    con, rows = _shipped(tmp_path)
    assert sorted(r[3] for r in rows) == [1, 1]
    got = con.sql("select message, observed_at, process_lists from xid order by ts").fetchall()
    assert got == [("Xid 79 #1", None, None), ("Xid 79 #2", seen, False)]

    from xidstream.exporters.parquet import lake_dataset
    table = lake_dataset(tmp_path, "gpu.xid").to_table().sort_by("ts").to_pylist()
    assert [(r["message"], r["observed_at"], r["process_lists"], r["hour"]) for r in table] == \
        [("Xid 79 #1", None, None, 23), ("Xid 79 #2", seen, False, 0)]


def test_an_sxid_lands_with_its_nvswitches_and_an_earlier_release_file_reads_them_as_null(tmp_path):
    raw = "[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"
    old = XidEvent(ts=D, node="node-a", kind="sxid", xid=20034, source="kmsg", raw=raw).model_dump(
        by_alias=True, mode="json")
    old.update(ts=D, schema="xidstream.xid/3", _kafka_partition=0, _kafka_offset=1)
    _old_release_file(tmp_path / "topic=gpu.xid" / "dt=2026-11-28" / "hour=23", [old],
                      drop=("nvswitch_pci_bus_ids",))
    later = D + timedelta(hours=1)
    lander = ParquetLander(tmp_path)
    _inventory(lander, D)
    lander.add("gpu.xid", XidEvent(ts=later, node="node-a", kind="sxid", xid=20034, source="kmsg", raw=raw,
                                   nvswitch_pci_bus_ids=["0000:06:00", "0000:05:00"]), partition=0, offset=2)
    lander.flush()
    con, _ = _shipped(tmp_path)
    got = con.sql("select schema, kind, pci_bus_id, nvswitch_pci_bus_ids from xid order by ts").fetchall()
    assert got == [("xidstream.xid/3", "sxid", None, None),
                   ("xidstream.xid/4", "sxid", None, ["0000:06:00", "0000:05:00"])]
    # the switch a lake query ties SXids to, as a list column of strings
    assert con.sql("select count(*) from xid where list_contains(nvswitch_pci_bus_ids, '0000:05:00')"
                   ).fetchall() == [(1,)]

    from xidstream.exporters.parquet import lake_dataset
    table = lake_dataset(tmp_path, "gpu.xid").to_table().sort_by("ts").to_pylist()
    assert [r["nvswitch_pci_bus_ids"] for r in table] == [None, ["0000:06:00", "0000:05:00"]]


# -- 11: partitions by the bounded time -------------------------------------------------------------

def test_a_skewed_live_xid_is_filed_at_its_reading_and_keeps_its_own_ts(tmp_path):
    seen = datetime(2026, 11, 28, 3, 20, tzinfo=timezone.utc)
    records = {
        "ahead": _xid(seen + timedelta(hours=6), 1, observed_at=seen),  # a `dmesg -T` line 6 h ahead
        "epoch": _xid(datetime(1970, 1, 1, tzinfo=timezone.utc), 2, observed_at=seen),
        "future": _xid(datetime(2099, 1, 1, tzinfo=timezone.utc), 3, observed_at=seen),
        "within": _xid(seen - timedelta(seconds=290), 4, observed_at=seen),  # inside the bound: its own ts
        "backfilled": _xid(seen - timedelta(days=2), 5, observed_at=seen, backfilled=True),  # history, not live
        "unobserved": _xid(seen + timedelta(hours=6), 6),  # an older collector: nothing to bound by
    }
    lander = ParquetLander(tmp_path)
    for r in records.values():
        lander.add("gpu.xid", r)
    lander.flush()
    table = ds.dataset(tmp_path / "topic=gpu.xid", format="parquet", partitioning="hive").to_table().to_pylist()
    where = {r["message"]: (r["dt"], r["hour"], r["ts"]) for r in table}
    filed = {name: where[rec.message] for name, rec in records.items()}
    assert filed == {
        "ahead": ("2026-11-28", 3, seen + timedelta(hours=6)),
        "epoch": ("2026-11-28", 3, datetime(1970, 1, 1, tzinfo=timezone.utc)),
        "future": ("2026-11-28", 3, datetime(2099, 1, 1, tzinfo=timezone.utc)),
        "within": ("2026-11-28", 3, seen - timedelta(seconds=290)),
        "backfilled": ("2026-11-26", 3, seen - timedelta(days=2)),
        "unobserved": ("2026-11-28", 9, seen + timedelta(hours=6)),
    }
    assert not list(tmp_path.glob("topic=gpu.xid/dt=1970-*")) and not list(tmp_path.glob("topic=gpu.xid/dt=2099-*"))


def test_the_landing_skew_bound_is_the_processors():
    from xidstream.exporters.parquet import MAX_CLOCK_SKEW_S
    from xidstream.streams.policy import Policy
    assert MAX_CLOCK_SKEW_S == Policy().max_clock_skew_s


# -- 10: streaming row groups, bounded open files, compaction ----------------------------------------

def _samples(n: int, start: datetime, step=timedelta(seconds=1)):
    for i in range(n):
        yield GpuSample(ts=start + i * step, node="node-a", gpu_uuid=UUID1, gpu_index=1, pci_bus_id="0000:01:00",
                        utilization_gpu_pct=float(i % 100), power_w=100.0 + i % 7)


def _visible(root: Path) -> int:
    files = list(root.glob("topic=*/dt=*/hour=*/*.parquet"))
    return duckdb.sql(f"select count(*) from read_parquet({[str(p) for p in files]})").fetchall()[0][0] if files else 0


def test_rows_are_written_as_row_groups_before_the_roll_and_published_only_by_flush(tmp_path):
    start = D.replace(hour=3)
    lander = ParquetLander(tmp_path, row_group_rows=500, batch_rows=100)
    for i, s in enumerate(_samples(2050, start)):
        lander.add("gpu.samples", s, partition=0, offset=i)
    temps = list(tmp_path.glob("topic=gpu.samples/dt=*/hour=*/.*.parquet.tmp"))
    assert len(temps) == 1 and temps[0].stat().st_size > 0  # 4 row groups already on disk
    assert _visible(tmp_path) == 0 and lander.rows_buffered == 2050  # nothing a reader can see yet
    files = lander.flush()
    assert [f.rows for f in files] == [2050] and not list(tmp_path.rglob(".*.tmp"))
    meta = pq.ParquetFile(files[0].path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [500, 500, 500, 500, 50]
    assert _visible(tmp_path) == 2050 and lander.rows_written == 2050 and lander.files_written == 1


def test_python_memory_does_not_grow_with_the_rows_until_the_roll(tmp_path):
    # rows used to be held as dicts until flush(): ~2 KB of Python objects per sample
    lander = ParquetLander(tmp_path, row_group_rows=2048, batch_rows=512)
    samples = list(_samples(6000, D.replace(hour=3), step=timedelta(milliseconds=100)))
    tracemalloc.start()
    try:
        for s in samples:
            lander.add("gpu.samples", s)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20, f"{peak / 2**20:.1f} MiB of Python objects held for 6,000 rows"
    assert sum(f.rows for f in lander.flush()) == 6000


def test_open_files_are_bounded_the_least_recently_used_is_published_first(tmp_path):
    lander = ParquetLander(tmp_path, max_open=2, batch_rows=10)
    hours = [D.replace(hour=h) for h in (1, 2, 3, 4, 5)]  # a backfill: five partitions, rows interleaved
    n = 0
    for _ in range(6):
        for h in hours:
            lander.add("gpu.samples", next(_samples(1, h + timedelta(seconds=n))), offset=n)
            n += 1
            assert len(list(tmp_path.rglob(".*.parquet.tmp"))) <= 2
    early = _visible(tmp_path)
    assert 0 < early < n  # published before the roll: complete files, offsets not yet committed
    files = lander.flush()
    assert sum(f.rows for f in files) == n == _visible(tmp_path) == lander.rows_written
    assert lander.files_written == len(files) and not list(tmp_path.rglob(".*.tmp"))
    offsets = duckdb.sql(f"select count(distinct _kafka_offset) from '{tmp_path}/topic=*/*/*/*.parquet'").fetchall()
    assert offsets == [(n,)]


def test_compaction_merges_a_partitions_files_into_one_with_every_row(tmp_path):
    from xidstream.exporters.parquet import compact, compact_lake
    folder = tmp_path / "topic=gpu.xid" / "dt=2026-11-28" / "hour=23"
    _old_release_file(folder, [_old_row(D, 0)])
    lander = ParquetLander(tmp_path)
    _inventory(lander, D)
    for roll in range(3):  # three rolls: three files in the one partition
        for i in range(1, 101):
            n = roll * 1000 + i
            lander.add("gpu.xid", _xid(D + timedelta(seconds=i), n, observed_at=D), offset=n)
        lander.flush()
    assert len(list(folder.glob("*.parquet"))) == 4
    _, before = _shipped(tmp_path)

    # the hour is not 2 hours past yet: left alone
    assert compact_lake(tmp_path, now=D.replace(minute=0) + timedelta(hours=2, minutes=59)) == []
    merged = compact_lake(tmp_path, now=D.replace(minute=0) + timedelta(hours=3))
    assert [(m.path.parent, m.rows) for m in merged] == [(folder, 301)]
    assert [p.name for p in folder.iterdir()] == [merged[0].path.name]  # inputs gone, no temp left
    con, after = _shipped(tmp_path)
    assert after == before == [(D.date(), "NVIDIA H100 80GB HBM3", 79, 301)]
    assert con.sql("select count(*), count(observed_at) from xid").fetchall() == [(301, 300)]
    assert compact(folder) is None  # one file: nothing to merge


def test_after_a_failed_write_no_flush_returns(tmp_path, monkeypatch):
    # Streamed rows are gone from memory once written: a failed write cannot be retried, so the
    # lander must never again say "durable" (the caller would commit offsets of rows it lost).
    import xidstream.exporters.parquet as parquet
    lander = ParquetLander(tmp_path)
    for s in _samples(10, D):
        lander.add("gpu.samples", s)
    real = parquet.os.fsync

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(parquet.os, "fsync", full)
    with pytest.raises(OSError):
        lander.flush()
    monkeypatch.setattr(parquet.os, "fsync", real)
    with pytest.raises(RuntimeError, match="earlier Parquet write failed"):
        lander.flush()
    with pytest.raises(RuntimeError, match="restart"):
        lander.add("gpu.samples", next(_samples(1, D)))


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside <...> and [...]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"<": 1, "[": 1, ">": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()] if cur.strip() else out


def test_the_column_table_in_the_docs_lists_every_landed_column():
    from xidstream.exporters.parquet import FINDINGS_SCHEMA, LANDED_MODELS
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    documented = {}
    for tables, cols in re.findall(r"^\| ((?:gpu|findings)\.[^|]*?) \| (.*) \|$", text, re.M):
        names = []
        for item in _split_top(re.sub(r"\([^)]*\)", "", cols)):
            names += [part.split()[0] for part in item.split(" / ")]
        for table in tables.split(" / "):
            documented[table] = names
    for table, model in LANDED_MODELS.items():
        assert documented.get(table) == arrow_schema(model).names[:-2], table  # less the two _kafka_ columns
    assert documented["findings.ocsf"] == FINDINGS_SCHEMA.names[:-2]
