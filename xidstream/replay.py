"""`xidstream replay SCENARIO...`: scenarios through the real path, with a readable verdict.

fake NVML + fake kernel log -> the real collector code (parse, identity, merge, KafkaSink) -> Kafka
-> the real processor (a `xidstream process` worker) -> gpu.alerts, gpu.remediation.

Each scenario runs under a fresh topic prefix (and so a fresh consumer group), so runs never see
each other's records; everything it created on the broker (topics of the contract and of the
processor, changelogs, faust's assignor topic, consumer groups) is deleted afterwards unless --keep. Scenario time runs as fast
as the pipeline takes it: the processor decides by the records' own timestamps.

The replay's children die with it. A SIGTERM or SIGINT stops the run where it is: the `finally`
blocks stop the worker (by its PID) and delete the run's topics, and the replay exits 128+signal
saying what it was doing; a second one while that runs ends the replay at once. A SIGKILL runs no
code of ours: the kernel then kills the worker (`xidstream.runner.die_with_parent`).
`--jobs N` replays up to N scenarios at once, each in a child `xidstream replay` of its own (its
own clients and worker: librdkafka clients in one process's threads are what crashed the cluster
tests), and prints their output in the order the files were given; a stop signal reaches every
child, which cleans up as above. Every wait is bounded, and a wait that ends says what it waited for and what it saw.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import orjson

from xidstream.collectors.scenario import ScenarioRunner, pick_command
from xidstream.collectors.sink import KafkaSink
from xidstream.schemas.base import Record
from xidstream.schemas.codec import decode_any, to_dict
from xidstream.schemas.errors import DecodeError, ScenarioError, XidstreamError
from xidstream.schemas.models import Alert, DeadLetter, RemediationCommand, RemediationResult
from xidstream.schemas.scenario import Scenario, load_scenario
from xidstream.schemas.topics import INPUT_TOPICS
from xidstream.streams.app import internal_topics
from xidstream.transport.kafka import create_topics, delete_run, read_all
from xidstream.runner import WorkerProcess
from xidstream.settings import Settings

__all__ = ["ReplayResult", "replay_scenario", "check_scenario", "render_timeline", "run_replay", "KafkaCommandLookup",
           "EngineCommandLookup"]


@dataclass
class ReplayResult:
    scenario: Scenario
    start: datetime
    records: list[tuple[str, str, Record]] = field(default_factory=list)  # (logical topic, key, record)
    seconds: float = 0.0
    published: dict = field(default_factory=dict)
    topic_prefix: str = ""  # the run's topics and groups were named under it (and deleted)

    @property
    def alerts(self) -> list[Alert]:
        return [r for t, _, r in self.records if isinstance(r, Alert)]

    @property
    def commands(self) -> list[RemediationCommand]:
        return [r for t, _, r in self.records if isinstance(r, RemediationCommand)]

    @property
    def dead(self) -> list[DeadLetter]:
        return [r for t, _, r in self.records if isinstance(r, DeadLetter)]


class KafkaCommandLookup:
    """The scripted executor's view of the run's `gpu.remediation` (a `CommandLookup`): every
    command the processor released, read from the beginning by a consumer that joins no group
    (so it leaves none behind). The scenario runs far ahead of the processor, so a lookup that
    finds no command waits for one: `before_wait` first (flush the collectors' records, so the
    processor can see what leads to the command; check the worker is alive), then up to `timeout`
    seconds of wall clock."""

    def __init__(self, settings: Settings, *, timeout: float = 30.0, before_wait=None) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from xidstream.transport.kafka import admin, consumer_config

        self.timeout = timeout
        self.before_wait = before_wait
        self.commands: list[RemediationCommand] = []
        topic = settings.topics.name("gpu.remediation")
        md = admin(settings).list_topics(topic, timeout=10)
        parts = sorted(md.topics[topic].partitions) if topic in md.topics else []
        if not parts:
            raise XidstreamError(f"{topic} does not exist: the replay's topics were not created")
        # assign(), not subscribe(): no group membership, no committed offsets, nothing to clean up
        self.consumer = Consumer(consumer_config(settings, f"{settings.topic_prefix}xidstream-replay-executor"))
        self.consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        self.topic = topic

    def _read(self, timeout: float) -> None:
        from xidstream.transport.kafka import consume_records

        self.commands += [r for r in consume_records(self.consumer, timeout) if isinstance(r, RemediationCommand)]

    def __call__(self, node, gpu_uuid, pci_bus_id, action, exclude):
        found = pick_command(self.commands, node, gpu_uuid, pci_bus_id, action, exclude)
        if found is not None:
            return found
        if self.before_wait is not None:
            self.before_wait()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            self._read(0.5)
            found = pick_command(self.commands, node, gpu_uuid, pci_bus_id, action, exclude)
            if found is not None:
                return found
        seen = ", ".join(f"{c.action.value} on {c.node}" for c in self.commands[-8:]) or "none"
        raise ScenarioError(f"no {action.value} command for node {node}"
                            + (f" GPU {gpu_uuid or pci_bus_id}" if (gpu_uuid or pci_bus_id) else "")
                            + f" reached {self.topic} within {self.timeout:g} s (commands seen: {seen})")

    def close(self) -> None:
        self.consumer.close()


class EngineCommandLookup:
    """A `CommandLookup` for the pure path (no Kafka): folds what the sink holds so far through a
    fresh `xidstream.streams.engine.Engine` and looks among its commands. Quadratic, for scenario-sized runs."""

    def __init__(self, records_so_far, policy=None) -> None:
        self.records_so_far = records_so_far
        self.policy = policy

    def __call__(self, node, gpu_uuid, pci_bus_id, action, exclude):
        from xidstream.streams.engine import Engine

        engine = Engine(self.policy).run(list(self.records_so_far()))
        return pick_command(engine.commands, node, gpu_uuid, pci_bus_id, action, exclude)


def replay_scenario(scenario: Scenario, bootstrap: str, *, partitions: int = 1, policy: str | None = None,
                    keep: bool = False, workdir: Path | None = None, log=None, telemetry: bool = False,
                    command_timeout: float = 30.0, processor_timeout: float = 240.0) -> ReplayResult:
    say = log or (lambda m: None)
    settings = Settings(bootstrap=bootstrap, topic_prefix=f"replay-{scenario.name[:40]}-{uuid.uuid4().hex[:8]}.",
                        partitions=partitions, node="replay")
    tmp = Path(workdir or tempfile.mkdtemp(prefix="xidstream-replay-"))
    t0 = time.monotonic()
    worker = None
    lookup = None
    # Everything this run creates on the broker is named under its prefix: the contract topics,
    # the processor's internal topics and changelogs, faust's assignor topic, the consumer groups.
    # It is all deleted at the end, also when the run fails (unless --keep).
    try:
        create_topics(settings)
        worker = WorkerProcess(settings, tmp, policy=policy).start()
        sink = KafkaSink(settings, tmp / "spool")
        start = scenario.start or datetime.now().astimezone().replace(microsecond=0)
        say(f"{scenario.name}: feeding {scenario.duration:.0f} s of scenario time through the collectors")
        if any(e.remediation_result is not None for e in scenario.timeline):
            def before_wait() -> None:
                if not sink.flush(30):
                    raise XidstreamError(f"Kafka did not acknowledge the scenario's records: {sink.stats()}")
                if not worker.alive():
                    raise XidstreamError(f"the processor exited (code {worker.proc.returncode}):\n{worker.tail()}")

            lookup = KafkaCommandLookup(settings, timeout=command_timeout, before_wait=before_wait)
        ScenarioRunner(scenario, sink, start=start, command_lookup=lookup).run()
        if not sink.flush(60):
            raise XidstreamError(f"Kafka did not acknowledge the scenario's records: {sink.stats()}")
        published = sink.stats()["published"]
        sink.close()
        say(f"{scenario.name}: {sum(published.values())} records published; waiting for the processor "
            f"(up to {processor_timeout:g} s)")
        topics = [settings.topics.name(n) for n in INPUT_TOPICS] + [settings.topics.name("gpu.remediation.results")]
        topics += list(internal_topics(settings))
        if not worker.wait_idle(topics, timeout=processor_timeout):
            seen = getattr(worker, "idle_seen", None) or f"consumer group {worker.group}; no lag reading"
            raise XidstreamError(f"the processor did not catch up within {processor_timeout:g} s: waited for "
                                 f"{seen}; its log:\n{worker.tail()}")
        worker.stop()
        reg = settings.topics
        out_topics = [reg.name(n) for n in ("gpu.alerts", "gpu.remediation", "gpu.remediation.results",
                                            "xidstream.deadletter")]
        if telemetry:  # the inputs too: `xidstream incident ID --html --stdin` charts the samples
            out_topics += [reg.name(n) for n in INPUT_TOPICS]
        result = ReplayResult(scenario, start, seconds=0.0, published=published, topic_prefix=settings.topic_prefix)
        for m in read_all(settings, out_topics, timeout=20, idle=2):
            try:
                rec = decode_any(m.value())
            except DecodeError as exc:
                raise XidstreamError(f"undecodable record on {m.topic()}: {exc}") from None
            result.records.append((m.topic()[len(settings.topic_prefix):], (m.key() or b"").decode(), rec))
        result.records.sort(key=lambda x: (x[2].ts, 0 if isinstance(x[2], Alert) else 1))
        result.seconds = time.monotonic() - t0
        return result
    finally:
        if lookup is not None:
            lookup.close()
        if worker is not None:
            if worker.alive():  # the run failed or was stopped before the worker's own stop
                say(f"{scenario.name}: stopping the processor worker (pid {worker.proc.pid})")
            worker.stop()
        if not keep:
            # after the worker stopped: a live worker would recreate its topics and rejoin its group
            try:
                delete_run(settings)
            except XidstreamError as exc:
                say(f"{scenario.name}: could not delete the run's topics (prefix {settings.topic_prefix}): {exc}")
            shutil.rmtree(tmp, ignore_errors=True)


# -- stopping ---------------------------------------------------------------------------------
class _Stopped(BaseException):
    """A SIGTERM or SIGINT reached the replay. Not an `Exception`, so no `except Exception` on the
    way out swallows it; every `finally` runs (the worker is stopped, the run's topics deleted)."""

    def __init__(self, signum: int, doing: str) -> None:
        super().__init__(signum, doing)
        self.signum, self.doing = signum, doing


@contextmanager
def _stop_on_signals(doing: Callable[[], str]) -> Iterator[list[int]]:
    """SIGTERM and SIGINT raise `_Stopped`, noting `doing()`, in the main thread (Python runs
    handlers only there; elsewhere this does nothing). A second signal during the clean-up ends the
    process by that signal at once: its workers then get their parent-death signal. Yields the
    signals received: a `_Stopped` raised inside a library's callback may reach the caller wrapped
    in that library's error (pydantic's serializer)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    stopping: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if stopping:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stopping.append(signum)
        raise _Stopped(signum, doing())

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stopping
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _replay_children(paths: list[str], names: list[str], bootstrap: str, args: list[str], jobs: int,
                     log: Callable[[str], None], out: TextIO, check: bool) -> int:
    """Each file replayed by a child `xidstream replay FILE --bootstrap ...`, up to `jobs` at once;
    a child's stdout and stderr are kept in files and printed whole, in the order of `paths`, so the
    output reads as a sequential run's. Returns how many failed (with --check: a failed check or an
    error; without: raises naming the scenarios that ended in an error).

    The children are started from this (the main) thread with `die_with_parent(SIGTERM)`: a replay
    killed outright still has every child clean up its worker and topics. A stop signal here
    (`_Stopped`) is passed on to every running child, and waited for, before it goes on up."""
    from xidstream.runner import die_with_parent

    tmp = Path(tempfile.mkdtemp(prefix="xidstream-replay-jobs-"))
    queue = list(range(len(paths)))
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    codes: dict[int, int] = {}
    printed = 0
    try:
        while queue or running:
            while queue and len(running) < jobs:
                i = queue.pop(0)
                with (tmp / f"{i}.out").open("wb") as o, (tmp / f"{i}.err").open("wb") as e:
                    proc = subprocess.Popen([sys.executable, "-m", "xidstream.cli", "replay", paths[i],
                                             f"--bootstrap={bootstrap}", *args],
                                            stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                            preexec_fn=die_with_parent(signal.SIGTERM))
                running[i] = (proc, time.monotonic())
                log(f"{names[i]}: started (pid {proc.pid}; {len(codes) + len(running)} of {len(paths)})")
            for i, (proc, began) in list(running.items()):
                if proc.poll() is not None:
                    codes[i] = proc.returncode
                    del running[i]
                    log(f"{names[i]}: done in {time.monotonic() - began:.1f} s (exit code {proc.returncode})")
            while printed in codes:  # in the order given, as soon as every earlier one is done
                out.write((tmp / f"{printed}.out").read_text(errors="replace"))
                out.flush()
                for line in (tmp / f"{printed}.err").read_text(errors="replace").splitlines():
                    if not line.startswith("replay --check: "):  # the sum is this run's, printed at the end
                        print(line, file=sys.stderr)
                printed += 1
            time.sleep(0.2)
    except _Stopped:
        for proc, _ in running.values():
            proc.send_signal(signal.SIGTERM)
        for i, (proc, _) in running.items():
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
            log(f"{names[i]}: stopped (exit code {proc.returncode}); its output: {tmp}/{i}.err")
        raise
    errors = [names[i] for i, rc in sorted(codes.items()) if rc not in (0, 1)]
    if errors and not check:
        raise XidstreamError(f"{len(errors)} of {len(paths)} replays ended in an error (above): {', '.join(errors)}")
    shutil.rmtree(tmp, ignore_errors=True)
    return sum(1 for rc in codes.values() if rc != 0)


# -- checking -----------------------------------------------------------------------------------
def _matches(scenario: Scenario, rec: Any, node: str | None, gpu: Any) -> bool:
    if node is not None and rec.node != node:
        return False
    if gpu is not None:
        uuid_ = scenario.gpu(node, gpu).uuid if node is not None else gpu
        return rec.gpu_uuid == uuid_
    return True


def _subsequence(wanted: list, got: list) -> bool:
    it = iter(got)
    return all(any(w == g for g in it) for w in wanted)


def check_scenario(result: ReplayResult) -> list[str]:
    """Failures of the scenario's `expect` and `forbid` blocks, as sentences; [] when all hold."""
    sc, start = result.scenario, result.start
    failures = []
    for i, exp in enumerate(sc.expect):
        where = f"expect[{i}] {exp.classification.value}" + (f" on {exp.node}" if exp.node else "") + \
            (f" GPU {exp.gpu}" if exp.gpu is not None else "")
        alerts = [a for a in result.alerts if a.classification == exp.classification and _matches(sc, a, exp.node, exp.gpu)]
        if not alerts:
            seen = sorted({a.classification.value for a in result.alerts if _matches(sc, a, exp.node, exp.gpu)})
            failures.append(f"{where}: no such alert (alerts there: {', '.join(seen) or 'none'})")
            continue
        if exp.actions:
            incidents = {a.incident_id for a in alerts}
            cmds = [c.action for c in result.commands if _matches(sc, c, exp.node, exp.gpu) and
                    (c.incident_id in incidents or exp.classification.value == "FLEET_STORM")]
            if not _subsequence(exp.actions, cmds):
                failures.append(f"{where}: actions {[a.value for a in exp.actions]} not commanded in that order "
                                f"(commanded: {[a.value for a in cmds]})")
        if exp.within is not None:
            first = (alerts[0].ts - start).total_seconds()
            lo, hi = exp.after, exp.after + exp.within
            if not lo <= first <= hi:
                failures.append(f"{where}: first alert at +{first:.1f} s, expected between +{lo:g} and +{hi:g} s")
    for i, forb in enumerate(sc.forbid):
        where = f"forbid[{i}]" + (f" on {forb.node}" if forb.node else "") + (f" GPU {forb.gpu}" if forb.gpu is not None else "")
        bad = [c for c in result.commands if c.action in forb.actions and not c.requires_approval
               and _matches(sc, c, forb.node, forb.gpu)]
        if bad:
            failures.append(f"{where}: commanded without approval: " +
                            ", ".join(f"{c.action.value} at +{(c.ts - start).total_seconds():.0f} s" for c in bad))
        bad_alerts = [a for a in result.alerts if a.classification in forb.classification and _matches(sc, a, forb.node, forb.gpu)]
        if bad_alerts:
            failures.append(f"{where}: forbidden classification raised: " +
                            ", ".join(sorted({a.classification.value for a in bad_alerts})))
    return failures


