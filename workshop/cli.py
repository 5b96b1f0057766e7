"""The workshop's command, `python -m workshop` from a checkout: the operator's commands
(`xidstream ...`) plus the local harnesses that only development, the demo and the tests use:

- `broker`: the local single-node Kafka (and `--brokers 3`, the KRaft cluster), `localbroker`/`localcluster`;
- `kube`: the local kube-apiserver + etcd (`localkube`);
- `node`: a real single-node cluster, kubelet and containerd (`localnode`);
- `e2e`: the chart on that node (`node_e2e`);
- `demo-cluster`: the closed loop on the local API server (`demo_cluster`).

`replay` here starts the local broker for the run when no `--bootstrap` is given; `xidstream
replay` in an installed product needs one. None of this is in the wheel or the images
(pyproject.toml, tests/test_wheel.py): the product never imports `workshop` (tests/test_layers.py).
"""

from __future__ import annotations

import argparse
import sys

from xidstream.cli import build_parser as _product_parser
from xidstream.cli import main as _product_main
from xidstream.schemas.errors import XidstreamError
from xidstream.settings import Settings

__all__ = ["main", "build_parser"]


# -- broker -------------------------------------------------------------------------------------
def _cluster(args: argparse.Namespace) -> int:
    """`python -m workshop broker ACTION --brokers N`: the local multi-broker KRaft cluster."""
    import json

    from workshop.localcluster import LocalCluster

    cluster = LocalCluster(brokers=args.brokers, secure=args.secure, port=args.port, host=args.host)
    if args.action in ("stop-one", "start-one") and args.id is None:
        raise XidstreamError(f"`python -m workshop broker {args.action}` needs the node's ID (1..{args.brokers})")
    if args.action == "fetch":
        print(f"Kafka jars in {cluster.nodes[0].fetch()}")
    elif args.action == "start":
        kind = "secure (SASL_SSL) " if args.secure else ""
        print(f"starting a local {kind}Kafka cluster of {args.brokers} brokers ({cluster.state_dir}) ...",
              file=sys.stderr)
        print(f"Kafka is up on {cluster.start()}")
        print(f"topics: --replication-factor {cluster.replication_factor} "
              f"--min-insync-replicas {cluster.min_insync_replicas}")
        if args.secure:
            from workshop.localbroker import ROLES

            print(f"CA: {cluster.ca_file}")
            for role in ROLES:
                print(f"{role:16} --kafka-config {cluster.client_file(role)}")
    elif args.action == "stop":
        print("stopped" if cluster.stop() else "not running")
    elif args.action == "stop-one":
        done = cluster.stop_one(args.id, kill=args.kill)
        print(f"node {args.id} {'killed' if args.kill else 'stopped'}" if done else f"node {args.id} not running")
    elif args.action == "start-one":
        cluster.start_one(args.id)
        print(f"node {args.id} up on {cluster.node(args.id).bootstrap}")
    elif args.action == "status":
        nodes = cluster.status()
        if args.json:
            print(json.dumps({"bootstrap": cluster.bootstrap, "brokers": nodes}, indent=2))
        else:
            for n in nodes:
                state = f"pid {n['pid']}" if n["pid"] else "not running"
                print(f"node {n['id']}  127.0.0.1:{n['port']}  {state:14} "
                      f"{'registered' if n['registered'] else 'not registered':15} leads {n['leads']} partition(s)")
        return 0 if all(n["pid"] and n["registered"] for n in nodes) else 1
    elif args.action == "reset":
        cluster.reset()
        print(f"stopped and deleted {cluster.state_dir}")
    return 0


def _broker(args: argparse.Namespace, settings: Settings) -> int:
    from workshop.localbroker import LocalBroker

    if args.brokers > 1:
        return _cluster(args)
    if args.action in ("stop-one", "start-one"):
        raise XidstreamError(f"`python -m workshop broker {args.action}` is for a cluster: add --brokers 3")
    broker = LocalBroker(port=args.port, secure=args.secure, host=args.host)
    if args.action == "fetch":
        print(f"Kafka jars in {broker.fetch()}")
    elif args.action == "start":
        kind = "secure (SASL_SSL) " if args.secure else ""
        print(f"starting the local {kind}Kafka broker (log: {broker.log_file}) ...", file=sys.stderr)
        print(f"Kafka is up on {broker.start()}")
        if args.secure:
            print(f"CA: {broker.ca_file}")
            from workshop.localbroker import ROLES

            for role in ROLES:
                print(f"{role:16} --kafka-config {broker.client_file(role)}")
    elif args.action == "stop":
        print("stopped" if broker.stop() else "not running")
    elif args.action == "status":
        pid = broker.pid()
        if pid and broker.answers():
            print(f"running, pid {pid}, on {broker.bootstrap}")
        elif pid:
            print(f"process {pid} exists but does not answer on {broker.bootstrap}")
            return 1
        else:
            print("not running")
            return 1
    elif args.action == "reset":
        broker.reset()
        print(f"stopped and deleted {broker.data_dir}")
    return 0


def _broker_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="the local single-node Kafka for the demo and tests")
    p.add_argument("action", choices=["fetch", "start", "stop", "status", "reset", "stop-one", "start-one"])
    p.add_argument("id", nargs="?", type=int, help="stop-one / start-one: the node id of a --brokers cluster (1..N)")
    p.add_argument("--brokers", type=int, default=1,
                   help="N > 1: a separate local KRaft cluster of N combined broker+controller nodes "
                        "(.xidstream/cluster/, ports 19592, 19594, ...; 19692... with --secure); topics on it "
                        "use --replication-factor 3 --min-insync-replicas 2")
    p.add_argument("--kill", action="store_true", help="stop-one: SIGKILL (a crash: no controlled shutdown)")
    p.add_argument("--json", action="store_true", help="status of a --brokers cluster as JSON: each broker's id, "
                                                       "port, PID and the partitions it leads")
    p.add_argument("--port", type=int, default=None, help="client port (controller: port+1); default 19092, "
                                                          "19392 with --secure")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address it listens on and advertises (default 127.0.0.1; pods on a CNI bridge cannot "
                        "reach loopback: give the bridge's address, e.g. the one `python -m workshop node up` prints)")
    p.add_argument("--secure", action="store_true",
                   help="the separate SASL_SSL instance (.xidstream/broker-secure/): TLS, SCRAM-SHA-512 users "
                        "collector, processor, executor, admin, ACLs; writes clients/ROLE.properties")
    p.set_defaults(handler=_broker)


def _kube(sub: argparse._SubParsersAction) -> None:
    from workshop.localkube import register

    register(sub)


def _node(sub: argparse._SubParsersAction) -> None:
    from workshop.localnode import register

    register(sub)


def _e2e(sub: argparse._SubParsersAction) -> None:
    from workshop.node_e2e import register

    register(sub)


def _demo_cluster(sub: argparse._SubParsersAction) -> None:
    from workshop.demo_cluster import register

    register(sub)


WORKSHOP_COMMANDS = (_broker_command, _kube, _node, _e2e, _demo_cluster)


def build_parser() -> argparse.ArgumentParser:
    return _product_parser(extra=WORKSHOP_COMMANDS, prog="python -m workshop")


def _local_broker():  # noqa: ANN202 (a LocalBroker, imported when a replay needs it)
    from workshop.localbroker import LocalBroker

    return LocalBroker()


def main(argv: list[str] | None = None) -> int:
    return _product_main(argv, build_parser(), local_broker=_local_broker)


if __name__ == "__main__":
    raise SystemExit(main())
