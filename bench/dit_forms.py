"""One full-attention DiT pass: the split published estimator against the streaming DiT.

``python -m bench.dit_forms --model-dir DIR --cache-dir CACHE
[--frames 450] [--repeats 3] [--precision fp32] [--out dit_forms.json]``

In one process, taking turns call by call on the same random inputs (batch 2, one flow time,
all-ones mask):

* ``split``: the published estimator as the engine loads it when ``EngineOptions.preset`` is
  not ``flow.chunk_causal`` (:mod:`..engine.derive.flow.estimator_split`);
* ``streaming``: the derived streaming DiT run with full attention
  (:class:`..engine.derive.flow.full_attention.FullAttentionDiT`), as ``quality`` now runs its
  final chunks and one-shot requests; its session uses onnxruntime's arena, shrunk after
  every run.

Reports seconds per call (median), the largest difference between the two velocities, and the
process's resident memory after the runs. Both graphs are derived into ``--cache-dir`` first
when they are not there yet.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from wyoming_cosyvoice3.engine.derive.flow.full_attention import VELOCITY, FullAttentionDiT
from wyoming_cosyvoice3.engine.graphs import return_freed_memory
from wyoming_cosyvoice3.engine.loaders import load_estimator, load_streaming
from wyoming_cosyvoice3.engine.options import EngineOptions


def _rss_gb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    options = EngineOptions(cache_dir=Path(args.cache_dir), threads=args.threads)
    model_dir = Path(args.model_dir)
    forms: dict[str, Any] = {
        "split": load_estimator(model_dir, options, args.precision),
        "streaming": FullAttentionDiT(load_streaming(model_dir, options, args.precision)),
    }
    rng = np.random.default_rng(0)
    n = args.frames
    feeds = {k: rng.standard_normal((2, 80, n)).astype(np.float32) for k in ("x", "mu", "cond")}
    feeds["spks"] = rng.standard_normal((2, 80)).astype(np.float32)
    feeds["t"] = np.full(2, 0.37, np.float32)  # the time conditioning of a 10-step schedule
    feeds["mask"] = np.ones((2, 1, n), np.float32)
    seconds: dict[str, list[float]] = {name: [] for name in forms}
    outputs: dict[str, np.ndarray] = {}
    for name, form in forms.items():  # first runs: arenas, time conditioning
        outputs[name] = form.run(feeds, [VELOCITY])[VELOCITY]
    for _ in range(args.repeats):
        for name, form in forms.items():
            began = time.perf_counter()
            form.run(feeds, [VELOCITY])
            seconds[name].append(time.perf_counter() - began)
    return_freed_memory()
    ref = outputs["split"]
    return {
        "frames": n, "precision": args.precision, "repeats": args.repeats,
        "seconds": seconds,
        "median_s": {k: float(np.median(v)) for k, v in seconds.items()},
        "max_abs_diff": float(np.abs(outputs["streaming"] - ref).max()),
        "max_abs_velocity": float(np.abs(ref).max()),
        "rss_after_gb": _rss_gb(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--frames", type=int, default=450)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", choices=("fp32", "int8"), default="fp32")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
