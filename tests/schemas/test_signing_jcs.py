"""The signed form is RFC 8785 (JCS): a consumer in another language verifies what the processor
signs (a verifier in Go's standard library, tests/go/jcsverify), the published test vectors hold,
and the previous release's signature version (orjson, keys sorted) gives the same bytes for every
command and approval, so executors of either release verify either release's signatures."""

from __future__ import annotations

import base64
import json
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import rfc8785
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hypothesis import given, settings
from hypothesis import strategies as st

from xidstream.schemas import Action, RemediationCommand
from xidstream.schemas.models import Approval
from xidstream.schemas.signing import SignatureError, SigningKey, VerifyKeys, canonical, canonical_v1
from tests.factories import T0
from tests.tools import examples, find_tool

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "data" / "signing_vectors.json"
GO_VERIFIER = ROOT / "tests" / "go" / "jcsverify"


def _key(seed: int) -> SigningKey:
    return SigningKey(Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32))


def _pub(key: SigningKey) -> str:
    raw = key._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def _verify_keys(key: SigningKey) -> VerifyKeys:
    return VerifyKeys({key.key_id: key._key.public_key()})


def _command(**kw) -> RemediationCommand:
    base = dict(event_id="7d0c9b1e5f2a4c3d8e6f0a1b2c3d4e5f", ts=T0, node="node-a", command_id="cmd-1",
                incident_id="inc-1", gpu_uuid="GPU-6d3f1a2b-0c4e-4f5a-9b7c-8d9e0f1a2b3c", gpu_index=1,
                pci_bus_id="0000:01:00", action=Action.RESET_GPU, step=2,
                reason="GPU 1 wedged — réinitialisation demandée 😀 \"quoted\" \\ tab\there",
                preconditions=["no compute process on the GPU", "node cordoned"], evidence_ids=["x43", "s-17"],
                expires_at=T0 + timedelta(minutes=15),
                rule={"id": "wedged.pinned_no_process_after_wedge_xid", "name": "Xid 43, then pinned with no process",
                      "facts": {"xid43": 1, "pinned_s": 60, "compute_processes": 0, "rate_per_h": "0.333"}})
    return RemediationCommand(**{**base, **kw})


def _approval() -> Approval:
    return Approval(event_id="0f1e2d3c4b5a69788796a5b4c3d2e1f0", ts=T0 + timedelta(minutes=2), node="node-a",
                    approval_id="ap-1", command_id="cmd-1", approved_by="Zoë O'Brien", reason="rack checked ✓",
                    expires_at=T0 + timedelta(minutes=17))


# Documents a consumer's canonicalizer must get right: RFC 8785's own number example, floats,
# escapes, keys ordered by UTF-16 code units (an astral key sorts before U+FFFF), nested evidence.
_DOCUMENTS = [
    {"numbers": [333333333.33333329, 1e30, 4.50, 2e-3, 0.000000000000000000000000001]},
    {"string": "\u20ac$\u000f\nA'B\"\\\\\"/"},
    {"z": 1e21, "y": 1e20, "x": -0.0, "w": 123e-10, "v": 1.0, "u": -5, "t": 9007199254740991},
    {"\uffff": 4, "\U0001f600": 3, "\u00e9": 1, "z": 2, "": 0},
    {"evidence": {"timeline": [{"kind": "xid", "data": {"xid": 43, "pid": 4242}},
                               {"kind": "sample_stats", "data": {"util_min": 100.0, "power_avg_w": 110.5}}],
                  "xid_counts": {"13": 3, "43": 1}}, "flag": True, "none": None, "empty": {}, "list": []},
]


# JSON texts RFC 8785 does not define (it takes I-JSON, RFC 7493): a verifier must refuse them, not
# map them onto another value (the nearest double, U+FFFD, the last duplicate), or two different
# records verify under one signature.
_REFUSED = [
    ('{"step": 9007199254740993}', "an integer beyond 2**53, which a double cannot hold"),
    ('{"reason": "\\ud800"}', "a lone high surrogate"),
    ('{"reason": "\\udc00x"}', "a lone low surrogate"),
    ('{"node": "node-a", "node": "node-b"}', "a duplicate key"),
]


