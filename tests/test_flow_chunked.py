"""Chunk-causal streaming flow: schedule, chunk mask and the fallback on other graphs.

The exactness against upstream is tested in test_parity_flow_chunked.py (on the parity fixture
set) and against an uncached reference in test_flow_chunked_reference.py; the fallback here
runs the tiny synthetic model with a convolutional estimator (no DiT blocks to stream), so the
engine must fall back to full attention with one warning.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from broken_graphs import convolutional_estimator
from decoding_support import FixedDecoding

from synthetic.audio import write_clip
from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions
from wyoming_cosyvoice3.engine.dit_runner import chunk_attention_bias
from wyoming_cosyvoice3.engine.flow.solver import cacheable_prompt_frames
from wyoming_cosyvoice3.engine.flow.stream import first_hop_tokens
from wyoming_cosyvoice3.engine.options import PRESETS, EulerSchedule
from wyoming_cosyvoice3.engine.sessions import ESTIMATOR


def test_chunk_bias_is_upstreams_static_chunk_mask() -> None:
    """utils/mask.py subsequent_chunk_mask(size, 50): frame i sees j < (i // 50 + 1) * 50."""
    full = chunk_attention_bias(0, 130, 0)[0, 0]
    allowed = np.isfinite(full)
    i, j = np.meshgrid(np.arange(130), np.arange(130), indexing="ij")
    np.testing.assert_array_equal(allowed, j < (i // 50 + 1) * 50)
    # the same rows, seen from a cache of the first 100 frames: cached keys all allowed
    tail = chunk_attention_bias(100, 30, 100)[0, 0]
    np.testing.assert_array_equal(np.isfinite(tail), allowed[100:])
    assert (chunk_attention_bias(0, 7, 3, 0) == 0).all()  # chunk 0 frames: full attention


def test_first_hop_is_padded_to_the_25_token_grid() -> None:
    quality = PRESETS["quality"].flow
    assert first_hop_tokens(quality, 50) == 25
    assert first_hop_tokens(quality, 37) == 38  # model.py prompt_token_pad = 13
    assert first_hop_tokens(quality, 125) == 25
    assert first_hop_tokens(quality, 126) == 49
    balanced = PRESETS["balanced"].flow
    assert first_hop_tokens(balanced, 37) == balanced.first_hop_tokens


def test_cache_geometry() -> None:
    assert EulerSchedule(4, 0.7).key == (1, 1, 1, 1)
    assert EulerSchedule(3, 0.0).key == (0, 0, 0)
    assert cacheable_prompt_frames(125) == 200  # 250 frames, the last 6 wait for new tokens


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> CosyVoice3Engine:
    """The tiny model with a convolutional estimator: no DiT blocks to stream."""
    model_dir = tmp_path_factory.mktemp("conv-dit") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    onnx.save(convolutional_estimator(), str(model_dir / ESTIMATOR.file))
    cache = tmp_path_factory.mktemp("derived")
    return CosyVoice3Engine.load(
        model_dir, EngineOptions(threads=1, llm_precision="fp32", cache_dir=cache,
                                      observer=FixedDecoding(2.0))
    )


def test_quality_preset_falls_back_to_full_attention_with_one_warning(
    engine: CosyVoice3Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clip = write_clip(tmp_path / "ref.wav", seconds=3.0)
    voice = engine.prepare_voice(clip, transcript="This is a reference clip.", name="t")
    text = "The kitchen lights are on and the front door is locked."
    # vocoder deferral follows the wall clock (a slow run merges chunks); without it every
    # flow chunk gives one audio chunk
    options = PRESETS["quality"].replace(flow={"schedule": {"steps": 2}},
                                         vocoder={"defer": False})
    with caplog.at_level(logging.WARNING):
        engine.warm_up(voice, options)
        first = [c.samples for c in engine.synthesize(text, voice, options)]
        second = [c.samples for c in engine.synthesize(text, voice, options)]
    # the one warning came when the engine loaded (with a cache directory the streaming DiT
    # is tried at start, as the estimator's form): none from the requests
    warnings = [r for r in caplog.records if "chunk-causal streaming flow" in r.getMessage()]
    assert not warnings, [r.getMessage() for r in caplog.records]
    assert engine.model.streaming_estimator("fp32") is None
    assert engine.chunked.loaded() == {"fp32": False}
    assert len(first) >= 3  # padded first hop, then 50, then the final chunk
    plain = [c.samples for c in engine.synthesize(
        text, voice, options.replace(flow={"chunk_causal": False}))]
    for a, b, c in zip(first, second, plain, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_prompt_caches_in_memory_are_bounded() -> None:
    """Only the most recently used prompt caches stay in memory (they are GB-sized)."""
    from types import SimpleNamespace

    from wyoming_cosyvoice3.engine.flow.solver import PROMPTS_IN_MEMORY, ChunkedFlow
    from wyoming_cosyvoice3.engine.options import VoiceFeatures

    est = SimpleNamespace(depth=2, inner=8)
    runner: Any = SimpleNamespace()  # never called: nothing to cache for a 10-token prompt
    flow = ChunkedFlow(runner, est, lambda n: np.zeros((80, n), np.float32))
    voices = [
        VoiceFeatures(np.arange(10, dtype=np.int64) + k, np.zeros(192, np.float32),
                      np.zeros((20, 80), np.float32))
        for k in range(PROMPTS_IN_MEMORY + 1)
    ]
    two = EulerSchedule(2, 0.7)
    caches = [flow.prompt_cache(v, two) for v in voices]  # 10 tokens: nothing cached
    assert all(c.frames == 0 and len(c.steps) == 2 for c in caches)
    assert len(flow._prompts) == PROMPTS_IN_MEMORY
    assert flow.prompt_cache(voices[-1], two) is caches[-1]
    assert flow.prompt_cache(voices[0], two) is not caches[0]  # evicted, rebuilt
