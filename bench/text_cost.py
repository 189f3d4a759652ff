"""What reading numbers costs: wetext's import and the normaliser per sentence.

``python -m bench.text_cost [--repeats N]`` prints, on this machine:

* wetext's import: the wall time and the resident memory it adds, each measured in a fresh
  interpreter (``python -c "import wetext"`` after the project's own text modules, so only
  wetext and its FSTs count), median of ``--repeats`` runs;
* milliseconds per sentence of :func:`~wyoming_cosyvoice3.engine.text.normalize.normalize_text`
  for the 30 Home Assistant answers of each language of tests/test_text_languages.py (CPU
  time of this process, median over the sentences of ``--repeats`` rounds, after one warm
  round), and for zh and ja the part spent inside wetext.

Run it at idle priority on a shared machine (``nice -n 19``) and say what else ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_IMPORT_PROBE = """
import json, resource, time
import wyoming_cosyvoice3.engine.text.normalize  # the project's own modules first
def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
before = rss_kb()
started = time.perf_counter()
import wetext
normalizer = wetext.Normalizer(lang="zh", operator="tn")
normalizer.normalize("1")
wetext.Normalizer(lang="ja", operator="tn").normalize("1")
print(json.dumps({"s": time.perf_counter() - started, "mb": (rss_kb() - before) / 1024}))
"""


def import_cost(repeats: int) -> tuple[float, float]:
    """(median seconds, median MB) of importing wetext and making both normalisers."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return (statistics.median(r["s"] for r in runs), statistics.median(r["mb"] for r in runs))


def table() -> dict[str, list[str]]:
    """The table's inputs per language (tests/test_text_languages.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_text_languages import TABLE

    rows: dict[str, list[str]] = {}
    for language, text, _ in TABLE:
        rows.setdefault(language, []).append(text)
    return rows


def per_sentence_ms(texts: list[str], language: str, repeats: int) -> float:
    from wyoming_cosyvoice3.engine.text.normalize import normalize_text

    for text in texts:  # warm: wetext loaded, regexes compiled
        normalize_text(text, language)
    times = []
    for _ in range(repeats):
        for text in texts:
            started = time.process_time()
            normalize_text(text, language)
            times.append(time.process_time() - started)
    return statistics.median(times) * 1000


def wetext_ms(texts: list[str], language: str, repeats: int) -> float:
    from wyoming_cosyvoice3.engine.text import lang_cjk

    guarded = [lang_cjk.guard_for_wetext(text, language) for text in texts]
    times = []
    for _ in range(repeats):
        for text in guarded:
            started = time.process_time()
            lang_cjk.read_with_wetext(text, language)
            times.append(time.process_time() - started)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    seconds, megabytes = import_cost(args.repeats)
    print(f"wetext import + zh and ja normalisers: {seconds:.2f} s, +{megabytes:.0f} MB RSS "
          f"(median of {args.repeats} fresh interpreters)")
    for language, texts in table().items():
        line = f"{language}: {per_sentence_ms(texts, language, args.repeats):.2f} ms/sentence"
        if language in ("zh", "ja"):
            line += f" (wetext alone {wetext_ms(texts, language, args.repeats):.2f} ms)"
        print(line)


if __name__ == "__main__":
    main()
