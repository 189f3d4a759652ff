"""Full-size synthetic LLM graphs: Qwen2-0.5B with the CosyVoice3 speech head, and both
embedding tables, with random weights.

Contract (export model card, spec section 1), identical to the tiny graphs (the inputs and
outputs are declared by :func:`.llm.llm_io`):

* text_embedding_fp16.onnx: input_ids int64 [1,S] -> inputs_embeds float32 [1,S,896]; a
  151936 x 896 float16 table cast to float32 in-graph.
* speech_embedding.onnx: input_ids int64 [1,S] (0..6760) -> float32 [1,S,896]; 6761 x 896.
* llm.onnx: inputs_embeds [1,S,896], attention_mask int64 [1,past+S], position_ids int64
  [1,S], past_key_values.{i}.{key,value} [1,2,past,64] -> logits [1,6761] (last position),
  present.{i}.{key,value} [1,2,past+S,64] = concat(past, new).

Architecture (Hugging Face Qwen2 modelling, the checkpoint's config; cosyvoice/llm/llm.py
CosyVoice3LM): per layer a pre-RMSNorm (eps 1e-6) grouped-query attention block (14 query
heads, 2 KV heads of 64, q/k/v with bias, o without; RoPE theta 1e6 on the half-split layout
at ``position_ids``; causal over past+S and masked where ``attention_mask`` is 0; the cached
keys are stored after RoPE) and a pre-RMSNorm SiLU-gated MLP 896 -> 4864 -> 896; a final
RMSNorm and the bias-free speech head 896 -> 6761 applied to the last position only.

Random weights (std 0.02, Qwen2 ``initializer_range``) give finite logits of standard
deviation about 0.6; they never predict a sensible end of speech: a benchmark fixes the
decode length on the host side.
"""

from __future__ import annotations

import numpy as np
import onnx

from .config import SyntheticConfig
from .full_config import FullConfig, ParamSpec, ParamTable, Weights
from .full_nn import Net, linear_params, rotate_half
from .llm import llm_io
from .onnx_builder import GraphBuilder

NEG_BIAS = -1.0e9
"""Additive attention bias of masked keys (finite: fully masked rows stay finite)."""
TEXT_FILE = "text_embedding_fp16.onnx"
SPEECH_FILE = "speech_embedding.onnx"
LLM_FILE = "llm.onnx"


def text_embedding_params(cfg: FullConfig) -> ParamTable:
    """The Qwen2 input embedding table (stored as float16)."""
    return {"embed_tokens.weight": ParamSpec((cfg.text_rows, cfg.llm_hidden), cfg.llm_init_std)}


def speech_embedding_params(cfg: FullConfig) -> ParamTable:
    """CosyVoice3LM ``speech_embedding``: 6561 speech tokens + 200 special rows."""
    return {"speech_embedding.weight": ParamSpec((cfg.speech_rows, cfg.llm_hidden), 0.02)}


def llm_params(cfg: FullConfig) -> ParamTable:
    """Every parameter of llm.onnx (the text table lives in text_embedding_fp16.onnx)."""
    hidden, kv_width = cfg.llm_hidden, cfg.llm_kv_heads * cfg.llm_head_dim
    std = cfg.llm_init_std
    table: ParamTable = {}
    ones = ParamSpec((hidden,), 0.0, 1.0)
    for i in range(cfg.llm_layers):
        p = f"layers.{i}"
        table[f"{p}.input_layernorm.weight"] = ones
        linear_params(table, f"{p}.q_proj", hidden, cfg.llm_heads * cfg.llm_head_dim, std)
        linear_params(table, f"{p}.k_proj", hidden, kv_width, std)
        linear_params(table, f"{p}.v_proj", hidden, kv_width, std)
        linear_params(table, f"{p}.o_proj", cfg.llm_heads * cfg.llm_head_dim, hidden, std, False)
        table[f"{p}.post_attention_layernorm.weight"] = ones
        linear_params(table, f"{p}.gate_proj", hidden, cfg.llm_intermediate, std, False)
        linear_params(table, f"{p}.up_proj", hidden, cfg.llm_intermediate, std, False)
        linear_params(table, f"{p}.down_proj", cfg.llm_intermediate, hidden, std, False)
    table["norm.weight"] = ones
    linear_params(table, "llm_decoder", hidden, cfg.speech_rows, std, False)
    return table


