"""Home Assistant add-on integration: announce the server to Home Assistant (discovery).

Inside an add-on the Supervisor gives the container ``SUPERVISOR_TOKEN``. Once the server
answers ``describe`` on its own port, one ``POST {SUPERVISOR_URL}/discovery`` with
``{"service": "wyoming", "config": {"uri": "tcp://<container host name>:<port>"}}`` makes Home
Assistant offer the Wyoming integration (the add-on's config.yaml lists ``discovery:
[wyoming]``; Supervisor API ``/discovery``). Outside an add-on nothing is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import urllib.error
import urllib.request

from .healthcheck import probe

_LOGGER = logging.getLogger(__name__)

SUPERVISOR_URL = "http://supervisor"
TOKEN_VARIABLE = "SUPERVISOR_TOKEN"
ANSWER_WAIT_S = 60.0
"""How long to wait for the own ``describe`` answer before giving up on discovery."""


def discovery_payload(port: int, host: str | None = None) -> dict[str, object]:
    """The Supervisor discovery message for the Wyoming service on ``port``."""
    return {"service": "wyoming",
            "config": {"uri": f"tcp://{host or socket.gethostname()}:{port}"}}


def _post(url: str, token: str, payload: dict[str, object]) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


async def announce(port: int, token: str | None = None, url: str | None = None) -> bool:
    """Wait until ``describe`` answers on ``port``, then send the discovery message once.

    Returns:
        True when the Supervisor accepted it; False when not in an add-on (no token), the
        server did not answer, or the Supervisor refused (logged).
    """
    token = token if token is not None else os.environ.get(TOKEN_VARIABLE)
    if not token:
        return False
    problem: str | None = "not asked"
    for _ in range(int(ANSWER_WAIT_S / 0.5)):
        problem = await probe(f"tcp://127.0.0.1:{port}", 2.0, require_ready=False)
        if problem is None:
            break
        await asyncio.sleep(0.5)
    if problem is not None:
        _LOGGER.error("Home Assistant discovery not sent: the server does not answer (%s)",
                      problem)
        return False
    target = f"{(url or SUPERVISOR_URL).rstrip('/')}/discovery"
    try:
        status = await asyncio.to_thread(_post, target, token, discovery_payload(port))
    except (urllib.error.URLError, OSError) as err:
        _LOGGER.error("Home Assistant discovery failed (%s): %s", target, err)
        return False
    _LOGGER.info("Sent discovery to Home Assistant (HTTP %d): wyoming on port %d", status, port)
    return True
