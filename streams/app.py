"""The faust-streaming app, built by `create_app(settings, policy)`; importing registers nothing.

Topology (aiokafka transport):

    gpu.samples, gpu.processes, gpu.xid, gpu.workloads, gpu.inventory,
    <prefix>xidstream.results-by-gpu  --(agent "gpus", table "gpu-state" keyed by GPU UUID)-->
        alerts -> gpu.alerts
        commands and node sightings -> <prefix>xidstream.fleet (1 partition)
    gpu.remediation.results (keyed by node) --(agent "results-rekey")--> xidstream.results-by-gpu
    <prefix>xidstream.fleet --(agent "fleet", table "fleet-state")--> gpu.remediation, gpu.alerts

The input topics and the re-keyed results share one partition count, so one worker owns all of a
GPU's records and its table row (faust co-partitioning; runtime-notes section 2). Every command
passes the one-partition fleet agent, which applies the circuit breaker and keeps a node's commands
in order. No faust join and no windowed table: faust's joins are not implemented and its windows
expire by wall clock; the state in `streams.classify.GpuState` expires by event time instead.
"""

from __future__ import annotations

import logging
from typing import Any

import weakref

import faust
import orjson
from faust.streams import _current_event

from schemas.codec import decode, decode_any, encode, to_dict
from schemas.errors import DecodeError
from schemas.models import (
    DeadLetter,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    RemediationCommand,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
)
from schemas.topics import INPUT_TOPICS
from streams.classify import GpuState, step
from streams.fleet import FleetState, fleet_step
from streams.policy import Policy
from xidstream.settings import Settings

__all__ = ["create_app", "internal_topics", "ProcessorApp"]

log = logging.getLogger(__name__)

_MODELS = {
    "gpu.samples": GpuSample,
    "gpu.processes": GpuProcesses,
    "gpu.xid": XidEvent,
    "gpu.workloads": WorkloadEvent,
    "gpu.inventory": GpuInventory,
}
FLEET_KEY = b"fleet"


def internal_topics(settings: Settings) -> dict[str, int]:
    """Topics the processor needs besides the contract's: name -> partitions."""
    p = settings.topic_prefix
    return {f"{p}xidstream.results-by-gpu": settings.partitions, f"{p}xidstream.fleet": 1}


class ProcessorApp:
    """The faust app and handles on its topics, for the CLI and the tests."""

    def __init__(self, app: faust.App, **parts: Any) -> None:
        self.app = app
        self.__dict__.update(parts)


