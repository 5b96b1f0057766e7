"""The whole decision path without Kafka: per-key `step` folds plus the fleet breaker, in the
order records arrive. The faust agents do the same across partitions; tests and `evaluate`
use this directly."""

from __future__ import annotations

from schemas.base import Record
from schemas.topics import TopicRegistry
from streams.classify import GpuState, step
from streams.fleet import FleetState, fleet_step
from streams.policy import Policy

__all__ = ["Engine"]


class Engine:
    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()
        self.states: dict[str, GpuState] = {}
        self.fleet = FleetState()
        self.alerts: list = []
        self.commands: list = []
        self._reg = TopicRegistry()

    def key_of(self, record: Record) -> str:
        if record.SCHEMA == "xidstream.remediation_result/1":
            return record.gpu_uuid or record.node  # type: ignore[attr-defined]
        return self._reg.for_record(record)[1].decode()

    def process(self, record: Record, key: str | None = None) -> list:
        key = key or self.key_of(record)
        state, outputs, _ = step(self.states.get(key), key, record, self.policy)
        self.states[key] = state
        final = []
        if not state.announced:
            state.announced = True
            self.fleet, _ = fleet_step(self.fleet, {"kind": "node_seen", "node": state.node, "ts": record.ts.timestamp()}, self.policy)
        for kind, out in outputs:
            if kind == "command":
                self.fleet, fouts = fleet_step(self.fleet, {"kind": "command", "command": out}, self.policy)
                final.extend(fouts)
            else:
                final.append((kind, out))
        for kind, out in final:
            (self.alerts if kind == "alert" else self.commands).append(out)
        return final

    def run(self, records: list[Record]) -> "Engine":
        for r in sorted(records, key=lambda r: r.ts):
            self.process(r)
        return self

    def reset_breaker(self) -> None:
        self.fleet, _ = fleet_step(self.fleet, {"kind": "reset"}, self.policy)