# -- rendering ----------------------------------------------------------------------------------
def _rel(result: ReplayResult, ts: datetime) -> str:
    return f"+{(ts - result.start).total_seconds():7.1f}s"


def render_timeline(result: ReplayResult, out: TextIO) -> None:
    sc = result.scenario
    w = out.write
    w(f"\n== {sc.name}: {len(result.alerts)} alert(s), {len(result.commands)} command(s), "
      f"{len(result.dead)} dead letter(s); {sc.duration:.0f} s of scenario time replayed in {result.seconds:.1f} s\n")
    if sc.description:
        w(f"   {sc.description}\n")
    incidents: dict[str, list] = {}
    for _, _, rec in result.records:
        iid = getattr(rec, "incident_id", None)
        if iid:
            incidents.setdefault(iid, []).append(rec)
    if not incidents:
        w("   no incident: nothing to act on\n")
    for iid, recs in incidents.items():
        first = next(r for r in recs if isinstance(r, Alert)) if any(isinstance(r, Alert) for r in recs) else recs[0]
        gpu = f"GPU {first.evidence.gpu_index} {first.gpu_uuid}" if isinstance(first, Alert) and first.gpu_uuid else "fleet-wide"
        w(f"\n   incident {iid[:12]}  {gpu}  on {first.node}\n")
        last_alert = None
        for rec in recs:
            if isinstance(rec, Alert):
                last_alert = rec
                w(f"   {_rel(result, rec.ts)}  {rec.classification.value} ({rec.severity.value}, {rec.state}): {rec.summary}\n")
            elif isinstance(rec, RemediationResult):
                w(f"   {_rel(result, rec.ts)}    <- {rec.outcome.value} on {rec.node}: {rec.detail}\n")
            else:
                hold = "  [HELD: needs approval]" if rec.requires_approval else ""
                dry = "  [dry run]" if rec.dry_run else ""
                pre = f"  (needs: {'; '.join(rec.preconditions)})" if rec.preconditions else ""
                w(f"   {_rel(result, rec.ts)}    -> step {rec.step}: {rec.action.value}{hold}{dry}{pre}\n")
        if last_alert is not None:
            ev = last_alert.evidence
            xids = ", ".join(f"Xid {k} x{v}" for k, v in ev.xid_counts.items())
            if xids:
                w(f"   evidence: {xids}; PIDs {ev.distinct_pids or '-'}; pods {ev.pod_uids or '-'}\n")
            if ev.sample_stats:
                st = ev.sample_stats
                w(f"   samples: pinned {st.get('pinned_seconds')} s, utilization min {st.get('utilization_gpu_pct_min')}%, "
                  f"memory max {st.get('memory_used_mib_max')} MiB, power avg {st.get('power_w_avg')} W, "
                  f"{st.get('process_snapshots_without_compute')} process snapshots without a compute app\n")
            w("   what to do:\n")
            for n, step in enumerate(last_alert.recommended_steps, 1):
                w(f"     {n}. {step}\n")
    for d in result.dead:
        w(f"   dead letter from {d.source_topic}: {d.error}\n")


