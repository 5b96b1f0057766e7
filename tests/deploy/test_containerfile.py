"""The images: one Containerfile stage per role (node, processor, cluster-executor, exporter), each
installing xidstream with its role's extras from one build of the wheels. Read from the
Containerfile and pyproject.toml; `make image` builds them for real where buildah or podman exist,
and `make e2e` (workshop/node_e2e.py) checks each built image's commands and what it lacks.

- the build stage copies every package the wheel is made from (`exporters/` was once never
  copied, so `xidstream export` could not work in the image), and not the workshop;
- every role has its stage, non-root, smoke-tested with `xidstream --help`;
- the node image, which every GPU node pulls, holds no faust, pyarrow or matplotlib;
- each role's code imports and its commands parse with every other role's modules blocked, so a
  module-level import of another role's dependency cannot slip into a role's image unseen.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("node", "processor", "cluster-executor", "exporter")

# what the node image must not carry (issue 44): the processor's, the exporter's, the report's
NOT_ON_THE_NODE = {"faust-streaming", "aiokafka", "pyarrow", "matplotlib", "rocksdict", "uvloop"}

# the top-level module of each optional distribution (pyproject.toml's extras)
DIST_MODULES = {"nvidia-ml-py": "pynvml", "prometheus-client": "prometheus_client", "grpcio": "grpc",
                "lightkube": "lightkube", "faust-streaming": "faust", "aiokafka": "aiokafka", "uvloop": "uvloop",
                "pyarrow": "pyarrow", "matplotlib": "matplotlib", "rocksdict": "rocksdict"}

# what each role runs: the packages whose every module it must import, and the ones it never loads
# (transport.kube is the Kubernetes client's, which the processor and the exporter never call); its
# commands are those xidstream.extras.runs_in(role) names
ROLE_CODE = {
    "node": (("collectors", "executors", "transport"), ()),
    "processor": (("streams", "transport", "schemas"), ("xidstream.transport.kube",)),
    "cluster-executor": (("executors", "transport"), ()),
    "exporter": (("exporters", "transport"), ("xidstream.transport.kube",)),
}


def _containerfile() -> str:
    return (ROOT / "Containerfile").read_text()


def stages() -> dict[str, str]:
    """Stage name -> its text (from its FROM line to the next)."""
    out = {}
    for part in re.split(r"^(?=FROM )", _containerfile(), flags=re.M)[1:]:
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", part)
        assert m, f"every stage is named: {part.splitlines()[0]}"
        out[m.group(1)] = part
    return out


def stage_extras(role: str) -> set[str]:
    """The extras a role's stage installs: `pip install ... 'xidstream[a,b]'`."""
    found = re.findall(r"pip install [^\n]*'xidstream\[([a-z,]+)\]'", stages()[role])
    assert len(found) == 1, f"the {role} stage installs xidstream with its extras exactly once: {found}"
    return set(found[0].split(","))


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=;!~]", req, maxsplit=1)[0].lower()


def extras_distributions(extras: set[str]) -> set[str]:
    """The distributions pyproject.toml's base and these extras name (self-references expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {_name(r) for r in project["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in project["optional-dependencies"][extra]:
            m = re.match(r"xidstream\[([a-z,]+)\]", req)
            if m:
                todo.extend(m.group(1).split(","))
            else:
                out.add(_name(req))
    return out


def _copied() -> set[str]:
    build = stages()["wheels"]  # where the wheels are made from
    return {m.group(1) for m in re.finditer(r"^COPY\s+(\S+)\s+\S+\s*$", build, re.M)}


def _folders() -> set[str]:
    """The checkout's folders the wheel is made from: `xidstream/` and every library it maps in."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {"xidstream", *setuptools["package-dir"].values()}


def test_the_image_builds_its_wheel_from_every_package_the_project_installs():
    packages = _folders()
    assert all((ROOT / p / "__init__.py").exists() for p in packages), packages
    missing = packages - _copied()
    assert not missing, f"the Containerfile's build stage copies no {sorted(missing)}: the image would lack them"
    assert "workshop" not in _copied(), "the workshop (local harnesses) is not part of the product's image"


def test_the_package_list_names_every_package_in_the_checkout():
    """A new top-level package must reach both pyproject.toml and the image; the workshop must not."""
    here = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench", "mutants", "workshop"}
    assert here <= _folders(), sorted(here - _folders())


