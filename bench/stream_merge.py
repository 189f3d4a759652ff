"""LLM work of the benchmark paragraph streamed as Home Assistant streams it: per sentence
against merged sentences (one engine request for a stream where that is cheaper).

``python -m bench.stream_merge --model-dir DIR`` cuts the paragraph into
10-character deltas, finds the sentences as the server does
(:class:`~wyoming_cosyvoice3.server.streaming_text.SentenceBuffer`), and counts for one engine
request per sentence (the server without merging) and for the server's merging (the first sentence
alone, the sentences queued while it is spoken joined up to
:data:`~wyoming_cosyvoice3.server.streams.MERGE_BUDGET_S`): engine requests, text pieces (each
one LLM prefill and one first hop) and prefilled positions per piece after the cached voice
prefix (``tts text + [TASK] + prompt speech tokens``, spec section 4). Counts, not timings: they
do not depend on the machine's load. Assumes every later sentence is queued when the first one
ends (the paragraph arrives in 2.3 s at 10 characters per 50 ms; the first sentence takes
longer than that to speak on a 2-core CPU).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from wyoming_cosyvoice3.engine.model import load_tokenizer
from wyoming_cosyvoice3.engine.text.frontend import TextFrontend
from wyoming_cosyvoice3.server.preroll import expected_speech_s
from wyoming_cosyvoice3.server.streaming_text import SentenceBuffer
from wyoming_cosyvoice3.server.streams import MERGE_BUDGET_S

from .run_helpers import PARAGRAPH


def stream_sentences(text: str, delta_chars: int = 10) -> list[str]:
    """Sentences of ``text`` streamed in ``delta_chars`` deltas, as the server finds them."""
    buffer = SentenceBuffer()
    sentences = [s for i in range(0, len(text), delta_chars)
                 for s in buffer.add(text[i:i + delta_chars])]
    tail = buffer.flush()
    return sentences + ([tail] if tail else [])


def merged_requests(sentences: list[str], budget_s: float = MERGE_BUDGET_S) -> list[str]:
    """The first sentence alone, the rest joined up to ``budget_s`` of expected speech."""
    groups, current = sentences[:1], ""
    for sentence in sentences[1:]:
        joined = f"{current} {sentence}" if current else sentence
        if current and expected_speech_s(joined) > budget_s:
            groups.append(current)
            joined = sentence
        current = joined
    return groups + ([current] if current else [])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="for tokenizer.json")
    p.add_argument("--prompt-speech-tokens", type=int, default=125,
                   help="speech tokens of the voice prompt (the benchmark's 5 s: 125)")
    args = p.parse_args(argv)
    frontend = TextFrontend(*load_tokenizer(args.model_dir / "tokenizer.json"))
    sentences = stream_sentences(PARAGRAPH)
    print("| engine requests | count | pieces (prefills, first hops) | prefilled positions |")
    print("|---|---|---|---|")
    for name, requests in (("one per sentence", sentences),
                           ("merged", merged_requests(sentences))):
        pieces = [piece for text in requests for piece in frontend.split_pieces(text)]
        positions = sum(len(frontend.encode_user(piece)) + 1 + args.prompt_speech_tokens
                        for piece in pieces)
        print(f"| {name} | {len(requests)} | {len(pieces)} | {positions} |")


if __name__ == "__main__":
    main()
