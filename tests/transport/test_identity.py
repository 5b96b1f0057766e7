"""Per-node identity without a broker or an API server (transport.identity): the keys, the MAC
each record carries, the verifier's every refusal, the CSR check's every refusal, and the
enrollment fold. The end-to-end runs are tests/integration/test_node_identity.py (a real API
server's CSRs) and test_identity_on_broker.py (a real worker)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import stat

import pytest

from xidstream.schemas.errors import ConfigError
from xidstream.schemas.models import NodeEnrollment
from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys
from xidstream.transport.identity import (CLUSTER_IDENTITY, HEADER, SIGNER_NAME, AuthError, IdentityDirectory, NodeIdentity,
                                ProcessorIdentity, RecordVerifier, record_mac, validate_csr)

LOW_ORDER_REFUSAL = "CSR csr-1: its X25519 key is a point of low order (no shared secret with any key)"
NODE_SA, CLUSTER_SA = "xidstream/xidstream-node", "xidstream/xidstream-cluster-executor"


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    priv, pub, _ = generate_keys(tmp_path_factory.mktemp("proc"))
    return ProcessorIdentity(SigningKey.load(priv))


@pytest.fixture()
def nodes(tmp_path):
    return {n: NodeIdentity.load_or_create(tmp_path / n, n) for n in ("gpu-a", "gpu-b")}


def test_record_mac_is_hmac_sha256_over_topic_key_and_value_separated_by_nul():
    key = b"k" * 32
    assert record_mac(key, "t", b"rk", b"v") == hmac.new(key, b"t\0rk\0v", hashlib.sha256).hexdigest()
    assert record_mac(key, "t", None, None) == hmac.new(key, b"t\0\0", hashlib.sha256).hexdigest()
    # the separator keeps the fields apart: topic "t", key "ab" is not topic "ta", key "b"
    assert record_mac(key, "t", b"ab", b"") != record_mac(key, "ta", b"b", b"")


def test_node_and_processor_derive_the_same_record_key_and_nobody_else_does(processor, nodes):
    a, b = nodes["gpu-a"], nodes["gpu-b"]
    auth_a = a.record_auth(processor.public)
    assert auth_a.key == processor.record_key("gpu-a", a.x25519_public)
    assert len(auth_a.key) == 32
    # bound to the identity too: the same keys under another name give another record key
    assert processor.record_key("gpu-b", a.x25519_public) != auth_a.key
    assert b.record_auth(processor.public).key != auth_a.key
    name, value = auth_a.header("gpu.xid", b"GPU-1", b"{}")
    assert name == HEADER == "xidstream-auth"
    assert value == f"v1:gpu-a:{record_mac(auth_a.key, 'gpu.xid', b'GPU-1', b'{}')}".encode()


def test_keys_are_made_once_kept_private_and_read_back(tmp_path):
    first = NodeIdentity.load_or_create(tmp_path / "id", "gpu-a")
    again = NodeIdentity.load_or_create(tmp_path / "id", "gpu-a")
    assert (again.x25519_public, again.ed25519_public) == (first.x25519_public, first.ed25519_public)
    assert len(first.x25519_public) == 64 and first.x25519_public != first.ed25519_public
    for name in ("identity-ed25519.key", "identity-x25519.key"):
        assert stat.S_IMODE((tmp_path / "id" / name).stat().st_mode) == 0o600
    other = NodeIdentity.load_or_create(tmp_path / "other", "gpu-a")
    assert other.x25519_public != first.x25519_public
    (tmp_path / "id" / "identity-x25519.key").write_bytes(b"not base64!")
    with pytest.raises(ConfigError, match="not a key of this node's identity"):
        NodeIdentity.load_or_create(tmp_path / "id", "gpu-a")


@pytest.mark.parametrize("name, ok", [("gpu-a", True), (CLUSTER_IDENTITY, True), ("a", True), ("node.example.com", True),
                                      ("GPU-A", False), ("-a", False), ("a-", False), ("", False), ("a:b", False),
                                      ("a" * 254, False), ("a" * 253, True)])
def test_an_identity_is_a_node_name_or_the_cluster_executor(tmp_path, name, ok):
    if ok:
        assert NodeIdentity.load_or_create(tmp_path, name).identity == name
    else:
        with pytest.raises(ConfigError, match="is no node name"):
            NodeIdentity.load_or_create(tmp_path, name)


def test_a_processor_identity_that_is_not_an_x25519_key_is_a_clear_error(nodes):
    with pytest.raises(ConfigError, match="--processor-identity 'zz': not an X25519 public key in hex"):
        nodes["gpu-a"].record_auth("zz")


def _verifier(processor, *idents):
    v = RecordVerifier(processor)
    for i in idents:
        v.enroll(i.identity, i.x25519_public)
    return v


def test_the_verifier_names_the_sender_whose_mac_holds(processor, nodes):
    a = nodes["gpu-a"]
    v = _verifier(processor, a, nodes["gpu-b"])
    assert v.identities == ["gpu-a", "gpu-b"]
    h = a.record_auth(processor.public).header("gpu.xid", b"k", b"v")
    assert v.sender([h], "gpu.xid", b"k", b"v") == "gpu-a"
    assert v.sender({h[0]: h[1]}, "gpu.xid", b"k", b"v") == "gpu-a"  # confluent-kafka gives a list, faust a mapping
    assert v.sender([("other", b"x"), h], "gpu.xid", b"k", b"v") == "gpu-a"


@pytest.mark.parametrize("change", ["topic", "key", "value"])
def test_an_altered_record_is_refused(processor, nodes, change):
    a = nodes["gpu-a"]
    v = _verifier(processor, a)
    h = a.record_auth(processor.public).header("gpu.xid", b"k", b"v")
    args = {"topic": "gpu.xid", "key": b"k", "value": b"v"}
    args[change] = "gpu.samples" if change == "topic" else b"x"
    with pytest.raises(AuthError, match="^the xidstream-auth MAC does not hold for 'gpu-a': altered, or sent by another node$"):
        v.sender([h], args["topic"], args["key"], args["value"])


def test_node_b_cannot_speak_as_node_a(processor, nodes):
    a, b = nodes["gpu-a"], nodes["gpu-b"]
    v = _verifier(processor, a, b)
    mac_b = b.record_auth(processor.public).header("gpu.xid", b"k", b"v")[1].decode().split(":")[2]
    with pytest.raises(AuthError, match="does not hold for 'gpu-a'"):
        v.sender([(HEADER, f"v1:gpu-a:{mac_b}".encode())], "gpu.xid", b"k", b"v")


@pytest.mark.parametrize("headers, why", [
    (None, "^no xidstream-auth header: the sender is not known"),
    ([], "^no xidstream-auth header"),
    ([("xidstream-auth-x", b"v1:gpu-a:00")], "^no xidstream-auth header"),
    ([(HEADER, b"v2:gpu-a:00")], r"^xidstream-auth header is not v1:<identity>:<mac>$"),
    ([(HEADER, b"v1:gpu-a")], r"^xidstream-auth header is not v1:<identity>:<mac>$"),
    ([(HEADER, b"v1:gpu-a:00:11")], r"^xidstream-auth header is not v1:<identity>:<mac>$"),
    ([(HEADER, b"v1:gpu-z:00")], r"^'gpu-z' is not enrolled \(no NodeEnrollment for it on xidstream.identities\)$"),
    ([(HEADER, b"v1:gpu-a:00"), (HEADER, b"v1:gpu-a:00")], "^2 xidstream-auth headers on one record$"),
])
def test_every_header_that_proves_nothing_is_refused_with_its_reason(processor, nodes, headers, why):
    v = _verifier(processor, nodes["gpu-a"])
    with pytest.raises(AuthError, match=why):
        v.sender(headers, "gpu.xid", b"k", b"v")


def test_an_unknown_identitys_name_is_cut_in_the_error(processor, nodes):
    v = _verifier(processor)
    with pytest.raises(AuthError) as e:
        v.sender([(HEADER, b"v1:" + b"x" * 300 + b":00")], "t", None, None)
    assert str(e.value) == f"{'x' * 64!r} is not enrolled (no NodeEnrollment for it on xidstream.identities)"


def test_revoking_or_re_enrolling_an_identity_ends_its_old_key(processor, nodes, tmp_path):
    a = nodes["gpu-a"]
    v = _verifier(processor, a)
    h = a.record_auth(processor.public).header("t", None, b"v")
    v.enroll("gpu-a", a.x25519_public)  # the same key again: still believed
    assert v.sender([h], "t", None, b"v") == "gpu-a"
    v.revoke("gpu-a")
    v.revoke("gpu-a")  # twice is harmless
    assert v.identities == []
    with pytest.raises(AuthError, match="not enrolled"):
        v.sender([h], "t", None, b"v")
    reimaged = NodeIdentity.load_or_create(tmp_path / "new", "gpu-a")
    v.enroll("gpu-a", a.x25519_public)
    v.enroll("gpu-a", reimaged.x25519_public)
    with pytest.raises(AuthError, match="does not hold"):
        v.sender([h], "t", None, b"v")
    assert v.sender([reimaged.record_auth(processor.public).header("t", None, b"v")], "t", None, b"v") == "gpu-a"


# --- the CSR check -----------------------------------------------------------------------------

def _csr(pem: bytes, *, user="system:serviceaccount:xidstream:xidstream-node", nodes=("gpu-a",), signer=SIGNER_NAME,
         pod="xidstream-node-abcde") -> dict:
    extra = {}
    if nodes is not None:
        extra["authentication.kubernetes.io/node-name"] = list(nodes)
    if pod is not None:
        extra["authentication.kubernetes.io/pod-name"] = [pod]
    return {"metadata": {"name": "csr-1"},
            "spec": {"signerName": signer, "request": base64.b64encode(pem).decode(), "username": user, "extra": extra}}


def test_a_node_pods_request_for_its_own_node_is_enrolled(nodes):
    a = nodes["gpu-a"]
    check = validate_csr(_csr(a.csr_pem()), node_service_account=NODE_SA, cluster_service_account=CLUSTER_SA)
    assert check.identity == "gpu-a"
    assert (check.x25519_public, check.ed25519_public) == (a.x25519_public, a.ed25519_public)
    assert check.reason == ("requested by system:serviceaccount:xidstream:xidstream-node from pod xidstream-node-abcde "
                            "on node gpu-a")
    check = validate_csr(_csr(a.csr_pem(), pod=None), node_service_account=NODE_SA)
    assert check.reason.endswith("from pod ? on node gpu-a")


def test_the_cluster_executor_enrolls_only_itself(tmp_path):
    me = NodeIdentity.load_or_create(tmp_path / "c", CLUSTER_IDENTITY)
    user = "system:serviceaccount:xidstream:xidstream-cluster-executor"
    check = validate_csr(_csr(me.csr_pem(), user=user, nodes=None), node_service_account=NODE_SA,
                         cluster_service_account=CLUSTER_SA)
    assert (check.identity, check.reason, check.x25519_public) == (CLUSTER_IDENTITY, f"requested by {user}", me.x25519_public)
    node = NodeIdentity.load_or_create(tmp_path / "n", "gpu-a")
    check = validate_csr(_csr(node.csr_pem(), user=user), node_service_account=NODE_SA, cluster_service_account=CLUSTER_SA)
    assert (check.identity, check.reason) == (
        None, "CSR csr-1: the cluster executor may enroll only @cluster-executor, not 'gpu-a'")
    # without a cluster service account configured, the cluster executor's user is just not the node's
    check = validate_csr(_csr(me.csr_pem(), user=user, nodes=None), node_service_account=NODE_SA)
    assert check.identity is None and "not the node service account" in check.reason


def test_every_request_the_api_server_did_not_vouch_for_is_refused(nodes):
    a, b = nodes["gpu-a"], nodes["gpu-b"]
    cases = {
        "wrong signer": (_csr(a.csr_pem(), signer="kubernetes.io/kube-apiserver-client"),
                         "CSR csr-1: signer 'kubernetes.io/kube-apiserver-client' is not xidstream.io/node-identity"),
        "a tenant's account": (_csr(a.csr_pem(), user="system:serviceaccount:team:notebook"),
                               "CSR csr-1: requested by 'system:serviceaccount:team:notebook', not the node service "
                               "account system:serviceaccount:xidstream:xidstream-node"),
        "a token bound to no node": (_csr(a.csr_pem(), nodes=None),
                                     "CSR csr-1: the API server names no node for its requester (a token not bound to "
                                     "a pod on a node; Kubernetes 1.30+ records it)"),
        "two nodes": (_csr(a.csr_pem(), nodes=("gpu-a", "gpu-b")), "CSR csr-1: the API server names no node"),
        "another node's name": (_csr(b.csr_pem(), nodes=("gpu-a",)),
                                "CSR csr-1: asks for 'gpu-b' but was requested from a pod on 'gpu-a'"),
    }
    for name, (csr, why) in cases.items():
        check = validate_csr(csr, node_service_account=NODE_SA, cluster_service_account=CLUSTER_SA)
        assert check.identity is None and check.reason.startswith(why), (name, check.reason)
        assert check.x25519_public is None, name


def test_a_request_that_is_not_an_ed25519_self_signed_csr_with_one_x25519_key_is_refused():
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519
    from cryptography.x509.oid import NameOID

    def pem(key, sans, cn="gpu-a", algo=None):
        b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        if sans is not None:
            b = b.add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in sans]), critical=False)
        return b.sign(key, algo).public_bytes(serialization.Encoding.PEM)

    ed = ed25519.Ed25519PrivateKey.generate()
    good = "urn:xidstream:x25519:" + "ab" * 32
    from xidstream.transport import identity as idm
    assert good.startswith(idm._X25519_URI)
    assert validate_csr(_csr(pem(ed, [good])), node_service_account=NODE_SA).identity == "gpu-a"
    from cryptography.hazmat.primitives import hashes
    refusals = {
        "an EC key": (pem(ec.generate_private_key(ec.SECP256R1()), [good], algo=hashes.SHA256()),
                      "CSR csr-1: not self-signed with an Ed25519 key"),
        "no SAN": (pem(ed, None), "CSR csr-1: no single X25519 key (urn:xidstream:x25519:<64 hex>)"),
        "two keys": (pem(ed, [good, "urn:xidstream:x25519:" + "cd" * 32]), "CSR csr-1: no single X25519 key"),
        "a short key": (pem(ed, ["urn:xidstream:x25519:" + "ab" * 31]), "CSR csr-1: no single X25519 key"),
        "upper-case hex": (pem(ed, ["urn:xidstream:x25519:" + "AB" * 32]), "CSR csr-1: no single X25519 key"),
        # points of low order (RFC 7748 section 6.1): no record key could be agreed with them
        "the point 0": (pem(ed, ["urn:xidstream:x25519:" + "00" * 32]), LOW_ORDER_REFUSAL),
        "the point 1": (pem(ed, ["urn:xidstream:x25519:" + "01" + "00" * 31]), LOW_ORDER_REFUSAL),
        "a point of order 8": (pem(ed, ["urn:xidstream:x25519:e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f"
                                        "49b800"]), LOW_ORDER_REFUSAL),
    }
    for name, (p, why) in refusals.items():
        check = validate_csr(_csr(p), node_service_account=NODE_SA)
        assert check.identity is None and check.reason.startswith(why), (name, check.reason)
    bad = _csr(b"x")
    bad["spec"]["request"] = "not base64!"
    assert validate_csr(bad, node_service_account=NODE_SA).reason.startswith("CSR csr-1: not a PEM certificate request (")
    assert validate_csr(_csr(b"-----BEGIN nothing-----"), node_service_account=NODE_SA).reason.startswith(
        "CSR csr-1: not a PEM certificate request (")
    assert validate_csr({"spec": {}}, node_service_account=NODE_SA).reason == \
        "CSR ?: signer None is not xidstream.io/node-identity"


# --- the enrollment fold -----------------------------------------------------------------------

def test_only_the_enrollers_signed_enrollments_count(processor, nodes, tmp_path):
    from xidstream.schemas.codec import encode

    priv, pub, _ = generate_keys(tmp_path / "enroller")
    enroller, trusted = SigningKey.load(priv), VerifyKeys.load([pub], purpose="enrollments")
    other, _, _ = generate_keys(tmp_path / "other")
    a = nodes["gpu-a"]
    v = RecordVerifier(processor)
    d = IdentityDirectory(None, trusted, v)
    rec = NodeEnrollment(node="gpu-a", x25519_public=a.x25519_public, ed25519_public=a.ed25519_public,
                         csr_name="csr-1", csr_uid="u1")
    assert d.apply(encode(rec)) == "unsigned: no signature or key_id"
    assert d.refused == 1 and v.identities == []
    assert d.apply(encode(SigningKey.load(other).sign(rec))).startswith("signed by unknown key")
    assert d.refused == 2
    assert d.apply(b"{not json") and d.refused == 3
    assert d.apply(encode(enroller.sign(rec))) is None
    assert v.identities == ["gpu-a"] and d.refused == 3
    h = a.record_auth(processor.public).header("t", None, b"v")
    assert v.sender([h], "t", None, b"v") == "gpu-a"
    assert d.apply(encode(enroller.sign(rec.model_copy(update={"revoked": True})))) is None
    assert v.identities == []


def test_the_record_key_is_hkdf_of_the_x25519_secret_computed_apart(processor, tmp_path):
    """A second implementation of the key agreement, from the key files and the signing key as the
    module documents them: X25519 between the node's key and the processor's (derived from its
    signing key with label "node identity x25519"), then HKDF-SHA256 with info
    "xidstream record auth v1|<identity>"."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import x25519
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    priv, _, _ = generate_keys(tmp_path / "p")
    signing = SigningKey.load(priv)
    proc = ProcessorIdentity(signing)
    node = NodeIdentity.load_or_create(tmp_path / "n" / "deep" / "er", "gpu-a")  # parents made too
    proc_key = x25519.X25519PrivateKey.from_private_bytes(signing.derive(b"node identity x25519"))
    node_key = x25519.X25519PrivateKey.from_private_bytes(
        base64.b64decode((tmp_path / "n" / "deep" / "er" / "identity-x25519.key").read_bytes()))
    assert node.x25519_public == node_key.public_key().public_bytes_raw().hex()
    assert proc.public == proc_key.public_key().public_bytes_raw().hex()
    shared = node_key.exchange(proc_key.public_key())
    want = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"xidstream record auth v1|gpu-a").derive(shared)
    assert node.record_auth(proc.public).key == want == proc.record_key("gpu-a", node.x25519_public)


