"""The packages have one direction: the command layer (`xidstream`) builds on the
libraries, never the other way round, and the product never builds on the workshop.

    schemas  <-  transport  <-  collectors, streams, executors, exporters  <-  xidstream (the commands)
                                                                          <-  workshop (a checkout's harnesses)

Every library is imported by its one name, `xidstream.<library>` (the wheel installs nothing else
at top level: tests/test_wheel.py); a bare `import schemas` would load a second copy of the module
in a checkout, with classes that are not the first copy's.

`schemas` is the contract (pydantic and orjson only: tests/schemas/test_import_hygiene.py);
`transport` is the Kafka plumbing; the libraries take small config objects
(`xidstream.transport.config.KafkaConfig`, `xidstream.collectors.agent.CollectorConfig`, ...) that the commands build.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("schemas", "transport", "collectors", "streams", "executors", "exporters")
# package -> packages of this project it must never import ("xidstream": the command layer)
FORBIDDEN = {
    "schemas": {"transport", "collectors", "streams", "executors", "xidstream", "workshop"},
    "transport": {"collectors", "streams", "executors", "xidstream", "workshop"},
    "collectors": {"streams", "executors", "xidstream", "workshop"},
    "streams": {"collectors", "executors", "xidstream", "workshop"},
    "executors": {"streams", "exporters", "xidstream", "workshop"},
    "exporters": {"collectors", "streams", "executors", "xidstream", "workshop"},
    "xidstream": {"workshop"},
}


def layer(module: str) -> str:
    """The layer of an imported module's dotted name: a library, `xidstream` (the command layer),
    `workshop`, `bare:<library>` (a library imported outside the namespace), or its top-level name."""
    parts = module.split(".")
    if parts[0] == "xidstream":
        return parts[1] if len(parts) > 1 and parts[1] in LIBRARIES else "xidstream"
    if parts[0] in LIBRARIES:
        return f"bare:{parts[0]}"
    return parts[0]


def imports(path: Path) -> list[str]:
    """Dotted names of every absolute import in a file, also those inside functions
    (`from xidstream import streams` counts as `xidstream.streams`)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{a.name}" for a in node.names)
    return names


def imported_packages(path: Path) -> set[str]:
    return {layer(name) for name in imports(path)}


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_never_imports_the_layers_above_it(package):
    bad = {}
    for path in _files(package):
        wrong = imported_packages(path) & FORBIDDEN[package]
        if wrong:
            bad[str(path.relative_to(ROOT))] = sorted(wrong)
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}: {bad}"


def test_no_library_is_imported_outside_the_namespace():
    bad = []
    for top in (*LIBRARIES, "xidstream", "workshop", "tests", "bench"):
        for path in _files(top):
            bare = sorted({n for n in imports(path) if layer(n).startswith("bare:")})
            if bare:
                bad.append(f"{path.relative_to(ROOT)}: {bare}")
    assert not bad, "import these as xidstream.<library>:\n" + "\n".join(bad)


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["xidstream", *parts] if parts[0] in LIBRARIES else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (at any depth of the file), product and workshop."""
    modules = {_module_of(p): p for top in (*LIBRARIES, "xidstream", "workshop") for p in _files(top)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for imported in imports(path):
            # `from a.b import c`: c may be a module (a.b.c) or a name in a.b
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                edges.add(imported)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    """Imports inside functions count: a lazy import that closes a cycle is still a cycle for the
    reader (cli.py and node_e2e.py imported each other, so did incidents.py and report.py)."""
    graph = import_graph()
    assert len(graph) > 100, f"only {len(graph)} modules found"
    assert not cycles(graph), f"import cycles: {cycles(graph)}"


def test_the_rules_can_fail(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from xidstream.settings import Settings\n    from workshop import localnode\n"
                 "    import streams.verdict\n    from xidstream.schemas import models\n")
    assert imported_packages(f) == {"xidstream", "workshop", "bare:streams", "schemas"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_checkout_maps_its_own_libraries_before_another_finder(tmp_path):
    """A finder already on sys.meta_path that answers `xidstream.schemas` from elsewhere (another
    checkout's editable install) must not win over this checkout's folders."""
    decoy = tmp_path / "elsewhere" / "schemas"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("DECOY = True\n")
    code = f"""
import importlib.abc, importlib.util, sys
class Decoy(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "xidstream.schemas":
            return importlib.util.spec_from_file_location(
                fullname, {str(decoy / "__init__.py")!r}, submodule_search_locations=[{str(decoy)!r}])
sys.meta_path.append(Decoy())
import xidstream.schemas
print(xidstream.schemas.__file__)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(ROOT / "schemas" / "__init__.py")
