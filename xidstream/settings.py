"""One frozen settings object per process, built by the CLI and passed down.

Library code never reads `os.environ` and never imports this module: `Settings` is a
`xidstream.transport.config.KafkaConfig` (what the libraries take) plus how the commands build it.
`Settings.from_env()` is called once, in the CLI, and flags override what the environment says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from xidstream.schemas.errors import ConfigError
from xidstream.transport.config import DEFAULT_BOOTSTRAP, KafkaConfig

__all__ = ["Settings", "DEFAULT_BOOTSTRAP", "read_kafka_properties"]

# Not a librdkafka setting: the path of a properties file (below `XIDSTREAM_KAFKA_*` settings).
KAFKA_CONFIG_ENV = "XIDSTREAM_KAFKA_CONFIG"


def read_kafka_properties(path: str | Path) -> dict[str, str]:
    """A librdkafka properties file (the format `kcat -F` reads): `key=value` lines, `#` comments,
    blank lines ignored. `ConfigError` naming the file and line for anything else."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the Kafka properties file {path}: {exc.strerror or exc}") from None
    props: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{n}: expected key=value, got {line[:60]!r}")
        props[key.strip()] = value.strip()
    return props


@dataclass(frozen=True)
class Settings(KafkaConfig):
    def with_(self, **changes: object) -> "Settings":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, kafka_config: str | Path | None = None) -> "Settings":
        """Read ``XIDSTREAM_*`` variables. ``XIDSTREAM_KAFKA_<NAME>`` become librdkafka settings
        (``XIDSTREAM_KAFKA_SECURITY_PROTOCOL=SSL`` -> ``security.protocol=SSL``).

        `kafka_config` (``--kafka-config``), else ``XIDSTREAM_KAFKA_CONFIG``, names a librdkafka
        properties file laid under them: its ``bootstrap.servers`` is the bootstrap unless
        ``XIDSTREAM_BOOTSTRAP`` says otherwise, its other keys are client settings unless an
        ``XIDSTREAM_KAFKA_*`` variable says otherwise (file < environment < flags)."""
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}
        path = kafka_config or env.get(KAFKA_CONFIG_ENV)
        from_file = read_kafka_properties(path) if path else {}
        if env.get("XIDSTREAM_BOOTSTRAP"):
            kwargs["bootstrap"] = env["XIDSTREAM_BOOTSTRAP"]
        if "XIDSTREAM_TOPIC_PREFIX" in env:
            kwargs["topic_prefix"] = env["XIDSTREAM_TOPIC_PREFIX"]
        if env.get("XIDSTREAM_NODE"):
            kwargs["node"] = env["XIDSTREAM_NODE"]
        for name, key in (("XIDSTREAM_PARTITIONS", "partitions"), ("XIDSTREAM_REPLICATION", "replication_factor"),
                          ("XIDSTREAM_MIN_INSYNC_REPLICAS", "min_insync_replicas")):
            if env.get(name):
                try:
                    kwargs[key] = int(env[name])
                except ValueError:
                    raise ConfigError(f"{name} must be an integer, got {env[name]!r}") from None
        extra = {
            k[len("XIDSTREAM_KAFKA_"):].lower().replace("_", "."): v
            for k, v in env.items() if k.startswith("XIDSTREAM_KAFKA_") and k != KAFKA_CONFIG_ENV
        }
        # a bootstrap among the librdkafka settings is the bootstrap, not an extra setting
        for layer in (extra, from_file):
            for key in ("bootstrap.servers", "metadata.broker.list"):
                if key in layer:
                    value = layer.pop(key)
                    if value:
                        kwargs.setdefault("bootstrap", value)
        extra = {**from_file, **extra}
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
        if self.replication_factor is not None and self.replication_factor < 1:
            raise ConfigError(f"replication factor must be >= 1, got {self.replication_factor}")
        if self.min_insync_replicas is not None and self.min_insync_replicas < 1:
            raise ConfigError(f"min.insync.replicas must be >= 1, got {self.min_insync_replicas}")
        if (self.min_insync_replicas is not None and self.replication_factor is not None
                and self.min_insync_replicas > self.replication_factor):
            raise ConfigError(f"min.insync.replicas must be between 1 and the replication factor "
                              f"({self.replication_factor}), got {self.min_insync_replicas}")
