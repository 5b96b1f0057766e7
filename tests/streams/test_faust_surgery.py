"""docs/development.md lists every private faust/aiokafka/mode attribute the product touches, with
why it stays, and gives their number: bench/faust_surgery.py's count of the code must agree."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # parses faust, aiokafka, mode and asyncio: about 5 s
def test_the_documented_private_attributes_are_the_ones_the_code_touches():
    spec = importlib.util.spec_from_file_location("faust_surgery", ROOT / "bench" / "faust_surgery.py")
    surgery = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = surgery  # its dataclasses look their module up
    try:
        spec.loader.exec_module(surgery)
    finally:
        del sys.modules[spec.name]
    touches, ambiguous, _ = surgery.scan(list(surgery.PRODUCT))
    counted = set(surgery.summary(touches)["names"])
    assert not ambiguous, ambiguous

    doc = (ROOT / "docs" / "development.md").read_text()
    section = doc[doc.index("### The private attributes it touches"):]
    section = section[:section.index("\n## ") if "\n## " in section else len(section)]
    listed = {name for row in section.splitlines() if row.startswith("| `")
              for name in re.findall(r"`(_\w+)`", row.split(" | ")[0])}
    assert listed == counted, f"in the code, not listed: {sorted(counted - listed)}; listed, not in the code: " \
                              f"{sorted(listed - counted)}"
    assert f"It\ngives {len(counted)} " in section or f"It gives {len(counted)} " in section
