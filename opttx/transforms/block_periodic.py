"""MuonBP's orthogonalization: each block of a matrix on its own on most steps, the whole
matrix every ``full_every`` steps (`orthogonalize_block_periodic`).

Under tensor parallelism or FSDP a matrix is cut into shards, one per rank. Orthogonalizing
each shard on its own needs no communication; orthogonalizing the matrix needs it whole.
MuonBP (Khaled et al., arXiv 2510.16981) does the first on most steps and the second on one
step in ``full_every``, each with its own step size. Here the blocks are declared (a grid
of row and column blocks per matrix, ``blocks``), so one device runs the same algorithm as
the sharded run whose shards are those blocks; under `opttx.distributed.sharded` (or `zero`
with ``split_above_mb``) the block step runs on each rank's shard with no collective, and the
full step brings each sharded matrix whole through the reduction hook (one all-reduce of the
zero-padded shards per process group, the sum of disjoint pieces: exact), so both equal one
device.

The Newton–Schulz iterations, their coefficients and the shape factors are those of
`opttx.orthogonalize` and `opttx.scale_by_shape`; the alias `opttx.muon_bp` composes this
transform with momentum, weight decay and the learning rate, as `opttx.muon` does.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._checks import check_nonnegative, check_positive, check_positive_int
from .._tracing import is_tracing
from ..base import (REDUCER_KEY, GradientTransformation, Params, Role, Traits,
                    check_init_params, current_reducer, declare, declare_roles,
                    reduce_statistics, zero_count)
from ..kernels import mark_scratch
from ..skeleton import as_tree, leafwise
from ..tree import (PyTree, Static, flatten_matching, leaf_labels, tree_cond, tree_flatten,
                    tree_paths, tree_unflatten)
from .matrix_axes import (MatrixAxes, check_axes_argument, from_last_two, in_layout_of,
                          leaf_matrix_axes, to_last_two)
from .orthogonalize import (NS_COEFFS, POLAR_EXPRESS_COEFFS, POLAR_EXPRESS_SAFETY, Coefficients,
                            Method, ShapeConvention, coefficient_steps, orthogonalizer,
                            shape_factor)

__all__ = ["BlockGrid", "OrthogonalizeBlockPeriodicState", "block_sizes",
           "orthogonalize_block_periodic"]

_NAME = "orthogonalize_block_periodic"

BlockGrid = Any
"""The blocks of one leaf's matrices: None (each rank's shard is one block: the whole matrix on
one device), an int ``r`` (``r`` row blocks), or a pair ``(rows, cols)`` whose entries are a
number of blocks along that axis or a tuple of their sizes; or a tree like the params (or a
function of them) holding one of those per leaf."""


class OrthogonalizeBlockPeriodicState(NamedTuple):
    """State of `orthogonalize_block_periodic`."""
    count: torch.Tensor   # shape (), int32: steps taken (step t is a full step when
    #                       t % full_every == 0, t counted from 0)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT)


# ---------------------------------------------------------------------------------------------
# the static layout: blocks per leaf, and where this rank's shard lies in them
# ---------------------------------------------------------------------------------------------


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_axis_blocks(x: Any) -> bool:
    """A number of blocks, or the block sizes, along one axis."""
    return _is_count(x) or (isinstance(x, tuple) and len(x) > 0 and all(map(_is_count, x)))


def _is_grid(x: Any) -> bool:
    """The blocks of one leaf (see `BlockGrid`)."""
    return x is None or _is_count(x) or (isinstance(x, tuple) and len(x) == 2
                                         and all(map(_is_axis_blocks, x)))


def _check_grid(grid: Any, where: str) -> None:
    if grid is None:
        return
    pair = (grid, 1) if _is_count(grid) else grid
    for along in pair:
        if _is_count(along) and along < 1:
            raise ValueError(f"{where}: a number of blocks must be >= 1, got {grid!r}.")
        if isinstance(along, tuple) and any(s < 1 for s in along):
            raise ValueError(f"{where}: block sizes must be positive, got {grid!r}.")


def _check_blocks_argument(blocks: Any) -> None:
    """At construction: a bool, or a grid with a count below 1 or a size below 1, raises (a
    tree or a function of the params is checked per leaf at init and update)."""
    if isinstance(blocks, bool):
        raise ValueError(f"{_NAME}: blocks must be None, a number of row blocks, a pair "
                         f"(rows, cols) or a tree of those, got {blocks!r}.")
    if _is_grid(blocks):
        _check_grid(blocks, _NAME)


def block_sizes(blocks: int | tuple[int, ...], size: int) -> tuple[int, ...]:
    """The sizes of the blocks along an axis of ``size``: a number ``k`` of blocks splits it as
    ``torch.tensor_split`` (and `opttx.distributed.local_shard`) do, sizes differing by at most
    one, the larger first (so ``k`` blocks are the shards of ``k`` ranks); a tuple gives the
    sizes, which must add up to ``size``."""
    if isinstance(blocks, int):
        q, r = divmod(size, blocks)
        return (q + 1,) * r + (q,) * (blocks - r)
    if sum(blocks) != size:
        raise ValueError(f"block sizes {blocks} add up to {sum(blocks)}, not {size}.")
    return tuple(blocks)


def _leaf_grids(tree: PyTree, blocks: Any, axes: list) -> list[Any]:
    """Per leaf: None (each shard one block), or the global (row sizes, col sizes)."""
    leaves = tree_flatten(tree)[0]
    per_leaf = not _is_grid(blocks)
    values = (leaf_labels(blocks, tree, "blocks", is_leaf=_is_grid) if per_leaf
              else [blocks] * len(leaves))
    return [_grid_of(v, ax, path) for v, ax, path in zip(values, axes, tree_paths(tree))]


def _grid_of(value: Any, ax: Any, path: str) -> Any:
    where = f"{_NAME}, updates{path}"
    if ax is None or value is None:
        return None
    if not _is_grid(value):
        raise ValueError(f"{where}: blocks is {value!r}; give None, a number of row blocks or "
                         "a pair (rows, cols) of numbers of blocks or block sizes.")
    _check_grid(value, where)
    return (value, 1) if _is_count(value) else value


def _sizes(grid_axis: Any, size: int, where: str) -> tuple[int, ...]:
    try:
        return block_sizes(grid_axis, size)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# this rank's first index along each sharded dim of each leaf, per reducer and tree structure
# (one all_gather of the local sizes at init: `ShardedReducer.local_offsets`)
_OFFSETS: weakref.WeakKeyDictionary[Any, dict[str, list[dict[int, int]]]] = \
    weakref.WeakKeyDictionary()


def _offsets(reducer: Any, tree: PyTree) -> list[dict[int, int]]:
    """Per leaf of ``tree``, this rank's first index along each sharded dim (empty: the leaf is
    whole here). From a cache filled at ``init``; computed (a collective, on every rank alike)
    when a restored state's first update finds none."""
    n = len(tree_flatten(tree)[0])
    find = getattr(reducer, "local_offsets", None)
    if find is None:
        return [{} for _ in range(n)]
    key = repr(flatten_matching(tree)[0])
    per_tree = _OFFSETS.setdefault(reducer, {})
    if key not in per_tree:
        per_tree[key] = find(tree)
    return per_tree[key]


