"""The node's rack on its GPU inventories (collectors.sources.rack): a Node label read through
lightkube, or --rack; over fakes, a socket that never answers, and the real local kube-apiserver
(the `kube` fixture)."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
import yaml

from xidstream.collectors.agent import INVENTORY_HEARTBEAT_S, Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakePynvml
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.sink import MemorySink
from xidstream.collectors.sources.rack import (
    DEFAULT_RACK_LABEL,
    FixedRack,
    NodeLabelRack,
    from_environment,
    valid_rack,
)
from xidstream.schemas import GpuInventory
from xidstream.schemas.errors import ConfigError
from xidstream.schemas.limits import K8S_LABEL_MAX
from xidstream.transport.kube import ApiError

T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)
LABEL = DEFAULT_RACK_LABEL


def _api_error(code: int) -> ApiError:
    return ApiError(status=SimpleNamespace(code=code, message=f"HTTP {code}"))


class FakeNodes:
    """A lightkube client's `get` of one Node: labels, or an exception, as the test sets them."""

    def __init__(self, labels: dict | None = None, error: Exception | None = None) -> None:
        self.labels = labels or {}
        self.error = error
        self.gets = 0

    def get(self, res, name):
        assert res.__name__ == "Node"
        self.gets += 1
        if self.error is not None:
            raise self.error
        return SimpleNamespace(metadata=SimpleNamespace(name=name, labels=dict(self.labels)))


def _inventories(sink) -> list[GpuInventory]:
    return [r for r in sink.records if isinstance(r, GpuInventory)]


def _rig(rack):
    sink = MemorySink()
    fake = FakePynvml([FakeGpu(0, "GPU-aaaa", "00000000:01:00.0"), FakeGpu(1, "GPU-bbbb", "00000000:02:00.0")])
    clock = [0.0]
    c = Collector(CollectorConfig(node="node-a", kmsg_wall_clock=False), sink, nvml=NvmlReader(fake),
                  nvml_events_thread=False, clock=lambda: clock[0], rack=rack)
    c.start(T0)
    return c, sink, clock


# -- the value -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["r1", "rack-07", "dc1.row3.rack_12", "A", "9" * K8S_LABEL_MAX])
def test_a_label_value_is_a_rack(value):
    assert valid_rack(value)


@pytest.mark.parametrize("value", ["", "9" * (K8S_LABEL_MAX + 1), "-r1", "r1.", "rack 1", "rack/1", "räck",
                                   "r1\n", None, 7])
def test_an_over_long_or_odd_value_is_not_a_rack(value):
    assert not valid_rack(value)


def test_an_explicit_rack_is_checked_at_start_and_never_cut():
    assert FixedRack("rack-12").read() == "rack-12"
    with pytest.raises(ValueError, match="--rack"):
        FixedRack("r" * (K8S_LABEL_MAX + 1))
    with pytest.raises(ValueError):
        FixedRack("row 3/rack 12")


# -- the Node label --------------------------------------------------------------------------------
def test_the_rack_is_the_nodes_label():
    nodes = FakeNodes({LABEL: "r7", "kubernetes.io/hostname": "n1"})
    assert NodeLabelRack(nodes, "n1", LABEL).read() == "r7"


def test_a_refusal_403_gives_no_rack_and_one_warning_naming_the_rbac_rule(caplog):
    nodes = FakeNodes({LABEL: "r7"})
    src = NodeLabelRack(nodes, "n1", LABEL)
    assert src.read() == "r7"
    nodes.error = _api_error(403)
    with caplog.at_level(logging.INFO, logger="xidstream.collectors.sources.rack"):
        assert src.read() is None  # the rack is no longer known: not the old one
        assert src.read() is None
    (said,) = caplog.records
    assert said.levelno == logging.WARNING
    assert "403" in said.getMessage() and "resources: [nodes], verbs: [get]" in said.getMessage()


def test_a_transient_failure_keeps_the_last_rack_and_is_said_once(caplog):
    nodes = FakeNodes({LABEL: "r7"})
    src = NodeLabelRack(nodes, "n1", LABEL)
    assert src.read() == "r7"
    with caplog.at_level(logging.INFO, logger="xidstream.collectors.sources.rack"):
        for error in (_api_error(503), _api_error(503), TimeoutError("timed out"), TimeoutError("again")):
            nodes.error = error
            assert src.read() == "r7"
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]  # one per kind of trouble
    nodes.error = None
    nodes.labels = {LABEL: "r8"}
    assert src.read() == "r8"


@pytest.mark.parametrize("value", ["r" * (K8S_LABEL_MAX + 1), "row 3/rack 12"])
def test_an_over_long_or_odd_label_is_not_published_never_cut_and_logged_once(caplog, value):
    src = NodeLabelRack(FakeNodes({LABEL: value}), "n1", LABEL)
    with caplog.at_level(logging.INFO, logger="xidstream.collectors.sources.rack"):
        assert src.read() is None
        assert src.read() is None
    (said,) = caplog.records
    assert said.levelno == logging.WARNING and "not published" in said.getMessage()


def test_an_unlabelled_node_or_a_missing_node_gives_no_rack():
    assert NodeLabelRack(FakeNodes({"other": "x"}), "n1", LABEL).read() is None
    assert NodeLabelRack(FakeNodes({LABEL: ""}), "n1", LABEL).read() is None
    assert NodeLabelRack(FakeNodes(error=_api_error(404)), "n1", LABEL).read() is None


