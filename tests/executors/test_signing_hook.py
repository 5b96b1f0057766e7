"""The processor signs every command as it leaves the fleet agent (`create_app(signing_key=...)`,
`xidstream process --signing-key FILE`), and an executor trusting that key accepts them."""

from __future__ import annotations

import asyncio

import orjson

from xidstream.schemas import decode_any
from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys
from xidstream.streams.app import FLEET_KEY, create_app
from xidstream.streams.handoff import Handoff
from tests.streams.builders import wedge
from tests.streams.test_agents import _fleet_messages
from xidstream.settings import Settings


def test_fleet_agent_signs_every_command(tmp_path):
    priv, pub, kid = generate_keys(tmp_path / "k")
    messages = _fleet_messages(wedge())
    assert any(m["kind"] == "command" for m in messages)

    async def run():
        key = SigningKey.load(priv)
        proc = create_app(Settings(topic_prefix="tc."), signing_key=key)
        handoff = Handoff.for_processor(key, None)  # what the GPU agents seal their messages with
        sent = []

        async def capture(key=None, value=None, **kw):
            sent.append(value)

        proc.remediation.send = capture
        proc.alerts.send = capture
        async with proc.fleet.test_context() as agent:
            for m in messages:
                await agent.put(handoff.seal(orjson.dumps(m)), key=FLEET_KEY)
        return sent

    commands = [c for c in map(decode_any, asyncio.run(run())) if c.schema_.startswith("xidstream.remediation_command")]
    assert commands and all(c.key_id == kid and c.signature for c in commands)
    keys = VerifyKeys.load([pub])
    for c in commands:
        keys.verify(c)  # raises when not authentic


def test_executors_never_import_faust_the_stream_processor_or_the_command_layer():
    """Executors run in the collector DaemonSet and a small Deployment: no faust, no streams; and,
    like the other library packages, they take a KafkaConfig, never the command layer."""
    from pathlib import Path

    import executors

    root = Path(executors.__file__).parent
    offenders = [f"{p.name}: {line.strip()}" for p in root.rglob("*.py") for line in p.read_text().splitlines()
                 if line.strip().split()[:1] in (["import"], ["from"])
                 and line.strip().split()[1].split(".")[0] in {"faust", "streams", "xidstream"}]
    assert not offenders
