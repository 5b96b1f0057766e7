"""Run a scenario through the real collector code: fake NVML, fake kernel log, fake /proc and
workloads on each node, the real parser, identity resolution, merger and sink.

Time is scenario time: every `interval` seconds of it, the entries due are applied to the fakes and
each node's collector ticks with ``now = start + t``. Nothing sleeps unless `speed` asks for it.

A `remediation_result` entry plays a scripted executor: it answers the newest command on
`gpu.remediation` for its node, GPU and action that it has not answered yet, with the entry's
outcome, copying the command's `command_id`, `incident_id`, `gpu_uuid` and `pci_bus_id` (the
processor acts only on a result that answers a command its incident emitted). The runner finds
that command through a `command_lookup` its caller gives it: `xidstream replay` reads the run's
`gpu.remediation` topic (waiting, since the scenario runs ahead of the processor), the pure path
asks a `xidstream.streams.engine.Engine` fed with what was published so far.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Protocol

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakeProcess, FakePynvml
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.parse.kernel import parse_scenario_line
from xidstream.collectors.sink import Sink
from xidstream.collectors.sources.kernel import MemoryKernelSource
from xidstream.collectors.sources.procfs import PodRef
from xidstream.schemas.base import normalize_pci
from xidstream.schemas.errors import ScenarioError
from xidstream.schemas.models import RemediationCommand, RemediationResult
from xidstream.schemas.scenario import Scenario, TimelineEntry
from xidstream.schemas.vocab import Action

__all__ = ["ScenarioRunner", "FakeProcFs", "MemoryWorkloadSource", "CommandLookup", "pick_command"]

log = logging.getLogger(__name__)

DEV_PREFIX = "/dev/nvidia"


class CommandLookup(Protocol):
    """Finds the command a scenario's `remediation_result` answers: the newest command for `node`
    and `action` on the GPU (`gpu_uuid`, or `pci_bus_id` for a command whose GPU has no resolved
    UUID; both None: any GPU of the node) whose `command_id` is not in `exclude` (already
    answered). None when there is none; it may wait for one first, or raise `ScenarioError` with
    what it saw."""

    def __call__(self, node: str, gpu_uuid: str | None, pci_bus_id: str | None, action: Action,
                 exclude: set[str]) -> RemediationCommand | None: ...


def pick_command(commands: list[RemediationCommand], node: str, gpu_uuid: str | None, pci_bus_id: str | None,
                 action: Action, exclude: set[str]) -> RemediationCommand | None:
    """The newest (last in `commands`, which are in the order they were published) command that a
    `CommandLookup` with these arguments returns; a building block for lookups."""
    pci = normalize_pci(pci_bus_id)
    for cmd in reversed(commands):
        if cmd.node != node or cmd.action != action or cmd.command_id in exclude:
            continue
        if gpu_uuid is None and pci is None:
            return cmd
        if cmd.gpu_uuid == gpu_uuid and cmd.gpu_uuid is not None:
            return cmd
        if not cmd.gpu_uuid and pci is not None and normalize_pci(cmd.pci_bus_id) == pci:
            return cmd
    return None


@dataclass
class FakeProcFs:
    holders: dict[str, list[int]] = field(default_factory=dict)
    pods: dict[int, PodRef] = field(default_factory=dict)
    comms: dict[int, str] = field(default_factory=dict)

    def pod_of(self, pid: int) -> PodRef:
        return self.pods.get(pid, PodRef(None, None))

    def comm(self, pid: int) -> str | None:
        return self.comms.get(pid)

    def device_holders(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self.holders.items()}


@dataclass
class MemoryWorkloadSource:
    items: list[dict] = field(default_factory=list)

    def push(self, item: dict) -> None:
        self.items.append(item)

    def read(self) -> list[dict]:
        out, self.items = self.items, []
        return out


@dataclass
class _Rig:
    fake: FakePynvml
    kernel: MemoryKernelSource
    procfs: FakeProcFs
    workloads: MemoryWorkloadSource
    collector: Collector


class ScenarioRunner:
    def __init__(self, scenario: Scenario, sink: Sink, *, start: datetime | None = None,
                 interval: float = 1.0, xid_merge_window: float = 2.0,
                 progress: Callable[[str], None] | None = None,
                 command_lookup: CommandLookup | None = None) -> None:
        results = [i for i, e in enumerate(scenario.timeline) if e.remediation_result is not None]
        if results and command_lookup is None:
            raise ScenarioError(
                f"scenario {scenario.name!r}: timeline[{results[0]}] has a remediation_result, which answers a "
                f"command of the processor, but no command_lookup was given to find it (xidstream replay "
                f"gives one; a caller of ScenarioRunner passes command_lookup=...)")
        self.command_lookup = command_lookup
        self.answered: set[str] = set()
        self.scenario = scenario
        self.sink = sink
        self.start = start or scenario.start or datetime.now(timezone.utc).replace(microsecond=0)
        self.interval = interval
        self.t = 0.0
        self.progress = progress
        self.rigs: dict[str, _Rig] = {}
        for node in scenario.nodes:
            fake = FakePynvml(
                [FakeGpu(g.index, g.uuid, g.pci_bus_id, name=g.name, serial=g.serial,
                         memory_total_mib=g.memory_total_mib) for g in node.gpus],
                driver_version=node.driver_version or "590.44.01", cuda_version=node.cuda_version or "13.1",
            )
            kernel = MemoryKernelSource("kmsg", scenario=True)
            procfs = FakeProcFs()
            workloads = MemoryWorkloadSource()
            collector = Collector(
                CollectorConfig(node=node.name, interval=interval, xid_merge_window=xid_merge_window,
                                dev_prefix=DEV_PREFIX, kmsg_wall_clock=False),
                sink, nvml=NvmlReader(fake), kernel=kernel, procfs=procfs, workloads=workloads,
                nvml_events_thread=False, clock=lambda: self.t,
            )
            self.rigs[node.name] = _Rig(fake, kernel, procfs, workloads, collector)

    def now(self) -> datetime:
        return self.start + timedelta(seconds=self.t)

    def _apply(self, entry: TimelineEntry) -> None:
        rig = self.rigs[entry.node]
        gpu = self.scenario.gpu(entry.node, entry.gpu) if entry.gpu is not None else None
        fake_gpu = rig.fake.gpu(gpu.uuid) if gpu is not None else None
        if entry.sample is not None:
            for name, value in entry.sample.model_dump(exclude_none=True).items():
                setattr(fake_gpu, name, value)
        if entry.processes is not None:
            fake_gpu.processes = [FakeProcess(p.pid, p.name, p.used_memory_mib, p.sm_util_pct) for p in entry.processes]
            for p in entry.processes:
                rig.procfs.pods[p.pid] = PodRef(p.pod_uid, p.container_id)
                rig.procfs.comms[p.pid] = p.name
        if entry.holders is not None:
            rig.procfs.holders[f"{DEV_PREFIX}{gpu.index}"] = [h.pid for h in entry.holders]
            for h in entry.holders:
                if h.name:
                    rig.procfs.comms[h.pid] = h.name
        if entry.kernel:
            rig.kernel.feed(entry.kernel)
            # The driver signals an NVML Xid event for each Xid it prints.
            by_pci = {normalize_pci(g.pci_bus_id): g for g in rig.fake.gpus}
            for line in entry.kernel:
                for rec in parse_scenario_line(line).records:
                    if rec.kind == "xid" and rec.pci in by_pci:
                        rig.fake.inject_xid(by_pci[rec.pci].uuid, rec.xid)
        if entry.workload is not None:
            rig.workloads.push(dict(gpu_uuid=gpu.uuid, ts=self.now(), **entry.workload.model_dump()))
        if entry.nvml is not None:
            fake_gpu.status = entry.nvml
        if entry.remediation_result is not None:
            self._answer(entry, gpu)

    def _answer(self, entry: TimelineEntry, gpu) -> None:
        r = entry.remediation_result
        where = (f"scenario {self.scenario.name!r} timeline[{self._index(entry)}] (at {entry.at:g}, node {entry.node}"
                 + (f", GPU {entry.gpu}" if entry.gpu is not None else "") + f"): remediation_result {r.action.value}")
        try:
            cmd = self.command_lookup(entry.node, gpu.uuid if gpu else None, gpu.pci_bus_id if gpu else None,
                                      r.action, set(self.answered))
        except ScenarioError as exc:  # the lookup says what it waited for; this says which entry
            raise ScenarioError(f"{where}: {exc}") from None
        if cmd is None:
            raise ScenarioError(f"{where} answers a {r.action.value} command, but the processor sent none for "
                                f"that node and GPU (that was not answered already)")
        self.answered.add(cmd.command_id)
        self.sink.publish(RemediationResult(
            ts=self.now(), node=entry.node, command_id=cmd.command_id, incident_id=cmd.incident_id,
            gpu_uuid=cmd.gpu_uuid, pci_bus_id=cmd.pci_bus_id, action=r.action, outcome=r.outcome, detail=r.detail))

    def _index(self, entry: TimelineEntry) -> int:
        return next(i for i, e in enumerate(self.scenario.timeline) if e is entry)

    def run(self, speed: float = 0.0) -> None:
        """Run the whole scenario. `speed` > 0 sleeps to run that many times faster than real time."""
        timeline = self.scenario.sorted_timeline()
        i = 0
        for rig in self.rigs.values():
            rig.collector.start(self.now())
        steps = int(self.scenario.duration / self.interval) + 1
        wall0 = time.monotonic()
        for step in range(steps):
            self.t = step * self.interval
            while i < len(timeline) and timeline[i].at <= self.t + 1e-9:
                self._apply(timeline[i])
                i += 1
            now = self.now()
            for rig in self.rigs.values():
                rig.collector.tick(now)
            if self.progress and step and step % max(1, steps // 10) == 0:
                self.progress(f"scenario time {self.t:.0f}/{self.scenario.duration:.0f} s")
            if speed > 0:
                ahead = wall0 + self.t / speed - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        # Let merged Xid records out, then stop.
        self.t += 60.0
        for rig in self.rigs.values():
            rig.collector.tick(self.now())
        for rig in self.rigs.values():
            rig.collector.stop()


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
