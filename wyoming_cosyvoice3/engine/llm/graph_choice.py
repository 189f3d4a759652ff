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

The steps run with onnxruntime directly, not through :meth:`.sessions.Graph.run_bound`, so a
run observer (the benchmark's graph-run records) sees no request work at load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from ..sessions import Graph

TIMED_CACHED_POSITIONS = 200
"""Cached positions of the timed steps: a voice prompt and a sentence's text (150-250
positions) plus its first tokens, where most of an answer's steps fall."""
TIMED_ROUNDS = 3
"""The candidates take turns this many times, so that a busy second of a shared host slows
one round of every graph rather than all of one graph's steps."""
TIMED_STEPS = 6
"""Timed steps per graph and round (after one untimed step: the first run of a session
allocates its buffers)."""


def time_decode_steps(graphs: Mapping[str, Graph], embeds: np.ndarray, *,
                      cached_positions: int = TIMED_CACHED_POSITIONS,
                      rounds: int = TIMED_ROUNDS, steps: int = TIMED_STEPS) -> dict[str, float]:
    """Median seconds of one decode step of each fused LLM graph, taking turns.

    Each graph gets its own KV cache buffers (zeros; a step's cost does not depend on the
    values) holding ``cached_positions`` positions, bound as past and present at once as the
    decoder's ``"buffer"`` mode binds them; every step writes the same next position.

    Args:
        graphs: name -> a fused LLM graph (``GroupQueryAttention``: past and present may share
            a buffer); ``past_key_values.{i}.{key,value}`` float32 [1, kv_heads, past,
            head_dim] inputs with static heads and head_dim.
        embeds: float32 [n, hidden] rows fed one per step (n >= 1; reused cyclically).
        cached_positions: positions in the cache before each step (>= 0).
        rounds, steps: turns over the graphs, and timed steps per graph and turn (>= 1).

    Returns:
        name -> median seconds per step over its ``rounds * steps`` timed steps.

    Raises:
        ValueError: a count out of range, ``embeds`` not 2-D, or a graph's KV dims not static.
        RuntimeError: onnxruntime failed (its errors derive from it).
    """
    if rounds < 1 or steps < 1 or cached_positions < 0:
        raise ValueError(f"rounds and steps must be >= 1 and cached_positions >= 0, got "
                         f"{rounds}, {steps}, {cached_positions}")
    rows = np.ascontiguousarray(embeds, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[0] < 1:
        raise ValueError(f"embeds must be float32 [n >= 1, hidden], got {rows.shape}")
    total = cached_positions + 1
    mask = np.ones((1, total), dtype=np.int64)
    position = np.array([[cached_positions]], dtype=np.int64)
    bound = {name: _bind_in_place(graph, total, mask, position) for name, graph in graphs.items()}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    fed = 0
    for _ in range(rounds):
        for name, (session, binding) in bound.items():
            for timed in (False, *([True] * steps)):
                binding.bind_cpu_input("inputs_embeds", rows[fed % len(rows)][None, None, :])
                fed += 1
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


def choose_decode_graph(step_s: Mapping[str, float], stream_bytes: Mapping[str, int],
                        planned: str) -> str:
    """The graph that decodes, from timed steps (:func:`time_decode_steps`).

    Among the graphs within :data:`DECODE_TIE` of the fastest step: one that streams clearly
    fewer bytes (:data:`LEANER_BYTES`) than the leanest of them does not, then ``planned``,
    then the fastest.

    Args:
        step_s: graph name -> seconds per decode step.
        stream_bytes: graph name -> bytes of its weights (its files).
        planned: the plan's decode graph (may be absent from ``step_s``).

    Raises:
        ValueError: ``step_s`` is empty.
        KeyError: a timed graph has no ``stream_bytes``.
    """
    if not step_s:
        raise ValueError("no timed LLM graphs")
    fastest_s = min(step_s.values())
    close = [name for name, s in step_s.items() if s <= (1.0 + DECODE_TIE) * fastest_s]
    leanest = min(stream_bytes[name] for name in close)
    return min(close, key=lambda name: (stream_bytes[name] * LEANER_BYTES > leanest,
                                        name != planned, step_s[name]))


def _bind_in_place(graph: Graph, capacity: int, mask: np.ndarray,
                   position: np.ndarray) -> tuple[ort.InferenceSession, ort.IOBinding]:
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
            np.zeros((1, heads, capacity, head_dim), dtype=np.float32))
        binding.bind_ortvalue_input(name, buffer)
        binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), buffer)
    for output in session.get_outputs():
        if not output.name.startswith("present."):
            binding.bind_output(output.name, "cpu")
    binding.bind_cpu_input("attention_mask", mask)
    binding.bind_cpu_input("position_ids", position)
    return session, binding


__all__ = ["DECODE_TIE", "LEANER_BYTES", "TIMED_CACHED_POSITIONS", "TIMED_ROUNDS", "TIMED_STEPS",
           "choose_decode_graph", "time_decode_steps"]
