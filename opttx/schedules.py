"""Schedules: functions of a 0-dim integer step tensor returning a 0-dim float32 tensor.

Names, arguments and numbers follow optax. Every schedule is written with tensor ops
(``torch.where``, ``torch.clamp``), so a compiled step that evaluates one does not recompile
as the step count advances.

Example:
  >>> sched = opttx.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=100, decay_steps=1000)
  >>> tx = opttx.adamw(learning_rate=sched)
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Sequence

import torch

from ._checks import check_nonnegative, check_positive

Schedule = Callable[[torch.Tensor], torch.Tensor]

__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_stable_decay_schedule",
]


def _as_float(count: torch.Tensor | int) -> torch.Tensor:
    if not isinstance(count, torch.Tensor):
        count = torch.tensor(count)
    return count.to(torch.float32)


def _full(count: torch.Tensor | int, value: float) -> torch.Tensor:
    return torch.full_like(_as_float(count), value)


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step."""
    def schedule(count: torch.Tensor) -> torch.Tensor:
        return _full(count, value)
    return schedule


def polynomial_schedule(init_value: float, end_value: float, power: float,
                        transition_steps: int, transition_begin: int = 0) -> Schedule:
    r"""Polynomial interpolation from ``init_value`` to ``end_value``.

    .. math::
        k = \mathrm{clip}(t - t_0, 0, T), \qquad
        v_t = (v_0 - v_{end}) (1 - k / T)^{p} + v_{end}

    ``init_value`` before ``transition_begin`` and ``end_value`` after it plus
    ``transition_steps``; a constant ``init_value`` when ``transition_steps <= 0`` (as optax).
    """
    check_nonnegative("transition_begin", transition_begin)
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        k = torch.clamp(_as_float(count) - transition_begin, 0, transition_steps)
        frac = 1 - k / transition_steps
        return (init_value - end_value) * frac**power + end_value
    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value`` over ``transition_steps``."""
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:
    r"""``init_value · decay_rate^((t − t_0) / T)`` (floored exponent with ``staircase``),
    ``init_value`` before ``transition_begin``, bounded by ``end_value`` when given."""
    if transition_steps <= 0:
        return constant_schedule(init_value)
    if decay_rate == 0:
        raise ValueError("decay_rate must be non-zero.")
    check_nonnegative("transition_begin", transition_begin)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        k = _as_float(count) - transition_begin
        p = k / transition_steps
        if staircase:
            p = torch.floor(p)
        value = torch.where(k <= 0, _full(count, init_value),
                            init_value * torch.pow(_full(count, decay_rate), p))
        if end_value is not None:
            bound = _full(count, end_value)
            value = torch.maximum(value, bound) if decay_rate < 1 else torch.minimum(value, bound)
        return value
    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    r"""Cosine decay from ``init_value`` to ``alpha · init_value`` over ``decay_steps``.

    .. math::
        v_t = v_0 \left((1 - \alpha) \left(\tfrac{1 + \cos(\pi \min(t, T) / T)}{2}\right)^{e}
        + \alpha\right)

    References: Loshchilov and Hutter, SGDR (arXiv 1608.03983).
    """
    check_positive("decay_steps", decay_steps)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        k = torch.clamp(_as_float(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * k / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)
    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` from ``boundaries[i - 1]`` on, each seeing the step counted from
    its own start."""
    if len(boundaries) != len(schedules) - 1:
        raise ValueError("join_schedules needs exactly one boundary fewer than schedules, got "
                         f"{len(schedules)} schedules and {len(boundaries)} boundaries.")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        if not isinstance(count, torch.Tensor):
            count = torch.tensor(count)
        value = schedules[0](count)
        for boundary, following in zip(boundaries, schedules[1:]):
            value = torch.where(count < boundary, value, following(count - boundary))
        return value
    return schedule


def warmup_constant_schedule(init_value: float, peak_value: float,
                             warmup_steps: int) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value``, then constant."""
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           constant_schedule(peak_value)], [warmup_steps])


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """Linear warm-up to ``peak_value`` over ``warmup_steps``, then cosine decay to
    ``end_value``; ``decay_steps`` counts the warm-up too (as optax)."""
    if decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps ({decay_steps}) must be larger than warmup_steps "
                         f"({warmup_steps}); it includes the warm-up.")
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           cosine_decay_schedule(peak_value, decay_steps - warmup_steps,
                                                 alpha, exponent)], [warmup_steps])


def piecewise_constant_schedule(init_value: float,
                                boundaries_and_scales: dict[int, float] | None = None
                                ) -> Schedule:
    """``init_value`` multiplied by ``scale`` from each ``boundary`` step on (inclusive)."""
    items = sorted((boundaries_and_scales or {}).items())
    for boundary, scale in items:
        check_nonnegative("boundary", boundary)
        check_nonnegative("scale", scale)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        value = _full(count, init_value)
        count = _as_float(count)
        for boundary, scale in items:
            value = torch.where(count < boundary, value, value * scale)
        return value
    return schedule


def warmup_stable_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 stable_steps: int, decay_steps: int, end_value: float = 0.0,
                                 decay_type: Literal["linear", "cosine", "1-sqrt"] = "linear"
                                 ) -> Schedule:
    r"""Warm-up–stable–decay ("trapezoidal") schedule.

    Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, ``peak_value``
    for ``stable_steps``, then a decay to ``end_value`` over ``decay_steps``: linear,
    cosine, or ``1-sqrt`` (:math:`v = v_{end} + (v_{peak} - v_{end})(1 - \sqrt{k/T})`),
    and ``end_value`` afterwards.

    References: Hu et al., MiniCPM (arXiv 2404.06395); Hägele et al. (arXiv 2405.18392).
    """
    for name, value in (("warmup_steps", warmup_steps), ("stable_steps", stable_steps),
                        ("decay_steps", decay_steps)):
        check_nonnegative(name, value)
    if decay_type == "linear":
        decay = linear_schedule(peak_value, end_value, decay_steps)
    elif decay_type == "cosine":
        alpha = 0.0 if peak_value == 0 else end_value / peak_value
        decay = (cosine_decay_schedule(peak_value, decay_steps, alpha) if decay_steps > 0
                 else constant_schedule(end_value))
    elif decay_type == "1-sqrt":
        def decay(count: torch.Tensor) -> torch.Tensor:
            k = torch.clamp(_as_float(count), max=max(decay_steps, 1)) / max(decay_steps, 1)
            return end_value + (peak_value - end_value) * (1 - torch.sqrt(k))
    else:
        raise ValueError(f"decay_type must be 'linear', 'cosine' or '1-sqrt', got {decay_type!r}.")
    return join_schedules([linear_schedule(init_value, peak_value, warmup_steps),
                           constant_schedule(peak_value), decay],
                          [warmup_steps, warmup_steps + stable_steps])
