"""The faust agents through agent.test_context(): in-memory channels and memory:// tables, no broker.
What the agents send is captured at their output topics' `send`; the broker tier
(tests/integration/test_processor_on_broker.py) runs the same app on the real Kafka."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from schemas import Action, Classification, decode_any, encode
from streams.app import create_app
from tests.streams.builders import GPU, wedge, xid
from xidstream.settings import Settings


def _app():
    proc = create_app(Settings(topic_prefix="tc."))
    sent: dict[str, list] = {"alerts": [], "fleet": [], "remediation": [], "deadletter": []}

    def capture(name):
        async def send(key=None, value=None, **kwargs):
            sent[name].append((key, value))
        return send

    proc.alerts.send = capture("alerts")
    proc.fleet_topic.send = capture("fleet")
    proc.remediation.send = capture("remediation")
    proc.deadletter.send = capture("deadletter")
    return proc, sent


def test_gpu_agent_turns_the_wedge_into_alerts_and_commands_for_the_fleet_agent():
    async def run():
        proc, sent = _app()
        async with proc.gpus.test_context() as agent:
            for rec in wedge():
                await agent.put(encode(rec), key=GPU.encode())
        return proc, sent

    proc, sent = asyncio.run(run())
    alerts = [decode_any(v) for _, v in sent["alerts"]]
    assert [a.classification for a in alerts] == [Classification.APP_FAULT, Classification.GPU_WEDGED]
    fleet = [orjson.loads(v) for _, v in sent["fleet"]]
    assert fleet[0] == {"kind": "node_seen", "node": "node-a", "ts": wedge()[0].ts.timestamp()}
    assert [m["command"]["action"] for m in fleet[1:]] == ["RECORD", "CORDON_NODE", "DRAIN_NODE", "RESET_GPU"]
    assert {k for k, _ in sent["fleet"]} == {b"fleet"}
    # the table holds the incident (what a restarted worker recovers from the changelog)
    stored = orjson.loads(proc.gpu_table[GPU.encode()])
    assert stored["incident"]["classification"] == "GPU_WEDGED"
    assert [e["action"] for e in stored["incident"]["emitted"]] == ["RECORD", "CORDON_NODE", "DRAIN_NODE", "RESET_GPU"]


@pytest.mark.parametrize("raw", [b"\x00garbage", b'{"schema": "xidstream.gpu_sample/1", "node": "n"}', b"[]"])
def test_bad_records_go_to_the_dead_letter_topic_and_the_agent_goes_on(raw):
    async def run():
        proc, sent = _app()
        async with proc.gpus.test_context() as agent:
            await agent.put(raw, key=GPU.encode())
            await agent.put(encode(xid(10, 13)), key=GPU.encode())
        return sent

    sent = asyncio.run(run())
    (dead,) = [decode_any(v) for _, v in sent["deadletter"]]
    assert dead.original == raw and dead.error and dead.error_type == "DecodeError"
    assert [decode_any(v).classification for _, v in sent["alerts"]] == [Classification.APP_FAULT]


def test_fleet_agent_applies_the_breaker_and_forwards_commands():
    from streams.engine import Engine
    from tests.streams.builders import inventory, sample

    recs = []
    for i in range(5):
        g = f"GPU-{i:08d}-0000-0000-0000-000000000000"
        recs += [inventory(0, gpu=g, node=f"node-{i}"), sample(0, gpu=g, node=f"node-{i}"),
                 xid(100 + i, 79, pid=None, gpu=g, node=f"node-{i}")]
    engine = Engine()
    messages = []
    for r in recs:
        key = engine.key_of(r)
        from streams.classify import step

        state, outputs, _ = step(engine.states.get(key), key, r, engine.policy)
        engine.states[key] = state
        if not state.announced:
            state.announced = True
            messages.append({"kind": "node_seen", "node": state.node, "ts": r.ts.timestamp()})
        messages += [{"kind": "command", "command": __import__("schemas").to_dict(c)} for k, c in outputs if k == "command"]

    async def run():
        proc, sent = _app()
        async with proc.fleet.test_context() as agent:
            for m in messages:
                await agent.put(orjson.dumps(m), key=b"fleet")
        return sent

    sent = asyncio.run(run())
    commands = [decode_any(v) for _, v in sent["remediation"]]
    assert len(commands) == 15 and all(c.action in (Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE) for c in commands)
    assert [c.requires_approval for c in commands if c.node in ("node-0", "node-1")] == [False] * 6
    assert all(c.requires_approval for c in commands if c.node not in ("node-0", "node-1"))
    storms = [decode_any(v) for _, v in sent["alerts"]]
    assert [a.classification for a in storms] == [Classification.FLEET_STORM]
    assert {k for k, _ in sent["remediation"]} == {f"node-{i}".encode() for i in range(5)}
