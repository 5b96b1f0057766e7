"""`xidstream collect` and `xidstream parse`: the commands over the collector library (`collectors/`)."""

from __future__ import annotations

import argparse
import gzip
import logging
import math
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import orjson

from xidstream.schemas.errors import ConfigError, TopicError
from xidstream.transport.config import default_node_name
from xidstream.cliargs import add_kafka_args, require_node_name
from xidstream.settings import Settings

__all__ = ["register"]

log = logging.getLogger("xidstream.collect")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="run the node collector (NVML, processes, kernel Xids -> Kafka)")
    p.add_argument("--sink", choices=["kafka", "stdout"], default="kafka", help="where records go (stdout: JSON lines)")
    p.add_argument("--kernel-log", default="kmsg", metavar="SRC",
                   help="kmsg (default), kmsg:PATH, journal, file:PATH, - (stdin), or none; file and stdin need "
                        "--accept-forgeable-kernel-log")
    p.add_argument("--accept-forgeable-kernel-log", action="store_true",
                   help="read --kernel-log file:PATH or - (stdin), text in which any process that crashes inside a "
                        "file it names can forge a driver Xid line (rsyslog's kern.log, dmesg output); its records "
                        "are published with source 'file', which the processor records but never acts on alone")
    p.add_argument("--accept-injected-kmsg", action="store_true",
                   help="END-TO-END TESTS ONLY: count /dev/kmsg lines written by userspace (facility 1) as the "
                        "kernel's, so a test can inject an Xid; any root process on the node can then forge one")
    p.add_argument("--fake-nvml", metavar="FILE",
                   help="END-TO-END TESTS ONLY: GPUs from a JSON file re-read when it changes "
                        "(collectors.fakes.FilePynvml), for a machine without a GPU")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    p.add_argument("--counters-interval", type=float, default=60.0, metavar="SECONDS",
                   help="seconds between reads of each GPU's error and link counters (NVLink, PCIe, ECC, retired "
                        "pages, clock event reasons, fabric: gpu.counters; default 60; 0: not read)")
    p.add_argument("--once", action="store_true", help="one sample of everything, publish, exit")
    p.add_argument("--scenario", help="drive fake NVML and kernel-log sources from a scenario file")
    p.add_argument("--speed", type=float, default=0.0, help="with --scenario: x times real time (0: as fast as possible)")
    p.add_argument("--node", help="node name on every record: the Node's name, a DNS-1123 subdomain (env "
                                  "XIDSTREAM_NODE; default: the host name in lower case, as the kubelet names its Node)")
    p.add_argument("--state-dir", default=".xidstream/collector", help="spool and cursors (default .xidstream/collector)")
    p.add_argument("--no-nvml", action="store_true", help="kernel Xid records only")
    p.add_argument("--no-kubernetes", action="store_true", help="no pod watch / pod-resources (gpu.workloads)")
    from xidstream.transport.podview import AUDIENCE, TOKEN_PATH

    p.add_argument("--pod-view", metavar="URL",
                   help="this node's pods from the cluster executor's pod view (its --pod-view-port), polled every "
                        "10 s, instead of a pod watch on the API server (the chart's node pods may not read pods)")
    p.add_argument("--pod-view-token", default=TOKEN_PATH, metavar="FILE",
                   help=f"with --pod-view: this pod's projected service-account token of audience {AUDIENCE} "
                        f"(default {TOKEN_PATH}, where the chart mounts it)")
    from xidstream.collectors.sources.rack import DEFAULT_RACK_LABEL

    p.add_argument("--rack-label", default=DEFAULT_RACK_LABEL, metavar="LABEL",
                   help="the label of this node's Node object that names its rack, carried by every GPU inventory "
                        "(read at start and every 6 h; needs `get` on nodes; default topology.kubernetes.io/rack; "
                        "'': none)")
    p.add_argument("--rack", metavar="VALUE",
                   help="this node's rack, instead of a Node label (a node outside Kubernetes)")
    p.add_argument("--identity-dir", metavar="DIR",
                   help="this node's identity keys (made once; `xidstream identity request` enrolls them): every record "
                        "carries the node's MAC, and a processor with --enroller-key believes only such records")
    p.add_argument("--processor-identity", metavar="HEX|FILE",
                   help="the processor's identity key, 64 hex digits or a file holding them (identity.pub, which "
                        "`xidstream keys generate` and `keys identity --key signing.key --out FILE` write), with --identity-dir")
    p.add_argument("--request-enrollment", action="store_true",
                   help="with --identity-dir, in a pod: ask the API server to enroll this node's identity at start "
                        "(as `xidstream identity request`), again every 30 s until it is asked")
    p.add_argument("--create-topics", action="store_true",
                   help="create missing topics first, replicated as the cluster can hold (3, or one per broker when "
                        "fewer) unless --replication-factor says otherwise")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="metrics bind address (default 127.0.0.1)")
    p.add_argument("--backfill", nargs="?", const="all", default=None, metavar="DAYS",
                   help="on a first start, publish kernel-log history (rotated files, the earlier journal) "
                        "older than the current boot: all of it, or the last DAYS days; records are marked "
                        "backfilled (default: the current boot only)")
    p.add_argument("--forget-gpu", action="append", default=[], metavar="UUID",
                   help="an operator removed this GPU: stop publishing it as lost from the saved inventory")
    add_kafka_args(p)
    p.set_defaults(handler=_collect)

    p = sub.add_parser("parse", help="kernel log text -> one JSON line per Xid or related record")
    p.add_argument("files", nargs="*", help="files (.gz too); default: stdin")
    p.add_argument("--node", default=None, help="node name for the records (default: hostname)")
    p.add_argument("--xid-only", action="store_true", help="only Xid records, not identity/SXid/... lines")
    p.add_argument("--strict", action="store_true",
                   help="only records a live source would believe (/dev/kmsg records of facility 0, journal "
                        "records of transport kernel); default: every driver record wherever it sits in a line, "
                        "each saying whether a live source would believe it and why not")
    p.add_argument("-v", "--verbose", action="store_true", help="name each refused line on stderr")
    p.set_defaults(handler=_parse)

    p = sub.add_parser("gpu-check", help="read every NVML field through the real pynvml and print it")
    p.add_argument("--wait-events", type=float, default=1.0, help="seconds to wait for an Xid event")
    p.set_defaults(handler=lambda args, settings: __import__("xidstream.collectors.gpucheck", fromlist=["x"]).run_gpu_check(
        wait_events=args.wait_events))


