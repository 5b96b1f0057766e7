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
from xidstream.extras import explain, require
from xidstream.settings import Settings

__all__ = ["main", "build_parser", "settings_from_args"]

Handler = Callable[[argparse.Namespace, Settings], int]


def settings_from_args(args: argparse.Namespace) -> Settings:
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
                      keep=args.keep, partitions=args.partitions, telemetry=args.telemetry, jobs=args.jobs,
                      local_broker=getattr(args, "local_broker", None))


def build_parser(extra: tuple[Callable[[argparse._SubParsersAction], None], ...] = (),
                 prog: str = "xidstream") -> argparse.ArgumentParser:
    """The operator's commands; `extra` registers more (the checkout's workshop: `python -m workshop`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Find sick GPUs from NVML samples, process lists and kernel Xid records, over Kafka.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    p.add_argument("--bootstrap", help="the Kafka to run on (default: XIDSTREAM_BOOTSTRAP; `python -m workshop replay` starts the local broker for the run when neither is given)")
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

    for register in (*_EXTRA_COMMANDS, *extra):
        register(sub)
    return parser


def command_names() -> list[str]:
    """The operator's commands (`xidstream --help`)."""
    return sorted(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse has no API


# Later subsystems (collectors, stream processor, replay) add their subcommands here.
def _collectors(sub: argparse._SubParsersAction) -> None:
    from xidstream.collect_cmd import register

    register(sub)


def _streams(sub: argparse._SubParsersAction) -> None:
    from xidstream.process_cmd import register

    register(sub)


def _executors(sub: argparse._SubParsersAction) -> None:
    from xidstream.execute_cmd import register

    register(sub)


def _exporters(sub: argparse._SubParsersAction) -> None:
    from xidstream.export_cmd import register

    register(sub)


def _incidents(sub: argparse._SubParsersAction) -> None:
    from xidstream.incidents import register

    register(sub)


_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_collectors, _streams, _executors, _exporters,
                                                                       _incidents]


# Commands of the checkout's workshop (workshop/cli.py), which an installed xidstream has not: named
# with where they went instead of argparse's bare "invalid choice".
WORKSHOP_COMMANDS = ("broker", "kube", "node", "e2e", "demo-cluster")


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None, **defaults: object) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if parser is None and argv and argv[0] in WORKSHOP_COMMANDS:
        print(f"xidstream: error: `{argv[0]}` is a command of the checkout's workshop, not of the installed "
              f"product: run `python -m workshop {' '.join(argv)}` from a checkout of xidstream", file=sys.stderr)
        return 2
    args = (parser or build_parser()).parse_args(argv)
    for name, value in defaults.items():  # what the workshop lends the commands (its local broker)
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
        require(args.command)  # the command's extra (pyproject.toml), named in one line when missing
        try:
            return args.handler(args, settings)
        except ModuleNotFoundError as exc:
            raise (explain(args.command, exc) or exc) from None
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
