"""Chinese, Japanese and Korean: symbols and numbers read in the language.

* Chinese and Japanese (:func:`normalize_chinese`): upstream's clean-up (full-width
  punctuation at sentence ends, brackets removed, blanks next to CJK characters dropped),
  symbols in the language's word order (50% -> 百分之50 / 50パーセント, ¥100 -> 100元 /
  100円), then the numbers read by ``wetext`` (WeTextProcessing's runtime, the normaliser
  upstream uses: its bundled FSTs, Chinese grammar for Chinese, Japanese grammar for Japanese
  text, never the Chinese one). Before wetext a guard pass handles what it reads wrong
  (measured on wetext 0.1.8): thousands separators (12,345 -> 十二,三百四十五 in some
  contexts), units it does not know (kWh -> 千瓦h, hPa -> 小时Pa; °C in Japanese ->
  摂氏 after the number), versions (1.2.3 -> 一.二点三), phone numbers (read as cardinals),
  "第2季" (-> 第两季). When wetext is missing or fails on a text, the text stays as it was
  before it (digits), logged once.
* Korean (:func:`normalize_korean`): a symbol table like the two others (°C -> 도, % -> 퍼센트,
  km/h -> 킬로미터, ₩ -> 원); the digits stay (no number reader for Korean is bundled that
  works offline without pynini; num2words' Korean ordinals are wrong for counters).

wetext loads all its FSTs when imported (about 0.5 s of CPU, +40 MB; BENCHMARKS.md "Text
normalisation"), so :func:`start_warm_up` imports it in a daemon thread when the engine is
made, and a request never waits for it unless it comes within that half second.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from .forms import PHONE, RANGE_DASH, VERSION
from .script import char_script

logger = logging.getLogger(__name__)

_ZH_REMOVED = str.maketrans("", "", "（）【】`")
_ZH_FULL_WIDTH = {".": "。", "?": "？", "!": "！", ";": "；", ":": "：", ",": "，"}
_CJK_PUNCTUATION = frozenset("。？！；：，、…「」『』（）《》〈〉【】“”‘’·—～")
_ZH_CLOSERS = frozenset("\"'”’)）」』»】]")
_FULL_WIDTH_DIGITS = str.maketrans("０１２３４５６７８９", "0123456789")

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
                after == " " or i == last or _is_cjk_char(after) or after in _ZH_CLOSERS
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


_ZH_NUMBER = r"(?P<n>(?:(?<![\d.,])[-−])?\d+(?:[.,]\d+)?)"
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
the digits stay for wetext (or stay digits when numbers are not read)."""
_JA_SYMBOLS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(_ZH_NUMBER + r"\s?[%％]"), r"\g<n>パーセント"),
    (re.compile(_ZH_NUMBER + r"\s?(?:°\s?C|℃|°)"), r"\g<n>度"),
    (re.compile(r"€\s?" + _ZH_NUMBER), r"\g<n>ユーロ"),
    (re.compile(_ZH_NUMBER + r"\s?€"), r"\g<n>ユーロ"),
    (re.compile(r"(?:US)?\$\s?" + _ZH_NUMBER), r"\g<n>ドル"),
    (re.compile(r"[¥￥]\s?" + _ZH_NUMBER), r"\g<n>円"),
)
"""The same for Japanese (text with kana): 50% is 50パーセント, ¥100 is 100円."""


# -- wetext -----------------------------------------------------------------------------------

_wetext_lock = threading.Lock()
_normalizers: dict[str, Any] = {}
_failed: set[str] = set()
_warm_up: threading.Thread | None = None


def _normalizer(language: str) -> Any | None:
    """wetext's TN normaliser of ``language`` ("zh" or "ja"), made once; None when wetext
    cannot be imported (logged once)."""
    with _wetext_lock:
        if language in _normalizers:
            return _normalizers[language]
        if "import" in _failed:
            return None
        try:
            from wetext import Normalizer
        except Exception:  # missing or broken install: the digits stay
            _failed.add("import")
            logger.warning("wetext cannot be imported: Chinese and Japanese numbers stay "
                           "digits", exc_info=True)
            return None
        normalizer = Normalizer(lang=language, operator="tn")
        _normalizers[language] = normalizer
        return normalizer


