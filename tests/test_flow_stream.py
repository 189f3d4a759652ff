"""One piece's mel stream (flow/stream.py) on stand-in flows: the flow form is chosen once per
piece, the chunk schedule (hop doubling, lookahead, final chunk), the left context of each form,
the history freed before a full-attention pass, and the noise columns each chunk reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from wyoming_cosyvoice3.engine import constants as C
from wyoming_cosyvoice3.engine.flow.solver import FlowCall
from wyoming_cosyvoice3.engine.flow.stream import FlowRequest, MelStream
from wyoming_cosyvoice3.engine.noise import GrowingNoise
from wyoming_cosyvoice3.engine.options import (
    EulerSchedule,
    FlowFallback,
    FlowPreset,
    StageTimes,
    VoiceFeatures,
)

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
                       call: FlowCall, **kwargs: Any) -> np.ndarray:
        self.calls.append(dict(kwargs, tokens=tokens, noise=noise, call=call))
        frames = 2 * (len(tokens) - PROMPT_TOKENS) - kwargs["drop_lookahead_frames"]
        return np.zeros((C.MEL_BINS, frames), np.float32)


class FakeChunked:
    """Chunk-causal: records each call; returns the frames not returned before."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.histories: list[dict[str, Any]] = []

    def new_history(self, schedule: EulerSchedule, keep_frames: int | None = None
                    ) -> dict[str, Any]:
        self.histories.append({"frames": 0, "keep": keep_frames})
        return self.histories[-1]

    def chunk_mel(self, tokens: np.ndarray, voice: VoiceFeatures, noise: np.ndarray,
                  history: dict[str, Any], call: FlowCall, drop: int) -> np.ndarray:
        self.calls.append({"tokens": tokens, "history": history, "call": call, "drop": drop})
        frames = 2 * (len(tokens) - PROMPT_TOKENS) - drop - history["frames"]
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


def _stream(flows: FakeFlows, voice: VoiceFeatures = VOICE, streaming: bool = True,
            **flow: Any) -> MelStream:
    noise = GrowingNoise(np.random.default_rng(1), C.MEL_BINS, "normal", 64)
    request = FlowRequest(flows, FlowPreset(**flow), voice, noise,  # type: ignore[arg-type]
                          streaming)
    return request.piece(middle=False)


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
    stream = _stream(flows, chunk_causal=True, final_chunk_causal=True,
                     precision="int8", first_hop_tokens=5)
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
    stream = _stream(flows, chunk_causal=causal, final_chunk_causal=causal,
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
    chunks = _run(_stream(full, left_context_tokens=6, first_hop_tokens=4), 40)
    starts = [c["generated_offset_tokens"] for c in full.runner.calls]
    assert starts == [max(0, offset - 6) for offset, _, _ in chunks]
    for call, (_, end, _) in zip(full.runner.calls, chunks, strict=True):
        assert len(call["tokens"]) == PROMPT_TOKENS + end + (
            0 if end == 40 else LOOKAHEAD) - call["generated_offset_tokens"]
    causal = FakeFlows(available=True)
    _run(_stream(causal, chunk_causal=True, final_chunk_causal=True,
                 left_context_tokens=6, first_hop_tokens=4), 40)
    assert causal.chunked is not None
    for call in causal.chunked.calls:
        assert len(call["tokens"]) >= PROMPT_TOKENS and call["tokens"][PROMPT_TOKENS] == 100
        assert call["history"]["keep"] == 12  # left context frames
    drops = [call["drop"] for call in causal.chunked.calls]
    assert drops == [2 * LOOKAHEAD] * (len(drops) - 1) + [0]  # the final chunk drops none


def test_a_full_attention_final_chunk_frees_the_history_first() -> None:
    flows = FakeFlows(available=True)
    stream = _stream(flows, chunk_causal=True, final_chunk_causal=False,
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
    """With a shorter flow prompt (``prompt_tokens``: 5 of 12 prompt tokens, 10 frames cut),
    frame i of the flow reads request noise column 10 + i."""
    flows = FakeFlows(available=False)
    whole = VoiceFeatures(
        speech_tokens=np.arange(PROMPT_TOKENS + 5, dtype=np.int64),
        speaker_embedding=np.ones(192, np.float32),
        prompt_mel=np.zeros((2 * (PROMPT_TOKENS + 5), C.MEL_BINS), np.float32),
    )
    stream = _stream(flows, whole, prompt_tokens=PROMPT_TOKENS, first_hop_tokens=4)
    _run(stream, 12)
    reference = GrowingNoise(np.random.default_rng(1), C.MEL_BINS, "normal", 64)
    for call in flows.runner.calls:
        n = call["noise"].shape[1]
        np.testing.assert_array_equal(call["noise"], reference.take(10 + n)[10:].T)
        assert n == 2 * PROMPT_TOKENS + 2 * (len(call["tokens"]) - PROMPT_TOKENS)



def test_a_chunk_causal_preset_without_the_streaming_dit_runs_its_fallback() -> None:
    """The flow decides the fallback itself: no chunk-causal flow of the precision, so the
    request runs full attention with the fallback's history bound."""
    flows = FakeFlows(available=False)
    stream = _stream(flows, chunk_causal=True, final_chunk_causal=True, left_context_tokens=50,
                     fallback=FlowFallback(left_context_tokens=6), first_hop_tokens=4)
    assert stream.preset.chunk_causal is False and stream.preset.left_context_tokens == 6
    chunks = _run(stream, 40)
    starts = [c["generated_offset_tokens"] for c in flows.runner.calls]
    assert starts == [max(0, offset - 6) for offset, _, _ in chunks]
    assert flows.asked == ["fp32"]


def test_a_middle_piece_runs_whole_when_the_preset_says_so() -> None:
    noise = GrowingNoise(np.random.default_rng(1), C.MEL_BINS, "normal", 64)
    for whole in (False, True):
        preset = FlowPreset(first_hop_tokens=4, whole_middle_pieces=whole)
        request = FlowRequest(FakeFlows(available=False), preset, VOICE,  # type: ignore[arg-type]
                              noise, True)
        assert request.piece(middle=False).streaming
        assert request.piece(middle=True).streaming is not whole
