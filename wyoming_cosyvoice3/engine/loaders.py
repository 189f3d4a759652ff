"""Which form of each graph is loaded: one table per stage, walked by one helper.

Each role below lists its forms in order of preference. A derived form is used when its
condition holds and it can be made (once, into the cache directory, by its module under
:mod:`.derive`; reused from there on later starts); otherwise the next form is tried after ONE
warning (:func:`.derive.common.forms.load_first`). "auto" below means the option (on by
default) and a ``EngineOptions.cache_dir``: a bare engine derives none of them. Tags name the
cached files
(``<source stem>.<tag>-<size>-<mtime_ns>.onnx``, :func:`.derive.common.files.keyed_name`).

Each line: form -- enabled when -- derived by (module under derive/, file tag). Every role
has at most one derived form before its published graph, and nothing is derived or loaded
just in case: a role's published graph loads only after its derived form failed (or was not
asked for).

LLM stage

* ``llm``:

  1. fused / fused-q4 operators -- ``llm_graph`` is not "published" -- llm/fused (fused2,
     fusedq4r2);
  2. the published graph ``LLM_FILES[llm_precision]``.

* ``text_embedding``:

  1. memory-mapped table -- ``mmap_embeddings`` (auto) and the graph is a plain lookup (else
     no warning) -- llm/embedding_table (table);
  2. the published graph.

Flow stage, per DiT precision p ("fp32" or "int8")

* ``streaming`` (the chunk-causal DiT; for the preset's precision tried at load when the
  preset is ``flow.chunk_causal``, when there is a ``cache_dir`` or when it is "int8"
  (:func:`wants_streaming`), else by the first request that needs it):

  1. chunk-causal streaming DiT -- a ``cache_dir`` -- flow/streaming_estimator (stream4main or
     stream4int8main, stream2time; the int8 one quantised by flow/quantize);
  2. none: streamed chunks use full attention.

* ``estimator`` (full-attention passes: final chunks, one-shot pieces):

  1. the streaming DiT of p run with full attention -- it loaded -- (the streaming form above:
     one copy of the DiT weights serves both roles);
  2. the published fp32 graph (for p "int8" too: the int8 weights exist only in the derived
     form, so a failed derivation costs speed, not accuracy).

  Why one derived form: every preset streams chunk-causally, so its DiT is the streaming
  form, and that form computes the published graph's full-attention pass up to float
  rounding (checked when derived). The split time / per-frame pair and the whole-graph int8
  copy that stood between them served only engines whose streaming DiT could not be made,
  and made a second copy of the weights for each precision a request switched to.

Vocoder stage

* ``vocoder`` (every synthesis call):

  1. streamed, convolution context, delay lines and source phase carried -- ``stream_vocoder``
     (auto) -- vocoder/hift_stream (stream4, after vocoder/hift_lean);
  2. the published ``hift.onnx``, loaded only when there is no streamed form (or on the first
     whole-mel call outside synthesis): each streamed chunk re-runs it over all mel so far, or
     over a lossy preset's left window (``vocoder_window_frames``; the source phase restarts
     at each window, the seams are cross-faded).

  Why one derived form: the streamed form equals one call over the whole mel up to float
  rounding and serves every call. The phase-carrying copy of ``hift.onnx`` that stood
  between them was derived and loaded only where the streamed form could not be made, to
  make that fallback's windows exact: a second derivation for a path that should not run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import constants as C
from .derive.common.files import derived_files_dir
from .derive.common.forms import Form, load_first
from .derive.flow.full_attention import FullAttentionDiT
from .derive.flow.streaming_estimator import load_streaming_estimator
from .derive.llm.embedding_table import load_table_embedding
from .derive.vocoder.hift_stream import STREAM_WARNING, open_stream_hift
from .dit_runner import StreamingEstimator
from .embedding import TableEmbedding
from .errors import ModelLoadError
from .options import LLM_FILES, PRESETS, EngineOptions, LlmGraph
from .sessions import ESTIMATOR, HIFT, TEXT_EMBEDDING, Graph, load_llm
from .vocoder.hift import StreamedHift

Estimator = Graph | FullAttentionDiT
"""The DiT estimator: the published graph or the streaming DiT run with full attention
(:mod:`.derive.flow.full_attention`)."""


def _wanted(option: bool, options: EngineOptions) -> bool:
    """A cached derived form is wanted: its option is on and ``options.cache_dir`` is set."""
    return option and options.cache_dir is not None


# -- flow --------------------------------------------------------------------------------------
def wants_streaming(options: EngineOptions, precision: str) -> bool:
    """Whether the streaming DiT of ``precision`` is tried before the estimator of that
    precision is chosen: with a ``cache_dir`` (it serves full attention as well), for "int8"
    (only a derived form has int8 weights: a bare engine warns once that it runs fp32), and for
    a ``flow.chunk_causal`` preset of that precision (a bare engine warns once that chunks run
    with full attention)."""
    flow = options.flow
    chunk_causal = flow.chunk_causal and flow.precision == precision
    return options.cache_dir is not None or precision == "int8" or chunk_causal


def estimator_forms(
    model_dir: Path, options: EngineOptions, precision: str,
    streaming: StreamingEstimator | None = None,
) -> list[Form[Estimator]]:
    """The estimator's forms for ``precision`` (module table), most preferred first.

    ``streaming``: the model's streaming DiT of ``precision`` when it loaded (it warned once
    if it could not be made); its full-attention form is then first.
    """
    source = model_dir / ESTIMATOR.file
    threads, providers, spin = options.threads, options.providers, options.spin_wait
    return [
        Form(f"streaming DiT ({precision}) with full attention", derived=False,
             wanted=streaming is not None, open=lambda _cache: FullAttentionDiT(streaming)),
        Form("published DiT estimator", derived=False,
             open=lambda _cache: Graph(source, ESTIMATOR, threads, providers, spin_wait=spin)),
    ]


def load_estimator(
    model_dir: Path, options: EngineOptions, precision: str,
    streaming: StreamingEstimator | None = None,
) -> Estimator:
    """The DiT estimator of ``precision`` ("fp32" or "int8"): the first form of
    :func:`estimator_forms` that loads. The derived form keeps the contract's spec file name
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
                "chunks use full attention over the prompt and history"
                + ("; the published fp32 estimator runs them" if precision == "int8" else ""),
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
def seeded_speech_rows(speech_embedding: Graph, n: int) -> np.ndarray:
    """Speech-embedding rows of ``n`` seeded random speech tokens, float32 [1, n, hidden]:
    LLM input of the size and scale a decode step feeds (a fused graph's validation, the
    timed decode steps)."""
    ids = np.random.default_rng(0).integers(0, C.SPEECH_TOKEN_VOCAB, n)
    embeds = speech_embedding.run({"input_ids": ids[None, :]}, ["inputs_embeds"])
    return np.asarray(embeds["inputs_embeds"], np.float32)


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

            return open_fused_llm(source, form, cache, threads, providers, spin,
                                  seeded_speech_rows(speech_embedding, sum(VALIDATION_SPLIT)))

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


