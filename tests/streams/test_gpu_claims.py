"""Two nodes claiming one GPU UUID (per-node identity on): the GPU row belongs to the node that
first spoke for it, and a record from another node naming that UUID is dead-lettered. Either of
the two may be the liar (a compromised node naming a UUID it read from a command, or speaking
first for one it expects), or the GPU moved; before, nothing but the dead letters said so. The
worker goes through `agent.test_context()` with a real `RecordVerifier`: no broker."""

from __future__ import annotations

import asyncio

import pytest

from xidstream.schemas import Classification, decode_any, encode
from xidstream.schemas.signing import SigningKey, generate_keys
from xidstream.streams.app import create_app
from xidstream.streams.metrics import metrics_text
from tests.streams.builders import GPU, sample
from xidstream.transport.identity import NodeIdentity, ProcessorIdentity, RecordVerifier
from xidstream.settings import Settings

SAMPLES = "tc.gpu.samples"
NODES = ("node-a", "node-b", "node-c")


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    d = tmp_path_factory.mktemp("identity")
    priv, _, _ = generate_keys(d / "processor")
    processor = ProcessorIdentity(SigningKey.load(priv))
    return processor, {n: NodeIdentity.load_or_create(d / n, n) for n in NODES}


def _run(identities, records):
    """Each (record, sending node) through one worker's GPU agent, as read from gpu.samples with
    the sender's MAC."""
    processor, nodes = identities
    verifier = RecordVerifier(processor)
    for name, node in nodes.items():
        verifier.enroll(name, node.x25519_public)
    auth = {name: node.record_auth(processor.public) for name, node in nodes.items()}

    async def run():
        proc = create_app(Settings(topic_prefix="tc."), verifier=verifier)
        sent: dict[str, list] = {"alerts": [], "fleet_topic": [], "remediation": [], "deadletter": []}

        def capture(name):
            async def send(key=None, value=None, **kwargs):
                sent[name].append((key, value))
            return send

        for name in sent:
            getattr(proc, name).send = capture(name)
        async with proc.gpus.test_context() as agent:
            agent._get_strtopic = lambda channel: SAMPLES  # the message's topic: the contract input
            for rec, sender in records:
                value, key = encode(rec), rec.gpu_uuid.encode()
                await agent.put(value, key=key, headers=[auth[sender].header(SAMPLES, key, value)])
        return proc, sent

    return asyncio.run(run())


def _claims(sent):
    return [a for a in (decode_any(v) for _, v in sent["alerts"]) if a.classification.value == "GPU_CLAIM_CONFLICT"]


def test_a_second_node_claiming_a_gpu_raises_one_alert_naming_both_nodes(identities):
    records = [(sample(0, gpu=GPU, node="node-b"), "node-b")]
    records += [(sample(t, gpu=GPU, node="node-a"), "node-a") for t in range(1, 51)]
    proc, sent = _run(identities, records)
    dead = [decode_any(v) for _, v in sent["deadletter"]]
    assert len(dead) == 50 and all(f"belongs to node node-b; node-a cannot speak for it" in d.error for d in dead)
    claims = _claims(sent)
    assert len(claims) == 1, "a second claimant to a GPU UUID raised no alert (or one per record)"
    (a,) = claims
    assert (a.gpu_uuid, a.node, a.state, a.evidence.gpu_index) == (GPU, "node-a", "open", 1)
    assert a.classification is Classification.GPU_CLAIM_CONFLICT and a.severity.value == "warning"
    assert "node-a" in a.summary and "node-b" in a.summary and GPU in a.summary
    (entry,) = a.evidence.timeline
    assert entry.data["owner"] == "node-b" and entry.data["claimant"] == "node-a" and entry.data["gpu_uuid"] == GPU
    # every refused claim is counted, alerted or not
    text = metrics_text(proc.stats, proc.labelled)
    assert "xidstream_processor_gpu_claims_refused_total 50" in text
    assert 'xidstream_processor_verdicts_raised_total{classification="GPU_CLAIM_CONFLICT"} 1' in text
    # the row is node-b's still, and nothing of node-a's reached the fleet agent
    assert not any(b"node-a" in v for _, v in sent["fleet_topic"])


