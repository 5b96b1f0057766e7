"""Mutation score of the rule modules: `make mutate` (mutmut 3), per module, and the survivors.

    python bench/mutation_report.py [--run [--open] [--jobs N] [--tests "PATHS"]] [--no-diff] [MODULE ...]

MODULE is a file or a folder of the checkout (`schemas/signing.py`, `collectors/parse/`); none
means every module [tool.mutmut] `only_mutate` in pyproject.toml names (a module must be one of
them). `--run` first runs mutmut on those modules' mutants only: mutants are made in a copy under
mutants/ (never in the checkout), judged by the fast tests (`-m "not broker and not kube"`) under
`--tests` (default: all of tests/), with `--jobs` workers; results are kept there, so a second
run only tests what changed, and a run over some modules keeps the others' results (mutmut would
reset them when the test selection differs; the report says which commit and tests judged each).
Without `--run` it reports what the runs left in mutants/. After changing `only_mutate`, remove
mutants/ for a fresh copy.

A surviving mutant that no test can kill, because it behaves exactly like the original, is listed
in tests/mutation_equivalent.txt with the reason: one line each, the mutant's name, the digest of
its diff (`sha=` and 10 hex digits), then why. Those are left out of the score and printed apart.
mutmut numbers a function's mutants in order, so when the function changes a listed name can come
to stand for another mutant, a real one, which the list would then hide: a listed name whose diff
no longer has its digest is counted like any other mutant and flagged, to be reviewed again, as is
a listed name that no longer exists. `--pin` writes the digest of every listed name that has none
yet (after reviewing them: it takes each name's mutant as it is now).

The score is killed / (killed + survived), equivalents left out; a mutant the tests time out on,
or that crashes them, counts as killed, one in code no test reaches ("no tests") as survived.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT = ROOT / "tests" / "mutation_equivalent.txt"
FAST_TIER = ["-m", "not broker and not kube"]

# mutmut's exit codes per mutant (mutmut.__main__.status_by_exit_code), grouped for the score
KILLED = {1, 3, 36, 37, 24, -24, 152, 255, -11, -9}  # test failure, timeout, type check, crash
SURVIVED = {0, 5, 33}  # tests passed, or no test reaches the mutant

# Runs mutmut with the tests of this run instead of pyproject's default: mutmut reads its settings
# only from pyproject.toml, so they are replaced in its loaded configuration (the workers are
# forked from this process and inherit it). mutmut 3.7 reads `item._nodeid`, which
# pytest 9 no longer has; 3.8 would not, but needs click>=8.4.2, which faust-streaming 0.15 refuses.
_BOOT = """
import dataclasses, json, sys
import _pytest.nodes
if not hasattr(_pytest.nodes.Node, "_nodeid"):
    _pytest.nodes.Node._nodeid = property(lambda node: node.nodeid)
