"""`xidstream process` (a stream-processor worker) and `xidstream breaker reset`."""

from __future__ import annotations

import argparse
import gc
import getpass
import logging
import sys
import time

from xidstream.schemas.errors import ConfigError, TopicError
from xidstream.cliargs import add_kafka_args, add_replication_args
from xidstream.settings import Settings

__all__ = ["register"]

log = logging.getLogger("xidstream.process")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("process", help="run a stream-processor worker (faust): classify, alert, plan remediation")
    p.add_argument("--config", help="YAML settings file: bootstrap, topic_prefix, partitions, node, store, "
                                    "data_dir, web_port, policy (a mapping or a file path); flags win over it")
    p.add_argument("--policy", help="YAML policy file (thresholds; see streams/policy.py)")
    p.add_argument("--store", default=None, help="table store: memory:// (default; state rebuilt from the "
                                                 "changelog) or rocksdb:// (needs rocksdict)")
    p.add_argument("--data-dir", default=None, help="faust data dir (default .xidstream/processor)")
    p.add_argument("--web-port", type=int, default=None,
                   help="serve faust's web views and Prometheus /metrics on PORT (default off)")
    p.add_argument("--web-bind", default="127.0.0.1",
                   help="address the web views listen on (default 127.0.0.1; in a pod: 0.0.0.0 for probes and scraping)")
    p.add_argument("--app-id", default=None, help="consumer group / app id (default <prefix>xidstream-processor)")
    p.add_argument("--node", help="name of this worker's host on dead-letter records")
    p.add_argument("--loglevel", default="warning", help="worker log level (default warning)")
    p.add_argument("--signing-key", help="Ed25519 private key (xidstream keys generate) that signs every command; "
                                         "executors refuse unsigned ones")
    p.add_argument("--approver-key", action="append", default=[], metavar="FILE",
                   help="a public key trusted to sign a breaker reset (`xidstream breaker reset --key`); repeat for "
                        "each approver; never the signing key's own")
    p.add_argument("--enroller-key", action="append", default=[], metavar="FILE",
                   help="the enroller's public key (the cluster executor's --enroll-key): believe an input record only "
                        "with the MAC of the node it is about, and a result only from the executor entitled to send it, "
                        "by the enrollments on xidstream.identities (needs --signing-key)")
    p.add_argument("--records-not-tied-to-nodes", action="store_true",
                   help="with --signing-key and no --enroller-key: sign commands for records that no node identity "
                        "vouches for, so one node's Kafka credentials can forge any node's telemetry and results. "
                        "Refused without this flag; with it, a warning at start and "
                        "xidstream_processor_node_identity_off 1 on /metrics (alert XidstreamNodeIdentityOff)")
    p.add_argument("--fast-rebalance", action="store_true", help="short session timeouts, for a one-broker test setup")
    add_kafka_args(p)
    add_replication_args(p)
    p.set_defaults(handler=_process)

    p = sub.add_parser("breaker", help="the fleet circuit breaker")
    p.add_argument("action", choices=["reset"])
    p.add_argument("--by", default=None, help="who resets it (default: the login name)")
    p.add_argument("--key", help="the approver's private key: the processor takes a reset only signed by one of its "
                                 "--approver-key keys (without one, the processor refuses resets unless it signs nothing)")
    p.add_argument("--ttl", type=float, default=300.0, help="seconds the reset stays valid if it waits in the topic (default 300)")
    add_kafka_args(p, partitions=False)
    p.set_defaults(handler=_breaker)


