"""The Home Assistant add-on folder (cosyvoice3/) and repository.yaml: every option of the
schema is a server setting with a compatible type, the options reach the server through the
options file as the add-on writes it, the translations cover the schema, discovery is sent
once the server answers."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from wyoming_cosyvoice3.server import addon
from wyoming_cosyvoice3.server.settings import OPTIONS, SettingsError, resolve_settings

ROOT = Path(__file__).resolve().parents[1]
ADDON = ROOT / "cosyvoice3"
_SCHEMA_RE = re.compile(r"^(?P<kind>\w+)(?:\((?P<args>[^)]*)\))?(?P<optional>\?)?$")


def _config() -> dict[str, Any]:
    return yaml.safe_load((ADDON / "config.yaml").read_text(encoding="utf-8"))


def _option_for(key: str) -> Any:
    for opt in OPTIONS:
        if key in (opt.key, opt.positive_key):
            return opt
    raise AssertionError(f"add-on option {key!r} is no server setting")


def _resolve(tmp_path: Path, options: dict[str, Any]) -> Any:
    path = tmp_path / "options.json"
    path.write_text(json.dumps(options), encoding="utf-8")
    return resolve_settings(["--options-file", str(path), "--data-dir", str(tmp_path)],
                            environ={})


def test_config_follows_the_add_on_conventions() -> None:
    config = _config()
    assert set(config["arch"]) == {"amd64", "aarch64"}
    assert config["ports"] == {"10200/tcp": 10200}
    assert config["discovery"] == ["wyoming"]
    assert config["init"] is False
    assert {"type": "addon_config", "read_only": False} in config["map"]
    assert {"*.onnx", "*.onnx.data", "engine-cache/*", "voice-cache/*"} <= set(
        config["backup_exclude"])
    assert set(config["options"]) == set(config["schema"])
    assert {"preset", "voice", "llm_precision", "threads", "speed", "streaming",
            "debug"} <= set(config["schema"])
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'\nversion = "{config["version"]}"\n' in project
    assert f"## {config['version']}" in (ADDON / "CHANGELOG.md").read_text(encoding="utf-8")
    for name in ("icon.png", "logo.png"):
        assert (ADDON / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert (ADDON / "DOCS.md").read_text(encoding="utf-8").startswith("# ")
    repository = yaml.safe_load((ROOT / "repository.yaml").read_text(encoding="utf-8"))
    assert repository["name"] and repository["url"].startswith("https://")


@pytest.mark.parametrize("key", sorted(_config()["schema"]))
def test_schema_option_is_a_server_setting_of_a_compatible_type(key: str) -> None:
    match = _SCHEMA_RE.match(str(_config()["schema"][key]))
    assert match, key
    kind, args = match["kind"], match["args"]
    opt = _option_for(key)
    if kind == "list":
        assert opt.choices is not None and set(args.split("|")) == set(opt.choices)
    elif kind == "bool":
        assert opt.kind in ("bool-true", "bool-false")
    elif kind in ("int", "float"):
        assert opt.kind == "value" and opt.convert is not None
        low, _, high = (args or ",").partition(",")
        for bound in (low, high):  # every value the schema allows is accepted
            if bound:
                assert opt.convert(bound) == (int if kind == "int" else float)(bound)
        if low:  # and the server refuses what the schema refuses below
            below = str(int(low) - 1) if kind == "int" else str(float(low) - 0.01)
            with pytest.raises(ValueError):
                opt.convert(below)
    elif kind == "str":
        assert opt.kind == "value" and opt.convert is str and opt.choices is None
    else:
        raise AssertionError(f"unhandled schema type {kind!r} for {key}")


def test_default_and_changed_options_reach_the_server(tmp_path: Path) -> None:
    defaults = _resolve(tmp_path, _config()["options"])
    assert (defaults.preset, defaults.voice, defaults.llm_precision, defaults.threads,
            defaults.split_cores, defaults.speed, defaults.streaming, defaults.debug) == (
        "auto", None, "int8", 0, True, 1.0, True, False)
    changed = _resolve(tmp_path, {"preset": "fast", "voice": "en-male", "llm_precision": "q4",
                                  "threads": 3, "split_cores": False, "speed": 1.5,
                                  "streaming": False, "debug": True})
    assert (changed.preset, changed.voice, changed.llm_precision, changed.threads,
            changed.split_cores, changed.speed, changed.streaming, changed.debug) == (
        "fast", "en-male", "q4", 3, False, 1.5, False, True)
    with pytest.raises(SettingsError, match="streaming"):
        _resolve(tmp_path, {"streaming": "maybe"})


def test_translations_cover_the_schema_and_the_port() -> None:
    config = _config()
    translations = yaml.safe_load((ADDON / "translations" / "en.yaml").read_text("utf-8"))
    assert set(translations["configuration"]) == set(config["schema"])
    for key, text in translations["configuration"].items():
        assert text["name"].strip() and text["description"].strip(), key
    assert set(translations["network"]) == set(config["ports"])


class _Supervisor(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, str, dict[str, Any]]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append((self.path, self.headers["Authorization"], body))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


async def test_discovery_is_sent_once_the_server_answers(tmp_path: Path) -> None:
    from server_support import make_settings, running_server

    supervisor = ThreadingHTTPServer(("127.0.0.1", 0), _Supervisor)
    threading.Thread(target=supervisor.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{supervisor.server_address[1]}"
    try:
        # nothing listens yet: no discovery is sent
        assert not await asyncio.wait_for(
            _announce_with_limit(1, "token", url), 30)
        assert _Supervisor.received == []
        empty = tmp_path / "model"
        empty.mkdir()
        async with running_server(make_settings(empty, tmp_path), wait_ready=False) as server:
            port = server.port
            assert port is not None
            assert await addon.announce(port, "secret-token", url)
    finally:
        supervisor.shutdown()
    path, authorization, body = _Supervisor.received[0]
    assert path == "/discovery" and authorization == "Bearer secret-token"
    assert body["service"] == "wyoming"
    assert re.fullmatch(r"tcp://[^:/]+:\d+", body["config"]["uri"])
    assert body["config"]["uri"].endswith(f":{port}")


async def _announce_with_limit(port: int, token: str, url: str) -> bool:
    saved = addon.ANSWER_WAIT_S
    addon.ANSWER_WAIT_S = 1.0
    try:
        return await addon.announce(port, token, url)
    finally:
        addon.ANSWER_WAIT_S = saved
