"""A request's tokens (engine/llm/tokens.py): the items, one piece or two at a time, the schedule,
the row check.

The schedule is tested on a scripted decoder whose logits name the token each piece must
take next (piece x 1000 + step), so every item and every model call can be checked; the row
check and the tokens on the tiny synthetic model's real fused graphs.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.errors import SynthesisCancelled
from wyoming_cosyvoice3.engine.llm import graph_choice, tokens
from wyoming_cosyvoice3.engine.llm.decoder import LlmDecoder
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions, LlmPrompt, StageTimes, SynthesisOptions

VOCAB = 6761


def _logits(token: int) -> np.ndarray:
    logits = np.zeros(VOCAB, np.float32)
    logits[token] = 60.0  # the nucleus and the RAS fallback both take it
    return logits


class _Seq:
    def __init__(self, piece: int) -> None:
        self.piece, self.step = piece, 0

    def next_logits(self) -> np.ndarray:
        logits = _logits(self.piece * 1000 + self.step)
        self.step += 1
        return logits


class ScriptedDecoder:
    """The decoder calls :func:`tokens.piece_tokens` makes, logged in ``calls``."""

    decode_graph_path = Path("scripted.onnx")

    pairs_pieces = True

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.sampled: dict[int, int] = {}

    def check(self, should_stop: Any, deadline: float | None, step: int) -> None:
        if should_stop():
            raise SynthesisCancelled("stopped")

    def prefill_prompt(self, prompt: LlmPrompt) -> tuple[_Seq, np.ndarray, int]:
        seq = _Seq(int(prompt.tts_text_ids[0]))
        self.calls.append(("prefill", seq.piece))
        return seq, seq.next_logits(), 1

    def step(self, state: _Seq, token: int) -> np.ndarray:
        assert token == state.piece * 1000 + state.step - 1  # fed the token it just took
        self.calls.append(("step", state.piece))
        return state.next_logits()

    def pair_states(self, first: _Seq, second: _Seq) -> list[_Seq]:
        self.calls.append(("pair", first.piece, second.piece))
        return [first, second]

    def unpair(self, pair: list[_Seq], row: int, tokens: list[int]) -> _Seq:
        return pair[row]

    def step_pair(self, pair: list[_Seq], tokens: tuple[int, int]) -> np.ndarray:
        self.calls.append(("step2", pair[0].piece, pair[1].piece))
        for seq, token in zip(pair, tokens, strict=True):
            assert token == seq.piece * 1000 + seq.step - 1
        return np.stack([seq.next_logits() for seq in pair])


class Request:
    def __init__(self, stop_after_items: int | None = None) -> None:
        self.options = SynthesisOptions()
        self.rng = np.random.default_rng(0)
        self.deadline_monotonic = time.monotonic() + 600
        self._times = StageTimes()
        self.items = 0
        self.stop_after_items = stop_after_items
        self.events: list[str] = []

    @property
    def times(self) -> StageTimes:
        return self._times

    def check(self) -> bool:
        return self.stop_after_items is not None and self.items >= self.stop_after_items

    def now(self) -> float:
        return time.monotonic()

    def event(self, stage: str, start_s: float, end_s: float | None = None) -> None:
        self.events.append(stage)


def _prompt(piece: int) -> LlmPrompt:
    empty = np.zeros(0, np.int64)
    return LlmPrompt(prompt_text_ids=empty, tts_text_ids=np.array([piece], np.int64),
                     prompt_speech_tokens=empty, mode="cross_lingual")


Items = list[tuple[int, int | None]]


def _run(lengths: list[int], more: Any = None, req: Request | None = None
         ) -> tuple[Items, ScriptedDecoder, list[LlmPrompt], list[int | None]]:
    llm = ScriptedDecoder()
    prompts = [_prompt(i) for i in range(len(lengths))]
    fixed: list[int | None] = list(lengths)
    req = req or Request()
    items = []
    for item in tokens.piece_tokens(llm, prompts, fixed, req, None,  # type: ignore[arg-type]
                                     None if more is None else lambda: more(prompts, fixed)):
        items.append(item)
        req.items += 1
    return items, llm, prompts, fixed


def _expected(lengths: list[int]) -> list[tuple[int, int | None]]:
    out: list[tuple[int, int | None]] = []
    for piece, n in enumerate(lengths):
        out += [(piece, piece * 1000 + s) for s in range(n)] + [(piece, None)]
    return out


@pytest.mark.parametrize("lengths", [[40], [40, 30, 50, 20], [10, 60], [60, 5, 5, 70], [0, 20]])
def test_the_items_are_every_piece_in_order(lengths: list[int]) -> None:
    items, _, _, _ = _run(lengths)
    assert items == _expected(lengths)


def test_the_next_piece_joins_after_the_first_pieces_first_tokens_and_steps_with_it() -> None:
    items, llm, _, _ = _run([40, 30, 50])
    calls = llm.calls
    join = calls.index(("prefill", 1))
    # piece 0 alone until it has JOIN_AFTER_TOKENS tokens: its prefill's token + n - 1 steps
    assert calls[:join] == [("prefill", 0)] + [("step", 0)] * (tokens.JOIN_AFTER_TOKENS - 1)
    assert calls[join + 1] == ("pair", 0, 1)
    # one pass serves both while both decode: piece 0's other 24 tokens in 24 two-row steps,
    # then piece 2 joins piece 1 at piece 0's end
    rest = 40 - tokens.JOIN_AFTER_TOKENS
    assert calls[join + 2:join + 2 + rest] == [("step2", 0, 1)] * rest
    assert calls[join + 2 + rest:join + 4 + rest] == [("prefill", 2), ("pair", 1, 2)]
    passes = sum(1 for c in calls if c[0] in ("step", "step2"))
    n_tokens = sum(1 for _, t in items if t is not None)
    # piece 0 alone 15, with piece 1 24, piece 1 with piece 2 5 (piece 1 ends at 1 + 24 + 5),
    # piece 2 alone 44 (1 + 5 + 44 = 50): 88 passes over the weights for 120 tokens
    assert n_tokens == 120 and passes == 15 + 24 + 5 + 44


def test_more_is_called_once_the_last_piece_is_decoded_and_its_pieces_follow() -> None:
    asked: list[int] = []

    def more(prompts: list[LlmPrompt], fixed: list[int | None]) -> None:
        asked.append(len(prompts))
        if len(asked) == 1:
            prompts.append(_prompt(2))
            fixed.append(25)

    items, _, _, _ = _run([20, 30], more=more)
    assert items == _expected([20, 30, 25])
    assert asked == [2, 3]  # after piece 1 (the last known), then after the added piece 2


def test_cancellation_stops_before_the_next_model_call() -> None:
    req = Request(stop_after_items=25)
    with pytest.raises(SynthesisCancelled):
        _run([40, 40], req=req)
    assert req.items == 25


def test_stage_times_count_tokens_and_prefills() -> None:
    req = Request()
    _run([40, 30], req=req)
    assert req.times.llm_tokens == 70
    assert req.times.llm_decode_s > 0 and req.times.llm_prefill_s > 0
    assert "llm" in req.events


# -- the real graphs (tiny synthetic model) ------------------------------------------------------

def _load(qwen_dir: Path, cache: Path, graph: str, prefill: str | None = None) -> CosyVoice3Model:
    return CosyVoice3Model.load(qwen_dir, EngineOptions(llm_graph=graph, llm_prefill_graph=prefill,  # type: ignore[arg-type]
                                                        cache_dir=cache))


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def graph_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("paired-cache")


def _rows_equal_alone(decoder: LlmDecoder) -> bool:
    """Independently of the decoder's own check: sequences of 6 and 3 positions, two steps."""
    rng = np.random.default_rng(5)
    states = [decoder.new_state(), decoder.new_state()]
    for state, n in zip(states, (6, 3), strict=True):
        decoder.prefill(state, rng.standard_normal((1, n, 64)).astype(np.float32))
    pair = decoder.pair_states(*states)
    for fed in ((11, 22), (33, 44)):
        alone = [decoder.step(s, t) for s, t in zip(states, fed, strict=True)]
        both = decoder.step_pair(pair, fed)
        if not all(np.array_equal(both[r], alone[r]) for r in (0, 1)):
            return False
    return True


