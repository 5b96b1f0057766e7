"""A schema change is a version change: `schemas/versions.lock` lists, per contract version
(`xidstream.xid/3`), its fields' names and types and a fingerprint of them. A model whose fields
differ from its version's entry fails here: a consumer (a lake reader, a SIEM parser, an older
processor) that knows `xidstream.xid/3` would otherwise get a different record under the same name.

After bumping a version, add its entry (entries already there are never rewritten):

    .venv/bin/python -m tests.schemas.test_schema_versions --update

Types are compared, not descriptions, caps or enum members: an enum is its value type, a nested
model its own fields, `X | None` a union with null; a field with a default is marked `?`.
"""

from __future__ import annotations

import enum
import hashlib
import sys
import types
import typing
from datetime import date, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import BaseModel

from xidstream.schemas.models import ALL_MODELS, GpuSample

LOCK = Path(__file__).resolve().parents[2] / "schemas" / "versions.lock"
BUMP = ("bump its version (SCHEMA, the `schema` Literal, LEGACY), run `xidstream schemas generate`, then "
        "`.venv/bin/python -m tests.schemas.test_schema_versions --update`")

_SCALARS = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bytes", datetime: "datetime",
            date: "date", type(None): "null"}


def type_name(annotation: Any) -> str:  # noqa: C901
    """The wire type of a field annotation, as text."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return "|".join(sorted({type_name(a) for a in args}))
    if origin is typing.Literal:
        return "|".join(sorted({type_name(type(a)) for a in args}))
    if origin in (list, tuple, set, frozenset):
        return f"list[{'|'.join(sorted({type_name(a) for a in args if a is not Ellipsis}))}]"
    if origin is dict:
        return f"dict[{type_name(args[0])},{type_name(args[1])}]"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return "str" if issubclass(annotation, str) else "int"
        if issubclass(annotation, BaseModel):
            return "{" + ",".join(f"{k}:{v}" for k, v in sorted(fields_of(annotation).items())) + "}"
        for base, name in _SCALARS.items():
            if issubclass(annotation, base) and not (base is int and issubclass(annotation, bool)):
                return name
    raise TypeError(f"no wire type for {annotation!r}: teach type_name")


def fields_of(model: type[BaseModel]) -> dict[str, str]:
    """Wire name (alias) -> type of every field; `?` after a name: it has a default."""
    return {(f.alias or n) + ("" if f.is_required() else "?"): type_name(f.annotation)
            for n, f in model.model_fields.items()}


def fingerprint(fields: dict[str, str]) -> str:
    return "sha256:" + hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def entry(model: type[BaseModel]) -> dict[str, Any]:
    fields = fields_of(model)
    return {"fingerprint": fingerprint(fields), "fields": fields}


def read_lock(path: Path = LOCK) -> dict[str, dict[str, Any]]:
    return orjson.loads(path.read_bytes())


def problems(models, lock: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong between the models and the lock: a version missing from it, or fields that
    differ from its version's entry."""
    out = []
    for model in models:
        locked = lock.get(model.SCHEMA)
        if locked is None:
            out.append(f"{model.SCHEMA} ({model.__name__}) is not in {LOCK.name}: a new version; run "
                       "`.venv/bin/python -m tests.schemas.test_schema_versions --update` and commit the lock")
            continue
        now = entry(model)
        if now["fingerprint"] == locked["fingerprint"]:
            continue
        was = locked.get("fields", {})
        added = sorted(set(now["fields"]) - set(was))
        removed = sorted(set(was) - set(now["fields"]))
        changed = sorted(f"{k}: {was[k]} -> {v}" for k, v in now["fields"].items() if k in was and was[k] != v)
        out.append(f"{model.__name__}'s fields changed but its SCHEMA is still {model.SCHEMA!r} "
                   f"(added {added}, removed {removed}, changed {changed}): {BUMP}")
    return out


def updated(models, lock: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The lock with an entry for every model's version; an entry already there is kept as it is
    (a released version's fields do not change: a mismatch is an error, not an update)."""
    out = dict(lock)
    for model in models:
        out.setdefault(model.SCHEMA, entry(model))
    return out


def _render(lock: dict[str, dict[str, Any]]) -> bytes:
    return orjson.dumps(lock, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def test_every_contract_version_has_the_fields_it_was_locked_with():
    assert LOCK.is_file(), f"{LOCK} is missing: run `.venv/bin/python -m tests.schemas.test_schema_versions --update`"
    found = problems(ALL_MODELS, read_lock())
    assert not found, "\n".join(found)


def test_the_lock_file_is_as_the_update_writes_it():
    lock = read_lock()
    assert LOCK.read_bytes() == _render(lock), f"{LOCK.name} was edited by hand: rewrite it with --update"
    for version, item in lock.items():
        assert item["fingerprint"] == fingerprint(item["fields"]), f"{version}: fingerprint does not match its fields"


def _variant(**fields) -> type[BaseModel]:
    """GpuSample with fields added or retyped, and the same SCHEMA: what an unversioned edit makes."""
    from pydantic import create_model
    return create_model("GpuSample", __base__=GpuSample, **fields)


@pytest.mark.parametrize("change", [
    {"fan_speed_pct": (float | None, None)},  # a new field
    {"temperature_c": (float | None, None)},  # a retyped field
    {"power_w": (float, ...)},  # optional -> required
])
def test_a_field_change_without_a_version_bump_is_caught(change):
    lock = {GpuSample.SCHEMA: entry(GpuSample)}
    assert problems([GpuSample], lock) == []
    found = problems([_variant(**change)], lock)
    assert len(found) == 1 and GpuSample.SCHEMA in found[0] and "bump its version" in found[0], found
    assert next(iter(change)) in found[0]


def test_a_bumped_version_is_added_and_a_locked_one_is_never_rewritten():
    old = {GpuSample.SCHEMA: entry(GpuSample)}
    bumped = _variant(fan_speed_pct=(float | None, None))
    bumped.SCHEMA = "xidstream.gpu_sample/99"
    assert "not in versions.lock" in problems([bumped], old)[0]
    new = updated([bumped], old)
    assert new[GpuSample.SCHEMA] == old[GpuSample.SCHEMA] and "fan_speed_pct?" in new[bumped.SCHEMA]["fields"]
    assert problems([bumped, GpuSample], new) == []
    # an unbumped edit is not papered over by an update
    assert problems([_variant(fan_speed_pct=(float | None, None))], updated([GpuSample], old))


def main(argv: list[str]) -> int:
    if argv != ["--update"]:
        print(__doc__, file=sys.stderr)
        return 2
    lock = read_lock() if LOCK.is_file() else {}
    new = updated(ALL_MODELS, lock)
    LOCK.write_bytes(_render(new))
    for version in sorted(set(new) - set(lock)):
        print(f"{LOCK}: added {version}")
    found = problems(ALL_MODELS, new)
    for p in found:
        print(p, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
