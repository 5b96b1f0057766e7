"""Generated floods of ordinary faults for the volume tests (tests/streams/test_flood.py) and the
bench (bench/flood_bench.py): many GPUs on many nodes, distinct pods and PIDs, application-class
Xids (13, 31, 43, 45) and hardware ones, pinned GPUs without compute, failing workloads, and
executors answering the commands. Deterministic for a seed. Text is of ordinary length, or with
``text="max"`` every string a node chooses is as long as its schema allows (schemas.limits): a
tenant's process names and pod names, a node's event ids, a kernel line the driver printed.

`fold(records)` runs them through `xidstream.streams.engine.Engine` as a worker would (one record at a time,
in the order given; an `Answer` answers the newest command of its GPU, as an executor would)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterator

import orjson

from xidstream.schemas import (
    ComputeApp,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
    encode,
)
from xidstream.schemas.xid_catalog import lookup

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)
APP_XIDS = (13, 31, 43, 45)
HW_XIDS = (48, 62, 64, 74, 79, 95, 119, 140, 154)


@dataclass(frozen=True)
class Answer:
    """An executor's answer to the newest command of `gpu` (resolved when it is folded)."""

    ts: datetime
    gpu: str
    outcome: str
    detail: str = ""
    event_id: str | None = None


@dataclass(frozen=True)
class Flood:
    """`records` records over `seconds` of event time on `gpus` GPUs, `gpus_per_node` to a node.
    Weights: how often each kind of record comes (hot: the share of records on GPU 0)."""

    records: int
    gpus: int = 64
    gpus_per_node: int = 8
    seconds: float = 1800.0
    seed: int = 0
    sample: float = 4.0
    procs: float = 3.0
    app_xid: float = 2.0
    hw_xid: float = 0.3
    workload: float = 0.6
    answer: float = 0.3
    hot: float = 0.0
    new_pid: float = 0.6  # an application Xid from a PID (a pod) not seen before
    wedging: float = 0.1  # share of GPUs that go pinned without compute half way through
    text: str = "ordinary"  # or "max": every string a node chooses at its schema's cap


def gpu_id(g: int) -> str:
    return f"GPU-{g:08x}-7c1e-4b2a-9d3f-{g:012x}"


def pci(g: int) -> str:
    return f"0000:{(g // 8) % 256:02x}:{g % 8:02x}"


class _Text:
    """The strings of a flood's records: ordinary ones, or each at its schema's cap."""

    def __init__(self, spec: Flood, rnd: random.Random) -> None:
        self.max = spec.text == "max"
        self.rnd = rnd
        if self.max:
            from xidstream.schemas import limits

            self.limits = limits

    def node(self, name: str) -> str:
        if not self.max:
            return name
        # a node name is a DNS-1123 subdomain too: its cap is met with labels of at most 63
        labels = [name.ljust(63, "n")]
        while len(".".join(labels)) < self.limits.NODE_NAME_MAX:
            labels.append("n" * min(63, self.limits.NODE_NAME_MAX - len(".".join(labels)) - 1))
        return ".".join(labels)

    def event_id(self) -> str:
        # a node chooses its records' event ids; they are kept per Xid and occurrence, and quoted
        return f"{self.rnd.getrandbits(128):032x}" + ("e" * (self.limits.ID_MAX - 32) if self.max else "")

    def pod_uid(self, base: str) -> str:
        return base.ljust(self.limits.ID_MAX, "u") if self.max else base

    def pod(self, base: str) -> str:
        return base.ljust(self.limits.POD_NAME_MAX, "p") if self.max else base

    def short(self, base: str) -> str:
        return base.ljust(self.limits.SHORT_TEXT_MAX, ".") if self.max else base

    def detail(self, base: str) -> str:
        return base.ljust(self.limits.DETAIL_MAX, ".") if self.max else base

    def comm(self) -> str:
        return "python3".ljust(self.limits.TASK_COMM_MAX, "3") if self.max else "python3"

    def process_name(self) -> str:
        return "python3".ljust(self.limits.PROCESS_NAME_MAX, "3") if self.max else "python3"

    def kernel(self, tail: str) -> tuple[str, str]:
        """(message, raw) of an Xid line."""
        if not self.max:
            return tail, tail
        return tail.ljust(self.limits.KERNEL_MESSAGE_MAX, "m"), tail.ljust(self.limits.KERNEL_RAW_MAX, "r")


