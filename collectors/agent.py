"""The collector loop: wires sources (NVML, kernel log, /proc, workloads) to a sink.

One `tick(now)` per interval: read kernel lines and NVML Xid notices, resolve PCI -> GPU UUID,
merge the kernel and NVML views of the same fault, sample every GPU, list its processes, publish;
every `counters_interval` seconds also each GPU's error and link counters (gpu.counters).
The clock is passed in, so a scenario can run the same loop in accelerated scenario time.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, Callable, Protocol

from pathlib import Path

import orjson

from xidstream.collectors.metrics import CollectorMetrics
from xidstream.collectors.nvml import EventWaitFailed, GpuIdentity, NvmlReader, NvmlRelease, NvmlUnavailable, XidNotice
from xidstream.collectors.parse.kernel import (REFUSALS, SCENARIO_TEXT, KernelRecord, Parsed, continues_fallen,
                                     parse_line_checked, parse_scenario_line, sxid_continues)
from xidstream.collectors.sink import Sink
from xidstream.collectors.sources.kernel import KernelSource
from xidstream.collectors.sources.rack import valid_rack
from xidstream.collectors.spool import write_durably
from xidstream.schemas.limits import (
    GPU_UUID_MAX,
    JOB_MAX,
    K8S_LABEL_MAX,
    KERNEL_MESSAGE_MAX,
    KERNEL_RAW_MAX,
    KERNEL_TS_MAX,
    NOTES_MAX,
    NVML_STRING_MAX,
    NVSWITCHES_MAX,
    POD_NAME_MAX,
    PROCESS_NAME_MAX,
    PROCESSES_MAX,
    SHORT_TEXT_MAX,
    TASK_COMM_MAX,
    clip,
)
from xidstream.schemas.models import (
    ComputeApp,
    DeviceHolder,
    GpuCounters,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    NvLinkCounters,
    PmonSample,
    WorkloadEvent,
    XidEvent,
)
from xidstream.schemas.vocab import SampleStatus, TsSource, XidSource
from xidstream.schemas.sxid_catalog import lookup_sxid
from xidstream.schemas.xid_catalog import XID_CATALOG, lookup

__all__ = ["CollectorConfig", "Collector", "IdentityMap", "XidMerger", "ProcessInfo", "WorkloadSource", "RackSource",
           "xid_fields", "line_time", "unidentified_key", "unidentified_pci"]

log = logging.getLogger(__name__)

# An unchanged inventory is published again this often: the processor counts a node as a GPU node
# (the fleet breaker's size; capacity taken without approval) while it saw the node's inventory
# within a day (streams.policy fleet_node_ttl_s), so a quiet node stays known.
INVENTORY_HEARTBEAT_S = 6 * 3600.0

# The event thread's wait in NVML (nvmlEventSetWait_v2's timeout): it holds the NVML lock meanwhile,
# so a release for a GPU reset waits at most this long for it (`Collector._check_release`).
EVENT_WAIT_MS = 500
# How long a tick waits for the event thread to leave NVML before trying again at the next tick
# (twice its wait: a driver slow to time the wait out costs the release a tick, never the loop).
RELEASE_LOCK_WAIT_S = 2 * EVENT_WAIT_MS / 1000

# A workload event's text fields and their caps (schemas.limits): the API server bounds the names, a
# container runtime's reason is its own.
_WORKLOAD_TEXT = {"namespace": K8S_LABEL_MAX, "pod": POD_NAME_MAX, "container": K8S_LABEL_MAX, "job": JOB_MAX,
                  "reason": SHORT_TEXT_MAX}


class ProcessInfo(Protocol):
    """What the collector needs from /proc (collectors.sources.procfs.ProcFs, or a fake)."""

    def pod_of(self, pid: int) -> Any: ...
    def comm(self, pid: int) -> str | None: ...
    def device_holders(self) -> dict[str, list[int]]: ...


class WorkloadSource(Protocol):
    def read(self) -> list[dict]: ...


class RackSource(Protocol):
    """The node's rack for its inventories (collectors.sources.rack): None when unknown; never raises."""

    def read(self) -> str | None: ...


def xid_fields(rec: KernelRecord, *, node: str, ts: datetime, gpu_uuid: str | None, gpu_index: int | None,
               pci_bus_id: str | None) -> dict:
    """The `gpu.xid` fields of one parsed kernel record, with NVIDIA's catalog entry for an Xid (or
    an SXid: schemas.sxid_catalog).
    The caller says where the GPU identity and the time come from, and adds the sources. Text is
    cut to its cap (schemas.limits) with a marker: an over-long line still gives its record."""
    uuid = rec.gpu_uuid or gpu_uuid  # an identity line names its own GPU
    fields = dict(
        ts=ts, node=node, kind=rec.kind, gpu_uuid=uuid, gpu_index=gpu_index, pci_bus_id=pci_bus_id,
        resolved=uuid is not None, xid=rec.xid, pid=rec.pid, process_name=clip(rec.process_name, TASK_COMM_MAX),
        gpu_instance=rec.gpu_instance, compute_instance=rec.compute_instance,
        message=clip(rec.message, KERNEL_MESSAGE_MAX), raw=clip(rec.raw, KERNEL_RAW_MAX),
        kernel_ts=clip(rec.kernel_ts, KERNEL_TS_MAX),
        # an SXid's switches (the first NVSWITCHES_MAX: a node has fewer); `raw` keeps every line
        nvswitch_pci_bus_ids=list(rec.nvswitch_pcis[:NVSWITCHES_MAX]),
    )
    if rec.kind == "xid" and rec.xid is not None:
        info = lookup(rec.xid)
        fields.update(xid_name=info.name, xid_category=info.category, xid_resolution=info.resolution)
    elif rec.kind == "sxid" and rec.xid is not None:
        # NVIDIA's name and class of the code; its guide gives no resolution bucket for SXids
        sx = lookup_sxid(rec.xid)
        fields.update(xid_name=sx.name, xid_category=sx.fatality)
    return fields


def unidentified_pci(index: int) -> str:
    """The stand-in PCI id of a GPU NVML counts at `index` but refuses, with nothing saved to name
    it: NVML gives no PCI id without a handle, and the records need one. ``ffff:<hi>:<lo>`` (the
    index's two bytes) is in PCI domain ffff, which no GPU has, and differs per index; the
    inventory's notes say the real one is unknown."""
    return f"ffff:{(index >> 8) & 0xFF:02x}:{index & 0xFF:02x}"


