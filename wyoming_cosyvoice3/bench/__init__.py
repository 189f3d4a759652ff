"""Benchmark of the Wyoming server (``python -m benchmarks.run``; BENCHMARKS.md).

Modules: ``flops`` (operation counts from the ONNX graphs), ``throughput`` (onnxruntime MatMul
microbenchmarks), ``player`` (simulated real-time playback: stalls), ``stats`` (medians and
per-run figures), ``client`` (Wyoming requests as Home Assistant sends them), ``server`` (the
real server as a subprocess), ``report`` (JSON, markdown), ``plot`` (timelines), ``cli``.
"""
