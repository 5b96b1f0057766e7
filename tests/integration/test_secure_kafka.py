"""Kafka security on the real secure local broker: SASL_SSL with SCRAM-SHA-512, one user
per role, KRaft's StandardAuthorizer and the contract's least-privilege ACLs (transport.acls).

Each role works end to end with its own properties file (the collector's sink, a real processor
worker, an executor-role consumer and producer); the roles are refused what the contract does not
give them; a wrong password and an untrusted CA fail fast, naming the cause.

The pure translations (properties file -> Settings, librdkafka -> faust) are tested here too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from xidstream.schemas import decode_any, encode
from xidstream.schemas.errors import ConfigError, TopicError
from xidstream.transport.config import KafkaConfig
from xidstream.transport.faust_auth import faust_kwargs
from xidstream.settings import Settings, read_kafka_properties
from tests.deploy.test_helm_chart import helm  # noqa: F401 - the helm fixture

# slow (make test-all only): the secure broker (a second JVM) and its end-to-end role paths
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GPU1 = "GPU-8d2e4b7a-1c9f-4a3b-b6d5-0e7f9a2c4d81"


# -- pure: the properties file and the faust translation -------------------------------------------
def test_a_properties_file_gives_bootstrap_and_client_settings_and_env_and_flags_win(tmp_path):
    f = tmp_path / "c.properties"
    f.write_text("# comment\n\nbootstrap.servers=k1:9093,k2:9093\nsecurity.protocol=SASL_SSL\n"
                 "sasl.mechanisms=SCRAM-SHA-512\nsasl.username=collector\nsasl.password=a=b\n")
    s = Settings.from_env({}, kafka_config=f)
    assert s.bootstrap == "k1:9093,k2:9093"
    assert s.kafka_extra == {"security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-512",
                             "sasl.username": "collector", "sasl.password": "a=b"}
    env = {"XIDSTREAM_KAFKA_CONFIG": str(f), "XIDSTREAM_BOOTSTRAP": "other:1", "XIDSTREAM_KAFKA_SASL_USERNAME": "x"}
    s = Settings.from_env(env)
    assert s.bootstrap == "other:1" and s.kafka_extra["sasl.username"] == "x"
    assert "config" not in s.kafka_extra  # XIDSTREAM_KAFKA_CONFIG is a file, not a librdkafka setting
    assert s.with_(bootstrap="flag:2").bootstrap == "flag:2"
    bad = tmp_path / "bad.properties"
    bad.write_text("security.protocol SASL_SSL\n")
    with pytest.raises(ConfigError, match="bad.properties:1: expected key=value"):
        read_kafka_properties(bad)
    with pytest.raises(ConfigError, match="cannot read the Kafka properties file"):
        Settings.from_env({}, kafka_config=tmp_path / "missing")


def test_replication_settings_are_checked():
    with pytest.raises(ConfigError, match="min.insync.replicas"):
        Settings.from_env({"XIDSTREAM_REPLICATION": "3", "XIDSTREAM_MIN_INSYNC_REPLICAS": "4"})
    s = Settings.from_env({"XIDSTREAM_REPLICATION": "3", "XIDSTREAM_MIN_INSYNC_REPLICAS": "2"})
    assert (s.replication_factor, s.min_insync_replicas) == (3, 2)
    from xidstream.transport.kafka import topic_config

    assert topic_config(s, {"cleanup.policy": "compact"}) == {"cleanup.policy": "compact", "min.insync.replicas": "2"}
    assert topic_config(Settings(), {}) == {}


def test_faust_gets_scram_over_tls_from_the_librdkafka_settings(tmp_path):
    import faust

    from workshop.localbroker import LocalBroker

    broker = LocalBroker(secure=True, state_dir=tmp_path)
    broker._ensure_tls()
    conf = KafkaConfig(bootstrap="a:1, b:2", kafka_extra={
        "security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-512", "sasl.username": "processor",
        "sasl.password": "pw", "ssl.ca.location": str(broker.ca_file), "client.id": "ignored"})
    kw = faust_kwargs(conf)
    assert kw["broker"] == ["kafka://a:1", "kafka://b:2"]
    cred = kw["broker_credentials"]
    assert isinstance(cred, faust.SASLCredentials)
    assert (cred.username, cred.password, cred.mechanism.value, cred.protocol.value) == \
        ("processor", "pw", "SCRAM-SHA-512", "SASL_SSL")
    assert cred.ssl_context.check_hostname and cred.ssl_context.get_ca_certs()
    assert faust_kwargs(KafkaConfig(bootstrap="h:1")) == {"broker": ["kafka://h:1"]}


@pytest.mark.parametrize("extra, message", [
    ({"security.protocol": "SASL_SSL", "sasl.mechanisms": "GSSAPI", "sasl.username": "u", "sasl.password": "p"},
     "GSSAPI is not supported"),
    ({"security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-512"}, "needs sasl.username and sasl.password"),
    ({"sasl.username": "u"}, "security.protocol is PLAINTEXT"),
    ({"security.protocol": "SSL", "ssl.keystore.location": "k.p12"}, "ssl.keystore.location cannot be carried over"),
    ({"security.protocol": "SSL", "ssl.ca.location": "/nonexistent/ca.pem"}, "cannot build the processor's TLS context"),
    ({"security.protocol": "SSL", "enable.ssl.certificate.verification": "false"}, "would accept any broker certificate"),
    ({"security.protocol": "SSL", "ssl.certificate.location": "c.pem"}, "go together"),
    ({"security.protocol": "KERBEROS"}, "is not one of"),
])
def test_what_faust_cannot_carry_is_a_clear_config_error(extra, message):
    with pytest.raises(ConfigError, match=message):
        faust_kwargs(KafkaConfig(bootstrap="h:1", kafka_extra=extra))


# -- on the secure broker ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secure(secure_kafka):
    """A fresh topic prefix on the secure broker: the contract's topics created and the ACLs of
    every role granted for it, as `admin`; everything under it deleted at the end."""
    from xidstream.transport.acls import apply_acls
    from xidstream.transport.kafka import create_topics, delete_run

    prefix = f"s{uuid.uuid4().hex[:8]}."

    def role(name: str) -> Settings:
        return Settings.from_env({}, kafka_config=secure_kafka.client_file(name)).with_(
            topic_prefix=prefix, partitions=2, node="node-a")

    admin = role("admin")
    assert apply_acls(admin) > 20
    create_topics(admin)
    yield role
    delete_run(admin)


def _start_worker(props: Path, settings: Settings, tmp_path: Path, name: str = "w", extra=()) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XIDSTREAM_")}
    cmd = [sys.executable, "-m", "xidstream.cli", "process", "--kafka-config", str(props),
           "--topic-prefix", settings.topic_prefix, "--partitions", str(settings.partitions),
           "--fast-rebalance", "--data-dir", str(tmp_path / f"data-{name}"), "--loglevel", "warning", *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.broker
def test_each_role_works_end_to_end_with_its_properties_file(secure, secure_kafka, tmp_path):
    from xidstream.collectors.scenario import ScenarioRunner
    from xidstream.collectors.sink import KafkaSink
    from xidstream.schemas import Action, Outcome, RemediationResult, load_scenario
    from xidstream.transport.kafka import consumer_config, producer_config, read_all

    collector, admin, executor = secure("collector"), secure("admin"), secure("cluster-executor")
    reg = admin.topics
    # the collector publishes through its sink
    sink = KafkaSink(collector, tmp_path / "spool")
    ScenarioRunner(load_scenario(ROOT / "scenarios" / "motivating-incident.yaml"), sink).run()
    assert sink.flush(30), sink.producer
    assert sink.dropped_permanent == 0
    sink.close()
    # a real processor worker with the processor's credentials reads it and writes alerts and commands
    worker = _start_worker(secure_kafka.client_file("processor"), secure("processor"), tmp_path)
    try:
        deadline, commands = time.monotonic() + 120, []
        while time.monotonic() < deadline and not commands:
            assert worker.poll() is None, (tmp_path / "w.log").read_text()[-3000:]
            commands = read_all(admin, [reg.name("gpu.remediation")], timeout=5, idle=2)
    finally:
        _stop(worker)
    assert commands, (tmp_path / "w.log").read_text()[-3000:]
    alerts = [decode_any(m.value()) for m in read_all(admin, [reg.name("gpu.alerts")], timeout=10, idle=2)]
    assert any(a.gpu_uuid == GPU1 for a in alerts)
    # an executor reads a command in its consumer group and writes the result
    consumer = Consumer(consumer_config(executor, f"{executor.topic_prefix}xidstream-executor-cluster"))
    consumer.subscribe([reg.name("gpu.remediation")])
    try:
        msg, deadline = None, time.monotonic() + 30
        while msg is None and time.monotonic() < deadline:
            m = consumer.poll(1.0)
            if m is not None:
                assert m.error() is None, m.error()
                msg = m
        assert msg is not None
        consumer.commit(msg, asynchronous=False)
    finally:
        consumer.close()
    command = decode_any(msg.value())
    result = RemediationResult(ts=command.ts, node=command.node, command_id=command.command_id,
                               incident_id=command.incident_id, gpu_uuid=command.gpu_uuid,
                               pci_bus_id=command.pci_bus_id, action=Action(command.action),
                               outcome=Outcome.failed, detail="test: executor role writes results")
    producer = Producer(producer_config(executor))
    errors: list = []
    producer.produce(reg.name("gpu.remediation.results"), key=command.node.encode(), value=encode(result),
                     on_delivery=lambda err, m: errors.append(err))
    assert producer.flush(30) == 0 and errors == [None]
    got = read_all(admin, [reg.name("gpu.remediation.results")], expected=1, timeout=20)
    assert decode_any(got[0].value()).command_id == command.command_id


def _produce_error(settings: Settings, topic: str) -> KafkaError | None:
    from xidstream.transport.kafka import producer_config

    out: list = []
    p = Producer(producer_config(settings, **{"message.timeout.ms": 15000}))
    p.produce(topic, key=b"k", value=b"{}", on_delivery=lambda err, m: out.append(err))
    p.flush(20)
    assert out, "no delivery report within 20 s"
    return out[0]


def _fetch_error(settings: Settings, topic: str) -> KafkaError | None:
    """The error a consumer of `settings` gets reading partition 0 of `topic`: the broker's
    metadata answer when it will not even describe the topic to this user (no READ, no DESCRIBE),
    else the fetch's, by assignment from offset 0 (a group error, from a group the role may not
    use, is skipped: the topic's own READ is what is tested)."""
    from xidstream.transport.kafka import consumer_config

    c = Consumer(consumer_config(settings, f"{settings.topic_prefix}probe-{uuid.uuid4().hex[:6]}"))
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        if md.error is not None:
            return md.error
        c.assign([TopicPartition(topic, 0, 0)])
        deadline, other = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and m.error() is not None:
                if m.error().code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                    return m.error()
                if m.error().code() != KafkaError._PARTITION_EOF:
                    other = other or m.error()
            elif m is not None:
                return None  # read a record: not refused
        return other
    finally:
        c.close()


