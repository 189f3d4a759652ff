"""The flow's numerics: speech tokens -> 50 Hz mel frames (spec section 5).

Three parts, in this order:

* :class:`FlowRunner`, the full-attention flow: runs the graphs ``flow_encoder.onnx`` (token
  embedding, pre-lookahead convolution, 2x upsampling, speaker projection) and
  ``flow.decoder.estimator.fp32.onnx`` (the DiT velocity field) over the prompt and the whole
  piece;
* the one Euler ODE solver with classifier-free guidance (CFG), :func:`solve_euler`, which
  both flow forms run (they differ only in how one step's velocity rows are computed); the
  loaders read :func:`cosine_t_schedule` too, to compute a derived DiT's time conditioning
  ahead of the requests;
* :class:`ChunkedFlow`, the chunk-causal flow of upstream's PyTorch streaming, where each chunk
  costs its own frames. Upstream streams with ``flow.inference(streaming=True)`` for every
  non-final chunk (cosyvoice/cli/model.py ``CosyVoice3Model.tts`` / ``token2wav``), so the DiT
  attends with a static 50-frame chunk mask counted from frame 0 of the prompt
  (cosyvoice/flow/DiT/dit.py ``DiT.forward``; utils/mask.py ``add_optional_chunk_mask``); the
  final chunk (``finalize=True``) runs with full attention. Under the chunk mask, a frame's
  keys and values at an Euler step depend only on frames of its own and earlier chunks, so:

  - **prompt cache** (per voice and Euler schedule): the prompt frames in whole chunks that
    end at least ``2 x 3`` frames before the prompt's end (the pre-lookahead layer lets the
    last 3 prompt tokens' mu depend on the generated tokens: flow.py
    ``pre_lookahead_layer``) are run once, with a fixed prompt noise (the engine passes the
    flow noise of seed 0, which is also the default request seed), and their keys/values and
    convolution context are kept for every Euler step and CFG row (:class:`KvCache`);
  - **history cache** (per request piece): each chunk's keys/values are appended.

  A chunk then runs the derived streaming estimator
  (:class:`..dit_runner.StreamingEstimator`) on its new frames only: the prompt frames after the
  cached ones (first chunk only) and its generated frames, with rotary positions continuing
  after the cached frames. Memory: per cached frame, Euler step and CFG row,
  ``depth x 2 x inner x 4`` bytes (180 KB with the published dims: depth 22, inner 1024).

Sources (FunAudioLLM/CosyVoice, commit ace7c47):

* ``cosyvoice/flow/flow.py`` ``CausalMaskedDiffWithDiT.inference``: prompt tokens are
  prepended to the new tokens, the speaker embedding is L2-normalised before its affine
  projection, ``cond`` holds the prompt mel in its first frames and zeros after, and the
  output keeps only the frames after the prompt mel.
* ``cosyvoice/flow/flow_matching.py`` ``CausalConditionalCFM.forward``: one fixed N(0,1)
  noise buffer sliced from frame 0 (``rand_noise``), cosine time schedule
  ``t = 1 - cos(linspace(0, 1, n + 1) * pi / 2)``; ``ConditionalCFM.solve_euler``: batch 2
  (conditional, unconditional with ``mu``, ``spks`` and ``cond`` zeroed), guidance
  ``(1 + rate) * v_cond - rate * v_uncond``, ``x += dt * v``.
* ``cosyvoice/cli/model.py`` ``CosyVoice3Model.token2wav``: ``speed`` resamples the mel with
  ``F.interpolate(mode="linear")`` to ``int(frames / speed)`` frames.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..dit_runner import CHUNK_FRAMES, chunk_attention_bias
from ..errors import GraphSignatureMismatch, SynthesisCancelled, SynthesisFailed
from ..options import EulerSchedule, ShouldStop, StageTimes, VoiceFeatures
from ..sessions import Graph

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]

_ESTIMATOR_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")
"""Estimator input names (cosyvoice/bin/export_onnx.py ``input_names``)."""
_ENCODER_INPUTS = ("token", "embedding")
_ENCODER_OUTPUTS = ("mu", "spks")


def l2_normalise(embedding: npt.NDArray[np.floating]) -> FloatArray:
    """L2-normalise a speaker embedding (flow.py ``F.normalize(embedding, dim=1)``, eps 1e-12).

    Args:
        embedding: float [D] (D = 192 for CAM++).

    Returns:
        float32 [D] of unit length (zeros stay zeros).
    """
    vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
    norm = float(np.sqrt(np.sum(vec.astype(np.float64) ** 2)))
    return (vec / max(norm, 1e-12)).astype(np.float32)


def _check_estimator(estimator: Any) -> str:
    """Check the estimator's input/output names; return the output name."""
    est_in = set(estimator.spec.inputs)
    missing = [n for n in _ESTIMATOR_INPUTS if n not in est_in]
    if missing or len(estimator.spec.outputs) != 1:
        raise GraphSignatureMismatch(
            f"estimator {estimator.spec.file}: expected inputs {list(_ESTIMATOR_INPUTS)} "
            f"and one output, found inputs {sorted(est_in)} and outputs "
            f"{sorted(estimator.spec.outputs)}; use flow.decoder.estimator.fp32.onnx "
            "from FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
        )
    return str(next(iter(estimator.spec.outputs)))


