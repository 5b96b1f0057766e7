"""`schemas` must import with only pydantic/orjson/stdlib; package dependencies point one way."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(statement: str) -> set[str]:
    # top-level names, and xidstream's libraries as xidstream.<library>
    code = (f"import sys; {statement}; print(' '.join(sorted({{'.'.join(m.split('.')[:2]) if m.startswith('xidstream.') "
            f"else m.split('.')[0] for m in sys.modules}})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_schemas_imports_without_faust_nvml_kafka_or_yaml():
    loaded = _loaded_after("import xidstream.schemas.jsonschema; from xidstream import schemas; schemas.TopicRegistry().all()")
    assert "xidstream.schemas" in loaded
    assert not loaded & {"faust", "mode", "pynvml", "confluent_kafka", "aiokafka", "yaml", "xidstream.collectors",
                         "xidstream.streams"}


def test_schemas_works_when_faust_and_pynvml_cannot_be_imported():
    # Block the modules outright: a consumer's environment may not have them at all.
    code = (
        "import sys; sys.modules['faust'] = None; sys.modules['pynvml'] = None; "
        "sys.modules['confluent_kafka'] = None; "
        "from xidstream import schemas; print(schemas.decode_any(schemas.encode(schemas.GpuSample("
        "node='n', gpu_uuid='GPU-1', gpu_index=0, pci_bus_id='0000:01:00'))).gpu_uuid)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "GPU-1"


@pytest.mark.parametrize(
    "package, forbidden",
    [("collectors", {"faust", "streams"}), ("streams", {"pynvml", "collectors"})],
)
def test_dependency_direction(package, forbidden):
    import importlib.util
    from pathlib import Path

    from tests.test_layers import layer

    spec = importlib.util.find_spec(f"xidstream.{package}")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip(f"{package} not present")
    root = Path(list(spec.submodule_search_locations)[0])
    offenders = []
    for path in root.rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.strip().split()
            if len(words) >= 2 and words[0] in ("import", "from") and layer(words[1]) in forbidden:
                offenders.append(f"{path.relative_to(root.parent)}: {line.strip()}")
    assert not offenders


def test_public_surface_of_schemas():
    from xidstream import schemas

    assert sorted(schemas.__all__) == sorted(set(schemas.__all__))
    missing = [name for name in schemas.__all__ if not hasattr(schemas, name)]
    assert not missing
    # what consumers of the topics need, by name
    for name in ("decode_any", "encode", "TopicRegistry", "TOPICS", "Alert", "RemediationCommand", "DecodeError"):
        assert name in schemas.__all__
