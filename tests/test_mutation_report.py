"""bench/mutation_report.py: the staged tree mutmut runs in, and the results of modules a run
does not judge.

mutmut names a mutant after its file's path and its trampoline after the module the tests import:
since the one namespace (xidstream.streams.verdict for the checkout's streams/verdict.py) mutmut
runs in a staged tree with the product under src/xidstream/; a run in the checkout stopped early
(no recorded test matches a mutant). mutmut also resets every module's results when a run's test
selection differs from the last run's, so `make mutate MODULES=streams/classify.py
MUTATE_TESTS=tests/streams` after a run over streams/verdict.py left verdict's 758 mutants
unjudged. These tests build the .meta files mutmut writes and play its reset, and run mutmut once
over a small staged product."""

from __future__ import annotations

import fnmatch
import importlib.util
import io
import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_report", ROOT / "bench" / "mutation_report.py")
mutation_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutation_report)


def _meta(stage: Path, src: str, codes: dict, hashes: dict, durations: dict | None = None) -> Path:
    """The .meta mutmut writes for the checkout's `src` (streams/verdict.py) in the staged tree
    `stage`: mutants/src/xidstream/streams/verdict.py.meta."""
    path = stage / "mutants" / f"{mutation_report.to_stage(src)}.meta"
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

    kept = mutation_report.snapshot(["streams/classify.py"], stage_dir=tmp_path)
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
    assert after["exit_code_by_key"] == {"xidstream.streams.verdict.x_g__mutmut_1": 1,
                                         "xidstream.streams.verdict.x_g__mutmut_2": 0,
                                         "xidstream.streams.verdict.x_h__mutmut_1": None,
                                         "xidstream.streams.verdict.xǁCǁm__mutmut_1": 1}
    assert after["durations_by_key"] == {"xidstream.streams.verdict.x_g__mutmut_1": 0.5}
    assert after["hash_by_function_name"]["x_h"] == "h2", "mutmut's new hashes stay"
    assert json.loads(judged.read_text())["exit_code_by_key"] == {"xidstream.streams.classify.x_f__mutmut_1": 1}


def test_restore_never_overwrites_a_result_the_run_wrote(tmp_path):
    other = _meta(tmp_path, "streams/a.py", {"xidstream.streams.a.x_f__mutmut_1": 0}, {"x_f": "f"})
    kept = mutation_report.snapshot(["streams/b.py"], stage_dir=tmp_path)
    _meta(tmp_path, "streams/a.py", {"xidstream.streams.a.x_f__mutmut_1": 1}, {"x_f": "f"})
    assert mutation_report.restore(kept) == 0
    assert json.loads(other.read_text())["exit_code_by_key"] == {"xidstream.streams.a.x_f__mutmut_1": 1}


M = "xidstream.streams.m.x_f__mutmut_"


def test_the_report_names_the_run_that_judged_each_module(tmp_path, monkeypatch):
    _meta(tmp_path, "streams/m.py", {M + "1": 1, M + "2": 0}, {"x_f": "f"})
    monkeypatch.setattr(mutation_report, "STAGE", tmp_path)
    (tmp_path / "mutants" / mutation_report.RUNS).write_text(json.dumps(
        {"streams/m.py": {"commit": "abc1234", "tests": "tests/streams", "at": "2026-12-03 18:00"}}))
    monkeypatch.setattr(mutation_report, "read_equivalent", lambda path=None: {})
    out = io.StringIO()
    summary = mutation_report.report(["streams/m.py"], diffs=False, out=out)
    text = out.getvalue()
    assert summary["streams/m.py"]["score"] == 0.5
    assert "streams/m.py: judged at abc1234 (2026-12-03 18:00 UTC) by tests/streams" in text


def test_open_mutants_are_the_survivors_and_the_unjudged_without_the_listed_equivalents(tmp_path, monkeypatch):
    _meta(tmp_path, "streams/m.py", {M + "1": 1, M + "2": 0, M + "3": None, M + "4": 33, M + "5": 0, M + "6": -9,
                                     M + "7": 2, M + "8": 0},
          {"x_f": "f"})
    _meta(tmp_path, "streams/other.py", {"xidstream.streams.other.x_g__mutmut_1": 0}, {"x_g": "g"})
    monkeypatch.setattr(mutation_report, "STAGE", tmp_path)
    # _5 is listed and its diff is the one reviewed; _8's diff moved (mutmut renumbered it): judged again
    monkeypatch.setattr(mutation_report, "read_equivalent",
                        lambda path=None: {M + "5": ("abc", "why"), M + "8": ("def", "why")})
    monkeypatch.setattr(mutation_report, "digest_of", lambda name: "abc")
    assert mutation_report.open_mutants(["streams/m.py"]) == [M + "2", M + "3", M + "4", M + "7", M + "8"]


