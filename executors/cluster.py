"""The cluster executor's actions (`xidstream execute --scope cluster`): API calls only.

Each action reads what it needs, then either describes what it would do (dry run: nothing is
written, not even an Event) or does it and records an Event on the Node. Each returns
(outcome, detail); the caller (executors.runner) wraps that into a RemediationResult.

Ownership: what xidstream changes on a Node is marked, so UNCORDON_NODE and RELEASE_GPU undo only
that: the `xidstream.io/gpu-fault` NoSchedule taint and the `xidstream.io/cordon` annotation (JSON:
every incident holding the cordon under `incidents`, with its command, GPU and time; the oldest one
also as `incident`/`command`/`gpu`/`at`, the single-incident format earlier versions wrote and still
read; and whether the node was already unschedulable before us). UNCORDON_NODE removes only its own
incident and uncordons when no other incident holds the cordon.

The Node condition `GPUHealthy` (node-problem-detector's convention) is False while an incident
that quarantined a GPU, cordoned or marked the node holds it (the `xidstream.io/gpu-incidents`
annotation names them), and True again once the closing step (UNCORDON_NODE, RELEASE_GPU) of the
last one succeeded.

REPLACE_NODE hands the node to the system that replaces nodes in this cluster, chosen by
--replace-backend (executors.replace): a label (the default), the Machine's Cluster API
remediation annotation, the deletion of Karpenter's NodeClaim, or the GPUHealthy condition.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from datetime import datetime, timezone
from typing import Any

from lightkube import ApiError, Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from xidstream.executors.gate import DRY_RUN_PREFIX
from xidstream.executors.kube import (device_taint_rule_resource, discover_version, is_daemonset_pod, is_mirror_pod, kept_by_drain,
                            node_or_none, pods_on_node, record_event)
from xidstream.executors.replace import DEFAULT_REPLACE_BACKEND, REPLACE_BACKENDS, ClusterApiReplace, KarpenterReplace
from xidstream.schemas.base import plain_text
from xidstream.schemas.models import RemediationCommand
from xidstream.schemas.vocab import Action

__all__ = ["ClusterActions", "CONDITION_TYPE", "CONDITION_ANNOTATION", "condition_for", "TAINT_KEY", "CORDON_ANNOTATION", "REPLACE_LABEL", "quarantine_rule_name",
           "REPLACEMENT_REQUESTED", "REPLACEMENT_CONDITION_TYPE", "replacement_condition_for",
           "DRA_DRIVER", "MANAGED_NODE_LABELS", "CONTROL_PLANE_LABELS", "unmanaged_reason"]

log = logging.getLogger(__name__)

TAINT_KEY = "xidstream.io/gpu-fault"
CORDON_ANNOTATION = "xidstream.io/cordon"
REPLACE_LABEL = "xidstream.io/replace"
QUARANTINE_LABEL_PREFIX = "gpu-quarantine.xidstream.io/"  # advisory fallback: <prefix>gpu-<index>
# NVIDIA's DRA driver publishes one ResourceSlice pool per node (named after it) with devices
# named gpu-<index>; a DeviceTaintRule selecting driver + pool + device hits exactly one GPU.
DRA_DRIVER = "gpu.nvidia.com"

Outcome = tuple[str, str]

# Which nodes this executor may act on: GPU nodes, as the chart's DaemonSet selects them (a node
# with EITHER label: the GPU operator's / device plugin's, or Node Feature Discovery's NVIDIA PCI
# vendor label), and never a control-plane node. A signed command names its node, but what the
# processor signs rests on what nodes sent (threats T1-T3): a command for kube-control-plane-1,
# or for a node that runs no GPU, is refused here whatever signed it.
MANAGED_NODE_LABELS = ("nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present")
CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


def unmanaged_reason(node: Any, managed_labels: tuple[str, ...]) -> str | None:
    """Why this executor must not touch `node` (None: it is a managed GPU node)."""
    labels = node.metadata.labels or {}
    name = node.metadata.name
    role = [k for k in CONTROL_PLANE_LABELS if k in labels]
    if role:
        return f"node {name} is a control-plane node (label {role[0]}): xidstream never acts on one"
    if managed_labels and not any(labels.get(k, "").lower() not in ("", "false") for k in managed_labels):
        return (f"node {name} is not a managed GPU node: it has none of the labels {', '.join(managed_labels)} "
                f"(--managed-node-label)")
    return None


def _now() -> str:
    return _rfc3339(datetime.now(timezone.utc))


def quarantine_rule_name(node: str, gpu: str) -> str:
    """A DNS-1123 name, stable per (node, GPU), so QUARANTINE is idempotent and RELEASE finds it."""
    digest = hashlib.sha256(f"{node}/{gpu}".encode()).hexdigest()[:10]
    base = re.sub(r"[^a-z0-9-]", "-", node.lower())[:40].strip("-")
    return f"xidstream-quarantine-{base}-{digest}"


def _label_value(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._") or "x"


def _cordon_holders(node: Any) -> tuple[dict, dict[str, dict]]:
    """The `xidstream.io/cordon` annotation and the incidents holding the cordon, by incident id.
    Earlier versions wrote one incident (``{"incident": ..., "command": ..., "gpu": ..., "at": ...}``):
    that incident is the one holder. An unreadable annotation holds nothing."""
    raw = (node.metadata.annotations or {}).get(CORDON_ANNOTATION)
    try:
        note = json.loads(raw) if raw else {}
    except ValueError:
        note = {}
    if not isinstance(note, dict):
        note = {}
    held = note.get("incidents")
    holders = {str(k): (v if isinstance(v, dict) else {}) for k, v in held.items()} if isinstance(held, dict) else {}
    if not holders and note.get("incident"):
        holders = {str(note["incident"]): {k: note.get(k) for k in ("command", "gpu", "at")}}
    return note, holders


def _cordon_note(holders: dict[str, dict], was_unschedulable: bool) -> str:
    """The annotation: every holder under `incidents`; the oldest holder also in the single-incident
    fields earlier versions read (incident, command, gpu, at)."""
    first_id, first = min(holders.items(), key=lambda kv: str(kv[1].get("at") or ""))
    return json.dumps({"incident": first_id, "command": first.get("command"), "gpu": first.get("gpu"),
                       "at": first.get("at"), "was_unschedulable": was_unschedulable, "incidents": holders},
                      sort_keys=True)


def _incidents(holders: dict[str, dict]) -> str:
    return ", ".join(sorted(holders))


class ClusterActions:
    def __init__(self, client: Client, *, drain_timeout: float = 120.0, eviction_retry: float = 2.0,
                 managed_labels: tuple[str, ...] = MANAGED_NODE_LABELS, keep_namespaces: tuple[str, ...] = (),
                 replace_backend: str = DEFAULT_REPLACE_BACKEND, replace_client: Client | None = None) -> None:
        """`replace_backend`: where REPLACE_NODE hands the node over (executors.replace);
        `replace_client`: the API server of the Cluster API Machines when it is not `client`'s (a
        management cluster)."""
        if replace_backend not in REPLACE_BACKENDS:
            raise ValueError(f"replace backend {replace_backend!r}: not one of {', '.join(REPLACE_BACKENDS)}")
        self.client = client
        self.replace_backend = replace_backend
        self._replacer = {"cluster-api": lambda: ClusterApiReplace(replace_client or client),
                          "karpenter": lambda: KarpenterReplace(client)}.get(replace_backend, lambda: None)()
        self.keep_namespaces = tuple(keep_namespaces)
        self.managed_labels = tuple(managed_labels)
        self.drain_timeout = drain_timeout
        self.eviction_retry = eviction_retry
        self._dtr_version: str | None | bool = False  # False: not discovered yet

    # -- dispatch ----------------------------------------------------------------------------
    def execute(self, cmd: RemediationCommand, dry_run: bool) -> Outcome:
        node = node_or_none(self.client, cmd.node)
        if node is None:
            return "failed", f"node {cmd.node} does not exist on the API server; nothing was done"
        why = unmanaged_reason(node, self.managed_labels)
        if why is not None:
            return "refused", f"refused: {why}; nothing was done"
        handler = {
            Action.RECORD: self._record, Action.CORDON_NODE: self._cordon, Action.UNCORDON_NODE: self._uncordon,
            Action.DRAIN_NODE: self._drain, Action.QUARANTINE_GPU: self._quarantine,
            Action.RELEASE_GPU: self._release, Action.REPLACE_NODE: self._replace,
        }[cmd.action]
        outcome, detail = handler(cmd, node, dry_run)
        # A closing step is the processor saying the incident resolved: its hold on the condition
        # goes whatever became of the step (an UNCORDON refused for someone else's cordon, a
        # release that found nothing to delete), or the condition stayed False for good.
        if not dry_run and ((outcome == "succeeded" and cmd.action in CONDITION_REASONS) or cmd.action in _CLOSING):
            detail += self._condition(cmd)
        return outcome, detail

    # -- the Node condition ----------------------------------------------------------------------
    # node-problem-detector's convention: a Node condition that `kubectl get/describe node`, the
    # cluster autoscaler and other remediators read without a Kafka client. The incidents that hold
    # it are kept in an annotation (like the cordon's holders): two incidents on one node's GPUs
    # both hold it, and it turns True again only when the last one closed.
    def _condition(self, cmd: RemediationCommand) -> str:
        """Record this command's incident on the node's GPUHealthy condition; returns what to add to
        the result's detail. Never fails the action it follows (the action was done)."""
        try:
            return self._hold_condition(cmd)
        except ApiError as exc:
            log.warning("could not update condition %s on node %s: %s", CONDITION_TYPE, cmd.node, exc)
            return f"; condition {CONDITION_TYPE} not updated: HTTP {exc.status.code}: {exc.status.message}"

    def _hold_condition(self, cmd: RemediationCommand) -> str:
        def act(n: Any) -> str:
            held = _condition_holders(n)
            if cmd.action in _CLOSING:
                if held.pop(cmd.incident_id, None) is None:
                    return ""  # this incident never held it (or it was cleared already)
            else:
                if cmd.incident_id in held and held[cmd.incident_id].get("action") == self._reason(cmd.action):
                    return ""
                prior = held.get(cmd.incident_id, {})
                # the strongest thing done for the incident names it (a cordon outranks a quarantine)
                reason = max((self._reason(cmd.action), prior.get("action") or ""), key=lambda r: _REASON_RANK.get(r, 0))
                held[cmd.incident_id] = {"gpu": cmd.gpu_uuid or cmd.pci_bus_id, "gpu_index": cmd.gpu_index,
                                         "action": reason, "at": prior.get("at") or _now(),
                                         "why": plain_text(cmd.reason, 200)}
            self._patch_node(n, {"metadata": {"annotations": {
                CONDITION_ANNOTATION: json.dumps(held, sort_keys=True) if held else None}}})
            cond = condition_for(held, _condition_of(n))
            conds = [cond]
            # the condition backend's own condition: written once it is in use, and kept up to date
            # (back to False) on a node that has it, whichever backend runs now
            current = _condition_of(n, REPLACEMENT_CONDITION_TYPE)
            if self.replace_backend == "condition" or current is not None:
                conds.append(replacement_condition_for(held, current))
            self.client.patch(Node.Status, cmd.node, {"status": {"conditions": conds}},
                              patch_type=PatchType.STRATEGIC)
            return "".join(f"; condition {c['type']}={c['status']} ({c['reason']})" for c in conds)

        return self._retrying(cmd, act, gone=f"; condition {CONDITION_TYPE} not updated: node {cmd.node} is gone",
                              changing=f"; condition {CONDITION_TYPE} not updated: node {cmd.node} kept changing "
                                       f"(5 conflicts)")

    def _reason(self, action: Action) -> str:
        """The condition's reason while `action` holds it; the condition backend's REPLACE_NODE says
        ReplacementRequested, the reason its consumers are pointed at (docs/operations.md)."""
        if action == Action.REPLACE_NODE and self.replace_backend == "condition":
            return REPLACEMENT_REQUESTED
        return CONDITION_REASONS[action]

    def _event(self, node: Any, cmd: RemediationCommand, reason: str, message: str, warning: bool = True) -> None:
        record_event(self.client, node, reason=reason, type_="Warning" if warning else "Normal",
                     message=f"xidstream {cmd.action.value} (incident {cmd.incident_id}, command {cmd.command_id}"
                             f"{', GPU ' + cmd.gpu_uuid if cmd.gpu_uuid else ''}): {message}")

    def _patch_node(self, node: Any, patch: dict) -> Any:
        """A merge patch carrying the resourceVersion we read: a concurrent change makes it fail
        with 409 instead of overwriting someone else's taints."""
        patch.setdefault("metadata", {})["resourceVersion"] = node.metadata.resourceVersion
        return self.client.patch(Node, node.metadata.name, patch, patch_type=PatchType.MERGE)

    def _retrying(self, cmd: RemediationCommand, fn: Any, *, gone: Any = None, changing: Any = None) -> Any:
        """`fn(node)` on the node as read now, again on a conflict (409: it changed since the read),
        up to 5 times; `gone` / `changing` are what to answer when the node disappears or keeps
        changing (an action's failed outcome by default)."""
        for _ in range(5):
            node = node_or_none(self.client, cmd.node)
            if node is None:
                return gone if gone is not None else ("failed", f"node {cmd.node} disappeared while acting")
            try:
                return fn(node)
            except ApiError as exc:
                if exc.status.code != 409:
                    raise
        return changing if changing is not None else (
            "failed", f"node {cmd.node} kept changing under us (5 conflicts); nothing more was done")

    # -- RECORD ------------------------------------------------------------------------------
    def _record(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        msg = cmd.reason or "fault recorded"
        if dry_run:
            return "refused", f"{DRY_RUN_PREFIX}record an Event on node {cmd.node}: {msg}"
        self._event(node, cmd, "XidstreamRecorded", msg, warning=False)
        return "succeeded", f"recorded an Event on node {cmd.node}: {msg}"

    # -- CORDON / UNCORDON ------------------------------------------------------------------------
    # Several incidents may need one node cordoned (two wedged GPUs of one node): the annotation
    # keeps every incident holding the cordon, CORDON adds its own, UNCORDON removes its own and
    # uncordons only when none is left.
    def _cordon(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        def ours(n: Any) -> bool:
            return any(t.key == TAINT_KEY for t in (n.spec.taints or []))

        if dry_run:
            if ours(node) and node.spec.unschedulable:
                holders = _cordon_holders(node)[1]
                if cmd.incident_id in holders:
                    return "refused", (f"{DRY_RUN_PREFIX}nothing: node {cmd.node} is already cordoned by xidstream "
                                       f"for incident {cmd.incident_id}")
                return "refused", (f"{DRY_RUN_PREFIX}add incident {cmd.incident_id} to those holding node "
                                   f"{cmd.node}'s xidstream cordon ({_incidents(holders)})")
            return "refused", (f"{DRY_RUN_PREFIX}cordon node {cmd.node} (spec.unschedulable, NoSchedule taint "
                               f"{TAINT_KEY}, annotation {CORDON_ANNOTATION}) for incident {cmd.incident_id}")

        def act(n: Any) -> Outcome:
            note, holders = _cordon_holders(n)
            hold = {"command": cmd.command_id, "gpu": cmd.gpu_uuid, "at": _now()}
            if ours(n) and n.spec.unschedulable:
                if cmd.incident_id in holders:
                    return "succeeded", (f"node {cmd.node} was already cordoned by xidstream for incident "
                                         f"{cmd.incident_id}; unchanged")
                others = _incidents(holders)
                holders[cmd.incident_id] = hold
                was = bool(note.get("was_unschedulable"))
                self._patch_node(n, {"metadata": {"annotations": {CORDON_ANNOTATION: _cordon_note(holders, was)}}})
                detail = (f"node {cmd.node} was already cordoned by xidstream (incident(s) {others or 'unrecorded'}); "
                          f"incident {cmd.incident_id} holds the cordon too: it stays until every holder uncordons")
                self._event(n, cmd, "XidstreamCordon", detail, warning=False)
                return "succeeded", detail
            was = bool(n.spec.unschedulable)
            taints = [_plain(t) for t in (n.spec.taints or []) if t.key != TAINT_KEY]
            taints.append({"key": TAINT_KEY, "value": _label_value(cmd.gpu_uuid or cmd.incident_id),
                           "effect": "NoSchedule", "timeAdded": _now()})
            holders[cmd.incident_id] = hold
            self._patch_node(n, {"spec": {"unschedulable": True, "taints": taints},
                                 "metadata": {"annotations": {CORDON_ANNOTATION: _cordon_note(holders, was)}}})
            extra = " (it was already unschedulable: someone else's cordon stays when xidstream uncordons)" if was else ""
            self._event(n, cmd, "XidstreamCordon", f"cordoned: unschedulable and NoSchedule taint {TAINT_KEY}{extra}")
            return "succeeded", f"cordoned node {cmd.node}: spec.unschedulable, NoSchedule taint {TAINT_KEY}{extra}"

        return self._retrying(cmd, act)

    def _uncordon(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        def decide(n: Any) -> tuple[str, str, dict | None, str]:
            """(outcome, detail, patch or None, what a dry run says it would do)"""
            note_raw = (n.metadata.annotations or {}).get(CORDON_ANNOTATION)
            has_taint = any(t.key == TAINT_KEY for t in (n.spec.taints or []))
            if note_raw is None and not has_taint:
                if n.spec.unschedulable:
                    detail = (f"node {cmd.node} is cordoned by someone else (no xidstream annotation or "
                              f"taint): left cordoned; nothing was done")
                    return "refused", detail, None, f"nothing: {detail}"
                detail = f"node {cmd.node} is not cordoned; nothing to undo"
                return "succeeded", detail, None, f"nothing: {detail}"
            note, holders = _cordon_holders(n)
            mine = holders.pop(cmd.incident_id, None)
            if holders:  # other incidents still need the node cordoned
                others = _incidents(holders)
                if mine is None:
                    detail = (f"node {cmd.node} stays cordoned for incident(s) {others}: incident {cmd.incident_id} "
                              f"held no xidstream cordon on it; nothing was done")
                    return "succeeded", detail, None, f"nothing: {detail}"
                detail = (f"node {cmd.node} stays cordoned for incident(s) {others}: released only incident "
                          f"{cmd.incident_id}'s hold on the cordon")
                patch = {"metadata": {"annotations": {
                    CORDON_ANNOTATION: _cordon_note(holders, bool(note.get("was_unschedulable")))}}}
                return "succeeded", detail, patch, (f"release only incident {cmd.incident_id}'s hold on the cordon: "
                                                    f"node {cmd.node} stays cordoned for incident(s) {others}")
            was = bool(note.get("was_unschedulable"))
            taints = [_plain(t) for t in (n.spec.taints or []) if t.key != TAINT_KEY]
            patch: dict = {"spec": {"taints": taints or None}, "metadata": {"annotations": {CORDON_ANNOTATION: None}}}
            if not was:
                patch["spec"]["unschedulable"] = None
            keep = " ; it stays unschedulable: it was cordoned before xidstream cordoned it" if was else ""
            detail = f"uncordoned node {cmd.node}: removed taint {TAINT_KEY} and the annotation{keep}"
            return "succeeded", detail, patch, detail.replace("uncordoned", "uncordon", 1).replace("removed", "remove", 1)

        if dry_run:
            return "refused", DRY_RUN_PREFIX + decide(node)[3]

        def act(n: Any) -> Outcome:
            outcome, detail, patch, _ = decide(n)
            if patch is not None:
                self._patch_node(n, patch)
                self._event(n, cmd, "XidstreamUncordon", detail, warning=False)
            return outcome, detail

        return self._retrying(cmd, act)

    # -- DRAIN -----------------------------------------------------------------------------------
    def _drain(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        if not node.spec.unschedulable:
            # Draining a schedulable node refills it: the precondition the plan states, checked now.
            return "failed", f"precondition failed: node {cmd.node} is not cordoned; nothing was evicted"
        pods = pods_on_node(self.client, cmd.node)
        kept = [p for p in pods if is_daemonset_pod(p) or is_mirror_pod(p)]
        own = [p for p in pods if p not in kept and kept_by_drain(p, self.keep_namespaces)]
        todo = [p for p in pods if p not in kept and p not in own]
        kept_txt = f"; kept {len(kept)} DaemonSet/mirror pod(s): {', '.join(_names(kept))}" if kept else ""
        if own:
            kept_txt += (f"; kept {len(own)} pod(s) of namespace(s) {', '.join(self.keep_namespaces)} "
                         f"(--drain-keep-namespace): {', '.join(_names(own))}")
        if dry_run:
            return "refused", (f"{DRY_RUN_PREFIX}evict {len(todo)} pod(s) from node {cmd.node} through the Eviction "
                               f"API (PodDisruptionBudgets honoured): {', '.join(_names(todo)) or 'none'}{kept_txt}")
        deadline = time.monotonic() + self.drain_timeout
        evicted: list[str] = []
        blocked: dict[str, str] = {}
        pending = list(todo)
        while pending:
            still = []
            for pod in pending:
                name = f"{pod.metadata.namespace}/{pod.metadata.name}"
                try:
                    self.client.create(Pod.Eviction(metadata=ObjectMeta(name=pod.metadata.name,
                                                                         namespace=pod.metadata.namespace)),
                                       name=pod.metadata.name, namespace=pod.metadata.namespace)
                    evicted.append(name)
                    blocked.pop(name, None)
                except ApiError as exc:
                    if exc.status.code == 404:  # gone already: drained all the same
                        evicted.append(name)
                        blocked.pop(name, None)
                    elif exc.status.code == 429:  # a PodDisruptionBudget says not now: retry until the deadline
                        causes = (exc.status.details.causes if exc.status.details else None) or []
                        blocked[name] = "; ".join(c.message for c in causes if c.message) or exc.status.message
                        still.append(pod)
                    else:
                        blocked[name] = f"HTTP {exc.status.code}: {exc.status.message}"
                        still.append(pod)
            pending = still
            if pending and time.monotonic() + self.eviction_retry > deadline:
                break
            if pending:
                time.sleep(self.eviction_retry)
        if blocked:
            names = "; ".join(f"{k} ({v})" for k, v in blocked.items())
            detail = (f"drain of node {cmd.node} blocked after {self.drain_timeout:.0f}s: {len(blocked)} pod(s) not "
                      f"evicted, never forced: {names}; evicted {len(evicted)}: {', '.join(evicted) or 'none'}{kept_txt}")
            self._event(node, cmd, "XidstreamDrainBlocked", detail)
            return "failed", detail
        detail = f"drained node {cmd.node}: evicted {len(evicted)} pod(s): {', '.join(evicted) or 'none'}{kept_txt}"
        self._event(node, cmd, "XidstreamDrain", detail)
        return "succeeded", detail

    # -- QUARANTINE / RELEASE ----------------------------------------------------------------------
    def _dtr(self) -> Any:
        if self._dtr_version is False:
            self._dtr_version = discover_version(self.client, "resource.k8s.io", "devicetaintrules")
        return device_taint_rule_resource(self._dtr_version) if self._dtr_version else None

    def _gpu_ref(self, cmd: RemediationCommand) -> tuple[str | None, str]:
        gpu = cmd.gpu_uuid or (f"pci {cmd.pci_bus_id}" if cmd.pci_bus_id else "")
        device = f"gpu-{cmd.gpu_index}" if cmd.gpu_index is not None else None
        return device, gpu

    def _quarantine(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        device, gpu = self._gpu_ref(cmd)
        if device is None:
            return "failed", "cannot select one device: the command names no gpu_index; nothing was done"
        res = self._dtr()
        name = quarantine_rule_name(cmd.node, cmd.gpu_uuid or device)
        if res is None:
            label = f"{QUARANTINE_LABEL_PREFIX}{device}"
            what = (f"label node {cmd.node} {label}={_label_value(cmd.incident_id)} and record an Event naming GPU "
                    f"{gpu}; advisory only: this server does not serve DeviceTaintRule (resource.k8s.io)")
            if dry_run:
                return "refused", DRY_RUN_PREFIX + what
            self._patch_node(node, {"metadata": {"labels": {label: _label_value(cmd.incident_id)}}})
            self._event(node, cmd, "XidstreamGpuQuarantine", f"GPU {device} ({gpu}) quarantined (advisory: no "
                                                              f"DeviceTaintRule API; schedulers must honour label {label})")
            return "succeeded", "quarantine is advisory: " + what.replace("label node", "labelled node", 1).replace(
                "and record", "and recorded", 1)
        spec = {"deviceSelector": {"driver": DRA_DRIVER, "pool": cmd.node, "device": device},
                "taint": {"key": TAINT_KEY, "value": _label_value(cmd.gpu_uuid or device), "effect": "NoSchedule"}}
        if dry_run:
            return "refused", (f"{DRY_RUN_PREFIX}create DeviceTaintRule {name} (resource.k8s.io/{self._dtr_version}) "
                               f"selecting driver {DRA_DRIVER} pool {cmd.node} device {device} (GPU {gpu}), "
                               f"NoSchedule")
        obj = res.from_dict({
            "apiVersion": f"resource.k8s.io/{self._dtr_version}", "kind": "DeviceTaintRule",
            "metadata": {"name": name, "labels": {"xidstream.io/incident": _label_value(cmd.incident_id),
                                                  "xidstream.io/node": _label_value(cmd.node)},
                         "annotations": {"xidstream.io/gpu": gpu, "xidstream.io/command": cmd.command_id}},
            "spec": spec})
        try:
            self.client.create(obj)
            created = True
        except ApiError as exc:
            if exc.status.code != 409:
                raise
            created = False
        detail = (f"{'created' if created else 'already present:'} DeviceTaintRule {name} "
                  f"(resource.k8s.io/{self._dtr_version}): GPU {device} ({gpu}) on node {cmd.node} takes no new "
                  f"work (NoSchedule)")
        if created:
            self._event(node, cmd, "XidstreamGpuQuarantine", detail)
        return "succeeded", detail

    def _release(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        device, gpu = self._gpu_ref(cmd)
        if device is None:
            return "failed", "cannot select one device: the command names no gpu_index; nothing was done"
        res = self._dtr()
        if res is None:
            label = f"{QUARANTINE_LABEL_PREFIX}{device}"
            if label not in (node.metadata.labels or {}):
                return "succeeded", f"GPU {device} ({gpu}) on node {cmd.node} is not quarantined (no label {label})"
            if dry_run:
                return "refused", f"{DRY_RUN_PREFIX}remove label {label} from node {cmd.node} (advisory quarantine)"
            self._patch_node(node, {"metadata": {"labels": {label: None}}})
            self._event(node, cmd, "XidstreamGpuRelease", f"GPU {device} ({gpu}) released", warning=False)
            return "succeeded", f"released GPU {device} ({gpu}): removed label {label} from node {cmd.node}"
        name = quarantine_rule_name(cmd.node, cmd.gpu_uuid or device)
        if dry_run:
            return "refused", f"{DRY_RUN_PREFIX}delete DeviceTaintRule {name} (GPU {device}, {gpu}, node {cmd.node})"
        try:
            self.client.delete(res, name)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            return "succeeded", f"GPU {device} ({gpu}) on node {cmd.node} is not quarantined (no DeviceTaintRule {name})"
        detail = f"released GPU {device} ({gpu}) on node {cmd.node}: deleted DeviceTaintRule {name}"
        self._event(node, cmd, "XidstreamGpuRelease", detail, warning=False)
        return "succeeded", detail

    # -- REPLACE -----------------------------------------------------------------------------------
    # The node-lifecycle system that owns the node replaces it (--replace-backend, executors.replace).
    # A re-delivered command is answered from the journal; one that reaches the API again (journal
    # lost) finds the hand-over done (annotation present, NodeClaim deleting, condition held) and
    # writes nothing.
    def _replace(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        if self._replacer is not None:
            outcome, detail, acted = self._replacer.replace(cmd, node, dry_run)
            if acted:
                self._event(node, cmd, "XidstreamReplaceNode",
                            f"node handed over for replacement ({self.replace_backend}): {detail}")
            return outcome, detail
        if self.replace_backend == "condition":
            return self._replace_by_condition(cmd, node, dry_run)
        return self._replace_by_label(cmd, node, dry_run)

    def _replace_by_condition(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        what = (f"set node {cmd.node}'s condition {REPLACEMENT_CONDITION_TYPE}=True (and {CONDITION_TYPE}=False, "
                f"reason {REPLACEMENT_REQUESTED}) for incident {cmd.incident_id} (a remediator that reads Node "
                f"conditions replaces it)")
        if dry_run:
            return "refused", DRY_RUN_PREFIX + what
        try:
            done = self._hold_condition(cmd)
        except ApiError as exc:
            return "failed", (f"could not set node {cmd.node}'s condition {CONDITION_TYPE}: HTTP {exc.status.code}: "
                              f"{exc.status.message}; nothing was handed over")
        if done.startswith(f"; condition {CONDITION_TYPE} not updated"):
            return "failed", f"could not set node {cmd.node}'s condition{done.split('not updated', 1)[1]}"
        if not done:
            return "succeeded", (f"node {cmd.node}'s condition {CONDITION_TYPE} already says {REPLACEMENT_REQUESTED} "
                                 f"for incident {cmd.incident_id}; unchanged")
        self._event(node, cmd, "XidstreamReplaceNode", f"replacement requested through condition "
                                                       f"{REPLACEMENT_CONDITION_TYPE}: {cmd.reason or 'see incident'}")
        return "succeeded", "set " + what.removeprefix("set ")

    def _replace_by_label(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> Outcome:
        what = f"label node {cmd.node} {REPLACE_LABEL}=true for replacement (incident {cmd.incident_id})"
        if dry_run:
            return "refused", DRY_RUN_PREFIX + what
        self._patch_node(node, {"metadata": {
            "labels": {REPLACE_LABEL: "true"},
            "annotations": {"xidstream.io/replace-reason": plain_text(f"incident {cmd.incident_id}: {cmd.reason}", 1000)}}})
        self._event(node, cmd, "XidstreamReplaceNode", f"node marked for replacement: {cmd.reason or 'see incident'}")
        return "succeeded", f"labelled node {cmd.node} {REPLACE_LABEL}=true for replacement and recorded an Event"


CONDITION_TYPE = "GPUHealthy"
CONDITION_ANNOTATION = "xidstream.io/gpu-incidents"
# The condition's reason while an incident holds it: what was done about the GPU (the command
# does not carry the verdict; its reason, quoted in the message, does).
CONDITION_REASONS = {
    Action.QUARANTINE_GPU: "GPUQuarantined",
    Action.CORDON_NODE: "GPUFaultCordonedNode",
    Action.REPLACE_NODE: "GPUFaultReplaceNode",
}
REPLACEMENT_REQUESTED = "ReplacementRequested"  # the condition backend's REPLACE_NODE (--replace-backend condition)
REPLACEMENT_CONDITION_TYPE = "GPUReplacementRequired"
_REASON_RANK = {"": 0, "GPUQuarantined": 1, "GPUFaultCordonedNode": 2, "GPUFaultReplaceNode": 3, REPLACEMENT_REQUESTED: 3}
_CLOSING = (Action.UNCORDON_NODE, Action.RELEASE_GPU)
HEALTHY_REASON = "NoOpenGPUIncident"


def _condition_holders(node: Any) -> dict[str, dict]:
    raw = (node.metadata.annotations or {}).get(CONDITION_ANNOTATION)
    try:
        held = json.loads(raw) if raw else {}
    except ValueError:
        held = {}
    if not isinstance(held, dict):
        return {}
    # the node's own credentials can write this annotation: an "action" that is not text counts as
    # none (an unknown reason, e.g. a newer release's, ranks lowest), never a TypeError
    return {str(k): {**v, "action": v.get("action") if isinstance(v.get("action"), str) else ""}
            for k, v in held.items() if isinstance(v, dict)}


def _condition_of(node: Any, type_: str = CONDITION_TYPE) -> Any:
    return next((c for c in (node.status.conditions or []) if c.type == type_), None) if node.status else None


def replacement_condition_for(held: dict[str, dict], current: Any = None) -> dict:
    """GPUReplacementRequired (the condition backend): True while an incident's REPLACE_NODE holds
    the node, else False. A condition of its own, because a consumer that acts on a condition's
    type and status alone (a MachineHealthCheck's unhealthyNodeConditions, medik8s NodeHealthCheck,
    Karpenter's node repair) would replace a node at the first rung if pointed at GPUHealthy, which
    a cordon or one GPU's quarantine already turns False."""
    now = _now()
    asking = sorted(i for i, h in held.items() if h.get("action") == REPLACEMENT_REQUESTED)
    if asking:
        status, reason = "True", REPLACEMENT_REQUESTED
        message = plain_text(f"xidstream asks for this node's replacement: incident {', '.join(asking)} "
                             f"(see condition {CONDITION_TYPE} for its GPU and why)", 1024)
    else:
        status, reason, message = "False", "NoReplacementRequested", "no open xidstream incident asks for it"
    moved = current is None or current.status != status
    return {"type": REPLACEMENT_CONDITION_TYPE, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now if moved else _rfc3339(current.lastTransitionTime) or now}


def condition_for(held: dict[str, dict], current: Any = None) -> dict:
    """The GPUHealthy condition for the incidents holding it: False, reason the strongest action,
    message naming each incident and GPU; True once none is left. lastTransitionTime moves only
    when the status does (the API convention)."""
    now = _now()
    if held:
        reason = max((h.get("action") or "" for h in held.values()), key=lambda r: _REASON_RANK.get(r, 0))
        parts = [f"incident {i}: GPU {_gpu_text(h)} {h.get('action')} since {h.get('at')}"
                 + (f": {h['why']}" if h.get("why") else "") for i, h in sorted(held.items())]
        status, message = "False", plain_text("; ".join(parts), 1024)
    else:
        status, reason, message = "True", HEALTHY_REASON, "no open xidstream incident on this node's GPUs"
    moved = current is None or current.status != status
    return {"type": CONDITION_TYPE, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now if moved else _rfc3339(current.lastTransitionTime) or now}


def _gpu_text(held: dict) -> str:
    """"1 (GPU-...)", or the UUID alone for a GPU whose index is unknown (fallen off the bus)."""
    idx = held.get("gpu_index")
    return f"{held.get('gpu')}" if idx is None else f"{idx} ({held.get('gpu')})"


def _rfc3339(value: Any) -> Any:
    """A datetime as RFC 3339 text (UTC, seconds); anything else as it is."""
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return value


def _names(pods: list[Any]) -> list[str]:
    return [f"{p.metadata.namespace}/{p.metadata.name}" for p in pods]


def _plain(taint: Any) -> dict:
    """A taint as JSON-ready data (timeAdded back to RFC 3339 text)."""
    out = {}
    for k, v in taint.to_dict().items():
        v = _rfc3339(v)
        if v is not None:
            out[k] = v
    return out
