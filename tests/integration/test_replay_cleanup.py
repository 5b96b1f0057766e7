"""Issue 8, defect 8: `xidstream replay` deletes everything it created on the broker: the contract
topics, the processor's own (results-by-gpu, fleet, both changelogs, faust's assignor topic) and
its consumer groups; a shared cluster (`--bootstrap`) is left as it was found."""

from __future__ import annotations

import uuid
from pathlib import Path

from schemas import load_scenario
from transport.kafka import admin
from xidstream.replay import replay_scenario
from xidstream.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _topics(bootstrap):
    return set(admin(Settings(bootstrap=bootstrap)).list_topics(timeout=10).topics)


def _groups(bootstrap):
    res = admin(Settings(bootstrap=bootstrap)).list_consumer_groups(request_timeout=10).result()
    return {g.group_id for g in res.valid}


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
