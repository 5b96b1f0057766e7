"""The `xidstream` command, its settings, and the Kafka plumbing shared by collectors and tools."""

__version__ = "0.1.0"
