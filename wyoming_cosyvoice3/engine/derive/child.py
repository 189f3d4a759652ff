"""Child-process entry of the large derivations (run by :func:`.common.files.run_child`).

``python -m wyoming_cosyvoice3.engine.derive.child COMMAND ARGS...``, one command per derived
form (:data:`COMMANDS`): ``stream fp32|int8 SOURCE MAIN_OUT TIME_OUT``
(:mod:`.flow.streaming_estimator`), ``table SOURCE TABLE_NPY DTYPE_FILE``
(:mod:`.llm.embedding_table`), ``llm fused|fused-q4 SOURCE DATA REPORT GRAPH [EMBEDS_NPY]``
(:mod:`.llm.fused`) and ``hift-stream SOURCE GRAPH REPORT`` (:mod:`.vocoder.hift_stream`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .flow.streaming_estimator import STREAM_TAGS, derive_streaming
from .llm.embedding_table import extract_table
from .llm.fused import FUSED_TAGS, write_fused_files
from .vocoder.hift_stream import write_stream_hift


def _stream(a: argparse.Namespace) -> None:
    derive_streaming(a.source, a.precision, a.main_out, a.time_out)


def _table(a: argparse.Namespace) -> None:
    extract_table(a.source, a.table_npy, a.dtype_file)


def _llm(a: argparse.Namespace) -> None:
    embeds = None if a.embeds_npy is None else np.load(a.embeds_npy)
    write_fused_files(a.source, a.variant, a.data, a.report, a.graph, embeds)


def _hift_stream(a: argparse.Namespace) -> None:
    write_stream_hift(a.source, a.graph, a.report)


Argument = str | tuple[str, list[str]]
COMMANDS: dict[str, tuple[list[Argument], Callable[[argparse.Namespace], None]]] = {
    "stream": ([("precision", sorted(STREAM_TAGS)), "source", "main_out", "time_out"], _stream),
    "table": (["source", "table_npy", "dtype_file"], _table),
    "llm": ([("variant", sorted(FUSED_TAGS)), "source", "data", "report", "graph", "embeds_npy?"],
            _llm),
    "hift-stream": (["source", "graph", "report"], _hift_stream),
}
"""Command -> (its arguments in order: a path, a ``(name, choices)`` word, or an optional path
ending in ``?``; the function it runs)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wyoming_cosyvoice3.engine.derive.child")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (arguments, run) in COMMANDS.items():
        sub = commands.add_parser(name)
        for argument in arguments:
            if isinstance(argument, tuple):
                sub.add_argument(argument[0], choices=argument[1])
            elif argument.endswith("?"):
                sub.add_argument(argument[:-1], type=Path, nargs="?", default=None)
            else:
                sub.add_argument(argument, type=Path)
        sub.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Child-process entry used by the engine (commands in the module docstring); returns the
    exit status (2: usage)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        parsed = _parser().parse_args(args)
    except SystemExit as exc:  # argparse printed the usage to stderr
        return 2 if exc.code else 0
    parsed.run(parsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
