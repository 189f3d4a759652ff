"""Probe figures of the two CPU kinds the project meets, for tests that must not depend on the
CPU they run on (test_machine.py, test_web_browser.py).

Probe figures (``python -m wyoming_cosyvoice3.server.machine``, two threads):

* AVX512: the Intel Xeon (AVX-512 VNNI, AMX) of 2026-12-06: fp32 262 GFLOP/s, int8
  2276 GOP/s, 22.6 GB/s; LLM products per decoded token fused 21.9 ms, fused-b8 19.4 ms,
  fused-q4 18.2 ms; per prefilled position 0.59, 2.58 and 4.53 ms.
* AVX2: the AVX2-only EPYC of 2026-12-03 (BENCHMARKS.md "LLM decode graph", "The preset that
  fits the machine"): fp32 180 GFLOP/s, int8 343 GOP/s, 26.2 GB/s; fused 22.4 ms, fused-q4
  16.3 ms per token; 2.75 and 4.67 ms per prefilled position (514 and 873 ms for 187). fused-b8
  was not measured there: the figure below (1.05x fused's) stands for a CPU where 8-bit blocks
  do not decode faster, which exercises the other branch of the choice.
"""

from __future__ import annotations

from wyoming_cosyvoice3.engine.machine import LlmCosts, MachineRates

AVX512 = MachineRates(
    262e9, 2276e9, 22.6e9, 2,
    llm=LlmCosts({"fused": 21.9e-3, "fused-b8": 19.4e-3, "fused-q4": 18.2e-3},
                 {"fused": 0.59e-3, "fused-b8": 2.58e-3, "fused-q4": 4.53e-3}))
AVX2 = MachineRates(
    180e9, 343e9, 26.2e9, 2,
    llm=LlmCosts({"fused": 22.4e-3, "fused-b8": 23.5e-3, "fused-q4": 16.3e-3},
                 {"fused": 2.75e-3, "fused-b8": 3.0e-3, "fused-q4": 4.67e-3}))
