"""``python -m wyoming_cosyvoice3``: the Wyoming server (same as ``wyoming-cosyvoice3``)."""

import sys

from .server.cli import main

if __name__ == "__main__":
    sys.exit(main())
