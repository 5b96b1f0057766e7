"""`xidstream replay` deletes everything it created on the broker: the contract
topics, the processor's own (results-by-gpu, fleet, both changelogs, faust's assignor topic) and
its consumer groups; a shared cluster (`--bootstrap`) is left as it was found. Its worker dies with
it (SIGKILL included), a SIGTERM or SIGINT stops the run in order, and its wait for the processor
ends at a bound, saying what it saw."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from xidstream.schemas import load_scenario
from xidstream.schemas.errors import XidstreamError
from xidstream.transport.kafka import admin, delete_run
from xidstream.replay import replay_scenario
from xidstream.settings import Settings

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]


def _topics(bootstrap):
    return set(admin(Settings(bootstrap=bootstrap)).list_topics(timeout=10).topics)


def _groups(bootstrap):
    res = admin(Settings(bootstrap=bootstrap)).list_consumer_groups(request_timeout=10).result()
    return {g.group_id for g in res.valid}


@pytest.mark.slow
def test_replay_leaves_no_topic_or_group_of_its_run(kafka_bootstrap, tmp_path):
    sc = load_scenario(ROOT / "scenarios" / "lone-xid13.yaml")
    name = f"cleanup-{uuid.uuid4().hex[:8]}"  # the run's prefix starts with replay-<name>-
    sc = sc.model_copy(update={"name": name})
    before = _topics(kafka_bootstrap)
    result = replay_scenario(sc, kafka_bootstrap, workdir=tmp_path)
    assert result.alerts, "the replay itself must have worked"
    ours = f"replay-{name}-"
    left = sorted(t for t in _topics(kafka_bootstrap) - before if t.startswith(ours))
    assert left == [], f"{len(left)} topic(s) of the run left on the broker: {left}"
    groups = sorted(g for g in _groups(kafka_bootstrap) if g.startswith(ours))
    assert groups == [], f"consumer group(s) of the run left on the broker: {groups}"


def test_replay_cleans_up_when_the_run_fails(kafka_bootstrap, tmp_path, monkeypatch):
    """A run that fails half-way (here: the processor never catches up) still deletes its topics."""
    import xidstream.replay as replay

    sc = load_scenario(ROOT / "scenarios" / "lone-xid13.yaml")
    name = f"cleanfail-{uuid.uuid4().hex[:8]}"
    sc = sc.model_copy(update={"name": name})
    monkeypatch.setattr(replay.WorkerProcess, "wait_idle", lambda self, topics, timeout=0: False)
    try:
        replay_scenario(sc, kafka_bootstrap, workdir=tmp_path)
    except Exception as exc:  # noqa: BLE001 - the failure is the point; the clean-up is under test
        assert "did not catch up" in str(exc)
    else:
        raise AssertionError("the replay should have failed")
    left = sorted(t for t in _topics(kafka_bootstrap) if t.startswith(f"replay-{name}-"))
    assert left == [], f"{len(left)} topic(s) of the failed run left on the broker: {left}"


# -- a replay's children die with it ----------------------------------------------------------
# A replay killed from outside (`timeout 600`, a CI job's cancel, ^C) must not leave its
# `xidstream process` worker consuming and committing on the broker with PID 1 as its parent.

def _committed(client, group: str) -> bool:
    """Has `group` committed an offset? (`client`: an admin client the caller holds; one freed
    while its request is out never answers the future.)"""
    from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException

    fut = client.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)], request_timeout=5)[group]
    try:
        return any(tp.offset >= 0 for tp in fut.result(10).topic_partitions)
    except KafkaException:
        return False


def _replay_child(replay: subprocess.Popen, stderr: Path, bootstrap: str,
                  timeout: float = 60.0) -> tuple[psutil.Process, str]:
    """The replay's `xidstream process` worker and its topic prefix, once the worker consumes and
    commits (its group has committed offsets), as the orphan of the report did. Its arguments are
    read when it is first seen: faust retitles the process once it runs."""
    client = admin(Settings(bootstrap=bootstrap))
    worker, prefix = None, ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replay.poll() is not None:
            raise AssertionError(f"the replay ended (code {replay.returncode}) before it could be stopped:\n"
                                 f"{stderr.read_text(errors='replace')}")
        if worker is None:
            for kid in psutil.Process(replay.pid).children():
                argv = kid.cmdline()
                if "process" in argv and "--topic-prefix" in argv:
                    worker, prefix = kid, argv[argv.index("--topic-prefix") + 1]
        if worker is not None and _committed(client, f"{prefix}xidstream-processor"):
            return worker, prefix
        time.sleep(0.1)
    raise AssertionError(f"no committing worker child of the replay within {timeout:g} s:\n"
                         f"{stderr.read_text(errors='replace')}")


def _gone(proc: psutil.Process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return True  # a zombie has exited; whoever adopted it has not reaped it yet
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _start_replay(bootstrap: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    sc = tmp_path / "scenario.yaml"
    # the run's prefix starts with replay-<name>-; the name tells a reader of the broker whose run it was
    sc.write_text((ROOT / "scenarios" / "lone-xid13.yaml").read_text().replace(
        "name: lone-xid13", f"name: children-{uuid.uuid4().hex[:8]}"))
    err = tmp_path / "replay.stderr"
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "xidstream.cli", "replay", "--bootstrap", bootstrap, str(sc)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=fh, stdin=subprocess.DEVNULL)
    return proc, err


def _clean_up(bootstrap: str, replay: subprocess.Popen, worker: psutil.Process | None, prefix: str) -> None:
    """What the replay under test failed to do: never leave a worker or its topics behind."""
    if replay.poll() is None:
        replay.kill()
    replay.wait(10)
    if worker is not None:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    if prefix:
        delete_run(Settings(bootstrap=bootstrap, topic_prefix=prefix))


@pytest.mark.broker
@pytest.mark.slow
def test_a_killed_replay_takes_its_worker_with_it(kafka_bootstrap, tmp_path):
    """SIGKILL (`timeout -s KILL`, the OOM killer) runs no clean-up code in the replay: the worker
    has to notice by itself that its parent is gone."""
    replay, err = _start_replay(kafka_bootstrap, tmp_path)
    worker, prefix = None, ""
    try:
        worker, prefix = _replay_child(replay, err, kafka_bootstrap)
        replay.kill()
        replay.wait(10)
        assert _gone(worker, 15), (f"the replay's worker (pid {worker.pid}) still runs 15 s after the replay "
                                   f"was killed; its parent is now {worker.ppid()}")
    finally:
        _clean_up(kafka_bootstrap, replay, worker, prefix)


@pytest.mark.broker
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_a_stopped_replay_stops_its_worker_and_says_so(kafka_bootstrap, tmp_path, sig):
    replay, err = _start_replay(kafka_bootstrap, tmp_path)
    worker, prefix = None, ""
    try:
        worker, prefix = _replay_child(replay, err, kafka_bootstrap)
        replay.send_signal(sig)
        code = replay.wait(60)
        text = err.read_text(errors="replace")
        assert code == 128 + sig, f"exit code {code} after {sig.name}:\n{text}"
        assert f"stopped by {sig.name}" in text and f"pid {worker.pid}" in text, text
        assert _gone(worker, 5), f"the worker (pid {worker.pid}) outlived the replay's {sig.name}:\n{text}"
        left = sorted(t for t in _topics(kafka_bootstrap) if t.startswith(prefix))
        assert left == [], f"{len(left)} topic(s) of the stopped run left on the broker: {left}"
    finally:
        _clean_up(kafka_bootstrap, replay, worker, prefix)


@pytest.mark.broker
@pytest.mark.slow
def test_a_stopped_parallel_replay_stops_every_child_and_its_worker(kafka_bootstrap, tmp_path):
    """`--jobs 2`: each scenario in a child replay with its own worker. A SIGTERM to the parent
    reaches both children, which stop their workers and delete their topics; the parent exits 143
    naming them."""
    files = []
    for i in range(2):
        sc = tmp_path / f"scenario-{i}.yaml"
        sc.write_text((ROOT / "scenarios" / "lone-xid13.yaml").read_text().replace(
            "name: lone-xid13", f"name: jobs-{i}-{uuid.uuid4().hex[:8]}"))
        files.append(str(sc))
    err = tmp_path / "replay.stderr"
    with err.open("w") as fh:
        replay = subprocess.Popen([sys.executable, "-m", "xidstream.cli", "replay", "--jobs", "2", "--bootstrap",
                                   kafka_bootstrap, *files], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=fh,
                                  stdin=subprocess.DEVNULL)
    seen: dict[int, tuple[psutil.Process, str]] = {}  # worker pid -> (worker, prefix)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(seen) < 2:
            assert replay.poll() is None, err.read_text(errors="replace")
            for kid in psutil.Process(replay.pid).children(recursive=True):
                try:
                    argv = kid.cmdline()
                except psutil.Error:
                    continue
                if kid.pid not in seen and "process" in argv and "--topic-prefix" in argv:
                    seen[kid.pid] = (kid, argv[argv.index("--topic-prefix") + 1])
            time.sleep(0.1)
        assert len(seen) == 2, f"two workers under the replay within 90 s:\n{err.read_text()}"
        children = psutil.Process(replay.pid).children()
        replay.send_signal(signal.SIGTERM)
        code = replay.wait(120)
        text = err.read_text(errors="replace")
        assert code == 143, f"exit code {code}:\n{text}"
        assert "stopped by SIGTERM" in text and text.count(": stopped (exit code 143)") == 2, text
        for proc in children + [w for w, _ in seen.values()]:
            assert _gone(proc, 5), f"pid {proc.pid} outlived the replay's SIGTERM:\n{text}"
        for _, prefix in seen.values():
            left = sorted(t for t in _topics(kafka_bootstrap) if t.startswith(prefix))
            assert left == [], f"{len(left)} topic(s) of a stopped child's run left on the broker: {left}"
    finally:
        if replay.poll() is None:
            replay.kill()
        replay.wait(10)
        for worker, prefix in seen.values():
            _clean_up(kafka_bootstrap, replay, worker, prefix)


@pytest.mark.broker
def test_the_wait_for_the_processor_is_bounded_and_says_what_it_saw(kafka_bootstrap, tmp_path):
    """The wait for the processor ends at its bound with a sentence naming the group it waited on
    and the lag it last read, not a bare "did not catch up"."""
    sc = load_scenario(ROOT / "scenarios" / "lone-xid13.yaml")
    sc = sc.model_copy(update={"name": f"bounded-{uuid.uuid4().hex[:8]}"})
    started = time.monotonic()
    with pytest.raises(XidstreamError) as err:
        # 0.5 s: shorter than the 3 s the group must stay idle, so the wait cannot succeed
        replay_scenario(sc, kafka_bootstrap, workdir=tmp_path, processor_timeout=0.5)
    text = str(err.value)
    assert "did not catch up within 0.5 s" in text, text
    assert re.search(r"waited for consumer group replay-bounded-\w+-\w+\.xidstream-processor to commit every "
                     r"message of its \d+ topic\(s\); saw \d+ lag reading\(s\) over [\d.]+ s, the last: ", text), text
    assert time.monotonic() - started < 60, "the replay did not end soon after its wait's bound"