@pytest.mark.broker
@pytest.mark.parametrize("role, topic", [
    ("collector", "gpu.remediation"),        # a compromised node cannot order a reset
    ("collector", "gpu.alerts"),
    ("collector", "gpu.remediation.results"),
    ("executor", "gpu.remediation"),         # an executor cannot forge commands
    ("executor", "gpu.samples"),
    ("processor", "gpu.remediation.approvals"),  # approvals are a person's, not the processor's
])
def test_a_role_is_refused_writing_what_the_contract_does_not_give_it(secure, role, topic):
    s = secure(role)
    err = _produce_error(s, s.topics.name(topic))
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err


@pytest.mark.broker
@pytest.mark.parametrize("role, topic", [
    ("collector", "gpu.alerts"),
    ("collector", "gpu.remediation"),
    ("collector", "gpu.xid"),                # it writes its inputs, it does not read them back
    ("executor", "gpu.alerts"),
])
def test_a_role_is_refused_reading_what_the_contract_does_not_give_it(secure, role, topic):
    s = secure(role)
    err = _fetch_error(s, s.topics.name(topic))
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err


@pytest.mark.broker
def test_the_collector_cannot_create_topics_or_read_the_processors_group(secure):
    from xidstream.transport.kafka import create_topics

    s = secure("collector")
    with pytest.raises(TopicError, match="TOPIC_AUTHORIZATION_FAILED"):
        create_topics(replace(s, topic_prefix=s.topic_prefix + "x."), names=["gpu.xid"])


