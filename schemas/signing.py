"""Signed records: remediation commands and approvals carry a detached Ed25519 signature.

Anyone who can write to `gpu.remediation` could otherwise order a fleet-wide drain.
The processor signs every command as it leaves the fleet agent; executors verify with one or more
public keys (several during a key rotation) and refuse anything unsigned, forged or signed by an
unknown key.

What is signed is the record's canonical encoding: its JSON contract form (`xidstream.schemas.codec.to_dict`)
without the `signature` field, canonicalized by RFC 8785, the JSON Canonicalization Scheme (JCS:
keys sorted by their UTF-16 code units, no whitespace, ECMAScript number and minimal string
escaping, UTF-8), which a consumer in any language implements from the RFC or one of its
libraries (docs/consumers.md has test vectors; tests/go/ is a verifier in Go's standard library).
`key_id` is inside what is signed, so a signature cannot be re-labelled as another key's. The
signature is Ed25519 (RFC 8032) over those bytes, base64 (RFC 4648, padded) in `signature`. Key
files are PEM: PKCS#8 for the private key, SubjectPublicKeyInfo for the public one (what
`openssl pkey` reads).

Signature versions. Version 1 (the previous release) signed orjson's sorted compact form
(`canonical_v1`); version 2 signs JCS. The two differ only on floats, integers beyond 2**53 and
keys outside the Basic Multilingual Plane, none of which a command or an approval holds (only
strings, booleans, small integers and timestamps as strings), so for every record either release
signs, both encodings are the same bytes: an executor of the previous release verifies what this
processor signs, and this executor what the previous processor signed (tests/schemas/
test_signing_jcs.py proves it over generated records). A record JCS cannot encode (an integer
beyond 2**53, which only a forger would send) is refused as not authentic.

`cryptography` is imported when a key is loaded, not at import: decoding records needs only
pydantic and orjson.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any, Iterable, TypeVar

import orjson

from xidstream.schemas.base import Record
from xidstream.schemas.codec import to_dict
from xidstream.schemas.errors import ConfigError

__all__ = ["SigningKey", "VerifyKeys", "canonical", "canonical_v1", "key_id", "generate_keys", "SignatureError"]

R = TypeVar("R", bound=Record)


class SignatureError(ValueError):
    """A record that is not authentic: unsigned, forged, or signed by a key we do not trust."""


def _unsigned(record: Record) -> dict:
    doc = record.signed_form(to_dict(record))  # a record of an earlier version: as it was signed
    doc.pop("signature", None)
    return doc


def canonical(record: Record) -> bytes:
    """The bytes a signature covers: RFC 8785 (JCS) of the record's contract JSON less `signature`.
    Raises `SignatureError` for a record JCS cannot encode (an integer beyond 2**53)."""
    import rfc8785

    try:
        return rfc8785.dumps(_unsigned(record))
    except rfc8785.CanonicalizationError as exc:
        raise SignatureError(f"cannot be canonicalized (RFC 8785): {exc}") from None


def canonical_v1(record: Record) -> bytes:
    """Signature version 1's bytes (orjson, keys sorted, compact): what the previous release signed
    and verified; the same bytes as `canonical` for every command and approval."""
    return orjson.dumps(_unsigned(record), option=orjson.OPT_SORT_KEYS)


def key_id(public_raw: bytes) -> str:
    """A short, stable name for a public key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ConfigError("signing needs the 'cryptography' package (pip install cryptography)") from None
    return serialization, ed25519


def _read(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None


class SigningKey:
    """The processor's (or an operator's) private key."""

    def __init__(self, private: Any) -> None:
        serialization, _ = _crypto()
        self._key = private
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = key_id(raw)

    @classmethod
    def load(cls, path: str | Path) -> "SigningKey":
        serialization, ed25519 = _crypto()
        try:
            key = serialization.load_pem_private_key(_read(path), password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path}: not a PEM private key: {exc}") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(f"{path}: not an Ed25519 private key")
        return cls(key)

    def derive(self, label: bytes) -> bytes:
        """A 32-byte secret for `label`, derived from the private key (HMAC-SHA256 keyed by its
        raw bytes): what only holders of this key can compute, e.g. the processor's hand-off MAC."""
        import hmac

        serialization, _ = _crypto()
        raw = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption())
        return hmac.new(raw, b"xidstream derive v1:" + label, hashlib.sha256).digest()

    def sign(self, record: R) -> R:
        """A copy of `record` with `key_id` and `signature` set."""
        stamped = record.model_copy(update={"key_id": self.key_id, "signature": None})
        stamped.note_decoded_from(None)  # signed now, in this version's form (what `encode` writes)
        sig = self._key.sign(canonical(stamped))
        return stamped.model_copy(update={"signature": base64.b64encode(sig).decode("ascii")})


