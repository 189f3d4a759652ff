"""Text normalisation before tokenisation (spec section 3).

Follows the rule-based fallback of upstream FunAudioLLM/CosyVoice (cosyvoice/cli/frontend.py
``CosyVoiceFrontEnd.text_normalize`` with utils/frontend_utils.py ``replace_blank``,
``replace_corner_mark``, ``remove_bracket``, ``spell_out_number``), with these differences:

* User text is untrusted. Upstream skips normalisation for text holding ``<|`` .. ``|>`` and
  encodes tokens such as ``<|endofprompt|>`` typed by a user as control tokens. Here
  ``<|name|>`` markup is removed, and :mod:`.frontend` encodes all user text so that it can
  never yield an added-token id.
* Control, format, surrogate, private-use and unassigned characters and emoji are removed;
  every kind of blank becomes one space.
* Numbers are spelled out only in English text (:mod:`.numbers_en`); upstream spells them in
  English whatever the language. Digits of other languages stay digits (the LLM reads them),
  and letters with diacritics (ä ö ü ß é ñ ç ...) are never touched.
* Chinese clean-up turns ASCII sentence punctuation into full-width forms only at a sentence
  boundary and never between digits (upstream turns every "." into "。", also in "21.5").
"""

from __future__ import annotations

import re
import unicodedata

from ..errors import TextError
from .numbers_en import expand_english
from .script import char_script, dominant_script, has_cjk, is_english
from .units_en import UNITS

_SPECIAL_MARKUP = re.compile(r"<\|[^<>|\s]{1,64}\|>")
"""Qwen / CosyVoice control-token syntax, e.g. ``<|endofprompt|>``, ``<|im_start|>``."""

_EMOJI_RANGES: tuple[tuple[int, int], ...] = (
    (0x1F000, 0x1FAFF),  # mahjong .. symbols and pictographs extended-A, flags, skin tones
    (0x2600, 0x27BF),  # miscellaneous symbols, dingbats
    (0x2B00, 0x2BFF),  # miscellaneous symbols and arrows (stars, arrows)
    (0x231A, 0x231B),  # watch, hourglass
    (0x23E9, 0x23FA),  # media control symbols
    (0xFE00, 0xFE0F),  # variation selectors
    (0x20E3, 0x20E3),  # combining enclosing keycap
    (0xE0000, 0xE007F),  # tag characters (flag sequences)
    (0xE0100, 0xE01EF),  # variation selectors supplement
)
_DROPPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})
_BLANK_CATEGORIES = frozenset({"Zs", "Zl", "Zp"})

# Chinese clean-up tables (upstream remove_bracket / replace_corner_mark, extended).
_ZH_REMOVED = str.maketrans("", "", "（）【】`")
_ZH_FULL_WIDTH = {".": "。", "?": "？", "!": "！", ";": "；", ":": "：", ",": "，"}
_CJK_PUNCTUATION = frozenset("。？！；：，、…「」『』（）《》〈〉【】“”‘’·—～")
_CLOSERS = frozenset("\"'”’)）」』»】]")


def is_emoji(code: int) -> bool:
    """True for a code point of the emoji / pictograph ranges (incl. variation selectors)."""
    return any(first <= code <= last for first, last in _EMOJI_RANGES)


def clean_text(text: str) -> str:
    """Remove what can never be spoken and unify blanks.

    NFC composition (so "a" + combining diaeresis becomes "ä", as the tokenizer's own NFC
    normaliser would); ``<|...|>`` markup removed; control / format / surrogate /
    private-use / unassigned characters and emoji removed; tabs, newlines and Unicode spaces
    become one ASCII space; the result is stripped.

    Args:
        text: any Python string (lone surrogates included).

    Returns:
        Cleaned text; may be empty.
    """
    kept: list[str] = []
    for char in text:
        category = unicodedata.category(char)
        if char in "\t\n\r\v\f" or category in _BLANK_CATEGORIES:
            kept.append(" ")
        elif category in _DROPPED_CATEGORIES or is_emoji(ord(char)):
            continue
        else:
            kept.append(char)
    text = unicodedata.normalize("NFC", "".join(kept))
    text = _SPECIAL_MARKUP.sub(" ", text)
    return re.sub(r" {2,}", " ", text).strip()


_EN_WORD_SLASH = re.compile(r"(?<![\w/.:@-])(?P<a>[a-z]{2,})/(?P<b>[a-z]{2,})(?![\w/@])")
"""Two lower-case English words joined by a slash ("on/off", "and/or")."""


_EN_ARITHMETIC = (
    (re.compile(r"(?<=\d) ?\* ?(?=\d)"), " times "),
    (re.compile(r"(?<=\d) = (?=[-−]?\d)"), " equals "),
)
"""``5 * 3 = 15`` (``×`` and ``x`` stay dimensions, "16x16" is "sixteen by sixteen")."""


def _english_slash(match: re.Match[str]) -> str:
    first, second = match.group("a"), match.group("b")
    if first in UNITS or second in UNITS:
        return match.group(0)  # a unit such as "mm/h" without its number
    return f"{first} or {second}"


def _is_cjk_char(char: str) -> bool:
    return char_script(char) in ("han", "kana") or char in _CJK_PUNCTUATION


def _full_width_punctuation(text: str) -> str:
    """ASCII . ? ! ; : , -> full width at a sentence boundary, never between two digits."""
    out: list[str] = []
    last = len(text) - 1
    for i, char in enumerate(text):
        wide = _ZH_FULL_WIDTH.get(char)
        if wide is not None:
            before = text[i - 1] if i > 0 else " "
            after = text[i + 1] if i < last else " "
            between_digits = before.isdigit() and after.isdigit()
            at_boundary = (
                after == " " or i == last or _is_cjk_char(after) or after in _CLOSERS
                or after in _ZH_FULL_WIDTH or _is_cjk_char(before)
            )
            if at_boundary and not between_digits:
                char = wide
        out.append(char)
    return "".join(out)


