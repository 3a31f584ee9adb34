"""Clipping transforms: elementwise, by global norm, by block RMS, and NaN zeroing.

The norm-based ones are layer-wise reductions written in the three steps of docs/design.md,
rule 6: (a) local partial statistics of every leaf, (b) one call to `opttx.base.reduce_statistics`
(a no-op unless the chain runs under `opttx.distributed.sharded`), (c) finish.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._checks import check_nonnegative, check_positive
from ..base import (ELEMENTWISE, GradientTransformation, LEAFWISE, Params, Role, Traits, Updates,
                    check_init_params, declare, declare_roles, reduce_across_leaves,
                    reduce_leaf_statistics, reduce_statistics, replace_state,
                    stateless_with_extra_args)
from ..kernels import foreach, foreach_op_, foreach_scale, foreach_sum_of_squares
from ..skeleton import leafwise
from ..tree import PyTree, Static, flatten_matching, tree_map, tree_unflatten
from .common import stateless_leafwise

__all__ = [
    "ZeroNansState",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "global_norm",
    "zero_nans",
]


@declare(hyperparams={"max_delta": None})
def clip(max_delta: float) -> GradientTransformation:
    r"""Clamp every element of the updates to :math:`[-\delta, \delta]`."""
    check_nonnegative("max_delta", max_delta)

    def clipped(g: list[torch.Tensor], params: None, extra_args: dict) -> list[torch.Tensor]:
        return foreach_op_("minimum", foreach("maximum", g, -max_delta), max_delta)

    return stateless_leafwise("clip", clipped, ELEMENTWISE)


def _sum_of_squares(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-leaf local sum of squares in fp32 (fp64 for fp64 leaves)."""
    if not leaves:
        return []
    return foreach_sum_of_squares(leaves)


def global_norm(updates: PyTree, extra_args: dict[str, Any] | None = None) -> torch.Tensor:
    r"""The L2 norm of all leaves together, :math:`\sqrt{\sum_\ell \lVert g_\ell \rVert^2}`,
    reduced over shards when run under `opttx.distributed.sharded`."""
    spec, g = flatten_matching(updates)
    partials = _sum_of_squares(g)                                            # (a)
    partials = reduce_statistics(tree_unflatten(partials, spec), extra_args or {})  # (b)
    flat = flatten_matching(partials)[1]
    total = torch.stack(flat).sum() if flat else torch.zeros(())
    # (c') leaves held by other ranks (whole leaves on owner ranks); a rank holding no leaf
    # still takes part
    total = reduce_across_leaves(total, extra_args or {})
    return torch.sqrt(total)                                                 # (c)


@declare(hyperparams={"max_norm": None})
def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    r"""Scale all updates down together when their global norm exceeds ``max_norm``.

    .. math::
        u_t = g_t \cdot \min\!\left(1, \frac{c}{\lVert g_t \rVert_2}\right)

    with the norm over all leaves (as ``optax.clip_by_global_norm``; torch's
    ``clip_grad_norm_`` adds 1e-6 to the norm).

    References:
      Pascanu, Mikolov and Bengio, ICML 2013.
    """
    check_positive("max_norm", max_norm)

    def clip_fn(updates: Updates, params: Params | None, extra_args: dict) -> Updates:
        spec, g = flatten_matching(updates)
        norm = global_norm(updates, extra_args)     # also with no leaf: see reduce_across_leaves
        if not g:
            return updates
        factor = torch.where(norm < max_norm, torch.ones_like(norm), max_norm / norm)
        return tree_unflatten(foreach_scale(g, factor), spec)

    return stateless_with_extra_args(clip_fn, Traits(across_leaves=True))


@declare(hyperparams={"threshold": None})
def clip_by_block_rms(threshold: float) -> GradientTransformation:
    r"""Clip every leaf (block) to a root mean square of at most ``threshold``.

    .. math::
        u = g / \max\!\left(1, \mathrm{RMS}(g) / d\right)

    This is Adafactor's update clipping (``clip_by_block_rms`` in optax).

    References:
      Shazeer and Stern, Adafactor (arXiv 1804.04235).
    """
    check_positive("threshold", threshold)

    def clipped(g: list[torch.Tensor], params: None, extra_args: dict) -> list[torch.Tensor]:
        # (a) local sum of squares and element count of each leaf, one 2-vector per leaf
        sums = _sum_of_squares(g)
        partials = [torch.stack([s, torch.full_like(s, x.numel())]) for s, x in zip(sums, g)]
        # (b) combine over shards
        partials = reduce_leaf_statistics(partials, extra_args)
        # (c) finish
        rms = [torch.sqrt(p[0] / p[1]) for p in partials]
        denom = [torch.clamp(r / threshold, min=1.0) for r in rms]
        return foreach("div", g, denom)

    return stateless_leafwise("clip_by_block_rms", clipped, LEAFWISE)


class ZeroNansState(NamedTuple):
    """State of `zero_nans`."""
    found_nan: PyTree  # like params, 0-dim bool: whether the leaf's last update had a NaN
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(found_nan=Role.PER_LEAF_SCALAR)


@declare()
def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by zeros, recording per leaf whether any were found."""

    def init(params: Params) -> ZeroNansState:
        check_init_params(params)
        return ZeroNansState(found_nan=tree_map(
            lambda p: torch.zeros((), dtype=torch.bool, device=p.device), params))

    def step(g: list[torch.Tensor], state: ZeroNansState, params: None,
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], ZeroNansState]:
        nans = [torch.isnan(x) for x in g]
        out = [torch.where(n, torch.zeros_like(x), x) for n, x in zip(nans, g)]
        return out, replace_state(state, found_nan=[n.any() for n in nans])

    # no check of the gradients: zero_nans takes whatever torch.isnan takes
    return GradientTransformation(init, leafwise(ZeroNansState, step, name="zero_nans",
                                                 per_leaf_roles=(Role.PER_LEAF_SCALAR,),
                                                 check_shapes=None), ELEMENTWISE)
