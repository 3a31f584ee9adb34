"""opttx: Optax's functional optimizer design for PyTorch.

An optimizer is a `GradientTransformation` — a pair of pure functions ``init(params)`` and
``update(updates, state, params)`` over pytrees of tensors — composed from small transforms
with `chain`. Every transform compiles inside one ``torch.compile(fullgraph=True)`` train
step; `Optimizer` runs any of them as a drop-in ``torch.optim.Optimizer``.

This package holds what a user composes and runs; the vocabulary for writing a transform of
your own (traits, roles, declarations, `leafwise`, argument checks) is `opttx.extend`.

Example:
  >>> import opttx
  >>> tx = opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adamw(3e-4, weight_decay=0.1))
  >>> state = tx.init(params)
  >>> updates, state = tx.update(grads, state, params)
  >>> params = opttx.apply_updates(params, updates)
"""

import warnings as _warnings

# core: the contract, applying updates, trees and kernels
from . import checks, extend, schedules, transforms, tree  # noqa: F401  (checks: the module)
from ._tracing import is_tracing
from .base import (EmptyState, GradientTransformation, apply_updates, apply_updates_, identity,
                   register_safe_globals as _register_safe_globals, round_stochastic_,
                   set_to_zero, stateless, stateless_with_tree_map, update_deferring_scale)
from .kernels import donating
from .tree import MaskedNode, tree_copy_
# schedules
from .schedules import (constant_schedule, cosine_decay_schedule, exponential_decay,
                        join_schedules, linear_schedule, piecewise_constant_schedule,
                        polynomial_schedule, warmup_constant_schedule,
                        warmup_cosine_decay_schedule, warmup_stable_decay_schedule)
# transforms: every name of opttx.transforms.__all__
from .transforms import *
from .transforms import __all__ as _transforms_all
# combinators, wrappers and layouts
from .combine import (MaskedState, PartitionState, chain, chain_links, freeze, masked,
                      multi_transform, named_chain, partition)
from .layout import FlatParams, FlattenState, flatten
from .stacked import StackedParams, StackedState, stacked
from .wrappers import (ApplyIfFiniteState, InjectHyperparamsState, MultiSteps, MultiStepsState,
                       apply_if_finite, inject_all_hyperparams, inject_hyperparams,
                       set_hyperparams_)
# aliases: every name of opttx.aliases.__all__ (the named optimizers)
from .aliases import *
from .aliases import __all__ as _aliases_all
# the torch.optim.Optimizer runners
from .backward import FusedBackward
from .optim import Optimizer
from .optim.weight_ema import swap_ema

__version__ = "0.1.0"

__all__ = [
    # core: the contract, applying updates, trees and kernels
    "GradientTransformation", "EmptyState", "apply_updates", "apply_updates_",
    "update_deferring_scale", "round_stochastic_", "identity", "set_to_zero", "stateless",
    "stateless_with_tree_map", "MaskedNode", "tree_copy_", "donating", "is_tracing",
    "tree", "transforms", "schedules",
    # schedules
    "constant_schedule", "cosine_decay_schedule", "exponential_decay", "join_schedules",
    "linear_schedule", "piecewise_constant_schedule", "polynomial_schedule",
    "warmup_constant_schedule", "warmup_cosine_decay_schedule",
    "warmup_stable_decay_schedule",
    # transforms (opttx.transforms)
    *_transforms_all,
    # combinators, wrappers and layouts
    "chain", "chain_links", "named_chain", "masked", "MaskedState", "freeze", "partition",
    "multi_transform", "PartitionState", "flatten", "FlatParams", "FlattenState", "stacked",
    "StackedParams", "StackedState", "apply_if_finite", "ApplyIfFiniteState",
    "inject_hyperparams", "inject_all_hyperparams", "InjectHyperparamsState",
    "set_hyperparams_", "MultiSteps", "MultiStepsState",
    # aliases: the named optimizers (opttx.aliases)
    *_aliases_all,
    # the torch.optim.Optimizer runners
    "Optimizer", "FusedBackward",
    "swap_ema",
]

# opttx's state NamedTuples load with torch.load(weights_only=True) (see register_safe_globals)
_register_safe_globals()

# the transform-writing vocabulary moved to opttx.extend; opttx.<name> still works for one
# release (opttx.checks stays: it is the module itself)
_MOVED_TO_EXTEND = frozenset(extend.__all__) - {"checks"}


def __getattr__(name: str):
    """``opttx.<name>`` for a name that moved to `opttx.extend`: the object, with a
    `DeprecationWarning`."""
    if name in _MOVED_TO_EXTEND:
        _warnings.warn(f"opttx.{name} moved to opttx.extend.{name}; opttx.{name} is deprecated "
                       "and will be removed in the next release", DeprecationWarning,
                       stacklevel=2)
        return getattr(extend, name)
    raise AttributeError(f"module 'opttx' has no attribute {name!r}")
