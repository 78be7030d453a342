"""The layers stay layers: no import circle inside ``common/``, the engine library imports no
program (router, nodes, launcher, bench), and ``kv_store/`` — the byte stores — imports nothing
of the engine (``common/``, ``kv_transfer/``, ``kernels/``) and no torch: it imports, every module
of it, in a process where torch cannot be imported.

The graph is read from the source (``ast``), not from a running interpreter: an import that only
a type checker sees (``if TYPE_CHECKING:``) still counts, since it is a dependency a reader
follows; an import inside a function does not (it runs late, when called).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ("router", "node_frontend", "prefill_node", "decode_node", "launcher", "bench")
ENGINE = ("common", "kv_transfer", "kernels", "torch", "triton")
# Torch-free build helpers that still live in common/: the shm arena's C slot protocol is built
# through them (kv_store/arena_slots.py). They belong below common/, in a package of their own;
# until they move, they are the only part of common/ a store may use.
STORE_MAY_USE = ("common.native_build", "common.cache_dir")


def modules(package: str) -> dict[str, Path]:
    """Dotted name → file of every module of ``package`` (a package is its ``__init__``)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported: at top level, under ``if`` (type
    checking included), ``try`` and ``with``, in class bodies; not inside functions."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)
        elif isinstance(node, ast.ClassDef):
            yield from _module_level(node.body)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Absolute names an import statement may load: ``from a import b`` names ``a`` and
    ``a.b`` (a submodule, if it is one); relative imports are resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(package: str) -> dict[str, set[str]]:
    """Module → modules of ``package`` it imports at module level (with the packages above
    each, whose ``__init__`` runs first)."""
    mods = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in _module_level(tree.body):
            for target in _imported(node, name, path.name == "__init__.py"):
                parts = target.split(".")
                deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def imports_anywhere(path: Path) -> set[str]:
    """Modules a file imports, at any depth (functions included): ``from a import b`` is
    ``a.b`` when that is a module of this tree, else ``a``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found = (ROOT / name.replace(".", "/")).with_suffix(".py").exists()
                out.add(name if found else node.module)
    return out


def _top(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def test_the_graph_reader_sees_imports():
    """The reader itself: a known edge, a type-checking-only one, and a circle it must find."""
    graph = import_graph("common")
    assert "common.step_outputs" in graph["common.scheduler"]
    assert "common.config" in graph["common.spec_decode.proposer"]  # under TYPE_CHECKING
    assert "common.spec_decode" in graph["common.spec_decode.proposer"]  # its package runs first
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_common():
    found = cycles(import_graph("common"))
    assert found == [], "import circles in common/: " + "; ".join(" <-> ".join(c) for c in found)


def test_common_imports_no_program():
    """The engine library is what the programs share; none of them is below it."""
    bad = {
        name: sorted(_top(imports_anywhere(path)) & set(PROGRAMS))
        for name, path in modules("common").items()
        if _top(imports_anywhere(path)) & set(PROGRAMS)
    }
    assert bad == {}


def test_kv_store_imports_nothing_of_the_engine():
    bad = {}
    for name, path in modules("kv_store").items():
        found = {m for m in imports_anywhere(path) if m.split(".")[0] in ENGINE}
        if found - set(STORE_MAY_USE):
            bad[name] = sorted(found - set(STORE_MAY_USE))
    assert bad == {}


_TORCH_BLOCKED = """
import importlib, pkgutil, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("kv_store imported " + name)
        return None

sys.meta_path.insert(0, Blocked())
import kv_store
for info in pkgutil.walk_packages(kv_store.__path__, "kv_store."):
    importlib.import_module(info.name)
print(sorted(name for name in sys.modules if name.split(".")[0] == "common"))
"""


def test_every_kv_store_module_imports_with_torch_blocked():
    """In a fresh interpreter that refuses torch, triton, the kernels and kv_transfer."""
    code = _TORCH_BLOCKED.format(blocked=("torch", "triton", "kernels", "kv_transfer"))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    # ``common`` runs its __init__ (SamplingParams, torch-free) on the way to the helpers
    assert loaded <= {"common", "common.sampling_params", *STORE_MAY_USE}
