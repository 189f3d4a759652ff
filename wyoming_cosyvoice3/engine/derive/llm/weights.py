"""Find the Qwen2 weights of a published CosyVoice3 LLM graph by structure (no node names).

Sources: Hugging Face ``transformers`` Qwen2 modelling (``Qwen2DecoderLayer``: pre-RMSNorm
attention with q/k/v bias and bias-free o_proj, pre-RMSNorm SiLU-gated MLP; ``Qwen2RMSNorm``:
``w * x / sqrt(mean(x^2) + eps)``), FunAudioLLM/CosyVoice ``cosyvoice/llm/llm.py``
``CosyVoice3LM`` (final norm, then the bias-free ``llm_decoder`` head on the last position),
and the export's graph contract (spec section 1: ``present.{i}.key = Concat(past, new key)``).

What is recognised, in an fp32 graph (``llm.onnx``) or its dynamic int8 form
(``llm_int8.onnx``, onnxruntime ``quantize_dynamic`` pattern ``DynamicQuantizeLinear ->
MatMulInteger -> Cast -> Mul(scale)``):

* a *linear*: ``y = x @ W`` with a constant 2-D ``W`` [K, N] (fp32), or the int8 pattern
  (weights int8 [K, N], per-column scale float32 [N] and zero point int8 [N]);
* per layer ``i``: the key and value projections are the linears reached walking back from
  the second input of the Concat producing ``present.{i}.key`` / ``.value``; the query
  projection is the other linear reading the same normalised input; the next four linears in
  graph order are o_proj, the two MLP inputs (the one feeding a Sigmoid is the gate) and
  down_proj; the head is the last linear (N = logits width);
* RMSNorm weight [H] (the constant multiplied into a linear's input) and epsilon (the scalar
  added to the ReduceMean of the squares);
* the rotary tables: the graph's own ``Cos`` / ``Sin`` subgraph is evaluated at positions
  ``0..max_positions-1`` (so theta and any scaling are whatever the graph computes).

Anything else (another architecture, q4 MatMulNBits weights, missing pieces) raises
:class:`LlmStructureError`; the caller then keeps the published graph. Whether the recovered
model computes the same function is checked numerically afterwards (:mod:`.fused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..common.graph import GraphIndex, Linear
from .patterns import (
    LlmStructureError,
    find_linears,
    llm_index,
    rms_norm_params,
    rope_tables,
    walk_back_to_linear,
)

__all__ = ["LayerWeights", "Linear", "LlmStructureError", "LlmWeights", "read_llm_weights"]


@dataclass
class LayerWeights:
    """Weights of one decoder layer (projections as :class:`Linear`)."""

    ln1: np.ndarray
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    ln2: np.ndarray
    gate: Linear
    up: Linear
    down: Linear


@dataclass
class LlmWeights:
    """Everything the fused graph needs.

    Attributes:
        hidden, heads, kv_heads, head_dim, vocab: dimensions (published: 896, 14, 2, 64, 6761).
        eps: RMSNorm epsilon (published 1e-6).
        layers: per-layer weights.
        norm: final RMSNorm weight [H]; head: the ``llm_decoder`` projection [H, vocab].
        cos, sin: rotary tables float32 [max_positions, head_dim / 2].
        int8: the source held int8 weights.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    layers: list[LayerWeights]
    norm: np.ndarray
    head: Linear
    cos: np.ndarray
    sin: np.ndarray
    int8: bool = False
    notes: list[str] = field(default_factory=list)


