"""`swap_ema`: evaluate a model at the average that `opttx.ema_params` keeps, in place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..transforms.weight_ema import (EmaParamsState, ema_leaves_for, find_ema_params_states,
                                     the_ema_params_state)
from ..tree import PyTree, tree_flatten, tree_leaves
from .optimizer import Optimizer

__all__ = ["swap_ema"]


def _local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (FSDP2), any other tensor as it is."""
    return x.to_local() if hasattr(x, "to_local") else x


def _optimizer_pairs(opt: Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, its average) for every parameter of the groups whose transform is an
    `opttx.ema_params`."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    found = 0
    for slot, group in enumerate(opt._slot_groups):
        states = find_ema_params_states(opt._tx_states[slot])
        if not states:
            continue
        if len(states) > 1:
            raise ValueError(f"swap_ema: param group {slot} holds {len(states)} ema_params "
                             "states (nested ema_params); keep one average per group.")
        found += 1
        params = list(group["params"])
        leaves = tree_leaves(opt._tree(group, params))          # the state's order
        ema = tree_leaves(states[0].ema)
        if len(ema) != len(leaves) or any(tuple(_local(p).shape) != tuple(_local(e).shape)
                                          for p, e in zip(leaves, ema)):
            raise ValueError(f"swap_ema: the ema_params state of param group {slot} does not "
                             "hold one average per parameter of the group (ema_params inside "
                             "partition/masked or a distributed wrapper); read it with "
                             "opttx.ema_eval_params on the tree it was built on.")
        pairs.extend(zip(leaves, ema))
    if not found:
        raise ValueError("swap_ema: no param group of this optimizer runs a transform built "
                         "with opttx.ema_params.")
    return pairs


def _tree_of(ema_state: EmaParamsState, params: Any) -> PyTree:
    """``params`` as the tree the state was built on: a tree of tensors as given; a module
    as ``dict(named_parameters())`` (or its list of parameters, for a state built on one)."""
    if not isinstance(params, torch.nn.Module):
        return params
    named = dict(params.named_parameters())
    _, spec = tree_flatten(ema_state.ema)
    if tree_flatten(named)[1] == spec:
        return named
    listed = list(params.parameters())
    return listed if tree_flatten(listed)[1] == spec else named


@contextlib.contextmanager
def swap_ema(target: Any, params: Any = None) -> Iterator[None]:
    """Inside the block the parameters hold the average of `opttx.ema_params`; on leaving
    it (also on an exception) they hold their training values again, bit for bit.

    ``target`` is an `opttx.Optimizer` (every param group whose transform is an
    ``ema_params`` is swapped; ``params`` is not given), or the state of an ``ema_params``
    transform (at any depth) with ``params``, the tree it was built on (written in place) or
    the ``torch.nn.Module`` whose ``dict(named_parameters())`` it was built on. The average
    is copied into the parameters in their dtype (from the host with ``offload=True``); the
    training values are kept in a copy on their device meanwhile. Do not step the optimizer
    inside the block: leaving it restores the values of before.

    Example:
      >>> opt = opttx.Optimizer(model.parameters(), opttx.ema_params(opttx.adamw(1e-3), 0.999))
      >>> for x, y in data:
      ...     opt.zero_grad()
      ...     loss_fn(model(x), y).backward()
      ...     opt.step()
      >>> with opttx.swap_ema(opt), torch.no_grad():        # evaluate the average
      ...     val_loss = loss_fn(model(x), y)
      >>> state = opttx.ema_params(opttx.sgd(0.1)).init(dict(model.named_parameters()))
      >>> with opttx.swap_ema(state, model):                # a functional state, its module
      ...     pass
    """
    if isinstance(target, Optimizer):
        if params is not None:
            raise TypeError("swap_ema(optimizer) swaps the optimizer's own parameters: pass "
                            "no params.")
        pairs = _optimizer_pairs(target)
    else:
        if params is None:
            raise TypeError("swap_ema(state, params): pass the parameters (a tree or the "
                            "module) the state was built on.")
        state = the_ema_params_state(target, "swap_ema")
        _, p, ema = ema_leaves_for(state, _tree_of(state, params), "swap_ema")
        pairs = list(zip(p, ema))
    with torch.no_grad():
        locals_ = [(_local(p), _local(e)) for p, e in pairs]
        saved = [p.clone() for p, _ in locals_]
        for p, e in locals_:
            p.copy_(e)
    try:
        yield
    finally:
        with torch.no_grad():
            for (p, _), s in zip(locals_, saved):
                p.copy_(s)
