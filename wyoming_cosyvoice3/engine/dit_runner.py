"""The chunk-causal streaming DiT at run time: the static chunk mask, the rotary tables and
:class:`StreamingEstimator`, the runner of the derived graph.

The flow stage runs it (:mod:`.flow.solver`) and the derivation
(:mod:`.derive.flow.streaming_estimator`) runs it to validate the graphs it makes; stages never
import each other, so it lives outside both. The chunk mask is upstream's, as an additive
attention bias: cosyvoice/flow/DiT/dit.py ``DiT.forward(streaming=True)`` builds
``add_optional_chunk_mask(x, mask, False, False, 0, static_chunk_size=50, -1)``
(cosyvoice/utils/mask.py ``subsequent_chunk_mask``): mel frame i may attend to frame j iff
``j < (i // 50 + 1) * 50``, chunks counted from frame 0 of the prompt, every left chunk kept.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ModelLoadError
from .memory import return_freed_memory

# -- the streaming DiT: chunk mask ----------------------------------------------------------

CHUNK_FRAMES = 50
"""Static chunk in mel frames (cosyvoice3.yaml DiT ``static_chunk_size``; model.py:
"token_hop_len must match training static_chunk_size", 25 tokens x 2 frames)."""
NEG_INF = np.float32(-np.inf)


def chunk_attention_bias(
    start: int, count: int, cached: int, chunk_frames: int = CHUNK_FRAMES
) -> npt.NDArray[np.float32]:
    """Additive attention bias float32 [1, 1, count, cached + count].

    Rows: new frames ``start .. start + count - 1`` (absolute indices); columns: the
    ``cached`` frames just before ``start``, then the new frames. 0 where the static chunk
    mask allows attention, -inf elsewhere. Cached frames are always visible (they belong to
    earlier chunks when ``start`` is on the chunk grid, which upstream's schedule guarantees).
    ``chunk_frames <= 0``: full attention (all zeros).
    """
    bias = np.zeros((1, 1, count, cached + count), dtype=np.float32)
    if chunk_frames <= 0 or count == 0:
        return bias
    rows = np.arange(start, start + count)
    keys = np.arange(start, start + count)
    limit = (rows // chunk_frames + 1) * chunk_frames
    bias[0, 0, :, cached:][keys[None, :] >= limit[:, None]] = NEG_INF
    return bias


# -- rotary tables ---------------------------------------------------------------------------

def rope_tables(
    inv_freq: np.ndarray, freq_div: float, layout: str, start: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 [count, head_dim] for absolute positions ``start .. start+count-1``.

    x-transformers ``RotaryEmbedding.forward_from_seq_len``: ``freqs = einsum(t, inv_freq) /
    interpolation_factor``, each frequency used for a pair of channels (interleaved) or both
    halves ("half"); computed in float32 as torch does.
    """
    pos = np.arange(start, start + count, dtype=np.float32)
    freqs = (pos[:, None] * np.asarray(inv_freq, np.float32)[None, :]).astype(np.float32)
    if freq_div != 1.0:
        freqs = (freqs / np.float32(freq_div)).astype(np.float32)
    if layout == "interleaved":
        table = np.repeat(freqs, 2, axis=1)
    else:
        table = np.concatenate([freqs, freqs], axis=1)
    return np.cos(table).astype(np.float32), np.sin(table).astype(np.float32)


# -- runner ---------------------------------------------------------------------------------

def _session(path: Path) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


KeyValue = tuple[np.ndarray, np.ndarray]
"""One block's (keys, values), float32 [B, H, frames, head_dim] each (head-major)."""


class StreamOutputs:
    """One call's outputs: ``velocity`` [B, 80, n], convolution pasts [B, D, K-1], and per
    block ``new`` (keys, values) [B, H, n, head_dim] of the call's frames (empty when the
    call was made with ``keep=False``)."""

    __slots__ = ("conv1_next", "conv2_next", "new", "velocity")

    def __init__(self, values: Sequence[np.ndarray]) -> None:
        self.velocity, self.conv1_next, self.conv2_next = values[:3]
        rest = values[3:]
        self.new: list[KeyValue] = [(rest[2 * i], rest[2 * i + 1])
                                    for i in range(len(rest) // 2)]


class StreamingEstimator:
    """Runs the derived main graph; computes modulation (time graph) once per ``t``.

    Args:
        main: onnxruntime session of the main graph, or a :class:`~.sessions.Graph` of it
            (runs are then seen by the benchmark's run observer).
        time_session: session of the time graph (released after :meth:`precompute`; a later
            unseen ``t`` reopens it from ``time_path``).
        time_path: the time graph file (None: keep ``time_session``).
    """

    def __init__(self, main: Any, time_session: Any = None, time_path: Path | None = None,
                 session_factory: Any = None) -> None:
        self.main = main
        self._time = time_session
        self.time_path = time_path
        self._factory = session_factory or _session
        session = getattr(main, "session", main)
        self.path: Path | None = getattr(main, "path", None)
        meta = session.get_modelmeta().custom_metadata_map
        self.depth = int(meta["depth"])
        self.dim = int(meta["dim"])
        self.inner = int(meta["inner"])
        self.head_dim = int(meta["head_dim"])
        self.heads = int(meta["heads"])
        self.conv_frames = int(meta["conv_context_frames"])
        self.layout = meta["rope_layout"]
        self.inv_freq = np.array([float(f) for f in meta["rope_inv_freq"].split(",")], np.float32)
        self.freq_div = float(meta["rope_freq_div"])
        self.outputs = ["velocity", "conv1_next", "conv2_next"] + [
            f"new_{kind}_{i}" for i in range(self.depth) for kind in ("key", "value")]
        self._rope_tables = rope_tables
        self._mods: dict[float, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()

    def modulation(self, t: float) -> dict[str, np.ndarray]:
        """``mod_<i>_<j>`` and ``mod_final_<j>`` float32 [D] for time ``t`` (the time graph's
        outputs, :mod:`.derive.flow.streaming_graph`; cached; a time not precomputed opens the
        time graph for this one call)."""
        key = float(np.float32(t))
        with self._lock:
            hit = self._mods.get(key)
            if hit is not None:
                return hit
            return self._compute([key])[key]

    def _compute(self, keys: Sequence[float]) -> dict[float, dict[str, np.ndarray]]:
        """Run the time graph for ``keys`` (lock held); an opened graph is dropped after."""
        session = self._time
        opened = session is None
        if session is None:
            if self.time_path is None:
                raise ModelLoadError("the streaming DiT's time graph is not available")
            session = self._factory(self.time_path)
        names = [o.name for o in session.get_outputs()]
        for key in keys:
            values = session.run(names, {"t": np.array([key], dtype=np.float32)})
            self._mods[key] = {n: np.ascontiguousarray(v)
                               for n, v in zip(names, values, strict=True)}
        if opened:
            del session
            return_freed_memory()  # the time graph's weights (0.57 GB at full size)
        return {k: self._mods[k] for k in keys}

    def precompute(self, t_values: Sequence[float]) -> None:
        """Compute the modulation for every ``t`` with one opening of the time graph, then
        release it (and give its freed heap back to the operating system)."""
        with self._lock:
            missing = sorted({float(np.float32(t)) for t in t_values} - set(self._mods))
            if missing:
                self._compute(missing)
            if self.time_path is not None and self._time is not None:
                self._time = None
                return_freed_memory()

    def empty_past(self, batch: int) -> np.ndarray:
        """float32 [batch, H, 0, head_dim]: no cached frames."""
        return np.zeros((batch, self.heads, 0, self.head_dim), dtype=np.float32)

    def run(
        self,
        frames: dict[str, np.ndarray],
        t: float,
        start_frame: int,
        attn_bias: np.ndarray,
        conv_past: tuple[np.ndarray, np.ndarray] | None = None,
        prompt: Sequence[KeyValue] | None = None,
        hist: Sequence[KeyValue] | None = None,
        keep: bool = True,
    ) -> StreamOutputs:
        """One estimator call on new frames.

        Args:
            frames: ``x``, ``mu``, ``cond`` float32 [B, 80, n] and ``spks`` [B, 80].
            t: flow time of the Euler step.
            start_frame: absolute index of the first new frame (rotary position).
            attn_bias: [1, 1, n, m + n] (:func:`chunk_attention_bias`); m = mp + mh cached frames.
            conv_past: (conv1, conv2) [B, D, K-1] or None (zeros: the utterance start).
            prompt, hist: per block (keys, values) [B, H, mp or mh, head_dim] of the cached
                prompt and history frames, or None (0 frames).
            keep: return the new frames' keys/values (False: velocity and convolution
                context only).
        """
        batch, _, n = frames["x"].shape
        cos, sin = self._rope_tables(self.inv_freq, self.freq_div, self.layout, start_frame, n)
        feeds: dict[str, np.ndarray] = dict(frames)
        feeds.update(self.modulation(t))
        feeds["rope_cos"], feeds["rope_sin"] = cos, sin
        feeds["attn_bias"] = attn_bias
        if conv_past is None:
            zeros = np.zeros((batch, self.dim, self.conv_frames), dtype=np.float32)
            conv_past = (zeros, zeros)
        feeds["conv1_past"], feeds["conv2_past"] = conv_past
        empty = self.empty_past(batch)
        for part, cached in (("prompt", prompt), ("hist", hist)):
            for i in range(self.depth):
                key, value = (empty, empty) if cached is None else cached[i]
                feeds[f"{part}_key_{i}"], feeds[f"{part}_value_{i}"] = key, value
        names = self.outputs if keep else self.outputs[:3]
        if hasattr(self.main, "spec"):  # a checked Graph: returns a dict
            out = self.main.run(feeds, names)
            return StreamOutputs([out[name] for name in names])
        return StreamOutputs(self.main.run(names, feeds))
