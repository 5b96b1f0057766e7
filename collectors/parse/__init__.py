"""Pure parsers: a string in, records out. No clock, no logging, no NVML."""

from collectors.parse.kernel import KernelRecord, extract_pci, parse_line

__all__ = ["KernelRecord", "extract_pci", "parse_line"]
