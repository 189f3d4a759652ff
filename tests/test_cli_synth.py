"""``cosyvoice3-synth`` writes a readable 24 kHz mono PCM16 WAV and reports timings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from wyoming_cosyvoice3.engine.cli import build_parser, main


def _listing(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory``: relative path -> (size, mtime_ns)."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_cli_writes_24k_pcm16_wav(tiny_model_dir: Path, tiny_engine_cache: Path, make_clip,
                                  tmp_path: Path, capsys) -> None:
    clip = make_clip(tmp_path / "ref.wav", seconds=2.5, sample_rate_hz=44100, channels=2)
    out = tmp_path / "out" / "hello.wav"
    model_files = _listing(tiny_model_dir)
    code = main(
        [
            "--model-dir", str(tiny_model_dir),
            "--clip", str(clip),
            "--transcript", "A short reference clip.",
            "--text", "Hello from the command line.",
            "--out", str(out),
            "--seed", "3",
            "--llm-precision", "fp32",
            "--threads", "1",
            # the session's engine cache: the tiny model's derivations are tried once per
            # session. Whether they are made now or were made before, the engine reads and
            # writes them only in --cache-dir: without it (or with the model directory as its
            # cache) they would be written next to the model files, which the listing catches
            "--cache-dir", str(tiny_engine_cache),
        ]
    )  # fmt: skip
    assert code == 0
    # derived files go to --cache-dir, never into the shared model directory
    assert _listing(tiny_model_dir) == model_files
    assert list(tiny_engine_cache.glob("flow.decoder.estimator.*.onnx"))
    info = sf.info(str(out))
    assert info.samplerate == 24000 and info.channels == 1 and info.subtype == "PCM_16"
    data, rate = sf.read(str(out), dtype="int16")
    assert rate == 24000 and data.ndim == 1
    assert info.frames > 0 and info.frames % 480 == 0
    assert np.any(data != 0)
    printed = capsys.readouterr().out
    for label in ("first chunk:", "RTF", "LLM prefill:", "ms/token", "flow:", "vocoder:"):
        assert label in printed


def test_cli_one_shot_and_speed(tiny_model_dir: Path, tiny_engine_cache: Path, make_clip,
                                tmp_path: Path) -> None:
    clip = make_clip(tmp_path / "ref.wav", seconds=2.0)
    base = ["--model-dir", str(tiny_model_dir), "--clip", str(clip), "--text", "Hi there."]
    # the session's engine cache (where derived files go is the test above)
    base += ["--llm-precision", "fp32", "--threads", "1", "--cache-dir", str(tiny_engine_cache)]
    out1, out2 = tmp_path / "a.wav", tmp_path / "b.wav"
    assert main([*base, "--out", str(out1), "--no-streaming", "--seed", "1"]) == 0
    assert main([*base, "--out", str(out2), "--no-streaming", "--seed", "1", "--speed", "2"]) == 0
    n1, n2 = sf.info(str(out1)).frames, sf.info(str(out2)).frames
    assert abs(n2 - n1 / 2) <= 480


def test_cli_rejects_bad_speed(tmp_path: Path, capsys) -> None:
    args = ["--model-dir", str(tmp_path), "--clip", "x.wav", "--text", "Hi", "--out", "o.wav"]
    assert main([*args, "--speed", "5"]) == 2
    assert "speed" in capsys.readouterr().err


def test_cli_missing_model_is_an_engine_error(tmp_path: Path, make_clip, capsys) -> None:
    clip = make_clip(tmp_path / "ref.wav")
    code = main(
        ["--model-dir", str(tmp_path / "nope"), "--clip", str(clip), "--text", "Hi",
         "--out", str(tmp_path / "o.wav")]
    )  # fmt: skip
    assert code == 1
    assert "nope" in capsys.readouterr().err


def test_parser_defaults() -> None:
    args = build_parser().parse_args(
        ["--model-dir", "m", "--clip", "c.wav", "--text", "t", "--out", "o.wav"]
    )
    assert args.preset == "balanced" and args.llm_precision == "int8" and not args.no_streaming
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-dir", "m"])
