"""The LLM prompt of each piece (spec section 4): :class:`TextFrontend` normalises user text
(:mod:`.normalize`), cuts it into pieces (:mod:`.pieces`) and turns each piece into prompt ids.

Prompt modes (upstream llm.py ``Qwen2LM.inference``, cli/frontend.py ``frontend_zero_shot``,
``frontend_cross_lingual``, ``frontend_instruct2``; the export's model card, host side step 2):

* zero_shot: prompt_text = SYSTEM_PROMPT + transcript; tts_text = piece; LLM prompt speech
  tokens = the clip's speech tokens.
* cross_lingual: no prompt_text; tts_text = SYSTEM_PROMPT + piece; no prompt speech tokens.
* instruct: prompt_text = INSTRUCT_PREFIX + instruction + "<|endofprompt|>"; tts_text = piece;
  no prompt speech tokens (upstream ``frontend_instruct2`` deletes them).

The flow always gets the clip's tokens, mel and embedding (not this module's business).

Zero-shot is used only when the transcript is written in the same script as the piece
(:func:`.script.dominant_script`); otherwise the voice is used cross-lingually (the model card
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
from functools import lru_cache

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
from .lang_cjk import start_warm_up
from .normalize import normalize_text
from .pieces import is_speakable, split_text
from .script import dominant_script

logger = logging.getLogger(__name__)


@lru_cache(maxsize=256)
def _prompt_text(text: str) -> str:
    """A voice's transcript or instruction, normalised once: every piece of every request
    builds its prompt from it, and its numbers may go through wetext (milliseconds each)."""
    return normalize_text(text)



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
        self, text: str, language: str | None = None, max_tokens: int | None = None,
        read_numbers: bool = True,
    ) -> list[str]:
        """Normalise ``text`` and split it into pieces of about 60-80 text tokens.

        Args:
            text: user text, untrusted.
            language: optional language hint for the normaliser (e.g. "en_US"); used only
                for sentences that give no cue of their own.
            max_tokens: upper piece size for this call instead of ``max_piece_tokens``
                (``SynthesisOptions.max_piece_tokens``); pieces shorter than
                ``min(merge_tokens, max_tokens // 2)`` are then merged, so a small bound
                gives about one sentence per piece instead of merging sentences up to
                ``merge_tokens``; a longer sentence is cut after its commas, and a clause
                is cut between words only beyond ``max_piece_tokens``.
            read_numbers: read numbers, dates, times and units as words in each sentence's
                language (``SynthesisOptions.read_numbers``); False keeps the digits.

        Returns:
            Pieces in order; ``[]`` when nothing is speakable ("", "。", "?!", emoji...).

        Raises:
            TextError: ``text`` is not a ``str``.
        """
        limit = self.max_piece_tokens if max_tokens is None else max_tokens
        normalized = normalize_text(text, language, read_numbers)
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

    @staticmethod
    def start_warm_up() -> None:
        """Load the Chinese and Japanese number reader (wetext, about 0.5 s) in a daemon
        thread now, so that no request waits for it (:func:`.lang_cjk.start_warm_up`)."""
        start_warm_up()

    # --- prompts -------------------------------------------------------------------------
    def select_mode(self, piece: str, voice: VoicePrompt) -> PromptMode:
        """Prompt mode for one piece and voice (see the module docstring).

        instruct when the voice has a speakable instruction; zero_shot when it has a
        speakable transcript in the piece's script (or either has no letters) and speech
        tokens; cross_lingual otherwise.
        """
        if voice.instruction and is_speakable(_prompt_text(voice.instruction)):
            return "instruct"
        transcript = _prompt_text(voice.transcript) if voice.transcript else ""
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
            instruction = _prompt_text(voice.instruction or "")
            prompt_ids = [*self.encode_user(INSTRUCT_PREFIX + instruction), self.end_of_prompt_id]
            tts_ids = piece_ids
        elif mode == "zero_shot":
            transcript = _prompt_text(voice.transcript or "")
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
