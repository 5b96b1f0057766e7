"""The export loop: contract records in (Kafka consumer group or JSON lines), OCSF/ECS documents
and Parquet files out, offsets committed only after the output is durable (at-least-once).

A source record's `event_id` is in every exported document (OCSF `metadata.original_event_uid`,
from which `metadata.uid` is derived; ECS `event.id`), so a record delivered twice (after a crash
between writing and committing) is recognisable downstream.

A document bigger than Kafka takes (the producer's `message.max.bytes`, or a lower limit of the
broker or topic, which refuses it with MSG_SIZE_TOO_LARGE) is shrunk (`fit_document`: its long
lists cut, then dropped, then its long strings cut; marked `truncated`) and, where even that is too
big, skipped with a logged error naming its event_id: one document must not stop the export, and
its uncommitted offset would stop the restarted exporter again.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Protocol

import orjson

from xidstream.exporters import ecs, ocsf
from xidstream.exporters.parquet import TELEMETRY_TOPICS, ParquetLander
from xidstream.schemas.base import Record
from xidstream.schemas.codec import decode_any
from xidstream.schemas.errors import ConfigError, DecodeError, TopicError
from xidstream.schemas.models import Alert, Approval, RemediationCommand, RemediationResult
from xidstream.schemas.topics import spec_for_model
from xidstream.transport.config import KafkaConfig

__all__ = ["FINDING_TOPICS", "ExportStats", "JsonlSink", "KafkaTopicSink", "ParquetSink", "Exporter", "map_record",
           "fit_document", "DEFAULT_MAX_BYTES"]

FINDING_TOPICS = ("gpu.alerts", "gpu.remediation", "gpu.remediation.results", "gpu.remediation.approvals")
_FINDING_TYPES = (Alert, RemediationCommand, RemediationResult, Approval)

DEFAULT_MAX_BYTES = 1_000_000  # librdkafka's (and the broker's) default message.max.bytes
# room for the key, headers and the record's framing inside message.max.bytes
_ENVELOPE = 1024
# lists that grow with an incident: the timeline (OCSF `unmapped.timeline`, ECS `xidstream.timeline`)
# and OCSF's evidences; kept to their first few, then dropped
_LONG_LISTS = (("unmapped", "timeline"), ("evidences",), ("xidstream", "timeline"),
               ("finding_info_list",))
_KEEP_ITEMS = 5
_KEEP_CHARS = 1024


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


def _cut_strings(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= _KEEP_CHARS else value[:_KEEP_CHARS] + "..."
    if isinstance(value, list):
        return [_cut_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: _cut_strings(v) for k, v in value.items()}
    return value


def _shrunk(doc: dict[str, Any], original: int) -> Iterable[dict[str, Any]]:
    """Ever smaller copies of `doc`, each marked: `truncated` and `original_bytes` in OCSF's
    `unmapped` or in ECS's `xidstream` namespace (a document with `class_uid` is OCSF)."""
    flag_at = "unmapped" if "class_uid" in doc else "xidstream"

    def mark(d: dict[str, Any], how: str) -> dict[str, Any]:
        d[flag_at] = {**(d.get(flag_at) or {}), "truncated": True, "truncation": how, "original_bytes": original}
        return d

    def with_lists(keep: int | None) -> dict[str, Any]:
        d = orjson.loads(orjson.dumps(doc))  # a deep copy of plain JSON
        for path in _LONG_LISTS:
            parent = d
            for k in path[:-1]:
                parent = parent.get(k) if isinstance(parent, dict) else None
            if isinstance(parent, dict) and isinstance(parent.get(path[-1]), list):
                if keep is None:
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = parent[path[-1]][:keep]
        return d

    yield mark(with_lists(_KEEP_ITEMS), "lists")
    yield mark(with_lists(None), "lists-dropped")
    yield mark(_cut_strings(with_lists(None)), "strings")


def fit_document(doc: dict[str, Any], limit: int) -> tuple[bytes | None, bool]:
    """`(encoded, truncated)`: `doc` encoded if it fits in `limit` bytes, else the first shrunk copy
    that does (truncated True), else `(None, True)`: too big however cut."""
    raw = orjson.dumps(doc)
    if len(raw) <= limit:
        return raw, False
    for smaller in _shrunk(doc, len(raw)):
        out = orjson.dumps(smaller)
        if len(out) <= limit:
            return out, True
    return None, True


def _event_ms(record: Record) -> int:
    """The Kafka timestamp of an exported document: its event's time (consumers such as Splunk's
    Kafka connector take the record's timestamp as the event time), never ahead of now: Kafka 4
    refuses a record stamped more than `log.message.timestamp.after.max.ms` (1 h) ahead, and a
    node's clock may be."""
    return min(int(record.ts.timestamp() * 1000), int(time.time() * 1000))


