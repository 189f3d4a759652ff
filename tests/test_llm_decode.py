"""LLM decoding with the KV cache on the tiny synthetic model (engine/llm/decoder.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.errors import SynthesisCancelled, SynthesisTimeout
from wyoming_cosyvoice3.engine.llm.decoder import (
    KvMode,
    LlmDecoder,
    decode_limits,
    run_outputs_are_zero_copy,
    sample_step,
)
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions, LlmPrompt, StageTimes

TRANSCRIPT = "This is the reference clip of the voice."
TEXT = "The living room lights are now on."


@pytest.fixture(scope="module")
def model(bare_model: CosyVoice3Model) -> CosyVoice3Model:
    return bare_model


@pytest.fixture(scope="module")
def decoder(model: CosyVoice3Model) -> LlmDecoder:
    return LlmDecoder(model)


def _ids(model: CosyVoice3Model, text: str) -> np.ndarray:
    return np.array(model.tokenizer.encode(text).ids, dtype=np.int64)


def zero_shot_prompt(model: CosyVoice3Model, text: str = TEXT, n_speech: int = 30) -> LlmPrompt:
    speech = np.random.default_rng(99).integers(0, C.SPEECH_TOKEN_VOCAB, n_speech)
    return LlmPrompt(
        prompt_text_ids=_ids(model, C.SYSTEM_PROMPT + TRANSCRIPT),
        tts_text_ids=_ids(model, text),
        prompt_speech_tokens=speech.astype(np.int64),
        mode="zero_shot",
    )


def cross_lingual_prompt(model: CosyVoice3Model, text: str = TEXT) -> LlmPrompt:
    empty = np.zeros(0, dtype=np.int64)
    return LlmPrompt(
        prompt_text_ids=empty,
        tts_text_ids=_ids(model, C.SYSTEM_PROMPT + text),
        prompt_speech_tokens=empty,
        mode="cross_lingual",
    )


def _decode(decoder: LlmDecoder, prompt: LlmPrompt, seed: int, **kwargs: object) -> list[int]:
    kwargs.setdefault("max_tokens", 3000)
    return list(decoder.decode(prompt, np.random.default_rng(seed), **kwargs))  # type: ignore[arg-type]


def test_prompt_embeddings_layout(decoder: LlmDecoder, model: CosyVoice3Model) -> None:
    prompt = zero_shot_prompt(model)
    embeds = decoder.prompt_embeddings(prompt)
    p, n, n_speech = (
        len(prompt.prompt_text_ids),
        len(prompt.tts_text_ids),
        len(prompt.prompt_speech_tokens),
    )
    assert embeds.shape == (1, 1 + p + n + 1 + n_speech, model.dims.hidden_size)
    assert embeds.dtype == np.float32
    text_ids = np.concatenate([prompt.prompt_text_ids, prompt.tts_text_ids])
    np.testing.assert_array_equal(embeds[:, :1], decoder.embed_speech([C.SOS_TOKEN]))
    np.testing.assert_array_equal(embeds[:, 1 : 1 + p + n], decoder.embed_text(text_ids))
    np.testing.assert_array_equal(
        embeds[:, 1 + p + n : 2 + p + n], decoder.embed_speech([C.TASK_TOKEN])
    )
    np.testing.assert_array_equal(
        embeds[:, 2 + p + n :], decoder.embed_speech(prompt.prompt_speech_tokens)
    )


@pytest.mark.parametrize("make_prompt", [zero_shot_prompt, cross_lingual_prompt])
def test_decode_ends_within_limits(
    decoder: LlmDecoder, model: CosyVoice3Model, make_prompt: object
) -> None:
    prompt = make_prompt(model)  # type: ignore[operator]
    min_len, max_len = decode_limits(len(prompt.tts_text_ids))
    for seed in range(3):
        tokens = _decode(decoder, prompt, seed)
        assert min_len <= len(tokens) <= max_len
        assert all(0 <= t < C.SPEECH_TOKEN_VOCAB for t in tokens)


def test_max_tokens_caps_decoding_exactly(decoder: LlmDecoder, model: CosyVoice3Model) -> None:
    prompt = zero_shot_prompt(model)
    min_len, _ = decode_limits(len(prompt.tts_text_ids))
    assert min_len > 7  # so a stop id is impossible before the cap
    assert len(_decode(decoder, prompt, 0, max_tokens=7)) == 7


def test_same_seed_same_tokens_other_seed_differs(
    decoder: LlmDecoder, model: CosyVoice3Model
) -> None:
    prompt = zero_shot_prompt(model)
    first = _decode(decoder, prompt, 1234)
    assert _decode(decoder, prompt, 1234) == first
    assert _decode(decoder, prompt, 1235) != first


@pytest.mark.parametrize("kv_mode", ["iobinding", "numpy"])
def test_kv_cache_matches_full_recompute(model: CosyVoice3Model, kv_mode: KvMode) -> None:
    """Cached decoding equals re-running the whole sequence without a cache at every step."""
    decoder = LlmDecoder(model, kv_mode=kv_mode)
    prompt = zero_shot_prompt(model)
    seed = 7
    tokens = _decode(decoder, prompt, seed, max_tokens=40)
    assert len(tokens) == 40
    base = decoder.prompt_embeddings(prompt)
    min_len, _ = decode_limits(len(prompt.tts_text_ids))

    cached_state = decoder.new_state()
    cached = [decoder.prefill(cached_state, base)]
    for token in tokens[:-1]:
        cached.append(decoder.step(cached_state, token))

    rng = np.random.default_rng(seed)
    replayed: list[int] = []
    for i in range(len(tokens)):
        full = np.concatenate([base, decoder.embed_speech(tokens[:i])], axis=1)
        reference = decoder.prefill(decoder.new_state(), full)
        np.testing.assert_allclose(cached[i], reference, rtol=1e-4, atol=1e-4)
        replayed.append(sample_step(reference, replayed, rng, i, min_len))
    assert replayed == tokens


def test_iobinding_and_numpy_paths_agree(model: CosyVoice3Model) -> None:
    decoder = LlmDecoder(model, kv_mode="iobinding")
    plain = LlmDecoder(model, kv_mode="numpy")
    prompt = zero_shot_prompt(model)
    assert _decode(plain, prompt, 5) == _decode(decoder, prompt, 5)
    bound_state, plain_state = decoder.new_state(), plain.new_state()
    embeds = decoder.prompt_embeddings(prompt)
    np.testing.assert_array_equal(
        decoder.prefill(bound_state, embeds), plain.prefill(plain_state, embeds)
    )
    for token in (17, 4000, 6560):
        np.testing.assert_array_equal(
            decoder.step(bound_state, token), plain.step(plain_state, token)
        )
    assert bound_state.past_len == plain_state.past_len == embeds.shape[1] + 3


def test_prefill_in_parts_equals_one_prefill(decoder: LlmDecoder, model: CosyVoice3Model) -> None:
    """The prefix-cache hook: [SOS + prompt text] then the rest gives the same logits."""
    prompt = zero_shot_prompt(model)
    whole = decoder.prefill(decoder.new_state(), decoder.prompt_embeddings(prompt))
    prefix_state = decoder.new_state()
    decoder.prefill(prefix_state, decoder.prefix_embeddings(prompt))
    assert prefix_state.past_len == 1 + len(prompt.prompt_text_ids)
    forked = prefix_state.fork()
    parts = decoder.prefill(forked, decoder.request_embeddings(prompt))
    np.testing.assert_allclose(parts, whole, rtol=1e-4, atol=1e-4)
    # the fork did not touch the cached prefix: it can start another request
    again = decoder.prefill(prefix_state.fork(), decoder.request_embeddings(prompt))
    np.testing.assert_array_equal(again, parts)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_cancellation_after_k_tokens(decoder: LlmDecoder, model: CosyVoice3Model, k: int) -> None:
    yielded: list[int] = []
    stop_calls: list[int] = []

    def should_stop() -> bool:
        stop_calls.append(len(yielded))
        return len(yielded) >= k

    with pytest.raises(SynthesisCancelled):
        for token in decoder.decode(
            zero_shot_prompt(model),
            np.random.default_rng(0),
            should_stop=should_stop,
            max_tokens=3000,
        ):
            yielded.append(token)
    assert len(yielded) == k
    assert stop_calls == list(range(k + 1))  # checked before the prefill and before every step


def test_deadline_in_the_past_times_out(decoder: LlmDecoder, model: CosyVoice3Model) -> None:
    times = StageTimes()
    gen = decoder.decode(
        zero_shot_prompt(model),
        np.random.default_rng(0),
        max_tokens=3000,
        deadline=time.monotonic() - 1.0,
        times=times,
    )
    with pytest.raises(SynthesisTimeout):
        next(gen)
    assert times.llm_tokens == 0 and times.llm_prefill_s == 0.0


def test_stage_times_are_recorded(decoder: LlmDecoder, model: CosyVoice3Model) -> None:
    times = StageTimes()
    tokens = _decode(decoder, zero_shot_prompt(model), 3, times=times)
    assert times.llm_tokens == len(tokens) > 0
    assert times.llm_prefill_s > 0.0 and times.llm_decode_s > 0.0


def test_empty_text_yields_nothing(decoder: LlmDecoder, model: CosyVoice3Model) -> None:
    empty = np.zeros(0, dtype=np.int64)
    prompt = LlmPrompt(empty, empty, empty, "cross_lingual")
    assert _decode(decoder, prompt, 0) == []


@pytest.mark.parametrize("precision", ["int8", "q4"])
def test_quantised_precisions_decode(tiny_model_dir: Path, precision: str) -> None:
    quant = CosyVoice3Model.load(tiny_model_dir, EngineOptions(llm_precision=precision))  # type: ignore[arg-type]
    decoder = LlmDecoder(quant)
    prompt = zero_shot_prompt(quant)
    min_len, max_len = decode_limits(len(prompt.tts_text_ids))
    tokens = _decode(decoder, prompt, 0)
    assert min_len <= len(tokens) <= max_len
    assert _decode(decoder, prompt, 0) == tokens


@pytest.mark.parametrize(
    ("version", "zero_copy"),
    [("1.18.1", False), ("1.19.0", True), ("1.32.0", True), ("2.0.0", True), ("dev", False)],
)
def test_zero_copy_version_rule(version: str, zero_copy: bool) -> None:
    assert run_outputs_are_zero_copy(version) is zero_copy


def test_auto_kv_mode_follows_onnxruntime_version(model: CosyVoice3Model) -> None:
    expected = "numpy" if run_outputs_are_zero_copy() else "iobinding"
    assert LlmDecoder(model).kv_mode == expected
    with pytest.raises(ValueError, match="kv_mode"):
        LlmDecoder(model, kv_mode="gpu")  # type: ignore[arg-type]
