"""Storms by blast radius: the fleet agent's groups of nodes, as pure functions over `FleetState`.

A fleet-wide count (streams.fleet) misses what one cause does to one part of the fleet: one job's
teardown logs Xid 45 on every node it ran on (77 nodes across 11 racks, NVSentinel#1629), and an
NVL72 rack or NVLink domain fails as one (NVSentinel#1275, #367). So each fleet message carries the
groups its GPU row is in (`xidstream.streams.routing.fan_out`): its node's **rack** (a Node label) and
**driver** version (the GPU inventory), its NVLink **domain** (``fabric_cluster_uuid/clique_id``
from gpu.counters) and the **job** of the newest pod that held it (a job label or the pod's
controller, ``namespace/name``). Per group, within `fleet_window_s`:

- node-level plans (`xidstream.schemas.vocab.BREAKER_ACTIONS`) starting on at least `fleet_min_nodes` of the
  group's nodes *and* on more than `group_fraction` of its known nodes open one FLEET_STORM incident
  for the group (its members listed, later ones as updates), and every further node-level command
  of the group's members is held for approval until `xidstream breaker reset`;
- one job's application faults on at least `job_storm_min_nodes` nodes are one APP_FAULT incident
  (severity warning, no command), its members listed, later members as updates of it.

What a node controls here: everything it says about its own groups (a rack label is set by whoever
administers the Node, a job label by whoever runs the pod, a driver and a fabric id by the node's
own collector). So grouping only ever adds holds and alerts: it never releases a command the breaker
held and never makes one (the fleet-wide breaker stays as the backstop). A node lying about its
groups can (a) count once, per kind, in a group it is not in: one node per single-valued kind (a
node has one rack, driver and domain; a new value moves it), which makes that group's storm one node
harder to reach (the breaker still counts it) or, with `fleet_min_nodes` liars, hold the commands
of that group's real members for a person (the safe direction); (b) add itself to a job's incident
as a member (an alert's list, no command). Only nodes the breaker knows (a GPU inventory) count.

State is bounded: `GROUPS_KEPT` groups per kind (the least recently touched without an open storm
goes first), `MEMBERS_KEPT` members, starts and faults per group (the newest kept), group names at
`GROUP_VALUE_MAX` characters (longer ones are ignored, not cut: a cut name could merge two groups).
The app persists each group as a row of its own (`group:<kind>=<value>`), like the pods' rows, so
the breaker's main row does not grow with the groups.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from xidstream.schemas.limits import JOB_MAX
from xidstream.streams import rules as R
from xidstream.streams.rules import facts, rule_ref
from xidstream.schemas.models import Alert, Evidence, EvidenceEntry, RemediationCommand
from xidstream.schemas.vocab import Classification, Severity
from xidstream.streams.policy import Policy

__all__ = ["KINDS", "GROUPS_KEPT", "MEMBERS_KEPT", "GROUP_VALUE_MAX", "group_attrs", "note_groups",
           "command_storms", "job_fault", "reset_groups", "rebuild_node_groups"]

KINDS = ("job", "rack", "domain", "driver")
_SINGLE = ("rack", "domain", "driver")  # a node is in one group of these kinds at a time
# 512 groups per kind: a 10,000-node fleet has about 560 racks of 18; jobs beyond it are the least
# recently seen. 256 members per group: an NVL72 domain has 18 nodes, a rack tens; a job on more
# nodes is listed by its newest 256 (its count says how many). At 253-character node names a group's
# row stays under 100 KB.
GROUPS_KEPT = 512
MEMBERS_KEPT = 256
GROUP_VALUE_MAX = JOB_MAX  # the longest name any kind has (namespace/name of a job: 317)
_FLEET_NODE = "fleet"


def _key(kind: str, value: str) -> str:
    return f"{kind}={value}"


def group_attrs(msg: dict) -> dict[str, str]:
    """The groups a fleet message names, each a non-empty string of at most GROUP_VALUE_MAX
    characters under a known kind; anything else is ignored (a node chose it)."""
    raw = msg.get("groups")
    if not isinstance(raw, dict):
        return {}
    return {k: v for k in KINDS if isinstance(v := raw.get(k), str) and 0 < len(v) <= GROUP_VALUE_MAX}


def _new_group(state, kind: str, value: str, ts: float) -> dict:
    key = _key(kind, value)
    same = [k for k, g in state.groups.items() if g["kind"] == kind]
    if len(same) >= GROUPS_KEPT:
        # the least recently touched goes, one without an open storm first (a storm's holds are the
        # safe direction and last until a reset; the breaker stays as the backstop if one goes)
        # and one of at most one member before a real group of many (one node can make any number of
        # one-member groups, e.g. a pod per job label; it cannot make many-member ones)
        drop = min(same, key=lambda k: (state.groups[k]["storm"] is not None or state.groups[k]["fault_storm"] is not None,
                                        len(state.groups[k]["members"]) + len(state.groups[k]["faults"]) > 1,
                                        state.groups[k]["touched"], k))
        _forget(state, drop)
    g = {"kind": kind, "value": value, "members": {}, "starts": {}, "faults": {}, "storm": None,
         "fault_storm": None, "touched": ts}
    state.groups[key] = g
    return g


def _forget(state, key: str) -> None:
    g = state.groups.pop(key)
    state.dirty_groups.add(key)
    if g["kind"] in _SINGLE:
        for node in g["members"]:
            if state.node_groups.get(node, {}).get(g["kind"]) == g["value"]:
                del state.node_groups[node][g["kind"]]


def _newest(items: dict) -> dict:
    """`items` (node -> [ts, ...] or ts) bounded to the MEMBERS_KEPT newest (by time, then name)."""
    if len(items) <= MEMBERS_KEPT:
        return items
    when = (lambda kv: (kv[1][0], kv[0])) if isinstance(next(iter(items.values())), list) else (lambda kv: (kv[1], kv[0]))
    return dict(sorted(items.items(), key=when)[-MEMBERS_KEPT:])


def note_groups(state, node: str, attrs: dict[str, str], ts: float) -> None:
    """`node` is in the groups `attrs` names, as of `ts`; for a single-valued kind it leaves its
    previous group (a node has one rack)."""
    for kind, value in attrs.items():
        key = _key(kind, value)
        if kind in _SINGLE:
            mine = state.node_groups.setdefault(node, {})
            old = mine.get(kind)
            if old is not None and old != value and _key(kind, old) in state.groups:
                left = state.groups[_key(kind, old)]
                left["members"].pop(node, None)
                state.dirty_groups.add(_key(kind, old))
                if not left["members"] and not left["starts"] and left["storm"] is None:
                    # a node naming one new rack after another left empty groups behind, which
                    # pushed the real racks out of the bounded table (review): gone when empty
                    _forget(state, _key(kind, old))
            mine[kind] = value
        g = state.groups.get(key) or _new_group(state, kind, value, ts)
        if g["members"].get(node, float("-inf")) < ts:
            g["members"][node] = ts
            g["members"] = _newest(g["members"])
            g["touched"] = max(g["touched"], ts)
            state.dirty_groups.add(key)


def _size(state, g: dict, ts: float, policy: Policy) -> int:
    """The group's known nodes: members the breaker knows and saw within fleet_node_ttl_s."""
    return sum(1 for n, seen in g["members"].items()
               if n in state.known_nodes and ts - seen <= policy.fleet_node_ttl_s)


