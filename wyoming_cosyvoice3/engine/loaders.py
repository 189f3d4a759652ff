"""Loaders of the graphs that have derived forms: the DiT estimator (split, int8), the LLM
(fused), the text embedding (memory-mapped table) and the vocoder (phase-carrying). Each
returns the derived form when the options ask for it and it can be made (once, into the cache
directory, :mod:`.derive`), else the published file, with one warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from . import constants as C
from .derive.embedding_table import TableEmbedding
from .derive.estimator_split import SplitEstimator, main_graph_spec
from .derive.streaming_full import FullAttentionDiT
from .errors import ModelLoadError
from .graphs import ESTIMATOR, HIFT, TEXT_EMBEDDING, Graph, load_llm, open_session
from .options import LLM_FILES, PRESETS, EngineOptions
from .vocoder.hift import StreamedHift

log = logging.getLogger(__name__)


def _wanted(option: bool | None, options: EngineOptions) -> bool:
    """A derived form's option: its value, or (None) on when ``options.cache_dir`` is set."""
    return options.cache_dir is not None if option is None else option

Estimator = Graph | SplitEstimator | FullAttentionDiT
"""The DiT estimator: one graph, the split time/main pair (:mod:`.estimator_split`), or the
streaming DiT run with full attention (:mod:`.derive.streaming_full`)."""


def load_estimator(model_dir: Path, options: EngineOptions, precision: str) -> Estimator:
    """Load the DiT estimator of ``precision`` ("fp32" or "int8").

    With ``options.split_estimator`` (default: when ``cache_dir`` is set) the graph is split
    once into its time-conditioning and per-frame parts (:mod:`.estimator_split`); int8 then
    quantises the per-frame part. Otherwise fp32 is the upstream file itself and int8 its
    cached quantised copy. Derived graphs keep the contract's spec file name (errors name the
    contract file). When deriving fails (e.g. out of memory: the converter needs about 3x the
    fp32 file, once) the next simpler form is used with a warning, down to the fp32 file.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
    """
    from .derive.estimator_split import ensure_split_estimator
    from .derive.files import derived_files_dir
    from .derive.quantize import ensure_int8_estimator

    source = model_dir / ESTIMATOR.file
    threads, providers, spin = options.threads, options.providers, options.spin_wait
    if _wanted(options.split_estimator, options):
        try:
            main, time_graph = ensure_split_estimator(
                source, derived_files_dir(model_dir, options.cache_dir), precision
            )
            session = open_session(main, threads, providers, spin)
            graph = Graph(main, main_graph_spec(session), session=session)
            return SplitEstimator(graph, time_graph, threads, providers, spin)
        except ModelLoadError as exc:
            log.warning("Split DiT estimator not available (%s); using the whole graph", exc)
    path = source
    if precision == "int8":
        try:
            path = ensure_int8_estimator(source, derived_files_dir(model_dir, options.cache_dir))
        except ModelLoadError as exc:  # e.g. out of memory while quantising: keep serving
            log.warning("int8 DiT estimator not available (%s); using the fp32 estimator", exc)
    return Graph(path, ESTIMATOR, threads, providers, spin_wait=spin)


def load_streaming(model_dir: Path, options: EngineOptions, precision: str) -> Any:
    """The chunk-causal streaming DiT of ``precision`` (:mod:`.derive.streaming_estimator`),
    derived once into ``options.cache_dir``, with the time conditioning of every preset's
    Euler schedule computed (its 0.57 GB graph is then released).

    Raises:
        ModelLoadError: no ``cache_dir``, or the derivation or its validation failed (callers
            keep the full-attention path with one warning).
        ModelFilesMissing: the published estimator is absent.
    """
    from .derive.streaming_estimator import load_streaming_estimator
    from .schedule import cosine_t_schedule

    if options.cache_dir is None:  # a bare engine writes no derived files
        raise ModelLoadError("no cache_dir for the derived streaming estimator (set "
                             "EngineOptions.cache_dir; server: --cache-dir)")
    est = load_streaming_estimator(model_dir, options.cache_dir, precision, options.threads,
                                   options.providers, options.spin_wait)
    steps = sorted({p.euler_steps for p in PRESETS.values()} | {C.DEFAULT_EULER_STEPS})
    est.precompute([float(t) for n in steps for t in cosine_t_schedule(n)[:-1]])
    return est


