"""`all_reduce_gradients`: data-parallel gradient averaging as the first link of a chain."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._checks import check_positive
from ..base import GradientTransformation, Params, Updates, stateless_with_extra_args
from ..tree import tree_flatten, tree_unflatten
from .reducer import CollectiveStats, collective_device, pack_all_reduce
from .shapes import agree_on_tree, require_member

__all__ = ["all_reduce_gradients", "plan_buckets"]


def plan_buckets(leaves: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``leaves`` grouped into buckets: leaves of one (device, dtype) in tree order,
    a new bucket whenever the next leaf would take the current one past ``bucket_bytes`` (a
    leaf larger than that gets a bucket of its own)."""
    by_kind: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        by_kind.setdefault((x.device, x.dtype), []).append(i)
    buckets: list[list[int]] = []
    for indices in by_kind.values():
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = leaves[i].numel() * leaves[i].element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def all_reduce_gradients(group: Any = None, bucket_size_mb: float = 25, *,
                         stats: CollectiveStats | None = None) -> GradientTransformation:
    r"""Average the updates (gradients) over the ranks of ``group``, in flat buckets.

    .. math::
        g \leftarrow \frac{1}{|G|} \sum_{r \in G} g^{(r)}

    Leaves are packed, in tree order and per (device, dtype), into flat buffers of at most
    ``bucket_size_mb`` MiB; each buffer is one functional ``all_reduce`` (sum, then divided by
    the group size, since gloo has no average). Collectives per step = number of buckets (the
    first eager call adds one small all-reduce that checks the ranks pass alike trees, shapes
    and dtypes: a clear ``ValueError`` on every rank instead of mismatched collectives). Use it
    as the first link of a chain in place of DDP's reducer; the rest of the chain then sees the
    data-parallel mean, identical on every rank.

    Args:
      group: the data-parallel process group (None: the default group).
      bucket_size_mb: the bucket capacity in MiB.
      stats: a `CollectiveStats` to count the collectives into (eager).

    Returns:
      A stateless `GradientTransformation`.

    Example:
      >>> tx = opttx.chain(opttx.distributed.all_reduce_gradients(dp_group),
      ...                  opttx.clip_by_global_norm(1.0), opttx.adamw(1e-3))

    References:
      Li et al., PyTorch Distributed: Experiences on Accelerating Data Parallel Training
      (VLDB 2020), for gradient bucketing.
    """
    check_positive("bucket_size_mb", bucket_size_mb)
    bucket_bytes = int(bucket_size_mb * 1024 * 1024)

    checked: list[bool] = []

    def agree(updates: Updates, g: Any) -> None:
        """On the first (eager) call: the ranks must pass the same tree of the same shapes and
        dtypes, else their buckets pair mismatched collectives (a gloo abort, a hang, or sums
        of unrelated leaves). One small all-reduce, once."""
        require_member(group, "opttx.distributed.all_reduce_gradients")
        agree_on_tree(updates, g, collective_device(g),
                      "opttx.distributed.all_reduce_gradients: the ranks passed different "
                      "gradient trees (structure, shapes or dtypes); every rank must pass "
                      "gradients of the same parameters, alike.")
        checked.append(True)

    def average(updates: Updates, params: Params | None, extra_args: dict) -> Updates:
        del params, extra_args
        g = group if group is not None else dist.group.WORLD
        if not checked and not torch.compiler.is_compiling():
            agree(updates, g)
        leaves, treespec = tree_flatten(updates)
        if not leaves:
            return updates
        world = dist.get_world_size(g)
        out = list(leaves)
        for bucket in plan_buckets(leaves, bucket_bytes):
            reduced = pack_all_reduce([leaves[i] for i in bucket], "sum", g, stats)
            for i, r in zip(bucket, reduced):
                out[i] = r / world
        return tree_unflatten(out, treespec)

    return stateless_with_extra_args(average)