def run_replay(paths: list[str], bootstrap: str | None, *, as_json: bool = False, check: bool = False,
               policy: str | None = None, keep: bool = False, partitions: int = 1, out: TextIO | None = None,
               telemetry: bool = False, jobs: int = 1) -> int:
    out = out or sys.stdout  # when called, not when imported (a captured stdout is honoured)
    scenarios = [load_scenario(p) for p in paths]  # every file is validated before anything starts
    doing = ["starting"]

    def log(m: str) -> None:
        doing[0] = m
        print(f"xidstream replay: {m}", file=sys.stderr, flush=True)

    stopping: list[int] = []
    try:
        with _stop_on_signals(lambda: doing[0]) as stopping:
            failed = _replay_all(scenarios, bootstrap, log, as_json=as_json, check=check, policy=policy, keep=keep,
                                 partitions=partitions, out=out, telemetry=telemetry,
                                 paths=paths if jobs > 1 and len(paths) > 1 else None, jobs=jobs)
    except _Stopped as stop:
        return _stopped(stop.signum, stop.doing)
    except Exception:
        if not stopping:
            raise
        # the signal's _Stopped was raised inside a library's callback and came out wrapped (the
        # clean-up in every `finally` ran all the same): a stop, not an error (exit 1 in CI)
        return _stopped(stopping[0], doing[0])
    if check:
        print(f"replay --check: {len(scenarios) - failed} passed, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


def _stopped(signum: int, doing: str) -> int:
    name = signal.Signals(signum).name
    print(f"xidstream replay: stopped by {name} (it was at: {doing}); exit code {128 + signum}",
          file=sys.stderr, flush=True)
    return 128 + signum


def _replay_all(scenarios: list[Scenario], bootstrap: str | None, log: Callable[[str], None], *, as_json: bool,
                check: bool, policy: str | None, keep: bool, partitions: int, out: TextIO, telemetry: bool = False,
                paths: list[str] | None = None, jobs: int = 1) -> int:
    """`run_replay` under its signal handlers; returns how many scenarios failed their check.
    With `paths`, the scenarios run in up to `jobs` child replays at once (`_replay_children`)."""
    broker = None
    if bootstrap is None:
        from workshop.localbroker import LocalBroker

        broker = LocalBroker()
        ours = broker.pid() is None
        log("starting the local Kafka broker ...")
        bootstrap = broker.start()
        if not ours:
            broker = None
    else:
        from xidstream.transport.kafka import reachable

        reachable(Settings(bootstrap=bootstrap))  # before any topic or worker: one clear line
    failed = 0
    try:
        if paths is not None:
            args = [f"--partitions={partitions}"] + ["--json"] * as_json + ["--check"] * check + ["--keep"] * keep
            args += ["--telemetry"] * telemetry + ([f"--policy={policy}"] if policy else [])
            return _replay_children(paths, [sc.name for sc in scenarios], bootstrap, args, jobs, log, out, check)
        for sc in scenarios:
            try:
                result = replay_scenario(sc, bootstrap, partitions=partitions, policy=policy, keep=keep, log=log,
                                         telemetry=telemetry)
            except ScenarioError as exc:
                if not check:
                    raise
                # e.g. a scripted executor's result with no command to answer: a failed check of
                # this scenario, and the others still run
                failed += 1
                print(f"CHECK FAILED {sc.name}:\n  - {exc}", file=sys.stderr)
                continue
            if as_json:
                for topic, key, rec in result.records:
                    out.write(orjson.dumps({"topic": topic, "key": key, "value": to_dict(rec)}).decode() + "\n")
            else:
                render_timeline(result, out)
            if check:
                failures = check_scenario(result)
                if failures:
                    failed += 1
                    print(f"CHECK FAILED {sc.name}:", file=sys.stderr)
                    for f in failures:
                        print(f"  - {f}", file=sys.stderr)
                else:
                    print(f"CHECK OK {sc.name}: {len(sc.expect)} expect, {len(sc.forbid)} forbid", file=sys.stderr)
            out.flush()
    finally:
        if broker is not None:
            broker.stop()
    return failed
