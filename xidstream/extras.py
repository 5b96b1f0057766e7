"""Which pip extra each command needs, and the one line a command says when it is missing.

The base install (pyproject.toml's `dependencies`) runs the commands that only read and write the
contract's topics; each role's image adds its extra (Containerfile: one stage per role). A command
run where its extra is not installed stops before it starts anything, with
"xidstream process needs the processor extra (no module named 'faust'): pip install 'xidstream[processor]'",
not a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util
from typing import Iterable

from xidstream.schemas.errors import XidstreamError

# The top-level modules each extra brings (pyproject.toml's optional-dependencies), the ones its
# commands import; tests/xidstream_cli/test_extras.py checks both agree with pyproject.toml.
MODULES: dict[str, tuple[str, ...]] = {
    "collector": ("pynvml", "prometheus_client", "grpc", "lightkube"),
    "processor": ("faust", "aiokafka"),
    "executors": ("lightkube", "pynvml", "prometheus_client"),
    "exporter": ("pyarrow",),
    "report": ("matplotlib",),
    "rocksdb": ("rocksdict",),
}

# Each role's image (the Containerfile's stage of that name) -> the extras it installs;
# tests/deploy/test_containerfile.py checks the stages install exactly these.
ROLES: dict[str, tuple[str, ...]] = {
    "node": ("collector", "executors"),  # the DaemonSet every GPU node pulls: collector, node executor
    "processor": ("processor", "rocksdb"),  # the processor, the topics Job
    "cluster-executor": ("executors",),  # the cluster executor and its pod view
    "exporter": ("exporter",),
}

# Command -> the extras it needs; a command not named here needs only the base.
COMMANDS: dict[str, tuple[str, ...]] = {
    "collect": ("collector",),
    "parse": ("collector",),
    "gpu-check": ("collector",),
    "simulate": ("collector",),
    "evaluate": ("collector",),
    "process": ("processor",),
    "replay": ("processor", "collector"),
    "execute": ("executors",),
    "identity": ("executors",),
    "export": ("exporter",),
}


class MissingExtra(XidstreamError):
    """A command runs where the extra it needs is not installed."""

    def __init__(self, command: str, extra: str, module: str) -> None:
        super().__init__(f"xidstream {command} needs the {extra} extra (no module named '{module}'): "
                         f"pip install 'xidstream[{extra}]'")
        self.extra = extra
        self.module = module


def runs_in(role: str, commands: Iterable[str]) -> list[str]:
    """Of `commands` (xidstream.cli.command_names()), those a role's image can run: the ones whose
    extras it installs, and the base's."""
    return sorted(c for c in commands if set(COMMANDS.get(c, ())) <= set(ROLES[role]))


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None  # None too for a module blocked in sys.modules
    except ValueError:  # a module imported without a spec
        return False


def require(command: str, *extras: str) -> None:
    """Raise MissingExtra naming the first of `extras` (default: the command's) that is not installed."""
    for extra in extras or COMMANDS.get(command, ()):
        for module in MODULES[extra]:
            if _absent(module):
                raise MissingExtra(command, extra, module)


def explain(command: str, exc: ModuleNotFoundError) -> MissingExtra | None:
    """The extra behind an import that failed while `command` ran (an option's module, like
    `incident --html`'s matplotlib), or None when the module is no extra's."""
    top = (exc.name or "").partition(".")[0]
    own = COMMANDS.get(command, ())
    for extra in (*own, *(e for e in MODULES if e not in own)):
        if top in MODULES[extra]:
            return MissingExtra(command, extra, top)
    return None
