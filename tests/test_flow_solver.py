"""Flow solver math: schedule, CFG, Euler steps, noise alignment, speed resampling."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from wyoming_cosyvoice3.engine.errors import SynthesisCancelled, SynthesisFailed
from wyoming_cosyvoice3.engine.flow.solver import (
    Conditioning,
    FlowCall,
    FlowRunner,
    cfg_combine,
    cosine_t_schedule,
    l2_normalise,
)
from wyoming_cosyvoice3.engine.flow.stream import SpeedResampler, resample_mel_linear
from wyoming_cosyvoice3.engine.noise import GrowingNoise
from wyoming_cosyvoice3.engine.options import EulerSchedule, VoiceFeatures

BINS = 80


def fake_velocity(x, mu, t, spks, cond):
    """A frame-local linear velocity field standing in for the DiT (per batch row)."""
    return 0.5 * x + 2.0 * mu - 0.25 * cond + t[:, None, None] + spks[:, :, None]


class FakeEstimator:
    """Stands in for Graph: same names as the contract, counts calls, optional batch limit."""

    def __init__(self, batch: int | str = "B", reject_batch1: bool = False) -> None:
        self.spec = SimpleNamespace(
            file="flow.decoder.estimator.fp32.onnx",
            inputs={n: "float32" for n in ("x", "mask", "mu", "t", "spks", "cond")},
            outputs={"estimator_out": "float32"},
        )
        self.batch = batch
        self.reject_batch1 = reject_batch1
        self.batches: list[int] = []

    def input_shape(self, name: str) -> list[Any]:
        return [self.batch, BINS, "F"]

    def run(self, feeds, output_names=None):
        b = feeds["x"].shape[0]
        if b == 1 and self.reject_batch1:
            raise SynthesisFailed("batch 1 not accepted")
        assert feeds["mask"].shape == (b, 1, feeds["x"].shape[2])
        assert np.all(feeds["mask"] == 1.0)
        self.batches.append(b)
        v = fake_velocity(feeds["x"], feeds["mu"], feeds["t"], feeds["spks"], feeds["cond"])
        return {"estimator_out": v.astype(np.float32)}


class FakeEncoder:
    """mu[:, 2i] = mu[:, 2i+1] = 0.01 * token_i (+ bin ramp); spks = first 80 of embedding."""

    def __init__(self) -> None:
        self.spec = SimpleNamespace(
            file="flow_encoder.onnx",
            inputs={"token": "int64", "embedding": "float32"},
            outputs={"mu": "float32", "spks": "float32"},
        )
        self.last_embedding: np.ndarray | None = None

    def run(self, feeds, output_names=None):
        tok = feeds["token"][0].astype(np.float32)
        self.last_embedding = feeds["embedding"].copy()
        mu = np.repeat(0.01 * tok, 2)[None, :] + np.linspace(0, 1, BINS)[:, None]
        return {
            "mu": mu[None].astype(np.float32),
            "spks": feeds["embedding"][:, :BINS].astype(np.float32),
        }


def make_runner(**est_kwargs) -> tuple[FlowRunner, FakeEstimator, FakeEncoder]:
    est, enc = FakeEstimator(**est_kwargs), FakeEncoder()
    model = SimpleNamespace(flow_encoder=enc, estimator=est)
    return FlowRunner(model), est, enc  # type: ignore[arg-type]


def make_voice(p_tokens: int = 4, seed: int = 1) -> VoiceFeatures:
    rng = np.random.default_rng(seed)
    return VoiceFeatures(
        speech_tokens=rng.integers(0, 6561, p_tokens).astype(np.int64),
        speaker_embedding=rng.standard_normal(192).astype(np.float32) * 3.0,
        prompt_mel=rng.standard_normal((2 * p_tokens, BINS)).astype(np.float32),
    )


def test_cosine_schedule_values() -> None:
    t = cosine_t_schedule(10)
    assert t.dtype == np.float32 and t.shape == (11,)
    assert t[0] == 0.0 and t[-1] == pytest.approx(1.0, abs=1e-7)
    assert t[5] == pytest.approx(1.0 - math.cos(math.pi / 4), abs=1e-7)  # 0.29289
    assert t[1] == pytest.approx(1.0 - math.cos(math.pi / 20), abs=1e-7)  # 0.01231
    assert np.all(np.diff(t) > 0)
    assert np.allclose(cosine_t_schedule(2), [0.0, 1.0 - math.sqrt(0.5), 1.0], atol=1e-7)
    with pytest.raises(ValueError):
        cosine_t_schedule(0)


# upstream's points, printed by PyTorch 2.13.0 (CPU) from flow_matching.py's two lines:
# torch.linspace(0, 1, n + 1, dtype=torch.float32), then 1 - torch.cos(t * 0.5 * torch.pi)
UPSTREAM_T_HEX = {
    2: ["0x0.0p+0", "0x1.2bec34p-2", "0x1.0p+0"],
    4: ["0x0.0p+0", "0x1.37ca2p-4", "0x1.2bec34p-2", "0x1.3c10ecp-1", "0x1.0p+0"],
    10: ["0x0.0p+0", "0x1.936d8p-7", "0x1.90f1ep-5", "0x1.be6ffp-4", "0x1.872218p-3",
         "0x1.2bec34p-2", "0x1.a61ba4p-2", "0x1.178e8ep-1", "0x1.61c888p-1", "0x1.afe7d2p-1",
         "0x1.0p+0"],
}


@pytest.mark.parametrize("n_steps", sorted(UPSTREAM_T_HEX))
def test_cosine_schedule_equals_upstreams_float32_points(n_steps: int) -> None:
    """Bit for bit, for the presets' step counts: the float64 form rounded once differs by up
    to 6e-8, which a high-f0 vocoder turns into audio errors above the parity tolerance."""
    expected = np.array([float.fromhex(h) for h in UPSTREAM_T_HEX[n_steps]], dtype=np.float32)
    assert np.array_equal(cosine_t_schedule(n_steps), expected)


def test_cfg_combine_arithmetic() -> None:
    v0 = np.array([1.0, 2.0, -3.0], dtype=np.float32)
    v1 = np.array([0.5, 4.0, 1.0], dtype=np.float32)
    out = cfg_combine(v0, v1, 0.7)
    assert np.allclose(out, [1.7 - 0.35, 3.4 - 2.8, -5.1 - 0.7], atol=1e-6)
    assert np.array_equal(cfg_combine(v0, v1, 0.0), v0)


def test_l2_normalise() -> None:
    e = np.array([3.0, 4.0], dtype=np.float32)
    assert np.allclose(l2_normalise(e), [0.6, 0.8])
    assert np.allclose(l2_normalise(l2_normalise(e)), [0.6, 0.8])
    assert np.array_equal(l2_normalise(np.zeros(4)), np.zeros(4, dtype=np.float32))


def test_one_euler_step_matches_hand_computation() -> None:
    runner, est, _ = make_runner()
    rng = np.random.default_rng(0)
    f = 7
    x0, mu, cond = (rng.standard_normal((BINS, f)).astype(np.float32) for _ in range(3))
    spks = rng.standard_normal(BINS).astype(np.float32)
    out = runner.solve(x0, Conditioning(mu, spks, cond), FlowCall(EulerSchedule(1, 0.7)))
    # t0 = 0, dt = 1: conditional and unconditional (mu, spks, cond zeroed) velocities
    v_cond = 0.5 * x0 + 2.0 * mu - 0.25 * cond + 0.0 + spks[:, None]
    v_unc = 0.5 * x0
    expected = x0 + 1.0 * (1.7 * v_cond - 0.7 * v_unc)
    assert np.allclose(out, expected, atol=1e-5)
    assert est.batches == [2]


def test_two_steps_use_the_schedule_and_unguided_steps_run_batch_1() -> None:
    rng = np.random.default_rng(1)
    f = 5
    x0, mu, cond = (rng.standard_normal((BINS, f)).astype(np.float32) for _ in range(3))
    spks = rng.standard_normal(BINS).astype(np.float32)
    given = Conditioning(mu, spks, cond)
    t = [0.0, 1.0 - math.sqrt(0.5), 1.0]

    def step(x, tk, dt, guided):
        vc = 0.5 * x + 2.0 * mu - 0.25 * cond + tk + spks[:, None]
        v = 1.7 * vc - 0.7 * (0.5 * x + tk) if guided else vc
        return x + dt * v

    full = step(step(x0, t[0], t[1] - t[0], True), t[1], t[2] - t[1], True)
    unguided = step(step(x0, t[0], t[1] - t[0], False), t[1], t[2] - t[1], False)
    guided_call, unguided_call = FlowCall(EulerSchedule(2, 0.7)), FlowCall(EulerSchedule(2, 0.0))

    runner, est, _ = make_runner()
    assert np.allclose(runner.solve(x0, given, guided_call), full, atol=1e-5)
    est.batches.clear()
    assert np.allclose(runner.solve(x0, given, unguided_call), unguided, atol=1e-5)
    assert est.batches == [1, 1]  # CFG rate 0: no unconditional row

    # a graph with a fixed batch of 2 gives the same result, always with batch 2
    runner2, est2, _ = make_runner(batch=2)
    assert np.allclose(runner2.solve(x0, given, unguided_call), unguided, atol=1e-5)
    assert est2.batches == [2, 2]
    # a graph that claims a dynamic batch but rejects 1 falls back once and stays on 2
    runner3, est3, _ = make_runner(reject_batch1=True)
    assert np.allclose(runner3.solve(x0, given, unguided_call), unguided, atol=1e-5)
    runner3.solve(x0, given, unguided_call)
    assert est3.batches == [2, 2, 2, 2]


def test_should_stop_checked_before_every_euler_step() -> None:
    runner, est, _ = make_runner()
    calls = {"n": 0}

    def stop_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    x = np.zeros((BINS, 3), dtype=np.float32)
    with pytest.raises(SynthesisCancelled):
        runner.solve(x, Conditioning(x, np.zeros(BINS, np.float32), x),
                     FlowCall(EulerSchedule(10, 0.7), should_stop=stop_after_three))
    assert len(est.batches) == 3


def test_mel_for_tokens_prompt_noise_and_lookahead() -> None:
    runner, _, enc = make_runner()
    voice = make_voice(p_tokens=4)
    noise = GrowingNoise(np.random.default_rng(5), BINS, "normal", block_frames=16)
    buf = noise.take(200).T
    gen = np.arange(100, 120, dtype=np.int64)
    tokens = np.concatenate([voice.speech_tokens, gen])
    three = FlowCall(EulerSchedule(3))
    mel = runner.mel_for_tokens(tokens, voice, buf, three, drop_lookahead_frames=6)
    assert mel.shape == (BINS, 2 * 20 - 6)
    # the encoder got the L2-normalised embedding
    assert np.isclose(np.linalg.norm(enc.last_embedding), 1.0, atol=1e-6)

    # reference, independent of the runner: the fake encoder's mu (each token's value on two
    # frames plus the bin ramp) without the 6 look-ahead frames, spks = the first 80 values of
    # the unit embedding, the prompt mel as condition on the first 8 frames, 3 Euler steps on
    # the cosine schedule with CFG 0.7 (unconditional row: mu, spks, cond zeroed); then the
    # 8 prompt frames are dropped
    frames = 2 * len(tokens) - 6
    mu = (np.repeat(0.01 * tokens.astype(np.float64), 2)[None, :]
          + np.linspace(0, 1, BINS)[:, None])[:, :frames]
    unit = voice.speaker_embedding.astype(np.float64)
    spks = (unit / np.linalg.norm(unit))[:BINS]
    cond = np.zeros((BINS, frames))
    cond[:, :8] = voice.prompt_mel.T
    t = [1.0 - math.cos(k / 3 * math.pi / 2) for k in range(4)]
    x = buf[:, :frames].astype(np.float64)
    for k in range(3):
        v_cond = 0.5 * x + 2.0 * mu - 0.25 * cond + t[k] + spks[:, None]
        v_unc = 0.5 * x + t[k]
        x = x + (t[k + 1] - t[k]) * (1.7 * v_cond - 0.7 * v_unc)
    np.testing.assert_allclose(mel, x[:, 8:], rtol=0, atol=1e-6 * np.abs(x).max())

    # bounded left context: same frames as the whole history (the fake field is frame-local)
    start = 6
    part = np.concatenate([voice.speech_tokens, gen[start:]])
    mel_part = runner.mel_for_tokens(
        part, voice, buf, three, drop_lookahead_frames=6, generated_offset_tokens=start
    )
    assert np.allclose(mel_part, mel[:, 2 * start :], atol=1e-6)

    with pytest.raises(SynthesisFailed):
        runner.mel_for_tokens(tokens, voice, buf[:, :20], FlowCall(EulerSchedule(1)))


def test_growing_noise_prefix_is_stable() -> None:
    a = GrowingNoise(np.random.default_rng(3), 9, "uniform", block_frames=10)
    b = GrowingNoise(np.random.default_rng(3), 9, "uniform", block_frames=10)
    first = a.take(7).copy()
    a.take(25)
    long_a = a.take(40)
    assert np.array_equal(long_a[:7], first)
    assert np.array_equal(b.take(40), long_a)
    assert long_a.dtype == np.float32 and long_a.min() >= 0.0 and long_a.max() < 1.0
    n = GrowingNoise(np.random.default_rng(3), BINS, "normal", block_frames=500).take(500)
    assert abs(float(n.mean())) < 0.02 and abs(float(n.std()) - 1.0) < 0.02


def _torch_like_oracle(mel: np.ndarray, n_out: int, scale: float) -> np.ndarray:
    """F.interpolate(linear, align_corners=False) via np.interp (which clamps at the ends)."""
    src = np.maximum(scale * (np.arange(n_out) + 0.5) - 0.5, 0.0)
    grid = np.arange(mel.shape[1])
    return np.stack([np.interp(src, grid, row) for row in mel])


@pytest.mark.parametrize("speed", [0.75, 1.5, 2.0, 0.5])
def test_resample_mel_linear_matches_interp_oracle(speed: float) -> None:
    mel = np.random.default_rng(2).standard_normal((BINS, 53)).astype(np.float32)
    n_out = int(53 / speed)
    out = resample_mel_linear(mel, n_out)
    assert out.shape == (BINS, n_out)
    assert np.allclose(out, _torch_like_oracle(mel, n_out, 53 / n_out), atol=1e-5)
    assert np.allclose(resample_mel_linear(mel, 53), mel)


@pytest.mark.parametrize("speed", [0.75, 1.5, 1.0])
def test_speed_resampler_streamed_length_and_values(speed: float) -> None:
    mel = np.random.default_rng(4).standard_normal((BINS, 97)).astype(np.float32)
    one_shot = SpeedResampler(speed).push(mel, final=True)
    assert one_shot.shape[1] == int(97 / speed)
    for cuts in ([30, 60], [1, 2, 3, 50, 96], [96]):
        rs = SpeedResampler(speed)
        parts, prev = [], 0
        for c in [*cuts, 97]:
            parts.append(rs.push(mel[:, prev:c], final=c == 97))
            prev = c
        streamed = np.concatenate(parts, axis=1)
        assert streamed.shape[1] == int(97 / speed)
        expected = _torch_like_oracle(mel, streamed.shape[1], speed)
        assert np.allclose(streamed, expected, atol=1e-5)
    # on a smooth mel the streamed (constant scale) and one-shot (exact size) results differ
    # only by the read position drift, under one input frame (slope of sin(n / 9) <= 1 / 9)
    smooth = np.sin(np.arange(97) / 9.0)[None, :] * np.ones((BINS, 1), dtype=np.float32)
    smooth = smooth.astype(np.float32)
    rs = SpeedResampler(speed)
    streamed = np.concatenate([rs.push(smooth[:, :40], False), rs.push(smooth[:, 40:], True)], 1)
    one = SpeedResampler(speed).push(smooth, final=True)
    assert np.max(np.abs(streamed - one)) < 1.0 / 9.0 + 1e-3
