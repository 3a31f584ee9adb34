"""Muon's pieces: `orthogonalize` (Newton–Schulz, Polar Express, Gram Newton–Schulz, or the
exact polar factor by SVD) and `scale_by_shape` (the per-matrix step-size conventions).

Each leaf is read as a matrix over two axes (``matrix_axes``, default the last two), or as a
batch of matrices over its other axes (convolutions, stacked experts), optionally cut into
row blocks (``split``: the heads of an attention projection, the Q, K and V of a fused one).
All matrices of one shape and dtype, across leaves, blocks and batch axes, go through one
batched product per iteration step. Both transforms are stateless. `orthogonalize` needs whole
matrices by default: under `opttx.distributed.sharded` run it with ``on_owners=True``, which
gathers each matrix to one rank (an orthogonalization of the local block would not be the
orthogonalization of the matrix, so a leaf sharded over its matrix axes is refused; one
sharded over a batch axis only, an expert stack under expert parallelism, runs where it is),
or with ``sharded_mode="gram"``/``"auto"``, which runs row- or column-sharded matrices on
their shards with the Gram matrix of the unsharded side all-reduced: see `orthogonalize`.

The alias `opttx.muon` composes them: Nesterov momentum (`opttx.ema`), `orthogonalize`,
`scale_by_shape`, decoupled weight decay and the learning rate on hidden matrices, AdamW on
the rest.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Sequence

import torch

from .._checks import check_nonnegative, check_positive, check_positive_int
from ..base import GradientTransformation, declare, reduce_statistics
from ..kernels import foreach, mark_scratch
from ..tree import MaskedNode, tree_unflatten
from .matrix_axes import (MatrixAxes, Split, check_axes_argument, check_split_argument,
                          from_last_two, in_layout_of, sharded_matrix_dims,
                          stateless_matrix_transform, to_last_two)

__all__ = [
    "NS_COEFFS",
    "POLAR_EXPRESS_COEFFS",
    "POLAR_EXPRESS_SAFETY",
    "gram_newton_schulz",
    "newton_schulz",
    "normalize_frobenius",
    "orthogonalize",
    "polar_factor",
    "scale_by_shape",
    "shape_factor",
]

NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton–Schulz coefficients :math:`(a, b, c)` (torch.optim.Muon's
and optax.contrib.muon's default)."""

POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
"""Polar Express's five per-step coefficients :math:`(a_k, b_k, c_k)` (Amsel et al. 2025,
computed for 5 steps with safety factor 2e-2 and cushion 2; the values of Microsoft's
``dion`` package and of Keller Jordan's and Karpathy's code). They assume singular values
at most 1 after dividing by :math:`1.02 \\lVert G \\rVert_F` (`POLAR_EXPRESS_SAFETY`)."""

POLAR_EXPRESS_SAFETY = 1.02
"""The factor on the Frobenius norm that `POLAR_EXPRESS_COEFFS` are computed for."""

Method = Literal["newton_schulz", "polar_express", "gram_newton_schulz", "svd"]
_METHODS = ("newton_schulz", "polar_express", "gram_newton_schulz", "svd")
ShardedMode = Literal["owners", "gram", "auto"]
_SHARDED_MODES = ("owners", "gram", "auto")
Coefficients = tuple[float, float, float] | Sequence[tuple[float, float, float]]


# ---------------------------------------------------------------------------------------------
# static layout (the matrix axes, row splits and checks: `opttx.transforms.matrix_axes`)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# the iterations
# ---------------------------------------------------------------------------------------------


def coefficient_steps(ns_coeffs: Coefficients, ns_steps: int) -> tuple[tuple[float, ...], ...]:
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


