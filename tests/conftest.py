"""Test tiers: fast tests need neither broker nor GPU; tests that take `kafka_settings` or
`kafka_bootstrap` run on the real Apache Kafka broker of deploy/local, started once per run.

Set XIDSTREAM_BOOTSTRAP to use a broker you already run instead.

Tests that take `secure_kafka` run on a second, separate local broker (`xidstream broker start
--secure`: SASL_SSL on 127.0.0.1:19392, SCRAM users per role, ACLs), started once per run and
stopped at the end; it never touches the plaintext broker.

Tests that take `kube` run on a real kube-apiserver + etcd (xidstream/localkube.py), started once
per run and stopped at the end; set XIDSTREAM_KUBECONFIG to use a cluster you already run instead
(its current context's bearer token must be allowed everything the tests do).

Markers: `broker` (the plaintext or the secure broker) and `kube` (the API server). A test that
takes one of the fixtures above, directly or through another fixture, gets the marker here even
where its module does not say so; tests that start a server themselves are marked in their
module. `pytest -m "not broker and not kube"` is the fast tier: it starts neither.

Tiers (docs/development.md "Test tiers"): `make test` is everything but `slow` and `cluster` (the
fast tier, the API-server tests and one broker smoke per subsystem), with Hypothesis's `quick`
profile; `make test-all` (CI) is every test with the `thorough` profile (XIDSTREAM_HYPOTHESIS).
"""

from __future__ import annotations

import os
import uuid

import pytest

from hypothesis import settings as hypothesis_settings

from tests.tools import PROFILE
from xidstream.settings import Settings

# Properties without a count of their own: 100 examples (Hypothesis's default) in CI, 25 locally;
# those with one scale it through tests.tools.examples.
hypothesis_settings.register_profile("thorough", max_examples=100)
hypothesis_settings.register_profile("quick", max_examples=25)
hypothesis_settings.load_profile(PROFILE)

# fixture -> the marker of the server it starts
_SERVER_FIXTURES = {"kafka_bootstrap": "broker", "kafka_settings": "broker", "secure_kafka": "broker",
                    "kafka_cluster": "broker", "secure_kafka_cluster": "broker", "kube": "kube"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        for name in {m for f, m in _SERVER_FIXTURES.items() if f in item.fixturenames}:
            if item.get_closest_marker(name) is None:
                item.add_marker(name)


@pytest.fixture(scope="session")
def kafka_bootstrap():
    given = os.environ.get("XIDSTREAM_BOOTSTRAP")
    if given:
        yield given
        return
    from workshop.localbroker import LocalBroker

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
    from xidstream.transport.kafka import create_topics, delete_topics

    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
                        partitions=8, node="node-a")
    create_topics(settings)
    yield settings
    delete_topics(settings)


@pytest.fixture(scope="session")
def kube():
    """A `workshop.localkube.KubeHandle`: kubeconfig, server, token, ca_file, request(),
    ensure_namespace(). No controller-manager, scheduler or kubelet runs."""
    from workshop.localkube import KubeHandle, LocalKube

    given = os.environ.get("XIDSTREAM_KUBECONFIG")
    if given:
        yield KubeHandle.from_kubeconfig(given)
        return
    local = LocalKube()
    ours = local.pid("kube-apiserver") is None  # leave a server that a developer started running
    try:
        yield local.start()
    finally:
        if ours:
            local.stop()


@pytest.fixture(scope="session")
def secure_kafka():
    """The secure local broker (`workshop.localbroker.LocalBroker(secure=True)`): its
    `client_file(role)` is each role's librdkafka properties file, `ca_file` its CA."""
    from workshop.localbroker import LocalBroker

    broker = LocalBroker(secure=True)
    ours = broker.pid() is None  # leave a broker that a developer started running
    try:
        broker.start()
        yield broker
    finally:
        if ours:
            broker.stop()
