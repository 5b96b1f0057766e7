"""Thresholds as data: every default here is the incident write-up's policy
(../shared/reference/incident.md, "The escalation policy"); operators override any of
them from a YAML file (`xidstream process --policy FILE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from xidstream.schemas.errors import ConfigError
from xidstream.schemas.xid_catalog import lookup

__all__ = ["Policy", "load_policy", "read_yaml", "is_app_class", "GUARD_MIN_PINNED_SAMPLES", "GUARD_MIN_PINNED_SPAN_S"]


# Codes the NVIDIA k8s device plugin ignores as application errors (anchors.md, k8s-device-plugin
# row: 13, 31, 43, 45, 68, 109), and codes NVIDIA's catalog resolves with RESTART_APP or IGNORE.
# Not a policy setting ("the guard is absolute"): a policy can make xidstream more
# careful, never let one user's Xid reach a node-level action.
DEVICE_PLUGIN_APP_XIDS = frozenset({13, 31, 43, 45, 68, 109})
APP_CLASS_RESOLUTIONS = frozenset({"RESTART_APP", "IGNORE"})

# The guard's floor on sustained evidence before any node-level action (also not a setting): at
# least two pinned samples 10 s apart. A pinned span below it can never act, so a policy asking
# for one is refused rather than left to produce a silent verdict.
GUARD_MIN_PINNED_SAMPLES = 2
GUARD_MIN_PINNED_SPAN_S = 10.0
GUARD_MIN_PINNED_UTIL_PCT = 90.0
GUARD_MAX_PINNED_MEM_FRACTION = 0.05


def is_app_class(xid: int) -> bool:
    """Application-class by NVIDIA's own word: the device plugin's list or the catalog's resolution."""
    return xid in DEVICE_PLUGIN_APP_XIDS or lookup(xid).resolution in APP_CLASS_RESOLUTIONS


