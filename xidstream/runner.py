"""Run a stream-processor worker (`xidstream process`) as a child process, for replay, the
simulator, the benchmarks and the tests; stop it when done.

A worker dies with the process that started it, however that one ends. Its own session (so a ^C
on the terminal reaches the parent, which stops it in order) keeps it out of the parent's process
group, and a SIGKILLed parent runs no clean-up code; without more, an orphaned worker went on
consuming and committing under PID 1. So on Linux the worker is started with a parent-death
signal (prctl(2) PR_SET_PDEATHSIG): the kernel sends it SIGKILL when its parent goes.

SIGKILL, not SIGTERM: SIGTERM is faust's clean shutdown (commit, leave the group, close the
stores), which needs the broker and the worker's event loop to answer, and an orphan whose
shutdown stalls has nobody left to escalate; a SIGTERMed orphan was seen still running 15 s on.
Nothing waits for an orphan's clean exit: its run is abandoned, and its group's membership
expires with the session timeout. A living parent still stops its worker with SIGTERM (`stop`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from xidstream.settings import Settings

__all__ = ["WorkerProcess", "die_with_parent"]

REPO = Path(__file__).resolve().parents[1]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that has the kernel send the child `sig` when this
    process dies (prctl(2) PR_SET_PDEATHSIG; it survives the exec), or None where it cannot work.

    None off Linux, and None off the main thread: the kernel counts the *thread* that forked as the
    parent (prctl(2): "the parent thread"), so a child forked from a helper thread would be killed
    when that thread returns, not when the process ends.

    Everything the child runs between fork and exec is looked up here, in the parent: the child of
    a process with other threads (librdkafka's) must not import or take locks another thread may
    have held at the fork."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    getppid, _exit = os.getppid, os._exit

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if getppid() != parent:  # the parent died between the fork and the prctl: no signal will come
            _exit(1)

    return preexec


class _LagSeen:
    """What one `WorkerProcess.wait_idle` saw, in a few numbers (not every reading), as a sentence."""

    def __init__(self, group: str, topics: int, settle: float) -> None:
        self.group, self.topics, self.settle = group, topics, settle
        self.readings = self.uncommitted = 0  # uncommitted: readings that found no commit (`LagProbe.lag` None)
        self.first: int | None = None
        self.last: int | None = None
        self.lowest: int | None = None
        self.last_at = 0.0
        self.changed_at = 0.0  # when the lag last moved
        self.alive = True

    def add(self, at: float, lag: int | None) -> None:
        self.readings += 1
        self.last_at = at
        if lag is None:
            self.uncommitted += 1
        else:
            if self.first is None:
                self.first = lag
            self.lowest = lag if self.lowest is None else min(self.lowest, lag)
        if self.readings == 1 or lag != self.last:
            self.changed_at = at
        self.last = lag

    def __str__(self) -> str:
        waited = f"consumer group {self.group} to commit every message of its {self.topics} topic(s)"
        if self.readings == 0:
            return f"{waited}; no lag reading came back"
        if self.last is None:
            last = (f"no commit of the group, or a partition without a leader "
                    f"({self.uncommitted} of the readings found that)")
        elif self.last == 0:
            last = f"no lag, but it must stay so for {self.settle:g} s"
        else:
            last = (f"{self.last} message(s) uncommitted (first {self.first}, lowest {self.lowest}), "
                    f"unchanged for its last {self.last_at - self.changed_at:.0f} s")
        return (f"{waited}; saw {self.readings} lag reading(s) over {self.last_at:.1f} s, the last: {last}"
                + ("" if self.alive else "; the worker had exited"))


class WorkerProcess:
    def __init__(self, settings: Settings, workdir: Path, *, name: str = "worker", policy: str | None = None,
                 loglevel: str = "warning", extra_args: list[str] | None = None, fast_rebalance: bool = True,
                 env: dict[str, str] | None = None) -> None:
        """`fast_rebalance=False` runs the worker with the processor's own group timeouts (the
        failover test measures those), not the shorter ones for a one-broker test setup. `env` is
        added to this process's environment for the worker."""
        self.settings = settings
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        self.name = name
        self.policy = policy
        self.loglevel = loglevel
        self.extra = extra_args or []
        self.fast_rebalance = fast_rebalance
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.idle_seen: _LagSeen | None = None  # what the last `wait_idle` saw

    @property
    def group(self) -> str:
        return f"{self.settings.topic_prefix}xidstream-processor"

    @property
    def data_dir(self) -> Path:
        """faust's data dir (a rocksdb:// store keeps its tables here); a worker of the same name reuses it."""
        return self.workdir / f"data-{self.name}"

    def start(self) -> "WorkerProcess":
        """Start the worker; it is killed when this process dies (see `die_with_parent`: start it
        from the main thread for that)."""
        s = self.settings
        cmd = [sys.executable, "-m", "xidstream.cli", "process", "--bootstrap", s.bootstrap,
               "--topic-prefix", s.topic_prefix, "--partitions", str(s.partitions),
               *(["--fast-rebalance"] if self.fast_rebalance else []), "--data-dir", str(self.data_dir),
               "--loglevel", self.loglevel, *self.extra]
        if self.policy:
            cmd += ["--policy", str(self.policy)]
        with self.log_path.open("w") as log:  # the child has its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, start_new_session=True, preexec_fn=die_with_parent(),
                                         env={**os.environ, **self.env} if self.env else None)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if not self.alive():
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_idle(self, topics: list[str], timeout: float = 180.0, settle: float = 3.0) -> bool:
        """Until the worker has committed every message of `topics`, and stayed so for `settle` s.
        False when `timeout` came first; `idle_seen` then says what the wait saw.

        The probe's broker calls get no more than the time left (at most 10 s each), so a slow
        broker stretches the wait past `timeout` by little: only the committed-offsets request
        keeps librdkafka's own request timeout."""
        from xidstream.transport.kafka import LagProbe

        probe = LagProbe(self.settings, self.group, topics)
        started = time.monotonic()
        deadline = started + timeout
        quiet_since = None
        seen = _LagSeen(self.group, len(topics), settle)
        self.idle_seen = seen
        try:
            while True:
                if not self.alive():
                    from xidstream.schemas.errors import XidstreamError

                    raise XidstreamError(f"the processor exited (code {self.proc.returncode}):\n{self.tail()}")
                probe.timeout = max(0.5, min(10.0, deadline - time.monotonic()))
                lag = probe.lag()
                seen.add(time.monotonic() - started, lag)
                if lag == 0:
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since >= settle:
                        return True
                else:
                    quiet_since = None
                if time.monotonic() + 0.5 >= deadline:
                    return False
                time.sleep(0.5)
        finally:
            seen.alive = self.alive()
            probe.close()
