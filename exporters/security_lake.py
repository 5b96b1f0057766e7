"""The landed OCSF findings as one Parquet table per OCSF class, in Amazon Security Lake's custom
source layout (one custom source per OCSF class), for upload to its S3 bucket:

    OUT/ext/<source>-<class>/region=<region>/accountId=<account>/eventDay=<YYYYMMDD>/part-*.parquet

e.g. `ext/xidstream-detection-finding/...`: register three custom sources (Detection Finding,
Incident Finding, Remediation Activity) under those names.

`xidstream export --format ocsf --to parquet:LAKE` lands every OCSF event as one JSON document per
row in the table `findings.ocsf` (its class in `class_uid`); Security Lake wants one table per class
with the OCSF attributes as columns. This reads that table, keeps each class's events apart, and
writes the documents as typed columns. OCSF's `json_t` attributes (`data`, `unmapped`) are kept as
JSON text: their shape changes from event to event, and a column whose type depends on the rows
present would change type between files. A table's columns are the union of every event's
attributes (an attribute the first event lacks is still a column), not the first event's.

    python -m xidstream.exporters.security_lake LAKE OUT --region us-east-1 --account 123456789012

Run it on a closed day (the exporter may still be landing today's files); each run writes new
files, so give it a fresh OUT or remove what it wrote before.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from xidstream.exporters.ocsf import class_name_of

__all__ = ["split_by_class", "source_name", "main"]

_JSON_ATTRS = ("data", "unmapped")


def _json_text(obj: Any) -> Any:
    """`obj` with every OCSF json_t attribute as JSON text, at any depth."""
    if isinstance(obj, dict):
        return {k: (orjson.dumps(v).decode() if k in _JSON_ATTRS else _json_text(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_text(v) for v in obj]
    return obj


def source_name(source: str, class_uid: int) -> str:
    """The custom source of a class: e.g. ``xidstream-detection-finding``."""
    return f"{source}-{class_name_of(class_uid).replace('_', '-')}"


def _union_schema(events: list[dict]) -> pa.Schema:
    """Every attribute any event has (pyarrow infers a table's columns from its first row alone:
    a Remediation Activity day that starts with a result lost its commands' `remediation`)."""
    seen: dict[str, pa.Schema] = {}
    for e in events:
        schema = pa.Table.from_pylist([e]).schema
        seen.setdefault(schema.to_string(), schema)
    return pa.unify_schemas(list(seen.values()), promote_options="permissive")


def split_by_class(lake: str | Path, out: str | Path, *, source: str = "xidstream", region: str = "us-east-1",
                   account: str = "000000000000", day: str | None = None) -> dict[int, int]:
    """Write the lake's OCSF findings (of `day`, YYYY-MM-DD, or every day) as one table per class;
    return the number of events written per class_uid."""
    import pyarrow.dataset as ds

    folder = Path(lake) / "topic=findings.ocsf"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no OCSF findings landed here (xidstream export --format ocsf "
                                f"--to parquet:{lake})")
    table = ds.dataset(folder, format="parquet", partitioning="hive").to_table(columns=["class_uid", "document"])
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for class_uid, text in zip(table.column("class_uid").to_pylist(), table.column("document").to_pylist()):
        event = orjson.loads(text)
        when = datetime.fromtimestamp(event["time"] / 1000, timezone.utc)
        if day is not None and when.strftime("%Y-%m-%d") != day:
            continue
        groups[(class_uid, when.strftime("%Y%m%d"))].append(_json_text(event))
    counts: dict[int, int] = defaultdict(int)
    for (class_uid, event_day), events in sorted(groups.items()):
        dest = (Path(out) / "ext" / source_name(source, class_uid) / f"region={region}"
                / f"accountId={account}" / f"eventDay={event_day}")
        dest.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(events, schema=_union_schema(events)),
                       dest / f"part-{uuid.uuid4().hex[:12]}.parquet", compression="zstd")
        counts[class_uid] += len(events)
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xidstream.exporters.security_lake", description=__doc__.split("\n\n")[0])
    ap.add_argument("lake", help="the folder `xidstream export --to parquet:` lands into")
    ap.add_argument("out", help="where to write the per-class tables (then upload to the Security Lake bucket)")
    ap.add_argument("--source", default="xidstream", help="the custom source's name (default xidstream)")
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--account", default="000000000000", help="the AWS account id of the source")
    ap.add_argument("--day", help="only this day, YYYY-MM-DD (default every day landed)")
    args = ap.parse_args(argv)
    try:
        counts = split_by_class(args.lake, args.out, source=args.source, region=args.region, account=args.account,
                                day=args.day)
    except FileNotFoundError as exc:
        print(f"security_lake: {exc}", file=sys.stderr)
        return 2
    for class_uid, n in sorted(counts.items()):
        print(f"{source_name(args.source, class_uid)} ({class_uid}): {n:,} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
