"""Normalisation: untrusted text -> the text the LLM reads (spec section 3).

Follows the rule-based fallback of upstream FunAudioLLM/CosyVoice (cosyvoice/cli/frontend.py
``CosyVoiceFrontEnd.text_normalize`` with utils/frontend_utils.py ``replace_blank``,
``replace_corner_mark``, ``remove_bracket``, ``spell_out_number``), with these differences:

* User text is untrusted. Upstream skips normalisation for text holding ``<|`` .. ``|>`` and
  encodes tokens such as ``<|endofprompt|>`` typed by a user as control tokens. Here
  ``<|name|>`` markup is removed (:func:`clean_text`), and the prompt builder encodes all user
  text so that it can never yield an added-token id (:mod:`.frontend`).
* Control, format, surrogate, private-use and unassigned characters and emoji are removed;
  every kind of blank becomes one space.
* Numbers, times, dates, units and money are read in the language of their sentence
  (:func:`reading_language`); upstream reads them in English whatever the language. Each
  language has its own module: English :mod:`.lang_en`; Chinese, Japanese and Korean
  :mod:`.lang_cjk`; German, French, Spanish, Italian and Russian :mod:`.lang_eu`. Letters
  with diacritics (ä ö ü ß é ñ ç ...) and Cyrillic are never touched.
* Text whose language is unknown keeps its digits (the LLM reads them), and so does all text
  when the caller asks for digits (``read_numbers=False``).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Literal, cast

from ..errors import TextError
from .lang_cjk import normalize_chinese, normalize_korean
from .lang_en import normalize_english
from .lang_eu import TABLES, read_european
from .pieces import cut_after_marks
from .script import char_script, dominant_script, has_cjk, is_emoji, script_units
from .units_en import UNITS

Language = Literal["zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru"]
"""The nine languages of the model card (Fun-CosyVoice3-0.5B-2512), ISO 639-1."""
LANGUAGES: tuple[Language, ...] = ("zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru")
LATIN_LANGUAGES: tuple[Language, ...] = ("en", "de", "fr", "es", "it")
"""The model's languages written in Latin script: told apart by :func:`language_cues`."""

# -- clean-up --------------------------------------------------------------------------------

_SPECIAL_MARKUP = re.compile(r"<\|[^<>|\s]{1,64}\|>")
"""Qwen / CosyVoice control-token syntax, e.g. ``<|endofprompt|>``, ``<|im_start|>``."""
_DROPPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})
_BLANK_CATEGORIES = frozenset({"Zs", "Zl", "Zp"})


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


# -- which language a sentence is read in ----------------------------------------------------
# Frequent function words of each Latin-script language. A word may belong to several
# languages ("de": French and Spanish; "la": French, Spanish, Italian); it then counts for each
# of them, so only the words of one language can tip the vote. Words shared with English
# ("in", "a", "so", "was", "will") are left out of English so that they cannot make a German
# or Italian sentence English. "other" holds frequent words of languages the model does not
# speak (Portuguese, Dutch, Scandinavian, Polish): their text keeps its digits.
def _word_set(*groups: str) -> frozenset[str]:
    return frozenset(word for group in groups for word in group.split())


