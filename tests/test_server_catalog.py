"""Voice catalog: the built-in file, user catalogs in data dirs, broken entries, path safety."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from wyoming_cosyvoice3.server.catalog import (
    default_catalog_path,
    load_catalog_file,
    load_catalogs,
    resolve_clip,
    with_model_dir,
)


def test_builtin_catalog(tmp_path: Path) -> None:
    assert default_catalog_path().is_file()
    entries = {e.name: e for e in load_catalogs([], None)}
    assert list(entries) == ["zh-female", "en-male"]
    zh, en = entries["zh-female"], entries["en-male"]
    assert zh.clip == "voices/zh-female.wav"
    assert zh.transcript == "希望你以后能够做的比我还好呦。"
    assert en.clip == "voices/en-male.wav" and en.transcript is None
    assert zh.problem is None and en.problem is None
    assert zh.languages[0] == "zh" and en.languages[0] == "en"
    assert "Apache-2.0" in zh.attribution_name and "CC BY 4.0" in en.attribution_name
    # the clips are found in the model dir once it is known
    model_dir = tmp_path / "model"
    (model_dir / "voices").mkdir(parents=True)
    (model_dir / "voices" / "en-male.wav").write_bytes(b"x")
    located = {e.name: e for e in with_model_dir(list(entries.values()), model_dir)}
    assert resolve_clip(located["en-male"]) == (model_dir / "voices" / "en-male.wav").resolve()
    with pytest.raises(ValueError, match="not found"):
        resolve_clip(located["zh-female"])


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_data_dir_catalog_adds_and_replaces_voices(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write(data / "clips" / "me.wav", "x")
    write(data / "voices.yaml", """
voices:
  - name: me
    description: Me
    languages: [de]
    clip: clips/me.wav
    instruction: Speak slowly.
  - name: en-male
    languages: [en]
    clip: clips/me.wav
    transcript: Hello there.
""")
    entries = {e.name: e for e in load_catalogs([data], None)}
    assert list(entries) == ["zh-female", "me", "en-male"]
    assert entries["en-male"].transcript == "Hello there."  # the data dir's entry wins
    assert entries["me"].instruction == "Speak slowly."
    assert resolve_clip(entries["me"]) == (data / "clips" / "me.wav").resolve()


def test_voices_file_paths_are_relative_to_it(tmp_path: Path) -> None:
    catalog = write(tmp_path / "extra" / "my.yaml",
                    "voices:\n  - {name: x, languages: [en], clip: x.wav}\n")
    write(tmp_path / "extra" / "x.wav", "x")
    entries = {e.name: e for e in load_catalogs([], None, voices_file=catalog)}
    assert resolve_clip(entries["x"]) == (tmp_path / "extra" / "x.wav").resolve()


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("{name: a, clip: c.wav}", "languages"),
        ("{name: a, languages: [en]}", "'clip' is missing"),
        ("{name: a, languages: [en], clip: 5}", "'clip' must be text"),
        ("{name: a, languages: ['not a code!'], clip: c.wav}", "invalid code"),
        ("{name: a, languages: [en], clip: c.wav, transcript: [1]}", "'transcript'"),
        ("{name: a, languages: [en], clip: c.wav, attribution: 3}", "attribution"),
    ],
)
def test_broken_entry_is_kept_disabled(tmp_path: Path, entry: str, problem: str,
                                       caplog: pytest.LogCaptureFixture) -> None:
    catalog = write(tmp_path / "voices.yaml", f"voices:\n  - {entry}\n  - "
                    "{name: ok, languages: [en], clip: c.wav}\n")
    with caplog.at_level(logging.WARNING):
        entries = load_catalog_file(catalog, [tmp_path])
    assert [e.name for e in entries] == ["a", "ok"]
    assert entries[0].problem is not None and problem in entries[0].problem
    assert entries[1].problem is None
    assert len(caplog.records) == 1 and "'a'" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "text",
    ["voices: [", "just text", "voices: {a: 1}", "- name: a", "voices:\n  - [1, 2]\n",
     "voices:\n  - {name: 'ü-umlaut', languages: [en], clip: c.wav}\n",
     "!!python/object/apply:os.system ['echo hacked']"],
)
def test_unusable_catalogs_are_skipped(tmp_path: Path, text: str,
                                       caplog: pytest.LogCaptureFixture) -> None:
    catalog = write(tmp_path / "voices.yaml", text)
    with caplog.at_level(logging.WARNING):
        assert load_catalog_file(catalog, [tmp_path]) == []
    assert len(caplog.records) == 1
    assert str(catalog) in caplog.records[0].getMessage()


def test_clip_paths_cannot_leave_the_allowed_directories(tmp_path: Path) -> None:
    data = tmp_path / "data"
    secret = write(tmp_path / "secret.wav", "x")
    write(data / "inside.wav", "x")
    os.symlink(secret, data / "link.wav")
    catalog = write(data / "voices.yaml", f"""
