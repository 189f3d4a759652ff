"""Vocoder: 50 Hz mel frames -> 24 kHz samples, streamed exactly (spec section 6).

``hift.onnx`` is upstream's CausalHiFTGenerator (f0 predictor, harmonic source, generator) up
to the STFT magnitude and phase; the iSTFT, the magnitude clip and the output clamp run on the
host (cosyvoice/hifigan/generator.py ``CausalHiFTGenerator.decode`` and ``HiFTGenerator._istft``).

Streaming: the generator is causal apart from a right context of 3 + 4 + 1 mel frames
(``conv_pre_look_right`` 4, the f0 predictor's causal padding 3, one iSTFT frame). With one
fixed U[0,1) source-noise buffer per request, running the graph on all mel so far and keeping
only samples before ``480 * (M - 8)`` gives the same samples as one pass over the whole mel;
the final call emits up to ``480 * M``. The harmonic source accumulates phase over the whole
utterance, so a bounded left window is not exact: by default the graph sees all mel, which makes
the vocoder's cost quadratic in the utterance length (as upstream: model.py
``CosyVoice3Model.token2wav`` re-runs hift on all mel of the utterance at every chunk).

The streamed form (:mod:`..derive.vocoder.hift_stream`, :class:`StreamedHift`) carries that
state between calls and runs each mel frame once; the calls of ``hift.onnx`` below are its
fallback, used only when it cannot be derived.

``window_frames`` > 0 (``SynthesisOptions.vocoder_window_frames``, a lossy preset's bound for
that fallback) bounds the re-run: each call runs the graph on the last ``window_frames``
already-emitted frames plus the new ones (with the noise columns of those frames, so the noise
still lines up). The causal convolutions see their real left context when the window covers
their receptive field (16 mel frames on the upstream-exported parity model), but the harmonic
source restarts its phase at the window start, so its harmonics are phase-shifted against the
exact path; to avoid a jump at the seam, the first ``crossfade`` samples of each call are
cross-faded with the previous call's own samples for the same span (computed, held back).

When the vocoder runs (last section, :func:`may_defer`): decoupled from the flow's chunks
while the audio already sent lasts. Every streamed vocoder call re-runs frames another call
already ran: with the exact vocoder (``vocoder_window_frames`` 0) all mel of the utterance so
far, with a window its left context, and always the 8 held-back right-context frames. Running it
after every flow chunk (20, 40, 80, ... frames) makes the streamed vocoder cost 1.2-2x one call
over the same frames (BENCHMARKS.md, "Streamed vocoder"). Running it less often is exact for
the exact vocoder (samples do not depend on how the mel was cut) and brings the cost towards
one call. Rule (``VocoderPreset.defer``): the vocoder may skip a non-final flow
chunk (its mel waits for the next call) while the audio already emitted and not yet played is
more than ``margin`` x the time until the next call would emit: the next flow chunk (estimated
as twice the time since the piece's previous chunk, as the hop doubles) plus the vocoder run
itself (measured seconds per frame of this request x the frames it will run). Playback is
assumed to start when the request's first chunk was emitted, so the estimate of the audio in
hand is low when a server holds the first audio back (pre-roll). The first chunk of a request
and the last chunk of every piece are never deferred.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..errors import GraphSignatureMismatch, SynthesisCancelled
from ..istft import istft
from ..noise import GrowingNoise
from ..options import ShouldStop, StageTimes

if TYPE_CHECKING:
    from ..sessions import Graph

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]
_HIFT_INPUTS = ("speech_feat", "noise")
_HIFT_OUTPUTS = ("magnitude", "phase")
_FIRST_INPUT, _FINAL_INPUT = "stream_first", "stream_final"
_STATE_IN, _STATE_OUT = "stream_state_in.", "stream_state_out."
"""The streamed graph's extra inputs and outputs (:mod:`..derive.vocoder.hift_stream`)."""
_ISTFT_KEEP_FRAMES = 4
"""STFT frames kept between calls: a sample needs the 4 frames whose windows cover it."""
CROSSFADE_MS = 20.0
"""Seam cross-fade of the windowed vocoder (only with ``window_frames`` > 0)."""


