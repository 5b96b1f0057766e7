"""The cluster tier: tests on a local three-broker KRaft cluster (`xidstream broker start
--brokers 3`, `.xidstream/cluster/`, ports 19592-19597), started once per run by the session
fixture `kafka_cluster` and stopped at the end; it never touches the single broker of the rest.

Marked `cluster` (and `broker`, so the fast tier leaves them out). `make test` runs them after
every other test, so the three JVMs never run beside the rest of the suite: on a 2-core machine
they would slow every test that runs meanwhile. `pytest -m "not cluster"` leaves them out;
`make test-cluster` (`pytest -m cluster tests/cluster`) runs only them.
Set XIDSTREAM_CLUSTER_KEEP=1 to leave the cluster running after the run (a second run reuses it).
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    # tests/cluster sorts before tests/collectors: move the tier to the end of the run
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("cluster") is not None)


# The clusters this run started, stopped before it starts another: on a 2-core machine one
# three-broker cluster at a time (the plain tests run first, test_failover.py < test_secure_cluster.py).
_STARTED: list = []


def _cluster(secure: bool):
    from workshop.localcluster import LocalCluster

    cluster = LocalCluster(brokers=3, secure=secure)
    for other in _STARTED:
        if other.secure != secure:
            other.stop()
    ours = not any(n.pid() for n in cluster.nodes)  # leave a cluster a developer started running
    try:
        cluster.start()
        if ours:
            _STARTED.append(cluster)
        yield cluster
    finally:
        if ours and not os.environ.get("XIDSTREAM_CLUSTER_KEEP"):
            cluster.stop()


@pytest.fixture(scope="session")
def kafka_cluster():
    """A started `workshop.localcluster.LocalCluster` (three combined broker+controller nodes;
    topics at replication 3, min.insync.replicas 2). Tests that kill a node start it again and wait
    until every partition is back in sync before they end."""
    yield from _cluster(secure=False)


@pytest.fixture(scope="session")
def secure_kafka_cluster():
    """The SASL_SSL variant (`--secure`): `client_config(role)` / `client_file(role)` per role."""
    yield from _cluster(secure=True)


@pytest.fixture(autouse=True)
def _balanced_cluster(request):
    """Each test starts on a cluster whose leaderships will not move under it: a node an earlier
    test restarted gets its preferred leaderships back now, not at the controller's next check
    with this test's worker just joined (`LocalCluster.wait_balanced`)."""
    for name in ("kafka_cluster", "secure_kafka_cluster"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_balanced(120)

