"""The wire contract: one pydantic model per topic.

Field names listed in the contract are public and stable; a change of meaning gets a new
schema version (``.../2``), never a silent edit. Optional fields are null when the source could not
say (NVML ``NotSupported``, an old driver that prints no pid).

Every string and list in a record a node or an executor sends (`NodeRecord`) has a cap, with its
reason, in `xidstream.schemas.limits`: a node chooses all of it, and the kernel and the kubelet copy a tenant's
text into theirs. The collector cuts text to fit (`xidstream.schemas.limits.clip`); a record over a cap does
not decode, so the processor dead-letters it.
"""

from __future__ import annotations


from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints

from xidstream.schemas.base import NodeRecord, Record, UtcDatetime
from xidstream.schemas.limits import (
    CATALOG_TEXT_MAX,
    COUNTER_NAMES_MAX,
    COUNTER_NAME_MAX,
    DETAIL_MAX,
    GPU_INDEX_MAX,
    GPU_UUID_MAX,
    ID_MAX,
    INT32_MAX,
    INT64_MAX,
    JOB_MAX,
    K8S_LABEL_MAX,
    KERNEL_MESSAGE_MAX,
    KERNEL_RAW_MAX,
    KERNEL_TS_MAX,
    NOTES_MAX,
    NVLINK_LINKS_MAX,
    NVML_STRING_MAX,
    NVSWITCHES_MAX,
    PCIE_GEN_MAX,
    PCIE_WIDTH_MAX,
    POD_NAME_MAX,
    PROCESSES_MAX,
    PROCESS_NAME_MAX,
    SHORT_TEXT_MAX,
    STEP_NAME_MAX,
    STEPS_MAX,
    TASK_COMM_MAX,
    TEMPERATURE_C_MAX,
    XID_SOURCES_MAX,
)
from xidstream.schemas.vocab import (
    ATTESTED_XID_SOURCES,
    Action,
    Classification,
    Outcome,
    SampleStatus,
    Severity,
    TsSource,
    WorkloadEventType,
    XidKind,
    XidSource,
)

__all__ = [
    "GpuInventory",
    "GpuSample",
    "NvLinkCounters",
    "GpuCounters",
    "ComputeApp",
    "PmonSample",
    "DeviceHolder",
    "GpuProcesses",
    "XidEvent",
    "WorkloadEvent",
    "EvidenceEntry",
    "Evidence",
    "Alert",
    "RuleRef",
    "RemediationCommand",
    "RemediationResult",
    "ResultStep",
    "Approval",
    "DeadLetter",
    "ALL_MODELS",
    "NodeEnrollment",
]

_PCI = r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}$"

