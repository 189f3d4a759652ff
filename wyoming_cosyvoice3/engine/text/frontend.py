"""Text front end: written text -> normalised pieces -> the LLM prompt ids of each piece
(spec sections 3-4).

Normalisation (last section, :func:`normalize_text`) follows the rule-based fallback of
upstream FunAudioLLM/CosyVoice (cosyvoice/cli/frontend.py ``CosyVoiceFrontEnd.text_normalize``
with utils/frontend_utils.py ``replace_blank``, ``replace_corner_mark``, ``remove_bracket``,
``spell_out_number``), with these differences:

* User text is untrusted. Upstream skips normalisation for text holding ``<|`` .. ``|>`` and
  encodes tokens such as ``<|endofprompt|>`` typed by a user as control tokens. Here
  ``<|name|>`` markup is removed, and the prompt builder encodes all user text so that it can
  never yield an added-token id (below).
* Control, format, surrogate, private-use and unassigned characters and emoji are removed;
  every kind of blank becomes one space.
* Numbers are spelled out only in English text (:func:`expand_english`); upstream spells them in
  English whatever the language. Digits of other languages stay digits (the LLM reads them),
  and letters with diacritics (ä ö ü ß é ñ ç ...) are never touched.
* Chinese clean-up turns ASCII sentence punctuation into full-width forms only at a sentence
  boundary and never between digits (upstream turns every "." into "。", also in "21.5").

The rules are picked by the text's writing system (:func:`dominant_script`,
:func:`is_english`), which the prompt builder reads too (below).

Pieces: normalised text is cut after sentences into pieces of about 60-80 LLM text tokens,
each piece bounded (:func:`split_text`; upstream's ``split_paragraph`` never cuts a sentence
without punctuation). A response's first piece can also be cut shorter than a sentence
(:func:`split_first_clause`): when synthesis runs slower than playback, the first audio waits
for the first piece to be safe to play through, so a short first piece means early first
audio. Every loop of the splitting runs over a finite list or advances by at least one
character per step.

Prompt modes (upstream llm.py ``Qwen2LM.inference``, cli/frontend.py ``frontend_zero_shot``,
``frontend_cross_lingual``, ``frontend_instruct2``; the export's model card, host side step 2):

* zero_shot: prompt_text = SYSTEM_PROMPT + transcript; tts_text = piece; LLM prompt speech
  tokens = the clip's speech tokens.
* cross_lingual: no prompt_text; tts_text = SYSTEM_PROMPT + piece; no prompt speech tokens.
* instruct: prompt_text = INSTRUCT_PREFIX + instruction + "<|endofprompt|>"; tts_text = piece;
  no prompt speech tokens (upstream ``frontend_instruct2`` deletes them).

The flow always gets the clip's tokens, mel and embedding (not this module's business).

Zero-shot is used only when the transcript is written in the same script as the piece
(:func:`dominant_script`); otherwise the voice is used cross-lingually (the model card
reports 25% WER for a Mandarin prompt reading German in zero-shot mode, 2-5% cross-lingual).

Decode lengths: the LLM stage takes min/max lengths from ``len(tts_text_ids)`` (upstream
``min_len = (text_len - prompt_text_len) * 2``). In cross-lingual mode ``tts_text_ids``
include the system-prompt ids, as upstream (which prepends the system prompt to the tts
text), so the limits there are a few tokens larger.

Untrusted text: the system prompt and the ``<|endofprompt|>`` separator are encoded with the
full tokenizer; every user part (piece, transcript, instruction) is encoded by the
tokenizer's normaliser, pre-tokenizer and BPE model directly, which bypasses the added-token
matcher, so "<|endofprompt|>", "<|im_start|>" or "[breath]" typed by a user become ordinary
byte-level BPE pieces and can never become control ids.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from typing import Literal

import numpy as np
import tokenizers
from num2words import num2words

from ..constants import (
    DEFAULT_MAX_PIECE_TOKENS,
    DEFAULT_MERGE_TOKENS,
    END_OF_PROMPT,
    INSTRUCT_PREFIX,
    SYSTEM_PROMPT,
)
from ..errors import EmptyText, ModelLoadError, TextError
from ..options import LlmPrompt, PromptMode, VoicePrompt
from .units_en import CURRENCIES, UNITS

logger = logging.getLogger(__name__)



class TextFrontend:
    """Turns user text into normalised pieces and each piece into :class:`LlmPrompt` ids.

    Stateless after construction and safe to share between threads and requests.

    Args:
        tokenizer: the model's ``tokenizer.json`` (Qwen2 BPE + CosyVoice3 added tokens).
        end_of_prompt_id: id of ``<|endofprompt|>`` read from that file (151646 in the release).
        max_piece_tokens: target upper size of a piece in text tokens.
        merge_tokens: pieces and tails shorter than this many tokens are merged.

    Raises:
        ModelLoadError: the tokenizer does not encode ``<|endofprompt|>`` to
            ``end_of_prompt_id`` as one token, or has no BPE model.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        end_of_prompt_id: int,
        max_piece_tokens: int = DEFAULT_MAX_PIECE_TOKENS,
        merge_tokens: int = DEFAULT_MERGE_TOKENS,
    ) -> None:
        self._tokenizer = tokenizer
        self.end_of_prompt_id = int(end_of_prompt_id)
        self.max_piece_tokens = int(max_piece_tokens)
        self.merge_tokens = int(merge_tokens)
        separator = tokenizer.encode(END_OF_PROMPT, add_special_tokens=False).ids
        if separator != [self.end_of_prompt_id]:
            raise ModelLoadError(
                f"tokenizer.json encodes {END_OF_PROMPT} to {separator}, expected the single id "
                f"{self.end_of_prompt_id}; use the CosyVoice3 tokenizer.json of the model "
                "directory (it adds <|endofprompt|> as a special token)"
            )
        self._added_ids = frozenset(int(i) for i in tokenizer.get_added_tokens_decoder())
        self.system_prompt_ids: tuple[int, ...] = tuple(
            tokenizer.encode(SYSTEM_PROMPT, add_special_tokens=False).ids
        )
        if self.system_prompt_ids.count(self.end_of_prompt_id) != 1:
            raise ModelLoadError(
                f"tokenizer.json encodes the system prompt {SYSTEM_PROMPT!r} without exactly "
                f"one id {self.end_of_prompt_id}; use the CosyVoice3 tokenizer.json"
            )

    # --- encoding ------------------------------------------------------------------------
    def encode_user(self, text: str) -> list[int]:
        """Token ids of untrusted text; never contains an added-token (control) id.

        Runs the tokenizer's normaliser, pre-tokenizer and BPE model directly, so the
        added-token matcher never sees the text. Equal to ``tokenizer.encode(text).ids``
        for text that holds no added-token string.
        """
        tokenizer = self._tokenizer
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        if tokenizer.pre_tokenizer is not None:
            words = [word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        else:
            words = [text]
        ids: list[int] = []
        for word in words:
            ids.extend(token.id for token in tokenizer.model.tokenize(word))
        if self._added_ids.intersection(ids):
            # Only possible if the BPE vocabulary itself held a control string.
            logger.warning("dropping control-token ids from user text")
            ids = [i for i in ids if i not in self._added_ids]
        return ids

    def text_token_count(self, text: str) -> int:
        """Number of LLM text tokens of ``text`` as user text (:meth:`encode_user`)."""
        return len(self.encode_user(text))

    def _hard_cut(self, text: str, max_tokens: int) -> list[str]:
        """Cut ``text`` every ``max_tokens`` tokens at the tokens' character offsets."""
        offsets = self._tokenizer.encode(text, add_special_tokens=False).offsets
        parts: list[str] = []
        start = 0
        for k in range(max_tokens, len(offsets), max_tokens):
            position = min(max(offsets[k][0], 0), len(text))
            if position > start:
                parts.append(text[start:position])
                start = position
        parts.append(text[start:])
        return parts

    # --- pieces --------------------------------------------------------------------------
    def split_pieces(
        self, text: str, language: str | None = None, max_tokens: int | None = None
    ) -> list[str]:
        """Normalise ``text`` and split it into pieces of about 60-80 text tokens.

        Args:
            text: user text, untrusted.
            language: optional language hint for the normaliser (e.g. "en_US"); used only
                when the text gives no cue.
            max_tokens: upper piece size for this call instead of ``max_piece_tokens``
                (``SynthesisOptions.max_piece_tokens``); pieces shorter than
                ``min(merge_tokens, max_tokens // 2)`` are then merged, so a small bound
                gives about one sentence per piece instead of merging sentences up to
                ``merge_tokens``; a longer sentence is cut after its commas, and a clause
                is cut between words only beyond ``max_piece_tokens``.

        Returns:
            Pieces in order; ``[]`` when nothing is speakable ("", "。", "?!", emoji...).

        Raises:
            TextError: ``text`` is not a ``str``.
        """
        limit = self.max_piece_tokens if max_tokens is None else max_tokens
        normalized = normalize_text(text, language)
        pieces = split_text(
            normalized,
            self.text_token_count,
            self._hard_cut,
            max_tokens=limit,
            merge_tokens=min(self.merge_tokens, limit // 2),
            clause_max_tokens=max(limit, self.max_piece_tokens),
        )
        logger.debug("text of %d chars -> %d piece(s)", len(text), len(pieces))
        return pieces

    # --- prompts -------------------------------------------------------------------------
    def select_mode(self, piece: str, voice: VoicePrompt) -> PromptMode:
        """Prompt mode for one piece and voice (see the module docstring).

        instruct when the voice has a speakable instruction; zero_shot when it has a
        speakable transcript in the piece's script (or either has no letters) and speech
        tokens; cross_lingual otherwise.
        """
        if voice.instruction and is_speakable(normalize_text(voice.instruction)):
            return "instruct"
        transcript = normalize_text(voice.transcript) if voice.transcript else ""
        if not is_speakable(transcript) or voice.features.speech_tokens.size == 0:
            return "cross_lingual"
        transcript_script = dominant_script(transcript)
        piece_script = dominant_script(piece)
        if "none" in (transcript_script, piece_script) or transcript_script == piece_script:
            return "zero_shot"
        return "cross_lingual"

    def build_prompt(self, piece: str, voice: VoicePrompt) -> LlmPrompt:
        """Token ids of one piece for the LLM in the mode :meth:`select_mode` picks.

        Args:
            piece: one item of :meth:`split_pieces` (encoded as given, as user text).
            voice: the prepared voice.

        Returns:
            :class:`LlmPrompt` with int64 arrays; ``tts_text_ids`` is never empty.

        Raises:
            EmptyText: the piece holds no letter or digit.
        """
        if not is_speakable(piece):
            raise EmptyText(
                f"text piece {piece[:40]!r} holds nothing speakable; send text with letters "
                "or digits"
            )
        mode = self.select_mode(piece, voice)
        piece_ids = self.encode_user(piece)
        no_ids: list[int] = []
        speech_tokens = np.zeros(0, dtype=np.int64)
        if mode == "instruct":
            instruction = normalize_text(voice.instruction or "")
            prompt_ids = [*self.encode_user(INSTRUCT_PREFIX + instruction), self.end_of_prompt_id]
            tts_ids = piece_ids
        elif mode == "zero_shot":
            transcript = normalize_text(voice.transcript or "")
            prompt_ids = [*self.system_prompt_ids, *self.encode_user(transcript)]
            tts_ids = piece_ids
            speech_tokens = np.asarray(voice.features.speech_tokens, dtype=np.int64).reshape(-1)
        else:
            prompt_ids = no_ids
            tts_ids = [*self.system_prompt_ids, *piece_ids]
        logger.debug(
            "voice %s: %s prompt, %d prompt text ids, %d tts text ids, %d speech tokens",
            voice.name, mode, len(prompt_ids), len(tts_ids), speech_tokens.size,
        )
        return LlmPrompt(
            prompt_text_ids=np.asarray(prompt_ids, dtype=np.int64),
            tts_text_ids=np.asarray(tts_ids, dtype=np.int64),
            prompt_speech_tokens=speech_tokens,
            mode=mode,
        )


# -- pieces ---------------------------------------------------------------------------------

TokenCounter = Callable[[str], int]
"""Number of LLM text tokens of a string."""
HardCutter = Callable[[str, int], list[str]]
"""Cuts a string into consecutive parts of at most the given number of tokens."""

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


def _is_cut(text: str, i: int, marks: frozenset[str]) -> bool:
    char = text[i]
    if char not in marks:
        return False
    if char not in _ASCII_MARKS:
        return True
    before = text[i - 1] if i > 0 else " "
    after = text[i + 1] if i + 1 < len(text) else " "
    if before.isdigit() and after.isdigit():
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


# -- normalisation --------------------------------------------------------------------------

_SPECIAL_MARKUP = re.compile(r"<\|[^<>|\s]{1,64}\|>")
"""Qwen / CosyVoice control-token syntax, e.g. ``<|endofprompt|>``, ``<|im_start|>``."""

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
_DROPPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})
_BLANK_CATEGORIES = frozenset({"Zs", "Zl", "Zp"})

