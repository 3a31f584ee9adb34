"""What you need to write a transform of your own (as ``jax.extend`` is for extending JAX).

``opttx`` holds what a user composes and runs (`opttx.adamw`, `opttx.chain`,
`opttx.Optimizer`, ...); ``opttx.extend`` holds the vocabulary for *writing* a
`opttx.GradientTransformation` that the rest of opttx (compiled steps, `opttx.Optimizer`,
`opttx.inject_hyperparams`, checkpoints, `opttx.stacked`, `opttx.distributed`) can run.
docs/guide/writing.md walks through three transforms written with it.

- **The per-leaf skeleton**: `leafwise` writes a transform's ``update`` from its
  mathematics, a step over lists of leaves (`as_tree` gives such a step the tree back);
  `stateless_leafwise` is the same for a transform without state;
  `stateless_with_extra_args` for one without state that reads ``update(..., **extra_args)``.
- **What a transform does** (`Traits`, read by the machinery): `ELEMENTWISE`, `LEAFWISE`,
  `PRECONDITIONER` (the common ones), `combine_traits`, `traits_of`.
- **What each state field is** (`Role`): `declare_roles`, `declare_optional`, `state_roles`,
  `leaf_roles`, `zero_count`.
- **How it was made** (`Recipe`, hyperparameters and their `HyperRole`): `declare`,
  `recipe_of`, `describe_transform`, `hyperparameter_roles`; `Static` marks an argument that
  is configuration, not a number to inject.
- **Checking arguments**: `checks` and its `check_positive`, `check_nonnegative`,
  `check_number`, `check_unit_interval`; `check_init_params`.
- **State helpers**: `keep_copy` (a state that keeps an input must not share its memory),
  `replace_state`, `stats_like`.
- **Statistics across leaves** (global norms, that `opttx.distributed` completes across
  ranks): `reduce_statistics`, `reduce_leaf_statistics`, `reduce_across_leaves`.

Example:
  >>> from opttx import extend
  >>> sign = extend.stateless_with_extra_args(
  ...     lambda updates, params, extra_args: opttx.tree.tree_map(torch.sign, updates),
  ...     extend.ELEMENTWISE)
  >>> traits = extend.traits_of(sign)

Each name here was also importable as ``opttx.<name>``; that spelling still works for one
release and warns (`DeprecationWarning`).
"""

from . import checks
from .base import (ELEMENTWISE, LEAFWISE, PRECONDITIONER, HyperRole, Recipe, Role, Traits,
                   check_init_params, combine_traits, declare, declare_optional, declare_roles,
                   describe_transform, keep_copy, leaf_roles, recipe_of, reduce_across_leaves,
                   reduce_leaf_statistics, reduce_statistics, replace_state, state_roles,
                   stateless_with_extra_args, traits_of, zero_count)
from .checks import check_nonnegative, check_number, check_positive, check_unit_interval
from .skeleton import as_tree, leafwise
from .transforms.common import stateless_leafwise
from .tree import Static, stats_like
from .wrappers import hyperparameter_roles

__all__ = [
    # the per-leaf skeleton
    "leafwise", "as_tree", "stateless_leafwise", "stateless_with_extra_args",
    # what a transform does: traits
    "Traits", "ELEMENTWISE", "LEAFWISE", "PRECONDITIONER", "combine_traits", "traits_of",
    # what each state field is: roles
    "Role", "declare_roles", "declare_optional", "state_roles", "leaf_roles", "zero_count",
    # how it was made: recipes and hyperparameters
    "Recipe", "HyperRole", "Static", "declare", "recipe_of", "describe_transform",
    "hyperparameter_roles",
    # checking arguments
    "checks", "check_positive", "check_nonnegative", "check_number", "check_unit_interval",
    "check_init_params",
    # state helpers
    "keep_copy", "replace_state", "stats_like",
    # statistics across leaves
    "reduce_statistics", "reduce_leaf_statistics", "reduce_across_leaves",
]
