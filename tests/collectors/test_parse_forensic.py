"""`xidstream parse` reads text as people paste it (the parser's forensic mode), and believes only
what a live source would; the driver's probe-time fallen-off-the-bus message is one record."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from collectors.parse.kernel import parse_line

DATA = Path(__file__).resolve().parents[1] / "data"


def rows(name: str) -> list[list[str]]:
    with (DATA / name).open(newline="") as fh:
        return [r for r in csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE) if r and not r[0].startswith("#")]


FORGERIES = [r[0] for r in rows("kernel-forgeries.tsv")] + [r[1] for r in rows("kernel-newline-forgery.tsv")]


@pytest.mark.parametrize("line", FORGERIES)
def test_no_tenant_injection_line_is_believed_by_any_live_source(line):
    for source in ("kmsg", "journal"):
        assert parse_line(line, source) == []
