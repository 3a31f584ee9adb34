"""Factored second moments (Adafactor, CAME) and the layer-wise scalings that go with them.

A factored leaf keeps, instead of a full second-moment tensor, the moving averages of its row
and column means over two chosen axes ``(d0, d1)``: :math:`R` (mean over ``d1``) and
:math:`C` (mean over ``d0``). The second moment is approximated by
:math:`\\hat v = R \\otimes C / \\mathrm{mean}_{d0}(R)`, and an update is scaled by
:math:`\\hat v^{-1/2} = (R / \\mathrm{mean}(R))^{-1/2} \\otimes C^{-1/2}`, never materialised.

Every mean here is a reduction over a tensor, so it is written in the three steps of
docs/design.md, rule 6: (a) local partial sums and element counts of every leaf, (b) one
call to `opttx.base.reduce_statistics` for all leaves (sums over the reduced dims; the
identity on one device), (c) finish (divide). A sharded run then gets exact row and column means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch

from .._checks import (check_gradient_leaves, check_nonnegative, check_positive,
                       check_unit_interval)
from ..base import (EmptyState, GradientTransformation, HyperRole, LEAF_SPEC_KEY, LEAFWISE,
                    Params, REDUCER_KEY, Role, Updates, check_init_params, current_reducer,
                    declare, declare_roles, reduce_statistics, replace_state, require_params,
                    safe_increment, zero_count)
from ..kernels import Scalar, cast_like, foreach, foreach_ema, foreach_op_, foreach_sum_of_squares
from ..schedules import Schedule
from ..skeleton import as_tree, leafwise
from ..tree import (MaskedNode, PyTree, Static, flatten_matching, leaf_labels, state_dtype,
                    tree_flatten, tree_map, tree_paths, tree_unflatten)
from .common import stateless_leafwise
from .clipping import clip_by_block_rms

__all__ = [
    "FactoredState",
    "ScaleByCameState",
    "add_step_scaled_decayed_weights",
    "clip_by_rms",
    "clip_by_rms_and_scale_by_param_rms",
    "factored_axes",
    "relative_step_schedule",
    "scale_by_came",
    "scale_by_factored_rms",
    "scale_by_param_block_rms",
    "scale_by_trust_ratio",
]

FactorAxes = Literal["last", "largest"] | PyTree | Callable[[Params], PyTree]
Axes = tuple[int, int] | None


# ---------------------------------------------------------------------------------------------
# which axes to factor
# ---------------------------------------------------------------------------------------------


def _axes_for_shape(shape: Sequence[int], rule: str, min_dim_size_to_factor: int) -> Axes:
    if len(shape) < 2:
        return None
    if rule == "last":
        d0, d1 = len(shape) - 2, len(shape) - 1
    else:  # "largest": the two largest dims, (second largest, largest), as optax
        order = _ascending(shape)
        d0, d1 = order[-2], order[-1]
    if min(shape[d0], shape[d1]) < min_dim_size_to_factor:
        return None
    return d0, d1


def _ascending(shape: Sequence[int]) -> list[int]:
    """The dims of ``shape`` by size, smallest first, ties in dim order: what
    ``sorted(range(len(shape)), key=shape.__getitem__)`` gives, by comparisons alone. Traced
    with dynamic shapes (offload's compiled host step) the sizes are symbolic, which Dynamo
    compares (guarding on the outcome) but refuses as sort keys."""
    order: list[int] = []
    for d in range(len(shape)):
        at = len(order)
        while at > 0 and shape[order[at - 1]] > shape[d]:
            at -= 1
        order.insert(at, d)
    return order


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, int) for a in x)


def factored_axes(params: Params, factor_axes: FactorAxes = "largest",
                  min_dim_size_to_factor: int = 128,
                  shapes: Sequence[Sequence[int]] | None = None) -> list[Axes]:
    """The pair of axes ``(d0, d1)`` each leaf of ``params`` is factored over (None: kept
    whole), in leaf order.

    ``factor_axes`` is ``"last"`` (the last two dims: the paper, transformers and torch.optim),
    ``"largest"`` (the two largest dims: optax), or a tree like ``params`` (or a function of it)
    giving an explicit ``(d0, d1)`` or None per leaf. With the named rules a leaf is factored
    when it has at least two dims and both chosen dims are >= ``min_dim_size_to_factor``.
    ``shapes`` (per leaf) are the shapes the named rules read instead of the leaves' own: the
    global shapes of local shards under `opttx.distributed.sharded` (the factoring
    transforms pass them, so a shard is factored as the whole tensor is).
    """
    leaves, _ = tree_flatten(params)
    if isinstance(factor_axes, str):
        if factor_axes not in ("last", "largest"):
            raise ValueError(f"factor_axes must be 'last', 'largest' or a tree of axis pairs, "
                             f"got {factor_axes!r}.")
        if shapes is None or len(shapes) != len(leaves):
            shapes = [p.shape for p in leaves]
        return [_axes_for_shape(s, factor_axes, min_dim_size_to_factor) for s in shapes]
    given = leaf_labels(factor_axes, params, "factor_axes", is_leaf=_is_axes)
    out: list[Axes] = []
    for path, p, axes in zip(tree_paths(params), leaves, given):
        if axes is None:
            out.append(None)
            continue
        if p.dim() < 2:
            raise ValueError(f"Cannot factor the {p.dim()}-d tensor params{path} over axes "
                             f"{axes}: factoring needs two axes. Give None for it.")
        d0, d1 = (a % p.dim() for a in axes)
        if d0 == d1:
            raise ValueError(f"factor_axes for params{path} names the same axis twice: {axes}.")
        out.append((d0, d1))
    return out


def _global_shapes(tree: Params, extra_args: dict[str, Any] | None) -> list | None:
    """The global shapes of ``tree``'s leaves when they are local shards under
    `opttx.distributed.sharded` (its reducer knows them; at ``init`` it is the current one),
    else None."""
    reducer = current_reducer(extra_args)
    shapes_of = getattr(reducer, "global_shapes_of", None)
    return shapes_of(tree) if shapes_of is not None else None


# ---------------------------------------------------------------------------------------------
# the shared machinery: factored EMAs and the inverse square root they give
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Static per-leaf factoring decisions for one update call."""
    axes: list[Axes]
    skip_full: bool = False  # leave unfactored leaves alone (CAME's instability statistics)

    @property
    def factored(self) -> list[int]:
        return [i for i, a in enumerate(self.axes) if a is not None]

    @property
    def full(self) -> list[int]:
        if self.skip_full:
            return []
        return [i for i, a in enumerate(self.axes) if a is None]


def _row_col_shapes(shape: Sequence[int], axes: tuple[int, int]) -> tuple[list, list]:
    d0, d1 = axes
    row = [s for i, s in enumerate(shape) if i != d1]
    col = [s for i, s in enumerate(shape) if i != d0]
    return row, col


def _init_factored(params: Params, axes: list[Axes], dtype: torch.dtype | None
                   ) -> tuple[PyTree, PyTree, PyTree]:
    """Zero row, column and full statistics (empty tensors where a kind is not used)."""
    leaves, spec = tree_flatten(params)
    rows, cols, fulls = [], [], []
    for p, a in zip(leaves, axes):
        kw = dict(dtype=state_dtype(p, dtype), device=p.device)
        empty = torch.zeros((0,), **kw)
        if a is None:
            rows.append(empty), cols.append(empty), fulls.append(torch.zeros(p.shape, **kw))
        else:
            row, col = _row_col_shapes(p.shape, a)
            rows.append(torch.zeros(row, **kw)), cols.append(torch.zeros(col, **kw))
            fulls.append(empty)
    return (tree_unflatten(rows, spec), tree_unflatten(cols, spec), tree_unflatten(fulls, spec))


def _reduce_sums(sums: list[torch.Tensor | None], counts: list[float], dims: list[Any],
                 spec: Any, extra_args: dict) -> list[torch.Tensor | None]:
    """Steps (b) and (c) of a batched mean: reduce partial sums and element counts over the
    given dims of every leaf, then divide."""
    present = [i for i, s in enumerate(sums) if s is not None]
    if not present:
        return [None] * len(sums)
    if extra_args.get(REDUCER_KEY) is None:   # one device: nothing to combine
        return [s / c if s is not None else None for s, c in zip(sums, counts)]
    sum_tree = _sparse_tree([sums[i] for i in present], present, spec, len(sums))
    count_tree = _sparse_tree([torch.tensor(counts[i], dtype=sums[i].dtype,
                                            device=sums[i].device) for i in present],
                              present, spec, len(sums))
    dim_tree = _sparse_tree([dims[i] for i in present], present, spec, len(sums))
    reduced_sums, reduced_counts = reduce_statistics((sum_tree, count_tree), extra_args,
                                                     dims=(dim_tree, dim_tree))
    out: list[torch.Tensor | None] = [None] * len(sums)
    for i, s, c in zip(present, tree_flatten(reduced_sums)[0], tree_flatten(reduced_counts)[0]):
        out[i] = s / c
    return out


def _reduce_many_sums(requests: list[tuple[list, list, list]], spec: Any, extra_args: dict
                      ) -> list[list[torch.Tensor | None]]:
    """Several batched means in ONE call of the reduction hook (one collective per group when
    sharded): each request is ``(sums, counts, dims)`` as for `_reduce_sums`."""
    if extra_args.get(REDUCER_KEY) is None:   # one device: nothing to combine
        return [[s / c if s is not None else None for s, c in zip(sums, counts)]
                for sums, counts, _ in requests]
    trees, dim_trees, presents = [], [], []
    for sums, counts, dims in requests:
        present = [i for i, x in enumerate(sums) if x is not None]
        presents.append(present)
        n = len(sums)
        count_values = [torch.tensor(counts[i], dtype=sums[i].dtype, device=sums[i].device)
                        for i in present]
        dim_tree = _sparse_tree([dims[i] for i in present], present, spec, n)
        trees += [_sparse_tree([sums[i] for i in present], present, spec, n),
                  _sparse_tree(count_values, present, spec, n)]
        dim_trees += [dim_tree, dim_tree]
    reduced = reduce_statistics(tuple(trees), extra_args, dims=tuple(dim_trees))
    out = []
    for k, ((sums, _, _), present) in enumerate(zip(requests, presents)):
        means: list[torch.Tensor | None] = [None] * len(sums)
        for i, total, count in zip(present, tree_flatten(reduced[2 * k])[0],
                                   tree_flatten(reduced[2 * k + 1])[0]):
            means[i] = total / count
        out.append(means)
    return out


def _sparse_tree(values: list, indices: list[int], spec: Any, n: int) -> PyTree:
    """A tree with ``spec``'s structure holding ``values`` at ``indices`` and MaskedNode
    elsewhere (so the reduction hook sees which parameter each statistic belongs to)."""
    full: list[Any] = [MaskedNode()] * n
    for i, v in zip(indices, values):
        full[i] = v
    return tree_unflatten(full, spec)


def _factored_ema(q: list[torch.Tensor], rows: list[torch.Tensor], cols: list[torch.Tensor],
                  fulls: list[torch.Tensor], layout: _Layout, decay: Scalar, spec: Any,
                  extra_args: dict) -> tuple[list, list, list, list | None]:
    r"""EMAs with ``decay`` of the row and column means of ``q`` (factored leaves) and of ``q``
    itself (the others).

    Also returns, when sharded (a reducer in ``extra_args``), the mean over ``d0`` of the new
    row statistic :math:`R_t`, from the same single reduction: by linearity
    :math:`\mathrm{mean}_{d_0} R_t = \beta\, \mathrm{mean}_{d_0} R_{t-1} + (1-\beta)\,
    \mathrm{mean}_{d_0 d_1} q_t`, whose partials are known before the call. On one device it
    returns None and `_scale_by_inverse_root` takes the mean of :math:`R_t` directly (the
    same value up to rounding).
    """
    n = len(q)
    row_sums: list[Any] = [None] * n
    col_sums: list[Any] = [None] * n
    row_counts, col_counts = [0.0] * n, [0.0] * n
    row_dims: list[Any] = [None] * n
    col_dims: list[Any] = [None] * n
    sharded = extra_args.get(REDUCER_KEY) is not None
    prev_sums: list[Any] = [None] * n       # sum over d0 of R_{t-1} (sharded only)
    q_sums: list[Any] = [None] * n          # sum over d0 and d1 of q (sharded only)
    prev_counts, q_counts = [0.0] * n, [0.0] * n
    prev_dims: list[Any] = [None] * n
    q_dims: list[Any] = [None] * n
    for i in layout.factored:                                            # (a) local partials
        d0, d1 = layout.axes[i]
        row_sums[i], row_counts[i], row_dims[i] = q[i].sum(dim=d1), q[i].shape[d1], (d1,)
        col_sums[i], col_counts[i], col_dims[i] = q[i].sum(dim=d0), q[i].shape[d0], (d0,)
        if sharded:
            r_d0 = d0 if d0 < d1 else d0 - 1
            prev_sums[i] = rows[i].sum(dim=r_d0, keepdim=True)
            prev_counts[i], prev_dims[i] = rows[i].shape[r_d0], (d0,)
            q_sums[i] = row_sums[i].sum(dim=r_d0, keepdim=True)
            q_counts[i] = q[i].shape[d0] * q[i].shape[d1]
            q_dims[i] = (d0, d1)
    requests = [(row_sums, row_counts, row_dims), (col_sums, col_counts, col_dims)]
    if sharded:
        requests += [(prev_sums, prev_counts, prev_dims), (q_sums, q_counts, q_dims)]
    means = _reduce_many_sums(requests, spec, extra_args)                 # (b), (c)
    row_means, col_means = means[0], means[1]
    f, u = layout.factored, layout.full
    new_rows, new_cols, new_fulls = list(rows), list(cols), list(fulls)
    r_means: list | None = None
    if sharded:
        r_means = [None] * n
        old_means = [means[2][i] for i in f]
        for idx, new in zip(f, foreach_ema(old_means, [means[3][i] for i in f], decay)):
            r_means[idx] = new
    for idx, new in zip(f, foreach_ema([rows[i] for i in f], [row_means[i] for i in f], decay)):
        new_rows[idx] = new
    for idx, new in zip(f, foreach_ema([cols[i] for i in f], [col_means[i] for i in f], decay)):
        new_cols[idx] = new
    for idx, new in zip(u, foreach_ema([fulls[i] for i in u], [q[i] for i in u], decay)):
        new_fulls[idx] = new
    return new_rows, new_cols, new_fulls, r_means


def _scale_by_inverse_root(x: list[torch.Tensor], rows: list[torch.Tensor],
                           cols: list[torch.Tensor], fulls: list[torch.Tensor],
                           layout: _Layout, spec: Any, extra_args: dict,
                           eps_clamp: float | None = None,
                           row_means: list | None = None) -> list[torch.Tensor]:
    r"""``x · v̂^{-1/2}`` per leaf, with :math:`\hat v = R \otimes C / \mathrm{mean}_{d0}(R)`
    for factored leaves and the full statistic for the others.

    With ``eps_clamp`` (torch.optim.Adafactor's ``eps1``) the row mean is clamped below at
    ``eps_clamp`` and :math:`\hat v` at ``eps_clamp²``, as torch does.
    """
    n = len(x)
    if row_means is None:      # not folded into the EMAs' reduction (one device)
        sums: list[Any] = [None] * n
        counts, dims = [0.0] * n, [None] * n
        for i in layout.factored:                      # (a) partial sums of R over d0
            d0, d1 = layout.axes[i]
            r_d0 = d0 if d0 < d1 else d0 - 1           # d0's index inside R's shape
            sums[i], counts[i], dims[i] = (rows[i].sum(dim=r_d0, keepdim=True),
                                           rows[i].shape[r_d0], (d0,))
        row_means = _reduce_sums(sums, counts, dims, spec, extra_args)   # (b), (c)
    out: list[torch.Tensor] = list(x)
    for i in layout.factored:
        d0, d1 = layout.axes[i]
        xi = x[i].to(rows[i].dtype)
        if eps_clamp is None:
            r_factor = torch.rsqrt(rows[i] / row_means[i]).unsqueeze(d1)
            c_factor = torch.rsqrt(cols[i]).unsqueeze(d0)
            out[i] = xi * r_factor * c_factor
        else:
            v_hat = rows[i].unsqueeze(d1) * cols[i].unsqueeze(d0)
            v_hat = v_hat / torch.clamp(row_means[i].unsqueeze(d1), min=eps_clamp)
            out[i] = xi * torch.rsqrt(torch.clamp(v_hat, min=eps_clamp * eps_clamp))
    for i in layout.full:
        xi = x[i].to(fulls[i].dtype)
        v = fulls[i] if eps_clamp is None else torch.clamp(fulls[i], min=eps_clamp * eps_clamp)
        out[i] = xi * torch.rsqrt(v)
    return out


# ---------------------------------------------------------------------------------------------
# scale_by_factored_rms (Adafactor)
# ---------------------------------------------------------------------------------------------


def reduced_dims(state: Any, field: str, k: int) -> tuple[int, ...] | None:
    """How the tensor of the ``k``-th leaf (in the order of the leaves present in the state)
    in ``field`` of a factored state relates to that leaf, as the state declares it (its
    ``factored_axes``, recorded by ``init``): the dims of the leaf it is a mean over
    (``v_row``: the leaf's ``d1``; ``v_col``: its ``d0``), ``()`` for a tensor shaped like the
    leaf, None for an empty placeholder. Read by checkpoints, which lay out a row or column
    statistic of a sharded leaf from it (sharded like the leaf on the dims it keeps,
    replicated over the dim it reduced)."""
    axes = state.factored_axes.value
    if axes is None or k >= len(axes):
        return None
    pair = axes[k]
    if field in ("v_row", "r_row"):
        return None if pair is None else (pair[1],)
    if field in ("v_col", "r_col"):
        return None if pair is None else (pair[0],)
    if field == "v":
        return () if pair is None else None
    return ()


class FactoredState(NamedTuple):
    """State of `scale_by_factored_rms`."""
    count: torch.Tensor  # shape (), int32: steps taken
    v_row: Updates       # per leaf: EMA of the means of g² + ε over d1 (empty if unfactored)
    v_col: Updates       # per leaf: EMA of the means of g² + ε over d0 (empty if unfactored)
    v: Updates           # per leaf: EMA of g² + ε for unfactored leaves (empty if factored)
    factored_axes: Static = Static()  # per leaf, in leaf order: its (d0, d1), or None
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, v_row=Role.FACTORED_MOMENT,
                              v_col=Role.FACTORED_MOMENT, v=Role.SECOND_MOMENT)

    def reduced_dims(self, field: str, k: int) -> tuple[int, ...] | None:
        """The layout of the ``k``-th leaf's tensor in ``field`` (see `reduced_dims`)."""
        return reduced_dims(self, field, k)


