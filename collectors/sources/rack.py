"""The node's rack, for its GPU inventories (`GpuInventory.rack`, read by the fleet agent's storms
by blast radius, streams.storms): a label of this node's own Node object, or a value the operator
gives (`xidstream collect --rack`, for nodes outside Kubernetes).

The Node is read with a GET of one object through `xidstream.transport.kube` (lightkube, the client of the pod
watch) at start and again at each inventory heartbeat (collectors.agent INVENTORY_HEARTBEAT_S), so a
relabelled node is picked up without a restart. The read is bounded (`timeout`) and never raises:

- not on Kubernetes (no KUBERNETES_SERVICE_HOST and no kubeconfig): `from_environment` returns
  None, and no inventory carries a rack;
- 403 (the ServiceAccount may not `get` nodes): one warning naming the RBAC rule, no rack;
- the Node has no such label: one info line, no rack;
- anything else (the API server restarting, a timeout): one warning, and the last rack read stays.

What an adversary controls: the value is whatever the label says. With the default label
(`topology.kubernetes.io/rack`) the NodeRestriction admission plugin keeps a kubelet from setting it
on its own Node (a kubelet may set only its listed `kubernetes.io` labels:
https://kubernetes.io/docs/reference/access-authn-authz/admission-controllers/#noderestriction), so it
is the cluster admin's; but the collector publishes it, and a node with root can publish any rack
(the fleet agent treats it as the node's claim: docs/operations.md, "Storms by blast radius"). A value
is bounded and checked against the label-value syntax; one that fails is not published, never cut:
two racks cut to the same prefix would merge into one group.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

from xidstream.schemas.limits import K8S_LABEL_MAX

__all__ = ["FixedRack", "NodeLabelRack", "valid_rack", "from_environment", "DEFAULT_RACK_LABEL",
           "RBAC_RULE"]

log = logging.getLogger(__name__)

DEFAULT_RACK_LABEL = "topology.kubernetes.io/rack"

# What the collector's ServiceAccount needs (the chart's node ClusterRole grants it).
RBAC_RULE = "apiGroups: [\"\"], resources: [nodes], verbs: [get]"

# A Kubernetes label value: empty, or up to 63 characters, alphanumerics at both ends and `-_.`
# between (apimachinery validation.IsValidLabelValue).
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def valid_rack(value: Any) -> bool:
    """A rack the inventory may carry: a label value of at most K8S_LABEL_MAX characters (the field's
    bound, schemas.limits), not empty."""
    return isinstance(value, str) and len(value) <= K8S_LABEL_MAX and _LABEL_VALUE.fullmatch(value) is not None


# Both sources are collectors.agent.RackSource: `read()` gives the rack or None, and never raises.
class FixedRack:
    """`--rack VALUE`: the operator's word, checked once here (a ValueError says why)."""

    def __init__(self, value: str) -> None:
        if not valid_rack(value):
            raise ValueError(f"--rack {value[:80]!r}: a rack is 1-{K8S_LABEL_MAX} letters, digits, '-', '_' or '.', "
                             f"beginning and ending with a letter or digit (a Kubernetes label value)")
        self.value = value

    def read(self) -> str | None:
        return self.value


class NodeLabelRack:
    """The value of label `label` on Node `node`, read through a lightkube client (`get` on nodes)."""

    def __init__(self, client: Any, node: str, label: str) -> None:
        self.client = client
        self.node = node
        self.label = label
        self.last: str | None = None
        # what was logged, by kind of trouble (refused, missing, error, unlabelled, invalid): each is
        # said once, again only when its detail changes or after it cleared
        self._said: dict[str, str] = {}

    def _once(self, kind: str, detail: str, level: int, msg: str, *args: Any) -> None:
        if self._said.get(kind) != detail:
            self._said[kind] = detail
            log.log(level, msg, *args)

    def read(self) -> str | None:
        from lightkube.resources.core_v1 import Node

        from xidstream.transport.kube import ApiError

        try:
            obj = self.client.get(Node, name=self.node)
            labels = dict((obj.metadata.labels if obj.metadata is not None else None) or {})
        except ApiError as exc:
            code = getattr(getattr(exc, "status", None), "code", None)
            if code == 403:
                self._once("refused", "", logging.WARNING,
                           "the API server refuses to let this collector read its Node %s (403: %s); inventories "
                           "carry no rack. Grant its ServiceAccount a ClusterRole rule {%s} (the Helm chart's node "
                           "ClusterRole has it), or give --rack VALUE, or --rack-label '' to stop asking",
                           self.node, exc, RBAC_RULE)
                self.last = None
                return None
            if code == 404:
                self._once("missing", "", logging.WARNING, "Node %s not found (is --node / XIDSTREAM_NODE the "
                           "Node's name?); inventories carry no rack", self.node)
                self.last = None
                return None
            self._once("error", f"HTTP {code}", logging.WARNING, "cannot read Node %s for its rack (HTTP %s: %s); "
                       "keeping rack %r until the next inventory heartbeat", self.node, code, exc, self.last)
            return self.last
        except Exception as exc:  # noqa: BLE001 - a timeout or a restarting API server costs the rack, never the collector
            self._once("error", type(exc).__name__, logging.WARNING, "cannot read Node %s for its rack (%s: %s); "
                       "keeping rack %r until the next inventory heartbeat", self.node, type(exc).__name__, exc,
                       self.last)
            return self.last
        for kind in ("refused", "missing", "error"):
            self._said.pop(kind, None)
        value = labels.get(self.label)
        if value is None or value == "":
            self._once("unlabelled", "", logging.INFO, "Node %s has no label %s: inventories carry no rack",
                       self.node, self.label)
            self.last = None
            return None
        if not valid_rack(value):
            self._once("invalid", str(value)[:K8S_LABEL_MAX + 1], logging.WARNING,
                       "Node %s label %s = %.80r is not a rack (1-%d letters, digits, '-', '_' or '.'); not "
                       "published (never cut: two racks must not merge)", self.node, self.label, value,
                       K8S_LABEL_MAX)
            self.last = None
            return None
        self._said.clear()
        if value != self.last:
            log.info("Node %s: rack %s (label %s)", self.node, value, self.label)
        self.last = value
        return value


def from_environment(env: Mapping[str, str], node: str, label: str, *, kubeconfig: str | None = None,
                     timeout: float = 5.0) -> NodeLabelRack | None:
    """The rack source when running in a Kubernetes pod (or given a kubeconfig) and `label` is set,
    else None. `timeout` bounds each GET: a collector never waits longer than that for its rack."""
    if not label:
        return None
    if not kubeconfig and not env.get("KUBERNETES_SERVICE_HOST"):
        log.info("not on Kubernetes (no KUBERNETES_SERVICE_HOST): no rack from a Node label (--rack VALUE gives one)")
        return None
    from xidstream.transport.kube import make_client

    try:
        client = make_client(kubeconfig, timeout=timeout, field_manager="xidstream-collector")
    except Exception as exc:  # noqa: BLE001 - the collector runs on without a rack
        log.warning("%s; inventories carry no rack", exc)
        return None
    return NodeLabelRack(client, node, label)
