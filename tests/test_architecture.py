"""Architecture rules over the production packages, checked from source with `ast`.

Nothing here imports the code under test: every .py file is parsed, and the import
graph is built from what the files say. Rules:

* the module import graph of atomd/, scheduler/, kv_transfer/, router/, launch/ has
  no cycle;
* scheduler/, kv_transfer/, router/ and atomd/api/ (the HTTP process) never import torch, directly or through any
  production module they import (lazily or not);
* router/ never imports atomd or scheduler, directly or transitively;
* atomd/engine/, atomd/kernels/ and atomd/model/ never import atomd/api/;
* contracts/ imports no other package of the tree, and atomd/ never imports launch/;
* nothing outside tests/ (the packages, benchmarks/, scripts/) imports tests.

What counts as an import (all of them, wherever they sit: module level, inside
functions, under `try`, under `if TYPE_CHECKING` -- the check is deliberately
conservative):

* `import a.b.c`                    -> edge to a.b.c
* `from a.b import c`               -> edge to a.b.c when that is a module, else to a.b
  (relative imports are resolved against the importing module's package first);
* `importlib.import_module("a.b")`, `import_module("a.b")`, `__import__("a.b")` with a
  string literal first argument     -> edge to a.b;
* in a file that uses importlib at all (`import importlib` / `from importlib import ...`),
  every string constant of the form "pkg.module" or "pkg.module:attr" whose module
  part is a scanned module, or lies under tests/, is taken as an import of that module.
  This covers registries and command tables such as
  kv_transfer/connector.py's {"zmq": "kv_transfer.zmq_connector:create_zmq_connector"}
  and atomd/cli.py's COMMANDS = {"serve": ("atomd.api.serve", ...)}.
  Not covered: names built at run time (f-strings, concatenation), plugin entry
  points, and string constants naming third-party modules (a literal passed
  straight to import_module *is* covered, third-party or not).

Package `__init__` semantics, and why a package importing its own child is not a cycle:

* Resolving `from pkg import sibling` to pkg.sibling (not to pkg) means a child that
  only fetches a sibling through its package does not depend on the package's
  `__init__`, so `atomd/__init__.py`'s lazy `__getattr__` importing atomd.engine.llm_engine
  plus atomd.engine.llm_engine doing `from atomd import protocol` is *not* reported as a cycle.
* Imports inside a package's module-level `def __getattr__` (PEP 562 lazy attributes)
  belong to a pseudo-node "pkg.__getattr__". Only code that really touches the
  package namespace -- `import pkg`, `from pkg import NotASubmodule`, `from pkg import *`
  -- gets an edge to it; `from atomd import LLM` therefore does reach torch, while
  `from atomd import __version__` (bound in the package's own body, so __getattr__ never
  runs) does not.
* Python runs every parent package's `__init__` before a submodule
  (importing scheduler.sequence executes scheduler/__init__.py, which eagerly imports
  scheduler.scheduler ...). For the reachability rules (torch, router) each module gets
  an implicit edge to its parent package, which follows the parent's eager imports
  but not its `__getattr__` pseudo-node (those run only when the attribute is used).
  The cycle check leaves these implicit edges out: a package `__init__` that
  re-exports its children is the normal Python pattern, not a cycle.
"""
from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION_PACKAGES = ("atomd", "contracts", "scheduler", "kv_transfer", "router", "launch")
OTHER_SCANNED_DIRS = ("benchmarks", "scripts")  # only for the "nothing imports tests" rule
TORCH_FREE_PACKAGES = ("contracts", "scheduler", "kv_transfer", "router", "atomd.api")  # atomd.api: the HTTP process
# The API process starts the engine core process with atomd.engine.core.run_engine_core as its
# multiprocessing target: torch is imported inside it, in the child. The edge is the process seam;
# test_api_process_never_imports_torch checks at run time that crossing it loads no torch here.
PROCESS_SEAMS = frozenset({("atomd.api.core_client", "atomd.engine.core")})
ROUTER_FORBIDDEN = ("atomd", "scheduler")
TESTS_PACKAGE = "tests"
GETATTR = "__getattr__"

