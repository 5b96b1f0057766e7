"""A processor that signs commands refuses to start without per-node identity unless the operator
names what is given up (`--records-not-tied-to-nodes`); with that flag, /metrics says so for the
worker's life. Before, `xidstream process --signing-key K` alone believed every record about any
node from any holder of a node's Kafka credentials, and said nothing."""

from __future__ import annotations

import pytest

from xidstream.schemas.signing import SigningKey, generate_keys
from xidstream.streams.app import create_app
from xidstream.streams.metrics import metrics_text
from xidstream.transport.identity import IDENTITY_PUB, ProcessorIdentity, RecordVerifier, read_processor_public
from xidstream.cli import main
from xidstream.settings import Settings

# An address nothing listens on: each refusal must come before any Kafka call.
NOWHERE = ["--bootstrap", "127.0.0.1:1", "--topic-prefix", "never."]


@pytest.fixture
def keys(tmp_path):
    priv, pub, _ = generate_keys(tmp_path / "keys")
    return priv, pub


def test_a_signing_processor_without_enrollment_refuses_to_start_naming_both_ways_out(keys, capsys):
    assert main(["process", "--signing-key", str(keys[0]), *NOWHERE]) == 2
    err = capsys.readouterr().err
    assert "--signing-key without --enroller-key" in err
    assert "--enroller-key FILE" in err and "--records-not-tied-to-nodes" in err


def test_the_flag_and_enrollment_together_are_refused(keys, capsys):
    assert main(["process", "--signing-key", str(keys[0]), "--enroller-key", str(keys[1]),
                 "--records-not-tied-to-nodes", *NOWHERE]) == 2
    assert "--records-not-tied-to-nodes contradicts --enroller-key" in capsys.readouterr().err


@pytest.mark.slow
def test_with_the_flag_it_warns_and_goes_on_to_kafka(keys, capsys):
    # past the identity check: the next thing it does is ask the (absent) broker for the topics
    assert main(["process", "--signing-key", str(keys[0]), "--records-not-tied-to-nodes", *NOWHERE]) == 2
    err = capsys.readouterr().err
    assert "WARNING: per-node identity is off" in err
    assert "--signing-key without --enroller-key" not in err


def _gauge(proc) -> str:
    text = metrics_text(proc.stats, proc.labelled)
    return [line for line in text.splitlines() if line.startswith("xidstream_processor_node_identity_off ")][0]


def test_the_identity_off_gauge_is_1_only_for_a_signing_worker_without_a_verifier(keys):
    sk = SigningKey.load(keys[0])
    s = Settings(topic_prefix="tc.")
    assert _gauge(create_app(s, signing_key=sk)) == "xidstream_processor_node_identity_off 1"
    assert _gauge(create_app(s, signing_key=sk, verifier=RecordVerifier(ProcessorIdentity(sk)))) == \
        "xidstream_processor_node_identity_off 0"
    assert _gauge(create_app(s)) == "xidstream_processor_node_identity_off 0"  # signs nothing: nothing is acted on


def test_keys_generate_and_keys_identity_write_the_identity_key_nodes_read_from_a_file(tmp_path, capsys):
    assert main(["keys", "generate", "--out", str(tmp_path / "k")]) == 0
    want = ProcessorIdentity(SigningKey.load(tmp_path / "k" / "signing.key")).public
    assert (tmp_path / "k" / IDENTITY_PUB).read_text() == want + "\n"
    assert main(["keys", "identity", "--key", str(tmp_path / "k" / "signing.key"), "--out", str(tmp_path / "id.pub")]) == 0
    assert (tmp_path / "id.pub").read_text() == want + "\n"
    capsys.readouterr()
    assert main(["keys", "identity", "--key", str(tmp_path / "k" / "signing.key")]) == 0
    assert capsys.readouterr().out.strip() == want
    # --processor-identity: hex or the file, the same key
    assert read_processor_public(want) == read_processor_public(str(tmp_path / "id.pub")) == want


@pytest.mark.parametrize("content, why", [("not a key\n", "holds no X25519 public key"), (None, "neither 64 hex digits")])
def test_a_processor_identity_that_is_no_key_is_refused_by_name(tmp_path, content, why):
    from xidstream.schemas.errors import ConfigError

    path = tmp_path / "identity.pub"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=why):
        read_processor_public(str(path))
