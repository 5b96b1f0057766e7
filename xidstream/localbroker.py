"""A real single-node Apache Kafka (KRaft) for the demo and the tests, without Docker.

Steps, each idempotent and each logging to `<state>/broker.log`:

- fetch:  Maven copies the Kafka 4.0 broker jars and the log4j jars its POM leaves out
          (deploy/local/pom.xml) into a cache outside the work tree (~/.cache/xidstream/).
- format: `kafka.tools.StorageTool format` of a fresh log dir, once.
- start:  `kafka.Kafka` on 127.0.0.1 on non-default ports; waits until the broker answers a
          metadata request; a second start finds it running and returns.
- stop:   SIGTERM, then SIGKILL after a grace period; removes the pid file.

`LocalBroker(secure=True)` (`xidstream broker start --secure`) is a second, separate instance
(`.xidstream/broker-secure/`, 127.0.0.1:19392, controller 19393) as a production cluster would
run it: one SASL_SSL listener (a local CA and a broker certificate made at first start, PEM key
stores), SCRAM-SHA-512 users `collector`, `processor`, `executor`, `cluster-executor`, `exporter` and
`admin` (added at format time, passwords generated once), KRaft's StandardAuthorizer with no access unless an ACL grants it,
and the contract's least-privilege ACLs (`xidstream.transport.acls`) created as `admin` through the Admin
API. The controller listener is TLS with client certificates on loopback (its principal, the
broker certificate's subject, is a super user like `admin`). Each role gets a librdkafka properties
file, `clients/ROLE.properties` (mode 0600), that `--kafka-config` and `kcat -F` read.

See ../shared/reference/runtime-notes.md section 1 for the facts behind the configuration.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from xidstream.schemas.errors import BrokerError

__all__ = ["LocalBroker", "broker_for_run", "DEPLOY_DIR", "default_cache_dir", "default_state_dir", "ROLES", "SECURE_PORT"]

DEPLOY_DIR = Path(__file__).resolve().parents[1] / "deploy" / "local"
REPO_ROOT = DEPLOY_DIR.parents[1]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xidstream"


def default_state_dir(secure: bool = False) -> Path:
    return REPO_ROOT / ".xidstream" / ("broker-secure" if secure else "broker")


# SCRAM users of the secure broker; `admin` is a super user, the others get the ACLs of
# transport.acls.
ROLES = ("collector", "processor", "executor", "cluster-executor", "exporter", "admin")
PLAIN_PORT = 19092
SECURE_PORT = 19392  # 19192 is the throwaway broker of tests/integration/test_collector_on_broker.py
# The subject of the secure broker's certificate: the principal of its controller listener.
BROKER_CN = "xidstream-local-broker"


def _kafka_version() -> str:
    pom = (DEPLOY_DIR / "pom.xml").read_text()
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", pom)
    if not match:
        raise BrokerError(f"{DEPLOY_DIR / 'pom.xml'} has no <kafka.version>")
    return match.group(1)


@dataclass
class LocalBroker:
    """The local broker. Ports are non-default so a developer's own Kafka on 9092 is untouched."""

    port: int = None  # type: ignore[assignment]  # 19092, or 19392 when secure
    controller_port: int = None  # type: ignore[assignment]  # port + 1
    host: str = "127.0.0.1"
    state_dir: Path = None  # type: ignore[assignment]
    cache_dir: Path = None  # type: ignore[assignment]
    heap: str = "512m"
    secure: bool = False

    def __post_init__(self) -> None:
        self.port = self.port or (SECURE_PORT if self.secure else PLAIN_PORT)
        self.controller_port = self.controller_port or self.port + 1
        self.state_dir = Path(self.state_dir or default_state_dir(self.secure))
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

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    @property
    def ca_file(self) -> Path:
        return self.tls_dir / "ca.pem"

    @property
    def clients_dir(self) -> Path:
        return self.state_dir / "clients"

    def client_file(self, role: str) -> Path:
        """The librdkafka properties file of a role of the secure broker."""
        if role not in ROLES:
            raise BrokerError(f"unknown role {role!r}; the secure broker has {', '.join(ROLES)}")
        return self.clients_dir / f"{role}.properties"

    def client_config(self, role: str = "admin") -> dict[str, str]:
        """librdkafka settings for `role` (secure) or just the bootstrap (plaintext)."""
        if not self.secure:
            return {"bootstrap.servers": self.bootstrap}
        password = self._passwords()[role]
        return {
            "bootstrap.servers": self.bootstrap,
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": "SCRAM-SHA-512",
            "sasl.username": role,
            "sasl.password": password,
            "ssl.ca.location": str(self.ca_file),
        }

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

    def _listener_config(self) -> list[str]:
        if not self.secure:
            return [
                f"listeners=PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
                f"advertised.listeners=PLAINTEXT://{self.host}:{self.port}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            ]
        admin_pw = self._passwords()["admin"]
        tls = self.tls_dir
        return [
            f"listeners=SASL_SSL://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            f"advertised.listeners=SASL_SSL://{self.host}:{self.port}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=SASL_SSL",
            "listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL",
            # one key store (the broker's key and certificate) and one trust store (the local CA), PEM
            "ssl.keystore.type=PEM",
            f"ssl.keystore.location={tls / 'broker.pem'}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={tls / 'ca.pem'}",
            # the controller listener takes only certificates of the local CA (the broker itself)
            "listener.name.controller.ssl.client.auth=required",
            "sasl.enabled.mechanisms=SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
            f'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="{admin_pw}";',
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            f"super.users=User:admin;User:CN={BROKER_CN}",
            "allow.everyone.if.no.acl.found=false",
        ]

    def _write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        props = self.state_dir / "server.properties"
        props.touch(mode=0o600)  # the secure one holds admin's password
        props.write_text(
            "\n".join([
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@{self.host}:{self.controller_port}",
                *self._listener_config(),
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
        args = ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)]
        if self.secure:
            # KRaft keeps SCRAM credentials in the metadata log: the users exist from the start
            for role, password in self._passwords().items():
                args += ["--add-scram", f"SCRAM-SHA-512=[name={role},password={password}]"]
        # The arguments go in a 0600 argument file (`java @file`, JDK 9+), not on the command line:
        # any local user can read a process's command line in /proc/PID/cmdline while it formats.
        argfile = self.state_dir / "format.args"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argfile.unlink(missing_ok=True)
        fd = os.open(argfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(f'"{a}"\n' for a in args))
        try:
            proc = subprocess.run([java, "-cp", f"{self.libs_dir}/*", f"@{argfile}"], capture_output=True, text=True)
        finally:
            argfile.unlink(missing_ok=True)
        self._log(f"format: {proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            raise BrokerError(f"formatting the KRaft log dir failed; see {self.log_file}:\n{proc.stderr[-1500:]}")

    # -- the secure instance's secrets -----------------------------------------------------------
    @property
    def _passwords_file(self) -> Path:
        return self.state_dir / "passwords.json"

    def _passwords(self) -> dict[str, str]:
        """Each role's SCRAM password, generated once (mode 0600). Formatted storage without the
        file cannot be used: its users have passwords nobody knows."""
        try:
            saved = json.loads(self._passwords_file.read_text())
            missing = [r for r in ROLES if r not in saved]
            if missing:
                raise BrokerError(f"{self._passwords_file} has no user for role(s) {', '.join(missing)} (made by an "
                                  f"earlier version); `xidstream broker reset --secure` starts over with every role")
            return saved
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            raise BrokerError(f"cannot read {self._passwords_file}: {exc}; `xidstream broker reset --secure` "
                              f"starts over") from None
        if (self.data_dir / "meta.properties").exists():
            raise BrokerError(f"{self._passwords_file} is missing but {self.data_dir} was formatted with its users; "
                              f"`xidstream broker reset --secure` starts over")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        passwords = {role: secrets.token_urlsafe(24) for role in ROLES}
        fd = os.open(self._passwords_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(passwords, fh)
        return passwords

    def _ensure_tls(self) -> None:
        """A local CA and a broker certificate for 127.0.0.1 and localhost, made once."""
        if (self.tls_dir / "broker.pem").exists() and self.ca_file.exists():
            return
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        self.tls_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.tls_dir, 0o700)
        now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
        ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "xidstream local CA")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=825))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False,
                                           encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=825))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(self.host))]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        pem = serialization.Encoding.PEM
        # Kafka's PEM key store: an unencrypted PKCS#8 key followed by the certificate chain
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        fd = os.open(self.tls_dir / "broker.pem", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key_pem + cert.public_bytes(pem) + ca.public_bytes(pem))
        # the CA key is kept only to sign a replacement; nothing reads it at run time
        fd = os.open(self.tls_dir / "ca-key.pem", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        self.ca_file.write_bytes(ca.public_bytes(pem))

    def _write_client_files(self) -> None:
        """`clients/ROLE.properties`: the librdkafka settings of each role (mode 0600)."""
        self.clients_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.clients_dir, 0o700)
        for role in ROLES:
            body = "".join(f"{k}={v}\n" for k, v in self.client_config(role).items())
            fd = os.open(self.client_file(role), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"# xidstream local secure broker, role {role} (librdkafka / kcat -F)\n" + body)

    def _grant(self) -> None:
        """The contract's ACLs (transport.acls), created as admin; idempotent."""
        from xidstream.transport.acls import apply_acls
        from xidstream.transport.config import KafkaConfig

        extra = {k: v for k, v in self.client_config("admin").items() if k != "bootstrap.servers"}
        apply_acls(KafkaConfig(bootstrap=self.bootstrap, kafka_extra=extra))

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

        try:
            config = self.client_config("admin")
        except BrokerError:
            return False
        admin = AdminClient({**config, "socket.timeout.ms": 2000})
        try:
            md = admin.list_topics(timeout=timeout * 3)
            return bool(md.brokers)
        except Exception:  # KafkaException while the broker is still starting
            return False

    def start(self, timeout: float = 90.0) -> str:
        """Start the broker unless it runs already; return its bootstrap address."""
        if self.pid() and self.answers():
            return self._ready()
        if self.pid():
            self.wait(timeout)
            return self._ready()
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
        if self.secure:
            self._ensure_tls()
            self._passwords()
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
        self.wait(timeout, proc)
        return self._ready()

    def _ready(self) -> str:
        if self.secure:
            self._grant()
            self._write_client_files()
        return self.bootstrap

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
        """Stop and delete all broker data (topics, offsets; for the secure one also its users,
        passwords, certificates and client files)."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.secure:
            for path in (self.tls_dir, self.clients_dir):
                shutil.rmtree(path, ignore_errors=True)
            self._passwords_file.unlink(missing_ok=True)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def broker_for_run(bootstrap: str | None) -> tuple[str, LocalBroker | None]:
    """The address a benchmark uses: `bootstrap` when given, else the local broker's, started if
    none runs. The broker comes back only when this call started it: the caller stops that one
    and leaves a running one (a developer's, the test suite's) running."""
    if bootstrap is not None:
        return bootstrap, None
    local = LocalBroker()
    ours = local.pid() is None
    return local.start(), (local if ours else None)
