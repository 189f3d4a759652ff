"""Markdown as conversation agents write it, spoken sensibly: one-shot and streamed.

Every case of the table is converted once as a whole and again from seeded random deltas of
1-7 characters (markers split across deltas: ``"**Su"`` + ``"re!**"``); the table holds the
exact speech text (:func:`markdown_to_speech`) and the exact pieces the LLM receives
(:meth:`TextFrontend.split_pieces`).
"""

from __future__ import annotations

import random
import re
import unicodedata
from pathlib import Path
from typing import NamedTuple

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from wyoming_cosyvoice3.engine.constants import END_OF_PROMPT
from wyoming_cosyvoice3.engine.text import TextFrontend
from wyoming_cosyvoice3.engine.text.markdown import (
    MarkdownSpeech,
    line_kind_is_decided,
    markdown_to_speech,
)
from wyoming_cosyvoice3.server.protocol import parse_request
from wyoming_cosyvoice3.server.streaming_text import SentenceBuffer
from wyoming_cosyvoice3.server.streams import StreamRequest


class Case(NamedTuple):
    name: str
    markdown: str
    speech: str
    pieces: list[str]


_FOX = "The quick brown fox jumps over the lazy dog. "
_FOX_SPEECH = _FOX

CASES: list[Case] = [
    Case('bold_intro_list', '**Sure!** Here are the lights:\n- Kitchen: on\n- Living room: off',
         'Sure! Here are the lights:\nKitchen: on.\nLiving room: off.\n',
         ['Sure! Here are the lights: Kitchen: on. Living room: off.']),
    Case('heading_em', '# Weather\nIt is *sunny* today',
         'Weather.\nIt is sunny today.\n',
         ['Weather. It is sunny today.']),
    Case('bare_url', 'Visit https://example.com/a_b for more.',
         'Visit example.com for more.\n',
         ['Visit example.com for more.']),
    Case('www_url', 'Details at www.home-assistant.io/integrations/wyoming, see there.',
         'Details at home-assistant.io, see there.\n',
         ['Details at home-assistant.io, see there.']),
    Case('autolink', 'Docs: <https://docs.python.org/3/library/re.html>',
         'Docs: docs.python.org.\n',
         ['Docs: docs.python.org.']),
    Case('link_text', 'Check [the forecast](https://met.no/x?y=1) before you go.',
         'Check the forecast before you go.\n',
         ['Check the forecast before you go.']),
    Case('image_alt', '![A red kitchen lamp](lamp.png) The lamp is on.',
         'A red kitchen lamp. The lamp is on.\n',
         ['A red kitchen lamp. The lamp is on.']),
    Case('nested_emphasis', 'This is ***very*** important and __really__ _nice_.',
         'This is very important and really nice.\n',
         ['This is very important and really nice.']),
    Case('strike', 'The meeting is ~~Monday~~ Tuesday.',
         'The meeting is Tuesday.\n',
         ['The meeting is Tuesday.']),
    Case('inline_code', 'Run `ha core restart` to restart.',
         'Run ha core restart to restart.\n',
         ['Run ha core restart to restart.']),
    Case('fenced_code', 'Use this script:\n```yaml\nalias: Lights\nsequence: []\n```\nThen reload.',
         'Use this script:\nThen reload.\n',
         ['Use this script: Then reload.']),
    Case('tilde_fence', "Example:\n~~~\nprint('hi')\n~~~",
         'Example:\n',
         ['Example:']),
    Case('ordered_list',
         'Steps:\n1. Preheat the oven to 180 °C\n2. Mix **flour** and sugar\n3. Bake for 25 min',
         'Steps:\nPreheat the oven to 180 °C.\nMix flour and sugar.\nBake for 25 min.\n',
         ['Steps: Preheat the oven to one hundred and eighty degrees Celsius. Mix flour and '
          'sugar. Bake for twenty-five minutes.']),
    Case('nested_list', '- Lights\n  - Kitchen: on\n  - Hall: off\n- Covers\n  - Garage: closed',
         'Lights.\nKitchen: on.\nHall: off.\nCovers.\nGarage: closed.\n',
         ['Lights. Kitchen: on. Hall: off. Covers. Garage: closed.']),
    Case('star_plus_bullets', '* First item\n+ Second item',
         'First item.\nSecond item.\n',
         ['First item. Second item.']),
    Case('task_list', '- [x] Buy milk\n- [ ] Call mom',
         'Buy milk.\nCall mom.\n',
         ['Buy milk. Call mom.']),
    Case('blockquote', '> Note: the door is **unlocked**.\n> Please check it.',
         'Note: the door is unlocked. Please check it.\n',
         ['Note: the door is unlocked. Please check it.']),
    Case('table', '| Room | Temp |\n|---|---|\n| Kitchen | 21.5 °C |\n| Bedroom | 19 °C |',
         'Room, Temp.\nKitchen, 21.5 °C.\nBedroom, 19 °C.\n',
         ['Room, Temp. Kitchen, 21.5 °C. Bedroom, 19 °C.']),
    Case('table_aligned', 'Here:\n\n| Device | State |\n|:---|---:|\n| Fan | on |\n\nDone.',
         'Here:\nDevice, State.\nFan, on.\nDone.\n',
         ['Here: Device, State. Fan, on. Done.']),
    Case('hr', 'Part one.\n\n---\n\nPart two.',
         'Part one.\nPart two.\n',
         ['Part one. Part two.']),
    Case('setext', 'Summary\n=======\nAll good.',
         'Summary.\nAll good.\n',
         ['Summary. All good.']),
    Case('html_inline', 'The <b>front door</b> is open.<br>Close it?',
         'The front door is open. Close it?\n',
         ['The front door is open. Close it?']),
    Case('html_block', '<div>\nHidden <i>note</i>\n</div>\n\nVisible text.',
         'Hidden note.\nVisible text.\n',
         ['Hidden note. Visible text.']),
    Case('html_comment', '<!-- internal -->\nHello there.',
         'Hello there.\n',
         ['Hello there.']),
    Case('emoji_dropped', 'Great job! 🎉👍 The lights are off. ✅',
         'Great job! The lights are off. \n',
         ['Great job! The lights are off.']),
    Case('emoji_only_item', '- 🎉\n- Party mode on',
         'Party mode on.\n',
         ['Party mode on.']),
    Case('keycap_digit', 'Press 1️⃣ then 2️⃣.',
         'Press 1 then 2.\n',
         ['Press one then two.']),
    Case('zwj_family', 'Family 👨\u200d👩\u200d👧 is home.',
         'Family is home.\n',
         ['Family is home.']),
    Case('percent_degree', 'Battery at 50%. It is 21.5 °C outside.',
         'Battery at 50%. It is 21.5 °C outside.\n',
         ['Battery at fifty percent. It is twenty-one point five degrees Celsius outside.']),
    Case('euro_amp', 'Tom & Jerry paid €5.50 for coffee.',
         'Tom & Jerry paid €5.50 for coffee.\n',
         ['Tom and Jerry paid five euros and fifty cents for coffee.']),
    Case('chinese_md', '大家好，**这里**介绍一篇论文。\n- 第一点\n- 第二点',
         '大家好，这里介绍一篇论文。\n第一点。\n第二点。\n',
         ['大家好，这里介绍一篇论文。第一点。第二点。']),
    Case('chinese_heading', '## 今天天气\n温度是21.5度，湿度50%。',
         '今天天气。\n温度是21.5度，湿度50%。\n',
         ['今天天气。温度是二十一点五度，湿度百分之五十。']),
    Case('japanese_list', '今日の予定：\n1. 買い物\n2. 掃除',
         '今日の予定：\n買い物。\n掃除。\n',
         ['今日の予定：買い物。掃除。']),
    Case('german_md', '**Achtung:** Die Tür ist *offen*. Temperatur: 10 Grad.',
         'Achtung: Die Tür ist offen. Temperatur: 10 Grad.\n',
         ['Achtung: Die Tür ist offen. Temperatur: zehn Grad.']),
    Case('french_link', "Voir [la météo](https://meteo.fr) pour aujourd'hui.",
         "Voir la météo pour aujourd'hui.\n",
         ["Voir la météo pour aujourd'hui."]),
    Case('russian_list',
         'Список:\n- Кухня: включено\n- Спальня: выключено',
         'Список:\nКухня: включено.\nСпальня: выключено.\n',
         ['Список: Кухня: включено. Спальня: выключено.']),
    Case('korean', '**안녕하세요!** 오늘은 맑습니다.',
         '안녕하세요! 오늘은 맑습니다.\n',
         ['안녕하세요! 오늘은 맑습니다.']),
    Case('arabic', 'مرحبا **بك** في المنزل.',
         'مرحبا بك في المنزل.\n',
         ['مرحبا بك في المنزل.']),
    Case('mixed_c4', 'Look at the photo. 是 **family**, friends, 还是 people at a game?',
         'Look at the photo. 是 family, friends, 还是 people at a game?\n',
         ['Look at the photo.是family，friends，还是people at a game？']),
    Case('fullwidth', 'ＡＢＣ１２３ is full width. 价格是１００元！',
         'ＡＢＣ１２３ is full width. 价格是１００元！\n',
         ['ＡＢＣ１２３ is full width.价格是一百元！']),
    Case('escaped_markers', 'Use \\*literal\\* stars and 5 * 3 = 15.',
         'Use literal stars and 5 * 3 = 15.\n',
         ['Use literal stars and five times three equals fifteen.']),
    Case('snake_case', 'Set input_boolean.guest_mode to on.',
         'Set input_boolean.guest_mode to on.\n',
         ['Set input_boolean.guest_mode to on.']),
    Case('unclosed_bold', '**Warning the stream was cut',
         'Warning the stream was cut.\n',
         ['Warning the stream was cut.']),
    Case('multi_paragraph',
         'First paragraph here. It has two sentences.\n\nSecond paragraph, no end',
         'First paragraph here. It has two sentences.\nSecond paragraph, no end.\n',
         ['First paragraph here. It has two sentences. Second paragraph, no end.']),
    Case(
        'long_paragraph',
        _FOX * 12 + "**Done** now.",
        _FOX_SPEECH * 11 + "The quick brown fox jumps over the lazy dog. Done now.\n",
        [(_FOX_SPEECH * 8).strip(), _FOX_SPEECH * 4 + "Done now."],
    ),
    Case('hard_wrap', 'This line wraps\nonto the next line\nand ends here.',
         'This line wraps onto the next line and ends here.\n',
         ['This line wraps onto the next line and ends here.']),
    Case('indented_plain', '    Indented text is still spoken.',
         'Indented text is still spoken.\n',
         ['Indented text is still spoken.']),
    Case('list_with_code', '- Turn on `light.kitchen`\n- Set `climate.hall` to 21 °C',
         'Turn on light.kitchen.\nSet climate.hall to 21 °C.\n',
         ['Turn on light.kitchen. Set climate.hall to twenty-one degrees Celsius.']),
    Case('ref_links', 'See [the docs][1].\n\n[1]: https://example.com/docs',
         'See the docs.\n',
         ['See the docs.']),
    Case('heading_only', '### Done',
         'Done.\n',
         ['Done.']),
    Case('empty', '',
         '',
         []),
    Case('symbols_only', '***',
         '',
         []),
    Case('code_only', '```\nls -la\n```',
         '',
         []),
    Case('time_date', 'Your timer for **3:45 PM** is set. Today is December 17, 2023.',
         'Your timer for 3:45 PM is set. Today is December 17, 2023.\n',
         ['Your timer for three forty-five PM is set. Today is December seventeenth, twenty '
          'twenty-three.']),
    Case('trailing_comma_item', '- apples,\n- pears,',
         'apples.\npears.\n',
         ['apples. pears.']),
    Case('quote_list', '> - one\n> - two',
         'one.\ntwo.\n',
         ['one. two.']),
    Case('table_with_intro',
         'Here are the temperatures:\n\n| Room | Temp |\n|------|------|\n| Kitchen | 21 °C |',
         'Here are the temperatures:\nRoom, Temp.\nKitchen, 21 °C.\n',
         ['Here are the temperatures: Room, Temp. Kitchen, twenty-one degrees Celsius.']),
    Case('bold_list_items', '1. **Kitchen light**: on\n2. **Garage door**: closed',
         'Kitchen light: on.\nGarage door: closed.\n',
         ['Kitchen light: on. Garage door: closed.']),
    Case('heading_levels', '## Step 2: Mix\n### Tips\nUse *cold* butter.',
         'Step 2: Mix.\nTips.\nUse cold butter.\n',
         ['Step 2: Mix. Tips. Use cold butter.']),
    Case('link_is_url', 'More at [https://www.example.org/page](https://www.example.org/page).',
         'More at example.org.\n',
         ['More at example.org.']),
]


