"""An executor: the gate, the scope's actions and the journal, fed from Kafka or from standard input.

`Executor.handle` answers one command (a RemediationResult), or None when the command is held for
an approval (Kafka mode: it is carried out when an authentic approval arrives, or answered
`refused` once it expires). `Executor.approve` takes an Approval; `Executor.due` returns the
results of held commands that an approval released or that expired meanwhile.

Kafka mode (`run_kafka`): the executor reads `gpu.remediation` and `gpu.remediation.approvals`;
every command this executor is responsible for gets a result on `gpu.remediation.results` (keyed
by node), and its position moves past the command only after the broker acknowledged that result
(a crash re-reads the command; the journal answers it without running it again). Where the
position lives depends on who could move it:

- the cluster executor: its own consumer group, which only its own Kafka user may use
  (transport.acls);
- a node executor: no consumer group at all. Every node executor holds the same `executor` Kafka
  user, so a group of node B's was one that node A's credentials could commit to its end (B then
  skips every command) or rewind (B replays them once its journal is gone) (threat T2,
  a review's finding 6). A node executor assigns itself every partition and keeps its position in a cursor
  file beside its journal (hostPath in the chart); without one it starts at the first record
  younger than the longest a command may live (`Limits`): anything older is refused at the gate
  anyway. The `executor` role may only describe its group names (librdkafka's coordinator
  lookup), never commit in them.

Routing: the cluster executor answers cluster-scoped actions, a node executor answers node-scoped
actions for its node; each leaves the others' commands to them (in `--stdin` mode every command
is answered, a misrouted one `refused` with the reason).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Callable

import orjson

from xidstream.collectors.spool import write_durably
from xidstream.executors.gate import PENDING, SCOPE_ACTIONS, Answer, Approvals, Journal, Limits, Scope, decide, result_for, separate_trust
from xidstream.schemas.base import format_ts
from xidstream.schemas.codec import decode_any, encode
from xidstream.schemas.errors import DecodeError
from xidstream.schemas.models import Approval, RemediationCommand, RemediationResult
from xidstream.schemas.signing import VerifyKeys
from xidstream.schemas.vocab import Outcome
from xidstream.transport.acls import executor_group
from xidstream.transport.config import KafkaConfig

__all__ = ["Executor", "run_stdin", "run_kafka", "Cursor"]

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
        self._held_since: dict[str, float] = {}  # epoch seconds: the metrics' oldest held command
        for cid, raw in self.journal.held.items():  # held before a restart: still waiting
            try:
                self._held[cid] = RemediationCommand.model_validate(raw)
                self._held_since[cid] = self._held[cid].ts.timestamp()  # since its evidence, at the latest
            except ValueError:
                log.warning("journal: held command %s no longer decodes; dropped", cid)
        self.on_result: Callable[[RemediationCommand, RemediationResult], None] | None = None

    def held_since(self) -> dict[str, float]:
        return {cid: self._held_since.get(cid, 0.0) for cid in list(self._held)}

    def _answered(self, cmd: RemediationCommand, result: RemediationResult) -> RemediationResult:
        self._held_since.pop(cmd.command_id, None)
        if self.on_result is not None:
            self.on_result(cmd, result)
        return result

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

    def _pending(self, command_id: str) -> bool:
        """An action still under way (a reboot waiting to be confirmed): answered by `due()`."""
        pending = getattr(self.actions, "pending_ids", None)
        return pending is not None and command_id in pending()

    def handle(self, cmd: RemediationCommand, *, hold: bool = False) -> RemediationResult | None:
        now = self.clock()
        if self._pending(cmd.command_id):
            return None  # read again (a restart before the cursor moved): its answer comes from due()
        d = decide(cmd, keys=self.keys, now=now, scope=self.scope, node=self.node, journal=self.journal,
                   approvals=self.approvals, limits=self.limits)
        if not d.proceed:
            if d.awaiting_approval and hold:
                if cmd.command_id not in self._held:
                    log.info("command %s (%s on %s) held until an approval names it (expires %s)", cmd.command_id,
                             cmd.action.value, cmd.node, format_ts(cmd.expires_at))
                    self._held[cmd.command_id] = cmd
                    self._held_since[cmd.command_id] = now.timestamp()
                    self.journal.hold(cmd.command_id, orjson.loads(encode(cmd)))
                return None
            return self._answered(cmd, d.result) if d.result is not None else None
        return self._carry_out(cmd, now)

    def _carry_out(self, cmd: RemediationCommand, now: datetime) -> RemediationResult:
        dry = not self.apply or cmd.dry_run
        if not dry:
            self.journal.started(cmd, now, node=self.node)  # before acting: a crash mid-way is never re-run
        try:
            got = self.actions.execute(cmd, dry)
            answer = got if isinstance(got, Answer) else Answer(*got)
        except Exception as exc:  # noqa: BLE001 - an API or OS error is a failed result, not a dead executor
            log.exception("command %s (%s) raised", cmd.command_id, cmd.action.value)
            answer = Answer("failed", f"error while carrying it out: {type(exc).__name__}: {exc}")
        if answer.outcome == PENDING and not dry:
            log.info("command %s (%s) under way: %s", cmd.command_id, cmd.action.value, answer.detail)
            return None  # journaled as started; due() answers it once the action is confirmed or times out
        return self._finish(cmd, answer, dry)

    def _finish(self, cmd: RemediationCommand, answer: Answer, dry: bool = False) -> RemediationResult:
        detail = answer.detail
        if dry and cmd.dry_run and self.apply:
            detail += " (the command itself is marked dry_run)"
        result = result_for(cmd, Outcome(answer.outcome), detail, node=self.node, steps=answer.steps,
                            final=answer.final)
        if not dry:
            self.journal.done(result)
        self.journal.release(cmd.command_id)
        return self._answered(cmd, result)

    def due(self) -> list[RemediationResult]:
        """Held commands that an approval released (carried out now) or that expired (refused)."""
        out = []
        now = self.clock()
        confirm = getattr(self.actions, "due", None)
        if confirm is not None:  # actions under way that have their answer now (a reboot seen, or not in time)
            try:
                answered = confirm()
            except Exception:  # noqa: BLE001 - an API error: asked again at the next poll, never the loop's end
                log.exception("checking the actions under way failed; trying again")
                answered = []
            out.extend(self._finish(cmd, answer) for cmd, answer in answered)
        for cid, cmd in list(self._held.items()):
            if self.approvals.valid_for(cid, now) is not None and cmd.expires_at > now:
                del self._held[cid]
                out.append(self._carry_out(cmd, now))
            elif cmd.expires_at <= now:
                del self._held[cid]
                self.journal.release(cid)
                out.append(self._answered(cmd, result_for(
                    cmd, Outcome.expired, f"held for an approval that never came; expired at "
                    f"{format_ts(cmd.expires_at)}; nothing was done", node=self.node)))
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


class Cursor:
    """A node executor's read position, `{"topic:partition": next offset}`, in one JSON file
    replaced durably (`xidstream.collectors.spool.write_durably`, as the collector's cursors are): a crash
    leaves the previous position, which only re-reads commands the journal already answers."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.positions: dict[str, int] = {}
        self._dirty = False
        if self.path.exists():
            try:
                raw = orjson.loads(self.path.read_bytes())
                self.positions = {str(k): int(v) for k, v in raw.items()}
            except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
                # a cursor we cannot read costs a re-read of the last hour, never a skipped command
                log.warning("cursor %s unreadable (%s): starting from the oldest command still alive", self.path, exc)
                self.positions = {}

    def get(self, topic: str, partition: int) -> int | None:
        return self.positions.get(f"{topic}:{partition}")

    def advance(self, topic: str, partition: int, next_offset: int) -> None:
        k = f"{topic}:{partition}"
        if self.positions.get(k, -1) < next_offset:
            self.positions[k] = next_offset
            self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        write_durably(self.path, orjson.dumps(self.positions, option=orjson.OPT_SORT_KEYS))
        self._dirty = False


# How often a node executor looks for partitions added to its topics: it is in no consumer group,
# so nothing hands it a new partition (a minute of delay for a command on one, never a loss).
RELIST_S = 60.0
# How long a start-up look-up may retry a retriable broker answer (NOT_LEADER_FOR_PARTITION right
# after the topics were created, a leader election) before the executor gives up and exits.
LOOKUP_RETRY_S = 30.0


def _retriable(err: Any) -> bool:
    """A broker answer worth asking again: flagged so, or one of the codes a leader election or a
    topic just made gives (librdkafka flags only errors of its newer APIs)."""
    from confluent_kafka import KafkaError

    if bool(getattr(err, "retriable", lambda: False)()):
        return True
    code = err.code() if hasattr(err, "code") else None
    return code in {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT,
                    KafkaError._TRANSPORT, KafkaError.NOT_ENOUGH_REPLICAS}


def _partitions(consumer: Any, topics: list[str], timeout: float) -> list[tuple[str, int]]:
    md = consumer.list_topics(timeout=timeout)
    out = []
    for t in topics:
        meta = md.topics.get(t)
        if meta is None or meta.error is not None:
            raise RuntimeError(f"cannot read topic {t}: {getattr(meta, 'error', None) or 'it does not exist'}")
        out += [(t, p) for p in sorted(meta.partitions)]
    return out


def _offsets_for_times(consumer: Any, missing: list, timeout: float, retry_s: float) -> list:
    """`consumer.offsets_for_times`, retried while the broker's answer is retriable (raised, or per
    partition) for up to `retry_s`."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + retry_s
    delay = 0.25
    while True:
        try:
            found = consumer.offsets_for_times(missing, timeout=timeout)
            err = next((tp.error for tp in found if tp.error is not None), None)
        except KafkaException as exc:
            found, err = None, exc.args[0]
        if err is None:
            return found
        if not _retriable(err) or time.monotonic() + delay > deadline:
            raise RuntimeError(f"cannot look up start offsets: {err}")
        log.info("looking up start offsets: %s; retrying in %.2f s", err, delay)
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def _assign_from_cursor(consumer: Any, topics: list[str], cursor: Cursor, horizon_ms: int,
                        timeout: float = 30.0, retry_s: float = LOOKUP_RETRY_S) -> set[tuple[str, int]]:
    """Assign every partition of `topics`: at the cursor's position where it has one, else at the
    first record at or after `horizon_ms` (the end when there is none). Returns what it assigned."""
    from confluent_kafka import OFFSET_END, TopicPartition

    have, missing = [], []
    parts = _partitions(consumer, topics, timeout)
    for t, p in parts:
        off = cursor.get(t, p)
        (have if off is not None else missing).append(TopicPartition(t, p, off if off is not None else horizon_ms))
    if missing:
        found = _offsets_for_times(consumer, missing, timeout, retry_s)
        # -1: no record at or after the horizon, so nothing alive to read: start at the end
        have += [TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_END) for tp in found]
    consumer.assign(have)
    return set(parts)


def _assign_new(consumer: Any, topics: list[str], assigned: set[tuple[str, int]], cursor: Cursor) -> int:
    """Assign the partitions added to `topics` since `assigned` was taken, from their beginning
    (every record on a partition made after the executor started is newer than its start; the gate
    refuses what has expired). A broker that does not answer now is asked again next time."""
    from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

    try:
        parts = _partitions(consumer, topics, timeout=5.0)
    except (KafkaException, RuntimeError) as exc:
        log.warning("looking for new partitions of %s: %s; trying again in %.0f s", ", ".join(topics), exc, RELIST_S)
        return 0
    new = [(t, p) for t, p in parts if (t, p) not in assigned]
    if not new:
        return 0
    consumer.incremental_assign([TopicPartition(t, p, cursor.get(t, p) if cursor.get(t, p) is not None else OFFSET_BEGINNING)
                                 for t, p in new])
    assigned.update(new)
    log.info("reading %d new partition(s): %s", len(new), ", ".join(f"{t}[{p}]" for t, p in new))
    return len(new)


def run_kafka(ex: Executor, settings: "KafkaConfig", *, group: str | None = None, stop: threading.Event | None = None,
              poll: float = 0.5, auth: Any = None, tick: Callable[[], None] | None = None,
              relist_s: float = RELIST_S) -> int:
    """`auth` (a `xidstream.transport.identity.RecordAuth`): each result carries this executor's MAC header
    (the node's identity for a node executor, ``@cluster-executor`` for the cluster executor), so
    the processor acts only on results from the executor entitled to answer."""
    from confluent_kafka import Consumer, KafkaError, Producer

    from xidstream.transport.kafka import consumer_config, producer_config

    reg = settings.topics
    cmd_topic, appr_topic = reg.name("gpu.remediation"), reg.name("gpu.remediation.approvals")
    res_topic = reg.name("gpu.remediation.results")
    group = group or executor_group(settings.topic_prefix, ex.scope, ex.node)
    grouped = ex.scope == "cluster"
    # librdkafka wants a group.id even for a consumer that never joins or commits; a node
    # executor's is never used (no subscribe, no commit), and its role may not use any group
    consumer = Consumer(consumer_config(settings, group))
    producer = Producer(producer_config(settings))
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    cursor: Cursor | None = None
    if grouped:
        consumer.subscribe([cmd_topic, appr_topic])
        where = f"as group {group}"
    else:
        cursor = Cursor(ex.journal.path.with_name(f"cursor-{ex.journal.path.stem.removeprefix('journal-')}.json"))
        horizon = ex.clock().timestamp() - ex.limits.max_lifetime_s - ex.limits.max_future_skew_s
        assigned = _assign_from_cursor(consumer, [cmd_topic, appr_topic], cursor, int(horizon * 1000))
        n = len(assigned)
        where = (f"{n} partitions from {'its cursor ' + str(cursor.path) if cursor.positions else 'the oldest command still alive'}"
                 f" (no consumer group)")
    log.info("executor (%s%s, %s) reading %s and %s, %s", ex.scope, f" {ex.node}" if ex.node else "",
             "apply" if ex.apply else "dry run", cmd_topic, appr_topic, where)

    def done(msg: Any, acted: bool) -> None:
        """Move past `msg`: a commit for the cluster executor; the cursor for a node executor,
        saved at once after a command of its own, else at most once a second (re-reading other
        nodes' commands after a crash costs nothing)."""
        if grouped:
            consumer.commit(message=msg, asynchronous=False)
            return
        cursor.advance(msg.topic(), msg.partition(), msg.offset() + 1)
        if acted or time.monotonic() - last_save[0] >= 1.0:
            cursor.save()
            last_save[0] = time.monotonic()

    last_save = [time.monotonic()]

    def publish(results: list[RemediationResult]) -> None:
        for r in results:
            key, value = r.node.encode(), encode(r)
            headers = [auth.header(res_topic, key, value)] if auth is not None else None
            producer.produce(res_topic, key=key, value=value, headers=headers)
        if results and producer.flush(30) != 0:
            raise RuntimeError(f"could not publish {len(results)} result(s) to {res_topic} within 30 s")

    next_relist = time.monotonic() + relist_s
    try:
        while not stop.is_set():
            msg = consumer.poll(poll)
            publish(ex.due())
            if cursor is not None and time.monotonic() >= next_relist:
                _assign_new(consumer, [cmd_topic, appr_topic], assigned, cursor)
                next_relist = time.monotonic() + relist_s
            if tick is not None:
                tick()
            if msg is None:
                if cursor is not None:
                    cursor.save()
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
                done(msg, False)
                continue
            acted = False
            if isinstance(rec, Approval) and msg.topic() == appr_topic:
                ex.approve(rec)
                publish(ex.due())
            elif isinstance(rec, RemediationCommand) and msg.topic() == cmd_topic:
                if ex.mine(rec):
                    acted = True
                    r = ex.handle(rec, hold=True)
                    if r is not None:
                        publish([r])
            done(msg, acted)
    finally:
        if cursor is not None:
            cursor.save()
        consumer.close()
        producer.flush(10)
    return 0