def test_pieces_pair_exactly_where_two_row_steps_equal_one_row_steps(
        qwen_dir: Path, graph_cache: Path) -> None:
    q4 = LlmDecoder(_load(qwen_dir, graph_cache, "fused-q4", "fused"))
    assert q4.pairs_pieces == _rows_equal_alone(q4)
    assert not LlmDecoder(_load(qwen_dir, graph_cache, "fused-q4", "fused"),
                          pair_pieces=False).pairs_pieces
    # fused: the int8 activation scale is one per tensor, so the rows couple
    fused = LlmDecoder(_load(qwen_dir, graph_cache, "fused"))
    assert not fused.pairs_pieces and not _rows_equal_alone(fused)
    # the published graph has one batch row
    assert not LlmDecoder(_load(qwen_dir, graph_cache, "published")).pairs_pieces


def test_the_load_time_check_of_two_rows_agrees_with_the_decoders(
        qwen_dir: Path, graph_cache: Path) -> None:
    # the graph choice at load (graph_choice.paired_rows_exact: zero caches, one step) and the
    # decoder's sequences of real steps (_rows_equal_alone) tell the same forms apart
    rows = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    q4 = LlmDecoder(_load(qwen_dir, graph_cache, "fused-q4", "fused"))
    assert graph_choice.paired_rows_exact(q4._model.llm, rows) == _rows_equal_alone(q4)
    fused = _load(qwen_dir, graph_cache, "fused")
    assert graph_choice.paired_rows_exact(fused.llm, rows) is False
    published = _load(qwen_dir, graph_cache, "published")
    assert graph_choice.paired_rows_exact(published.llm, rows) is None
    with pytest.raises(ValueError, match="n >= 2"):
        graph_choice.paired_rows_exact(fused.llm, rows[:1])


