"""The wheel holds what runs in production and nothing else: built from a copy of the
repository's files with pip (``python -m pip wheel . --no-deps``), then listed.

Expected contents come from the repository's tree, not from the packaging configuration: every
Python module tracked under ``wyoming_cosyvoice3/``, the voice page's static files and the
built-in catalog are in it; the benchmark (``bench/``), the synthetic-model builder
(``synthetic/``), the tests and the tools are not, and no console script points at them.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "wyoming_cosyvoice3"
LEFT_OUT = ("bench", "synthetic", "tests", "tools", "scripts", "docs")
"""Top-level folders of the repository that are development tooling or documents."""


def tracked_files() -> list[str]:
    """The repository's files (tracked and new, not ignored), relative POSIX paths."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
    return [name for name in listing.split("\0") if name and (ROOT / name).exists()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a clean copy (a build in the work tree would reuse a stale
    ``build/`` folder, which can carry modules that are gone)."""
    base = tmp_path_factory.mktemp("wheel")
    source, out = base / "src", base / "dist"
    for name in tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_NO_")}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
         "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("wyoming_cosyvoice3-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_no_development_tooling_in_the_wheel(wheel_names: list[str]) -> None:
    parts = [PurePosixPath(name).parts for name in wheel_names]
    tops = {p[0] for p in parts}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {PACKAGE} and len(dist_info) == 1
    offenders = [name for name, p in zip(wheel_names, parts, strict=True)
                 if set(p[:-1]) & set(LEFT_OUT)]
    assert offenders == []


def test_every_product_module_is_in_the_wheel(wheel_names: list[str]) -> None:
    product = {name for name in tracked_files()
               if name.startswith(f"{PACKAGE}/") and name.endswith(".py")}
    assert {f"{PACKAGE}/__main__.py", f"{PACKAGE}/server/cli.py",
            f"{PACKAGE}/server/hooks.py", f"{PACKAGE}/engine/pipeline.py"} <= product
    assert product - set(wheel_names) == set()
    static = {name for name in tracked_files() if name.startswith(f"{PACKAGE}/server/web/static/")}
    assert static and static <= set(wheel_names)
    assert {f"{PACKAGE}/py.typed", f"{PACKAGE}/config/voices.yaml"} <= set(wheel_names)


def test_console_scripts_are_the_products(wheel: Path, wheel_names: list[str]) -> None:
    (entry_points,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(entry_points).decode()
    parser = configparser.ConfigParser()
    parser.read_string(text)
    scripts = dict(parser["console_scripts"])
    assert scripts == {"wyoming-cosyvoice3": f"{PACKAGE}.server.cli:main",
                       "cosyvoice3-synth": f"{PACKAGE}.engine.cli:main"}
