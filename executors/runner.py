"""An executor: the gate, the scope's actions and the journal, fed from Kafka or from standard input.

`Executor.handle` answers one command (a RemediationResult), or None when the command is held for
an approval (Kafka mode: it is carried out when an authentic approval arrives, or answered
`refused` once it expires). `Executor.approve` takes an Approval; `Executor.due` returns the
results of held commands that an approval released or that expired meanwhile.

Kafka mode (`run_kafka`): one consumer group reads `gpu.remediation` and
`gpu.remediation.approvals`; every command this executor is responsible for gets a result on
`gpu.remediation.results` (keyed by node), and the offset is committed only after the broker
acknowledged that result (a crash re-reads the command; the journal answers it without running
it again). Routing: the cluster executor answers cluster-scoped actions, a node executor answers
node-scoped actions for its node; each leaves the others' commands to them (in `--stdin` mode
every command is answered, a misrouted one `refused` with the reason).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Callable

import orjson

from executors.gate import SCOPE_ACTIONS, Approvals, Journal, Limits, Scope, decide, result_for, separate_trust
from schemas.base import format_ts
from schemas.codec import decode_any, encode
from schemas.errors import DecodeError
from schemas.models import Approval, RemediationCommand, RemediationResult
from schemas.signing import VerifyKeys
from schemas.vocab import Outcome
from transport.acls import executor_group
from transport.config import KafkaConfig

__all__ = ["Executor", "run_stdin", "run_kafka"]

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class Executor:
    def __init__(self, *, scope: Scope, keys: VerifyKeys, actions: Any, state_dir: str | Path, apply: bool = False,
                 node: str | None = None, clock: Clock = _utc_now, approval_keys: VerifyKeys | None = None,
                 limits: Limits | None = None) -> None:
        """`keys` verify commands, `approval_keys` approvals (two trust sets, never sharing a key;
        without approver keys no held command can be approved)."""
        if scope == "node" and not node:
            raise ValueError("a node executor needs its node name (--node NAME)")
        self.scope, self.keys, self.actions, self.apply, self.node, self.clock = scope, keys, actions, apply, node, clock
        self.approval_keys = approval_keys if approval_keys is not None else VerifyKeys({})
        separate_trust(keys, self.approval_keys)
        self.limits = limits or Limits()
        self.journal = Journal(Path(state_dir) / f"journal-{scope}{'-' + node if node else ''}.jsonl")
        self.approvals = Approvals(self.approval_keys, self.limits)
        self._held: dict[str, RemediationCommand] = {}
        for cid, raw in self.journal.held.items():  # held before a restart: still waiting
            try:
                self._held[cid] = RemediationCommand.model_validate(raw)
            except ValueError:
                log.warning("journal: held command %s no longer decodes; dropped", cid)

    def mine(self, cmd: RemediationCommand) -> bool:
        """Routing in Kafka mode: is this executor the one that answers `cmd`?"""
        if cmd.action not in SCOPE_ACTIONS[self.scope]:
            return False
        return self.scope == "cluster" or cmd.node == self.node

    def approve(self, approval: Approval) -> str | None:
        why = self.approvals.add(approval)
        if why:
            log.warning("approval %s for command %s rejected: %s", approval.approval_id, approval.command_id, why)
        return why

    def handle(self, cmd: RemediationCommand, *, hold: bool = False) -> RemediationResult | None:
        now = self.clock()
        d = decide(cmd, keys=self.keys, now=now, scope=self.scope, node=self.node, journal=self.journal,
                   approvals=self.approvals, limits=self.limits)
        if not d.proceed:
            if d.awaiting_approval and hold:
                if cmd.command_id not in self._held:
                    log.info("command %s (%s on %s) held until an approval names it (expires %s)", cmd.command_id,
                             cmd.action.value, cmd.node, format_ts(cmd.expires_at))
                    self._held[cmd.command_id] = cmd
                    self.journal.hold(cmd.command_id, orjson.loads(encode(cmd)))
                return None
            return d.result
        return self._carry_out(cmd, now)

    def _carry_out(self, cmd: RemediationCommand, now: datetime) -> RemediationResult:
        dry = not self.apply or cmd.dry_run
        if not dry:
            self.journal.started(cmd, now, node=self.node)  # before acting: a crash mid-way is never re-run
        try:
            outcome, detail = self.actions.execute(cmd, dry)
        except Exception as exc:  # noqa: BLE001 - an API or OS error is a failed result, not a dead executor
            log.exception("command %s (%s) raised", cmd.command_id, cmd.action.value)
            outcome, detail = "failed", f"error while carrying it out: {type(exc).__name__}: {exc}"
        if dry and cmd.dry_run and self.apply:
            detail += " (the command itself is marked dry_run)"
        result = result_for(cmd, Outcome(outcome), detail, node=self.node)
        if not dry:
            self.journal.done(result)
        self.journal.release(cmd.command_id)
        return result

    def due(self) -> list[RemediationResult]:
        """Held commands that an approval released (carried out now) or that expired (refused)."""
        out = []
        now = self.clock()
        for cid, cmd in list(self._held.items()):
            if self.approvals.valid_for(cid, now) is not None and cmd.expires_at > now:
                del self._held[cid]
                out.append(self._carry_out(cmd, now))
            elif cmd.expires_at <= now:
                del self._held[cid]
                self.journal.release(cid)
                out.append(result_for(cmd, Outcome.expired, f"held for an approval that never came; expired at "
                                      f"{format_ts(cmd.expires_at)}; nothing was done", node=self.node))
        return out

    @property
    def held(self) -> list[str]:
        return list(self._held)

    def drop_held(self) -> list[RemediationResult]:
        """End of `--stdin` input: each held command is answered refused (no approval came)."""
        out = []
        for cid, cmd in list(self._held.items()):
            del self._held[cid]
            self.journal.release(cid)
            d = self.handle(cmd, hold=False)
            if d is not None:
                out.append(d)
        return out


def _decode_line(line: bytes) -> Any:
    return decode_any(line)


def run_stdin(ex: Executor, stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """Command (and approval) JSON lines in, one result JSON line per command out. Approvals may
    come before or after the command they name: a held command is carried out when its approval
    line arrives, and answered refused at the end of the input otherwise."""
    bad = 0

    def emit(r: RemediationResult) -> None:
        stdout.write(encode(r) + b"\n")
        stdout.flush()

    for n, line in enumerate(stdin, 1):
        if not line.strip():
            continue
        try:
            rec = _decode_line(line)
        except DecodeError as exc:
            print(f"xidstream execute: line {n}: not a contract record: {exc}", file=sys.stderr)
            bad += 1
            continue
        if isinstance(rec, Approval):
            ex.approve(rec)
            for r in ex.due():
                emit(r)
        elif isinstance(rec, RemediationCommand):
            r = ex.handle(rec, hold=True)
            if r is not None:
                emit(r)
        else:
            print(f"xidstream execute: line {n}: a {rec.schema_} record is neither a command nor an approval; skipped",
                  file=sys.stderr)
            bad += 1
    for r in ex.drop_held():
        emit(r)
    return 1 if bad else 0


def run_kafka(ex: Executor, settings: "KafkaConfig", *, group: str | None = None, stop: threading.Event | None = None,
              poll: float = 0.5, auth: Any = None, tick: Callable[[], None] | None = None) -> int:
    """`auth` (a `transport.identity.RecordAuth`): each result carries this executor's MAC header
    (the node's identity for a node executor, ``@cluster-executor`` for the cluster executor), so
    the processor acts only on results from the executor entitled to answer."""
    from confluent_kafka import Consumer, KafkaError, Producer

    from transport.kafka import consumer_config, producer_config

    reg = settings.topics
    cmd_topic, appr_topic = reg.name("gpu.remediation"), reg.name("gpu.remediation.approvals")
    res_topic = reg.name("gpu.remediation.results")
    group = group or executor_group(settings.topic_prefix, ex.scope, ex.node)
    consumer = Consumer(consumer_config(settings, group))
    producer = Producer(producer_config(settings))
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    consumer.subscribe([cmd_topic, appr_topic])
    log.info("executor (%s%s, %s) reading %s and %s as group %s", ex.scope, f" {ex.node}" if ex.node else "",
             "apply" if ex.apply else "dry run", cmd_topic, appr_topic, group)

    def publish(results: list[RemediationResult]) -> None:
        for r in results:
            key, value = r.node.encode(), encode(r)
            headers = [auth.header(res_topic, key, value)] if auth is not None else None
            producer.produce(res_topic, key=key, value=value, headers=headers)
        if results and producer.flush(30) != 0:
            raise RuntimeError(f"could not publish {len(results)} result(s) to {res_topic} within 30 s")

    try:
        while not stop.is_set():
            msg = consumer.poll(poll)
            publish(ex.due())
            if tick is not None:
                tick()
            if msg is None:
                continue
            if msg.error() is not None:
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer: %s", msg.error())
                continue
            try:
                rec = decode_any(msg.value())
            except DecodeError as exc:
                log.warning("%s[%d]@%d: not a contract record, skipped: %s", msg.topic(), msg.partition(),
                            msg.offset(), exc)
                consumer.commit(message=msg, asynchronous=False)
                continue
            if isinstance(rec, Approval) and msg.topic() == appr_topic:
                ex.approve(rec)
                publish(ex.due())
            elif isinstance(rec, RemediationCommand) and msg.topic() == cmd_topic:
                if ex.mine(rec):
                    r = ex.handle(rec, hold=True)
                    if r is not None:
                        publish([r])
            consumer.commit(message=msg, asynchronous=False)
    finally:
        consumer.close()
        producer.flush(10)
    return 0
