from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from xidstream.schemas import Action, Classification, ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]
MOTIVATING = ROOT / "scenarios" / "motivating-incident.yaml"


def _base() -> dict:
    return {
        "scenario": 1,
        "name": "t",
        "duration": 60,
        "nodes": [{"name": "node-a", "gpus": [
            {"index": 0, "uuid": "GPU-aaaa", "pci_bus_id": "00000000:01:00.0"},
            {"index": 1, "uuid": "GPU-bbbb", "pci_bus_id": "00000000:02:00.0"},
        ]}],
        "timeline": [],
    }


def test_every_scenario_in_the_library_loads():
    files = sorted((ROOT / "scenarios").glob("*.yaml"))
    assert MOTIVATING in files
    for path in files:
        sc = load_scenario(path)
        assert sc.scenario == 1 and sc.name


def test_motivating_incident_content():
    sc = load_scenario(MOTIVATING)
    assert sc.start is not None and sc.start.utcoffset().total_seconds() == 0
    assert [g.uuid for g in sc.node("gpu-node-7").gpus][1] == sc.gpu("gpu-node-7", 1).uuid
    kernel = [line for e in sc.timeline if e.kernel for line in e.kernel]
    assert any(": 43, " in line for line in kernel)
    wedged = [e for e in sc.expect if e.classification is Classification.GPU_WEDGED][0]
    assert wedged.actions == [Action.CORDON_NODE, Action.DRAIN_NODE, Action.RESET_GPU]


def test_entries_sort_by_time_and_keep_file_order_for_ties():
    data = _base()
    data["timeline"] = [
        {"at": 5, "node": "node-a", "kernel": "b"},
        {"at": 1, "node": "node-a", "kernel": ["a"]},
        {"at": 5, "node": "node-a", "kernel": "c"},
    ]
    sc = parse_scenario(data)
    assert [e.kernel for e in sc.sorted_timeline()] == [["a"], ["b"], ["c"]]


def test_gpu_by_index_or_uuid():
    sc = parse_scenario(_base())
    assert sc.gpu("node-a", 1).uuid == "GPU-bbbb"
    assert sc.gpu("node-a", "GPU-aaaa").index == 0


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d["timeline"].append({"at": 3, "node": "node-a", "gpu": 1, "sample": {"power_w": "lots"}}),
         "timeline[0] (at 3, node node-a): sample.power_w"),
        (lambda d: d["timeline"].append({"at": 3, "node": "node-a", "sample": {"power_w": 1}}),
         "'gpu' is required with sample"),
        (lambda d: d["timeline"].append({"at": 3, "node": "node-b", "kernel": "x"}),
         "timeline[0] (at 3): unknown node 'node-b'"),
        (lambda d: d["timeline"].append({"at": 3, "node": "node-a", "gpu": 7, "nvml": "lost"}),
         "node 'node-a' has no GPU 7"),
        (lambda d: d["timeline"].append({"at": 99, "node": "node-a", "kernel": "x"}),
         "at 99 is after duration 60"),
        (lambda d: d["timeline"].append({"at": 1, "node": "node-a", "gpu": 0, "nvml": "melted"}),
         "timeline[0] (at 1, node node-a): nvml"),
        (lambda d: d["timeline"].append({"at": 1, "node": "node-a", "colour": "red", "kernel": "x"}),
         "timeline[0] (at 1, node node-a): colour: Extra inputs are not permitted"),
        (lambda d: d["expect"].append({"gpu": 1, "classification": "GPU_WEDGED"}) if "expect" in d
         else d.update(expect=[{"gpu": 1, "classification": "GPU_WEDGED"}]),
         "expect[0]: a GPU index needs a 'node'"),
        (lambda d: d.update(expect=[{"classification": "GPU_MELTED"}]), "expect[0]"),
        (lambda d: d.update(scenario=2), "'scenario: 1' is required"),
        (lambda d: d["nodes"][0]["gpus"].append({"index": 0, "uuid": "GPU-cccc", "pci_bus_id": "0000:03:00"}),
         "duplicate GPU index"),
        (lambda d: d["nodes"][0]["gpus"][0].update(pci_bus_id="nowhere"), "not a PCI bus id"),
    ],
)
def test_invalid_scenarios_name_the_field_and_entry(mutate, needle):
    data = _base()
    mutate(data)
    with pytest.raises(ScenarioError) as info:
        parse_scenario(data, "my.yaml")
    assert needle in str(info.value)
    assert str(info.value).startswith("my.yaml")


def test_load_reports_bad_yaml_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scenario: 1\nnodes: [\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.yaml")


def test_json_and_yaml_give_the_same_scenario(tmp_path):
    import orjson

    data = _base()
    data["start"] = "2026-11-28T03:00:00Z"
    data["timeline"] = [{"at": 1, "node": "node-a", "gpu": 0, "processes": []}]
    (tmp_path / "s.json").write_bytes(orjson.dumps(data))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    assert load_scenario(tmp_path / "s.json") == load_scenario(tmp_path / "s.yaml")
