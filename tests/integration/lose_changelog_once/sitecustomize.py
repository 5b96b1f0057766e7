"""Fault injection for `test_failover.py::test_recovery_reads_again_changelog_records_it_lost`,
loaded only by the worker that test starts (this folder first on its PYTHONPATH): each changelog
record is dropped the first time it reaches a table's queue, after aiokafka has handed it over (the
test's worker runs alone, so those are its recovery's reads; a standby's would be dropped too). That is the loss seen in the failover bench (recovery waited
for records aiokafka had already read past); where the real one happens is not known, so the test
injects it at the last step before recovery."""

import os

if os.environ.get("XIDSTREAM_TEST_LOSE_CHANGELOG_ONCE") == "1":
    from mode.utils.queues import FlowControlQueue

    _seen: set = set()
    _put = FlowControlQueue.put_nowait_enhanced

    def put_nowait_enhanced(self, value, **kwargs):  # type: ignore[no-untyped-def]
        message = getattr(value, "message", None)
        if message is not None and message.topic.endswith("-changelog"):
            key = (message.topic, message.partition, message.offset)
            if key not in _seen:
                _seen.add(key)
                return None  # lost on its way to recovery, once
        return _put(self, value, **kwargs)

    FlowControlQueue.put_nowait_enhanced = put_nowait_enhanced
