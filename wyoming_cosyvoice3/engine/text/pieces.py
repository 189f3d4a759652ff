"""Pieces: normalised text cut into the parts the LLM speaks one at a time (spec section 3).

Normalised text is cut after sentences into pieces of about 60-80 LLM text tokens, each piece
bounded (:func:`split_text`; upstream's ``split_paragraph`` never cuts a sentence without
punctuation). A response's first piece can also be cut shorter than a sentence
(:func:`split_first_clause`): when synthesis runs slower than playback, the first audio waits
for the first piece to be safe to play through, so a short first piece means early first
audio. Every loop of the splitting runs over a finite list or advances by at least one
character per step.

A mark between two digits never cuts ("21.5", "21,5", "3:45"): the normaliser finds its
sentences with :func:`cut_after_marks` too, so a number is never read as two.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .script import char_script

TokenCounter = Callable[[str], int]
"""Number of LLM text tokens of a string."""
HardCutter = Callable[[str, int], list[str]]
"""Cuts a string into consecutive parts of at most the given number of tokens."""


@dataclass(frozen=True)
class PlannedPiece:
    """One piece of a text as the engine will speak it (``CosyVoice3Engine.plan_pieces``).

    Attributes:
        text: the normalised piece, as :func:`split_text` returns it.
        text_tokens: its number of LLM text tokens (as user text).
    """

    text: str
    text_tokens: int


MorePieces = Callable[[], Sequence[PlannedPiece]]
"""Asked by a running request for the pieces to speak after those it has
(``CosyVoice3Engine.synthesize``'s ``more``); an empty sequence ends the request."""

SENTENCE_MARKS = frozenset("。？！；：、….?!;:।؟۔")
"""Sentence ends: upstream's zh and en sets, plus the ellipsis, danda and Arabic marks."""
CLAUSE_MARKS = frozenset(",，、–—")
"""Second-level cut points for sentences that are too long."""
FIRST_CLAUSE_MARKS = frozenset(",;:，、；：–—")
"""Clause ends where a first piece may be cut: commas, semicolons, colons, dashes (Latin and
CJK full-width forms)."""
CONJUNCTIONS = frozenset({
    "and", "but", "or", "so", "because", "while", "whereas", "although", "though", "which",
    "when", "then", "und", "aber", "oder", "weil", "denn", "et", "mais", "y", "pero", "e", "ma",
})
"""Words a clause may start with (English, German, French, Spanish, Italian): with no clause
mark in reach, a first piece is cut before one of them (``"The lights are off | and the door
is locked."``)."""
_CLOSERS = frozenset("\"'”’)）」』»】]>")
_ASCII_MARKS = frozenset(".?!;:,")
_CJK = frozenset({"han", "kana", "hangul"})
_WORD_SPLIT = re.compile(r"\s*\S+")


def is_speakable(text: str) -> bool:
    """True when the text holds at least one letter or digit (Unicode categories L*, N*)."""
    return any(unicodedata.category(c)[0] in "LN" for c in text)


_GERMAN_ORDINAL = re.compile(
    r"\b(?:im|am|vom|zum|beim|zur|der|die|das|den|dem|des)\s\d{1,3}$", re.IGNORECASE)


def is_ordinal_dot(before: str) -> bool:
    """True when a "." after ``before`` marks a German ordinal ("im 2. Stock", "am 5.
    Dezember"), not a sentence end: the number and its noun are read together."""
    return _GERMAN_ORDINAL.search(before[-12:]) is not None


def _is_cut(text: str, i: int, marks: frozenset[str]) -> bool:
    char = text[i]
    if char not in marks:
        return False
    if char not in _ASCII_MARKS:
        return True
    before = text[i - 1] if i > 0 else " "
    after = text[i + 1] if i + 1 < len(text) else " "
    if before.isdigit() and (after.isdigit() or after in "ºª"):  # 21.5, 2.º (Spanish 2nd)
        return False
    if char == "." and before.isdigit() and is_ordinal_dot(text[:i]):
        return False
    return not (after.isascii() and after.isalnum())


def cut_after_marks(text: str, marks: frozenset[str]) -> list[str]:
    """Consecutive segments of ``text``, each ending after a run of marks and closing quotes.

    ``"".join(result) == text`` always holds.
    """
    segments: list[str] = []
    start = 0
    i = 0
    size = len(text)
    while i < size:
        if _is_cut(text, i, marks):
            end = i + 1
            while end < size and (text[end] in marks or text[end] in _CLOSERS):
                end += 1
            segments.append(text[start:end])
            start = i = end
        else:
            i += 1
    if start < size:
        segments.append(text[start:])
    return segments


MIN_CLAUSE_TOKENS = 6
"""Shortest part, in text tokens, that a cut before a conjunction may leave (a short clause of
about five words): "and" or "or" before a shorter tail usually joins two nouns ("the living
room and the kitchen"), not two clauses."""


def _conjunction_halves(clause: str, count: TokenCounter) -> list[tuple[str, int]] | None:
    """``clause`` cut once before a :data:`CONJUNCTIONS` word, as evenly as the words allow
    (both parts at least :data:`MIN_CLAUSE_TOKENS`); the head ends in a comma so that it is
    read as a clause, not as a sentence of its own. None when there is no such word."""
    best: tuple[int, list[tuple[str, int]]] | None = None
    for match in re.finditer(r"(?<=\s)(\w+)\b", clause):
        if match.group(1).lower() not in CONJUNCTIONS:
            continue
        head, tail = clause[:match.start()].rstrip() + ",", clause[match.start():]
        head_tokens, tail_tokens = count(head), count(tail)
        if min(head_tokens, tail_tokens) < MIN_CLAUSE_TOKENS:
            continue
        longer = max(head_tokens, tail_tokens)
        if best is None or longer < best[0]:
            best = (longer, [(head + " ", head_tokens), (tail, tail_tokens)])
    return None if best is None else best[1]


def _fit(
    segment: str, count: TokenCounter, cut: HardCutter, max_tokens: int, clause_max_tokens: int
) -> list[tuple[str, int]]:
    """Units of at most ``max_tokens``: a longer segment is cut after its commas; a clause
    still longer is cut once before a conjunction when it is at most ``clause_max_tokens``
    (>= ``max_tokens``) long, else before blanks, then hard."""
    tokens = count(segment)
    if tokens <= max_tokens:
        return [(segment, tokens)]
    units: list[tuple[str, int]] = []
    for clause in cut_after_marks(segment, CLAUSE_MARKS):
        clause_tokens = count(clause)
        if clause_tokens <= max_tokens:
            units.append((clause, clause_tokens))
            continue
        if clause_tokens <= clause_max_tokens:
            units.extend(_conjunction_halves(clause, count) or [(clause, clause_tokens)])
            continue
        for word in _WORD_SPLIT.findall(clause) or [clause]:
            word_tokens = count(word)
            if word_tokens <= clause_max_tokens:
                units.append((word, word_tokens))
                continue
            units.extend((part, count(part)) for part in cut(word, clause_max_tokens))
    return units


def _pack(
    units: list[tuple[str, int]], max_tokens: int, merge_tokens: int
) -> list[tuple[str, int]]:
    pieces: list[tuple[str, int]] = []
    current, current_tokens = "", 0
    for text, tokens in units:
        if current and current_tokens + tokens > max_tokens and current_tokens >= merge_tokens:
            pieces.append((current, current_tokens))
            current, current_tokens = "", 0
        current += text
        current_tokens += tokens
    if current:
        if pieces and (current_tokens < merge_tokens or not is_speakable(current)):
            text, tokens = pieces[-1]
            pieces[-1] = (text + current, tokens + current_tokens)
        else:
            pieces.append((current, current_tokens))
    return pieces


def split_text(
    text: str,
    count: TokenCounter,
    cut: HardCutter,
    max_tokens: int = 80,
    merge_tokens: int = 20,
    clause_max_tokens: int | None = None,
) -> list[str]:
    """Split normalised text into pieces of about 60-80 LLM text tokens, one LLM pass each.

    Upstream (utils/frontend_utils.py ``split_paragraph``) cuts after sentence punctuation
    (zh: 。？！；：、.?!; en: .?!;:), keeps adding sentences while a piece is shorter than
    ``token_min_n`` = 60 tokens, and merges a tail shorter than ``merge_len`` = 20 tokens into the
    previous piece; a sentence without punctuation is never cut, so a long unpunctuated text
    becomes one huge piece. This module keeps the sentence rule and bounds every piece:

    1. cut after sentence punctuation (one set for all scripts; an ASCII mark counts only when
       no letter or digit follows it directly and it does not sit between two digits, so
       "21.5", "3:45", "z.B." and "example.com" stay whole);
    2. a sentence longer than ``max_tokens`` is cut after commas, then before blanks, then
       every ``max_tokens`` tokens (the fallback for long runs without blanks);
    3. consecutive units are packed greedily while the piece stays within ``max_tokens``;
       a piece shorter than ``merge_tokens`` always takes the next unit, and a tail shorter than
       ``merge_tokens`` joins the previous piece, so a piece holds at most about
       ``max_tokens + merge_tokens`` tokens;
    4. pieces with no letter or digit (punctuation, symbols, emoji only) are dropped
       (upstream ``is_only_punctuation``);
    5. a piece ending in a letter or digit gets a full stop ("。" after a CJK character, "."
       otherwise), as upstream adds one to a text without final punctuation: the LLM then
       ends the piece as a sentence.

    Args:
        text: normalised text (:func:`normalize_text`).
        count: token counter of the LLM tokenizer.
        cut: hard cutter by tokens, used only for runs longer than ``max_tokens`` with
            neither commas nor blanks.
        max_tokens: target upper size of a piece (upstream ``token_max_n`` = 80).
        merge_tokens: pieces and tails shorter than this are merged (upstream ``merge_len``).
        clause_max_tokens: a clause (cut after commas) longer than ``max_tokens`` but at
            most this long is cut only before a conjunction (or stays whole); longer ones are
            cut between words. ``None`` = ``max_tokens``. A bound of a few seconds of speech
            (sentence pieces) keeps phrases whole this way: a cut between any two words
            would break one, and the piece would end in an added full stop.

    Returns:
        Stripped pieces, each holding a letter or digit, in text order; ``[]`` when nothing
        is speakable.
    """
    if max_tokens < 1 or merge_tokens < 0:
        raise ValueError(f"max_tokens must be >= 1 and merge_tokens >= 0, got {max_tokens}, "
                         f"{merge_tokens}")
    if not is_speakable(text):
        return []
    clause_max = max_tokens if clause_max_tokens is None else max(clause_max_tokens, max_tokens)
    units: list[tuple[str, int]] = []
    for sentence in cut_after_marks(text, SENTENCE_MARKS):
        units.extend(_fit(sentence, count, cut, max_tokens, clause_max))
    pieces = (piece.strip() for piece, _ in _pack(units, max_tokens, merge_tokens))
    return [_with_full_stop(piece) for piece in pieces if is_speakable(piece)]


def _with_full_stop(piece: str) -> str:
    last = piece[-1]
    if unicodedata.category(last)[0] not in "LN":
        return piece
    return piece + ("。" if char_script(last) in ("han", "kana") else ".")


def split_first_clause(
    text: str, max_s: float, min_s: float, speech_s: Callable[[str], float]
) -> tuple[str, str]:
    """Cut a short first piece off ``text``.

    When the first sentence (up to the first :data:`SENTENCE_MARKS` cut) has at most ``max_s``
    of expected speech, the head is the leading whole sentences within ``max_s`` and the rest
    is the text after them, provided the rest has at least ``min_s`` (else nothing is cut):
    the engine would otherwise pack a short first sentence with the next ones into one piece
    that cannot play through by the first-audio limit. Otherwise the head is the longest
    prefix of the first sentence within ``max_s`` and at least ``min_s`` that ends, in this
    order of preference: after a
    :data:`FIRST_CLAUSE_MARKS` run, before a :data:`CONJUNCTIONS` word, before a blank,
    between two CJK characters (a Chinese or Japanese sentence without a comma); a run of
    Latin letters is never cut inside (it may be a name or an address). The rest of the
    sentence must keep at least ``min_s`` too, so a cut never leaves a one-word tail.

    Args:
        text: the text of a response's first engine request (speech text).
        max_s: longest expected speech of the head, seconds.
        min_s: shortest expected speech of the head and of the rest of the sentence, seconds.
        speech_s: expected seconds of speech of a string (the server's
            ``preroll.expected_speech_s``).

    Returns:
        ``(head, rest)``, both stripped, ``head + " " + rest`` reading as ``text``;
        ``(text.strip(), "")`` when nothing is cut.

    Raises:
        ValueError: ``min_s`` < 0 or ``max_s`` < ``min_s``.
    """
    if min_s < 0 or max_s < min_s:
        raise ValueError(f"need 0 <= min_s <= max_s, got {min_s}, {max_s}")
    stripped = text.strip()
    sentences = cut_after_marks(stripped, SENTENCE_MARKS)
    first = sentences[0] if sentences else ""
    if speech_s(first) <= max_s:
        end = len(first)
        for sentence in sentences[1:]:
            if speech_s(stripped[:end + len(sentence)]) > max_s:
                break
            end += len(sentence)
        head, rest = stripped[:end].strip(), stripped[end:].strip()
        if rest and head and speech_s(rest) >= min_s:
            return head, rest
        return stripped, ""
    # candidate cut positions in ``first``, by preference; each must leave both parts long
    # enough (speech_s is monotonic in the prefix, so the last fitting cut is the longest)
    clause_cuts = []
    position = 0
    for segment in cut_after_marks(first, FIRST_CLAUSE_MARKS)[:-1]:
        position += len(segment)
        clause_cuts.append(position)
    conjunction_cuts = [m.start() for m in re.finditer(r"(?<=\s)(\w+)\b", first)
                        if m.group(1).lower() in CONJUNCTIONS]
    blank_cuts = [m.start() for m in re.finditer(r"\s+", first)]
    cjk_cuts = [c for c in range(1, len(first))
                if char_script(first[c - 1]) in _CJK and char_script(first[c]) in _CJK]
    for cuts in (clause_cuts, conjunction_cuts, blank_cuts, cjk_cuts):
        fitting = [c for c in cuts
                   if min_s <= speech_s(first[:c]) <= max_s and speech_s(first[c:]) >= min_s]
        if fitting:
            cut = max(fitting)
            return first[:cut].strip(), stripped[cut:].strip()
    return stripped, ""
