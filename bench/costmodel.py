"""Fitted cost models of the contract graphs: operations per run from the run's input shapes.

Each graph belongs to a :class:`Family` that names its size variables (LLM: new positions S
and total positions T; DiT estimator: batch B and mel frames F; HiFT: mel frames F; ...) and a
polynomial basis in them (attention makes the LLM cost bilinear in S and T and the DiT cost
quadratic in F). :func:`fit_cost_model` counts the graph (:func:`.flops.count_ops`) at a few
sizes, solves for the coefficients and checks them exactly at further sizes, so a benchmark
with thousands of graph runs needs only a handful of shape inferences. :func:`load_cost_models`
caches the fits per model file (name, size, modification time).

The streamed vocoder (``hift.stream*``, engine/derive/vocoder/hift_stream.py) runs each mel
frame once, with the context its convolutions need carried as state inputs and outputs; how
far a call pads depends on the values of its ``stream_first``/``stream_final`` inputs, which
shape inference cannot see unless they are constants. :func:`fit_streamed_vocoder` counts the
graph itself with those flags fixed: a first call (states empty), middle calls with the states
a middle call keeps (found by inferring the state outputs until they repeat) at a few frame
counts, and a final call. Its cost per call is ``k + c F`` (F new frames; ``c`` is hift.onnx's
cost per frame, ``k`` the one zero frame the f0 path's convolutions get per call,
engine/derive/vocoder/hift_exact.py) plus, on an utterance's first call (all states empty),
what its first and final calls do more than middle calls (the paddings), so an utterance's
calls add up to what the graph does for it. A recorded run does not say which call was final;
the first is the one whose states are all empty.

:func:`stage_of` sorts graph runs into the stages the engine times (LLM prefill and decoding,
flow, vocoder), for the per-stage minimum (:mod:`.stats`) and ``--preset auto``'s cost table
(:mod:`.machine_table`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from .flops import (
    FlopCountError,
    OpCount,
    StrippedGraph,
    count_ops,
    count_ops_and_outputs,
    load_stripped,
)

_LOGGER = logging.getLogger(__name__)


DimRule = Callable[[int, str, int, Mapping[str, int]], "int | None"]


@dataclass(frozen=True)
class Family:
    """How a graph's cost depends on its inputs.

    Attributes:
        name: family id.
        extract: observed input shapes (spec names) -> size variables.
        dim: (input index, input name, axis, variables) -> size, or None for "declared or 1".
        basis: variables -> basis values; the cost is a linear combination of them.
        points: variable values used to fit (the first ``len(basis)``) and check (the rest).
    """

    name: str
    extract: Callable[[Mapping[str, Sequence[int]]], dict[str, int]]
    dim: DimRule
    basis: Callable[[Mapping[str, int]], tuple[float, ...]]
    points: tuple[dict[str, int], ...]


def _poly(var: str) -> Callable[[Mapping[str, int]], tuple[float, ...]]:
    return lambda v: (1.0, float(v[var]), float(v[var]) ** 2)


def _llm_dim(_i: int, name: str, axis: int, v: Mapping[str, int]) -> int | None:
    if name in ("inputs_embeds", "position_ids") and axis == 1:
        return v["S"]
    if name == "attention_mask" and axis == 1:
        return v["T"]
    if fnmatch.fnmatch(name, "past_key_values.*") and axis == 2:
        return v["T"] - v["S"]
    return None


def _estimator_dim(_i: int, name: str, axis: int, v: Mapping[str, int]) -> int | None:
    if axis == 0:
        return v["B"]
    if name in ("x", "mask", "mu", "cond") and axis == 2:
        return v["F"]
    return None


def _stream_dim(_i: int, name: str, axis: int, v: Mapping[str, int]) -> int | None:
    """The derived streaming DiT (engine/derive/flow/streaming_graph.py): F new frames attending
    to M cached ones (all given as prompt cache; the history inputs have 0 frames). Graphs
    derived before the fused attention (``stream1``, still run by older trees a benchmark
    compares against) take ``kv_prompt_<i>``/``kv_hist_<i>`` [M, 2, B, inner]."""
    if name in ("x", "mu", "cond"):
        return v["B"] if axis == 0 else v["F"] if axis == 2 else None
    if name in ("spks", "conv1_past", "conv2_past") and axis == 0:
        return v["B"]
    if name in ("rope_cos", "rope_sin") and axis == 0:
        return v["F"]
    if name == "attn_bias" and axis >= 2:
        return v["F"] if axis == 2 else v["M"] + v["F"]
    if name.startswith(("prompt_key_", "prompt_value_", "hist_key_", "hist_value_")):
        if axis == 2:
            return v["M"] if name.startswith("prompt_") else 0
        return v["B"] if axis == 0 else None
    if name.startswith(("kv_prompt_", "kv_hist_")):  # graphs before the fused attention
        if axis == 0:
            return v["M"] if name.startswith("kv_prompt_") else 0
        return v["B"] if axis == 2 else None
    return None


STREAM_STATE_PREFIX = "stream_state_in."
"""State inputs of the streamed vocoder (engine/derive/vocoder/hift_stream.py ``STATE_IN``)."""


def _hift_stream_vars(s: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """New mel frames F of a streamed vocoder run, and first = 1 on an utterance's first call
    (every state input empty: each starts with time length 0 and is never empty again)."""
    states = [shape for name, shape in s.items() if name.startswith(STREAM_STATE_PREFIX)]
    first = bool(states) and all(0 in shape for shape in states)
    return {"F": int(s["speech_feat"][2]), "first": int(first)}


def _stream_vars(s: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """B, F, M of a recorded run (M: the cached frames; runs recorded before the fused
    attention graph name them ``kv_prompt_0``/``kv_hist_0`` [M, 2, B, inner])."""
    if "prompt_key_0" in s:
        cached = int(s["prompt_key_0"][2]) + int(s.get("hist_key_0", [0, 0, 0])[2])
    else:
        cached = int(s.get("kv_prompt_0", [0])[0]) + int(s.get("kv_hist_0", [0])[0])
    return {"B": s["x"][0], "F": s["x"][2], "M": cached}


FAMILIES: dict[str, Family] = {
    "llm": Family(
        "llm",
        lambda s: {"S": s["inputs_embeds"][1], "T": s["attention_mask"][1]},
        _llm_dim,
        lambda v: (1.0, float(v["S"]), float(v["S"] * v["T"])),
        ({"S": 1, "T": 16}, {"S": 1, "T": 64}, {"S": 8, "T": 8}, {"S": 8, "T": 40},
         {"S": 16, "T": 16}),
    ),
    "estimator": Family(
        "estimator",
        lambda s: {"B": s["x"][0], "F": s["x"][2]},
        _estimator_dim,
        lambda v: (float(v["B"]), float(v["B"] * v["F"]), float(v["B"] * v["F"] ** 2)),
        ({"B": 2, "F": 32}, {"B": 2, "F": 64}, {"B": 2, "F": 96}, {"B": 2, "F": 128}),
    ),
    "stream_estimator": Family(
        "stream_estimator",
        _stream_vars,
        _stream_dim,
        lambda v: (float(v["B"]), float(v["B"] * v["F"]), float(v["B"] * v["F"] ** 2),
                   float(v["B"] * v["F"] * v["M"])),
        ({"B": 2, "F": 32, "M": 16}, {"B": 2, "F": 64, "M": 16}, {"B": 2, "F": 32, "M": 64},
         {"B": 2, "F": 96, "M": 48}, {"B": 2, "F": 64, "M": 80}, {"B": 2, "F": 128, "M": 32}),
    ),
    "flow_encoder": Family(
        "flow_encoder",
        lambda s: {"N": s["token"][1]},
        lambda _i, name, axis, v: v["N"] if name == "token" and axis == 1 else None,
        _poly("N"),
        ({"N": 16}, {"N": 32}, {"N": 48}, {"N": 64}),
    ),
    "hift": Family(
        "hift",
        lambda s: {"F": s["speech_feat"][2]},
        lambda _i, name, axis, v: (
            v["F"] if name == "speech_feat" and axis == 2
            else 480 * v["F"] if name == "noise" and axis == 1 else None
        ),
        _poly("F"),
        ({"F": 16}, {"F": 32}, {"F": 48}, {"F": 64}),
    ),
    # the DiT's time conditioning (streaming form; the retired split form in older
    # recordings): t [B] -> the AdaLN modulation
    "dit_time": Family(
        "dit_time",
        lambda s: {"B": s["t"][0]},
        lambda _i, name, axis, v: v["B"] if name == "t" and axis == 0 else None,
        lambda v: (1.0, float(v["B"])),
        ({"B": 1}, {"B": 2}, {"B": 3}, {"B": 4}),
    ),
    # fitted by fit_streamed_vocoder (module doc)
    "hift_stream": Family(
        "hift_stream",
        _hift_stream_vars,
        lambda _i, name, axis, v: (
            v["F"] if name == "speech_feat" and axis == 2
            else 480 * v["F"] if name == "noise" and axis == 1 else None
        ),
        lambda v: (1.0, float(v["first"]), float(v["F"])),
        ({"F": 16}, {"F": 32}, {"F": 48}),
    ),
    "campplus": Family(
        "campplus",
        lambda s: {"T": next(iter(s.values()))[1]},
        lambda i, _n, axis, v: v["T"] if i == 0 and axis == 1 else None,
        _poly("T"),
        ({"T": 128}, {"T": 256}, {"T": 384}, {"T": 512}),
    ),
    "speech_tokenizer": Family(
        "speech_tokenizer",
        lambda s: {"T": next(iter(s.values()))[2]},
        lambda i, _n, axis, v: v["T"] if i == 0 and axis == 2 else None,
        _poly("T"),
        ({"T": 128}, {"T": 256}, {"T": 384}, {"T": 512}),
    ),
}


TIME_GRAPHS = ("flow.decoder.estimator.time", "flow.decoder.estimator.stream1time",
               "flow.decoder.estimator.stream2time")
"""The DiT's time-conditioning graphs (engine/derive/flow/streaming_estimator.py; the first two
names are retired forms', kept to read older recordings and baselines): run once per Euler time
value when the model loads or warms up, their outputs cached; no request runs them."""


def family_of(graph_file: str) -> Family | None:
    """The family of a contract file name (derived estimator files, the DiT's
    time-conditioning graphs and the streamed vocoder included); None for lookup-only graphs
    (the embeddings: no operation the benchmark counts)."""
    if graph_file.startswith("llm"):
        return FAMILIES["llm"]
    if graph_file.startswith(TIME_GRAPHS):
        return FAMILIES["dit_time"]
    if graph_file.startswith("flow.decoder.estimator.stream"):
        return FAMILIES["stream_estimator"]
    if graph_file.startswith("flow.decoder.estimator"):
        return FAMILIES["estimator"]
    if graph_file.startswith("hift.stream"):
        return FAMILIES["hift_stream"]
    for key in ("flow_encoder", "hift", "campplus", "speech_tokenizer"):
        if graph_file.startswith(key):
            return FAMILIES[key]
    return None


STAGES = ("llm_prefill", "llm_decode", "flow", "vocoder")
"""The stages the engine times (``StageTimes``: ``llm_prefill_s``, ``llm_decode_s``,
``flow_s``, ``vocoder_s``) that graph runs fall into (:func:`stage_of`)."""


def stage_of(graph_file: str, shapes: Mapping[str, Sequence[int]]) -> str | None:
    """The stage a graph run belongs to (None: embeddings, the DiT's time conditioning,
    voice encoders)."""
    if graph_file.startswith("llm"):
        return "llm_decode" if int(shapes["inputs_embeds"][1]) == 1 else "llm_prefill"
    if graph_file.startswith(TIME_GRAPHS):
        return None
    if graph_file.startswith(("flow_encoder", "flow.decoder.estimator")):
        return "flow"
    if graph_file.startswith("hift"):
        return "vocoder"
    return None


def concrete_dims(model: Any, family: Family, variables: Mapping[str, int]) -> dict[str, list[int]]:
    """Input name -> shape of ``model`` for ``variables`` under ``family``'s rules."""
    result: dict[str, list[int]] = {}
    for index, inp in enumerate(model.graph.input):
        dims = []
        for axis, dim in enumerate(inp.type.tensor_type.shape.dim):
            ruled = family.dim(index, inp.name, axis, variables)
            declared = int(dim.dim_value) if dim.HasField("dim_value") else None
            if declared is not None and declared > 0 and (ruled is None or axis == 0):
                dims.append(declared)  # static dims (e.g. a fixed CFG batch) win
            else:
                dims.append(ruled if ruled is not None else 1)
        result[inp.name] = dims
    return result


