r"""Layouts for optimizer work: run an element-wise chain on a few flat buffers instead of one
tensor per parameter.

A compiled optimizer step over ``N`` parameter tensors lowers every element-wise operation of
the chain to ``N`` kernels (Inductor on CPU compiles each of them separately), so compile time
and launch count grow with the number of tensors. `flatten` packs the leaves of each
(device, dtype) into one flat buffer, runs the inner transform on those buffers, and hands
back updates shaped like the parameters (views of one flat update buffer per group): the
chain's kernels no longer depend on ``N``, and its state is a handful of flat buffers.

Same numbers: for an element-wise inner transform (``adam``, ``adamw``, ``lion``, ``sgd``,
``rmsprop``, ``adagrad``, ``nadam``, momentum, decayed weights, schedules, ...) the results are
bitwise those of the per-leaf path. A transform that reduces per leaf (``clip_by_block_rms``,
``scale_by_trust_ratio``, Adafactor's factored statistics, Shampoo) would see one flat vector
instead of its leaves, so `flatten` must not wrap those; `clip_by_global_norm` is unaffected
(the norm over all buffers is the norm over all leaves). Masks and labels inside the inner
transform would see the flat buffers: one given as a function of the tree (``adamw(mask=...)``
deciding by ``ndim``) raises a ``ValueError``; put `flatten` inside `masked`/`partition`.

Cost: `flatten` concatenates the gradients and the parameters into new flat buffers at every
step (two extra copies: 44 instead of 28 bytes per parameter for AdamW), which a compiled
per-leaf step does not pay; measured on CPU (`benchmarks/gpu_step.py --size small`) the
compiled `flatten(adamw)` step is 4.4x slower than the compiled per-leaf step, while it
compiles faster. `FlatParams` removes both copies by keeping the parameters (and so the
gradients taken with respect to them) in flat buffers to begin with: prefer it for speed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch

from ._tracing import is_tracing
from .base import (GradientTransformation, check_init_params, combine_traits, declare,
                   declare_roles)
from .tree import PyTree, Static, flat_layout, tree_flatten, tree_unflatten

__all__ = ["FlatParams", "FlattenState", "flatten"]


class FlattenState(NamedTuple):
    """State of `flatten`."""
    inner_state: Any   # the inner transform's state over the tuple of flat buffers
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles()


def _groups(leaves: list[torch.Tensor]) -> list[list[int]]:
    """Leaf indices grouped by (device, dtype), groups in order of first appearance."""
    keys: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        keys.setdefault((x.device, x.dtype), []).append(i)
    return list(keys.values())


def _pack(leaves: list[torch.Tensor], groups: list[list[int]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat([leaves[i].reshape(-1) for i in g]) if len(g) > 1
                 else leaves[g[0]].reshape(-1) for g in groups)


@declare()
def flatten(inner: GradientTransformation) -> GradientTransformation:
    r"""Run the element-wise transform ``inner`` on one flat buffer per (device, dtype).

    .. math::
        u = \mathrm{unpack}(\mathrm{inner}(\mathrm{pack}(g), \mathrm{pack}(x)))

    where ``pack`` concatenates the flattened leaves of each (device, dtype) group and
    ``unpack`` splits the result back into views shaped like the leaves. The state is the inner
    state over the flat buffers (a tuple, one per group).

    Args:
      inner: an element-wise transform or chain (see the module docstring for what that
        excludes).

    Returns:
      A `GradientTransformation` with bitwise the numbers of ``inner`` for element-wise
      transforms, whose compiled step has a number of kernels independent of the number of
      parameter tensors.

    Example:
      >>> tx = opttx.flatten(opttx.adamw(1e-3, weight_decay=0.1))
      >>> state = tx.init(params)       # state.inner_state holds one m and one v buffer

    References:
      optax.flatten (the same idea for JAX pytrees).
    """

    def init(params: PyTree) -> FlattenState:
        check_init_params(params)
        leaves, _ = tree_flatten(params)
        with flat_layout():              # masks given as functions would see the buffers
            return FlattenState(inner.init(_pack(leaves, _groups(leaves))))

    def update(updates: PyTree, state: FlattenState, params: PyTree | None = None,
               **extra_args: Any) -> tuple[PyTree, FlattenState]:
        leaves, spec = tree_flatten(updates)
        groups = _groups(leaves)
        flat_params = None
        if params is not None:
            p_leaves, p_spec = tree_flatten(params)
            if p_spec != spec:
                from .tree import assert_same_structure
                assert_same_structure(updates, params, "updates and params")
            flat_params = _pack(p_leaves, groups)
        with contextlib.nullcontext() if is_tracing() else flat_layout():
            flat_updates, inner_state = inner.update(_pack(leaves, groups), state.inner_state,
                                                     flat_params, **extra_args)
        out: list[Any] = [None] * len(leaves)
        for g, buf in zip(groups, flat_updates):
            sizes = [leaves[i].numel() for i in g]
            for i, piece in zip(g, torch.split(buf, sizes)):
                out[i] = piece.view(leaves[i].shape)
        return tree_unflatten(out, spec), FlattenState(inner_state, made_by=state.made_by)

    return GradientTransformation(init, update, combine_traits((inner,)))


class FlatParams:
    r"""Parameters stored in one flat buffer per (device, dtype), each parameter a view.

    `flatten` packs gradients and parameters into flat buffers at every step; when the
    parameters *live* in flat buffers there is nothing to pack: a compiled step differentiates
    with respect to the buffers (the backward of the views is a single concatenation, which
    Inductor writes in place), runs an element-wise chain on them, and updates each buffer with
    one kernel. The optimizer's share of the graph then no longer depends on the number of
    parameter tensors.

    Example:
      >>> flat = opttx.FlatParams.of_module(model)     # model's parameters now view the buffers
      >>> tx = opttx.adamw(1e-3)
      >>> state = tx.init(flat.buffers)
      >>> def loss_fn(buffers, x, y):
      ...     return loss(functional_call(model, flat.unflatten(buffers), (x,)), y)
      >>> @torch.compile(fullgraph=True)
      ... def step(buffers, state, x, y):
      ...     grads, value = grad_and_value(loss_fn)(buffers, x, y)
      ...     updates, new_state = tx.update(grads, state, buffers)
      ...     opttx.apply_updates_(buffers, updates)
      ...     opttx.tree_copy_(state, new_state)
      ...     return value

    As with `flatten`, the transform must be element-wise (it sees one vector per group).
    """

    def __init__(self, params: PyTree) -> None:
        leaves, self.spec = tree_flatten(params)
        if not leaves:
            raise ValueError("FlatParams needs at least one parameter tensor.")
        self.shapes = [tuple(x.shape) for x in leaves]
        self.groups = _groups(leaves)
        with torch.no_grad():
            self.buffers: tuple[torch.Tensor, ...] = tuple(
                torch.cat([leaves[i].detach().reshape(-1) for i in g]) for g in self.groups)

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> "FlatParams":
        """Move ``module``'s parameters into flat buffers: every ``nn.Parameter`` keeps its
        identity and now views its buffer, so eager training, ``state_dict`` and the compiled
        functional step all see the same storage."""
        named = dict(module.named_parameters())
        flat = cls(named)
        views = flat.unflatten()
        with torch.no_grad():
            for (name, p), view in zip(named.items(), tree_flatten(views)[0]):
                p.data = view
        return flat

    def unflatten(self, buffers: tuple[torch.Tensor, ...] | None = None) -> PyTree:
        """The parameter tree as views of ``buffers`` (default: the stored buffers)."""
        buffers = self.buffers if buffers is None else buffers
        out: list[Any] = [None] * len(self.shapes)
        for g, buf in zip(self.groups, buffers):
            sizes = [math.prod(self.shapes[i]) for i in g]
            for i, piece in zip(g, torch.split(buf, sizes)):
                out[i] = piece.view(self.shapes[i])
        return tree_unflatten(out, self.spec)

    def flatten(self, tree: PyTree) -> tuple[torch.Tensor, ...]:
        """Pack a tree shaped like the parameters (gradients, say) into flat buffers."""
        leaves, spec = tree_flatten(tree)
        if spec != self.spec:
            from .tree import assert_same_structure
            assert_same_structure(self.unflatten(), tree, "parameters and tree")
        return _pack(leaves, self.groups)

