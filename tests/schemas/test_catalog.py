from __future__ import annotations

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


def test_generated_module_matches_the_shared_csv():
    data = catalog_gen.DEFAULT_DATA
    if not (data / "xid_catalog.csv").exists():
        pytest.skip("../shared/data is not beside this checkout")
    assert catalog_gen.OUT.read_text() == catalog_gen.render(data), "run python -m schemas.catalog_gen"
    assert "DO NOT EDIT" in Path(catalog_gen.OUT).read_text().splitlines()[0]
