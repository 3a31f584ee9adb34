"""opttx: Optax's functional optimizer design for PyTorch.

An optimizer is a `GradientTransformation` — a pair of pure functions ``init(params)`` and
``update(updates, state, params)`` over pytrees of tensors — composed from small transforms
with `chain`. Every transform compiles inside one ``torch.compile(fullgraph=True)`` train
step; `Optimizer` runs any of them as a drop-in ``torch.optim.Optimizer``.

Example:
  >>> import opttx
  >>> tx = opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adamw(3e-4, weight_decay=0.1))
  >>> state = tx.init(params)
  >>> updates, state = tx.update(grads, state, params)
  >>> params = opttx.apply_updates(params, updates)
"""

from . import schedules, transforms, tree
from .aliases import (adafactor, adagrad, adalomo, adam, adamw, adamw_4bit, adamw_8bit, came,
                      galore_adamw, galore_adamw_8bit, lamb, lars, lion, nadam, rmsprop, sgd,
                      shampoo)
from .aliases import ademamix, adopt
from .aliases import adabelief, adamax, muon, muon_hidden_matrices, radam
from .aliases import mars
from .aliases import prodigy, schedule_free_adamw, schedule_free_sgd
from .aliases import soap
from .backward import FusedBackward
from .base import (ELEMENTWISE, LEAFWISE, PRECONDITIONER, EmptyState, GradientTransformation,
                   Role, Traits, apply_updates, apply_updates_, check_init_params,
                   combine_traits, declare_optional, declare_roles, identity,
                   round_stochastic_, set_to_zero, state_roles, stateless,
                   stateless_with_tree_map, traits_of, update_deferring_scale, zero_count)
from .skeleton import leafwise
from .combine import (MaskedState, PartitionState, chain, chain_links, freeze, masked,
                      multi_transform, named_chain, partition)
from .layout import FlatParams, FlattenState, flatten
from .optim import Optimizer
from .stacked import StackedParams, StackedState, stacked
from .schedules import (constant_schedule, cosine_decay_schedule, exponential_decay,
                        join_schedules, linear_schedule, piecewise_constant_schedule,
                        polynomial_schedule, warmup_constant_schedule,
                        warmup_cosine_decay_schedule, warmup_stable_decay_schedule)
from .transforms import *  # noqa: F401,F403  (the public transforms and their states)
from .transforms import __all__ as _transforms_all
from .kernels import donating
from ._tracing import is_tracing
from .tree import MaskedNode, tree_copy_
from .wrappers import (ApplyIfFiniteState, InjectHyperparamsState, MultiSteps, MultiStepsState,
                       apply_if_finite, hyperparameter_roles, inject_all_hyperparams,
                       inject_hyperparams, set_hyperparams_)
from .base import (HyperRole, Recipe, declare, describe_transform, leaf_roles, recipe_of)
from .base import (keep_copy, reduce_across_leaves, reduce_leaf_statistics, reduce_statistics,
                   replace_state, stateless_with_extra_args)
from . import checks
from .checks import check_nonnegative, check_number, check_positive, check_unit_interval
from .tree import stats_like
from .tree import Static

__version__ = "0.1.0"

# opttx's state NamedTuples load with torch.load(weights_only=True) (see register_safe_globals)
from .base import register_safe_globals as _register_safe_globals  # noqa: E402

_register_safe_globals()

__all__ = [
    "ApplyIfFiniteState", "EmptyState", "FlatParams", "FlattenState", "FusedBackward",
    "GradientTransformation", "StackedParams", "StackedState", "stacked",
    "InjectHyperparamsState", "MaskedNode", "MaskedState", "MultiSteps", "MultiStepsState",
    "Optimizer", "PartitionState", "adafactor", "adagrad", "adalomo", "adam", "adamw",
    "adamw_4bit", "adamw_8bit", "apply_if_finite", "apply_updates", "apply_updates_", "came",
    "chain",
    "chain_links",
    "constant_schedule", "cosine_decay_schedule", "donating", "exponential_decay", "flatten",
    "freeze", "galore_adamw", "galore_adamw_8bit", "identity", "inject_hyperparams",
    "join_schedules", "lamb", "lars", "linear_schedule", "lion", "masked", "multi_transform",
    "nadam", "named_chain", "partition", "piecewise_constant_schedule", "polynomial_schedule",
    "rmsprop", "round_stochastic_", "schedules", "set_hyperparams_", "set_to_zero", "sgd", "shampoo", "stateless",
    "stateless_with_tree_map", "transforms", "update_deferring_scale", "tree", "tree_copy_", "warmup_constant_schedule",
    "warmup_cosine_decay_schedule", "warmup_stable_decay_schedule", *_transforms_all,
    # the vocabulary for writing a transform (docs/guide/writing.md)
    "ELEMENTWISE", "LEAFWISE", "PRECONDITIONER", "Role", "Traits", "check_init_params",
    "combine_traits", "declare_optional", "declare_roles", "leafwise", "state_roles",
    "traits_of", "zero_count",
    # declarations: hyperparameters, configuration and the identity of states
    "HyperRole", "Recipe", "Static", "declare", "describe_transform", "hyperparameter_roles",
    "inject_all_hyperparams", "leaf_roles", "recipe_of",
    # what a transform of your own needs (docs/guide/writing.md)
    "checks", "check_nonnegative", "check_number", "check_positive", "check_unit_interval",
    "keep_copy", "reduce_across_leaves", "reduce_leaf_statistics", "reduce_statistics",
    "replace_state", "stateless_with_extra_args", "stats_like",
    # torch.optim's remaining first-order set
    "adabelief", "adamax", "radam",
    # ADOPT and AdEMAMix
    "ademamix", "adopt",
    # Muon
    "muon", "muon_hidden_matrices",
    # MARS
    "mars",
    # Schedule-Free and Prodigy
    "prodigy", "schedule_free_adamw", "schedule_free_sgd",
    # SOAP
    "soap",
]

# the Muon family
from .aliases import adamuon, dion, dion2, kron, muon_clip, normuon  # noqa: E402

__all__ += ["adamuon", "dion", "dion2", "kron", "muon_clip", "normuon"]
__all__ += ["is_tracing"]
