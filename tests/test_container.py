"""Container pieces without a Docker engine: run.sh's check of /data, the health check's
address (the one the server listens on) and its answer while the model is missing."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from server_support import make_settings, running_server

from wyoming_cosyvoice3.server import healthcheck

ROOT = Path(__file__).resolve().parents[1]


def test_probe_uri_follows_the_listening_address() -> None:
    assert healthcheck.probe_uri("tcp://0.0.0.0:10200", 10200) == "tcp://127.0.0.1:10200"
    assert healthcheck.probe_uri("tcp://0.0.0.0:0", 41234) == "tcp://127.0.0.1:41234"
    assert healthcheck.probe_uri("tcp://192.168.1.5:10300", None) == "tcp://192.168.1.5:10300"
    assert healthcheck.probe_uri("tcp://[::]:10200", 10200) == "tcp://127.0.0.1:10200"
    assert healthcheck.probe_uri("unix:///run/cv.sock", None) == "unix:///run/cv.sock"
    assert healthcheck.probe_uri("stdio://", None) is None


async def test_health_check_uses_the_configured_address_and_stays_healthy_without_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri_file = tmp_path / "health.uri"
    monkeypatch.setenv(healthcheck.HEALTH_URI_FILE_VARIABLE, str(uri_file))
    empty = tmp_path / "model"
    empty.mkdir()  # no model files: the model fails, the process still answers
    async with running_server(make_settings(empty, tmp_path)) as server:
        assert uri_file.read_text().strip() == f"tcp://127.0.0.1:{server.port}"
        assert await asyncio.to_thread(healthcheck.main, []) == 0
        assert await asyncio.to_thread(healthcheck.main, ["--ready", "--timeout", "5"]) == 1
    assert await asyncio.to_thread(healthcheck.main, ["--timeout", "2"]) == 1  # stopped


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="run.sh's root path needs root and setpriv")
def test_run_sh_names_the_fix_when_data_is_not_writable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE3_")}
    env.update(COSYVOICE3_CONTAINER_DATA_DIR="/proc/sys",  # not writable, even for root
               COSYVOICE3_CONTAINER_CONFIG_DIR=str(tmp_path / "no-config"))
    done = subprocess.run(["bash", str(ROOT / "run.sh"), "--version"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 78, done
    assert "/proc/sys is not writable by uid" in done.stderr
    assert "sudo chown -R 1000:1000 ./data" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="run.sh's root path needs root and setpriv")
def test_run_sh_gives_a_root_owned_data_dir_to_the_server_user(tmp_path: Path) -> None:
    # root-owned, as `docker run -v ./data:/data` creates it; in a directory uid 1000 can
    # traverse (pytest's own temporary directories are private to root)
    base = Path(tempfile.mkdtemp(prefix="cosyvoice3-run-sh-"))
    base.chmod(0o755)
    data = base / "data"
    data.mkdir(mode=0o755)
    request_cleanup = base
    server = base / "server.sh"  # stands in for wyoming-cosyvoice3: who runs it, with what
    server.write_text('#!/bin/sh\nid -u\necho "$@"\n')
    server.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE3_")}
    env.update(COSYVOICE3_CONTAINER_DATA_DIR=str(data),
               COSYVOICE3_CONTAINER_CONFIG_DIR=str(tmp_path / "no-config"),
               COSYVOICE3_CONTAINER_SERVER=str(server))
    done = subprocess.run(["bash", str(ROOT / "run.sh"), "--version"], capture_output=True,
                          text=True, env=env, timeout=120)
    try:
        assert done.returncode == 0, done
        assert data.stat().st_uid == 1000
        assert done.stdout.split("\n")[:2] == ["1000", f"--data-dir {data} --version"]
    finally:
        shutil.rmtree(request_cleanup, ignore_errors=True)


@pytest.mark.parametrize("add_on", [False, True])
def test_run_sh_serves_the_voice_page_for_ingress_only_in_the_add_on(
    tmp_path: Path, add_on: bool
) -> None:
    """In the add-on (Supervisor sets SUPERVISOR_TOKEN) run.sh adds the voice page on the
    config.yaml ingress_port, answering only the ingress proxy; plain Docker gets no page."""
    data = tmp_path / "data"
    data.mkdir()
    server = tmp_path / "server.sh"  # stands in for wyoming-cosyvoice3: prints its arguments
    server.write_text('#!/bin/sh\necho "$@"\n')
    server.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("COSYVOICE3_") and k != "SUPERVISOR_TOKEN"}
    env.update(COSYVOICE3_CONTAINER_DATA_DIR=str(data),
               COSYVOICE3_CONTAINER_CONFIG_DIR=str(tmp_path / "no-config"),
               COSYVOICE3_CONTAINER_SERVER=str(server), COSYVOICE3_CONTAINER_UID=str(os.geteuid()))
    if add_on:
        env["SUPERVISOR_TOKEN"] = "token"
    done = subprocess.run(["bash", str(ROOT / "run.sh"), "--debug"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done
    args = done.stdout.strip().splitlines()[-1]
    ingress_port = yaml.safe_load((ROOT / "cosyvoice3" / "config.yaml").read_text())[
        "ingress_port"]
    page = f"--http-port {ingress_port} --http-host 0.0.0.0 --http-allow-from 172.30.32.2"
    expected = f"--data-dir {data} {page} --debug" if add_on else f"--data-dir {data} --debug"
    assert args == expected
