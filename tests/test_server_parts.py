"""The server is three parts wired together: the model loader, the voice table and the
synthesis runner; the voice table is the only writer of the voices.

A second writer of the table is what let a reload race a start-up preparation before, so the
rule is checked on the source: an AST scan of ``wyoming_cosyvoice3/server`` finds every
assignment to, deletion from or mutating call on the voices mapping (and every write of a
voice slot's fields) outside ``server/voice_table.py``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from wyoming_cosyvoice3.server.model_loader import ModelLoader
from wyoming_cosyvoice3.server.runner import SynthesisRunner
from wyoming_cosyvoice3.server.runtime import ServerRuntime
from wyoming_cosyvoice3.server.settings import Settings
from wyoming_cosyvoice3.server.voice_table import VoiceSlot, VoiceTable

SERVER_DIR = Path(__file__).resolve().parents[1] / "wyoming_cosyvoice3" / "server"
OWNER = SERVER_DIR / "voice_table.py"

TABLE_NAMES = frozenset({"voices", "_voices", "_slots"})
"""Names the voices mapping goes by (the table as an attribute, its private dict)."""
SLOT_FIELDS = frozenset({"entry", "prompt", "problem"})
"""A :class:`VoiceSlot`'s fields: changing one in place changes the table as well."""
MUTATORS = frozenset({"update", "pop", "popitem", "clear", "setdefault", "__setitem__",
                      "__delitem__", "prepare_all", "reload", "drop"})
"""Calls that change a mapping, and the table's own writing methods (the loader and the
voice page call those: they are the table's writes, not a second writer's)."""
ALLOWED_CALLERS = {"prepare_all": {"model_loader.py"}, "reload": {"web/admin.py"},
                   "drop": {"web/admin.py"}}
"""Who may ask the table to change itself: the loader at start, the voice page after an
edit."""


def _is_table(node: ast.expr) -> bool:
    """Whether ``node`` names the voices mapping (``voices``, ``runtime.voices``,
    ``self._slots``...)."""
    if isinstance(node, ast.Name):
        return node.id in TABLE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in TABLE_NAMES


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def _wiring(node: ast.AST, function: str | None) -> bool:
    """``self.voices = voices`` / ``= VoiceTable(...)`` in an ``__init__``: holding the
    table, not writing it."""
    if function != "__init__" or not isinstance(node, (ast.Assign, ast.AnnAssign)):
        return False
    value = node.value
    return isinstance(value, ast.Name) or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
        and value.func.id == "VoiceTable")


def table_writes(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: code`` of every write of the voice table in ``source`` (see the module
    docstring), the writing calls ``ALLOWED_CALLERS`` permits to ``filename`` excepted."""
    found: list[str] = []

    def report(node: ast.AST) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {ast.unparse(node)}")

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and target.attr in TABLE_NAMES:
                if not _wiring(node, function):
                    report(node)
            elif ((isinstance(target, ast.Attribute) and target.attr in SLOT_FIELDS)
                  or (isinstance(target, ast.Subscript) and _is_table(target.value))):
                report(node)  # a slot's field, or an entry of the mapping
        if isinstance(node, ast.Attribute) and node.attr == "_slots":
            report(node)  # the table's own dict: nobody else reaches it
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in MUTATORS
                    and _is_table(func.value)
                    and not any(filename.endswith(allowed)
                                for allowed in ALLOWED_CALLERS.get(func.attr, ()))):
                report(node)
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in TABLE_NAMES | SLOT_FIELDS):
                report(node)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source, filename), None)
    return found


def test_the_scan_finds_writes_of_the_table() -> None:
    source = "\n".join([
        # what the voice page did before the table had an owner
        "self.runtime.voices = {n: s for n, s in self.runtime.voices.items() if n != name}",
        "runtime.voices = await asyncio.to_thread(build)",
        "runtime.voices[name] = slot",
        "del self.runtime.voices[name]",
        "runtime.voices.update(new)",
        "slot.entry, slot.prompt, slot.problem = done.entry, done.prompt, done.problem",
        "table._slots.clear()",
        'setattr(runtime, "voices", {})',
        "runtime.voices.prepare_all(engine, model_dir)",  # only the loader prepares
        # reading, and holding the table: not writes
        "slots = list(runtime.voices.values())",
        "slot = self.voices.get(name)",
        "voices = [TtsVoice(name=n) for n in names]",
        "class Admin:\n    def __init__(self, voices):\n        self.voices = voices",
    ])
    lines = [int(hit.split(":")[1]) for hit in table_writes(source, "web/page.py")]
    assert sorted(set(lines)) == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_the_voice_table_is_the_only_writer_of_the_voices() -> None:
    files = sorted(SERVER_DIR.rglob("*.py"))
    assert OWNER in files and len(files) > 10  # the scan sees the server package
    found = [hit for path in files if path != OWNER
             for hit in table_writes(path.read_text(encoding="utf-8"),
                                     path.relative_to(SERVER_DIR).as_posix())]
    assert not found, ("change the voices through server/voice_table.py (prepare_all, "
                       "reload, drop) only:\n" + "\n".join(found))
    # the owner's own writes are seen by the same scan (it is not blind to them)
    assert table_writes(OWNER.read_text(encoding="utf-8"), "voice_table.py")


def test_the_three_parts_do_not_inherit_from_each_other() -> None:
    parts = (ModelLoader, VoiceTable, SynthesisRunner, ServerRuntime)
    for part in parts:
        others = [other.__name__ for other in parts if other is not part
                  and issubclass(part, other)]
        assert others == [], f"{part.__name__} inherits from {others}"


def test_the_runner_gets_the_engine_through_a_call(tmp_path: Path) -> None:
    """The runner is handed the loader's ``require_ready``, not the loader."""
    assert "engine" in inspect.signature(SynthesisRunner).parameters
    runtime = ServerRuntime(Settings(model_dir=tmp_path, data_dirs=(tmp_path,),
                                     warm_up=False))
    try:
        assert runtime.runner._engine == runtime.loader.require_ready
        assert isinstance(runtime.voices, VoiceTable)
        assert all(isinstance(slot, VoiceSlot) for slot in runtime.voices.values())
    finally:
        runtime.shutdown()
