from __future__ import annotations

import os
from pathlib import Path

import pytest

from schemas import catalog_gen
from schemas.xid_catalog import NOT_ASSIGNED, NVLINK5_RULES, XID_CATALOG, lookup


def test_every_entry_has_a_name_category_and_resolution():
    assert len(XID_CATALOG) >= 170
    for xid, info in XID_CATALOG.items():
        assert info.xid == xid and info.name and info.category and info.resolution, info
    assert {i.category for i in XID_CATALOG.values()} <= {
        "app", "driver", "hardware", "memory", "bus", "nvlink", "thermal", "other"}


def test_known_codes_and_unknown_ones():
    assert (lookup(43).resolution, lookup(43).device_plugin_ignored) == ("IGNORE", True)
    assert lookup(79).resolution == "RESTART_BM"
    assert lookup(48).resolution == "WORKFLOW_XID_48"
    assert lookup(100_000) == lookup(100_000)._replace(name="unknown", category="unknown", resolution=NOT_ASSIGNED)
    assert {r.xid for r in NVLINK5_RULES} == set(range(144, 151))


# The catalog CSVs the generated module was made from, kept in tests/data (as kernel-log-lines.tsv
# is), so the check runs on any checkout, not only one with ../shared beside it.
OWN_DATA = Path(__file__).resolve().parents[1] / "data"
CATALOG_CSVS = ("xid_catalog.csv", "xid_catalog_extended.csv", "xid_nvlink5_decode.csv")


def test_generated_module_matches_the_catalog_csv():
    assert catalog_gen.OUT.read_text() == catalog_gen.render(OWN_DATA), (
        "schemas/xid_catalog.py is not what tests/data's CSVs generate: run python -m schemas.catalog_gen "
        "(and copy the CSVs it read into tests/data)")
    assert "DO NOT EDIT" in Path(catalog_gen.OUT).read_text().splitlines()[0]


def test_the_tests_copy_of_the_csv_is_the_shared_one():
    """The copy in tests/data is the shared data's, byte for byte, wherever ../shared/data is there.
    A checkout without it skips this on a developer's machine; in CI (CI=true) a missing folder
    is a failure, so the comparison is never silently skipped there."""
    data = catalog_gen.DEFAULT_DATA
    if not (data / CATALOG_CSVS[0]).exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{data} has no {CATALOG_CSVS[0]}: CI must check tests/data against the shared catalog")
        pytest.skip(f"{data} is not beside this checkout")
    stale = [name for name in CATALOG_CSVS if (data / name).read_bytes() != (OWN_DATA / name).read_bytes()]
    assert not stale, f"tests/data/{stale[0]} differs from {data / stale[0]}: copy it and regenerate the module"
