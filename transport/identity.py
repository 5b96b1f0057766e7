"""Per-node identity: who sent a record, checked where the record is believed.

Every GPU node shares the `collector` and `executor` Kafka users, so with one node's credentials
(threat T2) a node could publish telemetry and executor results about any other node, and the
processor planned cordons, drains and reboots for what it forged. Kafka does not tell a consumer
which principal produced a record, so each record carries its own proof:

- **A key pair per node, made on the node** (`NodeIdentity`, in the node pod's state dir on the
  host: Ed25519 to sign its enrollment request, X25519 for key agreement).
- **Enrolled through what Kubernetes vouches for.** The node pod creates a
  CertificateSigningRequest (signer ``xidstream.io/node-identity``) with its public keys, using its
  own bound service-account token. The API server, not the requester, fills the CSR's `username`
  and `extra`, and for a pod-bound token `extra` names the pod's node
  (``authentication.kubernetes.io/node-name``; Kubernetes 1.30+). The enroller (the cluster
  executor) checks that the requester is the chart's node service account and that the node it
  names is the CSR's subject, and publishes a signed `NodeEnrollment` on ``xidstream.identities``.
  A compromised node's token names its own node only: it can enroll a key for itself, no other.
- **A MAC per record.** The node's record key is HKDF(X25519(node key, processor key)): the node
  and the processor compute it, nobody else. Each record carries the header ``xidstream-auth:
  v1:<identity>:<HMAC-SHA256 over topic, key and value>``; HMAC costs about a microsecond, where an
  Ed25519 verification per record would double the worker's cost per record.
- **Checked where believed** (`RecordVerifier`): a record about node N counts only with N's MAC; a
  result for a node-executor action only with N's, for a cluster action only with the cluster
  executor's (identity ``@cluster-executor``, whose key the enroller publishes the same way).

What a compromised node can still do: send records about itself, true or false, exactly as its
own driver and collector could.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from xidstream.schemas.errors import ConfigError

__all__ = ["NodeIdentity", "ProcessorIdentity", "RecordAuth", "RecordVerifier", "AuthError", "HEADER",
           "SIGNER_NAME", "CLUSTER_IDENTITY", "IDENTITY_PUB", "record_mac", "validate_csr", "CsrCheck",
           "read_processor_public"]

HEADER = "xidstream-auth"
SIGNER_NAME = "xidstream.io/node-identity"
CLUSTER_IDENTITY = "@cluster-executor"
_X25519_URI = "urn:xidstream:x25519:"
_NODE_NAME = "authentication.kubernetes.io/node-name"
_POD_NAME = "authentication.kubernetes.io/pod-name"
_POD_UID = "authentication.kubernetes.io/pod-uid"
_IDENTITY = re.compile(r"^@?[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_X25519_HEX = re.compile(r"^[0-9a-f]{64}$")
# The file `xidstream keys generate` / `keys identity --out` writes beside signing.pub; the chart
# reads it from the verify Secret every node pod mounts already, so no hex is copied by hand.
IDENTITY_PUB = "identity.pub"


def read_processor_public(value: str) -> str:
    """`--processor-identity`: the processor's X25519 public key as 64 hex digits, or a file that
    holds them (identity.pub). A file whose content is not such a key is refused by name: a node
    that agreed a record key with the wrong value would have every record dead-lettered."""
    text = value.strip().lower()
    if _X25519_HEX.match(text):
        return text
    path = Path(value)
    try:
        content = path.read_text(encoding="ascii").strip().lower()
    except FileNotFoundError:
        raise ConfigError(f"--processor-identity {value!r}: neither 64 hex digits nor an existing file "
                          f"(`xidstream keys identity --key signing.key --out {IDENTITY_PUB}` writes one)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--processor-identity {value}: cannot read it ({exc})") from None
    if not _X25519_HEX.match(content):
        raise ConfigError(f"--processor-identity {value}: holds no X25519 public key (64 hex digits, as "
                          f"`xidstream keys identity --key signing.key` prints)")
    return content


class AuthError(ValueError):
    """Why a record's sender could not be believed (the dead-letter record's error)."""


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ConfigError(f"node identity needs the cryptography package: {exc}") from None
    return hashes, serialization, ed25519, x25519, HKDF


def _raw_public(key: Any) -> bytes:
    _, serialization, *_ = _crypto()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _record_key(shared: bytes, identity: str) -> bytes:
    hashes, _, _, _, HKDF = _crypto()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"xidstream record auth v1|" + identity.encode()).derive(shared)


def record_mac(key: bytes, topic: str, rkey: bytes | None, value: bytes | None) -> str:
    """HMAC-SHA256 over what the consumer reads: the topic, the record key and the value."""
    msg = b"%s\0%s\0%s" % (topic.encode(), rkey or b"", value or b"")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


class NodeIdentity:
    """A node's (or the cluster executor's) key pair, made once and kept in `directory` (0600)."""

    def __init__(self, identity: str, signing: Any, agreement: Any) -> None:
        if not _IDENTITY.match(identity):
            raise ConfigError(f"{identity!r} is no node name")
        self.identity, self._signing, self._agreement = identity, signing, agreement

    @classmethod
    def load_or_create(cls, directory: str | Path, identity: str) -> "NodeIdentity":
        _, serialization, ed25519, x25519, _ = _crypto()
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        keys = []
        for name, kind in (("identity-ed25519.key", ed25519.Ed25519PrivateKey),
                           ("identity-x25519.key", x25519.X25519PrivateKey)):
            path = d / name
            if path.exists():
                try:
                    keys.append(kind.from_private_bytes(base64.b64decode(path.read_bytes(), validate=True)))
                except ValueError as exc:
                    raise ConfigError(f"{path}: not a key of this node's identity ({exc}); remove it to make a new one") from None
                continue
            key = kind.generate()
            raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                    serialization.NoEncryption())
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(base64.b64encode(raw))
            keys.append(key)
        return cls(identity, *keys)

    @property
    def x25519_public(self) -> str:
        return _raw_public(self._agreement.public_key()).hex()

    @property
    def ed25519_public(self) -> str:
        return _raw_public(self._signing.public_key()).hex()

    def csr_pem(self) -> bytes:
        """A PKCS#10 request: subject CN = the identity, the X25519 key as a SAN URI, signed with
        the Ed25519 key (so the request itself proves the keys belong together)."""
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        _, serialization, *_ = _crypto()
        csr = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.identity)]))
               .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(_X25519_URI + self.x25519_public)]),
                              critical=False)
               .sign(self._signing, None))
        return csr.public_bytes(serialization.Encoding.PEM)

    def record_auth(self, processor_public: str) -> "RecordAuth":
        _, _, _, x25519, _ = _crypto()
        try:
            peer = x25519.X25519PublicKey.from_public_bytes(bytes.fromhex(processor_public))
        except ValueError as exc:
            raise ConfigError(f"--processor-identity {processor_public!r}: not an X25519 public key in hex ({exc})") from None
        return RecordAuth(self.identity, _record_key(self._agreement.exchange(peer), self.identity))


@dataclass(frozen=True)
class RecordAuth:
    """What a sender adds to each record it produces: the ``xidstream-auth`` header."""

    identity: str
    key: bytes

    def header(self, topic: str, rkey: bytes | None, value: bytes | None) -> tuple[str, bytes]:
        return HEADER, f"v1:{self.identity}:{record_mac(self.key, topic, rkey, value)}".encode()


class ProcessorIdentity:
    """The processor's X25519 key, derived from its signing key (`SigningKey.derive`): nodes are
    given its public half (`xidstream keys identity`), and every worker holding the signing key
    computes each enrolled node's record key."""

    def __init__(self, signing_key: Any) -> None:
        _, _, _, x25519, _ = _crypto()
        self._key = x25519.X25519PrivateKey.from_private_bytes(signing_key.derive(b"node identity x25519"))

    @property
    def public(self) -> str:
        return _raw_public(self._key.public_key()).hex()

    def record_key(self, identity: str, x25519_public: str) -> bytes:
        _, _, _, x25519, _ = _crypto()
        peer = x25519.X25519PublicKey.from_public_bytes(bytes.fromhex(x25519_public))
        return _record_key(self._key.exchange(peer), identity)


