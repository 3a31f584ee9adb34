"""The transform contract, in one import: every name a transform needs, and the trivial
transforms (`identity`, `set_to_zero`, `stateless`) with their state, `EmptyState`.

Each concern lives in its own module; this one re-exports them, so ``from opttx.base import
X`` works for all of them:

* `opttx.core`: `GradientTransformation`, `Traits`, the roles of state fields (`Role`,
  `declare_roles`, `declare_optional`), and the helpers transforms use on their states
  (`replace_state`, `advance_counts`, `keep_copy`, `safe_increment`, ...);
* `opttx.declarations`: `declare`, `HyperRole`, `Declaration`, `Recipe`, the identity of a
  state (``made_by``) and its checks, `describe_transform`, `configuration_items`;
* `opttx.reduction`: the reduction hook of sharded runs (`reduce_statistics`,
  `current_reducer`, ...) and `PRECONDITION_INPUT`;
* `opttx.updates`: `apply_updates`, `apply_updates_`, `round_stochastic_`,
  `update_deferring_scale`;
* `opttx.skeleton`: `leafwise`, the skeleton of a per-leaf transform's ``update``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

# these live in the modules named in the docstring above; re-exported here
from .core import (ELEMENTWISE, LEAFWISE, OPTIONAL_MARK, PRECONDITIONER, GradientTransformation,
                   NamedTupleT, Params, Role, State, Traits, TransformInitFn, TransformUpdateFn,
                   Updates, advance_counts, check_init_params, combine_traits, declare_optional,
                   declare_roles, fields_with_role, is_masked, is_optional_entry, keep_copy,
                   leaf_roles, optional_fields, replace_state, require_params, safe_increment,
                   state_roles, traits_of, zero_count)
from .declarations import (Declaration, HyperRole, Recipe, check_made_by, check_state_type,
                           configuration_items, declaration_of, declare, describe_transform,
                           describe_value, format_identity, identity_differences, public_name,
                           rebuild_transform, recipe_of, step_local_transforms)
from .declarations import rebuild_transform as _rebuild  # the name pickles use (see there)
from .reduction import (LEAF_SPEC_KEY, PRECONDITION_INPUT, REDUCER_KEY, TOTALS_KEY, ReduceOp,
                        current_reducer, precondition_leaves, precondition_target,
                        reduce_across_leaves, reduce_leaf_statistics, reduce_statistics,
                        reducer_during_init, require_whole_leaves)
from .skeleton import LeafwiseStep, leafwise
from .tree import Static, tree_map
from .updates import (DEFERRED_SCALE, apply_updates, apply_updates_, round_stochastic_,
                      update_deferring_scale)

__all__ = [
    "Declaration",
    "HyperRole",
    "Recipe",
    "check_made_by",
    "check_state_type",
    "configuration_items",
    "declaration_of",
    "declare",
    "describe_transform",
    "describe_value",
    "public_name",
    "step_local_transforms",
    "format_identity",
    "identity_differences",
    "recipe_of",
    "ELEMENTWISE",
    "LEAFWISE",
    "PRECONDITIONER",
    "PRECONDITION_INPUT",
    "EmptyState",
    "GradientTransformation",
    "Role",
    "Traits",
    "declare_optional",
    "declare_roles",
    "fields_with_role",
    "is_optional_entry",
    "optional_fields",
    "leaf_roles",
    "state_roles",
    "traits_of",
    "Params",
    "LEAF_SPEC_KEY",
    "REDUCER_KEY",
    "TOTALS_KEY",
    "advance_counts",
    "check_init_params",
    "combine_traits",
    "current_reducer",
    "precondition_leaves",
    "precondition_target",
    "State",
    "Updates",
    "apply_updates",
    "apply_updates_",
    "identity",
    "keep_copy",
    "reduce_across_leaves",
    "reduce_leaf_statistics",
    "reduce_statistics",
    "replace_state",
    "reducer_during_init",
    "register_safe_globals",
    "require_whole_leaves",
    "round_stochastic_",
    "require_params",
    "safe_increment",
    "set_to_zero",
    "stateless",
    "stateless_with_extra_args",
    "stateless_with_tree_map",
    "zero_count",
    "DEFERRED_SCALE",
    "NamedTupleT",
    "OPTIONAL_MARK",
    "ReduceOp",
    "TransformInitFn",
    "TransformUpdateFn",
    "is_masked",
    "update_deferring_scale",
    "LeafwiseStep",
    "leafwise",
]


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


@declare()
def stateless_with_extra_args(fn: Callable[[Updates, Params | None, dict[str, Any]], Updates],
                              traits: Traits = Traits()) -> GradientTransformation:
    """A transform from ``fn(updates, params, extra_args) -> updates``, for stateless
    transforms that need the ``extra_args`` of a chain (the reduction hook of sharded runs).
    Its state is `EmptyState`, as that of every stateless transform."""

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EmptyState]:
        return fn(updates, params, extra_args), state

    return GradientTransformation(init, update, traits)


@declare()
def stateless(fn: Callable[[Updates, Params | None], Updates],
              traits: Traits = Traits()) -> GradientTransformation:
    """A transform from a function ``fn(updates, params) -> updates`` of the whole tree.

    Example:
      >>> halve = opttx.stateless(lambda u, p: opttx.tree.tree_map(lambda g: g / 2, u))
    """
    return stateless_with_extra_args(lambda updates, params, extra_args: fn(updates, params),
                                     traits)


@declare()
def stateless_with_tree_map(fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                            ) -> GradientTransformation:
    """A transform applying ``fn(update_leaf, param_leaf)`` to every leaf (``param_leaf`` is
    None when no params are given). It is per-leaf (`Traits.per_leaf`)."""

    def tree_fn(updates: Updates, params: Params | None) -> Updates:
        if params is None:
            return tree_map(lambda u: fn(u, None), updates)
        return tree_map(fn, updates, params)

    return stateless(tree_fn, LEAFWISE)


@declare()
def identity() -> GradientTransformation:
    """Leave updates unchanged.

    Example:
      >>> tx = opttx.chain(opttx.identity(), opttx.sgd(0.1))   # same as opttx.sgd(0.1)
    """
    return stateless(lambda updates, params: updates, ELEMENTWISE)


@declare()
def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros (the parameters do not move); used by `opttx.freeze`."""
    return stateless(lambda updates, params: tree_map(torch.zeros_like, updates), ELEMENTWISE)


def register_safe_globals() -> list[type]:
    """Allow opttx's state types in ``torch.load(path, weights_only=True)``.

    Functional states are trees of NamedTuples (`EmptyState`, ``ScaleByAdamState``,
    `opttx.MaskedNode`, ``QuantizedTensor``, ...); ``weights_only`` unpickling refuses any
    class it was not told about. ``import opttx`` calls this once, registering (with
    ``torch.serialization.add_safe_globals``) every public NamedTuple class of the opttx
    modules imported so far: plain containers of tensors whose reconstruction runs no code of
    the checkpoint's choosing. A state class of your own needs
    ``torch.serialization.add_safe_globals([MyState])``. Returns the classes registered.
    """
    import sys
    found: list[type] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "opttx" or name.startswith("opttx.")):
            continue
        for attr, obj in list(vars(module).items()):
            if (isinstance(obj, type) and obj.__module__ == name and issubclass(obj, tuple)
                    and hasattr(obj, "_fields") and not attr.startswith("_")
                    and obj is not GradientTransformation and obj not in found):
                found.append(obj)
    found.append(Static)
    add = getattr(getattr(torch, "serialization", None), "add_safe_globals", None)
    if add is not None:
        add(found)
    return found
