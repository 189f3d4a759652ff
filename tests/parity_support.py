"""Locating and reading the upstream parity fixtures (``<repo root>/../shared/parity``).

The fixture set holds reference outputs of upstream CosyVoice3 (PyTorch, random weights) and
the ONNX model exported from the same modules; its ``refs/manifest.json`` describes every array
(shape, meaning, the project function to compare with) and gives the tolerances per kind of
array (``tolerances``) and the cases (``llm_cases``, ``flow_cases``). Tests read all of that
from here, never as literals, so that another set generated the same way (other seeds, prompt
lengths, texts) passes unchanged.

A clone without the fixtures still passes: :func:`load_parity` skips the calling test (or
module) with a reason that says what is missing and where it was looked for.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PARITY_DIR = REPO_ROOT.parent / "shared" / "parity"
"""Where the fixture set is looked for: ``<repo root>/../shared/parity``."""
IDENTICAL = "identical"
"""Manifest tolerance meaning exact equality (ids, tokens, noise buffers, chunk bounds)."""
REF_FILES = ("features.npz", "llm.npz", "flow.npz")


@dataclass
class Parity:
    """One fixture set: manifest, lazily loaded reference arrays, model and clip folders."""

    root: Path
    manifest: dict[str, Any]
    _arrays: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def model_dir(self) -> Path:
        """The upstream-structured ONNX model directory (``model/``)."""
        return self.root / "model"

    @property
    def refs_dir(self) -> Path:
        return self.root / "refs"

    @property
    def voices_dir(self) -> Path:
        """Folder of the reference clips (``<parity>/../voices``)."""
        return self.root.parent / "voices"

    def refs(self, file_name: str) -> Any:
        """The loaded ``refs/<file_name>`` (an ``NpzFile``), cached; skips when absent."""
        if file_name not in self._arrays:
            path = self.refs_dir / file_name
            if not path.is_file():
                pytest.skip(f"parity fixtures: {path} is missing")
            self._arrays[file_name] = np.load(path, allow_pickle=False)
        return self._arrays[file_name]

    def array(self, file_name: str, key: str) -> np.ndarray:
        """One reference array; fails (not skips) when the manifest names a key the file lacks."""
        stored = self.refs(file_name)
        assert key in stored.files, f"refs/{file_name} has no array {key!r}"
        return np.asarray(stored[key])

    def entry(self, file_name: str, key: str) -> dict[str, Any]:
        """The manifest's description of ``refs/<file_name>[key]``."""
        entries = self.manifest.get("files", {}).get(file_name, {})
        assert key in entries, f"manifest describes no {file_name}:{key}"
        return dict(entries[key])

    def keys(self, file_name: str) -> list[str]:
        """Array names the manifest describes for ``file_name``, in manifest order."""
        return list(self.manifest.get("files", {}).get(file_name, {}))

    def tolerance(self, kind: str) -> float:
        """Max abs error allowed for ``kind`` (``tolerances`` in the manifest); 0 = identical."""
        tolerances = self.manifest.get("tolerances", {})
        assert kind in tolerances, f"manifest has no tolerance {kind!r}: {sorted(tolerances)}"
        value = tolerances[kind]
        if value == IDENTICAL:
            return 0.0
        return float(value)

    @property
    def llm_cases(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest.get("llm_cases", {}))

    @property
    def flow_cases(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest.get("flow_cases", {}))

    @property
    def request_seed(self) -> int:
        """Request seed whose noise buffers upstream used (``seeds``)."""
        return int(self.manifest["seeds"]["request_seed_of_noise_buffers"])

    @cached_property
    def feature_clips(self) -> dict[str, Path]:
        """``{prefix: clip path}`` of ``features.npz`` (``zh_wav16k`` -> prefix ``zh``).

        The clip is the audio file named in the manifest's meaning of ``<prefix>_wav16k``.
        """
        clips: dict[str, Path] = {}
        for key in self.keys("features.npz"):
            if not key.endswith("_wav16k"):
                continue
            prefix = key[: -len("_wav16k")]
            meaning = self.entry("features.npz", key)["meaning"]
            match = re.search(r"[\w.-]+\.(?:wav|flac|ogg|mp3)", meaning)
            assert match, f"manifest meaning of {key} names no clip file"
            clips[prefix] = self.voices_dir / match.group(0)
        return clips


def _skip(reason: str) -> NoReturn:
    pytest.skip(f"parity fixtures not available: {reason}")


_CACHE: dict[Path, Parity] = {}


