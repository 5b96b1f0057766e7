"""The reset handshake, collector side (collectors.nvml.NvmlRelease + collectors.agent.Collector),
with the fake NVML: a request in the collector's state dir shuts its NVML down (an NVML handle holds
/dev/nvidia*, and `nvidia-smi --gpu-reset` refuses a GPU any process holds), acknowledges, publishes
`unavailable` samples meanwhile, and takes NVML up again when the request is done or has expired.
The executor side runs on the real API server in tests/integration/test_executors_node.py."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

from xidstream.collectors.agent import Collector, CollectorConfig
from xidstream.collectors.fakes import FakeGpu, FakePynvml
from xidstream.collectors.nvml import NvmlReader, NvmlRelease
from xidstream.collectors.sink import MemorySink
from xidstream.schemas import GpuSample

UUID0, UUID1 = "GPU-00000000-aaaa-bbbb-cccc-000000000000", "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rig(tmp_path, clock=None):
    fake = FakePynvml([FakeGpu(0, UUID0, "00000000:01:00.0"), FakeGpu(1, UUID1, "00000000:02:00.0")])
    sink = MemorySink()
    c = Collector(CollectorConfig(node="n"), sink, nvml=NvmlReader(fake), nvml_events_thread=False,
                  state_dir=tmp_path / "collector", nvml_release=NvmlRelease(tmp_path / "collector", clock=clock or Clock()))
    c.start(datetime.now(timezone.utc))
    return fake, sink, c


def samples(sink: MemorySink, since: int) -> dict[str, str]:
    return {r.gpu_uuid: r.status.value for r in sink.records[since:] if isinstance(r, GpuSample)}


def test_collector_releases_nvml_for_a_reset_and_takes_it_up_again(tmp_path):
    clock = Clock()
    fake, sink, c = rig(tmp_path, clock)
    executor = NvmlRelease(tmp_path / "collector", clock=clock)  # the node executor's view of the same dir
    c.tick(datetime.now(timezone.utc))
    assert fake.initialized and samples(sink, 0) == {UUID0: "ok", UUID1: "ok"}

    executor.request(UUID1, command_id="cmd-1", hold_s=60)
    assert executor.wait_released(UUID1, 0) is None  # nobody has answered yet
    n = len(sink.records)
    c.tick(datetime.now(timezone.utc))
    assert not fake.initialized  # nvmlShutdown: no handle holds /dev/nvidia* any more
    ack = executor.wait_released(UUID1, 0)
    assert ack is not None and ack["gpu_uuid"] == UUID1
    # every GPU is unread meanwhile (NVML handles are per process), said as such, never "ok"
    assert samples(sink, n) == {UUID0: "unavailable", UUID1: "unavailable"}
    assert all("released for the reset" in (r.error or "") for r in sink.records[n:])
    c.tick(datetime.now(timezone.utc))
    assert not fake.initialized

    executor.done(UUID1)  # reset and re-read done
    n = len(sink.records)
    c.tick(datetime.now(timezone.utc))
    assert fake.initialized and samples(sink, n) == {UUID0: "ok", UUID1: "ok"}
    assert list((tmp_path / "collector" / "nvml-release").glob("reset-*")) == []
    c.stop()


def test_a_recovery_action_event_is_forgotten_across_the_reset(tmp_path):
    """A GPU whose recovery-action field is unreadable gets the event's action (Xid 154's "GPU
    reset required") in its samples; the reset repairs it, and the samples after the collector
    takes NVML up again must not still say "reset required" (a verification would read it as now)."""
    clock = Clock()
    fake = FakePynvml([FakeGpu(0, UUID0, "00000000:01:00.0"), FakeGpu(1, UUID1, "00000000:02:00.0", recovery_action=None)])
    sink = MemorySink()
    c = Collector(CollectorConfig(node="n"), sink, nvml=NvmlReader(fake), nvml_events_thread=False,
                  state_dir=tmp_path / "collector", nvml_release=NvmlRelease(tmp_path / "collector", clock=clock))
    c.start(datetime.now(timezone.utc))
    executor = NvmlRelease(tmp_path / "collector", clock=clock)
    fake.inject_recovery_action(1, 1)  # NVML_GPU_RECOVERY_ACTION_GPU_RESET, by event only
    c.tick(datetime.now(timezone.utc))

    def action(since: int) -> int | None:
        return [r for r in sink.records[since:] if isinstance(r, GpuSample) and r.gpu_uuid == UUID1][-1].recovery_action

    assert action(0) == 1
    executor.request(UUID1, command_id="cmd-1", hold_s=60)
    c.tick(datetime.now(timezone.utc))
    assert executor.wait_released(UUID1, 0) is not None
    executor.done(UUID1)  # reset and verified by the executor
    n = len(sink.records)
    c.tick(datetime.now(timezone.utc))
    assert fake.initialized and action(n) is None
    c.stop()


def test_an_abandoned_request_expires_and_the_collector_resumes(tmp_path):
    clock = Clock()
    fake, sink, c = rig(tmp_path, clock)
    NvmlRelease(tmp_path / "collector", clock=clock).request(UUID1, hold_s=30)
    c.tick(datetime.now(timezone.utc))
    assert not fake.initialized
    clock.t += 31  # the executor died mid-reset: the collector does not stay blind
    n = len(sink.records)
    c.tick(datetime.now(timezone.utc))
    assert fake.initialized and samples(sink, n) == {UUID0: "ok", UUID1: "ok"}
    assert not (tmp_path / "collector" / "nvml-release" / f"reset-{UUID1}.released").exists()
    c.stop()


def test_the_release_is_answered_within_a_tick_while_the_event_thread_waits(tmp_path):
    """With NVML's event thread running (as `xidstream collect` runs), the tick that sees a request
    shuts NVML down and acknowledges it without stalling: the event thread used to take the NVML
    lock straight back after each 0.5 s wait, and the tick waited seconds for it (the node executor
    gives up at 10 s). Each tick must stay within the loop's 1 s interval: it waits at most for the
    thread's current wait (EVENT_WAIT_MS) to end, so under 0.8 s with slack for a busy machine
    (before, every run's slowest of five was 1.0 s or more, once 9.5 s of ten); five requests,
    catching the thread at five points of its wait."""
    import time

    from xidstream.collectors.agent import EVENT_WAIT_MS

    clock = Clock()
    fake = FakePynvml([FakeGpu(0, UUID0, "00000000:01:00.0"), FakeGpu(1, UUID1, "00000000:02:00.0")])
    c = Collector(CollectorConfig(node="n"), MemorySink(), nvml=NvmlReader(fake), nvml_events_thread=True,
                  state_dir=tmp_path / "collector", nvml_release=NvmlRelease(tmp_path / "collector", clock=clock))
    c.start(datetime.now(timezone.utc))
    executor = NvmlRelease(tmp_path / "collector", clock=clock)
    slowest = 0.0
    try:
        for i in range(5):
            time.sleep(0.1 * i)  # catch the event thread at another point of its wait each time
            executor.request(UUID1, command_id=f"cmd-{i}", hold_s=60)
            started = time.monotonic()
            c.tick(datetime.now(timezone.utc))
            took = time.monotonic() - started
            slowest = max(slowest, took)
            assert executor.wait_released(UUID1, 0) is not None, f"request {i}: not answered in the tick that saw it"
            assert not fake.initialized
            executor.done(UUID1)
            c.tick(datetime.now(timezone.utc))
            assert fake.initialized
        assert slowest < EVENT_WAIT_MS / 1000 + 0.3, f"a release tick took {slowest:.2f} s"
    finally:
        c.stop()


def test_an_nvml_wait_that_overstays_costs_the_release_a_tick_not_the_loop(tmp_path):
    """A driver whose event wait outlasts its timeout holds the NVML lock: the tick gives up after
    RELEASE_LOCK_WAIT_S, samples on, and the next tick answers once the wait has ended."""
    import time

    from xidstream.collectors.agent import RELEASE_LOCK_WAIT_S

    fake, sink, c = rig(tmp_path)
    executor = NvmlRelease(tmp_path / "collector", clock=Clock())
    executor.request(UUID1, hold_s=60)
    c._nvml_lock.acquire()  # the event thread, stuck inside nvmlEventSetWait
    started = time.monotonic()
    c.tick(datetime.now(timezone.utc))
    assert time.monotonic() - started < RELEASE_LOCK_WAIT_S + 0.5
    assert executor.wait_released(UUID1, 0) is None and fake.initialized
    assert samples(sink, 0) == {UUID0: "ok", UUID1: "ok"}  # the loop went on
    c._nvml_lock.release()
    c.tick(datetime.now(timezone.utc))
    assert executor.wait_released(UUID1, 0) is not None and not fake.initialized
    c.stop()


def test_wait_released_sees_an_acknowledgement_written_meanwhile(tmp_path):
    rel = NvmlRelease(tmp_path)
    rel.request(UUID1)
    threading.Timer(0.2, rel.released, args=(UUID1,)).start()
    ack = rel.wait_released(UUID1, 5)
    assert ack is not None and ack["gpu_uuid"] == UUID1
    assert set(rel.pending()) == {UUID1}
    rel.done(UUID1)
    assert rel.pending() == {} and rel.wait_released(UUID1, 0) is None
