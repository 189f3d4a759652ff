"""Text front end: normalised pieces and the LLM prompt ids of each piece (spec sections 3-4).

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
(:func:`.normalize.dominant_script`); otherwise the voice is used cross-lingually (the model card
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
from collections.abc import Callable

import numpy as np
import tokenizers

from ..constants import (
    DEFAULT_MAX_PIECE_TOKENS,
    DEFAULT_MERGE_TOKENS,
    END_OF_PROMPT,
    INSTRUCT_PREFIX,
    SYSTEM_PROMPT,
)
from ..errors import EmptyText, ModelLoadError
from ..options import LlmPrompt, PromptMode, VoicePrompt
from .normalize import char_script, dominant_script, normalize_text

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
        text: normalised text (:func:`.normalize.normalize_text`).
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
    """Cut a short first piece off ``text`` when its first sentence is long.

    The first sentence (up to the first :data:`SENTENCE_MARKS` cut) is left alone when its
    expected speech is at most ``max_s``. Otherwise the head is the longest prefix of it
    within ``max_s`` and at least ``min_s`` that ends, in this order of preference: after a
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
