"""The one derivation sequence every cached derivation uses (engine/derive/files.py
``derive_once``): a valid result is reused, a failure is remembered by a ``.failed`` marker,
the helper itself never warns (the caller's fallback is the one warning), the files are
renamed into place so that a process killed half-way leaves no valid result (and the next
derivation removes its temporary files), and files of replaced sources are removed.

The derivation here writes small files whose content tells which call made them; the real
derivations (streaming DiT, fused LLM, vocoder forms) are tested in their own files.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from wyoming_cosyvoice3.engine.derive.common.files import derive_once, failure_marker
from wyoming_cosyvoice3.engine.errors import ModelFilesMissing, ModelLoadError

SOURCE = "flow.decoder.estimator.fp32.onnx"
STEM = "flow.decoder.estimator"
FILES = [("time", ".onnx"), ("main", ".onnx")]


class Maker:
    """A derivation: writes ``part <i> #<call>`` to each temporary path (but ``skip``), after
    ``delay_s``; then raises ``fail`` (when given)."""

    def __init__(self, fail: BaseException | None = None, skip: int | None = None,
                 delay_s: float = 0.0) -> None:
        self.calls = 0
        self.fail = fail
        self.skip = skip
        self.delay_s = delay_s

    def __call__(self, tmps: list[Path]) -> None:
        self.calls += 1
        time.sleep(self.delay_s)
        for i, tmp in enumerate(tmps):
            if i != self.skip:
                tmp.write_bytes(f"part {i} #{self.calls}".encode())
        if self.fail is not None:
            raise self.fail


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model" / SOURCE
    path.parent.mkdir()
    path.write_bytes(b"published graph")
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    folder = tmp_path / "cache"
    folder.mkdir()
    return folder


def key(source: Path) -> str:
    stat = source.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def test_a_valid_result_is_reused_and_not_made_again(source: Path, cache: Path) -> None:
    make = Maker()
    first = derive_once(source, cache, FILES, make, name="x")
    assert [p.name for p in first] == [f"{STEM}.time-{key(source)}.onnx",
                                       f"{STEM}.main-{key(source)}.onnx"]
    assert [p.read_bytes() for p in first] == [b"part 0 #1", b"part 1 #1"]
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in first)  # no tmp
    before = [p.stat().st_mtime_ns for p in first]
    assert derive_once(source, cache, FILES, make, name="x") == first
    assert make.calls == 1 and [p.stat().st_mtime_ns for p in first] == before
    # a result its module finds unusable (e.g. an unreadable report) is made again
    again = derive_once(source, cache, FILES, make, name="x", valid=lambda _: False)
    assert again == first and make.calls == 2
    assert [p.read_bytes() for p in first] == [b"part 0 #2", b"part 1 #2"]


def test_concurrent_callers_derive_once(source: Path, cache: Path) -> None:
    make = Maker(delay_s=0.3)  # the others arrive while the first one derives
    results: list[list[Path]] = []
    threads = [threading.Thread(target=lambda: results.append(
        derive_once(source, cache, FILES, make, name="x"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert make.calls == 1 and len(results) == 4 and all(r == results[0] for r in results)


def test_a_failure_leaves_a_marker_that_later_calls_honour(source: Path, cache: Path) -> None:
    make = Maker(fail=ValueError("no DiT structure found"))
    with pytest.raises(ModelLoadError, match=r"^splitting it failed: no DiT structure found$"):
        derive_once(source, cache, FILES, make, name="x", what="splitting it")
    guard = cache / f"{STEM}.main-{key(source)}.onnx"
    marker = failure_marker(guard)
    assert marker.name == guard.name + ".failed"
    assert marker.read_text(encoding="utf-8").strip() == "no DiT structure found"
    assert [p.name for p in cache.iterdir()] == [marker.name]  # no result, no temporary file
    # a later call (a later start) does not run the derivation again
    with pytest.raises(ModelLoadError, match=r"earlier attempt .* \(no DiT structure found\)"):
        derive_once(source, cache, FILES, make, name="x", what="splitting it")
    assert make.calls == 1
    # deleting the marker retries
    marker.unlink()
    good = Maker()
    paths = derive_once(source, cache, FILES, good, name="x", what="splitting it")
    assert good.calls == 1 and paths[-1] == guard and guard.read_bytes() == b"part 1 #1"


def test_error_types_and_messages(source: Path, cache: Path) -> None:
    # a ModelLoadError of the derivation is raised as it is
    with pytest.raises(ModelLoadError, match=r"^validation: differs by 0\.3$"):
        derive_once(source, cache, [("a", ".onnx")],
                    Maker(fail=ModelLoadError("validation: differs by 0.3")), name="x")
    # the default prefix, and a prefix of the caller's
    default = rf"^deriving the y from {re.escape(str(source))} failed: bad$"
    with pytest.raises(ModelLoadError, match=default):
        derive_once(source, cache, [("d", ".onnx")], Maker(fail=OSError("bad")), name="y")
    with pytest.raises(ModelLoadError, match=r"^fused LLM graph of llm\.onnx: bad$") as info:
        derive_once(source, cache, [("b", ".onnx")], Maker(fail=OSError("bad")), name="x",
                    failure="fused LLM graph of llm.onnx")
    assert isinstance(info.value.__cause__, OSError)
    # a derivation that returns without writing one of its files failed
    unmade = rf"^deriving the x from .* failed: no {STEM}\.time-.* was made$"
    with pytest.raises(ModelLoadError, match=unmade):
        derive_once(source, cache, [("time", ".onnx"), ("c", ".onnx")], Maker(skip=0), name="x")
    assert failure_marker(cache / f"{STEM}.c-{key(source)}.onnx").is_file()
    assert not list(cache.glob(f"{STEM}.c-*.onnx"))
    with pytest.raises(ModelFilesMissing):
        derive_once(source.with_name("missing.onnx"), cache, FILES, Maker(), name="x")


def test_the_helper_never_warns_so_the_caller_warns_once(
    source: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="wyoming_cosyvoice3"):
        for _ in range(2):  # the failure, then the marker
            with pytest.raises(ModelLoadError):
                derive_once(source, cache, FILES, Maker(fail=RuntimeError("oom")), name="x")
        derive_once(source, cache, [("ok", ".onnx")], Maker(), name="ok graph")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("ok graph ready in" in r.getMessage() for r in caplog.records)


def test_a_shared_file_already_present_is_kept(source: Path, cache: Path) -> None:
    shared = cache / f"{STEM}.time-{key(source)}.onnx"
    shared.write_bytes(b"made by the other precision")
    paths = derive_once(source, cache, FILES, Maker(), name="x", shared={"time"})
    assert paths[0] == shared and shared.read_bytes() == b"made by the other precision"
    assert paths[1].read_bytes() == b"part 1 #1"
    assert not list(cache.glob(".*tmp"))


def test_files_of_replaced_sources_and_retired_recipes_are_removed(
    source: Path, cache: Path
) -> None:
    old = [f"{STEM}.time-1-2.onnx", f"{STEM}.main-1-2.onnx", f"{STEM}.int8-1-2.onnx"]
    others = [f"{STEM}.int8main-1-2.onnx", f"{STEM}.stream2main-1-2.onnx", "llm.main-1-2.onnx"]
    for name in old + others:
        (cache / name).write_bytes(b"x")
    paths = derive_once(source, cache, FILES, Maker(), name="x", retired=["int8-*.onnx"])
    assert sorted(p.name for p in cache.iterdir()) == sorted(others + [p.name for p in paths])


CRASH = """
import os, signal, sys
from pathlib import Path
from wyoming_cosyvoice3.engine.derive.common import files

