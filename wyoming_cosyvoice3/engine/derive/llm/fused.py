"""The fused-operator LLM decode graph: derived once from the published LLM, validated, cached.

Why: the published ``llm_int8.onnx`` runs 2222 onnxruntime nodes per decoded token (Qwen2
exported op by op plus the dynamic-quantisation pattern around every MatMul); per-node
overhead is a large part of a decode step. The fused graph (:mod:`.fused_graph`) has 11
nodes per layer (274 for the published 24 layers) and the same inputs, outputs and KV-cache
layout ([1, kv_heads, positions, head_dim], keys after RoPE), so the decoder and the prefix
cache use it unchanged and a cache made by one graph continues in the other.

Variants (``EngineOptions.llm_graph``):

* ``"fused"``, lossless: the projections keep the source's numbers. From ``llm_int8.onnx``:
  ``DynamicQuantizeMatMul`` with the same per-column int8 weights and the same per-tensor
  uint8 quantisation of the activations (q|k|v and gate|up read one input, which the published
  graph quantises identically three and two times). From ``llm.onnx``: float ``MatMul``.
  Only float rounding differs (fused kernels sum in another order); with int8 activations a
  rounding difference occasionally moves one activation by one quantisation step, so the
  int8 form differs from the published graph by about the published graph's own
  activation-quantisation error (measured below) and is as far from float activations.
* ``"fused-q4"``, lossy: ``MatMulNBits`` 4-bit weights (blocks of :data:`Q4_BLOCK_SIZE` along
  K, asymmetric, quantised by onnxruntime from the source weights) with int8 compute
  (``accuracy_level`` 4): fewer weight bytes per token.

Validation when derived (prefill in the decoder's two calls, 20 then 40 positions, then
single-token steps, teacher-forced on the caller's embeddings or seeded N(0, 1) ones):

1. structure: the fused graph and the published graph, both with float activations and the
   same weights (:func:`~.llm_patterns.float_activation_reference` rewrites the published
   int8 pattern to ``MatMul(x, DequantizeLinear(w))``; the fused graph uses the same
   ``dequant`` kernel), must agree within :data:`EXACT_MAX_ABS_LOGP` in every log-prob. This
   checks every weight found by structure, the rotary tables, the norms and the attention.
   The same comparison of the published int8 graph with its float form gives its own
   activation-quantisation error (``int8_noise``).
2. the variant written: ``fused`` from float weights must stay within ``EXACT_MAX_ABS_LOGP`` of
   the published graph; ``fused`` and ``fused-b8`` from int8 weights no further from float
   activations than ``1.1 x int8_noise`` (10 % for float rounding), and so within
   ``2.1 x int8_noise`` of the published graph; ``fused-q4`` within
   ``max(LOSSY_MAX_ABS_LOGP, int8_noise)``.

Measured (teacher-forced, 90 positions; ``python -m bench.llm_decode``):
parity model structure 6e-6, full-size synthetic 4e-6; full-size synthetic ``fused`` against
``llm_int8.onnx`` max 0.12 / mean 0.019 nats (``llm_int8.onnx`` itself against ``llm.onnx``:
max 0.55 / mean 0.088), ``fused-q4`` max 0.7-1.4 / mean 0.10-0.23.

The report of each derivation is stored beside the file (``.json``). Any failure (structure
not recognised, q4 source, validation) raises :class:`ModelLoadError`, is remembered by a
``.failed`` marker (no retry on every start) and the caller keeps the published graph with
one warning.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ...errors import ModelLoadError
from ...sessions import Graph, count_llm_layers, llm_spec, open_session
from ..common.files import derive_reported, keyed_name, read_report, run_child
from ..common.files import validation_session as _session
from .fused_graph import build_fused_llm
from .patterns import float_activation_reference
from .weights import read_llm_weights

logger = logging.getLogger(__name__)

FUSED_TAGS = {"fused": "fused2", "fused-b8": "fusedb8r2", "fused-q4": "fusedq4r2"}
"""File tags per variant (bumped when the recipe changes)."""
RETIRED_TAGS = {"fused": ("fused1",), "fused-b8": ("fusedb8r1",), "fused-q4": ("fusedq4r1",)}
"""Earlier recipes' tags per variant: their files are removed once the current one is derived
(``*1``: one batch row)."""
B8_BLOCK_SIZE = 128
"""K-block of ``fused-b8`` at the published widths: the largest power of two that divides both
projection widths (896 = 7 x 128, 4864 = 38 x 128), so no block is padded. Its decode step was
25 % faster than 32-element blocks' on the AVX-512 test machine (BENCHMARKS.md "LLM decode
graph"); the weights are exact at any block size, so a model of other widths takes the largest
of 128, 64, 32, 16 that divides its widths (:func:`b8_block_size`)."""


def b8_block_size(widths: list[int]) -> int:
    """The ``fused-b8`` block for projections whose K is one of ``widths``.

    Raises:
        ModelLoadError: no block of 16 or more divides every width.
    """
    for block in (B8_BLOCK_SIZE, 64, 32, 16):
        if all(width % block == 0 for width in widths):
            return block
    raise ModelLoadError(f"fused-b8 needs projection widths divisible by 16, got {widths}")
Q4_BLOCK_SIZE = 32
"""K-block of the 4-bit weights (onnxruntime's default for MatMulNBits; 128 measured 10 %
faster per token on AVX2 but with 1.3x the weight error)."""
EXACT_MAX_ABS_LOGP = 1e-3
"""Lossless variant: largest accepted teacher-forced log-prob difference (float rounding is
about 1e-5; a wrong structure gives differences of order 1)."""
LOSSY_MAX_ABS_LOGP = 2.0
"""fused-q4: largest accepted teacher-forced log-prob difference from the published graph
(or the published int8 graph's own activation-quantisation error, when that is larger).

A decision, not a measurement: the 4-bit graph is lossy by design (``fast`` takes it for
speed), and this line only refuses one that has lost the model, where no token's probability
may move by more than e^2 (7.4x) on the validation history. Measured honest errors lie below
it: 0.7-1.4 on the full-size synthetic model, 1.1 (from ``llm.onnx``) and 1.6 (from
``llm_int8.onnx``) on the tiny one; the error grows with the logits' range (the tiny model with
its head weights x4 / x8: 4.3 / 8.6, refused). MatMulNBits' int8 compute rounds differently
per CPU, so a model whose error is near the line is accepted on one CPU and refused on another
(the parity model, head weights x8: 1.94 on a Zen 4, 2.55 on an AVX-512 Xeon); either is safe,
as a refused graph leaves the engine on its fallback with one warning. The tests judge graphs
far from the line (tests/test_llm_fused.py)."""
VALIDATION_SPLIT = (20, 40, 30)
"""Teacher-forced validation: prefix positions, request positions, single-token steps."""
STRUCTURE_SPLIT = (20, 40, 4)
"""The structure check's shorter run (its graphs dequantise every weight on every call)."""


