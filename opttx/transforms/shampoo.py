"""Shampoo as pure transforms: `block_by_dims`, `precondition_shampoo`, `graft`.

The pieces follow Meta's Distributed Shampoo (arXiv 2309.06497):

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
`scale_by_rss` and `precondition_shampoo` honour it).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, Sequence

import torch

from .._checks import check_nonnegative, check_positive_int, check_unit_interval
from ..base import (Role, declare_roles, PRECONDITION_INPUT, GradientTransformation, Params, Updates, advance_counts,
                    check_init_params, precondition_target, reduce_statistics,
                    require_whole_leaves, safe_increment, zero_count)
from ..tree import (PyTree, flatten_matching, foreach_ema, foreach_sum_of_squares, tree_cond,
                    tree_flatten, tree_map, tree_structure, tree_unflatten)

__all__ = [
    "GraftState",
    "PRECONDITION_INPUT",
    "ShampooState",
    "block_by_dims",
    "block_shapes",
    "graft",
    "matrix_inverse_root",
    "merge_small_dims",
    "precondition_shampoo",
]



# ---------------------------------------------------------------------------------------------
# blocking
# ---------------------------------------------------------------------------------------------


def merge_small_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """Meta's dimension merging: drop size-1 dims, then walking from the last dim merge each
    dim into its right neighbour while the product stays <= ``max_dim``.

    >>> merge_small_dims((32, 3, 64, 64), 1024)
    (32, 192, 64)
    >>> merge_small_dims((32, 3, 64, 64), 8192)
    (96, 4096)
    """
    dims = [d for d in shape if d != 1] or [1]
    merged = [dims[-1]]
    for d in reversed(dims[:-1]):
        if merged[0] * d <= max_dim:
            merged[0] *= d
        else:
            merged.insert(0, d)
    return tuple(merged)


def block_shapes(shape: Sequence[int], max_dim: int) -> list[tuple[int, ...]]:
    """The shapes of the blocks of a tensor of ``shape``, in row-major block order."""
    merged = merge_small_dims(shape, max_dim)
    # an empty dim is one empty block (as torch.split gives)
    pieces: list[list[int]] = [[max_dim] * (m // max_dim) + ([m % max_dim] if m % max_dim else [])
                               if m else [0] for m in merged]
    shapes: list[tuple[int, ...]] = [()]
    for sizes in pieces:
        shapes = [s + (size,) for s in shapes for size in sizes]
    return shapes


def _split(x: torch.Tensor, max_dim: int) -> tuple[torch.Tensor, ...]:
    blocks = [x.reshape(merge_small_dims(x.shape, max_dim))]
    for dim in range(blocks[0].dim()):
        blocks = [piece for b in blocks for piece in torch.split(b, max_dim, dim=dim)]
    return tuple(blocks)


def _merge(blocks: Sequence[torch.Tensor], shape: Sequence[int], max_dim: int) -> torch.Tensor:
    merged = merge_small_dims(shape, max_dim)
    counts = [max(1, math.ceil(m / max_dim)) for m in merged]
    parts = list(blocks)
    for dim in reversed(range(len(merged))):
        n = counts[dim]
        parts = [torch.cat(parts[i:i + n], dim=dim) if n > 1 else parts[i]
                 for i in range(0, len(parts), n)]
    return parts[0].reshape(shape)


def block_by_dims(inner: GradientTransformation,
                  max_preconditioner_dim: int = 1024) -> GradientTransformation:
    """Run ``inner`` on Meta's blocks of every leaf and reassemble its updates.

    Each leaf becomes a tuple of blocks (`block_shapes`); ``inner`` sees that tree, and its
    state is laid out by block. The blocks tile the leaf exactly and the round trip is the
    identity.

    Example:
      >>> tx = opttx.block_by_dims(opttx.precondition_shampoo(), max_preconditioner_dim=1024)
    """
    check_positive_int("max_preconditioner_dim", max_preconditioner_dim)

    def blocked(tree: PyTree) -> PyTree:
        return tree_map(lambda x: _split(x, max_preconditioner_dim), tree)

    def init(params: Params) -> Any:
        check_init_params(params)
        return inner.init(blocked(params))

    def update(updates: Updates, state: Any, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, Any]:
        require_whole_leaves(updates, extra_args, "block_by_dims")
        spec, leaves = flatten_matching(updates)
        extra = dict(extra_args)
        if PRECONDITION_INPUT in extra:
            extra[PRECONDITION_INPUT] = blocked(extra[PRECONDITION_INPUT])
        out, state = inner.update(blocked(updates), state,
                                  None if params is None else blocked(params), **extra)
        counts = [len(block_shapes(x.shape, max_preconditioner_dim)) for x in leaves]
        merged = [_merge(bs, x.shape, max_preconditioner_dim).to(x.dtype)
                  for bs, x in zip(_chunks(tree_flatten(out)[0], counts, "block_by_dims"),
                                   leaves)]
        return tree_unflatten(merged, spec), state

    return GradientTransformation(init, update)


def _chunks(flat: list, counts: list[int], who: str) -> list[list]:
    """Split ``flat`` into consecutive runs of the given lengths."""
    if len(flat) != sum(counts):
        raise ValueError(f"{who}: expected {sum(counts)} tensors for {len(counts)} leaves, "
                         f"got {len(flat)}; were the state and updates built from the same "
                         "parameter tree?")
    out, i = [], 0
    for c in counts:
        out.append(flat[i:i + c])
        i += c
    return out


# ---------------------------------------------------------------------------------------------
# matrix roots
# ---------------------------------------------------------------------------------------------


def matrix_inverse_root(a: torch.Tensor, root: float, epsilon: float = 0.0,
                        method: Literal["eigh", "newton"] = "eigh",
                        newton_iterations: int = 40) -> torch.Tensor:
    r""":math:`(A + \epsilon I)^{-1/r}` of a symmetric positive semi-definite matrix.

    ``eigh`` (Meta's default): :math:`A = Q \Lambda Q^\top`, then the eigenvalues are shifted
    up by :math:`\max(0, -\lambda_{\min})` so that rounding (an accumulated
    :math:`G G^\top` of a rank-deficient gradient has eigenvalues of about :math:`-10^{-7}
    \lVert A\rVert` in float32) cannot make them negative, :math:`\epsilon` is added, and
    :math:`Q (\Lambda + \epsilon)^{-1/r} Q^\top` is returned.
    ``newton``: the coupled Newton iteration (Guo and Higham) on :math:`A + \epsilon I`, a
    fixed number of steps so it compiles without data-dependent loops.

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
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    if method == "eigh":
        eigenvalues, eigenvectors = torch.linalg.eigh(a)
        shift = torch.clamp(eigenvalues.min(), max=0.0)
        eigenvalues = eigenvalues - shift + epsilon
        return (eigenvectors * eigenvalues.pow(-1.0 / root).unsqueeze(-2)) @ eigenvectors.mT
    if method != "newton":
        raise ValueError(f"root method must be 'eigh' or 'newton', got {method!r}.")
    a = a + epsilon * eye
    alpha = -1.0 / root
    z = (root + 1) / (2 * torch.linalg.matrix_norm(a))
    x = z.pow(-alpha) * eye
    m = z * a
    for _ in range(newton_iterations):
        m_p = alpha * m + (1 - alpha) * eye
        x = x @ m_p
        m = torch.linalg.matrix_power(m_p, int(root)) @ m if float(root).is_integer() \
            else _fractional_power(m_p, root) @ m
    return x


def _fractional_power(m: torch.Tensor, p: float) -> torch.Tensor:
    eigenvalues, eigenvectors = torch.linalg.eigh(m)
    return (eigenvectors * eigenvalues.pow(p).unsqueeze(-2)) @ eigenvectors.mT


# ---------------------------------------------------------------------------------------------
# precondition_shampoo
# ---------------------------------------------------------------------------------------------


class ShampooState(NamedTuple):
    """State of `precondition_shampoo`."""
    count: torch.Tensor     # shape (), int32: steps taken
    failures: torch.Tensor  # shape (), int32: consecutive root computations that failed
    factors: PyTree         # per block: tuple of (d_k, d_k) Kronecker factors, one per dim
    roots: PyTree           # per block: tuple of (d_k, d_k) inverse roots of the factors
    __roles__ = declare_roles(count=Role.COUNT, factors=Role.FACTOR_MATRIX, roots=Role.FACTOR_MATRIX)


def _contract_factor(g: torch.Tensor, k: int) -> torch.Tensor:
    """:math:`G \\otimes_k G`: contraction of ``g`` with itself over every dim but ``k``."""
    others = [d for d in range(g.dim()) if d != k]
    return torch.tensordot(g, g, dims=(others, others))


def _apply_roots(x: torch.Tensor, roots: Sequence[torch.Tensor]) -> torch.Tensor:
    """Multiply ``x`` by ``roots[k]`` along every dim ``k`` (mode products)."""
    for k, r in enumerate(roots):
        x = torch.movedim(torch.tensordot(r, x, dims=([1], [k])), 0, k)
    return x


def precondition_shampoo(beta2: float = 1.0, epsilon: float = 1e-12,
                         precondition_frequency: int = 1,
                         start_preconditioning_step: int | None = None,
                         root_method: Literal["eigh", "newton"] = "eigh",
                         inverse_exponent_override: float | None = None,
                         preconditioner_dtype: torch.dtype = torch.float32,
                         use_bias_correction: bool = True,
                         max_consecutive_failures: int = 3) -> GradientTransformation:
    r"""Shampoo's Kronecker-factored preconditioner, applied to every leaf (block) as a whole.

    For a block :math:`G` of order :math:`k` and each dim :math:`i`,

    .. math::
        L_i \leftarrow \beta_2 L_i + w\, G \otimes_i G, \qquad w = 1 \text{ if } \beta_2 = 1
        \text{ else } 1 - \beta_2,

    and every ``precondition_frequency`` steps from ``start_preconditioning_step`` on (steps
    counted from 1, as Meta: step ``t`` with ``t % f == 0 and t > start`` or ``t == start``)

    .. math::
        R_i = \left(L_i / (1 - \beta_2^t) + \epsilon I\right)^{-1/(2k)}

    (the bias correction only when :math:`\beta_2 < 1`; ``inverse_exponent_override`` replaces
    :math:`2k`). The output is :math:`G \times_1 R_1 \cdots \times_k R_k`: for a matrix
    :math:`L^{-1/4} G R^{-1/4}`, for a vector full-matrix Adagrad :math:`L^{-1/2} g`.
    Use it on blocks from `block_by_dims` (a leaf is one block otherwise).

    Eigenvalues are shifted to be non-negative before :math:`\epsilon` is added (see
    `matrix_inverse_root`), so float32 rounding of a rank-deficient factor does not fail the
    root. A factor whose root is still not finite in ``preconditioner_dtype`` is retried in
    float64 (only that factor, and only then); if that fails too it keeps its previous root,
    and the recomputation counts as failed; more than ``max_consecutive_failures`` failed
    recomputations in a row raise (checked in eager mode, at recomputation steps only, so
    other steps do not synchronise with the device). The recomputation, retry included, is a
    ``torch.cond`` inside the compiled graph.

    Args:
      beta2: factor decay (1.0: Adagrad-style sums, Meta's default).
      epsilon: :math:`\epsilon` added to the diagonal before the root.
      precondition_frequency: recompute roots every this many steps.
      start_preconditioning_step: first step that uses the roots (default: the frequency).
      root_method: ``"eigh"`` (default) or ``"newton"`` (coupled Newton iteration).
      inverse_exponent_override: use :math:`A^{-1/p}` with this ``p`` for every factor.
      preconditioner_dtype: dtype of factors and roots.
      use_bias_correction: divide factors by :math:`1-\beta_2^t` before the root.
      max_consecutive_failures: root failures tolerated in a row.

    References:
      Gupta, Koren and Singer, Shampoo (arXiv 1802.09568); Shi et al., A Distributed
      Data-Parallel PyTorch Implementation of Shampoo (arXiv 2309.06497).
    """
    check_unit_interval("beta2", beta2, closed_right=True)
    check_nonnegative("epsilon", epsilon)
    check_positive_int("precondition_frequency", precondition_frequency)
    start = precondition_frequency if start_preconditioning_step is None \
        else start_preconditioning_step
    check_nonnegative("start_preconditioning_step", start)
    check_positive_int("max_consecutive_failures", max_consecutive_failures)
    weight = 1.0 if beta2 == 1 else 1 - beta2

    def exponent(order: int) -> float:
        return inverse_exponent_override if inverse_exponent_override is not None else 2 * order

    def init(params: Params) -> ShampooState:
        check_init_params(params)

        def factors_of(x: torch.Tensor) -> tuple:
            x = x.reshape(x.shape or (1,))
            return tuple(torch.zeros(d, d, dtype=preconditioner_dtype, device=x.device)
                         for d in x.shape)

        def eyes_of(x: torch.Tensor) -> tuple:
            x = x.reshape(x.shape or (1,))
            return tuple(torch.eye(d, dtype=preconditioner_dtype, device=x.device)
                         for d in x.shape)

        count = zero_count(params)
        return ShampooState(count=count, failures=torch.zeros_like(count),
                            factors=tree_map(factors_of, params), roots=tree_map(eyes_of, params))

    def compute_roots(factors: list[tuple], old_roots: list[tuple], count: torch.Tensor
                      ) -> tuple[list[tuple], torch.Tensor]:
        """New roots of every factor; a factor whose root is not finite in
        ``preconditioner_dtype`` is retried in float64, and keeps its old root when that fails
        too. Returns the roots and whether any factor kept its old root."""
        t = count.to(torch.float64)
        scale = None if (beta2 == 1 or not use_bias_correction) else \
            (1 - torch.pow(torch.tensor(beta2, dtype=torch.float64, device=t.device), t))
        inputs, exps, ok = [], [], []
        for block_factors in factors:
            for f in block_factors:
                a = f if scale is None else f / scale.to(f.dtype)
                finite_in = torch.isfinite(a).all()
                inputs.append((torch.where(finite_in, a, torch.zeros_like(a)), finite_in))
                exps.append(exponent(len(block_factors)))
        fresh = []
        for (a, finite_in), p in zip(inputs, exps):
            r = matrix_inverse_root(a, p, epsilon, root_method)
            fresh.append(r)
            ok.append(finite_in & torch.isfinite(r).all())
        flat_old = [r for rs in old_roots for r in rs]
        if preconditioner_dtype != torch.float64 and fresh:
            # float64 retry of the failed factors only: in eager mode a Python branch per
            # factor, compiled one torch.cond that runs when any factor failed
            def retry(roots: list[torch.Tensor], oks: list[torch.Tensor]) -> tuple:
                out_r, out_ok = [], []
                for (a, finite_in), p, r, good in zip(inputs, exps, roots, oks):
                    if not torch.compiler.is_compiling() and bool(good):
                        out_r.append(r)
                        out_ok.append(good)
                        continue
                    r64 = matrix_inverse_root(a.double(), p, epsilon, root_method).to(r.dtype)
                    good64 = finite_in & torch.isfinite(r64).all()
                    out_r.append(torch.where(good, r, r64))
                    out_ok.append(good | good64)
                return out_r, out_ok

            all_ok = torch.stack(ok).all()
            fresh, ok = tree_cond(~all_ok, retry, lambda r, o: (r, o), (fresh, ok))
        kept = [torch.where(good, new, old) for good, new, old in zip(ok, fresh, flat_old)]
        any_failed = ~torch.stack(ok).all() if ok else torch.zeros((), dtype=torch.bool)
        return _chunks(kept, [len(rs) for rs in old_roots], "precondition_shampoo"), any_failed

    def update(updates: Updates, state: ShampooState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ShampooState]:
        require_whole_leaves(updates, extra_args, "precondition_shampoo")
        spec, g = flatten_matching(updates)
        x = flatten_matching(precondition_target(updates, extra_args))[1]
        orders = [max(x.dim(), 1) for x in g]
        factors = [tuple(c) for c in _chunks(tree_flatten(state.factors)[0], orders,
                                             "precondition_shampoo")]
        roots = [tuple(c) for c in _chunks(tree_flatten(state.roots)[0], orders,
                                           "precondition_shampoo")]
        count = safe_increment(state.count)
        new_factors = []
        for gi, fs in zip(g, factors):
            gi = gi.reshape(gi.shape or (1,)).to(preconditioner_dtype)
            new_factors.append(tuple(beta2 * f + weight * _contract_factor(gi, k)
                                     for k, f in enumerate(fs)))
        due = ((count % precondition_frequency == 0) & (count > start)) | (count == start)

        def recompute(flat_roots: list[tuple], failures: torch.Tensor) -> tuple:
            fresh, failed = compute_roots(new_factors, flat_roots, count)
            failures = torch.where(failed, failures + 1, torch.zeros_like(failures))
            if not torch.compiler.is_compiling() and int(failures) > max_consecutive_failures:
                raise RuntimeError(f"precondition_shampoo: the root computation failed "
                                   f"{int(failures)} times in a row (limit "
                                   f"{max_consecutive_failures}); the factors are not usable. "
                                   "Raise epsilon or use preconditioner_dtype=torch.float64.")
            return [tuple(rs) for rs in fresh], failures

        def keep(flat_roots: list[tuple], failures: torch.Tensor) -> tuple:
            return flat_roots, failures

        roots, failures = tree_cond(due, recompute, keep, (roots, state.failures))
        out = [_apply_roots(xi.reshape(xi.shape or (1,)).to(preconditioner_dtype), rs)
               .reshape(xi.shape).to(xi.dtype) for xi, rs in zip(x, roots)]
        factor_spec = tree_structure(state.factors)
        return tree_unflatten(out, spec), ShampooState(
            count=count, failures=failures,
            factors=tree_unflatten([m for fs in new_factors for m in fs], factor_spec),
            roots=tree_unflatten([m for rs in roots for m in rs], factor_spec))

    return GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------
# grafting
# ---------------------------------------------------------------------------------------------


class GraftState(NamedTuple):
    """State of `graft`."""
    count: torch.Tensor    # shape (), int32: steps taken
    filtered: Updates      # like params: EMA of the gradient with beta1 (empty if beta1 = 0)
    magnitude: Any         # the magnitude (grafted) transform's state
    direction: Any         # the direction transform's state
    __roles__ = declare_roles(count=Role.COUNT, filtered=Role.FIRST_MOMENT)


def graft(magnitude: GradientTransformation | None, direction: GradientTransformation,
          start_preconditioning_step: int = 0, beta1: float = 0.0,
          use_bias_correction: bool = True, rescale: bool = True) -> GradientTransformation:
    r"""Give ``direction``'s update, leaf by leaf, the norm of ``magnitude``'s.

    .. math::
        \bar G_t = \frac{\mathrm{EMA}_{\beta_1}(G)_t}{1 - \beta_1^t}, \quad
        P_t = \begin{cases} M(\bar G_t) & t < t_0 \\
        D(\bar G_t)\, \lVert M(\bar G_t) \rVert / (\lVert D(\bar G_t) \rVert + 10^{-16})
        & t \ge t_0 \end{cases}

    Both transforms update their statistics every step from the raw gradient :math:`G`
    (``updates``) and precondition the filtered gradient :math:`\bar G` (passed to them as
    ``extra_args[PRECONDITION_INPUT]``). ``magnitude=None`` grafts SGD (:math:`M = I`).
    Leaves are blocks when used inside `block_by_dims`, so norms are per block, as Meta's.

    Args:
      magnitude: the grafted method: ``scale_by_rms(decay=β2, eps, eps_in_sqrt=False,
        bias_correction=True)`` for Adam, without bias correction for RMSprop,
        ``scale_by_rss(0.0, eps, eps_in_sqrt=False)`` for Adagrad, None for SGD.
      direction: the preconditioner, usually `precondition_shampoo`.
      start_preconditioning_step: :math:`t_0`; before it the grafted method runs alone.
      beta1: the EMA of the gradient (0: none).
      use_bias_correction: divide the EMA by :math:`1 - \beta_1^t`.
      rescale: False keeps the direction's own norm (Shampoo without grafting: before
        :math:`t_0` the update is then :math:`\bar G_t`).
    """
    check_unit_interval("beta1", beta1)
    check_nonnegative("start_preconditioning_step", start_preconditioning_step)

    def init(params: Params) -> GraftState:
        count = zero_count(params)
        filtered = tree_map(torch.zeros_like, params) if beta1 else ()
        return GraftState(count=count, filtered=filtered,
                          magnitude=magnitude.init(params) if magnitude is not None else (),
                          direction=direction.init(params))

    def update(updates: Updates, state: GraftState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, GraftState]:
        spec, g = flatten_matching(updates)
        if not g:             # a tree without leaves: only the step counters move
            return updates, advance_counts(state)
        count = safe_increment(state.count)
        filtered = state.filtered
        if beta1:
            _, m = flatten_matching(updates, state.filtered)[1:]
            m = foreach_ema(m, g, beta1)
            filtered = tree_unflatten(m, spec)
            bar = (list(torch._foreach_div(m, 1 - torch.pow(
                torch.tensor(beta1, dtype=torch.float64), count.to(torch.float64))))
                if use_bias_correction else list(m))
        else:
            bar = list(g)
        bar_tree = tree_unflatten(bar, spec)
        extra = {**extra_args, PRECONDITION_INPUT: bar_tree}
        if magnitude is not None:
            mag, mag_state = magnitude.update(updates, state.magnitude, params, **extra)
        else:
            mag, mag_state = bar_tree, ()
        dirn, dir_state = direction.update(updates, state.direction, params, **extra)
        mag_l, dir_l = flatten_matching(mag)[1], flatten_matching(dirn)[1]
        # (a) local sums of squares of both, (b) one batched reduction, (c) finish
        sq = foreach_sum_of_squares
        m_sq, d_sq = reduce_statistics((tree_unflatten(sq(mag_l), spec),
                                        tree_unflatten(sq(dir_l), spec)), extra_args)
        grafting = count < start_preconditioning_step
        out = []
        for m_i, d_i, ms, ds in zip(mag_l, dir_l, tree_flatten(m_sq)[0], tree_flatten(d_sq)[0]):
            scaled = d_i * (torch.sqrt(ms) / (torch.sqrt(ds) + 1e-16)).to(d_i.dtype) \
                if rescale else d_i
            out.append(torch.where(grafting, m_i, scaled))
        return tree_unflatten(out, spec), GraftState(count=count, filtered=filtered,
                                                     magnitude=mag_state, direction=dir_state)

    return GradientTransformation(init, update)