_PciId = Annotated[str, StringConstraints(pattern=_PCI)]
_Note = Annotated[str, StringConstraints(max_length=SHORT_TEXT_MAX)]
_CounterName = Annotated[str, StringConstraints(max_length=COUNTER_NAME_MAX)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuInventory(NodeRecord):
    """One GPU of a node, published at start and whenever it changes (compacted topic).

    v2: `status` (a GPU that was lost when the collector started is still published, from
    the inventory the collector kept, as ``lost``), `memory_info_version` and `notes`.
    v3: strings and `notes` bounded (schemas.limits).
    v4: `rack`, the node's rack as its Node label says (the collector's `--rack-label`), for the
    fleet agent's storms by blast radius (streams.storms); null where unknown."""

    SCHEMA = "xidstream.gpu_inventory/4"
    LEGACY = ("xidstream.gpu_inventory/1", "xidstream.gpu_inventory/2", "xidstream.gpu_inventory/3")
    schema_: Literal["xidstream.gpu_inventory/4"] = Field(SCHEMA, alias="schema")
    gpu_uuid: str = Field(max_length=GPU_UUID_MAX)
    gpu_index: int = Field(ge=0)
    pci_bus_id: str = Field(pattern=_PCI, description="Normalised dddd:bb:dd.")
    name: str | None = Field(None, max_length=NVML_STRING_MAX)
    serial: str | None = Field(None, max_length=NVML_STRING_MAX)
    memory_total_mib: int | None = None
    driver_version: str | None = Field(None, max_length=NVML_STRING_MAX)
    cuda_version: str | None = Field(None, max_length=NVML_STRING_MAX)
    status: SampleStatus = Field(
        SampleStatus.ok, description="lost: NVML refuses a handle (e.g. fallen off the bus); published "
        "from the collector's saved inventory until the GPU returns or an operator removes it.")
    memory_info_version: int | None = Field(
        None, description="2: memory used excludes what the driver reserves (nvmlDeviceGetMemoryInfo_v2); "
        "1: the v1 call, whose 'used' includes the reserved memory; null: unknown.")
    notes: list[_Note] = Field(default_factory=list, max_length=NOTES_MAX,
                               description="What the collector could not read, in words.")
    # A label value is at most 63 characters (Kubernetes' own limit on label values).
    rack: str | None = Field(None, max_length=K8S_LABEL_MAX,
                             description="The node's rack (a Node label, topology.kubernetes.io/rack by default).")


class GpuSample(NodeRecord):
    """One NVML reading of one GPU. A field is null when NVML does not support it.

    v3: `gpu_uuid` and `error` bounded (schemas.limits)."""

    SCHEMA = "xidstream.gpu_sample/3"
    LEGACY = ("xidstream.gpu_sample/1", "xidstream.gpu_sample/2")
    schema_: Literal["xidstream.gpu_sample/3"] = Field(SCHEMA, alias="schema")
    gpu_uuid: str = Field(max_length=GPU_UUID_MAX)
    gpu_index: int = Field(ge=0)
    pci_bus_id: str = Field(pattern=_PCI)
    utilization_gpu_pct: float | None = None
    utilization_memory_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    temperature_c: int | None = None
    status: SampleStatus = SampleStatus.ok
    error: str | None = Field(None, max_length=SHORT_TEXT_MAX, description="The NVML error behind a non-ok status.")
    # v2
    memory_reserved_mib: float | None = Field(
        None, description="Memory the driver reserves (v2 memory call); not part of memory_used_mib.")
    recovery_action: int | None = Field(
        None, ge=0, le=7, description="NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0 none, 1 GPU reset, 2 node reboot, "
        "3 drain P2P, 4 drain and reset, 5 recover IMEX domain, 6 bus reset, 7 system reboot "
        "(schemas.vocab.RECOVERY_ACTIONS).")
    remapped_rows_correctable: int | None = Field(None, description="nvmlDeviceGetRemappedRows: rows remapped for correctable errors.")
    remapped_rows_uncorrectable: int | None = Field(None, description="Rows remapped for uncorrectable errors.")
    remapped_rows_pending: bool | None = Field(None, description="A remap is pending: it takes effect at the next GPU reset.")
    remapped_rows_failure: bool | None = Field(None, description="A row remap failed: the GPU is out of spare rows.")
    ecc_dbe_volatile: int | None = Field(None, description="Volatile (since the last driver load) double-bit ECC errors.")


class NvLinkCounters(_Part):
    """One NVLink of a GPU: its state and its data-link error counters, which count since the
    driver loaded (NVML API Reference, nvmlDeviceGetNvLinkErrorCounter). A counter is null when
    NVML could not read it (see the record's `unsupported` and `errors`)."""

    link: int = Field(ge=0, lt=NVLINK_LINKS_MAX, description="The link's number (NVML's `link` argument).")
    active: bool | None = Field(
        None, description="nvmlDeviceGetNvLinkState: true when the link is up (NVML_FEATURE_ENABLED).")
    replay_errors: int | None = Field(
        None, ge=0, le=INT64_MAX, description="nvmlDeviceGetNvLinkErrorCounter NVML_NVLINK_ERROR_DL_REPLAY: data-link replays.")
    recovery_errors: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_NVLINK_ERROR_DL_RECOVERY: link recoveries (retraining after errors).")
    crc_flit_errors: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_NVLINK_ERROR_DL_CRC_FLIT: flow-control units received with a bad CRC.")
    crc_data_errors: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_NVLINK_ERROR_DL_CRC_DATA: data packets received with a bad CRC.")


class GpuCounters(NodeRecord):
    """One GPU's error and link counters, read at a slower cadence than its samples (`xidstream
    collect --counters-interval`, 60 s by default): the signals that trend before a fault. A
    counter is null when NVML could not read it: it is named in `unsupported` when the driver
    answered NotSupported (asked once, never again for this GPU), or counted in `errors` when the
    read failed otherwise. Published only when at least one counter was read."""

    SCHEMA = "xidstream.gpu_counters/1"
    schema_: Literal["xidstream.gpu_counters/1"] = Field(SCHEMA, alias="schema")
    gpu_uuid: str = Field(max_length=GPU_UUID_MAX)
    gpu_index: int = Field(ge=0, le=GPU_INDEX_MAX)
    pci_bus_id: str = Field(pattern=_PCI)
    nvlinks: list[NvLinkCounters] | None = Field(
        None, max_length=NVLINK_LINKS_MAX, description="Every NVLink the GPU has, by number; null when it has none "
        "or they could not be read.")
    pcie_replay_count: int | None = Field(
        None, ge=0, le=INT64_MAX, description="nvmlDeviceGetPcieReplayCounter: PCIe replays since the driver loaded.")
    pcie_link_gen_current: int | None = Field(None, ge=0, le=PCIE_GEN_MAX, description="nvmlDeviceGetCurrPcieLinkGeneration.")
    pcie_link_gen_max: int | None = Field(
        None, ge=0, le=PCIE_GEN_MAX, description="nvmlDeviceGetMaxPcieLinkGeneration: the most the GPU and its slot allow. The current "
        "generation also drops below it when the GPU idles, to save power.")
    pcie_link_width_current: int | None = Field(None, ge=0, le=PCIE_WIDTH_MAX, description="nvmlDeviceGetCurrPcieLinkWidth (lanes).")
    pcie_link_width_max: int | None = Field(
        None, ge=0, le=PCIE_WIDTH_MAX, description="nvmlDeviceGetMaxPcieLinkWidth (lanes); a current width below it is a downgraded link.")
    ecc_corrected_volatile: int | None = Field(
        None, ge=0, le=INT64_MAX, description="nvmlDeviceGetTotalEccErrors NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC: "
        "single-bit errors since the driver loaded.")
    ecc_uncorrected_volatile: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC: double-bit errors since "
        "the driver loaded.")
    ecc_corrected_aggregate: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_AGGREGATE_ECC: over the GPU's life.")
    ecc_uncorrected_aggregate: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC: over the GPU's life.")
    retired_pages_single_bit: int | None = Field(
        None, ge=0, le=INT64_MAX, description="nvmlDeviceGetRetiredPages NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "
        "pages retired (pre-Ampere; Ampere and later remap rows instead, see gpu.samples).")
    retired_pages_double_bit: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: pages retired.")
    retired_pages_pending: bool | None = Field(
        None, description="nvmlDeviceGetRetiredPagesPendingStatus: a retirement waits for the next driver reload.")
    clock_event_reasons: int | None = Field(
        None, ge=0, le=INT64_MAX, description="nvmlDeviceGetCurrentClocksEventReasons (older drivers: ...ClocksThrottleReasons): "
        "the bitmask of why the clocks are below their target now.")
    clock_event_reason_names: list[_CounterName] = Field(
        default_factory=list, max_length=COUNTER_NAMES_MAX, description="The bits of clock_event_reasons by name "
        "(hw_slowdown, hw_thermal_slowdown, sw_thermal_slowdown, hw_power_brake_slowdown, sw_power_cap, gpu_idle, "
        "...); a bit without a name in the collector's pynvml is only in the mask.")
    temperature_c: int | None = Field(None, ge=-273, le=TEMPERATURE_C_MAX, description="nvmlDeviceGetTemperature NVML_TEMPERATURE_GPU.")
    fabric_cluster_uuid: str | None = Field(
        None, max_length=36, description="nvmlDeviceGetGpuFabricInfoV: the NVLink fabric (e.g. an NVL72 rack's "
        "NVLink domain) the GPU was registered in; null until registration completed.")
    fabric_clique_id: int | None = Field(
        None, ge=0, le=INT64_MAX, description="The GPU's clique within that fabric (GPUs that can reach each other over NVLink).")
    fabric_state: int | None = Field(
        None, ge=0, le=INT32_MAX, description="NVML_GPU_FABRIC_STATE_*: 1 not started, 2 in progress, 3 completed. A GPU outside any "
        "fabric (0, not supported) has the fabric named in `unsupported` instead.")
    fabric_status: int | None = Field(
        None, ge=0, le=INT32_MAX, description="The NVML return code of the fabric registration (0 success), once completed.")
    fabric_health_mask: int | None = Field(
        None, ge=0, le=INT64_MAX, description="NVML_GPU_FABRIC_HEALTH_MASK_* bits (the V call only; null from the older call).")
    unsupported: list[_CounterName] = Field(
        default_factory=list, max_length=COUNTER_NAMES_MAX, description="Counters the driver answered NotSupported "
        "for on this GPU (or a function this pynvml or driver lacks): never asked again by this collector.")
    errors: int = Field(
        0, ge=0, le=INT64_MAX, description="Reads of this round that failed with another NVML error; their fields are null.")


