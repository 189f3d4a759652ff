"""Full-size synthetic model: parameter counts of the real architecture (from the tables the
builders use, nothing built) and a reduced-depth build (``full-mini``: all widths real, 2 LLM
layers, 2 DiT blocks) that must pass the engine's graph checks and compute what the
architecture says (numpy Qwen2 reference, KV cache, masks, right context)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from synthetic.full_build import param_counts
from synthetic.full_config import (
    PUBLISHED_BYTES,
    FullConfig,
    count_params,
    get_full_config,
)
from synthetic.full_flow import (
    build_estimator,
    build_flow_encoder,
    estimator_flops_per_frame,
    estimator_params,
    flow_encoder_params,
)
from synthetic.full_hift import build_hift, hift_params
from synthetic.full_llm import (
    build_llm,
    build_speech_embedding,
    llm_params,
)
from synthetic.onnx_builder import save_model
from synthetic.quant import quantize_int8, quantize_q4
from wyoming_cosyvoice3.engine.graphs import (
    ESTIMATOR,
    FLOW_ENCODER,
    HIFT,
    SPEECH_EMBEDDING,
    Graph,
    GraphSpec,
    llm_spec,
    load_llm,
)
from wyoming_cosyvoice3.engine.model import CosyVoice3Model, ModelDims
from wyoming_cosyvoice3.engine.options import EngineOptions

MINI = get_full_config("full-mini")
QWEN2_05B_PARAMS = 494_032_768
"""Qwen2-0.5B ``num_parameters()`` (tied input/output embedding), Hugging Face model card."""


# --- parameter counts of the full configuration -----------------------------------------
@pytest.mark.parametrize(
    ("count_key", "published", "bytes_per_param"),
    [
        ("llm.onnx", "llm.onnx.data", 4),
        ("flow.decoder.estimator.fp32.onnx", "flow.decoder.estimator.fp32.onnx", 4),
        ("hift.onnx", "hift.onnx", 4),
        ("flow_encoder.onnx", "flow_encoder.onnx", 4),
        ("speech_embedding.onnx", "speech_embedding.onnx", 4),
        ("text_embedding_fp16.onnx", "text_embedding_fp16.onnx", 2),
        ("campplus.onnx", "campplus.onnx", 4),
        ("speech_tokenizer_v3.onnx", "speech_tokenizer_v3.onnx", 4),
    ],
)
def test_full_parameter_counts_within_10_percent_of_published_files(
    count_key: str, published: str, bytes_per_param: int
) -> None:
    counts = param_counts(get_full_config("full"))
    ratio = counts[count_key] * bytes_per_param / PUBLISHED_BYTES[published]
    assert 0.9 <= ratio <= 1.1, f"{count_key}: {ratio:.3f} of the published size"


def test_full_llm_plus_text_table_is_qwen2_05b_plus_speech_head() -> None:
    cfg = get_full_config("full")
    table = llm_params(cfg)
    head = table["llm_decoder.weight"].size
    assert head == cfg.llm_hidden * 6761
    text_table = cfg.text_rows * cfg.llm_hidden
    assert count_params(table) - head + text_table == QWEN2_05B_PARAMS


# --- the reduced-depth build --------------------------------------------------------------
@pytest.fixture(scope="module")
def mini_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llm.onnx (+ int8, q4), speech_embedding, flow_encoder, estimator, hift of full-mini."""
    out = tmp_path_factory.mktemp("full_mini")
    llm = build_llm(MINI, 0)
    save_model(llm, out / "llm.onnx", external_data=True)
    save_model(quantize_int8(llm), out / "llm_int8.onnx", external_data=True)
    save_model(quantize_q4(llm), out / "llm_q4.onnx", external_data=True)
    save_model(build_speech_embedding(MINI, 0), out / "speech_embedding.onnx")
    save_model(build_flow_encoder(MINI, 0), out / "flow_encoder.onnx")
    save_model(build_estimator(MINI, 0), out / "flow.decoder.estimator.fp32.onnx")
    save_model(build_hift(MINI, 0), out / "hift.onnx")
    return out


def _signature(path: Path) -> dict[str, tuple[str, list[object]]]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    args = [*session.get_inputs(), *session.get_outputs()]
    return {arg.name: (arg.type, list(arg.shape)) for arg in args}


@pytest.mark.parametrize("spec", [SPEECH_EMBEDDING, FLOW_ENCODER, ESTIMATOR, HIFT])
def test_mini_graphs_have_the_tiny_graphs_signature(
    spec: GraphSpec, mini_dir: Path, tiny_model_dir: Path
) -> None:
    Graph(mini_dir / spec.file, spec)  # the engine's own check
    assert _signature(mini_dir / spec.file) == _signature(tiny_model_dir / spec.file)


