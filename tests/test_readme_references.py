"""Every test the documents name as backing a claim exists: a renamed or deleted test
must not leave a claim pointing at nothing. The README is for Home Assistant users and names few
tests; DEVELOPMENT.md lists which tests back the README's statements."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "DEVELOPMENT.md")
REFERENCE = re.compile(r"`(?:(?:tests/)?(test_\w+\.py)(?:::(test_\w+))?|(?:::)?(test_\w+))`")


def named_tests(text: str) -> list[tuple[str | None, str | None]]:
    """``(file, test or None)`` for each `test_x.py`, `test_x.py::test_y`, `::test_y` and bare
    `test_y`; the last two belong to the file named last before them in the same paragraph
    (file None: no file named there, the test may be in any test file)."""
    found: list[tuple[str | None, str | None]] = []
    for paragraph in re.split(r"\n\s*\n", text):
        current: str | None = None
        for match in REFERENCE.finditer(paragraph):
            file, test, bare = match.groups()
            current = file or current
            found.append((current, test or bare))
    return found


def missing_tests(text: str, tests_dir: Path = ROOT / "tests") -> list[str]:
    """The references of ``text`` (see :func:`named_tests`) naming no file or test there."""
    sources = {path.name: path.read_text(encoding="utf-8")
               for path in sorted(tests_dir.glob("test_*.py"))}
    missing = []
    for file, test in named_tests(text):
        if file is not None and file not in sources:
            missing.append(file)
            continue
        pattern = re.compile(rf"^(async )?def {test}\(", re.MULTILINE)
        where = [sources[file]] if file is not None else list(sources.values())
        if test and not any(pattern.search(source) for source in where):
            missing.append(f"{file or 'tests'}::{test}")
    return missing


def test_the_parser_attributes_bare_test_names_to_the_last_file() -> None:
    text = ("`test_a.py::test_one`, `::test_two` and `tests/test_b.py`, `test_three`\n\n"
            "A new paragraph: `test_four`, `::test_five`.")
    assert named_tests(text) == [("test_a.py", "test_one"), ("test_a.py", "test_two"),
                                 ("test_b.py", None), ("test_b.py", "test_three"),
                                 (None, "test_four"), (None, "test_five")]


def test_a_wrong_bare_test_name_is_caught(tmp_path: Path) -> None:
    """A copy of the README with wrong bare names added: each is reported, nothing else."""
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text(encoding="utf-8") + (
        "\n\n(`test_server_download.py::test_missing_files_without_network`,"
        " `test_no_such_test_anywhere`, `test_broken_catalog_entry`).\n\n"
        "Elsewhere: `test_broken_catalog_entry`, `test_nor_this_one`.\n"), encoding="utf-8")
    assert missing_tests(readme.read_text(encoding="utf-8")) == [
        "test_server_download.py::test_no_such_test_anywhere",
        "test_server_download.py::test_broken_catalog_entry",  # lives in another file
        "tests::test_nor_this_one",
    ]


def test_every_test_the_documents_name_exists() -> None:
    texts = {name: (ROOT / name).read_text(encoding="utf-8") for name in DOCUMENTS}
    assert sum(len(named_tests(text)) for text in texts.values()) > 40
    assert any(match.group(3) for match in REFERENCE.finditer(texts["DEVELOPMENT.md"]))
    for name, text in texts.items():
        assert missing_tests(text) == [], name
