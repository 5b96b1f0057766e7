"""The export loop: contract records in (Kafka consumer group or JSON lines), OCSF/ECS documents
and Parquet files out, offsets committed only after the output is durable (at-least-once).

A source record's `event_id` is the exported document's id (`metadata.uid` / `event.id`), so a
record delivered twice (after a crash between writing and committing) is recognisable downstream.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Protocol

import orjson

from exporters import ecs, ocsf
from exporters.parquet import TELEMETRY_TOPICS, ParquetLander
from schemas.base import Record
from schemas.codec import decode_any
from schemas.errors import ConfigError, DecodeError
from schemas.models import Alert, RemediationCommand, RemediationResult
from schemas.topics import spec_for_model
from transport.config import KafkaConfig

__all__ = ["FINDING_TOPICS", "ExportStats", "JsonlSink", "KafkaTopicSink", "ParquetSink", "Exporter", "map_record"]

FINDING_TOPICS = ("gpu.alerts", "gpu.remediation", "gpu.remediation.results")
_FINDING_TYPES = (Alert, RemediationCommand, RemediationResult)


def map_record(record: Record, fmt: str) -> dict[str, Any] | None:
    if fmt == "ocsf":
        return ocsf.to_ocsf(record)
    if fmt == "ecs":
        return ecs.to_ecs(record)
    raise ConfigError(f"unknown format {fmt!r} (ocsf or ecs)")


class Sink(Protocol):
    def write(self, record: Record, doc: dict[str, Any], key: bytes | None, partition: int | None,
              offset: int | None) -> None: ...
    def durable(self) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON document a line, to a file (appended, fsynced before each commit) or stdout."""

    def __init__(self, path: str):
        self._stdout = path == "-"
        self._f: IO[bytes] = sys.stdout.buffer if self._stdout else open(path, "ab")
        # fsync only makes a regular file durable; on a pipe, a terminal or /dev/stdout it fails
        # with EINVAL, and `jsonl:/dev/stdout` crashed on its first commit
        self._sync = not self._stdout and stat.S_ISREG(os.fstat(self._f.fileno()).st_mode)

    def write(self, record, doc, key, partition, offset) -> None:
        self._f.write(orjson.dumps(doc) + b"\n")

    def durable(self) -> None:
        self._f.flush()
        if self._sync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self.durable()
        if not self._stdout:
            self._f.close()


def _event_ms(record: Record) -> int:
    """The Kafka timestamp of an exported document: its event's time (consumers such as Splunk's
    Kafka connector take the record's timestamp as the event time), never ahead of now: Kafka 4
    refuses a record stamped more than `log.message.timestamp.after.max.ms` (1 h) ahead, and a
    node's clock may be."""
    return min(int(record.ts.timestamp() * 1000), int(time.time() * 1000))


class KafkaTopicSink:
    """To a Kafka topic, keyed as the source record was; `durable()` waits for every ack."""

    def __init__(self, config: KafkaConfig, topic: str):
        from confluent_kafka import Producer

        from transport.kafka import producer_config

        self.topic = topic
        self._producer = Producer(producer_config(config))
        self._errors: list[str] = []
        md = self._producer.list_topics(topic, timeout=15)
        t = md.topics.get(topic)
        if t is None or t.error is not None:
            raise ConfigError(f"output topic {topic} does not exist on {config.bootstrap} (create it first, e.g. "
                              f"kafka-topics.sh --create --topic {topic}; brokers normally refuse to auto-create)")

    def _ack(self, err, msg) -> None:
        if err is not None:
            self._errors.append(str(err))

    def write(self, record, doc, key, partition, offset) -> None:
        while True:
            try:
                self._producer.produce(self.topic, orjson.dumps(doc), key=key, on_delivery=self._ack,
                                       timestamp=_event_ms(record))
                break
            except BufferError:
                self._producer.poll(0.1)
        self._producer.poll(0)

    def durable(self) -> None:
        left = self._producer.flush(60)
        if left or self._errors:
            raise ConfigError(f"cannot write to Kafka topic {self.topic}: "
                              f"{self._errors[0] if self._errors else f'{left} record(s) not acknowledged in 60 s'}")

    def close(self) -> None:
        self.durable()


class ParquetSink:
    """Findings as a Parquet table `findings.<format>` beside the landed telemetry (same lander)."""

    def __init__(self, lander: ParquetLander, fmt: str):
        self.lander = lander
        self.table = f"findings.{fmt}"

    def write(self, record, doc, key, partition, offset) -> None:
        self.lander.add_finding(self.table, record, orjson.dumps(doc).decode(), class_uid=doc.get("class_uid"),
                                partition=partition, offset=offset)

    def durable(self) -> None:
        pass  # the lander's flush is the durable point

    def close(self) -> None:
        pass


@dataclass
class ExportStats:
    consumed: int = 0
    exported: int = 0
    landed: int = 0
    bad: int = 0
    files: int = 0
    commits: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        secs = max(time.monotonic() - self.started, 1e-9)
        return (f"export: {self.consumed:,} read ({self.consumed / secs:,.0f}/s), {self.exported:,} findings exported, "
                f"{self.landed:,} telemetry rows landed in {self.files:,} file(s), {self.bad:,} undecodable")


