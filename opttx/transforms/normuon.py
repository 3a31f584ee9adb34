"""NorMuon's neuron-wise normalization of an orthogonalized update (`scale_by_neuron_rms`)
and AdaMuon's rescaling to the norm of an orthogonal matrix (`scale_to_orthogonal_norm`).

Both follow `opttx.orthogonalize` in a chain (the aliases `opttx.normuon` and
`opttx.adamuon`); both read whole matrices (a row statistic, a Frobenius norm of each
matrix), so under `opttx.distributed` they run where `orthogonalize` runs: on owner ranks, or
on each rank's own experts of an expert stack.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .._checks import check_nonnegative, check_unit_interval
from ..base import (GradientTransformation, HyperRole, Params, Role, Traits, Updates,
                    check_init_params, declare, declare_roles, replace_state, zero_count)
from ..skeleton import leafwise
from ..kernels import mark_scratch
from ..tree import Static, state_dtype, tree_flatten, tree_paths, tree_unflatten
from .matrix_axes import (MatrixAxes, Split, check_axes_argument, check_split_argument,
                          leaf_matrix_axes, leaf_row_blocks, require_whole_matrices,
                          stateless_matrix_transform)

__all__ = ["ScaleByNeuronRmsState", "scale_by_neuron_rms", "scale_to_orthogonal_norm"]

_WHOLE_MATRICES = Traits(per_leaf=True, whole_leaves=True)


class ScaleByNeuronRmsState(NamedTuple):
    """State of `scale_by_neuron_rms`."""
    count: torch.Tensor   # shape (), int32: steps taken
    nu: Updates           # per leaf, its shape with the column axis of size 1 (fp32 for 16-bit
    #                       leaves): EMA of the mean square of each row (neuron)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, nu=Role.FACTORED_MOMENT)


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
        require_whole_matrices(updates, extra_args, axes, "scale_by_neuron_rms")
        splits = leaf_row_blocks(updates, split, axes, "scale_by_neuron_rms")
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
        out, new_nu = [], []
        for u, v, ax, blocks in zip(g, nus, axes, splits):
            if ax is None:
                out.append(u)
                new_nu.append(v)
                continue
            r, c = ax
            w = u.to(v.dtype)
            neuron = (w * w).mean(dim=c, keepdim=True)
            v = torch.lerp(v, neuron, 1 - b2)
            normalized = w / (v.sqrt() + eps)
            if blocks is None:
                ratio = (torch.linalg.vector_norm(w, dim=ax, keepdim=True)
                         / torch.linalg.vector_norm(normalized, dim=ax,
                                                    keepdim=True).clamp(min=eps))
                normalized = normalized * ratio
            else:
                parts = [n * (torch.linalg.vector_norm(o, dim=ax, keepdim=True)
                              / torch.linalg.vector_norm(n, dim=ax, keepdim=True).clamp(min=eps))
                         for o, n in zip(w.split(list(blocks), dim=r),
                                         normalized.split(list(blocks), dim=r))]
                normalized = torch.cat(parts, dim=r)
            out.append(normalized.to(u.dtype))
            new_nu.append(v)
        mark_scratch([y for y, ax in zip(out, axes) if ax is not None])
        return out, replace_state(state, nu=tree_unflatten(new_nu, tree_flatten(state.nu)[1]))

    inner = leafwise(ScaleByNeuronRmsState, step)

    def update(updates: Updates, state: ScaleByNeuronRmsState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ScaleByNeuronRmsState]:
        return inner(updates, state, params, **extra_args, _spec=tree_flatten(updates)[1])

    return GradientTransformation(init, update, _WHOLE_MATRICES)


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
    Stateless; needs whole matrices.

    Args:
      eps: :math:`\epsilon` (``pytorch_optimizer.AdaMuon``'s default 1e-10).
      matrix_axes: as in `orthogonalize`.

    References:
      Si, Zhang and Shen, AdaMuon: Adaptive Muon Optimizer (arXiv 2507.11005).
    """
    check_nonnegative("eps", eps)
    check_axes_argument(matrix_axes, "scale_to_orthogonal_norm")

    def fn(leaves: list[torch.Tensor], axes: list, splits: list, shapes: list
           ) -> list[torch.Tensor]:
        out = list(leaves)
        for i, (x, ax) in enumerate(zip(leaves, axes)):
            if ax is None:
                continue
            k = math.sqrt(min(x.shape[ax[0]], x.shape[ax[1]]))
            out[i] = x * (k / (torch.linalg.vector_norm(x, dim=ax, keepdim=True) + eps))
        mark_scratch([out[i] for i, ax in enumerate(axes) if ax is not None])
        return out

    return stateless_matrix_transform("scale_to_orthogonal_norm", fn, matrix_axes, None)
