"""The voice page in a real headless browser (Debian's Chromium driven by Selenium) against the
real server on the tiny synthetic model: add a voice by upload, preview it, see it in
``describe`` over a real Wyoming TCP client, delete it; record a voice with the page's recorder
(Chromium's fake microphone plays a speech-like clip).

Needs ``chromium`` and ``chromium-driver`` (Debian packages; ``.ci/run`` installs them) and
the ``selenium`` package (``.[dev]``). ``VOICE_PAGE_SCREENSHOT=docs/voice-page.png`` saves the
screenshot used in the README.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import pytest
import pytest_asyncio
import soundfile as sf
from machine_figures import AVX2
from server_support import SpyEngine, describe, make_settings, running_server, spy_factory
from web_support import catalog_items, delete_voice, ingress_proxy, page_url

from synthetic.audio import write_clip
from wyoming_cosyvoice3.engine.machine import choose_preset
from wyoming_cosyvoice3.server import machine, model_loader
from wyoming_cosyvoice3.server.cli import RunningServer


def browser_required(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a missing browser is a failure here (``CI`` set, as CI runs with ``CI=true``, or
    ``COSYVOICE3_REQUIRE_BROWSER=1``), or None: then it is a skip."""
    if environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return f"CI={environ['CI']} is set"
    if environ.get("COSYVOICE3_REQUIRE_BROWSER") == "1":
        return "COSYVOICE3_REQUIRE_BROWSER=1 is set"
    return None


def browser_missing(reason: str) -> NoReturn:
    """Fail (CI, or the browser test required) or skip the whole module."""
    required = browser_required()
    if required is not None:
        pytest.fail(f"{reason}; the browser test is required because {required}",
                    pytrace=False)
    pytest.skip(f"{reason} (skipped: set CI or COSYVOICE3_REQUIRE_BROWSER=1 to fail instead)",
                allow_module_level=True)


try:
    from selenium import webdriver
    from selenium.common.exceptions import (
        StaleElementReferenceException,
        TimeoutException,
    )
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:
    browser_missing("selenium is not installed (pip install -e '.[dev]')")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    browser_missing("Chromium is not installed: apt-get install chromium chromium-driver "
                    "(.ci/run does this in CI)")

pytestmark = pytest.mark.asyncio(loop_scope="module")
WAIT_S = 120.0
"""Upper bound for the page to reach a state (a hang guard on a busy 2-core machine)."""


class Shared:
    server: RunningServer
    spy: SpyEngine
    data_dir: Path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tiny_model_dir: Path, tiny_engine_cache: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Shared]:
    data_dir = tmp_path_factory.mktemp("data")
    holder: list[SpyEngine] = []
    settings = make_settings(tiny_model_dir, data_dir, tiny_engine_cache, http_port=0,
                             preset="quality")
    async with running_server(settings, spy_factory(holder)) as server:
        state = Shared()
        state.server, state.spy, state.data_dir = server, holder[0], data_dir
        yield state


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # the microphone is a fake device playing a speech-like clip (allowed without a prompt)
    microphone = write_clip(tmp_path_factory.mktemp("microphone") / "mic.wav", seconds=6.0,
                            sample_rate_hz=48000, seed=12)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--autoplay-policy=no-user-gesture-required",
                     "--window-size=1100,1500", "--use-fake-ui-for-media-stream",
                     "--use-fake-device-for-media-stream",
                     f"--use-file-for-fake-audio-capture={microphone}",
                     f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(argument)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, condition: Any, what: str) -> Any:
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(condition)
    except TimeoutException:
        message = driver.find_element(By.ID, "form-message").text
        preview = driver.find_element(By.ID, "preview-message").text
        raise AssertionError(f"timed out waiting for {what}; form says {message!r}, "
                             f"preview says {preview!r}") from None


def row_state(driver: Any, name: str) -> str | None:
    """The State cell of a voice's row (read in one script: the table may re-render)."""
    state: str | None = driver.execute_script(
        "const row = [...document.querySelectorAll('#voices tbody tr')]"
        "  .find(r => r.dataset.voice === arguments[0]);"
        "return row ? row.cells[4].innerText : null;", name)
    return state


