"""The voice page's HTTP API end to end: the real server with the real engine on the tiny
synthetic model, a real HTTP client (aiohttp) and a real Wyoming client over TCP."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import soundfile as sf
from server_support import (
    SpyEngine,
    client,
    collect,
    describe,
    make_settings,
    running_server,
    spy_factory,
    wait_until,
)
from web_support import (
    CHANGE,
    add_voice,
    catalog_items,
    clip_bytes,
    delete_voice,
    listing,
    page_url,
    pcm_of_wav_stream,
    voice_form,
)
from wyoming.tts import Synthesize, SynthesizeVoice

from wyoming_cosyvoice3.engine.errors import SynthesisFailed, VoiceError
from wyoming_cosyvoice3.server.cli import RunningServer
from wyoming_cosyvoice3.server.settings import resolve_settings

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Shared:
    server: RunningServer
    spy: SpyEngine
    release: threading.Event
    data_dir: Path
    model_dir: Path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tiny_model_dir: Path, tiny_engine_cache: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Shared]:
    data_dir = tmp_path_factory.mktemp("data")
    holder: list[SpyEngine] = []
    release = threading.Event()
    release.set()  # tests clear it to hold a synthesis before its last chunk
    # the quality preset keeps the fp32 estimator: no derivation at start on the tiny model
    settings = make_settings(tiny_model_dir, data_dir, tiny_engine_cache, http_port=0,
                             preset="quality")
    async with running_server(settings, spy_factory(holder, release)) as server:
        state = Shared()
        state.server, state.spy, state.release = server, holder[0], release
        state.data_dir, state.model_dir = data_dir, tiny_model_dir
        yield state
        release.set()


@pytest_asyncio.fixture(loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        yield http


async def wyoming_audio(server: RunningServer, text: str, voice: str) -> np.ndarray:
    async with client(server) as cl:
        await cl.write_event(Synthesize(text=text, voice=SynthesizeVoice(name=voice)).event())
        response = await collect(cl, "audio-stop")
    assert not response.errors, response.errors
    return response.samples


async def test_page_is_off_by_default(tmp_path: Path) -> None:
    settings = resolve_settings(["--data-dir", str(tmp_path)], environ={})
    assert settings.http_port is None and settings.http_host == "127.0.0.1"
    on = resolve_settings(["--data-dir", str(tmp_path)],
                          environ={"COSYVOICE3_HTTP_PORT": "8099"})
    assert on.http_port == 8099 and on.http_host == "127.0.0.1"


async def test_page_and_voice_list(shared: Shared, session: aiohttp.ClientSession) -> None:
    async with session.get(page_url(shared.server)) as response:
        assert response.status == 200
        html = await response.text()
        assert 'id="voice-form"' in html and "reload" in html.lower()
        assert "no authentication" in html
    async with session.get(page_url(shared.server, "static/app.js")) as response:
        assert response.status == 200 and response.content_type == "text/javascript"
    for path in ("static/..%2F..%2Fcatalog.py", "static/index.htm", "static/%2Fetc%2Fpasswd"):
        async with session.get(page_url(shared.server, path)) as response:
            assert response.status == 404, path
    data = await listing(session, shared.server)
    assert data["state"] == "ready"
    voices = {v["name"]: v for v in data["voices"]}
    zh, en = voices["zh-female"], voices["en-male"]
    assert (zh["mode"], en["mode"]) == ("zero-shot", "cross-lingual")
    assert zh["installed"] and en["installed"] and not zh["editable"]
    assert zh["source"] == "built-in" and zh["languages"][0] == "zh"
    real = sf.info(str(shared.model_dir / "voices" / "en-male.wav")).duration
    assert en["clip_s"] == pytest.approx(real, abs=0.01)


async def test_add_preview_describe_delete(shared: Shared,
                                           session: aiohttp.ClientSession) -> None:
    server, data_dir = shared.server, shared.data_dir
    clip = clip_bytes(3.0, 48000, channels=2, seed=3)
    status, voice = await add_voice(session, server, "grandpa", clip,
                                    filename="../../../etc/grandpa.wav",  # never used as a path
                                    description="Grandpa (German)",
                                    transcript="Guten Morgen, wie geht es dir heute?")
    assert status == 201, voice
    assert voice["installed"] and voice["mode"] == "zero-shot" and voice["editable"]
    assert voice["clip_s"] == pytest.approx(3.0, abs=0.01)
    item = next(i for i in catalog_items(data_dir) if i["name"] == "grandpa")
    assert item["languages"] == ["de", "en"] and item["clip"] == "clips/grandpa.wav"
    assert item["description"] == "Grandpa (German)"
    assert (data_dir / "clips" / "grandpa.wav").read_bytes() == clip  # stored unchanged

    # usable at once over Wyoming, without a restart
    info = await describe(server)
    listed = {v.name: v for v in info.tts[0].voices}
    assert listed["grandpa"].installed and listed["grandpa"].languages == ["de", "en"]
    assert listed["grandpa"].description == "Grandpa (German)"
    text = "Hello from the page."
    over_wyoming = await wyoming_audio(server, text, "grandpa")
    assert over_wyoming.size > 0

    # the preview is the same synthesis (same seed, same voice), as a WAV stream
    async with session.get(page_url(server, "api/voices/grandpa/preview"),
                           params={"text": text}) as response:
        assert response.status == 200 and response.content_type == "audio/wav"
        assert response.headers.get("Transfer-Encoding") == "chunked"
        previewed = pcm_of_wav_stream(await response.read())
    np.testing.assert_array_equal(previewed, over_wyoming)
    assert shared.spy.voices[-1] == "grandpa"

    status, body = await delete_voice(session, server, "grandpa")
    assert status == 200, body
    assert "grandpa" not in {v.name for v in (await describe(server)).tts[0].voices}
    assert all(i["name"] != "grandpa" for i in catalog_items(data_dir))
    assert not (data_dir / "clips" / "grandpa.wav").exists()
    async with session.get(page_url(server, "api/voices/grandpa/preview"),
                           params={"text": text}) as response:
        assert response.status == 404
        assert "grandpa" in (await response.json())["error"]


@pytest.mark.parametrize(("fmt", "subtype", "extension"), [
    ("FLAC", None, "flac"), ("OGG", "VORBIS", "ogg"), ("MP3", None, "mp3"),
])
async def test_other_formats_are_stored_as_sent(
    shared: Shared, session: aiohttp.ClientSession, fmt: str, subtype: str | None,
    extension: str,
) -> None:
    name = f"fmt-{extension}"
    clip = clip_bytes(2.5, 24000, fmt=fmt, subtype=subtype, seed=5)
    # the client's file name says .wav: the stored extension follows the decoded format
    status, voice = await add_voice(session, shared.server, name, clip)
    assert status == 201, voice
    assert voice["installed"] and voice["mode"] == "cross-lingual"
    assert (shared.data_dir / "clips" / f"{name}.{extension}").read_bytes() == clip
    status, _ = await delete_voice(session, shared.server, name)
    assert status == 200


REFUSALS = [
    ("short", dict(clip=clip_bytes(0.5)), 400, "shorter than 1 s"),
    ("lowrate", dict(clip=clip_bytes(3.0, 8000)), 400, "16 kHz"),
    ("long", dict(clip=clip_bytes(31.0, 16000)), 400, "at most 30 s"),
    ("silent", dict(clip=clip_bytes(3.0, silent=True)), 400, "silent"),
    ("text", dict(clip=b"voices:\n  - name: x\n"), 400, "upload WAV, FLAC, OGG or MP3"),
    ("aiff", dict(clip=clip_bytes(3.0, fmt="AIFF")), 400, "upload WAV, FLAC, OGG or MP3"),
    ("noclip", dict(clip=None), 400, "record one"),
    ("../escape", dict(clip=clip_bytes()), 400, "ASCII letters"),
    ("ok-name", dict(clip=clip_bytes(), languages="german!"), 400, "languages"),
    ("ok-name", dict(clip=clip_bytes(), languages=""), 400, "languages"),
    ("en-male", dict(clip=clip_bytes()), 409, "exists already"),
]


@pytest.mark.parametrize(("name", "fields", "status", "says"), REFUSALS,
                         ids=[f"{r[0]}-{r[3][:12]}" for r in REFUSALS])
async def test_refusals_say_what_to_change_and_write_nothing(
    shared: Shared, session: aiohttp.ClientSession, name: str, fields: dict, status: int,
    says: str,
) -> None:
    before = catalog_items(shared.data_dir)
    clips_before = sorted((shared.data_dir / "clips").glob("*")) if (
        shared.data_dir / "clips").exists() else []
    fields = dict(fields)
    clip = fields.pop("clip")
    async with session.post(page_url(shared.server, "api/voices"), headers=CHANGE,
                            data=voice_form(name, clip, filename="../../x.wav",
                                            **fields)) as response:
        assert response.status == status
        assert says in (await response.json())["error"]
    assert catalog_items(shared.data_dir) == before
    after = sorted((shared.data_dir / "clips").glob("*")) if (
        shared.data_dir / "clips").exists() else []
    assert after == clips_before
    assert not (shared.data_dir.parent / "x.wav").exists()


async def test_edit_changes_mode_clip_and_description(
    shared: Shared, session: aiohttp.ClientSession,
) -> None:
    server, data_dir = shared.server, shared.data_dir
    status, voice = await add_voice(session, server, "editme", clip_bytes(2.0, seed=7))
    assert status == 201 and voice["mode"] == "cross-lingual"
    form = voice_form(None, None, languages="fr", description="Édith",
                      instruction="Speak slowly.")
    async with session.put(page_url(server, "api/voices/editme"), headers=CHANGE,
                           data=form) as response:
        assert response.status == 200, await response.text()
        voice = await response.json()
    assert voice["mode"] == "instruct" and voice["languages"] == ["fr"]
    assert voice["installed"] and voice["clip_s"] == pytest.approx(2.0, abs=0.01)
    assert server.runtime.voices["editme"].prompt.instruction == "Speak slowly."  # type: ignore
    # a new clip replaces the old file; the transcript makes it zero-shot
    new_clip = clip_bytes(4.0, 16000, fmt="FLAC", seed=8)
    form = voice_form(None, new_clip, languages="fr, en", transcript="Bonjour.")
    async with session.put(page_url(server, "api/voices/editme"), headers=CHANGE,
                           data=form) as response:
        assert response.status == 200, await response.text()
        voice = await response.json()
    assert voice["mode"] == "zero-shot" and voice["clip_s"] == pytest.approx(4.0, abs=0.01)
    item = next(i for i in catalog_items(data_dir) if i["name"] == "editme")
    assert item["clip"] == "clips/editme.flac" and "instruction" not in item
    assert "description" not in item
    assert not (data_dir / "clips" / "editme.wav").exists()
    info = await describe(server)
    assert {v.name: v.languages for v in info.tts[0].voices}["editme"] == ["fr", "en"]
    # built-in voices are read-only here
    async with session.put(page_url(server, "api/voices/zh-female"), headers=CHANGE,
                           data=voice_form(None, None, languages="zh")) as response:
        assert response.status == 409
        assert "built-in" in (await response.json())["error"]
    async with session.delete(page_url(server, "api/voices/zh-female"),
                              headers=CHANGE) as response:
        assert response.status == 409
    assert (await delete_voice(session, server, "editme"))[0] == 200
    assert not (data_dir / "clips" / "editme.flac").exists()


def clip_files(data_dir: Path) -> dict[str, bytes]:
    """Every file under ``clips/`` (temporary upload files too) with its bytes."""
    clips = data_dir / "clips"
    return {p.name: p.read_bytes() for p in clips.iterdir()} if clips.exists() else {}


async def test_a_clip_the_engine_refuses_leaves_nothing_behind(
    shared: Shared, session: aiohttp.ClientSession,
) -> None:
    """A clip that passes the upload checks but that the engine refuses: the written clip is
    removed and the catalog is unchanged; on add (a coded engine failure: 500) and on edit
    (a voice error: 400) the previous voice stays exactly as it was."""
    server, data_dir = shared.server, shared.data_dir
    catalog, clips = catalog_items(data_dir), clip_files(data_dir)
    shared.spy.refuse["refused"] = SynthesisFailed("injected failure in graph campplus.onnx")
    try:
        status, answer = await add_voice(session, server, "refused", clip_bytes(2.0, seed=30))
    finally:
        del shared.spy.refuse["refused"]
    assert status == 500 and "campplus.onnx" in answer["error"], answer
    assert catalog_items(data_dir) == catalog and clip_files(data_dir) == clips
    assert "refused" not in {v["name"] for v in (await listing(session, server))["voices"]}
    # edit: the voice keeps its clip, fields and prepared prompt
    old_clip = clip_bytes(2.0, seed=31)
    assert (await add_voice(session, server, "keeps", old_clip))[0] == 201
    catalog, clips = catalog_items(data_dir), clip_files(data_dir)
    before = next(v for v in (await listing(session, server))["voices"] if v["name"] == "keeps")
    prompt = server.runtime.voices["keeps"].prompt
    shared.spy.refuse["keeps"] = VoiceError("reference clip yields no speech tokens")
    try:
        async with session.put(page_url(server, "api/voices/keeps"), headers=CHANGE,
                               data=voice_form(None, clip_bytes(3.0, 16000, fmt="FLAC", seed=32),
                                               languages="fr", transcript="Bonjour.")
                               ) as response:
            assert response.status == 400
            assert "no speech tokens" in (await response.json())["error"]
    finally:
        del shared.spy.refuse["keeps"]
    assert catalog_items(data_dir) == catalog and clip_files(data_dir) == clips
    assert clips["keeps.wav"] == old_clip
    after = next(v for v in (await listing(session, server))["voices"] if v["name"] == "keeps")
    assert after == before and after["installed"] and after["languages"] == ["de", "en"]
    assert server.runtime.voices["keeps"].prompt is prompt
    assert (await delete_voice(session, server, "keeps"))[0] == 200


async def test_concurrent_changes_keep_the_catalog_whole(
    shared: Shared, session: aiohttp.ClientSession,
) -> None:
    server, data_dir = shared.server, shared.data_dir
    names = [f"crowd-{i}" for i in range(6)]
    results = await asyncio.gather(
        *(add_voice(session, server, name, clip_bytes(1.5, seed=20 + i))
          for i, name in enumerate(names)),
        add_voice(session, server, "crowd-0", clip_bytes(1.5, seed=99)),  # a duplicate
    )
    statuses = sorted(status for status, _ in results)
    assert statuses == [201] * 6 + [409], results
    listed = [i["name"] for i in catalog_items(data_dir)]
    for name in names:
        assert listed.count(name) == 1
    clips = sorted(p.name for p in (data_dir / "clips").glob("crowd-*"))
    assert clips == sorted(f"{n}.wav" for n in names)
    installed = {v.name for v in (await describe(server)).tts[0].voices if v.installed}
    assert set(names) <= installed
    deleted = await asyncio.gather(*(delete_voice(session, server, n) for n in names))
    assert [status for status, _ in deleted] == [200] * 6
    assert not any(i["name"].startswith("crowd-") for i in catalog_items(data_dir))
    assert not list((data_dir / "clips").glob("crowd-*"))
    assert not list(data_dir.glob(".voices.yaml.*.tmp"))


async def test_cross_site_and_rebinding_guards(shared: Shared,
                                               session: aiohttp.ClientSession) -> None:
    before = catalog_items(shared.data_dir)
    async with session.post(page_url(shared.server, "api/voices"),
                            data=voice_form("sneaky", clip_bytes())) as response:
        assert response.status == 403 and "X-Voice-Page" in (await response.json())["error"]
    async with session.get(page_url(shared.server, "api/voices"),
                           headers={"Host": "attacker.example:80"}) as response:
        assert response.status == 403
    async with session.get(page_url(shared.server, "api/voices"),
                           headers={"Host": "localhost:1234"}) as response:
        assert response.status == 200
    assert catalog_items(shared.data_dir) == before


async def test_preview_streams_while_synthesising(shared: Shared,
                                                  session: aiohttp.ClientSession) -> None:
    shared.release.clear()  # the engine holds the synthesis before its last chunk
    try:
        # one piece long enough (at least 2 x its text tokens are decoded) that the quality
        # preset's first hop (25 tokens padded to the 25-token grid, + 3 lookahead) is not
        # its last chunk
        text = ("One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, "
                "thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty.")
        async with session.get(page_url(shared.server, "api/voices/en-male/preview"),
                               params={"text": text}) as response:
            assert response.status == 200
            first = await asyncio.wait_for(response.content.read(4096), 60)
            assert first[:4] == b"RIFF" and len(first) > 44  # audio before the synthesis ends
            assert shared.server.runtime.runner.active == 1
            shared.release.set()
            rest = await response.read()
        assert pcm_of_wav_stream(first + rest).size > (len(first) - 44) // 2
    finally:
        shared.release.set()


async def test_preview_stops_when_the_listener_leaves(shared: Shared) -> None:
    spy = shared.spy
    shared.release.clear()
    done_before = len(spy.outcomes)
    try:
        async with aiohttp.ClientSession() as http, http.get(
            page_url(shared.server, "api/voices/en-male/preview"),
            params={"text": "A longer sentence that the listener will not hear to its end."},
        ) as response:
            assert response.status == 200
            await asyncio.wait_for(response.content.read(100), 60)
        # the session is closed: the engine must stop without the release
        assert await asyncio.to_thread(wait_until, lambda: len(spy.outcomes) > done_before,
                                       30.0)
        assert spy.outcomes[-1] in ("cancelled", "closed") and spy.stop_flags[-1]
        assert await shared.server.runtime.runner.wait_idle(10.0)
    finally:
        shared.release.set()


async def test_preview_speaks_markdown_as_a_wyoming_request_does(
        shared: Shared, session: aiohttp.ClientSession) -> None:
    """Chat agents answer in markdown: the page's preview removes the markup as the Wyoming
    path does, so the engine gets the same text and the audio is the same."""
    markdown = "**Warm** greetings from _the_ [page](http://example.invalid/x)."
    async with session.get(page_url(shared.server, "api/voices/en-male/preview"),
                           params={"text": markdown}) as response:
        assert response.status == 200
        previewed = pcm_of_wav_stream(await response.read())
    assert shared.spy.texts[-1] == "Warm greetings from the page."
    over_wyoming = await wyoming_audio(shared.server, markdown, "en-male")
    assert shared.spy.texts[-1] == "Warm greetings from the page."
    np.testing.assert_array_equal(previewed, over_wyoming)


@pytest.mark.parametrize(("path", "params", "status", "says"), [
    ("api/voices/en-male/preview", {"text": "   "}, 400, "type a sentence"),
    ("api/voices/en-male/preview", {"text": "*** ---"}, 400, "only markup"),
    # case C1: nothing to say is a clear answer, not a failure
    ("api/voices/en-male/preview", {"text": "。"}, 400, "nothing speakable"),
    ("api/voices/en-male/preview", {"text": "..."}, 400, "nothing speakable"),
    ("api/voices/en-male/preview", {"text": "?!"}, 400, "nothing speakable"),
    ("api/voices/en-male/preview", {"text": "👍"}, 400, "nothing speakable"),
    ("api/voices/en-male/preview", {"text": "x" * 501}, 400, "at most 500"),
    ("api/voices/nobody/preview", {"text": "Hi."}, 404, "no voice named"),
    ("api/voices/bad%20name/preview", {"text": "Hi."}, 404, "no voice named"),
])
async def test_preview_errors(shared: Shared, session: aiohttp.ClientSession, path: str,
                              params: dict, status: int, says: str) -> None:
    async with session.get(page_url(shared.server, path), params=params) as response:
        assert response.status == status
        assert says in (await response.json())["error"]


async def test_describe_stays_prompt_while_a_voice_is_added(
    shared: Shared, session: aiohttp.ClientSession,
) -> None:
    """The upload check, the clip decoding and the voice preparation run off the event loop."""
    clip = clip_bytes(30.0, 48000, channels=2, seed=11)  # the largest clip the page takes
    adding = asyncio.ensure_future(add_voice(session, shared.server, "big-voice", clip))
    latencies: list[float] = []
    for _ in range(200):  # bounded: 200 x (describe + 50 ms)
        started = time.monotonic()
        await describe(shared.server)
        latencies.append(time.monotonic() - started)
        if adding.done():
            break
        await asyncio.sleep(0.05)
    status, voice = await adding
    assert status == 201 and voice["clip_s"] == pytest.approx(30.0, abs=0.01), voice
    print(f"describe during an add: n={len(latencies)} median="
          f"{sorted(latencies)[len(latencies) // 2]:.3f}s max={max(latencies):.3f}s")
    assert len(latencies) >= 3  # describe was asked while the voice was being added
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    assert (await delete_voice(session, shared.server, "big-voice"))[0] == 200
