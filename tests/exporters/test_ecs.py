"""Every ECS document uses ECS fields with their ECS types (exporters.ecs.ECS_FIELD_TYPES, from the
ECS 8.17 field reference, generated/ecs/ecs_flat.yml); `xidstream.*` is our custom namespace."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from xidstream.exporters.ecs import CUSTOM_NAMESPACE, ECS_ARRAY_FIELDS, ECS_FIELD_TYPES, to_ecs
from xidstream.schemas import Classification, RemediationResult
from tests.exporters.helpers import alerts, commands_and_results
from tests.factories import UUID1, one_of_each

_RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
_LONG = (-(2**63), 2**63 - 1)


def _flatten(doc: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in doc.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and name not in ("labels",) and ECS_FIELD_TYPES.get(name) != "object":
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _ok(ecs_type: str, value, array: bool = True) -> bool:
    if isinstance(value, list) and not array:
        return False  # ECS defines one value here
    values = value if isinstance(value, list) else [value]
    for v in values:
        if ecs_type in ("keyword", "match_only_text", "text", "wildcard", "constant_keyword"):
            if not isinstance(v, str):
                return False
        elif ecs_type == "long":
            if isinstance(v, bool) or not isinstance(v, int) or not _LONG[0] <= v <= _LONG[1]:
                return False
        elif ecs_type in ("float", "scaled_float", "double"):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return False
        elif ecs_type == "date":
            if not (isinstance(v, str) and _RFC3339.match(v) and datetime.fromisoformat(v.replace("Z", "+00:00"))):
                return False
        elif ecs_type == "object":
            if not isinstance(v, dict):
                return False
        else:
            raise AssertionError(f"no check for ECS type {ecs_type}")
    return True


def ecs_errors(doc: dict) -> list[str]:
    errors = []
    for name, value in _flatten({k: v for k, v in doc.items() if k != CUSTOM_NAMESPACE}).items():
        if name not in ECS_FIELD_TYPES:
            errors.append(f"{name}: not an ECS field of the table")
        elif not _ok(ECS_FIELD_TYPES[name], value, name in ECS_ARRAY_FIELDS):
            errors.append(f"{name}: {value!r} is not an ECS {ECS_FIELD_TYPES[name]}")
    return errors


@pytest.mark.parametrize("record", [pytest.param(r, id=f"{type(r).__name__}-{i}") for i, r in
                                    enumerate(alerts() + commands_and_results() + one_of_each())
                                    if to_ecs(r) is not None])
def test_every_document_has_ecs_types(record):
    doc = to_ecs(record)
    assert ecs_errors(doc) == []
    storm = getattr(record, "classification", None) is Classification.FLEET_STORM
    assert doc["event"]["id"] == record.event_id and (storm or doc["host"]["name"] == record.node)


def test_the_check_can_fail():
    doc = to_ecs(alerts()[0])
    doc["event"]["severity"] = "high"
    doc["host"]["nmae"] = "x"
    doc["@timestamp"] = "yesterday"
    doc["process"] = {"pid": [1, 2]}  # a list where ECS defines one value
    assert len(ecs_errors(doc)) == 4


def test_an_alert_names_xid_gpu_host_and_verdict():
    a = next(a for a in alerts() if a.classification is Classification.GPU_WEDGED)
    doc = to_ecs(a)
    assert doc["event"]["kind"] == "alert" and doc["event"]["code"] == "43"
    assert doc["device"]["id"] == UUID1 and doc["host"]["name"] == "node-a"
    assert doc["rule"]["name"] == "GPU_WEDGED" and doc["process"]["pid"] == 4242


def test_results_have_an_outcome():
    docs = [to_ecs(r) for r in commands_and_results() if isinstance(r, RemediationResult)]
    assert {d["event"]["outcome"] for d in docs} == {"success", "failure"}
