"""streams/faust_fast.py cuts into faust-streaming's and aiokafka-driver's internals: the installed
versions and the source of every function it overrides or mirrors must be the ones it was written
against, or this fails naming what changed (re-read those functions against the module, then
update WRITTEN_FOR / MIRRORED: docs/development.md)."""

from __future__ import annotations

import xidstream.streams.faust_fast as ff


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


def test_the_dependency_ranges_admit_only_the_minors_the_cuts_were_written_for():
    """faust-streaming was pinned to its minor and aiokafka was not (>=0.13, the mends written
    against 0.14): pip could pick a minor whose internals the cuts never saw. Both ranges in
    pyproject.toml now admit the WRITTEN_FOR version and no other minor."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {Requirement(d).name: Requirement(d) for d in deps}
    for name, written in ff.WRITTEN_FOR.items():
        v = Version(written)
        spec = reqs[name].specifier
        assert spec.contains(written), (name, str(spec))
        assert not spec.contains(f"{v.major}.{v.minor + 1}.0"), (name, str(spec), "admits the next minor")
        assert not spec.contains(f"{v.major}.{v.minor - 1}.99"), (name, str(spec), "admits the previous minor")
