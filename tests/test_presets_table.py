"""The README's presets table states what each preset record in engine/options.py sets: the
expected values are read from the README, the values under test from ``PRESET_STAGES``."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from wyoming_cosyvoice3.engine.options import (
    PRESET_LLM_GRAPHS,
    PRESET_STAGES,
    PRESETS,
    SynthesisOptions,
)

README = Path(__file__).resolve().parents[1] / "README.md"


def presets_table() -> dict[str, dict[str, str]]:
    """README "Presets" table: row label -> preset name -> cell text."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Presets"):].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    end = next(i for i in range(start, len(section)) if not section[i].startswith("|"))
    lines = section[start:end]
    names = [cell.strip(" `") for cell in lines[0].strip("|").split("|")[1:]]
    table: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        label, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        table[label] = dict(zip(names, cells, strict=True))
    return table


def tokens(cell: str, what: str) -> int:
    """``N <what> tokens`` in a cell as N; ``whole <what>`` as 0 (no bound)."""
    found = re.search(rf"(\d+) {what} tokens", cell)
    if found:
        return int(found.group(1))
    assert f"whole {what}" in cell, cell
    return 0


def test_the_table_names_every_preset() -> None:
    table = presets_table()
    assert set(table["Euler steps"]) == set(PRESET_STAGES) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESET_STAGES))
def test_the_table_states_each_stage_of_the_preset(name: str) -> None:
    rows = {label: cells[name] for label, cells in presets_table().items()}
    preset = PRESET_STAGES[name]
    flow = preset.flow
    llm = rows["LLM decoding (`--llm-graph preset`, over `--llm-precision int8`): the fastest "
               "on this CPU of"]
    named = re.findall(r"`(fused[\w-]*|published)`", llm)
    assert named == list(preset.llm.decode_graphs)  # the default graph first
    assert PRESET_LLM_GRAPHS[name] == preset.llm.graph == named[0]
    assert rows["flow DiT precision"].split()[0] == flow.precision
    assert int(rows["Euler steps"]) == flow.schedule.steps
    rate, _, steps = rows["CFG"].partition(" in ")
    assert float(rate) == flow.schedule.cfg_rate
    assert steps == "every step"
    attention = rows["flow attention"]
    assert ("chunk-causal" in attention or "chunk mask" in attention) == flow.chunk_causal
    assert ("final chunk too" in attention) == flow.final_chunk_causal
    context = rows["flow context"]
    assert (tokens(context, "prompt"), tokens(context, "history")) == (
        flow.prompt_tokens, flow.left_context_tokens)
    first = rows["first flow chunk after"]
    assert int(first.split()[0]) == flow.first_hop_tokens
    assert ("chunk grid" in first) == flow.first_hop_on_chunk_grid
    largest = rows["largest flow chunk (the hop doubles after each chunk up to it)"]
    assert int(largest.split()[0]) == flow.max_hop_tokens
    middle = rows["middle pieces of an answer, when synthesis is slower than playback"]
    assert (middle == "one chunk each") == flow.whole_middle_pieces
    vocoder = rows["vocoder if the streamed form cannot be derived"]
    window = re.search(r"(\d+)-frame window", vocoder)
    assert (int(window.group(1)) if window else 0) == preset.vocoder.window_frames
    fallback = flow.full_attention()
    no_dit = rows["if the streaming DiT cannot be derived (one warning)"]
    assert (tokens(no_dit, "prompt"), tokens(no_dit, "history")) == (
        fallback.prompt_tokens, fallback.left_context_tokens)


@pytest.mark.parametrize("name", sorted(PRESET_STAGES))
def test_the_request_options_carry_the_stage_records(name: str) -> None:
    """``PRESETS`` is the same preset as request options: the stage records are the preset's,
    the caller's fields keep their defaults."""
    preset, options = PRESET_STAGES[name], PRESETS[name]
    assert (options.llm, options.flow, options.vocoder) == (
        preset.llm, preset.flow, preset.vocoder)
    assert options.vocoder_window_frames == preset.vocoder.window_frames
    callers = {f.name: getattr(options, f.name) for f in fields(options)
               if f.name not in ("llm", "flow", "vocoder", "vocoder_window_frames")}
    defaults = SynthesisOptions()
    assert callers == {name: getattr(defaults, name) for name in callers}
    options.validate()
