"""The GPU Operator's operands on this node: paused for a GPU reset through their node labels, and
restored exactly (`NodeActions` RESET_GPU; docs/operations.md "Reset on a real node").

On a node run by the GPU Operator, DaemonSet pods hold every GPU open with no workload on it: the
device plugin (an NVML event set for its health checks), gpu-feature-discovery (NVML in a loop),
dcgm-exporter (its embedded nv-hostengine, the Operator's default) or nvidia-dcgm, and any
third-party client that selects on ``nvidia.com/gpu.deploy.client``. A drain keeps DaemonSet pods,
so `nvidia-smi --gpu-reset` is refused until they are gone (NVSentinel PR #1243, gpu-operator #118).

Every Operator DaemonSet selects on its own ``nvidia.com/gpu.deploy.<operand>: "true"`` node label,
and any other value removes its pod (NVIDIA/gpu-operator controllers/state_manager.go,
assets/state-*/…daemonset.yaml; ../shared/reference/gpu-reset.md section 1). Those labels are
shared with the Operator's driver-upgrade manager (``paused-for-driver-upgrade``, or
``_paused-for-driver-upgrade`` appended) and mig-manager (``paused-for-mig-change``), so:

- a label is paused only when its value is exactly ``"true"``, to a value of our own
  (`PAUSE_VALUE`), never over another controller's pause: while one is on, or a driver upgrade or
  a MIG change is in progress, the reset is refused with the reason (NVSentinel #1869 clobbered an
  upgrade by writing ``false`` and then a blind ``true``);
- every write is a JSON patch with a ``test`` of the value it replaces, so a label another
  controller changed between our read and our write is never overwritten;
- the prior values are kept in a journal (fsynced before the first write) and written back exactly
  on every path; an executor that died mid-way restores them when it starts again (`recover`).

Never paused: ``driver`` (nvidia-persistenced runs in the driver container: persistence mode is
turned off for the reset instead; removing the driver pod unloads the driver), ``container-toolkit``,
``operator-validator``, ``node-status-exporter``, ``mig-manager`` and the sandbox/vGPU set: none
holds a GPU for the reset's purpose, and the driver-upgrade manager owns their lifecycle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import orjson
from lightkube import ApiError, Client
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from xidstream.collectors.spool import write_durably
from xidstream.executors.kube import node_or_none, pods_on_node
from xidstream.transport.podview import PodViewClient, PodViewError

__all__ = ["LABEL_PREFIX", "PAUSE_VALUE", "PAUSABLE", "Operands", "OperandPause", "OperandError", "selected_labels"]

log = logging.getLogger(__name__)

LABEL_PREFIX = "nvidia.com/gpu.deploy."
# Our own pause value: distinct from the driver-upgrade manager's and mig-manager's, so each
# controller recognises its own (../shared/reference/gpu-reset.md section 8, step 3).
PAUSE_VALUE = "paused-for-gpu-reset"
# The operands paused for a reset, and why each is safe to take off the node for a minute: each
# only observes or exposes the GPUs, and its DaemonSet brings it back when the label returns.
PAUSABLE = {
    "device-plugin": "the device plugin: keeps an NVML event set for its health checks; the node's "
                     "nvidia.com/gpu capacity is re-registered when it returns (the MPS control daemon "
                     "selects on this label too)",
    "gpu-feature-discovery": "gpu-feature-discovery: opens NVML in a loop to write node labels",
    "dcgm-exporter": "dcgm-exporter: its embedded nv-hostengine holds every GPU (the Operator's default); "
                     "metrics pause for the reset",
    "dcgm": "nvidia-dcgm: the standalone nv-hostengine, when the Operator runs one",
    "client": "third-party GPU clients that select on nvidia.com/gpu.deploy.client (GPU Operator "
              "v26.7; the contract for NVML clients outside the Operator)",
}
# Labels that say another controller is changing the node's GPU stack now.
UPGRADE_STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
UPGRADE_IDLE = ("", "upgrade-done", "upgrade-failed")
# mig-manager's restore writes "true" over anything but "false" (reconfigure-mig.sh): a reset
# while a MIG change is pending would have our pause overwritten.
MIG_STATE_LABEL = "nvidia.com/mig.config.state"


class OperandError(Exception):
    """The operands could not be paused or restored; the message says what and why."""


def _pointer(key: str) -> str:
    return "/metadata/labels/" + key.replace("~", "~0").replace("/", "~1")


def selected_labels(pod: Any) -> set[str]:
    """The gpu.deploy labels a pod's nodeSelector requires to be "true": the operands it belongs to."""
    sel = (pod.spec.nodeSelector or {}) if pod.spec else {}
    return {k for k, v in sel.items() if k.startswith(LABEL_PREFIX) and v == "true"}


