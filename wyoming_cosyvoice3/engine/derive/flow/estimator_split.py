"""Split the DiT estimator into its time-conditioning part and its per-frame part.

In the CosyVoice3 DiT (cosyvoice/flow/DiT/dit.py ``DiT``, F5-TTS style) the time ``t`` enters
through ``TimestepEmbedding`` and every block's ``AdaLayerNormZero`` (``linear(silu(t_emb))``
chunked into shift/scale/gate), plus ``AdaLayerNormZero_Final``: computations that depend on
``t`` and the weights only. Those modulation layers hold ~138 M of the estimator's ~331 M
parameters (0.55 GB in fp32) but cost nothing per mel frame; the graph still reads all their
weights in every Euler step and keeps them resident.

:func:`split_time_conditioning` cuts the graph at the boundary of that sub-graph (found by
dependency analysis from the input ``t``, so no node names are assumed): the "time" model maps
``t`` to the boundary tensors, the "main" model takes them as extra inputs. Same operators in
the same order, so the result equals the unsplit graph (up to onnxruntime fusing differently
across the cut; measured within float rounding). :class:`SplitEstimator` runs the time model
once per distinct ``t`` (a schedule has ``n`` of them) and caches its outputs (about 1 MB per
``t`` with the published dims), then releases it; per-frame work runs in the main model.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...graphs import ESTIMATOR, Graph, GraphSpec
from ..common.files import derive_once, run_child, weight_free_copy

logger = logging.getLogger(__name__)

TIME_INPUT = "t"
_CACHE_ENTRIES = 64


def split_time_conditioning(model: Any) -> tuple[Any, Any] | None:
    """``(main, time)`` onnx models from an estimator ``model``, or None when nothing depends
    on ``t`` alone (or the graph has sub-graphs, which are not analysed).

    ``time`` has the input ``t`` and one output per boundary tensor; ``main`` has the original
    inputs that are still used plus the boundary tensors as inputs, and the original outputs.
    """
    import onnx
    from onnx import helper

    if not isinstance(model, onnx.ModelProto):
        return None
    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in g.node for a in n.attribute):
        return None
    inputs = {i.name: i for i in g.input}
    if TIME_INPUT not in inputs:
        return None
    inits = {i.name: i for i in g.initializer}
    consts = set(inits)
    for node in g.node:
        if node.op_type == "Constant":
            consts.update(node.output)
    t_dep = {TIME_INPUT}
    time_nodes = []
    for node in g.node:
        ins = [i for i in node.input if i]
        if node.op_type != "Constant" and ins and any(i in t_dep for i in ins) and all(
            i in t_dep or i in consts for i in ins
        ):
            time_nodes.append(node)
            t_dep.update(node.output)
    if not time_nodes:
        return None
    time_ids = {id(n) for n in time_nodes}
    main_nodes = [n for n in g.node if id(n) not in time_ids]
    used_by_main = {i for n in main_nodes for i in n.input if i} | {o.name for o in g.output}
    boundary = [name for n in time_nodes for name in n.output if name in used_by_main]
    if not boundary:
        return None
    types = _value_types(model, boundary)
    if types is None:
        return None

    constant_nodes = {o: n for n in g.node if n.op_type == "Constant" for o in n.output}

    def needed_constants(nodes: list[Any]) -> list[Any]:
        names = {i for n in nodes for i in n.input if i in constant_nodes}
        return [constant_nodes[name] for name in sorted(names)]

    def initializers_for(nodes: list[Any]) -> list[Any]:
        names = {i for n in nodes for i in n.input if i in inits}
        return [inits[name] for name in sorted(names)]

    time_graph = helper.make_graph(
        needed_constants(time_nodes) + time_nodes,
        "estimator_time",
        [inputs[TIME_INPUT]],
        [helper.make_tensor_value_info(name, *types[name]) for name in boundary],
        initializers_for(time_nodes),
    )
    main_inputs = [i for i in g.input if i.name in used_by_main]
    main_inputs += [helper.make_tensor_value_info(name, *types[name]) for name in boundary]
    main_graph = helper.make_graph(
        main_nodes, "estimator_main", main_inputs, list(g.output), initializers_for(main_nodes)
    )
    opsets = list(model.opset_import)
    time_model = helper.make_model(time_graph, opset_imports=opsets)
    main_model = helper.make_model(main_graph, opset_imports=opsets)
    time_model.ir_version = main_model.ir_version = model.ir_version
    return main_model, time_model


def _value_types(model: Any, names: list[str]) -> dict[str, tuple[int, list[Any]]] | None:
    """(elem type, shape) of ``names`` by shape inference on a weight-free copy."""
    from onnx import shape_inference

    try:
        inferred = shape_inference.infer_shapes(weight_free_copy(model))
    except Exception as exc:  # onnx raises several types; do not split on doubt
        logger.warning("estimator shape inference failed (%s); not splitting", exc)
        return None
    found: dict[str, tuple[int, list[Any]]] = {}
    for v in inferred.graph.value_info:
        if v.name in names and v.type.tensor_type.elem_type:
            dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                    for d in v.type.tensor_type.shape.dim]
            found[v.name] = (v.type.tensor_type.elem_type, dims)
    return found if len(found) == len(names) else None


def derive_split(source: Path, precision: str, main_out: Path, time_out: Path) -> None:
    """Write the split estimator: ``time_out`` (fp32) and ``main_out`` (fp32, or int8 with
    :func:`~.quantize.quantize_estimator`'s recipe). Runs in a child process.

    Raises:
        ValueError: the graph cannot be split.
    """
    import onnx

    model = onnx.load(str(source))
    parts = split_time_conditioning(model)
    del model
    if parts is None:
        raise ValueError(f"{source.name}: no time-conditioning sub-graph found; not split")
    main, time_model = parts
    onnx.save(time_model, str(time_out))
    del time_model
    if precision == "fp32":
        onnx.save(main, str(main_out))
        return
    from .quantize import quantize_estimator

    plain = main_out.with_name(main_out.name + ".fp32.tmp")
    try:
        onnx.save(main, str(plain))
        del main
        quantize_estimator(plain, main_out)
    finally:
        plain.unlink(missing_ok=True)


def main_graph_spec(session: Any) -> GraphSpec:
    """Spec of a split main graph: the session's own float32 inputs, the contract output."""
    return GraphSpec(
        ESTIMATOR.file,
        {i.name: "float32" for i in session.get_inputs()},
        dict(ESTIMATOR.outputs),
    )


class SplitEstimator:
    """The estimator as two graphs, with the :class:`~.graphs.Graph` ``run`` interface.

    Args:
        main: the per-frame graph (inputs: the contract's minus unused ones, plus the
            boundary tensors).
        time_path: the time-conditioning graph file, loaded only while computing new ``t``.
        threads, providers, spin_wait: session options of the time graph.
    """

    def __init__(
        self,
        main: Graph,
        time_path: Path,
        threads: int = 0,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
        spin_wait: bool = True,
    ) -> None:
        self.main = main
        self.time_path = Path(time_path)
        self.spec: GraphSpec = ESTIMATOR
        self.path = main.path
        self._session_args = (threads, providers, spin_wait)
        self._main_inputs = {i.name for i in main.session.get_inputs()}
        self._cache: OrderedDict[bytes, dict[str, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self.time_runs = 0

    @property
    def session(self) -> Any:
        return self.main.session

    def input_shape(self, name: str) -> list[int | str | None]:
        """Declared shape of a contract input (``t``: [2])."""
        return [2] if name == TIME_INPUT else self.main.input_shape(name)

    def output_shape(self, name: str) -> list[int | str | None]:
        return self.main.output_shape(name)

    def conditioning(self, t: np.ndarray) -> dict[str, np.ndarray]:
        """Boundary tensors for ``t`` (float32 [batch]), from the cache or the time graph."""
        key = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            import onnxruntime as ort

            from ...graphs import open_session

            threads, providers, spin = self._session_args
            session: ort.InferenceSession = open_session(self.time_path, threads, providers, spin)
            names = [o.name for o in session.get_outputs()]
            values = session.run(names, {TIME_INPUT: np.asarray(t, dtype=np.float32)})
            del session  # 0.55 GB of modulation weights: not kept resident
            self.time_runs += 1
            out = {name: np.ascontiguousarray(v) for name, v in zip(names, values, strict=True)}
            self._cache[key] = out
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return out

    def precompute(self, t_values: list[np.ndarray]) -> None:
        """Fill the cache for several ``t`` arrays with one load of the time graph."""
        missing = [t for t in t_values if self._key(t) not in self._cache]
        if not missing:
            return
        import onnxruntime as ort

        from ...graphs import open_session, return_freed_memory

        threads, providers, spin = self._session_args
        with self._lock:
            session: ort.InferenceSession = open_session(self.time_path, threads, providers, spin)
            names = [o.name for o in session.get_outputs()]
            for t in missing:
                values = session.run(names, {TIME_INPUT: np.asarray(t, dtype=np.float32)})
                self._cache[self._key(t)] = {
                    n: np.ascontiguousarray(v) for n, v in zip(names, values, strict=True)
                }
            self.time_runs += 1
            del session
        return_freed_memory()  # the time graph's 0.55 GB of weights

    @staticmethod
    def _key(t: np.ndarray) -> bytes:
        return np.ascontiguousarray(t, dtype=np.float32).tobytes()

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the estimator: contract feeds in, ``{"estimator_out": ...}`` out."""
        main_feeds = {k: v for k, v in feeds.items() if k in self._main_inputs}
        main_feeds.update(self.conditioning(feeds[TIME_INPUT]))
        return self.main.run(main_feeds, output_names)

    def __repr__(self) -> str:
        return f"SplitEstimator({self.main.path.name!r}, time={self.time_path.name!r})"


SPLIT_TAGS = {"fp32": "main", "int8": "int8main"}
"""File tags of the split estimator's main graph per precision (time graph: ``time``)."""


def ensure_split_estimator(
    source: Path, cache_dir: Path, precision: str, *, in_process: bool = False
) -> tuple[Path, Path]:
    """(main graph, time graph) of the split estimator for ``precision`` ("fp32" or "int8"),
    derived once from ``source`` into ``cache_dir`` (:func:`~..common.files.derive_once`; the time
    graph, the same for both precisions, is shared).

    Raises:
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: splitting or quantising failed, now or in an earlier attempt (callers
            fall back to the whole graph).
    """

    def make(tmps: list[Path]) -> None:
        tmp_time, tmp_main = tmps
        if in_process:
            derive_split(source, precision, tmp_main, tmp_time)
        else:
            run_child(["split", precision, str(source), str(tmp_main), str(tmp_time)])

    time_graph, main = derive_once(
        source,
        cache_dir,
        [("time", ".onnx"), (SPLIT_TAGS[precision], ".onnx")],
        make,
        name="split estimator",
        what=f"splitting {source}",
        shared={"time"},
    )
    return main, time_graph
