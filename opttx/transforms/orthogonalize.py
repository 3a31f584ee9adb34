"""Muon's pieces: `orthogonalize` (the quintic Newton–Schulz iteration, or the exact polar
factor by SVD) and `scale_by_shape` (the per-matrix step-size conventions of Muon).

Each leaf is read as a matrix over two axes (``matrix_axes``, default the last two), or as a
batch of matrices over its other axes (convolutions, stacked experts). Both transforms are
stateless and need whole matrices: under `opttx.distributed.sharded` run them with
``on_owners=True``, which gathers each matrix to one rank (an orthogonalization of the local
block would not be the orthogonalization of the matrix, so a sharded leaf is refused).

The alias `opttx.muon` composes them: Nesterov momentum (`opttx.ema`), `orthogonalize`,
`scale_by_shape`, decoupled weight decay and the learning rate on hidden matrices, AdamW on
the rest.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Sequence

import torch

from .._checks import check_nonnegative, check_positive_int, matrix_axes_of
from ..base import (EmptyState, GradientTransformation, Params, Traits, Updates, check_init_params,
                    declare, require_whole_leaves)
from ..kernels import foreach, mark_scratch
from ..tree import PyTree, leaf_labels, tree_flatten, tree_paths, tree_unflatten

__all__ = [
    "NS_COEFFS",
    "newton_schulz",
    "orthogonalize",
    "polar_factor",
    "scale_by_shape",
    "shape_factor",
]

NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton–Schulz coefficients :math:`(a, b, c)` (torch.optim.Muon's
and optax.contrib.muon's default)."""

Method = Literal["newton_schulz", "svd"]
MatrixAxes = tuple[int, int] | PyTree | Callable[[Params], PyTree]
Coefficients = tuple[float, float, float] | Sequence[tuple[float, float, float]]

_WHOLE_MATRICES = Traits(per_leaf=True, whole_leaves=True)


# ---------------------------------------------------------------------------------------------
# static layout
# ---------------------------------------------------------------------------------------------


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(a, int) for a in x)


def _check_axes_argument(matrix_axes: MatrixAxes, name: str) -> None:
    if isinstance(matrix_axes, tuple) and not _is_axes(matrix_axes) and \
            all(isinstance(a, int) for a in matrix_axes):
        raise ValueError(f"{name}: matrix_axes must be a pair of axes such as (-2, -1), got "
                         f"{matrix_axes!r}.")


def _matrix_axes_of(tree: PyTree, matrix_axes: MatrixAxes, name: str
                    ) -> list[tuple[int, int] | None]:
    """The (row, column) axes of every leaf of ``tree``, non-negative (None: leave the leaf
    unchanged, only where ``matrix_axes`` is given per leaf). Static: from shapes only."""
    leaves = tree_flatten(tree)[0]
    per_leaf = not _is_axes(matrix_axes)
    axes_of = (leaf_labels(matrix_axes, tree, "matrix_axes", is_leaf=_is_axes) if per_leaf
               else [matrix_axes] * len(leaves))
    out: list[tuple[int, int] | None] = []
    for i, (x, axes) in enumerate(zip(leaves, axes_of)):
        if axes is None and per_leaf:
            out.append(None)
            continue
        if x.dim() < 2:
            raise ValueError(
                f"{name}: updates{tree_paths(tree)[i]} has {x.dim()} dim(s), but it works on "
                "matrices (2 or more dims; more are a batch of matrices over matrix_axes). "
                "Route vectors and scalars to another transform: opttx.muon sends them to "
                "AdamW; otherwise use opttx.masked(..., lambda p: opttx.tree.tree_map("
                "lambda x: x.ndim >= 2, p)) or opttx.partition.")
        if not _is_axes(axes):
            raise ValueError(f"{name}: matrix_axes for updates{tree_paths(tree)[i]} is "
                             f"{axes!r}; give a pair of axes such as (-2, -1), or None to leave "
                             "the leaf unchanged.")
        out.append(matrix_axes_of(axes, x.shape, f"{name}, updates{tree_paths(tree)[i]}"))
    return out


