"""tokenizer.json read in steps (engine/text/tokenizer_load.py): the same tokenizer as
``Tokenizer.from_file``, and other threads run between the steps."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


def test_other_threads_run_between_the_steps_of_the_read(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_file`` parses the whole file in one call that keeps the GIL. The steps are
    separate calls: the JSON parse, the pipeline, the BPE model, then the added tokens, with
    Python in between. A thread that always wants the interpreter (a counting loop) waits
    through each step and runs once it returns: its count moves between the parse and the
    model build, and between the model build and the end of the read. Asserted by that
    order, not by time: a slower or busier machine makes the steps longer, not fewer."""
    from tokenizers.models import BPE

    from wyoming_cosyvoice3.engine.text import tokenizer_load

    path = tiny_model_dir / "tokenizer.json"
    count = [0]
    running = [True]
    marks: list[tuple[str, int]] = []

    def step(name: str, call: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            marks.append((f"{name} start", count[0]))
            result = call(*args, **kwargs)
            marks.append((f"{name} end", count[0]))
            return result
        return wrapped

    monkeypatch.setattr(tokenizer_load, "json",
                        SimpleNamespace(loads=step("parse", json.loads), dumps=json.dumps))
    monkeypatch.setattr(tokenizer_load, "Tokenizer", SimpleNamespace(
        from_str=step("pipeline", Tokenizer.from_str),
        from_file=step("whole", Tokenizer.from_file)))
    monkeypatch.setattr(tokenizer_load, "BPE", step("model", BPE))

    def spin() -> None:
        while running[0]:
            count[0] += 1

    spinner = threading.Thread(target=spin)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the waiting thread asks for the interpreter after 0.1 ms
    try:
        spinner.start()
        tokenizer = read_tokenizer(path)
        marks.append(("read end", count[0]))
    finally:
        running[0] = False
        spinner.join(10.0)
        sys.setswitchinterval(interval)
    assert [name for name, _ in marks] == [
        "parse start", "parse end", "pipeline start", "pipeline end", "model start",
        "model end", "read end"]
    at = dict(marks)
    assert at["model start"] > at["parse end"]  # it ran between the two large steps
    assert at["read end"] > at["model end"]  # and while the added tokens were added
    _same(tokenizer, Tokenizer.from_file(str(path)))