# -- parse -------------------------------------------------------------------------------------
def _open_text(path: str):
    if path == "-":
        return sys.stdin
    if path.endswith(".gz"):
        return gzip.open(path, "rt", errors="replace")
    return open(path, errors="replace")


def _parse(args: argparse.Namespace, settings: Settings) -> int:
    """Kernel log text as people paste it (saved logs, tickets, a tool's output): one parser, the
    live rules (`parse_line_checked`) in forensic mode. Each record says whether a live source
    would believe it (`believed`, and `refused` with its reason when not); --strict prints only
    those it would. Lines refused (a live source would believe nothing of them) are counted on
    stderr by reason, and named with -v."""
    import os

    from xidstream.collectors.agent import IdentityMap, line_time, xid_fields
    from xidstream.collectors.parse.kernel import (REFUSALS, continues_fallen, merge_more, merge_sxid, parse_line_checked,
                                         sxid_continues)
    from xidstream.schemas.models import XidEvent
    from xidstream.schemas.codec import to_dict

    node = require_node_name(args.node or default_node_name())
    # GPU identity from believed lines only resolves believed records; a paste's own identity lines
    # resolve its other records.
    ident, ident_any = IdentityMap(), IdentityMap()
    lines = found = 0
    kinds: dict[str, int] = {}
    refused: dict[str, int] = {}
    out = sys.stdout
    pending = None  # an SXid event, or a print's first line, that later lines may continue

    ref_ts = None  # the file's mtime: the year of a syslog stamp

    def emit(rec) -> None:
        nonlocal found
        uuid, index, pci = (ident if rec.refused is None else ident_any).resolve(rec.pci, rec.gpu_ref)
        ts, ts_source = line_time(rec, ref_ts, datetime.now(timezone.utc))
        event = XidEvent(**xid_fields(rec, node=node, ts=ts, gpu_uuid=uuid, gpu_index=index, pci_bus_id=pci),
                         source="file", sources=["file"], ts_source=ts_source)
        doc = to_dict(event)
        doc["believed"] = rec.refused is None
        if rec.refused is not None:
            doc["refused"] = rec.refused
            doc["refused_why"] = REFUSALS[rec.refused]
        out.write(orjson.dumps(doc).decode() + "\n")
        found += 1
        kinds[rec.kind] = kinds.get(rec.kind, 0) + 1

    for path in args.files or ["-"]:
        try:
            ref_ts = os.stat(path).st_mtime if path != "-" else None
            fh = _open_text(path)
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
        with fh:
            for line in fh:
                lines += 1
                parsed = parse_line_checked(line, forensic=True)
                if parsed.refused is not None:
                    refused[parsed.refused] = refused.get(parsed.refused, 0) + 1
                    if args.verbose:
                        print(f"xidstream parse: {path}:{lines}: refused ({parsed.refused}: {REFUSALS[parsed.refused]})"
                              f"{': ' + parsed.error if parsed.error else ''}: {line.rstrip()[:300]!r}", file=sys.stderr)
                for rec in parsed.records:
                    if args.strict and rec.refused is not None:
                        continue
                    if args.xid_only and rec.kind != "xid":
                        continue
                    if rec.kind == "gpu_identity" and rec.pci and rec.gpu_uuid:
                        ident_any.learn_identity(rec.pci, rec.gpu_uuid)
                        if rec.refused is None:
                            ident.learn_identity(rec.pci, rec.gpu_uuid)
                    if pending is not None and sxid_continues(pending.xid, pending.mono_us, rec):
                        pending = merge_sxid(pending, rec)
                        continue
                    if pending is not None:
                        emit(pending)
                        pending = None
                    if rec.kind in ("sxid", "fallen_off_bus"):
                        pending = rec
                    else:
                        emit(rec)
                for piece in parsed.more:
                    if args.strict and piece.refused is not None:
                        continue
                    if continues_fallen(pending, piece):
                        pending = merge_more(pending, piece)
    if pending is not None:
        emit(pending)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
    why = ", ".join(f"{n} {k}" for k, n in sorted(refused.items())) or "none"
    print(f"xidstream parse: {lines} lines, {found} records ({summary}){' believed by a live source' if args.strict else ''}; "
          f"{sum(refused.values())} lines refused by a live source's rules ({why})"
          + ("" if args.verbose or not refused else "; -v names each"), file=sys.stderr)
    return 0


