"""`opttx.Optimizer`: run any transform as a ``torch.optim.Optimizer``, in place."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Iterable

import torch

from .base import (GradientTransformation, _foreach_add, _kind, _stochastic_pairs,
                   round_stochastic_, traits_of)
from .distributed.checkpoint_keys import (dtensor_placement, keyed_state,
                                          local_entries_as_dtensors, param_paths)
from .kernels import donating, foreach
from .tree import PyTree, tree_leaves
from .transforms.schedule_free import find_schedule_free_states, schedule_free_params_
from .wrappers import find_injected_states, inject_hyperparams

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
        if (_kind(p) is not None and _kind(u) is not None and p.device_mesh == u.device_mesh
                and tuple(p.placements) == tuple(u.placements)):
            p, u = p.to_local(), u.to_local()
        ps.append(p)
        us.append(u)
    return ps, us


SHARED = "shared."   # prefix of a group's shared state entries (on its first parameter)

# torch.optim's names for opttx arguments: constructor keywords and param-group keys
_TORCH_KEYWORDS = {"lr": ("learning_rate",), "betas": ("b1", "b2"), "alpha": ("decay",)}
# opttx names that the param groups show under torch's key
_OPTTX_NAMES = {"learning_rate": "lr", "b1": "betas", "b2": "betas"}
# opttx float arguments a torch user may write as ints (``lr=1``); made floats so they inject
_FLOAT_ARGUMENTS = frozenset({"learning_rate", "b1", "b2", "eps", "weight_decay", "momentum",
                              "decay"})
# param-group keys that are hyperparameters in torch.optim: writing one that this optimizer
# cannot apply raises instead of being ignored
_HYPERPARAMETER_KEYS = frozenset({"lr", "betas", "momentum", "weight_decay", "eps", "alpha",
                                  "dampening", "lr_decay", "momentum_decay", "decay"})


def _torch_arguments(factory: Callable[..., GradientTransformation],
                     kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with torch.optim's names (``lr``, ``betas``, ``alpha``) translated to the
    arguments of ``factory`` and integer hyperparameters made floats."""
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
            if name in _FLOAT_ARGUMENTS and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            out[name] = v
    return out


def _injected(factory: Callable[..., GradientTransformation], kwargs: dict[str, Any],
              dtype: torch.dtype) -> GradientTransformation:
    """``factory(**kwargs)`` (torch's names accepted) with its float hyperparameters injected
    as 0-dim tensors of ``dtype``."""
    return inject_hyperparams(factory, hyperparam_dtype=dtype)(
        **_torch_arguments(factory, kwargs))


def _hyperparameter_dtype(params: list) -> torch.dtype:
    """float64 for a model with float64 parameters, float32 otherwise: a compiled step reads
    float32 0-dim tensors as plain graph inputs (a float64 0-dim CPU tensor is how Dynamo
    carries Python floats it has made symbolic, and a grouped kernel given one as its scalar
    breaks the graph without fullgraph=True), and float32 is the precision in which torch's
    CPU kernels apply a float ``lr`` to float32 parameters anyway."""
    def tensors(entry: Any) -> Iterator[Any]:
        if isinstance(entry, dict):
            inner = entry.get("params", [])
            yield from tensors(inner if not isinstance(inner, torch.Tensor) else [inner])
        elif isinstance(entry, (list, tuple)):
            for e in entry:
                yield from tensors(e)
        elif isinstance(entry, torch.Tensor):
            yield entry
    wide = any(t.dtype == torch.float64 for t in tensors(params))
    return torch.float64 if wide else torch.float32


