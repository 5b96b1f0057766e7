"""An upgrade that adds a topic the processor does not read (gpu.counters) must not stop the
collectors or the processor before someone has created it (or granted its ACLs): found by review
of the counters change, where every collector refused to start, fleet-wide, over a topic it only
publishes trend counters to."""

from __future__ import annotations

import logging
import uuid

import pytest

from xidstream.schemas.errors import TopicError
from xidstream.schemas.topics import TOPICS
from xidstream.streams.app import create_app, internal_topics
from xidstream.transport.kafka import create_topics, delete_topics, ensure_processor_topics
from xidstream.collect_cmd import _check_topics
from xidstream.settings import Settings

pytestmark = pytest.mark.broker


@pytest.fixture
def without_counters(kafka_bootstrap):
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"u{uuid.uuid4().hex[:10]}.", partitions=8,
                        node="node-a")
    create_topics(settings, names=[n for n in TOPICS if n != "gpu.counters"])
    yield settings
    delete_topics(settings)


def test_a_collector_starts_without_gpu_counters_and_says_what_to_do(without_counters, caplog):
    with caplog.at_level(logging.ERROR):
        assert _check_topics(without_counters, create=False) == {"gpu.counters"}
    assert f"topic {without_counters.topic_prefix}gpu.counters is missing" in caplog.text
    assert "xidstream topics create" in caplog.text and "WRITE and DESCRIBE" in caplog.text


def test_a_collector_without_a_topic_the_processor_reads_still_refuses_to_start(kafka_bootstrap):
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"v{uuid.uuid4().hex[:10]}.", partitions=8)
    create_topics(settings, names=[n for n in TOPICS if n not in ("gpu.counters", "gpu.xid")])
    try:
        with pytest.raises(TopicError, match=rf"topics missing on .*: {settings.topic_prefix}gpu\.xid; run `xidstream "
                                             rf"topics create`"):
            _check_topics(settings, create=False)
    finally:
        delete_topics(settings)


def test_the_processor_starts_without_gpu_counters(without_counters, caplog):
    with caplog.at_level(logging.WARNING, logger="xidstream.kafka"):
        skip = ensure_processor_topics(without_counters, internal_topics(without_counters))
    assert f"topic {without_counters.topic_prefix}gpu.counters is missing" in caplog.text
    # left out of the worker's subscription (streams.app create_app skip_inputs) until a restart
    assert skip == {"gpu.counters"}
    assert without_counters.topic_prefix + "gpu.counters" not in create_app(without_counters, skip_inputs=skip).names


def test_the_processor_reads_gpu_counters_when_it_is_there(kafka_bootstrap):
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"w{uuid.uuid4().hex[:10]}.", partitions=8)
    create_topics(settings)
    try:
        skip = ensure_processor_topics(settings, internal_topics(settings))
        assert skip == set()
        assert settings.topic_prefix + "gpu.counters" in create_app(settings, skip_inputs=skip).names
    finally:
        delete_topics(settings)