def generate(spec: Flood) -> list:
    """The flood's records in event-time order (inventories first)."""
    rnd = random.Random(spec.seed)
    text = _Text(spec, rnd)
    kinds = ("sample", "procs", "app_xid", "hw_xid", "workload", "answer")
    weights = [getattr(spec, k) for k in kinds]
    wedging = {g for g in range(spec.gpus) if rnd.random() < spec.wedging}
    pids: dict[int, list[int]] = {g: [10_000 + g * 7] for g in range(spec.gpus)}
    next_pid = [100_000]
    out: list = []
    for g in range(spec.gpus):
        out.append(GpuInventory(ts=T0, node=text.node(_node(spec, g)), gpu_uuid=gpu_id(g), gpu_index=g % 8,
                                pci_bus_id=pci(g), memory_total_mib=81559, name="NVIDIA H100 80GB HBM3",
                                driver_version="550.90.07"))
    step = spec.seconds / max(spec.records, 1)
    for i in range(spec.records - len(out)):
        t = T0 + timedelta(seconds=(i + 1) * step)
        g = 0 if spec.hot and rnd.random() < spec.hot else rnd.randrange(spec.gpus)
        uuid, node = gpu_id(g), text.node(_node(spec, g))
        late = (i + 1) * step > spec.seconds / 2
        pinned = g in wedging and late
        kind = rnd.choices(kinds, weights)[0]
        if kind == "sample":
            out.append(GpuSample(ts=t, node=node, event_id=text.event_id(), gpu_uuid=uuid, gpu_index=g % 8,
                                 pci_bus_id=pci(g),
                                 utilization_gpu_pct=100.0 if pinned else float(rnd.randrange(10, 90)),
                                 memory_used_mib=0.0 if pinned else float(rnd.randrange(4000, 70000)),
                                 memory_total_mib=81559, power_w=110.0 if pinned else 450.0,
                                 sm_clock_mhz=1980, mem_clock_mhz=2619))
        elif kind == "procs":
            apps = [] if pinned else [ComputeApp(pid=p, process_name=text.process_name(),
                                                 pod_uid=text.pod_uid(f"pod-{p}"), used_memory_mib=9000)
                                      for p in pids[g][-2:]]
            out.append(GpuProcesses(ts=t, node=node, event_id=text.event_id(), gpu_uuid=uuid, gpu_index=g % 8,
                                    pci_bus_id=pci(g), compute_apps=apps))
        elif kind == "app_xid":
            if rnd.random() < spec.new_pid:
                next_pid[0] += 1
                pids[g].append(next_pid[0])
                del pids[g][:-64]
            pid = rnd.choice(pids[g])
            out.append(_xid(t, node, g, rnd.choices(APP_XIDS, (5, 3, 1, 2))[0], pid, text))
        elif kind == "hw_xid":
            out.append(_xid(t, node, g, rnd.choice(HW_XIDS), None, text))
        elif kind == "workload":
            pod = f"job-{rnd.randrange(1_000_000)}"
            out.append(WorkloadEvent(ts=t, node=node, event_id=text.event_id(), gpu_uuid=uuid,
                                     pod_uid=text.pod_uid(f"uid-{pod}"), namespace="ml", pod=text.pod(pod),
                                     container="trainer", event=rnd.choice(("failed", "restarted")),
                                     reason=text.short("Error"), exit_code=rnd.choice((1, 137, 139))))
        else:
            out.append(Answer(t, uuid, rnd.choice(("succeeded", "failed", "refused")),
                              text.detail("executor says so"), text.event_id()))
    return out


