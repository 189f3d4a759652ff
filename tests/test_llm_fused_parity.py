"""The fused LLM graph on the upstream-exported parity model (torch export of CosyVoice3LM,
small dims): derived by structure from both published files and checked against upstream's
teacher-forced log-probs (``refs/llm.npz``). Skipped when ``../shared/parity`` is absent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wyoming_cosyvoice3.engine.derive.llm_fused import ensure_fused_llm
from wyoming_cosyvoice3.engine.errors import ModelLoadError
from wyoming_cosyvoice3.engine.llm.decoder import LlmDecoder
from wyoming_cosyvoice3.engine.model import CosyVoice3Model
from wyoming_cosyvoice3.engine.options import EngineOptions
from wyoming_cosyvoice3.engine.types import LlmPrompt

PARITY = Path(__file__).resolve().parents[1].parent / "shared" / "parity"
if not PARITY.is_dir():
    PARITY = Path("/work/shared/parity")
pytestmark = pytest.mark.skipif(not (PARITY / "refs").is_dir(), reason="no parity fixtures")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct"])
def test_parity_fused_fp32_graph_reproduces_upstream_log_probs(mode: str, tmp_path: Path) -> None:
    refs = np.load(PARITY / "refs" / "llm.npz")
    tolerance = json.loads((PARITY / "refs" / "manifest.json").read_text())["tolerances"]
    model = CosyVoice3Model.load(
        PARITY / "model",
        EngineOptions(llm_precision="fp32", llm_graph="fused", cache_dir=tmp_path),
    )
    assert model.llm.path.parent == tmp_path  # the fused graph, not the fallback
    decoder = LlmDecoder(model)
    prompt = LlmPrompt(
        refs[f"{mode}_prompt_text_ids"],
        refs[f"{mode}_tts_text_ids"],
        refs[f"{mode}_prompt_speech_tokens"],
        mode,  # type: ignore[arg-type]
    )
    state, logits, _ = decoder.prefill_prompt(prompt)
    rows = [_log_softmax(logits)]
    for token in refs["forced_tokens"]:
        rows.append(_log_softmax(decoder.step(state, int(token))))
    error = np.abs(np.array(rows) - refs[f"{mode}_logp"]).max()
    assert error < tolerance["llm_log_probs"]


def test_parity_fused_int8_graph_passes_validation_and_q4_is_refused(tmp_path: Path) -> None:
    """int8: the structure check (float activations) agrees to rounding, and the deployed
    graph is within the published graph's own activation-quantisation error. q4: this model
    (weights x8 in the head) loses more than that, so validation refuses it."""
    source = PARITY / "model" / "llm_int8.onnx"
    _, report = ensure_fused_llm(source, tmp_path, "fused")
    assert report.structure_max_abs_logp < 1e-4
    assert report.max_abs_logp < report.int8_noise_max_abs_logp
    with pytest.raises(ModelLoadError, match="differs from it"):
        ensure_fused_llm(source, tmp_path, "fused-q4")
