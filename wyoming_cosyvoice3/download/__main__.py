"""Command line: download (or check) the model files into a directory.

``python -m wyoming_cosyvoice3.download --download-dir D [--llm-precision int8]`` fills ``D``
so that a machine without network can later start the server with ``--local-files-only``
(copy ``D`` over, including its hidden ``.cosyvoice3/`` directory, which holds the
verification records). ``--sizes`` prints the disk space each precision needs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..engine.errors import CosyVoiceError
from ..engine.options import LLM_FILES
from .ensure import ensure_model
from .files import (
    DEFAULT_REVISION,
    EXPORT_REPO,
    UPSTREAM_REPO,
    llm_files,
    published_size_bytes,
)

EXIT_MISSING = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m wyoming_cosyvoice3.download",
        description="Download and verify the Fun-CosyVoice3 ONNX model files.",
    )
    parser.add_argument("--download-dir", type=Path, help="directory to fill (created if needed)")
    parser.add_argument("--llm-precision", choices=sorted(LLM_FILES), default="int8")
    parser.add_argument("--local-files-only", action="store_true", help="never use the network")
    parser.add_argument("--export-repo", default=EXPORT_REPO)
    parser.add_argument("--export-revision", default=DEFAULT_REVISION)
    parser.add_argument("--upstream-repo", default=UPSTREAM_REPO)
    parser.add_argument("--upstream-revision", default=DEFAULT_REVISION)
    parser.add_argument("--endpoint", help="hub address (default: HF_ENDPOINT or huggingface.co)")
    parser.add_argument("--verify", action="store_true", help="hash every present file again")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None)
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--sizes", action="store_true", help="print disk space per precision")
    parser.add_argument("--debug", action="store_true")
    return parser


def print_sizes() -> None:
    """Print the disk space of a complete model directory per precision (published sizes)."""
    print(f"{'precision':10s} {'GB':>6s} {'GiB':>6s} {'bytes':>11s}  LLM files")
    for precision in sorted(LLM_FILES):
        size = published_size_bytes(precision)
        llm = " + ".join(llm_files(precision))
        print(f"{precision:10s} {size / 1e9:6.2f} {size / 2**30:6.2f} {size:11d}  {llm}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.sizes:
        print_sizes()
        return 0
    if args.download_dir is None:
        build_parser().error("--download-dir is required")
    try:
        model_dir = ensure_model(
            args.download_dir,
            args.llm_precision,
            local_files_only=args.local_files_only,
            export_repo=args.export_repo,
            export_revision=args.export_revision,
            upstream_repo=args.upstream_repo,
            upstream_revision=args.upstream_revision,
            endpoint=args.endpoint,
            progress=args.progress,
            verify=args.verify,
        )
    except CosyVoiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_MISSING
    except KeyboardInterrupt:
        print("interrupted; the next run resumes the download", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