class Exporter:
    """Reads records, maps findings to `fmt`, writes them to `sink`; with a `lander`, also lands the
    raw telemetry topics as Parquet. Offsets (Kafka) are committed only after `sink.durable()` and,
    with a lander, only after its files are written: never ahead of the output."""

    def __init__(self, fmt: str, sink: Sink, *, lander: ParquetLander | None = None,
                 progress: Callable[[str], None] | None = None, progress_every: float = 5.0):
        if fmt not in ("ocsf", "ecs"):
            raise ConfigError(f"unknown format {fmt!r} (ocsf or ecs)")
        self.fmt = fmt
        self.sink = sink
        self.lander = lander
        self.stats = ExportStats()
        self._progress = progress
        self._progress_every = progress_every
        self._last_progress = time.monotonic()

    # -- one record -------------------------------------------------------------------------------
    def handle(self, raw: bytes, key: bytes | None = None, partition: int | None = None,
               offset: int | None = None) -> None:
        self.stats.consumed += 1
        try:
            record = decode_any(raw)
        except DecodeError as exc:
            self.stats.bad += 1
            if self.stats.bad <= 10:
                print(f"xidstream export: skipped an undecodable record (partition {partition}, offset {offset}): {exc}",
                      file=sys.stderr)
            return
        if isinstance(record, _FINDING_TYPES):
            doc = map_record(record, self.fmt)
            if doc is not None:
                self.sink.write(record, doc, key, partition, offset)
                self.stats.exported += 1
            return
        if self.lander is not None:
            table = spec_for_model(type(record)).name
            if table in TELEMETRY_TOPICS or table == "gpu.inventory":
                self.lander.add(table, record, partition=partition, offset=offset, size=len(raw))
                self.stats.landed += 1

    def _tick_progress(self, force: bool = False) -> None:
        if self._progress and (force or time.monotonic() - self._last_progress >= self._progress_every):
            self._last_progress = time.monotonic()
            self._progress(self.stats.line())

    def make_durable(self) -> None:
        """Everything handled so far is on disk / acknowledged when this returns."""
        self.sink.durable()
        if self.lander is not None and self.lander.rows_buffered:
            self.stats.files += len(self.lander.flush())

    # -- standard input ---------------------------------------------------------------------------
    def run_lines(self, lines: Iterable[bytes]) -> ExportStats:
        """`{"topic","key","value"}` lines as `xidstream replay --json` writes them (a bare record
        line is accepted too)."""
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                self.stats.bad += 1
                print(f"xidstream export: line {n}: not JSON: {exc}", file=sys.stderr)
                continue
            if isinstance(obj, dict) and "value" in obj and "schema" not in obj:
                value = obj["value"]
                raw = value.encode() if isinstance(value, str) else orjson.dumps(value)
                key = obj.get("key")
                key_b = key.encode() if isinstance(key, str) else None
            else:
                raw, key_b = line, None
            self.handle(raw, key_b)
            if self.lander is not None and self.lander.should_roll():
                self.make_durable()
            self._tick_progress()
        self.make_durable()
        self.sink.close()
        self._tick_progress(force=True)
        return self.stats

    # -- Kafka ------------------------------------------------------------------------------------
    def run_kafka(self, config: KafkaConfig, group: str, *, telemetry: bool, idle_exit: float | None = None,
                  max_records: int | None = None, should_stop: Callable[[], bool] = lambda: False) -> ExportStats:
        """Consume as group `group` until `should_stop()`, `idle_exit` seconds without a record, or
        `max_records`; commit after each durable point. A restart resumes from the committed offsets."""
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        from transport.kafka import consumer_config

        reg = config.topics
        names = list(FINDING_TOPICS) + (list(TELEMETRY_TOPICS) + ["gpu.inventory"] if telemetry else [])
        topics = [reg.name(n) for n in names]
        # 10 s (not librdkafka's 45 s): a restarted exporter gets the partitions of the one that
        # crashed that much sooner
        consumer = Consumer(consumer_config(config, group, **{"enable.partition.eof": False,
                                                              "session.timeout.ms": 10000}))
        pending: dict[tuple[str, int], int] = {}

        def commit() -> None:
            self.make_durable()
            if pending:
                offsets = [TopicPartition(t, p, o) for (t, p), o in pending.items()]
                try:
                    consumer.commit(offsets=offsets, asynchronous=False)
                except KafkaException as exc:
                    # e.g. the partitions were reassigned meanwhile: the next owner re-reads them
                    print(f"xidstream export: commit failed ({exc}); records may be exported again", file=sys.stderr)
                pending.clear()
                self.stats.commits += 1

        assigned = {"at": None}

        def on_assign(c, partitions) -> None:
            assigned["at"] = time.monotonic()

        def on_revoke(c, partitions) -> None:
            commit()

        consumer.subscribe(topics, on_assign=on_assign, on_revoke=on_revoke)
        last_record = time.monotonic()
        try:
            while not should_stop():
                batch = consumer.consume(num_messages=2000, timeout=0.5)
                for msg in batch:
                    err = msg.error()
                    if err is not None:
                        if err.code() in (KafkaError._PARTITION_EOF,):
                            continue
                        if err.fatal() or err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                            raise ConfigError(f"Kafka error on {msg.topic()}: {err}")
                        print(f"xidstream export: Kafka: {err}", file=sys.stderr)
                        continue
                    self.handle(msg.value(), msg.key(), msg.partition(), msg.offset())
                    pending[(msg.topic(), msg.partition())] = msg.offset() + 1
                if batch:
                    last_record = time.monotonic()
                    if self.lander is None:
                        commit()  # documents only: durable after each batch
                if self.lander is not None and self.lander.should_roll():
                    commit()
                self._tick_progress()
                if max_records is not None and self.stats.consumed >= max_records:
                    break
                # idle counts from the assignment: joining the group (a crashed member's session
                # running out first) is not idleness
                if (idle_exit is not None and assigned["at"] is not None
                        and time.monotonic() - max(last_record, assigned["at"]) >= idle_exit):
                    break
            commit()
        finally:
            consumer.close()
            self.sink.close()
        self._tick_progress(force=True)
        return self.stats
