"""Kafka plumbing shared by the libraries and the commands: client configs, topic administration.

Every confluent-kafka producer that writes a topic the stream processor reads must hash keys the
way aiokafka and the Java client do (murmur2), or a GPU's records land on a different partition
than faust expects (runtime-notes section 2: 1 of 40 keys matched with librdkafka's default).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from xidstream.schemas.errors import ConfigError, TopicError
from xidstream.schemas.topics import TOPICS
from xidstream.transport.config import KafkaConfig
from xidstream.transport.kafka_log import KAFKA_LOG

__all__ = ["producer_config", "consumer_config", "read_since", "read_key", "murmur2_partition", "admin", "consume_records", "ClientErrors", "explain_error", "unreachable", "list_topics", "topic_config", "create_topics", "check_copartitioning", "delete_topics",
           "delete_run", "ensure_processor_topics", "read_all", "LagProbe", "consumer_lag", "replication_findings",
           "check_replication", "choose_replication", "settle_replication"]


def producer_config(settings: KafkaConfig, **overrides: object) -> dict:
    config: dict = {
        "bootstrap.servers": settings.bootstrap,
        "enable.idempotence": True,  # retries never duplicate or reorder
        "acks": "all",
        "compression.type": "lz4",
        "linger.ms": 5,
        "partitioner": "murmur2_random",  # same partition as aiokafka/Java for the same key
        "client.id": f"xidstream-{settings.node}",
        # librdkafka's log through Python logging, repeats folded (transport.kafka_log), not a
        # "%3|...|FAIL|" line on stderr every 50 ms while a broker is away
        "logger": KAFKA_LOG,
    }
    config.update(settings.kafka_extra)
    config.update(overrides)
    return config


def consumer_config(settings: KafkaConfig, group_id: str, **overrides: object) -> dict:
    config: dict = {
        "bootstrap.servers": settings.bootstrap,
        "group.id": group_id,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "logger": KAFKA_LOG,  # served by the consumer's poll()/consume() (transport.kafka_log)
    }
    config.update(settings.kafka_extra)
    config.update(overrides)
    return config


def explain_error(err: object, config: Mapping[str, object]) -> str | None:
    """A sentence naming the cause of a librdkafka error that retrying will not cure (a refused
    password, an untrusted certificate, a missing ACL), or None for any other (a broker that is
    down or starting: librdkafka retries those). `config` is the client's settings."""
    from confluent_kafka import KafkaError

    code = err.code() if hasattr(err, "code") else None
    text = err.str() if hasattr(err, "str") else str(err)
    user = config.get("sasl.username")
    where = config.get("bootstrap.servers", "?")
    auth_codes = {KafkaError._AUTHENTICATION, getattr(KafkaError, "SASL_AUTHENTICATION_FAILED", -1)}
    if code in auth_codes or "SASL authentication error" in text or "Authentication failed" in text:
        return (f"authentication failed for user {user or '(none)'} on {where} "
                f"(sasl.mechanisms={config.get('sasl.mechanisms', 'GSSAPI')}): {text}")
    if code == KafkaError._SSL or "SSL handshake failed" in text or "certificate verify failed" in text:
        cause = "certificate verify failed" if "verify failed" in text or "could not be verified" in text else "handshake failed"
        return (f"TLS: {cause} connecting to {where} (ssl.ca.location={config.get('ssl.ca.location', 'the system CAs')}): "
                f"{text}")
    if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
                KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED):
        return f"not authorized (user {user or 'ANONYMOUS'} on {where}): {text}"
    return None


class ClientErrors:
    """A librdkafka `error_cb` that keeps the last error that retrying will not cure, explained
    (`explain_error`), so a caller waiting on a client can stop waiting and say why."""

    def __init__(self, config: Mapping[str, object]) -> None:
        self.config = {k: v for k, v in config.items() if k != "sasl.password"}
        self.fatal: str | None = None

    def __call__(self, err: object) -> None:
        why = explain_error(err, self.config)
        if why:
            self.fatal = why


def consume_records(consumer: Any, timeout: float, batch: int = 500) -> Iterator[Any]:
    """The contract records of one `consume()` call, decoded; broker errors and undecodable values
    are skipped (for readers of a run's own outputs: replay's scripted executor, demo-cluster)."""
    from xidstream.schemas.codec import decode_any
    from xidstream.schemas.errors import DecodeError

    for m in consumer.consume(num_messages=batch, timeout=timeout):
        if m.error() is not None:
            continue
        try:
            yield decode_any(m.value())
        except DecodeError:
            continue


