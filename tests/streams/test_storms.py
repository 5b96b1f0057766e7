"""Storms by blast radius (streams.storms through streams.fleet.fleet_step), exactly: the boundaries
of each threshold (at it and one below), incident ids, members, which commands are held, and that
grouping never releases a held command nor makes one."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest

from xidstream.schemas import Classification, Severity
from xidstream.schemas.errors import ConfigError
from xidstream.schemas.vocab import Action
from xidstream.streams.fleet import FleetState, fleet_step
from xidstream.streams.policy import Policy, load_policy
from xidstream.streams.storms import GROUP_VALUE_MAX, GROUPS_KEPT, MEMBERS_KEPT, group_attrs
from tests.streams.test_fleet_trust import T0, _cmd

P = Policy()
TS = T0.timestamp()


def fleet(n_other: int = 100, racks: dict[str, int] | None = None, kind: str = "rack") -> FleetState:
    """A fleet of `n_other` ungrouped nodes plus, per group, its nodes (`<group>-<i>`)."""
    s = FleetState()
    for i in range(n_other):
        s, _ = fleet_step(s, {"kind": "inventory", "node": f"other-{i}", "ts": TS}, P)
    for g, size in (racks or {}).items():
        for i in range(size):
            s, _ = fleet_step(s, {"kind": "inventory", "node": f"{g}-{i}", "ts": TS, "groups": {kind: g}}, P)
    return s


def command(s, node, group, at=0.0, kind="rack", action=Action.CORDON_NODE, policy=P):
    cmd = _cmd(node, action.value, T0 + timedelta(seconds=at))
    cmd = cmd.model_copy(update={"incident_id": f"inc-{node}"})
    msg = {"kind": "command", "command": cmd}
    if group:
        msg["groups"] = {kind: group}
    return fleet_step(s, msg, policy)


def split(out):
    return [a for k, a in out if k == "alert"], [c for k, c in out if k == "command"]


def gid(what, kind, value, since):
    return hashlib.sha256(f"{what}:{kind}:{value}:{since}".encode()).hexdigest()[:24]


# -- node-level plans per group -----------------------------------------------------------------
def test_a_rack_storm_opens_above_half_not_at_half_and_holds_only_its_members():
    s = fleet(racks={"r1": 6})
    for i in range(3):  # 3 of 6: exactly half, not more
        s, out = command(s, f"r1-{i}", "r1", at=i)
        alerts, (cmd,) = split(out)
        assert alerts == [] and cmd.requires_approval is False
    s, out = command(s, "r1-3", "r1", at=3)  # 4 of 6
    (a,), (cmd,) = split(out)
    inc = gid("group-storm", "rack", "r1", TS)
    assert (a.incident_id, a.alert_id, a.state) == (inc, f"{inc}-4", "open")
    assert (a.classification, a.severity, a.node, a.gpu_uuid) == (Classification.FLEET_STORM, Severity.critical, "fleet", None)
    data = a.evidence.timeline[0].data
    assert data["members"] == [{"node": f"r1-{i}", "incident_id": f"inc-r1-{i}"} for i in range(4)]
    assert (data["group_kind"], data["group"], data["known_nodes"], data["nodes"]) == ("rack", "r1", 6, [f"r1-{i}" for i in range(4)])
    assert a.summary.startswith("FLEET STORM in rack r1: actions that take capacity away on 4 of its 6 known nodes")
    assert cmd.requires_approval is True and cmd.reason == "test [held: storm in rack r1]"
    s, out = command(s, "r1-4", "r1", at=4)  # a later member: an update of the same incident, held
    (a,), (cmd,) = split(out)
    assert (a.incident_id, a.alert_id, a.state) == (inc, f"{inc}-5", "updated") and cmd.requires_approval is True
    assert len(a.evidence.timeline[0].data["members"]) == 5
    s, out = command(s, "r1-4", "r1", at=5)  # the same node again: held, no new alert
    (cmd,) = [c for k, c in out if k == "command"]
    assert [k for k, _ in out] == ["command"] and cmd.requires_approval is True
    s, out = command(s, "other-1", None, at=6)  # not in the rack: not held
    assert split(out) == ([], [out[0][1]]) and out[0][1].requires_approval is False
    assert s.held == 3 and s.tripped is False  # the fleet-wide breaker did not trip (5 of 106)


def test_the_minimum_node_count_binds_in_a_small_group():
    s = fleet(racks={"r1": 3})
    s, out = command(s, "r1-0", "r1")
    s, out = command(s, "r1-1", "r1", at=1)  # 2 of 3 is more than half, but fewer than fleet_min_nodes
    assert split(out)[0] == [] and out[-1][1].requires_approval is False
    s, out = command(s, "r1-2", "r1", at=2)
    (a,), (cmd,) = split(out)
    assert a.state == "open" and cmd.requires_approval is True


def test_starts_older_than_the_window_do_not_count_and_the_window_edge_does():
    s = fleet(racks={"r1": 4})
    s, _ = command(s, "r1-0", "r1", at=0)
    s, _ = command(s, "r1-1", "r1", at=10)
    s, out = command(s, "r1-2", "r1", at=P.fleet_window_s + 0.5)  # r1-0 left the window: 2 of 4
    assert split(out)[0] == []
    s, out = command(s, "r1-3", "r1", at=P.fleet_window_s + 10)  # r1-1 at exactly the window: 3 of 4
    (a,), _ = split(out)
    assert a.incident_id == gid("group-storm", "rack", "r1", TS + 10)


@pytest.mark.parametrize("kind", ["domain", "driver", "job"])
def test_every_kind_groups_alike(kind):
    s = fleet(racks={"g": 4}, kind=kind)
    for i in range(3):
        s, out = command(s, f"g-{i}", "g", at=i, kind=kind)
    (a,), (cmd,) = split(out)
    assert a.incident_id == gid("group-storm", kind, "g", TS) and cmd.reason == f"test [held: storm in {kind} g]"


def test_grouping_never_releases_a_breaker_hold_and_never_makes_a_command():
    s = fleet(n_other=10, racks={"r1": 2})  # 12 nodes: the breaker trips at 3 (> 20% of 12 = 2.4)
    s, _ = command(s, "other-0", None)
    s, _ = command(s, "other-1", None, at=1)
    s, out = command(s, "r1-0", "r1", at=2)
    alerts, (cmd,) = split(out)
    assert s.tripped and [a.evidence.timeline[0].data.get("group") for a in alerts] == [None]
    assert cmd.requires_approval is True and cmd.reason == "test [held: fleet circuit breaker tripped]"
    # an action that takes no capacity passes as it came, groups or not
    s, out = command(s, "r1-1", "r1", at=3, action=Action.RECORD)
    assert [k for k, _ in out] == ["command"] and out[0][1].requires_approval is False


def test_a_reset_ends_group_storms():
    s = fleet(racks={"r1": 4})
    for i in range(3):
        s, out = command(s, f"r1-{i}", "r1", at=i)
    assert out[-1][1].requires_approval is True
    s, _ = fleet_step(s, {"kind": "reset"}, P)
    assert s.groups["rack=r1"]["storm"] is None and s.groups["rack=r1"]["starts"] == {}
    s, out = command(s, "r1-3", "r1", at=4)
    assert split(out)[0] == [] and out[-1][1].requires_approval is False


def test_switched_off_nothing_is_grouped():
    off = Policy(group_storms=False)
    s = FleetState()
    for i in range(4):
        s, _ = fleet_step(s, {"kind": "inventory", "node": f"r1-{i}", "ts": TS, "groups": {"rack": "r1"}}, off)
    for i in range(30):
        s, _ = fleet_step(s, {"kind": "inventory", "node": f"o-{i}", "ts": TS}, off)
    for i in range(3):
        s, out = command(s, f"r1-{i}", "r1", at=i, policy=off)
    assert split(out)[0] == [] and out[-1][1].requires_approval is False and s.groups == {}


# -- what a node says about its groups -----------------------------------------------------------
def test_a_node_is_in_one_rack_and_moving_leaves_the_old_one():
    s = fleet(racks={"r1": 2})
    s, _ = fleet_step(s, {"kind": "inventory", "node": "r1-0", "ts": TS + 1, "groups": {"rack": "r2"}}, P)
    assert set(s.groups["rack=r1"]["members"]) == {"r1-1"} and set(s.groups["rack=r2"]["members"]) == {"r1-0"}
    assert s.node_groups["r1-0"] == {"rack": "r2"}
    restored = FleetState.from_dict(s.to_dict())
    assert restored.node_groups == s.node_groups and "node_groups" not in s.to_dict() and "dirty_groups" not in s.to_dict()


def test_group_names_are_bounded_and_odd_ones_ignored():
    ok = "x" * GROUP_VALUE_MAX
    msg = {"groups": {"rack": ok + "y", "job": ok, "driver": 5, "domain": "", "colour": "red"}}
    assert group_attrs(msg) == {"job": ok}
    assert group_attrs({"groups": ["rack"]}) == {} and group_attrs({}) == {}


def test_groups_and_members_are_bounded():
    s = FleetState()
    for i in range(GROUPS_KEPT + 1):
        s, _ = fleet_step(s, {"kind": "inventory", "node": f"n{i}", "ts": TS + i, "groups": {"job": f"j{i}"}}, P)
    assert len(s.groups) == GROUPS_KEPT and "job=j0" not in s.groups and f"job=j{GROUPS_KEPT}" in s.groups
    for i in range(MEMBERS_KEPT + 1):
        s, _ = fleet_step(s, {"kind": "inventory", "node": f"m{i}", "ts": TS + i, "groups": {"rack": "big"}}, P)
    members = s.groups["rack=big"]["members"]
    assert len(members) == MEMBERS_KEPT and "m0" not in members and f"m{MEMBERS_KEPT}" in members


# -- one job's application faults ----------------------------------------------------------------
def jfault(s, node, job="ns/train", at=0.0, inc=None, policy=P):
    msg = {"kind": "job_fault", "node": node, "gpu_uuid": f"GPU-{node}", "xid": 45, "ts": TS + at,
           "incident_id": inc or f"inc-{node}", "groups": {"job": job}}
    return fleet_step(s, msg, policy)


def test_a_job_faulting_on_three_nodes_is_one_incident_with_updates_and_no_command():
    s = fleet(n_other=10)
    s, out = jfault(s, "other-0")
    s, out2 = jfault(s, "other-1", at=1)
    assert out == out2 == []  # 2 nodes: one below job_storm_min_nodes
    s, out = jfault(s, "other-2", at=2)
    ((k, a),) = out
    inc = gid("job-faults", "job", "ns/train", TS)
    assert k == "alert" and (a.incident_id, a.alert_id, a.state) == (inc, f"{inc}-3", "open")
    assert (a.classification, a.severity, a.node, a.gpu_uuid) == (Classification.APP_FAULT, Severity.warning, "fleet", None)
    assert a.evidence.timeline[0].data["members"] == [{"node": f"other-{i}", "incident_id": f"inc-other-{i}"} for i in range(3)]
    s, out = jfault(s, "other-2", at=3)  # the same node's other GPU: nothing new
    assert out == []
    s, out = jfault(s, "other-3", at=4)
    ((k, a),) = out
    assert (a.incident_id, a.alert_id, a.state, a.evidence.timeline[0].data["node_count"]) == (inc, f"{inc}-4", "updated", 4)
    # after the window, the job's next faults are a new incident
    s, out = jfault(s, "other-4", at=4 + P.fleet_window_s + 1)
    assert out == [] and s.groups["job=ns/train"]["fault_storm"] is None


def test_job_faults_of_unknown_nodes_or_without_a_job_count_for_nothing():
    s = fleet(n_other=3)
    for i in range(3):
        s, out = jfault(s, f"made-up-{i}", at=i)
        assert out == []
    s, out = fleet_step(s, {"kind": "job_fault", "node": "other-0", "ts": TS}, P)
    assert out == [] and s.groups == {}
    s = fleet(n_other=3)
    for i in range(3):
        s, out = jfault(s, f"other-{i}", at=i, policy=Policy(job_storm_min_nodes=4))
    assert out == []


# -- the knobs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"group_fraction": 0}, {"group_fraction": 1}, {"job_storm_min_nodes": 1},
                                 {"group_storms": "yes"}])
def test_bad_knobs_are_refused(bad):
    with pytest.raises(ConfigError):
        load_policy(bad)


def test_the_defaults():
    assert (P.group_storms, P.group_fraction, P.job_storm_min_nodes) == (True, 0.5, 3)
    assert load_policy({"group_fraction": 0.99, "job_storm_min_nodes": 2}).job_storm_min_nodes == 2


# -- review: a node flooding the group tables, repeated alert ids ----------------------------------
def test_a_node_naming_rack_after_rack_does_not_push_real_racks_out():
    # one known node sent 512 inventories, each with a new rack: the empty racks it left stayed and
    # the real rack r1 (6 nodes, 3 starts) was evicted; its 4th start then opened no storm
    s = fleet(racks={"r1": 6})
    for i in range(3):
        s, _ = command(s, f"r1-{i}", "r1", at=i)
    for k in range(GROUPS_KEPT + 5):
        s, _ = fleet_step(s, {"kind": "inventory", "node": "other-0", "ts": TS + 10 + k, "groups": {"rack": f"x{k}"}}, P)
    assert sum(1 for g in s.groups.values() if g["kind"] == "rack") <= 3  # r1, the newest lie, no empty ones
    s, out = command(s, "r1-3", "r1", at=4)
    (a,), (cmd,) = split(out)
    assert a.classification == Classification.FLEET_STORM and cmd.requires_approval is True


def test_one_member_groups_are_evicted_before_a_real_one():
    # a tenant's pods each with a new job label make one-member job groups; a job on many nodes stays
    s = fleet(n_other=10)
    for i in range(4):
        s, _ = fleet_step(s, {"kind": "node_seen", "node": f"other-{i}", "ts": TS,
                              "groups": {"job": "ml/real"}}, P)
    s, _ = fleet_step(s, {"kind": "inventory", "node": "other-9", "ts": TS}, P)
    for k in range(GROUPS_KEPT + 5):
        s, _ = fleet_step(s, {"kind": "node_seen", "node": "other-9", "ts": TS + 1 + k, "groups": {"job": f"t/j{k}"}}, P)
    assert "job=ml/real" in s.groups


def test_storm_alert_ids_do_not_repeat_when_old_starts_leave_the_window():
    s = fleet(racks={"r1": 6})
    ids = []
    for i, at in enumerate((0, 300, 400, 500, 650)):  # the first start leaves the 600 s window at 650
        s, out = command(s, f"r1-{i}", "r1", at=at)
        ids += [a.alert_id for a in split(out)[0]]
    assert len(ids) == len(set(ids)) and len(ids) >= 2
