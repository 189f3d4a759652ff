"""Autoregressive speech-token decoding with the CosyVoice3 LLM graph and a KV cache, and the
sampling of each token.

Spec section 4. Sources (FunAudioLLM/CosyVoice, commit ace7c47): ``cosyvoice/llm/llm.py``
``Qwen2LM.inference`` (prompt embeddings, length limits) and ``inference_wrapper`` (step loop);
the sampling below. Graph contract: the export's model card (llm*.onnx takes
``inputs_embeds``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.{key,value}`` and
returns ``logits`` of the last position and ``present.{i}.{key,value}``).

The decoder object is shared and stateless with respect to requests: the KV cache, position and
decoded tokens of one request live in a :class:`DecodeState`, the random generator is the
caller's. The state after a voice's fixed prompt prefix is kept in a :class:`PrefixCache`.
A request's tokens, piece after piece (two at a time where the decode graph allows it), come
from :mod:`.tokens`.

KV cache hand-over (``kv_mode``). The graph itself returns ``present = Concat(past, new)``, so
every step writes the whole cache once inside onnxruntime; the host must not add more copies.

* ``"numpy"``: plain ``InferenceSession.run``. Since onnxruntime 1.19 (microsoft/onnxruntime
  PR #20539) the numpy arrays it returns for CPU outputs are views of onnxruntime's own buffers,
  and CPU numpy inputs are used in place, so feeding ``present.*`` back as ``past_key_values.*``
  copies nothing. Measured the fastest path on CPU (no per-step binding overhead).
* ``"iobinding"``: ``present.*`` OrtValues are bound as the next step's inputs with
  ``SessionIOBinding``; no numpy conversion at all. Needed on onnxruntime < 1.19, where
  ``run`` copies every output into a new numpy array: 24 KiB per cached position with the
  published dims (24 layers x key+value x 2 heads x 64 x 4 bytes), 24 MiB per step at 1000
  positions (measured +3.8 ms/step on the tiny model, which has the published KV shapes).
* ``"buffer"``: the cache lives in preallocated buffers (:data:`KV_CAPACITY_STEP` positions at
  a time) that each step reads and extends in place: ``past_key_values.*`` and ``present.*``
  are bound to the same OrtValue, and onnxruntime's ``GroupQueryAttention`` then writes only
  the new position (its past/present shared-buffer mode) instead of copying the whole cache
  into a new ``present``; the logits are bit-identical. Needs every LLM graph of the model to
  be a fused form (``CosyVoice3Model.llm_kv_in_place``); measured 29.8 -> 23.7 ms per step
  at 500 cached positions on the full-size ``fused-b8`` graph (BENCHMARKS.md "LLM decode
  graph").
* ``"auto"`` (default): ``"buffer"`` when the graphs allow it, else ``"numpy"`` on
  onnxruntime >= 1.19 and ``"iobinding"`` before.

Sampling (last section; pure numpy): RAS, stop masking, the silent-run filter and the length
limits. Every function takes the request's own ``numpy.random.Generator`` so that a seed
reproduces a request and concurrent requests never share random state. Sources (same commit):
``cosyvoice/utils/common.py`` ``ras_sampling``, ``nucleus_sampling``, ``random_sampling``
(Repetition-Aware Sampling from VALL-E 2); ``cosyvoice/llm/llm.py`` ``Qwen2LM.sampling_ids`` /
``inference`` / ``inference_wrapper`` (per-step log-softmax, stop-token masking below the
minimum length, length limits); ``cosyvoice/cli/model.py`` ``CosyVoice2Model.llm_job`` (the
silent-run filter). Where a function departs from upstream on purpose, its docstring says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from .. import constants as C
from ..errors import GraphSignatureMismatch, SynthesisCancelled, SynthesisFailed, SynthesisTimeout
from ..options import LlmPrompt, ShouldStop, StageTimes
from ..sessions import ORT_ERRORS

if TYPE_CHECKING:
    from ..model import CosyVoice3Model

_LOGGER = logging.getLogger(__name__)

KvMode = Literal["auto", "iobinding", "numpy", "buffer"]
"""How the KV cache is handed from one step to the next (see the module docstring)."""


# -- state ----------------------------------------------------------------------------------

KvValue = Any
"""One KV tensor: an ``onnxruntime.OrtValue`` (IOBinding path) or a numpy array (fallback)."""
_STEP_ERRORS: tuple[type[BaseException], ...] = (SynthesisFailed, *ORT_ERRORS)

KV_CAPACITY_STEP = 512
"""Positions a ``"buffer"`` cache grows by (24 KiB each with the published dims: 12 MiB): a
prompt and a piece's tokens fit in one or two steps, and a growth copies the cache once."""