def click_row_button(driver: Any, name: str, label: str) -> None:
    """Click a button of a voice's row like a user (found again if the table re-rendered)."""
    for _ in range(5):
        try:
            row = driver.find_element(By.CSS_SELECTOR, f'tr[data-voice="{name}"]')
            row.find_element(By.XPATH, f".//button[text()='{label}']").click()
            return
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"the {label} button of {name} kept being replaced")


def fill_voice_form(driver: Any, name: str, clip: Path, transcript: str = "") -> None:
    driver.find_element(By.ID, "f-name").send_keys(name)
    driver.find_element(By.ID, "f-languages").send_keys("en, de")
    driver.find_element(By.ID, "f-description").send_keys(f"{name} from the browser")
    if transcript:
        driver.find_element(By.ID, "f-transcript").send_keys(transcript)
    driver.find_element(By.ID, "f-clip").send_keys(str(clip))
    driver.find_element(By.ID, "save").click()


def add_preview_delete(driver: Any, url: str, clips: Path, data_dir: Path,
                       check_describe: Any, screenshot: Path) -> dict[str, Any]:
    """The user's path through the page (blocking Selenium calls; runs in a thread)."""
    found: dict[str, Any] = {}
    driver.get(url)
    wait_for(driver, lambda d: "model ready" in d.find_element(By.ID, "status").text,
             "the model state")
    assert row_state(driver, "en-male") == "installed"
    # a preset given in the settings is shown as such (no machine measurement)
    assert driver.find_element(By.ID, "preset").text == "Preset quality (set in the options)."

    # a clip the catalog would refuse: the page shows what to change, nothing is saved
    fill_voice_form(driver, "tooshort", write_clip(clips / "short.wav", seconds=0.5))
    wait_for(driver, lambda d: "shorter than 1 s" in d.find_element(By.ID, "form-message").text,
             "the refusal of a 0.5 s clip")
    found["refusal"] = driver.find_element(By.ID, "form-message").text
    assert catalog_items(data_dir) == []
    driver.execute_script("document.getElementById('voice-form').reset()")

    # add a voice by upload
    clip = write_clip(clips / "anna.flac", seconds=3.0, sample_rate_hz=44100, seed=4)
    fill_voice_form(driver, "anna", clip, transcript="Hello, this is Anna.")
    wait_for(driver, lambda d: row_state(d, "anna") == "installed", "the new voice's row")
    found["saved_message"] = driver.find_element(By.ID, "form-message").text
    found["row"] = driver.execute_script(
        "return document.querySelector('tr[data-voice=\"anna\"]').innerText;")
    found["describe_after_add"] = check_describe()

    # preview: the page selected the new voice; the audio element gets the streamed WAV
    assert Select(driver.find_element(By.ID, "preview-voice")).first_selected_option.text == "anna"
    text_box = driver.find_element(By.ID, "preview-text")
    text_box.clear()
    text_box.send_keys("Good morning, the coffee is ready.")
    driver.find_element(By.ID, "preview-button").click()
    wait_for(driver, lambda d: d.execute_script(
        "const a = document.getElementById('preview-audio'); return a.ended || a.error;"),
        "the preview to play to its end")
    found["audio"] = driver.execute_script(
        "const a = document.getElementById('preview-audio');"
        "return {error: a.error && a.error.message, duration: a.duration,"
        " played: a.played.length ? a.played.end(0) : 0, src: a.currentSrc};")
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(screenshot))

    # edit it: the form is filled with the voice; a new instruction switches to instruct mode
    click_row_button(driver, "anna", "Edit")
    assert driver.find_element(By.ID, "f-languages").get_attribute("value") == "en, de"
    assert driver.find_element(By.ID, "f-name").get_attribute("readOnly") == "true"
    driver.find_element(By.ID, "f-instruction").send_keys("Speak slowly.")
    driver.find_element(By.ID, "save").click()
    wait_for(driver, lambda d: "instruct" in d.execute_script(
        "const r = document.querySelector('tr[data-voice=\"anna\"]');"
        "return r ? r.innerText : '';"), "the edited row")
    found["edited"] = [item for item in catalog_items(data_dir) if item["name"] == "anna"]

    # delete it (the page asks for confirmation)
    click_row_button(driver, "anna", "Delete")
    alert = WebDriverWait(driver, WAIT_S).until(lambda d: d.switch_to.alert)
    found["confirm"] = alert.text
    alert.accept()
    wait_for(driver, lambda d: row_state(d, "anna") is None, "the row to disappear")
    found["describe_after_delete"] = check_describe()
    return found