def admin(settings: KafkaConfig, *, quiet: bool = False) -> AdminClient:
    """An admin client whose fatal errors `ClientErrors` keeps; `quiet`: librdkafka's own log off."""
    config = {"bootstrap.servers": settings.bootstrap, **settings.kafka_extra}
    errors = ClientErrors(config)
    # its log lines wait for its poll(): `_metadata` polls while it waits (transport.kafka_log)
    client = AdminClient({**config, "error_cb": errors, "logger": KAFKA_LOG, **({"log_level": 0} if quiet else {})})
    client.xidstream_errors = errors  # type: ignore[attr-defined]
    return client


def reachable(settings: KafkaConfig, timeout: float = 10.0) -> None:
    """Return once a broker of `settings.bootstrap` answers a metadata request; `TopicError`
    naming the address after `timeout` s (or at once for a refused password or an untrusted CA).
    librdkafka's own log is off for this one probe: a broker that is not there would print a
    "Connection refused" line every 50 ms for the whole wait."""
    try:
        _describe(admin(settings, quiet=True), timeout)
    except TopicError as exc:
        raise TopicError(f"no Kafka broker answers at {settings.bootstrap} within {timeout:g} s ({exc}); "
                         f"is it running (`xidstream broker status`) and is the address right?") from None


def _describe(client: AdminClient, timeout: float) -> dict[str, int]:
    """Topic name -> partitions. A refused password, an untrusted CA: `TopicError` naming it as
    soon as librdkafka reports it, not after `timeout`."""
    md = _metadata(client, timeout)
    return {name: len(t.partitions) for name, t in md.topics.items() if not t.error}


def _metadata(client: AdminClient, timeout: float) -> Any:
    """The cluster's metadata (`ClusterMetadata`), with `_describe`'s errors."""
    import time

    errors: ClientErrors | None = getattr(client, "xidstream_errors", None)
    deadline = time.monotonic() + timeout
    while True:
        step = max(0.1, min(2.0, deadline - time.monotonic()))
        try:
            md = client.list_topics(timeout=step)
            break
        except KafkaException as exc:
            client.poll(0)  # serves error_cb and the log lines (transport.kafka_log)
            if errors is not None and errors.fatal:
                raise TopicError(errors.fatal) from None
            if time.monotonic() >= deadline:
                where = errors.config.get("bootstrap.servers", "?") if errors is not None else "?"
                raise TopicError(unreachable(str(where), timeout, exc, "to list topics")) from None
    return md


def list_topics(client: Any, timeout: float, topic: str | None = None) -> Any:
    """`client.list_topics(topic, timeout)` in steps of at most 1 s with a `poll(0)` between:
    the same answer, or the same KafkaException at `timeout`, with the client's log lines served
    while it waits (transport.kafka_log), not all at once when it gives up."""
    deadline = time.monotonic() + timeout
    while True:
        step = max(0.1, min(1.0, deadline - time.monotonic()))
        try:
            return client.list_topics(timeout=step) if topic is None else client.list_topics(topic, timeout=step)
        except KafkaException:
            client.poll(0)
            if time.monotonic() >= deadline:
                raise


def unreachable(bootstrap: str, waited_s: float, exc: object, doing: str = "") -> str:
    """The sentence for a command that gave up on Kafka: the address, how long it tried, the
    cause in words (the latest librdkafka line about it, e.g. "broker 127.0.0.1:1 unreachable:
    Connection refused", else the client's error), and what to check. The folded log's counts go
    out first, so that the command's last line is this one."""
    cause = KAFKA_LOG.latest(bootstrap) or str(exc)
    KAFKA_LOG.flush()
    return (f"cannot reach Kafka at {bootstrap}{' ' + doing if doing else ''}: no broker answered within "
            f"{waited_s:g} s ({cause}); is the address right (--bootstrap, XIDSTREAM_BOOTSTRAP) and a broker running?")


def _brokers(md: Any) -> int:
    """How many brokers the cluster has, by its metadata: those it lists (the live ones) and those
    that hold a replica of a topic it lists, so a broker down for a restart still counts."""
    ids = set(md.brokers)
    for t in md.topics.values():
        for p in (t.partitions or {}).values():
            ids.update(p.replicas or ())
    return len(ids)


def choose_replication(brokers: int, replication_factor: int | None = None,
                       min_insync_replicas: int | None = None) -> tuple[int, int | None]:
    """(replicas, min.insync.replicas) of a topic made on a cluster of `brokers` brokers: what is
    given, else what the cluster can hold. Three replicas, or one per broker when there are fewer:
    one broker is the only case for one, where a topic's broker is a single point of failure
    whatever the settings say. min.insync.replicas: one less than the replicas, at most 2, so an
    acks=all write survives one broker down (2 of 3, 1 of 2); None (the broker's default) for one
    replica."""
    rf = replication_factor if replication_factor is not None else max(1, min(3, brokers))
    if min_insync_replicas is not None:
        return rf, min_insync_replicas
    return rf, (min(2, rf - 1) if rf > 1 else None)