def fade_in_gain(start_sample: int, n_samples: int, fade_samples: int) -> FloatArray:
    """Raised-cosine fade-in gains for samples ``start_sample .. start_sample + n_samples``.

    The gain rises from 0 at sample 0 to 1 at ``fade_samples`` (half a Hann window) and is 1
    after; spec section 6 (upstream clicks at onset).

    Returns:
        float32 [n_samples].
    """
    idx = np.arange(start_sample, start_sample + n_samples, dtype=np.float64)
    if fade_samples <= 0:
        return np.ones(n_samples, dtype=np.float32)
    ramp = 0.5 - 0.5 * np.cos(np.pi * np.clip(idx / fade_samples, 0.0, 1.0))
    return ramp.astype(np.float32)


@dataclass(frozen=True)
class StreamedHift:
    """The streamed vocoder graph (:mod:`..derive.vocoder.hift_stream`) and what its report says.

    Attributes:
        graph: inputs ``speech_feat``, ``noise``, ``stream_first``, ``stream_final`` and
            ``stream_state_in.<i>``; outputs ``magnitude``, ``phase``, ``stream_state_out.<i>``.
        state_shapes: per state, its dims with -1 on the time axis (each starts empty).
        lookahead_frames: mel frames a non-final call holds back (4 upstream).
        min_first_frames: fewest mel frames of the first non-final call.
    """

    graph: Graph
    state_shapes: tuple[tuple[int, ...], ...]
    lookahead_frames: int
    min_first_frames: int

    def initial_states(self) -> list[FloatArray]:
        """Empty states (time length 0) for a new utterance."""
        return [np.zeros([0 if d < 0 else d for d in shape], np.float32)
                for shape in self.state_shapes]

    def step(
        self, mel: FloatArray, noise: FloatArray, states: list[FloatArray], first: bool,
        final: bool,
    ) -> tuple[FloatArray, FloatArray, list[FloatArray]]:
        """One call: the next magnitude and phase frames and the new states.

        Args:
            mel: float32 [80, n] new mel frames (n >= 1).
            noise: float32 [480 n, 9] their source noise rows.
            states: from :meth:`initial_states` or the previous call.
            first, final: the utterance's first / last call.

        Returns:
            (magnitude float32 [9, k] clipped at 100, phase float32 [9, k], states).
        """
        feeds: dict[str, npt.NDArray[np.generic]] = {
            "speech_feat": np.ascontiguousarray(mel, dtype=np.float32)[None],
            "noise": np.ascontiguousarray(noise, dtype=np.float32)[None],
            _FIRST_INPUT: np.array([int(first)], np.int64),
            _FINAL_INPUT: np.array([int(final)], np.int64),
        }
        feeds.update({f"{_STATE_IN}{i}": state for i, state in enumerate(states)})
        names = ["magnitude", "phase"] + [f"{_STATE_OUT}{i}" for i in range(len(states))]
        out = self.graph.run(feeds, names)
        magnitude = np.minimum(np.asarray(out["magnitude"], np.float32)[0], C.MAGNITUDE_CLIP)
        phase = np.asarray(out["phase"], np.float32)[0]
        return magnitude, phase, [np.asarray(out[n], np.float32) for n in names[2:]]


