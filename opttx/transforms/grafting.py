"""Meta's grafting and filtered gradient (Distributed Shampoo, arXiv 2309.06497).

* `graft` gives, block by block, the direction of one transform the norm of another (the
  "grafted" method, SGD/Adagrad/RMSprop/Adam), and runs the grafted method alone before
  preconditioning starts. It also owns Meta's filtered gradient (`filtered_gradient`, an EMA
  with ``beta1``), which both transforms precondition while their statistics see the raw
  gradient.
* `scale_by_grafted_diagonal` is Meta's diagonal grafted method, op for op.
* `meta_bias_correction` is Meta's float32 bias-correction scalar, used by these and by
  `precondition_shampoo` and `precondition_eigenvalue_corrected`.

A transform used inside `graft` computes its statistics from ``updates`` (the raw gradient) and
preconditions ``extra_args[PRECONDITION_INPUT]`` when it is given (`scale_by_rms`,
`scale_by_rss`, `scale_by_grafted_diagonal` and `precondition_shampoo` honour it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._checks import check_gradient_leaves, check_nonnegative, check_unit_interval
from ..base import (GradientTransformation, HyperRole, PRECONDITIONER, PRECONDITION_INPUT, Params,
                    Role, Updates, advance_counts, check_init_params, combine_traits, declare,
                    declare_roles, precondition_target, reduce_statistics, safe_increment,
                    traits_of, zero_count)
from ..kernels import cast_like, foreach, foreach_, foreach_ema, foreach_sum_of_squares
from ..tree import (Static, flatten_matching, state_dtype, stats_like, tree_flatten,
                    tree_unflatten)

__all__ = [
    "DiagonalGraftState",
    "GraftState",
    "filtered_gradient",
    "graft",
    "meta_bias_correction",
    "scale_by_grafted_diagonal",
]


def meta_bias_correction(beta: float, count: torch.Tensor, shift: int = 0,
                         scale: float = 1.0) -> torch.Tensor:
    r"""Meta's bias-correction scalar :math:`1 - s\,\beta^{t - \text{shift}}`, computed as
    Distributed Shampoo computes it: a float32 ``torch.pow`` of :math:`\beta` (rounded to
    float32) and the step, even for float64 factors. For :math:`\beta = 0.999`, :math:`t = 1`
    it is :math:`1 - \mathrm{fl}_{32}(0.999) = 0.00099998713`, 1.3e-5 relative away from
    0.001; `precondition_shampoo` and `graft` use it so that their numbers equal Meta's."""
    power = torch.pow(beta, count - shift if shift else count)   # float32, as Meta's
    return 1.0 - (scale * power if isinstance(scale, torch.Tensor) or scale != 1.0 else power)


def filtered_gradient(m: list[torch.Tensor], g: list[torch.Tensor], beta1: Any,
                       beta3: Any, count: torch.Tensor, bias_correction: bool
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    r"""Meta's filtered gradient, for the leaves ``m`` of its EMA and the gradients ``g``:
    :math:`\tilde G_t = \beta_1 \tilde G_{t-1} + (1 - \beta_1) G_t` (the new ``m``) and
    :math:`\bar G_t = (\beta_3 \tilde G_{t-1} + (1 - \beta_3) G_t) / (1 - \beta_3
    \beta_1^{t-1})` (:math:`\bar G_t = \tilde G_t / (1 - \beta_1^t)` when
    :math:`\beta_3 = \beta_1`; no division without ``bias_correction``), the correction
    computed as Meta's (`meta_bias_correction`). Used by `graft` and by
    `precondition_eigenvalue_corrected`'s own EMA (in whichever basis ``m`` and ``g`` are)."""
    g = cast_like(g, m)
    same = beta3 is beta1 or (not isinstance(beta3, torch.Tensor)
                              and not isinstance(beta1, torch.Tensor) and beta3 == beta1)
    bar = None if same else foreach("lerp", m, g, 1 - beta3)
    m = foreach_ema(m, g, beta1)
    bar = list(m) if bar is None else bar
    if bias_correction:
        bar = foreach("div", bar, meta_bias_correction(beta1, count, shift=1, scale=beta3))
    return m, bar


class GraftState(NamedTuple):
    """State of `graft`."""
    count: torch.Tensor    # shape (), int32: steps taken
    filtered: Updates      # like params (fp32 for 16-bit leaves): EMA of the gradient with
                           # beta1 (empty if beta1 = 0)
    magnitude: Any         # the magnitude (grafted) transform's state
    direction: Any         # the direction transform's state
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, filtered=Role.FIRST_MOMENT)


