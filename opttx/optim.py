"""`opttx.Optimizer`: run any transform as a ``torch.optim.Optimizer``, in place."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .base import GradientTransformation, _stochastic_pairs, round_stochastic_
from .tree import PyTree, donating, keystr, tree_flatten_with_path, tree_leaves
from .wrappers import find_injected_states

__all__ = ["Optimizer"]


def _is_named(params: list) -> bool:
    return bool(params) and isinstance(params[0], tuple)


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

    Example:
      >>> tx = opttx.inject_hyperparams(opttx.adamw)(learning_rate=1e-3, weight_decay=0.01)
      >>> opt = opttx.Optimizer(model.parameters(), tx)
      >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
      >>> for x, y in data:
      ...     loss_fn(model(x), y).backward()
      ...     opt.step(); opt.zero_grad(); sched.step()
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
            moved = [p for p, g in zip(params, has_grad) if g]
            deltas = [u for u, g in zip(tree_leaves(updates), has_grad) if g]
            if self.stochastic_rounding:
                sr_p, sr_u, moved, deltas = _stochastic_pairs(moved, deltas, factor)
                for p, u in zip(sr_p, sr_u):
                    round_stochastic_(p, p.float() + u.float(), self.generator)
            else:
                deltas = [u.to(p.dtype) for p, u in zip(moved, deltas)]
            if moved:
                torch._foreach_add_(moved, deltas, alpha=factor)
        return loss

    @staticmethod
    def _run(tx: GradientTransformation, grads: PyTree, state: Any,
             params: PyTree) -> tuple[PyTree, Any, float]:
        """``tx.update``, except that a chain ending in a constant `opttx.scale` (every alias
        with a fixed learning rate) stops before it and returns the factor, so the write
        ``p += factor · u`` does the scaling in the same pass (as torch's ``addcdiv_``)."""
        links = getattr(tx.update, "links", None)
        factor = getattr(links[-1].update, "constant_scale", None) if links else None
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

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {group index: {state path: tensor}}, "param_groups": [...]}``.

        Every tensor of every group's transform state, keyed by its path in the state tree
        (for example ``"[0].mu[3]"``), cloned. Loading it with `load_state_dict` into an
        optimizer built the same way resumes bit-identically.
        """
        state = {index: {keystr(path): leaf.detach().clone()
                         for path, leaf in tree_flatten_with_path(s)[0]
                         if isinstance(leaf, torch.Tensor)}
                 for index, s in enumerate(self._tx_states)}
        groups = []
        start = 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k not in ("params", "tx")}
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a `state_dict` into this optimizer's state buffers and param groups."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}.")
        for index, (group, saved) in enumerate(zip(self.param_groups, groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"param group {index} has {len(group['params'])} params, "
                                 f"the state_dict {len(saved['params'])}.")
            saved_state = state_dict["state"][index]
            current = {keystr(path): leaf for path, leaf
                       in tree_flatten_with_path(self._tx_states[index])[0]
                       if isinstance(leaf, torch.Tensor)}
            if set(current) != set(saved_state):
                missing = sorted(set(current) - set(saved_state))[:3]
                extra = sorted(set(saved_state) - set(current))[:3]
                raise ValueError(f"state_dict of param group {index} does not match this "
                                 f"optimizer's transform: missing {missing}, unexpected "
                                 f"{extra}.")
            for key, leaf in current.items():
                value = saved_state[key]
                if value.shape != leaf.shape:
                    raise ValueError(f"state{key} of param group {index} has shape "
                                     f"{tuple(value.shape)}, expected {tuple(leaf.shape)}.")
                leaf.copy_(value)
            self._synced.pop(index, None)
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
