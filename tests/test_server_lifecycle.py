"""Server life cycle on the real engine: describe while the model loads, a broken voice
catalog (C16), and fault injection (an engine failing mid-synthesis)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from server_support import (
    FaultyEngine,
    SpyEngine,
    check_audio_format,
    client,
    collect,
    describe,
    fake_model_dir,
    faulty_factory,
    make_settings,
    one_shot_error,
    running_server,
    spy_factory,
    wait_until,
)
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeVoice,
)

from wyoming_cosyvoice3.engine.options import PRESETS, EngineOptions
from wyoming_cosyvoice3.server.engine_port import Engine, default_engine_factory
from wyoming_cosyvoice3.server.model_loader import ModelState

MakeClip = Callable[..., Path]


async def test_describe_and_errors_while_loading(tiny_model_dir: Path, tiny_engine_cache: Path,
                                                 tmp_path: Path) -> None:
    """Describe answers at once during loading; synthesis gets a model-loading error."""
    gate = threading.Event()

    def slow_factory(model_dir: Path, options: EngineOptions) -> Engine:
        gate.wait(60)
        return default_engine_factory(model_dir, options)

    settings = make_settings(tiny_model_dir, tmp_path, tiny_engine_cache)
    try:
        async with running_server(settings, slow_factory, wait_ready=False) as server:
            info = await describe(server, timeout_s=1.0)
            program = info.tts[0]
            assert program.installed and "loading" in (program.description or "")
            assert [v.installed for v in program.voices] == [False, False]
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="Hello.").event())
                assert (await one_shot_error(cl)).code == "model-loading"
                await cl.write_event(SynthesizeStart().event())
                await cl.write_event(SynthesizeChunk(text="Hello.").event())
                await cl.write_event(SynthesizeStop().event())
                streamed = await collect(cl, "synthesize-stopped")
                assert streamed.errors[0].code == "model-loading"
                gate.set()
                assert await asyncio.to_thread(server.runtime.loader.ready_event.wait, 60)
                assert server.runtime.loader.state is ModelState.READY
                await cl.write_event(Synthesize(text="Hello.").event())
                check_audio_format(await collect(cl, "audio-stop"))
            info = await describe(server)
            assert [v.installed for v in info.tts[0].voices] == [True, True]
    finally:
        gate.set()


async def test_failed_model_is_reported(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """A model dir without the files: describe still answers; synthesis gets the reason."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    settings = make_settings(empty, tmp_path)
    caplog.set_level(logging.INFO, logger="wyoming_cosyvoice3")
    async with running_server(settings) as server:
        assert server.runtime.loader.state is ModelState.FAILED
        info = await describe(server)
        description = info.tts[0].description or ""
        assert "unavailable" in description
        # a one-line summary: the full list of missing files is in the error and the log
        assert "\n" not in description and len(description) < 400
        async with client(server) as cl:
            await cl.write_event(Synthesize(text="Hello.").event())
            error = await one_shot_error(cl)
        assert error.code == "model-files-missing"
        assert "tokenizer.json" in error.text
        async with client(server) as cl:
            await cl.write_event(SynthesizeStart().event())
            await cl.write_event(SynthesizeChunk(text="Lights on. ").event())
            await cl.write_event(SynthesizeChunk(text="Door locked.").event())
            await cl.write_event(SynthesizeStop().event())
            streamed = await collect(cl, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["model-files-missing"]
    # the request lines show what was asked for even though nothing was spoken
    stream_lines = [r.getMessage() for r in caplog.records if "stream failed" in r.getMessage()]
    assert len(stream_lines) == 1 and "chars=22" in stream_lines[0]
    error_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Error")]
    assert len(error_lines) == 2 and all("\n" not in line for line in error_lines)


async def test_broken_catalog_entry(tiny_model_dir: Path, tiny_engine_cache: Path,
                                    tmp_path: Path, make_clip: MakeClip,
                                    caplog: pytest.LogCaptureFixture) -> None:
    """C16: a voice naming a missing clip is advertised not installed; the others work."""
    data_dir = tmp_path / "data"
    make_clip(data_dir / "clips" / "mine.wav", seconds=3.0)
    (tmp_path / "outside.wav").write_bytes((data_dir / "clips" / "mine.wav").read_bytes())
    (data_dir / "voices.yaml").write_text(
        "voices:\n"
        "  - name: ghost\n"
        "    languages: [en]\n"
        "    clip: clips/does-not-exist.wav\n"
        "  - name: escape\n"
        "    languages: [en]\n"
        "    clip: ../outside.wav\n"
        "  - name: mine\n"
        "    description: My own voice\n"
        "    languages: [de, en]\n"
        "    clip: clips/mine.wav\n"
        "  - name: 'bad name!'\n"
        "    languages: [en]\n"
        "    clip: clips/mine.wav\n"
        "  - name: nolang\n"
        "    languages: []\n"
        "    clip: clips/mine.wav\n",
        encoding="utf-8",
    )
    settings = make_settings(tiny_model_dir, data_dir, tiny_engine_cache)
    with caplog.at_level(logging.WARNING):
        async with running_server(settings) as server:
            info = await describe(server)
            installed = {v.name: v.installed for v in info.tts[0].voices}
            assert installed == {"zh-female": True, "en-male": True, "ghost": False,
                                 "escape": False, "mine": True, "nolang": False}
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="Guten Tag.",
                                                voice=SynthesizeVoice("mine")).event())
                check_audio_format(await collect(cl, "audio-stop"))
                await cl.write_event(Synthesize(text="Hi.", voice=SynthesizeVoice("ghost")).event())
                error = await one_shot_error(cl)
                assert error.code == "invalid-voice"
                assert "does-not-exist.wav" in error.text and "mine" in error.text
    for name in ("ghost", "escape", "bad name!", "nolang"):
        lines = [r for r in caplog.records if name in r.getMessage()
                 and r.levelno == logging.WARNING]
        assert len(lines) == 1, (name, [r.getMessage() for r in caplog.records])


