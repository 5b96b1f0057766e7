"""`xidstream incidents` / `xidstream incident ID` (xidstream/incidents.py) on what the real fold
publishes (streams.Engine over the builders' records), and on `xidstream replay --json` lines."""

from __future__ import annotations

import io
import sys
import orjson
import pytest

from xidstream.schemas.codec import to_dict
from xidstream.schemas.errors import ConfigError
from xidstream.schemas.models import Alert, RemediationCommand, RemediationResult
from tests.shell import HOSTILE, interpreted
from tests.streams.builders import GPU, NODE, at, run, wedge
from xidstream.cli import main as cli
from xidstream.incidents import IncidentBook, parse_since


def _book(records) -> IncidentBook:
    book = IncidentBook()
    for r in records:
        book.add(orjson.loads(orjson.dumps(to_dict(r))))
    return book


def _wedged_engine():
    return run(wedge())


def test_one_wedged_gpu_is_one_open_incident_with_its_last_step_and_outcome():
    engine = _wedged_engine()
    book = _book([*engine.alerts, *engine.commands])
    [inc] = book.open_incidents()
    assert (inc.last["classification"], inc.last["node"], inc.gpu_index) == ("GPU_WEDGED", NODE, 1)
    now = book.newest + 60
    data = book.summary_json(now)
    [row] = data["open"]
    assert row["gpu_uuid"] == GPU and row["severity"] == "critical"
    assert row["age_s"] == pytest.approx(now - inc.opened)
    steps = {s["action"]: s["outcome"] for s in book.steps(inc)}
    assert steps["RESET_GPU"] == "no result yet"
    text = book.render_summary(now)
    assert "OPEN INCIDENTS: 1" in text and "GPU_WEDGED" in text and NODE in text and "HELD FOR APPROVAL: 0" in text


def test_results_are_matched_to_their_commands_and_show_as_done():
    engine = _wedged_engine()
    book = _book([*engine.alerts, *engine.commands])
    cordon = next(c for c in engine.commands if c.action.value == "CORDON_NODE")
    book.add(orjson.loads(orjson.dumps(to_dict(RemediationResult(
        ts=at(311), node=NODE, gpu_uuid=GPU, command_id=cordon.command_id, incident_id=cordon.incident_id,
        action=cordon.action, outcome="succeeded", detail="cordoned node-a")))))
    inc = book.find(cordon.incident_id[:10])
    assert {s["action"]: s["outcome"] for s in book.steps(inc)}["CORDON_NODE"] == "succeeded"
    lines = book.render_incident(inc)
    assert "result succeeded" in lines and "cordoned node-a" in lines
    assert "CORDON_NODE      done" in lines and "RESET_GPU        no result yet" in lines
    # every command of the incident is in its timeline, in time order, with its preconditions
    items = book.timeline(inc)
    assert [i["ts"] for i in items] == sorted(i["ts"] for i in items)
    assert sum(i["what"].startswith("command ") for i in items) == len(engine.commands)
    assert any("preconditions: node cordoned" in i["text"] for i in items)


def _held(cmd: RemediationCommand, **kw) -> RemediationCommand:
    return cmd.model_copy(update={"requires_approval": True, **kw})


def test_a_held_command_is_listed_with_the_line_that_releases_it_until_answered_or_expired():
    engine = _wedged_engine()
    drain = next(c for c in engine.commands if c.action.value == "DRAIN_NODE")
    held = _held(drain)
    book = _book([*engine.alerts, held])
    now = held.ts.timestamp() + 60
    [h] = book.summary_json(now)["held"]
    assert h["command_id"] == drain.command_id and h["node"] == NODE
    assert h["approve"] == f"xidstream approve {drain.command_id} --node {NODE} --key APPROVER.key --reason '...' --publish"
    assert "held for approval" in book.render_summary(now) and h["approve"] in book.render_summary(now)
    assert book.held(held.expires_at.timestamp() + 1) == []  # expired: nothing left to approve
    # a result naming another node (or action) is not this command's answer: it stays held
    book.add({"schema": "xidstream.remediation_result/4", "ts": "2026-11-28T03:06:00Z", "node": "evil",
              "command_id": drain.command_id, "incident_id": drain.incident_id, "action": "DRAIN_NODE",
              "outcome": "succeeded"})
    assert [c["command_id"] for c in book.held(now)] == [drain.command_id]
    book.add({"schema": "xidstream.remediation_result/4", "ts": "2026-11-28T03:06:00Z", "node": NODE,
              "command_id": drain.command_id, "incident_id": drain.incident_id, "action": "DRAIN_NODE",
              "outcome": "succeeded"})
    assert book.held(now) == []


