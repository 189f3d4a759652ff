"""``python -m bench.serve [BENCHMARK FLAGS] SERVER FLAGS...``: the Wyoming server as the
benchmark runs it (:class:`.server.ServerProcess` starts it; run from a clone).

The server is the product's own (:func:`wyoming_cosyvoice3.server.cli.main`, every server flag
as in ``python -m wyoming_cosyvoice3``), with the benchmark's hooks installed through
:class:`wyoming_cosyvoice3.server.hooks.ServerHooks`, so that the product has no benchmark
flag. The benchmark flags:

- ``--bench-stats-file PATH``: append one JSON line per request, voice preparation and
  response to PATH (:class:`.recorder.StatsRecorder`: stage times, every graph run, the
  pieces of each response).
- ``--bench-tokens-per-char RATE``: decode exactly ``max(1, round(RATE x characters))``
  speech tokens per text piece, ignoring the stop token (random weights never stop sensibly;
  :class:`.recorder.FixedDecoding`, installed through the engine's decoding-length hook).
- ``--bench-synthesis-options FIELD=VALUE,...``: change fields of the preset's synthesis
  options (e.g. ``euler_steps=3,flow_chunk_causal=true``) to measure one lever through the
  server; values are ``true``/``false``, ``none``, numbers or text. A field is a request
  option (``speed``), a stage record's field by its path (``flow.schedule.steps``) or by the
  flat name it had before the stages owned their options (:data:`FLAT_NAMES`).
- ``--bench-engine-options FIELD=VALUE,...``: change fields of the options the engine is
  loaded with (e.g. ``stream_vocoder=false``: the windowed vocoder the streamed one replaced),
  to measure an exact derived form apart; the same value spellings.

They keep the spelling the server's own flags had before they left the product, so older
command lines (``--variant 'cc:--bench-synthesis-options=...'``) still work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence, Set
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from wyoming_cosyvoice3.engine.options import SynthesisOptions
from wyoming_cosyvoice3.server import cli
from wyoming_cosyvoice3.server.hooks import ENGINE_OVERRIDABLE, ServerHooks

from .recorder import FixedDecoding, StatsRecorder


def positive_float(text: str) -> float:
    """``text`` as a float > 0; ``ValueError`` otherwise (also for nan)."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


FLAT_NAMES: dict[str, str] = {
    "euler_steps": "flow.schedule.steps",
    "cfg_rate": "flow.schedule.cfg_rate",
    "flow_precision": "flow.precision",
    "flow_chunk_causal": "flow.chunk_causal",
    "flow_final_chunk_causal": "flow.final_chunk_causal",
    "flow_prompt_tokens": "flow.prompt_tokens",
    "flow_left_context_tokens": "flow.left_context_tokens",
    "fallback_prompt_tokens": "flow.fallback.prompt_tokens",
    "fallback_left_context_tokens": "flow.fallback.left_context_tokens",
    "first_hop_tokens": "flow.first_hop_tokens",
    "first_hop_on_chunk_grid": "flow.first_hop_on_chunk_grid",
    "max_hop_tokens": "flow.max_hop_tokens",
    "whole_middle_pieces": "flow.whole_middle_pieces",
    "vocoder_defer": "vocoder.defer",
}
"""The flat option names recorded benchmark command lines use -> the stage record paths."""


def _record_paths(record: Any, prefix: str = "") -> set[str]:
    """Every leaf field of a dataclass as a dotted path (records are walked into)."""
    paths: set[str] = set()
    for f in fields(record):
        value = getattr(record, f.name)
        if is_dataclass(value):
            paths |= _record_paths(value, f"{prefix}{f.name}.")
        else:
            paths.add(prefix + f.name)
    return paths


