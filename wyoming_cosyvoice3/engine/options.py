"""What the engine is given and what it gives back.

* Options: :class:`EngineOptions` (how the model's graphs are loaded, fixed for the engine's
  life), :class:`SynthesisOptions` (how one request runs: the caller's fields and one record
  per stage, :class:`LlmPreset`, :class:`FlowPreset` with its :class:`EulerSchedule` and
  :class:`FlowFallback`, :class:`VocoderPreset`) and the named presets
  (:data:`PRESET_STAGES`; as request options: :data:`PRESETS`).
* Records passed between the stages and returned to callers: voice features and prompts, the
  LLM prompt of a piece, audio chunks, a request's result and stage times.
* :class:`EngineObserver`: how a caller (the benchmark, a profiler, a test) watches what the
  engine does without the engine knowing who watches, plus the one hook that changes what it
  does, a fixed decoding length (:meth:`EngineObserver.fixed_speech_tokens`). Pass a subclass
  as ``EngineOptions.observer``; every method defaults to doing nothing, and the engine calls
  them on its own threads, so implementations must be thread-safe and quick (they run on the
  synthesis path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from . import constants as C

LlmPrecision = Literal["fp32", "int8", "q4"]
LlmGraph = Literal["published", "fused", "fused-b8", "fused-q4"]
LLM_GRAPHS: tuple[str, ...] = ("published", "fused", "fused-b8", "fused-q4")
"""Every :data:`LlmGraph`."""
LOSSLESS_LLM_GRAPHS: tuple[LlmGraph, ...] = ("fused", "fused-b8")
"""Derived LLM graphs that keep the published int8 weights (the others' prefill candidates)."""
FlowPrecision = Literal["fp32", "int8"]
LLM_FILES: dict[str, str] = {"fp32": "llm.onnx", "int8": "llm_int8.onnx", "q4": "llm_q4.onnx"}
"""LLM graph file per precision (model card of the ONNX export)."""
_Record = TypeVar("_Record")


@dataclass(frozen=True)
class EulerSchedule:
    """How one flow pass integrates (flow_matching.py ``solve_euler``).

    Attributes:
        steps: Euler steps n (``n_timesteps``; upstream 10). Range 1..50.
        cfg_rate: classifier-free guidance rate (``inference_cfg_rate``; upstream 0.7), run in
            every step; 0 runs no unconditional row at all. Range 0..2.
    """

    steps: int = C.DEFAULT_EULER_STEPS
    cfg_rate: float = C.DEFAULT_CFG_RATE

    @property
    def guided(self) -> tuple[bool, ...]:
        """Per step, whether it runs CFG (two rows): every step, none when ``cfg_rate`` is 0
        (``(1 + 0) v_cond - 0 v_uncond == v_cond``)."""
        return (self.cfg_rate != 0.0,) * self.steps

    @property
    def key(self) -> tuple[int, ...]:
        """Which steps use CFG (1) or not (0): the part of a cached key/value set that
        depends on the schedule (its batch per step)."""
        return tuple(int(g) for g in self.guided)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when a value is out of range."""
        if not 1 <= self.steps <= 50:
            raise ValueError(f"euler steps must be within 1..50, got {self.steps}")
        if not 0.0 <= self.cfg_rate <= 2.0:
            raise ValueError(f"cfg_rate must be within 0..2, got {self.cfg_rate}")


@dataclass(frozen=True)
class FlowFallback:
    """The flow's context bounds while a chunk-causal preset runs full attention (the
    streaming DiT could not be derived from the model: one warning at start). Full attention
    runs the prompt and the history again in every chunk, so context that is cheap when
    cached is several times the work there; a lossy preset names smaller bounds for that case.

    Attributes:
        prompt_tokens: replaces :attr:`FlowPreset.prompt_tokens`; None = the same.
        left_context_tokens: replaces :attr:`FlowPreset.left_context_tokens`; None = the same.
    """

    prompt_tokens: int | None = None
    left_context_tokens: int | None = None


@dataclass(frozen=True)
class FlowPreset:
    """The flow stage of a preset (and of a request). The defaults are upstream's values,
    streamed under full attention.

    Attributes:
        precision: DiT estimator weights: ``fp32`` (spec-exact) or ``int8`` (dynamic
            per-channel MatMul quantisation, see :mod:`.derive.flow.quantize`).
        schedule: Euler steps and CFG rate.
        chunk_causal: non-final streamed chunks run the DiT under upstream's static 50-frame
            chunk mask (dit.py ``streaming=True``) with the prompt's and the earlier chunks'
            keys/values cached, so a chunk costs only its own frames; the final chunk keeps
            full attention (upstream ``finalize=True``). Uses a streaming estimator derived
            once from the model (falls back to full attention and :attr:`fallback`, with one
            warning). ``left_context_tokens`` then bounds the cached history instead (attended
            and stored).
        final_chunk_causal: with ``chunk_causal``, the final chunk (and a one-shot piece) also
            runs chunk-causal on its new frames only, instead of upstream's full attention
            over the prompt and the whole piece (``finalize=True``): its cost no longer grows
            with the prompt and the piece. Lossy: the cached keys/values of the earlier frames
            were made under the chunk mask and never see the final frames (BENCHMARKS.md
            "Levers" gives the measured deviation).
        prompt_tokens: when > 0, the flow sees only the last this-many prompt tokens and
            their 2x mel frames (the LLM still gets the whole prompt); 0 = whole prompt.
        left_context_tokens: when > 0, later chunks run the flow on the prompt plus only this
            many generated tokens before the new chunk (bounded cost); 0 keeps the whole
            history (spec-exact).
        fallback: the context bounds while the streaming DiT is not available.
        first_hop_tokens: speech tokens in the first streamed chunk (upstream 25; smaller is
            faster first audio: the exported estimator uses full attention, so any size works).
        first_hop_on_chunk_grid: pad the first hop so that prompt + first hop end on the
            25-token (50-frame) chunk grid, as upstream does (model.py ``prompt_token_pad``);
            needed for exact chunk-causal streaming.
        max_hop_tokens: the hop doubles after each chunk up to this many tokens (upstream 100).
        whole_middle_pieces: the pieces between a request's first and last run the flow and
            the vocoder once each, when the LLM has ended them, instead of in streamed chunks
            (streaming still holds for the first and the last piece). Every flow chunk costs
            a fixed part on top of its frames (4 Euler steps of about 40 ms at ``balanced`` on
            the 2-core reference machine, BENCHMARKS.md "What a listener hears"), and on a
            machine slower than playback the server holds such a piece until most of it is
            made anyway (:mod:`wyoming_cosyvoice3.server.preroll`), so its chunks only cost
            time. Exact in the sense of upstream's ``stream=False``: the piece's audio is what
            a one-shot request gives for it. The server keeps it only while it bounds pieces
            for slower-than-playback synthesis: on a faster machine a middle piece streamed
            keeps playback going.
    """

    precision: FlowPrecision = "fp32"
    schedule: EulerSchedule = EulerSchedule()
    chunk_causal: bool = False
    final_chunk_causal: bool = False
    prompt_tokens: int = 0
    left_context_tokens: int = 0
    fallback: FlowFallback = FlowFallback()
    first_hop_tokens: int = 15
    first_hop_on_chunk_grid: bool = False
    max_hop_tokens: int = 100
    whole_middle_pieces: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when a value is out of range."""
        self.schedule.validate()
        if self.precision not in ("fp32", "int8"):
            raise ValueError(f"flow precision must be fp32 or int8, got {self.precision!r}")
        if not 1 <= self.first_hop_tokens <= self.max_hop_tokens:
            raise ValueError("first_hop_tokens must be >= 1 and <= max_hop_tokens")
        if min(self.prompt_tokens, self.left_context_tokens) < 0:
            raise ValueError("flow prompt_tokens and left_context_tokens must be >= 0")
        fallback = self.fallback
        if min(fallback.prompt_tokens or 0, fallback.left_context_tokens or 0) < 0:
            raise ValueError("flow fallback prompt_tokens and left_context_tokens must be >= 0")

    def full_attention(self) -> FlowPreset:
        """This preset as it runs without the streaming DiT: not chunk-causal, and the
        :attr:`fallback` bounds (when set) instead of the prompt and history bounds."""
        prompt, left = self.fallback.prompt_tokens, self.fallback.left_context_tokens
        return dataclasses.replace(
            self,
            chunk_causal=False,
            final_chunk_causal=False,
            prompt_tokens=self.prompt_tokens if prompt is None else prompt,
            left_context_tokens=self.left_context_tokens if left is None else left,
        )


