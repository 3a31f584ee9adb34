"""Global shapes of sharded leaves, the factoring decisions that depend on them, and the
all-ranks error agreement that keeps a bad spec from hanging a job."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from ..base import Params
from ..tree import PyTree, tree_flatten, tree_leaves, tree_paths
from .reducer import CollectiveStats, collective_device, pack_all_reduce
from .specs import flatten_specs, shard_groups, specs_from_dtensors

__all__ = ["global_factor_axes", "global_shapes", "raise_on_every_rank"]


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a `torch.distributed.tensor.DTensor`."""
    from torch.distributed.tensor import DTensor
    return isinstance(x, DTensor)


def require_member(group: Any, who: str) -> None:
    """Raise ``ValueError`` when this rank is not in ``group``: checked before any collective
    on it (torch's own error, or a hang, would come first)."""
    if not dist.is_initialized() or group is None or group is dist.group.WORLD:
        return
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"{who}: this rank ({dist.get_rank()}) is not in the given process "
                         "group; call it only on the ranks of the group, or pass a group that "
                         "holds this rank.")


def _digest(tree: PyTree) -> int:
    """A hash of the tree structure, shapes and dtypes, the same on every rank alike."""
    leaves, treespec = tree_flatten(tree)
    text = repr(treespec) + repr([(tuple(x.shape), str(x.dtype)) for x in leaves])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def agree_on_tree(tree: PyTree, group: Any, device: torch.device, message: str) -> None:
    """Raise ``ValueError(message + the first difference)`` on every rank of ``group`` when
    the ranks' trees differ in structure, shapes or dtypes (plans made from different trees
    would pair mismatched collectives: a hang or an abort). One all-reduce of a hash; an
    object gather only to describe a difference."""
    h = _digest(tree)
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) == -int(both[1]):
        return
    mine = [f"{p}: {tuple(x.shape)} {x.dtype}" for p, x in
            zip(tree_paths(tree), tree_leaves(tree))]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    detail = ""
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            diff = next((f"{a!r} on rank 0 vs {b!r} on rank {r}" for a, b in
                         zip(every[0], theirs) if a != b),
                        f"{len(every[0])} leaves on rank 0 vs {len(theirs)} on rank {r}")
            detail = f" First difference: {diff}."
            break
    raise ValueError(message + detail)


