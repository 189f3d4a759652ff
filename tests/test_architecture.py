"""The package's shape: no import cycles between modules, the import-linter contracts of
pyproject.toml hold, the product package imports neither the benchmark (``bench/``) nor the
synthetic-model builder (``synthetic/``), and the engine reads no environment variables."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

PACKAGE = "wyoming_cosyvoice3"
TOOLS = ("bench", "synthetic")
"""The repository's top-level tool packages beside the product (not in the wheel)."""
ROOT = Path(__file__).resolve().parents[1]


def module_cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Every import cycle, as the shortest chain from a module back to itself (one per
    module pair that closes a cycle). Imports under ``if TYPE_CHECKING:`` count."""
    cycles: list[tuple[str, ...]] = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append((module, *back))
    return cycles


def test_module_cycles_are_found() -> None:
    graph = grimp.ImportGraph()
    for name in ("pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert module_cycles(graph) == []
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert ("pkg.a", "pkg.b", "pkg.c", "pkg.a") in module_cycles(graph)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """Imports among the product and the tool packages; imports inside functions and under
    ``if TYPE_CHECKING:`` count."""
    return grimp.build_graph(PACKAGE, *TOOLS, exclude_type_checking_imports=False)


def test_no_import_cycle(graph: grimp.ImportGraph) -> None:
    assert {m.split(".")[0] for m in graph.modules} == {PACKAGE, *TOOLS}
    assert module_cycles(graph) == []


def test_server_does_not_import_the_benchmark(graph: grimp.ImportGraph) -> None:
    """The benchmark plugs into the server's hooks (server/hooks.py); no chain of imports,
    direct or through other modules, leads from the server to it."""
    assert {"bench.recorder", f"{PACKAGE}.server.runtime"} <= graph.modules
    assert graph.find_shortest_chains(importer=f"{PACKAGE}.server", imported="bench") == set()
    # the benchmark does use the server (the guard would be empty otherwise)
    assert graph.find_shortest_chains(importer="bench", imported=f"{PACKAGE}.server")


@pytest.mark.parametrize("tool", TOOLS)
def test_product_imports_no_tool_package(graph: grimp.ImportGraph, tool: str) -> None:
    """Nothing in the installed package imports bench/ or synthetic/ (they are not in the
    wheel: such an import fails for every user)."""
    assert graph.find_shortest_chains(importer=PACKAGE, imported=tool) == set()
    assert graph.find_shortest_chains(importer=tool, imported=PACKAGE)  # a real edge exists


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contracts in pyproject.toml ([tool.importlinter]): the product imports neither
    bench nor synthetic; the server not the benchmark; the engine no server, bench, synthetic
    or download code; engine stages never import each other."""
    from importlinter import configuration
    from importlinter.application.use_cases import lint_imports

    configuration.configure()
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None,
                        no_logo=True) is True


def environment_reads(path: Path) -> list[int]:
    """Line numbers of ``os.environ`` / ``os.getenv`` / ``environ.get`` uses in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        attribute = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
        imported = isinstance(node, ast.ImportFrom) and node.module == "os" and any(
            alias.name in ("environ", "getenv") for alias in node.names
        )
        if attribute or imported:
            lines.append(node.lineno)
    return sorted(lines)


def test_environment_reads_are_detected(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import os\nx = os.environ.get('A')\nfrom os import getenv\n")
    assert environment_reads(sample) == [2, 3]


def test_engine_reads_no_environment() -> None:
    """Options and hooks are passed in; the only exception is the derivation child process,
    which hands the parent's environment on to the child (engine/derive/common/files.py)."""
    allowed = {ROOT / PACKAGE / "engine" / "derive" / "common" / "files.py"}
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / PACKAGE / "engine").rglob("*.py"))
        if path not in allowed and (lines := environment_reads(path))
    }
    assert offenders == {}