@declare(hyperparams={"beta1": HyperRole.B1, "beta3": None},
         runtime=("start_preconditioning_step",))
def graft(magnitude: GradientTransformation | None, direction: GradientTransformation,
          start_preconditioning_step: int = 0, beta1: float = 0.0,
          use_bias_correction: bool = True, rescale: bool = True,
          beta3: float | None = None) -> GradientTransformation:
    r"""Give ``direction``'s update, leaf by leaf, the norm of ``magnitude``'s.

    .. math::
        \tilde G_t = \beta_1 \tilde G_{t-1} + (1 - \beta_1) G_t, \quad
        \bar G_t = \frac{\beta_3 \tilde G_{t-1} + (1 - \beta_3) G_t}{1 - \beta_3 \beta_1^{t-1}},
        \quad
        P_t = \begin{cases} M(\bar G_t) & t < t_0 \\
        D(\bar G_t)\, \lVert M(\bar G_t) \rVert / (\lVert D(\bar G_t) \rVert + 10^{-16})
        & t \ge t_0 \end{cases}

    (:math:`\beta_3 = \beta_1` by default, when :math:`\bar G_t = \tilde G_t / (1 - \beta_1^t)`;
    no division without ``use_bias_correction``; :math:`\bar G_t = G_t` when
    :math:`\beta_1 = 0`.) This is Meta's filtered gradient and grafting, the bias correction
    computed as Meta computes it (`meta_bias_correction`). Both transforms update their
    statistics every step from the raw gradient :math:`G` (``updates``) and precondition the
    filtered gradient :math:`\bar G` (passed to them as ``extra_args[PRECONDITION_INPUT]``).
    ``magnitude=None`` grafts SGD (:math:`M = I`). Leaves are blocks when used inside
    `block_by_dims`, so norms are per block, as Meta's. The filtered gradient of 16-bit
    leaves is kept in float32 (docs/design.md, rule 3), and 16-bit gradients are cast to float32
    before both transforms see them, so the magnitude, the direction and the rescale are
    computed in float32 (a direction may hold entries far beyond float16's range that the
    rescale brings back); the update comes back in the gradient's dtype.

    Args:
      magnitude: the grafted method: ``scale_by_rms(decay=β2, eps, eps_in_sqrt=False,
        bias_correction=True)`` for Adam, without bias correction for RMSprop,
        ``scale_by_rss(0.0, eps, eps_in_sqrt=False)`` for Adagrad, None for SGD
        (`opttx.shampoo` uses the same methods computed op for op as Meta's).
      direction: the preconditioner, usually `precondition_shampoo`.
      start_preconditioning_step: :math:`t_0`; before it the grafted method runs alone.
      beta1: the EMA of the gradient (0: none).
      use_bias_correction: divide the EMA by :math:`1 - \beta_3 \beta_1^{t-1}`.
      rescale: False keeps the direction's own norm (Shampoo without grafting: before
        :math:`t_0` the update is then :math:`\bar G_t`).
      beta3: Meta's ``beta3``, the weight of the current gradient in the preconditioned
        average (default ``beta1``).

    Example:
      >>> tx = opttx.graft(None, opttx.precondition_shampoo(), beta1=0.9)
    """
    check_unit_interval("beta1", beta1)
    b3 = beta1 if beta3 is None else beta3
    check_unit_interval("beta3", b3)
    check_nonnegative("start_preconditioning_step", start_preconditioning_step)
    if beta1:
        # with a filter, the preconditioned input differs from the raw gradient: a transform
        # that does not read PRECONDITION_INPUT would silently precondition the raw gradient
        for role, tx in (("magnitude", magnitude), ("direction", direction)):
            if tx is not None and not traits_of(tx).takes_precondition_input:
                raise ValueError(
                    f"graft: the {role} transform does not declare "
                    "Traits(takes_precondition_input=True), so with beta1 > 0 it would "
                    "precondition the raw gradient instead of the filtered one. Use a "
                    "transform that reads opttx.base.precondition_target(updates, "
                    "extra_args) (and declares the trait), or beta1=0.")

    def init(params: Params) -> GraftState:
        count = zero_count(params)
        filtered = stats_like(params) if beta1 else ()
        return GraftState(count=count, filtered=filtered,
                          magnitude=magnitude.init(params) if magnitude is not None else (),
                          direction=direction.init(params))

    def update(updates: Updates, state: GraftState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, GraftState]:
        spec, g = flatten_matching(updates)
        if not g:             # a tree without leaves: only the step counters move
            return updates, advance_counts(state)
        leaves = g
        # an int gradient would give zero updates; complex, sparse or None ones torch errors
        check_gradient_leaves(g, None, updates, "graft")
        if any(x.dtype != state_dtype(x) for x in g):
            # 16-bit gradients: both methods and the rescale run in float32 and only the
            # grafted update is cast back. A direction of unit norm per element in exact
            # arithmetic may hold entries of 1e5 (Adam in an eigenbasis, where the squared
            # gradient is a rounding error): inf in float16, and inf times the rescale's 0 is
            # NaN, while the grafted update itself has the magnitude's (finite) norm.
            g = [x.to(state_dtype(x)) for x in g]
            updates = tree_unflatten(g, spec)
        count = safe_increment(state.count)
        filtered = state.filtered
        if beta1:
            _, m = flatten_matching(updates, state.filtered)[1:]
            check_gradient_leaves(g, m, updates, "graft")      # shaped like the blocks
            m, bar = filtered_gradient(m, g, beta1, b3, count, use_bias_correction)
            filtered = tree_unflatten(m, spec)
        else:
            bar = list(g)
        bar_tree = tree_unflatten(bar, spec)
        extra = {**extra_args, PRECONDITION_INPUT: bar_tree}
        if magnitude is not None:
            mag, mag_state = magnitude.update(updates, state.magnitude, params, **extra)
        else:
            mag, mag_state = bar_tree, ()
        dirn, dir_state = direction.update(updates, state.direction, params, **extra)
        mag_l, dir_l = flatten_matching(mag)[1], flatten_matching(dirn)[1]
        # (a) local sums of squares of both, (b) one batched reduction, (c) finish
        sq = foreach_sum_of_squares
        m_sq, d_sq = reduce_statistics((tree_unflatten(sq(mag_l), spec),
                                        tree_unflatten(sq(dir_l), spec)), extra_args)
        grafting = count < start_preconditioning_step
        out = []
        for g_i, m_i, d_i, ms, ds in zip(leaves, mag_l, dir_l, tree_flatten(m_sq)[0],
                                         tree_flatten(d_sq)[0]):
            scaled = d_i * (torch.sqrt(ms) / (torch.sqrt(ds) + 1e-16)).to(d_i.dtype) \
                if rescale else d_i
            out.append(torch.where(grafting, m_i, scaled).to(g_i.dtype))
        return tree_unflatten(out, spec), GraftState(count=count, filtered=filtered,
                                                     magnitude=mag_state, direction=dir_state,
                                                     made_by=state.made_by)

    return GradientTransformation(init, update, combine_traits(
        (direction,) if magnitude is None else (magnitude, direction),
        elementwise=False, per_leaf=True))


