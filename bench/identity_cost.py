"""What checking a record's sender costs the processor: prints figures; not a test.

    .venv/bin/python bench/identity_cost.py [--records 200000]

The per-record work `xidstream process --enroller-key` adds on the hot path
(`xidstream.transport.identity.RecordVerifier.sender`: find the header, recompute the node's HMAC-SHA256
over topic, key and value, compare), on a real sample record's bytes, against what a node pays to
add it (`RecordAuth.header`) and, for scale, an Ed25519 verification of the same bytes (what a
signature per record would have cost instead). One core, in-process, best of 5 passes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xidstream.schemas import GpuSample, encode  # noqa: E402
from xidstream.schemas.signing import SigningKey, generate_keys  # noqa: E402
from xidstream.transport.identity import NodeIdentity, ProcessorIdentity, RecordVerifier  # noqa: E402


def best(fn, n: int) -> float:
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn(n)
        times.append((time.perf_counter() - t) / n)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        key = SigningKey.load(generate_keys(Path(tmp) / "k")[0])
        proc = ProcessorIdentity(key)
        node = NodeIdentity.load_or_create(Path(tmp) / "n", "gpu-node-0001")
        auth = node.record_auth(proc.public)
        verifier = RecordVerifier(proc)
        for i in range(12_500):  # a 100k-GPU fleet's nodes enrolled
            verifier.enroll(f"gpu-node-{i:04d}" if i else node.identity, node.x25519_public)
        rec = GpuSample(node=node.identity, gpu_uuid="GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81", gpu_index=1,
                        pci_bus_id="0000:17:00", utilization_gpu_pct=37.0, memory_used_mib=12000.0,
                        memory_total_mib=81559, power_w=310.0, sm_clock_mhz=1980, mem_clock_mhz=2619, status="ok")
        topic, rkey, value = "gpu.samples", rec.gpu_uuid.encode(), encode(rec)
        headers = [("traceparent", b"00-x"), auth.header(topic, rkey, value)]

        def check(n: int) -> None:
            for _ in range(n):
                verifier.sender(headers, topic, rkey, value)

        def add(n: int) -> None:
            for _ in range(n):
                auth.header(topic, rkey, value)

        from cryptography.hazmat.primitives.asymmetric import ed25519

        sk = ed25519.Ed25519PrivateKey.generate()
        sig, pk = sk.sign(value), sk.public_key()

        def ed(n: int) -> None:
            for _ in range(n):
                pk.verify(sig, value)

        n = args.records
        c, a, e = best(check, n), best(add, n), best(ed, max(n // 10, 1000))
    print(f"record: a {len(value)}-byte gpu.samples value, 12,500 identities enrolled")
    print(f"processor, check one record's sender (RecordVerifier.sender): {c * 1e6:.2f} us")
    print(f"collector, add the header (RecordAuth.header):                {a * 1e6:.2f} us")
    print(f"for scale, an Ed25519 verification of the same bytes:        {e * 1e6:.2f} us")
    print(f"at the worker's ~24 us per record (bench/processor_bench.py), the check adds {c / 24e-6:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
