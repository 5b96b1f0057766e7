"""The least-privilege ACLs the topic contract implies, one principal per role.

    collector  WRITE the input topics (nothing else: a compromised node cannot write commands)
    processor  READ the inputs, gpu.remediation.results and xidstream.identities; WRITE gpu.alerts, gpu.remediation,
               xidstream.deadletter; ALL on its two internal topics
               (`<prefix>xidstream.results-by-gpu`, `<prefix>xidstream.fleet`) and on its changelogs and faust's assignor
               topic (prefix `<app id>-`); its consumer group (prefix `<app id>`)
    executor   (the node executors) READ gpu.remediation and gpu.remediation.approvals; WRITE
               gpu.remediation.results; no consumer group to commit in (DESCRIBE on the
               node executors' group names only, for librdkafka's coordinator lookup): every node
               holds this user, so any group it could commit in, node A could commit to its end or
               rewind for node B (T2). A node executor assigns itself the partitions and keeps its
               position on its own disk (executors.runner.Cursor)
    cluster-executor  the same topics, and WRITE xidstream.identities (it enrolls node identities);
               exactly its own group `<prefix>xidstream-executor-cluster`
               (LITERAL): with a node's credentials (threat T2) the cluster executor's group was
               committed to its end, after which it handled none of the signed commands, or
               rewound to replay them
    exporter   (`xidstream export`) READ the finding topics (gpu.alerts, gpu.remediation,
               gpu.remediation.results, gpu.remediation.approvals) and the telemetry topics it lands
               as Parquet (the input topics); its consumer groups: the prefix
               `<prefix>xidstream-export-` (PREFIXED), which every default group of the command
               (`xidstream-export-FORMAT-KIND`) starts with; WRITE the document topics
               `<prefix>xidstream.findings.ocsf` and `<prefix>xidstream.findings.ecs` (LITERAL:
               a prefix such as `gpu.alerts` would let it write fake alerts into gpu.alerts itself)
    admin      a super user (the broker's `super.users`): topics, ACLs, approvals

`acl_bindings()` is a pure function (tests read it); `apply_acls()` creates them through the Admin
API (idempotent: an existing binding is created again without error). The principals are
`User:<role>` by default; a cluster with other user names passes `principals`.
"""

from __future__ import annotations

from typing import Mapping

from xidstream.schemas.errors import TopicError
from xidstream.transport.config import KafkaConfig

__all__ = ["INPUT_TOPICS", "COLLECTED_TOPICS", "ROLE_NAMES", "acl_bindings", "apply_acls", "CLUSTER_EXECUTOR_GROUP",
           "NODE_EXECUTOR_GROUP_PREFIX", "executor_group", "EXPORT_GROUP_PREFIX", "EXPORT_READ_TOPICS", "EXPORT_TOPICS",
           "export_group"]

INPUT_TOPICS = ("gpu.inventory", "gpu.samples", "gpu.processes", "gpu.xid", "gpu.workloads", "gpu.counters")
# what a collector writes: the inputs (schemas.topics COLLECTED_TOPICS, which a test compares)
COLLECTED_TOPICS = INPUT_TOPICS
ROLE_NAMES = ("collector", "processor", "executor", "cluster-executor", "exporter")
# what `xidstream export` reads: the findings it maps to OCSF/ECS (the same tuple as
# exporters.pipeline.FINDING_TOPICS, which a test compares: transport does not import exporters)
EXPORT_READ_TOPICS = ("gpu.alerts", "gpu.remediation", "gpu.remediation.results", "gpu.remediation.approvals")
# the documents' topics the exporter may write (`--to kafka:<prefix>xidstream.findings.ocsf`)
EXPORT_TOPICS = ("xidstream.findings.ocsf", "xidstream.findings.ecs")
EXPORT_GROUP_PREFIX = "xidstream-export-"


CLUSTER_EXECUTOR_GROUP = "xidstream-executor-cluster"
NODE_EXECUTOR_GROUP_PREFIX = "xidstream-executor-node-"


def executor_group(topic_prefix: str, scope: str, node: str | None = None) -> str:
    """The consumer group of an executor: exactly what the ACLs grant the cluster executor's role.
    A node executor's is only the `group.id` librdkafka insists on: it never joins or commits it."""
    if scope == "cluster":
        return f"{topic_prefix}{CLUSTER_EXECUTOR_GROUP}"
    return f"{topic_prefix}{NODE_EXECUTOR_GROUP_PREFIX}{node}"