def _decay_rate_pow(step: torch.Tensor, exponent: float) -> torch.Tensor:
    """``1 − t^(−exponent)`` with ``t = step + 1`` (so 0 at the first step)."""
    t = (step + 1).to(torch.float64)
    return 1 - torch.pow(t, -exponent)


@declare(hyperparams={"decay_rate": None, "epsilon": HyperRole.EPS, "eps_clamp": None},
         runtime=("step_offset", "decay_rate_fn"))
def scale_by_factored_rms(factored: bool = True, decay_rate: float = 0.8, step_offset: int = 0,
                          min_dim_size_to_factor: int = 128, epsilon: float = 1e-30,
                          decay_rate_fn: Callable[[torch.Tensor, float], torch.Tensor] =
                          _decay_rate_pow, *, factor_axes: FactorAxes = "largest",
                          eps_clamp: float | None = None,
                          stats_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Adafactor's factored second-moment scaling.

    .. math::
        q_t = g_t^2 + \epsilon_1, \quad \beta_t = 1 - t^{-c}, \quad
        R_t = \beta_t R_{t-1} + (1-\beta_t)\,\mathrm{mean}_{d_1}(q_t), \quad
        C_t = \beta_t C_{t-1} + (1-\beta_t)\,\mathrm{mean}_{d_0}(q_t),

    .. math::
        u_t = g_t \odot \left(\frac{R_t}{\mathrm{mean}_{d_0}(R_t)}\right)^{-1/2}
              \otimes C_t^{-1/2}

    for factored leaves, and :math:`u_t = g_t / \sqrt{v_t}` with
    :math:`v_t = \beta_t v_{t-1} + (1-\beta_t) q_t` for the others (vectors, small matrices).
    Tensors of more than two dims are factored over two axes, the others acting as batch axes.
    With :math:`\beta_1 = 0` at the first step no bias correction is needed.

    Args:
      factored: factor the leaves that qualify (False: keep every statistic whole).
      decay_rate: the exponent :math:`c` in (0, 1] (transformers writes ``-0.8``).
      step_offset: subtracted from the step count before computing :math:`\beta_t`.
      min_dim_size_to_factor: both factored dims must be at least this large.
      epsilon: :math:`\epsilon_1`, added to :math:`g^2` before averaging.
      decay_rate_fn: ``fn(step, decay_rate) -> beta_t`` (0-based step tensor) for a custom
        decay.
      factor_axes: ``"largest"`` (optax, default), ``"last"`` (paper, transformers,
        torch.optim), or a tree of explicit ``(d0, d1)``/None per leaf.
      eps_clamp: torch.optim.Adafactor's ``eps1`` semantics (use with ``epsilon=0``): the row
        mean is clamped below at ``eps_clamp`` and :math:`\hat v` at ``eps_clamp²``.
      stats_dtype: dtype of the statistics (default fp32 for 16-bit leaves).

    Example:
      >>> tx = opttx.chain(opttx.scale_by_factored_rms(), opttx.clip_by_rms(1.0),
      ...                  opttx.scale_by_param_block_rms(), opttx.scale(-1e-2))

    References:
      Shazeer and Stern, Adafactor (arXiv 1804.04235).
    """
    if isinstance(decay_rate, (int, float)) and not 0 < decay_rate <= 1:
        raise ValueError(f"decay_rate must be in (0, 1] (the exponent c of 1 - t^-c; "
                         f"transformers' -0.8 is 0.8 here), got {decay_rate}.")
    check_nonnegative("epsilon", epsilon)
    check_nonnegative("step_offset", step_offset)
    if eps_clamp is not None:
        check_positive("eps_clamp", eps_clamp)

    def layout_of(params: Params, extra_args: dict[str, Any] | None = None) -> _Layout:
        if not factored:
            return _Layout([None] * len(tree_flatten(params)[0]))
        return _Layout(factored_axes(params, factor_axes, min_dim_size_to_factor,
                                     _global_shapes(params, extra_args)))

    def init(params: Params) -> FactoredState:
        check_init_params(params)
        axes = layout_of(params).axes
        rows, cols, fulls = _init_factored(params, axes, stats_dtype)
        return FactoredState(count=zero_count(params), v_row=rows, v_col=cols, v=fulls,
                             factored_axes=Static(tuple(axes)))

    def step(g: list[torch.Tensor], state: FactoredState, params: list | None,
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], FactoredState]:
        spec = extra_args[LEAF_SPEC_KEY]
        rows, cols, fulls = state.v_row, state.v_col, state.v
        layout = layout_of(as_tree(g, extra_args), extra_args)
        beta = decay_rate_fn(state.count - step_offset, decay_rate)
        q = [x.to(s.dtype if s.numel() else r.dtype) for x, s, r in zip(g, fulls, rows)]
        q = foreach("mul", q, q)
        if not (isinstance(epsilon, (int, float)) and epsilon == 0):
            q = foreach("add", q, epsilon)
        rows, cols, fulls, r_means = _factored_ema(q, rows, cols, fulls, layout, beta, spec,
                                                   extra_args)
        q = None   # free g² + ε before the update is allocated (one temporary at a time)
        out = _scale_by_inverse_root(g, rows, cols, fulls, layout, spec, extra_args, eps_clamp,
                                     r_means)
        return cast_like(out, g), replace_state(state, v_row=rows, v_col=cols, v=fulls)

    # the decay reads the 0-based step; the statistics' shapes are checked by the params'
    update = leafwise(FactoredState, step, name="scale_by_factored_rms",
                      per_leaf_roles=(Role.FACTORED_MOMENT,), check_shapes="params",
                      zero_based_count=True)
    return GradientTransformation(init, update, LEAFWISE)


@declare(hyperparams={"threshold": None})
def clip_by_rms(threshold: float = 1.0) -> GradientTransformation:
    r"""Adafactor's update clipping: :math:`u / \max(1, \mathrm{RMS}(u) / d)` per leaf.

    The same transform as `clip_by_block_rms` (optax's name), with Adafactor's default
    :math:`d = 1`.
    """
    return clip_by_block_rms(threshold)


def _leaf_rms(leaves: list[torch.Tensor], spec: Any, extra_args: dict) -> list[torch.Tensor]:
    """RMS of every leaf, in three steps: local sum of squares and count, reduce, finish."""
    if not leaves:
        return []
    sums = foreach_sum_of_squares(leaves)                                        # (a)
    means = _reduce_sums(sums, [float(x.numel()) for x in leaves], [None] * len(leaves),
                         spec, extra_args)                                       # (b), (c)
    return foreach("sqrt", means)


def _stateless_with_params(name: str, fn: Callable[[Any, list, list, dict], list]
                           ) -> GradientTransformation:
    """A stateless per-leaf transform that reads the params: ``fn(spec, updates, params,
    extra_args)`` maps the lists of leaves to the new update leaves."""
    return stateless_leafwise(
        name, lambda g, p, extra_args: fn(extra_args[LEAF_SPEC_KEY], g, p, extra_args),
        LEAFWISE, needs_params=True, check_shapes="params")


@declare(hyperparams={"min_scale": None})
def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    r"""Scale each leaf's update by its parameter's RMS: :math:`u \cdot \max(\epsilon_2,
    \mathrm{RMS}(x))` (Adafactor's ``scale_parameter``; optax's name and default).

    References:
      Shazeer and Stern, Adafactor (arXiv 1804.04235).
    """
    check_nonnegative("min_scale", min_scale)

    def scaled(spec: Any, g: list, p: list, extra_args: dict) -> list:
        # grouped passes over the 0-dim RMS values, then one grouped multiply
        scales = foreach("clamp_min", _leaf_rms(p, spec, extra_args), min_scale)
        return foreach("mul", g, cast_like(scales, g))

    return _stateless_with_params("scale_by_param_block_rms", scaled)


@declare(hyperparams={"threshold": None, "min_scale": None})
def clip_by_rms_and_scale_by_param_rms(threshold: float = 1.0, min_scale: float = 1e-3
                                       ) -> GradientTransformation:
    r"""`clip_by_rms` then `scale_by_param_block_rms`, both RMS values from one reduction.

    .. math::
        u \leftarrow \frac{u}{\max(1, \mathrm{RMS}(u)/d)} \cdot \max(\epsilon_2,
        \mathrm{RMS}(x))

    per leaf. The numbers of the two transforms in a row (a scalar factor such as the learning
    rate commutes with both), with the local sums of squares of the update and of the
    parameter reduced together: under `opttx.distributed.sharded` one collective instead of
    two. `opttx.adafactor` uses it when both clipping and parameter scaling are on.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_factored_rms(),
      ...                  opttx.clip_by_rms_and_scale_by_param_rms(1.0, 1e-3), opttx.scale(-1e-2))

    References:
      Shazeer and Stern, Adafactor (arXiv 1804.04235).
    """
    check_positive("threshold", threshold)
    check_nonnegative("min_scale", min_scale)

    def clipped_and_scaled(spec: Any, g: list, p: list, extra_args: dict) -> list:
        n = len(g)
        sq = foreach_sum_of_squares(g) + foreach_sum_of_squares(p)          # (a)
        counts = [float(x.numel()) for x in g] * 2
        u_means, p_means = _reduce_many_sums(                               # (b), (c)
            [(sq[:n], counts[:n], [None] * n), (sq[n:], counts[n:], [None] * n)], spec,
            extra_args)
        # (c) finish: grouped passes over the 0-dim statistics, then one grouped multiply
        p_scale = foreach("clamp_min", foreach("sqrt", p_means), min_scale)
        u_clip = foreach("clamp_min", foreach("div", foreach("sqrt", u_means), threshold), 1.0)
        factors = foreach("div", p_scale, u_clip)
        return foreach("mul", g, cast_like(factors, g))

    return _stateless_with_params("clip_by_rms_and_scale_by_param_rms", clipped_and_scaled)


def relative_step_schedule(max_learning_rate: float = 1e-2,
                           warmup_init: bool = False) -> Schedule:
    r"""Adafactor's relative step size :math:`\rho_t = \min(\eta_{max}, 1/\sqrt{t})`, or
    :math:`\min(10^{-6} t, 1/\sqrt{t})` with ``warmup_init``; ``t`` counts from 1.

    transformers' ``relative_step=True`` uses :math:`\eta_{max} = 10^{-2}`; torch.optim's
    Adafactor is this schedule with its ``lr`` as :math:`\eta_{max}`.
    """
    check_positive("max_learning_rate", max_learning_rate)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        t = (count + 1).to(torch.float64)
        cap = 1e-6 * t if warmup_init else torch.full_like(t, max_learning_rate)
        return torch.minimum(cap, torch.rsqrt(t))
    return schedule


@declare(hyperparams={"weight_decay": HyperRole.WEIGHT_DECAY,
                      "learning_rate": HyperRole.LEARNING_RATE, "min_scale": None})
def add_step_scaled_decayed_weights(weight_decay: float, learning_rate: float | Schedule,
                                    min_scale: float | None = 1e-3,
                                    mask: PyTree | None = None) -> GradientTransformation:
    r"""Add :math:`\lambda \eta_t \max(\epsilon_2, \mathrm{RMS}(x))\, x` to the updates:
    weight decay scaled by Adafactor's per-leaf step size, as transformers' Adafactor does
    (``p -= wd · lr_t · p``). ``min_scale=None`` drops the parameter-scale factor.
    """
    check_nonnegative("weight_decay", weight_decay)

    def init(params: Params) -> torch.Tensor:
        check_init_params(params)
        return zero_count(params)

    def update(updates: Updates, state: torch.Tensor, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, torch.Tensor]:
        params = require_params(params, "add_step_scaled_decayed_weights")
        spec, g, p = flatten_matching(updates, params, what="updates and params")
        check_gradient_leaves(g, p, updates, "add_step_scaled_decayed_weights")
        keep = leaf_labels(mask, params, "mask values") if mask is not None else [True] * len(g)
        lr = learning_rate(state) if callable(learning_rate) else learning_rate
        scales = ([torch.clamp(r, min=min_scale) for r in _leaf_rms(p, spec, extra_args)]
                  if min_scale is not None else [1.0] * len(g))
        out = [x + (weight_decay * lr * s * pi).to(x.dtype) if k else x
               for x, pi, s, k in zip(g, p, scales, keep)]
        return tree_unflatten(out, spec), safe_increment(state)

    return GradientTransformation(init, update, LEAFWISE)


# ---------------------------------------------------------------------------------------------
# CAME
# ---------------------------------------------------------------------------------------------


class ScaleByCameState(NamedTuple):
    """State of `scale_by_came`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params (fp32 for 16-bit leaves): EMA of the clipped update
    v_row: Updates       # per leaf: EMA of row means of g² + ε1 (empty if unfactored)
    v_col: Updates       # per leaf: EMA of column means of g² + ε1 (empty if unfactored)
    v: Updates           # per leaf: EMA of g² + ε1 for unfactored leaves (empty if factored)
    r_row: Updates       # per leaf: EMA of row means of the instability (û − m)² + ε2
    r_col: Updates       # per leaf: EMA of column means of the instability
    factored_axes: Static = Static()  # per leaf, in leaf order: its (d0, d1), or None
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, v_row=Role.FACTORED_MOMENT,
                           v_col=Role.FACTORED_MOMENT, v=Role.SECOND_MOMENT,
                           r_row=Role.FACTORED_MOMENT, r_col=Role.FACTORED_MOMENT)

    def reduced_dims(self, field: str, k: int) -> tuple[int, ...] | None:
        """The layout of the ``k``-th leaf's tensor in ``field`` (see `reduced_dims`)."""
        return reduced_dims(self, field, k)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "b3": None, "eps1": None,
                      "eps2": None, "clip_threshold": None})
