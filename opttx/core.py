"""The transform contract: `GradientTransformation`, the `Traits` that say what a transform
does, the `Role` of each field of a state, and the helpers every transform uses on its state
(`replace_state`, `advance_counts`, `keep_copy`, ...).

The modules below it in the layer table build on these (docs/design.md, section 1):
`opttx.declarations` (what a factory declares, the identity of its states),
`opttx.reduction` (the reduction hook of sharded runs), `opttx.updates` (applying updates to
the parameters); `opttx.base` re-exports them all.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from ._checks import check_floating
from .kernels import foreach_copy_, is_donating
from .tree import MaskedNode, PyTree, Static, tree_flatten, tree_leaves, tree_map, tree_unflatten

Params = PyTree
Updates = PyTree
State = PyTree
NamedTupleT = TypeVar("NamedTupleT", bound=tuple)

__all__ = [
    "ELEMENTWISE",
    "LEAFWISE",
    "OPTIONAL_MARK",
    "PRECONDITIONER",
    "GradientTransformation",
    "NamedTupleT",
    "Params",
    "Role",
    "State",
    "Traits",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
    "advance_counts",
    "check_init_params",
    "combine_traits",
    "declare_optional",
    "declare_roles",
    "fields_with_role",
    "is_masked",
    "is_optional_entry",
    "keep_copy",
    "leaf_roles",
    "optional_fields",
    "replace_state",
    "require_params",
    "safe_increment",
    "state_roles",
    "traits_of",
    "zero_count",
]


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> State: ...


class TransformUpdateFn(Protocol):
    def __call__(self, updates: Updates, state: State, params: Params | None = None,
                 **extra_args: Any) -> tuple[Updates, State]: ...


# ---------------------------------------------------------------------------------------------
# what a state field is, what a transform does (docs/design.md, section 3)
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
      ...     __roles__ = opttx.extend.declare_roles(step=opttx.extend.Role.COUNT,
      ...                                     exp_avg=opttx.extend.Role.FIRST_MOMENT,
      ...                                     exp_avg_sq=opttx.extend.Role.SECOND_MOMENT)
    """
    for name, role in roles.items():
        if not isinstance(role, Role):
            raise TypeError(f"declare_roles({name}=...) takes an opttx.extend.Role, got {role!r}.")
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
      ...     __roles__ = opttx.extend.declare_roles(inner=opttx.extend.Role.SAME_STATE,
      ...                                     master=opttx.extend.Role.PARAMS_LIKE,
      ...                                     started=opttx.extend.Role.PER_LEAF_SCALAR)
      ...     __optional__ = opttx.extend.declare_optional("master", "started")
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
    # an opttx.declarations.Recipe, named only: that module imports this one
    recipe: "Recipe | None" = None  # noqa: F821
    """How it was made: the declared factory and its arguments (see `declare`); None for a
    transform built directly from an ``(init, update)`` pair."""

    def __repr__(self) -> str:
        if self.recipe is None:
            return f"GradientTransformation(<undeclared>, {self.traits})"
        return f"GradientTransformation({self.recipe.describe()})"

    def __reduce__(self) -> tuple:
        if self.recipe is None:
            raise TypeError("this GradientTransformation was built from an (init, update) pair "
                            "without a declared factory, so it cannot be pickled or deep-"
                            "copied; build it with a factory decorated with opttx.extend.declare.")
        return self.recipe.pickled()     # closures do not pickle: rebuilt from the recipe


def traits_of(tx: GradientTransformation) -> Traits:
    """The declared `Traits` of ``tx`` (the defaults for a plain ``(init, update)`` pair)."""
    traits = getattr(tx, "traits", None)
    return traits if isinstance(traits, Traits) else Traits()


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
                        f"opttx.extend.declare_roles({name}=opttx.extend.Role.COUNT, ...) (see "
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
      >>> prev = opttx.extend.keep_copy(grads, prev)         # not ``prev = grads``
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


def is_masked(x: Any) -> bool:
    """Whether ``x`` is a `MaskedNode` placeholder."""
    return isinstance(x, MaskedNode)
