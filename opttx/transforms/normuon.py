"""NorMuon's neuron-wise normalization of an orthogonalized update (`scale_by_neuron_rms`)
and AdaMuon's rescaling to the norm of an orthogonal matrix (`scale_to_orthogonal_norm`).

Both follow `opttx.orthogonalize` in a chain (the aliases `opttx.normuon` and
`opttx.adamuon`); they read statistics of whole matrices (a row mean square, a Frobenius
norm of each matrix), taken through the reduction hook, so under `opttx.distributed` they
run where `orthogonalize` runs: on owner ranks, on each rank's own experts of an expert
stack, or on row- or column-shards (`orthogonalize`'s ``sharded_mode="gram"``), exactly.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .._checks import check_nonnegative, check_unit_interval
from ..base import (GradientTransformation, HyperRole, Params, Role, Traits, Updates,
                    check_init_params, declare, declare_roles, reduce_statistics,
                    replace_state, zero_count)
from ..skeleton import leafwise
from ..kernels import mark_scratch
from ..tree import MaskedNode, Static, state_dtype, tree_flatten, tree_paths, tree_unflatten
from .matrix_axes import (MatrixAxes, Split, check_axes_argument, check_split_argument,
                          leaf_matrix_axes, leaf_row_blocks, require_whole_matrices,
                          global_matrix_shapes, sharded_matrix_dims,
                          stateless_matrix_transform)

__all__ = ["ScaleByNeuronRmsState", "scale_by_neuron_rms", "scale_to_orthogonal_norm"]


def _reduce_some(values: dict[int, Any], dims: dict[int, tuple[int, ...]], n: int, spec: Any,
                 extra_args: dict[str, Any]) -> dict[int, Any]:
    """Sum the partial statistics ``values`` (leaf -> a tensor, or a tuple of tensors reduced
    together) over the groups sharding ``dims[leaf]``: one hook call for all of them."""
    if not values:
        return values
    width = max(len(v) if isinstance(v, tuple) else 1 for v in values.values())
    trees, dim_trees = [], []
    for k in range(width):
        parts: list[Any] = [MaskedNode()] * n
        where: list[Any] = [None] * n
        for i, v in values.items():
            parts[i] = v[k] if isinstance(v, tuple) else v
            where[i] = dims[i]
        trees.append(tree_unflatten(parts, spec))
        dim_trees.append(tree_unflatten(where, spec))
    out = reduce_statistics(tuple(trees), extra_args, "sum", tuple(dim_trees))
    flat = [spec.flatten_up_to(t) for t in out]
    return {i: (tuple(f[i] for f in flat) if isinstance(v, tuple) else flat[0][i])
            for i, v in values.items()}


class ScaleByNeuronRmsState(NamedTuple):
    """State of `scale_by_neuron_rms`."""
    count: torch.Tensor   # shape (), int32: steps taken
    nu: Updates           # per leaf, its shape with the column axis of size 1 (fp32 for 16-bit
    #                       leaves): EMA of the mean square of each row (neuron)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, nu=Role.FACTORED_MOMENT)


def _block_sums(x: torch.Tensor, axes: tuple[int, int], blocks: tuple[int, ...] | None
                ) -> torch.Tensor:
    """The local sum of squares of each matrix of ``x`` (each row block with ``blocks``),
    kept over the matrix axes (the row axis of the size of the number of blocks)."""
    sq = x * x
    if blocks is None:
        return sq.sum(dim=axes, keepdim=True)
    return torch.cat([b.sum(dim=axes, keepdim=True) for b in sq.split(list(blocks),
                                                                         dim=axes[0])],
                     dim=axes[0])


def _row_stat_shape(shape: torch.Size, axes: tuple[int, int]) -> list[int]:
    out = list(shape)
    out[axes[1]] = 1
    return out


@declare(hyperparams={"b2": HyperRole.B2, "eps": HyperRole.EPS})
def scale_by_neuron_rms(b2: float = 0.95, eps: float = 1e-8,
                        matrix_axes: MatrixAxes = (-2, -1), *, split: Split = None,
                        state_dtype_: torch.dtype | None = None) -> GradientTransformation:
    r"""NorMuon's normalization: divide each row (output neuron) of an orthogonalized update by
    the root of an EMA of its mean square, keeping the matrix's Frobenius norm.

    .. math::
        v_t = \beta_2 v_{t-1} + (1-\beta_2)\, \mathrm{mean}_j\, O_{t,ij}^2, \qquad
        \hat O_t = O_t / (\sqrt{v_t} + \epsilon), \qquad
        u_t = \hat O_t\, \lVert O_t \rVert_F / \max(\lVert \hat O_t \rVert_F, \epsilon)

    per matrix (rows over the first of ``matrix_axes``; the statistic :math:`v` has the
    leaf's shape with the column axis of size 1); with ``split`` (as in `orthogonalize`) the
    Frobenius norms are taken per row block, as for separate parameters. The EMA is written
    as ``lerp`` with weight :math:`1-\beta_2`, as the reference writes it. Statistics are
    float32 for 16-bit leaves; the update comes back in its own dtype.

    Args:
      b2: :math:`\beta_2` in [0, 1) (the ``dion`` package's ``muon_beta2``, default 0.95).
      eps: :math:`\epsilon`, in the denominator and the norm's floor (the reference's 1e-8).
      matrix_axes: the (row, column) axes, as in `orthogonalize`.
      split: row blocks with their own Frobenius norms.
      state_dtype_: dtype of :math:`v` (default: the leaf's, float32 for 16-bit leaves).

    Example:
      >>> tx = opttx.chain(opttx.trace(0.95), opttx.orthogonalize(method="polar_express"),
      ...                  opttx.scale_by_neuron_rms(0.95), opttx.scale_by_learning_rate(0.01))

    References:
      Li et al., NorMuon: Making Muon more efficient and scalable (arXiv 2510.05491);
      Microsoft's ``dion`` package, ``normuon.py``.
    """
    check_unit_interval("b2", b2)
    check_nonnegative("eps", eps)
    check_axes_argument(matrix_axes, "scale_by_neuron_rms")
    check_split_argument(split, "scale_by_neuron_rms")

    def init(params: Params) -> ScaleByNeuronRmsState:
        check_init_params(params)
        leaves, spec = tree_flatten(params)
        axes = leaf_matrix_axes(params, matrix_axes, "scale_by_neuron_rms")
        leaf_row_blocks(params, split, axes, "scale_by_neuron_rms")
        nu = [x if ax is None else torch.zeros(_row_stat_shape(x.shape, ax), device=x.device,
                                               dtype=state_dtype(x, state_dtype_))
              for x, ax in zip(leaves, axes)]
        return ScaleByNeuronRmsState(count=zero_count(params), nu=tree_unflatten(nu, spec))

    def step(g, state, params, extra_args):
        spec = extra_args["_spec"]
        updates = tree_unflatten(g, spec)
        axes = leaf_matrix_axes(updates, matrix_axes, "scale_by_neuron_rms")
        splits = leaf_row_blocks(updates, split, axes, "scale_by_neuron_rms")
        sharded = sharded_matrix_dims(g, spec, axes, extra_args)
        # row blocks need whole rows; otherwise the statistics are summed over the shards
        require_whole_matrices(updates, extra_args,
                               [ax if b is not None and ax[0] in d else None
                                for ax, b, d in zip(axes, splits, sharded)],
                               "scale_by_neuron_rms")
        nus = tree_flatten(state.nu)[0]
        paths = tree_paths(updates)
        if len(nus) != len(g):
            raise ValueError(f"scale_by_neuron_rms: the updates have {len(g)} leaves, the state "
                             f"{len(nus)}: pass the state made by init for these params.")
        for u, v, ax, path in zip(g, nus, axes, paths):
            if ax is not None and list(v.shape) != _row_stat_shape(u.shape, ax):
                raise ValueError(f"scale_by_neuron_rms: updates{path} has shape "
                                 f"{tuple(u.shape)}, but the state was made for rows of shape "
                                 f"{tuple(v.shape)}: pass the state made by init for these "
                                 "params.")
        ws = {i: u.to(v.dtype) for i, (u, v, ax) in enumerate(zip(g, nus, axes))
              if ax is not None}
        # the mean square of each row: summed over the column shards where split there
        by_cols = {i: (ws[i] * ws[i]).sum(dim=axes[i][1], keepdim=True) for i in ws
                   if axes[i][1] in sharded[i]}
        by_cols = _reduce_some(by_cols, {i: (axes[i][1],) for i in by_cols}, len(g), spec,
                               extra_args)
        shapes = global_matrix_shapes(g, spec, extra_args)
        normalized, new_nu = {}, list(nus)
        for i, w in ws.items():
            c = axes[i][1]
            neuron = (by_cols[i] / shapes[i][c] if i in by_cols
                      else (w * w).mean(dim=c, keepdim=True))
            new_nu[i] = torch.lerp(nus[i], neuron, 1 - b2)
            normalized[i] = w / (new_nu[i].sqrt() + eps)
        # the Frobenius norms of each matrix (or row block), before and after
        norms = {i: (_block_sums(ws[i], axes[i], splits[i]),
                     _block_sums(normalized[i], axes[i], splits[i]))
                 for i in ws if sharded[i]}
        norms = _reduce_some(norms, {i: axes[i] for i in norms}, len(g), spec, extra_args)
        out = list(g)
        for i, w in ws.items():
            ax, blocks, n = axes[i], splits[i], normalized[i]
            if i in norms:
                sw, sn = norms[i]
                ratio = sw.sqrt() / sn.sqrt().clamp(min=eps)
                if blocks is not None:
                    ratio = ratio.repeat_interleave(
                        torch.tensor(blocks, device=ratio.device), dim=ax[0],
                        output_size=sum(blocks))
                n = n * ratio
            elif blocks is None:
                ratio = (torch.linalg.vector_norm(w, dim=ax, keepdim=True)
                         / torch.linalg.vector_norm(n, dim=ax, keepdim=True).clamp(min=eps))
                n = n * ratio
            else:
                r = ax[0]
                parts = [nb * (torch.linalg.vector_norm(o, dim=ax, keepdim=True)
                               / torch.linalg.vector_norm(nb, dim=ax, keepdim=True).clamp(
                                   min=eps))
                         for o, nb in zip(w.split(list(blocks), dim=r),
                                          n.split(list(blocks), dim=r))]
                n = torch.cat(parts, dim=r)
            out[i] = n.to(g[i].dtype)
        mark_scratch([out[i] for i in ws])
        return out, replace_state(state, nu=tree_unflatten(new_nu, tree_flatten(state.nu)[1]))

    inner = leafwise(ScaleByNeuronRmsState, step)

    def update(updates: Updates, state: ScaleByNeuronRmsState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ScaleByNeuronRmsState]:
        return inner(updates, state, params, **extra_args, _spec=tree_flatten(updates)[1])

    return GradientTransformation(init, update, Traits(per_leaf=True))


@declare(hyperparams={"eps": HyperRole.EPS})
def scale_to_orthogonal_norm(eps: float = 1e-10, matrix_axes: MatrixAxes = (-2, -1)
                             ) -> GradientTransformation:
    r"""Rescale each matrix to the Frobenius norm of an orthogonal matrix of its shape.

    .. math::
        u \mapsto u\, \sqrt{\min(m, n)} / (\lVert u \rVert_F + \epsilon)

    (an :math:`m \times n` matrix with orthonormal rows or columns has
    :math:`\lVert \cdot \rVert_F = \sqrt{\min(m, n)}`). After an element-wise second moment
    of the orthogonalized update (AdaMuon) it restores Muon's scale; followed by
    ``scale_by_shape(consistent_rms=0.2)`` it is AdaMuon's RMS alignment
    :math:`0.2 \sqrt{mn}\, u / \lVert u \rVert_F` (an update RMS of 0.2, like Adam's).
    Stateless; on row- or column-shards (`opttx.distributed.sharded`) the norm is summed
    over the shards through the reduction hook.

    Args:
      eps: :math:`\epsilon` (``pytorch_optimizer.AdaMuon``'s default 1e-10).
      matrix_axes: as in `orthogonalize`.

    References:
      Si, Zhang and Shen, AdaMuon: Adaptive Muon Optimizer (arXiv 2507.11005).
    """
    check_nonnegative("eps", eps)
    check_axes_argument(matrix_axes, "scale_to_orthogonal_norm")

    def fn(leaves: list[torch.Tensor], axes: list, splits: list, shapes: list,
           extra_args: dict[str, Any] | None = None, spec: Any = None) -> list[torch.Tensor]:
        sharded = sharded_matrix_dims(leaves, spec, axes, extra_args or {})
        sums = _reduce_some({i: (x * x).sum(dim=axes[i], keepdim=True)
                             for i, (x, d) in enumerate(zip(leaves, sharded)) if d},
                            {i: axes[i] for i, d in enumerate(sharded) if d}, len(leaves), spec,
                            extra_args or {})
        out = list(leaves)
        for i, (x, ax) in enumerate(zip(leaves, axes)):
            if ax is None:
                continue
            k = math.sqrt(min(shapes[i][ax[0]], shapes[i][ax[1]]))
            norm = (sums[i].sqrt() if i in sums else
                    torch.linalg.vector_norm(x, dim=ax, keepdim=True))
            out[i] = x * (k / (norm + eps))
        mark_scratch([out[i] for i, ax in enumerate(axes) if ax is not None])
        return out

    return stateless_matrix_transform("scale_to_orthogonal_norm", fn, matrix_axes, None,
                                      on_shards=True)
