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
* Numbers are spelled out only in English text (:func:`expand_english`); upstream spells them in
  English whatever the language. Digits of other languages stay digits (the LLM reads them),
  and letters with diacritics (ä ö ü ß é ñ ç ...) are never touched.
* Chinese clean-up turns ASCII sentence punctuation into full-width forms only at a sentence
  boundary and never between digits (upstream turns every "." into "。", also in "21.5").

The rules are picked by the text's writing system (:func:`dominant_script`,
:func:`is_english`), which the prompt builder reads too: it falls back to cross-lingual mode
when a voice's transcript is written in another script than the text (spec section 4; the
export's model card reports a Mandarin prompt reading German at 25% WER in zero-shot mode, 2-5%
cross-lingual).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from typing import Literal

from num2words import num2words

from ..errors import TextError
from .units_en import CURRENCIES, UNITS

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
    * Latin-script text detected as English (:func:`is_english`): numbers, dates,
      times, units, percentages and currencies read as words (:func:`expand_english`);
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


# -- writing system ---------------------------------------------------------------------------

Script = Literal[
    "han", "kana", "hangul", "latin", "cyrillic", "greek", "arabic", "hebrew", "thai",
    "devanagari", "other", "none",
]
"""Script names returned by :func:`dominant_script`; ``none`` means the text has no letters."""

# (first, last, script) code point ranges of letters, checked in order.
_RANGES: tuple[tuple[int, int, Script], ...] = (
    (0x3040, 0x30FF, "kana"),  # hiragana + katakana
    (0x31F0, 0x31FF, "kana"),  # katakana phonetic extensions
    (0xFF66, 0xFF9F, "kana"),  # half-width katakana
    (0x3400, 0x4DBF, "han"),  # CJK extension A
    (0x4E00, 0x9FFF, "han"),  # CJK unified ideographs
    (0xF900, 0xFAFF, "han"),  # compatibility ideographs
    (0x20000, 0x323AF, "han"),  # extensions B..H
    (0x1100, 0x11FF, "hangul"),
    (0x3130, 0x318F, "hangul"),
    (0xAC00, 0xD7AF, "hangul"),
    (0x0400, 0x052F, "cyrillic"),
    (0x1C80, 0x1C8F, "cyrillic"),
    (0x0370, 0x03FF, "greek"),
    (0x1F00, 0x1FFF, "greek"),
    (0x0590, 0x05FF, "hebrew"),
    (0x0600, 0x06FF, "arabic"),
    (0x0750, 0x077F, "arabic"),
    (0x0E00, 0x0E7F, "thai"),
    (0x0900, 0x097F, "devanagari"),
    (0x0041, 0x024F, "latin"),  # basic Latin .. Latin extended-B (letters only, see below)
    (0x1E00, 0x1EFF, "latin"),  # Latin extended additional (Vietnamese)
    (0xFF21, 0xFF5A, "latin"),  # full-width Latin letters
)

# Scripts written without blanks between words: one character counts as one unit.
_CHARACTER_SCRIPTS = frozenset({"han", "kana", "hangul", "thai"})


def char_script(char: str) -> Script:
    """Script of one character; ``none`` for non-letters (digits, punctuation, symbols)."""
    if not char.isalpha():
        return "none"
    code = ord(char)
    for first, last, script in _RANGES:
        if first <= code <= last:
            return script
    return "other"


def script_units(text: str) -> Counter[str]:
    """Count comparable units per script: one per CJK/Thai character, one per word otherwise.

    A Chinese character carries about as much speech as an English word, so counting
    letters would let a few Latin words outweigh a long Chinese sentence.
    """
    counts: Counter[str] = Counter()
    previous: Script = "none"
    for char in text:
        script = char_script(char)
        if script == "none":
            previous = "none"
            continue
        if script in _CHARACTER_SCRIPTS or script != previous:
            counts[script] += 1
        previous = script
    return counts


def dominant_script(text: str) -> Script:
    """The script with most units (:func:`script_units`); Japanese Han+Kana counts as ``kana``.

    Returns ``none`` when the text has no letters. Ties go to the script seen first.
    """
    counts = script_units(text)
    if not counts:
        return "none"
    if counts.get("kana", 0) > 0:
        # Japanese mixes kanji and kana: any kana marks the Han characters as Japanese.
        counts["kana"] += counts.pop("han", 0)
    best, _ = counts.most_common(1)[0]
    return best  # type: ignore[return-value]


