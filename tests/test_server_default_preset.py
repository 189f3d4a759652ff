"""The default preset's derived graphs end to end through the server.

The tiny model has the published graphs' structure: at start the server derives the fused
LLM, the int8 streaming DiT and the streamed vocoder into
``<data dir>/engine-cache`` (warm-up included, as in a default start), and requests run
through them: `balanced` is chunk-causal, so the streaming DiT is the only DiT graph loaded.
Not one graph falls back (each fallback: test_llm_fused.py, test_perf_derived.py,
test_streaming_full.py, test_hift_stream.py).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from server_support import check_audio_format, client, collect, make_settings, running_server
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from wyoming_cosyvoice3.engine.derive.flow.full_attention import FullAttentionDiT
from wyoming_cosyvoice3.engine.loaders import fused_form_of
from wyoming_cosyvoice3.engine.options import PRESETS
from wyoming_cosyvoice3.server.settings import Settings

pytestmark = pytest.mark.timeout(300)


async def test_default_preset_runs_the_int8_streaming_dit_end_to_end(
        tiny_dit_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "data"
    settings = make_settings(tiny_dit_model_dir, data_dir, warm_up=True,
                             llm_graph=Settings.llm_graph)  # every default as shipped
    # the default is auto, which takes balanced when no preset keeps up with playback
    # (test_server_auto_preset.py); this test runs balanced on any machine
    assert settings.preset == "balanced" and Settings.preset == "auto"
    balanced = PRESETS["balanced"]
    assert balanced.flow.precision == "int8" and balanced.flow.chunk_causal
    with caplog.at_level(logging.INFO):
        async with running_server(settings) as server:
            engine: Any = server.runtime.loader.engine
            # the LLM graph the machine probe chose for the preset, or one it read close and
            # the timed steps found faster (or the fused graph, when that form is refused for
            # this model)
            plan = server.runtime.loader.llm_plan
            assert plan is not None and plan.decode in ("fused", "fused-b8")
            assert fused_form_of(engine.model.llm) in (plan.decode, *plan.candidates, "fused")
            assert engine.model.hift_stream is not None  # the streamed vocoder
            streaming = engine.model.streaming_estimator("int8")
            assert streaming is not None and "stream4int8main" in streaming.path.name
            assert streaming.path.parent == data_dir / "engine-cache"
            # one DiT graph: it also stands in for the published estimator
            assert isinstance(engine.model.estimator, FullAttentionDiT)
            assert engine.model.estimator.streaming is streaming
            assert list(engine.model._estimators) == ["int8"]  # no split estimator opened
            flow = engine.chunked.get("int8")
            assert flow is not None and flow.estimator is streaming
            calls: list[int] = []
            run = streaming.run

            def counting_run(*args: Any, **kwargs: Any) -> Any:
                calls.append(1)
                return run(*args, **kwargs)

            streaming.run = counting_run  # type: ignore[method-assign]
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="The front door is locked.").event())
                one_shot = await collect(cl, "audio-stop")
                used_by_one_shot = len(calls)
                await cl.write_event(SynthesizeStart().event())
                await cl.write_event(SynthesizeChunk(text="Lights on. Kitchen").event())
                await cl.write_event(SynthesizeChunk(text=" too.").event())
                await cl.write_event(SynthesizeStop().event())
                streamed = await collect(cl, "synthesize-stopped")
            # the streamed vocoder served everything: its fallback, hift.onnx in the
            # preset's 24-frame windows, was not loaded, and no other vocoder form derived
            assert engine.model._hift is None
            assert [p.name.split("-")[0] for p in (data_dir / "engine-cache").glob("hift.*.onnx")
                    ] == ["hift.stream4"]
            assert balanced.vocoder_window_frames > 0
    for response in (one_shot, streamed):
        check_audio_format(response)
        assert not response.errors and len(response.samples) > 24000 // 4
    # 4 Euler steps per flow call of the preset, each through the int8 streaming DiT
    assert used_by_one_shot >= balanced.flow.schedule.steps
    assert len(calls) > used_by_one_shot
    # every derived graph of the preset was made and used: not one fallback warning
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == []
