"""LLM decode speed of the published and fused LLM graphs, in one process, interleaved.

For each ``--graphs`` value (``EngineOptions.llm_graph``) the engine's own loader and
:class:`~wyoming_cosyvoice3.engine.llm.LlmDecoder` are used on ``--model-dir``: the prompt of a
zero-shot request (SOS, 40 prompt-text and 20 text ids, TASK, ``--prompt-tokens`` speech
tokens) is prefilled in the decoder's two calls, then ``--tokens`` steps are decoded with RAS
sampling from the request's generator; the graphs take turns token by token, so load changes
on a shared machine hit all of them alike (their idle worker threads then sleep instead of
spinning, ``EngineOptions.spin_wait``; a single graph spins as in the server). Reported per
graph: median / p10 / p90 ms per decode step (``LlmDecoder.step``: embedding + graph run),
prefill ms, graph nodes, and (``--rss``) the steady RSS of a fresh process that loaded the
model with that graph and decoded 20 tokens.

Run: ``python -m bench.llm_decode --model-dir MODEL_DIR --cache-dir CACHE --tokens 120
--rss`` (MODEL_DIR: the full-size synthetic model; CACHE: where the derived graphs go).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.llm.decoder import LlmDecoder, sample_step
from wyoming_cosyvoice3.engine.loaders import load_llm_graph
from wyoming_cosyvoice3.engine.model import CosyVoice3Model, ModelDims
from wyoming_cosyvoice3.engine.options import EngineOptions, LlmPrompt
from wyoming_cosyvoice3.engine.sessions import (
    SPEECH_EMBEDDING,
    TEXT_EMBEDDING,
    Graph,
    count_llm_layers,
)


def _prompt(prompt_tokens: int) -> LlmPrompt:
    rng = np.random.default_rng(7)
    return LlmPrompt(
        rng.integers(1000, 20000, 40),
        rng.integers(1000, 20000, 20),
        rng.integers(0, C.SPEECH_TOKEN_VOCAB, prompt_tokens),
        "zero_shot",
    )


class _LlmParts:
    """The parts of a loaded model :class:`LlmDecoder` uses (no flow, vocoder or DiT)."""

    def __init__(self, model_dir: Path, graph: str, cache_dir: Path, threads: int,
                 spin_wait: bool = True) -> None:
        options = EngineOptions(llm_graph=graph, cache_dir=cache_dir, threads=threads,  # type: ignore[arg-type]
                                spin_wait=spin_wait)
        self.speech_embedding = Graph(model_dir / SPEECH_EMBEDDING.file, SPEECH_EMBEDDING, threads,
                                      spin_wait=spin_wait)
        self.text_embedding = Graph(model_dir / TEXT_EMBEDDING.file, TEXT_EMBEDDING, threads,
                                    spin_wait=spin_wait)
        self.llm = load_llm_graph(model_dir, options, threads, self.speech_embedding)
        self.llm_prefill = None
        self.llm_kv_in_place = False  # the graphs taking turns keep the classic hand-over
        dims = self.llm.input_shape("past_key_values.0.key")
        self.dims = ModelDims(
            int(self.llm.input_shape("inputs_embeds")[2] or 0),
            count_llm_layers(list(self.llm.spec.inputs)),
            int(dims[1] or 0),
            int(dims[3] or 0),
            int(self.llm.output_shape("logits")[1] or 0),
            80,
            192,
        )


def _load(model_dir: Path, graph: str, cache_dir: Path, threads: int,
          spin_wait: bool = True) -> CosyVoice3Model:
    return _LlmParts(model_dir, graph, cache_dir, threads, spin_wait)  # type: ignore[return-value]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Interleaved decode timing of every graph (module docstring)."""
    prompt = _prompt(args.prompt_tokens)
    # several sessions taking turns: an idle session's spinning worker threads would take the
    # cores from the one running (measured 43.6 against 33.7 ms per token for the same fused
    # graph alone), so they sleep instead; one graph alone spins, as in the server
    spin = len(args.graphs) == 1
    decoders = {
        g: LlmDecoder(
            _load(args.model_dir, g, args.cache_dir, args.threads, spin), prefix_cache_entries=0
        )
        for g in args.graphs
    }
    states, logits, prefill = {}, {}, {}
    times: dict[str, list[float]] = {g: [] for g in args.graphs}
    rngs = {g: np.random.default_rng(0) for g in args.graphs}
    for g, dec in decoders.items():
        started = time.perf_counter()
        states[g], logits[g], _ = dec.prefill_prompt(prompt)
        prefill[g] = (time.perf_counter() - started) * 1e3
    for step in range(args.tokens):
        for g, dec in decoders.items():
            token = sample_step(logits[g], states[g].tokens, rngs[g], step, args.tokens + 1)
            states[g].tokens.append(token)
            started = time.perf_counter()
            logits[g] = dec.step(states[g], token)
            times[g].append((time.perf_counter() - started) * 1e3)
    out: dict[str, dict[str, Any]] = {}
    for g, dec in decoders.items():
        ms = np.array(times[g][5:])
        nodes = len(onnx.load(str(dec._llm.path), load_external_data=False).graph.node)
        out[g] = {
            "median_ms": float(np.median(ms)),
            "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)),
            "prefill_ms": prefill[g],
            "prefill_positions": int(states[g].past_len - args.tokens),
            "nodes": nodes,
            "file": dec._llm.path.name,
        }
    return out


def rss_of(args: argparse.Namespace, graph: str) -> float:
    """Steady RSS (MB) of a fresh process: load with ``graph``, decode 20 tokens."""
    model_dir, cache_dir = str(args.model_dir), str(args.cache_dir)
    call = f"Path({model_dir!r}), {graph!r}, Path({cache_dir!r}), {args.threads}"
    code = (
        "from pathlib import Path; from bench import llm_decode as m;"
        f"print(m._child_rss({call}))"
    )
    # the child imports ``bench`` from this clone, wherever the caller stands
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[1])
    return float(done.stdout.strip().splitlines()[-1])


def _child_rss(model_dir: Path, graph: str, cache_dir: Path, threads: int) -> float:
    from wyoming_cosyvoice3.engine.memory import return_freed_memory

    dec = LlmDecoder(_load(model_dir, graph, cache_dir, threads), prefix_cache_entries=0)
    state, _, _ = dec.prefill_prompt(_prompt(125))
    for token in range(20):
        dec.step(state, token)
    return_freed_memory()
    return _rss_mb()


def deviation(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Teacher-forced log-prob deviation of each graph from llm.onnx (fp32, exact) and from
    llm_int8.onnx (the published default), on speech-embedding rows of seeded tokens."""
    from wyoming_cosyvoice3.engine.derive.llm.fused import (
        VALIDATION_SPLIT,
        _session,
        compare,
        ensure_fused_llm,
        teacher_forced_logp,
    )

    model = _load(args.model_dir, "published", args.cache_dir, args.threads)
    ids = np.random.default_rng(3).integers(0, C.SPEECH_TOKEN_VOCAB, sum(VALIDATION_SPLIT))
    embeds = model.speech_embedding.run({"input_ids": ids[None, :]}, ["inputs_embeds"])
    x = np.asarray(embeds["inputs_embeds"], np.float32)
    source = args.model_dir / "llm_int8.onnx"
    paths = {"fp32": args.model_dir / "llm.onnx", "published": source}
    for g in ("fused", "fused-q4"):
        paths[g] = ensure_fused_llm(source, args.cache_dir, g)[0]
    logp = {g: teacher_forced_logp(_session(p), x) for g, p in paths.items()}
    out = {}
    for g in ("published", "fused", "fused-q4"):
        vs_fp32, vs_int8 = compare(logp["fp32"], logp[g]), compare(logp["published"], logp[g])
        out[g] = {
            "fp32_max": vs_fp32[0],
            "fp32_mean": vs_fp32[1],
            "fp32_greedy": vs_fp32[2],
            "int8_max": vs_int8[0],
            "int8_mean": vs_int8[1],
            "int8_greedy": vs_int8[2],
        }
        print(
            f"{g:10s} vs fp32: max {vs_fp32[0]:.3f} mean {vs_fp32[1]:.4f} "
            f"greedy {vs_fp32[2]:.3f}; vs published int8: max {vs_int8[0]:.3f} "
            f"mean {vs_int8[1]:.4f} greedy {vs_int8[2]:.3f}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--graphs", default="published,fused,fused-q4")
    p.add_argument("--tokens", type=int, default=120)
    p.add_argument("--prompt-tokens", type=int, default=125)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rss", action="store_true")
    p.add_argument("--deviation", action="store_true", help="also the log-prob deviation")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.graphs = args.graphs.split(",")
    result = measure(args)
    if args.rss:
        for g in args.graphs:
            result[g]["rss_mb"] = rss_of(args, g)
    base = result[args.graphs[0]]["median_ms"]
    for g, r in result.items():
        print(
            f"{g:10s} {r['median_ms']:7.2f} ms/token (p10 {r['p10_ms']:.2f}, "
            f"p90 {r['p90_ms']:.2f}; "
            f"x{r['median_ms'] / base:.2f}), prefill {r['prefill_ms']:.0f} ms for "
            f"{r['prefill_positions']} positions, {r['nodes']} nodes, "
            f"RSS {r.get('rss_mb', float('nan')):.0f} MB  [{r['file']}]"
        )
    report: dict[str, object] = {"timing": result}
    if args.deviation:
        report["deviation"] = deviation(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
