"""A request's speech tokens, piece after piece: decoded one piece at a time, or two at once
where one pass over the LLM's weights can serve both.

Decoding one speech token reads every weight of the LLM once (about 0.37 GB in 8-bit blocks,
0.24 GB in 4-bit ones) for one row of products, so a step is bound by memory, not by
arithmetic. A second row costs little more: on the 2-core Xeon of BENCHMARKS.md a ``fused-q4``
step with two rows took 1.2x the time of a step with one (26.8 against 22.3 ms), so two pieces
decoded side by side get their tokens 1.66x as fast in total. The pieces of a request are
independent LLM sequences (each its own prompt; upstream decodes each text segment on its
own), so the piece the listener hears next is decoded with the one after it, where the decode
graph allows it (:attr:`.decoder.LlmDecoder.pairs_pieces`).

:func:`piece_tokens` yields ``(piece index, token)`` for every token of piece 0, ``(0, None)``,
then piece 1, and so on; ``more`` is called once the last known piece is decoded, before its
end marker, and the pieces it returns are decoded next ([] there ends the request). Pieces
that do not pair go one after the other through ``LlmDecoder.decode``. When pieces pair, at
most two are decoded at a time, in one two-row step of the decode graph
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
when the piece starts, in piece order (:func:`piece_rng`). Two-row steps give each row exactly
its one-row logits, or were validated no further from float activations than the published
graph (``fused-b8``), so a seed gives every piece the same tokens paired or not, up to that.

:func:`request_tokens` runs the loop on the caller's thread or, with
``EngineOptions.split_cores``, in a per-request thread (:mod:`.producer`) while the caller's
thread runs the flow and the vocoder on the tokens already decoded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from .. import constants as C
from ..errors import SynthesisFailed
from ..options import LlmPrompt, ShouldStop, StageTimes, SynthesisOptions
from .decoder import DecodeState, LlmDecoder, PairState, decode_limits, sample_step
from .producer import TokenProducer

PieceToken = tuple[int, int | None]
"""``(piece index, speech token)``; the token is None at the end of the piece."""

PIECE_SEED_BOUND = 2**63 - 1
"""Upper bound of the per-piece seeds drawn from a request's generator (:func:`piece_rng`)."""


class TokenRequest(Protocol):
    """What the token loop reads of a request: the pipeline's
    :class:`~..pipeline.RequestState` (a stage may not import the pipeline, so it is named by
    its shape here)."""

    options: SynthesisOptions
    rng: np.random.Generator
    deadline_monotonic: float

    @property
    def times(self) -> StageTimes: ...

    def check(self) -> bool: ...

    def now(self) -> float: ...

    def event(self, stage: str, start_s: float, end_s: float | None = None) -> None: ...


def piece_rng(request_rng: np.random.Generator) -> np.random.Generator:
    """A piece's own generator, seeded from the request's (drawn when the piece starts, in
    piece order), so that a seed gives every piece the same tokens however the pieces'
    decoding steps interleave."""
    return np.random.default_rng(int(request_rng.integers(PIECE_SEED_BOUND)))

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


class DecodeProgress:
    """How far a request's decoding has gone, written by the decoding loop (in the
    ``split_cores`` thread) and read by the consumer, which may be behind it.

    A reader sees each value as of some recent step (the counts only grow, and a piece's
    count is final before it is marked ended), which is all the consumer needs to tell how
    much of a piece is already decoded.

    Attributes:
        decoded_tokens: per piece index (in the order pieces started), speech tokens decoded
            so far, end token excluded.
        ended: per piece index, True once the piece's last token is decoded (its count is
            final).
        finished: True once the loop has decoded every piece it was given and ``more`` had
            nothing further: no decoding runs beside the flow for the rest of the request.
    """

    def __init__(self) -> None:
        self.decoded_tokens: list[int] = []
        self.ended: list[bool] = []
        self.finished = False

    def _grow(self, index: int) -> None:
        while len(self.ended) <= index:
            self.decoded_tokens.append(0)
            self.ended.append(False)

    def token(self, index: int) -> None:
        """Piece ``index`` got one more speech token."""
        self._grow(index)
        self.decoded_tokens[index] += 1

    def end(self, index: int) -> None:
        """Piece ``index`` is decoded to its end."""
        self._grow(index)
        self.ended[index] = True

    def decoded_so_far(self, index: int) -> int:
        """Piece ``index``'s speech tokens decoded so far (0 before its first)."""
        return self.decoded_tokens[index] if index < len(self.decoded_tokens) else 0

    def tokens_if_ended(self, index: int) -> int | None:
        """Piece ``index``'s final token count once it ended, else None."""
        if index < len(self.ended) and self.ended[index]:
            return self.decoded_tokens[index]
        return None


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

    def sample(self, llm: LlmDecoder, req: TokenRequest, progress: DecodeProgress) -> None:
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
            progress.end(self.index)
            return
        self.tokens.append(token)
        self.pending.append(token)
        req.times.llm_tokens += 1
        progress.token(self.index)
        if len(self.tokens) >= self.max_len:
            self.done = True
            progress.end(self.index)
        else:
            self.last = token