@pytest.mark.broker
def test_a_wrong_password_fails_fast_naming_the_user(secure, tmp_path):
    from xidstream.transport.kafka import create_topics

    s = secure("collector")
    bad = replace(s, kafka_extra={**s.kafka_extra, "sasl.password": "not-the-password"})
    t0 = time.monotonic()
    with pytest.raises(TopicError, match=r"authentication failed for user collector .*invalid credentials"):
        create_topics(bad)
    assert time.monotonic() - t0 < 15


def _untrusted_ca(tmp_path: Path) -> Path:
    from workshop.localbroker import LocalBroker

    other = LocalBroker(secure=True, state_dir=tmp_path / "other")
    other._ensure_tls()
    return other.ca_file


@pytest.mark.broker
def test_an_untrusted_ca_fails_fast_naming_tls(secure, tmp_path):
    from xidstream.transport.kafka import create_topics

    s = secure("collector")
    bad = replace(s, kafka_extra={**s.kafka_extra, "ssl.ca.location": str(_untrusted_ca(tmp_path))})
    t0 = time.monotonic()
    with pytest.raises(TopicError, match=r"TLS: certificate verify failed"):
        create_topics(bad)
    assert time.monotonic() - t0 < 15


@pytest.mark.broker
def test_the_processor_with_an_untrusted_ca_exits_with_the_cause(secure, secure_kafka, tmp_path):
    props = tmp_path / "processor.properties"
    lines = secure_kafka.client_file("processor").read_text().splitlines()
    props.write_text("\n".join(
        f"ssl.ca.location={_untrusted_ca(tmp_path)}" if ln.startswith("ssl.ca.location=") else ln for ln in lines))
    worker = _start_worker(props, secure("processor"), tmp_path, "bad")
    try:
        rc = worker.wait(40)
    finally:
        _stop(worker)
    log = (tmp_path / "bad.log").read_text()
    assert rc == 2 and "TLS: certificate verify failed" in log, log[-2000:]


