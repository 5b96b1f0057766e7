"""The outside programs some tests run (helm, promtool, chromium), found the one way."""

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
