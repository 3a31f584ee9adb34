r"""MARS: a variance-reduced gradient, in front of Adam or Lion.

MARS (Yuan et al., 2024) replaces the gradient fed to a preconditioned optimizer by a
scaled STORM-style correction, :math:`c_t = g_t + \gamma \frac{\beta_1}{1-\beta_1}
(g_t - g_{t-1})`, clipped to norm 1 per leaf. `scale_by_mars` is that correction alone, so
``chain(scale_by_mars(...), scale_by_adam(...))`` is MARS-AdamW and
``chain(scale_by_mars(...), scale_by_lion(b1, b1))`` is MARS-Lion (`opttx.mars` builds both).
The clipping norm is a statistic of a whole leaf; it is taken in the three steps of
docs/design.md, rule 6 (local sum of squares, `opttx.base.reduce_statistics`, square root),
so it is exact on tensor-parallel shards.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._checks import check_nonnegative, check_positive, check_unit_interval
from ..base import (ELEMENTWISE, GradientTransformation, HyperRole, LEAFWISE, Params, Role,
                    Updates, check_init_params, declare, declare_roles, keep_copy,
                    reduce_leaf_statistics, replace_state)
from ..kernels import cast_like, foreach, foreach_op_, foreach_sum_of_squares, mark_scratch
from ..skeleton import leafwise
from ..tree import Static, stats_like

__all__ = ["ScaleByMarsState", "scale_by_mars"]


class ScaleByMarsState(NamedTuple):
    """State of `scale_by_mars`."""
    prev_grad: Updates   # like params (fp32 for 16-bit leaves): the previous step's input
                         #   g_{t-1} (zero before the first step)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(prev_grad=Role.FIRST_MOMENT)


@declare(hyperparams={"gamma": None, "b1": HyperRole.B1, "max_norm": None})
def scale_by_mars(gamma: float = 0.025, b1: float = 0.95, max_norm: float | None = 1.0,
                  state_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""MARS's variance-reduced gradient :math:`c_t`, clipped per leaf.

    .. math::
        \tilde c_t = g_t + \gamma \frac{\beta_1}{1-\beta_1} (g_t - g_{t-1}), \qquad
        c_t = \tilde c_t / \max\!\big(1, \lVert \tilde c_t \rVert_2 / \tau\big)

    with :math:`g_0 = 0` (the first step scales :math:`g_1` by
    :math:`1 + \gamma\beta_1/(1-\beta_1)`, as the paper's code, ``pytorch_optimizer.MARS``
    and ``heavyball`` all do) and the norm taken over each leaf (:math:`\tau` = ``max_norm``,
    1 in the paper). Put it in front of Adam (MARS-AdamW: Adam's both moments are of
    :math:`c_t`) or Lion with :math:`\beta_2 = \beta_1` (MARS-Lion: the sign of the EMA of
    :math:`c_t`); ``b1`` here should be the momentum of that optimizer. The state is the raw
    input :math:`g_t`, not :math:`c_t`.

    ``heavyball``'s ``mars=True`` differs: it does not clip, and it passes its
    ``mars_gamma`` and ``beta1`` to its correction in swapped places, so its coefficient is
    :math:`\beta_1 \gamma_h / (1-\gamma_h)`. Its correction is this transform's with
    ``max_norm=None`` and ``gamma`` :math:`= \gamma_h (1-\beta_1)/(1-\gamma_h)`.

    Args:
      gamma: :math:`\gamma` >= 0, the strength of the correction (0: the gradient, clipped).
      b1: :math:`\beta_1` in [0, 1), the momentum of the optimizer that follows.
      max_norm: :math:`\tau` > 0, the largest per-leaf norm of :math:`c_t` (None: no
        clipping; the transform is then element-wise).
      state_dtype: dtype of :math:`g_{t-1}` (default: the parameter's, fp32 for 16-bit).

    Returns:
      A `GradientTransformation` whose state is a `ScaleByMarsState`.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_mars(gamma=0.025, b1=0.95),
      ...                  opttx.scale_by_adam(b1=0.95, b2=0.99),
      ...                  opttx.scale_by_learning_rate(3e-3))        # = opttx.mars(3e-3)

    References:
      Yuan, Liu, Wu, Zhou, Gu, MARS: Unleashing the Power of Variance Reduction for
      Training Large Models (arXiv 2411.10438).
    """
    check_nonnegative("gamma", gamma)
    check_unit_interval("b1", b1)
    if max_norm is not None:
        check_positive("max_norm", max_norm)
    coef = gamma * b1 / (1 - b1)

    def init(params: Params) -> ScaleByMarsState:
        check_init_params(params)
        return ScaleByMarsState(prev_grad=stats_like(params, state_dtype))

    def step(g: list[torch.Tensor], state: ScaleByMarsState, params: None,
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], ScaleByMarsState]:
        prev = state.prev_grad
        gs = cast_like(g, prev)
        c = foreach_op_("add", foreach_op_("mul", foreach("sub", gs, prev), coef), gs)
        if max_norm is not None:
            c = _clip_per_leaf(c, max_norm, extra_args)
        new_prev = keep_copy(g, prev)       # the state must not alias the caller's gradient
        return mark_scratch(cast_like(c, g)), replace_state(state, prev_grad=new_prev)

    return GradientTransformation(init, leafwise(ScaleByMarsState, step, name="scale_by_mars"),
                                  ELEMENTWISE if max_norm is None else LEAFWISE)


def _clip_per_leaf(c: list[torch.Tensor], max_norm: float, extra_args: dict
                   ) -> list[torch.Tensor]:
    """``c / max(1, ‖c‖ / max_norm)`` per leaf (``c`` temporaries, overwritten): (a) local sums
    of squares, (b) summed over the shards of sharded leaves, (c) the root and the division."""
    sums = foreach_sum_of_squares(c)                                              # (a)
    sums = reduce_leaf_statistics(sums, extra_args)                               # (b)
    denom = foreach_op_("clamp_min", foreach_op_("div", foreach("sqrt", sums), max_norm),
                        1.0)                                                        # (c)
    return foreach_op_("div", c, cast_like(denom, c))
