"""tokenizer.json read in steps (engine/text/tokenizer_load.py): the same tokenizer as
``Tokenizer.from_file``, and other threads run while it is read."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from wyoming_cosyvoice3.engine.text.tokenizer_load import read_tokenizer

TEXTS = [
    "Hello world, it's 21 °C in the kitchen!",
    "你好，世界。<|endofprompt|>",
    "Ünïcödé   spaces\n\nand a new line",
    "<|im_start|>abc<|im_end|> [breath] <|en|> x",
    "",
]


def _same(a: Tokenizer, b: Tokenizer) -> None:
    assert json.loads(a.to_str()) == json.loads(b.to_str())
    for text in TEXTS:
        assert a.encode(text).ids == b.encode(text).ids, text


def test_steps_build_the_tokenizer_from_file_builds(tiny_model_dir: Path) -> None:
    path = tiny_model_dir / "tokenizer.json"
    stepped = read_tokenizer(path)
    _same(stepped, Tokenizer.from_file(str(path)))
    assert stepped.token_to_id("<|endofprompt|>") is not None


def test_merges_written_as_strings_read_the_same(tiny_model_dir: Path, tmp_path: Path) -> None:
    """tokenizers < 0.20 wrote each merge as "a b"."""
    config = json.loads((tiny_model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert isinstance(config["model"]["merges"][0], list)
    config["model"]["merges"] = [" ".join(m) for m in config["model"]["merges"]]
    old = tmp_path / "tokenizer.json"
    old.write_text(json.dumps(config), encoding="utf-8")
    _same(read_tokenizer(old), Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")))


def test_added_tokens_off_the_end_of_the_vocabulary_fall_back_to_one_parse(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Added tokens with ids the step-wise build does not give (a gap after the vocabulary)
    are read by one ``from_file`` parse instead, so the result is still ``from_file``'s."""
    config = json.loads((tiny_model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    for entry in config["added_tokens"]:
        entry["id"] += 1000
    gapped = tmp_path / "tokenizer.json"
    gapped.write_text(json.dumps(config), encoding="utf-8")
    with caplog.at_level("DEBUG", logger="wyoming_cosyvoice3.engine.text.tokenizer_load"):
        tokenizer = read_tokenizer(gapped)
    assert "parsing it in one call" in caplog.text
    _same(tokenizer, Tokenizer.from_file(str(gapped)))


def test_not_a_tokenizer_raises(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError):
        read_tokenizer(bad)


def _longest_stall_s(load: object) -> float:
    """Longest gap between the 5 ms ticks of this thread while ``load()`` runs in another."""
    done = threading.Event()

    def work() -> None:
        try:
            load()  # type: ignore[operator]
        finally:
            done.set()

    worker = threading.Thread(target=work)
    last, longest = time.perf_counter(), 0.0
    worker.start()
    for _ in range(20_000):  # bounded: 100 s of ticks
        if done.wait(0.005):
            break
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join(10.0)
    return longest


def test_other_threads_run_while_the_tokenizer_is_read(tiny_model_dir: Path) -> None:
    """``from_file`` keeps the GIL for the whole parse; the steps give it back in between.
    Compared in the same process, so the machine's speed cancels out."""
    path = tiny_model_dir / "tokenizer.json"
    whole = min(_longest_stall_s(lambda: Tokenizer.from_file(str(path))) for _ in range(2))
    stepped = min(_longest_stall_s(lambda: read_tokenizer(path)) for _ in range(2))
    assert stepped < 0.8 * whole, (stepped, whole)