@pytest.fixture(scope="module")
def frontend(tiny_model_dir: Path) -> TextFrontend:
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return TextFrontend(tokenizer, tokenizer.token_to_id(END_OF_PROMPT))


def stream(text: str, seed: int | None, max_delta: int = 7) -> list[str]:
    """Outputs of :class:`MarkdownSpeech` for ``text`` cut into deltas (seed None: 1 char)."""
    rng = random.Random(seed)
    converter = MarkdownSpeech()
    outputs: list[str] = []
    position = 0
    while position < len(text):
        size = 1 if seed is None else rng.randint(1, max_delta)
        outputs.append(converter.feed(text[position:position + size]))
        position += size
    outputs.append(converter.flush())
    return outputs


def streamed_sentences(text: str, seed: int) -> list[str]:
    """The server's streaming path: converter output into the sentence buffer."""
    rng = random.Random(seed)
    converter, buffer = MarkdownSpeech(), SentenceBuffer()
    sentences: list[str] = []
    position = 0
    while position < len(text):
        size = rng.randint(1, 7)
        sentences += buffer.add(converter.feed(text[position:position + size]))
        position += size
    sentences += buffer.add(converter.flush())
    tail = buffer.flush()
    return [*sentences, tail] if tail else sentences


_FULL_WIDTH_MARKS = str.maketrans("。？！；：，", ".?!;:,")


