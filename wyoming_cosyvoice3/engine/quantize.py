"""Files derived once from the model directory: the int8 DiT estimator and its cache location.

The DiT estimator (``flow.decoder.estimator.fp32.onnx``, ~1.33 GB) is MatMul-bound: spec
section 8 counts ~0.37 GFLOP per mel frame per pass, almost all of it in the 22 blocks' linear
layers. Quantising those weights to int8 lets onnxruntime use its integer MatMul kernels
(about 2x the fp32 MatMul throughput on the 2-core reference machine, BENCHMARKS.md) and
cuts the resident weights to a quarter.

How: ``onnxruntime.quantization.quantize_dynamic`` with ``per_channel=True``, int8 weights,
``op_types_to_quantize=["MatMul"]`` and ``MatMulConstBOnly`` (only MatMuls with a constant
weight; the attention products of two activations stay fp32), the same recipe the export's
model card gives for ``llm_int8.onnx`` ("dynamic int8 MatMul (per-channel)"). Activations are
quantised per tensor at run time (``DynamicQuantizeLinear``). Published effect of the same
change: nardi-xhepi/cosyvoice3-cpu reports 0.46 % waveform error for an int8 flow.

A failed attempt leaves ``<name>.failed`` (with the reason) so later starts do not retry it
(delete it to retry). The quantised file is written once, atomically (temporary name +
``os.replace``), named after the source file's size and mtime so a replaced source is
re-quantised, and reused afterwards.
The quantiser runs in a child process: it holds the fp32 model and its quantised copy in
memory (a few GB at the published size), which the serving process should never keep.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelFilesMissing, ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "wyoming-cosyvoice3"
INT8_TAG = "int8r2"
"""Tag of the int8 file name; bumped when the recipe changes (r2: per-frame MatMuls only)."""
QUANTIZE_TIMEOUT_S = 3600.0
_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def derived_files_dir(model_dir: Path, cache_dir: Path | None) -> Path:
    """Directory for files derived from ``model_dir`` (created if needed).

    ``cache_dir`` when given; else ``model_dir`` when writable; else ``DEFAULT_CACHE_DIR``.

    Raises:
        ModelLoadError: the chosen directory cannot be created.
    """
    if cache_dir is not None:
        chosen = Path(cache_dir)
    elif os.access(model_dir, os.W_OK):
        chosen = Path(model_dir)
    else:
        chosen = DEFAULT_CACHE_DIR
    try:
        chosen.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot create the cache directory {chosen}: {exc}; set EngineOptions.cache_dir "
            "(server: --cache-dir) to a writable directory"
        ) from exc
    return chosen


def keyed_name(source: Path, tag: str, suffix: str) -> str:
    """``<source stem without .fp32>.<tag>-<size>-<mtime_ns><suffix>`` for a derived file."""
    stat = source.stat()
    stem = source.name.removesuffix(".onnx").removesuffix(".fp32")
    return f"{stem}.{tag}-{stat.st_size}-{stat.st_mtime_ns}{suffix}"


def replace_atomically(tmp: Path, target: Path) -> None:
    """fsync ``tmp`` and rename it onto ``target`` (atomic on POSIX and Windows)."""
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, target)


def remove_stale(directory: Path, pattern: str, keep: Path) -> None:
    """Delete files matching ``pattern`` in ``directory`` except ``keep`` (best effort)."""
    for old in directory.glob(pattern):
        if old != keep:
            try:
                old.unlink()
                logger.info("removed stale derived file %s", old)
            except OSError as exc:
                logger.debug("cannot remove %s: %s", old, exc)


def _failure_marker(target: Path) -> Path:
    return target.with_name(target.name + ".failed")


def _check_failed_before(target: Path) -> None:
    """Raise at once when an earlier attempt for ``target`` failed (do not retry each start)."""
    marker = _failure_marker(target)
    if marker.is_file():
        reason = marker.read_text(encoding="utf-8", errors="replace").strip()[:500]
        raise ModelLoadError(
            f"an earlier attempt to derive {target.name} failed ({reason}); delete {marker} "
            "to try again"
        )


def _record_failure(target: Path, exc: BaseException) -> None:
    try:
        _failure_marker(target).write_text(f"{exc}\n", encoding="utf-8")
    except OSError as err:
        logger.debug("cannot write the failure marker for %s: %s", target, err)


def _lock_for(path: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(path, threading.Lock())


MIN_QUANTIZED_DIM = 512
"""Only weights whose both dimensions are at least this are quantised (the DiT blocks' linear
layers: 1024 x 1024, 1024 x 2048, 2048 x 1024); the input and output projections stay fp32."""


_KEEP_ELEMENTS = 4096


def weight_free_copy(model: Any) -> Any:
    """A copy of ``model`` (onnx.ModelProto) for shape inference: nodes, inputs and outputs
    kept, every initializer larger than ``_KEEP_ELEMENTS`` turned into a declared input
    (dims only, no data), so the copy is small whatever the model's size. Small initializers
    (shape constants) keep their values."""
    import onnx

    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    for field in ("node", "input", "output", "value_info"):
        getattr(light.graph, field).extend(getattr(model.graph, field))
    declared = {i.name for i in light.graph.input}
    for init in model.graph.initializer:
        if int(np.prod(init.dims)) <= _KEEP_ELEMENTS:
            light.graph.initializer.append(init)
        elif init.name not in declared:
            light.graph.input.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    return light
"""Initializers up to this size keep their data for shape inference (Reshape targets...)."""


def per_frame_matmuls(model: object) -> list[str]:
    """Names of the MatMul nodes worth quantising in an estimator graph.

    A node qualifies when its second input is a constant 2-D weight with both dimensions
    >= :data:`MIN_QUANTIZED_DIM` (or, in narrower graphs, the widest such width) and its
    activation has rank >= 3 (one row per mel frame, by onnx shape inference). This leaves
    the time-embedding MLP and the AdaLN modulation layers (rank-2 activations: one row per
    CFG batch item, so their cost is nil) and the input/output projections in fp32.
    Quantising the modulation layers scales/shifts every block by a per-tensor-quantised
    amount: velocity SNR against fp32 measured 28.8 dB with them quantised and 59.9 dB
    without (4-block full-width synthetic DiT, 200 frames; same speed).
    Nodes whose activation rank cannot be inferred are left in fp32.
    """
    import onnx
    from onnx import shape_inference

    if not isinstance(model, onnx.ModelProto):
        return []
    weights = {init.name: list(init.dims) for init in model.graph.initializer}
    try:
        inferred = shape_inference.infer_shapes(weight_free_copy(model))
    except Exception as exc:  # onnx raises several types; quantise nothing rather than guess
        logger.warning("shape inference of the estimator failed (%s); not quantising", exc)
        return []
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in [*inferred.graph.value_info, *inferred.graph.input]
        if v.type.tensor_type.HasField("shape")
    }
    candidates = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2 or not node.name:
            continue
        dims = weights.get(node.input[1])
        if dims is not None and len(dims) == 2 and ranks.get(node.input[0], 0) >= 3:
            candidates.append((node.name, min(dims)))
    if not candidates:
        return []
    # narrower models (the tiny test graphs) use their widest layers' width as the bar
    bar = min(MIN_QUANTIZED_DIM, max(width for _, width in candidates))
    return [name for name, width in candidates if width >= bar]


def quantize_estimator(source: Path, target: Path) -> None:
    """Write the dynamic int8 (per-channel) version of ``source`` to ``target``, quantising
    the MatMuls :func:`per_frame_matmuls` selects.

    Runs in the calling process (the child process of :func:`ensure_int8_estimator`).

    Raises:
        ValueError: no MatMul qualifies (not a DiT estimator).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source))
    nodes = per_frame_matmuls(model)
    del model  # the quantiser loads its own copy: keep one in memory at a time
    if not nodes:
        raise ValueError(f"{source.name}: no per-frame MatMul with a constant weight found")
    logger.info("quantising %d MatMul nodes of %s", len(nodes), source.name)
    quantize_dynamic(
        str(source),
        str(target),
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        reduce_range=False,
        weight_type=QuantType.QInt8,
        nodes_to_quantize=nodes,
        extra_options={"MatMulConstBOnly": True},
    )