def test_a_flood_of_claims_over_many_gpus_is_a_bounded_number_of_alerts(identities):
    from xidstream.streams.claims import CLAIM_ALERTS_PER_WINDOW

    gpus = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(200)]
    records = [(sample(0, gpu=g, node="node-b"), "node-b") for g in gpus]
    records += [(sample(1, gpu=g, node=claimant), claimant) for g in gpus for claimant in ("node-a", "node-c")]
    proc, sent = _run(identities, records)
    assert proc.stats["gpu_claims_refused"] == 400
    claims = _claims(sent)
    assert 1 <= len(claims) == CLAIM_ALERTS_PER_WINDOW < 400
    assert {a.node for a in claims} <= {"node-a", "node-c"}


# -- the pacing, exactly (streams.claims) ---------------------------------------------------------
def test_a_pair_alerts_once_an_hour_and_its_next_alert_counts_what_came_between():
    from xidstream.streams.claims import CLAIM_REALERT_S, ClaimAlerts

    assert CLAIM_REALERT_S == 3600.0
    c = ClaimAlerts()
    first = c.refused(GPU, "node-b", "node-a", 1000.0)
    assert first is not None and first.state == "open" and first.evidence.timeline[0].data["refused"] == 1
    assert all(c.refused(GPU, "node-b", "node-a", 1000.0 + t) is None for t in (1, 100, 3599.999))
    again = c.refused(GPU, "node-b", "node-a", 4600.0)  # the hour is up: said again, as an update
    assert again is not None and again.state == "updated" and again.incident_id == first.incident_id
    assert again.evidence.timeline[0].data["refused"] == 4 and again.alert_id != first.alert_id
    # another claimant of the same GPU, or the same claimant of another GPU, is its own incident
    other = c.refused(GPU, "node-b", "node-c", 4600.0)
    assert other is not None and other.incident_id != first.incident_id and other.node == "node-c"


def test_the_window_caps_alerts_over_all_gpus_and_the_next_alert_says_how_many_were_not():
    from xidstream.streams.claims import CLAIM_ALERTS_PER_WINDOW, CLAIM_WINDOW_S, ClaimAlerts

    assert (CLAIM_ALERTS_PER_WINDOW, CLAIM_WINDOW_S) == (10, 600.0)
    c = ClaimAlerts()
    sent = [c.refused(f"GPU-{i}", "node-b", "node-a", 10.0 + i) for i in range(25)]
    assert sum(a is not None for a in sent) == 10 and all(a is not None for a in sent[:10])
    assert c.refused("GPU-x", "node-b", "node-a", 10.0 + CLAIM_WINDOW_S - 0.001) is None  # the first still inside
    nxt = c.refused("GPU-y", "node-b", "node-a", 10.0 + CLAIM_WINDOW_S)  # the first alert left the window
    assert nxt is not None and nxt.evidence.timeline[0].data["unalerted"] == 16
    assert "(16 more refused claim(s) not alerted since the last alert: rate limit)" in nxt.summary
    # a GPU whose claim found the window full alerts once there is room, counting its refusals
    later = c.refused("GPU-20", "node-b", "node-a", 10.0 + 2 * CLAIM_WINDOW_S)
    assert later is not None and later.state == "open" and later.evidence.timeline[0].data["refused"] == 2


def test_the_pairs_remembered_are_bounded():
    from xidstream.streams.claims import PAIRS_KEPT, ClaimAlerts

    c = ClaimAlerts()
    for i in range(PAIRS_KEPT + 50):
        c.refused(f"GPU-{i}", "node-b", "node-a", float(i))
    assert len(c._pairs) == PAIRS_KEPT and ("GPU-0", "node-b", "node-a") not in c._pairs


def test_the_alert_names_both_nodes_the_gpu_and_what_to_do_in_plain_text():
    from xidstream.streams.claims import claim_alert

    a = claim_alert(GPU, "node-b", "node-a\x1b[2J", 1_800_000_000.0, state="open", refused=3, unalerted=0,
                    record_schema="xidstream.gpu_sample/2", record_ts=None, pci_bus_id="0000:02:00")
    assert a.summary.startswith(f"two nodes claim GPU {GPU}: it belongs to node node-b (the first to speak for it), "
                                f"and node node-a\\x1b[2J sent 3 record(s) naming it, dead-lettered")
    assert "\x1b" not in a.summary and all("\x1b" not in s for s in a.recommended_steps)
    assert a.classification is Classification.GPU_CLAIM_CONFLICT and a.pci_bus_id == "0000:02:00"
    assert len(a.recommended_steps) == 3 and "XidstreamGpuClaimConflict" in a.recommended_steps[2]
    assert a.incident_id == claim_alert(GPU, "node-b", "node-a\x1b[2J", 5.0, state="updated", refused=1, unalerted=0,
                                        record_schema=None, record_ts=None, pci_bus_id=None).incident_id