def build_vectors() -> dict:
    """The published test vectors, made from fixed keys and records (deterministic: Ed25519 is)."""
    processor, approver = _key(7), _key(9)
    cmd = processor.sign(_command())
    appr = approver.sign(_approval())
    signed = []
    for name, rec, key in (("remediation command", cmd, processor), ("approval", appr, approver)):
        signed.append({"name": name, "public_key": _pub(key), "record": json.loads(rec.model_dump_json(by_alias=True)),
                       "canonical": canonical(rec).decode("utf-8")})
    return {
        "about": "xidstream signature version 2: Ed25519 (RFC 8032) over RFC 8785 (JCS) of the record's JSON "
                 "without `signature`; public keys and signatures base64 (RFC 4648, padded); key_id is the first "
                 "16 hex digits of SHA-256 of the raw public key. Regenerate: python -m tests.schemas.test_signing_jcs",
        "signed": signed,
        "canonicalization": [{"document": d, "canonical": rfc8785.dumps(d).decode("utf-8")} for d in _DOCUMENTS],
        "refused": [{"document_text": text, "why": why} for text, why in _REFUSED],
    }


def test_the_published_vectors_are_what_the_code_makes():
    assert json.loads(VECTORS.read_text()) == json.loads(json.dumps(build_vectors()))


def test_rfc_8785s_own_example_canonicalizes_as_the_rfc_prints_it():
    # RFC 8785 section 3.2.2.3 / appendix: the sample's numbers
    assert rfc8785.dumps(_DOCUMENTS[0]) == b'{"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27]}'


def test_each_vector_verifies_with_its_public_key_here():
    for v in json.loads(VECTORS.read_text())["signed"]:
        raw = base64.b64decode(v["public_key"])
        sig = base64.b64decode(v["record"]["signature"])
        Ed25519PublicKey.from_public_bytes(raw).verify(sig, v["canonical"].encode("utf-8"))


