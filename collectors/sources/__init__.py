"""Input sources of the collector: kernel logs, /proc, kubelet. Each behind a small interface with
an in-memory twin (collectors.fakes, collectors.sources.kernel.MemoryKernelSource)."""
