"""The chunk layout of `opttx.distributed.zero` (`zero_plan`): parameters packed, in tree
order, into flat chunks of one (device, dtype), each chunk one equal segment per rank holding
that rank's owned parameters; and `state_costs`, the optimizer-state bytes per leaf that the
owners are balanced by. `opttx.distributed.offload` packs its chunks with the same plan (one
rank), so both read this module and neither imports the other's for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .._checks import check_floating, check_nonnegative, check_positive
from ..base import GradientTransformation, Params
from ..tree import MaskedNode, tree_flatten, tree_leaves, tree_paths
from .shapes import row_segment_sizes

__all__ = ["ZeroChunk", "ZeroPlan", "check_cover", "state_costs", "zero_plan"]

_MIB = 1 << 20
_SEARCH_STEPS = 32          # candidate capacities tried by the search, besides the lower end


@dataclass(frozen=True)
class ZeroChunk:
    """One flat chunk of a `ZeroPlan`: ``world`` segments of ``segment`` elements each, in one
    dtype on one device; segment ``r`` holds the parameters owned by rank ``r``, back to back
    in tree order, then zero padding up to the segment's end.

    ``leaves``, ``owners``, ``offsets`` (element offset in the chunk) and ``sizes`` (elements)
    describe the packed parameters in layout order (by offset)."""

    dtype: torch.dtype
    device: torch.device
    world: int
    segment: int
    capacity: int                 # the segment size the packing allowed (>= segment)
    leaves: tuple[int, ...]
    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the whole chunk (all segments)."""
        return self.world * self.segment

    @property
    def padding(self) -> int:
        """Elements of the chunk holding no parameter."""
        return self.numel - sum(self.sizes)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def members(self, rank: int) -> list[tuple[int, int, int]]:
        """``(leaf, offset in the segment, size)`` of the parameters rank ``rank`` owns here."""
        base = rank * self.segment
        return [(i, o - base, n) for i, r, o, n in
                zip(self.leaves, self.owners, self.offsets, self.sizes) if r == rank]


@dataclass(frozen=True)
class ZeroPlan:
    """Where every parameter lives under `zero`: its chunk, its owner rank and its place.

    Attributes:
      world: the number of ranks planned for.
      chunk_bytes: the chunk capacity in bytes (searched or given); a chunk that holds a
        parameter larger than its segment share is grown to hold it, and every chunk is trimmed
        to its fullest segment.
      chunks: the chunks, grouped by (device, dtype) in order of first appearance, each in
        packing order.
      owners: the owner rank of every leaf (tree-flattening order); of every *unit* when
        ``units`` is not empty.
      chunk_of: the index in ``chunks`` of every leaf's (unit's) chunk.
      paths, shapes: of every leaf (unit), for messages and checks.
      owned_bytes: the bytes of parameters owned by each rank.
      padding_bytes: bytes of all chunks that hold no parameter (each costs communication).
      searched: whether ``chunk_bytes`` came from the search, and ``candidates`` the
        ``(chunk_bytes, padding_bytes, number of chunks)`` of every size tried.
      units: with ``split_above_mb``, what is packed instead of the leaves: ``(leaf, start,
        stop)`` for the rows ``start:stop`` (dim 0) of a split leaf, row segment ``r`` owned
        by rank ``r``, and ``(leaf, -1, -1)`` for a whole leaf; empty when nothing is split
        (the units are the leaves).
    """

    world: int
    chunk_bytes: int
    chunks: tuple[ZeroChunk, ...]
    owners: tuple[int, ...]
    chunk_of: tuple[int, ...]
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    owned_bytes: tuple[int, ...]
    padding_bytes: int
    searched: bool = False
    candidates: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    units: tuple[tuple[int, int, int], ...] = ()

    @property
    def split_leaves(self) -> tuple[int, ...]:
        """The leaves split into row segments over the ranks."""
        return tuple(sorted({leaf for leaf, start, _ in self.units if start >= 0}))

    def owned(self, rank: int) -> tuple[int, ...]:
        """The leaves (flattening indices) that rank ``rank`` owns."""
        return tuple(i for i, r in enumerate(self.owners) if r == rank)

    def summary(self) -> str:
        """A table of the chunks: dtype, elements, padding and the parameters of each rank."""
        lines = [(f"ZeroPlan: {len(self.chunks)} chunks of up to {self.chunk_bytes} bytes "
                  f"over {self.world} ranks; owned bytes {list(self.owned_bytes)}; padding "
                  f"{self.padding_bytes} bytes")]
        for k, c in enumerate(self.chunks):
            lines.append(f"  chunk {k}: {c.dtype}, {c.world} x {c.segment} elements, "
                         f"padding {c.padding}")
            for r in range(self.world):
                names = [self.paths[i] for i, _, _ in c.members(r)]
                lines.append(f"    rank {r}: {', '.join(names) or '-'}")
        return "\n".join(lines)


