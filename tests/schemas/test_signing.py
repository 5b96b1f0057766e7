"""Signed commands and approvals (schemas.signing): what an executor trusts."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import sys
from datetime import timedelta

import pytest

from xidstream.schemas import Action, ConfigError, RemediationCommand, encode
from xidstream.schemas.models import Approval
from xidstream.schemas.signing import SignatureError, SigningKey, VerifyKeys, canonical, canonical_v1, generate_keys
from tests.factories import T0, one_of_each


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
    signer, verifier, kid = keys
    forged = signer.sign(command()).model_copy(update=change)
    if "key_id" in change:  # re-labelled as a key nobody trusts
        with pytest.raises(SignatureError, match="^signed by unknown key 0123456789abcdef"):
            verifier.verify(forged)
        return
    with pytest.raises(SignatureError, match=rf"^forged or altered: the signature does not match key {kid}$"):
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


# -- what is signed, by a second implementation ------------------------------------------------------
def _canonical_by_the_docstring(record) -> bytes:
    """Signature version 1's canonical form, built with the standard library from the record's
    wire encoding: its JSON without `signature`, keys sorted, no whitespace, UTF-8. (Version 2,
    RFC 8785, gives the same bytes for commands and approvals: tests/schemas/test_signing_jcs.py.)"""
    doc = json.loads(encode(record))
    doc.pop("signature", None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("record", one_of_each(), ids=lambda r: type(r).__name__)
def test_the_canonical_form_is_the_documented_one_for_every_record(record):
    # Not a round trip through `canonical` itself: signer and verifier share it, so a canonical
    # form with its keys unsorted would still verify, and break against any other implementation.
    assert canonical_v1(record) == _canonical_by_the_docstring(record)
    if isinstance(record, (RemediationCommand, Approval)):  # what is signed: both versions agree
        assert canonical(record) == _canonical_by_the_docstring(record)


def test_the_signature_is_over_the_documented_form_with_the_key_id_inside(keys):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    signer, _, kid = keys
    signed = signer.sign(command(reason="ünïcode reason", preconditions=["b", "a"]))
    raw = signer._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert kid == signed.key_id == hashlib.sha256(raw).hexdigest()[:16]
    Ed25519PublicKey.from_public_bytes(raw).verify(base64.b64decode(signed.signature), _canonical_by_the_docstring(signed))
    assert f'"key_id":"{kid}"'.encode() in _canonical_by_the_docstring(signed)


def test_the_derived_secret_is_hmac_sha256_of_the_label_under_the_raw_private_key():
    """The processes of one deployment derive the same hand-off secret only while the derivation
    stays the same (a changed label or hash splits a rolling upgrade)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = bytes(range(32))
    key = SigningKey(Ed25519PrivateKey.from_private_bytes(seed))
    assert key.derive(b"fleet hand-off") == hmac.new(seed, b"xidstream derive v1:fleet hand-off", hashlib.sha256).digest()
    assert key.derive(b"a") != key.derive(b"b")


# -- what verify refuses, and says -----------------------------------------------------------------------
def test_a_signature_without_a_key_id_or_a_key_id_without_a_signature_is_unsigned(keys):
    signer, verifier, _ = keys
    signed = signer.sign(command())
    for half in ({"key_id": None}, {"signature": None}, {"key_id": ""}):
        with pytest.raises(SignatureError, match=r"^unsigned: no signature or key_id$"):
            verifier.verify(signed.model_copy(update=half))


def test_a_record_that_cannot_carry_a_signature_is_unsigned(keys):
    _, verifier, _ = keys
    sample = next(r for r in one_of_each() if type(r).__name__ == "GpuSample")
    with pytest.raises(SignatureError, match=r"^unsigned: no signature or key_id$"):
        verifier.verify(sample)


def test_an_unknown_key_names_the_trusted_ones(keys, tmp_path):
    signer, verifier, kid = keys
    other, _, other_kid = generate_keys(tmp_path / "other")
    by_other = SigningKey.load(other).sign(command())
    with pytest.raises(SignatureError, match=rf"^signed by unknown key {other_kid} \(trusted: {kid}\)$"):
        verifier.verify(by_other)
    _, third_pub, third_kid = generate_keys(tmp_path / "third")
    two = VerifyKeys.load([tmp_path / "k" / "signing.pub", third_pub])
    listed = ", ".join(sorted([kid, third_kid]))
    with pytest.raises(SignatureError, match=rf"^signed by unknown key {other_kid} \(trusted: {listed}\)$"):
        two.verify(by_other)
    with pytest.raises(SignatureError, match=rf"^signed by unknown key {kid} \(trusted: none\)$"):
        VerifyKeys.load([], purpose="approvals").verify(signer.sign(command()))


