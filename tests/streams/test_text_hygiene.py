"""Text a node chose (a result's `detail`, a process name from a kernel line) is signed into a
command's `reason`, then written into Node annotations, Events and kured's sentinel: it arrives
there as one bounded plain line. On 1484261 a result's detail went into the next rung's reason
as it came: newlines, terminal escapes and any length."""

from __future__ import annotations

import pytest

from xidstream.schemas import Action
from xidstream.schemas.base import plain_text
from xidstream.schemas.limits import DETAIL_MAX
from tests.streams.builders import result, run, wedge


@pytest.mark.parametrize("text, expected", [
    ("GPU reset failed", "GPU reset failed"),
    ("line one\nREBOOT now\r", "line one\\x0aREBOOT now\\x0d"),
    ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),
    ("safe\u202etxt.exe", "safe\\u202etxt.exe"),
    ("tab\tnul\x00del\x7f", "tab\\x09nul\\x00del\\x7f"),
    ("", ""),
    (None, ""),
])
def test_plain_text_escapes_what_changes_how_text_reads(text, expected):
    assert plain_text(text) == expected


@pytest.mark.parametrize("limit", [20, 500, 1024])
def test_plain_text_is_bounded_and_says_it_was_cut(limit):
    out = plain_text("x" * 10 * limit + "\n", limit)
    assert len(out) == limit and out.endswith(f"[cut at {limit}]")
    assert plain_text("y" * limit, limit) == "y" * limit  # exactly at the bound: untouched


def test_a_results_detail_reaches_the_next_rungs_reason_as_one_bounded_line():
    hostile = "busy\nxidstream 2026-12-01 incident forged command forged: REBOOT\x1b[0m"
    hostile += "A" * (DETAIL_MAX - len(hostile))  # as long as a result's detail may be (schemas.limits)
    engine = run(wedge() + [result(400, "RESET_GPU", "failed", detail=hostile)])
    (reboot,) = [c for c in engine.commands if c.action == Action.REBOOT_NODE]
    assert "\n" not in reboot.reason and "\x1b" not in reboot.reason
    assert len(reboot.reason) <= 500 and "GPU reset failed" in reboot.reason


@pytest.mark.parametrize("index, word", [(1, "1"), (0, "0"), (None, "<index>")])
def test_the_reset_step_is_a_line_a_shell_takes_word_for_word(index, word):
    """A recommended step that is a command line (nvidia-smi --gpu-reset -i N) has its index
    shell-quoted: an unresolved GPU's placeholder, unquoted, was a redirection (`<index>`)."""
    import shlex

    from xidstream.streams.evidence import GpuState
    from xidstream.streams.render import _steps_text
    from tests.shell import interpreted

    [text] = _steps_text(GpuState(key="k", node="node-a", gpu_index=index), [Action.RESET_GPU.value])
    line = text.split(": ", 1)[1].split(". Never", 1)[0]
    assert shlex.split(line) == ["nvidia-smi", "--gpu-reset", "-i", word] and interpreted(line) == ""
