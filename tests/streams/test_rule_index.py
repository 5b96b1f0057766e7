"""Rules by name: every verdict and step names the rule that made it and the facts it read, the
motivating incident's alert names its rule end to end (pure fold, `xidstream incident`, exports), and
docs/architecture.md's decision index cannot drift from the code (every id the code can emit is in
it, every id in it exists, and its functions, policy fields, tests and scenarios are real)."""

from __future__ import annotations

import ast
import importlib
import io
import re
import sys
from pathlib import Path

import orjson
import pytest

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import MemorySink
from xidstream.exporters.ecs import to_ecs
from xidstream.exporters.ocsf import to_ocsf
from xidstream.schemas import Alert, load_scenario
from xidstream.schemas.codec import decode, encode, to_dict
from xidstream.schemas.models import RemediationCommand
from xidstream.streams import rules as R
from xidstream.streams.engine import Engine
from xidstream.streams.policy import Policy
from xidstream.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "scenarios"
ARCH = ROOT / "docs" / "architecture.md"
WEDGED = "wedged.pinned_no_process_after_wedge_xid"
GPU1 = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"  # the incident's GPU 1 (scenarios/motivating-incident.yaml)


def _fold(name: str) -> Engine:
    sink = MemorySink()
    ScenarioRunner(load_scenario(SCENARIOS / f"{name}.yaml"), sink).run()
    engine = Engine()
    for r in sink.records:
        engine.process(r)
    return engine


_ENGINES: dict[str, Engine] = {}


def folded(name: str) -> Engine:
    if name not in _ENGINES:
        _ENGINES[name] = _fold(name)
    return _ENGINES[name]


# -- the motivating incident -------------------------------------------------------------------
def test_the_motivating_incidents_wedge_alert_names_its_rule_and_the_facts_it_read():
    engine = folded("motivating-incident")
    wedged = [a for a in engine.alerts if a.gpu_uuid == GPU1 and a.classification.value == "GPU_WEDGED"]
    assert wedged, [a.classification for a in engine.alerts]
    rule = wedged[0].rule
    assert rule is not None and rule.id == WEDGED and rule.name == R.WEDGED_PINNED.name
    # what the rule read: Xid 43 and the driver's recovery failure, no compute process, SM pinned at
    # 100% with 0 MiB for the policy's span, the lookback it was read within
    policy = Policy()
    assert rule.facts["xid43"] == 1 and rule.facts["recovery_failures"] == 1
    assert rule.facts["compute_processes"] == 0
    assert rule.facts["util_min_pct"] == 100 and rule.facts["mem_max_mib"] == 0
    assert rule.facts["pinned_s"] >= policy.pinned_seconds == rule.facts["pinned_seconds"]
    assert rule.facts["wedged_xid43_lookback_s"] == policy.wedged_xid43_lookback_s
    # the plan it leads to names the same rule
    plan = [c for c in engine.commands if c.gpu_uuid == GPU1 and c.action.value != "RECORD"]
    assert [c.action.value for c in plan] == ["CORDON_NODE", "DRAIN_NODE", "RESET_GPU"]
    assert {c.rule.id for c in plan} == {WEDGED} and plan[0].rule.facts == dict(rule.facts)
    # the Xid 13 before it was recorded under the application-fault rule
    first = [a for a in engine.alerts if a.gpu_uuid == GPU1][0]
    assert first.classification.value == "APP_FAULT" and first.rule.id == R.APP_FAULT_XID.id
    assert first.rule.facts["xid"] == 13 and first.rule.facts["pid"] == 4242
    # on the wire, and back
    assert decode(Alert, encode(wedged[0])).rule == rule
    assert decode(RemediationCommand, encode(plan[-1])).rule == plan[-1].rule


