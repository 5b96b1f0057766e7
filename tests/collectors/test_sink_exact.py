"""KafkaSink, StdoutSink and MemorySink, exactly: which lane a record is spooled to, what reaches
the producer and when, what a delivery report does to the spool's cursor and to the callbacks
waiting on it (a kernel source's cursor: it must never move before the record is on the broker),
and the producer's settings. No broker: the producer is a scripted twin of confluent_kafka's."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import orjson
import pytest
from confluent_kafka import KafkaError

import xidstream.collectors.sink as sink_mod
from xidstream.collectors.sink import KafkaSink, MemorySink, StdoutSink
from xidstream.schemas import decode_any
from xidstream.schemas.codec import to_dict
from tests.factories import T0, one_of_each
from xidstream.transport.config import KafkaConfig

RECORDS = {type(r).__name__: r for r in one_of_each()}
XID, SAMPLE, PROCS, INVENTORY = (RECORDS[n] for n in ("XidEvent", "GpuSample", "GpuProcesses", "GpuInventory"))
SETTINGS = KafkaConfig(bootstrap="127.0.0.1:1", topic_prefix="t.", node="node-a")


class FakeProducer:
    """What KafkaSink uses of confluent_kafka.Producer; delivery reports come when the test says."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.sent: list[SimpleNamespace] = []  # every produce() call, in order
        self.undelivered: list[SimpleNamespace] = []
        self.capacity: int | None = None  # produce() raises BufferError past this many undelivered
        self.refuse = 0  # the next this many produce() calls raise BufferError
        self.polls: list[float] = []
        self.flushes: list[float] = []
        self.clock: Clock | None = None  # flush() waits its whole timeout on it: no report comes

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        if self.refuse or (self.capacity is not None and len(self.undelivered) >= self.capacity):
            self.refuse = max(0, self.refuse - 1)
            raise BufferError("Local: Queue full")
        msg = SimpleNamespace(topic=topic, value=value, key=key, headers=headers, on_delivery=on_delivery)
        self.sent.append(msg)
        self.undelivered.append(msg)

    def poll(self, timeout: float) -> int:
        self.polls.append(timeout)
        return 0

    def flush(self, timeout: float) -> int:
        self.flushes.append(timeout)
        if self.clock is not None:
            self.clock.t += timeout
        return len(self.undelivered)

    def deliver(self, n: int | None = None, err: KafkaError | None = None, order=None) -> None:
        """Report the first `n` undelivered messages (all by default), in `order` if given."""
        msgs = self.undelivered[: len(self.undelivered) if n is None else n]
        del self.undelivered[: len(msgs)]
        for i in order or range(len(msgs)):
            msgs[i].on_delivery(err, msgs[i])


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(sink_mod, "time", c)
    return c


@pytest.fixture
def make_sink(tmp_path, monkeypatch, clock):
    monkeypatch.setattr(sink_mod, "Producer", FakeProducer)

    def make(**kw) -> KafkaSink:
        sink = KafkaSink(SETTINGS, tmp_path / "spool", **kw)
        sink.producer.clock = clock
        return sink

    return make


def values(producer: FakeProducer) -> list:
    return [decode_any(m.value) for m in producer.sent]


def retriable(code=KafkaError.NOT_ENOUGH_REPLICAS) -> KafkaError:
    return KafkaError(code, "try again", retriable=True)


def messages(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "xidstream.collectors.sink" and r.levelno == level]


# -- construction --------------------------------------------------------------------------


def test_the_producer_never_times_a_message_out_and_reports_errors_to_the_sink(make_sink):
    sink = make_sink()
    cfg = sink.producer.config
    assert cfg["message.timeout.ms"] == 0  # librdkafka retries until the broker takes it
    assert cfg["error_cb"] == sink._on_error
    assert cfg["bootstrap.servers"] == "127.0.0.1:1" and cfg["enable.idempotence"] is True


def test_producer_overrides_win_over_the_sinks_own_settings(make_sink):
    sink = make_sink(producer_overrides={"message.timeout.ms": 7, "linger.ms": 1})
    assert sink.producer.config["message.timeout.ms"] == 7 and sink.producer.config["linger.ms"] == 1
    assert sink.producer.config["error_cb"] == sink._on_error


