"""`xidstream export` on the secure broker (SASL_SSL, SCRAM, the contract's ACLs): the `exporter`
role's ACLs (transport/acls.py) are enough to export, and a principal missing one of them is told
which, within bounded time, instead of reading 0 records for ever.

Each test grants one of the broker's users the exporter role's bindings (all, or all but one) on a
fresh topic prefix, as `admin`, and revokes them at the end: a missing ACL is tested without
touching the `exporter` user's own grants. (The tests once made SCRAM users of their own: deleting
them broke every user's credentials at the local KRaft broker's next start.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import (AclBinding, AclBindingFilter, AclOperation, AclPermissionType, NewTopic, ResourcePatternType,
                                   ResourceType)

from xidstream.exporters import ocsf
from xidstream.schemas import Approval
from xidstream.schemas.codec import encode
from xidstream.schemas.topics import spec_for_model
from tests.exporters.helpers import alerts, commands_and_results
from xidstream.transport.acls import acl_bindings
from xidstream.transport.kafka import admin, create_topics, delete_run, producer_config, read_all
from xidstream.settings import Settings

# slow (make test-all only): the secure broker's exporter ACL paths
pytestmark = [pytest.mark.broker, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _records() -> list:
    recs = alerts()[:4] + [x for x in commands_and_results() if x.action.value != "RECORD"][:4]
    a = recs[0]
    return recs + [Approval(ts=a.ts, node=a.node, approval_id="ap-1", command_id="cmd-0", approved_by="ops",
                            expires_at=a.ts + timedelta(minutes=15))]


RECORDS = _records()  # once: each record's event_id is made when it is


def _filter(b) -> AclBindingFilter:
    return AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation,
                            b.permission_type)


@pytest.fixture(scope="module")
def secure_run(secure_kafka):
    """A topic prefix on the secure broker with the contract's topics, the output topic and a few
    findings (written as admin); `user(role, drop)` grants a user the exporter role's ACLs."""
    prefix = f"x{uuid.uuid4().hex[:8]}."
    adm = Settings.from_env({}, kafka_config=secure_kafka.client_file("admin")).with_(
        topic_prefix=prefix, partitions=2, node="node-a")
    create_topics(adm)
    client = admin(adm)
    out_topic = f"{prefix}xidstream.findings.ocsf"
    client.create_topics([NewTopic(out_topic, num_partitions=1, replication_factor=1)])[out_topic].result(30)
    p = Producer(producer_config(adm))
    for r in RECORDS:
        spec = spec_for_model(type(r))
        p.produce(adm.topics.name(spec.name), encode(r), key=spec.key_for(r))
    assert p.flush(30) == 0
    granted: list = []

    def user(role: str, drop=lambda b: False) -> Path:
        """The properties file of the secure broker's user `role`, granted the exporter role's ACLs
        on this prefix but those `drop(binding)` names (revoked, if an earlier test granted them).
        The broker's other users stand in for principals that are not `exporter`: under this
        test's fresh prefix they have no other grant."""
        mine = [AclBinding(b.restype, b.name, b.resource_pattern_type, f"User:{role}", b.host, b.operation,
                           b.permission_type) for b in acl_bindings(prefix) if b.principal == "User:exporter"]
        assert mine, "the exporter role has no ACLs"
        for fut in client.create_acls([b for b in mine if not drop(b)]).values():
            fut.result(30)
        revoke = [_filter(b) for b in mine if drop(b)]
        for fut in (client.delete_acls(revoke).values() if revoke else ()):
            fut.result(30)
        granted.extend(mine)
        time.sleep(1.0)  # the ACLs reach the authorizer through the metadata log
        return secure_kafka.client_file(role)

    yield {"settings": adm, "prefix": prefix, "out": out_topic, "user": user}
    filters = list({(b.restype, b.name, b.resource_pattern_type, b.principal, b.operation): _filter(b)
                    for b in granted}.values())
    for fut in (client.delete_acls(filters).values() if filters else ()):
        fut.result(30)
    delete_run(adm)


def _export(props: Path, prefix: str, out: str, *extra: str, timeout: float = 120) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XIDSTREAM_")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "xidstream.cli", "export", "--kafka-config", str(props),
                           "--topic-prefix", prefix, "--to", f"kafka:{out}", "--idle-exit", "3", *extra],
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stderr, time.monotonic() - t0


def test_the_broker_grants_the_exporter_role_its_acls(secure_kafka):
    """`xidstream broker start --secure` applies transport.acls: the exporter role's too."""
    adm = Settings.from_env({}, kafka_config=secure_kafka.client_file("admin"))
    f = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, "User:exporter", None,
                         AclOperation.ANY, AclPermissionType.ANY)
    client = admin(adm)
    # (bindings of runs under a topic prefix, left on a broker state that outlives them, are not
    # the broker's own: only unprefixed names are compared)
    got = [b for b in client.describe_acls(f, request_timeout=30).result()
           if b.name.startswith(("gpu.", "xidstream")) or b.name == "*"]
    key = lambda b: (b.restype, b.name, b.resource_pattern_type, b.operation)  # noqa: E731
    want = [b for b in acl_bindings("") if b.principal == "User:exporter"]
    assert want and sorted(map(key, got)) == sorted(map(key, want))


def test_the_exporter_role_exports_with_its_own_acls(secure_run):
    r = secure_run
    rc, err, _ = _export(r["user"]("collector"), r["prefix"], r["out"])
    assert rc == 0, err[-3000:]
    assert f"group {r['prefix']}xidstream-export-ocsf-kafka" in err  # the default group: under the granted prefix
    want = {x.event_id for x in RECORDS if ocsf.to_ocsf(x) is not None}  # approvals too, once mapped
    assert len(want) >= 8
    msgs = read_all(r["settings"], [r["out"]], expected=len(want), timeout=30)
    assert sorted(orjson.loads(m.value())["metadata"]["original_event_uid"] for m in msgs) == sorted(want), err[-2000:]


@pytest.mark.parametrize("role, missing, drop, message", [
    ("processor", "group", lambda b: b.restype == ResourceType.GROUP,
     "is not authorized to use consumer group {prefix}xidstream-export-group"),
    ("executor", "write", lambda b: b.name.endswith("xidstream.findings.ocsf") and b.operation == AclOperation.WRITE,
     "is not authorized to write to {prefix}xidstream.findings.ocsf"),
    ("cluster-executor", "describe", lambda b: b.name.endswith("xidstream.findings.ocsf"),
     "is not authorized to describe output topic {prefix}xidstream.findings.ocsf"),
    ("collector", "read", lambda b: b.name.endswith("gpu.remediation.results") and b.operation == AclOperation.READ,
     "is not authorized to read"),
], ids=["group", "write", "describe", "read"])
def test_a_missing_acl_is_a_clear_error_in_bounded_time(secure_run, role, missing, drop, message):
    """A refused group was logged once, then the exporter read 0 records for ever (--idle-exit
    counted only from an assignment that never came); a topic it may not describe was reported as
    missing. Each now exits non-zero, naming the principal and what to grant."""
    r = secure_run
    props = r["user"](role, drop)
    # a group of its own (under the granted prefix): the committed offsets of another test's
    # export would leave it nothing to read
    rc, err, took = _export(props, r["prefix"], r["out"], "--group", f"{r['prefix']}xidstream-export-{missing}")
    assert rc == 2, err[-3000:]
    assert message.format(prefix=r["prefix"]) in err and f"User:{role} " in err, err[-3000:]
    assert took < 60, err[-3000:]
