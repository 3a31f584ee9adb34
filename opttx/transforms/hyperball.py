r"""Hyperball: every weight matrix and its update kept at fixed Frobenius norms, in place of
weight decay.

With :math:`u_t` the direction of a base optimizer (Adam's :math:`\hat m / \sqrt{\hat v}`,
Muon's orthogonalized momentum), :math:`\eta_t` the learning rate and :math:`R` the radius
of the leaf (its Frobenius norm at the first step, or a given number), Wen et al. step

.. math::
    W_{t+1} = R\, \mathrm{Normalize}\big(W_t - \eta_t R\, \mathrm{Normalize}(u_t)\big),
    \qquad \mathrm{Normalize}(x) = x / \lVert x \rVert_F,

so that :math:`\lVert W_{t+1} \rVert_F = R` and the step before the projection has length
:math:`\eta_t R` whatever the scale of :math:`u_t`. `hyperball_step` is that step as the last
link of a chain (it returns :math:`W_{t+1} - W_t`); `opttx.hyperball` puts it after any
direction, and `opttx.hyperball_muon`, `opttx.hyperball_adamw`, `opttx.hyperball_normuon`,
`opttx.hyperball_soap` are the published pairings (MuonH, AdamH, NorMuonH, SOAP-H).

The three norms a step needs are taken from one set of per-leaf statistics,
:math:`\lVert W \rVert^2`, :math:`\langle W, u \rangle` and :math:`\lVert u \rVert^2`
(:math:`\lVert W - a\,u/\lVert u\rVert \rVert^2 = \lVert W\rVert^2 - 2a\langle W,u\rangle
/\lVert u \rVert + a^2`), reduced in the three steps of docs/design.md, rule 6: one batched
collective per step under `opttx.distributed.sharded`, exact on tensor-parallel shards.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._checks import check_learning_rate, check_nonnegative, check_positive
from ..base import (LEAFWISE, GradientTransformation, HyperRole, Params, Role,
                    check_init_params, declare, declare_roles, reduce_leaf_statistics,
                    replace_state, zero_count)
from ..kernels import cast_like, foreach, foreach_op_, foreach_sum_of_squares, mark_scratch
from ..schedules import Schedule
from ..skeleton import leafwise
from ..tree import PyTree, Static, tree_map

__all__ = ["HyperballState", "hyperball_step"]


class HyperballState(NamedTuple):
    """State of `hyperball_step`."""
    count: torch.Tensor  # shape (), int32: steps taken (the schedule's 0-based argument)
    radius: PyTree       # like params, 0-dim float32 (float64 for float64 leaves): R of each
                         #   leaf; 0 until the first step measures it (radius=None)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, radius=Role.PER_LEAF_SCALAR)


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "eps": HyperRole.EPS})
def hyperball_step(learning_rate: float | Schedule, radius: float | None = None,
                   eps: float = 1e-12) -> GradientTransformation:
    r"""The Hyperball step: move each leaf by :math:`\eta R` along its normalized update, then
    project it back onto the sphere of radius :math:`R`.

    With :math:`W` a leaf of the params, :math:`u` its update (a direction, before any
    learning rate), :math:`a = \eta_t R`, :math:`\lVert\cdot\rVert` the Frobenius norm of the
    whole leaf:

    .. math::
        w = W - a\, \frac{u}{\max(\lVert u\rVert, \epsilon)}, \qquad
        W_{+} = R\, \frac{w}{\max(\lVert w\rVert, \epsilon)}, \qquad
        \text{returns } W_{+} - W

    (:math:`\lVert w \rVert` from the statistics of :math:`W` and :math:`u`, see the module).
    :math:`R` is the leaf's norm at the first step when ``radius`` is None (the paper's
    :math:`\lVert W_0 \rVert_F`), else ``radius`` for every leaf. No weight decay: the norm
    is held by the projection. A leaf of norm 0 with ``radius=None`` stays 0. Put it last in a
    chain, after the direction (`opttx.hyperball` does); the params are required. Leaves of
    three or more dims are one tensor each (under `opttx.stacked`, one matrix per slice);
    route vectors (biases, norm scales) and embeddings elsewhere with `opttx.partition`, as
    the aliases do.

    Args:
      learning_rate: :math:`\eta_t` (a number, a 0-dim tensor or a schedule of the 0-based
        step): the step's length relative to the radius, an angle in radians for small
        :math:`\eta`.
      radius: :math:`R` for every leaf, or None for each leaf's norm at the first step.
      eps: floor of the two norms divided by.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_adam(), opttx.hyperball_step(0.01))   # AdamH

    References:
      Wen, Dang, Lyu, Ma and Liang, Fantastic Pretraining Optimizers and Where to Find Them
      II: Hyperball Optimization (arXiv 2606.16899).
    """
    check_learning_rate(learning_rate)
    check_nonnegative("eps", eps)
    if radius is not None:
        check_positive("radius", radius)
        if isinstance(radius, torch.Tensor):
            raise TypeError("hyperball_step: radius must be a Python number or None (it is "
                            "configuration, stored in the state at init).")

    def init(params: Params) -> HyperballState:
        check_init_params(params)
        return HyperballState(count=zero_count(params), radius=tree_map(
            lambda p: torch.full((), 0.0 if radius is None else radius,
                                 dtype=_stat_dtype(p), device=p.device), params))

    def step(g: list[torch.Tensor], state: HyperballState, p: list[torch.Tensor],
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], HyperballState]:
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        dtypes = [_stat_dtype(x) for x in g]
        ps = [x.to(d) for x, d in zip(p, dtypes)]
        us = [x.to(d) for x, d in zip(g, dtypes)]
        # (a) per leaf: ||W||², <W, u>, ||u||² (one 3-vector per leaf)
        pp = foreach_sum_of_squares(ps)
        uu = foreach_sum_of_squares(us)
        pu = [torch.sum(x) for x in foreach("mul", ps, us)]
        partials = [torch.stack([a.to(d), b.to(d), c.to(d)])
                    for a, b, c, d in zip(pp, pu, uu, dtypes)]
        # (b) over the shards of sharded leaves
        partials = reduce_leaf_statistics(partials, extra_args)
        # (c) finish: W + c1 W + c2 u = (R / ||w||) (W - a u / ||u||)
        first = state.count == 0
        radii, c1, c2 = [], [], []
        for s, r in zip(partials, state.radius):
            w2, wu, u2 = s[0], s[1], s[2]
            big_r = torch.where(first, torch.sqrt(w2), r) if radius is None else r
            u_norm = torch.clamp(torch.sqrt(u2), min=eps)
            a = (lr * big_r).to(big_r.dtype)
            ww = w2 - 2 * a * wu / u_norm + a * a * u2 / (u_norm * u_norm)
            k = big_r / torch.clamp(torch.sqrt(torch.clamp(ww, min=0)), min=eps)
            radii.append(big_r)
            c1.append(k - 1)
            c2.append(-a * k / u_norm)
        out = foreach_op_("add", foreach("mul", ps, c1), foreach("mul", us, c2))
        return mark_scratch(cast_like(out, g)), replace_state(state, radius=radii)

    update = leafwise(HyperballState, step, needs_params="hyperball_step",
                      name="hyperball_step", per_leaf_roles=(Role.PER_LEAF_SCALAR,),
                      check_shapes="params", zero_based_count=True)
    return GradientTransformation(init, update, LEAFWISE)
