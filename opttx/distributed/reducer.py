"""The reducer that `sharded` passes to every transform of a chain.

Every layer-wise statistic in opttx goes through `opttx.base.reduce_statistics(partials,
extra_args, op, dims)` (docs/design.md, rule 6). Under `opttx.distributed.sharded`, that call lands
in `ShardedReducer.__call__`, which decides per leaf which process groups shard the dims the
statistic was reduced over, packs all leaves bound for the same group into one flat buffer and
issues one functional all-reduce per (group, op) per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..tree import MaskedNode, PyTree
from .specs import Shard

__all__ = ["CollectiveStats", "ShardedReducer", "collective_device", "pack_all_reduce"]


@dataclass
class CollectiveStats:
    """Counts of the collectives issued in eager mode (under ``torch.compile`` the counts are
    those of tracing). ``calls`` is the number of reduction-hook calls that reached a reducer,
    ``collectives`` the number of all-reduces issued, ``bytes`` their payload."""

    calls: int = 0
    collectives: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.calls = self.collectives = self.bytes = 0

    def record(self, group: Any, buffer: torch.Tensor) -> None:
        self.collectives += 1
        self.bytes += buffer.numel() * buffer.element_size()


def collective_device(group: Any) -> torch.device:
    """Where a small control tensor must live for ``group``'s backend (NCCL: the GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pack_all_reduce(tensors: Sequence[torch.Tensor], op: str, group: Any,
                    stats: CollectiveStats | None = None, dtype: torch.dtype | None = None,
                    tail: Callable[[torch.dtype, torch.device], torch.Tensor] | None = None
                    ) -> list[torch.Tensor]:
    """All-reduce ``tensors`` over ``group`` with one collective: flatten them into one buffer
    (in ``dtype``, default their promoted dtype), reduce, and split back into their shapes and
    dtypes. ``tail(dtype, device)``: a vector to reduce along in the same buffer, returned,
    reduced, after the others (the step counters of `StepCounters.reduction_tail`)."""
    if not tensors:
        return []
    if dtype is None:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
    parts = [t.reshape(-1).to(dtype) for t in tensors]
    if tail is not None:
        tensors = list(tensors) + [tail(dtype, parts[0].device)]
        parts.append(tensors[-1])
    buffer = torch.cat(parts)
    if stats is not None:
        stats.record(group, buffer)
    reduced = funcol.all_reduce(buffer, op, group)
    reduced = funcol.wait_tensor(reduced)
    out, start = [], 0
    for t in tensors:
        n = t.numel()
        out.append(reduced[start:start + n].view(t.shape).to(t.dtype))
        start += n
    return out