class HiftRunner:
    """Runs ``hift.onnx`` plus the host-side iSTFT for one model; holds no request state.

    Args:
        hift: the loaded hift graph (inputs ``speech_feat``, ``noise``; outputs ``magnitude``,
            ``phase``), or a loader of it called on the first whole-mel call.
        stream: the streamed graph (:class:`StreamedHift`): streaming runs each mel frame
            once; None: streaming re-runs the whole mel or a window.

    Raises:
        GraphSignatureMismatch: the graph lacks those names.
    """

    def __init__(
        self, hift: Graph | Callable[[], Graph], stream: StreamedHift | None = None,
    ) -> None:
        self._graph: Graph | None = None
        self._load: Callable[[], Graph] | None = None
        if callable(hift):  # a Graph is not callable: a loader, called on the first use
            self._load = hift
        else:
            self._graph = self._checked(hift)
        self.stream = stream

    @staticmethod
    def _checked(hift: Graph) -> Graph:
        names_in, names_out = set(hift.spec.inputs), set(hift.spec.outputs)
        wanted_in, wanted_out = set(_HIFT_INPUTS), set(_HIFT_OUTPUTS)
        if not wanted_in <= names_in or not wanted_out <= names_out:
            raise GraphSignatureMismatch(
                f"vocoder {hift.spec.file}: expected inputs {sorted(wanted_in)} and outputs "
                f"{sorted(wanted_out)}, found {sorted(names_in)} / {sorted(names_out)}; use "
                "hift.onnx from Masterx/Fun-CosyVoice3-0.5B-2512-ONNX"
            )
        return hift

    @property
    def graph(self) -> Graph:
        """The whole-mel graph (loaded on first use when given as a loader)."""
        if self._graph is None:
            assert self._load is not None
            self._graph = self._checked(self._load())
        return self._graph

    def waveform(self, mel: FloatArray, noise: FloatArray) -> FloatArray:
        """Samples for a whole mel (generator.py ``decode`` with ``finalize=True``).

        Args:
            mel: float32 [80, M], 50 frames/s natural-log mel.
            noise: float32 [480 M, 9] U[0,1) source noise.

        Returns:
            float32 [480 M], 24 kHz, clamped to +-0.99 (``audio_limit``).
        """
        feeds = {
            "speech_feat": np.ascontiguousarray(mel, dtype=np.float32)[None],
            "noise": np.ascontiguousarray(noise, dtype=np.float32)[None],
        }
        out = self.graph.run(feeds, list(_HIFT_OUTPUTS))
        # HiFTGenerator._istft: torch.clip(magnitude, max=1e2); idempotent if the graph clips
        magnitude = np.minimum(np.asarray(out["magnitude"], dtype=np.float32)[0], C.MAGNITUDE_CLIP)
        phase = np.asarray(out["phase"], dtype=np.float32)[0]
        samples = np.asarray(istft(magnitude, phase), dtype=np.float32).reshape(-1)
        return np.clip(samples, -C.AUDIO_LIMIT, C.AUDIO_LIMIT)