def _gid(what: str, kind: str, value: str, since: float) -> str:
    return hashlib.sha256(f"{what}:{kind}:{value}:{since}".encode()).hexdigest()[:24]


def command_storms(state, cmd: RemediationCommand, attrs: dict[str, str], ts: float,
                   policy: Policy) -> tuple[list[str], list]:
    """A node-level command of a known node, at breaker time `ts`: (the groups whose storm holds
    it, as "kind value", and the storm alerts to send). Never releases a command: the caller only
    ever adds requires_approval."""
    held: list[str] = []
    alerts: list = []
    for kind, value in attrs.items():
        key = _key(kind, value)
        g = state.groups[key]  # note_groups made it
        starts = {n: v for n, v in g["starts"].items() if ts - v[0] <= policy.fleet_window_s}
        new = cmd.node not in starts
        starts[cmd.node] = [ts, cmd.incident_id]
        g["starts"] = starts = _newest(starts)
        g["touched"] = max(g["touched"], ts)
        state.dirty_groups.add(key)
        storm = g["storm"]
        if storm is None:
            size = max(_size(state, g, ts, policy), len(starts))
            if len(starts) >= policy.fleet_min_nodes and len(starts) > policy.group_fraction * size:
                since = min(v[0] for v in starts.values())
                storm = g["storm"] = {"id": _gid("group-storm", kind, value, since), "since": since,
                                      "listed": len(starts), "size": size}
                alerts.append(_storm_alert(g, cmd, starts, "open", policy))
        elif new and storm["listed"] < MEMBERS_KEPT:
            storm["listed"] += 1
            alerts.append(_storm_alert(g, cmd, starts, "updated", policy))
        if storm is not None and (cmd.node in g["members"] or cmd.node in starts):
            held.append(f"{kind} {value}")
    return held, alerts


# members listed in one alert (the newest; the alert's count says how many): each update of a
# job storm lists them, so the alerts of one storm grow linearly, not with the square of its size
MEMBERS_LISTED = 128


def _members(items: dict) -> list[dict]:
    shown = sorted(items.items(), key=lambda kv: (kv[1][0], kv[0]))[-MEMBERS_LISTED:]
    return [{"node": n, "incident_id": v[1]} for n, v in sorted(shown)]


