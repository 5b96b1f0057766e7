"""`xidstream incident ID --html FILE`: one incident as a self-contained HTML page.

A chart of the GPU's utilization, memory used and power over the incident's span (its samples
from gpu.samples, or from `replay --json --telemetry` lines on stdin), the Xid and recovery records
as markers, the commands and their results as a band below; the evidence table; NVIDIA's catalog
text for each Xid; and the recovery order of the incident note with the steps done and left.

Why matplotlib: it renders the chart to SVG on the machine that writes the report, so the page has
no script and loads nothing at view time (it opens the same from a ticket attachment, an air-gapped
laptop or a mail client that blocks scripts), and its output is deterministic for a given input.
Plotly or Vega-Lite would inline megabytes of JavaScript per report and need a browser engine to
draw at all. It is an optional dependency (`pip install 'xidstream[report]'`): the collectors and
the processor never import it.
"""

from __future__ import annotations

import html
import io
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from xidstream.schemas.errors import ConfigError
from xidstream.schemas.xid_catalog import lookup
from xidstream.incidents import _ts

__all__ = ["write_report", "render_report", "live_samples", "RECOVERY_ORDER"]

# ../shared/reference/incident.md, "Recovery order (what a remediation plan must encode)"
RECOVERY_ORDER = [
    ("Establish the blast radius: pods on the node, GPU allocations.", ()),
    ("Cordon, then drain the GPU workloads through the cluster's normal process (PDBs, spare capacity, "
     "change approval, rollback plan). Never kill -9 the process that holds /dev/nvidiaN.", ("CORDON_NODE", "DRAIN_NODE")),
    ("Only when the GPU has no processes and the maintenance window holds: nvidia-smi --gpu-reset -i N. "
     "Never force-unload the kernel module.", ("RESET_GPU",)),
    ("If the reset fails, nvidia-smi hangs, or Xids keep coming: reboot or replace the node; afterwards verify "
     "nvidia-smi, pmon, and a kernel log with no new Xid since boot.", ("REBOOT_NODE", "REPLACE_NODE")),
    ("Bring work back gradually, a small share first.", ("UNCORDON_NODE", "RELEASE_GPU")),
]
_OUTCOME_COLOURS = {"succeeded": "#2ca02c", "failed": "#d62728", "refused": "#ff7f0e", "expired": "#7f7f7f"}


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)  # t from _ts: 0 .. year 9999


