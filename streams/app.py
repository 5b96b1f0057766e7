"""The faust-streaming app, built by `create_app(config, policy)` from a `xidstream.transport.config.KafkaConfig`
(the command layer passes its Settings, which is one); importing registers nothing.

Topology (aiokafka transport):

    gpu.samples, gpu.processes, gpu.xid, gpu.workloads, gpu.inventory,
    <prefix>xidstream.results-by-gpu  --(agent "gpus", table "gpu-state" keyed by GPU UUID)-->
        alerts -> gpu.alerts
        commands and node sightings -> <prefix>xidstream.fleet (1 partition)
    gpu.remediation.results (keyed by node) --(agent "results-rekey")--> xidstream.results-by-gpu
    <prefix>xidstream.fleet --(agent "fleet", table "fleet-state")--> gpu.remediation, gpu.alerts

Each agent is a class over one `Context` (topics, tables, caches, counters and how an output is
sent or dead-lettered): `GpuAgent` (what happens to a gpu.xid record, or any input), `RekeyAgent`,
`FleetAgent`; `create_app` only wires them.

The input topics and the re-keyed results share one partition count, so one worker owns all of a
GPU's records and its table row (faust co-partitioning; runtime-notes section 2). Every command
passes the one-partition fleet agent, which applies the circuit breaker and keeps a node's commands
in order. No faust join and no windowed table: faust's joins are not implemented and its windows
expire by wall clock; the state in `xidstream.streams.classify.GpuState` expires by event time instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

import faust
import orjson
from aiokafka.errors import (
    CorruptRecordException,
    InvalidTimestampError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnsupportedForMessageFormatError,
)
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from pydantic import ValidationError
from faust.streams import _current_event

from xidstream.schemas.base import Record
from xidstream.schemas.codec import decode, decode_any, encode, to_dict
from xidstream.schemas.errors import DecodeError, TopicError
from xidstream.schemas.models import (
    Alert,
    DeadLetter,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    RemediationCommand,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
)
from xidstream.schemas.topics import INPUT_TOPICS
from xidstream.schemas.vocab import Action
from xidstream.streams import faust_fast
from xidstream.streams.claims import ClaimAlerts
from xidstream.streams.classify import GpuState, step
from xidstream.streams.fleet import FleetState, fleet_step, forget_released
from xidstream.streams.storms import rebuild_node_groups
from xidstream.streams.handoff import MAX_AGE_S, Handoff, HandoffError
from xidstream.streams.metrics import LabelledCounts, metrics_text
from xidstream.transport.identity import CLUSTER_IDENTITY, AuthError
from xidstream.streams.policy import Policy
from xidstream.streams.routing import FLEET_KEY, fan_out, state_key
from xidstream.transport.config import KafkaConfig
from xidstream.transport.faust_auth import faust_kwargs

__all__ = ["create_app", "internal_topics", "assignor_topic", "changelog_topics", "wait_for_partitions", "ProcessorApp", "FLEET_KEY",
           "refused_for_good", "fits", "fleet_row", "bounded_original", "RateLimitedLog", "Context", "GpuAgent",
           "RekeyAgent", "FleetAgent", "guarded", "unconfirmed_reboots"]

log = logging.getLogger(__name__)

_MODELS = {
    "gpu.samples": GpuSample,
    "gpu.processes": GpuProcesses,
    "gpu.xid": XidEvent,
    "gpu.workloads": WorkloadEvent,
    "gpu.inventory": GpuInventory,
}
GPU_TABLE, FLEET_TABLE = "gpu-state", "fleet-state"
# How long one batch may stay in an agent's body before /livez says the worker is stuck. A batch
# of 500 records folds in ~12 ms (24 us a record, bench/processor_bench.py); a send held back by a
# slow broker waits for it within faust's producer timeouts (tens of seconds). Two minutes is well
# past both and still restarts a wedged worker within a few probe periods.
LIVENESS_STALL_S = 120.0
# Actions whose results only the node's own executor may send (executors.gate NODE_ACTIONS).
NODE_EXECUTOR_ACTIONS = frozenset({Action.RESET_GPU, Action.REBOOT_NODE})
NODE_ROW = b"node:"  # fleet table rows of the known nodes (`FleetAgent.load`)
WORKLOAD_ROW = b"workload:"  # fleet table rows of the pods with recent application faults
GROUP_ROW = b"group:"  # fleet table rows of the blast-radius groups (streams.storms), "kind=value"
RELEASED_ROW = b"released:"  # fleet table rows of the commands released within the hand-off's bound


def _exact(data: bytes) -> bytes:
    """An exact-size copy of what orjson.dumps returned: its own result keeps the allocation of
    its write buffer (~2-4 KiB), and the tables hold a row per GPU and per node for good."""
    return bytes(memoryview(data))


# -- outputs the producer refuses -------------------------------------------------------------------
# A send that fails because of the record itself: the producer or the broker refuses it again however
# often it is sent. faust's producer refuses anything over `producer_max_request_size` (1,000,000
# bytes) before it leaves the process (aiokafka's MessageSizeTooLargeError, raised by `send`); the
# broker's own refusals of a record are the rest. aiokafka marks all of them non-retriable.
_REFUSED_FOR_GOOD = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError, CorruptRecordException,
                     InvalidTimestampError, UnsupportedForMessageFormatError)


def refused_for_good(exc: BaseException | None) -> bool:
    """Whether a send failed because of the record itself (`_REFUSED_FOR_GOOD`, anywhere in the
    exception's chain: faust wraps aiokafka's error in its ProducerSendError).

    Only those are dead-lettered. Any other failure is about the worker or the broker, not the
    record: a timeout, a partition without a leader (retriable: resending could work), and also
    non-retriable ones such as a refused authorization or a closed producer, which would refuse
    every output alike. Those are raised, the worker stops, and its restart reads the record again:
    dead-lettering them would drop every alert and command fleet-wide while the worker looked alive."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, _REFUSED_FOR_GOOD):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def fits(key: bytes | None, value: bytes | None, limit: int) -> bool:
    """Whether a record is within the producer's `limit` (max_request_size), by aiokafka's own
    estimate of its size. A table write is sent later, from faust's producer buffer, where a refusal
    crashes the buffer's task and the worker with it: rows are checked before they are written."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, []) <= limit


# A dead letter carries the record it is about byte for byte when that is small, else the record's
# head: a 900 KB record that did not decode made a dead letter of 1.2 MB (base64 in JSON), which the
# producer refused, and the agent died on the dead letter. 64 KiB of the head (87 KiB in base64)
# names the record (its schema, node, GPU, event id come first) without ever nearing the limit.
DEADLETTER_ORIGINAL_BYTES = 64 * 1024
DEADLETTER_KEY_BYTES = 1024  # a Kafka key is a GPU UUID or a node name; a longer one is a head too
_ERROR_CHARS = 2000  # a dead letter's error text
_OUTPUT_HEAD_CHARS = 400  # of a refused output, quoted in its dead letter's error text


def bounded_original(raw: bytes | None, key: bytes | None) -> tuple[bytes, bytes | None, str]:
    """(value, key, a note for the error text): what a dead letter carries of the record."""
    raw, note = raw or b"", ""
    if len(raw) > DEADLETTER_ORIGINAL_BYTES:
        note = f" [original truncated: the first {DEADLETTER_ORIGINAL_BYTES:,} of {len(raw):,} bytes]"
        raw = raw[:DEADLETTER_ORIGINAL_BYTES]
    if key is not None and len(key) > DEADLETTER_KEY_BYTES:
        note += f" [key truncated: the first {DEADLETTER_KEY_BYTES:,} of {len(key):,} bytes]"
        key = key[:DEADLETTER_KEY_BYTES]
    return raw, key, note


def fleet_row(data: dict, limit: int) -> bytes:
    """The fleet agent's main row (`FleetState.to_dict()` without the node and pod rows), as
    written to its table.

    Its `starts` (one per node-level command within the breaker's window) grow with a storm, the
    very time the breaker's state must survive a restart: at 4 commands a node, a storm over 12,500
    nodes is 50,000 starts, 3 MB (each names its incident). When the row would pass the producer's `limit`, `starts` is
    written as each node's newest start only, which decides exactly as the full list does: the
    breaker reads only which nodes have a start within the window of a command (`fleet_step`), and
    a node has one when its newest one is, and the storm alert names each node's newest incident
    (streams.fleet). (12,500 nodes: 0.74 MB.)"""
    row = _exact(orjson.dumps(data))
    if fits(FLEET_KEY, row, limit) or not data.get("starts"):
        return row
    newest: dict[str, list] = {}
    for start in data["starts"]:  # [ts, node, incident] ([ts, node] from an older row)
        node = start[1]
        if node not in newest or start[0] > newest[node][0]:
            newest[node] = start
    return _exact(orjson.dumps({**data, "starts": sorted(newest.values(), key=lambda s: (s[0], s[1]))}))


class RateLimitedLog:
    """At most one log line per kind of message every `every_s` seconds, with a count of the lines
    left out since: a flood of bad records or refused outputs (each dead-lettered and counted on
    /metrics) must not become a flood of log lines too."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: Any) -> bool:
        """Log `msg % args` unless a line of `kind` was logged within `every_s`; True when logged."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return False
        self._last[kind] = now
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg += f" (and {left_out} more like it in the last %.0f s, not logged)"
            args = (*args, now - last if last is not None else self.every_s)
        self.logger.log(level, msg, *args)
        return True


TRIM_INTERVAL_S = 10.0
# Records aiokafka hands over per fetch (faust: all it holds, tens of thousands in a catch-up). Each
# becomes Python objects at once, and the pymalloc arenas they grow stay with the process, pinned
# by a few long-lived objects: after a 10,000-GPU catch-up 3.5 KiB per GPU were empty pools in
# kept arenas, beside 1.3 KiB of live objects (`sys._debugmallocstats()`). 2,000 at a
# time: 2.7 instead of 5.2-8.1 KiB per GPU. The worker's CPU from start to lag 0 is the same
# (3.11 vs 3.13 s for 2,000 GPUs x 20 s); the CPU per record "from the first commit" looks 5 us
# higher only because the first unlimited fetch parsed most of the load before that commit.
MAX_POLL_RECORDS = 2000


def release_free_memory() -> None:
    """Hand free heap pages back to the OS (glibc's malloc_trim); a no-op without glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def decode_input(model: type[Record], raw: bytes | None) -> Record:
    """`xidstream.schemas.codec.decode`, with the common case in one pass: pydantic parses the JSON itself
    (3.6 instead of 5.2 us for a sample). What that refuses (an older schema version to
    relabel, a bad record) goes through `decode`, which relabels it or raises its DecodeError."""
    try:
        return model.model_validate_json(raw)  # type: ignore[arg-type]
    except ValidationError:
        return decode(model, raw)


def internal_topics(settings: KafkaConfig) -> dict[str, int]:
    """Topics the processor needs besides the contract's: name -> partitions."""
    p = settings.topic_prefix
    return {f"{p}xidstream.results-by-gpu": settings.partitions, f"{p}xidstream.fleet": 1}


def assignor_topic(app_id: str) -> dict[str, int]:
    """faust's leader-election topic (`faust.assignor.LeaderAssignor`): name -> partitions (1)."""
    return {f"{app_id}-__assignor-__leader": 1}


def changelog_topics(settings: KafkaConfig, app_id: str) -> dict[str, int]:
    """The tables' changelog topics (faust names them ``<app id>-<table>-changelog``): name ->
    partitions. The GPU table is co-partitioned with the inputs; the fleet table has one row."""
    return {f"{app_id}-{GPU_TABLE}-changelog": settings.partitions, f"{app_id}-{FLEET_TABLE}-changelog": 1}


async def wait_for_partitions(lookup: Callable[[str], int | None], refresh: Callable[[], Awaitable[Any]],
                              topics: Iterable[str], *, timeout: float = 60.0, poll: float = 0.5) -> None:
    """Until `lookup(topic)` gives a partition count for every topic, asking `refresh()` for fresh
    metadata in between; `TopicError` naming the topic after `timeout` s.

    faust checks a table's changelog against its source topic before the first write, with the
    counts of the consumer's metadata, where a subscribed topic the consumer has no metadata for
    yet counts 0 partitions: the write then fails with PartitionsMismatch ("the changelog topic ...
    has 0 partitions"). None means there is no consumer (agent.test_context()): nothing to wait for.
    """
    topics = list(topics)
    deadline = time.monotonic() + timeout
    while True:
        unknown = [t for t in topics if lookup(t) == 0]
        if not unknown:
            return
        if time.monotonic() >= deadline:
            raise TopicError(f"Kafka metadata still gives {', '.join(unknown)} 0 partitions after {timeout:g} s; "
                             f"is the topic there (`xidstream topics list`) and the broker healthy?")
        await refresh()
        await asyncio.sleep(poll)


class _App(faust.App):
    """faust's App with the cuts of `xidstream.streams.faust_fast` (the consumer's delivery, no Monitor
    sensor) and one hook: `prepare` runs (in a thread; it is blocking admin I/O) when the worker
    first starts, before faust starts its producer, consumer and tables."""

    prepare: Callable[[], None] | None = None
    batch: int = 500

    def _new_transport(self) -> Any:
        return faust_fast.faster_transport(self, super()._new_transport())

    def on_init_dependencies(self) -> Any:
        deps = super().on_init_dependencies()
        faust_fast.drop_monitor(self)
        return deps

    async def on_first_start(self) -> None:
        # faust stops every agent while more than 100 changelog records wait to be sent; a batch
        # writes up to `batch` rows, and at each minute every GPU's row changes (its clock, kept
        # to the minute): room for a few batches, not a stall per batch (failover bench: "producer
        # buffer full", 16-18k instead of 23-25k records/s).
        self.producer.buffer.max_messages = max(self.producer.buffer.max_messages, 4 * self.batch)
        if self.prepare is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.prepare)
        await super().on_first_start()


class ProcessorApp:
    """The faust app and handles on its topics, for the CLI and the tests."""

    def __init__(self, app: faust.App, **parts: Any) -> None:
        self.app = app
        self.__dict__.update(parts)


# -- the app ------------------------------------------------------------------------------------
def _faust_app(settings: KafkaConfig, app_name: str, *, web_port: int | None, web_bind: str, store: str,
               datadir: str | None, fast_rebalance: bool) -> _App:
    """faust's App with the settings this processor needs from it."""
    # Failover: a worker killed without leaving its group is noticed when its session
    # expires; until then its share of the fleet is processed by nobody. faust's defaults (60 s
    # session, 60 s rebalance) left a blind share for a minute after one SIGKILL. 6 s is the
    # broker's smallest accepted session (group.min.session.timeout.ms); heartbeats every second
    # tell a survivor of the rebalance within a second; a member that does not rejoin within 10 s
    # is dropped from the rebalance. aiokafka heartbeats from the consumer's own thread, so a busy
    # event loop does not miss them. Worst case after a kill: 6 + 1 + the rebalance and the
    # changelog tail (standby replicas keep the survivor's copy current).
    extra: dict[str, Any] = dict(broker_session_timeout=6, broker_heartbeat_interval=1, broker_rebalance_timeout=10)
    # Commit four times a second (faust: every 2.8 s; faust's commit every 10,000 records stays):
    # a survivor or a restarted worker re-reads (and re-emits) at most a quarter second of input,
    # and a catch-up's lag reads true a quarter second after the work is done (failover bench,
    # 2,000 GPUs x 20 s, lag polled every 0.1 s: 29-32k records/s with 1 s, 38-44k with 0.25 s;
    # CPU per record the same, 21-23 us). Four commit requests a second per worker are nothing to
    # the broker.
    extra["broker_commit_interval"] = 0.25
    extra["broker_max_poll_records"] = MAX_POLL_RECORDS
    # Metadata at least every 10 s (faust: 5 minutes). aiokafka refreshes it on most errors that say
    # it is stale, not on all (`faust_fast.mend_aiokafka` mends the one the three-broker tier met),
    # and a refresh asked during one in flight gets that one's answer; a leader that moved with no
    # error to say so (the preferred leader taking its partitions back after a restart) was known
    # only at the next periodic refresh. One small Metadata request per client every 10 s.
    extra["consumer_metadata_max_age_ms"] = extra["producer_metadata_max_age_ms"] = 10_000
    if fast_rebalance:
        # A single test broker: the first JoinGroup takes ~3 s instead of ~30 s (runtime notes).
        extra.update(broker_rebalance_timeout=6, broker_request_timeout=30)
    if datadir:
        extra["datadir"] = datadir
    return _App(
        app_name,
        # broker URLs and credentials from the same librdkafka settings every client reads
        **faust_kwargs(settings),
        autodiscover=False,
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        # Every topic the worker uses is created before faust starts (`prepare_topics`, with the
        # confluent-kafka admin client): faust's own declaration sends CreateTopics to the node its
        # metadata names as controller, and when that broker is down the worker died at start with
        # NodeNotReadyError (the three-broker test: a worker restarted during a broker loss).
        topic_allow_declare=False,
        store=store,
        key_serializer="raw",
        value_serializer="raw",
        consumer_auto_offset_reset="earliest",
        processing_guarantee="at_least_once",
        web_enabled=web_port is not None,
        web_bind=web_bind,
        web_host=web_bind,
        web_port=web_port or 6066,
        # Only the probes and /metrics: faust's /router and /table views answer any caller with
        # which worker holds which GPU's row and the row itself (incidents, pods, PIDs), and the
        # graph and stats views show the topology. Nothing here needs them.
        web_router_enabled=False,
        web_tables_enabled=False,
        web_graph_enabled=False,
        web_stats_enabled=False,
        producer_acks=1 if faust_fast.processor_acks() == "1" else -1,  # -1: all (see IdempotentProducer)
        **extra,
    )


def create_app(settings: KafkaConfig, policy: Policy | None = None, *, app_id: str | None = None,
               web_port: int | None = None, store: str = "memory://", datadir: str | None = None,
               fast_rebalance: bool = False, batch: int = 500, within: float = 0.05,
               signing_key: Any = None, web_bind: str = "127.0.0.1", approver_keys: Any = None,
               verifier: Any = None, skip_inputs: Any = ()) -> ProcessorApp:
    """The topology of the module docstring: topics, tables, the three agents, probes and metrics.

    `signing_key` (a `xidstream.schemas.signing.SigningKey`): every command is signed as it leaves the
    fleet agent, the last place that changes it; executors refuse unsigned commands. It also seals
    what the GPU agents hand to the fleet agent, and `approver_keys` (a `VerifyKeys`) verify a
    breaker reset (`xidstream.streams.handoff`): nobody but this processor's agents gets a command signed.
    `verifier` (a `xidstream.transport.identity.RecordVerifier`, kept current by an `IdentityDirectory`):
    an input record counts only with the MAC of the node it is about, a result only with the MAC
    of the executor entitled to answer its action; anything else is dead-lettered with the reason.
    `web_bind`: where faust's web server (probes, ``/metrics``) listens; loopback unless the
    command says otherwise (in a pod: the pod's address, for the kubelet and Prometheus).
    `skip_inputs`: contract names of inputs left out of the subscription (an added topic that is
    missing or not readable yet: `xidstream.transport.kafka.ensure_processor_topics`)."""
    if type(batch) is not int or batch < 1:
        raise ValueError(f"batch must be a whole number of records >= 1, not {batch!r}")
    if not isinstance(within, (int, float)) or not math.isfinite(within) or within <= 0:
        # a short batch waits up to `within` s for more (faust_fast.take_batches): with inf or NaN
        # a quiet partition's last records (a fatal Xid) would wait for traffic that may never
        # come; 0 and None meant the same in faust's take_events, which the agents used before
        raise ValueError(f"within must be a number of seconds > 0, not {within!r}")
    for drift in faust_fast.faust_drift():  # the cuts into faust's internals may no longer fit
        log.warning("faust internals: %s (re-check streams/faust_fast.py, docs/development.md)", drift)
    policy = policy or Policy()
    reg = settings.topics
    app_name = app_id or f"{settings.topic_prefix}xidstream-processor"
    app = _faust_app(settings, app_name, web_port=web_port, web_bind=web_bind, store=store, datadir=datadir,
                     fast_rebalance=fast_rebalance)
    changelogs = changelog_topics(settings, app_name)

    def prepare_topics() -> None:
        # Before faust starts its producer, consumer and tables: the internal topics and the
        # changelogs exist with the partition counts faust will check, and the broker's metadata
        # shows them, so the consumer's first metadata has them (without it, a changelog faust
        # created a moment before counted 0 partitions and the fleet agent crashed on its first
        # table write). A changelog with a wrong count stops the worker here, with its name.
        from xidstream.transport.kafka import ensure_processor_topics

        ensure_processor_topics(settings, {**internal_topics(settings), **assignor_topic(app_name)},
                                compacted=changelogs)

    app.prepare = prepare_topics
    app.batch = batch
    names = {reg.name(n): n for n in INPUT_TOPICS if n not in set(skip_inputs)}
    rekeyed, fleet_name = list(internal_topics(settings))
    ctx = Context(
        app=app, settings=settings, policy=policy, handoff=Handoff.for_processor(signing_key, approver_keys),
        signing_key=signing_key, verifier=verifier, batch=batch, within=within, names=names, rekeyed=rekeyed,
        inputs=app.topic(*names, rekeyed, schema=faust_fast.RawSchema()),
        results_in=app.topic(reg.name("gpu.remediation.results"), key_type=bytes, value_type=bytes),
        results_by_gpu=app.topic(rekeyed, key_type=bytes, value_type=bytes),
        fleet_topic=app.topic(fleet_name, key_type=bytes, value_type=bytes),
        alerts=app.topic(reg.name("gpu.alerts"), key_type=bytes, value_type=bytes),
        remediation=app.topic(reg.name("gpu.remediation"), key_type=bytes, value_type=bytes),
        deadletter=app.topic(reg.name("xidstream.deadletter"), key_type=bytes, value_type=bytes),
        gpu_table=app.Table(GPU_TABLE, default=None, partitions=settings.partitions, key_type=bytes, value_type=bytes),
        fleet_table=app.Table(FLEET_TABLE, default=None, partitions=1, key_type=bytes, value_type=bytes),
        max_request=app.conf.producer_max_request_size,
    )
    # Signing commands for records no node identity vouches for: on /metrics for the worker's life.
    ctx.labelled.identity_off = int(signing_key is not None and verifier is None)

    @app.on_partitions_revoked.connect
    async def _drop_cache(sender: Any, revoked: Any = None, **kwargs: Any) -> None:
        # State of partitions that moved away must be read from the table again, never from here.
        ctx.cache.clear()
        ctx.fleet_cache.clear()
        ctx.labelled.breaker = 0  # the breaker is the fleet partition's owner's to report

    @app.on_partitions_assigned.connect
    async def _drop_cache_assigned(sender: Any, assigned: Any = None, **kwargs: Any) -> None:
        ctx.cache.clear()
        ctx.fleet_cache.clear()

    gpus = app.agent(ctx.inputs, name="gpus")(guarded(app, "gpus", GpuAgent(ctx)))
    rekey = app.agent(ctx.results_in, name="results-rekey")(guarded(app, "results-rekey", RekeyAgent(ctx)))
    fleet = app.agent(ctx.fleet_topic, name="fleet")(guarded(app, "fleet", FleetAgent(ctx)))

    @app.timer(interval=TRIM_INTERVAL_S)
    async def _give_back_memory() -> None:
        # After a catch-up the fetch and stream buffers' memory is free but still the process's:
        # glibc keeps freed pages until asked (201 -> 157 MiB at 10,000 GPUs).
        release_free_memory()

    @app.page("/livez")
    async def livez(web: Any, request: Any) -> Any:
        # The chart's liveness probe: folding records or idle. 503 once an agent has held one
        # batch past LIVENESS_STALL_S (a wedged send, a body that never returns), so the kubelet
        # restarts the worker; /metrics keeps answering either way and is no sign of life.
        why = faust_fast.BATCHES.stalled(LIVENESS_STALL_S)
        if why is not None:
            log.error("liveness: %s", why)
            return web.text(why + "\n", status=503)
        return web.text("ok: folding records or idle\n")

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        # Prometheus text format: what the worker did since it started (per process; sum over workers)
        try:
            ctx.labelled.unconfirmed = unconfirmed_reboots(ctx.gpu_table.items(), ctx.cache, time.time(),
                                                           policy.reboot_confirm_s)
        except Exception as exc:  # noqa: BLE001 - faust's store; /metrics still answers with the last count
            ctx.quiet.log(logging.WARNING, "unconfirmed", "counting unconfirmed reboots failed: %r", exc)
        return web.text(metrics_text(ctx.stats, ctx.labelled), content_type="text/plain; version=0.0.4")

    return ProcessorApp(app, gpus=gpus, rekey=rekey, fleet=fleet, gpu_table=ctx.gpu_table, fleet_table=ctx.fleet_table,
                        inputs=ctx.inputs, alerts=ctx.alerts, remediation=ctx.remediation, deadletter=ctx.deadletter,
                        fleet_topic=ctx.fleet_topic, results_by_gpu=ctx.results_by_gpu, stats=ctx.stats,
                        labelled=ctx.labelled, policy=policy,
                        settings=settings, changelogs=changelogs, names=names)


def _unanswered_reboot(emitted: Iterable[dict], now: float, bound: float) -> bool:
    return any(e.get("action") == "REBOOT_NODE" and e.get("outcome") is None and isinstance(e.get("ts"), (int, float))
               and now - e["ts"] > bound for e in emitted)


def unconfirmed_reboots(rows: Iterable[tuple[bytes, bytes | None]], cache: dict[bytes, GpuState], now: float,
                        bound: float) -> int:
    """GPUs whose open incident commanded REBOOT_NODE more than `bound` seconds before `now` (this
    worker's clock) and has no answer to it: the node may never have come back, and with it its
    executor and its collector, so nothing of that GPU is read again and the fold, which decides by
    each GPU's records (docs/architecture.md "Known limits"), cannot climb. Counted at each scrape
    from the rows this worker holds (`rows`: its table; `cache`: the rows it folded since, newer),
    so a row that no record touched since a restart counts too. Only rows naming a reboot are read
    (a bytes search first: the table holds every GPU's row)."""
    count = 0
    for key, state in cache.items():
        inc = state.incident
        if inc is not None and _unanswered_reboot(inc.emitted, now, bound):
            count += 1
    for key, raw in rows:
        if key in cache or not raw or b'"REBOOT_NODE"' not in raw:
            continue
        inc = orjson.loads(raw).get("incident")
        if isinstance(inc, dict) and _unanswered_reboot(inc.get("emitted") or (), now, bound):
            count += 1
    return count


def guarded(app: faust.App, name: str, body: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """An agent that dies takes the worker with it. faust's supervisor would restart the actor
    (or, when that fails, leave the worker running without it): a worker without its fleet
    agent releases no command again while looking alive. Crashing the app makes the worker stop
    and exit non-zero, so an orchestrator restarts it whole. One bad record never gets here:
    the agents dead-letter those and go on."""

    async def agent(stream: Any) -> None:
        try:
            await body(stream)
        except Exception as exc:  # noqa: BLE001 - anything that escapes the loop ends the worker
            log.critical("agent %s died: %r; stopping the worker (non-zero exit) so it is restarted whole",
                         name, exc, exc_info=exc)
            await app.crash(exc)

    agent.__name__ = agent.__qualname__ = f"{name}_agent"
    agent.__doc__ = body.__doc__
    return agent


# -- what the agents share ----------------------------------------------------------------------
@dataclass(eq=False)
class Context:
    """One worker's topics, tables, caches and counters, and the three ways an output leaves it:
    sent (`emit`), refused for good and dead-lettered as its source record (`refused`), or a bad
    input dead-lettered (`dead`)."""

    app: Any
    settings: KafkaConfig
    policy: Policy
    handoff: Handoff
    signing_key: Any
    verifier: Any
    batch: int
    within: float
    names: dict[str, str]  # physical input topic -> its contract name
    rekeyed: str  # the results-by-gpu topic
    inputs: Any
    results_in: Any
    results_by_gpu: Any
    fleet_topic: Any
    alerts: Any
    remediation: Any
    deadletter: Any
    gpu_table: Any
    fleet_table: Any
    max_request: int
    cache: dict[bytes, GpuState] = field(default_factory=dict)
    fleet_cache: dict[str, Any] = field(default_factory=dict)  # "state": the FleetState, "row": its main row as last written
    stats: dict[str, int] = field(default_factory=lambda: {
        "events": 0, "deadletters": 0, "alerts": 0, "commands": 0, "rows_written": 0, "outputs_refused": 0,
        "gpu_claims_refused": 0})
    labelled: LabelledCounts = field(default_factory=LabelledCounts)  # the same outputs by verdict and action
    quiet: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))
    verified: set[tuple[str, str]] = field(default_factory=set)
    claims: ClaimAlerts = field(default_factory=ClaimAlerts)  # which refused claims to a GPU row become an alert

    async def partitions_known(self, table: Any, source_topic: str) -> None:
        """Before a table's first write from `source_topic`: wait until the consumer's metadata
        knows both the source and the changelog (see `wait_for_partitions`)."""
        if (table.name, source_topic) in self.verified:
            return
        consumer = self.app._consumer  # None in agent.test_context(): no Kafka, nothing to check
        if consumer is not None:
            async def refresh() -> None:
                thread = consumer._thread  # aiokafka's client lives on the consumer's own thread

                async def force() -> None:
                    await thread._ensure_consumer()._client.force_metadata_update()

                try:
                    await thread.call_thread(force)
                except Exception as exc:  # noqa: BLE001 - faust internals; the bounded wait still decides
                    log.warning("could not ask the consumer for fresh metadata (%r); waiting for its own refresh", exc)

            t0 = time.monotonic()
            await wait_for_partitions(consumer.topic_partitions, refresh,
                                      [source_topic, table.changelog_topic_name])
            if time.monotonic() - t0 > 0.1:
                log.warning("table %s: waited %.1f s for the partition counts of %s and %s before its first write",
                            table.name, time.monotonic() - t0, source_topic, table.changelog_topic_name)
        self.verified.add((table.name, source_topic))

    async def dead(self, raw: bytes | None, key: bytes | None, topic: str, partition: int | None, offset: int | None,
                   error: BaseException, error_type: str | None = None) -> None:
        self.stats["deadletters"] += 1
        kind = error_type or type(error).__name__
        text = str(error)
        self.quiet.log(logging.WARNING, f"dead:{kind}", "dead-lettering a record from %s[%s]@%s: %s", topic, partition,
                       offset, text[:500])
        original, original_key, note = bounded_original(raw, key)
        rec = DeadLetter(node=self.settings.node, original=original, original_key=original_key, source_topic=topic,
                         source_partition=partition, source_offset=offset,
                         error=text[:_ERROR_CHARS - len(note)] + note, error_type=kind)
        try:
            await self.deadletter.send(key=topic.encode(), value=encode(rec))
        except Exception as exc:  # noqa: BLE001 - sorted by refused_for_good: the rest is raised
            if not refused_for_good(exc):
                raise
            # Bounded above, so only a broker or topic limit far below the producer's gets here;
            # there is nowhere left to put it, and stopping would re-read and refuse it for good.
            self.stats["outputs_refused"] += 1
            self.quiet.log(logging.ERROR, "dead:refused", "the dead letter of a record from %s[%s]@%s was refused too "
                           "(%r): dropped", topic, partition, offset, exc)

    async def emit(self, channel: Any, key: bytes, value: bytes, what: str, source: Any) -> bool:
        """Send one output of the record `source` (an event); True when the producer took it.

        An output the producer refuses for good (`refused_for_good`: over its 1,000,000-byte limit,
        or invalid) is dead-lettered as its source record (the reason, where the record came from,
        a bounded head of the record and of the output) and counted, and the agent goes on with the
        record's other outputs and the next record. Before, the refusal escaped the agent, the
        worker stopped, and its restart refused the same uncommitted record again: a crash loop
        that stopped every command fleet-wide (the fleet agent is one partition). Any other send
        failure is raised as before (the worker restarts and reads the record again)."""
        try:
            await channel.send(key=key, value=value)
            return True
        except Exception as exc:  # noqa: BLE001 - sorted by refused_for_good: the rest is raised
            if not refused_for_good(exc):
                raise
            await self.refused(source, f"the producer refused its {what} ({len(value):,} bytes, to "
                               f"{channel.get_topic_name()})", value, exc)
            return False

    async def refused(self, source: Any, why: str, value: bytes, exc: BaseException) -> None:
        """Count and dead-letter the record `source` (an event), one of whose outputs (`value`)
        cannot be sent; `why` says which and what became of it."""
        self.stats["outputs_refused"] += 1
        msg = source.message
        self.quiet.log(logging.ERROR, "refused", "%s, an output of the record from %s[%s]@%s: %r; the record is "
                       "dead-lettered and the agent goes on", why, msg.topic, msg.partition, msg.offset, exc)
        cause = exc
        while not isinstance(cause, _REFUSED_FOR_GOOD) and (cause.__cause__ or cause.__context__) is not None:
            cause = cause.__cause__ or cause.__context__
        head = value[:_OUTPUT_HEAD_CHARS].decode("utf-8", "replace")
        await self.dead(source.value, source.key, msg.topic, msg.partition, msg.offset,
                        RuntimeError(f"{why}: {cause}; the output begins: {head}"), error_type=type(cause).__name__)

    async def send_alert(self, alert: Alert, value: bytes, source: Any) -> None:
        if await self.emit(self.alerts, (alert.gpu_uuid or alert.node).encode(), value, "alert", source):
            self.stats["alerts"] += 1
            self.labelled.alert(alert)


