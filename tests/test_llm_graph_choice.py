"""Timing real decode steps of the candidate LLM graphs at load (engine/llm/graph_choice.py)
on the tiny model's fused graphs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import sessions
from wyoming_cosyvoice3.engine.llm import graph_choice
from wyoming_cosyvoice3.engine.llm.graph_choice import (
    choose_decode_graph,
    decodes_on_one_thread,
    time_decode_steps,
    token_cost_s,
)
from wyoming_cosyvoice3.engine.loaders import load_llm_graph
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions
from wyoming_cosyvoice3.engine.sessions import SPEECH_EMBEDDING, Graph

SLOW_S = 0.02
"""Added to each run of the slowed graph: a hundred times a tiny-model step."""


class SlowedSession:
    """An onnxruntime session whose IOBinding runs sleep :data:`SLOW_S` first and are
    counted."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self.runs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def run_with_iobinding(self, binding: Any, run_options: Any = None) -> None:
        self.runs += 1
        time.sleep(SLOW_S)
        self._session.run_with_iobinding(binding, run_options)


@pytest.fixture(scope="module")
def fused_graphs(tiny_model_dir: Path, tiny_engine_cache: Path) -> tuple[Graph, Graph, np.ndarray]:
    """Two sessions of the tiny model's fused LLM graph and speech-embedding rows."""
    embedding = Graph(tiny_model_dir / SPEECH_EMBEDDING.file, SPEECH_EMBEDDING, 1)
    options = EngineOptions(llm_graph="fused", cache_dir=tiny_engine_cache, threads=1)
    first = load_llm_graph(tiny_model_dir, options, 1, embedding)
    second = load_llm_graph(tiny_model_dir, options, 1, embedding)
    ids = np.arange(5, dtype=np.int64)[None, :]
    rows = embedding.run({"input_ids": ids}, ["inputs_embeds"])["inputs_embeds"][0]
    return first, second, np.asarray(rows, np.float32)


def test_the_slower_graph_reads_slower_and_every_step_is_timed(
        fused_graphs: tuple[Graph, Graph, np.ndarray]) -> None:
    fast, slow, rows = fused_graphs
    slowed = SlowedSession(slow.session)
    slow.session = slowed
    try:
        step_s = time_decode_steps({"a": fast, "b": slow}, rows, cached_positions=30,
                                   rounds=2, steps=3)
    finally:
        slow.session = slowed._session
    assert set(step_s) == {"a", "b"}
    # every step of b slept SLOW_S; each round runs one untimed step first
    assert slowed.runs == 2 * (1 + 3)
    assert step_s["b"] >= SLOW_S and step_s["b"] > step_s["a"] > 0.0


class FirstRunSlowed(SlowedSession):
    """Sleeps :data:`SLOW_S` x 25 before the first run of every ``runs_per_round`` runs (a
    round's untimed first step) only."""

    def __init__(self, session: Any, runs_per_round: int) -> None:
        super().__init__(session)
        self._per_round = runs_per_round

    def run_with_iobinding(self, binding: Any, run_options: Any = None) -> None:
        self.runs += 1
        if (self.runs - 1) % self._per_round == 0:
            time.sleep(25 * SLOW_S)
        self._session.run_with_iobinding(binding, run_options)


def test_each_rounds_first_step_is_not_timed(
        fused_graphs: tuple[Graph, Graph, np.ndarray]) -> None:
    # a round's first run (the session's first allocates its buffers) is left out: a slow
    # first run in every round does not reach the median of the timed ones (timed, it
    # would be half of the samples: a median of at least 12.5 x SLOW_S)
    graph, _, rows = fused_graphs
    slowed = FirstRunSlowed(graph.session, runs_per_round=1 + 1)
    graph.session = slowed
    try:
        step_s = time_decode_steps({"g": graph}, rows, rounds=3, steps=1)
    finally:
        graph.session = slowed._session
    assert slowed.runs == 3 * (1 + 1)
    assert step_s["g"] < 5 * SLOW_S


def test_the_benchmarks_run_observer_sees_no_timed_step(
        fused_graphs: tuple[Graph, Graph, np.ndarray]) -> None:
    graph, _, rows = fused_graphs
    seen: list[str] = []
    sessions.set_run_observer(lambda path, feeds, start, end: seen.append(path))
    try:
        time_decode_steps({"g": graph}, rows, rounds=1, steps=2)
        graph.run({"inputs_embeds": rows[None, :1], "attention_mask": np.ones((1, 1), np.int64),
                   "position_ids": np.zeros((1, 1), np.int64),
                   **{i.name: np.zeros((1, *i.shape[1:2], 0, *i.shape[3:]), np.float32)
                      for i in graph.session.get_inputs()
                      if i.name.startswith("past_key_values.")}}, ["logits"])
    finally:
        sessions.set_run_observer(None)
    assert seen == [str(graph.path)]  # the ordinary run only


