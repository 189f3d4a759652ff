"""One piece's mel stream (flow/stream.py) on stand-in flows: the flow form is chosen once per
piece, the chunk schedule (hop doubling, lookahead, final chunk), the left context of each form,
the history freed before a full-attention pass, and the noise columns each chunk reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.dsp import GrowingNoise
from wyoming_cosyvoice3.engine.flow.stream import MelStream, MelStreamOptions
from wyoming_cosyvoice3.engine.options import StageTimes, SynthesisOptions, VoiceFeatures

PROMPT_TOKENS = 7
LOOKAHEAD = C.PRE_LOOKAHEAD_TOKENS
VOICE = VoiceFeatures(
    speech_tokens=np.arange(PROMPT_TOKENS, dtype=np.int64),
    speaker_embedding=np.ones(192, np.float32),
    prompt_mel=np.zeros((2 * PROMPT_TOKENS, C.MEL_BINS), np.float32),
)


class FakeRunner:
    """Full attention: records each call; returns the frames after the prompt (minus drop)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def mel_for_tokens(self, tokens: np.ndarray, voice: VoiceFeatures, noise: np.ndarray,
                       **kwargs: Any) -> np.ndarray:
        self.calls.append(dict(kwargs, tokens=tokens, noise=noise))
        frames = 2 * (len(tokens) - PROMPT_TOKENS) - kwargs["drop_lookahead_frames"]
        return np.zeros((C.MEL_BINS, frames), np.float32)


