"""The preset and the LLM graphs that fit this machine, chosen at start (``--preset auto``,
``--llm-graph preset``): the engine's probe and cost model (:mod:`..engine.machine`) with the
memory this process may use.

``python -m wyoming_cosyvoice3.server.machine [--threads N]`` prints the probe and the
predictions for this machine.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..engine.machine import (
    FALLBACK_PRESET,
    LlmPlan,
    MachineRates,
    PresetChoice,
    choose_llm_graphs,
    choose_preset,
    fitted_plan,
    predict_rtf,
    probe_rates,
)
from ..engine.sessions import available_cpus

_LOGGER = logging.getLogger(__name__)

AUTO = "auto"
"""The ``--preset`` value that chooses with :func:`~..engine.machine.choose_preset` at start."""

# --- memory -------------------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _own_rss_bytes(statm: Path) -> int:
    try:
        return int(statm.read_text(encoding="ascii").split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_memory_bytes(root: Path = Path("/")) -> float | None:
    """Memory this process may grow into, bytes: the smaller of the system's
    ``MemAvailable`` and what the cgroup's limit leaves (v2 ``memory.max`` -
    ``memory.current``, v1 ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``; containers
    such as a Home Assistant add-on), plus this process's own RSS (the measured peaks include
    it). None when neither is readable (not Linux).

    Args:
        root: file system root (tests point it at a fake ``proc``/``sys`` tree).
    """
    limits: list[int] = []
    available = _meminfo_available(root / "proc/meminfo")
    if available is not None:
        limits.append(available)
    cgroup = root / "sys/fs/cgroup"
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        limit, usage = _read_int(cgroup / limit_file), _read_int(cgroup / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # "max" / no limit
            limits.append(max(0, limit - usage))
    if not limits:
        return None
    return float(min(limits) + _own_rss_bytes(root / "proc/self/statm"))


@dataclass(frozen=True)
class MachineChoice:
    """What the start-up probe decided.

    Attributes:
        preset: the preset requests run with.
        plan: its LLM graphs.
        rates: the probe's figures (None when it failed or did not run).
        preset_choice: ``--preset auto``'s choice with its predictions (None: a preset was
            given).
    """

    preset: str
    plan: LlmPlan
    rates: MachineRates | None = None
    preset_choice: PresetChoice | None = None


Probe = Callable[[int, float], MachineRates]


def choose_for_this_machine(preset: str = AUTO, threads: int = 0, budget_s: float = 1.0,
                            probe: Probe | None = None,
                            memory: Callable[[], float | None] | None = None,
                            split_cores: bool = False) -> MachineChoice:
    """Probe this machine; resolve ``preset`` (``auto``: :func:`~..engine.machine.choose_preset`)
    and its LLM graphs (:func:`~..engine.machine.choose_llm_graphs`, one graph when a second
    does not fit in memory). Never raises: a failed probe gives :data:`FALLBACK_PRESET` for
    ``auto`` and the preset's default LLM graph, with the reason.

    Args:
        preset: ``--preset`` (a preset name or ``auto``).
        threads: the engine's ``--threads`` (0: onnxruntime's choice).
        budget_s: the probe's timing budget.
        probe, memory: replace :func:`~..engine.machine.probe_rates` /
            :func:`available_memory_bytes` (tests).
        split_cores: the engine will decode beside the flow (``EngineOptions.split_cores``):
            ``auto`` predicts the presets so.
    """
    available = (memory or available_memory_bytes)()
    try:
        rates = (probe or (lambda t, b: probe_rates(t, b)))(threads, budget_s)
    except (ImportError, RuntimeError, OSError, ValueError) as err:
        name = FALLBACK_PRESET if preset == AUTO else preset
        plan = choose_llm_graphs(name, None)
        reason = f"the machine could not be measured ({err})"
        auto = (PresetChoice(name, available_bytes=available, reason=reason)
                if preset == AUTO else None)
        return MachineChoice(name, LlmPlan(plan.decode, None, reason), None, auto)
    if preset == AUTO:
        auto = choose_preset(rates, available, split_cores)
        assert auto.plan is not None
        return MachineChoice(auto.preset, auto.plan, rates, auto)
    return MachineChoice(preset, fitted_plan(preset, choose_llm_graphs(preset, rates.llm),
                                             available), rates)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the probe, the LLM graphs and every preset's predicted RTF for this machine."""
    parser = argparse.ArgumentParser(
        prog="python -m wyoming_cosyvoice3.server.machine",
        description="Measure this machine as --preset auto does and print the prediction.")
    parser.add_argument("--threads", type=int, default=0,
                        help="onnxruntime threads as the server's --threads (0: its choice)")
    parser.add_argument("--budget-s", type=float, default=1.0, help="probe timing budget")
    parser.add_argument("--no-split-cores", dest="split_cores", action="store_false",
                        help="predict as the server's --no-split-cores (the LLM decoding "
                             "between the flow's calls instead of beside them)")
    args = parser.parse_args(argv)
    split_cores = args.split_cores and available_cpus() >= 2
    choice = choose_for_this_machine(AUTO, args.threads, args.budget_s,
                                     split_cores=split_cores)
    rates, auto = choice.rates, choice.preset_choice
    if rates is not None:
        print(f"rates: {rates.describe()} ({rates.threads or 'default'} threads, "
              f"probe {rates.probe_s:.2f} s)")
        if rates.llm is not None:
            for graph in rates.llm.decode_s:
                print(f"LLM {graph}: {1e3 * rates.llm.decode_s[graph]:.1f} ms per decoded "
                      f"token, {1e3 * rates.llm.prefill_s[graph]:.2f} ms per prefilled "
                      "position (products only)")
        for name in ("quality", "balanced", "fast"):
            plan = choose_llm_graphs(name, rates.llm)
            rtf = predict_rtf(rates, name, plan, split_cores)
            print(f"{name}: predicted RTF {rtf:.3f}; LLM "
                  f"{plan.decode}{f' (prefill {plan.prefill})' if plan.prefill else ''}")
    assert auto is not None
    print(auto.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