import mutmut.configuration as conf
over = json.loads(sys.argv[1])
conf._config = dataclasses.replace(conf.Config.get(), **over)
from mutmut.__main__ import cli
sys.argv = ["mutmut", *sys.argv[2:]]
cli()
"""


def pyproject_mutmut() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def module_globs(modules: list[str]) -> list[str]:
    """`only_mutate` patterns for the modules given (a folder: every file under it)."""
    if not modules:
        return list(pyproject_mutmut()["only_mutate"])
    out = []
    for m in modules:
        path = m.rstrip("/")
        if (ROOT / path).is_dir():
            out.append(f"{path}/*")
        elif path.endswith(".py") and (ROOT / path).is_file():
            out.append(path)
        else:
            raise SystemExit(f"{m}: no such module file or folder in {ROOT}")
    return out


def mutant_globs(globs: list[str]) -> list[str]:
    """mutmut mutant-name patterns for file patterns: `schemas/signing.py` -> `xidstream.schemas.signing.*`."""
    return [g.removesuffix(".py").replace("/", ".").rstrip("*").rstrip(".") + ".*" for g in globs]


def run(globs: list[str], jobs: int, tests: str | None, only_open: bool = False) -> int:
    # Every module of `only_mutate` stays mutated in the copy; the run is narrowed by mutant names.
    # (A copy narrowed by `only_mutate` gets the other modules back unmutated, and mutmut, seeing
    # their sources unchanged, would not mutate them again on the next run.)
    configured = pyproject_mutmut()["only_mutate"]
    outside = [g for g in globs if not any(fnmatch.fnmatch(g.rstrip("*") or g, c) or g == c for c in configured)]
    if outside:
        raise SystemExit(f"{', '.join(outside)}: not in [tool.mutmut] only_mutate of pyproject.toml (add it there, "
                         "then remove mutants/ for a fresh copy)")
    over: dict = {"use_git_change_detection": False}
    if tests:
        over["pytest_add_cli_args_test_selection"] = [*tests.split(), *FAST_TIER]
    # CI=true makes checks of the checkout's surroundings strict (tests/schemas/test_catalog.py wants
    # ../shared/data beside it); the copy under mutants/ has no surroundings, and they are not
    # what a mutant is judged by.
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"GIT_OPTIONAL_LOCKS": "0"}
    names = mutant_globs(globs)
    if only_open:
        names = open_mutants(globs)
        if not names:
            print("no surviving or unjudged mutant in these modules: nothing to run (a changed module needs a "
                  "run without --open)", file=sys.stderr)
            return 0
        print(f"judging {len(names)} surviving or unjudged mutant(s) again", file=sys.stderr)
    cmd = [sys.executable, "-c", _BOOT, json.dumps(over), "run", "--max-children", str(jobs), *names]
    # --open names only some of this module's mutants: its other results need keeping too
    kept = snapshot([] if only_open else globs)
    try:
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
    finally:  # an interrupted run too: mutmut reset the results before it began judging
        restored = restore(kept)
        if restored:
            print(f"kept {restored} result(s) of earlier runs (mutmut had reset them)", file=sys.stderr)
    if rc == 0:
        record_run(globs, (tests or "tests") + (" (--open: survivors and unjudged again)" if only_open else ""))
    return rc


def open_mutants(globs: list[str]) -> list[str]:
    """These modules' mutants the last run did not kill (survived, unjudged, interrupted), listed
    equivalents left out unless their diff moved (a run names them to mutmut, which then judges
    them again whatever their last result)."""
    equivalent = read_equivalent()
    out = []
    for codes in results(globs).values():
        for name, code in sorted(codes.items()):
            if code in KILLED:
                continue
            if name in equivalent and (equivalent[name][0] is None or digest_of(name) == equivalent[name][0]):
                continue
            out.append(name)
    return out


def _metas(root: Path) -> dict[str, Path]:
    """Source file (relative) -> its .meta file under mutants/."""
    return {str(m.relative_to(root / "mutants"))[: -len(".meta")]: m for m in sorted((root / "mutants").rglob("*.py.meta"))}


def snapshot(globs: list[str], root: Path | None = None) -> dict[Path, dict]:
    """The .meta of every module this run does not judge. mutmut resets the results of every
    module when the run's test selection differs from the last run's (its configuration's
    fingerprint changes), though only this run's modules are judged again: without this, a run
    over one module forgot the others'."""
    return {meta: json.loads(meta.read_text()) for src, meta in _metas(root or ROOT).items()
            if not any(fnmatch.fnmatch(src, g) for g in globs)}


def restore(kept: dict[Path, dict]) -> int:
    """Put back each kept result that mutmut reset, where the mutant's function is unchanged (the
    same hash before and after: a changed function's mutants are new mutants and stay to be
    judged). Returns how many were put back."""
    restored = 0
    for meta, before in kept.items():
        if not meta.exists():
            continue
        now = json.loads(meta.read_text())
        codes = now.get("exit_code_by_key", {})
        changed = False
        for key, code in before.get("exit_code_by_key", {}).items():
            if code is None or key not in codes or codes[key] is not None:
                continue
            func = key.partition("__mutmut_")[0].rpartition(".")[2]
            old_hash = before.get("hash_by_function_name", {}).get(func)
            if old_hash is None or now.get("hash_by_function_name", {}).get(func) != old_hash:
                continue
            codes[key] = code
            if key in before.get("durations_by_key", {}):
                now.setdefault("durations_by_key", {})[key] = before["durations_by_key"][key]
            restored += 1
            changed = True
        if changed:
            meta.write_text(json.dumps(now, indent=4))
    return restored


