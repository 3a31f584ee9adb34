"""`opttx.Optimizer`: run any transform as a ``torch.optim.Optimizer``, in place."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable, Iterable

import torch

from ._statekeys import (dtensor_placement, keyed_state, local_entries_as_dtensors,
                         param_paths)
from .base import (GradientTransformation, _foreach_add, traits_of, _kind, _stochastic_pairs,
                   round_stochastic_)
from .tree import PyTree, donating, tree_leaves
from .wrappers import find_injected_states

__all__ = ["Optimizer"]


def _is_named(params: list) -> bool:
    return bool(params) and isinstance(params[0], tuple)


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
        for index, group in enumerate(self._optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if p is param:
                    return index, j
        return None

    def group_entries(self, index: int) -> list[dict]:
        state = self._optimizer._tx_states[index]
        cached = self._cache.get(index)
        if cached is None or cached[0] is not state:
            cached = (state, self._optimizer._group_entries(index))
            self._cache[index] = cached
        return cached[1]

    def __getitem__(self, param: torch.Tensor) -> dict:
        where = self._position(param)
        return {} if where is None else self.group_entries(where[0])[where[1]]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for group in self._optimizer.param_groups for p in group["params"])

    def __len__(self) -> int:
        return sum(len(group["params"]) for group in self._optimizer.param_groups)

    def __bool__(self) -> bool:
        return True


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that applies an opttx transform to ``p.grad`` in place.

    Each param group is one pytree (a list of its parameters, or a dict ``name -> param`` when
    built from ``named_parameters()``, so masks and labels can use names). A group may carry
    its own transform under the key ``"tx"``; otherwise the optimizer's ``tx`` is used.

    The state is updated in place (the transform runs inside `opttx.tree.donating`), so peak
    memory is that of the transform's state plus its temporaries, as torch's foreach
    optimizers.

    **Hyperparameters and LR schedulers.** When the transform is built with
    `opttx.inject_hyperparams`, every injected hyperparameter appears in the param group under
    its own name, with ``learning_rate`` under torch's key ``"lr"``. Writing to the group (as
    ``torch.optim.lr_scheduler`` does) sets the value in the state before the next step.

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
      >>> tx = opttx.inject_hyperparams(opttx.adamw)(learning_rate=1e-3, weight_decay=0.01)
      >>> opt = opttx.Optimizer(model.parameters(), tx)
      >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
      >>> for x, y in data:
      ...     loss_fn(model(x), y).backward()
      ...     opt.step(); opt.zero_grad(); sched.step()

      With FSDP2 (here CPU and gloo; ``"cuda"`` and NCCL alike):

      >>> from torch.distributed.fsdp import fully_shard
      >>> mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
      >>> for block in model.blocks:
      ...     fully_shard(block, mesh=mesh)
      >>> fully_shard(model, mesh=mesh)
      >>> opt = opttx.Optimizer(model.named_parameters(), opttx.distributed.sharded(
      ...     opttx.adafactor(1e-2)))
      >>> shampoo = opttx.Optimizer(model.parameters(), opttx.distributed.sharded(
      ...     opttx.shampoo(1e-3), on_owners=True))
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict] |
                 Iterable[tuple[str, torch.Tensor]], tx: GradientTransformation, *,
                 stochastic_rounding: bool = False,
                 generator: torch.Generator | None = None) -> None:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"tx must be a GradientTransformation, got {type(tx).__name__}.")
        self.tx = tx
        self.stochastic_rounding = stochastic_rounding
        self.generator = generator
        self._tx_states: list[Any] = []
        self._synced: dict[int, dict] = {}
        params = list(params)
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
        # live ``state`` view is rebuilt on the copy.
        out = dict(self.__dict__)
        out.pop("state", None)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.state = _ParamStates(self)

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

    @staticmethod
    def _tree(group: dict, leaves: list) -> PyTree:
        names = group.get("param_names")
        if names is not None:
            return dict(zip(names, leaves))
        return list(leaves)

    def add_param_group(self, param_group: dict) -> None:
        param_group = self._name_group(param_group)
        tx = param_group.setdefault("tx", self.tx)
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"param group 'tx' must be a GradientTransformation, got "
                            f"{type(tx).__name__}.")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        with torch.no_grad():
            tree = self._tree(group, [p.detach() for p in group["params"]])
            state = tx.init(tree)
        self._tx_states.append(state)
        for injected in find_injected_states(state):
            for name, value in injected.hyperparams.items():
                group.setdefault("lr" if name == "learning_rate" else name, value.item())

    def _sync_hyperparams(self, index: int, group: dict, state: Any) -> None:
        """Write the group's hyperparameter values into the injected state where they
        changed since the last step (an LR scheduler or the user edited the group)."""
        synced = self._synced.setdefault(index, {})
        for injected in find_injected_states(state):
            for name, tensor in injected.hyperparams.items():
                key = "lr" if name == "learning_rate" else name
                if key not in group:
                    continue
                value = group[key]
                if isinstance(value, torch.Tensor):
                    tensor.copy_(value)
                elif synced.get((id(tensor), key)) != value:
                    tensor.fill_(value)
                    synced[(id(tensor), key)] = value

    # -- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Apply one update to every parameter that has a gradient; returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            has_grad = [p.grad is not None for p in params]
            if not any(has_grad):
                continue
            state = self._tx_states[index]
            self._sync_hyperparams(index, group, state)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            param_tree = self._tree(group, [p.detach() for p in params])
            with donating():
                updates, state, factor = self._run(group["tx"], self._tree(group, grads),
                                                   state, param_tree)
            self._tx_states[index] = state
            moved, deltas = _local_pairs(
                [p for p, g in zip(params, has_grad) if g],
                [u for u, g in zip(tree_leaves(updates), has_grad) if g])
            if self.stochastic_rounding:
                sr_p, sr_u, moved, deltas = _stochastic_pairs(moved, deltas, factor)
                for p, u in zip(sr_p, sr_u):
                    round_stochastic_(p, p.float() + u.float(), self.generator)
            else:
                deltas = [u.to(p.dtype) for p, u in zip(moved, deltas)]
            if moved:
                _foreach_add(moved, deltas, inplace=True, alpha=factor)
        return loss

    @staticmethod
    def _run(tx: GradientTransformation, grads: PyTree, state: Any,
             params: PyTree) -> tuple[PyTree, Any, float]:
        """``tx.update``, except that a chain ending in a constant `opttx.scale` (every alias
        with a fixed learning rate) stops before it and returns the factor, so the write
        ``p += factor · u`` does the scaling in the same pass (as torch's ``addcdiv_``)."""
        links = traits_of(tx).links
        factor = traits_of(links[-1]).constant_scale if links else None
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            updates, state = tx.update(grads, state, params)
            return updates, state, 1.0
        new_state = list(state)
        updates = grads
        for i, link in enumerate(links[:-1]):
            updates, new_state[i] = link.update(updates, state[i], params)
        return updates, tuple(new_state), float(factor)

    # -- inspection and checkpoints --------------------------------------------------------------

    @property
    def tx_states(self) -> list[Any]:
        """The transform state of each param group (read-only view; do not replace)."""
        return list(self._tx_states)

    def _group_entries(self, index: int) -> list[dict]:
        """Per parameter of group ``index``, its entries of the transform state
        (``{field path: tensor}``), the group's shared entries on its first parameter; element-wise
        statistics of DTensor parameters as DTensors."""
        group = self.param_groups[index]
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
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        start = 0
        for index, group in enumerate(self.param_groups):
            for j, entries in enumerate(self._group_entries(index)):
                state[start + j] = {k: v.detach().clone() for k, v in entries.items()}
            saved = {k: v for k, v in group.items() if k not in ("params", "tx")}
            saved["tx"] = None          # not saved (DCP wants every key of the live groups)
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a `state_dict` into this optimizer's state buffers and param groups.

        ``state_dict["state"]`` may be keyed by parameter index (as `state_dict` makes it) or
        by any other key listed in the groups' ``"params"`` (DCP's fully qualified names).

        Raises:
          ValueError: another number of groups or parameters, or entries missing, unexpected
            or of another shape (the message names them).
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}.")
        for index, (group, saved) in enumerate(zip(self.param_groups, groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"param group {index} has {len(group['params'])} params, "
                                 f"the state_dict {len(saved['params'])}.")
            current = self._group_entries(index)
            given = [dict(state_dict["state"].get(key, {})) for key in saved["params"]]
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
                    if tuple(value.shape) != tuple(leaf.shape):
                        raise ValueError(f"state {names[j]}: {key} of param group {index} has "
                                         f"shape {tuple(value.shape)}, expected "
                                         f"{tuple(leaf.shape)}.")
            for mine, theirs in zip(current, given):
                for key, leaf in mine.items():
                    value = theirs[key]
                    dst = leaf.to_local() if hasattr(leaf, "to_local") else leaf
                    src = value.to_local() if hasattr(value, "to_local") else value
                    if src is not dst:
                        dst.copy_(src)
            self._synced.pop(index, None)
            for key, value in saved.items():
                if key not in ("params", "tx"):
                    group[key] = value
