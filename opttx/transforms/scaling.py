"""Scaling transforms: constant factors, learning rates and schedules, weight decay, sign."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from .._checks import check_learning_rate, check_nonnegative, check_number
from ..base import (DEFERRED_SCALE, ELEMENTWISE, EmptyState, GradientTransformation, HyperRole,
                    Params, Role, Updates, check_init_params, declare, declare_roles,
                    replace_state, safe_increment, stateless_with_extra_args,
                    zero_count)
from .._tracing import is_tracing
from ..kernels import Scalar, cast_like, foreach, foreach_, foreach_axpy, foreach_scale
from ..schedules import Schedule
from ..skeleton import as_tree, leafwise
from ..tree import PyTree, Static, flatten_matching, mask_leaves, tree_unflatten
from .common import stateless_leafwise

__all__ = [
    "ScaleByScheduleState",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_by_sign",
]


def signs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``sign(x)`` of every tensor as new tensors, a non-finite ``x`` (NaN, ±inf) giving NaN:
    ``torch.sign`` maps NaN to 0 (and ±inf to ±1), which would hide a non-finite gradient.
    Computed as ``sign(x) + 0·x`` (IEEE: ``0·NaN`` and ``0·inf`` are NaN, ``0·x`` is 0
    otherwise), one more grouped pass in place."""
    if not tensors:
        return []
    s = foreach("sign", tensors)
    if is_tracing():
        return foreach("add", s, tensors, alpha=0)
    return foreach_("add", s, tensors, alpha=0)


_FINAL_SCALE = dataclasses.replace(ELEMENTWISE, final_scale=True)


def _scaled(updates: Updates, factor: Scalar, extra_args: dict[str, Any]) -> Updates:
    """``factor · updates``; when the caller asks for the factor (`DEFERRED_SCALE`: it writes
    ``x + factor·u`` in one fused add) the updates unscaled, the factor reported."""
    sink = extra_args.get(DEFERRED_SCALE)
    if sink is not None:
        sink.append(factor)
        return updates
    spec, g = flatten_matching(updates)
    # cast back: a 0-D leaf times a float64 0-dim factor (a schedule's value) promotes
    return tree_unflatten(cast_like(foreach_scale(g, factor), g), spec)


@declare(hyperparams={"step_size": None})
def scale(step_size: float) -> GradientTransformation:
    r"""Multiply updates by a constant: :math:`u_t = \alpha g_t`.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_adam(), opttx.scale(-1e-3))
    """
    check_number("step_size", step_size)
    return stateless_with_extra_args(
        lambda updates, params, extra_args: _scaled(updates, step_size, extra_args),
        _FINAL_SCALE)


class ScaleByScheduleState(NamedTuple):
    """State of `scale_by_schedule`."""
    count: torch.Tensor  # shape (), int32: steps taken, the schedule's argument
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT)


@declare(runtime=("step_size_fn",))
def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    r"""Multiply updates by ``step_size_fn(t)``, with ``t`` the 0-based step (as optax).

    The schedule is evaluated from a 0-dim int tensor inside the graph, so a compiled step
    does not recompile as it advances.

    Example:
      >>> tx = opttx.scale_by_schedule(opttx.cosine_decay_schedule(-1e-2, 1000))
    """
    if not callable(step_size_fn):
        raise TypeError("step_size_fn must be a schedule: a function of the step count.")

    def init(params: Params) -> ScaleByScheduleState:
        check_init_params(params)
        return ScaleByScheduleState(count=zero_count(params))

    def update(updates: Updates, state: ScaleByScheduleState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ScaleByScheduleState]:
        del params
        step_size = step_size_fn(state.count)
        return (_scaled(updates, step_size, extra_args),
                replace_state(state, count=safe_increment(state.count)))

    return GradientTransformation(init, update, _FINAL_SCALE)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE})
def scale_by_learning_rate(learning_rate: float | Schedule,
                           *, flip_sign: bool = True) -> GradientTransformation:
    r"""Multiply updates by :math:`-\eta` (a descent step), :math:`\eta` a number or schedule.

    Args:
      learning_rate: a number >= 0, a 0-dim tensor, or a schedule of the step count.
      flip_sign: multiply by :math:`-\eta` (default) rather than :math:`\eta`.
    """
    check_learning_rate(learning_rate)
    sign = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)


