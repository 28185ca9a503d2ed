"""Benchmarks sit on top: no module of crest outside `crest.bench` and the `crest bench` commands imports them."""

from __future__ import annotations

import ast
from pathlib import Path

import crest

ROOT = Path(crest.__file__).parent


def _bench_side(module: str) -> bool:
    return module.startswith(("crest.bench.", "crest.cli.bench")) or module == "crest.bench"


def _module(path: Path) -> str:
    return ".".join(("crest", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def _imports(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return found


def test_no_product_module_imports_the_benchmarks() -> None:
    offenders = [
        f"{_module(path)} imports {name}"
        for path in sorted(ROOT.rglob("*.py"))
        if not _bench_side(_module(path))
        for name in _imports(ast.parse(path.read_text(encoding="utf-8")))
        if name == "crest.bench" or name.startswith("crest.bench.")
    ]
    assert offenders == []


def test_the_walk_sees_the_bench_side() -> None:
    modules = {_module(path) for path in ROOT.rglob("*.py")}
    assert {"crest.bench.results", "crest.cli.bench_display", "crest.cli.display"} <= modules
    assert _bench_side("crest.cli.bench_display") and not _bench_side("crest.cli.display")
    assert _imports(ast.parse("from crest import bench\nimport crest.bench.lookup")) == [
        "crest",
        "crest.bench",
        "crest.bench.lookup",
    ]
