"""`xidstream incident ID --html` (xidstream/report.py): the motivating incident's report from what
the collectors and the real fold produce, checked as HTML and as pixels in a real headless
Chromium (Debian's; `make chromium` installs it): the chart must be drawn, not only written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import orjson
import pytest

from xidstream.collectors.scenario import ScenarioRunner
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import load_scenario
from xidstream.schemas.codec import to_dict
from xidstream.schemas.models import GpuSample
from xidstream.schemas.xid_catalog import lookup
from xidstream.streams.engine import Engine
from xidstream.incidents import IncidentBook
from tests.tools import find_tool
from xidstream.report import RECOVERY_ORDER, render_report

ROOT = Path(__file__).resolve().parents[1]


def motivating_book() -> tuple[IncidentBook, object]:
    sink = MemorySink()
    ScenarioRunner(load_scenario(ROOT / "scenarios" / "motivating-incident.yaml"), sink).run()
    engine = Engine()
    for r in sink.records:
        engine.process(r)
    book = IncidentBook()
    for r in [*engine.alerts, *engine.commands, *(s for s in sink.records if isinstance(s, GpuSample))]:
        book.add(orjson.loads(orjson.dumps(to_dict(r))))
    [inc] = book.open_incidents()
    return book, inc


def test_the_report_is_one_self_contained_page_with_chart_evidence_xids_and_recovery_order():
    book, inc = motivating_book()
    page = render_report(book, inc)
    # self-contained: nothing is loaded at view time (the chart's own #fragment references only)
    assert "<script" not in page and not re.search(r"""\b(src|href)\s*=\s*["'](?!#)""", page)
    assert not re.search(r"url\(\s*['\"]?(?!#)", page)
    assert page.count("<svg") == 1 and "GPU_WEDGED on gpu-node-7 GPU 1" in page
    assert f"{len(book.samples[inc.last['gpu_uuid']])} samples charted" in page
    # every timeline item is a row of the evidence table
    rows = re.search(r"<table id=\"evidence\">(.*?)</table>", page, re.S).group(1)
    assert rows.count("<tr>") - 1 == len(book.timeline(inc))
    # NVIDIA's catalog text for each Xid of the incident (13, 31, 43)
    xids = re.search(r"<table id=\"xids\">(.*?)</table>", page, re.S).group(1)
    for code in (13, 31, 43):
        assert f"<td>{code}</td><td>{lookup(code).name}</td><td>{lookup(code).resolution}</td>" in xids
    # the incident note's recovery order, with what was commanded and its outcome
    recovery = re.search(r"<ol id=\"recovery\">(.*?)</ol>", page, re.S).group(1)
    assert recovery.count("<li") == len(RECOVERY_ORDER) == 5
    assert "CORDON_NODE no result yet, DRAIN_NODE no result yet" in recovery and "RESET_GPU no result yet" in recovery


@pytest.fixture(scope="module")
def chromium() -> str:
    return find_tool("XIDSTREAM_CHROMIUM", names=("chromium", "chromium-browser"),
                     hint="run `make chromium` (apt-get install chromium, as root)")


def _colour_pixels(img, rgb: tuple[int, int, int], tol: int = 40) -> int:
    raw = img.tobytes()  # RGB
    return sum(1 for i in range(0, len(raw), 3)
               if abs(raw[i] - rgb[0]) <= tol and abs(raw[i + 1] - rgb[1]) <= tol and abs(raw[i + 2] - rgb[2]) <= tol)


def test_the_motivating_incidents_report_renders_its_chart_in_headless_chromium(chromium, tmp_path):
    from PIL import Image

    book, inc = motivating_book()
    page = tmp_path / "incident.html"
    page.write_text(render_report(book, inc))
    shot = tmp_path / "shot.png"
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,1000", f"--screenshot={shot}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.exists(), proc.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1000)
    # the chart's three series and the Xid markers were drawn (matplotlib's colours of report.py)
    assert _colour_pixels(img, (0x1F, 0x77, 0xB4)) > 500, "no utilization line"   # C0 blue
    assert _colour_pixels(img, (0x94, 0x67, 0xBD)) > 300, "no memory line"        # purple
    assert _colour_pixels(img, (0x8C, 0x56, 0x4B)) > 300, "no power line"         # brown
    assert _colour_pixels(img, (0xD6, 0x27, 0x28)) > 100, "no Xid markers"        # red
    # the same page without its chart has none of the series' colour: the check sees the chart
    bare = tmp_path / "bare.html"
    bare.write_text(re.sub(r"<svg.*</svg>", "", page.read_text(), flags=re.S))
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,1000", f"--screenshot={tmp_path / 'bare.png'}", bare.as_uri()],
                   capture_output=True, timeout=120)
    assert _colour_pixels(Image.open(tmp_path / "bare.png").convert("RGB"), (0x94, 0x67, 0xBD)) == 0


def test_the_report_shows_the_time_to_repair_per_stage():
    from tests.test_incidents import _repaired_book

    book, inc = _repaired_book()
    page = render_report(book, inc)
    table = re.search(r"<table id=\"repair\">(.*?)</table>", page, re.S).group(1)
    rows = re.findall(r"<tr><td>(\w+)</td><td>[^<]+</td><td>([^<]+)</td><td>([^<]+)</td></tr>", table)
    assert [r[0] for r in rows] == ["detection", "cordon", "drained", "operands_paused", "reset", "verified",
                                    "operands_back", "uncordon"]
    assert rows[0][1:] == ("-", "-") and rows[4][1] == "10 s" and rows[-1][1] == "695 s"
    # before any step of a repair was answered the table says so
    empty = render_report(*motivating_book())
    assert "no step of a repair answered yet" in re.search(r"<table id=\"repair\">(.*?)</table>", empty, re.S).group(1)
