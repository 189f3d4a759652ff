"""Text embedding served from a memory-mapped table instead of an onnxruntime session.

``text_embedding_fp16.onnx`` holds the Qwen2 token table (151936 x 896, fp16: 272 MB) and, in
the export and the synthetic builder alike, does nothing but ``Gather`` rows and ``Cast`` them
to float32. A session keeps the whole table resident although a request reads a few dozen rows.
Here the table is extracted once to ``.npy`` (atomically, named after the source's size and
mtime, next to the other derived files) and opened with ``numpy.load(mmap_mode="r")``: only the
pages of rows actually used are read, and the kernel may drop them again under memory pressure.

Exactness: the graph is accepted only when it is exactly ``Gather(table, input_ids, axis=0)``
optionally followed by ``Cast(to=FLOAT)``; at extraction the host lookup is compared bit for bit
with the graph's output on sample ids (first, last and random rows). Any other graph is served
by its onnxruntime session as before.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np

from ...embedding import TableEmbedding
from ...errors import ModelLoadError
from ...sessions import GraphSpec
from ..common.files import keyed_name, remove_stale, replace_atomically, run_child

logger = logging.getLogger(__name__)

_CHECK_IDS = 256
_extract_lock = threading.Lock()


def plain_gather_table(model: object) -> tuple[np.ndarray, str] | None:
    """``(table, output dtype)`` when ``model`` (onnx.ModelProto) is a plain Gather [+ Cast].

    The graph must have one input ``input_ids``, one output ``inputs_embeds``, one 2-D
    initializer, a ``Gather`` on axis 0 of that initializer by ``input_ids`` and at most one
    ``Cast`` to float32 after it; anything else returns None.
    """
    import onnx
    from onnx import numpy_helper

    if not isinstance(model, onnx.ModelProto):
        return None
    g = model.graph
    if len(g.input) != 1 or len(g.output) != 1 or len(g.initializer) != 1:
        return None
    if g.input[0].name != "input_ids" or g.output[0].name != "inputs_embeds":
        return None
    init = g.initializer[0]
    nodes = list(g.node)
    if not nodes or nodes[0].op_type != "Gather" or len(nodes) > 2:
        return None
    gather = nodes[0]
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    if list(gather.input) != [init.name, "input_ids"] or axis != 0 or len(init.dims) != 2:
        return None
    table = numpy_helper.to_array(init)
    if len(nodes) == 1:
        return (table, str(table.dtype)) if gather.output[0] == "inputs_embeds" else None
    cast = nodes[1]
    to = next((a.i for a in cast.attribute if a.name == "to"), None)
    if (
        cast.op_type != "Cast"
        or list(cast.input) != [gather.output[0]]
        or list(cast.output) != ["inputs_embeds"]
        or to != onnx.TensorProto.FLOAT
    ):
        return None
    return table, "float32"


def _matches_session(source: Path, table: np.ndarray, out_dtype: str) -> bool:
    """Compare the host lookup with the graph's own output on sample ids (bit for bit)."""
    import onnxruntime as ort

    rows = table.shape[0]
    rng = np.random.default_rng(0)
    ids = np.concatenate([[0, rows - 1], rng.integers(0, rows, _CHECK_IDS)]).astype(np.int64)
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    expected = session.run(["inputs_embeds"], {"input_ids": ids[None, :]})[0]
    got = np.asarray(table[ids], dtype=out_dtype)[None]
    return expected.dtype == got.dtype and np.array_equal(expected, got)


def load_table_embedding(
    source: Path, spec: GraphSpec, cache_dir: Path, *, in_process: bool = False
) -> TableEmbedding | None:
    """A :class:`TableEmbedding` for ``source``, extracting its table once; None when the
    graph is not a plain lookup (then load the graph with onnxruntime instead).

    The extraction runs in a child process (:mod:`..child`) unless ``in_process``: parsing the
    published 272 MB graph with ``onnx.load`` holds Python's global lock for seconds, which
    would stall every other thread of a serving process (the server's ``describe`` answers).

    Raises:
        OSError: the cache directory is not writable (callers fall back to the graph).
        ModelLoadError: the table does not reproduce the graph's output, or the child failed
            (callers fall back to the graph).
    """
    source = Path(source)
    target = Path(cache_dir) / keyed_name(source, "table", ".npy")
    meta = target.with_suffix(".dtype")
    with _extract_lock:
        cached = target.is_file() and meta.is_file()
        if not cached:
            if in_process:
                extract_table(source, target, meta)
            else:
                run_child(["table", str(source), str(target), str(meta)])
            if not (target.is_file() and meta.is_file()):
                return None  # not a plain lookup
        out_dtype = meta.read_text(encoding="utf-8").strip()
        table = np.load(target, mmap_mode="r")
    logger.debug("%s served from the memory-mapped table %s", source.name, target)
    return TableEmbedding(source, spec, table, out_dtype)


def extract_table(source: Path, target: Path, meta: Path) -> bool:
    """Write ``source``'s table to ``target`` (.npy) and its output dtype to ``meta``; False
    (nothing written) when the graph is not a plain Gather lookup.

    Raises:
        ModelLoadError: the extracted table does not reproduce the graph's output bit for bit.
    """
    import onnx

    started = time.perf_counter()
    found = plain_gather_table(onnx.load(str(source)))
    if found is None:
        logger.debug("%s is not a plain Gather graph; served by onnxruntime", source.name)
        return False
    table, out_dtype = found
    if not _matches_session(source, table, out_dtype):
        raise ModelLoadError(f"{source.name}: the extracted table differs from the graph's output")
    tmp = target.with_name(f".{target.name}.tmp.npy")
    np.save(tmp, np.ascontiguousarray(table))
    replace_atomically(tmp, target)
    meta_tmp = meta.with_name(f".{meta.name}.tmp")
    meta_tmp.write_text(out_dtype + "\n", encoding="utf-8")
    replace_atomically(meta_tmp, meta)
    stem = target.name.split(".table-")[0]
    remove_stale(target.parent, f"{stem}.table-*.npy", target)
    remove_stale(target.parent, f"{stem}.table-*.dtype", meta)
    logger.info(
        "extracted the %s table %s to %s in %.1f s",
        out_dtype,
        tuple(table.shape),
        target,
        time.perf_counter() - started,
    )
    return True
