"""The speech tokens of one request: every piece's LLM decoding, in order, optionally in a
decoding thread (``SynthesisOptions.overlap_decoding``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..types import ShouldStop
from .decoder import LlmDecoder
from .producer import TokenProducer

if TYPE_CHECKING:
    from ..request import RequestState
    from ..types import LlmPrompt

PieceToken = tuple[int, int | None]
"""``(piece index, speech token)``; the token is None at the end of the piece."""


def token_stream(
    llm: LlmDecoder,
    prompts: list[LlmPrompt],
    fixed_tokens: list[int | None],
    req: RequestState,
    stopped: ShouldStop | None,
) -> Iterator[PieceToken]:
    """``(piece index, token)`` for every accepted LLM token of every piece of a request, then
    ``(piece index, None)`` at the end of each piece.

    Runs in the producer thread with ``overlap_decoding``. It records "llm" timeline spans,
    split where the consumer ran a chunk in between.

    Args:
        llm: the model's decoder (``llm.decode`` is looked up at each piece).
        prompts: one LLM prompt per text piece.
        fixed_tokens: per piece, the benchmark's fixed token count or None.
        req: the request (seeded generator, limits, cancellation, stage times).
        stopped: the producer thread's stop flag, or None.

    Raises:
        as ``LlmDecoder.decode`` (cancellation, timeout, graph failure).
    """

    def should_stop() -> bool:
        return (stopped is not None and stopped()) or req.check()

    opts = req.options
    for index, prompt in enumerate(prompts):
        span = req.now()
        tokens = llm.decode(
            prompt,
            req.rng,
            should_stop=should_stop,
            max_tokens=opts.max_decode_tokens,
            deadline=req.deadline_monotonic,
            times=req.times,
            fixed_tokens=fixed_tokens[index],
        )
        for token in tokens:
            handed = req.now()
            yield index, token
            if req.now() - handed > 1e-3:  # the consumer ran a chunk in between
                req.event("llm", span, handed)
                span = req.now()
        req.event("llm", span)
        yield index, None


@contextmanager
def request_tokens(
    llm: LlmDecoder,
    prompts: list[LlmPrompt],
    fixed_tokens: list[int | None],
    req: RequestState,
) -> Iterator[Iterator[PieceToken]]:
    """:func:`token_stream` of the request, decoded in a :class:`.producer.TokenProducer`
    thread when ``req.options.overlap_decoding`` (the items are the same either way); the
    thread is stopped and joined when the context exits."""
    if not req.options.overlap_decoding:
        yield token_stream(llm, prompts, fixed_tokens, req, None)
        return
    producer: TokenProducer[PieceToken] = TokenProducer(
        lambda stop: token_stream(llm, prompts, fixed_tokens, req, stop)
    ).start()
    try:
        yield iter(producer)
    finally:
        producer.close()