class ComputeApp(_Part):
    """A process NVML registered as a CUDA compute process (``--query-compute-apps``)."""

    pid: int
    process_name: str | None = Field(None, max_length=PROCESS_NAME_MAX)
    used_memory_mib: float | None = None
    pod_uid: str | None = Field(None, max_length=ID_MAX)
    container_id: str | None = Field(None, max_length=ID_MAX)


class PmonSample(_Part):
    """A process seen using a GPU engine in the sampling window (``nvidia-smi pmon``)."""

    pid: int
    sm_util_pct: float | None = None
    mem_util_pct: float | None = None


class DeviceHolder(_Part):
    """A process that merely has ``/dev/nvidia*`` open. Proves nothing about compute."""

    pid: int
    process_name: str | None = Field(None, max_length=TASK_COMM_MAX, description="/proc/<pid>/comm.")


class GpuProcesses(NodeRecord):
    """The three kinds of process evidence for one GPU at one time.

    v2: `compute_apps` is null when NVML could not list them. Unknown is not "no compute
    process": the wedge and phantom rules only count a snapshot that was read.
    v3: `device_holders` is null when the holder scan did not run (an empty list said that too);
    lists and strings bounded (schemas.limits), and `error` also says when a list was cut."""

    SCHEMA = "xidstream.gpu_processes/3"
    LEGACY = ("xidstream.gpu_processes/1", "xidstream.gpu_processes/2")
    schema_: Literal["xidstream.gpu_processes/3"] = Field(SCHEMA, alias="schema")
    gpu_uuid: str = Field(max_length=GPU_UUID_MAX)
    gpu_index: int | None = None
    pci_bus_id: str | None = Field(None, pattern=_PCI)
    compute_apps: list[ComputeApp] | None = Field(
        default_factory=list, max_length=PROCESSES_MAX, description="Null: NVML could not list them (unknown, not empty).")
    error: str | None = Field(
        None, max_length=SHORT_TEXT_MAX, description="Why a list is null, or that one was cut to its cap.")
    pmon: list[PmonSample] = Field(default_factory=list, max_length=PROCESSES_MAX)
    device_holders: list[DeviceHolder] | None = Field(
        None, max_length=PROCESSES_MAX, description="Null: the /dev/nvidia* holder scan did not run (no /proc, "
        "or not yet); empty: it ran and no process holds the device.")

    @classmethod
    def from_legacy(cls, found: str, data: dict) -> dict:
        # Before v3 an empty list was also what a collector without /proc sent: unknown, not "none".
        if data.get("device_holders") == []:
            data["device_holders"] = None
        return data