def agree_on_configuration(items: list[tuple[str, str]], group: Any, device: torch.device,
                           what: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` when the ranks built different
    transforms or configurations (``items``: `opttx.base.configuration_items` of the
    transform and the wrapper's own settings, hyperparameter values included), naming the
    first setting that differs and both values. Called first in ``init``, before any
    collective whose size or kind depends on a setting (a different ``communication_dtype``
    or ``split_above_mb`` on one rank would pair mismatched collectives: a gloo abort or a
    hang). One all-reduce of a hash; an object gather only to name the difference."""
    text = repr(items)
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) == -int(both[1]):
        return
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, items, group=group)
    r = next(r for r, t in enumerate(every) if t != every[0])
    mine, theirs = dict(every[0]), dict(every[r])
    diffs = [f"{k}: {mine.get(k, '<absent>')} on rank 0, {theirs.get(k, '<absent>')} on "
             f"rank {r}" for k in dict.fromkeys(list(mine) + list(theirs))
             if mine.get(k) != theirs.get(k)]
    raise ValueError(f"{what}: the ranks built different transforms or settings, which would "
                     f"pair mismatched collectives (an abort or a hang): "
                     f"{'; '.join(diffs[:4]) or 'their order differs'}. Give every rank the "
                     "same transform and settings.")


def agree_on_state_structure(state: Any, group: Any, device: torch.device, what: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` when the ranks' optimizer
    states differ in their skeleton (the links of a chain, each link's state type and fields;
    deeper parts legitimately differ where ranks hold different leaves): different chains on
    different ranks, which would pair mismatched collectives (a gloo abort, a hang). One
    all-reduce of a hash at init; an object gather only to name the difference."""
    text = repr(_skeleton(state))
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) == -int(both[1]):
        return
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, text[:300], group=group)
    r = next(r for r, t in enumerate(every) if t != every[0])
    raise ValueError(f"{what}: the ranks built different optimizer states (different chains "
                     f"or settings on different ranks would pair mismatched collectives). "
                     f"Rank 0: {every[0]} ... rank {r}: {every[r]} ... Give every rank the same "
                     "transform.")


def _skeleton(state: Any, depth: int = 1) -> Any:
    """The chain's shape of a state: the links (tuples) and, for each, its state's NamedTuple
    type and fields; nothing deeper, which may follow the leaves a rank holds (an 8-bit
    state's dense and quantized parts, a partition's groups)."""
    from ..tree import MaskedNode
    if isinstance(state, MaskedNode) or depth <= 0:
        return "."
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return (type(state).__name__,
                tuple((f, _skeleton(getattr(state, f), depth - 1)) for f in state._fields))
    if isinstance(state, tuple):
        return tuple(_skeleton(x, depth) for x in state)
    return "."


def raise_on_every_rank(error: BaseException | None, group: Any = None,
                        others: str | None = None) -> None:
    """Raise on every rank of ``group`` (default: all) if any rank has an ``error``.

    One all-reduce (max) of a flag: the rank that found the error raises it; the others raise a
    ``ValueError`` that points to it (``others``, with ``{rank}`` for that rank, when given).
    Call it where all ranks arrive (``init``).
    """
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1 + dist.get_rank()], dtype=torch.int64,
                        device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if flag.item():
        if others is not None:
            raise ValueError(others.format(rank=flag.item() - 1))
        raise ValueError(f"opttx.distributed: rank {flag.item() - 1} rejected its sharding "
                         "specs (see its error); no rank went on.")


def global_shapes(params: Params, specs: PyTree | None = None,
                  stats: CollectiveStats | None = None, check: bool = True
                  ) -> list[tuple[int, ...]]:
    """The global shape of every leaf of ``params`` (flattening order), from the local shapes
    and the specs: one all-reduce of the local sizes per process group.

    Raises ``ValueError`` (on every rank alike) when a `Shard` that states its ``size`` does
    not match the sum of the local sizes (unless ``check=False``).
    """
    leaves, _ = tree_flatten(params)
    flat = flatten_specs(params, specs if specs is not None else specs_from_dtensors(params))
    local = [tuple(x.to_local().shape) if is_dtensor(x) else tuple(x.shape) for x in leaves]
    shapes = [list(s) for s in local]
    for group in shard_groups(flat):              # sequential: nested shards on one dim work
        members = [(i, s.dim) for i, shards in enumerate(flat) for s in shards
                   if s.group is group]
        device = collective_device(group)
        sizes = [torch.tensor([shapes[i][d]], dtype=torch.int64, device=device)
                 for i, d in members]
        for (i, d), total in zip(members, pack_all_reduce(sizes, "sum", group, stats)):
            shapes[i][d] = int(total.item())
    paths = tree_paths(params)
    for i, shards in enumerate(flat if check else []):
        for s in shards:
            if s.size is not None and s.size != shapes[i][s.dim]:
                raise ValueError(f"{paths[i]}: the spec says dim {s.dim} has global size "
                                 f"{s.size}, but the local shards (local shape {local[i]}) add "
                                 f"up to {shapes[i][s.dim]}.")
    return [tuple(s) for s in shapes]


def global_factor_axes(params: Params, specs: PyTree | None = None,
                       factor_axes: str = "largest",
                       min_dim_size_to_factor: int = 128) -> PyTree:
    """The factoring axes of every leaf decided on its global shape, as a tree of explicit
    ``(d0, d1)`` or None to pass as ``factor_axes`` to `opttx.adafactor`, `opttx.came` or
    `opttx.scale_by_factored_rms`.

    Under `sharded` the named rules (``"largest"``, ``"last"``, ``min_dim_size_to_factor``)
    already read the global shapes (the reducer knows them), so this is not needed there; it
    makes the decisions explicit (to inspect them, to save them with a checkpoint, or for a
    transform run on local shards outside `sharded`).

    Example:
      >>> axes = global_factor_axes(local_params, specs, "largest", 128)
      >>> tx = sharded(opttx.adafactor(1e-2, factor_axes=axes), specs)
    """
    from ..transforms.factored import factored_axes

    treespec = tree_flatten(params)[1]
    shapes = global_shapes(params, specs)
    meta = treespec.unflatten([torch.empty(s, device="meta") for s in shapes])
    return treespec.unflatten(factored_axes(meta, factor_axes, min_dim_size_to_factor))


def row_segment_sizes(rows: int, world: int, block: int = 1) -> list[int]:
    """The rows of each segment: whole blocks of ``block`` rows spread as evenly as
    ``torch.tensor_split`` spreads rows (the extra blocks to the last ranks, so that the short
    last block joins whole ones), the last segment ending at ``rows``."""
    blocks = -(-rows // block)
    counts = [blocks // world + (r >= world - blocks % world) for r in range(world)]
    sizes = [c * block for c in counts]
    sizes[-1] -= blocks * block - rows
    return sizes