def export_group(topic_prefix: str, fmt: str, kind: str) -> str:
    """The default consumer group of `xidstream export --format FMT --to KIND:...`: under the
    exporter role's group prefix."""
    return f"{topic_prefix}{EXPORT_GROUP_PREFIX}{fmt}-{kind}"


def acl_bindings(topic_prefix: str = "", *, app_id: str | None = None,
                 principals: Mapping[str, str] | None = None) -> list:
    """confluent-kafka `AclBinding`s for every role, for topics under `topic_prefix` and a
    processor whose app id is `app_id` (default `<prefix>xidstream-processor`, as `create_app`)."""
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, ResourcePatternType,
                                       ResourceType)

    p = topic_prefix
    app_id = app_id or f"{p}xidstream-processor"
    who = {role: f"User:{role}" for role in ROLE_NAMES}
    who.update(principals or {})
    out: list = []

    def allow(role: str, rtype, name: str, ops, pattern=ResourcePatternType.LITERAL) -> None:
        for op in ops:
            out.append(AclBinding(rtype, name, pattern, who[role], "*", op, AclPermissionType.ALLOW))

    T, G = ResourceType.TOPIC, ResourceType.GROUP
    W, R, D = AclOperation.WRITE, AclOperation.READ, AclOperation.DESCRIBE
    PREFIXED = ResourcePatternType.PREFIXED
    for t in COLLECTED_TOPICS:
        allow("collector", T, p + t, (W, D))
    # processor
    for t in (*INPUT_TOPICS, "gpu.remediation.results"):
        allow("processor", T, p + t, (R, D))
    for t in ("gpu.alerts", "gpu.remediation", "xidstream.deadletter"):
        allow("processor", T, p + t, (W, D))
    for t in ("gpu.remediation.approvals",):
        allow("processor", T, p + t, (D,))  # its start-up check lists every contract topic
    allow("processor", T, p + "xidstream.identities", (R, D))  # whose MAC it believes (transport.identity)
    allow("processor", T, p + "xidstream.results-by-gpu", (AclOperation.ALL,))
    allow("processor", T, p + "xidstream.fleet", (AclOperation.ALL,))
    allow("processor", T, app_id + "-", (AclOperation.ALL,), PREFIXED)  # changelogs, faust's assignor topic
    allow("processor", G, app_id, (R, D), PREFIXED)
    # executors: the node executors share a role and use no group; the cluster executor has its
    # own role, and its group is named exactly, so no node's credentials reach it
    for role in ("executor", "cluster-executor"):
        for t in ("gpu.remediation", "gpu.remediation.approvals"):
            allow(role, T, p + t, (R, D))
        allow(role, T, p + "gpu.remediation.results", (W, D))
    # DESCRIBE only: librdkafka looks up the coordinator of the group.id every consumer must
    # have (FindCoordinator needs DESCRIBE), but committing or rewinding an offset needs READ
    allow("executor", G, p + NODE_EXECUTOR_GROUP_PREFIX, (D,), PREFIXED)
    allow("cluster-executor", G, p + CLUSTER_EXECUTOR_GROUP, (R, D))
    allow("cluster-executor", T, p + "xidstream.identities", (W, D))  # the enroller's enrollments
    # exporter: reads findings and telemetry, writes only its documents' topics
    for t in (*EXPORT_READ_TOPICS, *COLLECTED_TOPICS):
        allow("exporter", T, p + t, (R, D))
    for t in EXPORT_TOPICS:
        allow("exporter", T, p + t, (W, D))
    allow("exporter", G, p + EXPORT_GROUP_PREFIX, (R, D), PREFIXED)
    return out


def apply_acls(settings: KafkaConfig, *, app_id: str | None = None, principals: Mapping[str, str] | None = None,
               timeout: float = 30.0) -> int:
    """Create the bindings of `acl_bindings(settings.topic_prefix, ...)` with `settings`' client
    (a principal allowed to ALTER the cluster, e.g. a super user). Returns how many."""
    from confluent_kafka import KafkaException

    from xidstream.transport.kafka import admin

    bindings = acl_bindings(settings.topic_prefix, app_id=app_id, principals=principals)
    client = admin(settings)
    for binding, fut in client.create_acls(bindings, request_timeout=timeout).items():
        try:
            fut.result()
        except KafkaException as exc:
            raise TopicError(f"cannot create ACL {binding}: {exc.args[0]}") from None
    return len(bindings)
