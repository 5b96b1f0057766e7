"""An output the producer refuses for good is dead-lettered and the worker goes on, on the real
broker with a real worker process.

A record of 950 KB that does not decode is dead-lettered; its dead letter carried it whole, in
base64 inside JSON (1.27 MB), over faust's 1,000,000-byte producer limit. The refusal escaped the
agent, the worker stopped, and its restart read the same uncommitted record again: a crash loop, and
no command left the processor for any GPU."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from xidstream.schemas import Action, encode
from xidstream.streams.app import DEADLETTER_ORIGINAL_BYTES
from tests.integration.test_processor_on_broker import outputs, start_worker, stop_worker
from tests.streams.builders import NODE, xid
from xidstream.transport.kafka import producer_config

# slow (make test-all only): oversized dead letters on the broker
pytestmark = [pytest.mark.broker, pytest.mark.slow]

GPU_A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
HUGE = 950_000  # under the broker's and the test producer's 1 MB, over the producer's limit in base64


def test_a_record_whose_dead_letter_is_too_large_is_dead_lettered_bounded_and_the_next_record_gets_its_command(
        kafka_settings, tmp_path):
    s = kafka_settings
    reg = s.topics
    garbage = b"\xff" + b"x" * HUGE  # not JSON: a DecodeError, so a dead letter
    p = Producer(producer_config(s))
    # On the GPU agent's input, then a fatal Xid of the same GPU behind it in the same partition, and
    # on the results agent's input: either refusal stopped the worker before.
    p.produce(reg.name("gpu.xid"), key=GPU_A.encode(), value=garbage)
    p.produce(reg.name("gpu.remediation.results"), key=NODE.encode(), value=garbage)
    fatal = xid(100, 79, pid=None, gpu=GPU_A)
    p.produce(reg.name("gpu.xid"), key=GPU_A.encode(), value=encode(fatal))
    assert p.flush(30) == 0

    worker = start_worker(s, tmp_path)
    got: list = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and worker.poll() is None:
            got = outputs(s, timeout=4)
            if any(t == "gpu.remediation" for t, _ in got) and sum(t == "xidstream.deadletter" for t, _ in got) >= 2:
                break
        alive = worker.poll() is None
    finally:
        stop_worker(worker)
    log = (tmp_path / "w.log").read_text()[-3000:]
    assert alive, f"the worker exited ({worker.returncode}):\n{log}"
    commands = [r for t, r in got if t == "gpu.remediation" and r.gpu_uuid == GPU_A]
    assert Action.CORDON_NODE in {c.action for c in commands}, log
    dead = sorted((r for t, r in got if t == "xidstream.deadletter"), key=lambda r: r.source_topic)
    assert [d.source_topic for d in dead] == sorted([reg.name("gpu.remediation.results"), reg.name("gpu.xid")])
    for d in dead:
        # the head of the record, byte for byte, and where it came from: enough to find the rest
        assert d.original == garbage[:DEADLETTER_ORIGINAL_BYTES]
        assert f"the first {DEADLETTER_ORIGINAL_BYTES:,} of {len(garbage):,} bytes" in d.error
        assert d.error_type == "DecodeError" and d.source_offset == 0 and d.source_partition is not None
    assert {d.original_key for d in dead} == {GPU_A.encode(), NODE.encode()}
