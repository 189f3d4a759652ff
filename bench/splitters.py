"""Streaming sentence splitters compared: the server's ``SentenceBuffer`` and ``sentence-stream``.

``python -m bench.splitters`` (needs ``pip install sentence-stream``, the
splitter wyoming-piper uses). Each labelled text is fed in three ways (whole, 1-character
deltas, seeded random 1-7 character deltas); reported per splitter:

* correct: texts whose sentences equal the labels, for every way of feeding;
* consistent: texts whose sentences do not depend on how the text was cut into deltas;
* delay: characters that had to arrive after a sentence's last character before the
  sentence was handed out (1-character deltas; median and maximum over all sentences);
* markers: markdown characters (``* # ` [ ] |`` and line-leading ``-``) left in the sentences
  of raw LLM markdown, without and with the markdown-to-speech pass in front;
* time per character of input (1-character deltas, this machine).

The labels come from shared/cases (C2-C6) and from conversation-agent replies.
"""

from __future__ import annotations

import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable

from wyoming_cosyvoice3.engine.text.markdown import MarkdownSpeech
from wyoming_cosyvoice3.server.streaming_text import SentenceBuffer

Splitter = Callable[[Iterable[str]], list[str]]

LABELLED: list[tuple[str, list[str]]] = [
    ("The living room lights are now on. The kitchen is 21.5 degrees",
     ["The living room lights are now on.", "The kitchen is 21.5 degrees"]),
    ("It is 21.5 °C in the living room. Your timer for 3:45 PM is set. Battery at 50%. "
     "Today is December 17, 2023. Dinner at 6:31 PM",
     ["It is 21.5 °C in the living room.", "Your timer for 3:45 PM is set.", "Battery at 50%.",
      "Today is December 17, 2023.", "Dinner at 6:31 PM"]),
    ("Die Temperatur beträgt 10 Grad. Natürlich ändert sich das.",
     ["Die Temperatur beträgt 10 Grad.", "Natürlich ändert sich das."]),
    ("大家好，这里介绍一篇名为AN IMAGE IS WORTH 16X16 WORDS的论文。",
     ["大家好，这里介绍一篇名为AN IMAGE IS WORTH 16X16 WORDS的论文。"]),
    ("Look at the photo. 是 family, friends, 还是 people at a game?",
     ["Look at the photo.", "是 family, friends, 还是 people at a game?"]),
    ("你好。今天天气很好！明天会下雨吗？", ["你好。", "今天天气很好！", "明天会下雨吗？"]),
    ("I am Bob. I live here.", ["I am Bob.", "I live here."]),
    ("The code is 1234. 5678 is wrong.", ["The code is 1234.", "5678 is wrong."]),
    ("Dr. Smith called. He will call again.", ["Dr. Smith called.", "He will call again."]),
    ("Version 2.0 is out. Pi is 3.14 today.", ["Version 2.0 is out.", "Pi is 3.14 today."]),
    ('He said "stop." Then he left.', ['He said "stop."', "Then he left."]),
    ("It's on. ok, the fan is off.", ["It's on.", "ok, the fan is off."]),
    ("Sure! Here are the lights:\nKitchen: on.\nLiving room: off.\n",
     ["Sure!", "Here are the lights:", "Kitchen: on.", "Living room: off."]),
    ("Weather.\nIt is sunny today.\n", ["Weather.", "It is sunny today."]),
    ("The door is open. The door is open. The door is open. The door is open.",
     ["The door is open."] * 4),
    ("Привет. Как дела? Хорошо!", ["Привет.", "Как дела?", "Хорошо!"]),
    ("今日は晴れです。明日は雨です。", ["今日は晴れです。", "明日は雨です。"]),
    ("मौसम अच्छा है। कल बारिश होगी।", ["मौसम अच्छा है।", "कल बारिश होगी।"]),
    ("هل الباب مغلق؟ نعم، هو مغلق.", ["هل الباب مغلق؟", "نعم، هو مغلق."]),
]
"""Plain (already speech) texts and their sentences."""