class FakeChunked:
    """Chunk-causal: records each call; returns the frames not returned before."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.histories: list[dict[str, int]] = []

    def new_history(self, steps: int, cfg_rate: float, cfg_steps: int | None) -> dict[str, int]:
        self.histories.append({"frames": 0})
        return self.histories[-1]

    def chunk_mel(self, tokens: np.ndarray, voice: VoiceFeatures, noise: np.ndarray,
                  history: dict[str, int], *args: Any, **kwargs: Any) -> np.ndarray:
        self.calls.append({"tokens": tokens, "history": history, "args": args, **kwargs})
        frames = 2 * (len(tokens) - PROMPT_TOKENS) - args[3] - history["frames"]
        history["frames"] += frames
        return np.zeros((C.MEL_BINS, frames), np.float32)


class FakeFlows:
    def __init__(self, available: bool) -> None:
        self.runner = FakeRunner()
        self.chunked = FakeChunked() if available else None
        self.asked: list[str] = []

    def get(self, precision: str) -> FakeChunked | None:
        self.asked.append(precision)
        return self.chunked


def _stream(flows: FakeFlows, skip: int = 0, **options: Any) -> MelStream:
    opts = MelStreamOptions.of(SynthesisOptions(**options))
    noise = GrowingNoise(np.random.default_rng(1), C.MEL_BINS, "normal", 64)
    return MelStream(flows, VOICE, opts, noise, skip)  # type: ignore[arg-type]


def _run(stream: MelStream, n_tokens: int) -> list[tuple[int, int, int]]:
    """Feed ``n_tokens`` tokens, then end the piece; (offset, next offset, frames) per chunk."""
    chunks = []
    for token in range(100, 100 + n_tokens):
        if stream.push(token):
            offset = stream.offset_tokens
            mel = stream.next_mel(False, lambda: False, StageTimes())
            chunks.append((offset, stream.offset_tokens, mel.shape[1]))
    offset = stream.offset_tokens
    mel = stream.next_mel(True, lambda: False, StageTimes())
    chunks.append((offset, stream.offset_tokens, mel.shape[1]))
    return chunks


def test_the_flow_form_is_chosen_once_per_piece() -> None:
    flows = FakeFlows(available=True)
    stream = _stream(flows, flow_chunk_causal=True, flow_final_chunk_causal=True,
                     flow_precision="int8", first_hop_tokens=5)
    _run(stream, 40)
    assert flows.asked == ["int8"]
    assert flows.chunked is not None and len(flows.chunked.calls) == 4
    assert not flows.runner.calls and len(flows.chunked.histories) == 1
    full = FakeFlows(available=True)
    _run(_stream(full, first_hop_tokens=5), 40)
    assert full.asked == [] and len(full.runner.calls) == 4


@pytest.mark.parametrize("causal", [False, True])
def test_hops_double_up_to_the_maximum_and_the_last_chunk_takes_the_rest(causal: bool) -> None:
    flows = FakeFlows(available=True)
    stream = _stream(flows, flow_chunk_causal=causal, flow_final_chunk_causal=causal,
                     first_hop_tokens=4, max_hop_tokens=12)
    chunks = _run(stream, 50)
    # hops 4, 8, 12, 12 (+3 lookahead each: the chunk runs once hop + 3 tokens are in)
    assert chunks == [(0, 4, 8), (4, 12, 16), (12, 24, 24), (24, 36, 24), (36, 50, 28)]
    assert stream.hop_tokens == 12


def test_one_shot_runs_one_chunk() -> None:
    chunks = _run(_stream(FakeFlows(available=False), streaming=False), 30)
    assert chunks == [(0, 30, 60)]


def test_first_hop_on_the_chunk_grid() -> None:
    stream = _stream(FakeFlows(available=False), first_hop_tokens=25,
                     first_hop_on_chunk_grid=True)
    assert stream.hop_tokens == 25 + (25 - PROMPT_TOKENS)  # prompt + hop end on the grid
    chunks = _run(stream, 100)
    assert [c[1] - c[0] for c in chunks[:2]] == [43, 50]  # the unpadded hop doubles


def test_left_context_cuts_full_attention_tokens_and_bounds_the_chunk_causal_history() -> None:
    full = FakeFlows(available=False)
    chunks = _run(_stream(full, flow_left_context_tokens=6, first_hop_tokens=4), 40)
    starts = [c["generated_offset_tokens"] for c in full.runner.calls]
    assert starts == [max(0, offset - 6) for offset, _, _ in chunks]
    for call, (_, end, _) in zip(full.runner.calls, chunks, strict=True):
        assert len(call["tokens"]) == PROMPT_TOKENS + end + (
            0 if end == 40 else LOOKAHEAD) - call["generated_offset_tokens"]
    causal = FakeFlows(available=True)
    _run(_stream(causal, flow_chunk_causal=True, flow_final_chunk_causal=True,
                 flow_left_context_tokens=6, first_hop_tokens=4), 40)
    assert causal.chunked is not None
    for call in causal.chunked.calls:
        assert len(call["tokens"]) >= PROMPT_TOKENS and call["tokens"][PROMPT_TOKENS] == 100
        assert call["args"][5] == 12  # left context frames
        assert call["store_history"] is (call["args"][3] > 0)  # not on the final chunk


def test_a_full_attention_final_chunk_frees_the_history_first() -> None:
    flows = FakeFlows(available=True)
    stream = _stream(flows, flow_chunk_causal=True, flow_final_chunk_causal=False,
                     first_hop_tokens=4)
    seen: list[object] = []
    real = flows.runner.mel_for_tokens

    def final(*args: Any, **kwargs: Any) -> np.ndarray:
        seen.append(stream._history)
        return real(*args, **kwargs)

    flows.runner.mel_for_tokens = final  # type: ignore[method-assign]
    _run(stream, 20)
    assert flows.chunked is not None and len(flows.chunked.calls) == 2
    assert seen == [None] and flows.runner.calls[0]["generated_offset_tokens"] == 0


def test_each_chunk_reads_the_noise_columns_of_the_whole_prompt() -> None:
    """With ``noise_skip_frames`` (the prompt frames a shorter flow prompt cut), frame i of
    the flow reads request noise column skip + i."""
    flows = FakeFlows(available=False)
    stream = _stream(flows, skip=10, first_hop_tokens=4)
    _run(stream, 12)
    reference = GrowingNoise(np.random.default_rng(1), C.MEL_BINS, "normal", 64)
    for call in flows.runner.calls:
        n = call["noise"].shape[1]
        np.testing.assert_array_equal(call["noise"], reference.take(10 + n)[10:].T)
        assert n == 2 * PROMPT_TOKENS + 2 * (len(call["tokens"]) - PROMPT_TOKENS)