_FUNCTION_WORDS: dict[str, frozenset[str]] = {
    "en": _word_set(
        """the is are were been being it its it's this that these those of to and or at for
        with from by your you my we our he she they them his her their have has had does did
        not would can could should there here what which who when where how now today please
        all if then than but up out about into i i'm i've don't doesn't isn't aren't won't
        can't let's there's that's what's turned turning set been just currently on off will"""
    ),
    "de": _word_set(
        """der die das und ist nicht ein eine einer einen dem den des mit auf für zu von sich
        ich du er sie es wir ihr sind war wird werden auch noch nur oder aber wie bei im um
        grad uhr heute jetzt ist's beträgt wurde liegt hat haben bis am vom zum zur seit
        morgen läuft stunden minuten sekunden prozent beim ab"""
    ),
    "fr": _word_set(
        """le la les un une des du de et est sont dans pour avec sur pas ce cette il elle nous
        vous je qui que au aux c'est degrés aujourd'hui à on en heures actuellement a y se"""
    ),
    "es": _word_set(
        """el la los las una un y es son está están en del de por para con se lo al hoy grados
        hay horas minutos segundos hasta desde actualmente a que le muy más pero has han ha
        he hemos"""
    ),
    "it": _word_set(
        """il gli di della del nel alla alle oggi gradi sono è ore minuti secondi un una per
        con che la le lo attualmente dalle a e ci al dei delle nella sul tra hai ho"""
    ),
    "other": _word_set(
        """não são uma hoje graus também het een van op te dat niet zijn met voor maar ook
        graden vandaag och är det som på av med jeg og ikke jest nie się że""",
    ),
}
_LETTERS: dict[str, frozenset[str]] = {
    "de": frozenset("äöüß"),
    "fr": frozenset("âêîôûçëïÿœéèàù"),
    "es": frozenset("ñáíóúé"),
    "it": frozenset("àèéìòù"),
    "other": frozenset("åøæãõłąęśźżčřšžőűđ"),
}
"""Letters that mark a word as one of these languages (each word votes once per language)."""
_SCRIPT_LANGUAGES: dict[str, Language] = {
    "han": "zh", "kana": "ja", "hangul": "ko", "cyrillic": "ru",
}
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]*)?")
_UNIT_WORDS = frozenset(
    word for symbol in (*UNITS, *(u for table in TABLES.values() for u in table.units))
    for word in re.findall(r"[^\W\d_]+", symbol)
)
"""The letters of unit symbols ("C" of °C, "km" and "h" of km/h): a sentence whose only
Latin letters are these ("20 °C.", "85%，20mm") is numbers and units, of no script."""
_ELISIONS: dict[str, tuple[str, ...]] = {
    "l'": ("fr", "it"), "d'": ("fr",), "qu'": ("fr",), "c'": ("fr",), "j'": ("fr",),
    "n'": ("fr",), "s'": ("fr",), "all'": ("it",), "dell'": ("it",), "nell'": ("it",),
    "un'": ("it",), "sull'": ("it",), "dall'": ("it",), "quest'": ("it",),
}
"""Elided articles and prepositions of French and Italian ("l'humidité", "all'85 %"): each
votes for its languages, and the word after it is counted as a word of its own."""


def language_cues(text: str) -> Counter[str]:
    """Votes for the languages of ``text``: each Latin word counts for every language whose
    function words (:data:`_FUNCTION_WORDS`) or letters (:data:`_LETTERS`) it holds, each
    Han / kana / Hangul / Cyrillic unit (:func:`.script.script_units`) for zh / ja / ko / ru
    (Han counts as Japanese when the text holds kana). "other" counts words of languages the
    model does not speak. Votes of consecutive texts add up (a stream's sentences).

    Args:
        text: any text (cleaned or not).

    Returns:
        Language code (or "other") -> votes; empty when nothing gives a cue.
    """
    votes: Counter[str] = Counter()
    units = script_units(text)
    kana = units.get("kana", 0) > 0
    for script, count in units.items():
        language = _SCRIPT_LANGUAGES.get(script)
        if script == "han" and kana:
            language = "ja"
        if language is not None:
            votes[language] += count
    for match in _WORD.finditer(text):
        if char_script(match.group(0)[0]) != "latin" or (
                match.start() > 0 and text[match.start() - 1].isdigit()):
            continue  # another script, or a suffix: 2e, 1er, 2nd, 15h
        if match.group(0) in ("AM", "PM"):  # "3:45 PM" is English; "PM2,5" or "AM" alone no cue
            if re.search(r"\d\s?$", text[:match.start()]):
                votes["en"] += 1
            continue
        word = unicodedata.normalize("NFC", match.group(0)).lower().replace("’", "'")
        head, apostrophe, tail = word.partition("'")
        if apostrophe and head + "'" in _ELISIONS:
            votes.update(_ELISIONS[head + "'"])
            if not tail:
                continue
            word = tail
        for name, words in _FUNCTION_WORDS.items():
            if word in words or not _LETTERS.get(name, frozenset()).isdisjoint(word):
                votes[name] += 1
        # µ of µg is a unit prefix; º and ª mark Spanish and Italian ordinals (2.º, 1ª)
        foreign = {c for c in word if not c.isascii() and c.isalpha()} - {"µ", "º", "ª"}
        if foreign and all(letters.isdisjoint(foreign) for letters in _LETTERS.values()):
            votes["other"] += 1
    return votes