def same_words(pieces: list[str]) -> str:
    """Pieces without blanks, full-width sentence marks as ASCII: streamed pieces are
    normalised one sentence at a time, so a mixed-script sentence may keep its ASCII mark."""
    return re.sub(r"\s+", "", "".join(pieces)).translate(_FULL_WIDTH_MARKS)


def test_table_is_large_and_varied() -> None:
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_one_shot_text_sent_to_model(case: Case, frontend: TextFrontend) -> None:
    speech = markdown_to_speech(case.markdown)
    assert speech == case.speech
    assert frontend.split_pieces(speech) == case.pieces


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
def test_streamed_deltas_give_the_one_shot_text(case: Case, seed: int | None) -> None:
    assert "".join(stream(case.markdown, seed)) == case.speech


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_streamed_sentences_reach_the_model_as_one_shot(
    case: Case, frontend: TextFrontend
) -> None:
    """Each streamed sentence is normalised with the language hint the server's stream
    gives it (the language of the sentences so far): "Kitchen, 21 °C." after "Here are the
    temperatures:" reads its number as the one-shot text does."""
    stream = StreamRequest(request=parse_request({}, 10_000, 0.0, with_text=False),
                           buffer=SentenceBuffer(), max_chars=10_000)
    sentences = streamed_sentences(case.markdown, seed=7)
    pieces = [piece for sentence in sentences
              for piece in frontend.split_pieces(sentence, stream.language_hint(sentence))]
    assert same_words(pieces) == same_words(case.pieces)


