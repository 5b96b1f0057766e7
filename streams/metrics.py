"""The processor's Prometheus metrics (`/metrics` on the worker's web port), as text.

Per worker process: a fleet sums the counters over its workers, and takes the max of the breaker
gauge (only the worker that holds the fleet partition knows the breaker; the others say 0).
The alert rules and the dashboard of the chart (deploy/helm/xidstream/files/) read these names;
`tests/deploy/test_monitoring.py` checks each name they use is one exported here or by the
collector and executor registries.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["LabelledCounts", "metrics_text", "PROCESSOR_METRICS"]

_TOTALS = (
    ("events", "input records folded"),
    ("deadletters", "records sent to the dead-letter topic"),
    ("alerts", "alerts published"),
    ("commands", "remediation commands published"),
    ("rows_written", "GPU table rows written (one per changed row per batch)"),
    ("outputs_refused", "outputs the producer refused for good (over its size limit, or invalid: alerts, commands, "
                        "fleet messages, table rows, dead letters); each record was dead-lettered and the agent went on"),
)
VERDICT_ALERTS = "xidstream_processor_verdict_alerts_total"
ACTION_COMMANDS = "xidstream_processor_action_commands_total"
BREAKER = "xidstream_processor_breaker_tripped"
PROCESSOR_METRICS = frozenset({f"xidstream_processor_{n}_total" for n, _ in _TOTALS} | {VERDICT_ALERTS, ACTION_COMMANDS, BREAKER})


class LabelledCounts:
    """Alerts by verdict and state (opened, escalated, updated, resolved), commands by action and
    whether they are held for an approval, and the fleet breaker's state."""

    def __init__(self) -> None:
        self.alerts: Counter = Counter()
        self.commands: Counter = Counter()
        self.breaker = 0

    def alert(self, a: Any) -> None:
        self.alerts[(_value(a.classification), _value(a.state))] += 1

    def command(self, c: Any) -> None:
        self.commands[(_value(c.action), "true" if c.requires_approval else "false")] += 1


def _value(v: Any) -> str:
    return str(getattr(v, "value", v))


def metrics_text(stats: dict, labelled: LabelledCounts) -> str:
    """Prometheus text exposition format 0.0.4."""
    lines = []
    for name, help_text in _TOTALS:
        metric = f"xidstream_processor_{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter", f"{metric} {stats[name]}"]
    lines += [f"# HELP {VERDICT_ALERTS} alerts published, by verdict and alert state", f"# TYPE {VERDICT_ALERTS} counter"]
    lines += [f'{VERDICT_ALERTS}{{classification="{c}",state="{s}"}} {n}' for (c, s), n in sorted(labelled.alerts.items())]
    lines += [f"# HELP {ACTION_COMMANDS} remediation commands published, by action and whether held for an approval",
              f"# TYPE {ACTION_COMMANDS} counter"]
    lines += [f'{ACTION_COMMANDS}{{action="{a}",held="{h}"}} {n}' for (a, h), n in sorted(labelled.commands.items())]
    lines += [f"# HELP {BREAKER} 1 while the fleet circuit breaker holds node-level commands (this worker's view)",
              f"# TYPE {BREAKER} gauge", f"{BREAKER} {labelled.breaker}"]
    return "\n".join(lines) + "\n"
