"""The chart's alert rules and dashboard (deploy/helm/xidstream/files/): checked and unit-tested by
the real `promtool` (Debian's prometheus package, unpacked by `make promtool`), every metric they
read exported by the code, every runbook a section of docs/operations.md, and the chart shipping
them unchanged."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from xidstream.collectors.metrics import CollectorMetrics
from xidstream.executors.metrics import ExecutorMetrics
from xidstream.streams.metrics import PROCESSOR_METRICS
from tests.tools import find_tool
from tests.deploy.test_helm_chart import by_kind, helm, render  # noqa: F401 - the helm fixture

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "deploy" / "helm" / "xidstream" / "files"
RULES = FILES / "prometheus-rules.yaml"
DASHBOARD = FILES / "grafana-dashboard.json"
RULE_TESTS = Path(__file__).with_name("prometheus-rules.test.yaml")
OPERATIONS = ROOT / "docs" / "operations.md"
PROMTOOL_CACHE = Path.home() / ".cache" / "xidstream" / "prometheus-deb" / "promtool"
RUNBOOK_BASE = "https://github.com/xidstream/xidstream/blob/main/docs/operations.md"


@pytest.fixture(scope="module")
def promtool() -> str:
    return find_tool("XIDSTREAM_PROMTOOL", cached=PROMTOOL_CACHE, names=("promtool",),
                     hint="run `make promtool` (unpacks Debian's prometheus package into ~/.cache/xidstream)")


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules(promtool):
    proc = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


def test_promtool_unit_tests_of_the_rules_pass(promtool):
    proc = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], capture_output=True, text=True, timeout=120,
                          cwd=RULE_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == {r["alert"] for r in _rules()}  # every alert has a unit test


def _exported() -> set[str]:
    """Every sample name the collector, executor and processor export."""
    names = set(PROCESSOR_METRICS)
    for registry in (CollectorMetrics().registry, ExecutorMetrics("cluster", dict).registry):
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names |= {family.name + s for s in suffixes}
    return names


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(xidstream_[a-z_]+)", expr))


def test_every_metric_the_rules_and_the_dashboard_read_is_exported():
    exported = _exported()
    exprs = [r["expr"] for r in _rules()]
    dash = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used and not used - exported, f"read but not exported: {sorted(used - exported)}"
    assert len(dash["panels"]) >= 8 and all(p["targets"] for p in dash["panels"])


def test_every_alert_has_a_runbook_section_in_the_operations_docs():
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), flags=re.M)}
    for rule in _rules():
        url = rule["annotations"]["runbook_url"]
        assert url == f"{RUNBOOK_BASE}#{rule['alert'].lower()}", url
        assert rule["alert"].lower() in anchors, f"docs/operations.md has no section {rule['alert']}"
        assert rule["labels"]["severity"] in ("critical", "warning")


def test_the_chart_ships_the_rules_and_the_dashboard_unchanged(helm):  # noqa: F811
    objs, _ = render(helm, "--api-versions", "monitoring.coreos.com/v1",
                     "--set", "metrics.prometheusRule.runbookBase=https://wiki.example/xidstream-ops")
    kinds = by_kind(objs)
    [rule] = kinds["PrometheusRule"].values()
    want = yaml.safe_load(RULES.read_text().replace(RUNBOOK_BASE, "https://wiki.example/xidstream-ops"))
    assert rule["spec"] == want
    dash = kinds["ConfigMap"]["xs-xidstream-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["xidstream-fleet.json"]) == json.loads(DASHBOARD.read_text())
    # without the Prometheus operator's CRD there is no PrometheusRule (helm install would fail on it)
    assert "PrometheusRule" not in by_kind(render(helm)[0])


def test_what_the_rules_read_is_scraped_where_they_are_installed(helm):  # noqa: F811
    """Found by review: the only monitor was the collector's ServiceMonitor, so where the
    PrometheusRule is installed nothing scraped the processor or the cluster executor, and the
    wedge, breaker, held-command and refusal alerts could never fire."""
    from tests.deploy.test_helm_chart import containers

    kinds = by_kind(render(helm, "--api-versions", "monitoring.coreos.com/v1")[0])
    monitors = kinds["PodMonitor"]
    for component, deployment in (("processor", "xs-xidstream-processor"),
                                  ("cluster-executor", "xs-xidstream-cluster-executor")):
        mon = monitors[f"xs-xidstream-{component}"]
        pod = kinds["Deployment"][deployment]["spec"]["template"]
        assert mon["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        [endpoint] = mon["spec"]["podMetricsEndpoints"]
        ports = {p["name"] for c in containers(kinds["Deployment"][deployment]).values() for p in c.get("ports", [])}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    off = by_kind(render(helm, "--api-versions", "monitoring.coreos.com/v1", "--set", "clusterExecutor.metricsPort=0")[0])
    assert set(off["PodMonitor"]) == {"xs-xidstream-processor"}
    assert "PodMonitor" not in by_kind(render(helm)[0])