# -- collect -----------------------------------------------------------------------------------
def _check_topics(settings: Settings, create: bool) -> set[str]:
    """Check the topics a collector writes; returns the logical names of those missing that the
    collector can do without (what the processor does not read: gpu.counters). A missing topic the
    processor reads is a TopicError: without it the collector's Xids go nowhere."""
    from confluent_kafka import KafkaException

    from xidstream.schemas.topics import COLLECTED_TOPICS, TOPICS
    from xidstream.transport.kafka import admin, check_replication, create_topics, list_topics, settle_replication
    from xidstream.transport.kafka_log import KAFKA_LOG

    names = [settings.topics.name(n) for n in COLLECTED_TOPICS]
    if create:
        settings, replication = settle_replication(settings)
        log.warning("--create-topics: %s", replication)
        create_topics(settings)
        check_replication(settings, names)
        return set()
    try:
        md = list_topics(admin(settings), 5)
    except KafkaException as exc:
        # the sink says, at its first connection error, where it spools and how it retries
        log.warning("Kafka not reachable at %s at start (%s); the collector runs and spools its records until it is",
                    settings.bootstrap, KAFKA_LOG.latest(settings.bootstrap) or exc)
        return set()
    # Only what a collector writes: its least-privilege user may see no other topic (a user without
    # DESCRIBE on a topic does not see it either, hence the ACL in the messages).
    missing = [n for n in COLLECTED_TOPICS if settings.topics.name(n) not in md.topics]
    needed = [settings.topics.name(n) for n in missing if TOPICS[n].required]
    if needed:
        raise TopicError(f"topics missing on {settings.bootstrap}: {', '.join(needed)}; "
                         f"run `xidstream topics create` (or pass --create-topics), and grant the collector's user "
                         f"WRITE and DESCRIBE on them (transport/acls.py)")
    # An upgrade that added a topic (TopicSpec.required False) must not stop collection
    for n in missing:
        log.error("topic %s is missing on %s (or this user may not DESCRIBE it): %s is not published until the "
                  "collector restarts after `xidstream topics create` and a WRITE and DESCRIBE grant for it "
                  "(transport/acls.py)", settings.topics.name(n), settings.bootstrap, n)
    check_replication(settings, [t for t in names if t in md.topics])
    return set(missing)