RUNS = "xidstream-runs.json"


def record_run(globs: list[str], tests: str, root: Path | None = None) -> None:
    """Note, per module, the commit and test selection its results were last judged with, for the
    report: results kept from an earlier run are that run's."""
    root = root or ROOT
    path = root / "mutants" / RUNS
    runs = json.loads(path.read_text()) if path.exists() else {}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    for src in _metas(root):
        if any(fnmatch.fnmatch(src, g) for g in globs):
            runs[src] = {"commit": head + ("+changes" if dirty else ""), "tests": tests, "at": when}
    path.write_text(json.dumps(runs, indent=2, sort_keys=True))


def runs_of() -> dict[str, dict]:
    path = ROOT / "mutants" / RUNS
    return json.loads(path.read_text()) if path.exists() else {}


def read_equivalent(path: Path | None = None) -> dict[str, tuple[str | None, str]]:
    """name -> (the digest of its diff, or None where none is pinned yet; reason); every entry
    must give a reason."""
    path = path or EQUIVALENT
    out: dict[str, tuple[str | None, str]] = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        digest = None
        if rest.startswith("sha="):
            token, _, rest = rest.partition(" ")
            digest = token[len("sha="):]
        if not rest.strip():
            raise SystemExit(f"{path}:{n}: {name} has no reason: each equivalent mutant needs one line saying why")
        out[name] = (digest, rest.strip())
    return out


def digest_of(name: str) -> str | None:
    """The first 10 hex digits of the sha256 of a mutant's changed lines (each stripped of its
    indentation), or None when mutmut cannot show it."""
    lines = _changed_lines(name)
    if lines is None:
        return None
    return hashlib.sha256("\n".join(ln[0] + ln[1:].strip() for ln in lines).encode()).hexdigest()[:10]


def pin(globs: list[str], path: Path | None = None) -> int:
    """Write the digest of every listed equivalent of these modules that has none; returns how
    many were written. A listed name whose digest is there and differs is left for a review."""
    path = path or EQUIVALENT
    existing = {name for codes in results(globs).values() for name in codes}
    text = path.read_text().splitlines(keepends=True)
    written = 0
    for i, line in enumerate(text):
        name, _, rest = line.strip().partition(" ")
        if not name or name.startswith("#") or rest.startswith("sha=") or name not in existing:
            continue
        digest = digest_of(name)
        if digest is None:
            continue
        text[i] = f"{name} sha={digest} {rest}\n"
        written += 1
    path.write_text("".join(text))
    return written


def results(globs: list[str]) -> dict[str, dict[str, int | None]]:
    """Source file -> {mutant name: exit code}, from the .meta files mutmut writes beside each mutant file."""
    out = {}
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        src = str(meta.relative_to(ROOT / "mutants"))[: -len(".meta")]
        if any(fnmatch.fnmatch(src, g) for g in globs):
            out[src] = json.loads(meta.read_text())["exit_code_by_key"]
    return out


