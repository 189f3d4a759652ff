"""``--preset auto`` and ``--llm-graph preset`` through the server: the probe replaced by fixed
figures (tests/machine_figures.py), the choice made before loading, the one log line, the
voice page, the piece gate's prior, an explicit preset winning, ``describe`` during the probe;
and the probe and memory reading on this machine. The predictions themselves:
test_machine.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from machine_figures import AVX512
from server_support import client, collect, describe, make_settings, running_server
from web_support import listing
from wyoming.tts import Synthesize

from wyoming_cosyvoice3.engine import sessions as engine_sessions
from wyoming_cosyvoice3.engine.llm import graph_choice
from wyoming_cosyvoice3.engine.machine import (
    KEEPS_UP_RTF,
    PREDICTION_ERROR,
    LlmCosts,
    MachineRates,
    choose_llm_graphs,
    predict_rtf,
)
from wyoming_cosyvoice3.engine.options import PRESETS
from wyoming_cosyvoice3.engine.sessions import Graph
from wyoming_cosyvoice3.server import machine, model_loader
from wyoming_cosyvoice3.server.machine import (
    AUTO,
    available_memory_bytes,
    choose_for_this_machine,
)
from wyoming_cosyvoice3.server.settings import Settings, SettingsError, resolve_settings

PLENTY = 64e9


def scaled(rates: MachineRates, factor: float) -> MachineRates:
    assert rates.llm is not None
    return MachineRates(rates.fp32_flops * factor, rates.int8_ops * factor,
                        rates.int8_bytes * factor, rates.threads, llm=LlmCosts(
                            {k: v / factor for k, v in rates.llm.decode_s.items()},
                            {k: v / factor for k, v in rates.llm.prefill_s.items()}),
                        fp32_dit_flops=rates.fp32_dit_flops * factor)


SLOW = AVX512
MEDIUM = scaled(AVX512, predict_rtf(AVX512, "fast") / (0.9 * KEEPS_UP_RTF))
"""fast keeps up with the margin (RTF 0.9 x 0.87), balanced does not."""
MEDIUM_BESIDE = scaled(AVX512, predict_rtf(AVX512, "fast", split_cores=True)
                       / (0.9 * KEEPS_UP_RTF))
"""The same with the LLM decoding beside the flow (``split_cores``)."""


def test_a_failed_probe_takes_balanced_and_the_presets_graph() -> None:
    def broken(_threads: int, _budget_s: float) -> MachineRates:
        raise ImportError("No module named 'onnx'")

    choice = choose_for_this_machine(AUTO, probe=broken, memory=lambda: 8e9)
    assert choice.preset == "balanced" and choice.rates is None
    assert choice.preset_choice is not None and choice.preset_choice.predicted_rtf == {}
    assert "could not be measured" in choice.preset_choice.summary()
    assert "onnx" in choice.preset_choice.summary()
    # a given preset keeps its default LLM graph, one graph
    given = choose_for_this_machine("fast", probe=broken, memory=lambda: 8e9)
    assert (given.preset, given.plan.decode, given.plan.prefill) == ("fast", "fused-q4", None)
    assert given.preset_choice is None


def test_a_given_preset_gets_the_machines_llm_graphs_within_memory() -> None:
    def probe(_threads: int, _budget_s: float) -> MachineRates:
        return AVX512

    roomy = choose_for_this_machine("balanced", probe=probe, memory=lambda: PLENTY)
    assert roomy.plan == choose_llm_graphs("balanced", AVX512.llm)
    assert (roomy.plan.decode, roomy.plan.prefill) == ("fused-b8", "fused")
    tight = choose_for_this_machine("balanced", probe=probe, memory=lambda: 2.2e9)
    assert (tight.plan.decode, tight.plan.prefill) == ("fused-b8", None)
    assert "does not fit" in tight.plan.reason


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(
        "MemTotal:       8000000 kB\nMemAvailable:    3000000 kB\n", encoding="ascii")
    (tmp_path / "proc/self/statm").write_text("50000 25000 0 0 0 0 0\n", encoding="ascii")
    own = 25000 * os.sysconf("SC_PAGE_SIZE")
    assert available_memory_bytes(tmp_path) == 3000000 * 1024 + own
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("2000000000\n", encoding="ascii")
    (cgroup / "memory.current").write_text("500000000\n", encoding="ascii")
    assert available_memory_bytes(tmp_path) == 1_500_000_000 + own  # the add-on's limit
    (cgroup / "memory.max").write_text("max\n", encoding="ascii")  # no limit
    assert available_memory_bytes(tmp_path) == 3000000 * 1024 + own
    assert available_memory_bytes(tmp_path / "nothing") is None


def test_a_v1_cgroup_limit_counts(tmp_path: Path) -> None:
    # cgroup v1 (older Docker, some NAS systems): memory/memory.limit_in_bytes and
    # memory/memory.usage_in_bytes; an unlimited v1 group reports a number near 2^63
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemAvailable:    3000000 kB\n", encoding="ascii")
    (tmp_path / "proc/self/statm").write_text("50000 25000 0 0 0 0 0\n", encoding="ascii")
    own = 25000 * os.sysconf("SC_PAGE_SIZE")
    v1 = tmp_path / "sys/fs/cgroup/memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("1000000000\n", encoding="ascii")
    (v1 / "memory.usage_in_bytes").write_text("400000000\n", encoding="ascii")
    assert available_memory_bytes(tmp_path) == 600_000_000 + own
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n", encoding="ascii")
    assert available_memory_bytes(tmp_path) == 3000000 * 1024 + own


def test_default_threads_are_the_cpus_this_process_may_run_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --threads 0 (onnxruntime's choice) under `taskset -c 3` or a one-CPU cpuset on a
    # 64-CPU host runs one thread: the prediction is the one-thread prediction
    monkeypatch.setattr(engine_sessions.os, "sched_getaffinity", lambda _pid: {3}, raising=False)
    monkeypatch.setattr(engine_sessions.os, "cpu_count", lambda: 64)

    def with_threads(threads: int) -> MachineRates:
        return MachineRates(AVX512.fp32_flops, AVX512.int8_ops, AVX512.int8_bytes, threads,
                            llm=AVX512.llm)

    default, one, two = (predict_rtf(with_threads(threads), "balanced") for threads in (0, 1, 2))
    assert with_threads(0).thread_count() == 1
    assert default == one != two
    monkeypatch.setattr(engine_sessions.os, "sched_getaffinity", lambda _pid: {2, 3},
                        raising=False)
    assert with_threads(0).thread_count() == 2
    assert predict_rtf(with_threads(0), "balanced") == two


def test_the_probe_measures_this_machine() -> None:
    rates = machine.probe_rates(threads=1, budget_s=0.3)
    # any CPU onnxruntime runs on does more than 1 GFLOP/s and streams more than 0.5 GB/s
    assert rates.fp32_flops > 1e9 and rates.int8_ops > 1e9 and rates.int8_bytes > 0.5e9
    assert rates.fp32_dit_flops > 1e9 and rates.dit_fp32_rate() == rates.fp32_dit_flops
    assert rates.threads == 1 and rates.llm is not None
    # every LLM form timed: one token's products stream at most 20x the probe's rate (a
    # generous bound: attention and norms are not in them) and at least... something
    for graph in ("fused", "fused-b8", "fused-q4"):
        assert 0 < rates.llm.decode_s[graph] < 20 * 363_884_416 / rates.int8_bytes
        assert 0 < rates.llm.prefill_s[graph] < rates.llm.decode_s[graph]


def test_settings_default_is_auto_and_every_way_to_set_a_preset_wins(tmp_path: Path) -> None:
    base = ["--data-dir", str(tmp_path)]
    assert Settings().preset == "auto"
    assert resolve_settings(base, environ={}).preset == "auto"
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"preset": "quality"}), encoding="utf-8")
    from_file = [*base, "--options-file", str(options)]
    assert resolve_settings(from_file, environ={}).preset == "quality"
    assert resolve_settings(from_file, environ={"COSYVOICE3_PRESET": "fast"}).preset == "fast"
    assert resolve_settings([*from_file, "--preset", "balanced"],
                            environ={"COSYVOICE3_PRESET": "fast"}).preset == "balanced"
    assert resolve_settings([*base, "--preset", "auto"], environ={}).preset == "auto"
    with pytest.raises(SettingsError, match="auto, quality, balanced, fast"):
        resolve_settings(base, environ={"COSYVOICE3_PRESET": "turbo"})


# --- through the server (tiny model), the probe replaced by fixed rates -------------------


def fixed_probe(monkeypatch: pytest.MonkeyPatch, rates: MachineRates,
                delay_s: float = 0.0) -> list[int]:
    calls: list[int] = []

    def probe(threads: int = 0, budget_s: float = 1.0, seed: int = 0,
              llm: bool = True) -> MachineRates:
        calls.append(threads)
        time.sleep(delay_s)
        return rates

    monkeypatch.setattr(machine, "probe_rates", probe)
    monkeypatch.setattr(machine, "available_memory_bytes", lambda: PLENTY)
    return calls


@pytest.mark.parametrize(("split_cores", "rates"), [(False, MEDIUM), (True, MEDIUM_BESIDE)],
                         ids=["one-after-the-other", "decoding-beside"])
async def test_auto_chooses_before_loading_logs_one_line_and_shows_it(
        tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        split_cores: bool, rates: MachineRates) -> None:
    calls = fixed_probe(monkeypatch, rates)
    # two CPUs on any test machine: the loader splits the cores as the settings say
    monkeypatch.setattr(model_loader, "available_cpus", lambda: 2)
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache, preset="auto",
                             threads=1, http_port=0, split_cores=split_cores)
    with caplog.at_level(logging.INFO):
        async with running_server(settings) as server:
            runtime = server.runtime
            assert calls == [1]  # once, with the engine's thread count
            assert runtime.loader.preset == "fast"
            assert runtime.loader.split_cores is split_cores
            # the piece gate starts from the prediction (fast at RTF 0.9 x 0.87 = 0.783) with
            # the prediction's error: 1 / (0.783 x 1.15) s of audio per second
            assert runtime.production.seeded
            assert runtime.production.rate() == pytest.approx(
                1 / (0.9 * KEEPS_UP_RTF * (1 + PREDICTION_ERROR)), rel=1e-6)
            # the settings name an LLM graph (published): it wins over the machine's choice
            loader = runtime.loader
            assert loader.llm_plan is not None and loader.llm_plan.decode == "published"
            steps = loader.synthesis_options().flow.schedule.steps
            assert steps == PRESETS["fast"].flow.schedule.steps == 2
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="The door is locked.").event())
                response = await collect(cl, "audio-stop")
            assert not response.errors and len(response.samples) > 0
            async with aiohttp.ClientSession() as session:
                page = await listing(session, server)
    lines = [r.getMessage() for r in caplog.records if "preset auto" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("preset auto took `fast`: this machine makes speech at about")
    assert "short answers play without pauses" in lines[0]
    assert ("decoding beside the flow" in lines[0]) is split_cores
    assert page["preset"]["name"] == "fast" and page["preset"]["auto"] is True
    assert page["preset"]["choice"]["summary"] == lines[0]
    assert page["preset"]["choice"]["predicted_rtf"]["fast"] == pytest.approx(
        0.9 * KEEPS_UP_RTF, abs=1e-3)


async def test_an_explicit_preset_is_not_replaced(
        tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fixed_probe(monkeypatch, scaled(AVX512, 15.0))
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache,
                             preset="balanced", http_port=0)
    async with running_server(settings) as server:
        loader = server.runtime.loader
        assert loader.preset == "balanced" and loader.preset_choice is None
        async with aiohttp.ClientSession() as session:
            page = await listing(session, server)
    assert calls == []  # no probe at all, and no prior for the piece gate
    assert server.runtime.production.rate() is None
    assert page["preset"] == {"name": "balanced", "auto": False, "choice": None}


async def test_describe_answers_while_the_machine_is_measured(
        tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fixed_probe(monkeypatch, SLOW, delay_s=3.0)
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache, preset="auto")
    async with running_server(settings, wait_ready=False) as server:
        deadline = time.monotonic() + 30.0
        while server.runtime.loader.phase != "measuring this machine":
            assert time.monotonic() < deadline, server.runtime.loader.phase
            await asyncio.sleep(0.01)
        started = time.monotonic()
        info = await describe(server, timeout_s=1.0)
        assert time.monotonic() - started < 1.0
        assert info.tts and calls
        assert server.runtime.loader.preset == "balanced"  # until the choice: the fallback
        # let loading end here: a loader left running would log into the next test
        assert await asyncio.to_thread(server.runtime.loader.ready_event.wait, 120.0)


def fixed_step_times(monkeypatch: pytest.MonkeyPatch, step_ms: dict[str, float],
                     pair_ms: dict[str, float] | None = None,
                     paired: list[tuple[str, ...]] | None = None) -> list[tuple[str, ...]]:
    """Make the engine's timed decode steps read ``step_ms`` (form -> ms) for one row and
    ``pair_ms`` for two (default: twice one row's, so that pairing gains nothing); returns
    the list the forms of each one-row timing are appended to (``paired`` gets those of the
    two-row timings). The chosen graph's step on one thread against its sessions' threads
    (with split cores: ``model._decode_threads``) reads equal and is not listed."""
    timed: list[tuple[str, ...]] = []

    def fake(graphs: Mapping[str, Graph], embeds: np.ndarray, *,
             batch_rows: int = 1) -> dict[str, float]:
        assert embeds.ndim == 2 and embeds.shape[0] >= 1 and batch_rows in (1, 2)
        if set(graphs) == {"threads", "one"}:
            return {"threads": 20e-3, "one": 20e-3}
        if batch_rows == 2:
            if paired is not None:
                paired.append(tuple(graphs))
            return {form: (pair_ms or {}).get(form, 2.0 * step_ms[form]) * 1e-3
                    for form in graphs}
        timed.append(tuple(graphs))
        return {form: step_ms[form] * 1e-3 for form in graphs}

    monkeypatch.setattr(graph_choice, "time_decode_steps", fake)
    return timed


@pytest.mark.parametrize(("fastest", "decode_tag", "prefill_tag"),
                         [("fused", ".fused2", None), ("fused-b8", ".fusedb8", ".fused2")])
async def test_the_timed_decode_steps_overrule_the_probe(
        tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fastest: str,
        decode_tag: str, prefill_tag: str | None) -> None:
    # the AVX-512 probe reads the three forms within 1.2x, so fast's plan (4-bit decoding,
    # fused prefilling) loads the other two as well and times a real step of each: the
    # fastest decodes, fused keeps prefilling, the third graph is closed
    fixed_probe(monkeypatch, AVX512)
    step_ms = {"fused-q4": 30.0, "fused": 40.0, "fused-b8": 50.0, fastest: 20.0}
    timed = fixed_step_times(monkeypatch, step_ms)
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache,
                             llm_graph="preset", preset="fast")
    with caplog.at_level(logging.INFO):
        async with running_server(settings) as server:
            model = server.runtime.loader.engine.model  # type: ignore[union-attr]
            assert decode_tag in model.llm.path.name
            if prefill_tag is None:
                assert model.llm_prefill is None
            else:
                assert model.llm_prefill is not None and prefill_tag in model.llm_prefill.path.name
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="The door is locked.").event())
                response = await collect(cl, "audio-stop")
            assert not response.errors and len(response.samples) > 0
    assert len(timed) == 1 and set(timed[0]) == {"fused-q4", "fused", "fused-b8"}
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("LLM decode step timed at load")]
    assert len(lines) == 1 and lines[0].endswith(f"; {fastest} decodes")
    assert f"{fastest} 20.0 ms" in lines[0]


async def test_a_graph_that_decodes_two_pieces_at_once_wins_a_tie(
        tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the AMX Xeon's reading: both int8 forms 23.3 ms a one-row step. The per-tensor form
    # (planned for balanced) couples its rows and decodes one piece a step; 8-bit blocks,
    # validated for two rows when derived, take 28 ms for two: 0.22 x 23.3 + 0.78 x 14.0 =
    # 16.0 ms a token, beyond the 10 % tie, so they decode
    fixed_probe(monkeypatch, AVX512)
    paired: list[tuple[str, ...]] = []
    timed = fixed_step_times(monkeypatch, {"fused": 23.3, "fused-b8": 23.3},
                             {"fused": 28.0, "fused-b8": 28.0}, paired)
    monkeypatch.setattr(machine, "choose_llm_graphs", lambda preset, costs: machine.LlmPlan(
        "fused", None, "test plan", ("fused-b8",)))
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache,
                             llm_graph="preset", preset="balanced")
    with caplog.at_level(logging.INFO):
        async with running_server(settings) as server:
            model = server.runtime.loader.engine.model  # type: ignore[union-attr]
            assert ".fusedb8" in model.llm.path.name
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="The door is locked.").event())
                response = await collect(cl, "audio-stop")
            assert not response.errors and len(response.samples) > 0
    assert timed == [("fused", "fused-b8")] and paired == [("fused-b8",)]
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("LLM decode step timed at load")]
    assert len(lines) == 1 and lines[0].endswith("; fused-b8 decodes")
    assert "fused 23.3 ms (one row a step)" in lines[0]
    assert "fused-b8 23.3 ms (two rows 28.0 ms, 16.0 ms a token)" in lines[0]



async def test_the_preset_llm_graphs_load_as_the_probe_chose(
        tiny_model_dir: Path, tiny_engine_cache: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # --llm-graph preset (the default) with a given preset: the probe runs, balanced decodes
    # with 8-bit blocks and prefills with per-tensor int8 (the AVX-512 figures), both loaded;
    # the real steps of both are timed at load and agree
    calls = fixed_probe(monkeypatch, AVX512)
    timed = fixed_step_times(monkeypatch, {"fused-b8": 20.0, "fused": 30.0})
    settings = make_settings(tiny_model_dir, tmp_path / "data", tiny_engine_cache,
                             llm_graph="preset", preset="balanced")
    with caplog.at_level(logging.INFO):
        async with running_server(settings) as server:
            runtime = server.runtime
            assert calls == [0] and runtime.loader.preset == "balanced"
            assert runtime.loader.preset_choice is None and runtime.production.rate() is None
            model = runtime.loader.engine.model  # type: ignore[union-attr]
            assert ".fusedb8" in model.llm.path.name
            assert model.llm_prefill is not None and ".fused2" in model.llm_prefill.path.name
            async with client(server) as cl:
                await cl.write_event(Synthesize(text="The door is locked.").event())
                response = await collect(cl, "audio-stop")
            assert not response.errors and len(response.samples) > 0
    plan_lines = [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("LLM graphs for `balanced`")]
    assert plan_lines == ["LLM graphs for `balanced`: fused-b8, prefill fused (fused-b8 decodes "
                          "fastest; fused prefills 4.4x faster; fused timed at load)"]
    assert timed == [("fused-b8", "fused")]
    probes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("machine probe")]
    assert len(probes) == 1 and MachineRates.from_json(
        json.loads(probes[0].split(": ", 1)[1])) == AVX512