_DOTTED_STRING = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_]\w*)?$")
_IMPORT_FUNCS = {"import_module", "__import__"}


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class Ref:
    """One import as written, with the package-relative part already resolved."""

    module: str  # absolute dotted module name
    names: tuple[str, ...]  # `from module import names`; () for `import module`
    lineno: int
    kind: str  # import | from | call | string
    in_getattr: bool  # inside a package __init__'s module-level __getattr__


@dataclass
class ModuleInfo:
    name: str
    path: Path
    is_package: bool
    refs: list[Ref] = field(default_factory=list)
    defines: set[str] = field(default_factory=set)  # names bound at module level: no __getattr__ call


def module_name(rel: Path) -> tuple[str, bool]:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _resolve_relative(mod: ModuleInfo, level: int, target: str | None) -> str:
    package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    if level - 1 > len(package):
        raise ValueError(f"{mod.path}: relative import beyond top-level package")
    base = package[: len(package) - (level - 1)]
    if target:
        base.append(target)
    return ".".join(base)


class _Collector(ast.NodeVisitor):
    def __init__(self, mod: ModuleInfo, tree: ast.Module):
        self.mod = mod
        self.depth = 0  # function nesting
        self.in_getattr = False
        self.uses_importlib = any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "importlib" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "importlib")
            for n in ast.walk(tree))

    def _add(self, module: str, names: tuple[str, ...], lineno: int, kind: str) -> None:
        self.mod.refs.append(Ref(module, names, lineno, kind, self.in_getattr))

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer = self.in_getattr
        if self.depth == 0 and node.name == GETATTR and self.mod.is_package:
            self.in_getattr = True
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        self.in_getattr = outer

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, (), node.lineno, "import")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve_relative(self.mod, node.level, node.module) if node.level else node.module
        self._add(base, tuple(a.name for a in node.names), node.lineno, "from")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if fname in _IMPORT_FUNCS and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            target = node.args[0].value
            if target.startswith("."):  # import_module(".x", package="pkg")
                pkg = next((k.value.value for k in node.keywords if k.arg == "package"
                            and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)), None)
                if pkg is not None:
                    level = len(target) - len(target.lstrip("."))
                    parts = pkg.split(".")
                    target = ".".join(parts[: len(parts) - (level - 1)] + [target.lstrip(".")]).rstrip(".")
            if not target.startswith("."):
                self._add(target, (), node.lineno, "call")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if self.uses_importlib and isinstance(node.value, str):
            m = _DOTTED_STRING.match(node.value)
            if m:
                self._add(m.group(1), (), node.lineno, "string")


def scan(root: Path, dirs: tuple[str, ...]) -> dict[str, ModuleInfo]:
    modules: dict[str, ModuleInfo] = {}
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root)
            if any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            name, is_package = module_name(rel)
            modules[name] = ModuleInfo(name, path, is_package)
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(encoding="utf-8"), filename=str(mod.path))
        _Collector(mod, tree).visit(tree)
        mod.defines = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                       for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    return modules


# --------------------------------------------------------------------------- graph


@dataclass
class ImportGraph:
    modules: dict[str, ModuleInfo]
    explicit: dict[str, set[str]]  # node -> nodes (modules and "pkg.__getattr__" pseudo-nodes)
    implicit: dict[str, set[str]]  # module -> parent package (run before the module)
    external: dict[str, dict[str, int]]  # node -> {top-level third-party name: first line}
    where: dict[tuple[str, str], int]  # edge -> line in the source node's file
    string_edges: set[tuple[str, str]]  # edges that came from importlib calls / string constants

    def file_of(self, node: str) -> str:
        mod = self.modules.get(node.removesuffix("." + GETATTR)) or self.modules.get(node)
        return str(mod.path.relative_to(ROOT)) if mod and mod.path.is_relative_to(ROOT) else node