def _alert(iid: str, cls: str, state: str, node: str = NODE, t: float = 100) -> dict:
    return {"schema": "xidstream.alert/1", "ts": at(t).isoformat(), "node": node, "incident_id": iid,
            "gpu_uuid": None if cls == "FLEET_STORM" else GPU, "classification": cls, "severity": "critical",
            "state": state, "summary": f"{cls} {state}", "evidence": {"node": node, "gpu_index": 0}}


def test_resolved_incidents_filters_and_the_breaker():
    book = IncidentBook()
    book.add(_alert("a1", "GPU_SUSPECT", "open"))
    book.add(_alert("a1", "GPU_SUSPECT", "resolved", t=500))
    book.add(_alert("b2", "GPU_WEDGED", "open", node="node-b"))
    book.add(_alert("c3", "GPU_HARDWARE_FAULT", "open", node="node-c"))
    assert [i.id for i in book.open_incidents()] == ["b2", "c3"]
    assert [i.id for i in book.open_incidents(node="node-c")] == ["c3"]
    assert [i.id for i in book.open_incidents(verdict="GPU_WEDGED")] == ["b2"]
    assert book.breaker()["state"] == "closed"
    book.add(_alert("s1", "FLEET_STORM", "open", node="fleet", t=200))
    b = book.breaker()
    assert b["state"] == "tripped" and b["incident_id"] == "s1"
    assert "s1" not in [i.id for i in book.open_incidents()]  # the breaker is its own line, not a GPU's
    assert "BREAKER: tripped since" in book.render_summary(1e10)
    book.add(_alert("s1", "FLEET_STORM", "resolved", node="fleet", t=900))  # what a reset publishes
    assert book.breaker()["state"] == "closed"


def test_find_names_a_unique_prefix_or_says_why_not():
    book = IncidentBook()
    book.add(_alert("abc123", "GPU_WEDGED", "open"))
    book.add(_alert("abd999", "GPU_WEDGED", "open"))
    assert book.find("abc").id == "abc123"
    with pytest.raises(ConfigError, match="names 2 incidents"):
        book.find("ab")
    with pytest.raises(ConfigError, match="no incident 'zz'.*longer --since"):
        book.find("zz")


def test_since_durations():
    assert [parse_since(s) for s in ("30s", "90m", "24h", "7d", "1.5h")] == [30, 5400, 86400, 604800, 5400]
    with pytest.raises(ConfigError, match="expected a duration"):
        parse_since("a week")


