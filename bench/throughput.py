"""MatMul throughput of this machine under onnxruntime: the denominator of the physical limit.

Four one-node-ish graphs, each run on the CPU provider with the benchmark's thread count:

* ``fp32``: ``MatMul`` of activations [M, K] by a float32 weight [K, N] (compute-bound, M=256).
* ``int8``: the ``onnxruntime.quantization.quantize_dynamic`` pattern the int8 LLM uses:
  ``DynamicQuantizeLinear`` of the activations, ``MatMulInteger`` with an int8 weight, ``Cast``
  and ``Mul`` by the scales (compute-bound, M=256). Operations = 2 M K N.
* ``stream_fp32`` / ``stream_int8``: the same with M=1 and a large weight: one activation row
  reads the whole weight, as LLM decoding does per token; reported as weight bytes per second.

The best of the timed repetitions is kept (the bound is what the machine can do).

The streaming rates are memory rates, not cache rates: the LLM reads 0.36 GB of int8 weights
per token, in the same order every token, more than a last-level cache holds (300 MiB on the
largest here), so each token's weights come from DRAM; the probe's weight (32 MiB int8,
128 MiB fp32) fits in a large last-level cache (on the AVX-512 Xeon of 2026-12 with 300 MiB of
L3 it measured 43 GB/s int8, where a plain 2-thread read of 360 MB gets 22 GB/s). So before
each timed one-row run (:func:`best_cold_seconds`) a buffer of :func:`eviction_bytes` (twice
the last-level cache that sysfs reports, at least 64 MiB, 512 MiB when unknown) is read,
split over as many threads as the MatMul uses so that each core's own L2 is flushed too; the
buffer is written once when made, and one untimed read before the first run leaves only clean
lines behind, so no write-back lands in a timed run. The compute-bound rates are measured warm
(their weights are small and reused, as the DiT's are).
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Throughput:
    """Measured rates.

    Attributes:
        fp32_flops: float32 MatMul operations per second (2 x MACs).
        int8_ops: int8 MatMulInteger operations per second, quantisation included.
        fp32_bytes: float32 weight bytes streamed per second by a one-row MatMul.
        int8_bytes: int8 weight bytes streamed per second by a one-row MatMulInteger.
        threads: intra-op threads used.
        evict_bytes: bytes read before each timed one-row run to evict its weight from the
            caches (0: none, as measured before 2026-12; those rates are partly cache rates).
    """

    fp32_flops: float
    int8_ops: float
    fp32_bytes: float
    int8_bytes: float
    threads: int
    evict_bytes: int = 0

    def to_json(self) -> dict[str, float]:
        return dict(self.__dict__)

    @classmethod
    def best(cls, first: Throughput, second: Throughput) -> Throughput:
        """Field-wise maximum of two measurements (start and end of a benchmark)."""
        return cls(
            max(first.fp32_flops, second.fp32_flops),
            max(first.int8_ops, second.int8_ops),
            max(first.fp32_bytes, second.fp32_bytes),
            max(first.int8_bytes, second.int8_bytes),
            first.threads,
            max(first.evict_bytes, second.evict_bytes),
        )


COMPUTE_SHAPE = (256, 1024, 4096)
"""M, K, N of the compute-bound MatMuls."""
STREAM_SHAPE = (4096, 8192)
"""K, N of the one-row MatMuls' weight: 128 MiB fp32, 32 MiB int8."""
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
MIN_EVICT_BYTES = 64 << 20
"""Smallest eviction read (the product's probe read 64 MiB before 2026-12)."""
UNKNOWN_CACHE_EVICT_BYTES = 512 << 20
"""Eviction read when sysfs gives no cache size (larger than any desktop last-level cache)."""
EVICT_FACTOR = 2
"""Eviction read per byte of last-level cache: caches replace only approximately least
recently used lines, and a read of the cache's size leaves some of the weight behind."""


def _size_bytes(text: str) -> int:
    """``307200K`` / ``32M`` / ``1G`` / ``65536`` (sysfs cache ``size``) in bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a cache size: {text!r}")
    return int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2].upper()]


def last_level_cache_bytes(cache_dir: Path = CACHE_DIR) -> int | None:
    """Size of CPU 0's highest-level data or unified cache (sysfs ``index*/level``, ``type``,
    ``size``; level 3 on most machines, 2 on those without an L3), None when unreadable."""
    found: list[tuple[int, int]] = []
    for index in sorted(cache_dir.glob("index*")):
        try:
            if (index / "type").read_text(encoding="ascii").strip() == "Instruction":
                continue
            found.append((int((index / "level").read_text(encoding="ascii")),
                          _size_bytes((index / "size").read_text(encoding="ascii"))))
        except (OSError, ValueError):
            continue
    return max(found)[1] if found else None


def eviction_bytes(llc_bytes: int | None) -> int:
    """Bytes to read before a timed run so that its weight comes from memory:
    :data:`EVICT_FACTOR` x the last-level cache, at least :data:`MIN_EVICT_BYTES`;
    :data:`UNKNOWN_CACHE_EVICT_BYTES` when the cache size is unknown."""
    if llc_bytes is None or llc_bytes <= 0:
        return UNKNOWN_CACHE_EVICT_BYTES
    return max(MIN_EVICT_BYTES, EVICT_FACTOR * llc_bytes)


class Evictor:
    """Reads a buffer of ``size`` bytes in ``threads`` threads (numpy releases the GIL while
    it reduces), so that what was cached before (in the shared last-level cache and in each
    core's own) is gone. Call it untimed; it holds ``size`` bytes until released."""

    def __init__(self, size: int, threads: int) -> None:
        self.buffer = np.ones(size, dtype=np.uint8)  # written: zero pages would share a page
        self.parts = np.array_split(self.buffer, max(1, threads))
        self()  # the fill left dirty lines: read once so that later reads only evict clean ones

    def __call__(self) -> None:
        if len(self.parts) == 1:
            self.parts[0].max()
            return
        workers = [threading.Thread(target=part.max) for part in self.parts]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()


def _fp32_graph(k: int, n: int, rng: np.random.Generator) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "fp32_matmul",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [weight],
    )
    return bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                 .SerializeToString())