@dataclass(frozen=True)
class FusedReport:
    """Teacher-forced comparison of a fused graph with the published one.

    Attributes:
        variant: ``"fused"``, ``"fused-b8"`` or ``"fused-q4"``.
        source: file name of the published graph.
        max_abs_logp: largest |log p_fused - log p_published| over all steps and ids.
        mean_abs_logp: mean of the same.
        greedy_agreement: fraction of steps whose argmax agree.
        structure_max_abs_logp: the structure check: the fused graph against the published
            one, both with float activations and the same weights (only rounding remains).
        int8_noise_max_abs_logp: the published int8 graph against its float-activation
            form (its own activation-quantisation error; 0 for an fp32 source).
        nodes: node count of the fused graph; source_nodes: of the published graph.
        derive_s: seconds to read, build, validate and write.
        paired_max_abs_logp: ``fused-b8``: its two-row steps (two pieces decoded at once,
            :mod:`wyoming_cosyvoice3.engine.llm.tokens`; onnxruntime's ``MatMulNBits`` sums
            another way for more than one row) against the float-activation reference; they
            may pair when this is within ``1.1 x int8_noise`` (:attr:`pairs_rows`). None for
            the other variants (``fused-q4`` pairs where its rows are exact, checked at load;
            ``fused``'s per-tensor activation scale spans the rows).
    """

    variant: str
    source: str
    max_abs_logp: float
    mean_abs_logp: float
    greedy_agreement: float
    structure_max_abs_logp: float
    int8_noise_max_abs_logp: float
    nodes: int
    source_nodes: int
    derive_s: float
    paired_max_abs_logp: float | None = None

    @property
    def pairs_rows(self) -> bool:
        """Two-row steps validated: no further from float activations than the published
        graph (10 % for float rounding)."""
        return (self.paired_max_abs_logp is not None and self.paired_max_abs_logp
                <= max(EXACT_MAX_ABS_LOGP, 1.1 * self.int8_noise_max_abs_logp))


