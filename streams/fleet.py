"""The fleet circuit breaker, as a pure fold over the one stream of proposed commands.

Every remediation command passes through here (one partition, so one worker sees the whole
fleet) before it reaches `gpu.remediation`. When actions that take capacity away
(`xidstream.schemas.vocab.BREAKER_ACTIONS`: cordon, drain, reboot, replace, GPU reset, quarantine) would
start on more than `fleet_fraction` of the known nodes, and on at least `fleet_min_nodes`, within
`fleet_window_s`, one FLEET_STORM alert is raised and every further such command carries
``requires_approval: true`` until an operator resets the breaker (`xidstream breaker reset`, an
approval signed by an approver key). A reset forgets the window, so old starts cannot trip it again
(NVSentinel#450: stale events replayed after a reset).

Time: a command's `ts` is the time of its evidence, which a node's clock chose (threat T4). Given
`now` (when the fleet agent received the command, by the processor's clock), a stamp more than
`max_clock_skew_s` away from it, ahead or behind, is taken at `now`: commands stamped 11 minutes
apart in the future no longer fall into separate windows. Without `now` (the pure Engine, replays
and tests), event time is used as it is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timezone

from xidstream.schemas.models import Alert, Evidence, EvidenceEntry, RemediationCommand
from xidstream.schemas.vocab import BREAKER_ACTIONS, Classification, Severity
from xidstream.streams.policy import Policy
from xidstream.streams import rules as R
from xidstream.streams.rules import facts, rule_ref
from xidstream.streams.storms import command_storms, group_attrs, job_fault, note_groups, rebuild_node_groups, reset_groups

__all__ = ["FleetState", "fleet_step", "forget_released", "ReplayError", "FLEET_NODE", "RELEASED_KEPT"]

FLEET_NODE = "fleet"  # `node` of fleet-wide alerts (they name no GPU)


@dataclass
class FleetState:
    # node -> when it was last vouched for (epoch s): its GPU inventory, or the first record of
    # one of its GPU rows. A node not vouched for within `fleet_node_ttl_s` is forgotten (made-up
    # nodes used to grow the denominator for good).
    known_nodes: dict = field(default_factory=dict)
    # [ts, node, incident_id] of node-level command starts (a state written before the incident id
    # was kept has [ts, node]): the storm's alert names the incidents it groups
    starts: list = field(default_factory=list)
    # pod UID -> {GPU UUID: [ts, node, incident_id]}: application faults of known pods, per GPU.
    # Persisted as one table row per pod (streams.app), never inside the main row: a fleet-wide
    # burst of app faults from 9,700 pods grew the one row past Kafka's 1 MB and crash-looped the
    # worker, and with it every command fleet-wide.
    workload_gpus: dict = field(default_factory=dict)
    workload_swept_at: float | None = None  # when workloads that left the window were last dropped
    dirty_pods: set = field(default_factory=set)  # pods whose row changed since the app last wrote them
    tripped: bool = False
    tripped_at: float | None = None
    resets_used: list = field(default_factory=list)  # approval ids of the last resets: each resets once
    trips: int = 0
    held: int = 0
    # "kind=value" -> one blast-radius group (streams.storms): its members, starts, faults, storms.
    # Persisted as one table row per group (streams.app), never inside the main row.
    groups: dict = field(default_factory=dict)
    dirty_groups: set = field(default_factory=set)  # groups whose row changed since the app wrote them
    node_groups: dict = field(default_factory=dict)  # node -> {kind: value}: derived from `groups`
    # command_id -> when its message was sealed (epoch s; None when it was not sealed: no signing
    # key, or the pure Engine), the last RELEASED_KEPT commands passed on, oldest first: a fleet
    # message read twice (the consumer reading a partition again from its commit, at-least-once)
    # or written again (a replay: `xidstream.streams.handoff`) is not released, counted by the breaker or
    # grouped again. Persisted as one table row per command (streams.app), so a restarted worker
    # knows them too; the agent forgets those sealed longer ago than a hand-off is good for
    # (`forget_released`).
    released: dict = field(default_factory=dict)
    # The newest seal time of a command that fell off `released` by its count while a copy of its
    # message could still be opened: a sealed command from then or before that is not in
    # `released` cannot be told from a copy of one that was, and is refused (`ReplayError`).
    released_floor: float | None = None
    dirty_released: set = field(default_factory=set)  # ids added or dropped since the app last wrote them

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in _NOT_PERSISTED}

    @classmethod
    def from_dict(cls, data: dict) -> "FleetState":
        state = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k not in _NOT_PERSISTED})
        rebuild_node_groups(state)
        return state


# `released` is rows of its own (streams.app), never inside the main row
_NOT_PERSISTED = frozenset({"dirty_pods", "dirty_groups", "node_groups", "released", "dirty_released"})
# A rolling restart of the three-broker tier re-read 2 s of the fleet topic after the group
# coordinator moved and put a command on gpu.remediation twice; a re-read covers the records since
# the last commit (a quarter second, or the few seconds a coordinator's move holds commits). A copy
# written again can be opened for an hour (streams.handoff.MAX_AGE_S): an hour of a fleet-wide
# storm's commands over 4,000 nodes (four each) fits. Past it, the oldest fall off and what was
# sealed before them is refused (`released_floor`), so the bound costs at most a late command, never
# a second release.
RELEASED_KEPT = 16384


class ReplayError(ValueError):
    """A sealed command that cannot be told from a copy of one released before (the dead-letter
    record's error)."""


def breaker_time(ts: float, now: float | None, policy: Policy) -> float:
    """The time the breaker counts a command at: its own stamp, unless that is more than the
    clock-skew bound away from when it was received."""
    if now is None or abs(ts - now) <= policy.max_clock_skew_s:
        return ts
    return now


def _newest_incidents(starts: list) -> dict[str, str]:
    """Each node's incident of its newest start (the first of equal times): what a storm names per
    node. The newest only, so a row whose starts were compacted to each node's newest
    (streams.app.fleet_row) names the same ones."""
    newest: dict[str, list] = {}
    for s in starts:
        if len(s) > 2 and (s[1] not in newest or s[0] > newest[s[1]][0]):
            newest[s[1]] = s
    return {node: s[2] for node, s in newest.items()}


def forget_released(state: FleetState, before: float) -> None:
    """Forget the released commands sealed before `before` (epoch s): a copy of their message is
    refused by its age (`xidstream.streams.handoff.MAX_AGE_S`), so remembering them guards nothing. Oldest
    first, stopping at the first one sealed since (received in about the order they were sealed: one
    a little out of order is kept a little longer) or not sealed at all (kept by count only)."""
    released = state.released
    while released:
        cid, sealed_at = next(iter(released.items()))
        if sealed_at is None or sealed_at >= before:
            return
        del released[cid]
        state.dirty_released.add(cid)


def _release(state: FleetState, cmd: RemediationCommand, sealed_at: float | None) -> bool:
    """Whether `cmd` is passed on: not when it was released already (read twice, or a copy), and
    `ReplayError` when it cannot be told from a copy of one that fell off `released`."""
    released = state.released
    if cmd.command_id in released:
        return False
    floor = state.released_floor
    if sealed_at is not None and floor is not None and sealed_at <= floor:
        raise ReplayError(f"command {cmd.command_id} sealed at {sealed_at:.3f}, not after {floor:.3f}, the newest seal "
                          f"time of the commands this fleet agent no longer remembers ({RELEASED_KEPT:,} released "
                          f"since): it cannot be told from a copy of one released then, so it is not released")
    released[cmd.command_id] = sealed_at
    state.dirty_released.add(cmd.command_id)
    if len(released) > RELEASED_KEPT:
        cid, dropped = next(iter(released.items()))
        del released[cid]
        state.dirty_released.add(cid)
        if dropped is not None and (floor is None or dropped > floor):
            state.released_floor = dropped
    return True


def fleet_step(state: FleetState, msg: dict, policy: Policy, now: float | None = None,
               sealed_at: float | None = None) -> tuple[FleetState, list]:
    """msg: {"kind": "node_seen", "node", "ts"} | {"kind": "command", "command": RemediationCommand}
    | {"kind": "reset", "ts", "by"}. Returns outputs ("alert" | "command", record). `now`: when the
    message was received (epoch s, the processor's clock), or None to trust event time.
    `sealed_at`: when the message was sealed (`xidstream.streams.handoff`), None when it was not. A command
    already released is not released again; one sealed no later than a command forgotten by the
    count (`released_floor`) is refused with `ReplayError`.

    A reset here is already authenticated: the fleet agent takes one only with an approval signed
    by an approver key (`xidstream.streams.handoff`); the pure Engine resets in-process."""
    kind = msg.get("kind")
    if kind == "inventory":
        seen = breaker_time(float(msg["ts"]), now, policy)
        state.known_nodes[msg["node"]] = max(seen, state.known_nodes.get(msg["node"], seen))
        if policy.group_storms:
            note_groups(state, msg["node"], group_attrs(msg), seen)
        return state, []
    if kind == "node_seen":
        # A GPU row's first record: the node is known from then, for fleet_node_ttl_s, unless its
        # inventory (re-published every 6 h) keeps it known. With per-node identity on, only the
        # node itself can send records about it.
        seen = breaker_time(float(msg["ts"]), now, policy)
        state.known_nodes.setdefault(msg["node"], seen)
        if policy.group_storms:
            note_groups(state, msg["node"], group_attrs(msg), seen)
        return state, []
    if kind == "reset":
        used = msg.get("approval_id")
        if used is not None:
            if used in state.resets_used:
                return state, []  # the same approval again (a replayed reset): already applied
            state.resets_used = (state.resets_used + [used])[-64:]
        # The storm's incident resolves with the reset: without this alert its last word stayed
        # "open", and `xidstream incidents` showed the breaker tripped for as long as it read back.
        outputs = [("alert", _storm_reset_alert(state, msg, now))] if state.tripped else []
        state.tripped = False
        state.tripped_at = None
        state.starts = []
        reset_groups(state)
        return state, outputs
    if kind == "workload_fault":
        return state, _workload_fault(state, msg, policy, now)
    if kind == "job_fault":  # an application fault of a GPU whose pod belongs to a job (streams.storms)
        if not policy.group_storms:
            return state, []
        return state, [("alert", a) for a in job_fault(state, msg, breaker_time(float(msg.get("ts") or 0), now, policy),
                                                      policy)]
    if kind != "command":
        return state, []
    cmd: RemediationCommand = msg["command"]
    if not _release(state, cmd, sealed_at):
        return state, []  # this command read again, or a copy: already passed on (and counted)
    if cmd.action not in BREAKER_ACTIONS:
        return state, [("command", cmd)]
    ts = breaker_time(cmd.ts.timestamp(), now, policy)
    for node, seen in list(state.known_nodes.items()):
        if ts - seen > policy.fleet_node_ttl_s:
            del state.known_nodes[node]
    state.starts = [s for s in state.starts if ts - s[0] <= policy.fleet_window_s]
    if cmd.node not in state.known_nodes:
        # A node that never published a GPU inventory (or none within fleet_node_ttl_s) is not a
        # GPU node this processor manages: a record naming it (kube-control-plane-1, a typo, a
        # forgery) may still raise an alert, but taking capacity away needs a person. Not counted
        # as a start either: made-up nodes must not trip the breaker for the real fleet.
        state.held += 1
        return state, [("command", cmd.model_copy(update={
            "requires_approval": True,
            "reason": f"{cmd.reason} [held: node {cmd.node} has published no GPU inventory]"}))]
    nodes = {s[1] for s in state.starts}
    outputs: list = []
    if not state.tripped and cmd.node not in nodes:
        would = len(nodes) + 1
        known = max(len(state.known_nodes), 1)
        if would > policy.fleet_fraction * known and would >= policy.fleet_min_nodes:
            state.tripped, state.tripped_at = True, ts
            state.trips += 1
            members = sorted({**_newest_incidents(state.starts), cmd.node: cmd.incident_id}.items())
            outputs.append(("alert", _storm_alert(state, cmd, sorted(nodes | {cmd.node}), known, policy, members)))
    state.starts.append([ts, cmd.node, cmd.incident_id])
    # Storms by blast radius come after the fleet-wide count and only ever add a hold (streams.storms).
    grouped: list[str] = []
    if policy.group_storms:
        attrs = group_attrs(msg)
        note_groups(state, cmd.node, attrs, ts)
        grouped, alerts = command_storms(state, cmd, attrs, ts, policy)
        outputs.extend(("alert", a) for a in alerts)
    if state.tripped:
        state.held += 1
        cmd = cmd.model_copy(update={"requires_approval": True,
                                     "reason": f"{cmd.reason} [held: fleet circuit breaker tripped]"})
    elif grouped:
        state.held += 1
        cmd = cmd.model_copy(update={"requires_approval": True,
                                     "reason": f"{cmd.reason} [held: storm in {', '.join(grouped)}]"})
    outputs.append(("command", cmd))
    return state, outputs


def _storm_id(state: FleetState) -> str:
    return hashlib.sha256(f"fleet-storm:{state.trips}:{state.tripped_at}".encode()).hexdigest()[:24]


def _storm_reset_alert(state: FleetState, msg: dict, now: float | None) -> Alert:
    """The storm's incident, resolved by `xidstream breaker reset` (an approver's signed reset)."""
    inc = _storm_id(state)
    when = msg.get("ts") if isinstance(msg.get("ts"), (int, float)) else (now if now is not None else state.tripped_at)
    ts = datetime.fromtimestamp(float(when or 0), timezone.utc)
    who = f" by {msg['by']}" if msg.get("by") else ""
    summary = (f"fleet circuit breaker reset{who} (approval {msg.get('approval_id') or '-'}): node-level commands "
               f"are no longer held")
    return Alert(
        ts=ts, node=FLEET_NODE, alert_id=f"{inc}-reset-{msg.get('approval_id') or 'local'}"[:128], incident_id=inc,
        gpu_uuid=None, pci_bus_id=None, classification=Classification.FLEET_STORM, severity=Severity.critical,
        state="resolved", summary=summary,
        rule=rule_ref(R.FLEET_BREAKER_RESET, facts(approval_id=msg.get("approval_id"), by=msg.get("by"))),
        evidence=Evidence(node=FLEET_NODE, timeline=[EvidenceEntry(ts=ts, kind="note", summary=summary,
                                                                   data={"approval_id": msg.get("approval_id")})]))


def _storm_alert(state: FleetState, cmd: RemediationCommand, nodes: list, known: int, policy: Policy,
                 members: list) -> Alert:
    inc = _storm_id(state)
    # Stamped with the evidence time of the command that tripped it, like every other alert (a
    # replay of last week's storm reads as last week's); the window itself ran on the bounded time.
    ts = cmd.ts
    summary = (f"FLEET STORM: actions that take capacity away on {len(nodes)} of {known} known nodes within "
               f"{policy.fleet_window_s / 60:.0f} min (limit {policy.fleet_fraction:.0%}, at least "
               f"{policy.fleet_min_nodes}); every further such command needs approval until "
               f"`xidstream breaker reset`")
    return Alert(
        ts=ts, node=FLEET_NODE, alert_id=f"{inc}-storm", incident_id=inc, gpu_uuid=None, pci_bus_id=None,
        classification=Classification.FLEET_STORM, severity=Severity.critical, summary=summary,
        rule=rule_ref(R.FLEET_STORM, facts(nodes=len(nodes), known_nodes=known, fleet_window_s=policy.fleet_window_s,
                                           fleet_fraction=policy.fleet_fraction,
                                           fleet_min_nodes=policy.fleet_min_nodes)),
        evidence=Evidence(node=FLEET_NODE, timeline=[EvidenceEntry(ts=ts, kind="note", summary=summary,
                                                                   data={"nodes": nodes, "known_nodes": known,
                                                                         "trigger_command": cmd.command_id,
                                                                         # each node's newest incident in the
                                                                         # window: what the storm groups
                                                                         "members": [{"node": n, "incident_id": i}
                                                                                     for n, i in members]})]),
        recommended_steps=["Look for a common cause (a driver or firmware rollout, a bad image) before approving any held command.",
                           "Approve held commands one by one, or reset the breaker with `xidstream breaker reset`."],
    )


# GPUs remembered per pod: a job larger than this (64: eight 8-GPU nodes) already says that the
# fault follows the workload; more would only grow its row and its alert.
WORKLOAD_GPUS_KEPT = 64
_WHERE_SHOWN = 8


def _workload_fault(state: FleetState, msg: dict, policy: Policy, now: float | None = None) -> list:
    """One pod's application fault on one GPU. When the same workload has faulted two or more GPUs
    within the suspect window, the fault follows the workload, not a GPU: say so once per new GPU
    (an APP_FAULT update on the incident of the GPU just hit; it never carries a command).

    Work per fault is bounded: only this pod's GPUs are pruned here, and the pods that left the
    window are dropped in one sweep every quarter window (it was every pod at every fault)."""
    pod, gpu = msg.get("pod_uid"), msg.get("gpu_uuid")
    if not pod or not gpu:
        return []
    ts = breaker_time(float(msg.get("ts") or 0), now, policy)
    window = policy.suspect_window_s
    if state.workload_swept_at is None or ts - state.workload_swept_at >= window / 4 or ts < state.workload_swept_at:
        for p in list(state.workload_gpus):  # forget what left the window, so the table stays small
            gpus = {g: v for g, v in state.workload_gpus[p].items() if ts - v[0] <= window}
            if len(gpus) != len(state.workload_gpus[p]):
                state.dirty_pods.add(p)
                if gpus:
                    state.workload_gpus[p] = gpus
                else:
                    del state.workload_gpus[p]
        state.workload_swept_at = ts
    gpus = {g: v for g, v in state.workload_gpus.get(pod, {}).items() if ts - v[0] <= window}
    new_gpu = gpu not in gpus
    gpus[gpu] = [ts, msg.get("node"), msg.get("incident_id")]
    if len(gpus) > WORKLOAD_GPUS_KEPT:  # the newest by time, whichever order they came in
        gpus = dict(sorted(gpus.items(), key=lambda kv: (kv[1][0], kv[0]))[-WORKLOAD_GPUS_KEPT:])
    state.workload_gpus[pod] = gpus
    state.dirty_pods.add(pod)
    if not new_gpu or len(gpus) < 2 or not msg.get("incident_id"):
        return []
    when = datetime.fromtimestamp(ts, tz=timezone.utc)
    shown = sorted(gpus.items())[:_WHERE_SHOWN]
    where = ", ".join(f"{g} on {v[1]}" for g, v in shown) + (
        f" and {len(gpus) - len(shown)} more" if len(gpus) > len(shown) else "")
    many = f"{len(gpus)}+" if len(gpus) >= WORKLOAD_GPUS_KEPT else str(len(gpus))
    summary = (f"the fault follows the workload: pod {pod} hit application-class Xids on {many} GPUs "
               f"within {window / 60:.0f} min ({where}); look at the workload, not the GPUs")
    inc = msg["incident_id"]
    alert_id = hashlib.sha256(f"follows:{inc}:{pod}:{len(gpus)}".encode()).hexdigest()[:24]
    return [("alert", Alert(
        ts=when, node=msg.get("node") or FLEET_NODE, alert_id=alert_id, incident_id=inc, gpu_uuid=gpu, pci_bus_id=None,
        classification=Classification.APP_FAULT, severity=Severity.info, state="updated", summary=summary,
        rule=rule_ref(R.FLEET_WORKLOAD_FOLLOWS, facts(gpus=len(gpus), xid=msg.get("xid"), window_s=window)),
        evidence=Evidence(node=msg.get("node") or FLEET_NODE, gpu_uuid=gpu, pod_uids=[pod],
                          timeline=[EvidenceEntry(ts=when, kind="workload", summary=summary,
                                                  data={"pod_uid": pod, "gpus": sorted(gpus)[:_WHERE_SHOWN],
                                                        "gpu_count": len(gpus)})]),
        recommended_steps=["Record the fault with PID, GPU UUID, pod UID and the raw kernel line; let the workload restart itself.",
                           "The same pod faulted several GPUs: check its code, inputs and CUDA/driver versions before suspecting the hardware."],
    ))]
