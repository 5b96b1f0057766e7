"""The GPU agent's work per record without Kafka, in figures a busy machine does not move: prints figures; not a test.

    .venv/bin/python bench/worker_path_bench.py [--checkout DIR] [--gpus 2000] [--seconds 20] [--repeats 5]

The processor bench's load (`xidstream.simulate.Simulator`, no faults: `--gpus` GPUs x `--seconds`
of 1 Hz samples and process lists, + one inventory per GPU), encoded and keyed as the collector's
sink publishes it, then three passes over it, each on fresh state:

- decode: `xidstream.streams.app.decode_input` with the model of the record's topic (`decode_any` where a
  checkout has no such function), what the worker does to every input record;
- fold: `xidstream.streams.routing.state_key` and `xidstream.streams.classify.step` over the decoded records (the pure
  path, as `bench/pure_path_bench.py`);
- agent: every record through the GPU agent's own body (`agent.test_context()`, in-memory table,
  sends counted and dropped) in batches of 500 (`create_app`'s batch), the events built first:
  decode, identity and ownership checks, the fold, `fan_out`, table writes per batch.

For each: Python function calls per record (`sys.setprofile`, C functions included: the same on
every run and machine for one checkout) and CPU us per record (`time.process_time`, median of
`--repeats`). The agent pass also prints the table rows written and the messages sent per record:
each is a producer send on the real broker, which this pass does not pay.

Not covered: aiokafka's fetch and the records it parses, faust_fast's delivery, commits, and the
producer's sends (`bench/processor_bench.py` measures the whole worker on the broker).
`--checkout` runs the same passes on another checkout (an older commit in a `git worktree`), so
figures of two commits come from one script.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import logging
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BATCH = 500  # streams.app.create_app's default batch
START = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)  # a fixed start: the same bytes on every run


class _Capture:
    """A sink that keeps what the simulator publishes."""

    def __init__(self) -> None:
        self.records: list = []

    def publish(self, record, on_ack=None) -> None:
        self.records.append(record)

    def poll(self) -> None:
        pass

    def stats(self) -> dict:
        return {"published": {}, "spool_depth": 0, "dropped": 0}


class _Calls:
    """A profile hook that counts Python and C function calls."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call" or event == "c_call":
            self.n += 1


