"""The `xidstream` command.

Subcommands import what they need when they run: `import faust` reads sys.argv and writes
os.environ (runtime-notes section 2), so only `xidstream process` may import it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from xidstream.schemas.errors import XidstreamError
from xidstream.cliargs import add_kafka_args as _add_kafka_args
from xidstream.cliargs import add_replication_args as _add_replication_args
from xidstream.cliargs import positive_int as _positive_int
from xidstream.settings import Settings

__all__ = ["main", "build_parser"]

Handler = Callable[[argparse.Namespace, Settings], int]


def _settings(args: argparse.Namespace) -> Settings:
    base = Settings.from_env(kafka_config=getattr(args, "kafka_config", None))
    settings = base.with_(
        bootstrap=getattr(args, "bootstrap", None),
        topic_prefix=getattr(args, "topic_prefix", None),
        partitions=getattr(args, "partitions", None),
        node=getattr(args, "node", None),
        replication_factor=getattr(args, "replication_factor", None),
        min_insync_replicas=getattr(args, "min_insync_replicas", None),
    )
    settings.validate()
    return settings


# -- broker -------------------------------------------------------------------------------------
def _cluster(args: argparse.Namespace) -> int:
    """`xidstream broker ACTION --brokers N`: the local multi-broker KRaft cluster."""
    import json

    from workshop.localcluster import LocalCluster

    cluster = LocalCluster(brokers=args.brokers, secure=args.secure, port=args.port, host=args.host)
    if args.action in ("stop-one", "start-one") and args.id is None:
        raise XidstreamError(f"`xidstream broker {args.action}` needs the node's ID (1..{args.brokers})")
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
        raise XidstreamError(f"`xidstream broker {args.action}` is for a cluster: add --brokers 3")
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


# -- topics -------------------------------------------------------------------------------------
def _topics(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.schemas.topics import TOPICS

    if args.action == "list":
        reg = settings.topics
        for name, spec in TOPICS.items():
            keep = "compacted" if spec.compacted else f"{spec.retention_ms // 86_400_000} d"
            part = f"{settings.partitions} partitions" + (
                (" (co-partitioned input)" if spec.processed else " (co-partitioned)") if spec.co_partitioned else "")
            print(f"{reg.name(name):32} key: {spec.key:42} {keep:10} {part:38} {spec.model.SCHEMA}")
        return 0
    from xidstream.transport.kafka import create_topics, settle_replication

    settings, replication = settle_replication(settings)
    print(f"topics: {replication}", flush=True)
    for name, state in create_topics(settings).items():
        print(f"{name:32} {state}")
    return 0


# -- schemas ------------------------------------------------------------------------------------
def _schemas(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.schemas import jsonschema

    return jsonschema.main(["--check"] if args.action == "check" else [])


def _scenario(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.schemas.scenario import load_scenario

    for path in args.files:
        sc = load_scenario(path)
        gpus = sum(len(n.gpus) for n in sc.nodes)
        print(f"{path}: ok: '{sc.name}', {len(sc.nodes)} node(s), {gpus} GPU(s), "
              f"{len(sc.timeline)} timeline entries, {len(sc.expect)} expect, {len(sc.forbid)} forbid")
    return 0


def _simulate(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from xidstream.collectors.sink import KafkaSink
    from xidstream.transport.kafka import create_topics, settle_replication
    from xidstream.simulate import FaultRates, Simulator

    if args.create_topics:
        settings, replication = settle_replication(settings)
        print(f"simulate: topics: {replication}", file=sys.stderr, flush=True)
        create_topics(settings)
    rates = FaultRates(args.app_fault_rate, args.repeat_rate, args.wedge_rate, args.hardware_rate, args.phantom_rate)
    sim = Simulator(settings, args.nodes, args.gpus, rate=args.rate, duration=args.duration, rates=rates, seed=args.seed,
                    crash_loops=args.crash_loops, xid45_teardowns=args.xid45_teardowns,
                    teardown_nodes=args.teardown_nodes, rack_size=args.rack_size,
                    nvlink_domain_faults=args.nvlink_domain_faults)
    faults: dict[str, int] = {}
    for g in sim.gpus:
        faults[g.fault] = faults.get(g.fault, 0) + 1
    print(f"simulate: {len(sim.gpus)} GPUs on {args.nodes} nodes, faults {faults}", file=sys.stderr, flush=True)
    sink = KafkaSink(settings, Path(args.state_dir) / "spool", max_inflight=100_000)
    sim.run(sink, speed=args.speed)
    ok = sink.flush(5)
    if not ok:  # said once, before the wait, not only after it
        print(f"simulate: Kafka at {settings.bootstrap} has not taken everything yet; waiting up to 115 s more for "
              f"what is spooled in {sink.spool_dir}, then exiting with code 1 with the rest kept there",
              file=sys.stderr, flush=True)
        ok = sink.flush(115)
    sink.close()
    sim.write_truth(Path(args.truth))
    print(f"simulate: {sim.published:,} records published"
          f"{'' if ok else f' (some still spooled in {sink.spool_dir}: sent when a run with this --state-dir reaches Kafka)'}"
          f"; truth in {args.truth}", file=sys.stderr)
    return 0 if ok else 1


def _evaluate(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    import orjson

    from xidstream.simulate import evaluate

    if not args.topic_prefix:
        meta = orjson.loads(Path(args.truth).read_bytes().splitlines()[0])["meta"]
        settings = settings.with_(topic_prefix=meta["topic_prefix"])
    report = evaluate(Path(args.truth), settings)
    return 1 if report["node_actions_on_app_fault_gpus"] else 0


def _replay(args: argparse.Namespace, settings: Settings) -> int:
    import os

    from xidstream.replay import run_replay

    bootstrap = args.bootstrap or os.environ.get("XIDSTREAM_BOOTSTRAP")
    return run_replay(args.scenarios, bootstrap, as_json=args.json, check=args.check, policy=args.policy,
                      keep=args.keep, partitions=args.partitions, telemetry=args.telemetry, jobs=args.jobs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xidstream",
        description="Find sick GPUs from NVML samples, process lists and kernel Xid records, over Kafka.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
                        "reach loopback: give the bridge's address, e.g. the one `xidstream node up` prints)")
    p.add_argument("--secure", action="store_true",
                   help="the separate SASL_SSL instance (.xidstream/broker-secure/): TLS, SCRAM-SHA-512 users "
                        "collector, processor, executor, admin, ACLs; writes clients/ROLE.properties")
    p.set_defaults(handler=_broker)

    p = sub.add_parser("topics", help="create or list the contract's topics",
                       epilog="Replicated as the cluster can hold unless told: 3 replicas with min.insync.replicas 2 on "
                              "3+ brokers, one per broker on fewer, 1 on a single broker; `xidstream process` chooses "
                              "the same for its internal and changelog topics.")
    p.add_argument("action", choices=["create", "list"])
    _add_kafka_args(p)
    _add_replication_args(p)
    p.set_defaults(handler=_topics)

    p = sub.add_parser("schemas", help="generate or check the JSON Schema files in schemas/json/")
    p.add_argument("action", choices=["generate", "check"])
    p.set_defaults(handler=_schemas)

    p = sub.add_parser("scenario", help="validate scenario files")
    p.add_argument("action", choices=["check"])
    p.add_argument("files", nargs="+")
    p.set_defaults(handler=_scenario)

    p = sub.add_parser("replay", help="run scenario files through collectors, Kafka and the processor")
    p.add_argument("scenarios", nargs="+", metavar="SCENARIO")
    p.add_argument("--json", action="store_true", help="one JSON object per output record: {topic, key, value}")
    p.add_argument("--telemetry", action="store_true", help="with --json: the input records too (samples, process lists, "
                   "Xids, workloads), so `xidstream incident ID --html FILE --stdin` can chart the GPU")
    p.add_argument("--check", action="store_true", help="evaluate expect/forbid; exit 1 naming what failed")
    p.add_argument("--bootstrap", help="an existing Kafka (default: start the local broker for the run)")
    p.add_argument("--policy", help="policy YAML for the processor")
    p.add_argument("--partitions", type=int, default=1, help="partitions of the run's topics (default 1: the fleet breaker then sees commands in event-time order)")
    p.add_argument("--keep", action="store_true", help="keep the run's topics")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="replay up to N scenarios at once, each in a child replay with its own worker; output in "
                        "the order given (default 1; each worker takes about 0.3 GiB)")
    p.set_defaults(handler=_replay)

    p = sub.add_parser("simulate", help="publish a simulated fleet with injected faults (and keep the ground truth)")
    p.add_argument("--nodes", type=int, default=125)
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--rate", type=float, default=1.0, help="samples per GPU per second (default 1)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of fleet time (default 600)")
    p.add_argument("--speed", type=float, default=1.0, help="x real time; 0: as fast as possible (default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--truth", default="truth.jsonl", help="ground-truth output file (default truth.jsonl)")
    p.add_argument("--state-dir", default=".xidstream/simulate", help="the sink's spool")
    for name, default in (("app-fault", 0.04), ("repeat", 0.01), ("wedge", 0.01), ("hardware", 0.01), ("phantom", 0.005)):
        p.add_argument(f"--{name}-rate", type=float, default=default, help=f"share of GPUs with this fault (default {default})")
    p.add_argument("--crash-loops", type=int, default=0, metavar="N",
                   help="N fault-free GPUs get a crash-looping pod: a new PID per restart, Xid 13 each time (truth: APP_FAULT only)")
    p.add_argument("--xid45-teardowns", type=int, default=0, metavar="N",
                   help="N jobs on up to 6 nodes x 2 GPUs end with Xid 45 on every rank at once (truth: APP_FAULT at most)")
    p.add_argument("--teardown-nodes", type=int, default=0, metavar="N",
                   help="nodes per Xid 45 teardown job (default 6; 77 like NVSentinel#1629)")
    p.add_argument("--rack-size", type=int, default=0, metavar="N",
                   help="nodes per rack (one NVLink domain each), published in their inventories (default: no racks)")
    p.add_argument("--nvlink-domain-faults", type=int, default=0, metavar="N",
                   help="N racks where more than half of the nodes get a hardware Xid within a minute (needs --rack-size)")
    _add_kafka_args(p)
    p.add_argument("--create-topics", action="store_true",
                   help="create the contract's topics first, replicated as the cluster can hold (3, or one per "
                        "broker when fewer) unless --replication-factor says otherwise")
    _add_replication_args(p)
    p.set_defaults(handler=_simulate)

    p = sub.add_parser("evaluate", help="score the processor's output against a simulation's ground truth")
    p.add_argument("--truth", default="truth.jsonl")
    _add_kafka_args(p)
    p.set_defaults(handler=_evaluate)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


# Later subsystems (collectors, stream processor, replay) add their subcommands here.
def _collectors(sub: argparse._SubParsersAction) -> None:
    from xidstream.collect_cmd import register

    register(sub)


def _streams(sub: argparse._SubParsersAction) -> None:
    from xidstream.process_cmd import register

    register(sub)


def _kube(sub: argparse._SubParsersAction) -> None:
    from workshop.localkube import register

    register(sub)


def _node(sub: argparse._SubParsersAction) -> None:
    from workshop.localnode import register

    register(sub)


def _e2e(sub: argparse._SubParsersAction) -> None:
    from workshop.node_e2e import register

    register(sub)


def _executors(sub: argparse._SubParsersAction) -> None:
    from xidstream.execute_cmd import register

    register(sub)


def _demo_cluster(sub: argparse._SubParsersAction) -> None:
    from workshop.demo_cluster import register

    register(sub)


def _exporters(sub: argparse._SubParsersAction) -> None:
    from xidstream.export_cmd import register

    register(sub)


def _incidents(sub: argparse._SubParsersAction) -> None:
    from xidstream.incidents import register

    register(sub)


_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_collectors, _streams, _kube, _node, _e2e, _executors,
                                                                       _demo_cluster, _exporters, _incidents]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = _settings(args)
        return args.handler(args, settings)
    except XidstreamError as exc:
        print(f"xidstream: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `xidstream parse ... | head`: the reader left; say nothing more.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