def test_a_key_file_with_anything_but_base64_in_it_is_refused(tmp_path):
    NodeIdentity.load_or_create(tmp_path, "gpu-a")
    path = tmp_path / "identity-ed25519.key"
    path.write_bytes(path.read_bytes() + b"!")  # a lenient decoder would skip the "!" and load the key
    with pytest.raises(ConfigError, match="identity-ed25519.key: not a key of this node's identity"):
        NodeIdentity.load_or_create(tmp_path, "gpu-a")


def test_a_header_that_is_not_ascii_or_not_bytes_is_read_not_raised_on(processor, nodes):
    a = nodes["gpu-a"]
    v = _verifier(processor, a)
    name, value = a.record_auth(processor.public).header("t", None, b"v")
    assert v.sender([(name, value.decode())], "t", None, b"v") == "gpu-a"  # a str header value
    with pytest.raises(AuthError, match="^the xidstream-auth MAC does not hold for 'gpu-a'"):
        v.sender([(name, value[:-1] + b"\xff")], "t", None, b"v")


def test_an_identity_revoked_then_enrolled_again_with_the_same_key_is_believed(processor, nodes):
    a = nodes["gpu-a"]
    v = _verifier(processor, a)
    v.revoke("gpu-a")
    v.enroll("gpu-a", a.x25519_public)
    assert v.sender([a.record_auth(processor.public).header("t", None, b"v")], "t", None, b"v") == "gpu-a"