def _static_batch(estimator: Any) -> int | None:
    """Declared batch of the estimator's ``x`` (2 in the upstream export), None if symbolic."""
    try:
        dim = estimator.input_shape("x")[0]
    except (KeyError, IndexError, AttributeError):
        return None
    return dim if isinstance(dim, int) and dim > 0 else None


class Conditioning(NamedTuple):
    """What one flow pass is conditioned on: ``mu`` float32 [80, F] (the encoder's output),
    ``spks`` float32 [80] (the projected speaker embedding) and ``cond`` float32 [80, F] (the
    prompt mel in the prompt's frames, zeros after)."""

    mu: FloatArray
    spks: FloatArray
    cond: FloatArray


@dataclass(frozen=True)
class FlowCall:
    """How one flow call runs, beside its inputs.

    Attributes:
        schedule: Euler steps and CFG rate.
        precision: estimator precision ("fp32", "int8"); None = the one loaded at start.
        should_stop: checked before the encoder and every Euler step.
        times: ``flow_s`` and ``flow_calls`` are added to.
    """

    schedule: EulerSchedule = field(default_factory=EulerSchedule)
    precision: str | None = None
    should_stop: ShouldStop | None = None
    times: StageTimes | None = None


class FlowGraphs(Protocol):
    """The graphs the flow reads of the loaded model, :class:`~..model.CosyVoice3Model` (named
    by shape: the model's loaders import this module for :func:`cosine_t_schedule`)."""

    flow_encoder: Graph
    estimator: Any