def _embedding_graph(name: str, table: str, rows: np.ndarray, fp16: bool) -> onnx.ModelProto:
    g = GraphBuilder(name)
    hidden = int(rows.shape[1])
    g.input("input_ids", "int64", [1, "sequence_length"])
    if fp16:
        emb = g.op("Gather", [g.const(rows.astype(np.float16), name=table), "input_ids"], axis=0)
        g.op("Cast", [emb], out="inputs_embeds", to=onnx.TensorProto.FLOAT)
    else:
        g.op("Gather", [g.const(rows, name=table), "input_ids"], out="inputs_embeds", axis=0)
    g.output("inputs_embeds", "float32", [1, "sequence_length", hidden])
    return g.model()


def build_text_embedding(cfg: FullConfig, seed: int) -> onnx.ModelProto:
    """text_embedding_fp16.onnx: float16 table [151936, 896], float32 output."""
    weights = Weights(text_embedding_params(cfg), seed, TEXT_FILE)
    rows = weights.take("embed_tokens.weight")
    return _embedding_graph("text_embedding", "embed_tokens.weight", rows, fp16=True)


def build_speech_embedding(cfg: FullConfig, seed: int) -> onnx.ModelProto:
    """speech_embedding.onnx: float32 table [6761, 896]."""
    weights = Weights(speech_embedding_params(cfg), seed, SPEECH_FILE)
    rows = weights.take("speech_embedding.weight")
    return _embedding_graph("speech_embedding", "speech_embedding.weight", rows, fp16=False)


def interface_config(cfg: FullConfig) -> SyntheticConfig:
    """The tiny config whose interface dimensions equal ``cfg``'s (for :func:`.llm.llm_io`).

    Raises:
        ValueError: ``cfg`` differs from the published interface (896, 2 x 64, 6761 rows).
    """
    iface = SyntheticConfig(llm_num_layers=cfg.llm_layers)
    ours = (cfg.llm_hidden, cfg.llm_kv_heads, cfg.llm_head_dim, cfg.speech_rows)
    theirs = (
        iface.llm_hidden_size,
        iface.llm_num_kv_heads,
        iface.llm_head_dim,
        iface.speech_embedding_rows,
    )
    if ours != theirs:
        raise ValueError(f"full LLM interface {ours} differs from the contract {theirs}")
    return iface


def _rope_tables(g: GraphBuilder, cfg: FullConfig) -> tuple[str, str]:
    """cos, sin [1, 1, S, 64] at ``position_ids`` (Qwen2RotaryEmbedding, theta 1e6)."""
    dim = cfg.llm_head_dim
    inv_freq = 1.0 / cfg.llm_rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    pos = g.op("Cast", ["position_ids"], to=onnx.TensorProto.FLOAT)  # [1, S]
    angles = g.op(
        "Mul", [g.op("Unsqueeze", [pos, g.const([2])]), g.const(inv_freq.astype(np.float32))]
    )  # [1, S, D/2]
    both = g.op("Unsqueeze", [g.op("Concat", [angles, angles], axis=-1), g.const([1])])
    return g.op("Cos", [both]), g.op("Sin", [both])


def _rope(g: GraphBuilder, x: str, cos: str, sin: str, dim: int) -> str:
    """``x cos + rotate_half(x) sin`` for x [1, H, S, D]."""
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotate_half(g, x, dim), sin])])