def test_the_cli_reads_replay_json_lines_on_stdin(monkeypatch, capsys):
    engine = _wedged_engine()
    lines = [orjson.dumps({"topic": "gpu.alerts" if isinstance(r, Alert) else "gpu.remediation", "key": NODE,
                           "value": to_dict(r)}) for r in [*engine.alerts, *engine.commands]]
    stdin = b"\n".join([*lines, b"not json", b""]) + b"\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert cli(["incidents", "--stdin", "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert [r["classification"] for r in data["open"]] == ["GPU_WEDGED"]
    assert data["read"] == {"alert": len(engine.alerts), "command": len(engine.commands), "result": 0, "other": 1}
    # as of the newest record read: a post-mortem's ages are what they were then
    assert data["as_of"] == max(r.ts for r in [*engine.alerts, *engine.commands]).strftime("%Y-%m-%dT%H:%M:%SZ")
    iid = data["open"][0]["incident_id"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert cli(["incident", iid[:8], "--stdin"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"INCIDENT {iid}: GPU_WEDGED on {NODE} GPU 1") and "STEPS (done and left):" in out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert cli(["incident", "ffff", "--stdin"]) == 2
    assert "no incident 'ffff'" in capsys.readouterr().err


def test_records_read_as_published_cannot_crash_the_views_or_repaint_the_terminal():
    """Found by review: anything on these topics may come from a node. A year-9999 or 1e20 time, an
    evidence that is not an object, a terminal escape in a result's detail."""
    engine = _wedged_engine()
    book = _book([*engine.alerts, *engine.commands])
    cordon = next(c for c in engine.commands if c.action.value == "CORDON_NODE")
    book.add({"schema": "xidstream.remediation_result/4", "ts": "9999-12-31T23:59:59-14:00", "node": NODE,
              "command_id": cordon.command_id, "incident_id": cordon.incident_id, "action": "CORDON_NODE",
              "outcome": "failed", "detail": "\x1b[2J\x1b[Hall fine\nxidstream approve x"})
    book.add({"schema": "xidstream.alert/1", "ts": 1e20, "node": NODE, "incident_id": "odd", "classification": "GPU_WEDGED",
              "severity": "critical", "state": "open", "summary": "s", "evidence": "not an object"})
    inc = book.find(cordon.incident_id)
    text = book.render_incident(inc) + book.render_summary(book.newest)
    assert "\x1b" not in text and "\\x1b[2J" in text  # shown, escaped, never interpreted
    assert not any(line.startswith("xidstream approve x") for line in text.splitlines())
    assert book.find("odd").gpu_index is None
    from xidstream.report import render_report

    assert "<svg" in render_report(book, inc)  # the year-9999 result does not break the chart
    book.add({"schema": "xidstream.alert/1", "ts": "2026-11-28T03:00:00Z", "node": NODE, "incident_id": "tex",
              "gpu_uuid": "GPU-$\\frac{1}{0}$", "classification": "GPU_WEDGED", "severity": "critical",
              "state": "open", "summary": "s", "evidence": {"gpu_index": 0}})
    assert "GPU-$\\frac{1}{0}$" in render_report(book, book.find("tex"))  # text, not TeX


def test_a_resolved_incident_stays_resolved_when_a_closing_step_fails_afterwards():
    book = IncidentBook()
    book.add(_alert("q1", "GPU_SUSPECT", "open"))
    book.add(_alert("q1", "GPU_SUSPECT", "resolved", t=500))
    book.add(_alert("q1", "GPU_SUSPECT", "updated", t=520))  # RELEASE_GPU refused: news, not a reopening
    assert book.open_incidents() == []


# -- the executor's steps and the time to repair per stage ------------------------------------
def _repaired_book(uncordon: bool = True) -> tuple[IncidentBook, object]:
    """The builders' wedge, repaired: cordon, drain, a reset with its nine steps, healthy samples
    that resolve it, and (optionally) the uncordon's answer; the book reads what the fold and the
    executors published."""
    from tests.streams.builders import procs, sample
    from tests.streams.test_repair import RESET_STEPS, _answer, _newest, _ok, _wedged

    e = _wedged()
    results = [_answer(_newest(e, a), "succeeded", t) for a, t in (("CORDON_NODE", 190), ("DRAIN_NODE", 250))]
    results.append(_answer(_newest(e, "RESET_GPU"), "succeeded", 310, _ok(RESET_STEPS)))
    for r in results:
        e.process(r)
    for t in range(320, 1000, 10):
        e.process(sample(t, util=0, mem=0))
        e.process(procs(t))
    if uncordon:
        results.append(_answer(_newest(e, "UNCORDON_NODE"), "succeeded", 1000))
        e.process(results[-1])
    book = _book([*e.alerts, *e.commands, *results])
    [inc] = book.incidents.values()
    return book, inc


def test_each_step_an_executor_reported_is_one_line_of_the_incidents_timeline():
    book, inc = _repaired_book()
    items = book.timeline(inc)
    steps = [(i["what"], i["ts"]) for i in items if i["what"].startswith("step ")]
    # from the result as read, each once (the resolved alert's evidence carries the same steps)
    assert steps == [(f"step {n}", at(t).strftime("%Y-%m-%dT%H:%M:%S.%fZ")) for n, t in RESET_STEPS_]
    assert [i["ts"] for i in items] == sorted(i["ts"] for i in items)
    assert "RESET_GPU (" in next(i["text"] for i in items if i["what"] == "step reset")
    text = book.render_incident(inc)
    assert text.count("step operands_restored") == 1 and "step verified" in text


def test_a_failed_step_says_so_in_the_timeline():
    from tests.streams.test_repair import _answer, _newest, _wedged

    e = _wedged()
    failed = _answer(_newest(e, "RESET_GPU"), "failed", 310, [("reset", 280, False, "nvidia-smi answered 15")])
    e.process(failed)
    book = _book([*e.alerts, *e.commands, failed])
    [inc] = book.incidents.values()
    [line] = [i for i in book.timeline(inc) if i["what"] == "step reset"]
    assert line["text"].endswith("): FAILED: nvidia-smi answered 15")


def test_the_time_to_repair_per_stage_is_in_the_incident_view_and_its_json():
    book, inc = _repaired_book()
    detected = min(c["ts"] for c in inc.commands if c["action"] == "CORDON_NODE")
    data = book.incident_json(inc)
    assert [(r["stage"], r["seconds"]) for r in data["repair"]] == [
        ("detection", None), ("cordon", 190 - (_seconds(detected))), ("drained", 60.0), ("operands_paused", 20.0),
        ("reset", 10.0), ("verified", 10.0), ("operands_back", 15.0), ("uncordon", 695.0)]
    assert data["repair"][-1]["since_detection"] == 1000 - _seconds(detected)
    assert data["repair"][0]["at"] == detected[:19] + "Z"
    text = book.render_incident(inc)
    assert "TIME TO REPAIR (per stage, from the milestone before it):" in text
    assert "  reset            " in text and "+0m10s" in text and "uncordon" in text


def test_no_time_to_repair_before_any_step_of_it_was_answered():
    engine = _wedged_engine()
    book = _book([*engine.alerts, *engine.commands])
    [inc] = book.open_incidents()
    assert book.repair(inc) == [] and "TIME TO REPAIR" not in book.render_incident(inc)


def test_steps_read_as_published_cannot_crash_the_view():
    book, inc = _repaired_book(uncordon=False)
    reset = next(c for c in inc.commands if c["action"] == "RESET_GPU")
    [r] = book.results[reset["command_id"]]
    r["steps"] = [{"step": "reset", "at": "not a time"}, "x", {"at": "2026-11-28T03:04:00Z"},
                  {"step": "verified", "at": 1e300, "ok": "yes"}, {"step": "\x1b[2Jx", "at": "2026-11-28T03:04:50Z"}]
    text = book.render_incident(inc)
    assert "\x1b" not in text
    assert [x["stage"] for x in book.repair(inc)] == ["detection", "cordon", "drained"]  # no step held


def _seconds(iso: str) -> float:
    from xidstream.incidents import _ts

    return _ts(iso) - at(0).timestamp()


RESET_STEPS_ = [("cordoned_drained", 255), ("holders_classified", 256), ("operands_paused", 258),
                ("operands_gone", 270), ("persistence_off", 271), ("reset", 280), ("verified", 290),
                ("persistence_restored", 295), ("operands_restored", 305)]


def _argv(command_id: str, node: str) -> list[str]:
    return ["xidstream", "approve", command_id, "--node", node, "--key", "APPROVER.key", "--reason", "...", "--publish"]


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_the_approve_line_is_one_argument_per_field_in_a_shell_for_any_node_or_command_id(name):
    """Records are read as published (no decode), and alerts and commands are not held to node
    names at decode: a command with any node or command_id, added as it came off the topic or
    decoded from its bytes, gives an approve line whose shell words are exactly the fields."""
    import shlex

    from xidstream.schemas.base import plain_text
    from xidstream.schemas.codec import decode_any, encode

    engine = _wedged_engine()
    drain = next(c for c in engine.commands if c.action.value == "DRAIN_NODE")
    forged = _held(drain, node=name, command_id=f"{name}-cmd")
    raw = {**to_dict(forged), "node": name, "command_id": f"{name}-cmd"}
    as_read = _book(engine.alerts)
    as_read.add(raw)  # a dict, as read off the topic
    for book in (_book([*engine.alerts, forged]), _book([*engine.alerts, decode_any(encode(forged))]), as_read):
        now = forged.ts.timestamp() + 60
        [h] = book.summary_json(now)["held"]
        assert shlex.split(h["approve"]) == _argv(f"{name}-cmd", name) and interpreted(h["approve"]) == ""
        # the terminal shows the same line, or (a field it cannot show as it is: a control
        # character) no line to paste at all
        text = book.render_summary(now)
        pasted = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("xidstream approve")]
        if plain_text(name) != name:
            assert pasted == [] and "no line to paste" in text
        else:
            assert [shlex.split(p) for p in pasted] == [_argv(f"{name}-cmd", name)]
            assert interpreted(pasted[0]) == ""
