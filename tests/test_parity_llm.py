"""Parity of the LLM stage with upstream CosyVoice3: prompt layout, log-probs, decoding.

References: ``refs/llm.npz`` of the fixture set (``parity_support``) and the manifest's
``llm_cases`` (one case per prompt mode: text, clip, transcript, instruction, min/max length).
Upstream's frontend ids and prompt speech tokens are used to build the :class:`LlmPrompt` of
the log-prob and decode tests, so each test checks one stage. The fp32 LLM graph is used (the
references are fp32).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from parity_support import (
    Parity,
    assert_close,
    assert_identical,
    parity_cases,
    parity_engine,
)

from wyoming_cosyvoice3.engine import LlmPrompt, VoiceFeatures, VoicePrompt
from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.llm.decoder import decode_limits, log_softmax

LLM = "llm.npz"
MODES = parity_cases("llm")


@pytest.fixture(scope="module")
def engine(parity: Parity) -> Any:
    return parity_engine(parity)


def _ids(parity: Parity, mode: str, what: str) -> np.ndarray:
    return parity.array(LLM, f"{mode}_{what}").astype(np.int64).reshape(-1)


def _clip_tokens(parity: Parity, clip: str) -> np.ndarray:
    """Upstream's speech tokens of ``clip`` (from the case that uses them; empty if none)."""
    for mode, case in parity.llm_cases.items():
        tokens = _ids(parity, mode, "prompt_speech_tokens")
        if case.get("clip") == clip and tokens.size:
            return tokens
    return np.zeros(0, dtype=np.int64)


def _upstream_prompt(parity: Parity, mode: str) -> LlmPrompt:
    return LlmPrompt(
        prompt_text_ids=_ids(parity, mode, "prompt_text_ids"),
        tts_text_ids=_ids(parity, mode, "tts_text_ids"),
        prompt_speech_tokens=_ids(parity, mode, "prompt_speech_tokens"),
        mode=mode,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("mode", MODES)
def test_parity_prompt_ids(parity: Parity, engine: Any, mode: str) -> None:
    """The frontend builds upstream's prompt text ids, tts text ids and speech tokens.

    The voice carries the clip's speech tokens in every mode (as a prepared voice does);
    only zero-shot prompts may use them.
    """
    case = parity.llm_cases[mode]
    tokens = _clip_tokens(parity, case.get("clip"))
    # placeholder speaker and mel of the set's shapes (a flow case's; only the ids are checked)
    flow_case = next(iter(parity.flow_cases))
    embedding_dim = int(parity.entry("flow.npz", f"{flow_case}_embedding")["shape"][-1])
    frames = parity.token_mel_ratio(flow_case) * tokens.size
    features = VoiceFeatures(
        speech_tokens=tokens,
        speaker_embedding=np.zeros(embedding_dim, dtype=np.float32),
        prompt_mel=np.zeros((frames, int(parity.dit["mel_dim"])), dtype=np.float32),
    )
    voice = VoicePrompt(
        features=features, transcript=case.get("transcript"), instruction=case.get("instruction")
    )
    pieces = engine.frontend.split_pieces(case["text"])
    assert len(pieces) == 1, f"{mode}: the case text should be one piece, got {pieces}"
    prompt = engine.frontend.build_prompt(pieces[0], voice)
    assert prompt.mode == mode
    for what, got in (
        ("prompt_text_ids", prompt.prompt_text_ids),
        ("tts_text_ids", prompt.tts_text_ids),
        ("prompt_speech_tokens", prompt.prompt_speech_tokens),
    ):
        assert_identical(got, _ids(parity, mode, what), f"{mode} {what}")
    assert decode_limits(len(prompt.tts_text_ids)) == (case["min_len"], case["max_len"])


@pytest.mark.parametrize("mode", MODES)
def test_parity_prefill_and_teacher_forced_log_probs(
    parity: Parity, engine: Any, mode: str
) -> None:
    """log_softmax of the logits after prefill, then after each forced speech token."""
    reference = parity.array(LLM, f"{mode}_logp")
    forced = parity.array(LLM, "forced_tokens").astype(np.int64)
    assert reference.shape[0] == forced.shape[0] + 1
    tolerance = parity.tolerance("llm_log_probs")
    state, logits, _ = engine.llm.prefill_prompt(_upstream_prompt(parity, mode))
    assert_close(log_softmax(logits), reference[0], tolerance, f"{mode} prefill log-probs")
    rows = [log_softmax(engine.llm.step(state, int(token))) for token in forced]
    assert_close(np.stack(rows), reference[1:], tolerance, f"{mode} teacher-forced log-probs")


class StoredUniforms:
    """Stands in for ``numpy.random.Generator``: ``random()`` returns the stored stream."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = [float(v) for v in values]
        self.used = 0

    def random(self) -> float:
        assert self.used < len(self.values), "decode drew more uniforms than upstream stored"
        value = self.values[self.used]
        self.used += 1
        return value


def _decode(engine: Any, prompt: LlmPrompt, rng: Any, max_len: int) -> list[int]:
    return [int(t) for t in engine.llm.decode(prompt, rng, max_tokens=max_len)]


@pytest.mark.parametrize("mode", MODES)
def test_parity_greedy_decode(
    parity: Parity, engine: Any, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Full decode with top-k 1 and no repetition ban (stop ids masked below min_len)."""
    monkeypatch.setattr(C, "RAS_TOP_K", 1)
    monkeypatch.setattr(C, "RAS_TAU_R", 1000.0)
    case = parity.llm_cases[mode]
    rng = StoredUniforms(np.full(int(case["max_len"]) + 1, 0.5))
    tokens = _decode(engine, _upstream_prompt(parity, mode), rng, int(case["max_len"]))
    assert_identical(tokens, _ids(parity, mode, "greedy_tokens"), f"{mode} greedy decode")


@pytest.mark.parametrize("mode", MODES)
def test_parity_ras_decode_with_stored_uniforms(parity: Parity, engine: Any, mode: str) -> None:
    """Full RAS decode consuming upstream's stored uniform draws in upstream's order."""
    case = parity.llm_cases[mode]
    per_step = _ids(parity, mode, "ras_uniforms_per_step")
    rng = StoredUniforms(parity.array(LLM, f"{mode}_ras_uniforms"))
    tokens = _decode(engine, _upstream_prompt(parity, mode), rng, int(case["max_len"]))
    assert_identical(tokens, _ids(parity, mode, "ras_tokens"), f"{mode} RAS decode")
    assert rng.used == int(per_step.sum()) == int(case["ras_uniforms_used"]), (
        f"{mode}: decode drew {rng.used} uniforms, upstream {int(per_step.sum())}"
    )
