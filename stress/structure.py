#!/usr/bin/env python3
"""Structure figures of the ``shmq`` package: private reaches, import cycles, file sizes.

    python stress/structure.py                 # the three figures and the targets
    python stress/structure.py --verbose       # every reach and every cycle, with file:line
    python stress/structure.py --json out.json

Static (``ast``), no imports of shmq.  What is counted, precisely:

**Cross-file private reaches.**  A *private name* starts with one underscore
and is not a dunder (``_x``, not ``__x__``).  A *private module* (``_format``,
``_lock``, ...) is a layer, not a private name: importing it or importing
public names from it is not a reach.  Within ``shmq/``, one reach is counted
for each occurrence of

1. ``from M import _name`` (any level of relative import) where ``M`` is a
   shmq module other than the importing file and ``_name`` is not itself a
   module (a private function, class or constant imported across files);
2. ``X._name`` where ``X`` is a name (or dotted name) bound in the file by
   an import of a shmq module (``F._helper`` with ``from . import _format as
   F``);
3. ``expr._name`` for any other ``expr`` except the names ``self`` and
   ``cls``, when ``_name`` is *not defined in the same file*.  "Defined in
   the file" means: the name of a function, method or class of the file, a
   target of an assignment anywhere in the file (``_name = ...``,
   ``self._name = ...``, ``cls._name = ...``, also augmented and annotated
   assignments; ``other._name = ...`` is itself a reach, not a definition), a
   string in a ``__slots__`` of the file, or a parameter name.  This catches
   e.g. ``sp._map`` in workqueue.py if ``_map`` is assigned only in
   spool.py, and ``msg._slot`` in a file that does not define Message,
   without type inference.  Excluded: ``X._name`` where ``X`` is bound by an import of a
   non-shmq module (``os._exit``, ``sys._getframe``: the stdlib's own
   business), and the namedtuple API ``_replace``, ``_asdict``, ``_fields``,
   ``_make``.

``getattr(obj, "_x")``, ``setattr`` and ``hasattr`` with a constant
private name count like ``obj._x``.

Known blind spots (so the count is a floor, not a proof): ``self._x`` is
never counted, so a mixin spread over files, or a subclass in another file
using its base's private attributes, hides its reaches; a private name
defined in *both* files is not counted in either (rule 3: ``r._count_lost``
in a file with a method of that name too); a name computed at
run time (``getattr(obj, name)``) is not seen.

**Import cycles.**  A directed edge A -> B for every import statement in A
that names shmq module B, *including imports inside functions* (a lazy
import still makes A depend on B).  ``from P import n`` gives an edge to
``P.n`` when that is a module, else to ``P`` (``from . import _format``
depends on ``_format``, not on the package's ``__init__``).  The implicit import of a
parent package's ``__init__`` is not an edge (every package would cycle
with its own ``__init__``), nor is an import under ``if TYPE_CHECKING:`` (never
executed: a lower layer naming an upper layer's class in an annotation).  A cycle is a strongly connected component of
more than one module (or a module importing itself); the figure is the
number of such components.

**Largest file.**  Physical lines (``wc -l``) of the longest ``.py`` file.

**Largest C file.**  Physical lines of the longest ``.c`` or ``.h`` file
under the package (the compiled core, ``shmq/core/``).  A C extension is a
module for the import graph under its import name (``shmq._core``, from
``pyproject.toml``'s ``[[tool.setuptools.ext-modules]]``), with no imports
of its own; its source files are not modules.

Targets (a package a newcomer can read; one core, one writer):
reaches <= 20, cycles 0, largest file <= 700 lines, largest C file <= 900
lines.  ``--check`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tomllib

TARGETS = {"reaches": 20, "cycles": 0, "largest_lines": 700, "largest_c_lines": 900}
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shmq")


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def discover(root):
    """``{module name: path}`` of every .py file under ``root`` (package ``shmq``).

    A C extension named in ``pyproject.toml`` next to ``root`` (``shmq._core``)
    is a module too, with no imports of its own (its path: its first source):
    ``from . import _core`` is an edge to it, not to the package.  C and
    header files are not modules (see :func:`c_files`).
    """
    root = os.path.normpath(root)
    base = os.path.basename(root)
    mods = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), os.path.dirname(root))[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = os.path.join(d, f)
    assert base in mods, f"{root} is not a package"
    for name, sources in extensions(root).items():
        mods[name] = os.path.join(os.path.dirname(root), sources[0])
    return mods


def extensions(root):
    """``{import name: [source, ...]}`` of the C extensions ``pyproject.toml``
    (beside the package directory ``root``) builds; {} without one."""
    project = os.path.join(os.path.dirname(os.path.normpath(root)), "pyproject.toml")
    if not os.path.exists(project):
        return {}
    with open(project, "rb") as f:
        cfg = tomllib.load(f)
    exts = cfg.get("tool", {}).get("setuptools", {}).get("ext-modules", [])
    return {e["name"]: list(e["sources"]) for e in exts}


def c_files(root):
    """``{path relative to root's parent: lines}`` of every .c and .h file under ``root``."""
    root = os.path.normpath(root)
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith((".c", ".h")):
                path = os.path.join(d, f)
                src = open(path, encoding="utf-8").read()
                out[os.path.relpath(path, os.path.dirname(root))] = (
                    src.count("\n") + (0 if src.endswith("\n") or not src else 1))
    return out


def _package_of(mod, path):
    return mod if path.endswith("__init__.py") else mod.rpartition(".")[0]


def _resolve(mod, path, node):
    """The absolute module name an ImportFrom refers to (None: not relative and not shmq)."""
    if node.level:
        pkg = _package_of(mod, path)
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        return f"{pkg}.{node.module}" if node.module else pkg
    return node.module


class _FileFacts(ast.NodeVisitor):
    def __init__(self):
        self.defined = set()

    def visit_FunctionDef(self, node):
        self.defined.add(node.name)
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
            if arg is not None:
                self.defined.add(arg.arg)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.defined.add(node.name)
        self.generic_visit(node)

    def _target(self, t):
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                self.defined.add(n.id)
            elif isinstance(n, ast.Attribute) and _dotted(n.value) in ("self", "cls"):
                self.defined.add(n.attr)

    def visit_Assign(self, node):
        for t in node.targets:
            self._target(t)
        if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            for n in ast.walk(node.value):
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    self.defined.add(n.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._target(node.target)
        self.generic_visit(node)


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _type_checking(test):
    """True for the test of ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def analyse(root=ROOT):
    """Return ``{"reaches": [...], "cycles": [[mod, ...], ...], "edges": {...},
    "lines": {path: n}}`` for the package at ``root``."""
    mods = discover(root)
    top = os.path.basename(os.path.normpath(root))
    reaches, edges, lines = [], {m: set() for m in mods}, {}
    for mod, path in mods.items():
        if path.endswith(".c"):
            continue  # a compiled leaf: no Python imports, not a Python module's size
        src = open(path, encoding="utf-8").read()
        rel = os.path.relpath(path, os.path.dirname(os.path.normpath(root)))
        lines[rel] = src.count("\n") + (0 if src.endswith("\n") or not src else 1)
        tree = ast.parse(src, path)
        facts = _FileFacts()
        facts.visit(tree)
        shmq_alias, other_alias = {}, set()
        typing_only = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and _type_checking(t.test)
                       for s in t.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == top or a.name.startswith(top + "."):
                        if a.name in mods and a.name != mod:
                            edges[mod].add(a.name)
                        shmq_alias[a.asname or a.name] = a.name
                    else:
                        other_alias.add((a.asname or a.name).split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path, node)
                if target is None or not (target == top or target.startswith(top + ".")):
                    for a in node.names:
                        other_alias.add(a.asname or a.name)
                    continue
                if target in mods and target != mod and any(
                        f"{target}.{a.name}" not in mods for a in node.names):
                    edges[mod].add(target)  # a name defined in P (P's own code runs for it)
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:
                        if sub != mod:
                            edges[mod].add(sub)
                        shmq_alias[a.asname or a.name] = sub
                    elif _private(a.name) and target != mod:
                        reaches.append({"file": rel, "line": node.lineno, "kind": "import",
                                        "what": f"from {target} import {a.name}"})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
                # getattr(obj, "_x"): the same reach spelled as a call
                node = ast.Attribute(value=node.args[0], attr=node.args[1].value,
                                     lineno=node.lineno)
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            base = _dotted(node.value)
            if base in ("self", "cls"):
                continue
            if base is not None and base in shmq_alias:
                reaches.append({"file": rel, "line": node.lineno, "kind": "module",
                                "what": f"{shmq_alias[base]}.{node.attr}"})
                continue
            if base is not None and base.split(".")[0] in other_alias and base not in facts.defined:
                continue  # os._exit, sys._getframe: not ours
            if node.attr in NAMEDTUPLE_API or node.attr in facts.defined:
                continue
            reaches.append({"file": rel, "line": node.lineno, "kind": "attribute",
                            "what": f"{ast.unparse(node.value)}.{node.attr}"})
    return {"reaches": reaches, "cycles": cycles(edges),
            "edges": {m: sorted(v) for m, v in edges.items()}, "lines": lines,
            "c_lines": c_files(root)}


def cycles(edges):
    """Strongly connected components of more than one module (or with a self-edge), Tarjan."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out)


def figures(result):
    """The figures: reach count, cycle count, the largest .py file and the
    largest C file (.c or .h; 0 lines and None without one), with their lines."""
    path, n = max(result["lines"].items(), key=lambda kv: (kv[1], kv[0]))
    cpath, cn = max(result.get("c_lines", {}).items(), key=lambda kv: (kv[1], kv[0]), default=(None, 0))
    return {"reaches": len(result["reaches"]), "cycles": len(result["cycles"]),
            "largest_lines": n, "largest_file": path, "largest_c_lines": cn, "largest_c_file": cpath}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=ROOT, help="the package directory (default: shmq/)")
    ap.add_argument("--verbose", "-v", action="store_true", help="list every reach and cycle")
    ap.add_argument("--json", help="write figures and details to this file")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    a = ap.parse_args(argv)
    res = analyse(a.root)
    fig = figures(res)
    by_file = {}
    for r in res["reaches"]:
        by_file[r["file"]] = by_file.get(r["file"], 0) + 1
    if a.verbose:
        for r in res["reaches"]:
            print(f"  reach {r['file']}:{r['line']}: {r['what']} ({r['kind']})")
        for c in res["cycles"]:
            print(f"  cycle: {' <-> '.join(c)}")
    print("cross-file private reaches by file: "
          + (", ".join(f"{f} {n}" for f, n in sorted(by_file.items(), key=lambda kv: -kv[1]))
             or "none"))
    for c in res["cycles"]:
        print(f"import cycle: {', '.join(c)}")
    print(f"cross-file private reaches: {fig['reaches']} (target <= {TARGETS['reaches']})")
    print(f"import cycles: {fig['cycles']} (target {TARGETS['cycles']})")
    print(f"largest file: {fig['largest_file']} {fig['largest_lines']} lines "
          f"(target <= {TARGETS['largest_lines']})")
    print(f"largest C file: {fig['largest_c_file']} {fig['largest_c_lines']} lines "
          f"(target <= {TARGETS['largest_c_lines']}); C files: "
          + ", ".join(f"{f} {n}" for f, n in sorted(res["c_lines"].items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"figures": fig, "targets": TARGETS, **res}, f, indent=2)
    missed = [k for k in TARGETS if fig[k] > TARGETS[k]]
    if a.check and missed:
        print(f"missed: {', '.join(missed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
