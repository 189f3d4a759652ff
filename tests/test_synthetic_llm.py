"""The synthetic embeddings and LLM: a real KV cache, masking, quantised variants, EOS."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.graphs import SPEECH_EMBEDDING, TEXT_EMBEDDING, Graph, load_llm

LAYERS, HEADS, HEAD_DIM = 24, 2, 64


@pytest.fixture(scope="module")
def graphs(tiny_model_dir: Path) -> dict[str, Graph]:
    return {
        "text": Graph(tiny_model_dir / TEXT_EMBEDDING.file, TEXT_EMBEDDING),
        "speech": Graph(tiny_model_dir / SPEECH_EMBEDDING.file, SPEECH_EMBEDDING),
        "fp32": load_llm(tiny_model_dir / "llm.onnx"),
        "int8": load_llm(tiny_model_dir / "llm_int8.onnx"),
        "q4": load_llm(tiny_model_dir / "llm_q4.onnx"),
    }


def embed(graph: Graph, ids: list[int]) -> np.ndarray:
    return graph.run({"input_ids": np.asarray([ids], np.int64)})["inputs_embeds"]


def empty_cache() -> list[np.ndarray]:
    return [np.zeros((1, HEADS, 0, HEAD_DIM), np.float32) for _ in range(2 * LAYERS)]


def step(
    llm: Graph,
    embeds: np.ndarray,
    cache: list[np.ndarray],
    mask: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One LLM call; returns (logits [6761], present cache)."""
    past = cache[0].shape[2]
    seq = embeds.shape[1]
    feeds = {
        "inputs_embeds": embeds,
        "attention_mask": np.ones((1, past + seq), np.int64) if mask is None else mask,
        "position_ids": (
            np.arange(past, past + seq, dtype=np.int64)[None] if positions is None else positions
        ),
    }
    for layer in range(LAYERS):
        feeds[f"past_key_values.{layer}.key"] = cache[2 * layer]
        feeds[f"past_key_values.{layer}.value"] = cache[2 * layer + 1]
    out = llm.run(feeds)
    present = [
        out[f"present.{layer}.{kind}"] for layer in range(LAYERS) for kind in ("key", "value")
    ]
    return out["logits"][0], present


def random_cache(rng: np.random.Generator, past: int) -> list[np.ndarray]:
    return [rng.normal(size=(1, HEADS, past, HEAD_DIM)).astype(np.float32) for _ in range(48)]


def test_present_is_past_followed_by_new(graphs: dict[str, Graph]) -> None:
    rng = np.random.default_rng(1)
    cache = random_cache(rng, 7)
    logits, present = step(graphs["fp32"], embed(graphs["text"], [11, 22, 33]), cache)
    assert logits.shape == (6761,) and logits.dtype == np.float32
    for past, new in zip(cache, present, strict=True):
        assert new.shape == (1, HEADS, 10, HEAD_DIM)
        np.testing.assert_array_equal(new[:, :, :7], past)
        assert np.abs(new[:, :, 7:]).sum() > 0


def test_logits_depend_on_every_layer_of_the_cache(graphs: dict[str, Graph]) -> None:
    rng = np.random.default_rng(2)
    cache = random_cache(rng, 5)
    new = embed(graphs["text"], [101, 202])
    base, _ = step(graphs["fp32"], new, cache)
    for index in (0, 25, 47):  # layer 0 key, layer 12 value, layer 23 value
        changed = [c.copy() for c in cache]
        changed[index][:, :, 2] += 1.0
        logits, present = step(graphs["fp32"], new, changed)
        assert np.abs(logits - base).max() > 1e-3, index
        np.testing.assert_array_equal(present[index][:, :, :5], changed[index])


