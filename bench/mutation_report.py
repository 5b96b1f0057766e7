"""Mutation score of the rule modules: `make mutate` (mutmut 3), per module, and the survivors.

    python bench/mutation_report.py [--run [--open] [--jobs N] [--tests "PATHS"]] [--no-diff] [MODULE ...]

MODULE is a file or a folder of the checkout (`schemas/signing.py`, `collectors/parse/`); none
means every module [tool.mutmut] `only_mutate` in pyproject.toml names (a module must be one of
them). `--run` first runs mutmut on those modules' mutants only: mutants are made in a copy under
.xidstream/mutate/mutants/ (never in the checkout), judged by the fast tests (`-m "not broker and
not kube"`) under `--tests` (default: all of tests/), with `--jobs` workers; results are kept there,
so a second run only tests what changed, and a run over some modules keeps the others' results
(mutmut would reset them when the test selection differs; the report says which commit and tests
judged each). Without `--run` it reports what the runs left there. After changing `only_mutate`,
remove .xidstream/mutate/ for a fresh copy.

mutmut names a mutant after its file's path (`src/` left out) and its trampoline after the module
the function was imported as; the checkout's streams/verdict.py is imported as
`xidstream.streams.verdict`, so mutmut runs in a staged tree, .xidstream/mutate/, that has the
product where the wheel has it: src/xidstream/ (xidstream/ and, as the wheel's package-dir maps
them, schemas/ as src/xidstream/schemas/, ...), beside links to tests/ and the other folders the
tests read. Its mutants are named `xidstream.streams.verdict.x_...`; MODULE stays the checkout's
path and the report prints those.

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
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the staged tree mutmut runs in (gitignored with .xidstream/); its mutants/ holds the results
STAGE = ROOT / ".xidstream" / "mutate"
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


def staged_folders(root: Path | None = None) -> dict[str, str]:
    """Checkout folder -> its folder in the staged tree, where the wheel puts it (pyproject's
    package-dir): `streams` -> `src/xidstream/streams`, `xidstream` -> `src/xidstream`."""
    setuptools = tomllib.loads(((root or ROOT) / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"xidstream": "src/xidstream"}
    for package, folder in setuptools.get("package-dir", {}).items():
        folders[folder.rstrip("/")] = "src/" + package.replace(".", "/")
    return folders


def to_stage(path: str, folders: dict[str, str] | None = None) -> str:
    """A checkout path or glob in the staged tree: `streams/policy.py` -> `src/xidstream/streams/policy.py`."""
    folders = folders or staged_folders()
    for folder in sorted(folders, key=len, reverse=True):
        if path == folder or path.startswith(folder + "/"):
            return folders[folder] + path[len(folder):]
    raise SystemExit(f"{path}: in none of the product's folders ({', '.join(sorted(folders))}): mutmut mutates "
                     "only the product")


def from_stage(path: str, folders: dict[str, str] | None = None) -> str | None:
    """The checkout path of a staged path (`src/xidstream/cli.py` -> `xidstream/cli.py`); None
    for a path outside the staged product."""
    folders = folders or staged_folders()
    for folder, staged in sorted(folders.items(), key=lambda kv: len(kv[1]), reverse=True):
        if path == staged or path.startswith(staged + "/"):
            return folder + path[len(staged):]
    return None


def _sync(src: Path, dst: Path, keep: frozenset[str] = frozenset()) -> None:
    """Make `dst` a copy of `src` (no __pycache__), leaving the names in `keep` at its top. A
    file is copied only when it differs, keeping its mtime: mutmut reads the mtime to tell a
    changed source from one it already mutated, as it did reading the checkout itself."""
    dst.mkdir(parents=True, exist_ok=True)
    names = {p.name for p in src.iterdir() if p.name != "__pycache__"}
    for p in dst.iterdir():
        if p.name in names or p.name in keep or p.name == "__pycache__":
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    for name in sorted(names):
        s, d = src / name, dst / name
        if s.is_dir():
            if d.is_symlink() or d.is_file():
                d.unlink()
            _sync(s, d)
            continue
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d)
        if (not d.exists() or s.stat().st_mtime_ns != d.stat().st_mtime_ns or s.stat().st_size != d.stat().st_size
                or s.read_bytes() != d.read_bytes()):
            shutil.copy2(s, d)


def _toml(value) -> str:  # noqa: ANN001 (what [tool.mutmut] holds: strings, numbers, booleans, lists)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"{value!r}: no TOML for it here")


def staged_pyproject(text: str, folders: dict[str, str]) -> str:
    """The checkout's pyproject.toml with [tool.mutmut]'s paths in the staged tree (the rest, the
    pytest settings among it, as it is)."""
    conf = tomllib.loads(text)["tool"]["mutmut"]
    conf = dict(conf)
    # the product's folders collapse to the one that holds them all (mutmut walks each source path:
    # a folder twice would be mutated twice)
    staged = sorted({to_stage(p.rstrip("/"), folders) for p in conf.get("source_paths", list(folders))})
    conf["source_paths"] = [p for p in staged if not any(p.startswith(o + "/") for o in staged)]
    for key in ("only_mutate", "do_not_mutate"):
        if key in conf:
            conf[key] = [to_stage(g, folders) for g in conf[key]]
    lines = text.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "[tool.mutmut]")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    table = ["[tool.mutmut]\n",
             "# written by bench/mutation_report.py: the checkout's [tool.mutmut], the product under src/\n",
             *(f"{k} = {_toml(v)}\n" for k, v in conf.items()), "\n"]
    return "".join(lines[:start] + table + lines[end:])


def stage(root: Path | None = None, stage_dir: Path | None = None) -> Path:
    """Bring the staged tree up to the checkout: the product copied under src/xidstream/, links
    to tests/ and also_copy's folders (mutmut copies them into mutants/ itself), and in mutants/
    links from each checkout folder to its mutated copy, so that a test reading the source
    (`ROOT / "streams"`) reads what it read when mutmut ran in the checkout."""
    root, stage_dir = root or ROOT, stage_dir or STAGE
    folders = staged_folders(root)
    text = (root / "pyproject.toml").read_text()
    conf = tomllib.loads(text)["tool"]["mutmut"]
    product = stage_dir / folders["xidstream"]
    # the libraries' folders inside src/xidstream/ are synced on their own
    inside = frozenset(Path(s).name for f, s in folders.items() if f != "xidstream")
    _sync(root / "xidstream", product, keep=inside)
    for folder, staged in folders.items():
        if folder != "xidstream":
            _sync(root / folder, stage_dir / staged)
    pyproject = stage_dir / "pyproject.toml"
    want = staged_pyproject(text, folders)
    if not pyproject.exists() or pyproject.read_text() != want:
        pyproject.write_text(want)
    for name in ["tests", *conf.get("also_copy", [])]:
        _link(stage_dir / name, root / name)
    mutants = stage_dir / "mutants"
    mutants.mkdir(exist_ok=True)
    for folder, staged in folders.items():
        _link(mutants / folder, Path(os.path.relpath(mutants / staged, mutants)))
    return stage_dir


def _link(path: Path, target: Path) -> None:
    if path.is_symlink() and Path(os.readlink(path)) == target:
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.symlink_to(target, target_is_directory=True)


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
    """mutmut mutant-name patterns for file patterns: `schemas/signing.py` -> `xidstream.schemas.signing.*`
    (the staged path, `src/` left out, as mutmut names them)."""
    folders = staged_folders()
    return [to_stage(g, folders).removeprefix("src/").removesuffix(".py").replace("/", ".").rstrip("*").rstrip(".")
            + ".*" for g in globs]


def run(globs: list[str], jobs: int, tests: str | None, only_open: bool = False) -> int:
    # Every module of `only_mutate` stays mutated in the copy; the run is narrowed by mutant names.
    # (A copy narrowed by `only_mutate` gets the other modules back unmutated, and mutmut, seeing
    # their sources unchanged, would not mutate them again on the next run.)
    configured = pyproject_mutmut()["only_mutate"]
    outside = [g for g in globs if not any(fnmatch.fnmatch(g.rstrip("*") or g, c) or g == c for c in configured)]
    if outside:
        raise SystemExit(f"{', '.join(outside)}: not in [tool.mutmut] only_mutate of pyproject.toml (add it there, "
                         f"then remove {os.path.relpath(STAGE, ROOT)}/ for a fresh copy)")
    over: dict = {"use_git_change_detection": False}
    if tests:
        over["pytest_add_cli_args_test_selection"] = [*tests.split(), *FAST_TIER]
    # CI=true makes checks of the checkout's surroundings strict (tests/schemas/test_catalog.py wants
    # ../shared/data beside it); the copy under mutants/ has no surroundings, and they are not
    # what a mutant is judged by.
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"GIT_OPTIONAL_LOCKS": "0"}
    names = mutant_globs(globs)
    stage()
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
        rc = subprocess.call(cmd, cwd=STAGE, env=env)
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


def _metas(stage_dir: Path | None = None) -> dict[str, Path]:
    """Source file (the checkout's path) -> its .meta file under the staged tree's mutants/ (mutmut
    writes one beside each mutated file: mutants/src/xidstream/streams/verdict.py.meta)."""
    mutants = (stage_dir or STAGE) / "mutants"
    folders = staged_folders()
    out = {}
    # not rglob: it would follow mutants/streams, the link to src/xidstream/streams, too
    for dirpath, _, files in os.walk(mutants):
        for f in sorted(files):
            if f.endswith(".py.meta"):
                meta = Path(dirpath) / f
                src = from_stage(str(meta.relative_to(mutants))[: -len(".meta")], folders)
                if src is not None:
                    out[src] = meta
    return dict(sorted(out.items()))


def snapshot(globs: list[str], stage_dir: Path | None = None) -> dict[Path, dict]:
    """The .meta of every module this run does not judge. mutmut resets the results of every
    module when the run's test selection differs from the last run's (its configuration's
    fingerprint changes), though only this run's modules are judged again: without this, a run
    over one module forgot the others'."""
    return {meta: json.loads(meta.read_text()) for src, meta in _metas(stage_dir).items()
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


def record_run(globs: list[str], tests: str, root: Path | None = None, stage_dir: Path | None = None) -> None:
    """Note, per module, the commit (of the checkout, `root`) and test selection its results were
    last judged with, for the report: results kept from an earlier run are that run's."""
    root = root or ROOT
    path = (stage_dir or STAGE) / "mutants" / RUNS
    runs = json.loads(path.read_text()) if path.exists() else {}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    for src in _metas(stage_dir):
        if any(fnmatch.fnmatch(src, g) for g in globs):
            runs[src] = {"commit": head + ("+changes" if dirty else ""), "tests": tests, "at": when}
    path.write_text(json.dumps(runs, indent=2, sort_keys=True))


def runs_of() -> dict[str, dict]:
    path = STAGE / "mutants" / RUNS
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
    return {src: json.loads(meta.read_text())["exit_code_by_key"] for src, meta in _metas().items()
            if any(fnmatch.fnmatch(src, g) for g in globs)}


def _changed_lines(name: str) -> list[str] | None:
    """The changed lines of one mutant (`mutmut show`), without the diff's headers; None when
    mutmut shows none."""
    p = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=STAGE, capture_output=True, text=True,
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
        print(f"no mutation results for these modules in {STAGE / 'mutants'}: run with --run (make mutate)", file=out)
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
