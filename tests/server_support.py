"""Helpers for the server tests: a running server on an ephemeral port, Wyoming client
helpers, an instrumented wrapper around the real engine, and a fault-injecting engine."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import SynthesizeStopped

from wyoming_cosyvoice3.engine.errors import CosyVoiceError, SynthesisCancelled, SynthesisFailed
from wyoming_cosyvoice3.engine.options import (
    AudioChunk as EngineChunk,
)
from wyoming_cosyvoice3.engine.options import (
    EngineOptions,
    ShouldStop,
    SynthesisOptions,
    SynthesisResult,
    VoiceFeatures,
    VoicePrompt,
)
from wyoming_cosyvoice3.engine.text.pieces import MorePieces, PlannedPiece
from wyoming_cosyvoice3.server.cli import RunningServer
from wyoming_cosyvoice3.server.engine_port import Engine, EngineFactory, default_engine_factory
from wyoming_cosyvoice3.server.hooks import ServerHooks
from wyoming_cosyvoice3.server.runtime import ServerRuntime
from wyoming_cosyvoice3.server.settings import Settings

READ_TIMEOUT_S = 60.0
"""Upper bound for one event to arrive (a hang guard, not a speed assertion)."""


def make_settings(model_dir: Path, data_dir: Path, engine_cache: Path | None = None,
                  **changes: Any) -> Settings:
    """Settings of an in-process server on 127.0.0.1 with an ephemeral port.

    ``engine_cache``: a directory that ``<data_dir>/engine-cache`` links to, so the servers of
    a session on one unmodified model derive each graph (or record that it cannot be derived)
    once instead of once per data dir (conftest's ``tiny_engine_cache``). Tests about a first
    start, a damaged cache or loading itself leave it None.

    The LLM graph is ``published`` unless a test asks otherwise: the default ``fused`` would
    derive and validate the fused graph (a child process) once per fresh data dir
    (test_server_default_preset.py runs the real default; test_llm_fused.py the fused graph
    itself). The preset is ``balanced``
    unless a test asks otherwise: the default ``auto`` measures the machine at every start
    and its choice depends on the machine (test_server_auto_preset.py)."""
    values: dict[str, Any] = dict(uri="tcp://127.0.0.1:0", model_dir=model_dir,
                                  data_dirs=(data_dir,), warm_up=False, seed=1,
                                  llm_graph="published", preset="balanced")
    values.update(changes)
    if engine_cache is not None:
        link_engine_cache(data_dir, engine_cache)
    return Settings(**values)


def link_engine_cache(data_dir: Path, engine_cache: Path) -> Path:
    """``data_dir`` (created) whose ``engine-cache`` links to the shared ``engine_cache``
    (see :func:`make_settings`); for servers started as a program."""
    link = data_dir / "engine-cache"
    if not link.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        link.symlink_to(engine_cache, target_is_directory=True)
    return data_dir


@contextlib.asynccontextmanager
async def running_server(
    settings: Settings, engine_factory: EngineFactory = default_engine_factory,
    wait_ready: bool = True,
) -> AsyncIterator[RunningServer]:
    """Start a server in this event loop; stop it afterwards."""
    server = RunningServer(settings, engine_factory=engine_factory)
    await server.start()
    try:
        if wait_ready:
            ok = await asyncio.to_thread(server.runtime.loader.ready_event.wait, READ_TIMEOUT_S)
            assert ok, "the model did not load"
        yield server
    finally:
        await server.stop(grace_s=10.0)


def client(server: RunningServer) -> AsyncTcpClient:
    assert server.port is not None
    return AsyncTcpClient("127.0.0.1", server.port)


async def read(cl: AsyncTcpClient, timeout_s: float = READ_TIMEOUT_S) -> Event:
    event = await asyncio.wait_for(cl.read_event(), timeout_s)
    assert event is not None, "the server closed the connection"
    return event


async def audio_arrivals(cl: AsyncTcpClient, stop_type: str, t0: float | None = None,
                         max_events: int = 10000) -> list[tuple[float, float]]:
    """(arrival s after ``t0`` (default: now), duration s) of every ``audio-chunk`` read from
    ``cl`` until an event of ``stop_type``; 16-bit mono at the chunk's own rate."""
    start = time.monotonic() if t0 is None else t0
    arrivals: list[tuple[float, float]] = []
    for _ in range(max_events):
        event = await read(cl)
        if AudioChunk.is_type(event.type):
            chunk = AudioChunk.from_event(event)
            arrivals.append((time.monotonic() - start, len(chunk.audio) / 2 / chunk.rate))
        elif event.type == stop_type:
            return arrivals
    raise AssertionError(f"no {stop_type} within {max_events} events")


@dataclass
class Response:
    """Events of one response with arrival times (``time.monotonic()``)."""

    events: list[tuple[float, Event]] = field(default_factory=list)

    @property
    def types(self) -> list[str]:
        return [e.type for _, e in self.events]

    @property
    def chunks(self) -> list[AudioChunk]:
        return [AudioChunk.from_event(e) for _, e in self.events if AudioChunk.is_type(e.type)]

    @property
    def pcm(self) -> bytes:
        return b"".join(c.audio for c in self.chunks)

    @property
    def samples(self) -> np.ndarray:
        return np.frombuffer(self.pcm, dtype="<i2")

    @property
    def errors(self) -> list[Error]:
        return [Error.from_event(e) for _, e in self.events if Error.is_type(e.type)]

    def first_time(self, event_type: str) -> float:
        return next(t for t, e in self.events if e.type == event_type)


async def collect(cl: AsyncTcpClient, until: str, timeout_s: float = READ_TIMEOUT_S) -> Response:
    """Read events up to and including the first of type ``until`` (``audio-stop``,
    ``synthesize-stopped``, ``error``...)."""
    response = Response()
    for _ in range(100000):
        event = await read(cl, timeout_s)
        response.events.append((time.monotonic(), event))
        if event.type == until:
            return response
    raise AssertionError("too many events")


async def one_shot_error(cl: AsyncTcpClient, timeout_s: float = READ_TIMEOUT_S) -> Error:
    """Read the answer to a failed one-shot ``synthesize``: exactly ``error`` + ``audio-stop``
    (the audio-stop releases Home Assistant, which skips errors); return the error."""
    response = await collect(cl, "audio-stop", timeout_s)
    assert response.types == ["error", "audio-stop"], response.types
    return response.errors[0]


def check_audio_format(response: Response) -> None:
    """C13: one audio-start; every chunk 24000/2/1 with a payload multiple of 2; no WAV bytes."""
    starts = [AudioStart.from_event(e) for _, e in response.events if AudioStart.is_type(e.type)]
    assert len(starts) == 1, response.types
    assert (starts[0].rate, starts[0].width, starts[0].channels) == (24000, 2, 1)
    for chunk in response.chunks:
        assert (chunk.rate, chunk.width, chunk.channels) == (24000, 2, 1)
        assert len(chunk.audio) % 2 == 0 and len(chunk.audio) > 0
        assert not chunk.audio.startswith(b"RIFF")
    types = response.types
    assert types.index("audio-start") < types.index(AudioStop().event().type)
    if response.chunks:
        first_chunk = types.index("audio-chunk")
        last_chunk = len(types) - 1 - types[::-1].index("audio-chunk")
        assert types.index("audio-start") < first_chunk
        assert last_chunk < types.index("audio-stop")


async def describe(server: RunningServer, timeout_s: float = READ_TIMEOUT_S) -> Info:
    async with client(server) as cl:
        await cl.write_event(Describe().event())
        for _ in range(100):
            event = await read(cl, timeout_s)
            if Info.is_type(event.type):
                return Info.from_event(event)
    raise AssertionError("no info")


def ends_cleanly(response: Response, streaming: bool) -> bool:
    last = response.types[-1]
    return last == (SynthesizeStopped().event().type if streaming else "audio-stop")


# --- engine wrappers ------------------------------------------------------------------------


def whole_text_plan(text: str) -> list[PlannedPiece]:
    """A stand-in engine's plan: the whole text as one piece (words stand in for tokens)."""
    return [PlannedPiece(text, len(text.split()))]


def stand_in_pieces(text: str | Sequence[PlannedPiece],
                    sentence_end: str = r"(?<=[.!?。])\s*") -> list[str]:
    """The pieces a stand-in engine speaks: each sentence (cut where the regular expression
    ``sentence_end`` matches) of ``text``, or of each planned piece (a plan's piece
    boundaries stay piece boundaries, as in the real engine)."""
    texts = [text] if isinstance(text, str) else [piece.text for piece in text]
    return [sentence for part in texts for sentence in re.split(sentence_end, part)
            if re.search(r"\w", sentence)]


def spoken_text(text: str | Sequence[PlannedPiece]) -> str:
    """The text a stand-in engine speaks: ``text``, or a plan's pieces joined (the stand-ins
    plan a text as one piece, :func:`whole_text_plan`, so this is the request's text)."""
    return text if isinstance(text, str) else " ".join(piece.text for piece in text)


class SpyEngine:
    """Wraps a real engine: records every synthesize call and how it ended.

    ``hold_last`` (a threading.Event) makes each request wait before its last chunk until
    the event is set, so a test can act while the requests are known to be in progress.
    """

    def __init__(self, inner: Engine, hold_last: threading.Event | None = None) -> None:
        self.inner = inner
        self.hold_last = hold_last
        self.texts: list[str] = []
        self.voices: list[str] = []
        self.hints: list[str | None] = []
        """``SynthesisOptions.language_hint`` of each call."""
        self.outcomes: list[str] = []
        self.stop_flags: list[bool] = []
        """``should_stop()`` when each request ended (True: the server asked it to stop)."""
        self.started = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.warm_up_options: SynthesisOptions | None = None
        self.refuse: dict[str, Exception] = {}
        """Voice names whose ``prepare_voice`` raises the given error (after the clip passed
        every upload check: the engine refusing it)."""

    def prepare_voice(self, clip_path: Path, transcript: str | None = None,
                      instruction: str | None = None, name: str = "voice") -> VoicePrompt:
        if name in self.refuse:
            raise self.refuse[name]
        return self.inner.prepare_voice(clip_path, transcript, instruction, name)

    def release_voice_encoders(self) -> None:
        self.inner.release_voice_encoders()

    def close(self) -> None:
        self.inner.close()

    def warm_up(self, voice: VoicePrompt, options: SynthesisOptions | None = None) -> None:
        self.warm_up_options = options

    def text_token_count(self, text: str) -> int | None:
        return None  # no piece bound: requests reach the inner engine with their own options

    def plan_pieces(self, text: str, language_hint: str | None = None,
                    max_piece_tokens: int | None = None,
                    read_numbers: bool = True) -> list[PlannedPiece]:
        return whole_text_plan(text)

    def synthesize(self, text: str | Sequence[PlannedPiece], voice: VoicePrompt,
                   options: SynthesisOptions | None = None,
                   should_stop: ShouldStop | None = None,
                   result: SynthesisResult | None = None,
                   more: MorePieces | None = None) -> Iterator[EngineChunk]:
        text = spoken_text(text)  # the inner engine plans the raw text itself
        options = options or SynthesisOptions()
        with self.lock:
            self.texts.append(text)
            self.voices.append(voice.name)
            self.hints.append(options.language_hint)
            request = len(self.texts) - 1

        def inner_more() -> list[PlannedPiece]:  # the inner engine plans the text taken
            assert more is not None
            taken = spoken_text(more())
            if not taken:
                return []
            with self.lock:
                self.texts[request] += " " + taken
            return self.inner.plan_pieces(taken, options.language_hint,
                                          options.max_piece_tokens, options.read_numbers)

        self.started.release()
        outcome = "unfinished"
        try:
            chunks = self.inner.synthesize(text, voice, options, should_stop, result,
                                           None if more is None else inner_more)
            for chunk in chunks:
                if chunk.is_last and self.hold_last is not None:
                    for _ in range(600):  # bounded wait, 60 s
                        if self.hold_last.wait(0.1) or (should_stop and should_stop()):
                            break
                    if should_stop is not None and should_stop():
                        raise SynthesisCancelled("stopped while held")
                yield chunk
            outcome = "completed"
        except SynthesisCancelled:
            outcome = "cancelled"
            raise
        except GeneratorExit:
            outcome = "closed"
            raise
        finally:
            with self.lock:
                self.outcomes.append(outcome)
                self.stop_flags.append(bool(should_stop and should_stop()))


def spy_factory(holder: list[SpyEngine],
                hold_last: threading.Event | None = None) -> EngineFactory:
    def factory(model_dir: Path, options: EngineOptions) -> Engine:
        spy = SpyEngine(default_engine_factory(model_dir, options), hold_last)
        holder.append(spy)
        return spy

    return factory


STALL_S = 20.0
"""Length of the uninterruptible step of a ``STALL`` sentence (:class:`FaultyEngine`)."""


class FaultyEngine:
    """A fast stand-in engine for fault injection (no model needed beyond readable clips).

    Prepares voices like a model would (reads the clip). Each piece
    (:func:`stand_in_pieces`, cut at :attr:`sentence_end`) gives three chunks of 0.2 s
    (10 ms apart, ``should_stop`` checked before each); markers in a piece change that:

    * ``FAIL``: a coded ``SynthesisFailed`` after its first chunk;
    * ``CRASH``: a plain ``RuntimeError`` (a bug) after its first chunk;
    * ``HOLD``: waits for :attr:`gate` (bounded, 60 s) before its first chunk;
    * ``ENDLESS``: chunks until ``should_stop`` (bounded, 100000 chunks);
    * ``STALL``: after its first chunk, one step of :data:`STALL_S` seconds that does not
      look at ``should_stop`` (a long model step on a slow CPU).

    Records ``texts`` (with the text ``more`` handed over), ``plans``, ``outcomes`` and
    ``stop_flags`` like :class:`SpyEngine` unless ``record`` is False (for memory
    measurements).
    """

    sentence_end = r"(?<=[.!?。])\s*"
    follow_up = True
    """Ask ``more`` for the pieces that came meanwhile (at the first chunk of the last piece
    so far); False: never (each request speaks only what it was given)."""

    def __init__(self, model_dir: Path, options: EngineOptions, record: bool = True) -> None:
        self.model_dir = model_dir
        self.record = record
        self.gate = threading.Event()
        self.texts: list[str] = []
        self.plans: list[list[str]] = []
        """The pieces of each request (:func:`stand_in_pieces`)."""
        self.outcomes: list[str] = []
        self.stop_flags: list[bool] = []
        self.ended: list[float] = []
        """``time.monotonic()`` when each request's iterator ended."""
        self.started = threading.Semaphore(0)
        self.lock = threading.Lock()

    def prepare_voice(self, clip_path: Path, transcript: str | None = None,
                      instruction: str | None = None, name: str = "voice") -> VoicePrompt:
        info = sf.info(str(clip_path))
        frames = int(info.duration * 25)
        features = VoiceFeatures(
            speech_tokens=np.zeros(frames, dtype=np.int64),
            speaker_embedding=np.zeros(192, dtype=np.float32),
            prompt_mel=np.zeros((2 * frames, 80), dtype=np.float32),
        )
        return VoicePrompt(features, transcript, instruction, name)

    def release_voice_encoders(self) -> None:
        pass

    def close(self) -> None:
        pass

    def warm_up(self, voice: VoicePrompt, options: SynthesisOptions | None = None) -> None:
        """One short request, as the real engine's warm-up."""
        for _ in self.synthesize("Hello.", voice, options):
            pass

    def text_token_count(self, text: str) -> int | None:
        return None  # no piece bound

    def plan_pieces(self, text: str, language_hint: str | None = None,
                    max_piece_tokens: int | None = None,
                    read_numbers: bool = True) -> list[PlannedPiece]:
        return whole_text_plan(text)

    def synthesize(self, text: str | Sequence[PlannedPiece], voice: VoicePrompt,
                   options: SynthesisOptions | None = None,
                   should_stop: ShouldStop | None = None,
                   result: SynthesisResult | None = None,
                   more: MorePieces | None = None) -> Iterator[EngineChunk]:
        pieces = stand_in_pieces(text, self.sentence_end)
        if self.record:
            with self.lock:
                self.texts.append(spoken_text(text))
                self.plans.append(pieces)
                request = len(self.texts) - 1
        self.started.release()
        outcome = "unfinished"
        asked_at = 0  # pieces when ``more`` was last asked
        try:
            for chunk in self._chunks(pieces, should_stop or (lambda: False)):
                if (more is not None and self.follow_up and asked_at < len(pieces)
                        and chunk.piece_index == len(pieces) - 1):
                    # as the real engine with its LLM ahead: asked while the last piece plays
                    asked_at = len(pieces)
                    taken = more()
                    pieces.extend(stand_in_pieces(taken, self.sentence_end))
                    if self.record and taken:
                        with self.lock:
                            self.texts[request] += " " + spoken_text(taken)
                yield chunk
            outcome = "completed"
        except SynthesisCancelled:
            outcome = "cancelled"
            raise
        except GeneratorExit:
            outcome = "closed"
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            if self.record:
                with self.lock:
                    self.outcomes.append(outcome)
                    self.stop_flags.append(bool(should_stop and should_stop()))
                    self.ended.append(time.monotonic())

    def _chunks(self, pieces: list[str], should_stop: ShouldStop) -> Iterator[EngineChunk]:
        samples = (0.1 * np.sin(np.arange(4800) * 0.05)).astype(np.float32)
        for index, piece in enumerate(pieces):
            if "HOLD" in piece:
                for _ in range(600):
                    if self.gate.wait(0.1) or should_stop():
                        break
            count = 100000 if "ENDLESS" in piece else 3
            for k in range(count):
                if should_stop():
                    raise SynthesisCancelled("stopped")
                time.sleep(0.01)
                yield EngineChunk(samples, 24000, index, False, 0.0)
                if "FAIL" in piece and k == 0:
                    raise SynthesisFailed("injected failure in graph hift.onnx")
                if "CRASH" in piece and k == 0:
                    raise RuntimeError("injected bug")
                if "STALL" in piece and k == 0:
                    time.sleep(STALL_S)


def faulty_factory(model_dir: Path, options: EngineOptions) -> Engine:
    return FaultyEngine(model_dir, options)


def quiet_faulty_factory(model_dir: Path, options: EngineOptions) -> Engine:
    """A :class:`FaultyEngine` that keeps no record of its requests."""
    return FaultyEngine(model_dir, options, record=False)


def recording_faulty_factory(holder: list[FaultyEngine]) -> EngineFactory:
    """A :class:`FaultyEngine` factory that hands the instance to the test."""

    def factory(model_dir: Path, options: EngineOptions) -> Engine:
        engine = FaultyEngine(model_dir, options)
        holder.append(engine)
        return engine

    return factory


def fake_model_dir(root: Path, make_clip: Callable[..., Path]) -> Path:
    """A "model" directory for :class:`FaultyEngine`: just the two bundled voice clips."""
    model_dir = root / "model"
    make_clip(model_dir / "voices" / "zh-female.wav", seconds=2.0)
    make_clip(model_dir / "voices" / "en-male.wav", seconds=2.0)
    return model_dir


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` (bounded); True once it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def loaded_engine_options(settings: Settings, model_dir: Path,
                          hooks: ServerHooks | None = None) -> list[EngineOptions]:
    """The engine options a runtime of ``settings`` hands its engine factory when it loads
    (the factory records them and stops the load)."""
    loaded: list[EngineOptions] = []

    def factory(model_dir: Path, options: EngineOptions) -> Engine:
        loaded.append(options)
        raise CosyVoiceError("stop after the options were given")

    runtime = ServerRuntime(settings, hooks=hooks, engine_factory=factory,
                            model_locator=lambda settings, stopping: model_dir)
    try:
        runtime.start_loading()
        assert runtime.loader.ready_event.wait(30)
    finally:
        runtime.shutdown()
    return loaded


class FakeClock:
    """A monotonic clock the test moves by hand (``now_s``), for the piece gate's timing."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s
