"""Files derived once from the model directory: the int8 DiT estimator and its cache location.

The DiT estimator (``flow.decoder.estimator.fp32.onnx``, ~1.33 GB) is MatMul-bound: spec
section 8 counts ~0.37 GFLOP per mel frame per pass, almost all of it in the 22 blocks' linear
layers. Quantising those weights to int8 lets onnxruntime use its integer MatMul kernels
(about 3.7x the fp32 MatMul throughput on the 2-core reference machine, issue 5) and cuts the
resident weights to a quarter.

How: ``onnxruntime.quantization.quantize_dynamic`` with ``per_channel=True``, int8 weights,
``op_types_to_quantize=["MatMul"]`` and ``MatMulConstBOnly`` (only MatMuls with a constant
weight; the attention products of two activations stay fp32), the same recipe the export's
model card gives for ``llm_int8.onnx`` ("dynamic int8 MatMul (per-channel)"). Activations are
quantised per tensor at run time (``DynamicQuantizeLinear``). Published effect of the same
change: nardi-xhepi/cosyvoice3-cpu reports 0.46 % waveform error for an int8 flow.

The quantised file is written once, atomically (temporary name + ``os.replace``), named after
the source file's size and mtime so a replaced source is re-quantised, and reused afterwards.
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

from .errors import ModelFilesMissing, ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "wyoming-cosyvoice3"
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


def _lock_for(path: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(path, threading.Lock())


def quantize_estimator(source: Path, target: Path) -> None:
    """Write the dynamic int8 (per-channel, MatMul-only) version of ``source`` to ``target``.

    Runs in the calling process (the child process of :func:`ensure_int8_estimator`).
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(source),
        str(target),
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        reduce_range=False,
        weight_type=QuantType.QInt8,
        extra_options={"MatMulConstBOnly": True},
    )


def ensure_int8_estimator(source: Path, cache_dir: Path, *, in_process: bool = False) -> Path:
    """Path of the int8 estimator for ``source``, quantising it first if not cached yet.

    Args:
        source: the fp32 estimator file.
        cache_dir: directory of derived files (:func:`derived_files_dir`).
        in_process: quantise in this process instead of a child process (tests, tools).

    Returns:
        ``cache_dir / "flow.decoder.estimator.int8-<size>-<mtime_ns>.onnx"``.

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: quantisation failed (the message holds the quantiser's last output).
    """
    source = Path(source)
    if not source.is_file():
        raise ModelFilesMissing(str(source.parent), [source.name])
    target = Path(cache_dir) / keyed_name(source, "int8", ".onnx")
    with _lock_for(target):
        if target.is_file():
            return target
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
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(
                f"quantising {source} to int8 failed: {exc}; use flow_precision 'fp32' or "
                "re-download the estimator"
            ) from exc
        remove_stale(target.parent, f"{target.name.split('.int8-')[0]}.int8-*.onnx", target)
        logger.info("int8 estimator ready in %.1f s", time.perf_counter() - started)
        return target


def _quantize_in_child(source: Path, target: Path) -> None:
    package_root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(package_root), env.get("PYTHONPATH", "")) if p
    )
    cmd = [sys.executable, "-m", __name__, str(source), str(target)]
    try:
        proc = subprocess.run(  # argv: this interpreter and module
            cmd, capture_output=True, text=True, timeout=QUANTIZE_TIMEOUT_S, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"cannot run the int8 quantiser: {exc}") from exc
    if proc.returncode != 0 or not target.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        raise ModelLoadError(
            f"the int8 quantiser exited with {proc.returncode}: {' | '.join(tail)}; use "
            "flow_precision 'fp32' or re-download flow.decoder.estimator.fp32.onnx"
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m wyoming_cosyvoice3.engine.quantize SOURCE TARGET`` (used by the engine)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m wyoming_cosyvoice3.engine.quantize SOURCE TARGET", file=sys.stderr)
        return 2
    quantize_estimator(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
