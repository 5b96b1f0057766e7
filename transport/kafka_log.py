"""librdkafka's own log lines, through Python logging, with identical errors folded.

Without a `logger` in its config, librdkafka writes every log line to stderr itself, as
`%3|<time>|FAIL|rdkafka#producer-1| [thrd:...]: ...`: a broker address with nothing listening
gave a "Connection refused" line every 50 ms (about 15 a second) for as long as a client waited,
beside the command's own one readable sentence.

Every client the project builds gets `KAFKA_LOG` as its `logger` (transport.kafka's
`producer_config`, `consumer_config` and `admin`). confluent-kafka then calls
`logger.log(level, "%s [%s] %s", facility, client_name, text)` and does so only from the
client's own `poll()`, `flush()` or a consumer's `poll()`/`consume()` (librdkafka's `log.queue`,
which confluent-kafka turns on with a logger so that no log call comes from librdkafka's
threads). An AdminClient serves its log lines from `AdminClient.poll()` too (confluent-kafka
2.5+, confluentinc/confluent-kafka-python#1758): a caller that waits on an admin client polls it.

Folding: the first line of a kind is logged as it comes, in words ("broker 127.0.0.1:1
unreachable: Connection refused"); its repeats are counted, and one line with the count goes
out every `window_s` seconds while they go on ("... (x212 in 30 s)"), when a different error
about the same broker replaces it, when a window passes without one (the error cleared), and at
`flush()` (at exit, and when a client sees the broker again). A line's kind is its text with
what changes from repeat to repeat taken out: the client's name, the thread, "(after 0ms in
state CONNECT)" and librdkafka's own "(N identical error(s) suppressed)".
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["FoldingKafkaLog", "KAFKA_LOG", "FOLD_WINDOW_S", "readable"]

FOLD_WINDOW_S = 30.0

_THREAD = re.compile(r"^\[thrd:[^\]]*\]: ")
_VARYING = re.compile(r" \(after \d+ms in state \w+(?:, \d+ identical error\(s\) suppressed)?\)"
                      r"| \(\d+ identical error\(s\) suppressed\)")
# "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused" (librdkafka's
# rdkafka_broker.c, rd_kafka_broker_fail / rd_kafka_transport_connect); "/bootstrap" or "/<id>"
# names the broker's role, not its address.
_CONNECT = re.compile(r"^(?:\w+://)?(?P<broker>[^\s/]+)(?:/\S+)?: Connect to \S+ failed: (?P<why>.+)$")
_RESOLVE = re.compile(r"^(?:\w+://)?(?P<broker>[^\s/]+)(?:/\S+)?: Failed to resolve '[^']*': (?P<why>.+)$")
_DISCONNECT = re.compile(r"^(?:\w+://)?(?P<broker>[^\s/]+)(?:/\S+)?: (?P<why>Disconnected.*|Connection setup timed out.*)$")


def readable(text: str) -> tuple[str, str | None]:
    """(the line in words, the broker it is about or None) for one librdkafka log text, with the
    parts that change from repeat to repeat taken out."""
    text = _VARYING.sub("", _THREAD.sub("", text.strip()))
    m = _CONNECT.match(text)
    if m:
        return f"broker {m['broker']} unreachable: {m['why']}", m["broker"]
    m = _RESOLVE.match(text)
    if m:
        return f"broker {m['broker']} unreachable: cannot resolve its name: {m['why']}", m["broker"]
    m = _DISCONNECT.match(text)
    if m:
        return f"broker {m['broker']}: {m['why']}", m["broker"]
    return text, None


@dataclass
class _Seen:
    level: int
    since: float  # start of the current window
    last: float  # the latest repeat
    repeats: int = 0  # repeats since the line was last logged


class FoldingKafkaLog(logging.Logger):
    """The `logger` of a confluent-kafka client: librdkafka's lines, folded, to `target`.

    A `logging.Logger` (what confluent-kafka documents for `logger`) that forwards, not one in
    logging's tree: its records go out through `target` ("xidstream.kafka"), so the command's
    logging settings (level, format, -v) apply to them as to every other line. Thread-safe:
    clients are polled from more than one thread (the collector's sink, an executor's loop)."""

    def __init__(self, target: logging.Logger, window_s: float = FOLD_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(target.name)
        self.target, self.window_s, self.clock = target, window_s, clock
        self._seen: dict[str, _Seen] = {}
        self._broker: dict[str, str] = {}  # broker -> the kind of its latest line
        self._lock = threading.Lock()
        self._latest: dict[str, str] = {}  # broker -> its latest line (not forgotten by flush)

    # confluent-kafka calls log(level, "%s [%s] %s", facility, client_name, text)
    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if len(args) == 3 and msg == "%s [%s] %s":
            self.line(level, str(args[2]))
        else:
            self.target.log(level, msg, *args, **kwargs)

    def line(self, level: int, text: str) -> None:
        """One librdkafka log text at Python `level`: logged, counted or summarised."""
        kind, broker = readable(text)
        out: list[tuple[int, str]] = []
        with self._lock:
            now = self.clock()
            self._expire(now, out)
            if broker:
                self._latest[broker] = kind
            seen = self._seen.get(kind)
            if seen is None:
                previous = self._broker.get(broker) if broker else None
                if previous is not None and previous != kind:
                    self._summarise(previous, now, out)  # the error changed: the old one's count
                    self._seen.pop(previous, None)
                self._seen[kind] = _Seen(level, now, now)
                if broker:
                    self._broker[broker] = kind
                out.append((level, kind))
            else:
                seen.repeats += 1
                seen.last = now
                if now - seen.since >= self.window_s:
                    self._summarise(kind, now, out)
        self._emit(out)

    def latest(self, bootstrap: str) -> str | None:
        """The latest line logged or counted about a broker of `bootstrap` ("host:port,..."), in
        words (for a command's sentence when it gives up); None when none was heard of."""
        with self._lock:
            for addr in bootstrap.split(","):
                addr = addr.strip().split("://")[-1]
                if addr in self._latest:
                    return self._latest[addr]
            return None

    def flush(self) -> None:
        """Log the count of every error still being folded, and forget them: a later line of
        the same kind is logged as new (at exit; when a client sees its broker again)."""
        out: list[tuple[int, str]] = []
        with self._lock:
            now = self.clock()
            for kind in list(self._seen):
                self._summarise(kind, now, out)
            self._seen.clear()
            self._broker.clear()
        self._emit(out)

    def _expire(self, now: float, out: list[tuple[int, str]]) -> None:
        """Errors not seen for a whole window have cleared: their last count out, forgotten."""
        for kind, seen in list(self._seen.items()):
            if now - seen.last >= self.window_s:
                self._summarise(kind, seen.last, out)
                del self._seen[kind]
                self._broker = {b: k for b, k in self._broker.items() if k != kind}

    def _summarise(self, kind: str, now: float, out: list[tuple[int, str]]) -> None:
        seen = self._seen.get(kind)
        if seen is None or not seen.repeats:
            return
        out.append((seen.level, f"{kind} (x{seen.repeats} in {max(1.0, now - seen.since):.0f} s)"))
        seen.repeats, seen.since = 0, now

    def _emit(self, out: list[tuple[int, str]]) -> None:
        for level, text in out:  # outside the lock: a handler may be slow
            self.target.log(level, "%s", text)


# One per process, so that two clients failing on the same broker fold into the same count.
KAFKA_LOG = FoldingKafkaLog(logging.getLogger("xidstream.kafka"))
atexit.register(KAFKA_LOG.flush)
