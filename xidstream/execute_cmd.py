"""`xidstream keys generate|sign`, `xidstream approve`, `xidstream execute`.

    xidstream keys generate --out DIR             # DIR/signing.key (0600) + DIR/signing.pub, prints the key id
    xidstream keys sign --key DIR/signing.key < commands.jsonl > signed.jsonl
    xidstream approve COMMAND_ID --key FILE --node NODE [--by NAME] [--ttl S] [--publish]
    xidstream execute --scope cluster --verify-key DIR/signing.pub [--approver-key OPS/signing.pub] [--apply] [--kubeconfig FILE]
                      [--replace-backend label|cluster-api|karpenter|condition] [--replace-kubeconfig FILE]
    xidstream execute --scope node --node NAME --verify-key FILE [--apply] [--reboot-sentinel PATH]
    xidstream execute ... --stdin                  # command JSON lines in, one result line each out; no Kafka
"""

from __future__ import annotations

import argparse
import getpass
import shlex
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from xidstream.schemas.errors import ConfigError
from xidstream.cliargs import add_kafka_args, require_node_name
from xidstream.settings import Settings

__all__ = ["register"]


def _keys(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.schemas.signing import SigningKey, generate_keys

    if args.action == "identity":
        if not args.key:
            raise ConfigError("keys identity needs --key FILE (the processor's signing key)")
        from xidstream.transport.identity import ProcessorIdentity

        public = ProcessorIdentity(SigningKey.load(args.key)).public  # what nodes get as --processor-identity
        if args.out:
            _write_public(Path(args.out), public)
            print(f"processor identity {public} -> {args.out} (put it in the verify Secret as identity.pub)")
        else:
            print(public)
        return 0

    if args.action == "generate":
        if not args.out:
            raise ConfigError("keys generate needs --out DIR")
        from xidstream.transport.identity import IDENTITY_PUB, ProcessorIdentity

        priv, pub, kid = generate_keys(args.out)
        # The processor's X25519 identity key follows from its signing key: written beside it, so
        # the verify Secret the node pods mount carries it (the chart's identity.processorKey "").
        ident = Path(args.out) / IDENTITY_PUB
        _write_public(ident, ProcessorIdentity(SigningKey.load(priv)).public)
        print(f"key id {kid}\nprivate key {priv} (keep it with the processor; mode 0600)\n"
              f"public key  {pub} (give it to every executor: --verify-key {shlex.quote(str(pub))})\n"
              f"identity    {ident} (the processor's node-identity key: every node's --processor-identity)")
        return 0
    if not args.key:
        raise ConfigError("keys sign needs --key FILE (a private key from `xidstream keys generate`)")
    from xidstream.schemas.codec import decode_any, encode
    from xidstream.schemas.errors import DecodeError
    from xidstream.schemas.models import Approval, RemediationCommand

    key = SigningKey.load(args.key)
    bad = 0
    for n, line in enumerate(sys.stdin.buffer, 1):
        if not line.strip():
            continue
        try:
            rec = decode_any(line)
        except DecodeError as exc:
            print(f"xidstream keys sign: line {n}: {exc}", file=sys.stderr)
            bad += 1
            continue
        if not isinstance(rec, (RemediationCommand, Approval)):
            print(f"xidstream keys sign: line {n}: a {rec.schema_} record is not signed (commands and approvals are)",
                  file=sys.stderr)
            bad += 1
            continue
        sys.stdout.buffer.write(encode(key.sign(rec)) + b"\n")
    sys.stdout.flush()
    return 1 if bad else 0


def _write_public(path: Path, public: str) -> None:
    """A public key file, replaced whole (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(public + "\n", encoding="ascii")
    tmp.replace(path)


def _identity(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.transport.identity import NodeIdentity

    ident = NodeIdentity.load_or_create(args.identity_dir, args.node)
    if args.action == "show":
        print(f"{ident.identity} x25519 {ident.x25519_public} ed25519 {ident.ed25519_public}")
        return 0
    from xidstream.executors.enroll import request_enrollment
    from xidstream.executors.kube import make_client

    name = request_enrollment(make_client(args.kubeconfig), ident)
    print(f"asked to enroll {ident.identity} (CertificateSigningRequest {name}); the cluster executor's enroller "
          f"publishes it on {settings.topics.name('xidstream.identities')}", file=sys.stderr)
    return 0


def _approve(args: argparse.Namespace, settings: Settings) -> int:
    from xidstream.schemas.codec import encode
    from xidstream.schemas.models import Approval
    from xidstream.schemas.signing import SigningKey

    require_node_name(args.node)  # a held command is always about a Node; anything else came from a forgery
    key = SigningKey.load(args.key)
    approval = key.sign(Approval(
        node=args.node, approval_id=uuid.uuid4().hex, command_id=args.command_id,
        approved_by=args.by or getpass.getuser(), reason=args.reason or "",
        expires_at=datetime.now(timezone.utc) + timedelta(seconds=args.ttl)))
    raw = encode(approval)
    if args.publish:
        from confluent_kafka import Producer

        from xidstream.transport.kafka import producer_config

        topic = settings.topics.name("gpu.remediation.approvals")
        producer = Producer(producer_config(settings))
        producer.produce(topic, key=args.node.encode(), value=raw)
        if producer.flush(30) != 0:
            raise ConfigError(f"could not publish the approval to {topic} on {settings.bootstrap} within 30 s")
        print(f"approved command {args.command_id} on {args.node} until {approval.expires_at:%Y-%m-%dT%H:%M:%SZ} "
              f"(approval {approval.approval_id}, key {key.key_id}); published to {topic}", file=sys.stderr)
    else:
        sys.stdout.buffer.write(raw + b"\n")
        sys.stdout.flush()
    return 0


def build_executor(args: argparse.Namespace):  # -> executors.runner.Executor
    from xidstream.executors.runner import Executor
    from xidstream.schemas.signing import VerifyKeys

    if args.scope == "node" and not args.node:
        raise ConfigError("--scope node needs --node NAME (the node this executor runs on)")
    if args.scope == "node":
        require_node_name(args.node)
    if args.pod_view and args.scope != "node":
        raise ConfigError("--pod-view is the node executor's (--scope node); the cluster executor serves the view "
                          "(--pod-view-port)")
    if args.pod_view_port and args.scope != "cluster":
        raise ConfigError("--pod-view-port is the cluster executor's (--scope cluster)")
    if args.replace_kubeconfig and args.replace_backend != "cluster-api":
        raise ConfigError("--replace-kubeconfig names the Cluster API management cluster: it goes with "
                          "--replace-backend cluster-api")
    keys = VerifyKeys.load(args.verify_key or [], args.revoked_keys)
    approval_keys = VerifyKeys.load(args.approver_key or [], args.revoked_keys, purpose="approvals")
    client = None
    if not (args.scope == "node" and args.no_kube):
        from xidstream.executors.kube import make_client

        client = make_client(args.kubeconfig)
    if args.scope == "cluster":
        from xidstream.executors.cluster import ClusterActions

        from xidstream.executors.cluster import MANAGED_NODE_LABELS

        replace_client = make_client(args.replace_kubeconfig) if args.replace_kubeconfig else None
        actions = ClusterActions(client, drain_timeout=args.drain_timeout,
                                 managed_labels=tuple(args.managed_node_label or MANAGED_NODE_LABELS),
                                 keep_namespaces=tuple(args.drain_keep_namespace),
                                 replace_backend=args.replace_backend, replace_client=replace_client)
    else:
        from xidstream.executors.gpureset import NvidiaSmi
        from xidstream.executors.node import NodeActions, NvmlGpuOps
        from xidstream.executors.reboot import KuredReboot, LogindReboot

        if args.fake_nvml:
            from xidstream.collectors.fakes import FilePynvml

            print(f"xidstream execute: --fake-nvml {args.fake_nvml}: GPUs are what that file says, not NVML; for "
                  f"end-to-end tests only", file=sys.stderr, flush=True)
            gpu_ops = NvmlGpuOps(FilePynvml(args.fake_nvml), smi=NvidiaSmi(args.nvidia_smi))
        else:
            try:
                import pynvml

                gpu_ops = NvmlGpuOps(pynvml, smi=NvidiaSmi(args.nvidia_smi))
            except ImportError:
                gpu_ops = None
        from xidstream.collectors.nvml import NvmlRelease

        view = None
        if args.pod_view:
            from xidstream.transport.podview import PodViewClient

            view = PodViewClient(args.pod_view, args.pod_view_token)
        backend = LogindReboot() if args.reboot_backend == "logind" else KuredReboot(args.reboot_sentinel, pod_view=view)
        actions = NodeActions(client, args.node, gpu_ops, reboot_sentinel=args.reboot_sentinel, pod_view=view,
                              collector_release=NvmlRelease(args.collector_state_dir),
                              release_timeout=args.release_timeout, precondition_wait=args.precondition_wait,
                              keep_namespaces=tuple(args.drain_keep_namespace), state_dir=args.state_dir,
                              operand_wait=args.operand_wait, reboot_backend=backend,
                              reboot_confirm_s=args.reboot_confirm_timeout)
        if args.apply and not args.fake_nvml:
            from xidstream.executors.gpureset import lacks_admin

            if lacks_admin():
                print("xidstream execute: this process lacks CAP_SYS_ADMIN: the driver answers nvidia-smi --gpu-reset "
                      "and -pm only to an administrator, so RESET_GPU will fail (Insufficient Permissions) and climb "
                      "to a reboot. The chart grants it with nodeExecutor.apply; elsewhere add the capability.",
                      file=sys.stderr, flush=True)
        if args.apply:
            left = actions.recover()  # a reset this executor died in: its operands and persistence mode back
            if left:
                print(f"xidstream execute: an earlier reset left these unrestored: {'; '.join(left)}",
                      file=sys.stderr, flush=True)
    state = Path(args.state_dir)
    return Executor(scope=args.scope, keys=keys, actions=actions, state_dir=state, apply=args.apply,
                    node=args.node if args.scope == "node" else None, approval_keys=approval_keys)


def _execute(args: argparse.Namespace, settings: Settings) -> int:
    ex = build_executor(args)
    mode = "APPLY" if args.apply else "dry run (nothing is changed; --apply to act)"
    print(f"xidstream execute: {args.scope} executor{' for node ' + args.node if args.node else ''}, {mode}, "
          f"commands signed by {', '.join(ex.keys.key_ids)}, approvals by "
          f"{', '.join(ex.approval_keys.key_ids) or 'nobody (held commands expire)'}, journal {ex.journal.path}",
          file=sys.stderr, flush=True)
    if args.metrics_port:
        from xidstream.executors.metrics import ExecutorMetrics

        metrics = ExecutorMetrics(args.scope, ex.held_since)
        ex.on_result = lambda cmd, r: metrics.result(cmd.action, r.outcome, r.detail)
        metrics.serve(args.metrics_port, args.metrics_addr)
        print(f"xidstream execute: metrics on http://{args.metrics_addr}:{args.metrics_port}/metrics",
              file=sys.stderr, flush=True)
    if args.scope == "cluster" and args.pod_view_port:
        _serve_pod_view(args)
    if args.stdin:
        from xidstream.executors.runner import run_stdin

        return run_stdin(ex, sys.stdin.buffer, sys.stdout.buffer)
    from xidstream.executors.runner import run_kafka
    from xidstream.transport.identity import CLUSTER_IDENTITY
    from xidstream.transport.kafka import check_replication
    from xidstream.collect_cmd import node_auth

    reg = settings.topics
    check_replication(settings, [reg.name(n) for n in ("gpu.remediation", "gpu.remediation.approvals",
                                                       "gpu.remediation.results")])

    auth = node_auth(args, args.node if args.scope == "node" else CLUSTER_IDENTITY)
    tick = None
    if args.enroll_key:
        if args.scope != "cluster":
            raise ConfigError("--enroll-key is the cluster executor's (--scope cluster)")
        tick = _enroller(args, settings)
    return run_kafka(ex, settings, auth=auth, tick=tick)


def _serve_pod_view(args: argparse.Namespace) -> None:
    """The pod view (executors.podview): every pod watched, each node's served to that node's pods."""
    from xidstream.executors.kube import make_client
    from xidstream.executors.podview import PodIndex, PodViewServer, PodWatch, TokenCheck, review_with

    index = PodIndex()
    # clients of their own: the watch holds its connection open; the reviews come from the server's threads
    PodWatch(make_client(args.kubeconfig, timeout=60.0), index).start()
    tokens = TokenCheck(review_with(make_client(args.kubeconfig)), args.node_service_account)
    port = PodViewServer(index, tokens).serve(args.pod_view_port, args.pod_view_addr)
    print(f"xidstream execute: pod view on http://{args.pod_view_addr}:{port}/v1/pods for the pods of "
          f"{args.node_service_account} (each its own node's pods)", file=sys.stderr, flush=True)


def _enroller(args: argparse.Namespace, settings: Settings):
    """What run_kafka calls between polls: enroll new node identities every 10 s."""
    import time

    from confluent_kafka import Producer

    from xidstream.executors.enroll import Enroller
    from xidstream.executors.kube import make_client
    from xidstream.schemas.codec import encode
    from xidstream.schemas.signing import SigningKey
    from xidstream.transport.kafka import producer_config

    topic = settings.topics.name("xidstream.identities")
    producer = Producer(producer_config(settings))

    def publish(rec) -> None:
        producer.produce(topic, key=rec.node.encode(), value=encode(rec))
        if producer.flush(30) != 0:
            raise RuntimeError(f"could not publish the enrollment of {rec.node} to {topic} within 30 s")

    key = SigningKey.load(args.enroll_key)
    enroller = Enroller(make_client(args.kubeconfig), key, publish, node_service_account=args.node_service_account)
    if args.identity_dir:
        # The enroller vouches for itself: its own results carry @cluster-executor's MAC.
        from xidstream.schemas.models import NodeEnrollment
        from xidstream.transport.identity import CLUSTER_IDENTITY, NodeIdentity

        own = NodeIdentity.load_or_create(args.identity_dir, CLUSTER_IDENTITY)
        publish(key.sign(NodeEnrollment(node=CLUSTER_IDENTITY, x25519_public=own.x25519_public,
                                        ed25519_public=own.ed25519_public, csr_name="", csr_uid="",
                                        vouched="the enroller's own identity")))
    last = [0.0]

    def tick() -> None:
        if time.monotonic() - last[0] >= 10.0:
            last[0] = time.monotonic()
            try:
                enroller.poll_once()
            except Exception as exc:  # noqa: BLE001 - the API server may be away a moment; the next tick retries
                print(f"xidstream execute: enrollment pass failed: {exc}", file=sys.stderr, flush=True)

    return tick


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="Ed25519 keys that sign remediation commands and approvals")
    p.add_argument("action", choices=["generate", "sign", "identity"])
    p.add_argument("--out", help="generate: the folder for signing.key, signing.pub and identity.pub (the processor's "
                                 "node-identity key); identity: the file to write the identity key to (default: print it)")
    p.add_argument("--key", help="sign: the private key file; command/approval JSON lines stdin -> signed lines stdout")
    p.set_defaults(handler=_keys)

    p = sub.add_parser("identity", help="this node's identity: make its keys and ask the API server to enroll them")
    p.add_argument("action", choices=["request", "show"])
    p.add_argument("--node", required=True, help="the node this runs on (the downward API's spec.nodeName)")
    p.add_argument("--identity-dir", required=True, help="where the node's keys are kept (the node pod's state dir)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account, whose pod-bound "
                                        "token tells the API server which node asks)")
    p.set_defaults(handler=_identity)

    p = sub.add_parser("approve", help="sign an approval that releases one held command")
    p.add_argument("command_id")
    p.add_argument("--key", required=True, help="the approver's private key (its public key must be an executor's "
                                                 "--approver-key, never a --verify-key)")
    p.add_argument("--node", required=True, help="the node the command is for (the approvals topic is keyed by node)")
    p.add_argument("--by", help="who approves (default: the login name)")
    p.add_argument("--reason", help="why, in words")
    p.add_argument("--ttl", type=float, default=900.0, help="seconds the approval stays valid (default 900)")
    p.add_argument("--publish", action="store_true", help="publish to gpu.remediation.approvals (default: print the JSON line)")
    add_kafka_args(p, partitions=False)
    p.set_defaults(handler=_approve)

    p = sub.add_parser("execute", help="carry out signed remediation commands (dry run unless --apply)")
    p.add_argument("--scope", choices=["cluster", "node"], required=True)
    p.add_argument("--node", help="node scope: the node this executor runs on (required)")
    p.add_argument("--verify-key", action="append", metavar="FILE",
                   help="a public key trusted to sign commands: the processor's (repeat it during a key rotation); at least one")
    p.add_argument("--approver-key", action="append", metavar="FILE", default=[],
                   help="a public key trusted to sign approvals of held commands (repeat for each approver); never "
                        "one of the --verify-key keys. Without one, held commands wait until they expire")
    p.add_argument("--identity-dir", metavar="DIR",
                   help="this executor's identity keys (node scope: the node's, shared with its collector; cluster "
                        "scope: @cluster-executor's): each result carries its MAC")
    p.add_argument("--processor-identity", metavar="HEX|FILE",
                   help="the processor's identity key, 64 hex digits or a file holding them (identity.pub), with --identity-dir")
    p.add_argument("--enroll-key", metavar="FILE",
                   help="cluster scope: enroll node identities (CSRs for xidstream.io/node-identity) and sign the "
                        "enrollments with this private key (the processor's --enroller-key is its public half)")
    p.add_argument("--node-service-account", metavar="NS/NAME", default="xidstream/xidstream-node",
                   help="cluster scope: the service account of the node pods: with --enroll-key, whose CSRs enroll "
                        "their node; with --pod-view-port, whose tokens the pod view answers (default "
                        "xidstream/xidstream-node)")
    p.add_argument("--revoked-keys", metavar="FILE",
                   help="a file of revoked key ids, one per line; re-read when it changes (commands and approvals "
                        "signed by a listed key are refused)")
    p.add_argument("--apply", action="store_true", help="act; without it every command is answered with what it would do")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account)")
    p.add_argument("--no-kube", action="store_true", help="node scope: no API server (RESET_GPU then is refused on its "
                                                           "cordoned/drained precondition; REBOOT_NODE records no Event)")
    p.add_argument("--stdin", action="store_true", help="command JSON lines on stdin, one result line each on stdout; no Kafka")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics (results by action and outcome, commands held for an approval) "
                        "on this port (0: off)")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="metrics bind address (default 127.0.0.1)")
    from xidstream.transport.podview import AUDIENCE, TOKEN_PATH

    p.add_argument("--pod-view-port", type=int, default=0, metavar="PORT",
                   help="cluster scope: serve the pod view on this port (0: off; the chart's 9466): GET /v1/pods "
                        "answers a node pod the pods bound to its own node, the node named by a TokenReview of its "
                        f"token (audience {AUDIENCE}); needs pods watch and tokenreviews create")
    p.add_argument("--pod-view-addr", default="127.0.0.1", help="pod view bind address (default 127.0.0.1)")
    p.add_argument("--pod-view", metavar="URL",
                   help="node scope: this node's pods from the cluster executor's pod view instead of a pod list on "
                        "the API server (the chart's node pods may not read pods); cannot tell = not drained")
    p.add_argument("--pod-view-token", default=TOKEN_PATH, metavar="FILE",
                   help=f"with --pod-view: this pod's projected service-account token of audience {AUDIENCE} "
                        f"(default {TOKEN_PATH}, where the chart mounts it)")
    p.add_argument("--state-dir", default=".xidstream/executor", help="the journal of carried-out commands (default .xidstream/executor)")
    p.add_argument("--managed-node-label", action="append", metavar="LABEL",
                   help="cluster scope: act only on nodes with one of these labels, never on control-plane nodes "
                        "(repeat; default nvidia.com/gpu.present and feature.node.kubernetes.io/pci-10de.present, "
                        "the chart's GPU-node selector)")
    p.add_argument("--drain-keep-namespace", action="append", default=[], metavar="NS",
                   help="a drain never evicts pods of this namespace, and RESET_GPU's 'drained' precondition ignores "
                        "them (repeat; the chart gives its own namespace: the processor and the cluster executor "
                        "must outlive the drain they carry out)")
    p.add_argument("--replace-backend", choices=["label", "cluster-api", "karpenter", "condition"], default="label",
                   help="cluster scope: where REPLACE_NODE hands the node over: label (xidstream.io/replace=true, for "
                        "your own tooling; the default, as before), cluster-api (annotate its Machine "
                        "cluster.x-k8s.io/remediate-machine for MachineHealthCheck), karpenter (delete its NodeClaim), "
                        "condition (GPUHealthy=False, reason ReplacementRequested); docs/operations.md")
    p.add_argument("--replace-kubeconfig", metavar="FILE",
                   help="with --replace-backend cluster-api: the management cluster's kubeconfig, where the Machines "
                        "live (default: the same API server as the Nodes, a self-managed cluster)")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="cluster scope: seconds a drain waits on blocking PodDisruptionBudgets (default 120)")
    p.add_argument("--reboot-sentinel", default="/var/run/reboot-required", help="node scope: kured's sentinel file (default /var/run/reboot-required)")
    p.add_argument("--reboot-backend", choices=["kured", "logind"], default="kured",
                   help="node scope: how REBOOT_NODE reboots: kured (write its sentinel; refused when no kured pod runs "
                        "on the node; kured checks every --period, 1 h by default) or logind (the host's systemd-logind "
                        "over its D-Bus socket, at once, after the cordon and drain); either is confirmed by the node's "
                        "bootID changing (default kured)")
    p.add_argument("--reboot-confirm-timeout", type=float, default=None, metavar="S",
                   help="node scope: seconds a reboot may take to be seen (bootID changed, node Ready, GPU back) before "
                        "REBOOT_NODE is answered failed (default 5400 with kured, 900 with logind)")
    p.add_argument("--operand-wait", type=float, default=300.0, metavar="S",
                   help="node scope: seconds RESET_GPU waits for the GPU Operator's paused operands to leave, or for "
                        "another controller's pause to end (default 300, the Operator's own per-operand wait)")
    p.add_argument("--nvidia-smi", default=None, metavar="PATH",
                   help="node scope: the nvidia-smi to run (default: the one on the PATH)")
    p.add_argument("--fake-nvml", metavar="FILE",
                   help="END-TO-END TESTS ONLY: node scope, GPUs from a JSON file re-read when it changes "
                        "(collectors.fakes.FilePynvml), as the collector's --fake-nvml")
    p.add_argument("--collector-state-dir", default=".xidstream/collector",
                   help="node scope: the collector's --state-dir (shared in the node's pod); RESET_GPU asks the collector "
                        "there to release its NVML handles first (default .xidstream/collector)")
    p.add_argument("--release-timeout", type=float, default=10.0,
                   help="node scope: seconds RESET_GPU waits for the collector's release (default 10)")
    p.add_argument("--precondition-wait", type=float, default=150.0,
                   help="node scope: seconds RESET_GPU waits for the node to be cordoned and drained (the "
                        "CORDON_NODE and DRAIN_NODE sent with it; keep it above the cluster executor's "
                        "--drain-timeout) before its preconditions are checked (default 150)")
    add_kafka_args(p, partitions=False)
    p.set_defaults(handler=_execute)
