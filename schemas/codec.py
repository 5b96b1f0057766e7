"""orjson encoding of contract records, and decoding with clear errors.

Encoding is ``model_dump(mode="json", by_alias=True)`` through orjson: UTF-8 JSON, one object per
record, keys as in the contract. Decoding never raises anything but `DecodeError`, so an agent or a
consumer can send the bytes to the dead-letter topic and go on.
"""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import ValidationError

from schemas.base import Record
from schemas.errors import DecodeError
from schemas.models import ALL_MODELS

__all__ = ["encode", "decode", "decode_any", "to_dict", "MODELS_BY_SCHEMA"]

R = TypeVar("R", bound=Record)

MODELS_BY_SCHEMA: dict[str, type[Record]] = {m.SCHEMA: m for m in ALL_MODELS}


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


def decode(model: type[R], raw: bytes | None) -> R:
    """Decode bytes into `model`; raise `DecodeError` (never anything else) on bad input."""
    data = _load(raw)
    found = data.get("schema")
    if found != model.SCHEMA:
        raise DecodeError(f"schema is {found!r}, expected {model.SCHEMA!r}", raw, model.SCHEMA)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise DecodeError(_format_validation(exc), raw, model.SCHEMA) from None


def decode_any(raw: bytes | None) -> Record:
    """Decode bytes into whichever contract model its `schema` field names."""
    data = _load(raw)
    model = MODELS_BY_SCHEMA.get(data.get("schema"))  # type: ignore[arg-type]
    if model is None:
        raise DecodeError(f"unknown schema {data.get('schema')!r}", raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise DecodeError(_format_validation(exc), raw, model.SCHEMA) from None
