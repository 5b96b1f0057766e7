"""Storms by blast radius through the whole Kafka-free pipeline (streams.engine.Engine): a 77-node
Xid 45 teardown is one incident with 77 members and no node-level command; more than half of an
NVL72 rack's nodes with hardware faults is one storm for the rack."""

from __future__ import annotations

from types import SimpleNamespace

from xidstream.collectors.sink import MemorySink
from xidstream.schemas import Classification, Severity
from xidstream.schemas.vocab import BREAKER_ACTIONS
from xidstream.streams.engine import Engine
from xidstream.streams.routing import groups_of
from xidstream.settings import Settings
from xidstream.simulate import FaultRates, Simulator

NONE = FaultRates(0, 0, 0, 0, 0)


def run(**kw) -> tuple[Simulator, Engine]:
    sim = Simulator(Settings(), kw.pop("nodes"), 2, rate=0.1, seed=5, rates=NONE, **kw)
    sink = MemorySink()
    sim.run(sink, progress=None)
    return sim, Engine().run(list(sink.records))


def fleet_alerts(engine: Engine) -> list:
    return [a for a in engine.alerts if a.node == "fleet"]


def test_a_77_node_teardown_is_one_incident_with_77_members_and_no_node_level_command():
    sim, engine = run(nodes=80, duration=300, xid45_teardowns=1, teardown_nodes=77)
    ranks = {g.node for g in sim.gpus if g.fault == "xid45_teardown"}
    assert len(ranks) == 77
    alerts = fleet_alerts(engine)
    assert len({a.incident_id for a in alerts}) == 1
    opened = [a for a in alerts if a.state == "open"]
    assert len(opened) == 1 and len(alerts) == 77 - 3 + 1  # opened at the 3rd node, one update per later node
    assert all((a.classification, a.severity) == (Classification.APP_FAULT, Severity.warning) for a in alerts)
    last = alerts[-1].evidence.timeline[0].data
    assert last["group"] == "sim/teardown-0" and last["node_count"] == 77
    assert {m["node"] for m in last["members"]} == ranks
    assert not any(c.action in BREAKER_ACTIONS for c in engine.commands)
    assert engine.fleet.tripped is False


def test_more_than_half_of_a_racks_nodes_faulting_is_one_storm_for_the_rack():
    sim, engine = run(nodes=72, duration=600, rack_size=18, nvlink_domain_faults=1)
    hit = sorted({g.node for g in sim.gpus if g.fault == "hardware"})
    assert len(hit) == 10 and len({sim.rack_of(n) for n in hit}) == 1  # 10 of one rack's 18
    rack = sim.rack_of(hit[0])
    alerts = fleet_alerts(engine)
    storms = [a for a in alerts if a.classification == Classification.FLEET_STORM]
    assert len(storms) == 1 and storms[0].state == "open"
    data = storms[0].evidence.timeline[0].data
    assert (data["group_kind"], data["group"], data["known_nodes"]) == ("rack", rack, 18)
    assert [m["node"] for m in data["members"]] == hit
    node_level = [c for c in engine.commands if c.action in BREAKER_ACTIONS]
    assert {c.node for c in node_level} == set(hit)
    # the storm opened on the 10th node's first plan: from there on its commands wait for a person
    first = {}
    for c in node_level:
        first.setdefault(c.node, c)
    tenth = max(first.values(), key=lambda c: (c.ts, c.node)).node
    assert all(c.requires_approval == (c.node == tenth) for c in node_level)
    assert engine.fleet.tripped is False  # 10 of 72 nodes: under the fleet-wide 20% (14.4)


def test_groups_of_reads_the_nvlink_domain_where_the_row_has_one():
    row = SimpleNamespace(job="ns/j", rack=None, driver_version="590.44.01", fabric_domain="uuid/7")
    assert groups_of(row) == {"job": "ns/j", "domain": "uuid/7", "driver": "590.44.01"}
    assert groups_of(SimpleNamespace()) == {}


def test_a_record_with_nothing_to_route_does_not_read_the_rows_groups():
    # fan_out runs on every record the worker folds; the groups only go into a fleet message, and a
    # quiet GPU's samples and process lists make none: reading them for those was four getattrs and
    # two dicts on every record. Where a message is made, it still carries them.
    from xidstream.streams.classify import step
    from xidstream.streams.policy import Policy
    from xidstream.streams.routing import fan_out
    from tests.streams.builders import GPU, inventory, procs, sample

    class Watched:
        def __init__(self, state):
            self.__dict__.update(_state=state, read=[])

        def __getattr__(self, name):
            if name in ("job", "rack", "fabric_domain", "driver_version"):
                self.read.append(name)
            return getattr(self._state, name)

        def __setattr__(self, name, value):
            setattr(self._state, name, value)

    state, outputs, _ = step(None, GPU, inventory(0), Policy())
    state.driver_version = "590.44.01"
    fan_out(state, inventory(0), outputs)  # the row's first record: announced
    for record in (sample(1), procs(1, 4242)):
        state, outputs, _ = step(state, GPU, record, Policy())
        watched = Watched(state)
        assert fan_out(watched, record, outputs) == ([], []) and watched.read == []
    watched = Watched(state)
    fleet, _ = fan_out(watched, inventory(2), [])
    assert [(m["kind"], m.get("groups")) for m in fleet] == [("inventory", {"driver": "590.44.01"})]
    assert watched.read
