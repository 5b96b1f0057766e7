"""Thresholds as data: every default here is the incident write-up's policy
(../shared/reference/incident.md, "The escalation policy") and issue 4; operators override any of
them from a YAML file (`xidstream process --policy FILE`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from schemas.errors import ConfigError
from schemas.xid_catalog import lookup

__all__ = ["Policy", "load_policy", "read_yaml"]


@dataclass(frozen=True)
class Policy:
    # Xid 13/31/43/45/68/109 are the codes the NVIDIA k8s device plugin ignores as application
    # errors (anchors.md, k8s-device-plugin row); codes NVIDIA resolves with RESTART_APP or
    # IGNORE are application-class by NVIDIA's own catalog.
    app_class_xids: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
    app_class_resolutions: frozenset[str] = frozenset({"RESTART_APP", "IGNORE"})
    # Codes always treated as hardware, whatever the two sets above say.
    hardware_xids: frozenset[int] = frozenset()
    # One Xid 13 fault prints several lines within milliseconds; 5 s covers the 13 -> 31 -> 43
    # chain of one fault (incident.md timeline).
    burst_seconds: float = 5.0
    # "Xids repeated within a short window, or several different PIDs faulting the same GPU"
    # (incident.md) -> GPU_SUSPECT.
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
    # Incidents
    alert_cooldown_s: float = 300.0
    resolve_after_s: float = 300.0
    command_ttl_s: float = 3600.0
    evidence_limit: int = 60
    dry_run: bool = False

    def is_app_class(self, xid: int) -> bool:
        if xid in self.hardware_xids:
            return False
        return xid in self.app_class_xids or lookup(xid).resolution in self.app_class_resolutions


_SETS = {"app_class_xids", "app_class_resolutions", "hardware_xids"}


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
                changes[key] = frozenset(str(v) if key == "app_class_resolutions" else int(v) for v in value)
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
    policy = replace(default, **changes)
    for key in ("pinned_seconds", "suspect_window_s", "burst_seconds", "fleet_window_s"):
        if getattr(policy, key) < 0:
            raise ConfigError(f"{where}: {key} must be >= 0")
    if not 0 < policy.fleet_fraction <= 1:
        raise ConfigError(f"{where}: fleet_fraction must be in (0, 1]")
    return policy


