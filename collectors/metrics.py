"""The collector's own Prometheus metrics, on a private registry, served on 127.0.0.1 by default,
with the health endpoints a kubelet probes on the same port:

- ``/healthz`` (liveness): the collection loop ticked within ``stale_after`` seconds (or the
  process started less than that ago). A hung loop fails it; the kubelet restarts the container.
- ``/readyz`` (readiness): alive, ticked at least once, and every source the collector was asked
  to read is open (``nvml``, ``kernel_log``). A collector that runs blind (NVML refused at start,
  journalctl exited) keeps publishing what it can but is not ready, and
  ``xidstream_collector_source_up{source}`` says which source is down.
"""

from __future__ import annotations

import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

__all__ = ["CollectorMetrics", "serve_wsgi"]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - probes every few seconds: no access log
        pass


def serve_wsgi(app, port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """Serve a WSGI app (metrics, probes) on a daemon thread, without an access log; `shutdown()`
    and `server_close()` stop it."""
    server = make_server(addr, port, app, _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class CollectorMetrics:
    def __init__(self, stale_after: float = 120.0, clock=time.monotonic) -> None:
        self.stale_after = stale_after
        self._clock = clock
        self._started = clock()
        self._last_tick: float | None = None
        self._sources: dict[str, tuple[bool, str]] = {}
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Gauge("xidstream_collector_records_published", "Records acknowledged by Kafka (or printed), per topic", ["topic"], registry=r)
        self.spool_depth = Gauge("xidstream_collector_spool_depth", "Records spooled on disk and not yet acknowledged", ["lane"], registry=r)
        self.dropped = Gauge("xidstream_collector_records_dropped", "Records dropped: spool over its bound, or refused by Kafka", registry=r)
        self.nvml_errors = Gauge("xidstream_collector_nvml_errors", "NVML reads that failed (not counting NotSupported, NotFound, NoData)", registry=r)
        self.nvml_event_failures = Gauge("xidstream_collector_nvml_event_wait_failures",
                                         "NVML event waits that failed (not Timeout); the event set is re-created after a back-off", registry=r)
        self.kernel_lines = Counter("xidstream_collector_kernel_lines", "Kernel log lines read", registry=r)
        self.kernel_records = Counter("xidstream_collector_kernel_records", "Xid and related records found", ["kind"], registry=r)
        self.xids = Counter("xidstream_collector_xids", "Xid records found in the kernel log, by Xid code (\"other\": "
                            "a code outside NVIDIA's catalog)", ["xid"], registry=r)
        # Lines that name the driver but are not the driver's own record (collectors.parse.REFUSALS):
        # a rise in "quoted" or "facility" is someone trying to forge an Xid; "error" is a parser bug.
        self.kernel_refused = Counter("xidstream_collector_kernel_refused",
                                      "Kernel log lines naming the driver refused as not its own record, by reason",
                                      ["reason"], registry=r)
        self.kmsg_lost = Gauge("xidstream_collector_kmsg_overwritten", "Times the kernel ring buffer overwrote unread records", registry=r)
        self.gpu_status = Gauge("xidstream_collector_gpu_status", "1 for the GPU's current NVML status", ["gpu_uuid", "status"], registry=r)
        # A GPU NVML refuses is published as lost (collectors.agent): by its UUID where the
        # inventory saved by an earlier run names it, else by its NVML index alone (a first start
        # after the GPU fell off the bus), which no gpu_status series can name by UUID.
        self.lost_gpus = Gauge("xidstream_collector_lost_gpus",
                               "GPUs published as lost because NVML refuses them or no longer lists them, by what "
                               "names them: saved (the inventory saved when NVML last read them), index (refused "
                               "with nothing saved: published as <node>/ffff:00:<index>)", ["identity"], registry=r)
        for identity in ("saved", "index"):
            self.lost_gpus.labels(identity).set(0)
        self.loop_seconds = Histogram("xidstream_collector_loop_seconds", "Duration of one collection tick",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)
        self.source_up = Gauge("xidstream_collector_source_up",
                               "1 when the source is open and read, 0 when it is unavailable (then /readyz fails)",
                               ["source"], registry=r)

    # -- health ------------------------------------------------------------------------------
    def set_source(self, name: str, up: bool, reason: str = "") -> None:
        """A source the collector was asked to read (`nvml`, `kernel_log`) is open, or not and why."""
        with self._lock:
            self._sources[name] = (up, reason)
        self.source_up.labels(name).set(1 if up else 0)

    def tick_done(self) -> None:
        self._last_tick = self._clock()

    def liveness(self) -> tuple[bool, str]:
        now = self._clock()
        if self._last_tick is None:
            age = now - self._started
            return age < self.stale_after, f"no tick yet, {age:.0f} s after start (limit {self.stale_after:.0f} s)"
        age = now - self._last_tick
        return age < self.stale_after, f"last tick {age:.1f} s ago (limit {self.stale_after:.0f} s)"

    def readiness(self) -> tuple[bool, str]:
        alive, why = self.liveness()
        lines = [f"alive: {why}" if alive else f"not alive: {why}"]
        ok = alive
        if self._last_tick is None:
            ok = False
            lines.append("not ready: no collection tick yet")
        with self._lock:
            sources = dict(self._sources)
        for name, (up, reason) in sorted(sources.items()):
            ok = ok and up
            lines.append(f"{name}: {'up' if up else 'down'}" + (f" ({reason})" if reason else ""))
        return ok, "\n".join(lines) + "\n"

    def wsgi_app(self):
        """/metrics (any other path too, as prometheus_client serves), /healthz and /readyz."""
        metrics = make_wsgi_app(self.registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path in ("/healthz", "/readyz"):
                ok, text = self.liveness() if path == "/healthz" else self.readiness()
                if path == "/healthz":
                    text += "\n"
                start_response("200 OK" if ok else "503 Service Unavailable",
                               [("Content-Type", "text/plain; charset=utf-8")])
                return [text.encode()]
            return metrics(environ, start_response)

        return app

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        self._server = serve_wsgi(self.wsgi_app(), port, addr)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def update_sink(self, stats: dict) -> None:
        for topic, n in stats.get("published", {}).items():
            self.published.labels(topic).set(n)
        depth = stats.get("spool_depth", 0)
        if isinstance(depth, dict):
            for lane, n in depth.items():
                self.spool_depth.labels(lane).set(n)
        else:
            self.spool_depth.labels("all").set(depth)
        self.dropped.set(stats.get("dropped", 0))