def start_warm_up() -> None:
    """Import wetext and make both normalisers in a daemon thread (once per process), so that
    neither ``describe`` nor the first Chinese or Japanese request waits for its 0.5 s of
    loading. Each FST is one call that holds the interpreter lock for at most about 0.15 s
    (en/tn/verbalizer.fst, BENCHMARKS.md)."""
    global _warm_up
    with _wetext_lock:
        if _warm_up is not None:
            return
        _warm_up = threading.Thread(target=_warm, name="wetext-warm-up", daemon=True)
    _warm_up.start()


def _warm() -> None:
    for language in ("zh", "ja"):
        if _normalizer(language) is not None:
            read_with_wetext("1", language)


def read_with_wetext(text: str, language: str) -> str | None:
    """``text`` with its numbers read by wetext in ``language`` ("zh" or "ja"); None when
    wetext is missing or failed on this text (logged once per language)."""
    normalizer = _normalizer(language)
    if normalizer is None:
        return None
    try:
        with _wetext_lock:  # kaldifst's normaliser is not documented as thread-safe
            return str(normalizer.normalize(text))
    except Exception:
        if language not in _failed:
            _failed.add(language)
            logger.warning("wetext failed on a %s text; its digits stay (logged once)",
                           language, exc_info=True)
        return None


# -- the guard pass before wetext -------------------------------------------------------------

_DIGITS: dict[str, str] = {"zh": "零幺二三四五六七八九", "ja": "〇一二三四五六七八九"}
"""Digits of a phone number: Chinese reads 1 as 幺 in numbers said digit by digit (as wetext
itself reads 110 -> 幺幺零); Japanese uses the kanji digits with 〇."""
_PLUS = {"zh": "加", "ja": "プラス"}
_GROUP_PAUSE = {"zh": "，", "ja": "、"}
_RANGE_WORD = {"zh": "到", "ja": "から"}
_UNITS: dict[str, dict[str, str]] = {
    "zh": {
        "µg/m³": "微克每立方米", "mg/m³": "毫克每立方米", "kWh": "千瓦时", "MWh": "兆瓦时",
        "Wh": "瓦时", "kW": "千瓦", "W": "瓦", "V": "伏", "A": "安", "hPa": "百帕",
        "kPa": "千帕", "Pa": "帕", "mbar": "毫巴", "ppm": "ppm", "dB": "分贝", "lx": "勒克斯",
        "lm": "流明", "kHz": "千赫", "Hz": "赫兹", "l": "升", "g": "克", "‰": "‰",
    },
    "ja": {
        "ppm": "ピーピーエム", "ppb": "ピーピービー", "l": "リットル", "lx": "ルクス",
        "kHz": "キロヘルツ", "h": "時間", "Mbps": "メガビーピーエス", "‰": "パーミル",
    },
}
"""Units wetext 0.1.8 leaves in letters or reads wrong (each tried after "12" in a sentence),
written as the language names them; wetext then reads the number before them. The names are
the common Chinese unit names (千瓦时, 百帕, 微克每立方米, as wetext itself writes 千瓦 and
毫升) and the katakana names wetext's own Japanese grammar uses for the units it knows;
"ppm" stays in letters in Chinese, where it is said as letters."""
_NUMBER = r"\d+(?:\.\d+)?"
_GROUPED_OR_NUMBER = r"\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?"
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
_ISO_DATE = re.compile(r"(?<![0-9A-Za-z.:/-])(\d{4})-(\d{2})-(\d{2})(?![0-9A-Za-z:/-])")
_ORDINAL_ZH = re.compile(r"第(\d+)")
_RANGE = re.compile(
    rf"(?<![0-9A-Za-z.,:/-])(\d{{1,2}}:\d{{2}}|{_NUMBER}){RANGE_DASH}(\d{{1,2}}:\d{{2}}|{_NUMBER})"
    r"(?![0-9A-Za-z:/-]|[.,]\d)"
)