def test_an_open_run_keeps_the_judged_modules_own_killed_results_and_an_interrupted_run_restores(tmp_path,
                                                                                                  monkeypatch):
    # --open names only the module's open mutants; mutmut still resets all its results (a new test
    # selection): the killed ones must come back. And Ctrl-C during the run restores too.
    meta = _meta(tmp_path, "streams/m.py", {M + "1": 1, M + "2": 0}, {"x_f": "f"})
    monkeypatch.setattr(mutation_report, "pyproject_mutmut", lambda: {"only_mutate": ["streams/m.py"]})
    monkeypatch.setattr(mutation_report, "STAGE", tmp_path)
    monkeypatch.setattr(mutation_report, "stage", lambda *a, **k: tmp_path)
    monkeypatch.setattr(mutation_report, "read_equivalent", lambda path=None: {})
    monkeypatch.setattr(mutation_report, "record_run", lambda *a, **k: None)

    def mutmut(cmd, **kw):  # resets every result, judges what it was given
        assert cmd[-1] == M + "2"
        assert kw["cwd"] == tmp_path, "mutmut runs in the staged tree"
        _meta(tmp_path, "streams/m.py", {M + "1": None, M + "2": 0}, {"x_f": "f"})  # survives again
        return 0

    monkeypatch.setattr(mutation_report.subprocess, "call", mutmut)
    assert mutation_report.run(["streams/m.py"], 1, "tests", only_open=True) == 0
    assert json.loads(meta.read_text())["exit_code_by_key"] == {M + "1": 1, M + "2": 0}

    def interrupted(cmd, **kw):
        _meta(tmp_path, "streams/m.py", {M + "1": None, M + "2": None}, {"x_f": "f"})
        raise KeyboardInterrupt

    monkeypatch.setattr(mutation_report.subprocess, "call", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mutation_report.run(["streams/m.py"], 1, "tests", only_open=True)
    assert json.loads(meta.read_text())["exit_code_by_key"] == {M + "1": 1, M + "2": 0}


# -- the staged tree ---------------------------------------------------------------------------
def test_mutmut_names_a_staged_mutant_as_the_tests_import_its_module():
    """mutmut's name for a mutant (from its file's path) must be the module the trampoline sees
    (`orig.__module__`), or every mutant is left without tests: the checkout's path gave
    `streams.verdict.x_f`, the tests import xidstream.streams.verdict."""
    from mutmut.utils.format_utils import get_mutant_name

    import xidstream.streams.verdict as verdict

    staged = mutation_report.to_stage("streams/verdict.py")
    assert staged == "src/xidstream/streams/verdict.py"
    assert get_mutant_name(Path(staged), "x_f") == f"{verdict.__name__}.x_f"
    assert mutation_report.mutant_globs(["streams/verdict.py", "collectors/parse/"]) == [
        "xidstream.streams.verdict.*", "xidstream.collectors.parse.*"]
    assert mutation_report.from_stage(staged) == "streams/verdict.py"
    assert mutation_report.from_stage("src/xidstream/cli.py") == "xidstream/cli.py"


def test_the_listed_equivalents_name_mutants_of_the_mutated_modules():
    """Each name in tests/mutation_equivalent.txt is a mutant name of a module in `only_mutate`,
    as mutmut names it now (a name of the old top-level modules would match no mutant, and the
    report would flag every entry as gone)."""
    from mutmut.utils.format_utils import get_module_from_key

    patterns = mutation_report.mutant_globs(mutation_report.pyproject_mutmut()["only_mutate"])
    listed = mutation_report.read_equivalent()
    assert listed
    for name in listed:
        assert any(fnmatch.fnmatch(name, p) for p in patterns), name
        module = get_module_from_key(name).removeprefix("xidstream.").replace(".", "/")
        assert (ROOT / f"{module}.py").is_file() or (ROOT / module / "__init__.py").is_file(), name


def _checkout(root: Path) -> Path:
    """A small checkout laid out as the project's: the libraries at the top, the real
    xidstream/__init__.py (its finder) and the real pyproject.toml's package-dir, one module to
    mutate and its test."""
    root.mkdir()
    (root / "xidstream").mkdir()
    shutil.copy(ROOT / "xidstream" / "__init__.py", root / "xidstream" / "__init__.py")
    for library in ("schemas", "transport", "collectors", "streams", "executors", "exporters"):
        (root / library).mkdir()
        (root / library / "__init__.py").write_text("")
    (root / "schemas" / "versions.lock").write_text("1\n")
    (root / "streams" / "tiny.py").write_text(
        "def clamp(x, low, high):\n    if x < low:\n        return low\n    return min(x, high)\n\n\n"
        "def unused(x):\n    return x + 1\n")
    (root / "tests").mkdir()
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "test_tiny.py").write_text(
        "from pathlib import Path\n\nfrom xidstream.streams.tiny import clamp\n\n\n"
        "def test_clamp():\n    assert clamp(-1, 0, 9) == 0\n    assert clamp(5, 0, 9) == 5\n\n\n"
        "def test_the_checkout_folders_are_readable():\n"
        "    assert (Path(__file__).resolve().parents[1] / 'schemas' / 'versions.lock').read_text() == '1\\n'\n")
    (root / "scenarios").mkdir()
    real = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    package_dir = "\n".join(f'"{k}" = "{v}"' for k, v in real["setuptools"]["package-dir"].items())
    (root / "pyproject.toml").write_text(
        f"[tool.setuptools.package-dir]\n{package_dir}\n\n"
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n\n'
        '[tool.mutmut]\nsource_paths = ["schemas", "collectors", "streams", "executors", "exporters", "transport", '
        '"xidstream"]\nonly_mutate = ["streams/tiny.py"]\nalso_copy = ["scenarios"]\n'
        'pytest_add_cli_args_test_selection = ["tests", "-m", "not broker and not kube"]\n'
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n')
    return root


def test_the_staged_tree_holds_the_product_under_src_xidstream_and_follows_the_checkout(tmp_path):
    root = _checkout(tmp_path / "checkout")
    stage = mutation_report.stage(root=root, stage_dir=tmp_path / "stage")
    tiny = stage / "src" / "xidstream" / "streams" / "tiny.py"
    assert tiny.read_text() == (root / "streams" / "tiny.py").read_text()
    # the copy keeps the source's mtime: mutmut tells a changed source by it
    assert tiny.stat().st_mtime_ns == (root / "streams" / "tiny.py").stat().st_mtime_ns
    assert (stage / "src" / "xidstream" / "__init__.py").is_file()
    conf = tomllib.loads((stage / "pyproject.toml").read_text())
    assert conf["tool"]["mutmut"]["source_paths"] == ["src/xidstream"], "each file walked once"
    assert conf["tool"]["mutmut"]["only_mutate"] == ["src/xidstream/streams/tiny.py"]
    assert conf["tool"]["pytest"]["ini_options"]["pythonpath"] == ["."]
    assert (stage / "tests").resolve() == (root / "tests").resolve()
    assert (stage / "scenarios").resolve() == (root / "scenarios").resolve()
    assert os.readlink(stage / "mutants" / "streams") == "src/xidstream/streams"

    # a changed module is copied again, a removed one goes, the rest is left as it was
    os.utime(root / "streams" / "tiny.py", ns=(1, 1))
    (root / "streams" / "tiny.py").write_text("def clamp(x, low, high):\n    return x\n")
    (root / "schemas" / "__init__.py").unlink()
    before = (stage / "src" / "xidstream" / "transport" / "__init__.py").stat().st_mtime_ns
    (stage / "src" / "xidstream" / "streams" / "__pycache__").mkdir()
    mutation_report.stage(root=root, stage_dir=stage)
    assert tiny.read_text() == "def clamp(x, low, high):\n    return x\n"
    assert not (stage / "src" / "xidstream" / "schemas" / "__init__.py").exists()
    assert (stage / "src" / "xidstream" / "transport" / "__init__.py").stat().st_mtime_ns == before
    assert (stage / "src" / "xidstream" / "streams").is_dir(), "the libraries stay inside src/xidstream/"
    assert (stage / "src" / "xidstream" / "__init__.py").is_file()


# slow (make test-all only): mutmut itself, its stats, clean and forced-fail runs and a pytest per
# mutant (15-30 s on 2 cores); the staging and the names are checked in the fast tier above
@pytest.mark.slow
def test_mutmut_judges_every_mutant_of_a_staged_module(tmp_path, monkeypatch, capfd):
    """mutmut itself over the small checkout: every mutant of clamp is judged by test_clamp (none
    left "no tests", no early stop on names that match no mutant), unused's have no test; the
    tests read the checkout's folders as they would in the checkout."""
    root = _checkout(tmp_path / "checkout")
    monkeypatch.setattr(mutation_report, "ROOT", root)
    monkeypatch.setattr(mutation_report, "STAGE", root / ".xidstream" / "mutate")
    monkeypatch.setattr(mutation_report, "EQUIVALENT", root / "tests" / "mutation_equivalent.txt")
    assert mutation_report.run(["streams/tiny.py"], 1, "tests") == 0, capfd.readouterr().out[-3000:]
    codes = mutation_report.results(["streams/tiny.py"])["streams/tiny.py"]
    clamp = {k: v for k, v in codes.items() if ".x_clamp__mutmut_" in k}
    unused = {k: v for k, v in codes.items() if ".x_unused__mutmut_" in k}
    assert clamp and unused and set(codes) == set(clamp) | set(unused)
    assert all(k.startswith("xidstream.streams.tiny.") for k in codes)
    assert 33 not in clamp.values() and None not in clamp.values(), clamp
    assert set(unused.values()) == {33}, unused
    assert any(v in mutation_report.KILLED for v in clamp.values())
    out = io.StringIO()
    summary = mutation_report.report(["streams/tiny.py"], diffs=True, out=out)
    assert summary["streams/tiny.py"]["killed"] + summary["streams/tiny.py"]["survived"] == len(codes)
    survivor = next(iter(summary["streams/tiny.py"]["survivors"]))
    assert mutation_report.digest_of(survivor) is not None, "mutmut show finds the mutant in the staged tree"
