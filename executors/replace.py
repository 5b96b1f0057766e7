"""Where REPLACE_NODE hands a node over for replacement (`xidstream execute --scope cluster
--replace-backend ...`): the node-lifecycle system that owns the node, not xidstream, replaces it.

- ``label`` (the default, and what earlier versions did): the Node label ``xidstream.io/replace=true``
  and an Event, for a cluster's own tooling. Kept the default because it is the only one that
  needs no other controller and no extra RBAC: an upgrade changes nothing.
- ``cluster-api``: the annotation ``cluster.x-k8s.io/remediate-machine`` on the node's Machine;
  a MachineHealthCheck that selects the Machine marks it unhealthy and remediates it (its
  reconciler checks the annotation before anything else: `needsRemediation` in
  sigs.k8s.io/cluster-api internal/controllers/machinehealthcheck/machinehealthcheck_targets.go).
- ``karpenter``: deletes the node's NodeClaim; Karpenter's termination controller drains the node
  under its PodDisruptionBudgets and provisions a replacement for the pods.
- ``condition``: the Node condition ``GPUHealthy=False`` with reason ``ReplacementRequested``, for
  a remediator that reads Node conditions (executors.cluster keeps the condition).

The Cluster API and Karpenter parts are here; ``label`` and ``condition`` write the Node only and
live in `xidstream.executors.cluster` with the rest of the Node writes. Each answers (outcome, detail) like
every action, and never raises for a node that the backend does not know: a missing annotation,
Machine or NodeClaim is a `failed` result that says what is missing and what to do, and a Machine
that does not point back at the node is `refused`.
"""

from __future__ import annotations

import logging
from typing import Any

from lightkube import ApiError, Client
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.types import PatchType

from xidstream.executors.gate import DRY_RUN_PREFIX
from xidstream.executors.kube import discover_version
from xidstream.schemas.base import plain_text
from xidstream.schemas.models import RemediationCommand

__all__ = ["REPLACE_BACKENDS", "DEFAULT_REPLACE_BACKEND", "ClusterApiReplace", "KarpenterReplace",
           "CAPI_GROUP", "MACHINE_ANNOTATION", "CLUSTER_NAMESPACE_ANNOTATION", "REMEDIATE_ANNOTATION",
           "SKIP_REMEDIATION_ANNOTATION", "KARPENTER_GROUP", "REPLACE_REASON_ANNOTATION"]

log = logging.getLogger(__name__)

REPLACE_BACKENDS = ("label", "cluster-api", "karpenter", "condition")
DEFAULT_REPLACE_BACKEND = "label"

# sigs.k8s.io/cluster-api api/core/v1beta2/common_types.go: the Machine controller writes the first
# two on the Node it owns; the MachineHealthCheck reconciler acts on the third, and leaves a Machine
# with the fourth alone.
CAPI_GROUP = "cluster.x-k8s.io"
MACHINE_ANNOTATION = "cluster.x-k8s.io/machine"
CLUSTER_NAMESPACE_ANNOTATION = "cluster.x-k8s.io/cluster-namespace"
REMEDIATE_ANNOTATION = "cluster.x-k8s.io/remediate-machine"
SKIP_REMEDIATION_ANNOTATION = "cluster.x-k8s.io/skip-remediation"
KARPENTER_GROUP = "karpenter.sh"
# What xidstream writes beside the hand-over, so `kubectl describe` of the object says why.
REPLACE_REASON_ANNOTATION = "xidstream.io/replace-reason"

Outcome = tuple[str, str]


def _why(cmd: RemediationCommand) -> str:
    return plain_text(f"incident {cmd.incident_id}: {cmd.reason}", 1000)


def _api_error(exc: ApiError, what: str, rbac: str) -> Outcome:
    if exc.status.code == 403:
        return "failed", (f"the API server refused to {what} (HTTP 403: {exc.status.message}); the executor's "
                          f"service account needs {rbac}; nothing was done")
    raise exc


