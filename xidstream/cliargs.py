"""Command-line pieces shared by the subcommands of every package."""

from __future__ import annotations

import argparse

__all__ = ["add_kafka_args"]


def add_kafka_args(p: argparse.ArgumentParser, *, partitions: bool = True, prefix: bool = True) -> None:
    g = p.add_argument_group("kafka")
    g.add_argument("--bootstrap", help="Kafka bootstrap servers (env XIDSTREAM_BOOTSTRAP; default: the local broker 127.0.0.1:19092)")
    if prefix:
        g.add_argument("--topic-prefix", help="prefix for every topic name (env XIDSTREAM_TOPIC_PREFIX)")
    if partitions:
        g.add_argument("--partitions", type=int, help="partitions of every topic (env XIDSTREAM_PARTITIONS; default 8)")
