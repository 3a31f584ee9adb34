r"""Prodigy: Adam whose step size is a distance-to-solution estimate learned on the fly.

Its estimate :math:`d` is a ratio of two sums over *all* leaves (a weighted inner product of
the gradients with the distance travelled, and the L1 norm of a weighted gradient sum), so
the transform crosses leaves. Both sums are taken in the three steps of docs/design.md, rule
6: (a) local partial sums per leaf, (b) one `opttx.base.reduce_statistics` call (sums over
the shards of sharded leaves), (c) the local sum over leaves, combined over ranks holding
other leaves by one `opttx.base.reduce_across_leaves` call: exact when sharded.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .._checks import (check_gradient_leaves, check_learning_rate, check_nonnegative,
                       check_positive, check_unit_interval)
from ..base import (LEAF_SPEC_KEY, GradientTransformation, HyperRole, Params, Role, Traits,
                    Updates, check_init_params, declare, declare_roles, reduce_across_leaves,
                    reduce_statistics, replace_state, safe_increment, zero_count)
from ..kernels import (Scalar, cast_like, foreach, foreach_, foreach_ema, foreach_ema_sq,
                       foreach_norm, foreach_scale_add, mark_scratch)
from ..schedules import Schedule
from ..skeleton import as_tree, leafwise
from ..tree import Static, stats_like, tree_flatten, tree_map, tree_unflatten
from .common import float64_power

__all__ = ["ProdigyState", "scale_by_prodigy"]


class ProdigyState(NamedTuple):
    """State of `scale_by_prodigy`."""
    count: torch.Tensor         # shape (), int32: steps taken
    exp_avg: Updates            # like params (fp32 for 16-bit leaves): EMA of d * g
    exp_avg_sq: Updates         # like params (fp32 for 16-bit leaves): EMA of (d * g)^2
    grad_sum: Updates           # like params (fp32 for 16-bit leaves): beta3-weighted sum of
                                #   d * lr_t * d * g / d0 (the denominator's vector)
    params0: Updates            # like params (fp32 for 16-bit leaves): the initial point
    estim_lr: torch.Tensor      # shape (), float32 (float64 for float64 params): d
    numerator_weighted: torch.Tensor  # shape (), like estim_lr: beta3-weighted numerator
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, exp_avg=Role.FIRST_MOMENT,
                              exp_avg_sq=Role.SECOND_MOMENT, grad_sum=Role.FIRST_MOMENT,
                              params0=Role.PARAMS_LIKE, estim_lr=Role.SCALAR,
                              numerator_weighted=Role.SCALAR)


def _scalar_dtype(leaves: list[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "beta3": None,
                      "eps": HyperRole.EPS, "estim_lr0": None, "estim_lr_coef": None,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "growth_rate": None})
def scale_by_prodigy(learning_rate: float | Schedule = 1.0,
                     betas: tuple[float, float] = (0.9, 0.999), beta3: float | None = None,
                     eps: float = 1e-8, estim_lr0: float = 1e-6, estim_lr_coef: float = 1.0,
                     weight_decay: float = 0.0, safeguard_warmup: bool = False,
                     growth_rate: float = math.inf, *, flip_sign: bool = False
                     ) -> GradientTransformation:
    r"""Prodigy's step: Adam on :math:`d_t g_t`, scaled by the estimate :math:`d_t`.

    With :math:`t` the 1-based step, :math:`\eta_t` = ``learning_rate`` at the 0-based step,
    :math:`\lambda_t = d_t \eta_t \sqrt{1-\beta_2^t} / (1-\beta_1^t)` and :math:`x_0` the
    initial parameters:

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) d_t g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) d_t^2 g_t^2,

    .. math::
        s_t = \beta_3 s_{t-1} + \frac{\lambda_t}{d_0} d_t g_t, \qquad
        r_t = \beta_3 r_{t-1} + \frac{d_t}{d_0} \lambda_t \langle g_t, x_0 - x_t\rangle,

    .. math::
        \hat d_t = c\, \frac{r_t}{\lVert s_t \rVert_1}, \qquad
        d_{t+1} = \max\!\big(d_t, \min(\hat d_t, \gamma\, d_t)\big), \qquad
        u_t = \lambda_t \left(\frac{m_t}{\sqrt{v_t} + d_{t+1}\epsilon} + w\, x_t\right)

    (:math:`c` = ``estim_lr_coef``, :math:`\gamma` = ``growth_rate``, :math:`w` =
    ``weight_decay``; with ``safeguard_warmup`` :math:`s_t` uses :math:`d_t` in place of
    :math:`\lambda_t`, so a warm-up of :math:`\eta` does not shrink the denominator). The
    inner product and the L1 norm run over all leaves; when sharded they are reduced over
    shards and ranks (module docstring). Equal to ``optax.contrib.prodigy`` (which returns
    :math:`-u_t`: ``flip_sign=True``) for ``growth_rate=inf``.

    Args:
      learning_rate: :math:`\eta`, the schedule's multiplier of the estimate (1.0: the
        estimate itself; a number, 0-dim tensor or schedule of the 0-based step).
      betas: :math:`(\beta_1, \beta_2)` of the underlying Adam, in [0, 1).
      beta3: :math:`\beta_3` of the estimate's sums (default :math:`\sqrt{\beta_2}`).
      eps: :math:`\epsilon`, scaled by the estimate in the denominator.
      estim_lr0: :math:`d_0` > 0, the initial (under-)estimate.
      estim_lr_coef: :math:`c`, multiplies every estimate.
      weight_decay: :math:`w`, decoupled weight decay scaled by :math:`\lambda_t`.
      safeguard_warmup: leave :math:`\eta_t` out of the denominator's sum :math:`s_t`.
      growth_rate: :math:`\gamma` >= 1, the largest factor by which :math:`d` may grow in one
        step (``prodigyopt``'s ``growth_rate``; inf: unbounded, as optax).
      flip_sign: return :math:`-u_t` (a descent step, as `opttx.prodigy`) instead of
        :math:`u_t`.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_prodigy(), opttx.scale(-1.0))   # = opttx.prodigy()

    References:
      Mishchenko and Defazio, Prodigy: An Expeditiously Adaptive Parameter-Free Learner
      (arXiv 2306.06101).
    """
    check_learning_rate(learning_rate)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}.")
    b1, b2 = betas
    check_unit_interval("betas[0]", b1)
    check_unit_interval("betas[1]", b2)
    if beta3 is None:
        beta3 = b2 ** 0.5
    check_unit_interval("beta3", beta3)
    check_nonnegative("eps", eps)
    check_positive("estim_lr0", estim_lr0)
    check_nonnegative("estim_lr_coef", estim_lr_coef)
    check_nonnegative("weight_decay", weight_decay)
    check_positive("growth_rate", growth_rate)
    if isinstance(growth_rate, (int, float)) and growth_rate < 1:
        raise ValueError(f"growth_rate must be >= 1 (d never decreases), got {growth_rate}.")
    sign = -1.0 if flip_sign else 1.0

    def init(params: Params) -> ProdigyState:
        return _init_prodigy(params, estim_lr0)

    def step(g: list[torch.Tensor], state: ProdigyState, p: list[torch.Tensor],
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], ProdigyState]:
        spec = extra_args[LEAF_SPEC_KEY]
        m, v, s, p0 = state.exp_avg, state.exp_avg_sq, state.grad_sum, state.params0
        # a state made by init on other params: refused naming the leaf and the field, before
        # torch's broadcasting error (or a silent broadcast of a 1-row state)
        for field, leaves in (("exp_avg", m), ("exp_avg_sq", v), ("grad_sum", s),
                              ("params0", p0)):
            check_gradient_leaves(g, leaves, as_tree(g, extra_args), f"ProdigyState.{field}")
        d = state.estim_lr
        dtype = d.dtype
        t = safe_increment(state.count).to(torch.float64)     # the 1-based step
        sched = learning_rate(state.count) if callable(learning_rate) else learning_rate
        bc = torch.sqrt(1 - float64_power(b2, t)) / (1 - float64_power(b1, t))
        dlr = (d * _as(sched, d) * bc).to(dtype)
        d_over_d0 = d / _as(estim_lr0, d)

        dots: list[torch.Tensor] = []
        l1: list[torch.Tensor] = []
        if g:      # (a rank holding no leaf still takes part in the reductions below)
            s_scale = d_over_d0 if safeguard_warmup else dlr / _as(estim_lr0, d)
            m, v, s, dots, l1 = _moments_and_partials(g, m, v, s, p0, p, d, (b1, b2, beta3),
                                                      s_scale)
        # (b) over the shards of sharded leaves
        dots, l1 = reduce_statistics((tree_unflatten(dots, spec), tree_unflatten(l1, spec)),
                                     extra_args)
        dots, l1 = tree_flatten(dots)[0], tree_flatten(l1)[0]
        # (c) over leaves, and over ranks holding other leaves (one collective)
        local = torch.stack([torch.stack(dots).sum() if dots else d.new_zeros(()),
                             torch.stack(l1).sum() if l1 else d.new_zeros(())])
        numerator_acum, denominator = reduce_across_leaves(local, extra_args)
        numerator = beta3 * state.numerator_weighted + (d_over_d0 * dlr * numerator_acum
                                                        ).to(dtype)
        d_hat = _as(estim_lr_coef, d) * numerator / denominator
        if not (isinstance(growth_rate, float) and math.isinf(growth_rate)):
            d_hat = torch.minimum(d_hat, d * _as(growth_rate, d))
        # all gradients zero so far (or no leaf anywhere): keep d (optax's 0/0 gives NaN)
        new_d = torch.where(denominator > 0, torch.maximum(d, d_hat), d)

        out = _prodigy_updates(g, m, v, p, new_d, dlr, _as(eps, d), weight_decay, sign) \
            if g else []
        return out, replace_state(state, exp_avg=m, exp_avg_sq=v, grad_sum=s, estim_lr=new_d,
                                  numerator_weighted=numerator)

    # the schedule reads the 0-based step; a rank without leaves runs the step (the
    # reductions above are collective): the state's Role.SCALAR fields make leafwise do so
    update = leafwise(ProdigyState, step, needs_params="scale_by_prodigy",
                      name="scale_by_prodigy", check_shapes="params", zero_based_count=True)
    return GradientTransformation(init, update, Traits(across_leaves=True))


def _init_prodigy(params: Params, estim_lr0: Scalar) -> ProdigyState:
    """The state at step 0: zero moments and sum, the initial parameters, d = d0."""
    check_init_params(params)
    count = zero_count(params)
    dtype = _scalar_dtype(tree_flatten(params)[0])
    return ProdigyState(
        count=count, exp_avg=stats_like(params), exp_avg_sq=stats_like(params),
        grad_sum=stats_like(params),
        params0=tree_map(lambda p: p.detach().to(
            torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype,
            copy=True), params),
        estim_lr=torch.tensor(estim_lr0, dtype=dtype, device=count.device)
        if not isinstance(estim_lr0, torch.Tensor) else
        estim_lr0.detach().to(count.device, dtype).clone(),
        numerator_weighted=torch.zeros((), dtype=dtype, device=count.device))


def _moments_and_partials(g: list, m: list, v: list, s: list, p0: list, p: list,
                          d: torch.Tensor, betas: tuple, s_scale: Any) -> tuple:
    """The EMAs of d·g and (d·g)², the weighted sum s, and step (a) of the two global sums:
    per leaf <g, x0 − x> and ‖s‖₁."""
    b1, b2, beta3 = betas
    dtype = d.dtype
    gs = cast_like(g, m)
    dg = foreach("mul", gs, d)
    m = foreach_ema(m, dg, b1)
    v = foreach_ema_sq(v, dg, b2)
    s = foreach_scale_add(s, beta3, foreach_("mul", dg, s_scale))
    diff = foreach("sub", p0, cast_like(p, p0))
    dots = [torch.sum(a.to(dtype) * b.to(dtype)) for a, b in zip(gs, diff)]
    l1 = [x.to(dtype) for x in foreach_norm(s, 1, dtype=dtype)]
    return m, v, s, dots, l1


def _prodigy_updates(g: list, m: list, v: list, p: list, new_d: torch.Tensor,
                     dlr: torch.Tensor, eps: Any, weight_decay: Scalar, sign: float) -> list:
    """dlr · m / (√v + d·eps) (+ dlr · wd · x), negated for the alias, in the grads' dtype."""
    denom = foreach_("add", foreach("sqrt", v), new_d * eps)
    out = foreach_("mul", foreach("div", m, denom), dlr)
    if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
        out = foreach_("add", out, foreach("mul", cast_like(p, out),
                                           dlr * _as(weight_decay, new_d)))
    if sign < 0:
        out = foreach_("neg", out)
    return mark_scratch(cast_like(out, g))


def _as(value: Scalar, like: torch.Tensor) -> torch.Tensor | float:
    """``value`` (a number or a 0-dim tensor) usable with ``like``: tensors in its dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=like.dtype)
    return value
