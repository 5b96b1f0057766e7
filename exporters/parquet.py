"""Typed Parquet landing of the raw telemetry topics (and the exported findings) for the data lake.

Layout (Hive partitioning, read by DuckDB, Spark, Athena, pyarrow.dataset):

    DIR/topic=gpu.samples/dt=2026-11-28/hour=3/part-20261128T030001-<id>.parquet

`hour` is written without a leading zero: a reader that infers partition types from the folder
names (DuckDB does) read `hour=00`..`hour=09` as text and `hour=10`..`hour=23` as a number, so a
view's type changed during the day. Readers should still name the types (`HIVE_TYPES_SQL`,
`partitioning()`, `lake_dataset`): lakes landed by earlier releases hold `hour=03`.

`dt` and `hour` come from the record's own time (UTC), not from when it was landed, bounded the way
the processor bounds it (`partition_time`): a live Xid record stamped more than the skew bound from
when its collector read it lands at the reading. The `ts` column is always the record's own.

Each table's schema is derived from the topic's pydantic model (`arrow_schema`), plus where the row
came from (`_kafka_partition`, `_kafka_offset`; null for standard input). A newer release may add
columns: read the lake by column name (`union_by_name = true`, or `lake_dataset`), older files give
nulls.

Files are rolled by input size and by age: `ParquetLander.should_roll()` says when, `flush()`
publishes every open file. Rows are not held until then: each partition folder has an open file to
which row groups are written as rows arrive, so memory is bounded by the row group and buffer sizes,
not by the roll size. A file is written under a temporary dot-name, fsynced, renamed into place and
its folder fsynced, so a reader never sees a half-written file (dot-files are skipped by
pyarrow.dataset and by `*.parquet` globs). The caller commits its Kafka offsets only after `flush()`
returned: at-least-once. `compact()` merges a partition's files into one
(`python -m xidstream.exporters.parquet compact DIR`, for the hours that are over).
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import time
import types
import typing
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from xidstream.schemas.base import Record
from xidstream.schemas.models import GpuCounters, GpuInventory, GpuProcesses, GpuSample, WorkloadEvent, XidEvent

__all__ = ["TELEMETRY_TOPICS", "LANDED_MODELS", "FINDINGS_SCHEMA", "arrow_schema", "schema_for_topic",
           "ParquetLander", "LandedFile", "MAX_CLOCK_SKEW_S", "partition_time", "HIVE_TYPES_SQL", "partitioning",
           "lake_dataset", "compact", "compact_lake"]

# the raw telemetry topics the lake gets, and gpu.inventory (small, compacted) to join GPU models on
TELEMETRY_TOPICS = ("gpu.samples", "gpu.xid", "gpu.processes", "gpu.workloads", "gpu.counters")
LANDED_MODELS: dict[str, type[Record]] = {
    "gpu.samples": GpuSample,
    "gpu.xid": XidEvent,
    "gpu.processes": GpuProcesses,
    "gpu.workloads": WorkloadEvent,
    "gpu.counters": GpuCounters,
    "gpu.inventory": GpuInventory,
}
_KAFKA_FIELDS = [pa.field("_kafka_partition", pa.int32()), pa.field("_kafka_offset", pa.int64())]

# exported findings (OCSF or ECS documents) as one table per format: the document as JSON text plus
# the columns one filters on
FINDINGS_SCHEMA = pa.schema([
    pa.field("event_id", pa.string(), nullable=False),
    pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("node", pa.string()),
    pa.field("source_schema", pa.string()),
    pa.field("incident_id", pa.string()),
    pa.field("class_uid", pa.int32()),
    pa.field("document", pa.string(), nullable=False),
    *_KAFKA_FIELDS,
])


def _arrow_type(annotation: Any) -> tuple[pa.DataType, bool]:  # noqa: C901
    """(arrow type, nullable) of a pydantic field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner, _ = _arrow_type(args[0]) if len(args) == 1 else (pa.string(), True)
        return inner, True
    if origin is typing.Annotated:
        return _arrow_type(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return pa.string(), False
    if origin is list:
        inner, _ = _arrow_type(typing.get_args(annotation)[0])
        return pa.list_(inner), False
    if isinstance(annotation, type):
        if issubclass(annotation, bool):
            return pa.bool_(), False
        if issubclass(annotation, enum.Enum) or issubclass(annotation, str):
            return pa.string(), False
        if issubclass(annotation, int):
            return pa.int64(), False
        if issubclass(annotation, float):
            return pa.float64(), False
        if issubclass(annotation, datetime):
            return pa.timestamp("us", tz="UTC"), False
        if issubclass(annotation, bytes):
            return pa.binary(), False
        if issubclass(annotation, BaseModel):
            return pa.struct([_field(n, f) for n, f in annotation.model_fields.items()]), False
    raise TypeError(f"no Arrow type for {annotation!r}")


def _field(name: str, info: Any) -> pa.Field:
    typ, nullable = _arrow_type(info.annotation)
    out_name = info.alias or name
    # every column nullable: a record decoded from an older schema version may lack newer fields
    return pa.field(out_name, typ, nullable=True)


def arrow_schema(model: type[Record]) -> pa.Schema:
    """The Arrow schema of a contract model: one column per field (the `schema` alias kept), in order."""
    return pa.schema([_field(n, f) for n, f in model.model_fields.items()] + _KAFKA_FIELDS)


_SCHEMAS: dict[str, pa.Schema] = {topic: arrow_schema(m) for topic, m in LANDED_MODELS.items()}


def schema_for_topic(table: str) -> pa.Schema:
    if table.startswith("findings."):
        return FINDINGS_SCHEMA
    return _SCHEMAS[table]


def _has_enum(annotation: Any) -> bool:
    if isinstance(annotation, type):
        return issubclass(annotation, enum.Enum)
    return any(_has_enum(a) for a in typing.get_args(annotation))


_ENUM_COLUMNS: dict[type, tuple[str, ...]] = {}


def _row(record: Record) -> dict[str, Any]:
    row = record.model_dump(by_alias=True)
    cls = type(record)
    columns = _ENUM_COLUMNS.get(cls)
    if columns is None:  # once per model: checking every value of every row was half the landing time
        columns = _ENUM_COLUMNS[cls] = tuple(f.alias or n for n, f in cls.model_fields.items()
                                             if _has_enum(f.annotation))
    for k in columns:
        v = row[k]
        if isinstance(v, enum.Enum):
            row[k] = v.value
        elif isinstance(v, list) and v and isinstance(v[0], enum.Enum):
            row[k] = [x.value for x in v]
    return row


# The processor's bound on a record's stamp (streams.policy.Policy.max_clock_skew_s; a test keeps
# the two equal): the exporter has no policy file, and exporters do not import streams.
MAX_CLOCK_SKEW_S = 300.0

# The partition columns' types, for readers that would otherwise guess them from the folder names
# (DuckDB: `hive_types = ...`; pyarrow: `partitioning()`). Guessing gives text for lakes written
# with `hour=03`, and pyarrow guesses `dt` as text.
HIVE_TYPES_SQL = "{'dt': DATE, 'hour': INTEGER}"
_PARTITION_FIELDS = [pa.field("dt", pa.date32()), pa.field("hour", pa.int32())]


def partitioning():
    """The lake's Hive partitioning for pyarrow.dataset, with `dt` a date and `hour` an int32.
    (pyarrow.dataset is imported here, not by the lander: the exporter does not need it.)"""
    import pyarrow.dataset as ds

    return ds.partitioning(pa.schema(_PARTITION_FIELDS), flavor="hive")


def partition_time(record: Record, max_skew_s: float = MAX_CLOCK_SKEW_S) -> datetime:
    """The time a record is filed under: its `ts`, except that a live record (`observed_at` set, not
    backfilled) stamped more than `max_skew_s` from when its collector read it is filed at the
    reading, as the processor takes it (streams.evidence.event_time). A `dmesg -T` line stamped
    hours ahead, or a node clock at 1970, would otherwise land rows in partitions no query of the
    incident's hours reads, and make folders for years nobody asks about."""
    # asked of the class first: a pydantic model's missing attribute costs an exception each time
    if "observed_at" not in type(record).model_fields:
        return record.ts
    observed = record.observed_at  # type: ignore[attr-defined]
    if observed is None or getattr(record, "backfilled", False):
        return record.ts
    if abs((record.ts - observed).total_seconds()) > max_skew_s:
        return observed
    return record.ts


def lake_dataset(root: str | Path, table: str):
    """One table of the lake as a pyarrow dataset with this release's columns and typed partitions.
    Files an older release wrote (fewer columns) read as nulls in the newer columns; without the
    schema, pyarrow takes the first file's and silently drops the columns it lacks."""
    import pyarrow.dataset as ds

    schema = pa.schema([*schema_for_topic(table), *_PARTITION_FIELDS])
    return ds.dataset(Path(root) / f"topic={table}", format="parquet", partitioning=partitioning(), schema=schema)


@dataclass(frozen=True)
class LandedFile:
    path: Path
    table: str
    rows: int
    bytes: int


class _OpenFile:
    """One partition folder's file while it is written: rows not yet converted (dicts), record
    batches not yet written, and, once its first row group is written, the temporary file."""

    __slots__ = ("table", "folder", "schema", "rows", "batches", "batch_rows", "batch_bytes", "written",
                 "name", "tmp", "file", "writer")

    def __init__(self, table: str, folder: Path):
        self.table = table
        self.folder = folder
        self.schema = schema_for_topic(table)
        self.rows: list[dict[str, Any]] = []
        self.batches: list[pa.RecordBatch] = []
        self.batch_rows = 0
        self.batch_bytes = 0
        self.written = 0
        self.name = ""
        self.tmp: Path | None = None
        self.file: IO[bytes] | None = None
        self.writer: pq.ParquetWriter | None = None


def _new_name() -> str:
    return f"part-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}.parquet"


def _publish_file(f: IO[bytes], tmp: Path, final: Path) -> int:
    """fsync the written temporary file and rename it into place; its size. The folder is fsynced
    by the caller (once for all the files of a flush)."""
    f.flush()
    os.fsync(f.fileno())
    f.close()
    size = tmp.stat().st_size
    os.replace(tmp, final)
    return size


class ParquetLander:
    """Lands rows per (table, dt, hour) partition as row groups of an open temporary file, and
    publishes the files (atomically, durably) on `flush()`.

    Memory is bounded whatever the roll size: rows are converted to Arrow every `batch_rows` rows
    (all open partitions together), a partition's batches are written as a row group once they
    hold `row_group_rows` rows, and when all partitions' batches pass `buffer_bytes` the largest is
    written early. At most `max_open` files are open: a new partition beyond that (a backfill
    spanning days) first publishes the least recently used one. A file published that way before
    `flush()` is complete and durable, but its rows' offsets are committed only after the next
    `flush()`, like the rest (a crash lands them again: de-duplicate on `event_id`). A failed write
    (disk full) makes every later `add` and `flush` raise: the rows since the last flush cannot all
    be landed any more, and their offsets must not be committed."""

    def __init__(self, root: str | Path, *, max_bytes: int = 64 << 20, max_seconds: float = 300.0,
                 compression: str = "zstd", clock=time.monotonic, max_clock_skew_s: float = MAX_CLOCK_SKEW_S,
                 max_open: int = 64, row_group_rows: int = 128 * 1024, buffer_bytes: int = 64 << 20,
                 batch_rows: int = 4096):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.compression = compression
        self.max_clock_skew_s = max_clock_skew_s
        self.max_open = max(1, max_open)
        self.row_group_rows = max(1, row_group_rows)
        self.buffer_bytes = buffer_bytes
        self.batch_rows = max(1, batch_rows)
        self._clock = clock
        self._open: OrderedDict[tuple[str, str, str], _OpenFile] = OrderedDict()
        self._unconverted = 0  # dict rows over all open files
        self._arrow_bytes = 0  # record batches not yet written, over all open files
        self._published: list[LandedFile] = []
        self._dirs: set[Path] = set()
        self._bytes = 0
        self._since: float | None = None
        self._failed: BaseException | None = None
        self.rows_buffered = 0
        self.files_written = 0
        self.rows_written = 0
        # a file is open at most until the next roll: a temp file older than twice that is a crashed
        # writer's, even when another exporter writes into the same folders
        self._clean_stale_temps(max(600.0, 2 * max_seconds))

    def _clean_stale_temps(self, older_than: float = 600.0) -> None:
        """Temp files a crashed writer left behind (never visible to readers); only old ones, in
        case another exporter is writing into the same folder right now."""
        now = time.time()
        for tmp in self.root.glob("topic=*/dt=*/hour=*/.*.parquet.tmp"):
            try:
                if now - tmp.stat().st_mtime > older_than:
                    tmp.unlink()
            except OSError:
                pass

    def _check(self) -> None:
        # Rows already handed over may be lost with a failed write (a file half written, a writer
        # closed): no later flush() may return, or the caller would commit their offsets.
        if self._failed is not None:
            raise RuntimeError(f"an earlier Parquet write failed ({self._failed!r}): rows since the last flush() "
                               "may not be landed; restart (records not committed are read again)")

    def _add_row(self, table: str, when: datetime, row: dict[str, Any], size: int) -> None:
        self._check()
        when = when.astimezone(timezone.utc)
        # hour without a leading zero: readers that infer types from folder names see a number always
        key = (table, when.date().isoformat(), str(when.hour))
        try:
            part = self._open.get(key)
            if part is None:
                if len(self._open) >= self.max_open:
                    self._publish(self._open.popitem(last=False)[1])
                folder = self.root / f"topic={table}" / f"dt={key[1]}" / f"hour={key[2]}"
                part = self._open[key] = _OpenFile(table, folder)
            elif len(self._open) > 1:
                self._open.move_to_end(key)
            part.rows.append(row)
            self._unconverted += 1
            self._bytes += size
            self.rows_buffered += 1
            if self._since is None:
                self._since = self._clock()
            if self._unconverted >= self.batch_rows:
                for p in list(self._open.values()):
                    if p.rows:
                        self._convert(p)
                while self._arrow_bytes > self.buffer_bytes:
                    self._write_row_group(max(self._open.values(), key=lambda p: p.batch_bytes))
        except BaseException as exc:
            self._failed = exc
            raise

    def _convert(self, part: _OpenFile) -> None:
        batch = pa.RecordBatch.from_pylist(part.rows, schema=part.schema)
        self._unconverted -= len(part.rows)
        part.rows = []
        part.batches.append(batch)
        part.batch_rows += batch.num_rows
        part.batch_bytes += batch.nbytes
        self._arrow_bytes += batch.nbytes
        if part.batch_rows >= self.row_group_rows:
            self._write_row_group(part)

    def _write_row_group(self, part: _OpenFile) -> None:
        if not part.batches:
            return
        if part.writer is None:
            part.folder.mkdir(parents=True, exist_ok=True)
            part.name = _new_name()
            part.tmp = part.folder / f".{part.name}.tmp"
            part.file = open(part.tmp, "wb")
            part.writer = pq.ParquetWriter(part.file, part.schema, compression=self.compression)
        table = pa.Table.from_batches(part.batches, schema=part.schema)
        part.writer.write_table(table, row_group_size=table.num_rows)
        self._arrow_bytes -= part.batch_bytes
        part.written += table.num_rows
        part.batches, part.batch_rows, part.batch_bytes = [], 0, 0

    def _publish(self, part: _OpenFile) -> None:
        if part.rows:
            self._convert(part)
        self._write_row_group(part)
        if part.writer is None:
            return
        part.writer.close()
        final = part.folder / part.name
        size = _publish_file(part.file, part.tmp, final)
        self._dirs.add(part.folder)
        self._published.append(LandedFile(final, part.table, part.written, size))
        self.files_written += 1
        self.rows_written += part.written

    def add(self, table: str, record: Record, *, partition: int | None = None, offset: int | None = None,
            size: int = 256) -> None:
        """Land one telemetry record (`table` is its base topic name, e.g. ``gpu.samples``)."""
        if table not in _SCHEMAS:
            raise ValueError(f"{table} is not a landed table ({', '.join(_SCHEMAS)})")
        row = _row(record)
        row["_kafka_partition"] = partition
        row["_kafka_offset"] = offset
        self._add_row(table, partition_time(record, self.max_clock_skew_s), row, size)

    def add_finding(self, table: str, record: Record, document: str, *, class_uid: int | None = None,
                    partition: int | None = None, offset: int | None = None) -> None:
        """Land one exported finding (`table` e.g. ``findings.ocsf``) with its source record."""
        row = {"event_id": record.event_id, "ts": record.ts, "node": record.node, "source_schema": record.SCHEMA,
               "incident_id": getattr(record, "incident_id", None), "class_uid": class_uid, "document": document,
               "_kafka_partition": partition, "_kafka_offset": offset}
        self._add_row(table, partition_time(record, self.max_clock_skew_s), row, len(document))

    def should_roll(self) -> bool:
        if not self.rows_buffered:
            return False
        return self._bytes >= self.max_bytes or (self._clock() - (self._since or 0)) >= self.max_seconds

    def flush(self) -> list[LandedFile]:
        """Publish every open file; all files published since the last flush are durable (data and
        renames) when this returns, and are returned. After a failed write it raises, every time."""
        self._check()
        try:
            for key in sorted(self._open):
                self._publish(self._open[key])
            self._open.clear()
            folders = set()
            for d in self._dirs:  # the renames themselves are durable once their folders are fsynced
                folders.update((d, d.parent, d.parent.parent))
            for d in sorted(folders):
                _fsync_dir(d)
        except BaseException as exc:
            self._failed = exc
            raise
        out, self._published, self._dirs = self._published, [], set()
        self._bytes = 0
        self._since = None
        self.rows_buffered = 0
        return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- compaction -----------------------------------------------------------------------------------

def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """`batch` with `schema`'s columns in its order: a column an older file lacks is null."""
    names = batch.schema.names
    cols = [batch.column(f.name).cast(f.type) if f.name in names else pa.nulls(batch.num_rows, f.type)
            for f in schema]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def compact(folder: str | Path, *, row_group_rows: int = 128 * 1024, compression: str = "zstd",
            min_files: int = 2) -> LandedFile | None:
    """Merge the published files of one partition folder into one file (read and written a batch
    at a time: bounded memory), then delete them. None when it holds fewer than `min_files`.

    The merged file is written under a temporary dot-name, fsynced and renamed in before the inputs
    are removed, so no row is ever missing from the folder; until the removal (and after a crash
    between the two) the rows are there twice, as after an at-least-once re-delivery: readers
    de-duplicate on `event_id`. A query that listed the folder before the removal may fail to open
    a removed file; run it again. Files landed meanwhile are not touched (only those listed at the
    start are merged). The columns are this release's, plus any only older files have."""
    folder = Path(folder)
    inputs = sorted(folder.glob("[!.]*.parquet"))
    if len(inputs) < max(min_files, 1):
        return None
    table = folder.parent.parent.name.removeprefix("topic=")
    files = [pq.ParquetFile(p) for p in inputs]
    known = [schema_for_topic(table)] if table in _SCHEMAS or table.startswith("findings.") else []
    schema = pa.unify_schemas([*known, *(f.schema_arrow for f in files)])
    name = _new_name()
    tmp = folder / f".{name}.tmp"
    rows = 0
    with open(tmp, "wb") as out:
        writer = pq.ParquetWriter(out, schema, compression=compression)
        pending: list[pa.RecordBatch] = []
        held = 0
        for pf in files:
            for batch in pf.iter_batches(batch_size=min(row_group_rows, 64 * 1024)):
                pending.append(_conform(batch, schema))
                held += batch.num_rows
                if held >= row_group_rows:
                    writer.write_table(pa.Table.from_batches(pending, schema=schema), row_group_size=held)
                    rows += held
                    pending, held = [], 0
        if pending:
            writer.write_table(pa.Table.from_batches(pending, schema=schema), row_group_size=held)
            rows += held
        writer.close()
        size = _publish_file(out, tmp, folder / name)
    _fsync_dir(folder)
    for p in inputs:
        p.unlink()
    _fsync_dir(folder)
    return LandedFile(folder / name, table, rows, size)


def _partition_end(folder: Path) -> datetime | None:
    """The end of the hour a `dt=.../hour=...` folder holds (padded or not), or None."""
    try:
        day = datetime.strptime(folder.parent.name.removeprefix("dt="), "%Y-%m-%d").replace(tzinfo=timezone.utc)
        return day + timedelta(hours=int(folder.name.removeprefix("hour=")) + 1)
    except ValueError:
        return None


def compact_lake(root: str | Path, *, older_than: timedelta = timedelta(hours=2), now: datetime | None = None,
                 row_group_rows: int = 128 * 1024) -> list[LandedFile]:
    """`compact` every partition folder of the lake whose hour ended more than `older_than` ago
    (the current hours still get files at every roll)."""
    now = now or datetime.now(timezone.utc)
    out = []
    for folder in sorted(Path(root).glob("topic=*/dt=*/hour=*")):
        end = _partition_end(folder)
        if end is None or end > now - older_than or not folder.is_dir():
            continue
        merged = compact(folder, row_group_rows=row_group_rows)
        if merged is not None:
            out.append(merged)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xidstream.exporters.parquet",
                                 description="Maintenance of a lake landed by `xidstream export --to parquet:DIR`.")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compact", help="merge each partition's files into one")
    c.add_argument("root", help="the lake folder (DIR of --to parquet:DIR)")
    c.add_argument("--older-than-hours", type=float, default=2.0,
                   help="only partitions whose hour ended this long ago (default 2)")
    c.add_argument("--row-group-rows", type=int, default=128 * 1024)
    args = ap.parse_args(argv)
    for f in compact_lake(args.root, older_than=timedelta(hours=args.older_than_hours),
                          row_group_rows=args.row_group_rows):
        print(f"{f.path}: {f.rows:,} rows, {f.bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
