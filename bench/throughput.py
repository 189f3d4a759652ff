"""MatMul throughput of this machine under onnxruntime: the denominator of the physical limit.

Four one-node-ish graphs, each run on the CPU provider with the benchmark's thread count:

* ``fp32``: ``MatMul`` of activations [M, K] by a float32 weight [K, N] (compute-bound, M=256).
* ``int8``: the ``onnxruntime.quantization.quantize_dynamic`` pattern the int8 LLM uses:
  ``DynamicQuantizeLinear`` of the activations, ``MatMulInteger`` with an int8 weight, ``Cast``
  and ``Mul`` by the scales (compute-bound, M=256). Operations = 2 M K N.
* ``stream_fp32`` / ``stream_int8``: the same with M=1 and a large weight: one activation row
  reads the whole weight, as LLM decoding does per token; reported as weight bytes per second.

The best of the timed repetitions is kept (the bound is what the machine can do).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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
    """

    fp32_flops: float
    int8_ops: float
    fp32_bytes: float
    int8_bytes: float
    threads: int

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
        )


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


def measure(threads: int, seconds_each: float = 1.5, seed: int = 0) -> Throughput:
    """Measure the four rates with ``threads`` intra-op threads (about 4 x ``seconds_each``).

    Args:
        threads: onnxruntime intra-op threads (>= 1).
        seconds_each: timing budget per microbenchmark.
    """
    rng = np.random.default_rng(seed)
    m, k, n = 256, 1024, 4096
    k_stream, n_stream = 4096, 8192  # 128 MiB fp32 / 32 MiB int8 of weights
    a = rng.standard_normal((m, k), dtype=np.float32)
    a_row = rng.standard_normal((1, k_stream), dtype=np.float32)
    rates = []
    for builder, width in ((_fp32_graph, 4), (_int8_graph, 1)):
        session = _session(builder(k, n, rng), threads)
        compute_s = best_seconds(lambda s=session: s.run(None, {"a": a}), seconds_each)
        session = _session(builder(k_stream, n_stream, rng), threads)
        stream_s = best_seconds(lambda s=session: s.run(None, {"a": a_row}), seconds_each)
        del session
        rates.append((2.0 * m * k * n / compute_s, width * k_stream * n_stream / stream_s))
    return Throughput(rates[0][0], rates[1][0], rates[0][1], rates[1][1], threads)