def _stateless(name: str, fn: Callable[[list[torch.Tensor], list], list[torch.Tensor]],
               matrix_axes: MatrixAxes) -> GradientTransformation:
    """A stateless whole-matrix transform from ``fn(leaves, axes) -> leaves``; the leaves are
    checked (dims, axes) at init and at every update (while tracing, in a compiled step)."""

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        _matrix_axes_of(params, matrix_axes, name)
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EmptyState]:
        leaves, spec = tree_flatten(updates)
        if not leaves:
            return updates, state
        require_whole_leaves(updates, extra_args, name)
        axes = _matrix_axes_of(updates, matrix_axes, name)
        return tree_unflatten(fn(leaves, axes), spec), state

    return GradientTransformation(init, update, _WHOLE_MATRICES)


# ---------------------------------------------------------------------------------------------
# orthogonalization
# ---------------------------------------------------------------------------------------------


def _coefficient_steps(ns_coeffs: Coefficients, ns_steps: int) -> tuple[tuple[float, ...], ...]:
    """One (a, b, c) per Newton–Schulz step."""
    def triple(x: Any) -> bool:
        return (isinstance(x, (tuple, list)) and len(x) == 3
                and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in x))

    if triple(ns_coeffs):
        check_positive_int("ns_steps", ns_steps)
        steps = (tuple(float(c) for c in ns_coeffs),) * ns_steps
    elif isinstance(ns_coeffs, (tuple, list)) and ns_coeffs and all(map(triple, ns_coeffs)):
        steps = tuple(tuple(float(c) for c in t) for t in ns_coeffs)
    else:
        raise ValueError("ns_coeffs must be three numbers (a, b, c), or a sequence of such "
                         f"triples (one per step), got {ns_coeffs!r}.")
    for t in steps:
        if not all(math.isfinite(c) for c in t):
            raise ValueError(f"ns_coeffs must be finite, got {t}.")
    return steps


def newton_schulz(x: torch.Tensor, coefficients: Sequence[tuple[float, float, float]],
                  eps: float = 1e-7, dtype: torch.dtype | None = None) -> torch.Tensor:
    r"""The quintic Newton–Schulz iteration on the matrices in the last two dims of ``x``.

    .. math::
        X_0 = G / (\lVert G \rVert_F + \epsilon), \qquad
        A_k = X_k X_k^\top, \qquad X_{k+1} = a X_k + (b A_k + c A_k^2) X_k

    on the wide orientation (a tall matrix is transposed first and back after, so
    :math:`A_k` is the smaller Gram matrix), one :math:`(a, b, c)` per step. Each step maps
    the singular values by :math:`p(s) = a s + b s^3 + c s^5` and keeps the singular vectors,
    so :math:`X_K = U p^{(K)}(\Sigma / \lVert G \rVert_F) V^\top`: with `NS_COEFFS` and five
    steps the singular values of the result lie in about [0.7, 1.2] (not exactly 1: the
    coefficients buy speed at the cost of exactness, see `orthogonalize`). Written with
    ``addmm``/``baddbmm`` as torch.optim.Muon writes it: with ``dtype=torch.bfloat16`` its
    numbers bit for bit on a 2-D matrix in eager mode (Inductor computes fused bfloat16
    element-wise work in float32, so a compiled step agrees to bfloat16's resolution).

    Args:
      x: a tensor of 2 or more dims.
      coefficients: the :math:`(a, b, c)` of each step.
      eps: added to the Frobenius norm.
      dtype: the dtype the iteration runs in (default ``x``'s); the result has ``x``'s.
    """
    y = x if dtype is None or x.dtype == dtype else x.to(dtype)
    transposed = y.shape[-2] > y.shape[-1]
    if transposed:
        y = y.mT
    if y.dim() == 2:
        y = y / (y.norm() + eps)
        for a, b, c in coefficients:
            gram = y @ y.mT
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.addmm(y, poly, y, beta=a)
    else:
        batch = y.shape[:-2]
        y = y.reshape(-1, *y.shape[-2:])
        y = y / (torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True) + eps)
        for a, b, c in coefficients:
            gram = y @ y.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.baddbmm(y, poly, y, beta=a)
        y = y.reshape(*batch, *y.shape[-2:])
    if transposed:
        y = y.mT
    return y.to(x.dtype)


