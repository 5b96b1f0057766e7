"""The NVSwitch SXid table (schemas.sxid_catalog): each entry is whole, unknown codes pass through as
`unknown`, and the names agree with what the driver itself prints in real SXid lines."""

from __future__ import annotations

import re

import pytest

from xidstream.schemas.sxid_catalog import FATALITIES, SXID_CATALOG, lookup_sxid


def test_every_entry_has_its_code_a_name_and_the_guides_class():
    assert SXID_CATALOG
    for code, info in SXID_CATALOG.items():
        assert info.sxid == code and info.name and info.fatality in FATALITIES, info
    assert FATALITIES == ("non_fatal", "fatal", "always_fatal")


def test_a_code_the_table_lacks_is_unknown_not_dropped():
    assert tuple(lookup_sxid(99_999)) == (99_999, "unknown", "unknown")
    assert lookup_sxid(20034).fatality == "fatal"


# Real lines (gpud's capture and README, tests/data/kernel-log-lines.tsv; gpud's parser tests; a
# public dataset of DGX logs): the driver prints the severity and the error's text after the code.
REAL = [
    "[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
    "[111111111.111] nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted "
    "PRIV error (First)",
    "nvidia-nvswitch4: SXid (PCI:0000:c6:00.0): 19084, Non-fatal, Link 29 AN1 Heartbeat Timeout Error (First)",
]


@pytest.mark.parametrize("line", REAL)
def test_the_name_and_class_agree_with_what_the_driver_prints(line):
    code, severity, text = re.search(r"\): (\d+), (Fatal|Non-fatal), (.*)$", line).groups()
    info = lookup_sxid(int(code))
    squash = lambda s: re.sub(r"[^a-z]", "", s.lower())  # noqa: E731 - "non-posted" / "nonposted"
    assert squash(info.name) in squash(text)
    assert info.fatality == ("non_fatal" if severity == "Non-fatal" else "fatal")
