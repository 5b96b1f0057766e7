"""The client layer (executors/kube.py) on the real API server: list-then-watch re-lists on 410
Gone, and API discovery finds the resource.k8s.io version that serves DeviceTaintRule."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from lightkube.resources.core_v1 import Node

from xidstream.executors.kube import discover_version, list_then_watch, make_client

pytestmark = pytest.mark.kube


class _FirstListStale:
    """The real client, except that its first list reports a resourceVersion long compacted away
    (what a watcher sees after a long disconnect): the real server then answers the watch 410."""

    def __init__(self, client):
        self.client, self.lists = client, 0

    def list(self, *a, **kw):
        self.lists += 1
        listing = self.client.list(*a, **kw)
        items = list(listing)
        rv = "2" if self.lists == 1 else listing.resourceVersion

        class _L(list):
            resourceVersion = rv
        return _L(items)

    def watch(self, *a, **kw):
        return self.client.watch(*a, **kw)


def _server_answers_410_for_rv_2(kube) -> bool:
    """A fresh server still holds resourceVersion 2 in its watch cache (it answers the watch), and
    the cache keeps events for minutes: only a server that has run a while answers it 410 Gone."""
    import subprocess

    out = subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), "get", "--raw",
                          "/api/v1/nodes?watch=1&resourceVersion=2&timeoutSeconds=1"],
                         capture_output=True, text=True, timeout=30)
    return '"code":410' in out.stdout or "410" in out.stderr or "too old" in (out.stdout + out.stderr)


def test_list_then_watch_relists_on_410_and_sees_a_later_node(kube):
    if not _server_answers_410_for_rv_2(kube):
        pytest.skip("this API server still serves resourceVersion 2 from its watch cache (a fresh server): "
                    "no real 410 to test against")
    client = _FirstListStale(make_client(kube.kubeconfig))
    run = uuid.uuid4().hex[:6]
    name = f"watch-{run}"
    seen: list[tuple[str, str]] = []

    def later():
        time.sleep(1.0)
        kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                               "metadata": {"name": name, "labels": {"xs.watch": run}}})

    threading.Thread(target=later, daemon=True).start()

    def on_event(typ, node):
        seen.append((typ, node.metadata.name))
        return node.metadata.name != name

    t = threading.Thread(target=list_then_watch, args=(client, Node, on_event), kwargs={"labels": {"xs.watch": run}},
                         daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive()
    assert client.lists >= 2  # the 410 made it list again
    assert (("ADDED", name) in seen) or (("LISTED", name) in seen)


def test_discovery_finds_the_served_device_taint_rule_version(kube):
    client = make_client(kube.kubeconfig)
    assert discover_version(client, "resource.k8s.io", "devicetaintrules") == "v1alpha3"
    assert discover_version(client, "resource.k8s.io", "no-such-things") is None
    assert discover_version(client, "no-such-group.example.com", "things") is None
