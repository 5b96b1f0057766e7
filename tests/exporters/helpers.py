"""Records of every kind the exporter maps, and the validators the tests check them with."""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache

from xidstream.schemas import Action, Alert, Classification, Evidence, EvidenceEntry, Outcome, RemediationCommand, \
    RemediationResult, Severity
from tests.factories import NODE, T0, UUID1


def alerts() -> list[Alert]:
    """Every classification in every state; a storm and a GPU whose UUID was never resolved."""
    ev = Evidence(node=NODE, gpu_uuid=UUID1, gpu_index=1, pci_bus_id="0000:01:00",
                  timeline=[EvidenceEntry(ts=T0, kind="xid", summary="Xid 13", data={"xid": 13, "pid": 4242}),
                            EvidenceEntry(ts=T0 + timedelta(seconds=63), kind="xid", summary="Xid 43",
                                          data={"xid": 43})],
                  sample_stats={"pinned_s": 60.0, "util_min": 100.0, "mem_max_mib": 0.0, "power_avg_w": 110.0},
                  xid_counts={"13": 3, "31": 1, "43": 1}, distinct_pids=[4242, 4243], pod_uids=["pod-1"])
    out = []
    for i, cls in enumerate(Classification):
        for state, sev in (("open", Severity.info), ("updated", Severity.warning), ("resolved", Severity.critical)):
            gpu = None if cls is Classification.FLEET_STORM else UUID1
            out.append(Alert(ts=T0 + timedelta(seconds=i), node=NODE, alert_id=f"a{i}{state}", incident_id=f"inc-{i}",
                             gpu_uuid=gpu, pci_bus_id="0000:01:00" if gpu else None, classification=cls, severity=sev,
                             state=state, summary=f"{cls.value} {state}",
                             evidence=ev if gpu else Evidence(node=NODE),
                             recommended_steps=["cordon", "drain"] if state != "resolved" else []))
    out.append(Alert(ts=T0, node=NODE, alert_id="u1", incident_id="inc-u", gpu_uuid=None, pci_bus_id="0000:02:00",
                     classification=Classification.GPU_SUSPECT, severity=Severity.warning, summary="unresolved GPU",
                     evidence=Evidence(node=NODE, pci_bus_id="0000:02:00", xid_counts={"79": 1})))
    return out


def commands_and_results() -> list[RemediationCommand | RemediationResult]:
    out: list = []
    for i, action in enumerate(Action):
        cid = f"cmd-{i}"
        out.append(RemediationCommand(ts=T0, node=NODE, command_id=cid, incident_id="inc-1", gpu_uuid=UUID1,
                                      gpu_index=1, pci_bus_id="0000:01:00", action=action, step=i, reason="because",
                                      expires_at=T0 + timedelta(minutes=15), requires_approval=i % 2 == 0))
        for outcome in Outcome:
            out.append(RemediationResult(ts=T0 + timedelta(seconds=5), node=NODE, command_id=cid, incident_id="inc-1",
                                         gpu_uuid=UUID1, action=action, outcome=outcome, detail="d"))
    return out


@lru_cache(maxsize=None)
def ocsf_validator(class_name: str, profiles: tuple[str, ...] = ()):
    """A JSON Schema validator for one OCSF class, from the schema embedded in `ocsf-json-schema`
    (offline), with its objects resolved into `$defs`."""
    from jsonschema import Draft202012Validator
    from ocsf_json_schema import OcsfJsonSchemaEmbedded, get_ocsf_schema

    from xidstream.exporters.ocsf import OCSF_VERSION

    schema = OcsfJsonSchemaEmbedded(get_ocsf_schema(version=OCSF_VERSION)).get_class_schema(class_name, list(profiles))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def ocsf_errors(event: dict) -> list[str]:
    from xidstream.exporters.ocsf import class_name_of

    v = ocsf_validator(class_name_of(event["class_uid"]), tuple(sorted(event["metadata"].get("profiles", []))))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(event)]
