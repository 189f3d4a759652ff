"""The download's file list agrees with the engine's, and a downloaded directory loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_mimic import HubMimic, repos_from_dir

from wyoming_cosyvoice3.download import EXPORT_REPO, UPSTREAM_REPO, ensure_model, model_files
from wyoming_cosyvoice3.engine.model import CosyVoice3Model, required_files
from wyoming_cosyvoice3.engine.options import LLM_FILES, EngineOptions

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("precision", sorted(LLM_FILES))
def test_download_list_is_engine_requirements_plus_voices(precision: str) -> None:
    downloaded = {f.filename for f in model_files(precision)}
    engine = set(required_files(precision))
    assert engine <= downloaded
    assert downloaded - engine == {"voices/zh-female.wav", "voices/en-male.wav"}


def test_downloaded_synthetic_model_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    repos = repos_from_dir(tiny_model_dir, EXPORT_REPO, UPSTREAM_REPO)
    assert set(repos[UPSTREAM_REPO]) == {
        "campplus.onnx",
        "speech_tokenizer_v3.onnx",
        "flow.decoder.estimator.fp32.onnx",
    }
    target = tmp_path / "downloaded"
    with HubMimic(repos) as hub:
        ensure_model(target, "q4", endpoint=hub.endpoint, progress=False)
    for file in model_files("q4"):
        assert (target / file.filename).read_bytes() == (
            tiny_model_dir / file.filename
        ).read_bytes()
    model = CosyVoice3Model.load(target, EngineOptions(llm_precision="q4"))
    assert (
        model.dims == CosyVoice3Model.load(tiny_model_dir, EngineOptions(llm_precision="q4")).dims
    )