def has_cjk(text: str) -> bool:
    """True when the text holds a Han ideograph or kana (upstream ``contains_chinese``,
    utils/frontend_utils.py, checks U+4E00..U+9FFF only; kana and extensions added here)."""
    return any(char_script(c) in ("han", "kana") for c in text)


# --- English or not ----------------------------------------------------------------------
# Frequent function words that are (nearly) unique to one language. Words shared between
# English and another language ("in", "a", "an", "so", "was", "will", "on", "die") are left
# out so that they cannot tip the decision.
def _word_set(*groups: str) -> frozenset[str]:
    return frozenset(word for group in groups for word in group.split())


_ENGLISH_WORDS = _word_set(
    """the is are were been being it its it's this that these those of to and or at for with
    from by your you my we our he she they them his her their have has had does did not
    would can could should there here what which who when where how now today please all if
    then than but up out about into i i'm i've don't doesn't isn't aren't won't can't let's
    there's that's what's turned turning set timer been just currently on off"""
)
_OTHER_WORDS = _word_set(
    # German
    """der die das und ist nicht ein eine einer einen dem den des mit auf für zu von sich ich
    du er sie es wir ihr sind war wird werden auch noch nur oder aber wie bei im um grad
    uhr heute jetzt ist's beträgt wurde""",
    # French
    """ le la les un une des du et est sont dans pour avec sur pas ce cette il elle nous vous
    je qui que au aux c'est degrés aujourd'hui""",
    # Spanish / Italian / Portuguese
    """ el los las una y es son está en del por para con se lo al hoy grados il gli di della
    nel alla oggi gradi sono è não são uma hoje graus também""",
    # Dutch / Scandinavian / Polish
    """ het een van op te dat niet zijn met voor maar ook graden vandaag och är det som på av
    med jeg og ikke jest nie się że""",
)
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?")


def english_cues(text: str) -> tuple[int, int]:
    """(English function words, words of other European languages) in ``text``: the
    score :func:`is_english` decides on; every word with a letter outside ASCII (ä ö ü ß é
    ñ ç ...) counts for "other". Scores of consecutive texts add up (a stream's sentences)."""
    english = 0
    other = 0
    for match in _WORD.finditer(text):
        word = unicodedata.normalize("NFC", match.group(0)).lower().replace("’", "'")
        if word in _ENGLISH_WORDS:
            english += 1
        if word in _OTHER_WORDS or not word.isascii():
            other += 1
    return english, other


def is_english(text: str, language: str | None = None) -> bool:
    """Guess whether Latin-script text is English, from a stop-word score.

    English needs more English function words than function words of other European
    languages; every word with a letter outside ASCII (ä ö ü ß é ñ ç ...) counts for "other".
    With no cue either way, ``language`` (e.g. a voice's "en_US") decides; without it the
    answer is False, so digits stay digits (safe in every language).

    Args:
        text: text to classify (any script; only its words are looked at).
        language: optional BCP-47-like hint used only to break a tie of zero scores.
    """
    english, other = english_cues(text)
    if english == 0 and other == 0:
        return bool(language) and str(language).lower().startswith("en")
    return english > other


# -- English numbers, dates, times, currencies and units -------------------------------------

_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_MAX_CARDINAL_DIGITS = 15
"""Longer digit runs (serial numbers, phone numbers) are read digit by digit."""

_MONTH_NAMES = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)
MONTHS: dict[str, str] = {name.lower(): name for name in _MONTH_NAMES}
MONTHS.update(
    {
        abbr.lower(): full
        for abbr, full in (
            ("Jan", "January"), ("Feb", "February"), ("Mar", "March"), ("Apr", "April"),
            ("Jun", "June"), ("Jul", "July"), ("Aug", "August"), ("Sep", "September"),
            ("Sept", "September"), ("Oct", "October"), ("Nov", "November"),
            ("Dec", "December"),
        )
    }
)

_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_UNIT_ALT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
_MONTH_ALT = "|".join(sorted((m.capitalize() for m in MONTHS), key=len, reverse=True))
_AMPM = r"(?P<ampm>[AaPp])\.?\s?[Mm](?:\.(?=\s+[a-z]|,))?(?![A-Za-z])"