def test_off_cleanly_and_quietly_when_not_on_kubernetes_or_without_a_label(caplog):
    with caplog.at_level(logging.WARNING):
        assert from_environment({}, "n1", LABEL) is None
        assert from_environment({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "n1", "") is None
    assert not caplog.records


def test_in_a_pod_without_a_service_account_no_rack_and_no_crash(monkeypatch, tmp_path):
    import transport.kube

    monkeypatch.setattr(transport.kube, "SERVICE_ACCOUNT_DIR", str(tmp_path / "none"))
    assert from_environment({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "n1", LABEL) is None


def test_a_silent_api_server_costs_the_bounded_timeout_not_the_start(tmp_path):
    """A server that takes the connection and never answers: the read gives up after `timeout`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # never accepted: the TLS handshake gets no answer
    port = listener.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "s", "cluster": {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "s", "user": "u"}}]}))
    try:
        src = from_environment({}, "n1", LABEL, kubeconfig=str(kubeconfig), timeout=0.5)
        started = time.monotonic()
        assert src.read() is None
        assert time.monotonic() - started < 5
    finally:
        listener.close()


# -- the inventories ---------------------------------------------------------------------------------
def test_every_inventory_carries_the_rack_and_a_relabel_goes_out_at_the_heartbeat():
    nodes = FakeNodes({LABEL: "r1"})
    c, sink, clock = _rig(NodeLabelRack(nodes, "node-a", LABEL))
    assert [(r.gpu_uuid, r.rack) for r in _inventories(sink)] == [("GPU-aaaa", "r1"), ("GPU-bbbb", "r1")]
    assert nodes.gets == 1
    nodes.labels = {LABEL: "r2"}
    clock[0] = 61  # an inventory refresh, before the heartbeat: the Node is not read again
    c.tick(T0 + timedelta(seconds=61))
    assert nodes.gets == 1 and len(_inventories(sink)) == 2
    clock[0] = 122
    c.tick(T0 + timedelta(seconds=INVENTORY_HEARTBEAT_S))
    assert nodes.gets == 2
    assert [r.rack for r in _inventories(sink)[2:]] == ["r2", "r2"]


def test_a_403_or_a_source_that_raises_gives_inventories_without_a_rack_and_no_crash():
    c, sink, _ = _rig(NodeLabelRack(FakeNodes(error=_api_error(403)), "node-a", LABEL))
    assert [r.rack for r in _inventories(sink)] == [None, None]

    class Broken:
        def read(self):
            raise RuntimeError("a bug")

    c, sink, clock = _rig(Broken())
    clock[0] = 61
    c.tick(T0 + timedelta(seconds=INVENTORY_HEARTBEAT_S))
    assert [r.rack for r in _inventories(sink)] == [None, None, None, None]


def test_no_rack_source_leaves_the_inventory_as_it_was():
    _, sink, _ = _rig(None)
    assert [r.rack for r in _inventories(sink)] == [None, None]


def test_the_cli_prefers_rack_refuses_a_bad_one_and_is_off_without_kubernetes(monkeypatch):
    from xidstream.cli import build_parser
    from xidstream.collect_cmd import _rack_source

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args = build_parser().parse_args(["collect"])
    assert args.rack_label == LABEL and args.rack is None
    assert _rack_source(args, "n1") is None
    args = build_parser().parse_args(["collect", "--rack", "r9", "--rack-label", ""])
    assert _rack_source(args, "n1").read() == "r9"
    with pytest.raises(ConfigError, match="--rack"):
        _rack_source(build_parser().parse_args(["collect", "--rack", "r" * 64]), "n1")


# -- the real API server -------------------------------------------------------------------------
def test_on_the_real_api_server_the_inventory_carries_the_nodes_rack_label(kube, tmp_path, caplog):
    """A Node labelled with its rack: the collector's inventories carry it, and a relabel is
    published at the heartbeat; a user the RBAC gives nothing gets no rack, one warning, no crash."""
    from xidstream.transport.kube import make_client

    node = f"rack-node-{uuid.uuid4().hex[:6]}"
    status, body = kube.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": node, "labels": {LABEL: "dc1-row3-rack12"}}})
    assert status == 201, body
    try:
        c, sink, clock = _rig(NodeLabelRack(make_client(kube.kubeconfig, timeout=5.0), node, LABEL))
        assert [r.rack for r in _inventories(sink)] == ["dc1-row3-rack12"] * 2
        status, body = kube.request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {LABEL: "dc1-row3-rack13"}}},
                                    content_type="application/merge-patch+json")
        assert status == 200, body
        clock[0] = 61
        c.tick(T0 + timedelta(seconds=INVENTORY_HEARTBEAT_S))
        assert [r.rack for r in _inventories(sink)[2:]] == ["dc1-row3-rack13"] * 2

        if kube.nobody_token is None:
            return  # a cluster of one's own (XIDSTREAM_KUBECONFIG): no user without rights to try
        cfg = yaml.safe_load(kube.kubeconfig.read_text())
        for user in cfg["users"]:
            user["user"] = {"token": kube.nobody_token}
        nobody = tmp_path / "nobody.kubeconfig"
        nobody.write_text(yaml.safe_dump(cfg))
        with caplog.at_level(logging.WARNING, logger="xidstream.collectors.sources.rack"):
            c, sink, clock = _rig(from_environment({}, node, LABEL, kubeconfig=str(nobody)))
            clock[0] = 61
            c.tick(T0 + timedelta(seconds=INVENTORY_HEARTBEAT_S))
        assert [r.rack for r in _inventories(sink)] == [None] * 4  # the first and the heartbeat, none with a rack
        (said,) = caplog.records
        assert "403" in said.getMessage() and "verbs: [get]" in said.getMessage()
    finally:
        kube.request("DELETE", f"/api/v1/nodes/{node}")