def _longest_known_prefix(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def build_graph(modules: dict[str, ModuleInfo], internal_tops: set[str] | None = None) -> ImportGraph:
    known = set(modules)
    internal_tops = set(internal_tops or {m.split(".")[0] for m in modules})
    getattr_nodes = {m.name: f"{m.name}.{GETATTR}" for m in modules.values()
                     if m.is_package and any(r.in_getattr for r in m.refs)}
    explicit: dict[str, set[str]] = defaultdict(set)
    external: dict[str, dict[str, int]] = defaultdict(dict)
    where: dict[tuple[str, str], int] = {}
    string_edges: set[tuple[str, str]] = set()

    for mod in modules.values():
        for ref in mod.refs:
            src = getattr_nodes[mod.name] if ref.in_getattr else mod.name
            top = ref.module.split(".")[0]
            if ref.kind == "string" and _longest_known_prefix(ref.module, known) != ref.module \
                    and top != TESTS_PACKAGE:
                continue  # a dotted string that names no scanned module: not an import
            targets: set[str] = set()
            if top not in internal_tops:  # third-party, stdlib, and tests (not scanned)
                external[src].setdefault(top, ref.lineno)
                continue
            namespace_access = ref.kind == "import"  # `import pkg` may touch any attribute
            if ref.names:
                for name in ref.names:
                    if f"{ref.module}.{name}" in known:
                        targets.add(f"{ref.module}.{name}")
                    elif ref.module in modules and name in modules[ref.module].defines:
                        targets.add(ref.module)  # `from atomd import __version__`: found, __getattr__ not run
                    else:
                        namespace_access = True
                        targets.add(_longest_known_prefix(ref.module, known) or ref.module)
            else:
                targets.add(_longest_known_prefix(ref.module, known) or ref.module)
            if namespace_access:
                targets |= {getattr_nodes[t] for t in list(targets) if t in getattr_nodes}
            for dst in targets:
                if dst == src:
                    continue
                explicit[src].add(dst)
                where.setdefault((src, dst), ref.lineno)
                if ref.kind in ("call", "string"):
                    string_edges.add((src, dst))

    implicit: dict[str, set[str]] = defaultdict(set)
    for name in known:
        parent = name.rpartition(".")[0]
        if parent in known:
            implicit[name].add(parent)
    for pkg, node in getattr_nodes.items():
        implicit[node]  # the pseudo-node exists even when nothing reaches it
        explicit.setdefault(node, set())
    return ImportGraph(modules, dict(explicit), dict(implicit), dict(external), where, string_edges)


def strongly_connected_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan: every strongly connected component with more than one node (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[list[str]] = []
    counter = 0
    nodes = set(graph) | {d for ds in graph.values() for d in ds}

    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    result.append(sorted(component))
    return sorted(result)


def a_cycle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle inside a strongly connected component, as a node path a -> ... -> a."""
    members = set(component)
    start = component[0]
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, ())):
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if child not in prev:
                prev[child] = node
                queue.append(child)
    return component + [start]


def shortest_path(graph: ImportGraph, start: str, goal,
                  skip: frozenset[tuple[str, str]] = frozenset()) -> list[str] | None:
    """BFS over explicit + implicit (parent package) edges, less `skip`, to the first node with goal(node)."""
    prev: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if goal(node):
            path = [node]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])
            return list(reversed(path))
        for child in sorted(graph.explicit.get(node, set()) | graph.implicit.get(node, set())):
            if child not in prev and (node, child) not in skip:
                prev[child] = node
                queue.append(child)
    return None


def describe_path(graph: ImportGraph, path: list[str]) -> str:
    steps = []
    for a, b in zip(path, path[1:]):
        if (a, b) in graph.where:
            steps.append(f"{a} -> {b} ({graph.file_of(a)}:{graph.where[(a, b)]})")
        else:
            steps.append(f"{a} -> {b} (parent package, run first)")
    return "; ".join(steps) if steps else path[0]


def _top(node: str) -> str:
    return node.split(".")[0]


# --------------------------------------------------------------------------- the real tree


@functools.lru_cache(maxsize=1)
def production_graph() -> ImportGraph:
    return build_graph(scan(ROOT, PRODUCTION_PACKAGES + OTHER_SCANNED_DIRS),
                       internal_tops=set(PRODUCTION_PACKAGES + OTHER_SCANNED_DIRS))


def test_scanner_sees_the_tree():
    g = production_graph()
    for pkg in PRODUCTION_PACKAGES:
        assert pkg in g.modules, f"{pkg}/__init__.py not scanned"
    assert len([m for m in g.modules if _top(m) in PRODUCTION_PACKAGES]) >= 30
    # importlib-driven imports are in the graph (kv_transfer.connector's registry, atomd.cli's COMMANDS)
    assert g.string_edges, "no importlib / registry-string import found: the scanner lost that feature"


def test_no_import_cycles_in_production_packages_and_benchmarks():
    g = production_graph()
    scanned = PRODUCTION_PACKAGES + OTHER_SCANNED_DIRS
    prod = {src: {d for d in dsts if _top(d) in scanned}
            for src, dsts in g.explicit.items() if _top(src) in scanned}
    cycles = strongly_connected_cycles(prod)
    report = [f"cycle among {{{', '.join(c)}}}: {describe_path(g, a_cycle_through(prod, c))}" for c in cycles]
    assert not cycles, "import cycles:\n  " + "\n  ".join(report)


@pytest.mark.parametrize("package", TORCH_FREE_PACKAGES)
def test_package_never_imports_torch(package):
    g = production_graph()
    violations = []
    for start in sorted(n for n in set(g.explicit) | set(g.modules) if n == package or n.startswith(package + ".")):
        path = shortest_path(g, start, lambda n: "torch" in g.external.get(n, {}), skip=PROCESS_SEAMS)
        if path is not None:
            last = path[-1]
            chain = describe_path(g, path)
            violations.append(f"{start}: {chain + '; ' if len(path) > 1 else ''}"
                              f"{last} imports torch ({g.file_of(last)}:{g.external[last]['torch']})")
    assert not violations, f"{package}/ reaches torch:\n  " + "\n  ".join(violations)


def test_api_process_never_imports_torch():
    """What the static rule cannot see past the process seam: importing the API side's modules
    (engine core entry point included) leaves torch unloaded, in a fresh interpreter."""
    code = ("import sys, atomd.api.server, atomd.api.openapi, atomd.engine.core; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the API process loaded torch: {out.stdout}"


@pytest.mark.parametrize("side", ["atomd.engine", "atomd.kernels", "atomd.model"])
def test_engine_side_never_imports_the_api_side(side):
    g = production_graph()
    violations = []
    for start in sorted(n for n in set(g.explicit) | set(g.modules) if n == side or n.startswith(side + ".")):
        path = shortest_path(g, start, lambda n: n == "atomd.api" or n.startswith("atomd.api."))
        if path is not None:
            violations.append(f"{start}: {describe_path(g, path)}")
    assert not violations, f"{side} reaches atomd.api:\n  " + "\n  ".join(violations)


def test_contracts_import_no_other_package():
    """contracts/ is what every side agrees on: it depends on none of them."""
    g = production_graph()
    violations = [f"{src} -> {dst} ({g.file_of(src)}:{g.where[(src, dst)]})"
                  for src, dsts in sorted(g.explicit.items()) if _top(src) == "contracts"
                  for dst in sorted(dsts) if _top(dst) in PRODUCTION_PACKAGES and _top(dst) != "contracts"]
    assert not violations, "contracts imports another package:\n  " + "\n  ".join(violations)


def test_atomd_never_imports_launch():
    """launch/ starts atomd's processes by command line; the arrow points launch -> atomd only."""
    g = production_graph()
    violations = [f"{src} -> {dst} ({g.file_of(src)}:{g.where[(src, dst)]})"
                  for src, dsts in sorted(g.explicit.items()) if _top(src) == "atomd"
                  for dst in sorted(dsts) if _top(dst) == "launch"]
    assert not violations, "atomd imports launch:\n  " + "\n  ".join(violations)


def test_router_never_imports_atomd_or_scheduler():
    g = production_graph()
    violations = []
    for start in sorted(n for n in set(g.explicit) | set(g.modules) if _top(n) == "router"):
        path = shortest_path(g, start, lambda n: _top(n) in ROUTER_FORBIDDEN)
        if path is not None:
            violations.append(f"{start}: {describe_path(g, path)}")
    assert not violations, "router/ reaches atomd or scheduler:\n  " + "\n  ".join(violations)


def test_nothing_outside_tests_imports_tests():
    g = production_graph()
    violations = sorted(
        f"{g.file_of(mod.name)}:{ref.lineno}: {ref.module}"
        + (f" import {', '.join(ref.names)}" if ref.names else "")
        for mod in g.modules.values() for ref in mod.refs
        if _top(ref.module) == TESTS_PACKAGE)
    assert not violations, "modules outside tests/ import tests:\n  " + "\n  ".join(violations)


# --------------------------------------------------------------------------- self-tests of the checker


def test_cycle_finder_on_synthetic_graphs():
    assert strongly_connected_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": {"g"}}
    assert strongly_connected_cycles(graph) == [["a", "b", "c"], ["d", "e"], ["g"]]
    assert a_cycle_through(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    # a long chain with one back edge (and deep enough to need the iterative walk)
    chain = {str(i): {str(i + 1)} for i in range(5000)}
    assert strongly_connected_cycles(chain) == []
    chain["5000"] = {"0"}
    assert len(strongly_connected_cycles(chain)[0]) == 5001


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC = {
    # package with a lazy PEP 562 __getattr__ importing its heavy child (like atomd/__init__.py)
    "pkg/__init__.py": "def __getattr__(name):\n    from pkg.heavy import Heavy\n    return Heavy\n",
    "pkg/heavy.py": "import torch\nfrom pkg import light\n",
    "pkg/light.py": "X = 1\n",
    # core <-> dp: a lazy (function-level) import closing a cycle, relative import resolved
    "pkg/core.py": "def f():\n    from .dp import g\n",
    "pkg/dp.py": "from pkg.core import f\n",
    # eager package __init__ (like scheduler/__init__.py): loading any child runs it
    "eager/__init__.py": "from eager.a import A\nfrom eager.b import B\n",
    "eager/a.py": "A = 1\n",
    "eager/b.py": "from pkg import heavy\n",
    # importlib: registry string, command table, literal call
    "reg/__init__.py": "",
    "reg/connector.py": ("_BUILTIN = {'zmq': 'reg.impl:create'}\nLOG = 'not.a.module'\n"
                         "def make():\n    import importlib\n    return importlib.import_module('reg.other')\n"),
    "reg/impl.py": "",
    "reg/other.py": "",
    "reg/cli.py": ("import importlib\nCOMMANDS = {'serve': ('pkg.light', 'help')}\n"
                   "def main():\n    importlib.import_module('torch')\n"),
    "reg/plain.py": "S = 'pkg.light'  # no importlib here: just a string\n",
    # router-like modules
    "front/__init__.py": "",
    "front/ok.py": "from eager import a\n",  # loads eager/__init__ -> eager.b -> pkg.heavy -> torch
    "front/api.py": "from pkg import LLM\n",  # namespace access: reaches the lazy __getattr__
    "front/light_only.py": "from pkg import light\n",  # sibling resolution: pkg.light only
    "front/uses_tests.py": "def f():\n    from tests.helpers import x\n",
}


def test_scanner_and_rules_on_a_synthetic_tree(tmp_path):
    _write(tmp_path, SYNTHETIC)
    g = build_graph(scan(tmp_path, ("pkg", "eager", "reg", "front")))
    e = g.explicit

    # lazy + relative imports found; the core <-> dp cycle is reported
    assert "pkg.dp" in e["pkg.core"] and "pkg.core" in e["pkg.dp"]
    assert strongly_connected_cycles(e) == [["pkg.core", "pkg.dp"]]
    # __init__ -> own child through __getattr__, child -> `from pkg import light`: no cycle
    assert e["pkg.__getattr__"] == {"pkg.heavy"} and e["pkg.heavy"] == {"pkg.light"}
    # importlib: literal calls, registry "mod:attr" strings and command-table strings;
    # dotted strings naming no module, and strings in files without importlib, are ignored
    assert e["reg.connector"] == {"reg.impl", "reg.other"}
    assert e["reg.cli"] == {"pkg.light"} and "torch" in g.external["reg.cli"]
    assert "reg.plain" not in e
    assert ("reg.connector", "reg.impl") in g.string_edges
    # sibling resolution vs namespace access
    assert e["front.light_only"] == {"pkg.light"}
    assert e["front.api"] == {"pkg", "pkg.__getattr__"}

    def torch_path(start):
        return shortest_path(g, start, lambda n: "torch" in g.external.get(n, {}))

    assert torch_path("front.light_only") is None  # pkg/__init__ runs, its __getattr__ does not
    assert torch_path("front.api")[-1] == "pkg.heavy"
    # implicit parent-package edge: importing eager.a runs eager/__init__, which imports eager.b
    assert torch_path("front.ok") == ["front.ok", "eager.a", "eager", "eager.b", "pkg.heavy"]
    assert "parent package" in describe_path(g, torch_path("front.ok"))
    # an import of tests is seen even inside a function
    assert any(_top(r.module) == TESTS_PACKAGE for r in g.modules["front.uses_tests"].refs)