def test_three_spools_with_their_own_bounds_and_names(make_sink, tmp_path):
    sink = make_sink()
    crit, tele, count = sink.lanes["critical"].spool, sink.lanes["telemetry"].spool, sink.lanes["counters"].spool
    assert (crit.dir, crit.name, crit.max_bytes) == (tmp_path / "spool" / "critical", "spool/critical", 512 << 20)
    assert (tele.dir, tele.name, tele.max_bytes) == (tmp_path / "spool" / "telemetry", "spool/telemetry", 256 << 20)
    assert (count.dir, count.name, count.max_bytes) == (tmp_path / "spool" / "counters", "spool/counters", 128 << 20)
    assert make_sink(counters_bytes=1 << 18).lanes["counters"].spool.max_bytes == 1 << 18
    assert sink.max_inflight == 10_000 and sink.inflight == 0
    assert sink.auth_error is None and sink.failed == 0 and sink.dropped_permanent == 0
    other = make_sink(critical_bytes=1 << 20, telemetry_bytes=1 << 19, max_inflight=3)
    assert other.lanes["critical"].spool.max_bytes == 1 << 20
    assert other.lanes["telemetry"].spool.max_bytes == 1 << 19
    assert other.max_inflight == 3


def test_a_restarted_sink_resends_only_what_was_not_acknowledged(make_sink):
    sink = make_sink()
    for _ in range(3):
        sink.publish(XID)
    sink.poll()
    sink.producer.deliver(n=1)
    sink.close()
    again = make_sink()
    lane = again.lanes["critical"]
    assert lane.sent_through == lane.spool.acked_through == 1
    again.poll()
    assert len(again.producer.sent) == 2


# -- publishing ----------------------------------------------------------------------------


def test_samples_and_process_lists_go_to_telemetry_counters_apart_everything_else_to_critical(make_sink):
    # counters in the critical spool filled its bound in some 17 days of outage at 8 GPUs, and
    # pushed Xids out with them (review of the counters change)
    from tests.factories import one_of_each
    from xidstream.schemas.models import GpuCounters

    counters = next(r for r in one_of_each() if isinstance(r, GpuCounters))
    sink = make_sink()
    for rec in (XID, SAMPLE, counters, PROCS, INVENTORY):
        sink.publish(rec)
    crit, tele = sink.lanes["critical"].spool, sink.lanes["telemetry"].spool
    assert [r.topic for r in crit.pending()] == ["t.gpu.xid", "t.gpu.inventory"]
    assert [r.topic for r in tele.pending()] == ["t.gpu.samples", "t.gpu.processes"]
    assert [r.topic for r in sink.lanes["counters"].spool.pending()] == ["t.gpu.counters"]
    rec = crit.pending()[0]
    assert rec.key == SETTINGS.topics.for_record(XID)[1] and decode_any(rec.value) == XID
    assert sink.producer.sent == []  # spooled only: the producer is fed on poll()


def test_publish_sends_key_value_and_topic_on_poll(make_sink):
    sink = make_sink()
    sink.publish(XID)
    sink.publish(SAMPLE)
    sink.poll()
    sent = sink.producer.sent
    assert [(m.topic, m.key) for m in sent] == [("t.gpu.xid", SETTINGS.topics.for_record(XID)[1]),
                                                ("t.gpu.samples", SETTINGS.topics.for_record(SAMPLE)[1])]
    assert values(sink.producer) == [XID, SAMPLE]
    assert [m.headers for m in sent] == [None, None]
    assert sink.inflight == 2 and sink.producer.polls == [0]


def test_each_record_carries_the_nodes_mac_header_when_auth_is_given(make_sink):
    calls = []

    class Auth:
        def header(self, topic, key, value):
            calls.append((topic, key, value))
            return ("xs-mac", b"mac:" + topic.encode())

    sink = make_sink(auth=Auth())
    sink.publish(XID)
    sink.poll()
    (m,) = sink.producer.sent
    assert m.headers == [("xs-mac", b"mac:t.gpu.xid")]
    assert calls == [(m.topic, m.key, m.value)]


