"""`all_reduce_gradients`: data-parallel gradient averaging as the first link of a chain."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .._checks import check_positive
from .._tracing import is_tracing
from ..base import (EmptyState, GradientTransformation, Params, Traits, Updates, describe_value,
                    check_init_params, declare)
from ..tree import tree_flatten, tree_leaves, tree_paths, tree_unflatten
from .overlap import BackwardLaunches
from .reducer import CollectiveStats, collective_device, pack_all_reduce
from .shapes import agree_on_configuration, agree_on_tree, require_member

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


@declare()
def all_reduce_gradients(group: Any = None, bucket_size_mb: float = 25, *,
                         stats: CollectiveStats | None = None,
                         communication_dtype: torch.dtype | None = None,
                         overlap: bool = False) -> GradientTransformation:
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
      communication_dtype: the buckets' dtype on the wire (None: the gradients'). With
        ``torch.bfloat16`` each rank's gradient is rounded to 8 significant bits before the sum
        and the sum once more: an element of the mean is off by at most about
        :math:`(W + 1)\,2^{-8}` times the mean of the ranks' absolute values.
      overlap: start each bucket's all-reduce during backward, from the post-accumulate-grad
        hooks of its parameters (`opttx.distributed.overlap.BackwardLaunches`), as DDP does;
        ``update`` waits for it. ``init`` must get the model's parameters themselves, and
        every rank must give every parameter a gradient in each backward (else a
        ``ValueError`` on every rank naming the parameter). ``update`` first agrees across
        the ranks (one small all-reduce) on which launched buckets stand: a bucket whose
        ``.grad`` tensors were replaced or modified in place since backward (say by
        ``clip_grad_norm_``) is all-reduced again, so the numbers are those without overlap.
        Eager only; accumulate micro-batches inside `opttx.distributed.no_sync`.

    Returns:
      A stateless `GradientTransformation` (with ``overlap``, ``init`` also hooks the
      parameters).

    Example:
      >>> tx = opttx.chain(opttx.distributed.all_reduce_gradients(dp_group),
      ...                  opttx.clip_by_global_norm(1.0), opttx.adamw(1e-3))

    References:
      Li et al., PyTorch Distributed: Experiences on Accelerating Data Parallel Training
      (VLDB 2020), for gradient bucketing and its overlap with backward.
    """
    check_positive("bucket_size_mb", bucket_size_mb)
    if communication_dtype is not None and (not isinstance(communication_dtype, torch.dtype)
                                            or not communication_dtype.is_floating_point):
        raise ValueError("all_reduce_gradients: communication_dtype must be a floating "
                         f"torch.dtype or None, got {communication_dtype!r}.")
    bucket_bytes = int(bucket_size_mb * 1024 * 1024)
    checked: list[bool] = []
    launched: list[BackwardLaunches] = []      # overlap: the hooks of the last init

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

    settings = [(f"all_reduce_gradients.{k}", describe_value(v, True)) for k, v in (
        ("bucket_size_mb", bucket_size_mb), ("communication_dtype", communication_dtype),
        ("overlap", overlap))]

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        g = group if group is not None else dist.group.WORLD
        if dist.is_initialized() and dist.get_world_size(g) > 1:
            # different settings on different ranks would pair mismatched collectives
            require_member(group, "opttx.distributed.all_reduce_gradients")
            agree_on_configuration(settings, g, collective_device(g),
                                   "opttx.distributed.all_reduce_gradients")
        if overlap:
            leaves = tree_leaves(params)
            if not BackwardLaunches.hookable(leaves):
                raise ValueError("all_reduce_gradients(overlap=True): init needs the model's "
                                 "parameters themselves (leaf tensors that require grad) to "
                                 "hook their gradients.")
            for old in launched:
                old.remove()
            g = group if group is not None else dist.group.WORLD
            launched[:] = [BackwardLaunches(leaves, plan_buckets(leaves, bucket_bytes),
                                            _bucket_launcher(g, communication_dtype, stats),
                                            group=g, names=tree_paths(params), stats=stats)]
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EmptyState]:
        del params, extra_args
        g = group if group is not None else dist.group.WORLD
        launches = launched[0] if launched and not is_tracing() else None
        if launches is not None:
            # which launches from backward stand, agreed on every rank (a missing gradient on
            # one rank raises on every rank here, before the tree checks)
            launches.settle(tree_flatten(updates)[0])
        if not checked and not is_tracing():
            agree(updates, g)
        leaves, treespec = tree_flatten(updates)
        if not leaves:
            return updates, state
        world = dist.get_world_size(g)
        out = list(leaves)
        for k, bucket in enumerate(plan_buckets(leaves, bucket_bytes)):
            grads = [leaves[i] for i in bucket]
            reduced = None if launches is None else launches.take(k, grads)
            if reduced is None:
                reduced = pack_all_reduce(grads, "sum", g, stats, communication_dtype)
            for i, r in zip(bucket, reduced):
                out[i] = r.to(leaves[i].dtype) / world
        return tree_unflatten(out, treespec), state

    # its collectives take each rank's own gradients: a wrapper deciding from them (a skip)
    # agrees on the decision over the group first
    return GradientTransformation(init, update, Traits(collective_groups=(group,)))


def _bucket_launcher(group: Any, dtype: torch.dtype | None, stats: CollectiveStats | None
                     ) -> Callable[[int, list[torch.Tensor]], Callable[[], list[torch.Tensor]]]:
    """``launch(bucket, grads)`` for `BackwardLaunches`: one asynchronous all-reduce of the
    packed bucket; ``wait()`` gives the summed gradients in their shapes."""
    def launch(k: int, grads: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        del k
        buf = torch.cat([x.reshape(-1).to(dtype or grads[0].dtype) for x in grads])
        if stats is not None:
            stats.record(group, buf)
        work = dist.all_reduce(buf, group=group, async_op=True)

        def wait() -> list[torch.Tensor]:
            work.wait()
            out, start = [], 0
            for x in grads:
                out.append(buf[start:start + x.numel()].view(x.shape))
                start += x.numel()
            return out
        return wait
    return launch