@dataclass(frozen=True)
class LlmPreset:
    """The LLM stage of a preset.

    Attributes:
        graph: the LLM graph loaded when ``--llm-graph`` is ``preset`` (the server's default)
            and the machine was not measured: a load-time choice, so a request asking for
            another preset keeps the loaded one.
        decode_graphs: the graphs the machine probe chooses the decoding graph among
            (:func:`.machine.choose_llm_graphs`; the fastest on this CPU); prefills always
            take a lossless graph (:data:`LOSSLESS_LLM_GRAPHS`).
    """

    graph: LlmGraph
    decode_graphs: tuple[LlmGraph, ...] = LOSSLESS_LLM_GRAPHS


@dataclass(frozen=True)
class VocoderPreset:
    """The vocoder stage of a preset.

    Attributes:
        window_frames: left context of a vocoder call when the streamed vocoder cannot be
            derived, 0 = the whole utterance (``vocoder_window_frames``; the streamed vocoder
            runs each mel frame once and ignores it).
        defer: let the vocoder skip a non-final flow chunk while the audio already emitted
            lasts until its next call (fewer calls, fewer re-run frames; see
            :func:`.vocoder.hift.may_defer`). Exact with ``window_frames`` 0 (the samples do
            not depend on how the mel is cut); with a window it moves the seams (which only
            matters without the phase-carrying vocoder).
    """

    window_frames: int
    defer: bool = True