# -- callbacks and the cursor --------------------------------------------------------------


def test_a_callback_runs_only_once_its_record_and_all_before_it_are_acknowledged(make_sink):
    sink = make_sink()
    fired = []
    for i in range(3):
        sink.publish(XID, on_ack=lambda i=i: fired.append(i))
    sink.publish(SAMPLE, on_ack=lambda: fired.append("s"))
    sink.poll()
    assert fired == []  # handed to the producer is not acknowledged
    prod = sink.producer
    crit = prod.undelivered[:3]
    prod.undelivered = prod.undelivered[3:]
    crit[1].on_delivery(None, crit[1])  # out of order: record 1 is not on the broker yet
    sink.poll()
    assert fired == [] and sink.lanes["critical"].spool.acked_through == 0
    crit[0].on_delivery(None, crit[0])
    sink.poll()
    assert fired == [0, 1]
    crit[2].on_delivery(None, crit[2])
    prod.deliver()
    sink.poll()
    assert fired == [0, 1, 2, "s"]
    sink.poll()
    assert fired == [0, 1, 2, "s"]  # once each


def test_a_retriable_error_is_retried_and_holds_the_callback_back(make_sink):
    sink = make_sink()
    fired = []
    sink.publish(XID, on_ack=lambda: fired.append(1))
    sink.publish(XID, on_ack=lambda: fired.append(2))
    sink.poll()
    prod = sink.producer
    prod.deliver(n=1, err=retriable())
    assert sink.failed == 1 and sink.inflight == 1 and sink.lanes["critical"].retry == [1]
    prod.deliver()  # record 2 is on the broker, record 1 is not
    sink.poll()
    assert fired == [] and sink.lanes["critical"].spool.acked_through == 0
    assert [decode_any(m.value) for m in prod.sent] == [XID, XID, XID]  # record 1 sent again
    assert len(prod.undelivered) == 1 and sink.lanes["critical"].retry == []
    assert sink.stats()["retries"] == 1 and sink.stats()["dropped"] == 0
    prod.deliver()
    sink.poll()
    assert fired == [1, 2] and sink.lanes["critical"].spool.depth == 0


def test_a_retry_resends_only_the_failed_record_not_the_ones_after_it(make_sink):
    sink = make_sink()
    for _ in range(4):
        sink.publish(XID)
    sink.poll()
    prod = sink.producer
    first = prod.undelivered.pop(0)
    first.on_delivery(retriable(), first)  # seq 1 failed, 2-4 still in flight
    sink.poll()
    assert len(prod.sent) == 5 and sink.inflight == 4
    assert sink.lanes["critical"].retry == []
    prod.deliver()
    sink.poll()
    assert sink.lanes["critical"].spool.acked_through == 4


@pytest.mark.parametrize("code", sorted(sink_mod._PERMANENT))
def test_a_permanent_error_drops_the_record_and_moves_on(make_sink, code, caplog):
    sink = make_sink()
    fired = []
    sink.publish(XID, on_ack=lambda: fired.append(1))
    sink.poll()
    sink.producer.deliver(err=KafkaError(code, "no", retriable=True))  # permanent whatever it says
    sink.poll()
    assert sink.dropped_permanent == 1 and sink.failed == 0 and sink.inflight == 0
    assert sink.lanes["critical"].spool.acked_through == 1 and sink.lanes["critical"].retry == []
    assert fired == [1]  # the cursor moves on: a record no broker will take must not stall the rest
    assert sink.published == {} and sink.stats()["dropped"] == 1
    assert messages(caplog, logging.ERROR) == ["dropping record seq 1 for t.gpu.xid: no (not retriable)"]


