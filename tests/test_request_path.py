"""DEVELOPMENT.md lists the files a one-shot request runs through, stage by stage, and the list
is what runs: the set is measured by ``tools/request_path.py`` (its docstring: the real server
in this process on the tiny model, preset ``balanced``, a profiler on every thread, the files in
which a function ran between a warm-up request's end and the measured request's
``audio-stop``), the expected set is the table of DEVELOPMENT.md's section "One request through
the code", parsed from the document, so the document and the code cannot drift apart. There is
no limit on the count: modules are cut by concept, and the table tells a newcomer where each
stage of a request lives.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from server_support import link_engine_cache

from tools.request_path import DEFAULT_TEXT, measure

ROOT = Path(__file__).resolve().parents[1]
DEVELOPMENT = ROOT / "DEVELOPMENT.md"
SECTION = "## One request through the code"
PACKAGE = "wyoming_cosyvoice3"
def documented_files(text: str) -> list[str]:
    """The table rows ``| n | `path` | role |`` of the section :data:`SECTION` of ``text``,
    as package paths (``wyoming_cosyvoice3/server/handler.py``), in the table's order.

    Raises AssertionError when the section is missing, empty or numbered out of order."""
    assert SECTION in text, f"DEVELOPMENT.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`([^`]+\.py)`\s*\|", body, flags=re.MULTILINE)
    assert rows, f"no file table in the section {SECTION!r}"
    numbers = [int(n) for n, _ in rows]
    assert numbers == list(range(1, len(rows) + 1)), f"table rows numbered {numbers}"
    return [f"{PACKAGE}/{path}" for _, path in rows]


def documented_count(text: str) -> int:
    """The bold ``**N files**`` the section states."""
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"\*\*(\d+) files\*\*", body)
    assert match, f"the section {SECTION!r} states no **N files** count"
    return int(match.group(1))


@pytest.fixture(scope="module")
def doc_text() -> str:
    return DEVELOPMENT.read_text(encoding="utf-8")


@pytest.fixture
async def request_path(tiny_model_dir: Path, tiny_engine_cache: Path,
                       tmp_path: Path) -> dict[str, Any]:
    """``tools/request_path.measure`` on the session's tiny model; the derived graphs come
    from (or go to) the session's shared engine cache."""
    data_dir = link_engine_cache(tmp_path / "data", tiny_engine_cache)
    return await measure(tiny_model_dir, data_dir, DEFAULT_TEXT)


def test_documented_table_parses(doc_text: str) -> None:
    files = documented_files(doc_text)
    assert len(files) == len(set(files)) == documented_count(doc_text)
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert missing == [], f"DEVELOPMENT.md lists files that do not exist: {missing}"


async def test_one_shot_request_runs_through_the_documented_files(
    request_path: dict[str, Any], doc_text: str,
) -> None:
    assert request_path["audio_chunks"] > 0
    ran = [item["file"] for item in request_path["files"]]
    assert request_path["count"] == len(ran) == len(set(ran))
    documented = documented_files(doc_text)
    assert set(ran) == set(documented), (
        f"ran but not in DEVELOPMENT.md: {sorted(set(ran) - set(documented))}; "
        f"in DEVELOPMENT.md but did not run: {sorted(set(documented) - set(ran))}")