def _kind(x: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    return (x.device, x.dtype)


def _pack(numels: list[int], kinds: list[tuple[torch.device, torch.dtype]], world: int,
          chunk_bytes: int, costs: Sequence[float] | None = None,
          fixed: Sequence[int | None] | None = None
          ) -> tuple[list[ZeroChunk], list[int], list[int], list[int]]:
    """Greedy packing at one capacity. Leaves of each (device, dtype) are taken in tree order;
    each goes, in the current chunk, to the least loaded rank (fewest owned bytes, then fewest
    leaves, then lowest rank) among those whose segment has room for it (the chunk grown to a
    leaf larger than its segments) and whose owned bytes stay within the largest parameter's
    bytes of the least loaded rank's; when there is none, the chunk is closed and the leaf
    starts a new one on the least loaded rank. So owned bytes never differ by more than the
    largest parameter, a chunk closes only when no rank can take the next leaf, and the first
    ``world`` leaves go to distinct ranks. With ``costs`` (per leaf, e.g. its optimizer-state
    bytes) the loads and the bound are in those units instead of parameter bytes; segments
    still hold the parameters, so an uneven split of parameter bytes shows as padding. With
    ``fixed`` (an owner per leaf, decided elsewhere; None: chosen here) each such leaf goes to
    its given owner, in the current chunk while that owner's segment has room for it.
    Returns the chunks, owners, chunk of each leaf and the parameter bytes each rank owns."""
    loads, counts = [0.0] * world, [0] * world
    owned = [0] * world
    owners = [-1] * len(numels)
    chunk_of = [-1] * len(numels)
    chunks: list[ZeroChunk] = []
    order: dict[tuple, list[int]] = {}
    for i, k in enumerate(kinds):
        order.setdefault(k, []).append(i)
    weights = [float(c) for c in costs] if costs is not None else \
        [float(n * torch.empty((), dtype=k[1]).element_size()) for n, k in zip(numels, kinds)]
    largest = max(weights, default=0.0)
    for (device, dtype), indices in order.items():
        esize = torch.empty((), dtype=dtype).element_size()
        base = max(1, chunk_bytes // (esize * world))   # a segment's share of the capacity
        members: list[tuple[int, int, int]] = []          # (leaf, rank, offset in segment)
        used, cap = [0] * world, 0
        for i in indices:
            n = numels[i]
            # ranks this leaf may go to in the current chunk: room in their segment (the chunk
            # grown to hold it if it is larger), and owned bytes staying within the largest
            # parameter of the least loaded rank
            grown = max(cap, n)
            floor = min(loads)
            fits = [q for q in range(world) if used[q] + n <= grown
                    and (loads[q] + weights[i] <= floor + largest
                         if fixed is None or fixed[i] is None else q == fixed[i])
                    ] if members else []
            if fits:
                cap = grown
            else:
                _close_chunk(chunks, chunk_of, members, used, cap, device, dtype, numels)
                members, used, cap = [], [0] * world, max(base, n)
                fits = (list(range(world)) if fixed is None or fixed[i] is None
                        else [fixed[i]])
            r = min(fits, key=lambda q: (loads[q], counts[q], q))
            members.append((i, r, used[r]))
            used[r] += n
            loads[r] += weights[i]
            owned[r] += n * esize
            counts[r] += 1
            owners[i] = r
        _close_chunk(chunks, chunk_of, members, used, cap, device, dtype, numels)
    return chunks, owners, chunk_of, owned


def _close_chunk(chunks: list[ZeroChunk], chunk_of: list[int],
                 members: list[tuple[int, int, int]], used: list[int], cap: int,
                 device: torch.device, dtype: torch.dtype, numels: list[int]) -> None:
    """Append the chunk of ``members`` (leaf, rank, offset in the rank's segment), trimmed to
    its fullest segment, to ``chunks``."""
    if not members:
        return
    seg = max(used)
    laid = sorted(members, key=lambda m: (m[1], m[2]))
    for leaf, _, _ in laid:
        chunk_of[leaf] = len(chunks)
    chunks.append(ZeroChunk(
        dtype=dtype, device=device, world=len(used), segment=seg, capacity=cap,
        leaves=tuple(m[0] for m in laid), owners=tuple(m[1] for m in laid),
        offsets=tuple(m[1] * seg + m[2] for m in laid),
        sizes=tuple(numels[m[0]] for m in laid)))


def _padding_bytes(chunks: list[ZeroChunk]) -> int:
    return sum(c.padding * c.element_size for c in chunks)


def state_costs(tx: GradientTransformation, params: Params) -> list[float] | None:
    """The optimizer-state bytes ``tx.init`` allocates for each leaf of ``params`` alone (in
    flattening order), measured on meta tensors (nothing allocated), less what it allocates
    for no leaf at all (counters, lookup tables shared by the leaves). None when ``tx`` cannot
    be initialised on meta tensors: `zero` then balances parameter bytes."""
    leaves, treespec = tree_flatten(params)
    meta = [torch.empty(x.shape, dtype=x.dtype, device="meta") for x in leaves]

    def state_bytes(keep: int | None) -> int:
        tree = treespec.unflatten([m if i == keep else MaskedNode() for i, m in enumerate(meta)])
        return sum(x.numel() * x.element_size() for x in tree_leaves(tx.init(tree))
                   if isinstance(x, torch.Tensor))
    try:
        base = state_bytes(None)
        return [float(max(0, state_bytes(i) - base)) for i in range(len(leaves))]
    except Exception:  # noqa: BLE001 - a transform that needs real data at init
        return None


def zero_plan(params: Params, world: int, chunk_size_mb: float | None = None, *,
              min_chunk_size_mb: float = 32.0, search_range_mb: float = 32.0,
              costs: Sequence[float] | None = None,
              owners: Sequence[int] | None = None,
              split_above_mb: float | None = None,
              split_block_rows: int | None = None) -> ZeroPlan:
    r"""The chunk layout `zero` uses for ``params`` over ``world`` ranks (no process group
    needed; only the shapes and dtypes of ``params`` are read, so meta tensors do).

    Leaves of one (device, dtype) are packed in tree-flattening order. A chunk of capacity
    :math:`C` bytes gives every rank a segment of :math:`\lfloor C / (e \cdot W) \rfloor`
    elements (:math:`e` the element size, :math:`W` the world), grown to hold a parameter
    larger than that. Each leaf goes to the least loaded rank (fewest owned bytes) among those
    whose segment in the current chunk has room for it and whose owned bytes stay within the
    largest parameter :math:`P` of the least loaded rank's; when no rank qualifies, a new chunk
    starts. So the owned bytes of any two ranks differ by at most :math:`P`, and every rank owns
    a leaf when there are at least :math:`W`. Every chunk is then trimmed to its fullest
    segment, all segments of a chunk having that size, which is what
    ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` need; the padding is the rest.

    With ``chunk_size_mb=None`` the capacity is searched (as ColossalAI's Gemini does): 33
    sizes evenly spaced from ``min_chunk_size_mb`` to ``min_chunk_size_mb + search_range_mb``
    are tried and the one with the least padding kept (ties: fewer chunks, then the smaller
    size). The lower end bounds the number of chunks, and so of collectives; the upper end the
    size of the flat buffers of one collective. Because a whole parameter has one owner, the
    range is widened to at least :math:`[W P, 4 W P]` bytes: below :math:`W P` the chunks only
    grow, and padding gets small once each segment holds a few of the largest parameters.

    Args:
      params: the parameter tree (tensors).
      world: the number of ranks.
      chunk_size_mb: the chunk capacity in MiB (all segments together), or None to search.
      min_chunk_size_mb, search_range_mb: the searched range, in MiB.
      costs: per leaf (flattening order), what to balance instead of parameter bytes: `zero`
        passes each leaf's optimizer-state bytes (`state_costs`), so ranks hold equal state
        even where the state is not proportional to the parameter (Adafactor's factored
        matrices beside whole vectors, Shampoo's m² + n² per block).
      owners: per leaf, its owner rank, decided elsewhere; only the chunks are laid out here.
        `zero` inside `opttx.distributed.sharded` decides the owners on the global shapes, so
        that the ranks of a tensor-parallel group, whose local shards may differ in size, own
        the same parameters.
      split_above_mb: leaves larger than this (MiB) with at least ``world`` rows are split
        into ``world`` row segments (dim 0, as even as can be, the larger ones last), segment
        ``r`` owned by rank ``r``, so that one very large parameter (an embedding) does not put its
        whole state on one rank. None: no leaf is split.
      split_block_rows: split only at multiples of this many rows, whole blocks spread over the
        ranks (a leaf with fewer blocks than ranks is not split): what a blocked transform
        needs (Shampoo's ``max_preconditioner_dim``, `opttx.base.Traits.block_rows`).

    Returns:
      A `ZeroPlan`.

    Example:
      >>> plan = zero_plan({"w": torch.empty(1024, 1024), "b": torch.empty(1024)}, world=4,
      ...                  chunk_size_mb=8)
      >>> print(plan.summary()); plan.owners, plan.padding_bytes
    """
    check_floating(params)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be an integer >= 1, got {world!r}.")
    if chunk_size_mb is not None:
        check_positive("chunk_size_mb", chunk_size_mb)
    check_positive("min_chunk_size_mb", min_chunk_size_mb)
    check_nonnegative("search_range_mb", search_range_mb)
    leaves = tree_leaves(params)
    paths = tuple(tree_paths(params))
    if costs is not None and len(costs) != len(leaves):
        raise ValueError(f"zero_plan: {len(costs)} costs for {len(leaves)} parameters.")
    if owners is not None and (len(owners) != len(leaves)
                               or any(not 0 <= r < world for r in owners)):
        raise ValueError(f"zero_plan: owners must give a rank in [0, {world}) for each of the "
                         f"{len(leaves)} parameters, got {tuple(owners)}.")
    if split_above_mb is not None:
        check_nonnegative("split_above_mb", split_above_mb)
    units = _units_of(leaves, world, split_above_mb, split_block_rows)
    shapes = [tuple(x.shape) if a < 0 else (b - a, *x.shape[1:])
              for (i, a, b), x in ((u, leaves[u[0]]) for u in units)]
    numels = [math.prod(sh) for sh in shapes]
    kinds = [_kind(leaves[i]) for i, _, _ in units]
    unit_paths = tuple(paths[i] if a < 0 else f"{paths[i]}[{a}:{b}]" for i, a, b in units)
    split = any(a >= 0 for _, a, _ in units)
    fixed: list[int | None] | None = None
    if split or owners is not None:
        fixed = [(owners[i] if owners is not None else None) if a < 0 else r
                 for r, (i, a, b) in zip(_segment_ranks(units), units)]
    if costs is not None:            # a segment costs its share of the leaf's rows
        costs = [costs[i] if a < 0 else costs[i] * (b - a) / leaves[i].shape[0]
                 for i, a, b in units]

    if chunk_size_mb is not None:
        sizes = [max(1, int(chunk_size_mb * _MIB))]
    else:
        # a segment below the largest parameter only grows; padding gets small once segments
        # hold a few of the largest parameters
        largest = max((n * leaves[u[0]].element_size() for n, u in zip(numels, units)),
                      default=0)
        lo = max(1, int(min_chunk_size_mb * _MIB), world * largest)
        span = max(int(search_range_mb * _MIB), 3 * world * largest)
        sizes = sorted({lo + span * k // _SEARCH_STEPS for k in range(_SEARCH_STEPS + 1)})
    best, tried = None, []
    for size in sizes:
        packed = _pack(numels, kinds, world, size, costs, fixed)
        key = (_padding_bytes(packed[0]), len(packed[0]), size)
        tried.append((size, key[0], key[1]))
        if best is None or key < best[0]:
            best = (key, size, packed)
    _, size, (chunks, unit_owners, chunk_of, loads) = best
    plan = ZeroPlan(world=world, chunk_bytes=size, chunks=tuple(chunks),
                    owners=tuple(unit_owners), chunk_of=tuple(chunk_of),
                    paths=unit_paths if split else paths, shapes=tuple(shapes),
                    owned_bytes=tuple(loads), padding_bytes=_padding_bytes(chunks),
                    searched=chunk_size_mb is None, candidates=tuple(tried),
                    units=tuple(units) if split else ())
    check_cover(plan)
    return plan


def _units_of(leaves: list[torch.Tensor], world: int, split_above_mb: float | None,
              block_rows: int | None = None) -> list[tuple[int, int, int]]:
    """``(leaf, start, stop)`` row segments of the leaves to split, ``(leaf, -1, -1)`` for the
    others, in tree order (a split leaf's segments in rank order)."""
    limit = None if split_above_mb is None else split_above_mb * _MIB
    block = block_rows or 1
    units: list[tuple[int, int, int]] = []
    for i, x in enumerate(leaves):
        if (limit is None or world < 2 or x.ndim == 0 or -(-x.shape[0] // block) < world
                or x.numel() * x.element_size() <= limit):
            units.append((i, -1, -1))
            continue
        start = 0
        for rows in row_segment_sizes(x.shape[0], world, block):
            units.append((i, start, start + rows))
            start += rows
    return units


def _segment_ranks(units: list[tuple[int, int, int]]) -> list[int]:
    """For each unit, its index among the segments of its leaf (its owner rank; 0 for whole
    leaves)."""
    out, seen = [], {}
    for i, a, _ in units:
        k = seen.get(i, 0) if a >= 0 else 0
        out.append(k)
        if a >= 0:
            seen[i] = k + 1
    return out


def check_cover(plan: ZeroPlan) -> None:
    """Every parameter in exactly one chunk, inside its owner's segment: a parameter left out
    would silently never be updated."""
    seen = [0] * len(plan.owners)
    for c in plan.chunks:
        for i, r, o, n in zip(c.leaves, c.owners, c.offsets, c.sizes):
            seen[i] += 1
            if not (r * c.segment <= o and o + n <= (r + 1) * c.segment):
                raise ValueError(f"zero plan: {plan.paths[i]} lies outside the segment of its "
                                 f"owner rank {r}.")
    for i, k in enumerate(seen):
        if k == 0:
            raise ValueError(f"zero plan: parameter {plan.paths[i]} is not covered by any "
                             "chunk; it would never be updated.")
        if k > 1:
            raise ValueError(f"zero plan: parameter {plan.paths[i]} is in {k} chunks (every "
                             "parameter must be in exactly one).")
