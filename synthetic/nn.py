"""Layer helpers shared by the synthetic graph builders.

:class:`Net` couples a :class:`~.onnx_builder.GraphBuilder` with the :class:`~.config.Weights`
of one graph: parameters become initializers under their table names (``llm.layers.3.q.weight``),
so counting initializers by name reproduces :func:`~.config.count_params`. The ``*_params``
functions add the entries of one layer to a :data:`~.config.ParamTable`.

Conventions: linear weights are ``[in, out]`` (``y = x @ W + b``, a quantisable MatMul), conv
weights ``[out, in / groups, kernel]``; every op is standard ONNX opset 18.
"""

from __future__ import annotations

import numpy as np

from .config import ParamSpec, ParamTable, Weights, fan_in_std
from .onnx_builder import GraphBuilder


def linear_params(
    table: ParamTable, prefix: str, n_in: int, n_out: int, std: float | None, bias: bool = True
) -> None:
    """``prefix.weight`` [n_in, n_out] (std ``std`` or 1/sqrt(n_in)) and ``prefix.bias``."""
    table[f"{prefix}.weight"] = ParamSpec((n_in, n_out), fan_in_std(n_in) if std is None else std)
    if bias:
        table[f"{prefix}.bias"] = ParamSpec((n_out,), 0.0)


