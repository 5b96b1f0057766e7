"""Command-line pieces shared by the subcommands of every package."""

from __future__ import annotations

import argparse

from xidstream.schemas.base import is_node_name, plain_text
from xidstream.schemas.errors import ConfigError

__all__ = ["add_kafka_args", "add_replication_args", "require_node_name"]


def add_kafka_args(p: argparse.ArgumentParser, *, partitions: bool = True, prefix: bool = True) -> None:
    g = p.add_argument_group("kafka")
    g.add_argument("--bootstrap", help="Kafka bootstrap servers (env XIDSTREAM_BOOTSTRAP; default: the local broker 127.0.0.1:19092)")
    g.add_argument("--kafka-config", metavar="FILE",
                   help="librdkafka properties file (key=value, as `kcat -F` reads): bootstrap.servers, "
                        "security.protocol, sasl.*, ssl.*; for every client, the processor's included "
                        "(env XIDSTREAM_KAFKA_CONFIG; XIDSTREAM_KAFKA_<NAME> variables and --bootstrap win over it)")
    if prefix:
        g.add_argument("--topic-prefix", help="prefix for every topic name (env XIDSTREAM_TOPIC_PREFIX)")
    if partitions:
        g.add_argument("--partitions", type=int, help="partitions of every topic (env XIDSTREAM_PARTITIONS; default 8)")


def add_replication_args(p: argparse.ArgumentParser) -> None:
    """For commands that create topics: how each is replicated."""
    g = p.add_argument_group("replication")
    g.add_argument("--replication-factor", type=int,
                   help="replicas of every topic created, the processor's internal and changelog topics included "
                        "(env XIDSTREAM_REPLICATION; default: what the cluster can hold, 3, or the number of brokers "
                        "when fewer: 1 only on a single broker)")
    g.add_argument("--min-insync-replicas", type=int,
                   help="min.insync.replicas of every topic created (env XIDSTREAM_MIN_INSYNC_REPLICAS; default: one "
                        "less than the replicas, at most 2, so acks=all survives one broker down; the broker's own "
                        "default for one replica)")


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (`--jobs 0` is refused by name, not run as 0)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is less than 1")
    return n


def require_node_name(name: str | None, where: str = "--node") -> str:
    """`name` when it is a Kubernetes node name (a DNS-1123 subdomain), else a `ConfigError` at
    start: every record this process sends carries it, and the processor refuses records about a
    node of any other name."""
    if not is_node_name(name):
        raise ConfigError(f"{where} {plain_text(str(name), 100)!r} is not a Kubernetes node name (a DNS-1123 "
                          f"subdomain: lowercase letters, digits, '-' and '.'); give the Node's name with --node "
                          f"(env XIDSTREAM_NODE): records about any other name are refused")
    return name  # type: ignore[return-value]