# --- streaming: what is handed out when ------------------------------------------------------
def test_markers_split_across_deltas_are_held_back() -> None:
    converter = MarkdownSpeech()
    assert [converter.feed(d) for d in ["**Su", "re!**", " Here are", " the lights:\n- Kit"]] == [
        "", "", "Sure! ", "Here are the lights:\n"]
    assert converter.feed("chen: *on*\n- Living") == "Kitchen: on.\n"
    assert converter.flush() == "Living.\n"


def test_sentence_ending_in_a_blank_leaves_at_once() -> None:
    """"here. " at the end of a delta is complete (the parser strips the blank)."""
    converter = MarkdownSpeech()
    assert converter.feed("First sentence here. ") == "First sentence here. "
    assert converter.feed("Second") == ""
    assert converter.flush() == "Second.\n"
    assert markdown_to_speech("First sentence here. ") == "First sentence here. \n"


def test_nul_is_dropped_not_replaced() -> None:
    assert markdown_to_speech("Lights\x00 on.") == "Lights on.\n"


def test_first_sentence_leaves_before_the_paragraph_ends() -> None:
    """C6 through the converter: the sentence buffer gets the first sentence mid-paragraph."""
    converter, buffer = MarkdownSpeech(), SentenceBuffer()
    chunks = ["The li", "ving room lig", "hts are now on. Th", "e kitchen is 21", ".5 degrees"]
    per_chunk = [buffer.add(converter.feed(chunk)) for chunk in chunks]
    assert per_chunk == [[], [], ["The living room lights are now on."], [], []]
    assert buffer.add(converter.flush()) == ["The kitchen is 21.5 degrees."]