def test_the_csrs_key_extension_is_not_critical_and_a_request_without_fields_is_refused(nodes, tmp_path):
    from cryptography import x509

    a = nodes["gpu-a"]
    ext = x509.load_pem_x509_csr(a.csr_pem()).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert ext.critical is False  # a verifier that does not know the URI scheme must still read the request
    no_request = _csr(a.csr_pem())
    del no_request["spec"]["request"]
    assert validate_csr(no_request, node_service_account=NODE_SA).reason.startswith("CSR csr-1: not a PEM certificate request")
    no_user = _csr(a.csr_pem())
    del no_user["spec"]["username"]
    assert validate_csr(no_user, node_service_account=NODE_SA, cluster_service_account=CLUSTER_SA).reason == (
        "CSR csr-1: requested by '', not the node service account system:serviceaccount:xidstream:xidstream-node")
    junk = _csr(a.csr_pem())
    junk["spec"]["request"] = junk["spec"]["request"][:20] + "!" + junk["spec"]["request"][20:]
    reason = validate_csr(junk, node_service_account=NODE_SA).reason
    assert reason.startswith("CSR csr-1: not a PEM certificate request (") and "base64" in reason.lower(), reason
    me = NodeIdentity.load_or_create(tmp_path / "c", CLUSTER_IDENTITY)
    check = validate_csr(_csr(me.csr_pem(), user="system:serviceaccount:xidstream:xidstream-cluster-executor", nodes=None),
                         node_service_account=NODE_SA, cluster_service_account=CLUSTER_SA)
    assert (check.x25519_public, check.ed25519_public) == (me.x25519_public, me.ed25519_public)


