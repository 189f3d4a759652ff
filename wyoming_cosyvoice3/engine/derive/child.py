"""Child-process entry of the large derivations (run by :func:`.files.run_child`).

``python -m wyoming_cosyvoice3.engine.derive.child int8 SOURCE TARGET`` or
``... split fp32|int8 SOURCE MAIN_OUT TIME_OUT`` or ``... stream fp32|int8 SOURCE MAIN_OUT
TIME_OUT`` (the chunk-causal streaming estimator, :mod:`.streaming_estimator`) or
``... table SOURCE TABLE_NPY DTYPE_FILE`` (the text embedding table, :mod:`.embedding_table`)
or ``... llm fused|fused-q4 SOURCE DATA REPORT GRAPH [EMBEDS_NPY]`` (the fused-operator LLM
decode graph, :mod:`.llm_fused`) or ``... hift SOURCE GRAPH REPORT`` (the phase-carrying
vocoder, :mod:`.hift_phase`) or ``... hift-stream SOURCE GRAPH REPORT`` (the streamed
vocoder, :mod:`.hift_stream`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .embedding_table import extract_table
from .estimator_split import SPLIT_TAGS, derive_split
from .hift_phase import write_phase_hift
from .hift_stream import write_stream_hift
from .llm_fused import FUSED_TAGS, write_fused_files
from .quantize import quantize_estimator
from .streaming_estimator import STREAM_TAGS, derive_streaming


def main(argv: list[str] | None = None) -> int:
    """Child-process entry used by the engine (commands in the module docstring); returns the
    exit status (2: usage)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "int8":
        quantize_estimator(Path(args[1]), Path(args[2]))
        return 0
    if len(args) == 5 and args[0] == "split" and args[1] in SPLIT_TAGS:
        derive_split(Path(args[2]), args[1], Path(args[3]), Path(args[4]))
        return 0
    if len(args) == 4 and args[0] == "table":
        extract_table(Path(args[1]), Path(args[2]), Path(args[3]))
        return 0
    if len(args) == 5 and args[0] == "stream" and args[1] in STREAM_TAGS:
        derive_streaming(Path(args[2]), args[1], Path(args[3]), Path(args[4]))
        return 0
    if len(args) in (6, 7) and args[0] == "llm" and args[1] in FUSED_TAGS:
        embeds = np.load(args[6]) if len(args) == 7 else None
        data, report, graph = (Path(a) for a in args[3:6])
        write_fused_files(Path(args[2]), args[1], data, report, graph, embeds)
        return 0
    if len(args) == 4 and args[0] == "hift-stream":
        write_stream_hift(Path(args[1]), Path(args[2]), Path(args[3]))
        return 0
    if len(args) == 4 and args[0] == "hift":
        write_phase_hift(Path(args[1]), Path(args[2]), Path(args[3]))
        return 0
    print(
        "usage: python -m wyoming_cosyvoice3.engine.derive.child int8 SOURCE TARGET | "
        "split|stream fp32|int8 SOURCE MAIN_OUT TIME_OUT | table SOURCE TABLE_NPY DTYPE_FILE | "
        "llm fused|fused-q4 SOURCE DATA REPORT GRAPH [EMBEDS_NPY] | "
        "hift|hift-stream SOURCE GRAPH REPORT",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
