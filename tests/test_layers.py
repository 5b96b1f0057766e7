"""The packages have one direction: the command layer (`xidstream`) builds on the
libraries, never the other way round.

    schemas  <-  transport  <-  collectors, streams, executors, exporters  <-  xidstream (the commands)

`schemas` is the contract (pydantic and orjson only: tests/schemas/test_import_hygiene.py);
`transport` is the Kafka plumbing; the libraries take small config objects
(`xidstream.transport.config.KafkaConfig`, `xidstream.collectors.agent.CollectorConfig`, ...) that the commands build.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> packages of this project it must never import
FORBIDDEN = {
    "schemas": {"transport", "collectors", "streams", "executors", "xidstream"},
    "transport": {"collectors", "streams", "executors", "xidstream"},
    "collectors": {"streams", "executors", "xidstream"},
    "streams": {"collectors", "executors", "xidstream"},
    "executors": {"streams", "exporters", "xidstream"},
    "exporters": {"collectors", "streams", "executors", "xidstream"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every import in a file, also those inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_library_package_never_imports_the_layers_above_it(package):
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = imported_packages(path) & FORBIDDEN[package]
        if wrong:
            bad[str(path.relative_to(ROOT))] = sorted(wrong)
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}: {bad}"


def test_the_rule_can_fail(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from xidstream.settings import Settings\n")
    assert "xidstream" in imported_packages(f)