def ensure_int8_estimator(source: Path, cache_dir: Path, *, in_process: bool = False) -> Path:
    """Path of the int8 estimator for ``source``, quantising it first if not cached yet.

    Args:
        source: the fp32 estimator file.
        cache_dir: directory of derived files (:func:`derived_files_dir`).
        in_process: quantise in this process instead of a child process (tests, tools).

    Returns:
        ``cache_dir / "flow.decoder.estimator.int8r2-<size>-<mtime_ns>.onnx"``.

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: quantisation failed (the message holds the quantiser's last output).
    """
    source = Path(source)
    if not source.is_file():
        raise ModelFilesMissing(str(source.parent), [source.name])
    target = Path(cache_dir) / keyed_name(source, INT8_TAG, ".onnx")
    with _lock_for(target):
        if target.is_file():
            return target
        _check_failed_before(target)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        started = time.perf_counter()
        logger.info("quantising %s to int8 (once; written to %s)", source.name, target)
        try:
            if in_process:
                quantize_estimator(source, tmp)
            else:
                _quantize_in_child(source, tmp)
            replace_atomically(tmp, target)
        except Exception as exc:  # quantiser errors are not typed; always wrapped below
            tmp.unlink(missing_ok=True)
            _record_failure(target, exc)
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"quantising {source} to int8 failed: {exc}") from exc
        stem = target.name.split(f".{INT8_TAG}-")[0]
        remove_stale(target.parent, f"{stem}.int8*.onnx", target)
        logger.info("int8 estimator ready in %.1f s", time.perf_counter() - started)
        return target


