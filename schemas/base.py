"""Common parts of every record on an xidstream topic.

Every record carries `schema` (type and version, e.g. ``xidstream.gpu_sample/1``), a unique
`event_id`, a UTC timestamp `ts` written as RFC 3339 with a ``Z`` suffix, and the `node` it is about.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timezone
from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer

from xidstream.schemas.limits import ID_MAX, NODE_NAME_MAX

__all__ = ["Record", "NodeRecord", "UtcDatetime", "utc_now", "format_ts", "new_event_id", "normalize_pci", "plain_text",
           "NODE_NAME_PATTERN", "NodeName", "is_node_name"]


def _to_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamp must carry a time zone (RFC 3339, e.g. 2026-11-28T03:00:00Z)")
    return value.astimezone(timezone.utc)


def format_ts(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds and a ``Z`` suffix (sorts as text)."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


UtcDatetime = Annotated[
    datetime,
    AfterValidator(_to_utc),
    PlainSerializer(format_ts, return_type=str, when_used="json"),
]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def new_event_id() -> str:
    return uuid.uuid4().hex


# Characters that change how text reads rather than what it says: C0/C1 controls (newlines,
# ANSI escapes), DEL, the Unicode line/paragraph separators and the bidirectional overrides and
# isolates (the "Trojan Source" characters, CVE-2021-42574).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def plain_text(text: str | None, limit: int = 500) -> str:
    """`text` as one plain line of at most `limit` characters, for what a person or another tool
    reads: a command's reason (signed, then written into Node annotations, Events and kured's
    sentinel), alert summaries. Part of it may come from a node (a result's `detail`, a process
    name from a kernel line): a newline must not forge a second sentinel or log line, an escape
    must not repaint a terminal, and 10 MB of detail must not ride along."""
    if not text:
        return ""
    if len(text) > 4 * limit:
        text = text[: 4 * limit]  # bound the work before the substitution
    out = _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)
    if len(out) > limit:
        tail = f"... [cut at {limit}]"
        out = out[: max(limit - len(tail), 0)] + tail if limit > len(tail) else out[:limit]
    return out


def normalize_pci(bus_id: str | bytes | None) -> str | None:
    """Normalise a PCI bus id to the kernel's ``dddd:bb:dd`` form, lower case.

    NVML says ``00000000:17:00.0`` (8-digit domain, bytes), the kernel's Xid line ``0000:17:00``,
    other NVRM lines ``0000:91:00.0``; MIG lines add `` GPU-I:nn``. All must compare equal
    (shared/data/README.md, "Normalise before comparing").
    """
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    text = bus_id.strip().split()[0] if bus_id.strip() else ""
    if text.upper().startswith("PCI:"):
        text = text[4:]
    parts = text.split(":")
    if len(parts) == 2:  # bb:dd[.f] without a domain
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    domain, bus, dev = parts
    dev = dev.split(".")[0]
    try:
        return f"{int(domain, 16) & 0xFFFF:04x}:{int(bus, 16):02x}:{int(dev, 16):02x}"
    except ValueError:
        return None


# A Kubernetes node name is a DNS-1123 subdomain (RFC 1123 host names, as the API server checks
# them: k8s.io/apimachinery/pkg/util/validation IsDNS1123Subdomain): lowercase letters, digits, '-'
# and '.', at most 253 characters (NODE_NAME_MAX), each dot-separated label starting and ending with
# a letter or a digit. Each label is also held to DNS's 63 (RFC 1035 section 2.3.4), which the
# kubelet's host names meet. A node chooses the name on its records, and the name reaches a line
# an operator pastes into a shell (`xidstream incidents`' approve line), Node annotations, Events
# and file names: in this alphabet it cannot carry a quote, a space, a `;`, a `$` or a newline.
_DNS1123_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
NODE_NAME_PATTERN = rf"^{_DNS1123_LABEL}(?:\.{_DNS1123_LABEL})*$"
_NODE_NAME = re.compile(NODE_NAME_PATTERN)


def is_node_name(name: object) -> bool:
    """Whether `name` is a Kubernetes node name: a DNS-1123 subdomain of at most 253 characters."""
    return isinstance(name, str) and len(name) <= NODE_NAME_MAX and _NODE_NAME.fullmatch(name) is not None


def _node_name(value: str) -> str:
    # The value is not quoted back: it is the sender's, and the error text reaches logs.
    if not _NODE_NAME.fullmatch(value):
        raise ValueError("not a Kubernetes node name (a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', "
                         "each dot-separated label 1 to 63 characters that starts and ends with a letter or digit)")
    return value


# A node name field: `Field(max_length=NODE_NAME_MAX, json_schema_extra={"pattern": NODE_NAME_PATTERN})`
# goes with it, for the length check first and for the JSON Schema.
NodeName = Annotated[str, AfterValidator(_node_name)]


class Record(BaseModel):
    """Base of every topic model. Subclasses set ``SCHEMA`` and a ``schema`` Literal."""

    SCHEMA: ClassVar[str] = ""
    # Earlier versions of this record that still decode into it (every field they had kept its
    # meaning, or `from_legacy` says what it means now); a producer not yet upgraded goes on working
    # during a rolling upgrade.
    LEGACY: ClassVar[tuple[str, ...]] = ()

    model_config = ConfigDict(
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        ser_json_bytes="base64",
        val_json_bytes="base64",
    )

    schema_: str = Field(alias="schema", description="Record type and version, e.g. xidstream.gpu_sample/1.")
    event_id: str = Field(default_factory=new_event_id, description="Unique id of this record.")
    ts: UtcDatetime = Field(default_factory=utc_now, description="When it happened (UTC, RFC 3339).")
    node: str = Field(min_length=1, description="Kubernetes node (host) name the record is about.")

    @classmethod
    def from_legacy(cls, found: str, data: dict) -> dict:
        """`data`, a record of the earlier version `found` (one of LEGACY), in this version's terms."""
        return data

    def signed_form(self, doc: dict) -> dict:
        """`doc` (this record's contract JSON) in the version it was decoded from, for a signature
        made by a producer of that version; this version's form otherwise."""
        return doc

    def note_decoded_from(self, found: str | None) -> None:
        """`xidstream.schemas.codec`: this record came in as the LEGACY version `found` (None: signed or made
        in this version's form). Kept only by a model whose `signed_form` depends on it, as a
        private attribute of its own: a private attribute on this base made pydantic run its
        private-attribute set-up, in Python and once per class of the hierarchy, for every record
        validated, the worker's inputs included (about a tenth of the worker's CPU per record)."""


class NodeRecord(Record):
    """A record a node or an executor sends: its `node` and `event_id` are bounded
    (schemas.limits), as every string in it is, because whoever runs on the node chooses them;
    `node` is also a Kubernetes node name (`is_node_name`), or the record does not decode."""

    event_id: str = Field(default_factory=new_event_id, max_length=ID_MAX, description="Unique id of this record.")
    node: NodeName = Field(
        min_length=1, max_length=NODE_NAME_MAX, json_schema_extra={"pattern": NODE_NAME_PATTERN},
        description="Kubernetes node (host) name the record is about: a DNS-1123 subdomain.")
