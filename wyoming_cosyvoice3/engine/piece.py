"""One text piece (utterance) of a request: its token filter, mel stream and audio stream."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import constants as C
from .flow.melops import SpeedResampler
from .flow.stream import MelStream
from .llm.sampling import SilentRunFilter
from .request import RequestState
from .vocoder.hift import VocoderStream
from .vocoder.schedule import may_defer


@dataclass
class PieceState:
    """State of one text piece inside a request.

    Attributes:
        index: the piece's index in the request's text.
        mel: the piece's flow (tokens, chunk offsets, hop, key/value history).
        resampler: the speed resampler of the piece's mel.
        vocoder: the piece's streaming vocoder.
        silent_filter: drops the LLM's over-long silent-token runs.
        last_chunk_s: request-relative time of the piece's previous flow chunk (or of its
            start).
    """

    index: int
    mel: MelStream
    resampler: SpeedResampler
    vocoder: VocoderStream
    silent_filter: SilentRunFilter = field(default_factory=SilentRunFilter)
    last_chunk_s: float = 0.0

    def defer_vocoder(self, req: RequestState, new_frames: int, final: bool) -> bool:
        """Whether the vocoder leaves this chunk's ``new_frames`` mel frames for its next
        call (``SynthesisOptions.vocoder_defer``, :func:`.vocoder.schedule.may_defer`); also
        starts timing the next chunk."""
        now = req.now()
        since, self.last_chunk_s = now - self.last_chunk_s, now
        if final or not req.options.vocoder_defer:
            return False
        times = req.times
        per_frame = times.vocoder_s / times.vocoder_frames if times.vocoder_frames else None
        next_frames = new_frames + C.TOKEN_MEL_RATIO * self.mel.hop_tokens
        return may_defer(req.lead_s(), since, per_frame, self.vocoder.frames_for_call(next_frames))