def _remove_blanks_near_cjk(text: str) -> str:
    """Drop a space next to a CJK character or CJK punctuation; keep it between other words
    (upstream ``replace_blank`` keeps it only between two ASCII characters)."""
    out: list[str] = []
    last = len(text) - 1
    for i, char in enumerate(text):
        if (
            char == " " and 0 < i < last
            and (_is_cjk_char(text[i - 1]) or _is_cjk_char(text[i + 1]))
        ):
            continue
        out.append(char)
    return "".join(out)


_ZH_NUMBER = r"(?P<n>[-−]?\d+(?:[.,]\d+)?)"
_ZH_SYMBOLS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(_ZH_NUMBER + r"\s?[%％]"), r"百分之\g<n>"),
    (re.compile(_ZH_NUMBER + r"\s?(?:°\s?C|℃)"), r"\g<n>摄氏度"),
    (re.compile(_ZH_NUMBER + r"\s?(?:°\s?F|℉)"), r"\g<n>华氏度"),
    (re.compile(_ZH_NUMBER + r"\s?°"), r"\g<n>度"),
    (re.compile(r"€\s?" + _ZH_NUMBER), r"\g<n>欧元"),
    (re.compile(_ZH_NUMBER + r"\s?€"), r"\g<n>欧元"),
    (re.compile(r"(?:US)?\$\s?" + _ZH_NUMBER), r"\g<n>美元"),
    (re.compile(r"£\s?" + _ZH_NUMBER), r"\g<n>英镑"),
    (re.compile(r"[¥￥]\s?" + _ZH_NUMBER), r"\g<n>元"),
    (re.compile(r"\s*[&＆]\s*"), "和"),
)
"""Symbols read in Chinese word order (upstream's wetext zh rules read 50% as 百分之五十);
the digits stay digits, as everywhere in this module."""
_JA_SYMBOLS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(_ZH_NUMBER + r"\s?[%％]"), r"\g<n>パーセント"),
    (re.compile(_ZH_NUMBER + r"\s?(?:°\s?C|℃|°)"), r"\g<n>度"),
    (re.compile(r"€\s?" + _ZH_NUMBER), r"\g<n>ユーロ"),
    (re.compile(_ZH_NUMBER + r"\s?€"), r"\g<n>ユーロ"),
    (re.compile(r"(?:US)?\$\s?" + _ZH_NUMBER), r"\g<n>ドル"),
    (re.compile(r"[¥￥]\s?" + _ZH_NUMBER), r"\g<n>円"),
)
"""The same for Japanese (text with kana): 50% is 50パーセント, ¥100 is 100円."""


def normalize_chinese(text: str) -> str:
    """Clean-up of text holding Han or kana characters (upstream ``text_normalize``, zh branch).

    " - " and "——" become a full-width comma; （ ） 【 】 and backticks are removed;
    ² / ³ become 平方 / 立方 (upstream ``replace_corner_mark``); % ° °C € $ £ ¥ & after or
    before a number are read in Chinese order (``_ZH_SYMBOLS``: 50% -> 百分之50; Japanese
    text: ``_JA_SYMBOLS``, 50% -> 50パーセント); ASCII
    sentence punctuation becomes full width at boundaries; blanks next to CJK characters
    are removed; trailing commas become 。. Digits and Latin words are kept as they are
    (upstream's wetext normaliser is not used here).

    Args:
        text: output of :func:`clean_text`.
    """
    text = text.replace(" - ", "，").replace("——", "，")
    text = text.translate(_ZH_REMOVED)
    text = text.replace("²", "平方").replace("³", "立方")
    symbols = _JA_SYMBOLS if dominant_script(text) == "kana" else _ZH_SYMBOLS
    for pattern, replacement in symbols:
        text = pattern.sub(replacement, text)
    text = _full_width_punctuation(text)
    text = _remove_blanks_near_cjk(text)
    text = re.sub(r"[，,、]+$", "。", text)
    return re.sub(r" {2,}", " ", text).strip()


def normalize_text(text: str, language: str | None = None) -> str:
    """Normalise one text for the LLM (spec section 3).

    * Text with Han or kana characters (Chinese, Japanese, mixed zh+en): :func:`normalize_chinese`.
    * Latin-script text detected as English (:func:`.script.is_english`): numbers, dates,
      times, units, percentages and currencies read as words (:func:`.numbers_en.expand_english`);
      ``&`` is "and", a slash between two lower-case words is "or" ("on/off"), ``5 * 3 = 15``
      is "five times three equals fifteen".
    * Any other text (German, French, Cyrillic, Hangul...): cleaned only; digits stay digits.

    Args:
        text: user text, untrusted.
        language: optional language hint (e.g. the voice's "en_US"); used only when the
            text itself gives no cue (e.g. "50%").

    Returns:
        Normalised text; empty when nothing is left.

    Raises:
        TextError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TextError(
            f"text must be a string, got {type(text).__name__}; send the text as a JSON string"
        )
    text = clean_text(text)
    if not text:
        return ""
    script = dominant_script(text)
    if has_cjk(text) and script not in ("hangul", "cyrillic", "greek", "arabic", "hebrew"):
        return normalize_chinese(text)
    if script in ("latin", "none") and is_english(text, language):
        for pattern, words in _EN_ARITHMETIC:
            text = pattern.sub(words, text)
        return _EN_WORD_SLASH.sub(_english_slash, expand_english(text))
    return text