@pytest.mark.parametrize("code", [KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED])
def test_a_refused_write_is_kept_and_tried_again_until_the_acl_allows_it(make_sink, clock, code, caplog):
    # It was dropped: after a leader's SIGKILL on the secure cluster, the new leader refused 100
    # Xids for a moment (its ACLs not loaded yet) and the collector lost them for good.
    sink = make_sink()
    fired = []
    sink.publish(XID, on_ack=lambda: fired.append(1))
    sink.publish(XID, on_ack=lambda: fired.append(2))
    sink.poll()
    sink.producer.deliver(err=KafkaError(code, "Broker: Topic authorization failed", retriable=False))
    sink.poll()
    assert sink.dropped_permanent == 0 and sink.refused == 2 and fired == []
    assert sink.lanes["critical"].spool.depth == 2 and sink.lanes["critical"].parked == [1, 2]
    assert sink.auth_error == "Broker: Topic authorization failed writing t.gpu.xid"
    assert [m for m in messages(caplog, logging.ERROR) if "refuses" in m] == [
        "Kafka refuses this collector (Broker: Topic authorization failed writing t.gpu.xid); kept in the spool "
        "and tried again every 10 s until the ACL allows it (transport/acls.py)"]
    sent = len(sink.producer.sent)
    clock.t += sink_mod.AUTH_RETRY_S - 0.5
    sink.poll()
    assert len(sink.producer.sent) == sent  # not before AUTH_RETRY_S
    clock.t += 0.5
    sink.poll()
    # one probe, not the backlog (a missing grant must not make every node resend its spool)
    assert len(sink.producer.sent) == sent + 1 and sink.lanes["critical"].parked == [2]
    sink.producer.deliver(err=KafkaError(code, "Broker: Topic authorization failed", retriable=False))
    sink.poll()
    assert sink.lanes["critical"].parked == [2, 1] and len(sink.producer.sent) == sent + 1
    clock.t += sink_mod.AUTH_RETRY_S
    sink.poll()
    assert len(sink.producer.sent) == sent + 2 and sink.lanes["critical"].parked == [2]
    sink.producer.deliver()  # the grant came: the probe goes through, and the rest follows
    sink.poll()
    assert sink.lanes["critical"].parked == [] and len(sink.producer.sent) == sent + 3
    sink.producer.deliver()
    sink.poll()
    assert fired == [1, 2] and sink.lanes["critical"].spool.depth == 0
    assert sink.auth_error is None and sink.stats()["dropped"] == 0 and sink.stats()["refused"] == 3


def test_an_error_that_says_it_is_not_retriable_drops_the_record(make_sink):
    sink = make_sink()
    sink.publish(XID)
    sink.publish(XID)
    sink.poll()
    sink.producer.deliver(err=KafkaError(KafkaError.NOT_ENOUGH_REPLICAS, "no", retriable=False))
    assert sink.dropped_permanent == 2 and sink.failed == 0
    assert sink.lanes["critical"].spool.acked_through == 2


def test_a_failing_callback_is_logged_and_the_rest_still_run(make_sink, caplog):
    sink = make_sink()
    fired = []

    def boom():
        raise OSError("cursor disk full")

    sink.publish(XID, on_ack=boom)
    sink.publish(XID, on_ack=lambda: fired.append(2))
    sink.poll()
    sink.producer.deliver()
    sink.poll()
    assert fired == [2] and messages(caplog, logging.ERROR) == ["ack callback failed"]


def test_published_counts_per_topic(make_sink):
    sink = make_sink()
    for rec in (XID, XID, SAMPLE):
        sink.publish(rec)
    sink.poll()
    sink.producer.deliver()
    assert sink.published == {"t.gpu.xid": 2, "t.gpu.samples": 1}
    assert sink.stats() == {"published": {"t.gpu.xid": 2, "t.gpu.samples": 1},
                            "spool_depth": {"critical": 0, "telemetry": 0, "counters": 0}, "dropped": 0,
                            "inflight": 0, "retries": 0, "refused": 0}


def test_stats_count_spool_drops_and_permanent_drops_together(make_sink):
    sink = make_sink()
    sink.lanes["telemetry"].spool.dropped = 5
    sink.lanes["critical"].spool.dropped = 2
    sink.dropped_permanent = 1
    sink.publish(XID)
    assert sink.stats()["dropped"] == 8
    assert sink.stats()["spool_depth"] == {"critical": 1, "telemetry": 0, "counters": 0}


