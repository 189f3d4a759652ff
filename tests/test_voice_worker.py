"""The voice encoder process (engine/voice/worker.py) on the tiny model: the same features as
in this process, the same typed errors for bad clips, bounded jobs, idle exit, and a server
whose own process never loads the voice encoders (preparing a voice in the server's process
delayed ``describe``)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from server_support import link_engine_cache

from wyoming_cosyvoice3.engine.errors import ModelFilesMissing, SynthesisFailed, VoiceError
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions
from wyoming_cosyvoice3.engine.pipeline import CosyVoice3Engine
from wyoming_cosyvoice3.engine.voice.prepare import VoiceFeatureExtractor
from wyoming_cosyvoice3.engine.voice.worker import NICE_INCREMENT, VoiceWorker, WorkerConfig

pytestmark = pytest.mark.timeout(300)

FIELDS = ("speech_tokens", "speaker_embedding", "prompt_mel")


@pytest.fixture(scope="module")
def tiny_model(bare_model: CosyVoice3Model) -> CosyVoice3Model:
    return bare_model


@pytest.fixture
def worker(tiny_model_dir: Path):
    made = VoiceWorker(WorkerConfig(tiny_model_dir))
    yield made
    made.close()


def _refuse_encoders_here(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: CosyVoice3Model) -> None:
        raise AssertionError(f"voice encoders loaded in process {os.getpid()}")

    monkeypatch.setattr(CosyVoice3Model, "voice_encoders", refuse)


def _nice(pid: int) -> int:
    """The process's nice value (field 19 of /proc/PID/stat, ``man 5 proc``)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[16])


def _no_address(message: str) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x?", message)