def primary_language(tag: str | None) -> Language | None:
    """The model language of a language tag: "en_US", "de-DE", "zh-Hans" -> "en", "de",
    "zh"; None for None or a language the model does not speak."""
    if not tag:
        return None
    code = str(tag).replace("_", "-").split("-", 1)[0].lower()
    return cast(Language, code) if code in LANGUAGES else None


def winner(votes: Counter[str], among: Iterable[str] | None = None) -> str | None:
    """The language with the most votes (among ``among`` when given); None for no votes or
    a tie."""
    allowed = None if among is None else set(among)
    ranked = [(count, language) for language, count in votes.items()
              if count > 0 and (allowed is None or language in allowed)]
    if not ranked:
        return None
    ranked.sort(reverse=True)
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        return None
    return ranked[0][1]


def _best(candidates: tuple[str, ...], *sources: Counter[str] | str | None) -> Language | None:
    """The first decision among ``candidates`` that ``sources`` give (votes or a tag)."""
    for source in sources:
        if isinstance(source, Counter):
            choice = winner(source, candidates)
        else:
            choice = primary_language(source)
        if choice is not None and choice in candidates:
            return choice  # type: ignore[return-value]
    return None


def reading_language(
    sentence: str, context: Counter[str] | None = None, hint: str | None = None
) -> Language | None:
    """The language a sentence's numbers are read in, or None (keep its digits).

    By script first: Han or kana -> zh, or ja when it holds kana (also when Latin words
    outnumber them: "是 family, friends, 还是 people"); Hangul -> ko; Cyrillic -> ru.
    Latin script: the vote of :func:`language_cues` among en, de, fr, es and it; a tie is
    broken by ``context`` (the votes of the text before it, this sentence included), then by
    ``hint``, among the tied languages only, else None; a sentence of another language
    ("other" wins) is None. A sentence without letters ("50 %", "21:30") takes the context's
    language, then the hint's, and so does one whose only letters are unit symbols ("20 °C.");
    a Latin sentence without a word that votes ("Kitchen: 21 °C") the context's language
    whatever its script (inside a Chinese answer it
    is read in Chinese), else the hint's when that is a Latin-script language (a Chinese
    voice's "Kitchen: 21 °C" keeps its digits).

    Args:
        sentence: one cleaned sentence.
        context: votes of the text so far (:func:`language_cues` summed).
        hint: a language tag (the voice's language, or a stream's language so far).
    """
    script = dominant_script(sentence)
    if has_cjk(sentence) and script not in ("hangul", "cyrillic", "greek", "arabic", "hebrew"):
        return "ja" if any(char_script(c) == "kana" for c in sentence) else "zh"
    if script in ("hangul", "cyrillic"):
        return _SCRIPT_LANGUAGES[script]
    if script == "none":
        return _best(LANGUAGES, context, hint)
    if script != "latin":
        return None
    votes = language_cues(sentence)
    top = max((votes.get(language, 0) for language in (*LATIN_LANGUAGES, "other")), default=0)
    if top == 0:  # no word says which language ("15.2kWh", "Kitchen: 21 °C")
        if all(word in _UNIT_WORDS for word in _WORD.findall(sentence)):
            return _best(LANGUAGES, context, hint)  # numbers and units only: "20 °C."
        return _best(LANGUAGES, context) or _best(LATIN_LANGUAGES, hint)
    if votes.get("other", 0) == top:
        return None
    tied = tuple(language for language in LATIN_LANGUAGES if votes[language] == top)
    if len(tied) == 1:
        return tied[0]
    return _best(tied, context, hint)