# Chinese clean-up tables (upstream remove_bracket / replace_corner_mark, extended).
_ZH_REMOVED = str.maketrans("", "", "（）【】`")
_ZH_FULL_WIDTH = {".": "。", "?": "？", "!": "！", ";": "；", ":": "：", ",": "，"}
_CJK_PUNCTUATION = frozenset("。？！；：，、…「」『』（）《》〈〉【】“”‘’·—～")
_ZH_CLOSERS = frozenset("\"'”’)）」』»】]")


def is_emoji(code: int) -> bool:
    """True for a code point of the emoji / pictograph ranges (incl. variation selectors)."""
    return any(first <= code <= last for first, last in _EMOJI_RANGES)


def clean_text(text: str) -> str:
    """Remove what can never be spoken and unify blanks.

    NFC composition (so "a" + combining diaeresis becomes "ä", as the tokenizer's own NFC
    normaliser would); ``<|...|>`` markup removed; control / format / surrogate /
    private-use / unassigned characters and emoji removed; tabs, newlines and Unicode spaces
    become one ASCII space; the result is stripped.

    Args:
        text: any Python string (lone surrogates included).

    Returns:
        Cleaned text; may be empty.
    """
    kept: list[str] = []
    for char in text:
        category = unicodedata.category(char)
        if char in "\t\n\r\v\f" or category in _BLANK_CATEGORIES:
            kept.append(" ")
        elif category in _DROPPED_CATEGORIES or is_emoji(ord(char)):
            continue
        else:
            kept.append(char)
    text = unicodedata.normalize("NFC", "".join(kept))
    text = _SPECIAL_MARKUP.sub(" ", text)
    return re.sub(r" {2,}", " ", text).strip()


