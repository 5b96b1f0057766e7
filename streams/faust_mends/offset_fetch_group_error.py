"""aiokafka 0.14.0: an OffsetFetch answered with a group-level error reads as "nothing committed".

OffsetFetch v2 and later carry a group-level error at the top of the response, with no partitions
(a coordinator that moved answers NOT_COORDINATOR so). `GroupCoordinator._do_fetch_commit_offsets`
(aiokafka/consumer/group_coordinator.py) reads only the partitions, so it returns ``{}``: no
committed offset for any partition, and they were read again from their beginning (or the reset
sent them to ListOffsets, `offset_reset_stale_leader`). A partition-level COORDINATOR_NOT_AVAILABLE
(15) it raises as a non-retriable `KafkaError`. Found by the three-broker tier (a leader SIGKILLed,
a rolling restart). No upstream issue found; `patches/offset_fetch_group_error.patch` checks the
top-level error and treats 15 as it treats NOT_COORDINATOR.

Here, on the coordinator's requests: an OffsetFetch response with COORDINATOR_LOAD_IN_PROGRESS
(14), COORDINATOR_NOT_AVAILABLE (15) or NOT_COORDINATOR (16), at the top or for a partition, marks
the coordinator dead (not for 14: a coordinator loading its offsets is still the coordinator) and
raises that retriable error, which `fetch_committed_offsets` retries against the coordinator it
finds again; any other top-level error (GROUP_AUTHORIZATION_FAILED) is raised, never "nothing
committed".
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

GROUP_ERRORS = {14, 15, 16}  # COORDINATOR_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR
OFFSET_FETCH = 9  # the OffsetFetch API key


def mend(consumer: Any) -> None:
    """Wrap the requests of a started aiokafka consumer's group coordinator (none: nothing to do)."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is not None:
        coordinator._send_req = group_errors_raised(coordinator, coordinator._send_req)


def group_errors_raised(coordinator: Any, send: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    from aiokafka.errors import for_code

    async def send_req(request: Any) -> Any:
        response = await send(request)
        if getattr(response, "API_KEY", None) != OFFSET_FETCH:
            return response
        top = getattr(response, "error_code", 0)
        codes = [top] + [part[-1] for _, parts in response.topics for part in parts]
        group = next((c for c in codes if c in GROUP_ERRORS), None)
        if group is not None:
            if group != 14:  # a coordinator loading its offsets is still the coordinator
                coordinator.coordinator_dead()
            raise for_code(group)()
        if top:  # any other group-level error (GROUP_AUTHORIZATION_FAILED): never "nothing committed"
            raise for_code(top)()
        return response

    return send_req