def _number(v: Any) -> float | None:
    """A sample's value to chart: a finite number within what a GPU can report, else a gap (a
    record is read as published; a node can write anything)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > 1e9:
        return None
    return float(v)


def live_samples(settings: Any, gpu_uuid: str, inc: Any) -> list[dict]:
    """The GPU's samples from 10 minutes before the incident's first record to 5 after its last:
    only the partition its UUID is keyed to is read (transport.kafka.read_key)."""
    import orjson

    from xidstream.transport.kafka import read_key

    node = inc.last.get("node") if inc.alerts else None
    times = [_ts(a.get("ts")) for a in inc.alerts] + [_ts(c.get("ts")) for c in inc.commands]
    start, end = min(times) - 600, max(times) + 300
    msgs = read_key(settings, settings.topics.name("gpu.samples"), gpu_uuid.encode(), int(start * 1000), int(end * 1000))
    out = []
    for m in msgs:
        try:
            v = orjson.loads(m.value())
        except orjson.JSONDecodeError:
            continue
        # the GPU's own node's samples only: another node cannot draw this GPU's chart
        if isinstance(v, dict) and v.get("node") == node and start <= _ts(v.get("ts")) <= end:
            out.append(v)
    return out


def _chart_svg(book: Any, inc: Any, samples: list[dict]) -> str:
    """The chart as an inline SVG document (no external reference)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--html needs matplotlib: pip install 'xidstream[report]'") from None
    plt.rcParams["svg.fonttype"] = "none"  # text stays text (searchable), not paths
    plt.rcParams["text.parse_math"] = False  # a "$" in node-supplied text is a character, not TeX
    samples = sorted((s for s in samples if _ts(s.get("ts")) > 0), key=lambda s: _ts(s.get("ts")))
    xs = [_dt(_ts(s.get("ts"))) for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(11, 7.5), sharex=True,
                             gridspec_kw={"height_ratios": [3, 3, 3, 2]}, constrained_layout=True)
    series = [("utilization_gpu_pct", "utilization %", "#1f77b4"), ("memory_used_mib", "memory used MiB", "#9467bd"),
              ("power_w", "power W", "#8c564b")]
    for ax, (key, label, colour) in zip(axes[:3], series):
        ys = [_number(s.get(key)) for s in samples]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, linewidth=1.6, label=label)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    if not samples:
        axes[0].text(0.5, 0.5, "no samples of this GPU were read for this span", transform=axes[0].transAxes,
                     ha="center", va="center")
    for ax, (key, _, _) in zip(axes[:3], series):
        top = max((_number(s.get(key)) or 0 for s in samples), default=0)
        ax.set_ylim(0, 105 if key == "utilization_gpu_pct" else max(top * 1.1, 1))  # from zero: no magnified step
    # Xid and recovery records as markers across the three panels; the lines of one fault (within
    # 10 s) share one label, so a 13 -> 31 -> 43 burst reads as one event
    marks: list[tuple[float, str]] = []
    for item in _xid_marks(inc):
        marks.append(item)
        for ax in axes[:3]:
            ax.axvline(_dt(item[0]), color="#d62728", linestyle="--", linewidth=1, alpha=0.8)
    for t, label in _clusters(marks, 10.0):
        axes[0].annotate(label, (_dt(t), 0.04), xycoords=("data", "axes fraction"), ha="left", va="bottom",
                         fontsize=8, color="#d62728", xytext=(4, 0), textcoords="offset points")
    # commands (squares) and results (circles, coloured by outcome) in the band below
    band = axes[3]
    actions = [c.get("action") for c in sorted(inc.commands, key=lambda c: c.get("step") or 0)]
    rows = {a: i for i, a in enumerate(dict.fromkeys(actions))}
    for c in inc.commands:
        if _ts(c.get("ts")) <= 0:
            continue
        y = rows[c.get("action")]
        band.plot([_dt(_ts(c.get("ts")))], [y], marker="s", color="#1f77b4", markersize=7)
        r = book.result_for(c)
        if r is not None and _ts(r.get("ts")) > 0:
            band.plot([_dt(_ts(r.get("ts")))], [y], marker="o", markersize=8,
                      color=_OUTCOME_COLOURS.get(str(r.get("outcome")), "#17becf"))
    band.set_yticks(list(rows.values()), list(rows.keys()), fontsize=8)
    band.set_ylim(-0.7, max(len(rows), 1) - 0.3)
    band.set_ylabel("commands")
    band.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"GPU {inc.gpu_index} ({inc.last.get('gpu_uuid')}) on {inc.last.get('node')}: "
                 f"{inc.last.get('classification')}", fontsize=11)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})  # the same input, the same bytes
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE (its URL is never fetched, but still)


def _xid_marks(inc: Any) -> list[tuple[float, str]]:
    """(time, label) of each Xid or recovery record in the incident's evidence."""
    seen: dict[tuple, str] = {}
    for a in inc.alerts:
        for e in (a.get("evidence") or {}).get("timeline") or []:
            if e.get("kind") != "xid":
                continue
            x = (e.get("data") or {}).get("xid")
            label = f"Xid {x}" if x is not None else ("fallen off the bus" if "fallen" in str(e.get("summary"))
                                                      else "driver failed to recover")
            seen[(e.get("ts"), label)] = label
    return sorted((_ts(t), label) for (t, label) in seen if _ts(t) > 0)


def _clusters(marks: list[tuple[float, str]], within: float) -> list[tuple[float, str]]:
    out: list[tuple[float, list[str]]] = []
    for t, label in marks:
        if out and t - out[-1][0] <= within:
            if label not in out[-1][1]:
                out[-1][1].append(label)
        else:
            out.append((t, [label]))
    return [(t, ", ".join(labels)) for t, labels in out]


def _xid_codes(inc: Any) -> list[int]:
    codes: set[int] = set()
    for a in inc.alerts:
        ev = a.get("evidence") or {}
        codes |= {int(k) for k in (ev.get("xid_counts") or {}) if str(k).isdigit()}
        for e in ev.get("timeline") or []:
            x = (e.get("data") or {}).get("xid")
            if isinstance(x, int):
                codes.add(x)
    return sorted(codes)


def _repair_rows(rows: list[dict]) -> str:
    """The time to repair per stage (IncidentBook.repair) as table rows."""
    def secs(v: Any) -> str:
        return "-" if v is None else f"{v:g} s"

    return "".join(f"<tr><td>{html.escape(str(r['stage']))}</td><td>{html.escape(str(r['at']))}</td>"
                   f"<td>{secs(r['seconds'])}</td><td>{secs(r['since_detection'])}</td></tr>" for r in rows)


