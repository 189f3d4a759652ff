"""Which form of each graph is loaded: one table per stage, walked by one helper.

Each role below lists its forms in order of preference. A derived form is used when its
condition holds and it can be made (once, into the cache directory, by its module under
:mod:`.derive`; reused from there on later starts); otherwise the next form is tried after ONE
warning (:func:`.derive.common.forms.load_first`). "auto" below means the option (on by
default) and a ``EngineOptions.cache_dir``: a bare engine derives none of them. Tags name the
cached files
(``<source stem>.<tag>-<size>-<mtime_ns>.onnx``, :func:`.derive.common.files.keyed_name`).

Each line: form -- enabled when -- derived by (module under derive/, file tag).

LLM stage

* ``llm``:

  1. fused / fused-q4 operators -- ``llm_graph`` is not "published" -- llm/fused (fused1,
     fusedq4r1);
  2. the published graph ``LLM_FILES[llm_precision]``.

* ``text_embedding``:

  1. memory-mapped table -- ``mmap_embeddings`` (auto) and the graph is a plain lookup (else
     no warning) -- llm/embedding_table (table);
  2. the published graph.

Flow stage, per DiT precision p ("fp32" or "int8")

* ``streaming`` (chunk-causal chunks; asked for at load when ``EngineOptions.preset`` is
  ``flow.chunk_causal``, else by the first chunk-causal request):

  1. chunk-causal streaming DiT -- a ``cache_dir`` -- flow/streaming_estimator (stream2main or
     stream2int8main, stream1time);
  2. none: streamed chunks use full attention.

* ``estimator`` (full-attention passes):

  1. the streaming DiT run with full attention -- the preset is ``flow.chunk_causal``, p is
     its ``flow.precision`` and the streaming DiT loaded -- (the streaming form above);
  2. split time / per-frame pair, the per-frame part int8 for int8 -- ``split_estimator``
     (auto) -- flow/estimator_split (main or int8main, time);
  3. the whole graph in int8 -- p is "int8" -- flow/quantize (int8r2);
  4. the published fp32 graph.

Vocoder stage

* ``hift_stream`` (streamed chunks):

  1. streamed, convolution context carried -- ``stream_vocoder`` (auto) --
     vocoder/hift_stream (stream3);
  2. none: windowed calls of ``hift``.

* ``hift``:

  1. phase-carrying -- ``phase_vocoder`` (auto) -- vocoder/hift_phase (phase2);
  2. the published ``hift.onnx``.

Streamed chunks use ``hift_stream`` when there is one, else windowed calls of ``hift``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import constants as C
from .derive.common.files import derived_files_dir
from .derive.common.forms import Form, load_first
from .derive.flow import quantize
from .derive.flow.estimator_split import SplitEstimator, ensure_split_estimator, main_graph_spec
from .derive.flow.full_attention import FullAttentionDiT
from .derive.flow.streaming_estimator import load_streaming_estimator
from .derive.llm.embedding_table import load_table_embedding
from .derive.vocoder.hift_phase import PHASE_WARNING, open_phase_hift
from .derive.vocoder.hift_stream import STREAM_WARNING, open_stream_hift
from .errors import ModelLoadError
from .graphs import (
    ESTIMATOR,
    HIFT,
    TEXT_EMBEDDING,
    Graph,
    StreamingEstimator,
    TableEmbedding,
    load_llm,
    open_session,
)
from .options import LLM_FILES, PRESETS, EngineOptions, LlmGraph
from .vocoder.hift import StreamedHift

Estimator = Graph | SplitEstimator | FullAttentionDiT
"""The DiT estimator: one graph, the split time/main pair (:mod:`.derive.flow.estimator_split`),
or the streaming DiT run with full attention (:mod:`.derive.flow.full_attention`)."""


def _wanted(option: bool, options: EngineOptions) -> bool:
    """A cached derived form is wanted: its option is on and ``options.cache_dir`` is set."""
    return option and options.cache_dir is not None


# -- flow --------------------------------------------------------------------------------------
def estimator_forms(
    model_dir: Path, options: EngineOptions, precision: str,
    streaming: StreamingEstimator | None = None,
) -> list[Form[Estimator]]:
    """The estimator's forms for ``precision`` (module table), most preferred first.

    ``streaming``: the model's streaming DiT of ``precision`` when it has one loaded (it
    warned once if it could not be made); its full-attention form is then first.
    """
    source = model_dir / ESTIMATOR.file
    threads, providers, spin = options.threads, options.providers, options.spin_wait

    def split(cache: Path | None) -> Estimator:
        assert cache is not None  # a derived form is always given its directory
        main, time_graph = ensure_split_estimator(source, cache, precision)
        session = open_session(main, threads, providers, spin)
        graph = Graph(main, main_graph_spec(session), session=session)
        return SplitEstimator(graph, time_graph, threads, providers, spin)

    def int8(cache: Path | None) -> Estimator:
        assert cache is not None
        path = quantize.ensure_int8_estimator(source, cache)  # looked up now: tests replace it
        return Graph(path, ESTIMATOR, threads, providers, spin_wait=spin)

    return [
        Form("full-attention streaming DiT", derived=False,
             wanted=(streaming is not None and options.preset.flow.chunk_causal
                     and precision == options.preset.flow.precision),
             open=lambda _cache: FullAttentionDiT(streaming)),
        Form("split DiT estimator", open=split,
             wanted=_wanted(options.split_estimator, options),
             warning="Split DiT estimator not available (%s); using the whole graph"),
        # e.g. out of memory while quantising: keep serving
        Form("int8 DiT estimator", open=int8, wanted=precision == "int8",
             warning="int8 DiT estimator not available (%s); using the fp32 estimator"),
        Form("published DiT estimator", derived=False,
             open=lambda _cache: Graph(source, ESTIMATOR, threads, providers, spin_wait=spin)),
    ]


def load_estimator(
    model_dir: Path, options: EngineOptions, precision: str,
    streaming: StreamingEstimator | None = None,
) -> Estimator:
    """The DiT estimator of ``precision`` ("fp32" or "int8"): the first form of
    :func:`estimator_forms` that loads. Derived graphs keep the contract's spec file name
    (errors name the contract file).

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: the published file failed.
    """
    found = load_first(estimator_forms(model_dir, options, precision, streaming), model_dir,
                       options.cache_dir)
    assert found is not None  # the published form either loads or raises
    return found


def open_streaming(model_dir: Path, options: EngineOptions, precision: str,
                   cache_dir: Path) -> StreamingEstimator:
    """The chunk-causal streaming DiT of ``precision`` (:mod:`.derive.flow.streaming_estimator`)
    derived once into ``cache_dir``, with the time conditioning of every preset's Euler
    schedule computed (its 0.57 GB graph is then released).

    Raises:
        ModelLoadError: no ``options.cache_dir`` (a bare engine writes no derived files), or
            the derivation or its validation failed.
        ModelFilesMissing: the published estimator is absent.
    """
    from .flow.solver import cosine_t_schedule

    if options.cache_dir is None:
        raise ModelLoadError("no cache_dir for the derived streaming estimator (set "
                             "EngineOptions.cache_dir; server: --cache-dir)")
    est = load_streaming_estimator(model_dir, cache_dir, precision, options.threads,
                                   options.providers, options.spin_wait)
    steps = sorted({p.flow.schedule.steps for p in PRESETS.values()} | {C.DEFAULT_EULER_STEPS})
    est.precompute([float(t) for n in steps for t in cosine_t_schedule(n)[:-1]])
    return est


def streaming_forms(model_dir: Path, options: EngineOptions,
                    precision: str) -> list[Form[StreamingEstimator]]:
    """The streaming role's one derived form (module table); none loaded: full attention."""
    return [Form(
        f"chunk-causal streaming DiT ({precision})",
        open=lambda cache: open_streaming(model_dir, options, precision, cache or model_dir),
        warning=f"chunk-causal streaming flow ({precision}) not available (%s); streamed "
                "chunks use full attention over the prompt and history",
    )]