def settle_replication(settings: KafkaConfig, client: AdminClient | None = None,
                       timeout: float = 10.0) -> tuple[KafkaConfig, str]:
    """`settings` with the replication of the topics it creates settled (`choose_replication`),
    and a line saying what was chosen and why, for a command to print. The cluster is asked for
    its brokers only when the replication factor is not given (--replication-factor,
    XIDSTREAM_REPLICATION): a given one is taken as it is, more than the brokers included (the
    broker then refuses the topic, naming both)."""
    from dataclasses import replace

    brokers = None
    if settings.replication_factor is None:
        brokers = _brokers(_metadata(client or admin(settings), timeout))
    rf, isr = choose_replication(brokers or 0, settings.replication_factor, settings.min_insync_replicas)
    if isr is not None and isr > rf:
        raise ConfigError(f"--min-insync-replicas {isr} is more than the {rf} replica(s) chosen for the {brokers} "
                          f"broker(s) of {settings.bootstrap}: no write with acks=all could succeed")
    why = ("--replication-factor" if brokers is None else
           f"chosen: {brokers} broker{'' if brokers == 1 else 's'} in the cluster")
    isr_text = ("min.insync.replicas: the broker's default" if isr is None else
                f"min.insync.replicas {isr}" + (" (--min-insync-replicas)" if settings.min_insync_replicas else ""))
    return replace(settings, replication_factor=rf, min_insync_replicas=isr), f"replication factor {rf} ({why}), {isr_text}"


def topic_config(settings: KafkaConfig, config: Mapping[str, str]) -> dict[str, str]:
    """A new topic's configuration with the settings' min.insync.replicas, when one is set."""
    out = dict(config)
    if settings.min_insync_replicas is not None:
        out["min.insync.replicas"] = str(settings.min_insync_replicas)
    return out


def replication_findings(found: Mapping[str, tuple[int, int | None]], replication_factor: int,
                         min_insync_replicas: int | None, brokers: int) -> list[str]:
    """One line per topic whose replication is not what the settings assume: `found` is topic ->
    (replication factor, min.insync.replicas or None when it could not be read). Also a topic of
    one replica on a cluster of several brokers, whatever the settings say: its broker's loss
    stops every writer and reader of it, however many brokers are left."""
    out = []
    for topic, (rf, isr) in sorted(found.items()):
        if rf != replication_factor:
            out.append(f"topic {topic}: replication factor {rf}, expected {replication_factor} "
                       f"(--replication-factor)")
        elif rf == 1 and brokers > 1:
            out.append(f"topic {topic}: replication factor 1 on a cluster of {brokers} brokers, expected "
                       f"{min(3, brokers)}: one broker's loss stops it (--replication-factor)")
        if min_insync_replicas is not None and isr is not None and isr != min_insync_replicas:
            out.append(f"topic {topic}: min.insync.replicas {isr}, expected {min_insync_replicas} "
                       f"(--min-insync-replicas)")
        elif isr is not None and rf > 1 and isr >= rf:
            out.append(f"topic {topic}: min.insync.replicas {isr} with {rf} replicas, expected at most {rf - 1}: "
                       f"any broker down blocks every acks=all write")
    return out


def check_replication(settings: KafkaConfig, topics: Iterable[str], *, timeout: float = 10.0,
                      logger: Any = None) -> list[str]:
    """At a client's start: warn, one line per finding (`replication_findings`), when a physical
    topic of `topics` is replicated otherwise than the settings assume (what `choose_replication`
    makes of them for this cluster: a topic created with them would be so); returns the findings.
    Never raises: a topic that is missing, a broker that does not answer, or a user not allowed
    to read topic configs (DescribeConfigs) only narrows what is checked."""
    from confluent_kafka.admin import ConfigResource

    log = logger or logging.getLogger("xidstream.kafka")
    names = list(topics)
    try:
        client = admin(settings)
        md = client.list_topics(timeout=timeout)
    except KafkaException as exc:
        log.info("replication check skipped: %s", exc)
        return []
    present = [t for t in names if t in md.topics and md.topics[t].error is None and md.topics[t].partitions]
    isr: dict[str, int | None] = {t: None for t in present}
    if present:
        futures = client.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t) for t in present],
                                          request_timeout=timeout)
        for res, fut in futures.items():
            try:
                entry = fut.result(timeout=timeout).get("min.insync.replicas")
                isr[res.name] = int(entry.value) if entry is not None and entry.value is not None else None
            except Exception as exc:  # noqa: BLE001 - not allowed (ACL), timed out: check the rest
                log.debug("cannot read min.insync.replicas of %s: %s", res.name, exc)
        # a failed future keeps its exception and, through its traceback, this frame: without this
        # the admin client would be destroyed by a later garbage collection (see LagProbe.lag)
        futures.clear()
    found = {t: (max(len(p.replicas) for p in md.topics[t].partitions.values()), isr[t]) for t in present}
    brokers = _brokers(md)
    rf, min_isr = choose_replication(brokers, settings.replication_factor, settings.min_insync_replicas)
    findings = replication_findings(found, rf, min_isr, brokers)
    for line in findings:
        log.warning("replication: %s", line)
    return findings


