"""Time to repair, per stage, as pure functions of when each milestone of a repair was reached:
used alike by the processor (its incident's milestones, the histograms on /metrics) and by
`xidstream incident` and its HTML report (read from the topics).

    detection -> cordon -> drained -> operands_paused -> reset -> verified -> operands_back -> uncordon

- detection: the verdict that planned the repair (its alert and its first node-level command share
  that time);
- cordon, drained: the CORDON_NODE and DRAIN_NODE `succeeded` answers;
- operands_paused, reset, verified, operands_back: the RESET_GPU answer's steps `operands_gone`
  (else `operands_paused`), `reset`, `verified` and `operands_restored`, when they held (`ok`);
- uncordon: the UNCORDON_NODE `succeeded` answer (a closing step: answered after the incident
  resolved).

A stage lasts from the newest earlier milestone reached to its own: any may be missing (a node
without the GPU Operator has no operands to pause; a reset that failed was never verified). A step
is the executor's word: its time is taken no later than the answer that reports it, and a stage
that would end before it began (two executors' clocks) counts 0 s.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["STAGES", "REPAIR_ACTIONS", "answer_milestones", "step_time", "reached", "durations"]

STAGES = ("detection", "cordon", "drained", "operands_paused", "reset", "verified", "operands_back", "uncordon")
_ORDER = {s: i for i, s in enumerate(STAGES)}
# The commands whose first one starts a repair: the verdict that planned it.
REPAIR_ACTIONS = frozenset({"CORDON_NODE", "DRAIN_NODE", "RESET_GPU", "REBOOT_NODE", "REPLACE_NODE"})
# An answer's `succeeded` that is a milestone by itself
_ANSWERED = {"CORDON_NODE": "cordon", "DRAIN_NODE": "drained", "UNCORDON_NODE": "uncordon"}
# RESET_GPU steps -> milestones; the first of a milestone's steps that held counts
_STEPS = (("operands_gone", "operands_paused"), ("operands_paused", "operands_paused"), ("reset", "reset"),
          ("verified", "verified"), ("operands_restored", "operands_back"))


def step_time(at: float, answered_at: float, shift: float = 0.0) -> float:
    """When a step ended, on the answer's clock: `at` moved by `shift` (how far the answer's own stamp
    was moved, e.g. by the processor's clock-skew bound), never after the answer."""
    return min(at - shift, answered_at)


def answer_milestones(action: str, outcome: str, answered_at: float,
                      steps: Iterable[tuple[str, float, bool]] = ()) -> dict[str, float]:
    """The milestones one answer reaches: `steps` as (name, time, ok), times already taken
    (`step_time`)."""
    if action in _ANSWERED:
        return {_ANSWERED[action]: answered_at} if outcome == "succeeded" else {}
    if action != "RESET_GPU":
        return {}
    held = {}
    for name, at, ok in steps:
        if ok and name not in held:
            held[name] = at
    out: dict[str, float] = {}
    for step, milestone in _STEPS:
        if step in held and milestone not in out:
            out[milestone] = held[step]
    return out


def reached(milestones: dict[str, float], new: dict[str, float]) -> list[tuple[str, float]]:
    """Add `new` to `milestones` (in place; a milestone keeps its first time) and return (stage,
    seconds) for each stage it newly ends: from the newest earlier milestone known now."""
    out = []
    for stage in sorted(new, key=_ORDER.__getitem__):
        if stage in milestones:
            continue
        milestones[stage] = new[stage]
        if stage == "detection":
            continue
        before = [s for s in STAGES[:_ORDER[stage]] if s in milestones]
        if before:
            out.append((stage, max(0.0, new[stage] - milestones[before[-1]])))
    return out


def durations(milestones: dict[str, Any]) -> list[dict[str, Any]]:
    """Every milestone reached, in stage order, with the seconds since the one before it (None for
    detection, or when no earlier one was reached) and since detection."""
    rows = []
    prev = None
    start = milestones.get("detection")
    for stage in STAGES:
        t = milestones.get(stage)
        if t is None:
            continue
        rows.append({"stage": stage, "at": t,
                     "seconds": None if prev is None else round(max(0.0, t - prev), 3),
                     "since_detection": None if start is None or stage == "detection" else round(max(0.0, t - start), 3)})
        prev = t
    return rows