def _storm_alert(g: dict, cmd: RemediationCommand, starts: dict, state: str, policy: Policy) -> Alert:
    storm = g["storm"]
    inc = storm["id"]
    summary = (f"FLEET STORM in {g['kind']} {g['value']}: actions that take capacity away on {len(starts)} of its "
               f"{storm['size']} known nodes within {policy.fleet_window_s / 60:.0f} min (more than "
               f"{policy.group_fraction:.0%}, at least {policy.fleet_min_nodes}); every further such command of "
               f"its nodes needs approval until `xidstream breaker reset`")
    data = {"group_kind": g["kind"], "group": g["value"], "nodes": sorted(starts), "known_nodes": storm["size"],
            "trigger_command": cmd.command_id, "members": _members(starts)}
    return Alert(
        # numbered by the storm's own count of alerts: the window's count can fall and repeat an id
        ts=cmd.ts, node=_FLEET_NODE, alert_id=f"{inc}-{storm['listed']}", incident_id=inc, gpu_uuid=None, pci_bus_id=None,
        classification=Classification.FLEET_STORM, severity=Severity.critical, state=state, summary=summary,
        rule=rule_ref(R.FLEET_GROUP_STORM, facts(group_kind=g["kind"], nodes=len(starts), known_nodes=storm["size"],
                                                 fleet_window_s=policy.fleet_window_s,
                                                 group_fraction=policy.group_fraction,
                                                 fleet_min_nodes=policy.fleet_min_nodes)),
        evidence=Evidence(node=_FLEET_NODE, timeline=[EvidenceEntry(ts=cmd.ts, kind="note", summary=summary, data=data)]),
        recommended_steps=[f"Look for what the {g['kind']} shares (a power or cooling fault, an NVLink switch tray, a "
                           "driver rollout) before approving any held command.",
                           "Approve held commands one by one, or reset with `xidstream breaker reset`."])


def job_fault(state, msg: dict, ts: float, policy: Policy) -> list:
    """One application fault of a GPU whose newest pod belongs to a job. When the job's faults
    span `job_storm_min_nodes` nodes within `fleet_window_s`, one APP_FAULT incident for the job
    (warning: it is the workload's, not the GPUs'; FLEET_STORM stays the class of incidents that
    hold commands) lists them; each later node is an update of it. Never a command."""
    job, node = group_attrs(msg).get("job"), msg.get("node")
    if not job or not isinstance(node, str) or node not in state.known_nodes:
        return []
    key = _key("job", job)
    g = state.groups.get(key) or _new_group(state, "job", job, ts)
    faults = {n: v for n, v in g["faults"].items() if ts - v[0] <= policy.fleet_window_s}
    if not faults:
        g["fault_storm"] = None  # the job's last storm left the window: a new one is a new incident
    new = node not in faults
    faults[node] = [ts, msg.get("incident_id")]
    g["faults"] = faults = _newest(faults)
    g["touched"] = max(g["touched"], ts)
    state.dirty_groups.add(key)
    fs = g["fault_storm"]
    if not new:
        return []
    if fs is None:
        if len(faults) < policy.job_storm_min_nodes:
            return []
        since = min(v[0] for v in faults.values())
        fs = g["fault_storm"] = {"id": _gid("job-faults", "job", job, since), "since": since, "listed": len(faults)}
        how = "open"
    elif fs["listed"] >= MEMBERS_KEPT:
        return []
    else:
        fs["listed"] += 1
        how = "updated"
    when = datetime.fromtimestamp(ts, tz=timezone.utc)
    summary = (f"job {job}: application-class Xids on {len(faults)} nodes within {policy.fleet_window_s / 60:.0f} min "
               f"(at least {policy.job_storm_min_nodes}): one cause, the job's (a teardown logs Xid 45 on every "
               f"rank); no node-level action")
    data = {"group_kind": "job", "group": job, "node_count": len(faults), "xid": msg.get("xid"),
            "members": _members(faults)}
    return [Alert(
        ts=when, node=_FLEET_NODE, alert_id=f"{fs['id']}-{fs['listed']}", incident_id=fs["id"], gpu_uuid=None,
        pci_bus_id=None, classification=Classification.APP_FAULT, severity=Severity.warning, state=how,
        summary=summary,
        rule=rule_ref(R.FLEET_JOB_FAULTS, facts(nodes=len(faults), xid=msg.get("xid"),
                                                fleet_window_s=policy.fleet_window_s,
                                                job_storm_min_nodes=policy.job_storm_min_nodes)),
        evidence=Evidence(node=_FLEET_NODE, timeline=[EvidenceEntry(ts=when, kind="workload", summary=summary, data=data)]),
        recommended_steps=["Look at the job (its teardown, code, inputs, CUDA/driver versions) before suspecting the GPUs."])]


def reset_groups(state) -> None:
    """An approver's breaker reset ends every group storm and forgets their windows (as the
    breaker forgets its own); members are kept."""
    for key, g in state.groups.items():
        if g["storm"] is not None or g["starts"]:
            g["storm"], g["starts"] = None, {}
            state.dirty_groups.add(key)


def rebuild_node_groups(state) -> None:
    """Each node's single-valued groups, from the groups' members (the newest wins): derived, not
    persisted."""
    newest: dict[tuple[str, str], float] = {}
    state.node_groups = {}
    for g in state.groups.values():
        if g["kind"] not in _SINGLE:
            continue
        for node, seen in g["members"].items():
            if seen >= newest.get((node, g["kind"]), float("-inf")):
                newest[(node, g["kind"])] = seen
                state.node_groups.setdefault(node, {})[g["kind"]] = g["value"]
