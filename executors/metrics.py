"""The executors' Prometheus metrics (`xidstream execute --metrics-port`): what they answered, by
action and outcome, and the commands held for an approval (how many, the oldest one's age), which
the chart's alert rules page on (a command held longer than a human is expected to look)."""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from xidstream.collectors.metrics import serve_wsgi
from xidstream.executors.gate import DRY_RUN_PREFIX, SCOPE_ACTIONS
from xidstream.schemas.vocab import Outcome

__all__ = ["ExecutorMetrics"]


class ExecutorMetrics:
    def __init__(self, scope: str, held: Callable[[], dict[str, float]], clock: Callable[[], float] = time.time) -> None:
        """`held()`: command id -> the epoch seconds since it has been held."""
        self.registry = r = CollectorRegistry()
        self._held, self._clock = held, clock
        self._server: Any = None
        self.results = Counter("xidstream_executor_results", "Results published, by action and outcome; dry_run "
                               "\"true\" for a dry run's answer (outcome refused, nothing done)",
                               ["scope", "action", "outcome", "dry_run"], registry=r)
        held_n = Gauge("xidstream_executor_held_commands", "Commands held for an approval now", ["scope"], registry=r)
        held_n.labels(scope).set_function(lambda: len(self._held()))
        oldest = Gauge("xidstream_executor_oldest_held_age_seconds",
                       "Seconds the oldest command held for an approval has waited (0 when none)", ["scope"], registry=r)
        oldest.labels(scope).set_function(self._oldest)
        self.scope = scope
        # Every series this executor can answer exists from the start, at 0: increase() over a
        # series whose first sample is already 1 is 0, and the first refusal would never page.
        for action in SCOPE_ACTIONS.get(scope, ()):
            for outcome in Outcome:
                self.results.labels(scope, action.value, outcome.value, "false")

    def _oldest(self) -> float:
        since = self._held().values()
        return max(0.0, self._clock() - min(since)) if since else 0.0

    def result(self, action: Any, outcome: Any, detail: str = "") -> None:
        self.results.labels(self.scope, str(getattr(action, "value", action)), str(getattr(outcome, "value", outcome)),
                            "true" if detail.startswith(DRY_RUN_PREFIX) else "false").inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        self._server = serve_wsgi(make_wsgi_app(self.registry), port, addr)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
