"""The voice encoder process: voice features computed in a child process.

Preparing a new voice loads campplus.onnx and speech_tokenizer_v3.onnx (0.97 GB of fp32
weights in the published model), runs them on both cores and drops them again. In the server's
process this competed with the asyncio loop that answers ``describe`` (1.1 s once, at the end
of a full-size voice preparation on a loaded 2-core machine). Session creation and runs
release the interpreter lock (GIL); the longest holds are dropping the sessions and the fbank
(tens of milliseconds), so the stall is CPU and memory pressure more than the GIL. In a child
process none of it shares the server's interpreter or heap, the child runs at a lower CPU
priority (:data:`NICE_INCREMENT`), and the encoders' memory goes back to the system when it
exits.

The child is ``python -c <bootstrap> PACKAGE_ROOT`` running :func:`main`. Its stdin and stdout
carry :class:`multiprocessing.connection.Connection` frames (pickled objects between this
program and its own child): first a :class:`WorkerConfig`, then jobs ``(clip_bytes,
clip_name)``, each answered by ``("ok", VoiceFeatures)`` or ``("error", CosyVoiceError)``;
``None`` or the end of stdin ends it. Its stderr is the server's (warnings reach the log).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .. import constants as C
from ..errors import CosyVoiceError, SynthesisFailed
from ..options import EngineOptions, VoiceFeatures
from .encoders import read_only

_LOGGER = logging.getLogger(__name__)

JOB_TIMEOUT_S = 900.0
"""Longest a voice preparation may take in the child, its start included (the full-size
encoders took 54-69 s per clip on a loaded 2-core x86 machine): then the child is killed and
the preparation fails with ``SynthesisFailed``."""
IDLE_S = 10.0
"""The child (with its loaded encoders) exits this long after its last job: voices prepared
one after another (the catalog at start) share one child and one encoder load."""
STOP_WAIT_S = 5.0
"""How long a child asked to exit may take before it is killed."""
NICE_INCREMENT = 5
"""The child runs at this much lower CPU priority (``nice``): a synthesis or a ``describe``
in the server's process gets the cores first when both want them (``man 2 nice``)."""
POLL_S = 1.0
"""Slice of the wait for an answer (the total is bounded by :data:`JOB_TIMEOUT_S`)."""

_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from wyoming_cosyvoice3.engine.voice.worker import main; sys.exit(main())"
)
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
"""The directory holding the ``wyoming_cosyvoice3`` package this module was imported from."""


@dataclass(frozen=True)
class WorkerConfig:
    """What the child needs to load the voice encoders.

    Attributes:
        model_dir: the model directory (campplus.onnx, speech_tokenizer_v3.onnx).
        threads: intra-op threads per session (0: onnxruntime's choice).
        providers: onnxruntime execution providers, in order of preference.
        speaker_dim: expected width of the speaker embedding (flow_encoder's input).
    """

    model_dir: Path
    threads: int = 0
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    speaker_dim: int = C.SPEAKER_EMBEDDING_DIM


def worker_for(model_dir: Path, options: EngineOptions, speaker_dim: int) -> VoiceWorker | None:
    """The voice encoder process of an engine with ``options`` (None unless
    ``options.voice_process``); with ``load_voice_encoders`` it does not exit when idle."""
    if not options.voice_process:
        return None
    config = WorkerConfig(Path(model_dir), options.threads, options.providers, speaker_dim)
    return VoiceWorker(config, idle_s=None if options.load_voice_encoders else IDLE_S)


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    send: Connection
    receive: Connection


