"""One builder for every size: the ``full`` size's parameter counts are the real
architecture's (from the tables the builders use, nothing built), and the tiny model's graphs
hold exactly the parameters of their tables at the tiny widths. What the tiny graphs compute
is checked per graph in test_synthetic_llm/flow/vocoder.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from synthetic.build import param_counts
from synthetic.config import PUBLISHED_BYTES, count_params, get_config
from synthetic.encoders import campplus_params, tokenizer_params
from synthetic.flow import (
    build_flow_encoder,
    estimator_flops_per_frame,
    estimator_params,
    flow_encoder_params,
)
from synthetic.hift import hift_params
from synthetic.llm import llm_params

TINY = get_config("tiny")
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
    counts = param_counts(get_config("full"))
    ratio = counts[count_key] * bytes_per_param / PUBLISHED_BYTES[published]
    assert 0.9 <= ratio <= 1.1, f"{count_key}: {ratio:.3f} of the published size"


def test_full_llm_plus_text_table_is_qwen2_05b_plus_speech_head() -> None:
    cfg = get_config("full")
    table = llm_params(cfg)
    head = table["llm_decoder.weight"].size
    assert head == cfg.llm_hidden * 6761
    text_table = cfg.text_rows * cfg.llm_hidden
    assert count_params(table) - head + text_table == QWEN2_05B_PARAMS


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
        ("campplus.onnx", campplus_params),
        ("speech_tokenizer_v3.onnx", tokenizer_params),
    ],
)
def test_builders_store_exactly_their_parameter_tables(
    file: str, table: object, tiny_model_dir: Path
) -> None:
    params = table(TINY)  # type: ignore[operator]
    stored = _initializers(tiny_model_dir / file)
    assert {name: tuple(stored[name].shape) for name in params} == {
        name: spec.shape for name, spec in params.items()
    }
    assert sum(stored[name].size for name in params) == count_params(params)


def test_weights_are_seeded_per_parameter() -> None:
    first = build_flow_encoder(TINY, 11).SerializeToString()
    assert build_flow_encoder(TINY, 11).SerializeToString() == first
    assert build_flow_encoder(TINY, 12).SerializeToString() != first


def test_estimator_flops_per_frame_agree_with_the_spec_estimate() -> None:
    """spec section 8: ~0.37 GFLOP per mel frame per estimator row (linear layers only);
    the estimate here also counts the position convs and input/output projections."""
    flops = estimator_flops_per_frame(get_config("full"))
    assert 0.37e9 <= flops <= 0.37e9 * 1.05
