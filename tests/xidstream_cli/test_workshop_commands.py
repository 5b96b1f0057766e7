"""The workshop's commands (local broker, API server, node, e2e, demo cluster) left `xidstream`:
the installed command names where they went; `python -m workshop` runs them, and its `replay`
lends the local broker that an installed `xidstream replay` does not start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workshop.cli import build_parser as workshop_parser
from xidstream.cli import WORKSHOP_COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _commands(parser) -> set[str]:
    return set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse has no API for it


def test_the_product_has_none_of_the_workshops_commands_and_the_workshop_has_all_of_both():
    assert not _commands(build_parser()) & set(WORKSHOP_COMMANDS)
    assert _commands(workshop_parser()) == _commands(build_parser()) | set(WORKSHOP_COMMANDS)


@pytest.mark.parametrize("argv", [["broker", "start"], ["e2e", "--runs", "3"], ["demo-cluster"]])
def test_xidstream_names_where_a_workshop_command_went(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"python -m workshop {' '.join(argv)}" in err and "checkout" in err


def test_an_installed_replay_without_a_kafka_says_so_and_starts_nothing(capsys, monkeypatch):
    monkeypatch.delenv("XIDSTREAM_BOOTSTRAP", raising=False)
    assert main(["replay", str(ROOT / "scenarios" / "lone-xid13.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--bootstrap" in err and "python -m workshop replay" in err


def test_python_m_workshop_runs_from_the_checkout():
    out = subprocess.run([sys.executable, "-m", "workshop", "broker", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m workshop broker" in out.stdout