class XidEvent(NodeRecord):
    """A kernel Xid record or a related driver record, with the GPU resolved where possible.

    v3: strings and `sources` bounded (schemas.limits); the collector cuts `raw` and `message`;
    `process_lists` (false: no process list of this GPU will come).
    v4: `nvswitch_pci_bus_ids`, the NVSwitches an SXid event came from. Not `pci_bus_id`: that names
    a GPU, resolves to its UUID and keys the record (``node/pci_bus_id``), so a switch there would
    be taken for an unresolved GPU, with a processor row of its own. An SXid's `xid_name` and
    `xid_category` are NVIDIA's name and class of its code (schemas.sxid_catalog)."""

    SCHEMA = "xidstream.xid/4"
    # /3 is /4 naming no switch (an /3 SXid's switch is only in its `raw` line)
    LEGACY = ("xidstream.xid/1", "xidstream.xid/2", "xidstream.xid/3")
    schema_: Literal["xidstream.xid/4"] = Field(SCHEMA, alias="schema")
    kind: XidKind = XidKind.xid
    gpu_uuid: str | None = Field(
        None, max_length=GPU_UUID_MAX, description="Null when the PCI bus id could not be resolved.")
    gpu_index: int | None = None
    pci_bus_id: str | None = Field(None, pattern=_PCI, description="Normalised dddd:bb:dd.")
    resolved: bool = Field(False, description="True when gpu_uuid was resolved from NVML or the driver.")
    xid: int | None = None
    xid_name: str | None = Field(
        None, max_length=CATALOG_TEXT_MAX, description="NVIDIA catalog mnemonic; 'unknown' if not in it. kind "
        "sxid: the error's name in NVIDIA's Fabric Manager guide, 'unknown' if not in xidstream's SXid table.")
    xid_category: str | None = Field(
        None, max_length=CATALOG_TEXT_MAX, description="app, driver, hardware, memory, bus, nvlink, thermal, other "
        "or unknown. kind sxid: the guide's class, non_fatal, fatal (to the partitions using the port; "
        "propagated to the GPU as Xid 74 where it applies), always_fatal (to the fabric) or unknown.")
    xid_resolution: str | None = Field(
        None, max_length=CATALOG_TEXT_MAX, description="NVIDIA's immediate-action bucket; null for an SXid (NVIDIA "
        "gives none).")
    pid: int | None = None
    process_name: str | None = Field(None, max_length=TASK_COMM_MAX, description="The task name the driver printed.")
    gpu_instance: int | None = Field(None, description="MIG GPU instance (GPU-I).")
    compute_instance: int | None = Field(None, description="MIG compute instance (GPU-CI).")
    message: str = Field("", max_length=KERNEL_MESSAGE_MAX)
    raw: str = Field("", max_length=KERNEL_RAW_MAX)
    source: XidSource = Field(
        description="Where the record was read: kmsg, journal, nvml, or file (text from a log file or stdin, "
        "which a tenant can forge: the processor never acts on an Xid that only `file` names).")
    sources: list[XidSource] = Field(
        default_factory=list, max_length=XID_SOURCES_MAX,
        description="Every source that saw this fault (kernel log and NVML)."
    )
    kernel_ts: str | None = Field(
        None, max_length=KERNEL_TS_MAX, description="The log line's own timestamp text, if any.")
    # v2
    ts_source: TsSource | None = Field(None, description="Where `ts` comes from (schemas.vocab.TsSource).")
    backfilled: bool = Field(
        False, description="Read from history at the collector's first start (rotated logs, earlier journal), "
        "not seen live: evidence for the timeline, never a reason to act now.")
    observed_at: UtcDatetime | None = Field(
        None, description="When the collector read the line (or received the NVML event), by its own clock. "
        "A live record whose `ts` is far from it was stamped by a drifting clock: the processor takes it at "
        "`observed_at` instead.")
    process_lists: bool = Field(
        True, description="False when this collector publishes no gpu.processes for the GPU (`collect "
        "--no-nvml`, or NVML failed to start): the processor then has no process list to wait for before "
        "it counts the fault's workload (its pod from gpu.workloads, else its PID).")
    # v4
    nvswitch_pci_bus_ids: list[_PciId] = Field(
        default_factory=list, max_length=NVSWITCHES_MAX,
        description="kind sxid: the PCI bus id (normalised dddd:bb:dd) of each NVSwitch that printed a line of "
        "the event, in the order first seen, each once; empty for every other kind. One event often comes "
        "from several switches within microseconds (a GPU's links going down on each).")

    @property
    def attested(self) -> bool:
        """True when a source that the kernel or the driver vouches for saw it (kmsg, journal,
        NVML: schemas.vocab.ATTESTED_XID_SOURCES); False for a record read only from text."""
        return any(s in ATTESTED_XID_SOURCES for s in self.sources) or self.source in ATTESTED_XID_SOURCES


