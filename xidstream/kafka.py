"""The Kafka plumbing now lives in the library layer (`transport.kafka`); this name stays for the
commands and scripts that import it from here."""

from transport.kafka import *  # noqa: F401,F403
from transport.kafka import __all__  # noqa: F401
