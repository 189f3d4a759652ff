"""The LLM graph that decodes, chosen by timing real decode steps at load.

The machine probe (:mod:`..machine`) times two decoder layers' products in each derived form
before the model is loaded; on the AVX-512 + AMX test machine it read the per-tensor int8 form
(``fused``) as fast as the 4-bit one (``fused-q4``) while a real step of the first took 1.5x
the second's time (BENCHMARKS.md "LLM decode graph"). So when the plan names several decode
candidates (``EngineOptions.llm_decode_candidates``), the engine loads them, runs real decode
steps of each on the same cache length, and keeps the fastest: the figure is a step as the
decoder runs it (every layer, attention over the cache, the KV cache extended in place, the
sessions' own threads and spinning).

Timed alone, the forms that stream the same bytes read close, and on a CPU whose AMX tiles
run the per-tensor int8 products (``fused``) that form switches between two speeds for
seconds at a time, while the ``MatMulNBits`` forms stay steady (BENCHMARKS.md "The decode
graph timed at load"); beside the flow, which streams its own weights on the other core, a
step that reads fewer bytes loses less. So :func:`choose_decode_graph` takes the fastest only
where it is clearly faster; among the graphs within :data:`DECODE_TIE` of it, the one that
streams clearly fewer bytes, then the plan's.

A graph that decodes two pieces of an answer at once (:mod:`.tokens`: its two-row steps give
each row its own logits, :func:`paired_rows_exact`, or were validated when it was derived)
serves most of a long answer's tokens two to a step, at about 1.2x a one-row step's time. So
the fastest is judged per token (:func:`token_cost_s`): a graph that pairs against one that
cannot (per-tensor int8 couples its rows through one activation scale) at equal one-row steps
decodes a paragraph in about 0.7x the time. On the AVX-512 + AMX test machine both int8
forms read 23.3 ms a step at load and the per-tensor one, which cannot pair, was kept: it
decoded ``balanced``'s paragraph at 40 ms a token beside the flow (BENCHMARKS.md "The decode
graph that pairs").

The steps run with onnxruntime directly, not through :meth:`.sessions.Graph.run_bound`, so a
run observer (the benchmark's graph-run records) sees no request work at load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from ..sessions import ORT_ERRORS, Graph

TIMED_CACHED_POSITIONS = 200
"""Cached positions of the timed steps: a voice prompt and a sentence's text (150-250
positions) plus its first tokens, where most of an answer's steps fall."""
TIMED_ROUNDS = 3
"""The candidates take turns this many times, so that a busy second of a shared host slows
one round of every graph rather than all of one graph's steps."""
TIMED_STEPS = 6
"""Timed steps per graph and round (after one untimed step: the first run of a session
allocates its buffers)."""
PAIRED_TOKEN_SHARE = 0.78
"""Share of a long answer's tokens decoded in two-row steps where the graph pairs: the
benchmark's streamed paragraph (745 tokens) took 455 steps with ``fused-q4``, 290 of them two
rows (BENCHMARKS.md "The decode graph that pairs"). A one-sentence answer is one piece and
decodes one row a step; the tie (:data:`DECODE_TIE`) keeps such answers from paying for the
pairing: a graph is preferred for pairing only where that makes it clearly cheaper."""