def test_every_role_has_a_stage_that_installs_its_extras_runs_as_non_root_and_smoke_tests():
    st = stages()
    assert set(ROLES) <= set(st), sorted(set(ROLES) - set(st))
    assert re.search(r"useradd --system --uid 10001", st["runtime"])
    for role in ROLES:
        text = st[role]
        assert re.match(r"FROM runtime AS ", text), f"{role} builds on the shared runtime stage (its user)"
        assert re.findall(r"^USER (\S+)", text, re.M)[-1:] == ["10001:10001"], f"{role} ends as the non-root user"
        assert "--mount=type=bind,from=wheels" in text and "--no-index" in text, f"{role} installs only the built wheels"
        assert "xidstream --help" in text, f"{role} smoke-tests the installed command"
        # its dependencies first (a layer a code change leaves alone), the same extras' as it installs
        assert set(re.findall(r"-r /req/([a-z]+)\.txt", text)) == {"base"} | stage_extras(role), role
        assert stage_extras(role) <= set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_the_stages_install_the_extras_the_cli_says_each_role_has():
    """xidstream.extras.ROLES (what `make e2e` checks in each built image) is the Containerfile's."""
    from xidstream.extras import ROLES as EXTRAS_OF

    assert set(EXTRAS_OF) == set(ROLES)
    assert {role: stage_extras(role) for role in ROLES} == {role: set(e) for role, e in EXTRAS_OF.items()}


def test_the_node_stage_installs_no_faust_pyarrow_or_matplotlib():
    node = extras_distributions(stage_extras("node"))
    assert not node & NOT_ON_THE_NODE, sorted(node & NOT_ON_THE_NODE)
    assert {"nvidia-ml-py", "grpcio", "lightkube"} <= node  # what the collector and node executor do use
    # ... and the build checks it in the image itself
    assert re.search(r'for m in \("faust", "pyarrow", "matplotlib"\) if u\.find_spec\(m\)', stages()["node"])
    # the other roles carry what they run
    assert "faust-streaming" in extras_distributions(stage_extras("processor"))
    assert "pyarrow" in extras_distributions(stage_extras("exporter"))
    assert "lightkube" in extras_distributions(stage_extras("cluster-executor"))


def test_only_the_node_image_carries_journalctl():
    """The collector reads the journal (--kernel-log journal) and the node executor reboots through
    logind's busctl: both from Debian's systemd package, which no other role needs."""
    st = stages()
    assert "install -y --no-install-recommends systemd" in st["node"]
    assert [r for r in ROLES if "systemd" in re.sub(r"#.*", "", st[r]) and r != "node"] == []


def test_extras_per_role_and_dev_holds_them_all():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    roles = {"collector", "processor", "executors", "exporter", "report", "rocksdb"}
    assert roles <= set(extras)
    assert extras_distributions({"all"}) == extras_distributions(roles)
    assert extras_distributions({"all"}) <= extras_distributions({"dev"})
    base = extras_distributions(set())
    assert {"pydantic", "orjson", "confluent-kafka"} <= base
    assert not base & set(DIST_MODULES), "no role's dependency in the base install"


def _blocked(role: str) -> list[str]:
    """The optional modules a role's image lacks: every extra's distributions but its own."""
    mine = extras_distributions(stage_extras(role))
    every = extras_distributions({"all"})
    return sorted(DIST_MODULES[d] for d in every - mine if d in DIST_MODULES)


@pytest.mark.parametrize("role", ROLES)
def test_each_role_imports_and_parses_without_the_other_roles_modules(role):
    from xidstream.cli import command_names
    from xidstream.extras import runs_in

    packages, skip = ROLE_CODE[role]
    commands = runs_in(role, command_names())
    assert {"node": "collect", "processor": "process", "cluster-executor": "execute", "exporter": "export"}[role] in commands
    blocked = _blocked(role)
    if role == "node":
        assert {"faust", "pyarrow", "matplotlib"} <= set(blocked)
    code = f"""
import importlib, pkgutil, sys
for m in {blocked!r}:
    sys.modules[m] = None  # `import m` raises ImportError, as where it is not installed
failed = []
names = []
for pkg in {packages!r}:
    mod = importlib.import_module("xidstream." + pkg)
    names += [i.name for i in pkgutil.walk_packages(mod.__path__, mod.__name__ + ".")]
for name in names:
    if name in {skip!r}:
        continue
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed.append(f"FAILED {{name}}: {{exc}}")
from xidstream.cli import build_parser
from xidstream.extras import require
for command in {commands!r}:
    require(command)
    try:
        build_parser().parse_args([command, "--help"])
    except SystemExit as exc:
        if exc.code:
            failed.append(f"FAILED {{command}} --help: exit {{exc.code}}")
print(*failed, sep="\\n")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("FAILED ")] == []
