"""Who may speak to the fleet agent: the processor's own agents, and an approver resetting the breaker.

The fleet agent signs every command that reaches it (`streams.app`), so whoever can write to the
fleet topic could have it sign anything: with the `processor` Kafka user alone (threat T3: a leaked
role credential, without the private key), a ``REBOOT_NODE kube-control-plane-1`` valid for 30 days
was signed and passed the executors' gate, and an unsigned ``{"kind": "reset"}`` reset the
breaker. Now:

- Every message the GPU agents hand to the fleet agent is sealed with an HMAC-SHA256 over its
  exact bytes, keyed by a secret derived from the signing key (`SigningKey.derive`): only a worker
  holding the private key can seal, and every worker of the processor holds it. An unsealed or
  altered message is dead-lettered with its reason, never folded.
- A breaker reset is an `Approval` for the command id ``breaker-reset`` signed by an approver key
  (the executors' ``--approver-key`` set, never the signing key), unexpired, living at most a day,
  not stamped ahead of the processor's clock, and used once (its approval id is remembered).

Without a signing key (a demo: executors refuse the unsigned commands anyway) messages go unsealed
and a reset needs no approval unless approver keys are given.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timedelta, timezone
from typing import Any

import orjson

from schemas.models import Approval
from schemas.signing import SignatureError, VerifyKeys

__all__ = ["Handoff", "RESET_COMMAND_ID", "HandoffError"]

RESET_COMMAND_ID = "breaker-reset"
_TAG = b"xs1:"  # format version; a sealed message is _TAG + 64 hex digits + ":" + body
_MAC_LEN = 64
# The same bounds as the executors' gate (executors.gate.Limits): an approval lives a day at most
# and may be stamped at most the clock-skew bound ahead.
_MAX_APPROVAL_LIFETIME_S = 86400.0
_MAX_FUTURE_S = 300.0


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

    def seal(self, body: bytes) -> bytes:
        if self.key is None:
            return body
        return _TAG + hmac.new(self.key, body, hashlib.sha256).hexdigest().encode() + b":" + body

    def unseal(self, value: bytes | None) -> bytes | None:
        """The body of a message sealed by `seal` (as it is, without a signing key)."""
        if self.key is None or value is None:
            return value
        if not value.startswith(_TAG) or value[len(_TAG) + _MAC_LEN:len(_TAG) + _MAC_LEN + 1] != b":":
            raise HandoffError("unsealed message on a topic only this processor's agents write")
        mac, body = value[len(_TAG):len(_TAG) + _MAC_LEN], value[len(_TAG) + _MAC_LEN + 1:]
        if not hmac.compare_digest(mac, hmac.new(self.key, body, hashlib.sha256).hexdigest().encode()):
            raise HandoffError("message sealed with another key or altered: not from this processor's agents")
        return body

    def open(self, value: bytes | None, now: float) -> dict:
        """The fleet message in `value`, as `streams.fleet.fleet_step` takes it (a command's
        "command" still a dict); `HandoffError` when it is not one to fold."""
        if not value:
            raise HandoffError("empty fleet-topic message")
        if value.startswith(_TAG):
            if self.key is None:
                raise HandoffError("a sealed message, but this processor has no signing key to check it with")
            return _loads(self.unseal(value))
        msg = _loads(value)
        if msg.get("kind") == "reset":
            return self._reset(msg, now)
        if self.key is not None:
            raise HandoffError(f"unsealed {msg.get('kind')!r} message: only this processor's agents may hand "
                               f"commands to the fleet agent (the signing key seals them)")
        return msg

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
        if approval.ts > at + timedelta(seconds=_MAX_FUTURE_S):
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
