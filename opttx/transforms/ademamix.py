r"""AdEMAMix: Adam whose numerator mixes a fast and a slow moving average of the gradients.

Element-wise, as Adam: a few grouped kernels over all leaves per step (docs/design.md, rule
4). The slow average (decay :math:`\beta_3` close to 1) keeps gradients from tens of
thousands of steps ago in the update; the fast one (Adam's :math:`\beta_1`) keeps it
responsive. Both are declared first moments and the squared-gradient average a second
moment, so `opttx.quantize_state` stores the state in 8 bits with no further rule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import check_nonnegative, check_unit_interval
from ..base import (ELEMENTWISE, GradientTransformation, HyperRole, Params, Role, Updates,
                    check_init_params, declare, declare_roles, replace_state, zero_count)
from ..skeleton import leafwise
from ..kernels import cast_like, foreach, foreach_ema, foreach_ema_sq, foreach_op_
from ..schedules import Schedule
from ..tree import Static, stats_like
from .common import divide_consuming, fresh_updates, debias_factor

__all__ = ["ScaleByAdemamixState", "scale_by_ademamix"]


class ScaleByAdemamixState(NamedTuple):
    """State of `scale_by_ademamix`."""
    count: torch.Tensor  # shape (), int32: steps taken
    m1: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): fast EMA (b1)
    m2: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): slow EMA (b3)
    nu: Updates          # like params (fp32 for 16-bit leaves): EMA of squared gradients
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, m1=Role.FIRST_MOMENT, m2=Role.FIRST_MOMENT,
                              nu=Role.SECOND_MOMENT)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "b3": None, "alpha": None,
                      "eps": HyperRole.EPS, "eps_root": None})
def scale_by_ademamix(b1: float = 0.9, b2: float = 0.999,
                      b3: float | Schedule = 0.9999, alpha: float | Schedule = 5.0,
                      eps: float = 1e-8, eps_root: float = 0.0,
                      mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Rescale updates by AdEMAMix's mixture of a fast and a slow first moment.

    With :math:`t` the 1-based step and :math:`\beta_{3,t}`, :math:`\alpha_t` the values of
    ``b3`` and ``alpha`` at the 0-based step :math:`t-1` (numbers or schedules):

    .. math::
        m^{(1)}_t = \beta_1 m^{(1)}_{t-1} + (1-\beta_1) g_t, \quad
        m^{(2)}_t = \beta_{3,t} m^{(2)}_{t-1} + (1-\beta_{3,t}) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,

    .. math::
        u_t = \frac{m^{(1)}_t / (1-\beta_1^t) + \alpha_t\, m^{(2)}_t}
        {\sqrt{v_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}

    The slow average is not bias-corrected (as in the paper). The paper warms
    :math:`\alpha` up linearly and :math:`\beta_3` up along
    :math:`\beta_{3,t} = \min\big(\exp\frac{\ln\beta_1 \ln\beta_3}
    {(1-t/T)\ln\beta_3 + (t/T)\ln\beta_1}, \beta_3\big)` over :math:`T` steps when the run is
    long; pass those as schedules (docs/mapping.md gives ``pytorch_optimizer``'s
    ``t_alpha_beta3`` as two functions).

    Args:
      b1: :math:`\beta_1`, decay of the fast average, in [0, 1).
      b2: :math:`\beta_2`, decay of the second moment, in [0, 1).
      b3: :math:`\beta_3`, decay of the slow average, in [0, 1), or a schedule of the 0-based
        step.
      alpha: :math:`\alpha` >= 0, weight of the slow average, or a schedule of the 0-based
        step (default 5.0: ``optax.contrib.ademamix``'s and ``pytorch_optimizer``'s;
        ``optax.contrib.scale_by_ademamix`` defaults to 6.0).
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      mu_dtype: dtype of both first moments (default: fp32 for 16-bit leaves, else the
        leaf's; optax also keeps the second moment in it, here it keeps the default).

    Returns:
      A `GradientTransformation`; same numbers as ``optax.contrib.scale_by_ademamix`` with
      the same arguments.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_ademamix(b3=0.999), opttx.scale_by_learning_rate(1e-3))

    References:
      Pagliardini, Ablin and Grangier, The AdEMAMix Optimizer: Better, Faster, Older
      (arXiv 2409.03137).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_unit_interval("b3", b3)
    check_nonnegative("alpha", alpha)
    check_nonnegative("eps", eps)
    check_nonnegative("eps_root", eps_root)
    fast_path = isinstance(eps_root, (int, float)) and eps_root == 0

    def init(params: Params) -> ScaleByAdemamixState:
        check_init_params(params)
        return ScaleByAdemamixState(count=zero_count(params), m1=stats_like(params, mu_dtype),
                                    m2=stats_like(params, mu_dtype), nu=stats_like(params))

    def step(g, state, params, extra_args):
        step0 = state.count - 1        # the 0-based step the schedules are evaluated at
        b3_t = b3(step0) if callable(b3) else b3
        alpha_t = alpha(step0) if callable(alpha) else alpha
        m1 = foreach_ema(state.m1, g, b1)
        m2 = foreach_ema(state.m2, g, b3_t)
        nu = foreach_ema_sq(state.nu, g, b2)
        bc1, bc2 = debias_factor(b1, state.count), debias_factor(b2, state.count)
        if fast_path:
            denom = foreach_op_("mul", foreach("sqrt", nu), 1 / torch.sqrt(bc2))
        else:
            denom = foreach_op_("sqrt", foreach_op_("add", foreach("div", nu, bc2), eps_root))
        denom = foreach_op_("add", denom, eps)
        num = foreach_op_("add", foreach("div", m1, bc1), foreach("mul", m2, alpha_t))
        out = divide_consuming(cast_like(num, nu), denom)
        return fresh_updates(out, g), replace_state(state, m1=m1, m2=m2, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByAdemamixState, step), ELEMENTWISE)
