"""Applying updates to the parameters: `apply_updates` (a new tree) and `apply_updates_` (in
place), with stochastic rounding of bfloat16 parameters (`round_stochastic_`) and the fold of
a transform's final scalar into the write (`update_deferring_scale`); and the grouped adds
they are made of, which `opttx.Optimizer` shares (`add_leaves`, `scaled_updates`,
`stochastic_pairs`)."""

from __future__ import annotations

from typing import Any

import torch

from .core import GradientTransformation, Params, State, Updates, traits_of
from .kernels import cast_like, foreach, foreach_
from .tree import assert_same_structure, tree_flatten, tree_paths, tree_unflatten

__all__ = [
    "DEFERRED_SCALE",
    "add_leaves",
    "apply_updates",
    "apply_updates_",
    "grouping_key",
    "round_stochastic_",
    "scaled_updates",
    "stochastic_pairs",
    "update_deferring_scale",
]


DEFERRED_SCALE = "deferred_scale"
"""The ``extra_args`` key of a list in which a transform with `Traits.final_scale` reports
its final scalar instead of applying it (see `update_deferring_scale`)."""


def update_deferring_scale(tx: GradientTransformation, updates: Updates, state: State,
                           params: Params | None = None, **extra_args: Any
                           ) -> tuple[Updates, State, Any]:
    """``tx.update`` with its final scalar left out: ``(updates, new_state, scale)`` such
    that ``apply_updates(params, updates, scale=scale)`` is the step, written as
    ``x + scale·u`` in one fused add (torch.optim's ``p.add_(u, alpha=-lr)``) instead of
    ``x + round(scale·u)``. ``scale`` is None (and the updates are ``tx.update``'s) when ``tx``
    does not declare `Traits.final_scale`. A number when the transform holds one (eager
    `opttx.Optimizer` steps), a 0-dim tensor under tracing or from a schedule.

    Example:
      >>> updates, state, s = opttx.update_deferring_scale(tx, grads, state, params)
      >>> params = opttx.apply_updates(params, updates, scale=s)
    """
    if not traits_of(tx).final_scale:
        return (*tx.update(updates, state, params, **extra_args), None)
    sink: list[Any] = []
    updates, state = tx.update(updates, state, params, **extra_args, **{DEFERRED_SCALE: sink})
    if len(sink) != 1:
        raise RuntimeError(f"update_deferring_scale: the transform declares a final scale but "
                           f"reported {len(sink)} scalars; a transform with Traits.final_scale "
                           "reports exactly one when asked.")
    return updates, state, sink[0]


def _paired_leaves(params: Params, updates: Updates) -> tuple[list, list, Any]:
    """The leaves of ``params`` and of ``updates`` paired by path, not by position: a dict
    of updates whose keys come in another order is read in the order of the params; any
    other difference of structure, and updates whose shapes differ from their parameters'
    (even broadcastable ones), raise. The structures are compared once per call in eager
    mode; a compiled step checks them while tracing."""
    p_leaves, spec = tree_flatten(params)
    u_leaves, u_spec = tree_flatten(updates)
    if u_spec != spec:
        try:
            u_leaves = spec.flatten_up_to(updates)
        except (ValueError, TypeError, RuntimeError):
            assert_same_structure(params, updates, "params and updates")
            raise ValueError("params and updates have different tree structures "
                             f"({spec} vs {u_spec}).") from None
    for i, (p, u) in enumerate(zip(p_leaves, u_leaves)):
        if not isinstance(u, torch.Tensor) or p.shape != u.shape:
            path = tree_paths(params)[i]
            got = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(f"update for parameter {path!r} has shape {got}, expected "
                             f"{tuple(p.shape)}: updates must have the shapes of the params.")
        if u.is_complex() and not p.is_complex():
            path = tree_paths(params)[i]
            raise TypeError(f"update for parameter {path!r} is complex ({u.dtype}) but the "
                            f"parameter is {p.dtype}: casting would drop the imaginary part. "
                            "Optimize complex parameters as real views (torch.view_as_real).")
    return p_leaves, u_leaves, spec


