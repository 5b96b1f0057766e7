"""How far the product's code reaches into faust's, aiokafka's and mode's internals: prints figures; not a test.

    .venv/bin/python bench/faust_surgery.py [--paths streams transport ...] [--list] [--json]

Counted by reading the source (AST), not by hand. An *upstream private attribute* is a name that
starts with one underscore (not a dunder) and belongs to an object of faust-streaming, aiokafka or
mode-streaming (faust's service framework), or to the stdlib class such an object inherits it from
(mode's queues are `asyncio.Queue`s: marked "via asyncio"). The product's own private names, on
its own classes or modules, are not counted. How each access is attributed:

- ``self._x`` / ``super()._x`` in a class of ours: upstream when one of the class's upstream bases
  (its runtime MRO: classes of the faust, aiokafka or mode packages) defines ``_x`` or uses
  ``self._x`` in its own source; otherwise ours.
- ``expr._x`` on anything else (and ``getattr``/``hasattr``/``setattr`` with the name as a string
  constant), in a module that imports faust, aiokafka or mode itself, or has a class that is (or
  is mixed into) a subclass of theirs (elsewhere the receiver is not theirs: such a module holds
  none of their objects but what it is handed, and none of ours is handed one): upstream when ``_x`` is a private name of some faust/aiokafka/
  mode (or asyncio) class and not one the same module defines; a name in both is printed as
  ambiguous, not counted (none at the time of writing). ``os._exit`` and the like (an imported
  stdlib module's name) are skipped.

Kinds: *read*; *write* (the attribute rebound, or an item of it assigned); *override* (a ``def _x``
in our subclass where an upstream base defines ``_x``); *patch* (an upstream method or function
replaced on an instance or module: ``obj._x = ...`` / ``setattr`` where ``_x`` is an upstream
function). A name is counted once however often and however it is touched; the listing gives each
place (file:line, kind, the upstream classes that define the name).

The default scope is the product's packages (what the wheel installs; tests and bench/ are
workshop). ``--paths tests`` counts what the tests reach into, separately.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import inspect
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("collectors", "executors", "exporters", "schemas", "streams", "transport", "xidstream")
UPSTREAM = ("faust", "aiokafka", "mode")
STDLIB_THROUGH = ("asyncio",)  # private names of stdlib classes faust/mode objects inherit


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


@dataclass
class Upstream:
    """Private names per upstream class (module.Class -> names), and which are functions."""

    names: dict = field(default_factory=lambda: defaultdict(set))  # qualname -> private names used or defined
    functions: dict = field(default_factory=lambda: defaultdict(set))  # qualname -> private def names
    owners: dict = field(default_factory=lambda: defaultdict(set))  # name -> qualnames

    def scan(self, package: str) -> None:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            module = package + "." + ".".join(path.relative_to(root).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except SyntaxError:
                continue
            self._walk(tree, module)

    def _walk(self, tree: ast.AST, module: str) -> None:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            qual = f"{module}.{node.name}"
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(item.name):
                    self._add(qual, item.name, function=True)
                targets = (item.targets if isinstance(item, ast.Assign) else
                           [item.target] if isinstance(item, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    if isinstance(t, ast.Name) and private(t.id):
                        self._add(qual, t.id)
                    if isinstance(t, ast.Name) and t.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                        for e in item.value.elts:
                            if isinstance(e, ast.Constant) and isinstance(e.value, str) and private(e.value):
                                self._add(qual, e.value)
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id in ("self", "cls") and private(sub.attr)):
                    self._add(qual, sub.attr)

    def _add(self, qual: str, name: str, function: bool = False) -> None:
        self.names[qual].add(name)
        self.owners[name].add(qual)
        if function:
            self.functions[qual].add(name)

    def in_mro(self, cls: type, name: str) -> list[str]:
        """The upstream classes in `cls`'s MRO that define or use `name`."""
        out = []
        for base in cls.__mro__:
            qual = f"{base.__module__}.{base.__qualname__}"
            if base.__module__.split(".")[0] in UPSTREAM + STDLIB_THROUGH and name in self.names.get(qual, ()):
                out.append(qual)
        return out

    def is_function(self, name: str) -> bool:
        return any(name in self.functions.get(q, ()) for q in self.owners.get(name, ()))


@dataclass
class Touch:
    name: str
    kind: str  # read, write, override, patch
    where: str  # file:line
    owners: list  # upstream classes defining the name
    via: str = ""  # "asyncio" when the name is the stdlib class's


def _upstream_bases(cls: type | None) -> bool:
    return cls is not None and any(b.__module__.split(".")[0] in UPSTREAM for b in cls.__mro__[1:])


def _effective(cls: type | None) -> type | None:
    """`cls`, or for a mixin of ours (no upstream base itself) the first subclass that has one:
    the mixin's ``self`` is that class's instance (streams/faust_mends' mends are mixins of
    faust_fast's consumer classes)."""
    if cls is None or _upstream_bases(cls):
        return cls
    todo = list(cls.__subclasses__())
    while todo:
        sub = todo.pop(0)
        if _upstream_bases(sub):
            return sub
        todo.extend(sub.__subclasses__())
    return cls