class _Plan(NamedTuple):
    """The static layout of one matrix leaf on this rank."""
    axes: tuple[int, int]
    local_rows: tuple[int, ...]     # this rank's blocks along the rows
    local_cols: tuple[int, ...]     # and along the columns
    whole: tuple[int, int]          # the matrix's global (rows, cols)
    gathered: dict[int, int]        # sharded matrix axes of this leaf: dim -> this rank's offset


def _local_blocks(global_sizes: tuple[int, ...], offset: int, local: int, where: str
                  ) -> tuple[int, ...]:
    """The blocks of ``global_sizes`` that a shard of ``local`` elements at ``offset`` holds
    whole; a shard that cuts a block raises."""
    if local == 0:
        return (0,)
    edges = [0]
    for s in global_sizes:
        edges.append(edges[-1] + s)
    if offset not in edges or offset + local not in edges:
        raise ValueError(
            f"{where}: this rank's shard holds indices {offset}..{offset + local - 1} of an axis "
            f"whose blocks are {global_sizes}, so it cuts a block; the block step needs each "
            "block on one rank. Give blocks that the shards hold whole (the shards themselves: "
            "as many blocks as ranks along the sharded axis, or blocks=None).")
    return tuple(global_sizes[edges.index(offset):edges.index(offset + local)])