def load_streaming(model_dir: Path, options: EngineOptions, precision: str) -> StreamingEstimator:
    """:func:`open_streaming` into the derived-files directory (raises; the model's
    :func:`load_streaming_or_none` is the form that falls back)."""
    return open_streaming(model_dir, options, precision,
                          derived_files_dir(model_dir, options.cache_dir))


def load_streaming_or_none(model_dir: Path, options: EngineOptions,
                           precision: str) -> StreamingEstimator | None:
    """The streaming DiT of ``precision``, or None after one warning (full attention)."""
    return load_first(streaming_forms(model_dir, options, precision), model_dir,
                      options.cache_dir)


# -- LLM ---------------------------------------------------------------------------------------
def load_llm_graph(
    model_dir: Path, options: EngineOptions, threads: int, speech_embedding: Graph,
    variant: LlmGraph | None = None,
) -> Graph:
    """The LLM graph of ``options.llm_precision``, or its fused form ``variant`` (default
    ``options.llm_graph``). A form that cannot be derived falls back with one warning:
    ``fused-b8`` and ``fused-q4`` to ``fused``, ``fused`` to the published file (see
    :mod:`.derive.llm.fused`)."""
    source = model_dir / LLM_FILES[options.llm_precision]
    providers, spin = options.providers, options.spin_wait
    variant = variant or options.llm_graph

    def fused(form: str) -> Callable[[Path | None], Graph]:
        def open_form(cache: Path | None) -> Graph:
            assert cache is not None
            from .derive.llm.fused import VALIDATION_SPLIT, open_fused_llm  # onnx: when asked

            # validation input: speech-embedding rows of seeded random speech tokens
            ids = np.random.default_rng(0).integers(0, C.SPEECH_TOKEN_VOCAB,
                                                    sum(VALIDATION_SPLIT))
            embeds = speech_embedding.run({"input_ids": ids[None, :]}, ["inputs_embeds"])
            return open_fused_llm(source, form, cache, threads, providers, spin,
                                  np.asarray(embeds["inputs_embeds"], np.float32))

        return open_form

    published = Form("published LLM graph", derived=False,
                     open=lambda _cache: load_llm(source, threads, providers, spin))
    forms: list[Form[Graph]] = []
    if variant in ("fused-b8", "fused-q4"):
        forms.append(Form(f"{variant} LLM graph", open=fused(variant),
                          warning=f"{variant} LLM graph not used (%s); using the fused graph"))
    if variant != "published":
        forms.append(Form("fused LLM graph", open=fused("fused"),
                          warning=f"fused LLM graph not used (%s); using {source.name}"))
    forms.append(published)
    found = load_first(forms, model_dir, options.cache_dir)
    assert found is not None
    return found


