"""``python -m synthetic OUT_DIR [--size tiny] [--seed N]``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .config import SIZES


def main(argv: list[str] | None = None) -> int:
    """Build a synthetic model directory; return the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m synthetic",
        description="Write a contract-exact synthetic Fun-CosyVoice3 ONNX model directory "
        "(random weights; for tests, demos and benchmarks).",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument(
        "--size",
        default="tiny",
        choices=sorted(SIZES),
        help="model size; every size has the published graphs' structure: tiny (tests, "
        "~30 MB, seconds); full (real widths, random weights, ~4.8 GB, minutes; for "
        "benchmarks, write it outside git); full-mini (full widths, 2 LLM layers, 2 DiT "
        "blocks)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same files)")
    parser.add_argument("--debug", action="store_true", help="log at DEBUG level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO)

    from .build import build_synthetic_model

    out = build_synthetic_model(args.out_dir, size=args.size, seed=args.seed)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {total / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
