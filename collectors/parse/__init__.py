"""Pure parsers: a string in, records out. No clock, no logging, no NVML."""

from xidstream.collectors.parse.kernel import REFUSALS, KernelRecord, Parsed, extract_pci, parse_line, parse_line_checked

__all__ = ["KernelRecord", "Parsed", "REFUSALS", "extract_pci", "parse_line", "parse_line_checked"]
