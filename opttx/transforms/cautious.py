r"""Cautious optimizers: `cautious` zeroes the update entries that disagree with the gradient.

Cautious (Liang et al., 2024) keeps an entry of the inner optimizer's update only where it
points the same way as the gradient's descent direction, and rescales each leaf by the
inverse of the fraction kept. That fraction is a mean over a whole leaf; it is taken in the
three steps of docs/design.md, rule 6 (local count of kept entries and of entries,
`opttx.base.reduce_statistics`, ratio), so it is exact on tensor-parallel shards.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .._checks import check_positive
from ..base import (GradientTransformation, Params, State, Updates, combine_traits, declare,
                    reduce_leaf_statistics)
from ..kernels import cast_like, foreach, foreach_op_, mark_scratch
from ..tree import flatten_matching, tree_unflatten

__all__ = ["cautious"]

Direction = Literal["descent", "gradient"]


@declare(hyperparams={"min_fraction": None})
def cautious(inner: GradientTransformation, direction: Direction = "descent",
             min_fraction: float | None = None) -> GradientTransformation:
    r"""Run ``inner``, zero the entries of its update that disagree in sign with the
    gradient, and rescale each leaf by the inverse of the fraction kept.

    With :math:`g` the updates given to this wrapper (the gradient, when it wraps the start
    of the chain; the mask is taken against this input, not against anything inside
    ``inner``), :math:`u` the update of ``inner`` and :math:`n` a leaf's size:

    .. math::
        \phi = \mathbb{1}[\,s\, u \odot g > 0\,], \qquad
        u' = u \odot \phi \cdot \frac{n}{\sum \phi + 1}
        \quad\Big(\text{or } \frac{n}{\max(\sum \phi,\ f\, n)} \text{ with }
        \texttt{min\_fraction} = f\Big)

    with :math:`s = -1` for ``direction="descent"`` (``inner`` returns the step added to the
    parameters, optax's convention: a kept entry moves against the gradient) and
    :math:`s = 1` for ``direction="gradient"`` (``inner`` returns a preconditioned gradient,
    before the learning rate: `scale_by_adam`, `scale_by_lion`). Entries where
    :math:`u \odot g = 0` are dropped. The default normalisation is
    ``pytorch_optimizer``'s ``apply_cautious`` (:math:`n / (\sum\phi + 1)`);
    ``min_fraction=1e-3`` is the paper's code (``mask / mask.mean().clamp(min=1e-3)``).
    ``heavyball``'s ``caution=True`` keeps entries of equal sign bits (zeros count as
    positive) and divides by :math:`\max(\sum\phi, 1)`: close, not the same numbers.

    To leave the weight decay out of the mask, as ``pytorch_optimizer`` does, wrap the part
    before it: ``chain(cautious(scale_by_lion(), "gradient"), add_decayed_weights(wd),
    scale_by_learning_rate(lr))`` is ``pytorch_optimizer.Lion(..., cautious=True)``.

    Args:
      inner: the transform whose update is masked.
      direction: ``"descent"`` (``inner`` returns steps, as an alias with its learning rate
        does) or ``"gradient"`` (``inner`` returns a direction of the gradient's sign).
      min_fraction: None for :math:`n/(\sum\phi+1)`; a number in (0, 1] for
        :math:`n/\max(\sum\phi, f n)`.

    Returns:
      A `GradientTransformation` whose state is the state of ``inner``.

    Example:
      >>> tx = opttx.cautious(opttx.adamw(1e-3, weight_decay=0.0))        # C-AdamW
      >>> tx = opttx.chain(opttx.cautious(opttx.scale_by_lion(), "gradient"),
      ...                  opttx.add_decayed_weights(0.1), opttx.scale_by_learning_rate(1e-4))

    References:
      Liang, Chen, Liu, Liu, Cautious Optimizers: Improving Training with One Line of Code
      (arXiv 2411.16085).
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"cautious: inner must be a GradientTransformation, got "
                        f"{type(inner).__name__}.")
    if direction not in ("descent", "gradient"):
        raise ValueError(f"direction must be 'descent' or 'gradient', got {direction!r}.")
    if min_fraction is not None:
        check_positive("min_fraction", min_fraction)
        if min_fraction > 1:
            raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction}.")
    descent = direction == "descent"

    def init(params: Params) -> State:
        return inner.init(params)

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        out, state = inner.update(updates, state, params, **extra_args)
        spec, u, g = flatten_matching(out, updates, what="the inner updates and the gradient")
        if not u:
            return out, state
        # u·g in one grouped kernel; torch has no grouped comparison, so the sign test is
        # per leaf (descent keeps u·g < 0, gradient keeps u·g > 0)
        products = foreach("mul", u, cast_like(g, u))
        agree = [p < 0 if descent else p > 0 for p in products]
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in u) else torch.float32
        # (a) local count of kept entries and of entries, one 2-vector per leaf
        partials = [torch.stack([a.sum(dtype=dtype), torch.full((), a.numel(), dtype=dtype,
                                                                device=a.device)])
                    for a in agree]
        # (b) over the shards of sharded leaves
        partials = reduce_leaf_statistics(partials, extra_args, spec=spec)
        # (c) the rescaling n / (kept + 1), or n / max(kept, f n)
        if min_fraction is None:
            factors = [p[1] / (p[0] + 1) for p in partials]
        else:
            factors = [p[1] / torch.clamp(p[0], min=min_fraction * p[1]) for p in partials]
        masked = foreach("mul", u, cast_like(agree, u))
        masked = foreach_op_("mul", masked, cast_like(factors, u))
        return tree_unflatten(mark_scratch(masked), spec), state

    return GradientTransformation(init, update, combine_traits((inner,), elementwise=False))