def test_incremental_decode_equals_one_full_pass(graphs: dict[str, Graph]) -> None:
    ids = [500, 1000, 1500, 2000, 2500, 3000]
    full_logits, full_cache = step(graphs["fp32"], embed(graphs["text"], ids), empty_cache())
    logits, cache = step(graphs["fp32"], embed(graphs["text"], ids[:3]), empty_cache())
    for token in ids[3:]:
        logits, cache = step(graphs["fp32"], embed(graphs["text"], [token]), cache)
    np.testing.assert_allclose(logits, full_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache, full_cache, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_attention_mask_and_positions_are_used(graphs: dict[str, Graph]) -> None:
    rng = np.random.default_rng(3)
    cache = random_cache(rng, 6)
    new = embed(graphs["text"], [7, 8])
    base, _ = step(graphs["fp32"], new, cache)
    mask = np.ones((1, 8), np.int64)
    mask[0, 1] = 0
    masked, _ = step(graphs["fp32"], new, cache, mask=mask)
    assert np.abs(masked - base).max() > 1e-3
    shifted, _ = step(graphs["fp32"], new, cache, positions=np.asarray([[20, 21]], np.int64))
    assert np.abs(shifted - base).max() > 1e-3


def _prompt(graphs: dict[str, Graph], tokenizer: Tokenizer, text: str, prompt_tokens: int):
    ids = tokenizer.encode(C.SYSTEM_PROMPT + text, add_special_tokens=False).ids
    parts = [embed(graphs["speech"], [C.SOS_TOKEN]), embed(graphs["text"], ids)]
    parts.append(embed(graphs["speech"], [C.TASK_TOKEN]))
    if prompt_tokens:
        tokens = np.random.default_rng(4).integers(0, C.SPEECH_TOKEN_VOCAB, prompt_tokens)
        parts.append(embed(graphs["speech"], tokens.tolist()))
    n_text = len(tokenizer.encode(text, add_special_tokens=False).ids)
    return np.concatenate(parts, axis=1), n_text


@pytest.mark.parametrize("precision", ["int8", "q4"])
def test_quantised_logits_are_close_to_fp32(
    graphs: dict[str, Graph], tiny_model_dir: Path, precision: str
) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    embeds, _ = _prompt(graphs, tokenizer, "The kitchen light is now on.", 50)
    ref, _ = step(graphs["fp32"], embeds, empty_cache())
    got, _ = step(graphs[precision], embeds, empty_cache())
    a, b = ref[: C.SPEECH_TOKEN_VOCAB], got[: C.SPEECH_TOKEN_VOCAB]
    cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert cosine > (0.9 if precision == "int8" else 0.95)
    assert got[C.EOS_TOKEN] == pytest.approx(ref[C.EOS_TOKEN], abs=1e-3)  # exact counters


def test_speech_special_ids_get_distinct_rows(graphs: dict[str, Graph]) -> None:
    table = embed(graphs["speech"], list(range(C.SPEECH_EMBEDDING_ROWS)))[0]
    assert table.shape == (6761, 896)
    specials = table[C.SPEECH_TOKEN_VOCAB :]
    assert len(np.unique(specials, axis=0)) == 200
    ordinary = {row.tobytes() for row in table[: C.SPEECH_TOKEN_VOCAB]}
    for token in (C.SOS_TOKEN, C.EOS_TOKEN, C.TASK_TOKEN, C.FILL_TOKEN):
        assert table[token].tobytes() not in ordinary


def test_text_embedding_is_fp16_table_cast_to_fp32(graphs: dict[str, Graph]) -> None:
    out = embed(graphs["text"], [0, 151643, 151646, 151935])
    assert out.dtype == np.float32 and out.shape == (1, 4, 896)
    np.testing.assert_array_equal(out.astype(np.float16).astype(np.float32), out)


@pytest.mark.parametrize(
    ("prompt_tokens", "text"), [(0, "Turn on the lights, please."), (125, "It is sunny.")]
)
def test_decoding_ends_about_five_tokens_per_text_token(
    graphs: dict[str, Graph], tiny_model_dir: Path, prompt_tokens: int, text: str
) -> None:
    """EOS logit = 6 + (decode steps - 5 * text tokens): it rises by exactly 1 per step."""
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    embeds, n_text = _prompt(graphs, tokenizer, text, prompt_tokens)
    logits, cache = step(graphs["fp32"], embeds, empty_cache())
    assert logits[C.EOS_TOKEN] == pytest.approx(6.0 - 5.0 * n_text, abs=1e-4)
    assert logits[C.FILL_TOKEN] < -20 and logits[C.SOS_TOKEN] < -20
    rng = np.random.default_rng(0)
    generated: list[int] = []
    for _ in range(20 * n_text):
        probs = np.exp(logits - logits.max())
        if len(generated) < 2 * n_text:
            probs[C.SPEECH_TOKEN_VOCAB :] = 0.0
        token = int(rng.choice(len(probs), p=probs / probs.sum()))
        if token >= C.SPEECH_TOKEN_VOCAB:
            break
        generated.append(token)
        previous = logits[C.EOS_TOKEN]
        logits, cache = step(graphs["fp32"], embed(graphs["speech"], [token]), cache)
        assert logits[C.EOS_TOKEN] - previous == pytest.approx(1.0, abs=1e-4)
    assert token == C.EOS_TOKEN
    assert 5 * n_text - 5 <= len(generated) <= 5 * n_text + 15
    assert 20 <= len(generated) <= 150
