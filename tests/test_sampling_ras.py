"""Repetition-Aware Sampling, nucleus filtering and stop masking (engine/llm/decoder.py,
its sampling section)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import scipy.special

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.llm.decoder import (
    log_softmax,
    mask_stop_tokens,
    nucleus_candidates,
    nucleus_sample,
    random_sample,
    ras_sample,
    sample_step,
)


def _logp(probs: list[float], vocab: int | None = None) -> np.ndarray:
    """Log-probabilities of ``probs`` padded with -inf up to ``vocab`` entries."""
    p = np.zeros(vocab or len(probs))
    p[: len(probs)] = probs
    with np.errstate(divide="ignore"):
        return np.log(p)


def _reference_nucleus(logp: np.ndarray, top_p: float, top_k: int) -> list[int]:
    """Straight transcription of the rule of upstream common.py nucleus_sampling."""
    p = scipy.special.softmax(logp)
    order = np.argsort(-p, kind="stable")
    kept: list[int] = []
    cum = 0.0
    for i in order:
        if cum < top_p and len(kept) < top_k:
            cum += p[i]
            kept.append(int(i))
        else:
            break
    return kept


def test_log_softmax_matches_scipy() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=8.0, size=(3, C.SPEECH_EMBEDDING_ROWS)).astype(np.float32)
    np.testing.assert_allclose(
        log_softmax(logits),
        scipy.special.log_softmax(logits.astype(np.float64), axis=-1),
        atol=1e-12,
    )
    masked = logits[0].astype(np.float64)
    masked[10:] = -np.inf
    out = log_softmax(masked)
    assert np.all(np.isneginf(out[10:]))
    np.testing.assert_allclose(np.exp(out[:10]).sum(), 1.0, atol=1e-12)


def test_nucleus_keeps_crossing_token_and_respects_top_k() -> None:
    # sorted: id1 .50 (before 0), id2 .20 (before .50), id3 .15 (before .70 < .8: the crossing
    # token, kept), id4 .10 (before .85 >= .8: dropped)
    logp = _logp([0.05, 0.50, 0.20, 0.15, 0.10], vocab=50)
    ids, probs = nucleus_candidates(logp, top_p=0.8, top_k=25)
    assert ids.tolist() == [1, 2, 3]
    np.testing.assert_allclose(probs, [0.50, 0.20, 0.15], atol=1e-12)
    ids, _ = nucleus_candidates(logp, top_p=0.8, top_k=2)
    assert ids.tolist() == [1, 2]
    ids, _ = nucleus_candidates(logp, top_p=1.0, top_k=5)
    assert ids.tolist() == [1, 2, 3, 4, 0]


def test_nucleus_equal_probabilities_keep_ascending_ids() -> None:
    logp = np.zeros(64)  # every p = 1/64 exactly; cumulative sums i/64 are exact
    ids, _ = nucleus_candidates(logp, top_p=0.125, top_k=25)
    assert ids.tolist() == list(range(8))  # kept while i/64 < 8/64
    ids, _ = nucleus_candidates(logp, top_p=0.8, top_k=25)
    assert ids.tolist() == list(range(25))  # top_k binds


def test_nucleus_matches_reference_rule_on_random_logits() -> None:
    rng = np.random.default_rng(7)
    for trial in range(200):
        logits = rng.normal(scale=rng.uniform(0.5, 6.0), size=C.SPEECH_EMBEDDING_ROWS)
        if trial % 3 == 0:
            logits = np.round(logits)  # many exact ties
        logp = log_softmax(logits)
        top_p = float(rng.uniform(0.05, 1.0))
        top_k = int(rng.integers(1, 60))
        ids, _ = nucleus_candidates(logp, top_p, top_k)
        assert ids.tolist() == _reference_nucleus(logp, top_p, top_k)


def test_nucleus_sample_frequencies() -> None:
    logp = _logp([0.05, 0.50, 0.20, 0.15, 0.10], vocab=30)
    rng = np.random.default_rng(123)
    n = 20000
    counts = Counter(nucleus_sample(logp, rng) for _ in range(n))
    assert set(counts) == {1, 2, 3}
    for token, p in {1: 0.50, 2: 0.20, 3: 0.15}.items():
        assert counts[token] / n == pytest.approx(p / 0.85, abs=0.01)


def test_random_sample_frequencies() -> None:
    logp = _logp([0.1, 0.6, 0.3], vocab=10)
    rng = np.random.default_rng(5)
    n = 30000
    counts = Counter(random_sample(logp, rng) for _ in range(n))
    assert set(counts) == {0, 1, 2}
    for token, p in enumerate([0.1, 0.6, 0.3]):
        assert counts[token] / n == pytest.approx(p, abs=0.01)


def test_ras_without_repetition_is_plain_nucleus() -> None:
    # token 0 alone fills the nucleus (0.9 >= 0.8), so nucleus sampling always picks it
    logp = _logp([0.9, 0.06, 0.04], vocab=20)
    rng = np.random.default_rng(0)
    history = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert {ras_sample(logp, history, rng) for _ in range(500)} == {0}
    # token 0 just outside the 10-token window: still no fallback
    assert {ras_sample(logp, [0, *history], rng) for _ in range(500)} == {0}


def test_ras_fallback_triggers_when_token_is_in_window() -> None:
    logp = _logp([0.9, 0.06, 0.04], vocab=20)
    rng = np.random.default_rng(1)
    history = [0, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # token 0 once, at the window's oldest slot
    n = 20000
    counts = Counter(ras_sample(logp, history, rng) for _ in range(n))
    assert set(counts) == {1, 2}  # the repeated token is banned for this draw
    assert counts[1] / n == pytest.approx(0.6, abs=0.012)
    assert counts[2] / n == pytest.approx(0.4, abs=0.012)


def test_ras_fallback_samples_the_whole_distribution() -> None:
    # 0.9 on token 0 and 0.001 on each of 100 others: the fallback ignores top-k (25)
    probs = [0.9] + [0.001] * 100
    logp = _logp(probs, vocab=200)
    rng = np.random.default_rng(2)
    draws = [ras_sample(logp, [0], rng) for _ in range(5000)]
    assert 0 not in draws
    assert set(draws) == set(range(1, 101))


def test_ras_only_token_left_is_returned() -> None:
    logp = _logp([1.0], vocab=8)
    rng = np.random.default_rng(3)
    assert ras_sample(logp, [0] * 10, rng) == 0


def test_ras_is_deterministic_per_seed() -> None:
    rng = np.random.default_rng(11)
    logp = log_softmax(rng.normal(scale=3.0, size=C.SPEECH_EMBEDDING_ROWS))

    def run(seed: int) -> list[int]:
        gen = np.random.default_rng(seed)
        out: list[int] = []
        for _ in range(200):
            out.append(ras_sample(logp, out, gen))
        return out

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_mask_stop_tokens_blocks_every_special_id() -> None:
    logits = np.zeros(C.SPEECH_EMBEDDING_ROWS)
    logits[C.EOS_TOKEN] = 50.0  # EOS by far the most likely
    logits[C.SPEECH_TOKEN_VOCAB + 100] = 40.0
    masked = mask_stop_tokens(log_softmax(logits))
    assert np.all(np.isneginf(masked[C.SPEECH_TOKEN_VOCAB :]))
    assert np.all(np.isfinite(masked[: C.SPEECH_TOKEN_VOCAB]))
    rng = np.random.default_rng(9)
    below = [sample_step(logits, [], rng, step=3, min_len=4) for _ in range(300)]
    assert max(below) < C.SPEECH_TOKEN_VOCAB
    at_min = [sample_step(logits, [], rng, step=4, min_len=4) for _ in range(50)]
    assert set(at_min) == {C.EOS_TOKEN}


def test_invalid_parameters_raise() -> None:
    logp = np.zeros(10)
    with pytest.raises(ValueError, match="top_p"):
        nucleus_candidates(logp, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        nucleus_candidates(logp, top_k=0)
    with pytest.raises(ValueError, match="-inf"):
        nucleus_candidates(np.full(10, -np.inf))


def test_sample_step_equals_composed_functions() -> None:
    rng = np.random.default_rng(21)
    for trial in range(100):
        logits = rng.normal(scale=3.0, size=C.SPEECH_EMBEDDING_ROWS).astype(np.float32)
        logits[C.EOS_TOKEN] += 6.0
        history = rng.integers(0, 40, size=int(rng.integers(0, 20))).tolist()
        logits[history[-1:]] += 8.0  # provoke the repetition fallback now and then
        step, min_len = trial % 7, 3
        logp = log_softmax(logits)
        if step < min_len:
            logp = mask_stop_tokens(logp)
        seed = int(rng.integers(1 << 30))
        composed = ras_sample(logp, history, np.random.default_rng(seed))
        fused = sample_step(logits, history, np.random.default_rng(seed), step, min_len)
        assert fused == composed
