"""The machine probe's decisions (engine/machine.py): which LLM graphs a preset runs, the
predicted RTF and ``--preset auto``'s choice and promise, from fixed probe figures of the two
CPU kinds the project meets, so the outcome does not depend on the CPU the tests run on.

Probe figures: tests/machine_figures.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from machine_figures import AVX2, AVX512

from wyoming_cosyvoice3.engine import machine
from wyoming_cosyvoice3.engine.derive.llm import fused
from wyoming_cosyvoice3.engine.machine import (
    KEEPS_UP_RTF,
    LLM_PROBE_FORMS,
    PREDICTION_ERROR,
    LlmCosts,
    LlmPlan,
    MachineRates,
    StageSplit,
    choose_llm_graphs,
    choose_preset,
    evict_bytes,
    last_level_cache_bytes,
    llm_weight_bytes,
    predict_rtf,
    predict_split,
)
from wyoming_cosyvoice3.engine.options import PRESET_STAGES


def scaled(rates: MachineRates, factor: float) -> MachineRates:
    """Every rate ``factor`` x faster (every product time ``factor`` x shorter)."""
    assert rates.llm is not None
    llm = LlmCosts({k: v / factor for k, v in rates.llm.decode_s.items()},
                   {k: v / factor for k, v in rates.llm.prefill_s.items()})
    return MachineRates(rates.fp32_flops * factor, rates.int8_ops * factor,
                        rates.int8_bytes * factor, rates.threads, llm=llm,
                        fp32_dit_flops=rates.fp32_dit_flops * factor)


def test_each_kind_decodes_with_its_fastest_graph_and_prefills_fast() -> None:
    # the AVX-512 machine: 8-bit blocks decode fastest of the lossless forms, but prefill
    # 4.4x slower than per-tensor int8, so balanced prefills with fused
    assert choose_llm_graphs("balanced", AVX512.llm) == LlmPlan(
        "fused-b8", "fused",
        "fused-b8 decodes fastest; fused prefills 4.4x faster; fused timed at load",
        ("fused",))
    assert choose_llm_graphs("quality", AVX512.llm).decode == "fused-b8"
    # fast may take 4-bit weights; it never prefills with them (slowest everywhere)
    fast = choose_llm_graphs("fast", AVX512.llm)
    assert (fast.decode, fast.prefill) == ("fused-q4", "fused")
    # the AVX2 machine: per-tensor int8 steps 1.05x faster than 8-bit blocks, but those decode
    # two pieces at once: 0.22 x 23.5 + 0.78 x 1.2 x 23.5 / 2 = 16.2 ms a token against 22.4;
    # they prefill only 1.09x slower: one graph
    assert choose_llm_graphs("balanced", AVX2.llm) == LlmPlan(
        "fused-b8", None,
        "fused-b8 decodes fastest; fused prefills only 1.1x faster; fused timed at load",
        ("fused",))
    assert (choose_llm_graphs("fast", AVX2.llm).decode,
            choose_llm_graphs("fast", AVX2.llm).prefill) == ("fused-q4", "fused")
    # a CPU whose 8-bit blocks step 1.6x slower than per-tensor int8 (25.0 ms a token paired
    # against 22.4): per-tensor int8 decodes and prefills, one graph
    slow_b8 = LlmCosts({"fused": 22.4e-3, "fused-b8": 36.3e-3}, {"fused": 2.75e-3,
                                                                 "fused-b8": 3.0e-3})
    assert choose_llm_graphs("balanced", slow_b8) == LlmPlan(
        "fused", None, "fused decodes and prefills fastest; fused-b8 timed at load",
        ("fused-b8",))


def test_fast_never_decodes_or_prefills_slower_than_balanced() -> None:
    # on both machine kinds and on a CPU where 4-bit weights decode slowest
    slow_q4 = LlmCosts({"fused": 20e-3, "fused-b8": 25e-3, "fused-q4": 30e-3},
                       {"fused": 1e-3, "fused-b8": 3e-3, "fused-q4": 5e-3})
    for costs in (AVX512.llm, AVX2.llm, slow_q4):
        assert costs is not None
        fast, balanced = choose_llm_graphs("fast", costs), choose_llm_graphs("balanced", costs)
        assert costs.token_s(fast.decode) <= costs.token_s(balanced.decode)
        assert costs.prefill_s[fast.prefill_graph] <= costs.prefill_s[balanced.prefill_graph]
    # per token: fused 20 ms (one row a step), 8-bit blocks 0.688 x 25 = 17.2 ms, 4-bit 20.6 ms
    assert choose_llm_graphs("fast", slow_q4).decode == "fused-b8"


def test_a_second_prefill_graph_only_for_a_large_gain() -> None:
    # 1.4x faster prefill is not worth a second copy of the weights (0.36 GB)
    costs = LlmCosts({"fused": 50e-3, "fused-b8": 20e-3}, {"fused": 1.0e-3, "fused-b8": 1.4e-3})
    assert choose_llm_graphs("balanced", costs) == LlmPlan(
        "fused-b8", None, "fused-b8 decodes fastest; fused prefills only 1.4x faster")
    # without measured costs: the preset's default graph
    assert choose_llm_graphs("fast", None).decode == PRESET_STAGES["fast"].llm.graph


def test_graphs_the_probe_reads_close_are_timed_again_at_load() -> None:
    # the AVX-512 probe reads all three forms within 1.2x: fast's other two are timed at load
    fast = choose_llm_graphs("fast", AVX512.llm)
    assert fast.candidates == ("fused", "fused-b8")
    # a graph read more than twice as costly a token as the cheapest is not loaded for timing;
    # one within twice is. 4-bit weights: 0.22 x 20 + 0.78 x 1.2 x 20 / 2 = 13.76 ms a token;
    # per-tensor int8 27.5 ms (one row a step: within 27.52); 8-bit blocks 27.59 ms a token
    costs = LlmCosts({"fused": 27.5e-3, "fused-b8": 40.1e-3, "fused-q4": 20e-3},
                     {"fused": 1e-3, "fused-b8": 3e-3, "fused-q4": 5e-3})
    assert choose_llm_graphs("fast", costs).candidates == ("fused",)
    assert choose_llm_graphs("balanced", costs).candidates == ("fused-b8",)
    assert choose_llm_graphs("balanced", costs).decode == "fused"
    # nothing measured: nothing to time
    assert choose_llm_graphs("fast", None).candidates == ()


def test_graphs_are_timed_at_load_only_where_they_fit_in_memory() -> None:
    # fast on the AVX-512 figures: fused-q4 decodes, fused prefills, fused and fused-b8 are
    # timed; fused is loaded anyway, so only fused-b8's weights come on top of the peak
    plan = choose_llm_graphs("fast", AVX512.llm)
    assert (plan.prefill, plan.candidates) == ("fused", ("fused", "fused-b8"))
    peak = machine.preset_peak_bytes("fast", plan)
    room = peak + machine.PREFILL_GRAPH_BYTES
    assert machine.fitted_plan("fast", plan, room) == plan
    assert machine.fitted_plan("fast", plan, None) == plan
    tight = machine.fitted_plan("fast", plan, room - 1.0)
    assert (tight.decode, tight.prefill, tight.candidates) == ("fused-q4", "fused", ())
    assert tight.reason.endswith("nothing timed at load: it does not fit in memory")
    # no room for the second graph: one graph, nothing timed
    single = machine.fitted_plan("fast", plan, peak - 1.0)
    assert (single.prefill, single.candidates) == (None, ())


def test_the_probe_builds_what_the_derivation_builds() -> None:
    # the probe times each form with the derivation's kernel and block size
    assert LLM_PROBE_FORMS == {"fused": ("int8", 32), "fused-b8": ("nbits8", fused.B8_BLOCK_SIZE),
                               "fused-q4": ("nbits4", fused.Q4_BLOCK_SIZE)}
    assert set(LLM_PROBE_FORMS) == set(fused.FUSED_TAGS)
    # 24 layers x (896x1152 + 896x896 + 896x9728 + 4864x896) + the 896x6761 head
    assert llm_weight_bytes() == 24 * 14_909_440 + 6_057_856 == 363_884_416


def test_the_llm_terms_use_the_plans_graphs() -> None:
    # by hand: 25 tokens x 19.4 ms x decode efficiency + 5.5 positions x 0.59 ms x prefill's
    work = machine.LlmWork(25.0, 5.5, decode_efficiency=1.2, prefill_efficiency=2.0,
                           one_thread=0.9)
    plan = LlmPlan("fused-b8", "fused")
    expected = 25 * 19.4e-3 * 1.2 + 5.5 * 0.59e-3 * 2.0
    assert work.seconds_per_audio_s(AVX512, plan) == pytest.approx(expected, rel=1e-12)
    # the same machine decoding with fused instead: slower by exactly the products' ratio
    other = work.seconds_per_audio_s(AVX512, LlmPlan("fused", None))
    assert other - work.seconds_per_audio_s(AVX512, plan) == pytest.approx(
        25 * (21.9e-3 - 19.4e-3) * work.decode_efficiency, rel=1e-9)
    # not timed: estimated from the streaming and int8 rates (364 MB per token at 22.6 GB/s)
    bare = replace(AVX512, llm=None)
    assert work.seconds_per_audio_s(bare, LlmPlan("fused", None)) == pytest.approx(
        25 * 363_884_416 / 22.6e9 * work.decode_efficiency
        + 5.5 * 2 * 363_884_416 / 2276e9 * work.prefill_efficiency, rel=1e-9)


def test_the_prediction_scales_with_the_machine() -> None:
    for rates in (AVX512, AVX2):
        for name in ("quality", "balanced", "fast"):
            assert predict_rtf(scaled(rates, 2.0), name) == pytest.approx(
                predict_rtf(rates, name) / 2, rel=1e-9)


def test_keeping_up_needs_the_predictions_margin() -> None:
    assert pytest.approx(1 / (1 + PREDICTION_ERROR)) == KEEPS_UP_RTF
    # scale AVX512 so that fast is predicted just faster than playback (RTF 0.93): within the
    # prediction's error of real time, so it does not count as keeping up; nothing does, and
    # it is the fastest, so it is taken, and the line says it may pause, not that it will not
    factor = predict_rtf(AVX512, "fast") / 0.93
    near = scaled(AVX512, factor)
    assert predict_rtf(near, "fast") == pytest.approx(0.93)
    choice = choose_preset(near, 64e9)
    assert choice.preset == "fast" and not choice.keeps_up
    assert "within the prediction's error of real time" in choice.reason
    line = choice.summary()
    assert "without pauses" not in line and "may pause" in line and "15%" in line
    # fast predicted at 1.1, still within 15 % of real time: taken, pauses expected
    slower = choose_preset(scaled(near, 0.93 / 1.1), 64e9)
    assert slower.preset == "fast" and slower.predicted_rtf["fast"] == pytest.approx(1.1)
    assert slower.summary().endswith("expect pauses between sentences on long answers")
    # at 1.2, beyond the error: the fallback, balanced
    slowest = choose_preset(scaled(near, 0.93 / 1.2), 64e9)
    assert slowest.preset == "balanced" and "no preset keeps up" in slowest.reason
    assert slowest.summary().endswith("expect pauses between sentences on long answers")
    # 1.2x faster: fast at 0.78 keeps up with the margin
    faster = choose_preset(scaled(near, 1.2), 64e9)
    assert faster.preset == "fast" and faster.keeps_up
    assert faster.summary().endswith("short answers play without pauses; a long one may "
                                     "pause between its first sentences")


def test_decoding_beside_the_flow_overlaps_the_two_kinds_of_work() -> None:
    for rates in (AVX512, AVX2):
        for name in ("quality", "balanced", "fast"):
            parts = predict_split(rates, name)
            alone = predict_rtf(rates, name)
            beside = predict_rtf(rates, name, split_cores=True)
            assert alone == pytest.approx(parts.llm_s + parts.stages_s, rel=1e-12)
            # sooner than one after the other, never sooner than the longer kind alone
            assert max(parts.llm_s, parts.stages_s) < beside < alone
    # work that costs nothing changes nothing; equal halves overlap by the fitted fraction
    assert StageSplit(0.0, 1.0).rtf(True) == StageSplit(0.0, 1.0).rtf(False) == 1.0
    assert StageSplit(1.0, 0.0).rtf(True) == 1.0
    assert StageSplit(0.5, 0.5).rtf(True) == pytest.approx(0.5 * (1 + machine.SPLIT_OVERLAP))
    assert StageSplit(0.5, 0.5).rtf(False) == 1.0


def test_auto_predicts_as_the_engine_will_run() -> None:
    # a machine where fast keeps up only when its LLM decodes beside the flow (predicted at
    # RTF 0.8 so, above the 0.87 of keeping up one after the other)
    near = scaled(AVX512, predict_rtf(AVX512, "fast", split_cores=True) / 0.8)
    assert predict_rtf(near, "fast") > KEEPS_UP_RTF
    beside = choose_preset(near, 64e9, split_cores=True)
    assert beside.preset == "fast" and beside.keeps_up and beside.split_cores
    assert beside.predicted_rtf["fast"] == pytest.approx(0.8)
    assert "decoding beside the flow" in beside.summary()
    # one after the other, fast is predicted at RTF 0.99: within the prediction's error of
    # real time, taken without the promise of keeping up
    turns = choose_preset(near, 64e9)
    assert turns.preset == "fast" and not turns.keeps_up
    assert turns.predicted_rtf["fast"] == pytest.approx(0.99, abs=0.005)
    assert "decoding beside the flow" not in turns.summary()


@pytest.mark.parametrize("rates", [AVX512, AVX2], ids=["avx512", "avx2"])
def test_slow_medium_and_fast_machines_of_each_kind(rates: MachineRates) -> None:
    # nothing keeps up (fast predicted at RTF 1.2): balanced, the fallback
    slow = scaled(rates, predict_rtf(rates, "fast") / 1.2)
    assert choose_preset(slow, 64e9).preset == "balanced"
    # a machine fast enough for balanced with the margin but not quality takes balanced; one
    # fast enough for quality takes quality
    for name, margin in (("balanced", 1.15), ("quality", 1.15)):
        factor = predict_rtf(rates, name) / (0.97 / margin)
        choice = choose_preset(scaled(rates, factor), 64e9)
        assert choice.preset == name and choice.keeps_up
        assert choice.plan == choose_llm_graphs(name, rates.llm)


def test_quality_keeps_up_with_the_same_margin() -> None:
    # quality's flow is predicted from the DiT-sized rate, as near as the other presets: the
    # same 15 %. Predicted at RTF 0.85 it keeps up; at 0.9 it does not and balanced, the next
    # preset, is taken with its own margin
    assert machine.PREDICTION_ERRORS == {"quality": 0.15, "balanced": 0.15, "fast": 0.15}
    at = {rtf: scaled(AVX512, predict_rtf(AVX512, "quality") / rtf) for rtf in (0.85, 0.9)}
    keeps = choose_preset(at[0.85], 64e9)
    assert keeps.preset == "quality" and keeps.keeps_up
    assert keeps.predicted_rtf["quality"] == pytest.approx(0.85)
    near = choose_preset(at[0.9], 64e9)
    assert near.preset == "balanced" and near.keeps_up


def test_memory_drops_the_second_prefill_graph_then_the_preset() -> None:
    fast_machine = scaled(AVX512, predict_rtf(AVX512, "balanced") / (0.9 * KEEPS_UP_RTF))
    plenty = choose_preset(fast_machine, 64e9)
    assert plenty.preset == "balanced" and plenty.plan is not None
    assert plenty.plan.prefill == "fused"
    # room for balanced's measured peak but not for a second copy of the LLM's weights
    one_graph = choose_preset(fast_machine, machine.preset_peak_bytes("balanced") + 0.1e9)
    assert one_graph.preset == "balanced" and one_graph.plan is not None
    assert one_graph.plan.prefill is None and "does not fit" in one_graph.plan.reason


def test_machine_rates_round_trip_through_json() -> None:
    assert MachineRates.from_json(AVX512.to_json()) == AVX512
    bare = MachineRates(1e9, 2e9, 3e9, 1, 0.5)
    assert MachineRates.from_json(bare.to_json()) == bare
    dit = replace(AVX512, fp32_dit_flops=150e9)
    assert MachineRates.from_json(dit.to_json()) == dit
    # a probe logged before the DiT-sized rate existed: the peak rate stands in for it
    old = {k: v for k, v in AVX512.to_json().items() if k != "fp32_dit_flops"}
    assert MachineRates.from_json(old).dit_fp32_rate() == AVX512.fp32_flops


def test_only_quality_flow_runs_at_the_dit_sized_rate() -> None:
    # the DiT-sized product at half the peak rate: quality's fp32 flow takes twice as long,
    # the stages calibrated against the peak rate (the int8 flows' fp32 parts, the vocoder)
    # do not move
    half = replace(AVX512, fp32_dit_flops=AVX512.fp32_flops / 2)
    flows = {name: machine.STAGE_WORK[name]["flow"] for name in ("quality", "balanced", "fast")}
    assert [name for name, work in flows.items() if work.fp32_dit] == ["quality"]
    assert flows["quality"].seconds_per_audio_s(half) == pytest.approx(
        2 * flows["quality"].seconds_per_audio_s(AVX512), rel=1e-9)
    for work in (flows["balanced"], flows["fast"], machine.STAGE_WORK["quality"]["vocoder"]):
        assert work.seconds_per_audio_s(half) == work.seconds_per_audio_s(AVX512)


def test_the_eviction_buffer_covers_the_last_level_cache(tmp_path: Path) -> None:
    cache = tmp_path / "sys/devices/system/cpu/cpu0/cache"
    for index, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "300M")]):
        (cache / f"index{index}").mkdir(parents=True)
        (cache / f"index{index}/level").write_text(f"{level}\n")
        (cache / f"index{index}/size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 300 << 20
    assert evict_bytes(tmp_path) == int(1.5 * (300 << 20))
    (cache / "index2/size").write_text("32M\n")  # the EPYCs' 32 MB L3: at least 64 MiB
    assert evict_bytes(tmp_path) == 64 << 20
    assert last_level_cache_bytes(tmp_path / "none") is None
    assert evict_bytes(tmp_path / "none") == 64 << 20


def test_the_cost_and_memory_tables_cover_exactly_the_presets() -> None:
    presets = set(PRESET_STAGES)
    assert set(machine.PRESET_ORDER) == presets
    assert set(machine.STAGE_WORK) == set(machine.LLM_WORK) == set(machine.PRESET_MEMORY) == (
        presets)
    # every preset's decode candidates are forms the probe times
    for name, stages in PRESET_STAGES.items():
        assert stages.llm.graph in stages.llm.decode_graphs, name
        assert set(stages.llm.decode_graphs) <= set(LLM_PROBE_FORMS), name


def test_each_forms_cost_is_its_median_over_the_rounds() -> None:
    rounds = [LlmCosts({"fused": 30e-3, "fused-q4": 18e-3}, {"fused": 1.0e-3, "fused-q4": 4e-3}),
              LlmCosts({"fused": 19e-3, "fused-q4": 25e-3}, {"fused": 0.8e-3, "fused-q4": 5e-3}),
              LlmCosts({"fused": 21e-3, "fused-q4": 19e-3}, {"fused": 0.9e-3, "fused-q4": 6e-3})]
    costs = machine.median_costs(rounds)
    assert costs.decode_s == {"fused": 21e-3, "fused-q4": 19e-3}
    assert costs.prefill_s == {"fused": 0.9e-3, "fused-q4": 5e-3}
    with pytest.raises(ValueError):
        machine.median_costs([])


def test_the_probe_times_the_llm_in_rounds_spread_over_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # one slow round (a busy second of a shared host) must not set the figure
    order: list[str] = []
    decode = iter([40e-3, 20e-3, 21e-3])

    def fake_llm(threads: int, **kwargs: object) -> LlmCosts:
        order.append("llm")
        assert kwargs["models"] is not None  # built once, not per round
        value = next(decode)
        return LlmCosts({"fused": value}, {"fused": value / 20})

    real_median = machine._median_s

    def counting_median(*args: object, **kwargs: object) -> float:
        order.append("compute")
        return real_median(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(machine, "probe_llm", fake_llm)
    monkeypatch.setattr(machine, "llm_probe_models", lambda: {"fused": b""})
    monkeypatch.setattr(machine, "_median_s", counting_median)
    monkeypatch.setattr(machine, "evict_bytes", lambda: 1 << 20)
    rates = machine.probe_rates(budget_s=0.05)
    assert rates.llm is not None
    assert rates.llm.decode_s == {"fused": 21e-3}
    assert order.count("llm") == machine.LLM_ROUNDS == 3
    # a compute window before the first LLM round and after the last
    assert order[0] == "compute" and order[-1] == "compute"
    assert "llm" in order[order.index("compute") + 1:]
