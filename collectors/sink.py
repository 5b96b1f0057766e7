"""Where the collector's records go: Kafka (through the spool) or stdout (JSON lines).

`KafkaSink` appends every record to an on-disk `Spool` first, then hands spooled records to an
idempotent confluent-kafka producer (acks=all, murmur2 partitioner: transport.kafka.producer_config).
`message.timeout.ms=0` makes librdkafka retry a message until the broker takes it, so a broker
that goes away and comes back gets every record exactly once and in order per key; the number in
flight is capped so the rest waits on disk, not in memory.

Three spools, each with its own bound, so that what a long outage drops first is never an Xid:
`critical` (Xid, workloads, inventory: never replaceable), `counters` (gpu.counters, one record per
GPU a minute, about 2.7 KB with 18 NVLinks: 30 MB a day at 8 GPUs; in the critical spool they would
fill its 512 MiB in some 17 days of outage and push Xids out with them) and `telemetry` (samples,
process lists: the next second replaces them).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Protocol

from confluent_kafka import KafkaError, Producer

from xidstream.schemas.base import Record
from xidstream.schemas.codec import encode, to_dict
from xidstream.schemas.models import GpuCounters, GpuProcesses, GpuSample
from xidstream.transport.kafka import explain_error, producer_config
from xidstream.transport.config import KafkaConfig

__all__ = ["Sink", "KafkaSink", "StdoutSink", "MemorySink"]

log = logging.getLogger(__name__)

AckCallback = Callable[[], None]

_TELEMETRY = (GpuSample, GpuProcesses)
# Errors that retrying cannot fix: the record is counted as dropped and logged.
_PERMANENT = {
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError._MSG_TIMED_OUT,
}
# A refused write is kept, not dropped: the grant may come (an upgrade that added a topic runs the
# collectors before anyone granted it), and a broker that became the partition's leader a moment
# ago may not have loaded the ACLs yet (the cluster tier: 100 Xids dropped after a leader's SIGKILL
# on the secure cluster). Its records wait in the spool; this often one of them is sent again as a
# probe, and all of them once a write goes through (not the whole backlog every time: a missing
# grant would have every node resend its spool at full speed every 10 s).
_REFUSED = {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED}
AUTH_RETRY_S = 10.0


class Sink(Protocol):
    def publish(self, record: Record, on_ack: AckCallback | None = None) -> None: ...
    def poll(self) -> None: ...
    def flush(self, timeout: float = 10.0) -> bool: ...
    def close(self) -> None: ...
    def stats(self) -> dict: ...


class StdoutSink:
    """JSON lines on stdout, one per record, with its topic and key: what `--sink stdout` prints."""

    def __init__(self, settings: KafkaConfig, stream=None) -> None:
        import orjson

        self._dumps = orjson.dumps
        self.settings = settings
        self.stream = stream or sys.stdout
        self.published: dict[str, int] = {}

    def publish(self, record: Record, on_ack: AckCallback | None = None) -> None:
        topic, key = self.settings.topics.for_record(record)
        line = self._dumps({"topic": topic, "key": key.decode(), "value": to_dict(record)})
        self.stream.write(line.decode() + "\n")
        self.published[topic] = self.published.get(topic, 0) + 1
        if on_ack:
            on_ack()

    def poll(self) -> None:
        self.stream.flush()

    def flush(self, timeout: float = 10.0) -> bool:
        self.stream.flush()
        return True

    def close(self) -> None:
        self.stream.flush()

    def stats(self) -> dict:
        return {"published": dict(self.published), "spool_depth": 0, "dropped": 0}


class MemorySink:
    """Keeps records in a list (tests, the simulator's ground truth)."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def publish(self, record: Record, on_ack: AckCallback | None = None) -> None:
        self.records.append(record)
        if on_ack:
            on_ack()

    def poll(self) -> None:
        pass

    def flush(self, timeout: float = 10.0) -> bool:
        return True

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"published": {"memory": len(self.records)}, "spool_depth": 0, "dropped": 0}


class _Lane:
    """One spool and the callbacks waiting for its cursor."""

    def __init__(self, spool_dir: Path, name: str, max_bytes: int) -> None:
        from xidstream.collectors.spool import Spool

        self.spool = Spool(spool_dir / name, max_bytes=max_bytes, name=f"spool/{name}")
        self.sent_through = self.spool.acked_through
        self.waiting: deque[tuple[int, AckCallback]] = deque()
        self.retry: list[int] = []
        self.parked: list[int] = []  # refused by an authorization error: tried again after AUTH_RETRY_S