def round_stochastic_(out: torch.Tensor, x: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Write float32 ``x`` into the bfloat16 tensor ``out``, rounded stochastically.

    A value between two neighbouring bfloat16 numbers :math:`a < x < b` becomes :math:`b`
    with probability :math:`(x - a)/(b - a)`, so :math:`\mathbb{E}[\mathrm{round}(x)] = x`:
    updates much smaller than the spacing of bfloat16 near the parameter still move it on
    average, where round-to-nearest would drop them every step. Done on the bits: a uniform
    16-bit integer is added to the float32 pattern and the low 16 bits are cut (inf and NaN
    pass through unchanged).

    References:
      Gupta et al., Deep Learning with Limited Numerical Precision (arXiv 1502.02551);
      Zamirai et al., Revisiting BFloat16 Training (arXiv 2010.06192).
    """
    x = x.to(torch.float32)
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    out.copy_(torch.where(torch.isfinite(x), rounded, x))
    return out


def stochastic_pairs(p_leaves: list, u_leaves: list, scale: float = 1.0
                      ) -> tuple[list, list, list, list]:
    """Split leaves into bfloat16 parameters (written with stochastic rounding) and others:
    ``(bf16_params, their_updates, other_params, their_updates)``, the first updates
    multiplied by ``scale`` (they are added in float32), the others cast to their
    parameter's dtype (for `add_leaves` with ``alpha=scale``)."""
    sr_p, sr_u, rest_p, rest_u = [], [], [], []
    for p, u in zip(p_leaves, u_leaves):
        if p.dtype == torch.bfloat16:
            sr_p.append(p)
            sr_u.append(u if scale == 1.0 else u * scale)
        else:
            rest_p.append(p)
            rest_u.append(u.to(p.dtype))
    return sr_p, sr_u, rest_p, rest_u


def grouping_key(x: torch.Tensor) -> Any:
    """What a grouped (``_foreach``) kernel cannot mix: plain tensors, and DTensors per mesh
    and placements (a tree under ``parallelize_module`` holds both)."""
    mesh = getattr(x, "device_mesh", None)
    if mesh is None:
        return None
    return (id(mesh), tuple(x.placements))


def _as_real_view(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(x) if x.is_complex() else x


def add_leaves(p_leaves: list[torch.Tensor], u_leaves: list[torch.Tensor],
               inplace: bool, alpha: float = 1.0) -> list[torch.Tensor]:
    """``p + alpha · u`` (or ``p += alpha · u``) with one grouped kernel per kind of leaf
    (see `grouping_key`)."""
    if alpha != 1.0 and any(p.is_complex() for p in p_leaves):
        # a real factor scales each part alike, as torch.optim's real views do (a complex
        # multiply-add would round the parts otherwise)
        views = [_as_real_view(p) for p in p_leaves], [_as_real_view(u) for u in u_leaves]
        out = add_leaves(*views, inplace=inplace, alpha=alpha)
        if inplace:
            return list(p_leaves)
        return [torch.view_as_complex(o) if p.is_complex() else o
                for o, p in zip(out, p_leaves)]
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(p_leaves):
        groups.setdefault(grouping_key(p), []).append(i)
    out: list[Any] = list(p_leaves)
    for idx in groups.values():
        ps, us = [p_leaves[i] for i in idx], [u_leaves[i] for i in idx]
        if inplace:
            foreach_("add", ps, us, alpha=alpha)
        else:
            for i, r in zip(idx, foreach("add", ps, us, alpha=alpha)):
                out[i] = r
    return out


def scaled_updates(u_leaves: list, scale: Any) -> tuple[list, float]:
    """The updates and the ``alpha`` of the fused add that writes ``x + scale·u``: a number
    goes into the add itself (one rounding, as torch.optim's ``add_(u, alpha=-lr)``); a
    tensor scale (traced, scheduled) multiplies the updates first, in one grouped kernel and
    back in their dtypes, as `opttx.scale` would have."""
    if scale is None:
        return u_leaves, 1.0
    if isinstance(scale, torch.Tensor):
        return cast_like(foreach("mul", list(u_leaves), scale), u_leaves), 1.0
    return u_leaves, float(scale)


def apply_updates(params: Params, updates: Updates, *, stochastic_rounding: bool = False,
                  generator: torch.Generator | None = None,
                  differentiable: bool = False, scale: Any = None) -> Params:
    """``params + updates``, leaf by leaf, as a new tree (pure); ``params + scale·updates``
    in one fused add when ``scale`` is given (the scalar `update_deferring_scale` returns).

    Updates are cast to each parameter's dtype. One grouped kernel for all leaves. With
    ``stochastic_rounding=True`` bfloat16 parameters are added in float32 and rounded
    stochastically (`round_stochastic_`); other dtypes are unaffected.

    The functional API is differentiable, as optax is under ``jax.grad``: with grad mode on,
    parameters that require grad (``model.parameters()``) make the new parameters (and,
    through weight decay, the optimizer state) part of the autograd graph, which then grows
    by one step per step. So, unless ``differentiable=True`` says that this is meant (for
    example to differentiate through an update, as in meta-learning), parameters that
    require grad in grad mode are refused: train with detached parameters
    (``{k: p.detach() for k, p in model.named_parameters()}``), under ``torch.no_grad()``,
    or with `apply_updates_` / `opttx.Optimizer`, which write in place without a graph.

    Example:
      >>> updates, state = tx.update(grads, state, params)
      >>> params = opttx.apply_updates(params, updates)
    """
    p_leaves, u_leaves, spec = _paired_leaves(params, updates)
    if not differentiable and torch.is_grad_enabled():
        for i, p in enumerate(p_leaves):
            if p.requires_grad:
                raise ValueError(
                    f"apply_updates: parameter {tree_paths(params)[i]} requires grad and grad "
                    "mode is on, so the new parameters would extend its autograd graph (one "
                    "step deeper every step). Pass detached parameters ({k: p.detach() ...}), "
                    "call it under torch.no_grad(), use apply_updates_ (in place), or pass "
                    "differentiable=True to differentiate through the update on purpose.")
    u_leaves, alpha = scaled_updates(u_leaves, scale)
    if stochastic_rounding:
        out = []
        for p, u in zip(p_leaves, u_leaves):
            u = u * alpha if alpha != 1.0 else u
            if p.dtype == torch.bfloat16:
                out.append(round_stochastic_(torch.empty_like(p), p.float() + u.float(),
                                             generator))
            else:
                out.append(p + u.to(p.dtype))
        return tree_unflatten(out, spec)
    u_leaves = [u.to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    return tree_unflatten(add_leaves(p_leaves, u_leaves, inplace=False, alpha=alpha), spec)


@torch.no_grad()
def apply_updates_(params: Params, updates: Updates, *, stochastic_rounding: bool = False,
                   generator: torch.Generator | None = None, scale: Any = None) -> Params:
    """``params += updates`` in place (also on ``nn.Parameter`` leaves); returns ``params``.
    With ``scale`` (the scalar `update_deferring_scale` returns): ``params += scale·updates``
    in one fused add.

    Updates that carry autograd history (computed in grad mode from parameters that require
    grad) are refused with a ``ValueError`` naming the leaf: their state would keep every
    step's graph. In a compiled step the write lowers to an in-place update of the graph's
    inputs. With
    ``stochastic_rounding=True`` bfloat16 parameters are updated in float32 and written back
    rounded stochastically (`round_stochastic_`): the usual companion of bf16 parameters
    with fp32 optimizer state, instead of an fp32 master copy of the weights (4 bytes per
    parameter saved).
    """
    p_leaves, u_leaves, _ = _paired_leaves(params, updates)
    if not p_leaves:
        return params
    for i, u in enumerate(u_leaves):
        if u.requires_grad:
            raise ValueError(
                f"apply_updates_: the update of {tree_paths(params)[i]} carries autograd "
                "history: the step ran in grad mode on parameters that require grad, so the "
                "optimizer state (momenta, traces, Prodigy's and Schedule-Free's sums) keeps "
                "every step's graph alive. Run the step under torch.no_grad() (as "
                "opttx.Optimizer and FusedBackward do) or pass detached parameters; to "
                "differentiate through a step on purpose, use apply_updates(..., "
                "differentiable=True).")
    u_leaves, alpha = scaled_updates(u_leaves, scale)
    if stochastic_rounding:
        sr_p, sr_u, p_leaves, u_leaves = stochastic_pairs(p_leaves, u_leaves, alpha)
        for p, u in zip(sr_p, sr_u):
            round_stochastic_(p, p.float() + u.float(), generator)
        add_leaves(p_leaves, u_leaves, inplace=True, alpha=alpha)
        return params
    u_leaves = [u.to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    add_leaves(p_leaves, u_leaves, inplace=True, alpha=alpha)
    return params
