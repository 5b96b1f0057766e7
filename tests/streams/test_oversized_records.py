"""A record past a cap of the contract (schemas.limits) reaches the processor only from a producer
that does not cut its text, like the collector that sent four 350 KB kernel lines: the GPU agent
dead-letters it, naming the field and the limit, and goes on."""

from __future__ import annotations

import asyncio

import orjson

from xidstream.schemas import Classification, decode_any, encode
from xidstream.schemas.limits import KERNEL_RAW_MAX
from xidstream.streams.app import create_app
from tests.streams.builders import GPU, xid
from xidstream.settings import Settings


def test_an_xid_past_its_raw_cap_is_dead_lettered_by_name_and_the_agent_goes_on():
    big = orjson.dumps({**orjson.loads(encode(xid(10, 13))), "raw": "A" * 350_000})
    sent: dict[str, list] = {"alerts": [], "deadletter": []}

    async def run():
        proc = create_app(Settings(topic_prefix="tc."))
        for name in sent:
            async def send(key=None, value=None, _name=name, **kwargs):
                sent[_name].append(value)
            getattr(proc, name).send = send
        async with proc.gpus.test_context() as agent:
            await agent.put(big, key=GPU.encode())
            await agent.put(encode(xid(11, 13)), key=GPU.encode())

    asyncio.run(run())
    (dead,) = [decode_any(v) for v in sent["deadletter"]]
    assert dead.error_type == "DecodeError"  # (its copy of the original is the dead-letter path's to bound)
    assert f"raw: String should have at most {KERNEL_RAW_MAX} characters" in dead.error
    assert [decode_any(v).classification for v in sent["alerts"]] == [Classification.APP_FAULT]