def load_llm_graph(
    model_dir: Path, options: EngineOptions, threads: int, speech_embedding: Graph
) -> Graph:
    """The LLM graph of ``options.llm_precision``, or its fused form (``options.llm_graph``;
    falls back to the published file with one warning, see :mod:`.derive.llm_fused`)."""
    source = model_dir / LLM_FILES[options.llm_precision]
    providers, spin = options.providers, options.spin_wait
    if options.llm_graph != "published":
        from .derive.files import derived_files_dir
        from .derive.llm_fused import VALIDATION_SPLIT, load_fused_llm

        # validation input: speech-embedding rows of seeded random speech tokens
        ids = np.random.default_rng(0).integers(0, C.SPEECH_TOKEN_VOCAB, sum(VALIDATION_SPLIT))
        embeds = speech_embedding.run({"input_ids": ids[None, :]}, ["inputs_embeds"])
        try:
            cache = derived_files_dir(model_dir, options.cache_dir)
        except ModelLoadError as exc:
            log.warning("%s LLM graph not used (%s); using %s", options.llm_graph, exc, source.name)
            return load_llm(source, threads, providers, spin)
        fused = load_fused_llm(
            source, options.llm_graph, cache, threads, providers, spin,
            np.asarray(embeds["inputs_embeds"], np.float32),
        )
        if fused is not None:
            return fused
    return load_llm(source, threads, providers, spin)


def load_text_table(model_dir: Path, options: EngineOptions) -> TableEmbedding | None:
    """The memory-mapped text embedding, or None (option off, not a plain lookup, no cache)."""
    if not _wanted(options.mmap_embeddings, options):
        return None
    from .derive.embedding_table import load_table_embedding
    from .derive.files import derived_files_dir

    try:
        cache = derived_files_dir(model_dir, options.cache_dir)
        return load_table_embedding(model_dir / TEXT_EMBEDDING.file, TEXT_EMBEDDING, cache)
    except (OSError, ModelLoadError, ValueError) as exc:
        log.warning("text embedding table not memory-mapped (%s); using the graph", exc)
        return None


def load_hift(model_dir: Path, options: EngineOptions) -> tuple[Graph, float | None]:
    """The vocoder graph and its source-phase period (CumSum units per 2 pi), or
    ``(hift.onnx, None)``.

    With ``options.phase_vocoder`` (default: when ``cache_dir`` is set) the phase-carrying
    form is derived once (:mod:`.derive.hift_phase`): without a carry it computes what
    ``hift.onnx`` computes, and a windowed call given the carried phase continues the
    harmonic source exactly. Not derivable: ``hift.onnx``, with one warning.

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: as :class:`Graph`.
    """
    threads, providers, spin = options.threads, options.providers, options.spin_wait
    source = model_dir / HIFT.file
    if _wanted(options.phase_vocoder, options):
        from .derive.files import derived_files_dir
        from .derive.hift_phase import load_phase_hift

        try:
            cache = derived_files_dir(model_dir, options.cache_dir)
        except ModelLoadError as exc:
            log.warning("phase-carrying vocoder not used (%s)", exc)
        else:
            loaded = load_phase_hift(source, cache, threads, providers, spin)
            if loaded is not None:
                return loaded[0], loaded[1].period
    return Graph(source, HIFT, threads, providers, spin_wait=spin), None


def load_hift_stream(model_dir: Path, options: EngineOptions) -> StreamedHift | None:
    """The streamed vocoder (:mod:`.derive.hift_stream`), or None (option off, or not
    derivable: one warning, streaming keeps the windowed vocoder)."""
    if not _wanted(options.stream_vocoder, options):
        return None
    from .derive.files import derived_files_dir
    from .derive.hift_stream import load_stream_hift

    try:
        cache = derived_files_dir(model_dir, options.cache_dir)
    except ModelLoadError as exc:
        log.warning("streamed vocoder not used (%s)", exc)
        return None
    loaded = load_stream_hift(model_dir / HIFT.file, cache, options.threads, options.providers,
                              options.spin_wait)
    if loaded is None:
        return None
    graph, report = loaded
    return StreamedHift(graph, tuple(tuple(s) for s in report.state_shapes),
                        report.lookahead_frames, report.min_first_frames)