class VoiceWorker:
    """Computes voice features in a child process (:func:`main`), one clip at a time.

    Thread-safe. The child starts with the first job and exits ``idle_s`` after the last one,
    on :meth:`release` or :meth:`close`; a job that exceeds ``timeout_s`` or a child that
    dies fails with a ``SynthesisFailed`` and the next job starts a new child.

    Args:
        config: model directory and session settings for the child.
        timeout_s: bound of one job, the child's start included.
        idle_s: idle time after which the child exits; ``None`` keeps it until
            :meth:`release` or :meth:`close`.
    """

    def __init__(
        self, config: WorkerConfig, timeout_s: float = JOB_TIMEOUT_S, idle_s: float | None = IDLE_S
    ) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self._job_lock = threading.Lock()
        self._child: _Child | None = None
        self._closed = False
        self._timer: threading.Timer | None = None
        self._last_job_end = 0.0

    @property
    def pid(self) -> int | None:
        """Process id of the running child (None when none runs)."""
        child = self._child
        return None if child is None or child.process.poll() is not None else child.process.pid

    def compute(self, clip_bytes: bytes, clip_name: str) -> VoiceFeatures:
        """Features of an encoded clip (see :func:`.encoders.features_from_audio`).

        Raises:
            VoiceError: the clip is unusable (raised in the child, same message).
            SynthesisFailed: an encoder failed or returned bad values, the child died or took
                longer than ``timeout_s`` (then it is killed), or the worker is closed.
            ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: the encoder files.
        """
        with self._job_lock:
            self._cancel_timer()
            try:
                kind, value = self._run_job(clip_bytes, clip_name)
            finally:
                self._last_job_end = time.monotonic()
                self._arm_timer()
        if kind == "ok" and isinstance(value, VoiceFeatures):
            return VoiceFeatures(
                speech_tokens=read_only(value.speech_tokens),
                speaker_embedding=read_only(value.speaker_embedding),
                prompt_mel=read_only(value.prompt_mel),
            )
        if kind == "error" and isinstance(value, CosyVoiceError):
            raise value
        raise SynthesisFailed(f"the voice encoder process answered {kind!r} for {clip_name}")

    def release(self) -> None:
        """Let the child exit once its current job (if any) is done; a later job starts a new
        one."""
        with self._job_lock:
            self._cancel_timer()
            self._stop_child()

    def close(self) -> None:
        """Kill the child now (a job in flight fails with ``SynthesisFailed``); later jobs
        fail too. Does not wait for the job's thread."""
        self._closed = True
        self._cancel_timer()
        child = self._child
        if child is not None and child.process.poll() is None:
            child.process.kill()
        if self._job_lock.acquire(blocking=False):
            try:
                self._stop_child()
            finally:
                self._job_lock.release()

    # --- parent side ----------------------------------------------------------------------

    def _run_job(self, clip_bytes: bytes, clip_name: str) -> tuple[str, Any]:
        if self._closed:
            raise SynthesisFailed("the engine is closed: no voice can be prepared")
        deadline = time.monotonic() + self.timeout_s
        reused = self._child is not None
        child = self._running_child()
        job = (clip_bytes, clip_name)
        try:
            self._send_within(child, job, deadline, clip_name)
        except OSError as err:
            if not reused or self._closed:
                raise self._ended(clip_name, err) from err
            # an idle child that died (its exit not visible yet): the job never reached it
            self._stop_child()
            child = self._running_child()
            try:
                self._send_within(child, job, deadline, clip_name)
            except OSError as again:
                raise self._ended(clip_name, again) from again
        while not child.receive.poll(max(0.0, min(POLL_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise self._too_slow(child, clip_name)
        try:
            reply: tuple[str, Any] = child.receive.recv()
        except Exception as err:  # EOF, broken pipe, an answer that cannot be unpickled
            raise self._ended(clip_name, err) from err
        return reply

    def _send_within(self, child: _Child, message: object, deadline: float, clip_name: str) -> None:
        """Send ``message`` (a clip may exceed the pipe's buffer: the child must read it) by
        ``deadline``, else kill the child.

        Raises:
            OSError: the child's end is closed.
            SynthesisFailed: the deadline passed (a child stuck before reading its jobs).
        """
        failed: list[OSError] = []

        def send() -> None:
            try:
                child.send.send(message)
            except OSError as err:
                failed.append(err)

        sender = threading.Thread(target=send, name="cosyvoice3-voice-send", daemon=True)
        sender.start()
        sender.join(max(0.0, deadline - time.monotonic()))
        if sender.is_alive():
            child.process.kill()  # its write then fails at once; only then close the pipe
            sender.join(STOP_WAIT_S)
            raise self._too_slow(child, clip_name)
        if failed:
            raise failed[0]

    def _too_slow(self, child: _Child, clip_name: str) -> SynthesisFailed:
        """Kill the child of a job past its deadline; the job's error."""
        child.process.kill()
        self._stop_child()
        return SynthesisFailed(
            f"preparing {clip_name} took more than {self.timeout_s:.0f} s in the voice "
            "encoder process, which was stopped; try a shorter clip or fewer threads"
        )

    def _ended(self, clip_name: str, err: Exception) -> SynthesisFailed:
        """The error of a job whose child went away (reaped here)."""
        code = self._stop_child()
        if self._closed:
            return SynthesisFailed(
                f"preparing {clip_name} was stopped: the engine is closing (server shutdown)"
            )
        return SynthesisFailed(
            f"the voice encoder process ended while preparing {clip_name} (exit code {code}; "
            f"out of memory? see the log above): {type(err).__name__}: {err}"
        )

    def _running_child(self) -> _Child:
        child = self._child
        if child is not None and child.process.poll() is None:
            return child
        self._stop_child()
        try:
            process = subprocess.Popen(  # argv: this interpreter, a fixed bootstrap, a path
                [sys.executable, "-c", _BOOTSTRAP, str(_PACKAGE_ROOT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        except OSError as err:
            raise SynthesisFailed(f"cannot start the voice encoder process: {err}") from err
        assert process.stdin is not None and process.stdout is not None
        send = Connection(os.dup(process.stdin.fileno()), readable=False)
        receive = Connection(os.dup(process.stdout.fileno()), writable=False)
        process.stdin.close()
        process.stdout.close()
        child = self._child = _Child(process, send, receive)
        _LOGGER.debug("voice encoder process %d started", process.pid)
        if self._closed:  # closed while starting: close() may not have seen this child
            self._stop_child()
            raise SynthesisFailed("the engine is closed: no voice can be prepared")
        # the config fits in the pipe's buffer: this never waits for the child
        with contextlib.suppress(OSError):  # it died at once: the job's send reports it
            send.send(self.config)
        return child

    def _stop_child(self) -> int | None:
        """Ask the child to exit (kill it after :data:`STOP_WAIT_S`); its exit code."""
        child, self._child = self._child, None
        if child is None:
            return None
        if child.process.poll() is None:
            with contextlib.suppress(OSError):
                child.send.send(None)
        try:
            code = child.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            child.process.kill()
            code = child.process.wait(STOP_WAIT_S)
        child.send.close()
        child.receive.close()
        _LOGGER.debug("voice encoder process %d exited with %s", child.process.pid, code)
        return code

    def _arm_timer(self) -> None:
        if self.idle_s is None or self._closed:
            return
        timer = threading.Timer(self.idle_s, self._on_idle)
        timer.daemon = True
        timer.name = "cosyvoice3-voice-idle"
        self._timer = timer
        timer.start()

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _on_idle(self) -> None:
        if not self._job_lock.acquire(blocking=False):
            return  # a job runs: it arms a new timer when it ends
        try:
            idle_s = self.idle_s or 0.0
            if time.monotonic() - self._last_job_end >= idle_s * 0.99:
                self._stop_child()
        finally:
            self._job_lock.release()


# --- child side -----------------------------------------------------------------------------


def _portable(err: CosyVoiceError) -> CosyVoiceError:
    """``err`` if it survives pickling, else a ``SynthesisFailed`` with its message."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return SynthesisFailed(f"{type(err).__name__}: {err}")
    return err


def _answer(job: tuple[bytes, str], encoders: list[Any], config: WorkerConfig) -> tuple[str, Any]:
    from ..sessions import CAMPPLUS, SPEECH_TOKENIZER, Graph
    from .audio_io import decode_clip
    from .encoders import features_from_audio, run_voice_encoders

    clip_bytes, clip_name = job
    try:
        samples, rate_hz = decode_clip(clip_bytes, clip_name)
        if not encoders:  # loaded with the first clip, kept while the child lives
            for spec in (CAMPPLUS, SPEECH_TOKENIZER):
                path = config.model_dir / spec.file
                encoders.append(Graph(path, spec, config.threads, config.providers))

        def run(log_mel: Any, fbank: Any) -> Any:
            return run_voice_encoders(encoders[0], encoders[1], log_mel, fbank, config.speaker_dim)

        return "ok", features_from_audio(samples, rate_hz, run, clip_name)
    except CosyVoiceError as err:
        return "error", _portable(err)
    except Exception as err:  # a bug or MemoryError: the parent gets a typed error
        _LOGGER.exception("Preparing %s failed in the voice encoder process", clip_name)
        return "error", SynthesisFailed(
            f"preparing {clip_name} failed in the voice encoder process: "
            f"{type(err).__name__}: {err}"
        )


def main() -> int:
    """Child entry: answer jobs from stdin on stdout until ``None`` or the end of stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no os.nice (Windows)
        os.nice(NICE_INCREMENT)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s voice encoder process: %(message)s"
    )
    receive = Connection(os.dup(0), writable=False)
    send = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # stray prints go to stderr, never into the answers
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    encoders: list[Any] = []
    try:
        config = receive.recv()
        while True:
            job = receive.recv()
            if job is None:
                return 0
            send.send(_answer(job, encoders, config))
    except (EOFError, BrokenPipeError):
        return 0  # the parent went away