def test_open_emphasis_keeps_its_sentences_together() -> None:
    converter = MarkdownSpeech()
    assert converter.feed("**Note. The door is open. ") == ""
    assert converter.feed("Close it.** Thanks. ") == "Note. The door is open. Close it. Thanks. "
    assert converter.flush() == "\n"


def test_fenced_code_is_skipped_while_it_streams() -> None:
    converter = MarkdownSpeech()
    outputs = [converter.feed(d) for d in ["Run:\n``", "`sh\nrm -rf /tmp/x. Done. \n", "ls\n",
                                            "```\nAll set. ", "Bye"]]
    assert outputs == ["", "Run:\n", "", "All set. ", ""]
    assert converter.flush() == "Bye.\n"


def test_text_after_a_closed_fence_or_rule_streams_at_once() -> None:
    converter = MarkdownSpeech()
    assert converter.feed("```\nx\n```\n") == ""
    assert converter.feed("Next one. And") == "Next one. "
    converter = MarkdownSpeech()
    assert converter.feed("Part one.\n\n---\n\n") == "Part one.\n"
    assert converter.feed("Part two. And") == "Part two. "


@pytest.mark.parametrize(
    ("line", "decided"),
    [("Hello", True), ("#", False), ("#tag", True), ("# T", True), ("-", False), ("- K", True),
     ("1", False), ("1.", False), ("1. P", True), ("21 degrees", True), ("2.5 kW", True),
     ("**Su", True), ("**", False), ("***", False), ("|", False), ("<b", False), ("```", False),
     ("> - a", True), ("> ", False), ("    code", True), ("[1]: http", False), ("😀 Hi", True)],
)
def test_unfinished_line_kind(line: str, decided: bool) -> None:
    assert line_kind_is_decided(line) is decided


def test_issue_examples() -> None:
    assert markdown_to_speech("**Sure!** Here are the lights:\n- Kitchen: on\n- Living room: off"
                              ) == "Sure! Here are the lights:\nKitchen: on.\nLiving room: off.\n"
    assert markdown_to_speech("# Weather\nIt is *sunny* today") == "Weather.\nIt is sunny today.\n"
    assert markdown_to_speech("Visit https://example.com/a_b for more.") == (
        "Visit example.com for more.\n")