def unidentified_key(node: str, index: int) -> str:
    """The key (`gpu_uuid`) such a GPU is published under: ``<node>/<unidentified_pci(index)>``,
    the topics' key of a GPU with no UUID (schemas.topics: an unresolved Xid's ``node/pci``). The
    processor takes it as unresolved (a '/' no UUID has: nothing to aim a GPU reset at) and routes
    the results of its commands, which carry no UUID but this PCI id, back to the same row. A node
    name too long for GPU_UUID_MAX is cut and tagged with a digest of the whole, so two nodes never
    share a key (its commands' results then fold apart from it)."""
    suffix = "/" + unidentified_pci(index)
    key = node + suffix
    if len(key) <= GPU_UUID_MAX:
        return key
    digest = hashlib.sha256(node.encode()).hexdigest()[:12]
    return f"{node[:GPU_UUID_MAX - len(suffix) - len(digest) - 1]}~{digest}{suffix}"


def _local(naive: datetime, tz: tzinfo | None) -> datetime:
    aware = naive.replace(tzinfo=tz) if tz is not None else naive.astimezone()  # astimezone: this machine's zone
    return aware.astimezone(timezone.utc)


def _syslog_time(parts: tuple, ref_ts: float | None, now: datetime, tz: tzinfo | None) -> datetime | None:
    """A syslog stamp has no year: take the year of the file's last write (`ref_ts`, its mtime; for
    a line just read, now). A stamp later than that (by more than a day of clock or zone slack) is
    from the year before: a file written across New Year holds "Dec 31" lines under a January
    mtime. Feb 29 goes back to the last leap year."""
    month, day, hh, mm, ss = parts
    ref = datetime.fromtimestamp(ref_ts, timezone.utc) if ref_ts is not None else now
    year = ref.astimezone(tz).year if tz is not None else ref.astimezone().year
    for y in range(year, year - 5, -1):
        try:
            ts = _local(datetime(y, month, day, hh, mm, ss), tz)
        except ValueError:  # Feb 29 of a common year, or a bad day
            continue
        if ts <= ref + timedelta(days=1):
            return ts
    return None


def line_time(rec: KernelRecord, ref_ts: float | None, now: datetime, *, boot: datetime | None = None,
              tz: tzinfo | None = None) -> tuple[datetime, TsSource]:
    """A kernel record's time: the line's own where it has one, else `now`.
    `ref_ts`: the file's mtime (anchors a year-less syslog stamp); `boot`: the boot's wall time,
    for /dev/kmsg stamps (None: they are from an unknown boot); `tz`: zone of local-time stamps."""
    kind = rec.ts_kind
    if rec.wall_ts is not None:
        return rec.wall_ts, TsSource.journal if kind == "journal" else TsSource.line
    if kind == "ctime" and rec.local_ts is not None:
        return _local(rec.local_ts, tz), TsSource.line
    if kind == "syslog" and rec.syslog_ts is not None:
        ts = _syslog_time(rec.syslog_ts, ref_ts, now, tz)
        if ts is not None:
            return ts, TsSource.line
    if kind == "kmsg" and boot is not None and rec.mono_us is not None:
        return boot + timedelta(microseconds=rec.mono_us), TsSource.kmsg
    return now, TsSource.read


@dataclass(frozen=True)
class CollectorConfig:
    node: str
    interval: float = 1.0
    # How long kernel-log and NVML records of one fault wait for each other to be merged into one
    # record with both sources. The driver prints the line and signals the event together; a few
    # seconds covers a slow journald.
    xid_merge_window: float = 2.0
    inventory_interval: float = 60.0
    holders_interval: float = 10.0  # /proc/*/fd scans are the collector's costliest read
    # Seconds between reads of the error and link counters (gpu.counters); None: not read. They
    # trend over hours (an NVLink's recoveries, a rising single-bit ECC count), so a minute loses
    # nothing and costs 1/60 of a sample's NVML calls. `xidstream collect` reads them every 60 s;
    # a scenario replay does not, unless its config says so.
    counters_interval: float | None = None
    dev_prefix: str = "/dev/nvidia"
    # Live mode: the loop's clock is the node's, so kmsg monotonic stamps become wall time and
    # local-time stamps (syslog, dmesg -T) are placed by the node's clock and zone. False (a
    # scenario replay in its own time): only absolute stamps (ISO, journal) are the line's time;
    # the rest are stamped with the loop's clock, as scenario lines are copied from other days.
    kmsg_wall_clock: bool = True
    # When NVML's event wait fails at once (a registered GPU is lost, an unknown error), wait this
    # long before re-creating the event set, doubling up to the second figure
    # (without it the event thread took a full core).
    event_backoff: tuple[float, float] = (1.0, 60.0)
    # Time zone of local-time log stamps (syslog, `dmesg -T`); None: this machine's.
    log_tz: tzinfo | None = None
    boot_time: datetime | None = None  # None: now - time.monotonic()
    # How far back a first start publishes history (rotated files, the earlier journal); older
    # lines are skipped. None: the current boot (NVSentinel starts at the journal tail for the same
    # reason: a months-old Xid 79 must not become today's reboot plan). `--backfill` widens it.
    backfill_since: datetime | None = None


class IdentityMap:
    """PCI bus id and the driver's GPU number -> GPU UUID, from NVML and `GPU at PCI` lines."""

    def __init__(self) -> None:
        self.by_pci: dict[str, tuple[str, int | None]] = {}
        self.by_index: dict[int, str] = {}  # NVML index -> PCI
        self.driver_order: list[str] = []  # PCI ids in the order the driver named them

    def learn_nvml(self, gpus: list[GpuIdentity]) -> None:
        for g in gpus:
            self.by_pci[g.pci_bus_id] = (g.uuid, g.index)
            self.by_index[g.index] = g.pci_bus_id

    def learn_identity(self, pci: str, uuid: str) -> None:
        old = self.by_pci.get(pci)
        self.by_pci[pci] = (uuid, old[1] if old else None)
        if pci not in self.driver_order:
            self.driver_order.append(pci)

    def resolve(self, pci: str | None, gpu_ref: int | None = None) -> tuple[str | None, int | None, str | None]:
        """(uuid, index, pci); uuid None when unresolved."""
        if pci is None and gpu_ref is not None:
            # "GPU<n>" is the driver's number, which follows PCI probe order like NVML's index.
            pci = self.by_index.get(gpu_ref)
            if pci is None and gpu_ref < len(self.driver_order):
                pci = self.driver_order[gpu_ref]
        if pci is None:
            return None, None, None
        hit = self.by_pci.get(pci)
        return (hit[0], hit[1], pci) if hit else (None, None, pci)


@dataclass
class _Pending:
    due: float
    fields: dict
    sources: list[str]
    line_no: int | None  # the kernel line it came from, for cursor commits
    key: tuple | None  # (gpu key, xid) for merging; None for non-Xid records


