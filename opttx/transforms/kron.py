"""PSGD-Kron (`scale_by_kron`): a Kronecker-factored preconditioner fitted by Li's PSGD rule,
one factor per dim (upper triangular, or diagonal for large or size-1 dims and vectors).

The alias `opttx.kron` chains it with weight decay (on matrices) and the learning rate.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, NamedTuple

import torch

from .._checks import check_nonnegative, check_positive, check_positive_int, check_unit_interval
from ..base import (GradientTransformation, HyperRole, Params, Role, Traits, Updates,
                    check_init_params, declare, declare_roles, replace_state,
                    require_whole_leaves, zero_count)
from ..skeleton import leafwise
from ..kernels import mark_scratch
from ..tree import Static, state_dtype, tree_flatten, tree_unflatten
from .counter_hash import hash32

__all__ = ["ScaleByKronState", "kron_merged_shape", "kron_noise", "scale_by_kron"]

MemorySaveMode = Literal["smart_one_diag", "one_diag", "all_diag"] | None


class ScaleByKronState(NamedTuple):
    """State of `scale_by_kron`."""
    count: torch.Tensor      # shape (), int32: steps taken
    mu: Updates              # like params (merged dims kept as the params'): momentum
    q: Updates               # per leaf, a tuple of factors, one per (merged) dim: (n, n)
    #                          upper triangular or (n,) diagonal, float32 unless precond_dtype
    since_update: torch.Tensor  # shape (), int32: steps since the preconditioner was updated
    updates_done: torch.Tensor  # shape (), int32: preconditioner updates so far (balancing)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, q=Role.FACTOR_MATRIX)


def kron_merged_shape(shape: tuple[int, ...], merge_dims: bool = True) -> tuple[int, ...]:
    """The shape a leaf is preconditioned as: a leaf of more than two dims becomes a matrix,
    (all but the last, last) or (first, all but the first), by kron-torch's rule (the first
    when its signed difference last - first is not larger, which holds for every shape: so
    always the first)."""
    if len(shape) <= 2 or not merge_dims:
        return tuple(shape)
    s1 = (math.prod(shape[:-1]), shape[-1])
    s2 = (shape[0], math.prod(shape[1:]))
    return s1 if s1[1] - s1[0] <= s2[1] - s2[0] else s2


def kron_noise(shape: tuple[int, ...], seed: int, step: torch.Tensor | int,
               dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The standard normal probe :math:`V` of a (merged) leaf of ``shape`` at ``step``
    (1-based): Box–Muller on a counter-based hash of (``seed``, the shape, ``step``, the
    element), so a step is a pure function of the state, the same on every rank, layout and
    `opttx.stacked` slice (leaves of one shape share their probe; kron-torch draws
    ``torch.randn_like`` from the global generator)."""
    n = math.prod(shape)
    e = torch.arange(2 * n, dtype=torch.int64, device=device)
    step = torch.as_tensor(step, dtype=torch.int64, device=device)
    tag = seed
    for d in shape:
        tag = (tag * 1_000_003 + d + 1) & 0xFFFFFFFF
    key = hash32(hash32(torch.tensor(tag, device=device)) + step)
    h = hash32(hash32(e ^ key) + (e >> 32))
    u = (h.double() + 0.5) / 2.0**32
    u1, u2 = u[0::2], u[1::2]
    z = (-2 * u1.log()).sqrt() * torch.cos(2 * math.pi * u2)
    return z.reshape(shape).to(dtype)


def _diagonal_dims(shape: tuple[int, ...], max_size: int, min_ndim_triangular: int,
                   memory_save_mode: MemorySaveMode) -> list[bool]:
    if memory_save_mode is None:
        diag = [False] * len(shape)
    elif memory_save_mode == "all_diag":
        diag = [True] * len(shape)
    else:
        diag = [False] * len(shape)
        # the reverse of a stable ascending argsort (numpy's, as kron-torch): ties go to the
        # later dim
        order = list(reversed(sorted(range(len(shape)), key=lambda i: shape[i])))
        sorted_shape = sorted(shape)
        if memory_save_mode == "one_diag" or (
                len(shape) > 1 and sorted_shape[-1] > sorted_shape[-2]):
            if shape:
                diag[order[0]] = True
    return [d or n == 1 or n > max_size or len(shape) < min_ndim_triangular
            for d, n in zip(diag, shape)]


