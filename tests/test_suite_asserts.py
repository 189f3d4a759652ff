"""The suite's own asserts can fail: no ``assert a == b if c else d`` (it parses as
``assert (a == b) if c else d``, so one branch is a constant truth value) and no assert whose
condition is a constant or a literal (always true or always false).

ruff covers part of this (B011 ``assert False``, F631 ``assert (a, b)``, PT015 falsy constants,
PLW0129 string literals; see pyproject.toml); the conditional expression and truthy constants
have no ruff rule, so this test walks the syntax tree of every Python file in the repository.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCES = {"build", "dist", "venv", "env", "node_modules", "site-packages"}
"""Folder names that hold copies or installed packages, not this repository's code."""
SOURCE_FOLDERS = ("bench", "synthetic", "tests", "wyoming_cosyvoice3")
"""Folders that must be among those scanned (a rename must update this, not drop them)."""

_LITERALS = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.JoinedStr,
             ast.GeneratorExp, ast.Lambda)


def assert_defects(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: reason`` for each assert in ``source`` whose outcome does not depend on
    the values it names: a conditional expression at the top of the condition, or a
    constant / literal condition (also as an operand of ``and`` / ``or`` / ``not``)."""
    defects: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Assert):
            continue
        reason = _defect(node.test)
        if reason:
            defects.append(f"{filename}:{node.lineno}: {reason}")
    return defects


def _defect(test: ast.expr) -> str | None:
    if isinstance(test, ast.IfExp):
        return ("conditional expression as the assert condition (one branch is not "
                "compared; write `expected = x if c else y` first)")
    if isinstance(test, _LITERALS):
        return "constant or literal assert condition (always true or always false)"
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _defect(test.operand)
    if isinstance(test, ast.BoolOp):
        for value in test.values:
            reason = _defect(value)
            if reason:
                return f"operand of {type(test.op).__name__.lower()}: {reason}"
    return None


def _skipped(folder: Path) -> bool:
    """Hidden folders (.git, .venv, caches), virtual environments, build output."""
    return (folder.name.startswith(".") or folder.name in NOT_SOURCES
            or (folder / "pyvenv.cfg").exists())


def _python_files_in(folder: Path) -> list[Path]:
    files: list[Path] = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and not path.is_symlink() and not _skipped(path):
            files.extend(_python_files_in(path))
        elif path.suffix == ".py" and path.is_file():
            files.append(path)
    return files


def source_folders(root: Path = ROOT) -> list[str]:
    """Every top-level folder of ``root`` holding ``.py`` files (at any depth), except hidden
    folders, virtual environments and build output."""
    return [d.name for d in sorted(root.iterdir())
            if d.is_dir() and not _skipped(d) and _python_files_in(d)]


def python_files(root: Path = ROOT) -> list[Path]:
    return sorted([p for p in root.glob("*.py") if p.is_file()]
                  + [p for top in source_folders(root) for p in _python_files_in(root / top)])


def test_the_scan_covers_every_folder_holding_python(tmp_path: Path) -> None:
    for name in ("pkg/a.py", "deep/x/y/b.py", "top.py", ".hidden/c.py", "venv/lib/d.py",
                 "myenv/pyvenv.cfg", "myenv/lib/e.py", "build/lib/f.py", "docs/g.md",
                 "pkg/.venv/h.py", "pkg/inner/pyvenv.cfg", "pkg/inner/i.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert source_folders(tmp_path) == ["deep", "pkg"]
    found = [p.relative_to(tmp_path).as_posix() for p in python_files(tmp_path)]
    assert found == ["deep/x/y/b.py", "pkg/a.py", "top.py"]
    scanned = source_folders()
    assert set(SOURCE_FOLDERS) <= set(scanned), scanned
    assert all((ROOT / folder).is_dir() for folder in (*SOURCE_FOLDERS, *scanned))


@pytest.mark.parametrize("snippet", [
    "assert texts == [1] if reset else [1, 2]",
    "assert outcome == 'completed' if reset else 'cancelled'",
    "assert True",
    "assert 1",
    "assert 'always'",
    "assert (x, 'message')",
    "assert [x]",
    "assert f'{x}'",
    "assert x or True",
    "assert x and not 0",
    "assert (lambda: x)",
])
def test_the_check_rejects_asserts_that_cannot_fail(snippet: str) -> None:
    assert len(assert_defects(snippet)) == 1, snippet


@pytest.mark.parametrize("snippet", [
    "assert texts == ([1] if reset else [1, 2])",
    "assert x, 'message'",
    "assert x == 1 and y",
    "assert not x",
    "assert (a if c else b) == 3",
    "assert all(v > 0 for v in values)",
    "assert not [r for r in records if r.levelno > 20]",
])
def test_the_check_accepts_asserts_that_can_fail(snippet: str) -> None:
    assert assert_defects(snippet) == [], snippet


def test_no_assert_in_the_repository_is_constant_or_a_conditional_expression() -> None:
    files = python_files()
    assert len(files) > 50 and any(p.name == Path(__file__).name for p in files)
    defects = [d for p in files
               for d in assert_defects(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert defects == []
