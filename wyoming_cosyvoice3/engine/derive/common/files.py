"""Helpers shared by every derivation: where derived files live, how they are named, written
and guarded, and the child process that makes the large ones.

A derived file is named after its source file's size and mtime (:func:`keyed_name`), so a
replaced source is derived again; it is written once, atomically (temporary name +
``os.replace``); a failed attempt leaves ``<name>.failed`` with the reason so later starts do
not retry it (delete the marker to retry). Large derivations run in a child process
(:func:`run_child`, entry point :mod:`..child`): it holds the source graph and its derived copy
in memory (a few GB at the published size), which the serving process should never keep.
:func:`derive_once` is that whole sequence; each derivation module gives it only what to make
and how to tell a valid result.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ...errors import ModelFilesMissing, ModelLoadError

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "wyoming-cosyvoice3"
CHILD_TIMEOUT_S = 3600.0
"""Longest a derivation child process may run (the full-size int8 quantisation takes minutes)."""
CHILD_MODULE = "wyoming_cosyvoice3.engine.derive.child"
_KEEP_ELEMENTS = 4096
"""Initializers up to this size keep their data for shape inference (Reshape targets...)."""
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
    return f"{_stem(source)}.{tag}-{stat.st_size}-{stat.st_mtime_ns}{suffix}"


def _stem(source: Path) -> str:
    return source.name.removesuffix(".onnx").removesuffix(".fp32")


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


def remove_orphans(final: Path) -> None:
    """Delete temporary files of ``final`` left by a process that no longer runs (killed while
    deriving: ``.<name>.<pid>.<thread>.tmp`` and the ``...tmp.<suffix>`` files made beside
    it). Files of running processes, this one included, are kept (best effort)."""
    prefix = f".{final.name}."
    for path in final.parent.glob(f"{prefix}*.tmp*"):
        pid_text = path.name[len(prefix) :].split(".", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # still running (perhaps another server on the same data dir)
        except ProcessLookupError:
            pass
        except OSError:  # e.g. PermissionError: a process of another user exists
            continue
        try:
            path.unlink()
            logger.info("removed %s, left by an interrupted derivation", path.name)
        except OSError as exc:
            logger.debug("cannot remove %s: %s", path, exc)


def failure_marker(target: Path) -> Path:
    """``<target>.failed``: written with the reason when deriving ``target`` failed."""
    return target.with_name(target.name + ".failed")


def check_failed_before(target: Path) -> None:
    """Raise at once when an earlier attempt for ``target`` failed (do not retry each start)."""
    marker = failure_marker(target)
    if marker.is_file():
        reason = marker.read_text(encoding="utf-8", errors="replace").strip()[:500]
        raise ModelLoadError(
            f"an earlier attempt to derive {target.name} failed ({reason}); delete {marker} "
            "to try again"
        )


def record_failure(target: Path, exc: BaseException) -> None:
    """Write ``exc`` to ``target``'s failure marker (best effort: a read-only cache only logs)."""
    try:
        failure_marker(target).write_text(f"{exc}\n", encoding="utf-8")
    except OSError as err:
        logger.debug("cannot write the failure marker for %s: %s", target, err)


def lock_for(path: Path) -> threading.Lock:
    """The lock serialising this process's derivations of ``path`` (one per path, kept)."""
    with _locks_guard:
        return _locks.setdefault(path, threading.Lock())


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


def run_child(args: list[str]) -> None:
    """Run one derivation in a child process (``python -m`` :mod:`..child` ``args``), waiting
    at most :data:`CHILD_TIMEOUT_S`; this process only waits (no GIL held, no weights in
    memory).

    Raises:
        ModelLoadError: the child could not start, timed out or exited non-zero (the message
            ends with its last line of output; the whole output is logged at debug level).
    """
    # the directory holding the wyoming_cosyvoice3 package (this file is
    # wyoming_cosyvoice3/engine/derive/common/files.py): the child imports this same tree
    package_root = Path(__file__).resolve().parents[4]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(package_root), env.get("PYTHONPATH", "")) if p
    )
    cmd = [sys.executable, "-m", CHILD_MODULE, *args]
    try:
        proc = subprocess.run(  # argv: this interpreter and module
            cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"cannot run the {args[0]} derivation process: {exc}") from exc
    if proc.returncode != 0:
        output = (proc.stderr or proc.stdout or "").strip()
        logger.debug("%s derivation process output:\n%s", args[0], output)
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        raise ModelLoadError(
            f"the {args[0]} derivation process exited with {proc.returncode}: "
            f"{lines[-1] if lines else 'no output'}"
        )