SPLIT_TAGS = {"fp32": "main", "int8": "int8main"}
"""File tags of the split estimator's main graph per precision (time graph: ``time``)."""


def ensure_split_estimator(
    source: Path, cache_dir: Path, precision: str, *, in_process: bool = False
) -> tuple[Path, Path]:
    """(main graph, time graph) of the split estimator (:mod:`.estimator_split`) for
    ``precision``, derived once from ``source`` like :func:`ensure_int8_estimator`.

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: splitting or quantising failed (callers fall back to the whole graph).
    """
    source = Path(source)
    if not source.is_file():
        raise ModelFilesMissing(str(source.parent), [source.name])
    cache_dir = Path(cache_dir)
    main = cache_dir / keyed_name(source, SPLIT_TAGS[precision], ".onnx")
    time_graph = cache_dir / keyed_name(source, "time", ".onnx")
    with _lock_for(main):
        if main.is_file() and time_graph.is_file():
            return main, time_graph
        _check_failed_before(main)
        suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
        tmp_main = main.with_name(f".{main.name}{suffix}")
        tmp_time = time_graph.with_name(f".{time_graph.name}{suffix}")
        started = time.perf_counter()
        logger.info("splitting %s (%s, once; written to %s)", source.name, precision, cache_dir)
        try:
            if in_process:
                from .estimator_split import derive_split

                derive_split(source, precision, tmp_main, tmp_time)
            else:
                _run_child(["split", precision, str(source), str(tmp_main), str(tmp_time)])
            if not time_graph.is_file():
                replace_atomically(tmp_time, time_graph)
            replace_atomically(tmp_main, main)
        except Exception as exc:  # child/quantiser errors are not typed; always wrapped below
            _record_failure(main, exc)
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"splitting {source} failed: {exc}") from exc
        finally:
            tmp_main.unlink(missing_ok=True)
            tmp_time.unlink(missing_ok=True)
        stem = main.name.split(f".{SPLIT_TAGS[precision]}-")[0]
        remove_stale(cache_dir, f"{stem}.{SPLIT_TAGS[precision]}-*.onnx", main)
        remove_stale(cache_dir, f"{stem}.time-*.onnx", time_graph)
        logger.info("split estimator ready in %.1f s", time.perf_counter() - started)
        return main, time_graph


def _quantize_in_child(source: Path, target: Path) -> None:
    _run_child(["int8", str(source), str(target)])
    if not target.is_file():
        raise ModelLoadError(f"the int8 quantiser wrote no {target.name}")


def _run_child(args: list[str]) -> None:
    package_root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(package_root), env.get("PYTHONPATH", "")) if p
    )
    cmd = [sys.executable, "-m", __name__, *args]
    try:
        proc = subprocess.run(  # argv: this interpreter and module
            cmd, capture_output=True, text=True, timeout=QUANTIZE_TIMEOUT_S, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"cannot run the estimator converter: {exc}") from exc
    if proc.returncode != 0:
        output = (proc.stderr or proc.stdout or "").strip()
        logger.debug("estimator converter output:\n%s", output)
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        raise ModelLoadError(
            f"the {args[0]} estimator converter exited with {proc.returncode}: "
            f"{lines[-1] if lines else 'no output'}"
        )


def main(argv: list[str] | None = None) -> int:
    """Child-process entry used by the engine:
    ``python -m wyoming_cosyvoice3.engine.quantize int8 SOURCE TARGET`` or
    ``... split fp32|int8 SOURCE MAIN_OUT TIME_OUT``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "int8":
        quantize_estimator(Path(args[1]), Path(args[2]))
        return 0
    if len(args) == 5 and args[0] == "split" and args[1] in SPLIT_TAGS:
        from .estimator_split import derive_split

        derive_split(Path(args[2]), args[1], Path(args[3]), Path(args[4]))
        return 0
    print(
        "usage: python -m wyoming_cosyvoice3.engine.quantize int8 SOURCE TARGET | "
        "split fp32|int8 SOURCE MAIN_OUT TIME_OUT",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
