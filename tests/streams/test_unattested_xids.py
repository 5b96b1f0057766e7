"""An Xid that only text names (`source` file: a log file or stdin) is never a reason to act.

A tenant's crash report becomes a driver line in text: the syslog(2) interface splits a record at a
newline in a file name and prefixes the rest like any kernel line
(tests/collectors/test_kernel_newline_forgery.py). So the fold takes an Xid as the driver's only
where a source the kernel or the driver vouches for saw it (schemas.vocab.ATTESTED_XID_SOURCES):
a kmsg or journal record, or an NVML event.
"""

from __future__ import annotations

import pytest

from xidstream.schemas import Action, Classification
from xidstream.schemas.vocab import ATTESTED_XID_SOURCES, XidSource
from xidstream.streams.routing import fan_out
from tests.streams.builders import inventory, procs, run, sample, wedge, workload, xid

NODE_LEVEL = {Action.CORDON_NODE, Action.DRAIN_NODE, Action.REBOOT_NODE, Action.REPLACE_NODE}


def from_(sources: list[str], rec):
    return rec.model_copy(update={"source": XidSource(sources[0]), "sources": [XidSource(s) for s in sources]})


def test_only_text_is_unattested():
    assert ATTESTED_XID_SOURCES == {XidSource.kmsg, XidSource.journal, XidSource.nvml}
    assert not from_(["file"], xid(0, 79)).attested
    for sources in (["kmsg"], ["journal"], ["nvml"], ["file", "nvml"], ["kmsg", "nvml"]):
        assert from_(sources, xid(0, 79)).attested, sources
    # a record without `sources` (before they were listed) goes by `source`
    assert xid(0, 79).model_copy(update={"sources": []}).attested
    assert not xid(0, 79).model_copy(update={"source": XidSource.file, "sources": []}).attested


@pytest.mark.parametrize("code", [79, 48, 74, 119, 95])
def test_a_hardware_xid_from_text_is_on_the_timeline_and_nothing_else(code):
    base = [inventory(), sample(0), procs(0)]
    e = run(base + [from_(["file"], xid(10, code, pid=None)), sample(11), procs(11)])
    assert e.commands == [] and e.alerts == []
    (state,) = e.states.values()
    (note,) = [n for n in state.pending_notes if n["kind"] == "xid"]
    assert note["summary"].startswith("(unattested: read from text)")
    assert note["data"]["unattested"] is True and note["data"]["sources"] == ["file"]
    # The same line merged with the driver's NVML event for the same GPU and code is believed.
    e = run(base + [from_(["file", "nvml"], xid(10, code, pid=None))])
    assert e.alerts and e.alerts[0].classification == Classification.GPU_HARDWARE_FAULT


@pytest.mark.parametrize("kind", ["fallen_off_bus", "recovery_failure"])
def test_a_driver_record_of_another_kind_from_text_moves_nothing(kind):
    rec = from_(["file"], xid(10, 79, pid=None, kind=kind)).model_copy(update={"xid": None})
    e = run([inventory(), sample(0), procs(0), rec] + [x for t in range(11, 200, 5)
                                                        for x in (sample(t, util=100, mem=0), procs(t))])
    assert not NODE_LEVEL & {c.action for c in e.commands}
    assert Action.RESET_GPU not in {c.action for c in e.commands}
    assert Classification.GPU_HARDWARE_FAULT not in {a.classification for a in e.alerts}
    assert Classification.GPU_WEDGED not in {a.classification for a in e.alerts}


def test_a_wedge_whose_xids_only_text_names_is_no_wedge():
    records = [from_(["file"], r) if r.__class__.__name__ == "XidEvent" else r for r in wedge()]
    e = run(records)
    assert Classification.GPU_WEDGED not in {a.classification for a in e.alerts}
    assert Classification.APP_FAULT not in {a.classification for a in e.alerts}
    assert not NODE_LEVEL & {c.action for c in e.commands}
    # the same records from /dev/kmsg: the wedge and its reset plan (test_classify's motivating incident)
    e = run(wedge())
    assert Classification.GPU_WEDGED in {a.classification for a in e.alerts}


def test_application_faults_from_text_count_toward_no_quarantine():
    e = run([inventory(), sample(0)] + [from_(["file"], xid(10 + 100 * i, 13, pid=1000 + i)) for i in range(6)])
    assert e.alerts == [] and e.commands == []


def test_an_application_fault_from_text_is_not_a_jobs_fault_for_the_storms():
    e = run([inventory(), sample(0), procs(0, 4242),
             workload(1, event="started").model_copy(update={"job": "ml/train"})])
    (state,) = e.states.values()
    assert state.job == "ml/train"
    to_fleet, _ = fan_out(state, from_(["file"], xid(10, 13)), [])
    assert [m for m in to_fleet if m["kind"] == "job_fault"] == []
    to_fleet, _ = fan_out(state, xid(10, 13), [])
    assert [m["kind"] for m in to_fleet if m["kind"] == "job_fault"] == ["job_fault"]