@pytest.mark.parametrize("account", ["xidstream", "xidstream/", "/xidstream-node", "a/b/c", ""])
def test_a_service_account_that_is_not_namespace_slash_name_is_a_clear_error(nodes, account):
    # "xidstream" alone meant the user "system:serviceaccount:xidstream:", which no token has: every
    # node's CSR was refused as "not the node service account", and nothing said why
    a = nodes["gpu-a"]
    with pytest.raises(ConfigError, match=rf"^service account {re.escape(repr(account))} is not namespace/name$"):
        validate_csr(_csr(a.csr_pem()), node_service_account=account)
    from xidstream.executors.enroll import Enroller

    with pytest.raises(ConfigError, match="is not namespace/name"):
        Enroller(None, None, print, node_service_account=NODE_SA, cluster_service_account=account)
    with pytest.raises(ConfigError, match="is not namespace/name"):
        Enroller(None, None, print, node_service_account=account)
    assert validate_csr(_csr(a.csr_pem()), node_service_account="xidstream/xidstream-node").identity == "gpu-a"


def test_a_missing_cryptography_package_is_a_clear_config_error_for_identities(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives", None)  # what a failed import leaves
    with pytest.raises(ConfigError, match=r"^node identity needs the cryptography package: .+"):
        NodeIdentity.load_or_create(tmp_path / "n", "gpu-a")
