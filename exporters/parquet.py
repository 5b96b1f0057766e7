"""Typed Parquet landing of the raw telemetry topics (and the exported findings) for the data lake.

Layout (Hive partitioning, read by DuckDB, Spark, Athena, pyarrow.dataset):

    DIR/topic=gpu.samples/dt=2026-11-28/hour=03/part-20261128T030001-<id>.parquet

`dt` and `hour` come from the record's own `ts` (UTC), not from when it was landed.

Each table's schema is derived from the topic's pydantic model (`arrow_schema`), plus where the row
came from (`_kafka_partition`, `_kafka_offset`; null for standard input). Files are rolled by size
and by age: `ParquetLander.should_roll()` says when, `flush()` writes every buffered table. A file is
written under a temporary dot-name, fsynced, renamed into place and its folder fsynced, so a reader
never sees a half-written file (dot-files are skipped by pyarrow.dataset and by `*.parquet` globs).
The caller commits its Kafka offsets only after `flush()` returned: at-least-once.
"""

from __future__ import annotations

import enum
import os
import time
import types
import typing
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from schemas.base import Record
from schemas.models import GpuInventory, GpuProcesses, GpuSample, WorkloadEvent, XidEvent

__all__ = ["TELEMETRY_TOPICS", "LANDED_MODELS", "FINDINGS_SCHEMA", "arrow_schema", "schema_for_topic",
           "ParquetLander", "LandedFile"]

# the raw telemetry topics the lake gets, and gpu.inventory (small, compacted) to join GPU models on
TELEMETRY_TOPICS = ("gpu.samples", "gpu.xid", "gpu.processes", "gpu.workloads")
LANDED_MODELS: dict[str, type[Record]] = {
    "gpu.samples": GpuSample,
    "gpu.xid": XidEvent,
    "gpu.processes": GpuProcesses,
    "gpu.workloads": WorkloadEvent,
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


def _row(record: Record) -> dict[str, Any]:
    row = record.model_dump(by_alias=True)
    for k, v in row.items():
        if isinstance(v, enum.Enum):
            row[k] = v.value
        elif isinstance(v, list) and v and isinstance(v[0], enum.Enum):
            row[k] = [x.value for x in v]
    return row


@dataclass(frozen=True)
class LandedFile:
    path: Path
    table: str
    rows: int
    bytes: int


class ParquetLander:
    """Buffers rows per (table, dt, hour) and writes them as atomic Parquet files on `flush()`."""

    def __init__(self, root: str | Path, *, max_bytes: int = 64 << 20, max_seconds: float = 300.0,
                 compression: str = "zstd", clock=time.monotonic):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.compression = compression
        self._clock = clock
        self._buffers: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        self._bytes = 0
        self._since: float | None = None
        self.rows_buffered = 0
        self.files_written = 0
        self.rows_written = 0
        self._clean_stale_temps()

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

    def _add_row(self, table: str, ts: datetime, row: dict[str, Any], size: int) -> None:
        ts = ts.astimezone(timezone.utc)
        key = (table, ts.strftime("%Y-%m-%d"), ts.strftime("%H"))
        self._buffers.setdefault(key, []).append(row)
        self._bytes += size
        self.rows_buffered += 1
        if self._since is None:
            self._since = self._clock()

    def add(self, table: str, record: Record, *, partition: int | None = None, offset: int | None = None,
            size: int = 256) -> None:
        """Buffer one telemetry record (`table` is its base topic name, e.g. ``gpu.samples``)."""
        if table not in _SCHEMAS:
            raise ValueError(f"{table} is not a landed table ({', '.join(_SCHEMAS)})")
        row = _row(record)
        row["_kafka_partition"] = partition
        row["_kafka_offset"] = offset
        self._add_row(table, record.ts, row, size)

    def add_finding(self, table: str, record: Record, document: str, *, class_uid: int | None = None,
                    partition: int | None = None, offset: int | None = None) -> None:
        """Buffer one exported finding (`table` e.g. ``findings.ocsf``) with its source record."""
        row = {"event_id": record.event_id, "ts": record.ts, "node": record.node, "source_schema": record.SCHEMA,
               "incident_id": getattr(record, "incident_id", None), "class_uid": class_uid, "document": document,
               "_kafka_partition": partition, "_kafka_offset": offset}
        self._add_row(table, record.ts, row, len(document))

    def should_roll(self) -> bool:
        if not self._buffers:
            return False
        return self._bytes >= self.max_bytes or (self._clock() - (self._since or 0)) >= self.max_seconds

    def flush(self) -> list[LandedFile]:
        """Write every buffered table as one file per partition folder; durable when it returns."""
        out: list[LandedFile] = []
        dirs: set[Path] = set()
        for (table, dt, hour), rows in sorted(self._buffers.items()):
            folder = self.root / f"topic={table}" / f"dt={dt}" / f"hour={hour}"
            folder.mkdir(parents=True, exist_ok=True)
            arrow = pa.Table.from_pylist(rows, schema=schema_for_topic(table))
            name = f"part-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}.parquet"
            tmp = folder / f".{name}.tmp"
            with open(tmp, "wb") as f:
                pq.write_table(arrow, f, compression=self.compression)
                f.flush()
                os.fsync(f.fileno())
            size = tmp.stat().st_size
            os.replace(tmp, folder / name)
            dirs.add(folder)
            out.append(LandedFile(folder / name, table, len(rows), size))
        for d in dirs:  # the renames themselves are durable once their folders are fsynced
            _fsync_dir(d)
            _fsync_dir(d.parent)
            _fsync_dir(d.parent.parent)
        self._buffers.clear()
        self._bytes = 0
        self._since = None
        self.rows_buffered = 0
        self.files_written += len(out)
        self.rows_written += sum(f.rows for f in out)
        return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
