"""The processor's /metrics text (streams/metrics.py): every series from the start, and a verdict
counted as raised once per incident."""

from __future__ import annotations

from types import SimpleNamespace

from xidstream.streams.metrics import LabelledCounts, metrics_text

STATS = {"events": 0, "deadletters": 0, "alerts": 0, "commands": 0, "rows_written": 0, "outputs_refused": 0,
         "gpu_claims_refused": 0}


def _alert(iid: str, cls: str, state: str):
    return SimpleNamespace(incident_id=iid, classification=cls, state=state)


def _samples(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def test_every_series_is_there_at_zero_before_anything_happened():
    """Prometheus's increase() over a series whose first sample is already 1 is 0: the first wedged
    GPU after a worker started would never page (found by review)."""
    got = _samples(metrics_text(STATS, LabelledCounts()))
    assert got['xidstream_processor_verdicts_raised_total{classification="GPU_WEDGED"}'] == 0
    assert got['xidstream_processor_verdict_alerts_total{classification="GPU_HARDWARE_FAULT",state="open"}'] == 0
    assert got['xidstream_processor_action_commands_total{action="RESET_GPU",held="true"}'] == 0
    assert got["xidstream_processor_breaker_tripped"] == 0
    assert got["xidstream_processor_gpu_claims_refused_total"] == 0
    assert got['xidstream_processor_verdicts_raised_total{classification="GPU_CLAIM_CONFLICT"}'] == 0


def test_a_verdict_is_raised_once_per_incident_not_per_alert():
    c = LabelledCounts()
    c.alert(_alert("i1", "APP_FAULT", "open"))
    c.alert(_alert("i1", "GPU_WEDGED", "updated"))  # escalated: raised
    c.alert(_alert("i1", "GPU_WEDGED", "updated"))  # a step's outcome: not raised again
    c.alert(_alert("i1", "GPU_WEDGED", "resolved"))
    c.alert(_alert("i1", "GPU_WEDGED", "updated"))  # a closing step failed after it resolved: no page
    c.alert(_alert("i2", "GPU_WEDGED", "open"))
    got = _samples(metrics_text(STATS, c))
    assert got['xidstream_processor_verdicts_raised_total{classification="GPU_WEDGED"}'] == 2
    assert got['xidstream_processor_verdicts_raised_total{classification="APP_FAULT"}'] == 1
    assert got['xidstream_processor_verdict_alerts_total{classification="GPU_WEDGED",state="updated"}'] == 3