class Scan(ast.NodeVisitor):
    def __init__(self, path: Path, module: str, up: Upstream, ours: set, touches: list, ambiguous: list) -> None:
        self.path, self.module, self.up, self.ours = path, module, up, ours
        self.touches, self.ambiguous = touches, ambiguous
        self.classes: list = []  # stack of (ClassDef, runtime class or None)
        self.stdlib_modules: set = set()
        self.parents: dict = {}
        self.imports_upstream = False

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(ROOT)}:{node.lineno}"

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] not in UPSTREAM:
                self.stdlib_modules.add((alias.asname or alias.name).split(".")[0])


    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        runtime = None
        if not self.classes:  # module-level classes: their runtime MRO
            try:
                runtime = getattr(importlib.import_module(self.module), node.name, None)
            except Exception:  # noqa: BLE001 - a module that does not import: counted without MROs
                runtime = None
        self.classes.append((node, _effective(runtime) if inspect.isclass(runtime) else None))
        if _upstream_bases(self.classes[-1][1]):
            cls = self.classes[-1][1]
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(item.name):
                    owners = [q for q in self.up.in_mro(cls, item.name) if not q.startswith(self.module + ".")]
                    if owners:
                        self.touches.append(Touch(item.name, "override", self.where(item), owners))
        self.generic_visit(node)
        self.classes.pop()

    def _kind(self, node: ast.Attribute) -> str:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            return "write"
        parent = self.parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Store):
            return "write"
        return "read"

    def _self_like(self, value: ast.AST) -> bool:
        return ((isinstance(value, ast.Name) and value.id in ("self", "cls"))
                or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"))

    def touch(self, node: ast.AST, receiver: ast.AST, name: str, kind: str) -> None:
        cls = self.classes[-1][1] if self.classes else None
        if self._self_like(receiver):
            if not _upstream_bases(cls):
                return
            owners = self.up.in_mro(cls, name)
            if not owners:
                return  # our own attribute on our subclass
            if any(q.startswith(self.module + ".") for q in owners):
                return
        else:
            if not self.imports_upstream:
                return
            root = receiver
            while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
                root = root.func if isinstance(root, ast.Call) else root.value
            if isinstance(root, ast.Name) and root.id in self.stdlib_modules:
                return
            owners = sorted(self.up.owners.get(name, ()))
            if not owners:
                return
            if name in self.ours:
                self.ambiguous.append((name, self.where(node)))
                return
        via = "asyncio" if any(q.split(".")[0] in STDLIB_THROUGH for q in owners) else ""
        if kind == "write" and self.up.is_function(name) and not self._self_like(receiver):
            kind = "patch"
        self.touches.append(Touch(name, kind, self.where(node), owners, via))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if private(node.attr):
            self.touch(node, node.value, node.attr, self._kind(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if (isinstance(f, ast.Name) and f.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and private(node.args[1].value)):
            self.touch(node, node.args[0], node.args[1].value, "write" if f.id == "setattr" else "read")
        self.generic_visit(node)


def our_names(tree: ast.Module) -> set:
    """Private names a module of ours defines: defs and class-level names in its classes,
    ``self._x`` assigned in them, and its module-level private names."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(item.name):
                    names.add(item.name)
                if (isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
                        and isinstance(item.value, ast.Name) and item.value.id == "self" and private(item.attr)):
                    names.add(item.attr)
    for item in tree.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(item.name):
            names.add(item.name)
    return names


def scan(paths: list) -> tuple[list, list, Upstream]:
    up = Upstream()
    for package in UPSTREAM + STDLIB_THROUGH:
        up.scan(package)
    files = []
    for p in paths:
        base = ROOT / p
        for path in sorted([base] if base.is_file() else base.rglob("*.py")):
            files.append((path, ast.parse(path.read_text(encoding="utf-8"))))
    touches: list = []
    ambiguous: list = []
    sys.path.insert(0, str(ROOT))
    for path, _ in files:  # every module imported first: a mixin's subclasses are then known
        try:
            importlib.import_module(_module_name(path))
        except Exception:  # noqa: BLE001 - a module that does not import: counted without MROs
            pass
    for path, tree in files:
        module = _module_name(path)
        ours = our_names(tree)
        # a name our subclass overrides or assigns on an upstream object is still upstream's
        ours -= {n for n in ours if n in up.owners and _defined_only_in_upstream_subclasses(n, [(path, tree)], up)}
        s = Scan(path, module, up, ours, touches, ambiguous)
        s.imports_upstream = any(  # anywhere in the module, a function's own imports included
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] in UPSTREAM for a in n.names))
            or (isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] in UPSTREAM)
            for n in ast.walk(tree)) or _holds_upstream(module, tree)
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                s.parents[child] = parent
        s.visit(tree)
    return touches, ambiguous, up


def _module_name(path: Path) -> str:
    """The module a file of the checkout is imported as: the libraries' folders are
    `xidstream.<folder>` (xidstream/__init__.py), the command layer is `xidstream` itself."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in PRODUCT and parts[0] != "xidstream":
        parts = ("xidstream", *parts)
    return ".".join(parts).removesuffix(".__init__")


def _defined_only_in_upstream_subclasses(name: str, files: list, up: Upstream) -> bool:
    """Whether every definition of `name` in our code is in a subclass of an upstream class that
    has the name itself (an override, or an upstream attribute written): then it is upstream's."""
    found = False
    for path, tree in files:
        module = _module_name(path)
        for node in tree.body:
            defines = any((isinstance(i, (ast.FunctionDef, ast.AsyncFunctionDef)) and i.name == name)
                          or (isinstance(i, ast.Attribute) and isinstance(i.ctx, ast.Store)
                              and isinstance(i.value, ast.Name) and i.value.id == "self" and i.attr == name)
                          for i in ast.walk(node)) if isinstance(node, ast.ClassDef) else (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name)
            if not defines:
                continue
            found = True
            if not isinstance(node, ast.ClassDef):
                return False
            try:
                cls = getattr(importlib.import_module(module), node.name)
            except Exception:  # noqa: BLE001
                return False
            cls = _effective(cls)
            if not _upstream_bases(cls) or not up.in_mro(cls, name):
                return False
    return found


def _holds_upstream(module: str, tree: ast.Module) -> bool:
    """Whether a class of `module` is (or is mixed into) a subclass of an upstream class: its
    ``self.app``, ``self.consumer`` ... are then upstream objects, imports or not."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001
        return False
    return any(_upstream_bases(_effective(getattr(mod, n.name, None)))
               for n in tree.body if isinstance(n, ast.ClassDef) and inspect.isclass(getattr(mod, n.name, None)))


def summary(touches: list) -> dict:
    by_name: dict = defaultdict(list)
    for t in touches:
        by_name[t.name].append(t)
    overridden = sorted(n for n, ts in by_name.items() if any(t.kind == "override" for t in ts))
    patched = sorted(n for n, ts in by_name.items() if any(t.kind == "patch" for t in ts))
    return {
        "private_attributes": len(by_name),
        "of_which_via_asyncio": sorted(n for n, ts in by_name.items() if all(t.via == "asyncio" for t in ts)),
        "private_methods_overridden": overridden,
        "functions_patched": patched,
        "by_file": {f: len({t.name for t in touches if t.where.split(":")[0] == f})
                    for f in sorted({t.where.split(":")[0] for t in touches})},
        "names": {n: {"kinds": sorted({t.kind for t in ts}),
                      "where": [f"{t.where} {t.kind}" for t in ts],
                      "owners": sorted({q for t in ts for q in t.owners})}
                  for n, ts in sorted(by_name.items())},
    }


def mirrored() -> int:
    try:
        from xidstream.streams import faust_fast
    except Exception:  # noqa: BLE001
        return -1
    return len(getattr(faust_fast, "MIRRORED", {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="+", default=list(PRODUCT), help="files or folders, relative to the repository")
    ap.add_argument("--list", action="store_true", help="each name with every place it is touched")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    touches, ambiguous, _ = scan(args.paths)
    s = summary(touches)
    s["digest_pins"] = mirrored()
    s["ambiguous"] = ambiguous
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print(f"scope: {' '.join(args.paths)}")
    print(f"distinct upstream private attributes touched: {s['private_attributes']} "
          f"({len(s['of_which_via_asyncio'])} of them asyncio.Queue's, through mode's queues: "
          f"{', '.join(s['of_which_via_asyncio']) or '-'})")
    print(f"private methods overridden: {len(s['private_methods_overridden'])}: "
          f"{', '.join(s['private_methods_overridden']) or '-'}")
    print(f"upstream functions patched: {len(s['functions_patched'])}: {', '.join(s['functions_patched']) or '-'}")
    print(f"functions digest-pinned (streams.faust_fast.MIRRORED): {s['digest_pins']}")
    print("per file (distinct names): " + ", ".join(f"{f} {n}" for f, n in s["by_file"].items()))
    if ambiguous:
        print("ambiguous (ours and upstream's name; not counted): " + ", ".join(f"{n} {w}" for n, w in ambiguous))
    width = max((len(n) for n in s["names"]), default=0)
    for name, info in s["names"].items():
        owners = info["owners"]
        shown = ", ".join(owners[:3]) + (f" +{len(owners) - 3}" if len(owners) > 3 else "")
        print(f"  {name:<{width}}  {'/'.join(info['kinds']):<14} {len(info['where']):>3}x  [{shown}]")
        if args.list:
            for w in info["where"]:
                print(f"      {w}")


if __name__ == "__main__":
    main()
