"""Silent-run filter and decode length limits (engine/llm/decoder.py, its sampling section)."""

from __future__ import annotations

import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.llm.decoder import SilentRunFilter, decode_limits


def test_silent_run_filter_exact_output() -> None:
    tokens = [
        1, 2, 28, 29, 55, 248, 494,  # seven different silent tokens: the last two dropped
        7,                           # speech resets the run
        1, 1, 1, 1, 1, 1,            # six equal silent tokens: the sixth dropped
        100, 2241, 2242,             # reset, then a run of two
    ]  # fmt: skip
    expected = [1, 2, 28, 29, 55, 7, 1, 1, 1, 1, 1, 100, 2241, 2242]
    assert SilentRunFilter().filter(tokens) == expected


def test_silent_run_filter_state_is_per_instance_and_continues() -> None:
    first = SilentRunFilter()
    assert first.filter([2322] * 4) == [2322] * 4
    # the run continues across calls on the same instance: only one more gets through
    assert first.filter([2323, 2323, 2323]) == [2323]
    # a fresh instance starts a fresh run
    assert SilentRunFilter().filter([2323, 2323, 2323]) == [2323, 2323, 2323]


def test_silent_run_filter_never_drops_speech_tokens() -> None:
    speech = [t for t in range(0, 3000, 7) if t not in C.SILENT_TOKENS]
    assert SilentRunFilter().filter(speech) == speech


@pytest.mark.parametrize("n", [1, 7, 33])
def test_decode_limits(n: int) -> None:
    assert decode_limits(n) == (2 * n, 20 * n)


def test_decode_limits_rejects_negative() -> None:
    with pytest.raises(ValueError, match="n_tts_text_tokens"):
        decode_limits(-1)