class ClusterApiReplace:
    """REPLACE_NODE through Cluster API: annotate the node's Machine for MachineHealthCheck.

    `client` reaches the Machines: the workload cluster's own API server when it is self-managed
    (the Machines live beside the Nodes), else the management cluster's (--replace-kubeconfig)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._version: str | None | bool = False  # False: not discovered yet

    def _machine_resource(self) -> Any:
        if self._version is False or self._version is None:
            # None is asked again: the CRDs may be installed after the executor started.
            self._version = discover_version(self.client, CAPI_GROUP, "machines")
        return create_namespaced_resource(CAPI_GROUP, self._version, "Machine", "machines") if self._version else None

    def replace(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> tuple[str, str, bool]:
        """(outcome, detail, acted): acted is True when this call wrote the annotation (the caller
        records the Event only then)."""
        notes = node.metadata.annotations or {}
        machine, namespace = notes.get(MACHINE_ANNOTATION), notes.get(CLUSTER_NAMESPACE_ANNOTATION)
        if not machine or not namespace:
            missing = " and ".join(k for k, v in ((MACHINE_ANNOTATION, machine), (CLUSTER_NAMESPACE_ANNOTATION,
                                                                                  namespace)) if not v)
            return "failed", (f"node {cmd.node} has no annotation {missing}: Cluster API's Machine controller writes "
                              f"them on the Nodes it owns, so this node is not a Cluster API Machine's (or its Machine "
                              f"has not adopted it yet); replace it by hand, or run the cluster executor with the "
                              f"--replace-backend that owns this node; nothing was done"), False
        res = self._machine_resource()
        if res is None:
            return "failed", (f"node {cmd.node} names Machine {namespace}/{machine}, but this API server serves no "
                              f"Machine resource ({CAPI_GROUP}): where the Machines live in a management cluster, give "
                              f"the executor its kubeconfig (--replace-kubeconfig); nothing was done"), False
        ref = f"Machine {namespace}/{machine} ({CAPI_GROUP}/{self._version})"
        try:
            obj = self.client.get(res, machine, namespace=namespace).to_dict()
        except ApiError as exc:
            if exc.status.code == 404:
                return "failed", (f"node {cmd.node} names {ref} (annotations {MACHINE_ANNOTATION}, "
                                  f"{CLUSTER_NAMESPACE_ANNOTATION}), which does not exist: it was deleted already, or "
                                  f"the Machines live in another cluster (--replace-kubeconfig); nothing was done"), False
            return (*_api_error(exc, f"read {ref}", f"get on machines.{CAPI_GROUP} in namespace {namespace}"), False)
        node_ref = ((obj.get("status") or {}).get("nodeRef") or {}).get("name")
        if node_ref != cmd.node:
            # A kubelet may write its own Node's annotations: the Machine must name the node back,
            # or a node could get another node's Machine (a control-plane one) remediated.
            said = f"names node {node_ref}" if node_ref else "names no node yet"
            return "refused", (f"refused: {ref} {said} in status.nodeRef, not node {cmd.node}: the node's annotation "
                               f"{MACHINE_ANNOTATION} does not point at its own Machine; nothing was done"), False
        notes = (obj.get("metadata") or {}).get("annotations") or {}
        if SKIP_REMEDIATION_ANNOTATION in notes:
            return "refused", (f"refused: {ref} carries {SKIP_REMEDIATION_ANNOTATION} (someone paused its "
                               f"remediation): MachineHealthCheck would not act; remove it to let the replacement "
                               f"through; nothing was done"), False
        if REMEDIATE_ANNOTATION in notes:
            return "succeeded", (f"{ref} of node {cmd.node} already carries {REMEDIATE_ANNOTATION}; unchanged "
                                 f"(a MachineHealthCheck selecting it remediates it)"), False
        what = (f"annotate {ref} of node {cmd.node} with {REMEDIATE_ANNOTATION} (a MachineHealthCheck selecting it "
                f"marks it unhealthy and remediates it)")
        if dry_run:
            return "refused", DRY_RUN_PREFIX + what, False
        try:
            self.client.patch(res, machine, {"metadata": {"annotations": {REMEDIATE_ANNOTATION: "",
                                                                          REPLACE_REASON_ANNOTATION: _why(cmd)}}},
                              namespace=namespace, patch_type=PatchType.MERGE)
        except ApiError as exc:
            if exc.status.code == 404:
                return "failed", f"{ref} was deleted while acting; nothing was done", False
            return (*_api_error(exc, f"annotate {ref}", f"patch on machines.{CAPI_GROUP} in namespace {namespace}"),
                    False)
        return "succeeded", ("annotated " + what.removeprefix("annotate ")), True


class KarpenterReplace:
    """REPLACE_NODE through Karpenter: delete the node's NodeClaim.

    The NodeClaim is found as Karpenter itself relates the two: its `status.nodeName`, or its
    `status.providerID` equal to the Node's `spec.providerID` (Karpenter puts no NodeClaim label on
    the Node: the node's `karpenter.sh/nodepool` label names the pool only)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._version: str | None | bool = False

    def _resource(self) -> Any:
        if self._version is False or self._version is None:
            self._version = discover_version(self.client, KARPENTER_GROUP, "nodeclaims")
        return create_global_resource(KARPENTER_GROUP, self._version, "NodeClaim", "nodeclaims") if self._version else None

    def replace(self, cmd: RemediationCommand, node: Any, dry_run: bool) -> tuple[str, str, bool]:
        res = self._resource()
        pool = (node.metadata.labels or {}).get(f"{KARPENTER_GROUP}/nodepool")
        if res is None:
            return "failed", (f"this API server serves no NodeClaim resource ({KARPENTER_GROUP}): Karpenter is not "
                              f"installed, so node {cmd.node} is not Karpenter's; use the --replace-backend that owns "
                              f"it; nothing was done"), False
        try:
            claims = [c.to_dict() for c in self.client.list(res)]
        except ApiError as exc:
            return (*_api_error(exc, f"list NodeClaims ({KARPENTER_GROUP}/{self._version})",
                                f"list on nodeclaims.{KARPENTER_GROUP}"), False)
        provider = node.spec.providerID if node.spec else None
        mine = [c for c in claims
                if (c.get("status") or {}).get("nodeName") == cmd.node
                or (provider and (c.get("status") or {}).get("providerID") == provider)]
        if not mine:
            by = f"status.nodeName {cmd.node}" + (f" or status.providerID {provider}" if provider else "")
            hint = (f" although the node has the label {KARPENTER_GROUP}/nodepool={pool} (Karpenter has not "
                    f"registered it yet, or its NodeClaim was deleted by hand)" if pool else
                    f": the node has no {KARPENTER_GROUP}/nodepool label, so Karpenter did not launch it; use the "
                    f"--replace-backend that owns it")
            return "failed", (f"no NodeClaim ({KARPENTER_GROUP}/{self._version}) has {by}{hint}; nothing was done"), False
        if len(mine) > 1:
            names = ", ".join(sorted(c["metadata"]["name"] for c in mine))
            return "refused", (f"refused: {len(mine)} NodeClaims name node {cmd.node} ({names}); deleting one is a "
                               f"guess; nothing was done"), False
        claim = mine[0]
        name = claim["metadata"]["name"]
        ref = f"NodeClaim {name} ({KARPENTER_GROUP}/{self._version})"
        if claim["metadata"].get("deletionTimestamp"):
            return "succeeded", (f"{ref} of node {cmd.node} is already being deleted (since "
                                 f"{claim['metadata']['deletionTimestamp']}); unchanged"), False
        what = (f"delete {ref} of node {cmd.node}: Karpenter drains the node under its PodDisruptionBudgets and "
                f"replaces it")
        if dry_run:
            return "refused", DRY_RUN_PREFIX + what, False
        try:
            self.client.delete(res, name)
        except ApiError as exc:
            if exc.status.code == 404:
                return "succeeded", f"{ref} of node {cmd.node} is gone already; unchanged", False
            return (*_api_error(exc, f"delete {ref}", f"delete on nodeclaims.{KARPENTER_GROUP}"), False)
        return "succeeded", "deleted " + what.removeprefix("delete "), True
