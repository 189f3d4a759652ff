"""The default preset's int8 DiT end to end through the server (issue 16, item 5).

On the ``tiny`` model the int8 derivation falls back to the fp32 estimator (its stand-in DiT
has no per-frame MatMul with a constant weight), so that path never ran in the server tests.
The ``tiny-dit`` model has an upstream-structured DiT and vocoder: at start the server
derives the split estimator with an int8 per-frame graph and the phase-carrying vocoder into
``<data dir>/engine-cache`` (warm-up included, as in a default start), and requests run through
them. Its LLM is the tiny stand-in, not a Qwen2 stack, so the default fused LLM graph falls
back to the published one with its one warning (the fused graph itself: test_llm_fused.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from server_support import check_audio_format, client, collect, make_settings, running_server
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from wyoming_cosyvoice3.engine.derive.estimator_split import SplitEstimator
from wyoming_cosyvoice3.engine.options import PRESETS
from wyoming_cosyvoice3.server.settings import Settings

pytestmark = pytest.mark.timeout(300)


async def test_default_preset_runs_the_int8_split_dit_end_to_end(
        tiny_dit_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "data"
    settings = make_settings(tiny_dit_model_dir, data_dir, warm_up=True,
                             llm_graph=Settings.llm_graph)  # every default as shipped
    assert settings.preset == Settings.preset == "balanced"  # the default
    assert PRESETS["balanced"].flow_precision == "int8"
    with caplog.at_level(logging.INFO):
        async with running_server(settings) as server:
            engine: Any = server.runtime.engine
            estimator = engine.model.estimator_for("int8")
            assert isinstance(estimator, SplitEstimator)
            assert "int8main" in estimator.path.name
            assert estimator.path.parent == data_dir / "engine-cache"
            assert estimator.time_runs > 0  # the warm-up precomputed the time conditioning
            calls: list[int] = []
            run = estimator.run

            def counting_run(*args: Any, **kwargs: Any) -> Any:
                calls.append(1)
                return run(*args, **kwargs)

            estimator.run = counting_run  # type: ignore[method-assign]
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="The front door is locked.").event())
                one_shot = await collect(cl, "audio-stop")
                used_by_one_shot = len(calls)
                await cl.write_event(SynthesizeStart().event())
                await cl.write_event(SynthesizeChunk(text="Lights on. Kitchen").event())
                await cl.write_event(SynthesizeChunk(text=" too.").event())
                await cl.write_event(SynthesizeStop().event())
                streamed = await collect(cl, "synthesize-stopped")
            assert engine.model.estimator is estimator  # loaded at start, not on first use
            # the preset's 16-frame vocoder window continues the harmonic phase
            assert engine.model.hift_phase_period is not None
            assert PRESETS["balanced"].vocoder_window_frames > 0
    for response in (one_shot, streamed):
        check_audio_format(response)
        assert not response.errors and len(response.samples) > 24000 // 4
    # 4 Euler steps per flow call of the preset, each through the int8 estimator
    assert used_by_one_shot >= PRESETS["balanced"].euler_steps
    assert len(calls) > used_by_one_shot
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(problems) == 1 and problems[0].startswith("fused LLM graph not used")
    assert "LlmStructureError" in problems[0]  # the stand-in LLM, and only that
    assert any("split estimator ready" in r.getMessage() for r in caplog.records)
