from __future__ import annotations

import jsonschema
import orjson
import pytest

from xidstream.schemas import encode
from xidstream.schemas.jsonschema import SCHEMA_DIR, render_all, stale_files
from tests.factories import one_of_each


def test_committed_json_schemas_are_in_sync():
    stale = stale_files()
    assert not stale, f"run `xidstream schemas generate`; stale: {stale}"


def test_stale_detection_notices_a_change(tmp_path):
    for name, body in render_all().items():
        (tmp_path / name).write_bytes(body)
    assert stale_files(tmp_path) == []
    victim = sorted(render_all())[0]
    (tmp_path / victim).write_bytes(b"{}")
    (tmp_path / "old.v0.json").write_bytes(b"{}")
    assert stale_files(tmp_path) == [victim, "old.v0.json"]


@pytest.mark.parametrize("record", one_of_each(), ids=lambda r: type(r).__name__)
def test_encoded_records_validate_against_their_committed_schema(record):
    kind, version = record.SCHEMA.split("/")
    schema = orjson.loads((SCHEMA_DIR / f"{kind}.v{version}.json").read_bytes())
    jsonschema.validate(orjson.loads(encode(record)), schema)
