"""Piece-aligned pauses: hold each piece's audio until the piece can play through.

Home Assistant's satellites start playing at the first ``audio-chunk`` and play 1 s of audio
per second. When the server produces audio more slowly than that, playback must pause
somewhere; the total waiting is the same wherever the pauses fall, but a pause between two
sentences sounds like a breath and a pause inside a word sounds broken. So the audio of every
*piece* (the engine's unit of text: a sentence, several short ones, or a clause of a long one;
:attr:`~..engine.options.AudioChunk.piece_index` within one engine request) is held until the
rest of that piece can follow without running dry, and then played through.

Rule (constant production rate): ``r`` = audio seconds produced per second within a piece,
measured from chunk to chunk after each piece's first chunk (the start-up of a piece -- LLM
prefill, first hop -- happens before its first chunk and does not slow its rest), over this
response and the runtime's recent responses (:class:`ProductionHistory`); ``A`` = seconds of
this piece in hand, ``R`` = seconds of it still to come (its expected length minus ``A``),
``Q`` = seconds of earlier audio the client has not played yet (its playback clock is
modelled from what was sent and when: it plays from the first audio on and waits when it runs
dry), ``d`` = the longest chunk so far, at most ``R`` (audio comes in whole chunks), ``c`` =
the audio of the piece's next chunk (the engine's next hop). Releasing now, the piece plays
from ``Q`` seconds from now, its next chunk is made ``c / r`` and its last sample ``R / r``
seconds from now, so the piece never runs dry when::

    A + Q >= max(R (1 / r - 1) + d, c / r)     (only c / r when r >= 1)

(:func:`needed_hold_s`; ``r`` lowered by :data:`RATE_MARGIN`, plus :data:`ARRIVAL_MARGIN_S`).
While nothing is queued, each second of waiting lets production catch up by one second, so a
piece short of this at a chunk is released by a timer that much later rather than at its next
chunk, which late in a piece can be seconds away. Once released, a piece's audio is sent as
soon as it exists. A held piece is also released when it is complete (the next piece starts,
the engine request ends), when production stops (end of the text, waiting for streamed text, an
error), and at the bound: ``max_hold_s`` (``--max-preroll-ms``) after the hold became audible
(the piece's first audio was ready and the client had played everything before it), and for a
response's first piece no later than :data:`FIRST_AUDIO_LIMIT_S` after the answer began for the
listener (the one-shot request arrived, the stream's first text came; Home Assistant's Voice PE
gives up at about 5 s without audio). On a machine faster than playback ``r >= 1`` and a piece
is held at most until its first chunk lasts until its second (a fraction of a second). Before
any chunk-to-chunk measurement (the first chunk of a fresh server's first response) ``r`` is
the response's audio per second of work so far, start-up included, which errs slow.

When the engine decodes the speech tokens in a thread of its own beside the flow
(``EngineOptions.split_cores``, the server's default on 2 or more CPUs), chunk to chunk is not
what a piece sustains: tokens decoded while earlier audio was being made let a piece's first
chunks follow each other faster than the decoding runs, and a long piece's later chunks then
wait for the decoding (on the 2-core Xeon of BENCHMARKS.md ``fast``'s decoding was busy 85-98 %
of the paragraph at 22-38 tokens/s while the DiT idled, so a rate learned from one-sentence
answers let the paragraph's long pieces start too early and pause inside). There ``r`` is the
audio produced per second of engine work since each engine request began, start-up included
(``decoding_ahead``), which the decoding cannot run ahead of.

That rate errs slow for a piece whose tokens are all decoded before its audio is made (the
decoding runs ahead; with two pieces decoded at once a later piece often is, long before its
first chunk): nothing of it waits for the LLM any more, and its length is known from its
tokens. The engine says so on every chunk (``AudioChunk.piece_left_s``, the audio the piece
still has to come, and ``decoding_done``), and such a piece is held for ``R`` = that length at
``r`` = the pace of chunks made from decoded pieces, chunk to chunk
(:meth:`PieceGate.decoded_rate`), measured apart while the decoding still runs beside the flow
(it takes its share of the cores) and after it has finished (:data:`REGIMES`).

A piece still being decoded is made at ``r`` only until its decoding ends; after that the
flow no longer waits for tokens, and when no later piece is decoded beside it, it has the
cores to itself (on the 2-core Xeon of BENCHMARKS.md, ``fast``'s one-piece sentence went from
about 0.9 to 1.57 s of audio a second there, so a prediction at the first pace held it too
long: "The gate that predicts the decoding's end"). The engine reports how much of the
piece is decoded on every chunk (``AudioChunk.piece_decoded_s``); the gate measures the
decoding's pace from the piece's first chunk on (:meth:`_Piece.decode_pace`), predicts when
it reaches the piece's expected length, and takes the chunks after that at the pace of
decoded pieces (:func:`needed_hold_s` ``switch_s`` and ``rate_after``): after the decoding
for the last piece of a request that can take no more text (``PieceGate.text_may_follow``),
beside it for any other, and never slower than ``r``.

The expected length of a piece is the speech of its text (:func:`expected_speech_s`) times
the ratio measured on earlier pieces (:meth:`ProductionHistory.length_ratio`) times
:data:`LENGTH_MARGIN`; for the last piece of an engine request, whose hold lengthens the
answer when it is the answer's last, the margin follows how far the prediction has missed
on recent pieces instead (:meth:`ProductionHistory.length_margin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from wyoming.event import Event

from ..engine.machine import PREDICTION_ERROR
from .protocol import CHANNELS, SAMPLE_WIDTH_BYTES, ClientGone

_LOGGER = logging.getLogger(__name__)

LATIN_CHARS_PER_S = 14.0
"""Characters of non-CJK text per second of speech, on the slow side of read English
(about 150 words/min x 5.5-6 characters with the blank = 14-15 characters/s; the benchmark
decodes 15 characters/s), so the expected length errs long and the hold errs safe."""
CJK_CHARS_PER_S = 4.0
"""Han, kana and hangul characters per second of speech (read Mandarin: about 4-5 syllables/s,
one character each), on the slow side for the same reason."""
FIRST_AUDIO_LIMIT_S = 2.45
"""Latest first audio after a response began (request or first streamed text), seconds,
unless the first chunk itself comes later: the listening target of 2.5 s for a 60-character
sentence (the Voice PE satellite gives up at about 5 s without audio, shared spec
``wyoming.md``), less the 10-20 ms a chunk takes to reach a client on the same host or LAN.
A lower limit releases a short first piece before its second chunk exists and puts a pause
inside it (BENCHMARKS.md, "What a listener hears")."""
FIRST_PIECE_MAX_S = 2.5
"""Longest expected speech of a response's first piece when synthesis is slower than
playback, seconds (35 Latin / 10 CJK characters): with ``r`` about 0.5 such a piece is safe
to play through after about its own length of production, within :data:`FIRST_AUDIO_LIMIT_S`
of a first chunk at 1-1.5 s (``balanced`` on the 2-core reference machine, BENCHMARKS.md)."""
FIRST_PIECE_MIN_S = 0.8
"""Shortest first piece, and shortest rest of its sentence, seconds (about two words): a
shorter cut saves little and leaves a fragment for the LLM to speak alone."""
LENGTH_MARGIN = 1.15
"""Factor on a piece's predicted length (for a request's last piece: until
:data:`MIN_PIECES_FOR_SPREAD` pieces were measured): predicting too short lets a pause fall
inside the piece, too long lengthens the pause before it and, for a response's last piece,
the whole answer (the measured ratio scatters by about +-10 % between sentences of the tiny
and the full model)."""
MIN_PIECES_FOR_SPREAD = 3
"""Pieces measured before the margin follows their measured spread instead of
:data:`LENGTH_MARGIN`."""
SPREAD_MARGIN_FACTOR = 2.0
"""The margin is ``1 + SPREAD_MARGIN_FACTOR x spread``, spread = the decayed mean relative
miss of the length prediction on recent pieces: about two typical misses of headroom."""
MIN_LENGTH_MARGIN = 1.03
"""Smallest margin: a piece's audio comes in whole mel frames and the speed resampler rounds,
so even a perfect ratio misses by a few per cent on short pieces."""
MAX_LENGTH_MARGIN = 1.3
"""Largest margin (a voice whose pieces scatter widely): beyond it the holds grow more than
the pauses inside pieces they would prevent."""
SEED_WORK_S = 2.0
"""Seconds of engine work a predicted rate counts as in a fresh server's history
(:meth:`ProductionHistory.seed_prediction`): it sizes the first answer's pieces and holds
instead of :data:`ASSUMED_SLOW_RATE`, and the first measured response replaces it."""
PRIOR_WEIGHT_S = 10.0
"""Seconds of engine work the runtime's history counts as, next to this response's own
measurement (which dominates after about one sentence)."""
HISTORY_DECAY = 0.5
"""Weight of the history against each new response: recent responses count most (the
machine's load changes)."""
PLANNED_HOLD_S = 8.0
"""The pause between pieces that pieces are sized for on a slow machine (:func:`piece_limit_s`),
seconds: about one sentence's hold at ``r`` = 0.5, where the splitter's sentences are the
pieces. Pieces are never cut below a clause, so on a slower machine their holds grow past this
(a 4 s sentence at ``r`` = 0.2 needs 16 s) up to ``--max-preroll-ms``; a larger bound therefore
moves pauses out of sentences instead of making pieces longer."""
PIECE_HOLD_SHARE = 0.7
"""Share of the planned hold (the smaller of :data:`PLANNED_HOLD_S` and ``--max-preroll-ms``)
that a piece's hold may take (:func:`piece_limit_s`): the rest covers a chunk longer than
planned, the length margin and a rate that drops within the piece."""
ASSUMED_SLOW_RATE = 0.5
"""Production rate (audio seconds per second) assumed for sizing pieces before anything was
measured: about ``balanced`` on the 2-core reference machine (RTF 1.9-2.2, BENCHMARKS.md), so a
fresh server on a slow machine cuts its first answer into sentences too; a fast machine's
measured rate lifts the bound from its next engine request on."""
RATE_MARGIN = 0.1
"""Production may run this much slower within a piece than measured so far (load from other
processes, a longer chunk) and the piece still plays through: the release rule uses
``r / (1 + RATE_MARGIN)``."""
ARRIVAL_MARGIN_S = 0.1
"""Seconds added to the audio a held piece needs in hand: a chunk reaches the client some tens
of milliseconds after it was made (worker thread -> event loop -> TCP), and a piece's second
chunk can follow its first by less than a quarter second, so without it a prediction exactly
on time lost 20-70 ms gaps inside the first piece (BENCHMARKS.md "What a listener hears")."""
MIN_PIECE_FOR_RATIO_S = 0.5
"""Pieces with less expected speech than this do not update the length ratio (too noisy)."""
MIN_PACE_SPAN_S = 0.3
"""Shortest time between a piece's first chunk and a later one over which the pace of its
LLM decoding is measured (:meth:`PieceGate._decoding_end`): at the 25-40 tokens a second the
decoding runs beside the flow on the 2-core reference machines (BENCHMARKS.md), 0.3 s spans
8-12 tokens, so the count's granularity of one token stays near :data:`RATE_MARGIN`."""
REGIMES = ("decoding", "decoded")
"""The two paces of a piece whose tokens are all decoded: while the request's LLM decoding
still runs beside the flow (it takes its share of the cores), and once it has finished."""


def _with_prior(audio_s: float, work_s: float, prior_audio_s: float,
                prior_work_s: float) -> tuple[float, float]:
    """``(audio, work)`` of this response plus a history's ``(audio, work)`` scaled to at most
    :data:`PRIOR_WEIGHT_S` of work (unchanged when the history holds nothing)."""
    if prior_work_s <= 0 or prior_audio_s <= 0:
        return audio_s, work_s
    weight = min(prior_work_s, PRIOR_WEIGHT_S)
    return audio_s + prior_audio_s / prior_work_s * weight, work_s + weight


def expected_speech_s(text: str) -> float:
    """Expected seconds of speech for ``text`` (see the module constants); >= 0."""
    cjk = sum(
        1 for c in text
        if "\u3040" <= c <= "\u30ff" or "\u3400" <= c <= "\u9fff" or "\uac00" <= c <= "\ud7af"
    )
    other = sum(1 for c in text if not c.isspace()) - cjk
    return cjk / CJK_CHARS_PER_S + max(other, 0) / LATIN_CHARS_PER_S


def needed_hold_s(remaining_s: float, rate: float, chunk_s: float = 0.0,
                  next_chunk_s: float = 0.0, max_chunk_s: float = 0.0,
                  switch_s: float = math.inf, rate_after: float | None = None) -> float:
    """Audio seconds that must be in hand (this piece's ``A`` plus the client's queue ``Q``)
    before a piece with ``remaining_s`` seconds still to come can play through.

    Audio comes in chunks: with chunks ``c_1 .. c_J`` still to come (sums ``S_j``, ``S_J`` =
    ``R``), chunk ``j`` is made ``S_j / r`` after the last one and is due ``A + Q + S_{j-1}``
    after the piece starts, so the piece plays through when::

        A + Q >= max_j (S_j / r - S_{j-1}) = max_j (S_j (1 / r - 1) + c_j)

    The chunks to come follow the engine's hop schedule: ``c_1`` = ``next_chunk_s``, each
    next one twice the one before up to ``max_chunk_s`` (cosyvoice/cli/model.py
    ``stream_scale_factor`` 2, ``token_max_hop_len``), the last one what remains of ``R``.
    Without ``next_chunk_s`` every chunk is taken as ``chunk_s`` long, and without either
    production as continuous (``R (1 / r - 1)``). For ``r < 1`` the last chunk binds; for
    ``r >= 1`` an early one (the hop grows faster than production runs ahead while
    ``r < 2``).

    With ``rate_after``, production changes pace after the first ``switch_s`` seconds of
    the piece still to come (its LLM decoding ends: module docstring): audio up to ``S``
    is made ``t(S)`` = ``S / r`` for ``S <= switch_s``, else ``switch_s / r +
    (S - switch_s) / rate_after``, and ``S_j / r`` above becomes ``t(S_j)``.

    Args:
        remaining_s: ``R``, expected seconds of the piece not produced yet (>= 0).
        rate: ``r``, audio seconds produced per second of work (> 0).
        chunk_s: ``d``, the longest chunk so far, seconds.
        next_chunk_s: ``c_1``, audio seconds of the piece's next chunk (the engine's next
            hop, :attr:`~..engine.options.AudioChunk.next_chunk_s`; 0: unknown).
        max_chunk_s: the longest chunk the hop schedule makes, seconds (0: ``c_1``).
        switch_s: audio seconds still to come that are made at ``rate`` (>= 0; inf: all).
        rate_after: audio seconds per second of work after ``switch_s`` (> 0), or None
            (``rate`` throughout).

    Returns:
        Seconds, >= 0; 0 when nothing remains.

    Raises:
        ValueError: ``rate`` <= 0, or ``rate_after`` given and <= 0.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if rate_after is not None and rate_after <= 0:
        raise ValueError(f"rate_after must be > 0, got {rate_after}")
    if remaining_s <= 0.0:
        return 0.0

    def made_at(audio_s: float) -> float:
        if rate_after is None or audio_s <= switch_s:
            return audio_s / rate
        return switch_s / rate + (audio_s - switch_s) / rate_after

    size = next_chunk_s if next_chunk_s > 0 else chunk_s
    if size <= 0:  # continuous: t(S) - S is piecewise linear, largest at a corner
        corners = (min(max(switch_s, 0.0), remaining_s), remaining_s)
        return max(0.0, *(made_at(corner) - corner for corner in corners))
    cap = max(max_chunk_s, size) if next_chunk_s > 0 else size
    need = made = 0.0
    while made < remaining_s:
        step = min(size, remaining_s - made)
        need = max(need, made_at(made + step) - made)
        made += step
        size = min(2.0 * size, cap)
    return need


def release_wait_s(in_hand_s: float, remaining_s: float, rate: float, chunk_s: float = 0.0,
                   next_chunk_s: float = 0.0, max_chunk_s: float = 0.0,
                   switch_s: float = math.inf, rate_after: float | None = None) -> float:
    """The gate's release rule: seconds from now until a piece with ``in_hand_s`` seconds
    of audio in hand (its own and the client's queue) and ``remaining_s`` still to come can
    start and play through: :func:`needed_hold_s` at ``rate`` (and ``rate_after``) lowered by
    :data:`RATE_MARGIN`, plus :data:`ARRIVAL_MARGIN_S` when anything is needed, less what is
    in hand (negative: it could have started that long ago). The other arguments as
    :func:`needed_hold_s`.

    Raises:
        ValueError: ``rate`` <= 0, or ``rate_after`` given and <= 0.
    """
    margin = 1.0 + RATE_MARGIN
    need = needed_hold_s(remaining_s, rate / margin, chunk_s, next_chunk_s, max_chunk_s,
                         switch_s, None if rate_after is None else rate_after / margin)
    if need > 0:
        need += ARRIVAL_MARGIN_S
    return need - in_hand_s


def first_piece_release_s(piece_s: float, rate: float, first_chunk_at_s: float,
                          first_chunk_s: float, max_chunk_s: float = 0.0) -> float:
    """When the gate would release a response's first piece, predicted before its engine
    request starts: seconds from now, by the rule of :meth:`PieceGate._safe_start` at the
    piece's first chunk.

    The first chunk brings ``first_chunk_s`` seconds of audio ``first_chunk_at_s`` from now;
    the rest of the piece (``piece_s`` less that) follows at ``rate`` lowered by
    :data:`RATE_MARGIN`, in chunks that double from twice the first up to ``max_chunk_s``
    (:func:`needed_hold_s`), plus :data:`ARRIVAL_MARGIN_S`. With the hop doubling, the hold
    a piece needs grows with its length until the chunks reach their longest (at ``rate``
    1.4, 0.4 s first hops and 4 s longest chunks, a piece of 6 s or more needs about 2 s in
    hand after its first chunk, a 4 s piece about 1.1 s), so a long first sentence can miss
    the first-audio limit on a machine faster than playback.

    Args:
        piece_s: expected seconds of the piece (its length margin included), >= 0.
        rate: audio seconds produced per second of work (> 0; :meth:`ProductionHistory.rate`).
        first_chunk_at_s: seconds from now until the first chunk is ready, >= 0.
        first_chunk_s: audio seconds of the first chunk (the engine's first hop), >= 0.
        max_chunk_s: the longest chunk the hop schedule makes, seconds (0: no bound).

    Returns:
        Seconds from now, >= ``first_chunk_at_s``.

    Raises:
        ValueError: ``rate`` <= 0.
    """
    rest_s = max(piece_s - first_chunk_s, 0.0)
    next_s = 2.0 * first_chunk_s if max_chunk_s <= 0 else min(2.0 * first_chunk_s, max_chunk_s)
    wait_s = release_wait_s(first_chunk_s, rest_s, rate, next_chunk_s=next_s,
                            max_chunk_s=max_chunk_s)
    return first_chunk_at_s + max(wait_s, 0.0)


def piece_limit_s(max_hold_s: float, rate: float | None) -> float | None:
    """Longest expected speech of a piece whose hold stays within the planned hold at ``rate``.

    A piece of ``L`` seconds made at ``r`` < 1 can play through once about ``L (1 - r)``
    seconds of it are in hand, i.e. after ``L (1 / r - 1)`` seconds of audible hold
    (:func:`needed_hold_s` with nothing queued); keeping that within
    :data:`PIECE_HOLD_SHARE` of ``H = min(max_hold_s, PLANNED_HOLD_S)`` gives
    ``L <= share x H x r / (1 - r)``. The splitter keeps whole clauses, so on a very slow
    machine the pieces stay longer than this and their holds longer than ``H``.

    Args:
        max_hold_s: the bound of one hold, seconds; 0 = audio is never held.
        rate: measured production rate ``r`` (audio seconds per second), or None before any
            measurement (then :data:`ASSUMED_SLOW_RATE`).

    Returns:
        Seconds, or None when pieces need no bound (nothing is held, or ``r >= 1``).
    """
    if max_hold_s <= 0:
        return None
    r = ASSUMED_SLOW_RATE if rate is None else rate
    if r >= 1.0:
        return None
    planned_s = min(max_hold_s, PLANNED_HOLD_S)
    return PIECE_HOLD_SHARE * planned_s * r / (1.0 - max(r, 0.0))


class ProductionHistory:
    """The runtime's recent production rate and piece-length ratio (one per server runtime;
    used on the event loop only).

    Attributes:
        audio_s: decayed sum of audio seconds produced within pieces (after each piece's
            first chunk) by finished responses.
        work_s: decayed sum of the seconds that took.
        ratio: measured / expected length of recent pieces (None before the first).
        spread: decayed mean of ``|piece ratio / predicted ratio - 1|`` over the pieces
            measured after the first (None before the second).
        pieces: pieces counted in ``ratio``.
        seeded: ``audio_s`` and ``work_s`` hold only a predicted rate (:meth:`seed`), no
            measurement yet.
        decoded_rates: per :data:`REGIMES` entry, decayed ``[audio seconds, work seconds]``
            of chunks made from a piece whose tokens were all decoded at its previous chunk
            (the flow and the vocoder alone set their pace; :meth:`PieceGate.decoded_rate`).
        first_chunk_s: decayed mean seconds from a response's first engine request to its
            first chunk (prefill, first hop, first flow and vocoder calls), or None before
            any (:meth:`add_first_chunk`).
    """

    def __init__(self) -> None:
        self.audio_s = 0.0
        self.work_s = 0.0
        self.first_chunk_s: float | None = None
        self.decoded_rates: dict[str, list[float]] = {regime: [0.0, 0.0] for regime in REGIMES}
        self.ratio: float | None = None
        self.spread: float | None = None
        self.pieces = 0
        self.seeded = False

    def seed_prediction(self, predicted_rtf: float, error: float = PREDICTION_ERROR) -> None:
        """Start from ``--preset auto``'s predicted real-time factor, as a production rate
        ``1 / (RTF x (1 + error))`` (``error``: the preset's
        :data:`~..engine.machine.PREDICTION_ERRORS`): the prediction may be that much too low, so a
        preset predicted just faster than playback still gets bounded pieces and held first
        pieces. It counts as :data:`SEED_WORK_S` of work until the first response is measured,
        which replaces it (a prediction is not a measurement); within the first answer a
        measured piece outweighs it (:meth:`PieceGate.rate`). Nothing for RTF <= 0."""
        if predicted_rtf > 0:
            rate = 1.0 / (predicted_rtf * (1.0 + error))
            self.audio_s, self.work_s, self.seeded = rate * SEED_WORK_S, SEED_WORK_S, True

    def rate(self) -> float | None:
        """Audio seconds per second within pieces of recent responses, or None before any."""
        return self.audio_s / self.work_s if self.work_s > 0 and self.audio_s > 0 else None

    def add_response(self, audio_s: float, work_s: float) -> None:
        """Count one finished response's chunk-to-chunk production (nothing when none)."""
        if audio_s > 0 and work_s > 0:
            if self.seeded:  # the first measurement replaces the prediction
                self.audio_s = self.work_s = 0.0
                self.seeded = False
            self.audio_s = self.audio_s * HISTORY_DECAY + audio_s
            self.work_s = self.work_s * HISTORY_DECAY + work_s

    def add_first_chunk(self, latency_s: float) -> None:
        """Count one response's seconds from its first engine request to its first chunk
        (recent responses count most, :data:`HISTORY_DECAY`)."""
        if latency_s >= 0:
            self.first_chunk_s = latency_s if self.first_chunk_s is None else (
                self.first_chunk_s * HISTORY_DECAY + latency_s * (1 - HISTORY_DECAY))

    def add_decoded(self, regime: str, audio_s: float, work_s: float) -> None:
        """Count one finished response's chunks from decoded pieces in ``regime`` (nothing
        when none)."""
        if audio_s > 0 and work_s > 0:
            sums = self.decoded_rates[regime]
            sums[0] = sums[0] * HISTORY_DECAY + audio_s
            sums[1] = sums[1] * HISTORY_DECAY + work_s

    def add_piece(self, measured_s: float, expected_s: float) -> None:
        """Count one complete piece: ``measured_s`` of audio for ``expected_s`` expected."""
        if expected_s < MIN_PIECE_FOR_RATIO_S or measured_s <= 0:
            return
        ratio = measured_s / expected_s
        if self.ratio is not None:
            miss = abs(ratio / self.ratio - 1.0)
            self.spread = miss if self.spread is None else (
                self.spread * HISTORY_DECAY + miss * (1 - HISTORY_DECAY))
        self.ratio = ratio if self.ratio is None else (
            self.ratio * HISTORY_DECAY + ratio * (1 - HISTORY_DECAY))
        self.pieces += 1

    def length_ratio(self) -> float:
        """Factor from :func:`expected_speech_s` to the measured length (1 before any)."""
        return 1.0 if self.ratio is None else self.ratio

    def length_margin(self) -> float:
        """Factor on the predicted length of a piece: :data:`LENGTH_MARGIN` before
        :data:`MIN_PIECES_FOR_SPREAD` pieces, then ``1 + SPREAD_MARGIN_FACTOR x spread``
        within :data:`MIN_LENGTH_MARGIN` .. :data:`MAX_LENGTH_MARGIN`."""
        if self.spread is None or self.pieces < MIN_PIECES_FOR_SPREAD:
            return LENGTH_MARGIN
        margin = 1.0 + SPREAD_MARGIN_FACTOR * self.spread
        return min(MAX_LENGTH_MARGIN, max(MIN_LENGTH_MARGIN, margin))


@dataclass
class _Piece:
    """One piece being produced: its held events and figures."""

    key: tuple[int, int]
    expected_s: float
    first_at: float
    deadline: float
    audio_s: float = 0.0
    last_chunk_at: float = 0.0
    next_chunk_s: float = 0.0
    left_s: float | None = None
    decoding_done: bool = False
    decoded_s: float = 0.0
    decoded_from: tuple[float, float] | None = None
    """``(clock(), decoded_s)`` at the piece's first chunk: where its decoding pace is
    measured from."""
    released: bool = False
    held: list[tuple[list[Event], float]] = field(default_factory=list)

    def decode_pace(self, now: float) -> float | None:
        """Audio seconds of the piece's tokens decoded per second since its first chunk, or
        None before :data:`MIN_PACE_SPAN_S` or without any."""
        if self.decoded_from is None:
            return None
        since, decoded = self.decoded_from
        if now - since < MIN_PACE_SPAN_S or self.decoded_s <= decoded:
            return None
        return (self.decoded_s - decoded) / (now - since)


class PieceGate:
    """Per-response gate between the synthesis and the connection (one per response).

    Call :meth:`begin_text` before each engine request, :meth:`add_pieces` when it takes
    more, :meth:`audio` for each of its chunks, :meth:`end_text` after it (also after a
    failure), :meth:`release` when production stops for a while, and :meth:`close` at the
    end of the response.

    Args:
        send: writes one event to the client (``EventSink.send``).
        max_hold_s: longest audible silence one hold may add, seconds; 0 = never hold.
        history: the runtime's :class:`ProductionHistory` (updated at :meth:`close`).
        clock: monotonic seconds (tests pass their own).
        first_audio_limit_s: :data:`FIRST_AUDIO_LIMIT_S`.
        decoding_ahead: the engine decodes the tokens in a thread of its own
            (``EngineOptions.split_cores``): ``r`` is audio per second of engine work, start-up
            included, instead of chunk to chunk (module docstring).

    Attributes:
        first_sent_at: ``clock()`` when the first audio was sent, or None.
        held_s: seconds the first audio was held after it was ready (0 until sent).
        piece_starts_samples: sample offset, in the audio sent, of the first sample of each
            piece (24 kHz samples; the benchmark tells pauses between pieces from pauses
            inside one with these).
        sent_samples: samples sent so far.
        holds: ``(audible hold seconds, piece key)`` of every held piece, for the log.
        text_may_follow: whether text may still join the running engine request (set by the
            caller; default: never, as for a one-shot request).
    """

    def __init__(
        self,
        send: Callable[[Event], Awaitable[None]],
        max_hold_s: float,
        history: ProductionHistory,
        clock: Callable[[], float] = time.monotonic,
        first_audio_limit_s: float = FIRST_AUDIO_LIMIT_S,
        decoding_ahead: bool = False,
    ) -> None:
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s must be >= 0, got {max_hold_s}")
        self._send = send
        self.max_hold_s = max_hold_s
        self.history = history
        self._clock = clock
        self.first_audio_limit_s = first_audio_limit_s
        self.decoding_ahead = decoding_ahead
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self._texts = 0
        self._expected: list[float] = []
        self._piece: _Piece | None = None
        self._work_since: float | None = None
        self.started_at: float | None = None
        self.first_audio_from: float | None = None
        """``clock()`` when the listener's answer began (the one-shot request arrived, the
        stream's first text came), set by the caller; the first audio is due
        ``first_audio_limit_s`` after it. None: after the first engine request began."""
        self.first_audio_at: float | None = None
        self.first_sent_at: float | None = None
        self.produced_s = 0.0
        self.work_s = 0.0
        self.steady_audio_s = 0.0
        """Audio produced within pieces after their first chunk, seconds."""
        self.steady_work_s = 0.0
        """Seconds from each such chunk's predecessor in its piece to it."""
        self.decoded_sums: dict[str, list[float]] = {regime: [0.0, 0.0] for regime in REGIMES}
        """Per regime, ``[audio s, work s]`` of this response's chunks whose piece was all
        decoded at its previous chunk (:meth:`decoded_rate`)."""
        self.longest_chunk_s = 0.0
        self.held_s = 0.0
        self.play_end: float | None = None
        self.sent_samples = 0
        self.piece_starts_samples: list[int] = []
        self.holds: list[tuple[float, tuple[int, int]]] = []
        self.release_due: float | None = None
        """``clock()`` at which the held piece is released (the earliest safe start or its
        bound), or None when nothing is held."""
        self._last_sent_key: tuple[int, int] | None = None
        self.max_chunk_s = 0.0
        self.text_may_follow: Callable[[], bool] = lambda: False
        """Whether text may still join the running engine request (a stream's text still
        arriving or queued; set by the caller): then the decoding may go on after the
        request's last known piece."""

    def first_audio_due_in_s(self) -> float | None:
        """Seconds from now until the first audio is due (:attr:`first_audio_from` plus
        ``first_audio_limit_s``; negative once past), or None when the answer's start is not
        known yet."""
        if self.first_audio_from is None:
            return None
        return self.first_audio_from + self.first_audio_limit_s - self._clock()

    # --- the production side ------------------------------------------------------------
    def begin_text(self, piece_expected_s: Sequence[float], max_chunk_s: float = 0.0) -> None:
        """An engine request starts; ``piece_expected_s`` = expected speech of each of its
        pieces in seconds (from their texts; the last entry stands for any later piece);
        ``max_chunk_s`` = the longest chunk its hop schedule makes (``max_hop_tokens`` / 25
        per second / speed; 0: unknown)."""
        now = self._clock()
        self.max_chunk_s = max_chunk_s
        if self.started_at is None:
            self.started_at = now
        self._texts += 1
        self._expected = list(piece_expected_s) or [0.0]
        self._work_since = now

    def add_pieces(self, piece_expected_s: Sequence[float]) -> None:
        """The running engine request took more pieces (a stream's later text); their
        expected speech in seconds, in order."""
        self._expected.extend(piece_expected_s)

    def stop_work(self) -> None:
        """The engine request stopped working (done or failed): its work time is counted."""
        if self._work_since is not None:
            self.work_s += self._clock() - self._work_since
            self._work_since = None

    async def end_text(self) -> None:
        """The engine request ended: its last piece is complete (sent now if held).

        Raises:
            ClientGone: the client disconnected.
        """
        self.stop_work()
        async with self._lock:
            await self._finish_piece()

    def rate(self) -> float | None:
        """``r``: audio seconds per second within pieces (with ``decoding_ahead``: per second
        of engine work), this response blended with the history (:data:`PRIOR_WEIGHT_S`);
        without either, audio per second of work so far; None before any audio."""
        audio, work = self._measured()
        if not (self.history.seeded and work > 0 and audio > 0):
            # a predicted prior counts only until this response measured production
            audio, work = _with_prior(audio, work, self.history.audio_s, self.history.work_s)
        if work > 0 and audio > 0:
            return audio / work
        work = self._work_so_far()
        return self.produced_s / work if work > 0 and self.produced_s > 0 else None

    def decoded_rate(self, decoding_done: bool) -> float | None:
        """Audio seconds per second made from pieces whose tokens were all decoded (the
        flow's and the vocoder's pace, chunk to chunk; no wait for the LLM in it), this
        response blended with the history (:data:`PRIOR_WEIGHT_S`), for the regime
        ``decoding_done`` names; once the decoding is done and that pace is not measured
        yet, the pace beside the decoding (which is slower: the decoding took cores); None
        when neither is measured."""
        regimes = REGIMES[::-1] if decoding_done else REGIMES[:1]
        for regime in regimes:
            audio, work = _with_prior(*self.decoded_sums[regime],
                                      *self.history.decoded_rates[regime])
            if work > 0 and audio > 0:
                return audio / work
        return None

    def _work_so_far(self) -> float:
        """Seconds the engine requests of this response have worked, the running one to now."""
        if self._work_since is None:
            return self.work_s
        return self.work_s + self._clock() - self._work_since

    def _measured(self) -> tuple[float, float]:
        """(audio seconds, work seconds) this response's rate is measured from: within pieces
        after their first chunk, or with ``decoding_ahead`` all of it."""
        if self.decoding_ahead:
            return self.produced_s, self._work_so_far()
        return self.steady_audio_s, self.steady_work_s

    async def audio(self, events: list[Event], duration_s: float, piece_index: int = 0,
                    next_chunk_s: float = 0.0, piece_done: bool = False,
                    piece_left_s: float | None = None, decoding_done: bool = False,
                    piece_decoded_s: float = 0.0) -> None:
        """Send (or hold) the ``audio-chunk`` events of one engine chunk of ``duration_s``
        seconds that belongs to piece ``piece_index`` of the current engine request;
        ``next_chunk_s`` = the audio seconds the piece's next chunk will bring (0: unknown
        or none); ``piece_done``: the piece's last chunk (it is released at once: nothing
        more of it can run dry); ``piece_left_s``: the piece's audio still to come, known
        once its tokens are all decoded (None: not yet); ``decoding_done``: the request's
        decoding had finished; ``piece_decoded_s``: the piece's tokens decoded so far, in
        audio seconds (0: unknown) (all three as :class:`~..engine.options.AudioChunk`).

        Raises:
            ClientGone: the client disconnected.
        """
        async with self._lock:
            now = self._clock()
            key = (self._texts, piece_index)
            if self._piece is None or self._piece.key != key:
                await self._finish_piece()
                self._piece = self._start_piece(key, now)
            elif duration_s > 0:
                since = now - self._piece.last_chunk_at
                self.steady_audio_s += duration_s
                self.steady_work_s += since
                if self._piece.left_s is not None:  # made by the flow alone
                    sums = self.decoded_sums[REGIMES[self._piece.decoding_done]]
                    sums[0] += duration_s
                    sums[1] += since
            piece = self._piece
            piece.last_chunk_at = now
            piece.next_chunk_s = next_chunk_s
            piece.left_s = piece_left_s
            piece.decoding_done = decoding_done
            piece.decoded_s = piece_decoded_s
            if piece.decoded_from is None and piece_decoded_s > 0:
                piece.decoded_from = (now, piece_decoded_s)
            self.produced_s += duration_s
            self.longest_chunk_s = max(self.longest_chunk_s, duration_s)
            piece.audio_s += duration_s
            if self.first_audio_at is None:
                self.first_audio_at = now
            if piece.released:
                await self._send_chunk(piece.key, events, duration_s)
                return
            piece.held.append((events, duration_s))
            if piece_done or self._can_play_through(piece, now) or now >= piece.deadline:
                await self._release_piece(piece)
            else:
                self._schedule_release(piece, now)

    async def release_if_due(self) -> None:
        """Release the held piece if its planned release time (:attr:`release_due`) has come
        by ``clock()`` (for a caller whose clock is not the event loop's; the gate's own
        timer releases on time otherwise).

        Raises:
            ClientGone: the client disconnected.
        """
        async with self._lock:
            piece = self._piece
            if (piece is not None and not piece.released and self.release_due is not None
                    and self._clock() >= self.release_due):
                await self._release_piece(piece)

    async def release(self) -> None:
        """Send everything held; the current piece plays through (production pauses).

        Raises:
            ClientGone: the client disconnected.
        """
        async with self._lock:
            if self._piece is not None:
                await self._release_piece(self._piece)

    async def close(self) -> None:
        """End of the response: count it in the history and stop the timer (held audio is
        not sent; call :meth:`release` first)."""
        self._cancel_timer()
        self.history.add_response(*self._measured())
        if self.first_audio_at is not None and self.started_at is not None:
            self.history.add_first_chunk(self.first_audio_at - self.started_at)
        for regime, (audio_s, work_s) in self.decoded_sums.items():
            self.history.add_decoded(regime, audio_s, work_s)
        if self.holds:
            _LOGGER.debug("held pieces (audible s, key): %s",
                          ", ".join(f"{s:.2f} {k}" for s, k in self.holds))

    # --- the rule -----------------------------------------------------------------------
    def _start_piece(self, key: tuple[int, int], now: float) -> _Piece:
        index = min(key[1], len(self._expected) - 1)
        # the measured margin only for the request's last piece: holding it for length that
        # never comes lengthens the answer, while a longer hold before an earlier piece is
        # paid back (the next piece finds that much more audio queued) and the fixed margin
        # also covers a rate that drops within a long piece
        last = index == len(self._expected) - 1
        margin = self.history.length_margin() if last else LENGTH_MARGIN
        expected = self._expected[index] * self.history.length_ratio() * margin
        queued_end = self.play_end if self.play_end is not None else now
        deadline = max(now, queued_end) + self.max_hold_s
        origin = self.first_audio_from if self.first_audio_from is not None else self.started_at
        if self.first_sent_at is None and origin is not None:
            deadline = min(deadline, max(now, origin + self.first_audio_limit_s))
        return _Piece(key, expected, now, deadline, last_chunk_at=now,
                      released=self.max_hold_s == 0)

    def _can_play_through(self, piece: _Piece, now: float) -> bool:
        start = self._safe_start(piece, now)
        return start is not None and max(self.play_end or now, now) >= start

    def _safe_start(self, piece: _Piece, now: float) -> float | None:
        """Earliest time the held piece can start playing and not run dry, or None before
        any rate: ``now + need - A`` (:func:`release_wait_s`). Waiting with nothing queued
        buys one second of production per second, so a piece short of
        ``A + Q >= R (1/r - 1) + d`` at a chunk is safe that much later, usually well before
        its next chunk (several seconds apart late in a piece)."""
        rate = self.rate()
        remaining = max(piece.expected_s - piece.audio_s, 0.0)
        switch_s, rate_after = math.inf, None
        if piece.left_s is not None:
            # the piece's tokens are all decoded: its length is known and only the flow and
            # the vocoder remain, at their own pace (the rate over the engine work counts
            # start-ups and the decoding's share of the cores: module docstring)
            decoded = self.decoded_rate(piece.decoding_done)
            if decoded is not None:
                rate, remaining = decoded, piece.left_s
        elif rate is not None:
            switch_s, rate_after = self._decoding_end(piece, now, rate)
        if rate is None:
            return None
        return now + release_wait_s(piece.audio_s, remaining, rate, self.longest_chunk_s,
                                    piece.next_chunk_s, self.max_chunk_s, switch_s,
                                    rate_after)

    def _decoding_end(self, piece: _Piece, now: float,
                      rate: float) -> tuple[float, float | None]:
        """For a piece still being decoded, made at ``rate``: ``(switch_s, rate_after)`` for
        :func:`needed_hold_s`. Its decoding goes on at the pace measured since its first
        chunk (:meth:`_Piece.decode_pace`) until its expected length is decoded; the flow
        then makes the rest at the pace of decoded pieces (:meth:`decoded_rate`: beside the
        decoding of a later piece, or alone when none can follow), never slower than before
        (the flow no longer waits for tokens). ``(inf, None)`` (one pace) before the
        decoding pace or the later pace is measured, and once the piece has decoded its
        expected length (it runs longer than predicted: its end is not known)."""
        pace = piece.decode_pace(now)
        after = self.decoded_rate(piece.key[1] >= len(self._expected) - 1
                                  and not self.text_may_follow())
        if pace is None or after is None or piece.decoded_s >= piece.expected_s:
            return math.inf, None
        margin = 1.0 + RATE_MARGIN
        decoding_left_s = max(piece.expected_s - piece.decoded_s, 0.0) / (pace / margin)
        return rate / margin * decoding_left_s, max(after, rate)

    def _schedule_release(self, piece: _Piece, now: float) -> None:
        due = piece.deadline
        start = self._safe_start(piece, now)
        if start is not None:
            due = min(due, start)
        if due == self.release_due and self._timer is not None:
            return
        self._cancel_timer()
        self.release_due = due
        self._timer = asyncio.create_task(self._release_at(due))

    async def _finish_piece(self) -> None:
        piece, self._piece = self._piece, None
        if piece is None:
            return
        index = min(piece.key[1], len(self._expected) - 1)
        self.history.add_piece(piece.audio_s, self._expected[index])
        await self._release_piece(piece)

    async def _release_piece(self, piece: _Piece) -> None:
        if piece.released:
            return
        piece.released = True
        self._cancel_timer()
        self.release_due = None
        now = self._clock()
        audible_from = max(piece.first_at, self.play_end or piece.first_at)
        if piece.held:
            self.holds.append((max(now - audible_from, 0.0), piece.key))
            if self.first_sent_at is None and self.first_audio_at is not None:
                self.held_s = now - self.first_audio_at
        held, piece.held = piece.held, []
        for events, duration_s in held:
            await self._send_chunk(piece.key, events, duration_s)

    async def _send_chunk(self, key: tuple[int, int], events: list[Event],
                          duration_s: float) -> None:
        if self._last_sent_key != key:
            self.piece_starts_samples.append(self.sent_samples)
            self._last_sent_key = key
        for event in events:
            await self._send(event)
            if self.first_sent_at is None:
                self.first_sent_at = self._clock()
            self.sent_samples += len(event.payload or b"") // (SAMPLE_WIDTH_BYTES * CHANNELS)
        # the client's playback clock: it plays from the first audio on, waits when dry
        now = self._clock()
        self.play_end = max(self.play_end if self.play_end is not None else now, now) + duration_s

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()

    async def _release_at(self, due: float) -> None:
        await asyncio.sleep(max(due - self._clock(), 0.0))
        with contextlib.suppress(ClientGone):  # the request's own next send reports it
            async with self._lock:
                if self._timer is not asyncio.current_task():
                    return  # rescheduled or released meanwhile
                self._timer = None
                if self._piece is not None:
                    await self._release_piece(self._piece)
