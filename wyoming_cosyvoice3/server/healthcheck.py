"""Container health probe: send ``describe`` and expect ``info`` (exit 0) or fail (exit 1).

``python -m wyoming_cosyvoice3.server.healthcheck [--uri URI] [--ready]``.

* Without ``--ready`` it checks that the process answers (healthy also while the model
  downloads, waits for the network or loads): what a container health check needs, since a
  restart would not help a download.
* ``--ready`` also requires at least one installed voice (the model has loaded): for scripts
  that want to wait until speech works.

Without ``--uri`` the address is read from the file named by ``COSYVOICE3_HEALTH_URI_FILE``
(the server writes its bound address there when the variable is set, as the Docker image
does), else ``tcp://127.0.0.1:10200``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from wyoming.client import AsyncClient
from wyoming.info import Describe, Info

MAX_EVENTS = 16
DEFAULT_PROBE_URI = "tcp://127.0.0.1:10200"
HEALTH_URI_FILE_VARIABLE = "COSYVOICE3_HEALTH_URI_FILE"


def probe_uri(listen_uri: str, port: int | None) -> str | None:
    """The address a local probe uses for a server listening on ``listen_uri`` (bound to
    ``port``): a wildcard host becomes 127.0.0.1; None for ``stdio://``."""
    parts = urlsplit(listen_uri)
    if parts.scheme == "unix":
        return listen_uri
    if parts.scheme != "tcp":
        return None
    host = parts.hostname or "0.0.0.0"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port if port is not None else parts.port}"


def write_health_uri(listen_uri: str, port: int | None) -> Path | None:
    """Write the probe address to ``$COSYVOICE3_HEALTH_URI_FILE`` when that is set."""
    target = os.environ.get(HEALTH_URI_FILE_VARIABLE)
    uri = probe_uri(listen_uri, port)
    if not target or uri is None:
        return None
    path = Path(target)
    try:
        path.write_text(uri + "\n", encoding="utf-8")
    except OSError:
        return None
    return path


def configured_uri() -> str:
    """The probe address written by the server, else :data:`DEFAULT_PROBE_URI`."""
    target = os.environ.get(HEALTH_URI_FILE_VARIABLE)
    if target:
        try:
            text = Path(target).read_text(encoding="utf-8").strip()
        except OSError:
            text = ""
        if text:
            return text
    return DEFAULT_PROBE_URI


async def _ask(uri: str, require_ready: bool) -> str | None:
    async with AsyncClient.from_uri(uri) as client:
        await client.write_event(Describe().event())
        for _ in range(MAX_EVENTS):
            event = await client.read_event()
            if event is None:
                return "the server closed the connection"
            if Info.is_type(event.type):
                info = Info.from_event(event)
                if not info.tts:
                    return "no text-to-speech program"
                if require_ready and not any(v.installed for v in info.tts[0].voices):
                    return f"not ready: {info.tts[0].description}"
                return None
    return "no info event"


async def probe(uri: str, timeout_s: float, require_ready: bool) -> str | None:
    """Return None when healthy, else what is wrong."""
    try:
        return await asyncio.wait_for(_ask(uri, require_ready), timeout_s)
    except (OSError, asyncio.TimeoutError) as err:
        return f"no answer from {uri}: {err or type(err).__name__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m wyoming_cosyvoice3.server.healthcheck",
        description="Container health probe: send describe to the server and expect info. "
        "Exit status 0 when healthy, 1 otherwise (the reason goes to stderr).",
    )
    parser.add_argument("--uri", default=None,
                        help=f"server address (default: the address the server wrote to "
                        f"${HEALTH_URI_FILE_VARIABLE}, else {DEFAULT_PROBE_URI})")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--ready", action="store_true",
                        help="also require a loaded model (exit 1 while it downloads or loads)")
    args = parser.parse_args(argv)
    problem = asyncio.run(probe(args.uri or configured_uri(), args.timeout, args.ready))
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
