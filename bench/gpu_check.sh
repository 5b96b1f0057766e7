#!/usr/bin/env bash
# Real-NVML check of the collector. Run on a machine with an NVIDIA GPU and driver:
#     bash bench/gpu_check.sh [OUT_DIR]
# 1. `xidstream gpu-check`: every field per GPU through the real pynvml (memory v2 and reserved,
#    recovery action, remapped rows, volatile DBE, event registration), then NVML shut down and
#    initialised again as the collector's release for a GPU reset does (same GPUs), exit code 0 / 3.
# 2. The collector's NvmlReader on the real module: the issue-9 fields are present, the NVML error
#    counter stays at 0 on healthy GPUs (NotSupported/NoData are not errors), 30 samples per GPU
#    timed, and the event set re-registers without error.
#    Then the counters (gpu.counters): every field per GPU, what the board does not support, the
#    time of a read (first, with the NVLink probe, then p50 of 10), errors 0 on healthy GPUs.
# 3. One `xidstream collect --sink stdout --once` round, checked against the contract: a
#    gpu.counters record per GPU with its PCIe and clock fields read.
# 4. The node executor's reset facts, read only (nothing reset, no persistence mode changed): each
#    GPU's platform (architecture, MIG, virtualization, NVSwitch, Fabric Manager), the scope rule's
#    answer, persistence mode through nvidia-smi, and who holds /dev/nvidia<minor>.
# Prints figures; exits non-zero when a check fails. Takes about 20 s.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/xidstream-gpu-check}}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
rc=0
nvidia-smi -L > "$OUT/nvidia-smi.txt" 2>&1; nvidia-smi >> "$OUT/nvidia-smi.txt" 2>&1
echo "== xidstream gpu-check"
"$PY" -m xidstream.cli gpu-check --wait-events 2 > "$OUT/gpu-check.txt" 2>&1
code=$?
cat "$OUT/gpu-check.txt"
echo "gpu-check exit code: $code (0 all read, 3 faults found)"
for f in memory_reserved_mib recovery_action remapped_rows_pending remapped_rows_failure ecc_dbe_volatile memory_info_version \
         "counters (first read" nvlinks pcie_replay_count pcie_link_width_max ecc_corrected_aggregate \
         retired_pages_pending clock_event_reason_names fabric_clique_id unsupported \
         "re-initialisation (the collector's release for a reset)"; do
  grep -q "$f" "$OUT/gpu-check.txt" || { echo "MISSING in gpu-check output: $f"; rc=1; }
done
echo "== NvmlReader on the real pynvml"
"$PY" - <<'PY' > "$OUT/reader.txt" 2>&1 || rc=1
import statistics, sys, time
import pynvml
from xidstream.collectors.nvml import NEW_SAMPLE_FIELDS, NvmlReader
r = NvmlReader(pynvml)
gpus = r.init()
print(f"{len(gpus)} GPU(s), refused {r.refused}")
bad = 0
for g in gpus:
    print(f"GPU {g.index} {g.uuid} {g.name} memory v{g.memory_info_version} notes={list(g.notes)}")
    times = []
    for _ in range(30):
        t0 = time.perf_counter(); s = r.sample(g); times.append(time.perf_counter() - t0)
    missing = [k for k in NEW_SAMPLE_FIELDS if k not in s.values]
    print(f"  status={s.status} sample p50 {1000*statistics.median(times):.2f} ms, max {1000*max(times):.2f} ms")
    for k in NEW_SAMPLE_FIELDS + ("memory_used_mib", "memory_total_mib"):
        print(f"  {k:28} {s.values.get(k)!r}")
    apps = r.compute_apps(g)
    print(f"  compute apps: {apps!r}" + ("" if apps is not None else f" (unknown: {r.last_error})"))
    if missing:
        print("  MISSING:", missing); bad += 1
from xidstream.collectors.nvml import COUNTER_FIELDS
for g in gpus:
    t0 = time.perf_counter(); c = r.counters(g); first = time.perf_counter() - t0
    times = []
    for _ in range(10):
        t0 = time.perf_counter(); r.counters(g); times.append(time.perf_counter() - t0)
    print(f"GPU {g.index} counters: status={c.status} errors={c.errors} first read {1000*first:.2f} ms, "
          f"then p50 {1000*statistics.median(times):.2f} ms")
    for k in COUNTER_FIELDS:
        v = c.values.get(k)
        print(f"  {k:28} {len(v)} links: {v}" if k == "nvlinks" and v else f"  {k:28} {v!r}")
    print(f"  unsupported: {c.unsupported}")
    missing = [k for k in COUNTER_FIELDS if k not in c.values]
    if missing or c.status != "ok" or c.errors:
        print("  COUNTERS NOT READ:", missing, c.status, c.errors); bad += 1
