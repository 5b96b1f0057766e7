"""A real single-node Apache Kafka (KRaft) for the demo and the tests, without Docker.

Steps, each idempotent and each logging to `<state>/broker.log`:

- fetch:  Maven copies the Kafka 4.0 broker jars and the log4j jars its POM leaves out
          (deploy/local/pom.xml) into a cache outside the work tree (~/.cache/xidstream/).
- format: `kafka.tools.StorageTool format` of a fresh log dir, once.
- start:  `kafka.Kafka` on 127.0.0.1 on non-default ports; waits until the broker answers a
          metadata request; a second start finds it running and returns.
- stop:   SIGTERM, then SIGKILL after a grace period; removes the pid file.

See ../shared/reference/runtime-notes.md section 1 for the facts behind the configuration.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import BrokerError

__all__ = ["LocalBroker", "DEPLOY_DIR", "default_cache_dir", "default_state_dir"]

DEPLOY_DIR = Path(__file__).resolve().parents[1] / "deploy" / "local"
REPO_ROOT = DEPLOY_DIR.parents[1]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xidstream"


def default_state_dir() -> Path:
    return REPO_ROOT / ".xidstream" / "broker"


def _kafka_version() -> str:
    pom = (DEPLOY_DIR / "pom.xml").read_text()
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", pom)
    if not match:
        raise BrokerError(f"{DEPLOY_DIR / 'pom.xml'} has no <kafka.version>")
    return match.group(1)


@dataclass
class LocalBroker:
    """The local broker. Ports are non-default so a developer's own Kafka on 9092 is untouched."""

    port: int = 19092
    controller_port: int = 19093
    host: str = "127.0.0.1"
    state_dir: Path = None  # type: ignore[assignment]
    cache_dir: Path = None  # type: ignore[assignment]
    heap: str = "512m"

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir or default_state_dir())
        self.cache_dir = Path(self.cache_dir or default_cache_dir())

    # -- paths ------------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def libs_dir(self) -> Path:
        return self.cache_dir / f"kafka-{_kafka_version()}" / "libs"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "broker.log"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "broker.pid"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    # -- tools ------------------------------------------------------------------------------
    def _java(self) -> str:
        java_home = os.environ.get("JAVA_HOME")
        java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
        if not java or not Path(java).exists():
            raise BrokerError(
                "Java 17+ is needed to run the local Kafka broker and was not found "
                "(install OpenJDK 17, e.g. `apt-get install openjdk-17-jre-headless`, or set JAVA_HOME)"
            )
        out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
        match = re.search(r'version "(\d+)', out)
        if match and int(match.group(1)) < 17:
            raise BrokerError(f"Kafka 4 needs Java 17+, found: {out.splitlines()[0]}")
        return java

    def _log(self, text: str) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("a") as fh:
            fh.write(f"[xidstream {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")

    # -- steps ------------------------------------------------------------------------------
    def fetch(self) -> Path:
        """Download the broker jars once; later calls find them in the cache."""
        marker = self.libs_dir / ".complete"
        if marker.exists():
            return self.libs_dir
        mvn = shutil.which("mvn")
        if not mvn:
            raise BrokerError(
                "Maven is needed once to fetch the Kafka broker jars and was not found "
                "(install it, e.g. `apt-get install maven`)"
            )
        self._java()
        self.libs_dir.mkdir(parents=True, exist_ok=True)
        self._log(f"fetching Kafka {_kafka_version()} jars into {self.libs_dir}")
        cmd = [
            mvn, "-q", "-B", "-f", str(DEPLOY_DIR / "pom.xml"),
            "dependency:copy-dependencies", "-DincludeScope=runtime",
            f"-DoutputDirectory={self.libs_dir}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        self._log(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise BrokerError(
                f"Maven could not fetch the Kafka jars (exit {proc.returncode}); "
                f"see {self.log_file}:\n{(proc.stdout + proc.stderr)[-2000:]}"
            )
        if not list(self.libs_dir.glob("kafka_2.13-*.jar")):
            raise BrokerError(f"Maven ran but {self.libs_dir} has no kafka_2.13 jar")
        marker.touch()
        return self.libs_dir

    def _write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        props = self.state_dir / "server.properties"
        props.write_text(
            "\n".join([
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@{self.host}:{self.controller_port}",
                f"listeners=PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
                f"advertised.listeners=PLAINTEXT://{self.host}:{self.port}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                f"log.dirs={self.data_dir}",
                "num.partitions=1",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=8",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
                # faust's first JoinGroup otherwise waits out the default 3 s delay on every test.
                "group.initial.rebalance.delay.ms=0",
                # Topics are the contract: `xidstream topics create` makes them, typos do not.
                "auto.create.topics.enable=false",
                "delete.topic.enable=true",
                "log.retention.check.interval.ms=60000",
                "",
            ])
        )
        return props

    def _format(self, java: str, props: Path) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        cluster_id = subprocess.run(
            [java, "-cp", f"{self.libs_dir}/*", "kafka.tools.StorageTool", "random-uuid"],
            capture_output=True, text=True,
        ).stdout.strip() or uuid.uuid4().hex[:22]
        proc = subprocess.run(
            [java, "-cp", f"{self.libs_dir}/*", "kafka.tools.StorageTool", "format",
             "-t", cluster_id, "-c", str(props)],
            capture_output=True, text=True,
        )
        self._log(f"format: {proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            raise BrokerError(f"formatting the KRaft log dir failed; see {self.log_file}:\n{proc.stderr[-1500:]}")

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        # A recycled pid after a reboot would not be a java process running Kafka.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"kafka.Kafka" not in cmdline:
                return None
        except OSError:
            pass
        return pid

    def answers(self, timeout: float = 1.0) -> bool:
        """True when the broker answers a metadata request."""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout):
                pass
        except OSError:
            return False
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "socket.timeout.ms": 2000})
        try:
            md = admin.list_topics(timeout=timeout * 3)
            return bool(md.brokers)
        except Exception:  # KafkaException while the broker is still starting
            return False

    def start(self, timeout: float = 90.0) -> str:
        """Start the broker unless it runs already; return its bootstrap address."""
        if self.pid() and self.answers():
            return self.bootstrap
        if self.pid():
            return self.wait(timeout)
        java = self._java()
        self.fetch()
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                in_use = True
        except OSError:
            in_use = False
        if in_use:
            if self.answers(timeout=3.0):
                # A Kafka of someone else's (another checkout's local broker): use it, never stop it.
                self._log(f"a Kafka broker already answers on {self.bootstrap}; using it")
                return self.bootstrap
            raise BrokerError(
                f"port {self.bootstrap} is in use by another process that is not a Kafka broker; "
                f"stop it or choose another port (--port)"
            )
        props = self._write_config()
        self._format(java, props)
        self._log(f"starting Kafka on {self.bootstrap}")
        log = self.log_file.open("a")
        proc = subprocess.Popen(
            [java, f"-Xmx{self.heap}", "-Xms128m", "-XX:+UseSerialGC", "-Xshare:auto",
             "-Djava.awt.headless=true",
             f"-Dlog4j2.configurationFile=file:{DEPLOY_DIR / 'log4j2.yaml'}",
             "-cp", f"{self.libs_dir}/*", "kafka.Kafka", str(props)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # not killed with the shell that started it; `stop` does that
        )
        self.pid_file.write_text(str(proc.pid))
        return self.wait(timeout, proc)

    def wait(self, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise BrokerError(
                    f"Kafka exited with code {proc.returncode} while starting; "
                    f"last lines of {self.log_file}:\n{self.tail()}"
                )
            if self.answers():
                return self.bootstrap
            time.sleep(0.5)
        raise BrokerError(f"Kafka did not answer on {self.bootstrap} within {timeout:.0f}s; "
                          f"last lines of {self.log_file}:\n{self.tail()}")

    def stop(self, grace: float = 30.0) -> bool:
        """Stop the broker; True if one was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        self._log(f"stopping Kafka (pid {pid})")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
                # reap if it is our child, so it does not linger as a zombie
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            self._log(f"Kafka did not stop within {grace:.0f}s; killing it")
            os.kill(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return True

    def reset(self) -> None:
        """Stop and delete all broker data (topics, offsets)."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
