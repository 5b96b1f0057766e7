"""Test tiers: fast tests need neither broker nor GPU; tests that take `kafka_settings` or
`kafka_bootstrap` run on the real Apache Kafka broker of deploy/local, started once per run.

Set XIDSTREAM_BOOTSTRAP to use a broker you already run instead.
"""

from __future__ import annotations

import os
import uuid

import pytest

from xidstream.settings import Settings


@pytest.fixture(scope="session")
def kafka_bootstrap():
    given = os.environ.get("XIDSTREAM_BOOTSTRAP")
    if given:
        yield given
        return
    from xidstream.localbroker import LocalBroker

    broker = LocalBroker()
    ours = broker.pid() is None  # leave a broker that a developer started running
    bootstrap = broker.start()
    yield bootstrap
    if ours:
        broker.stop()


@pytest.fixture
def kafka_settings(kafka_bootstrap):
    """Settings with a fresh topic prefix (all registry topics created), so tests never see each
    other's records; the topics are deleted afterwards."""
    from xidstream.kafka import create_topics, delete_topics

    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
                        partitions=8, node="node-a")
    create_topics(settings)
    yield settings
    delete_topics(settings)