def piece_tokens(
    llm: LlmDecoder,
    prompts: list[LlmPrompt],
    fixed_tokens: list[int | None],
    req: TokenRequest,
    stopped: ShouldStop | None = None,
    more: Callable[[], None] | None = None,
    progress: DecodeProgress | None = None,
) -> Iterator[PieceToken]:
    """``(piece index, token)`` for every accepted LLM token of every piece of a request, then
    ``(piece index, None)`` at the end of each piece (module docstring; two pieces at a time
    where ``llm.pairs_pieces``).

    ``more`` is called once the last piece in ``prompts`` is decoded, before its end marker
    (so the consumer knows which piece is the request's last when it sees the marker); it
    may append to ``prompts`` and ``fixed_tokens``, and the pieces it adds are decoded next.
    Records "llm" timeline spans, split where the consumer ran a chunk in between (in the
    producer thread: where the bounded queue was full).

    Args:
        llm: the model's decoder.
        prompts: one LLM prompt per text piece.
        fixed_tokens: per piece, the benchmark's fixed token count or None.
        req: the request (seeded generator, limits, cancellation, stage times).
        stopped: the producer thread's stop flag (the consumer has gone), or None.
        progress: updated as tokens are decoded (the consumer reads how far ahead the
            decoding is), or None.

    Raises:
        SynthesisCancelled, SynthesisTimeout: as ``LlmDecoder.check``.
        SynthesisFailed: a graph failed or produced non-finite logits.
    """

    def should_stop() -> bool:
        return (stopped is not None and stopped()) or req.check()

    progress = progress or DecodeProgress()
    if not llm.pairs_pieces:
        yield from _one_at_a_time(llm, prompts, fixed_tokens, req, should_stop, more, progress)
        progress.finished = True
        return
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
            progress.end(index)
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
                piece.sample(llm, req, progress)
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
        if (more is not None and len(going) == 1
                and started_pieces == len(prompts)
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
    progress.finished = True


def _one_at_a_time(
    llm: LlmDecoder,
    prompts: list[LlmPrompt],
    fixed_tokens: list[int | None],
    req: TokenRequest,
    should_stop: ShouldStop,
    more: Callable[[], None] | None,
    progress: DecodeProgress,
) -> Iterator[PieceToken]:
    """:func:`piece_tokens` where pieces do not pair: each piece through
    ``LlmDecoder.decode`` in turn."""
    opts = req.options
    for index, prompt in enumerate(prompts):
        span = req.now()
        decoded = llm.decode(
            prompt,
            piece_rng(req.rng),
            should_stop=should_stop,
            max_tokens=opts.max_decode_tokens,
            deadline=req.deadline_monotonic,
            times=req.times,
            fixed_tokens=fixed_tokens[index],
        )
        for token in decoded:
            progress.token(index)
            handed = req.now()
            yield index, token
            if req.now() - handed > 1e-3:  # the consumer ran a chunk in between
                req.event("llm", span, handed)
                span = req.now()
        req.event("llm", span)
        progress.end(index)
        if more is not None and index == len(prompts) - 1 and not should_stop():
            more()
        yield index, None


@contextmanager
def request_tokens(
    llm: LlmDecoder,
    prompts: list[LlmPrompt],
    fixed_tokens: list[int | None],
    req: TokenRequest,
    threaded: bool,
    more: Callable[[], None] | None = None,
    progress: DecodeProgress | None = None,
) -> Iterator[Iterator[PieceToken]]:
    """:func:`piece_tokens` of the request (``more`` and ``progress`` as there); with
    ``threaded`` decoded in a :class:`.producer.TokenProducer` thread (the items are the same
    either way: only that thread calls the LLM and draws from ``req.rng``, one seed per
    piece). The thread is stopped and joined when the context exits, however it exits; its
    error is raised in the consumer."""
    if not threaded:
        yield piece_tokens(llm, prompts, fixed_tokens, req, None, more, progress)
        return
    producer: TokenProducer[PieceToken] = TokenProducer(
        lambda stop: piece_tokens(llm, prompts, fixed_tokens, req, stop, more, progress)
    ).start()
    try:
        yield iter(producer)
    finally:
        producer.close()