class XidMerger:
    """Holds Xid records for `window` seconds so that the kernel line and the NVML event of one
    fault become one record naming both sources. Emits in arrival order."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.queue: deque[_Pending] = deque()
        self._recent: deque[tuple[float, tuple, str]] = deque()  # (time, key, source) flushed lately
        self.merged = 0

    def add(self, now: float, fields: dict, source: str, line_no: int | None,
            record: KernelRecord | None = None) -> bool:
        """Queue a record; False when it was folded into a queued record of the same line's
        predecessor (an SXid continuation), so it needs no acknowledgement of its own."""
        if record is not None and record.kind == "sxid" and self.queue:
            last = self.queue[-1]
            if last.fields.get("kind") == "sxid" and sxid_continues(last.fields.get("xid"), last.fields.get("_mono_us"), record):
                _append_capped(last.fields, "raw", "\n" + record.raw, KERNEL_RAW_MAX)
                _append_capped(last.fields, "message", " | " + record.message, KERNEL_MESSAGE_MAX)
                switches = last.fields.setdefault("nvswitch_pci_bus_ids", [])
                for pci in record.nvswitch_pcis:  # one event, often printed by several switches
                    if pci not in switches and len(switches) < NVSWITCHES_MAX:
                        switches.append(pci)
                return False
        key = None
        if fields.get("kind") == "xid":
            key = (fields.get("gpu_uuid") or fields.get("pci_bus_id"), fields["xid"])
            for p in self.queue:
                if p.key == key and ((source == "nvml") != ("nvml" in p.sources)) and len(p.sources) == 1:
                    self.merged += 1
                    if source == "nvml":
                        p.sources.append("nvml")
                        return False
                    # the kernel line has the richer record: it replaces the NVML draft
                    p.fields = fields
                    p.sources.insert(0, source)
                    p.line_no = line_no
                    return True
            # An NVML event for a fault whose kernel line was already published: drop it.
            if source == "nvml":
                for i, (_, rkey, rsrc) in enumerate(self._recent):
                    if rkey == key and rsrc != "nvml":
                        del self._recent[i]
                        self.merged += 1
                        return False
        self.queue.append(_Pending(now + (self.window if key else 0.0), fields, [source], line_no, key))
        return True

    def add_more(self, piece: KernelRecord) -> bool:
        """Join a later line of a print (`Parsed.more`: the probe-time fallen-off-the-bus message)
        to the queued record of its first line; False when there is none (the first line was lost,
        or already sent): the piece names no GPU and is dropped."""
        if not self.queue:
            return False
        f = self.queue[-1].fields
        head = KernelRecord(kind=f.get("kind") or "", raw="", message=f.get("message") or "", mono_us=f.get("_mono_us"))
        if not continues_fallen(head, piece):
            return False
        _append_capped(f, "raw", "\n" + piece.raw, KERNEL_RAW_MAX)
        _append_capped(f, "message", " " + piece.message, KERNEL_MESSAGE_MAX)
        return True

    def due(self, now: float, flush_all: bool = False) -> list[_Pending]:
        out = []
        while self.queue and (flush_all or self.queue[0].due <= now):
            p = self.queue.popleft()
            out.append(p)
            if p.key is not None and "nvml" not in p.sources:
                self._recent.append((now, p.key, p.sources[0]))
        while self._recent and self._recent[0][0] < now - 5 * self.window:
            self._recent.popleft()
        return out


def _notes(notes: tuple[str, ...] | list[str]) -> list[str]:
    """Inventory notes within their caps: each cut, and past NOTES_MAX one note says how many more."""
    out = [clip(n, SHORT_TEXT_MAX) for n in notes[:NOTES_MAX]]
    if len(notes) > NOTES_MAX:
        out[-1] = f"... and {len(notes) - NOTES_MAX + 1} more notes"
    return out


def _capped(name: str, items: list | None, cut: list[str]) -> list | None:
    """`items` within PROCESSES_MAX (schemas.limits); a list that was cut is named in `cut`."""
    if items is None or len(items) <= PROCESSES_MAX:
        return items
    cut.append(f"{name} cut to the first {PROCESSES_MAX} of {len(items)}")
    return items[:PROCESSES_MAX]


def _append_capped(fields: dict, name: str, text: str, limit: int) -> None:
    """Append `text` to ``fields[name]`` while it fits under `limit`; past that, count it in
    ``fields["_<name>_cut"]`` for `clip`'s marker. One SXid event prints a line per NVSwitch port
    within a second: joined whole they would make a record over its cap, which would be lost."""
    cut = f"_{name}_cut"
    if not fields.get(cut) and len(fields[name]) + len(text) <= limit:
        fields[name] += text
    else:
        fields[cut] = fields.get(cut, 0) + len(text)


class _KernelCursors:
    """Commits a kernel source's cursor only when every event from it and the lines before it
    was acknowledged by the sink.

    Keeps only what a restart needs: the newest cursor, and for each line
    whose events are not acknowledged yet, the cursor of the line before it. While Kafka is down
    that is one entry per unacknowledged Xid line (those are on disk in the spool anyway), not one
    per kernel line read (about 9 MiB an hour at 20 lines/s before)."""

    def __init__(self) -> None:
        self.next_no = 0
        self.outstanding: dict[int, int] = {}  # line_no -> events not yet acked
        self.before: dict[int, Any] = {}  # line_no (with events outstanding) -> cursor of the line before
        self._latest: Any = None  # cursor of the newest line read
        self._prev: Any = None  # cursor before the newest line
        self._committed: Any = None

    def add_line(self, cursor: Any) -> int:
        self.next_no += 1
        self._prev = self._latest
        if cursor is not None:
            self._latest = cursor
        return self.next_no

    def hold(self, line_no: int) -> None:
        """One more event of the newest line (`line_no`) waits for its acknowledgement."""
        if line_no not in self.outstanding:
            self.outstanding[line_no] = 0
            self.before[line_no] = self._prev if line_no == self.next_no else None
        self.outstanding[line_no] += 1

    def ack(self, line_no: int) -> None:
        left = self.outstanding.get(line_no, 0) - 1
        if left <= 0:
            self.outstanding.pop(line_no, None)
            self.before.pop(line_no, None)
        else:
            self.outstanding[line_no] = left

    def committable(self) -> Any:
        """The cursor to save now, or None when it has not moved since the last one."""
        cursor = self.before[min(self.outstanding)] if self.outstanding else self._latest
        if cursor is None or cursor == self._committed:
            return None
        self._committed = cursor
        return cursor


class Collector:
    def __init__(
        self,
        config: CollectorConfig,
        sink: Sink,
        *,
        nvml: NvmlReader | None = None,
        kernel: KernelSource | None = None,
        procfs: ProcessInfo | None = None,
        workloads: WorkloadSource | None = None,
        metrics: CollectorMetrics | None = None,
        nvml_events_thread: bool = True,
        clock: Callable[[], float] = time.monotonic,
        state_dir: Path | None = None,
        nvml_release: NvmlRelease | None = None,
        rack: RackSource | None = None,
    ) -> None:
        self.config = config
        self.sink = sink
        self.nvml = nvml
        self.kernel = kernel
        self.procfs = procfs
        self.workloads = workloads
        self.rack_source = rack
        self.rack: str | None = None  # as last read; every inventory record carries it
        self._rack_read_at: datetime | None = None
        self.metrics = metrics or CollectorMetrics()
        self.identity = IdentityMap()
        self.merger = XidMerger(config.xid_merge_window)
        self.cursors = _KernelCursors()
        self.gpus: list[GpuIdentity] = []
        self._inventory_sent: dict[str, GpuInventory] = {}
        self._status: dict[str, str] = {}
        self._last_inventory = float("-inf")
        self._last_holders = float("-inf")
        self._last_counters = float("-inf")
        self._counters_failed: set[str] = set()  # GPUs whose counters read raised (logged once each)
        # PIDs holding each /dev/nvidia* by the last scan; None until one ran (and always without /proc).
        self._holders: dict[str, list[int]] | None = None
        self._nvml_q: queue.Queue[XidNotice] = queue.Queue()
        self._nvml_thread: threading.Thread | None = None
        self._use_thread = nvml_events_thread
        self._stop = threading.Event()
        self._clock = clock
        self._boot_wall = config.boot_time or datetime.now(timezone.utc) - timedelta(seconds=time.monotonic())
        self._since = config.backfill_since or self._boot_wall
        self.history_skipped = 0  # history lines older than the look-back, or of unknown time
        self._refusals: dict[str, int] = {}  # kernel log lines refused, by collectors.parse.REFUSALS reason
        self.ticks = 0
        # GPUs of the saved inventory that NVML no longer gives a handle for.
        self._inventory_file = Path(state_dir) / "inventory.json" if state_dir is not None else None
        self._saved: dict[str, GpuIdentity] = self._load_inventory()
        self.lost: list[GpuIdentity] = []
        self._lost_why: dict[str, str] = {}
        # Keys (`unidentified_key`) of the GPUs in `lost` that NVML refuses with nothing saved to
        # name them: known by their NVML index only, never saved, never taught to the identity map.
        self._unidentified: set[str] = set()
        self._events_stale = False  # set when a GPU returns: the event set must be re-created
        self._event_delay = 0.0
        self._event_retry_at = 0.0
        # The reset handshake (collectors.nvml.NvmlRelease): NVML is shut down while the node
        # executor resets a GPU; the event thread leaves NVML alone meanwhile (the lock).
        self.release = nvml_release or (NvmlRelease(state_dir) if state_dir is not None else None)
        self.released_for: set[str] = set()  # GPU UUIDs whose reset NVML is released for now
        self._acked_without_nvml: set[str] = set()  # requests answered by a collector without NVML
        self._before_release: dict[str, str] = {}  # GPU UUID -> its status when NVML was released
        self._nvml_lock = threading.Lock()
        # Set while a tick waits for the NVML lock to release NVML: the event thread does not take
        # the lock again meanwhile. A plain Lock is not fair: the thread, taking it back the moment
        # it let go after each wait, kept a waiting tick out for seconds (up to 9.5 s in a test on a
        # busy machine; the node executor waits 10 s for the acknowledgement, then refuses the reset).
        self._release_wanted = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, now: datetime) -> None:
        if self.nvml is not None:
            try:
                self.gpus = self.nvml.init()
            except NvmlUnavailable as exc:
                log.error("%s; collecting kernel Xid records only", exc)
                self.nvml = None
                self.metrics.set_source("nvml", False, str(exc))  # not ready: running blind
            else:
                self.metrics.set_source("nvml", True)
        if self.kernel is not None:
            self.metrics.set_source("kernel_log", True)
        if self.nvml is not None:
            self._merge_saved_inventory()
            self._learn_identities()
            self._read_rack(now)
            self._publish_inventory(now)
            self._last_inventory = self._clock()
            if self.nvml.register_xid_events() and self._use_thread:
                self._nvml_thread = threading.Thread(target=self._watch_nvml, name="nvml-xid-events", daemon=True)
                self._nvml_thread.start()

    def _watch_nvml(self) -> None:
        lo, hi = self.config.event_backoff
        delay = 0.0
        while not self._stop.is_set():
            if self.released_for or self._release_wanted.is_set():  # NVML is (being) shut down for a GPU reset
                self._stop.wait(0.2)
                continue
            failure: Exception | None = None
            notice = None
            with self._nvml_lock:
                if self.released_for or self._release_wanted.is_set():
                    continue
                if self._events_stale and self.nvml is not None:
                    self._events_stale = False
                    self.nvml.register_xid_events()
                try:
                    notice = self.nvml.wait_xid(EVENT_WAIT_MS) if self.nvml else None
                except Exception as exc:  # noqa: BLE001 - handled below, outside the lock
                    failure = exc
            try:
                if failure is not None:
                    raise failure
            except EventWaitFailed as exc:
                # Answered at once (a registered GPU is lost, an unknown error): back off, then
                # re-create the set; GPUs that refuse registration are left out until they return.
                delay = min(hi, max(lo, delay * 2))
                self.metrics.nvml_event_failures.set(self.nvml.event_wait_failures)
                if delay == lo:
                    log.warning("NVML event wait failed (%s); retrying with a new event set in %.1f s, backing "
                                "off to %g s while it fails", exc, delay, hi)
                self._stop.wait(delay)
                self._events_stale = True
                continue
            except Exception:  # noqa: BLE001 - never let the event thread die
                log.exception("NVML event wait failed")
                self._stop.wait(max(1.0, lo))
                continue
            delay = 0.0
            if notice is not None:
                self._nvml_q.put(notice)

    def stop(self) -> None:
        self._stop.set()
        if self._nvml_thread is not None:
            self._nvml_thread.join(2)
        self._emit(self.merger.due(self._clock(), flush_all=True), datetime.now(timezone.utc))
        # Deliver what the merger held and save the kernel cursor past it, so that the next start
        # neither re-sends nor loses these lines.
        self.sink.flush(10.0)
        self._commit_kernel()
        if self.kernel is not None:
            self.kernel.close()
        if self.nvml is not None:
            self.nvml.shutdown()

    # -- one tick --------------------------------------------------------------------------
    def tick(self, now: datetime) -> None:
        started = time.perf_counter()
        mono = self._clock()
        self._read_kernel(now, mono)
        self._read_nvml_events(now, mono)
        self._emit(self.merger.due(mono), now)
        if self.nvml is not None and self.release is not None:
            self._check_release()
        elif self.release is not None:
            self._answer_release_without_nvml()
        if self.nvml is not None and self.released_for:
            if self.procfs is not None and mono - self._last_holders >= self.config.holders_interval:
                self._holders = self.procfs.device_holders()
                self._last_holders = mono
            for gpu in self.gpus + self.lost:
                self._sample_released(gpu, now)
        elif self.nvml is not None:
            if mono - self._last_inventory >= self.config.inventory_interval:
                self._refresh_inventory(now)
                self._last_inventory = mono
            if self.procfs is not None and mono - self._last_holders >= self.config.holders_interval:
                self._holders = self.procfs.device_holders()
                self._last_holders = mono
            for gpu in self.gpus:
                self._sample(gpu, now)
            for gpu in self.lost:
                self._sample_lost(gpu, now)
            every = self.config.counters_interval
            if every is not None and mono - self._last_counters >= every:
                self._last_counters = mono
                for gpu in self.gpus:
                    if self._status.get(gpu.uuid, "ok") == "ok":  # a lost GPU's sample says so already
                        self._publish_counters(gpu, now)
        if self.workloads is not None:
            self._read_workloads(now)
        self.sink.poll()
        self._commit_kernel()
        self.ticks += 1
        m = self.metrics
        m.update_sink(self.sink.stats())
        if self.nvml is not None:
            m.nvml_errors.set(self.nvml.error_count)
            m.nvml_event_failures.set(self.nvml.event_wait_failures)
        if self.kernel is not None:
            m.kmsg_lost.set(self.kernel.lost)
            failed = getattr(self.kernel, "failed", None)  # e.g. journalctl exited
            m.set_source("kernel_log", failed is None, failed or "")
        m.loop_seconds.observe(time.perf_counter() - started)
        m.tick_done()

    # -- kernel log ------------------------------------------------------------------------
    def _read_kernel(self, now: datetime, mono: float) -> None:
        if self.kernel is None:
            return
        lines = self.kernel.read()
        self.metrics.kernel_lines.inc(len(lines))
        for line in lines:
            line_no = self.cursors.add_line(line.cursor)
            if line.parse_as == SCENARIO_TEXT:  # a scenario's lines, as their author wrote them
                parsed = parse_scenario_line(line.text)
            else:
                parsed = parse_line_checked(line.text, line.parse_as or line.source)
            if parsed.refused is not None:
                self._refused(parsed, line)
            for rec in parsed.records:
                fields = self._fields_from_kernel(rec, now, line)
                if fields is None:
                    continue
                self.metrics.kernel_records.labels(rec.kind).inc()
                if rec.xid is not None:
                    # by code for the dashboard's Xid rate; a code outside NVIDIA's catalog is
                    # "other", so a line cannot mint label values without bound
                    self.metrics.xids.labels(str(rec.xid) if rec.xid in XID_CATALOG else "other").inc()
                if self.merger.add(mono, fields, line.source, line_no, rec):
                    self.cursors.hold(line_no)
            for piece in parsed.more:
                self.merger.add_more(piece)

    def _refused(self, parsed: Parsed, line: Any) -> None:
        """Count and log a line that names the driver but is not its record (a forgery, or a
        parser bug): the first of each reason, then every 1,000th, so a flood cannot fill the log."""
        self.metrics.kernel_refused.labels(parsed.refused).inc()
        n = self._refusals[parsed.refused] = self._refusals.get(parsed.refused, 0) + 1
        if n == 1 or n % 1000 == 0:
            log.warning("kernel log: refused a %s line (%s; %d so far)%s: %.300r", line.source,
                        REFUSALS[parsed.refused], n, f": {parsed.error}" if parsed.error else "", line.text)

    def _line_time(self, rec: KernelRecord, line: Any, now: datetime) -> tuple[datetime, TsSource]:
        if not self.config.kmsg_wall_clock:  # replay in the loop's own time (see CollectorConfig)
            if rec.wall_ts is not None:
                return rec.wall_ts, TsSource.journal if rec.ts_kind == "journal" else TsSource.line
            return now, TsSource.read
        boot = self._boot_wall if line.source == "kmsg" else None
        return line_time(rec, getattr(line, "ref_ts", None), now, boot=boot, tz=self.config.log_tz)

    def _fields_from_kernel(self, rec: KernelRecord, now: datetime, line: Any) -> dict | None:
        if rec.kind == "gpu_identity" and rec.pci and rec.gpu_uuid:
            self.identity.learn_identity(rec.pci, rec.gpu_uuid)  # identity lines teach even from history
        ts, ts_source = self._line_time(rec, line, now)
        history = bool(getattr(line, "history", False))
        if history and (ts < self._since if ts_source != TsSource.read else self.config.backfill_since is None):
            # Older than the look-back; or of unknown time, which by default (current boot only)
            # cannot be placed in this boot. With --backfill it is published, backfilled, read-stamped.
            self.history_skipped += 1
            return None
        uuid, index, pci = self.identity.resolve(rec.pci, rec.gpu_ref)
        fields = xid_fields(rec, node=self.config.node, ts=ts, gpu_uuid=uuid, gpu_index=index, pci_bus_id=pci)
        fields["ts_source"] = ts_source
        fields["backfilled"] = history
        fields["observed_at"] = now  # by the collector's clock: bounds a drifting line stamp downstream
        fields["_mono_us"] = rec.mono_us
        return fields

    def _read_nvml_events(self, now: datetime, mono: float) -> None:
        if self.nvml is None or self.released_for:
            return  # released for a GPU reset: no event set until NVML is taken up again
        if not self._use_thread:
            # Same backoff as the thread, in the loop's own (maybe scenario) time.
            if self._events_stale and mono >= self._event_retry_at:
                self._events_stale = False
                self.nvml.register_xid_events()
            while not self._events_stale:
                try:
                    notice = self.nvml.wait_xid(0)
                except EventWaitFailed as exc:
                    lo, hi = self.config.event_backoff
                    self._event_delay = min(hi, max(lo, self._event_delay * 2))
                    self._event_retry_at = mono + self._event_delay
                    self._events_stale = True
                    self.metrics.nvml_event_failures.set(self.nvml.event_wait_failures)
                    log.warning("NVML event wait failed (%s); new event set in %.1f s", exc, self._event_delay)
                    break
                if notice is None:
                    self._event_delay = 0.0
                    break
                # the loop's clock is the time of arrival here (scenario replays run in their own time)
                self._nvml_q.put(XidNotice(**{**notice.__dict__, "received": now}))
        while True:
            try:
                n = self._nvml_q.get_nowait()
            except queue.Empty:
                return
            if n.xid is None:
                if n.recovery_action is not None:
                    # Carried by the GPU's next sample (`recovery_action`); said here as it happens.
                    log.warning("GPU %s: NVML recovery action event: %d", n.uuid or n.pci_bus_id, n.recovery_action)
                continue
            info = lookup(n.xid)
            fields = dict(
                node=self.config.node, kind="xid", gpu_uuid=n.uuid, pci_bus_id=n.pci_bus_id,
                gpu_index=self.identity.resolve(n.pci_bus_id)[1], resolved=n.uuid is not None,
                xid=n.xid, xid_name=info.name, xid_category=info.category, xid_resolution=info.resolution,
                gpu_instance=n.gpu_instance, compute_instance=n.compute_instance,
                message="(from NVML event; no kernel log line seen)", raw="",
                # When the event arrived, not when the merge window let it out.
                ts=n.received or now, ts_source=TsSource.nvml, observed_at=n.received or now,
            )
            self.merger.add(mono, fields, "nvml", None)

    def _emit(self, ready: list[_Pending], now: datetime) -> None:
        for p in ready:
            fields = dict(p.fields)
            fields.pop("_mono_us", None)
            for name, limit in (("raw", KERNEL_RAW_MAX), ("message", KERNEL_MESSAGE_MAX)):
                cut = fields.pop(f"_{name}_cut", 0)
                if cut:
                    fields[name] = clip(fields[name], limit, more=cut)
            fields.setdefault("ts", now)
            # without NVML no process list of any GPU comes: the processor must not wait for one
            fields.setdefault("process_lists", self.nvml is not None)
            try:
                event = XidEvent(**fields, source=XidSource(p.sources[0]), sources=[XidSource(s) for s in p.sources])
            except Exception as exc:  # noqa: BLE001 - one odd record must not stop the collector
                log.error("cannot build an Xid record from %r: %s", fields.get("raw"), exc)
                self._ack_line(p.line_no)
                continue
            self.sink.publish(event, on_ack=(lambda n=p.line_no: self._ack_line(n)) if p.line_no else None)

    def _ack_line(self, line_no: int | None) -> None:
        if line_no is not None:
            self.cursors.ack(line_no)

    def _commit_kernel(self) -> None:
        if self.kernel is None:
            return
        cursor = self.cursors.committable()
        if cursor is not None:
            try:
                self.kernel.commit(cursor)
            except OSError as exc:
                log.warning("cannot save the kernel log cursor: %s", exc)

    # -- NVML ------------------------------------------------------------------------------
    def _load_inventory(self) -> dict[str, GpuIdentity]:
        if self._inventory_file is None:
            return {}
        try:
            data = orjson.loads(self._inventory_file.read_bytes())
            gpus = {}
            for d in data.get("gpus", []):
                d["notes"] = tuple(d.get("notes") or ())
                d["status"] = "ok"
                g = GpuIdentity(**d)
                gpus[g.uuid] = g
            return gpus
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("cannot read the saved GPU inventory %s: %s; starting from NVML's", self._inventory_file, exc)
            return {}

    def _save_inventory(self) -> None:
        """Write-rename-fsync, so a power loss leaves the old or the new file, never an empty one."""
        if self._inventory_file is None:
            return
        data = {"gpus": [{**g.__dict__, "notes": list(g.notes), "status": "ok"} for g in self._saved.values()]}
        path = self._inventory_file
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_durably(path, orjson.dumps(data))
        except OSError as exc:
            log.warning("cannot save the GPU inventory to %s: %s", path, exc)

    def forget_gpu(self, uuid: str) -> bool:
        """An operator removed this GPU: stop publishing it as lost (`xidstream collect --forget-gpu`)."""
        found = self._saved.pop(uuid, None) is not None
        self.lost = [g for g in self.lost if g.uuid != uuid]
        if found:
            log.warning("GPU %s removed from the saved inventory by the operator", uuid)
            self._save_inventory()
        return found

    def _merge_saved_inventory(self) -> None:
        """Live GPUs replace their saved entries; a saved GPU that NVML no longer gives a handle for
        stays, as lost (after Xid 79 and a collector restart, real NVML refuses
        the GPU's handle, and the GPU would vanish from every topic). A different GPU at the same
        PCI address means it was replaced: the old entry goes. A GPU NVML refuses at an index that
        nothing saved names is lost too, under `unidentified_key`; both are counted in
        xidstream_collector_lost_gpus."""
        live = {g.uuid for g in self.gpus}
        live_pci = {g.pci_bus_id for g in self.gpus}
        refused = self.nvml.refused if self.nvml is not None else {}
        lost, why = [], {}
        for uuid, g in list(self._saved.items()):
            if uuid in live:
                continue
            if g.pci_bus_id in live_pci:
                log.warning("GPU %s at %s was replaced; forgetting it", uuid, g.pci_bus_id)
                del self._saved[uuid]
                continue
            lost.append(GpuIdentity(**{**g.__dict__, "status": "lost"}))
            why[uuid] = refused.get(g.index) or "not listed by NVML"
        # A GPU NVML counts and refuses that nothing saved names (a first start after it fell off
        # the bus, or a state dir lost with its pod): NVML gives no UUID or PCI id without a handle,
        # but it does count the GPU, so it is published as lost under its index rather than left
        # out of every topic, where a node with a dead GPU would look like a node with one fewer.
        covered = {g.index for g in self.gpus} | {g.index for g in lost}
        unidentified: set[str] = set()
        for index, refusal in sorted(refused.items()):
            if index in covered:
                continue
            key = unidentified_key(self.config.node, index)
            note = (f"NVML counts a GPU at index {index} and refuses it ({refusal}); no inventory saved by an earlier "
                    f"run names it: its UUID and PCI id are unknown ({unidentified_pci(index)} stands in)")
            lost.append(GpuIdentity(index=index, uuid=key, pci_bus_id=unidentified_pci(index), name=None, serial=None,
                                    memory_total_mib=None, driver_version=None, cuda_version=None, notes=(note,),
                                    status="lost"))
            why[key] = refusal
            unidentified.add(key)
        before_lost = {x.uuid for x in self.lost}
        returned = before_lost - {g.uuid for g in lost}
        for g in lost:
            if g.uuid in before_lost:
                continue
            if g.uuid in unidentified:
                log.error("GPU %d: NVML counts it and refuses it (%s), and no inventory saved by an earlier run names "
                          "it; published as lost as %s until NVML gives its UUID", g.index, why[g.uuid], g.uuid)
            else:
                log.error("GPU %d (%s, %s) from the saved inventory: NVML refuses it (%s); published as lost until "
                          "it returns or `--forget-gpu %s`", g.index, g.uuid, g.pci_bus_id, why[g.uuid], g.uuid)
        gone = returned & self._unidentified  # NVML answers at that index again, under the GPU's own UUID
        for uuid in sorted(gone):
            log.warning("%s: NVML no longer refuses the GPU at that index; published under its UUID from now on", uuid)
            self._status.pop(uuid, None)
            for status in SampleStatus:  # its series would say lost (or unavailable) for good
                self.metrics.gpu_status.remove(uuid, status.value)
        if returned - gone:
            log.warning("GPU(s) %s are back", ", ".join(sorted(returned - gone)))
        if returned:
            self._events_stale = True
        self.lost, self._lost_why, self._unidentified = lost, why, unidentified
        self.metrics.lost_gpus.labels("saved").set(len(lost) - len(unidentified))
        self.metrics.lost_gpus.labels("index").set(len(unidentified))
        before = dict(self._saved)
        merged = []
        for g in self.gpus:
            good = self._saved.get(g.uuid)
            if g.status == "ok" or good is None:
                # Healthy; or never seen healthy (a first deployment): saved as read, so that a
                # restart can still publish it as lost, and published with its own status.
                self._saved[g.uuid] = g
                merged.append(g)
                continue
            # It answered GpuIsLost / ResetRequired during the read: the fields it could not give
            # come from the entry saved when it was healthy, which its nulls must not overwrite.
            kept = [k for k, v in g.__dict__.items() if v is None and getattr(good, k) is not None]
            fields = {k: (v if v is not None else getattr(good, k)) for k, v in g.__dict__.items()}
            notes = g.notes + ((f"{', '.join(kept)} from the saved inventory",) if kept else ())
            merged.append(GpuIdentity(**{**fields, "notes": notes}))
        self.gpus = merged
        if before != self._saved or not (self._inventory_file and self._inventory_file.exists()):
            self._save_inventory()

    def _learn_identities(self) -> None:
        """Teach the identity map every GPU NVML or the saved inventory names; a GPU known only by
        its index has no PCI id to resolve a kernel line by (`unidentified_pci` is a stand-in)."""
        self.identity.learn_nvml([g for g in self.gpus + self.lost if g.uuid not in self._unidentified])

    def _inventory_record(self, gpu: GpuIdentity, now: datetime) -> GpuInventory:
        # NVML's strings fit their caps (its buffers set them); cut anyway, so an odd driver costs
        # a field, not the GPU's inventory.
        nvml_text = {k: clip(getattr(gpu, k), NVML_STRING_MAX) for k in ("name", "serial", "driver_version", "cuda_version")}
        return GpuInventory(
            ts=now, node=self.config.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id,
            memory_total_mib=gpu.memory_total_mib, status=gpu.status, memory_info_version=gpu.memory_info_version,
            notes=_notes(gpu.notes), rack=self.rack, **nvml_text,
        )

    def _publish_inventory(self, now: datetime) -> None:
        for gpu in self.gpus + self.lost:
            rec = self._inventory_record(gpu, now)
            prev = self._inventory_sent.get(gpu.uuid)
            same = prev is not None and prev.model_dump(exclude={"event_id", "ts"}) == rec.model_dump(exclude={"event_id", "ts"})
            stale = prev is not None and (now - prev.ts).total_seconds() >= INVENTORY_HEARTBEAT_S
            if not same or stale:
                self.sink.publish(rec)
                self._inventory_sent[gpu.uuid] = rec

    def _read_rack(self, now: datetime) -> None:
        """Read the rack at start and again with each inventory heartbeat (a relabelled node is
        picked up within INVENTORY_HEARTBEAT_S; a changed rack changes the records, which go out at
        once). The source bounds its own wait; whatever it raises costs the rack, not the loop."""
        if self.rack_source is None:
            return
        age = (now - self._rack_read_at).total_seconds() if self._rack_read_at is not None else None
        if age is not None and 0 <= age < INVENTORY_HEARTBEAT_S:
            return
        self._rack_read_at = now
        try:
            rack = self.rack_source.read()
        except Exception:  # noqa: BLE001 - the RackSource contract says it never raises; a bug must not stop collection
            log.exception("reading the node's rack failed; inventories carry no rack")
            rack = None
        if rack is not None and not valid_rack(rack):  # the sources check; an inventory must never fail on it
            log.warning("rack %.80r is not a label value of at most %d characters; not published", rack, K8S_LABEL_MAX)
            rack = None
        self.rack = rack

    def _refresh_inventory(self, now: datetime) -> None:
        self._read_rack(now)
        try:
            gpus = self.nvml.refresh_inventory()
        except NvmlUnavailable as exc:
            log.warning("inventory refresh failed: %s", exc)
            return
        if {g.uuid for g in gpus} - {g.uuid for g in self.gpus}:
            self._events_stale = True  # a GPU appeared or came back: register it for events
        self.gpus = gpus
        self._merge_saved_inventory()
        self._learn_identities()
        self._publish_inventory(now)

    def _set_status(self, gpu: GpuIdentity, status: str, error: str | None) -> None:
        old = self._status.get(gpu.uuid, "ok")
        if old != status:
            level = logging.ERROR if status != "ok" else logging.WARNING
            # `unavailable` is only NVML released for a planned reset (_sample_released): one line
            # says so for the node (_check_release), not an ERROR per GPU; nor is a GPU coming back
            # to the status it had before. A GPU whose status changed across the reset (lost after
            # it, or healthy again) still gets its line.
            if status == "unavailable":
                self._before_release.setdefault(gpu.uuid, old)
                level = logging.DEBUG
            elif old == "unavailable" and self._before_release.pop(gpu.uuid, "ok") == status:
                level = logging.DEBUG
            log.log(level, "GPU %s (%s) NVML status: %s -> %s %s", gpu.index, gpu.uuid, old, status, error or "")
            self.metrics.gpu_status.labels(gpu.uuid, old).set(0)
            self._status[gpu.uuid] = status
            if status == "ok":
                self._events_stale = True  # it is back: the event set must include it again
        self.metrics.gpu_status.labels(gpu.uuid, status).set(1)

    # -- the reset handshake ---------------------------------------------------------------
    def _check_release(self) -> None:
        """Release NVML while a reset request stands (acknowledged once shut down); take it up
        again when none stands. An NVML handle holds /dev/nvidia*, and `nvidia-smi --gpu-reset`
        refuses a GPU that any process holds, this collector included."""
        wanted = set(self.release.pending())
        new = wanted - self.released_for
        if not wanted:
            self._release_wanted.clear()  # a request withdrawn before NVML could be released
        if wanted and not self.released_for:
            # Keep the event thread from taking the lock back, then wait for its current wait in
            # NVML to end (at most EVENT_WAIT_MS): answered within this tick.
            self._release_wanted.set()
            if not self._nvml_lock.acquire(timeout=RELEASE_LOCK_WAIT_S):
                log.warning("NVML release for the reset of GPU(s) %s: the event thread is still inside NVML "
                            "after %.1f s; trying again next tick", ", ".join(sorted(wanted)), RELEASE_LOCK_WAIT_S)
                return
            try:  # the event thread is not inside NVML now
                self.released_for = wanted
                self.nvml.shutdown()
            finally:
                self._nvml_lock.release()
                self._release_wanted.clear()  # `released_for` keeps the thread out from here
            log.warning("NVML released for the reset of GPU(s) %s; samples are `unavailable` until it is done",
                        ", ".join(sorted(wanted)))
        if wanted:
            self.released_for = wanted
            for uuid in new:
                self.release.released(uuid)  # after nvmlShutdown: the handles are gone
            return
        if self.released_for:
            try:
                with self._nvml_lock:
                    self.gpus = self.nvml.init()
            except NvmlUnavailable as exc:
                log.error("%s after the GPU reset; retrying next tick", exc)
                return
            for uuid in self.released_for:
                self.release.clear_released(uuid)
            log.warning("NVML taken up again after the reset of GPU(s) %s", ", ".join(sorted(self.released_for)))
            self.released_for = set()
            self._learn_identities()
            self._events_stale = True  # the event set was freed with the handles
            self._last_inventory = float("-inf")  # re-read and publish what changed at once

    def _answer_release_without_nvml(self) -> None:
        """Without NVML (`collect --no-nvml`, or NVML that failed to start) this collector holds no
        /dev/nvidia* handle, so it has nothing to release: it acknowledges at once, saying so
        (`held_nvml: false`), rather than leave the node executor to time out and refuse the reset.
        One line per request; an acknowledgement goes when its request is done or has expired."""
        wanted = set(self.release.pending())
        for uuid in sorted(wanted - self._acked_without_nvml):
            self.release.released(uuid, held_nvml=False)
            log.info("GPU %s: reset requested by the node executor; acknowledged at once, this collector has "
                     "no NVML open (kernel-log records only)", uuid)
        for uuid in self._acked_without_nvml - wanted:
            self.release.clear_released(uuid)
        self._acked_without_nvml = wanted

    def _sample_released(self, gpu: GpuIdentity, now: datetime) -> None:
        error = clip(f"NVML released for the reset of GPU(s) {', '.join(sorted(self.released_for))} (node executor)",
                     SHORT_TEXT_MAX)
        self._set_status(gpu, "unavailable", error)
        common = dict(ts=now, node=self.config.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id)
        self.sink.publish(GpuSample(**common, status="unavailable", error=error))
        self._publish_processes(gpu, now, None, error, [])

    def _holders_of(self, gpu: GpuIdentity, cut: list[str]) -> list[DeviceHolder] | None:
        """Who holds this GPU's /dev/nvidiaN by the last scan: None when no scan ran (no /proc, or
        not yet), which is unknown; an empty list says the scan found nobody."""
        if self._holders is None or self.procfs is None:
            return None
        minor = gpu.minor if gpu.minor is not None else gpu.index
        pids = _capped("device_holders", self._holders.get(f"{self.config.dev_prefix}{minor}", []), cut)
        return [DeviceHolder(pid=p, process_name=clip(self.procfs.comm(p), TASK_COMM_MAX)) for p in pids]

    def _publish_processes(self, gpu: GpuIdentity, now: datetime, apps: list[tuple[int, Any]] | None,
                           error: str | None, pmon: list[tuple[int, Any, Any]]) -> None:
        """One gpu.processes record. `apps`: NVML's compute processes as (pid, used MiB), None when
        unreadable; `pmon`: its (pid, sm %, mem %) rows. A list past PROCESSES_MAX is cut and
        `error` says so, so the record still fits its contract (schemas.limits) and goes out.
        A GPU known only by its NVML index has no known device minor: its holders are unknown."""
        cut: list[str] = []
        apps = _capped("compute_apps", apps, cut)
        pmon = _capped("pmon", pmon, cut)
        holders = self._holders_of(gpu, cut) if gpu.uuid not in self._unidentified else None
        compute = None
        if apps is not None:
            compute = []
            for pid, used in apps:
                ref = self.procfs.pod_of(pid) if self.procfs is not None else None
                name = self.nvml.process_name(pid) if self.nvml is not None else None
                name = name or (self.procfs.comm(pid) if self.procfs else None)
                compute.append(ComputeApp(pid=pid, process_name=clip(name, PROCESS_NAME_MAX), used_memory_mib=used,
                                          pod_uid=getattr(ref, "pod_uid", None), container_id=getattr(ref, "container_id", None)))
        self.sink.publish(GpuProcesses(
            ts=now, node=self.config.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id,
            compute_apps=compute, error=clip("; ".join(filter(None, [error, *cut])) or None, SHORT_TEXT_MAX),
            pmon=[PmonSample(pid=p, sm_util_pct=sm, mem_util_pct=mem) for p, sm, mem in pmon],
            device_holders=holders,
        ))

    def _sample_lost(self, gpu: GpuIdentity, now: datetime) -> None:
        """A GPU of the saved inventory that NVML refuses, or one it refuses at an index nothing
        saved names: lost, with nothing else known."""
        why = self._lost_why.get(gpu.uuid, "no handle")
        if gpu.uuid in self._unidentified:
            error = f"NVML refuses the GPU at index {gpu.index} ({why}); no saved inventory names it"
        else:
            error = f"NVML refuses this GPU ({why}); from the saved inventory"
        error = clip(error, SHORT_TEXT_MAX)
        self._set_status(gpu, "lost", error)
        common = dict(ts=now, node=self.config.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id)
        self.sink.publish(GpuSample(**common, status="lost", error=error))
        self._publish_processes(gpu, now, None, error, [])

    def _sample(self, gpu: GpuIdentity, now: datetime) -> None:
        reading = self.nvml.sample(gpu)
        self._set_status(gpu, reading.status, reading.error)
        self.sink.publish(GpuSample(
            ts=now, node=self.config.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id,
            status=reading.status, error=clip(reading.error, SHORT_TEXT_MAX), **reading.values,
        ))
        # A list NVML could not read is unknown (null), never "no compute process": the wedge and
        # phantom rules would take [] as evidence.
        if reading.status != "ok":
            apps, error = None, f"GPU {reading.status}: {reading.error}"
        else:
            apps = self.nvml.compute_apps(gpu)
            error = None if apps is not None else f"compute processes not readable: {self.nvml.last_error}"
        self._publish_processes(gpu, now, apps, error, list(self.nvml.pmon(gpu)) if reading.status == "ok" else [])

    def _publish_counters(self, gpu: GpuIdentity, now: datetime) -> None:
        """One gpu.counters record for this GPU, when any counter was read. NVML errors are data
        (NvmlReader.counters); anything else one GPU's read raises (an odd pynvml's struct, a value
        out of the contract) costs that GPU's record, logged once, never the loop."""
        try:
            reading = self.nvml.counters(gpu)
            if not reading.anything:
                return
            values = dict(reading.values)
            links = values.pop("nvlinks")
            self.sink.publish(GpuCounters(
                ts=now, node=self.config.node, gpu_uuid=gpu.uuid, gpu_index=gpu.index, pci_bus_id=gpu.pci_bus_id,
                nvlinks=[NvLinkCounters(**link) for link in links] if links is not None else None,
                unsupported=reading.unsupported, errors=reading.errors, **values,
            ))
        except Exception:  # noqa: BLE001 - one GPU's counters must not stop the collector
            if gpu.uuid not in self._counters_failed:
                self._counters_failed.add(gpu.uuid)
                log.exception("GPU %s (%s): cannot read or publish its counters; trying again every %g s",
                              gpu.index, gpu.uuid, self.config.counters_interval)

    # -- workloads -------------------------------------------------------------------------
    def _read_workloads(self, now: datetime) -> None:
        for item in self.workloads.read():
            item = {k: clip(v, _WORKLOAD_TEXT[k]) if k in _WORKLOAD_TEXT and isinstance(v, str) else v
                    for k, v in item.items()}
            try:
                self.sink.publish(WorkloadEvent(node=self.config.node, ts=item.pop("ts", now), **item))
            except Exception as exc:  # noqa: BLE001
                log.error("skipping a workload event %r: %s", item, exc)
