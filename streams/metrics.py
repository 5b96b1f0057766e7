"""The processor's Prometheus metrics (`/metrics` on the worker's web port), as text.

Per worker process: a fleet sums the counters over its workers, and takes the max of the breaker
gauge (only the worker that holds the fleet partition knows the breaker; the others say 0).
The alert rules and the dashboard of the chart (deploy/helm/xidstream/files/) read these names;
`tests/deploy/test_monitoring.py` checks each name they use is one exported here or by the
collector and executor registries.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from xidstream.schemas.vocab import Action, Classification
from xidstream.streams.repair import STAGES

__all__ = ["LabelledCounts", "metrics_text", "PROCESSOR_METRICS"]

_TOTALS = (
    ("events", "input records folded"),
    ("deadletters", "records sent to the dead-letter topic"),
    ("alerts", "alerts published"),
    ("commands", "remediation commands published"),
    ("rows_written", "GPU table rows written (one per changed row per batch)"),
    ("outputs_refused", "outputs the producer refused for good (over its size limit, or invalid: alerts, commands, "
                        "fleet messages, table rows, dead letters); each record was dead-lettered and the agent went on"),
    ("gpu_claims_refused", "records refused because their GPU's row belongs to another node (per-node identity: two "
                           "nodes claim one GPU UUID); each was dead-lettered, and GPU_CLAIM_CONFLICT alerts say so, "
                           "rate-limited"),
)
VERDICT_ALERTS = "xidstream_processor_verdict_alerts_total"
VERDICTS_RAISED = "xidstream_processor_verdicts_raised_total"
ACTION_COMMANDS = "xidstream_processor_action_commands_total"
BREAKER = "xidstream_processor_breaker_tripped"
REPAIR_STAGE = "xidstream_processor_repair_stage_seconds"
UNCONFIRMED = "xidstream_processor_reboots_unconfirmed"
IDENTITY_OFF = "xidstream_processor_node_identity_off"
# Seconds a stage of a repair took: a cordon takes a second, a drain minutes to hours (PDBs), a
# reset under a minute, a reboot through kured up to its period (an hour) and more.
STAGE_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0)
PROCESSOR_METRICS = frozenset({f"xidstream_processor_{n}_total" for n, _ in _TOTALS}
                              | {VERDICT_ALERTS, VERDICTS_RAISED, ACTION_COMMANDS, BREAKER, UNCONFIRMED, IDENTITY_OFF}
                              | {REPAIR_STAGE + s for s in ("_bucket", "_sum", "_count")})
_STATES = ("open", "updated", "resolved")
# Incidents remembered for "raised": the newest, per worker (an incident's alerts come from the one
# worker that owns its GPU); far more than a worker has open at once.
_RAISED_KEPT = 100_000


class LabelledCounts:
    """Alerts by verdict and state, verdicts raised (an incident's first alert of a verdict: opened
    with it or escalated to it; not a later step's outcome or a closing step's failure, which are
    alerts of the same verdict), commands by action and whether they are held for an approval, and
    the fleet breaker's state.

    Every series exists from the start, at 0: Prometheus's increase() over a series whose first
    sample is already 1 is 0, and the first wedged GPU after a worker started would never page."""

    def __init__(self) -> None:
        self.alerts: Counter = Counter({(c.value, s): 0 for c in Classification for s in _STATES})
        self.raised: Counter = Counter({c.value: 0 for c in Classification})
        self.commands: Counter = Counter({(a.value, h): 0 for a in Action for h in ("false", "true")})
        self.breaker = 0
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        # per stage of a repair (streams.repair, detection not being one): counts per bucket, sum, count
        self.stage_buckets: dict[str, list[int]] = {st: [0] * len(STAGE_BUCKETS) for st in STAGES[1:]}
        self.stage_sum: Counter = Counter({st: 0.0 for st in STAGES[1:]})
        self.stage_count: Counter = Counter({st: 0 for st in STAGES[1:]})
        self.unconfirmed = 0  # GPUs whose REBOOT_NODE went unanswered past reboot_confirm_s (streams.app)
        # 1 for the worker's life when it signs commands but believes records without per-node
        # identity (`xidstream process --records-not-tied-to-nodes`): an alert rule fires on it.
        self.identity_off = 0

    def alert(self, a: Any) -> None:
        cls = _value(a.classification)
        self.alerts[(cls, _value(a.state))] += 1
        key = (str(a.incident_id), cls)
        if _value(a.state) != "resolved" and key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > _RAISED_KEPT:
                self._seen.popitem(last=False)
            self.raised[cls] += 1

    def command(self, c: Any) -> None:
        self.commands[(_value(c.action), "true" if c.requires_approval else "false")] += 1

    def stage(self, stage: str, seconds: float) -> None:
        """One stage of a repair that ended (a fold's "repair_stage" output)."""
        if stage not in self.stage_buckets:
            return
        buckets = self.stage_buckets[stage]
        for i, le in enumerate(STAGE_BUCKETS):
            if seconds <= le:
                buckets[i] += 1
        self.stage_sum[stage] += seconds
        self.stage_count[stage] += 1


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
    lines += [f"# HELP {VERDICTS_RAISED} incidents opened with or escalated to a verdict (what the alert rules page on)",
              f"# TYPE {VERDICTS_RAISED} counter"]
    lines += [f'{VERDICTS_RAISED}{{classification="{c}"}} {n}' for c, n in sorted(labelled.raised.items())]
    lines += [f"# HELP {ACTION_COMMANDS} remediation commands published, by action and whether held for an approval",
              f"# TYPE {ACTION_COMMANDS} counter"]
    lines += [f'{ACTION_COMMANDS}{{action="{a}",held="{h}"}} {n}' for (a, h), n in sorted(labelled.commands.items())]
    lines += [f"# HELP {BREAKER} 1 while the fleet circuit breaker holds node-level commands (this worker's view)",
              f"# TYPE {BREAKER} gauge", f"{BREAKER} {labelled.breaker}"]
    lines += [f"# HELP {REPAIR_STAGE} seconds each stage of a repair took (detection, cordon, drained, operands "
              f"paused, reset, verified, operands back, uncordon), by the stage it ended",
              f"# TYPE {REPAIR_STAGE} histogram"]
    for st, buckets in labelled.stage_buckets.items():
        lines += [f'{REPAIR_STAGE}_bucket{{stage="{st}",le="{le:g}"}} {n}' for le, n in zip(STAGE_BUCKETS, buckets)]
        lines += [f'{REPAIR_STAGE}_bucket{{stage="{st}",le="+Inf"}} {labelled.stage_count[st]}',
                  f'{REPAIR_STAGE}_sum{{stage="{st}"}} {labelled.stage_sum[st]:g}',
                  f'{REPAIR_STAGE}_count{{stage="{st}"}} {labelled.stage_count[st]}']
    lines += [f"# HELP {UNCONFIRMED} GPUs of this worker whose REBOOT_NODE has had no answer for longer than the "
              f"policy's reboot_confirm_s (the node may not have come back)", f"# TYPE {UNCONFIRMED} gauge",
              f"{UNCONFIRMED} {labelled.unconfirmed}"]
    lines += [f"# HELP {IDENTITY_OFF} 1 while this worker signs commands for records not tied to the node they are "
              f"about (no per-node identity: one node's Kafka credentials can forge any node's records)",
              f"# TYPE {IDENTITY_OFF} gauge", f"{IDENTITY_OFF} {labelled.identity_off}"]
    return "\n".join(lines) + "\n"
