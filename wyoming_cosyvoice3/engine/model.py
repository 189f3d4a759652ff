"""The loaded model directory: tokenizer, checked graphs and dimensions read from them.

File list (spec section 1 and the export's model card): tokenizer.json,
text_embedding_fp16.onnx, speech_embedding.onnx, one LLM (llm.onnx, llm_int8.onnx or
llm_q4.onnx, each with its ``.data`` file), flow_encoder.onnx,
flow.decoder.estimator.fp32.onnx, hift.onnx, and the voice encoders campplus.onnx and
speech_tokenizer_v3.onnx (needed only while a new voice is prepared; loaded lazily unless
``EngineOptions.load_voice_encoders``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
from tokenizers import Tokenizer

from . import constants as C
from .derive.flow.full_attention import FullAttentionDiT
from .dit_runner import StreamingEstimator
from .embedding import TableEmbedding
from .errors import GraphSignatureMismatch, ModelFilesMissing, ModelLoadError
from .llm import graph_choice
from .loaders import (
    Estimator,
    fused_form_of,
    fused_rows_validated,
    is_fused_form,
    load_estimator,
    load_hift,
    load_hift_stream,
    load_llm_graph,
    load_streaming_or_none,
    load_text_table,
    seeded_speech_rows,
    wants_streaming,
)
from .memory import return_freed_memory
from .options import LLM_FILES, EngineOptions, FlowPrecision, LlmGraph
from .sessions import (
    CAMPPLUS,
    ESTIMATOR,
    FLOW_ENCODER,
    HIFT,
    SPEECH_EMBEDDING,
    SPEECH_TOKENIZER,
    TEXT_EMBEDDING,
    Graph,
    GraphSpec,
    available_cpus,
)
from .text.tokenizer_load import read_tokenizer
from .vocoder.hift import StreamedHift

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
VOICE_ENCODER_FILES = (CAMPPLUS.file, SPEECH_TOKENIZER.file)
BUILT_IN_VOICE_FILES = ("voices/zh-female.wav", "voices/en-male.wav")
"""Reference clips shipped with the export (model card); not required by the engine."""


def llm_files(precision: str) -> list[str]:
    """The LLM graph of ``precision`` and its external-data file."""
    if precision not in LLM_FILES:
        raise ValueError(f"llm_precision must be one of {sorted(LLM_FILES)}, got {precision!r}")
    name = LLM_FILES[precision]
    return [name, name + ".data"]


def required_files(precision: str) -> list[str]:
    """Every file the engine needs for LLM ``precision`` ("fp32", "int8", "q4").

    Raises:
        ValueError: unknown precision.
    """
    return [
        TOKENIZER_FILE,
        TEXT_EMBEDDING.file,
        SPEECH_EMBEDDING.file,
        *llm_files(precision),
        FLOW_ENCODER.file,
        ESTIMATOR.file,
        HIFT.file,
        *VOICE_ENCODER_FILES,
    ]


@dataclass(frozen=True)
class ModelDims:
    """Dimensions read from the graphs at load (published values in brackets).

    Attributes:
        hidden_size: width of inputs_embeds (896).
        num_layers: LLM layers = number of past_key_values.<i>.key inputs (24).
        num_kv_heads: KV heads, axis 1 of past_key_values.0.key (2).
        head_dim: axis 3 of past_key_values.0.key (64).
        speech_vocab_rows: columns of logits = rows of speech_embedding (6761).
        mel_bins: channels of hift's speech_feat (80).
        speaker_dim: width of flow_encoder's embedding input (192).
    """

    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    speech_vocab_rows: int
    mel_bins: int
    speaker_dim: int


def _static_dim(graph: Graph, name: str, axis: int, output: bool, default: int) -> int:
    """``axis`` of the declared shape of ``name``; the published default if symbolic."""
    shape = graph.output_shape(name) if output else graph.input_shape(name)
    value = shape[axis] if axis < len(shape) else None
    if isinstance(value, int) and value > 0:
        return value
    log.warning(
        "%s: %s axis %d is symbolic (%r); assuming the published value %d",
        graph.spec.file,
        name,
        axis,
        value,
        default,
    )
    return default


def read_dims(llm: Graph, flow_encoder: Graph, hift: Graph) -> ModelDims:
    """Read :class:`ModelDims` from the graphs' declared shapes."""
    layers = sum(1 for name in llm.spec.inputs if name.endswith(".key"))
    kv = "past_key_values.0.key"
    return ModelDims(
        hidden_size=_static_dim(llm, "inputs_embeds", 2, False, C.LLM_HIDDEN_SIZE),
        num_layers=layers,
        num_kv_heads=_static_dim(llm, kv, 1, False, C.LLM_NUM_KV_HEADS),
        head_dim=_static_dim(llm, kv, 3, False, C.LLM_HEAD_DIM),
        speech_vocab_rows=_static_dim(llm, "logits", 1, True, C.SPEECH_EMBEDDING_ROWS),
        mel_bins=_static_dim(hift, "speech_feat", 1, False, C.MEL_BINS),
        speaker_dim=_static_dim(flow_encoder, "embedding", 1, False, C.SPEAKER_EMBEDDING_DIM),
    )