MARKDOWN: list[str] = [
    "**Sure!** Here are the lights:\n- Kitchen: *on*\n- Living room: off",
    "# Weather\nIt is _sunny_ today.",
    "1. Preheat the oven\n2. Mix `flour` and sugar\n3. Bake",
    "| Room | Temp |\n|---|---|\n| Kitchen | 21 °C |",
    "See [the docs](https://example.com/a_b). ~~Old~~ New.",
    "> **Note:** the door is open.\n\n```yaml\nx: 1\n```\nDone.",
]
_MARKER = re.compile(r"[*#`\[\]|]|^\s*-\s", re.MULTILINE)


def buffer_splitter(deltas: Iterable[str]) -> list[str]:
    buffer = SentenceBuffer()
    out = [s for delta in deltas for s in buffer.add(delta)]
    tail = buffer.flush()
    return [*out, tail] if tail else out


def _sentence_stream() -> Splitter:
    try:
        from sentence_stream import SentenceBoundaryDetector
    except ImportError:
        sys.exit("pip install sentence-stream (the splitter wyoming-piper uses) to compare")

    def split(deltas: Iterable[str]) -> list[str]:
        detector = SentenceBoundaryDetector()
        out = [s for delta in deltas for s in detector.add_chunk(delta)]
        tail = detector.finish()
        return [*out, tail] if tail else out

    return split


def _ways(text: str, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    random_cut: list[str] = []
    position = 0
    while position < len(text):
        size = rng.randint(1, 7)
        random_cut.append(text[position:position + size])
        position += size
    return [[text], list(text), random_cut]


def _streamed_with_positions(split_kind: str, text: str) -> list[tuple[str, int]]:
    """(sentence, input characters received when it was handed out), 1-character deltas."""
    out: list[tuple[str, int]] = []
    if split_kind == "SentenceBuffer":
        buffer = SentenceBuffer()
        for index, char in enumerate(text):
            out += [(s, index + 1) for s in buffer.add(char)]
        tail = buffer.flush()
        out += [(tail, len(text))] if tail else []
    else:
        from sentence_stream import SentenceBoundaryDetector

        detector = SentenceBoundaryDetector()
        for index, char in enumerate(text):
            out += [(s, index + 1) for s in detector.add_chunk(char)]
        tail = detector.finish()
        out += [(tail, len(text))] if tail else []
    return out


def evaluate(name: str, split: Splitter) -> dict[str, object]:
    correct = consistent = 0
    delays: list[int] = []
    wrong: list[str] = []
    for text, sentences in LABELLED:
        results = [split(way) for way in _ways(text)]
        consistent += all(r == results[0] for r in results)
        if all(r == sentences for r in results):
            correct += 1
        else:
            wrong.append(f"{text[:40]!r} -> {results[1]!r}")
        search = 0
        for sentence, received in _streamed_with_positions(name, text):
            end = text.find(sentence, search)
            if end < 0:
                continue
            end += len(sentence)
            search = end
            delays.append(max(0, received - end))
    raw = sum(len(_MARKER.findall(" ".join(split([t])))) for t in MARKDOWN)
    converted = 0
    for text in MARKDOWN:
        converter = MarkdownSpeech()
        speech = converter.feed(text) + converter.flush()
        converted += len(_MARKER.findall(" ".join(split([speech]))))
    prose = " ".join(t for t, _ in LABELLED if t.isascii()) * 10
    started = time.perf_counter()
    split(list(prose))
    per_char_us = (time.perf_counter() - started) / len(prose) * 1e6
    return {"splitter": name, "correct": f"{correct}/{len(LABELLED)}",
            "consistent": f"{consistent}/{len(LABELLED)}",
            "delay median": statistics.median(delays) if delays else None,
            "delay max": max(delays) if delays else None,
            "markers raw": raw, "markers after pass": converted,
            "us/char": round(per_char_us, 1), "wrong": wrong}


def main() -> int:
    rows = [evaluate("SentenceBuffer", buffer_splitter),
            evaluate("sentence-stream", _sentence_stream())]
    for row in rows:
        wrong = row.pop("wrong")
        print("  ".join(f"{k}: {v}" for k, v in row.items()))
        for line in wrong:  # type: ignore[attr-defined]
            print("    wrong:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
