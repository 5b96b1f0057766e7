"""`KafkaConfig`: what a library part needs to reach Kafka, and nothing about where it came from.

The command layer (`xidstream.settings.Settings`) builds it from flags and the environment; the
collectors' sink, the processor and the executors take it as it is, so they never read
`os.environ` and never import the command layer.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Mapping

from xidstream.schemas.topics import DEFAULT_PARTITIONS, TopicRegistry

__all__ = ["KafkaConfig", "DEFAULT_BOOTSTRAP", "default_node_name"]

# The local broker of deploy/local (non-default port, loopback only).
DEFAULT_BOOTSTRAP = "127.0.0.1:19092"


def default_node_name() -> str:
    """This host's name as the kubelet names its Node by default: trimmed, in lower case
    (k8s.io/component-helpers/node/util GetHostname)."""
    return socket.gethostname().strip().lower()


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap: str = DEFAULT_BOOTSTRAP
    topic_prefix: str = ""
    partitions: int = DEFAULT_PARTITIONS
    # Of every topic xidstream creates (the contract's, the processor's internal ones and its
    # changelogs). None: what the cluster can hold, asked when topics are created
    # (`xidstream.transport.kafka.choose_replication`: 3, or one per broker when there are fewer).
    replication_factor: int | None = None
    # The topics' min.insync.replicas; with acks=all a write then needs this many replicas, e.g. 2
    # of 3 survives one broker down without losing a record. None: one less than the replicas, at
    # most 2 (the broker's default for one replica).
    min_insync_replicas: int | None = None
    node: str = field(default_factory=default_node_name)
    # Extra librdkafka settings (security.protocol, sasl.*, ...) for every client we create. Not in
    # repr: it holds sasl.password and key passwords, and settings end up in logs and tracebacks.
    kafka_extra: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def topics(self) -> TopicRegistry:
        return TopicRegistry(self.topic_prefix, self.partitions)