async def test_add_preview_delete_in_a_real_browser(shared: Shared, browser: Any,
                                                    tmp_path: Path) -> None:
    await check_add_preview_delete(shared, browser, tmp_path, page_url(shared.server),
                                   os.environ.get("VOICE_PAGE_SCREENSHOT"))


async def test_the_same_through_an_ingress_proxy(shared: Shared, browser: Any,
                                                 tmp_path: Path) -> None:
    """Home Assistant's add-on ingress serves the page under a path prefix of its own origin:
    every URL of the page is relative, so the same steps work there."""
    async with ingress_proxy(page_url(shared.server).rstrip("/")) as url:
        await check_add_preview_delete(shared, browser, tmp_path, url, None)


async def check_add_preview_delete(shared: Shared, browser: Any, tmp_path: Path, url: str,
                                   screenshot_path: str | None) -> None:
    loop = asyncio.get_running_loop()
    syntheses_before = len(shared.spy.texts)
    checked = threading.Event()

    def check_describe() -> dict[str, bool]:
        """A real Wyoming client's view (run on the server's loop from the browser thread)."""
        info = asyncio.run_coroutine_threadsafe(describe(shared.server), loop).result(60)
        checked.set()
        return {voice.name: voice.installed for voice in info.tts[0].voices}

    screenshot = Path(screenshot_path or tmp_path / "page.png")
    found = await asyncio.to_thread(add_preview_delete, browser, url, tmp_path,
                                    shared.data_dir, check_describe, screenshot)

    assert "shorter than 1 s" in found["refusal"] and "3-30 s" in found["refusal"]
    assert "reload the Wyoming integration" in found["saved_message"]
    assert "zero-shot" in found["row"] and "3.0 s" in found["row"]
    assert found["describe_after_add"].get("anna") is True
    audio = found["audio"]
    assert audio["error"] is None
    assert audio["src"].startswith(url + "api/voices/anna/preview?text=")
    assert audio["duration"] > 0.1 and audio["played"] == pytest.approx(audio["duration"],
                                                                        abs=0.05)
    spoken = list(zip(shared.spy.voices, shared.spy.texts, strict=True))[syntheses_before:]
    assert spoken == [("anna", "Good morning, the coffee is ready.")]
    assert [item["instruction"] for item in found["edited"]] == ["Speak slowly."]
    assert found["edited"][0]["transcript"] == "Hello, this is Anna."  # kept
    assert "Delete the voice anna" in found["confirm"]
    assert "anna" not in found["describe_after_delete"]
    assert catalog_items(shared.data_dir) == []
    assert not list((shared.data_dir / "clips").glob("anna*"))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def record_and_save(driver: Any, url: str, seconds: float) -> dict[str, Any]:
    """Record a clip with the page's recorder (the fake microphone) and save it as a voice."""
    driver.get(url)
    wait_for(driver, lambda d: "model ready" in d.find_element(By.ID, "status").text,
             "the model state")
    driver.find_element(By.ID, "f-name").send_keys("recorded")
    driver.find_element(By.ID, "f-languages").send_keys("en")
    driver.find_element(By.ID, "record").click()
    wait_for(driver, lambda d: "recording" in d.find_element(By.ID, "record-state").text,
             "the recorder to start")
    threading.Event().wait(seconds)
    driver.find_element(By.ID, "record").click()
    wait_for(driver, lambda d: "recorded" in d.find_element(By.ID, "record-state").text,
             "the recording to be encoded")
    found = {"state": driver.find_element(By.ID, "record-state").text}
    driver.find_element(By.ID, "save").click()
    wait_for(driver, lambda d: row_state(d, "recorded") == "installed", "the recorded voice")
    found["row"] = driver.execute_script(
        "return document.querySelector('tr[data-voice=\"recorded\"]').innerText;")
    return found