_CURRENCY_PREFIX = re.compile(
    rf"(?P<neg>[-−])?(?P<cur>[$€£¥])\s?(?P<int>{_INT})(?:\.(?P<frac>\d+))?"
    r"(?:\s(?P<scale>thousand|million|billion|trillion)\b)?"
)
_CURRENCY_SUFFIX = re.compile(
    rf"(?<![\w.,])(?P<neg>[-−])?(?P<int>{_INT})(?:\.(?P<frac>\d+))?\s?(?P<cur>[€£¥])"
)
_ISO_DATE = re.compile(r"(?<![\w.:/-])(?P<y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})(?![\w:/-])")
_SLASH_DATE = re.compile(r"(?<![\w./])(?P<a>\d{1,2})/(?P<b>\d{1,2})/(?P<y>\d{4})(?![\w/])")
_MONTH_DAY = re.compile(
    rf"\b(?P<month>{_MONTH_ALT})\.?\s+(?P<d>\d{{1,2}})(?:st|nd|rd|th)?\b"
    r"(?:,?\s+(?P<y>\d{4})\b)?"
)
_DAY_MONTH = re.compile(
    rf"(?<![\w.,])(?P<d>\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<month>{_MONTH_ALT})\b\.?"
    r"(?:,?\s+(?P<y>\d{4})\b)?"
)
_MONTH_YEAR = re.compile(rf"\b(?P<month>{_MONTH_ALT})\.?\s+(?P<y>\d{{4}})\b")
_TIME = re.compile(
    r"(?<![\d:.,])(?P<h>\d{1,2}):(?P<m>\d{2})(?::(?P<s>\d{2}))?(?![\d:])"
    rf"(?:\s?{_AMPM})?"
)
_HOUR_AMPM = re.compile(rf"(?<![\d:.,])(?P<h>\d{{1,2}})\s?{_AMPM}")
_DIMENSIONS = re.compile(r"(?<![\w.])(?P<a>\d+)\s?[xX×]\s?(?P<b>\d+)(?!\d|\.\d)")
_ORDINAL = re.compile(r"(?<![\w.,])(?P<n>\d+)(?:st|nd|rd|th)\b", re.IGNORECASE)
_DECADE = re.compile(
    r"(?<![\w.,'’])(?:(?P<y>\d{3}0)|['’](?P<y2>\d0)|(?<=\b[Tt]he )(?P<y3>\d0))s\b"
)
_YEAR_CONTEXT = re.compile(
    r"\b(?P<ctx>[Ii]n|[Ss]ince|[Uu]ntil|[Tt]ill|[Bb]y|[Ff]rom|[Oo]f|[Yy]ear|[Bb]efore|[Aa]fter"
    r"|[Dd]uring|[Cc]irca|[Aa]round|[Tt]hrough)\s+(?P<y>\d{4})(?![\w%°]|[.,]\d|\s?(?:" + _UNIT_ALT
    + r")(?![A-Za-z0-9]))"
)
_NUMBER = re.compile(
    rf"(?P<neg>(?<![\w.,)\]])[-−])?(?P<int>{_INT})(?:\.(?P<frac>\d+))?"
    rf"(?:\s?(?P<unit>{_UNIT_ALT})(?![A-Za-z0-9]))?"
)
_FRACTION = re.compile(r"(?<![\w/.,])(?P<a>\d{1,3})/(?P<b>\d{1,3})(?![\w/]|[.,]\d)")
_VERSION = re.compile(r"(?<![\w.])\d+(?:\.\d+){2,}(?![\w]|\.\d)")
_NUMBER_SIGN = re.compile(r"#(?=\d)")
_AMPERSAND = re.compile(r"\s*&\s*")


def digits(text: str) -> str:
    """Read a digit string one digit at a time: "007" -> "zero zero seven"."""
    return " ".join(_DIGIT_WORDS[int(c)] for c in text if c.isdecimal())


def cardinal(value: int) -> str:
    """Cardinal words: 21 -> "twenty-one", -3 -> "minus three" (num2words, English)."""
    if value < 0:
        return "minus " + cardinal(-value)
    return str(num2words(value, lang="en")).replace(",", "")


def ordinal(value: int) -> str:
    """Ordinal words: 17 -> "seventeenth"."""
    return str(num2words(value, lang="en", to="ordinal"))


def year(value: int) -> str:
    """Year words: 2023 -> "twenty twenty-three", 1905 -> "nineteen oh-five"."""
    return str(num2words(value, lang="en", to="year")).replace(",", "")


