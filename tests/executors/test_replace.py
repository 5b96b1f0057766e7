"""REPLACE_NODE's backends without an API server: the choices, and the answers that need no
Machine or NodeClaim (the rest is tests/integration/test_executors_replace.py, on the real CRDs)."""

from __future__ import annotations

import argparse

import pytest
from lightkube.models.core_v1 import Node, NodeSpec
from lightkube.models.meta_v1 import ObjectMeta

import xidstream.executors.replace as replace
from xidstream.executors.cluster import ClusterActions
from xidstream.executors.replace import REPLACE_BACKENDS, ClusterApiReplace, KarpenterReplace
from xidstream.schemas.errors import ConfigError
from tests.executors.helpers import command
from xidstream import execute_cmd


def node(annotations: dict | None = None, labels: dict | None = None) -> Node:
    return Node(metadata=ObjectMeta(name="gpu-1", annotations=annotations, labels=labels), spec=NodeSpec())


class NoClient:
    """Any API call is a test failure: these answers must come before one."""

    def __getattr__(self, name):
        raise AssertionError(f"unexpected API call {name}")


def test_the_cli_offers_exactly_the_backends_and_label_stays_the_default():
    parser = argparse.ArgumentParser()
    execute_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["execute", "--scope", "cluster"])
    assert args.replace_backend == "label" == replace.DEFAULT_REPLACE_BACKEND
    action = next(a for a in parser._subparsers._group_actions[0].choices["execute"]._actions
                  if a.dest == "replace_backend")
    assert tuple(action.choices) == REPLACE_BACKENDS


def test_an_unknown_backend_or_a_management_kubeconfig_without_cluster_api_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="not one of label, cluster-api, karpenter, condition"):
        ClusterActions(NoClient(), replace_backend="mhc")
    parser = argparse.ArgumentParser()
    execute_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["execute", "--scope", "cluster", "--replace-backend", "karpenter",
                              "--replace-kubeconfig", str(tmp_path / "mgmt"), "--kubeconfig", str(tmp_path / "k")])
    with pytest.raises(ConfigError, match="--replace-kubeconfig names the Cluster API management cluster"):
        execute_cmd.build_executor(args)


@pytest.mark.parametrize("annotations, missing", [
    (None, "cluster.x-k8s.io/machine and cluster.x-k8s.io/cluster-namespace"),
    ({"cluster.x-k8s.io/machine": "m-1"}, "cluster.x-k8s.io/cluster-namespace"),
])
def test_cluster_api_names_the_missing_node_annotation_before_any_call(annotations, missing):
    outcome, detail, acted = ClusterApiReplace(NoClient()).replace(command("gpu-1", "REPLACE_NODE"),
                                                                   node(annotations), dry_run=False)
    assert (outcome, acted) == ("failed", False)
    assert f"node gpu-1 has no annotation {missing}:" in detail and detail.endswith("nothing was done")


def test_cluster_api_and_karpenter_say_when_their_api_is_not_served(monkeypatch):
    monkeypatch.setattr(replace, "discover_version", lambda client, group, resource, preferred=(): None)
    capi = node({"cluster.x-k8s.io/machine": "m-1", "cluster.x-k8s.io/cluster-namespace": "ns"})
    outcome, detail, _ = ClusterApiReplace(NoClient()).replace(command("gpu-1", "REPLACE_NODE"), capi, False)
    assert outcome == "failed" and "serves no Machine resource (cluster.x-k8s.io)" in detail
    assert "--replace-kubeconfig" in detail
    outcome, detail, _ = KarpenterReplace(NoClient()).replace(command("gpu-1", "REPLACE_NODE"), node(), False)
    assert outcome == "failed" and "serves no NodeClaim resource (karpenter.sh)" in detail
