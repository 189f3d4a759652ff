"""``EngineOptions.split_cores`` on the tiny synthetic model: the LLM decodes in a per-request
thread while the calling thread runs the flow and the vocoder. The audio equals the engine
without it; cancellation, timeouts, graph failures and an early close end the thread; every
session keeps its threads and none spins."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from decoding_support import FixedDecoding
from packaging.version import Version

from synthetic.audio import write_clip
from wyoming_cosyvoice3.engine import (
    AudioChunk,
    CosyVoice3Engine,
    EngineOptions,
    SynthesisCancelled,
    SynthesisOptions,
    SynthesisResult,
    SynthesisTimeout,
    TextError,
    VoicePrompt,
)
from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine import sessions as sessions_module
from wyoming_cosyvoice3.engine.errors import SynthesisFailed
from wyoming_cosyvoice3.engine.llm.tokens import DecodeProgress
from wyoming_cosyvoice3.engine.text.pieces import PlannedPiece

TEXT = ("The kitchen lights are on. The front door is locked for the night, and the garden "
        "sprinklers run until morning.")
THREAD = "cosyvoice3-llm"


@pytest.fixture(scope="module")
def engines(tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path) -> dict[bool, CosyVoice3Engine]:
    """An engine without ``split_cores`` and one with it, both at 1 thread per session
    (onnxruntime's rounding depends on the thread count), with every derived graph a preset
    runs (fused LLM with its in-place KV cache, streaming DiT, streamed vocoder)."""
    return {split: CosyVoice3Engine.load(tiny_dit_model_dir, EngineOptions(
        cache_dir=tiny_dit_cache_dir, llm_graph="fused", threads=1,
        split_cores=split, observer=FixedDecoding(0.8))) for split in (False, True)}


@pytest.fixture(scope="module")
def voice(engines: dict[bool, CosyVoice3Engine],
          tmp_path_factory: pytest.TempPathFactory) -> VoicePrompt:
    clip = write_clip(tmp_path_factory.mktemp("clip") / "ref.wav", seconds=3.0)
    return engines[False].prepare_voice(clip, transcript="This is a reference clip.",
                                        name="split")


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def options(**changes: Any) -> SynthesisOptions:
    # the vocoder's deferral follows the wall clock, which differs between any two runs
    # (threaded or not) and moves samples by float rounding where it cuts the mel: off here
    return SynthesisOptions(seed=3, max_piece_tokens=12, **changes).replace(
        flow={"first_hop_tokens": 5}, vocoder={"defer": False})


def decoding_threads(engine: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the thread that decodes each piece: the one that prefills its prompt (wraps
    ``prefill_prompt``, never replaces it)."""
    names: list[str] = []
    prefill = engine.llm.prefill_prompt

    def recording(*args: Any, **kwargs: Any) -> Any:
        names.append(threading.current_thread().name)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(engine.llm, "prefill_prompt", recording)
    return names


# -- same audio -------------------------------------------------------------------------------


@pytest.mark.parametrize(("streaming", "speed"), [(True, 1.0), (True, 1.3), (False, 1.0)])
def test_split_cores_gives_the_same_chunks(
    engines: dict[bool, CosyVoice3Engine], voice: VoicePrompt,
    monkeypatch: pytest.MonkeyPatch, streaming: bool, speed: float,
) -> None:
    runs: dict[bool, tuple[list[AudioChunk], SynthesisResult]] = {}
    threads: dict[bool, list[str]] = {}
    for split, engine in engines.items():
        threads[split] = decoding_threads(engine, monkeypatch)
        result = SynthesisResult()
        chunks = list(engine.synthesize(TEXT, voice, options(streaming=streaming, speed=speed),
                                        result=result))
        runs[split] = (chunks, result)
    (plain, plain_result), (split_chunks, split_result) = runs[False], runs[True]
    # several pieces; streamed, several chunks each (one-shot: one each)
    assert plain_result.pieces >= 2
    if streaming:
        assert len(plain) >= 2 * plain_result.pieces
    else:
        assert len(plain) == plain_result.pieces
    assert [len(c.samples) for c in split_chunks] == [len(c.samples) for c in plain]
    for a, b in zip(plain, split_chunks, strict=True):
        np.testing.assert_array_equal(a.samples, b.samples)
        assert (a.piece_index, a.is_last, a.piece_done, a.next_chunk_s) == (
            b.piece_index, b.is_last, b.piece_done, b.next_chunk_s)
    assert split_result.times.llm_tokens == plain_result.times.llm_tokens > 0
    # the split engine decoded every piece in its thread, the plain one in the caller's
    caller = threading.current_thread().name
    assert threads[True] == [THREAD] * plain_result.pieces
    assert threads[False] == [caller] * plain_result.pieces
    assert not producer_threads()


@pytest.mark.parametrize("split", [False, True])
def test_pieces_asked_for_while_decoding_give_the_audio_of_one_plan(
    engines: dict[bool, CosyVoice3Engine], voice: VoicePrompt,
    monkeypatch: pytest.MonkeyPatch, split: bool,
) -> None:
    # a request given the first piece of a plan, asking for the others one by one through
    # ``more``, speaks the audio of the request given the whole plan: the pieces reach the
    # decoding loop, the seeded streams go on, and only the true last chunk is the last
    engine = engines[split]
    plan = engine.plan_pieces(TEXT, None, 12, True)
    assert len(plan) >= 3
    whole = list(engine.synthesize(plan, voice, options()))
    threads = decoding_threads(engine, monkeypatch)
    later = [[piece] for piece in plan[1:]]
    asked: list[tuple[str, int]] = []  # (thread, pieces decoded) at each call

    def more() -> list[PlannedPiece]:
        asked.append((threading.current_thread().name, len(threads)))
        return later.pop(0) if later else []

    result = SynthesisResult()
    fed = list(engine.synthesize(plan[:1], voice, options(), result=result, more=more))
    decoder = THREAD if split else threading.current_thread().name
    # asked once after each piece was decoded, in the thread that decodes
    assert asked == [(decoder, n) for n in range(1, len(plan) + 1)]
    assert result.pieces == len(plan)
    assert [len(c.samples) for c in fed] == [len(c.samples) for c in whole]
    for a, b in zip(whole, fed, strict=True):
        np.testing.assert_array_equal(a.samples, b.samples)
        assert (a.piece_index, a.is_last, a.piece_done, a.next_chunk_s) == (
            b.piece_index, b.is_last, b.piece_done, b.next_chunk_s)
    assert sum(c.is_last for c in fed) == 1 and fed[-1].is_last
    assert not producer_threads()


def test_more_must_return_planned_pieces(engines: dict[bool, CosyVoice3Engine],
                                         voice: VoicePrompt) -> None:
    plan = engines[True].plan_pieces(TEXT, None, 12, True)
    with pytest.raises(TextError):
        list(engines[True].synthesize(plan[:1], voice, options(),
                                      more=lambda: ["not planned"]))  # type: ignore[list-item,return-value]
    assert not producer_threads()


# -- the thread always ends -------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
def test_cancelled_request_raises_and_leaves_no_thread(
    engines: dict[bool, CosyVoice3Engine], voice: VoicePrompt, split: bool
) -> None:
    chunks = 0

    def should_stop() -> bool:
        return chunks >= 1

    with pytest.raises(SynthesisCancelled):
        for _ in engines[split].synthesize(TEXT, voice, options(), should_stop=should_stop):
            chunks += 1
    assert chunks == 1
    assert not producer_threads()


@pytest.mark.parametrize("split", [False, True])
def test_request_timeout_raises_and_leaves_no_thread(
    engines: dict[bool, CosyVoice3Engine], voice: VoicePrompt, split: bool
) -> None:
    with pytest.raises(SynthesisTimeout):
        list(engines[split].synthesize(TEXT, voice, options(max_request_s=1e-6)))
    assert not producer_threads()


@pytest.mark.parametrize("split", [False, True])
def test_llm_graph_failure_raises_and_leaves_no_thread(
    engines: dict[bool, CosyVoice3Engine], voice: VoicePrompt,
    monkeypatch: pytest.MonkeyPatch, split: bool,
) -> None:
    graph = engines[split].model.llm
    calls = {"n": 0}

    def failing(real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > 20:  # after the first chunks: the flow is busy meanwhile
                raise SynthesisFailed("injected graph failure")
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(graph, "run", failing(graph.run))
    monkeypatch.setattr(graph, "run_bound", failing(graph.run_bound))
    chunks = 0
    with pytest.raises(SynthesisFailed, match="injected graph failure"):
        for _ in engines[split].synthesize(TEXT, voice, options()):
            chunks += 1
    assert chunks >= 1 and calls["n"] == 21
    assert not producer_threads()


@pytest.mark.parametrize("split", [False, True])
def test_closing_the_generator_early_leaves_no_thread(
    engines: dict[bool, CosyVoice3Engine], voice: VoicePrompt,
    monkeypatch: pytest.MonkeyPatch, split: bool,
) -> None:
    step = engines[split].llm.step

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.01)  # the thread is still decoding when the first chunk is out
        return step(*args, **kwargs)

    monkeypatch.setattr(engines[split].llm, "step", slow_step)
    stream = engines[split].synthesize(TEXT, voice, options())
    next(stream)
    if split:
        assert producer_threads()  # still decoding the rest of the request
    stream.close()  # type: ignore[attr-defined]
    assert not producer_threads()


# -- the sessions' threads --------------------------------------------------------------------


def _idle_wait(opened: ort.SessionOptions) -> str:
    """How idle worker threads of a session opened with ``opened`` wait: "spin" (onnxruntime's
    default), "brief" (10 us between a run's operators, none after the run) or "sleep"."""
    def entry(key: str) -> str | None:
        try:
            return str(opened.get_session_config_entry(key))
        except Exception:  # not set: onnxruntime's default
            return None

    if entry("session.intra_op.allow_spinning") == "0":
        return "sleep"
    if (entry("session.intra_op.spin_duration_us"), entry("session.force_spinning_stop")) == (
            "10", "1"):
        return "brief"
    return "spin"


# onnxruntime names session.intra_op.spin_duration_us from 1.26.0 on (its library's strings)
SPLIT_WAIT = "brief" if Version(ort.__version__) >= Version("1.26.0") else "sleep"


def _spins(session: ort.InferenceSession) -> bool:
    """Whether the session's idle threads spin past the end of a run."""
    return _idle_wait(session.get_session_options()) == "spin"


def sessions(engine: CosyVoice3Engine) -> dict[str, dict[str, ort.InferenceSession]]:
    """The synthesis sessions by role: the LLM's and the flow's and vocoder's."""
    model = engine.model
    streaming = model.streaming_estimator(model.options.flow.precision)
    assert model.hift_stream is not None and streaming is not None
    llm = {"llm": model.llm.session, "speech_embedding": model.speech_embedding.session}
    if model.llm_prefill is not None:
        llm["llm_prefill"] = model.llm_prefill.session
    if hasattr(model.text_embedding, "session"):
        llm["text_embedding"] = model.text_embedding.session
    stages = {"flow_encoder": model.flow_encoder.session,
              "streaming_dit": streaming.main.session,
              "vocoder": model.hift_stream.graph.session}
    return {"llm": llm, "stages": stages}


def test_split_sessions_keep_their_threads_and_do_not_spin(
    engines: dict[bool, CosyVoice3Engine],
) -> None:
    # both engines were loaded with 1 thread: each session of the split one keeps it
    for role, by_name in sessions(engines[True]).items():
        for name, session in by_name.items():
            opened = session.get_session_options()
            assert (role, name, opened.intra_op_num_threads) == (role, name, 1)
            assert (role, name, _idle_wait(opened)) == (role, name, SPLIT_WAIT)
    # a DiT loaded on first use (the other precision) opens the same way
    model = engines[True].model
    other = "int8" if model.options.flow.precision == "fp32" else "fp32"
    late = model.streaming_estimator(other)
    assert late is not None
    assert late.main.session.get_session_options().intra_op_num_threads == 1
    assert _idle_wait(late.main.session.get_session_options()) == SPLIT_WAIT
    for by_name in sessions(engines[False]).values():
        for name, session in by_name.items():
            assert (name, session.get_session_options().intra_op_num_threads) == (name, 1)
            assert _spins(session), name


@pytest.mark.parametrize(("version", "supported"), [
    ("1.18.0", False), ("1.25.1", False), ("1.26.0", True), ("1.32.0", True), ("2.0.1", True),
])
def test_brief_spinning_needs_onnxruntime_1_26(version: str, supported: bool) -> None:
    assert sessions_module.brief_spin_supported(version) is supported


def test_sessions_that_do_not_spin_wait_spin_briefly_or_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # spinning within a run keeps a run's operators from waking a sleeping worker each time;
    # none after the run leaves the core to the other kind of work
    monkeypatch.setattr(sessions_module, "brief_spin_supported", lambda: True)
    assert _idle_wait(sessions_module.session_options(2, spin_wait=False)) == "brief"
    assert _idle_wait(sessions_module.session_options(2, spin_wait=True)) == "spin"
    # an onnxruntime without the bound would ignore it and spin for as long as it likes
    monkeypatch.setattr(sessions_module, "brief_spin_supported", lambda: False)
    assert _idle_wait(sessions_module.session_options(2, spin_wait=False)) == "sleep"
    assert _idle_wait(sessions_module.session_options(2, spin_wait=True)) == "spin"


@pytest.mark.parametrize(("threads", "cpus", "expected"), [
    (0, 1, 1), (0, 2, 2), (0, 3, 3), (0, 0, 1), (2, 8, 2), (5, 1, 5),
])
def test_for_sessions_keeps_the_threads_and_stops_spinning(threads: int, cpus: int,
                                                            expected: int) -> None:
    # both kinds of work get every thread: the operating system shares the cores between the
    # decoding thread and the flow (BENCHMARKS.md: faster than a half each on two cores)
    split = EngineOptions(threads=threads, split_cores=True)
    assert split.for_sessions(cpus) == EngineOptions(
        threads=expected, spin_wait=False, split_cores=True)
    plain = EngineOptions(threads=threads)
    assert plain.for_sessions(cpus) is plain


# -- the server's flag ------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "environ", "options_file", "cpus", "expected"), [
    ([], {}, None, 2, True),
    ([], {}, None, 4, True),
    ([], {}, None, 1, False),  # one CPU: the two kinds of work would only take turns
    (["--no-split-cores"], {}, None, 2, False),
    ([], {"COSYVOICE3_NO_SPLIT_CORES": "true"}, None, 2, False),
    ([], {}, {"split_cores": False}, 2, False),
    ([], {}, {"split_cores": True}, 2, True),
])
def test_the_server_splits_the_cores_unless_told_or_alone_on_one_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str],
        environ: dict[str, str], options_file: dict[str, bool] | None, cpus: int,
        expected: bool) -> None:
    from server_support import loaded_engine_options

    from wyoming_cosyvoice3.server import model_loader
    from wyoming_cosyvoice3.server.settings import resolve_settings

    monkeypatch.setattr(model_loader, "available_cpus", lambda: cpus)
    if options_file is not None:
        path = tmp_path / "options.json"
        path.write_text(json.dumps(options_file), encoding="utf-8")
        argv = [*argv, "--options-file", str(path)]
    # explicit preset and LLM graph: the loader measures nothing
    settings = resolve_settings(["--model-dir", str(tmp_path), "--preset", "balanced",
                                 "--llm-graph", "fused", *argv], environ=environ)
    (loaded,) = loaded_engine_options(settings, tmp_path)
    assert loaded.split_cores is expected