class WorkloadEvent(NodeRecord):
    """A pod on this node that holds a GPU started, failed, restarted or finished.

    v2: strings bounded (schemas.limits).
    v3: `job`, the job the pod belongs to (``namespace/name``: a job label, else its controller),
    for the fleet agent's storms by job (streams.storms); null where the pod has neither."""

    SCHEMA = "xidstream.workload/3"
    LEGACY = ("xidstream.workload/1", "xidstream.workload/2")
    schema_: Literal["xidstream.workload/3"] = Field(SCHEMA, alias="schema")
    gpu_uuid: str = Field(max_length=GPU_UUID_MAX)
    pod_uid: str | None = Field(None, max_length=ID_MAX)
    namespace: str | None = Field(None, max_length=K8S_LABEL_MAX)
    pod: str | None = Field(None, max_length=POD_NAME_MAX)
    container: str | None = Field(None, max_length=K8S_LABEL_MAX)
    event: WorkloadEventType
    reason: str | None = Field(None, max_length=SHORT_TEXT_MAX)
    exit_code: int | None = None
    job: str | None = Field(None, max_length=JOB_MAX, description="namespace/name of the pod's job or controller.")


class EvidenceEntry(_Part):
    """One line of an incident's timeline."""

    ts: UtcDatetime
    kind: str = Field(description="xid | sample_stats | processes | workload | remediation | note")
    summary: str
    data: dict[str, Any] = Field(default_factory=dict)