@pytest.mark.parametrize("file", ["llm.onnx", "llm_int8.onnx", "llm_q4.onnx"])
def test_mini_llm_signature_is_the_contract_for_its_depth(
    file: str, mini_dir: Path, tiny_model_dir: Path
) -> None:
    graph = load_llm(mini_dir / file)
    assert graph.spec == llm_spec(file, MINI.llm_layers)
    mini, tiny = _signature(mini_dir / file), _signature(tiny_model_dir / "llm.onnx")
    assert set(mini) == {name for name in tiny if not any(f".{i}." in name for i in range(2, 24))}
    assert all(mini[name] == tiny[name] for name in mini)


def test_mini_directory_loads_with_the_engine_loader(
    mini_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The full-width graphs plus the tiny tokenizer, text table and voice encoders (same
    contract) form a directory that CosyVoice3Model.load accepts in every precision."""
    model_dir = tmp_path / "mixed"
    model_dir.mkdir()
    for source in (mini_dir, tiny_model_dir):
        for path in source.iterdir():
            if path.is_file() and not (model_dir / path.name).exists():
                (model_dir / path.name).symlink_to(path)
    for precision in ("fp32", "int8", "q4"):
        model = CosyVoice3Model.load(model_dir, EngineOptions(llm_precision=precision))
        assert model.dims == ModelDims(896, MINI.llm_layers, 2, 64, 6761, 80, 192)
        assert model.estimator.path.resolve() == (mini_dir / ESTIMATOR.file).resolve()


def _initializers(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


@pytest.mark.parametrize(
    ("file", "table"),
    [
        ("llm.onnx", llm_params),
        ("flow_encoder.onnx", flow_encoder_params),
        ("flow.decoder.estimator.fp32.onnx", estimator_params),
        ("hift.onnx", hift_params),
    ],
)
def test_builders_store_exactly_their_parameter_tables(
    file: str, table: object, mini_dir: Path
) -> None:
    params = table(MINI)  # type: ignore[operator]
    stored = _initializers(mini_dir / file)
    assert {name: tuple(stored[name].shape) for name in params} == {
        name: spec.shape for name, spec in params.items()
    }
    assert sum(stored[name].size for name in params) == count_params(params)


# --- LLM semantics ------------------------------------------------------------------------
def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [S, H, D] rotated at ``positions`` (half-split layout)."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angles = positions[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
    rotated = np.concatenate([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + rotated * sin


def _qwen2_reference(
    w: dict[str, np.ndarray], cfg: FullConfig, embeds: np.ndarray, mask: np.ndarray, pos0: int
) -> np.ndarray:
    """Logits of the last position, float64, written from the Qwen2 equations."""
    h = embeds[0].astype(np.float64)
    n = h.shape[0]
    positions = np.arange(pos0, pos0 + n, dtype=np.float64)
    group = cfg.llm_heads // cfg.llm_kv_heads
    allowed = np.tril(np.ones((n, n), bool)) & mask[0].astype(bool)[None, :]
    for i in range(cfg.llm_layers):
        p = f"layers.{i}"
        x = _rms(h, w[f"{p}.input_layernorm.weight"], cfg.llm_rms_eps)

        def proj(name: str, heads: int, x: np.ndarray = x, p: str = p) -> np.ndarray:
            y = x @ w[f"{p}.{name}.weight"] + w[f"{p}.{name}.bias"]
            return y.reshape(n, heads, cfg.llm_head_dim)

        q = _rope(proj("q_proj", cfg.llm_heads), positions, cfg.llm_rope_theta)
        k = _rope(proj("k_proj", cfg.llm_kv_heads), positions, cfg.llm_rope_theta)
        v = proj("v_proj", cfg.llm_kv_heads)
        out = np.empty((n, cfg.llm_heads, cfg.llm_head_dim))
        for head in range(cfg.llm_heads):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(cfg.llm_head_dim)
            scores = np.where(allowed, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (probs / probs.sum(-1, keepdims=True)) @ v[:, head // group]
        h = h + out.reshape(n, -1) @ w[f"{p}.o_proj.weight"]
        x = _rms(h, w[f"{p}.post_attention_layernorm.weight"], cfg.llm_rms_eps)
        gate = x @ w[f"{p}.gate_proj.weight"]
        h = (
            h
            + (gate / (1 + np.exp(-gate)) * (x @ w[f"{p}.up_proj.weight"]))
            @ w[f"{p}.down_proj.weight"]
        )
    return _rms(h[-1], w["norm.weight"], cfg.llm_rms_eps) @ w["llm_decoder.weight"]


def _llm_run(
    graph: Graph, embeds: np.ndarray, past: list[np.ndarray], pos0: int, mask: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray]]:
    n = embeds.shape[1]
    feeds = {"inputs_embeds": embeds, "attention_mask": mask}
    feeds["position_ids"] = np.arange(pos0, pos0 + n, dtype=np.int64)[None, :]
    for i in range(MINI.llm_layers):
        feeds[f"past_key_values.{i}.key"] = past[2 * i]
        feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
    out = graph.run(feeds)
    present = [
        out[f"present.{i}.{kind}"] for i in range(MINI.llm_layers) for kind in ("key", "value")
    ]
    return out["logits"], present


def _empty_cache() -> list[np.ndarray]:
    return [np.zeros((1, 2, 0, 64), np.float32) for _ in range(2 * MINI.llm_layers)]


def test_mini_llm_matches_a_numpy_qwen2_reference(mini_dir: Path) -> None:
    graph = load_llm(mini_dir / "llm.onnx")
    weights = {k: v.astype(np.float64) for k, v in _initializers(mini_dir / "llm.onnx").items()}
    rng = np.random.default_rng(3)
    embeds = rng.normal(0.0, 0.5, (1, 6, 896)).astype(np.float32)
    mask = np.array([[1, 0, 1, 1, 1, 1]], np.int64)  # one masked key
    logits, present = _llm_run(graph, embeds, _empty_cache(), 7, mask)
    expected = _qwen2_reference(weights, MINI, embeds, mask, 7)
    assert logits.shape == (1, 6761)
    np.testing.assert_allclose(logits[0], expected, rtol=0, atol=2e-3 * np.abs(expected).max())
    assert present[0].shape == (1, 2, 6, 64)
    assert 0.1 < float(np.std(logits)) < 10.0  # finite and reasonably scaled


def test_mini_llm_kv_cache_steps_equal_one_prefill(mini_dir: Path) -> None:
    graph = load_llm(mini_dir / "llm.onnx")
    rng = np.random.default_rng(4)
    embeds = rng.normal(0.0, 0.5, (1, 7, 896)).astype(np.float32)
    full, _ = _llm_run(graph, embeds, _empty_cache(), 0, np.ones((1, 7), np.int64))
    _, cache = _llm_run(graph, embeds[:, :5], _empty_cache(), 0, np.ones((1, 5), np.int64))
    _, cache = _llm_run(graph, embeds[:, 5:6], cache, 5, np.ones((1, 6), np.int64))
    step, cache = _llm_run(graph, embeds[:, 6:7], cache, 6, np.ones((1, 7), np.int64))
    np.testing.assert_allclose(step, full, atol=1e-4)
    assert cache[-1].shape == (1, 2, 7, 64)


@pytest.mark.parametrize("file", ["llm_int8.onnx", "llm_q4.onnx"])
def test_mini_quantised_llms_follow_the_fp32_logits(file: str, mini_dir: Path) -> None:
    rng = np.random.default_rng(5)
    embeds = rng.normal(0.0, 0.5, (1, 4, 896)).astype(np.float32)
    mask = np.ones((1, 4), np.int64)
    reference, _ = _llm_run(load_llm(mini_dir / "llm.onnx"), embeds, _empty_cache(), 0, mask)
    logits, _ = _llm_run(load_llm(mini_dir / file), embeds, _empty_cache(), 0, mask)
    assert np.all(np.isfinite(logits))
    assert np.corrcoef(reference[0], logits[0])[0, 1] > 0.9


# --- flow and vocoder semantics -----------------------------------------------------------
def test_mini_flow_encoder_lookahead_repeat_and_speaker_norm(mini_dir: Path) -> None:
    graph = Graph(mini_dir / "flow_encoder.onnx", FLOW_ENCODER)
    tokens = np.array([[5, 17, 300, 6000, 42, 42, 7, 1000, 2, 9]], np.int64)
    emb = np.random.default_rng(6).normal(size=(1, 192)).astype(np.float32)
    out = graph.run({"token": tokens, "embedding": emb})
    mu = out["mu"]
    assert mu.shape == (1, 80, 20)
    np.testing.assert_array_equal(mu[:, :, 0::2], mu[:, :, 1::2])
    changed = tokens.copy()
    changed[0, -1] = 3333
    mu2 = graph.run({"token": changed, "embedding": emb})["mu"]
    diff = np.abs(mu2 - mu).max(axis=(0, 1))
    assert np.all(diff[: 2 * (10 - 4)] == 0.0) and np.all(diff[2 * (10 - 4) :] > 0.0)
    scaled = graph.run({"token": tokens, "embedding": 7.0 * emb})["spks"]
    np.testing.assert_allclose(scaled, out["spks"], rtol=1e-5, atol=1e-6)


def _estimator_feeds(frames: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(2, 80, frames)).astype(np.float32),
        "mu": rng.normal(size=(2, 80, frames)).astype(np.float32),
        "cond": rng.normal(size=(2, 80, frames)).astype(np.float32),
        "mask": np.ones((2, 1, frames), np.float32),
        "t": np.array([0.4, 0.4], np.float32),
        "spks": rng.normal(size=(2, 80)).astype(np.float32),
    }


def test_mini_estimator_full_attention_cfg_rows_and_mask(mini_dir: Path) -> None:
    graph = Graph(mini_dir / "flow.decoder.estimator.fp32.onnx", ESTIMATOR)
    feeds = _estimator_feeds(37, 7)
    out = graph.run(feeds)["estimator_out"]
    assert out.shape == (2, 80, 37) and np.all(np.isfinite(out))
    # full attention: the last frame's input reaches the first frame's output
    later = {**feeds, "x": feeds["x"].copy()}
    later["x"][:, :, -1] += 1.0
    assert np.abs(graph.run(later)["estimator_out"][:, :, 0] - out[:, :, 0]).max() > 1e-4
    # CFG rows are independent
    other_row = {**feeds, "mu": feeds["mu"].copy()}
    other_row["mu"][1] = 0.0
    np.testing.assert_allclose(graph.run(other_row)["estimator_out"][0], out[0], atol=1e-5)
    # masked frames are invisible as keys (their own outputs may change)
    masked = {**feeds, "mask": feeds["mask"].copy()}
    masked["mask"][:, :, 30:] = 0.0
    base = graph.run(masked)["estimator_out"]
    masked_x = {**masked, "x": masked["x"].copy()}
    masked_x["x"][:, :, 30:] += 3.0  # (the position convs are causal: left padding only)
    np.testing.assert_allclose(
        graph.run(masked_x)["estimator_out"][:, :, :30], base[:, :, :30], atol=1e-5
    )


def test_mini_hift_shapes_ranges_and_right_context(mini_dir: Path) -> None:
    graph = Graph(mini_dir / "hift.onnx", HIFT)
    rng = np.random.default_rng(8)
    frames, extra = 40, 12
    mel = rng.normal(-4.0, 2.0, (1, 80, frames + extra)).astype(np.float32)
    noise = rng.random((1, 480 * (frames + extra), 9), dtype=np.float32)
    short = graph.run({"speech_feat": mel[:, :, :frames], "noise": noise[:, : 480 * frames]})
    long = graph.run({"speech_feat": mel, "noise": noise})
    mag, phase = short["magnitude"], short["phase"]
    assert mag.shape == phase.shape == (1, 9, 120 * frames + 1)
    assert np.all(np.isfinite(mag)) and np.all(mag > 0.0) and np.all(np.abs(phase) <= 1.0)
    stable = 120 * (frames - MINI.hift_conv_pre_look_right)
    for name in ("magnitude", "phase"):
        np.testing.assert_allclose(
            short[name][:, :, :stable], long[name][:, :, :stable], rtol=1e-3, atol=1e-3
        )
    # the last frames do depend on the mel that follows (conv_pre looks 4 frames ahead)
    tail = np.abs(
        short["magnitude"][:, :, stable + 1 :]
        - long["magnitude"][:, :, stable + 1 : 120 * frames + 1]
    )
    assert tail.max() > 1e-3


def test_weights_are_seeded_per_parameter() -> None:
    first = build_flow_encoder(MINI, 11).SerializeToString()
    assert build_flow_encoder(MINI, 11).SerializeToString() == first
    assert build_flow_encoder(MINI, 12).SerializeToString() != first


def test_estimator_flops_per_frame_agree_with_the_spec_estimate() -> None:
    """spec section 8: ~0.37 GFLOP per mel frame per estimator row (linear layers only);
    the estimate here also counts the position convs and input/output projections."""
    flops = estimator_flops_per_frame(get_full_config("full"))
    assert 0.37e9 <= flops <= 0.37e9 * 1.05
