"""German, French, Spanish, Italian and Russian: Home Assistant's number forms read as words.

:func:`read_european` reads, in this order, each with the words of the sentence's language:
phone numbers (digit by digit), dates (ISO, d.m.yyyy, dd/mm/yyyy, "5. Dezember 2026"),
times ("14:30", "14.30 Uhr", "7 h 05") and time ranges, money (€ $ ₽ £ before or after the
amount), grouped thousands ("1.013", "12 345"), versions, ordinals where the written form
says which one ("1. Stock" after an article, "1er", "1.º", "1-й"), years with a cue ("im Jahr
1998", "в 2026 году"), quantities with a unit ("21,5 °C", "85 %", "1 h 30 min", "12 km/h",
"20-22 °C", "-5 °C"), ranges, decimals with a comma or a point, and the remaining numbers.

Number words come from ``num2words``; the words around them from one table per language
(:data:`TABLES`: decimal word, months, units with their gender, currencies, the time, date and
range templates). Where the word of a number depends on a noun's gender or case that the
text does not give (a bare count before a noun: "1 Lampe" ein/eine, "21 lampes" un/une,
"200 luces" doscientos/doscientas, every Russian count), the digits stay.

num2words pitfalls avoided here: Italian drops the fraction of a decimal given as a string
("2.50" -> "due"), so fractions are read as their own numbers; Japanese years default to era
names (not used here); Spanish reads a decimal with "punto", Spain and Home Assistant's es
locale write a comma ("coma").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from num2words import num2words

from .forms import PHONE, RANGE_DASH, VERSION


@dataclass(frozen=True)
class Noun:
    """A unit or currency word after a number.

    Attributes:
        forms: (singular, plural); Russian (one, few, many): 1 / 2-4 / 5-20 ("градус",
            "градуса", "градусов"), the "few" form also after a decimal (genitive singular).
        gender: "m", "f" or "n": the number word agrees with it (ein/eine, un/une, один/одна).
    """

    forms: tuple[str, ...]
    gender: str = "m"


@dataclass(frozen=True)
class Table:
    """The words and templates of one language (the values are this module's, checked by
    hand against each language's grammar; see tests/test_text_languages.py).

    Attributes:
        code: num2words language code.
        minus, decimal, point, plus: words for "-5", "21,5", "1.2.3", "+49".
        digits: 0-9 for numbers read digit by digit.
        months: January .. December as a date reads them (Russian: genitive).
        units: unit symbol -> noun.
        currencies: symbol -> (main noun, sub noun).
        money: template of an amount with cents: {main} {main_noun} {sub} ({sub_noun} in ru).
        hour, minute: nouns of a time ("Uhr" has no plural: one form).
        time: template of a time with minutes: {h} {hour} {m} ...
        time_whole: template of a full hour.
        date: template of a date: {d} day, {month}, {y} year (" {y}" part only with a year).
        date_year: the year part of a date template.
        range: template of a range {a} .. {b}.
        safe_after: words after which a count is not a count of a noun ("von", "sur"...).
        version_words: words before a two-part version ("Version 2.1").
    """

    code: str
    minus: str
    decimal: str
    point: str
    plus: str
    digits: tuple[str, ...]
    months: tuple[str, ...]
    units: dict[str, Noun]
    currencies: dict[str, tuple[Noun, Noun]]
    money: str
    hour: Noun
    minute: Noun
    time: str
    time_whole: str
    date: str
    date_year: str
    range: str
    safe_after: frozenset[str] = field(default_factory=frozenset)
    version_words: frozenset[str] = field(default_factory=frozenset)


def _n(*forms: str, gender: str = "m") -> Noun:
    return Noun(tuple(forms), gender)


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


DE = Table(
    code="de", minus="minus", decimal="Komma", point="Punkt", plus="plus",
    digits=("null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun"),
    months=("Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August", "September",
            "Oktober", "November", "Dezember"),
    units={
        "°C": _n("Grad", gender="n"), "°F": _n("Grad Fahrenheit", gender="n"),
        "°": _n("Grad", gender="n"), "%": _n("Prozent", gender="n"),
        "min": _n("Minute", "Minuten", gender="f"), "h": _n("Stunde", "Stunden", gender="f"),
        "s": _n("Sekunde", "Sekunden", gender="f"), "km/h": _n("Kilometer pro Stunde"),
        "m/s": _n("Meter pro Sekunde"), "kWh": _n("Kilowattstunde", "Kilowattstunden",
                                                   gender="f"),
        "Wh": _n("Wattstunde", "Wattstunden", gender="f"), "kW": _n("Kilowatt", gender="n"),
        "W": _n("Watt", gender="n"), "V": _n("Volt", gender="n"), "A": _n("Ampere", gender="n"),
        "hPa": _n("Hektopascal", gender="n"), "mbar": _n("Millibar", gender="n"),
        "mm": _n("Millimeter"), "cm": _n("Zentimeter"), "km": _n("Kilometer"), "m": _n("Meter"),
        "l": _n("Liter"), "L": _n("Liter"), "ml": _n("Milliliter"),
        "kg": _n("Kilogramm", gender="n"), "g": _n("Gramm", gender="n"),
        "µg/m³": _n("Mikrogramm pro Kubikmeter", gender="n"), "ppm": _n("ppm", gender="n"),
        "dB": _n("Dezibel", gender="n"), "lx": _n("Lux", gender="n"),
    },
    currencies={"€": (_n("Euro"), _n("Cent")), "$": (_n("Dollar"), _n("Cent")),
                "₽": (_n("Rubel"), _n("Kopeke", "Kopeken", gender="f")),
                "£": (_n("Pfund", gender="n"), _n("Penny", "Pence"))},
    money="{main} {main_noun} {sub}",
    hour=_n("Uhr", gender="f"), minute=_n("Minute", "Minuten", gender="f"),
    time="{h} Uhr {m}", time_whole="{h} Uhr",
    date="{d} {month}", date_year=" {y}", range="{a} bis {b}",
    safe_after=_words("von bis und oder mal"),
    version_words=_words("Version Firmware Update"),
)
FR = Table(
    code="fr", minus="moins", decimal="virgule", point="point", plus="plus",
    digits=("zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf"),
    months=("janvier", "février", "mars", "avril", "mai", "juin", "juillet", "août",
            "septembre", "octobre", "novembre", "décembre"),
    units={
        "°C": _n("degré", "degrés"), "°F": _n("degré Fahrenheit", "degrés Fahrenheit"),
        "°": _n("degré", "degrés"), "%": _n("pour cent"),
        "min": _n("minute", "minutes", gender="f"), "h": _n("heure", "heures", gender="f"),
        "s": _n("seconde", "secondes", gender="f"),
        "km/h": _n("kilomètre par heure", "kilomètres par heure"),
        "m/s": _n("mètre par seconde", "mètres par seconde"),
        "kWh": _n("kilowattheure", "kilowattheures"), "Wh": _n("wattheure", "wattheures"),
        "kW": _n("kilowatt", "kilowatts"), "W": _n("watt", "watts"), "V": _n("volt", "volts"),
        "A": _n("ampère", "ampères"), "hPa": _n("hectopascal", "hectopascals"),
        "mbar": _n("millibar", "millibars"), "mm": _n("millimètre", "millimètres"),
        "cm": _n("centimètre", "centimètres"), "km": _n("kilomètre", "kilomètres"),
        "m": _n("mètre", "mètres"), "l": _n("litre", "litres"), "L": _n("litre", "litres"),
        "ml": _n("millilitre", "millilitres"), "kg": _n("kilogramme", "kilogrammes"),
        "g": _n("gramme", "grammes"),
        "µg/m³": _n("microgramme par mètre cube", "microgrammes par mètre cube"),
        "ppm": _n("ppm"), "dB": _n("décibel", "décibels"), "lx": _n("lux"),
    },
    currencies={"€": (_n("euro", "euros"), _n("centime", "centimes")),
                "$": (_n("dollar", "dollars"), _n("cent", "cents")),
                "₽": (_n("rouble", "roubles"), _n("kopeck", "kopecks")),
                "£": (_n("livre", "livres", gender="f"), _n("penny", "pence"))},
    money="{main} {main_noun} {sub}",
    hour=_n("heure", "heures", gender="f"), minute=_n("minute", "minutes", gender="f"),
    time="{h} {hour} {m}", time_whole="{h} {hour}",
    date="{d} {month}", date_year=" {y}", range="{a} à {b}",
    safe_after=_words("sur de à et ou fois"),
    version_words=_words("version"),
)
ES = Table(
    code="es", minus="menos", decimal="coma", point="punto", plus="más",
    digits=("cero", "uno", "dos", "tres", "cuatro", "cinco", "seis", "siete", "ocho", "nueve"),
    months=("enero", "febrero", "marzo", "abril", "mayo", "junio", "julio", "agosto",
            "septiembre", "octubre", "noviembre", "diciembre"),
    units={
        "°C": _n("grado", "grados"), "°F": _n("grado Fahrenheit", "grados Fahrenheit"),
        "°": _n("grado", "grados"), "%": _n("por ciento"),
        "min": _n("minuto", "minutos"), "h": _n("hora", "horas", gender="f"),
        "s": _n("segundo", "segundos"), "km/h": _n("kilómetro por hora", "kilómetros por hora"),
        "m/s": _n("metro por segundo", "metros por segundo"),
        "kWh": _n("kilovatio hora", "kilovatios hora"), "Wh": _n("vatio hora", "vatios hora"),
        "kW": _n("kilovatio", "kilovatios"), "W": _n("vatio", "vatios"),
        "V": _n("voltio", "voltios"), "A": _n("amperio", "amperios"),
        "hPa": _n("hectopascal", "hectopascales"), "mbar": _n("milibar", "milibares"),
        "mm": _n("milímetro", "milímetros"), "cm": _n("centímetro", "centímetros"),
        "km": _n("kilómetro", "kilómetros"), "m": _n("metro", "metros"),
        "l": _n("litro", "litros"), "L": _n("litro", "litros"),
        "ml": _n("mililitro", "mililitros"), "kg": _n("kilogramo", "kilogramos"),
        "g": _n("gramo", "gramos"),
        "µg/m³": _n("microgramo por metro cúbico", "microgramos por metro cúbico"),
        "ppm": _n("ppm"), "dB": _n("decibelio", "decibelios"), "lx": _n("lux"),
    },
    currencies={"€": (_n("euro", "euros"), _n("céntimo", "céntimos")),
                "$": (_n("dólar", "dólares"), _n("centavo", "centavos")),
                "₽": (_n("rublo", "rublos"), _n("kopek", "kopeks")),
                "£": (_n("libra", "libras", gender="f"), _n("penique", "peniques"))},
    money="{main} {main_noun} con {sub}",
    hour=_n("hora", "horas", gender="f"), minute=_n("minuto", "minutos"),
    time="{h} y {m}", time_whole="{h}",
    date="{d} de {month}", date_year=" de {y}", range="{a} a {b}",
    safe_after=_words("de a y o por entre"),
    version_words=_words("versión version"),
)
IT = Table(
    code="it", minus="meno", decimal="virgola", point="punto", plus="più",
    digits=("zero", "uno", "due", "tre", "quattro", "cinque", "sei", "sette", "otto", "nove"),
    months=("gennaio", "febbraio", "marzo", "aprile", "maggio", "giugno", "luglio", "agosto",
            "settembre", "ottobre", "novembre", "dicembre"),
    units={
        "°C": _n("grado", "gradi"), "°F": _n("grado Fahrenheit", "gradi Fahrenheit"),
        "°": _n("grado", "gradi"), "%": _n("per cento"),
        "min": _n("minuto", "minuti"), "h": _n("ora", "ore", gender="f"),
        "s": _n("secondo", "secondi"), "km/h": _n("chilometro orario", "chilometri orari"),
        "m/s": _n("metro al secondo", "metri al secondo"),
        "kWh": _n("chilowattora"), "Wh": _n("wattora"), "kW": _n("chilowatt"), "W": _n("watt"),
        "V": _n("volt"), "A": _n("ampere"), "hPa": _n("ettopascal"), "mbar": _n("millibar"),
        "mm": _n("millimetro", "millimetri"), "cm": _n("centimetro", "centimetri"),
        "km": _n("chilometro", "chilometri"), "m": _n("metro", "metri"),
        "l": _n("litro", "litri"), "L": _n("litro", "litri"), "ml": _n("millilitro", "millilitri"),
        "kg": _n("chilogrammo", "chilogrammi"), "g": _n("grammo", "grammi"),
        "µg/m³": _n("microgrammo per metro cubo", "microgrammi per metro cubo"),
        "ppm": _n("ppm"), "dB": _n("decibel"), "lx": _n("lux"),
    },
    currencies={"€": (_n("euro"), _n("centesimo", "centesimi")),
                "$": (_n("dollaro", "dollari"), _n("centesimo", "centesimi")),
                "₽": (_n("rublo", "rubli"), _n("copeco", "copechi")),
                "£": (_n("sterlina", "sterline", gender="f"), _n("penny", "pence"))},
    money="{main} {main_noun} e {sub}",
    hour=_n("ora", "ore", gender="f"), minute=_n("minuto", "minuti"),
    time="{h} e {m}", time_whole="{h}",
    date="{d} {month}", date_year=" {y}", range="da {a} a {b}",
    safe_after=_words("di su a e o per"),
    version_words=_words("versione"),
)
RU = Table(
    code="ru", minus="минус", decimal="целых", point="точка", plus="плюс",
    digits=("ноль", "один", "два", "три", "четыре", "пять", "шесть", "семь", "восемь", "девять"),
    months=("января", "февраля", "марта", "апреля", "мая", "июня", "июля", "августа",
            "сентября", "октября", "ноября", "декабря"),
    units={
        "°C": _n("градус", "градуса", "градусов"), "°F": _n("градус по Фаренгейту",
                                                            "градуса по Фаренгейту",
                                                            "градусов по Фаренгейту"),
        "°": _n("градус", "градуса", "градусов"), "%": _n("процент", "процента", "процентов"),
        "min": _n("минута", "минуты", "минут", gender="f"),
        "мин": _n("минута", "минуты", "минут", gender="f"),
        "h": _n("час", "часа", "часов"), "ч": _n("час", "часа", "часов"),
        "s": _n("секунда", "секунды", "секунд", gender="f"),
        "с": _n("секунда", "секунды", "секунд", gender="f"),
        "km/h": _n("километр в час", "километра в час", "километров в час"),
        "км/ч": _n("километр в час", "километра в час", "километров в час"),
        "m/s": _n("метр в секунду", "метра в секунду", "метров в секунду"),
        "м/с": _n("метр в секунду", "метра в секунду", "метров в секунду"),
        "kWh": _n("киловатт-час", "киловатт-часа", "киловатт-часов"),
        "кВт·ч": _n("киловатт-час", "киловатт-часа", "киловатт-часов"),
        "kW": _n("киловатт", "киловатта", "киловатт"), "кВт": _n("киловатт", "киловатта",
                                                                  "киловатт"),
        "W": _n("ватт", "ватта", "ватт"), "Вт": _n("ватт", "ватта", "ватт"),
        "V": _n("вольт", "вольта", "вольт"), "В": _n("вольт", "вольта", "вольт"),
        "A": _n("ампер", "ампера", "ампер"),
        "hPa": _n("гектопаскаль", "гектопаскаля", "гектопаскалей"),
        "гПа": _n("гектопаскаль", "гектопаскаля", "гектопаскалей"),
        "mm": _n("миллиметр", "миллиметра", "миллиметров"),
        "мм": _n("миллиметр", "миллиметра", "миллиметров"),
        "cm": _n("сантиметр", "сантиметра", "сантиметров"),
        "см": _n("сантиметр", "сантиметра", "сантиметров"),
        "km": _n("километр", "километра", "километров"),
        "км": _n("километр", "километра", "километров"),
        "l": _n("литр", "литра", "литров"), "L": _n("литр", "литра", "литров"),
        "л": _n("литр", "литра", "литров"),
        "kg": _n("килограмм", "килограмма", "килограммов"),
        "кг": _n("килограмм", "килограмма", "килограммов"),
        "µg/m³": _n("микрограмм на кубический метр", "микрограмма на кубический метр",
                    "микрограммов на кубический метр"),
        "мкг/м³": _n("микрограмм на кубический метр", "микрограмма на кубический метр",
                     "микрограммов на кубический метр"),
        "ppm": _n("ppm", "ppm", "ppm"), "dB": _n("децибел", "децибела", "децибел"),
        "дБ": _n("децибел", "децибела", "децибел"),
    },
    currencies={"€": (_n("евро", "евро", "евро"), _n("цент", "цента", "центов")),
                "$": (_n("доллар", "доллара", "долларов"), _n("цент", "цента", "центов")),
                "₽": (_n("рубль", "рубля", "рублей"),
                      _n("копейка", "копейки", "копеек", gender="f")),
                "£": (_n("фунт", "фунта", "фунтов"), _n("пенни", "пенни", "пенни"))},
    money="{main} {main_noun} {sub} {sub_noun}",
    hour=_n("час", "часа", "часов"), minute=_n("минута", "минуты", "минут", gender="f"),
    time="{h} {hour} {m} {minute}", time_whole="{h} {hour}",
    date="{d} {month}", date_year=" {y} года", range="от {a} до {b}",
    safe_after=_words("из и или до на"),
    version_words=_words("версия версии версию"),
)
TABLES: dict[str, Table] = {"de": DE, "fr": FR, "es": ES, "it": IT, "ru": RU}
"""One table per language; the keys are the languages :func:`read_european` reads."""

# -- number words --------------------------------------------------------------------------------


def _cardinal(value: int, t: Table, gender: str | None = None, case: str = "n") -> str:
    """Cardinal of ``value`` agreeing with a noun of ``gender`` (None: the counting form,
    "eins", "un", "uno", "один")."""
    if value < 0:
        return f"{t.minus} {_cardinal(-value, t, gender, case)}"
    if t.code == "ru":
        return str(num2words(value, lang="ru", case=case, gender=gender or "m"))
    words = str(num2words(value, lang=t.code))
    if gender is None:
        return words
    return _agree(words, t.code, gender)


def _agree(words: str, code: str, gender: str) -> str:
    """A counting form before a noun of ``gender``: eins -> ein/eine, un -> une, uno -> un /
    una (veintiuno -> veintiún / veintiuna, doscientos -> doscientas), uno -> un / una."""
    if code == "de" and words.endswith("eins"):
        return words[:-1] + ("e" if gender == "f" else "")
    if code == "fr" and gender == "f" and words.endswith("un"):
        return words + "e"
    if code == "es":
        if gender == "f":
            words = words.replace("ientos", "ientas")
            return words[:-1] + "a" if words.endswith("uno") else words
        if words.endswith("veintiuno"):
            return words[:-3] + "ún"
        return words[:-1] if words.endswith("uno") else words
    if code == "it" and words == "uno":
        return "una" if gender == "f" else "un"
    return words


def _ordinal(value: int, t: Table, gender: str = "m", case: str = "n") -> str:
    if t.code == "ru":
        return str(num2words(value, lang="ru", to="ordinal", case=case, gender=gender))
    words = str(num2words(value, lang=t.code, to="ordinal"))
    if gender == "f" and t.code in ("es", "it") and words.endswith("o"):
        return words[:-1] + "a"
    if gender == "f" and t.code == "fr" and words == "premier":
        return "première"
    return words


def _year(value: int, t: Table) -> str:
    if t.code == "de" and 1100 <= value <= 1999:  # neunzehnhundertachtundneunzig
        return str(num2words(value, lang="de", to="year"))
    return _cardinal(value, t)


def _digits(text: str, t: Table) -> str:
    return " ".join(t.digits[int(c)] for c in text if c.isdigit())


def _fraction(frac: str, t: Table) -> str:
    """The digits after a decimal comma: German reads them one by one ("Komma neun neun");
    French, Spanish and Italian read leading zeros, then the rest as a number ("virgule zéro
    cinq", "coma noventa y nueve")."""
    if t.code == "de" or len(frac) > 3:
        return _digits(frac, t)
    zeros = len(frac) - len(frac.lstrip("0"))
    rest = frac.lstrip("0")
    words = [t.digits[0]] * zeros + ([_cardinal(int(rest), t)] if rest else [])
    return " ".join(words)


def _decimal(int_text: str, frac: str | None, t: Table, gender: str | None = None,
             case: str = "n") -> str:
    """Words of "21,5" / "21.5" / "-3": the integer part agrees with ``gender`` only when
    there is no fraction (German "eins Komma fünf", Russian "одна целая пять десятых")."""
    negative = int_text.startswith(("-", "−"))
    digits = int_text.lstrip("-−")
    if frac is None:
        words = _cardinal(int(digits), t, gender, case)
    elif t.code == "ru":
        words = str(num2words(f"{int(digits)}.{frac}", lang="ru"))
    else:
        words = f"{_cardinal(int(digits), t)} {t.decimal} {_fraction(frac, t)}"
    return f"{t.minus} {words}" if negative else words


def _noun(noun: Noun, int_text: str, frac: str | None, t: Table, case: str = "n") -> str:
    """The form of ``noun`` after the number: plural from 2 (French: below 2 singular, also
    for decimals), Russian one / few / many, the few form after a decimal."""
    forms = noun.forms
    value = abs(int(int_text.lstrip("-−") or 0))
    if t.code == "ru":
        if frac is not None:
            return forms[1]
        if case == "g":
            return forms[1] if value % 10 == 1 and value % 100 != 11 else forms[2]
        if value % 10 == 1 and value % 100 != 11:
            return forms[0]
        if 2 <= value % 10 <= 4 and not 12 <= value % 100 <= 14:
            return forms[1]
        return forms[2]
    if len(forms) == 1:
        return forms[0]
    if t.code == "fr":
        amount = float(f"{value}.{frac}") if frac else value
        return forms[0] if amount < 2 else forms[1]
    return forms[0] if value == 1 and frac is None else forms[1]


# -- patterns -----------------------------------------------------------------------------------

_NUM = r"(?:(?<![\w.,])[-−])?\d+(?:[.,]\d+)?"
_SIGNED = re.compile(r"(?P<int>[-−]?\d+)(?:[.,](?P<frac>\d+))?")


def _split_number(text: str) -> tuple[str, str | None]:
    match = _SIGNED.fullmatch(text)
    if match is None:
        return text, None
    return match.group("int"), match.group("frac")


def _unit_alternatives(t: Table) -> str:
    return "|".join(re.escape(u) for u in sorted(t.units, key=len, reverse=True))


_PREPOSITION_CASES = {
    "до": "g", "с": "g", "от": "g", "после": "g", "около": "g", "из": "g", "без": "g",
    "к": "d", "по": "d",
}
"""Russian prepositions before a time, date or amount and the case they govern."""


def _word_before(text: str, start: int) -> str:
    match = re.search(r"([^\W\d_]+)\W*$", text[:start])
    return match.group(1).lower() if match else ""


def _ru_case(text: str, start: int) -> str:
    return _PREPOSITION_CASES.get(_word_before(text, start), "n")


# -- the passes -----------------------------------------------------------------------------------


def _phone(t: Table) -> Callable[[re.Match[str]], str]:
    def read(match: re.Match[str]) -> str:
        groups = [_digits(group, t) for group in re.findall(r"\d+", match.group(0))]
        plus = f"{t.plus} " if match.group(0).startswith("+") else ""
        return plus + ", ".join(groups)
    return read


def _date_words(day: int, month: int, year: int | None, t: Table, text: str,
                start: int) -> str | None:
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    before = _word_before(text, start)
    if t.code == "de":
        # "der 5. Dezember" (nominative), else dative: "am fünften Dezember", "bis zum ..."
        preposition = _word_before(text, start - len(before) - 1) if before == "der" else ""
        words = _ordinal(day, t)
        if before not in ("der", "die", "das") or preposition in _DE_PREPOSITIONS:
            words += "n"
    elif t.code == "ru":
        case = _PREPOSITION_CASES.get(before)
        if case is None:  # "Сегодня 5 декабря" names the day; without a word it is a time
            case = "n" if before in ("сегодня", "завтра", "вчера", "это", "") else "g"
        words = _ordinal(day, t, "n", case)
    elif day == 1 and t.code in ("fr", "it"):
        words = _ordinal(1, t)
    else:
        words = _cardinal(day, t)
    out = t.date.format(d=words, month=t.months[month - 1])
    if year is not None:
        year_words = (_ordinal(year, t, "m", "g") if t.code == "ru" else _year(year, t))
        out += t.date_year.format(y=year_words)
    return out


_DE_DATIVE = frozenset(["in", "mit", "nach", "seit", "von", "zu", "bei", "aus"])
"""German prepositions that put a following "ein" into the dative ("in einer Stunde")."""
_DE_PREPOSITIONS = _words(
    "in an auf aus bei mit nach von zu vor hinter über unter seit bis ab für"
)


_BETWEEN: dict[str, tuple[frozenset[str], str]] = {
    "de": (frozenset({"zwischen"}), "{a} und {b}"),
    "fr": (frozenset({"entre"}), "{a} et {b}"),
    "es": (frozenset({"entre"}), "{a} y {b}"),
    "it": (frozenset({"tra", "fra"}), "{a} e {b}"),
    "ru": (frozenset({"от"}), "{a} до {b}"),
}
"""A range after "zwischen" / "entre" / "tra" / "от" already has its first word: "zwischen
zwanzig und zweiundzwanzig", not "zwischen zwanzig bis"."""


def _range(t: Table, text: str, start: int, first: str, last: str,
           template: str | None = None) -> str:
    words, between = _BETWEEN[t.code]
    if _word_before(text, start) in words:
        return between.format(a=first, b=last)
    return (template or t.range).format(a=first, b=last)


def _time_words(hour: int, minute: int, t: Table, case: str = "n") -> str | None:
    """A time in words; None (keep the digits) for an impossible time, or a Russian case
    whose noun forms the tables do not hold (only nominative and genitive)."""
    if hour > 24 or minute > 59 or case not in ("n", "g"):
        return None
    hour_words = _cardinal(hour, t, t.hour.gender, case)
    hour_noun = _noun(t.hour, str(hour), None, t, case)
    if t.code == "de":
        hour_words = _cardinal(hour, t, "n")  # "ein Uhr"
    if minute == 0:
        return t.time_whole.format(h=hour_words, hour=hour_noun)
    # minutes agree with their noun where it is said (ru) or implied (fr: "heures une");
    # German, Spanish and Italian count them ("Uhr eins", "y uno", "e uno")
    minute_gender = t.minute.gender if t.code in ("fr", "ru") else None
    minute_words = _cardinal(minute, t, minute_gender, case)
    return t.time.format(h=hour_words, hour=hour_noun, m=minute_words,
                         minute=_noun(t.minute, str(minute), None, t, case))


def read_european(text: str, language: str) -> str:
    """Read the numbers of a German, French, Spanish, Italian or Russian text as words
    (the module docstring lists the forms and their order).

    Args:
        text: cleaned text (:func:`.normalize.clean_text`) of one language.
        language: "de", "fr", "es", "it" or "ru".

    Returns:
        The text with its number forms read; digits remain only in bare counts before a noun
        whose gender or case decides the number word.

    Raises:
        KeyError: ``language`` has no table.
    """
    t = TABLES[language]
    text = text.replace("μ", "µ").replace("℃", "°C").replace("℉", "°F")
    text = re.sub(r"°\s+([CF])(?![A-Za-z])", r"°\1", text)
    text = _dates(text, t)  # before the phone numbers: "05/12/2026" has a leading 0
    text = PHONE.sub(_phone(t), text)
    text = _times(text, t)
    text = _money(text, t)
    text = _grouped(text, t)
    text = VERSION.sub(lambda m: f" {t.point} ".join(_cardinal(int(p), t)
                                                       for p in m.group(0).split(".")), text)
    text = _ordinals(text, t)
    text = _years(text, t)
    text = _quantities(text, t)
    text = _numbers(text, t)
    text = re.sub(r"\s+([.,!?;:…)])", r"\1", text)
    text = re.sub(r"(?<=[^\W\d_]['’]) ", "", text)  # "dell'ottantacinque"
    return re.sub(r"\s{2,}", " ", text).strip()


_ISO_DATE = re.compile(r"(?<![\w.:/-])(?P<y>\d{4})-(?P<m>\d{1,2})-(?P<d>\d{1,2})(?![\w:/-])")
_LOCAL_DATE = re.compile(
    r"(?<![\w.,/])(?P<d>\d{1,2})(?P<sep>[./])(?P<m>\d{1,2})(?P=sep)(?P<y>\d{4})(?![\w/]|[.,]\d)"
)
_DAY_MONTH = re.compile(
    r"(?P<cue>\b(?:am|vom|zum|bis|ab|seit|den|der|dem|für)\s)(?P<d>\d{1,2})\.(?P<m>\d{1,2})\."
    r"(?!\d)", re.IGNORECASE
)
"""A German date without a year, "am 5.12.", only after a word that announces a date: a
sentence ending in "21.5." is more often a number than the 21st of May."""


def _dates(text: str, t: Table) -> str:
    def numeric(match: re.Match[str]) -> str:
        groups = match.groupdict()
        year = int(groups["y"]) if groups.get("y") else None
        cue = groups.get("cue") or ""
        words = _date_words(int(match.group("d")), int(match.group("m")), year, t,
                            match.string, match.start() + len(cue))
        return cue + words if words is not None else match.group(0)

    text = _ISO_DATE.sub(numeric, text)
    text = _LOCAL_DATE.sub(numeric, text)
    if t.code == "de":
        text = _DAY_MONTH.sub(numeric, text)
    months = "|".join(t.months)
    day_dot = r"\.?" if t.code == "de" else ""
    pattern = re.compile(
        rf"(?<![\w.,])(?P<d>\d{{1,2}}){day_dot}\s+(?:de\s+)?(?P<month>{months})"
        rf"(?:(?:\s+de)?\s+(?P<y>\d{{4}})(?:\s*(?:года|г\.))?)?(?![\w])", re.IGNORECASE
    )

    def named(match: re.Match[str]) -> str:
        month = [m.lower() for m in t.months].index(match.group("month").lower()) + 1
        year = int(match.group("y")) if match.group("y") else None
        words = _date_words(int(match.group("d")), month, year, t, match.string, match.start())
        return words if words is not None else match.group(0)

    return pattern.sub(named, text)


def _times(text: str, t: Table) -> str:
    separator = {"de": r"(?::|\.(?=\d\d\s?Uhr))", "fr": r"(?::|\s?h\s?)"}.get(t.code, ":")
    clock = r"(?P<h{n}>\d{{1,2}})" + separator + r"(?P<m{n}>\d{{2}})(?!\d|\s?min)"
    one = clock.format(n=1)
    two = clock.format(n=2)
    tail = r"(?:\s?Uhr\b)?" if t.code == "de" else ""
    range_pattern = re.compile(rf"(?<![\w.,:])(?:{one}){tail}{RANGE_DASH}(?:{two}){tail}"
                               r"(?![\d:])")
    single = re.compile(rf"(?<![\w.,:])(?:{one}){tail}(?![\d:])")

    def value(match: re.Match[str], n: int) -> tuple[int, int]:
        return int(match.group(f"h{n}")), int(match.group(f"m{n}"))

    def read_range(match: re.Match[str]) -> str:
        case = "g" if t.code == "ru" else "n"
        first = _time_words(*value(match, 1), t, case)
        second = _time_words(*value(match, 2), t, case)
        if first is None or second is None:
            return match.group(0)
        template = "с {a} до {b}" if t.code == "ru" else (
            "dalle {a} alle {b}" if t.code == "it" else t.range)
        return " " + _range(t, match.string, match.start(), first, second, template) + " "

    def read_single(match: re.Match[str]) -> str:
        case = _ru_case(match.string, match.start()) if t.code == "ru" else "n"
        words = _time_words(*value(match, 1), t, case)
        return match.group(0) if words is None else f" {words} "

    text = range_pattern.sub(read_range, text)
    return single.sub(read_single, text)


def _money(text: str, t: Table) -> str:
    symbols = "".join(re.escape(c) for c in t.currencies)
    amount = r"(?P<int>[-−]?\d{1,3}(?:[.  \u202f]\d{3})+|[-−]?\d+)(?:[.,](?P<frac>\d{1,2}))?"
    before = re.compile(rf"(?<![\w.,])(?P<cur>[{symbols}])\s?{amount}(?![\d])")
    after = re.compile(rf"(?<![\w.,]){amount}\s?(?P<cur>[{symbols}])")

    def read(match: re.Match[str]) -> str:
        main_noun, sub_noun = t.currencies[match.group("cur")]
        whole_text = re.sub(r"[.  \u202f]", "", match.group("int"))
        frac = match.group("frac")
        case = _ru_case(match.string, match.start()) if t.code == "ru" else "n"
        if case not in ("n", "g"):  # the tables hold nominative and genitive nouns only
            return match.group(0)
        whole = int(whole_text)
        main = _cardinal(whole, t, main_noun.gender, case)
        main_form = _noun(main_noun, whole_text, None, t, case)
        cents = int(frac.ljust(2, "0")) if frac else 0
        if not cents:
            return f" {main} {main_form} "
        sub = _cardinal(cents, t, sub_noun.gender, case)
        sub_form = _noun(sub_noun, str(cents), None, t, case)
        if whole == 0:
            return f" {sub} {sub_form} "
        return " " + t.money.format(main=main, main_noun=main_form, sub=sub,
                                    sub_noun=sub_form) + " "

    text = before.sub(read, text)
    return after.sub(read, text)


def _grouped(text: str, t: Table) -> str:
    """Grouped thousands as plain digits: "1.013" (de, es, it), "12 345" (fr, ru, and the
    narrow no-break space of Home Assistant's fr locale)."""
    if t.code in ("de", "es", "it"):
        pattern = r"(?<![\w.,])\d{1,3}(?:\.\d{3})+(?![\d]|\.\d)"
    else:
        pattern = r"(?<![\w.,])\d{1,3}(?:[  \u202f]\d{3})+(?![\d]|[.,]\d{3})"
    # a count that keeps its digits keeps them without the group mark ("12345 pasos"): the
    # later passes would read the parts of "12.345" as a decimal
    return re.sub(pattern, lambda m: re.sub(r"\D", "", m.group(0)), text)


def _ordinals(text: str, t: Table) -> str:
    if t.code == "de":
        pattern = re.compile(r"\b(?P<art>im|am|vom|zum|beim|zur|dem|den|des|der|die|das)\s"
                             r"(?P<n>\d{1,3})\.(?=\s+[A-ZÄÖÜ])", re.IGNORECASE)

        def read(match: re.Match[str]) -> str:
            article = match.group("art")
            preposition = _word_before(match.string, match.start())
            words = _ordinal(int(match.group("n")), t)
            if article.lower() not in ("der", "die", "das") or preposition in _DE_PREPOSITIONS:
                words += "n"
            return f"{article} {words}"
        return pattern.sub(read, text)
    if t.code == "fr":
        def read_fr(match: re.Match[str]) -> str:
            value, suffix = int(match.group(1)), match.group(2)
            if value == 1:
                return "première" if suffix in ("re", "ère") else "premier"
            return _ordinal(value, t)
        return re.sub(r"(?<![\w.,])(\d+)(er|re|ère|e|ème)\b", read_fr, text)
    if t.code in ("es", "it"):
        def read_romance(match: re.Match[str]) -> str:
            value, suffix = int(match.group(1)), match.group(2)
            gender = "f" if suffix in ("ª", ".ª") else "m"
            words = _ordinal(value, t, gender)
            if suffix.endswith("er"):  # primer, tercer (apocope before a noun)
                words = words[:-1]
            return words
        suffixes = r"(\.?º|\.?ª|\.er)" if t.code == "es" else r"(º|ª)"
        return re.sub(rf"(?<![\w.,])(\d+){suffixes}", read_romance, text)
    endings = {"й": ("m", "n"), "я": ("f", "n"), "е": ("n", "n"), "го": ("m", "g"),
               "му": ("m", "d"), "ю": ("f", "a"), "м": ("m", "i")}

    def read_ru(match: re.Match[str]) -> str:
        gender, case = endings[match.group(2)]
        if match.group(2) == "м" and _word_before(match.string, match.start()) in (
                "на", "в", "во", "о", "об", "при"):
            case = "p"  # "на 1-м этаже": на первом этаже
        return _ordinal(int(match.group(1)), t, gender, case)
    return re.sub(r"(?<![\w.,])(\d+)-(й|я|е|го|му|ю|м)(?![\w])", read_ru, text)


def _years(text: str, t: Table) -> str:
    if t.code == "ru":
        forms = {"году": ("p", "году"), "года": ("g", "года"), "год": ("n", "год"),
                 "г.": ("g", "года")}

        def read_ru(match: re.Match[str]) -> str:
            case, noun = forms[match.group(2)]
            return f"{_ordinal(int(match.group(1)), t, 'm', case)} {noun}"
        return re.sub(r"(?<![\w.,])(\d{4})\s?(году|года|год|г\.)(?!\w)", read_ru, text)
    if t.code == "de":
        cue = r"\b((?:Jahr|Jahre|Baujahr|seit|im|von|bis|ab|um|Anfang|Ende)\s)"
        return re.sub(cue + r"(1[1-9]\d\d)(?!\w|[.,]\d|\s?[%°])",
                      lambda m: m.group(1) + _year(int(m.group(2)), t), text)
    return text


def _quantities(text: str, t: Table) -> str:
    units = _unit_alternatives(t)
    pattern = re.compile(
        rf"(?<![^\W\d_])(?P<a>{_NUM})(?:{RANGE_DASH}(?P<b>{_NUM}))?\s?(?P<unit>{units})"
        r"(?![\w/²³])"
    )

    def read(match: re.Match[str]) -> str:
        noun = t.units[match.group("unit")]
        first_int, first_frac = _split_number(match.group("a"))
        if match.group("b") is None:
            case = _ru_case(match.string, match.start()) if t.code == "ru" else "n"
            if case not in ("n", "g"):  # the tables hold nominative and genitive nouns only
                return match.group(0)
            number = _decimal(first_int, first_frac, t, noun.gender, case)
            if (t.code == "de" and first_frac is None and number.endswith(("ein", "eine"))
                    and _word_before(match.string, match.start()) in _DE_DATIVE):
                # "in einer Stunde", "mit einem Grad": the preposition gives the case
                number = number.removesuffix("e") + ("er" if noun.gender == "f" else "em")
            form = _noun(noun, first_int, first_frac, t, case)
            if t.code == "it" and number == "una" and form[:1] in "aeiou":
                return f" un'{form} "  # "un'ora"
            return f" {number} {form} "
        last_int, last_frac = _split_number(match.group("b"))
        case = "g" if t.code == "ru" else "n"
        first = _decimal(first_int, first_frac, t, noun.gender, case)
        last = _decimal(last_int, last_frac, t, noun.gender, case)
        return (" " + _range(t, match.string, match.start(), first, last) + " "
                + _noun(noun, last_int, last_frac, t, case) + " ")

    return pattern.sub(read, text)


def _numbers(text: str, t: Table) -> str:
    ranges = re.compile(rf"(?<![\w.,:/-])(?P<a>\d+(?:[.,]\d+)?){RANGE_DASH}"
                        rf"(?P<b>\d+(?:[.,]\d+)?)(?![\w:/-]|[.,]\d)")

    def read_range(match: re.Match[str]) -> str:
        case = "g" if t.code == "ru" else "n"
        first = _decimal(*_split_number(match.group("a")), t, None, case)
        last = _decimal(*_split_number(match.group("b")), t, None, case)
        return _range(t, match.string, match.start(), first, last)

    text = ranges.sub(read_range, text)
    # a time left as written (a Russian case the tables do not hold) stays whole: "к 7:00"
    number = re.compile(r"(?P<neg>(?<![\w.,])[-−])?(?<![\d:])(?P<int>\d+)(?:[.,](?P<frac>\d+))?"
                        r"(?!\d|:\d)")

    def read(match: re.Match[str]) -> str:
        int_text, frac = match.group("int"), match.group("frac")
        source = match.string
        after = source[match.end():]
        follower = re.match(r"\s+([^\W\d_][\w'’-]*)", after)
        attached = match.start() > 0 and source[match.start() - 1].isalpha()  # CO2, PM2,5
        if frac is None and follower is not None and not attached and not _before_noun_is_safe(
                int(int_text), follower.group(1), t):
            return match.group(0)  # a count before a noun: gender or case unknown
        case = _ru_case(source, match.start()) if t.code == "ru" else "n"
        if len(int_text) > 1 and int_text.startswith("0"):
            words = _digits(int_text, t)
        else:
            words = _decimal(int_text, frac, t, None, case)
        if match.group("neg"):
            words = f"{t.minus} {words}"
        left = " " if match.start() > 0 and source[match.start() - 1].isalnum() else ""
        right = " " if after[:1].isalnum() else ""
        return f"{left}{words}{right}"

    return number.sub(read, text)


def _before_noun_is_safe(value: int, word: str, t: Table) -> bool:
    """True when ``value`` may be read as words before ``word``: the word is not a noun it
    counts (a preposition or conjunction of ``safe_after``), or the number's word is the same
    for every gender (German: not ending in "eins"; French: not in "un"; Spanish: not in "uno"
    nor hundreds; Italian: not in "uno"). Russian counts change with case: never."""
    if word.lower() in t.safe_after:
        return True
    if t.code == "ru":
        return False
    words = str(num2words(value, lang=t.code))
    if t.code == "de":
        return not words.endswith("eins")
    if t.code == "fr":
        return not words.endswith("un")
    if t.code == "es":
        return not words.endswith("uno") and "ientos" not in words
    return not words.endswith("uno")
