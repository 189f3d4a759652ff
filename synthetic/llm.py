"""Synthetic text/speech embeddings and the tiny LLM with a real KV cache.

Interfaces follow the export's model card (spec section 1): the embeddings map int64 ids
[1,S] to float32 [1,S,896]; the LLM takes inputs_embeds [1,S,896], attention_mask [1,past+S],
position_ids [1,S] and past_key_values.{i}.{key,value} [1,2,past,64] and returns logits
[1,6761] of the last position plus present.{i}.{key,value} [1,2,past+S,64].

Inside, the LLM is a small attention stack: the 896-wide inputs are projected to
``llm_inner_size``, every layer computes 2 heads of keys/values, ``present = Concat(past, new)``
on the sequence axis, and causal softmax attention runs over past+new (so a wrong cache changes
the logits), with the usual additive mask from ``attention_mask``.

End of speech on random weights: two marker columns of the embeddings travel through the
cache. Column ``H-2`` is 1 for ordinary speech tokens (rows 0..6560 of speech_embedding) and
column ``H-1`` is 1 for every text token. Layer 0 writes them (read straight from
inputs_embeds, so they are exact in every precision) into value channels 0 and 1 of head 0;
channel 0 is kept only for single-token calls (decode steps). Summing the two
channels over ``present.0.value`` gives ``n_decoded`` (speech tokens fed back one at a time)
and ``n_text`` (text tokens in the prompt). The EOS logit (id 6562) is::

    eos_offset + eos_slope * (n_decoded - eos_tokens_per_text_token * (n_text - n_system))

where ``n_system`` is the token count of the system prompt. So decoding stops after roughly
5 speech tokens per text token (of prompt text plus text) regardless of the prompt mode, e.g.
~40 tokens for an 8-token sentence in cross-lingual mode, ~100 in zero-shot mode with a
12-token transcript. The other special ids (>= 6561) get -30 so they never stop decoding.
The host's min length (2x) and max length (20x) still bound it.
"""

from __future__ import annotations

import numpy as np
import onnx

from wyoming_cosyvoice3.engine import constants as C

from .config import SyntheticConfig
from .onnx_builder import GraphBuilder

NEG_INF = -1.0e4
"""Additive attention bias of masked keys (finite, so fully masked rows stay finite)."""


def marker_columns(cfg: SyntheticConfig) -> tuple[int, int]:
    """(speech marker column, text marker column) of the 896-wide embeddings."""
    return cfg.llm_hidden_size - 2, cfg.llm_hidden_size - 1


