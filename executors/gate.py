"""The gate every command passes before an executor touches anything.

`decide` is pure: the command, the trusted keys, the executor's wall clock, its scope and node, what
its journal says about the command and the approvals it holds -> refuse (a result to publish) or
proceed. Nothing here talks to Kubernetes, Kafka or the GPU, so every refusal leaves the cluster
unchanged by construction: the caller acts only on `Decision.proceed`.

Order of the checks (each one names itself in the result's `detail`):

1. signature: unsigned, forged, altered or signed by an unknown key -> refused (the SignatureError
   text). First, so nothing an attacker wrote (not even a command_id) selects what we answer.
2. journal: a command_id already carried out is answered again with the journal's result, never
   executed twice (also when it has expired since: the answer is what happened).
3. expiry: `expires_at` <= now by the executor's wall clock -> outcome `expired`.
   lifetime: a command whose `expires_at` lies more than `Limits.max_lifetime_s` after its `ts`,
   or whose `ts` lies more than `Limits.max_future_skew_s` ahead of the executor's clock, is
   refused: a key that signs a command valid for 30 days (T3), or a processor fed records from a
   lying clock (T4), must not leave an order that waits for its moment.
4. node: a node executor acts only on commands for its own node.
5. scope: an action this executor does not carry out (e.g. RESET_GPU sent to the cluster executor).
6. approval: `requires_approval` needs an authentic, unexpired Approval naming the command_id,
   signed by an *approver* key: commands and approvals have separate trust sets, so the
   processor's key (which signs commands) cannot approve what it held, and an approver's key
   cannot sign a command;
   without one the command is refused with `awaiting_approval` set (the Kafka runner holds it until
   an approval arrives or it expires; `--stdin` answers refused at the end of its input).

Dry run (the default; `--apply` turns it off, a command's own `dry_run: true` turns it back on) is
not decided here: the executor describes the action instead of doing it and answers outcome
`refused` with a detail starting ``dry run: would ...``. Not `succeeded`: the processor's fold
treats a succeeded RESET_GPU/REBOOT_NODE as a repair, and a dry run repaired nothing.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Iterable, Literal

import orjson

from xidstream.schemas.base import format_ts, new_event_id
from xidstream.schemas.limits import DETAIL_MAX, STEPS_MAX, clip
from xidstream.schemas.models import Approval, RemediationCommand, RemediationResult, ResultStep
from xidstream.schemas.signing import SignatureError, VerifyKeys
from xidstream.schemas.vocab import Action, Outcome

__all__ = ["Scope", "CLUSTER_ACTIONS", "NODE_ACTIONS", "Decision", "decide", "result_for", "Journal",
           "Approvals", "DRY_RUN_PREFIX", "Limits", "separate_trust"]

log = logging.getLogger(__name__)

Scope = Literal["cluster", "node"]

# Which executor carries out what: the node executor does what needs the node's own hands (NVML,
# the kured sentinel); everything that is an API call is the cluster executor's.
CLUSTER_ACTIONS = frozenset({Action.RECORD, Action.CORDON_NODE, Action.UNCORDON_NODE, Action.DRAIN_NODE,
                             Action.QUARANTINE_GPU, Action.RELEASE_GPU, Action.REPLACE_NODE})
NODE_ACTIONS = frozenset({Action.RESET_GPU, Action.REBOOT_NODE})
SCOPE_ACTIONS = {"cluster": CLUSTER_ACTIONS, "node": NODE_ACTIONS}

DRY_RUN_PREFIX = "dry run: would "


@dataclass(frozen=True)
class Limits:
    """Bounds on what a signed record may claim about time.

    The processor stamps a command with the time of the evidence and lets it live `command_ttl_s`
    (900 s by default, streams.policy): an hour is four times that. Five minutes of future skew is
    the same bound the processor puts on a node's clock (streams.evidence CLOCK_SKEW_S). Approvals
    are made by `xidstream approve` (900 s by default): a day at most."""

    max_lifetime_s: float = 3600.0
    max_future_skew_s: float = 300.0
    max_approval_lifetime_s: float = 86400.0


def separate_trust(commands: VerifyKeys, approvals: VerifyKeys) -> None:
    """Refuse a configuration where one key both signs commands and approves them."""
    both = sorted(set(commands.key_ids) & set(approvals.key_ids))
    if both:
        from xidstream.schemas.errors import ConfigError

        raise ConfigError(f"key(s) {', '.join(both)} are trusted both for commands (--verify-key) and for "
                          f"approvals (--approver-key): a key that signs commands must not approve them; "
                          f"give the approvers keys of their own (xidstream keys generate)")


@dataclass(frozen=True)
class Answer:
    """What an action answers: its outcome and detail, the steps it took (each with its time), and
    whether a refusal is final (it will not go away by itself: the processor climbs). The outcome
    `pending` means "no answer yet": the action answers later through its `due()` (a reboot,
    confirmed once the node's boot id changed)."""

    outcome: str
    detail: str
    steps: tuple[ResultStep, ...] = ()
    final: bool = False


PENDING = "pending"


def result_for(cmd: RemediationCommand, outcome: Outcome | str, detail: str, node: str | None = None, *,
               steps: Iterable[ResultStep] = (), final: bool = False) -> RemediationResult:
    """A result answering `cmd`: command_id, incident_id, gpu_uuid and pci_bus_id echoed. `detail` is
    cut to its cap (schemas.limits.DETAIL_MAX: a drain of many pods names them all), so the result
    still reaches the processor; so are the steps (schemas.limits.STEPS_MAX, the last kept)."""
    steps = list(steps)[-STEPS_MAX:]
    return RemediationResult(node=node or cmd.node, command_id=cmd.command_id, incident_id=cmd.incident_id,
                             gpu_uuid=cmd.gpu_uuid, pci_bus_id=cmd.pci_bus_id, action=cmd.action,
                             outcome=Outcome(outcome), detail=clip(detail, DETAIL_MAX), steps=steps, final=final)


def _stored_result(data: dict) -> RemediationResult:
    """A result the journal kept, maybe written by an earlier executor: an older schema version
    (relabelled, as `xidstream.schemas.decode` does), a detail longer than today's cap (cut)."""
    data = RemediationResult.from_legacy(data.get("schema"), {**data, "schema": RemediationResult.SCHEMA})
    if isinstance(data.get("detail"), str):
        data["detail"] = clip(data["detail"], DETAIL_MAX)
    return RemediationResult.model_validate(data)


@dataclass(frozen=True)
class Decision:
    proceed: bool
    result: RemediationResult | None = None  # the answer when not proceeding
    reason: str = ""  # short name of the check that refused ("signature", "expired", ...)
    awaiting_approval: bool = False
    from_journal: bool = False


class Approvals:
    """Authentic approvals by command_id. Only verified, unexpired approvals count; a forged one is
    dropped with its reason (kept in `rejected` for the log)."""

    def __init__(self, keys: VerifyKeys, limits: Limits | None = None) -> None:
        self._keys = keys
        self._limits = limits or Limits()
        self._by_command: dict[str, list[Approval]] = {}
        self.rejected: list[tuple[str, str]] = []  # (approval_id, why)

    def add(self, approval: Approval) -> str | None:
        """Keep an approval; return why it was rejected (None when kept)."""
        try:
            self._keys.verify(approval)
        except SignatureError as exc:
            self.rejected.append((approval.approval_id, str(exc)))
            return str(exc)
        lifetime = (approval.expires_at - approval.ts).total_seconds()
        if lifetime > self._limits.max_approval_lifetime_s:
            why = (f"valid for {lifetime:.0f} s from its ts, more than the {self._limits.max_approval_lifetime_s:.0f} s "
                   f"an approval may live")
            self.rejected.append((approval.approval_id, why))
            return why
        self._by_command.setdefault(approval.command_id, []).append(approval)
        return None

    def valid_for(self, command_id: str, now: datetime) -> Approval | None:
        for a in self._by_command.get(command_id, ()):
            if a.expires_at > now and a.ts <= now + timedelta(seconds=self._limits.max_future_skew_s):
                try:
                    self._keys.verify(a)  # again: its key may have been revoked since it arrived
                except SignatureError:
                    continue
                return a
        return None

    def expired_for(self, command_id: str, now: datetime) -> list[Approval]:
        return [a for a in self._by_command.get(command_id, ()) if a.expires_at <= now]


def decide(cmd: RemediationCommand, *, keys: VerifyKeys, now: datetime, scope: Scope, node: str | None,
           journal: "Journal", approvals: Approvals, limits: Limits | None = None) -> Decision:
    def refuse(reason: str, detail: str, outcome: Outcome = Outcome.refused, **kw: bool) -> Decision:
        return Decision(False, result_for(cmd, outcome, detail, node=node), reason, **kw)

    try:
        keys.verify(cmd)
    except SignatureError as exc:
        return refuse("signature", f"refused: not authentic: {exc}; nothing was done")
    done = journal.answer(cmd.command_id)
    if done is not None:
        prior = done.detail
        # A new event_id and time: the answer is a new record; outcome and detail are the original's.
        # (model_copy does not validate: the longer detail is cut here.)
        return Decision(False, done.model_copy(update={"detail": clip(f"already carried out (journal): {prior}",
                                                                      DETAIL_MAX),
                                                       "event_id": new_event_id(), "ts": now}),
                        "duplicate", from_journal=True)
    if cmd.expires_at <= now:
        return refuse("expired", f"expired at {format_ts(cmd.expires_at)} (executor clock {format_ts(now)}); "
                                 f"nothing was done", Outcome.expired)
    limits = limits or Limits()
    lifetime = (cmd.expires_at - cmd.ts).total_seconds()
    if lifetime > limits.max_lifetime_s:
        return refuse("lifetime", f"refused: valid for {lifetime:.0f} s from its ts {format_ts(cmd.ts)}, more than the "
                                  f"{limits.max_lifetime_s:.0f} s a command may live; nothing was done")
    if (cmd.ts - now).total_seconds() > limits.max_future_skew_s:
        return refuse("future", f"refused: stamped {format_ts(cmd.ts)}, more than {limits.max_future_skew_s:.0f} s "
                                f"ahead of the executor clock {format_ts(now)}; nothing was done")
    if scope == "node" and cmd.node != node:
        return refuse("node", f"refused: command is for node {cmd.node}, this executor acts only on {node}; "
                              f"nothing was done")
    if cmd.action not in SCOPE_ACTIONS[scope]:
        other = "node" if scope == "cluster" else "cluster"
        return refuse("scope", f"refused: the {scope} executor does not carry out {cmd.action.value} "
                               f"(the {other} executor does); nothing was done")
    if cmd.requires_approval:
        approval = approvals.valid_for(cmd.command_id, now)
        if approval is None:
            stale = approvals.expired_for(cmd.command_id, now)
            why = (f"its approval {stale[0].approval_id} expired at {format_ts(stale[0].expires_at)}" if stale
                   else "no authentic approval names it")
            # the line an operator may paste: the command's fields shell-quoted (signed, but text)
            line = shlex.join(["xidstream", "approve", cmd.command_id, "--key", "FILE", "--node", cmd.node])
            return refuse("approval", f"refused: requires approval and {why} ({line}); nothing was done",
                          awaiting_approval=True)
    return Decision(True)


class Journal:
    """What this executor carried out, by command_id: a JSON-lines file in its state dir, each line
    fsynced before the action starts ("started") and after it ends ("done", with the result).

    A command found "started" without "done" (the executor died while acting) is answered
    `failed`, "interrupted", never run again: whether the first attempt changed something is
    unknown, and running a drain or a reset twice is the worse mistake. Dry runs are not journaled
    (a later `--apply` run must still be able to carry the command out), nor are refusals (an
    unapproved command may be approved later)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._done: dict[str, RemediationResult] = {}
        self._started: dict[str, dict] = {}
        self.held: dict[str, dict] = {}  # command_id -> raw command, awaiting an approval
        if self.path.exists():
            self._repair_tail()
            for line in self.path.read_bytes().splitlines():
                if not line.strip():
                    continue
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a torn last line after a crash: the entry never completed
                try:
                    self._apply(entry)
                except (AttributeError, KeyError, TypeError) as exc:  # no entry of ours: never a reason not to start
                    log.error("journal %s: a line that is no entry, skipped (%s: %s): %r", self.path,
                              type(exc).__name__, str(exc)[:200], line[:200])

    def _repair_tail(self) -> None:
        """A crash mid-write leaves a last line without its newline: appending after it would glue
        the next entry onto it, and the glued line is unreadable on the next start (a command
        started then could be run again after a second crash). A complete entry gets its newline;
        a torn one is cut back to the last newline (it never completed), fsynced."""
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1  # 0 when the torn line is the only one
        tail = data[cut:]
        try:
            orjson.loads(tail)
            complete = True
        except orjson.JSONDecodeError:
            complete = False
        with self.path.open("r+b") as fh:
            if complete:
                fh.seek(0, os.SEEK_END)
                fh.write(b"\n")
            else:
                fh.truncate(cut)
            fh.flush()
            os.fsync(fh.fileno())

    def _apply(self, entry: dict) -> None:
        cid, kind = entry.get("command_id"), entry.get("kind")
        if kind == "started":
            if not isinstance(entry.get("stub"), dict):
                raise KeyError("stub")  # answer() builds the interrupted answer from it
            self._started[cid] = entry
        elif kind == "done":
            try:
                self._done[cid] = _stored_result(entry["result"])
            except (KeyError, TypeError, AttributeError, ValueError) as exc:  # ValidationError is a ValueError
                # A complete line that is no result (a disk error, a hand edit): the executor must
                # still start. Its "started" line stays, so the command is answered as interrupted
                # and never run again.
                log.error("journal %s: the result of command %s is unreadable (%s: %s); answered as interrupted, "
                          "not run again", self.path, cid, type(exc).__name__, str(exc)[:200])
            self.held.pop(cid, None)
        elif kind == "held":
            self.held[cid] = entry["command"]
        elif kind == "released":
            self.held.pop(cid, None)

    def _append(self, entry: dict) -> None:
        with self.path.open("ab") as fh:
            fh.write(orjson.dumps(entry) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        self._apply(entry)

    def answer(self, command_id: str) -> RemediationResult | None:
        if command_id in self._done:
            return self._done[command_id]
        started = self._started.get(command_id)
        if started is not None:
            return _stored_result({
                **started["stub"], "outcome": "failed",
                "detail": f"interrupted: the executor stopped while carrying it out (started {started['at']}); "
                          f"outcome unknown, not run again"})
        return None

    def started(self, cmd: RemediationCommand, now: datetime, node: str | None = None) -> None:
        stub = orjson.loads(result_for(cmd, Outcome.failed, "", node=node).model_dump_json(by_alias=True))
        self._append({"kind": "started", "command_id": cmd.command_id, "at": format_ts(now), "stub": stub})

    def done(self, result: RemediationResult) -> None:
        self._append({"kind": "done", "command_id": result.command_id,
                      "result": orjson.loads(result.model_dump_json(by_alias=True))})

    def hold(self, command_id: str, raw_command: dict) -> None:
        if command_id not in self.held:
            self._append({"kind": "held", "command_id": command_id, "command": raw_command})

    def release(self, command_id: str) -> None:
        if command_id in self.held:
            self._append({"kind": "released", "command_id": command_id})

    def __contains__(self, command_id: str) -> bool:
        return command_id in self._done or command_id in self._started

    def ids(self) -> Iterable[str]:
        return list(self._done)
