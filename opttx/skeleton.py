"""The skeleton of a per-leaf transform's ``update``: `leafwise`.

A transform whose state is a NamedTuple with declared roles (`opttx.base.Role`) writes only
its mathematics, a ``step`` over lists of leaves; `leafwise` does the rest: it checks the
state and the updates' structure, handles trees without leaves, advances the counters, and
flattens and unflattens (docs/guide/writing.md). What a transform needs beyond that is
declared in its arguments, never guessed from field names: its name for error messages,
further per-leaf fields by role (``per_leaf_roles``), what the gradients' shapes are checked
against (``check_shapes``), a 0-based step (``zero_based_count``). `as_tree` gives a step
the tree its lists stand for (for masks and labels given per tree). A stateless per-leaf
transform is `opttx.transforms.common.stateless_leafwise`, `leafwise` over `EmptyState`.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Literal

import torch

from ._checks import check_gradient_leaves
from .core import (Params, Role, TransformUpdateFn, Updates, advance_counts, replace_state,
                   require_params, safe_increment, state_roles)
from .declarations import check_state_type
from .reduction import LEAF_SPEC_KEY
from .tree import flatten_matching, tree_unflatten

__all__ = ["LeafwiseStep", "as_tree", "leafwise"]


LeafwiseStep = Callable[[list[torch.Tensor], Any, "list[torch.Tensor] | None", dict[str, Any]],
                        "tuple[list[torch.Tensor], Any]"]


def leafwise(state_type: type, step: LeafwiseStep, *, needs_params: str | None = None,
             name: str | None = None, per_leaf_roles: Collection[Role] = (),
             check_shapes: Literal["state", "params"] | None = "state",
             zero_based_count: bool = False) -> TransformUpdateFn:
    """The ``update`` of a transform whose state is a ``state_type`` NamedTuple with declared
    roles, from the part that is its mathematics.

    ``update(updates, state, params, **extra_args)`` checks the state's type and that the
    fields shaped like the updates (roles `Role.FIRST_MOMENT`, `Role.SECOND_MOMENT`,
    `Role.PARAMS_LIKE`) match the updates' structure, returns at once on a tree without
    leaves (advancing the counters, see `advance_counts`), advances every `Role.COUNT`
    field, and calls

        ``step(grads, state, params, extra_args) -> (new_updates, new_state)``

    with ``grads`` (and ``params``, when ``needs_params`` names the transform for the error
    message, or ``check_shapes="params"`` and params are given) as lists of leaves,
    ``extra_args`` those of the chain plus the tree's spec (so that `reduce_leaf_statistics`
    turns a list of per-leaf partial statistics into the reduction hook's call, rule 6), and
    ``state`` a ``state_type`` whose like-updates fields are lists of leaves in the same order
    and whose counters already count this step. ``step`` returns lists in the same places;
    they are unflattened back into trees. Every other field (``made_by``, a `Static` layout,
    a `Role.SCALAR`) is kept as ``step`` returns it (`replace_state`), so ``step`` changes
    only what it computes.

    Args:
      state_type: the NamedTuple class of the state, with ``__roles__``.
      step: the mathematics, on lists of leaves (above).
      needs_params: the transform's name for the error raised when no params are given; the
        params are then required and passed to ``step`` as a list of leaves (None: ``step``
        gets None, unless ``check_shapes="params"``).
      name: the transform's name in error messages (the state's type, the gradients'
        leaves); default: the state type's name.
      per_leaf_roles: roles of further fields that hold one entry per leaf without being
        shaped like it (`Role.FACTORED_MOMENT`: a row or column statistic, possibly empty;
        `Role.PER_LEAF_SCALAR`): these fields too must match the updates' structure and are
        given to ``step`` as lists of leaves, and unflattened from the lists it returns.
      check_shapes: what every gradient leaf's shape is checked against (besides being a
        dense floating-point tensor): ``"state"``, the first like-updates field (no shape
        check when there is none); ``"params"``, the params when given (a state whose
        like-updates fields may be empty placeholders, as a factored second moment's); None:
        no check of the gradients at all (a transform that passes any tensor through).
      zero_based_count: ``step`` sees the `Role.COUNT` fields as they were before this step
        (0 at the first step: Adafactor's decay of the 0-based step), and the skeleton
        advances them in the state ``step`` returns (default False: ``step`` sees them
        advanced, 1 at the first step, as Adam's bias correction wants).

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
                        f"add __roles__ = opttx.extend.declare_roles(...) to its class body.")
    if check_shapes not in ("state", "params", None):
        raise ValueError(f"leafwise: check_shapes must be 'state', 'params' or None, got "
                         f"{check_shapes!r}.")
    like_updates = [f for f in state_type._fields if f in roles and roles[f].like_updates]
    tree_fields = like_updates + [f for f in state_type._fields
                                  if f in roles and roles[f] in per_leaf_roles
                                  and not roles[f].like_updates]
    counters = [f for f in state_type._fields if roles.get(f) is Role.COUNT]
    # scalars shared by the tree (Nadam's momentum product) move on a rank without leaves as
    # on the others: the step runs on empty lists
    scalars = [f for f in state_type._fields if roles.get(f) is Role.SCALAR]
    state_name = name or state_type.__name__[:-5] or "transform"
    leaves_name = name or state_type.__name__

    def update(updates: Updates, state: Any, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, Any]:
        check_state_type(state, state_type, state_name)
        if needs_params is not None:
            params = require_params(params, needs_params)
        spec, g, *leaves = flatten_matching(updates, *(getattr(state, f) for f in tree_fields))
        p = None
        if params is not None and (needs_params is not None or check_shapes == "params"):
            p = flatten_matching(updates, params, what="updates and params")[2]
        if not g and not scalars:   # a tree without leaves: only the step counters move
            return updates, advance_counts(state)
        if check_shapes is not None:
            like = p if check_shapes == "params" else (leaves[0] if like_updates else None)
            check_gradient_leaves(g, like, updates, leaves_name)
        fields = dict(zip(tree_fields, leaves))
        if not zero_based_count:
            fields.update({f: safe_increment(getattr(state, f)) for f in counters})
        # the tree's spec, for reductions of per-leaf statistics (reduce_leaf_statistics)
        out, new = step(g, replace_state(state, **fields), p,
                        {**extra_args, LEAF_SPEC_KEY: spec})
        fields = {f: tree_unflatten(list(getattr(new, f)), spec) for f in tree_fields}
        if zero_based_count:
            fields.update({f: safe_increment(getattr(new, f)) for f in counters})
        return tree_unflatten(out, spec), replace_state(new, **fields)

    return update


def as_tree(leaves: list[Any], extra_args: dict[str, Any]) -> Any:
    """The tree that ``leaves`` (a list in the order of a `leafwise` step's gradients: the
    params, a statistic) stand for, from the spec the skeleton passes in ``extra_args``: for
    what is given per tree rather than per leaf (a mask, labels or a function of the params).

    Example (in a step, ``extra_args`` holds the spec; here it is made by hand):
      >>> leaves, spec = opttx.tree.tree_flatten(params)
      >>> tree = as_tree(leaves, {LEAF_SPEC_KEY: spec})        # params again
      >>> mask = opttx.tree.mask_leaves(lambda p: {k: v.ndim > 1 for k, v in p.items()}, tree)
    """
    return tree_unflatten(list(leaves), extra_args[LEAF_SPEC_KEY])