def time_decode_steps(graphs: Mapping[str, Graph], embeds: np.ndarray, *,
                      cached_positions: int = TIMED_CACHED_POSITIONS,
                      rounds: int = TIMED_ROUNDS, steps: int = TIMED_STEPS,
                      batch_rows: int = 1) -> dict[str, float]:
    """Median seconds of one decode step of each fused LLM graph, taking turns.

    Each graph gets its own KV cache buffers (zeros; a step's cost does not depend on the
    values) holding ``cached_positions`` positions, bound as past and present at once as the
    decoder's ``"buffer"`` mode binds them; every step writes the same next position.

    Args:
        graphs: name -> a fused LLM graph (``GroupQueryAttention``: past and present may share
            a buffer); ``past_key_values.{i}.{key,value}`` float32 [batch, kv_heads, past,
            head_dim] inputs with static heads and head_dim (a batch axis for
            ``batch_rows`` > 1).
        embeds: float32 [n, hidden] rows fed ``batch_rows`` per step (n >= 1; reused
            cyclically).
        cached_positions: positions in the cache before each step (>= 0).
        rounds, steps: turns over the graphs, and timed steps per graph and turn (>= 1).
        batch_rows: rows per step (1: one piece decoding; 2: two pieces at once).

    Returns:
        name -> median seconds per step over its ``rounds * steps`` timed steps.

    Raises:
        ValueError: a count out of range, ``embeds`` not 2-D, or a graph's KV dims not static.
        RuntimeError: onnxruntime failed (its errors derive from it; also a graph with a batch
            of one row asked for more).
    """
    if rounds < 1 or steps < 1 or cached_positions < 0 or batch_rows < 1:
        raise ValueError(f"rounds, steps and batch_rows must be >= 1 and cached_positions >= 0, "
                         f"got {rounds}, {steps}, {batch_rows}, {cached_positions}")
    rows = np.ascontiguousarray(embeds, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[0] < 1:
        raise ValueError(f"embeds must be float32 [n >= 1, hidden], got {rows.shape}")
    bound = {name: _bind_in_place(graph, cached_positions, batch_rows)
             for name, graph in graphs.items()}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    fed = 0
    for _ in range(rounds):
        for name, (session, binding) in bound.items():
            for timed in (False, *([True] * steps)):
                picked = np.arange(fed, fed + batch_rows) % len(rows)
                binding.bind_cpu_input("inputs_embeds", rows[picked][:, None, :])
                fed += batch_rows
                started = time.perf_counter()
                session.run_with_iobinding(binding)
                if timed:
                    times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


DECODE_TIE = 0.10
"""Graphs whose timed step is within this fraction of the fastest count as equally fast:
on the test machine twelve timings of the three forms in one process moved each form's
median by up to 10 % within one of ``fused``'s speeds (BENCHMARKS.md "LLM decode graph")."""
LEANER_BYTES = 0.8
"""A graph streams clearly fewer bytes when its files hold at most this fraction of another's
(4-bit against 8-bit weights: 0.65; 8-bit blocks against per-tensor int8: 1.03)."""


def token_cost_s(step_s: float, pair_step_s: float | None,
                 paired_share: float = PAIRED_TOKEN_SHARE) -> float:
    """Seconds per decoded token of a long answer: ``step_s`` per token where the graph does
    not pair (``pair_step_s`` None); where it does, ``paired_share`` of the tokens at half a
    two-row step and the rest at a one-row step.

    Raises:
        ValueError: ``paired_share`` outside 0..1.
    """
    if not 0.0 <= paired_share <= 1.0:
        raise ValueError(f"paired_share must be within 0..1, got {paired_share}")
    if pair_step_s is None:
        return step_s
    return (1.0 - paired_share) * step_s + paired_share * pair_step_s / 2.0


def choose_decode_graph(step_s: Mapping[str, float], stream_bytes: Mapping[str, int],
                        planned: str, pair_step_s: Mapping[str, float] | None = None) -> str:
    """The graph that decodes, from timed steps (:func:`time_decode_steps`).

    Each graph's cost is its seconds per token (:func:`token_cost_s`: with its two-row step
    where it pairs). Among the graphs within :data:`DECODE_TIE` of the cheapest: one that
    streams clearly fewer bytes (:data:`LEANER_BYTES`) than the leanest of them does not, then
    ``planned``, then the cheapest.

    Args:
        step_s: graph name -> seconds per one-row decode step.
        stream_bytes: graph name -> bytes of its weights (its files).
        planned: the plan's decode graph (may be absent from ``step_s``).
        pair_step_s: graph name -> seconds per two-row step, for the graphs that decode two
            pieces at once (others absent; None: none does).

    Raises:
        ValueError: ``step_s`` is empty.
        KeyError: a timed graph has no ``stream_bytes``.
    """
    if not step_s:
        raise ValueError("no timed LLM graphs")
    paired = pair_step_s or {}
    cost = {name: token_cost_s(s, paired.get(name)) for name, s in step_s.items()}
    cheapest_s = min(cost.values())
    close = [name for name, s in cost.items() if s <= (1.0 + DECODE_TIE) * cheapest_s]
    leanest = min(stream_bytes[name] for name in close)
    return min(close, key=lambda name: (stream_bytes[name] * LEANER_BYTES > leanest,
                                        name != planned, cost[name]))


ONE_THREAD_MAX_RATIO = 1.5
"""Longest one-thread decode step, as a multiple of the same graph's step on the sessions'
threads, at which the decoding beside the flow runs on one intra-op thread
(:func:`decodes_on_one_thread`). Measured on 2-core machines (BENCHMARKS.md "One thread for
the decoding beside the flow"): on the Zen 4 EPYC a one-thread step of ``fused-b8`` took
1.11-1.32x its two-thread time at load and ``balanced``'s paragraph was made in 0.92-0.98x
the time; ``fused-q4``'s took 1.24-1.45x, and ``fast``'s paragraph 0.92-0.97x (at
1.42-1.45x its sentence was heard 0.26 s sooner); on the family-26 EPYC a step took 1.27x
and the paragraphs 0.94-0.96x. The Xeon's one core reads memory at 12.7 GB/s against 22.5
on two (0.56), so a step there would take about 1.8x; its decoding is already the longer
side for ``fast``."""


def decodes_on_one_thread(threads_s: float, one_thread_s: float,
                          max_ratio: float = ONE_THREAD_MAX_RATIO) -> bool:
    """Whether the decode graph runs on one intra-op thread beside the flow.

    A step streams the weights from memory; on one thread it holds one core while the flow's
    thread has the other to itself, where with the sessions' threads both kinds of work take
    turns on both cores (each keeping 0.5-0.7 of its speed alone). That pays when one thread
    streams the weights almost as fast as two: ``one_thread_s`` at most ``max_ratio`` x
    ``threads_s``.

    Args:
        threads_s: median seconds of a step on the sessions' threads (> 0).
        one_thread_s: median seconds of a step of the same graph on one thread (> 0).
        max_ratio: :data:`ONE_THREAD_MAX_RATIO`.

    Raises:
        ValueError: a time <= 0.
    """
    if threads_s <= 0 or one_thread_s <= 0:
        raise ValueError(f"step times must be > 0, got {threads_s} and {one_thread_s}")
    return one_thread_s <= max_ratio * threads_s


def paired_rows_exact(graph: Graph, embeds: np.ndarray) -> bool | None:
    """Whether a two-row step of ``graph`` gives each row exactly the logits of its own
    one-row step (the first two rows of ``embeds`` as the new positions after a cache of zeros;
    a few ms on the full-size model). None when the graph cannot run two rows, or not with its
    KV cache in place (a published graph).

    Raises:
        ValueError: ``embeds`` is not float32 [n >= 2, hidden], or the graph's KV dims are not
            static.
    """
    rows = np.ascontiguousarray(embeds, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[0] < 2:
        raise ValueError(f"embeds must be float32 [n >= 2, hidden], got {rows.shape}")
    def step(fed: np.ndarray) -> np.ndarray:
        session, binding = _bind_in_place(graph, PAIR_CHECK_POSITIONS, len(fed))
        binding.bind_cpu_input("inputs_embeds", fed[:, None, :])
        session.run_with_iobinding(binding)
        return _logits(session, binding)

    try:
        alone = [step(rows[i:i + 1])[0] for i in range(2)]
        paired = step(rows[:2])
    except ORT_ERRORS:
        return None
    return all(np.array_equal(paired[i], alone[i]) for i in range(2))


PAIR_CHECK_POSITIONS = 3
"""Cached positions (zeros) before the steps :func:`paired_rows_exact` compares."""


def _logits(session: ort.InferenceSession, binding: ort.IOBinding) -> np.ndarray:
    names = [o.name for o in session.get_outputs() if not o.name.startswith("present.")]
    return np.asarray(binding.copy_outputs_to_cpu()[names.index("logits")])


def _bind_in_place(graph: Graph, cached_positions: int, batch_rows: int,
                   ) -> tuple[ort.InferenceSession, ort.IOBinding]:
    """``graph``'s session and a binding of ``batch_rows`` zero KV caches holding
    ``cached_positions`` positions plus the next one, past and present in one buffer."""
    capacity = cached_positions + 1
    mask = np.ones((batch_rows, capacity), dtype=np.int64)
    position = np.full((batch_rows, 1), cached_positions, dtype=np.int64)
    session = graph.session
    shapes = {i.name: i.shape for i in session.get_inputs()}
    binding = session.io_binding()
    for name, shape in shapes.items():
        if not name.startswith("past_key_values."):
            continue
        heads, head_dim = shape[1], shape[3]
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            raise ValueError(f"{graph.path.name}: {name} has no static heads and head_dim "
                             f"({shape})")
        buffer = ort.OrtValue.ortvalue_from_numpy(
            np.zeros((batch_rows, heads, capacity, head_dim), dtype=np.float32))
        binding.bind_ortvalue_input(name, buffer)
        binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), buffer)
    for output in session.get_outputs():
        if not output.name.startswith("present."):
            binding.bind_output(output.name, "cpu")
    binding.bind_cpu_input("attention_mask", mask)
    binding.bind_cpu_input("position_ids", position)
    return session, binding


__all__ = ["DECODE_TIE", "LEANER_BYTES", "ONE_THREAD_MAX_RATIO", "PAIRED_TOKEN_SHARE",
           "PAIR_CHECK_POSITIONS", "TIMED_CACHED_POSITIONS", "TIMED_ROUNDS", "TIMED_STEPS",
           "choose_decode_graph", "decodes_on_one_thread", "paired_rows_exact",
           "time_decode_steps", "token_cost_s"]
