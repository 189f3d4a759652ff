"""Container health probe: send ``describe`` and expect ``info`` (exit 0) or fail (exit 1).

``python -m wyoming_cosyvoice3.server.healthcheck [--uri tcp://127.0.0.1:10200] [--ready]``;
``--ready`` also requires at least one installed voice (the model has loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from wyoming.client import AsyncClient
from wyoming.info import Describe, Info

MAX_EVENTS = 16


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
    parser.add_argument("--uri", default="tcp://127.0.0.1:10200",
                        help="server address (default tcp://127.0.0.1:10200)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--ready", action="store_true", help="also require a loaded model")
    args = parser.parse_args(argv)
    problem = asyncio.run(probe(args.uri, args.timeout, args.ready))
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
