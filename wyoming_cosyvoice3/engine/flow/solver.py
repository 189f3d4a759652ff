"""Flow matching: speech tokens -> 50 Hz mel frames (spec section 5).

The graphs ``flow_encoder.onnx`` (token embedding, pre-lookahead convolution, 2x upsampling,
speaker projection) and ``flow.decoder.estimator.fp32.onnx`` (the DiT velocity field) are run
from here; the Euler steps with classifier-free guidance (CFG) are :func:`.euler.solve_euler`.

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

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..errors import GraphSignatureMismatch, SynthesisCancelled, SynthesisFailed
from ..options import StageTimes
from ..types import ShouldStop, VoiceFeatures
from .euler import EulerSchedule, solve_euler

if TYPE_CHECKING:
    from ..model import CosyVoice3Model

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


class FlowRunner:
    """Runs flow_encoder + the DiT estimator for one model; holds no per-request state.

    Args:
        model: a loaded :class:`~.model.CosyVoice3Model` (uses ``.flow_encoder`` and
            ``.estimator``).

    Raises:
        GraphSignatureMismatch: the graphs lack the input/output names of the contract.
    """

    def __init__(self, model: CosyVoice3Model) -> None:
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
        graph = self.model.estimator_for(precision)  # type: ignore[arg-type]
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
        self,
        x: FloatArray,
        mu: FloatArray,
        spks: FloatArray,
        cond: FloatArray,
        t: float,
        guided: bool,
        estimator: Any,
    ) -> FloatArray:
        """One Euler step's estimator rows, float32 [B, 80, F]: B = 2 (conditional,
        unconditional) when ``guided``; unguided steps run batch 1 when the graph takes it,
        else batch 2 with both rows conditional."""
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
    def solve(
        self,
        x0: FloatArray,
        mu: FloatArray,
        spks: FloatArray,
        cond: FloatArray,
        steps: int,
        cfg_rate: float,
        cfg_steps: int | None = None,
        should_stop: ShouldStop | None = None,
        precision: str | None = None,
    ) -> FloatArray:
        """Euler ODE solve from noise to mel with the full-attention estimator
        (flow_matching.py ``solve_euler``; the loop is :func:`.euler.solve_euler`).

        Args:
            x0: float32 [80, F], the start noise.
            mu: float32 [80, F]; spks: float32 [80]; cond: float32 [80, F].
            steps: Euler steps n; cfg_rate: CFG rate.
            cfg_steps: CFG only in the first ``cfg_steps`` steps (None = all).
            should_stop: checked before every Euler step.
            precision: estimator precision ("fp32", "int8"); None = the one loaded at start.

        Returns:
            float32 [80, F], the mel at t = 1.

        Raises:
            SynthesisCancelled: ``should_stop()`` returned True.
        """
        estimator = self.estimator_for(precision)

        def rows(x: FloatArray, _k: int, t: float, guided: bool) -> FloatArray:
            return self._velocity_rows(x, mu, spks, cond, t, guided, estimator)

        schedule = EulerSchedule(steps, cfg_rate, cfg_steps)
        return solve_euler(x0, schedule, rows, should_stop)

    def mel_for_tokens(
        self,
        tokens: npt.NDArray[np.int64],
        voice: VoiceFeatures,
        noise: FloatArray,
        steps: int = C.DEFAULT_EULER_STEPS,
        cfg_rate: float = C.DEFAULT_CFG_RATE,
        cfg_steps: int | None = None,
        drop_lookahead_frames: int = 0,
        should_stop: ShouldStop | None = None,
        times: StageTimes | None = None,
        *,
        generated_offset_tokens: int = 0,
        precision: str | None = None,
    ) -> FloatArray:
        """Mel frames for the generated tokens (flow.py ``CausalMaskedDiffWithDiT.inference``).

        Args:
            tokens: int64 [T] = the voice's P prompt tokens ++ generated tokens (lookahead
                tokens included when streaming).
            voice: the voice's features (prompt tokens, prompt mel [2P, 80], embedding).
            noise: float32 [80, N], the request's fixed N(0,1) buffer, N >= 2T. Frame i of the
                flow input reads noise column i for the prompt and column
                ``2P + 2 * generated_offset_tokens + j`` for generated frame j.
            steps, cfg_rate, cfg_steps: see :meth:`solve`.
            drop_lookahead_frames: mu frames dropped at the end (6 = 2 x 3 lookahead tokens in
                streamed chunks, 0 on the final chunk): the exported encoder is the "finalize"
                form, so the last tokens' frames lack their right context.
            should_stop: checked before the encoder and before every Euler step.
            times: ``flow_s`` and ``flow_calls`` are added to.
            generated_offset_tokens: index (in the whole generated sequence) of the first
                generated token in ``tokens``; > 0 with a bounded left context.
            precision: estimator precision ("fp32", "int8"); None = the one loaded at start.

        Returns:
            float32 [80, 2T - 2P - drop_lookahead_frames].

        Raises:
            SynthesisCancelled: ``should_stop()`` returned True.
            SynthesisFailed: a graph failed or the noise buffer is too short.
        """
        start = time.perf_counter()
        if should_stop is not None and should_stop():
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
        mel = self.solve(x0, mu, spks, cond, steps, cfg_rate, cfg_steps, should_stop, precision)
        elapsed = time.perf_counter() - start
        if times is not None:
            times.flow_s += elapsed
            times.flow_calls += 1
        logger.debug(
            "flow: %d tokens -> %d frames (%d new) in %.3f s",
            len(tokens),
            n_frames,
            gen_frames,
            elapsed,
        )
        return np.ascontiguousarray(mel[:, prompt_frames:])
