"""Builders shared by the gate tests and the executor tests on the real API server."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from xidstream.schemas.models import Approval, RemediationCommand
from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys

UUID1 = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"


def keypair(tmp: Path, name: str = "k") -> tuple[SigningKey, VerifyKeys, Path, Path]:
    priv, pub, _ = generate_keys(tmp / name)
    return SigningKey.load(priv), VerifyKeys.load([pub]), priv, pub


def command(node: str, action: str, *, ttl: float = 600.0, now: datetime | None = None, **kw) -> RemediationCommand:
    now = now or datetime.now(timezone.utc)
    fields = dict(ts=now, node=node, command_id=f"cmd-{uuid.uuid4().hex[:12]}", incident_id=f"inc-{uuid.uuid4().hex[:8]}",
                  gpu_uuid=UUID1, gpu_index=1, pci_bus_id="0000:02:00", action=action, step=1,
                  reason="GPU 1 wedged after Xid 43", expires_at=now + timedelta(seconds=ttl))
    fields.update(kw)
    return RemediationCommand(**fields)


def approval(key: SigningKey, cmd: RemediationCommand, *, ttl: float = 600.0, now: datetime | None = None) -> Approval:
    now = now or datetime.now(timezone.utc)
    return key.sign(Approval(ts=now, node=cmd.node, approval_id=uuid.uuid4().hex, command_id=cmd.command_id,
                             approved_by="operator", expires_at=now + timedelta(seconds=ttl)))
