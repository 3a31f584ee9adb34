"""Schedule-Free's evaluation parameters and the weight average of `opttx.ema_params` when
each rank holds the state of some leaves only (`from_owners`: each leaf from its owner)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..base import Params
from ..kernels import cast_like, foreach
from ..transforms.schedule_free import check_params_like_z, the_schedule_free_state
from ..transforms.weight_ema import the_ema_params_state
from ..tree import MaskedNode, PyTree, tree_flatten, tree_paths, tree_unflatten

__all__ = ["ema_eval_params", "from_owners", "schedule_free_eval_params"]


def schedule_free_eval_params(state: PyTree, params: Params, group: Any = None) -> Params:
    r"""`opttx.schedule_free_eval_params` for a state spread over ranks (collective).

    Under `zero` (and ``sharded(..., on_owners=True)``) a rank's state holds Schedule-Free's
    :math:`z` only for the parameters it owns (`opttx.MaskedNode` elsewhere), so no rank can
    compute every evaluation parameter :math:`x = y + (1 - 1/\beta_1)(z - y)` alone. Here
    each owner computes those of its leaves, exactly as the single-device function does, and
    broadcasts them (one broadcast per owner rank and dtype, after one ``all_gather_object``
    of who owns what): every rank gets the whole tree, the same numbers bit for bit as
    `opttx.schedule_free_eval_params` on one device. A state that holds every leaf (one
    device, plain `sharded` on local shards) needs no communication and gets none.

    Args:
      state: this rank's state of the transform (a `zero` or ``on_owners`` state around
        `opttx.schedule_free`).
      params: the full training parameters :math:`y`, the same on every rank (as `zero` keeps
        them).
      group: the ranks the state is spread over (the group given to `zero`; None: the
        default group).

    Returns:
      New tensors shaped like ``params``: the evaluation parameters :math:`x`.

    Raises:
      ValueError: on every rank, when a leaf has no owner or several, or a rank holds only
        rows of a leaf (``split_above_mb``: not supported).

    Example:
      >>> tx = opttx.schedule_free_adamw(1e-3)    # under zero: zero(schedule_free_adamw(...))
      >>> state = tx.init(params)
      >>> x = opttx.distributed.schedule_free_eval_params(state, params)   # on every rank
    """
    name = "opttx.distributed.schedule_free_eval_params"
    sf = the_schedule_free_state(state, name)

    def check(y: list[Any], z: list[torch.Tensor], held: Params) -> None:
        check_params_like_z(y, z, held, name)

    def compute(y: list[torch.Tensor], z: list[torch.Tensor]) -> list[torch.Tensor]:
        return foreach("lerp", y, cast_like(z, y), 1 - 1 / sf.b1)

    return from_owners(sf.z, params, check, compute, group, name)


def ema_eval_params(state: PyTree, params: Params, group: Any = None) -> Params:
    r"""`opttx.ema_eval_params` for a state spread over ranks (collective).

    Under `zero` (and ``sharded(..., on_owners=True)``) a rank's `opttx.ema_params` state
    holds the average :math:`\bar\theta` only of the parameters it owns; here each owner
    sends its leaves (cast to the parameters' dtypes), one broadcast per owner rank and dtype
    after one ``all_gather_object`` of who owns what, so every rank gets the whole average,
    bit for bit the single-device one. A state that holds every leaf needs no communication.

    Args:
      state: this rank's state of a transform with an `opttx.ema_params` inside (a `zero` or
        ``on_owners`` state around it).
      params: the full parameters, the same on every rank (as `zero` keeps them).
      group: the ranks the state is spread over (None: the default group).

    Returns:
      New tensors shaped like ``params``: the average, in their dtypes and on their devices.

    Example:
      >>> tx = opttx.ema_params(opttx.adamw(1e-3), 0.999)   # under zero: zero(ema_params(...))
      >>> state = tx.init(params)
      >>> averaged = opttx.distributed.ema_eval_params(state, params)   # every rank calls it
    """
    name = "opttx.distributed.ema_eval_params"
    ema_state = the_ema_params_state(state, name)

    def check(y: list[Any], ema: list[torch.Tensor], held: Params) -> None:
        _check_like(y, ema, held, name)

    def compute(y: list[torch.Tensor], ema: list[torch.Tensor]) -> list[torch.Tensor]:
        return [e.to(device=x.device, dtype=x.dtype, copy=True) for e, x in zip(ema, y)]

    return from_owners(ema_state.ema, params, check, compute, group, name)


def _check_like(y: list[Any], held: list[torch.Tensor], params: Params, name: str) -> None:
    """Every held leaf is a tensor of its parameter's shape; else a clear error naming it."""
    for path, yi, hi in zip(tree_paths(params), y, held):
        if not isinstance(yi, torch.Tensor) or tuple(yi.shape) != tuple(hi.shape):
            got = tuple(yi.shape) if isinstance(yi, torch.Tensor) else type(yi).__name__
            raise ValueError(f"{name}: params{path} is {got}, but the average has shape "
                             f"{tuple(hi.shape)}: pass the parameters the state was built on.")