@pytest.mark.parametrize("counts", [{"rounds": 0}, {"steps": 0}, {"cached_positions": -1}])
def test_counts_out_of_range_are_refused(fused_graphs: tuple[Graph, Graph, np.ndarray],
                                         counts: dict[str, int]) -> None:
    graph, _, rows = fused_graphs
    with pytest.raises(ValueError, match="must be"):
        time_decode_steps({"g": graph}, rows, **counts)
    with pytest.raises(ValueError, match="embeds must be"):
        time_decode_steps({"g": graph}, rows[0])


MB = 1_000_000
BYTES = {"fused": 374 * MB, "fused-b8": 387 * MB, "fused-q4": 242 * MB}
"""The full-size forms' file sizes."""


def test_a_clearly_faster_graph_decodes() -> None:
    # 12 % faster than the leaner, planned graph: beyond the 10 % tie
    step_s = {"fused-q4": 20.0e-3, "fused": 17.6e-3, "fused-b8": 19.0e-3}
    assert choose_decode_graph(step_s, BYTES, "fused-q4") == "fused"


def test_within_the_tie_the_leaner_graph_then_the_plans_decodes() -> None:
    # fused 5 % faster than 4-bit weights, which stream 0.65x the bytes: 4-bit
    step_s = {"fused-q4": 19.0e-3, "fused": 18.1e-3, "fused-b8": 19.1e-3}
    assert choose_decode_graph(step_s, BYTES, "fused") == "fused-q4"
    # per-tensor int8 against 8-bit blocks (1.03x the bytes: not clearly more): the plan's
    step_s = {"fused": 18.2e-3, "fused-b8": 19.0e-3}
    assert choose_decode_graph(step_s, BYTES, "fused-b8") == "fused-b8"
    assert choose_decode_graph(step_s, BYTES, "fused") == "fused"
    # the plan's graph not timed (it fell back): the fastest of the equals
    assert choose_decode_graph(step_s, BYTES, "fused-q4") == "fused"
    # a leaner graph beyond the tie does not decode
    assert choose_decode_graph({"fused": 18.0e-3, "fused-q4": 20.0e-3}, BYTES,
                               "fused-q4") == "fused"


def test_a_token_of_a_graph_that_pairs_costs_its_share_of_two_row_steps() -> None:
    # 78 % of a paragraph's tokens two to a 24 ms step, the rest one to a 20 ms step
    assert token_cost_s(20e-3, 24e-3) == pytest.approx(0.22 * 20e-3 + 0.78 * 12e-3)
    assert token_cost_s(20e-3, None) == 20e-3
    assert token_cost_s(20e-3, 24e-3, paired_share=0.0) == 20e-3
    assert token_cost_s(20e-3, 24e-3, paired_share=1.0) == pytest.approx(12e-3)
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        token_cost_s(20e-3, 24e-3, paired_share=1.5)


def test_pairing_is_judged_per_token() -> None:
    # equal one-row steps (the AMX Xeon's 23.3 ms): 8-bit blocks pair at 28 ms for two rows
    # (16.0 ms a token), per-tensor int8 cannot: 8-bit blocks, though fused was planned
    step_s = {"fused": 23.3e-3, "fused-b8": 23.3e-3}
    assert choose_decode_graph(step_s, BYTES, "fused", {"fused-b8": 28e-3}) == "fused-b8"
    assert choose_decode_graph(step_s, BYTES, "fused") == "fused"
    # a two-row step at twice one row's time gains nothing: within the tie, the plan's
    assert choose_decode_graph(step_s, BYTES, "fused", {"fused-b8": 46.6e-3}) == "fused"
    # a graph 1.5x faster a step that cannot pair still beats one that pairs at 1.2x:
    # 15 ms against 0.22 x 22.5 + 0.78 x 13.5 = 15.5 ms a token, within the tie: the plan's
    step_s = {"fused": 15e-3, "fused-b8": 22.5e-3}
    assert choose_decode_graph(step_s, BYTES, "fused", {"fused-b8": 27e-3}) == "fused"
    assert choose_decode_graph(step_s, BYTES, "fused-b8", {"fused-b8": 27e-3}) == "fused-b8"
    # and beyond the tie the cheaper per token decodes whatever was planned
    step_s = {"fused": 12e-3, "fused-b8": 22.5e-3}
    assert choose_decode_graph(step_s, BYTES, "fused-b8", {"fused-b8": 27e-3}) == "fused"


