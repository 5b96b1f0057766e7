"""One frozen settings object per process, built by the CLI and passed down.

Library code never reads `os.environ` and never imports this module: `Settings` is a
`transport.config.KafkaConfig` (what the libraries take) plus how the commands build it.
`Settings.from_env()` is called once, in the CLI, and flags override what the environment says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

from schemas.errors import ConfigError
from transport.config import DEFAULT_BOOTSTRAP, KafkaConfig

__all__ = ["Settings", "DEFAULT_BOOTSTRAP"]


@dataclass(frozen=True)
class Settings(KafkaConfig):
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
