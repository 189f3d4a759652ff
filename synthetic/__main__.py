"""``python -m synthetic OUT_DIR [--size tiny] [--seed N]`` from a clone: see ``--help``."""

import sys

from synthetic.cli import main

if __name__ == "__main__":
    sys.exit(main())
