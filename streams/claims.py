"""Two nodes claiming one GPU UUID: the `GPU_CLAIM_CONFLICT` alert, rate-limited.

With per-node identity on, a GPU row belongs to the node that first spoke for it (`xidstream.streams.app`):
a record from another node naming that UUID is dead-lettered, so a node cannot re-point another
node's GPU to itself and answer its commands. Who lies is not known from here: GPU UUIDs are not
secret (every command carries one), so node B naming node A's GPU may be a compromised B, and a
compromised node that speaks first for a UUID it expects (a GPU being installed) leaves the real
node as the one refused. Or the GPU moved between the two (a board swap keeps its UUID). Each
case needs a person, so the refusal is an alert besides its dead letters.

What an adversary controls: a compromised node can claim every GPU UUID it has seen, as often as it
sends records, and choose their timestamps. So alerts are paced by this worker's clock, never by a
record's: at most one per GPU, owner and claimant every `CLAIM_REALERT_S`, and at most
`CLAIM_ALERTS_PER_WINDOW` per worker every `CLAIM_WINDOW_S` over all GPUs. Every refused claim
is counted on /metrics (`xidstream_processor_gpu_claims_refused_total`) and dead-lettered, alerted
or not; the next alert says how many went unalerted. State is bounded: `PAIRS_KEPT` pairs, the
least recently claimed forgotten first (a forgotten pair may alert again, within the window's cap).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from datetime import datetime, timezone

from xidstream.schemas.base import plain_text
from xidstream.schemas.models import Alert, Evidence, EvidenceEntry
from xidstream.schemas.vocab import Classification, Severity
from xidstream.streams import rules as R
from xidstream.streams.rules import facts, rule_ref

__all__ = ["ClaimAlerts", "claim_alert", "CLAIM_REALERT_S", "CLAIM_ALERTS_PER_WINDOW", "CLAIM_WINDOW_S", "PAIRS_KEPT"]

CLAIM_REALERT_S = 3600.0  # one alert per GPU, owner and claimant an hour: a claim that goes on is one incident
CLAIM_WINDOW_S = 600.0
CLAIM_ALERTS_PER_WINDOW = 10  # per worker: a node claiming 10,000 GPUs is 10 alerts in 10 min, and the counter
PAIRS_KEPT = 4096
_TEXT = 253  # a node name's bound (a DNS subdomain); a GPU UUID is shorter


def claim_alert(gpu_uuid: str, owner: str, claimant: str, now: float, *, state: str, refused: int,
                unalerted: int, record_schema: str | None, record_ts: datetime | None, pci_bus_id: str | None,
                gpu_index: int | None = None) -> Alert:
    """The alert for `claimant` naming GPU `gpu_uuid`, whose row belongs to `owner`: `refused`
    records of this pair since its last alert (this one included), `unalerted` refused claims of
    any pair that the window's cap kept from an alert since the last alert went out."""
    gpu, own, other = (plain_text(x, _TEXT) for x in (gpu_uuid, owner, claimant))
    incident = hashlib.sha256(f"gpu-claim:{gpu_uuid}:{owner}:{claimant}".encode()).hexdigest()[:24]
    when = datetime.fromtimestamp(now, tz=timezone.utc)
    summary = (f"two nodes claim GPU {gpu}: it belongs to node {own} (the first to speak for it), and node {other} "
               f"sent {refused} record(s) naming it, dead-lettered; one of them is not telling the truth, or the GPU "
               f"moved between them")
    if unalerted:
        summary += f" ({unalerted} more refused claim(s) not alerted since the last alert: rate limit)"
    return Alert(
        ts=when, node=claimant, alert_id=f"{incident}-{int(now * 1000)}", incident_id=incident, gpu_uuid=gpu_uuid,
        pci_bus_id=pci_bus_id, classification=Classification.GPU_CLAIM_CONFLICT, severity=Severity.warning,
        state=state, summary=summary, rule=rule_ref(R.CLAIM_CONFLICT, facts(refused=refused, unalerted=unalerted)),
        evidence=Evidence(node=claimant, gpu_uuid=gpu_uuid, gpu_index=gpu_index, pci_bus_id=pci_bus_id, timeline=[EvidenceEntry(
            ts=when, kind="note", summary=summary,
            data={"gpu_uuid": gpu_uuid, "owner": owner, "claimant": claimant, "refused": refused,
                  "unalerted": unalerted, "record": record_schema,
                  "record_ts": record_ts.isoformat() if record_ts is not None else None})]),
        recommended_steps=[
            f"Ask both nodes which GPUs they hold: `nvidia-smi --query-gpu=uuid,serial,pci.bus_id --format=csv` on "
            f"{own} and on {other}.",
            f"If {other} does not hold {gpu}, it speaks for another node's GPU: treat it as compromised (cordon it, "
            f"take it out of service, read its dead letters). If {own} does not hold it, {own} spoke first for a GPU "
            f"that is not its own: the same, for {own}.",
            "If the GPU moved between them (a board swap keeps its UUID), its records from the new node stay refused "
            "while the processor's row names the old one: the runbook XidstreamGpuClaimConflict says what to do.",
        ],
    )


class ClaimAlerts:
    """Which refused claims become an alert (module docstring). Not persisted: a restarted worker
    may alert a claim that goes on once more, within the same caps."""

    def __init__(self) -> None:
        # (gpu, owner, claimant) -> [time of its last alert, refused since then, alerts so far]
        self._pairs: OrderedDict[tuple[str, str, str], list] = OrderedDict()
        self._sent: deque[float] = deque()  # times of the alerts within the window
        self._unalerted = 0

    def refused(self, gpu_uuid: str, owner: str, claimant: str, now: float, *, record_schema: str | None = None,
                record_ts: datetime | None = None, pci_bus_id: str | None = None,
                gpu_index: int | None = None) -> Alert | None:
        """One record of `claimant` naming `gpu_uuid`, refused because its row is `owner`'s, at
        `now` (this worker's clock, epoch s): the alert to publish, or None."""
        key = (gpu_uuid, owner, claimant)
        pair = self._pairs.pop(key, None)
        if pair is None:
            pair = [None, 0, 0]
        self._pairs[key] = pair  # the most recently claimed last
        if len(self._pairs) > PAIRS_KEPT:
            self._pairs.popitem(last=False)
        pair[1] += 1
        if pair[0] is not None and now - pair[0] < CLAIM_REALERT_S:
            return None  # this pair alerted within the hour: counted, and said at its next alert
        while self._sent and now - self._sent[0] >= CLAIM_WINDOW_S:
            self._sent.popleft()
        if len(self._sent) >= CLAIM_ALERTS_PER_WINDOW:
            self._unalerted += 1
            return None
        self._sent.append(now)
        alert = claim_alert(gpu_uuid, owner, claimant, now, state="open" if pair[2] == 0 else "updated",
                            refused=pair[1], unalerted=self._unalerted, record_schema=record_schema,
                            record_ts=record_ts, pci_bus_id=pci_bus_id, gpu_index=gpu_index)
        pair[0], pair[1], pair[2] = now, 0, pair[2] + 1
        self._unalerted = 0
        return alert
