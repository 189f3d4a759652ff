"""The server reaches the engine only through the calls ``server/engine_port.py`` names.

Every engine call the server makes is a method of the ``Engine`` protocol, so the type checker
sees it, test stand-ins must implement it, and the real engine is checked against it here; no
server module looks an engine attribute up by name (``getattr``/``hasattr``), where a renamed
or missing method would silently take a fallback path.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine
from wyoming_cosyvoice3.server.engine_port import Engine

SERVER_DIR = Path(__file__).resolve().parents[1] / "wyoming_cosyvoice3" / "server"

LOOKUPS = frozenset({"getattr", "hasattr"})


def _mentions_engine(node: ast.expr) -> bool:
    """Whether a name or attribute in ``node`` contains "engine" (``engine``,
    ``runtime.loader.engine``, ``self._built_engine``...)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and "engine" in child.id.lower():
            return True
        if isinstance(child, ast.Attribute) and "engine" in child.attr.lower():
            return True
    return False


def engine_lookups(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: call`` of every ``getattr``/``hasattr`` call in ``source`` whose first
    argument mentions an engine."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) else "")
        if name in LOOKUPS and _mentions_engine(node.args[0]):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_lookups_on_an_engine() -> None:
    source = "\n".join([
        'f = getattr(engine, "frontend", None)',
        'close = getattr(self._built_engine, "close", None)',
        'split = builtins.getattr(runtime.loader.engine.frontend, "split_pieces")',
        'ok = hasattr(self.engine, "warm_up")',
        # not an engine: the wyoming server object and a generator
        'inner = getattr(self.server, "_server", None)',
        'close = getattr(work.iterator, "close", None)',
        'engine = getattr(settings, "engine_name")',  # only the result is called engine
    ])
    assert [line.split(":")[1] for line in engine_lookups(source)] == ["1", "2", "3", "4"]


def test_the_server_never_looks_up_engine_attributes_by_name() -> None:
    files = sorted(SERVER_DIR.rglob("*.py"))
    assert len(files) > 10  # the scan sees the server package
    found = [hit for path in files
             for hit in engine_lookups(path.read_text(encoding="utf-8"), str(path))]
    assert not found, "call the engine through the Engine protocol instead:\n" + "\n".join(found)


def _protocol_methods() -> list[str]:
    """The methods ``Engine`` names, its base protocols' included."""
    names: set[str] = set()
    for cls in Engine.__mro__:
        if cls is Engine or getattr(cls, "_is_protocol", False):
            names.update(name for name, value in vars(cls).items()
                         if not name.startswith("_") and inspect.isfunction(value))
    return sorted(names)


def test_the_protocol_names_the_calls_the_server_makes() -> None:
    assert {"prepare_voice", "synthesize", "warm_up", "release_voice_encoders", "close",
            "text_token_count", "plan_pieces"} <= set(_protocol_methods())


@pytest.mark.parametrize("name", _protocol_methods())
def test_the_real_engine_has_each_protocol_method(name: str) -> None:
    real = getattr(CosyVoice3Engine, name, None)
    assert callable(real), f"CosyVoice3Engine has no method {name}"
    expected = inspect.signature(getattr(Engine, name)).parameters
    actual = inspect.signature(real).parameters
    assert [(p.name, p.kind) for p in actual.values()] == [
        (p.name, p.kind) for p in expected.values()]
    # an argument the server may leave out has a default in the engine too
    assert [p.name for p in actual.values() if p.default is inspect.Parameter.empty] == [
        p.name for p in expected.values() if p.default is inspect.Parameter.empty]