class ShardedReducer:
    """``reducer(partials, op="sum", dims=None)``: the collectives of one reduction hook call.

    For leaf :math:`\\ell` with shards :math:`(d_k, G_k)_k` and a statistic reduced over the
    dims :math:`D_\\ell` (None: all), the partial is combined over every :math:`G_k` with
    :math:`d_k \\in D_\\ell`; the others already hold the whole statistic. Groups are visited
    in a fixed order (first appearance in the spec tree, the same on every rank); for each, the
    partials of all leaves (and of all trees of a tuple) bound for it are packed into one flat
    buffer and reduced with one ``all_reduce``. A leaf sharded over two groups (a 2-D mesh) is
    reduced over the first, then the result over the second.

    Args:
      treespec: the structure of the params (and so of the updates).
      flat_specs: per leaf, a tuple of `Shard` with non-negative dims (empty: replicated).
      groups: the groups in the order every rank visits them.
      stats: a `CollectiveStats` to count into (optional).
      ndims: the number of dims of each leaf (to resolve negative ``dims``).
      check: before each group's reduction, all-reduce the buffer length (max of ``n`` and of
        ``-n``, one small extra collective per group and call, issued even when this rank has
        nothing for the group) and raise ``ValueError`` on every rank when the ranks disagree,
        instead of a mismatched collective (a hang or a gloo abort). For debugging: a
        disagreement means a transform made a shape-dependent decision on the local shard.
    """

    def __init__(self, treespec: Any, flat_specs: list[tuple[Shard, ...]], groups: list[Any],
                 stats: CollectiveStats | None = None, ndims: list[int] | None = None,
                 check: bool = False) -> None:
        self.treespec = treespec
        self.check = check
        self._ndims = ndims
        self.flat_specs = flat_specs
        self.groups = groups
        self.stats = stats
        # per leaf, the shape of the whole tensor (set by `sharded`): decisions that read a
        # leaf's shape (Adafactor's factoring) take them, not the local shard's
        self.global_shapes: list[tuple[int, ...]] | None = None
        # per leaf split by rows over one group (`zero`'s split_above_mb), this rank's first
        # row (None elsewhere): row-aligned blocks are whole (see `require_whole`)
        self.row_starts: list[int | None] | None = None
        # the state's step counters, to travel with the next reduction (see carry_counters)
        self._counters: Any = None

    def carry_counters(self, counters: Any) -> None:
        """Send ``counters`` (a `StepCounters`; None: none) along with the first all-reduce
        of the next call, where they are compared (`StepCounters.check_reduced`): `sharded`
        hands it the state's step counters before each eager update and takes them back
        after it, so the ranks' steps are compared without a collective of their own (a
        chain without statistics, Adam's, carries nothing)."""
        self._counters = counters if counters else None
    def global_shapes_of(self, tree: PyTree) -> list[tuple[int, ...]] | None:
        """The global shapes of the leaves present in ``tree`` (a tree like the params,
        `MaskedNode` where absent), in its leaf order; None when unknown or when ``tree`` has
        another structure (blocks of leaves)."""
        if self.global_shapes is None:
            return None
        try:
            flat = self.treespec.flatten_up_to(tree)
        except (ValueError, TypeError):
            return None
        return [self.global_shapes[i] for i, x in enumerate(flat)
                if isinstance(x, torch.Tensor)]

    def _split_trees(self, partials: PyTree, dims: PyTree | None
                     ) -> tuple[bool, list[list[Any]], list[list[Any]]]:
        """Partials and dims, per tree, as one entry per parameter leaf."""
        def one(tree: PyTree) -> list[Any] | None:
            try:
                flat = self.treespec.flatten_up_to(tree)
            except (ValueError, TypeError):
                return None
            ok = all(isinstance(x, (torch.Tensor, MaskedNode)) or x is None for x in flat)
            return flat if ok else None

        single = one(partials)
        several = ([one(t) for t in partials] if single is None and
                   isinstance(partials, (tuple, list)) else [])
        if single is not None:
            trees, dim_trees, is_tuple = [single], [dims], False
        elif several and all(t is not None for t in several):
            trees, is_tuple = several, True
            if dims is None:
                dim_trees = [None] * len(partials)
            elif isinstance(dims, (tuple, list)) and len(dims) == len(partials):
                dim_trees = list(dims)
            else:
                raise ValueError("reduce_statistics: with a tuple of partial trees, dims must be "
                                 "None or a tuple of dim trees of the same length.")
        else:
            raise ValueError("reduce_statistics under opttx.distributed.sharded: the partials "
                             "must be a tree shaped like the params (MaskedNode where absent) or "
                             "a tuple of such trees.")
        n = len(self.flat_specs)
        flat_dims = []
        for d in dim_trees:
            if d is None:
                flat_dims.append([None] * n)
            else:
                flat_dims.append(self.treespec.flatten_up_to(d))
        return is_tuple, trees, flat_dims

    def local_offsets(self, tree: PyTree) -> list[dict[int, int]]:
        """Per leaf present in ``tree`` (this rank's pieces, a tree like the params,
        `MaskedNode` where absent; in its leaf order, as `global_shapes_of`), this rank's
        first index along each sharded dim, ``{dim: offset}`` (empty for replicated leaves):
        what a transform needs to take its piece of a tensor it builds whole (Dion's starting
        factor). From ``row_starts`` where known, else one ``all_gather`` of the local sizes
        per group: call it on every rank alike (at ``init``). One `Shard` per dim."""
        flat = self.treespec.flatten_up_to(tree)
        out: list[dict[int, int]] = [{} for _ in flat]
        for i in range(len(flat)):
            if self.row_starts is not None and self.row_starts[i] is not None:
                out[i][0] = self.row_starts[i]
        for group in self.groups:
            members = [(i, s.dim) for i, shards in enumerate(self.flat_specs) for s in shards
                       if s.group is group and s.dim not in out[i]]
            if not members:
                continue
            sizes = torch.tensor([flat[i].shape[d] if isinstance(flat[i], torch.Tensor) else 0
                                  for i, d in members], dtype=torch.int64,
                                 device=collective_device(group))
            every = [torch.zeros_like(sizes) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, sizes, group=group)
            before = sum(every[:dist.get_rank(group)], torch.zeros_like(sizes))
            for (i, d), off in zip(members, before.tolist()):
                out[i][d] = int(off)
        return [o for o, x in zip(out, flat) if isinstance(x, torch.Tensor)]

    def require_whole(self, tree: PyTree, name: str, block_rows: int | None = None) -> None:
        """Raise ``ValueError`` when a leaf of ``tree`` (a tree like the params, `MaskedNode`
        where absent) is sharded: ``name`` needs whole matrices (see
        `opttx.base.require_whole_leaves`). With ``block_rows``, a leaf split by rows whose
        local rows start at a multiple of it and hold whole blocks of it (the last one may be
        short at the leaf's end) passes: ``name`` needs whole blocks only. A tree of another
        structure (blocks of leaves) is not checked here: the transform that made the blocks
        checked the leaves."""
        try:
            flat = self.treespec.flatten_up_to(tree)
        except (ValueError, TypeError):
            return
        sharded = [i for i, x in enumerate(flat)
                   if isinstance(x, torch.Tensor) and self.flat_specs[i]
                   and not self._whole_row_blocks(i, x, block_rows)]
        if sharded:
            raise ValueError(
                f"{name} needs whole matrices, but {len(sharded)} of its leaves are local "
                f"shards here (leaf {sharded[0]}: {self.flat_specs[sharded[0]]}); computing "
                "it on the local block would be another optimizer. Run it on owner ranks: "
                "opttx.distributed.sharded(tx, specs, on_owners=True), or "
                "sharded(chain(..., on_owners(tx)), specs).")

    def _whole_row_blocks(self, i: int, x: torch.Tensor, block_rows: int | None) -> bool:
        """Whether this rank's piece ``x`` of leaf ``i`` is whole blocks of ``block_rows``
        rows (split on dim 0 only, starting at a multiple of it)."""
        if block_rows is None or self.row_starts is None or self.global_shapes is None:
            return False
        start = self.row_starts[i]
        specs = self.flat_specs[i]
        if start is None or len(specs) != 1 or specs[0].dim != 0 or x.ndim == 0:
            return False
        rows, total = x.shape[0], self.global_shapes[i][0]
        return start % block_rows == 0 and (rows % block_rows == 0 or start + rows == total)

    def _groups_of(self, leaf: int, dims: Any) -> list[Any]:
        shards = self.flat_specs[leaf]
        if dims is None:
            return [s.group for s in shards]
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        ndim = self._ndims[leaf] if self._ndims is not None else None
        if ndim is not None:
            dims = tuple(d % ndim for d in dims)
        return [s.group for s in shards if s.dim in dims]

    def _check_lengths(self, group: Any, tensors: list[torch.Tensor]) -> None:
        n = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else collective_device(group)
        both = funcol.wait_tensor(funcol.all_reduce(
            torch.tensor([n, -n], dtype=torch.int64, device=device), "max", group))
        high, low = int(both[0]), -int(both[1])
        if high != low:
            raise ValueError(
                f"opttx.distributed: the ranks of a group disagree on the size of a reduction "
                f"({low} to {high} elements; this rank: {n}). The ranks configured or "
                "decided something differently (a per-leaf setting such as factor_axes that "
                "differs between ranks, or a custom transform that reads the local shard's "
                "shape): give every rank the same settings, decided on the global shapes "
                "(opttx.distributed.global_shapes).")

    def __call__(self, partials: PyTree, op: str = "sum", dims: PyTree | None = None) -> PyTree:
        if op not in ("sum", "max"):
            raise ValueError(f"reduce_statistics: op must be 'sum' or 'max', got {op!r}.")
        if self.stats is not None:
            self.stats.calls += 1
        is_tuple, trees, flat_dims = self._split_trees(partials, dims)
        values = [list(t) for t in trees]
        # which (tree, leaf) goes through which groups (found by identity: Dynamo of torch
        # 2.11 cannot trace id() of a process group)
        todo: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        for t, (tree, tdims) in enumerate(zip(trees, flat_dims)):
            for i, (x, d) in enumerate(zip(tree, tdims)):
                if not isinstance(x, torch.Tensor):
                    continue
                for g in self._groups_of(i, d):
                    todo[next(k for k, h in enumerate(self.groups) if h is g)].append((t, i))
        for group, members in zip(self.groups, todo):   # the same order on every rank
            if self.check:
                self._check_lengths(group, [values[t][i] for t, i in members or ()])
            if not members:
                continue
            counters, tail = self._counters, None
            if counters is not None:          # the first collective carries them, then none
                self._counters = None
                world = dist.get_world_size(group)
                tail = (lambda dtype, device: counters.reduction_tail(op, dtype, world, device))
            reduced = pack_all_reduce([values[t][i] for t, i in members], op, group, self.stats,
                                      tail=tail)
            if counters is not None:
                sent = reduced.pop()
                counters.check_reduced(op, sent, sent.dtype, world)
            for (t, i), r in zip(members, reduced):
                values[t][i] = r
        outs = [self.treespec.unflatten(v) for v in values]
        return tuple(outs) if is_tuple else outs[0]