def validation_session(model: Any, optimize: bool = True) -> Any:
    """A quiet one-thread onnxruntime CPU session for checking a derivation.

    Args:
        model: a file path or an onnx.ModelProto (serialised here).
        optimize: False keeps the graph as written (e.g. ``DequantizeLinear`` of constant
            weights stays unfolded, so int8 weights stay int8 in memory).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # derived or rewritten graphs may leave unused initializers
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def read_report(path: Path, report_type: Callable[..., T], what: str) -> T | None:
    """The JSON report stored beside a derived file as ``report_type(**fields)``, or None
    (missing, unreadable, or written by an older recipe with other fields; logged at info
    level naming ``what``)."""
    try:
        return report_type(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        logger.info("the %s report %s cannot be used (%s)", what, path.name, exc)
        return None


def _all_present(paths: list[Path]) -> bool:
    return all(path.is_file() for path in paths)


def derive_once(
    source: Path,
    cache_dir: Path,
    files: Sequence[tuple[str, str]],
    make: Callable[[list[Path]], None],
    *,
    name: str,
    what: str | None = None,
    failure: str | None = None,
    valid: Callable[[list[Path]], bool] = _all_present,
    shared: Collection[str] = (),
    retired: Sequence[str] = (),
) -> list[Path]:
    """Paths of the files derived from ``source``, made by ``make`` only when no valid result
    is cached and no earlier attempt failed.

    The sequence, under a per-file lock (threads of this process): a valid earlier result
    (``valid``) is returned as it is; a ``<last>.failed`` marker raises at once; else ``make``
    writes every file under a temporary name (``.<file>.<pid>.<thread>.tmp``, same directory),
    each is renamed onto its final name in the order of ``files``, the last one (the *guard*,
    which also names the lock and the marker) last, so a crash half-way leaves no valid result
    and the next call derives again (first removing the temporary files the dead process
    left, :func:`remove_orphans`). On success the files of other sources' keys (and the
    ``retired`` ones) are removed; on failure the temporary files are removed and the marker
    records the reason. Nothing here warns: the caller falls back with its one warning.

    Args:
        source: the published file derived from (its size and mtime key the names).
        cache_dir: directory of derived files (:func:`derived_files_dir`).
        files: ``(tag, suffix)`` per file, in writing order, the guard last; the file is
            ``cache_dir / keyed_name(source, tag, suffix)``.
        make: writes the files to the temporary paths it is given (same order); in this
            process or through :func:`run_child`. Any exception it raises is a failure.
        name: what is made, for the log (``"streaming DiT"``: ``"<name> ready in 2.0 s"``).
        what: what is done, for the log (default ``"deriving the <name> from <source>"``).
        failure: prefix of the error message (default ``"<what> failed"``).
        valid: whether the files (final paths) hold a usable result (default: all exist).
        shared: tags of files that other derivations make identically (the streaming DiT's
            time graph, the same for both precisions): kept when already present, not replaced.
        retired: globs after ``"<stem>."`` of files an older recipe wrote (``"int8-*.onnx"``),
            removed after a success.

    Returns:
        The final paths, in the order of ``files``.

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: the derivation failed now (a ModelLoadError of ``make`` as it is,
            anything else wrapped as ``"<failure>: <error>"``) or in an earlier attempt
            (until the marker is deleted).
    """
    source = Path(source)
    if not source.is_file():
        raise ModelFilesMissing(str(source.parent), [source.name])
    cache_dir = Path(cache_dir)
    finals = [cache_dir / keyed_name(source, tag, suffix) for tag, suffix in files]
    guard = finals[-1]
    with lock_for(guard):
        for final in finals:
            remove_orphans(final)
        if valid(finals):
            return finals
        check_failed_before(guard)
        tmp_suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
        tmps = [path.with_name(f".{path.name}{tmp_suffix}") for path in finals]
        what = what or f"deriving the {name} from {source}"
        prefix = failure or f"{what} failed"
        started = time.perf_counter()
        logger.info("%s (once; writing %s)", what, guard)
        try:
            make(tmps)
            for (tag, _), tmp, final in zip(files, tmps, finals, strict=True):
                if tag in shared and final.is_file():
                    continue
                if not tmp.is_file():
                    raise ModelLoadError(f"{prefix}: no {final.name} was made")
                replace_atomically(tmp, final)
        except Exception as exc:  # derivation errors are not typed; always wrapped below
            record_failure(guard, exc)
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{prefix}: {exc}") from exc
        finally:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)
        for (tag, suffix), final in zip(files, finals, strict=True):
            remove_stale(cache_dir, f"{_stem(source)}.{tag}-*-*{suffix}", final)
        for pattern in retired:
            remove_stale(cache_dir, f"{_stem(source)}.{pattern}", guard)
        logger.info("%s ready in %.1f s", name, time.perf_counter() - started)
        return finals


def derive_reported(
    source: Path,
    cache_dir: Path,
    files: Sequence[tuple[str, str]],
    make: Callable[[list[Path]], None],
    report_type: Callable[..., T],
    *,
    report_index: int,
    name: str,
    failure: str | None = None,
    retired: Sequence[str] = (),
) -> tuple[list[Path], T]:
    """:func:`derive_once` for a derivation that stores a JSON report beside its graph: a
    cached result counts only when its report reads back as ``report_type``
    (:func:`read_report`; an older recipe's report makes it derive again).

    Args:
        source, cache_dir, files, make, name, failure, retired: as :func:`derive_once`.
        report_type: the report's dataclass.
        report_index: which of ``files`` is the report.

    Returns:
        The final paths (order of ``files``) and the report.

    Raises:
        ModelFilesMissing, ModelLoadError: as :func:`derive_once`; ModelLoadError also when
            the report cannot be read after the derivation (damaged by another process).
    """

    def valid(paths: list[Path]) -> bool:
        return _all_present(paths) and read_report(paths[report_index], report_type,
                                                   name) is not None

    finals = derive_once(source, cache_dir, files, make, name=name, failure=failure,
                         valid=valid, retired=retired)
    report = read_report(finals[report_index], report_type, name)
    if report is None:
        raise ModelLoadError(f"the report {finals[report_index]} is unreadable")
    return finals, report