@dataclass
class DecodeState:
    """Per-request LLM state: the KV cache and the number of positions it holds.

    Attributes:
        kv: one tensor per ``past_key_values.{i}.{key,value}`` input, in layer order
            (key before value), each float32 [1, kv_heads, past_len, head_dim]; in
            ``"buffer"`` mode OrtValues [1, kv_heads, capacity, head_dim] whose first
            ``past_len`` positions are the cache.
        past_len: positions already in the cache (the next position id).
        tokens: speech tokens generated so far (the RAS window sees all of them).
        in_place: ``kv`` are buffers written in place (``"buffer"`` mode).
        binding: ``"buffer"`` mode: (session, its IOBinding with ``kv`` bound, the logits
            buffer bound as its output) of the last run, reused while the session and the
            buffers stay the same.

    Outside ``"buffer"`` mode the tensors in ``kv`` are never written to after creation
    (every model step allocates new ``present.*`` tensors), so :meth:`fork` shares them; in
    that mode it copies them. :class:`PrefixCache` keeps the state of a voice's fixed prefix
    ``[SOS, prompt text]`` and forks it for each request.
    """

    kv: list[KvValue]
    past_len: int = 0
    tokens: list[int] = field(default_factory=list)
    in_place: bool = False
    binding: tuple[Any, Any, Any] | None = None

    @property
    def capacity(self) -> int:
        """Positions the ``"buffer"`` cache can hold (``past_len`` outside that mode)."""
        if not self.in_place or not self.kv:
            return self.past_len
        return int(self.kv[0].shape()[2])

    def fork(self, extra_capacity: int = KV_CAPACITY_STEP) -> DecodeState:
        """A copy with its own token list: sharing the (immutable) KV tensors, or in
        ``"buffer"`` mode holding a copy of the cache with room for ``extra_capacity`` more
        positions."""
        if not self.in_place:
            return DecodeState(kv=list(self.kv), past_len=self.past_len,
                               tokens=list(self.tokens))
        return DecodeState(kv=[_kv_buffer(value, self.past_len, self.past_len + extra_capacity)
                               for value in self.kv],
                           past_len=self.past_len, tokens=list(self.tokens), in_place=True)


def _kv_buffer(value: KvValue | None, valid: int, capacity: int, like: tuple[int, ...] = ()
               ) -> KvValue:
    """A new float32 [1, kv_heads, capacity, head_dim] OrtValue with the first ``valid``
    positions of ``value`` (an OrtValue or array; None: zeros shaped ``like``)."""
    if value is None:
        buffer = np.zeros((*like[:2], capacity, like[3]), np.float32)
    else:
        source = value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)
        buffer = np.zeros((*source.shape[:2], capacity, source.shape[3]), np.float32)
        buffer[:, :, :valid] = source[:, :, :valid]
    return ort.OrtValue.ortvalue_from_numpy(buffer)


@dataclass
class PairState:
    """Two sequences' KV caches in one batch of two rows (``"buffer"`` mode), for steps that
    decode both in one pass over the weights (:meth:`LlmDecoder.step_pair`).

    Attributes:
        arrays: one float32 [2, kv_heads, capacity, head_dim] numpy buffer per
            ``past_key_values.{i}.{key,value}`` input; row ``r``'s first ``lens[r]`` positions
            are its cache (the rest is padding the graph does not read).
        values: OrtValues over the same memory, bound as past and present.
        lens: positions each row holds (its next position id).
        binding: (session, IOBinding, logits buffer [2, V]) of the last step, reused while
            the session and the buffers stay the same.
    """

    arrays: list[np.ndarray]
    values: list[Any]
    lens: list[int]
    binding: tuple[Any, Any, Any] | None = None

    @property
    def capacity(self) -> int:
        """Positions each row can hold."""
        return int(self.arrays[0].shape[2])


def _pair_buffers(rows: Sequence[Sequence[np.ndarray]], lens: Sequence[int], capacity: int
                  ) -> tuple[list[np.ndarray], list[Any]]:
    """New [2, kv_heads, capacity, head_dim] buffers holding each row's first ``lens[r]``
    positions of ``rows[r]`` (per input, arrays [1 or 2, kv_heads, >= len, head_dim])."""
    arrays, values = [], []
    for parts in zip(*rows, strict=True):
        first = parts[0]
        buffer = np.zeros((2, first.shape[1], capacity, first.shape[3]), np.float32)
        for r, (part, n) in enumerate(zip(parts, lens, strict=True)):
            buffer[r, :, :n] = part[min(r, part.shape[0] - 1), :, :n]
        arrays.append(buffer)
        values.append(ort.OrtValue.ortvalue_from_numpy(buffer))
    return arrays, values


class PrefixCache:
    """Thread-safe LRU map ``prompt-text ids -> DecodeState`` after the prefix.

    Every LLM prompt starts with ``[speech_emb(SOS), text_emb(prompt text)]`` (spec section 4):
    for a zero-shot voice the prompt text is ``SYS + transcript`` and is the same for every
    request of that voice. Its KV cache is computed once and each request continues from a fork
    of it (:meth:`DecodeState.fork`: the KV tensors are immutable and shared).

    The decoder always prefills in two calls (prefix, then the rest), whether or not the cache is
    enabled, so cached and uncached requests see bit-identical logits. With dynamic int8
    quantisation one call and two calls are not bit-identical (activations are quantised per
    tensor over the positions of one call); the benchmark's "levers" section records the
    difference.

    Size: 24 KiB per cached position with the published dims (24 layers x key+value x 2 heads x
    64 x 4 bytes), e.g. 0.9 MiB for a 40-token transcript. One cache per decoder = per LLM
    precision; entries are keyed by the prompt-text ids, least recently used dropped first.

    Args:
        max_entries: entries kept (0 disables the cache: :meth:`get` always misses).
    """

    def __init__(self, max_entries: int = 16) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, DecodeState] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(prompt_text_ids: npt.ArrayLike) -> bytes:
        """Cache key of a prompt text: its int64 ids as bytes."""
        return np.asarray(prompt_text_ids, dtype=np.int64).reshape(-1).tobytes()

    def get(self, key: bytes) -> DecodeState | None:
        """A fork of the cached state (the caller may extend it), or None."""
        with self._lock:
            state = self._entries.get(key)
            if state is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return state.fork()

    def put(self, key: bytes, state: DecodeState) -> None:
        """Store a fork of ``state`` (taken right after the prefix prefill)."""
        if self.max_entries == 0:
            return
        with self._lock:
            self._entries[key] = state.fork(extra_capacity=0)  # compact; get() adds room
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


