"""Wrappers: `inject_hyperparams`, `apply_if_finite`, `MultiSteps`."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch

from ._checks import check_positive_int
from ._tracing import is_tracing
from .base import (Declaration, GradientTransformation, HyperRole, Params, Recipe, Role, State,
                   Updates, describe_value, public_name, check_made_by, check_state_type,
                   combine_traits, current_reducer, declaration_of, declare, declare_roles,
                   recipe_of, reduce_across_leaves, safe_increment, step_local_transforms,
                   traits_of, zero_count)
from .kernels import LiveFloat, foreach, foreach_axpy, keeping_state
from .tree import (PyTree, Static, find_instances, flatten_matching, stats_like, tree_cond,
                   tree_leaves, tree_map, tree_unflatten)

__all__ = [
    "ApplyIfFiniteState",
    "InjectHyperparamsState",
    "MultiSteps",
    "MultiStepsState",
    "apply_if_finite",
    "hyperparameter_roles",
    "InjectedHyperparameter",
    "inject_all_hyperparams",
    "inject_hyperparams",
    "injected",
    "multi_steps",
    "set_hyperparams_",
]


# ---------------------------------------------------------------------------------------------
# inject_hyperparams
# ---------------------------------------------------------------------------------------------


class InjectHyperparamsState(NamedTuple):
    """State of a transform built with `inject_hyperparams`."""
    count: torch.Tensor                 # shape (), int32: steps taken (the schedules' argument)
    hyperparams: dict[str, torch.Tensor]  # name -> 0-dim tensor (float64, CPU): current value
    inner_state: State                  # the wrapped transform's state
    roles: Static = Static()  # ((name, HyperRole value or None, is a schedule, value given), ...)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, hyperparams=Role.SCALAR)


class InjectedHyperparameter(NamedTuple):
    """What `hyperparameter_roles` says of one injected hyperparameter."""
    role: HyperRole | None   # as the factory declared it (None: none, or undeclared factory)
    schedule: bool           # it follows a schedule of the step count (not settable)
    given: Any               # the value given at construction (a Python number, or None)


def hyperparameter_roles(state: InjectHyperparamsState) -> dict[str, InjectedHyperparameter]:
    """``name ->`` `InjectedHyperparameter` of the injected hyperparameters of ``state``, as
    the factory declared them (`opttx.extend.declare`)."""
    return {name: InjectedHyperparameter(HyperRole(role) if role is not None else None,
                                         schedule, given)
            for name, role, schedule, given in (state.roles.value or ())}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_injectable(value: Any) -> bool:
    """Floats and 0-dim floating tensors become state; ints stay Python values, since they
    usually decide shapes or control flow (sizes, steps, offsets)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.is_floating_point()
    return isinstance(value, float)


def _is_schedule(value: Any, name: str | None = None) -> bool:
    """For an undeclared factory: a function of the step count alone (callable with one
    positional argument). Callables that need more stay Python values (Adafactor's
    ``decay_rate_fn(step, exponent)``), and so do functions passed as an argument whose
    ``name`` says it is a mask, labels or axes (functions of the params); another function of
    one argument that is not a schedule is named in ``static_args``."""
    if not callable(value) or isinstance(value, GradientTransformation):
        return False
    if name is not None and any(word in name for word in ("mask", "label", "axes")):
        return False            # a function of the params (adamw's mask=, muon's matrix_axes=)
    return _takes_one_argument(value)


def _takes_one_argument(value: Any) -> bool:
    try:
        inspect.signature(value).bind(0)
    except TypeError:
        return False
    except ValueError:          # no signature (a builtin): assume a schedule
        return True
    return True