def number(int_text: str, frac_text: str | None = None, negative: bool = False) -> str:
    """Words of a decimal number given as text: ("21", "5") -> "twenty-one point five".

    Thousands commas are ignored; a leading zero or more than 15 digits reads digit by
    digit; the fraction is always read digit by digit ("2.50" -> "two point five zero").
    """
    plain = int_text.replace(",", "")
    if (len(plain) > 1 and plain.startswith("0")) or len(plain) > _MAX_CARDINAL_DIGITS:
        words = digits(plain)
    else:
        words = cardinal(int(plain))
    if frac_text:
        words += " point " + digits(frac_text)
    return ("minus " + words) if negative else words


def _is_one(int_text: str, frac_text: str | None) -> bool:
    return frac_text is None and int_text == "1"


def _padded(match: re.Match[str], words: str) -> str:
    """Words with a blank where they touch a letter or digit ("H2O" -> "H two O")."""
    text = match.string
    before = text[match.start() - 1] if match.start() > 0 else " "
    after = text[match.end()] if match.end() < len(text) else " "
    left = " " if before.isalnum() else ""
    right = " " if after.isalnum() else ""
    return f"{left}{words}{right}"


def _currency(match: re.Match[str]) -> str:
    main_one, main_many, sub_one, sub_many = CURRENCIES[match.group("cur")]
    int_text, frac = match.group("int"), match.group("frac")
    negative = match.group("neg") is not None
    scale = match.groupdict().get("scale")
    if scale:
        return f"{number(int_text, frac, negative)} {scale} {main_many}"
    if frac is not None and (len(frac) != 2 or not sub_one):
        return f"{number(int_text, frac, negative)} {main_many}"
    whole = int(int_text.replace(",", ""))
    cents = int(frac) if frac is not None else 0
    parts = []
    if whole or not cents:
        parts.append(f"{cardinal(whole)} {main_one if whole == 1 else main_many}")
    if cents:
        parts.append(f"{cardinal(cents)} {sub_one if cents == 1 else sub_many}")
    words = " and ".join(parts)
    return _padded(match, ("minus " + words) if negative else words)


def _date(month: int, day: int, year_text: str | None, day_first: bool = False) -> str | None:
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    name = _MONTH_NAMES[month - 1]
    words = f"the {ordinal(day)} of {name}" if day_first else f"{name} {ordinal(day)}"
    if year_text:
        words += f", {year(int(year_text))}"
    return words


def _iso_date(match: re.Match[str]) -> str:
    words = _date(int(match.group("m")), int(match.group("d")), match.group("y"))
    return words if words is not None else match.group(0)


def _slash_date(match: re.Match[str]) -> str:
    first, second = int(match.group("a")), int(match.group("b"))
    # US order (month/day) unless the first field cannot be a month.
    month, day = (second, first) if first > 12 else (first, second)
    words = _date(month, day, match.group("y"))
    return words if words is not None else match.group(0)


def _month_day(match: re.Match[str]) -> str:
    month = _MONTH_NAMES.index(MONTHS[match.group("month").lower()]) + 1
    words = _date(month, int(match.group("d")), match.group("y"))
    return words if words is not None else match.group(0)


def _day_month(match: re.Match[str]) -> str:
    month = _MONTH_NAMES.index(MONTHS[match.group("month").lower()]) + 1
    words = _date(month, int(match.group("d")), match.group("y"), day_first=True)
    if words is None:
        return match.group(0)
    if match.string[: match.start()].lower().endswith("the "):
        words = words.removeprefix("the ")
    return words


def _month_year(match: re.Match[str]) -> str:
    return f"{MONTHS[match.group('month').lower()]} {year(int(match.group('y')))}"


def _time(match: re.Match[str]) -> str:
    hour, minute = int(match.group("h")), int(match.group("m"))
    second = match.group("s")
    ampm = match.group("ampm")
    if hour > (12 if ampm else 24) or minute > 59 or (second is not None and int(second) > 59):
        return match.group(0)
    words = cardinal(hour)
    if minute == 0:
        if not ampm:
            words += " o'clock" if 1 <= hour <= 12 else " hundred"
    elif minute < 10:
        words += " oh " + cardinal(minute)
    else:
        words += " " + cardinal(minute)
    if second is not None and int(second) > 0:
        words += f" and {cardinal(int(second))} second" + ("" if int(second) == 1 else "s")
    if ampm:
        words += " AM" if ampm.lower() == "a" else " PM"
    return _padded(match, words)


