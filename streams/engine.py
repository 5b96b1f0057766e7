"""The whole decision path without Kafka: per-key `step` folds plus the fleet agent, in the order
records arrive. The faust agents do the same across partitions, through the same routing
(`xidstream.streams.routing`); tests and `evaluate` use this directly."""

from __future__ import annotations

from xidstream.schemas.base import Record
from xidstream.streams.classify import GpuState, step
from xidstream.streams.fleet import FleetState, fleet_step
from xidstream.streams.policy import Policy
from xidstream.streams.routing import fan_out, state_key

__all__ = ["Engine"]


class Engine:
    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()
        self.states: dict[str, GpuState] = {}
        self.fleet = FleetState()
        self.alerts: list = []
        self.commands: list = []
        self.stages: list = []  # (stage, seconds) of each repair stage that ended (streams.repair)

    def process(self, record: Record, key: str | None = None) -> list:
        key = key or state_key(record)
        if key is None:
            return []  # a result that names no GPU: the app dead-letters it
        state, outputs, _ = step(self.states.get(key), key, record, self.policy)
        self.states[key] = state
        self.stages.extend((o["stage"], o["seconds"]) for kind, o in outputs if kind == "repair_stage")
        to_fleet, alerts = fan_out(state, record, outputs)
        final = [("alert", a) for a in alerts]
        for msg in to_fleet:
            self.fleet, fouts = fleet_step(self.fleet, msg, self.policy)
            final.extend(fouts)
        for kind, out in final:
            (self.alerts if kind == "alert" else self.commands).append(out)
        return final

    def run(self, records: list[Record]) -> "Engine":
        for r in sorted(records, key=lambda r: r.ts):
            self.process(r)
        return self

    def reset_breaker(self) -> None:
        self.fleet, _ = fleet_step(self.fleet, {"kind": "reset"}, self.policy)