async def test_engine_failure_mid_synthesis(tmp_path: Path, make_clip: MakeClip) -> None:
    """An exception inside one synthesis: coded error, audio-stop, connection reusable, the
    other client's request unaffected."""
    model_dir = tmp_path / "model"
    make_clip(model_dir / "voices" / "zh-female.wav")
    make_clip(model_dir / "voices" / "en-male.wav")
    settings = make_settings(model_dir, tmp_path, max_concurrent=2)
    async with running_server(settings, faulty_factory) as server, \
            client(server) as bad, client(server) as good:
        await bad.write_event(Synthesize(text="Fine start. This will FAIL. Never.").event())
        await good.write_event(Synthesize(text="All good. Really.").event())
        failed = await collect(bad, "audio-stop")
        fine = await collect(good, "audio-stop")
        assert [e.code for e in failed.errors] == ["synthesis-failed"]
        assert "hift.onnx" in failed.errors[0].text
        assert failed.types[-2:] == ["error", "audio-stop"]
        check_audio_format(failed)
        assert not fine.errors and len(fine.chunks) >= 6
        check_audio_format(fine)
        # streaming: the failing sentence ends the response with an error, then stopped
        await bad.write_event(SynthesizeStart().event())
        await bad.write_event(SynthesizeChunk(text="One. Now FAIL here. Three.").event())
        await bad.write_event(SynthesizeStop().event())
        streamed = await collect(bad, "synthesize-stopped")
        assert [e.code for e in streamed.errors] == ["synthesis-failed"]
        assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"]
        await bad.write_event(Synthesize(text="Recovered.").event())
        again = await collect(bad, "audio-stop")
        assert not again.errors and again.chunks


async def test_zeroconf_announces_the_bound_port(tmp_path: Path, make_clip: MakeClip,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--zeroconf NAME registers ``_wyoming._tcp`` with the real listening port."""
    import wyoming.zeroconf

    announced: list[tuple[str | None, int]] = []

    class Recorder:
        def __init__(self, port: int, name: str | None = None, host: str | None = None):
            announced.append((name, port))

        async def register_server(self) -> None:
            return None

    monkeypatch.setattr(wyoming.zeroconf, "HomeAssistantZeroconf", Recorder)
    model_dir = tmp_path / "model"
    make_clip(model_dir / "voices" / "zh-female.wav")
    settings = make_settings(model_dir, tmp_path, zeroconf="kitchen")
    async with running_server(settings, faulty_factory) as server:
        assert announced == [("kitchen", server.port)]


async def test_warm_up_uses_the_preset(tiny_model_dir: Path, tiny_engine_cache: Path,
                                       tmp_path: Path) -> None:
    """The start-up warm-up runs the preset's options (its DiT precision and Euler steps)."""
    holder: list[SpyEngine] = []
    settings = make_settings(tiny_model_dir, tmp_path, tiny_engine_cache, warm_up=True,
                             preset="fast")
    async with running_server(settings, spy_factory(holder)):
        (spy,) = holder
        options = spy.warm_up_options
        assert options is not None
        assert options.flow.schedule.steps == PRESETS["fast"].flow.schedule.steps == 2
        assert options.flow.precision == PRESETS["fast"].flow.precision


class GatedWarmUp(FaultyEngine):
    """Voices prepare at once; the warm-up waits for :attr:`gate`, then raises a bug when
    :attr:`crash` is set (a failed start after the voices were prepared)."""

    def __init__(self, model_dir: Path, options: EngineOptions) -> None:
        super().__init__(model_dir, options)
        self.warming = threading.Event()
        self.crash = False

    def warm_up(self, voice: object, options: object = None) -> None:
        self.warming.set()
        self.gate.wait(60)
        if self.crash:
            raise RuntimeError("injected warm-up crash")


async def test_voices_are_not_installed_while_warming_up_or_after_a_failed_start(
        tmp_path: Path, make_clip: MakeClip) -> None:
    """The voices are prepared before the warm-up, but describe advertises none installed
    until the model is READY: not during the warm-up, not after the start failed in it."""
    holder: list[GatedWarmUp] = []

    def factory(model_dir: Path, options: EngineOptions) -> Engine:
        holder.append(GatedWarmUp(model_dir, options))
        return holder[0]

    settings = make_settings(fake_model_dir(tmp_path, make_clip), tmp_path, warm_up=True)
    async with running_server(settings, factory, wait_ready=False) as server:
        try:
            assert await asyncio.to_thread(wait_until, lambda: bool(holder), 30.0)
            assert await asyncio.to_thread(holder[0].warming.wait, 30)
            assert all(slot.installed for slot in server.runtime.voices.values())
            program = (await describe(server, timeout_s=1.0)).tts[0]
            assert "warming up" in (program.description or "")
            assert [(v.name, v.installed) for v in program.voices] == [
                ("zh-female", False), ("en-male", False)]
            holder[0].crash = True
        finally:
            for engine in holder:
                engine.gate.set()
        assert await asyncio.to_thread(server.runtime.loader.ready_event.wait, 30)
        assert server.runtime.loader.state is ModelState.FAILED
        assert all(slot.installed for slot in server.runtime.voices.values())
        program = (await describe(server)).tts[0]
        assert "unavailable" in (program.description or "")
        assert "injected warm-up crash" in (program.description or "")
        assert [v.installed for v in program.voices] == [False, False]