def _power_of_two_floor(a: torch.Tensor) -> torch.Tensor:
    """:math:`2^{\\lfloor \\log_2 a \\rfloor}` of every element (its exponent bits), 1 where
    ``a`` is 0, subnormal or not finite; float64 for float64 input, else float32."""
    if a.dtype == torch.float64:
        p = (a.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)
    else:
        p = (a.float().view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where((p > 0) & torch.isfinite(p), p, torch.ones_like(p))


def normalize_frobenius(x: torch.Tensor, eps: float = 1e-7, scale: float = 1.0
                        ) -> torch.Tensor:
    r""":math:`X / (s \lVert X \rVert_F + \epsilon)` for the matrices in the last two dims of
    ``x``, without overflow for any finite ``x``.

    The norm is taken of :math:`X / 2^e` with :math:`2^e` the power of two at or below
    :math:`\max |X|` (an exact scaling), and :math:`\epsilon / 2^e` is added to it, so the
    quotient is the same number as the naive formula whenever that one does not overflow (bit
    for bit: scaling by a power of two commutes with rounding), and stays finite where
    :math:`\sum X^2` would overflow (a gradient of 1e30 in float32). The sum with
    :math:`\epsilon` is rounded once in float32 for 16-bit input, as torch's ``norm + eps``.
    """
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    p = _power_of_two_floor(amax)
    scaled = x / p.to(x.dtype)
    n = torch.linalg.vector_norm(scaled, dim=(-2, -1), keepdim=True)
    denom = scale * n.to(p.dtype) + eps / p
    return scaled / denom.to(x.dtype)


def _polynomial(gram: torch.Tensor, b: float, c: float) -> torch.Tensor:
    """:math:`b A + c A^2`."""
    if gram.dim() == 2:
        return torch.addmm(gram, gram, gram, beta=b, alpha=c)
    return torch.baddbmm(gram, gram, gram, beta=b, alpha=c)


def _gram_of(y: torch.Tensor, wide: bool) -> torch.Tensor:
    """:math:`Y Y^\\top` (``wide``: the Gram matrix of the rows) or :math:`Y^\\top Y`."""
    return y @ y.mT if wide else y.mT @ y


def _ns_step(y: torch.Tensor, gram: torch.Tensor, coefficient: tuple[float, ...], wide: bool
             ) -> torch.Tensor:
    """One Newton–Schulz step from the iterate ``y`` and its Gram matrix (of the rows when
    ``wide``, else of the columns): :math:`a Y + (bA + cA^2) Y` or :math:`a Y + Y (bA + cA^2)`."""
    a, b, c = coefficient
    poly = _polynomial(gram, b, c)
    mm = torch.addmm if y.dim() == 2 else torch.baddbmm
    return mm(y, poly, y, beta=a) if wide else mm(y, y, poly, beta=a)


def _gram_segment(y: torch.Tensor, gram: torch.Tensor,
                  coefficients: Sequence[tuple[float, float, float]], wide: bool
                  ) -> torch.Tensor:
    """Gram Newton–Schulz steps from the iterate ``y`` and its Gram matrix, up to the next
    restart: with :math:`Z_k = a_k I + b_k A_k + c_k A_k^2`, :math:`Q = Z_{K-1} \\cdots Z_0`
    and :math:`A_{k+1} = Z_k A_k Z_k` on the small Gram matrix, then :math:`Q Y` (``wide``) or
    :math:`Y Q` once on the long side."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    q = None
    last = len(coefficients) - 1
    for i, (a, b, c) in enumerate(coefficients):
        z = _polynomial(gram, b, c) + a * eye
        q = z if q is None else (z @ q if wide else q @ z)
        if i < last:
            gram = z @ gram @ z
    return q @ y if wide else y @ q


def _segments(n: int, restarts: Sequence[int]) -> list[tuple[int, int]]:
    """The step ranges between restarts (a restart at step 0 or past the end does nothing)."""
    starts = [0] + sorted({r for r in restarts if 0 < r < n})
    return list(zip(starts, starts[1:] + [n]))


def _ns_steps(y: torch.Tensor, coefficients: Sequence[tuple[float, float, float]]
              ) -> torch.Tensor:
    """The Newton–Schulz steps on normalized matrices (2-D or 3-D), on the Gram matrix of
    the smaller side, keeping the input's orientation (no transposed views)."""
    wide = y.shape[-2] <= y.shape[-1]
    for coefficient in coefficients:
        y = _ns_step(y, _gram_of(y, wide), coefficient, wide)
    return y


def _gram_steps(y: torch.Tensor, coefficients: Sequence[tuple[float, float, float]],
                restarts: Sequence[int]) -> torch.Tensor:
    """Gram Newton–Schulz: the same iterates as `_ns_steps`, computed on the small Gram
    matrix. With :math:`Z_k = a_k I + b_k A_k + c_k A_k^2` (wide case), :math:`X_{k+1} = Z_k
    X_k`, so :math:`X_K = (Z_{K-1} \\cdots Z_0) X_0` and :math:`A_{k+1} = Z_k A_k Z_k`: only
    the last product touches the long side. At a restart step the product is applied and
    the Gram matrix recomputed from the iterate (rounding in the products of small matrices
    accumulates otherwise)."""
    wide = y.shape[-2] <= y.shape[-1]
    for start, end in _segments(len(coefficients), restarts):
        y = _gram_segment(y, _gram_of(y, wide), coefficients[start:end], wide)
    return y


def _flat_batch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    if x.dim() <= 3:
        return x, x.shape
    return x.reshape(-1, *x.shape[-2:]), x.shape


def newton_schulz(x: torch.Tensor, coefficients: Sequence[tuple[float, float, float]],
                  eps: float = 1e-7, dtype: torch.dtype | None = None, *,
                  norm_scale: float = 1.0) -> torch.Tensor:
    r"""The quintic Newton–Schulz iteration on the matrices in the last two dims of ``x``.

    .. math::
        X_0 = G / (s \lVert G \rVert_F + \epsilon), \qquad
        A_k = X_k X_k^\top, \qquad X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2) X_k

    on a wide matrix; a tall one iterates :math:`X_{k+1} = a_k X_k + X_k (b_k A_k + c_k
    A_k^2)` with :math:`A_k = X_k^\top X_k`, the same numbers as transposing, iterating and
    transposing back, with a result laid out as the input. Each step maps the singular values
    by :math:`p_k(s) = a_k s + b_k s^3 + c_k s^5` and keeps the singular vectors: with
    `NS_COEFFS` and five steps the singular values of the result lie in about [0.7, 1.2]; with
    `POLAR_EXPRESS_COEFFS` (and ``norm_scale`` 1.02) closer to 1. The norm never overflows
    (`normalize_frobenius`). Written with ``addmm``/``baddbmm`` as torch.optim.Muon writes it:
    with ``dtype=torch.bfloat16`` its numbers bit for bit on a 2-D matrix in eager mode
    (Inductor computes fused bfloat16 element-wise work in float32, so a compiled step agrees
    to bfloat16's resolution).

    Args:
      x: a tensor of 2 or more dims.
      coefficients: the :math:`(a_k, b_k, c_k)` of each step.
      eps: :math:`\epsilon`, added to the scaled Frobenius norm.
      dtype: the dtype the iteration runs in (default ``x``'s); the result has ``x``'s.
      norm_scale: :math:`s` (`POLAR_EXPRESS_SAFETY` for Polar Express).
    """
    y = x if dtype is None or x.dtype == dtype else x.to(dtype)
    y, shape = _flat_batch(y)
    y = _ns_steps(normalize_frobenius(y, eps, norm_scale), coefficients)
    return y.reshape(shape).to(x.dtype)


def gram_newton_schulz(x: torch.Tensor, coefficients: Sequence[tuple[float, float, float]],
                       eps: float = 1e-7, dtype: torch.dtype | None = None, *,
                       norm_scale: float = 1.0, restarts: Sequence[int] = (2,)
                       ) -> torch.Tensor:
    r"""`newton_schulz` computed on the Gram matrix of the smaller side (Gram Newton–Schulz).

    For a wide :math:`m \times n` matrix (:math:`m \le n`), with :math:`R_0 = X_0 X_0^\top`:

    .. math::
        Z_k = a_k I + b_k R_k + c_k R_k^2, \quad Q_{k+1} = Z_k Q_k, \quad
        R_{k+1} = Z_k R_k Z_k, \qquad X_K = Q_K X_0

    (every :math:`Z_k` is a polynomial of :math:`R_0`, so this is the Newton–Schulz iterate
    exactly, in exact arithmetic). A step costs :math:`4 m^3` flops instead of
    :math:`2 m^2 n + m^3`, plus :math:`2 m^2 n` once at each end: faster when :math:`n` is
    well above :math:`m` (MLP matrices, fused QKV), slower for square ones. At each step
    index in ``restarts`` (0-based) the accumulated :math:`Q` is applied and :math:`R`
    recomputed from the iterate, which bounds the rounding that the products of small
    matrices accumulate (the Dao AI Lab implementation restarts before step 2 of 5).

    Args:
      x, coefficients, eps, dtype, norm_scale: as in `newton_schulz`.
      restarts: step indices at which to restart from the iterate.

    References:
      Zhang, Amsel, Chen and Dao, Gram Newton–Schulz (2026),
      https://dao-ailab.github.io/blog/2026/gram-newton-schulz/.
    """
    y = x if dtype is None or x.dtype == dtype else x.to(dtype)
    y, shape = _flat_batch(y)
    y = _gram_steps(normalize_frobenius(y, eps, norm_scale), coefficients, tuple(restarts))
    return y.reshape(shape).to(x.dtype)


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


# ---------------------------------------------------------------------------------------------
# orthogonalize: matrices grouped by shape, one batched iteration per group
# ---------------------------------------------------------------------------------------------


def _pieces(x: torch.Tensor, axes: tuple[int, int], blocks: tuple[int, ...] | None
            ) -> list[torch.Tensor]:
    """The matrices of leaf ``x`` as 3-D batches: one per distinct block (all, when
    ``blocks`` is None or equal blocks)."""
    m = to_last_two(x, axes)
    batch = m.reshape(math.prod(m.shape[:-2]), *m.shape[-2:])   # explicit: a shard may be empty
    if blocks is None:
        return [batch]
    if len(set(blocks)) == 1:        # equal blocks: one batch of heads
        return [batch.reshape(batch.shape[0] * len(blocks), blocks[0], batch.shape[-1])]
    return list(batch.split(list(blocks), dim=1))


def _assemble(x: torch.Tensor, axes: tuple[int, int], blocks: tuple[int, ...] | None,
              outs: list[torch.Tensor]) -> torch.Tensor:
    m_shape = to_last_two(x, axes).shape
    if blocks is None or len(set(blocks)) == 1:
        y = outs[0]
    else:
        y = torch.cat(outs, dim=1)
    return in_layout_of(from_last_two(y.reshape(m_shape), axes), x)


def _refuse_shards(i: int, ax: tuple[int, int], dims: tuple[int, ...], why: str) -> None:
    raise ValueError(
        f"orthogonalize needs whole matrices here, but leaf {i} is sharded over its matrix "
        f"axis {dims[0] if len(dims) == 1 else dims} of {ax}: {why} Run it on owner ranks "
        "(opttx.distributed.sharded(tx, specs, on_owners=True), or on_owners(tx) for these "
        "leaves inside opttx.partition), or shard such leaves over a batch axis (experts).")


def _gram_choice(mode: str, method: str, i: int, ax: tuple[int, int],
                 dims: tuple[int, ...], shape: tuple[int, ...],
                 blocks: tuple[int, ...] | None) -> bool:
    """Whether leaf ``i``, sharded over the matrix axes ``dims``, is orthogonalized on its
    shards with the Gram matrix all-reduced (else refused: see `orthogonalize`)."""
    if mode == "owners":
        _refuse_shards(i, ax, dims, "orthogonalizing the local block would be another "
                       "optimizer (sharded_mode='gram' or 'auto' all-reduce its Gram matrix).")
    if len(dims) == 2:
        _refuse_shards(i, ax, dims, "it is sharded over both, so no Gram matrix is a sum "
                       "over its shards.")
    if method == "svd":
        _refuse_shards(i, ax, dims, "method='svd' takes a whole matrix (the iterations run "
                       "on shards).")
    rows_sharded = dims[0] == ax[0]
    if rows_sharded and blocks is not None:
        _refuse_shards(i, ax, dims, "its split row blocks need whole rows.")
    gram_side = shape[ax[1]] if rows_sharded else max(blocks or (shape[ax[0]],))
    if mode == "auto" and gram_side > shape[dims[0]]:
        _refuse_shards(i, ax, dims, f"sharded_mode='auto' leaves it to owners, its Gram "
                       f"matrix ({gram_side} x {gram_side}, the unsharded side) being larger "
                       f"than the matrix (sharded side {shape[dims[0]]}); "
                       "sharded_mode='gram' would all-reduce it anyway.")
    return True


def _orthogonalize_shards(leaves: dict[int, torch.Tensor], axes: list, splits: list,
                          dims: dict[int, int], n_leaves: int, spec: Any,
                          extra_args: dict[str, Any],
                          coefficients: Sequence[tuple[float, float, float]],
                          segments: list[tuple[int, int]], gram_form: bool, eps: float,
                          norm_scale: float, dtype: torch.dtype | None
                          ) -> dict[int, torch.Tensor]:
    r"""`orthogonalize` of row- or column-sharded leaves on their local shards (Gram mode).

    A leaf sharded over rows (``dims[i]`` its row axis) iterates on the Gram matrix of the
    columns, :math:`X^\top X = \sum_r X_r^\top X_r`, and a leaf sharded over columns on that
    of the rows: the local partial Gram matrices are all-reduced through the reduction hook
    and each rank multiplies its own shard. All pieces of one local shape, side and dtype
    are one batch; each exchange is one hook call for all of them (one all-reduce per
    process group): the max of :math:`|X|` (the exact power-of-two scaling of
    `normalize_frobenius`), then the Gram matrices with the squared Frobenius norms, then
    one per segment after the first (``segments``: every step for the Newton–Schulz form,
    the restarts for the Gram form)."""
    members: dict[tuple, list[tuple[int, int]]] = {}
    pieces: dict[int, list[torch.Tensor]] = {}
    for i, x in leaves.items():
        work = x if dtype is None or x.dtype == dtype else x.to(dtype)
        pieces[i] = _pieces(work, axes[i], splits[i])
        wide = dims[i] != axes[i][0]           # columns sharded: the Gram matrix of the rows
        for j, p in enumerate(pieces[i]):
            members.setdefault((tuple(p.shape[1:]), p.dtype, p.device, wide), []).append(
                (i, j))
    keys = list(members)
    batch = {key: (pieces[ms[0][0]][ms[0][1]] if len(ms) == 1 else
                   torch.cat([pieces[i][j] for i, j in ms])) for key, ms in members.items()}
    sizes = {key: [pieces[i][j].shape[0] for i, j in ms] for key, ms in members.items()}

    def exchange(values: dict[tuple, torch.Tensor], op: str) -> dict[tuple, torch.Tensor]:
        """All-reduce one tensor per group (leading dim: the group's matrices) over the
        groups sharding each leaf's matrix: one hook call."""
        per_piece = {}
        for key in keys:
            for m, part in zip(members[key], values[key].split(sizes[key])):
                per_piece[m] = part
        partials: list[Any] = [MaskedNode()] * n_leaves
        reduce_dims: list[Any] = [None] * n_leaves
        for i in leaves:
            parts = [per_piece[(i, j)].reshape(-1) for j in range(len(pieces[i]))]
            partials[i] = parts[0] if len(parts) == 1 else torch.cat(parts)
            reduce_dims[i] = (dims[i],)
        reduced = reduce_statistics(tree_unflatten(partials, spec), extra_args, op,
                                    tree_unflatten(reduce_dims, spec))
        flat = spec.flatten_up_to(reduced)
        back = {}
        for i in leaves:
            shapes = [per_piece[(i, j)].shape for j in range(len(pieces[i]))]
            chunks = flat[i].split([math.prod(s) for s in shapes])
            for j, (c, s) in enumerate(zip(chunks, shapes)):
                back[(i, j)] = c.reshape(s)
        return {key: (back[members[key][0]] if len(members[key]) == 1 else
                      torch.cat([back[m] for m in members[key]])) for key in keys}

    def stat_dtype(y: torch.Tensor) -> torch.dtype:
        return torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype

    # the exact power-of-two scale of the whole matrix (`normalize_frobenius`)
    amax = exchange({key: (y.abs().amax(dim=(-2, -1)) if y.numel() else
                           torch.zeros(y.shape[0], dtype=y.dtype, device=y.device))
                     for key, y in batch.items()}, "max")
    scale = {key: _power_of_two_floor(a).reshape(-1, 1, 1) for key, a in amax.items()}
    scaled = {key: y / scale[key].to(y.dtype) for key, y in batch.items()}
    # the Gram matrices of the scaled matrices and their squared norms, in one exchange
    first = exchange({key: torch.cat([
        torch.linalg.vector_norm(y, dim=(-2, -1)).to(stat_dtype(y)).square().reshape(-1, 1),
        _gram_of(y.to(stat_dtype(y)), key[3]).reshape(y.shape[0], -1 if y.shape[0] else 0)],
        dim=1)
        for key, y in scaled.items()}, "sum")
    ys, grams = {}, {}
    for key, y in scaled.items():
        p = scale[key]
        denom = norm_scale * first[key][:, :1].sqrt().reshape(-1, 1, 1).to(p.dtype) + eps / p
        ys[key] = y / denom.to(y.dtype)
        k = y.shape[-2] if key[3] else y.shape[-1]
        g = first[key][:, 1:].reshape(y.shape[0], k, k)
        grams[key] = (g / denom.to(g.dtype).square()).to(y.dtype)
    for s, (start, end) in enumerate(segments):
        if s:
            grams = {key: g.to(ys[key].dtype) for key, g in exchange(
                {key: _gram_of(y.to(stat_dtype(y)), key[3]) for key, y in ys.items()},
                "sum").items()}
        for key in keys:
            wide = key[3]
            if gram_form:
                ys[key] = _gram_segment(ys[key], grams[key], coefficients[start:end], wide)
            else:
                ys[key] = _ns_step(ys[key], grams[key], coefficients[start], wide)
    results: dict[int, list[Any]] = {i: [None] * len(ps) for i, ps in pieces.items()}
    for key in keys:
        outs = ys[key].split(sizes[key]) if len(members[key]) > 1 else [ys[key]]
        for (i, j), y in zip(members[key], outs):
            results[i][j] = y.to(leaves[i].dtype)
    return {i: _assemble(x, axes[i], splits[i], results[i]) for i, x in leaves.items()}


def orthogonalizer(method: str, steps: Sequence[tuple[float, float, float]], eps: Any,
                   ns_dtype: torch.dtype | None, scale: float, restarts: Sequence[int]
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function that orthogonalizes a 3-D batch (or one 2-D matrix) by ``method``
    (`orthogonalize`'s methods); shared with `orthogonalize_block_periodic`."""
    def run(batch: torch.Tensor) -> torch.Tensor:
        if method == "svd":
            return polar_factor(batch)
        if method == "gram_newton_schulz":
            return gram_newton_schulz(batch, steps, eps, ns_dtype, norm_scale=scale,
                                      restarts=restarts)
        return newton_schulz(batch, steps, eps, ns_dtype, norm_scale=scale)
    return run


@declare(hyperparams={"eps": None}, runtime=("ns_steps", "ns_coeffs"))
def orthogonalize(ns_steps: int = 5, ns_coeffs: Coefficients = NS_COEFFS, eps: float = 1e-7,
                  method: Method = "newton_schulz", matrix_axes: MatrixAxes = (-2, -1), *,
                  ns_dtype: torch.dtype | None = None, split: Split = None,
                  norm_scale: float | None = None, gram_restarts: Sequence[int] = (2,),
                  batched: bool = True, sharded_mode: ShardedMode = "owners"
                  ) -> GradientTransformation:
    r"""Replace each matrix of the updates by (an approximation of) its orthogonal polar
    factor: Muon's step direction.

    .. math::
        G = U \Sigma V^\top \ \mapsto\ U V^\top \quad(\texttt{method="svd"}), \qquad
        G \mapsto U\, p_{K-1} \circ \cdots \circ p_0\!\left(\Sigma / (s\lVert G \rVert_F +
        \epsilon)\right) V^\top \quad(\text{the iterations})

    where :math:`p_k(\sigma) = a_k \sigma + b_k \sigma^3 + c_k \sigma^5`. Methods:

    * ``"newton_schulz"``: `newton_schulz` with ``ns_coeffs`` (`NS_COEFFS`, five steps: the
      singular values end in about [0.7, 1.2]; the steepest-descent direction under the
      spectral norm up to that spread);
    * ``"polar_express"``: the same iteration with `POLAR_EXPRESS_COEFFS` and :math:`s` = 1.02
      (Polar Express's per-step optimal polynomials: closer to 1 in as many steps);
    * ``"gram_newton_schulz"``: `gram_newton_schulz` with ``ns_coeffs`` (pass
      ``POLAR_EXPRESS_COEFFS`` and ``norm_scale=1.02`` for Polar Express's), the same
      iterate computed on the small Gram matrix;
    * ``"svd"``: the exact polar factor (`polar_factor`), the reference of the others.

    Measured against ``"svd"`` (benchmarks/orthogonalize.py, RESULTS.md): the spectral-norm
    distance to :math:`UV^\top` per method.

    Every matrix of one shape and dtype is orthogonalized in one batched product per step,
    whatever leaf it comes from: leaves of the same shape, the batch axes of a leaf of more
    than two dims (convolutions, stacked experts, `opttx.stacked` layers) and the blocks of
    ``split``. ``batched=False`` runs one matrix at a time instead (the same numbers up to
    the summation order of the batched product; for comparison). The output of each leaf has
    the layout (strides) of the input leaf.

    ``split`` cuts the rows (the first of ``matrix_axes``) into blocks orthogonalized on
    their own: an int ``h`` gives ``h`` equal blocks (attention heads), a tuple the row sizes
    (a fused QKV projection, GQA's unequal Q and K/V), or a tree like the params (a function
    of them) of those, None leaving a leaf whole. Use the same ``split`` in `scale_by_shape`
    for the blocks' own step-size factors.

    Leaves with fewer than two dims are refused (the alias `opttx.muon` sends them to
    AdamW). Stateless (`EmptyState`). Under `opttx.distributed.sharded` a leaf sharded over a
    batch axis only (an expert stack sharded on its expert axis: expert parallelism) is
    orthogonalized on each rank, its own experts, with no collective. A leaf sharded over a
    matrix axis (tensor parallel ``Shard``, FSDP2's DTensor ``Shard(0)``/``Shard(1)``, the row
    segments of `opttx.distributed.zero`'s ``split_above_mb``) is taken per ``sharded_mode``:

    * ``"owners"`` (default): refused, it needs whole matrices (``Traits.whole_leaves``): run
      it under ``on_owners``;
    * ``"gram"``: orthogonalized on its shards. Sharded over rows, the iteration runs on the
      Gram matrix of the columns,

      .. math::
          X^\top X = \textstyle\sum_r X_r^\top X_r, \qquad
          X_{k+1, r} = a_k X_{k,r} + X_{k,r} (b_k A_k + c_k A_k^2)

      (sharded over columns, on :math:`X X^\top = \sum_r X_r X_r^\top` and
      :math:`a_k X + (b_k A_k + c_k A_k^2) X`): each rank computes its partial Gram matrix,
      the reduction hook all-reduces it, the polynomial runs on every rank and each rank
      multiplies its own shard; no gather. The normalization is the whole matrix's: the max
      of :math:`|X|` is all-reduced (the exact power-of-two scaling of
      `normalize_frobenius`), the squared Frobenius norm is summed with the first Gram
      matrix. The exchanges are batched over every leaf and shape group (one hook call each,
      so one all-reduce per process group): per step 1 + ``ns_steps`` for
      ``"newton_schulz"`` and ``"polar_express"`` (the Gram matrix of every iterate, the
      iteration of `newton_schulz` in the orientation of the unsharded side), 2 + the
      restarts for ``"gram_newton_schulz"`` (the iteration of `gram_newton_schulz`, its
      restarts recomputing the Gram matrix from the iterate). Equal to the single-device
      result to rounding, not bit for bit: the Gram matrix is summed over the shards in
      another order than one device's product (float64: 1e-15 relative; float32: about
      1e-6); every rank gets the same all-reduced Gram matrix, so the ranks agree bit for
      bit. Refused: a leaf sharded over both matrix axes, row blocks of ``split`` on a
      row-sharded leaf (blocks of a column-sharded one run), ``method="svd"``;
    * ``"auto"``: ``"gram"`` where the Gram matrix is no larger than the matrix, i.e. its
      side :math:`k` (the unsharded dimension; a row block's rows with ``split``) is at most
      the sharded dimension (:math:`k^2 \le k \cdot s`: then the all-reduced Gram matrix
      is no more data than the matrix), else ``"owners"``'s refusal (route those leaves to
      `opttx.distributed.on_owners`, e.g. with `opttx.partition`).

    In Gram mode the transform runs on shards (``Traits.whole_leaves`` is off): a chain
    of it runs under plain ``sharded``, its other links taking exact statistics through the
    hook (`opttx.muon`, `opttx.normuon`, `opttx.adamuon`, `opttx.dion2` pass the option on).

    Args:
      ns_steps: the number of steps :math:`K` (>= 1) when ``ns_coeffs`` is one triple.
      ns_coeffs: :math:`(a, b, c)`, or a sequence of such triples, one per step (then
        ``ns_steps`` is their number).
      eps: :math:`\epsilon` (torch.optim.Muon's default 1e-7; optax's 1e-8).
      method: ``"newton_schulz"``, ``"polar_express"``, ``"gram_newton_schulz"`` or
        ``"svd"``.
      matrix_axes: the (row, column) axes of the matrix, for every leaf; or a tree like the
        params (or a function of them) holding a pair per leaf, None leaving that leaf
        unchanged.
      ns_dtype: the dtype the iteration runs in (default: the update's).
        ``torch.bfloat16`` is torch.optim.Muon's (and Keller Jordan's) choice, and gives
        their numbers; the result always comes back in the update's dtype.
      split: row blocks orthogonalized separately (see above).
      norm_scale: :math:`s` (default 1.02 for ``"polar_express"``, else 1).
      gram_restarts: the restart steps of ``"gram_newton_schulz"``.
      batched: one batched product per shape group (default) or one matrix at a time
        (whole matrices; shards are always batched).
      sharded_mode: ``"owners"``, ``"gram"`` or ``"auto"``: how a leaf sharded over a
        matrix axis is taken (see above).

    Returns:
      A `GradientTransformation`.

    Example:
      >>> heads = lambda p: {k: 4 if k.endswith("attn.qkv") else None for k in p}
      >>> tx = opttx.chain(opttx.ema(0.95, debias=False, nesterov=True),
      ...                  opttx.orthogonalize(method="polar_express", split=heads),
      ...                  opttx.scale_by_shape(split=heads),
      ...                  opttx.scale_by_learning_rate(0.02))
      >>> from opttx.distributed import Shard, sharded
      >>> tp = sharded(opttx.orthogonalize(sharded_mode="gram"),   # row- and column-shards
      ...              {"w_in": Shard(0), "w_out": Shard(1)})

    References:
      Jordan et al., Muon: An optimizer for hidden layers in neural networks (2024),
      https://kellerjordan.github.io/posts/muon/; Amsel, Persson, Musco and Gower, The Polar
      Express (arXiv 2505.16932); Zhang, Amsel, Chen and Dao, Gram Newton–Schulz (2026).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, _METHODS))}, got "
                         f"{method!r}.")
    if method == "polar_express":
        if ns_coeffs not in (NS_COEFFS, POLAR_EXPRESS_COEFFS):
            raise ValueError("method='polar_express' runs POLAR_EXPRESS_COEFFS; for other "
                             "coefficients use method='newton_schulz' with ns_coeffs=...")
        if ns_steps != 5:
            raise ValueError("method='polar_express' runs its 5 per-step coefficients; "
                             f"ns_steps={ns_steps} does not apply.")
        steps = POLAR_EXPRESS_COEFFS
        scale = POLAR_EXPRESS_SAFETY if norm_scale is None else norm_scale
    else:
        steps = coefficient_steps(ns_coeffs, ns_steps)
        scale = 1.0 if norm_scale is None else norm_scale
    check_nonnegative("eps", eps)
    check_positive("norm_scale", scale)
    restarts = tuple(gram_restarts)
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in restarts):
        raise ValueError(f"gram_restarts must be step indices >= 0, got {gram_restarts!r}.")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype)
                                     and ns_dtype.is_floating_point):
        raise ValueError(f"ns_dtype must be a floating-point torch.dtype or None, got "
                         f"{ns_dtype!r}.")
    if sharded_mode not in _SHARDED_MODES:
        raise ValueError(f"sharded_mode must be one of {', '.join(map(repr, _SHARDED_MODES))}, "
                         f"got {sharded_mode!r}.")
    check_axes_argument(matrix_axes, "orthogonalize")
    check_split_argument(split, "orthogonalize")
    gram_form = method == "gram_newton_schulz"
    segments = (_segments(len(steps), restarts) if gram_form else
                [(k, k + 1) for k in range(len(steps))])

    run = orthogonalizer(method, steps, eps, ns_dtype, scale, restarts)

    def run_group(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [p.shape[0] for p in pieces]
        if not batched:
            return [torch.stack([run(m) for m in p.unbind(0)]) for p in pieces]
        if sum(sizes) == 1:
            return [run(pieces[0][0]).unsqueeze(0)]
        out = run(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        return list(out.split(sizes)) if len(pieces) > 1 else [out]

    def fn(leaves: list[torch.Tensor], axes: list, splits: list, shapes: list,
           extra_args: dict[str, Any] | None = None, spec: Any = None) -> list[torch.Tensor]:
        on_shards: dict[int, int] = {}     # leaf -> its sharded matrix axis (Gram mode)
        if extra_args is not None:
            for i, (ax, d) in enumerate(zip(axes, sharded_matrix_dims(leaves, spec, axes,
                                                                     extra_args))):
                if ax is not None and d and math.prod(shapes[i]) > 0 and _gram_choice(
                        sharded_mode, method, i, ax, d, shapes[i], splits[i]):
                    on_shards[i] = d[0]
        groups: dict[tuple, list[tuple[int, int]]] = {}
        pieces: dict[int, list[torch.Tensor]] = {}
        for i, (x, ax, blocks) in enumerate(zip(leaves, axes, splits)):
            if ax is None or x.numel() == 0 or i in on_shards:   # an empty matrix is its
                continue                                          # own polar factor
            pieces[i] = _pieces(x, ax, blocks)
            for j, p in enumerate(pieces[i]):
                key = (tuple(p.shape[1:]), p.dtype, p.device)
                groups.setdefault(key, []).append((i, j))
        results: dict[int, list[Any]] = {i: [None] * len(ps) for i, ps in pieces.items()}
        for members in groups.values():     # one batched iteration per shape group
            for (i, j), y in zip(members, run_group([pieces[i][j] for i, j in members])):
                results[i][j] = y
        out = list(leaves)
        for i in pieces:
            out[i] = _assemble(leaves[i], axes[i], splits[i], results[i])
        if on_shards:
            for i, y in _orthogonalize_shards(
                    {i: leaves[i] for i in on_shards}, axes, splits, on_shards, len(leaves),
                    spec, extra_args, steps, segments, gram_form, eps, scale,
                    ns_dtype).items():
                out[i] = y
        mark_scratch([out[i] for i in [*pieces, *on_shards]])   # fresh tensors
        return out

    return stateless_matrix_transform("orthogonalize", fn, matrix_axes, split, batched=batched,
                                      on_shards=sharded_mode != "owners")
# ---------------------------------------------------------------------------------------------
# shape scaling
# ---------------------------------------------------------------------------------------------


ShapeConvention = Literal["muon", "spectral"]


def shape_factor(rows: int, cols: int, consistent_rms: float | None = None,
                 convention: ShapeConvention = "muon") -> float:
    r"""The step-size factor of a ``rows`` × ``cols`` matrix: :math:`\sqrt{\max(1,
    \text{rows}/\text{cols})}` (``convention="muon"``) or :math:`\sqrt{\text{rows}/
    \text{cols}}` (``"spectral"``) when ``consistent_rms`` is None, else
    :math:`\text{consistent\_rms} \cdot \sqrt{\max(\text{rows}, \text{cols})}`. An empty
    matrix (a zero side) has nothing to scale: 1."""
    if rows == 0 or cols == 0:
        return 1.0
    if consistent_rms is not None:
        return consistent_rms * math.sqrt(max(rows, cols))
    if convention == "spectral":
        return math.sqrt(rows / cols)
    return math.sqrt(max(1.0, rows / cols))


@declare(hyperparams={"consistent_rms": None})
def scale_by_shape(consistent_rms: float | None = None,
                   matrix_axes: MatrixAxes = (-2, -1), *, split: Split = None,
                   convention: ShapeConvention = "muon") -> GradientTransformation:
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
      weight decay carry over): ``consistent_rms=0.2``; the ``dion`` package's
      ``adjust_lr="rms_norm"``;
    * ``convention="spectral"``: :math:`\sqrt{m/n}` (unit RMS-to-RMS operator norm; the
      ``dion`` package's ``adjust_lr="spectral_norm"``, its default for Dion, Dion2 and
      NorMuon);
    * ``optax.contrib.scale_by_shape(consistent_rms=...)``: the same argument, with optax's
      (in, out) layout as above.

    Batched leaves (more than two dims) take the factor of their matrices; with ``split``
    (as in `orthogonalize`) each row block takes the factor of its own shape, as separate
    parameters would (the ``dion`` package's ``split_sizes``). Stateless; it reads the
    matrix shape: under `opttx.distributed.sharded` it runs on local shards with the whole
    shapes (a leaf with ``split`` row blocks needs whole rows).

    Args:
      consistent_rms: :math:`\gamma`, or None for the width scaling.
      matrix_axes: as in `orthogonalize`.
      split: row blocks with their own factors, as in `orthogonalize`.
      convention: ``"muon"`` or ``"spectral"``, for ``consistent_rms=None``.

    Example:
      >>> tx = opttx.chain(opttx.orthogonalize(), opttx.scale_by_shape(consistent_rms=0.2))

    References:
      Jordan et al., Muon (2024); Liu et al., Muon is Scalable for LLM Training
      (arXiv 2502.16982); Bernstein and Newhouse, Old Optimizer, New Norm (arXiv 2409.20325).
    """
    if consistent_rms is not None:
        check_nonnegative("consistent_rms", consistent_rms)
    if convention not in ("muon", "spectral"):
        raise ValueError(f"convention must be 'muon' or 'spectral', got {convention!r}.")
    check_axes_argument(matrix_axes, "scale_by_shape")
    check_split_argument(split, "scale_by_shape")
    static = consistent_rms is None or isinstance(consistent_rms, (int, float))
    rms = consistent_rms if static else 1.0      # an injected tensor multiplies afterwards

    def factor(m: int, n: int) -> float:
        if not static:
            return math.sqrt(max(m, n))
        return shape_factor(m, n, rms, convention)

    def fn(leaves: list[torch.Tensor], axes: list, splits: list, shapes: list
           ) -> list[torch.Tensor]:
        idx = [i for i, ax in enumerate(axes) if ax is not None]
        if not idx:
            return leaves
        scaled, factors = [], []
        for i in idx:
            x, (r, c), blocks = leaves[i], axes[i], splits[i]
            n = shapes[i][c]
            per_block = [factor(b, n) for b in (blocks or (shapes[i][r],))]
            if len(set(per_block)) == 1:
                scaled.append(x)
                factors.append(per_block[0])
            else:               # unequal blocks: a factor per row
                rows = torch.tensor([f for f, b in zip(per_block, blocks) for _ in range(b)],
                                    dtype=x.dtype, device=x.device)
                shape = [1] * x.dim()
                shape[r] = x.shape[r]
                scaled.append(x * rows.reshape(shape))
                factors.append(1.0)
        scaled = foreach("mul", scaled, factors)
        if not static:
            scaled = foreach("mul", scaled, consistent_rms)
        out = list(leaves)
        for i, y in zip(idx, mark_scratch(scaled)):
            out[i] = y
        return out

    return stateless_matrix_transform("scale_by_shape", fn, matrix_axes, split, whole=False)