class RecordVerifier:
    """Checks the ``xidstream-auth`` header of a record against the enrolled identities."""

    def __init__(self, processor: ProcessorIdentity) -> None:
        self._processor = processor
        self._keys: dict[str, bytes] = {}
        self._enrolled: dict[str, str] = {}  # identity -> its X25519 public key (hex)

    def enroll(self, identity: str, x25519_public: str) -> None:
        if self._enrolled.get(identity) != x25519_public:
            self._keys[identity] = self._processor.record_key(identity, x25519_public)
            self._enrolled[identity] = x25519_public

    def revoke(self, identity: str) -> None:
        self._keys.pop(identity, None)
        self._enrolled.pop(identity, None)

    @property
    def identities(self) -> list[str]:
        return sorted(self._keys)

    def sender(self, headers: Iterable[tuple[str, bytes]] | Mapping[str, bytes] | None, topic: str,
               rkey: bytes | None, value: bytes | None) -> str:
        """The identity whose MAC the record carries; `AuthError` when it carries none that holds."""
        items = headers.items() if isinstance(headers, Mapping) else (headers or ())
        found = [v for k, v in items if k == HEADER]
        if not found:
            raise AuthError(f"no {HEADER} header: the sender is not known (records must come from an enrolled node)")
        if len(found) > 1:
            raise AuthError(f"{len(found)} {HEADER} headers on one record")
        raw = found[0]
        text = raw.decode("ascii", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        parts = text.split(":")
        if len(parts) != 3 or parts[0] != "v1":
            raise AuthError(f"{HEADER} header is not v1:<identity>:<mac>")
        identity, mac = parts[1], parts[2]
        key = self._keys.get(identity)
        if key is None:
            raise AuthError(f"{identity[:64]!r} is not enrolled (no NodeEnrollment for it on xidstream.identities)")
        # as bytes: compare_digest raises TypeError on a str with non-ASCII characters, which a
        # header's bytes decoded with "replace" can hold (a clear refusal, not a crash)
        if not hmac.compare_digest(mac.encode(), record_mac(key, topic, rkey, value).encode()):
            raise AuthError(f"the {HEADER} MAC does not hold for {identity!r}: altered, or sent by another node")
        return identity


@dataclass(frozen=True)
class CsrCheck:
    identity: str | None  # who is enrolled; None when refused
    reason: str  # why refused, or what was checked
    x25519_public: str | None = None
    ed25519_public: str | None = None


def validate_csr(csr: Mapping[str, Any], *, node_service_account: str, cluster_service_account: str | None = None) -> CsrCheck:
    """Whether a CertificateSigningRequest object (as the API server returns it) enrolls a node.

    `node_service_account` / `cluster_service_account`: ``namespace/name`` of the chart's node pod
    and cluster executor service accounts. The API server sets `spec.username` and `spec.extra`
    from the requester's token; the request's subject is what the requester claims. They must agree."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    _, serialization, ed25519, x25519, _ = _crypto()
    spec = csr.get("spec") or {}
    name = (csr.get("metadata") or {}).get("name", "?")
    if spec.get("signerName") != SIGNER_NAME:
        return CsrCheck(None, f"CSR {name}: signer {spec.get('signerName')!r} is not {SIGNER_NAME}")
    try:
        req = x509.load_pem_x509_csr(base64.b64decode(spec.get("request", ""), validate=True))
    except ValueError as exc:
        return CsrCheck(None, f"CSR {name}: not a PEM certificate request ({exc})")
    if not req.is_signature_valid or not isinstance(req.public_key(), ed25519.Ed25519PublicKey):
        return CsrCheck(None, f"CSR {name}: not self-signed with an Ed25519 key")
    cns = req.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    claimed = cns[0].value if len(cns) == 1 else None
    try:
        sans = req.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(_X25519_URI)]
    except x509.ExtensionNotFound:
        uris = []
    if len(uris) != 1 or not re.fullmatch(r"[0-9a-f]{64}", uris[0][len(_X25519_URI):]):
        return CsrCheck(None, f"CSR {name}: no single X25519 key ({_X25519_URI}<64 hex>)")
    x_pub = uris[0][len(_X25519_URI):]
    # The fold refuses such a key too (IdentityDirectory.apply); refused here, it is never signed.
    # A point of low order (RFC 7748 section 6.1) has no shared secret with any key: X25519 with
    # it is all zeros, and `exchange` raises ValueError.
    try:
        x25519.X25519PrivateKey.generate().exchange(x25519.X25519PublicKey.from_public_bytes(bytes.fromhex(x_pub)))
    except ValueError:
        return CsrCheck(None, f"CSR {name}: its X25519 key is a point of low order (no shared secret with any key)")
    e_pub = _raw_public(req.public_key()).hex()
    user = spec.get("username", "")
    extra = spec.get("extra") or {}
    nodes = extra.get(_NODE_NAME) or []
    if cluster_service_account and user == _sa_user(cluster_service_account):
        if claimed != CLUSTER_IDENTITY:
            return CsrCheck(None, f"CSR {name}: the cluster executor may enroll only {CLUSTER_IDENTITY}, not {claimed!r}")
        return CsrCheck(CLUSTER_IDENTITY, f"requested by {user}", x_pub, e_pub)
    if user != _sa_user(node_service_account):
        return CsrCheck(None, f"CSR {name}: requested by {user!r}, not the node service account "
                              f"{_sa_user(node_service_account)}")
    if len(nodes) != 1:
        return CsrCheck(None, f"CSR {name}: the API server names no node for its requester (a token not bound to "
                              f"a pod on a node; Kubernetes 1.30+ records it)")
    if claimed != nodes[0]:
        return CsrCheck(None, f"CSR {name}: asks for {claimed!r} but was requested from a pod on {nodes[0]!r}")
    pod = (extra.get(_POD_NAME) or ["?"])[0]
    return CsrCheck(nodes[0], f"requested by {user} from pod {pod} on node {nodes[0]}", x_pub, e_pub)


def _sa_user(ns_name: str) -> str:
    """The API server's user name for service account ``namespace/name``. Anything else is refused:
    "xidstream" alone gave "system:serviceaccount:xidstream:", a user no token has, and every
    node's enrollment was refused as "not the node service account" with nothing to say why."""
    ns, _, name = ns_name.partition("/")
    if not ns or not name or "/" in name:
        raise ConfigError(f"service account {ns_name!r} is not namespace/name")
    return f"system:serviceaccount:{ns}:{name}"


class IdentityDirectory:
    """Every enrollment on ``xidstream.identities``, kept current in a `RecordVerifier` by a daemon
    thread (each processor worker reads the whole compacted topic: every worker checks records of
    every node). An enrollment counts only when signed by an enroller key; anything else is logged
    and skipped. `wait_loaded` blocks until the topic was read to its end once, so a starting
    worker does not dead-letter records of nodes it has simply not read yet."""

    def __init__(self, settings: Any, enroller_keys: Any, verifier: RecordVerifier, *,
                 consumer: Callable[[dict], Any] | None = None) -> None:
        """`consumer`: makes the reader's consumer from its configuration; confluent-kafka's
        `Consumer` unless given (the fast tests give a scripted one with the same methods:
        `list_topics`, `assign`, `poll`, `close`)."""
        import threading

        self.settings, self.enroller_keys, self.verifier = settings, enroller_keys, verifier
        self._consumer = consumer
        self.refused = 0
        self._loaded = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xidstream-identities", daemon=True)

    def start(self) -> "IdentityDirectory":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def wait_loaded(self, timeout: float = 60.0) -> bool:
        return self._loaded.wait(timeout)

    def apply(self, value: bytes | None) -> str | None:
        """Fold one enrollment record; returns why it was refused (None when it counted)."""
        from xidstream.schemas.codec import decode
        from xidstream.schemas.errors import DecodeError
        from xidstream.schemas.models import NodeEnrollment
        from xidstream.schemas.signing import SignatureError

        try:
            rec = decode(NodeEnrollment, value)
            self.enroller_keys.verify(rec)
        except (DecodeError, SignatureError) as exc:
            self.refused += 1
            return str(exc)
        if rec.revoked:
            self.verifier.revoke(rec.node)
            return None
        try:
            self.verifier.enroll(rec.node, rec.x25519_public)
        except ValueError:
            # A low-order X25519 point (all zeros, for one) is 64 hex digits like any key, and
            # there is no shared secret with it: `exchange` raises ValueError (RFC 7748 section
            # 6.1). The API server vouches only for who asked, so a node can get such a key of its
            # own enrolled; raised here it would end this thread, and no worker could start while
            # the record stays on the compacted topic. The node's old key goes: it asked to replace it.
            self.verifier.revoke(rec.node)
            self.refused += 1
            return (f"{rec.node}: X25519 key {rec.x25519_public} has no shared secret with ours (a low-order "
                    f"point); not believed until it enrolls another")
        return None

    def _run(self) -> None:
        import logging

        from confluent_kafka import Consumer, KafkaError, TopicPartition

        from xidstream.transport.kafka import consumer_config

        log = logging.getLogger(__name__)
        topic = self.settings.topics.name("xidstream.identities")
        make = self._consumer or Consumer
        consumer = make(consumer_config(self.settings, f"{self.settings.topic_prefix}xidstream-identities-reader",
                                        **{"enable.partition.eof": True}))
        try:
            md = consumer.list_topics(topic, timeout=30)
            parts = sorted(md.topics[topic].partitions) if topic in md.topics and md.topics[topic].error is None else []
            if not parts:
                log.error("%s does not exist: no record can be believed until it does (xidstream topics create)", topic)
            consumer.assign([TopicPartition(topic, p, -2) for p in parts])  # -2: from the beginning
            at_end: set[int] = set()
            while not self._stop.is_set():
                msg = consumer.poll(0.5)
                if msg is None:
                    if len(at_end) == len(parts):
                        self._loaded.set()
                    continue
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        at_end.add(msg.partition())
                        if len(at_end) == len(parts):
                            self._loaded.set()
                    else:
                        log.warning("%s: %s", topic, msg.error())
                    continue
                why = self.apply(msg.value())
                if why is not None:
                    log.warning("%s[%d]@%d: enrollment refused: %s", topic, msg.partition(), msg.offset(), why)
        finally:
            consumer.close()