_EN_WORD_SLASH = re.compile(r"(?<![\w/.:@-])(?P<a>[a-z]{2,})/(?P<b>[a-z]{2,})(?![\w/@])")
"""Two lower-case English words joined by a slash ("on/off", "and/or")."""


_EN_ARITHMETIC = (
    (re.compile(r"(?<=\d) ?\* ?(?=\d)"), " times "),
    (re.compile(r"(?<=\d) = (?=[-−]?\d)"), " equals "),
)
"""``5 * 3 = 15`` (``×`` and ``x`` stay dimensions, "16x16" is "sixteen by sixteen")."""


def _english_slash(match: re.Match[str]) -> str:
    first, second = match.group("a"), match.group("b")
    if first in UNITS or second in UNITS:
        return match.group(0)  # a unit such as "mm/h" without its number
    return f"{first} or {second}"


def _is_cjk_char(char: str) -> bool:
    return char_script(char) in ("han", "kana") or char in _CJK_PUNCTUATION


def _full_width_punctuation(text: str) -> str:
    """ASCII . ? ! ; : , -> full width at a sentence boundary, never between two digits."""
    out: list[str] = []
    last = len(text) - 1
    for i, char in enumerate(text):
        wide = _ZH_FULL_WIDTH.get(char)
        if wide is not None:
            before = text[i - 1] if i > 0 else " "
            after = text[i + 1] if i < last else " "
            between_digits = before.isdigit() and after.isdigit()
            at_boundary = (
                after == " " or i == last or _is_cjk_char(after) or after in _ZH_CLOSERS
                or after in _ZH_FULL_WIDTH or _is_cjk_char(before)
            )
            if at_boundary and not between_digits:
                char = wide
        out.append(char)
    return "".join(out)


