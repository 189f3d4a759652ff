"""Writing systems: which script a character belongs to and which script a text is
mostly written in.

The text front end picks its rules by script (Han without kana: Chinese, kana: Japanese, Hangul:
Korean, Cyrillic: Russian, Latin: a vote between the Latin-script languages,
:mod:`.normalize`); the prompt builder compares the scripts of a voice's transcript and of a
piece (:mod:`.frontend`); the piece splitter adds a full-width stop after a CJK character
(:mod:`.pieces`); the markdown pass drops emoji (:mod:`.markdown`).
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

_EMOJI_RANGES: tuple[tuple[int, int], ...] = (
    (0x1F000, 0x1FAFF),  # mahjong .. symbols and pictographs extended-A, flags, skin tones
    (0x2600, 0x27BF),  # miscellaneous symbols, dingbats
    (0x2B00, 0x2BFF),  # miscellaneous symbols and arrows (stars, arrows)
    (0x231A, 0x231B),  # watch, hourglass
    (0x23E9, 0x23FA),  # media control symbols
    (0xFE00, 0xFE0F),  # variation selectors
    (0x20E3, 0x20E3),  # combining enclosing keycap
    (0xE0000, 0xE007F),  # tag characters (flag sequences)
    (0xE0100, 0xE01EF),  # variation selectors supplement
)


def is_emoji(code: int) -> bool:
    """True for a code point of the emoji / pictograph ranges (incl. variation selectors)."""
    return any(first <= code <= last for first, last in _EMOJI_RANGES)




Script = Literal[
    "han", "kana", "hangul", "latin", "cyrillic", "greek", "arabic", "hebrew", "thai",
    "devanagari", "other", "none",
]
"""Script names returned by :func:`dominant_script`; ``none`` means the text has no letters."""

# (first, last, script) code point ranges of letters, checked in order.
_RANGES: tuple[tuple[int, int, Script], ...] = (
    (0x3040, 0x30FF, "kana"),  # hiragana + katakana
    (0x31F0, 0x31FF, "kana"),  # katakana phonetic extensions
    (0xFF66, 0xFF9F, "kana"),  # half-width katakana
    (0x3400, 0x4DBF, "han"),  # CJK extension A
    (0x4E00, 0x9FFF, "han"),  # CJK unified ideographs
    (0xF900, 0xFAFF, "han"),  # compatibility ideographs
    (0x20000, 0x323AF, "han"),  # extensions B..H
    (0x1100, 0x11FF, "hangul"),
    (0x3130, 0x318F, "hangul"),
    (0xAC00, 0xD7AF, "hangul"),
    (0x0400, 0x052F, "cyrillic"),
    (0x1C80, 0x1C8F, "cyrillic"),
    (0x0370, 0x03FF, "greek"),
    (0x1F00, 0x1FFF, "greek"),
    (0x0590, 0x05FF, "hebrew"),
    (0x0600, 0x06FF, "arabic"),
    (0x0750, 0x077F, "arabic"),
    (0x0E00, 0x0E7F, "thai"),
    (0x0900, 0x097F, "devanagari"),
    (0x0041, 0x024F, "latin"),  # basic Latin .. Latin extended-B (letters only, see below)
    (0x1E00, 0x1EFF, "latin"),  # Latin extended additional (Vietnamese)
    (0xFF21, 0xFF5A, "latin"),  # full-width Latin letters
)

# Scripts written without blanks between words: one character counts as one unit.
_CHARACTER_SCRIPTS = frozenset({"han", "kana", "hangul", "thai"})


def char_script(char: str) -> Script:
    """Script of one character; ``none`` for non-letters (digits, punctuation, symbols)."""
    if not char.isalpha():
        return "none"
    code = ord(char)
    for first, last, script in _RANGES:
        if first <= code <= last:
            return script
    return "other"


def script_units(text: str) -> Counter[str]:
    """Count comparable units per script: one per CJK/Thai character, one per word otherwise.

    A Chinese character carries about as much speech as an English word, so counting
    letters would let a few Latin words outweigh a long Chinese sentence.
    """
    counts: Counter[str] = Counter()
    previous: Script = "none"
    for char in text:
        script = char_script(char)
        if script == "none":
            previous = "none"
            continue
        if script in _CHARACTER_SCRIPTS or script != previous:
            counts[script] += 1
        previous = script
    return counts


def dominant_script(text: str) -> Script:
    """The script with most units (:func:`script_units`); Japanese Han+Kana counts as ``kana``.

    Returns ``none`` when the text has no letters. Ties go to the script seen first.
    """
    counts = script_units(text)
    if not counts:
        return "none"
    if counts.get("kana", 0) > 0:
        # Japanese mixes kanji and kana: any kana marks the Han characters as Japanese.
        counts["kana"] += counts.pop("han", 0)
    best, _ = counts.most_common(1)[0]
    return best  # type: ignore[return-value]


def has_cjk(text: str) -> bool:
    """True when the text holds a Han ideograph or kana (upstream ``contains_chinese``,
    utils/frontend_utils.py, checks U+4E00..U+9FFF only; kana and extensions added here)."""
    return any(char_script(c) in ("han", "kana") for c in text)