def test_paired_pieces_get_the_tokens_they_get_alone(qwen_dir: Path, graph_cache: Path) -> None:
    model = _load(qwen_dir, graph_cache, "fused-q4", "fused")
    decoder = LlmDecoder(model)
    if not decoder.rows_exact:
        pytest.skip("this CPU's kernels couple the rows of a two-row fused-q4 step")
    texts = ["The living room lights are now on.", "The front door is locked.",
             "It is seven degrees outside with light rain.", "Have a nice day."]
    empty = np.zeros(0, np.int64)
    prompts = [LlmPrompt(prompt_text_ids=empty, prompt_speech_tokens=empty, mode="cross_lingual",
                         tts_text_ids=np.array(model.tokenizer.encode(C.SYSTEM_PROMPT + t).ids,
                                               np.int64)) for t in texts]
    fixed: list[int | None] = [None] * len(prompts)
    runs = []
    for llm in (LlmDecoder(model, pair_pieces=False), decoder):
        req = Request()
        req.rng = np.random.default_rng(1234)
        runs.append(list(tokens.piece_tokens(llm, list(prompts), fixed, req, None, None)))
    alone, both = runs
    assert both == alone
    assert sum(1 for _, t in both if t is not None) > 4 * tokens.JOIN_AFTER_TOKENS


def test_text_that_came_meanwhile_joins_the_lone_piece() -> None:
    """A stream's next sentence: ``more`` is asked every MORE_POLL_TOKENS tokens of a piece
    decoding alone with nothing after it ([] there means "nothing yet", not the end)."""
    asked: list[int] = []

    def more(prompts: list[LlmPrompt], fixed: list[int | None]) -> None:
        asked.append(len(prompts))
        if len(asked) == 2:  # the sentence arrives before the second poll
            prompts.append(_prompt(2))
            fixed.append(30)

    items, llm, _, _ = _run([20, 80], more=more)
    assert items == _expected([20, 80, 30])
    # piece 1 joined piece 0 at its 16th token and took 4 more tokens in pairs plus its prefill's:
    # alone from 5 tokens on, polled at 25 and 50 (the second poll brings piece 2)
    assert asked[:2] == [2, 2] and asked[-1] == 3
    join = llm.calls.index(("prefill", 2))
    assert llm.calls[join + 1] == ("pair", 1, 2)
    assert sum(1 for c in llm.calls[:join] if c == ("step", 1)) == 50 - 5


def test_a_report_lets_rows_pair_only_within_the_published_graphs_distance_from_float(
        tmp_path: Path) -> None:
    from wyoming_cosyvoice3.engine.derive.llm.fused import FusedReport
    from wyoming_cosyvoice3.engine.loaders import fused_rows_validated

    def report(paired_logp: float | None) -> FusedReport:
        return FusedReport("fused-b8", "llm_int8.onnx", 0.13, 0.02, 0.9, 4e-6, 0.118, 274, 2222,
                           40.0, paired_logp)

    assert report(0.054).pairs_rows and report(0.1298).pairs_rows  # <= 1.1 x 0.118
    assert not report(0.1299).pairs_rows and not report(None).pairs_rows

    class FakeGraph:
        def __init__(self, path: Path) -> None:
            self.path = path

    b8 = tmp_path / "llm_int8.fusedb8r2-1-2.onnx"
    assert not fused_rows_validated(FakeGraph(b8))  # type: ignore[arg-type]  # no report
    (tmp_path / f"{b8.name}.json").write_text(json.dumps(asdict(report(0.054))))
    assert fused_rows_validated(FakeGraph(b8))  # type: ignore[arg-type]
    (tmp_path / f"{b8.name}.json").write_text(json.dumps(asdict(report(0.2))))
    assert not fused_rows_validated(FakeGraph(b8))  # type: ignore[arg-type]
    q4 = tmp_path / "llm_int8.fusedq4r2-1-2.onnx"  # only fused-b8's report counts
    (tmp_path / f"{q4.name}.json").write_text(json.dumps(asdict(report(0.054))))
    assert not fused_rows_validated(FakeGraph(q4))  # type: ignore[arg-type]


