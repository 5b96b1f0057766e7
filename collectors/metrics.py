"""The collector's own Prometheus metrics, on a private registry, served on 127.0.0.1 by default."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["CollectorMetrics"]


class CollectorMetrics:
    def __init__(self) -> None:
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
        self.kmsg_lost = Gauge("xidstream_collector_kmsg_overwritten", "Times the kernel ring buffer overwrote unread records", registry=r)
        self.gpu_status = Gauge("xidstream_collector_gpu_status", "1 for the GPU's current NVML status", ["gpu_uuid", "status"], registry=r)
        self.loop_seconds = Histogram("xidstream_collector_loop_seconds", "Duration of one collection tick",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0), registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

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