def _load_config(path: str | None) -> dict:
    if not path:
        return {}
    from xidstream.streams.policy import read_yaml

    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    known = {"bootstrap", "topic_prefix", "partitions", "node", "store", "data_dir", "web_port", "policy", "app_id"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return data


def _check_identity_choice(args: argparse.Namespace, signing_key: object) -> None:
    """A processor that signs commands acts on what it believes: without per-node identity it
    believes a record about any node from any holder of a node's Kafka credentials (every GPU
    node holds them), so it refuses to start unless the operator says so by name. Without a
    signing key nothing it plans is carried out (executors refuse unsigned commands)."""
    if args.enroller_key:
        if args.records_not_tied_to_nodes:
            raise ConfigError("--records-not-tied-to-nodes contradicts --enroller-key: choose one")
        return
    if signing_key is None:
        return
    if not args.records_not_tied_to_nodes:
        raise ConfigError(
            "--signing-key without --enroller-key: the commands this worker would sign could be steered by any node "
            "that holds the collector's or executor's Kafka credentials, about any other node. Either turn on per-node "
            "identity (--enroller-key FILE, the enroller's public key; docs/security.md \"Per-node identity\"), or "
            "accept that records are not tied to nodes with --records-not-tied-to-nodes")
    log.warning("per-node identity is OFF (--records-not-tied-to-nodes): records are believed whichever node sent "
                "them; one node's Kafka credentials can forge any node's telemetry and results")
    print("xidstream process: WARNING: per-node identity is off (--records-not-tied-to-nodes): a record about a node "
          "is believed whichever node sent it; /metrics says xidstream_processor_node_identity_off 1 while this runs",
          file=sys.stderr, flush=True)


def _process(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.streams.policy import load_policy

    conf = _load_config(args.config)
    # file < environment < flags: the file's values stand in for unset XIDSTREAM_* variables
    import os

    from_file = {f"XIDSTREAM_{k.upper()}": str(conf[k]) for k in ("bootstrap", "topic_prefix", "partitions", "node")
                 if k in conf}
    settings = Settings.from_env({**from_file, **os.environ}, kafka_config=args.kafka_config).with_(
        bootstrap=args.bootstrap, topic_prefix=args.topic_prefix, partitions=args.partitions, node=args.node,
        replication_factor=args.replication_factor, min_insync_replicas=args.min_insync_replicas)
    settings.validate()
    from xidstream.streams.faust_fast import PROCESSOR_ACKS_ENV, processor_acks

    try:
        if processor_acks() == "1":
            print(f"xidstream process: {PROCESSOR_ACKS_ENV}=1: commands and table rows are written with acks=1, "
                  f"without idempotence; a leader's loss can lose what it acknowledged (for measurement only)",
                  file=sys.stderr, flush=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    policy = load_policy(args.policy or conf.get("policy"))
    signing_key = None
    if args.signing_key or conf.get("signing_key"):
        from xidstream.schemas.signing import SigningKey

        signing_key = SigningKey.load(args.signing_key or conf.get("signing_key"))
    approver_keys = None
    if args.approver_key:
        from xidstream.schemas.signing import VerifyKeys

        approver_keys = VerifyKeys.load(args.approver_key, purpose="approvals")
        if signing_key is not None and signing_key.key_id in approver_keys.key_ids:
            raise ConfigError(f"--approver-key {signing_key.key_id} is the signing key's own: a reset must be "
                              f"approved by someone else's key")
    _check_identity_choice(args, signing_key)
    from xidstream.streams.app import create_app, internal_topics
    from xidstream.transport.kafka import ensure_processor_topics, settle_replication

    # its internal and changelog topics, and the start-up check of every topic, with one answer
    settings, replication = settle_replication(settings)
    print(f"xidstream process: topics it creates: {replication}", file=sys.stderr, flush=True)
    skip_inputs = ensure_processor_topics(settings, internal_topics(settings))
    verifier = None
    if args.enroller_key:
        if signing_key is None:
            raise ConfigError("--enroller-key needs --signing-key: each node's record key is agreed with the processor's")
        from xidstream.schemas.signing import VerifyKeys
        from xidstream.transport.identity import IdentityDirectory, ProcessorIdentity, RecordVerifier

        verifier = RecordVerifier(ProcessorIdentity(signing_key))
        directory = IdentityDirectory(settings, VerifyKeys.load(args.enroller_key, purpose="enrollments"), verifier).start()
        if not directory.wait_loaded(60):
            raise ConfigError(f"could not read {settings.topics.name('xidstream.identities')} to its end within 60 s")
        print(f"xidstream process: believing records of {len(verifier.identities)} enrolled identities "
              f"(more as they enroll)", file=sys.stderr, flush=True)
    store = args.store or conf.get("store") or "memory://"
    if store.startswith("rocksdb"):
        try:
            import rocksdict  # noqa: F401
        except ImportError:
            raise ConfigError("--store rocksdb:// needs the rocksdict package (pip install rocksdict)") from None
    data_dir = args.data_dir or conf.get("data_dir") or ".xidstream/processor"
    web_port = args.web_port if args.web_port is not None else conf.get("web_port")
    proc = create_app(settings, policy, app_id=args.app_id or conf.get("app_id"), web_port=web_port, web_bind=args.web_bind, store=store,
                      datadir=data_dir, fast_rebalance=args.fast_rebalance, signing_key=signing_key,
                      approver_keys=approver_keys, verifier=verifier, skip_inputs=skip_inputs)
    import faust

    try:
        import uvloop

        # faust's per-event cost is mostly asyncio scheduling; libuv's loop cuts it.
        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    print(f"xidstream process: {loop_name} loop, {proc.app.conf.id} on {settings.bootstrap}, {settings.partitions} partitions, "
          f"topics prefix {settings.topic_prefix!r}, store {store}"
          + (f", web and /metrics on http://{args.web_bind}:{web_port}" if web_port else ""), file=sys.stderr, flush=True)
    worker = faust.Worker(proc.app, loglevel=args.loglevel.upper(), quiet=True, redirect_stdouts=False)
    # faust's start-up spinner lowers the root logger to DEBUG (for a handler that spins on every
    # message) and leaves it there: every debug call of aiokafka and faust then built a log record,
    # per message sent (catch-up profile: ~3% of the worker's time). No spinner, no DEBUG.
    worker.spinner = None
    # Python's cyclic GC traced the ~0.5 million objects of faust, pydantic and the modules at
    # every full collection (30-90 ms every ~3 s on a busy worker) and ran a young collection every
    # 700 allocations (a record makes dozens). Start-up's objects are frozen out of it, and young
    # collections run every 10,000 allocations: 30.4 vs 32.7 us of CPU per record (median of 4
    # interleaved `processor_bench.py --only throughput` runs each), RSS per GPU unchanged after a
    # 10,000-GPU catch-up (5.6-5.7 KiB). Frozen objects that later become cyclic garbage are never
    # freed: start-up's objects live as long as the worker anyway.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    worker.execute_from_commandline()
    return 0


def _breaker(args: argparse.Namespace, settings: Settings) -> int:
    import orjson
    from confluent_kafka import KafkaException, Producer

    from xidstream.streams.app import FLEET_KEY, internal_topics
    from xidstream.transport.kafka import admin, list_topics, producer_config, unreachable

    fleet = list(internal_topics(settings))[1]
    try:
        md = list_topics(admin(settings), 10)
    except KafkaException as exc:
        raise TopicError(unreachable(settings.bootstrap, 10, exc, "to send the reset") + "; nothing was sent") from None
    if fleet not in md.topics:
        raise TopicError(f"{fleet} does not exist: no processor has run with topic prefix {settings.topic_prefix!r}")
    msg: dict = {"kind": "reset", "ts": time.time(), "by": args.by or getpass.getuser()}
    if args.key:
        import uuid
        from datetime import datetime, timedelta, timezone

        from xidstream.schemas.codec import to_dict
        from xidstream.schemas.models import Approval
        from xidstream.schemas.signing import SigningKey
        from xidstream.streams.handoff import RESET_COMMAND_ID

        now = datetime.now(timezone.utc)
        approval = SigningKey.load(args.key).sign(Approval(
            ts=now, node="fleet", approval_id=uuid.uuid4().hex, command_id=RESET_COMMAND_ID, approved_by=msg["by"],
            reason="breaker reset", expires_at=now + timedelta(seconds=args.ttl)))
        msg["approval"] = to_dict(approval)
    producer = Producer(producer_config(settings))
    producer.produce(fleet, key=FLEET_KEY, value=orjson.dumps(msg))
    if producer.flush(15) != 0:
        raise TopicError("the reset was not acknowledged by Kafka within 15 s")
    print(f"breaker reset sent to {fleet}; the fleet agent applies it in order with the commands before it")
    return 0