def build_text_embedding(cfg: SyntheticConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """text_embedding_fp16.onnx: input_ids int64 [1,S] -> inputs_embeds float32 [1,S,896].

    A float16 table of ``text_table_rows`` rows indexed by ``id % rows``, cast to float32
    in-graph like the real export (model card: "fp16 table, cast in-graph").
    """
    hidden = cfg.llm_hidden_size
    speech_col, text_col = marker_columns(cfg)
    table = rng.normal(0.0, 0.5, (cfg.text_table_rows, hidden)).astype(np.float32)
    table[:, speech_col] = 0.0
    table[:, text_col] = 1.0
    g = GraphBuilder("text_embedding")
    g.input("input_ids", "int64", [1, "sequence_length"])
    row = g.op("Mod", ["input_ids", g.const(np.asarray(cfg.text_table_rows, dtype=np.int64))])
    emb = g.op("Gather", [g.const(table.astype(np.float16)), row], axis=0)
    g.op("Cast", [emb], out="inputs_embeds", to=onnx.TensorProto.FLOAT)
    g.output("inputs_embeds", "float32", [1, "sequence_length", hidden])
    return g.model()


def build_speech_embedding(cfg: SyntheticConfig, rng: np.random.Generator) -> onnx.ModelProto:
    """speech_embedding.onnx: input_ids int64 [1,S] (0..6760) -> float32 [1,S,896].

    Ordinary tokens use row ``id % speech_table_rows``; the special ids 6561.. (SOS, EOS, TASK,
    FILL, ...) each get their own row, so they are distinct from every speech token.
    """
    hidden = cfg.llm_hidden_size
    n_special = cfg.speech_embedding_rows - C.SPEECH_TOKEN_VOCAB
    speech_col, text_col = marker_columns(cfg)
    table = rng.normal(0.0, 0.5, (cfg.speech_table_rows + n_special, hidden)).astype(np.float32)
    table[:, text_col] = 0.0
    table[:, speech_col] = 0.0
    table[: cfg.speech_table_rows, speech_col] = 1.0
    g = GraphBuilder("speech_embedding")
    g.input("input_ids", "int64", [1, "sequence_length"])
    vocab = g.const(np.asarray(C.SPEECH_TOKEN_VOCAB, dtype=np.int64))
    is_speech = g.op("Less", ["input_ids", vocab])
    ordinary = g.op("Mod", ["input_ids", g.const(np.asarray(cfg.speech_table_rows, np.int64))])
    special = g.op(
        "Add",
        [
            g.op("Sub", ["input_ids", vocab]),
            g.const(np.asarray(cfg.speech_table_rows, dtype=np.int64)),
        ],
    )
    row = g.op("Where", [is_speech, ordinary, special])
    g.op("Gather", [g.const(table), row], out="inputs_embeds", axis=0)
    g.output("inputs_embeds", "float32", [1, "sequence_length", hidden])
    return g.model()


def llm_io(g: GraphBuilder, cfg: SyntheticConfig) -> None:
    """Declare the LLM inputs and outputs exactly as the contract names them."""
    g.input("inputs_embeds", "float32", [1, "sequence_length", cfg.llm_hidden_size])
    g.input("attention_mask", "int64", [1, "total_sequence_length"])
    g.input("position_ids", "int64", [1, "sequence_length"])
    heads, head_dim = cfg.llm_num_kv_heads, cfg.llm_head_dim
    kv_shape: list[int | str] = [1, heads, "past_sequence_length", head_dim]
    present_shape: list[int | str] = [1, heads, "total_sequence_length", head_dim]
    for layer in range(cfg.llm_num_layers):
        for kind in ("key", "value"):
            g.input(f"past_key_values.{layer}.{kind}", "float32", kv_shape)
    g.output("logits", "float32", [1, cfg.speech_embedding_rows])
    for layer in range(cfg.llm_num_layers):
        for kind in ("key", "value"):
            g.output(f"present.{layer}.{kind}", "float32", present_shape)


def _attention_bias(g: GraphBuilder, cfg: SyntheticConfig) -> tuple[str, str]:
    """Return (additive bias [1,1,S,T], S as int64 [1]) from the mask and the cache length."""
    seq = g.dim("inputs_embeds", 1)
    past = g.dim("past_key_values.0.key", 2)
    total = g.op("Add", [past, seq])
    zero, one = g.const(np.asarray(0, np.int64)), g.const(np.asarray(1, np.int64))
    q_pos = g.op(
        "Add",
        [g.op("Range", [zero, g.op("Squeeze", [seq]), one]), g.op("Squeeze", [past])],
    )
    k_pos = g.op("Range", [zero, g.op("Squeeze", [total]), one])
    causal = g.op(
        "LessOrEqual",
        [g.op("Unsqueeze", [k_pos, g.const([0])]), g.op("Unsqueeze", [q_pos, g.const([1])])],
    )
    causal_bias = g.op("Where", [causal, g.const(0.0), g.const(NEG_INF)])  # [S, T]
    mask = g.op("Cast", ["attention_mask"], to=onnx.TensorProto.FLOAT)  # [1, T]
    key_bias = g.scale(g.op("Sub", [g.const(1.0), mask]), NEG_INF)
    key_bias = g.op("Unsqueeze", [key_bias, g.const([1, 2])])  # [1, 1, 1, T]
    bias = g.op("Add", [g.op("Unsqueeze", [causal_bias, g.const([0, 1])]), key_bias])
    return bias, seq


def _heads(g: GraphBuilder, x: str, n_heads: int, head_dim: int) -> str:
    """[1,S,n*d] -> [1,n,S,d]."""
    split = g.op("Reshape", [x, g.const([0, 0, n_heads, head_dim])])
    return g.op("Transpose", [split], perm=[0, 2, 1, 3])


def _norm(g: GraphBuilder, x: str, width: int) -> str:
    """Layer normalisation over the last axis (stands in for Qwen2's RMSNorm)."""
    ones, zeros = np.ones(width, np.float32), np.zeros(width, np.float32)
    return g.op("LayerNormalization", [x, g.const(ones), g.const(zeros)], axis=-1)


def build_llm(cfg: SyntheticConfig, rng: np.random.Generator, n_system: int) -> onnx.ModelProto:
    """The fp32 tiny LLM (llm.onnx); see the module docstring for its behaviour."""
    hidden, inner = cfg.llm_hidden_size, cfg.llm_inner_size
    heads, head_dim = cfg.llm_num_kv_heads, cfg.llm_head_dim
    width = heads * head_dim
    speech_col, text_col = marker_columns(cfg)
    g = GraphBuilder("cosyvoice3_llm_tiny")
    llm_io(g, cfg)

    w_in = rng.normal(0.0, 1.0 / np.sqrt(0.25 * hidden), (hidden, inner)).astype(np.float32)
    h = g.matmul("inputs_embeds", w_in)
    markers = g.op("Gather", ["inputs_embeds", g.const([speech_col, text_col])], axis=2)
    n_freq = 8
    freqs = (1.0 / 10000.0 ** (np.arange(n_freq) / n_freq)).astype(np.float32)
    pos = g.op(
        "Unsqueeze", [g.op("Cast", ["position_ids"], to=onnx.TensorProto.FLOAT), g.const([2])]
    )
    angles = g.op("Mul", [pos, g.const(freqs)])
    pos_feat = g.op("Concat", [g.op("Sin", [angles]), g.op("Cos", [angles])], axis=2)
    w_pos = rng.normal(0.0, 0.3, (2 * n_freq, inner)).astype(np.float32)
    h = g.op("Add", [h, g.matmul(pos_feat, w_pos)])

    bias, seq = _attention_bias(g, cfg)
    is_decode = g.op("Cast", [g.op("Equal", [seq, g.const([1])])], to=onnx.TensorProto.FLOAT)
    gate = g.op("Concat", [is_decode, g.const(np.ones(1, np.float32))], axis=0)
    counters = g.op("Mul", [markers, gate])  # [1, S, 2], exact in every precision
    for layer in range(cfg.llm_num_layers):
        std = 1.0 / np.sqrt(inner)
        w_q, w_k, w_v = (rng.normal(0.0, std, (inner, width)).astype(np.float32) for _ in range(3))
        normed = _norm(g, h, inner)
        q = _heads(g, g.matmul(normed, w_q), heads, head_dim)
        k = _heads(g, g.matmul(normed, w_k), heads, head_dim)
        v_flat = g.matmul(normed, w_v)
        if layer == 0:  # value channels 0 and 1 of head 0 carry the counters
            rest = g.op("Slice", [v_flat, g.const([2]), g.const([width]), g.const([2])])
            v_flat = g.op("Concat", [counters, rest], axis=2)
        v = _heads(g, v_flat, heads, head_dim)
        keys = g.op(
            "Concat", [f"past_key_values.{layer}.key", k], out=f"present.{layer}.key", axis=2
        )
        values = g.op(
            "Concat", [f"past_key_values.{layer}.value", v], out=f"present.{layer}.value", axis=2
        )
        scores = g.op("MatMul", [q, g.op("Transpose", [keys], perm=[0, 1, 3, 2])])
        scores = g.op("Add", [g.scale(scores, 1.0 / np.sqrt(head_dim)), bias])
        context = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), values])
        merged = g.op(
            "Reshape",
            [g.op("Transpose", [context], perm=[0, 2, 1, 3]), g.const([0, 0, width])],
        )
        w_o = rng.normal(0.0, 0.2 / np.sqrt(width), (width, inner)).astype(np.float32)
        h = g.op("Add", [h, g.op("Tanh", [g.matmul(merged, w_o)])])

    last = g.op("Gather", [h, g.op("Sub", [seq, g.const([1])])], axis=1)  # [1, 1, inner]
    last = _norm(g, g.op("Reshape", [last, g.const([1, inner])]), inner)
    vocab = cfg.speech_embedding_rows
    w_head = rng.normal(0.0, 1.5 / np.sqrt(inner), (inner, vocab)).astype(np.float32)
    b_head = np.zeros(vocab, np.float32)
    w_head[:, C.SPEECH_TOKEN_VOCAB :] = 0.0
    b_head[C.SPEECH_TOKEN_VOCAB :] = -30.0
    b_head[C.EOS_TOKEN] = 0.0
    logits = g.matmul(last, w_head, b_head)

    channels = g.op(
        "Slice",
        ["present.0.value", g.const([0, 0]), g.const([1, 2]), g.const([1, 3])],
    )  # [1, 1, T, 2]: (decoded speech marker, text marker)
    counts = g.op("ReduceSum", [channels, g.const([0, 1, 2])], keepdims=0)  # [2]
    target_w = np.asarray([1.0, -cfg.eos_tokens_per_text_token], np.float32) * cfg.eos_slope
    eos_value = g.op("ReduceSum", [g.op("Mul", [counts, g.const(target_w)])], keepdims=1)
    eos_value = g.shift(
        eos_value, cfg.eos_offset + cfg.eos_slope * cfg.eos_tokens_per_text_token * n_system
    )
    one_hot = np.zeros((1, vocab), np.float32)
    one_hot[0, C.EOS_TOKEN] = 1.0
    g.op("Add", [logits, g.op("Mul", [g.const(one_hot), eos_value])], out="logits")
    return g.model()