def render_report(book: Any, inc: Any) -> str:
    e = html.escape
    data = book.incident_json(inc)
    samples = book.samples.get(data["gpu_uuid"] or "", [])
    svg = _chart_svg(book, inc, samples)
    outcomes: dict[str, str] = {}
    for s in data["steps"]:
        outcomes[str(s["action"])] = s["outcome"]
    recovery = []
    for n, (text, actions) in enumerate(RECOVERY_ORDER, 1):
        mine = [a for a in actions if a in outcomes]
        if n == 1:
            status = "shown below (evidence)"
        elif not mine:
            if n == 5:
                status = "done: the incident resolved" if data["state"] == "resolved" else "left"
            else:
                status = "not planned for this incident" if data["state"] == "resolved" or n < 4 else "not needed so far"
        else:
            status = ", ".join(f"{a} {outcomes[a]}" for a in mine)
        cls = "done" if (mine and all(outcomes[a] == "succeeded" for a in mine)) or status.startswith("done") \
            else ("left" if status == "left" else "")
        recovery.append(f"<li class='{cls}'>{e(text)}<br><b>{e(status)}</b></li>")
    xid_rows = []
    for code in _xid_codes(inc):
        info = lookup(code)
        xid_rows.append(f"<tr><td>{code}</td><td>{e(info.name)}</td><td>{e(info.resolution)}</td>"
                        f"<td>{e(info.investigatory or '-')}</td><td>{e(info.description or '-')}</td></tr>")
    rows = "".join(f"<tr><td>{e(str(i['ts']))}</td><td>{e(i['what'])}</td><td>{e(str(i['text']))}</td></tr>"
                   for i in data["timeline"])
    steps = "".join(f"<li>{e(str(s))}</li>" for s in data["recommended_steps"])
    rule = data.get("rule")
    # the rule that made the verdict, by its id (docs/architecture.md "Decision index"), and its facts
    rule_html = ("<p>No rule named (an alert of an earlier contract version).</p>" if not rule else
                 f"<p><code>{e(str(rule['id']))}</code>: {e(str(rule['name']))}</p>"
                 + "<table id='rule-facts'><tr><th>fact</th><th>value</th></tr>"
                 + "".join(f"<tr><td>{e(str(k))}</td><td>{e(str(v))}</td></tr>" for k, v in rule["facts"].items())
                 + "</table>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>xidstream incident {e(inc.id)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; max-width: 1150px; }}
h1 {{ font-size: 1.3em; }} h2 {{ font-size: 1.1em; margin-top: 1.5em; }}
table {{ border-collapse: collapse; width: 100%; font-size: 0.85em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; text-align: left; }}
th {{ background: #f0f0f0; }} li.done b {{ color: #2ca02c; }} li.left b {{ color: #d62728; }}
.meta {{ color: #555; }} #chart svg {{ width: 100%; height: auto; }}
</style></head><body>
<h1>{e(str(data['classification']))} on {e(str(data['node']))} GPU {e(str(data['gpu_index']))}</h1>
<p class="meta">incident {e(inc.id)} &middot; GPU {e(str(data['gpu_uuid']))} &middot; {e(str(data['state']))} &middot;
opened {e(data['opened'])} &middot; {len(samples)} samples charted</p>
<div id="chart">{svg}</div>
<h2>Rule</h2>
<div id="rule">{rule_html}</div>
<h2>Recovery order (incident note) and what was done</h2>
<ol id="recovery">{''.join(recovery)}</ol>
<h2>Time to repair, per stage</h2>
<table id="repair"><tr><th>stage</th><th>reached</th><th>took (from the stage before)</th><th>since detection</th></tr>
{_repair_rows(data['repair']) or '<tr><td colspan="4">no step of a repair answered yet</td></tr>'}</table>
<h2>Evidence and steps, in time order</h2>
<table id="evidence"><tr><th>time</th><th>what</th><th>detail</th></tr>{rows}</table>
<h2>NVIDIA's text for each Xid</h2>
<table id="xids"><tr><th>Xid</th><th>name</th><th>immediate action</th><th>investigatory action</th><th>description</th></tr>
{''.join(xid_rows) or '<tr><td colspan="5">no Xid in the evidence</td></tr>'}</table>
<h2>Recommended steps (the alert's words)</h2>
<ol>{steps}</ol>
</body></html>
"""


def write_report(book: Any, inc: Any, path: str | Path) -> None:
    Path(path).write_text(render_report(book, inc), encoding="utf-8")