class VerifyKeys:
    """The public keys an executor trusts for one purpose (commands, or approvals), by key id,
    less those a revocation list names.

    `revoked`: a file of revoked key ids (one per line, ``#`` comments), re-read whenever its
    modification time or size changes, so a leaked key is refused without a restart (threat T3: one
    leaked signing key). A revocation list that cannot be read refuses everything rather than
    trusting a key that may be revoked."""

    def __init__(self, keys: dict[str, Any], revoked: str | Path | None = None) -> None:
        self._keys = keys
        self._revoked_path = Path(revoked) if revoked is not None else None
        self._revoked: frozenset[str] = frozenset()
        self._revoked_stamp: tuple | None = None
        self._revoked_error: str | None = None

    def with_revocations(self, path: str | Path | None) -> "VerifyKeys":
        return VerifyKeys(dict(self._keys), path)

    def _reload_revoked(self) -> None:
        if self._revoked_path is None:
            return
        try:
            st = self._revoked_path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._revoked_stamp:
                return
            text = self._revoked_path.read_text()
        except OSError as exc:
            self._revoked_stamp, self._revoked_error = None, f"cannot read the revocation list {self._revoked_path}: {exc.strerror}"
            return
        ids = {ln.split("#", 1)[0].strip() for ln in text.splitlines()}
        self._revoked, self._revoked_stamp, self._revoked_error = frozenset(i for i in ids if i), stamp, None

    def revoked(self) -> frozenset[str]:
        self._reload_revoked()
        return self._revoked

    @classmethod
    def load(cls, paths: Iterable[str | Path], revoked: str | Path | None = None, *,
             purpose: str = "commands") -> "VerifyKeys":
        serialization, ed25519 = _crypto()
        keys: dict[str, Any] = {}
        for path in paths:
            try:
                key = serialization.load_pem_public_key(_read(path))
            except ValueError as exc:
                raise ConfigError(f"{path}: not a PEM public key: {exc}") from None
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise ConfigError(f"{path}: not an Ed25519 public key")
            raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            keys[key_id(raw)] = key
        if not keys and purpose == "commands":
            raise ConfigError("no verify key given: an executor acts only on signed commands (--verify-key FILE)")
        return cls(keys, revoked)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, record: Record) -> None:
        """Raise `SignatureError` naming what is wrong; return None when authentic."""
        sig = getattr(record, "signature", None)
        kid = getattr(record, "key_id", None)
        if not sig or not kid:
            raise SignatureError("unsigned: no signature or key_id")
        key = self._keys.get(kid)
        if key is None:
            raise SignatureError(f"signed by unknown key {kid} (trusted: {', '.join(self.key_ids) or 'none'})")
        self._reload_revoked()
        if self._revoked_error is not None:
            raise SignatureError(f"{self._revoked_error}; trusting no key until it can be read")
        if kid in self._revoked:
            raise SignatureError(f"signed by revoked key {kid} (listed in {self._revoked_path})")
        try:
            raw = base64.b64decode(sig, validate=True)
        except ValueError:
            raise SignatureError("signature is not base64") from None
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(raw, canonical(record))
        except InvalidSignature:
            raise SignatureError(f"forged or altered: the signature does not match key {kid}") from None


def generate_keys(directory: str | Path) -> tuple[Path, Path, str]:
    """Write DIR/signing.key (mode 0600) and DIR/signing.pub; return their paths and the key id.
    Refuses to overwrite an existing key."""
    serialization, ed25519 = _crypto()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = out / "signing.key", out / "signing.pub"
    if priv_path.exists() or pub_path.exists():
        raise ConfigError(f"{out} already holds a key pair; remove it first or choose another --out")
    key = ed25519.Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    priv_path.touch(mode=0o600)
    priv_path.write_bytes(priv)
    pub_path.write_bytes(pub)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return priv_path, pub_path, key_id(raw)
