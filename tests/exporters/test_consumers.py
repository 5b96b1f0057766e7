"""What the consumer guide ships works with the documents the exporter writes: the Elasticsearch
index template maps every field with its ECS type, and the Security Lake split writes one typed
table per OCSF class."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from xidstream.exporters import security_lake
from xidstream.exporters.ecs import CUSTOM_NAMESPACE, ECS_FIELD_TYPES, to_ecs
from xidstream.exporters.ocsf import to_ocsf
from xidstream.schemas import Action
from tests.exporters.helpers import alerts, commands_and_results
from tests.exporters.test_ecs import _flatten
from tests.exporters.test_semantics import _approval, _key

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "elasticsearch" / "xidstream-ecs-index-template.json"


def _mapped(props: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for name, m in props.items():
        if "properties" in m:
            out.update(_mapped(m["properties"], f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = m["type"]
    return out


def _docs() -> list[dict]:
    return [d for d in map(to_ecs, alerts() + commands_and_results() + [_key().sign(_approval())]) if d is not None]


def test_the_index_template_maps_every_ecs_field_with_its_ecs_type():
    mapped = _mapped(json.loads(TEMPLATE.read_text())["template"]["mappings"]["properties"])
    assert {k: v for k, v in mapped.items() if not k.startswith(CUSTOM_NAMESPACE + ".")} == ECS_FIELD_TYPES
    # every ECS field of every document is mapped (dynamic: false would keep an unmapped one
    # out of the index without a word)
    for doc in _docs():
        fields = _flatten({k: v for k, v in doc.items() if k != CUSTOM_NAMESPACE})
        assert set(fields) <= set(mapped), set(fields) - set(mapped)


def test_the_template_types_the_xidstream_fields_it_indexes_as_the_documents_hold_them():
    mapped = _mapped(json.loads(TEMPLATE.read_text())["template"]["mappings"]["properties"])
    ours = {k[len(CUSTOM_NAMESPACE) + 1:]: v for k, v in mapped.items() if k.startswith(CUSTOM_NAMESPACE + ".")}
    checks = {"keyword": str, "match_only_text": str, "long": int, "boolean": bool, "date": str}
    seen = set()
    for doc in _docs():
        for name, value in _flatten(doc.get(CUSTOM_NAMESPACE, {})).items():
            if name in ours and value is not None:
                values = value if isinstance(value, list) else [value]
                assert all(isinstance(v, checks[ours[name]]) for v in values), (name, value)
                seen.add(name)
    assert {"incident_id", "command_id", "key_id", "pids", "pod_uids", "approval_id"} <= seen


def _findings_lake(root: Path) -> list[dict]:
    """A findings.ocsf table as the exporter lands it (one JSON document a row), over two days."""
    events = [e for e in map(to_ocsf, alerts() + commands_and_results() + [_approval()]) if e is not None]
    events[0] = {**events[0], "time": events[0]["time"] + 86_400_000}  # the next day
    folder = root / "topic=findings.ocsf" / "dt=2026-11-28" / "hour=3"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"class_uid": pa.array([e["class_uid"] for e in events], pa.int32()),
                             "document": [orjson.dumps(e).decode() for e in events]}), folder / "part-1.parquet")
    return events


def test_security_lake_gets_one_typed_table_per_class_and_day(tmp_path):
    events = _findings_lake(tmp_path / "lake")
    counts = security_lake.split_by_class(tmp_path / "lake", tmp_path / "out", region="eu-west-1", account="1234")
    want = {}
    for e in events:
        want[e["class_uid"]] = want.get(e["class_uid"], 0) + 1
    assert counts == want and set(counts) == {2004, 2005, 7001}
    base = tmp_path / "out" / "ext"
    days = sorted(p.name for p in (base / "xidstream-detection-finding" / "region=eu-west-1" / "accountId=1234").iterdir())
    assert days == ["eventDay=20261128", "eventDay=20261129"]
    for cls, name in ((2004, "detection-finding"), (2005, "incident-finding"), (7001, "remediation-activity")):
        t = pq.ParquetDataset(base / f"xidstream-{name}").read()
        assert t.num_rows == want[cls] and set(t.column("class_uid").to_pylist()) == {cls}
        assert pa.types.is_integer(t.schema.field("time").type)
        assert pa.types.is_struct(t.schema.field("metadata").type)  # typed columns, not JSON text
        # json_t attributes stay JSON text (their shape differs between events)
        assert pa.types.is_string(t.schema.field("unmapped").type)
        assert isinstance(json.loads(t.column("unmapped")[0].as_py()), dict)
    one = security_lake.split_by_class(tmp_path / "lake", tmp_path / "out2", day="2026-11-29")
    assert one == {events[0]["class_uid"]: 1}


def test_a_column_the_first_event_lacks_is_kept(tmp_path):
    # a day of Remediation Activity that starts with a result (no `remediation`) and then has a
    # command (with one): pyarrow alone infers the columns from the first row and dropped it
    recs = [r for r in commands_and_results() if r.action is not Action.RECORD]
    cmd, res = to_ocsf(recs[0]), to_ocsf(recs[1])  # a command and its result
    assert "remediation" not in res and "remediation" in cmd
    folder = tmp_path / "lake" / "topic=findings.ocsf" / "dt=2026-11-28" / "hour=3"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"class_uid": pa.array([7001, 7001], pa.int32()),
                             "document": [orjson.dumps(res).decode(), orjson.dumps(cmd).decode()]}),  # result first
                   folder / "part-1.parquet")
    security_lake.split_by_class(tmp_path / "lake", tmp_path / "out")
    t = pq.ParquetDataset(tmp_path / "out" / "ext" / "xidstream-remediation-activity").read()
    rows = t.to_pylist()
    assert rows[0]["remediation"] is None and rows[1]["remediation"] == cmd["remediation"]
    assert "status_detail" in t.column_names and "command_uid" in t.column_names


def test_security_lake_says_when_nothing_was_landed(tmp_path, capsys):
    assert security_lake.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "no OCSF findings landed here" in capsys.readouterr().err