# -- the in-flight cap ---------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_no_more_than_max_inflight_records_are_handed_to_the_producer(make_sink, cap):
    sink = make_sink(max_inflight=cap)
    for _ in range(5):
        sink.publish(XID)
    sink.poll()
    assert len(sink.producer.sent) == cap and sink.inflight == cap
    sink.poll()  # at the cap exactly: nothing more
    assert len(sink.producer.sent) == cap
    sink.producer.deliver(n=1)
    sink.poll()  # one slot free: one more
    assert len(sink.producer.sent) == cap + 1 and sink.inflight == cap


def test_the_cap_is_shared_by_both_lanes(make_sink):
    sink = make_sink(max_inflight=3)
    for _ in range(2):
        sink.publish(XID)
        sink.publish(SAMPLE)
    sink.poll()
    assert [m.topic for m in sink.producer.sent] == ["t.gpu.xid", "t.gpu.xid", "t.gpu.samples"]
    sink.producer.deliver()
    sink.poll()
    assert [m.topic for m in sink.producer.sent][3:] == ["t.gpu.samples"]


def test_a_full_cap_with_retries_waiting_sends_nothing(make_sink):
    sink = make_sink(max_inflight=2)
    for _ in range(3):
        sink.publish(XID)
    sink.poll()
    prod = sink.producer
    m = prod.undelivered.pop(0)
    m.on_delivery(retriable(), m)  # seq 1 to retry, seq 2 in flight, one slot free
    sink.poll()
    assert len(prod.sent) == 3 and decode_any(prod.sent[2].value) == XID
    assert sink.inflight == 2
    # the retry took the free slot, not seq 3
    assert sink.lanes["critical"].sent_through == 2


def test_retries_come_before_new_records_and_within_the_budget(make_sink):
    sink = make_sink(max_inflight=3)
    for _ in range(6):
        sink.publish(XID)
    sink.poll()
    prod = sink.producer
    msgs = list(prod.undelivered)
    prod.undelivered.clear()
    for m in msgs:
        m.on_delivery(retriable(), m)  # 1, 2, 3 all to retry
    sink.poll()
    assert len(prod.sent) == 6 and sink.inflight == 3
    lane = sink.lanes["critical"]
    assert lane.sent_through == 3 and lane.retry == [] and sink.failed == 3
    prod.deliver()
    sink.poll()
    assert lane.spool.acked_through == 3 and len(prod.sent) == 9 and lane.sent_through == 6


def test_a_full_producer_queue_keeps_the_record_for_later(make_sink):
    sink = make_sink()
    for _ in range(4):
        sink.publish(XID)
    sink.producer.capacity = 2
    sink.poll()
    lane = sink.lanes["critical"]
    assert len(sink.producer.sent) == 2 and sink.inflight == 2
    assert lane.retry == [3, 4] and lane.sent_through == 2  # what the queue did not take waits
    sink.producer.capacity = None
    sink.producer.deliver()
    sink.poll()
    assert len(sink.producer.sent) == 4 and lane.retry == [] and lane.sent_through == 4
    sink.poll()
    assert [decode_any(m.value) for m in sink.producer.sent] == [XID] * 4
    sink.producer.deliver()
    sink.poll()
    assert lane.spool.acked_through == 4 and sink.inflight == 0


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT])
def test_broker_down_is_said_once_and_its_end_too(make_sink, clock, caplog, code):
    sink = make_sink()
    caplog.set_level(logging.WARNING, logger="xidstream.collectors.sink")
    sink._on_error(KafkaError(code, "broker gone"))
    clock.t += 30
    sink._on_error(KafkaError(code, "broker gone"))
    assert sink._broker_down_since == 1000.0 and sink.auth_error is None
    assert messages(caplog, logging.WARNING) == [
        f"Kafka unreachable at {SETTINGS.bootstrap} (broker gone); spooling to {sink.spool_dir} until it returns, "
        f"reconnecting every 10 s at most; nothing is dropped until a spool reaches its bound"]
    sink.publish(XID)
    sink.poll()
    clock.t += 12
    sink.producer.deliver()
    assert sink._broker_down_since is None
    assert messages(caplog, logging.WARNING)[1:] == ["Kafka reachable again after 42 s; draining the spool"]
    sink.publish(XID)
    sink.poll()
    sink.producer.deliver()
    assert len(messages(caplog, logging.WARNING)) == 2
    sink._on_error(KafkaError(code, "broker gone again"))  # a second outage is said again
    assert sink._broker_down_since == 1042.0 and len(messages(caplog, logging.WARNING)) == 3