def synthesis_overrides(text: str) -> dict[str, Any]:
    """``FIELD=VALUE,...`` -> the changes for :meth:`SynthesisOptions.replace`, a stage
    record's fields as a nested mapping (``flow.schedule.steps=3`` ->
    ``{"flow": {"schedule": {"steps": 3}}}``).

    Raises:
        ValueError: an item is not ``FIELD=VALUE``, names no synthesis option field, or the
            options refuse the value (:meth:`SynthesisOptions.validate`).
    """
    known = _record_paths(SynthesisOptions()) | set(FLAT_NAMES)
    changes: dict[str, Any] = {}
    for name, value in _field_pairs(text, known, "a synthesis").items():
        *records, leaf = FLAT_NAMES.get(name, name).split(".")
        target = changes
        for record in records:
            target = target.setdefault(record, {})
        target[leaf] = value
    SynthesisOptions().replace(**changes).validate()
    return changes


def engine_overrides(text: str) -> dict[str, Any]:
    """``FIELD=VALUE,...`` -> {field: value} for the engine option fields a hook may replace
    (:data:`~wyoming_cosyvoice3.server.hooks.ENGINE_OVERRIDABLE`).

    Raises:
        ValueError: an item is not ``FIELD=VALUE`` or names no such field.
    """
    return _field_pairs(text, ENGINE_OVERRIDABLE, "an engine")


def _field_pairs(text: str, known: Set[str], kind: str) -> dict[str, Any]:
    """``FIELD=VALUE,...`` -> {field: value}; ``ValueError`` for an item that is not
    ``FIELD=VALUE`` with a field of ``known`` (``kind`` names them in the message)."""
    pairs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or name not in known:
            raise ValueError(f"{item!r} is not FIELD=VALUE with {kind} option field "
                             f"({', '.join(sorted(known))})")
        pairs[name] = _value(raw)
    return pairs


def _value(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw


def _checked(convert: Any, flag: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{flag}: {err}") from err

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The benchmark flags; everything else on the command line goes to the server."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve", add_help=False, allow_abbrev=False,
        description="The Wyoming server with the benchmark's hooks; every other flag is the "
        "server's (python -m wyoming_cosyvoice3 --help).")
    parser.add_argument("--bench-stats-file", type=Path, default=None,
                        help="append one JSON line per request, voice preparation and "
                        "response (stage times, every graph run, pieces)")
    parser.add_argument("--bench-tokens-per-char", default=None,
                        type=_checked(positive_float, "--bench-tokens-per-char"),
                        help="decode exactly this many speech tokens per character, "
                        "ignoring the stop token")
    parser.add_argument("--bench-synthesis-options", default={},
                        type=_checked(synthesis_overrides, "--bench-synthesis-options"),
                        help="change fields of the preset's synthesis options, "
                        "FIELD=VALUE,... (e.g. euler_steps=3,flow_chunk_causal=true)")
    parser.add_argument("--bench-engine-options", default={},
                        type=_checked(engine_overrides, "--bench-engine-options"),
                        help="change fields of the engine's load options, FIELD=VALUE,... "
                        "(e.g. stream_vocoder=false)")
    return parser


def parse(argv: Sequence[str]) -> tuple[ServerHooks, list[str]]:
    """The hooks the benchmark flags of ``argv`` ask for, and the server's flags (the rest).

    Raises:
        SystemExit: a benchmark flag has a bad value (argparse prints which).
    """
    args, server_argv = build_parser().parse_known_args(list(argv))
    rate = args.bench_tokens_per_char
    observer: FixedDecoding | None = None
    if args.bench_stats_file is not None:
        observer = StatsRecorder(args.bench_stats_file.expanduser(), tokens_per_char=rate)
    elif rate is not None:
        observer = FixedDecoding(rate)
    hooks = ServerHooks(observer=observer,
                        synthesis_overrides=dict(args.bench_synthesis_options),
                        engine_overrides=dict(args.bench_engine_options))
    return hooks, server_argv


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server with the benchmark's hooks; returns the server's exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        print(build_parser().format_help())  # then the server prints its own help
    hooks, server_argv = parse(argv)
    return cli.main(server_argv, hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
