"""`xidstream export`: findings for the SIEM (OCSF or ECS), telemetry for the lake (Parquet).

    xidstream export --format ocsf --to kafka:xidstream.findings.ocsf   # consumer group, at-least-once
    xidstream export --format ecs --to jsonl:findings.ndjson
    xidstream export --to parquet:/lake                              # + gpu.samples/xid/processes/workloads/counters
    xidstream replay --json scenarios/motivating-incident.yaml | xidstream export --stdin --to jsonl:-
"""

from __future__ import annotations

import argparse
import signal
import sys

from xidstream.schemas.errors import ConfigError
from xidstream.cliargs import add_kafka_args
from xidstream.settings import Settings

__all__ = ["register"]


def _parse_to(value: str) -> tuple[str, str]:
    kind, sep, where = value.partition(":")
    if not sep or kind not in ("kafka", "jsonl", "parquet") or not where:
        raise ConfigError(f"--to {value!r}: expected kafka:TOPIC, jsonl:PATH (or jsonl:-) or parquet:DIR")
    return kind, where


def _export(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.exporters.parquet import ParquetLander
    from xidstream.exporters.pipeline import Exporter, JsonlSink, KafkaTopicSink, ParquetSink
    from xidstream.transport.acls import export_group

    kind, where = _parse_to(args.to)
    lander = None
    if kind == "kafka":
        sink = KafkaTopicSink(settings, where)
    elif kind == "jsonl":
        sink = JsonlSink(where)
    else:
        try:
            lander = ParquetLander(where, max_bytes=int(args.roll_mb * (1 << 20)), max_seconds=args.roll_seconds)
        except OSError as exc:
            raise ConfigError(f"--to parquet:{where}: {exc}") from None
        sink = ParquetSink(lander, args.format)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    exporter = Exporter(args.format, sink, lander=lander, progress=progress)
    if args.stdin:
        exporter.run_lines(sys.stdin.buffer)
        return 0
    stop = {"now": False}

    def _stop(signum, frame):  # finish the batch, flush, commit, leave
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # the exporter role's ACLs grant exactly the groups under this name's prefix
    group = args.group or export_group(settings.topic_prefix, args.format, kind)
    print(f"export: group {group}, {args.format} -> {args.to}" + (" (+ telemetry as Parquet)" if lander else ""),
          file=sys.stderr, flush=True)
    exporter.run_kafka(settings, group, telemetry=lander is not None, idle_exit=args.idle_exit,
                       max_records=args.max_records, should_stop=lambda: stop["now"])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="findings as OCSF or ECS for a SIEM; raw telemetry as Parquet for a data lake")
    p.add_argument("--format", choices=["ocsf", "ecs"], default="ocsf", help="document format (default ocsf)")
    p.add_argument("--to", required=True, metavar="SINK",
                   help="kafka:TOPIC (e.g. xidstream.findings.ocsf, what the exporter role may write), jsonl:PATH or jsonl:- (stdout), or parquet:DIR "
                        "(also lands gpu.samples, gpu.xid, gpu.processes, gpu.workloads, gpu.counters, gpu.inventory)")
    p.add_argument("--stdin", action="store_true", help="read {topic,key,value} JSON lines (xidstream replay --json); no Kafka")
    p.add_argument("--group", help="consumer group (default: xidstream-export-FORMAT-KIND under the topic prefix)")
    p.add_argument("--roll-mb", type=float, default=256.0, help="parquet: roll files at this much buffered input (default 256: zstd makes that tens of MB of Parquet; memory does not grow with it)")
    p.add_argument("--roll-seconds", type=float, default=300.0, help="parquet: roll files at least this often (default 300)")
    p.add_argument("--idle-exit", type=float, default=None, metavar="S", help="stop after S seconds without a record")
    p.add_argument("--max-records", type=int, default=None, help="stop after this many records")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    add_kafka_args(p, partitions=False)
    p.set_defaults(handler=_export)