def check_copartitioning(settings: KafkaConfig, existing: dict[str, int]) -> None:
    """Raise `TopicError` unless every input topic has `settings.partitions` partitions."""
    reg = settings.topics
    wrong = {
        reg.name(n): existing[reg.name(n)]
        for n, spec in TOPICS.items()
        if spec.co_partitioned and reg.name(n) in existing and existing[reg.name(n)] != settings.partitions
    }
    if wrong:
        listing = ", ".join(f"{t} has {p}" for t, p in sorted(wrong.items()))
        raise TopicError(
            f"input topics must all have {settings.partitions} partitions to be co-partitioned by "
            f"GPU UUID (the stream processor joins them per key): {listing}. Either set "
            f"--partitions to match, or grow the topics (`kafka-topics --alter --partitions`; note "
            f"that this moves keys between partitions) and restart the processor."
        )


def _lost_request(err: Any) -> bool:
    """A request lost with its connection rather than answered: librdkafka drops the bootstrap
    brokers' handles once the metadata names the real ones, and a CreateTopics queued on one fails
    with _DESTROY_BROKER ("Broker handle destroyed without termination"; seen on a fresh
    three-broker cluster), or the connection broke (_TRANSPORT)."""
    from confluent_kafka import KafkaError

    code = getattr(err, "code", lambda: None)()
    return code in (KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT) or bool(getattr(err, "retriable", lambda: False)())


def create_topics(settings: KafkaConfig, names: Iterable[str] | None = None, timeout: float = 30.0) -> dict[str, str]:
    """Create the registry's topics that do not exist; check those that do.

    Returns physical topic name -> "created" | "exists". Idempotent. Replicated as the settings
    say, else as the cluster can hold (`settle_replication`).
    """
    client = admin(settings)
    settings, replication = settle_replication(settings, client, timeout)
    logging.getLogger("xidstream.kafka").info("topics: %s", replication)
    reg = settings.topics
    wanted = list(names) if names is not None else list(TOPICS)
    existing = _describe(client, timeout)
    check_copartitioning(settings, existing)
    new = [
        NewTopic(reg.name(n), num_partitions=settings.partitions,
                 replication_factor=settings.replication_factor, config=topic_config(settings, TOPICS[n].config()))
        for n in wanted if reg.name(n) not in existing
    ]
    result = {reg.name(n): "exists" for n in wanted if reg.name(n) in existing}
    for attempt in range(3):
        if not new:
            break
        futures = client.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
        again = []
        for topic in new:
            name = topic.topic
            try:
                futures[name].result()
                result[name] = "created"
            except KafkaException as exc:
                err = exc.args[0]
                if getattr(err, "name", lambda: "")() == "TOPIC_ALREADY_EXISTS":
                    result[name] = "exists"
                elif _lost_request(err) and attempt < 2:
                    again.append(topic)  # creating is idempotent: asked again (exists, if it got there)
                else:
                    raise TopicError(f"cannot create topic {name}: {err}") from None
        new = again
        if new:
            logging.getLogger("xidstream.kafka").info("creating %d topic(s) again: the request was lost with its "
                                                      "connection", len(new))
            time.sleep(0.5 * (attempt + 1))
    # Wait until the broker's metadata shows them (a fresh KRaft broker lags the controller by a
    # moment, and the next client to ask must not be told they are missing).
    deadline = time.monotonic() + timeout
    wanted_names = {reg.name(n) for n in wanted}
    while True:
        existing = _describe(client, timeout)
        if wanted_names <= set(existing) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # A topic created concurrently by someone else may still have the wrong count.
    check_copartitioning(settings, existing)
    return dict(sorted(result.items()))


def delete_topics(settings: KafkaConfig, timeout: float = 30.0) -> list[str]:
    """Test and benchmark clean-up: with a topic prefix, everything the run created under it
    (`delete_run`: also the processor's internal topics, changelogs, faust's assignor topic and
    the consumer groups, which a worker of the run leaves behind); without one, only the registry's
    topics (never every topic of a cluster)."""
    if settings.topic_prefix:
        return delete_run(settings, timeout)["topics"]
    client = admin(settings)
    reg = settings.topics
    existing = _describe(client, timeout)
    names = [reg.name(n) for n in TOPICS if reg.name(n) in existing]
    if not names:
        return []
    for fut in client.delete_topics(names, operation_timeout=timeout).values():
        try:
            fut.result()
        except KafkaException:
            pass
    return names


