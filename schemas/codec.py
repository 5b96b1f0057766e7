"""orjson encoding of contract records, and decoding with clear errors.

Encoding is ``model_dump(mode="json", by_alias=True)`` through orjson: UTF-8 JSON, one object per
record, keys as in the contract. Decoding never raises anything but `DecodeError`, so an agent or a
consumer can send the bytes to the dead-letter topic and go on.
"""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import ValidationError

from xidstream.schemas.base import Record
from xidstream.schemas.errors import DecodeError
from xidstream.schemas.models import ALL_MODELS

__all__ = ["encode", "decode", "decode_any", "to_dict", "MODELS_BY_SCHEMA"]

R = TypeVar("R", bound=Record)

MODELS_BY_SCHEMA: dict[str, type[Record]] = {m.SCHEMA: m for m in ALL_MODELS}
# An older version decodes into the current model: its record is relabelled, then validated.
LEGACY_MODELS: dict[str, type[Record]] = {old: m for m in ALL_MODELS for old in m.LEGACY}


def to_dict(record: Record) -> dict:
    return record.model_dump(mode="json", by_alias=True)


def encode(record: Record) -> bytes:
    return orjson.dumps(to_dict(record))


def _format_validation(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    more = len(exc.errors()) - 5
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def _load(raw: bytes | None) -> dict:
    if raw is None:
        raise DecodeError("empty record (null value, maybe a tombstone)", raw)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc}", raw) from None
    if not isinstance(data, dict):
        raise DecodeError(f"expected a JSON object, got {type(data).__name__}", raw)
    return data


def _validate(model: type[R], data: dict, raw: bytes | None) -> R:
    found = data.get("schema")
    if found != model.SCHEMA:  # a LEGACY version: relabel, then validate as the current one
        data["schema"] = model.SCHEMA
        data = model.from_legacy(found, data)
    try:
        record = model.model_validate(data)
    except ValidationError as exc:
        where = "" if found == model.SCHEMA else f" (a {found} record read as {model.SCHEMA})"
        raise DecodeError(_format_validation(exc) + where, raw, model.SCHEMA) from None
    if found != model.SCHEMA:
        record.note_decoded_from(found)
    return record


def decode(model: type[R], raw: bytes | None) -> R:
    """Decode bytes into `model`; raise `DecodeError` (never anything else) on bad input."""
    data = _load(raw)
    found = data.get("schema")
    if found != model.SCHEMA and found not in model.LEGACY:
        raise DecodeError(f"schema is {found!r}, expected {model.SCHEMA!r}", raw, model.SCHEMA)
    return _validate(model, data, raw)


def decode_any(raw: bytes | None) -> Record:
    """Decode bytes into whichever contract model its `schema` field names."""
    data = _load(raw)
    found = data.get("schema")
    # `schema` may be any JSON value here (a list is unhashable): only a string can name a model.
    model = (MODELS_BY_SCHEMA.get(found) or LEGACY_MODELS.get(found)) if isinstance(found, str) else None
    if model is None:
        raise DecodeError(f"unknown schema {found!r}", raw)
    return _validate(model, data, raw)