def _unit_pattern(units: dict[str, str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(u) for u in sorted(units, key=len, reverse=True))
    return re.compile(rf"(?<![0-9A-Za-z.,])({_GROUPED_OR_NUMBER})\s?({alternatives})"
                      r"(?![A-Za-z0-9])")


_UNIT_PATTERNS = {language: _unit_pattern(units) for language, units in _UNITS.items()}


def _phone(language: str) -> Callable[[re.Match[str]], str]:
    def read(match: re.Match[str]) -> str:
        digits = _DIGITS[language]
        groups = ["".join(digits[int(c)] for c in group)
                  for group in re.findall(r"\d+", match.group(0))]
        plus = _PLUS[language] if match.group(0).startswith("+") else ""
        return plus + _GROUP_PAUSE[language].join(groups)
    return read


def _version(language: str) -> Callable[[re.Match[str]], str]:
    def read(match: re.Match[str]) -> str:
        return "点".join(match.group(0).split("."))  # wetext reads "1点2点3" part by part
    return read


_COUNTER = {"zh": "个", "ja": "個"}
"""A counter word after a number makes wetext read it as a cardinal: alone, or before some
words, it reads a few numbers as codes (12345 -> 幺二三四五, wetext 0.1.8)."""


def _alone(number: str, language: str) -> str:
    """A number read by wetext as a cardinal without the words around it (digits when
    wetext fails)."""
    counter = _COUNTER[language]
    read = read_with_wetext(number + counter, language)
    return read.removesuffix(counter) if read and read.endswith(counter) else number


_MONEY_ZEROS = re.compile(r"(?<=\d\.\d)0(?=\s?(?:[€$£¥￥]|ユーロ|ドル|円|欧元|美元|英镑|元))"
                          r"|(?<=[€$£¥￥])(\d+\.\d)0")


def _grouped(match: re.Match[str], language: str) -> str:
    number = match.group(0).replace(",", "")
    if re.match(r"\s?[A-Za-z°%µ‰]", match.string[match.end():]):
        return number
    return _alone(number, language)


def guard_for_wetext(text: str, language: str) -> str:
    """Rewrite what wetext 0.1.8 reads wrong into forms it reads right (module docstring):
    thousands separators dropped, a comma between two other numbers as 、, ISO dates as
    年月日, phone numbers as digits, versions with 点 between the parts, ranges with 到 /
    から, units it does not know as words, "第2" read by wetext alone, µ written one way
    (Greek mu U+03BC -> micro sign U+00B5)."""
    text = text.replace("μ", "µ")
    text = _MONEY_ZEROS.sub(lambda m: m.group(1) or "", text)  # €12.50: 十二点五, not 五〇
    units = _UNITS[language]
    text = _UNIT_PATTERNS[language].sub(lambda m: m.group(1) + units[m.group(2)], text)
    # a grouped number before a unit: without its commas (wetext reads 1013hPa); before
    # anything else read alone, as in a sentence wetext reads "12345步" as a code (幺二三四五)
    text = _THOUSANDS.sub(lambda m: _grouped(m, language), text)
    # two numbers apart by a comma are a list: wetext reads "0.75，20毫米" as 零点七五二零毫米
    text = re.sub(r"(?<=\d)[，,](?=\d)", "、", text)
    text = _ISO_DATE.sub(lambda m: f"{int(m.group(1))}年{int(m.group(2))}月{int(m.group(3))}日",
                         text)
    text = PHONE.sub(_phone(language), text)
    text = VERSION.sub(_version(language), text)
    text = _RANGE.sub(rf"\1{_RANGE_WORD[language]}\2", text)
    if language == "zh":  # wetext reads 第2季 as 第两季 (两 is the counting form)
        text = _ORDINAL_ZH.sub(lambda m: "第" + (read_with_wetext(m.group(1), "zh")
                                             or m.group(1)), text)
    return text


# -- Chinese and Japanese ---------------------------------------------------------------------


def normalize_chinese(text: str, language: str = "zh", read_numbers: bool = True) -> str:
    """Chinese or Japanese text for the LLM (the module docstring).

    " - " and "——" become a full-width comma; （ ） 【 】 and backticks are removed;
    % ° °C € $ £ ¥ & after or before a number are read in the language's order
    (``_ZH_SYMBOLS``: 50% -> 百分之50; ``_JA_SYMBOLS``: 50% -> 50パーセント); a ² / ³ that is
    not part of a unit becomes 平方 / 立方 (upstream ``replace_corner_mark``; "µg/m³" keeps its
    ³ for the unit reading); ASCII sentence punctuation becomes full width at boundaries;
    blanks next to CJK characters are removed; trailing commas become 。. With
    ``read_numbers`` the guard pass (:func:`guard_for_wetext`) and wetext read the numbers;
    otherwise, or when wetext fails, the digits stay.

    Args:
        text: cleaned text (:func:`.normalize.clean_text`) with Han or kana characters.
        language: "zh" or "ja" (the Japanese grammar and symbol words for "ja").
        read_numbers: read numbers as words (False: keep digits).
    """
    language = "ja" if language == "ja" else "zh"
    text = text.translate(_FULL_WIDTH_DIGITS)
    if read_numbers:
        text = guard_for_wetext(text, language)
    text = text.replace(" - ", "，").replace("——", "，")
    text = text.translate(_ZH_REMOVED)
    # a square or cube of metres (m², km³, µg/m³) is a unit, read by the unit table or wetext
    text = re.sub(r"(?<!m)²", "平方", text)
    text = re.sub(r"(?<!m)³", "立方", text)
    symbols = _JA_SYMBOLS if language == "ja" else _ZH_SYMBOLS
    for pattern, replacement in symbols:
        text = pattern.sub(replacement, text)
    text = _full_width_punctuation(text)
    text = _remove_blanks_near_cjk(text)
    text = re.sub(r"[，,、]+$", "。", text)
    text = re.sub(r" {2,}", " ", text).strip()
    if read_numbers and any(c.isdigit() for c in text):
        read = read_with_wetext(text, language)
        if read is not None:
            text = read
    return text


# -- Korean -----------------------------------------------------------------------------------

_KO_NUMBER = r"(?P<n>(?:(?<![\d.,])[-−])?\d+(?:[.,]\d+)*)"
_KO_UNITS: dict[str, str] = {
    "°C": "도", "℃": "도", "°F": "화씨 도", "℉": "화씨 도", "°": "도", "%": "퍼센트",
    "kWh": "킬로와트시", "kW": "킬로와트",
    "W": "와트", "hPa": "헥토파스칼", "mm": "밀리미터", "cm": "센티미터", "km": "킬로미터",
    "µg/m³": "마이크로그램 퍼 세제곱미터", "ppm": "피피엠", "kg": "킬로그램", "g": "그램",
    "ml": "밀리리터", "l": "리터", "L": "리터", "min": "분", "h": "시간", "s": "초",
    "V": "볼트", "A": "암페어", "dB": "데시벨",
}
"""Unit symbols after a number, as Korean reads them (the number stays digits: "21.5°C" ->
"21.5도"). Speeds take their word before the number, as Korean weather reports read them
(:data:`_KO_SPEEDS`: "12km/h" -> "시속 12킬로미터")."""
_KO_SPEEDS: dict[str, tuple[str, str]] = {"km/h": ("시속", "킬로미터"), "m/s": ("초속", "미터")}
_KO_CURRENCIES_BEFORE: dict[str, str] = {
    "₩": "원", "€": "유로", "$": "달러", "¥": "엔", "£": "파운드",
}
_KO_UNIT = re.compile(
    _KO_NUMBER + r"\s?(?P<u>" + "|".join(re.escape(u) for u in sorted(_KO_UNITS, key=len,
                                                                       reverse=True))
    + r")(?![A-Za-z0-9])"
)
_KO_MONEY = re.compile(r"(?P<c>[₩€$¥£])\s?" + _KO_NUMBER)
_KO_SPEED = re.compile(_KO_NUMBER + r"\s?(?P<u>km/h|m/s)(?![A-Za-z0-9])")


def normalize_korean(text: str) -> str:
    """Korean text: unit symbols and currencies after or before a number read as Korean
    words, the number kept in digits ("21.5°C" -> "21.5도", "₩5,000" -> "5,000원").

    Args:
        text: cleaned text with Hangul.
    """
    text = text.replace("μ", "µ")
    text = _KO_MONEY.sub(lambda m: m.group("n") + _KO_CURRENCIES_BEFORE[m.group("c")], text)
    text = _KO_SPEED.sub(lambda m: f"{_KO_SPEEDS[m.group('u')][0]} {m.group('n')}"
                         f"{_KO_SPEEDS[m.group('u')][1]}", text)
    text = _KO_UNIT.sub(lambda m: m.group("n") + _KO_UNITS[m.group("u")], text)
    return re.sub(r" {2,}", " ", text).strip()
