"""xidstream's wire contract: topic models, topic registry, codec, scenario format.

Imports only pydantic, orjson and the standard library, so that any consumer (a SIEM forwarder, a
data-lake loader, a remediation executor) can decode xidstream's topics without faust or NVML.
"""

from schemas.base import Record, format_ts, normalize_pci, utc_now
from schemas.codec import decode, decode_any, encode, to_dict
from schemas.errors import (
    BrokerError,
    ConfigError,
    ContractError,
    DecodeError,
    ScenarioError,
    TopicError,
    XidstreamError,
)
from schemas.models import (
    ALL_MODELS,
    Alert,
    ComputeApp,
    DeadLetter,
    DeviceHolder,
    Evidence,
    EvidenceEntry,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    PmonSample,
    RemediationCommand,
    RemediationResult,
    Approval,
    WorkloadEvent,
    XidEvent,
)
from schemas.scenario import Scenario, load_scenario, parse_scenario
from schemas.topics import DEFAULT_PARTITIONS, INPUT_TOPICS, TOPICS, TopicRegistry, TopicSpec
from schemas.vocab import (
    NODE_ACTIONS,
    Action,
    Classification,
    Outcome,
    SampleStatus,
    Severity,
    WorkloadEventType,
    XidKind,
    XidSource,
)

__all__ = [
    "ALL_MODELS",
    "Action",
    "Alert",
    "BrokerError",
    "Classification",
    "ComputeApp",
    "ConfigError",
    "ContractError",
    "DEFAULT_PARTITIONS",
    "DeadLetter",
    "DecodeError",
    "DeviceHolder",
    "Evidence",
    "EvidenceEntry",
    "GpuInventory",
    "GpuProcesses",
    "GpuSample",
    "INPUT_TOPICS",
    "NODE_ACTIONS",
    "Outcome",
    "PmonSample",
    "Record",
    "RemediationCommand",
    "RemediationResult",
    "Approval",
    "SampleStatus",
    "Scenario",
    "ScenarioError",
    "Severity",
    "TOPICS",
    "TopicError",
    "TopicRegistry",
    "TopicSpec",
    "WorkloadEvent",
    "WorkloadEventType",
    "XidEvent",
    "XidKind",
    "XidSource",
    "XidstreamError",
    "decode",
    "decode_any",
    "encode",
    "format_ts",
    "load_scenario",
    "normalize_pci",
    "parse_scenario",
    "to_dict",
    "utc_now",
]