def _reader(settings: KafkaConfig, **overrides: object) -> Any:
    """A consumer for the tools' reads, under a group of its own named under the run's prefix (so
    a run's clean-up, `delete_run`, takes it too); it commits nothing."""
    import uuid

    from confluent_kafka import Consumer

    return Consumer(consumer_config(settings, f"{settings.topic_prefix}xidstream-read-{uuid.uuid4().hex[:12]}",
                                    **overrides))


def read_all(settings: KafkaConfig, topics: list[str], *, timeout: float = 10.0, idle: float = 1.5,
             expected: int | None = None) -> list:
    """Read physical `topics` from the beginning until `expected` messages arrived, or nothing
    new came for `idle` seconds after the end offsets were reached, or `timeout` passed.

    Returns confluent-kafka `Message` objects (errors skipped). For tools and tests, not hot paths.
    """
    import time

    from confluent_kafka import KafkaError

    consumer = _reader(settings)
    consumer.subscribe(topics)
    out = []
    deadline = time.monotonic() + timeout
    last_new = time.monotonic()
    try:
        while time.monotonic() < deadline:
            batch = consumer.consume(num_messages=500, timeout=0.2)
            fresh = [m for m in batch if m.error() is None]
            for m in batch:
                if m.error() is not None and m.error().code() != KafkaError._PARTITION_EOF:
                    raise TopicError(f"error reading {m.topic()}: {m.error()}")
            if fresh:
                out.extend(fresh)
                last_new = time.monotonic()
            if expected is not None and len(out) >= expected:
                break
            if expected is None and out and time.monotonic() - last_new > idle:
                break
    finally:
        consumer.close()
    return out


def read_since(settings: KafkaConfig, topics: list[str], since_ms: int, *, timeout: float = 120.0) -> Iterator[Any]:
    """The messages of physical `topics` stamped at or after `since_ms` (epoch ms), up to each
    partition's end as it was when the read began: a bounded read that ends when it reached those
    offsets (no waiting for silence), for the operator's commands. No group is joined and nothing
    is committed. Raises TopicError for a missing topic, or when the ends are not reached in time."""
    import time

    from confluent_kafka import KafkaError, TopicPartition

    consumer = _reader(settings, **{"enable.partition.eof": True})
    try:
        try:
            meta = list_topics(consumer, 15)
        except KafkaException as exc:  # a clear sentence, not a traceback (`xidstream incidents`)
            consumer.poll(0)  # serves the log lines the wait left queued
            raise TopicError(unreachable(settings.bootstrap, 15, exc, "to read " + ", ".join(topics))) from None
        tps = []
        for t in topics:
            tm = meta.topics.get(t)
            if tm is None or tm.error is not None:
                raise TopicError(f"topic {t} does not exist on {settings.bootstrap} (xidstream topics create)")
            tps += [TopicPartition(t, p, since_ms) for p in sorted(tm.partitions)]
        starts = _retrying(lambda: consumer.offsets_for_times(tps, timeout=15))
        todo: dict[tuple[str, int], int] = {}
        assign = []
        for tp in starts:
            end = _retrying(lambda: consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=15))[1]
            if 0 <= tp.offset < end:  # -1: nothing stamped since then
                todo[(tp.topic, tp.partition)] = end
                assign.append(TopicPartition(tp.topic, tp.partition, tp.offset))
        if not todo:
            return
        consumer.assign(assign)
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TopicError(f"read of {', '.join(topics)} did not reach the end of "
                                 f"{', '.join(f'{t}[{p}]' for t, p in todo)} within {timeout:g} s")
            for m in consumer.consume(num_messages=1000, timeout=0.5):
                key = (m.topic(), m.partition())
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        todo.pop(key, None)
                        continue
                    raise TopicError(f"error reading {m.topic()}: {m.error()}")
                if key in todo:
                    yield m
                    if m.offset() + 1 >= todo[key]:
                        del todo[key]
    finally:
        consumer.close()