def _plans(leaves: list[torch.Tensor], tree: PyTree, axes: list, grids: list,
           shapes: list[tuple[int, ...]], offsets: list[dict[int, int]]) -> list[Any]:
    plans: list[Any] = []
    for x, ax, grid, shape, off, path in zip(leaves, axes, grids, shapes, offsets,
                                              tree_paths(tree)):
        if ax is None or math.prod(shape) == 0:    # (decided on the whole shape: every rank
            plans.append(None)                       # alike, an empty shard included)
            continue
        where = f"{_NAME}, updates{path}"
        r, c = ax
        gathered = {d: o for d, o in off.items() if d in ax}
        whole = (shape[r], shape[c])
        if grid is None:               # each shard (the whole matrix on one device) one block
            rows, cols = (x.shape[r],), (x.shape[c],)
        else:
            rows = _sizes(grid[0], whole[0], where)
            cols = _sizes(grid[1], whole[1], where)
            if r in gathered:
                rows = _local_blocks(rows, gathered[r], x.shape[r], where)
            if c in gathered:
                cols = _local_blocks(cols, gathered[c], x.shape[c], where)
        plans.append(_Plan(ax, rows, cols, whole, gathered))
    return plans


# ---------------------------------------------------------------------------------------------
# the transform
# ---------------------------------------------------------------------------------------------




@declare(hyperparams={"eps": None, "consistent_rms": None, "block_scale": None},
         runtime=("ns_steps", "ns_coeffs"))
