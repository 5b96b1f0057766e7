"""How long each string and list that a node or an executor sends may be, and `clip` to fit one.

Everything a node sends is untrusted input (docs/security.md), and text the kernel or the kubelet
copied from a tenant is no exception. Unbounded, four 350 KB kernel lines from one collector made
table rows and alerts of megabytes, over the producer's 1 MB request limit (Kafka's
``max.request.size`` default, which faust's producer keeps). Every free-text field of a record a
node or an executor sends therefore has a cap here, set from the source's own limit where it has one:

- the collector never emits a record over a cap: it cuts the text with `clip`, which says how much it
  cut (``... [N more characters]``), rather than lose the record to a validation error;
- a record that arrives over a cap fails validation (`xidstream.schemas.decode` names the field and the
  limit) and the processor dead-letters it.

The caps count characters, as pydantic's ``max_length`` does; a source limit in bytes is at least
as many characters once decoded (an undecodable byte becomes one U+FFFD).
"""

from __future__ import annotations

__all__ = [
    "NODE_NAME_MAX",
    "POD_NAME_MAX",
    "K8S_LABEL_MAX",
    "ID_MAX",
    "GPU_UUID_MAX",
    "NVML_STRING_MAX",
    "TASK_COMM_MAX",
    "PROCESS_NAME_MAX",
    "KERNEL_RAW_MAX",
    "KERNEL_MESSAGE_MAX",
    "KERNEL_TS_MAX",
    "CATALOG_TEXT_MAX",
    "SHORT_TEXT_MAX",
    "NOTES_MAX",
    "DETAIL_MAX",
    "PROCESSES_MAX",
    "XID_SOURCES_MAX",
    "NVLINK_LINKS_MAX",
    "INT64_MAX",
    "INT32_MAX",
    "GPU_INDEX_MAX",
    "PCIE_GEN_MAX",
    "PCIE_WIDTH_MAX",
    "TEMPERATURE_C_MAX",
    "COUNTER_NAME_MAX",
    "COUNTER_NAMES_MAX",
    "JOB_MAX",
    "STEP_NAME_MAX",
    "STEPS_MAX",
    "NVSWITCHES_MAX",
    "clip",
]

# Kubernetes object names: a node or a pod name is a DNS-1123 subdomain (at most 253 characters),
# a namespace or a container name a DNS-1123 label (at most 63). The API server refuses longer ones.
NODE_NAME_MAX = 253
POD_NAME_MAX = 253
K8S_LABEL_MAX = 63

# An identifier a producer makes: our event ids are 32 hex digits, a Kubernetes UID is a 36-character
# UUID, a container id is 64 hex digits, 77 with its runtime prefix (``containerd://``).
ID_MAX = 128

# NVML's buffer for a GPU UUID, MIG UUIDs included (nvml.h NVML_DEVICE_UUID_V2_BUFFER_SIZE = 96).
GPU_UUID_MAX = 96

# NVML's inventory strings: its largest buffer for them is 96 (nvml.h NVML_DEVICE_NAME_V2_BUFFER_SIZE;
# the serial's is 30, the driver version's 80). Also bounds `cuda_version`, which we format.
NVML_STRING_MAX = 96

# A task name (``comm``, what the Xid line's ``name=`` and /proc/<pid>/comm give) is at most 15 bytes
# (TASK_COMM_LEN 16 with its NUL); /dev/kmsg writes an unprintable byte as 4 characters (``\\xNN``).
TASK_COMM_MAX = 64

# NVML's process name (nvmlSystemGetProcessName: a path; pynvml reads it into 1024 bytes).
PROCESS_NAME_MAX = 1024

# A printk record holds at most 1 KiB of text (kernel/printk: PRINTKRB_RECORD_MAX, LOG_LINE_MAX
# before it). `raw` is the line as read, with its prefix (a journal record is its whole JSON object,
# about 1 KiB of fields) and an SXid event's continuation lines, so 4 KiB is generous; `message` is
# the text after the driver's fields, also joined across an SXid event's lines.
KERNEL_RAW_MAX = 4096
KERNEL_MESSAGE_MAX = 2048

