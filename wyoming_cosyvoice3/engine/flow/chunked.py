"""Chunk-causal streaming flow: each chunk costs its own frames (upstream's PyTorch streaming).

Upstream streams with ``flow.inference(streaming=True)`` for every non-final chunk
(cosyvoice/cli/model.py ``CosyVoice3Model.tts`` / ``token2wav``), so the DiT attends with a
static 50-frame chunk mask counted from frame 0 of the prompt (cosyvoice/flow/DiT/dit.py
``DiT.forward``; utils/mask.py ``add_optional_chunk_mask``); the final chunk
(``finalize=True``) runs with full attention. Under the chunk mask, a frame's keys and values
at an Euler step depend only on frames of its own and earlier chunks, so:

* **prompt cache** (per voice and Euler schedule): the prompt frames in whole chunks that end
  at least ``2 x 3`` frames before the prompt's end (the pre-lookahead layer lets the last 3
  prompt tokens' mu depend on the generated tokens: flow.py ``pre_lookahead_layer``) are run
  once, with a fixed prompt noise (the engine passes the flow noise of seed 0, which is also
  the default request seed), and their keys/values and convolution context are kept for
  every Euler step and CFG row (:class:`KvCache`);
* **history cache** (per request piece): each chunk's keys/values are appended.

A chunk then runs the derived streaming estimator (:class:`..streaming_dit.StreamingEstimator`)
on its new frames only: the prompt frames after the cached ones (first chunk only) and its
generated frames, with rotary positions continuing after the cached frames.

Memory: per cached frame, Euler step and CFG row, ``depth x 2 x inner x 4`` bytes (180 KB
with the published dims: depth 22, inner 1024).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import constants as C
from ..options import StageTimes
from ..streaming_dit import CHUNK_FRAMES, chunk_attention_bias
from ..types import ShouldStop, VoiceFeatures
from .euler import EulerSchedule, solve_euler
from .solver import FlowRunner

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float32]
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
    """Per Euler step :class:`StepKv` (prompt cache of a voice, or a piece's history)."""

    steps: list[StepKv] = field(default_factory=list)

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
            (:class:`..streaming_dit.StreamingEstimator`: ``run``, ``depth``, ``inner``).
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

    def _disk_path(self, digest: str, schedule: tuple[int, ...], cfg_rate: float) -> Path | None:
        if self.disk_dir is None:
            return None
        sched = "".join(str(g) for g in schedule)
        return self.disk_dir / f"{DISK_PREFIX}-{digest}-{sched}-{cfg_rate:g}-{self.disk_tag}.npz"

    # -- caches -----------------------------------------------------------------------------
    def prompt_cache(self, voice: VoiceFeatures, steps: int, cfg_rate: float,
                     cfg_steps: int | None, should_stop: ShouldStop | None = None) -> KvCache:
        """The voice's prompt cache for this Euler schedule (computed once, kept in memory)."""
        key = (features_digest(voice), EulerSchedule(steps, cfg_rate, cfg_steps).key, cfg_rate)
        with self._lock:
            hit = self._prompts.get(key)
            if hit is not None:
                self._prompts.move_to_end(key)
        if hit is not None:
            return hit
        path = self._disk_path(*key)
        if path is not None and path.is_file():
            loaded = load_kv_cache(path, steps)
            if loaded is not None:
                self._remember(key, loaded)
                return loaded
        prompt_tokens = np.asarray(voice.speech_tokens, dtype=np.int64).reshape(-1)
        frames = cacheable_prompt_frames(len(prompt_tokens))
        cache = self.new_history(steps, cfg_rate, cfg_steps)
        if frames > 0:
            mu, spks = self.runner.encode(prompt_tokens, voice.speaker_embedding)
            cond = np.asarray(voice.prompt_mel, dtype=np.float32)[:frames].T
            self._solve(self.prompt_noise(frames), mu[:, :frames], np.ascontiguousarray(cond), spks,
                        0, steps, cfg_rate, cfg_steps, None, cache, should_stop)
        logger.info("flow prompt cache: %d frames, %d Euler steps, %.1f MB", frames, steps,
                    cache.nbytes / 1e6)
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

    def new_history(self, steps: int, cfg_rate: float, cfg_steps: int | None) -> KvCache:
        """An empty history cache for one piece (batch per step from the CFG schedule)."""
        return KvCache([StepKv() for _ in range(steps)])

    # -- solver -----------------------------------------------------------------------------
    def _solve(
        self,
        x0: FloatArray,
        mu: FloatArray,
        cond: FloatArray,
        spks: FloatArray,
        start: int,
        steps: int,
        cfg_rate: float,
        cfg_steps: int | None,
        prompt: KvCache | None,
        history: KvCache,
        should_stop: ShouldStop | None,
        left_context_frames: int | None = None,
        store: bool = True,
    ) -> FloatArray:
        """Euler/CFG solve of new frames ``start ..`` (float32 [80, n] each); appends their
        keys/values to ``history`` (unless ``store`` is False: a piece's final chunk), keeping
        at most ``left_context_frames`` when given. flow_matching.py ``solve_euler`` with
        cached attention; the loop is :func:`.euler.solve_euler`, the estimator call is the
        streaming graph's on the new frames."""
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
                hist.append(out.new, (out.conv1_next, out.conv2_next), left_context_frames)
            velocity: FloatArray = out.velocity
            return velocity

        return solve_euler(x0, EulerSchedule(steps, cfg_rate, cfg_steps), rows, should_stop)

    def chunk_mel(
        self,
        tokens: npt.NDArray[np.int64],
        voice: VoiceFeatures,
        noise: FloatArray,
        history: KvCache,
        steps: int,
        cfg_rate: float,
        cfg_steps: int | None,
        drop_lookahead_frames: int,
        should_stop: ShouldStop | None = None,
        left_context_frames: int | None = None,
        times: StageTimes | None = None,
        store_history: bool = True,
    ) -> FloatArray:
        """Mel of one non-final chunk under upstream's chunk mask (``streaming=True``).

        Args:
            tokens: int64 [T] = the voice's P prompt tokens ++ all generated tokens so far
                (lookahead included); the chunk's new frames are those after the prompt
                cache and ``history``.
            voice: the flow's voice features; noise: float32 [80, >= 2T], the request's noise
                (column i = frame i; prompt frames use ``prompt_noise`` instead).
            history: this piece's history cache (appended to).
            drop_lookahead_frames: mu frames dropped at the end (6 = 2 x 3 lookahead tokens).
            left_context_frames: attend to at most this many history frames (None = all).
            times: ``flow_s`` and ``flow_calls`` are added to (prompt cache work included).
            store_history: False for a piece's final chunk (its keys/values are not needed).

        Returns:
            float32 [80, new generated frames].
        """
        began = time.perf_counter()
        prompt = self.prompt_cache(voice, steps, cfg_rate, cfg_steps, should_stop)
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
        x = self._solve(x0, np.ascontiguousarray(mu[:, start:end]), cond, spks, start, steps,
                        cfg_rate, cfg_steps, prompt, history, should_stop, left_context_frames,
                        store_history)
        if times is not None:
            times.flow_s += time.perf_counter() - began
            times.flow_calls += 1
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