def _principal(config: KafkaConfig) -> str:
    user = config.kafka_extra.get("sasl.username")
    return f"User:{user}" if user else "this client's principal"


class KafkaTopicSink:
    """To a Kafka topic, keyed as the source record was; `durable()` waits for every ack.

    `max_bytes` is the largest document it sends (default the producer's `message.max.bytes`);
    larger ones are shrunk or skipped (`fit_document`), and so are those the broker refuses as too
    large, counted in `stats` (an `ExportStats`, bound by the Exporter)."""

    def __init__(self, config: KafkaConfig, topic: str, *, max_bytes: int | None = None):
        from confluent_kafka import KafkaError, KafkaException, Producer

        from xidstream.transport.kafka import producer_config

        self.topic = topic
        conf = producer_config(config)
        self._producer = Producer(conf)
        self.max_bytes = max_bytes or max(int(conf.get("message.max.bytes", DEFAULT_MAX_BYTES)) - _ENVELOPE, 1)
        self.stats: ExportStats | None = None
        self._principal = _principal(config)
        self._errors: list[str] = []
        self._refused: list[tuple[Record, dict[str, Any], bytes | None, bytes, bool]] = []
        deadline = time.monotonic() + 15
        while True:
            from xidstream.transport.kafka import list_topics, unreachable

            try:
                t = list_topics(self._producer, 15, topic).topics.get(topic)
            except KafkaException as exc:  # a sentence naming the address, not a traceback
                raise TopicError(unreachable(config.bootstrap, 15, exc, f"to write {topic}")) from None
            # a topic created a moment ago has no leader yet: not a missing topic
            if (t is None or t.error is None or t.error.code() != KafkaError.LEADER_NOT_AVAILABLE
                    or time.monotonic() > deadline):
                break
            time.sleep(0.2)
        if t is not None and t.error is not None and t.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            # the broker answers this for a topic the principal may not DESCRIBE, whether it exists or not
            raise ConfigError(f"{self._principal} is not authorized to describe output topic {topic} on "
                              f"{config.bootstrap}: grant it WRITE and DESCRIBE on the topic (the exporter role's "
                              f"ACLs, transport/acls.py) and create the topic if it does not exist")
        if t is not None and t.error is not None and t.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise ConfigError(f"output topic {topic} on {config.bootstrap}: {t.error.str()}")
        if t is None or t.error is not None:
            raise ConfigError(f"output topic {topic} does not exist on {config.bootstrap} (create it first, e.g. "
                              f"kafka-topics.sh --create --topic {topic}; brokers normally refuse to auto-create)")

    def bind_stats(self, stats: ExportStats) -> None:
        self.stats = stats

    def _count(self, name: str) -> None:
        if self.stats is not None:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _skip(self, record: Record, size: int, why: str) -> None:
        self._count("too_large")
        print(f"xidstream export: ERROR: skipped the document of event {record.event_id} ({size:,} bytes): {why}",
              file=sys.stderr)

    def _produce(self, record: Record, doc: dict[str, Any], value: bytes, key: bytes | None, truncated: bool,
                 alone: bool = False) -> None:
        def ack(err, msg) -> None:
            from confluent_kafka import KafkaError

            if err is None:
                if truncated:
                    self._count("truncated")
            elif err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                # the broker refuses a whole batch: which of its documents is too big is known only
                # once each is sent alone (durable() does); one refused alone is then shrunk fully
                if not alone:
                    self._refused.append((record, doc, key, value, truncated))
                    return
                smallest = orjson.dumps(list(_shrunk(doc, len(orjson.dumps(doc))))[-1])
                if len(smallest) < len(value):
                    self._refused.append((record, doc, key, smallest, True))
                else:
                    self._skip(record, len(value), f"the broker refuses it as too large even shrunk ({err.str()})")
            elif err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                self._errors.append(f"{self._principal} is not authorized to write to {self.topic}: grant it WRITE "
                                    f"(and DESCRIBE) on the topic (the exporter role's ACLs, transport/acls.py)")
            else:
                self._errors.append(str(err))

        while True:
            try:
                self._producer.produce(self.topic, value, key=key, on_delivery=ack, timestamp=_event_ms(record))
                break
            except BufferError:
                self._producer.poll(0.1)
        self._producer.poll(0)

    def write(self, record, doc, key, partition, offset) -> None:
        value, truncated = fit_document(doc, self.max_bytes)
        if value is None:
            self._skip(record, len(orjson.dumps(doc)), f"over the {self.max_bytes:,}-byte limit however shrunk")
            return
        self._produce(record, doc, value, key, truncated)

    def durable(self) -> None:
        left = self._producer.flush(60)
        while self._refused and not left and not self._errors:
            # the broker's or the topic's limit is below ours (rare): each refused document again,
            # alone, so that the broker's answer is about it, and shrunk when refused alone
            refused, self._refused = self._refused, []
            for record, doc, key, value, truncated in refused:
                self._produce(record, doc, value, key, truncated, alone=True)
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
    truncated: int = 0   # documents shrunk to fit the topic's size limit
    too_large: int = 0   # documents skipped: too big however shrunk
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        secs = max(time.monotonic() - self.started, 1e-9)
        size = (f", {self.truncated:,} truncated, {self.too_large:,} too large (skipped)"
                if self.truncated or self.too_large else "")
        return (f"export: {self.consumed:,} read ({self.consumed / secs:,.0f}/s), {self.exported:,} findings exported, "
                f"{self.landed:,} telemetry rows landed in {self.files:,} file(s), {self.bad:,} undecodable{size}")


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
        bind = getattr(sink, "bind_stats", None)
        if bind is not None:
            bind(self.stats)
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
                  max_records: int | None = None, should_stop: Callable[[], bool] = lambda: False,
                  join_grace: float = 30.0) -> ExportStats:
        """Consume as group `group` until `should_stop()`, `idle_exit` seconds without a record, or
        `max_records`; commit after each durable point. A restart resumes from the committed offsets.
        Without any assignment, `idle_exit` counts from the start plus `join_grace` seconds (a
        crashed member's session running out first). A refused group or topic (a missing ACL), a
        refused password or certificate is a ConfigError, not a loop."""
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        from xidstream.transport.kafka import ClientErrors, consumer_config

        reg = config.topics
        names = list(FINDING_TOPICS) + (list(TELEMETRY_TOPICS) + ["gpu.inventory"] if telemetry else [])
        topics = [reg.name(n) for n in names]
        # 10 s (not librdkafka's 45 s): a restarted exporter gets the partitions of the one that
        # crashed that much sooner
        conf = consumer_config(config, group, **{"enable.partition.eof": False, "session.timeout.ms": 10000})
        client_errors = ClientErrors(conf)
        consumer = Consumer({**conf, "error_cb": client_errors})
        principal = _principal(config)
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

        # a telemetry topic a release added (gpu.counters) may not exist yet after the upgrade:
        # landed once it does (a restart), the rest goes on meanwhile
        from xidstream.schemas.topics import TOPICS

        optional = {reg.name(n) for n in names if not TOPICS[n].required}
        if optional:
            try:
                shown = consumer.list_topics(timeout=10).topics
            except KafkaException:
                shown = None  # unreachable now: the subscription's own errors say so
            absent = sorted(t for t in optional if shown is not None and t not in shown)
            for t in absent:
                print(f"xidstream export: topic {t} is missing (or {principal} may not DESCRIBE it); not landed until "
                      f"the exporter restarts after `xidstream topics create` and a READ and DESCRIBE grant",
                      file=sys.stderr)
            topics = [t for t in topics if t not in absent]
        consumer.subscribe(topics, on_assign=on_assign, on_revoke=on_revoke)
        started = last_record = time.monotonic()
        try:
            while not should_stop():
                batch = consumer.consume(num_messages=2000, timeout=0.5)
                for msg in batch:
                    err = msg.error()
                    if err is not None:
                        if err.code() in (KafkaError._PARTITION_EOF,):
                            continue
                        if err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
                            # librdkafka reports it and retries for ever: nothing is ever assigned
                            raise ConfigError(f"{principal} is not authorized to use consumer group {group}: grant it "
                                              f"READ and DESCRIBE on the group (the exporter role's ACLs, "
                                              f"transport/acls.py: groups under <prefix>xidstream-export-) or pass "
                                              f"--group with a group it may use ({err.str()})")
                        if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                            which = msg.topic() or f"one of {', '.join(topics)}"
                            raise ConfigError(f"{principal} is not authorized to read {which}: grant it READ and "
                                              f"DESCRIBE on the topic (the exporter role's ACLs, transport/acls.py) "
                                              f"({err.str()})")
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
                if client_errors.fatal:
                    raise ConfigError(f"{client_errors.fatal} (consumer group {group}; the exporter role's ACLs: "
                                      f"transport/acls.py)")
                # idle counts from the assignment: joining the group (a crashed member's session
                # running out first) is not idleness; but an assignment may never come (a broker
                # that never answers), so without one it counts from the start, after a grace
                if idle_exit is not None:
                    now = time.monotonic()
                    if assigned["at"] is not None and now - max(last_record, assigned["at"]) >= idle_exit:
                        break
                    if assigned["at"] is None and now - started >= idle_exit + join_grace:
                        print(f"xidstream export: no partition assigned to group {group} in "
                              f"{now - started:.0f} s; stopping (--idle-exit)", file=sys.stderr)
                        break
            commit()
        finally:
            consumer.close()
            self.sink.close()
        self._tick_progress(force=True)
        return self.stats
