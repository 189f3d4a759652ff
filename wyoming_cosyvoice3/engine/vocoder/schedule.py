"""When the vocoder runs: decoupled from the flow's chunks while the audio already sent lasts.

Every streamed vocoder call re-runs frames another call already ran: with the exact vocoder
(``vocoder_window_frames`` 0) all mel of the utterance so far (upstream model.py
``CosyVoice3Model.token2wav`` re-runs hift on all mel at every chunk), with a window its left
context, and always the 8 held-back right-context frames. Running it after every flow chunk
(20, 40, 80, ... frames) makes the streamed vocoder cost 1.2-2x one call over the same frames
(BENCHMARKS.md, "Streamed vocoder"). Running it less often is exact for the exact vocoder
(samples do not depend on how the mel was cut) and brings the cost towards one call.

Rule (``SynthesisOptions.vocoder_defer``): the vocoder may skip a non-final flow chunk (its
mel waits for the next call) while the audio already emitted and not yet played is more than
``margin`` x the time until the next call would emit: the next flow chunk (estimated as twice
the time since the piece's previous chunk, as the hop doubles) plus the vocoder run itself
(measured seconds per frame of this request x the frames it will run). Playback is assumed to
start when the request's first chunk was emitted, so the estimate of the audio in hand is low
when a server holds the first audio back (pre-roll). The first chunk of a request and the last
chunk of every piece are never deferred.
"""

from __future__ import annotations

DEFAULT_MARGIN = 1.5
"""Safety factor on the estimated time until the next vocoder call (this project's choice, not
from upstream, which always vocodes every chunk): a 50 % misestimate of the next chunk's time
still leaves audio in hand."""


def may_defer(
    lead_s: float,
    since_last_chunk_s: float,
    vocoder_s_per_frame: float | None,
    frames_next_call: int,
    margin: float = DEFAULT_MARGIN,
) -> bool:
    """True when the vocoder may leave this chunk's mel for its next call.

    Args:
        lead_s: seconds of emitted audio not yet played (<= 0: playback waits for audio).
        since_last_chunk_s: seconds since the piece's previous flow chunk (or its start).
        vocoder_s_per_frame: measured vocoder seconds per mel frame run in this request;
            None before the first call (never defer then).
        frames_next_call: mel frames the deferred call will run (window or all, new frames,
            the next chunk's frames).
        margin: safety factor (>= 1).

    Returns:
        True if ``lead_s > margin * (2 * since_last_chunk_s + vocoder_s_per_frame *
        frames_next_call)``.
    """
    if vocoder_s_per_frame is None or lead_s <= 0.0:
        return False
    next_emission_s = 2.0 * since_last_chunk_s + vocoder_s_per_frame * frames_next_call
    return lead_s > margin * next_emission_s
