"""English: numbers, dates, times, units and money read as words, as Home Assistant says them.

Upstream's fallback front end (utils/frontend_utils.py ``spell_out_number``) spells every
digit run with ``inflect`` whatever the language and ignores decimals, times and units. Here
English text (:func:`.normalize.reading_language`) is read by :func:`expand_english`: number
words from ``num2words``, the unit names of :mod:`.units_en`; a range ("20-22 °C",
"8:00-17:30") is read with "to", and a phone number digit by digit.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from num2words import num2words

from .forms import PHONE, RANGE_DASH, VERSION
from .units_en import CURRENCIES, UNITS

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
_VERSION = VERSION
_NUMBER_SIGN = re.compile(r"#(?=\d)")
_RANGE_VALUE = r"\d{1,2}:\d{2}|\d+(?:\.\d+)?"
_RANGE = re.compile(
    rf"(?<![\w.,:/-])(?P<a>{_RANGE_VALUE}){RANGE_DASH}(?P<b>{_RANGE_VALUE})(?![\w:/-]|[.,]\d)"
)
"""A range of two numbers or two times: "20-22 °C", "8:00-17:30" (after the dates)."""
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


def _phone(match: re.Match[str]) -> str:
    """Phone number digit by digit, groups apart: "+1 555 123 4567" -> "plus one, five five
    five, one two three, four five six seven"."""
    groups = re.findall(r"\d+", match.group(0))
    words = ", ".join(digits(group) for group in groups)
    return _padded(match, ("plus " if match.group(0).startswith("+") else "") + words)


def _range(match: re.Match[str]) -> str:
    return f"{match.group('a')} to {match.group('b')}"


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
    (_SLASH_DATE, _slash_date),  # before the phone numbers: "05/12/2026" starts with a 0
    (PHONE, _phone),
    (_VERSION, _version),
    (_RANGE, _range),
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



def normalize_english(text: str, read_numbers: bool = True) -> str:
    """English text for the LLM: ``5 * 3 = 15`` is "five times three equals fifteen", a slash
    between two lower-case words is "or" ("on/off"), and with ``read_numbers`` every number
    form is read as words (:func:`expand_english`).

    Args:
        text: cleaned English text (:func:`.normalize.clean_text`).
        read_numbers: False keeps the digits (``&`` is still "and").
    """
    for pattern, words in _EN_ARITHMETIC:
        text = pattern.sub(words, text)
    if read_numbers:
        text = expand_english(text)
    else:
        text = re.sub(r"\s{2,}", " ", _AMPERSAND.sub(" and ", text)).strip()
    return _EN_WORD_SLASH.sub(_english_slash, text)
