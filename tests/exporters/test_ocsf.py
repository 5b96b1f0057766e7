"""Every OCSF event validates against its class's JSON schema (OCSF 1.8.0, embedded offline by the
`ocsf-json-schema` package), and the mapping keeps the ids a SIEM correlates on."""

from __future__ import annotations

import pytest

from exporters.ocsf import OCSF_VERSION, to_ocsf
from schemas import Action, Classification, RemediationCommand
from tests.exporters.helpers import alerts, commands_and_results, ocsf_errors
from tests.factories import UUID1, one_of_each


def _cases():
    recs = alerts() + commands_and_results() + [r for r in one_of_each() if to_ocsf(r) is not None]
    return [pytest.param(r, id=f"{type(r).__name__}-{i}") for i, r in enumerate(recs)]


@pytest.mark.parametrize("record", _cases())
def test_every_event_validates_against_the_ocsf_schema_of_its_class(record):
    event = to_ocsf(record)
    assert event["metadata"]["version"] == OCSF_VERSION
    assert ocsf_errors(event) == []


def test_the_validator_rejects_a_broken_event():
    event = to_ocsf(alerts()[0])
    del event["finding_info"]["uid"]
    event["severity_id"] = 42
    errors = ocsf_errors(event)
    assert any("uid" in e for e in errors) and any("severity_id" in e for e in errors)


def test_an_incident_is_one_finding_created_updated_closed():
    by_state = {a.state: to_ocsf(a) for a in alerts() if a.incident_id == "inc-2"}
    assert {s: e["activity_id"] for s, e in by_state.items()} == {"open": 1, "updated": 2, "resolved": 3}
    assert {e["finding_info"]["uid"] for e in by_state.values()} == {"inc-2"}
    assert {e["class_uid"] for e in by_state.values()} == {2004}
    assert by_state["resolved"]["status_id"] == 4 and by_state["open"]["type_uid"] == 200401
    assert {s: e["severity_id"] for s, e in by_state.items()} == {"open": 1, "updated": 3, "resolved": 5}


def test_the_gpu_is_a_resource_with_its_uuid_and_the_node_the_device():
    a = next(a for a in alerts() if a.classification is Classification.GPU_WEDGED)
    e = to_ocsf(a)
    assert e["resources"] == [{"type": "GPU", "hostname": "node-a", "name": "GPU 1", "uid": UUID1,
                               "data": {"gpu_index": 1, "pci_bus_id": "0000:01:00"}}]
    assert e["device"]["hostname"] == "node-a"
    ev = e["evidences"]
    assert [x["data"]["xid"] for x in ev if x["name"].startswith("Xid")] == [13, 31, 43]
    assert [x["process"]["pid"] for x in ev if "process" in x] == [4242, 4243]
    assert [x["data"]["pod_uid"] for x in ev if x["name"] == "pod"] == ["pod-1"]
    assert next(x for x in ev if x["name"] == "sample_stats")["data"]["util_min"] == 100.0


def test_a_re_delivery_has_the_same_uid():
    a = alerts()[0]
    assert to_ocsf(a)["metadata"]["uid"] == a.event_id == to_ocsf(a.model_copy())["metadata"]["uid"]


def test_a_fleet_storm_is_an_incident_finding():
    e = to_ocsf(next(a for a in alerts() if a.classification is Classification.FLEET_STORM))
    assert e["class_uid"] == 2005 and e["finding_info_list"][0]["uid"].startswith("inc-")


def test_commands_and_results_correlate_by_command_uid():
    recs = commands_and_results()
    events = [to_ocsf(r) for r in recs]
    assert {e["class_uid"] for e in events} == {7001}
    for r, e in zip(recs, events):
        assert e["command_uid"] == r.command_id
    acts = {r.action: to_ocsf(r)["activity_id"] for r in recs if isinstance(r, RemediationCommand)}
    assert acts[Action.CORDON_NODE] == acts[Action.QUARANTINE_GPU] == 1  # Isolate
    assert acts[Action.DRAIN_NODE] == 2  # Evict
    assert acts[Action.UNCORDON_NODE] == acts[Action.RELEASE_GPU] == acts[Action.RESET_GPU] == 3  # Restore
    statuses = {to_ocsf(r)["status_id"] for r in recs if not isinstance(r, RemediationCommand)}
    assert statuses == {1, 2, 99}