@pytest.mark.broker
def test_replication_and_min_insync_apply_to_contract_internal_and_changelog_topics(secure):
    from confluent_kafka.admin import ConfigResource

    from xidstream.streams.app import changelog_topics, internal_topics
    from xidstream.transport.kafka import admin as admin_client
    from xidstream.transport.kafka import create_topics, ensure_processor_topics

    s = secure("admin").with_(min_insync_replicas=1)
    s = replace(s, topic_prefix=s.topic_prefix + "r.")
    create_topics(s, names=list(__import__("xidstream.schemas.topics", fromlist=["TOPICS"]).TOPICS))
    ensure_processor_topics(s, internal_topics(s), compacted=changelog_topics(s, s.topic_prefix + "app"))
    client = admin_client(s)
    names = [s.topics.name("gpu.xid"), *internal_topics(s), *changelog_topics(s, s.topic_prefix + "app")]
    futures = client.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in names])
    for res, fut in futures.items():
        entry = fut.result()["min.insync.replicas"]
        assert entry.value == "1" and entry.source == 1, (res, entry)  # 1: DYNAMIC_TOPIC_CONFIG, set by us
    md = client.list_topics(timeout=10)
    assert all(len(p.replicas) == 1 for n in names for p in md.topics[n].partitions.values())


@pytest.mark.broker
def test_the_collectors_sink_names_a_refused_password_and_keeps_the_records(secure, tmp_path):
    from xidstream.collectors.sink import KafkaSink
    from tests.factories import one_of_each

    s = secure("collector")
    bad = replace(s, kafka_extra={**s.kafka_extra, "sasl.password": "not-the-password"})
    sink = KafkaSink(bad, tmp_path / "spool")
    sink.publish(one_of_each()[0])
    assert not sink.flush(5)
    assert "authentication failed for user collector" in (sink.auth_error or "")
    assert sum(lane.spool.depth for lane in sink.lanes.values()) == 1  # spooled, not dropped
    sink.producer = None


def _commit_error(settings: Settings, group: str, topic: str):
    """The error of setting `group`'s offset of `topic`[0] to 0 through the Admin API, as a rewind
    or a commit to the end would (None when allowed)."""
    from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition

    from xidstream.transport.kafka import admin

    client = admin(settings)  # kept referenced until the answer: a freed AdminClient never completes its futures
    futures = client.alter_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0, 0)])], request_timeout=20)
    try:
        for fut in futures.values():
            for tp in fut.result(timeout=30).topic_partitions:
                if tp.error is not None:  # a partition-level refusal arrives here, not raised
                    return tp.error
        return None
    except KafkaException as exc:
        return exc.args[0]


@pytest.mark.broker
def test_a_nodes_credentials_cannot_commit_or_rewind_the_cluster_executors_group(secure):
    """With a node's `executor` user (threat T2) the cluster executor's group was committed to its
    end on 1484261, after which it handled none of the signed commands. Now it is its own user's."""
    from xidstream.transport.acls import executor_group

    node, cluster = secure("executor"), secure("cluster-executor")
    topic = node.topics.name("gpu.remediation")
    err = _commit_error(node, executor_group(node.topic_prefix, "cluster"), topic)
    assert err is not None and err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED, err
    assert _commit_error(cluster, executor_group(cluster.topic_prefix, "cluster"), topic) is None
    err = _commit_error(cluster, executor_group(cluster.topic_prefix, "node", "gpu-1"), topic)
    assert err is not None and err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED, err


