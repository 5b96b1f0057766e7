"""One frozen settings object per process, built by the CLI and passed down.

Library code never reads `os.environ`; `Settings.from_env()` is called once, in the CLI, and flags
override what the environment says.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, replace
from typing import Mapping

from schemas.errors import ConfigError
from schemas.topics import DEFAULT_PARTITIONS, TopicRegistry

__all__ = ["Settings", "DEFAULT_BOOTSTRAP"]

# The local broker of deploy/local (non-default port, loopback only).
DEFAULT_BOOTSTRAP = "127.0.0.1:19092"


@dataclass(frozen=True)
class Settings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    topic_prefix: str = ""
    partitions: int = DEFAULT_PARTITIONS
    replication_factor: int = 1
    node: str = field(default_factory=socket.gethostname)
    # Extra librdkafka settings (security.protocol, sasl.*, ...) for every client we create.
    kafka_extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def topics(self) -> TopicRegistry:
        return TopicRegistry(self.topic_prefix, self.partitions)

    def with_(self, **changes: object) -> "Settings":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Read ``XIDSTREAM_*`` variables. ``XIDSTREAM_KAFKA_<NAME>`` become librdkafka settings
        (``XIDSTREAM_KAFKA_SECURITY_PROTOCOL=SSL`` -> ``security.protocol=SSL``)."""
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}
        if env.get("XIDSTREAM_BOOTSTRAP"):
            kwargs["bootstrap"] = env["XIDSTREAM_BOOTSTRAP"]
        if "XIDSTREAM_TOPIC_PREFIX" in env:
            kwargs["topic_prefix"] = env["XIDSTREAM_TOPIC_PREFIX"]
        if env.get("XIDSTREAM_NODE"):
            kwargs["node"] = env["XIDSTREAM_NODE"]
        for name, key in (("XIDSTREAM_PARTITIONS", "partitions"), ("XIDSTREAM_REPLICATION", "replication_factor")):
            if env.get(name):
                try:
                    kwargs[key] = int(env[name])
                except ValueError:
                    raise ConfigError(f"{name} must be an integer, got {env[name]!r}") from None
        extra = {
            k[len("XIDSTREAM_KAFKA_"):].lower().replace("_", "."): v
            for k, v in env.items() if k.startswith("XIDSTREAM_KAFKA_")
        }
        if extra:
            kwargs["kafka_extra"] = extra
        settings = cls(**kwargs)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {self.partitions}")
        if not self.bootstrap:
            raise ConfigError("bootstrap servers must not be empty")