@dataclass(frozen=True)
class Policy:
    # Codes treated as hardware beyond NVIDIA's catalog (e.g. a code a vendor's RMA guide names).
    # An application-class code here is refused at load.
    hardware_xids: frozenset[int] = frozenset()
    # One Xid 13 fault prints several lines within milliseconds; 5 s covers the 13 -> 31 -> 43
    # chain of one fault (incident.md timeline).
    burst_seconds: float = 5.0
    # "Xids repeated within a short window, or several different PIDs faulting the same GPU"
    # (incident.md) -> GPU_SUSPECT. Counted per workload (pod UID, else PID): a crash-looping pod
    # is one workload, whatever its PIDs.
    suspect_occurrences: int = 3
    suspect_window_s: float = 600.0
    suspect_distinct_pids: int = 2
    app_xid_lookback_s: float = 1800.0
    # "Xid 43 + compute-apps empty + SM utilization pinned near 100% over time" (incident.md).
    wedged_xid43_lookback_s: float = 1800.0
    pinned_util_pct: float = 95.0
    pinned_mem_fraction: float = 0.01
    pinned_seconds: float = 60.0
    wedged_requires_workload_failure: bool = False
    workload_failure_lookback_s: float = 1800.0
    # Fleet circuit breaker: like NVSentinel's (docs/circuit-breaker.md) and EKS auto-repair's 20%
    # pause (anchors.md "Safety knobs").
    fleet_fraction: float = 0.20
    fleet_min_nodes: int = 3
    fleet_window_s: float = 600.0
    # A node counts towards the fleet (and may have capacity taken away without approval) while its
    # GPU inventory was seen within this span; collectors re-publish theirs every 6 h
    # (collectors.agent INVENTORY_HEARTBEAT_S), so a day survives three missed heartbeats.
    fleet_node_ttl_s: float = 86400.0
    # Storms by blast radius (streams.storms): node-level plans on at least fleet_min_nodes nodes of
    # one group (job, rack, NVLink domain, driver) and on more than group_fraction of its known
    # nodes within fleet_window_s hold that group's further node-level commands for approval; one
    # job's application faults on job_storm_min_nodes nodes within fleet_window_s are one incident.
    # Half: NVL72 users ask for a rack-level decision once most of a domain is affected
    # (NVSentinel#1275); a teardown of a 2-node job is ordinary, of 3 or more worth one line.
    group_storms: bool = True
    group_fraction: float = 0.5
    job_storm_min_nodes: int = 3
    # Incidents
    alert_cooldown_s: float = 300.0
    resolve_after_s: float = 300.0
    # Xid 163 (power smoothing disengaged) re-engaged by an Xid 162 of the same GPU within this span
    # is cancelled: the incident it opened closes (its quarantine released), and a 163 read after its
    # 162 raises nothing (streams.verdict, "power smoothing"). NVIDIA publishes no figure: five
    # minutes, the span resolve_after_s asks of a GPU before any incident resolves; a disengagement
    # that lasted longer stays open for a person (NVIDIA: resolve the thermal events).
    pshc_cancel_s: float = 300.0
    # A command expires this long after the evidence it rests on (event time), so an executor
    # refuses by its wall clock what a replay of history or a stuck queue delivers late.
    command_ttl_s: float = 900.0
    # The bound within which a node's reboot must be seen (its bootID changed, the node Ready, the
    # GPU back) after REBOOT_NODE was commanded. kured, the default reboot backend, looks at its
    # sentinel once per `--period`, 60 min by default (kubereboot/kured cmd/kured/main.go), then
    # drains, reboots and waits for the node: a bound under an hour would call a reboot that kured
    # was about to do "not seen". An hour of period plus 30 min for kured's lock and drain, a GPU
    # server's firmware POST (minutes on 8-GPU boards), the boot, the driver and the collector's
    # first inventory. Raise it for a kured reboot window (`--start-time`/`--end-time`), which can
    # hold a reboot for most of a day. The node executor answers `failed` past its own bound (keep
    # it at or under this one) and the processor climbs to REPLACE_NODE; a reboot that no answer
    # ever comes for (the node never came back) is not timed out by the fold (event time per GPU:
    # nothing arrives for it: docs/architecture.md "Known limits"); the processor's /metrics counts
    # it (streams.app.unconfirmed_reboots) and the chart's rules page on it.
    reboot_confirm_s: float = 5400.0
    # How far ahead of its GPU's clock (the collector's sample times) a record's own stamp may be:
    # `dmesg -T` renders from the monotonic clock and drifts after suspend/resume; an RTC can be
    # wrong. A record further ahead is kept, taken at the GPU's clock, and the skew noted.
    max_clock_skew_s: float = 300.0
    evidence_limit: int = 60
    dry_run: bool = False
    # Degradation before the fault (streams.degrade): a counter whose increments over the window
    # reach its rate limit (per hour; 0 turns it off) AND rose in at least `degrade_min_intervals`
    # of the window's 24 intervals raises GPU_DEGRADING, once per `degrade_realert_s`. The plan is
    # RECORD; QUARANTINE_GPU only with `degrade_quarantine`; never a node-level action.
    degrade_window_s: float = 86400.0
    degrade_min_intervals: int = 4
    degrade_realert_s: float = 86400.0
    degrade_quarantine: bool = False
    # marin-community/marin#9086: a GB200 link logged 505 lifetime recoveries, rising by about 100
    # a day (4/h) in the five days before its Xid 149; a healthy link logs none between boots.
    degrade_nvlink_recovery_per_h: float = 1.0
    # NVIDIA publishes no rate for these; the limits sit well above what a healthy GPU shows
    # (replays and CRC errors retried by the link now and then, a few corrected ECC errors a day)
    # and are the policy's to tighten once a fleet's own baseline is known.
    degrade_nvlink_replay_per_h: float = 60.0
    degrade_nvlink_crc_per_h: float = 60.0
    degrade_ecc_sbe_per_h: float = 10.0
    degrade_pcie_replay_per_h: float = 60.0
    # readings with a hardware slowdown bit: 6 an hour is a tenth of the readings at the default
    # 60 s cadence, held over hours (a brief thermal event at full load sets it for a minute or two)
    degrade_hw_slowdown_per_h: float = 6.0
    # Telemetry silence: a gap of more than `degrade_sample_gap_s` in a GPU's samples (1 Hz) while
    # its collector kept publishing its process lists, counted like a counter (GWDG, arXiv
    # 2603.28781: missing samples preceded fallen-off-bus incidents). Half an hour's worth of gaps
    # a day, 0.5/h, is far above a collector restart now and then (which stops both).
    degrade_sample_gap_s: float = 30.0
    degrade_sample_gaps_per_h: float = 0.5

    def __post_init__(self) -> None:
        # Every Policy object holds the guard, however it was made (a file, a mapping, code).
        _check(self, "policy")

    def is_app_class(self, xid: int) -> bool:
        return is_app_class(xid)