def _exact_values(factory: Callable[..., GradientTransformation],
                  kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Python values of the float arguments of ``factory(**kwargs)`` (defaults
    included) under their param-group keys: what the groups show, not the float32 roundings."""
    bound = inspect.signature(factory).bind(**_torch_arguments(factory, kwargs))
    bound.apply_defaults()
    args = {k: v for k, v in bound.arguments.items()
            if isinstance(v, float) and not isinstance(v, bool)}
    out: dict[str, Any] = {}
    if "b1" in args and "b2" in args:
        out["betas"] = (args.pop("b1"), args.pop("b2"))
    for name, value in args.items():
        out["lr" if name == "learning_rate" else name] = value
    return out


def _live_hyperparameters(state: Any) -> dict[str, list[tuple[dict, tuple[str, ...]]]]:
    """Param-group key -> where it lives: per injected state, its ``hyperparams`` dict and
    the names the key sets there (two for ``"betas"``); torch's key where there is one
    (``lr``, ``betas``), the opttx name otherwise."""
    live: dict[str, list[tuple[dict, tuple[str, ...]]]] = {}
    for injected in find_injected_states(state):
        h = injected.hyperparams
        names = set(h)
        if "b1" in names and "b2" in names:
            live.setdefault("betas", []).append((h, ("b1", "b2")))
            names -= {"b1", "b2"}
        for name in h:
            if name in names:
                key = "lr" if name == "learning_rate" else name
                live.setdefault(key, []).append((h, (name,)))
    return live


def _group_value(where: tuple[dict, tuple[str, ...]]) -> Any:
    values = tuple(where[0][name].item() for name in where[1])
    return values if len(values) > 1 else values[0]


class _Group(dict):
    """A param group whose hyperparameter keys write through to the transform state: a
    torch LR scheduler's ``group["lr"] = x`` (or a user's) sets the injected tensor at once,
    so a step (compiled or not) only reads tensors."""

    _owner: Any = None     # the Optimizer, once the group's state exists
    _slot: int = 0         # index of the group's transform state

    def __setitem__(self, key: str, value: Any) -> None:
        if self._owner is not None:
            self._owner._write_hyperparameter(self._slot, key, value)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __missing__(self, key: str) -> Any:
        if key == "lr" and self._owner is not None:
            raise KeyError("'lr': this param group's transform has no learning rate that can "
                           "be changed (no injected hyperparameter and no constant final "
                           "scale). Build the Optimizer from the alias itself, e.g. "
                           "opttx.Optimizer(params, opttx.adamw, lr=1e-3), or pass "
                           "opttx.inject_hyperparams(alias)(...).")
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


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that applies an opttx transform to ``p.grad`` in place.

    Each param group is one pytree (a list of its parameters, or a dict ``name -> param`` when
    built from ``named_parameters()``, so masks and labels can use names). A group may carry
    its own transform under the key ``"tx"``; otherwise the optimizer's ``tx`` is used.

    The state is updated in place (the transform runs inside `opttx.donating`), so peak
    memory is that of the transform's state plus its temporaries, as torch's foreach
    optimizers.

    **Hyperparameters and LR schedulers.** Pass the alias itself with its arguments, torch's
    names accepted (``lr`` for ``learning_rate``, ``betas`` for ``(b1, b2)``, ``alpha`` for
    ``decay``): ``Optimizer(params, opttx.adamw, lr=1e-3, betas=(0.9, 0.95),
    weight_decay=0.1)``. Its float hyperparameters are then injected (`opttx.inject_hyperparams`,
    as float32 0-dim tensors, float64 for a model with float64 parameters) and live in
    every param group under torch's keys (``"lr"``,
    ``"betas"``, ``"weight_decay"``, ``"eps"``, ``"momentum"``, ...) and in ``defaults``.
    Writing a group key (a torch or HF LR scheduler, a hand-written warm-up, OneCycleLR or
    CyclicLR cycling ``betas``/``momentum``) writes the value into the state at once; a
    per-group value in a param-group dict applies to that group; a 0-dim tensor ``lr`` is
    shared with the state, so a scheduler's in-place ``fill_`` applies too. A transform built
    with `opttx.inject_hyperparams` behaves the same. A transform built with fixed numbers
    shows ``"lr"`` when it ends in a constant learning rate (every alias given a float lr):
    the group's ``lr`` then replaces that final scale; a key it cannot apply (``lr`` of a
    chain not ending in a constant scale, ``weight_decay`` of a built ``adamw``) raises
    instead of being ignored.

    **torch.compile.** ``torch.compile(opt.step)`` (``fullgraph=True`` works, LR scheduler
    attached) is one graph; the hyperparameters are tensor inputs, so a scheduler changing
    them recompiles nothing. Donation (`opttx.donating`) is an eager-mode saving and is
    off in the compiled step.

    **torch.optim's contract.** State-dict and load-state-dict hooks and step hooks run; a
    state dict saved from ``named_parameters()`` loads into one built from ``parameters()``
    and back; an optimizer built from an alias pickles (it is rebuilt from the alias and its
    arguments). ``optimizer.state[p]`` holds the parameter's entries of the transform state
    under their field paths (``"inner_state.0.mu"``, not torch's ``"exp_avg"``):
    ``torch.distributed.checkpoint``'s state-dict helpers read ``optimizer.state``, so extra
    names there would be saved twice, and the field paths name every transform alike (a
    Shampoo preconditioner has no torch name); the step count is one int32 tensor per group
    (``"shared.count"``), not a float ``"step"`` per parameter.

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
                 generator: torch.Generator | None = None, **hyperparameters: Any) -> None:
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "Tensors or dicts, but got " + torch.typename(params))
        self._recipe: tuple[Callable[..., GradientTransformation], dict, torch.dtype] | None = \
            None
        params = list(params) if params is not None else params   # torch's error on None
        if params:                # a group's params given as a generator are read once, here
            kept = (torch.Tensor, list, tuple, set, frozenset)   # sets: torch's error
            params = [dict(g, params=list(g["params"])) if isinstance(g, dict) and
                      not isinstance(g.get("params", []), kept) else g for g in params]
        if isinstance(tx, GradientTransformation):
            if hyperparameters:
                raise TypeError(f"Hyperparameter keywords {sorted(hyperparameters)} are for a "
                                "factory (opttx.Optimizer(params, opttx.adamw, lr=1e-3)); this "
                                "transform is already built.")
        elif callable(tx):
            dtype = _hyperparameter_dtype(params) if params is not None else torch.float32
            self._recipe = (tx, dict(hyperparameters), dtype)
            try:
                tx = _injected(tx, hyperparameters, dtype)
            except TypeError as e:
                name = getattr(tx, "__name__", "the factory")
                raise TypeError(f"{name} is given to the Optimizer as a factory, to be called "
                                f"with the hyperparameter keywords (opttx.Optimizer(params, "
                                f"opttx.adamw, lr=1e-3)); pass them, or a built "
                                f"GradientTransformation: {e}") from None
        else:
            raise TypeError(f"tx must be a GradientTransformation or a function returning "
                            f"one (an alias such as opttx.adamw), got {type(tx).__name__}.")
        self.tx = tx
        self.stochastic_rounding = stochastic_rounding
        self.generator = generator
        self._tx_states: list[Any] = []
        self._steps_called = torch.zeros((), dtype=torch.int32)   # 1 once step has run
        self._state_extras: dict[Any, Any] = {}   # ``state`` entries not keyed by a parameter
        self._tree_names: list[list[str] | None] = []   # per state: its tree's names, if any
        self._slot_groups: list[_Group] = []       # the group of each transform state
        self._live: list[frozenset[str]] = []      # group keys that set injected values
        self._lr_is_scale: list[bool] = []         # lr applied as the final constant scale
        self._lr_values: list[torch.Tensor] = []   # that lr as a float32 0-dim tensor
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
        # its states would be dropped silently (copy.deepcopy, pickle). Keep everything; the
        # live ``state`` view is rebuilt on the copy. An optimizer built from a factory is
        # saved with its recipe instead of the transform (closures do not pickle).
        out = dict(self.__dict__)
        out.pop("state", None)
        if self._recipe is not None:
            out["tx"] = None
            groups = {id(g): _Group({k: (None if v is self.tx else v) for k, v in g.items()})
                      for g in self.param_groups}
            out["param_groups"] = [groups[id(g)] for g in self.param_groups]
            out["_slot_groups"] = [groups[id(g)] for g in self._slot_groups]
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._recipe is not None and self.tx is None:
            self.tx = _injected(*self._recipe)
            for group in self._slot_groups:
                if group.get("tx", self) is None:
                    dict.__setitem__(group, "tx", self.tx)
        for slot, group in enumerate(self._slot_groups):
            group._owner, group._slot = self, slot
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
        given = set(param_group) - {"params", "param_names", "tx"}
        tx = param_group.setdefault("tx", self.tx)
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"param group 'tx' must be a GradientTransformation, got "
                            f"{type(tx).__name__}.")
        super().add_param_group(param_group)   # fills in torch's checks and the defaults
        group = param_group
        with torch.no_grad():
            tree = self._tree(group, [p.detach() for p in group["params"]])
            state = tx.init(tree)
        live = _live_hyperparameters(state)
        initial = {key: _group_value(places[0]) for key, places in live.items()}
        if self._recipe is not None and tx is self.tx:
            exact = _exact_values(*self._recipe[:2])
            initial.update({k: v for k, v in exact.items() if k in initial})
        factor = self._final_scale(tx)
        lr_is_scale = "lr" not in live and factor is not None and factor < 0
        if lr_is_scale:
            initial["lr"] = -factor
        for key in given:
            if key in _HYPERPARAMETER_KEYS and key not in initial:
                raise ValueError(self._not_live(key))
        for key in set(group) - given - {"params", "param_names", "tx"}:
            if key not in initial:
                dict.pop(group, key)           # a default of another group's transform
        for key, value in initial.items():
            if key not in given:
                dict.__setitem__(group, key, value)
        if not self.defaults:
            self.defaults.update(initial)
        slot = len(self._tx_states)
        self._tx_states.append(state)
        self._slot_groups.append(group)
        self._tree_names.append(list(group["param_names"]) if "param_names" in group else None)
        self._live.append(frozenset(live))
        self._lr_is_scale.append(lr_is_scale)
        self._lr_values.append(torch.tensor(float(group["lr"]) if lr_is_scale else 0.0,
                                            dtype=torch.float32))
        group._owner, group._slot = self, slot
        if find_schedule_free_states(state):
            dict.__setitem__(group, "train_mode", True)    # see `train` and `eval`
        for key in given & set(initial):
            self._write_hyperparameter(slot, key, group[key])

    @staticmethod
    def _not_live(key: str) -> str:
        return (f"param group key {key!r} cannot take effect: this group's transform was built "
                f"with fixed hyperparameters (no injected {key!r}). Build the Optimizer from "
                f"the alias itself, e.g. opttx.Optimizer(params, opttx.adamw, lr=1e-3, "
                f"weight_decay=0.1), or pass opttx.inject_hyperparams(alias)(...).")

    @staticmethod
    def _final_scale(tx: GradientTransformation) -> float | None:
        links = traits_of(tx).links
        factor = traits_of(links[-1]).constant_scale if links else None
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            return None
        return float(factor)

    @torch.no_grad()
    def _check_hyperparameter(self, slot: int, key: str, value: Any) -> None:
        """Refuse a value of a live group key (``lr``, ``betas``, ...) that is not a number
        or a real tensor, naming the key (before: a bare error from ``float()`` or
        ``fill_``)."""
        if key in self._live[slot] or (key == "lr" and self._lr_is_scale[slot]):
            for v in (tuple(value) if key == "betas" and isinstance(value, (tuple, list))
                      else (value,)):
                number = isinstance(v, (int, float)) and not isinstance(v, bool)
                real = isinstance(v, torch.Tensor) and not v.is_complex() and \
                    v.dtype != torch.bool
                if not (number or real):
                    raise TypeError(f"param group {key!r} must be a number or a 0-dim tensor, "
                                    f"got {type(v).__name__} {v!r:.40}.")

    def _write_hyperparameter(self, slot: int, key: str, value: Any) -> None:
        """Apply ``group[key] = value`` to the transform state of group ``slot`` (called by
        the group as it is written)."""
        self._check_hyperparameter(slot, key, value)
        if key in self._live[slot]:
            places = _live_hyperparameters(self._tx_states[slot])[key]
            values = tuple(value) if key == "betas" else (value,)
            if len(values) != len(places[0][1]):
                raise ValueError(f"param group {key!r} must have {len(places[0][1])} values, "
                                 f"got {value!r}.")
            for hyperparams, names in places:
                for name, v in zip(names, values):
                    if isinstance(v, torch.Tensor) and v.dim() == 0 and \
                            v.device == hyperparams[name].device:
                        # the state holds the group's tensor itself: a scheduler's in-place
                        # ``group["lr"].fill_(x)`` is the state's value at once
                        hyperparams[name] = v
                    elif isinstance(v, torch.Tensor):
                        hyperparams[name].copy_(v)
                    else:
                        hyperparams[name].fill_(v)
        elif key == "lr" and self._lr_is_scale[slot]:
            if isinstance(value, torch.Tensor):
                raise ValueError("a tensor 'lr' needs an injected learning rate: build the "
                                 "Optimizer from the alias (opttx.Optimizer(params, "
                                 "opttx.adamw, lr=torch.tensor(1e-3))).")
            self._lr_values[slot].fill_(float(value))
        elif key in _HYPERPARAMETER_KEYS:
            raise ValueError(self._not_live(key))

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
            lr = None
            if self._lr_is_scale[slot]:
                # compiled: the group's lr as a tensor input (a float would be a constant
                # of the graph, recompiled at every change)
                lr = self._lr_values[slot] if torch.compiler.is_compiling() else group["lr"]
            if torch.compiler.is_compiling():
                # donation is an eager memory saving (Dynamo cannot enter its ContextVar;
                # under compile the graph reuses buffers itself)
                updates, state, factor = self._run(group["tx"], self._tree(group, grads),
                                                   state, param_tree, lr)
            else:
                with donating():
                    updates, state, factor = self._run(group["tx"], self._tree(group, grads),
                                                       state, param_tree, lr)
            self._tx_states[slot] = state
            moved, deltas = _local_pairs(
                [p for p, g in zip(params, has_grad) if g],
                [u for u, g in zip(tree_leaves(updates), has_grad) if g])
            if isinstance(factor, torch.Tensor):
                deltas = foreach("mul", deltas, factor)
                factor = 1.0
            if self.stochastic_rounding:
                sr_p, sr_u, moved, deltas = _stochastic_pairs(moved, deltas, factor)
                for p, u in zip(sr_p, sr_u):
                    round_stochastic_(p, p.float() + u.float(), self.generator)
            else:
                deltas = [u.to(p.dtype) for p, u in zip(moved, deltas)]
            if moved:
                _foreach_add(moved, deltas, inplace=True, alpha=factor)
        return loss

    @classmethod
    def _run(cls, tx: GradientTransformation, grads: PyTree, state: Any,
             params: PyTree, lr: float | None = None) -> tuple[PyTree, Any, float]:
        """``tx.update``, except that a chain ending in a constant `opttx.scale` (every alias
        with a fixed learning rate) stops before it and returns the factor, so the write
        ``p += factor · u`` does the scaling in the same pass (as torch's ``addcdiv_``).
        ``lr`` (the group's, for such a chain) replaces the factor by ``-lr``."""
        factor = cls._final_scale(tx)
        if factor is None:
            updates, state = tx.update(grads, state, params)
            return updates, state, 1.0
        links = traits_of(tx).links
        new_state = list(state)
        updates = grads
        for i, link in enumerate(links[:-1]):
            updates, new_state[i] = link.update(updates, state[i], params)
        return updates, tuple(new_state), (factor if lr is None else -lr)

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
        per_param, shared = keyed_state(self._tx_states[index], tree)
        placed = [dtensor_placement(p) for p in params]
        if any(w is not None for w in placed):
            per_param = local_entries_as_dtensors(per_param, names, params, placed,
                                                  strict=False)
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
        (any group) leaves this optimizer as it was.

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
        if have != got:
            missing = sorted(f"{names[j]}: {k}" for j, k in have - got)[:3]
            extra = sorted(f"{names[j]}: {k}" for j, k in got - have)[:3]
            raise ValueError(f"state_dict of param group {index} does not match this "
                             f"optimizer's transform: missing {missing}, unexpected "
                             f"{extra}.")
        for j, (mine, theirs) in enumerate(zip(current, given)):
            for key, leaf in mine.items():
                value = theirs[key]
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"state {names[j]}: {key} of param group {index} is "
                                     f"a {type(value).__name__}, expected a tensor of "
                                     f"shape {tuple(leaf.shape)} and dtype {leaf.dtype}.")
                if tuple(value.shape) != tuple(leaf.shape) or value.dtype != leaf.dtype:
                    raise ValueError(f"state {names[j]}: {key} of param group {index} is "
                                     f"{tuple(value.shape)} {value.dtype}, expected "
                                     f"{tuple(leaf.shape)} {leaf.dtype}.")
        for key, value in saved.items():
            if key not in ("params", "tx", "param_names"):
                self._check_hyperparameter(group._slot, key, value)
        return group, saved, current, given

    def _write_group(self, group: Any, saved: dict, current: list, given: list) -> None:
        """Copy a checked group's saved entries into the live buffers and its hyperparameters
        into the group."""
        for mine, theirs in zip(current, given):
            for key, leaf in mine.items():
                value = theirs[key]
                dst = leaf.to_local() if hasattr(leaf, "to_local") else leaf
                src = value.to_local() if hasattr(value, "to_local") else value
                if src is not dst:
                    dst.copy_(src)
        live = _live_hyperparameters(self._tx_states[group._slot])
        for key, value in saved.items():
            if key in ("params", "tx", "param_names"):
                continue
            if _OPTTX_NAMES.get(key) in live:
                continue        # an older state dict's opttx name of a live torch key
            group[key] = value
        for key, places in live.items():
            if key not in saved:        # the state just loaded holds its value
                dict.__setitem__(group, key, _group_value(places[0]))
        if "param_names" in saved and "param_names" not in group:
            group["param_names"] = list(saved["param_names"])   # as torch keeps them


# torch.optim.lr_scheduler wraps ``optimizer.step`` to record ``_opt_called`` (for its
# "scheduler.step() before optimizer.step()" warning) unless the step says it is wrapped
# already; Dynamo force-skips that wrapper (a graph break, an error under fullgraph=True).
# `Optimizer.step` records the flag itself.
Optimizer.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