def test_other_client_errors_are_logged_not_taken_for_an_outage(make_sink, caplog):
    sink = make_sink()
    sink._on_error(KafkaError(KafkaError._RESOLVE, "name not known"))
    assert sink._broker_down_since is None and sink.auth_error is None
    assert messages(caplog, logging.WARNING) == ["Kafka client error: name not known"]


def test_an_auth_error_is_kept_and_said_once(make_sink, caplog):
    sink = make_sink()
    err = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: bad password")
    sink._on_error(err)
    sink._on_error(err)
    why = ("authentication failed for user (none) on 127.0.0.1:1 (sasl.mechanisms=GSSAPI): "
           "SASL authentication error: bad password")
    assert sink.auth_error == why
    assert messages(caplog, logging.ERROR) == [f"Kafka refuses this collector ({why}); spooling to disk until it is fixed"]
    assert sink._broker_down_since is None and messages(caplog, logging.WARNING) == []
    other = KafkaError(KafkaError._SSL, "SSL handshake failed")
    sink._on_error(other)
    assert sink.auth_error.startswith("TLS: handshake failed connecting to 127.0.0.1:1")
    assert len(messages(caplog, logging.ERROR)) == 2


# -- poll, flush, close --------------------------------------------------------------------


def test_the_spools_are_synced_once_a_second_not_every_tick(make_sink, clock, monkeypatch):
    sink = make_sink()
    synced = []
    for name, lane in sink.lanes.items():
        monkeypatch.setattr(lane.spool, "sync", lambda name=name: synced.append(name), raising=False)
    clock.t += 0.9375  # (binary fractions: the clock's sums are exact)
    sink.poll()
    assert synced == []
    clock.t += 0.0625  # exactly one second since the sink started
    sink.poll()
    assert synced == ["critical", "telemetry", "counters"]
    clock.t += 0.5
    sink.poll()
    assert synced == ["critical", "telemetry", "counters"]  # the second counts from the last sync
    clock.t += 0.625
    sink.poll()
    assert synced == ["critical", "telemetry", "counters"] * 2


def test_flush_returns_true_once_everything_is_acknowledged_and_persists_the_cursor(make_sink, tmp_path, clock):
    sink = make_sink()
    sink.publish(XID)
    sink.publish(SAMPLE)
    prod = sink.producer
    prod.flush = lambda timeout: (prod.flushes.append(timeout), prod.deliver(), clock.__setattr__("t", clock.t + 0.0625))
    assert sink.flush(5.0) is True
    assert prod.flushes == [0.2]
    assert (tmp_path / "spool" / "critical" / "cursor").read_text() == "1"
    assert (tmp_path / "spool" / "telemetry" / "cursor").read_text() == "1"


def test_flush_runs_the_callbacks_of_what_it_drained(make_sink):
    sink = make_sink()
    fired = []
    sink.publish(XID, on_ack=lambda: fired.append(1))
    prod = sink.producer
    prod.flush = lambda timeout: prod.deliver()
    assert sink.flush(1.0) and fired == [1]