@pytest.fixture(scope="module")
def go_verifier(tmp_path_factory) -> Path:
    go = find_tool("GO", names=("go",), hint="the Go toolchain (1.22+) builds the verifier: https://go.dev/dl/")
    out = tmp_path_factory.mktemp("go") / "jcsverify"
    subprocess.run([go, "build", "-o", str(out), "."], cwd=GO_VERIFIER, check=True, capture_output=True,
                   timeout=300, env={**__import__("os").environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"})
    return out


def _go(verifier: Path, lines: list[dict]) -> list[dict]:
    proc = subprocess.run([str(verifier)], input="\n".join(json.dumps(x) for x in lines) + "\n", text=True,
                          capture_output=True, timeout=60, check=True)
    return [json.loads(ln) for ln in proc.stdout.splitlines()]


def test_go_verifies_what_the_processor_signs(go_verifier):
    from tests.streams.test_order_free import records_of
    from xidstream.streams.engine import Engine

    processor = _key(7)
    cmds = [processor.sign(c) for c in Engine().run(records_of("motivating-incident")).commands]
    assert {c.action for c in cmds} >= {Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU}
    approver = _key(9)
    approvals = [approver.sign(_approval()), approver.sign(Approval(
        ts=T0, node="fleet", approval_id="ap-2", command_id=cmds[-1].command_id, approved_by="ops",
        expires_at=T0 + timedelta(minutes=5)))]
    lines = [{"record": json.loads(c.model_dump_json(by_alias=True)), "public_key": _pub(processor)} for c in cmds]
    lines += [{"record": json.loads(a.model_dump_json(by_alias=True)), "public_key": _pub(approver)} for a in approvals]
    answers = _go(go_verifier, lines)
    assert [a["ok"] for a in answers] == [True] * len(lines), answers
    # and Go's canonical bytes are the processor's, byte for byte
    assert [base64.b64decode(a["canonical"]) for a in answers] == [canonical(r) for r in cmds + approvals]


def test_go_refuses_an_altered_record_a_wrong_key_and_a_relabelled_key(go_verifier):
    processor, other = _key(7), _key(8)
    cmd = json.loads(processor.sign(_command()).model_dump_json(by_alias=True))
    altered = {**cmd, "node": "node-b"}
    answers = _go(go_verifier, [{"record": altered, "public_key": _pub(processor)},
                                {"record": cmd, "public_key": _pub(other)},
                                {"record": {**cmd, "key_id": other.key_id}, "public_key": _pub(other)}])
    assert [a["ok"] for a in answers] == [False, False, False]
    assert answers[0]["error"] == "signature does not verify" and "is not this key's" in answers[1]["error"]


def test_go_canonicalizes_every_vector_as_published(go_verifier):
    vectors = json.loads(VECTORS.read_text())
    answers = _go(go_verifier, [{"document": v["document"]} for v in vectors["canonicalization"]]
                  + [{"record": v["record"], "public_key": v["public_key"]} for v in vectors["signed"]])
    want = [v["canonical"] for v in vectors["canonicalization"]] + [v["canonical"] for v in vectors["signed"]]
    assert [base64.b64decode(a["canonical"]).decode("utf-8") for a in answers] == want
    assert all(a["ok"] for a in answers)


def test_go_refuses_what_rfc_8785_does_not_define(go_verifier):
    # raw lines: parsing and re-encoding them here would repair exactly what is under test
    vectors = json.loads(VECTORS.read_text())["refused"]
    lines = "".join(f'{{"document": {v["document_text"]}}}\n' for v in vectors).encode()
    lines += b'{"document": {"a": "\xff"}}\n'  # not UTF-8
    out = subprocess.run([str(go_verifier)], input=lines, capture_output=True, timeout=60, check=True).stdout
    answers = [json.loads(ln) for ln in out.decode().splitlines()]
    assert [a["ok"] for a in answers] == [False] * 5
    assert [a["error"].split(" ")[0] for a in answers] == ["integer", "lone", "lone", "duplicate", "not"]
    assert all(a["error"].endswith("(I-JSON)") for a in answers), answers


def test_python_refuses_the_same_integer_and_surrogates():
    # the processor never signs them; an executor verifying a forged record refuses them too
    for v in json.loads(VECTORS.read_text())["refused"][:3]:
        with pytest.raises(rfc8785.CanonicalizationError):
            rfc8785.dumps(json.loads(v["document_text"]))


# -- the previous signature version ------------------------------------------------------------------
_text = st.text(st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=examples(200), deadline=None)
@given(reason=_text, pre=st.lists(_text, max_size=3), node=_text.filter(bool), step=st.integers(0, 2**31),
       who=_text.filter(bool), held=st.booleans())
def test_both_signature_versions_are_the_same_bytes_for_any_command_and_approval(reason, pre, node, step, who, held):
    cmd = _command(reason=reason, preconditions=pre, node=node, step=step, requires_approval=held)
    appr = _approval().model_copy(update={"approved_by": who, "reason": reason})
    assert canonical(cmd) == canonical_v1(cmd) and canonical(appr) == canonical_v1(appr)


def test_an_executor_of_either_release_verifies_the_other_releases_signature():
    key = _key(7)
    pub = key._key.public_key()
    new = key.sign(_command())
    # the previous release verified Ed25519 over orjson's sorted form
    pub.verify(base64.b64decode(new.signature), canonical_v1(new))
    # a command the previous release signed (over that form) verifies here
    stamped = _command().model_copy(update={"key_id": key.key_id, "signature": None})
    old = stamped.model_copy(update={"signature": base64.b64encode(key._key.sign(canonical_v1(stamped))).decode()})
    _verify_keys(key).verify(old)


def test_a_record_jcs_cannot_encode_is_refused_as_not_authentic():
    # an integer beyond 2**53 (I-JSON): only a forger sends one; it is refused, never a crash
    key = _key(7)
    forged = key.sign(_command()).model_copy(update={"step": 2**60})
    with pytest.raises(SignatureError, match=r"cannot be canonicalized \(RFC 8785\)"):
        _verify_keys(key).verify(forged)


def test_a_command_the_previous_release_signed_still_verifies_after_it_decodes_as_this_one():
    # The previous processor signs a /2 command (no `rule`) in its /2 form; this executor decodes it
    # into /3 (rule null) and must check the signature over the form it was signed in, or every
    # command of a processor not yet upgraded is refused as forged during the roll.
    from xidstream.schemas.codec import decode, encode

    key = _key(7)
    doc = json.loads(encode(_command(rule=None, key_id=key.key_id)))
    doc.pop("rule")
    doc.pop("signature")
    doc["schema"] = "xidstream.remediation_command/2"
    doc["signature"] = base64.b64encode(key._key.sign(rfc8785.dumps(doc))).decode()
    got = decode(RemediationCommand, json.dumps(doc).encode())
    assert got.schema_ == RemediationCommand.SCHEMA and got.rule is None
    _verify_keys(key).verify(got)
    # ... and an altered one, or a /2 command that claims a rule, still fails
    for bad in ({**doc, "step": 3}, {**doc, "rule": {"id": "wedged.again_after_reset"}}):
        with pytest.raises(SignatureError, match="forged or altered"):
            _verify_keys(key).verify(decode(RemediationCommand, json.dumps(bad).encode()))
    # re-signed by this release, it is signed (and verified) in this version's form
    again = key.sign(got)
    assert json.loads(canonical(again))["schema"] == RemediationCommand.SCHEMA
    _verify_keys(key).verify(decode(RemediationCommand, encode(again)))


if __name__ == "__main__":
    VECTORS.write_text(json.dumps(build_vectors(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {VECTORS}")
