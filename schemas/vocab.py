"""Exact vocabularies of the wire contract. Consumers match on these strings: never rename."""

from __future__ import annotations

from enum import Enum

__all__ = [
    "Classification",
    "Action",
    "Severity",
    "SampleStatus",
    "XidSource",
    "ATTESTED_XID_SOURCES",
    "XidKind",
    "WorkloadEventType",
    "Outcome",
    "TsSource",
    "NODE_ACTIONS",
    "BREAKER_ACTIONS",
    "RECOVERY_ACTIONS",
]


class Classification(str, Enum):
    APP_FAULT = "APP_FAULT"
    GPU_SUSPECT = "GPU_SUSPECT"
    GPU_WEDGED = "GPU_WEDGED"
    GPU_HARDWARE_FAULT = "GPU_HARDWARE_FAULT"
    PHANTOM_LOAD = "PHANTOM_LOAD"
    GPU_DEGRADING = "GPU_DEGRADING"
    FLEET_STORM = "FLEET_STORM"
    GPU_CLAIM_CONFLICT = "GPU_CLAIM_CONFLICT"  # two nodes claim one GPU UUID (per-node identity: streams.claims)


class Action(str, Enum):
    RECORD = "RECORD"
    QUARANTINE_GPU = "QUARANTINE_GPU"
    RELEASE_GPU = "RELEASE_GPU"
    CORDON_NODE = "CORDON_NODE"
    UNCORDON_NODE = "UNCORDON_NODE"
    DRAIN_NODE = "DRAIN_NODE"
    RESET_GPU = "RESET_GPU"
    REBOOT_NODE = "REBOOT_NODE"
    REPLACE_NODE = "REPLACE_NODE"


# Actions that disturb every tenant of a node.
NODE_ACTIONS = frozenset(
    {Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE, Action.REPLACE_NODE}
)
# What the fleet circuit breaker counts and, once tripped, holds for approval: every action that
# takes capacity away. A GPU reset ends every process on the GPU (and its node must be drained
# first); a quarantine takes the GPU from the scheduler. Counting only the node-level four let a
# storm walk around the breaker: 160 GPUs on 20 nodes quarantined, RESET_GPU unheld on every node.
BREAKER_ACTIONS = NODE_ACTIONS | {Action.RESET_GPU, Action.QUARANTINE_GPU}


class Severity(str, Enum):
    info = "info"
    warning = "warning"
    critical = "critical"


class SampleStatus(str, Enum):
    ok = "ok"
    lost = "lost"  # NVML_ERROR_GPU_IS_LOST
    reset_required = "reset_required"  # NVML_ERROR_RESET_REQUIRED
    unavailable = "unavailable"  # NVML could not be read at all (no driver, no permission)


class XidSource(str, Enum):
    kmsg = "kmsg"  # a /dev/kmsg record, facility 0: the kernel's
    journal = "journal"  # a journal record with _TRANSPORT=kernel
    file = "file"  # text: a log file or stdin (`collect --accept-forgeable-kernel-log`), forgeable
    nvml = "nvml"  # an NVML Xid event: the driver's


# Sources whose records the kernel or the driver vouches for. A line of text (`file`) is not one: the
# syslog(2) interface that rsyslog's imklog (kern.log) and `dmesg -S` read splits a record at a newline
# in a tenant's file name and gives the rest a kernel prefix of its own, so a crashing process can
# write what reads as the driver's Xid line. The processor never acts on an Xid none of these saw.
ATTESTED_XID_SOURCES = frozenset({XidSource.kmsg, XidSource.journal, XidSource.nvml})


class XidKind(str, Enum):
    """What a `gpu.xid` record is. Only ``xid`` records carry an Xid code."""

    xid = "xid"
    sxid = "sxid"  # NVSwitch error, one event for its several lines
    gpu_identity = "gpu_identity"  # "NVRM: GPU at PCI:...: GPU-<uuid>"
    fallen_off_bus = "fallen_off_bus"
    recovery_failure = "recovery_failure"  # e.g. refcntRequestReference_IMPL ... Failed to enter state
    gsp_rate_limit = "gsp_rate_limit"  # later Xid counts are undercounted


class TsSource(str, Enum):
    """Where an Xid record's `ts` comes from, most trusted first."""

    line = "line"  # the line's own wall-clock time: ISO 8601, `dmesg -T`, syslog with the year inferred
    journal = "journal"  # the journal entry's __REALTIME_TIMESTAMP
    kmsg = "kmsg"  # /dev/kmsg's monotonic microseconds plus the boot time
    nvml = "nvml"  # when the NVML event arrived
    read = "read"  # the line carries no time: when the collector read it


# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvml.h, nvmlDeviceGpuRecoveryAction_t). Xid 154
# prints the same names when the action changes.
RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset",
                    5: "recover_imex_domain", 6: "bus_reset", 7: "system_reboot"}


class WorkloadEventType(str, Enum):
    started = "started"
    failed = "failed"
    restarted = "restarted"
    succeeded = "succeeded"


class Outcome(str, Enum):
    succeeded = "succeeded"
    failed = "failed"
    refused = "refused"
    expired = "expired"