@declare(hyperparams={"weight_decay": HyperRole.WEIGHT_DECAY})
def add_decayed_weights(weight_decay: float = 0.0,
                        mask: PyTree | Callable[[Params], PyTree] | None = None,
                        *, cautious: bool = False) -> GradientTransformation:
    r"""Add the parameters times ``weight_decay`` to the updates: :math:`u_t = g_t + \lambda x_t`.

    Placed before `scale_by_learning_rate` (as in `opttx.adamw`) this is decoupled weight decay
    with the same numbers as ``torch.optim.AdamW`` (torch multiplies ``p`` by
    :math:`1 - \eta\lambda` first). Placed before the scaling transform it is L2
    regularisation, as torch.optim's ``weight_decay`` in SGD and Adam.

    Args:
      weight_decay: :math:`\lambda` >= 0.
      mask: a tree of booleans like the params (or a function of the params returning one);
        ``True`` where decay applies. Biases and norm scales are commonly excluded.
      cautious: cautious weight decay (Chen et al.): decay only the entries where the
        update and the parameter agree in sign,
        :math:`u_t = g_t + \lambda\, \mathbb{1}[g_t \odot x_t \ge 0] \odot x_t`, with
        :math:`g_t` the updates this transform is given: the optimizer's direction before the
        learning rate when it sits where `opttx.adamw` puts it (the paper's :math:`u_t`:
        Adam's :math:`\hat m_t / (\sqrt{\hat v_t} + \epsilon)`, Lion's sign, Muon's
        orthogonalized momentum). An entry whose update is 0 is decayed (the paper's
        :math:`\ge`); heavyball's ``cautious_weight_decay`` compares sign bits instead, so
        there a zero update decays only the parameters of its sign bit.

    Example:
      >>> mask = lambda p: {k: v.ndim > 1 for k, v in p.items()}
      >>> tx = opttx.chain(opttx.scale_by_adam(), opttx.add_decayed_weights(1e-2, mask),
      ...                  opttx.scale_by_learning_rate(1e-3))
      >>> tx = opttx.chain(opttx.scale_by_adam(), opttx.add_decayed_weights(0.1, cautious=True),
      ...                  opttx.scale_by_learning_rate(1e-3))            # AdamW with CWD

    References:
      Chen, Li, Liang, Su, Xie, Pierse, Liang, Lao and Liu, Cautious Weight Decay
      (arXiv 2510.12402).
    """
    check_nonnegative("weight_decay", weight_decay)

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        if mask is not None:
            mask_leaves(mask, params)  # fail early on a malformed mask
        return EmptyState()

    def step(g: list[torch.Tensor], state: EmptyState, p: list[torch.Tensor],
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], EmptyState]:
        selected = (mask_leaves(mask, as_tree(p, extra_args)) if mask is not None
                    else [True] * len(g))
        idx = [i for i, keep in enumerate(selected) if keep]
        if not idx:
            return g, state
        decay = cast_like([p[i] for i in idx], [g[i] for i in idx])
        if cautious:
            # the paper's mask 1[u·x >= 0] (a NaN update decays nothing and stays NaN); torch
            # has no grouped comparison, so the test and the select are per leaf
            products = foreach("mul", [g[i] for i in idx], decay)
            decay = [torch.where(q >= 0, x, torch.zeros_like(x))
                     for q, x in zip(products, decay)]
        decayed = foreach_axpy(weight_decay, decay, [g[i] for i in idx])
        out = list(g)
        for i, d in zip(idx, decayed):
            out[i] = d
        return out, state

    return GradientTransformation(init, leafwise(EmptyState, step,
                                                 needs_params="add_decayed_weights",
                                                 name="add_decayed_weights",
                                                 check_shapes="params"), ELEMENTWISE)


@declare()
def scale_by_sign() -> GradientTransformation:
    r"""Replace updates by their sign: :math:`u_t = \mathrm{sign}(g_t)` (signSGD).

    References:
      Bernstein et al., signSGD (arXiv 1802.04434).
    """

    return stateless_leafwise("scale_by_sign", lambda g, params, extra_args: signs(g),
                              ELEMENTWISE)
