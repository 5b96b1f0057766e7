"""The topic registry: every topic's name, key, partitions, retention and model, in one place.

The topics a collector writes (`COLLECTED_TOPICS`) are keyed by GPU UUID and must have the same
partition count (faust co-partitioning; runtime-notes section 2): the stream processor reads
`INPUT_TOPICS` of them together (a topic it did not read would be partitioned the same way, so a
rule that joins it later finds a GPU's records on the same partition number).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from xidstream.schemas.base import Record
from xidstream.schemas.models import (
    Alert,
    Approval,
    DeadLetter,
    GpuCounters,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    NodeEnrollment,
    RemediationCommand,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
)

__all__ = [
    "TopicSpec",
    "TopicRegistry",
    "TOPICS",
    "INPUT_TOPICS",
    "COLLECTED_TOPICS",
    "DEFAULT_PARTITIONS",
    "spec_for_model",
]

DAY_MS = 24 * 3600 * 1000

# faust's own default `topic_partitions`; the input topics and its tables must agree.
DEFAULT_PARTITIONS = 8


def _key_gpu(record: Record) -> str:
    return record.gpu_uuid  # type: ignore[attr-defined]


def _key_xid(record: Record) -> str:
    # An Xid whose PCI id could not be resolved to a UUID is still published: keyed by
    # node and PCI so that all its records stay in order on one partition.
    if record.gpu_uuid:  # type: ignore[attr-defined]
        return record.gpu_uuid  # type: ignore[attr-defined]
    return f"{record.node}/{record.pci_bus_id or 'unknown'}"  # type: ignore[attr-defined]


def _key_alert(record: Record) -> str:
    return record.gpu_uuid or record.node  # type: ignore[attr-defined]


def _key_node(record: Record) -> str:
    return record.node


def _key_deadletter(record: Record) -> str:
    return record.source_topic  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TopicSpec:
    """One topic of the contract. `name` is the default (unprefixed) name."""

    name: str
    model: type[Record]
    key: str  # what the key is, in words, for docs and `xidstream topics list`
    key_fn: Callable[[Record], str]
    retention_ms: int | None  # None: compacted, kept forever
    compacted: bool = False
    co_partitioned: bool = False  # keyed by GPU UUID with the processor's partition count (checked)
    processed: bool = True  # with co_partitioned: read by the stream processor (INPUT_TOPICS)
    # False: a topic a release added, which the collectors, the processor and the exporter go on
    # without (saying so) until someone has created it and granted its ACLs: an upgrade runs them
    # before that
    required: bool = True

    def key_for(self, record: Record) -> bytes:
        return self.key_fn(record).encode("utf-8")

    def config(self) -> dict[str, str]:
        if self.compacted:
            return {"cleanup.policy": "compact"}
        return {"cleanup.policy": "delete", "retention.ms": str(self.retention_ms)}


TOPICS: dict[str, TopicSpec] = {
    spec.name: spec
    for spec in (
        TopicSpec("gpu.inventory", GpuInventory, "GPU UUID", _key_gpu, None, compacted=True, co_partitioned=True),
        TopicSpec("gpu.samples", GpuSample, "GPU UUID", _key_gpu, 3 * DAY_MS, co_partitioned=True),
        TopicSpec("gpu.processes", GpuProcesses, "GPU UUID", _key_gpu, 3 * DAY_MS, co_partitioned=True),
        TopicSpec(
            "gpu.xid", XidEvent, "GPU UUID, or node/pci_bus_id when unresolved", _key_xid,
            30 * DAY_MS, co_partitioned=True,
        ),
        TopicSpec("gpu.workloads", WorkloadEvent, "GPU UUID", _key_gpu, 7 * DAY_MS, co_partitioned=True),
        # error and link counters at a slower cadence (collectors.nvml NvmlReader.counters), trended
        # by the processor (streams.degrade); added after the others, so not required
        TopicSpec("gpu.counters", GpuCounters, "GPU UUID", _key_gpu, 3 * DAY_MS, co_partitioned=True,
                  required=False),
        TopicSpec("gpu.alerts", Alert, "GPU UUID, or node for node-wide alerts", _key_alert, 90 * DAY_MS),
        TopicSpec("gpu.remediation", RemediationCommand, "node", _key_node, 30 * DAY_MS),
        TopicSpec(
            "gpu.remediation.results", RemediationResult, "node", _key_node, 30 * DAY_MS,
        ),
        TopicSpec("gpu.remediation.approvals", Approval, "node", _key_node, 30 * DAY_MS),
        TopicSpec("xidstream.deadletter", DeadLetter, "source topic", _key_deadletter, 14 * DAY_MS),
        # who may speak for which node (transport.identity): the latest enrollment per identity
        TopicSpec("xidstream.identities", NodeEnrollment, "node (or @cluster-executor)", _key_node, None, compacted=True),
    )
}

# what a collector writes, and what of it the stream processor reads
COLLECTED_TOPICS: tuple[str, ...] = tuple(name for name, spec in TOPICS.items() if spec.co_partitioned)
INPUT_TOPICS: tuple[str, ...] = tuple(name for name, spec in TOPICS.items() if spec.co_partitioned and spec.processed)

_BY_MODEL = {spec.model: spec for spec in TOPICS.values()}


def spec_for_model(model: type[Record]) -> TopicSpec:
    return _BY_MODEL[model]


@dataclass(frozen=True)
class TopicRegistry:
    """Topic names as deployed: the defaults with an optional prefix (e.g. ``staging.``)."""

    prefix: str = ""
    partitions: int = DEFAULT_PARTITIONS

    def name(self, logical: str) -> str:
        if logical not in TOPICS:
            raise KeyError(f"unknown topic {logical!r}; known: {', '.join(TOPICS)}")
        return f"{self.prefix}{logical}"

    def logical(self, physical: str) -> str | None:
        if not physical.startswith(self.prefix):
            return None
        rest = physical[len(self.prefix):]
        return rest if rest in TOPICS else None

    def for_record(self, record: Record) -> tuple[str, bytes]:
        """The physical topic and key bytes for a record."""
        spec = _BY_MODEL[type(record)]
        return self.name(spec.name), spec.key_for(record)

    def all(self) -> dict[str, TopicSpec]:
        return {self.name(n): spec for n, spec in TOPICS.items()}
