"""Degradation before the fault: trends of a GPU's error counters (`gpu.counters`), as a pure fold.

Every GPU-health tool reacts to the Xid; the evidence that one is coming is often already in NVML
and nobody trends it: one GB200 NVLink link logged 505 lifetime link-recovery events, still
rising, five days before it failed with Xid 149 (marin-community/marin#9086); a rising
single-bit ECC rate and pages pending retirement precede uncorrectable errors (NVIDIA's GPU
memory error management guide). This module keeps, per GPU and per counter, a fixed-size summary
(the increments of the last `degrade_window_s` in 24 equal intervals) and says when one rises
steadily: its rate over the window, leaving out the window's largest interval, at or above the
policy's limit AND rising in at least `degrade_min_intervals` different intervals. Both are what
tell a degradation from healthy noise: a counter that jumps once (a link retrained at boot, a cable
reseated) puts its jump in one interval, however large.

Step changes are said at once: a PCIe link running narrower than its maximum width on two
readings in a row (the generation drops at idle to save power; the width does not), and a page
retirement pending (it takes effect at the next driver reload).

What comes out is a finding, never a plan: `xidstream.streams.classify` raises GPU_DEGRADING (warning) with
RECORD, or QUARANTINE_GPU where the policy asks for it (`degrade_quarantine`), and never a
node-level action from a trend alone. A node can forge its own counters (threat model: a node
speaks only for its own GPUs, transport.identity): the worst it gets is a warning, or a quarantine
of its own GPU under that policy.

Counters are cumulative, so the fold needs no order: a reading older than the newest one seen is
skipped (the newer one already counts its increments), and a reading below the last one (the
driver reloaded: the volatile counters restart at 0) starts a new baseline with no increment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from xidstream.schemas.limits import INT64_MAX
from xidstream.schemas.models import GpuCounters
from xidstream.streams.policy import Policy

__all__ = ["INTERVALS", "TRENDS", "Finding", "fold_counters", "trend_summary", "degrading_now"]

INTERVALS = 24  # the window in 24 intervals: an hour each at the default day

# NVML's clock event reasons that are the hardware's, not the workload's or the power cap's
# (nvml.h: clocksEventReasonHwSlowdown 0x8, HwThermalSlowdown 0x40, HwPowerBrakeSlowdown 0x80).
# Idle (0x1), the applications clocks setting (0x2) and the software power cap (0x4) are normal.
HW_SLOWDOWN_MASK = 0x8 | 0x40 | 0x80


def _links(field: str) -> Callable[[GpuCounters], tuple[int | None, int | None]]:
    def read(c: GpuCounters) -> tuple[int | None, int | None]:
        """(the sum over the GPU's links, the link with the largest count) or (None, None)."""
        values = [(getattr(link, field), link.link) for link in c.nvlinks or () if getattr(link, field) is not None]
        if not values:
            return None, None
        # each value is bounded by the schema, their sum is not: kept within int64, or the row
        # (JSON, then the changelog) fails to serialize and the worker crash-loops on it (review)
        return min(INT64_MAX, sum(v for v, _ in values)), max(values)[1]
    return read


def _crc(c: GpuCounters) -> tuple[int | None, int | None]:
    flit, link_f = _links("crc_flit_errors")(c)
    data, link_d = _links("crc_data_errors")(c)
    if flit is None and data is None:
        return None, None
    return min(INT64_MAX, (flit or 0) + (data or 0)), link_f if link_f is not None else link_d


def _field(name: str) -> Callable[[GpuCounters], tuple[int | None, int | None]]:
    return lambda c: (getattr(c, name), None)


@dataclass(frozen=True)
class Trend:
    title: str  # what the alert calls it
    limit: str  # the policy field: the rate per hour at or above which it warns (0: off)
    read: Callable[[GpuCounters], tuple[int | None, int | None]]


# name -> how to read it. A "counter" of HW slowdowns is made here: one per reading that had a
# hardware slowdown bit set, so a GPU throttled by its own hardware for a good part of the day
# trends like a counter (at the default 60 s cadence, 60 readings an hour).
TRENDS: dict[str, Trend] = {
    "nvlink_recovery": Trend("NVLink link recoveries (NVML_NVLINK_ERROR_DL_RECOVERY)", "degrade_nvlink_recovery_per_h",
                             _links("recovery_errors")),
    "nvlink_replay": Trend("NVLink data-link replays (NVML_NVLINK_ERROR_DL_REPLAY)", "degrade_nvlink_replay_per_h",
                           _links("replay_errors")),
    "nvlink_crc": Trend("NVLink CRC errors (flit and data)", "degrade_nvlink_crc_per_h", _crc),
    "ecc_sbe": Trend("corrected (single-bit) ECC errors", "degrade_ecc_sbe_per_h", _field("ecc_corrected_volatile")),
    "pcie_replay": Trend("PCIe replays", "degrade_pcie_replay_per_h", _field("pcie_replay_count")),
    "hw_slowdown": Trend("readings with a hardware clock slowdown (HW slowdown, HW thermal, power brake)",
                         "degrade_hw_slowdown_per_h", lambda c: (None, None)),
    # not a counter of gpu.counters: gaps in the GPU's samples while its collector kept publishing
    # its process lists (`note_gap`)
    "sample_gaps": Trend("gaps in the GPU's samples while its collector kept publishing (telemetry silence)",
                         "degrade_sample_gaps_per_h", lambda c: (None, None)),
}


@dataclass(frozen=True)
class Finding:
    counter: str
    summary: str
    data: dict


def _trend(trends: dict, name: str, width: float) -> dict:
    t = trends.get(name)
    if t is None or t.get("bw") != width:
        # A new counter, or a policy whose window changed: its intervals start over.
        t = trends[name] = {"v": None, "t": None, "b": None, "n": [0] * INTERVALS, "bw": width, "w": None}
    return t


def _add(t: dict, ts: float, inc: int) -> None:
    """Count `inc` in the interval of `ts`, moving the window forward when `ts` is past it."""
    width = t["bw"]
    slot = int(ts // width)
    base = t["b"]
    n = t["n"]
    if base is None or slot > base:
        shift = INTERVALS if base is None else min(slot - base, INTERVALS)
        if shift:
            n[:] = n[shift:] + [0] * shift
        t["b"] = base = slot
    age = base - slot
    if inc and 0 <= age < INTERVALS:
        # bounded like the counters: readings that reset and jump to INT64_MAX again within an
        # interval would add up past it
        n[INTERVALS - 1 - age] = min(INT64_MAX, n[INTERVALS - 1 - age] + inc)


def _window(t: dict, ts: float) -> tuple[int, int, int]:
    """(increments, intervals with an increase, the largest interval's increments) within the
    window that ends at `ts`."""
    if t["b"] is None:
        return 0, 0, 0
    age = int(ts // t["bw"]) - t["b"]  # intervals since the newest one counted
    kept = t["n"][max(0, age):] if age > 0 else t["n"]
    return sum(kept), sum(1 for v in kept if v), max(kept, default=0)


def _rising(count: int, intervals: int, top: int, limit: float, policy: Policy) -> float | None:
    """The rate per hour that counts, when the trend is at or above `limit`; else None.

    The rate leaves out the window's largest interval: a counter that jumped once by thousands
    (a link retrained, a cable reseated) on a GPU whose counter also ticks now and then would
    otherwise pass both tests, the rate by the jump and the intervals by the ticks (found by
    bench/degrade_eval.py: 5 healthy GPUs warned in 810 GPU-days). A steady rise loses a 24th."""
    if intervals < policy.degrade_min_intervals:
        return None
    rate = (count - top) / (policy.degrade_window_s / 3600 * (INTERVALS - 1) / INTERVALS)
    return rate if rate >= limit else None


def _fold(t: dict, ts: float, value: int | None) -> None:
    if value is None:
        return
    last, last_ts = t["v"], t["t"]
    if last_ts is not None and ts <= last_ts:
        return  # older than the newest reading: the newest already counts its increments
    inc = value - last if last is not None and value >= last else 0
    t["v"], t["t"] = value, ts
    _add(t, ts, inc)


def fold_counters(trends: dict, c: GpuCounters, ts: float, policy: Policy, where: str) -> list[Finding]:
    """Fold one counters reading into `trends` (the GPU row's dict, changed in place); the findings
    that are new: a trend at or above its limit not said within `degrade_realert_s`, a step."""
    width = policy.degrade_window_s / INTERVALS
    found: list[Finding] = []
    for name, spec in TRENDS.items():
        limit = getattr(policy, spec.limit)
        if name == "sample_gaps":
            continue
        if name == "hw_slowdown":
            if c.clock_event_reasons is None:
                continue
            t = _trend(trends, name, width)
            if t["t"] is not None and ts <= t["t"]:
                continue
            t["t"] = ts
            _add(t, ts, 1 if c.clock_event_reasons & HW_SLOWDOWN_MASK else 0)
            value, link = None, None
        else:
            value, link = spec.read(c)
            if value is None:
                continue
            t = _trend(trends, name, width)
            _fold(t, ts, value)
        f = _warn(t, name, spec, limit, ts, policy, where, value, link)
        if f is not None:
            found.append(f)
    found.extend(_steps(trends, c, ts, policy, where))
    return found


def _warn(t: dict, name: str, spec: Trend, limit: float, ts: float, policy: Policy, where: str,
          value: int | None = None, link: int | None = None) -> Finding | None:
    """The finding of trend `t` at `ts`, when it is at or above its limit and was not said within
    `degrade_realert_s`; None otherwise."""
    if limit <= 0:
        return None
    count, intervals, top = _window(t, ts)
    rate = _rising(count, intervals, top, limit, policy)
    if rate is None or (t["w"] is not None and ts - t["w"] < policy.degrade_realert_s):
        return None
    t["w"] = ts
    hours = policy.degrade_window_s / 3600
    data = {"counter": name, "count": count, "rate_per_h": round(rate, 3), "limit_per_h": limit,
            "intervals": intervals, "of_intervals": INTERVALS, "largest_interval": top,
            "window_s": policy.degrade_window_s, "history": list(t["n"])}
    now = ""
    if value is not None:
        data["value"] = value
        now = f"; {value} since the driver loaded"
    if link is not None:
        data["link"] = link
        now += f", the most on link {link}"
    return Finding(name, f"{spec.title} rising on {where}: {count} in the last {hours:g} h "
                         f"({rate:.2f}/h without its largest interval, limit {limit:g}/h), rising in {intervals} "
                         f"of {INTERVALS} intervals{now}", data)


def note_gap(trends: dict, ts: float, gap: float, policy: Policy, where: str) -> Finding | None:
    """A sample at `ts` after `gap` s without one, while the GPU's process lists kept coming (the
    caller checks): one more gap in the `sample_gaps` trend; the finding when it warns.

    A collector down or restarting stops the process lists too and is not counted; a GPU whose
    NVML reads stall or fail now and then is. Missing samples preceded fallen-off-bus incidents in
    a published cluster study (GWDG, arXiv 2603.28781)."""
    t = _trend(trends, "sample_gaps", policy.degrade_window_s / INTERVALS)
    t["t"] = ts if t["t"] is None else max(t["t"], ts)
    _add(t, ts, 1)
    t["v"] = min(INT64_MAX, (t["v"] or 0) + 1)
    f = _warn(t, "sample_gaps", TRENDS["sample_gaps"], policy.degrade_sample_gaps_per_h, ts, policy, where)
    if f is not None:
        f.data["last_gap_s"] = round(gap, 1)
    return f


def _steps(trends: dict, c: GpuCounters, ts: float, policy: Policy, where: str) -> list[Finding]:
    out: list[Finding] = []
    cur, top = c.pcie_link_width_current, c.pcie_link_width_max
    if cur is not None and top:
        s = trends.setdefault("pcie_width", {"low": 0, "t": None, "w": None})
        if s["t"] is None or ts > s["t"]:
            s["t"] = ts
            s["low"] = s["low"] + 1 if cur < top else 0
            if s["low"] == 2 and (s["w"] is None or ts - s["w"] >= policy.degrade_realert_s):
                s["w"] = ts
                out.append(Finding("pcie_width", f"PCIe link of {where} runs at x{cur} of x{top} on two readings in "
                                                 f"a row (a downgraded link: a bad riser, slot or cable)",
                                   {"counter": "pcie_width", "width": cur, "width_max": top}))
    if c.retired_pages_pending is not None:
        s = trends.setdefault("retire_pending", {"p": False, "w": None})
        if c.retired_pages_pending and not s["p"] and (s["w"] is None or ts - s["w"] >= policy.degrade_realert_s):
            s["w"] = ts
            out.append(Finding("retire_pending", f"a page retirement is pending on {where} (ECC errors retired a page; "
                                                 f"it takes effect at the next driver reload)",
                               {"counter": "retire_pending", "retired_pages_single_bit": c.retired_pages_single_bit,
                                "retired_pages_double_bit": c.retired_pages_double_bit}))
        s["p"] = bool(c.retired_pages_pending)
    return out


def degrading_now(trends: dict, ts: float, policy: Policy) -> bool:
    """True while a trend is still at or above its limit (an open GPU_DEGRADING incident stays
    open while it is: healthy samples do not make a link stop recovering)."""
    width = policy.degrade_window_s / INTERVALS
    for name, spec in TRENDS.items():
        t = trends.get(name)
        limit = getattr(policy, spec.limit)
        if t is None or limit <= 0:
            continue
        if t["bw"] != width:
            return True  # a policy with another window: open until the next reading starts the trend over
        if _rising(*_window(t, ts), limit, policy) is not None:
            return True
    s = trends.get("pcie_width")
    return bool(s and s["low"] >= 2)


def trend_summary(trends: dict, ts: float, policy: Policy) -> dict:
    """Per trended counter, its count and rising intervals in the window ending at `ts`: for the
    CLI and the tests."""
    out = {}
    for name in TRENDS:
        t = trends.get(name)
        if t is not None:
            count, intervals, _top = _window(t, ts)
            out[name] = {"count": count, "intervals": intervals, "value": t["v"]}
    return out
