"""flow_encoder and the DiT estimator of the tiny model: upstream's context structure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.sessions import ESTIMATOR, FLOW_ENCODER, Graph


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> Graph:
    return Graph(tiny_model_dir / FLOW_ENCODER.file, FLOW_ENCODER)


@pytest.fixture(scope="module")
def estimator(tiny_model_dir: Path) -> Graph:
    return Graph(tiny_model_dir / ESTIMATOR.file, ESTIMATOR)


def encode(encoder: Graph, tokens: np.ndarray, embedding: np.ndarray) -> dict[str, np.ndarray]:
    return encoder.run({"token": tokens[None].astype(np.int64), "embedding": embedding[None]})


def test_mu_has_two_frames_per_token(encoder: Graph) -> None:
    tokens = np.random.default_rng(0).integers(0, C.SPEECH_TOKEN_VOCAB, 23)
    out = encode(encoder, tokens, np.ones(192, np.float32))
    assert out["mu"].shape == (1, 80, 46) and out["spks"].shape == (1, 80)
    np.testing.assert_array_equal(out["mu"][..., 0::2], out["mu"][..., 1::2])
    assert np.all(np.isfinite(out["mu"])) and out["mu"].std() > 0.1


@pytest.mark.parametrize("changed", [0, 9, 19])
def test_pre_lookahead_sees_three_tokens_ahead(encoder: Graph, changed: int) -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, C.SPEECH_TOKEN_VOCAB, 20)
    emb = rng.normal(size=192).astype(np.float32)
    base = encode(encoder, tokens, emb)["mu"][0]
    other = tokens.copy()
    other[changed] = (other[changed] + 1234) % C.SPEECH_TOKEN_VOCAB
    diff = np.abs(encode(encoder, other, emb)["mu"][0] - base).max(axis=0)  # per frame
    token_changed = diff.reshape(-1, 2).max(axis=1) > 0
    # token t sees tokens t-2 .. t+3 (causal conv of kernel 3 after the lookahead conv)
    expected = np.zeros(20, bool)
    expected[max(0, changed - C.PRE_LOOKAHEAD_TOKENS) : changed + 3] = True
    np.testing.assert_array_equal(token_changed, expected)


def test_last_tokens_see_zero_padding(encoder: Graph) -> None:
    """Finalize form: the output for a prefix equals the full output except its last 3 tokens."""
    tokens = np.random.default_rng(2).integers(0, C.SPEECH_TOKEN_VOCAB, 30)
    emb = np.ones(192, np.float32)
    full = encode(encoder, tokens, emb)["mu"]
    prefix = encode(encoder, tokens[:20], emb)["mu"]
    stable = 2 * (20 - C.PRE_LOOKAHEAD_TOKENS)
    np.testing.assert_allclose(prefix[..., :stable], full[..., :stable], rtol=1e-5, atol=1e-5)
    assert np.abs(prefix[..., stable:] - full[..., stable:40]).max() > 1e-3


def test_spks_uses_the_normalised_embedding(encoder: Graph) -> None:
    tokens = np.arange(5)
    emb = np.random.default_rng(3).normal(size=192).astype(np.float32)
    a = encode(encoder, tokens, emb)["spks"]
    b = encode(encoder, tokens, 7.5 * emb)["spks"]
    c = encode(encoder, tokens, -emb)["spks"]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.abs(a - c).max() > 1e-2


def _feeds(rng: np.random.Generator, frames: int) -> dict[str, np.ndarray]:
    return {
        "x": rng.normal(size=(2, 80, frames)).astype(np.float32),
        "mask": np.ones((2, 1, frames), np.float32),
        "mu": rng.normal(-5.0, 1.0, (2, 80, frames)).astype(np.float32),
        "t": np.asarray([0.3, 0.3], np.float32),
        "spks": rng.normal(size=(2, 80)).astype(np.float32),
        "cond": np.zeros((2, 80, frames), np.float32),
    }


def test_estimator_has_full_context(estimator: Graph) -> None:
    rng = np.random.default_rng(4)
    feeds = _feeds(rng, 60)
    base = estimator.run(feeds)["estimator_out"]
    assert base.shape == (2, 80, 60)
    feeds["x"] = feeds["x"].copy()
    feeds["x"][:, :, 59] += 3.0
    changed = estimator.run(feeds)["estimator_out"]
    assert np.abs(changed[:, :, 0] - base[:, :, 0]).max() > 1e-4  # frame 0 sees frame 59


def test_estimator_depends_on_every_input(estimator: Graph) -> None:
    rng = np.random.default_rng(5)
    feeds = _feeds(rng, 12)
    base = estimator.run(feeds)["estimator_out"]
    for name in ("mu", "spks", "cond", "t"):
        other = dict(feeds)
        other[name] = feeds[name] + 0.5
        assert np.abs(estimator.run(other)["estimator_out"] - base).max() > 1e-3, name


def test_cfg_rows_are_independent_and_masked_frames_invisible(estimator: Graph) -> None:
    feeds = _feeds(np.random.default_rng(7), 37)
    out = estimator.run(feeds)["estimator_out"]
    other_row = {**feeds, "mu": feeds["mu"].copy()}
    other_row["mu"][1] = 0.0
    np.testing.assert_allclose(estimator.run(other_row)["estimator_out"][0], out[0], atol=1e-5)
    # masked frames are invisible as keys (their own outputs may change)
    masked = {**feeds, "mask": feeds["mask"].copy()}
    masked["mask"][:, :, 30:] = 0.0
    base = estimator.run(masked)["estimator_out"]
    masked_x = {**masked, "x": masked["x"].copy()}
    masked_x["x"][:, :, 30:] += 3.0  # (the position convs are causal: left padding only)
    np.testing.assert_allclose(
        estimator.run(masked_x)["estimator_out"][:, :, :30], base[:, :, :30], atol=1e-5
    )
