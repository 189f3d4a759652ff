"""Poll ``describe`` every 100 ms from its own thread, the way Home Assistant asks (a new
connection each time), and record how long every answer took.

Used by tests/test_server_describe_latency.py, and as a script for the full-size model:

    python tests/describe_poll.py --model-dir MODEL_DIR --data-dir DATA_DIR \
        [--add-voice CLIP]

starts ``python -m wyoming_cosyvoice3`` on a free port, polls through the whole start (model
load, voice preparation, warm-up), optionally a voice added through the voice page once the
server is ready (a new voice: voice-cache miss), and one synthesis (in the added voice), and
prints the maximum latency.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLL_INTERVAL_S = 0.1
ANSWER_LIMIT_S = 30.0
"""Socket timeout of one poll (a hang guard: a slower answer is recorded as this)."""


@dataclass
class Answer:
    """One ``describe`` answer: when it was asked (s since the poller started), how long the
    ``info`` took, the program description and whether any voice was installed."""

    at_s: float
    latency_s: float
    description: str
    ready: bool


def read_event(stream: Any) -> tuple[str, dict[str, Any], bytes]:
    """One Wyoming event from a binary file object: (type, data, payload)."""
    line = stream.readline()
    if not line:
        raise ConnectionError("the server closed the connection")
    header = json.loads(line)
    data = dict(header.get("data") or {})
    if header.get("data_length"):
        data.update(json.loads(stream.read(header["data_length"])))
    payload = stream.read(header["payload_length"]) if header.get("payload_length") else b""
    return header["type"], data, payload


def send_event(sock: socket.socket, event_type: str, data: dict[str, Any] | None = None) -> None:
    body = json.dumps(data).encode() if data else b""
    header: dict[str, Any] = {"type": event_type}
    if body:
        header["data_length"] = len(body)
    sock.sendall(json.dumps(header).encode() + b"\n" + body)


def ask_describe(port: int) -> tuple[float, dict[str, Any]]:
    """(seconds until ``info`` arrived, its data) over a new connection."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_LIMIT_S) as sock:
        send_event(sock, "describe")
        stream = sock.makefile("rb")
        for _ in range(16):
            event_type, data, _payload = read_event(stream)
            if event_type == "info":
                return time.monotonic() - started, data
    raise ConnectionError("no info event")


@dataclass
class DescribePoller:
    """Background thread asking ``describe`` every :data:`POLL_INTERVAL_S`."""

    port: int
    answers: list[Answer] = field(default_factory=list)
    refused: int = 0
    """Polls that found nothing listening (before the server listens)."""
    marks: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Named windows (start, end in s since the poller started), e.g. the voice page add."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _started: float = 0.0

    def start(self) -> DescribePoller:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="describe-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(ANSWER_LIMIT_S + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic() - self._started
            try:
                latency, data = ask_describe(self.port)
            except ConnectionRefusedError:
                self.refused += 1
            except OSError:  # timeout: recorded as the limit
                self.answers.append(Answer(asked, ANSWER_LIMIT_S, "(no answer)", False))
            else:
                program = data["tts"][0]
                self.answers.append(Answer(
                    asked, latency, program.get("description") or "",
                    any(v.get("installed") for v in program.get("voices", [])),
                ))
            self._stop.wait(POLL_INTERVAL_S)

    @property
    def ready(self) -> bool:
        return bool(self.answers) and self.answers[-1].ready

    def worst(self) -> Answer:
        return max(self.answers, key=lambda a: a.latency_s)

    def now_s(self) -> float:
        """Seconds since the poller started (the clock of :attr:`Answer.at_s`)."""
        return time.monotonic() - self._started

    def during(self, mark: str) -> list[Answer]:
        """Answers asked inside the window ``mark``."""
        start, end = self.marks[mark]
        return [a for a in self.answers if start <= a.at_s <= end]


def synthesize(port: int, text: str, timeout_s: float = 600.0, voice: str | None = None) -> int:
    """One-shot ``synthesize`` (in ``voice``, else the default voice); returns the bytes of
    audio received before ``audio-stop``.

    Raises:
        AssertionError: an ``error`` event arrived.
    """
    audio = 0
    request: dict[str, Any] = {"text": text}
    if voice is not None:
        request["voice"] = {"name": voice}
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        send_event(sock, "synthesize", request)
        stream = sock.makefile("rb")
        for _ in range(100000):
            event_type, data, payload = read_event(stream)
            if event_type == "error":
                raise AssertionError(f"synthesis failed: {data}")
            if event_type == "audio-chunk":
                audio += len(payload)
            if event_type == "audio-stop":
                return audio
    raise AssertionError("no audio-stop")


