"""Shampoo as pure transforms: `block_by_dims`, `precondition_shampoo`, `graft`.

The pieces follow Meta's Distributed Shampoo (arXiv 2309.06497). This module holds the
preconditioner (`precondition_shampoo`, `ShampooState`); the other pieces have modules of
their own and are importable from here too: `opttx.transforms.blocking` (`block_by_dims`,
`merge_small_dims`, `block_shapes`), `opttx.transforms.grafting` (`graft`,
`scale_by_grafted_diagonal`, `meta_bias_correction`), `opttx.transforms.matrix_functions`
(`matrix_inverse_root`, `matrix_eigendecomposition`, ...) and
`opttx.transforms.kronecker_factors` (the factors' update and storage, shared with SOAP:
`pack_symmetric`, `unpack_symmetric`, ...).

* `block_by_dims` reshapes every leaf the way Meta does — drop size-1 dims, merge neighbouring
  dims from the last one while the product stays <= ``max_preconditioner_dim``, then cut every
  dim into chunks of at most that size — runs an inner transform on the blocks, and puts the
  result back together.
* `precondition_shampoo` keeps one Kronecker factor per dim of every block and applies the
  inverse roots of the factors to its input. The roots are recomputed every
  ``precondition_frequency`` steps inside the one compiled graph (``torch.cond``).
* `graft` gives, block by block, the direction of one transform the norm of another (the
  "grafted" method, SGD/Adagrad/RMSprop/Adam), and runs the grafted method alone before
  preconditioning starts. It also owns Meta's filtered gradient (an EMA with ``beta1``), which
  both transforms precondition while their statistics see the raw gradient.

A transform used inside `graft` computes its statistics from ``updates`` (the raw gradient) and
preconditions ``extra_args[PRECONDITION_INPUT]`` when it is given (`scale_by_rms`,
`scale_by_rss`, `scale_by_grafted_diagonal` and `precondition_shampoo` honour it).

**What equals Meta.** `opttx.shampoo` (these pieces with `scale_by_grafted_diagonal` as the
grafted method, `add_decayed_weights` and `trace`) equals Meta's ``DistributedShampoo`` with its
default ``RootInvShampooPreconditionerConfig`` (``EigenConfig``: eigh, perturbation before the
computation) on one device, for every grafting type (Adagrad, RMSprop, Adam, SGD, none), L2
and decoupled weight decay, bias correction on and off, ``beta3``, ``beta2 < 1``, classic
momentum with or without Nesterov (dampening 0), any frequency and start step, blocking and
merged dims (``max_preconditioner_dim`` an int or ``math.inf``), ``inverse_exponent_override``,
trace scaling, the rank-deficient stability configs (perturbation before or after,
pseudo-inverse), all three root methods (``EigenConfig``, ``CoupledNewtonConfig`` and
``CoupledHigherOrderConfig`` with their tolerances, iteration caps and orders), the
CORRECTED and INDEPENDENT weight decay types, and float32 or float64 factors and roots (``preconditioner_dtype`` and
``inv_factor_matrix_dtype``, Meta's ``factor_matrix_dtype`` and ``inv_factor_matrix_dtype``):
to 1e-8 relative with float64 factors and roots, bitwise on CPU with float32 ones in the
cases measured, rank-deficient factors with epsilon 1e-12 included (where Meta itself moves by
11-41 % when its gradients move by one ulp). ``tests/test_shampoo_meta.py`` checks it. For
that, the pieces compute what Meta computes in Meta's way: bias corrections as float32
scalars (`meta_bias_correction`), factors and roots read from their upper triangles (Meta's
symmetric packing), outer products in the gradient's dtype, roots in their own dtype.
The eigenvalue-corrected config (SOAP) is `precondition_eigenvalue_corrected` in
`opttx.transforms.soap`. Not equal: a root that comes out non-finite (Meta raises, opttx
retries an ``eigh`` root in float64 and keeps the previous root); Meta's in-place aliasing of
its filtered gradient with SGD grafting before the start step, ``beta3 = beta1`` and no bias
correction (a Meta bug); 16-bit parameters (opttx keeps statistics in float32, Meta in the
parameter's dtype). The eigendecomposed config (``eigendecomposed=True``), symmetric
packing (``use_symmetric_packing``) and KL-Shampoo (``kl_shampoo=True``, root-inverse or
eigendecomposed) are equal too; Meta's generalized primal averaging and Schedule-Free are
`opttx.schedule_free` around `opttx.shampoo` (``docs/mapping.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from .._checks import (check_gradient_leaves, check_nonnegative, check_positive_int,
                       check_unit_interval)
from .._tracing import is_tracing
from ..base import (GradientTransformation, HyperRole, PRECONDITION_INPUT, Params, Role, Traits,
                    Updates, check_init_params, declare, declare_roles, precondition_target,
                    require_whole_leaves, safe_increment, zero_count)
from ..tree import (PyTree, Static, flatten_matching, tree_cond, tree_flatten, tree_map,
                    tree_paths, tree_structure, tree_unflatten)
from .blocking import block_by_dims, block_shapes, chunks, merge_small_dims
from .grafting import (DiagonalGraftState, GraftState, graft, meta_bias_correction,
                       scale_by_grafted_diagonal)
from .kronecker_factors import (apply_roots, decompose_factors, from_upper, pack_symmetric,
                                prepared_factor, unpack_symmetric, update_factors)
from .matrix_functions import (add_ridge, grouped_eigh, inverse_root_from_eigendecomposition,
                               matrix_eigendecomposition, matrix_inverse_root, off_diagonal_small)

__all__ = [
    "DiagonalGraftState",
    "GraftState",
    "PRECONDITION_INPUT",
    "ShampooState",
    "block_by_dims",
    "block_shapes",
    "graft",
    "matrix_inverse_root",
    "merge_small_dims",
    "inverse_root_from_eigendecomposition",
    "matrix_eigendecomposition",
    "meta_bias_correction",
    "off_diagonal_small",
    "pack_symmetric",
    "precondition_shampoo",
    "scale_by_grafted_diagonal",
    "unpack_symmetric",
]


class ShampooState(NamedTuple):
    """State of `precondition_shampoo`."""
    count: torch.Tensor     # shape (), int32: steps taken
    failures: torch.Tensor  # shape (), int32: consecutive root computations that failed
    factors: PyTree         # per block: tuple of (d_k, d_k) Kronecker factors, one per dim,
                            # as their upper triangles (zeros below the diagonal; the factor
                            # is f + f.triu(1).mT), or packed, (d_k (d_k + 1) / 2,)
    roots: PyTree           # per block: tuple of (d_k, d_k) inverse roots of the factors
                            # (packed likewise); with eigendecomposed caching, the factors'
                            # eigenvectors (identity until the first computation)
    eigenvalues: PyTree = ()  # eigendecomposed caching: per block, tuple of (d_k,)
                              # eigenvalues of the factors (ones at first); () otherwise
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, factors=Role.FACTOR_MATRIX,
                              roots=Role.FACTOR_MATRIX)


@declare(hyperparams={"beta2": HyperRole.B2, "epsilon": HyperRole.EPS},
         runtime=("precondition_frequency", "start_preconditioning_step",
                  "max_consecutive_failures", "trace_scaling_exponent",
                  "inverse_exponent_override", "rank_atol", "rank_rtol", "root_max_iterations",
                  "root_tolerance", "root_order", "root_rel_epsilon", "root_abs_epsilon",
                  "qr_iterations", "eigendecomposition_tolerance", "root_method"))
def precondition_shampoo(beta2: float = 1.0, epsilon: float = 1e-12,
                         precondition_frequency: int = 1,
                         start_preconditioning_step: int | None = None,
                         root_method: Literal["eigh", "newton", "higher_order"] = "eigh",
                         inverse_exponent_override: float | dict | None = None,
                         preconditioner_dtype: torch.dtype = torch.float32,
                         use_bias_correction: bool = True,
                         max_consecutive_failures: int = 3,
                         inv_factor_matrix_dtype: torch.dtype | None = torch.float32,
                         use_trace_scaling: bool = False,
                         trace_scaling_exponent: float = 0.5,
                         drop_weighting_factor_on_gsquare: bool = False,
                         rank_deficient: Literal["perturb_before", "perturb_after",
                                                 "pseudo_inverse"] = "perturb_before",
                         rank_atol: float = 0.0, rank_rtol: float | None = 0.0, *,
                         root_max_iterations: int | None = None,
                         root_tolerance: float | None = None, root_order: int = 3,
                         root_rel_epsilon: float = 0.0, root_abs_epsilon: float | None = None,
                         use_symmetric_packing: bool = False, eigendecomposed: bool = False,
                         eigendecomposition: Literal["eigh", "qr"] = "eigh",
                         qr_iterations: int = 1, eigendecomposition_tolerance: float = 0.0,
                         kl_shampoo: bool = False,
                         batched_refresh: bool = True) -> GradientTransformation:
    r"""Shampoo's Kronecker-factored preconditioner, applied to every leaf (block) as a whole.

    For a block :math:`G` of order :math:`k` and each dim :math:`i`,

    .. math::
        L_i \leftarrow \beta_2 L_i + w\, G \otimes_i G, \qquad w = 1 \text{ if } \beta_2 = 1
        \text{ else } 1 - \beta_2,

    and every ``precondition_frequency`` steps from ``start_preconditioning_step`` on (steps
    counted from 1, as Meta: step ``t`` with ``t % f == 0 and t > start`` or ``t == start``)

    .. math::
        \hat L_i = L_i / b_t, \qquad R_i = (\hat L_i + \epsilon I)^{-1/(2k)}

    with the bias correction :math:`b_t = 1 - \beta_2^t` when :math:`\beta_2 < 1` and
    ``use_bias_correction`` (else 1), and with :math:`\hat L_i` multiplied by
    :math:`\mathrm{tr}(\hat L_i)^{-\text{trace\_scaling\_exponent}}` first when
    ``use_trace_scaling`` (the trace clamped below at :math:`\epsilon`).
    ``inverse_exponent_override`` replaces :math:`2k`. The output is
    :math:`G \times_1 R_1 \cdots \times_k R_k`: for a matrix :math:`L^{-1/4} G R^{-1/4}`, for
    a vector full-matrix Adagrad :math:`L^{-1/2} g`. Use it on blocks from `block_by_dims` (a
    leaf is one block otherwise).

    **Equal to Meta.** This is Meta's ``RootInvShampooPreconditionerConfig()`` with its
    default ``EigenConfig`` (eigh, perturbation before the computation, see
    `matrix_inverse_root`), computed op for op as Meta computes it: factors read from their
    upper triangle (Meta's symmetric packing), :math:`b_t` in float32 (`meta_bias_correction`),
    roots stored in ``inv_factor_matrix_dtype`` (Meta's default float32, whatever the factor
    dtype) and the gradient preconditioned in that dtype, outer products formed in the
    gradient's dtype (float32 for 16-bit gradients, where Meta would use the 16-bit dtype).
    ``preconditioner_dtype`` is Meta's ``factor_matrix_dtype``. ``tests/test_shampoo_meta.py``
    compares them on drawn shapes and settings: float64 to 1e-8 (measured: 0, bitwise), float32
    to 1e-5 or Meta's own one-ulp spread (measured: bitwise equal on CPU).

    Where :math:`\hat L_i` is rank-deficient and :math:`\epsilon` small, the output is an
    ill-conditioned function of the gradient: :math:`R_i` has norm :math:`\epsilon^{-1/(2k)}`
    while :math:`R_i g` is of order :math:`\lambda_{\max}^{-1/(2k)} \lVert g\rVert`, so a
    relative rounding :math:`u` of the roots' dtype becomes an error of about
    :math:`u\,(\lambda_{\max}/\epsilon)^{1/(2k)}` (float32 roots, :math:`\epsilon = 10^{-12}`,
    a 1-D block: tens of percent). Any two implementations differ by that much; use
    float64 roots or a larger :math:`\epsilon` where it matters.

    A factor whose root is not finite in ``preconditioner_dtype`` is retried in float64 (only
    that factor, and only then); if that fails too it keeps its previous root, and the
    recomputation counts as failed; more than ``max_consecutive_failures`` failed
    recomputations in a row raise (checked in eager mode, at recomputation steps only, so
    other steps do not synchronise with the device). (Meta raises at once on a non-finite
    root.) The recomputation, retry included, is a ``torch.cond`` inside the compiled graph.

    Args:
      beta2: factor decay (1.0: Adagrad-style sums, Meta's default).
      epsilon: :math:`\epsilon` added to the diagonal before the root.
      precondition_frequency: recompute roots every this many steps.
      start_preconditioning_step: first step that uses the roots (default: the frequency).
      root_method: ``"eigh"`` (default, Meta's ``EigenConfig``), ``"newton"`` (Meta's
        ``CoupledNewtonConfig``) or ``"higher_order"`` (Meta's ``CoupledHigherOrderConfig``);
        see `matrix_inverse_root`. The iterative methods stop at ``root_tolerance`` or after
        ``root_max_iterations`` (defaults: Meta's, 1e-6 / 1e-8 and 100); ``root_order`` is the
        higher-order method's order; it adds :math:`\max(\text{root\_rel\_epsilon} \cdot
        \lVert A\rVert_\infty, \text{root\_abs\_epsilon})\, I` (``root_abs_epsilon=None``:
        ``epsilon``) where the others add :math:`\epsilon I` (Meta's higher-order config
        ignores Shampoo's epsilon and has its own two). A factor whose iterative root is not
        finite or not accurate keeps its previous root, as in Meta (no float64 retry).
      inverse_exponent_override: a number ``p``: :math:`A^{-1/p}` for every factor; or Meta's
        dict ``{order: e}`` / ``{order: {dim: e}}`` of inverse exponents :math:`e = 1/p`
        for the blocks of that order (unlisted: :math:`1/(2k)`; :math:`e = 0`: the dim is
        not preconditioned and keeps no factor).
      preconditioner_dtype: dtype of the factors (Meta's ``factor_matrix_dtype``).
      use_bias_correction: divide factors by :math:`1-\beta_2^t` before the root.
      max_consecutive_failures: root failures tolerated in a row.
      inv_factor_matrix_dtype: dtype of the roots and of the preconditioning product
        (Meta's ``inv_factor_matrix_dtype``; default float32 as Meta's, whatever
        ``preconditioner_dtype`` is, so float64 factors alone give float32 roots: pass
        ``inv_factor_matrix_dtype=torch.float64`` too for float64 throughout; None: float32).
      use_trace_scaling, trace_scaling_exponent: Meta's options of the same names.
      drop_weighting_factor_on_gsquare: Meta's option: :math:`w = 1` even when
        :math:`\beta_2 < 1`, and no bias correction.
      rank_deficient, rank_atol, rank_rtol: how singular factors are handled (see
        `matrix_inverse_root`; ``"pseudo_inverse"`` needs ``epsilon=0``).
      use_symmetric_packing: keep factors and roots as their packed upper triangles
        (`pack_symmetric`, :math:`d(d+1)/2` entries instead of :math:`d^2`; Meta's
        ``use_symmetric_packing``). Lossless: the numbers are the same bit for bit, as the
        unpacked matrices are read from their upper triangles anyway; each step unpacks them
        into temporaries.
      eigendecomposed: cache each factor's eigendecomposition instead of its inverse root
        (Meta's ``EigendecomposedShampooPreconditionerConfig``): the roots are formed from the
        cached :math:`(\Lambda, Q)` at every step (`inverse_root_from_eigendecomposition`,
        with the ``rank_deficient`` rules), and the decomposition is refreshed by
        ``eigendecomposition="eigh"`` or Meta's QR algorithm (``"qr"``, ``qr_iterations``
        from the previous eigenvectors), skipped while the previous eigenvectors still
        diagonalise the factor to ``eigendecomposition_tolerance``
        (`matrix_eigendecomposition`). ``inv_factor_matrix_dtype`` is the dtype of the
        eigenvectors and eigenvalues (Meta's two dtypes). Root method ``"eigh"`` only.
      kl_shampoo: KL-Shampoo (Lin et al., arXiv 2509.03378; Meta's
        ``RootInvKLShampooPreconditionerConfig`` and, with ``eigendecomposed``,
        ``EigendecomposedKLShampooPreconditionerConfig``): factor :math:`i` takes in the
        gradient preconditioned along every *other* dim by the roots in use before this
        step's recomputation, :math:`L_i \leftarrow \beta_2 L_i + w\,(G \times_{j \ne i}
        R_j) \otimes_i (G \times_{j \ne i} R_j)`, formed in the roots' dtype.
      batched_refresh: the refresh decomposes all factors of the step together, the
        same-size ones (across leaves and blocks, and across the leaves a rank owns under
        `opttx.distributed.on_owners`) stacked into one batched ``eigh`` (or QR) call per size
        group (`opttx.transforms.matrix_functions.grouped_eigh`); the roots are then formed
        factor by factor, each factor judged on its own (the float64 retry and the fallback to
        the previous root are per factor, as before). The same numbers as one call per factor,
        bit for bit on CPU; on CUDA the batched solver's rounding. ``False``: one call per
        factor (for debugging). The iterative root methods (``"newton"``,
        ``"higher_order"``) run factor by factor either way.

    Example:
      >>> tx = opttx.block_by_dims(opttx.precondition_shampoo(epsilon=1e-12), 1024)

    References:
      Gupta, Koren and Singer, Shampoo (arXiv 1802.09568); Shi et al., A Distributed
      Data-Parallel PyTorch Implementation of Shampoo (arXiv 2309.06497).
    """
    cfg = _shampoo_config(
        beta2=beta2, epsilon=epsilon, precondition_frequency=precondition_frequency,
        start_preconditioning_step=start_preconditioning_step, root_method=root_method,
        inverse_exponent_override=inverse_exponent_override,
        preconditioner_dtype=preconditioner_dtype, use_bias_correction=use_bias_correction,
        max_consecutive_failures=max_consecutive_failures,
        inv_factor_matrix_dtype=inv_factor_matrix_dtype, use_trace_scaling=use_trace_scaling,
        trace_scaling_exponent=trace_scaling_exponent,
        drop_weighting_factor_on_gsquare=drop_weighting_factor_on_gsquare,
        rank_deficient=rank_deficient, rank_atol=rank_atol, rank_rtol=rank_rtol,
        root_max_iterations=root_max_iterations, root_tolerance=root_tolerance,
        root_order=root_order, root_rel_epsilon=root_rel_epsilon,
        root_abs_epsilon=root_abs_epsilon, symmetric_packing=use_symmetric_packing,
        eigendecomposed=eigendecomposed, eigendecomposition=eigendecomposition,
        qr_iterations=qr_iterations, eigendecomposition_tolerance=eigendecomposition_tolerance,
        kl_shampoo=kl_shampoo, batched_refresh=batched_refresh)

    def init(params: Params) -> ShampooState:
        check_init_params(params)
        return _init_shampoo(params, cfg)

    def update(updates: Updates, state: ShampooState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ShampooState]:
        require_whole_leaves(updates, extra_args, "precondition_shampoo")
        return _update_shampoo(updates, state, precondition_target(updates, extra_args), cfg)

    return GradientTransformation(init, update, Traits(per_leaf=True, whole_leaves=True,
                                                       takes_precondition_input=True))


@dataclass(frozen=True, eq=False)
class _ShampooConfig:
    """The static settings of one `precondition_shampoo`, validated and resolved (plain data)."""
    beta2: Any                          # a float, or a 0-dim tensor (injected)
    epsilon: float
    precondition_frequency: int
    start: int                          # first step that uses the roots
    root_method: str
    inverse_exponent_override: Any      # None, a number, or Meta's dict of exponents
    preconditioner_dtype: torch.dtype   # of the factors
    root_dtype: torch.dtype             # of the roots and of the preconditioning product
    bias_correction: bool               # divide the factors by 1 - beta2^t before the root
    weight: float                       # w in L <- beta2 L + w G (x)_k G
    max_consecutive_failures: int
    use_trace_scaling: bool
    trace_scaling_exponent: float
    rank_options: dict                  # matrix_inverse_root's rank_deficient/atol/rtol
    iteration_options: dict             # matrix_inverse_root's max_iterations/tolerance/...
    root_epsilon: float                 # the epsilon of matrix_inverse_root
    symmetric_packing: bool             # factors and roots kept as packed upper triangles
    eigen_options: dict | None          # eigendecomposed caching: matrix_eigendecomposition's
                                        # method/qr_iterations/tolerance (None: roots cached)
    kl_shampoo: bool = False            # factors take in G preconditioned along the other dims
    batched: bool = True                # same-size factors decomposed by one batched call


def _shampoo_config(*, beta2: float, epsilon: float, precondition_frequency: int,
                    start_preconditioning_step: int | None, root_method: str,
                    inverse_exponent_override: float | dict | None,
                    preconditioner_dtype: torch.dtype, use_bias_correction: bool,
                    max_consecutive_failures: int, inv_factor_matrix_dtype: torch.dtype | None,
                    use_trace_scaling: bool, trace_scaling_exponent: float,
                    drop_weighting_factor_on_gsquare: bool, rank_deficient: str,
                    rank_atol: float, rank_rtol: float | None,
                    root_max_iterations: int | None = None, root_tolerance: float | None = None,
                    root_order: int = 3, root_rel_epsilon: float = 0.0,
                    root_abs_epsilon: float | None = None,
                    symmetric_packing: bool = False, eigendecomposed: bool = False,
                    eigendecomposition: str = "eigh", qr_iterations: int = 1,
                    eigendecomposition_tolerance: float = 0.0,
                    kl_shampoo: bool = False, batched_refresh: bool = True) -> _ShampooConfig:
    """Validate `precondition_shampoo`'s arguments and resolve them into a `_ShampooConfig`."""
    check_unit_interval("beta2", beta2, closed_right=True)
    check_nonnegative("epsilon", epsilon)
    check_positive_int("precondition_frequency", precondition_frequency)
    start = precondition_frequency if start_preconditioning_step is None \
        else start_preconditioning_step
    check_nonnegative("start_preconditioning_step", start)
    check_positive_int("max_consecutive_failures", max_consecutive_failures)
    if use_trace_scaling and not 0.0 < trace_scaling_exponent <= 1.0:
        raise ValueError(f"trace_scaling_exponent must be in (0, 1] with use_trace_scaling, "
                         f"got {trace_scaling_exponent}.")
    _check_inverse_exponent_override(inverse_exponent_override)
    _check_root_settings(root_method=root_method,
                         inverse_exponent_override=inverse_exponent_override,
                         rank_deficient=rank_deficient, epsilon=epsilon,
                         root_max_iterations=root_max_iterations, root_tolerance=root_tolerance,
                         root_order=root_order, root_rel_epsilon=root_rel_epsilon,
                         root_abs_epsilon=root_abs_epsilon)
    _check_eigen_settings(eigendecomposed, root_method, eigendecomposition, qr_iterations,
                          eigendecomposition_tolerance)
    iteration_options = {} if root_method == "eigh" else dict(
        max_iterations=root_max_iterations, tolerance=root_tolerance)
    if root_method == "higher_order":
        iteration_options.update(order=root_order, rel_epsilon=root_rel_epsilon)
    # a 0-dim tensor (injected, or a float given inside a compiled function): its value may
    # change, so beta2 = 1 (a sum, not corrected) is decided in the graph, not in Python
    injected = isinstance(beta2, torch.Tensor)
    return _ShampooConfig(
        beta2=beta2, epsilon=epsilon, precondition_frequency=precondition_frequency,
        start=start, root_method=root_method,
        inverse_exponent_override=inverse_exponent_override,
        preconditioner_dtype=preconditioner_dtype,
        # Meta's default, whatever the factors' dtype (None: the `shampoo` alias's default)
        root_dtype=torch.float32 if inv_factor_matrix_dtype is None
        else inv_factor_matrix_dtype,
        bias_correction=use_bias_correction and not drop_weighting_factor_on_gsquare
        and (injected or beta2 != 1),
        weight=1.0 if drop_weighting_factor_on_gsquare
        else torch.where(beta2 == 1, torch.ones_like(beta2), 1 - beta2) if injected
        else 1.0 if beta2 == 1 else 1 - beta2,
        max_consecutive_failures=max_consecutive_failures, use_trace_scaling=use_trace_scaling,
        trace_scaling_exponent=trace_scaling_exponent,
        rank_options=dict(rank_deficient=rank_deficient, rank_atol=rank_atol,
                          rank_rtol=rank_rtol) if root_method == "eigh" else {},
        iteration_options=iteration_options,
        root_epsilon=root_abs_epsilon if root_method == "higher_order"
        and root_abs_epsilon is not None else epsilon, symmetric_packing=symmetric_packing,
        eigen_options=dict(method=eigendecomposition, qr_iterations=qr_iterations,
                           tolerance=eigendecomposition_tolerance) if eigendecomposed else None,
        kl_shampoo=bool(kl_shampoo), batched=bool(batched_refresh))


def _check_inverse_exponent_override(inverse_exponent_override: float | dict | None) -> None:
    """A number >= 0, or Meta's dict ``{order: e}`` / ``{order: {dim: e}}`` with orders, dims
    (0 .. order - 1) and exponents >= 0; else a ``ValueError``."""
    if isinstance(inverse_exponent_override, dict):
        for order, given in inverse_exponent_override.items():
            values = given.values() if isinstance(given, dict) else [given]
            if order < 0 or any(e < 0 for e in values) or (isinstance(given, dict) and any(
                    not 0 <= d <= max(order - 1, 0) for d in given)):
                raise ValueError(f"inverse_exponent_override[{order}]={given!r}: orders, dims "
                                 "(0 .. order - 1) and exponents must be >= 0.")
    elif inverse_exponent_override is not None:
        check_nonnegative("inverse_exponent_override", inverse_exponent_override)


def _check_root_settings(*, root_method: str, inverse_exponent_override: float | dict | None,
                         rank_deficient: str, epsilon: float, root_max_iterations: int | None,
                         root_tolerance: float | None, root_order: int, root_rel_epsilon: float,
                         root_abs_epsilon: float | None) -> None:
    """The root method and its settings, checked together (the rank-deficient rules belong
    to ``eigh``, the Newton iteration takes integer roots only); else a ``ValueError``."""
    if rank_deficient == "pseudo_inverse" and epsilon != 0:
        raise ValueError(f"epsilon={epsilon} must be 0 with rank_deficient='pseudo_inverse' "
                         "(as Meta's PseudoInverseConfig).")
    if rank_deficient not in ("perturb_before", "perturb_after", "pseudo_inverse"):
        raise ValueError("rank_deficient must be 'perturb_before', 'perturb_after' or "
                         f"'pseudo_inverse', got {rank_deficient!r}.")
    if root_method not in ("eigh", "newton", "higher_order"):
        raise ValueError("root_method must be 'eigh', 'newton' or 'higher_order', got "
                         f"{root_method!r}.")
    if root_method == "newton":             # its iteration takes integer roots only
        if isinstance(inverse_exponent_override, dict):
            roots = [1 / e for given in inverse_exponent_override.values()
                     for e in (given.values() if isinstance(given, dict) else [given]) if e]
        else:
            roots = [] if inverse_exponent_override is None else [inverse_exponent_override]
        if any(not float(r).is_integer() for r in roots):
            raise ValueError(f"inverse_exponent_override={inverse_exponent_override!r} asks "
                             "for a root that is not an integer; the coupled Newton iteration "
                             "takes integer roots only (as Meta's CoupledNewtonConfig): use "
                             "root_method='higher_order' or 'eigh'.")
    if root_method != "eigh" and rank_deficient != "perturb_before":
        raise ValueError(f"rank_deficient={rank_deficient!r} is a setting of the 'eigh' root "
                         f"method (Meta's EigenConfig), not of {root_method!r}.")
    if root_max_iterations is not None:
        check_positive_int("root_max_iterations", root_max_iterations)
    if root_tolerance is not None:
        check_nonnegative("root_tolerance", root_tolerance)
    if root_method == "higher_order" and (not isinstance(root_order, int) or root_order < 2):
        raise ValueError(f"root_order={root_order!r} must be an int >= 2 (2: Newton).")
    check_nonnegative("root_rel_epsilon", root_rel_epsilon)
    if root_abs_epsilon is not None:
        check_nonnegative("root_abs_epsilon", root_abs_epsilon)


def _check_eigen_settings(eigendecomposed: bool, root_method: str, eigendecomposition: str,
                          qr_iterations: int, eigendecomposition_tolerance: float) -> None:
    """The settings of eigendecomposed caching; else a ``ValueError``."""
    if eigendecomposed and root_method != "eigh":
        raise ValueError("eigendecomposed caching keeps eigendecompositions (root_method "
                         f"'eigh'), not roots by {root_method!r}.")
    if eigendecomposition not in ("eigh", "qr"):
        raise ValueError(f"eigendecomposition must be 'eigh' or 'qr', got "
                         f"{eigendecomposition!r}.")
    check_positive_int("qr_iterations", qr_iterations)
    check_unit_interval("eigendecomposition_tolerance", eigendecomposition_tolerance,
                        closed_right=True)


def _roots_of_order(order: int, override: float | dict | None) -> list[float | None]:
    """The root p of every dim of a block of this order (None: not preconditioned)."""
    default = 1 / (2 * max(order, 1))         # Meta's inverse exponent
    if isinstance(override, dict):
        given = override.get(order, {})
        exps = [given.get(d, default) if isinstance(given, dict) else given
                for d in range(order)]
        return [None if e == 0 else 1 / e for e in exps]
    if override is not None:
        return [override] * order
    return [1 / default] * order               # Meta's root: 1 / its inverse exponent


def _zero_factors(x: torch.Tensor, cfg: _ShampooConfig) -> tuple:
    """The initial factors of one block: zeros, (0, 0) for a dim not preconditioned."""
    x = x.reshape(x.shape or (1,))
    return tuple(torch.zeros((d, d) if p else (0, 0), dtype=cfg.preconditioner_dtype,
                             device=x.device)
                 for d, p in zip(x.shape, _roots_of_order(x.dim(), cfg.inverse_exponent_override)))


def _identity_roots(x: torch.Tensor, cfg: _ShampooConfig) -> tuple:
    """The initial roots of one block: identities, (0, 0) for a dim not preconditioned."""
    x = x.reshape(x.shape or (1,))
    return tuple(torch.eye(d if p else 0, dtype=cfg.root_dtype, device=x.device)
                 for d, p in zip(x.shape, _roots_of_order(x.dim(), cfg.inverse_exponent_override)))


def _init_shampoo(params: Params, cfg: _ShampooConfig) -> ShampooState:
    """The state of `precondition_shampoo` for ``params``: zero factors, identity roots."""
    count = zero_count(params)
    stored = _packed if cfg.symmetric_packing else (lambda ms: ms)
    if cfg.eigen_options is not None:     # eigenvectors (never packed) and eigenvalues
        return ShampooState(count=count, failures=torch.zeros_like(count),
                            factors=tree_map(lambda x: stored(_zero_factors(x, cfg)), params),
                            roots=tree_map(lambda x: _identity_roots(x, cfg), params),
                            eigenvalues=tree_map(lambda x: tuple(
                                torch.ones(q.shape[0], dtype=q.dtype, device=q.device)
                                for q in _identity_roots(x, cfg)), params))
    return ShampooState(count=count, failures=torch.zeros_like(count),
                        factors=tree_map(lambda x: stored(_zero_factors(x, cfg)), params),
                        roots=tree_map(lambda x: stored(_identity_roots(x, cfg)), params))


def _packed(matrices: tuple) -> tuple:
    return tuple(pack_symmetric(m) for m in matrices)


def _unpacked(vectors: tuple, block: torch.Tensor) -> tuple:
    """The full factors (or roots) of ``block`` from their packed triangles."""
    shape = block.shape or (1,)
    return tuple(unpack_symmetric(v, shape[k] if v.shape[0] else 0)
                 for k, v in enumerate(vectors))


def _root_inputs(factors: list[tuple], count: torch.Tensor, cfg: _ShampooConfig
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[float]]:
    """The matrices to take roots of (bias-corrected, trace-scaled, zeroed when not finite)
    with their finiteness, and the root of each, for every factor of every block."""
    scale = meta_bias_correction(cfg.beta2, count) if cfg.bias_correction else None
    if scale is not None and isinstance(cfg.beta2, torch.Tensor):   # a sum is not corrected
        scale = torch.where(cfg.beta2 < 1, scale, torch.ones_like(scale))
    inputs, exps = [], []
    for block_factors in factors:
        for f, p in zip(block_factors,
                        _roots_of_order(len(block_factors), cfg.inverse_exponent_override)):
            inputs.append(prepared_factor(f, scale, cfg))
            exps.append(p or 1.0)
    return inputs, exps


def _count_failures(failed: torch.Tensor, failures: torch.Tensor, cfg: _ShampooConfig,
                    what: str) -> torch.Tensor:
    """Consecutive failed recomputations after this one; raises (eager mode) when there are
    more than ``max_consecutive_failures``."""
    failures = torch.where(failed, failures + 1, torch.zeros_like(failures))
    if not is_tracing() and int(failures) > cfg.max_consecutive_failures:
        raise RuntimeError(f"precondition_shampoo: the {what} failed {int(failures)} times "
                           f"in a row (limit {cfg.max_consecutive_failures}); the factors "
                           "are not usable. Raise epsilon or use "
                           "preconditioner_dtype=torch.float64.")
    return failures


def _root_of(a: torch.Tensor, p: float, dtype: torch.dtype, cfg: _ShampooConfig
             ) -> torch.Tensor:
    """The inverse ``p``-th root of ``a``, cast to ``dtype``, read from its upper triangle
    (kept as that packed triangle with ``use_symmetric_packing``)."""
    root = matrix_inverse_root(a, p, cfg.root_epsilon, cfg.root_method, **cfg.rank_options,
                               **cfg.iteration_options).to(dtype)
    return pack_symmetric(root) if cfg.symmetric_packing else from_upper(root)


def _roots_of(matrices: list[torch.Tensor], exps: list[float], dtype: torch.dtype,
              cfg: _ShampooConfig) -> list[torch.Tensor]:
    """`_root_of` of every matrix; with ``eigh`` roots the decompositions of same-size
    matrices are one batched call per size group (`grouped_eigh`), then each root is formed
    from its decomposition as `matrix_inverse_root` forms it (the same numbers)."""
    if cfg.root_method != "eigh" or not cfg.batched:
        return [_root_of(a, p, dtype, cfg) for a, p in zip(matrices, exps)]
    before = cfg.rank_options["rank_deficient"] == "perturb_before"
    todo = [i for i, a in enumerate(matrices) if a.shape[-1]]     # (0, 0): nothing to invert
    decs = grouped_eigh([add_ridge(matrices[i], cfg.root_epsilon, torch.eye(
        matrices[i].shape[-1], dtype=matrices[i].dtype, device=matrices[i].device))
        if before else matrices[i] for i in todo])
    out = [_root_of(a, p, dtype, cfg) if not a.shape[-1] else None
           for a, p in zip(matrices, exps)]
    for i, (values, vectors) in zip(todo, decs):
        root = inverse_root_from_eigendecomposition(values, vectors, exps[i], cfg.root_epsilon,
                                                    **cfg.rank_options).to(dtype)
        out[i] = pack_symmetric(root) if cfg.symmetric_packing else from_upper(root)
    return out


def _retry_in_float64(inputs: list[tuple[torch.Tensor, torch.Tensor]], exps: list[float],
                      roots: list[torch.Tensor], oks: list[torch.Tensor],
                      cfg: _ShampooConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The roots with each failed one (``oks`` false) recomputed in float64, and which are
    finite now; in eager mode only the failed ones are recomputed (same-size ones batched)."""
    todo = [i for i, good in enumerate(oks) if is_tracing() or not bool(good)]
    out_r, out_ok = list(roots), list(oks)
    redone = _roots_of([inputs[i][0].double() for i in todo], [exps[i] for i in todo],
                       roots[0].dtype if roots else cfg.root_dtype, cfg)
    for i, r64 in zip(todo, redone):
        r64 = r64.to(roots[i].dtype)
        good64 = inputs[i][1] & torch.isfinite(r64).all()
        out_r[i] = torch.where(oks[i], roots[i], r64)
        out_ok[i] = oks[i] | good64
    return out_r, out_ok


def _compute_roots(factors: list[tuple], old_roots: list[tuple], count: torch.Tensor,
                   cfg: _ShampooConfig) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """New roots of every factor (same-size ones decomposed together, `_roots_of`); a factor
    whose root is not finite in ``preconditioner_dtype`` is retried in float64, and keeps its
    old root when that fails too. Returns the roots (per block) and whether any factor kept
    its old root."""
    inputs, exps = _root_inputs(factors, count, cfg)
    fresh = _roots_of([a for a, _ in inputs], exps, cfg.root_dtype, cfg)
    ok = [finite_in & torch.isfinite(r).all() for (_, finite_in), r in zip(inputs, fresh)]
    flat_old = [r for rs in old_roots for r in rs]
    if cfg.preconditioner_dtype != torch.float64 and fresh and cfg.root_method == "eigh":
        # float64 retry of the failed factors only (Meta's retry_double_precision of its
        # eigendecomposition): in eager mode a Python branch per factor, compiled one
        # torch.cond that runs when any factor failed
        all_ok = torch.stack(ok).all()
        fresh, ok = tree_cond(~all_ok, lambda r, o: _retry_in_float64(inputs, exps, r, o, cfg),
                              lambda r, o: (r, o), (fresh, ok))
    kept = [torch.where(good, new, old) for good, new, old in zip(ok, fresh, flat_old)]
    any_failed = ~torch.stack(ok).all() if ok else torch.zeros((), dtype=torch.bool)
    return chunks(kept, [len(rs) for rs in old_roots], "precondition_shampoo"), any_failed


def _recompute_roots(factors: list[tuple], roots: list[tuple], failures: torch.Tensor,
                     count: torch.Tensor, cfg: _ShampooConfig) -> tuple[list[tuple], torch.Tensor]:
    """The roots of ``factors`` and the count of consecutive failed recomputations; raises
    (eager mode) when it exceeds ``max_consecutive_failures``."""
    fresh, failed = _compute_roots(factors, roots, count, cfg)
    failures = _count_failures(failed, failures, cfg, "root computation")
    return [tuple(rs) for rs in fresh], failures


def _recompute_eigen(factors: list[tuple], vectors: list[tuple], values: list[tuple],
                     failures: torch.Tensor, count: torch.Tensor, cfg: _ShampooConfig
                     ) -> tuple[list[tuple], list[tuple], torch.Tensor]:
    r"""Eigendecomposed caching: every factor's eigendecomposition (`matrix_eigendecomposition`
    of the bias-corrected, trace-scaled factor, plus :math:`\epsilon I` with the default
    perturbation, as Meta's); a factor whose result is not finite keeps its old one."""
    inputs, _ = _root_inputs(factors, count, cfg)
    flat_q = [q for qs in vectors for q in qs]
    flat_v = [v for vs in values for v in vs]
    new_q, new_v = list(flat_q), list(flat_v)     # a dim not preconditioned keeps its (0, 0)
    todo = [i for i, q in enumerate(flat_q) if q.shape[0]]
    before = cfg.rank_options.get("rank_deficient", "perturb_before") == "perturb_before"
    decs = decompose_factors([(*inputs[i], flat_q[i], flat_v[i]) for i in todo], before,
                             cfg.epsilon, **cfg.eigen_options, batched=cfg.batched)
    oks = []
    for i, (v, q, good) in zip(todo, decs):
        new_q[i], new_v[i] = q, v
        oks.append(good)
    failed = ~torch.stack(oks).all() if oks else torch.zeros((), dtype=torch.bool)
    failures = _count_failures(failed, failures, cfg, "eigendecomposition")
    counts = [len(qs) for qs in vectors]
    return ([tuple(c) for c in chunks(new_q, counts, "precondition_shampoo")],
            [tuple(c) for c in chunks(new_v, counts, "precondition_shampoo")], failures)


def _roots_from_eigen(vectors: tuple, values: tuple, cfg: _ShampooConfig) -> tuple:
    """One block's inverse roots formed from the cached eigendecompositions (this step's)."""
    exps = _roots_of_order(len(vectors), cfg.inverse_exponent_override)
    return tuple(q if q.shape[0] == 0 else
                 inverse_root_from_eigendecomposition(v, q, p, cfg.epsilon, **cfg.rank_options)
                 for q, v, p in zip(vectors, values, exps))


def _precondition(x: torch.Tensor, roots: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One block ``x`` multiplied by its roots along every dim, computed in ``dtype``."""
    return apply_roots(x.reshape(x.shape or (1,)).to(dtype), roots) \
        .reshape(x.shape).to(x.dtype)


def check_block_shapes(g: list[torch.Tensor], factors: list[tuple], tree: PyTree, who: str,
                       packed: bool = False) -> None:
    """Every gradient block has the order and the sizes of the state's factors (one per dim,
    ``(d, d)``, packed ``(d (d + 1) / 2,)``, ``(0, 0)`` for a dim kept without one); else a
    ``ValueError`` naming the leaf and both shapes."""
    for i, (x, fs) in enumerate(zip(g, factors)):
        shape = tuple(x.shape) or (1,)
        sizes = [_factor_size(f, packed) for f in fs]
        if len(fs) == len(shape) and all(n is None or n == d for n, d in zip(sizes, shape)):
            continue
        expected = tuple("?" if n is None else n for n in sizes)
        path = tree_paths(tree)[i] if i < len(tree_paths(tree)) else f" leaf {i}"
        raise ValueError(f"{who}: the gradient{path} has shape {tuple(x.shape)}, but the "
                         f"state's factors are those of a block of shape {expected} ('?': a "
                         "dim without a factor): gradients must have the shapes of the params, "
                         "and the state must come from init on these params (with the same "
                         "max_preconditioner_dim).")


def _factor_size(f: torch.Tensor, packed: bool) -> int | None:
    """The dim a factor (or basis) preconditions, None for a dim kept without one."""
    if not f.shape[0]:
        return None
    return (math.isqrt(8 * f.shape[0] + 1) - 1) // 2 if packed and f.dim() == 1 else f.shape[0]


def _update_shampoo(updates: Updates, state: ShampooState, target: Updates,
                    cfg: _ShampooConfig) -> tuple[Updates, ShampooState]:
    """One step of `precondition_shampoo`: the factors take in ``updates``, the roots are
    recomputed when due, and ``target`` is preconditioned with them."""
    spec, g = flatten_matching(updates)
    check_gradient_leaves(g, None, updates, "precondition_shampoo")
    x = flatten_matching(target)[1]
    orders = [max(x.dim(), 1) for x in g]
    factors = [tuple(c) for c in chunks(tree_flatten(state.factors)[0], orders,
                                        "precondition_shampoo")]
    check_block_shapes(g, factors, updates, "precondition_shampoo", cfg.symmetric_packing)
    roots = [tuple(c) for c in chunks(tree_flatten(state.roots)[0], orders,
                                      "precondition_shampoo")]
    count = safe_increment(state.count)
    # packed factors and roots: full matrices only where needed, as temporaries (the
    # factors inside the root recomputation, the roots to precondition)
    full = (lambda ms: [_unpacked(m, gi) for m, gi in zip(ms, g)]) if cfg.symmetric_packing \
        else (lambda ms: ms)
    if cfg.eigen_options is not None:
        values = [tuple(c) for c in chunks(tree_flatten(state.eigenvalues)[0], orders,
                                           "precondition_shampoo")]
    if cfg.kl_shampoo:       # the roots in use before this step's recomputation
        in_use = [_roots_from_eigen(qs, vs, cfg) for qs, vs in zip(roots, values)] \
            if cfg.eigen_options is not None else full(roots)
        new_factors = [update_factors(gi, fs, cfg, rs)
                       for gi, fs, rs in zip(g, factors, in_use)]
    else:
        new_factors = [update_factors(gi, fs, cfg) for gi, fs in zip(g, factors)]
    due = ((count % cfg.precondition_frequency == 0) & (count > cfg.start)) \
        | (count == cfg.start)
    factor_spec = tree_structure(state.factors)
    new_state = dict(count=count,
                     factors=tree_unflatten([m for fs in new_factors for m in fs], factor_spec))
    if cfg.eigen_options is not None:
        # KL-Shampoo formed the roots of the old decompositions already: they serve again
        # unless refreshed (the others are formed after the refresh, once)
        def refreshed(q, v, f, r):
            q, v, f = _recompute_eigen(full(new_factors), q, v, f, count, cfg)
            return q, v, f, ([_roots_from_eigen(qs, vs, cfg) for qs, vs in zip(q, v)]
                             if cfg.kl_shampoo else r)
        roots, values, failures, applied = tree_cond(
            due, refreshed, lambda q, v, f, r: (q, v, f, r),
            (roots, values, state.failures, in_use if cfg.kl_shampoo else []))
        if not cfg.kl_shampoo:
            applied = [_roots_from_eigen(qs, vs, cfg) for qs, vs in zip(roots, values)]
        new_state["eigenvalues"] = tree_unflatten([v for vs in values for v in vs],
                                                  tree_structure(state.eigenvalues))
    else:
        roots, failures = tree_cond(
            due, lambda r, f: _recompute_roots(full(new_factors), r, f, count, cfg),
            lambda r, f: (r, f), (roots, state.failures))
        applied = full(roots)
    out = [_precondition(xi, rs, cfg.root_dtype) for xi, rs in zip(x, applied)]
    return tree_unflatten(out, spec), ShampooState(
        failures=failures, roots=tree_unflatten([m for rs in roots for m in rs], factor_spec),
        made_by=state.made_by, **new_state)