def scale_by_came(b1: float = 0.9, b2: float = 0.999, b3: float = 0.9999,
                  eps1: float = 1e-30, eps2: float = 1e-16, clip_threshold: float = 1.0,
                  factor_axes: FactorAxes = "last", min_dim_size_to_factor: int = 1,
                  stats_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""CAME's confidence-guided factored scaling.

    .. math::
        u_t = g_t \hat v_t^{-1/2}, \quad \hat u_t = u_t / \max(1, \mathrm{RMS}(u_t)/d), \quad
        m_t = \beta_1 m_{t-1} + (1-\beta_1)\hat u_t,

    .. math::
        r_t = (\hat u_t - m_t)^2 + \epsilon_2, \quad
        S_t = \text{factored EMA}_{\beta_3}(r_t), \quad \text{update} = m_t\, \hat S_t^{-1/2}

    where :math:`\hat v_t` is the factored EMA (constant :math:`\beta_2`) of
    :math:`g^2 + \epsilon_1`, exactly as `scale_by_factored_rms` builds it. Leaves that are not
    factored (vectors) return :math:`m_t`. No bias correction. Factors the last two dims of
    every ≥2-D leaf by default, as ``came_pytorch.CAME``; the instability statistics have their
    own buffers (ColossalAI's DistributedCAME aliases them to the second-moment ones).

    References:
      Luo et al., CAME: Confidence-guided Adaptive Memory Efficient Optimization
      (arXiv 2307.02047).
    """
    for name, value in (("b1", b1), ("b2", b2), ("b3", b3)):
        check_unit_interval(name, value)
    check_nonnegative("eps1", eps1)
    check_nonnegative("eps2", eps2)
    check_positive("clip_threshold", clip_threshold)

    def layout_of(params: Params, extra_args: dict[str, Any] | None = None) -> _Layout:
        return _Layout(factored_axes(params, factor_axes, min_dim_size_to_factor,
                                     _global_shapes(params, extra_args)))

    def init(params: Params) -> ScaleByCameState:
        check_init_params(params)
        axes = layout_of(params).axes
        rows, cols, fulls = _init_factored(params, axes, stats_dtype)
        r_rows, r_cols, _ = _init_factored(params, axes, stats_dtype)
        mu = tree_map(lambda p: torch.zeros_like(p, dtype=state_dtype(p, stats_dtype)), params)
        return ScaleByCameState(count=zero_count(params), mu=mu, v_row=rows, v_col=cols,
                                v=fulls, r_row=r_rows, r_col=r_cols,
                                factored_axes=Static(tuple(axes)))

    def step(g: list[torch.Tensor], state: ScaleByCameState, params: None,
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], ScaleByCameState]:
        spec = extra_args[LEAF_SPEC_KEY]
        mu, rows, cols, fulls = state.mu, state.v_row, state.v_col, state.v
        r_rows, r_cols = state.r_row, state.r_col
        layout = layout_of(as_tree(g, extra_args), extra_args)
        g32 = cast_like(g, mu)
        q = foreach("add", foreach("mul", g32, g32), eps1)
        rows, cols, fulls, r_means = _factored_ema(q, rows, cols, fulls, layout, b2, spec,
                                                   extra_args)
        q = None   # temporaries are dropped as soon as they are used: peak memory, not numbers
        u = _scale_by_inverse_root(g32, rows, cols, fulls, layout, spec, extra_args,
                                   row_means=r_means)
        rms = _leaf_rms(u, spec, extra_args)
        u = foreach_op_("div", u, [torch.clamp(r / clip_threshold, min=1.0) for r in rms])
        mu = foreach_ema(mu, u, b1)
        out = list(mu)
        f = layout.factored
        res = foreach("sub", [u[i] for i in f], [mu[i] for i in f]) if f else []
        u = None   # (an assignment: Dynamo cannot trace `del` of a closure cell)
        if f:
            res = foreach_op_("mul", res, res)
            res = foreach_op_("add", res, eps2)
            res_full = [None] * len(g)
            for i, r in zip(f, res):
                res_full[i] = r
            factored_only = _Layout(layout.axes, skip_full=True)
            r_rows, r_cols, _, rr_means = _factored_ema(res_full, r_rows, r_cols, res_full,
                                                        factored_only, b3, spec, extra_args)
            out = _scale_by_inverse_root(out, r_rows, r_cols, res_full, factored_only, spec,
                                         extra_args, row_means=rr_means)
        return cast_like(out, g), replace_state(state, mu=mu, v_row=rows, v_col=cols, v=fulls,
                                                r_row=r_rows, r_col=r_cols)

    update = leafwise(ScaleByCameState, step, name="scale_by_came",
                      per_leaf_roles=(Role.FACTORED_MOMENT,))
    return GradientTransformation(init, update, LEAFWISE)


# ---------------------------------------------------------------------------------------------
# trust ratio (LAMB, LARS)
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"min_norm": None, "trust_coefficient": None, "eps": HyperRole.EPS})
def scale_by_trust_ratio(min_norm: float = 0.0, trust_coefficient: float = 1.0,
                         eps: float = 0.0, *, phi_bounds: tuple[float, float] | None = None,
                         mask: PyTree | Callable[[Params], PyTree] | None = None
                         ) -> GradientTransformation:
    r"""Scale each leaf's update by its layer-wise trust ratio.

    .. math::
        u \leftarrow u \cdot \tau\, \frac{\phi(\lVert x \rVert)}{\lVert u \rVert + \epsilon},
        \qquad \phi(z) = \mathrm{clip}(z, \gamma_l, \gamma_u)\ \text{(identity by default)}

    with ratio 1 where either norm is 0. Norms are floored at ``min_norm``.

    Args:
      min_norm: floor of both norms (optax's ``min_norm``).
      trust_coefficient: :math:`\tau` (LARS uses 0.001).
      eps: added to the update norm.
      phi_bounds: ``(γl, γu)`` to clip the parameter norm, as in the LAMB paper.
      mask: tree of booleans (or a function of the params); leaves where it is False (biases,
        norm scales) keep ratio 1.

    References:
      You et al., LAMB (arXiv 1904.00962); You, Gitman and Ginsburg, LARS (arXiv 1708.03888).
    """
    check_nonnegative("min_norm", min_norm)
    check_nonnegative("trust_coefficient", trust_coefficient)
    check_nonnegative("eps", eps)
    if phi_bounds is not None and not 0 <= phi_bounds[0] <= phi_bounds[1]:
        raise ValueError(f"phi_bounds must satisfy 0 <= low <= high, got {phi_bounds}.")

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        return EmptyState()

    def step(g: list[torch.Tensor], state: EmptyState, p: list[torch.Tensor],
             extra_args: dict[str, Any]) -> tuple[list[torch.Tensor], EmptyState]:
        spec = extra_args[LEAF_SPEC_KEY]
        keep = (leaf_labels(mask, as_tree(p, extra_args), "mask values") if mask is not None
                else [True] * len(g))
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in g) else torch.float32
        # (a) local sums of squares of params and updates; (b) one batched reduction
        p_sq = foreach_sum_of_squares(p, dtype)
        u_sq = foreach_sum_of_squares(g, dtype)
        n = len(g)
        none = [None] * n
        p_sq, u_sq = reduce_statistics((tree_unflatten(p_sq, spec), tree_unflatten(u_sq, spec)),
                                       extra_args, dims=(tree_unflatten(none, spec),
                                                         tree_unflatten(none, spec)))
        # (c) finish
        out = []
        for x, ps, us, k in zip(g, tree_flatten(p_sq)[0], tree_flatten(u_sq)[0], keep):
            if not k:
                out.append(x)
                continue
            p_norm = torch.clamp(torch.sqrt(ps), min=min_norm)
            u_norm = torch.clamp(torch.sqrt(us), min=min_norm)
            phi = p_norm if phi_bounds is None else torch.clamp(p_norm, *phi_bounds)
            ratio = trust_coefficient * phi / (u_norm + eps)
            ratio = torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)
            out.append(x * ratio.to(x.dtype))
        return out, state

    update = leafwise(EmptyState, step, needs_params="scale_by_trust_ratio",
                      name="scale_by_trust_ratio", check_shapes="params")
    return GradientTransformation(init, update, LEAFWISE)
