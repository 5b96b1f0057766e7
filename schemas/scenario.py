"""The scenario format, version 1: an incident at the raw input level.

Used by tests, the demo, `xidstream replay`, `xidstream collect --scenario` and the fleet simulator.
A scenario names nodes and their GPUs and a timeline of raw inputs (NVML sample fields, process
lists, kernel log lines, workload events, NVML status, executor results); `expect` and `forbid`
say what the processor must and must not decide. See docs in README ("Scenario format").

Invalid files raise `ScenarioError` naming the field and the entry, e.g.
``timeline[3] (at 12.5, node node-a): sample.power_w: Input should be a valid number``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from xidstream.schemas.base import NODE_NAME_PATTERN, NodeName, UtcDatetime, normalize_pci
from xidstream.schemas.errors import ScenarioError
from xidstream.schemas.limits import NODE_NAME_MAX
from xidstream.schemas.vocab import Action, Classification, Outcome, WorkloadEventType

__all__ = [
    "Scenario",
    "ScenarioNode",
    "ScenarioGpu",
    "TimelineEntry",
    "SampleFields",
    "ScenarioProcess",
    "ScenarioWorkload",
    "ScenarioResult",
    "Expectation",
    "Forbidden",
    "load_scenario",
    "parse_scenario",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScenarioGpu(_Strict):
    index: int = Field(ge=0)
    uuid: str = Field(pattern=r"^(GPU|MIG)-[0-9A-Za-z-]+$")
    pci_bus_id: str
    name: str = "NVIDIA GPU"
    memory_total_mib: int = Field(32607, gt=0)
    serial: str | None = None

    @field_validator("pci_bus_id")
    @classmethod
    def _pci(cls, value: str) -> str:
        if normalize_pci(value) is None:
            raise ValueError(f"not a PCI bus id: {value!r} (expected e.g. 00000000:01:00.0)")
        return value


class ScenarioNode(_Strict):
    # every record of the node carries it, and a record's node is a Kubernetes node name
    name: NodeName = Field(min_length=1, max_length=NODE_NAME_MAX, json_schema_extra={"pattern": NODE_NAME_PATTERN})
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[ScenarioGpu] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "ScenarioNode":
        for attr in ("index", "uuid"):
            seen = [getattr(g, attr) for g in self.gpus]
            dup = {v for v in seen if seen.count(v) > 1}
            if dup:
                raise ValueError(f"duplicate GPU {attr} {sorted(dup)} on node {self.name}")
        return self


class SampleFields(_Strict):
    """NVML sample fields; the given ones replace earlier values."""

    utilization_gpu_pct: float | None = Field(None, ge=0, le=100)
    utilization_memory_pct: float | None = Field(None, ge=0, le=100)
    memory_used_mib: float | None = Field(None, ge=0)
    power_w: float | None = Field(None, ge=0)
    sm_clock_mhz: int | None = Field(None, ge=0)
    mem_clock_mhz: int | None = Field(None, ge=0)
    temperature_c: int | None = None


class ScenarioProcess(_Strict):
    pid: int = Field(gt=0)
    name: str = "python3"
    used_memory_mib: float | None = None
    pod_uid: str | None = None
    container_id: str | None = None
    sm_util_pct: float | None = Field(None, ge=0, le=100, description="pmon SM%; omitted: not in pmon")


class ScenarioHolder(_Strict):
    pid: int = Field(gt=0)
    name: str | None = None


class ScenarioWorkload(_Strict):
    pod_uid: str | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    event: WorkloadEventType
    reason: str | None = None
    exit_code: int | None = None


class ScenarioResult(_Strict):
    action: Action
    outcome: Outcome
    detail: str = ""


class TimelineEntry(_Strict):
    at: float = Field(ge=0, description="Seconds since the scenario's start.")
    node: str
    gpu: int | str | None = Field(None, description="GPU index or UUID on that node.")
    sample: SampleFields | None = None
    processes: list[ScenarioProcess] | None = Field(None, description="Replaces the list; [] = none.")
    holders: list[ScenarioHolder] | None = Field(None, description="Processes holding /dev/nvidia*.")
    kernel: list[str] | None = Field(None, description="Kernel log lines for the node's log source.")
    workload: ScenarioWorkload | None = None
    nvml: Literal["ok", "lost", "reset_required"] | None = None
    remediation_result: ScenarioResult | None = None

    @field_validator("kernel", mode="before")
    @classmethod
    def _lines(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _needs_gpu(self) -> "TimelineEntry":
        per_gpu = [
            k for k in ("sample", "processes", "holders", "workload", "nvml", "remediation_result")
            if getattr(self, k) is not None
        ]
        if per_gpu and self.gpu is None:
            raise ValueError(f"'gpu' is required with {', '.join(per_gpu)}")
        if not per_gpu and self.kernel is None:
            raise ValueError("entry has no input (sample, processes, kernel, workload, nvml, ...)")
        return self


class Expectation(_Strict):
    node: str | None = None
    gpu: int | str | None = None
    classification: Classification
    actions: list[Action] = Field(default_factory=list)
    after: float = 0.0
    within: float | None = Field(None, gt=0)


class Forbidden(_Strict):
    node: str | None = None
    gpu: int | str | None = None
    actions: list[Action] = Field(min_length=1)
    classification: list[Classification] = Field(
        default_factory=list, description="Alerts of these classifications must not appear either."
    )


class Scenario(_Strict):
    scenario: Literal[1]
    name: str = Field(min_length=1)
    description: str = ""
    start: UtcDatetime | None = None
    duration: float = Field(gt=0)
    nodes: list[ScenarioNode] = Field(min_length=1)
    timeline: list[TimelineEntry] = Field(default_factory=list)
    expect: list[Expectation] = Field(default_factory=list)
    forbid: list[Forbidden] = Field(default_factory=list)

    def node(self, name: str) -> ScenarioNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def gpu(self, node: str, ref: int | str) -> ScenarioGpu:
        """The GPU that `ref` (an index or a UUID) names on `node`."""
        for gpu in self.node(node).gpus:
            if ref == gpu.index or ref == gpu.uuid:
                return gpu
        raise KeyError(f"{node}/{ref}")

    def sorted_timeline(self) -> list[TimelineEntry]:
        """Entries in time order (stable: entries at the same `at` keep file order)."""
        return sorted(self.timeline, key=lambda e: e.at)

    def time_of(self, at: float, start: datetime | None = None) -> datetime:
        base = start or self.start
        if base is None:
            raise ScenarioError("scenario has no 'start'; pass one")
        return base + timedelta(seconds=at)

    @model_validator(mode="after")
    def _references(self) -> "Scenario":
        names = [n.name for n in self.nodes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate node names {sorted(dup)}")
        uuids = [g.uuid for n in self.nodes for g in n.gpus]
        dup = {u for u in uuids if uuids.count(u) > 1}
        if dup:
            raise ValueError(f"GPU UUIDs used on several nodes: {sorted(dup)}")

        def check(where: str, node: str | None, gpu: int | str | None) -> None:
            if node is None:
                if gpu is not None and not isinstance(gpu, str):
                    raise ValueError(f"{where}: a GPU index needs a 'node'")
                if isinstance(gpu, str) and gpu not in uuids:
                    raise ValueError(f"{where}: unknown GPU {gpu!r}")
                return
            if node not in names:
                raise ValueError(f"{where}: unknown node {node!r} (nodes: {', '.join(names)})")
            if gpu is not None:
                try:
                    self.gpu(node, gpu)
                except KeyError:
                    raise ValueError(f"{where}: node {node!r} has no GPU {gpu!r}") from None

        for i, entry in enumerate(self.timeline):
            where = f"timeline[{i}] (at {entry.at:g})"
            check(where, entry.node, entry.gpu)
            if entry.at > self.duration:
                raise ValueError(f"{where}: at {entry.at:g} is after duration {self.duration:g}")
        for i, exp in enumerate(self.expect):
            check(f"expect[{i}]", exp.node, exp.gpu)
        for i, forb in enumerate(self.forbid):
            check(f"forbid[{i}]", forb.node, forb.gpu)
        return self


def _describe(data: Any, loc: tuple) -> str:
    """'timeline[3] (at 12.5, node node-a): sample.power_w' from a pydantic error location."""
    parts: list[str] = []
    head = ""
    node = data
    for i, item in enumerate(loc):
        if isinstance(item, int):
            if parts:
                parts[-1] = f"{parts[-1]}[{item}]"
            else:
                parts.append(f"[{item}]")
        else:
            parts.append(str(item))
        try:
            node = node[item]
        except (KeyError, IndexError, TypeError):
            node = None
        if i == 1 and loc and loc[0] in ("timeline", "expect", "forbid", "nodes") and isinstance(node, dict):
            hints = [f"{k} {node[k]}" for k in ("at", "node", "name") if k in node]
            head = ".".join(parts) + (f" ({', '.join(hints)})" if hints else "")
            parts = []
    rest = ".".join(parts)
    if head:
        return f"{head}: {rest}" if rest else head
    return rest or "<top level>"


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate already-loaded data as a scenario; raise `ScenarioError` naming field and entry."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: a scenario is a mapping, got {type(data).__name__}")
    if data.get("scenario") != 1:
        raise ScenarioError(
            f"{source}: 'scenario: 1' is required (this xidstream reads scenario format 1), "
            f"got {data.get('scenario')!r}"
        )
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors()[:10]:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {_describe(data, tuple(err['loc']))}: {msg}")
        raise ScenarioError(f"{source}: invalid scenario:\n" + "\n".join(lines)) from None


def load_scenario(path: str | Path) -> Scenario:
    """Load a scenario from a YAML (``.yaml``/``.yml``) or JSON file."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        # PyYAML is imported here, not at module level, so that `schemas` imports with only
        # pydantic and orjson (consumers that only decode records need nothing else).
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    else:
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ScenarioError(f"{path}: not valid JSON: {exc}") from None
    return parse_scenario(data, str(path))