def _remove_blanks_near_cjk(text: str) -> str:
    """Drop a space next to a CJK character or CJK punctuation; keep it between other words
    (upstream ``replace_blank`` keeps it only between two ASCII characters)."""
    out: list[str] = []
    last = len(text) - 1
    for i, char in enumerate(text):
        if (
            char == " " and 0 < i < last
            and (_is_cjk_char(text[i - 1]) or _is_cjk_char(text[i + 1]))
        ):
            continue
        out.append(char)
    return "".join(out)


_ZH_NUMBER = r"(?P<n>[-−]?\d+(?:[.,]\d+)?)"
_ZH_SYMBOLS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(_ZH_NUMBER + r"\s?[%％]"), r"百分之\g<n>"),
    (re.compile(_ZH_NUMBER + r"\s?(?:°\s?C|℃)"), r"\g<n>摄氏度"),
    (re.compile(_ZH_NUMBER + r"\s?(?:°\s?F|℉)"), r"\g<n>华氏度"),
    (re.compile(_ZH_NUMBER + r"\s?°"), r"\g<n>度"),
    (re.compile(r"€\s?" + _ZH_NUMBER), r"\g<n>欧元"),
    (re.compile(_ZH_NUMBER + r"\s?€"), r"\g<n>欧元"),
    (re.compile(r"(?:US)?\$\s?" + _ZH_NUMBER), r"\g<n>美元"),
    (re.compile(r"£\s?" + _ZH_NUMBER), r"\g<n>英镑"),
    (re.compile(r"[¥￥]\s?" + _ZH_NUMBER), r"\g<n>元"),
    (re.compile(r"\s*[&＆]\s*"), "和"),
)
"""Symbols read in Chinese word order (upstream's wetext zh rules read 50% as 百分之五十);
the digits stay digits, as everywhere in this module."""
_JA_SYMBOLS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(_ZH_NUMBER + r"\s?[%％]"), r"\g<n>パーセント"),
    (re.compile(_ZH_NUMBER + r"\s?(?:°\s?C|℃|°)"), r"\g<n>度"),
    (re.compile(r"€\s?" + _ZH_NUMBER), r"\g<n>ユーロ"),
    (re.compile(_ZH_NUMBER + r"\s?€"), r"\g<n>ユーロ"),
    (re.compile(r"(?:US)?\$\s?" + _ZH_NUMBER), r"\g<n>ドル"),
    (re.compile(r"[¥￥]\s?" + _ZH_NUMBER), r"\g<n>円"),
)
"""The same for Japanese (text with kana): 50% is 50パーセント, ¥100 is 100円."""


