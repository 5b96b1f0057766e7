"""bench/mutation_report.py keeps the results of modules a run does not judge.

mutmut resets every module's results when a run's test selection differs from the last run's, so
`make mutate MODULES=streams/classify.py MUTATE_TESTS=tests/streams` after a run over
streams/verdict.py left verdict's 758 mutants unjudged. These tests build the .meta files mutmut
writes and play its reset."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_report", ROOT / "bench" / "mutation_report.py")
mutation_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutation_report)


def _meta(root: Path, src: str, codes: dict, hashes: dict, durations: dict | None = None) -> Path:
    path = root / "mutants" / f"{src}.meta"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code_by_key": codes, "hash_by_function_name": hashes,
                                "type_check_error_by_key": {}, "durations_by_key": durations or {},
                                "estimated_durations_by_key": {}}))
    return path


def test_a_run_over_one_module_keeps_the_results_of_the_others(tmp_path):
    judged = _meta(tmp_path, "streams/classify.py", {"xidstream.streams.classify.x_f__mutmut_1": None}, {"x_f": "aa"})
    other = _meta(tmp_path, "streams/verdict.py",
                  {"xidstream.streams.verdict.x_g__mutmut_1": 1, "xidstream.streams.verdict.x_g__mutmut_2": 0,
                   "xidstream.streams.verdict.x_h__mutmut_1": 1, "xidstream.streams.verdict.xǁCǁm__mutmut_1": 1},
                  {"x_g": "g1", "x_h": "h1", "xǁCǁm": "m1"}, durations={"xidstream.streams.verdict.x_g__mutmut_1": 0.5})

    kept = mutation_report.snapshot(["streams/classify.py"], root=tmp_path)
    assert set(kept) == {other}, "only modules outside the run are kept"

    # mutmut's run: every result reset, verdict's x_h changed (its mutants are new ones now),
    # classify judged
    _meta(tmp_path, "streams/verdict.py",
          {"xidstream.streams.verdict.x_g__mutmut_1": None, "xidstream.streams.verdict.x_g__mutmut_2": None,
           "xidstream.streams.verdict.x_h__mutmut_1": None, "xidstream.streams.verdict.xǁCǁm__mutmut_1": None},
          {"x_g": "g1", "x_h": "h2", "xǁCǁm": "m1"})
    _meta(tmp_path, "streams/classify.py", {"xidstream.streams.classify.x_f__mutmut_1": 1}, {"x_f": "aa"})

    assert mutation_report.restore(kept) == 3
    after = json.loads(other.read_text())
    assert after["exit_code_by_key"] == {"xidstream.streams.verdict.x_g__mutmut_1": 1, "xidstream.streams.verdict.x_g__mutmut_2": 0,
                                         "xidstream.streams.verdict.x_h__mutmut_1": None,
                                         "xidstream.streams.verdict.xǁCǁm__mutmut_1": 1}
    assert after["durations_by_key"] == {"xidstream.streams.verdict.x_g__mutmut_1": 0.5}
    assert after["hash_by_function_name"]["x_h"] == "h2", "mutmut's new hashes stay"
    assert json.loads(judged.read_text())["exit_code_by_key"] == {"xidstream.streams.classify.x_f__mutmut_1": 1}


def test_restore_never_overwrites_a_result_the_run_wrote(tmp_path):
    other = _meta(tmp_path, "a.py", {"a.x_f__mutmut_1": 0}, {"x_f": "f"})
    kept = mutation_report.snapshot(["b.py"], root=tmp_path)
    _meta(tmp_path, "a.py", {"a.x_f__mutmut_1": 1}, {"x_f": "f"})
    assert mutation_report.restore(kept) == 0
    assert json.loads(other.read_text())["exit_code_by_key"] == {"a.x_f__mutmut_1": 1}


def test_the_report_names_the_run_that_judged_each_module(tmp_path, monkeypatch):
    _meta(tmp_path, "m.py", {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0}, {"x_f": "f"})
    monkeypatch.setattr(mutation_report, "ROOT", tmp_path)
    (tmp_path / "mutants" / mutation_report.RUNS).write_text(json.dumps(
        {"m.py": {"commit": "abc1234", "tests": "tests/streams", "at": "2026-12-03 18:00"}}))
    monkeypatch.setattr(mutation_report, "read_equivalent", lambda path=None: {})
    out = io.StringIO()
    summary = mutation_report.report(["m.py"], diffs=False, out=out)
    text = out.getvalue()
    assert summary["m.py"]["score"] == 0.5
    assert "m.py: judged at abc1234 (2026-12-03 18:00 UTC) by tests/streams" in text


def test_open_mutants_are_the_survivors_and_the_unjudged_without_the_listed_equivalents(tmp_path, monkeypatch):
    _meta(tmp_path, "m.py", {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0, "m.x_f__mutmut_3": None,
                             "m.x_f__mutmut_4": 33, "m.x_f__mutmut_5": 0, "m.x_f__mutmut_6": -9,
                             "m.x_f__mutmut_7": 2, "m.x_f__mutmut_8": 0},
          {"x_f": "f"})
    _meta(tmp_path, "other.py", {"other.x_g__mutmut_1": 0}, {"x_g": "g"})
    monkeypatch.setattr(mutation_report, "ROOT", tmp_path)
    # _5 is listed and its diff is the one reviewed; _8's diff moved (mutmut renumbered it): judged again
    monkeypatch.setattr(mutation_report, "read_equivalent",
                        lambda path=None: {"m.x_f__mutmut_5": ("abc", "why"), "m.x_f__mutmut_8": ("def", "why")})
    monkeypatch.setattr(mutation_report, "digest_of", lambda name: "abc")
    assert mutation_report.open_mutants(["m.py"]) == ["m.x_f__mutmut_2", "m.x_f__mutmut_3", "m.x_f__mutmut_4",
                                                      "m.x_f__mutmut_7", "m.x_f__mutmut_8"]


def test_an_open_run_keeps_the_judged_modules_own_killed_results_and_an_interrupted_run_restores(tmp_path,
                                                                                                  monkeypatch):
    # --open names only the module's open mutants; mutmut still resets all its results (a new test
    # selection): the killed ones must come back. And Ctrl-C during the run restores too.
    meta = _meta(tmp_path, "m.py", {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0}, {"x_f": "f"})
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\nonly_mutate = ["m.py"]\n')
    (tmp_path / "m.py").write_text("")
    monkeypatch.setattr(mutation_report, "ROOT", tmp_path)
    monkeypatch.setattr(mutation_report, "read_equivalent", lambda path=None: {})
    monkeypatch.setattr(mutation_report, "record_run", lambda *a, **k: None)

    def mutmut(cmd, **kw):  # resets every result, judges what it was given
        assert cmd[-1] == "m.x_f__mutmut_2"
        _meta(tmp_path, "m.py", {"m.x_f__mutmut_1": None, "m.x_f__mutmut_2": 0}, {"x_f": "f"})  # survives again
        return 0

    monkeypatch.setattr(mutation_report.subprocess, "call", mutmut)
    assert mutation_report.run(["m.py"], 1, "tests", only_open=True) == 0
    assert json.loads(meta.read_text())["exit_code_by_key"] == {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0}

    def interrupted(cmd, **kw):
        _meta(tmp_path, "m.py", {"m.x_f__mutmut_1": None, "m.x_f__mutmut_2": None}, {"x_f": "f"})
        raise KeyboardInterrupt

    monkeypatch.setattr(mutation_report.subprocess, "call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mutation_report.run(["m.py"], 1, "tests", only_open=True)
    assert json.loads(meta.read_text())["exit_code_by_key"] == {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0}
