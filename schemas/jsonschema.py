"""Generate the JSON Schema files that consumers (SIEM, data lakes, automation) validate against.

`python -m xidstream.schemas.jsonschema` (or `xidstream schemas generate`) writes one file per model into
`schemas/json/`; `--check` exits non-zero when a committed file is stale. A test runs the check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from xidstream.schemas.models import ALL_MODELS
from xidstream.schemas.scenario import Scenario

__all__ = ["SCHEMA_DIR", "render_all", "write_all", "stale_files"]

SCHEMA_DIR = Path(__file__).parent / "json"


def _filename(schema_name: str) -> str:
    # "xidstream.gpu_sample/1" -> "xidstream.gpu_sample.v1.json"
    kind, version = schema_name.split("/")
    return f"{kind}.v{version}.json"


def render_all() -> dict[str, bytes]:
    """File name -> content, for every topic model and the scenario format."""
    out: dict[str, bytes] = {}
    for model in ALL_MODELS:
        doc = model.model_json_schema(by_alias=True, mode="serialization")
        doc = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": model.SCHEMA, **doc}
        out[_filename(model.SCHEMA)] = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    doc = Scenario.model_json_schema(by_alias=True, mode="validation")
    doc = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "xidstream.scenario/1", **doc}
    out["xidstream.scenario.v1.json"] = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    return out


def stale_files(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of files that are missing, differ, or should not be there."""
    wanted = render_all()
    stale = [name for name, body in wanted.items()
             if not (directory / name).is_file() or (directory / name).read_bytes() != body]
    if directory.is_dir():
        stale += sorted(p.name for p in directory.glob("*.json") if p.name not in wanted)
    return stale


def write_all(directory: Path = SCHEMA_DIR) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    wanted = render_all()
    for name, body in wanted.items():
        (directory / name).write_bytes(body)
    for extra in directory.glob("*.json"):
        if extra.name not in wanted:
            extra.unlink()
    return sorted(wanted)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        stale = stale_files()
        if stale:
            print("stale JSON Schema files (run `xidstream schemas generate`): " + ", ".join(stale),
                  file=sys.stderr)
            return 1
        print(f"JSON Schemas in {SCHEMA_DIR} are up to date")
        return 0
    for name in write_all():
        print(SCHEMA_DIR / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