def test_xidstream_incident_shows_the_rule_of_the_motivating_incident(monkeypatch, capsys):
    engine = folded("motivating-incident")
    lines = [orjson.dumps({"topic": "gpu.alerts" if isinstance(r, Alert) else "gpu.remediation", "key": r.node,
                           "value": to_dict(r)}) for r in [*engine.alerts, *engine.commands]]
    stdin = b"\n".join(lines) + b"\n"
    iid = next(a.incident_id for a in engine.alerts if a.classification.value == "GPU_WEDGED")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert cli(["incident", iid[:12], "--stdin"]) == 0
    out = capsys.readouterr().out
    assert f"\nRULE {WEDGED}: {R.WEDGED_PINNED.name}\n" in out
    assert "xid43=1" in out and "compute_processes=0" in out
    assert re.search(rf"command RESET_GPU .*\[rule {re.escape(WEDGED)}\]", out), out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert cli(["incidents", "--stdin"]) == 0
    table = capsys.readouterr().out
    assert "RULE" in table and WEDGED in table
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert cli(["incident", iid[:12], "--stdin", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["rule"]["id"] == WEDGED


def test_the_html_report_and_the_siem_exports_name_the_rule():
    from xidstream.incidents import IncidentBook
    from xidstream.report import render_report

    engine = folded("motivating-incident")
    alert = next(a for a in engine.alerts if a.classification.value == "GPU_WEDGED")
    book = IncidentBook()
    for r in [*engine.alerts, *engine.commands]:
        book.add(to_dict(r))
    html = render_report(book, book.find(alert.incident_id))
    assert f"<code>{WEDGED}</code>" in html and "<td>xid43</td><td>1</td>" in html
    analytic = to_ocsf(alert)["finding_info"]["analytic"]
    assert analytic == {"uid": WEDGED, "name": R.WEDGED_PINNED.name, "type_id": 1, "type": "Rule",
                        "category": "xidstream"}
    ecs = to_ecs(alert)
    assert ecs["rule"]["id"] == WEDGED and ecs["rule"]["name"] == R.WEDGED_PINNED.name
    assert ecs["rule"]["ruleset"] == "xidstream" and ecs["xidstream"]["rule_facts"]["xid43"] == 1
    cmd = next(c for c in engine.commands if c.action.value == "RESET_GPU")
    assert to_ocsf(cmd)["unmapped"]["rule_id"] == WEDGED and to_ecs(cmd)["rule"]["id"] == WEDGED


def test_an_alert_of_the_previous_contract_version_still_decodes_naming_no_rule():
    alert = next(a for a in folded("motivating-incident").alerts)
    doc = to_dict(alert)
    doc.pop("rule")
    doc["schema"] = "xidstream.alert/1"
    old = decode(Alert, orjson.dumps(doc))
    assert old.rule is None and old.schema_ == Alert.SCHEMA
    assert to_ecs(old)["rule"]["id"] == alert.classification.value  # the class stands in, as before
    assert "analytic" not in to_ocsf(old)["finding_info"]


# -- every rule the code emits is named --------------------------------------------------------
# the scenarios the pure engine runs alone (the others answer commands through `xidstream replay`)
ALL = sorted(p.stem for p in SCENARIOS.glob("*.yaml") if "remediation_result" not in p.read_text())


@pytest.mark.parametrize("name", ALL)
def test_every_alert_and_command_of_every_scenario_names_a_known_rule(name):
    engine = folded(name)
    for rec in [*engine.alerts, *engine.commands]:
        assert rec.rule is not None, (name, type(rec).__name__, getattr(rec, "summary", getattr(rec, "action", "")))
        assert rec.rule.id in R.RULES, rec.rule.id
        assert rec.rule.name == R.RULES[rec.rule.id].name
        assert len(rec.rule.facts) <= R.FACTS_MAX
        assert all(not isinstance(v, float) for v in rec.rule.facts.values()), rec.rule.facts


def test_rule_ids_are_dotted_unique_and_never_retired_ones():
    assert len({r.id for r in R.RULES.values()}) == len(R.RULES)
    assert not set(R.RULES) & R.RETIRED
    for rid in R.RULES:
        assert re.fullmatch(r"[a-z][a-z0-9_]*(\.[a-z0-9_]+)+", rid), rid


def _rule_names_used(path: Path) -> set[str]:
    """`R.NAME` attributes read in a module: the rules it can emit."""
    tree = ast.parse(path.read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "R"}


def test_the_code_names_rules_only_through_the_registry():
    """Every rule a module of streams/ can emit is a constant of streams.rules (so the registry, and
    with it the index, lists every id the code can emit); no module writes a rule id of its own."""
    used: set[str] = set()
    constants = {name for name, v in vars(R).items() if isinstance(v, R.Rule)}
    for path in sorted((ROOT / "streams").glob("*.py")):
        if path.name == "rules.py":
            continue
        names = _rule_names_used(path)
        assert names <= constants, (path.name, names - constants)
        used |= names
        literal = re.findall(r"[\"']((?:" + "|".join(sorted({i.split('.')[0] for i in R.RULES})) + r")\.[a-z0-9_]+)[\"']",
                             path.read_text())
        assert not literal, (path.name, literal)
    # every registered rule is emitted somewhere: none listed that the code cannot emit
    assert {getattr(R, n).id for n in used} == set(R.RULES)


# -- the decision index ------------------------------------------------------------------------
def _index() -> list[dict]:
    text = ARCH.read_text()
    start = text.index("#### Decision index")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        ticks = [re.findall(r"`([^`]+)`", c) for c in cells]
        rows.append({"id": ticks[0][0], "function": ticks[1], "policy": ticks[2], "tests": ticks[3],
                     "scenario": ticks[4]})
    return rows


def test_the_decision_index_lists_every_rule_once_and_nothing_else():
    ids = [r["id"] for r in _index()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert set(ids) == set(R.RULES), {"missing from the index": sorted(set(R.RULES) - set(ids)),
                                      "not a rule of the code": sorted(set(ids) - set(R.RULES))}


@pytest.mark.parametrize("row", _index(), ids=lambda r: r["id"])
def test_each_index_row_leads_to_real_code_policy_tests_and_scenarios(row):
    assert row["function"], row
    for ref in row["function"]:
        module, _, name = ref.rpartition(".")
        assert hasattr(importlib.import_module(module), name), ref
    fields = set(Policy.model_fields) if hasattr(Policy, "model_fields") else set(vars(Policy()))
    for f in row["policy"]:
        assert f in fields, f
    assert row["tests"], row
    for t in row["tests"]:
        path, _, test = t.partition("::")
        assert (ROOT / path).is_file(), path
        if test:
            assert re.search(rf"def {re.escape(test)}\b", (ROOT / path).read_text()), t
    for s in row["scenario"]:
        assert (ROOT / s).is_file(), s
