"""Two pieces of a request decoded together: one pass over the LLM's weights serves both.

Decoding one speech token reads every weight of the LLM once (about 0.37 GB in 8-bit blocks,
0.24 GB in 4-bit ones) for one row of products, so a step is bound by memory, not by
arithmetic. A second row costs little more: on the 2-core Xeon of BENCHMARKS.md a ``fused-q4``
step with two rows took 1.2x the time of a step with one (26.8 against 22.3 ms), so two pieces
decoded side by side get their tokens 1.66x as fast in total. The pieces of a request are
independent LLM sequences (each its own prompt; upstream decodes each text segment on its
own), so the piece the listener hears next is decoded with the one after it.

:func:`paired_stream` yields exactly what :func:`.decoder.token_stream` yields --
``(piece index, token)`` for every token of piece 0, ``(0, None)``, then piece 1, and so on,
``more`` called once the last known piece is decoded, before its end marker, where [] ends the
request -- but at most two pieces are decoded at a time, in one two-row step of the decode graph
(:meth:`.decoder.LlmDecoder.step_pair`); the later piece's tokens wait in a list until the
earlier piece has ended. Schedule:

* the request's first piece decodes alone for its first :data:`JOIN_AFTER_TOKENS` tokens (its
  first audio needs them; the next piece's prefill would delay them), then the next piece is
  prefilled and joins;
* when a piece ends, the next piece not yet started is prefilled and joins the one left;
* a piece whose partner has ended decodes on alone until the next one joins; while no later
  piece is known, ``more`` is also asked every :data:`MORE_POLL_TOKENS` of its tokens (a
  stream's next sentence may have come; [] then only means "nothing yet").

Each piece draws its samples from a generator of its own, seeded from the request's generator
when the piece starts, in piece order (:func:`.decoder.piece_rng`, as
:func:`.decoder.token_stream` does). Used only where the two-row step gives each row exactly
its one-row logits (:attr:`.decoder.LlmDecoder.pairs_pieces`), so a seed gives every piece
the same tokens paired or not.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from .. import constants as C
from ..errors import SynthesisFailed
from ..options import LlmPrompt, ShouldStop
from .decoder import (
    DecodeState,
    LlmDecoder,
    PairState,
    PieceToken,
    TokenRequest,
    decode_limits,
    piece_rng,
    sample_step,
)

MORE_POLL_TOKENS = 25
"""While one piece decodes alone and no later piece is known, ``more`` is asked for text that
came meanwhile every this many of its tokens (1 s of speech; it returns at once, [] when none
came), so a stream's next sentence can join; asking on every step would cost the event loop a
call per token."""

JOIN_AFTER_TOKENS = 16
"""Tokens of a request's first piece decoded before the next piece joins: more than any
preset's first flow hop and its lookahead (``first_hop_tokens`` 10 + 3 at ``balanced``, 8 + 3
at ``fast``; the exact ``quality`` preset decodes with ``fused``, which never pairs), so the
first chunk's tokens are not slowed by the join's prefill or by two-row steps."""

class _Piece:
    """One piece's decoding: its cache (alone or a row of the pair), limits and tokens."""

    def __init__(self, index: int, state: DecodeState | None, logits: np.ndarray | None,
                 min_len: int, max_len: int, rng: np.random.Generator) -> None:
        self.index = index
        self.state: DecodeState | None = state
        self.logits: np.ndarray | None = logits
        self.min_len = min_len
        self.max_len = max_len
        self.rng = rng
        self.tokens: list[int] = []
        self.pending: deque[int] = deque()
        self.last: int | None = None
        self.done = max_len <= 0

    def sample(self, llm: LlmDecoder, req: TokenRequest) -> None:
        """Choose the next token from the fresh logits (or end the piece)."""
        logits, self.logits = self.logits, None
        assert logits is not None
        started = time.perf_counter()
        step = len(self.tokens)
        if not np.all(np.isfinite(logits)):
            raise SynthesisFailed(
                f"LLM graph {llm.decode_graph_path} produced non-finite logits at step {step}; "
                "use llm_precision 'fp32' or 'int8' or re-download the model"
            )
        token = sample_step(logits, self.tokens, self.rng, step, self.min_len)
        req.times.llm_decode_s += time.perf_counter() - started
        if token >= C.SPEECH_TOKEN_VOCAB:
            self.done = True
            return
        self.tokens.append(token)
        self.pending.append(token)
        req.times.llm_tokens += 1
        if len(self.tokens) >= self.max_len:
            self.done = True
        else:
            self.last = token


