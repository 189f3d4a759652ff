"""One plan per request: the server asks the engine how it will cut a text
(``Engine.plan_pieces``) and hands that plan back to ``synthesize``, so the text is normalised
and cut into pieces once, through the real server and engine over TCP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from server_support import client, collect, make_settings, running_server
from wyoming.tts import Synthesize

from wyoming_cosyvoice3.engine.text import frontend


async def test_a_request_normalises_its_text_once(tiny_model_dir: Path, tiny_engine_cache: Path,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    text = "It is 21 degrees in the kitchen."
    seen: list[str] = []
    normalize = frontend.normalize_text

    def counting(raw: str, *args: Any, **kwargs: Any) -> str:
        seen.append(raw)
        return normalize(raw, *args, **kwargs)

    monkeypatch.setattr(frontend, "normalize_text", counting)
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache)
    async with running_server(settings) as server, client(server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        response = await collect(cl, "audio-stop")
    assert len(response.pcm) > 0
    # the voice's transcript is normalised too when the voice is prepared: count this text
    assert seen.count(text) == 1


@pytest.mark.parametrize("text", ["。", "...", "?!", "👍"])
async def test_an_unspeakable_text_ends_cleanly_through_the_plan(
        text: str, tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path) -> None:
    """Case C1 on the plan path (blank texts get the empty-text error before any plan,
    test_server_e2e.py): the engine plans no piece, speaks the empty plan, and the client
    gets ``audio-start`` + ``audio-stop`` with no audio and no error."""
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache)
    async with running_server(settings) as server, client(server) as cl:
        await cl.write_event(Synthesize(text=text).event())
        response = await collect(cl, "audio-stop")
    assert response.types == ["audio-start", "audio-stop"]
    assert response.pcm == b""
