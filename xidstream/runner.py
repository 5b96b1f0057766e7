"""Run a stream-processor worker (`xidstream process`) as a child process, for replay, the
simulator, the benchmarks and the tests; stop it when done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from xidstream.settings import Settings

__all__ = ["WorkerProcess"]

REPO = Path(__file__).resolve().parents[1]


class WorkerProcess:
    def __init__(self, settings: Settings, workdir: Path, *, name: str = "worker", policy: str | None = None,
                 loglevel: str = "warning", extra_args: list[str] | None = None, fast_rebalance: bool = True,
                 env: dict[str, str] | None = None) -> None:
        """`fast_rebalance=False` runs the worker with the processor's own group timeouts (issue 12's
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

    @property
    def group(self) -> str:
        return f"{self.settings.topic_prefix}xidstream-processor"

    @property
    def data_dir(self) -> Path:
        """faust's data dir (a rocksdb:// store keeps its tables here); a worker of the same name reuses it."""
        return self.workdir / f"data-{self.name}"

    def start(self) -> "WorkerProcess":
        s = self.settings
        cmd = [sys.executable, "-m", "xidstream.cli", "process", "--bootstrap", s.bootstrap,
               "--topic-prefix", s.topic_prefix, "--partitions", str(s.partitions),
               *(["--fast-rebalance"] if self.fast_rebalance else []), "--data-dir", str(self.data_dir),
               "--loglevel", self.loglevel, *self.extra]
        if self.policy:
            cmd += ["--policy", str(self.policy)]
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=REPO, start_new_session=True,
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
        """Until the worker has committed every message of `topics`, and stayed so for `settle` s."""
        from transport.kafka import LagProbe

        probe = LagProbe(self.settings, self.group, topics)
        deadline = time.monotonic() + timeout
        quiet_since = None
        try:
            while time.monotonic() < deadline:
                if not self.alive():
                    from schemas.errors import XidstreamError

                    raise XidstreamError(f"the processor exited (code {self.proc.returncode}):\n{self.tail()}")
                lag = probe.lag()
                if lag == 0:
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since >= settle:
                        return True
                else:
                    quiet_since = None
                time.sleep(0.5)
            return False
        finally:
            probe.close()
