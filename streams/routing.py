"""Where records go, as pure functions: used alike by the faust agents (`xidstream.streams.app`), the
Kafka-free `xidstream.streams.engine.Engine` and the tests, so the three cannot drift apart.

- `state_key(record)`: the table row (a `GpuState`) a record folds into. Inputs are keyed as the
  topic registry keys them (GPU UUID, or ``node/pci`` for an Xid whose GPU was never resolved);
  a remediation result, keyed by node on its topic, goes to the row of the GPU its command named:
  the UUID, else ``node/pci`` (the command carries the PCI id, the result echoes it), so the result
  of an unresolved GPU still reaches its incident.
- `fan_out(state, record, outputs)`: what one fold step sends on. Alerts go out as they are; every
  command, each GPU inventory (its node's membership of the fleet) and each application fault of a known pod go to the
  single-partition fleet agent (`xidstream.streams.fleet.fleet_step`), which alone releases commands to
  `gpu.remediation` (the circuit breaker) and sees when one workload faults several GPUs. Fleet
  messages are plain dicts except a command's ``"command"``, a `RemediationCommand`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xidstream.schemas.base import Record
from xidstream.schemas.models import Alert, GpuInventory, RemediationResult, XidEvent
from xidstream.streams.policy import is_app_class
from xidstream.schemas.topics import TopicRegistry

if TYPE_CHECKING:
    from xidstream.transport.config import KafkaConfig

__all__ = ["state_key", "fan_out", "groups_of", "FLEET_KEY", "internal_topics"]

FLEET_KEY = b"fleet"
_REGISTRY = TopicRegistry()


def internal_topics(settings: KafkaConfig) -> dict[str, int]:
    """Topics the processor needs besides the contract's: name -> partitions. Here, not in
    streams.app, so that `xidstream breaker reset` runs without faust (the base install)."""
    p = settings.topic_prefix
    return {f"{p}xidstream.results-by-gpu": settings.partitions, f"{p}xidstream.fleet": 1}


def state_key(record: Record) -> str | None:
    """The row a record folds into, or None when it names no GPU at all (a result with neither
    a UUID nor a PCI id cannot be matched to anything: the caller dead-letters it)."""
    if isinstance(record, RemediationResult):
        if record.gpu_uuid:
            return record.gpu_uuid
        if record.pci_bus_id:
            return f"{record.node}/{record.pci_bus_id}"
        return None
    return _REGISTRY.for_record(record)[1].decode()


def groups_of(state) -> dict[str, str]:
    """The blast-radius groups of a GPU row (streams.storms), as its node says: rack and driver
    from its inventory, job from its newest pod's workload event, NVLink domain from its counters
    (`fabric_domain`, where the row has one)."""
    found = {"job": getattr(state, "job", None), "rack": getattr(state, "rack", None),
             "domain": getattr(state, "fabric_domain", None), "driver": getattr(state, "driver_version", None)}
    return {k: v for k, v in found.items() if v}


def fan_out(state, record: Record, outputs: list) -> tuple[list[dict], list[Alert]]:
    """(messages for the fleet breaker, alerts to publish) for one fold step's `outputs`.

    A GPU inventory tells the breaker its node is a GPU node (the fleet's size; commands that take
    capacity away from a node without one are held, `xidstream.streams.fleet`)."""
    if state.announced and not outputs and not isinstance(record, (GpuInventory, XidEvent)):
        # Most records (a sample, a process list) give nothing to route: return before reading the
        # row's groups, which only go into a message (four getattrs and two dicts per record).
        return [], []
    fleet: list[dict] = []
    alerts: list[Alert] = []
    groups = groups_of(state)
    tag = {"groups": groups} if groups else {}  # left out when none: messages stay as they were
    if not state.announced:
        # The first record of each GPU row tells the breaker its node exists: topics are read in
        # parallel, so a node's first Xid can be folded before its inventory (a replay held every
        # command of a storm when only inventories counted).
        state.announced = True
        fleet.append({"kind": "node_seen", "node": state.node, "ts": record.ts.timestamp(), **tag})
    if isinstance(record, GpuInventory) and record.node:
        fleet.append({"kind": "inventory", "node": record.node, "ts": record.ts.timestamp(), **tag})
    if isinstance(record, XidEvent) and "job" in groups and is_app_class(record.xid) and record.attested:
        # One job's application faults across nodes (Xid 45 included: a teardown logs it on every
        # rank) are grouped by the fleet agent into one incident per job (streams.storms). A fault
        # only text names (schemas.vocab.ATTESTED_XID_SOURCES) is on its GPU's timeline only.
        inc = state.incident.id if state.incident else None
        fleet.append({"kind": "job_fault", "node": state.node, "gpu_uuid": state.gpu_uuid, "xid": record.xid,
                      "ts": record.ts.timestamp(), "incident_id": inc, **tag})
    for kind, out in outputs:
        if kind == "command":
            fleet.append({"kind": "command", "command": out, **tag})
        elif kind == "workload_fault":  # a plain dict: which pod faulted which GPU
            fleet.append({"kind": "workload_fault", **out, **tag})
        elif kind == "alert":
            alerts.append(out)
        elif kind == "repair_stage":
            pass  # a stage of a repair that ended: the worker's histograms (streams.app), not a message
        else:  # a fold step's output of no kind we route: a bug, never published as something else
            raise ValueError(f"a fold step gave an output of unknown kind {kind!r}")
    return fleet, alerts
