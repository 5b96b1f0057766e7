"""The fleet agent trusts only its own processor's agents and an approver's signed reset, counts
every action that takes capacity away, and bounds a node's clock by when it received a command
(threats T3: a leaked `processor` Kafka credential without the private key; T4: lying clocks).

On 1484261 an unsealed ``REBOOT_NODE kube-control-plane-1`` with a 30-day expiry put on the fleet
topic came out signed, an unsigned ``{"kind": "reset"}`` reset the breaker, commands stamped 11 min
apart never shared a window, and RESET_GPU / QUARANTINE_GPU were never counted or held."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timedelta, timezone

import orjson
import pytest

from xidstream.schemas import Action, Classification, RemediationCommand, decode_any, to_dict
from xidstream.schemas.models import Approval
from xidstream.schemas.signing import SigningKey, VerifyKeys, generate_keys
from xidstream.streams.app import FLEET_KEY, create_app
from xidstream.streams.fleet import FleetState, breaker_time, fleet_step
from xidstream.streams.handoff import RESET_COMMAND_ID, Handoff, HandoffError
from xidstream.streams.policy import Policy
from xidstream.settings import Settings

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    sp, spub, _ = generate_keys(d / "processor")
    op, opub, _ = generate_keys(d / "ops")
    return SigningKey.load(sp), VerifyKeys.load([spub]), SigningKey.load(op), VerifyKeys.load([opub], purpose="approvals")


def _cmd(node: str, action: str, ts: datetime, **kw) -> RemediationCommand:
    return RemediationCommand(ts=ts, node=node, command_id=f"c-{uuid.uuid4().hex[:10]}", incident_id="i-1",
                              gpu_uuid=f"GPU-{node}", gpu_index=0, pci_bus_id="0000:01:00", action=action, step=1,
                              reason="test", expires_at=ts + timedelta(minutes=15), **kw)


def _reset(key: SigningKey, *, now: datetime = T0, command_id: str = RESET_COMMAND_ID, ttl: float = 300) -> dict:
    approval = key.sign(Approval(ts=now, node="fleet", approval_id=uuid.uuid4().hex, command_id=command_id,
                                 approved_by="ops", expires_at=now + timedelta(seconds=ttl)))
    return {"kind": "reset", "ts": now.timestamp(), "by": "ops", "approval": to_dict(approval)}


# -- the hand-off seal ---------------------------------------------------------------------------

def test_a_sealed_message_opens_and_anything_else_is_refused(keys):
    sk, _, ok, ov = keys
    h = Handoff.for_processor(sk, ov)
    body = orjson.dumps({"kind": "node_seen", "node": "n1", "ts": 1.0})
    now = T0.timestamp()
    assert h.open(h.seal(body, now), now) == {"kind": "node_seen", "node": "n1", "ts": 1.0}
    with pytest.raises(HandoffError, match="unsealed 'command' message"):
        h.open(orjson.dumps({"kind": "command", "command": to_dict(_cmd("kube-control-plane-1", "REBOOT_NODE", T0))}),
               now)
    sealed = h.seal(body, now)
    altered = sealed.replace(b'"n1"', b'"n2"')
    with pytest.raises(HandoffError, match="another key or altered"):
        h.open(altered, now)
    later = sealed.replace(b":%d:" % (now * 1000), b":%d:" % (now * 1000 + 3_600_000))  # the seal time moved on
    assert later != sealed
    with pytest.raises(HandoffError, match="another key or altered"):
        h.open(later, now + 3600)
    other = Handoff.for_processor(ok, ov)  # the operator's key is not the processor's
    with pytest.raises(HandoffError, match="another key or altered"):
        h.open(other.seal(body, now), now)


def test_a_breaker_reset_needs_an_approvers_signature(keys):
    sk, _, ok, ov = keys
    h = Handoff.for_processor(sk, ov)
    now = T0.timestamp()
    with pytest.raises(HandoffError, match="no signed approval"):
        h.open(orjson.dumps({"kind": "reset", "ts": now, "by": "mallory"}), now)
    with pytest.raises(HandoffError, match="unknown key"):
        h.open(orjson.dumps(_reset(sk)), now)  # the processor's own key approves nothing
    with pytest.raises(HandoffError, match="not 'breaker-reset'"):
        h.open(orjson.dumps(_reset(ok, command_id="cmd-123")), now)  # an approval of a command is no reset
    with pytest.raises(HandoffError, match="expired"):
        h.open(orjson.dumps(_reset(ok, now=T0 - timedelta(hours=1))), now)
    with pytest.raises(HandoffError, match="longer than a day"):
        h.open(orjson.dumps(_reset(ok, ttl=2 * 86400)), now)
    with pytest.raises(HandoffError, match="ahead of the processor's clock"):
        h.open(orjson.dumps(_reset(ok, now=T0 + timedelta(hours=1))), now)
    msg = h.open(orjson.dumps(_reset(ok)), now)
    assert msg["kind"] == "reset" and msg["by"] == "ops" and msg["key_id"] == ok.key_id
    # A processor with no approver key takes no reset at all.
    with pytest.raises(HandoffError, match="trusts no approver key"):
        Handoff.for_processor(sk, None).open(orjson.dumps(_reset(ok)), now)


def test_a_reset_approval_resets_once(keys):
    sk, _, ok, ov = keys
    h = Handoff.for_processor(sk, ov)
    policy = Policy()
    state = FleetState(known_nodes={f"n{i}": T0.timestamp() for i in range(10)}, tripped=True, tripped_at=1.0)
    reset = h.open(orjson.dumps(_reset(ok)), T0.timestamp())
    state, _ = fleet_step(state, reset, policy)
    assert not state.tripped
    state.tripped = True  # tripped again later; the same approval replayed must not reset it
    state, _ = fleet_step(state, reset, policy)
    assert state.tripped


# -- the fleet agent on its channel (agent.test_context(): no broker) --------------------------

def _app(keys, **kw):
    sk, _, _, ov = keys
    proc = create_app(Settings(topic_prefix="tc."), signing_key=sk, approver_keys=ov, **kw)
    sent = {"alerts": [], "remediation": [], "deadletter": [], "fleet": []}

    def capture(name):
        async def send(key=None, value=None, **kwargs):
            sent[name].append((key, value))
        return send

    for name in sent:
        getattr(proc, "fleet_topic" if name == "fleet" else name).send = capture(name)
    return proc, sent


def test_the_fleet_agent_signs_nothing_it_was_not_handed_by_its_own_agents(keys):
    sk, sv, ok, _ = keys
    forged = _cmd("kube-control-plane-1", "REBOOT_NODE", datetime.now(timezone.utc))
    forged = forged.model_copy(update={"expires_at": forged.ts + timedelta(days=30)})

    async def run():
        proc, sent = _app(keys)
        async with proc.fleet.test_context() as agent:
            await agent.put(orjson.dumps({"kind": "command", "command": to_dict(forged)}), key=FLEET_KEY)
            await agent.put(orjson.dumps({"kind": "reset", "ts": 1.0, "by": "mallory"}), key=FLEET_KEY)
            genuine = _cmd("node-a", "CORDON_NODE", datetime.now(timezone.utc))
            h = Handoff.for_processor(sk, None)
            await agent.put(h.seal(orjson.dumps({"kind": "command", "command": to_dict(genuine)})), key=FLEET_KEY)
        return sent, genuine

    sent, genuine = asyncio.run(run())
    out = [decode_any(v) for _, v in sent["remediation"]]
    assert [(c.node, c.action) for c in out] == [("node-a", Action.CORDON_NODE)]
    sv.verify(out[0])  # the genuine one is signed
    dead = [decode_any(v) for _, v in sent["deadletter"]]
    assert len(dead) == 2 and all(d.error_type == "HandoffError" for d in dead)
    assert "unsealed 'command'" in dead[0].error and "no signed approval" in dead[1].error


def test_the_gpu_agent_seals_what_it_hands_to_the_fleet_agent(keys):
    from tests.streams.builders import GPU, wedge
    from xidstream.schemas import encode

    sk = keys[0]

    async def run():
        proc, sent = _app(keys)
        async with proc.gpus.test_context() as agent:
            for rec in wedge():
                await agent.put(encode(rec), key=GPU.encode())
        return sent

    sent = asyncio.run(run())
    h = Handoff.for_processor(sk, None)
    msgs = [h.open(v, time.time()) for _, v in sent["fleet"]]
    assert [m["command"]["action"] for m in msgs if m["kind"] == "command"] == [
        "RECORD", "CORDON_NODE", "DRAIN_NODE", "RESET_GPU"]
    assert all(v.startswith(b"xs2:") for _, v in sent["fleet"])


# -- what the breaker counts, and on which clock -------------------------------------------------

def _storm(actions, nodes=10, spacing=timedelta(seconds=10), now=None):
    policy = Policy()
    state = FleetState(known_nodes={f"n{i}": T0.timestamp() for i in range(nodes)})
    out = []
    for i in range(nodes):
        ts = T0 + spacing * i
        for a in actions:
            state, o = fleet_step(state, {"kind": "command", "command": _cmd(f"n{i}", a, ts)}, policy,
                                  now=None if now is None else now(i))
            out += o
    return state, out


@pytest.mark.parametrize("action", ["RESET_GPU", "QUARANTINE_GPU", "CORDON_NODE"])
def test_every_action_that_takes_capacity_away_trips_the_breaker_and_is_held(action):
    state, out = _storm([action])
    assert state.tripped and state.trips == 1
    cmds = [c for k, c in out if k == "command"]
    assert [c.requires_approval for c in cmds] == [False, False] + [True] * 8  # 3rd of 10 nodes > 20%
    assert any(k == "alert" and c.classification == Classification.FLEET_STORM for k, c in out)


def test_closing_steps_and_records_are_never_held():
    state, out = _storm(["CORDON_NODE"])
    for a in ("UNCORDON_NODE", "RELEASE_GPU", "RECORD"):
        state, o = fleet_step(state, {"kind": "command", "command": _cmd("n1", a, T0)}, Policy())
        assert [c.requires_approval for _, c in o] == [False]


def test_commands_stamped_apart_in_the_future_are_counted_when_received():
    eleven = timedelta(minutes=11)  # more than the 10 min window between any two stamps
    received = lambda i: T0.timestamp() + i  # all handed over within ten seconds
    state, out = _storm(["CORDON_NODE"], spacing=eleven, now=received)
    assert state.tripped
    assert sum(c.requires_approval for k, c in out if k == "command") == 8
    # Trusting the stamps (no receive time: the pure path), the same commands never trip it.
    state, _ = _storm(["CORDON_NODE"], spacing=eleven)
    assert not state.tripped


@pytest.mark.parametrize("offset, taken_at", [(300, "stamp"), (-300, "stamp"), (301, "now"), (-301, "now")])
def test_the_breaker_takes_a_stamp_within_the_skew_bound_and_the_receipt_time_beyond(offset, taken_at):
    now = 1_000_000.0
    got = breaker_time(now + offset, now, Policy())
    assert got == (now + offset if taken_at == "stamp" else now)
    assert breaker_time(now + 5000, None, Policy()) == now + 5000


# -- the fleet's size comes from GPU inventories ------------------------------------------------

def test_a_node_without_a_gpu_inventory_gets_no_capacity_taken_without_approval():
    policy = Policy()
    state = FleetState()
    state, _ = fleet_step(state, {"kind": "inventory", "node": "gpu-1", "ts": T0.timestamp()}, policy)
    state, out = fleet_step(state, {"kind": "command", "command": _cmd("gpu-1", "CORDON_NODE", T0)}, policy)
    assert [c.requires_approval for _, c in out] == [False]
    for node in ("kube-control-plane-1", "made-up-node"):
        state, out = fleet_step(state, {"kind": "command", "command": _cmd(node, "REBOOT_NODE", T0)}, policy)
        (cmd,) = [c for k, c in out if k == "command"]
        assert cmd.requires_approval and f"node {node} has published no GPU inventory" in cmd.reason
    # A node named by the first record of a GPU row counts too, but only for a day: made-up nodes
    # no longer grow the fleet for good.
    state, _ = fleet_step(state, {"kind": "node_seen", "node": "ghost", "ts": T0.timestamp()}, policy)
    assert set(state.known_nodes) == {"gpu-1", "ghost"}
    later = T0 + timedelta(seconds=policy.fleet_node_ttl_s + 1)
    state, _ = fleet_step(state, {"kind": "inventory", "node": "gpu-1", "ts": later.timestamp()}, policy)
    state, _ = fleet_step(state, {"kind": "command", "command": _cmd("gpu-1", "CORDON_NODE", later)}, policy)
    assert set(state.known_nodes) == {"gpu-1"}


def test_a_node_whose_inventory_was_not_seen_for_a_day_is_forgotten():
    policy = Policy()
    state = FleetState()
    state, _ = fleet_step(state, {"kind": "inventory", "node": "gpu-1", "ts": T0.timestamp()}, policy)
    state, _ = fleet_step(state, {"kind": "inventory", "node": "gpu-2", "ts": T0.timestamp()}, policy)
    later = T0 + timedelta(seconds=policy.fleet_node_ttl_s)
    state, _ = fleet_step(state, {"kind": "inventory", "node": "gpu-2", "ts": later.timestamp()}, policy)
    state, out = fleet_step(state, {"kind": "command", "command": _cmd("gpu-2", "CORDON_NODE", later)}, policy)
    assert set(state.known_nodes) == {"gpu-1", "gpu-2"}  # exactly a day: still known
    just_after = later + timedelta(seconds=1)
    state, out = fleet_step(state, {"kind": "command", "command": _cmd("gpu-1", "CORDON_NODE", just_after)}, policy)
    assert set(state.known_nodes) == {"gpu-2"}
    assert [c.requires_approval for _, c in out] == [True]


def test_an_inventory_stamped_far_ahead_counts_when_received():
    policy = Policy()
    state = FleetState()
    now = T0.timestamp()
    state, _ = fleet_step(state, {"kind": "inventory", "node": "gpu-1", "ts": now + 10 * 86400}, policy, now=now)
    assert state.known_nodes["gpu-1"] == now  # a forged far-future stamp cannot keep a node known for good


def test_the_web_server_serves_no_router_table_graph_or_stats_views():
    proc = create_app(Settings(topic_prefix="tc."), web_port=0)
    served = [prefix for prefix, _ in proc.app.web.blueprints._enabled]
    assert not {"/router", "/table", "/graph"} & set(served), served
    assert all("stats" not in str(bp) and "router" not in str(bp) and "tables" not in str(bp)
               for _, bp in proc.app.web.blueprints._enabled)


def test_settings_never_show_their_secrets():
    s = Settings(kafka_extra={"sasl.password": "hunter2-secret", "ssl.key.password": "k3y-secret"})
    assert "secret" not in repr(s) and "secret" not in str(s)
    assert s.kafka_extra["sasl.password"] == "hunter2-secret"


# -- a replayed hand-off message -----------------------------------------------------------------

def test_a_replayed_sealed_command_is_not_released_again_after_a_restart(keys):
    """T3 with the `processor` Kafka user but not the key: a sealed fleet message copied from the
    topic and written again. The fleet agent remembered the commands it had released in memory
    only, so after a restart the copy was released and signed again, and counted by the breaker
    once more. What it released is rows of its table now, read back on start."""
    sk, sv, _, _ = keys
    now = datetime.now(timezone.utc)
    h = Handoff.for_processor(sk, None)
    inventory = h.seal(orjson.dumps({"kind": "inventory", "node": "node-a", "ts": now.timestamp()}))
    cordon = _cmd("node-a", "CORDON_NODE", now)
    sealed = h.seal(orjson.dumps({"kind": "command", "command": to_dict(cordon)}))

    async def first():
        proc, sent = _app(keys)
        async with proc.fleet.test_context() as agent:
            await agent.put(inventory, key=FLEET_KEY)
            await agent.put(sealed, key=FLEET_KEY)
        return dict(proc.fleet_table.data.items()), sent

    async def restarted(rows):
        proc, sent = _app(keys)
        proc.fleet_table.data.update(rows)  # what the changelog gives a restarted worker
        async with proc.fleet.test_context() as agent:
            await agent.put(sealed, key=FLEET_KEY)  # the copy
        return dict(proc.fleet_table.data.items()), sent

    rows, sent = asyncio.run(first())
    (released,) = [decode_any(v) for _, v in sent["remediation"]]
    sv.verify(released)
    assert released.command_id == cordon.command_id
    after, sent = asyncio.run(restarted(rows))
    assert sent["remediation"] == [], "the replayed command was released and signed again"
    assert len(orjson.loads(after[FLEET_KEY])["starts"]) == 1  # and not counted by the breaker again


def test_a_copy_older_than_the_hand_off_bound_is_dead_lettered_and_what_it_named_forgotten(keys, monkeypatch):
    """A copy written again after the hour: refused by its seal time, whatever the table still
    holds; and the rows of the commands released an hour ago are gone from the table."""
    import xidstream.streams.app as app_module

    sk = keys[0]
    now = time.time()
    h = Handoff.for_processor(sk, None)
    cordon = _cmd("node-a", "CORDON_NODE", datetime.now(timezone.utc))
    sealed = h.seal(orjson.dumps({"kind": "command", "command": to_dict(cordon)}), now)
    row = b"released:" + cordon.command_id.encode()

    async def run(rows, messages):
        proc, sent = _app(keys)
        proc.fleet_table.data.update(rows)
        async with proc.fleet.test_context() as agent:
            for m in messages:
                await agent.put(m, key=FLEET_KEY)
        return dict(proc.fleet_table.data.items()), sent

    rows, sent = asyncio.run(run({}, [sealed]))
    assert len(sent["remediation"]) == 1 and orjson.loads(rows[row]) == pytest.approx(now, abs=0.001)
    monkeypatch.setattr(app_module, "time", type("Clock", (), {"time": staticmethod(lambda: now + 3601),
                                                               "monotonic": staticmethod(time.monotonic)}))
    later = h.seal(orjson.dumps({"kind": "node_seen", "node": "node-b", "ts": now + 3601}), now + 3601)
    rows, sent = asyncio.run(run(rows, [sealed, later]))
    assert sent["remediation"] == []
    (dead,) = [decode_any(v) for _, v in sent["deadletter"]]
    assert dead.error_type == "HandoffError" and dead.error.startswith("sealed 3601 s ago, more than the 3600 s")
    assert row not in rows  # forgotten: a copy of it can no longer be opened


def test_the_breaker_counts_a_sealed_message_at_its_seal_time_not_at_the_records_timestamp(keys):
    """The record's timestamp is its producer's to choose, and whoever writes a copy chooses it;
    the seal time is covered by the MAC."""
    sk = keys[0]
    now = time.time()
    h = Handoff.for_processor(sk, None)
    far = h.seal(orjson.dumps({"kind": "inventory", "node": "node-a", "ts": now + 10 * 86400}), now)

    async def run():
        proc, sent = _app(keys)
        async with proc.fleet.test_context() as agent:
            await agent.put(far, key=FLEET_KEY, timestamp=now + 9 * 86400)
        return dict(proc.fleet_table.data.items())

    rows = asyncio.run(run())
    assert orjson.loads(rows[b"node:node-a"]) == pytest.approx(now, abs=0.001)