def _wait_until(condition, limit_s: float = 20.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def test_child_features_equal_those_computed_here(
    worker: VoiceWorker, tiny_model: CosyVoice3Model, make_clip, tmp_path: Path
) -> None:
    clip = make_clip(tmp_path / "stereo.wav", seconds=3.0, sample_rate_hz=44100, channels=2)
    got = worker.compute(clip.read_bytes(), str(clip))
    pid = worker.pid
    assert pid is not None and pid != os.getpid()
    again = worker.compute(clip.read_bytes(), str(clip))
    assert worker.pid == pid  # one child serves clips prepared one after another
    assert _nice(pid) == _nice(os.getpid()) + NICE_INCREMENT  # the server's threads come first
    want = VoiceFeatureExtractor(tiny_model, None).prepare(clip).features
    assert want.speech_tokens.shape[0] > 0
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
        np.testing.assert_array_equal(getattr(again, field), getattr(want, field))
        assert not getattr(got, field).flags.writeable
    assert got.speech_tokens.dtype == np.int64 and got.prompt_mel.dtype == np.float32


@pytest.mark.parametrize("kind", ["not audio", "silent", "too short"])
def test_bad_clips_give_the_same_typed_error_as_here(
    kind: str, worker: VoiceWorker, tiny_model: CosyVoice3Model, make_clip, tmp_path: Path
) -> None:
    clip = tmp_path / "bad.wav"
    if kind == "not audio":
        clip.write_bytes(b"this is not a WAV file" * 50)
    else:
        make_clip(clip, seconds=0.3 if kind == "too short" else 2.0)
        if kind == "silent":
            import soundfile as sf

            samples, rate = sf.read(clip)
            sf.write(clip, np.zeros_like(samples), rate)
    with pytest.raises(VoiceError) as here:
        VoiceFeatureExtractor(tiny_model, None).prepare(clip)
    with pytest.raises(VoiceError) as there:
        worker.compute(clip.read_bytes(), str(clip))
    # soundfile names the in-memory buffer by its address: the only difference allowed
    assert _no_address(str(there.value)) == _no_address(str(here.value))
    assert str(clip) in str(there.value)
    assert there.value.code == "invalid-voice"
    assert worker.pid is not None  # a bad clip does not end the child


def test_missing_encoder_file_is_typed(tiny_model_dir: Path, make_clip, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(tiny_model_dir / "speech_tokenizer_v3.onnx", model_dir)
    clip = make_clip(tmp_path / "a.wav", seconds=2.0)
    worker = VoiceWorker(WorkerConfig(model_dir))
    try:
        with pytest.raises(ModelFilesMissing) as info:
            worker.compute(clip.read_bytes(), str(clip))
    finally:
        worker.close()
    assert info.value.missing == ["campplus.onnx"] and info.value.model_dir == str(model_dir)
    assert info.value.code == "model-files-missing"


def test_a_job_over_its_time_bound_kills_the_child(
    tiny_model_dir: Path, make_clip, tmp_path: Path
) -> None:
    """The child's start alone (interpreter, numpy, onnxruntime) takes longer than 50 ms; the
    2.9 MB clip does not fit in the pipe's buffer, so the send itself waits for the child and is
    bounded too."""
    clip = make_clip(tmp_path / "a.wav", seconds=30.0, sample_rate_hz=48000)
    worker = VoiceWorker(WorkerConfig(tiny_model_dir), timeout_s=0.05)
    try:
        started = time.monotonic()
        with pytest.raises(SynthesisFailed, match="took more than"):
            worker.compute(clip.read_bytes(), str(clip))
        assert time.monotonic() - started < 10.0
        assert worker.pid is None
        worker.timeout_s = 120.0
        assert worker.compute(clip.read_bytes(), str(clip)).speech_tokens.shape[0] > 0
    finally:
        worker.close()


def _in_thread(worker: VoiceWorker, clip: Path) -> tuple[threading.Thread, list[object]]:
    """Run one job in a thread; its result or exception lands in the returned list."""
    outcome: list[object] = []

    def job() -> None:
        try:
            outcome.append(worker.compute(clip.read_bytes(), str(clip)))
        except Exception as err:  # recorded for the caller's assertions
            outcome.append(err)

    thread = threading.Thread(target=job)
    thread.start()
    return thread, outcome


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith(("Z", "X"))
    except (OSError, IndexError):
        return True


def test_a_child_that_dies_fails_its_job_and_is_replaced(
    worker: VoiceWorker, make_clip, tmp_path: Path
) -> None:
    """A child killed from outside (as the kernel's out-of-memory killer would): during a job
    (killed while it still imports, long before it could answer) the job fails typed; while
    idle the next job just starts a new child."""
    clip = make_clip(tmp_path / "a.wav", seconds=2.0)
    thread, outcome = _in_thread(worker, clip)
    assert _wait_until(lambda: worker.pid is not None)
    first = worker.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    thread.join(30)
    assert isinstance(outcome[0], SynthesisFailed), outcome
    assert re.search(r"ended while preparing .*exit code -9", str(outcome[0])), outcome
    worker.compute(clip.read_bytes(), str(clip))
    second = worker.pid
    assert second is not None and second != first
    os.kill(second, signal.SIGKILL)
    assert _wait_until(lambda: _dead(second))
    assert worker.compute(clip.read_bytes(), str(clip)).speech_tokens.shape[0] > 0
    assert worker.pid not in (None, first, second)


def test_close_during_a_job_fails_it_and_later_ones(
    tiny_model_dir: Path, make_clip, tmp_path: Path
) -> None:
    clip = make_clip(tmp_path / "a.wav", seconds=2.0)
    worker = VoiceWorker(WorkerConfig(tiny_model_dir))
    thread, outcome = _in_thread(worker, clip)
    assert _wait_until(lambda: worker.pid is not None)
    worker.close()
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome[0], SynthesisFailed), outcome
    assert "stopped: the engine is closing" in str(outcome[0])
    assert worker.pid is None
    with pytest.raises(SynthesisFailed, match="closed"):
        worker.compute(clip.read_bytes(), str(clip))


def test_idle_child_exits(tiny_model_dir: Path, make_clip, tmp_path: Path) -> None:
    clip = make_clip(tmp_path / "a.wav", seconds=2.0)
    worker = VoiceWorker(WorkerConfig(tiny_model_dir), idle_s=0.3)
    try:
        worker.compute(clip.read_bytes(), str(clip))
        assert _wait_until(lambda: worker.pid is None, limit_s=15.0)
        assert worker.compute(clip.read_bytes(), str(clip)).speech_tokens.shape[0] > 0
    finally:
        worker.close()


def test_engine_prepares_voices_without_loading_encoders_here(
    tiny_model_dir: Path, make_clip, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``voice_process`` the engine's process never loads campplus/speech_tokenizer; the
    disk cache still serves a prepared voice without any child."""
    clip = make_clip(tmp_path / "a.wav", seconds=3.0)
    cache = tmp_path / "voice-cache"
    options = EngineOptions(llm_precision="fp32", voice_process=True, voice_cache_dir=cache)
    _refuse_encoders_here(monkeypatch)
    # its own engines: voice preparation in a child process, and each closed here
    engine = CosyVoice3Engine.load(tiny_model_dir, options)
    try:
        prompt = engine.prepare_voice(clip, "Hello there.", name="a")
        worker = engine.voices.worker
        assert isinstance(worker, VoiceWorker) and worker.pid is not None
        engine.release_voice_encoders()
        assert worker.pid is None
        assert len(list(cache.glob("*.npz"))) == 1
    finally:
        engine.close()
    fresh = CosyVoice3Engine.load(tiny_model_dir, options)
    try:
        again = fresh.prepare_voice(clip, "Hello there.", name="a")
        assert isinstance(fresh.voices.worker, VoiceWorker) and fresh.voices.worker.pid is None
    finally:
        fresh.close()
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(again.features, field),
                                      getattr(prompt.features, field))


def test_server_process_never_loads_the_voice_encoders(
    tiny_model_dir: Path, tiny_engine_cache: Path, make_clip, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's loader prepares the catalog voices (the model's two and a user voice) in the
    voice encoder process, which has exited when the model is ready."""
    from wyoming_cosyvoice3.server.model_loader import ModelState
    from wyoming_cosyvoice3.server.runtime import ServerRuntime
    from wyoming_cosyvoice3.server.settings import Settings

    data_dir = link_engine_cache(tmp_path / "data", tiny_engine_cache)
    make_clip(data_dir / "clips" / "mine.wav", seconds=4.0)
    (data_dir / "voices.yaml").write_text(
        "voices:\n  - name: mine\n    languages: [en]\n    clip: clips/mine.wav\n"
        "    transcript: Good morning, how are you today?\n", encoding="utf-8")
    _refuse_encoders_here(monkeypatch)
    runtime = ServerRuntime(Settings(model_dir=tiny_model_dir, data_dirs=(data_dir,),
                                     warm_up=False))
    runtime.start_loading()
    try:
        assert runtime.loader.ready_event.wait(240)
        assert runtime.loader.state is ModelState.READY, runtime.loader.error
        assert {name: slot.installed for name, slot in runtime.voices.items()} == {
            "zh-female": True, "en-male": True, "mine": True}
        worker = getattr(runtime.loader.engine, "voices").worker  # noqa: B009
        assert isinstance(worker, VoiceWorker) and worker.pid is None
    finally:
        runtime.shutdown()
