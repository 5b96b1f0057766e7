"""The processor's faust/aiokafka connection from the same librdkafka settings every other client
reads (`KafkaConfig.kafka_extra`: ``XIDSTREAM_KAFKA_*`` or ``--kafka-config FILE``).

`faust_kwargs(config)` is a pure function: librdkafka's ``security.protocol``, ``sasl.mechanisms``,
``sasl.username``/``sasl.password``, ``ssl.ca.location``, ``ssl.certificate.location``,
``ssl.key.location`` (and ``ssl.key.password``) become faust App settings: ``broker`` (one
``kafka://host:port`` URL per bootstrap server; faust takes the security protocol from the
credentials, not the scheme) and ``broker_credentials`` (``faust.SASLCredentials`` with an
``ssl_context`` for SASL_SSL, ``faust.SSLCredentials`` for SSL). Anything it cannot carry over
faithfully is a `ConfigError` naming the setting, never silently dropped: a worker that quietly
connected without TLS, or without the CA it was given, would be worse than one that stops.

Settings that only tune librdkafka (``client.id``, ``socket.*``, ``linger.ms``, ...) have no meaning
for aiokafka and are left to the confluent-kafka clients.
"""

from __future__ import annotations

from typing import Any, Mapping

from xidstream.schemas.errors import ConfigError
from xidstream.transport.config import KafkaConfig

__all__ = ["faust_kwargs", "SECURITY_KEYS"]

# The librdkafka settings that decide how a client authenticates and encrypts: each must be
# translated, or refused.
SECURITY_KEYS = frozenset({
    "security.protocol", "sasl.mechanisms", "sasl.mechanism", "sasl.username", "sasl.password",
    "ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.key.password",
})
_UNSUPPORTED_PREFIXES = ("sasl.kerberos.", "sasl.oauthbearer.", "ssl.keystore.", "ssl.ca.pem", "ssl.certificate.pem",
                         "ssl.key.pem", "ssl.crl.", "ssl_key", "ssl.engine.", "ssl.providers")
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def _ssl_context(props: Mapping[str, str]) -> Any:
    from aiokafka.helpers import create_ssl_context

    verify = props.get("enable.ssl.certificate.verification", "true").lower()
    if verify in ("false", "0"):
        raise ConfigError("enable.ssl.certificate.verification=false is not carried over to the processor: "
                          "it would accept any broker certificate; give ssl.ca.location instead")
    cert, key = props.get("ssl.certificate.location"), props.get("ssl.key.location")
    if bool(cert) != bool(key):
        raise ConfigError("ssl.certificate.location and ssl.key.location go together (a client certificate "
                          "needs its key)")
    try:
        ctx = create_ssl_context(cafile=props.get("ssl.ca.location") or None, certfile=cert or None,
                                 keyfile=key or None, password=props.get("ssl.key.password") or None)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        files = ", ".join(f"{k}={props[k]}" for k in ("ssl.ca.location", "ssl.certificate.location",
                                                      "ssl.key.location") if props.get(k))
        raise ConfigError(f"cannot build the processor's TLS context from {files or 'the system CAs'}: {exc}") from None
    endpoint = props.get("ssl.endpoint.identification.algorithm", "https").lower()
    if endpoint == "none":
        ctx.check_hostname = False  # librdkafka's explicit opt-out, kept as it was asked for
    return ctx


def faust_kwargs(config: KafkaConfig) -> dict[str, Any]:
    """faust App keyword arguments (``broker``, ``broker_credentials``) for `config`."""
    props = {k.lower(): str(v) for k, v in config.kafka_extra.items()}
    for key in props:
        if key.startswith(_UNSUPPORTED_PREFIXES):
            raise ConfigError(f"the Kafka setting {key} cannot be carried over to the processor (faust/aiokafka); "
                              f"use security.protocol, sasl.mechanisms, sasl.username, sasl.password and "
                              f"ssl.ca.location / ssl.certificate.location / ssl.key.location files")
    hosts = [h.strip() for h in config.bootstrap.split(",") if h.strip()]
    if not hosts:
        raise ConfigError("bootstrap servers must not be empty")
    for h in hosts:
        if "://" in h:
            raise ConfigError(f"bootstrap server {h!r}: give host:port; the security protocol comes from "
                              f"security.protocol")
    out: dict[str, Any] = {"broker": [f"kafka://{h}" for h in hosts]}
    protocol = props.get("security.protocol", "plaintext").upper()
    mechanism = (props.get("sasl.mechanisms") or props.get("sasl.mechanism") or "").upper()
    user, password = props.get("sasl.username"), props.get("sasl.password")
    if protocol == "PLAINTEXT":
        stray = sorted(k for k in SECURITY_KEYS - {"security.protocol"} if k in props)
        if stray:
            raise ConfigError(f"{', '.join(stray)} given but security.protocol is PLAINTEXT (the default): "
                              f"set security.protocol to SASL_SSL, SSL or SASL_PLAINTEXT")
        return out
    import faust

    if protocol in ("SASL_SSL", "SASL_PLAINTEXT"):
        mechanism = mechanism or "GSSAPI"
        if mechanism not in _MECHANISMS:
            raise ConfigError(f"sasl.mechanisms={mechanism} is not supported for the processor; "
                              f"use one of {', '.join(_MECHANISMS)}")
        if not user or password is None:
            raise ConfigError(f"security.protocol={protocol} with {mechanism} needs sasl.username and sasl.password")
        ssl_context = _ssl_context(props) if protocol == "SASL_SSL" else None
        if protocol == "SASL_PLAINTEXT" and any(k.startswith("ssl.") and k.endswith(".location") for k in props):
            raise ConfigError("ssl.* files given but security.protocol is SASL_PLAINTEXT (no TLS): use SASL_SSL")
        out["broker_credentials"] = faust.SASLCredentials(username=user, password=password, mechanism=mechanism,
                                                          ssl_context=ssl_context)
        return out
    if protocol == "SSL":
        if mechanism or user:
            raise ConfigError("sasl.* settings given but security.protocol is SSL: use SASL_SSL")
        out["broker_credentials"] = faust.SSLCredentials(_ssl_context(props))
        return out
    raise ConfigError(f"security.protocol={protocol} is not one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL")
