"""One incident per GPU: its verdict, its remediation ladder, and the commands it emitted.

A ladder only climbs: RECORD < QUARANTINE_GPU < CORDON_NODE < DRAIN_NODE < RESET_GPU <
REBOOT_NODE < REPLACE_NODE. Once a rung is commanded, nothing below it is commanded again in the
same incident (a GPU reset after an already ordered node reboot would act on a node that is
going away). The closing steps (UNCORDON_NODE, RELEASE_GPU) come only when the incident resolves.

A remediation result acts on the incident only when it answers a command this incident emitted
(same `incident_id`, a known `command_id`, the same action), and only its first outcome counts: a
stale, foreign or repeated result is written into the timeline and changes nothing.
"""

from __future__ import annotations

from typing import Any

from xidstream.schemas.vocab import Action

__all__ = ["Incident", "LADDER", "RUNG", "CLOSING"]

LADDER = (Action.RECORD, Action.QUARANTINE_GPU, Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU,
          Action.REBOOT_NODE, Action.REPLACE_NODE)
RUNG = {a.value: i for i, a in enumerate(LADDER)}
CLOSING = frozenset({Action.UNCORDON_NODE.value, Action.RELEASE_GPU.value})
# The first and the newest part of a long timeline are kept: how it started and how it is going.
_KEEP_HEAD = 10
# RECORD commands kept in `emitted` (the newest): one per application-fault occurrence, so a burst
# of faults grew the row and every alert without end. A RECORD is never a rung nor a closing step;
# an answer to one dropped here is written into the timeline as answering no command.
_RECORDS_KEPT = 16


# The fields of a row, in order (its changelog form is a dict of them).
_FIELDS = ("id", "classification", "opened_at", "remedy", "plan", "emitted", "timeline", "alerts", "last_alert_at",
           "hardware", "remediated", "reset_ok_at", "reboot_ok_at", "recommendation", "sample_stats", "steps", "noted", "repair",
           "rule")


class Incident:
    """A plain class with slots, not a dataclass: mutmut 3 does not mutate the methods of a decorated
    class, and the ladder's rules live in these methods (make mutate)."""

    __slots__ = _FIELDS

    def __init__(self, id: str, classification: str, opened_at: float, remedy: str, plan: list[str] | None = None,
                 emitted: list[dict] | None = None, timeline: list[dict] | None = None, alerts: int = 0,
                 last_alert_at: float | None = None, hardware: bool = False, remediated: bool = False,
                 reset_ok_at: float | None = None, reboot_ok_at: float | None = None,
                 recommendation: str | None = None, sample_stats: dict | None = None, steps: int = 0,
                 noted: int = 0, repair: dict | None = None, rule: dict | None = None) -> None:
        self.id = id
        self.classification = classification
        self.opened_at = opened_at
        self.remedy = remedy
        self.plan = [] if plan is None else plan
        # {"step", "action", "command_id", "ts", "outcome"}: outcome is None until a result answers it
        self.emitted = [] if emitted is None else emitted
        self.timeline = [] if timeline is None else timeline
        self.alerts = alerts
        self.last_alert_at = last_alert_at
        self.hardware = hardware
        self.remediated = remediated
        self.reset_ok_at = reset_ok_at
        self.reboot_ok_at = reboot_ok_at
        self.recommendation = recommendation
        self.sample_stats = sample_stats
        # commands emitted in all: the next step's number (RECORDs past the cap are not kept)
        self.steps = steps
        # timeline entries noted in all: a full timeline drops one as it takes one, at the same
        # length, and the row must still be written (streams.classify._material)
        self.noted = noted
        # stage -> when the repair reached it (streams.repair: detection, cordon, drained, ...)
        self.repair = repair
        # the rule behind `classification` and the facts it read ({"id", "name", "facts"}: what the
        # alerts carry, streams.rules); None in a row written before rules had names
        self.rule = rule

    def __eq__(self, other: object) -> bool:
        if type(other) is not Incident:
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it was

    def __repr__(self) -> str:
        return f"Incident({', '.join(f'{k}={getattr(self, k)!r}' for k in _FIELDS)})"

    # -- the ladder ------------------------------------------------------------------------------
    def top_rung(self) -> int:
        return max((RUNG[e["action"]] for e in self.emitted if e["action"] in RUNG), default=0)

    def has_emitted(self, action: Action) -> bool:
        return any(e["action"] == action.value for e in self.emitted)

    def may_emit(self, action: Action) -> bool:
        """RECORD always (every occurrence is recorded); a remedial rung only above the top one."""
        if action == Action.RECORD:
            return True
        if action.value in CLOSING:
            return not self.has_emitted(action)
        return not self.has_emitted(action) and RUNG[action.value] > self.top_rung()

    def next_step(self) -> int:
        return max(self.steps, len(self.emitted))  # rows written before `steps`: their list's length

    def emit(self, action: Action, command_id: str, ts: float) -> int:
        step = self.next_step()
        self.steps = step + 1
        self.emitted.append({"step": step, "action": action.value, "command_id": command_id, "ts": ts,
                             "outcome": None})
        if action == Action.RECORD:
            records = [i for i, e in enumerate(self.emitted) if e["action"] == Action.RECORD.value]
            if len(records) > _RECORDS_KEPT:
                del self.emitted[records[0]]
        return step

    # -- results ---------------------------------------------------------------------------------
    def answered(self, incident_id: str, command_id: str, action: Action) -> dict | None:
        """The emitted command a result answers, or None when it answers none of this incident's."""
        if incident_id != self.id:
            return None
        for e in self.emitted:
            if e["command_id"] == command_id and e["action"] == action.value:
                return e
        return None

    # -- the timeline ----------------------------------------------------------------------------
    def note(self, entry: dict, limit: int) -> None:
        tl = self.timeline
        tl.append(entry)
        self.noted += 1
        if len(tl) > limit:
            del tl[_KEEP_HEAD: len(tl) - limit + _KEEP_HEAD]

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Incident":
        return cls(**{k: v for k, v in data.items() if k in _FIELDS})