def from_owners(held_tree: PyTree, params: Params, check: Callable, compute: Callable,
                group: Any, name: str) -> Params:
    """Every leaf of ``params`` computed by the rank whose state holds it (``held_tree``: a
    tree like ``params`` with `opttx.MaskedNode` where this rank holds nothing) with
    ``compute(param_leaves, held_leaves)``, and broadcast from there to every rank of
    ``group``. ``check(param_leaves, held_leaves, masked_params)`` runs on the held leaves
    first. One ``all_gather_object`` of who holds what, then one broadcast per owner rank
    and dtype; nothing when the state holds every leaf and there is one rank."""
    is_masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731
    z_all, _ = tree_flatten(held_tree, is_leaf=is_masked)
    y, spec = tree_flatten(params)
    if len(z_all) != len(y):
        raise ValueError(f"{name}: the state has {len(z_all)} positions for {len(y)} "
                         "parameter leaves: pass the parameter tree the state was built on.")
    mine = [not is_masked(z) for z in z_all]
    paths = tree_paths(params)
    split = [p for p, z, yi, m in zip(paths, z_all, y, mine)
             if m and isinstance(yi, torch.Tensor) and tuple(z.shape) != tuple(yi.shape)]
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    every = [mine]
    if distributed:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (mine, split), group=group)
        split = [p for _, theirs in every for p in theirs]
        every = [m for m, _ in every]
    if split:
        raise ValueError(f"{name}: a rank holds only rows of {split[0]} (zero's "
                         "split_above_mb): not supported; use a plan without split leaves.")
    owners = []
    for i, path in enumerate(paths):
        holders = [r for r, m in enumerate(every) if m[i]]
        if len(holders) != 1:
            raise ValueError(f"{name}: {path} is held by ranks {holders}, expected exactly "
                             "one owner (pass the state of a zero or on_owners transform, and "
                             "the group it runs on).")
        owners.append(holders[0])
    own = [i for i, m in enumerate(mine) if m]
    check([y[i] for i in own], [z_all[i] for i in own],
          tree_unflatten([y[i] if m else MaskedNode() for i, m in enumerate(mine)], spec))
    # the owners' leaves, computed as the single-device function computes them
    out: list[Any] = [None] * len(y)
    if own:
        local = compute([y[i] for i in own], [z_all[i] for i in own])
        for i, x in zip(own, local):
            out[i] = x
    if not distributed:
        return tree_unflatten(out, spec)
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    for r, source in enumerate(ranks):
        leaves = [i for i, o in enumerate(owners) if o == r]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in leaves:
            by_dtype.setdefault(y[i].dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            if out[idx[0]] is not None:          # this rank owns them: send
                buf = torch.cat([out[i].reshape(-1) for i in idx])
            else:
                buf = torch.empty(sum(y[i].numel() for i in idx), dtype=dtype,
                                  device=y[idx[0]].device)
            dist.broadcast(buf, src=source, group=group)
            start = 0
            for i in idx:
                n = y[i].numel()
                if out[i] is None:
                    out[i] = buf[start:start + n].view(y[i].shape).clone()
                start += n
    return tree_unflatten(out, spec)
