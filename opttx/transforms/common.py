"""Helpers shared by the transforms' ``step`` functions: float64 scalars of the step counter
(bias corrections), a division that reuses its temporaries, and the marking of new updates.

A transform's ``step`` (see `opttx.skeleton.leafwise`) computes its hyperparameter terms from
the 0-dim step tensor in float64, so a compiled step never recompiles as the step advances
and float64 training matches torch.optim to 1e-10; it returns updates in the gradients'
dtypes, marked as temporaries that later links of the chain may overwrite.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch

from .._tracing import is_tracing
from ..base import (EmptyState, GradientTransformation, Params, Traits, Updates,
                    check_init_params)
from ..kernels import Scalar, cast_like, foreach, foreach_, mark_scratch
from ..skeleton import leafwise

__all__ = ["as_float64", "debias_factor", "divide_consuming", "float64_power", "fresh_updates",
           "stateless_leafwise"]


def float64_power(base: Scalar, exponent: torch.Tensor) -> torch.Tensor:
    """``base ** exponent`` as a float64 0-dim tensor (``base`` a number or 0-dim tensor,
    ``exponent`` a float64 0-dim tensor)."""
    if isinstance(base, torch.Tensor):
        base = base.to(torch.float64)
    return torch.pow(base, exponent)


def as_float64(value: Scalar, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a number or 0-dim tensor) as a float64 0-dim tensor on ``like``'s device."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64)
    return torch.tensor(value, dtype=torch.float64, device=like.device)


def debias_factor(decay: Scalar, count: torch.Tensor) -> torch.Tensor:
    r"""The bias correction :math:`1 - \beta^t` of an exponential moving average started at
    zero, in float64 (``decay`` :math:`\beta`, ``count`` :math:`t` the 1-based step).

    Example (Adam's first moment at the first step: 1 - 0.9 = 0.1):
      >>> mu = [torch.ones(3)]
      >>> mu_hat = foreach("div", mu, debias_factor(0.9, torch.tensor(1)))
    """
    return 1 - float64_power(decay, count.to(torch.float64))


def divide_consuming(numerators: list[torch.Tensor], denominators: list[torch.Tensor]
                     ) -> list[torch.Tensor]:
    """``numerators / denominators``, overwriting the denominators (temporaries the caller
    owns; do not pass state buffers). In eager mode as ``reciprocal_`` then ``mul_``: one
    more pass but no new parameter-sized allocation, which on CPU costs more than a pass in
    page faults; under tracing one ``div``."""
    if is_tracing():
        return foreach("div", numerators, denominators)
    foreach_("reciprocal", denominators)
    return foreach_("mul", denominators, numerators)


def fresh_updates(out: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """New update tensors ``out``, cast to the dtypes of the gradients ``like`` and registered
    as temporaries that later links of the chain may overwrite (see
    `opttx.kernels.mark_scratch`): how a ``step`` returns the updates it computed."""
    return mark_scratch(cast_like(out, like))


StatelessStep = Callable[[list[torch.Tensor], "list[torch.Tensor] | None", dict[str, Any]],
                         list[torch.Tensor]]


def stateless_leafwise(name: str, step: StatelessStep, traits: Traits, *,
                       needs_params: bool = False,
                       check_shapes: Literal["state", "params"] | None = None
                       ) -> GradientTransformation:
    """A stateless per-leaf transform (state `EmptyState`) from ``step(grads, params,
    extra_args) -> new_updates`` on lists of leaves: `opttx.skeleton.leafwise` does the rest (a
    tree without leaves, the tree's spec in ``extra_args``). Like every stateless transform it
    gives back whatever state it is given.

    ``name`` names the transform in error messages; with ``needs_params`` the params are
    required and given to ``step`` as a list of leaves (else None); ``check_shapes`` as in
    `opttx.skeleton.leafwise` (default None: the gradients are not checked, as a stateless
    element-wise transform passes any tensor on; ``"params"``: against the params' shapes).

    Example (halve every update):
      >>> tx = stateless_leafwise("halve", lambda g, p, extra_args:
      ...                         opttx.kernels.foreach("mul", g, 0.5), opttx.base.ELEMENTWISE)
    """

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        return EmptyState()

    def leaf_step(g: list[torch.Tensor], state: EmptyState, p: list[torch.Tensor] | None,
                  extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], EmptyState]:
        return step(g, p, extra_args), state

    leaves_update = leafwise(EmptyState, leaf_step, needs_params=name if needs_params else None,
                             name=name, check_shapes=check_shapes)

    def update(updates: Updates, state: Any, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, Any]:
        # a stateless transform takes whatever state it is given and gives it back unchanged
        return leaves_update(updates, EmptyState(), params, **extra_args)[0], state

    return GradientTransformation(init, update, traits)