class FlowRunner:
    """Runs flow_encoder + the DiT estimator for one model; holds no per-request state.

    Args:
        model: a loaded :class:`~..model.CosyVoice3Model` (uses ``.flow_encoder`` and
            ``.estimator``, and ``estimator_for`` when it has one).

    Raises:
        GraphSignatureMismatch: the graphs lack the input/output names of the contract.
    """

    def __init__(self, model: FlowGraphs) -> None:
        self.model = model
        self.encoder = model.flow_encoder
        self.estimator = model.estimator
        enc_in, enc_out = set(self.encoder.spec.inputs), set(self.encoder.spec.outputs)
        if not set(_ENCODER_INPUTS) <= enc_in or not set(_ENCODER_OUTPUTS) <= enc_out:
            raise GraphSignatureMismatch(
                f"flow encoder {self.encoder.spec.file}: expected inputs {list(_ENCODER_INPUTS)} "
                f"and outputs {list(_ENCODER_OUTPUTS)}, found {sorted(enc_in)} / "
                f"{sorted(enc_out)}; "
                "use flow_encoder.onnx from Masterx/Fun-CosyVoice3-0.5B-2512-ONNX"
            )
        self._velocity_name = _check_estimator(self.estimator)
        # per estimator graph: None = try batch 1 once; False after a failure (a graph
        # property, not request state)
        self._batch1_ok: dict[int, bool | None] = {}

    def estimator_for(self, precision: str | None) -> Any:
        """The estimator graph of ``precision`` (None = the one loaded at start)."""
        if precision is None or not hasattr(self.model, "estimator_for"):
            return self.estimator
        graph = self.model.estimator_for(precision)
        if graph is not self.estimator:
            _check_estimator(graph)
        return graph

    def _batch1_state(self, estimator: Any) -> bool | None:
        key = id(estimator)
        if key not in self._batch1_ok:
            batch = _static_batch(estimator)
            self._batch1_ok[key] = None if batch in (None, 1) else False
        return self._batch1_ok[key]

    # -- graph calls ------------------------------------------------------------------------
    def encode(
        self, tokens: npt.NDArray[np.int64], speaker_embedding: npt.NDArray[np.floating]
    ) -> tuple[FloatArray, FloatArray]:
        """Run flow_encoder.

        Args:
            tokens: int64 [T], prompt tokens ++ generated tokens (values 0..6560).
            speaker_embedding: float [192], raw CAM++ embedding (normalised here).

        Returns:
            (mu float32 [80, 2T], spks float32 [80]).
        """
        feeds: dict[str, np.ndarray] = {
            "token": np.ascontiguousarray(tokens, dtype=np.int64).reshape(1, -1),
            "embedding": l2_normalise(speaker_embedding).reshape(1, -1),
        }
        out = self.encoder.run(feeds, list(_ENCODER_OUTPUTS))
        mu = np.asarray(out["mu"], dtype=np.float32)[0]
        spks = np.asarray(out["spks"], dtype=np.float32).reshape(-1)
        return mu, spks

    def _velocity_rows(
        self, x: FloatArray, given: Conditioning, t: float, guided: bool, estimator: Any
    ) -> FloatArray:
        """One Euler step's estimator rows, float32 [B, 80, F]: B = 2 (conditional,
        unconditional) when ``guided``; unguided steps run batch 1 when the graph takes it,
        else batch 2 with both rows conditional."""
        mu, spks, cond = given
        n_frames = x.shape[1]
        batch1 = self._batch1_state(estimator)
        if not guided and batch1 is not False:
            feeds = {
                "x": x[None],
                "mask": np.ones((1, 1, n_frames), dtype=np.float32),
                "mu": mu[None],
                "t": np.array([t], dtype=np.float32),
                "spks": spks[None],
                "cond": cond[None],
            }
            try:
                v = estimator.run(feeds, [self._velocity_name])[self._velocity_name]
            except SynthesisFailed:
                if batch1:
                    raise
                logger.debug("estimator rejects batch 1; using batch 2 for unguided steps")
                self._batch1_ok[id(estimator)] = False
            else:
                self._batch1_ok[id(estimator)] = True
                return np.asarray(v, dtype=np.float32)
        zeros = np.zeros_like(mu)
        feeds = {
            "x": np.stack([x, x]),
            "mask": np.ones((2, 1, n_frames), dtype=np.float32),
            "mu": np.stack([mu, zeros if guided else mu]),
            "t": np.array([t, t], dtype=np.float32),
            "spks": np.stack([spks, np.zeros_like(spks) if guided else spks]),
            "cond": np.stack([cond, zeros if guided else cond]),
        }
        v2 = np.asarray(estimator.run(feeds, [self._velocity_name])[self._velocity_name])
        return v2.astype(np.float32, copy=False)

    # -- solver -----------------------------------------------------------------------------
    def solve(self, x0: FloatArray, given: Conditioning, call: FlowCall) -> FloatArray:
        """Euler ODE solve from noise to mel with the full-attention estimator
        (flow_matching.py ``solve_euler``; the loop is :func:`solve_euler`).

        Args:
            x0: float32 [80, F], the start noise.
            given: mu, spks and cond of the F frames.
            call: the Euler schedule, the estimator precision and the cancellation check
                (before every Euler step).

        Returns:
            float32 [80, F], the mel at t = 1.

        Raises:
            SynthesisCancelled: ``call.should_stop()`` returned True.
        """
        estimator = self.estimator_for(call.precision)

        def rows(x: FloatArray, _k: int, t: float, guided: bool) -> FloatArray:
            return self._velocity_rows(x, given, t, guided, estimator)

        return solve_euler(x0, call.schedule, rows, call.should_stop)

    def mel_for_tokens(
        self,
        tokens: npt.NDArray[np.int64],
        voice: VoiceFeatures,
        noise: FloatArray,
        call: FlowCall,
        drop_lookahead_frames: int = 0,
        generated_offset_tokens: int = 0,
    ) -> FloatArray:
        """Mel frames for the generated tokens (flow.py ``CausalMaskedDiffWithDiT.inference``).

        Args:
            tokens: int64 [T] = the voice's P prompt tokens ++ generated tokens (lookahead
                tokens included when streaming).
            voice: the voice's features (prompt tokens, prompt mel [2P, 80], embedding).
            noise: float32 [80, N], the request's fixed N(0,1) buffer, N >= 2T. Frame i of the
                flow input reads noise column i for the prompt and column
                ``2P + 2 * generated_offset_tokens + j`` for generated frame j.
            call: the Euler schedule, the estimator precision, the cancellation check (before
                the encoder and before every Euler step) and the stage times (``flow_s`` and
                ``flow_calls`` are added to).
            drop_lookahead_frames: mu frames dropped at the end (6 = 2 x 3 lookahead tokens in
                streamed chunks, 0 on the final chunk): the exported encoder is the "finalize"
                form, so the last tokens' frames lack their right context.
            generated_offset_tokens: index (in the whole generated sequence) of the first
                generated token in ``tokens``; > 0 with a bounded left context.

        Returns:
            float32 [80, 2T - 2P - drop_lookahead_frames].

        Raises:
            SynthesisCancelled: ``should_stop()`` returned True.
            SynthesisFailed: a graph failed or the noise buffer is too short.
        """
        start = time.perf_counter()
        if call.should_stop is not None and call.should_stop():
            raise SynthesisCancelled("synthesis cancelled before the flow")
        prompt_tokens = np.asarray(voice.speech_tokens, dtype=np.int64).reshape(-1)
        prompt_frames = int(voice.prompt_mel.shape[0])
        mu, spks = self.encode(tokens, voice.speaker_embedding)
        if drop_lookahead_frames > 0:
            mu = mu[:, : mu.shape[1] - drop_lookahead_frames]
        n_frames = mu.shape[1]
        gen_frames = n_frames - prompt_frames
        if gen_frames <= 0 or len(tokens) < len(prompt_tokens):
            return np.zeros((mu.shape[0], 0), dtype=np.float32)
        gen_start = prompt_frames + C.TOKEN_MEL_RATIO * generated_offset_tokens
        if noise.shape[1] < gen_start + gen_frames:
            raise SynthesisFailed(
                f"flow noise buffer has {noise.shape[1]} frames, needs {gen_start + gen_frames}; "
                "pass a longer buffer (GrowingNoise.take)"
            )
        x0 = np.concatenate(
            [noise[:, :prompt_frames], noise[:, gen_start : gen_start + gen_frames]], axis=1
        ).astype(np.float32)
        cond = np.zeros_like(mu)
        cond[:, :prompt_frames] = np.asarray(voice.prompt_mel, dtype=np.float32).T
        mel = self.solve(x0, Conditioning(mu, spks, cond), call)
        elapsed = time.perf_counter() - start
        if call.times is not None:
            call.times.flow_s += elapsed
            call.times.flow_calls += 1
        logger.debug(
            "flow: %d tokens -> %d frames (%d new) in %.3f s",
            len(tokens),
            n_frames,
            gen_frames,
            elapsed,
        )
        return np.ascontiguousarray(mel[:, prompt_frames:])


