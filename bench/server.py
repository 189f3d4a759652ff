"""The real server as a subprocess: same server flags as users give, plus the benchmark's.

:class:`ServerProcess` starts ``python -m bench.serve --bench-tokens-per-char R
--bench-stats-file PATH --uri tcp://127.0.0.1:PORT --model-dir DIR --data-dir DATA --voice
bench --preset P ...`` (:mod:`.serve`: the product's server with the benchmark's hooks; fixed
decoding length, per-request records of :mod:`.recorder`), waits until ``describe`` reports the
benchmark voice installed, samples the resident memory of the process while it runs and stops
it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .client import describe

VOICE_NAME = "bench"
REPO_ROOT = Path(__file__).resolve().parents[1]
"""The clone this harness runs from (holds ``bench/`` and ``wyoming_cosyvoice3/``)."""
HOST = "127.0.0.1"
RSS_SAMPLE_S = 0.1


class ServerFailed(RuntimeError):
    """The server exited or did not become ready; the message holds its log tail."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def write_voice_catalog(data_dir: Path, clip: Path, transcript: str | None) -> Path:
    """Write ``data_dir/voices.yaml`` naming ``clip`` (a file inside ``data_dir``: the server
    only reads clips inside its data dirs) as voice ``bench``."""
    import yaml

    data_dir.mkdir(parents=True, exist_ok=True)
    entry: dict[str, Any] = {"name": VOICE_NAME, "description": "benchmark voice prompt",
                             "languages": ["en"],
                             "clip": str(clip.resolve().relative_to(data_dir.resolve()))}
    if transcript:
        entry["transcript"] = transcript
    path = data_dir / "voices.yaml"
    path.write_text(yaml.safe_dump({"voices": [entry]}, allow_unicode=True), encoding="utf-8")
    return path


def read_rss_bytes(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of ``pid`` in bytes: /proc VmRSS/VmHWM, else psutil (peak=0)."""
    status = Path(f"/proc/{pid}/status")
    with contextlib.suppress(OSError):
        values = {}
        for line in status.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
        if "VmRSS" in values:
            return values["VmRSS"], values.get("VmHWM", 0)
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss), 0
    except Exception:  # psutil missing or the process is gone
        return 0, 0


@dataclass
class ServerProcess:
    """One running server.

    Attributes:
        model_dir / data_dir / preset: what it serves.
        stats_file: where its per-request records go.
        log_file: its stderr/stdout.
        extra_args: more command-line flags (e.g. ``--llm-precision fp32``).
        tokens_per_char: fixed decoding length (``--bench-tokens-per-char``).
        source_dir: run the server from this source tree (``PYTHONPATH`` and working
            directory) instead of this clone, e.g. a checkout of an older commit for a
            baseline, with that tree's own ``bench.serve``; a tree from before
            ``bench/serve.py`` existed (the benchmark inside the package, up to a5fefb8) runs
            ``python -m wyoming_cosyvoice3`` and gets the benchmark settings through the
            environment (``COSYVOICE3_BENCH_*``), which those servers read.
    """

    model_dir: Path
    data_dir: Path
    preset: str
    stats_file: Path
    log_file: Path
    tokens_per_char: float
    extra_args: list[str] = field(default_factory=list)
    source_dir: Path | None = None
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    load_s: float = 0.0
    peak_rss_bytes: int = 0
    _sampled_peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _sampler: threading.Thread | None = None
    _log: IO[bytes] | None = None

    @property
    def tree(self) -> Path:
        """The source tree the server runs from."""
        return (self.source_dir or REPO_ROOT).resolve()

    @property
    def package_bench(self) -> bool:
        """True for a tree whose benchmark sits inside the package (no ``bench/serve.py``):
        its server takes the benchmark settings itself, from the environment."""
        return not (self.tree / "bench" / "serve.py").is_file()

    def command(self) -> list[str]:
        server_flags = [
            "--uri", f"tcp://{HOST}:{self.port}",
            "--model-dir", str(self.model_dir.resolve()),
            "--data-dir", str(self.data_dir.resolve()),
            "--voice", VOICE_NAME,
            "--preset", self.preset,
            "--seed", "1",
            "--max-request-seconds", "3600",
        ]
        if self.package_bench:
            return [sys.executable, "-m", "wyoming_cosyvoice3", *server_flags, *self.extra_args]
        return [sys.executable, "-m", "bench.serve",
                "--bench-tokens-per-char", f"{self.tokens_per_char:g}",
                "--bench-stats-file", str(self.stats_file.resolve()),
                *server_flags, *self.extra_args]

    def start(self, ready_timeout_s: float = 1800.0, again: bool = False) -> None:
        """Start the process and wait until the benchmark voice is installed.

        Args:
            ready_timeout_s: longest wait for the server to be ready.
            again: a later life of this server in the same benchmark run: its records and
                log go on after the earlier life's (otherwise both files start empty);
                ``load_s`` stays the first life's.

        Raises:
            ServerFailed: the process exited or was not ready in ``ready_timeout_s``.
        """
        self.port = free_port()
        if not again:
            self.stats_file.unlink(missing_ok=True)
        self._stop.clear()
        # every start computes the voice features again: feature extraction is measured
        shutil.rmtree(self.data_dir / "voice-cache", ignore_errors=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.tree), *filter(None, [env.get("PYTHONPATH")])])
        if self.package_bench:
            env["COSYVOICE3_BENCH_TOKENS_PER_CHAR"] = f"{self.tokens_per_char:g}"
            env["COSYVOICE3_BENCH_STATS_FILE"] = str(self.stats_file.resolve())
        self._log = self.log_file.open("ab" if again else "wb")
        started = time.monotonic()
        # ``python -m`` puts the working directory first on sys.path, before PYTHONPATH: the
        # server starts in its tree, or one started elsewhere could import another tree
        cwd = self.tree
        self.process = subprocess.Popen(self.command(), stdout=self._log, cwd=cwd,
                                        stderr=subprocess.STDOUT, env=env)
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()
        deadline = started + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(f"server exited with {self.process.returncode}: "
                                   f"{self.log_tail()}")
            info = asyncio.run(describe(HOST, self.port, timeout_s=2.0))
            voices = [v for p in (info.tts if info else []) for v in p.voices]
            if any(v.name == VOICE_NAME and v.installed for v in voices):
                if not again:
                    self.load_s = time.monotonic() - started
                return
            if info is not None and any("unavailable" in (p.description or "")
                                        for p in info.tts):
                raise ServerFailed(f"model failed to load: {self.log_tail()}")
            time.sleep(0.5)
        raise ServerFailed(f"not ready after {ready_timeout_s:.0f} s: {self.log_tail()}")

    def _sample_rss(self) -> None:
        process = self.process
        while process is not None and not self._stop.is_set() and process.poll() is None:
            rss, peak = read_rss_bytes(process.pid)
            self._sampled_peak = max(self._sampled_peak, rss)
            self.peak_rss_bytes = max(self.peak_rss_bytes, peak, self._sampled_peak)
            self._stop.wait(RSS_SAMPLE_S)

    def rss_bytes(self) -> int:
        """Current resident memory of the server."""
        return read_rss_bytes(self.process.pid)[0] if self.process is not None else 0

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code."""
        self._stop.set()
        process = self.process
        code = None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                code = process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait(10)
        elif process is not None:
            code = process.returncode
        if self._log is not None:
            self._log.close()
        return code