voices:
  - {{name: up, languages: [en], clip: ../secret.wav}}
  - {{name: absolute, languages: [en], clip: {secret}}}
  - {{name: link, languages: [en], clip: link.wav}}
  - {{name: inside, languages: [en], clip: {data / 'inside.wav'}}}
""")
    entries = {e.name: e for e in load_catalog_file(catalog, [data])}
    for name in ("up", "absolute", "link"):
        with pytest.raises(ValueError, match="outside the allowed directories"):
            resolve_clip(entries[name])
    assert resolve_clip(entries["inside"]) == (data / "inside.wav").resolve()


def test_symlinked_directories_and_loops_stay_inside(tmp_path: Path) -> None:
    """A data-dir subdirectory that is a symlink to elsewhere, a symlink loop and a FIFO:
    none of them is ever handed to the engine."""
    data = tmp_path / "data"
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "x.wav", "x")
    data.mkdir()
    os.symlink(elsewhere, data / "clips")
    os.symlink(data / "loop-b.wav", data / "loop-a.wav")
    os.symlink(data / "loop-a.wav", data / "loop-b.wav")
    os.mkfifo(data / "pipe.wav")
    catalog = write(data / "voices.yaml", """
voices:
  - {name: dirlink, languages: [en], clip: clips/x.wav}
  - {name: loop, languages: [en], clip: loop-a.wav}
  - {name: pipe, languages: [en], clip: pipe.wav}
""")
    entries = {e.name: e for e in load_catalog_file(catalog, [data])}
    with pytest.raises(ValueError, match="outside the allowed directories"):
        resolve_clip(entries["dirlink"])
    for name in ("loop", "pipe"):
        with pytest.raises(ValueError, match="not found"):
            resolve_clip(entries[name])


def test_yaml_tags_never_run_code(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A python tag inside an entry fails the whole file cleanly (safe_load) and runs nothing."""
    marker = tmp_path / "ran"
    catalog = write(tmp_path / "voices.yaml", f"""
voices:
  - name: evil
    languages: [en]
    clip: !!python/object/apply:os.system ["touch {marker}"]
""")
    with caplog.at_level(logging.WARNING):
        assert load_catalog_file(catalog, [tmp_path]) == []
    assert not marker.exists()
    assert "unreadable" in caplog.records[0].getMessage()
    # the other catalogs still load
    assert [e.name for e in load_catalogs([tmp_path], None)] == ["zh-female", "en-male"]


def test_huge_catalog_is_capped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """YAML aliases make a small file list many entries: only the first 256 are read."""
    items = "\n".join(f"  - *v{k % 4}" for k in range(2000))
    anchors = "\n".join(f"  - &v{k} {{name: v{k}, languages: [en], clip: c.wav}}"
                        for k in range(4))
    catalog = write(tmp_path / "voices.yaml", f"voices:\n{anchors}\n{items}\n")
    with caplog.at_level(logging.WARNING):
        entries = load_catalog_file(catalog, [tmp_path])
    assert len(entries) == 256
    assert "only the first 256" in caplog.records[0].getMessage()


def test_catalog_file_over_1_mib_is_skipped(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """README "Limits": a catalog file is read only up to 1 MiB (1048576 bytes): a file of
    exactly that size is read, one byte more and it is skipped with one warning."""
    entry = "voices:\n  - {name: big, languages: [en], clip: c.wav}\n"
    for size, read in ((1 << 20, True), ((1 << 20) + 1, False)):
        catalog = write(tmp_path / f"voices-{size}.yaml",
                        entry + "#" * (size - len(entry) - 1) + "\n")
        assert catalog.stat().st_size == size
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            entries = load_catalog_file(catalog, [tmp_path])
        assert [e.name for e in entries] == (["big"] if read else [])
        warnings = [r.getMessage() for r in caplog.records]
        assert warnings == ([] if read else [
            f"Voice catalog {catalog} is unreadable and was skipped: larger than 1048576 bytes"])
