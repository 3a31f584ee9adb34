"""Eigenvalue-corrected Shampoo (SOAP): Adam run in the eigenbasis of Shampoo's factors.

`precondition_eigenvalue_corrected` keeps Shampoo's Kronecker factors (built with the helpers of
`opttx.transforms.shampoo`), an eigenbasis of each factor refreshed every
``precondition_frequency`` steps, and a second moment of the gradient rotated into that basis
(the "corrected eigenvalues"). It has two schedules:

* ``schedule="meta"`` is Meta's ``EigenvalueCorrectedShampooPreconditionerConfig``: every step
  the factors take in the gradient, the basis is refreshed when due (with this step's factors),
  then the second moment is updated and the input preconditioned in the (new) basis. Used
  inside `graft` (Meta's filtered gradient is the input), it is what
  ``opttx.shampoo(preconditioner="eigenvalue_corrected")`` computes, equal to Meta's
  ``DistributedShampoo`` (``tests/test_soap.py``).
* ``schedule="soap"`` is the SOAP paper's Algorithm (Vyas et al., arXiv 2409.11321, and its
  reference code, ported as ``pytorch_optimizer.SOAP``): the first gradient only initialises
  the factors and the basis (the update is zero); from then on the update uses the basis
  computed *before* the current gradient entered the factors, then the factors are updated
  and, every ``precondition_frequency`` Adam steps, the basis is refreshed by one step of
  power iteration with QR. `opttx.soap` uses it.

Where the references differ (each difference is tested in ``tests/test_soap.py``):

* **first step**: Meta preconditions step 1 (identity basis before
  ``start_preconditioning_step``); SOAP and heavyball return no update at step 1 and count Adam's
  steps from the second gradient.
* **basis refresh timing**: Meta refreshes with the factors that include the current gradient
  and uses the new basis at once; SOAP refreshes after the update, when the Adam step count is
  a multiple of the frequency; heavyball refreshes when its call count is (one step earlier
  than SOAP), and its 1/frequency accumulator drifts for frequencies that are not powers of
  two (with frequency 10 it first refreshes at call 11).
* **QR vs eigh**: Meta refreshes by ``eigh`` (default) or by its QR algorithm (``QR(Q^T A Q)``
  from the previous basis, columns sorted by ascending estimated eigenvalue, the second moment
  left in place); SOAP by one power step ``QR(A Q)`` on columns sorted by descending estimated
  eigenvalue, permuting the second moment with them (``eigendecomposition="power"``);
  heavyball's power step adds a "lift" ``max(eps, 64 n eps_dtype) |lambda|_max Q`` to ``A Q``
  and fixes signs, so it is not the same numbers after a refresh.
* **bias correction**: Meta divides the factors and the second moment by ``1 - beta2^t``
  computed in float32; SOAP (and heavyball's debiased betas) use the usual Adam form
  ``m_hat / (sqrt(v_hat) + eps)``; the reference SOAP code folds the corrections into the step
  size, so its ``eps`` is effectively ``eps / sqrt(1 - beta2^t)``. Bias correction of the factors
  does not change their eigenvectors.
* **first moment**: Meta and SOAP keep the gradient EMA in the parameters' basis and rotate it
  every step; heavyball keeps it in the eigenbasis and rotates it on each refresh (the same
  numbers in exact arithmetic, two matrix products per 2-D block fewer each step; opttx's
  ``first_moment_in_eigenbasis=True``).
* **1-D and large dims**: Meta blocks every dim at ``max_preconditioner_dim`` and preconditions
  1-D blocks with a full factor; SOAP leaves 1-D leaves (unless ``precondition_1d``) and dims
  larger than ``max_precond_dim`` in the standard basis (``max_basis_dim``, and
  ``ignored_basis_change_dims`` which is Meta's option of that name).
* **merging dims**: Meta merges from the last dim (`merge_small_dims`, inside `block_by_dims`);
  the SOAP reference code from the first (`merge_dims_soap`; a small matrix becomes one dim);
  heavyball keeps dim 0 and merges the others from the last (`merge_dims_heavyball`, its
  default). The last two are ``merge_dims`` here and in `opttx.soap`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from .._checks import (check_gradient_leaves, check_nonnegative, check_positive_int,
                       check_unit_interval)
from ..base import (GradientTransformation, HyperRole, Params, Role, Traits, Updates,
                    advance_counts, check_init_params, declare, declare_roles, precondition_target,
                    require_whole_leaves, safe_increment, zero_count)
from ..kernels import (cast_like, foreach, foreach_ema, is_fixed_zero, keeping_state,
                       new_buffers)
from ..tree import (PyTree, Static, flatten_matching, state_dtype, stats_like, tree_cond,
                    tree_flatten, tree_map, tree_structure, tree_unflatten)
from .blocking import chunks
from .grafting import filtered_gradient, meta_bias_correction
from .kronecker_factors import (_by_other_roots, contract_factor, decompose_factors, from_upper,
                                prepared_factor, update_factors)
from .matrix_functions import grouped_qr, inverse_root_from_eigendecomposition

__all__ = ["EigenvalueCorrectedState", "merge_dims_heavyball", "merge_dims_soap",
           "precondition_eigenvalue_corrected"]


class EigenvalueCorrectedState(NamedTuple):
    """State of `precondition_eigenvalue_corrected`."""
    count: torch.Tensor     # shape (), int32: steps taken
    factors: PyTree         # per leaf: tuple of (d_k, d_k) Kronecker factors as their upper
                            # triangles (f + f.triu(1).mT is the factor), (0, 0) for a dim
                            # that is not rotated
    bases: PyTree           # per leaf: tuple of (d_k, d_k) eigenvectors of the factors
                            # (identity until the first refresh), (0, 0) where not rotated
    mu: Updates             # like params: EMA of the gradient in the parameters' basis, or
                            # rotated into the bases (first_moment_in_eigenbasis, in the
                            # bases' dtype); empty when beta1 = 0
    nu: Updates             # like params: EMA (or sum) of the squared gradient rotated into
                            # the bases (Meta's "corrected eigenvalues"); with merge_dims
                            # the rotated (merged) tensor kept in the leaf's shape
    eigenvalues: PyTree = ()  # KL-SOAP (kl_shampoo): per leaf, tuple of (d_k,) eigenvalues
                              # of the factors from the last refresh (ones at first, (0,)
                              # where not rotated); () otherwise
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, factors=Role.FACTOR_MATRIX,
                              bases=Role.PROJECTION, mu=Role.FIRST_MOMENT,
                              nu=Role.SECOND_MOMENT)


@dataclass(frozen=True, eq=False)
class _FactorDecay:
    """The decay and weight of the factors, as `update_factors` reads them."""
    beta2: Any
    weight: Any
    symmetric_packing: bool = False   # SOAP keeps full factors


@dataclass(frozen=True, eq=False)
class _ECConfig:
    """The static settings of one `precondition_eigenvalue_corrected` (plain data)."""
    beta1: float
    beta3: float                  # weight of the EMA in the preconditioned average ("meta")
    eigenbasis_moment: bool       # keep the EMA rotated into the bases
    moment_correction: bool       # divide the EMA by its bias correction
    beta2: float                  # second-moment decay
    weight: float                 # w in nu <- beta2 nu + w (Q^T g Q)^2
    factor: _FactorDecay          # decay and weight of the factors
    epsilon: float
    frequency: int
    start: int
    method: str                   # "eigh", "qr" (Meta's QR algorithm) or "power" (SOAP's)
    qr_iterations: int
    tolerance: float
    schedule: str                 # "meta" or "soap"
    dtype: torch.dtype            # of the factors
    basis_dtype: torch.dtype      # of the bases and of nu
    bias_correction: bool
    exponent: Any                 # a number, or Meta's {order: exponent}
    ignored: dict                 # Meta's ignored_basis_change_dims: {order: [dims]}
    merge: Any                    # shape -> merged shape (merge_dims), or None
    max_basis_dim: float
    perturb_before: bool
    use_trace_scaling: bool
    trace_scaling_exponent: float
    batched: bool = True          # same-size factors decomposed by one batched call
    kl: bool = False              # KL-SOAP: factors take in G times the other dims' roots
    kl_exponent: Any = None       # the roots' inverse exponent (None: 1 / (2 k), Meta's)


@declare(hyperparams={"beta2": HyperRole.B2, "epsilon": HyperRole.EPS, "beta1": HyperRole.B1,
                      "beta3": None, "shampoo_beta": None}, runtime=("precondition_frequency",
                                                                     "start_preconditioning_step",
                                                                     "qr_iterations", "tolerance",
                                                                     "eigenvalue_exponent",
                                                                     "trace_scaling_exponent"))
def precondition_eigenvalue_corrected(
        beta2: float = 0.999, epsilon: float = 1e-12, precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None, *, beta1: float = 0.0,
        beta3: float | None = None, first_moment_in_eigenbasis: bool = False,
        shampoo_beta: float | None = None,
        eigendecomposition: Literal["eigh", "qr", "power"] = "eigh", qr_iterations: int = 1,
        tolerance: float = 0.0, schedule: Literal["meta", "soap"] = "meta",
        preconditioner_dtype: torch.dtype = torch.float32,
        basis_dtype: torch.dtype | None = None, use_bias_correction: bool = True,
        eigenvalue_exponent: float | dict = 0.5,
        ignored_basis_change_dims: dict | None = None, max_basis_dim: int | float = math.inf,
        drop_weighting_factor_on_gsquare: bool = False,
        rank_deficient: Literal["perturb_before", "perturb_after"] = "perturb_before",
        use_trace_scaling: bool = False, trace_scaling_exponent: float = 0.5,
        merge_dims: Callable[[tuple[int, ...]], Sequence[int]] | None = None,
        batched_refresh: bool = True, kl_shampoo: bool = False,
        kl_exponent: float | None = None) -> GradientTransformation:
    r"""Eigenvalue-corrected Shampoo (SOAP): Adam's second moment kept in the eigenbasis of
    Shampoo's factors.

    For a leaf :math:`G` of order :math:`k` (a block inside `block_by_dims`) and each dim
    :math:`i` that is rotated,

    .. math::
        L_i \leftarrow \beta_s L_i + w_s\, G \otimes_i G, \qquad
        Q_i \leftarrow \operatorname{eigvecs}(L_i / b_t + \epsilon I)
        \text{ every } f \text{ steps},

    .. math::
        \tilde G = G \times_1 Q_1^\top \cdots \times_k Q_k^\top, \qquad
        \nu \leftarrow \beta_2 \nu + w\, \tilde G^{2}, \qquad
        u = \Big(\frac{\tilde X}{(\nu / b_t)^{e} + \epsilon}\Big)
        \times_1 Q_1 \cdots \times_k Q_k

    where :math:`X` is the input (``extra_args[PRECONDITION_INPUT]`` inside `graft`, Meta's
    filtered gradient; else the gradient), or with ``beta1 > 0`` the transform's own EMA
    :math:`m_t = \beta_1 m_{t-1} + (1 - \beta_1) G` made into Meta's filtered gradient
    :math:`(\beta_3 m_{t-1} + (1 - \beta_3) G) / (1 - \beta_3 \beta_1^{t-1})` (``"meta"``, as
    `graft` computes it) or Adam's :math:`m_t / (1 - \beta_1^t)` (``"soap"``);
    :math:`w = 1 - \beta_2` (1 when :math:`\beta_2 = 1`: Adagrad in the eigenbasis),
    :math:`b_t = 1 - \beta_2^t`, :math:`e = 1/2` (``eigenvalue_exponent``). A dim that is not
    rotated (``ignored_basis_change_dims``, a size above ``max_basis_dim``) keeps the standard
    basis and no factor. See the module docstring for the two schedules (``"meta"``: Meta's
    order; ``"soap"``: the SOAP paper's, with a zero first update) and how Meta, SOAP and
    heavyball differ.

    Args:
      beta2: decay of the second moment (and of the factors unless ``shampoo_beta``).
      epsilon: added to the factors before ``eigh`` (``perturb_before``) and to the root of
        the second moment.
      precondition_frequency: refresh the bases every this many steps (``"soap"``: Adam steps).
      start_preconditioning_step: first refresh (``"meta"``; default the frequency).
      beta1: keep an EMA of the gradient and precondition it instead of the input (the SOAP
        schedule's Adam; with ``"meta"``, Meta's filtered gradient).
      beta3: Meta's ``beta3``, the weight of the EMA in what is preconditioned (``"meta"``;
        default ``beta1``).
      first_moment_in_eigenbasis: keep the EMA rotated into the bases, as heavyball's SOAP
        does: :math:`\tilde m \leftarrow \beta_1 \tilde m + (1 - \beta_1) \tilde G` reuses the
        rotation of the gradient that the second moment needs, so two matrix products per 2-D
        block fewer every step (six instead of eight); each refresh carries :math:`\tilde m`
        from the old bases to the new ones (four products, refresh steps only). The same
        numbers in exact arithmetic; rounding differs, which matters only where Shampoo's own
        rounding does (the null space of a rank-deficient factor at a tiny ``epsilon``).
        Needs ``beta1 > 0``.
      shampoo_beta: decay of the factors (SOAP's name; default ``beta2``).
      eigendecomposition: ``"eigh"``; ``"qr"``: Meta's QR algorithm (``qr_iterations`` steps
        of :math:`B = Q^\top A Q = Q' R`, :math:`Q \leftarrow Q Q'`, columns sorted by the
        ascending diagonal of :math:`B`); ``"power"``: SOAP's one power step
        :math:`Q \leftarrow \operatorname{qr}(A\, Q_\sigma)` with columns sorted by descending
        :math:`\operatorname{diag}(Q^\top A Q)` and :math:`\nu` permuted the same way.
      tolerance: skip the refresh (or stop the QR iterations) when
        :math:`\lVert B - \operatorname{diag} B\rVert_F \le \text{tolerance}\,\lVert B\rVert_F`
        (Meta's criterion; 0 never skips).
      schedule: ``"meta"`` or ``"soap"``.
      preconditioner_dtype: dtype of the factors (Meta's ``factor_matrix_dtype``).
      basis_dtype: dtype of the bases and of :math:`\nu` (Meta's
        ``factor_matrix_eigenvectors_dtype``/``corrected_eigenvalues_dtype``; default
        ``preconditioner_dtype``).
      use_bias_correction: divide by :math:`1 - \beta^t` (factors and :math:`\nu`).
      eigenvalue_exponent: :math:`e`, or Meta's ``inverse_exponent_override`` ``{order: e}``.
      ignored_basis_change_dims: Meta's ``{order: [dims]}`` of dims kept in the standard basis.
      max_basis_dim: dims larger than this are not rotated (SOAP's ``max_precond_dim``).
      drop_weighting_factor_on_gsquare, rank_deficient, use_trace_scaling,
        trace_scaling_exponent: Meta's options of these names (``rank_deficient`` is its
        ``PerturbationConfig(perturb_before_computation=...)``).
      merge_dims: a leaf's shape -> the shape it is preconditioned in (same number of
        elements; `merge_dims_soap`, `merge_dims_heavyball`), as SOAP's and heavyball's
        ``merge_dims``: the factors and bases are those of the merged dims, the moments stay
        in the leaf's shape (a reshape, no copy), the update comes back in the leaf's shape.
        ``ignored_basis_change_dims`` then only takes ``{1: [0]}``, read on the leaf as
        given: 1-D leaves stay in the standard basis while a matrix merged into one dim is
        rotated, as the SOAP reference code does. (Meta's merging is `block_by_dims`
        around this transform.)
      batched_refresh: a refresh decomposes the factors of all leaves together, the
        same-size ones (across leaves and blocks, and across the leaves a rank owns under
        `opttx.distributed.on_owners`) stacked into one batched ``eigh`` or ``qr`` call per
        size group (`opttx.transforms.matrix_functions.grouped_eigh`); each factor still
        keeps its previous basis on its own when its result is not finite. The same numbers
        as one call per factor, bit for bit on CPU; on CUDA the batched solver's rounding.
        ``False``: one call per factor (for debugging).
      kl_shampoo: KL-SOAP, Meta's KL-Shampoo (Lin et al., arXiv 2509.03378) in the
        eigenvalue-corrected form (``schedule="meta"``, ``eigendecomposition`` ``"eigh"``
        or ``"qr"``): factor :math:`i` takes in the gradient preconditioned along every
        *other* dim by the inverse roots of those factors as of the last refresh,

        .. math::
            L_i \leftarrow \beta_s L_i + w_s\, (G \times_{j \ne i} R_j) \otimes_i
            (G \times_{j \ne i} R_j), \qquad R_j = Q_j \Lambda_j'^{-e_K} Q_j^\top,

        where :math:`(\Lambda_j, Q_j)` is the eigendecomposition of the refresh (of
        :math:`L_j / b_t + \epsilon I`; identity and ones before the first refresh, so the
        first factors are Shampoo's), :math:`\Lambda_j'` the eigenvalues made positive by
        ``rank_deficient``'s rule (`inverse_root_from_eigendecomposition`) and
        :math:`e_K = 1/(2K)` for a leaf of order :math:`K` (Meta's default inverse exponent;
        ``kl_exponent`` replaces it: the paper's KL-Shampoo takes :math:`1/2` for matrices).
        The state keeps the refresh's eigenvalues beside the bases (``eigenvalues``); the
        second moment, the bases and the update are SOAP's as above. Formed in the bases'
        dtype, as `precondition_shampoo`'s ``kl_shampoo`` forms it in the roots' dtype.

    Example:
      >>> tx = opttx.block_by_dims(opttx.precondition_eigenvalue_corrected(0.95, 1e-8, 10))

    References:
      George et al., Fast Approximate Natural Gradient Descent in a Kronecker-factored
      Eigenbasis (arXiv 1806.03884); Vyas et al., SOAP: Improving and Stabilizing Shampoo
      using Adam (arXiv 2409.11321); Shi et al. (arXiv 2309.06497).
    """
    cfg = _ec_config(
        beta1=beta1, beta3=beta3, first_moment_in_eigenbasis=first_moment_in_eigenbasis,
        beta2=beta2, shampoo_beta=shampoo_beta, epsilon=epsilon,
        precondition_frequency=precondition_frequency,
        start_preconditioning_step=start_preconditioning_step,
        eigendecomposition=eigendecomposition, qr_iterations=qr_iterations,
        tolerance=tolerance, schedule=schedule, preconditioner_dtype=preconditioner_dtype,
        basis_dtype=basis_dtype, use_bias_correction=use_bias_correction,
        eigenvalue_exponent=eigenvalue_exponent,
        ignored_basis_change_dims=ignored_basis_change_dims, max_basis_dim=max_basis_dim,
        drop_weighting_factor_on_gsquare=drop_weighting_factor_on_gsquare,
        rank_deficient=rank_deficient, use_trace_scaling=use_trace_scaling,
        trace_scaling_exponent=trace_scaling_exponent, merge_dims=merge_dims)
    cfg = dataclasses.replace(cfg, batched=bool(batched_refresh), kl=bool(kl_shampoo),
                              kl_exponent=kl_exponent)
    if cfg.kl and (cfg.schedule != "meta" or cfg.method not in ("eigh", "qr")):
        raise ValueError("kl_shampoo (KL-SOAP) forms its roots from the eigendecompositions of "
                         "Meta's schedule: it takes schedule='meta' and eigendecomposition "
                         f"'eigh' or 'qr', got {cfg.schedule!r} and {cfg.method!r}.")
    if kl_exponent is not None and not kl_exponent > 0:
        raise ValueError(f"kl_exponent must be > 0, got {kl_exponent!r}.")

    def init(params: Params) -> EigenvalueCorrectedState:
        check_init_params(params)
        return EigenvalueCorrectedState(
            count=zero_count(params),
            factors=tree_map(lambda x: _empty_mats(x, cfg, cfg.dtype, torch.zeros), params),
            bases=tree_map(lambda x: _empty_mats(x, cfg, cfg.basis_dtype, _eye), params),
            mu=(stats_like(params, cfg.basis_dtype) if cfg.eigenbasis_moment
                else stats_like(params)) if _has(cfg.beta1) else (),
            nu=stats_like(params, cfg.basis_dtype),
            eigenvalues=tree_map(lambda x: tuple(
                torch.ones(q.shape[0], dtype=q.dtype, device=q.device)
                for q in _empty_mats(x, cfg, cfg.basis_dtype, _eye)), params) if cfg.kl else ())

    def update(updates: Updates, state: EigenvalueCorrectedState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EigenvalueCorrectedState]:
        require_whole_leaves(updates, extra_args, "precondition_eigenvalue_corrected")
        return _update_ec(updates, state, precondition_target(updates, extra_args), cfg)

    return GradientTransformation(init, update, Traits(per_leaf=True, whole_leaves=True,
                                                       takes_precondition_input=True))


def _ec_config(*, beta1, beta3, first_moment_in_eigenbasis, beta2, shampoo_beta, epsilon,
               precondition_frequency, start_preconditioning_step, eigendecomposition,
               qr_iterations, tolerance, schedule, preconditioner_dtype, basis_dtype,
               use_bias_correction, eigenvalue_exponent, ignored_basis_change_dims, max_basis_dim,
               drop_weighting_factor_on_gsquare, rank_deficient, use_trace_scaling,
               trace_scaling_exponent, merge_dims=None) -> _ECConfig:
    """Validate `precondition_eigenvalue_corrected`'s arguments into an `_ECConfig`."""
    check_unit_interval("beta1", beta1, closed_right=False)
    beta3 = beta1 if beta3 is None else beta3
    check_unit_interval("beta3", beta3, closed_right=False)
    if first_moment_in_eigenbasis and not _has(beta1):
        raise ValueError("first_moment_in_eigenbasis keeps the EMA of the gradient (beta1) in "
                         "the eigenbasis: it needs beta1 > 0.")
    check_unit_interval("beta2", beta2, closed_right=True)
    sbeta = beta2 if shampoo_beta is None else shampoo_beta
    check_unit_interval("shampoo_beta", sbeta, closed_right=True)
    check_nonnegative("epsilon", epsilon)
    check_positive_int("precondition_frequency", precondition_frequency)
    check_positive_int("qr_iterations", qr_iterations)
    start = precondition_frequency if start_preconditioning_step is None \
        else start_preconditioning_step
    check_nonnegative("start_preconditioning_step", start)
    check_unit_interval("tolerance", tolerance, closed_right=True)
    for name, value, allowed in (("eigendecomposition", eigendecomposition,
                                  ("eigh", "qr", "power")),
                                 ("schedule", schedule, ("meta", "soap")),
                                 ("rank_deficient", rank_deficient,
                                  ("perturb_before", "perturb_after"))):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")
    exps = eigenvalue_exponent.values() if isinstance(eigenvalue_exponent, dict) \
        else [eigenvalue_exponent]
    if any(not e > 0 for e in exps):
        raise ValueError(f"eigenvalue_exponent must be > 0, got {eigenvalue_exponent!r}.")
    ignored = dict(ignored_basis_change_dims or {})
    for order, dims in ignored.items():
        if order < 0 or any(not 0 <= d <= max(order - 1, 0) for d in dims):
            raise ValueError(f"ignored_basis_change_dims[{order}]={dims!r}: dims must be in "
                             f"[0, {max(order - 1, 0)}].")
    if merge_dims is not None and any(order != 1 for order in ignored):
        raise ValueError(f"ignored_basis_change_dims={ignored!r} with merge_dims: only "
                         "{1: [0]} (leaves that are 1-D as given) is defined on merged leaves.")
    if max_basis_dim != math.inf:
        check_positive_int("max_basis_dim", max_basis_dim)
    if use_trace_scaling and _number(trace_scaling_exponent) \
            and not 0.0 < trace_scaling_exponent <= 1.0:
        raise ValueError(f"trace_scaling_exponent must be in (0, 1], got "
                         f"{trace_scaling_exponent}.")
    drop = drop_weighting_factor_on_gsquare
    return _ECConfig(
        beta1=beta1, beta3=beta3, eigenbasis_moment=bool(first_moment_in_eigenbasis),
        moment_correction=use_bias_correction, beta2=beta2, weight=_weight(beta2, drop),
        factor=_FactorDecay(beta2=sbeta, weight=_weight(sbeta, drop)),
        epsilon=epsilon, frequency=precondition_frequency, start=start,
        method=eigendecomposition, qr_iterations=qr_iterations, tolerance=tolerance,
        schedule=schedule, dtype=preconditioner_dtype,
        basis_dtype=preconditioner_dtype if basis_dtype is None else basis_dtype,
        bias_correction=use_bias_correction and not drop
        and (not _number(beta2) or beta2 < 1),
        exponent=eigenvalue_exponent, ignored=ignored, max_basis_dim=max_basis_dim,
        perturb_before=rank_deficient == "perturb_before", use_trace_scaling=use_trace_scaling,
        trace_scaling_exponent=trace_scaling_exponent, merge=merge_dims)


def _number(value: Any) -> bool:
    """A Python number (not an injected 0-dim tensor, whose value may change)."""
    return not isinstance(value, torch.Tensor)


def _has(value: Any) -> bool:
    """An optional term is present: an injected value (a tensor, or a `LiveFloat` in an
    eager step) always is, a number when not 0."""
    return not is_fixed_zero(value)


def _weight(beta: Any, drop: bool) -> Any:
    """Meta's weighting factor: 1 when beta = 1 (a sum) or dropped, else 1 - beta."""
    if drop:
        return 1.0
    if _number(beta):
        return 1.0 if beta == 1 else 1 - beta
    return torch.where(beta == 1, torch.ones_like(beta), 1 - beta)


def _factors_after(g: torch.Tensor, fs: tuple, cfg: _ECConfig,
                   kl_roots: tuple | None = None) -> tuple:
    """Shampoo's factor update (`update_factors`; with ``kl_roots``, KL-Shampoo's: factor k
    takes in ``g`` times the roots of the other dims); with an injected decay the same
    sum written for tensors."""
    if _number(cfg.factor.beta2):
        return update_factors(g, fs, cfg.factor, kl_roots)
    g = g.reshape(g.shape or (1,)).to(state_dtype(g))
    return tuple(f if f.shape[0] != g.shape[k] else
                 (f * cfg.factor.beta2 + cfg.factor.weight * contract_factor(
                     g if kl_roots is None else _by_other_roots(g, kl_roots, k), k)).to(f.dtype)
                 for k, f in enumerate(fs))


def _kl_roots(bases: tuple, values: tuple, cfg: _ECConfig) -> tuple:
    r"""KL-SOAP: one leaf's inverse roots :math:`Q \Lambda'^{-e} Q^T` from the refresh's
    eigendecompositions (``(0, 0)`` for a dim not rotated)."""
    root = 1 / cfg.kl_exponent if cfg.kl_exponent is not None else 2 * len(bases)
    rule = "perturb_before" if cfg.perturb_before else "perturb_after"
    return tuple(q if not q.shape[0] else
                 inverse_root_from_eigendecomposition(v, q, root, cfg.epsilon, rule)
                 for q, v in zip(bases, values))


def _eye(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.eye(shape[0], dtype=dtype, device=device)


def _rotated_dims(shape: tuple[int, ...], cfg: _ECConfig,
                  order: int | None = None) -> list[bool]:
    """Which dims of a leaf of this shape (at least 1-D) are rotated into an eigenbasis;
    ``order``: the leaf's own order where ``shape`` is its merged shape."""
    ignored = cfg.ignored.get(len(shape) if order is None else order, ())
    return [d not in ignored and n <= cfg.max_basis_dim for d, n in enumerate(shape)]


def _merged_shape(shape: torch.Size | tuple, cfg: _ECConfig) -> tuple[int, ...]:
    """The shape a leaf is preconditioned in: ``merge_dims``'s, else its own (1-D at least)."""
    if cfg.merge is None:
        return tuple(shape) or (1,)
    merged = tuple(int(d) for d in cfg.merge(tuple(shape)))
    if math.prod(merged) != math.prod(shape) or not merged:
        raise ValueError(f"merge_dims gave {merged} for a leaf of shape {tuple(shape)}: "
                         "it must keep the number of elements.")
    return merged


def _empty_mats(x: torch.Tensor, cfg: _ECConfig, dtype: torch.dtype, make) -> tuple:
    """One matrix per (merged) dim of ``x`` (zeros or identities), (0, 0) for a dim not
    rotated."""
    shape = _merged_shape(x.shape, cfg)
    rotated = _rotated_dims(shape, cfg, max(x.dim(), 1) if cfg.merge is not None else None)
    return tuple(make((d, d) if r else (0, 0), dtype=dtype, device=x.device)
                 for d, r in zip(shape, rotated))


def merge_dims_soap(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """The SOAP reference code's ``merge_dims``: walking from the first dim, multiply dims
    together while the product stays <= ``max_dim``; a dim larger than ``max_dim`` stands
    alone; size-1 dims vanish (a shape of ones is ``(1,)``).

    >>> merge_dims_soap((128, 64, 3, 3), 10000)
    (8192, 9)
    >>> merge_dims_soap((1, 2, 512, 1, 2048, 1, 3, 4), 1024)
    (1024, 2048, 12)
    """
    merged, current = _products_up_to(shape, max_dim)
    if current > 1 or not merged:
        merged.append(current)
    return tuple(merged)


def merge_dims_heavyball(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """heavyball's ``merge_dims`` (its ``dim_merger`` without ``split``): dim 0 (fan-out)
    stays; the others merge from the last one while the product stays <= ``max_dim``, so a
    convolution's kernel goes into its fan-in; size-1 dims among them vanish.

    >>> merge_dims_heavyball((128, 64, 3, 3), 10000)
    (128, 576)
    >>> merge_dims_heavyball((128, 64, 3, 3), 100)
    (128, 64, 9)
    """
    if len(shape) <= 1 or 0 in shape:
        return tuple(shape) or (1,)
    merged, current = _products_up_to(reversed(shape[1:]), max_dim)
    if current > 1:
        merged.append(current)
    return (shape[0], *reversed(merged))


def _products_up_to(dims: Iterable[int], max_dim: int) -> tuple[list[int], int]:
    """The merging walk both rules share: ``dims`` in walking order multiplied together while
    the product stays <= ``max_dim`` (a larger dim alone); the finished products and the
    running one."""
    merged: list[int] = []
    current = 1
    for d in dims:
        if current * d <= max_dim:
            current *= d
        elif current > 1:
            merged.append(current)
            current = d
        else:
            merged.append(d)
    return merged, current


def _rotate(x: torch.Tensor, bases: tuple, back: bool = False) -> torch.Tensor:
    """``x`` times every basis along its dim (``Q^T`` into the eigenbasis, ``Q`` back), computed
    in the bases' dtype as Meta does: each step contracts the leading dim and appends the result
    as the last one; a dim not rotated is moved to the end unchanged."""
    dtype = next((q.dtype for q in bases if q.shape[0]), x.dtype)
    y = x.reshape(x.shape or (1,)).to(dtype)
    for q in bases:
        if q.shape[0] == 0:
            y = y.permute(*range(1, y.dim()), 0)
        else:
            y = torch.tensordot(y, q, dims=([0], [1 if back else 0]))
    return y.reshape(x.shape).to(x.dtype)


def _refresh(factors: list[tuple], bases: list[tuple], scale: torch.Tensor | None,
             cfg: _ECConfig, method: str, values: list[tuple] | None = None):
    """New bases of every leaf's factors, computed as Meta computes them (``eigh`` or Meta's
    QR, `decompose_factors`: same-size factors of all leaves in one batched call); a factor
    whose input or result is not finite keeps its old basis, dims not rotated keep their
    empty one. With ``values`` (KL-SOAP) also the new eigenvalues: returns both."""
    flat_f = [f for fs in factors for f in fs]
    flat_q = [q for qs in bases for q in qs]
    flat_v = [v for vs in values for v in vs] if values is not None else [None] * len(flat_q)
    todo = [i for i, q in enumerate(flat_q) if q.shape[0]]
    decs = decompose_factors([(*prepared_factor(flat_f[i], scale, cfg), flat_q[i], flat_v[i])
                              for i in todo], cfg.perturb_before, cfg.epsilon,
                             "qr" if method == "qr" else "eigh", cfg.qr_iterations,
                             cfg.tolerance, batched=cfg.batched)
    new, new_v = list(flat_q), list(flat_v)
    for i, (v, q, _) in zip(todo, decs):
        new[i], new_v[i] = q, v
    counts = [len(qs) for qs in bases]
    who = "precondition_eigenvalue_corrected"
    out = [tuple(c) for c in chunks(new, counts, who)]
    if values is None:
        return out
    return out, [tuple(c) for c in chunks(new_v, counts, who)]


def _power_refresh(factors: list[tuple], bases: list[tuple], nu: list[torch.Tensor],
                   batched: bool = True) -> tuple[list[tuple], list[torch.Tensor]]:
    """SOAP's refresh: per rotated dim k, sort the columns of ``Q`` by descending
    ``diag(Q^T L Q)``, permute ``nu`` along dim k the same way, ``Q <- qr(L Q_sorted)`` (the
    ``qr`` of same-size products of all leaves in one batched call, `grouped_qr`)."""
    products, slots, new_bases, new_nu = [], [], [], []
    for j, (fs, qs, v) in enumerate(zip(factors, bases, nu)):
        # a new tensor (torch.cond refuses an output that is a view of an operand)
        v = v.reshape(v.shape or (1,)).clone()
        for k, (f, q) in enumerate(zip(fs, qs)):
            if not q.shape[0]:
                continue
            f = from_upper(f)
            product = f @ q.to(f.dtype)
            order = torch.argsort((q.to(f.dtype) * product).sum(dim=0), descending=True)
            v = v.index_select(k, order)
            products.append(product.index_select(1, order))
            slots.append((j, k))
        new_bases.append(list(qs))
        new_nu.append(v)
    for (j, k), (q, _) in zip(slots, grouped_qr(products, batched)):
        new_bases[j][k] = q.to(bases[j][k].dtype).contiguous()
    return [tuple(qs) for qs in new_bases], [v.reshape(n.shape) for v, n in zip(new_nu, nu)]


def _eigen_scale(order: int, cfg: _ECConfig) -> float:
    """Meta's exponent of the corrected eigenvalues: ``1 / root``, root ``1 / e``."""
    e = cfg.exponent.get(order, 0.5) if isinstance(cfg.exponent, dict) else cfg.exponent
    return 1 / (1 / e)


def _adam_in_basis(x: list[torch.Tensor], bases: list[tuple], nu: list[torch.Tensor],
                   scale: torch.Tensor | None, cfg: _ECConfig,
                   rotated: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``Q[(Q^T x Q) / ((nu / scale)^e + eps)]Q^T`` for every leaf (Meta's order of ops): the
    rotations per leaf (matrix products), the element-wise part in grouped kernels, one
    ``pow`` per distinct exponent. ``rotated`` is ``Q^T x Q`` when it is already at hand (the
    EMA kept in the eigenbasis); ``x`` is then not read."""
    if not nu:
        return []
    if rotated is None:
        rotated = [_rotate(xi, qs) for xi, qs in zip(x, bases)]
    denom = list(nu) if scale is None else foreach("div", nu, scale)
    exponents = [_eigen_scale(max(xi.dim(), 1), cfg) for xi in rotated]
    for e in dict.fromkeys(exponents):
        group = [i for i, f in enumerate(exponents) if f == e]
        for i, d in zip(group, foreach("pow", [denom[i] for i in group], e)):
            denom[i] = d
    y = cast_like(foreach("div", rotated, foreach("add", denom, cfg.epsilon)), rotated)
    return [_rotate(yi, qs, back=True) for yi, qs in zip(y, bases)]


def _in_bases(g: list[torch.Tensor], bases: list[tuple], nu: list[torch.Tensor]
              ) -> list[torch.Tensor]:
    """``Q^T g Q`` for every leaf, in the dtype of ``nu`` (the second moment's)."""
    return cast_like([_rotate(gi, qs) for gi, qs in zip(g, bases)], nu)


def _second_moment(rotated: list[torch.Tensor], nu: list[torch.Tensor], cfg: _ECConfig
                   ) -> list[torch.Tensor]:
    """``nu <- beta2 nu + w (Q^T g Q)^2``: the squared gradient in the eigenbases (``rotated``
    is `_in_bases` of the gradient)."""
    nu = foreach("mul", nu, cfg.beta2) if not _number(cfg.beta2) or cfg.beta2 != 1 \
        else list(nu)
    return foreach("addcmul", nu, rotated, rotated, value=cfg.weight)


def _first_moment(g: list[torch.Tensor], mu: list[torch.Tensor], steps: torch.Tensor,
                  cfg: _ECConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The EMA of the gradient (in whichever basis ``g`` and ``mu`` are) and what is
    preconditioned: ``"meta"``, Meta's filtered gradient as `graft` computes it,
    ``(beta3 m_{t-1} + (1 - beta3) g) / (1 - beta3 beta1^{t-1})`` (float32 correction);
    ``"soap"``, Adam's ``m_t / (1 - beta1^t)`` (float64 correction, Adam's step count)."""
    if cfg.schedule == "meta":
        return filtered_gradient(mu, g, cfg.beta1, cfg.beta3, steps, cfg.moment_correction)
    mu = foreach_ema(mu, g, cfg.beta1)
    if not cfg.moment_correction:
        return mu, list(mu)
    correction = 1.0 - torch.pow(torch.as_tensor(cfg.beta1, dtype=torch.float64), steps)
    return mu, foreach("div", mu, correction)


def _rebased(mu: list[torch.Tensor], old: list[tuple], new: list[tuple]) -> list[torch.Tensor]:
    """The EMA kept in the eigenbasis carried from the ``old`` bases to the ``new`` ones:
    ``Q_new^T (Q_old m Q_old^T) Q_new`` (exact for orthogonal bases, up to rounding). A leaf
    with no rotated dim is ``m`` itself (its rotations would be views of ``m``, which a
    ``torch.cond`` branch may not return; ``m`` itself it copies)."""
    return [_rotate(_rotate(m, qo, back=True), qn) if any(q.shape[0] for q in qn) else m
            for m, qo, qn in zip(mu, old, new)]


def _meta_step(g, x, factors, bases, nu, mu, count, cfg, values=None):
    """Meta's order: factors, refresh when due, second moment, precondition (new bases).
    KL-SOAP (``values``, the refresh's eigenvalues): the factors take in the gradient times
    the other dims' roots of the last refresh, and the refresh renews the eigenvalues too."""
    if cfg.kl:
        factors = [_factors_after(gi, fs, cfg, _kl_roots(qs, vs, cfg))
                   for gi, fs, qs, vs in zip(g, factors, bases, values)]
    else:
        factors = [_factors_after(gi, fs, cfg) for gi, fs in zip(g, factors)]
    due = ((count % cfg.frequency == 0) & (count > cfg.start)) | (count == cfg.start)
    fscale = meta_bias_correction(cfg.factor.beta2, count) \
        if cfg.bias_correction and (not _number(cfg.factor.beta2) or cfg.factor.beta2 < 1) \
        else None
    if cfg.kl:
        if cfg.eigenbasis_moment:
            def refresh_kl(b, v, m):
                new, new_v = _refresh(factors, b, fscale, cfg, cfg.method, v)
                return new, new_v, _rebased(m, b, new)
            bases, values, mu = tree_cond(due, refresh_kl, lambda b, v, m: (b, v, m),
                                          (bases, values, mu))
        else:
            bases, values = tree_cond(
                due, lambda b, v: _refresh(factors, b, fscale, cfg, cfg.method, v),
                lambda b, v: (b, v), (bases, values))
    elif cfg.eigenbasis_moment:
        def refresh(b, m):
            new = _refresh(factors, b, fscale, cfg, cfg.method)
            return new, _rebased(m, b, new)
        bases, mu = tree_cond(due, refresh, lambda b, m: (b, m), (bases, mu))
    else:
        (bases,) = tree_cond(due, lambda b: (_refresh(factors, b, fscale, cfg, cfg.method),),
                             lambda b: (b,), (bases,))
    g_rot = _in_bases(g, bases, nu)
    nu = _second_moment(g_rot, nu, cfg)
    rotated = None
    if _has(cfg.beta1):
        if cfg.eigenbasis_moment:      # Q^T x Q from the gradient's rotation: no product
            mu, rotated = _first_moment(g_rot, mu, count, cfg)
        else:
            mu, x = _first_moment(g, mu, count, cfg)
    scale = meta_bias_correction(cfg.beta2, count) if cfg.bias_correction else None
    out = _adam_in_basis(x, bases, nu, scale, cfg, rotated), factors, bases, nu, mu
    return out + (values,) if cfg.kl else out


def _soap_step(g, x, factors, bases, nu, mu, count, cfg):
    """The SOAP paper's order: the first gradient initialises the factors and the bases (zero
    update); then Adam in the previous bases, the factors, and a refresh every ``frequency``
    Adam steps."""
    first = count == 1
    steps = torch.clamp(count - 1, min=1)                     # Adam's step count
    g_rot = _in_bases(g, bases, nu)
    new_nu = _second_moment(g_rot, nu, cfg)
    rotated = None
    if _has(cfg.beta1):
        # out of place: the old EMA is kept on the first step (read by the where below),
        # then written into its own buffers when the state is donated
        with keeping_state():
            if cfg.eigenbasis_moment:
                new_mu, rotated = _first_moment(g_rot, mu, steps, cfg)
            else:
                new_mu, x = _first_moment(g, mu, steps, cfg)
        mu = new_buffers(mu, [torch.where(first, m, n) for m, n in zip(mu, new_mu)])
    scale = 1.0 - torch.pow(torch.as_tensor(cfg.beta2, dtype=torch.float64), steps) \
        if cfg.bias_correction else None
    out = [torch.where(first, torch.zeros_like(u), u)
           for u in _adam_in_basis(x, bases, new_nu, scale, cfg, rotated)]
    nu = [torch.where(first, n, m) for n, m in zip(nu, new_nu)]
    factors = [_factors_after(gi, fs, cfg) for gi, fs in zip(g, factors)]
    due = (count - 1) % cfg.frequency == 0                    # read after the first step
    # through the branches: the bases, nu when the power step permutes it, the EMA when it
    # is kept in the eigenbasis
    power, eig = cfg.method == "power", cfg.eigenbasis_moment

    def first_bases(b, *rest):
        # eigh of the first factors (the EMA is still zero: nothing to carry)
        return (_refresh(factors, b, None, cfg, "eigh"),) + rest

    def refresh(b, *rest):
        n, m = (rest[0] if power else None), (rest[-1] if eig else None)
        if power:
            new, n = _power_refresh(factors, b, n, cfg.batched)
        else:
            new = _refresh(factors, b, None, cfg, cfg.method)
        return (new,) + ((n,) if power else ()) + ((_rebased(m, b, new),) if eig else ())
    # the periodic refresh nested in the first step's branch: one cond per step, so what is
    # kept unchanged is copied once (torch.cond returns copies of operands it passes through)
    carried = tree_cond(first, first_bases,
                        lambda *ops: tree_cond(due, refresh, lambda *o: o, ops),
                        (bases,) + ((nu,) if power else ()) + ((mu,) if eig else ()))
    bases = carried[0]
    nu = carried[1] if power else nu
    mu = carried[-1] if eig else mu
    return out, factors, bases, nu, mu


def _update_ec(updates: Updates, state: EigenvalueCorrectedState, target: Updates,
               cfg: _ECConfig) -> tuple[Updates, EigenvalueCorrectedState]:
    """One step of `precondition_eigenvalue_corrected`."""
    spec, g = flatten_matching(updates)
    if not g:
        return updates, advance_counts(state)
    nu = flatten_matching(updates, state.nu)[2]
    # None, sparse, integer, complex or wrongly shaped gradients: refused naming the leaf
    # (nu is shaped like the params)
    check_gradient_leaves(g, nu, updates, "precondition_eigenvalue_corrected")
    x = flatten_matching(target)[1]
    mu = flatten_matching(updates, state.mu)[2] if _has(cfg.beta1) else []
    shapes = [gi.shape for gi in g]
    if cfg.merge is not None:       # every leaf (and its moments) in its merged shape
        merged = [_merged_shape(s, cfg) for s in shapes]
        g, x, nu, mu = ([t.reshape(m) for t, m in zip(ts, merged)] for ts in (g, x, nu, mu))
    orders = [max(gi.dim(), 1) for gi in g]
    who = "precondition_eigenvalue_corrected"
    factors = [tuple(c) for c in chunks(tree_flatten(state.factors)[0], orders, who)]
    bases = [tuple(c) for c in chunks(tree_flatten(state.bases)[0], orders, who)]
    count = safe_increment(state.count)
    step = _meta_step if cfg.schedule == "meta" else _soap_step
    if cfg.kl:
        values = [tuple(c) for c in chunks(tree_flatten(state.eigenvalues)[0], orders, who)]
        out, factors, bases, nu, mu, values = _meta_step(g, x, factors, bases, nu, mu, count,
                                                         cfg, values)
        eigenvalues = tree_unflatten([v for vs in values for v in vs],
                                     tree_structure(state.eigenvalues))
    else:
        out, factors, bases, nu, mu = step(g, x, factors, bases, nu, mu, count, cfg)
        eigenvalues = ()
    mat_spec = tree_structure(state.factors)
    out = [o.to(gi.dtype) for o, gi in zip(out, g)]
    if cfg.merge is not None:
        out, nu, mu = ([t.reshape(s) for t, s in zip(ts, shapes)] for ts in (out, nu, mu))
    return tree_unflatten(out, spec), EigenvalueCorrectedState(
        count=count,
        factors=tree_unflatten([m for fs in factors for m in fs], mat_spec),
        bases=tree_unflatten([m for qs in bases for m in qs], mat_spec),
        mu=tree_unflatten(mu, spec) if _has(cfg.beta1) else (), nu=tree_unflatten(nu, spec),
        eigenvalues=eigenvalues, made_by=state.made_by)