def add_voice_through_page(http_port: int, name: str, clip: bytes, transcript: str,
                           timeout_s: float = 600.0) -> tuple[int, dict[str, Any]]:
    """POST a new voice to the voice page the way the page's form does (multipart: name,
    languages, transcript, the clip file); returns (HTTP status, JSON answer)."""
    boundary = uuid.uuid4().hex
    parts = [(f'name="{key}"', value.encode()) for key, value in
             (("name", name), ("languages", "en"), ("transcript", transcript))]
    parts.append(('name="clip"; filename="clip.wav"', clip))
    body = b"".join(
        f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n\r\n".encode()
        + value + b"\r\n" for disposition, value in parts
    ) + f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/api/voices", data=body, method="POST",
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}",
                 "X-Voice-Page": "1"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, model_dir: Path, data_dir: Path, log_path: Path,
                 *args: str) -> subprocess.Popen[bytes]:
    """``python -m wyoming_cosyvoice3`` on 127.0.0.1:``port`` (no COSYVOICE3_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE3_")}
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "wyoming_cosyvoice3", "--uri", f"tcp://127.0.0.1:{port}",
             "--model-dir", str(model_dir), "--data-dir", str(data_dir), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )


def poll_start_and_synthesis(model_dir: Path, data_dir: Path, log_path: Path, text: str,
                             *args: str, limit_s: float = 600.0,
                             add_voice: tuple[str, bytes, str] | None = None) -> DescribePoller:
    """Start the server, poll through the start, the optional voice page add (``(name, clip
    bytes, transcript)``; marked ``"add"`` in ``poller.marks``) and one synthesis (in the added
    voice), stop the server.

    Raises:
        AssertionError: the server exited, did not become ready within ``limit_s``, or the
            page refused the voice.
    """
    port, http_port = free_port(), free_port()
    if add_voice is not None:
        args = (*args, "--http-port", str(http_port))
    process = start_server(port, model_dir, data_dir, log_path, *args)
    poller = DescribePoller(port).start()
    try:
        deadline = time.monotonic() + limit_s
        while not poller.ready:
            assert process.poll() is None, f"server exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready: {log_path.read_text()[-3000:]}"
            time.sleep(POLL_INTERVAL_S)
        voice = None
        if add_voice is not None:
            voice, clip, transcript = add_voice
            started = poller.now_s()
            status, answer = add_voice_through_page(http_port, voice, clip, transcript)
            poller.marks["add"] = (started, poller.now_s())
            assert status == 201, (status, answer, log_path.read_text()[-3000:])
        assert synthesize(port, text, voice=voice) > 0
        time.sleep(3 * POLL_INTERVAL_S)  # a few polls after the synthesis
    finally:
        poller.stop()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return poller


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--text", default="The front door is locked and the lights are off.")
    parser.add_argument("--add-voice", type=Path, metavar="CLIP",
                        help="once ready, add this clip as voice 'polled' through the voice "
                        "page (a new voice is prepared while the poll runs)")
    parser.add_argument("server_args", nargs="*", help="more server flags (after --)")
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.data_dir / "poll-server.log"
    started = time.monotonic()
    add = None
    if args.add_voice is not None:
        add = ("polled", args.add_voice.read_bytes(), "This is a reference clip.")
    poller = poll_start_and_synthesis(args.model_dir, args.data_dir, log_path, args.text,
                                      *args.server_args, limit_s=3600.0, add_voice=add)
    worst = poller.worst()
    latencies = sorted(a.latency_s for a in poller.answers)
    print(f"describe answers: {len(latencies)} over {time.monotonic() - started:.0f} s "
          f"(refused before listening: {poller.refused}); median "
          f"{latencies[len(latencies) // 2] * 1000:.0f} ms, max {worst.latency_s * 1000:.0f} ms "
          f"at {worst.at_s:.1f} s ({worst.description})")
    if "add" in poller.marks:
        during = poller.during("add")
        start, end = poller.marks["add"]
        print(f"voice page add: {end - start:.1f} s, {len(during)} answers, max "
              f"{max((a.latency_s for a in during), default=0.0) * 1000:.0f} ms")
    slow = [a for a in poller.answers if a.latency_s >= 1.0]
    print(f"answers of 1 s or more: {len(slow)}")
    for answer in slow:
        print(f"  at {answer.at_s:7.1f} s: {answer.latency_s * 1000:6.0f} ms "
              f"({answer.description})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
