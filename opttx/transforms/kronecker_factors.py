r"""The Kronecker factors of Shampoo (`precondition_shampoo`) and SOAP
(`precondition_eigenvalue_corrected`): the pieces both compute alike, as Meta computes them.

* the update :math:`L_k \leftarrow \beta_2 L_k + w\, G \otimes_k G` of one block's factors
  (`update_factors`, on `contract_factor`);
* their storage: the upper triangle counts (`from_upper`), optionally packed
  (`pack_symmetric`, `unpack_symmetric`, Meta's symmetric packing);
* the matrix Meta decomposes for a factor (`prepared_factor`: bias-corrected, trace-scaled)
  and its eigendecomposition with the fallback to the previous one (`decompose_factor`; for
  many factors at once, same-size ones batched, `decompose_factors`);
* the mode products of a block with one matrix per dim (`apply_roots`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .._tracing import is_tracing
from ..tree import state_dtype
from .matrix_functions import add_ridge, grouped_eigendecomposition, matrix_eigendecomposition

__all__ = [
    "apply_roots",
    "contract_factor",
    "decompose_factor",
    "decompose_factors",
    "from_upper",
    "pack_symmetric",
    "prepared_factor",
    "unpack_symmetric",
    "update_factors",
]


def contract_factor(g: torch.Tensor, k: int) -> torch.Tensor:
    """The upper triangle of :math:`G \\otimes_k G`, the contraction of ``g`` with itself over
    every dim but ``k`` (zeros below the diagonal). A float32 ``G G^T`` is not bitwise
    symmetric; Meta keeps factors as packed upper triangles, so only the upper triangle
    counts: factors accumulate upper triangles and are read through `from_upper` where a root
    or a basis is computed (the same entries, without a transposed pass over every factor at
    every step). The ``triu`` also keeps a bare matmul away from ``add(..., alpha=w)``, which
    Inductor (torch 2.13, CPU) rewrites into an ``addmm`` that drops ``alpha``."""
    others = [d for d in range(g.dim()) if d != k]
    if all(g.shape[d] == 1 for d in others):
        # an outer product (a 1-D block): each entry is one product, as in a matmul with an
        # inner size of 1, so the same numbers; written element-wise it fuses into the
        # factor's update instead of being one more matmul call
        v = g.reshape(-1)
        return torch.triu(v[:, None] * v[None, :])
    return torch.triu(torch.tensordot(g, g, dims=(others, others)))


def from_upper(m: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose upper triangle is that of ``m`` (what Meta's packed
    storage of factors and roots keeps)."""
    return torch.triu(m) + torch.triu(m, diagonal=1).mT


def pack_symmetric(m: torch.Tensor) -> torch.Tensor:
    """The upper triangle of a ``(d, d)`` matrix, row by row: a vector of
    :math:`d(d+1)/2` entries (Meta's ``pack_upper_triangular`` layout)."""
    rows, cols = torch.triu_indices(m.shape[-1], m.shape[-1], device=m.device)
    return m[..., rows, cols]