def _choose_decode_graph(graphs: dict[str, Graph | TableEmbedding | Estimator], model_dir: Path,
                         opened: EngineOptions, speech_embedding: Graph) -> None:
    """Load ``opened.llm_decode_candidates`` beside the planned LLM graphs, time a real decode
    step of each fused form (:func:`.llm.graph_choice.time_decode_steps`), and a two-row step
    of each that will decode two pieces at once (``opened.llm_pair_pieces`` and
    :func:`_pairs_rows`), and make the one :func:`.llm.graph_choice.choose_decode_graph` picks
    per token ``graphs["llm"]``; the planned prefill graph (``llm_prefill``, else the planned
    ``llm``) stays ``graphs["llm_prefill"]`` unless it is that one. A candidate that falls
    back to a form already loaded is dropped; nothing is timed when fewer than two fused forms
    loaded. With ``split_cores`` on more than one thread, a decode graph that does not also
    prefill is then timed on one intra-op thread against the sessions' threads
    (:func:`_decode_threads`)."""
    planned = _graph(graphs["llm"])
    prefill = _graph(graphs.get("llm_prefill", planned))
    loaded: dict[str, Graph] = {}
    for graph in (planned, prefill):
        form = fused_form_of(graph)
        if form is not None:
            loaded.setdefault(form, graph)
    for candidate in opened.llm_decode_candidates:
        if candidate in loaded:
            continue
        graph = load_llm_graph(model_dir, opened, opened.threads, speech_embedding, candidate)
        form = fused_form_of(graph)
        if form is not None:
            loaded.setdefault(form, graph)
    if len(loaded) < 2:
        return
    rows = seeded_speech_rows(speech_embedding, 16)[0]
    step_s = graph_choice.time_decode_steps(loaded, rows)
    # the graphs that will decode two pieces at once, as the decoder decides it at start
    pairing = {form: graph for form, graph in loaded.items() if opened.llm_pair_pieces
               and _pairs_rows(graph, rows)}
    pair_step_s = (graph_choice.time_decode_steps(pairing, rows, batch_rows=2) if pairing
                   else {})
    stream_bytes = {form: _file_bytes(graph.path) for form, graph in loaded.items()}
    best = graph_choice.choose_decode_graph(step_s, stream_bytes, fused_form_of(planned) or "",
                                            pair_step_s)
    log.info("LLM decode step timed at load (%d cached positions, medians): %s; %s decodes",
             graph_choice.TIMED_CACHED_POSITIONS,
             ", ".join(f"{form} {1e3 * s:.1f} ms" + (
                 f" (two rows {1e3 * pair_step_s[form]:.1f} ms, "
                 f"{1e3 * graph_choice.token_cost_s(s, pair_step_s[form]):.1f} ms a token)"
                 if form in pair_step_s else " (one row a step)")
                       + f" ({stream_bytes[form] / 1e6:.0f} MB)"
                       for form, s in step_s.items()), best)
    decoder = loaded[best]
    timed_threads = decoder is not prefill and opened.split_cores and opened.threads > 1
    if timed_threads:
        decoder = _decode_threads(decoder, best, model_dir, opened, speech_embedding, rows)
    graphs["llm"] = decoder
    if prefill is decoder:
        graphs.pop("llm_prefill", None)
    else:
        graphs["llm_prefill"] = prefill
    # (timing the threads loaded a second session of the decode graph; one of the two is left)
    dropped = timed_threads or any(g is not decoder and g is not prefill
                                   for g in loaded.values())
    loaded.clear()
    if dropped:  # the slower candidates' weights go back to the operating system
        return_freed_memory()


