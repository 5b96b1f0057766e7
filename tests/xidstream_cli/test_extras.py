"""A command run where its pip extra is not installed says which extra in one line, before it starts
anything, instead of a traceback from an import deep inside it (issue 44: the role images install
only their role's extras). The missing module is blocked in a child interpreter
(sys.modules[name] = None), which imports exactly as an environment without it does."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.test_containerfile import DIST_MODULES
from xidstream.extras import COMMANDS, MODULES, MissingExtra, explain

ROOT = Path(__file__).resolve().parents[2]


def _run_blocked(blocked: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    code = (f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n"
            f"from xidstream.cli import main\nraise SystemExit(main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv,blocked,extra", [
    (["process", "--bootstrap", "127.0.0.1:9"], ["faust"], "processor"),
    (["replay", "scenarios/motivating-incident.yaml", "--bootstrap", "127.0.0.1:9"], ["aiokafka"], "processor"),
    (["collect", "--sink", "stdout", "--once"], ["grpc"], "collector"),
    (["execute", "--scope", "cluster", "--stdin"], ["lightkube"], "executors"),
    (["identity", "request", "--node", "n1", "--identity-dir", "/nonexistent/ids"], ["lightkube"], "executors"),
    (["export", "--format", "ocsf", "--to", "jsonl:-"], ["pyarrow"], "exporter"),
])
def test_a_command_without_its_extra_names_it_in_one_line(argv, blocked, extra):
    out = _run_blocked(blocked, argv)
    assert out.returncode == 2, out.stderr[-1500:]
    assert out.stderr.strip() == (f"xidstream: error: xidstream {argv[0]} needs the {extra} extra "
                                  f"(no module named '{blocked[0]}'): pip install 'xidstream[{extra}]'")
    assert out.stdout == ""


def test_a_command_of_the_base_runs_without_any_extra():
    every = sorted({m for mods in MODULES.values() for m in mods} | {"mode", "uvloop"})
    out = _run_blocked(every, ["scenario", "check", "scenarios/motivating-incident.yaml"])
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.startswith("scenarios/motivating-incident.yaml: ok")


def test_an_options_module_is_named_by_its_extra():
    """A module met only on one path of a command (`incident --html`'s matplotlib) names its extra."""
    exc = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib.pyplot")
    assert isinstance(explain("incident", exc), MissingExtra)
    assert explain("incident", exc).extra == "report"
    assert explain("replay", ModuleNotFoundError(name="faust")).extra == "processor"
    assert explain("topics", ModuleNotFoundError(name="not_an_extras_module")) is None


def test_the_extras_table_agrees_with_pyproject():
    """Each extra's modules are those of its distributions in pyproject.toml, and every command's
    extra exists there."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in MODULES.items():
        dists = {re.split(r"[\s\[<>=;!~]", r, maxsplit=1)[0].lower() for r in extras[extra]}
        named = {DIST_MODULES[d] for d in dists if d in DIST_MODULES} - {"uvloop"}  # uvloop: not on Windows
        assert set(modules) == named, extra
    assert {e for es in COMMANDS.values() for e in es} <= set(MODULES)


def test_an_extras_module_missing_inside_a_command_is_said_in_one_line(capsys):
    """Past the up-front check (an option's module, a lazy import): main names the extra too."""
    from xidstream.cli import build_parser, main

    def handler(args, settings):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    parser = build_parser()
    parser._subparsers._group_actions[0].choices["scenario"].set_defaults(handler=handler)  # noqa: SLF001
    assert main(["scenario", "check", "x.yaml"], parser=parser) == 2
    assert capsys.readouterr().err == ("xidstream: error: xidstream scenario needs the report extra (no module named "
                                       "'matplotlib'): pip install 'xidstream[report]'\n")


def test_breaker_reset_runs_on_the_base_install():
    """`xidstream breaker reset` (an operator's, from any image or a workstation) needs no extra:
    it once took the fleet topic's name from streams.app, which imports faust at module level."""
    every = sorted({m for mods in MODULES.values() for m in mods} | {"mode", "uvloop"})
    code = (f"import sys\nfor m in {every!r}:\n    sys.modules[m] = None\n"
            "from confluent_kafka import KafkaException\n"
            "import xidstream.transport.kafka as kafka\n"
            "def unreachable_here(*a, **k):\n    raise KafkaException('no broker in this test')\n"
            "kafka.list_topics = unreachable_here\n"
            "from xidstream.cli import main\n"
            "raise SystemExit(main(['breaker', 'reset', '--bootstrap', '127.0.0.1:9']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-1500:]
    assert "needs the" not in out.stderr and "nothing was sent" in out.stderr, out.stderr
