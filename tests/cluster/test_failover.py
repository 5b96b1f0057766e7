"""The motivating incident on a three-broker cluster, with a broker lost mid-incident.

The scenario (scenarios/motivating-incident.yaml) runs through the real collector code (fake NVML,
fake kernel log, `KafkaSink` with acks=all and idempotence) into topics of replication 3 and
min.insync.replicas 2, and a real `xidstream process` worker decides. When the collector has
published the Xid 43 and the worker has folded it (its lag is 0), a broker is SIGKILLed: the
leader of the GPU's gpu.xid, gpu.samples and gpu.remediation partitions (of the three, the node
that leads most of them). The rest of the incident (the wedge's samples, the failed pods) is
published while the controller moves leadership; the wedge verdict comes after.

What must hold: the scenario's expect/forbid; every command of the plan exactly once per
command_id; one incident; every record the producer had acknowledged is on its topic, once (by
event_id); and the verdicts are those of the pure decision path (`xidstream.streams.engine.Engine`) over
the same records, i.e. of an uninterrupted run.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import KafkaSink
from xidstream.schemas.codec import decode_any
from xidstream.schemas.models import Alert, RemediationCommand, XidEvent
from xidstream.schemas.scenario import load_scenario
from xidstream.schemas.topics import INPUT_TOPICS, TOPICS
from xidstream.schemas.vocab import Action
from xidstream.streams.app import changelog_topics, internal_topics
from xidstream.streams.engine import Engine
from xidstream.transport.kafka import admin, check_replication, create_topics, delete_run, read_all
from xidstream.replay import ReplayResult, check_scenario
from xidstream.runner import WorkerProcess
from xidstream.settings import Settings

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "scenarios" / "motivating-incident.yaml"
WEDGED_GPU = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"
PLAN = [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]
# the worker gets the same replication through its environment (Settings.from_env)
REPLICATION_ENV = {"XIDSTREAM_REPLICATION": "3", "XIDSTREAM_MIN_INSYNC_REPLICAS": "2"}


def _settings(cluster) -> Settings:
    return Settings(bootstrap=cluster.bootstrap, topic_prefix=f"c{uuid.uuid4().hex[:8]}.", partitions=1,
                    node="cluster-test", replication_factor=3, min_insync_replicas=2)


class _KillAfterXid43:
    """A `Sink` in front of the collector's `KafkaSink`: once the Xid 43 was published, every
    record so far acknowledged and folded by the worker, it calls `fault()` once."""

    def __init__(self, sink: KafkaSink, fault) -> None:
        self.sink, self.fault, self.done = sink, fault, False

    def publish(self, record, on_ack=None) -> None:
        self.sink.publish(record, on_ack)
        if not self.done and isinstance(record, XidEvent) and record.xid == 43:
            self.done = True
            assert self.sink.flush(60), self.sink.stats()
            self.fault()

    def poll(self) -> None:
        self.sink.poll()

    def flush(self, timeout: float = 10.0) -> bool:
        return self.sink.flush(timeout)

    def close(self) -> None:
        self.sink.close()

    def stats(self) -> dict:
        return self.sink.stats()


def _decoded(settings: Settings, names: list[str], expected: int | None = None,
             appended: dict | None = None) -> dict[str, list]:
    """The records of `names` by logical topic; `appended` (when given) gets each record's append
    time (the producer's clock, ms) by id() of the decoded record, to tell which worker sent it."""
    reg = settings.topics
    out: dict[str, list] = {n: [] for n in names}
    topics = [reg.name(n) for n in names]
    for m in read_all(settings, topics, timeout=60, idle=3, expected=expected):
        rec = decode_any(m.value())
        out[m.topic()[len(settings.topic_prefix):]].append(rec)
        if appended is not None:
            appended[id(rec)] = m.timestamp()[1]
    return out


def _verdicts(alerts: list, commands: list) -> tuple[list, list]:
    """What an incident's run decided, without ids and times of its own making."""
    a = [(x.gpu_uuid, x.classification.value, x.state) for x in alerts]
    c = [(x.gpu_uuid, x.action.value, x.step, x.command_id, x.incident_id) for x in commands]
    return a, c


def _run_incident(cluster, settings: Settings, tmp: Path, fault) -> dict:
    """The scenario through the cluster with `fault(worker)` after the Xid 43; returns what the
    producer acknowledged, what the topics hold, and the worker's outputs."""
    create_topics(settings)
    worker = WorkerProcess(settings, tmp, env=REPLICATION_ENV, loglevel="info").start()
    state = {"worker": worker}
    sink = KafkaSink(settings, tmp / "spool")
    reg = settings.topics
    watch = [reg.name(n) for n in INPUT_TOPICS] + list(internal_topics(settings))
    try:
        scenario = load_scenario(SCENARIO)

        def at_xid43() -> None:
            assert state["worker"].wait_idle(watch, timeout=120), f"{state['worker'].idle_seen}\n{state['worker'].tail()}"
            state["fault_at"] = time.time()
            state.update(fault(state["worker"]) or {})

        front = _KillAfterXid43(sink, at_xid43)
        ScenarioRunner(scenario, front, start=scenario.start).run()
        assert front.done, "the scenario published no Xid 43"
        assert sink.flush(120), f"records not acknowledged after the fault: {sink.stats()}"
        stats = sink.stats()
        sink.close()
        assert state["worker"].wait_idle(watch, timeout=180), f"{state['worker'].idle_seen}\n{state['worker'].tail()}"
        inputs = _decoded(settings, list(INPUT_TOPICS), expected=sum(stats["published"].values()))
        appended: dict = {}
        outputs = _decoded(settings, ["gpu.alerts", "gpu.remediation", "xidstream.deadletter"], appended=appended)
        return {"stats": stats, "inputs": inputs, "outputs": outputs, "scenario": scenario, "appended": appended, **state}
    finally:
        state["worker"].stop()


def _restart_soon(cluster, node: int, topics: list[str]) -> threading.Thread:
    """Once the controller has moved leadership of `topics` off the dead `node`, start it again,
    in a thread, while the incident goes on (a rolling restart's shape), so that the clients the
    test makes later do not spend their lives retrying a dead bootstrap address."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and node in cluster.leaders(topics).values():
            time.sleep(0.2)
        cluster.start_one(node)

    t = threading.Thread(target=run, name=f"restart-node-{node}", daemon=True)
    t.start()
    return t


def _leader_of_most(cluster, settings: Settings) -> tuple[int, list[str]]:
    reg = settings.topics
    wanted = [reg.name(n) for n in ("gpu.xid", "gpu.samples", "gpu.remediation")]
    leaders = cluster.leaders(wanted)
    counts = Counter(leaders[(t, 0)] for t in wanted)
    node = max(counts, key=lambda n: (counts[n], n == leaders[(wanted[0], 0)]))
    return node, [t for t in wanted if leaders[(t, 0)] == node]


def _check_nothing_lost(run: dict, settings: Settings) -> None:
    """Every acknowledged record is on its topic, once: counts per topic and unique event_ids."""
    acked = {t[len(settings.topic_prefix):]: n for t, n in run["stats"]["published"].items()}
    held = {t: len(recs) for t, recs in run["inputs"].items() if recs}
    assert held == acked, f"acknowledged {acked}, the topics hold {held}"
    assert run["stats"]["dropped"] == 0 and set(run["stats"]["spool_depth"].values()) == {0}, run["stats"]
    ids = Counter(r.event_id for recs in run["inputs"].values() for r in recs)
    assert not [i for i, n in ids.items() if n > 1], "a record is on its topic twice"


def _check_incident(run: dict, settings: Settings, *, resent: bool = False) -> None:
    """`resent`: the worker was SIGKILLed, so a command it sent but had not yet committed the
    input of is sent again by its successor (at-least-once; executors keep one per command_id):
    each copy must be the same command, and the copies count once."""
    alerts = [r for r in run["outputs"]["gpu.alerts"] if isinstance(r, Alert)]
    commands = [r for r in run["outputs"]["gpu.remediation"] if isinstance(r, RemediationCommand)]
    if resent:
        first: dict = {}
        for c in commands:
            seen = first.setdefault(c.command_id, c)
            assert (seen.gpu_uuid, seen.action, seen.step, seen.incident_id) == (
                c.gpu_uuid, c.action, c.step, c.incident_id), f"two commands with one command_id: {seen} / {c}"
        commands = list(first.values())
        alerts = list({(a.incident_id, a.state, a.classification, a.gpu_uuid): a for a in alerts}.values())
    result = ReplayResult(run["scenario"], run["scenario"].start, topic_prefix=settings.topic_prefix)
    result.records = [("gpu.alerts", "", a) for a in alerts] + [("gpu.remediation", "", c) for c in commands]
    result.records.sort(key=lambda x: (x[2].ts, 0 if isinstance(x[2], Alert) else 1))
    assert check_scenario(result) == []
    # the plan, each command exactly once per command_id, all of one incident
    ids = Counter(c.command_id for c in commands)
    assert [i for i, n in ids.items() if n > 1] == [], f"a command was published twice: {ids}"
    wedged = [c for c in commands if c.gpu_uuid == WEDGED_GPU]
    assert [c.action for c in wedged if c.action != Action.RECORD] == PLAN
    assert len({c.incident_id for c in wedged}) == 1
    assert len({a.incident_id for a in alerts if a.gpu_uuid == WEDGED_GPU}) == 1
    # the verdicts of an uninterrupted run: the pure decision path over the records the worker read
    records = [r for recs in run["inputs"].values() for r in recs]
    engine = Engine().run(records)
    got, want = _verdicts(alerts, commands), _verdicts(engine.alerts, engine.commands)
    assert got == want, "the worker's verdicts differ from the pure path's:\n" + "\n".join(
        f"{kind}: worker {g} / pure path {w}" for kind, gs, ws in (("alert", got[0], want[0]), ("command", got[1], want[1]))
        for g, w in itertools.zip_longest(gs, ws) if g != w) + "\n" + _who_sent(run, alerts + commands)


def _who_sent(run: dict, records: list) -> str:
    """Each output with its append time against the fault's (which worker sent it), and the
    inputs of the wedged GPU in their topics' order: what a failure needs to be explained."""
    at = run.get("fault_at")
    lines = [f"fault at {at}"]
    for r in records:
        t = run["appended"].get(id(r))
        rel = f"{(t / 1000 - at):+.2f}s" if t and at else "?"
        lines.append(f"  {rel} {type(r).__name__} {getattr(r, 'action', getattr(r, 'classification', ''))} "
                     f"{getattr(r, 'command_id', getattr(r, 'alert_id', ''))} step={getattr(r, 'step', '')} "
                     f"state={getattr(r, 'state', '')} {getattr(r, 'summary', getattr(r, 'reason', ''))[:160]}")
    lines += [f"  input {type(r).__name__} {r.ts.isoformat()} {getattr(r, 'xid', '')} {r.event_id}"
              for recs in run["inputs"].values() for r in recs
              if getattr(r, "gpu_uuid", None) == WEDGED_GPU and type(r).__name__ in ("XidEvent", "WorkloadEvent")]
    return "\n".join(lines)


def test_leader_killed_between_xid43_and_the_wedge_verdict(kafka_cluster, tmp_path):
    settings = _settings(kafka_cluster)
    killed: dict = {}

    def kill_leader(worker) -> dict:
        node, led = _leader_of_most(kafka_cluster, settings)
        t0 = time.monotonic()
        assert kafka_cluster.stop_one(node, kill=True)
        killed.update(node=node, led=led, at=t0, restart=_restart_soon(kafka_cluster, node, led))
        return {}

    try:
        run = _run_incident(kafka_cluster, settings, tmp_path, kill_leader)
        assert killed["led"], "the killed node led none of the GPU's partitions"
        _check_nothing_lost(run, settings)
        _check_incident(run, settings)
    finally:
        if killed:
            killed["restart"].join(120)
            kafka_cluster.start_one(killed["node"])
            kafka_cluster.wait_in_sync(90)
        delete_run(settings)


def test_processor_topics_replicated_and_tables_restored_after_a_broker_loss(kafka_cluster, tmp_path):
    """The changelogs and the fleet topic are replicated like the contract's (3 replicas, min ISR
    2); a worker killed during a broker loss and started afresh (no local state) restores its
    tables from the changelogs, led now by the surviving brokers, and decides as an uninterrupted
    run would."""
    settings = _settings(kafka_cluster)
    app_id = f"{settings.topic_prefix}xidstream-processor"
    killed: dict = {}

    def lose_broker_and_worker(worker) -> dict:
        # the node leading the GPU table's changelog: the restore must read it from a follower
        # promoted to leader
        changelog = next(iter(changelog_topics(settings, app_id)))
        node = kafka_cluster.leaders([changelog])[(changelog, 0)]
        assert kafka_cluster.stop_one(node, kill=True)
        killed.update(node=node, restart=_restart_soon(kafka_cluster, node, [changelog]))
        worker.stop(sig=9)
        import shutil

        shutil.rmtree(worker.data_dir, ignore_errors=True)  # nothing local: the tables come from Kafka
        fresh = WorkerProcess(settings, tmp_path, name="worker-2", env=REPLICATION_ENV).start()
        return {"worker": fresh}

    try:
        run = _run_incident(kafka_cluster, settings, tmp_path, lose_broker_and_worker)
        assert run["worker"].name == "worker-2"
        # every topic the run has, the processor's own included, is replicated as the settings say
        reg = settings.topics
        md = admin(settings).list_topics(timeout=10)
        names = sorted(t for t in md.topics if t.startswith(settings.topic_prefix))
        must = {reg.name(n) for n in TOPICS} | set(internal_topics(settings)) | set(changelog_topics(settings, app_id))
        assert must <= set(names), sorted(must - set(names))
        assert {t: len(p.replicas) for t in names for p in md.topics[t].partitions.values()} == {t: 3 for t in names}
        assert check_replication(settings, names) == []
        _check_nothing_lost(run, settings)
        _check_incident(run, settings, resent=True)
    finally:
        if killed:
            killed["restart"].join(120)
            kafka_cluster.start_one(killed["node"])
            kafka_cluster.wait_in_sync(90)
        delete_run(settings)