_SETS = {"hardware_xids"}
# Settings that earlier versions had and that are no longer the policy's to make.
_FIXED = {
    "app_class_xids": "which codes are application-class comes from NVIDIA's catalog and the device plugin's "
                      "list (13, 31, 43, 45, 68, 109), not from the policy",
    "app_class_resolutions": "application-class resolutions (RESTART_APP, IGNORE) come from NVIDIA's catalog",
}


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content ({} when empty); `ConfigError` naming the file when it cannot be read."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def load_policy(source: str | Path | Mapping[str, Any] | None) -> Policy:
    """A policy from a YAML file or a mapping; unknown keys and bad values are `ConfigError`s."""
    if source is None:
        return Policy()
    where = "policy"
    if not isinstance(source, Mapping):
        where = str(source)
        data = read_yaml(source)
    else:
        data = dict(source)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of settings")
    fixed = sorted(set(data) & set(_FIXED))
    if fixed:
        raise ConfigError(f"{where}: {fixed[0]} is not a policy setting: {_FIXED[fixed[0]]}")
    known = {f.name: f for f in fields(Policy)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    changes: dict[str, Any] = {}
    default = Policy()
    for key, value in data.items():
        current = getattr(default, key)
        try:
            if key in _SETS:
                if not isinstance(value, (list, tuple, set)):
                    raise TypeError("a list")
                if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
                    raise TypeError("a list of integer Xid codes")
                changes[key] = frozenset(value)
            elif isinstance(current, bool):
                if not isinstance(value, bool):
                    raise TypeError("true or false")
                changes[key] = value
            elif isinstance(current, int):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                    raise TypeError("an integer")
                changes[key] = int(value)
            else:
                if isinstance(value, bool):
                    raise TypeError("a number")
                changes[key] = float(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {key} must be {exc if isinstance(exc, TypeError) else 'a number'}, got {value!r}") from None
    try:
        return replace(default, **changes)
    except ConfigError as exc:
        raise ConfigError(f"{where}:{str(exc).removeprefix('policy:')}") from None


# Upper bounds that keep every window and TTL a real duration (a NaN compares false with
# everything, so unchecked it switched rules off: the fleet breaker, resolution, the skew bound).
_MAX_SECONDS = 30 * 24 * 3600.0


def _check(policy: Policy, where: str) -> None:
    """Refuse a policy that contradicts the guard or can only produce silent states."""
    for f in fields(Policy):
        value = getattr(policy, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: {f.name} must be a finite number, got {value}")
        if f.name.endswith("_s") and isinstance(value, (int, float)) and value > _MAX_SECONDS:
            raise ConfigError(f"{where}: {f.name} must be at most {_MAX_SECONDS:g} s (30 days), got {value:g}")
    for x in policy.hardware_xids:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ConfigError(f"{where}: hardware_xids must list integer Xid codes, got {x!r}")
    if policy.wedged_xid43_lookback_s < policy.pinned_seconds:
        raise ConfigError(f"{where}: wedged_xid43_lookback_s must be >= pinned_seconds: a shorter lookback forgets the "
                          "Xid 43 before the pinned evidence is complete, and no wedge is ever found")
    if policy.fleet_min_nodes < 1:
        raise ConfigError(f"{where}: fleet_min_nodes must be >= 1")
    for key in ("suspect_window_s", "burst_seconds", "fleet_window_s", "fleet_node_ttl_s", "alert_cooldown_s", "resolve_after_s",
                "app_xid_lookback_s", "wedged_xid43_lookback_s", "workload_failure_lookback_s", "pshc_cancel_s"):
        if getattr(policy, key) < 0:
            raise ConfigError(f"{where}: {key} must be >= 0")
    app = sorted(x for x in policy.hardware_xids if is_app_class(x))
    if app:
        raise ConfigError(f"{where}: hardware_xids lists application-class Xid {', '.join(map(str, app))} "
                          "(NVIDIA's catalog or the device plugin's list): an application's fault is never a "
                          "reason for a node-level action")
    if policy.pinned_seconds < GUARD_MIN_PINNED_SPAN_S:
        raise ConfigError(f"{where}: pinned_seconds must be >= {GUARD_MIN_PINNED_SPAN_S:g} (the guard's minimum "
                          f"span of pinned samples); below it a wedge could never be acted on")
    # "Pinned" is the guard's own evidence (SM near 100% with nothing resident, incident.md): a
    # policy may make it stricter, never redefine an ordinary busy or idle GPU as pinned.
    if not GUARD_MIN_PINNED_UTIL_PCT <= policy.pinned_util_pct <= 100:
        raise ConfigError(f"{where}: pinned_util_pct must be in [{GUARD_MIN_PINNED_UTIL_PCT:g}, 100]: below it an "
                          "ordinary busy GPU would count as pinned")
    if not 0 <= policy.pinned_mem_fraction <= GUARD_MAX_PINNED_MEM_FRACTION:
        raise ConfigError(f"{where}: pinned_mem_fraction must be in [0, {GUARD_MAX_PINNED_MEM_FRACTION:g}]: above "
                          "it a GPU with a job's memory resident would count as pinned")
    for key in ("suspect_occurrences", "suspect_distinct_pids"):
        if getattr(policy, key) < 2:
            raise ConfigError(f"{where}: {key} must be >= 2: one occurrence is an application fault, "
                              "never a reason to quarantine the GPU")
    if policy.command_ttl_s <= 0:
        raise ConfigError(f"{where}: command_ttl_s must be > 0")
    if policy.reboot_confirm_s < 600:
        raise ConfigError(f"{where}: reboot_confirm_s must be >= 600: a GPU server's reboot (firmware, boot, driver, "
                          "the collector's first inventory) takes minutes, and a shorter bound reports every reboot unseen")
    if policy.max_clock_skew_s < 0:
        raise ConfigError(f"{where}: max_clock_skew_s must be >= 0")
    if policy.evidence_limit < 20:
        raise ConfigError(f"{where}: evidence_limit must be >= 20")
    if not 0 < policy.fleet_fraction <= 1:
        raise ConfigError(f"{where}: fleet_fraction must be in (0, 1]")
    if policy.degrade_window_s < 3600:
        raise ConfigError(f"{where}: degrade_window_s must be >= 3600: a trend is hours to days of a counter, "
                          "not minutes")
    if not 2 <= policy.degrade_min_intervals <= 24:
        raise ConfigError(f"{where}: degrade_min_intervals must be in [2, 24] (of the window's 24 intervals): with 1, "
                          "a counter that jumped once would count as a trend")
    if policy.degrade_sample_gap_s < 5:
        raise ConfigError(f"{where}: degrade_sample_gap_s must be >= 5: samples come once a second, and a shorter gap "
                          "is a busy collector's jitter")
    if policy.degrade_realert_s < 3600:
        raise ConfigError(f"{where}: degrade_realert_s must be >= 3600: a trend said again at every reading is noise")
    for f in fields(Policy):
        if f.name.startswith("degrade_") and f.name.endswith("_per_h") and getattr(policy, f.name) < 0:
            raise ConfigError(f"{where}: {f.name} must be >= 0 (0 turns the trend off)")
    if not 0 < policy.group_fraction < 1:
        raise ConfigError(f"{where}: group_fraction must be in (0, 1): more than all of a group never happens")
    if policy.job_storm_min_nodes < 2:
        raise ConfigError(f"{where}: job_storm_min_nodes must be >= 2: one node's faults are its pods' "
                          "(the per-pod grouping), not a job's")