def load(settings, gpus: int, seconds: int) -> list[tuple[str, bytes, bytes]]:
    from xidstream.schemas import encode
    from xidstream.simulate import FaultRates, Simulator

    sim = Simulator(settings, max(1, gpus // 8), 8, duration=seconds, rates=FaultRates(0, 0, 0, 0, 0), start=START)
    sink = _Capture()
    sim.run(sink, speed=0, progress=None)
    return [(*settings.topics.for_record(r), encode(r)) for r in sink.records]


def decode_pass(settings, recs: list, count: bool) -> tuple[float, list]:
    import xidstream.streams.app as sapp
    from xidstream.schemas import decode_any

    models = getattr(sapp, "_MODELS", {})
    names = {settings.topics.name(n): n for n in models}
    decode_input = getattr(sapp, "decode_input", None)
    out: list = []
    # Only the counting pass keeps what it decoded (for the fold): 82,000 records kept alive made
    # every later collection of the timed passes walk them, a third of the time per record.
    keep = out.append if count else (lambda record: None)
    calls = _Calls()
    if count:
        sys.setprofile(calls)
    t0 = time.process_time()
    for topic, _, raw in recs:
        logical = names.get(topic)
        keep(decode_input(models[logical], raw) if decode_input and logical else decode_any(raw))
    cpu = time.process_time() - t0
    sys.setprofile(None)
    return (calls.n if count else cpu), out


def fold_pass(records: list, count: bool) -> float:
    from xidstream.streams.classify import step
    from xidstream.streams.policy import Policy
    from xidstream.streams.routing import state_key

    policy, states = Policy(), {}
    calls = _Calls()
    if count:
        sys.setprofile(calls)
    t0 = time.process_time()
    for r in records:
        key = state_key(r)
        states[key], _, _ = step(states.get(key), key, r, policy)
    cpu = time.process_time() - t0
    sys.setprofile(None)
    return calls.n if count else cpu


async def agent_pass(settings, recs: list, count: bool) -> dict:
    from faust.types import Message

    from xidstream.streams.app import create_app

    proc = create_app(settings)
    sent: collections.Counter = collections.Counter()

    def counted(name):
        async def send(*args, **kwargs):
            sent[name] += 1
        return send

    for name in ("alerts", "fleet_topic", "remediation", "deadletter", "results_by_gpu"):
        getattr(proc, name).send = counted(name)
    async with proc.gpus.test_context() as agent:
        channel = agent.stream().channel
        generation = proc.app.consumer_generation_id  # take_batches drops an event of another generation
        events = [await channel.decode(Message(
            topic=topic, partition=0, offset=i, timestamp=1.0, timestamp_type=0, headers=None, key=key, value=raw,
            checksum=b"", serialized_key_size=0, serialized_value_size=0, generation_id=generation))
            for i, (topic, key, raw) in enumerate(recs)]
        gc.collect()
        calls = _Calls()
        if count:
            sys.setprofile(calls)
        t0 = time.process_time()
        for j in range(0, len(events), BATCH):
            for event in events[j:j + BATCH]:
                await channel.put(event)
            # a full batch is taken and folded before the agent waits again: this task runs next
            # once every event put so far went through the agent's body
            while agent.processed_offset < min(j + BATCH, len(events)):
                await asyncio.sleep(0)
        cpu = time.process_time() - t0
        sys.setprofile(None)
    stats = getattr(proc, "stats", {}) or {}
    return {"calls": calls.n, "cpu": cpu, "rows_written": stats.get("rows_written", 0), "sent": dict(sent)}


class _OldLayout:
    """A checkout from before the one namespace (issue 44) has its libraries at top level
    (`import streams`): `xidstream.<library>[.module]` is made the very module object of
    `<library>[.module]`, so that this script's imports and the old code's share one copy."""

    LIBRARIES = ("schemas", "transport", "collectors", "streams", "executors", "exporters")

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (the finder protocol)
        import importlib.machinery

        head, _, rest = fullname.partition(".")
        if head != "xidstream" or rest.split(".")[0] not in self.LIBRARIES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # noqa: ANN001
        import importlib

        return importlib.import_module(spec.name.removeprefix("xidstream."))

    def exec_module(self, module):  # noqa: ANN001 (already executed under its old name)
        pass


def _alias_old_layout(checkout: Path) -> None:
    if (checkout / "streams").is_dir() and "_CheckoutLibraries" not in (checkout / "xidstream" / "__init__.py").read_text():
        sys.meta_path.insert(0, _OldLayout())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the checkout whose code runs (default: this script's)")
    ap.add_argument("--gpus", type=int, default=2000)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="timed passes of each kind (0: calls only)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.checkout.resolve()))
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # test_context's end of stream, at exit

    _alias_old_layout(args.checkout.resolve())
    import xidstream.streams as streams
    from xidstream.settings import Settings

    if not Path(streams.__file__).resolve().is_relative_to(args.checkout.resolve()):
        raise SystemExit(f"streams was imported from {streams.__file__}, not from {args.checkout}")
    settings = Settings(topic_prefix="pathbench.")
    recs = load(settings, args.gpus, args.seconds)
    n = len(recs)
    kinds = collections.Counter(topic.removeprefix(settings.topic_prefix) for topic, _, _ in recs)
    print(f"{args.checkout}: {n:,} records ({args.gpus} GPUs x {args.seconds} s: {dict(kinds)}), "
          f"{sum(len(r) for _, _, r in recs) / n:.0f} bytes each on average", flush=True)

    def timed(run) -> str:
        cpus = []
        for _ in range(args.repeats):
            gc.collect()
            cpus.append(run() / n * 1e6)
        return f"{statistics.median(cpus):6.2f} us/record (median of {args.repeats})" if cpus else ""

    calls, decoded = decode_pass(settings, recs, True)
    print(f"decode: {calls / n:7.2f} calls/record  {timed(lambda: decode_pass(settings, recs, False)[0])}", flush=True)
    calls = fold_pass(decoded, True)
    print(f"fold:   {calls / n:7.2f} calls/record  {timed(lambda: fold_pass(decoded, False))}", flush=True)
    counted = asyncio.run(agent_pass(settings, recs, True))
    print(f"agent:  {counted['calls'] / n:7.2f} calls/record  "
          f"{timed(lambda: asyncio.run(agent_pass(settings, recs, False))['cpu'])}", flush=True)
    sent = ", ".join(f"{k} {v / n:.4f}" for k, v in sorted(counted["sent"].items())) or "none"
    print(f"agent:  table rows written {counted['rows_written'] / n:.4f}/record; sent per record: {sent}")


if __name__ == "__main__":
    main()