def orthogonalize_block_periodic(full_every: int | None = 5, blocks: BlockGrid = None,
                                 consistent_rms: float | None = 0.2,
                                 block_scale: float = 1.0, ns_steps: int = 5,
                                 ns_coeffs: Coefficients = NS_COEFFS, eps: float = 1e-7,
                                 method: Method = "newton_schulz",
                                 matrix_axes: MatrixAxes = (-2, -1), *,
                                 ns_dtype: torch.dtype | None = None,
                                 norm_scale: float | None = None,
                                 gram_restarts: Sequence[int] = (2,),
                                 convention: ShapeConvention = "muon"
                                 ) -> GradientTransformation:
    r"""MuonBP's direction: orthogonalize each block of every matrix on its own, and the
    whole matrix every ``full_every`` steps, each scaled by the shape of what it
    orthogonalized.

    At step :math:`t` (counted from 0), for a matrix :math:`G` (:math:`m \times n`) cut into
    blocks :math:`G_{ij}` (:math:`m_i \times n_j`):

    .. math::
        t \bmod P = 0:\quad U = s(m, n)\, \mathrm{Orth}(G), \qquad
        \text{else:}\quad U_{ij} = \rho\, s(m_i, n_j)\, \mathrm{Orth}(G_{ij})

    with :math:`P` = ``full_every``, :math:`\mathrm{Orth}` the iteration of
    `opttx.orthogonalize` (``method``, ``ns_steps``, ``ns_coeffs``, ``eps``, ...), :math:`s`
    the factor of `opttx.scale_by_shape` (`shape_factor` with ``consistent_rms`` and
    ``convention``) and :math:`\rho` = ``block_scale``. Step 0 is a full step (the paper's
    :math:`t \bmod P = 0`); ``full_every=1`` is Muon's direction (every step full),
    ``full_every=None`` never takes a full step (block-wise Muon, the paper's
    :math:`P = \infty`).

    **Step sizes.** MuonBP takes the two kinds of step with two step sizes, :math:`\eta_{full}`
    and :math:`\eta_{block}`, each on the update scaled to match AdamW's RMS by the square root
    of the dimensions of the matrix it orthogonalized: the whole matrix's on a full step, the
    block's on a block step (the paper's RMS matching; Moonlight's :math:`0.2\sqrt{\max(m,
    n)}`, the default ``consistent_rms=0.2`` here). That is :math:`s(m, n)` and
    :math:`s(m_i, n_j)` above; the learning rate after this transform is :math:`\eta_{full}`
    and ``block_scale`` is :math:`\eta_{block} / \eta_{full}` (1: one learning rate, the
    shape factors alone set the ratio). `opttx.muon_bp` takes ``block_learning_rate``.

    **Blocks.** ``blocks`` gives each leaf's grid (`BlockGrid`): an int ``r`` is ``r`` row
    blocks, a pair ``(rows, cols)`` a grid, each entry a number of blocks (sizes as
    ``torch.tensor_split`` cuts the axis, the larger first: the shards of that many ranks as
    `opttx.distributed.local_shard` cuts them; FSDP2's uneven ``torch.chunk`` shards may
    differ, give their sizes or None) or a tuple of sizes; None: each
    rank's shard is one block (on one device, the whole matrix: every step full). A grid may
    be finer than the shards (several blocks per rank) but no block may straddle two ranks.
    Leaves of more than two dims are batches of matrices over ``matrix_axes``, each cut alike.

    **Sharded.** Under `opttx.distributed.sharded` (a TP or FSDP ``Shard`` over a matrix
    axis, on one dim or on both) and under `opttx.distributed.zero` with ``split_above_mb``
    (row segments), the block step orthogonalizes the blocks of each rank's shard where they
    are: no collective. The full step places each rank's shard at its offset in a zero matrix
    of the whole shape and sums these over the groups that shard the matrix axes (the
    reduction hook: one batched all-reduce per group, a sum of disjoint pieces, so exact),
    orthogonalizes the whole matrix on every rank and keeps the rank's own part: every rank
    gets its piece of the single-device result (the same iteration on the same matrix, bit
    for bit where the batched products are). A leaf sharded over a batch axis only (experts)
    is whole on its rank and needs nothing. The offsets of the shards are found once, at
    ``init`` (one ``all_gather`` of the local sizes per group, as `opttx.scale_by_dion`).

    **One graph.** The choice between the two steps is a `opttx.tree.tree_cond` on the step
    counter: in eager mode only the chosen step runs (its collectives only on full steps); in
    a compiled step it is one ``torch.cond`` holding both, so nothing recompiles when the
    step kind changes, and the full step's all-reduce runs only on full steps.

    Args:
      full_every: :math:`P`, a full step every this many steps (>= 1), or None for never.
      blocks: the blocks of each leaf (above).
      consistent_rms: :math:`\gamma` of `scale_by_shape` (:math:`\gamma\sqrt{\max(m, n)}`);
        None for :math:`\sqrt{\max(1, m/n)}` (``convention="muon"``) or :math:`\sqrt{m/n}`
        (``"spectral"``).
      block_scale: :math:`\rho = \eta_{block}/\eta_{full}`, on block steps.
      ns_steps, ns_coeffs, eps, method, ns_dtype, norm_scale, gram_restarts: the iteration,
        as in `opttx.orthogonalize`.
      matrix_axes: the (row, column) axes of the matrices, as in `opttx.orthogonalize`.
      convention: the shape factor without ``consistent_rms``, as in `scale_by_shape`.

    Returns:
      A `GradientTransformation` whose state is `OrthogonalizeBlockPeriodicState` (a step
      counter).

    Example:
      >>> tx = opttx.chain(opttx.ema(0.95, debias=False, nesterov=True),
      ...                  opttx.orthogonalize_block_periodic(full_every=5, blocks=(8, 1)),
      ...                  opttx.scale_by_learning_rate(0.02))
      >>> tp = opttx.distributed.sharded(        # the blocks: each rank's shard
      ...     opttx.orthogonalize_block_periodic(), {"w_in": Shard(0), "w_out": Shard(1)})

    References:
      Khaled, Ozkara, Yu, Hong and Park, MuonBP: Faster Muon via Block-Periodic
      Orthogonalization (arXiv 2510.16981); Jordan et al., Muon (2024); Liu et al., Muon is
      Scalable for LLM Training (arXiv 2502.16982) for the RMS matching.
    """
    if full_every is not None:
        check_positive_int("full_every", full_every)
    _check_blocks_argument(blocks)
    if method not in ("newton_schulz", "polar_express", "gram_newton_schulz", "svd"):
        raise ValueError(f"method must be 'newton_schulz', 'polar_express', "
                         f"'gram_newton_schulz' or 'svd', got {method!r}.")
    if method == "polar_express":
        if ns_coeffs not in (NS_COEFFS, POLAR_EXPRESS_COEFFS) or ns_steps != 5:
            raise ValueError("method='polar_express' runs its 5 POLAR_EXPRESS_COEFFS; for "
                             "other coefficients use method='newton_schulz'.")
        steps = POLAR_EXPRESS_COEFFS
        scale = POLAR_EXPRESS_SAFETY if norm_scale is None else norm_scale
    else:
        steps = coefficient_steps(ns_coeffs, ns_steps)
        scale = 1.0 if norm_scale is None else norm_scale
    check_nonnegative("eps", eps)
    check_positive("norm_scale", scale)
    check_nonnegative("block_scale", block_scale)
    if consistent_rms is not None:
        check_nonnegative("consistent_rms", consistent_rms)
    if convention not in ("muon", "spectral"):
        raise ValueError(f"convention must be 'muon' or 'spectral', got {convention!r}.")
    restarts = tuple(gram_restarts)
    if not all(_is_count(r) and r >= 0 for r in restarts):
        raise ValueError(f"gram_restarts must be step indices >= 0, got {gram_restarts!r}.")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype)
                                     and ns_dtype.is_floating_point):
        raise ValueError(f"ns_dtype must be a floating-point torch.dtype or None, got "
                         f"{ns_dtype!r}.")
    check_axes_argument(matrix_axes, _NAME)
    run = orthogonalizer(method, steps, eps, ns_dtype, scale, restarts)
    static_rms = consistent_rms is None or isinstance(consistent_rms, (int, float))

    def factor(rows: int, cols: int, block: bool) -> Any:
        """The scale of an orthogonalized (rows x cols) matrix: one Python number (float64)
        when the hyperparameters are numbers, a 0-dim float64 tensor when injected."""
        f: Any = (shape_factor(rows, cols, consistent_rms, convention) if static_rms
                  else (math.sqrt(max(rows, cols)) if rows and cols else 1.0) * consistent_rms)
        return f * block_scale if block else f

    def orthogonalize_groups(pieces: list[torch.Tensor], block: bool) -> list[torch.Tensor]:
        """Orthogonalize and scale 3-D batches of matrices: one batched iteration per shape,
        dtype and device, whatever leaf or block they come from."""
        groups: dict[tuple, list[int]] = {}
        for k, p in enumerate(pieces):
            if p.numel():
                groups.setdefault((tuple(p.shape[1:]), p.dtype, p.device), []).append(k)
        out = list(pieces)             # empty pieces are their own result
        for (shape, _, _), members in groups.items():
            batch = [pieces[k] for k in members]
            sizes = [b.shape[0] for b in batch]
            y = run(batch[0] if len(batch) == 1 else torch.cat(batch))
            y = y * factor(shape[0], shape[1], block)
            parts = y.split(sizes) if len(batch) > 1 else [y]
            for j, (k, part) in enumerate(zip(members, parts)):
                # a later piece of a batched result starts inside its storage; the branches
                # of a torch.cond (compiled) must agree on storage offsets: its own copy
                out[k] = (y.index_select(0, torch.arange(
                    sum(sizes[:j]), sum(sizes[:j + 1]), device=y.device))
                    if j and is_tracing() else part)
        return out

    def block_step(xs: list[torch.Tensor], plans: list[_Plan]) -> list[torch.Tensor]:
        pieces: list[torch.Tensor] = []
        where: list[tuple[int, int, torch.Size]] = []   # per leaf: first piece, number of
        for x, plan in zip(xs, plans):                  # pieces, its matrix axes' shape
            m = to_last_two(x, plan.axes)
            batch = m.reshape(math.prod(m.shape[:-2]), *m.shape[-2:])
            start = len(pieces)
            if len(plan.local_rows) == 1 and len(plan.local_cols) == 1:
                pieces.append(batch)
            else:
                for rows in batch.split(list(plan.local_rows), dim=1):
                    pieces.extend(rows.split(list(plan.local_cols), dim=2))
            where.append((start, len(pieces) - start, m.shape))
        done = orthogonalize_groups(pieces, block=True)
        out = []
        for x, plan, (start, n, m_shape) in zip(xs, plans, where):
            parts = done[start:start + n]
            if n == 1:
                y = parts[0]
            else:
                c = len(plan.local_cols)
                y = torch.cat([torch.cat(parts[i:i + c], dim=2) for i in range(0, n, c)],
                              dim=1)
            out.append(in_layout_of(from_last_two(y.reshape(m_shape), plan.axes), x))
        return out

    def full_step(xs: list[torch.Tensor], plans: list[_Plan], spec: Any, present: list[int],
                  total: int, extra_args: dict[str, Any]) -> list[torch.Tensor]:
        wholes = list(xs)
        if any(p.gathered for p in plans):
            # each rank's shard at its offset in a zero matrix of the whole shape, summed over
            # the groups that shard the matrix axes: the whole matrix on every rank (exact)
            partials: list[Any] = [torch.zeros(0)] * total
            dims: list[Any] = [()] * total
            for i, x, plan in zip(present, xs, plans):
                if not plan.gathered:
                    continue
                padded = x
                for d, off in sorted(plan.gathered.items()):
                    whole = plan.whole[plan.axes.index(d)]
                    shape = list(padded.shape)
                    before, after = list(shape), list(shape)
                    before[d], after[d] = off, whole - off - x.shape[d]
                    padded = torch.cat([padded.new_zeros(before), padded,
                                        padded.new_zeros(after)], dim=d)
                partials[i] = padded
                dims[i] = tuple(sorted(plan.gathered))
            reduced = _reduce(partials, dims, spec, extra_args)
            wholes = [reduced[i] if plan.gathered else x
                      for i, x, plan in zip(present, xs, plans)]
        pieces, m_shapes = [], []
        for w, plan in zip(wholes, plans):
            m = to_last_two(w, plan.axes)
            pieces.append(m.reshape(math.prod(m.shape[:-2]), *m.shape[-2:]))
            m_shapes.append(m.shape)
        done = orthogonalize_groups(pieces, block=False)
        out = []
        for x, y, plan, m_shape in zip(xs, done, plans, m_shapes):
            y = from_last_two(y.reshape(m_shape), plan.axes)
            for d, off in plan.gathered.items():
                # this rank's part, gathered into its own storage (not a view: the branches of
                # a compiled torch.cond must agree on storage offsets)
                y = y.index_select(d, torch.arange(off, off + x.shape[d], device=y.device))
            out.append(in_layout_of(y, x))
        return out

    def init(params: Params) -> OrthogonalizeBlockPeriodicState:
        check_init_params(params)
        axes = leaf_matrix_axes(params, matrix_axes, _NAME)
        grids = _leaf_grids(params, blocks, axes)
        reducer = current_reducer()
        known = getattr(reducer, "global_shapes_of", lambda t: None)(params)
        shapes = known or [tuple(x.shape) for x in tree_flatten(params)[0]]
        for grid, ax, shape, path in zip(grids, axes, shapes, tree_paths(params)):
            if grid is not None:       # the sizes add up to the whole matrix's sides
                for along, dim in zip(grid, ax):
                    _sizes(along, shape[dim], f"{_NAME}, params{path}")
        if reducer is not None:          # the shards' offsets: one collective, here
            _offsets(reducer, params)
        return OrthogonalizeBlockPeriodicState(count=zero_count(params))

    def step(g, state, params, extra_args):
        tree = as_tree(g, extra_args)
        spec = flatten_matching(tree)[0]
        axes = leaf_matrix_axes(tree, matrix_axes, _NAME)
        grids = _leaf_grids(tree, blocks, axes)
        reducer = extra_args.get(REDUCER_KEY)
        known = getattr(reducer, "global_shapes_of", lambda t: None)(tree)
        shapes = ([tuple(s) for s in known] if known is not None
                  else [tuple(x.shape) for x in g])
        offsets = (_offsets(reducer, tree) if reducer is not None
                   else [{} for _ in g])
        plans = _plans(g, tree, axes, grids, shapes, offsets)
        present = [i for i, p in enumerate(plans) if p is not None]
        if not present:
            return list(g), state
        xs = [g[i] for i in present]
        ps = [plans[i] for i in present]
        # both branches take and return a tree shaped like the operands, (leaves,)
        block = lambda leaves: (block_step(leaves, ps),)
        full = lambda leaves: (full_step(leaves, ps, spec, present, len(g),
                                         extra_args),)
        if full_every is None:
            ys = block(xs)[0]
        elif full_every == 1:
            ys = full(xs)[0]
        else:
            ys = tree_cond(state.count % full_every == 0, full, block, (xs,))[0]
        out = list(g)
        for i, y in zip(present, ys):
            out[i] = y
        mark_scratch(list(ys))            # fresh tensors
        return out, state

    return GradientTransformation(
        init, leafwise(OrthogonalizeBlockPeriodicState, step, name=_NAME,
                       zero_based_count=True),
        Traits(per_leaf=True, batched_across_leaves=True))


def _reduce(partials: list[Any], dims: list[Any], spec: Any, extra_args: dict[str, Any]
            ) -> list[torch.Tensor]:
    """`reduce_statistics` of per-leaf partials (a list in the order of the leaves) reduced over
    the given dims of each leaf, as a list again."""
    reduced = reduce_statistics(tree_unflatten(partials, spec), extra_args, "sum",
                                dims=tree_unflatten(dims, spec))
    return flatten_matching(reduced)[1]
