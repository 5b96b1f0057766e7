"""Signed commands and approvals (schemas.signing): what an executor trusts."""

from __future__ import annotations

from datetime import timedelta

import pytest

from schemas import Action, ConfigError, RemediationCommand
from schemas.models import Approval
from schemas.signing import SignatureError, SigningKey, VerifyKeys, canonical, generate_keys
from tests.factories import T0


def command(**kw):
    base = dict(ts=T0, node="node-a", command_id="c1", incident_id="i1", gpu_uuid="GPU-1", action=Action.CORDON_NODE,
                step=1, expires_at=T0 + timedelta(minutes=15))
    return RemediationCommand(**{**base, **kw})


@pytest.fixture
def keys(tmp_path):
    priv, pub, kid = generate_keys(tmp_path / "k")
    return SigningKey.load(priv), VerifyKeys.load([pub]), kid


def test_a_signed_command_verifies_and_names_its_key(keys):
    signer, verifier, kid = keys
    signed = signer.sign(command())
    assert signed.key_id == kid and signed.signature
    verifier.verify(signed)


@pytest.mark.parametrize("change", [{"node": "node-b"}, {"action": Action.DRAIN_NODE}, {"requires_approval": True},
                                    {"expires_at": T0 + timedelta(days=1)}, {"key_id": "0123456789abcdef"}])
def test_any_altered_field_is_a_forgery(keys, change):
    signer, verifier, _ = keys
    forged = signer.sign(command()).model_copy(update=change)
    with pytest.raises(SignatureError):
        verifier.verify(forged)


def test_unsigned_and_unknown_key_are_refused(keys, tmp_path):
    signer, verifier, _ = keys
    with pytest.raises(SignatureError, match="unsigned"):
        verifier.verify(command())
    other, _, _ = generate_keys(tmp_path / "other")
    with pytest.raises(SignatureError, match="unknown key"):
        verifier.verify(SigningKey.load(other).sign(command()))


def test_rotation_trusts_every_given_key(tmp_path):
    old_priv, old_pub, _ = generate_keys(tmp_path / "old")
    new_priv, new_pub, _ = generate_keys(tmp_path / "new")
    both = VerifyKeys.load([old_pub, new_pub])
    for priv in (old_priv, new_priv):
        both.verify(SigningKey.load(priv).sign(command()))


def test_approvals_are_signed_records_too(keys):
    signer, verifier, _ = keys
    ok = signer.sign(Approval(ts=T0, node="node-a", approval_id="a1", command_id="c1", approved_by="alice",
                              expires_at=T0 + timedelta(hours=1)))
    verifier.verify(ok)
    with pytest.raises(SignatureError):
        verifier.verify(ok.model_copy(update={"command_id": "c2"}))


def test_canonical_encoding_leaves_out_only_the_signature(keys):
    signer, _, _ = keys
    signed = signer.sign(command())
    assert b'"signature"' not in canonical(signed) and b'"key_id"' in canonical(signed)


def test_key_files_errors_are_clear(tmp_path):
    generate_keys(tmp_path / "k")
    with pytest.raises(ConfigError, match="already holds a key pair"):
        generate_keys(tmp_path / "k")
    with pytest.raises(ConfigError, match="cannot read key file"):
        SigningKey.load(tmp_path / "missing.key")
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        VerifyKeys.load([tmp_path / "junk.pub"])
    with pytest.raises(ConfigError, match="no verify key"):
        VerifyKeys.load([])
    assert oct((tmp_path / "k" / "signing.key").stat().st_mode & 0o777) == "0o600"