@dataclass(frozen=True)
class CostModel:
    """Fitted cost of one graph file.

    Attributes:
        family: family name.
        fp32_coef / int8_coef: coefficients over the family basis.
        batch_static: the graph's static batch (estimator), else 0.
        weight_bytes_fp32 / weight_bytes_int8: weights read once per run.
    """

    family: str
    fp32_coef: tuple[float, ...]
    int8_coef: tuple[float, ...]
    batch_static: int
    weight_bytes_fp32: int
    weight_bytes_int8: int

    def ops(self, observed: Mapping[str, Sequence[int]]) -> OpCount:
        """Operations of a run with these observed input shapes (spec names)."""
        family = FAMILIES[self.family]
        variables = family.extract(observed)
        if self.batch_static and "B" in variables:
            variables = {**variables, "B": self.batch_static}  # a static batch is always run
        basis = np.array(family.basis(variables))
        return OpCount(float(basis @ np.array(self.fp32_coef)),
                       float(basis @ np.array(self.int8_coef)))

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostModel:
        return cls(data["family"], tuple(data["fp32_coef"]), tuple(data["int8_coef"]),
                   int(data["batch_static"]), int(data["weight_bytes_fp32"]),
                   int(data["weight_bytes_int8"]))


def fit_cost_model(stripped: StrippedGraph, family: Family, rel_tol: float = 1e-6) -> CostModel:
    """Count ``stripped`` at the family's points and fit the basis coefficients.

    Raises:
        FlopCountError: counting failed, or the check points deviate by more than ``rel_tol``.
    """
    model = stripped.model
    batch_dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    batch_static = int(batch_dim.dim_value) if family.name == "estimator" else 0
    rows, fp32, int8 = [], [], []
    for point in family.points:
        if batch_static:
            point = {**point, "B": batch_static}
        count = count_ops(model, concrete_dims(model, family, point))
        rows.append(family.basis(point))
        fp32.append(count.fp32)
        int8.append(count.int8)
    n = len(rows[0])
    matrix = np.array(rows, dtype=np.float64)
    coefs = []
    for values in (fp32, int8):
        target = np.array(values, dtype=np.float64)
        coef = np.linalg.lstsq(matrix[:n], target[:n], rcond=None)[0]
        check = matrix[n:] @ coef
        scale = np.maximum(np.abs(target[n:]), 1.0)
        if np.any(np.abs(check - target[n:]) / scale > rel_tol):
            raise FlopCountError(
                f"{family.name}: operation counts are not a {family.name} polynomial "
                f"(fit {check.tolist()} vs counted {target[n:].tolist()})"
            )
        coefs.append(tuple(float(c) for c in coef))
    return CostModel(family.name, coefs[0], coefs[1], batch_static,
                     stripped.weight_bytes_fp32, stripped.weight_bytes_int8)


