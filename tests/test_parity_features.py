"""Parity of the voice-prompt features with upstream CosyVoice3 (frontend.py).

References: ``refs/features.npz`` of the fixture set (see its ``manifest.json``;
``parity_support`` says which set): for each clip of the set's voices folder, upstream's 16
and 24 kHz waveforms (``load_wav``: torchaudio ``Resample`` defaults), the Whisper log-mel,
the mean-normalised Kaldi fbank and the 24 kHz prompt mel, each computed by upstream from its
own waveform. Each feature is compared twice: from upstream's waveform (the feature math alone)
and from the clip file with the engine's own loading and resampling (the full path). A clip
the manifest names but the voices folder lacks makes the set partial: the test fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parity_support import (
    Parity,
    assert_close,
    assert_identical,
    parity_cases,
    parity_engine,
)

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.voice import features as F
from wyoming_cosyvoice3.engine.voice.audio_io import load_clip, resample

FEATURES = "features.npz"
CLIPS = parity_cases("features")
RATES_HZ = {"wav16k": C.FEATURE_SAMPLE_RATE_HZ, "wav24k": C.OUTPUT_SAMPLE_RATE_HZ}
# feature name in features.npz -> (tolerance kind, engine function, waveform it is computed from)
FEATURE_FUNCTIONS = {
    "whisper_logmel": ("features_whisper_log_mel", F.whisper_log_mel, "wav16k"),
    "fbank": ("features_fbank", F.kaldi_fbank, "wav16k"),
    "prompt_mel": ("features_prompt_mel", F.prompt_mel, "wav24k"),
}


def _clip(parity: Parity, prefix: str) -> Path:
    path = parity.feature_clips.get(prefix)
    assert path is not None, f"manifest names no clip for {prefix}_wav16k"
    if not path.is_file():
        pytest.fail(f"parity fixture set is partial: clip {path} (named by the manifest's "
                    f"{prefix}_wav16k) is missing", pytrace=False)
    return path


def _engine_waveforms(parity: Parity, prefix: str) -> dict[str, np.ndarray]:
    samples, rate_hz = load_clip(_clip(parity, prefix))
    return {name: resample(samples, rate_hz, to_hz) for name, to_hz in RATES_HZ.items()}


@pytest.mark.parametrize("prefix", CLIPS)
def test_parity_resampled_waveforms(parity: Parity, prefix: str) -> None:
    """``load_clip`` + ``resample`` give upstream's ``load_wav`` waveforms at 16 and 24 kHz."""
    waveforms = _engine_waveforms(parity, prefix)
    for name, samples in waveforms.items():
        assert_close(
            samples,
            parity.array(FEATURES, f"{prefix}_{name}"),
            parity.tolerance("resampled_waveform"),
            f"{prefix} {name}",
        )


@pytest.mark.parametrize("prefix", CLIPS)
def test_parity_features_from_upstream_waveforms(parity: Parity, prefix: str) -> None:
    """The feature math alone: each feature of upstream's own resampled waveform."""
    for name, (kind, function, source) in FEATURE_FUNCTIONS.items():
        wave = parity.array(FEATURES, f"{prefix}_{source}").astype(np.float32)
        assert_close(
            function(wave),
            parity.array(FEATURES, f"{prefix}_{name}"),
            parity.tolerance(kind),
            f"{prefix} {name} (upstream waveform)",
        )


@pytest.mark.parametrize("prefix", CLIPS)
def test_parity_features_full_path(parity: Parity, prefix: str) -> None:
    """From the clip file: the engine's loading and resampling, then each feature."""
    waveforms = _engine_waveforms(parity, prefix)
    for name, (kind, function, source) in FEATURE_FUNCTIONS.items():
        assert_close(
            function(waveforms[source]),
            parity.array(FEATURES, f"{prefix}_{name}"),
            parity.tolerance(kind),
            f"{prefix} {name} (full path)",
        )


def _zero_shot_cases(parity: Parity) -> list[tuple[str, dict[str, Any]]]:
    return [
        (mode, case)
        for mode, case in parity.llm_cases.items()
        if parity.array("llm.npz", f"{mode}_prompt_speech_tokens").size
    ]


def test_parity_prepared_voice_matches_upstream_prompt(parity: Parity) -> None:
    """``prepare_voice`` on the clip: upstream's prompt speech tokens and aligned prompt mel.

    Upstream's tokens come from its own features through ``model/speech_tokenizer_v3.onnx``;
    the engine computes everything from the clip file (resampling included).
    """
    cases = _zero_shot_cases(parity)
    assert cases, "the manifest has no llm case with prompt speech tokens"
    engine = parity_engine(parity)
    clips = {path.name: (prefix, path) for prefix, path in parity.feature_clips.items()}
    for mode, case in cases:
        prefix, path = clips[case["clip"]]
        voice = engine.prepare_voice(_clip(parity, prefix), transcript=case["transcript"])
        tokens = parity.array("llm.npz", f"{mode}_prompt_speech_tokens")
        assert_identical(voice.features.speech_tokens, tokens, f"{mode} prompt speech tokens")
        frames = parity.token_mel_ratio(next(iter(parity.flow_cases))) * tokens.size
        mel = parity.array(FEATURES, f"{prefix}_prompt_mel")[:frames]
        assert_close(
            voice.features.prompt_mel,
            mel,
            parity.tolerance("features_prompt_mel"),
            f"{prefix} aligned prompt mel ({path.name})",
        )