def normalize_chinese(text: str) -> str:
    """Clean-up of text holding Han or kana characters (upstream ``text_normalize``, zh branch).

    " - " and "——" become a full-width comma; （ ） 【 】 and backticks are removed;
    ² / ³ become 平方 / 立方 (upstream ``replace_corner_mark``); % ° °C € $ £ ¥ & after or
    before a number are read in Chinese order (``_ZH_SYMBOLS``: 50% -> 百分之50; Japanese
    text: ``_JA_SYMBOLS``, 50% -> 50パーセント); ASCII
    sentence punctuation becomes full width at boundaries; blanks next to CJK characters
    are removed; trailing commas become 。. Digits and Latin words are kept as they are
    (upstream's wetext normaliser is not used here).

    Args:
        text: output of :func:`clean_text`.
    """
    text = text.replace(" - ", "，").replace("——", "，")
    text = text.translate(_ZH_REMOVED)
    text = text.replace("²", "平方").replace("³", "立方")
    symbols = _JA_SYMBOLS if dominant_script(text) == "kana" else _ZH_SYMBOLS
    for pattern, replacement in symbols:
        text = pattern.sub(replacement, text)
    text = _full_width_punctuation(text)
    text = _remove_blanks_near_cjk(text)
    text = re.sub(r"[，,、]+$", "。", text)
    return re.sub(r" {2,}", " ", text).strip()


