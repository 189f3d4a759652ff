"""Checked onnxruntime sessions: one per ONNX graph of the model directory.

Every graph of the contract (spec section 1, the export's model card) has a :class:`GraphSpec`
naming the inputs and outputs it must have and their dtypes. :class:`Graph` loads the file with
explicit ``SessionOptions``, compares the session's signature with the spec and raises a typed
error naming the file, the expected and the found signature and how to fix it.

Two upstream graphs (campplus.onnx, speech_tokenizer_v3.onnx) are fed *by position* by
upstream frontend.py (``session.get_inputs()[0].name``), so their names are not a published
contract. Their specs set ``by_position``: only the number and dtypes of inputs are checked,
and :meth:`Graph.run` maps the spec's names onto the session's names in order.

The benchmark's run observer (:func:`set_run_observer`) sees every run of a checked graph, and
of the graphs served without a session (:class:`.embedding.TableEmbedding`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state
from packaging.version import Version

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


def run_observer() -> RunObserver | None:
    """The installed run observer (None: none), for runners outside this module."""
    return _run_observer


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


BRIEF_SPIN_US = 10
"""Microseconds an idle worker thread of a session that does not spin-wait still spins for the
run's next operator before it sleeps (``session.intra_op.spin_duration_us``). A run's
operators follow each other within microseconds, so the worker is mostly still awake for the
next one, while a thread of a session waiting for its next run sleeps at once instead of
holding a core the other kind of work needs. On the 2-core Xeon of BENCHMARKS.md ("Brief
spinning between a run's operators"), alone, a decode step took 20 against 22.8 ms and a
40-frame DiT call 71 against 79 ms, and both at once about as long as without spinning;
through the server 10 and 20 us shortened the answers alike, 50 us not the paragraph."""

BRIEF_SPIN_SINCE = Version("1.26")
"""The first onnxruntime with ``session.intra_op.spin_duration_us`` (its Python module's
library names the key from 1.26.0 on, not in 1.25.1); older ones ignore unknown keys, so
there a session that does not spin-wait does not spin at all."""


def brief_spin_supported(version: str = ort.__version__) -> bool:
    """Whether onnxruntime ``version`` can bound its worker threads' spinning
    (:data:`BRIEF_SPIN_SINCE`)."""
    return Version(version) >= BRIEF_SPIN_SINCE


def session_options(threads: int, spin_wait: bool = True,
                    memory_arena: bool = True) -> ort.SessionOptions:
    """SessionOptions used for every graph: all graph optimisations, sequential execution,
    ``threads`` intra-op threads (0 = onnxruntime's choice), one inter-op thread. Idle worker
    threads spin before sleeping, as onnxruntime does by default; with ``spin_wait`` False
    (see ``EngineOptions.spin_wait``) only for :data:`BRIEF_SPIN_US` within a run and not at
    all once the run has returned (``session.intra_op.spin_duration_us``,
    ``session.force_spinning_stop``), or, on an onnxruntime without that bound, not at all
    (``session.intra_op.allow_spinning``). ``memory_arena`` False: intermediate tensors are
    freed after each run instead of kept in onnxruntime's CPU arena (``enable_cpu_mem_arena``),
    for graphs whose largest run is a one-off."""
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = memory_arena
    if not spin_wait and brief_spin_supported():
        options.add_session_config_entry("session.intra_op.spin_duration_us",
                                         str(BRIEF_SPIN_US))
        options.add_session_config_entry("session.force_spinning_stop", "1")
    elif not spin_wait:
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