# -- the Euler/CFG solver -------------------------------------------------------------------


VelocityRows = Callable[[FloatArray, int, float, bool], FloatArray]
"""``(x float32 [80, F], step k, time t, guided) -> float32 [B, 80, F]``: one Euler step's
estimator output. Guided steps return B = 2 rows (conditional, then unconditional with mu,
spks and cond zeroed); unguided steps return B >= 1 rows of which row 0 (conditional) is
used."""


def cosine_t_schedule(n_steps: int) -> npt.NDArray[np.float32]:
    """Time points of the Euler solver: ``t_k = 1 - cos(k / n * pi / 2)``, k = 0..n, rounded
    the way upstream computes them (flow_matching.py, ``t_scheduler == "cosine"``:
    ``torch.linspace(0, 1, n + 1)`` in float32, then ``1 - cos(t * 0.5 * pi)`` in float32).

    Why float32 step by step and not float64 rounded once: near t = 0, ``1 - cos`` in float32
    cancels, so upstream's points sit up to 2 ulp (6e-8) away from the exactly rounded ones.
    That offset moves the mel by about 2e-5, and a vocoder whose f0 reaches several hundred
    Hz accumulates it into 1e-2 of audio over 4 s (the harmonic phase is a running sum of f0).
    The cosine here is rounded correctly to float32; PyTorch's float32 cosine (and its
    vectorised linspace) round some arguments 1 ulp the other way. With PyTorch 2.13 on x86
    the points are equal bit for bit for 1-7 and 10-13 steps (the presets use 10, 4 and 2);
    other counts differ in one to four points by 1-2 ulp.

    Args:
        n_steps: number of Euler steps n (>= 1).

    Returns:
        float32 [n + 1], from 0 to 1.

    Raises:
        ValueError: ``n_steps`` < 1.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    # torch.linspace: step (end - start) / (steps - 1) in float32; the first half counts up
    # from 0, the second half down from 1
    step = np.float32(1.0) / np.float32(n_steps)
    k = np.arange(n_steps + 1)
    up = k.astype(np.float32) * step
    down = np.float32(1.0) - (n_steps - k).astype(np.float32) * step
    t = np.where(k < (n_steps + 1) // 2, up, down).astype(np.float32)
    angle = (t * np.float32(0.5)) * np.float32(math.pi)
    cosine = np.cos(angle.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) - cosine).astype(np.float32)


def cfg_combine(v_cond: FloatArray, v_uncond: FloatArray, rate: float) -> FloatArray:
    """Classifier-free guidance: ``(1 + rate) * v_cond - rate * v_uncond``.

    (flow_matching.py ``solve_euler``; rate 0.7 upstream). Shapes of both inputs are equal;
    the result has the same shape, float32.
    """
    out = (1.0 + rate) * v_cond - rate * v_uncond
    return np.asarray(out, dtype=np.float32)


def solve_euler(
    x0: FloatArray,
    schedule: EulerSchedule,
    velocity_rows: VelocityRows,
    should_stop: ShouldStop | None = None,
) -> FloatArray:
    """Integrate from the noise ``x0`` at t = 0 to the mel at t = 1.

    Args:
        x0: float32 [80, F], the start noise (not modified).
        schedule: steps and CFG schedule.
        velocity_rows: the estimator call of one step (see :data:`VelocityRows`).
        should_stop: checked before every step.

    Returns:
        float32 [80, F].

    Raises:
        SynthesisCancelled: ``should_stop()`` returned True.
    """
    t_span = cosine_t_schedule(schedule.steps)
    x = np.array(x0, dtype=np.float32, copy=True)
    for k, guided in enumerate(schedule.guided):
        if should_stop is not None and should_stop():
            raise SynthesisCancelled("synthesis cancelled during the flow (Euler step)")
        rows = velocity_rows(x, k, float(t_span[k]), guided)
        v = cfg_combine(rows[0], rows[1], schedule.cfg_rate) if guided else rows[0]
        x += (t_span[k + 1] - t_span[k]) * v
    return x


# -- the chunk-causal flow ------------------------------------------------------------------

KeyValue = tuple[np.ndarray, np.ndarray]
"""One DiT block's cached (keys, values), float32 [B, H, frames, head_dim] each."""
PROMPTS_IN_MEMORY = 2
"""Prompt caches (voice x schedule) kept in memory; 0.7-2.5 GB each for ``quality`` with a
5-15 s prompt, so only the most recently used stay resident (the rest are read from disk)."""
DISK_PREFIX = "flowkv2"
"""Prompt cache file prefix (2: head-major keys/values per block; files of the frame-major
layout 1, ``flowkv-*``, are removed when a voice's cache is written again)."""