def _decode_threads(graph: Graph, form: str, model_dir: Path, opened: EngineOptions,
                    speech_embedding: Graph, rows: np.ndarray) -> Graph:
    """``graph`` (the decode graph, fused form ``form``, not the prefill graph) or a session
    of it on one intra-op thread, whichever :func:`.llm.graph_choice.decodes_on_one_thread`
    picks from real steps of both, taking turns. For ``split_cores`` with more than one
    thread only (the caller checks): the decoding then runs beside the flow, and one thread
    leaves the flow a core; without ``split_cores`` the stages take turns, and a step on
    fewer threads only takes longer. The prefill graph keeps the sessions' threads (a prompt's
    positions are compute-bound)."""
    single = load_llm_graph(model_dir, opened, 1, speech_embedding, cast(LlmGraph, form))
    if fused_form_of(single) != form:  # fell back to another form: not the same graph
        return graph
    step_s = graph_choice.time_decode_steps({"threads": graph, "one": single}, rows)
    one = graph_choice.decodes_on_one_thread(step_s["threads"], step_s["one"])
    log.info("LLM decode step of %s timed at load on one intra-op thread %.1f ms, on %d "
             "%.1f ms: decodes on %s", form, 1e3 * step_s["one"], opened.threads,
             1e3 * step_s["threads"], "one thread" if one else f"{opened.threads} threads")
    return single if one else graph


def _pairs_rows(graph: Graph, rows: np.ndarray) -> bool:
    """Whether the decoder will decode two pieces at once with ``graph``
    (:attr:`.llm.decoder.LlmDecoder.pairs_pieces`): its two-row steps give each row its own
    logits, or it is a ``fused-b8`` graph whose two-row steps were validated when derived."""
    exact = graph_choice.paired_rows_exact(graph, rows)
    return exact is not None and (exact or fused_rows_validated(graph))