def _split_arguments(inner_factory: Callable[..., GradientTransformation], arguments: dict,
                     static: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """``(schedules, numbers, other)``: the arguments of ``inner_factory`` to inject as
    schedules evaluated every step, as 0-dim tensors, and to keep as Python values.

    A declared factory (`opttx.extend.declare`) injects exactly its declared hyperparameters whose
    values are numbers, 0-dim floating tensors or schedules (functions of the step count); an
    undeclared one, every float and 0-dim floating tensor, and every function of one
    argument not named like a mask, labels or axes."""
    declaration = declaration_of(inner_factory)
    schedules, numeric, other = {}, {}, {}
    for name, value in arguments.items():
        if name in static or isinstance(value, bool):
            other[name] = value
        elif declaration is not None:
            if name not in declaration.hyperparams:
                other[name] = value
            elif _is_number(value) or _is_injectable(value):
                numeric[name] = float(value) if _is_number(value) else value
            elif callable(value) and not isinstance(value, GradientTransformation) and \
                    _takes_one_argument(value):
                schedules[name] = value
            else:
                other[name] = value     # None (a part left out), a tuple, a 1-D tensor
        elif _is_schedule(value, name):
            schedules[name] = value
        elif _is_injectable(value):
            numeric[name] = value
        else:
            other[name] = value
    return schedules, numeric, other


def _call_plan(factory: Callable[..., GradientTransformation]) -> tuple[tuple[str, str], ...]:
    """How ``_call`` passes each argument of ``factory``: ``(name, kind)`` pairs in the order of
    its signature, read once outside traced code (Dynamo does not trace ``inspect``)."""
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.POSITIONAL_OR_KEYWORD: "either",
             inspect.Parameter.VAR_POSITIONAL: "spread",
             inspect.Parameter.KEYWORD_ONLY: "keyword",
             inspect.Parameter.VAR_KEYWORD: "spread_keywords"}
    return tuple((name, kinds[p.kind])
                 for name, p in inspect.signature(factory).parameters.items())


def _call(factory: Callable[..., GradientTransformation], arguments: Mapping[str, Any],
          plan: tuple[tuple[str, str], ...] | None = None) -> GradientTransformation:
    """``factory`` called with ``arguments`` by name, in the order of its signature (so a
    ``*transforms`` or ``**kwargs`` argument is spread again, as it was given): positional
    arguments stay positional until the first one left out, the rest go by keyword."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    gap = False
    for name, kind in plan if plan is not None else _call_plan(factory):
        if name not in arguments:
            gap = gap or kind in ("positional", "either")
            continue
        value = arguments[name]
        if kind == "spread":
            if gap:
                raise TypeError(f"{public_name(factory)}: *{name} given after a positional "
                                "argument that was left out")
            args.extend(value)
        elif kind == "spread_keywords":
            kwargs.update(value)
        elif kind == "positional" or (kind == "either" and not gap):
            args.append(value)
        else:
            kwargs[name] = value
    return factory(*args, **kwargs)


def _injected_identity(inner_factory: Callable[..., GradientTransformation],
                       other: dict) -> tuple:
    """The identity of an injected transform: the inner factory and its configuration (what is
    not injected, less the declared hyperparameters and runtime arguments)."""
    declaration = declaration_of(inner_factory)
    skip = set(declaration.hyperparams) | declaration.runtime if declaration else set()
    config = tuple((k, describe_value(v, False)) for k, v in other.items() if k not in skip)
    return ("inject_hyperparams", (("inner", public_name(inner_factory)),) + config)


def _read_for_free(value: torch.Tensor) -> bool:
    """Whether an eager step reads the injected ``value`` as a Python number: a plain 0-dim
    tensor on the CPU, where ``.item()`` costs a microsecond and no device sync (not a tensor
    of a trace, of ``vmap`` or another subclass, nor one on an accelerator)."""
    return type(value) is torch.Tensor and value.device.type == "cpu" and \
        not torch._C._functorch.is_functorch_wrapped_tensor(value)


def _as_arguments(hyperparams: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The injected values as the inner factory is called with them: in eager code each value
    on the CPU as the Python number it holds (exact: a float64 tensor holds the number given),
    so the factory takes the very decisions and kernels of the functional path (Adam's
    ``eps_root == 0`` fast path, a grouped kernel's Python scalar), marked live
    (`opttx.kernels.LiveFloat`: an optional term stays in the state's structure at 0);
    under tracing (`opttx.is_tracing`) the tensors themselves, graph inputs that change
    without a recompile. A tensor off the CPU (a tensor ``lr`` the user shares, on the GPU) is
    passed as it is: reading it would sync the device."""
    if is_tracing():
        return hyperparams
    return {name: LiveFloat(value.item()) if _read_for_free(value) else value
            for name, value in hyperparams.items()}