# -- the whole text ----------------------------------------------------------------------------

SENTENCE_ENDS = frozenset("。？！….?!।؟۔")
"""Where a sentence ends for the choice of its language: the piece splitter's marks without
the clause marks (: ; 、): "Küche: 21 °C" and "PM、12、15.2kWh、つの..." are one sentence each,
so the clause of numbers is read in the language of the words around it."""

_CJK_JOIN = ("han", "kana")


def _reader(language: Language | None, read_numbers: bool) -> Callable[[str], str]:
    if language in ("zh", "ja"):
        return lambda text: normalize_chinese(text, language, read_numbers)
    if language == "ko":
        return normalize_korean
    if language == "en":
        return lambda text: normalize_english(text, read_numbers)
    if language is not None and read_numbers:
        return lambda text: read_european(text, language)
    return lambda text: text


def _join(parts: list[str]) -> str:
    out = ""
    for part in parts:
        if not part:
            continue
        if out and not (char_script(out[-1]) in _CJK_JOIN or _is_cjk_mark(out[-1])
                        or char_script(part[0]) in _CJK_JOIN or _is_cjk_mark(part[0])):
            out += " "
        out += part
    return out


def _is_cjk_mark(char: str) -> bool:
    return "\u3000" <= char <= "\u303f" or "\uff00" <= char <= "\uffef"


def normalize_text(text: str, language: str | None = None, read_numbers: bool = True) -> str:
    """Normalise one text for the LLM (spec section 3).

    The text is cleaned (:func:`clean_text`), cut into sentences (:data:`SENTENCE_ENDS`, with
    :func:`.pieces.cut_after_marks`: never between two digits nor after a German ordinal),
    and each sentence gets its reading language (:func:`reading_language`, with the votes of
    the text up to it as context and ``language`` as hint). Consecutive sentences of one
    language are read together by that language's module:

    * zh / ja (:func:`.lang_cjk.normalize_chinese`): clean-up, symbols in the language's word
      order, numbers by wetext (Chinese or Japanese grammar) after a guard pass;
    * ko (:func:`.lang_cjk.normalize_korean`): symbols as Korean words, digits stay;
    * en (:func:`.lang_en.normalize_english`): numbers, dates, times, units, money as words;
    * de, fr, es, it, ru (:func:`.lang_eu.read_european`): Home Assistant's number forms as
      words from each language's template table;
    * no language (another script, another Latin language, no cue): cleaned only, digits stay.

    Args:
        text: user text, untrusted.
        language: optional language tag (the voice's "en_US", a stream's "de"); used only
            for sentences that give no cue of their own.
        read_numbers: False keeps every digit as written (the server's ``--keep-digits``);
            symbols and clean-up still apply.

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
    context: Counter[str] = Counter()
    groups: list[tuple[Language | None, str]] = []
    for sentence in cut_after_marks(text, SENTENCE_ENDS):
        context.update(language_cues(sentence))
        chosen = reading_language(sentence, context, language)
        if groups and groups[-1][0] == chosen:
            groups[-1] = (chosen, groups[-1][1] + sentence)
        else:
            groups.append((chosen, sentence))
    parts = [_reader(chosen, read_numbers)(part.strip()) for chosen, part in groups]
    return re.sub(r" {2,}", " ", _join(parts)).strip()


def is_english(text: str, language: str | None = None) -> bool:
    """True when Latin-script ``text`` is read as English (:func:`reading_language` of the
    whole text, ``language`` breaking a tie)."""
    return reading_language(text, None, language) == "en"
