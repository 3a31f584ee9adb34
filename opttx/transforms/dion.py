"""Dion and Dion2: orthonormal updates from part of the momentum.

`scale_by_dion`: a rank-:math:`r` power iteration on the momentum, with error feedback, whose
low-rank factors are the only thing reduced across shards (through the reduction hook, rule 6:
no gather of whole matrices), so it runs on tensor-parallel shards under
`opttx.distributed.sharded` and equals one device. `scale_by_dion2`: Muon on the top
fraction of the momentum's rows (or columns), with error feedback on them.

The aliases `opttx.dion` and `opttx.dion2` chain them with `scale_by_shape`, weight decay and
the learning rate on matrices, AdamW elsewhere.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Sequence

import torch

from .._checks import check_nonnegative, check_positive_int, check_unit_interval
from ..base import (LEAF_SPEC_KEY, EmptyState, GradientTransformation, HyperRole, LEAFWISE,
                    Params,
                    REDUCER_KEY, Role, Traits, Updates, check_init_params, current_reducer,
                    declare, declare_roles, reduce_statistics, replace_state,
                    require_whole_leaves, traits_of, zero_count)
from ..skeleton import leafwise
from ..kernels import mark_scratch
from ..tree import (MaskedNode, PyTree, Static, state_dtype, tree_flatten, tree_paths,
                    tree_unflatten)
from .counter_hash import hash32
from .matrix_axes import global_matrix_shapes, sharded_matrix_dims
from .orthogonalize import NS_COEFFS, Method, ShardedMode, orthogonalize

__all__ = ["ScaleByDionState", "ScaleByDion2State", "dion_rank", "scale_by_dion",
           "scale_by_dion2"]


# ---------------------------------------------------------------------------------------------
# Dion
# ---------------------------------------------------------------------------------------------


class ScaleByDionState(NamedTuple):
    """State of `scale_by_dion`."""
    count: torch.Tensor   # shape (), int32: steps taken
    momentum: Updates     # like params: the momentum, less what the low-rank steps took
    q: Updates            # per leaf (columns of B, r): the right factor of the power
    #                       iteration, B = M or M^T (tall); rows sharded as B's columns
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, momentum=Role.FIRST_MOMENT,
                              q=Role.PROJECTION)


def dion_rank(rows: int, cols: int, rank_fraction: float, rank_multiple_of: int = 1) -> int:
    """Dion's rank :math:`r` of a ``rows`` × ``cols`` matrix: ``rank_fraction`` of the
    smaller side, rounded up to a multiple of ``rank_multiple_of``, at most the smaller
    side (the ``dion`` package's rule)."""
    r = rank_multiple_of * math.ceil(rank_fraction * min(rows, cols) / rank_multiple_of)
    return max(1, min(r, rows, cols))


def _initial_q(start: int, rows: int, r: int, seed: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Rows ``start:start + rows`` of a leaf's starting right factor: standard normal numbers
    (Box–Muller on a counter-based hash of ``seed`` and each element's index in the whole
    factor), so every rank computes its own rows of the same factor, every layout and
    `opttx.stacked` slice the same numbers, with no random generator state. Leaves whose
    factors have the same width start alike, which the power iteration does not mind."""
    i = torch.arange(start, start + rows, dtype=torch.int64, device=device).unsqueeze(-1)
    j = torch.arange(r, dtype=torch.int64, device=device)
    k = 2 * (i * r + j)
    key = int(hash32(torch.tensor(seed & 0xFFFFFFFF)))

    def uniform(n: torch.Tensor) -> torch.Tensor:
        h = hash32(hash32(n ^ key) + (n >> 32))
        return (h.double() + 0.5) / 2.0**32

    u1, u2 = uniform(k), uniform(k + 1)
    return ((-2 * u1.log()).sqrt() * torch.cos(2 * math.pi * u2)).to(dtype)


def _check_static_fraction(name: str, value: Any) -> None:
    """A fraction that decides shapes: a Python number (a `fractions.Fraction` too) in
    (0, 1]; a tensor (`opttx.inject_hyperparams`) is refused with the way out."""
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name} decides the shapes of the state, so it cannot be a tensor; "
                         f"with opttx.inject_hyperparams pass static_args=({name!r},).")
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}.")


class _Layout(NamedTuple):
    transposed: bool     # B = M^T (M wider than tall)
    rank: int
    row_dim: int         # the dim of M that is B's rows
    col_dim: int         # the dim of M that is B's columns (Q's rows)


def _layout(shape: Sequence[int], rank_fraction: float, rank_multiple_of: int) -> _Layout:
    m, n = shape
    t = m < n
    return _Layout(t, dion_rank(m, n, rank_fraction, rank_multiple_of), 1 if t else 0,
                   0 if t else 1)


@declare(hyperparams={"mu": HyperRole.MOMENTUM, "eps": HyperRole.EPS},
         runtime=("power_iters", "seed"))
def scale_by_dion(rank_fraction: float = 1.0, mu: float = 0.95, eps: float = 1e-8, *,
                  power_iters: int = 1, rank_multiple_of: int = 1, seed: int = 0,
                  momentum_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Dion's update: a rank-:math:`r` orthonormal direction from one power iteration on the
    momentum, with error feedback.

    For each matrix :math:`M` (:math:`m \times n`), with :math:`B = M` if :math:`m \ge n`
    else :math:`M^\top` (tall) and :math:`Q` its :math:`(\cdot, r)` right factor:

    .. math::
        M \leftarrow M + G, \quad P = \mathrm{orth}(B Q), \quad R = B^\top P, \quad
        M \leftarrow M - (1-\mu)\, P R^\top, \quad Q \leftarrow R / (\lVert R_{:,j}
        \rVert + \epsilon), \quad u = P Q^\top

    (transposed back where :math:`B = M^\top`; ``power_iters`` repeats :math:`P, R` with
    :math:`Q = R`), where :math:`\mathrm{orth}(P)` is the :math:`Q` factor of the QR
    decomposition of :math:`P` (positive diagonal of :math:`R`), computed by shifted Cholesky
    QR, three passes (Fukaya et al.): each pass is :math:`P \leftarrow P\, \mathrm{chol}(P^\top
    P + s I)^{-\top}` with a shift :math:`s` of a few ulps of :math:`\mathrm{tr}(P^\top P)`
    (11 :math:`(\text{rows}\, r + r(r+1))\, u\, \mathrm{tr}` on the first pass), so it stays
    finite on rank-deficient :math:`P`. A momentum that is all zero leaves :math:`P = 0` and
    :math:`Q` unchanged. :math:`r` is `dion_rank` (``rank_fraction`` of the smaller side).
    :math:`Q` starts standard normal, the same numbers for a given width :math:`r` and
    ``seed`` on every rank and layout (a counter-based hash, no generator state).

    Sharded (`opttx.distributed.sharded`, a leaf split over rows or columns): the products
    :math:`BQ`, :math:`P^\top P`, :math:`B^\top P` and the column norms of :math:`R` are local
    partial sums combined through the reduction hook (rule 6): six hook calls per step for
    one power iteration (the first also carries :math:`\sum |M|`), each one batched
    collective for all leaves, of :math:`r`-column factors only: no whole matrix moves.
    :math:`Q` is sharded as :math:`B`'s columns.

    Compared with the ``dion`` package's ``DionReference`` (same orientation, rank, error
    feedback and column normalization): its ``"rcqr"`` orthonormalization (a random sketch,
    then Cholesky QR) gives the same :math:`P` up to the signs of its columns, which cancel in
    :math:`PR^\top` and :math:`PQ^\top`; it normalizes :math:`R`'s columns in float32 also
    for float64 parameters (here: float32 for 16-bit, else the parameters' dtype).

    Args:
      rank_fraction: :math:`r / \min(m, n)`, in (0, 1].
      mu: :math:`\mu`, the error-feedback momentum, in [0, 1).
      eps: :math:`\epsilon` of the column normalization.
      power_iters: power iterations per step (>= 1).
      rank_multiple_of: round :math:`r` up to a multiple of this.
      seed: seed of the starting :math:`Q`.
      momentum_dtype: dtype of :math:`M` (default: the parameter's, float32 for 16-bit).

    Example:
      >>> tx = opttx.chain(opttx.scale_by_dion(0.25), opttx.scale_by_shape(
      ...     convention="spectral"), opttx.scale_by_learning_rate(0.01))

    References:
      Ahn et al., Dion: Distributed Orthonormalized Updates (arXiv 2504.05295); Fukaya et
      al., Shifted Cholesky QR for computing the QR factorization of ill-conditioned matrices
      (SIAM J. Sci. Comput. 2020); Microsoft's ``dion`` package, ``dion_reference.py``.
    """
    _check_static_fraction("rank_fraction", rank_fraction)
    rank_fraction = float(rank_fraction)
    check_unit_interval("mu", mu)
    check_nonnegative("eps", eps)
    check_positive_int("power_iters", power_iters)
    check_positive_int("rank_multiple_of", rank_multiple_of)

    def init(params: Params) -> ScaleByDionState:
        check_init_params(params)
        _check_matrices(params)
        reducer = current_reducer()
        leaves, spec = tree_flatten(params)
        shapes = _shapes_of(params, reducer)
        offsets = (reducer.local_offsets(params) if reducer is not None
                   and hasattr(reducer, "local_offsets") else [{}] * len(leaves))
        qs = []
        for x, shape, off in zip(leaves, shapes, offsets):
            lay = _layout(shape, rank_fraction, rank_multiple_of)
            dtype = state_dtype(x, momentum_dtype)
            qs.append(_initial_q(off.get(lay.col_dim, 0), x.shape[lay.col_dim], lay.rank, seed,
                                 dtype, x.device))
        momentum = [torch.zeros_like(x, dtype=state_dtype(x, momentum_dtype)) for x in leaves]
        return ScaleByDionState(count=zero_count(params), momentum=tree_unflatten(momentum, spec),
                                q=tree_unflatten(qs, spec))

    def step(g, state, params, extra_args):
        return _dion_step(g, state, extra_args, rank_fraction=rank_fraction,
                          rank_multiple_of=rank_multiple_of, power_iters=power_iters, mu=mu,
                          eps=eps)

    inner = leafwise(ScaleByDionState, step)

    def update(updates: Updates, state: ScaleByDionState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ScaleByDionState]:
        return inner(updates, state, params, **extra_args, _dion_spec=tree_flatten(updates)[1])

    return GradientTransformation(init, update, LEAFWISE)


def _shapes_of(tree: PyTree, reducer: Any) -> list[tuple[int, ...]]:
    """The whole shapes of the leaves of ``tree`` (local shapes without a sharded reducer)."""
    leaves = tree_flatten(tree)[0]
    known = reducer.global_shapes_of(tree) if reducer is not None and hasattr(
        reducer, "global_shapes_of") else None
    return [tuple(s) for s in known] if known is not None else [tuple(x.shape)
                                                                for x in leaves]


def _check_matrices(tree: PyTree) -> None:
    """Refuse a leaf that is not a 2-D matrix, naming it."""
    for x, path in zip(tree_flatten(tree)[0], tree_paths(tree)):
        if x.dim() != 2:
            raise ValueError(f"scale_by_dion: params{path} has {x.dim()} dim(s); Dion "
                             "works on 2-D matrices. Route other leaves elsewhere "
                             "(opttx.dion sends them to AdamW).")


def _dion_step(g: list[torch.Tensor], state: ScaleByDionState, extra_args: dict[str, Any], *,
               rank_fraction: float, rank_multiple_of: int, power_iters: int, mu: Any,
               eps: float) -> tuple[list[torch.Tensor], ScaleByDionState]:
    """One step of `scale_by_dion` on the flat leaves ``g`` (its ``leafwise`` step): the power
    iteration with its reductions through the hook, error feedback, the new right factor."""
    spec = extra_args["_dion_spec"]
    updates = tree_unflatten(g, spec)
    _check_matrices(updates)
    shapes = _shapes_of(updates, extra_args.get(REDUCER_KEY))
    lays = [_layout(s, rank_fraction, rank_multiple_of) for s in shapes]
    qs = tree_flatten(state.q)[0]
    n = len(g)

    def reduce(trees: list[list], dims: list[list]) -> list[list]:
        out = reduce_statistics(tuple(tree_unflatten(t, spec) for t in trees), extra_args,
                                dims=tuple(tree_unflatten(d, spec) for d in dims))
        return [tree_flatten(t)[0] for t in out]

    M = [m + u.to(m.dtype) for m, u in zip(state.momentum, g)]
    B = [m.mT if lay.transposed else m for m, lay in zip(M, lays)]
    work = [torch.float64 if m.dtype == torch.float64 else torch.float32 for m in M]
    rows = [(lay.row_dim,) for lay in lays]
    cols = [(lay.col_dim,) for lay in lays]
    rows_of_b = [s[lay.row_dim] for s, lay in zip(shapes, lays)]
    Q0 = [q.to(m.dtype) for q, m in zip(qs, M)]
    Q = Q0
    for it in range(power_iters):
        if it == 0:     # (a) B Q, with sum |M| (is M all zero?): one hook call
            P, absum = reduce([[b @ q for b, q in zip(B, Q)], [m.abs().sum() for m in M]],
                              [cols, [None] * n])
        else:
            P = reduce([[b @ q for b, q in zip(B, Q)]], [cols])[0]
        P = [p.to(w) for p, w in zip(P, work)]
        for k in range(3):       # shifted Cholesky QR, three passes
            grams = reduce([[p.mT @ p for p in P]], [rows])[0]
            P = [_cholesky_pass(p, gram, k == 0, mb) for p, gram, mb in
                 zip(P, grams, rows_of_b)]
        P = [p.to(m.dtype) for p, m in zip(P, M)]
        Q = reduce([[b.mT @ p for b, p in zip(B, P)]], [rows])[0]
    R = Q
    # an all-zero M (whose Cholesky passes divide by zero) gives P = 0 and keeps Q; a
    # non-finite M is not zero and its NaN reaches the update (the dion package's
    # fix_all_zero_or_nan also zeroes NaN factors, which hides a NaN gradient for good)
    zero = [s == 0 for s in absum]
    P = [torch.where(z, 0.0, p) for p, z in zip(P, zero)]
    R = [torch.where(z, q, r) for r, q, z in zip(R, Q0, zero)]
    # error feedback, in M's orientation
    M = [m - (1 - mu) * ((r @ p.mT) if lay.transposed else (p @ r.mT))
         for m, p, r, lay in zip(M, P, R, lays)]
    # column-normalized R: the new Q (sums of squares over B's columns: one hook call)
    Rw = [r.to(w) for r, w in zip(R, work)]
    sq = reduce([[(r * r).sum(dim=0) for r in Rw]], [cols])[0]
    Qn = [(r / (s.sqrt() + eps)).to(m.dtype) for r, s, m in zip(Rw, sq, M)]
    out = [((q @ p.mT) if lay.transposed else (p @ q.mT)).to(u.dtype)
           for p, q, lay, u in zip(P, Qn, lays, g)]
    mark_scratch(out)
    new_q = [q.to(old.dtype) for q, old in zip(Qn, qs)]
    return out, replace_state(state, momentum=M,
                              q=tree_unflatten(new_q, tree_flatten(state.q)[1]))


def _cholesky_pass(p: torch.Tensor, gram: torch.Tensor, first: bool, rows: int
                   ) -> torch.Tensor:
    """One pass of shifted Cholesky QR: :math:`P R^{-1}` with :math:`R^\\top R = P^\\top P +
    sI` (``gram`` is the whole :math:`P^\\top P`, reduced over shards)."""
    r = gram.shape[-1]
    u = torch.finfo(gram.dtype).eps
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    shift = (11 * (rows * r + r * (r + 1)) * u if first else u) * trace
    eye = torch.eye(r, dtype=gram.dtype, device=gram.device)
    lower, _ = torch.linalg.cholesky_ex(gram + shift * eye)
    return torch.linalg.solve_triangular(lower.mT, p, upper=True, left=False)


# ---------------------------------------------------------------------------------------------
# Dion2
# ---------------------------------------------------------------------------------------------


class ScaleByDion2State(NamedTuple):
    """State of `scale_by_dion2`."""
    count: torch.Tensor   # shape (), int32: steps taken
    momentum: Updates     # like params: the momentum, its selected slices decayed each step
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, momentum=Role.FIRST_MOMENT)


@declare(hyperparams={"ef_decay": HyperRole.MOMENTUM, "eps": HyperRole.EPS},
         runtime=("ns_coeffs", "ns_steps"))
def scale_by_dion2(fraction: float = 0.25, ef_decay: float = 0.95, eps: float = 1e-8, *,
                   method: Method = "polar_express", ns_coeffs: Any = NS_COEFFS,
                   ns_steps: int = 5, ns_dtype: torch.dtype | None = None,
                   momentum_dtype: torch.dtype | None = None,
                   sharded_mode: ShardedMode = "owners") -> GradientTransformation:
    r"""Dion2's update: orthogonalize only the rows (or columns) of the momentum with the
    largest :math:`\ell_1` norms, and decay those in the momentum (error feedback).

    For each matrix :math:`M` (:math:`m \times n`; a leaf of more dims is a batch of them over
    its last two), selecting over rows when :math:`m \le n`, else over columns, with
    :math:`k = \lceil \text{fraction} \cdot (\text{rows or columns}) \rceil`:

    .. math::
        M \leftarrow M + G, \quad S = \mathrm{top}_k\, \lVert M_{i,:} \rVert_1, \quad
        M_S \leftarrow \text{ef\_decay} \cdot M_S, \quad u_S = \mathrm{orth}(M_S), \quad
        u_{\bar S} = 0

    with :math:`M_S` the selected slices before the decay and :math:`\mathrm{orth}` the
    ``method`` of `orthogonalize` (Polar Express by default, as the ``dion`` package; its
    ``epsilon`` 1e-8 added to the norm). The submatrices of all leaves go through one
    batched `orthogonalize` per shape. Needs whole matrices (the top-:math:`k` is over the
    whole matrix: the ``dion`` package's ``selection_scope="global"``), unless
    ``sharded_mode`` is ``"gram"`` or ``"auto"``: then a matrix sharded over the side it is
    not selected on (the columns of a wide matrix, the rows of a tall one: its rows or
    columns are selected whole) runs on its shards, the :math:`\ell_1` norms summed over
    them through the reduction hook and the selected slices orthogonalized with the Gram
    matrix of the selected side all-reduced (`orthogonalize`'s Gram mode; never larger
    than the selection); one sharded over the selected side is refused (its top-:math:`k`
    is across shards: run it on owners).

    Args:
      fraction: the selected fraction of rows or columns, in (0, 1].
      ef_decay: the factor on the selected slices of the momentum, in [0, 1].
      eps, method, ns_coeffs, ns_steps, ns_dtype: of the orthogonalization.
      momentum_dtype: dtype of :math:`M` (default: the parameter's, float32 for 16-bit).
      sharded_mode: ``"owners"`` (whole matrices only), ``"gram"`` or ``"auto"`` (the
        same here: shards of the unselected side), as in `orthogonalize`.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_dion2(0.25), opttx.scale_by_shape(
      ...     convention="spectral"), opttx.scale_by_learning_rate(0.01))

    References:
      Ahn et al., Dion2 (2026); Microsoft's ``dion`` package, ``dion2.py``.
    """
    _check_static_fraction("fraction", fraction)
    fraction = float(fraction)
    check_unit_interval("ef_decay", ef_decay, closed_right=True)
    on_shards = sharded_mode != "owners"
    # the selection is the smaller side, so its Gram matrix never exceeds it: "gram"
    ortho = orthogonalize(ns_steps, ns_coeffs, eps, method, ns_dtype=ns_dtype,
                          sharded_mode="gram" if on_shards else "owners")

    def check(tree: PyTree) -> None:
        for x, path in zip(tree_flatten(tree)[0], tree_paths(tree)):
            if x.dim() < 2:
                raise ValueError(f"scale_by_dion2: params{path} has {x.dim()} dim(s); Dion2 "
                                 "works on matrices. Route other leaves elsewhere "
                                 "(opttx.dion2 sends them to AdamW).")

    def init(params: Params) -> ScaleByDion2State:
        check_init_params(params)
        check(params)
        leaves, spec = tree_flatten(params)
        momentum = [torch.zeros_like(x, dtype=state_dtype(x, momentum_dtype)) for x in leaves]
        return ScaleByDion2State(count=zero_count(params),
                                 momentum=tree_unflatten(momentum, spec))

    def step(g, state, params, extra_args):
        M = [m + u.to(m.dtype) for m, u in zip(state.momentum, g)]
        spec = extra_args.get(LEAF_SPEC_KEY)
        shapes = [x.shape for x in M]
        sharded: list[tuple[int, ...]] = [()] * len(M)
        if on_shards and spec is not None:
            axes = [(m.dim() - 2, m.dim() - 1) for m in M]
            sharded = sharded_matrix_dims(M, spec, axes, extra_args)
            shapes = global_matrix_shapes(M, spec, extra_args)
        selected, index, dims, partial = {}, {}, {}, {}
        for i, m in enumerate(M):
            if math.prod(shapes[i]) == 0:   # an empty matrix: an empty update (below)
                continue
            rows, cols = shapes[i][-2:]
            dim = -2 if rows <= cols else -1
            if sharded[i] and m.dim() + dim in sharded[i]:
                raise ValueError(
                    f"scale_by_dion2: leaf {i} is sharded over the side its top-k selects "
                    f"({'rows' if dim == -2 else 'columns'} of a {rows} x {cols} matrix): the "
                    "selection is across the shards. Shard it over the other side, or run it "
                    "on owner ranks (opttx.distributed.sharded(tx, specs, on_owners=True)).")
            partial[i] = m.abs().sum(dim=-1 if dim == -2 else -2)
            dims[i] = dim
        if any(sharded):
            reduced = reduce_statistics(
                tree_unflatten([partial.get(i, MaskedNode()) for i in range(len(M))], spec),
                extra_args, "sum",
                tree_unflatten([(M[i].dim() + (-1 if dims[i] == -2 else -2),)
                                if i in partial else None for i in range(len(M))], spec))
            partial = {i: x for i, x in enumerate(spec.flatten_up_to(reduced)) if i in partial}
        for i, norms in partial.items():
            m, dim = M[i], dims[i]
            rows, cols = m.shape[-2:]
            k = max(1, math.ceil(fraction * shapes[i][dim]))
            idx = torch.topk(norms, k, dim=-1, sorted=False).indices
            idx = idx.unsqueeze(-1).expand(*idx.shape, cols) if dim == -2 else \
                idx.unsqueeze(-2).expand(*idx.shape[:-1], rows, k)
            selected[i] = torch.gather(m, dim, idx)
            index[i] = idx
        if any(sharded):        # the selections as a tree like the updates, for the hook
            tree = tree_unflatten([selected.get(i, MaskedNode()) for i in range(len(M))], spec)
            orth = dict(zip(selected, tree_flatten(ortho.update(
                tree, EmptyState(), **extra_args)[0])[0]))
        else:
            orth = ortho.update(selected, EmptyState())[0]
        out, new_m = [], []
        for i, (m, u) in enumerate(zip(M, g)):
            if i not in selected:
                new_m.append(m)
                out.append(torch.zeros_like(u))
                continue
            new_m.append(m.scatter(dims[i], index[i], selected[i] * ef_decay))
            out.append(torch.zeros_like(m).scatter(dims[i], index[i], orth[i]).to(u.dtype))
        mark_scratch(out)
        return out, replace_state(state, momentum=new_m)

    inner = leafwise(ScaleByDion2State, step)

    def update(updates: Updates, state: ScaleByDion2State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ScaleByDion2State]:
        check(updates)
        if not on_shards:
            require_whole_leaves(updates, extra_args, "scale_by_dion2")
        return inner(updates, state, params, **extra_args)

    # rows of one shape orthogonalized in one batched product, as `orthogonalize`'s
    return GradientTransformation(init, update, Traits(
        per_leaf=True, whole_leaves=not on_shards,
        batched_across_leaves=traits_of(ortho).batched_across_leaves))