# -- agent "gpus": the input topics and the re-keyed results -> a GPU's row -----------------------
class GpuAgent:
    """Every input record (gpu.samples, gpu.processes, gpu.xid, gpu.workloads, gpu.inventory) and
    every re-keyed result is folded into its GPU's row (`xidstream.streams.classify.step`); alerts go to
    gpu.alerts and commands to the fleet agent at once; a row whose persisted facts changed is
    written to the table once per batch."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def __call__(self, stream: Any) -> None:
        ctx = self.ctx
        async for events in faust_fast.take_batches(stream, ctx.batch, ctx.within):
            # One table write per changed row per batch, not one per record: a row
            # folded from 40 records of a batch costs one changelog record, not 40. Exact on
            # recovery: take_batches acks the batch's events only after this body has run, so the
            # offsets faust commits never pass a record whose row was not written; a crash
            # re-reads the uncommitted records onto the last written rows, as before.
            dirty: dict[bytes, tuple[Any, GpuState]] = {}
            for event in events:
                ctx.stats["events"] += 1
                await self.handle(event, dirty)
            for key, (event, state) in dirty.items():
                await self.write(key, event, state)

    async def handle(self, event: Any, dirty: dict[bytes, tuple[Any, GpuState]]) -> None:
        """Fold one event into its row (in the cache); a row whose persisted facts changed goes
        into `dirty`. Alerts and fleet messages go out at once."""
        ctx = self.ctx
        msg = event.message
        topic, key = msg.topic, event.key
        record, sender, raw = await self.decode(event)
        if record is None:
            return
        # The row is chosen by streams.routing, as in streams.engine and the tests. The message's
        # key must name the same row: the row's changelog goes to the message's partition, and a
        # record keyed otherwise would fold into a row another worker owns after a rebalance.
        row = state_key(record)
        if row is None:
            await ctx.dead(raw, key, topic, msg.partition, msg.offset, DecodeError(
                "the record names no GPU: neither gpu_uuid nor node and pci_bus_id", raw))
            return
        if key != row.encode():
            await ctx.dead(raw, key, topic, msg.partition, msg.offset, DecodeError(
                f"record keyed {key!r} belongs to row {row!r}: its producer does not key by the topic "
                f"registry (schemas.topics), so it reached a partition that does not own its GPU", raw))
            return
        owner = None  # set when the row is another node's: two nodes claim one GPU
        try:
            state = ctx.cache.get(key)
            if state is None:
                stored = ctx.gpu_table.get(key)
                state = GpuState.from_dict(orjson.loads(stored)) if stored else None
            if sender is not None and state is not None and state.node and state.node != sender:
                # A GPU row belongs to the node that first spoke for it: node A naming node B's GPU
                # UUID (they are not secret: commands carry them) must not re-point B's row to A,
                # open incidents on it, or answer B's commands for it.
                owner = state.node
                raise AuthError(f"GPU row {row} belongs to node {state.node}; {sender} cannot speak for it")
            state, outputs, changed = step(state, row, record, ctx.policy)
            announced = state.announced
            to_fleet, to_alert = fan_out(state, record, outputs)
            changed = changed or state.announced != announced  # the announcement is part of the row
            fleet_msgs = [orjson.dumps({**m, "command": to_dict(m["command"])} if m["kind"] == "command" else m)
                          for m in to_fleet]
            alert_msgs = [(a, encode(a)) for a in to_alert]
        except AuthError as exc:
            await ctx.dead(raw, key, topic, msg.partition, msg.offset, exc)
            if owner is not None:
                await self.claimed(record, state, row, owner, sender, event)
            return
        except Exception as exc:  # noqa: BLE001 - one bad record must not stop the agent
            log.exception("processing a record from %s failed", topic)
            await ctx.dead(raw, key, topic, msg.partition, msg.offset, exc)
            return
        ctx.cache[key] = state
        for kind, out in outputs:
            if kind == "repair_stage":  # a stage of a repair ended: the histograms on /metrics
                ctx.labelled.stage(out["stage"], out["seconds"])
        if changed:
            dirty[key] = (event, state)
        for a, v in alert_msgs:
            await ctx.send_alert(a, v, event)
        for v in fleet_msgs:
            await ctx.emit(ctx.fleet_topic, FLEET_KEY, ctx.handoff.seal(v), "message to the fleet agent", event)

    async def claimed(self, record: Record, state: GpuState, row: str, owner: str, claimant: str, event: Any) -> None:
        """A record of `claimant` refused because its GPU's row is `owner`'s: counted, and a
        GPU_CLAIM_CONFLICT alert when `xidstream.streams.claims` says one is due (rate-limited by this
        worker's clock)."""
        ctx = self.ctx
        ctx.stats["gpu_claims_refused"] += 1
        alert = ctx.claims.refused(state.gpu_uuid or row, owner, claimant, time.time(), record_schema=record.SCHEMA,
                                   record_ts=record.ts, pci_bus_id=state.pci_bus_id, gpu_index=state.gpu_index)
        if alert is not None:
            ctx.quiet.log(logging.WARNING, "claim", "GPU %s belongs to node %s; node %s claims it too (%s)",
                          alert.gpu_uuid, owner, claimant, alert.summary)
            await ctx.send_alert(alert, encode(alert), event)

    async def decode(self, event: Any) -> tuple[Record | None, str | None, bytes | None]:
        """(the record, the node whose MAC it carries, its bytes unsealed); the record None when it
        was dead-lettered."""
        ctx = self.ctx
        msg = event.message
        topic, raw, key = msg.topic, event.value, event.key
        logical = ctx.names.get(topic)
        model = _MODELS.get(logical) if logical else (RemediationResult if topic == ctx.rekeyed else None)
        sender = None
        try:
            if ctx.verifier is not None and logical is not None:
                sender = ctx.verifier.sender(msg.headers, topic, key, raw)
            elif topic == ctx.rekeyed:
                raw = ctx.handoff.unseal(raw)  # the results agent checked its sender, then sealed it
            # A record from a channel that is none of our topics (agent.test_context()) is taken
            # for what its `schema` says it is.
            record = decode_input(model, raw) if model is not None else decode_any(raw)
        except (DecodeError, AuthError, HandoffError) as exc:
            await ctx.dead(raw, key, topic, msg.partition, msg.offset, exc)
            return None, None, raw
        if sender is not None and record.node != sender:
            await ctx.dead(raw, key, topic, msg.partition, msg.offset, AuthError(
                f"a record about node {record.node} sent by {sender}: only a node speaks for itself"))
            return None, None, raw
        return record, sender, raw

    async def write(self, key: bytes, event: Any, state: GpuState) -> None:
        ctx = self.ctx
        try:
            row = _exact(orjson.dumps(state.to_dict()))
        except (orjson.JSONEncodeError, TypeError, ValueError) as exc:
            # A fact the row cannot hold (a number past 64 bits) is a bug of the fold, not a reason
            # to stop: outside a guard it crashed the worker, which re-read the same batch and
            # crashed again. The table keeps the last row that serialized, as for an oversized one.
            await ctx.refused(event, f"the table row of GPU {key[:200]!r} cannot be serialized ({exc}): not "
                              f"written (the table keeps its last row)", b"", exc)
            return
        if not fits(key, row, ctx.max_request):
            # A row the producer would refuse is not written (faust sends table writes from its
            # buffer, where a refusal stops the worker): the changelog keeps this GPU's last row
            # that fit, and this worker goes on deciding with the row in memory, which saw every
            # record. After a restart or a failover the GPU resumes from that last row (the records
            # since are not in it; commands re-emitted from it carry the ids they had). Not a row
            # cut down here to fit: which facts can be left out without changing a verdict is the
            # fold's to say (streams.evidence bounds its lists), and a row cut by the writer could
            # drop an incident's commands.
            await ctx.refused(event, f"the table row of GPU {key[:200]!r} is {len(row):,} bytes, over the "
                              f"producer's limit of {ctx.max_request:,}: not written (the table keeps its last row "
                              f"that fit)", row, MessageSizeTooLargeError(f"a {len(row):,}-byte table row"))
            return
        # The changelog partition of a table write is the current event's: the row's own.
        _current_event.set(weakref.ref(event))
        await ctx.partitions_known(ctx.gpu_table, event.message.topic)
        ctx.gpu_table[key] = row
        ctx.stats["rows_written"] += 1


# -- agent "results-rekey": gpu.remediation.results (keyed by node) -> the GPU's partition ---------
class RekeyAgent:
    """Results arrive keyed by node; each goes to the row of the GPU its command named
    (`xidstream.streams.routing.state_key`: the UUID, else node/pci_bus_id for a GPU whose UUID was
    never resolved), on the topic co-partitioned with the inputs."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def __call__(self, stream: Any) -> None:
        ctx = self.ctx
        async for event in stream.events():
            msg = event.message
            try:
                result = decode(RemediationResult, event.value)
                row = state_key(result)
                if row is None:
                    raise DecodeError("a remediation result must name its GPU: gpu_uuid, or pci_bus_id (with its "
                                      "node), copied from the command it answers", event.value)
                if ctx.verifier is not None:
                    sender = ctx.verifier.sender(msg.headers, msg.topic, event.key, event.value)
                    # The node executor answers what only the node's hands do; everything else is
                    # an API call, the cluster executor's (executors.gate SCOPE_ACTIONS).
                    entitled = result.node if result.action in NODE_EXECUTOR_ACTIONS else CLUSTER_IDENTITY
                    if sender != entitled:
                        raise AuthError(f"a {result.action.value} result for node {result.node} must come from "
                                        f"{entitled}; it was sent by {sender}")
            except (DecodeError, AuthError) as exc:
                await ctx.dead(event.value, event.key, msg.topic, msg.partition, msg.offset, exc)
                continue
            await ctx.emit(ctx.results_by_gpu, row.encode(), ctx.handoff.seal(event.value), "re-keyed result", event)


# -- agent "fleet": every command and node sighting -> the breaker -> gpu.remediation -------------
class FleetAgent:
    """One partition: every command passes here, where the fleet circuit breaker holds node-level
    actions during a storm (`xidstream.streams.fleet.fleet_step`) and each command is signed as it leaves."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def __call__(self, stream: Any) -> None:
        ctx = self.ctx
        async for events in faust_fast.take_batches(stream, ctx.batch, ctx.within):
            # One batch, one write of what changed: the main row when it changed, and
            # a row for each node seen for the first time. Acked after the body, as in GpuAgent.
            state = self.load()
            nodes_before = dict(state.known_nodes)  # a node's row is written when its inventory time moves
            # what a copy can no longer be opened for (streams.handoff): by this worker's clock,
            # never a record's timestamp, which the writer of a copy chooses
            forget_released(state, time.time() - MAX_AGE_S)
            for event in events:
                state = await self.fold(state, event)
            if events:
                await self.write(state, nodes_before, events[-1])

    async def fold(self, state: FleetState, event: Any) -> FleetState:
        ctx = self.ctx
        msg = event.message
        try:
            data, sealed_at = ctx.handoff.open_sealed(event.value, time.time())
            # When it was handed over, by this processor's clock: the breaker's bound on a node's
            # clock (streams.fleet.breaker_time). The seal's time, which its MAC covers; unsealed
            # (no signing key), the record's timestamp, which its producer stamped.
            if sealed_at is not None:
                received = sealed_at
            elif isinstance(msg.timestamp, (int, float)) and msg.timestamp > 0:
                received = msg.timestamp
            else:
                received = time.time()
            if data.get("kind") == "command":
                data["command"] = RemediationCommand.model_validate(data["command"])
            elif data.get("kind") == "reset":
                log.warning("fleet breaker reset by %s (approval %s, key %s)", data.get("by"),
                            data.get("approval_id"), data.get("key_id"))
            state, outputs = fleet_step(state, data, ctx.policy, now=received, sealed_at=sealed_at)
            ctx.labelled.breaker = 1 if state.tripped else 0
        except Exception as exc:  # noqa: BLE001
            await ctx.dead(event.value, event.key, msg.topic, msg.partition, msg.offset, exc)
            return state
        for kind, out in outputs:
            if isinstance(out, RemediationCommand):
                if ctx.signing_key is not None:
                    out = ctx.signing_key.sign(out)
                if await ctx.emit(ctx.remediation, out.node.encode(), encode(out), "command", event):
                    ctx.stats["commands"] += 1
                    ctx.labelled.command(out)
            elif isinstance(out, Alert):
                await ctx.send_alert(out, encode(out), event)
            else:  # a kind this agent does not publish: say so rather than guess a topic
                log.error("the fleet step gave an output of kind %r that has no topic: %r", kind, out)
        return state

    def load(self) -> FleetState:
        """The fleet state from the cache, else from the table: the main row, plus one row per
        known node (when its GPU inventory was last seen). Known nodes are rows of their own
        (`node:<name>`) so that the main row stays small: in one row, 12,500 nodes (100k GPUs) made
        every write ~0.5 MB, and a 1M-GPU fleet's row would pass Kafka's 1 MB message limit. Pods
        with recent application faults are rows of their own too (`workload:<pod UID>`): 9,700 of
        them in the main row made it 1.3 MB, and the producer's refusal crash-looped the worker. The
        commands released within the hand-off's bound are rows too (`released:<command id>`, when
        its message was sealed), so a copy of one is not released again after a restart."""
        ctx = self.ctx
        state = ctx.fleet_cache.get("state")
        if state is None:
            stored = ctx.fleet_table.get(FLEET_KEY)
            data = orjson.loads(stored) if stored else {}
            older = data.pop("known_nodes", None) or {}  # a row written before the node rows
            older_pods = data.pop("workload_gpus", None) or {}  # likewise, before the pod rows
            state = FleetState.from_dict(data)
            state.known_nodes, pods, released = {}, {}, []
            for k, v in ctx.fleet_table.items():
                if k.startswith(NODE_ROW):
                    state.known_nodes[k[len(NODE_ROW):].decode()] = orjson.loads(v)
                elif k.startswith(WORKLOAD_ROW):
                    pods[k[len(WORKLOAD_ROW):].decode()] = orjson.loads(v)
                elif k.startswith(GROUP_ROW):
                    state.groups[k[len(GROUP_ROW):].decode()] = orjson.loads(v)
                elif k.startswith(RELEASED_ROW):
                    released.append((orjson.loads(v), k[len(RELEASED_ROW):].decode()))
            # oldest first, as they were released (about the order they were sealed in)
            released.sort(key=lambda r: (r[0] is not None, r[0] or 0.0, r[1]))
            state.released = {cid: sealed_at for sealed_at, cid in released}
            rebuild_node_groups(state)
            ctx.fleet_cache["unsaved_nodes"] = [n for n in older if n not in state.known_nodes]
            state.known_nodes = {**older, **state.known_nodes}
            state.workload_gpus = {**older_pods, **pods}
            state.dirty_pods = {p for p in older_pods if p not in pods}
            ctx.fleet_cache["state"], ctx.fleet_cache["row"] = state, stored
            ctx.labelled.breaker = 1 if state.tripped else 0  # as stored, before the next message
        return state

    async def write(self, state: FleetState, nodes_before: dict, last: Any) -> None:
        """The rows that changed in a batch: nodes whose inventory time moved, pods, groups, released
        commands, the main row."""
        ctx = self.ctx
        _current_event.set(weakref.ref(last))
        await ctx.partitions_known(ctx.fleet_table, last.message.topic)

        async def put(key: bytes, row: bytes, what: str) -> None:
            # A row the producer would refuse is not written (see GpuAgent.write): the table keeps
            # the last one that fit, and this worker goes on with the fleet state in memory.
            if fits(key, row, ctx.max_request):
                ctx.fleet_table[key] = row
            else:
                await ctx.refused(last, f"the fleet table row of {what} is {len(row):,} bytes with its "
                                  f"{len(key):,}-byte key, over the producer's limit of {ctx.max_request:,}: not "
                                  f"written (the table keeps its last row that fit)", row,
                                  MessageSizeTooLargeError(f"a {len(row):,}-byte table row"))

        moved = [n for n, seen in state.known_nodes.items() if nodes_before.get(n) != seen]
        for node in moved + [n for n in ctx.fleet_cache.pop("unsaved_nodes", []) if n in state.known_nodes]:
            await put(NODE_ROW + node.encode(), _exact(orjson.dumps(state.known_nodes[node])), f"node {node[:200]!r}")
        for node in nodes_before.keys() - state.known_nodes.keys():  # forgotten (no inventory for a day)
            ctx.fleet_table.pop(NODE_ROW + node.encode(), None)
        for pod in state.dirty_pods:
            gpus = state.workload_gpus.get(pod)
            if gpus:
                await put(WORKLOAD_ROW + pod.encode(), _exact(orjson.dumps(gpus)), f"pod {pod[:200]!r}")
            else:
                ctx.fleet_table.pop(WORKLOAD_ROW + pod.encode(), None)
        state.dirty_pods = set()
        for key in state.dirty_groups:
            group = state.groups.get(key)
            if group:
                await put(GROUP_ROW + key.encode(), _exact(orjson.dumps(group)), f"group {key[:200]!r}")
            else:
                ctx.fleet_table.pop(GROUP_ROW + key.encode(), None)
        state.dirty_groups = set()
        for cid in state.dirty_released:
            if cid in state.released:
                await put(RELEASED_ROW + cid.encode(), _exact(orjson.dumps(state.released[cid])),
                          f"released command {cid[:200]!r}")
            else:
                ctx.fleet_table.pop(RELEASED_ROW + cid.encode(), None)
        state.dirty_released = set()
        row = fleet_row({k: v for k, v in state.to_dict().items() if k not in ("known_nodes", "workload_gpus", "groups")},
                        ctx.max_request)
        if row != ctx.fleet_cache.get("row"):
            ctx.fleet_cache["row"] = row
            await put(FLEET_KEY, row, "the breaker")