class DiagonalGraftState(NamedTuple):
    """State of `scale_by_grafted_diagonal`."""
    count: torch.Tensor    # shape (), int32: steps taken
    nu: Updates            # like params (fp32 for 16-bit leaves): sum or EMA of squares
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, nu=Role.SECOND_MOMENT)


# saved states name these classes by the module that defined them before grafting had a
# module of its own (torch.save pickles the class's __module__): weights_only loading of a
# state saved then, and now, finds them there (opttx.transforms.shampoo re-exports both)
GraftState.__module__ = DiagonalGraftState.__module__ = "opttx.transforms.shampoo"


@declare(hyperparams={"beta2": HyperRole.B2, "epsilon": HyperRole.EPS, "weighting_factor": None})
def scale_by_grafted_diagonal(beta2: float = 1.0, epsilon: float = 1e-10,
                              weighting_factor: float = 1.0,
                              use_bias_correction: bool = False) -> GradientTransformation:
    r"""Meta's diagonal grafting preconditioner (its ``AdagradPreconditionerList``), op for op.

    .. math::
        \nu_t = \beta_2 \nu_{t-1} + w\, g_t^2, \qquad
        u_t = \bar g_t / (\sqrt{\nu_t / b_t} + \epsilon)

    with :math:`b_t = 1 - \beta_2^t` computed as Meta does (`meta_bias_correction`) when
    ``use_bias_correction``, else 1. Adagrad: ``(1.0, eps, 1.0, False)``; RMSprop:
    ``(β2, eps, 1 − β2, False)``; Adam: ``(β2, eps, 1 − β2, True)``. The statistics come
    from ``updates``, the division applies to ``extra_args[PRECONDITION_INPUT]`` inside
    `graft`. Statistics of 16-bit leaves are float32 (Meta keeps them in the parameter's
    dtype).

    Example:
      >>> adam_graft = opttx.scale_by_grafted_diagonal(0.999, 1e-8, 0.001, True)
    """
    check_unit_interval("beta2", beta2, closed_right=True)
    check_nonnegative("epsilon", epsilon)
    injected = isinstance(beta2, torch.Tensor)     # inject_hyperparams: its value may change
    correct = use_bias_correction and (injected or beta2 < 1)

    def init(params: Params) -> DiagonalGraftState:
        check_init_params(params)
        return DiagonalGraftState(count=zero_count(params), nu=stats_like(params))

    def update(updates: Updates, state: DiagonalGraftState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, DiagonalGraftState]:
        spec, g = flatten_matching(updates)
        if not g:
            return updates, advance_counts(state)
        nu = flatten_matching(updates, state.nu)[2]
        check_gradient_leaves(g, nu, updates, "scale_by_grafted_diagonal")
        count = safe_increment(state.count)
        nu = foreach("mul", nu, beta2) if injected or beta2 != 1 else list(nu)
        nu = foreach("addcmul", nu, cast_like(g, nu), cast_like(g, nu), value=weighting_factor)
        if correct:
            b = meta_bias_correction(beta2, count)
            if injected:    # a sum (beta2 = 1) is not corrected
                b = torch.where(beta2 < 1, b, torch.ones_like(b))
            denom = foreach_("sqrt", foreach("div", nu, b))
        else:
            denom = foreach("sqrt", nu)      # new tensors: nu is the state
        foreach_("add", denom, epsilon)
        x = flatten_matching(precondition_target(updates, extra_args))[1]
        out = cast_like(foreach("div", cast_like(x, denom), denom), g)
        return tree_unflatten(out, spec), DiagonalGraftState(count=count,
                                                             nu=tree_unflatten(nu, spec),
                                                             made_by=state.made_by)

    return GradientTransformation(init, update, PRECONDITIONER)
