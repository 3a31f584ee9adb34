"""Sharding specs: how each local leaf relates to the logical (global) tensor it is a piece of.

A leaf is either `Replicated` (every rank of every group holds the whole tensor) or sharded
along one dim over a process group (`Shard`), or along several dims over several groups at once
(a tuple of `Shard`, one per mesh dim: TP on one mesh dim, FSDP/DP on another). Splits may be
uneven: the local sizes along a sharded dim may differ between ranks (``torch.tensor_split``,
``torch.chunk`` or any other contiguous split); only the sum of the local sizes is the global
size. Specs are given explicitly as a tree shaped like the params (Megatron-style TP on plain
tensors) or read from `torch.distributed.tensor.DTensor` leaves (`specs_from_dtensors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist

from ..tree import PyTree, tree_flatten, tree_paths

__all__ = ["LeafSpec", "Replicated", "Shard", "flatten_specs", "local_shard", "shard_groups",
           "specs_from_dtensors"]


@dataclass(frozen=True)
class Replicated:
    """The leaf is whole on every rank: its statistics need no collective."""


@dataclass(frozen=True, eq=False)
class Shard:
    """The leaf is the local piece, along ``dim``, of a tensor split over ``group``.

    Args:
      dim: the sharded dim of the leaf (negative counts from the end).
      group: the process group whose ranks hold the pieces (None: the default group).
      size: the global size of ``dim`` (optional: it is the sum of the local sizes and only
        checked against them when given, see `global_shapes`).

    Example:
      >>> tp = dist.new_group([0, 1])
      >>> specs = {"w1": Shard(1, tp), "w2": Shard(0, tp), "b2": Replicated()}
    """

    dim: int
    group: Any = None
    size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int):
            raise TypeError(f"Shard.dim must be an int, got {self.dim!r}.")
        if self.size is not None and self.size < 0:
            raise ValueError(f"Shard.size must be >= 0, got {self.size}.")

    def __repr__(self) -> str:
        size = _group_size(self.group) if isinstance(self.group, dist.ProcessGroup) else -1
        group = ("WORLD" if self.group is None else f"group of {size}" if size >= 0
                 else repr(self.group))
        size = "" if self.size is None else f", size={self.size}"
        return f"Shard({self.dim}, {group}{size})"


LeafSpec = Union[Replicated, Shard, tuple[Shard, ...]]
"""The spec of one leaf: `Replicated`, a `Shard`, or a tuple of `Shard` (one per mesh dim)."""


def _group_size(group: Any) -> int:
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return -1


def _normalize(spec: Any, leaf: Any, path: str) -> tuple[Shard, ...]:
    """The leaf's spec as a tuple of `Shard` with non-negative dims (empty: replicated)."""
    if spec is None or isinstance(spec, Replicated):
        return ()
    shards = (spec,) if isinstance(spec, Shard) else spec
    if not isinstance(shards, (tuple, list)) or not all(isinstance(s, Shard) for s in shards):
        raise TypeError(f"The sharding spec of {path} must be Replicated(), Shard(dim, group) "
                        f"or a tuple of Shard (one per mesh dim), got {spec!r}.")
    ndim = leaf.ndim if isinstance(leaf, torch.Tensor) else None
    out = []
    for s in shards:
        dim = s.dim
        if ndim is not None:
            if not -ndim <= dim < ndim:
                raise ValueError(f"The sharding spec of {path} shards dim {s.dim}, but the leaf "
                                 f"has {ndim} dims (shape {tuple(leaf.shape)}).")
            dim %= ndim
        group = s.group if s.group is not None else dist.group.WORLD
        if isinstance(group, int) or dist.get_rank(group) < 0:   # int: NON_GROUP_MEMBER
            raise ValueError(f"The sharding spec of {path} names a process group this rank "
                             f"(rank {dist.get_rank()}) is not in; give each rank the group it "
                             "belongs to (new_group returns a placeholder to non-members).")
        out.append(Shard(dim, group, s.size))
    groups = [id(s.group) for s in out]
    if len(set(groups)) != len(groups):
        raise ValueError(f"The sharding spec of {path} uses the same process group for two mesh "
                         f"dims ({spec!r}); each mesh dim needs its own group.")
    return tuple(out)


def flatten_specs(params: PyTree, specs: PyTree) -> list[tuple[Shard, ...]]:
    """Per leaf of ``params`` (in flattening order), its spec as a tuple of `Shard` with
    non-negative dims and explicit groups; ``()`` for replicated leaves.

    ``specs`` is a tree with the structure of ``params`` whose leaves are `LeafSpec` (or None
    for replicated); a mismatch raises ``ValueError`` naming the first path that differs.
    """
    leaves, treespec = tree_flatten(params)
    try:
        flat = treespec.flatten_up_to(specs)
    except (ValueError, TypeError) as e:
        paths = ", ".join(tree_paths(params)[:8])
        raise ValueError(f"The sharding specs do not have the structure of the params ({e}). "
                         f"Give one spec per parameter leaf, in a tree like the params "
                         f"(leaves: {paths}{', ...' if len(leaves) > 8 else ''}).") from None
    paths = tree_paths(params)
    return [_normalize(s, leaf, path) for s, leaf, path in zip(flat, leaves, paths)]


def shard_groups(flat_specs: list[tuple[Shard, ...]]) -> list[Any]:
    """The distinct process groups of ``flat_specs`` in order of first appearance (leaf order,
    then mesh-dim order): the order in which every rank issues its collectives."""
    seen: list[Any] = []
    for shards in flat_specs:
        for s in shards:
            # by identity, without id(): Dynamo of torch 2.11 cannot trace id() of a group
            if not any(s.group is g for g in seen):
                seen.append(s.group)
    return seen


def local_shard(full: torch.Tensor, spec: LeafSpec | None) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec``, split as ``torch.tensor_split`` does
    (sizes differ by at most one, the larger pieces first). For tests and for sharding a
    checkpoint by hand; the library itself accepts any contiguous split."""
    out = full
    for s in _normalize(spec, full, "<leaf>"):
        rank, world = dist.get_rank(s.group), dist.get_world_size(s.group)
        out = torch.tensor_split(out, world, dim=s.dim)[rank]
    return out.contiguous()


def specs_from_dtensors(params: PyTree) -> PyTree:
    """The spec tree of a tree of `DTensor` leaves (plain tensors are `Replicated`).

    A mesh dim with placement ``Shard(d)`` becomes ``Shard(d, mesh.get_group(i))``;
    ``Replicate()`` adds nothing; ``Partial`` placements are rejected (reduce them first).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    leaves, treespec = tree_flatten(params)
    out: list[Any] = []
    for leaf, path in zip(leaves, tree_paths(params)):
        if not isinstance(leaf, DTensor):
            out.append(Replicated())
            continue
        mesh = leaf.device_mesh
        shards = []
        for i, p in enumerate(leaf.placements):
            if isinstance(p, DShard):
                shards.append(Shard(p.dim, mesh.get_group(i), leaf.shape[p.dim]))
            elif not isinstance(p, DReplicate):
                raise ValueError(f"{path} has placement {p} on mesh dim {i}; opttx.distributed "
                                 "handles Shard and Replicate (redistribute Partial first).")
        out.append(tuple(shards) if shards else Replicated())
    return treespec.unflatten(out)

