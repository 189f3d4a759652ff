"""The onnxruntime graphs the engine runs: one checked session per ONNX graph of the model
directory, the runner of the derived chunk-causal streaming DiT, and returning freed heap.

Every graph of the contract (spec section 1, the export's model card) has a :class:`GraphSpec`
naming the inputs and outputs it must have and their dtypes. :class:`Graph` loads the file with
explicit ``SessionOptions``, compares the session's signature with the spec and raises a typed
error naming the file, the expected and the found signature and how to fix it.

Two upstream graphs (campplus.onnx, speech_tokenizer_v3.onnx) are fed *by position* by
upstream frontend.py (``session.get_inputs()[0].name``), so their names are not a published
contract. Their specs set ``by_position``: only the number and dtypes of inputs are checked,
and :meth:`Graph.run` maps the spec's names onto the session's names in order.

Dropping a session frees its weights but not the process's resident memory;
:func:`return_freed_memory` gives the freed heap back.

The chunk-causal streaming DiT at run time (last section: the static chunk mask, the rotary
tables and :class:`StreamingEstimator`, the runner of the derived graph): the flow stage runs it
(:mod:`.flow.solver`) and the derivation (:mod:`.derive.flow.streaming_estimator`) runs it to
validate the graphs it makes; stages never import each other, so it lives outside both. The
chunk mask is upstream's, as an additive attention bias: cosyvoice/flow/DiT/dit.py
``DiT.forward(streaming=True)`` builds
``add_optional_chunk_mask(x, mask, False, False, 0, static_chunk_size=50, -1)``
(cosyvoice/utils/mask.py ``subsequent_chunk_mask``): mel frame i may attend to frame j iff
``j < (i // 50 + 1) * 50``, chunks counted from frame 0 of the prompt, every left chunk kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from .errors import GraphSignatureMismatch, ModelFilesMissing, ModelLoadError, SynthesisFailed

log = logging.getLogger(__name__)

ORT_ERRORS: tuple[type[BaseException], ...] = (
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.InvalidGraph,
    ort_state.InvalidProtobuf,
    ort_state.NoSuchFile,
    ort_state.NoModel,
    ort_state.NotImplemented,
    ort_state.RuntimeException,
    ort_state.EPFail,
    RuntimeError,
    OSError,
    ValueError,
)
"""Exceptions onnxruntime raises while loading or running a session."""

ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}

CPU_PROVIDER = "CPUExecutionProvider"

RunObserver = Callable[[str, Mapping[str, np.ndarray], float, float], None]
"""Called after each :meth:`Graph.run`: (path of the file the session runs, feeds, start and end
in ``time.time()`` seconds). The path can differ from the spec's file (a derived int8 copy)."""
_run_observer: RunObserver | None = None


def set_run_observer(observer: RunObserver | None) -> None:
    """Install (or remove, None) the process-wide run observer; benchmark use only
    (:class:`.options.EngineObserver`). Unset, a run costs one ``is None`` test more."""
    global _run_observer
    _run_observer = observer
LLM_FILES_BY_PRECISION = {"fp32": "llm.onnx", "int8": "llm_int8.onnx", "q4": "llm_q4.onnx"}


@dataclass(frozen=True)
class GraphSpec:
    """Required signature of one graph file.

    Attributes:
        file: file name inside the model directory.
        inputs: input name -> numpy dtype name ("int64", "int32", "float32"); alternatives
            are written "int32|int64".
        outputs: output name -> dtype, as for inputs. Extra outputs of the file are ignored.
        by_position: check input/output count and dtypes in order, not names (for the
            upstream graphs that upstream feeds by position).
    """

    file: str
    inputs: dict[str, str]
    outputs: dict[str, str]
    by_position: bool = False