def test_two_row_steps_are_timed_with_two_rows_fed(
        fused_graphs: tuple[Graph, Graph, np.ndarray]) -> None:
    graph, _, rows = fused_graphs
    fed: list[tuple[int, ...]] = []
    real = graph.session

    class Recording(SlowedSession):
        def run_with_iobinding(self, binding: Any, run_options: Any = None) -> None:
            self.runs += 1
            self._session.run_with_iobinding(binding, run_options)
            names = [o.name for o in self._session.get_outputs()
                     if not o.name.startswith("present.")]
            fed.append(binding.copy_outputs_to_cpu()[names.index("logits")].shape[:1])

    graph.session = Recording(real)
    try:
        step_s = time_decode_steps({"g": graph}, rows, rounds=1, steps=2, batch_rows=2)
    finally:
        graph.session = real
    assert step_s["g"] > 0.0 and fed == [(2,)] * 3
    with pytest.raises(ValueError, match="must be"):
        time_decode_steps({"g": graph}, rows, batch_rows=0)


def test_nothing_timed_is_an_error() -> None:
    with pytest.raises(ValueError, match="no timed"):
        choose_decode_graph({}, BYTES, "fused")


def test_one_thread_decodes_when_its_step_takes_at_most_the_ratio() -> None:
    # 10 ms a step on the sessions' threads: up to 15 ms on one thread is close enough
    assert decodes_on_one_thread(10e-3, 11.5e-3)  # the Zen 4's fused-b8: 1.14-1.32x
    assert decodes_on_one_thread(10e-3, 14.5e-3)  # its fused-q4: 1.42-1.45x
    assert decodes_on_one_thread(10e-3, 14.9e-3)
    assert not decodes_on_one_thread(10e-3, 15.1e-3)
    assert not decodes_on_one_thread(10e-3, 18e-3)  # the Xeon's one core: about 1.8x
    assert decodes_on_one_thread(10e-3, 9e-3)  # one thread faster (a busy second core)
    assert not decodes_on_one_thread(10e-3, 12.5e-3, max_ratio=1.2)
    with pytest.raises(ValueError, match="must be > 0"):
        decodes_on_one_thread(0.0, 10e-3)


def _intra_op_threads(graph: Graph | None) -> int:
    assert graph is not None
    return int(graph.session.get_session_options().intra_op_num_threads)


@pytest.mark.parametrize(
    ("split_cores", "threads", "one_thread_s", "decode_threads", "compared"), [
    (True, 2, 14e-3, 1, 1),  # 1.4x the two-thread step: one thread
    (True, 2, 16e-3, 2, 1),  # 1.6x: the sessions' threads
    (False, 2, 14e-3, 2, 0),  # the stages take turns: never fewer threads, nothing timed
    (True, 1, 14e-3, 1, 0),  # one thread already: nothing to time
])
def test_the_decoding_beside_the_flow_takes_one_thread_when_its_step_is_nearly_as_fast(
        tiny_model_dir: Path, tiny_engine_cache: Path, monkeypatch: pytest.MonkeyPatch,
        split_cores: bool, threads: int, one_thread_s: float, decode_threads: int,
        compared: int) -> None:
    """The load times each decode session it compares: 10 ms a step on two threads, and the
    decode graph's one-thread session ``one_thread_s``."""
    timed: list[dict[str, int]] = []

    def time_steps(graphs: dict[str, Graph], embeds: np.ndarray, *, batch_rows: int = 1,
                   **_: Any) -> dict[str, float]:
        counts = {name: _intra_op_threads(g) for name, g in graphs.items()}
        timed.append(counts)
        return {name: one_thread_s if n == 1 and threads > 1 else 10e-3
                for name, n in counts.items()}

    monkeypatch.setattr(graph_choice, "time_decode_steps", time_steps)
    model = CosyVoice3Model.load(tiny_model_dir, EngineOptions(
        llm_graph="fused-q4", llm_prefill_graph="fused", llm_decode_candidates=("fused-b8",),
        split_cores=split_cores, threads=threads, cache_dir=tiny_engine_cache))
    # equal steps: the leaner 4-bit graph decodes, on the threads the timing chose
    assert ".fusedq4" in model.llm.path.name
    assert _intra_op_threads(model.llm) == decode_threads
    # the prefill graph keeps the sessions' threads
    assert ".fused2-" in model.llm_prefill.path.name  # type: ignore[union-attr]
    assert _intra_op_threads(model.llm_prefill) == threads
    # a one-thread session was timed against the decode graph only with split cores
    assert [counts for counts in timed if "one" in counts] == [
        {"threads": threads, "one": 1}] * compared