async def test_record_a_voice_in_the_browser(shared: Shared, browser: Any) -> None:
    found = await asyncio.to_thread(record_and_save, browser, page_url(shared.server), 3.0)
    items = [item for item in catalog_items(shared.data_dir) if item["name"] == "recorded"]
    assert len(items) == 1 and items[0]["clip"] == "clips/recorded.wav"
    info = sf.info(str(shared.data_dir / "clips" / "recorded.wav"))
    # the page encodes the recording as 16-bit mono WAV at the browser's rate
    assert (info.format, info.subtype, info.channels) == ("WAV", "PCM_16", 1)
    assert info.samplerate >= 16000 and 2.0 < info.duration < 10.0
    assert f"recorded {info.duration:.1f} s" in found["state"]
    assert "cross-lingual" in found["row"] and f"{info.duration:.1f} s" in found["row"]
    installed = {v.name: v.installed for v in (await describe(shared.server)).tts[0].voices}
    assert installed.get("recorded") is True
    async with aiohttp.ClientSession() as http:
        assert (await delete_voice(http, shared.server, "recorded"))[0] == 200



async def test_the_page_shows_what_auto_chose(tiny_model_dir: Path, tiny_engine_cache: Path,
                                              browser: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``--preset auto`` with the machine probe replaced by the figures of the AVX2 machine
    (test_machine.py): balanced, slower than playback, and the prediction's line on the page."""
    reference = AVX2
    monkeypatch.setattr(machine, "probe_rates", lambda *_args, **_kw: reference)
    monkeypatch.setattr(machine, "available_memory_bytes", lambda: 16e9)
    # two CPUs: the server decodes beside the flow, as it does by default on any test machine
    monkeypatch.setattr(model_loader, "available_cpus", lambda: 2)
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache, http_port=0,
                             preset="auto")
    async with running_server(settings) as server:
        def shown() -> str:
            browser.get(page_url(server))
            wait_for(browser, lambda d: "model ready" in d.find_element(By.ID, "status").text,
                     "the model state")
            return str(browser.find_element(By.ID, "preset").text)

        text = await asyncio.to_thread(shown)
    # the page shows the choice's own line (its figures are checked in test_machine.py)
    choice = choose_preset(reference, 16e9, split_cores=True)
    assert choice.preset == "balanced" and not choice.keeps_up
    assert text.startswith("Preset balanced (chosen for this machine): this machine makes "
                           "speech at about "), text
    speed = f"{1 / choice.predicted_rtf['balanced']:.2g}x playback speed"
    assert speed in text and "expect pauses between sentences on long answers." in text
    others = ", ".join(f"{name} {rtf:.2f}" for name, rtf in choice.predicted_rtf.items())
    assert text.endswith(f"{others}."), text


def test_ci_or_the_variable_requires_the_browser() -> None:
    assert browser_required({"CI": "true"}) == "CI=true is set"
    assert browser_required({"CI": "1"}) == "CI=1 is set"
    assert browser_required({"COSYVOICE3_REQUIRE_BROWSER": "1"}) == (
        "COSYVOICE3_REQUIRE_BROWSER=1 is set")
    for environ in ({}, {"CI": ""}, {"CI": "false"}, {"COSYVOICE3_REQUIRE_BROWSER": "0"}):
        assert browser_required(environ) is None, environ


@pytest.mark.parametrize("ci", [True, False])
def test_a_missing_browser_fails_in_ci_and_skips_elsewhere(tmp_path: Path, ci: bool) -> None:
    """This module collected where Chromium is not on PATH (PATH is an empty folder)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "COSYVOICE3_REQUIRE_BROWSER", "PYTEST_ADDOPTS")}
    env["PATH"] = str(tmp_path)
    if ci:
        env["CI"] = "true"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--collect-only", "-rs", Path(__file__).name],
                         cwd=Path(__file__).parent, env=env, capture_output=True, text=True,
                         timeout=120)
    output = run.stdout + run.stderr
    assert "Chromium is not installed: apt-get install chromium chromium-driver" in output
    if ci:
        assert run.returncode == pytest.ExitCode.INTERRUPTED, output  # a collection error
        assert "the browser test is required because CI=true is set" in output, output
    else:
        assert run.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, output
        assert "SKIPPED [1]" in output and "COSYVOICE3_REQUIRE_BROWSER=1 to fail" in output
