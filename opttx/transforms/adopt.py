r"""ADOPT: Adam whose gradient is normalised by the *previous* second moment, then averaged.

Element-wise, as Adam: a few grouped kernels over all leaves per step (docs/design.md, rule
4). Where Adam divides its momentum by :math:`\sqrt{v_t}` (which holds the current gradient),
ADOPT divides the gradient by :math:`\sqrt{v_{t-1}}` first and averages the result, so the
normalisation is independent of the gradient it scales; the first step only records
:math:`v_1 = g_1^2`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .._checks import check_nonnegative, check_positive, check_unit_interval
from ..base import (ELEMENTWISE, GradientTransformation, HyperRole, Params, Role, Updates,
                    check_init_params, declare, declare_roles, replace_state, zero_count)
from ..skeleton import leafwise
from ..kernels import cast_like, foreach, foreach_ema, foreach_ema_sq, foreach_op_
from ..tree import Static, stats_like
from .common import as_float64, divide_consuming, fresh_updates

__all__ = ["ScaleByAdoptState", "scale_by_adopt"]


class ScaleByAdoptState(NamedTuple):
    """State of `scale_by_adopt`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): EMA of the
                         #   normalised (and clipped) gradients
    nu: Updates          # like params (fp32 for 16-bit leaves): EMA of squared gradients
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


def _quarter_power(count: torch.Tensor) -> torch.Tensor:
    """The default clipping bound: ``count ** 0.25`` (``count`` the 0-based step), float64."""
    return count.to(torch.float64) ** 0.25


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "clip_value_fn": None})
def scale_by_adopt(b1: float = 0.9, b2: float = 0.9999, eps: float = 1e-6,
                   mu_dtype: torch.dtype | None = None, *, nesterov: bool = False,
                   use_clipping: bool = True,
                   clip_value_fn: Callable[[torch.Tensor], Any] | float = _quarter_power
                   ) -> GradientTransformation:
    r"""Rescale updates by ADOPT's moments: normalise by the previous second moment, then
    average.

    With :math:`t` the 1-based step and :math:`c(t-1)` = ``clip_value_fn`` of the 0-based
    step (default :math:`(t-1)^{1/4}`):

    .. math::
        v_1 = g_1^2, \qquad m_1 = 0, \qquad u_1 = 0,

    .. math::
        \tilde g_t = \operatorname{clip}\!\left(\frac{g_t}{\max(\sqrt{v_{t-1}}, \epsilon)},
        -c(t-1), c(t-1)\right), \quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1) \tilde g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad u_t = m_t \quad (t > 1)

    (no clipping with ``use_clipping=False``; with ``nesterov=True``,
    :math:`u_t = \beta_1 m_t + (1-\beta_1) \tilde g_t`). No bias correction: the first
    step's :math:`v_1 = g_1^2` starts the second moment unbiased, and the first step moves
    nothing.

    Args:
      b1: :math:`\beta_1`, decay of the first moment, in [0, 1).
      b2: :math:`\beta_2`, decay of the second moment, in [0, 1) (the paper's claim: any
        :math:`\beta_2` converges; default 0.9999).
      eps: :math:`\epsilon` > 0, the floor of :math:`\sqrt{v}` (a floor, not an addend).
      mu_dtype: dtype of the first moment (default: fp32 for 16-bit leaves, else the leaf's).
      nesterov: output the Nesterov look-ahead of the first moment.
      use_clipping: clip the normalised gradient to :math:`[-c, c]` (the paper's stabiliser
        for the first steps).
      clip_value_fn: :math:`c`, a schedule: a function of the 0-dim integer 0-based step
        returning a number or a 0-dim tensor (optax's convention; the paper and
        ``pytorch_optimizer`` evaluate :math:`t^{1/4}` at the 1-based step: pass
        ``lambda count: (count + 1.0) ** 0.25`` for theirs), or a number >= 0 (a constant
        bound; what `opttx.inject_hyperparams` passes, the schedule's value at this step).

    Returns:
      A `GradientTransformation`; same numbers as ``optax.contrib.scale_by_adopt`` with the
      same arguments.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_adopt(), opttx.scale_by_learning_rate(1e-3))

    References:
      Taniguchi et al., ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal
      Rate (arXiv 2411.02853, NeurIPS 2024).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_positive("eps", eps)    # v is 0 where a first gradient element was 0: 0 / 0
    check_nonnegative("clip_value_fn", clip_value_fn)

    def init(params: Params) -> ScaleByAdoptState:
        check_init_params(params)
        return ScaleByAdoptState(count=zero_count(params), mu=stats_like(params, mu_dtype),
                                 nu=stats_like(params))

    def step(g, state, params, extra_args):
        # state.count already counts this step: 1 on the first
        first = state.count == 1
        one = torch.ones((), dtype=torch.float64, device=state.count.device)
        b1_t = torch.where(first, one, as_float64(b1, state.count))       # m stays 0
        b2_t = torch.where(first, one - 1, as_float64(b2, state.count))   # v_1 = g_1^2
        gs = cast_like(g, state.nu)
        # g / max(sqrt(v_{t-1}), eps), before v is updated (in place when donating)
        normed = divide_consuming(gs, foreach_op_("maximum", foreach("sqrt", state.nu), eps))
        if use_clipping:
            bound = clip_value_fn(state.count - 1) if callable(clip_value_fn) \
                else clip_value_fn
            normed = foreach_op_("minimum", foreach_op_("maximum", normed, -bound), bound)
        nu = foreach_ema_sq(state.nu, gs, b2_t)
        mu = foreach_ema(state.mu, normed, b1_t)
        if nesterov:
            out = fresh_updates(foreach("lerp", cast_like(normed, mu), mu, b1_t), g)
        else:
            out = cast_like(mu, g)      # aliases the state: not a temporary
        return out, replace_state(state, mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByAdoptState, step), ELEMENTWISE)
