"""The trend summary's arithmetic, exactly: where an increment lands among the 24 intervals, what
the window ending at a moment holds, and how NVLink CRC counters are summed. The first mutation
run over `streams/degrade.py` (2026-12-04, judged by tests/streams/test_degrade*.py and
test_storms*.py) left mutants of `_add`, `_window` and `_crc` alive: an index off by the age, a
reading exactly one window old counted into the newest interval, a data-only CRC count read as
one more. Each test below fails on one of them."""

from __future__ import annotations

from xidstream.schemas.limits import INT64_MAX
from xidstream.schemas.models import GpuCounters, NvLinkCounters
from xidstream.streams.degrade import INTERVALS, _add, _crc, _links, _window
from tests.streams.builders import GPU, NODE, PCI, at

W = 3600.0  # the interval's width at the default day


def _summary() -> dict:
    return {"bw": W, "b": None, "n": [0] * INTERVALS}


def test_the_first_increment_is_the_newest_interval_and_sets_the_window():
    t = _summary()
    t["n"][0] = 99  # what a row held before its first reading in this window: cleared
    _add(t, 10 * W + 5, 3)
    assert t["b"] == 10 and t["n"] == [0] * (INTERVALS - 1) + [3]
    _add(t, 10 * W + 3599, 4)  # same interval
    assert t["b"] == 10 and t["n"][-1] == 7 and sum(t["n"]) == 7


def test_a_later_interval_moves_the_window_and_a_late_reading_lands_by_its_age():
    t = _summary()
    _add(t, 10 * W, 5)
    _add(t, 12 * W, 2)  # two intervals on: the 5 is now two from the newest
    assert t["b"] == 12 and t["n"][-3:] == [5, 0, 2] and sum(t["n"]) == 7
    _add(t, 11 * W + 7, 1)  # a reading read late, one interval old: its own interval
    assert t["b"] == 12 and t["n"][-3:] == [5, 1, 2]
    _add(t, 12 * W - (INTERVALS - 1) * W, 6)  # the oldest interval the window still holds
    assert t["n"][0] == 6 and sum(t["n"]) == 14


def test_a_reading_a_whole_window_old_is_not_counted_anywhere():
    t = _summary()
    _add(t, 30 * W, 1)
    before = list(t["n"])
    _add(t, (30 - INTERVALS) * W, 50)  # exactly INTERVALS old: outside
    _add(t, (30 - INTERVALS - 7) * W, 50)  # older still
    assert t["n"] == before and t["b"] == 30


def test_a_jump_past_the_window_clears_it_and_a_zero_increment_changes_nothing():
    t = _summary()
    for h in range(5):
        _add(t, h * W, 1)
    _add(t, (4 + INTERVALS + 3) * W, 0)  # a reading with nothing new, long after
    assert t["b"] == 4 + INTERVALS + 3 and t["n"] == [0] * INTERVALS
    _add(t, (4 + INTERVALS + 3) * W, 0)
    assert t["n"] == [0] * INTERVALS


def test_an_interval_is_bounded_to_int64():
    t = _summary()
    _add(t, 0.0, INT64_MAX - 1)
    _add(t, 1.0, 5)
    assert t["n"][-1] == INT64_MAX


def test_the_window_ending_at_a_moment_leaves_out_the_intervals_it_has_passed():
    assert _window(_summary(), 5 * W) == (0, 0, 0)
    t = _summary()
    for h, inc in ((0, 4), (1, 0), (2, 9), (3, 1)):
        _add(t, (100 + h) * W, inc)
    # at the newest interval: all of it (4 + 9 + 1, three intervals rose, the largest 9)
    assert _window(t, 103 * W + 10) == (14, 3, 9)
    # a moment before it (a late reading): still all of it
    assert _window(t, 101 * W) == (14, 3, 9)
    # INTERVALS - 2 intervals later the oldest two (4, 0) have left the window
    assert _window(t, (103 + INTERVALS - 2) * W) == (10, 2, 9)
    assert _window(t, (103 + INTERVALS) * W) == (0, 0, 0)


def test_one_interval_on_the_oldest_interval_leaves_the_window():
    t = _summary()
    _add(t, 200 * W - (INTERVALS - 1) * W, 7)  # the oldest interval of the window ending at 200
    _add(t, 200 * W, 1)
    assert _window(t, 200 * W) == (8, 2, 7)
    assert _window(t, 201 * W) == (1, 1, 1)  # one interval on: the 7 is a day old


def _counters(links: list[NvLinkCounters] | None) -> GpuCounters:
    return GpuCounters(ts=at(0), node=NODE, gpu_uuid=GPU, gpu_index=1, pci_bus_id=PCI, nvlinks=links)


def test_crc_errors_are_flit_plus_data_over_the_links_and_name_the_worst_link():
    assert _crc(_counters(None)) == (None, None)
    assert _crc(_counters([NvLinkCounters(link=0)])) == (None, None)
    both = _counters([NvLinkCounters(link=0, crc_flit_errors=5, crc_data_errors=1),
                      NvLinkCounters(link=3, crc_flit_errors=2, crc_data_errors=40)])
    assert _crc(both) == (48, 0)  # the link named is the flit counters' worst
    data_only = _counters([NvLinkCounters(link=2, crc_data_errors=3), NvLinkCounters(link=5, crc_data_errors=8)])
    assert _crc(data_only) == (11, 5)
    flit_only = _counters([NvLinkCounters(link=4, crc_flit_errors=7)])
    assert _crc(flit_only) == (7, 4)
    huge = _counters([NvLinkCounters(link=i, crc_flit_errors=INT64_MAX, crc_data_errors=INT64_MAX) for i in range(3)])
    assert _crc(huge)[0] == INT64_MAX


def test_a_links_sum_skips_unread_links_and_names_the_one_with_most():
    read = _links("recovery_errors")
    c = _counters([NvLinkCounters(link=1, recovery_errors=4), NvLinkCounters(link=2),
                   NvLinkCounters(link=6, recovery_errors=9), NvLinkCounters(link=7, recovery_errors=0)])
    assert read(c) == (13, 6)
