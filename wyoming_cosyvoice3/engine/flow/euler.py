"""The Euler ODE solver with classifier-free guidance, shared by both flow forms (spec section 5).

Source (FunAudioLLM/CosyVoice, commit ace7c47): ``cosyvoice/flow/flow_matching.py``
``CausalConditionalCFM.forward`` (cosine time schedule ``t = 1 - cos(linspace(0, 1, n + 1)
* pi / 2)``) and ``ConditionalCFM.solve_euler`` (batch 2: conditional and unconditional rows,
guidance ``(1 + rate) * v_cond - rate * v_uncond``, ``x += dt * v``).

The full-attention flow (:class:`.solver.FlowRunner`) and the chunk-causal flow
(:class:`.chunked.ChunkedFlow`) differ only in how one step's velocity rows are computed;
:func:`solve_euler` runs the steps for both. The loaders read :func:`cosine_t_schedule` too,
to compute a derived DiT's time conditioning ahead of the requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import SynthesisCancelled
from ..types import ShouldStop

FloatArray = npt.NDArray[np.float32]

VelocityRows = Callable[[FloatArray, int, float, bool], FloatArray]
"""``(x float32 [80, F], step k, time t, guided) -> float32 [B, 80, F]``: one Euler step's
estimator output. Guided steps return B = 2 rows (conditional, then unconditional with mu,
spks and cond zeroed); unguided steps return B >= 1 rows of which row 0 (conditional) is
used."""


def cosine_t_schedule(n_steps: int) -> npt.NDArray[np.float32]:
    """Time points of the Euler solver: ``t_k = 1 - cos(k / n * pi / 2)``, k = 0..n.

    Args:
        n_steps: number of Euler steps n (>= 1).

    Returns:
        float32 [n + 1], from 0 to 1 (flow_matching.py ``t_scheduler == "cosine"``).
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    k = np.arange(n_steps + 1, dtype=np.float64)
    return (1.0 - np.cos(k / n_steps * (math.pi / 2.0))).astype(np.float32)


def cfg_combine(v_cond: FloatArray, v_uncond: FloatArray, rate: float) -> FloatArray:
    """Classifier-free guidance: ``(1 + rate) * v_cond - rate * v_uncond``.

    (flow_matching.py ``solve_euler``; rate 0.7 upstream). Shapes of both inputs are equal;
    the result has the same shape, float32.
    """
    out = (1.0 + rate) * v_cond - rate * v_uncond
    return np.asarray(out, dtype=np.float32)


@dataclass(frozen=True)
class EulerSchedule:
    """How one flow pass integrates: Euler steps and where CFG runs.

    Attributes:
        steps: Euler steps n (>= 1; upstream 10, ``constants.DEFAULT_EULER_STEPS``).
        cfg_rate: CFG rate (upstream 0.7); 0 means no unconditional row is run at all.
        cfg_steps: CFG only in the first ``cfg_steps`` steps (None = every step).
    """

    steps: int
    cfg_rate: float
    cfg_steps: int | None = None

    @property
    def t_span(self) -> npt.NDArray[np.float32]:
        """float32 [steps + 1], the cosine time points from 0 to 1."""
        return cosine_t_schedule(self.steps)

    @property
    def guided(self) -> tuple[bool, ...]:
        """Per step, whether it runs CFG (two rows): the first ``cfg_steps`` steps, none when
        ``cfg_rate`` is 0 (``(1 + 0) v_cond - 0 v_uncond == v_cond``)."""
        n_guided = self.steps if self.cfg_steps is None else max(0, min(self.cfg_steps, self.steps))
        if self.cfg_rate == 0.0:
            n_guided = 0
        return tuple(k < n_guided for k in range(self.steps))

    @property
    def key(self) -> tuple[int, ...]:
        """Which steps use CFG (1) or not (0): the part of a cached key/value set that
        depends on the schedule (its batch per step)."""
        return tuple(int(g) for g in self.guided)


def solve_euler(
    x0: FloatArray,
    schedule: EulerSchedule,
    velocity_rows: VelocityRows,
    should_stop: ShouldStop | None = None,
) -> FloatArray:
    """Integrate from the noise ``x0`` at t = 0 to the mel at t = 1.

    Args:
        x0: float32 [80, F], the start noise (not modified).
        schedule: steps and CFG schedule.
        velocity_rows: the estimator call of one step (see :data:`VelocityRows`).
        should_stop: checked before every step.

    Returns:
        float32 [80, F].

    Raises:
        SynthesisCancelled: ``should_stop()`` returned True.
    """
    t_span = schedule.t_span
    x = np.array(x0, dtype=np.float32, copy=True)
    for k, guided in enumerate(schedule.guided):
        if should_stop is not None and should_stop():
            raise SynthesisCancelled("synthesis cancelled during the flow (Euler step)")
        rows = velocity_rows(x, k, float(t_span[k]), guided)
        v = cfg_combine(rows[0], rows[1], schedule.cfg_rate) if guided else rows[0]
        x += (t_span[k + 1] - t_span[k]) * v
    return x