@dataclass
class OperandPause:
    """What was paused: the labels we wrote (key -> the value before) and the journal's path."""

    node: str
    before: dict[str, str] = field(default_factory=dict)
    persistence_off: list[str] = field(default_factory=list)  # GPU UUIDs whose persistence mode we turned off
    command_id: str = ""


# What wait_gone reports when the pod view could not say: not "still there", which would make a
# refusal for good out of an outage of the view (the node executor answers it not final).
PODS_UNKNOWN = "(the node's pods unknown: "


class Operands:
    def __init__(self, client: Client, node: str, journal: str | Path, *, wait_s: float = 300.0, poll_s: float = 2.0,
                 pausable: tuple[str, ...] = tuple(PAUSABLE), clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, pod_view: PodViewClient | None = None) -> None:
        self.client, self.node = client, node
        self.pod_view = pod_view  # the node's pods from the cluster executor's pod view (executors.kube.pods_on_node)
        self.journal = Path(journal)
        # 5 minutes per operand is what the Operator's own driver-upgrade manager and mig-manager
        # allow (k8s-driver-manager defaultGracePeriod; reconfigure-mig.sh kubectl wait --timeout=5m).
        self.wait_s, self.poll_s = wait_s, poll_s
        self.pausable = tuple(LABEL_PREFIX + p for p in pausable)
        self.clock, self.sleep = clock, sleep

    # -- reading ---------------------------------------------------------------------------------
    def labels(self) -> dict[str, str]:
        node = node_or_none(self.client, self.node)
        if node is None:
            raise OperandError(f"node {self.node} does not exist on the API server")
        return dict(node.metadata.labels or {})

    def conflicts(self, labels: dict[str, str]) -> list[str]:
        """Another controller's work in progress on this node's GPU stack, in words (empty: none)."""
        why = []
        for k, v in sorted(labels.items()):
            if k.startswith(LABEL_PREFIX) and "paused-for-" in v and v != PAUSE_VALUE:
                why.append(f"{k}={v} (another controller's pause)")
            elif k.startswith(LABEL_PREFIX) and v == PAUSE_VALUE and self.pending() is None:
                why.append(f"{k}={v} with no journal of ours: its value before is unknown (restore it by hand)")
        state = labels.get(UPGRADE_STATE_LABEL, "")
        if state not in UPGRADE_IDLE:
            why.append(f"{UPGRADE_STATE_LABEL}={state} (a driver upgrade is in progress)")
        if labels.get(MIG_STATE_LABEL) == "pending":
            why.append(f"{MIG_STATE_LABEL}=pending (mig-manager is changing the MIG layout)")
        return why

    def to_pause(self, labels: dict[str, str], extra: set[str] = frozenset()) -> list[str]:
        """The operand labels to pause: those of ours set to "true", and `extra` (labels the GPU's
        holders' pods select on, within what we may pause)."""
        wanted = set(self.pausable) | (set(extra) & set(self.pausable))
        return sorted(k for k in wanted if labels.get(k) == "true")

    def operand_pods(self, keys: list[str]) -> list[str]:
        """ns/name of the pods on this node that select on one of `keys` (still there, terminating
        or not: a terminating pod may still hold the GPU)."""
        keys_set = set(keys)
        return sorted(f"{p.metadata.namespace}/{p.metadata.name}" for p in pods_on_node(self.client, self.node, self.pod_view)
                      if selected_labels(p) & keys_set)

    # -- writing ---------------------------------------------------------------------------------
    def _cas(self, key: str, old: str, new: str) -> None:
        """Replace label `key` only while it still holds `old` (JSON patch `test`): a label another
        controller changed meanwhile is left to it. Raises OperandError naming what it found."""
        ops = [{"op": "test", "path": _pointer(key), "value": old},
               {"op": "replace", "path": _pointer(key), "value": new}]
        try:
            self.client.patch(Node, self.node, ops, patch_type=PatchType.JSON)
        except ApiError as exc:
            now = self.labels().get(key)
            why = (f"changed under us: {old!r} expected, {now!r} found" if now != old else
                   "refused by the API server (RBAC: nodeExecutor.pauseOperands; or the admission policy "
                   "node-operand-labels)")
            raise OperandError(f"{key} not written ({new!r}): {why} (API: {exc.status.code} {exc.status.message})") from None

    def _save(self, pause: OperandPause) -> None:
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        write_durably(self.journal, orjson.dumps({"node": pause.node, "before": pause.before,
                                                  "persistence_off": pause.persistence_off,
                                                  "command_id": pause.command_id}))

    def note_persistence_off(self, pause: OperandPause, uuid: str) -> None:
        pause.persistence_off.append(uuid)
        self._save(pause)

    def note_persistence_restored(self, pause: OperandPause, uuid: str) -> None:
        pause.persistence_off.remove(uuid)
        self._save(pause)

    def pause(self, keys: list[str], command_id: str = "") -> OperandPause:
        """Write PAUSE_VALUE over each of `keys` (each "true" now), the journal first. A label that
        changed meanwhile stops the pause: what was written is restored, then OperandError."""
        pause = OperandPause(node=self.node, command_id=command_id)
        pause.before = {k: "true" for k in keys}
        self._save(pause)  # before the first write: a crash after it is restored at the next start
        done: list[str] = []
        try:
            for k in keys:
                self._cas(k, "true", PAUSE_VALUE)
                done.append(k)
        except OperandError:
            pause.before = {k: pause.before[k] for k in done}
            self._save(pause)
            self.restore(pause)
            raise
        return pause

    def wait_gone(self, keys: list[str]) -> list[str]:
        """Wait (bounded by wait_s) until no pod on the node selects on `keys`; returns those left."""
        deadline = self.clock() + self.wait_s
        while True:
            try:
                left = self.operand_pods(keys)
            except PodViewError as exc:  # cannot tell is not gone
                left = [f"{PODS_UNKNOWN}{exc})"]
            if not left or self.clock() >= deadline:
                return left
            self.sleep(min(self.poll_s, max(0.0, deadline - self.clock())))

    def restore(self, pause: OperandPause) -> list[str]:
        """Write back each label's value from before, where it still holds ours; returns what could
        not be restored, in words (empty: all). The journal goes only when everything is back.

        The driver-upgrade manager appends ``_paused-for-driver-upgrade`` to a value it does not
        own and strips it on its own restore; over our pause it would strip back to ours and leave
        the operand off for good, so such a label gets the value that manager would have written
        over the original ("true" -> ``paused-for-driver-upgrade``)."""
        problems = []
        retry = {}  # labels still ours to restore: kept in the journal
        labels = self.labels()
        for k, old in pause.before.items():
            now = labels.get(k)
            try:
                if now == PAUSE_VALUE:
                    self._cas(k, PAUSE_VALUE, old)
                elif now == PAUSE_VALUE + "_paused-for-driver-upgrade":
                    self._cas(k, now, "paused-for-driver-upgrade" if old == "true" else old + "_paused-for-driver-upgrade")
                elif now != old:
                    # someone else's now: theirs to restore, not ours (kept, it would refuse every
                    # later reset on this node for good)
                    problems.append(f"{k} is {now!r}, set by someone else while paused: left as it is "
                                    f"(it was {old!r})")
            except OperandError as exc:
                problems.append(str(exc))
                retry[k] = old
        if retry != pause.before:
            pause.before = retry
            if retry or pause.persistence_off:
                self._save(pause)
        if not retry and not pause.persistence_off:  # persistence mode is restored first (NodeActions)
            try:
                self.journal.unlink()
            except FileNotFoundError:
                pass
        if problems:
            log.error("node %s: operand labels not all restored: %s", self.node, "; ".join(problems))
        return problems

    def pending(self) -> OperandPause | None:
        """The pause a journal left (an executor that died between pause and restore), or None."""
        try:
            doc = orjson.loads(self.journal.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, orjson.JSONDecodeError) as exc:
            log.error("operand journal %s unreadable (%s): labels with %s must be restored by hand",
                      self.journal, exc, PAUSE_VALUE)
            return None
        return OperandPause(node=doc.get("node", self.node), before=dict(doc.get("before") or {}),
                            persistence_off=list(doc.get("persistence_off") or []),
                            command_id=doc.get("command_id", ""))
