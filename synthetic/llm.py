"""Synthetic LLM graphs: Qwen2 with the CosyVoice3 speech head, and both embedding tables.

Contract (export model card, spec section 1; widths from the :class:`.config.SyntheticConfig`,
published values in brackets):

* text_embedding_fp16.onnx: input_ids int64 [1,S] -> inputs_embeds float32 [1,S,H]; a
  151936 x H float16 table cast to float32 in-graph (H = 896).
* speech_embedding.onnx: input_ids int64 [1,S] (0..6760) -> float32 [1,S,H]; 6761 x H.
* llm.onnx: inputs_embeds [1,S,H], attention_mask int64 [1,past+S], position_ids int64
  [1,S], past_key_values.{i}.{key,value} [1,KV,past,D] -> logits [1,6761] (last position),
  present.{i}.{key,value} [1,KV,past+S,D] = concat(past, new) (KV = 2, D = 64, 24 layers).

Architecture (Hugging Face Qwen2 modelling, the checkpoint's config; cosyvoice/llm/llm.py
CosyVoice3LM): per layer a pre-RMSNorm (eps 1e-6) grouped-query attention block (14 query
heads, 2 KV heads of 64, q/k/v with bias, o without; RoPE theta 1e6 on the half-split layout
at ``position_ids``; causal over past+S and masked where ``attention_mask`` is 0; the cached
keys are stored after RoPE) and a pre-RMSNorm SiLU-gated MLP 896 -> 4864 -> 896; a final
RMSNorm and the bias-free speech head 896 -> 6761 applied to the last position only.

Random weights (std 0.02, Qwen2 ``initializer_range``) give finite logits of standard
deviation about 0.6; they never predict a sensible end of speech. The full sizes leave it at
that (a benchmark fixes the decoding length on the host side); the tiny size sets a few
weights so that the model stops by itself (:func:`stop_counter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from wyoming_cosyvoice3.engine import constants as C

from .config import ParamSpec, ParamTable, SyntheticConfig, Weights
from .nn import Net, linear_params, rotate_half
from .onnx_builder import GraphBuilder

NEG_BIAS = -1.0e9
"""Additive attention bias of masked keys (finite: fully masked rows stay finite)."""
TEXT_FILE = "text_embedding_fp16.onnx"
SPEECH_FILE = "speech_embedding.onnx"
LLM_FILE = "llm.onnx"


def text_embedding_params(cfg: SyntheticConfig) -> ParamTable:
    """The Qwen2 input embedding table (stored as float16)."""
    return {"embed_tokens.weight": ParamSpec((cfg.text_rows, cfg.llm_hidden), cfg.llm_init_std)}


def speech_embedding_params(cfg: SyntheticConfig) -> ParamTable:
    """CosyVoice3LM ``speech_embedding``: 6561 speech tokens + 200 special rows."""
    return {"speech_embedding.weight": ParamSpec((cfg.speech_rows, cfg.llm_hidden), 0.02)}


def llm_params(cfg: SyntheticConfig) -> ParamTable:
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


def build_text_embedding(cfg: SyntheticConfig, seed: int) -> onnx.ModelProto:
    """text_embedding_fp16.onnx: float16 table [151936, H], float32 output."""
    weights = Weights(text_embedding_params(cfg), seed, TEXT_FILE, _counter_adjust(cfg))
    rows = weights.take("embed_tokens.weight")
    return _embedding_graph("text_embedding", "embed_tokens.weight", rows, fp16=True)


def build_speech_embedding(cfg: SyntheticConfig, seed: int) -> onnx.ModelProto:
    """speech_embedding.onnx: float32 table [6761, H]."""
    weights = Weights(speech_embedding_params(cfg), seed, SPEECH_FILE, _counter_adjust(cfg))
    rows = weights.take("speech_embedding.weight")
    return _embedding_graph("speech_embedding", "speech_embedding.weight", rows, fp16=False)


def llm_io(g: GraphBuilder, cfg: SyntheticConfig) -> None:
    """Declare the LLM inputs and outputs exactly as the contract names them (symbolic
    sequence axes, static widths)."""
    g.input("inputs_embeds", "float32", [1, "sequence_length", cfg.llm_hidden])
    g.input("attention_mask", "int64", [1, "total_sequence_length"])
    g.input("position_ids", "int64", [1, "sequence_length"])
    kv_shape: list[int | str] = [1, cfg.llm_kv_heads, "past_sequence_length", cfg.llm_head_dim]
    present_shape: list[int | str] = [
        1, cfg.llm_kv_heads, "total_sequence_length", cfg.llm_head_dim,
    ]  # fmt: skip
    for layer in range(cfg.llm_layers):
        for kind in ("key", "value"):
            g.input(f"past_key_values.{layer}.{kind}", "float32", kv_shape)
    g.output("logits", "float32", [1, cfg.speech_rows])
    for layer in range(cfg.llm_layers):
        for kind in ("key", "value"):
            g.output(f"present.{layer}.{kind}", "float32", present_shape)


# --- the tiny model's end of speech -----------------------------------------------------
STOP_GAIN = 25.0
"""EOS logit per unit of the stop sum (one speech token moves it by 1/T, T the context
length: about 0.4 logits per token for a short sentence). Bounded by the fused-LLM
derivation's validation, which feeds speech tokens only (stop sum 1): there the EOS logit is
the gain itself, and the 4-bit graph's deviation in log-probabilities grows with it (5.5 at
a gain of 100, where 2 is accepted)."""
SPECIAL_LOGIT = -30.0
"""Logit of the special ids other than EOS (6561, 6563..6760): never drawn."""


@dataclass(frozen=True)
class StopCounter:
    """Columns of the residual stream that the tiny LLM's end of speech runs through.

    Every embedding row has RMS 1 (so layer 0's RMSNorm passes it unchanged) and carries
    three marker columns: ``count`` (+1 for a speech token 0..6560, ``-k`` for a text token,
    k = ``llm_stop_tokens_per_text_token``), ``sos`` (1 on the SOS row only) and ``one``
    (1 on every row). Query head 0 of layer 0 has zero weights, so it attends uniformly over
    the T positions of the context; it reads ``count`` and ``sos`` through value channels 0
    and 1 of KV head 0 and writes their means into the residual columns ``total`` and
    ``system`` (the latter scaled by ``k * system_tokens``). Nothing else writes into
    ``total``, ``system`` or ``one``. The EOS column of the head reads ``total + system``::

        EOS logit = s * STOP_GAIN * (n_speech - k * n_text + k * system_tokens) / T

    (s > 0: the final RMSNorm's scale): negative until the context holds ``k`` speech tokens
    per text token after the system prompt, then rising by ``s * STOP_GAIN / T`` per token,
    so EOS is drawn a few tokens later (about 10 for a 16-token sentence). Speech tokens of
    a zero-shot prompt count too, so a zero-shot request decodes fewer tokens than a
    cross-lingual one by about (prompt speech tokens - k * prompt text tokens). All of it is
    weights: the graph is the plain Qwen2 graph, and every changed weight is exact under int8
    per-channel and 4-bit block quantisation (one non-zero value per output column and
    block).
    """

    hidden: int
    k: float
    system_tokens: int
    head_dim: int
    """Width of query head 0 (its q weights are zeroed)."""

    @property
    def count(self) -> int:
        return self.hidden - 1

    @property
    def sos(self) -> int:
        return self.hidden - 2

    @property
    def one(self) -> int:
        return self.hidden - 3

    @property
    def total(self) -> int:
        return self.hidden - 4

    @property
    def system(self) -> int:
        return self.hidden - 5

    @property
    def reserved(self) -> list[int]:
        """Columns kept out of the random part of the embeddings."""
        return [self.count, self.sos, self.one, self.total, self.system]

    @property
    def protected(self) -> list[int]:
        """Residual columns no layer writes into except through the counter."""
        return [self.total, self.system, self.one]

    def embedding_rows(self, rows: np.ndarray, kind: str) -> None:
        """Set the markers of an embedding table in place (``kind`` "text" or "speech") and
        scale the rest of every row to RMS 1."""
        markers = np.zeros((rows.shape[0], len(self.reserved)), np.float32)
        markers[:, 2] = 1.0  # one
        if kind == "text":
            markers[:, 0] = -self.k
        else:
            markers[: C.SPEECH_TOKEN_VOCAB, 0] = 1.0
            markers[C.SOS_TOKEN, 1] = 1.0
        free = np.ones(rows.shape[1], bool)
        free[self.reserved] = False
        room = self.hidden - np.square(markers).sum(axis=1, keepdims=True)
        if np.any(room <= 0):
            raise ValueError(f"hidden {self.hidden} too narrow for the stop markers (k {self.k})")
        part = rows[:, free]
        part *= np.sqrt(room / np.square(part).sum(axis=1, keepdims=True)).astype(np.float32)
        rows[:, free] = part
        rows[:, self.reserved] = markers

    def llm_weight(self, name: str, value: np.ndarray) -> None:
        """Set the counter's weights of llm.onnx parameter ``name`` in place."""
        if name == "layers.0.q_proj.weight":
            value[:, : self.head_dim] = 0.0  # query head 0: uniform attention
        elif name == "layers.0.q_proj.bias":
            value[: self.head_dim] = 0.0
        elif name == "layers.0.v_proj.weight":
            value[:, :2] = 0.0
            value[self.count, 0] = 1.0
            value[self.sos, 1] = 1.0
        elif name == "layers.0.v_proj.bias":
            value[:2] = 0.0
        elif name.endswith((".o_proj.weight", ".down_proj.weight")):
            value[:, self.protected] = 0.0
            if name == "layers.0.o_proj.weight":  # rows 0, 1: query head 0, channels 0, 1
                value[0, self.total] = 1.0
                value[1, self.system] = self.k * self.system_tokens
        elif name == "llm_decoder.weight":
            value[self.protected, :] = 0.0
            value[:, C.SPEECH_TOKEN_VOCAB :] = 0.0
            value[[self.total, self.system], C.EOS_TOKEN] = STOP_GAIN
            special = [c for c in range(C.SPEECH_TOKEN_VOCAB, value.shape[1]) if c != C.EOS_TOKEN]
            value[self.one, special] = SPECIAL_LOGIT


def stop_counter(cfg: SyntheticConfig, system_tokens: int = 0) -> StopCounter | None:
    """The tiny LLM's :class:`StopCounter`, or None when ``cfg`` has none.

    ``system_tokens``: tokens of :data:`wyoming_cosyvoice3.engine.constants.SYSTEM_PROMPT`
    in the model's tokenizer (the prefix every prompt starts with; not counted as text).
    """
    if cfg.llm_stop_tokens_per_text_token is None:
        return None
    return StopCounter(
        cfg.llm_hidden, cfg.llm_stop_tokens_per_text_token, system_tokens, cfg.llm_head_dim
    )


def _counter_adjust(cfg: SyntheticConfig) -> Callable[[str, np.ndarray], None] | None:
    """Weights ``adjust`` of the embedding tables: the stop markers (tiny size only)."""
    counter = stop_counter(cfg)
    if counter is None:
        return None

    def adjust(name: str, value: np.ndarray) -> None:
        counter.embedding_rows(value, "text" if name == "embed_tokens.weight" else "speech")

    return adjust


def _rope_tables(g: GraphBuilder, cfg: SyntheticConfig) -> tuple[str, str]:
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


def build_llm(cfg: SyntheticConfig, seed: int, system_tokens: int = 0) -> onnx.ModelProto:
    """llm.onnx (fp32): see the module docstring. ``system_tokens``: see :func:`stop_counter`
    (used only by a size with a stop counter)."""
    g = GraphBuilder("cosyvoice3_llm_qwen2")
    llm_io(g, cfg)
    counter = stop_counter(cfg, system_tokens)
    net = Net(g, Weights(llm_params(cfg), seed, LLM_FILE,
                         None if counter is None else counter.llm_weight))
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
