"""The docs say what the code does: every flag and policy field documented, every command shown parses.

README.md is the front page (short, links every guide in docs/, shows the test command CI runs);
docs/*.md are the guides. Commands are read from fenced code blocks, so a renamed flag or a
removed subcommand fails here instead of in a reader's terminal. Fast: no broker, no network.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest

from xidstream.streams.policy import Policy
from xidstream.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOC_PAGES]

# Where a shell command line stops being the xidstream command: a pipe, a redirection, a list.
_CUT = re.compile(r"\s*(\|\||\||&&|;|>|<|&)")
_TRAILING_COMMENT = re.compile(r"(^|\s)#.*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fenced_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, logical line) of every fenced code block; lines ending in `\\` are joined."""
    out: list[tuple[int, str]] = []
    inside = False
    pending: tuple[int, str] | None = None
    for no, line in enumerate(_text(path).splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
            pending = None
            continue
        if not inside:
            continue
        if pending is not None:
            start, text = pending
            line = text + " " + line.strip()
            no = start
        if line.rstrip().endswith("\\"):
            pending = (no, line.rstrip()[:-1].rstrip())
            continue
        pending = None
        out.append((no, line.strip()))
    return out


def _commands(prefix_re: str) -> list[tuple[str, int, str]]:
    """(page, line, command) for every fenced line, or piped segment, starting with the prefix."""
    found = []
    start = re.compile(prefix_re)
    for page in PAGES:
        for no, line in _fenced_lines(page):
            line = line.removeprefix("$ ")
            line = _TRAILING_COMMENT.sub("", line).strip()
            # `a | xidstream b`: each segment of a pipeline or list is a command of its own
            for segment in re.split(r"\|\||\||&&|;", line):
                segment = _CUT.split(segment.strip(), maxsplit=1)[0].strip()
                if start.match(segment):
                    found.append((page.name, no, segment))
    return found


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the parser and every subparser under it, recursively."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*path, name))


def _all_docs() -> str:
    return "\n".join(_text(p) for p in PAGES)


def test_readme_is_a_short_front_page_that_links_every_guide():
    text = _text(README)
    lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    assert lines < 200, f"README.md has {lines} lines; the front page stays under 200 (guides go in docs/)"
    assert DOC_PAGES, "docs/ has no pages"
    missing = [p.name for p in DOC_PAGES if f"docs/{p.name}" not in text]
    assert not missing, f"README.md does not link docs page(s): {missing}"
    # CI runs the README's test command (.ci/run): it must be shown as a command, not only named.
    assert any(line.startswith("make test") for _, line in _fenced_lines(README)), \
        "README.md shows no `make test` command in a code block"


def test_every_cli_flag_is_documented():
    docs = _all_docs()
    missing = []
    for path, parser in _subparsers(build_parser()):
        for action in parser._actions:
            for opt in action.option_strings:
                if not opt.startswith("--") or opt == "--help":
                    continue
                # a flag followed by a letter, digit or dash is another flag (--node vs --node-service-account)
                if not re.search(re.escape(opt) + r"(?![\w-])", docs):
                    missing.append(f"{' '.join(path) or 'xidstream'}: {opt}")
    assert not missing, "flags not mentioned in README.md or docs/*.md:\n" + "\n".join(missing)


def test_every_policy_field_is_in_configuration_md():
    text = _text(ROOT / "docs" / "configuration.md")
    missing = [f.name for f in dataclasses.fields(Policy) if not re.search(rf"`{re.escape(f.name)}`", text)]
    assert not missing, f"docs/configuration.md does not document policy field(s): {missing}"


def test_the_command_extraction_reads_pipes_comments_and_continuations(tmp_path, monkeypatch):
    # The checks below are only as good as what they extract; pin the extraction on a known page.
    page = tmp_path / "page.md"
    page.write_text("text `xidstream nope --bad` outside a block is not read\n"
                    "```sh\n"
                    "$ xidstream keys sign --key k < cmds.jsonl | xidstream execute --scope cluster --stdin  # why\n"
                    "xidstream process --store rocksdb:// \\\n"
                    "    --web-port 6066 > log.txt\n"
                    "kubectl get nodes && make demo\n"
                    "```\n")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    assert [c for _, _, c in _commands(r"xidstream\s")] == [
        "xidstream keys sign --key k",
        "xidstream execute --scope cluster --stdin",
        "xidstream process --store rocksdb:// --web-port 6066",
    ]
    assert [c for _, _, c in _commands(r"make\s")] == ["make demo"]


def test_every_documented_command_parses():
    commands = _commands(r"(\.venv/bin/)?xidstream\s")
    assert len(commands) > 20, f"only {len(commands)} xidstream commands found in fenced blocks"
    parser = build_parser()
    bad = []
    for page, no, command in commands:
        argv = shlex.split(command)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit:
            bad.append(f"{page}:{no}: {command}")
    assert not bad, "commands in the docs that `xidstream` refuses:\n" + "\n".join(bad)


def _make_targets() -> set[str]:
    targets: set[str] = set()
    for line in _text(ROOT / "Makefile").splitlines():
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
        m = re.match(r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)\s*:(?!=)", line)
        if m:
            targets.add(m.group(1))
    return targets


def test_every_make_target_shown_exists():
    targets = _make_targets()
    assert {"demo", "test"} <= targets
    shown = [(page, no, cmd) for page, no, cmd in _commands(r"make\s")]
    for page in PAGES:
        for m in re.finditer(r"`make\s+([^`]*)`", _text(page)):
            shown.append((page.name, _text(page)[: m.start()].count("\n") + 1, "make " + m.group(1)))
    assert shown
    bad = []
    for page, no, cmd in shown:
        # `make e2e E2E_RUNS=10`: variable assignments are not targets
        words = [w for w in shlex.split(cmd)[1:] if "=" not in w and not w.startswith("-")]
        bad += [f"{page}:{no}: {cmd} ({w})" for w in words if w not in targets and w != "..."]
    assert not bad, "make targets shown in the docs that the Makefile does not have:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_cites_this_projects_issue_numbers(page):
    # A reader cannot open this tracker's issues; their numbers belong in commit messages.
    hits = [f"{page.name}:{no}: {line.strip()}" for no, line in enumerate(_text(page).splitlines(), 1)
            if re.search(r"\bissues? \d+\b", line, re.IGNORECASE)]
    assert not hits, "issue numbers in the docs:\n" + "\n".join(hits)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    inside = False
    for line in _text(path).splitlines():
        if _FENCE.match(line):
            inside = not inside
        m = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def test_every_link_between_the_pages_reaches_its_section():
    bad = []
    for page in PAGES:
        for m in re.finditer(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", _text(page)):
            target, anchor = m.group(1), m.group(2)
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            dest = (page.parent / target).resolve() if target else page
            if not dest.exists():
                bad.append(f"{page.name}: {m.group(0)}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {m.group(0)}: no such section")
    assert not bad, "broken links:\n" + "\n".join(bad)