def create_app(settings: Settings, policy: Policy | None = None, *, app_id: str | None = None,
               web_port: int | None = None, store: str = "memory://", datadir: str | None = None,
               fast_rebalance: bool = False, batch: int = 500, within: float = 0.05) -> ProcessorApp:
    policy = policy or Policy()
    reg = settings.topics
    partitions = settings.partitions
    extra: dict[str, Any] = {}
    if fast_rebalance:
        # A single test broker: the first JoinGroup takes ~3 s instead of ~30 s (runtime notes).
        extra.update(broker_rebalance_timeout=6, broker_session_timeout=6, broker_heartbeat_interval=1,
                     broker_request_timeout=30)
    if datadir:
        extra["datadir"] = datadir
    app = faust.App(
        app_id or f"{settings.topic_prefix}xidstream-processor",
        broker=[f"kafka://{h.strip()}" for h in settings.bootstrap.split(",")],
        autodiscover=False,
        topic_partitions=partitions,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=True,
        store=store,
        key_serializer="raw",
        value_serializer="raw",
        consumer_auto_offset_reset="earliest",
        processing_guarantee="at_least_once",
        web_enabled=web_port is not None,
        web_bind="127.0.0.1",
        web_host="127.0.0.1",
        web_port=web_port or 6066,
        producer_acks=-1,
        **extra,
    )
    names = {reg.name(n): n for n in INPUT_TOPICS}
    rekeyed, fleet_name = list(internal_topics(settings))
    inputs = app.topic(*names, rekeyed, key_type=bytes, value_type=bytes)
    results_in = app.topic(reg.name("gpu.remediation.results"), key_type=bytes, value_type=bytes)
    results_by_gpu = app.topic(rekeyed, key_type=bytes, value_type=bytes)
    fleet_topic = app.topic(fleet_name, key_type=bytes, value_type=bytes)
    alerts = app.topic(reg.name("gpu.alerts"), key_type=bytes, value_type=bytes)
    remediation = app.topic(reg.name("gpu.remediation"), key_type=bytes, value_type=bytes)
    deadletter = app.topic(reg.name("xidstream.deadletter"), key_type=bytes, value_type=bytes)
    gpu_table = app.Table("gpu-state", default=None, partitions=partitions, key_type=bytes, value_type=bytes)
    fleet_table = app.Table("fleet-state", default=None, partitions=1, key_type=bytes, value_type=bytes)
    cache: dict[bytes, GpuState] = {}
    stats = {"events": 0, "deadletters": 0, "alerts": 0, "commands": 0}

    @app.on_partitions_revoked.connect
    async def _drop_cache(sender: Any, revoked: Any = None, **kwargs: Any) -> None:
        # State of partitions that moved away must be read from the table again, never from here.
        cache.clear()

    @app.on_partitions_assigned.connect
    async def _drop_cache_assigned(sender: Any, assigned: Any = None, **kwargs: Any) -> None:
        cache.clear()

    async def dead(raw: bytes | None, key: bytes | None, topic: str, partition: int | None, offset: int | None,
                   error: BaseException) -> None:
        stats["deadletters"] += 1
        log.warning("dead-lettering a record from %s[%s]@%s: %s", topic, partition, offset, error)
        rec = DeadLetter(node=settings.node, original=raw or b"", original_key=key, source_topic=topic,
                         source_partition=partition, source_offset=offset, error=str(error)[:2000],
                         error_type=type(error).__name__)
        await deadletter.send(key=topic.encode(), value=encode(rec))

    async def handle(event: Any) -> None:
        msg = event.message
        topic, raw, key = msg.topic, event.value, event.key
        logical = names.get(topic)
        model = _MODELS.get(logical) if logical else (RemediationResult if topic == rekeyed else None)
        try:
            # A record from a channel that is none of our topics (agent.test_context()) is taken
            # for what its `schema` says it is.
            record = decode(model, raw) if model is not None else decode_any(raw)
        except DecodeError as exc:
            await dead(raw, key, topic, msg.partition, msg.offset, exc)
            return
        if not key:
            await dead(raw, key, topic, msg.partition, msg.offset, DecodeError("record has no key"))
            return
        try:
            state = cache.get(key)
            if state is None:
                stored = gpu_table.get(key)
                state = GpuState.from_dict(orjson.loads(stored)) if stored else None
            state, outputs, changed = step(state, key.decode(), record, policy)
            if not state.announced:
                state.announced = True
                changed = True
                await fleet_topic.send(key=FLEET_KEY, value=orjson.dumps(
                    {"kind": "node_seen", "node": state.node, "ts": record.ts.timestamp()}))
        except Exception as exc:  # noqa: BLE001 - one bad record must not stop the agent
            log.exception("processing a record from %s failed", topic)
            await dead(raw, key, topic, msg.partition, msg.offset, exc)
            return
        cache[key] = state
        if changed:
            # an exact-size copy: orjson's own result keeps a ~4 KiB buffer, for every GPU
            gpu_table[key] = bytes(memoryview(orjson.dumps(state.to_dict())))
        for kind, out in outputs:
            if kind == "alert":
                stats["alerts"] += 1
                await alerts.send(key=(out.gpu_uuid or out.node).encode(), value=encode(out))
            else:
                await fleet_topic.send(key=FLEET_KEY, value=orjson.dumps({"kind": "command", "command": to_dict(out)}))

    @app.agent(inputs, name="gpus")
    async def gpus(stream: Any) -> None:
        async for events in stream.take_events(batch, within=within):
            for event in events:
                stats["events"] += 1
                # take_events leaves the stream's "current event" at the batch's last event; a
                # table write takes its changelog partition from it, so point it at this one.
                _current_event.set(weakref.ref(event))
                await handle(event)

    @app.agent(results_in, name="results-rekey")
    async def rekey(stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            try:
                result = decode(RemediationResult, event.value)
                if not result.gpu_uuid:
                    raise DecodeError("a remediation result must name its gpu_uuid", event.value)
            except DecodeError as exc:
                await dead(event.value, event.key, msg.topic, msg.partition, msg.offset, exc)
                continue
            await results_by_gpu.send(key=result.gpu_uuid.encode(), value=event.value)

    @app.agent(fleet_topic, name="fleet")
    async def fleet(stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            try:
                data = orjson.loads(event.value)
                if data.get("kind") == "command":
                    data["command"] = RemediationCommand.model_validate(data["command"])
                stored = fleet_table.get(FLEET_KEY)
                state = FleetState.from_dict(orjson.loads(stored)) if stored else FleetState()
                state, outputs = fleet_step(state, data, policy)
            except Exception as exc:  # noqa: BLE001
                await dead(event.value, event.key, msg.topic, msg.partition, msg.offset, exc)
                continue
            fleet_table[FLEET_KEY] = orjson.dumps(state.to_dict())
            for kind, out in outputs:
                if kind == "alert":
                    stats["alerts"] += 1
                    await alerts.send(key=(out.gpu_uuid or out.node).encode(), value=encode(out))
                else:
                    stats["commands"] += 1
                    await remediation.send(key=out.node.encode(), value=encode(out))

    return ProcessorApp(app, gpus=gpus, rekey=rekey, fleet=fleet, gpu_table=gpu_table, fleet_table=fleet_table,
                        inputs=inputs, alerts=alerts, remediation=remediation, deadletter=deadletter,
                        fleet_topic=fleet_topic, stats=stats, policy=policy, settings=settings)
