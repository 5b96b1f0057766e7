"""The one exception root of xidstream.

    XidstreamError
     +-- ContractError            a record does not satisfy the wire contract
     |    +-- DecodeError         bytes on a topic could not be decoded into a model
     +-- ScenarioError            a scenario file is invalid (names the field and the entry)
     +-- ConfigError              a setting or policy file is invalid
     +-- BrokerError              the local broker could not be provisioned, started or reached
     +-- TopicError               topics are missing or break co-partitioning

Everything that a user can cause (bad bytes, a bad file, a missing tool) raises one of these with a
message that says what to do; anything else is a bug.
"""

from __future__ import annotations

__all__ = [
    "XidstreamError",
    "ContractError",
    "DecodeError",
    "ScenarioError",
    "ConfigError",
    "BrokerError",
    "TopicError",
]


class XidstreamError(Exception):
    """Root of every error xidstream raises on purpose."""


class ContractError(XidstreamError):
    """A record does not satisfy the wire contract."""


class DecodeError(ContractError):
    """Bytes could not be decoded into a contract model.

    Carries what a dead-letter record needs: the original bytes and a short reason.
    """

    def __init__(self, reason: str, raw: bytes | None = None, schema: str | None = None) -> None:
        self.reason = reason
        self.raw = raw
        self.schema = schema
        where = f" as {schema}" if schema else ""
        preview = ""
        if raw is not None:
            preview = f" (first bytes: {raw[:60]!r}, {len(raw)} bytes)"
        super().__init__(f"cannot decode record{where}: {reason}{preview}")


class ScenarioError(XidstreamError):
    """A scenario file is invalid."""


class ConfigError(XidstreamError):
    """A setting or policy file is invalid."""


class BrokerError(XidstreamError):
    """The local Kafka broker could not be provisioned, started, stopped or reached."""


class TopicError(XidstreamError):
    """Topics are missing, or their partition counts break co-partitioning."""
