"""Who may speak to the fleet agent: the processor's own agents, and an approver resetting the breaker.

The fleet agent signs every command that reaches it (`xidstream.streams.app`), so whoever can write to the
fleet topic could have it sign anything: with the `processor` Kafka user alone (threat T3: a leaked
role credential, without the private key), a ``REBOOT_NODE kube-control-plane-1`` valid for 30 days
was signed and passed the executors' gate, and an unsigned ``{"kind": "reset"}`` reset the
breaker. Now:

- Every message the GPU agents hand to the fleet agent is sealed with an HMAC-SHA256 over its
  exact bytes and the time it was sealed (the sealing worker's clock, in ms), keyed by a secret
  derived from the signing key (`SigningKey.derive`): only a worker holding the private key can
  seal, and every worker of the processor holds it. An unsealed or altered message is
  dead-lettered with its reason, never folded.
- A sealed message is good for `MAX_AGE_S` (an hour) from its seal time, by the clock of the
  worker that opens it: the same user could copy a sealed message off the topic and write it again
  (a replay), and the fleet agent remembered what it had released in memory only, so after a
  restart the copy was released and signed again and counted by the breaker once more. Older, or
  stamped more than `MAX_FUTURE_S` ahead, it is dead-lettered; within the hour the fleet agent
  knows each command it released from the rows of its table (`xidstream.streams.fleet`), restarts included.
  A message of the format before the seal time (``xs1``) cannot be told from its copy and is
  dead-lettered on the fleet topic; re-keyed results (`unseal`) still take it: the GPU's row
  answers each command once, restarts included.
- A breaker reset is an `Approval` for the command id ``breaker-reset`` signed by an approver key
  (the executors' ``--approver-key`` set, never the signing key), unexpired, living at most a day,
  not stamped ahead of the processor's clock, and used once (its approval id is remembered).

Without a signing key (a demo: executors refuse the unsigned commands anyway) messages go unsealed
and a reset needs no approval unless approver keys are given.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import orjson

from xidstream.schemas.models import Approval
from xidstream.schemas.signing import SignatureError, VerifyKeys

__all__ = ["Handoff", "RESET_COMMAND_ID", "HandoffError", "MAX_AGE_S", "MAX_FUTURE_S"]

RESET_COMMAND_ID = "breaker-reset"
# Format version. A sealed message is _TAG + 64 hex digits (the MAC) + ":" + the seal time in ms
# since the epoch (decimal) + ":" + body; the MAC covers the time and the body.
_TAG = b"xs2:"
_OLD_TAG = b"xs1:"  # the format before: _OLD_TAG + MAC + ":" + body, no time
_MAC_LEN = 64
_MAX_MS_DIGITS = 15  # ms since the epoch: 13 digits until the year 2286
# How long a sealed message is good for on the fleet topic. A command lives at most an hour at any
# executor (executors.gate.Limits.max_lifetime_s), and the fleet agent's worker is replaced within
# seconds when it dies (the group's session, 6 s): an hour behind, the fleet agent has a bigger
# problem than what it dead-letters. Within the hour the agent keeps the ids of the commands it
# released (streams.fleet.RELEASED_KEPT), so this bound is also how long it must remember them.
MAX_AGE_S = 3600.0
# The same bounds as the executors' gate (executors.gate.Limits): an approval lives a day at most
# and may be stamped at most the clock-skew bound ahead. A seal stamped further ahead than that
# comes from a worker whose clock is wrong: its copies would outlive the hour by as much.
_MAX_APPROVAL_LIFETIME_S = 86400.0
MAX_FUTURE_S = 300.0


class HandoffError(ValueError):
    """Why a fleet-topic message was refused (the dead-letter record's error)."""


class Handoff:
    # A plain class, not a dataclass: its repr must not print the key (and mutmut 3 does not
    # mutate the methods of a decorated class, so `make mutate` could not judge these)
    def __init__(self, key: bytes | None, approvers: VerifyKeys | None = None) -> None:
        self.key = key  # None: unsealed (no signing key)
        self.approvers = approvers

    @classmethod
    def for_processor(cls, signing_key: Any, approvers: VerifyKeys | None) -> "Handoff":
        return cls(signing_key.derive(b"fleet hand-off") if signing_key is not None else None, approvers)

    def seal(self, body: bytes, now: float | None = None) -> bytes:
        """`body` sealed at `now` (epoch s; this worker's clock when None)."""
        if self.key is None:
            return body
        signed = b"%d:" % round((time.time() if now is None else now) * 1000) + body
        return _TAG + hmac.new(self.key, signed, hashlib.sha256).hexdigest().encode() + b":" + signed

    def _check(self, value: bytes) -> tuple[float | None, bytes]:
        """(the seal time in epoch s, None for the format without one; the body) of a sealed
        message whose MAC holds."""
        tag = _TAG if value.startswith(_TAG) else _OLD_TAG if value.startswith(_OLD_TAG) else None
        if tag is None or value[len(tag) + _MAC_LEN:len(tag) + _MAC_LEN + 1] != b":":
            raise HandoffError("unsealed message on a topic only this processor's agents write")
        mac, signed = value[len(tag):len(tag) + _MAC_LEN], value[len(tag) + _MAC_LEN + 1:]
        if not hmac.compare_digest(mac, hmac.new(self.key, signed, hashlib.sha256).hexdigest().encode()):
            raise HandoffError("message sealed with another key or altered: not from this processor's agents")
        if tag is _OLD_TAG:
            return None, signed
        ms, sep, body = signed.partition(b":")
        if not sep or not ms.isdigit() or len(ms) > _MAX_MS_DIGITS:  # our own MAC over a bad time: a bug, not an attack
            raise HandoffError("sealed message without a seal time")
        return int(ms) / 1000, body

    def unseal(self, value: bytes | None) -> bytes | None:
        """The body of a message sealed by `seal` (as it is, without a signing key), however old:
        for the re-keyed results, which their GPU's row takes once each."""
        if self.key is None or value is None:
            return value
        return self._check(value)[1]

    def open(self, value: bytes | None, now: float) -> dict:
        """The fleet message in `value`, as `xidstream.streams.fleet.fleet_step` takes it (a command's
        "command" still a dict); `HandoffError` when it is not one to fold. `now`: this worker's
        clock (epoch s)."""
        return self.open_sealed(value, now)[0]

    def open_sealed(self, value: bytes | None, now: float) -> tuple[dict, float | None]:
        """`open`, and when the message was sealed (epoch s; None for one that is not sealed: a
        breaker reset, or any message of a processor without a signing key)."""
        if not value:
            raise HandoffError("empty fleet-topic message")
        if value.startswith(_TAG) or value.startswith(_OLD_TAG):
            if self.key is None:
                raise HandoffError("a sealed message, but this processor has no signing key to check it with")
            sealed_at, body = self._check(value)
            if sealed_at is None:
                raise HandoffError("sealed without a seal time (hand-off format xs1, a worker of an earlier release): "
                                   "a copy of it cannot be told from it, so it is not folded")
            if now - sealed_at > MAX_AGE_S:
                raise HandoffError(f"sealed {now - sealed_at:.0f} s ago, more than the {MAX_AGE_S:.0f} s a hand-off "
                                   f"is good for: a copy written again, or a fleet agent that far behind")
            if sealed_at - now > MAX_FUTURE_S:
                raise HandoffError(f"sealed {sealed_at - now:.0f} s ahead of this worker's clock, more than "
                                   f"{MAX_FUTURE_S:.0f} s: the clocks of the processor's workers disagree")
            return _loads(body), sealed_at
        msg = _loads(value)
        if msg.get("kind") == "reset":
            return self._reset(msg, now), None
        if self.key is not None:
            raise HandoffError(f"unsealed {msg.get('kind')!r} message: only this processor's agents may hand "
                               f"commands to the fleet agent (the signing key seals them)")
        return msg, None

    def _reset(self, msg: dict, now: float) -> dict:
        if self.approvers is None or not self.approvers.key_ids:
            if self.key is None:
                return msg  # a demo without keys: the breaker resets as before
            raise HandoffError("breaker reset refused: the processor trusts no approver key (--approver-key), "
                               "so no reset can be authenticated")
        raw = msg.get("approval")
        if not isinstance(raw, dict):
            raise HandoffError("breaker reset refused: it carries no signed approval "
                               "(xidstream breaker reset --key APPROVER.key)")
        try:
            approval = Approval.model_validate(raw)
            self.approvers.verify(approval)
        except (ValueError, SignatureError) as exc:
            raise HandoffError(f"breaker reset refused: {exc}") from None
        at = datetime.fromtimestamp(now, tz=timezone.utc)
        if approval.command_id != RESET_COMMAND_ID:
            raise HandoffError(f"breaker reset refused: the approval is for command {approval.command_id!r}, "
                               f"not {RESET_COMMAND_ID!r}")
        if approval.expires_at <= at:
            raise HandoffError(f"breaker reset refused: its approval expired at {approval.expires_at.isoformat()}")
        if (approval.expires_at - approval.ts).total_seconds() > _MAX_APPROVAL_LIFETIME_S:
            raise HandoffError("breaker reset refused: its approval lives longer than a day")
        if approval.ts > at + timedelta(seconds=MAX_FUTURE_S):
            raise HandoffError("breaker reset refused: its approval is stamped ahead of the processor's clock")
        return {"kind": "reset", "ts": now, "by": approval.approved_by, "approval_id": approval.approval_id,
                "key_id": approval.key_id}


def _loads(body: bytes) -> dict:
    try:
        msg = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HandoffError(f"fleet-topic message is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise HandoffError("fleet-topic message is not a JSON object")
    return msg