def node_auth(args: argparse.Namespace, identity: str):  # -> transport.identity.RecordAuth | None
    """The MAC every record of this node carries, from --identity-dir and --processor-identity."""
    if not getattr(args, "identity_dir", None):
        if getattr(args, "processor_identity", None):
            raise ConfigError("--processor-identity needs --identity-dir (where this node's keys are kept)")
        return None
    if not args.processor_identity:
        raise ConfigError("--identity-dir needs --processor-identity HEX|FILE (`xidstream keys identity --key signing.key`)")
    from xidstream.transport.identity import NodeIdentity, read_processor_public

    return NodeIdentity.load_or_create(args.identity_dir, identity).record_auth(read_processor_public(args.processor_identity))


def _request_enrollment_until_done(identity_dir: str | None, node: str) -> None:
    """Ask for this node's enrollment in a daemon thread, every 30 s until the API server took the
    request (it may be unreachable at boot); the collector publishes meanwhile, and the processor
    dead-letters what it cannot yet believe."""
    import threading

    if not identity_dir:
        raise ConfigError("--request-enrollment needs --identity-dir")

    def run() -> None:
        import time

        from xidstream.executors.enroll import request_enrollment
        from xidstream.executors.kube import make_client
        from xidstream.transport.identity import NodeIdentity

        while True:
            try:
                name = request_enrollment(make_client(None), NodeIdentity.load_or_create(identity_dir, node))
                log.warning("asked the API server to enroll node %s (CertificateSigningRequest %s)", node, name)
                return
            except Exception as exc:  # noqa: BLE001 - any failure: say why, try again
                log.error("cannot ask for this node's enrollment (%s); trying again in 30 s", exc)
                time.sleep(30)

    threading.Thread(target=run, name="xidstream-enroll", daemon=True).start()


