"""The exporter role's least-privilege ACLs (transport/acls.py), read from the pure
`acl_bindings()`; the secure broker's tests (tests/integration/test_export_secure.py) use them."""

from __future__ import annotations

from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType

from xidstream.transport.acls import ROLE_NAMES, acl_bindings


def _grants(principal: str, prefix: str = "p.") -> set[tuple[str, str, str, str]]:
    return {(b.restype.name, b.name, b.resource_pattern_type.name, b.operation.name)
            for b in acl_bindings(prefix) if b.principal == principal}


def test_the_exporter_reads_findings_and_telemetry_and_writes_only_its_document_topics():
    assert "exporter" in ROLE_NAMES
    got = _grants("User:exporter")
    reads = ("gpu.alerts", "gpu.remediation", "gpu.remediation.results", "gpu.remediation.approvals",
             "gpu.samples", "gpu.xid", "gpu.processes", "gpu.workloads", "gpu.inventory", "gpu.counters")
    want = {("TOPIC", f"p.{t}", "LITERAL", op) for t in reads for op in ("READ", "DESCRIBE")}
    want |= {("TOPIC", f"p.xidstream.findings.{f}", "LITERAL", op) for f in ("ocsf", "ecs")
             for op in ("WRITE", "DESCRIBE")}
    want |= {("GROUP", "p.xidstream-export-", "PREFIXED", op) for op in ("READ", "DESCRIBE")}
    assert got == want
    # nothing it could forge: no write on a contract topic, no group of another role
    assert not {g for g in got if g[3] == "WRITE" and not g[1].startswith("p.xidstream.findings.")}


def test_the_exporters_default_groups_are_under_its_granted_prefix():
    from xidstream.transport.acls import EXPORT_GROUP_PREFIX, export_group

    for fmt in ("ocsf", "ecs"):
        for kind in ("kafka", "jsonl", "parquet"):
            assert export_group("p.", fmt, kind) == f"p.xidstream-export-{fmt}-{kind}"
            assert export_group("p.", fmt, kind).startswith("p." + EXPORT_GROUP_PREFIX)
    # no other role's group lies under it (a PREFIXED grant reaches every name it starts)
    other_groups = {b.name for b in acl_bindings("p.") if b.restype == ResourceType.GROUP
                    and b.principal != "User:exporter"}
    assert not any(g.startswith("p." + EXPORT_GROUP_PREFIX) for g in other_groups)
    assert all(b.operation != AclOperation.ALL for b in acl_bindings("p.") if b.principal == "User:exporter")
    assert ResourcePatternType.PREFIXED in {b.resource_pattern_type for b in acl_bindings("p.")}


def test_the_collector_writes_what_the_registry_says_it_collects_and_the_processor_reads_only_its_inputs():
    from xidstream.schemas.topics import COLLECTED_TOPICS as REGISTRY_COLLECTED, INPUT_TOPICS as REGISTRY_INPUTS
    from xidstream.transport.acls import COLLECTED_TOPICS, INPUT_TOPICS

    assert set(COLLECTED_TOPICS) == set(REGISTRY_COLLECTED) and set(INPUT_TOPICS) == set(REGISTRY_INPUTS)
    writes = {g[1] for g in _grants("User:collector") if g[3] == "WRITE"}
    assert writes == {f"p.{t}" for t in COLLECTED_TOPICS}
    reads = {g[1] for g in _grants("User:processor") if g[0] == "TOPIC" and g[3] == "READ"}
    # the counters are trended (streams.degrade): read like the other inputs
    assert "p.gpu.counters" in reads and "p.gpu.samples" in reads
    assert reads == {f"p.{t}" for t in INPUT_TOPICS} | {"p.gpu.remediation.results", "p.xidstream.identities"}
    assert ("TOPIC", "p.gpu.counters", "LITERAL", "DESCRIBE") in _grants("User:processor")
