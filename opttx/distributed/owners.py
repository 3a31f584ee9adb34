r"""`on_owners(tx)`: run a transform on whole leaves, each at one owner rank, exactly.

Element-wise and layer-wise transforms run on local shards (`sharded` turns their statistics
into collectives). Matrix transforms cannot: Shampoo's factors :math:`GG^\top`, GaLore's SVD,
the 256-element blocks of an 8-bit state all need the whole tensor, and computing them on the
local block would be a different optimizer. `on_owners` brings every leaf whole to one owner
rank, runs ``tx`` there and sends each rank its piece of the update back:

1. a plan, made once: every rank's coordinates in the groups that shard each leaf and its local
   shape (one ``all_gather_object`` over the owner group); each leaf gets one owner, greedily
   by cost (largest first, to the least loaded rank), the same on every rank;
2. per step, one ``all_to_all`` carries every rank's pieces of the gradients (and of the
   parameters) to the owners, which reassemble them by coordinates (uneven splits, 2-D
   meshes and nested shards of one dim included);
3. each rank runs ``tx`` on the leaves it owns, the others masked out (`opttx.MaskedNode`),
   so it holds optimizer state for those leaves only; statistics across leaves (a global
   norm) are combined over the owner group by `opttx.base.reduce_across_leaves`;
4. one ``all_to_all`` sends each rank its piece of every update.

Two collectives per step (three with a global norm), whatever the number of leaves, all
functional (``torch.compile`` traces them without a graph break).

With ``split_above_mb`` a leaf too large for one owner is cut into one row segment per rank
(at multiples of a blocked transform's block rows): each owner receives only the rows of its
segment, from the pieces that hold them, and runs ``tx`` on them with the segments' statistics
reduced across the owners, as `sharded` does for ``Shard(0)``. Shi et al.'s distributor hands
out Shampoo's blocks the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .._checks import check_nonnegative
from .._tracing import is_tracing
from ..base import (GradientTransformation, Params, REDUCER_KEY, State, TOTALS_KEY, Updates,
                    current_reducer, declare, reducer_during_init, traits_of)
from ..tree import MaskedNode, PyTree, tree_paths
from .chunk_plan import state_costs
from .reducer import CollectiveStats, ShardedReducer, pack_all_reduce
from .specs import Shard, shard_groups

__all__ = ["OwnerPlan", "default_cost", "on_owners", "plan_owners"]


Coords = tuple[int, ...]


@dataclass(frozen=True)
class LeafRoute:
    """How one leaf travels: its shards, every owner-group rank's piece, its owner."""
    index: int                         # position among the param leaves
    shards: tuple[Shard, ...]          # () replicated
    pieces: tuple[tuple[Coords, tuple[int, ...]], ...]  # per owner-group rank: coords, shape
    shape: tuple[int, ...]             # the whole leaf's shape (of a segment: its rows)
    owner: int                         # owner-group rank that computes it (-1: split)
    rows: tuple[int, int] | None = None           # a segment: rows [a, b) of the whole leaf
    row_slices: tuple[tuple[int, int], ...] = ()   # a segment: per owner-group rank, the rows
                                                   # of its local piece that fall in it
    segments: tuple[LeafRoute, ...] = ()           # a split leaf: segment r, owned by rank r

    def piece_numel(self, rank: int) -> int:
        n = 1
        for s in self.pieces[rank][1]:
            n *= s
        return n

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def extent(self, prefix: Coords, dim: int) -> int:
        """The size along ``dim`` of the sub-block whose coordinates start with ``prefix``."""
        level = len(prefix)
        if level == len(self.shards):
            return self._shape_at[prefix][dim]
        sizes = self._group_sizes()
        if self.shards[level].dim == dim:
            return sum(self.extent(prefix + (c,), dim) for c in range(sizes[level]))
        return self.extent(prefix + (0,), dim)

    def __post_init__(self) -> None:
        # made once, eagerly (the plan is built outside any compiled region), read at every
        # step: each piece's shape by its coordinates, and the split sizes of every level
        object.__setattr__(self, "_shape_at", dict(self.pieces))
        object.__setattr__(self, "_split_sizes", self._make_split_sizes())

    def _make_split_sizes(self) -> dict[Coords, list[int]]:
        """For every prefix of coordinates, the sizes its children take along the dim split
        at that level."""
        sizes = self._group_sizes()
        out: dict[Coords, list[int]] = {}

        def visit(prefix: Coords) -> None:
            level = len(prefix)
            if level == len(self.shards):
                return
            d = self.shards[level].dim
            out[prefix] = [self.extent(prefix + (c,), d) for c in range(sizes[level])]
            for c in range(sizes[level]):
                visit(prefix + (c,))
        visit(())
        return out

    def _group_sizes(self) -> list[int]:
        return [dist.get_world_size(s.group) for s in self.shards]

    def row_offset(self, coords: Coords) -> int:
        """The first row (dim 0) of the whole leaf that the piece at ``coords`` holds."""
        offset = 0
        for level, s in enumerate(self.shards):
            if s.dim == 0:
                offset += sum(self.extent(coords[:level] + (c,), 0)
                              for c in range(coords[level]))
        return offset

    def segment(self, owner: int, start: int, stop: int) -> LeafRoute:
        """The route of rows ``[start, stop)`` of this leaf to ``owner``: every piece cut to
        the rows it holds of them (none, for a piece elsewhere along dim 0)."""
        pieces, slices = [], []
        for coords, shape in self.pieces:
            first = self.row_offset(coords) if self.shards else 0
            lo, hi = max(start, first), min(stop, first + shape[0])
            hi = max(hi, lo)
            pieces.append((coords, (hi - lo, *shape[1:])))
            slices.append((lo - first, hi - first))
        return LeafRoute(self.index, self.shards, tuple(pieces), (stop - start, *self.shape[1:]),
                     owner, rows=(start, stop), row_slices=tuple(slices))

    def assemble(self, by_rank: dict[int, torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece (a dict owner-group rank -> piece)."""
        by_coords = {self.pieces[r][0]: x for r, x in by_rank.items()}
        sizes = self._group_sizes()

        def build(prefix: Coords) -> torch.Tensor:
            level = len(prefix)
            if level == len(self.shards):
                return by_coords[prefix]
            return torch.cat([build(prefix + (c,)) for c in range(sizes[level])],
                             dim=self.shards[level].dim)
        return build(())

    def split(self, whole: torch.Tensor) -> list[torch.Tensor]:
        """Every owner-group rank's piece of ``whole`` (the inverse of `assemble`)."""
        out: dict[Coords, torch.Tensor] = {}

        def cut(x: torch.Tensor, prefix: Coords) -> None:
            level = len(prefix)
            if level == len(self.shards):
                out[prefix] = x
                return
            parts = torch.split(x, self._split_sizes[prefix], dim=self.shards[level].dim)
            for c, part in enumerate(parts):
                cut(part, prefix + (c,))
        cut(whole, ())
        return [out[coords] for coords, _ in self.pieces]


@dataclass(frozen=True)
class OwnerPlan:
    """Who computes which leaf, and how the pieces travel (see `on_owners`).

    Attributes:
      group: the owner group (ranks among which leaves are spread).
      rank: this rank's index in it; world: its size.
      leaves: per param leaf, its route, or None where the leaf is absent (masked); a leaf
        split into row segments (``split_above_mb``) has owner -1 and one segment per rank.
      loads: the summed cost of the leaves (and segments) each rank owns.
    """
    group: Any
    rank: int
    world: int
    leaves: tuple[LeafRoute | None, ...]
    loads: tuple[float, ...]

    @classmethod
    def of_whole_leaves(cls, shapes: Sequence[Sequence[int]]) -> OwnerPlan:
        """The plan of one rank owning whole replicated leaves of these shapes (what the
        bucketing and the cost model read: each leaf's route, in order)."""
        leaves = tuple(LeafRoute(i, (), (((), tuple(s)),), tuple(s), 0)
                       for i, s in enumerate(shapes))
        return cls(None, 0, 1, leaves, (0.0,))

    def owned(self) -> list[bool]:
        """Per param leaf, whether this rank computes it (or a row segment of it)."""
        return [leaf is not None and (leaf.owner == self.rank or len(leaf.segments) > 0)
                for leaf in self.leaves]

    def owners(self) -> list[int | None]:
        """Per param leaf, the owner-group rank that computes it (None: absent; -1: split
        into row segments, segment r computed by rank r)."""
        return [None if leaf is None else leaf.owner for leaf in self.leaves]

    def split(self) -> list[bool]:
        """Per param leaf, whether it is split into row segments over the owners."""
        return [leaf is not None and len(leaf.segments) > 0 for leaf in self.leaves]

    def routes(self) -> list[LeafRoute]:
        """The routes in a fixed order: whole leaves, and the segments of split ones."""
        out: list[LeafRoute] = []
        for leaf in self.leaves:
            if leaf is not None:
                out.extend(leaf.segments or (leaf,))
        return out


def default_cost(shape: Sequence[int]) -> float:
    r"""The work of one leaf for balancing owners: its element count plus, for a matrix (the
    last two dims), the :math:`m^3 + n^3` of the eigendecompositions or SVDs a matrix
    transform runs on it, counted per matrix of a batch."""
    numel = 1
    for s in shape:
        numel *= s
    if len(shape) < 2 or numel == 0:
        return float(numel)
    m, n = shape[-2], shape[-1]
    return float(numel + (numel // (m * n)) * (m ** 3 + n ** 3))


def _owner_group(flat_specs: list[tuple[Shard, ...]], group: Any) -> Any:
    if group is not None:
        return group
    groups = shard_groups(flat_specs)
    if len(groups) == 1:
        return groups[0]
    return dist.group.WORLD


def make_plan(reducer: ShardedReducer, present: list[torch.Tensor | None], group: Any,
              cost: Callable[[Sequence[int]], float], paths: list[str],
              split_above_mb: float | None = None, block_rows: int | None = None) -> OwnerPlan:
    """Resolve `OwnerPlan` for the leaves in ``present`` (None: absent): one
    ``all_gather_object`` over the owner group; errors are raised on every rank alike.
    Leaves larger than ``split_above_mb`` (MiB, whole) are cut into one row segment per rank
    (at multiples of ``block_rows``) where they have enough rows."""
    from .shapes import raise_on_every_rank
    group = _owner_group(reducer.flat_specs, group)
    error: BaseException | None = None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        error = ValueError(f"on_owners: rank {dist.get_rank()} is not in the owner group.")
    mine = []
    for i, x in enumerate(present):
        if x is None:
            mine.append(None)
            continue
        coords = tuple(dist.get_rank(s.group) for s in reducer.flat_specs[i])
        mine.append((coords, tuple(x.shape)))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    leaves: list[LeafRoute | None] = []
    for i, x in enumerate(present):
        if error is not None or x is None:
            leaves.append(None)
            continue
        shards = reducer.flat_specs[i]
        pieces = [e[i] for e in everyone]
        if any(p is None for p in pieces):
            error = ValueError(f"on_owners: {paths[i]} is masked on some ranks only.")
            continue
        if shards:
            n_pieces = 1
            for s in shards:
                n_pieces *= dist.get_world_size(s.group)
            coords = [c for c, _ in pieces]
            if n_pieces != world or len(set(coords)) != world:
                error = ValueError(
                    f"on_owners: {paths[i]} is split into {n_pieces} pieces over its groups, "
                    f"but the owner group has {world} ranks holding "
                    f"{len(set(coords))} distinct pieces; every leaf must be spread over "
                    "exactly the owner group (pass owner_group= the group that shards it, "
                    "or one on-owners transform per group).")
                continue
            leaf = LeafRoute(i, shards, tuple(pieces), (), -1)
            shape = tuple(leaf.extent((), d) for d in range(x.ndim))
        else:
            shapes = {s for _, s in pieces}
            if len(shapes) != 1:
                error = ValueError(f"on_owners: {paths[i]} is replicated but its shape differs "
                                   f"between ranks: {sorted(shapes)}.")
                continue
            shape = pieces[0][1]
        leaves.append(LeafRoute(i, shards, tuple(pieces), shape, -1))
    raise_on_every_rank(error, group)
    loads = [0.0] * world
    leaves = _split_leaves(leaves, present, world, split_above_mb, block_rows, cost, loads)
    # greedy: largest cost first, to the least loaded rank (ties: lowest leaf index, rank)
    order = sorted((i for i, leaf in enumerate(leaves) if leaf is not None
                    and not leaf.segments), key=lambda i: (-cost(leaves[i].shape), i))
    owners: dict[int, int] = {}
    for i in order:
        r = min(range(world), key=lambda k: (loads[k], k))
        owners[i] = r
        loads[r] += cost(leaves[i].shape)
    final = tuple(None if leaf is None else leaf if leaf.segments else LeafRoute(
        leaf.index, leaf.shards, leaf.pieces, leaf.shape, owners[i])
        for i, leaf in enumerate(leaves))
    return OwnerPlan(group, rank, world, final, tuple(loads))


def blocked_cost(cost: Callable[[Sequence[int]], float], block_rows: int | None
                  ) -> Callable[[Sequence[int]], float]:
    r"""``cost`` summed over the blocks a blocked transform (`Traits.block_rows`: Shampoo's
    ``max_preconditioner_dim``) cuts a leaf into: a 50k x 4096 embedding costs its blocks'
    :math:`\sum (m^3 + n^3)`, not that of one 50k x 4096 matrix."""
    if block_rows is None or cost is None:
        return cost
    from ..transforms.shampoo import block_shapes
    return lambda shape: sum(cost(b) for b in block_shapes(shape, block_rows))


def _split_leaves(leaves: list[LeafRoute | None], present: list[torch.Tensor | None], world: int,
                  split_above_mb: float | None, block_rows: int | None,
                  cost: Callable[[Sequence[int]], float], loads: list[float]
                  ) -> list[LeafRoute | None]:
    """``leaves`` with those above ``split_above_mb`` cut into one row segment per rank
    (segment r to rank r, its cost added to ``loads[r]``)."""
    if split_above_mb is None or world < 2:
        return leaves
    from .shapes import row_segment_sizes
    block = block_rows or 1
    out = list(leaves)
    for i, leaf in enumerate(leaves):
        if leaf is None or not leaf.shape:
            continue
        nbytes = leaf.numel() * present[i].element_size()
        if nbytes <= split_above_mb * 2**20 or -(-leaf.shape[0] // block) < world:
            continue
        segments, start = [], 0
        for r, rows in enumerate(row_segment_sizes(leaf.shape[0], world, block)):
            segments.append(leaf.segment(r, start, start + rows))
            loads[r] += cost(segments[-1].shape)
            start += rows
        out[i] = LeafRoute(leaf.index, leaf.shards, leaf.pieces, leaf.shape, -1,
                       segments=tuple(segments))
    return out


def plan_owners(params: Params, specs: PyTree | None = None, owner_group: Any = None,
                cost: Callable[[Sequence[int]], float] | str = default_cost,
                tx: GradientTransformation | None = None,
                split_above_mb: float | None = None) -> OwnerPlan:
    """The `OwnerPlan` that `on_owners` makes for these local ``params`` and ``specs`` (None:
    read from DTensor leaves): which rank computes (and holds the state of) which leaf. A
    collective over the owner group; call it on every rank. Plans depend only on the shapes,
    the specs, ``cost``, ``split_above_mb`` and the transform's blocking (a blocked
    transform's leaves cost the sum over their blocks; ``cost="state"`` needs ``tx``), so with
    the same arguments and ``tx`` this is the plan `on_owners(tx, ...)` uses.

    Example:
      >>> plan = plan_owners(local_params, specs)
      >>> mine = [path for path, owned in zip(opttx.tree.tree_paths(local_params),
      ...                                     plan.owned()) if owned]
    """
    from ..tree import tree_flatten
    from .specs import flatten_specs, specs_from_dtensors
    from .shapes import is_dtensor
    leaves, treespec = tree_flatten(params)
    flat = flatten_specs(params, specs if specs is not None else specs_from_dtensors(params))
    reducer = ShardedReducer(treespec, flat, shard_groups(flat), ndims=[x.ndim for x in leaves])
    local = [x.to_local() if is_dtensor(x) else x for x in leaves]
    if cost == "state" and tx is None:
        raise ValueError("plan_owners: cost='state' needs the transform: pass tx=.")
    cost_fn, block_rows = _plan_cost(tx, cost, local)
    return make_plan(reducer, local, owner_group, cost_fn, tree_paths(params), split_above_mb,
                     block_rows)


def _all_to_all(chunks: list[list[torch.Tensor]], recv_sizes: list[int], group: Any,
                dtype: torch.dtype, device: torch.device,
                stats: CollectiveStats | None) -> list[torch.Tensor]:
    """Send ``chunks[r]`` (a list of tensors) to owner-group rank ``r``; return what every rank
    sent to this one, as one flat tensor per source rank."""
    return _finish_all_to_all(_start_all_to_all(chunks, recv_sizes, group, dtype, device,
                                                stats))


def _start_all_to_all(chunks: list[list[torch.Tensor]], recv_sizes: list[int], group: Any,
                      dtype: torch.dtype, device: torch.device,
                      stats: CollectiveStats | None) -> tuple[torch.Tensor, list[int]]:
    """Issue the ``all_to_all`` of `_all_to_all` without waiting for it (a functional
    collective: in eager mode it runs in the background until `_finish_all_to_all`, and
    ``torch.compile`` traces it, and its wait, without a graph break)."""
    flat = [x.reshape(-1).to(dtype) for chunk in chunks for x in chunk]
    send = torch.cat(flat) if flat else torch.zeros(0, dtype=dtype, device=device)
    send_sizes = [sum(x.numel() for x in chunk) for chunk in chunks]
    if stats is not None:
        stats.record(group, send)
    return funcol.all_to_all_single(send, recv_sizes, send_sizes, group), recv_sizes


def _finish_all_to_all(pending: tuple[torch.Tensor, list[int]]) -> list[torch.Tensor]:
    """Wait for an ``all_to_all`` `_start_all_to_all` issued; one flat tensor per source."""
    got, recv_sizes = pending
    return list(torch.split(funcol.wait_tensor(got), recv_sizes))


def _dtype_device(tensors: list[torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype, tensors[0].device


def gather_to_owners(plan: OwnerPlan, trees: list[list[torch.Tensor | None]],
                     stats: CollectiveStats | None = None) -> list[list[torch.Tensor | None]]:
    """Bring the leaves of every tree in ``trees`` (per param leaf, this rank's piece, None
    where absent) whole to their owners, in one ``all_to_all``; per tree, the whole leaves this
    rank owns (None elsewhere)."""
    return finish_gather(start_gather(plan, trees, stats))


def start_gather(plan: OwnerPlan, trees: list[list[torch.Tensor | None]],
                 stats: CollectiveStats | None = None, routes: list[LeafRoute] | None = None,
                 dtype: torch.dtype | None = None) -> tuple:
    """Issue the ``all_to_all`` of `gather_to_owners` for ``routes`` (default: all of the
    plan's), on the wire in ``dtype`` (default: the promoted dtype of the routes' pieces),
    without waiting; `finish_gather` waits and reassembles."""
    routes = plan.routes() if routes is None else routes
    if not routes:
        return plan, trees, routes, None
    wire, device = _dtype_device([tree[leaf.index] for tree in trees for leaf in routes])
    chunks: list[list[torch.Tensor]] = [[] for _ in range(plan.world)]
    for leaf in routes:
        if leaf.shards:
            for tree in trees:
                chunks[leaf.owner].append(_rows_of(leaf, tree[leaf.index], plan.rank))
    recv_sizes = [sum(leaf.piece_numel(src) for leaf in routes
                      if leaf.shards and leaf.owner == plan.rank) * len(trees)
                  for src in range(plan.world)]
    pending = _start_all_to_all(chunks, recv_sizes, plan.group, dtype or wire, device, stats)
    return plan, trees, routes, pending


def finish_gather(started: tuple) -> list[list[torch.Tensor | None]]:
    """The whole leaves this rank owns among the routes of a `start_gather`, per tree (None
    elsewhere)."""
    plan, trees, routes, pending = started
    out: list[list[torch.Tensor | None]] = [[None] * len(plan.leaves) for _ in trees]
    if not routes:
        return out
    got = _finish_all_to_all(pending)
    offsets = [0] * plan.world
    for leaf in routes:
        if leaf.owner != plan.rank:
            continue
        for t, tree in enumerate(trees):
            if not leaf.shards:
                out[t][leaf.index] = _rows_of(leaf, tree[leaf.index], plan.rank)
                continue
            pieces = {}
            for src in range(plan.world):
                n = leaf.piece_numel(src)
                pieces[src] = got[src][offsets[src]:offsets[src] + n].view(
                    leaf.pieces[src][1]).to(tree[leaf.index].dtype)
                offsets[src] += n
            out[t][leaf.index] = leaf.assemble(pieces)
    return out


def _rows_of(leaf: LeafRoute, piece: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of this rank's ``piece`` that travel on route ``leaf`` (all of them for a
    whole leaf)."""
    if leaf.rows is None:
        return piece
    lo, hi = leaf.row_slices[rank]
    return piece[lo:hi]


def scatter_from_owners(plan: OwnerPlan, whole: list[torch.Tensor | None],
                        like: list[torch.Tensor | None],
                        stats: CollectiveStats | None = None,
                        communication_dtype: torch.dtype | None = None
                        ) -> list[torch.Tensor | None]:
    """Send every rank its piece of the whole updates its owners computed (``whole``: per
    param leaf, the owned update, None elsewhere), in one ``all_to_all`` (in
    ``communication_dtype`` when given); per param leaf, this rank's piece, in the dtype of
    ``like`` (this rank's gradient piece)."""
    return finish_scatter(start_scatter(plan, whole, like, stats, communication_dtype))


def wire_dtype(plan: OwnerPlan, like: list[torch.Tensor | None], routes: list[LeafRoute],
               communication_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype updates travel back in: ``communication_dtype``, else the promoted dtype of
    the routes' pieces (None without routes)."""
    if communication_dtype is not None:
        return communication_dtype
    return _dtype_device([like[leaf.index] for leaf in routes])[0] if routes else None


def start_scatter(plan: OwnerPlan, whole: list[torch.Tensor | None],
                  like: list[torch.Tensor | None], stats: CollectiveStats | None = None,
                  communication_dtype: torch.dtype | None = None,
                  routes: list[LeafRoute] | None = None) -> tuple:
    """Issue the ``all_to_all`` of `scatter_from_owners` for ``routes`` (default: all of the
    plan's) without waiting; `finish_scatter` waits and cuts the pieces out."""
    routes = plan.routes() if routes is None else routes
    if not routes:
        return plan, whole, like, routes, None, None
    device = like[routes[0].index].device
    dtype = wire_dtype(plan, like, routes, communication_dtype)
    chunks: list[list[torch.Tensor]] = [[] for _ in range(plan.world)]
    for leaf in routes:
        if leaf.owner != plan.rank:
            continue
        if leaf.shards:
            for dst, piece in enumerate(leaf.split(whole[leaf.index])):
                chunks[dst].append(piece)
        else:
            for dst in range(plan.world):
                if dst != plan.rank:
                    chunks[dst].append(whole[leaf.index])
    recv_sizes = [0] * plan.world
    for leaf in routes:
        if leaf.owner == plan.rank and not leaf.shards:
            continue
        recv_sizes[leaf.owner] += (leaf.piece_numel(plan.rank) if leaf.shards
                                   else leaf.numel())
    pending = _start_all_to_all(chunks, recv_sizes, plan.group, dtype, device, stats)
    return plan, whole, like, routes, dtype, pending


def finish_scatter(started: tuple, out: list[torch.Tensor | None] | None = None
                   ) -> list[torch.Tensor | None]:
    """This rank's pieces of the updates of a `start_scatter`'s routes, per param leaf (None
    elsewhere), written into ``out`` when given."""
    plan, whole, like, routes, dtype, pending = started
    if out is None:
        out = [None] * len(plan.leaves)
    if not routes:
        return out
    got = _finish_all_to_all(pending)
    rows: dict[int, list[torch.Tensor]] = {}        # the parts of split leaves, in row order
    offsets = [0] * plan.world
    for leaf in routes:
        ref = like[leaf.index]
        if leaf.owner == plan.rank and not leaf.shards:
            # the owner's own copy goes through the wire dtype too: every rank the same
            part = whole[leaf.index].to(dtype)
        else:
            shape = leaf.pieces[plan.rank][1] if leaf.shards else leaf.shape
            n, src = math.prod(shape), leaf.owner
            part = got[src][offsets[src]:offsets[src] + n].view(shape)
            offsets[src] += n
        if leaf.rows is None:
            out[leaf.index] = part.to(ref.dtype)
        else:
            rows.setdefault(leaf.index, []).append(part)
    for i, parts in rows.items():
        out[i] = torch.cat(parts).to(like[i].dtype)
    return out


def check_pieces(plan: OwnerPlan, trees: list[list[torch.Tensor | None]],
                 paths: Callable[[], Sequence[str]], what: Sequence[str]) -> ValueError | None:
    """The error for a leaf of ``trees`` (per param leaf, this rank's piece, None where
    absent) whose shape is not this rank's piece in ``plan``, else None: a wrong shape would
    be cut into the others' pieces silently."""
    for tree, name in zip(trees, what):
        for leaf, x in zip(plan.leaves, tree):
            if leaf is None or x is None:
                continue
            expected = leaf.pieces[plan.rank][1]
            if tuple(x.shape) != tuple(expected):
                return ValueError(
                    f"on_owners: {name} {paths()[leaf.index]} has local shape {tuple(x.shape)}, "
                    f"but the plan made at init gives this rank (owner-group rank "
                    f"{plan.rank}) a piece of shape {tuple(expected)} of the whole "
                    f"{leaf.shape}; pass updates and params shaped like the params given to "
                    "init.")
    return None


def _totals(plan: OwnerPlan, stats: CollectiveStats | None,
            outer: Callable[..., torch.Tensor] | None = None) -> Callable[..., torch.Tensor]:
    """The ``TOTALS_KEY`` hook: a total over the owned leaves all-reduced over the owner group,
    then passed to the hook of an enclosing wrapper (`zero` around this one), if any."""
    def combine(total: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = pack_all_reduce([total], op, plan.group, stats)[0]
        return out if outer is None else outer(out, op=op)
    return combine


@declare(same_state_as="tx")
def on_owners(tx: GradientTransformation, owner_group: Any = None,
              cost: Callable[[Sequence[int]], float] | str = default_cost,
              stats: CollectiveStats | None = None,
              split_above_mb: float | None = None,
              communication_dtype: torch.dtype | None = None,
              overlap: bool = False, buckets: int | None = None,
              bucket_mb: float | None = None) -> GradientTransformation:
    r"""Run ``tx`` on whole leaves, each at one owner rank; a link of a `sharded` chain.

    For a leaf split over the groups :math:`G_1, \dots, G_k` into pieces :math:`x^{(r)}`,
    the owner :math:`o(\ell)` receives every piece, reassembles :math:`x_\ell`, and computes

    .. math::
        (u_\ell, s_\ell) = \mathrm{tx}(x_\ell, s_\ell) \quad\text{on rank } o(\ell)\ \text{only,}

    then every rank receives its piece :math:`u_\ell^{(r)}`. The result is the single-device
    result exactly, for any transform (Shampoo, GaLore, 8-bit states, ...). Replicated leaves
    are spread over the owners too (the owner's result is sent to every rank), so each leaf's
    state lives on one rank and the work is balanced: owners are chosen greedily, most
    expensive leaf first, to the rank with the least work so far (``cost``, default
    `default_cost`: elements plus :math:`m^3+n^3` per matrix). The state on each rank is
    ``tx``'s state over the leaves it owns (the others `opttx.MaskedNode`).

    Collectives per step: one ``all_to_all`` bringing gradient (and parameter) pieces to the
    owners, one sending update pieces back, plus one ``all_reduce`` of a scalar per global
    statistic across leaves (`opttx.clip_by_global_norm` inside ``tx``), whatever the number
    of leaves.

    Args:
      tx: any transform; it sees whole leaves and no sharded reducer.
      owner_group: the ranks among which leaves are spread. Default: the one group that
        shards the leaves when there is one, else the default group. Every sharded leaf must
        be split over exactly these ranks (one piece per rank); replicated leaves are whole
        on each of them.
      cost: ``cost(shape) -> float``, the work of a leaf for balancing (for a blocked
        transform, summed over its blocks); or ``"state"``: the optimizer-state bytes
        ``tx.init`` allocates for the leaf (measured once per shape on meta tensors), to
        balance memory rather than the work of the roots.
      stats: a `CollectiveStats` to count into (default: that of the enclosing `sharded`).
      split_above_mb: cut every leaf larger than this (MiB, whole) into one row segment
        (dim 0) per owner-group rank instead of giving it one owner, so that a 50k x 4096
        embedding's blocks do not all land on one rank. For blocked transforms
        (`opttx.shampoo`: segments cut at multiples of its ``max_preconditioner_dim``,
        `opttx.base.Traits.block_rows`, so each rank holds whole blocks, balanced by their
        :math:`m^3+n^3`) and for element-wise, factored and layer-wise ones (statistics over
        dim 0 reduced across the segments, as `sharded` does for ``Shard(0)``). Each rank
        receives only the rows of its segment (from the tensor-parallel pieces that hold
        them), so the collectives per step stay two. Transforms that need whole matrices
        (GaLore, 8-bit states) refuse segments with a ``ValueError``; so does `on_owners` for
        statistics across leaves (a global norm); checkpoints of a split plan are refused.
      communication_dtype: the dtype the updates travel back in (``torch.bfloat16`` halves
        that ``all_to_all``); gradients and parameters travel in their own dtype, so the
        owners compute exactly; each rank's update piece is rounded to that dtype (relative
        error at most :math:`2^{-8}` for bf16), the same rounding on every rank that holds a
        copy of a replicated leaf.
      overlap: send the leaves in buckets and overlap one bucket's ``all_to_all`` with the
        owners' computation of another (`opttx.distributed.owners_overlap`): the next
        bucket's gather is issued before the current bucket is computed, and each bucket's
        updates travel back while the next computes. Bitwise the plain path's result and
        state; two ``all_to_all`` per bucket. Only for transforms whose traits say each
        leaf's output depends on that leaf alone (``Traits.per_leaf``, not
        ``across_leaves``; others raise ``ValueError``), and not with ``split_above_mb``.
        ``buckets`` of about equal bytes (default 4, ``owners_overlap.DEFAULT_BUCKETS``,
        measured in benchmarks/owners_overlap.py and modeled in benchmarks/scale_model.py), or
        buckets of ``bucket_mb`` MiB of whole leaves; either implies ``overlap``. Leaves of
        one shape stay in one bucket for a transform that batches them
        (``Traits.batched_across_leaves``: Muon), so its batches are the plain path's.
      buckets: the number of buckets (about equal bytes, leaves in order).
      bucket_mb: the size of a bucket, MiB of whole leaves.

    Inside `opttx.distributed.sharded` (which knows the specs) it does the above;
    ``sharded(tx, specs, on_owners=True)`` is ``sharded(on_owners(tx), specs)``. Outside any
    `sharded` (one device, the single-device reference of a sharded run) it is ``tx`` itself,
    with ``tx``'s state, so one factory serves both runs. Put element-wise and
    layer-wise links outside it to keep them on the local shards (less traffic), e.g.
    ``sharded(chain(all_reduce_gradients(dp), on_owners(shampoo(...))), specs)``.

    Example:
      >>> specs = {"w": Shard(0, tp), "b": Replicated()}
      >>> tx = sharded(opttx.shampoo(1e-3, precondition_frequency=10), specs, on_owners=True)
      >>> state = tx.init(local_params)      # Shampoo factors only for the leaves owned here
      >>> updates, state = tx.update(local_grads, state, local_params)

    References:
      Shi et al., A Distributed Data-Parallel PyTorch Implementation of Distributed Shampoo
      (arXiv 2309.06497), section 4 (blocks assigned to ranks); Rajbhandari et al., ZeRO
      (arXiv 1910.02054) for partitioning optimizer state by owner.
    """
    if split_above_mb is not None:
        check_nonnegative("split_above_mb", split_above_mb)
        if traits_of(tx).across_leaves:
            raise ValueError(
                "on_owners: split_above_mb with a transform that takes statistics across "
                "leaves (a global norm, Traits.across_leaves) is not supported: every rank "
                "holds rows of a split leaf. Split only element-wise, factored, layer-wise "
                "and blocked chains; clip outside on_owners.")
    if not (callable(cost) or cost == "state"):
        raise ValueError(f"on_owners: cost must be a function of a shape or 'state', got "
                         f"{cost!r}.")
    if communication_dtype is not None and (not isinstance(communication_dtype, torch.dtype)
                                            or not communication_dtype.is_floating_point):
        raise ValueError("on_owners: communication_dtype must be a floating torch.dtype or "
                         f"None, got {communication_dtype!r}.")
    bucketed = overlap or buckets is not None or bucket_mb is not None
    if bucketed:
        from .owners_overlap import DEFAULT_BUCKETS, check_bucketable
        if buckets is not None and (not isinstance(buckets, int) or buckets < 1):
            raise ValueError(f"on_owners: buckets must be a positive int, got {buckets!r}.")
        if buckets is not None and bucket_mb is not None:
            raise ValueError("on_owners: give buckets or bucket_mb, not both.")
        if bucket_mb is not None:
            check_nonnegative("bucket_mb", bucket_mb)
        if buckets is None and bucket_mb is None:
            buckets = DEFAULT_BUCKETS
        if split_above_mb is not None:
            raise ValueError("on_owners: buckets (overlap) with split_above_mb is not "
                             "supported: the rows of a split leaf are reduced across the "
                             "owners inside tx; use one or the other.")
        check_bucketable(tx)
    cfg = _OwnersConfig(tx, owner_group, cost, stats, split_above_mb, communication_dtype,
                        bucketed, buckets, bucket_mb)
    plans: dict[tuple[bool, ...], OwnerPlan] = {}     # by which leaves are present
    checked: set[int] = set()                         # plans whose pieces the ranks agreed on
    bucket_plans: dict[int, Any] = {}                 # overlap: per plan, its BucketPlan

    def init(params: Params) -> State:
        if current_reducer(None) is None:      # one device: the leaves are whole already
            return cfg.tx.init(params)
        reducer = _reducer_of("init", None)
        local = _split_tree(reducer, params)
        plan = _plan_for(reducer, local, params, plans, cfg)
        whole = gather_to_owners(plan, [local], cfg.stats or reducer.stats)[0]
        # tx sees whole leaves (and the rows of split ones), as in update
        with reducer_during_init(_segments_reducer(reducer, plan, cfg.stats or reducer.stats)):
            state = cfg.tx.init(_masked(reducer, whole, plan.owned()))
        if cfg.bucketed:                       # each bucket's part of the state, mapped once
            _bucket_plan_for(cfg, plan, reducer, local, state, bucket_plans)
        return state

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        if current_reducer(extra_args) is None:   # one device: tx itself
            return cfg.tx.update(updates, state, params, **extra_args)
        return _on_owners_update(updates, state, params, extra_args, cfg, plans, checked,
                                 bucket_plans)

    return GradientTransformation(init, update)


@dataclass(frozen=True, eq=False)
class _OwnersConfig:
    """The static settings of one `on_owners` transform (plain data)."""
    tx: GradientTransformation
    owner_group: Any                          # None: the group that shards the leaves
    cost: Callable[[Sequence[int]], float] | str   # a function of a shape, or "state"
    stats: CollectiveStats | None
    split_above_mb: float | None = None       # leaves cut into row segments above this
    communication_dtype: torch.dtype | None = None   # of the updates on the wire
    bucketed: bool = False                    # overlap: leaves travel and compute in buckets
    buckets: int | None = None                # the number of buckets (or None: by size)
    bucket_mb: float | None = None            # the size of a bucket, MiB of whole leaves


def _split_tree(reducer: ShardedReducer, tree: PyTree) -> list[torch.Tensor | None]:
    """The leaves of ``tree`` in the reducer's order, None where masked."""
    flat = reducer.treespec.flatten_up_to(tree)
    return [x if isinstance(x, torch.Tensor) else None for x in flat]


def _plan_for(reducer: ShardedReducer, present: list[torch.Tensor | None],
              params_tree: PyTree, plans: dict[tuple[bool, ...], OwnerPlan],
              cfg: _OwnersConfig) -> OwnerPlan:
    """The plan for the leaves in ``present``, made once per set of present leaves."""
    key = tuple(x is not None for x in present)
    if key not in plans:
        try:
            paths = tree_paths(params_tree)
        except Exception:  # noqa: BLE001 - only for messages
            paths = [f"leaf {i}" for i in range(len(present))]
        if len(paths) != len(present):
            paths = [f"leaf {i}" for i in range(len(present))]
        cost, block_rows = _plan_cost(cfg.tx, cfg.cost, present)
        plans[key] = make_plan(reducer, present, cfg.owner_group, cost, paths,
                               cfg.split_above_mb, block_rows)
    return plans[key]


def _plan_cost(tx: GradientTransformation | None, cost: Callable[[Sequence[int]], float] | str,
               present: list[torch.Tensor | None]
               ) -> tuple[Callable[[Sequence[int]], float], int | None]:
    """The cost function of a plan for ``tx`` (summed over its blocks, or its state bytes
    for ``cost="state"``) and the block rows its segments are cut at."""
    block_rows = traits_of(tx).block_rows if tx is not None else None
    if cost == "state":
        dtype = next((x.dtype for x in present if x is not None), torch.float32)
        return _state_cost(tx, dtype), block_rows
    return blocked_cost(cost, block_rows), block_rows


def _state_cost(tx: GradientTransformation, dtype: torch.dtype
                ) -> Callable[[Sequence[int]], float]:
    """The state bytes ``tx.init`` allocates for one leaf of ``shape`` (`zero.state_costs` on
    a one-leaf tree of meta tensors), cached per shape."""
    cache: dict[tuple[int, ...], float] = {}

    def cost(shape: Sequence[int]) -> float:
        key = tuple(shape)
        if key not in cache:
            with reducer_during_init(None):        # the leaf alone, whole
                measured = state_costs(tx, [torch.empty(key, dtype=dtype, device="meta")])
            if measured is None:
                raise ValueError("on_owners: cost='state' measures tx.init on meta tensors, "
                                 "which this transform refuses; balance by work (the "
                                 "default cost) instead.")
            cache[key] = measured[0]
        return cache[key]
    return cost


def _segments_reducer(reducer: ShardedReducer, plan: OwnerPlan,
                      stats: CollectiveStats | None) -> ShardedReducer | None:
    """The reducer ``tx`` sees when the plan splits leaves into row segments: those leaves
    are ``Shard(0)`` over the owner group (this rank's first row and the whole shapes known,
    so blocks and factored statistics are those of the whole leaf); None otherwise."""
    split = plan.split()
    if not any(split):
        return None
    out = ShardedReducer(reducer.treespec,
                         [(Shard(0, plan.group),) if s else () for s in split], [plan.group],
                         stats, ndims=[len(leaf.shape) if leaf is not None else 0
                                       for leaf in plan.leaves])
    out.global_shapes = [leaf.shape if leaf is not None else () for leaf in plan.leaves]
    out.row_starts = [leaf.segments[plan.rank].rows[0] if s else None
                      for leaf, s in zip(plan.leaves, split)]
    return out


def _masked(reducer: ShardedReducer, leaves: list[torch.Tensor | None],
            keep: list[bool]) -> PyTree:
    """The tree of ``leaves`` with those not kept (or absent) as `MaskedNode`."""
    return reducer.treespec.unflatten(
        [x if k and x is not None else MaskedNode() for x, k in zip(leaves, keep)])


def _reducer_of(where: str, extra_args: dict[str, Any] | None) -> ShardedReducer:
    """The enclosing `sharded`'s reducer; raises outside `sharded`."""
    # init has no extra_args: `sharded` makes its reducer current around tx.init
    reducer = current_reducer(extra_args)
    if not isinstance(reducer, ShardedReducer):
        raise ValueError(f"on_owners: {where} outside opttx.distributed.sharded; wrap the "
                         "chain: sharded(on_owners(tx), specs) or sharded(tx, specs, "
                         "on_owners=True).")
    return reducer


def _agree_on_pieces(plan: OwnerPlan, trees: list, updates: PyTree, checked: set[int]) -> None:
    """Raise when a piece of ``trees`` has the wrong shape, on every rank at a plan's first
    eager update."""
    # static shapes: a Python check, also when compiled; at the first eager update of a
    # plan every rank agrees on it (one all-reduce), so a wrong shape on one rank raises
    # on all of them rather than leave the others waiting in the all_to_all
    error = check_pieces(plan, trees, lambda: tree_paths(updates), ("updates", "params"))
    if id(plan) not in checked and not is_tracing():
        from .shapes import raise_on_every_rank
        raise_on_every_rank(error, plan.group)
        checked.add(id(plan))
    if error is not None:
        raise error


def _bucket_plan_for(cfg: _OwnersConfig, plan: OwnerPlan, reducer: ShardedReducer,
                     local: list[torch.Tensor | None], state: State,
                     bucket_plans: dict[int, Any]) -> Any:
    """The `owners_overlap.BucketPlan` of ``plan``, made once (at init, eagerly) from the
    whole state ``state``."""
    if id(plan) not in bucket_plans:
        if is_tracing():
            raise ValueError("on_owners: the buckets are mapped at init (or the first eager "
                             "update); run one eagerly before compiling the update.")
        from .owners_overlap import bucket_plan
        bucket_plans[id(plan)] = bucket_plan(cfg.tx, plan, reducer.treespec, local, state,
                                             cfg.buckets, cfg.bucket_mb)
    return bucket_plans[id(plan)]


def _on_owners_update(updates: Updates, state: State, params: Params | None,
                      extra_args: dict[str, Any], cfg: _OwnersConfig,
                      plans: dict[tuple[bool, ...], OwnerPlan], checked: set[int],
                      bucket_plans: dict[int, Any] | None = None
                      ) -> tuple[Updates, State]:
    """One step of `on_owners`: pieces to the owners, ``tx`` on whole leaves, pieces back."""
    reducer = _reducer_of("update", extra_args)
    counter = cfg.stats or reducer.stats
    grads = _split_tree(reducer, updates)
    plan = _plan_for(reducer, grads, updates, plans, cfg)
    trees = [grads]
    if params is not None:
        local_params = _split_tree(reducer, params)
        trees.append([p if g is not None else None for g, p in zip(grads, local_params)])
    _agree_on_pieces(plan, trees, updates, checked)
    keep = plan.owned()
    inner_extra = {k: v for k, v in extra_args.items() if k != REDUCER_KEY}
    inner_extra[TOTALS_KEY] = _totals(plan, counter, extra_args.get(TOTALS_KEY))
    if cfg.bucketed and plan.routes():          # buckets: gathers, computes, returns overlapped
        from .owners_overlap import overlapped_update
        bplan = _bucket_plan_for(cfg, plan, reducer, grads, state, bucket_plans)
        mine, new_state = overlapped_update(cfg.tx, bplan, plan, trees, state, inner_extra,
                                            counter, cfg.communication_dtype)
        flat = reducer.treespec.flatten_up_to(updates)
        return reducer.treespec.unflatten(
            [m if m is not None else x for m, x in zip(mine, flat)]), new_state
    whole = gather_to_owners(plan, trees, counter)
    segments_reducer = _segments_reducer(reducer, plan, counter)
    if segments_reducer is not None:            # rows of split leaves: reduced over the owners
        inner_extra[REDUCER_KEY] = segments_reducer
    out, new_state = cfg.tx.update(_masked(reducer, whole[0], keep), state,
                                   _masked(reducer, whole[1], keep) if params is not None
                                   else None, **inner_extra)
    computed = reducer.treespec.flatten_up_to(out)
    whole_updates = [x if k else None for x, k in zip(computed, keep)]
    mine = scatter_from_owners(plan, whole_updates, grads, counter, cfg.communication_dtype)
    flat = reducer.treespec.flatten_up_to(updates)
    return reducer.treespec.unflatten(
        [m if m is not None else x for m, x in zip(mine, flat)]), new_state