def _replaced(record: _Record, changes: Mapping[str, object]) -> _Record:
    """``record`` with ``changes`` applied; a change to a field that holds a record may be
    a mapping of that record's fields (``{"schedule": {"steps": 4}}``)."""
    merged: dict[str, object] = {}
    for name, value in changes.items():
        current = getattr(record, name, None)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(current):
            value = _replaced(current, value)
        merged[name] = value
    return dataclasses.replace(record, **merged)  # type: ignore[type-var]


@dataclass(frozen=True)
class SynthesisOptions:
    """How one request runs: what the caller sets, and the preset's stage records. The
    defaults are the spec-exact upstream values.

    Attributes:
        speed: speaking rate; the mel is linearly resampled to ``int(frames / speed)``
            frames (cosyvoice/flow/flow.py inference with ``speed``). Range 0.5..2.0.
        seed: seed of the request's ``numpy.random.Generator`` (sampling and noise); the same
            seed, text and voice give the same audio.
        streaming: emit audio in chunks while the LLM decodes (True) or once per text piece.
        language_hint: the language the text is most likely in (e.g. the voice's "en"):
            the text normaliser uses it only when the text itself gives no cue, so that a
            streamed sentence such as "Kitchen, 21 °C." reads its numbers as the whole
            answer would (:func:`.text.normalize.normalize_text`); None: digits without a
            cue stay digits.
        read_numbers: read numbers, times, dates, units and money as words in each
            sentence's language (:func:`.text.normalize.normalize_text`); False keeps every
            digit as written, for a voice that reads digits better itself (the server's
            ``--keep-digits``).
        max_piece_tokens: upper size of a text piece in LLM text tokens (upstream
            ``split_paragraph`` ``token_max_n`` = 80, which packs several sentences into one
            LLM pass). A smaller bound gives a piece per sentence (a long sentence is cut at
            its commas, then between words), and the short-piece merge threshold shrinks with
            it (:meth:`.text.frontend.TextFrontend.split_pieces`): the server asks for this
            when synthesis runs slower than playback, so that each piece's audio can be held
            until it plays through without a pause inside it.
        max_decode_tokens: hard cap on decoded speech tokens per piece, on top of 20x text.
        max_request_s: wall-clock limit of one request; exceeded raises SynthesisTimeout.
        output_dtype: ``float32`` samples in [-1, 1] or ``int16`` PCM.
        llm: the preset's LLM record (a load-time choice: :attr:`EngineOptions.llm_graph`).
        flow: the preset's flow record; the flow stage decides from it, per request, whether
            the chunk-causal form runs (:meth:`FlowPreset.full_attention` otherwise).
        vocoder: the preset's vocoder record.
        vocoder_window_frames: when > 0, each vocoder call sees only this many already-emitted
            mel frames of left context (linear instead of quadratic cost; see :mod:`.vocoder`);
            0 = all mel of the utterance (spec-exact). Only where the streamed vocoder could not
            be derived: hift.onnx as published restarts the harmonic source's phase at each
            window, and the seams are cross-faded.
    """

    speed: float = 1.0
    seed: int = 0
    streaming: bool = True
    language_hint: str | None = None
    read_numbers: bool = True
    max_piece_tokens: int = C.DEFAULT_MAX_PIECE_TOKENS
    max_decode_tokens: int = 3000
    max_request_s: float = 300.0
    output_dtype: Literal["float32", "int16"] = "float32"
    llm: LlmPreset = LlmPreset(graph="published")
    flow: FlowPreset = FlowPreset()
    vocoder: VocoderPreset = VocoderPreset(window_frames=0)
    vocoder_window_frames: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option when a value is out of range."""
        if not 0.5 <= self.speed <= 2.0:
            raise ValueError(f"speed must be within 0.5..2.0, got {self.speed}")
        self.flow.validate()
        if self.vocoder_window_frames < 0:
            raise ValueError("vocoder_window_frames must be >= 0")
        if self.max_decode_tokens < 1 or self.max_request_s <= 0:
            raise ValueError("max_decode_tokens and max_request_s must be positive")
        if self.max_piece_tokens < 1:
            raise ValueError(f"max_piece_tokens must be >= 1, got {self.max_piece_tokens}")
        if self.output_dtype not in ("float32", "int16"):
            raise ValueError(f"output_dtype must be float32 or int16, got {self.output_dtype!r}")

    def replace(self, **changes: object) -> SynthesisOptions:
        """Return a copy with ``changes`` applied; a stage record may be changed in part by a
        mapping of its fields, e.g. ``replace(flow={"schedule": {"steps": 4}})``."""
        return _replaced(self, changes)


@dataclass(frozen=True)
class EngineOptions:
    """How the model directory is loaded (fixed for the engine's life; per request:
    :class:`SynthesisOptions`).

    Attributes:
        llm_precision: which LLM graph to load: ``fp32`` (llm.onnx), ``int8`` (llm_int8.onnx,
            the CPU default recommended by the export's model card) or ``q4`` (llm_q4.onnx).
        llm_graph: ``published`` runs the LLM file of ``llm_precision`` as shipped; ``fused``
            derives once (into ``cache_dir``) a graph with fused onnxruntime operators from
            it: same weights and numbers (lossless: log-probs equal to float rounding, and
            to the published int8 graph's own rounding of activations), about 11 instead of
            90 nodes per layer; ``fused-q4`` the same graph with 4-bit weights (lossy,
            deviation measured at derivation and logged). Not derivable (q4 file, another
            structure, failed validation): the published graph, with one warning. See
            :mod:`.derive.llm.fused`. ``fused-b8``: the int8 weights as published in 8-bit
            blocks (``MatMulNBits``), activations quantised per block instead of per tensor
            (no further from float activations than the published graph; validated when
            derived); a faster one-row kernel on some CPUs.
        llm_prefill_graph: the LLM graph that prefills prompts (several positions per call),
            when it is not ``llm_graph`` (None: the same graph); both graphs share the KV-cache
            layout, so decoding continues the other graph's cache. Per-tensor int8 products
            (``fused``) prefill several times faster than ``MatMulNBits`` on CPUs with AMX or
            VNNI, while ``fused-b8`` or ``fused-q4`` may decode faster; the second graph holds
            its own copy of the weights (0.36 GB at full size).
        llm_decode_candidates: further LLM graphs that may decode instead of ``llm_graph``:
            each is loaded and real decode steps of all of them are timed at load
            (:mod:`.llm.graph_choice`, about 0.5 s a graph at full size, and as much again for
            two-row steps of the graphs that decode two pieces at once with
            ``llm_pair_pieces``); the cheapest per token of a long answer decodes (within 10 %
            of it: the graph streaming clearly fewer bytes, then ``llm_graph``), the others
            are closed. The prefill graph stays ``llm_prefill_graph``, else
            ``llm_graph``. Empty (default): ``llm_graph`` decodes, nothing is timed.
        llm_pair_pieces: decode two pieces of a request at once, in two-row steps of the decode
            graph (:mod:`.llm.tokens`; one pass over the weights serves both), where that graph
            gives each row exactly the logits of its own one-row step (checked at load: the
            ``fused-q4`` form; not the published graphs, not ``fused``, whose int8 activation
            scale spans the rows). Exact: each piece's tokens are those it gets decoded alone
            with the same generator. False: one piece at a time.
        flow: the flow record most requests will run with (the server's preset's
            :attr:`SynthesisOptions.flow`). The graphs it needs are opened at start: the DiT
            estimator of its ``precision`` (a request asking for the other precision loads that on
            first use), and for a ``chunk_causal`` record (e.g. ``quality``'s) the streaming DiT of
            that precision, derived once into ``cache_dir``. The streaming DiT then also serves that
            precision's full-attention passes (final chunks, one-shot requests;
            :mod:`.derive.flow.full_attention`: equal to the published estimator up to float
            rounding, checked when derived), so the published estimator is not loaded: one copy of
            the DiT weights instead of two (0.76 GB fp32 at full size). Not derivable: the published
            estimator, with one warning.
        read_numbers: requests will read numbers as words (the server's preset's
            :attr:`SynthesisOptions.read_numbers`): the number readers (wetext, about 0.5 s)
            load at start, off the first request's path.
        threads: intra-op threads per onnxruntime session; 0 lets onnxruntime choose
            (one per physical core).
        spin_wait: let idle onnxruntime worker threads spin before sleeping, as onnxruntime
            does by default: lowest latency for one busy session, but spinning threads steal
            the core from a concurrent session. False: they spin only briefly between a run's
            operators and not after the run (:data:`.sessions.BRIEF_SPIN_US`; not at all on
            an onnxruntime before 1.26).
        split_cores: decode each request's speech tokens in a thread of its own (a bounded
            queue) while the calling thread runs the flow and the vocoder on the tokens
            already decoded, every session with ``threads`` intra-op threads and ``spin_wait``
            off (a thread spinning between runs would hold a core the other kind of work is
            waiting for; the operating system shares the cores between the memory-bound
            decoding and the compute-bound flow). Same tokens, audio and chunks as without it
            at the same ``threads`` (only that thread calls the LLM and draws from the
            request's generator; the vocoder's deferral still follows the wall clock). On the 2-core
            Xeon of BENCHMARKS.md ("Both cores busy: decoding beside the flow") it took
            ``balanced``'s streamed paragraph from 50.6 to 43.2 s; giving each kind of work
            half of the cores instead (one thread each) took it to 47.6 s. One extra thread per
            request in flight. Where ``llm_decode_candidates`` are timed at load, the
            decode graph may run on one intra-op thread instead, where a step there takes
            little longer (:func:`.llm.graph_choice.decodes_on_one_thread`; on the 2-core
            Zen 4 of BENCHMARKS.md it made ``balanced``'s paragraph in 0.92x the time,
            "One thread for the decoding beside the flow"). The server turns it on where it
            may use 2 or more CPUs
            (``--no-split-cores`` turns it off); ``--preset auto`` predicts with it
            (:meth:`.machine.StageSplit.rtf`).
        providers: onnxruntime execution providers in order of preference; the CPU provider
            is always appended as the fallback.
        cache_dir: where derived files go. ``None``: a bare engine; the forms below stay
            off and the streaming DiT cannot be made (the published fp32 estimator with full
            attention; one warning when chunk-causal or int8 was asked for); a form asked for
            by name (a fused LLM graph) goes to the model directory if writable, else
            ``~/.cache/wyoming-cosyvoice3``.
        mmap_embeddings: with a ``cache_dir``, serve the text embedding from a memory-mapped
            table extracted once from text_embedding_fp16.onnx (only when the graph is a
            plain Gather [+ Cast], so the output is bit-identical; otherwise the graph).
        stream_vocoder: with a ``cache_dir``, derive once the streamed form of hift.onnx
            (:mod:`.derive.vocoder.hift_stream`): convolution context, delay lines and the
            source phase carried as state, so streaming runs each mel frame once (about one
            call's cost) and equals one call up to float rounding (validated when derived).
            Off or not derivable (one warning): calls of hift.onnx as published, over all mel
            so far or ``SynthesisOptions.vocoder_window_frames`` of it.
        voice_cache_dir: directory for cached voice features; ``None`` disables the disk cache.
        voice_process: prepare new voices in a child process (:mod:`.voice.worker`): the
            encoder sessions never load in this process (no share of its interpreter lock,
            heap or CPU priority), and their memory is returned when the child exits. Costs
            the child's start (about 1 s) per batch of preparations.
            The server sets it; off, voices are prepared in the calling thread.
        load_voice_encoders: load campplus and speech_tokenizer_v3 at start (True) or only
            while a new voice is prepared (False, saves memory on small boards). With
            ``voice_process`` True keeps the voice encoder process running instead.
        observer: callbacks the engine makes while it works, and the benchmark's fixed
            decoding length (:class:`EngineObserver`); ``None`` = nobody watches.
    """

    llm_precision: LlmPrecision = "int8"
    llm_graph: LlmGraph = "published"
    llm_prefill_graph: LlmGraph | None = None
    llm_decode_candidates: tuple[LlmGraph, ...] = ()
    llm_pair_pieces: bool = True
    flow: FlowPreset = FlowPreset()
    read_numbers: bool = True
    threads: int = 0
    spin_wait: bool = True
    split_cores: bool = False
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    cache_dir: Path | None = None
    mmap_embeddings: bool = True
    stream_vocoder: bool = True
    voice_cache_dir: Path | None = None
    voice_process: bool = False
    load_voice_encoders: bool = False
    observer: EngineObserver | None = field(default=None, compare=False)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option when a value is out of range."""
        if self.llm_precision not in LLM_FILES:
            raise ValueError(
                f"llm_precision must be one of {sorted(LLM_FILES)}, got {self.llm_precision!r}"
            )
        for name, value in (("llm_graph", self.llm_graph),
                            ("llm_prefill_graph", self.llm_prefill_graph)):
            if value is not None and value not in LLM_GRAPHS:
                raise ValueError(f"{name} must be one of {', '.join(LLM_GRAPHS)}, got {value!r}")
        for value in self.llm_decode_candidates:
            if value not in LLM_GRAPHS:
                raise ValueError(f"llm_decode_candidates must be of {', '.join(LLM_GRAPHS)}, "
                                 f"got {value!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        self.flow.validate()

    def for_sessions(self, cpus: int) -> EngineOptions:
        """These options as every session opens them: unchanged without ``split_cores``; with
        it, ``spin_wait`` off and ``threads`` as given (for 0, ``cpus``, the CPUs this process
        may run on), the LLM's sessions and the flow's and vocoder's alike (the operating
        system shares the cores between the decoding thread and the calling thread)."""
        if not self.split_cores:
            return self
        return dataclasses.replace(self, threads=self.threads or max(1, cpus), spin_wait=False)


# -- presets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A named preset: one record per stage. The README's presets table shows the values with
    what each costs and how far it moves from the exact path; BENCHMARKS.md has the
    measurements behind them."""

    llm: LlmPreset
    flow: FlowPreset
    vocoder: VocoderPreset

    def options(self) -> SynthesisOptions:
        """The request options of this preset (every caller field at its default)."""
        return SynthesisOptions(llm=self.llm, flow=self.flow, vocoder=self.vocoder,
                                vocoder_window_frames=self.vocoder.window_frames)


PRESET_STAGES: dict[str, Preset] = {
    # upstream's PyTorch streaming exactly, so that parity with upstream can be tested
    "quality": Preset(
        llm=LlmPreset(graph="fused"),
        flow=FlowPreset(
            precision="fp32", schedule=EulerSchedule(C.DEFAULT_EULER_STEPS, C.DEFAULT_CFG_RATE),
            chunk_causal=True, final_chunk_causal=False,
            prompt_tokens=0, left_context_tokens=0, fallback=FlowFallback(),
            first_hop_tokens=25, first_hop_on_chunk_grid=True, whole_middle_pieces=False,
        ),
        vocoder=VocoderPreset(window_frames=0),
    ),
    # the default: each lever cuts work per chunk at the smallest deviation from the exact path.
    # 103 prompt tokens = 4 s + the 3 lookahead tokens: the prompt frames that do not depend on
    # the generated tokens, 2 x (103 - 3) = 200, end on the 50-frame chunk grid, so all of them
    # are cached (solver.cacheable_prompt_frames) and a piece's first chunk runs only the
    # prompt's last 6 frames again, not a whole 50-frame block (100 tokens cached 150 frames)
    "balanced": Preset(
        llm=LlmPreset(graph="fused"),
        flow=FlowPreset(
            precision="int8", schedule=EulerSchedule(4, C.DEFAULT_CFG_RATE),
            chunk_causal=True, final_chunk_causal=True,
            prompt_tokens=103, left_context_tokens=50,
            fallback=FlowFallback(prompt_tokens=25, left_context_tokens=10),
            first_hop_tokens=10, first_hop_on_chunk_grid=False, whole_middle_pieces=True,
        ),
        vocoder=VocoderPreset(window_frames=24),
    ),
    # lowest latency, lossy in every stage. Chunks of at most 40 tokens (1.6 s) instead of
    # upstream's 100: a 4 s chunk is made in one go while the client's queue runs down, and
    # the first piece is held for the last chunk it expects (BENCHMARKS.md "Chunks of at most
    # 40 tokens for fast": the sentence heard 0.45 s sooner, 0.03 dB further from the exact
    # path over the paragraph)
    "fast": Preset(
        llm=LlmPreset(graph="fused-q4", decode_graphs=("fused-q4", *LOSSLESS_LLM_GRAPHS)),
        flow=FlowPreset(
            precision="int8", schedule=EulerSchedule(2, C.DEFAULT_CFG_RATE),
            chunk_causal=True, final_chunk_causal=True,
            prompt_tokens=15, left_context_tokens=5, fallback=FlowFallback(),
            first_hop_tokens=8, max_hop_tokens=40, first_hop_on_chunk_grid=False,
            whole_middle_pieces=True,
        ),
        vocoder=VocoderPreset(window_frames=16),
    ),
}
"""The presets, one record per stage (documented in the README's presets table)."""

PRESETS: dict[str, SynthesisOptions] = {
    name: preset.options() for name, preset in PRESET_STAGES.items()
}
"""Each preset's request options (:meth:`Preset.options`)."""

PRESET_LLM_GRAPHS: dict[str, LlmGraph] = {
    name: preset.llm.graph for name, preset in PRESET_STAGES.items()
}
"""The LLM graph each preset loads unless ``--llm-graph`` names one (:attr:`LlmPreset.graph`)."""


# -- records between the stages and for the caller -------------------------------------------

ShouldStop = Callable[[], bool]
"""Cancellation callable: checked before every model step; True stops the request."""

PromptMode = Literal["zero_shot", "cross_lingual", "instruct"]


@dataclass
class StageTimes:
    """Wall-clock seconds spent per stage of one request (filled as the request runs)."""

    frontend_s: float = 0.0
    llm_prefill_s: float = 0.0
    llm_decode_s: float = 0.0
    llm_tokens: int = 0
    flow_s: float = 0.0
    flow_calls: int = 0
    vocoder_s: float = 0.0
    vocoder_calls: int = 0
    vocoder_frames: int = 0
    """Mel frames the vocoder ran over, summed over its calls (re-run frames count again)."""
    events: list[tuple[str, float, float]] = field(default_factory=list)
    """(stage, start_s, end_s) relative to the request start, for timelines."""


@dataclass(frozen=True)
class VoiceFeatures:
    """Features of one reference clip, computed once and cached (spec section 2).

    Attributes:
        speech_tokens: int64 [L], 25 Hz speech tokens of the clip (frontend.py
            _extract_speech_token), trimmed so that ``prompt_mel`` has exactly 2L frames.
        speaker_embedding: float32 [192], CAM++ embedding (frontend.py _extract_spk_embedding),
            not normalised (the flow path L2-normalises it).
        prompt_mel: float32 [2L, 80], 50 frames/s natural-log mel of the 24 kHz clip
            (frontend.py _extract_speech_feat).
    """

    speech_tokens: npt.NDArray[np.int64]
    speaker_embedding: npt.NDArray[np.float32]
    prompt_mel: npt.NDArray[np.float32]


@dataclass(frozen=True)
class VoicePrompt:
    """A prepared voice: its features plus what selects the prompt mode.

    Attributes:
        features: the clip's :class:`VoiceFeatures`.
        transcript: what the clip says; ``None`` makes every request cross-lingual.
        instruction: a style instruction (instruct mode), e.g. "Speak cheerfully."
        name: voice id, for logs.
    """

    features: VoiceFeatures
    transcript: str | None = None
    instruction: str | None = None
    name: str = "voice"


@dataclass(frozen=True)
class LlmPrompt:
    """What the LLM is prefilled with for one text piece (spec section 4).

    Attributes:
        prompt_text_ids: int64 [P], token ids of the prompt text (may be empty).
        tts_text_ids: int64 [N], token ids of the text to speak (N >= 1); min/max decode
            lengths are 2N and 20N.
        prompt_speech_tokens: int64 [L], the clip's speech tokens (empty unless zero-shot).
        mode: which prompt mode built it.
    """

    prompt_text_ids: npt.NDArray[np.int64]
    tts_text_ids: npt.NDArray[np.int64]
    prompt_speech_tokens: npt.NDArray[np.int64]
    mode: PromptMode


@dataclass
class AudioChunk:
    """One piece of output audio.

    Attributes:
        samples: float32 [N] in [-0.99, 0.99] or int16 [N]; 24 kHz mono.
        sample_rate_hz: always 24000.
        piece_index: index of the text piece (sentence) it belongs to.
        is_last: True on the last chunk of the whole request.
        elapsed_s: seconds from the start of ``synthesize`` to this chunk being ready.
        next_chunk_s: audio seconds the piece's next flow chunk will bring (its next hop
            of speech tokens at 25 per second, divided by the speed); 0 after the piece's
            last chunk. A consumer that holds audio until a piece can play through uses it
            for the wait until the next chunk.
        piece_done: True on the last chunk of its piece (the piece's audio is complete).
        piece_left_s: audio seconds of the piece still to come after this chunk, known once
            the LLM has decoded all of the piece's tokens (their count at 25 per second,
            divided by the speed, less the piece's audio so far; a few tokens the silent-run
            filter may still drop make it err long); None while the piece is still being
            decoded; 0 on its last chunk. With ``split_cores`` the decoding runs ahead of the
            flow, so a piece is often complete in tokens long before it is in audio.
        decoding_done: the request's LLM decoding had finished when the chunk was made: no
            decoding runs beside the flow and the vocoder for the rest of the request (with
            ``split_cores``, the flow then has the cores to itself).
        piece_decoded_s: audio seconds of the piece's speech tokens the LLM had decoded when
            the chunk was made (their count at 25 per second, divided by the speed); with
            ``split_cores`` the decoding runs ahead of the audio, and a consumer tells from
            two chunks how fast it goes and when the piece's decoding will end. 0 on a
            piece's last chunk.
    """

    samples: np.ndarray
    sample_rate_hz: int
    piece_index: int
    is_last: bool
    elapsed_s: float
    next_chunk_s: float = 0.0
    piece_done: bool = False
    piece_left_s: float | None = None
    decoding_done: bool = False
    piece_decoded_s: float = 0.0


@dataclass
class SynthesisResult:
    """Summary of one finished request (returned by ``Synthesis.result``)."""

    audio_s: float = 0.0
    first_chunk_s: float | None = None
    total_s: float = 0.0
    pieces: int = 0
    times: StageTimes = field(default_factory=StageTimes)

    @property
    def rtf(self) -> float:
        """Real-time factor: processing seconds per second of audio (0 if no audio)."""
        return self.total_s / self.audio_s if self.audio_s > 0 else 0.0


# -- the observer ---------------------------------------------------------------------------

class EngineObserver:
    """Callbacks made by :class:`~.pipeline.CosyVoice3Engine` (override what you need)."""

    observes_graph_runs: bool = False
    """True to receive :meth:`graph_run` for every ONNX run of the process (installed at
    :meth:`CosyVoice3Engine.load <.pipeline.CosyVoice3Engine.load>`; process-wide, as the
    graph wrappers are shared)."""

    def graph_run(
        self, graph_path: str, feeds: Mapping[str, np.ndarray], start_s: float, end_s: float
    ) -> None:
        """One graph run: the file its session runs (can be a derived copy), the feeds, and
        its start and end in ``time.time()`` seconds."""

    def voice_prepared(self, name: str, seconds: float) -> None:
        """A voice's features were computed or loaded from the cache in ``seconds``."""

    def request_finished(self, text: str, result: SynthesisResult) -> None:
        """A synthesis request ended (done, failed or cancelled) with these figures."""

    def fixed_speech_tokens(self, piece_text: str) -> int | None:
        """How many speech tokens to decode for one text piece, ignoring the stop token;
        None (the default) decodes until the stop token or the request's cap.

        For measurements only: a model with random weights (the synthetic ones) never stops
        sensibly, so the benchmark fixes the length from the text (``python -m bench``,
        ``--bench-tokens-per-char``). Called once per piece when the request starts.

        Args:
            piece_text: the normalised text of the piece.

        Returns:
            A token count >= 1, or None.
        """
        return None