def injected(inner_factory: Callable[..., GradientTransformation], arguments: Mapping[str, Any],
             static_args: tuple[str, ...] = (), hyperparam_dtype: torch.dtype | None = None
             ) -> GradientTransformation:
    """``inner_factory(**arguments)`` with its hyperparameters in the state: what
    ``inject_hyperparams(inner_factory, static_args, hyperparam_dtype)(**arguments)`` returns
    (this function is its recipe: it pickles)."""
    static = (static_args,) if isinstance(static_args, str) else tuple(static_args)
    declaration = declaration_of(inner_factory)
    schedules, numeric, other = _split_arguments(inner_factory, dict(arguments), static)
    plan = _call_plan(inner_factory)
    sample = _call(inner_factory, arguments, plan)  # validates the values once
    roles = Static(tuple(
        (name, (declaration.hyperparams.get(name).value
                if declaration and declaration.hyperparams.get(name) is not None else None),
         name in schedules, numeric[name] if isinstance(numeric.get(name), float) else None)
        for name in list(numeric) + list(schedules)))
    made_by = Static(_injected_identity(inner_factory, other))
    dtype = hyperparam_dtype or torch.float64

    def as_tensor(value: Any, device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.detach().clone().to(device)
        return torch.tensor(value, dtype=dtype)     # on the CPU: read for free (see above)

    def evaluate_schedules(count: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: torch.as_tensor(fn(count)).to(dtype) for name, fn in schedules.items()}

    def init(params: Params) -> InjectHyperparamsState:
        count = zero_count(params)
        hyperparams = {name: as_tensor(v, count.device) for name, v in numeric.items()}
        hyperparams.update(evaluate_schedules(count))
        inner = _call(inner_factory, {**other, **_as_arguments(hyperparams)}, plan)
        return InjectHyperparamsState(count=count, hyperparams=hyperparams,
                                      inner_state=inner.init(params), roles=roles,
                                      made_by=made_by)

    def update(updates: Updates, state: InjectHyperparamsState,
               params: Params | None = None, **extra_args: Any
               ) -> tuple[Updates, InjectHyperparamsState]:
        if not isinstance(state, InjectHyperparamsState):
            raise TypeError(f"inject_hyperparams({public_name(inner_factory)}).update got a "
                            f"state of type {type(state).__name__}, expected "
                            "InjectHyperparamsState: pass the state made by its init.")
        check_made_by(state, made_by.value)
        hyperparams = dict(state.hyperparams)
        hyperparams.update(evaluate_schedules(state.count))
        with step_local_transforms():       # rebuilt for this step only: no recipes
            inner = _call(inner_factory, {**other, **_as_arguments(hyperparams)}, plan)
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        return updates, InjectHyperparamsState(count=safe_increment(state.count),
                                               hyperparams=hyperparams,
                                               inner_state=inner_state, roles=state.roles,
                                               made_by=state.made_by)

    recipe = Recipe(injected, {"inner_factory": inner_factory, "arguments": dict(arguments),
                               "static_args": static, "hyperparam_dtype": hyperparam_dtype},
                    _INJECTED_DECLARATION)
    object.__setattr__(recipe, "_identity", made_by.value)
    # what the transform does is unchanged by where its hyperparameters live
    return GradientTransformation(init, update, traits_of(sample), recipe)


_INJECTED_DECLARATION = Declaration(inspect.signature(injected), {}, frozenset())


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation],
                       static_args: str | tuple[str, ...] = (),
                       hyperparam_dtype: torch.dtype | None = None
                       ) -> Callable[..., GradientTransformation]:
    """Make the numeric hyperparameters of a transform part of its state.

    ``inject_hyperparams(opttx.adamw)(learning_rate=1e-3, weight_decay=0.1)`` builds a
    transform with the same numbers as ``opttx.adamw(1e-3, weight_decay=0.1)`` whose
    learning rate, betas, eps and weight decay live in ``state.hyperparams`` as 0-dim tensors.
    Changing them between steps (`set_hyperparams_`, or a torch LR scheduler driving
    `opttx.Optimizer`) does not recompile a compiled step. Hyperparameters given as schedules
    are evaluated at every step from the count and their current value is stored in the
    state too (handy for logging).

    *Precision and speed.* A number is stored as a float64 0-dim tensor on the CPU: exactly
    the Python float given. An eager step calls the factory with the values as Python floats
    (`opttx.kernels.LiveFloat`, read with a free ``.item()`` on the CPU), so it computes what
    ``inner_factory`` with those numbers computes, bit for bit and with the same kernels;
    under ``torch.compile`` it passes the tensors (graph inputs; complements such as
    ``1 - b2`` formed in float64 in the graph). A 0-dim tensor given as a value keeps its
    dtype and moves to the parameters' device; off the CPU it is passed as a tensor (reading
    it would sync the device).

    Which arguments are injected is *declared* by the factory (`opttx.extend.declare`): its
    hyperparameters whose values are numbers, 0-dim floating tensors or schedules (functions
    of the step count); the state also records each one's role (``state.roles``, read by
    `opttx.Optimizer` for torch's param-group keys). For a factory that declares nothing, every
    float and 0-dim floating tensor is injected, and every function of one argument is taken
    for a schedule unless its name says mask, labels or axes.

    Args:
      inner_factory: a function returning a `GradientTransformation` (an alias or transform).
      static_args: names of arguments to keep as Python values even if declared.
      hyperparam_dtype: dtype of the injected values (default float64, so that they equal
        the Python floats they replace; float32 rounds them, and every step computes with
        the rounded numbers: ``1 - float32(0.9999)`` is 1.000166e-4).

    Example:
      >>> tx = opttx.inject_hyperparams(opttx.adamw)(learning_rate=1e-3)
      >>> state = tx.init(params)
      >>> opttx.set_hyperparams_(state, learning_rate=3e-4)   # in place; no recompile
    """
    static = (static_args,) if isinstance(static_args, str) else tuple(static_args)
    signature = inspect.signature(inner_factory)

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return injected(inner_factory, dict(bound.arguments), static, hyperparam_dtype)

    wrapped.__doc__ = f"`{getattr(inner_factory, '__name__', 'transform')}` with its numeric " \
                      "hyperparameters injected into the state (see opttx.inject_hyperparams)."
    wrapped.__signature__ = signature       # type: ignore[attr-defined]
    return wrapped