def test_flush_gives_up_at_the_deadline_and_says_so(make_sink, clock, tmp_path):
    sink = make_sink()
    sink.publish(XID)
    prod = sink.producer

    def slow_flush(timeout):
        prod.flushes.append(timeout)
        clock.t += 0.25

    prod.flush = slow_flush
    assert sink.flush(0.75) is False
    assert prod.flushes == [0.2, 0.2, 0.2]  # at the deadline exactly it stops
    prod.flushes.clear()
    prod.flush = lambda timeout: (prod.flushes.append(timeout), clock.__setattr__("t", clock.t + 0.125))
    assert sink.flush(0.375) is False
    assert prod.flushes == [0.2, 0.2, 0.125]  # the last wait is what is left
    assert sink.lanes["critical"].spool.depth == 1 and sink.inflight == 1
    assert (tmp_path / "spool" / "critical" / "cursor").exists() is False
    assert sink.lanes["critical"].spool._unsynced is False  # the open segment was fsynced anyway


def test_flush_never_waits_a_negative_time(make_sink, clock):
    sink = make_sink()
    sink.publish(XID)
    prod = sink.producer
    prod.poll = lambda timeout: setattr(clock, "t", clock.t + 0.375)  # a poll that overran the deadline
    prod.flush = lambda timeout: prod.flushes.append(timeout)
    assert sink.flush(0.25) is False
    assert prod.flushes == [0.0]


def test_flush_waits_ten_seconds_by_default(make_sink, clock):
    sink = make_sink()
    sink.publish(XID)
    assert sink.flush() is False
    assert sum(sink.producer.flushes) == pytest.approx(10.0) and clock.t == pytest.approx(1010.0)


def test_flush_waits_for_records_in_flight_even_with_an_empty_spool(make_sink, clock):
    sink = make_sink()
    sink.inflight = 1  # a delivery report still to come
    sink.producer.flush = lambda timeout: setattr(clock, "t", clock.t + 0.2)
    assert sink.flush(0.3) is False


def test_close_flushes_closes_the_spools_and_drops_the_producer(make_sink, tmp_path):
    sink = make_sink()
    sink.publish(XID)
    prod = sink.producer
    prod.flush = lambda timeout: prod.deliver()
    sink.close()
    assert sink.producer is None
    assert sink.lanes["critical"].spool._writer is None
    assert (tmp_path / "spool" / "critical" / "cursor").read_text() == "1"
    sink.close()  # a second close does nothing


def test_close_gives_a_dead_broker_five_seconds(make_sink, clock):
    sink = make_sink()
    sink.publish(XID)
    prod = sink.producer
    waited = []

    def never(timeout):
        waited.append(timeout)
        clock.t += timeout

    prod.flush = never
    sink.close()
    assert sum(waited) == pytest.approx(5.0) and sink.producer is None


# -- stdout and memory ---------------------------------------------------------------------


def test_stdout_sink_prints_topic_key_and_value_and_acknowledges_at_once():
    out = io.StringIO()
    sink = StdoutSink(SETTINGS, stream=out)
    fired = []
    sink.publish(XID, on_ack=lambda: fired.append(1))
    sink.publish(SAMPLE)
    sink.publish(XID)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and out.getvalue().endswith("\n")
    first = orjson.loads(lines[0])
    assert first == {"topic": "t.gpu.xid", "key": SETTINGS.topics.for_record(XID)[1].decode(),
                     "value": orjson.loads(orjson.dumps(to_dict(XID)))}
    assert fired == [1]
    assert sink.stats() == {"published": {"t.gpu.xid": 2, "t.gpu.samples": 1}, "spool_depth": 0, "dropped": 0}
    assert sink.flush() is True


def test_stdout_sink_flushes_its_stream():
    class Stream(io.StringIO):
        flushed = 0

        def flush(self):
            self.flushed += 1

    s = Stream()
    sink = StdoutSink(SETTINGS, stream=s)
    sink.poll()
    sink.flush()
    sink.close()
    assert s.flushed == 3


def test_stdout_sink_defaults_to_stdout(capsys):
    sink = StdoutSink(SETTINGS)
    sink.publish(XID)
    sink.close()
    assert '"topic":"t.gpu.xid"' in capsys.readouterr().out