def _file_bytes(path: Path) -> int:
    """Bytes of an ONNX file and of its external data file (``<name>.data``), if any."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def _graph(item: Graph | TableEmbedding | Estimator) -> Graph:
    if not isinstance(item, Graph):
        raise TypeError(f"expected an onnxruntime Graph, got {item!r}")
    return item


@functools.lru_cache(maxsize=4)
def _read_tokenizer(path: str, size: int, mtime_ns: int) -> Tokenizer:
    """Parse tokenizer.json once per (path, size, mtime): parsing the 10 MB file takes ~1 s,
    in steps that each release the GIL (:func:`.text.tokenizer_load.read_tokenizer`).

    Sharing is safe: the engine only calls ``encode``/``token_to_id`` and never changes the
    tokenizer's padding or truncation settings.
    """
    del size, mtime_ns  # cache key only
    return read_tokenizer(Path(path))


def load_tokenizer(path: Path) -> tuple[Tokenizer, int]:
    """Load tokenizer.json; return it and the id of ``<|endofprompt|>``.

    Raises:
        ModelLoadError: unreadable file, or no ``<|endofprompt|>`` token in it.
    """
    try:
        stat = path.stat()
        tokenizer = _read_tokenizer(str(path), stat.st_size, stat.st_mtime_ns)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise ModelLoadError(
            f"cannot read {path.name} in {path.parent}: {exc}; delete it and download it again"
        ) from exc
    eop = tokenizer.token_to_id(C.END_OF_PROMPT)
    if eop is None:
        raise ModelLoadError(
            f"{path} has no {C.END_OF_PROMPT} token: it is not the CosyVoice3 tokenizer; "
            "download tokenizer.json of Masterx/Fun-CosyVoice3-0.5B-2512-ONNX"
        )
    return tokenizer, int(eop)


class CosyVoice3Model:
    """Tokenizer, graphs and dimensions of one model directory (shared, read-only).

    Graph sessions are thread-safe for ``run``; per-request state never lives here.
    ``estimator`` is the DiT estimator of ``options.flow.precision``; the other
    precision is loaded on first use by :meth:`estimator_for`. ``text_embedding`` is a
    memory-mapped :class:`~.derive.llm.embedding_table.TableEmbedding` when
    ``options.mmap_embeddings`` and the graph is a plain lookup, else the graph.
    """

    def __init__(
        self,
        model_dir: Path,
        options: EngineOptions,
        tokenizer: Tokenizer,
        end_of_prompt_id: int,
        graphs: dict[str, Graph | TableEmbedding | Estimator],
        streaming: dict[str, StreamingEstimator | None] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.options = options
        self.opened_options = options.for_sessions(available_cpus())
        """``options`` as the sessions loaded on first use open: with ``split_cores`` not
        spin-waiting, else ``options`` itself."""
        self.tokenizer = tokenizer
        self.end_of_prompt_id = end_of_prompt_id
        text_embedding = graphs["text_embedding"]
        if isinstance(text_embedding, FullAttentionDiT):
            raise TypeError("the text embedding cannot be an estimator")
        self.text_embedding: Graph | TableEmbedding = text_embedding
        self.speech_embedding = _graph(graphs["speech_embedding"])
        self.llm = _graph(graphs["llm"])
        prefill = graphs.get("llm_prefill")
        self.llm_prefill: Graph | None = None if prefill is None else _graph(prefill)
        """The graph that prefills prompts when it is not ``llm``
        (``EngineOptions.llm_prefill_graph``), else None."""
        self.llm_kv_in_place = all(
            fused_form_of(g) is not None for g in (self.llm, self.llm_prefill) if g is not None)
        """Every LLM graph is a fused form (onnxruntime ``GroupQueryAttention``), so the
        decoder may keep the KV cache in buffers extended in place (``kv_mode`` buffer)."""
        self.llm_rows_validated = fused_rows_validated(self.llm)
        """The decode graph's two-row steps were validated when it was derived
        (``fused-b8``: :attr:`~.derive.llm.fused.FusedReport.pairs_rows`), so two pieces may
        decode together even where its rows are not bit-equal to one-row steps."""
        self.flow_encoder = _graph(graphs["flow_encoder"])
        estimator = graphs["estimator"]
        if isinstance(estimator, TableEmbedding):
            raise TypeError("the estimator cannot be a table lookup")
        self.estimator: Estimator = estimator
        hift = graphs.get("hift")
        self._hift: Graph | None = None if hift is None else _graph(hift)
        self._hift_lock = threading.Lock()
        self.hift_stream: StreamedHift | None = None
        """The streamed vocoder (:mod:`.derive.vocoder.hift_stream`), or None: streaming then runs
        ``hift`` over all mel or a window per call."""
        self.dims = read_dims(self.llm, self.flow_encoder,
                              self._hift or _graph(graphs["hift_dims"]))
        self._voice_lock = threading.Lock()
        self._voice_encoders: tuple[Graph, Graph] | None = None
        self._graphs: dict[tuple[str, str], Estimator | StreamingEstimator | None] = {
            ("estimator", options.flow.precision): self.estimator,
            **{("streaming", p): est for p, est in (streaming or {}).items()},
        }
        """The one cache of per-precision DiT graphs: (role, precision) -> the loaded form;
        role "estimator" (:func:`.loaders.estimator_forms`) or "streaming" (the chunk-causal
        DiT, None once it could not be made: warned once)."""
        self._graphs_lock = threading.Lock()

    @classmethod
    def load(cls, model_dir: Path, options: EngineOptions | None = None) -> CosyVoice3Model:
        """Load every graph of ``model_dir`` for ``options.llm_precision``.

        Raises:
            ValueError: invalid options.
            ModelFilesMissing: files absent (all of them listed at once).
            ModelLoadError: a file is corrupt or truncated.
            GraphSignatureMismatch: a graph differs from the contract.
        """
        options = options or EngineOptions()
        options.validate()
        model_dir = Path(model_dir)
        missing = [
            f for f in required_files(options.llm_precision) if not (model_dir / f).is_file()
        ]
        if missing:
            raise ModelFilesMissing(str(model_dir), missing)
        tokenizer, eop = load_tokenizer(model_dir / TOKENIZER_FILE)
        # with split_cores no session spin-waits between runs: a spinning thread would hold a
        # core the other kind of work waits for
        opened = options.for_sessions(available_cpus())

        def graph(spec: GraphSpec) -> Graph:
            return Graph(model_dir / spec.file, spec, opened.threads, opened.providers,
                         spin_wait=opened.spin_wait)

        speech_embedding = graph(SPEECH_EMBEDDING)
        hift_stream = load_hift_stream(model_dir, opened)
        # the streamed form serves every synthesis: hift.onnx, its fallback, loads at start
        # only without it (else on a whole-mel call's first use)
        hift = load_hift(model_dir, opened) if hift_stream is None else None
        precision = options.flow.precision
        streaming: dict[str, StreamingEstimator | None] = {}
        if wants_streaming(options, precision):
            streaming[precision] = load_streaming_or_none(model_dir, opened, precision)
        # one DiT graph serves chunks and full attention when the streaming DiT loaded
        estimator = load_estimator(model_dir, opened, precision, streaming.get(precision))
        llm = load_llm_graph(model_dir, opened, opened.threads, speech_embedding)
        graphs: dict[str, Graph | TableEmbedding | Estimator] = {
            "speech_embedding": speech_embedding,
            "llm": llm,
            "flow_encoder": graph(FLOW_ENCODER),
            "estimator": estimator,
        }
        if hift is not None:
            graphs["hift"] = hift
        elif hift_stream is not None:  # the same speech_feat input declares the mel bins
            graphs["hift_dims"] = hift_stream.graph
        graphs["text_embedding"] = (load_text_table(model_dir, options)
                                    or graph(TEXT_EMBEDDING))
        prefill = options.llm_prefill_graph
        if prefill is not None and prefill != options.llm_graph and not (
                prefill == "fused" and is_fused_form(llm, "fused")):
            # (a decode graph that fell back to the fused form prefills as well as it would)
            graphs["llm_prefill"] = load_llm_graph(model_dir, opened, opened.threads,
                                                   speech_embedding, prefill)
        if options.llm_decode_candidates:
            _choose_decode_graph(graphs, model_dir, opened, speech_embedding)
        model = cls(model_dir, options, tokenizer, eop, graphs, streaming)
        model.hift_stream = hift_stream
        if model.dims.speech_vocab_rows <= C.FILL_TOKEN:
            raise GraphSignatureMismatch(
                f"{model.llm.spec.file}: logits have {model.dims.speech_vocab_rows} columns, "
                f"expected {C.SPEECH_EMBEDDING_ROWS} (speech tokens + specials); re-download it"
            )
        if options.load_voice_encoders and not options.voice_process:
            model.voice_encoders()
        log.info(
            "model loaded from %s: llm %s, %d layers, hidden %d, providers %s",
            model_dir,
            model.llm.spec.file,
            model.dims.num_layers,
            model.dims.hidden_size,
            model.llm.providers,
        )
        if options.split_cores:
            log.info("split cores: LLM sessions %d intra-op threads (the decode session %d), "
                     "flow and vocoder sessions the same, none spinning between runs; each "
                     "request decodes in its own thread", opened.threads,
                     model.llm.session.get_session_options().intra_op_num_threads)
        return model

    def _cached(self, role: str, precision: str, load: Callable[[], Any]) -> Any:
        """``self._graphs[(role, precision)]``, loading it with ``load`` on first use
        (thread-safe: one load per key)."""
        with self._graphs_lock:
            key = (role, precision)
            if key not in self._graphs:
                self._graphs[key] = load()
            return self._graphs[key]

    @property
    def _estimators(self) -> dict[str, Estimator]:
        """Precision -> the DiT estimator loaded so far (a view of the one cache)."""
        with self._graphs_lock:
            return {p: g for (role, p), g in self._graphs.items()
                    if role == "estimator" and g is not None
                    and not isinstance(g, StreamingEstimator)}

    def estimator_for(self, precision: FlowPrecision) -> Estimator:
        """The DiT estimator of ``precision`` ("fp32" or "int8"), loaded on first use
        (thread-safe; derived once, :func:`.loaders.estimator_forms`).

        Raises:
            ValueError: unknown precision.
            ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
        """
        if precision not in ("fp32", "int8"):
            raise ValueError(f"flow_precision must be fp32 or int8, got {precision!r}")
        with self._graphs_lock:
            loaded = self._graphs.get(("estimator", precision))
        if isinstance(loaded, Graph | FullAttentionDiT):
            return loaded
        # outside the cache's lock (it loads under the same lock): the streaming DiT first,
        # so that its one copy of the weights serves full attention too
        streaming = (self.streaming_estimator(precision)
                     if wants_streaming(self.options, precision) else None)

        def load() -> Estimator:
            log.info("loading the %s DiT estimator on first use", precision)
            return load_estimator(self.model_dir, self.opened_options, precision, streaming)

        estimator: Estimator = self._cached("estimator", precision, load)
        return estimator

    @property
    def hift(self) -> Graph:
        """The vocoder graph for whole-mel calls (:class:`~.vocoder.hift.HiftRunner`):
        ``hift.onnx``, loaded at start where the streamed form could not be made, else on
        first use (thread-safe).

        Raises:
            ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
        """
        with self._hift_lock:
            if self._hift is None:
                log.info("loading %s for a whole-mel vocoder call", HIFT.file)
                self._hift = load_hift(self.model_dir, self.opened_options)
            return self._hift

    def streaming_estimator(self, precision: str) -> StreamingEstimator | None:
        """The chunk-causal streaming DiT of ``precision``
        (:class:`~.dit_runner.StreamingEstimator`), derived and opened on
        first use (thread-safe), or None when it cannot be made (one warning; the caller keeps
        full attention)."""
        streaming: StreamingEstimator | None = self._cached(
            "streaming", precision,
            lambda: load_streaming_or_none(self.model_dir, self.opened_options, precision))
        return streaming

    def voice_encoders(self) -> tuple[Graph, Graph]:
        """(campplus, speech_tokenizer_v3), loaded on first use (thread-safe).

        Raises:
            ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
        """
        with self._voice_lock:
            if self._voice_encoders is None:
                threads, providers = self.options.threads, self.options.providers
                self._voice_encoders = (
                    Graph(self.model_dir / CAMPPLUS.file, CAMPPLUS, threads, providers),
                    Graph(
                        self.model_dir / SPEECH_TOKENIZER.file, SPEECH_TOKENIZER, threads, providers
                    ),
                )
                log.debug("voice encoders loaded")
            return self._voice_encoders

    def release_voice_encoders(self) -> None:
        """Drop the voice encoder sessions (they load again on the next use) and give their
        memory back to the operating system (:func:`.memory.return_freed_memory`)."""
        with self._voice_lock:
            dropped = self._voice_encoders is not None
            self._voice_encoders = None
        if dropped:
            return_freed_memory()

    @property
    def voice_encoders_loaded(self) -> bool:
        return self._voice_encoders is not None

    def fingerprint(self) -> str:
        """Hex digest of the names, sizes and mtimes of the files voice features come from.

        Voice features depend on campplus.onnx and speech_tokenizer_v3.onnx only (the prompt
        mel is DSP), so switching the LLM precision keeps cached voices valid.
        """
        digest = hashlib.sha256()
        for name in VOICE_ENCODER_FILES:
            path = self.model_dir / name
            stat = path.stat() if path.is_file() else None
            entry = f"{name}:{stat.st_size}:{stat.st_mtime_ns}" if stat else f"{name}:absent"
            digest.update(entry.encode("utf-8") + b"\n")
        return digest.hexdigest()[:16]