def derived_source(path: Path, beside: Iterable[Path]) -> Path | None:
    """The published graph a derived graph was made from, when the derivation's report
    (``<file>.json``, engine/derive/llm/fused.py) names it and it lies beside one of the
    ``beside`` graphs (the model directory). The fused LLM graph runs its source's matrix
    products with fused onnxruntime operators whose shapes onnx cannot infer, so its
    operations are counted on the source."""
    try:
        source = json.loads(Path(f"{path}.json").read_text(encoding="utf-8"))["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for other in beside:
        candidate = Path(other).parent / str(source)
        if candidate.is_file() and candidate != path:
            return candidate
    return None


STREAM_FLAGS = ("stream_first", "stream_final")
"""The streamed vocoder's call flags (engine/derive/vocoder/hift_stream.py)."""
STREAM_STATE_OUT = "stream_state_out."


def _flags_fixed(model: Any, first: int, final: int) -> Any:
    """A copy of ``model`` whose flag inputs are constants (shape inference then follows the
    paddings the call applies)."""
    import onnx
    from onnx import numpy_helper

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    inputs = [i for i in fixed.graph.input if i.name not in STREAM_FLAGS]
    del fixed.graph.input[:]
    fixed.graph.input.extend(inputs)
    fixed.graph.initializer.extend(
        numpy_helper.from_array(np.array([value], np.int64), name)
        for name, value in zip(STREAM_FLAGS, (first, final), strict=True))
    return fixed


def streamed_call(model: Any, first: int, final: int, frames: int,
                  states: Mapping[str, Sequence[int]]) -> tuple[OpCount, dict[str, list[int]]]:
    """Operations of one call of the streamed vocoder ``model`` (stripped) over ``frames``
    new mel frames with state inputs of shapes ``states``, and the shapes of the states it
    returns (keyed by the state input names of the next call).

    Raises:
        FlopCountError: not counted, or a returned state's shape stays unknown.
    """
    dims = concrete_dims(model, FAMILIES["hift_stream"], {"F": frames})
    dims.update({name: list(shape) for name, shape in states.items()})
    count, outputs = count_ops_and_outputs(_flags_fixed(model, first, final), dims)
    returned: dict[str, list[int]] = {}
    for name, shape in outputs.items():
        if name.startswith(STREAM_STATE_OUT):
            if not shape or any(d is None for d in shape):
                raise FlopCountError(f"shape of {name} unknown after inference: {shape}")
            returned[STREAM_STATE_PREFIX + name[len(STREAM_STATE_OUT):]] = [
                int(d) for d in shape if d is not None]
    return count, returned


def fit_streamed_vocoder(stripped: StrippedGraph, rel_tol: float = 1e-6,
                         max_settle: int = 4) -> CostModel:
    """Count the streamed vocoder itself (module doc): coefficients over (1, first, F).

    Raises:
        FlopCountError: a call cannot be counted, the states a middle call keeps do not
            settle within ``max_settle`` calls, or the middle calls' cost is not linear in F.
    """
    model = stripped.model
    family = FAMILIES["hift_stream"]
    empty = {}
    for inp in model.graph.input:
        if inp.name.startswith(STREAM_STATE_PREFIX):
            empty[inp.name] = [int(d.dim_value) if d.dim_value > 0 else 0
                               for d in inp.type.tensor_type.shape.dim]
    if not empty:
        raise FlopCountError("no stream_state_in inputs: not a streamed vocoder graph")
    probe = family.points[1]["F"]
    first, states = streamed_call(model, 1, 0, probe, empty)
    for _ in range(max_settle):
        middle, kept = streamed_call(model, 0, 0, probe, states)
        if kept == states:
            break
        states = kept
    else:
        raise FlopCountError(f"the streamed vocoder's states do not settle: {states}")
    counts = {probe: middle}
    for point in family.points:
        if point["F"] not in counts:
            counts[point["F"]] = streamed_call(model, 0, 0, point["F"], states)[0]
    final = streamed_call(model, 0, 1, probe, states)[0]
    frames = [point["F"] for point in family.points]
    coefs = []
    for kind in ("fp32", "int8"):
        values = [getattr(counts[f], kind) for f in frames]
        per_frame = (values[1] - values[0]) / (frames[1] - frames[0])
        fixed = values[0] - per_frame * frames[0]
        for f, value in zip(frames[2:], values[2:], strict=True):
            if abs(fixed + per_frame * f - value) > rel_tol * max(abs(value), 1.0):
                raise FlopCountError(f"streamed vocoder: {kind} cost of middle calls is not "
                                     f"linear in the frames {frames}: {values}")
        middle_probe = fixed + per_frame * probe
        edges = getattr(first, kind) + getattr(final, kind) - 2.0 * middle_probe
        coefs.append((fixed, edges, per_frame))
    return CostModel("hift_stream", coefs[0], coefs[1], 0, stripped.weight_bytes_fp32,
                     stripped.weight_bytes_int8)


_COUNT_ERRORS = (FlopCountError, OSError, ValueError, DecodeError)


def _fit_file(path: Path, family: Family, beside: Iterable[Path]) -> CostModel:
    """Fit ``path`` (the streamed vocoder: :func:`fit_streamed_vocoder`); a derived graph
    that cannot be counted is counted as its source (:func:`derived_source`). Raises one of
    ``_COUNT_ERRORS``."""
    if family.name == "hift_stream":
        return fit_streamed_vocoder(load_stripped(path))
    try:
        return fit_cost_model(load_stripped(path), family)
    except _COUNT_ERRORS:
        source = derived_source(path, beside)
        if source is None:
            raise
        _LOGGER.info("counting %s as its source %s", path.name, source.name)
        return fit_cost_model(load_stripped(source), family)


COUNT_VERSION = 2
"""Bumped when the counting changes, so that cached fits are made again (2: the streamed
vocoder counted, weights read through Slice nodes with Constant bounds counted)."""


def _file_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}:v{COUNT_VERSION}"


