"""What `pip install xidstream` puts into site-packages: one top-level name, `xidstream`, holding
every library the checkout keeps in its own folder (schemas/, streams/, ...: pyproject.toml's
package-dir), and nothing of the workshop (the local broker, API server, node and e2e driver).

The wheel is built from the checkout (offline: the dev extra's setuptools, no build isolation),
installed into a folder of its own and imported from there in a fresh interpreter that cannot
see the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("schemas", "transport", "collectors", "streams", "executors", "exporters")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # a copy of the tree git knows, so no build/ or egg-info is left in the checkout
    src = out / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = out.glob("xidstream-*.whl")
    return built


def test_the_wheel_installs_only_xidstream_at_top_level(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"xidstream"}


def test_every_module_of_the_libraries_is_in_the_wheel_under_xidstream(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"xidstream/{p.relative_to(ROOT).as_posix()}" for lib in LIBRARIES for p in (ROOT / lib).rglob("*.py")
            if "__pycache__" not in p.parts}
    want |= {f"xidstream/{p.name}" for p in (ROOT / "xidstream").glob("*.py")}
    want |= {f"xidstream/schemas/json/{p.name}" for p in (ROOT / "schemas" / "json").glob("*.json")}
    assert want - names == set(), sorted(want - names)
    assert not [n for n in names if "workshop" in n or "localbroker" in n or "node_e2e" in n]
    assert len([n for n in names if n.startswith("xidstream/schemas/json/")]) >= 10


def test_the_installed_wheel_imports_by_one_name_and_lacks_the_workshop(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    code = (
        "import importlib.util, sys\n"
        "import xidstream.streams.verdict, xidstream.collectors.agent, xidstream.cli\n"
        "print(xidstream.streams.verdict.__file__)\n"
        "print(*(importlib.util.find_spec(n) is None for n in ('schemas', 'streams', 'transport', 'workshop')))\n"
        "print(sorted(xidstream.cli.build_parser()._subparsers._group_actions[0].choices))\n"
    )
    # run from an empty folder, the installed copy first on the path: the checkout is not visible
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, absent, commands = proc.stdout.splitlines()
    assert where.startswith(str(target / "xidstream" / "streams")), where
    assert absent == "True True True True"
    assert {"collect", "process", "execute", "export", "incident"} <= set(eval(commands))  # noqa: S307 (our own print)
    assert not {"broker", "kube", "node", "e2e", "demo-cluster"} & set(eval(commands))  # noqa: S307
