r"""Matrix functions of symmetric positive semi-definite matrices, computed as Meta's
Distributed Shampoo computes them (its ``matrix_functions``), for `precondition_shampoo` and
`precondition_eigenvalue_corrected`.

* `matrix_inverse_root`: :math:`(A + \epsilon I)^{-1/r}` by an eigendecomposition (with
  Meta's rank-deficient rules, `inverse_root_from_eigendecomposition`), by the coupled Newton
  iteration or by the coupled higher-order iteration.
* `matrix_eigendecomposition`: eigenvalues and eigenvectors by ``eigh`` or by Meta's QR
  algorithm from a previous estimate, skipped while the estimate still diagonalises the
  matrix (`off_diagonal_small`).
* `add_ridge`: :math:`A + \epsilon I` formed as Meta forms it.
* `grouped_eigh`, `grouped_qr`: ``eigh`` / ``qr`` of a list of matrices, one batched call per
  (shape, dtype, device) group (the batched refresh of Shampoo and SOAP).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Literal, Sequence

import torch

from .._tracing import is_tracing
from ..tree import _is_batched, tree_cond, tree_while

__all__ = [
    "add_ridge",
    "grouped_eigendecomposition",
    "grouped_eigh",
    "grouped_qr",
    "inverse_root_from_eigendecomposition",
    "matrix_eigendecomposition",
    "matrix_inverse_root",
    "off_diagonal_small",
]


def matrix_inverse_root(a: torch.Tensor, root: float, epsilon: float = 0.0,
                        method: Literal["eigh", "newton", "higher_order"] = "eigh",
                        rank_deficient: Literal["perturb_before", "perturb_after",
                                                "pseudo_inverse"] = "perturb_before",
                        rank_atol: float = 0.0, rank_rtol: float | None = 0.0, *,
                        max_iterations: int | None = None, tolerance: float | None = None,
                        order: int = 3, rel_epsilon: float = 0.0) -> torch.Tensor:
    r""":math:`(A + \epsilon I)^{-1/r}` of a symmetric positive semi-definite matrix.

    ``eigh`` (Meta's default ``EigenConfig`` with its default perturbation, computed as Meta
    computes it): :math:`A + \epsilon I = Q \Lambda Q^\top`; when
    :math:`\lambda_{\min} < \epsilon` (the factor is singular or rounding made an eigenvalue
    negative: an accumulated :math:`G G^\top` of a rank-deficient gradient has eigenvalues of
    about :math:`\pm 10^{-7} \lVert A\rVert` in float32) the eigenvalues become
    :math:`\Lambda - \lambda_{\min} + \epsilon`, so the smallest is exactly
    :math:`\epsilon`; then :math:`Q \Lambda^{-1/r} Q^\top` is returned. In exact arithmetic
    this is :math:`(A - \min(\lambda_{\min}(A), 0) I + \epsilon I)^{-1/r}`.
    ``rank_deficient="perturb_after"`` (Meta's ``PerturbationConfig(perturb_before_computation=
    False)``) decomposes :math:`A` itself and shifts its eigenvalues by
    :math:`-\min(\lambda_{\min}, 0) + \epsilon`; ``"pseudo_inverse"`` (Meta's
    ``PseudoInverseConfig``, ``epsilon`` must be 0) sets :math:`\lambda^{-1/r}` to 0 where
    :math:`\lambda \le \max(\text{rank\_rtol} \cdot \max(\lambda_{\max}, 0),
    \text{rank\_atol})` (``rank_rtol=None``: the matrix size times the dtype's epsilon).

    ``newton`` (Meta's ``CoupledNewtonConfig``; an integer ``root`` only): the coupled
    inverse Newton iteration of Guo and Higham on :math:`B = A + \epsilon I`. With
    :math:`\alpha = -1/r` and :math:`z = (r + 1) / (2 \lVert B\rVert_F)`,

    .. math::
        X_0 = z^{1/r} I,\quad M_0 = z B,\qquad
        M' = (1 - \alpha) I + \alpha M_k,\quad X_{k+1} = X_k M',\quad
        M_{k+1} = M'^{\,r} M_k,

    run while :math:`\lVert M_k - I\rVert_\infty >` ``tolerance`` (default 1e-6) for at most
    ``max_iterations`` (default 100) steps; :math:`X_k \to B^{-1/r}`.

    ``higher_order`` (Meta's ``CoupledHigherOrderConfig``; any rational ``root`` = p/q): the
    same coupling with :math:`M'` the order-``order`` (default 3) Taylor polynomial of
    :math:`M^{-1/p}` around :math:`I` (Lakić), on :math:`B = A + \max(\text{rel\_epsilon}
    \cdot \lVert A\rVert_\infty, \epsilon) I`, started from :math:`z = 1/\mathrm{tr}(B)`
    and one Newton step; it stops at ``tolerance`` (default 1e-8), after ``max_iterations``
    (default 100), or as soon as the error stagnates or grows by more than 1.2×; then
    :math:`X^q`. A result with :math:`\lVert B X^p - I\rVert_\infty > 0.1` is rejected
    (returned as NaN: where Meta raises ``ArithmeticError``, and its preconditioner keeps the
    previous root, `precondition_shampoo` sees a non-finite root and does the same). Meta
    turns TF32 matmuls off for this method; here they follow torch's global setting.

    The iterations have a data-dependent number of steps: a Python loop in eager mode (the
    iterates are Meta's, bit for bit) and ``torch.while_loop`` under ``torch.compile``.

    Non-finite results (for example :math:`\epsilon = 0` and a singular :math:`A`) are the
    caller's to detect; `precondition_shampoo` keeps the previous root then.

    Example:
      >>> a = torch.tensor([[4.0, 0.0], [0.0, 16.0]])
      >>> matrix_inverse_root(a, 2)
      tensor([[0.5000, 0.0000],
              [0.0000, 0.2500]])
    """
    if a.shape[-1] == 0:                 # the factor of an empty dim: nothing to invert
        return a.clone()
    if method == "eigh":
        return _inverse_root_eigh(a, root, epsilon, rank_deficient, rank_atol, rank_rtol)
    if method == "newton":
        return _inverse_root_newton(a, root, epsilon, 100 if max_iterations is None
                                    else max_iterations, 1e-6 if tolerance is None else tolerance)
    if method == "higher_order":
        return _inverse_root_higher_order(
            a, root, epsilon, rel_epsilon, 100 if max_iterations is None else max_iterations,
            1e-8 if tolerance is None else tolerance, order)
    raise ValueError(f"root method must be 'eigh', 'newton' or 'higher_order', got {method!r}.")


def _inverse_root_eigh(a: torch.Tensor, root: float, epsilon: float, rank_deficient: str,
                       rank_atol: float, rank_rtol: float | None) -> torch.Tensor:
    """`matrix_inverse_root` by an eigendecomposition (Meta's ``EigenConfig``)."""
    if rank_deficient == "pseudo_inverse" and epsilon != 0:
        raise ValueError(f"epsilon={epsilon} must be 0 with the pseudo-inverse.")
    if rank_deficient not in ("perturb_before", "perturb_after", "pseudo_inverse"):
        raise ValueError("rank_deficient must be 'perturb_before', 'perturb_after' or "
                         f"'pseudo_inverse', got {rank_deficient!r}.")
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    before = rank_deficient == "perturb_before"
    eigenvalues, eigenvectors = torch.linalg.eigh(add_ridge(a, epsilon, eye) if before else a)
    return inverse_root_from_eigendecomposition(eigenvalues, eigenvectors, root, epsilon,
                                                rank_deficient, rank_atol, rank_rtol)


def inverse_root_from_eigendecomposition(
        eigenvalues: torch.Tensor, eigenvectors: torch.Tensor, root: float,
        epsilon: float = 0.0,
        rank_deficient: Literal["perturb_before", "perturb_after",
                                "pseudo_inverse"] = "perturb_before",
        rank_atol: float = 0.0, rank_rtol: float | None = 0.0) -> torch.Tensor:
    r""":math:`Q \Lambda'^{-1/r} Q^\top` from an eigendecomposition :math:`(\Lambda, Q)`, with
    the eigenvalues made positive as `matrix_inverse_root` describes (Meta's
    ``matrix_inverse_root_from_eigendecomposition``): ``perturb_before`` shifts them to a
    smallest of :math:`\epsilon` only when the smallest is below it (the decomposed matrix
    already had :math:`\epsilon I` added), ``perturb_after`` by
    :math:`-\min(\lambda_{\min}, 0) + \epsilon`, ``pseudo_inverse`` zeroes the powers of
    eigenvalues at or below :math:`\max(\text{rank\_rtol} \cdot \lambda_{\max},
    \text{rank\_atol})`."""
    # Meta's exponent, -1 / Fraction(root), is this float64 division: a float's Fraction
    # converts back to the same float (written without Fraction, which Dynamo of torch 2.11
    # cannot trace)
    power = -1.0 / float(root)
    if rank_deficient == "pseudo_inverse":
        rtol = eigenvalues.numel() * torch.finfo(eigenvalues.dtype).eps \
            if rank_rtol is None else rank_rtol
        cutoff = torch.clamp(rtol * eigenvalues.max().relu(), min=rank_atol)
        inverse = torch.where(eigenvalues <= cutoff, torch.zeros_like(eigenvalues),
                              eigenvalues.pow(power))
        return eigenvectors * inverse.unsqueeze(0) @ eigenvectors.T
    smallest = eigenvalues.min()
    if rank_deficient == "perturb_before":
        eigenvalues = torch.where(smallest < epsilon, (eigenvalues - smallest) + epsilon,
                                  eigenvalues)
    else:
        eigenvalues = (eigenvalues - torch.clamp(smallest, max=0.0)) + epsilon
    return eigenvectors * eigenvalues.pow(power).unsqueeze(0) @ eigenvectors.T


def matrix_eigendecomposition(a: torch.Tensor, estimate: torch.Tensor | None = None,
                              method: Literal["eigh", "qr"] = "eigh", qr_iterations: int = 1,
                              tolerance: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(eigenvalues, eigenvectors)`` of a symmetric matrix as Meta's
    ``matrix_eigendecomposition`` computes them (any ridge is the caller's to add).

    ``eigh``: ``torch.linalg.eigh``; with ``tolerance > 0`` the previous eigenvectors
    ``estimate`` are kept, with the diagonal of :math:`B = Q^\top A Q` as eigenvalues, when
    :math:`\lVert B - \mathrm{diag}(B)\rVert_F \le \text{tolerance}\,\lVert B\rVert_F`
    (the refresh skipped while the old basis still diagonalises the matrix). ``qr``: Meta's QR
    algorithm from ``estimate``: while that criterion fails, at most ``qr_iterations`` times,
    :math:`B = Q'R,\ B \leftarrow RQ',\ Q \leftarrow QQ'`; then the diagonal of :math:`B`
    sorted ascending (stably) with the columns of :math:`Q`. What the criterion skips is not
    computed: a Python branch in eager mode (one device sync per test, as Meta's), a
    ``torch.cond`` per test when compiled (`opttx.tree.tree_cond`).
    """
    if method == "qr":
        if estimate is None:
            raise ValueError("matrix_eigendecomposition: the QR algorithm needs an estimate.")
        b, q = estimate.T @ a @ estimate, estimate
        for _ in range(qr_iterations):
            b, q = tree_cond(off_diagonal_small(b, tolerance), lambda b, q: (b, q),
                             _qr_step, (b, q))
        values, order = b.diag().sort(stable=True)
        return values, q[:, order]
    if method != "eigh":
        raise ValueError(f"method must be 'eigh' or 'qr', got {method!r}.")
    if not (isinstance(tolerance, torch.Tensor) or tolerance):
        return torch.linalg.eigh(a)
    if estimate is None:
        raise ValueError("matrix_eigendecomposition: a tolerance needs an estimate.")
    b = estimate.T @ a @ estimate
    return tree_cond(off_diagonal_small(b, tolerance), lambda v, q: (v, q),
                     lambda v, q: _eigh_like(a, q), (b.diag(), estimate))


def size_groups(matrices: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of ``matrices`` grouped by (shape, dtype, device), in order of first
    appearance (each group one batched call); on CPU a matrix that is not a multiple of 64
    bytes is a group of its own (see `grouped_eigh`)."""
    groups: dict = {}
    for i, m in enumerate(matrices):
        aligned = m.device.type != "cpu" or (m.numel() * m.element_size()) % 64 == 0
        groups.setdefault((tuple(m.shape), m.dtype, m.device) if aligned else i, []).append(i)
    return list(groups.values())


def _grouped(decompose: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
             matrices: Sequence[torch.Tensor], batched: bool
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``decompose`` (a batched linalg call returning two tensors) of every matrix: one call
    per `size_groups` group, its results unstacked; one call per matrix unless ``batched``."""
    if not batched:
        return [decompose(m) for m in matrices]
    out: list = [None] * len(matrices)
    for group in size_groups(matrices):
        if len(group) == 1:
            out[group[0]] = decompose(matrices[group[0]])
            continue
        first, second = decompose(torch.stack([matrices[i] for i in group]))
        for k, i in enumerate(group):
            out[i] = (first[k], second[k])
    return out


def grouped_eigh(matrices: Sequence[torch.Tensor], batched: bool = True
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    r"""``torch.linalg.eigh`` of every matrix, one batched call per (shape, dtype, device)
    group: the same-size matrices are stacked, decomposed by one call and unstacked.

    Each result is ``(eigenvalues, eigenvectors)`` of one matrix, the eigenvectors
    column-major as a single call returns them (a slice of the batched result has the same
    strides). On CPU the batched kernel runs LAPACK matrix by matrix, and the numbers are
    those of one call per matrix, bit for bit (``benchmarks/batched_eigh.py``), provided every
    matrix of the batch starts as a single call's copy does, on a 64-byte boundary: MKL's
    result depends on the alignment of the matrix (measured: a 7 x 7 or 33 x 33 float32
    matrix at a 4-byte offset decomposes to other bits). So on CPU a group whose matrices
    are not a multiple of 64 bytes (a size not divisible by 4 in float32 and float64) is
    decomposed matrix by matrix; on CUDA every group is batched, and the batched solver may
    round differently from one call. A matrix that makes LAPACK fail makes its whole group
    fail (as it would fail alone): callers pass finite matrices and judge each result on its
    own. ``batched=False``: one call per matrix (the per-factor path, for debugging).

    Example:
      >>> a = torch.eye(3) * torch.tensor([1.0, 2.0, 3.0])
      >>> values = [v for v, _ in grouped_eigh([a, 2 * a, torch.ones(2, 2)])]
      >>> values[1]
      tensor([2., 4., 6.])
    """
    return _grouped(torch.linalg.eigh, matrices, batched)


def grouped_qr(matrices: Sequence[torch.Tensor], batched: bool = True
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``torch.linalg.qr`` of every matrix, one batched call per (shape, dtype, device) group,
    with `grouped_eigh`'s rule for CPU alignment (measured bitwise equal to one call per
    matrix on CPU for aligned sizes); ``batched=False``: one call per matrix."""
    return _grouped(torch.linalg.qr, matrices, batched)


def grouped_eigendecomposition(matrices: Sequence[torch.Tensor],
                               estimates: Sequence[torch.Tensor | None],
                               method: Literal["eigh", "qr"] = "eigh", qr_iterations: int = 1,
                               tolerance: float = 0.0, batched: bool = True
                               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`matrix_eigendecomposition` of every matrix (from its estimate), with the ``eigh`` and
    ``qr`` calls of same-size matrices batched (`grouped_eigh`, `grouped_qr`): the same
    numbers as one `matrix_eigendecomposition` per matrix. Where the tolerance criterion
    skips a matrix, eager mode leaves it out of the batch (one device sync per test, as the
    per-matrix path); compiled, the batch takes every matrix and ``torch.where`` keeps the
    skipped ones' previous values (no ``torch.cond`` per matrix). ``batched=False``: one
    `matrix_eigendecomposition` per matrix."""
    if not batched:
        return [matrix_eigendecomposition(m, e, method, qr_iterations, tolerance)
                for m, e in zip(matrices, estimates)]
    if method not in ("eigh", "qr"):
        raise ValueError(f"method must be 'eigh' or 'qr', got {method!r}.")
    if method == "eigh" and not (isinstance(tolerance, torch.Tensor) or tolerance):
        return grouped_eigh(matrices)
    if any(e is None for e in estimates):
        raise ValueError("matrix_eigendecomposition: the QR algorithm and a tolerance need an "
                         "estimate.")
    bs = [e.T @ m @ e for m, e in zip(matrices, estimates)]
    if method == "eigh":
        small = [off_diagonal_small(b, tolerance) for b in bs]
        todo, select = _not_skipped(small)
        out = [(b.diag(), e) for b, e in zip(bs, estimates)]
        for i, (v, q) in zip(todo, grouped_eigh([matrices[i] for i in todo])):
            q = q.contiguous() if estimates[i].is_contiguous() else q
            out[i] = (torch.where(small[i], bs[i].diag(), v),
                      torch.where(small[i], estimates[i], q)) if select else (v, q)
        return out
    qs = list(estimates)
    for _ in range(qr_iterations):
        small = [off_diagonal_small(b, tolerance) for b in bs]
        todo, select = _not_skipped(small)
        for i, (qq, r) in zip(todo, grouped_qr([bs[i] for i in todo])):
            b, q = r @ qq, qs[i] @ qq
            bs[i], qs[i] = (torch.where(small[i], bs[i], b),
                            torch.where(small[i], qs[i], q)) if select else (b, q)
    out = []
    for b, q in zip(bs, qs):
        values, order = b.diag().sort(stable=True)
        out.append((values, q[:, order]))
    return out


def _not_skipped(small: list[torch.Tensor]) -> tuple[list[int], bool]:
    """The matrices a tolerance test did not skip, and whether the results must be selected
    with ``torch.where``: in eager mode those whose test is false (read back, as the
    per-matrix path's branch), compiled or under ``vmap`` every one (then selected)."""
    if is_tracing() or any(_is_batched(s) for s in small):
        return list(range(len(small))), True
    return [i for i, s in enumerate(small) if not bool(s)], False


def _eigh_like(a: torch.Tensor, estimate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh(a)`` with the eigenvectors in ``estimate``'s memory layout (``torch.cond`` needs
    both branches' outputs laid out alike; eigh's are column-major)."""
    values, vectors = torch.linalg.eigh(a)
    return values, vectors.contiguous() if estimate.is_contiguous() else vectors


def _qr_step(b: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One step of the QR algorithm: :math:`B = Q'R,\ B \leftarrow RQ',\ Q \leftarrow
    QQ'`."""
    qq, r = torch.linalg.qr(b)
    return r @ qq, q @ qq


def off_diagonal_small(b: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Meta's criterion: ``||B - diag(B)||_F <= tolerance * ||B||_F`` (a 0-dim bool)."""
    norm = torch.linalg.norm(b)
    off = torch.sqrt(norm**2 - torch.linalg.norm(b.diag())**2)
    return off <= tolerance * norm


def add_ridge(a: torch.Tensor, epsilon: float | torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    r""":math:`A + \epsilon I`, formed as Meta forms it (``add`` with ``alpha`` for a number,
    a product for a tensor (an injected epsilon: always added), nothing for 0)."""
    if isinstance(epsilon, torch.Tensor):
        return a + epsilon.to(a.dtype) * eye
    return a.add(eye, alpha=epsilon) if epsilon else a


def _inverse_root_newton(a: torch.Tensor, root: float, epsilon: float, max_iterations: int,
                         tolerance: float) -> torch.Tensor:
    """`matrix_inverse_root` by the coupled inverse Newton iteration (Meta's
    ``CoupledNewtonConfig``), stopped at ``tolerance``."""
    if not float(root).is_integer():
        raise ValueError(f"root={root}: the coupled Newton iteration takes an integer root "
                         "(as Meta's CoupledNewtonConfig); use method='higher_order'.")
    p = int(root)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    alpha = -1 / p
    ridge = add_ridge(a, epsilon, eye)
    z = (p + 1) / (2 * torch.linalg.norm(ridge))
    x, m = z ** (-alpha) * eye, z * ridge
    error = torch.dist(m, eye, p=math.inf)
    step = torch.zeros((), dtype=torch.int64, device=a.device)

    def going(step, x, m, error):
        return (error > tolerance) & (step < max_iterations)

    def newton_step(step, x, m, error):
        m_p = m.mul(alpha).add_(eye, alpha=1 - alpha)
        m = torch.linalg.matrix_power(m_p, p) @ m
        return step + 1, x @ m_p, m, torch.dist(m, eye, p=math.inf)

    return tree_while(going, newton_step, (step, x, m, error))[1]


def _lakic_coefficients(p: int, order: int) -> list[float]:
    """The Taylor coefficients of :math:`(1 - y)^{-1/p}` up to ``order - 1`` (Lakić)."""
    b, num, den = [1.0], 1, 1
    for i in range(1, order):
        num *= 1 + (i - 1) * p
        den *= i * p
        b.append(num / den)
    return b


def _inverse_root_higher_order(a: torch.Tensor, root: float, abs_epsilon: float,
                               rel_epsilon: float, max_iterations: int, tolerance: float,
                               order: int) -> torch.Tensor:
    """`matrix_inverse_root` by Meta's coupled higher-order iteration
    (``CoupledHigherOrderConfig``); NaN where its accuracy check fails."""
    if order < 2:
        raise ValueError(f"order={order} must be >= 2 (2 is Newton's method).")
    frac = Fraction(root)
    p, q = frac.numerator, frac.denominator
    b = _lakic_coefficients(p, order)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    s = -1 / p
    lambda_max = torch.linalg.matrix_norm(a, math.inf)
    ridge = a + torch.clamp(lambda_max * rel_epsilon, min=abs_epsilon) * eye
    z = torch.reciprocal(torch.trace(ridge))
    x, m = torch.pow(z, -s) * eye, z * ridge
    # one Newton step first: it guarantees the higher-order iteration converges
    m_p = m.mul(s).add_(eye, alpha=1 - s)
    x, m = x @ m_p, torch.linalg.matrix_power(m_p, p) @ m
    error = torch.linalg.vector_norm(m - eye, math.inf)
    step = torch.ones((), dtype=torch.int64, device=a.device)
    stopped = torch.zeros((), dtype=torch.bool, device=a.device)

    def going(step, x, m, error, stopped):
        return ~stopped & (error > tolerance) & (step < max_iterations)

    def higher_order_step(step, x, m, error, stopped):
        base = eye - m
        m_p = base.mul(b[order - 1]).add_(eye, alpha=b[order - 2])
        for i in reversed(range(order - 2)):
            m_p = torch.addmm(eye, m_p, base, beta=b[i])
        x, m = x @ m_p, torch.linalg.matrix_power(m_p, p) @ m
        new_error = torch.linalg.vector_norm(m - eye, math.inf)
        # stagnating or diverging: keep this iterate, stop (Meta's rule)
        stop = (new_error > error * 1.2) | ((new_error == error) & (error < 1e-3))
        return step + 1, x, m, torch.where(stop, error, new_error), stop

    x = tree_while(going, higher_order_step, (step, x, m, error, stopped))[1]
    accurate = torch.linalg.vector_norm(ridge @ torch.linalg.matrix_power(x, p) - eye,
                                        math.inf) <= 0.1
    if q > 1:
        x = torch.linalg.matrix_power(x, q)
    return torch.where(accurate & torch.isfinite(lambda_max), x, torch.full_like(x, math.nan))