class Evidence(_Part):
    """Why an alert was raised: the one timeline the incident write-up asks for."""

    node: str
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    pci_bus_id: str | None = None
    timeline: list[EvidenceEntry] = Field(default_factory=list)
    sample_stats: dict[str, Any] = Field(default_factory=dict)
    xid_counts: dict[str, int] = Field(default_factory=dict)
    distinct_pids: list[int] = Field(default_factory=list)
    pod_uids: list[str] = Field(default_factory=list)


_RULE_ID = r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$"
_FactValue = int | bool | Annotated[str, StringConstraints(max_length=200)] | \
    Annotated[list[int | Annotated[str, StringConstraints(max_length=200)]], Field(max_length=16)]


class RuleRef(_Part):
    """Which rule of the decision core made a verdict or a step, and the facts it read
    (docs/architecture.md "Decision index"). `id` is stable: never renamed, never reused."""

    id: str = Field(max_length=96, pattern=_RULE_ID, description="The rule's stable dotted id, e.g. "
                    "wedged.pinned_no_process_after_wedge_xid (streams.rules).")
    name: str = Field("", max_length=200, description="What held, in one line.")
    facts: dict[Annotated[str, StringConstraints(max_length=64)], _FactValue] = Field(
        default_factory=dict, max_length=16,
        description="The evidence fields the rule read when it held: codes, counts, seconds, utilization, "
                    "process count, window. Whole numbers, short text, short lists.")


