"""streams/faust_fast.py cuts into faust-streaming's and aiokafka-driver's internals: the installed
versions and the source of every function it overrides or mirrors must be the ones it was written
against, or this fails naming what changed (re-read those functions against the module, then
update WRITTEN_FOR / MIRRORED: docs/development.md)."""

from __future__ import annotations

import streams.faust_fast as ff


def test_the_installed_faust_is_the_one_the_cuts_were_written_for():
    drift = ff.faust_drift()
    assert drift == [], "faust internals changed under streams/faust_fast.py:\n  " + "\n  ".join(drift)


def test_a_changed_function_a_new_version_and_a_lost_attribute_are_each_named(monkeypatch):
    path = "faust.transport.consumer.Consumer._drain_messages"
    monkeypatch.setitem(ff.MIRRORED, path, "000000000000")
    monkeypatch.setitem(ff.MIRRORED, "faust.transport.consumer.Consumer._gone_in_0_16", "111111111111")
    monkeypatch.setitem(ff.WRITTEN_FOR, "faust-streaming", "0.15.0")
    monkeypatch.setattr(ff, "CONSUMER_ATTRIBUTES", ("_read_offset", "_no_such_attribute"))
    drift = ff.faust_drift()
    assert drift[0].startswith("faust-streaming is 0.15.") and drift[0].endswith("written for 0.15.0")
    assert any(d.startswith(f"{path} changed (source digest ") and d.endswith("written against 000000000000)")
               for d in drift)
    assert any(d.startswith("faust.transport.consumer.Consumer._gone_in_0_16 is gone (AttributeError") for d in drift)
    assert drift[-1] == "faust's Consumer no longer uses self._no_such_attribute"
    assert len(drift) == 4