class KafkaSink:
    def __init__(self, settings: KafkaConfig, spool_dir: str | Path, *, max_inflight: int = 10_000,
                 critical_bytes: int = 512 << 20, telemetry_bytes: int = 256 << 20, counters_bytes: int = 128 << 20,
                 producer_overrides: dict | None = None, auth: Any = None) -> None:
        """`auth` (a `xidstream.transport.identity.RecordAuth`): every record sent carries this node's MAC
        header, computed at send time over what Kafka stores (the spool keeps the record only)."""
        self.settings = settings
        self.auth = auth
        spool_dir = self.spool_dir = Path(spool_dir)
        self.lanes = {
            "critical": _Lane(spool_dir, "critical", critical_bytes),
            "telemetry": _Lane(spool_dir, "telemetry", telemetry_bytes),
            "counters": _Lane(spool_dir, "counters", counters_bytes),  # about four days at 8 GPUs
        }
        self.max_inflight = max_inflight
        self.inflight = 0
        self.published: dict[str, int] = {}
        self.failed = 0
        self.dropped_permanent = 0
        self._last_sync = time.monotonic()
        self._broker_down_since: float | None = None
        # a refused password, an untrusted CA, a missing ACL: retrying will not cure it; said once,
        # at error level, and kept for the metrics and the caller (`auth_error`)
        self.auth_error: str | None = None
        self.refused = 0  # deliveries refused by an authorization error (kept and tried again)
        self._parked_at: float | None = None
        overrides = {"message.timeout.ms": 0, "error_cb": self._on_error, **(producer_overrides or {})}
        self.producer = Producer(producer_config(settings, **overrides))

    # -- publishing ------------------------------------------------------------------------
    def publish(self, record: Record, on_ack: AckCallback | None = None) -> None:
        lane = self.lanes["telemetry" if isinstance(record, _TELEMETRY)
                          else "counters" if isinstance(record, GpuCounters) else "critical"]
        topic, key = self.settings.topics.for_record(record)
        seq = lane.spool.append(topic, key, encode(record))
        if on_ack is not None:
            lane.waiting.append((seq, on_ack))

    def _on_error(self, err: KafkaError) -> None:
        why = explain_error(err, producer_config(self.settings))
        if why:
            if why != self.auth_error:
                log.error("Kafka refuses this collector (%s); spooling to disk until it is fixed", why)
            self.auth_error = why
            return
        # Broker-down errors are expected and retried by librdkafka; say so once, not per message.
        if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            if self._broker_down_since is None:
                self._broker_down_since = time.monotonic()
                from xidstream.transport.kafka_log import readable

                conf = producer_config(self.settings)
                log.warning("Kafka unreachable at %s (%s); spooling to %s until it returns, reconnecting "
                            "every %g s at most; nothing is dropped until a spool reaches its bound",
                            self.settings.bootstrap, readable(err.str())[0], self.spool_dir,
                            float(conf.get("reconnect.backoff.max.ms", 10_000)) / 1000)
        else:
            log.warning("Kafka client error: %s", err.str())

    def _delivered(self, lane: _Lane, seq: int, topic: str):
        def callback(err: KafkaError | None, msg) -> None:
            self.inflight -= 1
            if err is None:
                if self._broker_down_since is not None:
                    from xidstream.transport.kafka_log import KAFKA_LOG

                    KAFKA_LOG.flush()  # the count of the connection errors folded meanwhile, first
                    log.warning("Kafka reachable again after %.0f s; draining the spool",
                                time.monotonic() - self._broker_down_since)
                    self._broker_down_since = None
                lane.spool.ack(seq)
                self.published[topic] = self.published.get(topic, 0) + 1
                if self._parked_at is not None or any(ln.parked for ln in self.lanes.values()):
                    # a write went through: what was refused is tried again, all of it
                    log.warning("Kafka accepts this collector's records again; the spool drains")
                    self._parked_at = None
                    self.auth_error = None
                    for ln in self.lanes.values():
                        ln.retry.extend(ln.parked)
                        ln.parked.clear()
            elif err.code() in _REFUSED:
                self.refused += 1
                why = f"{err.str()} writing {topic}"
                if why != self.auth_error:
                    log.error("Kafka refuses this collector (%s); kept in the spool and tried again every %.0f s "
                              "until the ACL allows it (transport/acls.py)", why, AUTH_RETRY_S)
                self.auth_error = why
                self._parked_at = time.monotonic()
                lane.parked.append(seq)
            elif err.code() in _PERMANENT or not err.retriable():
                self.dropped_permanent += 1
                log.error("dropping record seq %d for %s: %s (not retriable)", seq, topic, err.str())
                lane.spool.ack(seq)
            else:
                self.failed += 1
                lane.retry.append(seq)
        return callback

    def _send(self) -> None:
        if self._parked_at is not None and time.monotonic() - self._parked_at >= AUTH_RETRY_S:
            # one probe per lane: its answer releases the rest (accepted) or parks it again
            self._parked_at = time.monotonic()
            for lane in self.lanes.values():
                if lane.parked:
                    lane.parked.sort()
                    lane.retry.append(lane.parked.pop(0))
        for lane in self.lanes.values():
            budget = self.max_inflight - self.inflight
            if budget <= 0:
                return
            if lane.retry:
                # Read from the oldest retry on: records still in flight before it must not use up
                # the limit, or a retry falls out of the batch and, being behind sent_through, is
                # never sent again. Retries over the free slots wait for the next call.
                retry = set(lane.retry)
                lane.retry.clear()
                first, last = min(retry), max(retry)
                batch = [r for r in lane.spool.pending(after=first - 1, limit=last - first + 1) if r.seq in retry]
                lane.retry.extend(r.seq for r in batch[budget:])
                batch = batch[:budget]
            else:
                batch = lane.spool.pending(after=lane.sent_through, limit=budget)
            for i, rec in enumerate(batch):
                try:
                    headers = [self.auth.header(rec.topic, rec.key, rec.value)] if self.auth is not None else None
                    self.producer.produce(rec.topic, value=rec.value, key=rec.key, headers=headers,
                                          on_delivery=self._delivered(lane, rec.seq, rec.topic))
                except BufferError:
                    # what the queue did not take goes first next call (the rest of a retry batch
                    # is behind sent_through: only the retry list can bring it back)
                    lane.retry.extend(r.seq for r in batch[i:])
                    break
                self.inflight += 1
                lane.sent_through = max(lane.sent_through, rec.seq)

    def poll(self) -> None:
        """Send what is spooled, serve delivery reports, run ack callbacks. Call every tick."""
        self._send()
        self.producer.poll(0)
        for lane in self.lanes.values():
            acked = lane.spool.acked_through
            while lane.waiting and lane.waiting[0][0] <= acked:
                _, cb = lane.waiting.popleft()
                try:
                    cb()
                except Exception:  # noqa: BLE001 - a cursor write failing must not stop publishing
                    log.exception("ack callback failed")
        now = time.monotonic()
        if now - self._last_sync >= 1.0:
            for lane in self.lanes.values():
                lane.spool.sync()
            self._last_sync = now

    def flush(self, timeout: float = 10.0) -> bool:
        """Send everything spooled; True when nothing is left unacknowledged."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if all(lane.spool.depth == 0 for lane in self.lanes.values()) and self.inflight == 0:
                self.poll()
                for lane in self.lanes.values():
                    lane.spool.sync()
                return True
            self.producer.flush(min(0.2, max(0.0, deadline - time.monotonic())))
        for lane in self.lanes.values():
            lane.spool.sync()
        return False

    def close(self) -> None:
        if self.producer is None:
            return
        self.flush(5.0)
        for lane in self.lanes.values():
            lane.spool.close()
        # The producer holds our error callback: drop it now, so that its threads end here and
        # not whenever the garbage collector breaks the cycle (maybe after the broker is gone).
        self.producer = None

    def stats(self) -> dict:
        return {
            "published": dict(self.published),
            "spool_depth": {n: lane.spool.depth for n, lane in self.lanes.items()},
            "dropped": sum(lane.spool.dropped for lane in self.lanes.values()) + self.dropped_permanent,
            "inflight": self.inflight,
            "retries": self.failed,
            "refused": self.refused,
        }
