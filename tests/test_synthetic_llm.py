"""The tiny synthetic LLM and its embeddings: the Qwen2 equations, a real KV cache, masking,
quantised variants, and the end of speech its stop counter gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from tokenizers import Tokenizer

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.sessions import SPEECH_EMBEDDING, TEXT_EMBEDDING, Graph, load_llm

# The tiny size (synthetic/config.py): hidden 64, 2 layers, 4 query heads over 2 KV heads of
# 32, RMSNorm eps 1e-6, RoPE theta 1e6 (Qwen2's), 5 speech tokens per text token.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 32
EPS, THETA, TOKENS_PER_TEXT_TOKEN = 1e-6, 1.0e6, 5


@pytest.fixture(scope="module")
def graphs(tiny_model_dir: Path) -> dict[str, Graph]:
    return {
        "text": Graph(tiny_model_dir / TEXT_EMBEDDING.file, TEXT_EMBEDDING),
        "speech": Graph(tiny_model_dir / SPEECH_EMBEDDING.file, SPEECH_EMBEDDING),
        "fp32": load_llm(tiny_model_dir / "llm.onnx"),
        "int8": load_llm(tiny_model_dir / "llm_int8.onnx"),
        "q4": load_llm(tiny_model_dir / "llm_q4.onnx"),
    }


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def embed(graph: Graph, ids: list[int]) -> np.ndarray:
    return graph.run({"input_ids": np.asarray([ids], np.int64)})["inputs_embeds"]


def empty_cache() -> list[np.ndarray]:
    return [np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32) for _ in range(2 * LAYERS)]


def random_cache(rng: np.random.Generator, past: int) -> list[np.ndarray]:
    shape = (1, KV_HEADS, past, HEAD_DIM)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(2 * LAYERS)]


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


# --- the Qwen2 equations ------------------------------------------------------------------
def _rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight


def _rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [S, H, D] rotated at ``positions`` (half-split layout)."""
    dim = x.shape[-1]
    inv = 1.0 / THETA ** (np.arange(0, dim, 2) / dim)
    angles = positions[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
    rotated = np.concatenate([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + rotated * sin


def _qwen2_reference(
    w: dict[str, np.ndarray], embeds: np.ndarray, mask: np.ndarray, pos0: int
) -> np.ndarray:
    """Logits of the last position, float64, written from the Qwen2 equations."""
    h = embeds[0].astype(np.float64)
    n = h.shape[0]
    positions = np.arange(pos0, pos0 + n, dtype=np.float64)
    group = HEADS // KV_HEADS
    allowed = np.tril(np.ones((n, n), bool)) & mask[0].astype(bool)[None, :]
    for i in range(LAYERS):
        p = f"layers.{i}"
        x = _rms(h, w[f"{p}.input_layernorm.weight"])

        def proj(name: str, heads: int, x: np.ndarray = x, p: str = p) -> np.ndarray:
            y = x @ w[f"{p}.{name}.weight"] + w[f"{p}.{name}.bias"]
            return y.reshape(n, heads, HEAD_DIM)

        q = _rope(proj("q_proj", HEADS), positions)
        k = _rope(proj("k_proj", KV_HEADS), positions)
        v = proj("v_proj", KV_HEADS)
        out = np.empty((n, HEADS, HEAD_DIM))
        for head in range(HEADS):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(HEAD_DIM)
            scores = np.where(allowed, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (probs / probs.sum(-1, keepdims=True)) @ v[:, head // group]
        h = h + out.reshape(n, -1) @ w[f"{p}.o_proj.weight"]
        x = _rms(h, w[f"{p}.post_attention_layernorm.weight"])
        gate = x @ w[f"{p}.gate_proj.weight"]
        h = (
            h
            + (gate / (1 + np.exp(-gate)) * (x @ w[f"{p}.up_proj.weight"]))
            @ w[f"{p}.down_proj.weight"]
        )
    return _rms(h[-1], w["norm.weight"]) @ w["llm_decoder.weight"]


def test_llm_computes_the_qwen2_equations(graphs: dict[str, Graph], tiny_model_dir: Path) -> None:
    model = onnx.load(str(tiny_model_dir / "llm.onnx"))
    weights = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    embeds = embed(graphs["text"], [11, 220, 3000, 151643, 9, 77])
    mask = np.array([[1, 0, 1, 1, 1, 1]], np.int64)  # one masked key
    logits, present = step(graphs["fp32"], embeds, empty_cache(), mask,
                           np.arange(7, 13, dtype=np.int64)[None])
    expected = _qwen2_reference(weights, embeds, mask, 7)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert present[0].shape == (1, KV_HEADS, 6, HEAD_DIM)


def test_present_is_past_followed_by_new(graphs: dict[str, Graph]) -> None:
    rng = np.random.default_rng(1)
    cache = random_cache(rng, 7)
    logits, present = step(graphs["fp32"], embed(graphs["text"], [11, 22, 33]), cache)
    assert logits.shape == (6761,) and logits.dtype == np.float32
    for past, new in zip(cache, present, strict=True):
        assert new.shape == (1, KV_HEADS, 10, HEAD_DIM)
        np.testing.assert_array_equal(new[:, :, :7], past)
        assert np.abs(new[:, :, 7:]).sum() > 0


def test_logits_depend_on_every_layer_of_the_cache(graphs: dict[str, Graph]) -> None:
    rng = np.random.default_rng(2)
    cache = random_cache(rng, 5)
    new = embed(graphs["text"], [101, 202])
    base, _ = step(graphs["fp32"], new, cache)
    for index in range(2 * LAYERS):
        changed = [c.copy() for c in cache]
        changed[index][:, :, 2] += 1.0
        logits, present = step(graphs["fp32"], new, changed)
        assert np.abs(logits - base).max() > 1e-4, index
        np.testing.assert_array_equal(present[index][:, :, :5], changed[index])


def test_incremental_decode_equals_one_full_pass(graphs: dict[str, Graph]) -> None:
    ids = [500, 1000, 1500, 2000, 2500, 3000]
    full_logits, full_cache = step(graphs["fp32"], embed(graphs["text"], ids), empty_cache())
    logits, cache = step(graphs["fp32"], embed(graphs["text"], ids[:3]), empty_cache())
    for token in ids[3:]:
        logits, cache = step(graphs["fp32"], embed(graphs["text"], [token]), cache)
    np.testing.assert_allclose(logits, full_logits, rtol=1e-4, atol=1e-3)
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
    assert np.abs(shifted - base).max() > 1e-4


def _prompt(
    graphs: dict[str, Graph], tokenizer: Tokenizer, text: str, prompt_tokens: int
) -> tuple[np.ndarray, int]:
    """LLM input ``[SOS, system prompt + text, TASK, prompt speech]`` and the text's tokens."""
    ids = tokenizer.encode(C.SYSTEM_PROMPT + text, add_special_tokens=False).ids
    parts = [embed(graphs["speech"], [C.SOS_TOKEN]), embed(graphs["text"], ids)]
    parts.append(embed(graphs["speech"], [C.TASK_TOKEN]))
    if prompt_tokens:
        tokens = np.random.default_rng(4).integers(0, C.SPEECH_TOKEN_VOCAB, prompt_tokens)
        parts.append(embed(graphs["speech"], tokens.tolist()))
    n_text = len(tokenizer.encode(text, add_special_tokens=False).ids)
    return np.concatenate(parts, axis=1), n_text


@pytest.mark.parametrize("precision", ["int8", "q4"])
def test_quantised_logits_follow_fp32(
    graphs: dict[str, Graph], tokenizer: Tokenizer, precision: str
) -> None:
    embeds, _ = _prompt(graphs, tokenizer, "The kitchen light is now on.", 50)
    ref, _ = step(graphs["fp32"], embeds, empty_cache())
    got, _ = step(graphs[precision], embeds, empty_cache())
    a, b = ref[: C.SPEECH_TOKEN_VOCAB], got[: C.SPEECH_TOKEN_VOCAB]
    cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert cosine > (0.9 if precision == "int8" else 0.8)
    assert np.all(np.isfinite(got))


def test_speech_special_ids_get_distinct_rows(graphs: dict[str, Graph]) -> None:
    table = embed(graphs["speech"], list(range(C.SPEECH_EMBEDDING_ROWS)))[0]
    assert table.shape == (6761, HIDDEN)
    specials = table[C.SPEECH_TOKEN_VOCAB :]
    assert len(np.unique(specials, axis=0)) == 200
    ordinary = {row.tobytes() for row in table[: C.SPEECH_TOKEN_VOCAB]}
    for token in (C.SOS_TOKEN, C.EOS_TOKEN, C.TASK_TOKEN, C.FILL_TOKEN):
        assert table[token].tobytes() not in ordinary


def test_text_embedding_is_fp16_table_cast_to_fp32(graphs: dict[str, Graph]) -> None:
    out = embed(graphs["text"], [0, 151643, 151646, 151935])
    assert out.dtype == np.float32 and out.shape == (1, 4, HIDDEN)
    np.testing.assert_array_equal(out.astype(np.float16).astype(np.float32), out)


def _decode(
    graphs: dict[str, Graph], precision: str, embeds: np.ndarray, steps: int
) -> list[tuple[float, float, float]]:
    """Feed ``steps`` random speech tokens after the prompt; per call (EOS logit, largest
    speech logit, largest other special logit)."""
    rng = np.random.default_rng(0)
    logits, cache = step(graphs[precision], embeds, empty_cache())
    trace = []
    for _ in range(steps):
        others = np.delete(logits[C.SPEECH_TOKEN_VOCAB :], C.EOS_TOKEN - C.SPEECH_TOKEN_VOCAB)
        trace.append((float(logits[C.EOS_TOKEN]), float(logits[: C.SPEECH_TOKEN_VOCAB].max()),
                      float(others.max())))
        token = int(rng.integers(0, C.SPEECH_TOKEN_VOCAB))
        logits, cache = step(graphs[precision], embed(graphs["speech"], [token]), cache)
    return trace


@pytest.mark.parametrize(("precision", "margin"), [("fp32", 1), ("int8", 3), ("q4", 3)])
def test_eos_rises_through_zero_at_five_speech_tokens_per_text_token(
    graphs: dict[str, Graph], tokenizer: Tokenizer, precision: str, margin: int
) -> None:
    """Cross-lingual prompt (no prompt speech): the EOS logit is negative until the context
    holds 5 speech tokens per text token and positive after (within ``margin`` tokens: the
    quantised graphs round the activations); it rises with every speech token and passes
    every speech logit a few tokens later. The other special ids never come near."""
    embeds, n_text = _prompt(graphs, tokenizer, "Turn on the lights, please.", 0)
    target = TOKENS_PER_TEXT_TOKEN * n_text
    trace = _decode(graphs, precision, embeds, target + 16)
    eos = np.array([t[0] for t in trace])
    assert all(t[2] < -20.0 for t in trace)
    assert np.all(eos[: target - margin + 1] < 0.0) and np.all(eos[target + margin :] > 0.0)
    if precision == "fp32":
        assert np.all(np.diff(eos) > 0.0)
        assert eos[target + 15] > trace[target + 15][1] + 1.0


def test_prompt_speech_tokens_count_towards_the_stop(
    graphs: dict[str, Graph], tokenizer: Tokenizer
) -> None:
    """Zero-shot: the prompt's speech tokens are in the context too, so the EOS logit turns
    positive after 5 x (prompt text + text tokens) - prompt speech tokens decoded ones."""
    text, transcript, prompt_speech = "It is sunny today.", "Hello there, my friend.", 30
    embeds, n_text = _prompt(graphs, tokenizer, transcript + text, prompt_speech)
    target = TOKENS_PER_TEXT_TOKEN * n_text - prompt_speech
    trace = _decode(graphs, "fp32", embeds, target + 2)
    assert trace[target - 1][0] < 0.0 < trace[target + 1][0]