@pytest.mark.broker
def test_no_nodes_credentials_can_move_another_node_executors_position(secure, tmp_path):
    """Every node holds the `executor` user. On 43fa317 it could commit node B's group
    (`xidstream-executor-node-B`) to its end, after which B's executor skipped every command. Now
    the role has no group at all: a node executor keeps its position in its own cursor file, and
    with exactly the `executor` user it still reads and answers its own node's commands, resumes
    after a restart where it stopped, and answers nobody else's."""
    import threading

    from xidstream.executors.node import NodeActions
    from xidstream.executors.runner import Executor, run_kafka
    from xidstream.schemas.models import RemediationResult
    from tests.executors.helpers import command, keypair
    from xidstream.transport.acls import executor_group
    from xidstream.transport.kafka import producer_config, read_all

    node, admin = secure("executor"), secure("admin")
    reg = node.topics
    cmd_topic, res_topic = reg.name("gpu.remediation"), reg.name("gpu.remediation.results")
    # this module's tests share their topics: names of this test's own, so no other test sees its
    # commands (the end-to-end test asserts none for node-b) and it reads only its own results
    me, other = f"exec-b-{uuid.uuid4().hex[:6]}", f"exec-a-{uuid.uuid4().hex[:6]}"
    for victim in (me, other):
        err = _commit_error(node, executor_group(node.topic_prefix, "node", victim), cmd_topic)
        assert err is not None and err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED, err

    key, verify, _, _ = keypair(tmp_path)
    producer = Producer(producer_config(admin))

    def send(*cmds) -> None:
        for c in cmds:
            producer.produce(cmd_topic, key=c.node.encode(), value=encode(c))
        assert producer.flush(10) == 0

    def answers_so_far() -> list[RemediationResult]:
        out = [decode_any(m.value()) for m in read_all(admin, [res_topic], timeout=5)]
        return [r for r in out if r.node in (me, other)]

    def run_once(expected: int) -> list[RemediationResult]:
        ex = Executor(scope="node", node=me, keys=verify, state_dir=tmp_path / "state",
                      actions=NodeActions(None, me, None, tmp_path / "reboot-required"))
        stop = threading.Event()
        t = threading.Thread(target=run_kafka, args=(ex, node), kwargs={"stop": stop, "poll": 0.2}, daemon=True)
        t.start()
        try:
            deadline = time.monotonic() + 60
            while len(answers_so_far()) < expected and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(1.5)  # room for an answer too many
            got = answers_so_far()
        finally:
            stop.set()
            t.join(20)
        assert not t.is_alive()
        return got

    first = key.sign(command(me, "REBOOT_NODE"))
    send(key.sign(command(other, "REBOOT_NODE")), first)
    answers = run_once(1)
    assert [r.command_id for r in answers] == [first.command_id]
    assert answers[0].detail.startswith("dry run: would"), answers[0].detail
    assert (tmp_path / "state" / f"cursor-node-{me}.json").exists()
    second = key.sign(command(me, "REBOOT_NODE"))
    send(second)
    answers = run_once(2)  # the restart starts at its cursor: the first command is not read again
    assert [r.command_id for r in answers] == [first.command_id, second.command_id]


@pytest.mark.broker
def test_node_a_credentials_cannot_move_node_b_on_the_secure_broker(secure, secure_kafka, tmp_path):
    """The tenant-proof end-to-end test with each role's own credentials: node A holds the
    collector's and the node executor's (as every node does) and its identity keys; a real worker
    runs as `processor`; enrollments come from `cluster-executor`. No command, no alert for node B;
    every forgery dead-lettered with its reason; node A's Xid 79 still gets its plan."""
    from tests.integration.test_identity_on_broker import run_forgeries

    run_forgeries(secure, lambda extra, files: _start_worker(secure_kafka.client_file("processor"), secure("processor"),
                                                             tmp_path, extra=extra), tmp_path)


@pytest.mark.broker
def test_node_a_cannot_move_node_b_with_the_processor_as_the_default_chart_renders_it(secure, secure_kafka, helm,
                                                                                     tmp_path):
    """The same forgeries, with the processor's trust flags taken from `helm template` of the chart
    with its DEFAULT values (no identity value set): telemetry, results and inventories about node
    B sent with node A's credentials change nothing and are dead-lettered with their reason. With
    the defaults of before (identity off) the rendered processor believed them all."""
    from tests.integration.test_identity_on_broker import chart_trust_args, run_forgeries

    def start(extra, files):
        args = chart_trust_args(helm, files)
        assert "--enroller-key" in args and "--records-not-tied-to-nodes" not in args, args
        return _start_worker(secure_kafka.client_file("processor"), secure("processor"), tmp_path, extra=args)

    run_forgeries(secure, start, tmp_path)