def test_a_signature_that_is_not_strict_base64_is_refused_as_such(keys):
    signer, verifier, _ = keys
    signed = signer.sign(command())
    # one character outside the base64 alphabet: a lax decoder would skip it and call it a forgery
    junk = signed.model_copy(update={"signature": signed.signature[:10] + "$" + signed.signature[10:]})
    with pytest.raises(SignatureError, match=r"^signature is not base64$"):
        verifier.verify(junk)


def test_the_revocation_list_reads_one_key_id_a_line_with_comments(keys, tmp_path):
    signer, verifier, kid = keys
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# keys that leaked\n\n0123456789abcdef  # laptop # stolen twice\nfedcba9876543210#no space\n"
                       f"   {kid}   \n")
    keys_then = VerifyKeys.load([tmp_path / "k" / "signing.pub"], revoked)
    assert keys_then.revoked() == {"0123456789abcdef", "fedcba9876543210", kid}
    with pytest.raises(SignatureError, match=f"signed by revoked key {kid}"):
        keys_then.verify(signer.sign(command()))


def test_a_revocation_list_that_cannot_be_read_trusts_no_key(keys, tmp_path):
    signer, _, _ = keys
    missing = tmp_path / "revoked.txt"
    watched = VerifyKeys.load([tmp_path / "k" / "signing.pub"], missing)
    with pytest.raises(SignatureError, match=rf"^cannot read the revocation list {re.escape(str(missing))}: "
                                             r"No such file or directory; trusting no key until it can be read$"):
        watched.verify(signer.sign(command()))
    missing.write_text("# none\n")
    watched.verify(signer.sign(command()))  # readable again: trusted again


def test_with_revocations_keeps_the_keys_and_applies_the_list(keys, tmp_path):
    signer, verifier, kid = keys
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# none yet\n")
    watched = verifier.with_revocations(revoked)
    assert watched.key_ids == verifier.key_ids == [kid]
    watched.verify(signer.sign(command()))
    revoked.write_text(f"{kid}\n")
    with pytest.raises(SignatureError, match=f"signed by revoked key {kid}"):
        watched.verify(signer.sign(command()))
    verifier.verify(signer.sign(command()))  # the original is left as it was


# -- key files -------------------------------------------------------------------------------------------
def test_generate_keys_writes_the_documented_files_into_a_new_folder(tmp_path):
    priv, pub, kid = generate_keys(tmp_path / "a" / "b")  # parents made as needed
    assert (priv, pub) == (tmp_path / "a" / "b" / "signing.key", tmp_path / "a" / "b" / "signing.pub")
    assert len(kid) == 16 and int(kid, 16) >= 0
    assert VerifyKeys.load([pub]).key_ids == [kid] == [SigningKey.load(priv).key_id]


@pytest.mark.parametrize("present", ["signing.key", "signing.pub"])
def test_generate_keys_refuses_a_folder_holding_either_half(tmp_path, present):
    (tmp_path / present).write_text("keep me")
    with pytest.raises(ConfigError, match="already holds a key pair"):
        generate_keys(tmp_path)
    assert (tmp_path / present).read_text() == "keep me"


def test_a_key_of_another_kind_is_refused_by_name(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.key").write_bytes(other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    (tmp_path / "ec.pub").write_bytes(other.public_key().public_bytes(serialization.Encoding.PEM,
                                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'ec.key'))}: not an Ed25519 private key$"):
        SigningKey.load(tmp_path / "ec.key")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'ec.pub'))}: not an Ed25519 public key$"):
        VerifyKeys.load([tmp_path / "ec.pub"])
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'junk.key'))}: not a PEM private key: "):
        SigningKey.load(tmp_path / "junk.key")


def test_no_verify_key_names_the_flag_to_give():
    with pytest.raises(ConfigError, match=r"^no verify key given: an executor acts only on signed commands "
                                          r"\(--verify-key FILE\)$"):
        VerifyKeys.load([])


def test_a_missing_cryptography_package_is_a_clear_config_error(monkeypatch, tmp_path):
    priv, _, _ = generate_keys(tmp_path / "k")
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives", None)  # what a failed import leaves
    with pytest.raises(ConfigError, match=r"^signing needs the 'cryptography' package \(pip install cryptography\)$"):
        SigningKey.load(priv)