def normalize_text(text: str, language: str | None = None) -> str:
    """Normalise one text for the LLM (spec section 3).

    * Text with Han or kana characters (Chinese, Japanese, mixed zh+en): :func:`normalize_chinese`.
    * Latin-script text detected as English (:func:`is_english`): numbers, dates,
      times, units, percentages and currencies read as words (:func:`expand_english`);
      ``&`` is "and", a slash between two lower-case words is "or" ("on/off"), ``5 * 3 = 15``
      is "five times three equals fifteen".
    * Any other text (German, French, Cyrillic, Hangul...): cleaned only; digits stay digits.

    Args:
        text: user text, untrusted.
        language: optional language hint (e.g. the voice's "en_US"); used only when the
            text itself gives no cue (e.g. "50%").

    Returns:
        Normalised text; empty when nothing is left.

    Raises:
        TextError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TextError(
            f"text must be a string, got {type(text).__name__}; send the text as a JSON string"
        )
    text = clean_text(text)
    if not text:
        return ""
    script = dominant_script(text)
    if has_cjk(text) and script not in ("hangul", "cyrillic", "greek", "arabic", "hebrew"):
        return normalize_chinese(text)
    if script in ("latin", "none") and is_english(text, language):
        for pattern, words in _EN_ARITHMETIC:
            text = pattern.sub(words, text)
        return _EN_WORD_SLASH.sub(_english_slash, expand_english(text))
    return text


# -- writing system ---------------------------------------------------------------------------

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


# -- English numbers, dates, times, currencies and units -------------------------------------

_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_MAX_CARDINAL_DIGITS = 15
"""Longer digit runs (serial numbers, phone numbers) are read digit by digit."""

_MONTH_NAMES = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)
MONTHS: dict[str, str] = {name.lower(): name for name in _MONTH_NAMES}
MONTHS.update(
    {
        abbr.lower(): full
        for abbr, full in (
            ("Jan", "January"), ("Feb", "February"), ("Mar", "March"), ("Apr", "April"),
            ("Jun", "June"), ("Jul", "July"), ("Aug", "August"), ("Sep", "September"),
            ("Sept", "September"), ("Oct", "October"), ("Nov", "November"),
            ("Dec", "December"),
        )
    }
)

_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_UNIT_ALT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
_MONTH_ALT = "|".join(sorted((m.capitalize() for m in MONTHS), key=len, reverse=True))
_AMPM = r"(?P<ampm>[AaPp])\.?\s?[Mm](?:\.(?=\s+[a-z]|,))?(?![A-Za-z])"

_CURRENCY_PREFIX = re.compile(
    rf"(?P<neg>[-−])?(?P<cur>[$€£¥])\s?(?P<int>{_INT})(?:\.(?P<frac>\d+))?"
    r"(?:\s(?P<scale>thousand|million|billion|trillion)\b)?"
)
_CURRENCY_SUFFIX = re.compile(
    rf"(?<![\w.,])(?P<neg>[-−])?(?P<int>{_INT})(?:\.(?P<frac>\d+))?\s?(?P<cur>[€£¥])"
)
_ISO_DATE = re.compile(r"(?<![\w.:/-])(?P<y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})(?![\w:/-])")
_SLASH_DATE = re.compile(r"(?<![\w./])(?P<a>\d{1,2})/(?P<b>\d{1,2})/(?P<y>\d{4})(?![\w/])")
_MONTH_DAY = re.compile(
    rf"\b(?P<month>{_MONTH_ALT})\.?\s+(?P<d>\d{{1,2}})(?:st|nd|rd|th)?\b"
    r"(?:,?\s+(?P<y>\d{4})\b)?"
)
_DAY_MONTH = re.compile(
    rf"(?<![\w.,])(?P<d>\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<month>{_MONTH_ALT})\b\.?"
    r"(?:,?\s+(?P<y>\d{4})\b)?"
)
_MONTH_YEAR = re.compile(rf"\b(?P<month>{_MONTH_ALT})\.?\s+(?P<y>\d{{4}})\b")
_TIME = re.compile(
    r"(?<![\d:.,])(?P<h>\d{1,2}):(?P<m>\d{2})(?::(?P<s>\d{2}))?(?![\d:])"
    rf"(?:\s?{_AMPM})?"
)
_HOUR_AMPM = re.compile(rf"(?<![\d:.,])(?P<h>\d{{1,2}})\s?{_AMPM}")
_DIMENSIONS = re.compile(r"(?<![\w.])(?P<a>\d+)\s?[xX×]\s?(?P<b>\d+)(?!\d|\.\d)")
_ORDINAL = re.compile(r"(?<![\w.,])(?P<n>\d+)(?:st|nd|rd|th)\b", re.IGNORECASE)
_DECADE = re.compile(
    r"(?<![\w.,'’])(?:(?P<y>\d{3}0)|['’](?P<y2>\d0)|(?<=\b[Tt]he )(?P<y3>\d0))s\b"
)
_YEAR_CONTEXT = re.compile(
    r"\b(?P<ctx>[Ii]n|[Ss]ince|[Uu]ntil|[Tt]ill|[Bb]y|[Ff]rom|[Oo]f|[Yy]ear|[Bb]efore|[Aa]fter"
    r"|[Dd]uring|[Cc]irca|[Aa]round|[Tt]hrough)\s+(?P<y>\d{4})(?![\w%°]|[.,]\d|\s?(?:" + _UNIT_ALT
    + r")(?![A-Za-z0-9]))"
)
_NUMBER = re.compile(
    rf"(?P<neg>(?<![\w.,)\]])[-−])?(?P<int>{_INT})(?:\.(?P<frac>\d+))?"
    rf"(?:\s?(?P<unit>{_UNIT_ALT})(?![A-Za-z0-9]))?"
)
_FRACTION = re.compile(r"(?<![\w/.,])(?P<a>\d{1,3})/(?P<b>\d{1,3})(?![\w/]|[.,]\d)")
_VERSION = re.compile(r"(?<![\w.])\d+(?:\.\d+){2,}(?![\w]|\.\d)")
_NUMBER_SIGN = re.compile(r"#(?=\d)")
_AMPERSAND = re.compile(r"\s*&\s*")


def digits(text: str) -> str:
    """Read a digit string one digit at a time: "007" -> "zero zero seven"."""
    return " ".join(_DIGIT_WORDS[int(c)] for c in text if c.isdecimal())


def cardinal(value: int) -> str:
    """Cardinal words: 21 -> "twenty-one", -3 -> "minus three" (num2words, English)."""
    if value < 0:
        return "minus " + cardinal(-value)
    return str(num2words(value, lang="en")).replace(",", "")


def ordinal(value: int) -> str:
    """Ordinal words: 17 -> "seventeenth"."""
    return str(num2words(value, lang="en", to="ordinal"))


def year(value: int) -> str:
    """Year words: 2023 -> "twenty twenty-three", 1905 -> "nineteen oh-five"."""
    return str(num2words(value, lang="en", to="year")).replace(",", "")


def number(int_text: str, frac_text: str | None = None, negative: bool = False) -> str:
    """Words of a decimal number given as text: ("21", "5") -> "twenty-one point five".

    Thousands commas are ignored; a leading zero or more than 15 digits reads digit by
    digit; the fraction is always read digit by digit ("2.50" -> "two point five zero").
    """
    plain = int_text.replace(",", "")
    if (len(plain) > 1 and plain.startswith("0")) or len(plain) > _MAX_CARDINAL_DIGITS:
        words = digits(plain)
    else:
        words = cardinal(int(plain))
    if frac_text:
        words += " point " + digits(frac_text)
    return ("minus " + words) if negative else words


def _is_one(int_text: str, frac_text: str | None) -> bool:
    return frac_text is None and int_text == "1"


def _padded(match: re.Match[str], words: str) -> str:
    """Words with a blank where they touch a letter or digit ("H2O" -> "H two O")."""
    text = match.string
    before = text[match.start() - 1] if match.start() > 0 else " "
    after = text[match.end()] if match.end() < len(text) else " "
    left = " " if before.isalnum() else ""
    right = " " if after.isalnum() else ""
    return f"{left}{words}{right}"


def _currency(match: re.Match[str]) -> str:
    main_one, main_many, sub_one, sub_many = CURRENCIES[match.group("cur")]
    int_text, frac = match.group("int"), match.group("frac")
    negative = match.group("neg") is not None
    scale = match.groupdict().get("scale")
    if scale:
        return f"{number(int_text, frac, negative)} {scale} {main_many}"
    if frac is not None and (len(frac) != 2 or not sub_one):
        return f"{number(int_text, frac, negative)} {main_many}"
    whole = int(int_text.replace(",", ""))
    cents = int(frac) if frac is not None else 0
    parts = []
    if whole or not cents:
        parts.append(f"{cardinal(whole)} {main_one if whole == 1 else main_many}")
    if cents:
        parts.append(f"{cardinal(cents)} {sub_one if cents == 1 else sub_many}")
    words = " and ".join(parts)
    return _padded(match, ("minus " + words) if negative else words)


def _date(month: int, day: int, year_text: str | None, day_first: bool = False) -> str | None:
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    name = _MONTH_NAMES[month - 1]
    words = f"the {ordinal(day)} of {name}" if day_first else f"{name} {ordinal(day)}"
    if year_text:
        words += f", {year(int(year_text))}"
    return words


def _iso_date(match: re.Match[str]) -> str:
    words = _date(int(match.group("m")), int(match.group("d")), match.group("y"))
    return words if words is not None else match.group(0)


def _slash_date(match: re.Match[str]) -> str:
    first, second = int(match.group("a")), int(match.group("b"))
    # US order (month/day) unless the first field cannot be a month.
    month, day = (second, first) if first > 12 else (first, second)
    words = _date(month, day, match.group("y"))
    return words if words is not None else match.group(0)


def _month_day(match: re.Match[str]) -> str:
    month = _MONTH_NAMES.index(MONTHS[match.group("month").lower()]) + 1
    words = _date(month, int(match.group("d")), match.group("y"))
    return words if words is not None else match.group(0)


def _day_month(match: re.Match[str]) -> str:
    month = _MONTH_NAMES.index(MONTHS[match.group("month").lower()]) + 1
    words = _date(month, int(match.group("d")), match.group("y"), day_first=True)
    if words is None:
        return match.group(0)
    if match.string[: match.start()].lower().endswith("the "):
        words = words.removeprefix("the ")
    return words


def _month_year(match: re.Match[str]) -> str:
    return f"{MONTHS[match.group('month').lower()]} {year(int(match.group('y')))}"


def _time(match: re.Match[str]) -> str:
    hour, minute = int(match.group("h")), int(match.group("m"))
    second = match.group("s")
    ampm = match.group("ampm")
    if hour > (12 if ampm else 24) or minute > 59 or (second is not None and int(second) > 59):
        return match.group(0)
    words = cardinal(hour)
    if minute == 0:
        if not ampm:
            words += " o'clock" if 1 <= hour <= 12 else " hundred"
    elif minute < 10:
        words += " oh " + cardinal(minute)
    else:
        words += " " + cardinal(minute)
    if second is not None and int(second) > 0:
        words += f" and {cardinal(int(second))} second" + ("" if int(second) == 1 else "s")
    if ampm:
        words += " AM" if ampm.lower() == "a" else " PM"
    return _padded(match, words)


def _hour_ampm(match: re.Match[str]) -> str:
    hour = int(match.group("h"))
    if not 0 <= hour <= 12:
        return match.group(0)
    suffix = "AM" if match.group("ampm").lower() == "a" else "PM"
    return _padded(match, f"{cardinal(hour)} {suffix}")


def _dimensions(match: re.Match[str]) -> str:
    return _padded(match, f"{number(match.group('a'))} by {number(match.group('b'))}")


def _ordinal(match: re.Match[str]) -> str:
    return _padded(match, ordinal(int(match.group("n"))))


def _decade(match: re.Match[str]) -> str:
    value = int(match.group("y") or match.group("y2") or match.group("y3"))
    words = year(value) if value >= 1000 else cardinal(value)
    words = words[:-1] + "ies" if words.endswith("y") else words + "s"
    return _padded(match, words)


def _year_in_context(match: re.Match[str]) -> str:
    value = int(match.group("y"))
    if not 1100 <= value <= 2099:
        return match.group(0)
    return f"{match.group('ctx')} {year(value)}"


def _fraction(match: re.Match[str]) -> str:
    """Simple fraction: "1/2" -> "one half", "3/4" -> "three quarters", "2/3" -> "two thirds"."""
    numerator, denominator = int(match.group("a")), int(match.group("b"))
    if not 2 <= denominator <= 100:
        return _padded(match, f"{cardinal(numerator)} over {cardinal(denominator)}")
    if denominator == 2:
        name = "half" if numerator == 1 else "halves"
    else:
        name = "quarter" if denominator == 4 else ordinal(denominator)
        if numerator != 1:
            name += "s"
    return _padded(match, f"{cardinal(numerator)} {name}")


def _version(match: re.Match[str]) -> str:
    """Dotted version or address: "1.2.3" -> "one point two point three"."""
    return _padded(match, " point ".join(number(part) for part in match.group(0).split(".")))


def _number(match: re.Match[str]) -> str:
    int_text, frac = match.group("int"), match.group("frac")
    words = number(int_text, frac, negative=match.group("neg") is not None)
    unit = match.group("unit")
    if unit:
        singular, plural = UNITS[unit]
        words += " " + (singular if _is_one(int_text, frac) else plural)
    return _padded(match, words)


_PASSES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (_CURRENCY_PREFIX, _currency),
    (_CURRENCY_SUFFIX, _currency),
    (_ISO_DATE, _iso_date),
    (_SLASH_DATE, _slash_date),
    (_MONTH_DAY, _month_day),
    (_DAY_MONTH, _day_month),
    (_MONTH_YEAR, _month_year),
    (_TIME, _time),
    (_HOUR_AMPM, _hour_ampm),
    (_DIMENSIONS, _dimensions),
    (_ORDINAL, _ordinal),
    (_DECADE, _decade),
    (_YEAR_CONTEXT, _year_in_context),
    (_FRACTION, _fraction),
    (_VERSION, _version),
    (_NUMBER, _number),
)


def expand_english(text: str) -> str:
    """Replace every number form of English text by words, as Home Assistant says them.

    Upstream's fallback front end (utils/frontend_utils.py ``spell_out_number``) spells every digit
    run with ``inflect`` whatever the language and ignores decimals, times and units. This module
    is applied only to text detected as English (:func:`is_english`) and reads, e.g.:

        "21.5 °C"            -> "twenty-one point five degrees Celsius"
        "3:45 PM"            -> "three forty-five PM"
        "50%"                -> "fifty percent"
        "December 17, 2023"  -> "December seventeenth, twenty twenty-three"
        "$5.50"              -> "five dollars and fifty cents"
        "16X16"              -> "sixteen by sixteen"

    "AM"/"PM" are written as capitals without dots: dots would end a sentence for the splitter,
    and the LLM reads the two capitals as letters. Number words come from ``num2words``.

    Args:
        text: cleaned text (no control characters), detected as English.

    Returns:
        The text with no ASCII digits left, blanks collapsed.
    """
    text = text.replace("℃", "°C").replace("℉", "°F")
    text = re.sub(r"°\s+([CF])(?![A-Za-z])", r"°\1", text)
    text = _NUMBER_SIGN.sub("number ", text)
    for pattern, replace in _PASSES:
        text = pattern.sub(replace, text)
    text = _AMPERSAND.sub(" and ", text)
    return re.sub(r"\s{2,}", " ", text).strip()
