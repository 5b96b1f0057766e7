"""The outside programs some tests run (helm, promtool, chromium), found the one way; and how many
examples a property gets in this run's Hypothesis profile."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def find_tool(env: str, *, cached: Path | None = None, names: tuple[str, ...], hint: str) -> str:
    """$`env` when set, else the project's cached build, else the first of `names` on the PATH;
    the test fails with `hint` (the make target that provides it) when none is an executable file."""
    for cand in (os.environ.get(env), str(cached) if cached else None, *(shutil.which(n) for n in names)):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    pytest.fail(f"{names[0]} not found: {hint}")


# Hypothesis profiles (registered in tests/conftest.py): `quick` for `make test`, what a developer
# runs on every change, `thorough` for `make test-all` (CI). A property's count is written once, as
# the thorough one; the quick run tries a quarter of it, at least 10.
PROFILE = os.environ.get("XIDSTREAM_HYPOTHESIS", "quick")
if PROFILE not in ("quick", "thorough"):
    raise ValueError(f"XIDSTREAM_HYPOTHESIS={PROFILE!r}: use quick or thorough")


def examples(thorough: int) -> int:
    """max_examples for a property whose thorough count is `thorough`, in this run's profile."""
    return thorough if PROFILE == "thorough" else max(10, thorough // 4)
