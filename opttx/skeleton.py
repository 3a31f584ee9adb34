"""The skeleton of a per-leaf transform's ``update``: `leafwise`.

A transform whose state is a NamedTuple with declared roles (`opttx.base.Role`) writes only
its mathematics, a ``step`` over lists of leaves; `leafwise` does the rest: it checks the
state and the updates' structure, handles trees without leaves, advances the counters, and
flattens and unflattens (docs/guide/writing.md).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._checks import check_gradient_leaves
from .base import (LEAF_SPEC_KEY, Params, Role, TransformUpdateFn, Updates, advance_counts,
                   check_state_type, replace_state, require_params, safe_increment,
                   state_roles)
from .tree import flatten_matching, tree_unflatten

__all__ = ["LeafwiseStep", "leafwise"]


LeafwiseStep = Callable[[list[torch.Tensor], Any, "list[torch.Tensor] | None", dict[str, Any]],
                        "tuple[list[torch.Tensor], Any]"]


def leafwise(state_type: type, step: LeafwiseStep, *, needs_params: str | None = None
             ) -> TransformUpdateFn:
    """The ``update`` of a transform whose state is a ``state_type`` NamedTuple with declared
    roles, from the part that is its mathematics.

    ``update(updates, state, params, **extra_args)`` checks that the fields shaped like the
    updates (roles `Role.FIRST_MOMENT`, `Role.SECOND_MOMENT`, `Role.PARAMS_LIKE`) match the
    updates' structure, returns at once on a tree without leaves (advancing the counters, see
    `advance_counts`), advances every `Role.COUNT` field, and calls

        ``step(grads, state, params, extra_args) -> (new_updates, new_state)``

    with ``grads`` (and ``params``, when ``needs_params`` names the transform for the error
    message) as lists of leaves, ``extra_args`` those of the chain plus the tree's spec (so
    that `reduce_leaf_statistics` turns a list of per-leaf partial statistics into the
    reduction hook's call, rule 6), and ``state`` a ``state_type`` whose like-updates fields are
    lists of leaves in the same order and whose counters already count this step. ``step``
    returns lists in the same places; they are unflattened back into trees.

    Example (the whole update of a Lion-like transform):
      >>> from opttx.kernels import foreach, foreach_ema
      >>> from opttx.base import replace_state
      >>> from opttx.transforms.moments import ScaleByLionState
      >>> b1, b2 = 0.9, 0.99
      >>> def step(g, state, params, extra_args):
      ...     out = foreach("sign", foreach_ema(state.mu, g, b1))   # sign(b1·mu + (1-b1)·g)
      ...     return out, replace_state(state, mu=foreach_ema(state.mu, g, b2))
      >>> update = leafwise(ScaleByLionState, step)
    """
    roles = state_roles(state_type)
    if not roles and [f for f in state_type._fields if f != "made_by"]:
        raise TypeError(f"leafwise({state_type.__name__}, ...): the state declares no roles; "
                        f"add __roles__ = opttx.declare_roles(...) to its class body.")
    tree_fields = [f for f in state_type._fields if f in roles and roles[f].like_updates]
    counters = [f for f in state_type._fields if roles.get(f) is Role.COUNT]
    # scalars shared by the tree (Nadam's momentum product) move on a rank without leaves as
    # on the others: the step runs on empty lists
    scalars = [f for f in state_type._fields if roles.get(f) is Role.SCALAR]

    def update(updates: Updates, state: Any, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, Any]:
        check_state_type(state, state_type, state_type.__name__[:-5] or "transform")
        trees = [getattr(state, f) for f in tree_fields]
        if needs_params is not None:
            trees.append(require_params(params, needs_params))
        spec, g, *leaves = flatten_matching(updates, *trees)
        if not g and not scalars:   # a tree without leaves: only the step counters move
            return updates, advance_counts(state)
        check_gradient_leaves(g, leaves[0] if leaves else None, updates, state_type.__name__)
        p = leaves.pop() if needs_params is not None else None
        fields = dict(zip(tree_fields, leaves))
        fields.update({f: safe_increment(getattr(state, f)) for f in counters})
        # the tree's spec, for reductions of per-leaf statistics (reduce_leaf_statistics)
        out, new = step(g, replace_state(state, **fields), p,
                        {**extra_args, LEAF_SPEC_KEY: spec})
        return (tree_unflatten(out, spec),
                replace_state(new, **{f: tree_unflatten(list(getattr(new, f)), spec)
                                       for f in tree_fields}))

    return update
