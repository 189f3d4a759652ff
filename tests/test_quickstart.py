"""The README's two quick-start lines, run as written in a fresh copy of the repository.

The server line runs until ``describe`` answers (the environment points it at the tiny
synthetic model and a free port, so no model download is needed); the test line runs with
``PYTEST_ADDOPTS`` limiting it to one short test file, so the suite does not run itself.
Package installs use the configured package index (the pip cache makes repeats fast), and pip
does not byte-compile what it installs (``PIP_COMPILE=0``): that is about 40 s of CPU for the
two lines' packages on a 2-core CI machine, writes only ``.pyc`` files that Python would
otherwise make when it imports a module, and changes nothing the lines are checked for.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from describe_poll import ask_describe, free_port
from server_support import link_engine_cache

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 1800.0
"""Hang guard per line (installing the dev extra into a fresh venv takes minutes)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(4000)]


def readme_line(marker: str) -> str:
    """The one command of the fenced block after ``<!-- quickstart:<marker> -->``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- quickstart:{marker} -->\n```sh\n(.+?)\n```", text)
    assert match, f"README has no quickstart:{marker} block"
    return match.group(1)


def fresh_copy(target: Path) -> Path:
    """The repository's files (tracked and new, not ignored) copied to ``target``."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listing):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree
        dest = target / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            dest.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, dest)
    return target


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COSYVOICE3_", "PYTEST_", "VIRTUAL_ENV"))}
    # pip reads an environment boolean as its option's value: PIP_COMPILE=0 is --no-compile
    # (PIP_NO_COMPILE=1 would turn compiling on)
    env["PIP_COMPILE"] = "0"
    env.update(extra)
    return env


def test_readme_lines_work_as_written_in_a_fresh_copy(tiny_model_dir: Path,
                                                      tiny_engine_cache: Path,
                                                      tmp_path: Path) -> None:
    server_line, tests_line = readme_line("server"), readme_line("tests")
    assert server_line.startswith("python3 -m venv .venv && ")
    assert tests_line.startswith("python3 -m venv .venv && ")
    assert server_line.endswith(" --data-dir ./data")
    work = fresh_copy(tmp_path / "clone")
    # the derived graphs of the tiny model come from the session's engine cache (a first
    # start's derivations: test_server_subprocess.py::test_started_as_the_readme_says)
    link_engine_cache(work / "data", tiny_engine_cache)
    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", server_line], cwd=work, stdout=log, stderr=subprocess.STDOUT,
            env=_env(COSYVOICE3_MODEL_DIR=str(tiny_model_dir),
                     COSYVOICE3_URI=f"tcp://127.0.0.1:{port}"),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + LIMIT_S
        answer = None
        while answer is None:
            assert process.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            try:
                answer = ask_describe(port)
            except OSError:
                time.sleep(0.5)
        assert answer[1]["tts"][0]["name"] == "cosyvoice3"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    assert (work / ".venv" / "bin" / "wyoming-cosyvoice3").is_file()

    done = subprocess.run(
        ["bash", "-c", tests_line], cwd=work, capture_output=True, text=True, timeout=LIMIT_S,
        env=_env(PYTEST_ADDOPTS="-p no:cacheprovider tests/test_server_settings.py"),
    )
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert re.search(r"\d+ passed", done.stdout), done.stdout[-2000:]
    installed = subprocess.run([str(work / ".venv/bin/python"), "-m", "pip", "list"],
                               capture_output=True, text=True, check=True).stdout
    assert "transformers" not in installed.lower()