TEXT_EMBEDDING = GraphSpec(
    "text_embedding_fp16.onnx", {"input_ids": "int64"}, {"inputs_embeds": "float32"}
)
SPEECH_EMBEDDING = GraphSpec(
    "speech_embedding.onnx", {"input_ids": "int64"}, {"inputs_embeds": "float32"}
)
FLOW_ENCODER = GraphSpec(
    "flow_encoder.onnx",
    {"token": "int64", "embedding": "float32"},
    {"mu": "float32", "spks": "float32"},
)
ESTIMATOR = GraphSpec(
    "flow.decoder.estimator.fp32.onnx",
    {name: "float32" for name in ("x", "mask", "mu", "t", "spks", "cond")},
    {"estimator_out": "float32"},
)
"""Upstream export_onnx.py: inputs (x, mask, mu, t, spks, cond), output ``estimator_out``."""
HIFT = GraphSpec(
    "hift.onnx",
    {"speech_feat": "float32", "noise": "float32"},
    {"magnitude": "float32", "phase": "float32"},
)
CAMPPLUS = GraphSpec("campplus.onnx", {"input": "float32"}, {"output": "float32"}, True)
SPEECH_TOKENIZER = GraphSpec(
    "speech_tokenizer_v3.onnx",
    {"feats": "float32", "feats_length": "int32"},
    {"indices": "int32|int64"},
    True,
)


def llm_spec(file: str, num_layers: int) -> GraphSpec:
    """Spec of an LLM graph with ``num_layers`` layers of KV cache (model card)."""
    inputs = {"inputs_embeds": "float32", "attention_mask": "int64", "position_ids": "int64"}
    outputs = {"logits": "float32"}
    for layer in range(num_layers):
        for kind in ("key", "value"):
            inputs[f"past_key_values.{layer}.{kind}"] = "float32"
            outputs[f"present.{layer}.{kind}"] = "float32"
    return GraphSpec(file, inputs, outputs)


def count_llm_layers(input_names: list[str]) -> int:
    """Number of ``past_key_values.<i>.key`` inputs."""
    return sum(
        1 for name in input_names if name.startswith("past_key_values.") and name.endswith(".key")
    )


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, a container's cpuset), at
    least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def session_options(threads: int, spin_wait: bool = True,
                    memory_arena: bool = True) -> ort.SessionOptions:
    """SessionOptions used for every graph: all graph optimisations, sequential execution,
    ``threads`` intra-op threads (0 = onnxruntime's choice), one inter-op thread; idle worker
    threads spin before sleeping unless ``spin_wait`` is False
    (``session.intra_op.allow_spinning``, see ``EngineOptions.spin_wait``). ``memory_arena``
    False: intermediate tensors are freed after each run instead of kept in onnxruntime's
    CPU arena (``enable_cpu_mem_arena``), for graphs whose largest run is a one-off."""
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = memory_arena
    if not spin_wait:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = max(0, int(threads))
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def resolve_providers(requested: tuple[str, ...]) -> list[str]:
    """Available providers from ``requested`` in order, with the CPU provider appended."""
    available = set(ort.get_available_providers())
    chosen = [p for p in requested if p in available]
    missing = [p for p in requested if p not in available]
    if missing:
        log.warning("execution providers not available, skipped: %s", ", ".join(missing))
    if CPU_PROVIDER not in chosen:
        chosen.append(CPU_PROVIDER)
    return chosen


def open_session(
    path: Path, threads: int, providers: tuple[str, ...], spin_wait: bool = True,
    memory_arena: bool = True,
) -> ort.InferenceSession:
    """Load ``path`` into an InferenceSession (:func:`session_options`).

    Raises:
        ModelFilesMissing: the file does not exist.
        ModelLoadError: onnxruntime cannot load it (corrupt, truncated, external data missing).
    """
    if not path.is_file():
        raise ModelFilesMissing(str(path.parent), [path.name])
    try:
        return ort.InferenceSession(
            str(path),
            sess_options=session_options(threads, spin_wait, memory_arena),
            providers=resolve_providers(providers),
        )
    except ORT_ERRORS as exc:
        raise ModelLoadError(
            f"cannot load {path.name} from {path.parent}: {exc}. The file is corrupt or "
            "truncated (or its .data file is missing): delete it and download it again"
        ) from exc


def _signature(args: list[ort.NodeArg]) -> dict[str, str]:
    return {arg.name: ORT_DTYPES.get(arg.type, arg.type) for arg in args}