def read_llm_weights(path: Path, max_positions: int = 32768) -> LlmWeights:
    """Read the Qwen2 weights of ``path`` (llm.onnx or llm_int8.onnx with its .data file).

    Args:
        path: the published LLM graph.
        max_positions: rows of the rotary tables (positions the fused graph accepts; Qwen2
            ``max_position_embeddings`` is 32768).

    Raises:
        LlmStructureError: the structure is not recognised (see the module docstring).
        OSError, onnx errors: unreadable file.
    """
    model = onnx.load(str(path))
    ix = llm_index(model)
    inputs = {i.name: i for i in model.graph.input}
    kv = inputs.get("past_key_values.0.key")
    if kv is None or "inputs_embeds" not in inputs:
        raise LlmStructureError("no inputs_embeds / past_key_values.0.key input")
    head_dim = kv.type.tensor_type.shape.dim[3].dim_value
    hidden = inputs["inputs_embeds"].type.tensor_type.shape.dim[2].dim_value
    n_layers = sum(
        1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key")
    )
    if head_dim <= 0 or hidden <= 0:
        raise LlmStructureError("hidden size / head dim are not static in the graph inputs")
    linears = find_linears(ix)
    if len(linears) != 7 * n_layers + 1:
        raise LlmStructureError(
            f"{len(linears)} projections for {n_layers} layers (expected 7 per layer + head)"
        )
    by_output = {lin.y: lin for lin in linears}
    order = sorted(linears, key=lambda lin: lin.order)
    layers: list[LayerWeights] = []
    eps_values: set[float] = set()
    for i in range(n_layers):
        concat = {}
        for kind in ("key", "value"):
            node = ix.node_of(f"present.{i}.{kind}")
            if (
                node is None
                or node.op_type != "Concat"
                or node.input[0] != f"past_key_values.{i}.{kind}"
            ):
                raise LlmStructureError(f"present.{i}.{kind} is not Concat(past, new)")
            concat[kind] = walk_back_to_linear(ix, node.input[1], by_output)
        k, v = concat["key"], concat["value"]
        q_cands = [lin for lin in linears if lin.x == k.x and lin is not k and lin is not v]
        if len(q_cands) != 1 or v.x != k.x:
            raise LlmStructureError(f"layer {i}: q/k/v do not share one normalised input")
        q = q_cands[0]
        last = max(order.index(q), order.index(k), order.index(v))
        rest = order[last + 1 : last + 5]
        if len(rest) != 4 or rest[1].x != rest[2].x:
            raise LlmStructureError(f"layer {i}: o/gate/up/down not found after the attention")
        o, a, b, down = rest
        gate, up = (a, b) if _feeds_sigmoid(ix, a) else (b, a)
        if not _feeds_sigmoid(ix, gate) or _feeds_sigmoid(ix, up):
            raise LlmStructureError(f"layer {i}: no SiLU gate (Sigmoid) on one MLP input")
        ln1, eps1 = rms_norm_params(ix, q.x, hidden)
        ln2, eps2 = rms_norm_params(ix, gate.x, hidden)
        eps_values.update((eps1, eps2))
        shapes = [(p.k, p.n) for p in (o, gate, up, down)]
        inter = gate.n
        if shapes != [(q.n, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]:
            raise LlmStructureError(f"layer {i}: unexpected projection shapes {shapes}")
        if (
            o.bias is not None
            or gate.bias is not None
            or up.bias is not None
            or down.bias is not None
        ):
            raise LlmStructureError(f"layer {i}: unexpected bias on o/gate/up/down")
        layers.append(LayerWeights(ln1, q, k, v, o, ln2, gate, up, down))
    head = order[-1]
    if head.y != "logits" and ix.users(head.y):
        raise LlmStructureError("the last projection does not produce the logits")
    norm, eps_final = rms_norm_params(ix, head.x, hidden)
    eps_values.add(eps_final)
    if len(eps_values) != 1:
        raise LlmStructureError(f"several RMSNorm epsilons {sorted(eps_values)}")
    q0, k0 = layers[0].q, layers[0].k
    if q0.n % head_dim or k0.n % head_dim or (q0.n // head_dim) % (k0.n // head_dim):
        raise LlmStructureError("query/key widths are not multiples of the head dim")
    cos, sin = rope_tables(model, ix, max_positions)
    if cos.shape[1] * 2 != head_dim:
        raise LlmStructureError("rotary table width differs from the head dim")
    return LlmWeights(
        hidden=hidden,
        heads=q0.n // head_dim,
        kv_heads=k0.n // head_dim,
        head_dim=head_dim,
        vocab=head.n,
        eps=eps_values.pop(),
        layers=layers,
        norm=norm,
        head=head,
        cos=cos,
        sin=sin,
        int8=head.qweight is not None,
    )


def _feeds_sigmoid(ix: GraphIndex, lin: Linear) -> bool:
    return any(user.op_type == "Sigmoid" for user in ix.users(lin.y))
