"""Shared fixtures: the tiny synthetic model and speech-like clips.

``tiny_model_dir`` is built once per test session (a few seconds) into a temporary directory:
the published graphs' structure at small widths, so every derived graph the default preset
runs (fused LLM, int8 and fp32 streaming DiT, streamed vocoder) derives from
it. Tests must not modify it; copy files first (see ``tiny_model_copy``).

Engines on it are loaded once per session and shared read-only (``engine_support.py``):
``bare_engine`` / ``bare_model`` / ``bare_voice`` and one engine per preset
(``engine_quality``, ``engine_balanced``, ``engine_fast``). The parity fixture set is
``parity``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from engine_support import TinyEngines
from parity_support import Parity, derived_cache_dir, load_parity

from synthetic import build_synthetic_model
from synthetic.audio import write_clip
from wyoming_cosyvoice3.engine import CosyVoice3Engine
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import VoicePrompt

MakeClip = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a synthetic tiny model directory (seed 0), shared by the whole session."""
    return build_synthetic_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One engine cache for the servers and engines on ``tiny_model_dir`` whose tests are not
    about loading (``server_support.make_settings(..., engine_cache=...)``, servers started as
    a program through ``link_engine_cache``, ``--cache-dir`` of the command lines, and
    ``tiny_dit_cache_dir``): the derived graphs of the tiny model (fused LLM, fp32 and int8
    streaming DiT, streamed vocoder; each made in a child process) are made once per session
    and later starts read them. Tests of a first start or of the derivations
    use their own data dir."""
    return tmp_path_factory.mktemp("tiny_engine_cache")


@pytest.fixture(scope="session")
def tiny_dit_model_dir(tiny_model_dir: Path) -> Path:
    """``tiny_model_dir`` under the name the DiT-derivation tests use (the tiny model's DiT
    is the upstream architecture, so the fp32 and int8 streaming DiT derive from it)."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def tiny_dit_cache_dir(tiny_engine_cache: Path) -> Path:
    """The cache directory of derived graphs for the engines of the session that only use
    those graphs (fp32 and int8 streaming DiT, streamed vocoder, fused LLM):
    ``tiny_engine_cache`` itself, so a graph the servers derived is not derived again
    for an engine built in the test process (derived names are keyed by the source file's
    size and mtime, so both find the same files). Tests that check the derivation itself
    (files written, markers, counts) use a private ``tmp_path`` instead."""
    return tiny_engine_cache


@pytest.fixture(scope="session")
def tiny_engines(tiny_model_dir: Path, tiny_engine_cache: Path) -> Iterator[TinyEngines]:
    """The session's engines on ``tiny_model_dir``, one per load options (``engine_support.py``):
    shared read-only; a test changes one only through ``monkeypatch`` or
    ``decoding_support.fixed_decoding``, which restore it."""
    engines = TinyEngines(tiny_model_dir, tiny_engine_cache)
    yield engines
    engines.close()


@pytest.fixture(scope="session")
def bare_engine(tiny_engines: TinyEngines) -> CosyVoice3Engine:
    """The tiny model without a cache directory: the published graphs, the LLM in fp32."""
    return tiny_engines.bare()


@pytest.fixture(scope="session")
def bare_model(bare_engine: CosyVoice3Engine) -> CosyVoice3Model:
    """The model of ``bare_engine`` (its graphs and tokenizer), for the stage tests."""
    return bare_engine.model


@pytest.fixture(scope="session")
def bare_voice(bare_engine: CosyVoice3Engine,
               tmp_path_factory: pytest.TempPathFactory) -> VoicePrompt:
    """A 3 s speech-like reference clip prepared by ``bare_engine``."""
    clip = write_clip(tmp_path_factory.mktemp("clip") / "ref.wav", seconds=3.0)
    return bare_engine.prepare_voice(clip, transcript="This is a reference clip.", name="test")


@pytest.fixture(scope="session")
def engine_quality(tiny_engines: TinyEngines) -> CosyVoice3Engine:
    """The engine a server on ``quality`` loads (fp32 streaming DiT, shared engine cache)."""
    return tiny_engines.preset("quality")


@pytest.fixture(scope="session")
def engine_balanced(tiny_engines: TinyEngines) -> CosyVoice3Engine:
    """The engine a server on ``balanced`` loads (int8 streaming DiT, shared engine cache)."""
    return tiny_engines.preset("balanced")


@pytest.fixture(scope="session")
def engine_fast(tiny_engines: TinyEngines) -> CosyVoice3Engine:
    """The engine a server on ``fast`` loads (int8 streaming DiT, shared engine cache)."""
    return tiny_engines.preset("fast")


@pytest.fixture(scope="session")
def parity() -> Parity:
    """The parity fixture set (``parity_support.load_parity``: skips or fails with the
    reason when it is missing)."""
    return load_parity()


@pytest.fixture(scope="session")
def parity_streaming_files(parity: Parity) -> tuple[Path, Path]:
    """The fp32 streaming DiT (main and time graphs) of the parity model, derived in this
    process into the set's shared cache directory."""
    from wyoming_cosyvoice3.engine.derive.flow.streaming_estimator import (
        ensure_streaming_estimator,
    )

    return ensure_streaming_estimator(parity.model_dir / "flow.decoder.estimator.fp32.onnx",
                                      derived_cache_dir(parity), "fp32", in_process=True)


@pytest.fixture
def tiny_model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model directory that a test may modify or break."""
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    return target


@pytest.fixture
def make_clip() -> MakeClip:
    """Callable writing a speech-like clip with soundfile and returning its path.

    ``make_clip(path, seconds=3.0, sample_rate_hz=24000, channels=1, subtype="PCM_16",
    f0_hz=150.0, seed=0)``; the format follows the suffix of ``path``.
    """

    def _make(
        path: Path,
        seconds: float = 3.0,
        sample_rate_hz: int = 24000,
        channels: int = 1,
        subtype: str = "PCM_16",
        f0_hz: float = 150.0,
        seed: int = 0,
    ) -> Path:
        return write_clip(
            Path(path),
            seconds=seconds,
            sample_rate_hz=sample_rate_hz,
            channels=channels,
            subtype=subtype,
            f0_hz=f0_hz,
            seed=seed,
        )

    return _make


TOOLING_PREFIXES = ("test_bench_", "test_synthetic_")
"""Test files of the benchmark and the synthetic builder (marker ``tooling``, pyproject.toml)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of bench/ and synthetic/ ``tooling`` by their file name."""
    for item in items:
        if item.path.name.startswith(TOOLING_PREFIXES):
            item.add_marker(pytest.mark.tooling)
