"""``python -m bench --model-dir DIR ...``: see BENCHMARKS.md and ``--help``."""

import sys

from bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
