"""Read tokenizer.json in steps, so that no step holds Python's interpreter lock for long.

``tokenizers.Tokenizer.from_file`` parses the whole file (CosyVoice3's: 11 MB, 151,643 BPE
vocabulary entries, 151,387 merges, 281 added tokens) in one Rust call that keeps the GIL:
0.6-1.0 s on the 2-core x86 test machine, during which no other Python thread runs. A server
that loads its model while it listens (the first start, right after the download) then
leaves Home Assistant's ``describe`` unanswered for that long.

:func:`read_tokenizer` builds the same tokenizer from the same file in four calls, between
which other threads run: Python's ``json`` parse of the file, the tokenizer's pipeline
(normaliser, pre-tokenizer, post-processor, decoder) from the file's own entries with an
empty model, the BPE model from the vocabulary and merges, then the added tokens in id order.
The longest step took 0.27-0.34 s on the same machine. The result serialises to the same
JSON as ``from_file``'s (``tests/test_text_tokenizer_load.py``); when an added token would get
another id than the file gives it, or the file has another model type, it falls back to
``from_file``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer
from tokenizers.models import BPE

_LOGGER = logging.getLogger(__name__)

_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of ``path`` (a Hugging Face tokenizer.json), built in steps.

    Raises:
        OSError: the file cannot be read.
        ValueError, KeyError, TypeError, Exception: the file is not a tokenizer.json (the
            ``tokenizers`` library raises plain ``Exception`` subclasses).
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    model = config.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return Tokenizer.from_file(str(path))
    vocab: dict[str, int] = model["vocab"]
    merges = [_merge_pair(m) for m in model.get("merges", [])]
    added: list[dict[str, Any]] = list(config.get("added_tokens") or [])
    shell = dict(config, added_tokens=[], model=dict(model, vocab={}, merges=[]))
    tokenizer = Tokenizer.from_str(json.dumps(shell))
    settings = {k: v for k, v in model.items() if k not in ("type", "vocab", "merges")}
    tokenizer.model = BPE(vocab, merges, **settings)
    for entry in sorted(added, key=lambda e: int(e["id"])):
        token = AddedToken(entry["content"], **{k: bool(entry.get(k, False))
                                                for k in _ADDED_TOKEN_FLAGS})
        if entry.get("special", False):
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    moved = [e["content"] for e in added if tokenizer.token_to_id(e["content"]) != e["id"]]
    if moved:
        _LOGGER.debug("%s: added tokens would get other ids (%s); parsing it in one call",
                      path, moved[:3])
        return Tokenizer.from_file(str(path))
    return tokenizer


def _merge_pair(merge: Any) -> tuple[str, str]:
    """A merge as a pair: tokenizers >= 0.20 writes ``["a", "b"]``, older files ``"a b"``."""
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return left, right
    left, right = merge
    return str(left), str(right)


__all__ = ["read_tokenizer"]
