"""Throughput of the Parquet landing: N gpu.samples records on the local broker ->
`exporters` Kafka loop -> rolled, fsynced Parquet files; prints records/s.

    .venv/bin/python bench/export_bench.py [--records 200000] [--bootstrap 127.0.0.1:19092]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Producer  # noqa: E402

from xidstream.exporters.parquet import ParquetLander  # noqa: E402
from xidstream.exporters.pipeline import Exporter, ParquetSink  # noqa: E402
from xidstream.schemas import GpuSample  # noqa: E402
from xidstream.schemas.codec import encode  # noqa: E402
from xidstream.transport.config import KafkaConfig  # noqa: E402
from xidstream.transport.kafka import create_topics, delete_topics, producer_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--bootstrap", default="127.0.0.1:19092")
    ap.add_argument("--roll-mb", type=float, default=16.0)
    args = ap.parse_args()
    cfg = KafkaConfig(bootstrap=args.bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:8]}.", partitions=8,
                      node="bench")
    create_topics(cfg)
    try:
        t0 = datetime(2026, 11, 28, tzinfo=timezone.utc)
        p = Producer(producer_config(cfg, **{"linger.ms": 50}))
        topic = cfg.topics.name("gpu.samples")
        start = time.perf_counter()
        for i in range(args.records):
            g = f"GPU-{i % 1000:08d}-0000-0000-0000-000000000000"
            s = GpuSample(ts=t0 + timedelta(milliseconds=i * 40), node=f"node-{i % 125}", gpu_uuid=g, gpu_index=i % 8,
                          pci_bus_id="0000:01:00", utilization_gpu_pct=float(i % 100), memory_used_mib=1024.0,
                          memory_total_mib=32607.0, power_w=250.0, sm_clock_mhz=2000, temperature_c=60)
            while True:
                try:
                    p.produce(topic, encode(s), key=g.encode())
                    break
                except BufferError:
                    p.poll(0.05)
            p.poll(0)
        p.flush(120)
        print(f"produced {args.records:,} gpu.samples in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        with tempfile.TemporaryDirectory() as out:
            lander = ParquetLander(out, max_bytes=int(args.roll_mb * (1 << 20)), max_seconds=300)
            exporter = Exporter("ocsf", ParquetSink(lander, "ocsf"), lander=lander)
            start = time.perf_counter()
            stats = exporter.run_kafka(cfg, f"{cfg.topic_prefix}bench", telemetry=True, max_records=args.records,
                                       idle_exit=10)
            secs = time.perf_counter() - start
            size = sum(f.stat().st_size for f in Path(out).rglob("*.parquet"))
            print(f"parquet landing: {stats.landed:,} records in {secs:.1f} s = {stats.landed / secs:,.0f} records/s "
                  f"({stats.files} files, {size / 1e6:.1f} MB zstd, {stats.commits} commits; consumer group join included)")
    finally:
        delete_topics(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
