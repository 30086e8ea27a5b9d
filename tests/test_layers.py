"""The layer rules of core/, checked by walking every import (docs/architecture.md).

Layers, bottom to top: gguf -> model -> tokenizer/chat_template -> lora -> serve ->
http; no import goes up, and no two modules import each other, directly or round a
loop (an import inside a function counts too: it is the same dependency, only later).
(Module sizes: tests/test_module_sizes.py.)
"""

from __future__ import annotations

import ast
import gc
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "core"

# (importer prefix, what it must not import)
FORBIDDEN = [
    ("core.model", ("core.lora", "core.serve", "core.http", "core.cli")),
    ("core.gguf", ("core.model", "core.lora", "core.serve", "core.http", "core.cli")),
    ("core.lora", ("core.serve", "core.http", "core.cli")),
    ("core.serve", ("core.http", "core.cli")),
    ("core.cli", ("core.http",)),
    ("core", ("ui", "PySide6", "qasync")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``: an import there is read by the
    type checker only, never run, so it is no dependency."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def parse(path: Path) -> ast.Module:
    """``ast.parse`` with the collector paused. In 3.11, a finalizer the collector runs
    in the middle of a parse that parses too (asyncio's "exception was never retrieved"
    log formats a traceback, which parses with ``ast``) makes the outer parse fail with
    "AST constructor recursion depth mismatch": a leftover from another test must not
    fail this one. (The leftover itself: tests/test_http_robust.py.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text())
    finally:
        if enabled:
            gc.enable()


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports at run time, absolute, wherever the import stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(parse(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            # "from . import layout" names a module, not a symbol
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    mods = {module_name(p): p for p in CORE.rglob("*.py")}

    def known(m: str) -> str | None:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        return m or None

    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = {known(m) for m in imports_of(path) if m.startswith("core")}
        # a package's __init__ is not a dependency of its own modules
        out[name] = {d for d in deps if d and d != name and not name.startswith(d + ".")}
    return out


def test_no_import_goes_up_a_layer():
    bad = []
    for path in CORE.rglob("*.py"):
        name = module_name(path)
        for mod in imports_of(path):
            for who, banned in FORBIDDEN:
                if name == who or name.startswith(who + "."):
                    hit = [b for b in banned if mod == b or mod.startswith(b + ".")]
                    bad += [f"{name} imports {mod}" for _ in hit]
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_import_cycle_in_core():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
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
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The walk itself works: a made-up core/ with model -> lora -> model fails both."""
    fake = tmp_path / "core"
    (fake / "model").mkdir(parents=True)
    (fake / "lora").mkdir()
    for d in (fake, fake / "model", fake / "lora"):
        (d / "__init__.py").write_text("")
    (fake / "model" / "llama.py").write_text("from ..lora import mix\n")
    (fake / "lora" / "mix.py").write_text("from ..model.llama import X\n")
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "ROOT", tmp_path)
    monkeypatch.setattr(here, "CORE", fake)
    with pytest.raises(AssertionError, match="core.model.llama imports core.lora"):
        test_no_import_goes_up_a_layer()
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycle_in_core()