def fused_rows_validated(graph: Graph) -> bool:
    """The derivation report beside a ``fused-b8`` graph validated its two-row steps
    (:attr:`~.derive.llm.fused.FusedReport.pairs_rows`); False for any other graph or
    without a readable report."""
    if fused_form_of(graph) != "fused-b8":
        return False
    from .derive.common.files import read_report  # onnx: only when asked
    from .derive.llm.fused import FusedReport

    report = read_report(Path(f"{graph.path}.json"), FusedReport, "fused LLM")
    return report is not None and report.pairs_rows


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
def load_hift(model_dir: Path, options: EngineOptions) -> Graph:
    """The published ``hift.onnx``: the vocoder's fallback (module table) and the graph of
    whole-mel calls.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
    """
    return Graph(model_dir / HIFT.file, HIFT, options.threads, options.providers,
                 spin_wait=options.spin_wait)


def load_hift_stream(model_dir: Path, options: EngineOptions) -> StreamedHift | None:
    """The streamed vocoder (:mod:`.derive.vocoder.hift_stream`), or None (option off, or not
    derivable: one warning; :func:`load_hift` then serves)."""

    def streamed(cache: Path | None) -> StreamedHift:
        assert cache is not None
        graph, report = open_stream_hift(model_dir / HIFT.file, cache, options.threads,
                                         options.providers, options.spin_wait)
        return StreamedHift(graph, tuple(tuple(s) for s in report.state_shapes),
                            report.lookahead_frames, report.min_first_frames)

    return load_first([Form("streamed vocoder", open=streamed, warning=STREAM_WARNING,
                            wanted=_wanted(options.stream_vocoder, options))],
                      model_dir, options.cache_dir)
