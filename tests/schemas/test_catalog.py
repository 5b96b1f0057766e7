from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import pytest

from xidstream.schemas import catalog_gen
from xidstream.schemas.xid_catalog import NOT_ASSIGNED, NVLINK5_RULES, XID_CATALOG, lookup


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
        "schemas/xid_catalog.py is not what tests/data's CSVs generate: run python -m xidstream.schemas.catalog_gen "
        "(and copy the CSVs it read into tests/data)")
    assert "DO NOT EDIT" in Path(catalog_gen.OUT).read_text().splitlines()[0]


def _csv_rows(path: Path) -> dict[int, dict[str, str]]:
    with path.open(newline="") as fh:
        return {int(r["xid"]): r for r in csv.DictReader(fh)}


def test_the_tests_copy_of_the_csv_holds_the_shared_one():
    """tests/data holds the shared reference's catalog: each of its rows, every column as it is there
    (the extended and NVLink5 sheets byte for byte), plus rows and a `driver_branch` column for codes
    NVIDIA documents after it. A checkout without ../shared/data skips this on a developer's machine;
    in CI (CI=true) a missing folder is a failure, so the comparison is never silently skipped there."""
    data = catalog_gen.SHARED_DATA
    if not (data / CATALOG_CSVS[0]).exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{data} has no {CATALOG_CSVS[0]}: CI must check tests/data against the shared catalog")
        pytest.skip(f"{data} is not beside this checkout")
    stale = [name for name in CATALOG_CSVS[1:] if (data / name).read_bytes() != (OWN_DATA / name).read_bytes()]
    assert not stale, f"tests/data/{stale[0]} differs from {data / stale[0]}: copy it and regenerate the module"
    shared, own = _csv_rows(data / CATALOG_CSVS[0]), _csv_rows(OWN_DATA / CATALOG_CSVS[0])
    changed = [x for x, row in shared.items() if {k: own.get(x, {}).get(k) for k in row} != row]
    assert not changed, f"tests/data/xid_catalog.csv differs from the shared copy at Xid {changed[:5]}"
    assert min(set(own) - set(shared), default=max(shared) + 1) > max(shared), "rows added here are past the shared ones"


def test_xid_185_sparing_event_is_in_the_catalog_with_its_driver_branch():
    info = lookup(185)
    assert (info.name, info.category, info.resolution, info.driver_branch) == (
        "SPARING_EVENT", "memory", NOT_ASSIGNED, "R620")
    assert "GPU Operational Events" in info.description


def test_each_code_added_past_the_shared_catalog_names_its_source_and_driver_branch():
    """A code the shared reference (1-172) lacks is here only with a public NVIDIA page that names
    it and the earliest driver branch a public source ties it to; a code no public source names is
    not made up (it passes through `lookup` as unknown)."""
    rows = _csv_rows(OWN_DATA / CATALOG_CSVS[0])
    added = {x: r for x, r in rows.items() if x > 172}
    assert added, "no code past 172"
    for x, r in added.items():
        assert re.fullmatch(r"R\d{3}", r["driver_branch"]), (x, r["driver_branch"])
        assert "https://docs.nvidia.com/" in r["sources"], x
        assert XID_CATALOG[x].driver_branch == r["driver_branch"]
    assert all(not r["driver_branch"] for x, r in rows.items() if x <= 172)  # the shared rows' is not ours to add
    assert lookup(173).name == "unknown"  # 173-184: in no public source found
