"""Text normalisation: cases C2, C3, C4 and the clean-up rules (spec section 3)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wyoming_cosyvoice3.engine.errors import TextError
from wyoming_cosyvoice3.engine.text import dominant_script, is_english, normalize_text
from wyoming_cosyvoice3.engine.text.lang_en import expand_english

C2 = [
    ("It is 21.5 °C in the living room.",
     "It is twenty-one point five degrees Celsius in the living room."),
    ("Your timer for 3:45 PM is set.", "Your timer for three forty-five PM is set."),
    ("Battery at 50%.", "Battery at fifty percent."),
    ("Today is December 17, 2023.", "Today is December seventeenth, twenty twenty-three."),
    ("Dinner at 6:31 PM", "Dinner at six thirty-one PM"),
]
C3 = "Die Temperatur beträgt 10 Grad. Natürlich ändert sich das."
C4_ZH = "大家好，这里介绍一篇名为AN IMAGE IS WORTH 16X16 WORDS的论文。"
C4_MIXED = "Look at the photo. 是 family, friends, 还是 people at a game?"


@pytest.mark.parametrize(("text", "expected"), C2)
def test_c2_home_assistant_sentences_read_as_words(text: str, expected: str) -> None:
    assert normalize_text(text) == expected


@pytest.mark.parametrize(("text", "expected"), C2)
def test_c2_normalisation_is_idempotent(text: str, expected: str) -> None:
    assert normalize_text(normalize_text(text)) == expected


def test_c3_german_numbers_read_in_german_and_umlauts_kept() -> None:
    out = normalize_text(C3)
    assert out == "Die Temperatur beträgt zehn Grad. Natürlich ändert sich das."
    for letter in "äüÄÖÜß":
        assert out.count(letter) == C3.count(letter)
    assert not is_english(C3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Il fait 21,5 °C aujourd'hui, c'est très agréable.",
         "Il fait vingt et un virgule cinq degrés aujourd'hui, c'est très agréable."),
        ("Mañana la temperatura es de 18 grados en el salón.",
         "Mañana la temperatura es de dieciocho grados en el salón."),
        ("Oggi ci sono 25 gradi e il sole è forte.",
         "Oggi ci sono venticinque gradi e il sole è forte."),
        ("Straße Nr. 5 ist für Fußgänger gesperrt.", "Straße Nr. fünf ist für Fußgänger gesperrt."),
        # a count before a Russian noun keeps its digits (the case is not known)
        ("Сейчас 21 градус, влажность 45%.", "Сейчас 21 градус, влажность сорок пять процентов."),
        # Dutch is no language of the model, Korean keeps its digits: both unchanged
        ("Het is vandaag 12 graden in de woonkamer.", "Het is vandaag 12 graden in de woonkamer."),
        ("오늘은 21도입니다. 좋은 하루 되세요.", "오늘은 21도입니다. 좋은 하루 되세요."),
    ],
)
def test_non_english_text_reads_its_own_numbers_and_keeps_letters(text: str,
                                                                   expected: str) -> None:
    out = normalize_text(text)
    assert out == expected
    assert not any(word in out.split() for word in ("one", "two", "five", "twenty", "percent"))


def test_c4_chinese_with_latin_reads_numbers_and_keeps_letters() -> None:
    assert normalize_text(C4_ZH) == (
        "大家好，这里介绍一篇名为AN IMAGE IS WORTH 十六X十六 WORDS的论文。")
    assert dominant_script(C4_ZH) == "han"


def test_c4_mixed_sentence_gets_chinese_cleanup() -> None:
    """The English sentence is read as English, the mixed one with the Chinese clean-up."""
    out = normalize_text(C4_MIXED)
    assert out == "Look at the photo.是family，friends，还是people at a game？"
    assert dominant_script(out) == "latin"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("温度是21.5度. 很好", "温度是二十一点五度。很好"),
        ("时间 3:45 到了", "时间三点四十五分到了"),
        ("面积100m²（大约）", "面积一百平方米大约"),
        ("今天 - 明天——后天，", "今天，明天，后天。"),
        ("【通知】访问 www.example.com 了解", "通知访问www.example.com了解"),
        ("今日は21度です。", "今日は二十一度です。"),
    ],
)
def test_chinese_cleanup(text: str, expected: str) -> None:
    assert normalize_text(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("It is -5 °F outside.", "It is minus five degrees Fahrenheit outside."),
        ("It is 1 °C.", "It is one degree Celsius."),
        ("The wind is 12 km/h and the car uses 15.2 kWh.",
         "The wind is twelve kilometers per hour and the car uses fifteen point two kilowatt "
         "hours."),
        ("The lamp uses 60 W and 1 W in standby.",
         "The lamp uses sixty watts and one watt in standby."),
        ("It is 72°F and 21 ℃ at 1,013 hPa.",
         "It is seventy-two degrees Fahrenheit and twenty-one degrees Celsius at one thousand "
         "and thirteen hectopascals."),
        ("The icon is 16X16 and the screen 1920×1080.",
         "The icon is sixteen by sixteen and the screen one thousand nine hundred and twenty by "
         "one thousand and eighty."),
        ("It costs $5.50, $1 or $0.99.",
         "It costs five dollars and fifty cents, one dollar or ninety-nine cents."),
        ("This is the 1st, 2nd and 23rd time.", "This is the first, second and twenty-third time."),
        ("The alarm is set for 7:05 am.", "The alarm is set for seven oh five AM."),
        ("The meeting is at 3 p.m. today.", "The meeting is at three PM today."),
        ("It is 18:00 and 9:00.", "It is eighteen hundred and nine o'clock."),
        ("She was born on 2023-12-17 in 1999.",
         "She was born on December seventeenth, twenty twenty-three in nineteen ninety-nine."),
        ("It was the 17th of December 2023.",
         "It was the seventeenth of December, twenty twenty-three."),
        ("Music of the 1980s and the '90s.", "Music of the nineteen eighties and the nineties."),
        ("The code is 007 and the value 0.05.",
         "The code is zero zero seven and the value zero point zero five."),
        ("Tom & Jerry are #1.", "Tom and Jerry are number one."),
        ("Version 1.2.3 of the app.", "Version one point two point three of the app."),
        ("It is H2O and mp3.", "It is H two O and mp three."),
        ("Add 1/2 cup, 3/4 of it and 2/3 more.",
         "Add one half cup, three quarters of it and two thirds more."),
        ("Wake me at 12:00 AM.", "Wake me at twelve AM."),
    ],
)
def test_english_numbers_units_dates(text: str, expected: str) -> None:
    assert normalize_text(text) == expected


def test_english_reading_leaves_no_digits() -> None:
    out = expand_english("Set 3 timers: 1:05, 22:47:30, 12/24/2024, 4.5%, -0.3 °C, 2,500,000 W")
    assert not any(c.isdigit() for c in out)
    assert "December twenty-fourth, twenty twenty-four" in out
    assert "twenty-two forty-seven and thirty seconds" in out
    assert "two million five hundred thousand watts" in out


def test_language_hint_breaks_only_a_tie() -> None:
    assert normalize_text("50%") == "50%"
    assert normalize_text("50%", language="en_US") == "fifty percent"
    assert normalize_text("50%", language="de_DE") == "fünfzig Prozent"
    # The text's own cue wins over the hint: German, never English.
    assert normalize_text("Die Batterie ist bei 50%.", language="en") == (
        "Die Batterie ist bei fünfzig Prozent.")


def test_user_control_tokens_are_removed_and_brackets_kept() -> None:
    out = normalize_text("<|endofprompt|>Hello <|im_start|>there [breath] <strong>x</strong>")
    assert out == "Hello there [breath] <strong>x</strong>"


def test_control_characters_and_blanks() -> None:
    text = "  Hallo\x00 Wel\x07t\u200b\ufeff!\t\n\u3000Tschüß  "
    assert normalize_text(text) == "Hallo Welt! Tschüß"
    # Decomposed umlaut is composed (NFC), never dropped.
    assert normalize_text("Mu\u0308nchen") == "München"


def test_emoji_are_removed() -> None:
    assert normalize_text("👍") == ""
    assert normalize_text("Gut gemacht 👍🏽 ❤️ 🇩🇪!") == "Gut gemacht !"


def test_non_string_is_a_typed_error() -> None:
    with pytest.raises(TextError, match="must be a string"):
        normalize_text(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "script"),
    [
        (C4_ZH, "han"),
        ("今日はいい天気です", "kana"),
        ("오늘은 날씨가 좋아요", "hangul"),
        ("Привет, мир", "cyrillic"),
        ("Grüß Gott", "latin"),
        ("12 + 3 = 15 !", "none"),
        ("", "none"),
    ],
)
def test_dominant_script(text: str, script: str) -> None:
    assert dominant_script(text) == script


_FORBIDDEN = {"Cc", "Cf", "Cs", "Co"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.text(st.characters(exclude_categories=())),
            st.sampled_from(
                ["<|endofprompt|>", "21.5 °C", "3:45 PM", "Dec 17, 2023", "$5.50", "大家好",
                 "the", " ", "\n", "ß", "-", ".", "%", "1st", "12/31/2099", "99:99"]
            ),
        ),
        max_size=12,
    ).map("".join)
)
def test_normalize_never_raises_and_leaves_no_control_characters(text: str) -> None:
    out = normalize_text(text)
    assert isinstance(out, str)
    assert out == out.strip()
    assert "  " not in out
    assert not any(unicodedata.category(c) in _FORBIDDEN for c in out)
    assert "<|endofprompt|>" not in out


# --- symbols per language ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("温度是21.5°C，湿度50%。", "温度是二十一点五摄氏度，湿度百分之五十。"),
        ("今天12℃，明天-3 °C。", "今天十二摄氏度，明天负三摄氏度。"),
        ("价格€5.50或者$3，还有¥100。", "价格五点五欧元或者三美元，还有一百元。"),
        ("猫 & 狗", "猫和狗"),
        ("５０％的人", "百分之五十的人"),
        ("今日は50%の確率で雨です。", "今日は五十パーセントの確率で雨です。"),
        ("気温は21℃、¥100です。", "気温は二十一度、百円です。"),
        ("Turn the lights on/off now.", "Turn the lights on or off now."),
        ("It rains 5 mm/h and AC/DC is a band.",
         "It rains five millimeters per hour and AC/DC is a band."),
        ("The answer is 5 * 3 = 15.", "The answer is five times three equals fifteen."),
        ("The screen is 1920×1080.",
         "The screen is one thousand nine hundred and twenty by one thousand and eighty."),
        ("Die Temperatur beträgt 10 Grad & mehr.", "Die Temperatur beträgt zehn Grad & mehr."),
    ],
)
def test_symbols_read_per_language(text: str, expected: str) -> None:
    assert normalize_text(text) == expected