def _mode_product(x: torch.Tensor, m: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``m`` applied along ``dim``: :math:`y_{..a..} = \\sum_b m_{ab} x_{..b..}`
    (a vector ``m`` multiplies element-wise along ``dim``)."""
    if m.dim() < 2:
        shape = [1] * x.dim()
        shape[dim] = -1
        return x * m.reshape(shape)
    return torch.movedim(torch.tensordot(m, x, dims=([1], [dim])), 0, dim)


def _gram(x: torch.Tensor, dim: int, diagonal: bool) -> torch.Tensor:
    """:math:`X_{(d)} X_{(d)}^\\top` over all other dims (its diagonal for a diagonal
    factor)."""
    xm = torch.movedim(x, dim, 0).reshape(x.shape[dim], -1)
    if diagonal:
        return (xm * xm).sum(dim=1)
    return xm @ xm.mT


def _lower_bound(a: torch.Tensor, max_abs: torch.Tensor) -> torch.Tensor:
    """kron-torch's cheap lower bound of the spectral norm of the symmetric ``a``: one power
    step from its column of largest norm."""
    a = a / max_abs
    i = torch.argmax((a * a).sum(dim=0))
    x = a.index_select(1, i.reshape(1)).flatten()
    x = x @ a
    x = x / x.norm()
    return (a @ x).norm() * max_abs


@declare(hyperparams={"b1": HyperRole.B1, "preconditioner_update_probability": None,
                      "precond_lr": None, "precond_init_scale": None},
         runtime=("balance_every", "seed"))
def scale_by_kron(b1: float = 0.9, preconditioner_update_probability: float |
                  Callable[[torch.Tensor], torch.Tensor] | None = None,
                  max_size_triangular: int = 8192, min_ndim_triangular: int = 2,
                  memory_save_mode: MemorySaveMode = None,
                  momentum_into_precond_update: bool = True, precond_lr: float = 0.1,
                  precond_init_scale: float = 1.0, merge_dims: bool = True,
                  balance_every: int | None = 100, seed: int = 0,
                  mu_dtype: torch.dtype | None = None,
                  precond_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""PSGD-Kron: precondition the debiased momentum by a Kronecker product of factors
    :math:`Q_i`, fitted to the gradient noise by Li's PSGD rule, and clip its RMS to 1.1.

    Per leaf (a leaf of more than two dims merged to a matrix, `kron_merged_shape`):

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad \hat m_t = m_t / (1-\beta_1^t), \quad
        u_t = \mathrm{clip}_{1.1}\Big(\hat m_t \textstyle\prod_i \times_i Q_i^\top Q_i\Big)

    where :math:`\mathrm{clip}_c(u) = u \min(1, c / (\mathrm{RMS}(u) + 10^{-12}))`. On a step
    that updates the preconditioner, with a probe :math:`V \sim N(0, I)` (`kron_noise`) and
    :math:`G = \hat m_t + \sqrt{\epsilon_{32}}\, \mathrm{mean}|\hat m_t|\, V` (the momentum
    with its probe noise, also what is preconditioned that step): :math:`A = G \prod_i \times_i
    Q_i`, :math:`B = V \prod_i \times_i Q_i^{-\top}`, and for every factor with
    :math:`T_1 = A_{(i)}A_{(i)}^\top - B_{(i)}B_{(i)}^\top`,
    :math:`T_2 = A_{(i)}A_{(i)}^\top + B_{(i)}B_{(i)}^\top`:

    .. math::
        Q_i \leftarrow Q_i - \eta_p\, \frac{\mathrm{triu}(T_1)}{\lambda(T_2)} Q_i
        \quad\text{(triangular)}, \qquad
        Q_i \leftarrow Q_i - \eta_p\, \frac{T_1 \odot Q_i}{\max|T_2|}
        \quad\text{(diagonal)}

    with :math:`\lambda` kron-torch's one-step lower bound of the spectral norm. A dim gets a
    diagonal factor when it has size 1 or more than ``max_size_triangular`` elements, when
    the leaf has fewer than ``min_ndim_triangular`` dims (vectors), or by
    ``memory_save_mode``; factors start at ``precond_init_scale``:math:`^{1/n}` times the
    identity. The preconditioner is updated when the steps since its last update reach
    :math:`1/p` (``preconditioner_update_probability`` :math:`p`, a number or a function of
    the 0-based step; default kron-torch's anneal: 1 for 500 steps, then
    :math:`e^{-0.001(t-500)}` down to 0.03).

    Same numbers as ``kron_torch.Kron`` (tests/test_kron.py, float32) where their definitions
    agree; they differ in two places, both for purity (a step is a function of its state):
    the probe :math:`V` comes from a counter-based hash of ``seed``, the step and the leaf's
    shape (kron-torch: ``torch.randn_like``, the global generator), and the factors are balanced
    (rescaled to the geometric mean of their max-norms) every ``balance_every``-th update
    (kron-torch: with probability 0.01 at each update, from ``random.Random(42)``). Both
    compute every step whether or not the preconditioner is updated, selecting with
    ``torch.where`` (one compiled graph). heavyball's ``ForeachPSGDKron`` follows the same
    rule with its own defaults (a preconditioner learning rate and update schedule of its
    own, stochastic rounding): not compared.

    Args:
      b1: momentum :math:`\beta_1` in [0, 1).
      preconditioner_update_probability: :math:`p` (see above).
      max_size_triangular, min_ndim_triangular, memory_save_mode: which factors are
        diagonal (kron-torch's arguments and defaults).
      momentum_into_precond_update: fit the preconditioner to the momentum (default) or to
        the raw gradient.
      precond_lr: :math:`\eta_p`.
      precond_init_scale: the scale of the initial preconditioner.
      merge_dims: merge leaves of more than two dims into matrices.
      balance_every: balance the factors every this many preconditioner updates (None:
        never).
      seed: of the probes.
      mu_dtype: dtype of the momentum (default the parameter's, float32 for 16-bit ones).
      precond_dtype: dtype of the factors and of the preconditioning (default float32).

    Example:
      >>> tx = opttx.chain(opttx.scale_by_kron(), opttx.scale_by_learning_rate(3e-4))

    References:
      Li, Preconditioned Stochastic Gradient Descent (arXiv 1512.04202); Li, Black Box Lie
      Group Preconditioners for SGD (arXiv 2211.04422); Evan Walters' ``kron_torch``.
    """
    check_unit_interval("b1", b1)
    check_positive_int("max_size_triangular", max_size_triangular)
    check_nonnegative("precond_lr", precond_lr)
    check_positive("precond_init_scale", precond_init_scale)
    if memory_save_mode not in (None, "smart_one_diag", "one_diag", "all_diag"):
        raise ValueError(f"memory_save_mode must be None, 'smart_one_diag', 'one_diag' or "
                         f"'all_diag', got {memory_save_mode!r}.")
    if balance_every is not None:
        check_positive_int("balance_every", balance_every)
    prob = preconditioner_update_probability
    if prob is None:
        def prob(n: torch.Tensor) -> torch.Tensor:     # kron-torch's default anneal
            return torch.exp(-0.001 * (n - 500.0)).clamp(0.03, 1.0)
    elif not callable(prob):
        check_positive("preconditioner_update_probability", prob)

    def layout(x: torch.Tensor) -> tuple[tuple[int, ...], list[bool]]:
        shape = kron_merged_shape(tuple(x.shape), merge_dims)
        return shape, _diagonal_dims(shape, max_size_triangular, min_ndim_triangular,
                                     memory_save_mode)

    def init(params: Params) -> ScaleByKronState:
        check_init_params(params)
        leaves, spec = tree_flatten(params)
        qs = []
        for x in leaves:
            shape, diag = layout(x)
            qs.append(_initial_factors(shape, diag, precond_dtype or torch.float32,
                                       precond_init_scale, x.device))
        mu = [torch.zeros_like(x, dtype=state_dtype(x, mu_dtype)) for x in leaves]
        zero = zero_count(params)
        return ScaleByKronState(count=zero, mu=tree_unflatten(mu, spec),
                                q=tree_unflatten(qs, spec), since_update=zero.clone(),
                                updates_done=zero.clone())

    def step(g, state, params, extra_args):
        count = state.count                               # 1-based: this step
        p = prob(count.to(torch.float32) - 1) if callable(prob) else prob
        since = state.since_update + 1
        do_update = since.to(torch.float32) >= 1 / torch.as_tensor(p, dtype=torch.float32)
        done = state.updates_done + do_update.to(torch.int32)
        balance = do_update & (done % balance_every == 0) if balance_every else None
        factors, q_spec = tree_flatten(state.q)
        qs, k = [], 0
        for u in g:                 # regroup the flat factors: one per (merged) dim
            n = max(1, len(layout(u)[0]))
            qs.append(factors[k:k + n])
            k += n
        out, new_mu, new_q = [], [], []
        for u, m, q in zip(g, state.mu, qs):
            m = b1 * m + (1 - b1) * u.to(m.dtype)
            new_mu.append(m)
            if u.numel() == 0:      # an empty leaf: an empty update, its factors kept
                out.append(torch.zeros_like(u))
                new_q.extend(q)
                continue
            x, q = _kron_leaf(u, m, q, layout(u)[0], count, do_update, balance, b1=b1,
                              seed=seed, momentum_into_precond_update=momentum_into_precond_update,
                              precond_lr=precond_lr)
            out.append(x)
            new_q.extend(q)
        mark_scratch(out)
        since = torch.where(do_update, torch.zeros_like(since), since)
        return out, replace_state(state, mu=new_mu, q=tree_unflatten(new_q, q_spec),
                                  since_update=since, updates_done=done)

    inner = leafwise(ScaleByKronState, step)

    def update(updates: Updates, state: ScaleByKronState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ScaleByKronState]:
        require_whole_leaves(updates, extra_args, "scale_by_kron")
        return inner(updates, state, params, **extra_args)

    # whole leaves: its factors span whole dims (under opttx.distributed: on_owners)
    return GradientTransformation(init, update, Traits(per_leaf=True, whole_leaves=True))


def _initial_factors(shape: tuple[int, ...], diag: list[bool], dtype: torch.dtype,
                     precond_init_scale: float, device: torch.device) -> tuple:
    """One leaf's starting factors: ``precond_init_scale``:math:`^{1/n}` times the identity
    (a vector of ones for a diagonal factor), one factor of the whole scale for a scalar."""
    if not shape:
        return (torch.full((), precond_init_scale, dtype=dtype, device=device),)
    s = precond_init_scale ** (1 / len(shape))
    return tuple(s * (torch.ones(n, dtype=dtype, device=device) if d else
                      torch.eye(n, dtype=dtype, device=device))
                 for n, d in zip(shape, diag))


def _kron_leaf(u: torch.Tensor, m: torch.Tensor, q: list, shape: tuple[int, ...],
               count: torch.Tensor, do_update: torch.Tensor, balance: torch.Tensor | None, *,
               b1: float, seed: int, momentum_into_precond_update: bool, precond_lr: float
               ) -> tuple[torch.Tensor, list]:
    """One non-empty leaf's step of `scale_by_kron`, after its momentum ``m``: the factors
    balanced and fitted (kept where ``do_update`` is false), and the clipped preconditioned
    momentum. Returns the update (in ``u``'s shape and dtype) and the factors."""
    dtype = q[0].dtype
    debiased = (m / (1 - b1 ** count.to(torch.float64)).to(m.dtype)).to(dtype)
    gm = debiased.reshape(shape)
    raw = u.to(dtype).reshape(shape)
    q = list(q)
    if balance is not None and len(shape) > 1:
        q = _balanced(q, balance)
    # the preconditioner update, on the momentum (or gradient) plus its probe noise
    v = kron_noise(shape, seed, count, dtype, u.device)
    fit = gm if momentum_into_precond_update else raw
    eps = math.sqrt(torch.finfo(torch.float32).eps)
    noisy = fit + eps * fit.abs().mean() * v
    a, b = _probe_products(noisy, v, q, shape)
    q = _fitted_factors(a, b, q, shape, do_update, precond_lr)
    # precondition the momentum (with the probe noise on an updating step)
    if momentum_into_precond_update:
        x = torch.where(do_update, noisy, gm)
    else:
        x = gm
    for d, f in enumerate(q):
        if not shape:
            x = x * f * f
        elif f.dim() < 2:
            x = _mode_product(x, f * f, d)
        else:
            x = _mode_product(x, f.mT @ f, d)
    rms = x.square().mean().sqrt()
    x = x * torch.clamp(1.1 / (rms + 1e-12), max=1.0)
    return x.reshape(u.shape).to(u.dtype), q


def _balanced(q: list, balance: torch.Tensor) -> list:
    """The factors rescaled to the geometric mean of their max-norms where ``balance``."""
    norms = torch.stack([f.abs().amax() for f in q])
    factors = norms.log().mean().exp() / norms
    return [torch.where(balance, f * c, f) for f, c in zip(q, factors)]


def _probe_products(noisy: torch.Tensor, v: torch.Tensor, q: list, shape: tuple[int, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`A = G \prod_i \times_i Q_i` of the noisy momentum and
    :math:`B = V \prod_i \times_i Q_i^{-\top}` of the probe."""
    a = noisy
    for d, f in enumerate(q):
        a = _mode_product(a, f, d) if shape else a * f
    b = v
    for d, f in enumerate(q):
        if f.dim() < 2:
            b = _mode_product(b, 1 / f, d) if shape else b / f
        else:       # Q^{-T} along d: solve Q^T y = x, i.e. y^T Q = x^T
            bm = torch.movedim(b, d, -1)
            bm = torch.linalg.solve_triangular(f, bm.reshape(-1, bm.shape[-1]),
                                               upper=True, left=False)
            b = torch.movedim(bm.reshape(torch.movedim(b, d, -1).shape), -1, d)
    return a, b


def _fitted_factors(a: torch.Tensor, b: torch.Tensor, q: list, shape: tuple[int, ...],
                    do_update: torch.Tensor, precond_lr: float) -> list:
    """Every factor after one step of Li's PSGD rule on :math:`A` and :math:`B` (triangular
    or diagonal), where ``do_update``; the factor as it was elsewhere."""
    dtype = q[0].dtype
    tiny = torch.finfo(dtype).tiny
    fitted = []
    for d, f in enumerate(q):
        diagonal = f.dim() < 2
        if shape:
            ga, gb = _gram(a, d, diagonal), _gram(b, d, diagonal)
        else:
            ga, gb = a * a, b * b
        t1, t2 = (ga - gb) * precond_lr, ga + gb
        norm = t2.abs().amax()
        if diagonal:
            f_new = f - t1 * f / norm.clamp(min=tiny)
        else:
            bound = torch.where(norm > 0, _lower_bound(t2, norm), norm).clamp(min=tiny)
            f_new = f - (torch.triu(t1) / bound) @ f
        fitted.append(torch.where(do_update, f_new, f))
    return fitted
