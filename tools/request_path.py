"""Count the product files one one-shot request runs through (DEVELOPMENT.md, "One request
through the code").

Starts the real server in this process (the synthetic ``tiny`` model, preset ``balanced``,
every other setting as shipped), installs a profiler on every thread (``sys.setprofile`` for
this one, ``threading.setprofile`` for every thread started later: the profiler is installed
before the server starts, so the worker, decoding and executor threads all carry it), sends one
``synthesize`` as warm-up, clears what was collected, sends the measured ``synthesize`` and
reads the collection after its ``audio-stop``. A file counts when at least one of its functions
ran (a ``call`` event whose code is not a module body) between the clearing and the
``audio-stop``.

Run from a clone (development tooling, not part of the package)::

    python tools/request_path.py [--model-dir DIR] [--text TEXT] [--json]

Without ``--model-dir`` the tiny model is built into a temporary directory (seconds).

``tests/test_request_path.py`` runs :func:`measure` on the test session's tiny model and engine
cache and holds the result to DEVELOPMENT.md's table and to the limit of 15 files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from wyoming.tts import Synthesize

import wyoming_cosyvoice3
from wyoming_cosyvoice3.server.cli import RunningServer
from wyoming_cosyvoice3.server.settings import Settings

PACKAGE_DIR = Path(wyoming_cosyvoice3.__file__).resolve().parent
DEFAULT_TEXT = "The front door is locked. It is 21 degrees in the kitchen."
READ_TIMEOUT_S = 1800.0
"""Hang guard for the model load (derivations included) and for each event; generous: the
count is often made on a shared machine at idle priority."""


class CallFiles:
    """The product files whose functions were called, in the order of their first call."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}  # file -> first function called in it
        self.module_bodies: set[str] = set()

    def clear(self) -> None:
        self.files = {}
        self.module_bodies = set()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        name = code.co_filename
        if name in self.files:
            return
        if code.co_name == "<module>":
            self.module_bodies.add(name)
            return
        self.files.setdefault(name, code.co_name)

    def product(self) -> list[tuple[str, str]]:
        """(path relative to the repository, first function) of the package's files."""
        out = []
        for name, func in list(self.files.items()):
            path = Path(name).resolve()
            if path.is_relative_to(PACKAGE_DIR):
                out.append((str(path.relative_to(PACKAGE_DIR.parent)), func))
        return out


@contextmanager
def profiled(calls: CallFiles) -> Iterator[None]:
    sys.setprofile(calls.profile)
    threading.setprofile(calls.profile)
    try:
        yield
    finally:
        threading.setprofile(None)
        sys.setprofile(None)


async def one_shot(port: int, text: str) -> int:
    """Send one ``synthesize``; return the number of ``audio-chunk`` events before ``audio-stop``.
    """
    from wyoming.client import AsyncTcpClient

    chunks = 0
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text=text).event())
        while True:
            event = await asyncio.wait_for(client.read_event(), READ_TIMEOUT_S)
            if event is None:
                raise RuntimeError("the server closed the connection")
            if event.type == "error":
                raise RuntimeError(f"the server answered with an error: {event.data}")
            if event.type == "audio-chunk":
                chunks += 1
            if event.type == "audio-stop":
                return chunks


async def measure(model_dir: Path, data_dir: Path, text: str) -> dict[str, Any]:
    settings = Settings(uri="tcp://127.0.0.1:0", model_dir=model_dir, data_dirs=(data_dir,),
                        preset="balanced")
    calls = CallFiles()
    with profiled(calls):
        server = RunningServer(settings)
        await server.start()
        try:
            ready = await asyncio.to_thread(server.runtime.loader.ready_event.wait, READ_TIMEOUT_S)
            if not ready:
                raise RuntimeError("the model did not load")
            port = server.port  # read before the clearing: it runs a product function
            assert port is not None
            await one_shot(port, text)  # warm-up
            calls.clear()
            chunks = await one_shot(port, text)
            files = calls.product()
            bodies = sorted(str(Path(b).resolve().relative_to(PACKAGE_DIR.parent))
                            for b in calls.module_bodies
                            if Path(b).resolve().is_relative_to(PACKAGE_DIR))
        finally:
            await server.stop(grace_s=10.0)
    return {"text": text, "preset": settings.preset, "audio_chunks": chunks,
            "count": len(files), "files": [{"file": f, "first_call": fn} for f, fn in files],
            "module_bodies_run": bodies}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="a tiny model (default: build one)")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="the measured request's text")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="request-path-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from synthetic.build import build_synthetic_model

            model_dir = build_synthetic_model(Path(tmp) / "model", size="tiny", seed=0)
        result = asyncio.run(measure(model_dir, Path(tmp) / "data", args.text))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['count']} product files ran a function for one one-shot request "
              f"({result['audio_chunks']} audio chunks, preset {result['preset']}, "
              f"text {result['text']!r}); in the order of their first call:")
        for n, item in enumerate(result["files"], 1):
            print(f"{n:3d}  {item['file']}  ({item['first_call']})")
        if result["module_bodies_run"]:
            print("module bodies run during the request:", ", ".join(result["module_bodies_run"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