def _hour_ampm(match: re.Match[str]) -> str:
    hour = int(match.group("h"))
    if not 0 <= hour <= 12:
        return match.group(0)
    suffix = "AM" if match.group("ampm").lower() == "a" else "PM"
    return _padded(match, f"{cardinal(hour)} {suffix}")


def _dimensions(match: re.Match[str]) -> str:
    return _padded(match, f"{number(match.group('a'))} by {number(match.group('b'))}")


def _ordinal(match: re.Match[str]) -> str:
    return _padded(match, ordinal(int(match.group("n"))))


def _decade(match: re.Match[str]) -> str:
    value = int(match.group("y") or match.group("y2") or match.group("y3"))
    words = year(value) if value >= 1000 else cardinal(value)
    words = words[:-1] + "ies" if words.endswith("y") else words + "s"
    return _padded(match, words)


def _year_in_context(match: re.Match[str]) -> str:
    value = int(match.group("y"))
    if not 1100 <= value <= 2099:
        return match.group(0)
    return f"{match.group('ctx')} {year(value)}"


def _fraction(match: re.Match[str]) -> str:
    """Simple fraction: "1/2" -> "one half", "3/4" -> "three quarters", "2/3" -> "two thirds"."""
    numerator, denominator = int(match.group("a")), int(match.group("b"))
    if not 2 <= denominator <= 100:
        return _padded(match, f"{cardinal(numerator)} over {cardinal(denominator)}")
    if denominator == 2:
        name = "half" if numerator == 1 else "halves"
    else:
        name = "quarter" if denominator == 4 else ordinal(denominator)
        if numerator != 1:
            name += "s"
    return _padded(match, f"{cardinal(numerator)} {name}")


def _version(match: re.Match[str]) -> str:
    """Dotted version or address: "1.2.3" -> "one point two point three"."""
    return _padded(match, " point ".join(number(part) for part in match.group(0).split(".")))


def _number(match: re.Match[str]) -> str:
    int_text, frac = match.group("int"), match.group("frac")
    words = number(int_text, frac, negative=match.group("neg") is not None)
    unit = match.group("unit")
    if unit:
        singular, plural = UNITS[unit]
        words += " " + (singular if _is_one(int_text, frac) else plural)
    return _padded(match, words)


_PASSES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (_CURRENCY_PREFIX, _currency),
    (_CURRENCY_SUFFIX, _currency),
    (_ISO_DATE, _iso_date),
    (_SLASH_DATE, _slash_date),
    (_MONTH_DAY, _month_day),
    (_DAY_MONTH, _day_month),
    (_MONTH_YEAR, _month_year),
    (_TIME, _time),
    (_HOUR_AMPM, _hour_ampm),
    (_DIMENSIONS, _dimensions),
    (_ORDINAL, _ordinal),
    (_DECADE, _decade),
    (_YEAR_CONTEXT, _year_in_context),
    (_FRACTION, _fraction),
    (_VERSION, _version),
    (_NUMBER, _number),
)


def expand_english(text: str) -> str:
    """Replace every number form of English text by words, as Home Assistant says them.

    Upstream's fallback front end (utils/frontend_utils.py ``spell_out_number``) spells every digit
    run with ``inflect`` whatever the language and ignores decimals, times and units. This module
    is applied only to text detected as English (:func:`is_english`) and reads, e.g.:

        "21.5 °C"            -> "twenty-one point five degrees Celsius"
        "3:45 PM"            -> "three forty-five PM"
        "50%"                -> "fifty percent"
        "December 17, 2023"  -> "December seventeenth, twenty twenty-three"
        "$5.50"              -> "five dollars and fifty cents"
        "16X16"              -> "sixteen by sixteen"

    "AM"/"PM" are written as capitals without dots: dots would end a sentence for the splitter,
    and the LLM reads the two capitals as letters. Number words come from ``num2words``.

    Args:
        text: cleaned text (no control characters), detected as English.

    Returns:
        The text with no ASCII digits left, blanks collapsed.
    """
    text = text.replace("℃", "°C").replace("℉", "°F")
    text = re.sub(r"°\s+([CF])(?![A-Za-z])", r"°\1", text)
    text = _NUMBER_SIGN.sub("number ", text)
    for pattern, replace in _PASSES:
        text = pattern.sub(replace, text)
    text = _AMPERSAND.sub(" and ", text)
    return re.sub(r"\s{2,}", " ", text).strip()
