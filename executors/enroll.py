"""Enrollment of node identities (transport.identity), on the Kubernetes API.

The node side (`request_enrollment`, run by `xidstream identity request` in the node pod) makes
the node's key pair once and asks for enrollment with a CertificateSigningRequest for the signer
``xidstream.io/node-identity``, with its own pod-bound service-account token: the API server
records in the CSR who asked and from which node. Nothing signs or approves these CSRs; they are
the API server's word about the requester.

The cluster side (`Enroller`, in the cluster executor) lists those CSRs, keeps the newest valid one
per identity (`xidstream.transport.identity.validate_csr`), and publishes a `NodeEnrollment` signed with the
enroller's key for each identity whose key is new or changed. A refused CSR is logged with its
reason once. The controller-manager deletes CSRs after a day; the enrollment stays on the
compacted ``xidstream.identities`` topic, and a node asks again at each start.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from typing import Any, Callable

from lightkube import ApiError, Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.certificates_v1 import CertificateSigningRequest

from xidstream.schemas.models import NodeEnrollment
from xidstream.transport.identity import SIGNER_NAME, NodeIdentity, _sa_user, validate_csr

__all__ = ["Enroller", "request_enrollment", "csr_name"]

log = logging.getLogger(__name__)


def csr_name(identity: NodeIdentity) -> str:
    """One CSR name per key pair: asking again with the same keys is idempotent."""
    digest = hashlib.sha256(identity.ed25519_public.encode()).hexdigest()[:10]
    base = identity.identity.lstrip("@").lower()[:200]
    return f"xidstream-identity-{base}-{digest}"


def request_enrollment(client: Client, identity: NodeIdentity) -> str:
    """Create (or find) this identity's CSR; returns its name."""
    from lightkube.models.certificates_v1 import CertificateSigningRequestSpec

    name = csr_name(identity)
    csr = CertificateSigningRequest(
        metadata=ObjectMeta(name=name, labels={"app.kubernetes.io/part-of": "xidstream"}),
        spec=CertificateSigningRequestSpec(request=base64.b64encode(identity.csr_pem()).decode(), signerName=SIGNER_NAME,
                                           usages=["digital signature"]))
    try:
        client.create(csr)
    except ApiError as exc:
        if exc.status.code != 409:  # 409: asked before with these keys
            raise
    return name


class Enroller:
    """Turns the API server's CSRs into signed enrollments, published with `publish(record)`."""

    def __init__(self, client: Client, signing_key: Any, publish: Callable[[NodeEnrollment], None], *,
                 node_service_account: str, cluster_service_account: str | None = None) -> None:
        self.client, self.signing_key, self.publish = client, signing_key, publish
        self.node_sa, self.cluster_sa = node_service_account, cluster_service_account
        # a malformed account is a ConfigError at start, not a refusal of every CSR
        _sa_user(node_service_account)
        if cluster_service_account is not None:
            _sa_user(cluster_service_account)
        self.published: dict[str, str] = {}  # identity -> X25519 key published
        self._refused: set[str] = set()  # CSR uids already logged

    def poll_once(self) -> list[NodeEnrollment]:
        """One pass over the CSRs; returns the enrollments published."""
        newest: dict[str, tuple[str, Any, Any]] = {}
        for csr in self.client.list(CertificateSigningRequest, fields={"spec.signerName": SIGNER_NAME}):
            raw = csr.to_dict()
            check = validate_csr(raw, node_service_account=self.node_sa, cluster_service_account=self.cluster_sa)
            uid = csr.metadata.uid or csr.metadata.name
            if check.identity is None:
                if uid not in self._refused:
                    self._refused.add(uid)
                    log.warning("enrollment refused: %s", check.reason)
                continue
            created = str(csr.metadata.creationTimestamp or "")
            if check.identity not in newest or created > newest[check.identity][0]:
                newest[check.identity] = (created, csr, check)
        out = []
        for identity, (_, csr, check) in newest.items():
            if self.published.get(identity) == check.x25519_public:
                continue
            if identity in self.published:
                # A node's key is made once and kept on the host: a new one means a reimaged
                # node, or someone with that node's token enrolling a key of their own.
                log.warning("identity %s enrolls a NEW key (CSR %s, %s): check the node if it was not reimaged",
                            identity, csr.metadata.name, check.reason)
            rec = self.signing_key.sign(NodeEnrollment(
                node=identity, x25519_public=check.x25519_public, ed25519_public=check.ed25519_public,
                csr_name=csr.metadata.name, csr_uid=csr.metadata.uid or "", vouched=check.reason[:500]))
            self.publish(rec)
            self.published[identity] = check.x25519_public
            log.info("enrolled %s (%s)", identity, check.reason)
            out.append(rec)
        return out
