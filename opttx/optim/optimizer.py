"""`opttx.Optimizer`: run any transform as a ``torch.optim.Optimizer``, in place."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Iterable, NamedTuple

import torch

from .._tracing import is_tracing
from ..base import (GradientTransformation, HyperRole, describe_transform, is_optional_entry,
                   recipe_of, round_stochastic_, update_deferring_scale)
from ..distributed.checkpoint_keys import (dtensor_placement, keyed_state,
                                          local_entries_as_dtensors, param_paths)
from ..kernels import donating, foreach
from ..tree import PyTree, tree_leaves
from ..updates import add_leaves, grouping_key, scaled_updates, stochastic_pairs
from ..transforms.schedule_free import find_schedule_free_states, schedule_free_params_
from ..wrappers import find_injected_states, hyperparameter_roles, inject_all_hyperparams

__all__ = ["Optimizer"]


def _is_named(params: list) -> bool:
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        raise ValueError("all optimizer params should be with/without names. Some param names "
                         "are missing")     # torch.optim's check and message
    return bool(params) and named[0]


def _local_pairs(params: list, updates: list) -> tuple[list, list]:
    """Parameters and updates to write, with every pair of DTensors on the same mesh and
    placements replaced by their local tensors (the write is then a plain grouped kernel on
    the shards, no DTensor dispatch; under ``no_grad`` ``to_local`` is the parameter's own
    storage). Other leaves are left as they are."""
    ps, us = [], []
    for p, u in zip(params, updates):
        if (grouping_key(p) is not None and grouping_key(u) is not None
                and p.device_mesh == u.device_mesh
                and tuple(p.placements) == tuple(u.placements)):
            p, u = p.to_local(), u.to_local()
        ps.append(p)
        us.append(u)
    return ps, us


SHARED = "shared."   # prefix of a group's shared state entries (on its first parameter)
TRANSFORM_KEY = "transform"   # the param-group key naming what made the group's state

# torch.optim's names for opttx arguments: constructor keywords and param-group keys
_TORCH_KEYWORDS = {"lr": ("learning_rate",), "betas": ("b1", "b2"), "alpha": ("decay",)}
# param-group keys of torch.optim that change no number (implementation choices): accepted
_IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable"})
# param-group keys of torch.optim that change the numbers: a group that gives one which its
# transform cannot honour (neither a live hyperparameter nor an argument of its factory)
# raises instead of ignoring it
_NUMERIC_KEYS = frozenset({"lr", "betas", "momentum", "weight_decay", "eps", "alpha",
                           "dampening", "lr_decay", "momentum_decay", "decay", "nesterov",
                           "amsgrad", "centered", "decoupled_weight_decay", "rho", "lambd",
                           "t0", "etas", "step_sizes", "initial_accumulator_value",
                           "weight_decouple", "differentiable"})


def _torch_arguments(factory: Callable[..., GradientTransformation],
                     kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with torch.optim's names (``lr``, ``betas``, ``alpha``) translated to the
    arguments of ``factory``."""
    accepted = inspect.signature(factory).parameters
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in accepted:
            names, values = (key,), (value,)
        elif key in _TORCH_KEYWORDS and all(n in accepted for n in _TORCH_KEYWORDS[key]):
            names = _TORCH_KEYWORDS[key]
            values = tuple(value) if len(names) > 1 else (value,)
            if len(values) != len(names):
                raise ValueError(f"{key} must have {len(names)} values, got {value!r}.")
        else:
            raise TypeError(f"{getattr(factory, '__name__', factory)!r} has no argument "
                            f"{key!r} (its arguments: {list(accepted)}).")
        for name, v in zip(names, values):
            if name in out:
                raise TypeError(f"{name!r} given twice (as {key!r} and {name!r}).")
            out[name] = v
    return out


class _Place(NamedTuple):
    """One injected hyperparameter of a group's state, found by `_places`."""
    hyperparams: dict           # the injected state's ``hyperparams`` (re-read at each write)
    name: str
    role: HyperRole | None
    schedule: bool
    given: Any                  # the Python number given at construction, or None


def _places(state: Any) -> list[_Place]:
    """Every injected hyperparameter in ``state``, in the state's order (outermost injected
    transform first, then the order of its arguments)."""
    out = []
    for injected in find_injected_states(state):
        roles = hyperparameter_roles(injected)
        for name in injected.hyperparams:
            role, schedule, given = roles.get(name, (None, False, None))
            out.append(_Place(injected.hyperparams, name, role, schedule, given))
    return out


LR_RATIOS = "lr_ratios"   # param-group key: each other learning rate's ratio to ``lr``


class _Keys(NamedTuple):
    """The param-group keys of one group's hyperparameters (see `_group_keys`)."""
    places: dict[str, tuple[tuple[int, ...], ...]]   # key -> per component, the places it sets
    roles: frozenset[str]     # the keys of roles (torch's names), written before own keys
    first_lr: int | None      # the place of the first learning rate (``lr``'s own)
    other_lrs: dict[str, int]  # own key -> place, of every other learning rate


def _place_paths(state: Any, tree: PyTree, places: list[_Place]) -> list[str]:
    """The field path of each place in the group's state, as `Optimizer.state_dict` names
    it less ``"shared."`` (``"hyperparams.weight_decay"``, ``"1.hyperparams.decay"``)."""
    _, shared = keyed_state(state, tree, None)
    where = {id(t): k for k, t in shared.items()}
    out = []
    for i, place in enumerate(places):
        path = where.get(id(place.hyperparams[place.name]))
        out.append(path if path is not None else f"hyperparams[{i}].{place.name}")
    return out


def _group_keys(places: list[_Place], paths: list[str]) -> _Keys:
    """The param-group keys of a group whose injected hyperparameters are ``places``.

    *Role keys*, torch.optim's names (``lr``, ``betas`` when both betas are declared,
    ``momentum``, ``weight_decay``, ``eps``, ``alpha``): each names every hyperparameter of
    its role (``lr``: every learning rate, the others at their ratios). *Own keys*: every
    hyperparameter that no role key names alone (no role, or a role that several hold) has
    one, except the first learning rate, whose key is ``lr``; it is the hyperparameter's name
    when no other hyperparameter of the group has that name and no role key is that name, its
    field path in the state (`_place_paths`) otherwise. So every key names a fixed set of
    places and no two own keys name the same place."""
    by_role: dict[HyperRole, list[int]] = {}
    for i, place in enumerate(places):
        if place.role is not None:
            by_role.setdefault(place.role, []).append(i)
    keys: dict[str, tuple[tuple[int, ...], ...]] = {}
    for role, idx in by_role.items():
        if role not in (HyperRole.B1, HyperRole.B2):
            keys[role.group_key] = (tuple(idx),)
    if HyperRole.B1 in by_role and HyperRole.B2 in by_role:
        keys["betas"] = (tuple(by_role[HyperRole.B1]), tuple(by_role[HyperRole.B2]))
    roles = frozenset(keys)
    alone = {comp[0] for comps in keys.values() for comp in comps if len(comp) == 1}
    lrs = by_role.get(HyperRole.LEARNING_RATE, [])
    first_lr = lrs[0] if lrs else None
    if first_lr is not None:
        alone.add(first_lr)
    names: dict[str, int] = {}
    for place in places:
        names[place.name] = names.get(place.name, 0) + 1
    other_lrs: dict[str, int] = {}
    for i, place in enumerate(places):
        if i in alone:
            continue
        key = place.name if names[place.name] == 1 and place.name not in roles else paths[i]
        keys[key] = ((i,),)
        if place.role is HyperRole.LEARNING_RATE:
            other_lrs[key] = i
    return _Keys(keys, roles, first_lr, other_lrs)