def _node(spec: Flood, g: int) -> str:
    return f"gpu-node-{g // spec.gpus_per_node:04d}"


def _xid(t: datetime, node: str, g: int, code: int, pid: int | None, text: _Text) -> XidEvent:
    info = lookup(code)
    tail = f"pid={pid}, name=python3, Ch 00000008" if pid is not None else "GPU has fallen off the bus."
    message, raw = text.kernel(f"NVRM: Xid (PCI:{pci(g)}): {code}, {tail}")
    return XidEvent(ts=t, node=node, event_id=text.event_id(), gpu_uuid=gpu_id(g), gpu_index=g % 8, pci_bus_id=pci(g),
                    resolved=True, xid=code, xid_name=info.name, xid_resolution=info.resolution, pid=pid,
                    process_name=text.comm() if pid is not None else None, message=message, raw=raw,
                    source="kmsg", sources=["kmsg"])


def answer(newest: dict, a: Answer) -> RemediationResult | None:
    """The result an executor would send for the newest command of the GPU (`newest`: GPU -> its
    newest command), or None (no command yet)."""
    cmd = newest.get(a.gpu)
    if cmd is None:
        return None
    extra = {"event_id": a.event_id} if a.event_id else {}
    return RemediationResult(ts=a.ts, node=cmd.node, gpu_uuid=cmd.gpu_uuid, pci_bus_id=cmd.pci_bus_id,
                             command_id=cmd.command_id, incident_id=cmd.incident_id, action=cmd.action,
                             outcome=a.outcome, detail=a.detail or f"executor says {a.outcome}", **extra)


def fold(records: list, policy=None, each: Callable[[int, object], None] | None = None):
    """An Engine with `records` folded in order; `each(i, engine)` after each record (if given)."""
    from xidstream.streams.engine import Engine

    engine = Engine(policy)
    newest: dict = {}  # GPU -> its newest command (a look-up that does not grow with the flood)
    for i, r in enumerate(records):
        if isinstance(r, Answer):
            r = answer(newest, r)
        if r is not None:
            for kind, out in engine.process(r):
                if kind == "command":
                    newest[out.gpu_uuid] = out
        if each is not None:
            each(i, engine)
    return engine


# -- what is persisted and sent ---------------------------------------------------------------------
def gpu_rows(engine) -> Iterator[tuple[str, bytes]]:
    """(key, row) of every GPU table row, as streams.app writes them."""
    for key, state in engine.states.items():
        yield key, orjson.dumps(state.to_dict())


def fleet_rows(engine) -> Iterator[tuple[str, bytes]]:
    """(key, row) of the fleet agent's table as streams.app writes it: the main row without the
    known nodes and the pods, which are rows of their own (`node:<name>`, `workload:<pod UID>`).
    The main row as `FleetState` keeps it, before any compaction the writer may do."""
    state = engine.fleet
    yield "fleet", orjson.dumps({k: v for k, v in state.to_dict().items() if k not in ("known_nodes", "workload_gpus")})
    for node, seen in state.known_nodes.items():
        yield f"node:{node}", orjson.dumps(seen)
    for pod, gpus in state.workload_gpus.items():
        yield f"workload:{pod}", orjson.dumps(gpus)


def outputs(engine) -> Iterator[tuple[str, bytes]]:
    """(kind, bytes on the wire) of every alert and command the engine emitted."""
    for a in engine.alerts:
        yield "alert", encode(a)
    for c in engine.commands:
        yield "command", encode(c)


def verdicts(engine) -> tuple[list, list]:
    """What the rules decided: (classification, alert state, ts) of each alert and (action, ts,
    node, GPU) of each command, in the order they were emitted."""
    return ([(a.classification.value, a.state, a.ts) for a in engine.alerts],
            [(c.action.value, c.ts, c.node, c.gpu_uuid) for c in engine.commands])