print("events registered:", r.register_xid_events(), "re-registered:", r.register_xid_events())
print("NVML error count (not counting absent answers):", r.error_count)
r.shutdown()
sys.exit(1 if bad or r.error_count else 0)
PY
cat "$OUT/reader.txt"
echo "== collect --once"
"$PY" -m xidstream.cli collect --sink stdout --once --kernel-log none --no-kubernetes --state-dir "$OUT/state" \
  > "$OUT/collect.jsonl" 2> "$OUT/collect.err" || rc=1
"$PY" - "$OUT/collect.jsonl" <<'PY' || rc=1
import sys, orjson
from xidstream.schemas import decode_any
recs = [decode_any(orjson.dumps(orjson.loads(l)["value"])) for l in open(sys.argv[1]) if l.strip()]
kinds = {}
for r in recs:
    kinds[type(r).__name__] = kinds.get(type(r).__name__, 0) + 1
print("records:", kinds)
for r in recs:
    if type(r).__name__ == "GpuSample":
        print(" ", r.gpu_index, r.status.value, "used", r.memory_used_mib, "reserved", r.memory_reserved_mib,
              "recovery", r.recovery_action, "rows pending/failure", r.remapped_rows_pending, r.remapped_rows_failure,
              "dbe", r.ecc_dbe_volatile)
    if type(r).__name__ == "GpuCounters":
        links = r.nvlinks or []
        print(" ", r.gpu_index, "counters: pcie gen", r.pcie_link_gen_current, "/", r.pcie_link_gen_max, "width",
              r.pcie_link_width_current, "/", r.pcie_link_width_max, "replays", r.pcie_replay_count,
              "ecc corrected/uncorrected aggregate", r.ecc_corrected_aggregate, r.ecc_uncorrected_aggregate,
              "clock reasons", hex(r.clock_event_reasons or 0), r.clock_event_reason_names,
              "nvlinks", len(links), "active", sum(1 for l in links if l.active),
              "recoveries", sum(l.recovery_errors or 0 for l in links),
              "fabric", r.fabric_state, r.fabric_cluster_uuid, r.fabric_clique_id,
              "unsupported", r.unsupported, "errors", r.errors)
ok = kinds.get("GpuSample") and kinds.get("GpuCounters") == kinds.get("GpuSample")
sys.exit(0 if ok else 1)
PY
echo "== the node executor's reset facts (read only: nothing is reset, no persistence mode changed)"
"$PY" - <<'PY' > "$OUT/reset-scope.txt" 2>&1 || rc=1
# What RESET_GPU decides from, through the real pynvml and nvidia-smi: the platform's facts
# (architecture, MIG, virtualization, NVLink to an NVSwitch, Fabric Manager) and the scope rule's
# answer, persistence mode as nvidia-smi reads it, and who holds each GPU's /dev/nvidia<minor>.
import pynvml
from xidstream.collectors.nvml import NvmlReader
from xidstream.collectors.sources.procfs import ProcFs
from xidstream.executors.gpureset import NvidiaSmi, classify_holders, reset_scope
from xidstream.executors.node import NvmlGpuOps
ops = NvmlGpuOps(pynvml)
smi = NvidiaSmi()
procfs = ProcFs()
reader = NvmlReader(pynvml)
for g in reader.init():
    p = ops.platform(ops.find(g.uuid, None, None))
    print(f"GPU {g.index} {g.uuid} {g.name}: {p}")
    print(f"  reset scope: {reset_scope(p) or 'this GPU can be reset alone'}")
    print(f"  persistence mode (nvidia-smi): {smi.persistence(g.uuid)}")
    ops.release()
    pids = ops.holders(g)
    for h in classify_holders(pids, procfs, [], ()):
        print(f"  holder: {h.what} [{h.kind}]")
    if not pids:
        print(f"  holders: none")
reader.shutdown()
PY
cat "$OUT/reset-scope.txt"
grep -q "reset scope:" "$OUT/reset-scope.txt" || { echo "MISSING in reset-scope output: reset scope"; rc=1; }
echo "== done: rc=$rc (outputs in $OUT)"
exit $rc
