"""Outputs the producer refuses for good (over its 1,000,000-byte limit, or invalid) are dead-lettered
as their source record and counted, and the agent goes on; any other send failure still stops the
worker (its restart reads the record again), so nothing retriable is dropped. Through the agents'
test_context (no broker); the broker tier is tests/integration/test_send_refusals_on_broker.py."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import orjson
import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotLeaderForPartitionError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
)
from faust.exceptions import ProducerSendError
from hypothesis import given, settings, strategies as st

import xidstream.streams.app as app_mod
from xidstream.schemas import Classification, RemediationCommand, decode_any, encode, to_dict
from xidstream.streams.app import (
    DEADLETTER_KEY_BYTES,
    DEADLETTER_ORIGINAL_BYTES,
    FLEET_KEY,
    RateLimitedLog,
    bounded_original,
    create_app,
    fits,
    fleet_row,
    refused_for_good,
)
from xidstream.streams.fleet import FleetState, fleet_step
from xidstream.streams.policy import Policy
from tests.streams.builders import GPU, T0, wedge, xid
from xidstream.settings import Settings
from tests.tools import examples

GPU_B = "GPU-bbbbbbbb-2222-3333-4444-555555555555"


def _wrapped(exc):
    """A send failure as faust raises it: its ProducerSendError, from aiokafka's error."""
    try:
        raise ProducerSendError(f"Error while sending: {exc!r}") from exc
    except ProducerSendError as wrapped:
        return wrapped


@pytest.mark.parametrize("exc, for_good", [
    (MessageSizeTooLargeError("1,267,306 bytes"), True),
    (RecordListTooLargeError(), True),
    (KafkaTimeoutError(), False),  # non-retriable by aiokafka's flag, but a resend can work
    (NotLeaderForPartitionError(), False),
    (TopicAuthorizationFailedError(), False),  # the worker's, not the record's: every output would fail
    (ValueError("a bug"), False),
])
def test_only_a_refusal_of_the_record_itself_counts_as_for_good(exc, for_good):
    assert refused_for_good(exc) is for_good
    assert refused_for_good(_wrapped(exc)) is for_good


def test_fits_is_aiokafkas_own_size_check():
    limit = 1_000_000
    value = b"x" * (limit - 200)
    assert fits(b"k", value, limit)
    assert not fits(b"k", value + b"x" * 300, limit)


def test_a_dead_letter_carries_a_small_record_whole_and_a_large_one_s_head():
    assert bounded_original(b"abc", b"GPU-1") == (b"abc", b"GPU-1", "")
    raw, key, note = bounded_original(b"y" * 900_000, b"k" * 5000)
    assert raw == b"y" * DEADLETTER_ORIGINAL_BYTES and key == b"k" * DEADLETTER_KEY_BYTES
    assert note == (f" [original truncated: the first {DEADLETTER_ORIGINAL_BYTES:,} of 900,000 bytes]"
                    f" [key truncated: the first {DEADLETTER_KEY_BYTES:,} of 5,000 bytes]")