def test_memory_sink_keeps_records_and_acknowledges_at_once():
    sink = MemorySink()
    fired = []
    sink.publish(XID, on_ack=lambda: fired.append(1))
    sink.publish(SAMPLE)
    sink.poll()
    sink.close()
    assert sink.records == [XID, SAMPLE] and fired == [1] and sink.flush() is True
    assert sink.stats() == {"published": {"memory": 2}, "spool_depth": 0, "dropped": 0}


# -- retries behind records still in flight -------------------------------------------------


def test_a_failed_record_behind_records_in_flight_is_retried(make_sink):
    """The retry read pending() from the cursor with a limit of retries + free slots: records still
    in flight before the failed one used up that limit, the failed one was not in the batch, and
    it was forgotten (sent_through is past it): never sent again, the cursor stuck behind it."""
    sink = make_sink(max_inflight=3)
    fired = []
    for i in range(3):
        sink.publish(XID, on_ack=lambda i=i: fired.append(i))
    sink.poll()
    prod = sink.producer
    third = prod.undelivered.pop(2)
    third.on_delivery(retriable(), third)  # 1 and 2 still in flight, one slot free
    sink.poll()
    assert len(prod.sent) == 4 and sink.inflight == 3
    prod.deliver()
    sink.poll()
    assert fired == [0, 1, 2] and sink.lanes["critical"].spool.acked_through == 3


def test_retries_over_the_free_slots_wait_for_the_next_poll(make_sink):
    sink = make_sink(max_inflight=4)
    for _ in range(4):
        sink.publish(XID)
    sink.poll()
    prod = sink.producer
    first = prod.undelivered.pop(0)
    rest = list(prod.undelivered)
    prod.undelivered.clear()
    for m in rest[1:]:  # 3 and 4 fail, 2 stays in flight
        m.on_delivery(retriable(), m)
    prod.undelivered.append(rest[0])
    first.on_delivery(retriable(), first)  # then 1 fails: three retries, three free slots
    sink.inflight += 2  # two slots taken by the other lane
    sink.poll()
    assert len(prod.sent) == 5 and sink.lanes["critical"].retry == [3, 4]
    sink.inflight -= 2
    sink.poll()
    assert len(prod.sent) == 7 and sink.lanes["critical"].retry == []
    prod.deliver()
    sink.poll()
    assert sink.lanes["critical"].spool.acked_through == 4


def test_a_full_queue_in_the_middle_of_a_retry_keeps_the_rest_for_later(make_sink):
    sink = make_sink()
    for _ in range(3):
        sink.publish(XID)
    sink.poll()
    prod = sink.producer
    msgs = list(prod.undelivered)
    prod.undelivered.clear()
    for m in msgs:
        m.on_delivery(retriable(), m)
    prod.capacity = 1
    sink.poll()  # 1 is taken, 2 meets a full queue
    assert len(prod.sent) == 4 and sorted(sink.lanes["critical"].retry) == [2, 3]
    prod.capacity = None
    prod.deliver()
    sink.poll()
    prod.deliver()
    sink.poll()
    assert sink.lanes["critical"].spool.acked_through == 3


def test_a_full_queue_on_one_lane_does_not_stop_the_other(make_sink):
    """librdkafka drains its queue from its own thread: the next produce() may well succeed."""
    sink = make_sink()
    sink.publish(XID)
    sink.publish(SAMPLE)
    sink.producer.refuse = 1
    sink.poll()
    assert [m.topic for m in sink.producer.sent] == ["t.gpu.samples"]
    assert sink.lanes["critical"].retry == [1] and sink.inflight == 1


def test_retries_further_apart_than_a_default_read_are_all_sent(make_sink):
    """The retry read spans from the oldest retry to the newest, however many records that is."""
    sink = make_sink(max_inflight=10_005)
    for _ in range(10_003):
        sink.publish(SAMPLE)
    sink.poll()
    prod = sink.producer
    first, last = prod.undelivered.pop(0), prod.undelivered.pop()
    first.on_delivery(retriable(), first)
    last.on_delivery(retriable(), last)
    sink.poll()
    assert len(prod.sent) == 10_005 and sink.lanes["telemetry"].retry == []
    prod.deliver()
    sink.poll()
    assert sink.lanes["telemetry"].spool.acked_through == 10_003
