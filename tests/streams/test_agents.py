"""The faust agents through agent.test_context(): in-memory channels and memory:// tables, no broker.
What the agents send is captured at their output topics' `send`; the broker tier
(tests/integration/test_processor_on_broker.py) runs the same app on the real Kafka."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from xidstream.schemas import Action, Classification, RemediationResult, decode_any, encode, to_dict
from xidstream.streams.app import FLEET_KEY, create_app
from xidstream.streams.classify import step
from xidstream.streams.policy import Policy
from xidstream.streams.routing import fan_out, state_key
from tests.streams.builders import GPU, PCI, at, wedge, xid
from xidstream.settings import Settings


def _app():
    proc = create_app(Settings(topic_prefix="tc."))
    sent: dict[str, list] = {"alerts": [], "fleet": [], "remediation": [], "deadletter": [], "results_by_gpu": []}

    def capture(name):
        async def send(key=None, value=None, **kwargs):
            sent[name].append((key, value))
        return send

    proc.alerts.send = capture("alerts")
    proc.fleet_topic.send = capture("fleet")
    proc.remediation.send = capture("remediation")
    proc.deadletter.send = capture("deadletter")
    proc.results_by_gpu.send = capture("results_by_gpu")
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
    # the row's first record tells the fleet agent its node exists; its inventory keeps it known
    ts = wedge()[0].ts.timestamp()
    assert fleet[:2] == [{"kind": "node_seen", "node": "node-a", "ts": ts}, {"kind": "inventory", "node": "node-a", "ts": ts}]
    commands = [m["command"]["action"] for m in fleet if m["kind"] == "command"]
    assert commands == ["RECORD", "CORDON_NODE", "DRAIN_NODE", "RESET_GPU"]
    assert {k for k, _ in sent["fleet"]} == {FLEET_KEY}
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


def _fleet_messages(records):
    """What the gpu agent sends the fleet agent for `records`, through the same routing
    (`xidstream.streams.routing`) the agent and `xidstream.streams.engine.Engine` use."""
    states, messages = {}, []
    for r in records:
        key = state_key(r)
        state, outputs, _ = step(states.get(key), key, r, Policy())
        states[key] = state
        to_fleet, _ = fan_out(state, r, outputs)
        messages += [{**m, "command": to_dict(m["command"])} if m["kind"] == "command" else m for m in to_fleet]
    return messages


def test_fleet_agent_applies_the_breaker_and_forwards_commands():
    from tests.streams.builders import inventory, sample

    recs = []
    for i in range(5):
        g = f"GPU-{i:08d}-0000-0000-0000-000000000000"
        recs += [inventory(0, gpu=g, node=f"node-{i}"), sample(0, gpu=g, node=f"node-{i}"),
                 xid(100 + i, 79, pid=None, gpu=g, node=f"node-{i}")]
    messages = _fleet_messages(recs)

    async def run():
        proc, sent = _app()
        async with proc.fleet.test_context() as agent:
            for m in messages:
                await agent.put(orjson.dumps(m), key=FLEET_KEY)
        return sent

    sent = asyncio.run(run())
    commands = [decode_any(v) for _, v in sent["remediation"]]
    assert len(commands) == 15 and all(c.action in (Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE) for c in commands)
    assert [c.requires_approval for c in commands if c.node in ("node-0", "node-1")] == [False] * 6
    assert all(c.requires_approval for c in commands if c.node not in ("node-0", "node-1"))
    storms = [decode_any(v) for _, v in sent["alerts"]]
    assert [a.classification for a in storms] == [Classification.FLEET_STORM]
    assert {k for k, _ in sent["remediation"]} == {f"node-{i}".encode() for i in range(5)}


def _result(**kw):
    base = dict(ts=at(300), node="node-a", command_id="c-1", incident_id="i-1", action=Action.RESET_GPU,
                outcome="failed", detail="in use")
    return RemediationResult(**{**base, **kw})


def test_results_are_rekeyed_to_the_row_of_their_gpu_even_without_a_uuid():
    """Defect 4 (the app's half): a result for a GPU whose UUID was never resolved carries the
    command's pci_bus_id and reaches the ``node/pci`` row; only a result that names no GPU at all
    is dead-lettered, with the reason."""
    by_uuid, by_pci, neither = _result(gpu_uuid=GPU), _result(pci_bus_id=PCI), _result()

    async def run():
        proc, sent = _app()
        async with proc.rekey.test_context() as agent:
            for r in (by_uuid, by_pci, neither):
                await agent.put(encode(r), key=b"node-a")
        return sent

    sent = asyncio.run(run())
    assert [k for k, _ in sent["results_by_gpu"]] == [GPU.encode(), f"node-a/{PCI}".encode()]
    assert [decode_any(v).command_id for _, v in sent["results_by_gpu"]] == ["c-1", "c-1"]
    (dead,) = [decode_any(v) for _, v in sent["deadletter"]]
    assert dead.original == encode(neither) and "must name its GPU" in dead.error


def test_a_record_keyed_off_its_row_is_dead_lettered_not_folded():
    """The table row's changelog goes to the message's partition: a record whose key is not the
    row `state_key` gives would fold into a row its partition does not own."""
    rec = xid(10, 13)

    async def run():
        proc, sent = _app()
        async with proc.gpus.test_context() as agent:
            await agent.put(encode(rec), key=b"GPU-someone-else")
            await agent.put(encode(rec), key=GPU.encode())
        return sent

    sent = asyncio.run(run())
    (dead,) = [decode_any(v) for _, v in sent["deadletter"]]
    assert "belongs to row" in dead.error and GPU in dead.error
    assert [decode_any(v).classification for _, v in sent["alerts"]] == [Classification.APP_FAULT]


def test_known_nodes_are_rows_of_their_own_and_a_one_row_fleet_state_is_split_on_first_use():
    """In one row, every node-seen message rewrote the whole fleet (0.5 MB a write at
    12,500 nodes; past Kafka's 1 MB limit at 1M GPUs). Each node is now a row; the main row keeps
    the breaker; a row written the old way is split the first time the agent runs."""
    old = {"known_nodes": {"node-old": 1.0}, "starts": [], "workload_gpus": {}, "tripped": False,
           "tripped_at": None, "trips": 0, "held": 0}

    async def run():
        proc, sent = _app()
        proc.fleet_table.data[FLEET_KEY] = orjson.dumps(old)
        async with proc.fleet.test_context() as agent:
            for n in ("node-0", "node-1", "node-0"):
                # handed over at 5.0 by the processor's clock too (the record's timestamp): the
                # fleet agent keeps a stamp within the clock-skew bound of it
                await agent.put(orjson.dumps({"kind": "inventory", "node": n, "ts": 5.0}), key=FLEET_KEY, timestamp=5.0)
        return proc

    proc = asyncio.run(run())
    rows = dict(proc.fleet_table.data.items())
    assert {k for k in rows if k.startswith(b"node:")} == {b"node:node-old", b"node:node-0", b"node:node-1"}
    assert "known_nodes" not in orjson.loads(rows[FLEET_KEY])
    assert orjson.loads(rows[b"node:node-old"]) == 1.0 and orjson.loads(rows[b"node:node-0"]) == 5.0


@pytest.mark.parametrize("bad", [{"within": 0}, {"within": None}, {"within": -1}, {"within": float("inf")},
                                 {"within": float("nan")}, {"batch": 0}, {"batch": 2.5}, {"batch": True}])
def test_a_batch_setting_that_would_hold_records_back_is_refused(bad):
    """faust's take_events with `within` 0 or None waits for a full batch: a quiet partition's last
    records (the fatal Xid of a sick GPU) would wait for traffic that may never come."""
    with pytest.raises(ValueError, match="batch|within"):
        create_app(Settings(topic_prefix="tc-bad."), **bad)


def test_the_gpu_agent_counts_each_stage_of_a_repair_and_its_table_shows_an_unconfirmed_reboot():
    from xidstream.streams.app import unconfirmed_reboots

    async def run():
        proc, sent = _app()
        async with proc.gpus.test_context() as agent:
            for rec in wedge():
                await agent.put(encode(rec), key=GPU.encode())
        commands = {m["command"]["action"]: m["command"] for m in map(orjson.loads, (v for _, v in sent["fleet"]))
                    if m["kind"] == "command"}
        async with proc.gpus.test_context() as agent:
            for action, outcome, t in (("CORDON_NODE", "succeeded", 190), ("RESET_GPU", "failed", 310)):
                c = commands[action]
                await agent.put(encode(RemediationResult(
                    ts=at(t), node=c["node"], gpu_uuid=GPU, pci_bus_id=PCI, command_id=c["command_id"],
                    incident_id=c["incident_id"], action=action, outcome=outcome)), key=GPU.encode())
        return proc

    proc = asyncio.run(run())
    assert proc.labelled.stage_count["cordon"] == 1 and proc.labelled.stage_count["reset"] == 0
    # the failed reset climbed to REBOOT_NODE (at 310 s): unanswered, it counts once the bound passed
    rows = list(proc.gpu_table.items())
    assert unconfirmed_reboots(rows, {}, at(310).timestamp() + 5401, 5400) == 1
    assert unconfirmed_reboots(rows, {}, at(310).timestamp() + 5399, 5400) == 0