def _collect(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.collectors.metrics import CollectorMetrics
    from xidstream.collectors.sink import KafkaSink, StdoutSink

    if args.interval <= 0:
        raise ConfigError("--interval must be > 0")
    state = Path(args.state_dir)
    if args.sink == "kafka":
        if "gpu.counters" in _check_topics(settings, args.create_topics):
            args.counters_interval = 0
        sink = KafkaSink(settings, state / "spool", auth=node_auth(args, settings.node))
        if args.request_enrollment:
            _request_enrollment_until_done(args.identity_dir, settings.node)
    else:
        sink = StdoutSink(settings)
    metrics = CollectorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
        log.warning("metrics on http://%s:%d/metrics", args.metrics_addr, args.metrics_port)

    if args.scenario:
        from xidstream.collectors.scenario import ScenarioRunner
        from xidstream.schemas.scenario import load_scenario

        scenario = load_scenario(args.scenario)
        progress = (lambda m: print(f"xidstream collect: {m}", file=sys.stderr)) if args.sink == "kafka" else None
        ScenarioRunner(scenario, sink, interval=args.interval, progress=progress).run(speed=args.speed)
        ok = sink.flush(60)
        sink.close()
        stats = sink.stats()
        print(f"xidstream collect: scenario '{scenario.name}' done: published {stats['published']}, "
              f"dropped {stats['dropped']}" + ("" if ok else " (not all acknowledged; kept in the spool)"),
              file=sys.stderr)
        return 0 if ok else 1
    return _collect_live(args, settings, sink, metrics, state)


def _backfill_since(value: str | None) -> datetime | None:
    """--backfill: None (current boot), "all" (the epoch), or a number of days back."""
    if value is None:
        return None
    if value == "all":
        return datetime(1970, 1, 1, tzinfo=timezone.utc)
    try:
        days = float(value)
    except ValueError:
        raise ConfigError(f"--backfill {value!r}: give a number of days, or no value for all history") from None
    if days <= 0:
        raise ConfigError("--backfill DAYS must be > 0")
    from datetime import timedelta

    return datetime.now(timezone.utc) - timedelta(days=days)


def _rack_source(args: argparse.Namespace, node: str):  # -> collectors.agent.RackSource | None
    """--rack VALUE (checked here: a bad one is refused at start), else the Node label --rack-label
    when on Kubernetes, else None."""
    import os

    from xidstream.collectors.sources import rack

    if args.rack is not None:
        try:
            return rack.FixedRack(args.rack)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return rack.from_environment(os.environ, node, args.rack_label)


def _collect_live(args, settings: Settings, sink, metrics, state: Path) -> int:
    from xidstream.collectors.agent import Collector, CollectorConfig
    from xidstream.collectors.nvml import NvmlReader
    from xidstream.collectors.sources.kernel import open_kernel_source
    from xidstream.collectors.sources.procfs import ProcFs

    require_node_name(settings.node)
    if args.accept_injected_kmsg:
        log.warning("--accept-injected-kmsg: lines written to /dev/kmsg by userspace count as the kernel's; "
                    "for end-to-end tests only, never on a node that runs tenants' pods")
    if args.accept_forgeable_kernel_log and (args.kernel_log.startswith("file:") or args.kernel_log == "-"):
        log.warning("--accept-forgeable-kernel-log: reading the kernel log from text (%s), where a tenant can forge "
                    "a driver line; its Xid records go out with source 'file', which the processor never acts on "
                    "alone (only where NVML saw the same fault)", args.kernel_log)
    nvml = None
    if args.fake_nvml:
        from xidstream.collectors.fakes import FilePynvml

        log.warning("--fake-nvml %s: GPUs are what that file says, not NVML; for end-to-end tests only",
                    args.fake_nvml)
        try:
            nvml = NvmlReader(FilePynvml(args.fake_nvml))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    elif not args.no_nvml:
        import pynvml  # NVIDIA's nvidia-ml-py

        nvml = NvmlReader(pynvml)
    since = _backfill_since(args.backfill)
    kernel = None
    if args.kernel_log != "none":
        try:
            kernel = open_kernel_source(args.kernel_log, state, since=since.timestamp() if since else None,
                                        accept_injected=args.accept_injected_kmsg,
                                        accept_forgeable=args.accept_forgeable_kernel_log)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
    import os

    from xidstream.collectors.sources.kubernetes import from_environment

    view = None
    if args.pod_view:
        from xidstream.transport.podview import PodViewClient

        view = PodViewClient(args.pod_view, args.pod_view_token)
    workloads = None if args.no_kubernetes else from_environment(os.environ, settings.node, pod_view=view)
    rack = _rack_source(args, settings.node)
    if not math.isfinite(args.counters_interval) or args.counters_interval < 0:
        raise ConfigError("--counters-interval must be a number of seconds >= 0 (0: the counters are not read)")
    config = CollectorConfig(node=settings.node, interval=args.interval, backfill_since=since,
                             counters_interval=args.counters_interval or None)
    collector = Collector(config, sink,
                          nvml=nvml, kernel=kernel, procfs=ProcFs(), workloads=workloads, metrics=metrics,
                          state_dir=state, rack=rack)
    for uuid in args.forget_gpu:
        if not collector.forget_gpu(uuid):
            log.warning("--forget-gpu %s: not in the saved inventory", uuid)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    collector.start(datetime.now(timezone.utc))
    try:
        while not stopping:
            began = time.monotonic()
            collector.tick(datetime.now(timezone.utc))
            if args.once or (kernel is not None and getattr(kernel, "done", False) and nvml is None):
                break
            time.sleep(max(0.0, args.interval - (time.monotonic() - began)))
    except KeyboardInterrupt:
        pass
    finally:
        collector.stop()
        ok = sink.flush(10)
        sink.close()
    if not ok:
        log.warning("some records are not acknowledged yet; they stay in %s and are sent on the next start", state / "spool")
    return 0
