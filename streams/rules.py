"""The rules by name: every verdict, plan and step the processor emits names the rule that made it.

A rule id is a short dotted name, ``<family>.<condition>``: the family is the verdict it makes
(``wedged``, ``suspect``, ``hardware``, ...) or the part of the incident's life it drives
(``ladder`` for a rung climbed after a failed step, ``resolve`` for the closing steps, ``fleet``
and ``claim`` for the fleet agent's), the condition says what held, in words a person can search
for. An id is part of the contract (alerts, commands, OCSF `finding_info.analytic.uid`, ECS
`rule.id`): it is never renamed nor reused for another condition; a rule that changes meaning gets
a new id, and the old one is kept here, retired, so it is not taken again.

docs/architecture.md "Decision index" leads from each id to its function, its policy fields, its
tests and the scenario that shows it; tests/streams/test_rule_index.py keeps the two in step.

Facts (`facts`): the few evidence fields the rule read when it held (codes, counts, seconds,
utilization, process count, window), bounded (`FACTS_MAX` keys, short values) and built only when
a verdict is made, never per record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Rule", "RULES", "RETIRED", "facts", "rule_ref", "FACTS_MAX",
           "APP_FAULT_XID", "SUSPECT_WORKLOADS", "SUSPECT_OCCURRENCES", "SUSPECT_PINNED_AFTER_APP_XID",
           "WEDGED_PINNED", "WEDGED_AGAIN_AFTER_RESET", "WEDGED_AGAIN_AFTER_REBOOT", "PHANTOM_PINNED",
           "HARDWARE_XID", "HARDWARE_NVML_LOST", "HARDWARE_NVML_RESET_REQUIRED", "HARDWARE_FALLEN_OFF_BUS",
           "HARDWARE_RECOVERY_ACTION", "HARDWARE_ROW_REMAP_FAILURE", "DEGRADING_TREND",
           "LADDER_RESET_FAILED", "LADDER_REBOOT_FAILED", "LADDER_XID_AFTER_RESET", "LADDER_XID_AFTER_REBOOT",
           "RESOLVE_HEALTHY", "RESOLVE_PSHC_CANCELLED", "FLEET_STORM", "FLEET_GROUP_STORM", "FLEET_BREAKER_RESET",
           "FLEET_WORKLOAD_FOLLOWS", "FLEET_JOB_FAULTS", "CLAIM_CONFLICT"]

FACTS_MAX = 12  # keys of one rule's facts (schemas.models.Rule caps them at 16)
_TEXT_MAX = 200  # a fact's text: a node's words may be in it


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: its stable id and a one-line name of what held."""

    id: str
    name: str


def _r(rule_id: str, name: str) -> Rule:
    return Rule(rule_id, name)


# -- the GPU's verdicts (streams.verdict, streams.classify) ------------------------------------
APP_FAULT_XID = _r("app_fault.app_class_xid", "application-class Xid occurrence: recorded")
SUSPECT_WORKLOADS = _r("suspect.distinct_workloads", "several different workloads faulted the GPU within the window")
SUSPECT_OCCURRENCES = _r("suspect.repeated_occurrences", "repeated application-class Xid occurrences within the window")
SUSPECT_PINNED_AFTER_APP_XID = _r("suspect.pinned_after_app_xid",
                                  "pinned with no compute process after an application-class Xid, no wedge evidence")
WEDGED_PINNED = _r("wedged.pinned_no_process_after_wedge_xid",
                   "Xid 43 or the driver's recovery failure, then pinned with no compute process for the span")
