"""Every test the README names as backing a claim exists (issue 16): a renamed or deleted test
must not leave a claim pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"`(?:tests/)?(test_\w+\.py)?(?:::(test_\w+))?`")


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """``(file, test or None)`` for each `test_x.py`, `test_x.py::test_y` and `::test_y`
    (the latter in the file named last before it)."""
    found: list[tuple[str, str | None]] = []
    current: str | None = None
    for match in REFERENCE.finditer(text):
        file, test = match.groups()
        if file is None and test is None:
            continue
        current = file or current
        assert current is not None, f"`::{test}` without a file before it"
        found.append((current, test))
    return found


def test_the_parser_attributes_bare_test_names_to_the_last_file() -> None:
    text = "`test_a.py::test_one`, `::test_two` and `tests/test_b.py`, `::test_three`"
    assert named_tests(text) == [("test_a.py", "test_one"), ("test_a.py", "test_two"),
                                 ("test_b.py", None), ("test_b.py", "test_three")]


def test_every_test_the_readme_names_exists() -> None:
    references = named_tests((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(references) > 40
    missing = []
    for file, test in references:
        path = ROOT / "tests" / file
        if not path.is_file():
            missing.append(file)
        elif test and not re.search(rf"^(async )?def {test}\(", path.read_text(encoding="utf-8"),
                                    re.MULTILINE):
            missing.append(f"{file}::{test}")
    assert missing == []
