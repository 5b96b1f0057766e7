"""Small record builders for processor tests: time is seconds after T0."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from xidstream.schemas import (
    Action,
    ComputeApp,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    RemediationResult,
    WorkloadEvent,
    XidEvent,
)
from xidstream.schemas.xid_catalog import lookup

T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)
NODE = "node-a"
GPU = "GPU-11111111-2222-3333-4444-555555555555"
PCI = "0000:02:00"


def at(t: float) -> datetime:
    return T0 + timedelta(seconds=t)


def inventory(t=0, gpu=GPU, node=NODE, index=1):
    return GpuInventory(ts=at(t), node=node, gpu_uuid=gpu, gpu_index=index, pci_bus_id=PCI, memory_total_mib=32607)


def sample(t, util=30.0, mem=12000.0, gpu=GPU, node=NODE, status="ok", power=200.0):
    return GpuSample(ts=at(t), node=node, gpu_uuid=gpu, gpu_index=1, pci_bus_id=PCI, utilization_gpu_pct=util,
                     memory_used_mib=mem, memory_total_mib=32607, power_w=power, sm_clock_mhz=2407,
                     mem_clock_mhz=14001, status=status)


def procs(t, *pids, gpu=GPU, node=NODE):
    return GpuProcesses(ts=at(t), node=node, gpu_uuid=gpu, gpu_index=1, pci_bus_id=PCI,
                        compute_apps=[ComputeApp(pid=p, process_name="python3", pod_uid=f"pod-{p}") for p in pids])


def xid(t, code, pid=4242, gpu=GPU, node=NODE, message="m", kind="xid"):
    info = lookup(code)
    return XidEvent(ts=at(t), node=node, gpu_uuid=gpu, gpu_index=1 if gpu else None, pci_bus_id=PCI,
                    resolved=gpu is not None, xid=code, xid_name=info.name, xid_resolution=info.resolution, pid=pid,
                    process_name="python3", message=message, raw=f"NVRM: Xid (PCI:{PCI}): {code}, pid={pid}, {message}",
                    source="kmsg", sources=["kmsg"], kind=kind)


def workload(t, event="failed", gpu=GPU, node=NODE, pod="vllm-1"):
    return WorkloadEvent(ts=at(t), node=node, gpu_uuid=gpu, pod_uid=f"uid-{pod}", namespace="ml", pod=pod,
                         container="vllm", event=event, reason="Error", exit_code=1)


@dataclass(frozen=True)
class Answer:
    """An executor's answer, at time `t`, to the newest `action` command for the GPU: which
    command it answers is only known once the engine has emitted it (see `run`)."""

    t: float
    action: Action
    outcome: str
    gpu: str | None = GPU
    node: str = NODE
    detail: str = ""

    @property
    def ts(self):
        return at(self.t)

    def to_result(self, engine) -> RemediationResult:
        cmd = next(c for c in reversed(engine.commands)
                   if c.action == self.action and c.node == self.node and c.gpu_uuid == self.gpu)
        return RemediationResult(ts=self.ts, node=self.node, gpu_uuid=self.gpu, pci_bus_id=cmd.pci_bus_id,
                                 command_id=cmd.command_id, incident_id=cmd.incident_id, action=self.action,
                                 outcome=self.outcome, detail=self.detail)


def result(t, action, outcome, gpu=GPU, node=NODE, detail=""):
    return Answer(t, Action(action), outcome, gpu, node, detail)


def feed(engine, records):
    """Feed records in the order given; an `Answer` becomes the result of the command it answers."""
    for r in records:
        engine.process(r.to_result(engine) if isinstance(r, Answer) else r)
    return engine


def run(records, policy=None):
    """`Engine(policy).run(records)`, with `Answer`s answering the commands emitted before them."""
    from xidstream.streams.engine import Engine

    return feed(Engine(policy), sorted(records, key=lambda r: r.ts))


def wedge(start=120, pinned_until=300, step=5, gpu=GPU, node=NODE):
    """Xid 13 -> 31 -> 43 from one PID, then pinned at 100% / 0 MiB with no compute app."""
    recs = [inventory(0, gpu=gpu, node=node), sample(0, gpu=gpu, node=node), procs(0, 4242, gpu=gpu, node=node),
            xid(start, 13, gpu=gpu, node=node), xid(start, 13, gpu=gpu, node=node),
            xid(start + 1, 31, gpu=gpu, node=node), xid(start + 2, 43, gpu=gpu, node=node)]
    t = start + 3
    while t <= pinned_until:
        recs += [sample(t, util=100, mem=0, power=110, gpu=gpu, node=node), procs(t, gpu=gpu, node=node)]
        t += step
    return recs


def counters(t, recovery=None, links=4, gpu=GPU, node=NODE, **fields):
    """A `gpu.counters` reading: `recovery` NVLink recoveries in all, on link 0 (the others none)."""
    from xidstream.schemas.models import GpuCounters, NvLinkCounters

    nvlinks = None
    if recovery is not None:
        nvlinks = [NvLinkCounters(link=i, active=True, replay_errors=0, recovery_errors=recovery if i == 0 else 0,
                                  crc_flit_errors=0, crc_data_errors=0) for i in range(links)]
    return GpuCounters(ts=at(t), node=node, gpu_uuid=gpu, gpu_index=1, pci_bus_id=PCI, nvlinks=nvlinks, **fields)