def conv_params(
    table: ParamTable,
    prefix: str,
    n_out: int,
    n_in: int,
    kernel: int,
    groups: int = 1,
    gain: float = 1.0,
    bias: bool = True,
) -> None:
    """``prefix.weight`` [n_out, n_in/groups, kernel] (std gain/sqrt(fan in)), ``prefix.bias``."""
    fan_in = n_in // groups * kernel
    table[f"{prefix}.weight"] = ParamSpec((n_out, n_in // groups, kernel), fan_in_std(fan_in, gain))
    if bias:
        table[f"{prefix}.bias"] = ParamSpec((n_out,), 0.0)


class Net:
    """Graph builder plus the weights of one graph; methods return value names."""

    def __init__(self, g: GraphBuilder, weights: Weights) -> None:
        self.g = g
        self.w = weights

    def param(self, name: str) -> str:
        """The initializer of parameter ``name`` (drawn now, stored under its own name)."""
        return self.g.const(self.w.take(name), name=name)

    def has(self, name: str) -> bool:
        return name in self.w.table

    # --- linear algebra ----------------------------------------------------------------
    def linear(self, x: str, prefix: str) -> str:
        """``x @ prefix.weight (+ prefix.bias)`` over the last axis."""
        y = self.g.op("MatMul", [x, self.param(f"{prefix}.weight")], name=f"{prefix}.matmul")
        if self.has(f"{prefix}.bias"):
            y = self.g.op("Add", [y, self.param(f"{prefix}.bias")])
        return y

    def conv1d(
        self,
        x: str,
        prefix: str,
        pads: tuple[int, int] = (0, 0),
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
    ) -> str:
        """1-D convolution of [B, C, T] with zero padding ``(left, right)``."""
        weight = self.w.table[f"{prefix}.weight"]
        inputs = [x, self.param(f"{prefix}.weight")]
        if self.has(f"{prefix}.bias"):
            inputs.append(self.param(f"{prefix}.bias"))
        return self.g.op(
            "Conv",
            inputs,
            name=f"{prefix}.conv",
            kernel_shape=[weight.shape[2]],
            pads=list(pads),
            strides=[stride],
            dilations=[dilation],
            group=groups,
        )

    # --- normalisation and activations -------------------------------------------------
    def rms_norm(self, x: str, weight_name: str, eps: float) -> str:
        """Qwen2RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight`` over the last axis."""
        g = self.g
        power = g.op("Pow", [x, g.const(2.0)])
        mean = g.op("ReduceMean", [power, g.const([-1])], keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.shift(mean, eps)])])
        return g.op("Mul", [g.op("Mul", [x, inv]), self.param(weight_name)])

    def layer_norm(self, x: str, width: int, eps: float, prefix: str | None = None) -> str:
        """LayerNorm over the last axis; affine from ``prefix.weight``/``prefix.bias`` if given,
        else ``elementwise_affine=False`` (unit scale, zero shift constants)."""
        if prefix is None:
            scale = self.g.const(np.ones(width, np.float32))
            bias = self.g.const(np.zeros(width, np.float32))
        else:
            scale, bias = self.param(f"{prefix}.weight"), self.param(f"{prefix}.bias")
        return self.g.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=eps)

    def silu(self, x: str) -> str:
        return self.g.op("Mul", [x, self.g.op("Sigmoid", [x])])

    def gelu_tanh(self, x: str) -> str:
        """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (nn.GELU(approximate="tanh"))."""
        g = self.g
        cube = g.op("Mul", [g.op("Mul", [x, x]), x])
        inner = g.op("Add", [x, g.scale(cube, 0.044715)])
        t = g.op("Tanh", [g.scale(inner, float(np.sqrt(2.0 / np.pi)))])
        return g.op("Mul", [g.scale(x, 0.5), g.shift(t, 1.0)])

    def gelu(self, x: str) -> str:
        """Exact GELU ``0.5 x (1 + erf(x / sqrt 2))``."""
        g = self.g
        erf = g.op("Erf", [g.scale(x, float(1.0 / np.sqrt(2.0)))])
        return g.op("Mul", [g.scale(x, 0.5), g.shift(erf, 1.0)])

    def snake(self, x: str, alpha_name: str) -> str:
        """Snake activation of [B, C, T]: ``x + sin(alpha x)^2 / (alpha + 1e-9)``
        (cosyvoice/transformer/activation.py Snake, ``alpha_logscale=False``)."""
        g = self.g
        alpha = g.op("Unsqueeze", [self.param(alpha_name), g.const([0, 2])])  # [1, C, 1]
        sine = g.op("Sin", [g.op("Mul", [x, alpha])])
        return g.op("Add", [x, g.op("Div", [g.op("Mul", [sine, sine]), g.shift(alpha, 1e-9)])])

    # --- attention ---------------------------------------------------------------------
    def split_heads(self, x: str, heads: int, head_dim: int) -> str:
        """[B, S, H*D] -> [B, H, S, D]."""
        split = self.g.op("Reshape", [x, self.g.const([0, 0, heads, head_dim])])
        return self.g.op("Transpose", [split], perm=[0, 2, 1, 3])

    def merge_heads(self, x: str, width: int) -> str:
        """[B, H, S, D] -> [B, S, H*D]."""
        moved = self.g.op("Transpose", [x], perm=[0, 2, 1, 3])
        return self.g.op("Reshape", [moved, self.g.const([0, 0, width])])

    def attention(
        self, q: str, k: str, v: str, head_dim: int, bias: str | None, rank: int = 4
    ) -> str:
        """Scaled dot-product attention of rank-``rank`` [.., S, D] queries over [.., T, D]
        keys/values, with an additive ``bias`` broadcastable to [.., S, T]."""
        g = self.g
        scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=_swap_last(rank))])
        scores = g.scale(scores, 1.0 / float(np.sqrt(head_dim)))
        if bias is not None:
            scores = g.op("Add", [scores, bias])
        return g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])


def _swap_last(rank: int) -> list[int]:
    """Permutation swapping the last two axes of a rank-``rank`` tensor."""
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return perm


def rotate_half(g: GraphBuilder, x: str, dim: int) -> str:
    """``concat(-x[..., dim/2:], x[..., :dim/2])`` over the last axis (HF / x-transformers
    ``rotate_half`` on the half-split layout)."""
    half = dim // 2
    first = g.op("Slice", [x, g.const([0]), g.const([half]), g.const([-1])])
    second = g.op("Slice", [x, g.const([half]), g.const([dim]), g.const([-1])])
    return g.op("Concat", [g.op("Neg", [second]), first], axis=-1)