def polar_factor(x: torch.Tensor) -> torch.Tensor:
    r"""The orthogonal polar factor :math:`U V^\top` of the matrices in the last two dims of
    ``x`` (:math:`G = U \Sigma V^\top`, thin SVD), computed in float32 for 16-bit inputs.
    Directions of singular values below the numerical rank tolerance
    (:math:`\max(m, n)\, \epsilon_{mach}\, \sigma_{max}`) map to 0, as the Newton–Schulz
    iteration maps them (a zero matrix stays zero)."""
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    tol = s.amax(dim=-1, keepdim=True) * (max(x.shape[-2:]) * torch.finfo(work.dtype).eps)
    keep = (s > tol).to(work.dtype)
    return ((u * keep.unsqueeze(-2)) @ vh).to(x.dtype)


def _to_last_two(x: torch.Tensor, axes: tuple[int, int]) -> torch.Tensor:
    if axes == (x.dim() - 2, x.dim() - 1):
        return x
    return torch.movedim(x, axes, (-2, -1))


def _from_last_two(y: torch.Tensor, axes: tuple[int, int]) -> torch.Tensor:
    if axes == (y.dim() - 2, y.dim() - 1):
        return y
    return torch.movedim(y, (-2, -1), axes)


@declare(hyperparams={"eps": None}, runtime=("ns_steps", "ns_coeffs"))
def orthogonalize(ns_steps: int = 5, ns_coeffs: Coefficients = NS_COEFFS, eps: float = 1e-7,
                  method: Method = "newton_schulz", matrix_axes: MatrixAxes = (-2, -1), *,
                  ns_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Replace each matrix of the updates by (an approximation of) its orthogonal polar
    factor: Muon's step direction.

    .. math::
        G = U \Sigma V^\top \ \mapsto\ U V^\top \quad(\texttt{method="svd"}), \qquad
        G \mapsto U\, p^{(K)}\!\left(\Sigma / (\lVert G \rVert_F + \epsilon)\right) V^\top
        \quad(\texttt{"newton\_schulz"})

    where :math:`p(s) = a s + b s^3 + c s^5` is applied :math:`K` = ``ns_steps`` times
    (`newton_schulz`). The default coefficients (`NS_COEFFS`) make :math:`p` steep at 0, so
    five steps push every non-negligible singular value into about [0.7, 1.2] rather than
    converging to 1: the steepest-descent direction under the spectral norm, up to that
    spread. ``method="svd"`` is the exact polar factor, the reference.

    A leaf with more than two dims is a batch of matrices over ``matrix_axes`` (its other
    axes are the batch: conv kernels, stacked MoE experts), each orthogonalized on its own.
    Leaves with fewer than two dims are refused (the alias `opttx.muon` sends them to
    AdamW). Stateless (`EmptyState`); it needs whole matrices (``Traits.whole_leaves``).

    Args:
      ns_steps: the number of Newton–Schulz steps :math:`K` (>= 1).
      ns_coeffs: :math:`(a, b, c)`, or a sequence of such triples, one per step (then
        ``ns_steps`` is their number).
      eps: added to the Frobenius norm before dividing (torch.optim.Muon's default 1e-7;
        optax's 1e-8).
      method: ``"newton_schulz"`` or ``"svd"``.
      matrix_axes: the (row, column) axes of the matrix, for every leaf; or a tree like the
        params (or a function of them) holding a pair per leaf, None leaving that leaf
        unchanged.
      ns_dtype: the dtype the iteration runs in (default: the update's).
        ``torch.bfloat16`` is torch.optim.Muon's (and Keller Jordan's) choice, and gives
        their numbers; the result always comes back in the update's dtype.

    Returns:
      A `GradientTransformation`.

    Example:
      >>> tx = opttx.chain(opttx.ema(0.95, debias=False, nesterov=True), opttx.orthogonalize(),
      ...                  opttx.scale_by_shape(), opttx.scale_by_learning_rate(0.02))

    References:
      Jordan et al., Muon: An optimizer for hidden layers in neural networks (2024),
      https://kellerjordan.github.io/posts/muon/; Bernstein and Newhouse, Old Optimizer,
      New Norm: An Anthology (arXiv 2409.20325).
    """
    steps = _coefficient_steps(ns_coeffs, ns_steps)
    check_nonnegative("eps", eps)
    if method not in ("newton_schulz", "svd"):
        raise ValueError(f"method must be 'newton_schulz' or 'svd', got {method!r}.")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype)
                                     and ns_dtype.is_floating_point):
        raise ValueError(f"ns_dtype must be a floating-point torch.dtype or None, got "
                         f"{ns_dtype!r}.")
    _check_axes_argument(matrix_axes, "orthogonalize")

    def one(x: torch.Tensor) -> torch.Tensor:
        if method == "svd":
            return polar_factor(x)
        return newton_schulz(x, steps, eps, ns_dtype)

    def fn(leaves: list[torch.Tensor], axes: list) -> list[torch.Tensor]:
        out = [x if ax is None else _from_last_two(one(_to_last_two(x, ax)), ax)
               for x, ax in zip(leaves, axes)]
        mark_scratch([y for y, ax in zip(out, axes) if ax is not None])   # fresh tensors
        return out

    return _stateless("orthogonalize", fn, matrix_axes)


# ---------------------------------------------------------------------------------------------
# shape scaling
# ---------------------------------------------------------------------------------------------


def shape_factor(rows: int, cols: int, consistent_rms: float | None = None) -> float:
    r"""Muon's step-size factor of a ``rows`` × ``cols`` matrix: :math:`\sqrt{\max(1,
    \text{rows}/\text{cols})}` (``consistent_rms`` None), else
    :math:`\text{consistent\_rms} \cdot \sqrt{\max(\text{rows}, \text{cols})}`."""
    if consistent_rms is None:
        return math.sqrt(max(1.0, rows / cols))
    return consistent_rms * math.sqrt(max(rows, cols))


@declare(hyperparams={"consistent_rms": None})
def scale_by_shape(consistent_rms: float | None = None,
                   matrix_axes: MatrixAxes = (-2, -1)) -> GradientTransformation:
    r"""Scale each matrix's update by a factor of its shape (Muon's step-size conventions).

    .. math::
        u \mapsto \sqrt{\max(1, m/n)}\; u \quad(\texttt{consistent\_rms=None}), \qquad
        u \mapsto \gamma \sqrt{\max(m, n)}\; u \quad(\texttt{consistent\_rms} = \gamma)

    for an :math:`m \times n` matrix (rows over the first of ``matrix_axes``). Rows are the
    fan-out: torch's ``nn.Linear.weight`` is (out, in), so the default axes ``(-2, -1)``
    give Keller Jordan's width scaling :math:`\sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}`;
    for (in, out) layouts (JAX, optax) pass ``matrix_axes=(-1, -2)``.

    * ``torch.optim.Muon(adjust_lr_fn="original")`` (its default): ``consistent_rms=None``;
    * ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` and Moonlight's
      :math:`0.2\sqrt{\max(m, n)}` (an update RMS like AdamW's, so AdamW's learning rate and
      weight decay carry over): ``consistent_rms=0.2``;
    * ``optax.contrib.scale_by_shape(consistent_rms=...)``: the same argument, with optax's
      (in, out) layout as above.

    Batched leaves (more than two dims) take the factor of their matrices. Stateless; it
    reads the matrix shape, so it needs whole leaves as `orthogonalize` does.

    Args:
      consistent_rms: :math:`\gamma`, or None for the width scaling.
      matrix_axes: as in `orthogonalize`.

    Example:
      >>> tx = opttx.chain(opttx.orthogonalize(), opttx.scale_by_shape(consistent_rms=0.2))

    References:
      Jordan et al., Muon (2024); Liu et al., Muon is Scalable for LLM Training
      (arXiv 2502.16982).
    """
    if consistent_rms is not None:
        check_nonnegative("consistent_rms", consistent_rms)
    _check_axes_argument(matrix_axes, "scale_by_shape")
    static = consistent_rms is None or isinstance(consistent_rms, (int, float))

    def fn(leaves: list[torch.Tensor], axes: list) -> list[torch.Tensor]:
        idx = [i for i, ax in enumerate(axes) if ax is not None]
        if not idx:
            return leaves
        scaled = [leaves[i] for i in idx]
        shapes = [(leaves[i].shape[axes[i][0]], leaves[i].shape[axes[i][1]]) for i in idx]
        if static:
            factors = [shape_factor(m, n, consistent_rms) for m, n in shapes]
            scaled = foreach("mul", scaled, factors)
        else:       # an injected 0-dim tensor: the shape part, then the tensor
            scaled = foreach("mul", foreach("mul", scaled, [math.sqrt(max(m, n))
                                                            for m, n in shapes]),
                             consistent_rms)
        out = list(leaves)
        for i, y in zip(idx, mark_scratch(scaled)):
            out[i] = y
        return out

    return _stateless("scale_by_shape", fn, matrix_axes)