@dataclass
class StepKv:
    """Cached keys/values of one Euler step: ``kv`` per DiT block (keys, values) float32
    [B, H, frames, head_dim] (head-major, as the streaming graph takes and returns them; None
    before the first frame), the convolution context after the last cached frame, and
    ``dropped``: the frames before the stored ones that a bounded left context let go."""

    kv: list[KeyValue] | None = None
    frames: int = 0
    conv: tuple[np.ndarray, np.ndarray] | None = None
    dropped: int = 0

    def append(self, new: list[KeyValue], conv: tuple[np.ndarray, np.ndarray],
               keep_frames: int | None = None) -> None:
        """Add a call's new keys/values (one copy of the kept frames per block); with
        ``keep_frames``, store only the last ``keep_frames`` frames (older ones are never
        attended again under a bounded left context; their count moves to ``dropped``)."""
        n = new[0][0].shape[2] if new else 0
        total = self.frames + n
        keep = total if keep_frames is None else min(total, max(0, keep_frames))
        old_from = self.frames - max(0, keep - n)  # first stored frame that is kept
        new_from = max(0, n - keep)
        if self.kv is None or old_from >= self.frames:
            self.kv = [(np.ascontiguousarray(k[:, :, new_from:]),
                        np.ascontiguousarray(v[:, :, new_from:])) for k, v in new]
        else:
            self.kv = [(np.concatenate([ok[:, :, old_from:], k], axis=2),
                        np.concatenate([ov[:, :, old_from:], v], axis=2))
                       for (ok, ov), (k, v) in zip(self.kv, new, strict=True)]
        self.frames = keep
        self.dropped += total - keep
        self.conv = conv

    @property
    def nbytes(self) -> int:
        return sum(int(k.nbytes + v.nbytes) for k, v in self.kv) if self.kv else 0