def _attention_bias(g: GraphBuilder) -> str:
    """Additive bias [1, 1, S, past+S]: causal and ``attention_mask``-masked keys."""
    seq = g.dim("inputs_embeds", 1)
    past = g.dim("past_key_values.0.key", 2)
    total = g.op("Add", [past, seq])
    zero, one = g.const(np.asarray(0, np.int64)), g.const(np.asarray(1, np.int64))
    q_pos = g.op("Add", [g.op("Range", [zero, g.op("Squeeze", [seq]), one]), past])
    k_pos = g.op("Range", [zero, g.op("Squeeze", [total]), one])
    causal = g.op(
        "LessOrEqual",
        [g.op("Unsqueeze", [k_pos, g.const([0])]), g.op("Unsqueeze", [q_pos, g.const([1])])],
    )  # [S, T]
    keep = g.op("Cast", ["attention_mask"], to=onnx.TensorProto.BOOL)  # [1, T]
    allowed = g.op("And", [causal, keep])  # [1, T] broadcasts to [S, T] -> [1, S, T]
    bias = g.op("Where", [allowed, g.const(0.0), g.const(NEG_BIAS)])
    return g.op("Unsqueeze", [bias, g.const([0, 1])])  # [1, 1, S, T]


def build_llm(cfg: FullConfig, seed: int) -> onnx.ModelProto:
    """llm.onnx (fp32): see the module docstring."""
    g = GraphBuilder("cosyvoice3_llm_qwen2")
    llm_io(g, interface_config(cfg))
    net = Net(g, Weights(llm_params(cfg), seed, LLM_FILE))
    heads, kv_heads, dim = cfg.llm_heads, cfg.llm_kv_heads, cfg.llm_head_dim
    group = heads // kv_heads
    cos, sin = _rope_tables(g, cfg)
    bias = _attention_bias(g)
    h = "inputs_embeds"
    for i in range(cfg.llm_layers):
        p = f"layers.{i}"
        x = net.rms_norm(h, f"{p}.input_layernorm.weight", cfg.llm_rms_eps)
        q = _rope(g, net.split_heads(net.linear(x, f"{p}.q_proj"), heads, dim), cos, sin, dim)
        k = _rope(g, net.split_heads(net.linear(x, f"{p}.k_proj"), kv_heads, dim), cos, sin, dim)
        v = net.split_heads(net.linear(x, f"{p}.v_proj"), kv_heads, dim)
        keys = g.op("Concat", [f"past_key_values.{i}.key", k], out=f"present.{i}.key", axis=2)
        values = g.op("Concat", [f"past_key_values.{i}.value", v], out=f"present.{i}.value", axis=2)
        # grouped-query attention: query head h reads KV head h // group
        q5 = g.op("Reshape", [q, g.const([0, kv_heads, group, -1, dim])])
        k5 = g.op("Unsqueeze", [keys, g.const([2])])
        v5 = g.op("Unsqueeze", [values, g.const([2])])
        context = net.attention(q5, k5, v5, dim, bias, rank=5)  # [1, kv, group, S, D]
        context = g.op("Reshape", [context, g.const([0, heads, -1, dim])])
        h = g.op("Add", [h, net.linear(net.merge_heads(context, heads * dim), f"{p}.o_proj")])
        x = net.rms_norm(h, f"{p}.post_attention_layernorm.weight", cfg.llm_rms_eps)
        gate = net.silu(net.linear(x, f"{p}.gate_proj"))
        mlp = net.linear(g.op("Mul", [gate, net.linear(x, f"{p}.up_proj")]), f"{p}.down_proj")
        h = g.op("Add", [h, mlp])
    last_index = g.op("Sub", [g.op("Squeeze", [g.dim("inputs_embeds", 1)]), g.const(1)])
    last = g.op("Gather", [h, last_index], axis=1)  # [1, hidden]
    last = net.rms_norm(last, "norm.weight", cfg.llm_rms_eps)
    g.op("MatMul", [last, net.param("llm_decoder.weight")], out="logits", name="llm_decoder")
    net.w.check_all_used()
    return g.model()