def _changed_lines(name: str) -> list[str] | None:
    """The changed lines of one mutant (`mutmut show`), without the diff's headers; None when
    mutmut shows none."""
    p = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    lines = [ln for ln in p.stdout.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    return lines or None


def diff_of(name: str) -> str:
    """The changed lines of one mutant, indented for the report."""
    lines = _changed_lines(name)
    return "\n".join(f"        {ln}" for ln in lines) if lines else f"        (mutmut show {name}: no diff)"


def report(globs: list[str], *, diffs: bool = True, out=sys.stdout) -> dict[str, dict]:
    equivalent = read_equivalent()
    by_file = results(globs)
    if not by_file:
        print("no mutation results for these modules in mutants/: run with --run (make mutate)", file=out)
        return {}
    # a listed name whose mutant is not the one reviewed (its diff's digest changed) is no equivalent
    moved = {name for codes in by_file.values() for name in codes
             if name in equivalent and equivalent[name][0] is not None and digest_of(name) != equivalent[name][0]}
    unpinned = sorted(name for codes in by_file.values() for name in codes
                      if name in equivalent and equivalent[name][0] is None)
    summary: dict[str, dict] = {}
    seen = set()
    total = Counter()
    print(f"{'module':<34} {'killed':>6} {'surv.':>6} {'equiv.':>6} {'other':>6}  score", file=out)
    for src, codes in by_file.items():
        c = Counter()
        survivors = []
        for name, code in sorted(codes.items()):
            seen.add(name)
            if name in equivalent and name not in moved:
                c["equivalent"] += 1
            elif code in KILLED:
                c["killed"] += 1
            elif code in SURVIVED:
                c["survived"] += 1
                survivors.append(name)
            else:
                c["other"] += 1  # not checked yet, skipped, interrupted
        judged = c["killed"] + c["survived"]
        score = c["killed"] / judged if judged else None
        summary[src] = {**c, "score": score, "survivors": survivors}
        total.update(c)
        shown = f"{score:6.1%}" if score is not None else "     -"
        print(f"{src:<34} {c['killed']:>6} {c['survived']:>6} {c['equivalent']:>6} {c['other']:>6} {shown}", file=out)
    judged = total["killed"] + total["survived"]
    if judged:
        print(f"{'all':<34} {total['killed']:>6} {total['survived']:>6} {total['equivalent']:>6} {total['other']:>6} "
              f"{total['killed'] / judged:6.1%}", file=out)
    runs = runs_of()
    for src in summary:
        if src in runs:
            r = runs[src]
            print(f"    {src}: judged at {r['commit']} ({r['at']} UTC) by {r['tests']}", file=out)
    for src, s in summary.items():
        if s["survivors"]:
            print(f"\nsurviving in {src}:", file=out)
            for name in s["survivors"]:
                print(f"    {name}", file=out)
                if diffs:
                    print(diff_of(name), file=out)
    listed = [n for n in equivalent if n not in seen and any(fnmatch.fnmatch(n, g) for g in mutant_globs(globs))]
    if listed:
        print(f"\n{EQUIVALENT} names mutants that no longer exist (review them again):", file=out)
        for n in listed:
            print(f"    {n}", file=out)
    if moved:
        print(f"\n{EQUIVALENT} names mutants whose diff is not the one reviewed (mutmut renumbered them; "
              "counted as any other mutant until reviewed again):", file=out)
        for n in sorted(moved):
            print(f"    {n}", file=out)
            if diffs:
                print(diff_of(n), file=out)
    if unpinned:
        print(f"\n{len(unpinned)} listed equivalent(s) have no digest yet (review them, then --pin): "
              f"{', '.join(unpinned[:5])}{' ...' if len(unpinned) > 5 else ''}", file=out)
    if any(s.get("other") for s in summary.values()):
        print("\n'other': mutants not checked (an interrupted or partial run): they are not in the score", file=out)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", help="module files or folders (default: pyproject's only_mutate)")
    ap.add_argument("--run", action="store_true", help="run mutmut on these modules first")
    ap.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1)")
    ap.add_argument("--tests", help='test paths that judge the mutants (default: tests/), e.g. "tests/schemas"')
    ap.add_argument("--open", action="store_true",
                    help="with --run: judge again only the mutants the last run left surviving or unjudged (after "
                         "adding tests against survivors: minutes, not the module's whole run); a changed module "
                         "needs a run without it")
    ap.add_argument("--no-diff", action="store_true", help="list survivors without their diffs")
    ap.add_argument("--pin", action="store_true", help="write the digest of each listed equivalent of these modules "
                                                       "that has none (after reviewing them), then report")
    args = ap.parse_args(argv)
    globs = module_globs(args.modules)
    if args.pin:
        print(f"pinned {pin(globs)} equivalent(s) in {EQUIVALENT}", file=sys.stderr)
    if args.run:
        rc = run(globs, args.jobs, args.tests, only_open=args.open)
        if rc != 0:
            print(f"mutmut run exited {rc}", file=sys.stderr)
            return rc
    report(globs, diffs=not args.no_diff)
    return 0


if __name__ == "__main__":
    sys.exit(main())
