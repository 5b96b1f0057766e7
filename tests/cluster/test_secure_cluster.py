"""The secure three-broker cluster (`xidstream broker start --brokers 3 --secure`: SASL_SSL,
SCRAM users per role, the contract's ACLs): a broker SIGKILLed while a collector publishes, and
the clients carry on with their own credentials through the leader change.

The collector role's `KafkaSink` publishes Xids before and after the leader of their partition is
killed; the processor role reads them back. Every record acknowledged is read, once, and no client
reported an authentication or authorization error.
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition

from xidstream.collectors.sink import KafkaSink
from xidstream.schemas.codec import decode_any
from xidstream.schemas.models import XidEvent
from xidstream.schemas.vocab import XidSource
from xidstream.transport.acls import apply_acls
from xidstream.transport.config import KafkaConfig
from xidstream.transport.kafka import check_replication, consumer_config, create_topics, delete_run

pytestmark = pytest.mark.cluster

GPU = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"


def _as(cluster, role: str, prefix: str) -> KafkaConfig:
    extra = {k: v for k, v in cluster.client_config(role).items() if k != "bootstrap.servers"}
    return KafkaConfig(bootstrap=cluster.bootstrap, topic_prefix=prefix, partitions=1, node="gpu-node-7",
                       replication_factor=3, min_insync_replicas=2, kafka_extra=extra)


def _xid(i: int) -> XidEvent:
    return XidEvent(node="gpu-node-7", gpu_uuid=GPU, xid=13, pci_bus_id="0000:02:00", source=XidSource.kmsg,
                    message=f"NVRM: Xid (PCI:0000:02:00): 13, pid={1000 + i}, name=python3, test {i}")


def test_secure_cluster_broker_killed_clients_reconnect_with_their_credentials(secure_kafka_cluster, tmp_path):
    cluster = secure_kafka_cluster
    prefix = f"s{uuid.uuid4().hex[:8]}."
    admin_s, collector_s, processor_s = (_as(cluster, r, prefix) for r in ("admin", "collector", "processor"))
    create_topics(admin_s)
    apply_acls(admin_s)
    killed = None
    try:
        # the collector's start-up check under its own least-privilege user: nothing to say
        assert check_replication(collector_s, [collector_s.topics.name("gpu.xid")]) == []
        sink = KafkaSink(collector_s, tmp_path / "spool")
        sent = [_xid(i) for i in range(200)]
        for rec in sent[:100]:
            sink.publish(rec)
        assert sink.flush(60), sink.stats()
        topic = collector_s.topics.name("gpu.xid")
        killed = cluster.leaders([topic])[(topic, 0)]
        t0 = time.monotonic()
        assert cluster.stop_one(killed, kill=True)
        for rec in sent[100:]:
            sink.publish(rec)
        assert sink.flush(120), sink.stats()
        took = time.monotonic() - t0
        stats = sink.stats()
        assert cluster.leaders([topic])[(topic, 0)] not in (killed, -1)
        # back before any client is destroyed: see tests/cluster/test_failover.py `_restart_soon`
        cluster.start_one(killed)
        killed = None
        sink.close()
        assert sink.auth_error is None
        assert stats["published"] == {topic: 200} and stats["dropped"] == 0

        # the processor's user reads all of them back, once each
        c = Consumer(consumer_config(processor_s, f"{prefix}xidstream-processor"))
        c.assign([TopicPartition(topic, 0, 0)])
        got: list[str] = []
        deadline = time.monotonic() + 60
        while len(got) < 200 and time.monotonic() < deadline:
            for m in c.consume(num_messages=500, timeout=0.5):
                assert m.error() is None, m.error()
                got.append(decode_any(m.value()).event_id)
        c.close()
        assert sorted(got) == sorted(r.event_id for r in sent), f"read {len(got)} of 200"
        assert took < 60
    finally:
        if killed is not None:
            cluster.start_one(killed)
        cluster.wait_in_sync(90)
        delete_run(admin_s)