# A log line's own time stamp as text: the longest prefix we read is about 35 characters
# (an RFC 3339 stamp with microseconds and a zone offset).
KERNEL_TS_MAX = 64

# NVIDIA's Xid catalog names: the longest mnemonic is 63 characters (schemas.xid_catalog).
CATALOG_TEXT_MAX = 128

# A job a pod belongs to, namespace-qualified (``ns/name``): a namespace (a DNS-1123 label, 63)
# and an object name (a label value or an owner's name, at most a DNS-1123 subdomain, 253).
JOB_MAX = K8S_LABEL_MAX + 1 + POD_NAME_MAX

# A sentence: the collector's note or error around an NVML error string (nvmlErrorString gives a
# few words), a kubelet's termination reason (one CamelCase word: OOMKilled, ContainerCannotRun).
SHORT_TEXT_MAX = 1024

# An inventory's notes: one per field the collector could not read; a GPU has about 20 fields.
NOTES_MAX = 32

# An executor's account of what it did: a drain lists the pods it evicted (a node runs at most
# 110 pods by default: kubelet maxPods), a precondition failure every check that failed.
DETAIL_MAX = 4096
# An executor's steps for one command (RemediationResult.steps): a reset has about ten, a name is a
# word of our own vocabulary.
STEPS_MAX = 32
STEP_NAME_MAX = 64

# Processes per GPU in one snapshot (compute apps, pmon, /dev/nvidia* holders). A CUDA context takes
# hundreds of MiB of GPU memory and MPS served 48 clients per GPU on Volta (NVIDIA's MPS guide), so
# real lists stay in the tens; 4096 leaves room for holders that only have the device open.
PROCESSES_MAX = 4096

# The sources of one Xid record: each of kmsg, journal, file, nvml (schemas.vocab.XidSource) once.
XID_SOURCES_MAX = 4

# NVSwitches one SXid event names (XidEvent.nvswitch_pci_bus_ids): a node's kernel log has lines only
# from its own switches, and a node has at most 12 (HGX-2: two baseboards of six; HGX A100 six,
# HGX H100 four, HGX B200 two: NVIDIA Fabric Manager User Guide, "GPU Baseboard Topologies").
NVSWITCHES_MAX = 16

# NVLinks per GPU: NVML numbers them below NVML_NVLINK_MAX_LINKS (nvml.h; 36 in nvidia-ml-py 13,
# 18 before), the bound the collector probes up to.
NVLINK_LINKS_MAX = 36

# A counter's name in a gpu.counters record (a field name, an NVML function name, a clock event
# reason): the longest we write is under 50 characters.
COUNTER_NAME_MAX = 64
# Names per list of one gpu.counters record: about 30 counters, or the 64 bits of a clock event
# reasons mask (nvmlDeviceGetCurrentClocksEventReasons returns an unsigned long long).
COUNTER_NAMES_MAX = 64
# The integers of a gpu.counters record. Every node writes the topic, so any value must land: the
# lake's columns are Parquet int64, and a count past that (2**64 from a forged record) failed the
# lander's conversion, and every flush after it, for every topic.
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1  # NVML enums and return codes (fabric state and status)
GPU_INDEX_MAX = 4095  # NVML device indices on one node (eight or sixteen GPUs today)
PCIE_GEN_MAX = 32  # PCIe generations (7 today)
PCIE_WIDTH_MAX = 64  # lanes (x16 for a GPU; the PCIe spec's widest link is x32)
TEMPERATURE_C_MAX = 1000  # NVML_TEMPERATURE_GPU in degrees C; GPUs shut down far below this


def clip(text: str | None, limit: int, more: int = 0) -> str | None:
    """`text` cut to at most `limit` characters, ending with ``... [N more characters]`` when cut.

    `more`: characters already left out before this call (e.g. lines not appended), counted in N.
    """
    if text is None or (len(text) <= limit and not more):
        return text
    # The marker's length depends on N: size it for the largest N it can say, then cut.
    widest = f"... [{len(text) + more} more characters]"
    if len(widest) >= limit:  # too small a cap for a marker: a plain cut
        return text[:limit]
    keep = min(len(text), limit - len(widest))
    return f"{text[:keep]}... [{len(text) - keep + more} more characters]"
