"""Imports run one way: bench -> workers -> clients, workers -> streamer -> kernels, never back, and
no module imports itself through others (no cycles). Read from the source with `ast`, imports inside
functions and under TYPE_CHECKING included, so a lazy import cannot hide an edge."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bench", "workers", "clients", "streamer", "streamer_kernels")
# The folder of each package whose import name differs from it (pyproject.toml's package-dir).
FOLDERS = {"streamer_kernels": "kernels"}
# Which other top-level packages each one may import (any module may import its own package).
ALLOWED = {
    "bench": {"workers", "clients", "streamer", "streamer_kernels"},
    "workers": {"clients", "streamer", "streamer_kernels"},
    "clients": set(),
    "streamer": {"streamer_kernels"},
    "streamer_kernels": set(),
}
# Inside workers: the programs (cli, worker, gateway) use the shared modules directly in workers/;
# only the CLI starts the others; the shared modules use none of them.
WORKERS_PROGRAMS = ("workers.cli", "workers.worker", "workers.gateway")
WORKERS_ALLOWED = {
    "workers.cli": {"workers.worker", "workers.gateway", "workers"},
    "workers.worker": {"workers"},
    "workers.gateway": {"workers"},
    "workers": set(),
}
DYNAMIC_IMPORTS = ("import_module", "__import__")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the project module it imports (a submodule when `from pkg import submodule`)
    where: str  # path:line, for the message


def module_name(path: Path, root: Path = ROOT) -> str:
    folder, *rest = path.relative_to(root).with_suffix("").parts
    parts = [next((p for p, f in FOLDERS.items() if f == folder), folder), *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every non-test module of the project packages."""
    files = {}
    for package in PACKAGES:
        for path in sorted((root / FOLDERS.get(package, package)).rglob("*.py")):
            if not path.name.startswith("test_") and "tests" not in path.relative_to(root).parts:
                files[module_name(path, root)] = path
    return files


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _resolve(target: str, modules: set[str]) -> str:
    """The longest prefix of `target` that is a module (`import a.b.c` where c is a function...)."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return target


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(module: str, path: Path, modules: set[str], root: Path = ROOT) -> tuple[list[Import], list[str]]:
    """(project imports of one file, dynamic imports found in it)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    dynamic: list[str] = []
    rel = path.relative_to(root)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(node, module, is_package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _resolve(base, modules)
                       for a in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            dynamic.append(f"{rel}:{node.lineno}")
        found += [Import(module, t, f"{rel}:{node.lineno}") for t in targets if _top(t) in PACKAGES]
    return found, dynamic


def _is_dynamic_import(call: ast.Call) -> bool:
    """import_module / __import__ of a project module, or of a name computed at run time."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in DYNAMIC_IMPORTS or not call.args:
        return False
    arg = call.args[0]
    return not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)) or _top(arg.value) in PACKAGES


def _workers_unit(module: str) -> str:
    return next((p for p in WORKERS_PROGRAMS if module == p or module.startswith(p + ".")), "workers")


def layering_violations(imports: list[Import]) -> list[str]:
    """Every import that runs against ALLOWED (and, inside workers, WORKERS_ALLOWED)."""
    bad = []
    for imp in imports:
        src, dst = _top(imp.importer), _top(imp.target)
        if src != dst and dst not in ALLOWED[src]:
            bad.append(f"{imp.where}: {imp.importer} imports {imp.target} ({src} -> {dst} is not allowed)")
        elif src == dst == "workers":
            a, b = _workers_unit(imp.importer), _workers_unit(imp.target)
            if a != b and b not in WORKERS_ALLOWED[a]:
                bad.append(f"{imp.where}: {imp.importer} imports {imp.target} ({a} -> {b} is not allowed)")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def project_imports() -> tuple[list[Import], list[str]]:
    files = source_files()
    imports: list[Import] = []
    dynamic: list[str] = []
    for module, path in files.items():
        found, dyn = imports_of(module, path, set(files))
        imports += found
        dynamic += dyn
    return imports, dynamic


def graph_of(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
    return graph


# --- the project -------------------------------------------------------------------------------

def test_imports_follow_the_layers() -> None:
    imports, _ = project_imports()
    assert len(imports) > 100, "the walk found too few imports to be looking at the project"
    bad = layering_violations(imports)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_dynamic_imports_of_project_modules() -> None:
    _, dynamic = project_imports()
    assert not dynamic, "import_module/__import__ hides an edge from this test; use an import statement: " \
        + ", ".join(dynamic)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    imports, _ = project_imports()
    cycles = [c for c in import_cycles(graph_of(imports)) if _top(c[0]) == package]
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_async_engine_fits_the_workers_engine_seam() -> None:
    """The worker types its engine as `workers.worker.engine.Engine`: AsyncEngine must have each of
    its methods with the same parameters."""
    from streamer.async_engine import AsyncEngine
    from workers.worker.engine import Engine

    methods = [n for n, v in vars(Engine).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert sorted(methods) == ["abort", "admission_capacity", "chat_template", "detokenize", "embed", "generate",
                              "output_text", "prompt_progress", "render_chat", "sampling_defaults", "stats",
                              "take_step_records", "token_texts", "tokenize"]
    for name in methods:
        want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(Engine, name)).parameters.values()]
        have = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(AsyncEngine, name)).parameters.values()]
        assert have == want, name


# --- the checker itself ------------------------------------------------------------------------

def test_a_back_edge_is_reported() -> None:
    imports = [Import("clients.redis_client", "workers.errors", "clients/redis_client.py:3"),
               Import("streamer.llm", "workers.cli.main", "streamer/llm.py:9"),
               Import("streamer_kernels.rotary", "streamer.config", "kernels/rotary.py:1"),
               Import("workers.worker.job", "workers.cli.parent", "workers/worker/job.py:5"),
               Import("workers.errors", "workers.gateway.hub", "workers/errors.py:2"),
               # allowed ones
               Import("bench.fanout", "workers.redis_server", "bench/fanout.py:1"),
               Import("workers.cli.main", "workers.worker.command", "workers/cli/main.py:1"),
               Import("workers.worker.job", "streamer.errors", "workers/worker/job.py:1"),
               Import("streamer.llm", "streamer_kernels.rotary", "streamer/llm.py:1")]
    bad = layering_violations(imports)
    assert [line.split(":")[0] for line in bad] == ["clients/redis_client.py", "streamer/llm.py",
                                                    "kernels/rotary.py", "workers/worker/job.py",
                                                    "workers/errors.py"]


def test_a_cycle_is_reported() -> None:
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x", "a.w"}, "a.w": set(), "b.p": {"b.q"},
             "b.q": {"b.p"}, "c.solo": {"c.solo"}}
    assert import_cycles(graph) == [["a.x", "a.y", "a.z"], ["b.p", "b.q"]]
    assert import_cycles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_imports_are_read_from_every_place(tmp_path: Path) -> None:
    """Relative imports, `from pkg import submodule`, imports in functions and under TYPE_CHECKING,
    and dynamic imports of project modules are all seen."""
    pkg = tmp_path / "workers" / "gateway"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "session.py", "server.py"):
        (pkg / name).write_text("")
    (pkg / "session.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .server import Gateway\n"
        "def f():\n    from workers import gateway\n    from . import server\n"
        "import importlib\nimportlib.import_module('streamer.llm')\n__import__(name)\n"
        "importlib.import_module('json')\n")
    modules = {"workers.gateway", "workers.gateway.session", "workers.gateway.server"}
    found, dynamic = imports_of("workers.gateway.session", pkg / "session.py", modules, tmp_path)
    assert sorted({i.target for i in found}) == ["workers.gateway", "workers.gateway.server"]
    assert [i.where for i in found if i.target == "workers.gateway.server"] == [
        "workers/gateway/session.py:3", "workers/gateway/session.py:6"]
    assert dynamic == ["workers/gateway/session.py:8", "workers/gateway/session.py:9"]
    assert import_cycles(graph_of(found + [Import("workers.gateway.server", "workers.gateway.session", "")])) \
        == [["workers.gateway.server", "workers.gateway.session"]]


# Modules of the engine that nothing in it imports, and why they belong there all the same.
ENGINE_ENTRY_POINTS = {
    "streamer": "the package: its public face (LLM, LLMEngine, AsyncEngine, EngineConfig, SamplingParams, ...)",
    "streamer.grammar_child": "the grammar compile process's entry point, started by module name",
    "streamer.random_checkpoint": "tiny random checkpoints for the tests and benchmarks; to move with the tests",
}


def test_the_engine_holds_only_what_the_engine_uses() -> None:
    """A module in streamer/ is imported from streamer/ itself (or is an entry point listed above):
    serving code (tool-call parsers, protocols) lives with the programs that use it, in workers/."""
    imports, _ = project_imports()
    files = source_files()
    inside = {i.target for i in imports if _top(i.importer) == "streamer" and i.importer != i.target}
    stray = [m for m, path in files.items() if _top(m) == "streamer" and path.name != "__init__.py"
             and m not in inside and m not in ENGINE_ENTRY_POINTS]
    assert not stray, f"modules in streamer/ that the engine never imports (move them to their users): {stray}"
    assert all(m in files for m in ENGINE_ENTRY_POINTS), "an entry point listed here no longer exists"