def teacher_forced_logp(
    session: Any, embeds: np.ndarray, split: tuple[int, int, int] = VALIDATION_SPLIT,
    rows: int = 1,
) -> np.ndarray:
    """Log-probs float64 [2 + steps, V] of an LLM session fed ``embeds`` [1, n, H] the way the
    decoder feeds it (two prefill calls, then one position per call); with ``rows`` 2 the
    single positions in two batch rows holding the same sequence (a graph with a batch axis;
    the prompts in one row, as the decoder prefills), row 0's log-probs.

    Raises:
        ValueError: ``embeds`` has fewer than ``sum(split)`` positions.
    """
    prefix, request, steps = split
    if embeds.shape[1] < prefix + request + steps:
        raise ValueError("not enough validation embeddings")
    names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    shape = session.get_inputs()[[i.name for i in session.get_inputs()].index(names[0])].shape
    kv = {n: np.zeros((1, int(shape[1]), 0, int(shape[3])), np.float32) for n in names}
    bounds = [(0, prefix), (prefix, prefix + request)]
    bounds += [(t, t + 1) for t in range(prefix + request, prefix + request + steps)]
    out = []
    for start, end in bounds:
        # prompts in one row, as the decoder prefills each piece alone (onnxruntime's
        # GroupQueryAttention takes one row when it adds several positions to a cache)
        batch = rows if end - start == 1 else 1
        if batch > 1:
            kv = {n: np.repeat(v[:1], batch, axis=0) for n, v in kv.items()}
        feeds = {
            "inputs_embeds": np.ascontiguousarray(
                np.repeat(embeds[:, start:end], batch, axis=0), np.float32),
            "attention_mask": np.ones((batch, end), np.int64),
            "position_ids": np.repeat(np.arange(start, end, dtype=np.int64)[None, :], batch, 0),
            **kv,
        }
        names_out = [o.name for o in session.get_outputs()]
        outputs = dict(zip(names_out, session.run(None, feeds), strict=True))
        kv = {n: outputs[n.replace("past_key_values.", "present.")] for n in names}
        logits = outputs["logits"][0].reshape(-1).astype(np.float64)
        logits -= logits.max()
        out.append(logits - np.log(np.exp(logits).sum()))
    return np.array(out)


def compare(reference: np.ndarray, other: np.ndarray) -> tuple[float, float, float]:
    """(max abs, mean abs, greedy agreement) of two log-prob arrays [steps, V]."""
    if not np.all(np.isfinite(other)):
        return float("inf"), float("inf"), 0.0
    diff = np.abs(other - reference)
    agree = float(np.mean(np.argmax(other, axis=1) == np.argmax(reference, axis=1)))
    return float(diff.max()), float(diff.mean()), agree


