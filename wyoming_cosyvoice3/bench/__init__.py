"""Benchmark of the Wyoming server (``python -m wyoming_cosyvoice3.bench``; BENCHMARKS.md).

Modules: ``flops`` (operation counts from the ONNX graphs), ``throughput`` (onnxruntime MatMul
microbenchmarks), ``player`` (simulated real-time playback: stalls), ``stats`` (medians and
per-run figures), ``client`` (Wyoming requests as Home Assistant sends them), ``server`` (the
real server as a subprocess), ``report`` (JSON, markdown), ``plot`` (timelines), ``cli``,
``recorder`` (the engine observer behind ``--bench-stats-file``), ``levers`` (each
performance lever's deviation and cost, in process). It observes the engine only through
:class:`wyoming_cosyvoice3.engine.hooks.EngineObserver` and options.
"""
