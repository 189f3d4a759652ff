"""The chunk-causal streaming DiT estimator: derived once, validated, cached (its runner is
:class:`~...dit_runner.StreamingEstimator`).

Why: upstream streams with a static 50-frame chunk mask (cosyvoice/flow/DiT/dit.py
``DiT.forward(streaming=True)`` -> ``add_optional_chunk_mask(..., static_chunk_size=50, -1)``):
a mel frame attends to its own chunk and every earlier one. Under that mask the keys and
values of the prompt frames and of finished chunks, at every Euler step, never change, so a
chunk only needs its own frames run through the DiT, attending to cached keys/values. The
published estimator was traced with full attention (``streaming=False``) and cannot express
this; :mod:`.streaming_graph` rebuilds the same computation from its weights (found by
:mod:`.dit_structure`) with key/value caches, an explicit attention bias, rotary positions that
start anywhere and the two causal position convolutions fed their 30 frames of left context.

When made (in a child process: it holds the source model and the new graphs) the graphs are
validated against the source file and written to the cache directory only if

1. no cache + all-zero bias == the original estimator (max abs error <= ``FP32_TOL`` x
   max(1, max |reference|)), and
2. cached + chunk mask == uncached + chunk mask (first chunk cached, then the next frames).

The int8 variant quantises the main graph with the project's int8 recipe
(:func:`.quantize.quantize_estimator`: per-channel dynamic int8 MatMuls of the per-frame
layers) and is checked against the fp32 derived graph (``INT8_TOL``; its activation scales are
per call, so its cached and uncached results are not bit-comparable).

A failure leaves ``<main>.failed`` (see :mod:`..common.files`) and raises ModelLoadError; callers
fall back to the full-attention path with one warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ...dit_runner import CHUNK_FRAMES, StreamingEstimator, _session
from ...dit_runner import chunk_attention_bias as chunk_bias
from ...errors import ModelLoadError
from ..common.files import derive_once, run_child

logger = logging.getLogger(__name__)

STREAM_TAGS = {"fp32": "stream4main", "int8": "stream4int8main"}
"""File tags of the main graph per precision (4: the position convolutions in 2-D; 3: the
modulation chunks as inputs, each modulated norm one ``LayerNormalization``; 2 sliced them
from whole modulation vectors; 1 was the plain-operator attention); the time graph is
``stream2time`` (1 gave whole vectors)."""
TIME_TAG = "stream2time"
FP32_TOL = 1e-4
"""Relative max-abs tolerance of the fp32 derived graph against the source (float rounding:
measured 5e-7 relative on the parity model)."""
INT8_TOL = 0.25
"""Relative max-abs bound of the int8 main graph against the fp32 one (a sanity check: the
quantisation error itself is reported by the benchmark, BENCHMARKS.md)."""
# -- derivation (child process) -------------------------------------------------------------
def derive_streaming(source: Path, precision: str, main_out: Path, time_out: Path) -> str:
    """Write and validate the streaming graphs; return a one-line validation summary.

    Raises:
        ValueError: structure not recognised (:class:`.dit_structure.StructureError`) or a
            validation failed.
    """
    import onnx

    from .dit_structure import read_dit
    from .streaming_graph import build_main, build_time

    model = onnx.load(str(source))
    weights = read_dit(model)
    onnx.save(build_time(model, weights), str(time_out))
    del model
    layouts = [weights.layout_hint] + [x for x in ("interleaved", "half")
                                       if x != weights.layout_hint]
    plain = main_out.with_name(main_out.name + ".fp32.tmp")
    errors = []
    try:
        for layout in layouts:
            onnx.save(build_main(weights, layout), str(plain))
            try:
                summary = validate(source, plain, time_out)
            except ValueError as exc:
                errors.append(f"{layout}: {exc}")
                continue
            del weights
            if precision == "fp32":
                os.replace(plain, main_out)
                return summary
            from .quantize import quantize_estimator

            quantize_estimator(plain, main_out)
            return summary + "; " + validate_int8(plain, main_out, time_out)
        raise ValueError("; ".join(errors))
    finally:
        plain.unlink(missing_ok=True)


def _probe_inputs(frames: int, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {n: rng.standard_normal((2, 80, frames)).astype(np.float32)
             for n in ("x", "mu", "cond")}
    feeds["spks"] = rng.standard_normal((2, 80)).astype(np.float32)
    return feeds


def validate(source: Path, main: Path, time_graph: Path, frames: int = 90) -> str:
    """Run the two checks of the module docstring; return a summary.

    Raises:
        ValueError: a check failed (message gives the errors).
    """
    probe = _probe_inputs(frames)
    t = np.full(2, 0.37, dtype=np.float32)
    original = _session(source)
    ref = original.run(None, {**probe, "t": t, "mask": np.ones((2, 1, frames), np.float32)})[0]
    del original
    runner = StreamingEstimator(_session(main), _session(time_graph))
    scale = max(1.0, float(np.abs(ref).max()))
    full = runner.run(probe, 0.37, 0, chunk_bias(0, frames, 0, 0))
    err_full = float(np.abs(full.velocity - ref).max())
    if not err_full <= FP32_TOL * scale:
        raise ValueError(f"no cache + full mask differs from the source by {err_full:.3g}")
    masked = runner.run(probe, 0.37, 0, chunk_bias(0, frames, 0, CHUNK_FRAMES))
    first = {k: v[..., :CHUNK_FRAMES] if v.ndim == 3 else v for k, v in probe.items()}
    rest = {k: v[..., CHUNK_FRAMES:] if v.ndim == 3 else v for k, v in probe.items()}
    head = runner.run(first, 0.37, 0, chunk_bias(0, CHUNK_FRAMES, 0, CHUNK_FRAMES))
    tail = runner.run(
        rest, 0.37, CHUNK_FRAMES,
        chunk_bias(CHUNK_FRAMES, frames - CHUNK_FRAMES, CHUNK_FRAMES, CHUNK_FRAMES),
        conv_past=(head.conv1_next, head.conv2_next),
        prompt=head.new,
    )
    joined = np.concatenate([head.velocity, tail.velocity], axis=2)
    err_cache = float(np.abs(joined - masked.velocity).max())
    if not err_cache <= FP32_TOL * scale:
        raise ValueError(f"cached + chunk mask differs from uncached by {err_cache:.3g}")
    return (f"full attention vs source {err_full:.2g}, cached vs uncached chunk mask "
            f"{err_cache:.2g} (max |v| {scale:.3g})")


def validate_int8(fp32_main: Path, int8_main: Path, time_graph: Path, frames: int = 90) -> str:
    """Compare the int8 main graph with the fp32 one (uncached, chunk mask)."""
    probe = _probe_inputs(frames)
    bias = chunk_bias(0, frames, 0, CHUNK_FRAMES)
    ref = StreamingEstimator(_session(fp32_main), _session(time_graph)).run(probe, 0.37, 0, bias)
    got = StreamingEstimator(_session(int8_main), _session(time_graph)).run(probe, 0.37, 0, bias)
    scale = max(1.0, float(np.abs(ref.velocity).max()))
    err = float(np.abs(got.velocity - ref.velocity).max())
    if not np.isfinite(got.velocity).all() or err > INT8_TOL * scale:
        raise ValueError(f"int8 streaming graph differs from fp32 by {err:.3g}")
    return f"int8 vs fp32 {err:.2g}"


# -- cached files -----------------------------------------------------------------------------
def ensure_streaming_estimator(
    source: Path, cache_dir: Path, precision: str, *, in_process: bool = False
) -> tuple[Path, Path]:
    """(main graph, time graph) of the streaming estimator for ``precision`` ("fp32" or
    "int8"), derived and validated once from ``source`` into ``cache_dir``
    (:func:`~..common.files.derive_once`; the time graph is shared by both precisions).

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: the derivation or a validation failed (also on later calls, until
            the ``.failed`` marker is deleted).
    """

    def make(tmps: list[Path]) -> None:
        tmp_time, tmp_main = tmps
        if in_process:
            summary = derive_streaming(source, precision, tmp_main, tmp_time)
            logger.info("streaming DiT validated: %s", summary)
        else:  # validated in the child process
            run_child(["stream", precision, str(source), str(tmp_main), str(tmp_time)])

    time_graph, main = derive_once(
        source,
        cache_dir,
        [(TIME_TAG, ".onnx"), (STREAM_TAGS[precision], ".onnx")],
        make,
        name="streaming DiT",
        shared={TIME_TAG},
        # the forms it replaced as the estimator (the split pair, the whole-graph int8 copy)
        # and its own earlier tags
        retired=["main-*.onnx", "int8main-*.onnx", "time-*.onnx", "int8r2-*.onnx",
                 "stream2main-*.onnx", "stream2int8main-*.onnx", "stream1time-*.onnx",
                 "stream3main-*.onnx", "stream3int8main-*.onnx"],
    )
    return main, time_graph


def load_streaming_estimator(
    model_dir: Path, cache_dir: Path | None, precision: str, threads: int = 0,
    providers: tuple[str, ...] = ("CPUExecutionProvider",), spin_wait: bool = True,
) -> StreamingEstimator:
    """Derive (once) and open the streaming estimator of ``model_dir`` for ``precision``.

    Raises:
        ModelFilesMissing, ModelLoadError: derivation failed or the graph cannot be opened
            (callers fall back to full attention).
    """
    from ...sessions import ESTIMATOR, ORT_ERRORS, Graph, GraphSpec, open_session
    from ..common.files import derived_files_dir

    source = Path(model_dir) / ESTIMATOR.file
    main, time_graph = ensure_streaming_estimator(
        source, derived_files_dir(Path(model_dir), cache_dir), precision
    )
    errors: tuple[type[BaseException], ...] = (*ORT_ERRORS, KeyError)
    try:
        # the arena, shrunk after every run: a kept arena would hold a large pass's
        # intermediates for good (+0.68 GB after a 450-frame full-attention pass, full-size
        # fp32), no arena made every run slower (450 frames 4.67 s vs 3.84 s, a 50-frame
        # chunk 0.53 vs 0.44 s; BENCHMARKS.md "One DiT graph for quality")
        session = open_session(main, threads, providers, spin_wait, memory_arena=True)
        spec = GraphSpec(
            ESTIMATOR.file,
            {i.name: "float32" for i in session.get_inputs()},
            {o.name: "float32" for o in session.get_outputs()},
        )
        return StreamingEstimator(
            Graph(main, spec, session=session, shrink_arena=True), None, time_graph,
            session_factory=lambda path: open_session(path, threads, providers, spin_wait),
        )
    except errors as exc:
        raise ModelLoadError(f"cannot open the streaming DiT {main.name}: {exc}") from exc