def inject_all_hyperparams(tx: GradientTransformation,
                           hyperparam_dtype: torch.dtype | None = None) -> GradientTransformation:
    """``tx`` rebuilt from its recipe with every declared hyperparameter injected: each
    declared factory in it (`opttx.extend.declare`; a chain's links, a wrapper's inner transform, at
    any depth) is rebuilt as ``inject_hyperparams(factory)(...)`` with the arguments it was
    given, so the hyperparameters of a *built* transform live in its state as 0-dim tensors.
    This is what `opttx.Optimizer` does to a transform it is given.

    Transforms without a recipe (built from an ``(init, update)`` pair) and transforms already
    injected are kept as they are. The numbers are those of ``tx``: the injected values have
    ``hyperparam_dtype`` (float64 by default, exactly the Python floats, on the CPU), and an
    eager step of the result is the eager step of ``tx``, bit for bit (see
    `inject_hyperparams`). With another dtype the numbers are rounded to it.

    Example:
      >>> tx = opttx.inject_all_hyperparams(opttx.chain(opttx.clip_by_global_norm(1.0),
      ...                                               opttx.adamw(1e-3)))
      >>> state = tx.init(params)
      >>> opttx.set_hyperparams_(state, learning_rate=3e-4)
    """
    recipe = recipe_of(tx)
    if recipe is None or recipe.factory is injected:
        return tx
    arguments = dict(recipe.arguments)
    changed = {}
    for name, value in arguments.items():
        new = _with_live_transforms(value, hyperparam_dtype)
        if new is not value:
            changed[name] = new
    arguments.update(changed)
    schedules, numeric, _ = _split_arguments(recipe.factory, arguments, ())
    if numeric or schedules:
        return injected(recipe.factory, arguments, (), hyperparam_dtype)
    return recipe.rebuild(**changed) if changed else tx


