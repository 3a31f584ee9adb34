"""The transform contract: `GradientTransformation`, the trivial transforms, applying updates,
and the reduction hook through which layer-wise statistics become sharding-aware."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator, Literal, NamedTuple, Protocol, TypeVar

import torch

from ._checks import check_floating
from ._tracing import is_tracing
from .kernels import foreach, foreach_, foreach_copy_, is_donating
from .tree import (MaskedNode, PyTree, Static, assert_same_structure, tree_flatten, tree_leaves,
                   tree_map, tree_paths, tree_unflatten)

Params = PyTree
Updates = PyTree
State = PyTree
NamedTupleT = TypeVar("NamedTupleT", bound=tuple)

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
    "leafwise",
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
]


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> State: ...


class TransformUpdateFn(Protocol):
    def __call__(self, updates: Updates, state: State, params: Params | None = None,
                 **extra_args: Any) -> tuple[Updates, State]: ...


# ---------------------------------------------------------------------------------------------
# declarations: what a state field is, what a transform does (docs/design.md, section 3)
# ---------------------------------------------------------------------------------------------


class Role(str, enum.Enum):
    """What a field of a transform's state is. Machinery that must treat fields differently
    (advancing counters on empty trees, rotating moments into a new low-rank basis, choosing
    an 8-bit map, naming checkpoint entries) reads these declarations, never field names.

    A state declares its roles with ``__roles__ = declare_roles(...)`` in its class body;
    fields it does not name have no role (`state_roles` gives None for them).
    """

    COUNT = "count"
    """A 0-dim integer step counter. Advanced by one on every update, also when the update
    holds no leaf (`advance_counts`), so counters of all ranks stay in step."""
    FIRST_MOMENT = "first_moment"
    """A signed statistic shaped like the updates, linear in the gradients (momentum, Adam's
    ``mu``): a low-rank basis change rotates it; 8-bit storage uses the signed map."""
    SECOND_MOMENT = "second_moment"
    """A non-negative statistic shaped like the updates, quadratic in the gradients (Adam's
    ``nu``, Adagrad's sum of squares): rotated as squares; 8-bit storage uses the unsigned
    map."""
    FACTORED_MOMENT = "factored_moment"
    """A non-negative row or column statistic of a factored second moment (Adafactor's
    ``v_row``/``v_col``): not shaped like the updates; unsigned 8-bit map."""
    PARAMS_LIKE = "params_like"
    """A signed tensor shaped like the parameters that is not a moment of the gradients (an
    iterate of Schedule-Free, an average of parameters): never rotated into a projected
    basis; signed 8-bit map."""
    FACTOR_MATRIX = "factor_matrix"
    """A matrix statistic over one dim of a block (Shampoo's Kronecker factors, their roots):
    needs the whole tensor, never quantized."""
    PROJECTION = "projection"
    """A basis (GaLore's projector, an eigenbasis): needs the whole tensor, never quantized."""
    QUANTIZED = "quantized"
    """A compressed copy standing for another field: block-wise 8-bit or packed 4-bit codes
    with their scales, FP8 values with per-block scales, or bfloat16 values with an error
    correction; each container records its own layout (see `opttx.quantize_state`)."""
    SCALAR = "scalar"
    """A 0-dim value shared by all leaves (Prodigy's distance estimate, an injected
    hyperparameter, a wrapper's step flags): one tensor whatever the layout of the leaves
    (`opttx.stacked` keeps it unstacked)."""
    PER_LEAF_SCALAR = "per_leaf_scalar"
    """One 0-dim value per leaf, in a tree like the params (a flag or a norm of each leaf):
    under `opttx.stacked` one value per slice, in a checkpoint one entry per parameter."""
    SAME_STATE = "same_state"
    """The whole state of the transform a wrapper keeps as its own (the argument its factory
    declares ``same_state_as``, `Declaration`; `opttx.distributed.offload` with
    ``master_params``): its checkpoint entries are named as that transform's alone (this
    field's name is not part of their keys), so a checkpoint moves between the two."""

    @property
    def like_updates(self) -> bool:
        """Whether a field of this role holds one tensor per leaf, shaped like that leaf."""
        return self in (Role.FIRST_MOMENT, Role.SECOND_MOMENT, Role.PARAMS_LIKE)

    @property
    def nonnegative(self) -> bool:
        """Whether every element of a field of this role is >= 0."""
        return self in (Role.SECOND_MOMENT, Role.FACTORED_MOMENT)


def declare_roles(**roles: Role) -> Mapping[str, Role]:
    """The ``__roles__`` of a state class: field name -> `Role`.

    Example:
      >>> class MyAdamState(NamedTuple):
      ...     step: torch.Tensor     # shape (), int32: steps taken
      ...     exp_avg: Updates       # like params: first moment
      ...     exp_avg_sq: Updates    # like params: second moment
      ...     __roles__ = opttx.declare_roles(step=opttx.Role.COUNT,
      ...                                     exp_avg=opttx.Role.FIRST_MOMENT,
      ...                                     exp_avg_sq=opttx.Role.SECOND_MOMENT)
    """
    for name, role in roles.items():
        if not isinstance(role, Role):
            raise TypeError(f"declare_roles({name}=...) takes an opttx.Role, got {role!r}.")
    return dict(roles)


OPTIONAL_MARK = "~"
"""The first character of the key segment of a field declared optional (`declare_optional`)
in checkpoint field paths (``"~master"``): a loader recognizes such entries by their keys
alone, also where its own state has no such field."""


def declare_optional(*fields: str) -> frozenset[str]:
    """The ``__optional__`` of a state class: fields that a checkpoint may lack, and that a
    run without them may skip (a copy kept beside what the state means: offload's float32
    master copy of the parameters). Their entries are keyed with `OPTIONAL_MARK` in front
    of the field's name; a loader ignores such entries its state does not have, and fills
    its own that the checkpoint lacks with zeros, so the state must read zeros in them as
    "absent" (a boolean ``started`` flag per leaf among them says whether the others hold
    values: per leaf, since a checkpoint may hold them for some parameters only, as one
    saved with fewer offloaded).

    Example:
      >>> class MasterState(NamedTuple):
      ...     inner: Any                  # the wrapped transform's state
      ...     master: Any                 # like params: the master copy
      ...     started: Any                # like params: (), bool, whether master holds values
      ...     __roles__ = opttx.declare_roles(inner=opttx.Role.SAME_STATE,
      ...                                     master=opttx.Role.PARAMS_LIKE,
      ...                                     started=opttx.Role.PER_LEAF_SCALAR)
      ...     __optional__ = opttx.declare_optional("master", "started")
    """
    for name in fields:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"declare_optional takes field names, got {name!r}.")
    return frozenset(fields)


def optional_fields(state: Any) -> frozenset[str]:
    """The fields of ``state`` (an instance or a class) declared optional in checkpoints
    (`declare_optional`); empty when none is."""
    cls = state if isinstance(state, type) else type(state)
    declared = getattr(cls, "__optional__", None)
    if not declared:
        return frozenset()
    unknown = set(declared) - set(getattr(cls, "_fields", declared))
    if unknown:
        raise TypeError(f"{cls.__name__}.__optional__ names {sorted(unknown)}, which are not "
                        f"fields of it.")
    return frozenset(declared)


def is_optional_entry(field_path: str) -> bool:
    """Whether a checkpoint entry's field path (``"~master"``, ``"1.~started"``) is in a
    field declared optional (`declare_optional`)."""
    return any(part.startswith(OPTIONAL_MARK) for part in field_path.split("."))


def state_roles(state: Any) -> Mapping[str, Role]:
    """The declared roles of the fields of ``state`` (an instance or a class); empty for a
    state that declares none (a dict, a tuple, a user NamedTuple without ``__roles__``)."""
    cls = state if isinstance(state, type) else type(state)
    roles = getattr(cls, "__roles__", None)
    if roles is None:
        return {}
    fields = getattr(cls, "_fields", None)
    if fields is not None:
        unknown = set(roles) - set(fields)
        if unknown:
            raise TypeError(f"{cls.__name__}.__roles__ names {sorted(unknown)}, which are not "
                            f"fields of it (fields: {list(fields)}).")
    return roles


def leaf_roles(state: Any) -> Any:
    """``state`` with every tensor replaced by the declared `Role` of the field it is in
    (None where no field around it declares one): what each state leaf is, for the machinery
    that lays states out (`opttx.stacked`). The innermost declaring field wins."""
    if isinstance(state, torch.Tensor):
        return None
    if isinstance(state, (Static, MaskedNode)):
        return state
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        roles = state_roles(state)
        out = {}
        for name in state._fields:
            child = getattr(state, name)
            inner = leaf_roles(child)
            role = roles.get(name)
            if role is not None:
                inner = tree_map(lambda r, _role=role: _role if r is None else r, inner,
                                 is_leaf=lambda x: x is None)
            out[name] = inner
        return type(state)(**out)
    if isinstance(state, (tuple, list)):
        return type(state)(leaf_roles(x) for x in state)
    if isinstance(state, dict):
        return type(state)((k, leaf_roles(v)) for k, v in state.items())
    return state


def fields_with_role(state: Any, *roles: Role) -> list[str]:
    """The names of the fields of ``state`` declared with one of ``roles``, in field order."""
    declared = state_roles(state)
    order = getattr(state, "_fields", tuple(declared))
    return [f for f in order if declared.get(f) in roles]


@dataclasses.dataclass(frozen=True)
class Traits:
    """What a transform does, for the machinery that runs it (docs/design.md, section 3).

    The defaults claim nothing: a transform built as ``GradientTransformation(init, update)``
    runs wherever no claim is needed, and is refused with a clear error where one is (for
    example by `opttx.stacked`, which needs ``per_leaf``)."""

    elementwise: bool = False
    """Each output element depends only on the same element of the updates, params and state
    (Adam, Lion): the transform may run on any flat or stacked layout of the leaves."""
    per_leaf: bool = False
    """Each leaf's output depends only on that leaf (element-wise, or a statistic of the leaf
    as Adafactor's row means or LAMB's trust ratio): the transform may run one leaf at a time
    (`opttx.FusedBackward`) or on stacked slices."""
    whole_leaves: bool = False
    """It needs whole tensors (an SVD, an eigendecomposition, a blocking by shape): local
    shards must be gathered to an owner first (`opttx.distributed.on_owners`)."""
    across_leaves: bool = False
    """It takes a statistic across leaves (a global norm, a finiteness test): it must see the
    whole tree at once, and reduces through `reduce_across_leaves` when sharded."""
    batched_across_leaves: bool = False
    """It computes the leaves of one shape together in batched kernels (Muon's orthogonalization:
    one batched matrix product per shape). Each leaf's output is its own in exact arithmetic
    (``per_leaf`` may hold), but it rounds with the batch: run on a part of the leaves (offload
    chunks, owner ranks) it agrees to rounding, not bit for bit."""
    takes_precondition_input: bool = False
    """Inside `opttx.graft` it takes its statistics from the updates and applies itself to
    ``extra_args[PRECONDITION_INPUT]`` (`precondition_leaves`); ``graft`` refuses a
    direction or magnitude transform without this trait instead of ignoring the input."""
    block_rows: int | None = None
    """It works on blocks of this many rows of each leaf and needs only whole blocks
    (Shampoo's blocks of ``max_preconditioner_dim``): a leaf split by rows at multiples of it
    (`opttx.distributed.zero`'s ``split_above_mb``) may run on its local rows although
    ``whole_leaves`` is set."""
    final_scale: bool = False
    """Its last operation multiplies every update by one scalar (the learning rate of
    `scale_by_learning_rate`, the factor of `scale`). Asked with a list under
    ``extra_args[DEFERRED_SCALE]``, its ``update`` appends that scalar to the list and
    returns the updates *unscaled*, so that the caller writes :math:`x + s u` in one fused
    add (`update_deferring_scale`, `apply_updates` with ``scale``): torch.optim's
    ``p.add_(u, alpha=-lr)``, one rounding and one pass fewer. `chain` has it when its last
    link has it; a wrapper claims it only by saying so."""
    collective_groups: tuple = ()
    """The process groups its ``update`` issues collectives over, on inputs that differ per
    rank (None: the default group): `opttx.distributed.zero`, ``sharded``, ``on_owners``,
    ``all_reduce_gradients``. A wrapper that decides from its own inputs whether to call it
    (`opttx.apply_if_finite`'s skip, `opttx.MultiSteps`' boundary) agrees on the decision
    over these groups first, so that every rank calls it alike."""


LEAFWISE = Traits(elementwise=False, per_leaf=True)
"""The traits of a transform that works leaf by leaf with statistics of each leaf."""
ELEMENTWISE = Traits(elementwise=True, per_leaf=True)
"""The traits of an element-wise transform."""
PRECONDITIONER = Traits(elementwise=True, per_leaf=True, takes_precondition_input=True)
"""The traits of an element-wise preconditioner that honours `PRECONDITION_INPUT`."""


DEFERRED_SCALE = "deferred_scale"
"""The ``extra_args`` key of a list in which a transform with `Traits.final_scale` reports
its final scalar instead of applying it (see `update_deferring_scale`)."""


def update_deferring_scale(tx: "GradientTransformation", updates: Updates, state: State,
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


def combine_traits(transforms: "tuple[GradientTransformation, ...]", **changes: Any) -> Traits:
    """The traits of transforms run one after another (a chain, or a wrapper around one):
    element-wise and per-leaf when all are, needing whole leaves or crossing leaves when any
    does."""
    traits = [traits_of(tx) for tx in transforms]
    rows = [t.block_rows for t in traits if t.block_rows is not None]
    combined = Traits(elementwise=all(t.elementwise for t in traits),
                      per_leaf=all(t.per_leaf for t in traits),
                      whole_leaves=any(t.whole_leaves for t in traits),
                      across_leaves=any(t.across_leaves for t in traits),
                      batched_across_leaves=any(t.batched_across_leaves for t in traits),
                      block_rows=math.lcm(*rows) if rows else None,
                      collective_groups=_union_of_groups(t.collective_groups for t in traits))
    return dataclasses.replace(combined, **changes)


def _union_of_groups(groups: Any) -> tuple:
    """The process groups of several transforms, each once (by identity), in order."""
    out: list[Any] = []
    for gs in groups:
        for g in gs:
            if not any(g is h for h in out):
                out.append(g)
    return tuple(out)


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra_args) -> (updates, new_state)``, and the
    `Traits` that say what the pair does (optional: the default claims nothing).

    ``update`` never mutates its inputs (see `opttx.donating` for the one, opt-in,
    exception that saves memory). ``extra_args`` are passed down a chain to every link, so a
    transform must accept and ignore the ones it does not know.
    """

    init: TransformInitFn
    update: TransformUpdateFn
    traits: Traits = Traits()
    recipe: "Recipe | None" = None
    """How it was made: the declared factory and its arguments (see `declare`); None for a
    transform built directly from an ``(init, update)`` pair."""

    def __repr__(self) -> str:
        if self.recipe is None:
            return f"GradientTransformation(<undeclared>, {self.traits})"
        return f"GradientTransformation({describe_transform(self)})"

    def __reduce__(self) -> tuple:
        # closures do not pickle: a declared transform is rebuilt from its recipe
        if self.recipe is None:
            raise TypeError("this GradientTransformation was built from an (init, update) pair "
                            "without a declared factory, so it cannot be pickled or deep-"
                            "copied; build it with a factory decorated with opttx.declare.")
        return (_rebuild, (self.recipe.factory, self.recipe.args, self.recipe.kwargs))


def traits_of(tx: GradientTransformation) -> Traits:
    """The declared `Traits` of ``tx`` (the defaults for a plain ``(init, update)`` pair)."""
    traits = getattr(tx, "traits", None)
    return traits if isinstance(traits, Traits) else Traits()


# ---------------------------------------------------------------------------------------------
# declarations of a factory: its hyperparameters, its configuration, the identity of its state
# ---------------------------------------------------------------------------------------------


class HyperRole(str, enum.Enum):
    """What a hyperparameter of a transform is, for the machinery that exposes it: the role
    decides its key in an `opttx.Optimizer` param group (torch.optim's names), so LR
    schedulers, ``OneCycleLR``'s momentum cycling and hand-written warm-ups find it.

    A factory declares its hyperparameters with `declare`; one without a role is shown under
    its own name."""

    LEARNING_RATE = "learning_rate"
    """A step size: the group's ``"lr"``. A transform with several (muon's
    ``adam_learning_rate``, a partition's links) shows the first under ``"lr"``; see
    `opttx.Optimizer` for how the others follow it."""
    B1 = "b1"
    """The decay of a first moment (Adam's beta1): ``group["betas"][0]``."""
    B2 = "b2"
    """The decay of a second moment (Adam's beta2): ``group["betas"][1]``."""
    MOMENTUM = "momentum"
    """A heavy-ball or Nesterov momentum coefficient: ``group["momentum"]``."""
    WEIGHT_DECAY = "weight_decay"
    """A weight decay coefficient: ``group["weight_decay"]``."""
    EPS = "eps"
    """A denominator's regulariser: ``group["eps"]``."""
    RMS_DECAY = "rms_decay"
    """The decay of RMSprop's average of squares: ``group["alpha"]`` (torch's name)."""

    @property
    def group_key(self) -> str:
        """The param-group key of torch.optim for this role (``"betas"`` for both betas)."""
        return {"learning_rate": "lr", "b1": "betas", "b2": "betas",
                "rms_decay": "alpha"}.get(self.value, self.value)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What a factory declares about its arguments (see `declare`)."""

    signature: inspect.Signature
    """The factory's signature (its arguments are bound to it)."""
    hyperparams: Mapping[str, "HyperRole | None"]
    """The arguments that are hyperparameters: numbers (or 0-dim tensors, or schedules of the
    step count) that may change between steps without changing what the state means;
    `opttx.inject_hyperparams` makes them 0-dim tensors in the state. Each with its role
    (None: no torch.optim name)."""
    runtime: frozenset[str]
    """Other arguments that may differ between a checkpoint and the run that resumes it
    (a refresh frequency, a warm-up length): part of the configuration that ranks must agree
    on, not of the state's identity."""
    same_state_as: str | None = None
    """The argument holding the transform whose state this one keeps as its own (a
    distributed layout of it: `opttx.distributed.sharded`, ``zero``, ``on_owners``): the
    identity is that transform's, so a checkpoint moves between layouts."""
    wraps: str | None = None
    """The argument holding the transform this wrapper calls from its ``update`` on the whole
    updates, keeping that transform's state whole inside its own (`opttx.apply_if_finite`,
    `opttx.multi_steps`): the wrapper may be rebuilt (`Recipe.rebuild`) around another way of
    running that transform with the same state, as `opttx.distributed.offload` does to run
    its chunks inside the wrapper."""


def _rebuild(factory: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``factory(*args, **kwargs)``: how a declared transform is unpickled."""
    return factory(*args, **kwargs)


_LONG = 160      # a tree argument described longer than this is named by its digest


def describe_value(value: Any, values: bool) -> str:
    """A canonical, deterministic description of an argument (the same in every process).

    Transforms are described by `describe_transform`; scalars by their ``repr``; enums,
    dtypes and tensors by their kind (a one-element tensor by its value when ``values``);
    lists and mappings item by item, a long tree of plain values by its digest; any other
    callable or object by its qualified name. The declared configurations of wrappers
    (`configuration_items`) are built from it."""
    if isinstance(value, GradientTransformation):
        return describe_transform(value, values=values)
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Tensor):
        if values and value.numel() == 1:
            return f"tensor({value.item()!r})"
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, (list, tuple)):
        items = list(value)
        text = "[" + ", ".join(describe_value(v, values) for v in items) + "]"
    elif isinstance(value, Mapping):
        items = list(value.values())
        text = "{" + ", ".join(f"{k!r}: {describe_value(v, values)}"
                               for k, v in value.items()) + "}"
    elif callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"<function {name}>"
    else:
        return f"<{type(value).__qualname__}>"
    # a long tree of plain values (a mask, labels) is named by its digest; transforms never
    if len(text) > _LONG and not any(isinstance(v, GradientTransformation) for v in items):
        import hashlib
        return f"<tree {hashlib.sha1(text.encode()).hexdigest()[:12]}>"
    return text


# the old private spelling, until distributed/zero.py imports `describe_value`
_describe = describe_value


def public_name(factory: Callable[..., Any]) -> str:
    """The name a factory is known by in messages and identities: its qualified name, prefixed
    by its module unless it is defined inside ``opttx``."""
    module = getattr(factory, "__module__", "") or ""
    name = getattr(factory, "__qualname__", None) or repr(factory)
    return name if module == "opttx" or module.startswith("opttx.") else f"{module}.{name}"


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """How a declared transform was made: its factory and every argument, by name (defaults
    included). `opttx.Optimizer` rebuilds a transform from it with its hyperparameters
    injected; pickling rebuilds from it; its `identity` names the state the transform makes."""

    factory: Callable[..., "GradientTransformation"]
    arguments: Mapping[str, Any]
    declaration: Declaration

    def __repr__(self) -> str:
        return f"Recipe({self.name}, {len(self.arguments)} arguments)"

    @property
    def name(self) -> str:
        """The factory's name (``"adamw"``; module-qualified outside opttx)."""
        return public_name(self.factory)

    @property
    def args(self) -> tuple:
        return inspect.BoundArguments(self.declaration.signature, dict(self.arguments)).args

    @property
    def kwargs(self) -> dict:
        return inspect.BoundArguments(self.declaration.signature, dict(self.arguments)).kwargs

    def configuration(self) -> tuple[tuple[str, str], ...]:
        """``(argument, description)`` of the arguments that decide what the state means:
        all but the hyperparameters and the runtime arguments."""
        skip = set(self.declaration.hyperparams) | self.declaration.runtime
        return tuple((k, describe_value(v, False)) for k, v in self.arguments.items()
                     if k not in skip)

    @property
    def identity(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """``(name, configuration)``: equal for two transforms whose states mean the same (the
        same factory and configuration; hyperparameters may differ). The ``made_by`` of the
        states it makes."""
        cached = self.__dict__.get("_identity")
        if cached is None:
            inner = self.declaration.same_state_as
            if inner is not None:
                recipe = recipe_of(self.arguments[inner])
                cached = recipe.identity if recipe is not None else \
                    ("<undeclared transform>", ())
            else:
                cached = (self.name, self.configuration())
            object.__setattr__(self, "_identity", cached)
        return cached

    @property
    def stamped_by(self) -> Any:
        """The identity its states carry in ``made_by``: its own, or, when the factory returned
        another declared factory's transform (``muon`` returns a ``partition``), that one's."""
        return self.__dict__.get("_stamped_by") or self.identity

    def rebuild(self, **changes: Any) -> "GradientTransformation":
        """The factory called again with ``changes`` to its arguments."""
        unknown = set(changes) - set(self.arguments)
        if unknown:
            raise TypeError(f"{self.name} has no argument(s) {sorted(unknown)}.")
        bound = inspect.BoundArguments(self.declaration.signature,
                                       {**dict(self.arguments), **changes})
        return self.factory(*bound.args, **bound.kwargs)


def format_identity(identity: Any) -> str:
    """``name(arg=value, ...)`` of an identity (`Recipe.identity`, a state's ``made_by``)."""
    if not (isinstance(identity, tuple) and len(identity) == 2):
        return repr(identity)
    name, config = identity
    return f"{name}(" + ", ".join(f"{k}={v}" for k, v in config) + ")"


def identity_differences(a: Any, b: Any) -> str:
    """What differs between two identities, in words (for error messages)."""
    if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2):
        return f"{format_identity(a)} vs {format_identity(b)}"
    if a[0] != b[0]:
        return f"made by {a[0]}, not {b[0]}"
    da, db = dict(a[1]), dict(b[1])
    diffs = [f"{k}: {da.get(k, '<absent>')} vs {db.get(k, '<absent>')}"
             for k in dict.fromkeys(list(da) + list(db)) if da.get(k) != db.get(k)]
    return "; ".join(diffs) or "the same configuration"


def recipe_of(tx: Any) -> "Recipe | None":
    """The `Recipe` of a declared transform, else None."""
    recipe = getattr(tx, "recipe", None)
    return recipe if isinstance(recipe, Recipe) else None


def describe_transform(tx: Any, values: bool = True) -> str:
    """``tx`` as ``factory(argument=value, ...)``, nested transforms described alike; with
    ``values=False`` only what decides the state's meaning (`Recipe.identity`), else every
    argument, hyperparameter values included (what ranks must agree on). An undeclared
    transform is ``"<undeclared transform>"``."""
    recipe = recipe_of(tx)
    if recipe is None:
        return "<undeclared transform>"
    if not values:
        return format_identity(recipe.identity)
    return f"{recipe.name}(" + ", ".join(f"{k}={describe_value(v, True)}"
                                          for k, v in recipe.arguments.items()) + ")"


def configuration_items(tx: Any, prefix: str | None = None) -> list[tuple[str, str]]:
    """Every argument of ``tx``'s recipe and of the recipes nested in it, hyperparameter
    values included, as ``(path, description)`` (``("adamw.learning_rate", "0.001")``): what
    the ranks of a distributed run must agree on. An undeclared transform is one item."""
    recipe = recipe_of(tx)
    prefix = (recipe.name if recipe is not None else "transform") if prefix is None else prefix
    if recipe is None:
        return [(prefix, "<undeclared transform>")]
    items: list[tuple[str, str]] = []

    def visit(path: str, value: Any) -> None:
        if isinstance(value, GradientTransformation):
            inner = recipe_of(value)
            items.extend(configuration_items(value, f"{path}:{inner.name}" if inner else path))
        elif isinstance(value, (list, tuple)) and any(
                isinstance(v, GradientTransformation) for v in value):
            for i, v in enumerate(value):
                visit(f"{path}[{i}]", v)
        elif isinstance(value, Mapping) and any(
                isinstance(v, GradientTransformation) for v in value.values()):
            for k, v in value.items():
                visit(f"{path}[{k!r}]", v)
        else:
            items.append((path, describe_value(value, True)))

    for name, value in recipe.arguments.items():
        visit(f"{prefix}.{name}", value)
    return items


def _stamp(state: Any, stamp: Static) -> Any:
    """``state`` with ``made_by = stamp`` when its root declares that field and no transform
    stamped it yet (a wrapper whose state is its inner transform's leaves it to that one)."""
    if isinstance(state, tuple) and "made_by" in getattr(type(state), "_fields", ()) and \
            isinstance(state.made_by, Static) and state.made_by.value is None:
        # a new Static each time: the closure's own instance in the state would make
        # torch.compile guard on the two being one object
        return replace_state(state, made_by=Static(stamp.value))
    return state


def _nested_identities(value: Any) -> list:
    """The identities of the declared transforms among ``value`` (an argument of a factory:
    a transform, or a list, tuple or dict of them), and of the transforms nested in those."""
    if isinstance(value, GradientTransformation):
        recipe = recipe_of(value)
        if recipe is None:
            return []
        found = [recipe.identity, recipe.stamped_by]
        for v in recipe.arguments.values():
            found += _nested_identities(v)
        return found
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _nested_identities(v)]
    if isinstance(value, Mapping):
        return [i for v in value.values() for i in _nested_identities(v)]
    return []


def _makers(state: Any, limit: int = 2) -> list[str]:
    """The outermost ``made_by`` stamps inside ``state``, formatted (at most ``limit``)."""
    found: list[str] = []

    def visit(node: Any) -> None:
        if len(found) >= limit:
            return
        made = getattr(node, "made_by", None) if isinstance(node, tuple) else None
        if isinstance(made, Static) and made.value is not None:
            found.append(format_identity(made.value))
            return
        children = node.values() if isinstance(node, Mapping) else \
            node if isinstance(node, (tuple, list)) else ()
        for child in children:
            visit(child)

    visit(state)
    return found


def check_state_type(state: Any, expected: type | tuple[type, ...], name: str,
                     what: str | None = None) -> None:
    """Refuse a ``state`` that is not of the ``expected`` type, naming what made it (its
    ``made_by`` stamps) so a state given to the wrong transform says whose it is; ``what``
    describes the expected state in words (default: the type's name)."""
    if isinstance(state, expected):
        return
    kinds = expected if isinstance(expected, tuple) else (expected,)
    makers = _makers(state)
    made = f" (made by {' and '.join(makers)})" if makers else ""
    raise TypeError(f"{name}.update got a state of type {type(state).__name__}{made}, "
                    f"expected {what or ' or '.join(k.__name__ for k in kinds)}: pass the "
                    "state made by this transform's init (a state of another transform or "
                    "configuration cannot be used).")


def check_made_by(state: Any, identity: Any, what: str | None = None,
                  also: Any = ()) -> None:
    """Refuse a state whose ``made_by`` names another transform or configuration than
    ``identity`` (or one of ``also``: the transforms a wrapper passes its state to). A state
    whose root has no ``made_by``, or an unset one, passes. A trace-time check under
    ``torch.compile``: ``made_by`` is a `Static`, part of the state's structure."""
    made = getattr(state, "made_by", None)
    if not isinstance(made, Static) or made.value is None or made.value == identity or \
            made.value in also:
        return
    name = what or (identity[0] if isinstance(identity, tuple) else "transform")
    raise TypeError(f"{name}.update got a state made by {format_identity(made.value)}, but this "
                    f"transform is {format_identity(identity)} "
                    f"({identity_differences(made.value, identity)}): a state of another "
                    "transform or configuration cannot be used; build the state with this "
                    "transform's init (or load a checkpoint made by the same configuration).")


def _declared_transform(tx: GradientTransformation, recipe: Recipe) -> GradientTransformation:
    """``tx`` with its recipe; when the factory built ``tx`` itself (no recipe yet) its init
    stamps ``made_by`` on a state that has the field and its update checks it."""
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{recipe.name} is declared with opttx.declare but returned a "
                        f"{type(tx).__name__}, not a GradientTransformation.")
    if tx.recipe is not None:       # made by another declared factory: it stamps its states
        object.__setattr__(recipe, "_stamped_by", tx.recipe.stamped_by)
        return GradientTransformation(tx.init, tx.update, tx.traits, recipe)
    inner_init, inner_update = tx.init, tx.update
    stamp = Static(recipe.identity)
    # a wrapper may hand its whole state to a transform it wraps (cautious, graft's
    # direction): a state stamped by one of those is its state too
    nested = tuple(i for v in recipe.arguments.values() for i in _nested_identities(v))

    def init(params: Params) -> State:
        return _stamp(inner_init(params), stamp)

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        # the transform hands ``made_by`` on itself (replace_state keeps it): restamping here
        # would differ from a step that rebuilt the transform inside a compiled graph
        check_made_by(state, stamp.value, also=nested)
        return inner_update(updates, state, params, **extra_args)

    return GradientTransformation(init, update, tx.traits, recipe)


_STEP_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("opttx_step_local",
                                                                  default=False)


def step_local_transforms() -> contextlib.AbstractContextManager:
    """Build transforms without their recipes inside the block: for a wrapper that rebuilds
    its inner transform in every ``update`` to run that one step (`opttx.inject_hyperparams`
    with this step's hyperparameter tensors, `opttx.partition` with this step's masks). Such a
    transform never leaves the step, the wrapper's own recipe describes it, and the outer
    state was checked already; skipping the recipes keeps the step's Python light. (Under
    ``torch.compile`` recipes are skipped anyway: the transform is traced, not kept, and
    Dynamo cannot enter the context variable.)"""
    if is_tracing():
        return contextlib.nullcontext()
    return _step_local_block()


@contextlib.contextmanager
def _step_local_block() -> Iterator[None]:
    token = _STEP_LOCAL.set(True)
    try:
        yield
    finally:
        _STEP_LOCAL.reset(token)


def declare(*, hyperparams: Mapping[str, "HyperRole | None"] | None = None,
            runtime: tuple[str, ...] = (), same_state_as: str | None = None,
            wraps: str | None = None) -> Callable[[Callable[..., GradientTransformation]],
                          Callable[..., GradientTransformation]]:
    """Declare a transform factory: which arguments are hyperparameters (and their roles),
    and which may change on resume; every other argument is configuration.

    The decorated factory returns its transform with a `Recipe` (the factory and every
    argument), from which:

    * `opttx.Optimizer` finds the hyperparameters and their roles (``lr``, ``betas``,
      ``momentum``, ``weight_decay``, ``eps`` in the param groups) and rebuilds the transform
      with them injected (`opttx.inject_hyperparams`), so a built transform is a full drop-in;
    * the states it makes carry their *identity* (``made_by``: the factory and its
      configuration), and ``update``, ``Optimizer.load_state_dict`` and the checkpoint loaders
      refuse a state of another transform or configuration, naming both;
    * ``opttx.distributed`` checks at ``init`` that every rank built the same transform with the
      same configuration and hyperparameters;
    * the transform pickles (it is rebuilt from the recipe).

    A state NamedTuple that has a field ``made_by: Static = Static()`` gets it stamped by the
    factory that builds the transform (not by a declared factory that returns another declared
    factory's transform: the state belongs to that one).

    So ``update`` checks the configuration of the factories that built the state. A factory
    of yours that returns opttx's transforms (a chain of them) adds its configuration to the
    recipe, which ``Optimizer.load_state_dict`` compares (the group key ``"transform"``) and
    ``opttx.distributed``'s ranks agree on, but not to the state: its stamps are those of the
    transforms it returns (and a chain's state is a tuple, with no field to stamp). An
    argument of yours that reaches one of them as configuration is checked by ``update``
    (``nesterov`` given to `opttx.trace`); one that reaches them only as a hyperparameter
    (``decay``), or that picks numbers in your own code, is not: the state fits either value.
    To have ``update`` check your whole configuration, return a transform whose state
    NamedTuple has the ``made_by`` field (it is then stamped with your factory's identity).

    Args:
      hyperparams: argument name -> `HyperRole` (or None: a hyperparameter without a torch.optim
        name). Only these are injected and shown in param groups.
      runtime: arguments that may differ on resume (refresh frequencies, warm-up lengths):
        excluded from the state's identity, not from what ranks must agree on.
      same_state_as: for a wrapper that keeps the state of the transform it is given (a
        distributed layout of it), the name of that argument: the identity is that
        transform's.
      wraps: for a wrapper that calls the transform it is given on the whole updates and
        keeps its state whole (`Declaration.wraps`), the name of that argument.

    Example:
      >>> @opttx.declare(hyperparams={"learning_rate": opttx.HyperRole.LEARNING_RATE,
      ...                             "decay": opttx.HyperRole.MOMENTUM})
      ... def my_momentum(learning_rate: float, decay: float = 0.9, nesterov: bool = False):
      ...     return opttx.chain(opttx.trace(decay, nesterov),
      ...                        opttx.scale_by_learning_rate(learning_rate))
    """
    hyperparams = dict(hyperparams or {})
    for name, role in hyperparams.items():
        if role is not None and not isinstance(role, HyperRole):
            raise TypeError(f"declare(hyperparams={{{name!r}: ...}}) takes an opttx.HyperRole "
                            f"or None, got {role!r}.")

    def decorate(factory: Callable[..., GradientTransformation]
                 ) -> Callable[..., GradientTransformation]:
        signature = inspect.signature(factory)
        unknown = (set(hyperparams) | set(runtime) | {same_state_as, wraps} - {None}) - \
            set(signature.parameters)
        if unknown:
            raise TypeError(f"declare: {getattr(factory, '__name__', factory)} has no "
                            f"argument(s) {sorted(unknown)}.")
        declaration = Declaration(signature, dict(hyperparams), frozenset(runtime),
                                  same_state_as, wraps)

        positional = [n for n, p in signature.parameters.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        learning_rates = {n for n, role in hyperparams.items()
                          if role is HyperRole.LEARNING_RATE}

        @functools.wraps(factory)
        def declared(*args: Any, **kwargs: Any) -> GradientTransformation:
            if is_tracing():
                # built inside a compiled function: a Python-float hyperparameter would be a
                # constant of the graph (a recompile for every new value, and a symbolic float
                # that the checks cannot read once Dynamo makes it dynamic); as a 0-dim tensor
                # it is a graph input, as an injected hyperparameter is. Learning rates only:
                # they are scale factors everywhere, while a factory may decide in Python on
                # its other hyperparameters (graft's filter on beta1, Shampoo's bias correction
                # on beta2 == 1), also when another factory's body calls it
                args = tuple(_as_graph_input(a) if i < len(positional) and
                             positional[i] in learning_rates else a for i, a in enumerate(args))
                kwargs = {k: _as_graph_input(v) if k in learning_rates else v
                          for k, v in kwargs.items()}
                return factory(*args, **kwargs)   # traced, not kept: no recipe
            tx = factory(*args, **kwargs)
            if _STEP_LOCAL.get():
                return tx       # built to run inside one step (see step_local_transforms)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return _declared_transform(tx, Recipe(declared, dict(bound.arguments),
                                                  declaration))

        declared.__declaration__ = declaration     # type: ignore[attr-defined]
        return declared

    return decorate


def _as_graph_input(value: Any) -> Any:
    """A Python number as a float64 0-dim tensor (in a traced function); anything else as
    it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.scalar_tensor(value, dtype=torch.float64)
    return value


def declaration_of(factory: Any) -> "Declaration | None":
    """The `Declaration` of a factory decorated with `declare`, else None."""
    declaration = getattr(factory, "__declaration__", None)
    return declaration if isinstance(declaration, Declaration) else None


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


# ---------------------------------------------------------------------------------------------
# applying updates
# ---------------------------------------------------------------------------------------------


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


def _stochastic_pairs(p_leaves: list, u_leaves: list, scale: float = 1.0
                      ) -> tuple[list, list, list, list]:
    """Split leaves into bfloat16 parameters (written with stochastic rounding) and others."""
    sr_p, sr_u, rest_p, rest_u = [], [], [], []
    for p, u in zip(p_leaves, u_leaves):
        if p.dtype == torch.bfloat16:
            sr_p.append(p)
            sr_u.append(u if scale == 1.0 else u * scale)
        else:
            rest_p.append(p)
            rest_u.append(u.to(p.dtype))
    return sr_p, sr_u, rest_p, rest_u


def _kind(x: torch.Tensor) -> Any:
    """What a grouped (``_foreach``) kernel cannot mix: plain tensors, and DTensors per mesh
    and placements (a tree under ``parallelize_module`` holds both)."""
    mesh = getattr(x, "device_mesh", None)
    if mesh is None:
        return None
    return (id(mesh), tuple(x.placements))


def _as_real_view(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(x) if x.is_complex() else x


def _foreach_add(p_leaves: list[torch.Tensor], u_leaves: list[torch.Tensor],
                 inplace: bool, alpha: float = 1.0) -> list[torch.Tensor]:
    """``p + alpha · u`` (or ``p += alpha · u``) with one grouped kernel per kind of leaf
    (see `_kind`)."""
    if alpha != 1.0 and any(p.is_complex() for p in p_leaves):
        # a real factor scales each part alike, as torch.optim's real views do (a complex
        # multiply-add would round the parts otherwise)
        views = [_as_real_view(p) for p in p_leaves], [_as_real_view(u) for u in u_leaves]
        out = _foreach_add(*views, inplace=inplace, alpha=alpha)
        if inplace:
            return list(p_leaves)
        return [torch.view_as_complex(o) if p.is_complex() else o
                for o, p in zip(out, p_leaves)]
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(p_leaves):
        groups.setdefault(_kind(p), []).append(i)
    out: list[Any] = list(p_leaves)
    for idx in groups.values():
        ps, us = [p_leaves[i] for i in idx], [u_leaves[i] for i in idx]
        if inplace:
            foreach_("add", ps, us, alpha=alpha)
        else:
            for i, r in zip(idx, foreach("add", ps, us, alpha=alpha)):
                out[i] = r
    return out


def _scaled_updates(u_leaves: list, scale: Any) -> tuple[list, float]:
    """The updates and the ``alpha`` of the fused add that writes ``x + scale·u``: a number
    goes into the add itself (one rounding, as torch.optim's ``add_(u, alpha=-lr)``); a
    tensor scale (traced, scheduled) multiplies the updates first."""
    if scale is None:
        return u_leaves, 1.0
    if isinstance(scale, torch.Tensor):
        return [(u * scale).to(u.dtype) for u in u_leaves], 1.0
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
    u_leaves, alpha = _scaled_updates(u_leaves, scale)
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
    return tree_unflatten(_foreach_add(p_leaves, u_leaves, inplace=False, alpha=alpha), spec)


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
    u_leaves, alpha = _scaled_updates(u_leaves, scale)
    if stochastic_rounding:
        sr_p, sr_u, p_leaves, u_leaves = _stochastic_pairs(p_leaves, u_leaves, alpha)
        for p, u in zip(sr_p, sr_u):
            round_stochastic_(p, p.float() + u.float(), generator)
        _foreach_add(p_leaves, u_leaves, inplace=True, alpha=alpha)
        return params
    u_leaves = [u.to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    _foreach_add(p_leaves, u_leaves, inplace=True, alpha=alpha)
    return params


# ---------------------------------------------------------------------------------------------
# helpers shared by transforms
# ---------------------------------------------------------------------------------------------


def replace_state(state: NamedTupleT, **fields: Any) -> NamedTupleT:
    """``state._replace(**fields)``: a copy of the NamedTuple ``state`` with ``fields``
    changed, built by its constructor.

    Transforms use this, never ``_replace``: torch 2.11's Dynamo reconstructs a NamedTuple
    made by a traced ``_replace`` as an *empty* tuple when it leaves the graph, so a compiled
    step that returns its state would return ``TraceState()`` with no fields (fixed in later
    torch; `tests/test_compile.py` checks that no transform calls ``_replace``).

    Example:
      >>> from opttx.transforms.moments import TraceState
      >>> s = opttx.base.replace_state(TraceState(trace={"w": 0}), trace={"w": 1})
      >>> s.trace
      {'w': 1}
    """
    unknown = set(fields) - set(state._fields)
    if unknown:
        raise TypeError(f"{type(state).__name__} has no field(s) {sorted(unknown)}")
    return type(state)(*(fields[f] if f in fields else v
                         for f, v in zip(state._fields, state)))


def advance_counts(state: State) -> State:
    """``state`` with every step counter (a field declared `Role.COUNT`, at any depth)
    advanced by one and nothing else changed: what an update on a tree without leaves leaves
    behind (a rank that owns no leaf under `opttx.distributed.zero` or ``on_owners``, a label
    of `opttx.partition` that matches nothing), so counters stay in step with the ranks that
    do have leaves.

    Raises:
      TypeError: a NamedTuple state that declares no roles holds a 0-dim integer tensor: it
        may be a counter, and advancing it or not would be a guess.
    """
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        fields = {name: advance_counts(getattr(state, name)) for name in state._fields}
        if getattr(type(state), "__roles__", None) is None:
            for name, x in fields.items():
                if isinstance(x, torch.Tensor) and x.ndim == 0 and \
                        not x.dtype.is_floating_point:
                    raise TypeError(
                        f"{type(state).__name__}.{name} is a 0-dim integer tensor but the "
                        f"state declares no roles, so opttx cannot tell whether it counts "
                        f"steps. Declare them in the class body: __roles__ = "
                        f"opttx.declare_roles({name}=opttx.Role.COUNT, ...) (see "
                        f"docs/guide/writing.md).")
        for name in fields_with_role(state, Role.COUNT):
            fields[name] = safe_increment(getattr(state, name))
        return type(state)(**fields)
    if isinstance(state, (tuple, list)):
        return type(state)(advance_counts(x) for x in state)
    if isinstance(state, dict):
        return {k: advance_counts(v) for k, v in state.items()}
    return state


def zero_count(params: Params) -> torch.Tensor:
    """A 0-dim int32 step counter on the device of the first parameter."""
    leaves = [x for x in tree_leaves(params) if isinstance(x, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    return torch.zeros((), dtype=torch.int32, device=device)


def keep_copy(values: PyTree, buffers: PyTree | None = None) -> PyTree:
    """A copy of ``values`` for the state to keep: tensors read from the caller's updates,
    params or gradients (a previous gradient, a starting point) must not be stored as they
    are, since the caller may overwrite them after the step (``zero_grad(set_to_none=False)``,
    an in-place step, a reused gradient buffer) and the state would change with them.

    ``values`` is a list of tensors (a `leafwise` step's) or a tree; the result has its
    structure. ``buffers``, the state's buffers that the copy replaces, give the dtype of the
    copy, and inside `opttx.donating` the copy is written into them in place (no new memory);
    without ``buffers`` each tensor is cloned in its own dtype.
    `opttx.testing.check_transform` checks that no state shares memory with its inputs.

    Example (a transform that keeps the previous gradient; in its ``update``, ``grads`` are
    the updates it was given and ``prev`` the state's buffers):
      >>> prev = {k: torch.zeros_like(g) for k, g in grads.items()}
      >>> prev = opttx.keep_copy(grads, prev)         # not ``prev = grads``
      >>> grads["w"].zero_()                          # the caller reuses its buffer
      >>> bool(prev["w"].abs().sum() > 0)
      True
    """
    leaves, spec = tree_flatten(values)
    if buffers is None:
        return tree_unflatten([x.clone() for x in leaves], spec)
    olds = tree_flatten(buffers)[0]
    if len(olds) != len(leaves):
        raise ValueError(f"keep_copy: {len(leaves)} values but {len(olds)} buffers; pass the "
                         "state's buffers that the values replace, one per value.")
    if is_donating():
        foreach_copy_(olds, leaves)
        return tree_unflatten(list(olds), spec)
    return tree_unflatten([x.to(o.dtype, copy=True) for x, o in zip(leaves, olds)], spec)


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, saturating at the largest value of its dtype instead of wrapping."""
    limit = torch.iinfo(count.dtype).max
    return torch.where(count < limit, count + 1, count)


def require_params(params: Params | None, name: str) -> Params:
    """Raise a clear error when a transform that reads the parameters got none."""
    if params is None:
        raise ValueError(f"{name} needs the current parameters: call "
                         f"tx.update(updates, state, params) with params.")
    return params


def check_init_params(params: Params) -> None:
    """Common checks of the tree given to ``init``: floating-point tensor leaves only."""
    check_floating(params)


# ---------------------------------------------------------------------------------------------
# the reduction hook (docs/design.md, rule 6)
# ---------------------------------------------------------------------------------------------

REDUCER_KEY = "opttx_reducer"
"""The key of ``extra_args`` under which `opttx.distributed` passes its reducer."""

TOTALS_KEY = "opttx_totals"
"""The key of ``extra_args`` under which a distributed wrapper that hands whole leaves to owner
ranks (`opttx.distributed.sharded` with ``on_owners=True``, `opttx.distributed.zero`) passes
the function that combines statistics taken across leaves (see `reduce_across_leaves`)."""

ReduceOp = Literal["sum", "max"]


_INIT_REDUCER: contextvars.ContextVar[Any] = contextvars.ContextVar("opttx_init_reducer",
                                                                  default=None)


def current_reducer(extra_args: dict[str, Any] | None = None) -> Any:
    """The reducer of the enclosing `opttx.distributed.sharded`, or None on one device.

    In ``update`` it is ``extra_args[REDUCER_KEY]``; ``init`` has no extra_args, so
    ``sharded`` sets it for the duration of ``tx.init`` (`reducer_during_init`) and
    ``current_reducer()`` (no argument) reads it there. Transforms use it for decisions that
    must be taken on the global shapes (Adafactor's factoring) and for whole-leaf checks."""
    if extra_args is not None:
        return extra_args.get(REDUCER_KEY)
    return _INIT_REDUCER.get()


@contextlib.contextmanager
def reducer_during_init(reducer: Any) -> Iterator[None]:
    """Make ``reducer`` the `current_reducer` of the ``init`` calls inside the block (None:
    none, as for whole leaves at owner ranks)."""
    token = _INIT_REDUCER.set(reducer)
    try:
        yield
    finally:
        _INIT_REDUCER.reset(token)


def reduce_statistics(partials: PyTree, extra_args: dict[str, Any], op: ReduceOp = "sum",
                      dims: PyTree | None = None) -> PyTree:
    """Step (b) of every layer-wise reduction: combine local partial statistics over shards.

    ``partials`` is a tree with the structure of the updates (`MaskedNode` where a leaf is
    absent) whose leaves are the *local* partial statistics of each leaf (a sum of squares, a
    row sum, ...). ``dims`` gives, per leaf, the tuple of the leaf's dims that the statistic
    was reduced over (None: all of them). On unsharded leaves this is the identity; under
    `opttx.distributed.sharded` the reducer passed in ``extra_args[REDUCER_KEY]`` turns it into
    collectives over the process groups that shard those dims, batched over all leaves.
    """
    reducer = extra_args.get(REDUCER_KEY)
    if reducer is None:
        return partials
    return reducer(partials, op=op, dims=dims)


LEAF_SPEC_KEY = "opttx_leaf_spec"
"""The key of ``extra_args`` under which `leafwise` hands its ``step`` the spec of the tree
its lists of leaves come from (read by `reduce_leaf_statistics`)."""


def reduce_leaf_statistics(partials: Sequence[torch.Tensor], extra_args: dict[str, Any],
                           op: ReduceOp = "sum", spec: Any = None) -> list[torch.Tensor]:
    """Step (b) of rule 6 for a *list* of per-leaf partial statistics, one per leaf in the
    order of the leaves: `reduce_statistics` of the tree they stand for, as a list again.

    Inside a `leafwise` step the tree's spec comes with ``extra_args``; elsewhere pass the
    ``spec`` of the updates (``spec, g = flatten_matching(updates)``). Unsharded it returns
    ``partials`` unchanged, with no work.

    Example (in a leafwise step, each leaf's sum of squares, whole when sharded; unsharded,
    as here, the partials come back as they are):
      >>> g = [torch.ones(3), torch.ones(2, 2)]
      >>> sq = reduce_leaf_statistics([x.square().sum() for x in g], extra_args={})
    """
    if extra_args.get(REDUCER_KEY) is None:
        return list(partials)
    spec = extra_args.get(LEAF_SPEC_KEY) if spec is None else spec
    if spec is None:
        raise ValueError("reduce_leaf_statistics needs the spec of the tree the partials "
                         "belong to: call it in a leafwise step, or pass spec=.")
    from .tree import flatten_matching
    return flatten_matching(reduce_statistics(tree_unflatten(list(partials), spec),
                                              extra_args, op))[1]


def require_whole_leaves(updates: PyTree, extra_args: dict[str, Any], name: str,
                         block_rows: int | None = None) -> None:
    """Raise when a transform that needs whole matrices (an SVD, an eigendecomposition of a
    factor, a blocking by shape) is handed local shards: under `opttx.distributed.sharded`
    that would silently be an approximation on the local block. The reducer in
    ``extra_args[REDUCER_KEY]`` knows which leaves are sharded; a trace-time check, free at
    run time. ``block_rows``: the transform needs only whole blocks of that many rows, so
    rows split at multiples of it pass (`Traits.block_rows`)."""
    check = getattr(extra_args.get(REDUCER_KEY), "require_whole", None)
    if check is not None:
        if block_rows is None:
            check(updates, name)
        else:
            check(updates, name, block_rows=block_rows)


def reduce_across_leaves(total: torch.Tensor, extra_args: dict[str, Any],
                         op: ReduceOp = "sum") -> torch.Tensor:
    """Step (c') of a statistic taken across leaves (a global norm): combine this rank's
    ``total`` over the leaves it holds with the totals of the ranks holding the others.
    ``total`` is a tensor of any shape (one total, or several stacked: one collective).

    Call it after `reduce_statistics` and the local sum over leaves, on every rank, even one
    that holds no leaf (its total is zero): when whole leaves are spread over owner ranks
    (``extra_args[TOTALS_KEY]``, one collective), each leaf is on exactly one rank; otherwise
    (one device, or local shards whose per-leaf statistics `reduce_statistics` already made
    whole) it is the identity.
    """
    combine = extra_args.get(TOTALS_KEY)
    if combine is None:
        return total
    return combine(total, op=op)


PRECONDITION_INPUT = "precondition_input"
"""The ``extra_args`` key under which `opttx.graft` passes the (filtered) gradient that a
preconditioning transform should apply itself to, while its statistics come from ``updates``
(the raw gradient). `scale_by_rms`, `scale_by_rss` and `precondition_shampoo` honour it."""


def precondition_target(updates: Updates, extra_args: dict[str, Any]) -> Updates:
    """What a preconditioning transform applies itself to: ``extra_args[PRECONDITION_INPUT]``
    when `opttx.graft` provides one, else the updates themselves."""
    return extra_args.get(PRECONDITION_INPUT, updates)


def precondition_leaves(grads: list[torch.Tensor], extra_args: dict[str, Any]
                        ) -> list[torch.Tensor]:
    """The leaves a preconditioner applies itself to inside a `leafwise` step: those of
    ``extra_args[PRECONDITION_INPUT]`` when `opttx.graft` provides one, else ``grads``."""
    if PRECONDITION_INPUT in extra_args:
        return tree_leaves(extra_args[PRECONDITION_INPUT])
    return grads


def is_masked(x: Any) -> bool:
    """Whether ``x`` is a `MaskedNode` placeholder."""
    return isinstance(x, MaskedNode)
