"""Small text helpers of the server's protocol module."""

from __future__ import annotations

from wyoming_cosyvoice3.server.protocol import first_line, short_repr


def test_first_line_summarises_a_multi_line_message() -> None:
    text = "\n  Model files are missing: tokenizer.json\n  - https://example/a\n  - b\n"
    assert first_line(text) == (
        "Model files are missing: tokenizer.json (details in the server log)"
    )


def test_first_line_keeps_a_single_line_and_cuts_long_ones() -> None:
    assert first_line("voice not found") == "voice not found"
    assert first_line("") == ""
    cut = first_line("x" * 500, max_chars=50)
    assert len(cut) == 50 and cut.endswith("...")


def test_short_repr_cuts_long_values() -> None:
    assert short_repr("abc") == "'abc'"
    cut = short_repr("y" * 1000, max_chars=20)
    assert len(cut) == 20 and cut.endswith("...")