def load_parity(root: Path = PARITY_DIR) -> Parity:
    """The fixture set at ``root``; skips the caller when it is absent or incomplete.

    Skips (never fails) when ``root``, its ``refs/manifest.json`` or ``model/`` is missing or
    the manifest is not JSON; a present but inconsistent set fails in the tests instead.
    """
    root = Path(root).resolve() if Path(root).exists() else Path(root)
    if root in _CACHE:
        return _CACHE[root]
    if not root.is_dir():
        _skip(f"{root} does not exist (expected <repo root>/../shared/parity)")
    manifest_path = root / "refs" / "manifest.json"
    if not manifest_path.is_file():
        _skip(f"{manifest_path} is missing")
    if not (root / "model").is_dir():
        _skip(f"{root / 'model'} is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        _skip(f"{manifest_path} cannot be read ({err})")
    parity = Parity(root=root, manifest=manifest)
    _CACHE[root] = parity
    return parity


def parity_cases(kind: str, root: Path = PARITY_DIR) -> list[str]:
    """Case names for ``pytest.mark.parametrize`` at collection time (no skip here).

    ``kind``: ``"llm"`` (modes of ``llm_cases``), ``"flow"`` (``flow_cases``) or
    ``"features"`` (clip prefixes of ``features.npz``). Without fixtures it returns
    ``["absent"]`` so the test is collected and then skips through :func:`load_parity`.
    """
    manifest_path = Path(root) / "refs" / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ["absent"]
    if kind == "llm":
        names = list(manifest.get("llm_cases", {}))
    elif kind == "flow":
        names = list(manifest.get("flow_cases", {}))
    elif kind == "features":
        names = [
            key[: -len("_wav16k")]
            for key in manifest.get("files", {}).get("features.npz", {})
            if key.endswith("_wav16k")
        ]
    else:
        raise ValueError(f"unknown parity case kind {kind!r}")
    return names or ["absent"]


def max_abs(actual: Any, expected: Any) -> float:
    """Largest absolute difference (float64); shapes must agree."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != reference shape {b.shape}"
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)))


def assert_close(actual: Any, expected: Any, tolerance: float, what: str) -> float:
    """Assert ``max|actual - expected| <= tolerance``; prints and returns the measured error.

    The printed line (``PARITY <what>: max_abs ... tol ...``; shown with ``pytest -s``) is the
    record of how far the engine is from upstream on this fixture set.
    """
    error = max_abs(actual, expected)
    print(f"PARITY {what}: max_abs {error:.3g} tol {tolerance:.3g}")
    assert np.isfinite(error) and error <= tolerance, (
        f"{what}: max abs error {error:.3g} exceeds the manifest tolerance {tolerance:.3g}"
    )
    return error


def assert_identical(actual: Any, expected: Any, what: str) -> None:
    """Assert exact equality of id/token sequences, with the first differing position."""
    a = np.asarray(actual).reshape(-1)
    b = np.asarray(expected).reshape(-1)
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and a.shape == b.shape:
        print(f"PARITY {what}: identical ({b.shape[0]} values)")
        return
    where = first if first is not None else min(a.shape[0], b.shape[0])
    raise AssertionError(
        f"{what}: differs from upstream at position {where} (lengths {a.shape[0]} vs "
        f"{b.shape[0]}): engine {a[where : where + 5].tolist()} vs upstream "
        f"{b[where : where + 5].tolist()}"
    )


_ENGINES: dict[Path, Any] = {}
_ENGINE_DIRS: list[tempfile.TemporaryDirectory[str]] = []


def parity_engine(parity: Parity) -> Any:
    """The engine loaded on ``parity.model_dir`` once per test process.

    fp32 LLM (the references are fp32 PyTorch; ``llm_int8.onnx`` has none) and a private
    ``cache_dir``, so the exact engine-level levers the server uses with ``quality`` (the
    streaming DiT serving the full-attention passes too: ``flow_chunk_causal``; the
    memory-mapped text table where the graph allows it) are on and nothing is written into
    the shared fixture directory. (test_parity_flow_chunked.py's engine keeps the split
    published estimator for full attention, so both paths meet upstream's references.)
    """
    if parity.root not in _ENGINES:
        from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions

        cache = tempfile.TemporaryDirectory(prefix="parity-cache-")
        _ENGINE_DIRS.append(cache)
        options = EngineOptions(llm_precision="fp32", cache_dir=Path(cache.name),
                                flow_chunk_causal=True)
        _ENGINES[parity.root] = CosyVoice3Engine.load(parity.model_dir, options)
    return _ENGINES[parity.root]


def flow_case_voice(flow_refs: Any, case: str) -> Any:
    """The flow's :class:`VoiceFeatures` of ``case`` from ``refs/flow.npz`` (prompt tokens,
    speaker embedding, prompt mel), as the chunk-causal parity tests use them."""
    from wyoming_cosyvoice3.engine.types import VoiceFeatures

    return VoiceFeatures(
        speech_tokens=np.asarray(flow_refs[f"{case}_prompt_tokens"], dtype=np.int64),
        speaker_embedding=np.asarray(flow_refs[f"{case}_embedding"], dtype=np.float32),
        prompt_mel=np.asarray(flow_refs[f"{case}_prompt_mel"], dtype=np.float32),
    )