# --- never losing letters or digits ------------------------------------------------------------
_PLAIN_ALPHABET = st.sampled_from(
    [*"abcxyzÄäößéñçАяΩ中文字かなカナ한국ไทยअ0123456789٣", " ", " ", "\n", "\n\n", ", ", "! ", "? ",
     "。", "，", "！", "、", "'"]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_PLAIN_ALPHABET, min_size=1, max_size=80), st.integers(0, 2**16))
def test_letters_and_digits_of_every_script_survive(parts: list[str], seed: int) -> None:
    """Text without markdown syntax keeps every letter and digit, in order, streamed or not."""
    text = "".join(parts)
    speech = markdown_to_speech(text)

    def alnum(value: str) -> str:
        return "".join(c for c in value if unicodedata.category(c)[0] in "LN")

    assert alnum(speech) == alnum(unicodedata.normalize("NFC", text))
    assert "".join(stream(text, seed)) == speech


_MARKDOWN_BITS = st.sampled_from([
    "*", "**", "_", "`", "```", "~~~", "#", "# ", "## ", "- ", "* ", "1. ", "2) ", "> ", "|",
    "| a | b |", "|---|---|", "---", "===", "\n", "\n\n", "[", "]", "](", ")", "<b>", "</b>",
    "<div>", "~~", "\r", "\r\n", "word", "Word.", "Hi! ", " ", "  ", "。", "中文", "！", "\\",
    "    ", "<!--", "-->", "![", "https://x.org/a", "😀", "1️⃣", "[ ] ", "[1]: http://z", ":",
    ".", "5 * 3", "snake_case", "&amp;", "\t",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_MARKDOWN_BITS, min_size=1, max_size=25), st.integers(0, 2**16),
       st.sampled_from([40, 400]))
def test_any_markdown_streams_to_the_one_shot_result(
    bits: list[str], seed: int, window_chars: int
) -> None:
    """Random mixtures of markdown syntax, line ends and scripts, in random deltas."""
    text = "".join(bits)
    whole = MarkdownSpeech(window_chars)
    expected = whole.feed(text) + whole.flush()
    rng = random.Random(seed)
    converter = MarkdownSpeech(window_chars)
    outputs: list[str] = []
    position = 0
    while position < len(text):
        size = rng.randint(1, 6)
        outputs.append(converter.feed(text[position:position + size]))
        position += size
    outputs.append(converter.flush())
    assert "".join(outputs) == expected


def test_carriage_returns_are_line_ends() -> None:
    text = "Line one\rLine two\r\r- item one\r- item two\r\n\r\nEnd."
    assert markdown_to_speech(text) == "Line one Line two.\nitem one.\nitem two.\nEnd.\n"
    assert "".join(stream(text, None)) == markdown_to_speech(text)


# --- bounded on hostile input --------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    ["*" * 4000, "[" * 4000, ">" * 4000, "`a " * 1300, "| x |\n" * 600, "```\n" + "x\n" * 1500,
     "**" + "Sentence here. " * 260, "<a " * 1300, "1. " * 1300, "_a " * 1300, "word " * 800],
    ids=["stars", "brackets", "quotes", "backticks", "pipes", "fence", "open-bold", "tags",
         "numbers", "underscores", "no-punctuation"],
)
def test_hostile_markdown_streams_to_the_one_shot_result(text: str) -> None:
    speech = markdown_to_speech(text)
    assert "".join(stream(text, seed=5)) == speech
    assert not set("*[]|`<>").intersection(speech)
    assert all(len(line) <= 4000 for line in speech.split("\n"))


def test_no_punctuation_run_is_cut_within_the_window() -> None:
    """400 characters without a sentence end leave at the last blank before the window."""
    converter = MarkdownSpeech(window_chars=40)
    out = converter.feed("one two three four five six seven eight nine ten eleven twelve ")
    assert out == "one two three four five six seven eight "
    assert converter.flush() == "nine ten eleven twelve.\n"
