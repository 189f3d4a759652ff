"""``EngineOptions.split_cores`` on the tiny synthetic model: every session got its share of
the threads, none spinning."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest
from decoding_support import FixedDecoding

from wyoming_cosyvoice3.engine import CosyVoice3Engine, EngineOptions


@pytest.fixture(scope="module")
def engines(tiny_dit_model_dir: Path, tiny_dit_cache_dir: Path) -> dict[bool, CosyVoice3Engine]:
    """An engine without ``split_cores`` at 1 thread per session and one with it at 2
    threads (split 1 + 1: the same thread count per session, as onnxruntime's rounding
    depends on it), with every derived graph a preset runs (fused LLM with its in-place KV
    cache, streaming DiT, streamed vocoder)."""
    return {split: CosyVoice3Engine.load(tiny_dit_model_dir, EngineOptions(
        cache_dir=tiny_dit_cache_dir, llm_graph="fused", threads=2 if split else 1,
        split_cores=split, observer=FixedDecoding(0.8))) for split in (False, True)}


# -- the sessions' threads --------------------------------------------------------------------


def _spins(session: ort.InferenceSession) -> bool:
    try:
        entry = session.get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning")
    except Exception:  # not set: onnxruntime's default, spinning
        return True
    return entry != "0"


def sessions(engine: CosyVoice3Engine) -> dict[str, dict[str, ort.InferenceSession]]:
    """The synthesis sessions by role: the LLM's and the flow's and vocoder's."""
    model = engine.model
    streaming = model.streaming_estimator(model.options.flow.precision)
    assert model.hift_stream is not None and streaming is not None
    llm = {"llm": model.llm.session, "speech_embedding": model.speech_embedding.session}
    if model.llm_prefill is not None:
        llm["llm_prefill"] = model.llm_prefill.session
    if hasattr(model.text_embedding, "session"):
        llm["text_embedding"] = model.text_embedding.session
    stages = {"flow_encoder": model.flow_encoder.session,
              "streaming_dit": streaming.main.session,
              "vocoder": model.hift_stream.graph.session}
    return {"llm": llm, "stages": stages}


def test_split_sessions_get_their_share_of_the_threads_and_do_not_spin(
    engines: dict[bool, CosyVoice3Engine],
) -> None:
    # the split engine was loaded with 2 threads: each role gets 1
    for role, by_name in sessions(engines[True]).items():
        for name, session in by_name.items():
            opened = session.get_session_options()
            assert (role, name, opened.intra_op_num_threads) == (role, name, 1)
            assert not _spins(session), (role, name)
    # a DiT loaded on first use (the other precision) gets the flow's share too
    model = engines[True].model
    other = "int8" if model.options.flow.precision == "fp32" else "fp32"
    late = model.streaming_estimator(other)
    assert late is not None
    assert late.main.session.get_session_options().intra_op_num_threads == 1
    assert not _spins(late.main.session)
    for by_name in sessions(engines[False]).values():
        for name, session in by_name.items():
            assert (name, session.get_session_options().intra_op_num_threads) == (name, 1)
            assert _spins(session), name


@pytest.mark.parametrize(("threads", "cpus", "llm", "stages"), [
    (0, 1, 1, 1), (0, 2, 1, 1), (0, 3, 1, 2), (0, 4, 2, 2), (0, 8, 4, 4),
    (2, 8, 1, 1), (5, 1, 2, 3),
])
def test_for_sessions_splits_the_cores(threads: int, cpus: int, llm: int, stages: int) -> None:
    split = EngineOptions(threads=threads, split_cores=True)
    assert split.for_sessions("llm", cpus) == EngineOptions(threads=llm, spin_wait=False,
                                                            split_cores=True)
    assert split.for_sessions("stages", cpus) == EngineOptions(threads=stages, spin_wait=False,
                                                               split_cores=True)
    plain = EngineOptions(threads=threads)
    assert plain.for_sessions("llm", cpus) is plain
    assert plain.for_sessions("stages", cpus) is plain