def test_the_rate_limited_log_says_how_many_lines_it_left_out(caplog):
    now = [0.0]
    quiet = RateLimitedLog(logging.getLogger("t"), every_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        assert quiet.log(logging.WARNING, "a", "refused %s", 1)
        for i in range(500):
            now[0] += 0.01
            quiet.log(logging.WARNING, "a", "refused %s", i)
        assert quiet.log(logging.WARNING, "b", "another kind")  # its own budget
        now[0] = 10.5
        assert quiet.log(logging.WARNING, "a", "refused %s", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1", "another kind", "refused 2 (and 500 more like it in the last 10 s, not logged)"]


# -- the agents -----------------------------------------------------------------------------------
def _app(refuse=lambda topic, value: None, batch=500):
    """The app with its sends captured; `refuse(topic, value)` may return an exception to raise."""
    proc = create_app(Settings(topic_prefix="tc."), batch=batch)
    sent: dict[str, list] = {"alerts": [], "fleet": [], "remediation": [], "deadletter": [], "results_by_gpu": []}

    def capture(name):
        async def send(key=None, value=None, **kwargs):
            exc = refuse(name, value)
            if exc is not None:
                raise _wrapped(exc)
            sent[name].append((key, value))
        return send

    for name, topic in (("alerts", proc.alerts), ("fleet", proc.fleet_topic), ("remediation", proc.remediation),
                        ("deadletter", proc.deadletter), ("results_by_gpu", proc.results_by_gpu)):
        topic.send = capture(name)
    crashed: list = []

    async def crash(exc):
        crashed.append(exc)

    proc.app.crash = crash
    return proc, sent, crashed


def test_a_refused_alert_dead_letters_its_record_and_the_record_s_commands_and_the_next_records_go_on():
    first_alert = []

    def refuse(topic, value):
        if topic == "alerts" and not first_alert:
            first_alert.append(value)
            return MessageSizeTooLargeError("The message is 1,300,000 bytes when serialized")
        return None

    async def run():
        proc, sent, crashed = _app(refuse)
        async with proc.gpus.test_context() as agent:
            await agent.put(encode(xid(10, 79, pid=None)), key=GPU.encode())  # its alert is refused
            await agent.put(encode(xid(12, 13, gpu=GPU_B)), key=GPU_B.encode())
        return proc, sent, crashed

    proc, sent, crashed = asyncio.run(run())
    assert crashed == []
    (dead,) = [decode_any(v) for _, v in sent["deadletter"]]
    assert dead.error_type == "MessageSizeTooLargeError" and dead.original_key == GPU.encode()
    assert "the producer refused its alert" in dead.error and "1,300,000 bytes" in dead.error
    assert dead.error.endswith(first_alert[0][:400].decode())  # the output's head, bounded
    assert decode_any(dead.original).xid == 79  # the record itself, whole (it is small)
    # the same record's commands still went to the fleet agent, and the next record's alert went out
    commands = [orjson.loads(v)["command"] for _, v in sent["fleet"] if orjson.loads(v)["kind"] == "command"]
    assert {c["gpu_uuid"] for c in commands} == {GPU, GPU_B}
    assert [decode_any(v).gpu_uuid for _, v in sent["alerts"]] == [GPU_B]
    assert proc.stats["outputs_refused"] == 1 and proc.stats["deadletters"] == 1 and proc.stats["alerts"] == 1


@pytest.mark.parametrize("exc", [NotLeaderForPartitionError(), KafkaTimeoutError(), TopicAuthorizationFailedError()])
def test_any_other_send_failure_stops_the_worker_and_drops_nothing(exc):
    async def run():
        proc, sent, crashed = _app(lambda topic, value: exc if topic == "alerts" else None)
        async with proc.gpus.test_context() as agent:
            await agent.put(encode(xid(10, 79, pid=None)), key=GPU.encode())
            for _ in range(50):
                if crashed:
                    break
                await asyncio.sleep(0.01)
        return proc, sent, crashed

    proc, sent, crashed = asyncio.run(run())
    assert len(crashed) == 1 and refused_for_good(crashed[0]) is False
    assert sent["deadletter"] == [] and proc.stats["outputs_refused"] == 0


def test_a_refused_command_of_the_fleet_agent_is_dead_lettered_and_the_next_command_goes_out():
    def refuse(topic, value):
        return MessageSizeTooLargeError("too large") if topic == "remediation" and b"inc-big" in value else None

    def cmd(incident, minute):
        return RemediationCommand(ts=T0 + timedelta(minutes=minute), node="node-7", command_id=f"c-{incident}",
                                  incident_id=incident, gpu_uuid="GPU-79", gpu_index=0, pci_bus_id="0000:01:00",
                                  action="RECORD", step=0, reason="Xid 79", expires_at=T0 + timedelta(minutes=30))

    async def run():
        proc, sent, crashed = _app(refuse)
        async with proc.fleet.test_context() as agent:
            for c in (cmd("inc-big", 1), cmd("inc-ok", 2)):
                await agent.put(orjson.dumps({"kind": "command", "command": to_dict(c)}), key=FLEET_KEY)
        return proc, sent, crashed

    proc, sent, crashed = asyncio.run(run())
    assert crashed == []
    assert [decode_any(v).incident_id for _, v in sent["remediation"]] == ["inc-ok"]
    (dead,) = [decode_any(v) for _, v in sent["deadletter"]]
    assert "its command" in dead.error and b"inc-big" in dead.original
    assert proc.stats["commands"] == 1 and proc.stats["outputs_refused"] == 1


def test_a_gpu_row_over_the_limit_is_not_written_and_the_worker_decides_on(monkeypatch):
    """A row the producer would refuse would crash faust's producer buffer (table writes are sent
    from there): the table keeps the last row that fit, the record is dead-lettered, and the GPU's
    incident goes on from the row in memory (the wedge's commands all still come)."""
    limit = 1500
    monkeypatch.setattr(app_mod, "fits", lambda key, value, max_request: len(value) <= limit)

    async def run():
        proc, sent, crashed = _app(batch=1)  # a row written per record: some fit, later ones do not
        async with proc.gpus.test_context() as agent:
            for rec in wedge():
                await agent.put(encode(rec), key=GPU.encode())
        return proc, sent, crashed

    proc, sent, crashed = asyncio.run(run())
    assert crashed == []
    assert len(proc.gpu_table[GPU.encode()]) <= limit
    assert proc.stats["outputs_refused"] >= 1 and proc.stats["rows_written"] >= 1
    dead = [decode_any(v) for _, v in sent["deadletter"]]
    assert dead and all("not written (the table keeps its last row that fit)" in d.error
                        and d.error_type == "MessageSizeTooLargeError" for d in dead)
    alerts = [decode_any(v).classification for _, v in sent["alerts"]]
    assert alerts == [Classification.APP_FAULT, Classification.GPU_WEDGED]
    commands = [orjson.loads(v)["command"]["action"] for _, v in sent["fleet"] if orjson.loads(v)["kind"] == "command"]
    assert commands == ["RECORD", "CORDON_NODE", "DRAIN_NODE", "RESET_GPU"]


# -- the fleet agent's main row ---------------------------------------------------------------------
_command = st.tuples(st.integers(0, 40), st.integers(0, 3000), st.sampled_from(["CORDON_NODE", "DRAIN_NODE",
                                                                                 "REBOOT_NODE", "RECORD"]))


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(_command, min_size=1, max_size=60), st.lists(_command, max_size=40), st.integers(3, 40))
def test_the_compacted_breaker_row_decides_exactly_as_the_full_one(before, after, known):
    """When the main row would pass the limit, `starts` is written as each node's newest start;
    a breaker restored from that row gives the same outputs as the one that kept every start."""
    policy = Policy()

    def msg(i, c):
        node, t, action = c
        return {"kind": "command", "command": RemediationCommand(
            ts=T0 + timedelta(seconds=t), node=f"node-{node}", command_id=f"c{i}", incident_id=f"i{i}",
            action=action, step=0, expires_at=T0 + timedelta(hours=1))}

    state = FleetState()
    for n in range(known):
        state, _ = fleet_step(state, {"kind": "inventory", "node": f"node-{n}", "ts": T0.timestamp()}, policy)
    for i, c in enumerate(before):
        state, _ = fleet_step(state, msg(i, c), policy)
    data = {k: v for k, v in state.to_dict().items() if k not in ("known_nodes", "workload_gpus")}
    row = fleet_row(data, limit=0)  # over any limit: compacted
    restored = FleetState.from_dict(orjson.loads(row))
    restored.known_nodes = dict(state.known_nodes)
    assert len(restored.starts) == len({s[1] for s in state.starts})
    for i, c in enumerate(after, start=len(before)):
        m = msg(i, c)
        state, full = fleet_step(state, m, policy)
        restored, compact = fleet_step(restored, m, policy)
        same = [(k, o.model_dump(exclude={"event_id"})) for k, o in full]  # a storm alert's event_id is new
        assert [(k, o.model_dump(exclude={"event_id"})) for k, o in compact] == same
    assert (restored.tripped, restored.trips, restored.held) == (state.tripped, state.trips, state.held)


def test_a_row_that_fits_is_written_as_it_is():
    data = {"starts": [[1.0, "a"], [2.0, "a"]], "tripped": False}
    assert fleet_row(data, limit=1_000_000) == orjson.dumps(data)
    assert orjson.loads(fleet_row(data, limit=0))["starts"] == [[2.0, "a"]]
