"""xidstream: finds sick GPUs across a Kubernetes fleet, over Kafka.

One namespace for the whole product (issue 44): `xidstream.schemas` (the topics' contract),
`xidstream.transport` (Kafka and Kubernetes plumbing), `xidstream.collectors`, `xidstream.streams`,
`xidstream.executors`, `xidstream.exporters`, and the command layer in this folder (`xidstream.cli`).

The libraries keep their folders at the top of the checkout (`schemas/`, `streams/`, ...); the
wheel maps each into this package (pyproject.toml's `package-dir`), so an installed xidstream puts
only `xidstream` into site-packages. In a checkout, which has no such mapping, the same names
resolve through a finder that maps exactly `xidstream.<library>` to the checkout's
`<library>/` folder (`_LIBRARIES`; nothing else of the checkout, not `tests/` nor `workshop/`,
becomes part of the package). An installed wheel has them inside this folder and adds nothing.
"""

from __future__ import annotations

import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"

_LIBRARIES = ("schemas", "transport", "collectors", "streams", "executors", "exporters")


class _CheckoutLibraries(_abc.MetaPathFinder):
    """`xidstream.<library>` -> `<root>/<library>/`; its submodules then load from that folder."""

    def __init__(self, root: _Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (the finder protocol)
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in _LIBRARIES:
            return None
        folder = self.root / name
        return _util.spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def _from_checkout() -> None:
    here = _Path(__file__).resolve().parent
    if (here / "schemas").is_dir():  # an installed wheel: the libraries are inside
        return
    root = here.parent
    if all((root / name / "__init__.py").is_file() for name in _LIBRARIES) and not any(
            isinstance(f, _CheckoutLibraries) for f in _sys.meta_path):
        # First, not last: another checkout's editable install (setuptools appends its finder to
        # sys.meta_path at startup, e.g. a shared venv's `pip install -e`) also answers
        # `xidstream.<library>`, with its own folders; this package came from this checkout, so
        # its libraries must too.
        _sys.meta_path.insert(0, _CheckoutLibraries(root))


_from_checkout()
