"""``python tests/faulty_server.py ARGS``: the server program (``wyoming_cosyvoice3.server.cli``)
with :class:`server_support.FaultyEngine` in place of the model, for tests that need the real
process (signals, exit code, exit time) and an engine whose steps they control."""

from __future__ import annotations

import sys

from server_support import faulty_factory

from wyoming_cosyvoice3.server.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], engine_factory=faulty_factory))