WEDGED_AGAIN_AFTER_RESET = _r("wedged.again_after_reset", "wedged again after a GPU reset that succeeded")
WEDGED_AGAIN_AFTER_REBOOT = _r("wedged.again_after_reboot", "wedged again after the node came back from its reboot")
PHANTOM_PINNED = _r("phantom.pinned_no_process", "pinned with no compute process and no application or wedge Xid")
HARDWARE_XID = _r("hardware.xid_resolution", "an Xid whose NVIDIA resolution is a GPU or node action")
HARDWARE_NVML_LOST = _r("hardware.nvml_gpu_lost", "NVML reports the GPU lost")
HARDWARE_NVML_RESET_REQUIRED = _r("hardware.nvml_reset_required", "NVML reports the GPU requires a reset")
HARDWARE_FALLEN_OFF_BUS = _r("hardware.fallen_off_bus", "the driver reports the GPU fallen off the bus")
HARDWARE_RECOVERY_ACTION = _r("hardware.nvml_recovery_action", "NVML's GPU recovery action asks for a reset or reboot")
HARDWARE_ROW_REMAP_FAILURE = _r("hardware.row_remap_failure", "a row remap failed: no spare rows left")
DEGRADING_TREND = _r("degrading.counter_trend", "a health counter rising, or telemetry silent, over its window")
# -- the ladder and the closing steps (streams.classify) ---------------------------------------
LADDER_RESET_FAILED = _r("ladder.reset_failed", "the GPU reset failed or was refused for good: reboot the node")
LADDER_REBOOT_FAILED = _r("ladder.reboot_failed", "the node reboot failed or was refused for good: replace the node")
LADDER_XID_AFTER_RESET = _r("ladder.xid_after_reset", "a reset-class Xid again after the GPU reset: reboot the node")
LADDER_XID_AFTER_REBOOT = _r("ladder.xid_after_reboot", "a GPU-level Xid after the node came back from its reboot")
RESOLVE_HEALTHY = _r("resolve.healthy", "healthy for the resolve span with no new Xid: closing steps")
RESOLVE_PSHC_CANCELLED = _r("resolve.pshc_cancelled", "Xid 162 re-engaged power smoothing within the cancel span")
# -- the fleet agent (streams.fleet, streams.storms, streams.claims) ---------------------------
FLEET_STORM = _r("fleet.storm", "capacity-taking actions on too many of the fleet's nodes within the window")
FLEET_GROUP_STORM = _r("fleet.group_storm", "capacity-taking actions on too many nodes of one rack, domain or driver")
FLEET_BREAKER_RESET = _r("fleet.breaker_reset", "an approver's signed reset of the fleet circuit breaker")
FLEET_WORKLOAD_FOLLOWS = _r("fleet.workload_follows", "one pod hit application-class Xids on several GPUs")
FLEET_JOB_FAULTS = _r("fleet.job_faults", "one job's application-class Xids on several nodes within the window")
CLAIM_CONFLICT = _r("claim.conflict", "two nodes claim the same GPU")

RULES: dict[str, Rule] = {r.id: r for r in (
    APP_FAULT_XID, SUSPECT_WORKLOADS, SUSPECT_OCCURRENCES, SUSPECT_PINNED_AFTER_APP_XID, WEDGED_PINNED,
    WEDGED_AGAIN_AFTER_RESET, WEDGED_AGAIN_AFTER_REBOOT, PHANTOM_PINNED, HARDWARE_XID, HARDWARE_NVML_LOST,
    HARDWARE_NVML_RESET_REQUIRED, HARDWARE_FALLEN_OFF_BUS, HARDWARE_RECOVERY_ACTION, HARDWARE_ROW_REMAP_FAILURE,
    DEGRADING_TREND, LADDER_RESET_FAILED, LADDER_REBOOT_FAILED, LADDER_XID_AFTER_RESET, LADDER_XID_AFTER_REBOOT,
    RESOLVE_HEALTHY, RESOLVE_PSHC_CANCELLED, FLEET_STORM, FLEET_GROUP_STORM, FLEET_BREAKER_RESET,
    FLEET_WORKLOAD_FOLLOWS, FLEET_JOB_FAULTS, CLAIM_CONFLICT)}
# Ids once used and withdrawn: never given to another rule.
RETIRED: frozenset[str] = frozenset()


def _fact(value: Any) -> Any:
    """A fact as the contract holds it: an int, a bool, short text, or a short list of ints or
    text. A whole float is an int, any other its text (a signed command holds no floats:
    schemas.signing, both signature versions' bytes stay the same)."""
    if isinstance(value, bool) or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else f"{value:g}"  # text, not a float: 0.333 stays 0.333
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, int) and not isinstance(v, bool) else str(v)[:_TEXT_MAX] for v in value[:16]]
    return str(value)[:_TEXT_MAX]


def rule_ref(rule: Rule | None, facts: dict | None = None) -> dict | None:
    """A rule as alerts and commands carry it (schemas.models.RuleRef), and as an incident keeps it."""
    if rule is None:
        return None
    return {"id": rule.id, "name": rule.name, "facts": dict(facts or {})}


def facts(**items: Any) -> dict[str, Any]:
    """The facts a rule read, bounded; None values (not known) are left out."""
    return {k: _fact(v) for k, v in list(items.items())[:FACTS_MAX] if v is not None}