def _int8_graph(k: int, n: int, rng: np.random.Generator) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    # 7-bit weights: u8 x s8 products summed in pairs stay within int16 on AVX2 (no VNNI),
    # so the result is exact; the speed is the same as with full-range weights
    weight = rng.integers(-63, 64, size=(k, n), dtype=np.int8)
    inits = [
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(np.zeros((), dtype=np.int8), "w_zero"),
        numpy_helper.from_array(np.full((n,), 0.01, dtype=np.float32), "w_scale"),
    ]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["a"], ["aq", "a_scale", "a_zero"]),
        helper.make_node("MatMulInteger", ["aq", "w", "a_zero", "w_zero"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["a_scale", "w_scale"], ["scale"]),
        helper.make_node("Mul", ["acc_f", "scale"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "int8_matmul",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        inits,
    )
    return bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                 .SerializeToString())


def _session(model: bytes, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def best_seconds(run: Any, min_total_s: float, max_reps: int = 200) -> float:
    """Fastest of repeated calls of ``run()`` (2 untimed first), repeated for ``min_total_s``."""
    run()
    run()
    best = float("inf")
    spent = 0.0
    for _ in range(max_reps):
        started = time.perf_counter()
        run()
        elapsed = time.perf_counter() - started
        best = min(best, elapsed)
        spent += elapsed
        if spent >= min_total_s:
            break
    return best


def _nothing() -> None:
    return None


def best_cold_seconds(run: Callable[[], Any], evict: Callable[[], Any], budget_s: float,
                      min_reps: int = 3, max_reps: int = 30) -> float:
    """Fastest of repeated calls of ``run()``, each after an untimed ``evict()`` (one untimed
    call first), repeated while the whole loop (evictions included) is within ``budget_s``
    and at least ``min_reps`` times."""
    evict()
    run()
    best = float("inf")
    started = time.perf_counter()
    for rep in range(max_reps):
        evict()
        begin = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - begin)
        if rep + 1 >= min_reps and time.perf_counter() - started >= budget_s:
            break
    return best


def measure(threads: int, seconds_each: float = 1.5, seed: int = 0,
            evict_bytes: int | None = None) -> Throughput:
    """Measure the four rates with ``threads`` intra-op threads (about 4 x ``seconds_each``).

    Args:
        threads: onnxruntime intra-op threads (>= 1).
        seconds_each: timing budget per microbenchmark.
        evict_bytes: read before each timed one-row run (module doc); None:
            :func:`eviction_bytes` of this machine's last-level cache; 0: none (the weight
            stays cached between runs, as measured before 2026-12).
    """
    rng = np.random.default_rng(seed)
    m, k, n = COMPUTE_SHAPE
    k_stream, n_stream = STREAM_SHAPE
    a = rng.standard_normal((m, k), dtype=np.float32)
    a_row = rng.standard_normal((1, k_stream), dtype=np.float32)
    if evict_bytes is None:
        evict_bytes = eviction_bytes(last_level_cache_bytes())
    rates = []
    for builder, width in ((_fp32_graph, 4), (_int8_graph, 1)):
        session = _session(builder(k, n, rng), threads)
        compute_s = best_seconds(lambda s=session: s.run(None, {"a": a}), seconds_each)
        session = _session(builder(k_stream, n_stream, rng), threads)
        evict: Callable[[], Any] = (Evictor(evict_bytes, threads) if evict_bytes > 0
                                    else _nothing)  # 0: cached (the old measurement)
        stream_s = best_cold_seconds(functools.partial(session.run, None, {"a": a_row}), evict,
                                     seconds_each)
        del session, evict
        rates.append((2.0 * m * k * n / compute_s, width * k_stream * n_stream / stream_s))
    return Throughput(rates[0][0], rates[1][0], rates[0][1], rates[1][1], threads, evict_bytes)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.throughput``: print rate samples as JSON (for ``python -m bench
    --report-only --rates-file``)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m bench.throughput",
                                     description=main.__doc__)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--seconds", type=float, default=1.5, help="budget per microbenchmark")
    parser.add_argument("--samples", type=int, default=1, help="measurements (default 1)")
    parser.add_argument("--evict-bytes", type=int, default=None,
                        help="bytes read before each one-row run (default: eviction_bytes of "
                             "this machine; 0: none, cached)")
    args = parser.parse_args(argv)
    samples = [measure(args.threads, args.seconds, seed=i, evict_bytes=args.evict_bytes)
               .to_json() for i in range(args.samples)]
    print(json.dumps(samples, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