def is_fused_form(graph: Graph, variant: str) -> bool:
    """Whether ``graph`` is the derived LLM form ``variant`` (its cached file's tag)."""
    return fused_form_of(graph) == variant


def fused_form_of(graph: Graph) -> str | None:
    """The derived LLM form ``graph`` is (``fused``, ``fused-b8``, ``fused-q4``), by its
    cached file's tag; None for a published graph."""
    from .derive.llm.fused import FUSED_TAGS  # onnx: only when asked

    return next((form for form, tag in FUSED_TAGS.items() if f".{tag}-" in graph.path.name),
                None)


def load_text_table(model_dir: Path, options: EngineOptions) -> TableEmbedding | None:
    """The memory-mapped text embedding, or None (option off, not a plain lookup, no cache)."""

    def table(cache: Path | None) -> TableEmbedding | None:
        assert cache is not None
        try:
            return load_table_embedding(model_dir / TEXT_EMBEDDING.file, TEXT_EMBEDDING, cache)
        except (OSError, ValueError) as exc:  # unwritable cache, unreadable table
            raise ModelLoadError(str(exc)) from exc

    return load_first([Form(
        "text embedding table", open=table, wanted=_wanted(options.mmap_embeddings, options),
        warning="text embedding table not memory-mapped (%s); using the graph",
    )], model_dir, options.cache_dir)


# -- vocoder -----------------------------------------------------------------------------------
def load_hift(model_dir: Path, options: EngineOptions) -> tuple[Graph, float | None]:
    """The vocoder graph and its source-phase period (CumSum units per 2 pi), or
    ``(hift.onnx, None)``: the first of the phase-carrying form (:mod:`.derive.vocoder.
    hift_phase`: without a carry it computes what ``hift.onnx`` computes, and a windowed call
    given the carried phase continues the harmonic source exactly) and the published file.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
    """
    threads, providers, spin = options.threads, options.providers, options.spin_wait
    source = model_dir / HIFT.file

    def phase(cache: Path | None) -> tuple[Graph, float | None]:
        assert cache is not None
        graph, report = open_phase_hift(source, cache, threads, providers, spin)
        return graph, report.period

    forms: list[Form[tuple[Graph, float | None]]] = [
        Form("phase-carrying vocoder", open=phase, warning=PHASE_WARNING,
             wanted=_wanted(options.phase_vocoder, options)),
        Form("published vocoder", derived=False, open=lambda _cache: (
            Graph(source, HIFT, threads, providers, spin_wait=spin), None)),
    ]
    found = load_first(forms, model_dir, options.cache_dir)
    assert found is not None
    return found


def load_hift_stream(model_dir: Path, options: EngineOptions) -> StreamedHift | None:
    """The streamed vocoder (:mod:`.derive.vocoder.hift_stream`), or None (option off, or not
    derivable: one warning, streaming keeps the windowed vocoder)."""

    def streamed(cache: Path | None) -> StreamedHift:
        assert cache is not None
        graph, report = open_stream_hift(model_dir / HIFT.file, cache, options.threads,
                                         options.providers, options.spin_wait)
        return StreamedHift(graph, tuple(tuple(s) for s in report.state_shapes),
                            report.lookahead_frames, report.min_first_frames)

    return load_first([Form("streamed vocoder", open=streamed, warning=STREAM_WARNING,
                            wanted=_wanted(options.stream_vocoder, options))],
                      model_dir, options.cache_dir)