class Alert(Record):
    """A verdict on a GPU (or a node, or the fleet) for people and SIEMs.

    v2: `rule`, the rule that made the alert's classification and the facts it read (null only in
    a /1 alert, which decodes without it)."""

    SCHEMA = "xidstream.alert/2"
    LEGACY = ("xidstream.alert/1",)
    schema_: Literal["xidstream.alert/2"] = Field(SCHEMA, alias="schema")
    alert_id: str
    incident_id: str
    gpu_uuid: str | None = Field(None, description="Null for node- or fleet-wide alerts.")
    pci_bus_id: str | None = None
    classification: Classification
    severity: Severity
    state: Literal["open", "updated", "resolved"] = Field(
        "open", description="open: a new incident; updated: more evidence or a step's outcome; resolved: closed.")
    summary: str
    evidence: Evidence
    recommended_steps: list[str] = Field(default_factory=list)
    rule: RuleRef | None = Field(None, description="The rule behind `classification` (streams.rules); null in a /1 alert.")


class RemediationCommand(Record):
    """A decided step for a separate executor. `command_id` is deterministic from incident and
    step, so a command re-emitted after a restart is recognisable.

    v2: `expires_at` is the evidence's time plus the policy's TTL, so an executor refuses
    a stale command by its wall clock while a replay of an old incident still decides as it did
    live; `evidence_ids` are the `event_id`s the decision rests on; `pci_bus_id` names the GPU when
    its UUID was never resolved (a result echoes it, so it finds its incident).
    v3: `rule`, the rule that decided this step (the verdict's for its plan, a ladder rule for a
    rung climbed after a failed step, a resolve rule for a closing step) and the facts it read. A /2
    command decodes with `rule` null, and its signature is checked over the /2 form it was signed in
    (`signed_form`)."""

    SCHEMA = "xidstream.remediation_command/3"
    LEGACY = ("xidstream.remediation_command/2",)
    schema_: Literal["xidstream.remediation_command/3"] = Field(SCHEMA, alias="schema")
    command_id: str
    incident_id: str
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    pci_bus_id: str | None = Field(None, pattern=_PCI)
    action: Action
    step: int = Field(ge=0)
    reason: str = ""
    preconditions: list[str] = Field(default_factory=list)
    expires_at: UtcDatetime
    requires_approval: bool = False
    dry_run: bool = False
    evidence_ids: list[str] = Field(default_factory=list, description="event_ids of the records it rests on.")
    rule: RuleRef | None = Field(None, description="The rule that decided this step (streams.rules); null in a /2 command.")
    # Signed by the processor: a detached Ed25519 signature over `xidstream.schemas.signing`'s
    # canonical encoding of every other field, and the id of the key that made it.
    key_id: str | None = Field(None, description="Id of the signing key (schemas.signing.key_id).")
    signature: str | None = Field(None, description="Base64 Ed25519 signature over the canonical encoding.")
    # The LEGACY version this command was decoded from (schemas.codec), None when it came in this
    # one: its signature covers the form it was signed in (`signed_form`).
    _decoded_from: str | None = PrivateAttr(None)

    def note_decoded_from(self, found: str | None) -> None:
        self._decoded_from = found

    def signed_form(self, doc: dict) -> dict:
        # A /2 command was signed without `rule` and under its own version: checked in that form, so
        # an executor of this release verifies what the previous processor signed. A /2 command that
        # carries a rule was not made by a /2 producer: left as it is, it fails the check.
        if self._decoded_from == "xidstream.remediation_command/2" and doc.get("rule") is None:
            doc = {k: v for k, v in doc.items() if k != "rule"}
            doc["schema"] = self._decoded_from
        return doc


class ResultStep(_Part):
    """One step an executor took for a command, in order: what it did, when it ended, whether it
    held. A RESET_GPU reports e.g. ``holders_classified``, ``operands_paused``, ``operands_gone``,
    ``persistence_off``, ``reset``, ``verified``, ``persistence_restored``, ``operands_restored``;
    a REBOOT_NODE ``boot_id_recorded``, ``reboot_requested``, ``rebooted``, ``node_ready``,
    ``gpu_back``. The incident's timeline and its time to repair per stage are read from them."""

    step: str = Field(min_length=1, max_length=STEP_NAME_MAX, pattern=r"^[a-z][a-z0-9_]*$")
    at: UtcDatetime
    ok: bool = True
    detail: str = Field("", max_length=SHORT_TEXT_MAX)