def _place_value(place: _Place) -> Any:
    return place.given if place.given is not None else place.hyperparams[place.name].item()


def _as_transform(tx: Any) -> Any:
    """A `opttx.MultiSteps` as its `GradientTransformation`; anything else unchanged."""
    to_transform = getattr(tx, "gradient_transformation", None)
    if not isinstance(tx, (GradientTransformation, type)) and callable(to_transform) and \
            hasattr(tx, "init") and hasattr(tx, "update"):
        return to_transform()
    return tx


def _honour_group_keys(tx: GradientTransformation, group: dict, given: set[str]
                       ) -> tuple[GradientTransformation, set[str]]:
    """``tx`` rebuilt with the group keys that are configuration arguments of its factory
    (``nesterov``, ``amsgrad``, torch's names translated), and the keys so honoured."""
    recipe = recipe_of(tx)
    honoured: set[str] = set()
    if recipe is None:
        return tx, honoured
    changes: dict[str, Any] = {}
    for key in given:
        names = _TORCH_KEYWORDS.get(key, (key,))
        if not all(n in recipe.arguments and n not in recipe.declaration.hyperparams
                   for n in names):
            continue
        value = group[key]
        values = tuple(value) if len(names) > 1 else (value,)
        for name, v in zip(names, values):
            current = recipe.arguments[name]
            if not (type(current) is type(v) and current == v):
                changes[name] = v
        honoured.add(key)
    return (recipe.rebuild(**changes) if changes else tx), honoured


def _check_unhonoured_key(key: str, value: Any, tx: GradientTransformation) -> None:
    """Refuse a group key of torch.optim that changes the numbers and that the group's
    transform neither has as a hyperparameter nor as an argument (``maximize`` and the
    implementation flags are honoured by the Optimizer itself)."""
    if key in _IMPLEMENTATION_KEYS or key == "maximize" or key not in _NUMERIC_KEYS:
        return
    if key == "differentiable" and not value:
        return
    raise ValueError(f"param group key {key!r} cannot take effect: this group's transform, "
                     f"{describe_transform(tx, values=False)}, declares no hyperparameter "
                     f"with that role and its factory no argument of that name (see "
                     f"opttx.extend.declare). Drop the key, or use a transform that has it.")


def _is_ambiguous_name(places: list[_Place], keys: _Keys, name: str) -> bool:
    """Whether ``name`` is not a key but the name of several hyperparameters."""
    return name not in keys.places and sum(p.name == name for p in places) > 1


def _check_ambiguous_name(places: list[_Place], keys: _Keys, name: str) -> None:
    """Refuse ``name`` as a key when it is not one but several hyperparameters have that name
    (``decay`` of ``scale_by_rms`` and of ``trace``), naming the key of each."""
    if not _is_ambiguous_name(places, keys, name):
        return
    named = [k for k, comps in keys.places.items()
             if any(places[c[0]].name == name and (len(c) == 1 or k == "lr") for c in comps)]
    raise ValueError(f"param group {name!r}: several hyperparameters of this group's "
                     f"transform have that name; set each by its own key: {named}.")


def _write_place(place: _Place, value: Any, ratio: float, share: bool) -> None:
    """Set one injected hyperparameter to ``value * ratio``."""
    h, name = place.hyperparams, place.name
    if isinstance(value, torch.Tensor) and value.dim() == 0 and share and ratio == 1.0:
        # the state holds the group's tensor itself, on its device (numbers are held on the
        # CPU): a scheduler's in-place ``group["lr"].fill_(x)`` is the state's value at once
        h[name] = value
    elif isinstance(value, torch.Tensor):
        h[name].copy_(value * ratio)
    else:
        h[name].fill_(value * ratio)


class _Group(dict):
    """A param group whose hyperparameter keys write through to the transform state: a
    torch LR scheduler's ``group["lr"] = x`` (or a user's) sets the injected tensor at once,
    so a step (compiled or not) only reads tensors."""

    _owner: Any = None     # the Optimizer, once the group's state exists
    _slot: int = 0         # index of the group's transform state
    _scheduled: frozenset = frozenset()   # keys of hyperparameters that follow a schedule

    def __setitem__(self, key: str, value: Any) -> None:
        if self._owner is not None:
            if self._owner._write_by_name(self._slot, key, value):
                return        # an opttx name shown under torch's key (b1 -> betas)
            self._owner._write_hyperparameter(self._slot, key, value)
        super().__setitem__(key, value)

    def __getitem__(self, key: str) -> Any:
        if key in self._scheduled and self._owner is not None:
            self._owner._show_scheduled(self._slot)    # the value the state holds now
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __missing__(self, key: str) -> Any:
        if key == "lr" and self._owner is not None:
            raise KeyError("'lr': this param group's transform declares no learning rate: "
                           "none of its factories declares a hyperparameter with the role "
                           "HyperRole.LEARNING_RATE (a transform without a step size, such as "
                           "clip_by_global_norm alone, or one built from an (init, update) "
                           "pair; decorate its factory with opttx.extend.declare).")
        raise KeyError(key)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # the owner is re-attached by Optimizer.__setstate__; copying it with the items
        # would write into a half-built copy
        return (_Group, (dict(self),))


class _ParamStates(Mapping):
    """``optimizer.state`` of an `Optimizer`: parameter -> its entries of the transform state
    (``{field path: tensor}``, see `Optimizer.state_dict`), read from the live state.

    ``torch.distributed.checkpoint.state_dict`` reads it: it must not look empty (DCP would
    "initialize" the state with a zero-gradient step, which moves an opttx state: counts,
    moment decay, weight decay) and it names the fields of every parameter."""

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer
        self._cache: dict[int, tuple[Any, list[dict]]] = {}

    def _position(self, param: torch.Tensor) -> tuple[int, int] | None:
        for group in self._optimizer.param_groups:
            for j, p in enumerate(group["params"]):
                if p is param:
                    return group._slot, j
        return None

    def group_entries(self, index: int) -> list[dict]:
        state = self._optimizer._tx_states[index]
        cached = self._cache.get(index)
        if cached is None or cached[0] is not state:
            cached = (state, self._optimizer._group_entries(index))
            self._cache[index] = cached
        return cached[1]

    def __getitem__(self, param: Any) -> Any:
        if not isinstance(param, torch.Tensor):
            return self._optimizer._state_extras[param]
        where = self._position(param)
        return {} if where is None else self.group_entries(where[0])[where[1]]

    def __setitem__(self, key: Any, value: Any) -> None:
        # torch.optim keeps entries under other keys than parameters in ``state`` and in its
        # state dict (hooks do); a parameter's entries are the transform's
        if isinstance(key, torch.Tensor):
            raise TypeError("optimizer.state[param] is a view of the transform state; change "
                            "the state with load_state_dict or through optimizer.tx_states.")
        self._optimizer._state_extras[key] = value

    def __iter__(self) -> Iterator[Any]:
        yield from (p for group in self._optimizer._slot_groups for p in group["params"])
        yield from self._optimizer._state_extras

    def __len__(self) -> int:
        return sum(len(group["params"]) for group in self._optimizer._slot_groups) + \
            len(self._optimizer._state_extras)

    def __bool__(self) -> bool:
        return True