@dataclass
class KvCache:
    """Per Euler step :class:`StepKv` (prompt cache of a voice, or a piece's history).

    Attributes:
        steps: one :class:`StepKv` per Euler step.
        keep_frames: a piece's history under a bounded left context stores (and its chunks
            attend to) at most this many frames; None = all.
    """

    steps: list[StepKv] = field(default_factory=list)
    keep_frames: int | None = None

    @property
    def frames(self) -> int:
        """Frames this cache has seen (stored + dropped): the next new frame's index."""
        return self.steps[0].frames + self.steps[0].dropped if self.steps else 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.steps)


def features_digest(voice: VoiceFeatures) -> str:
    """Content hash of the flow's voice features (tokens, prompt mel, embedding)."""
    h = hashlib.sha1()
    for arr in (voice.speech_tokens, voice.prompt_mel, voice.speaker_embedding):
        a = np.ascontiguousarray(arr)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def cacheable_prompt_frames(prompt_tokens: int) -> int:
    """Prompt frames whose keys/values do not depend on the generated tokens: whole chunks
    ending at least 2 x 3 frames (pre-lookahead tokens) before the prompt's end."""
    usable = C.TOKEN_MEL_RATIO * (prompt_tokens - C.PRE_LOOKAHEAD_TOKENS)
    return max(0, usable // CHUNK_FRAMES * CHUNK_FRAMES)


class ChunkedFlow:
    """Chunk-causal flow over a :class:`FlowRunner` and a streaming estimator.

    Args:
        runner: the full-attention flow (encoder, final chunks).
        estimator: the derived streaming estimator
            (:class:`..dit_runner.StreamingEstimator`: ``run``, ``depth``, ``inner``).
        prompt_noise: ``frames -> float32 [80, frames]``, the fixed noise of the prompt frames.
        disk_dir: where prompt caches are stored (None: memory only); disk_tag: file name
            part naming the estimator (precision and source file key).
    """

    def __init__(self, runner: FlowRunner, estimator: Any,
                 prompt_noise: Callable[[int], FloatArray], disk_dir: Path | None = None,
                 disk_tag: str = "") -> None:
        self.runner = runner
        self.estimator = estimator
        self.prompt_noise = prompt_noise
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self.disk_tag = disk_tag
        self._prompts: OrderedDict[tuple[Any, ...], KvCache] = OrderedDict()
        self._lock = threading.Lock()

    def _disk_path(self, digest: str, guided: tuple[int, ...], cfg_rate: float) -> Path | None:
        if self.disk_dir is None:
            return None
        sched = "".join(str(g) for g in guided)
        return self.disk_dir / f"{DISK_PREFIX}-{digest}-{sched}-{cfg_rate:g}-{self.disk_tag}.npz"

    # -- caches -----------------------------------------------------------------------------
    def prompt_cache(self, voice: VoiceFeatures, schedule: EulerSchedule,
                     should_stop: ShouldStop | None = None) -> KvCache:
        """The voice's prompt cache for this Euler schedule (computed once, kept in memory)."""
        key = (features_digest(voice), schedule.key, schedule.cfg_rate)
        with self._lock:
            hit = self._prompts.get(key)
            if hit is not None:
                self._prompts.move_to_end(key)
        if hit is not None:
            return hit
        path = self._disk_path(*key)
        if path is not None and path.is_file():
            loaded = load_kv_cache(path, schedule.steps)
            if loaded is not None:
                self._remember(key, loaded)
                return loaded
        prompt_tokens = np.asarray(voice.speech_tokens, dtype=np.int64).reshape(-1)
        frames = cacheable_prompt_frames(len(prompt_tokens))
        cache = self.new_history(schedule)
        if frames > 0:
            mu, spks = self.runner.encode(prompt_tokens, voice.speaker_embedding)
            cond = np.asarray(voice.prompt_mel, dtype=np.float32)[:frames].T
            chunk = Conditioning(mu[:, :frames], spks, np.ascontiguousarray(cond))
            self._solve(self.prompt_noise(frames), chunk, 0, (None, cache),
                        FlowCall(schedule, should_stop=should_stop))
        logger.info("flow prompt cache: %d frames, %d Euler steps, %.1f MB", frames,
                    schedule.steps, cache.nbytes / 1e6)
        if path is not None:
            for stale in path.parent.glob(f"flowkv-{key[0]}-*.npz"):  # layout 1
                stale.unlink(missing_ok=True)
            save_kv_cache(path, cache)
        self._remember(key, cache)
        return cache

    def _remember(self, key: tuple[Any, ...], cache: KvCache) -> None:
        """Keep ``cache`` in memory, dropping the least recently used beyond
        :data:`PROMPTS_IN_MEMORY` (they stay on disk)."""
        with self._lock:
            self._prompts[key] = cache
            self._prompts.move_to_end(key)
            while len(self._prompts) > PROMPTS_IN_MEMORY:
                self._prompts.popitem(last=False)

    def new_history(self, schedule: EulerSchedule, keep_frames: int | None = None) -> KvCache:
        """An empty history cache for one piece, storing at most ``keep_frames`` frames
        (None = all)."""
        return KvCache([StepKv() for _ in range(schedule.steps)], keep_frames)

    # -- solver -----------------------------------------------------------------------------
    def _solve(
        self,
        x0: FloatArray,
        given: Conditioning,
        start: int,
        caches: tuple[KvCache | None, KvCache],
        call: FlowCall,
        store: bool = True,
    ) -> FloatArray:
        """Euler/CFG solve of new frames ``start ..`` (``x0`` and ``given`` float32 [80, n]
        each); ``caches`` = (the prompt cache or None, the history). Appends the new frames'
        keys/values to the history (unless ``store`` is False: a piece's final chunk), keeping
        at most its ``keep_frames``. flow_matching.py ``solve_euler`` with cached attention;
        the loop is :func:`solve_euler`, the estimator call is the streaming graph's on the
        new frames."""
        mu, spks, cond = given
        prompt, history = caches
        n = x0.shape[1]
        zeros, zspk = np.zeros_like(mu), np.zeros_like(spks)

        def rows(x: FloatArray, k: int, t: float, guided: bool) -> FloatArray:
            if guided:
                frames = {"x": np.stack([x, x]), "mu": np.stack([mu, zeros]),
                          "cond": np.stack([cond, zeros]), "spks": np.stack([spks, zspk])}
            else:
                frames = {"x": x[None], "mu": mu[None], "cond": cond[None], "spks": spks[None]}
            hist = history.steps[k]
            pre = prompt.steps[k] if prompt is not None and prompt.steps else None
            kv_prompt = pre.kv if pre is not None and pre.frames else None
            kv_hist = hist.kv if hist.frames else None
            cached = (pre.frames if kv_prompt is not None and pre is not None else 0) + (
                hist.frames if kv_hist is not None else 0)
            conv = hist.conv if hist.frames else (pre.conv if pre is not None else None)
            out = self.estimator.run(frames, t, start, chunk_attention_bias(start, n, cached),
                                     conv, kv_prompt, kv_hist, keep=store)
            if store:
                hist.append(out.new, (out.conv1_next, out.conv2_next), history.keep_frames)
            velocity: FloatArray = out.velocity
            return velocity

        return solve_euler(x0, call.schedule, rows, call.should_stop)

    def chunk_mel(
        self,
        tokens: npt.NDArray[np.int64],
        voice: VoiceFeatures,
        noise: FloatArray,
        history: KvCache,
        call: FlowCall,
        drop_lookahead_frames: int,
    ) -> FloatArray:
        """Mel of one chunk under upstream's chunk mask (``streaming=True``).

        Args:
            tokens: int64 [T] = the voice's P prompt tokens ++ all generated tokens so far
                (lookahead included); the chunk's new frames are those after the prompt
                cache and ``history``.
            voice: the flow's voice features; noise: float32 [80, >= 2T], the request's noise
                (column i = frame i; prompt frames use ``prompt_noise`` instead).
            history: this piece's history cache (appended to; its ``keep_frames`` bounds the
                attended history).
            call: the Euler schedule, the cancellation check and the stage times (``flow_s``
                and ``flow_calls`` are added to, prompt cache work included).
            drop_lookahead_frames: mu frames dropped at the end (6 = 2 x 3 lookahead tokens);
                0 marks a piece's final chunk, whose keys/values are never attended, so they
                are not stored.

        Returns:
            float32 [80, new generated frames].
        """
        began = time.perf_counter()
        prompt = self.prompt_cache(voice, call.schedule, call.should_stop)
        prompt_frames = int(voice.prompt_mel.shape[0])
        mu, spks = self.runner.encode(tokens, voice.speaker_embedding)
        end = mu.shape[1] - drop_lookahead_frames
        start = prompt.frames + history.frames
        if end <= start:
            return np.zeros((C.MEL_BINS, 0), dtype=np.float32)
        x0 = np.array(noise[:, start:end], dtype=np.float32, copy=True)
        cond = np.zeros((mu.shape[0], end - start), dtype=np.float32)
        if start < prompt_frames:
            x0[:, : prompt_frames - start] = self.prompt_noise(prompt_frames)[:, start:]
            cond[:, : prompt_frames - start] = np.asarray(
                voice.prompt_mel, dtype=np.float32)[start:].T
        given = Conditioning(np.ascontiguousarray(mu[:, start:end]), spks, cond)
        x = self._solve(x0, given, start, (prompt, history), call,
                        store=drop_lookahead_frames > 0)
        if call.times is not None:
            call.times.flow_s += time.perf_counter() - began
            call.times.flow_calls += 1
        logger.debug("chunked flow: frames %d..%d (%d cached) in %.3f s", start, end,
                     start, time.perf_counter() - began)
        return np.ascontiguousarray(x[:, max(0, prompt_frames - start):])


def save_kv_cache(path: Path, cache: KvCache) -> None:
    """Write ``cache`` to ``path`` (.npz, atomically); a failure is logged, not raised.

    Per step ``k``: ``kv{k}`` float32 [depth, 2, B, H, frames, head_dim] and the convolution
    context ``conv1_{k}``, ``conv2_{k}``."""
    arrays: dict[str, np.ndarray] = {"frames": np.asarray(cache.frames)}
    for k, step in enumerate(cache.steps):
        if step.kv:
            arrays[f"kv{k}"] = np.stack([np.stack(kv) for kv in step.kv])
        if step.conv is not None:
            arrays[f"conv1_{k}"], arrays[f"conv2_{k}"] = step.conv
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as handle:
            np.savez(handle, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("cannot write the flow prompt cache %s: %s", path, exc)


def load_kv_cache(path: Path, steps: int) -> KvCache | None:
    """Read a cache of ``steps`` Euler steps written by :func:`save_kv_cache`; None (logged)
    when damaged."""
    try:
        with np.load(path) as data:
            frames = int(data["frames"])
            loaded = []
            for k in range(steps):
                conv = (data[f"conv1_{k}"], data[f"conv2_{k}"]) if f"conv1_{k}" in data else None
                kv = None
                if frames:
                    stacked = np.ascontiguousarray(data[f"kv{k}"], dtype=np.float32)
                    if stacked.ndim != 6 or stacked.shape[1] != 2 or stacked.shape[4] != frames:
                        raise ValueError(f"kv{k} has shape {stacked.shape}")
                    kv = [(stacked[i, 0], stacked[i, 1]) for i in range(stacked.shape[0])]
                loaded.append(StepKv(kv, frames, conv))
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("damaged flow prompt cache %s (%s); recomputing it", path, exc)
        return None
    return KvCache(loaded)