def load_cost_models(
    graph_paths: Mapping[str, Path], cache_file: Path | None = None
) -> dict[str, CostModel | str]:
    """Cost models of the graphs ``graph_paths`` (file name -> path), fits cached in
    ``cache_file``.

    Returns:
        file name -> :class:`CostModel`, or why there is none (lookup-only graphs such as the
        embeddings have no matrix products; a file that is gone; a failed count).
    """
    cache: dict[str, Any] = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cache = {}
    result: dict[str, CostModel | str] = {}
    for name, path in sorted(graph_paths.items()):
        family = family_of(name)
        if family is None:
            result[name] = "no cost model (lookup-only or per-time-step graph)"
            continue
        if not Path(path).is_file():
            # a derived file (int8 estimator) may be gone by now; its count was cached
            cached = [v for k, v in cache.items() if k.split(":", 1)[0] == name]
            result[name] = (CostModel.from_json(cached[-1]) if cached
                            else f"{path} not found")
            continue
        key = _file_key(Path(path))
        if key in cache:
            result[name] = CostModel.from_json(cache[key])
            continue
        _LOGGER.info("counting operations of %s", name)
        try:
            model = _fit_file(Path(path), family, graph_paths.values())
        except _COUNT_ERRORS as err:
            result[name] = f"not counted: {err}"
            continue
        result[name] = model
        cache[key] = model.to_json()
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cache, indent=1), encoding="utf-8")
    return result