class RemediationResult(NodeRecord):
    """What an executor reports back for a command.

    v2: `command_id` and `incident_id` are required (the processor acts only on a result
    that answers a command its incident emitted); `pci_bus_id` is echoed from the command so the
    result of a GPU without a resolved UUID reaches its incident (routing key ``node/pci``).
    v3: strings bounded (schemas.limits); the executor cuts `detail`.
    v4: `steps` (what the executor did, each with its time) and `final` (a refusal that will not
    go away by itself: the processor climbs the ladder rather than wait for a person)."""

    SCHEMA = "xidstream.remediation_result/4"
    # /1 decodes when it names its command and incident; /3 is /4 with no steps and final false
    LEGACY = ("xidstream.remediation_result/1", "xidstream.remediation_result/2", "xidstream.remediation_result/3")
    schema_: Literal["xidstream.remediation_result/4"] = Field(SCHEMA, alias="schema")
    command_id: str = Field(max_length=ID_MAX)
    incident_id: str = Field(max_length=ID_MAX)
    gpu_uuid: str | None = Field(None, max_length=GPU_UUID_MAX)
    pci_bus_id: str | None = Field(None, pattern=_PCI)
    action: Action
    outcome: Outcome
    detail: str = Field("", max_length=DETAIL_MAX)
    steps: list[ResultStep] = Field(default_factory=list, max_length=STEPS_MAX,
                                    description="The executor's steps for this command, in order, each with its time.")
    final: bool = Field(False, description="A refusal (or failure) that will not go away by itself: the "
                                           "reset is not supported here, the GPU is in MIG mode, a holder is "
                                           "not ours, or it was still refused after the executor's bounded "
                                           "wait. The processor climbs to the next rung.")


class Approval(Record):
    """An operator's signed approval of one command that `requires_approval` (e.g. held by the
    fleet circuit breaker): `xidstream approve COMMAND_ID --key FILE`. Executors carry out a held
    command only with an authentic, unexpired approval naming it."""

    SCHEMA = "xidstream.approval/1"
    schema_: Literal["xidstream.approval/1"] = Field(SCHEMA, alias="schema")
    approval_id: str
    command_id: str
    approved_by: str = Field(description="Who approved it, in words (a user name).")
    reason: str = ""
    expires_at: UtcDatetime
    key_id: str | None = None
    signature: str | None = None


class DeadLetter(Record):
    """A record that could not be processed, kept byte for byte with where it came from."""

    SCHEMA = "xidstream.deadletter/1"
    schema_: Literal["xidstream.deadletter/1"] = Field(SCHEMA, alias="schema")
    original: bytes = Field(description="The original value bytes (base64 in JSON).")
    original_key: bytes | None = None
    source_topic: str
    source_partition: int | None = None
    source_offset: int | None = None
    error: str
    error_type: str = ""


class NodeEnrollment(Record):
    """An identity's record key material, vouched for by the Kubernetes API server and signed by
    the enroller (transport.identity): the processor believes a record about node `node` only with
    the MAC of the identity enrolled here. `node` is the node name, or ``@cluster-executor``."""

    SCHEMA = "xidstream.node_enrollment/1"
    schema_: Literal["xidstream.node_enrollment/1"] = Field(SCHEMA, alias="schema")
    x25519_public: str = Field(pattern=r"^[0-9a-f]{64}$", description="The identity's X25519 key (hex).")
    ed25519_public: str = Field(pattern=r"^[0-9a-f]{64}$", description="The key that signed its request (hex).")
    csr_name: str = Field(max_length=253)
    csr_uid: str = Field(max_length=64)
    vouched: str = Field("", max_length=500, description="What the API server recorded of the requester.")
    revoked: bool = False
    key_id: str | None = None
    signature: str | None = None


ALL_MODELS: tuple[type[Record], ...] = (
    GpuInventory,
    GpuSample,
    GpuProcesses,
    XidEvent,
    WorkloadEvent,
    GpuCounters,
    Alert,
    RemediationCommand,
    RemediationResult,
    Approval,
    DeadLetter,
    NodeEnrollment,
)