def _with_live_transforms(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` (an argument of a factory) with the transforms in it made live
    (`inject_all_hyperparams`); the same object when nothing changed."""
    if isinstance(value, GradientTransformation):
        return inject_all_hyperparams(value, dtype)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        new = [_with_live_transforms(v, dtype) for v in value]
        return type(value)(new) if any(a is not b for a, b in zip(new, value)) else value
    if isinstance(value, dict):
        new = {k: _with_live_transforms(v, dtype) for k, v in value.items()}
        return type(value)(new) if any(new[k] is not value[k] for k in value) else value
    return value


def find_injected_states(state: PyTree) -> list[InjectHyperparamsState]:
    """Every `InjectHyperparamsState` in ``state`` (outermost first)."""
    return find_instances(state, InjectHyperparamsState)


@torch.no_grad()
def set_hyperparams_(state: PyTree, **values: float) -> None:
    """Set injected hyperparameters in place (``fill_``), wherever in ``state`` they live.

    Raises ``KeyError`` for a name no injected state holds. In place, so a compiled step that
    takes ``state`` as input sees the new value without recompiling.
    """
    states = find_injected_states(state)
    for name, value in values.items():
        targets = [s.hyperparams[name] for s in states if name in s.hyperparams]
        if not targets:
            known = sorted({k for s in states for k in s.hyperparams})
            raise KeyError(f"No injected hyperparameter {name!r}; the state holds {known}.")
        for t in targets:
            t.fill_(value)


# ---------------------------------------------------------------------------------------------
# apply_if_finite
# ---------------------------------------------------------------------------------------------


class ApplyIfFiniteState(NamedTuple):
    """State of `apply_if_finite`."""
    notfinite_count: torch.Tensor  # shape (), int32: consecutive non-finite steps so far
    last_finite: torch.Tensor      # shape (), bool: whether the last step's updates were finite
    total_notfinite: torch.Tensor  # shape (), int32: non-finite steps skipped in total
    inner_state: State             # the wrapped transform's state
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(notfinite_count=Role.SCALAR, last_finite=Role.SCALAR,
                              total_notfinite=Role.SCALAR)


def all_finite(tree: PyTree) -> torch.Tensor:
    """A 0-dim bool tensor: every element of every leaf is finite."""
    leaves = tree_leaves(tree)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(x).all() for x in leaves]).all()


def _all_finite_everywhere(updates: Updates, extra_args: dict[str, Any],
                           groups: tuple = ()) -> torch.Tensor:
    """`all_finite` over the whole tree even when it is spread over ranks, so that every rank
    takes the same decision (and the same branch, with the same collectives inside it).

    The count of non-finite elements is summed over every rank that takes part (see
    `_across_ranks`): on local shards (`opttx.distributed.sharded`, whose reducer is in
    ``extra_args``) over every rank of the default group, since a leaf replicated over some
    ranks may hold a NaN on one rank only; with whole leaves spread over owner ranks
    (``zero``, ``on_owners``) through `reduce_across_leaves`; and around a transform that
    runs collectives on rank-local inputs (``groups``: ``apply_if_finite(zero(...))``) over
    its groups. One collective each."""
    spec, leaves = flatten_matching(updates)
    counts = [(~torch.isfinite(_local(x))).sum().to(torch.float32) for x in leaves]
    total = torch.stack(counts).sum() if counts else torch.zeros(())
    return _across_ranks(total, extra_args, groups, on_leaf_device=bool(leaves)) == 0


def _local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (FSDP2's gradients), any other tensor as it is: the counts
    are summed over the ranks explicitly."""
    return x.to_local() if hasattr(x, "to_local") else x


def _across_ranks(total: torch.Tensor, extra_args: dict[str, Any], groups: tuple,
                  op: str = "sum", on_leaf_device: bool = True) -> torch.Tensor:
    """``total`` (this rank's part of a decision's statistic) combined over every rank that
    must take the same decision: under `opttx.distributed.sharded` (a reducer in
    ``extra_args``) over the default group (which holds every other group), else over the
    owner ranks of `reduce_across_leaves` and then over each process group of ``groups``
    (the `Traits.collective_groups` of the wrapped transform). The identity on one
    process."""
    reducer = current_reducer(extra_args)
    if reducer is not None:     # every rank of the default group: the groups are within it
        return _reduce_over_group(total, op, None, on_leaf_device,
                                  getattr(reducer, "stats", None))
    total = reduce_across_leaves(total, extra_args, op)
    for group in groups:
        total = _reduce_over_group(total, op, group, on_leaf_device, None)
    return total


def _several_ranks() -> bool:
    """Whether this process is one of several in an initialised default process group."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _reduce_over_group(total: torch.Tensor, op: str, group: Any, on_leaf_device: bool,
                       stats: Any) -> torch.Tensor:
    """``total`` reduced (``op``) over the ranks of ``group`` (None: the default group): one
    functional all-reduce, traced by ``torch.compile`` without a graph break; the identity
    on one process."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return total
    group = dist.group.WORLD if group is None else group
    if dist.get_world_size(group) == 1:
        return total
    import torch.distributed._functional_collectives as funcol
    device = total.device
    if dist.get_backend(group) == "nccl" and (not on_leaf_device or device.type != "cuda"):
        total = total.to(torch.device("cuda", torch.cuda.current_device()))
    if stats is not None:
        stats.record(group, total)
    return funcol.wait_tensor(funcol.all_reduce(total, op, group)).to(device)


@declare(runtime=("max_consecutive_errors",), wraps="inner")
def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int, *,
                    check_state: bool = False) -> GradientTransformation:
    """Skip steps whose incoming updates hold an inf or NaN: zero updates, state kept.

    After more than ``max_consecutive_errors`` consecutive bad steps the update is applied
    anyway (so a run that has truly diverged is not silently frozen). Counts of skipped steps
    are in the state. Under ``torch.compile`` the skip is a ``torch.cond`` in one graph.

    In a distributed run the decision is global, wherever the wrapper is placed: one
    non-finite element on any rank skips the step on every rank (one small all-reduce of
    the count of non-finite elements, traced without a graph break). Inside
    `opttx.distributed.sharded`, ``zero`` or ``on_owners`` it goes over the ranks holding the
    other shards or leaves; around them (``apply_if_finite(zero(adamw(...)), 3)``, and
    around ``all_reduce_gradients`` in a chain) over the process groups the wrapped
    transform declares (`opttx.extend.Traits.collective_groups`), since the local gradients it sees
    differ per rank. Inside or around `opttx.distributed.offload` (and ``zero(...,
    offload=...)``) the skip is decided once over every chunk (offload runs its chunks
    inside the wrapper).

    What the default cannot see: only the *incoming* updates are tested. Finite gradients
    can still overflow inside the inner transform's statistics: squares of gradients above
    about 1e19 are inf in float32 (Adam's and RMSprop's ``nu``, Adafactor's and CAME's row and
    column means, NAdam's products, the block scales of 8-bit states, GaLore's projections),
    after which the state holds inf or NaN and the updates of those elements are 0 or NaN
    for good; an inf or NaN already in the state (loaded from a checkpoint) is not seen
    either. ``check_state=True`` also tests the inner transform's new updates and every
    floating-point leaf of its new state, and keeps the old state when any is not finite.
    It runs the inner update on every step (also on the skipped ones, whose result is then
    dropped) and holds the old and the new state at once (no donation of the old buffers).

    Args:
      inner: the wrapped transform.
      max_consecutive_errors: bad steps in a row skipped before one is applied anyway.
      check_state: also require the inner transform's new updates and state to be finite.

    Example:
      >>> tx = opttx.apply_if_finite(opttx.adam(1e-3), max_consecutive_errors=5)
      >>> tx = opttx.apply_if_finite(opttx.adafactor(1e-2), 5, check_state=True)
    """
    if not isinstance(max_consecutive_errors, int) or max_consecutive_errors < 0:
        raise ValueError("max_consecutive_errors must be an integer >= 0, got "
                         f"{max_consecutive_errors!r}.")
    groups = traits_of(inner).collective_groups     # the ranks that must decide alike

    def init(params: Params) -> ApplyIfFiniteState:
        zero = zero_count(params)
        return ApplyIfFiniteState(notfinite_count=zero, last_finite=torch.ones_like(zero,
                                  dtype=torch.bool), total_notfinite=zero.clone(),
                                  inner_state=inner.init(params))

    def decide(finite: torch.Tensor, state: ApplyIfFiniteState
               ) -> tuple[torch.Tensor, torch.Tensor]:
        notfinite_count = torch.where(finite, torch.zeros_like(state.notfinite_count),
                                      safe_increment(state.notfinite_count))
        return notfinite_count, finite | (notfinite_count > max_consecutive_errors)

    def update(updates: Updates, state: ApplyIfFiniteState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ApplyIfFiniteState]:
        check_state_type(state, ApplyIfFiniteState, "apply_if_finite")
        if check_state:
            # the old state must survive a rejected step (a compiled step never donates)
            with keeping_state():
                new_updates, new_inner = inner.update(updates, state.inner_state, params,
                                                      **extra_args)
            floating = [x for x in tree_leaves(new_inner)
                        if isinstance(x, torch.Tensor) and x.is_floating_point()]
            finite = _all_finite_everywhere((updates, new_updates, floating), extra_args,
                                            groups)
            finite = finite.to(state.last_finite.device)
            notfinite_count, apply = decide(finite, state)
            # both branches return the operands' structure (tree_cond's contract)
            updates, inner_state, _ = tree_cond(
                apply, lambda u, new, old: (u, new, old),
                lambda u, new, old: (tree_map(torch.zeros_like, u), old, old),
                (new_updates, new_inner, state.inner_state))
        else:
            finite = _all_finite_everywhere(updates, extra_args, groups).to(
                state.last_finite.device)
            notfinite_count, apply = decide(finite, state)

            def do_update(u: Updates, s: State) -> tuple[Updates, State]:
                return inner.update(u, s, params, **extra_args)

            def skip(u: Updates, s: State) -> tuple[Updates, State]:
                return tree_map(torch.zeros_like, u), s

            updates, inner_state = tree_cond(apply, do_update, skip,
                                             (updates, state.inner_state))
        total = state.total_notfinite + (~finite).to(state.total_notfinite.dtype)
        return updates, ApplyIfFiniteState(notfinite_count=notfinite_count, last_finite=finite,
                                           total_notfinite=total, inner_state=inner_state,
                                           made_by=state.made_by)

    return GradientTransformation(init, update, combine_traits((inner,), across_leaves=True))


# ---------------------------------------------------------------------------------------------
# MultiSteps
# ---------------------------------------------------------------------------------------------


class MultiStepsState(NamedTuple):
    """State of `MultiSteps`."""
    mini_step: torch.Tensor      # shape (), int32: mini-steps accumulated since the last update
    gradient_step: torch.Tensor  # shape (), int32: inner updates made so far
    inner_opt_state: State       # the wrapped transform's state
    acc_grads: Updates           # like params (fp32 for 16-bit leaves): accumulated gradients
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(mini_step=Role.SCALAR, gradient_step=Role.SCALAR,
                              acc_grads=Role.FIRST_MOMENT)


class MultiSteps:
    """Gradient accumulation: call the inner transform once every ``every_k_schedule`` calls.

    Each call adds the gradient into one accumulator (a running mean with
    ``use_grad_mean=True``, else a sum) and returns zero updates; the k-th call runs the inner
    transform on the accumulated gradient and resets it. So ``MultiSteps(tx, k)`` over k
    mini-batches equals one step of ``tx`` on the mean of their gradients, with the memory of
    one accumulator. Under ``torch.compile`` the branch is a ``torch.cond`` (one graph).
    In a distributed run (inside `opttx.distributed.sharded` or ``zero``, or around a
    transform declaring `opttx.extend.Traits.collective_groups` such as ``zero`` itself) the ranks
    agree on the boundary with one small all-reduce per call, and a rank whose count differs
    (it skipped or repeated a call) makes every rank raise the same ``ValueError`` (eager
    code reads the agreed value: a host sync per call). ``agree_across_ranks=False`` leaves
    that out, for accumulation without any communication before the k-th call, when every
    rank is known to call ``update`` alike.

    Args:
      opt: the inner transform.
      every_k_schedule: k, an int >= 1, or a function of the number of inner updates so far
        returning k as a 0-dim tensor.
      use_grad_mean: average (default) rather than sum the mini-batch gradients.
      agree_across_ranks: in a distributed run, agree on the boundary across the ranks
        (default; see above).

    Example:
      >>> tx = opttx.MultiSteps(opttx.adamw(1e-3), every_k_schedule=4)
      >>> state = tx.init(params)   # then call tx.update once per micro-batch
    """

    def __init__(self, opt: GradientTransformation, every_k_schedule: int | Callable,
                 use_grad_mean: bool = True, agree_across_ranks: bool = True) -> None:
        if not callable(every_k_schedule):
            check_positive_int("every_k_schedule", every_k_schedule)
        self.inner = opt
        self.every_k_schedule = every_k_schedule
        self.use_grad_mean = use_grad_mean
        self.agree_across_ranks = bool(agree_across_ranks)

    def _k(self, gradient_step: torch.Tensor) -> torch.Tensor | int:
        if callable(self.every_k_schedule):
            return self.every_k_schedule(gradient_step)
        return self.every_k_schedule

    def init(self, params: Params) -> MultiStepsState:
        zero = zero_count(params)
        return MultiStepsState(mini_step=zero, gradient_step=zero.clone(),
                               inner_opt_state=self.inner.init(params),
                               acc_grads=stats_like(params))

    def update(self, updates: Updates, state: MultiStepsState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, MultiStepsState]:
        check_state_type(state, MultiStepsState, "MultiSteps")
        spec, g, acc = flatten_matching(updates, state.acc_grads)
        if self.use_grad_mean:
            # acc + (g - acc) / (n + 1): a running mean in one buffer
            weight = 1.0 / (state.mini_step + 1).to(torch.float64)
            acc = foreach("lerp", acc, [x.to(a.dtype) for x, a in zip(g, acc)],
                          weight.to(acc[0].dtype)) if acc else []
        else:
            acc = foreach_axpy(1.0, [x.to(a.dtype) for x, a in zip(g, acc)], acc)
        emit = state.mini_step + 1 >= self._k(state.gradient_step)
        if self.agree_across_ranks:
            emit = _agreed_boundary(emit, state, extra_args,
                                    traits_of(self.inner).collective_groups)

        zeros = tree_unflatten([torch.zeros_like(x) for x in g], spec)

        def final(out: Updates, acc_tree: Updates, inner_state: State) -> tuple:
            grads = tree_unflatten([a.to(x.dtype) for a, x in zip(tree_leaves(acc_tree), g)],
                                   spec)
            out, inner_state = self.inner.update(grads, inner_state, params, **extra_args)
            return out, tree_map(torch.zeros_like, acc_tree), inner_state

        def accumulate(out: Updates, acc_tree: Updates, inner_state: State) -> tuple:
            return out, acc_tree, inner_state

        out, acc_tree, inner_state = tree_cond(
            emit, final, accumulate, (zeros, tree_unflatten(acc, spec), state.inner_opt_state))
        zero = torch.zeros_like(state.mini_step)
        return out, MultiStepsState(
            mini_step=torch.where(emit, zero, state.mini_step + 1),
            gradient_step=torch.where(emit, safe_increment(state.gradient_step),
                                      state.gradient_step),
            inner_opt_state=inner_state, acc_grads=acc_tree, made_by=state.made_by)

    def has_updated(self, state: MultiStepsState) -> torch.Tensor:
        """Whether the last call ran the inner transform (0-dim bool)."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        """This accumulator as a plain `GradientTransformation`, for `chain` and friends
        (declared: it pickles, and `opttx.Optimizer` injects the inner hyperparameters)."""
        return multi_steps(self.inner, self.every_k_schedule, self.use_grad_mean,
                           self.agree_across_ranks)


def _agreed_boundary(emit: torch.Tensor, state: MultiStepsState, extra_args: dict[str, Any],
                     groups: tuple) -> torch.Tensor:
    """Whether this call ends an accumulation, the same on every rank: in a distributed run
    (inside `opttx.distributed.sharded`, ``zero`` or ``on_owners``, or around a transform that
    declares `Traits.collective_groups`) the ranks' decisions are combined with one small
    all-reduce (max of ``[emit, -emit]``), so the inner update and its collectives run on
    every rank or on none. Ranks that disagree (a rank skipped or repeated a call, and so
    counts other mini-steps) raise the same ``ValueError`` on every rank in eager code; a
    compiled step, which cannot raise without a host sync, ends the accumulation on every
    rank when one does."""
    from ._tracing import is_tracing
    from .base import TOTALS_KEY
    if current_reducer(extra_args) is None and extra_args.get(TOTALS_KEY) is None \
            and not groups:
        return emit
    if not _several_ranks():     # one process (opttx.stacked's slices among such runs)
        return emit
    e = torch.as_tensor(emit).to(torch.float32).reshape(1)
    both = _across_ranks(torch.cat([e, -e]), extra_args, groups, op="max")
    if not is_tracing() and float(both[0]) != -float(both[1]):
        raise ValueError(
            "MultiSteps: the ranks disagree on whether this call ends an accumulation (this "
            f"rank had accumulated {int(state.mini_step)} mini-steps since its last update, "
            f"after {int(state.gradient_step)} updates): a rank skipped or repeated a call of "
            "update (a step left out after a local check, say), or every_k_schedule gave "
            "another k on another rank. Every rank must call update once per micro-batch; "
            "skip bad steps together with opttx.apply_if_finite.")
    return both[0] > 0


@declare(runtime=("every_k_schedule", "agree_across_ranks"), wraps="opt")
def multi_steps(opt: GradientTransformation, every_k_schedule: int | Callable,
                use_grad_mean: bool = True, agree_across_ranks: bool = True
                ) -> GradientTransformation:
    """``MultiSteps(opt, every_k_schedule, use_grad_mean, agree_across_ranks)
    .gradient_transformation()``: gradient accumulation as a transform (see `MultiSteps`)."""
    accumulator = MultiSteps(opt, every_k_schedule, use_grad_mean, agree_across_ranks)
    return GradientTransformation(accumulator.init, accumulator.update,
                                  combine_traits((opt,)))