# -- decoding -------------------------------------------------------------------------------

def run_outputs_are_zero_copy(version: str = ort.__version__) -> bool:
    """True when ``InferenceSession.run`` returns CPU outputs without copying them.

    onnxruntime >= 1.19 (PR #20539, "numpy array over CPU OrtValues on return values").
    """
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) >= (1, 19)


class LlmDecoder:
    """Prefill and step the LLM graph of a loaded model; decode speech tokens with RAS.

    Args:
        model: the loaded :class:`~..model.CosyVoice3Model` (its ``llm``, ``text_embedding``,
            ``speech_embedding`` graphs and ``dims`` are used; nothing is stored per request).
        kv_mode: ``"auto"``, ``"iobinding"`` or ``"numpy"`` (module docstring); both paths
            give bit-identical logits.
        prefix_cache_entries: voices whose prefix KV is kept (:class:`PrefixCache`; 0 = off).
        pair_pieces: let the pipeline decode two pieces of a request at once
            (:mod:`.tokens`) where the decode graph allows it (:attr:`pairs_pieces`).

    Attributes:
        pairs_pieces: two pieces decode together: ``pair_pieces``, ``"buffer"`` mode, and the
            check passed, or the graph's two-row steps were validated when it was derived
            (``fused-b8``, whose multi-row kernel sums in another order:
            ``CosyVoice3Model.llm_rows_validated``). False on graphs with one batch row (the
            published ones) and on ``fused``, whose per-tensor activation scale spans the rows.

    Raises:
        GraphSignatureMismatch: the LLM graph lacks an input/output the dims imply.
        ValueError: unknown ``kv_mode``.
    """

    def __init__(
        self, model: CosyVoice3Model, *, kv_mode: KvMode = "auto", prefix_cache_entries: int = 16,
        pair_pieces: bool = True,
    ) -> None:
        if kv_mode not in ("auto", "iobinding", "numpy", "buffer"):
            raise ValueError(
                f"kv_mode must be 'auto', 'iobinding', 'numpy' or 'buffer', got {kv_mode!r}")
        in_place = model.llm_kv_in_place
        if kv_mode == "buffer" and not in_place:
            raise ValueError("kv_mode 'buffer' needs fused LLM graphs (llm_kv_in_place)")
        self._model = model
        self._dims = model.dims
        self._llm = model.llm
        self._prefill_llm = model.llm_prefill or model.llm
        if kv_mode == "auto":
            kv_mode = ("buffer" if in_place
                       else "numpy" if run_outputs_are_zero_copy() else "iobinding")
        self.kv_mode: KvMode = kv_mode
        self._use_iobinding = kv_mode == "iobinding"
        layers = range(self._dims.num_layers)
        self._past_names = [
            f"past_key_values.{i}.{kind}" for i in layers for kind in ("key", "value")
        ]
        self._present_names = [f"present.{i}.{kind}" for i in layers for kind in ("key", "value")]
        self._output_names = ["logits", *self._present_names]
        self._check_names()
        self.prefix_cache = PrefixCache(prefix_cache_entries)
        self.pairs_pieces = False
        self.rows_exact = False
        """Two-row steps give each row exactly its one-row logits (checked at load)."""
        if pair_pieces and kv_mode == "buffer":
            exact = self._rows_exact()
            self.rows_exact = bool(exact)
            self.pairs_pieces = exact is not None and (exact or model.llm_rows_validated)

    def _check_names(self) -> None:
        session = self._llm.session
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        need_in = {"inputs_embeds", "attention_mask", "position_ids", *self._past_names}
        missing = sorted(need_in - inputs) + sorted(set(self._output_names) - outputs)
        if missing:
            raise GraphSignatureMismatch(
                f"{self._llm.path}: expected LLM inputs/outputs for {self._dims.num_layers} layers "
                f"are missing: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; "
                "use the llm*.onnx files of the Fun-CosyVoice3-0.5B-2512 ONNX export"
            )

    # --- embeddings -----------------------------------------------------------------------

    def embed_text(self, ids: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Text embeddings float32 [1, n, hidden] of text token ids int64 [n] (n may be 0)."""
        return self._embed(self._model.text_embedding, ids)

    def embed_speech(self, ids: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Speech embeddings float32 [1, n, hidden] of speech/special ids int64 [n]."""
        return self._embed(self._model.speech_embedding, ids)

    def _embed(self, graph: Any, ids: npt.ArrayLike) -> npt.NDArray[np.float32]:
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if flat.size == 0:
            return np.zeros((1, 0, self._dims.hidden_size), dtype=np.float32)
        out = graph.run({"input_ids": flat[None, :]}, ["inputs_embeds"])["inputs_embeds"]
        return np.ascontiguousarray(out, dtype=np.float32)

    def prefix_embeddings(self, prompt: LlmPrompt) -> npt.NDArray[np.float32]:
        """Embeddings of the voice's fixed prefix ``[speech_emb(SOS), text_emb(prompt text)]``.

        float32 [1, 1 + P, hidden]. Text embedding is a per-token lookup, so embedding the
        prompt text apart from the tts text equals embedding their concatenation.
        """
        sos = self.embed_speech([C.SOS_TOKEN])
        return np.concatenate([sos, self.embed_text(prompt.prompt_text_ids)], axis=1)

    def request_embeddings(self, prompt: LlmPrompt) -> npt.NDArray[np.float32]:
        """Embeddings after the voice prefix, float32 [1, N + 1 + L, hidden]:
        ``[text_emb(tts text), speech_emb([TASK] ++ prompt speech tokens)]``.
        """
        speech_ids = np.concatenate(
            [np.array([C.TASK_TOKEN], dtype=np.int64), np.asarray(prompt.prompt_speech_tokens)]
        )
        return np.concatenate(
            [self.embed_text(prompt.tts_text_ids), self.embed_speech(speech_ids)], axis=1
        )

    def prompt_embeddings(self, prompt: LlmPrompt) -> npt.NDArray[np.float32]:
        """The whole LLM input of spec section 4, float32 [1, 1 + P + N + 1 + L, hidden]:
        ``[speech_emb(SOS), text_emb(prompt_text ++ tts_text), speech_emb(TASK),
        speech_emb(prompt_speech_tokens)]`` (llm.py ``Qwen2LM.inference``, ``lm_input``)."""
        return np.concatenate(
            [self.prefix_embeddings(prompt), self.request_embeddings(prompt)], axis=1
        )

    # --- model steps ----------------------------------------------------------------------

    def new_state(self) -> DecodeState:
        """An empty state: past tensors float32 [1, kv_heads, 0, head_dim] (in ``"buffer"``
        mode buffers of :data:`KV_CAPACITY_STEP` positions)."""
        shape = (1, self._dims.num_kv_heads, 0, self._dims.head_dim)
        if self.kv_mode == "buffer":
            return DecodeState(kv=[_kv_buffer(None, 0, KV_CAPACITY_STEP, shape)
                                   for _ in self._past_names], in_place=True)
        empty = np.zeros(shape, dtype=np.float32)
        if self._use_iobinding:
            kv: list[KvValue] = [ort.OrtValue.ortvalue_from_numpy(empty) for _ in self._past_names]
        else:
            kv = [empty for _ in self._past_names]
        return DecodeState(kv=kv)

    def prefill(self, state: DecodeState, embeds: npt.NDArray[np.float32]) -> np.ndarray:
        """Run the LLM on ``embeds`` after the positions already in ``state``; extend its cache.

        Works from any state, so a prompt can be fed in parts (a cached voice prefix, then the
        request's part): mathematically the same as one call; numerically equal up to rounding
        and, in the int8 graph, the per-call activation quantisation.

        Args:
            state: the request's state (modified: ``kv`` replaced, ``past_len`` advanced).
            embeds: float32 [1, S, hidden], S >= 1.

        Returns:
            logits float32 [V] of the last position.

        Raises:
            SynthesisFailed: onnxruntime failed (names the graph file).
        """
        n_new = int(embeds.shape[1])
        total = state.past_len + n_new
        mask = np.ones((1, total), dtype=np.int64)
        positions = np.arange(state.past_len, total, dtype=np.int64)[None, :]
        embeds = np.ascontiguousarray(embeds, dtype=np.float32)
        graph = self._llm if n_new == 1 else self._prefill_llm
        if state.in_place:
            logits = self._run_in_place(graph, state, embeds, mask, positions)
        elif self._use_iobinding:
            logits = self._run_bound(graph, state, embeds, mask, positions)
        else:
            logits = self._run_numpy(graph, state, embeds, mask, positions)
        state.past_len = total
        return logits

    def prefill_prompt(self, prompt: LlmPrompt) -> tuple[DecodeState, np.ndarray, int]:
        """Prefill a whole prompt in two calls: the voice prefix (from :attr:`prefix_cache`
        when present) and the request part. Returns (state, last logits float32 [V],
        positions prefilled)."""
        key = self.prefix_cache.key(prompt.prompt_text_ids)
        state = self.prefix_cache.get(key)
        if state is None:
            state = self.new_state()
            self.prefill(state, self.prefix_embeddings(prompt))
            self.prefix_cache.put(key, state)
        logits = self.prefill(state, self.request_embeddings(prompt))
        return state, logits, state.past_len

    def step(self, state: DecodeState, token: int) -> np.ndarray:
        """Feed one generated speech token; returns the next logits float32 [V]."""
        return self.prefill(state, self.embed_speech([token]))

    def _run_bound(
        self,
        graph: Any,
        state: DecodeState,
        embeds: np.ndarray,
        mask: np.ndarray,
        positions: np.ndarray,
    ) -> np.ndarray:
        session = graph.session
        binding = session.io_binding()
        binding.bind_cpu_input("inputs_embeds", embeds)
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_cpu_input("position_ids", positions)
        for name, value in zip(self._past_names, state.kv, strict=True):
            binding.bind_ortvalue_input(name, value)
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        try:
            graph.run_bound(binding, {"inputs_embeds": embeds, "attention_mask": mask,
                                      "position_ids": positions})
            outputs = binding.get_outputs()
        except SynthesisFailed as exc:
            raise SynthesisFailed(
                f"LLM graph {graph.path} failed at position {state.past_len}: {exc}; "
                "check the model files (re-download) or try another llm_precision"
            ) from exc
        state.kv = list(outputs[1:])
        return np.asarray(outputs[0].numpy()).reshape(-1)

    def _run_in_place(
        self,
        graph: Any,
        state: DecodeState,
        embeds: np.ndarray,
        mask: np.ndarray,
        positions: np.ndarray,
    ) -> np.ndarray:
        needed = state.past_len + int(embeds.shape[1])
        if needed > state.capacity:  # grow: one copy of the cache
            capacity = needed + KV_CAPACITY_STEP
            state.kv = [_kv_buffer(value, state.past_len, capacity) for value in state.kv]
            state.binding = None
        session = graph.session
        if state.binding is None or state.binding[0] is not session:
            state.binding = self._bind_in_place(session, state.kv, 1)
        _, binding, logits_value = state.binding
        binding.bind_cpu_input("inputs_embeds", embeds)
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_cpu_input("position_ids", positions)
        try:
            graph.run_bound(binding, {"inputs_embeds": embeds, "attention_mask": mask,
                                      "position_ids": positions})
        except SynthesisFailed as exc:
            raise SynthesisFailed(
                f"LLM graph {graph.path} failed at position {state.past_len}: {exc}; "
                "check the model files (re-download) or try another llm_precision"
            ) from exc
        return np.array(logits_value.numpy(), np.float32).reshape(-1)  # a copy: reused

    def _bind_in_place(self, session: Any, values: Sequence[Any], rows: int
                       ) -> tuple[Any, Any, Any]:
        """(session, its IOBinding, a logits buffer [rows, V]) with every cache buffer in
        ``values`` bound as both past and present: onnxruntime's GroupQueryAttention then
        writes only the new positions into it."""
        binding = session.io_binding()
        for past, present, value in zip(self._past_names, self._present_names, values,
                                        strict=True):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)  # the same buffer: in place
        logits_value = ort.OrtValue.ortvalue_from_numpy(
            np.zeros((rows, self._dims.speech_vocab_rows), np.float32))
        binding.bind_ortvalue_output("logits", logits_value)
        return session, binding, logits_value

    def _run_numpy(
        self,
        graph: Any,
        state: DecodeState,
        embeds: np.ndarray,
        mask: np.ndarray,
        positions: np.ndarray,
    ) -> np.ndarray:
        feeds = {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": positions}
        feeds.update(zip(self._past_names, state.kv, strict=True))
        outputs = graph.run(feeds, self._output_names)
        state.kv = [outputs[name] for name in self._present_names]
        return np.asarray(outputs["logits"]).reshape(-1)

    # --- two sequences per step ------------------------------------------------------------

    def pair_states(self, first: DecodeState, second: DecodeState) -> PairState:
        """One :class:`PairState` holding copies of two ``"buffer"`` states' caches (row 0:
        ``first``), with room for :data:`KV_CAPACITY_STEP` more positions each."""
        lens = [first.past_len, second.past_len]
        rows = [[value.numpy() for value in state.kv] for state in (first, second)]
        arrays, values = _pair_buffers(rows, lens, max(lens) + KV_CAPACITY_STEP)
        return PairState(arrays=arrays, values=values, lens=lens)

    def unpair(self, pair: PairState, row: int, tokens: list[int]) -> DecodeState:
        """A ``"buffer"`` state of its own for ``row`` of ``pair`` (a copy of its cache), with
        ``tokens`` as its decoded tokens."""
        n = pair.lens[row]
        kv = [_kv_buffer(array[row:row + 1], n, n + KV_CAPACITY_STEP) for array in pair.arrays]
        return DecodeState(kv=kv, past_len=n, tokens=tokens, in_place=True)

    def step_pair(self, pair: PairState, tokens: tuple[int, int]) -> np.ndarray:
        """Feed one generated speech token to each row of ``pair`` in one run of the decode
        graph; returns the next logits float32 [2, V] (row order as ``pair``).

        Raises:
            SynthesisFailed: onnxruntime failed (names the graph file).
        """
        if max(pair.lens) + 1 > pair.capacity:  # grow: one copy of both caches
            pair.arrays, pair.values = _pair_buffers(
                [pair.arrays, pair.arrays], pair.lens, pair.capacity + KV_CAPACITY_STEP)
            pair.binding = None
        embeds = np.ascontiguousarray(
            self.embed_speech(list(tokens)).reshape(2, 1, self._dims.hidden_size))
        total = max(pair.lens) + 1
        mask = np.zeros((2, total), np.int64)
        for row, n in enumerate(pair.lens):
            mask[row, :n + 1] = 1  # right-padded: the shorter row's trailing zeros
        positions = np.array(pair.lens, np.int64)[:, None]
        session = self._llm.session
        if pair.binding is None or pair.binding[0] is not session:
            pair.binding = self._bind_in_place(session, pair.values, 2)
        _, binding, logits_value = pair.binding
        feeds: dict[str, np.ndarray] = {
            "inputs_embeds": embeds, "attention_mask": mask, "position_ids": positions}
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        try:
            self._llm.run_bound(binding, feeds)
        except SynthesisFailed as exc:
            raise SynthesisFailed(
                f"LLM graph {self._llm.path} failed at positions {pair.lens}: {exc}; "
                "check the model files (re-download) or try another llm_precision"
            ) from exc
        pair.lens = [n + 1 for n in pair.lens]
        return np.array(logits_value.numpy(), np.float32)  # a copy: the buffer is reused

    def _rows_exact(self) -> bool | None:
        """Whether a two-row step of the decode graph gives each row exactly the logits of
        its own one-row step: two seeded sequences of 3 and 2 positions, one more step each,
        alone and paired (a few ms on the full-size model). None when the graph cannot run
        two rows (a fixed batch of one row)."""
        hidden = self._dims.hidden_size
        embeds = np.random.default_rng(0).standard_normal((5, hidden)).astype(np.float32)
        try:
            states = [self.new_state(), self.new_state()]
            for state, rows in zip(states, (embeds[:3], embeds[3:]), strict=True):
                for row in rows:
                    self._step_embeds(state, row)
            pair = self.pair_states(*states)
            alone = [self.step(state, token) for state, token in zip(states, (1, 2), strict=True)]
            paired = self.step_pair(pair, (1, 2))
        except _STEP_ERRORS as exc:
            _LOGGER.debug("LLM graph %s decodes one row per step: %s", self._llm.path, exc)
            return None
        exact = all(np.array_equal(paired[row], alone[row]) for row in (0, 1))
        _LOGGER.debug("LLM graph %s: two rows per step %s", self._llm.path,
                      "give each row's own logits" if exact else "differ from one row's")
        return exact

    def _step_embeds(self, state: DecodeState, row: np.ndarray) -> None:
        """One decode-graph step on an embedding row float32 [hidden] (the exactness check)."""
        n = state.past_len
        self._run_in_place(self._llm, state, row.reshape(1, 1, -1),
                           np.ones((1, n + 1), np.int64), np.array([[n]], np.int64))
        state.past_len = n + 1

    # --- decoding -------------------------------------------------------------------------

    def decode(
        self,
        prompt: LlmPrompt,
        rng: np.random.Generator,
        *,
        should_stop: ShouldStop | None = None,
        max_tokens: int,
        deadline: float | None = None,
        times: StageTimes | None = None,
        fixed_tokens: int | None = None,
    ) -> Iterator[int]:
        """Generate speech tokens for one text piece, yielding each as soon as it is sampled.

        Length limits: ``min_len, max_len = decode_limits(len(prompt.tts_text_ids))`` with
        ``max_len`` further capped at ``max_tokens``; a stop id (>= 6561) is impossible before
        ``min_len`` tokens and ends decoding afterwards (it is not yielded).

        Args:
            prompt: the piece's :class:`~..options.LlmPrompt`.
            rng: the request's generator (RAS draws).
            should_stop: checked before every model step (prefill included).
            max_tokens: hard cap on yielded tokens (``SynthesisOptions.max_decode_tokens``).
            deadline: ``time.monotonic()`` value after which no model step starts.
            times: ``llm_prefill_s``, ``llm_decode_s`` and ``llm_tokens`` are added to
                (time spent by the consumer between tokens is not counted).
            fixed_tokens: benchmarks only: decode exactly this many tokens (stop ids masked
                throughout; still capped at ``max_tokens``).

        Yields:
            speech token ids int in [0, 6561).

        Raises:
            SynthesisCancelled: ``should_stop()`` returned True.
            SynthesisTimeout: the deadline passed.
            SynthesisFailed: the graph failed or produced non-finite logits.
        """
        min_len, max_len = decode_limits(len(prompt.tts_text_ids))
        if fixed_tokens is not None:
            min_len = max_len = fixed_tokens
        max_len = min(max_len, max_tokens)
        if max_len <= 0:
            return
        self.check(should_stop, deadline, 0)
        started = time.perf_counter()
        state, logits, n_prompt = self.prefill_prompt(prompt)
        prefill_s = time.perf_counter() - started
        if times is not None:
            times.llm_prefill_s += prefill_s
        decode_s = 0.0
        for step_index in range(max_len):
            started = time.perf_counter()
            if not np.all(np.isfinite(logits)):
                raise SynthesisFailed(
                    f"LLM graph {self._llm.path} produced non-finite logits at step "
                    f"{step_index}; use llm_precision 'fp32' or 'int8' or re-download the model"
                )
            token = sample_step(logits, state.tokens, rng, step_index, min_len)
            sample_s = time.perf_counter() - started
            decode_s += sample_s
            if times is not None:
                times.llm_decode_s += sample_s
            if token >= C.SPEECH_TOKEN_VOCAB:
                break
            state.tokens.append(token)
            if times is not None:
                times.llm_tokens += 1
            yield token
            if step_index + 1 >= max_len:
                break
            self.check(should_stop, deadline, step_index + 1)
            started = time.perf_counter()
            logits = self.step(state, token)
            step_s = time.perf_counter() - started
            decode_s += step_s
            if times is not None:
                times.llm_decode_s += step_s
        n_tokens = len(state.tokens)
        _LOGGER.debug(
            "LLM: %d prompt positions prefilled in %.1f ms; %d tokens (min %d, max %d) "
            "in %.1f ms (%.2f ms/token)",
            n_prompt,
            prefill_s * 1e3,
            n_tokens,
            min_len,
            max_len,
            decode_s * 1e3,
            decode_s * 1e3 / max(n_tokens, 1),
        )

    @property
    def decode_graph_path(self) -> Path:
        """The decode graph's file (for messages)."""
        return Path(self._llm.path)

    def check(self, should_stop: ShouldStop | None, deadline: float | None, step: int) -> None:
        """Raise before model step ``step`` when the request is cancelled or past its deadline.

        Raises:
            SynthesisCancelled: ``should_stop()`` returned True.
            SynthesisTimeout: ``time.monotonic()`` passed ``deadline``.
        """
        if should_stop is not None and should_stop():
            raise SynthesisCancelled(f"LLM decoding cancelled before step {step}")
        if deadline is not None and time.monotonic() > deadline:
            raise SynthesisTimeout(
                f"LLM decoding passed the request deadline at step {step}; raise "
                "max_request_s or send shorter text"
            )


# -- sampling -------------------------------------------------------------------------------

FloatArray = npt.NDArray[np.floating]


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Numerically stable log-softmax over the last axis.

    Args:
        logits: float [..., V] (any float dtype; ``-inf`` entries allowed as long as one
            entry per row is finite).

    Returns:
        float64 [..., V] log-probabilities (``-inf`` where the input was ``-inf``).

    Source: llm.py ``inference_wrapper`` (``self.llm_decoder(...).log_softmax(dim=-1)``).
    """
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _probabilities(scores: FloatArray) -> npt.NDArray[np.float64]:
    """Softmax of logits or (possibly masked, unnormalised) log-probabilities, float64 [V].

    ``softmax(log_softmax(x)) == softmax(x)``, so callers may pass either. The exponentials
    are taken in float32 (as upstream's fp32 torch path does; float64 ``exp`` is several times
    slower here), the normalisation in float64.
    """
    x = np.asarray(scores, dtype=np.float32)
    top = np.max(x)
    if not np.isfinite(top):
        raise ValueError("cannot sample: every log-probability is -inf or NaN")
    p = np.exp(x - top).astype(np.float64)
    return np.asarray(p / p.sum(), dtype=np.float64)


def _draw(weights: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    """Index drawn with probability proportional to ``weights`` (one uniform draw)."""
    cdf = np.cumsum(weights)
    u = rng.random() * cdf[-1]
    index = int(np.searchsorted(cdf, u, side="right"))
    return min(index, weights.shape[0] - 1)


def nucleus_candidates(
    logp: FloatArray, top_p: float = C.RAS_TOP_P, top_k: int = C.RAS_TOP_K
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Token ids and probabilities kept by nucleus (top-p + top-k) filtering.

    Rule of upstream ``nucleus_sampling`` (common.py): take the softmax of ``logp``, sort it in
    descending order with a *stable* sort (equal probabilities keep ascending-id order), then
    walk the sorted list and keep token i while ``sum(kept probs) < top_p`` and
    ``len(kept) < top_k`` *before* adding it. The token whose probability makes the sum cross
    ``top_p`` is therefore included, and at most ``top_k`` tokens are kept. The kept
    probabilities are not renormalised (sampling normalises them).

    Args:
        logp: float [V] log-probabilities (``-inf`` = masked).
        top_p: cumulative-probability bound, in (0, 1].
        top_k: maximum number of kept tokens, >= 1.

    Returns:
        (ids int64 [n], probs float64 [n]) in descending-probability order, 1 <= n <= top_k.

    Raises:
        ValueError: top_p / top_k out of range, or every entry masked.
    """
    return _nucleus(_probabilities(logp), top_p, top_k)


def _nucleus(
    p: npt.NDArray[np.float64], top_p: float, top_k: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """:func:`nucleus_candidates` on probabilities ``p`` float64 [V] (sum 1)."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be within (0, 1], got {top_p}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    vocab = p.shape[0]
    k = min(top_k, vocab)
    # candidates: every id whose probability reaches the k-th largest value (ties included),
    # then a stable descending sort of those few, which equals a full stable sort's prefix
    kth_value = np.partition(p, vocab - k)[vocab - k]
    candidates = np.flatnonzero(p >= kth_value)
    order = candidates[np.argsort(-p[candidates], kind="stable")][:k]
    sorted_p = p[order]
    cum_before = np.concatenate(([0.0], np.cumsum(sorted_p[:-1])))
    n_kept = max(1, int(np.count_nonzero(cum_before < top_p)))
    return order[:n_kept].astype(np.int64), sorted_p[:n_kept]


def nucleus_sample(
    logp: FloatArray,
    rng: np.random.Generator,
    top_p: float = C.RAS_TOP_P,
    top_k: int = C.RAS_TOP_K,
) -> int:
    """Sample one token among the nucleus of ``logp`` (see :func:`nucleus_candidates`).

    The kept tokens are drawn with probability proportional to their softmax probability
    (upstream: ``prob.multinomial(1)`` on the kept, unnormalised probabilities).

    Args:
        logp: float [V] log-probabilities (``-inf`` = masked).
        rng: the request's generator (one uniform draw per call).

    Returns:
        the sampled token id.
    """
    ids, probs = nucleus_candidates(logp, top_p, top_k)
    return int(ids[_draw(probs, rng)])


def random_sample(logp: FloatArray, rng: np.random.Generator) -> int:
    """Sample one token from the whole softmax distribution of ``logp``.

    Source: common.py ``random_sampling`` (``softmax().multinomial(1)``).
    """
    return _draw(_probabilities(logp), rng)


def ras_sample(
    logp: FloatArray,
    decoded_tokens: Sequence[int],
    rng: np.random.Generator,
    top_p: float = C.RAS_TOP_P,
    top_k: int = C.RAS_TOP_K,
    win_size: int = C.RAS_WINDOW_TOKENS,
    tau_r: float = C.RAS_TAU_R,
) -> int:
    """Repetition-Aware Sampling (VALL-E 2), as upstream common.py ``ras_sampling`` does it.

    1. Nucleus-sample a token t (:func:`nucleus_sample`).
    2. Count how often t occurs among the last ``win_size`` decoded tokens. If the count is
       ``>= win_size * tau_r`` (10 x 0.1 = 1: t occurs at all in the window), upstream sets
       ``logp[t] = -inf`` and draws with ``random_sampling`` from the *whole* distribution
       (no top-p / top-k) of the remaining tokens. This function does the same: t is banned
       for this draw and the fallback samples among all other tokens by their probabilities.
       If t was the only unmasked token, t is returned.

    Args:
        logp: float [V] log-probabilities of this step (masked entries ``-inf``); not modified.
        decoded_tokens: every token generated so far in this request (the RAS window uses all
            generated tokens, before the silent-run filter).
        rng: the request's generator (one or two uniform draws per call).

    Returns:
        the sampled token id.
    """
    return _ras(_probabilities(logp), decoded_tokens, rng, top_p, top_k, win_size, tau_r)


def _ras(
    p: npt.NDArray[np.float64],
    decoded_tokens: Sequence[int],
    rng: np.random.Generator,
    top_p: float,
    top_k: int,
    win_size: int,
    tau_r: float,
) -> int:
    """:func:`ras_sample` on probabilities ``p`` float64 [V] (sum 1)."""
    ids, kept = _nucleus(p, top_p, top_k)
    token = int(ids[_draw(kept, rng)])
    n_decoded = len(decoded_tokens)
    repeats = sum(
        1 for i in range(max(0, n_decoded - win_size), n_decoded) if decoded_tokens[i] == token
    )
    if repeats >= win_size * tau_r:
        banned = p.copy()
        banned[token] = 0.0  # softmax of logp with logp[token] = -inf, up to normalisation
        if banned.any():
            token = _draw(banned, rng)
    return token


def mask_stop_tokens(
    logp: FloatArray, speech_vocab: int = C.SPEECH_TOKEN_VOCAB
) -> npt.NDArray[np.float64]:
    """Return a copy of ``logp`` with every special id (>= ``speech_vocab``) set to ``-inf``.

    Applied while the step index is below the minimum length so that decoding cannot stop
    early. Deliberate fix: upstream llm.py ``Qwen2LM.sampling_ids`` masks only the single id
    ``speech_token_size`` (6561, which in CosyVoice3LM is SOS, not EOS 6562), while any id in
    ``stop_token_ids`` = 6561..6760 ends decoding, so upstream can stop before ``min_len``.

    Args:
        logp: float [V] log-probabilities, V >= speech_vocab.

    Returns:
        float64 [V].
    """
    masked = np.array(logp, dtype=np.float64, copy=True)
    masked[speech_vocab:] = -np.inf
    return masked


def sample_step(
    logits: FloatArray,
    decoded_tokens: Sequence[int],
    rng: np.random.Generator,
    step: int,
    min_len: int,
    speech_vocab: int = C.SPEECH_TOKEN_VOCAB,
) -> int:
    """One decoding step's choice: log-softmax, stop masking below ``min_len``, RAS.

    Equivalent to ``ras_sample(mask_stop_tokens(log_softmax(logits)) if step < min_len else
    log_softmax(logits), ...)`` with the upstream parameters (top_p 0.8, top_k 25, window 10,
    tau_r 0.1), computed with a single softmax.

    Args:
        logits: float [V] LLM head output of the last position.
        decoded_tokens: tokens generated so far (the RAS window).
        rng: the request's generator.
        step: index of the token being chosen (0 for the first).
        min_len: minimum number of speech tokens (:func:`decode_limits`).

    Returns:
        a token id; ids >= ``speech_vocab`` mean "stop" (only possible when step >= min_len).

    Source: llm.py ``inference_wrapper`` (log_softmax, ``sampling_ids`` with
    ``ignore_eos = i < min_len``).
    """
    scores = np.asarray(logits, dtype=np.float32)
    if step < min_len:
        scores = scores.copy()
        scores[speech_vocab:] = -np.inf
    # softmax(log_softmax(x)) == softmax(x): one exponential pass serves the whole step
    p = _probabilities(scores)
    return _ras(p, decoded_tokens, rng, C.RAS_TOP_P, C.RAS_TOP_K, C.RAS_WINDOW_TOKENS, C.RAS_TAU_R)


def decode_limits(n_tts_text_tokens: int) -> tuple[int, int]:
    """Minimum and maximum number of speech tokens for a text of N tokens.

    ``(int(N * 2.0), int(N * 20.0))``; N counts only the tts-text tokens (prompt text
    excluded; in cross-lingual mode the system prefix is part of the tts text).
    Source: llm.py ``Qwen2LM.inference`` (``min_token_text_ratio``, ``max_token_text_ratio``).

    Raises:
        ValueError: N < 0.
    """
    if n_tts_text_tokens < 0:
        raise ValueError(f"n_tts_text_tokens must be >= 0, got {n_tts_text_tokens}")
    return (
        int(n_tts_text_tokens * C.MIN_TOKEN_TEXT_RATIO),
        int(n_tts_text_tokens * C.MAX_TOKEN_TEXT_RATIO),
    )


class SilentRunFilter:
    """Drops silent tokens beyond a run of ``max_run_tokens`` consecutive ones.

    One instance per request (it counts the current run). Any token of ``silent_tokens``
    extends the run (they need not be equal); any other token resets it. Tokens are only
    dropped from what reaches the flow; the LLM and the RAS window still see every token.

    Source: model.py ``CosyVoice2Model.llm_job`` (``silent_tokens``, ``max_silent_token_num``
    = 5), silent set from ``CosyVoice3Model.__init__``.
    """

    def __init__(
        self,
        silent_tokens: frozenset[int] = C.SILENT_TOKENS,
        max_run_tokens: int = C.MAX_SILENT_RUN_TOKENS,
    ) -> None:
        self._silent = silent_tokens
        self._max_run = max_run_tokens
        self._run = 0

    def accept(self, token: int) -> bool:
        """Return True when ``token`` should be passed on to the flow."""
        if token in self._silent:
            self._run += 1
            return self._run <= self._max_run
        self._run = 0
        return True

    def filter(self, tokens: Sequence[int]) -> list[int]:
        """The accepted subset of ``tokens`` in order (continues the current run)."""
        return [t for t in tokens if self.accept(t)]