def unpack_symmetric(v: torch.Tensor, d: int | None = None) -> torch.Tensor:
    """The symmetric ``(d, d)`` matrix whose upper triangle `pack_symmetric` gave (``d``
    derived from the length when not given)."""
    if d is None:
        n = v.shape[-1]
        if is_tracing():      # isqrt cannot take a traced size
            d = 0
            while d * (d + 1) // 2 < n:
                d += 1
        else:
            d = (math.isqrt(8 * n + 1) - 1) // 2
    # one gather: entry (i, j) is packed entry a d - a (a - 1) / 2 + (b - a) with a = min(i, j),
    # b = max(i, j) (index arithmetic a compiler fuses into the gather, no scatter)
    i = torch.arange(d, device=v.device)
    a, b = torch.minimum(i[:, None], i[None, :]), torch.maximum(i[:, None], i[None, :])
    return v[..., a * d - a * (a - 1) // 2 + (b - a)]


def apply_roots(x: torch.Tensor, roots: Sequence[torch.Tensor]) -> torch.Tensor:
    """Multiply ``x`` by ``roots[k]`` along every dim ``k`` (mode products), as Meta does:
    each step contracts the leading dim with a (symmetric) root and appends the result as
    the last dim, so after one step per dim the dims are back in order."""
    for r in roots:
        if r.shape[0] != x.shape[0]:              # a dim not preconditioned: rotate it
            x = x.permute(*range(1, x.dim()), 0)
        else:
            x = torch.tensordot(x, r, dims=([0], [0]))
    return x


def update_factors(g: torch.Tensor, factors: tuple, cfg: Any,
                   kl_roots: tuple | None = None) -> tuple:
    """One block's factors after the gradient ``g``: L_k <- beta2 L_k + w G (x)_k G; with
    ``kl_roots`` (KL-Shampoo) G is first multiplied by the roots of every dim but k. ``cfg``
    holds ``beta2``, ``weight`` (w) and ``symmetric_packing`` (the configuration of
    `precondition_shampoo`, or SOAP's decay of its factors)."""
    # Meta contracts in the gradient's dtype (float32 at least here, for 16-bit gradients),
    # then L *= beta2 (when beta2 != 1), L += w * outer in L's dtype (add with alpha, as its
    # _foreach_add_). Packed factors take in the packed triangle of the contraction (the same
    # entries); unpacked ones the whole contraction, their upper triangle being what counts.
    g = g.reshape(g.shape or (1,)).to(state_dtype(g))
    out = []
    for k, f in enumerate(factors):
        d = g.shape[k]
        if f.shape[0] != (d * (d + 1) // 2 if cfg.symmetric_packing else d):
            out.append(f)                        # a dim not preconditioned: (0, 0) or (0,)
            continue
        outer = contract_factor(g if kl_roots is None else _by_other_roots(g, kl_roots, k), k)
        if cfg.symmetric_packing:
            outer = pack_symmetric(outer)
        if isinstance(cfg.beta2, torch.Tensor):      # injected: no Python branch, no alpha
            out.append((f * cfg.beta2 + outer * cfg.weight).to(f.dtype))
        else:
            out.append(torch.add(f * cfg.beta2 if cfg.beta2 != 1 else f, outer,
                                 alpha=cfg.weight).to(f.dtype))
    return tuple(out)


def _by_other_roots(g: torch.Tensor, roots: tuple, k: int) -> torch.Tensor:
    """KL-Shampoo's input to factor ``k``: ``g`` times the roots of every other dim, in the
    roots' dtype (Meta contracts the gradient with its inverse factor matrices as they are)."""
    dtype = next((r.dtype for r in roots if r.numel()), g.dtype)
    skip = torch.zeros((0, 0), dtype=dtype, device=g.device)
    return apply_roots(g.to(dtype), [skip if j == k else r for j, r in enumerate(roots)])


def prepared_factor(f: torch.Tensor, scale: torch.Tensor | None, cfg: Any
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix Meta decomposes for the factor ``f`` (of `precondition_shampoo` or
    `precondition_eigenvalue_corrected`): symmetric, read from its upper triangle (packed
    factors come unpacked, symmetric already), divided by the bias correction ``scale``,
    trace-scaled; zeros where it is not finite, with whether it was."""
    if not getattr(cfg, "symmetric_packing", False):
        f = from_upper(f)
    a = f if scale is None else f / scale
    if cfg.use_trace_scaling:
        a = a * torch.pow(torch.clamp(torch.trace(a), min=cfg.epsilon),
                          -cfg.trace_scaling_exponent)
    finite = torch.isfinite(a).all()
    return torch.where(finite, a, torch.zeros_like(a)), finite


def decompose_factor(a: torch.Tensor, finite: torch.Tensor, vectors: torch.Tensor,
                     values: torch.Tensor | None, perturb_before: bool, epsilon: Any,
                     method: str, qr_iterations: int, tolerance: Any
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    r"""Meta's eigendecomposition of a `prepared_factor` ``a`` (plus :math:`\epsilon I` when
    perturbing before), from the previous ``vectors``, cast to the old dtypes and contiguous
    (Meta copies it into its buffers; eigh's column-major result would round the products
    differently); the old eigenvectors (and ``values``) where ``a`` or the result is not
    finite. Returns the eigenvalues (None without old ``values``), eigenvectors, success."""
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    v, q = matrix_eigendecomposition(add_ridge(a, epsilon, eye) if perturb_before else a,
                                     vectors.to(a.dtype), method, qr_iterations, tolerance)
    return _kept_decomposition(v, q, finite, vectors, values)


def decompose_factors(factors: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor | None]],
                      perturb_before: bool, epsilon: Any, method: str, qr_iterations: int,
                      tolerance: Any, batched: bool = True
                      ) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """`decompose_factor` of many factors, each given as ``(a, finite, vectors, values)``,
    with the ``eigh`` (or QR) calls of same-size factors batched into one call per size
    group (`grouped_eigendecomposition`): the same numbers as one `decompose_factor` per
    factor (bitwise on CPU), and each factor still judged on its own (a factor whose input or
    result is not finite keeps its previous decomposition; the others are not affected).
    ``batched=False``: one `decompose_factor` per factor."""
    if not batched:
        return [decompose_factor(a, finite, q, v, perturb_before, epsilon, method,
                                 qr_iterations, tolerance) for a, finite, q, v in factors]
    matrices = [add_ridge(a, epsilon, torch.eye(a.shape[0], dtype=a.dtype, device=a.device))
                if perturb_before else a for a, _, _, _ in factors]
    decs = grouped_eigendecomposition(matrices, [q.to(a.dtype) for a, _, q, _ in factors],
                                      method, qr_iterations, tolerance)
    return [_kept_decomposition(v, q, finite, vectors, values)
            for (v, q), (_, finite, vectors, values) in zip(decs, factors)]


def _kept_decomposition(v: torch.Tensor, q: torch.Tensor, finite: torch.Tensor,
                        vectors: torch.Tensor, values: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A fresh decomposition cast to the old dtypes and contiguous, or the old one where the
    input or the result is not finite (`decompose_factor`'s rule)."""
    q = q.to(vectors.dtype).contiguous()
    good = finite & torch.isfinite(q).all() & torch.isfinite(v).all()
    v = None if values is None else torch.where(good, v.to(values.dtype), values)
    return v, torch.where(good, q, vectors), good