def validation_embeddings(hidden: int, seed: int = 0) -> np.ndarray:
    """Seeded N(0, 1) embeddings float32 [1, sum(VALIDATION_SPLIT), hidden] (the first
    RMSNorm removes the scale; callers may pass real embedding rows instead)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, sum(VALIDATION_SPLIT), hidden)).astype(np.float32)


def derive_fused_llm(
    source: Path, target: Path, variant: str, embeds: np.ndarray | None = None
) -> FusedReport:
    """Read ``source``, build, validate and write the ``variant`` graph to ``target``
    (+ ``target.data``). See the module docstring.

    Raises:
        LlmStructureError: structure not recognised.
        ModelLoadError: validation failed.
        ValueError: unknown variant.
    """
    if variant not in FUSED_TAGS:
        raise ValueError(f"variant must be one of {sorted(FUSED_TAGS)}, got {variant!r}")
    started = time.perf_counter()
    weights = read_llm_weights(source)
    if embeds is None:
        embeds = validation_embeddings(weights.hidden)
    split = VALIDATION_SPLIT
    published = teacher_forced_logp(_session(source), embeds, split)
    # 1. structure: float activations on both sides, same weights -> equal to rounding
    if weights.int8:
        float_ref = _session(float_activation_reference(source), optimize=False)
        exact = _session(build_fused_llm(weights, kernel="dequant"), optimize=False)
        reference = teacher_forced_logp(float_ref, embeds, STRUCTURE_SPLIT)
        del float_ref
        int8_noise = compare(reference, published[: len(reference)])[0]
    else:
        exact = _session(build_fused_llm(weights, kernel="fp32"))
        reference, int8_noise = published[: sum(STRUCTURE_SPLIT[2:]) + 2], 0.0
    structure = compare(reference, teacher_forced_logp(exact, embeds, STRUCTURE_SPLIT))[0]
    del exact
    if not structure <= EXACT_MAX_ABS_LOGP:
        raise ModelLoadError(
            f"the fused graph of {source.name} differs from it by {structure:.3g} in log-probs "
            f"with float activations (allowed {EXACT_MAX_ABS_LOGP}); its structure was misread"
        )
    # 2. the deployed variant against the published graph
    if variant == "fused":
        model = build_fused_llm(weights, kernel="int8" if weights.int8 else "fp32")
        limit = max(EXACT_MAX_ABS_LOGP, int8_noise)
    elif variant == "fused-b8":
        if not weights.int8:
            raise ModelLoadError(
                f"fused-b8 keeps int8 weights as published; {source.name} has float weights")
        widths = sorted({lin.k for layer in weights.layers
                         for lin in (layer.q, layer.o, layer.gate, layer.down)})
        model = build_fused_llm(weights, kernel="nbits8", block_size=b8_block_size(widths))
        limit = max(EXACT_MAX_ABS_LOGP, int8_noise)
    else:
        model = build_fused_llm(weights, kernel="nbits4", block_size=Q4_BLOCK_SIZE)
        limit = max(LOSSY_MAX_ABS_LOGP, int8_noise)
    del weights
    _save(model, target)
    session = _session(target)
    logp = teacher_forced_logp(session, embeds, split)
    if variant == "fused-b8" or (variant == "fused" and int8_noise > 0):
        # int8 activations: fused-b8 quantises them per block, not per tensor as the published
        # graph; fused per tensor as it does, but its kernels sum in another order, and one
        # activation moved by one quantisation step moves the log-probs as much as the
        # quantisation itself, and the published graph's own distance from float activations
        # depends on the CPU's kernels (BENCHMARKS.md "Two pieces decoded at once"). So
        # each must be no further from the same weights with float activations than the
        # published graph is (``int8_noise``), with 10 % for the two runs' float rounding
        to_float = compare(reference, logp[: len(reference)])[0]
        if not to_float <= max(EXACT_MAX_ABS_LOGP, 1.1 * int8_noise):
            raise ModelLoadError(
                f"{variant} graph of {source.name} is {to_float:.3g} from float activations in "
                f"log-probs, the published graph {int8_noise:.3g}")
        # and so within 1.1 + 1 int8_noise of the published graph (triangle inequality)
        limit = max(limit, 2.1 * int8_noise)
    paired = None
    if variant == "fused-b8":
        # two rows take another MatMulNBits kernel path: measured, not required (pairs_rows)
        two_rows = teacher_forced_logp(session, embeds, split, rows=2)
        paired = compare(reference, two_rows[: len(reference)])[0]
    del session
    stats = compare(published, logp)
    report = FusedReport(
        variant,
        source.name,
        *stats,
        structure,
        int8_noise,
        len(model.graph.node),
        _node_count(source),
        time.perf_counter() - started,
        paired,
    )
    if not report.max_abs_logp <= limit:
        raise ModelLoadError(
            f"{variant} graph of {source.name} differs from it by {report.max_abs_logp:.3g} "
            f"in log-probs (allowed {limit:.3g})"
        )
    return report


def _node_count(path: Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def _save(model: onnx.ModelProto, target: Path) -> None:
    data = target.name + ".data"
    (target.parent / data).unlink(missing_ok=True)
    onnx.save(model, str(target), save_as_external_data=True, location=data, size_threshold=1024)


def write_fused_files(
    source: Path, variant: str, data: Path, report_json: Path, graph: Path,
    embeds: np.ndarray | None = None,
) -> FusedReport:
    """Derive the ``variant`` graph of ``source`` (:func:`derive_fused_llm`) and write its three
    files: the weights to ``data``, the report to ``report_json`` and to ``graph`` the graph,
    whose external-data entries name the weights file by its final name
    (:func:`~..common.files.keyed_name`), so all three can be renamed into place. Run in the
    derivation child process (:mod:`..child`) or, with ``in_process``, by :func:`ensure_fused_llm`.

    Raises:
        as :func:`derive_fused_llm`.
    """
    written = graph.with_name(graph.name + ".data")  # the weights, as derive_fused_llm saves
    try:
        report = derive_fused_llm(source, graph, variant, embeds)
        os.replace(written, data)
        _point_at(graph, keyed_name(source, FUSED_TAGS[variant], ".onnx.data"))
    finally:
        written.unlink(missing_ok=True)
    report_json.write_text(json.dumps(asdict(report), indent=1), encoding="utf-8")
    return report


def ensure_fused_llm(
    source: Path, cache_dir: Path, variant: str, embeds: np.ndarray | None = None,
    *, in_process: bool = False,
) -> tuple[Path, FusedReport]:
    """Path of the fused graph of ``source`` (deriving and validating it once,
    :func:`~..common.files.derive_reported`) and its report.

    The derivation runs in a child process (:func:`~..common.files.run_child`) unless
    ``in_process`` (tests, tools): reading, rebuilding and checking the weights is seconds of
    Python work that would hold this process's GIL (a server would stop answering), and a
    child killed for memory leaves this process serving the published graph.

    Returns:
        (``cache_dir / "<stem>.<tag>-<size>-<mtime_ns>.onnx"``, the report stored beside it
        as ``.onnx.json``; the weights are in ``.onnx.data``).

    Raises:
        ValueError: unknown variant.
        ModelFilesMissing: ``source`` does not exist.
        ModelLoadError: not derivable or not valid (now or in an earlier attempt).
    """
    if variant not in FUSED_TAGS:
        raise ValueError(f"variant must be one of {sorted(FUSED_TAGS)}, got {variant!r}")
    tag = FUSED_TAGS[variant]

    def make(tmps: list[Path]) -> None:
        data, report_json, graph = tmps
        if in_process:
            write_fused_files(source, variant, data, report_json, graph, embeds)
        else:
            args = ["llm", variant, str(source), *(str(path) for path in tmps)]
            embeds_file = graph.with_name(graph.name + ".embeds.npy")
            try:
                if embeds is not None:
                    np.save(embeds_file, np.asarray(embeds, np.float32))
                    args.append(str(embeds_file))
                run_child(args)
            finally:
                embeds_file.unlink(missing_ok=True)
        report = read_report(report_json, FusedReport, "fused LLM")
        if report is None:
            raise ModelLoadError(f"the {variant} LLM derivation wrote no readable report")
        logger.info(
            "%s LLM graph: %d nodes (published %d), teacher-forced log-prob max abs %.2g, "
            "greedy agreement %.3f",
            variant,
            report.nodes,
            report.source_nodes,
            report.max_abs_logp,
            report.greedy_agreement,
        )

    (_, _, target), report = derive_reported(
        source,
        cache_dir,
        [(tag, ".onnx.data"), (tag, ".onnx.json"), (tag, ".onnx")],
        make,
        FusedReport,
        report_index=1,
        name=f"{variant} LLM graph",
        failure=f"{variant} LLM graph of {Path(source).name}",
        retired=[f"{old}-*" for old in RETIRED_TAGS[variant]],
    )
    return target, report


def _point_at(graph: Path, data: str) -> None:
    """Rewrite ``graph`` so that its external-data entries name the file ``data``."""
    model = onnx.load(str(graph), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = data
    graph.write_bytes(model.SerializeToString())


def open_fused_llm(
    source: Path,
    variant: str,
    cache_dir: Path,
    threads: int,
    providers: tuple[str, ...],
    spin_wait: bool = True,
    embeds: np.ndarray | None = None,
) -> Graph:
    """The ``variant`` LLM graph of ``source`` (derived once, :func:`ensure_fused_llm`) as a
    checked :class:`~...sessions.Graph` whose spec keeps the contract's file name.

    Args:
        source: the published graph (``llm_int8.onnx`` or ``llm.onnx``).
        variant: ``"fused"`` or ``"fused-q4"``.
        cache_dir: directory of derived files.
        threads, providers, spin_wait: session settings (as :func:`~...sessions.open_session`).
        embeds: validation embeddings float32 [1, >= 90, hidden] (default: seeded N(0, 1)).

    Raises:
        ModelFilesMissing, ModelLoadError, GraphSignatureMismatch: not derivable, not valid or
            not loadable (the caller falls back to ``source``).
    """
    path, report = ensure_fused_llm(source, cache_dir, variant, embeds)
    session = open_session(path, threads, providers, spin_wait)
    layers = count_llm_layers([arg.name for arg in session.get_inputs()])
    graph = Graph(path, llm_spec(source.name, layers), threads, providers, session=session)
    logger.info(
        "LLM: %s graph of %s (%d nodes instead of %d; teacher-forced log-prob max abs %.2g "
        "from the published graph, greedy agreement %.3f)",
        variant,
        source.name,
        report.nodes,
        report.source_nodes,
        report.max_abs_logp,
        report.greedy_agreement,
    )
    return graph
