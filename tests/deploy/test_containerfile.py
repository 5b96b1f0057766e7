"""The image carries every package the project installs (`exporters/` was never copied,
so `xidstream export` could not work in the image). Read from the Containerfile's build stage and
pyproject.toml's package list; `make image` builds it for real where buildah or podman exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _copied() -> set[str]:
    text = (ROOT / "Containerfile").read_text()
    build = text.split("\nFROM ", 2)[1]  # the build stage: where the wheel is made from
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