def _retrying(call: Callable[[], Any], within: float = 15.0) -> Any:
    """`call()`, again while it fails with an error Kafka calls retriable (a leader moving or just
    elected: NOT_LEADER_FOR_PARTITION on a topic a moment old failed `xidstream incidents` in CI),
    for up to `within` s; then, or at any other error, the error."""
    import time

    deadline = time.monotonic() + within
    while True:
        try:
            return call()
        except KafkaException as exc:
            from confluent_kafka import KafkaError

            err = exc.args[0] if exc.args else None
            code = err.code() if hasattr(err, "code") else None
            # librdkafka does not mark a ListOffsets' NOT_LEADER as retriable: the codes are named
            moving = code in (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                              KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT)
            if not (moving or (hasattr(err, "retriable") and err.retriable())) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def murmur2_partition(key: bytes, partitions: int) -> int:
    """The partition the Java client, aiokafka and our producers (`partitioner=murmur2_random`)
    put `key` on: Kafka's murmur2, made positive, modulo the partition count. One GPU's records
    are read from that one partition."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def murmur2(key: bytes) -> int:
    """Kafka's murmur2 (org.apache.kafka.common.utils.Utils.murmur2) as the Java int it returns."""
    m, length = 0x5BD1E995, len(key)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(key[i:i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail, rest = length % 4, length - length % 4
    if tail == 3:
        h ^= key[rest + 2] << 16
    if tail >= 2:
        h ^= key[rest + 1] << 8
    if tail >= 1:
        h ^= key[rest]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def read_key(settings: KafkaConfig, topic: str, key: bytes, start_ms: int, end_ms: int, *,
             timeout: float = 60.0) -> list[Any]:
    """The messages of physical `topic` with `key`, stamped in [start_ms, end_ms]: only the key's
    partition is read, from its first offset published at `start_ms` until one published 10 minutes
    past `end_ms` or the end offset found when the read began (the caller filters by the records'
    own times). For one GPU's samples over an incident's span."""
    import time

    from confluent_kafka import KafkaError, TopicPartition

    consumer = _reader(settings, **{"enable.partition.eof": True})
    out: list[Any] = []
    try:
        tm = consumer.list_topics(topic, timeout=15).topics.get(topic)
        if tm is None or tm.error is not None or not tm.partitions:
            raise TopicError(f"topic {topic} does not exist on {settings.bootstrap}")
        part = murmur2_partition(key, len(tm.partitions))
        [start] = consumer.offsets_for_times([TopicPartition(topic, part, start_ms)], timeout=15)
        end = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=15)[1]
        if not 0 <= start.offset < end:
            return out
        consumer.assign([TopicPartition(topic, part, start.offset)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in consumer.consume(num_messages=1000, timeout=0.5):
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        return out
                    raise TopicError(f"error reading {topic}: {m.error()}")
                if m.key() == key:
                    # The broker's timestamp is when a collector published: a sample spooled through
                    # a short broker outage is published late, so the read goes 10 minutes past the
                    # span. Only this key's own records end it: another node's record on the same
                    # partition, stamped far ahead, must not cut this GPU's chart short.
                    if m.timestamp()[1] > end_ms + 600_000:
                        return out
                    out.append(m)
                if m.offset() + 1 >= end:
                    return out
        raise TopicError(f"read of {topic}[{part}] did not reach its end within {timeout:g} s")
    finally:
        consumer.close()


def _wait_visible(client: AdminClient, wanted: dict[str, int], timeout: float) -> dict[str, int]:
    """Until the broker's metadata shows every topic of `wanted` with its partitions (a fresh KRaft
    broker lags its controller by a moment); returns what it last saw."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        existing = _describe(client, timeout)
        if all(existing.get(n) == p for n, p in wanted.items()) or time.monotonic() > deadline:
            return existing
        time.sleep(0.2)


def ensure_processor_topics(settings: KafkaConfig, internal: dict[str, int], timeout: float = 30.0, *,
                            compacted: dict[str, int] | None = None) -> set[str]:
    """Check the processor's inputs (they must exist, co-partitioned), then create its internal
    topics (`internal`, 7 days' retention) and its tables' changelogs (`compacted`: the latest row
    per key survives), or check the partition count of those that exist.

    Returns only when the broker's metadata shows all of them with their partition counts: a client
    that starts next must not be told that a topic has 0 partitions (faust's PartitionsMismatch).
    Returns the contract names of the inputs a release added (not `required`) that are missing or
    that this user may not READ: the worker leaves them out of its subscription (a subscribed
    topic it may not read fails the consumer, and with it every rule) until a restart finds them."""
    import time

    client = admin(settings)
    settings, replication = settle_replication(settings, client, timeout)
    logging.getLogger("xidstream.kafka").info("processor topics: %s", replication)
    reg = settings.topics
    deadline = time.monotonic() + 10.0
    while True:  # topics created a moment ago may not be in the metadata yet
        existing = _describe(client, timeout)
        missing = [reg.name(n) for n, s in TOPICS.items() if reg.name(n) not in existing and s.processed and s.required]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if missing:
        raise TopicError(f"topics missing on {settings.bootstrap}: {', '.join(missing)}; run `xidstream topics create` "
                         f"with the same --topic-prefix and --partitions")
    # a topic a release added (gpu.counters) is no reason to stop deciding: an upgrade runs the
    # processor before anyone created it. Left out of the worker's subscription (returned), as one
    # it may not READ is: a restart after the topic is created and granted takes it in.
    skip: set[str] = set()
    for n, spec in TOPICS.items():
        if spec.required:
            continue
        if reg.name(n) not in existing:
            what = ("the rules that read it are off until the processor restarts after it is created and granted "
                    "(READ and DESCRIBE)" if spec.processed else "the processor does not read it")
            logging.getLogger("xidstream.kafka").warning(
                "topic %s is missing on %s: %s (run `xidstream topics create`; transport/acls.py)",
                reg.name(n), settings.bootstrap, what)
            skip.add(n)
        elif spec.processed and not _may_read(client, reg.name(n), timeout):
            logging.getLogger("xidstream.kafka").warning(
                "topic %s: this processor's user may not READ it; the rules that read it are off until the processor "
                "restarts after the grant (`xidstream acls apply`, transport/acls.py)", reg.name(n))
            skip.add(n)
    check_copartitioning(settings, existing)
    compacted = dict(compacted or {})
    wanted = {**internal, **compacted}
    new = []
    for name, parts in wanted.items():
        if name in existing:
            if existing[name] != parts:
                what = "changelog" if name in compacted else "internal topic"
                raise TopicError(f"{what} {name} has {existing[name]} partitions, needs {parts}; delete it "
                                 f"(the processor recreates it{'; its table is rebuilt from the inputs' if name in compacted else ''}) "
                                 f"or set --partitions to {existing[name]}")
            continue
        config = {"cleanup.policy": "compact"} if name in compacted else {"retention.ms": str(7 * 24 * 3600 * 1000)}
        new.append(NewTopic(name, num_partitions=parts, replication_factor=settings.replication_factor,
                            config=topic_config(settings, config)))
    if new:
        for name, fut in client.create_topics(new, operation_timeout=timeout).items():
            try:
                fut.result()
            except KafkaException as exc:
                if getattr(exc.args[0], "name", lambda: "")() != "TOPIC_ALREADY_EXISTS":
                    raise TopicError(f"cannot create {name}: {exc.args[0]}") from None
    seen = _wait_visible(client, wanted, timeout)
    wrong = {n: seen.get(n, 0) for n, p in wanted.items() if seen.get(n) != p}
    if wrong:
        raise TopicError("the broker does not show the processor's topics with their partition counts after "
                         f"{timeout:g} s: " + ", ".join(f"{n} has {c}, needs {wanted[n]}" for n, c in sorted(wrong.items())))
    check_replication(settings, [reg.name(n) for n in TOPICS] + list(wanted), timeout=timeout)
    return skip


def _may_read(client: AdminClient, name: str, timeout: float) -> bool:
    """Whether the broker says this user may READ topic `name` (its authorized operations); True
    when it does not say (an older broker, no authorizer: nothing is refused there)."""
    from confluent_kafka import TopicCollection
    from confluent_kafka.admin import AclOperation

    try:
        desc = client.describe_topics(TopicCollection([name]), request_timeout=timeout,
                                      include_authorized_operations=True)[name].result()
    except Exception:  # noqa: BLE001 - the subscription's own errors say more than a guess here
        return True
    ops = desc.authorized_operations
    return ops is None or AclOperation.READ in ops or AclOperation.ALL in ops


def delete_run(settings: KafkaConfig, timeout: float = 30.0) -> dict[str, list[str]]:
    """Delete every topic and consumer group named under this run's topic prefix: the contract
    topics, the processor's internal ones, its changelogs, faust's assignor topic and the groups.
    For runs that own a unique prefix (replay, tests): refuses an empty prefix, which names the
    whole cluster. Waits until the broker no longer lists the topics. Returns what it deleted."""
    import time

    prefix = settings.topic_prefix
    if not prefix:
        raise TopicError("refusing to delete a run's topics without a topic prefix: that would be every topic")
    client = admin(settings)
    topics = sorted(n for n in _describe(client, timeout) if n.startswith(prefix))
    if topics:
        for fut in client.delete_topics(topics, operation_timeout=timeout).values():
            try:
                fut.result()
            except KafkaException:
                pass  # already gone (a concurrent clean-up); checked below
    groups: list[str] = []
    try:
        listed = client.list_consumer_groups(request_timeout=timeout).result()
        groups = sorted(g.group_id for g in listed.valid if g.group_id.startswith(prefix))
    except KafkaException:
        pass
    if groups:
        for fut in client.delete_consumer_groups(groups, request_timeout=timeout).values():
            try:
                fut.result()
            except KafkaException:
                pass  # a group with a member still leaving; reported by the caller's check
    deadline = time.monotonic() + timeout
    while topics and time.monotonic() < deadline:
        if not any(n.startswith(prefix) for n in _describe(client, timeout)):
            break
        time.sleep(0.2)
    return {"topics": topics, "groups": groups}


class LagProbe:
    """Messages in `topics` that consumer group `group` has not committed; reuses its clients
    while their answers move, so it can be asked every second without loading a small machine.

    The committed offsets are read by a consumer of the group itself (`Consumer.committed`: an
    OffsetFetch; it never subscribes, so it never joins the group or takes a partition), not by
    `AdminClient.list_consumer_group_offsets`: when the group's coordinator moved (its broker
    SIGKILLed), librdkafka 2.16 handled the admin OffsetFetch's "not coordinator" answer through
    the consumer-group code an admin client does not have, and the process died of a segmentation
    fault (core dump of the three-broker test: rd_kafka_ListConsumerGroupOffsetsResponse_parse ->
    rd_kafka_handle_OffsetFetch -> rd_kafka_cgrp_op). A consumer has that code and re-finds the
    coordinator.

    Mostly: once, on the three-broker cluster, a probe made while the group's coordinator was
    about to move (its preferred node just restarted) read "nothing committed" for 75 s while the
    worker committed every 0.25 s, to the old coordinator and then to the new one (its DEBUG log),
    and a new consumer read the commits at once. That probe was the "worker made no commit for two
    minutes" of the cluster tier (docs/development.md). So a reading that finds nothing committed,
    or the same committed offsets for `renew_after` s while messages wait, makes the next reading
    with a new consumer: at most one per `renew_after` s, counted from the last one made, so a
    group that has not committed yet (a worker starting) costs a new consumer every 5 s."""

    def __init__(self, settings: KafkaConfig, group: str, topics: list[str], timeout: float = 10.0,
                 renew_after: float = 5.0) -> None:
        self.settings, self.group, self.topics, self.timeout = settings, group, topics, timeout
        self.renew_after = renew_after
        self.admin = admin(settings)
        self.probe = self._consumer()
        self.renewed = 0  # consumers made anew (`renew_after`)
        self._made = self._changed = time.monotonic()
        self._commits: tuple | None = None  # the committed offsets the last reading found
        self._last: tuple | None = None
        self._tps: list | None = None

    def _consumer(self) -> Any:
        from confluent_kafka import Consumer

        return Consumer(consumer_config(self.settings, self.group))

    def _renew_if_stuck(self, lag: int | None) -> None:
        """A new consumer for the next reading when this one found nothing committed, or the same
        committed offsets for `renew_after` s with messages waiting (by the offsets, not the lag:
        a stuck answer under a flowing topic gives a lag that changes at every reading)."""
        now = time.monotonic()
        if self._commits != self._last:
            self._last, self._changed = self._commits, now
        stuck = lag is None or (lag > 0 and now - self._changed >= self.renew_after)
        if stuck and now - self._made >= self.renew_after:
            fresh = self._consumer()  # made before the old one is closed: a failure leaves that one
            old, self.probe = self.probe, fresh
            old.close()
            self._made = now
            self.renewed += 1

    def _partitions(self) -> list:
        from confluent_kafka import TopicPartition

        if self._tps is not None:
            return self._tps
        md = self.admin.list_topics(timeout=self.timeout)
        tps = [TopicPartition(t, p) for t in self.topics if t in md.topics for p in md.topics[t].partitions]
        if all(t in md.topics for t in self.topics):
            self._tps = tps  # kept once every topic exists (a worker creates its internal ones)
        return tps

    def lag(self) -> int | None:
        """None while the group has committed nothing (or a partition has no leader yet)."""
        lag = self._lag()
        self._renew_if_stuck(lag)
        return lag

    def _lag(self) -> int | None:
        tps = self._partitions()
        if not tps:
            return 0
        self._commits = None
        try:
            got = self.probe.committed(tps, timeout=self.timeout)
        except KafkaException:
            return None
        committed = {(tp.topic, tp.partition): tp.offset for tp in got if tp.error is None}
        self._commits = tuple(sorted(committed.items()))
        lag, seen = 0, False
        for tp in tps:
            try:
                low, high = self.probe.get_watermark_offsets(tp, timeout=self.timeout, cached=False)
            except KafkaException:
                return None
            off = committed.get((tp.topic, tp.partition), -1001)
            seen = seen or off >= 0
            lag += max(0, high - (off if off >= 0 else low))
        return lag if seen or lag == 0 else None

    def close(self) -> None:
        self.probe.close()
        self.admin = None  # destroyed here, not by a garbage collection


def consumer_lag(settings: KafkaConfig, group: str, topics: list[str], timeout: float = 10.0) -> int | None:
    """One-off `LagProbe.lag()`."""
    probe = LagProbe(settings, group, topics, timeout)
    try:
        return probe.lag()
    finally:
        probe.close()
