"""``python -m wyoming_cosyvoice3.bench --model-dir DIR ...``: see BENCHMARKS.md and ``--help``."""

import sys

from wyoming_cosyvoice3.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