class VocoderStream:
    """Per-request, per-utterance streaming vocoder state.

    Holds the mel not yet final (all mel so far without the streamed graph; with it only the
    frames not run yet) and the number of samples already emitted; the first ``FADE_IN_MS``
    of the utterance are faded in.

    Args:
        runner: the model's :class:`HiftRunner` (shared, stateless).
        noise: the request's U[0,1) noise buffer with 9 channels (shared by the request's
            utterances; each utterance reads it from frame 0).
        fade_in_ms: fade-in length at the start of the utterance.
    """

    def __init__(
        self,
        runner: HiftRunner,
        noise: GrowingNoise,
        fade_in_ms: float = C.FADE_IN_MS,
        window_frames: int = 0,
        crossfade_ms: float = CROSSFADE_MS,
    ) -> None:
        if noise.channels != C.HARMONIC_CHANNELS:
            raise ValueError(f"vocoder noise needs {C.HARMONIC_CHANNELS} channels")
        if window_frames < 0:
            raise ValueError(f"window_frames must be >= 0, got {window_frames}")
        self.runner = runner
        self.noise = noise
        self.fade_samples = round(fade_in_ms * C.OUTPUT_SAMPLE_RATE_HZ / 1000.0)
        self.window_frames = window_frames
        self.crossfade_samples = round(crossfade_ms * C.OUTPUT_SAMPLE_RATE_HZ / 1000.0)
        self._mel = np.zeros((C.MEL_BINS, 0), dtype=np.float32)
        self._mel_first = 0
        """Absolute index of ``_mel[:, 0]``: the streamed graph drops the frames it has run
        (its states hold the context), so a long answer keeps a bounded buffer; the other
        paths re-read earlier frames and keep them all (0)."""
        self._tail = np.zeros(0, dtype=np.float32)
        self._streamed = runner.stream
        """The streamed graph, when the model has one: each frame runs once (then
        ``window_frames`` is not used)."""
        self._sent_frames = 0
        """Mel frames given to the streamed graph so far."""
        self._states: list[FloatArray] = (
            self._streamed.initial_states() if self._streamed is not None else []
        )
        self._stft_frames = np.zeros((2, C.ISTFT_N_FFT // 2 + 1, 0), dtype=np.float32)
        """The last STFT frames (magnitude, phase) of the streamed graph, the first of them
        frame ``_stft_first``: the next samples overlap them."""
        self._stft_first = 0
        self.emitted_samples = 0
        self.frames_run = 0
        """Mel frames the graph ran over, summed over calls (re-run frames count again)."""
        self.finished = False

    @property
    def mel_frames(self) -> int:
        """Mel frames received so far."""
        return self._mel_first + int(self._mel.shape[1])

    @property
    def buffered_frames(self) -> int:
        """Mel frames held in memory (with the streamed graph: the ones not run yet)."""
        return int(self._mel.shape[1])

    def frames_for_call(self, extra_frames: int) -> int:
        """Mel frames a call would run after ``extra_frames`` more frames were pushed."""
        total = self.mel_frames + extra_frames
        if self._streamed is not None:
            return total - self._sent_frames
        if self.window_frames == 0:
            return total
        emitted_frames = self.emitted_samples // C.SAMPLES_PER_MEL_FRAME
        return min(total, total - emitted_frames + self.window_frames)

    def _crossfade(self, out: FloatArray) -> FloatArray:
        """Blend the start of ``out`` from the previous call's samples for the same span."""
        k = min(len(self._tail), len(out), self.crossfade_samples)
        if k > 0:
            ramp = fade_in_gain(0, k, k)
            out[:k] = self._tail[:k] * (1.0 - ramp) + out[:k] * ramp
        return out

    def push(
        self,
        new_mel: FloatArray,
        final: bool,
        should_stop: ShouldStop | None = None,
        times: StageTimes | None = None,
        defer: bool = False,
    ) -> FloatArray:
        """Append mel frames and return the samples that became final.

        Args:
            new_mel: float32 [80, k] (k may be 0).
            final: True on the utterance's last call: all remaining samples are emitted.
            should_stop: checked before the graph runs.
            times: ``vocoder_s`` and ``vocoder_calls`` are added to.
            defer: keep the frames for the next call and run nothing (ignored when
                ``final``); see :func:`may_defer`. With ``window_frames`` 0 the samples do
                not depend on how the mel was cut into calls.

        Returns:
            float32 [n] samples at 24 kHz: ``[emitted, 480 (M - 8))`` or, when ``final``,
            ``[emitted, 480 M)``; empty when nothing new is ready (the graph is not run).
            The streamed graph keeps these bounds (:meth:`_push_streamed`) once its first
            call has ``min_first_frames``.

        Raises:
            SynthesisCancelled: ``should_stop()`` returned True.
            RuntimeError: called again after the final call.
        """
        if self.finished:
            raise RuntimeError("VocoderStream.push called after the final push")
        if new_mel.shape[1]:
            self._mel = np.concatenate([self._mel, np.asarray(new_mel, np.float32)], axis=1)
        self.finished = final
        if defer and not final:
            return np.zeros(0, dtype=np.float32)
        if self._streamed is not None:
            return self._push_streamed(self._streamed, final, should_stop, times)
        n_frames = self.mel_frames
        held = 0 if final else C.VOCODER_RIGHT_CONTEXT_FRAMES
        end = C.SAMPLES_PER_MEL_FRAME * max(n_frames - held, 0)
        if end <= self.emitted_samples:
            return np.zeros(0, dtype=np.float32)
        if should_stop is not None and should_stop():
            raise SynthesisCancelled("synthesis cancelled before the vocoder")
        start = time.perf_counter()
        spf = C.SAMPLES_PER_MEL_FRAME
        noise = self.noise.take(spf * n_frames)
        first = 0
        if self.window_frames > 0:
            first = max(0, self.emitted_samples // spf - self.window_frames)
        samples = self.runner.waveform(self._mel[:, first:], noise[spf * first :])
        self.frames_run += n_frames - first
        base = spf * first  # absolute index of samples[0]
        out = samples[self.emitted_samples - base : end - base].copy()
        if self.window_frames > 0:
            out = self._crossfade(out)
            # this call's samples just after ``end``: the next call fades from them
            self._tail = samples[end - base : end - base + self.crossfade_samples].copy()
        if self.emitted_samples < self.fade_samples:
            out *= fade_in_gain(self.emitted_samples, len(out), self.fade_samples)
        self.emitted_samples = end
        elapsed = time.perf_counter() - start
        if times is not None:
            times.vocoder_s += elapsed
            times.vocoder_calls += 1
            times.vocoder_frames += n_frames - first
        logger.debug(
            "vocoder: %d mel frames -> %d new samples in %.3f s%s",
            n_frames,
            len(out),
            elapsed,
            " (final)" if final else "",
        )
        return out

    def _push_streamed(
        self,
        streamed: StreamedHift,
        final: bool,
        should_stop: ShouldStop | None,
        times: StageTimes | None,
    ) -> FloatArray:
        """:meth:`push` with the streamed graph: the unsent frames run once.

        A non-final call keeps its last frame back (so the final call always has one) and
        waits for ``min_first_frames`` + 1 frames at the start; it emits the samples whose 4
        STFT frames are out, ``480 (sent - lookahead) - 4``, but not past the spec's
        ``480 (M - 8)`` (section 6): the chunk bounds stay those of the exact whole-mel
        stream and of upstream (the parity tests compare them), at up to 3 frames of
        latency the streamed graph could save (lookahead 4 upstream).
        """
        spf, hop = C.SAMPLES_PER_MEL_FRAME, C.ISTFT_HOP
        first = self._sent_frames == 0
        keep = 0 if final else 1
        count = self.mel_frames - self._sent_frames - keep
        if count <= 0 or (first and not final and count < streamed.min_first_frames):
            return np.zeros(0, dtype=np.float32)
        if should_stop is not None and should_stop():
            raise SynthesisCancelled("synthesis cancelled before the vocoder")
        start = time.perf_counter()
        begin, end_frame = self._sent_frames, self._sent_frames + count
        noise = self.noise.take(spf * end_frame)[spf * begin :]
        local = slice(begin - self._mel_first, end_frame - self._mel_first)
        magnitude, phase, self._states = streamed.step(
            self._mel[:, local], noise, self._states, first, final
        )
        self._sent_frames = end_frame
        # the states carry all context the next calls need: run frames are not read again
        self._mel = self._mel[:, local.stop :].copy()
        self._mel_first = end_frame
        self.frames_run += count
        frames = np.concatenate([self._stft_frames, np.stack([magnitude, phase])], axis=2)
        total = self._stft_first + frames.shape[2]
        # sample n needs STFT frames up to (n + 8) // 4: the last 2 hops wait for the next;
        # and no further than the spec's 480 (M - 8), so the chunk bounds stay upstream's
        ready = max(0, hop * total - C.ISTFT_N_FFT // 2)
        spec_end = spf * max(0, self.mel_frames - C.VOCODER_RIGHT_CONTEXT_FRAMES)
        end = spf * end_frame if final else min(ready, spec_end)
        out = np.zeros(0, dtype=np.float32)
        if end > self.emitted_samples:
            samples = np.asarray(istft(frames[0], frames[1]), dtype=np.float32).reshape(-1)
            base = hop * self._stft_first  # absolute index of samples[0]
            out = np.clip(samples[self.emitted_samples - base : end - base],
                          -C.AUDIO_LIMIT, C.AUDIO_LIMIT)
            if self.emitted_samples < self.fade_samples:
                out = out * fade_in_gain(self.emitted_samples, len(out), self.fade_samples)
            self.emitted_samples = end
        keep_from = max(0, min(total - _ISTFT_KEEP_FRAMES, self.emitted_samples // hop - 2))
        self._stft_frames = frames[:, :, keep_from - self._stft_first :]
        self._stft_first = keep_from
        elapsed = time.perf_counter() - start
        if times is not None:
            times.vocoder_s += elapsed
            times.vocoder_calls += 1
            times.vocoder_frames += count
        logger.debug("vocoder (streamed): %d mel frames -> %d new samples in %.3f s%s",
                     count, len(out), elapsed, " (final)" if final else "")
        return np.asarray(out, dtype=np.float32)


# -- when the vocoder runs ------------------------------------------------------------------

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
