"""Benchmark of the Wyoming server (``python -m bench`` from a clone; BENCHMARKS.md). Not part
of the installed package: it lives beside ``wyoming_cosyvoice3/`` in the repository.

Modules: ``flops`` (operation counts from the ONNX graphs), ``throughput`` (onnxruntime MatMul
microbenchmarks), ``player`` (simulated real-time playback: stalls), ``stats`` (medians and
per-run figures), ``client`` (Wyoming requests as Home Assistant sends them), ``server`` (the
real server as a subprocess), ``serve`` (that subprocess: the product's server with the
benchmark's hooks), ``report`` (JSON, markdown), ``plot`` (timelines), ``cli``, ``recorder``
(the server observer behind ``--bench-stats-file``), ``levers`` (each performance lever's
deviation and cost, in process). It observes the server and the engine only through
:class:`wyoming_cosyvoice3.server.hooks.ServerHooks` (its observer is an
:class:`wyoming_cosyvoice3.engine.options.EngineObserver`) and options.
"""