@pytest.mark.parametrize("cpus", [1, 2])
def test_the_piece_gate_measures_as_the_engine_decodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int) -> None:
    # decoding beside the flow, tokens decoded ahead make chunk-to-chunk rates too fast: the
    # gate of every response then measures over the engine's work (test_server_pauses.py)
    from types import SimpleNamespace

    from wyoming_cosyvoice3.server import model_loader
    from wyoming_cosyvoice3.server.runtime import ServerRuntime
    from wyoming_cosyvoice3.server.settings import resolve_settings
    from wyoming_cosyvoice3.server.speech import piece_gate

    monkeypatch.setattr(model_loader, "available_cpus", lambda: cpus)
    settings = resolve_settings(["--model-dir", str(tmp_path), "--preset", "balanced"],
                                environ={})
    runtime = ServerRuntime(settings)
    try:
        gate = piece_gate(runtime, SimpleNamespace(send=None))  # type: ignore[arg-type]
        assert runtime.loader.split_cores is (cpus >= 2)
        assert gate.decoding_ahead is (cpus >= 2)
    finally:
        runtime.shutdown()


# -- how far the decoding is ahead -------------------------------------------------------------


@pytest.mark.parametrize("speed", [1.0, 0.75, 1.3, 1.5])  # C14's speeds among them
def test_chunks_tell_a_decoded_pieces_audio_still_to_come(
    engines: dict[bool, CosyVoice3Engine], voice: VoicePrompt,
    monkeypatch: pytest.MonkeyPatch, speed: float,
) -> None:
    # the consumer waits after the first chunk until the decoding thread has finished, so
    # every later chunk comes from pieces decoded to their end: each tells the audio its piece
    # still has to come, which the piece's later chunks then bring
    made: list[DecodeProgress] = []

    class Recorded(DecodeProgress):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr("wyoming_cosyvoice3.engine.pipeline.DecodeProgress", Recorded)
    chunks: list[AudioChunk] = []
    for chunk in engines[True].synthesize(TEXT, voice, options(speed=speed)):
        if not chunks:
            waited = 0.0
            while not made[0].finished and waited < 60.0:
                time.sleep(0.01)
                waited += 0.01
            assert made[0].finished
        chunks.append(chunk)
    assert len({c.piece_index for c in chunks}) >= 2
    assert all(c.decoding_done for c in chunks[1:])
    frame_s = 1.0 / C.MEL_RATE_HZ  # one mel frame of output audio
    told = 0
    for k, chunk in enumerate(chunks[1:], start=1):
        later = sum(len(c.samples) for c in chunks[k + 1:] if c.piece_index == chunk.piece_index)
        assert chunk.piece_left_s is not None
        if chunk.piece_done:
            assert chunk.piece_left_s == 0.0 and later == 0
            continue
        told += 1
        # the tokens' audio at 25 per second: the samples to come, exactly at speed 1; the
        # speed resampler makes whole mel frames of 20 ms out of F / speed, so at most one
        # frame less comes (the estimate errs long, never short)
        error_s = chunk.piece_left_s - later / C.OUTPUT_SAMPLE_RATE_HZ
        longest_s = 1e-9 if speed == 1.0 else frame_s
        assert -1e-9 <= error_s <= longest_s
        # and its decoded tokens are all of them: the piece's whole audio, within the same
        whole = sum(len(c.samples) for c in chunks if c.piece_index == chunk.piece_index)
        assert -1e-9 <= chunk.piece_decoded_s - whole / C.OUTPUT_SAMPLE_RATE_HZ <= longest_s
    assert told >= 2
    # without the thread a piece is decoded to its end only at its last chunk, and before
    # that a chunk's tokens and the flow's lookahead are decoded when it is made
    plain = list(engines[False].synthesize(TEXT, voice, options(speed=speed)))
    assert [c.piece_left_s for c in plain if not c.piece_done] == [None] * sum(
        not c.piece_done for c in plain)
    for k, chunk in enumerate(plain):
        so_far = sum(len(c.samples) for c in plain[:k + 1] if c.piece_index == chunk.piece_index)
        if chunk.piece_done:
            assert chunk.piece_decoded_s == 0.0
        else:
            assert chunk.piece_decoded_s > so_far / C.OUTPUT_SAMPLE_RATE_HZ