def _dtype_ok(expected: str, found: str) -> bool:
    return found in expected.split("|")


def signature_mismatch(
    spec: GraphSpec, path: Path, session: ort.InferenceSession, problem: str
) -> GraphSignatureMismatch:
    """Build the error for a graph whose signature differs from ``spec``."""
    found_in = _signature(session.get_inputs())
    found_out = _signature(session.get_outputs())
    return GraphSignatureMismatch(
        f"{spec.file} ({path}) does not match the CosyVoice3 graph contract: {problem}. "
        f"Expected inputs {spec.inputs}, outputs {spec.outputs}; found inputs {found_in}, "
        f"outputs {found_out}. Fix: re-download the file (Masterx/Fun-CosyVoice3-0.5B-2512-ONNX; "
        "campplus, speech_tokenizer_v3 and flow.decoder.estimator.fp32 from "
        "FunAudioLLM/Fun-CosyVoice3-0.5B-2512)"
    )


class Graph:
    """A loaded, signature-checked ONNX graph.

    Attributes:
        path: the graph file.
        spec: its :class:`GraphSpec`.
        session: the ``onnxruntime.InferenceSession``.
        run_options: passed to every run (None: onnxruntime's defaults); see
            ``shrink_arena``.
    """

    def __init__(
        self,
        path: Path,
        spec: GraphSpec,
        threads: int = 0,
        providers: tuple[str, ...] = (CPU_PROVIDER,),
        session: ort.InferenceSession | None = None,
        spin_wait: bool = True,
        shrink_arena: bool = False,
    ) -> None:
        """Load ``path`` (or adopt ``session``) and check it against ``spec``.

        ``shrink_arena``: give the CPU arena's free memory back at the end of every run
        (onnxruntime run option ``memory.enable_memory_arena_shrinkage``): a run keeps the
        arena's speed, and a large run's intermediates do not stay resident afterwards.

        Raises:
            ModelFilesMissing, ModelLoadError: see :func:`open_session`.
            GraphSignatureMismatch: input/output names or dtypes differ from ``spec``.
        """
        self.path = Path(path)
        self.spec = spec
        self.session = session or open_session(self.path, threads, providers, spin_wait)
        self._input_names, self._output_names = self._check()
        self.run_options: ort.RunOptions | None = None
        if shrink_arena:  # the session keeps its arena within a run, returns it after each
            self.run_options = ort.RunOptions()
            self.run_options.add_run_config_entry(
                "memory.enable_memory_arena_shrinkage", "cpu:0")

    def _mismatch(self, problem: str) -> GraphSignatureMismatch:
        return signature_mismatch(self.spec, self.path, self.session, problem)

    def _check(self) -> tuple[dict[str, str], dict[str, str]]:
        """Return spec name -> session name maps for inputs and outputs."""
        found_in = _signature(self.session.get_inputs())
        found_out = _signature(self.session.get_outputs())
        if self.spec.by_position:
            if len(found_in) != len(self.spec.inputs) or len(found_out) < len(self.spec.outputs):
                raise self._mismatch("input/output count differs")
            pairs_in = list(zip(self.spec.inputs.items(), found_in.items(), strict=True))
            pairs_out = list(zip(self.spec.outputs.items(), found_out.items(), strict=False))
            for (name, want), (_, got) in pairs_in + pairs_out:
                if not _dtype_ok(want, got):
                    raise self._mismatch(f"{name} (by position) is {got}, expected {want}")
            return (
                {spec[0]: real[0] for spec, real in pairs_in},
                {spec[0]: real[0] for spec, real in pairs_out},
            )
        missing = [n for n in self.spec.inputs if n not in found_in]
        extra = [n for n in found_in if n not in self.spec.inputs]
        missing_out = [n for n in self.spec.outputs if n not in found_out]
        if missing or extra or missing_out:
            raise self._mismatch(
                f"missing inputs {missing}, unexpected inputs {extra}, "
                f"missing outputs {missing_out}"
            )
        wanted = {**self.spec.inputs, **self.spec.outputs}
        found = {**found_in, **found_out}
        for name, want in wanted.items():
            if not _dtype_ok(want, found[name]):
                raise self._mismatch(f"{name} is {found[name]}, expected {want}")
        return {n: n for n in self.spec.inputs}, {n: n for n in self.spec.outputs}

    @property
    def providers(self) -> list[str]:
        """Execution providers the session actually uses."""
        return list(self.session.get_providers())

    def input_shape(self, name: str) -> list[int | str | None]:
        """Declared shape of input ``name`` (spec name): ints, symbolic names or None."""
        real = self._input_names.get(name, name)
        for arg in self.session.get_inputs():
            if arg.name == real:
                return list(arg.shape)
        raise KeyError(f"{self.spec.file} has no input {name!r}")

    def output_shape(self, name: str) -> list[int | str | None]:
        """Declared shape of output ``name`` (spec name)."""
        real = self._output_names.get(name, name)
        for arg in self.session.get_outputs():
            if arg.name == real:
                return list(arg.shape)
        raise KeyError(f"{self.spec.file} has no output {name!r}")

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the graph on ``feeds`` (spec names); return outputs by spec name.

        Args:
            feeds: input name -> array of the spec's dtype.
            output_names: outputs to compute; all outputs of the spec when None.

        Raises:
            SynthesisFailed: onnxruntime failed (wrong shapes, out-of-range ids...); the
                message names the graph.
        """
        wanted = list(self.spec.outputs) if output_names is None else list(output_names)
        real_feeds = {self._input_names.get(name, name): value for name, value in feeds.items()}
        real_outputs = [self._output_names.get(name, name) for name in wanted]
        observer = _run_observer
        started = time.time() if observer is not None else 0.0
        try:
            values = self.session.run(real_outputs, real_feeds, self.run_options)
        except ORT_ERRORS as exc:
            shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
            raise SynthesisFailed(f"{self.spec.file} failed on inputs {shapes}: {exc}") from exc
        if observer is not None:
            observer(str(self.path), feeds, started, time.time())
        return dict(zip(wanted, values, strict=True))

    def run_bound(self, binding: Any, reported: Mapping[str, np.ndarray]) -> None:
        """Run the graph on a prepared ``onnxruntime`` IOBinding of its session (inputs and
        outputs bound by the caller, e.g. a KV cache extended in place); the run observer sees
        ``reported`` as its feeds.

        Raises:
            SynthesisFailed: onnxruntime failed; the message names the graph.
        """
        observer = _run_observer
        started = time.time() if observer is not None else 0.0
        try:
            self.session.run_with_iobinding(binding, self.run_options)
        except ORT_ERRORS as exc:
            shapes = {name: tuple(np.shape(value)) for name, value in reported.items()}
            raise SynthesisFailed(f"{self.spec.file} failed on inputs {shapes}: {exc}") from exc
        if observer is not None:
            observer(str(self.path), reported, started, time.time())

    def __repr__(self) -> str:
        return f"Graph({self.spec.file!r}, providers={self.providers})"


def load_llm(
    path: Path,
    threads: int = 0,
    providers: tuple[str, ...] = (CPU_PROVIDER,),
    spin_wait: bool = True,
) -> Graph:
    """Load an LLM graph; its spec is built from the number of KV-cache layers it declares.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
    """
    session = open_session(Path(path), threads, providers, spin_wait)
    layers = count_llm_layers([arg.name for arg in session.get_inputs()])
    spec = llm_spec(Path(path).name, layers)
    if layers == 0:
        raise signature_mismatch(spec, Path(path), session, "no past_key_values.<i>.key inputs")
    return Graph(Path(path), spec, threads, providers, session=session)


# -- freed heap -------------------------------------------------------------------------------

_trim_lock = threading.Lock()
_trim: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_looked_up = False


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _trim, _looked_up
    with _trim_lock:
        if not _looked_up:
            _looked_up = True
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _trim = getattr(libc, "malloc_trim", None)
            except OSError as err:
                log.debug("no C library to trim: %s", err)
        return _trim


def return_freed_memory() -> bool:
    """Ask the C library to unmap freed heap pages; True when it released some.

    Loading an onnxruntime session parses the whole ONNX file on the heap; dropping a session
    (the voice encoders after a voice is prepared, the streaming DiT's time graph) frees its
    weights, but glibc keeps freed heap pages mapped, so the process's resident set (RSS) does
    not shrink. ``malloc_trim(0)`` (glibc, ``man 3 malloc_trim``) releases them. Measured on the
    full-size model: after preparing a voice, RSS 2.14 GB -> 0.80 GB (speech_tokenizer_v3.onnx
    alone holds 0.97 GB of fp32 weights while it is loaded).

    On other C libraries (musl, macOS, Windows) this is a no-op.

    Safe to call at any time from any thread (glibc locks its arenas); takes milliseconds.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    return bool(trim(0))


# -- the streaming DiT: chunk mask ----------------------------------------------------------

CHUNK_FRAMES = 50
"""Static chunk in mel frames (cosyvoice3.yaml DiT ``static_chunk_size``; model.py:
"token_hop_len must match training static_chunk_size", 25 tokens x 2 frames)."""
NEG_INF = np.float32(-np.inf)


def chunk_attention_bias(
    start: int, count: int, cached: int, chunk_frames: int = CHUNK_FRAMES
) -> npt.NDArray[np.float32]:
    """Additive attention bias float32 [1, 1, count, cached + count].

    Rows: new frames ``start .. start + count - 1`` (absolute indices); columns: the
    ``cached`` frames just before ``start``, then the new frames. 0 where the static chunk
    mask allows attention, -inf elsewhere. Cached frames are always visible (they belong to
    earlier chunks when ``start`` is on the chunk grid, which upstream's schedule guarantees).
    ``chunk_frames <= 0``: full attention (all zeros).
    """
    bias = np.zeros((1, 1, count, cached + count), dtype=np.float32)
    if chunk_frames <= 0 or count == 0:
        return bias
    rows = np.arange(start, start + count)
    keys = np.arange(start, start + count)
    limit = (rows // chunk_frames + 1) * chunk_frames
    bias[0, 0, :, cached:][keys[None, :] >= limit[:, None]] = NEG_INF
    return bias


# -- rotary tables ---------------------------------------------------------------------------

def rope_tables(
    inv_freq: np.ndarray, freq_div: float, layout: str, start: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 [count, head_dim] for absolute positions ``start .. start+count-1``.

    x-transformers ``RotaryEmbedding.forward_from_seq_len``: ``freqs = einsum(t, inv_freq) /
    interpolation_factor``, each frequency used for a pair of channels (interleaved) or both
    halves ("half"); computed in float32 as torch does.
    """
    pos = np.arange(start, start + count, dtype=np.float32)
    freqs = (pos[:, None] * np.asarray(inv_freq, np.float32)[None, :]).astype(np.float32)
    if freq_div != 1.0:
        freqs = (freqs / np.float32(freq_div)).astype(np.float32)
    if layout == "interleaved":
        table = np.repeat(freqs, 2, axis=1)
    else:
        table = np.concatenate([freqs, freqs], axis=1)
    return np.cos(table).astype(np.float32), np.sin(table).astype(np.float32)


# -- runner ---------------------------------------------------------------------------------

def _session(path: Path) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


KeyValue = tuple[np.ndarray, np.ndarray]
"""One block's (keys, values), float32 [B, H, frames, head_dim] each (head-major)."""


class StreamOutputs:
    """One call's outputs: ``velocity`` [B, 80, n], convolution pasts [B, D, K-1], and per
    block ``new`` (keys, values) [B, H, n, head_dim] of the call's frames (empty when the
    call was made with ``keep=False``)."""

    __slots__ = ("conv1_next", "conv2_next", "new", "velocity")

    def __init__(self, values: Sequence[np.ndarray]) -> None:
        self.velocity, self.conv1_next, self.conv2_next = values[:3]
        rest = values[3:]
        self.new: list[KeyValue] = [(rest[2 * i], rest[2 * i + 1])
                                    for i in range(len(rest) // 2)]


class StreamingEstimator:
    """Runs the derived main graph; computes modulation (time graph) once per ``t``.

    Args:
        main: onnxruntime session of the main graph, or a :class:`~.graphs.Graph` of it
            (runs are then seen by the benchmark's run observer).
        time_session: session of the time graph (released after :meth:`precompute`; a later
            unseen ``t`` reopens it from ``time_path``).
        time_path: the time graph file (None: keep ``time_session``).
    """

    def __init__(self, main: Any, time_session: Any = None, time_path: Path | None = None,
                 session_factory: Any = None) -> None:
        self.main = main
        self._time = time_session
        self.time_path = time_path
        self._factory = session_factory or _session
        session = getattr(main, "session", main)
        self.path: Path | None = getattr(main, "path", None)
        meta = session.get_modelmeta().custom_metadata_map
        self.depth = int(meta["depth"])
        self.dim = int(meta["dim"])
        self.inner = int(meta["inner"])
        self.head_dim = int(meta["head_dim"])
        self.heads = int(meta["heads"])
        self.conv_frames = int(meta["conv_context_frames"])
        self.layout = meta["rope_layout"]
        self.inv_freq = np.array([float(f) for f in meta["rope_inv_freq"].split(",")], np.float32)
        self.freq_div = float(meta["rope_freq_div"])
        self.outputs = ["velocity", "conv1_next", "conv2_next"] + [
            f"new_{kind}_{i}" for i in range(self.depth) for kind in ("key", "value")]
        self._rope_tables = rope_tables
        self._mods: dict[float, dict[str, np.ndarray]] = {}
        self._lock = threading.Lock()

    def modulation(self, t: float) -> dict[str, np.ndarray]:
        """``mod_<i>`` [1, 6D] and ``mod_final`` [1, 2D] for time ``t`` (cached; a time not
        precomputed opens the time graph for this one call)."""
        key = float(np.float32(t))
        with self._lock:
            hit = self._mods.get(key)
            if hit is not None:
                return hit
            return self._compute([key])[key]

    def _compute(self, keys: Sequence[float]) -> dict[float, dict[str, np.ndarray]]:
        """Run the time graph for ``keys`` (lock held); an opened graph is dropped after."""
        session = self._time
        opened = session is None
        if session is None:
            if self.time_path is None:
                raise ModelLoadError("the streaming DiT's time graph is not available")
            session = self._factory(self.time_path)
        names = [o.name for o in session.get_outputs()]
        for key in keys:
            values = session.run(names, {"t": np.array([key], dtype=np.float32)})
            self._mods[key] = {n: np.ascontiguousarray(v)
                               for n, v in zip(names, values, strict=True)}
        if opened:
            del session
            return_freed_memory()  # the time graph's weights (0.57 GB at full size)
        return {k: self._mods[k] for k in keys}

    def precompute(self, t_values: Sequence[float]) -> None:
        """Compute the modulation for every ``t`` with one opening of the time graph, then
        release it (and give its freed heap back to the operating system)."""
        with self._lock:
            missing = sorted({float(np.float32(t)) for t in t_values} - set(self._mods))
            if missing:
                self._compute(missing)
            if self.time_path is not None and self._time is not None:
                self._time = None
                return_freed_memory()

    def empty_past(self, batch: int) -> np.ndarray:
        """float32 [batch, H, 0, head_dim]: no cached frames."""
        return np.zeros((batch, self.heads, 0, self.head_dim), dtype=np.float32)

    def run(
        self,
        frames: dict[str, np.ndarray],
        t: float,
        start_frame: int,
        attn_bias: np.ndarray,
        conv_past: tuple[np.ndarray, np.ndarray] | None = None,
        prompt: Sequence[KeyValue] | None = None,
        hist: Sequence[KeyValue] | None = None,
        keep: bool = True,
    ) -> StreamOutputs:
        """One estimator call on new frames.

        Args:
            frames: ``x``, ``mu``, ``cond`` float32 [B, 80, n] and ``spks`` [B, 80].
            t: flow time of the Euler step.
            start_frame: absolute index of the first new frame (rotary position).
            attn_bias: [1, 1, n, m + n] (:func:`chunk_attention_bias`); m = mp + mh cached frames.
            conv_past: (conv1, conv2) [B, D, K-1] or None (zeros: the utterance start).
            prompt, hist: per block (keys, values) [B, H, mp or mh, head_dim] of the cached
                prompt and history frames, or None (0 frames).
            keep: return the new frames' keys/values (False: velocity and convolution
                context only).
        """
        batch, _, n = frames["x"].shape
        cos, sin = self._rope_tables(self.inv_freq, self.freq_div, self.layout, start_frame, n)
        feeds: dict[str, np.ndarray] = dict(frames)
        feeds.update(self.modulation(t))
        feeds["rope_cos"], feeds["rope_sin"] = cos, sin
        feeds["attn_bias"] = attn_bias
        if conv_past is None:
            zeros = np.zeros((batch, self.dim, self.conv_frames), dtype=np.float32)
            conv_past = (zeros, zeros)
        feeds["conv1_past"], feeds["conv2_past"] = conv_past
        empty = self.empty_past(batch)
        for part, cached in (("prompt", prompt), ("hist", hist)):
            for i in range(self.depth):
                key, value = (empty, empty) if cached is None else cached[i]
                feeds[f"{part}_key_{i}"], feeds[f"{part}_value_{i}"] = key, value
        names = self.outputs if keep else self.outputs[:3]
        if hasattr(self.main, "spec"):  # a checked Graph: returns a dict
            out = self.main.run(feeds, names)
            return StreamOutputs([out[name] for name in names])
        return StreamOutputs(self.main.run(names, feeds))


class TableEmbedding:
    """Embedding lookup with the :class:`Graph` ``run`` interface: the text embedding served
    from the table that ``derive/llm/embedding_table.py`` extracts once from
    ``text_embedding_fp16.onnx`` (a plain ``Gather`` [+ ``Cast``]), typically memory-mapped.

    Args:
        path: the source graph file (for messages).
        spec: the graph's spec (input ``input_ids``, output ``inputs_embeds``).
        table: [rows, hidden] table (fp16 or fp32, typically a read-only memory map).
        out_dtype: dtype of the output (the graph's Cast target; float32).
    """

    def __init__(self, path: Path, spec: GraphSpec, table: np.ndarray, out_dtype: str) -> None:
        self.path = Path(path)
        self.spec = spec
        self.table = table
        self.out_dtype = np.dtype(out_dtype)

    @property
    def rows(self) -> int:
        return int(self.table.shape[0])

    def input_shape(self, name: str) -> list[int | str | None]:
        """Declared shape of ``input_ids``: [1, "sequence_length"]."""
        return [1, "sequence_length"]

    def output_shape(self, name: str) -> list[int | str | None]:
        """Declared shape of ``inputs_embeds``: [1, "sequence_length", hidden]."""
        return [1, "sequence_length", int(self.table.shape[1])]

    def lookup(self, ids: npt.ArrayLike) -> np.ndarray:
        """Rows of ``ids`` (int64, any shape; negative ids count from the end like ONNX
        Gather) as ``out_dtype`` [*ids.shape, hidden].

        Raises:
            SynthesisFailed: an id is outside ``[-rows, rows)`` (the graph fails the same way).
        """
        index = np.asarray(ids, dtype=np.int64)
        if index.size and (index.min() < -self.rows or index.max() >= self.rows):
            raise SynthesisFailed(
                f"{self.spec.file}: token id out of range [-{self.rows}, {self.rows}) in "
                f"input_ids {tuple(index.shape)}"
            )
        return np.asarray(self.table[index], dtype=self.out_dtype)

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Like :meth:`Graph.run`: ``{"inputs_embeds": lookup(feeds["input_ids"])}``."""
        observer = _run_observer
        started = time.time() if observer is not None else 0.0
        out = {"inputs_embeds": self.lookup(feeds["input_ids"])}
        if observer is not None:
            observer(str(self.path), feeds, started, time.time())
        return out

    def __repr__(self) -> str:
        return f"TableEmbedding({self.spec.file!r}, rows={self.rows})"