def test_the_validation_runs_the_steps_in_two_rows(qwen_dir: Path, graph_cache: Path) -> None:
    """teacher_forced_logp(rows=2): prompts in one row, single steps in two rows holding the
    same sequence: on fused-q4, where its rows are exact, equal to one row; the published
    graph (one batch row) refuses."""
    from wyoming_cosyvoice3.engine.derive.llm.fused import (
        teacher_forced_logp,
        validation_embeddings,
    )

    embeds = validation_embeddings(64)
    model = _load(qwen_dir, graph_cache, "fused-q4")
    one = teacher_forced_logp(model.llm.session, embeds)
    two = teacher_forced_logp(model.llm.session, embeds, rows=2)
    assert one.shape == two.shape and np.all(np.isfinite(two))
    if LlmDecoder(model).rows_exact:
        np.testing.assert_array_equal(two, one)
    published = _load(qwen_dir, graph_cache, "published")
    with pytest.raises(Exception, match=r"(?i)dimension|shape|batch"):
        teacher_forced_logp(published.llm.session, embeds, rows=2)


def test_a_two_row_step_is_each_rows_own_step_in_float(qwen_dir: Path,
                                                        graph_cache: Path) -> None:
    """The fused graph from the float LLM: each row of a two-row step (sequences of 6 and 3
    positions, the shorter one right-padded) equals its one-row step up to float summation
    order (1e-4 in logits of scale ~1 on the tiny model: products of 64-128 terms), whatever
    the CPU's kernels; a row that attended to the other's padding would be off by order 1."""
    model = CosyVoice3Model.load(qwen_dir, EngineOptions(llm_precision="fp32", llm_graph="fused",
                                                         cache_dir=graph_cache))
    decoder = LlmDecoder(model)
    rng = np.random.default_rng(8)
    states = [decoder.new_state(), decoder.new_state()]
    for state, n in zip(states, (6, 3), strict=True):
        decoder.prefill(state, rng.standard_normal((1, n, 64)).astype(np.float32))
    pair = decoder.pair_states(*states)
    for fed in ((11, 22), (33, 44), (55, 66)):
        alone = [decoder.step(s, t) for s, t in zip(states, fed, strict=True)]
        both = decoder.step_pair(pair, fed)
        for row in (0, 1):
            np.testing.assert_allclose(both[row], alone[row], rtol=0, atol=1e-4)
    assert pair.lens == [s.past_len for s in states] == [9, 6]


@pytest.mark.parametrize("lengths", [[40, 30, 50, 20], [60, 5, 5, 70], [0, 20]])
def test_the_progress_runs_ahead_of_the_items(lengths: list[int]) -> None:
    # what the consumer can read at each item: every token handed over is counted; a piece
    # paired beside a longer one is decoded to its end before its first item comes; the loop
    # is finished only after the last item
    llm = ScriptedDecoder()
    prompts = [_prompt(i) for i in range(len(lengths))]
    progress = tokens.DecodeProgress()
    seen: dict[int, int] = {}
    ended_at_first: dict[int, bool] = {}
    finished_before_end = False
    for index, token in tokens.piece_tokens(llm, prompts, list(lengths), Request(),  # type: ignore[arg-type]
                                            None, None, progress):
        finished_before_end |= progress.finished
        if token is None:
            assert progress.tokens_if_ended(index) == lengths[index]
            continue
        if index not in seen:
            ended_at_first[index] = progress.tokens_if_ended(index) is not None
        seen[index] = seen.get(index, 0) + 1
        assert progress.decoded_tokens[index] >= seen[index]
    assert not finished_before_end and progress.finished
    assert progress.decoded_tokens == lengths
    if lengths == [60, 5, 5, 70]:
        # pieces 1 and 2 (5 tokens each) were decoded beside piece 0 before it ended
        assert ended_at_first == {0: False, 1: True, 2: True, 3: False}