def paired_stream(
    llm: LlmDecoder,
    prompts: list[LlmPrompt],
    fixed_tokens: list[int | None],
    req: TokenRequest,
    stopped: ShouldStop | None = None,
    more: Callable[[], None] | None = None,
) -> Iterator[PieceToken]:
    """:func:`.decoder.token_stream`'s items, two pieces decoded at a time (module docstring).

    Raises:
        as ``LlmDecoder.decode`` (cancellation, timeout, graph failure).
    """

    def should_stop() -> bool:
        return (stopped is not None and stopped()) or req.check()

    opts = req.options
    pieces: deque[_Piece] = deque()  # started and not yet handed over, in piece order
    pair: tuple[PairState, _Piece, _Piece] | None = None
    started_pieces = 0

    def start() -> _Piece:
        nonlocal started_pieces
        index = started_pieces
        started_pieces += 1
        prompt = prompts[index]
        min_len, max_len = decode_limits(len(prompt.tts_text_ids))
        fixed = fixed_tokens[index]
        if fixed is not None:
            min_len = max_len = fixed
        max_len = min(max_len, opts.max_decode_tokens)
        rng = piece_rng(req.rng)
        if max_len <= 0:  # nothing to decode (as LlmDecoder.decode: no prefill either)
            piece = _Piece(index, None, None, min_len, max_len, rng)
            pieces.append(piece)
            return piece
        llm.check(should_stop, req.deadline_monotonic, 0)
        began = time.perf_counter()
        state, logits, _ = llm.prefill_prompt(prompt)
        req.times.llm_prefill_s += time.perf_counter() - began
        piece = _Piece(index, state, logits, min_len, max_len, rng)
        pieces.append(piece)
        return piece

    def unpair() -> None:
        """The pair's rows become states of their own (a row whose piece ended is dropped)."""
        nonlocal pair
        if pair is None:
            return
        state, first, second = pair
        for row, piece in enumerate((first, second)):
            piece.state = None if piece.done else llm.unpair(state, row, piece.tokens)
        pair = None

    def active() -> list[_Piece]:
        return [piece for piece in pieces if not piece.done]

    asked_at = 0  # the lone piece's token count at the last early ``more``
    span = req.now()
    while pieces or started_pieces < len(prompts):  # ``more`` may add prompts
        if not pieces:
            start()
        for piece in active():
            if piece.logits is not None:
                piece.sample(llm, req)
        if pair is not None and (pair[1].done or pair[2].done):
            unpair()
        # hand over what the listener's piece has, and every piece that is complete
        while pieces:
            head = pieces[0]
            while head.pending:
                handed = req.now()
                yield head.index, head.pending.popleft()
                if req.now() - handed > 1e-3:  # the consumer ran a chunk in between
                    req.event("llm", span, handed)
                    span = req.now()
            if not head.done:
                break
            pieces.popleft()
            asked_at = 0
            if (more is not None and head.index == len(prompts) - 1 and not pieces
                    and not should_stop()):
                req.event("llm", span)
                more()
                span = req.now()
            yield head.index, None
        going = active()
        if (more is not None and len(going) == 1 and started_pieces == len(prompts)
                and len(going[0].tokens) >= asked_at + MORE_POLL_TOKENS):
            # a slot is free and no piece waits: text that came meanwhile can join now
            asked_at = len(going[0].tokens)
            more()
        if len(going) < 2 and started_pieces < len(prompts):
            first_piece_waits = (started_pieces == 1 and going
                                 and len(going[0].tokens) < JOIN_AFTER_TOKENS)
            if not going or not first_piece_waits:
                start()
                continue  # the new piece samples its first token before any step
        if not going:
            continue
        llm.check(should_stop, req.deadline_monotonic, len(going[0].tokens))
        began = time.perf_counter()
        if len(going) == 2:
            first, second = going
            if pair is None:
                assert first.state is not None and second.state is not None
                pair = (llm.pair_states(first.state, second.state), first, second)
                first.state = second.state = None
            assert first.last is not None and second.last is not None
            logits = llm.step_pair(pair[0], (first.last, second.last))
            first.logits, second.logits = logits[0], logits[1]
        else:
            (piece,) = going
            assert piece.state is not None and piece.last is not None
            piece.logits = llm.step(piece.state, piece.last)
        req.times.llm_decode_s += time.perf_counter() - began
    req.event("llm", span)
