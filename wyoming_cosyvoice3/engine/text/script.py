"""Writing-system and language cues of a text: which script dominates, is it English.

Used twice: the normaliser picks its rules (Chinese clean-up, English number reading, or
digits kept), and the prompt builder falls back to cross-lingual mode when a voice's
transcript is written in another script than the text (spec section 4; the export's model
card reports a Mandarin prompt reading German at 25% WER in zero-shot mode, 2-5% cross-lingual).

Pure functions over ``str``; no state.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from typing import Literal

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


# --- English or not ----------------------------------------------------------------------
# Frequent function words that are (nearly) unique to one language. Words shared between
# English and another language ("in", "a", "an", "so", "was", "will", "on", "die") are left
# out so that they cannot tip the decision.
def _word_set(*groups: str) -> frozenset[str]:
    return frozenset(word for group in groups for word in group.split())


_ENGLISH_WORDS = _word_set(
    """the is are were been being it its it's this that these those of to and or at for with
    from by your you my we our he she they them his her their have has had does did not
    would can could should there here what which who when where how now today please all if
    then than but up out about into i i'm i've don't doesn't isn't aren't won't can't let's
    there's that's what's turned turning set timer been just currently on off"""
)
_OTHER_WORDS = _word_set(
    # German
    """der die das und ist nicht ein eine einer einen dem den des mit auf für zu von sich ich
    du er sie es wir ihr sind war wird werden auch noch nur oder aber wie bei im um grad
    uhr heute jetzt ist's beträgt wurde""",
    # French
    """ le la les un une des du et est sont dans pour avec sur pas ce cette il elle nous vous
    je qui que au aux c'est degrés aujourd'hui""",
    # Spanish / Italian / Portuguese
    """ el los las una y es son está en del por para con se lo al hoy grados il gli di della
    nel alla oggi gradi sono è não são uma hoje graus também""",
    # Dutch / Scandinavian / Polish
    """ het een van op te dat niet zijn met voor maar ook graden vandaag och är det som på av
    med jeg og ikke jest nie się że""",
)
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?")


def english_cues(text: str) -> tuple[int, int]:
    """(English function words, words of other European languages) in ``text``: the
    score :func:`is_english` decides on; every word with a letter outside ASCII (ä ö ü ß é
    ñ ç ...) counts for "other". Scores of consecutive texts add up (a stream's sentences)."""
    english = 0
    other = 0
    for match in _WORD.finditer(text):
        word = unicodedata.normalize("NFC", match.group(0)).lower().replace("’", "'")
        if word in _ENGLISH_WORDS:
            english += 1
        if word in _OTHER_WORDS or not word.isascii():
            other += 1
    return english, other


def is_english(text: str, language: str | None = None) -> bool:
    """Guess whether Latin-script text is English, from a stop-word score.

    English needs more English function words than function words of other European
    languages; every word with a letter outside ASCII (ä ö ü ß é ñ ç ...) counts for "other".
    With no cue either way, ``language`` (e.g. a voice's "en_US") decides; without it the
    answer is False, so digits stay digits (safe in every language).

    Args:
        text: text to classify (any script; only its words are looked at).
        language: optional BCP-47-like hint used only to break a tie of zero scores.
    """
    english, other = english_cues(text)
    if english == 0 and other == 0:
        return bool(language) and str(language).lower().startswith("en")
    return english > other