source, cache, stage = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
real = files.replace_atomically


def replace_then_die(tmp, target):
    real(tmp, target)
    os.kill(os.getpid(), signal.SIGKILL)


def make(tmps):
    for tmp in tmps:
        tmp.write_bytes(b"partial")
    if stage == "make":
        os.kill(os.getpid(), signal.SIGKILL)


files.replace_atomically = replace_then_die
files.derive_once(source, cache, [("time", ".onnx"), ("main", ".onnx")], make, name="x")
"""


@pytest.mark.parametrize("stage", ["make", "commit"])
def test_a_process_killed_half_way_leaves_no_valid_result(
    source: Path, cache: Path, stage: str
) -> None:
    """Killed while deriving, or after renaming the first file but before the guard: no
    result, no marker (a crash is not a failure of the graph); the next call derives anew."""
    proc = subprocess.run([sys.executable, "-c", CRASH, str(source), str(cache), stage],
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    time_graph, guard = (cache / f"{STEM}.{tag}-{key(source)}.onnx" for tag in ("time", "main"))
    assert not guard.exists() and not failure_marker(guard).exists()
    assert time_graph.exists() == (stage == "commit")
    left = list(cache.glob(".*.tmp"))  # the killed process's temporary files stay hidden
    assert left
    # a temporary file of a process that still runs (another server on this data dir) stays
    alive = guard.with_name(f".{guard.name}.{os.getppid()}.1.tmp")
    alive.write_bytes(b"in progress")
    make = Maker()
    paths = derive_once(source, cache, FILES, make, name="x")
    assert make.calls == 1 and paths == [time_graph, guard]
    assert [p.read_bytes() for p in paths] == [b"part 0 #1", b"part 1 #1"]
    # the next derivation removed what the killed process left, and only that
    assert not any(path.exists() for path in left) and alive.read_bytes() == b"in progress"