def _update_unscaled(tx: GradientTransformation, updates: Any, state: Any, params: Any
                     ) -> tuple[Any, Any, None]:
    """``tx.update`` in `update_deferring_scale`'s form, its scale left in the updates."""
    return (*tx.update(updates, state, params), None)

class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that applies an opttx transform to ``p.grad`` in place.

    Each param group is one pytree (a list of its parameters, or a dict ``name -> param`` when
    built from ``named_parameters()``, so masks and labels can use names). A group may carry
    its own transform under the key ``"tx"``; otherwise the optimizer's ``tx`` is used.

    The state is updated in place (the transform runs inside `opttx.donating`), so peak
    memory is that of the transform's state plus its temporaries, as torch's foreach
    optimizers.

    **Hyperparameters and LR schedulers.** Give the transform built (``Optimizer(params,
    opttx.adamw(1e-3, weight_decay=0.1))``, any chain or wrapper of declared transforms) or
    the alias with its arguments, torch's names accepted (``lr`` for ``learning_rate``,
    ``betas`` for ``(b1, b2)``, ``alpha`` for ``decay``): ``Optimizer(params, opttx.adamw,
    lr=1e-3, betas=(0.9, 0.95))``; the two are the same optimizer. The transform is rebuilt
    from its recipe with every hyperparameter its factories *declare* injected
    (`opttx.inject_all_hyperparams`), and each param group shows them under keys read from
    their declared roles (`opttx.extend.HyperRole`). Writing a group key (a torch or HF LR
    scheduler, a hand-written warm-up, OneCycleLR or CyclicLR cycling ``betas`` /
    ``momentum``) writes the value into the state at once; a per-group value in a
    param-group dict applies to that group.

    *Group keys: one key, one set of hyperparameters.* Each key names a fixed set of the
    group's injected hyperparameters, a write reaches exactly those, and every key that names
    one of them shows its new value at once (a key never shows a number another key moved):

    - *Role keys*, torch's names: ``"lr"``, ``"betas"`` (when both betas are declared),
      ``"momentum"``, ``"weight_decay"``, ``"eps"``, ``"alpha"``. Each names every
      hyperparameter of its role and shows the first one's value (the transform's order: a
      chain's first link that has one, a partition's first label).
    - *Own keys*: a hyperparameter that no role key names alone (no role, as ``eps_root``;
      or a role several links hold, as muon's ``adam_weight_decay`` or adamuon's ``adam_b1``)
      has one key of its own: its name, when no other hyperparameter of the group has that
      name and no role key is called so; otherwise its field path in the state, as
      `state_dict` names it less ``"shared."``: ``"0.hyperparams.max_norm"`` and
      ``"2.hyperparams.max_norm"`` for two ``clip_by_global_norm`` links,
      ``"hyperparams.weight_decay"`` for muon's own ``weight_decay`` (``"weight_decay"``
      names both), ``"inner_states.s.inner_state.hyperparams.learning_rate"`` for a
      partition's second learning rate. Two links that both call a hyperparameter ``decay``
      (``scale_by_rms`` and ``trace``) show as ``"alpha"`` and ``"momentum"``; a ``"decay"``
      key would name both, and writing it is refused.
    - *Several learning rates* (muon's ``adam_learning_rate``, a partition's links, a chain
      with two scaled links): ``"lr"`` is the first one's key. Writing it sets the first to
      the value and every other to the value times its ratio, ``group["lr_ratios"]`` (own
      key -> ratio; from the values given at construction, 1 where the first was 0), so a
      scheduler scales them all. Writing another learning rate's own key sets it alone and
      makes its ratio the one it now has to ``lr`` (kept when ``lr`` is 0, as at the start of
      a warm-up). ``"lr_ratios"`` is saved in the state dict and may be set (a ratio for each
      other learning rate).
    - An opttx name that a role key shows (``b1`` in ``betas``, ``decay`` as ``alpha``,
      ``learning_rate`` as ``lr``), given in a param-group dict or an older state dict, is
      written through that key, and not kept, when exactly one hyperparameter has it; a
      name several share is refused (`load_state_dict` skips it: an older state dict showed
      one of them under it, and saved each under its role key too).

    A 0-dim tensor ``lr`` is shared with the state, so a scheduler's in-place ``fill_``
    applies too (refused when the group has several learning rates: they could not follow
    it). A hyperparameter given as a schedule shows the value its state holds (the value
    the last step used; before any step, the first step's) and cannot be written.
    `load_state_dict` takes a saved group's values in that order (role keys, own keys,
    ``lr_ratios``) and leaves scheduled ones to the loaded state: ``load_state_dict(
    state_dict())`` is the identity, and a run resumed from a state dict equals the
    uninterrupted one bit for bit (`opttx.conformance.check_optimizer_resume`).

    *Other group keys.* A key that is an argument of the transform's factory but not a
    hyperparameter (``nesterov``, ``amsgrad``, ``centered``) rebuilds that group's transform
    with it; ``maximize=True`` steps along the gradient (as torch); ``foreach``, ``fused`` and
    ``capturable`` change no number and are accepted; any other key of torch.optim that the
    transform cannot honour raises instead of being ignored. Keys of your own are kept.

    *Precision.* The state holds each hyperparameter as a float64 0-dim tensor on the CPU,
    exactly the number given (a tensor ``lr`` shared with a param group keeps its own dtype
    and device). An eager `step` reads them as Python floats (`opttx.kernels.LiveFloat`;
    free on the CPU, no device sync) and calls the factories with them, so it *is* the
    functional step of the transform you gave, bit for bit and at its speed (Adam's
    ``eps_root == 0`` fast path, grouped kernels with Python scalars), whatever the
    parameters' dtype or device: ``1 - b2`` is formed from 0.95, not from float32(0.95).
    A tensor off the CPU (a shared GPU ``lr``) is passed to the factory as a tensor, not read.

    **torch.compile.** ``torch.compile(opt.step)`` is one graph (also without
    ``fullgraph=True``, and with an LR scheduler attached); the hyperparameters are float64
    tensor inputs (complements and products formed in float64 in the graph, read by the
    element loops as scalars), so a scheduler changing them recompiles nothing. On torch
    2.13 Dynamo restarts its analysis once on the first compile through AOT autograd (a
    float64 0-dim CPU input gets a symbolic float that is never used): one graph is kept,
    but a compile counter backend is called twice. With GPU parameters the CPU scalars are
    kernel arguments read at launch (no sync; whether Inductor then still uses CUDA graphs
    was not measured, as no GPU was at hand). Donation (`opttx.donating`) is an eager-mode
    saving and is off in the compiled step.

    **torch.optim's contract.** State-dict and load-state-dict hooks and step hooks run; a
    state dict saved from ``named_parameters()`` loads into one built from ``parameters()``
    and back; the optimizer pickles and deep-copies (declared transforms are rebuilt from
    their recipes). Each group's ``"transform"`` key names the transform and configuration
    that made its state (`opttx.extend.describe_transform`): `load_state_dict` refuses a state dict
    made by another one before writing anything, naming both. ``optimizer.state[p]`` holds
    the parameter's entries of the transform state
    under their field paths (``"inner_state.0.mu"``, not torch's ``"exp_avg"``):
    ``torch.distributed.checkpoint``'s state-dict helpers read ``optimizer.state``, so extra
    names there would be saved twice, and the field paths name every transform alike (a
    Shampoo preconditioner has no torch name); the step count is one int32 tensor per group
    (``"shared.count"``), not a float ``"step"`` per parameter.

    **The learning rate in the write.** With ``fold_learning_rate=True`` a transform that
    ends with a scale (`opttx.base.Traits.final_scale`: `scale_by_learning_rate`, `scale`,
    every alias) leaves it to the parameter write, ``p.add_(u, alpha=-lr)`` in one fused
    kernel (`opttx.update_deferring_scale`): one grouped pass fewer, and torch.optim's
    rounding, so `opttx.optim.SGD` (which sets it) is bitwise ``torch.optim.SGD``. The step
    then equals the functional ``update_deferring_scale`` + ``apply_updates(..., scale=)``
    bit for bit, and ``tx.update`` + ``apply_updates`` to one rounding of the update per
    step. Off by default: the step is then the functional step bit for bit.

    **Parameters without a gradient.** A parameter whose ``grad`` is None in a step is not
    moved, as in torch.optim; its statistics advance as with a zero gradient (torch would leave
    them untouched).

    **bf16 parameters.** Statistics of 16-bit parameters are float32 (see the transforms);
    ``stochastic_rounding=True`` adds each update to a bfloat16 parameter in float32 and writes
    the sum back rounded stochastically (`opttx.base.round_stochastic_`, optionally from
    ``generator``), so small updates are not lost to round-to-nearest without keeping a float32
    master copy of the weights.

    **FSDP2 and other DTensor parameters.** After ``fully_shard`` the parameters are DTensors
    sharded on dim 0 (uneven splits included) and ``backward`` leaves each rank its shard of
    the gradient, already averaged over the ranks: no ``all_reduce_gradients``. Pass the
    transform wrapped in `opttx.distributed.sharded`, which reads the specs from the DTensors
    and runs the transform on the local shards; it issues no collective for element-wise
    transforms (adam, adamw, lion), one batched all-reduce per statistic for layer-wise ones
    (lamb, lars, clip_by_global_norm, adafactor, came), and with ``on_owners=True`` brings
    whole leaves to owner ranks for the transforms that need whole matrices (shampoo,
    galore_adamw, adamw_8bit; they refuse local shards). Adafactor and CAME take their
    factoring decisions on the global shapes, which ``sharded`` knows. The collectives are
    the ones ``sharded`` makes,
    nothing here adds any; DTensor parameters are written through their local tensors. One
    ``sharded`` transform per param group (it keeps the specs of the tree it was initialised
    on). Every rank must call ``step`` (the collectives are over the mesh).

    Example:
      >>> opt = opttx.Optimizer(model.parameters(), opttx.adamw, lr=1e-3, weight_decay=0.01)
      >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
      >>> for x, y in data:
      ...     loss_fn(model(x), y).backward()
      ...     opt.step(); opt.zero_grad(); sched.step()

      With FSDP2 (here CPU and gloo; ``"cuda"`` and NCCL alike), on every rank of an
      initialised process group:

      ```python
      from torch.distributed.fsdp import fully_shard
      mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
      for block in model.blocks:
          fully_shard(block, mesh=mesh)
      fully_shard(model, mesh=mesh)
      opt = opttx.Optimizer(model.named_parameters(), opttx.distributed.sharded(
          opttx.adafactor(1e-2)))
      shampoo = opttx.Optimizer(model.parameters(), opttx.distributed.sharded(
          opttx.shampoo(1e-3), on_owners=True))
      ```
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict] |
                 Iterable[tuple[str, torch.Tensor]],
                 tx: GradientTransformation | Callable[..., GradientTransformation], *,
                 stochastic_rounding: bool = False,
                 generator: torch.Generator | None = None, fold_learning_rate: bool = False,
                 **hyperparameters: Any) -> None:
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "Tensors or dicts, but got " + torch.typename(params))
        params = list(params) if params is not None else params   # torch's error on None
        if params:                # a group's params given as a generator are read once, here
            kept = (torch.Tensor, list, tuple, set, frozenset)   # sets: torch's error
            params = [dict(g, params=list(g["params"])) if isinstance(g, dict) and
                      not isinstance(g.get("params", []), kept) else g for g in params]
        tx = _as_transform(tx)
        if isinstance(tx, GradientTransformation):
            if hyperparameters:
                raise TypeError(f"Hyperparameter keywords {sorted(hyperparameters)} are for a "
                                "factory (opttx.Optimizer(params, opttx.adamw, lr=1e-3)); this "
                                "transform is already built.")
        elif callable(tx):
            factory = tx
            try:
                tx = factory(**_torch_arguments(factory, hyperparameters))
            except TypeError as e:
                name = getattr(factory, "__name__", "the factory")
                raise TypeError(f"{name} is given to the Optimizer as a factory, to be called "
                                f"with the hyperparameter keywords (opttx.Optimizer(params, "
                                f"opttx.adamw, lr=1e-3)); pass them, or a built "
                                f"GradientTransformation: {e}") from None
            tx = _as_transform(tx)
            if not isinstance(tx, GradientTransformation):
                raise TypeError(f"{getattr(factory, '__name__', factory)} returned a "
                                f"{type(tx).__name__}, not a GradientTransformation.")
        else:
            raise TypeError(f"tx must be a GradientTransformation or a function returning "
                            f"one (an alias such as opttx.adamw), got {type(tx).__name__}.")
        self.tx = tx                       # as built; each group runs it with live hyperparams
        self.stochastic_rounding = stochastic_rounding
        self.generator = generator
        self.fold_learning_rate = fold_learning_rate   # final scale in the parameter write
        self._tx_states: list[Any] = []
        self._steps_called = torch.zeros((), dtype=torch.int32)   # 1 once step has run
        self._state_extras: dict[Any, Any] = {}   # ``state`` entries not keyed by a parameter
        self._tree_names: list[list[str] | None] = []   # per state: its tree's names, if any
        self._slot_groups: list[_Group] = []       # the group of each transform state
        self._keys: list[_Keys] = []               # per state: its group's keys
        self._shown: list[list[Any]] = []          # per state: each place's value, as written
        self._ratios: list[dict[str, float]] = []  # per state: other learning rates' ratios
        self._honoured: list[frozenset[str]] = []  # group keys built into the transform
        params = list(params)     # None: torch's TypeError
        if _is_named(params):
            params = [{"params": [p for _, p in params],
                       "param_names": [n for n, _ in params]}]
        elif params and isinstance(params[0], dict):
            params = [self._name_group(g) for g in params]
        super().__init__(params, {})
        self.state = _ParamStates(self)  # what DCP's state_dict helpers read

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer keeps only defaults, state and param_groups: the transform and
        # its states would be dropped silently (copy.deepcopy, pickle). Keep everything (the
        # transforms pickle through their recipes); the live ``state`` view is rebuilt.
        out = dict(self.__dict__)
        out.pop("state", None)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for slot, group in enumerate(self._slot_groups):
            group._owner, group._slot = self, slot
            group._scheduled = self._scheduled_keys(slot)
        self.state = _ParamStates(self)

    @property
    def _opt_called(self) -> bool:
        """Whether `step` has run (read by torch LR schedulers for their "scheduler.step()
        before optimizer.step()" warning; `step` declares itself already wrapped by them, as
        Dynamo refuses to trace their wrapper: ``torch.compile(opt.step, fullgraph=True)``
        works with a scheduler attached)."""
        return bool(self._steps_called)

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        self._steps_called.fill_(int(bool(value)))

    @staticmethod
    def _name_group(group: dict) -> dict:
        group = dict(group)
        entries = list(group["params"]) if not isinstance(group["params"], torch.Tensor) \
            else [group["params"]]
        if _is_named(entries):
            group["params"] = [p for _, p in entries]
            group["param_names"] = [n for n, _ in entries]
        return group

    # -- groups and their trees ---------------------------------------------------------------

    def _tree(self, group: dict, leaves: list) -> PyTree:
        # the names the group's transform state was built with (a state dict loaded from
        # named_parameters() may add "param_names" to a group built without)
        names = self._tree_names[group._slot] if group._owner is self else \
            group.get("param_names")
        if names is not None:
            return dict(zip(names, leaves))
        return list(leaves)

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        param_group = _Group(self._name_group(param_group))
        given = set(param_group) - {"params", "param_names", "tx", TRANSFORM_KEY}
        built = _as_transform(param_group.get("tx", self.tx))
        if not isinstance(built, GradientTransformation):
            raise TypeError(f"param group 'tx' must be a GradientTransformation, got "
                            f"{type(built).__name__}.")
        built, honoured = _honour_group_keys(built, param_group, given)
        tx = inject_all_hyperparams(built)     # float64 on the CPU: the numbers given
        dict.__setitem__(param_group, "tx", tx)
        super().add_param_group(param_group)   # fills in torch's checks and the defaults
        group = param_group
        with torch.no_grad():
            tree = self._tree(group, [p.detach() for p in group["params"]])
            state = tx.init(tree)
        places = _places(state)
        keys = _group_keys(places, _place_paths(state, tree, places))
        shown = [None if p.schedule else _place_value(p) for p in places]
        for key in given:
            if key not in keys.places and key not in honoured and key != LR_RATIOS and \
                    not self._is_legacy_name(places, keys, key):
                _check_ambiguous_name(places, keys, key)
                _check_unhonoured_key(key, group[key], tx)
        for key in set(group) - given - {"params", "param_names", "tx", TRANSFORM_KEY}:
            dict.pop(group, key)                # a default of another group's transform
        first = shown[keys.first_lr] if keys.first_lr is not None else None
        ratios = {key: (float(shown[i]) / float(first) if first and shown[i] is not None
                        else 1.0)
                  for key, i in keys.other_lrs.items()}
        slot = len(self._tx_states)
        self._tx_states.append(state)
        self._slot_groups.append(group)
        self._tree_names.append(list(group["param_names"]) if "param_names" in group else None)
        self._keys.append(keys)
        self._shown.append(shown)
        self._ratios.append(ratios)
        self._honoured.append(frozenset(honoured))
        group._owner, group._slot = self, slot
        group._scheduled = self._scheduled_keys(slot)
        written = {key: group[key] for key in given
                   if key in keys.places or key == LR_RATIOS or
                   self._is_legacy_name(places, keys, key)}
        for key in written:
            dict.pop(group, key)
        self._show(slot)
        dict.__setitem__(group, TRANSFORM_KEY, describe_transform(tx, values=False))
        if not self.defaults:
            self.defaults.update({k: v for k, v in group.items()
                                  if k in keys.places or k == LR_RATIOS})
        if find_schedule_free_states(state):
            dict.__setitem__(group, "train_mode", True)    # see `train` and `eval`
        for key in self._write_order(slot, written):
            group[key] = written[key]

    # -- param-group keys of the hyperparameters ------------------------------------------------

    def _scheduled_keys(self, slot: int) -> frozenset[str]:
        """The keys of group ``slot`` that name a hyperparameter given as a schedule."""
        places = _places(self._tx_states[slot])
        return frozenset(key for key, comps in self._keys[slot].places.items()
                         if any(places[i].schedule for c in comps for i in c))

    @staticmethod
    def _is_legacy_name(places: list[_Place], keys: _Keys, name: str) -> bool:
        """Whether ``name`` is the name of exactly one hyperparameter that has no key of that
        name (``b1`` shown in ``betas``, ``decay`` shown as ``alpha``): accepted as that
        hyperparameter's key, as older state dicts and opttx's own names have it."""
        return name not in keys.places and sum(p.name == name for p in places) == 1

    def _write_order(self, slot: int, items: Iterable[str]) -> list[str]:
        """``items`` in the order to write them: role keys, then the hyperparameters' own keys
        (more specific: a ``weight_decay`` of two links, then one link's own), then the rest,
        ``lr_ratios`` last (writing an own learning rate sets its ratio)."""
        keys = self._keys[slot]

        def rank(key: str) -> int:
            if key in keys.roles:
                return 0
            if key == LR_RATIOS:
                return 3
            return 1 if key in keys.places else 2
        return sorted(items, key=rank)

    def _show(self, slot: int, changed: set[int] | None = None, skip: str | None = None
              ) -> None:
        """Show in the group the current value of every key (of those naming a place in
        ``changed``; all when None), except ``skip`` (the key being written, stored as given)."""
        group, keys, shown = self._slot_groups[slot], self._keys[slot], self._shown[slot]
        if group._scheduled:
            self._show_scheduled(slot)
        for key, comps in keys.places.items():
            if key == skip or key in group._scheduled:
                continue
            if changed is None or any(i in changed for c in comps for i in c):
                values = tuple(shown[c[0]] for c in comps)
                dict.__setitem__(group, key, values if len(values) > 1 else values[0])
        if keys.other_lrs:
            dict.__setitem__(group, LR_RATIOS, dict(self._ratios[slot]))

    def _show_scheduled(self, slot: int) -> None:
        """Show the keys of hyperparameters that follow a schedule with the values the state
        holds (the value the last step used; before any step, the first step's)."""
        group, keys = self._slot_groups[slot], self._keys[slot]
        places = _places(self._tx_states[slot])
        for key in group._scheduled:
            values = tuple(places[c[0]].hyperparams[places[c[0]].name].item()
                           if places[c[0]].schedule else self._shown[slot][c[0]]
                           for c in keys.places[key])
            dict.__setitem__(group, key, values if len(values) > 1 else values[0])

    @torch.no_grad()
    def _check_hyperparameter(self, slot: int, key: str, value: Any, loading: bool = False
                              ) -> None:
        """Refuse a value of a group key that this group cannot take, naming the key: a live
        hyperparameter that is not a number or a real 0-dim tensor (or that follows a
        schedule, unless ``loading``: a state dict shows its value, which the loaded state
        holds), ``lr_ratios`` that do not name this group's other learning rates, a
        configuration key changed after the group was built, a key of torch.optim that the
        transform cannot honour."""
        keys = self._keys[slot]
        if key in keys.places:
            comps = keys.places[key]
            values = tuple(value) if len(comps) > 1 and isinstance(value, (tuple, list)) \
                else (value,)
            if len(values) != len(comps):
                raise ValueError(f"param group {key!r} must have {len(comps)} values, got "
                                 f"{value!r}.")
            for v in values:
                number = isinstance(v, (int, float)) and not isinstance(v, bool)
                real = isinstance(v, torch.Tensor) and not v.is_complex() and \
                    v.dtype != torch.bool
                if not (number or real):
                    raise TypeError(f"param group {key!r} must be a number or a 0-dim tensor, "
                                    f"got {type(v).__name__} {v!r:.40}.")
            places = _places(self._tx_states[slot])
            for comp in comps:
                for i in comp:
                    if places[i].schedule and not loading:
                        raise ValueError(
                            f"param group {key!r}: {places[i].name} follows the schedule "
                            "it was given at construction, so it cannot also be set (by a "
                            "torch LR scheduler or by hand); give it as a number instead.")
            if key == "lr" and keys.other_lrs and isinstance(value, torch.Tensor):
                raise ValueError(
                    "param group 'lr': this group has several learning rates "
                    f"({', '.join(places[i].name for i in comps[0])}) that follow 'lr' at "
                    "their ratios; a tensor lr would be shared with the first only (an "
                    "in-place change would leave the others behind). Give lr as a number, or "
                    "set each learning rate by its own key.")
        elif key == LR_RATIOS:
            if not keys.other_lrs:
                raise ValueError(f"param group {LR_RATIOS!r}: this group has one learning "
                                 "rate (or none), so there are no ratios to set.")
            if not isinstance(value, Mapping) or set(value) != set(keys.other_lrs) or \
                    not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                            for v in value.values()):
                raise ValueError(f"param group {LR_RATIOS!r} must map each other learning "
                                 f"rate's key ({sorted(keys.other_lrs)}) to a number, got "
                                 f"{value!r:.80}.")
        elif key in self._honoured[slot]:
            if value != self._slot_groups[slot].get(key, value):
                raise ValueError(
                    f"param group {key!r} is a configuration argument of this group's "
                    "transform, built into it when the group was added; it cannot change "
                    "afterwards. Add a new param group, or build a new Optimizer.")
        else:
            _check_ambiguous_name(_places(self._tx_states[slot]), keys, key)
            if key in _NUMERIC_KEYS:
                _check_unhonoured_key(key, value, self._slot_groups[slot]["tx"])

    def _write_by_name(self, slot: int, name: str, value: Any) -> bool:
        """``group[name] = value`` where ``name`` is not a key but the name of exactly one
        hyperparameter (``b1`` shown in ``betas``, ``decay`` as ``alpha``, ``learning_rate``
        as ``lr``; as older state dicts and opttx's arguments name them): written through
        the key that names it, ``name`` itself not kept. False when ``name`` is not such a
        name."""
        keys = self._keys[slot]
        places = _places(self._tx_states[slot])
        if name == LR_RATIOS or not self._is_legacy_name(places, keys, name):
            return False
        i = next(j for j, p in enumerate(places) if p.name == name)
        group = self._slot_groups[slot]
        for key, comps in keys.places.items():
            if comps == ((i,),):
                group[key] = value              # its own key
                return True
        for key, comps in keys.places.items():
            for c, comp in enumerate(comps):
                if comp[0] == i and (len(comp) == 1 or key == "lr"):
                    shown = group[key]
                    values = list(shown) if len(comps) > 1 else [shown]
                    values[c] = value
                    group[key] = tuple(values) if len(comps) > 1 else value
                    return True
        return False                            # not reached: every place has a key

    def _write_hyperparameter(self, slot: int, key: str, value: Any, loading: bool = False
                              ) -> None:
        """Apply ``group[key] = value`` to the transform state of group ``slot`` (called by
        the group as it is written) and show the new values under every other key that names
        a place it moved."""
        self._check_hyperparameter(slot, key, value, loading)
        keys = self._keys[slot]
        if key == LR_RATIOS:
            self._ratios[slot] = {k: float(value[k]) for k in keys.other_lrs}
            return
        comps = keys.places.get(key)
        if comps is None:
            return
        places, shown = _places(self._tx_states[slot]), self._shown[slot]
        lr_keys = {i: k for k, i in keys.other_lrs.items()}
        values = tuple(value) if len(comps) > 1 else (value,)
        changed: set[int] = set()
        for comp, v in zip(comps, values):
            for i in comp:
                if places[i].schedule:          # loading: the loaded state holds it
                    continue
                ratio = self._ratios[slot][lr_keys[i]] if key == "lr" and i in lr_keys \
                    else 1.0
                _write_place(places[i], v, ratio, share=len(comp) == 1)
                shown[i] = v if ratio == 1.0 else v * ratio
                changed.add(i)
        if key in keys.other_lrs:
            # an own learning rate written: its ratio to lr is the one it now has
            first = shown[keys.first_lr] if keys.first_lr is not None else None
            if first is not None and float(first) != 0.0:
                self._ratios[slot][key] = float(value) / float(first)
        self._show(slot, changed, skip=key)

    # -- Schedule-Free: train() and eval() ------------------------------------------------------

    @torch.no_grad()
    def train(self, mode: bool = True) -> Optimizer:
        """Put the parameters of Schedule-Free groups (`opttx.schedule_free`,
        `opttx.schedule_free_adamw`, ...) at the training point :math:`y`, where gradients are
        taken, as ``schedulefree``'s ``optimizer.train()``; ``train(False)`` is `eval`.

        Call it with ``model.train()``; groups of other transforms are unaffected, and a
        group already in training mode is left as it is. The mode is the group's
        ``"train_mode"`` key, saved in `state_dict`: save checkpoints in either mode (with
        the model's parameters of the same moment) and they load right. Groups start in
        training mode (:math:`x = y = z` before the first step).
        """
        if not mode:
            return self.eval()
        self._schedule_free_mode(True)
        return self

    @torch.no_grad()
    def eval(self) -> Optimizer:
        """Put the parameters of Schedule-Free groups at the evaluation point :math:`x` (the
        average; `opttx.schedule_free_eval_params`), as ``schedulefree``'s
        ``optimizer.eval()``: call it with ``model.eval()``, and `train` before the next
        `step` (which refuses to run in evaluation mode)."""
        self._schedule_free_mode(False)
        return self

    def _schedule_free_mode(self, train: bool) -> None:
        for slot, group in enumerate(self._slot_groups):
            if bool(group.get("train_mode", train)) == train:
                continue
            leaves = tree_leaves(self._tree(group, list(group["params"])))   # z's order
            schedule_free_params_(self._tx_states[slot], leaves, to_eval=not train)
            dict.__setitem__(group, "train_mode", train)

    # -- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Apply one update to every parameter that has a gradient; returns ``closure()``."""
        if not all(bool(group.get("train_mode", True)) for group in self._slot_groups):
            raise RuntimeError("Optimizer.step: a Schedule-Free group is in evaluation mode "
                               "(its parameters hold the average x); call optimizer.train() "
                               "before training steps.")
        # What a torch LR scheduler's wrapper of ``step`` records (see `_opt_called`); a
        # tensor, since Dynamo drops attribute writes on a torch.optim.Optimizer
        self._steps_called.fill_(1)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for slot, group in enumerate(self._slot_groups):
            params = group["params"]
            has_grad = [p.grad is not None for p in params]
            if not any(has_grad):
                continue
            state = self._tx_states[slot]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            param_tree = self._tree(group, [p.detach() for p in params])
            if group.get("maximize", False) and "maximize" not in self._honoured[slot]:
                grads = foreach("neg", grads)     # torch's maximize: ascend the gradient
            tx = group["tx"]
            run = update_deferring_scale if self.fold_learning_rate else _update_unscaled
            if is_tracing():
                # donation is an eager memory saving (Dynamo cannot enter its ContextVar;
                # under compile the graph reuses buffers itself)
                updates, state, scale = run(tx, self._tree(group, grads), state, param_tree)
            else:
                with donating():
                    updates, state, scale = run(tx, self._tree(group, grads), state,
                                                param_tree)
            self._tx_states[slot] = state
            moved, deltas = _local_pairs(
                [p for p, g in zip(params, has_grad) if g],
                [u for u, g in zip(tree_leaves(updates), has_grad) if g])
            if moved:
                self._write(moved, deltas, scale)
        return loss

    def _write(self, params: list[torch.Tensor], deltas: list[torch.Tensor], scale: Any
               ) -> None:
        """``p += scale·u`` (``scale`` None: ``p += u``) in one grouped add per kind of
        parameter, bfloat16 ones with stochastic rounding when asked."""
        deltas, alpha = scaled_updates(deltas, scale)
        if self.stochastic_rounding:
            sr_p, sr_u, params, deltas = stochastic_pairs(params, deltas, alpha)
            for p, u in zip(sr_p, sr_u):
                round_stochastic_(p, p.float() + u.float(), self.generator)
        else:
            deltas = [u.to(p.dtype) for p, u in zip(params, deltas)]
        if params:
            add_leaves(params, deltas, inplace=True, alpha=alpha)

    # -- inspection and checkpoints --------------------------------------------------------------

    @property
    def tx_states(self) -> list[Any]:
        """The transform state of each param group (read-only view; do not replace)."""
        return list(self._tx_states)

    def _group_entries(self, index: int) -> list[dict]:
        """Per parameter of the group of transform state ``index``, its entries of the
        transform state (``{field path: tensor}``), the group's shared entries on its first
        parameter; element-wise statistics of DTensor parameters as DTensors."""
        group = self._slot_groups[index]
        params = group["params"]
        tree = self._tree(group, list(params))
        names = param_paths(tree)
        layouts: dict = {}
        per_param, shared = keyed_state(self._tx_states[index], tree, None, layouts)
        placed = [dtensor_placement(p) for p in params]
        if any(w is not None for w in placed):
            per_param = local_entries_as_dtensors(per_param, names, params, placed,
                                                  strict=False, layouts=layouts)
        entries = [dict(per_param.get(name, {})) for name in names]
        if entries:
            entries[0].update({SHARED + k: v for k, v in shared.items()})
        return entries

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {param index: {field path: tensor}}, "param_groups": [...]}``, as
        torch.optim's, so ``torch.distributed.checkpoint.state_dict``'s
        ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (and ``torch.save``) work.

        Parameters are indexed across groups as in torch.optim. A parameter's entries are its
        parts of the transform state, keyed by field path (``"1.mu"``: link 1 of a chain, field
        ``mu``; see `opttx.distributed.state_dict`), so they do not depend on which other
        parameters the group holds; the tensors the whole group shares (step counts, injected
        hyperparameters) are on the group's first parameter, under ``"shared."`` + field path.
        Element-wise statistics of DTensor parameters (FSDP2) are DTensors, so DCP reshards
        them; other statistics of a local shard (Adafactor's row and column means under
        `opttx.distributed.sharded`) stay this rank's plain tensors, right for a per-rank
        ``torch.save`` but not for DCP, which keeps one copy of a plain tensor: checkpoint
        those transforms with ``sharded(..., on_owners=True)``. Tensors are cloned. Loading
        it with `load_state_dict` into an optimizer built the same way resumes
        bit-identically.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        for slot, group in enumerate(self._slot_groups):
            if group._scheduled:
                self._show_scheduled(slot)     # the values the state holds now
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        index_of: dict[int, int] = {}     # id(param) -> its index (a repeated one keeps its first)
        start = 0
        done: set[int] = set()
        for group in self.param_groups:
            params = group["params"]
            for i, p in enumerate(params, start):
                index_of.setdefault(id(p), i)
            if group._slot not in done:        # a group listed twice (param_groups.extend)
                done.add(group._slot)
                for p, entries in zip(params, self._group_entries(group._slot)):
                    state[index_of[id(p)]] = {k: v.detach().clone() for k, v in entries.items()}
            saved = {k: v for k, v in group.items() if k not in ("params", "tx")}
            saved["tx"] = None          # not saved (DCP wants every key of the live groups)
            saved["params"] = [index_of[id(p)] for p in params]
            start += len(params)
            groups.append(saved)
        state.update(self._state_extras)           # type: ignore[arg-type]
        out = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a `state_dict` into this optimizer's state buffers and param groups.

        ``state_dict["state"]`` may be keyed by parameter index (as `state_dict` makes it) or
        by any other key listed in the groups' ``"params"`` (DCP's fully qualified names).

        Everything is checked before anything is written: a state dict that does not match
        (any group) leaves this optimizer as it was. Entries of fields a state declares
        optional (`opttx.extend.declare_optional`: offload's master copy, ``"~master"``) may be
        absent on either side: ignored where this optimizer's state has none, set to zeros
        (read as absent) where the state dict lacks them.

        Raises:
          ValueError: not a state dict, another number of groups or parameters, or entries
            missing, unexpected, not tensors, or of another shape or dtype (the message names
            them; dtypes must match exactly, as for `opttx.distributed.load_state_dict`: an
            integer moment or a floating-point step count is refused, never cast).
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError("load_state_dict expects a dict with 'state' and 'param_groups' "
                             "(as Optimizer.state_dict() makes it), got "
                             f"{type(state_dict).__name__}.")
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("load_state_dict expects a dict with 'state' and 'param_groups' "
                             "(as Optimizer.state_dict() makes it), got keys "
                             f"{sorted(map(str, state_dict))}.")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}.")
        done: set[int] = set()
        checked = []                          # first check every group, then write
        for index, (group, saved) in enumerate(zip(self.param_groups, groups)):
            if group._slot in done:
                continue                      # a group listed twice: loaded once
            done.add(group._slot)
            checked.append(self._checked_group(index, group, saved, state_dict["state"]))
        for group, saved, current, given in checked:
            self._write_group(group, saved, current, given)
        listed = {key for saved in groups for key in saved["params"]}
        for key, value in state_dict["state"].items():
            if key not in listed:
                self._state_extras[key] = value    # entries not keyed by a parameter
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _checked_group(self, index: int, group: Any, saved: dict, state: Mapping) -> tuple:
        """One group's part of a state dict, checked against this optimizer (nothing
        written): ``(group, saved group, live entries, saved entries)``."""
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"param group {index} has {len(group['params'])} params, "
                             f"the state_dict {len(saved['params'])}.")
        theirs, mine = saved.get(TRANSFORM_KEY), group.get(TRANSFORM_KEY)
        if isinstance(theirs, str) and theirs != mine:
            raise ValueError(f"state_dict of param group {index} was made by {theirs}, but "
                             f"this group's transform is {mine}: a state of another "
                             "transform or configuration cannot be loaded (nothing was "
                             "written). Build the Optimizer with the transform that saved it.")
        current = self._group_entries(group._slot)
        given = [dict(state.get(key, {})) for key in saved["params"]]
        if given and current:
            # the shared entries may sit on any one parameter of the group
            shared = {k: v for g in given for k, v in g.items() if k.startswith(SHARED)}
            given = [{k: v for k, v in g.items() if not k.startswith(SHARED)}
                     for g in given]
            given[0].update(shared)
        names = list(saved["params"])
        have = {(j, k) for j, e in enumerate(current) for k in e}
        got = {(j, k) for j, e in enumerate(given) for k in e}
        # entries of fields declared optional (opttx.extend.declare_optional: offload's master copy)
        # may be absent on either side; _write_group zeroes this state's that are absent
        missing_keys = {(j, k) for j, k in have - got if not is_optional_entry(k)}
        extra_keys = {(j, k) for j, k in got - have if not is_optional_entry(k)}
        if missing_keys or extra_keys:
            missing = sorted(f"{names[j]}: {k}" for j, k in missing_keys)[:3]
            extra = sorted(f"{names[j]}: {k}" for j, k in extra_keys)[:3]
            raise ValueError(f"state_dict of param group {index} does not match this "
                             f"optimizer's transform: missing {missing}, unexpected "
                             f"{extra}.")
        for j, (mine, theirs) in enumerate(zip(current, given)):
            for key, leaf in mine.items():
                if key not in theirs:             # an optional entry (checked above)
                    continue
                value = theirs[key]
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"state {names[j]}: {key} of param group {index} is "
                                     f"a {type(value).__name__}, expected a tensor of "
                                     f"shape {tuple(leaf.shape)} and dtype {leaf.dtype}.")
                if tuple(value.shape) != tuple(leaf.shape) or value.dtype != leaf.dtype:
                    raise ValueError(f"state {names[j]}: {key} of param group {index} is "
                                     f"{tuple(value.shape)} {value.dtype}, expected "
                                     f"{tuple(leaf.shape)} {leaf.dtype}.")
        places = _places(self._tx_states[group._slot])
        for key, value in saved.items():
            if key in ("params", "tx", "param_names", TRANSFORM_KEY):
                continue
            if self._is_legacy_name(places, self._keys[group._slot], key):
                if not (isinstance(value, (int, float, torch.Tensor)) and
                        not isinstance(value, bool)):
                    raise TypeError(f"param group {key!r} must be a number or a 0-dim "
                                    f"tensor, got {type(value).__name__} {value!r:.40}.")
                continue
            if _is_ambiguous_name(places, self._keys[group._slot], key):
                continue        # an older state dict's shared name: see _write_group
            self._check_hyperparameter(group._slot, key, value, loading=True)
        return group, saved, current, given

    def _write_group(self, group: Any, saved: dict, current: list, given: list) -> None:
        """Copy a checked group's saved entries into the live buffers and its hyperparameters
        into the group."""
        for mine, theirs in zip(current, given):
            for key, leaf in mine.items():
                dst = leaf.to_local() if hasattr(leaf, "to_local") else leaf
                if key not in theirs:             # optional, absent: zeros read as absent
                    dst.zero_()
                    continue
                value = theirs[key]
                src = value.to_local() if hasattr(value, "to_local") else value
                if src is not dst:
                    dst.copy_(src)
        slot = group._slot
        keys, shown = self._keys[slot], self._shown[slot]
        # what the state just loaded holds, for the keys the saved group lacks
        places = _places(self._tx_states[slot])
        for i, place in enumerate(places):
            if not place.schedule:
                shown[i] = place.hyperparams[place.name].item()
        self._show(slot)
        # then the saved group's values, as torch.optim takes them (copies: a tensor lr is not
        # shared with the optimizer that saved it); role keys before the hyperparameters' own
        # keys, the learning rates' ratios last: the identity for a state dict of this group
        values = {k: copy.deepcopy(v) for k, v in saved.items()
                  if k not in ("params", "tx", "param_names", TRANSFORM_KEY)}
        for key in self._write_order(slot, values):
            value = values[key]
            if key in keys.places or key == LR_RATIOS:
                self._write_hyperparameter(slot, key, value, loading=True)
                if key not in group._scheduled:
                    dict.__setitem__(group, key, value)
            elif _is_ambiguous_name(places, keys, key):
                continue    # an older state dict showed one of them under it: each has a key
            elif not self._write_by_name(slot, key, value):
                group[key] = value
        if "param_names" in saved and "param_names" not in group:
            group["param_names"] = list(saved["param_names"])   # as torch keeps them


# torch.optim.lr_scheduler wraps ``optimizer.step`` to record ``_opt_called`` (for its
# "scheduler.step() before optimizer.step()" warning) unless the step says it is wrapped
# already; Dynamo force-skips that wrapper (a graph break, an error under fullgraph=True).
# `Optimizer.step` records the flag itself.
Optimizer.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
