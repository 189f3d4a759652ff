"""Locating and reading the upstream parity fixtures.

A fixture set holds reference outputs of upstream CosyVoice3 (PyTorch, random weights) and
the ONNX model exported from the same modules; its ``refs/manifest.json`` describes every array
(shape, meaning, the project function to compare with) and gives the tolerances per kind of
array (``tolerances``), the cases (``llm_cases``, ``flow_cases``), the dimensions and flow
settings (``dims``) and the seeds (``seeds``). Tests read all of that from here, never as
literals, so that another set generated the same way (other seeds, prompt lengths, texts,
widths) passes unchanged.

Which set (:func:`parity_root`), first match wins:

1. ``COSYVOICE3_PARITY_DIR=<path>``: that set, explicitly (e.g. a second set generated with
   other seeds: ``COSYVOICE3_PARITY_DIR=ALT_DIR python -m pytest -q -k parity``);
   a missing explicit set fails.
2. ``<repo root>/../shared/parity`` when that directory exists (the full set);
3. ``tests/fixtures/parity`` (the compact set committed with the repository).

Clips (``Parity.voices_dir``): the set's own ``voices/`` when present, else ``<root>/../voices``.

Missing and partial sets (:func:`load_parity`):

* a missing set (no directory, or no ``refs/manifest.json``) skips the calling test with the
  reason, except in CI (``CI`` set to a true value) or with ``COSYVOICE3_REQUIRE_PARITY=1``,
  where it fails;
* a partial set (a manifest that is not JSON, ``model/`` missing, a file of ``refs/`` or an
  array the manifest describes missing) always fails.

Derived graphs (streaming DiT, fused LLM, split estimator, phase vocoder) go to one cache
directory per set and process (:func:`derived_cache_dir`), and the engines are loaded once per
set and configuration (:func:`parity_engine`).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_PARITY_DIR = REPO_ROOT.parent / "shared" / "parity"
"""The full fixture set, used when present: ``<repo root>/../shared/parity``."""
COMMITTED_PARITY_DIR = REPO_ROOT / "tests" / "fixtures" / "parity"
"""The compact set committed with the repository, used when the shared one is absent."""
PARITY_DIR_ENV = "COSYVOICE3_PARITY_DIR"
"""Environment variable selecting a fixture set explicitly (overrides both defaults)."""
REQUIRE_ENV = "COSYVOICE3_REQUIRE_PARITY"
"""``1``: a missing fixture set fails instead of skipping (as with ``CI`` set)."""
TRUE_VALUES = ("1", "true", "yes", "on")
IDENTICAL = "identical"
"""Manifest tolerance meaning exact equality (ids, tokens, noise buffers, chunk bounds)."""
REF_FILES = ("features.npz", "llm.npz", "flow.npz")


def parity_root() -> Path:
    """The fixture set the parity tests use (see the module docstring), read at call time."""
    override = os.environ.get(PARITY_DIR_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    if SHARED_PARITY_DIR.is_dir():
        return SHARED_PARITY_DIR
    return COMMITTED_PARITY_DIR


PARITY_DIR = parity_root()
"""The set chosen when this module was imported (for modules that need a path at import)."""


def parity_required() -> bool:
    """True when a missing fixture set must fail: ``CI`` true or ``COSYVOICE3_REQUIRE_PARITY``."""
    return any(
        os.environ.get(name, "").strip().lower() in TRUE_VALUES for name in ("CI", REQUIRE_ENV)
    )


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
        """Folder of the reference clips: the set's own ``voices/`` when present, else
        ``<root>/../voices``."""
        own = self.root / "voices"
        return own if own.is_dir() else self.root.parent / "voices"

    def refs(self, file_name: str) -> Any:
        """The loaded ``refs/<file_name>`` (an ``NpzFile``), cached; fails when absent (a
        partial set: :func:`load_parity` checked the files it knows of)."""
        if file_name not in self._arrays:
            path = self.refs_dir / file_name
            if not path.is_file():
                _partial(f"{path} is missing")
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

    @property
    def flow_dims(self) -> dict[str, Any]:
        """``dims.flow`` of the manifest (``euler_steps``, ``cfg_rate``, ``dit``, ...)."""
        return dict(self.manifest["dims"]["flow"])

    @property
    def dit(self) -> dict[str, Any]:
        """``dims.flow.dit``: dim, depth, heads, dim_head, static_chunk_size, ..."""
        return dict(self.flow_dims["dit"])

    @property
    def euler_steps(self) -> int:
        return int(self.flow_dims["euler_steps"])

    @property
    def cfg_rate(self) -> float:
        return float(self.flow_dims["cfg_rate"])

    def flow_case(self, case: str) -> dict[str, Any]:
        """``flow_cases.<case>`` of the manifest."""
        assert case in self.flow_cases, f"manifest has no flow case {case!r}"
        return dict(self.flow_cases[case])

    def lookahead_tokens(self, case: str) -> int:
        """Tokens of upstream's pre-lookahead layer, from the case's streamed flow calls: a
        non-final call on ``n`` tokens yields ``ratio x (n - lookahead)`` new frames."""
        ratio = self.token_mel_ratio(case)
        for n_tokens, finalize, _masked, frames in self.flow_case(case)["stream_full"][
            "flow_calls"
        ]:
            if not finalize:
                return int(n_tokens) - int(frames) // ratio
        raise AssertionError(f"flow case {case}: no non-final streamed flow call")

    def token_mel_ratio(self, case: str) -> int:
        """Mel frames per speech token: prompt mel rows / prompt tokens of ``case``."""
        frames = int(self.entry("flow.npz", f"{case}_prompt_mel")["shape"][0])
        tokens = int(self.flow_case(case)["prompt_tokens"])
        assert frames % tokens == 0, f"flow case {case}: {frames} mel rows for {tokens} tokens"
        return frames // tokens

    def cacheable_prompt_frames(self, case: str) -> int:
        """Prompt frames a chunk-causal prompt cache can hold for ``case``, from the manifest:
        whole ``static_chunk_size`` chunks that end before the prompt's lookahead frames (the
        last ``lookahead`` prompt tokens' mu depends on the generated tokens)."""
        chunk = int(self.dit["static_chunk_size"])
        ratio = self.token_mel_ratio(case)
        usable = ratio * (int(self.flow_case(case)["prompt_tokens"]) - self.lookahead_tokens(case))
        return max(0, usable // chunk * chunk)

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


def _missing(reason: str, explicit: bool = False) -> NoReturn:
    """Skip (or fail, in CI / with ``COSYVOICE3_REQUIRE_PARITY=1`` / for an explicitly
    selected set) because the fixture set is not there."""
    message = f"parity fixtures not available: {reason}"
    if explicit:
        pytest.fail(f"{message} (selected by {PARITY_DIR_ENV})", pytrace=False)
    if parity_required():
        pytest.fail(f"{message} (required: CI or {REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(message)


def _partial(reason: str) -> NoReturn:
    """Fail: the set is there but incomplete (never a skip: it would hide a broken set)."""
    pytest.fail(f"parity fixture set is partial: {reason}", pytrace=False)


_CACHE: dict[Path, Parity] = {}


def _check_complete(root: Path, manifest: dict[str, Any]) -> None:
    """Fail unless ``model/``, every ``refs/`` file and every array the manifest describes
    exist (reads the npz directories only)."""
    if not (root / "model").is_dir():
        _partial(f"{root / 'model'} is missing")
    described = manifest.get("files", {})
    for file_name in sorted({*REF_FILES, *described}):
        path = root / "refs" / file_name
        if not path.is_file():
            _partial(f"{path} is missing")
        with np.load(path, allow_pickle=False) as stored:
            absent = sorted(set(described.get(file_name, {})) - set(stored.files))
        if absent:
            _partial(f"{path} lacks the arrays the manifest describes: {absent}")


def load_parity(root: Path | None = None) -> Parity:
    """The fixture set at ``root`` (default :func:`parity_root`), checked once per process.

    A missing set (no ``root``, or no ``refs/manifest.json``) skips the caller with the
    reason, or fails when :func:`parity_required` or when the set was selected with
    ``COSYVOICE3_PARITY_DIR``; a partial set (manifest not JSON, ``model/``, a ``refs/`` file
    or a described array missing) fails.
    """
    explicit = root is None and bool(os.environ.get(PARITY_DIR_ENV, "").strip())
    root = parity_root() if root is None else Path(root)
    root = root.resolve() if root.exists() else root
    if root in _CACHE:
        return _CACHE[root]
    where = f"{root} (from {PARITY_DIR_ENV}, else ../shared/parity, else tests/fixtures/parity)"
    if not root.is_dir():
        _missing(f"{where} does not exist", explicit)
    manifest_path = root / "refs" / "manifest.json"
    if not manifest_path.is_file():
        _missing(f"{manifest_path} is missing", explicit)
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        _partial(f"{manifest_path} cannot be read ({err})")
    if not isinstance(manifest, dict):
        _partial(f"{manifest_path} is not a JSON object")
    _check_complete(root, manifest)
    parity = Parity(root=root, manifest=manifest)
    _CACHE[root] = parity
    return parity


def parity_cases(kind: str, root: Path | None = None) -> list[str]:
    """Case names for ``pytest.mark.parametrize`` at collection time (no skip here).

    ``kind``: ``"llm"`` (modes of ``llm_cases``), ``"flow"`` (``flow_cases``) or
    ``"features"`` (clip prefixes of ``features.npz``). Without a readable manifest it returns
    ``["absent"]`` so the test is collected and then skips (or fails) through
    :func:`load_parity`.
    """
    manifest_path = (parity_root() if root is None else Path(root)) / "refs" / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ["absent"]
    if not isinstance(manifest, dict):
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


_DERIVED: dict[Path, Path] = {}
_ENGINES: dict[tuple[Path, bool], Any] = {}


def derived_cache_dir(parity: Parity) -> Path:
    """One cache directory per fixture set and test process, removed at exit: every parity
    engine and every derivation of these tests (streaming DiT, fused LLM, split estimator,
    phase vocoder) writes there, so each graph is derived once per run and nothing is
    written into the (possibly read-only) fixture directory."""
    if parity.root not in _DERIVED:
        path = Path(tempfile.mkdtemp(prefix="parity-derived-"))
        atexit.register(shutil.rmtree, path, True)
        _DERIVED[parity.root] = path
    return _DERIVED[parity.root]


def parity_engine(parity: Parity, *, published_estimator: bool = False) -> Any:
    """The engine loaded on ``parity.model_dir`` once per set, configuration and process
    (fp32 LLM: the references are fp32 PyTorch; ``llm_int8.onnx`` has none), with
    :func:`derived_cache_dir` as ``cache_dir``.

    Default: loaded as the server loads ``quality`` (``flow.chunk_causal``: the streaming DiT
    also serves the full-attention passes; the memory-mapped text table where the graph
    allows it). ``published_estimator``: full attention on the published estimator (loaded
    as if the streaming DiT were not wanted at start, so the estimator is not its
    full-attention form), the chunk-causal flow derived on first use, so both paths meet
    upstream's references.
    """
    key = (parity.root, published_estimator)
    if key not in _ENGINES:
        from unittest import mock

        from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions
        from wyoming_cosyvoice3.engine import model as engine_model
        from wyoming_cosyvoice3.engine.options import FlowPreset

        flow = FlowPreset(chunk_causal=not published_estimator)
        options = EngineOptions(llm_precision="fp32", cache_dir=derived_cache_dir(parity),
                                flow=flow)
        if published_estimator:
            with mock.patch.object(engine_model, "wants_streaming", return_value=False):
                _ENGINES[key] = CosyVoice3Engine.load(parity.model_dir, options)
        else:
            _ENGINES[key] = CosyVoice3Engine.load(parity.model_dir, options)
    return _ENGINES[key]


def faded(reference: np.ndarray) -> np.ndarray:
    """``reference`` times the engine's fade-in gain (upstream's audio has none; README)."""
    from wyoming_cosyvoice3.engine import constants as C
    from wyoming_cosyvoice3.engine.vocoder.hift import fade_in_gain

    fade_samples = round(C.FADE_IN_MS * C.OUTPUT_SAMPLE_RATE_HZ / 1000.0)
    return reference * fade_in_gain(0, reference.shape[0], fade_samples)


def quality_options(parity: Parity, **changes: Any) -> Any:
    """The ``quality`` preset with the set's request seed, Euler steps and CFG rate, then
    ``changes`` (:meth:`SynthesisOptions.replace`).

    Vocoder deferral is off unless changed: deferring follows the wall clock, so with it the
    chunk bounds would depend on how fast the machine is (the audio does not)."""
    from wyoming_cosyvoice3.engine.options import PRESETS

    base = PRESETS["quality"].replace(
        seed=parity.request_seed, vocoder={"defer": False},
        flow={"schedule": {"steps": parity.euler_steps, "cfg_rate": parity.cfg_rate}})
    return base.replace(**changes)


def flow_case_voice(flow_refs: Any, case: str) -> Any:
    """The flow's :class:`VoiceFeatures` of ``case`` from ``refs/flow.npz`` (prompt tokens,
    speaker embedding, prompt mel), as the chunk-causal parity tests use them."""
    from wyoming_cosyvoice3.engine.options import VoiceFeatures

    return VoiceFeatures(
        speech_tokens=np.asarray(flow_refs[f"{case}_prompt_tokens"], dtype=np.int64),
        speaker_embedding=np.asarray(flow_refs[f"{case}_embedding"], dtype=np.float32),
        prompt_mel=np.asarray(flow_refs[f"{case}_prompt_mel"], dtype=np.float32),
    )
