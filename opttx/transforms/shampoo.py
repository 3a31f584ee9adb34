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
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, NamedTuple, Sequence

import torch

from .._checks import (check_gradient_leaves, check_nonnegative, check_positive_int,
                       check_unit_interval)
from .._tracing import is_tracing
from ..base import (GradientTransformation, HyperRole, PRECONDITIONER, PRECONDITION_INPUT, Params,
                    REDUCER_KEY, Role, Traits, Updates, advance_counts, check_init_params,
                    combine_traits, current_reducer, declare, declare_roles, precondition_target,
                    reduce_statistics, reducer_during_init, require_whole_leaves, safe_increment,
                    traits_of, zero_count)
from ..kernels import cast_like, foreach, foreach_, foreach_ema, foreach_sum_of_squares
from ..tree import (PyTree, Static, flatten_matching, state_dtype, stats_like, tree_cond,
                    tree_flatten, tree_map, tree_paths, tree_structure, tree_unflatten,
                    tree_while)

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



# ---------------------------------------------------------------------------------------------
# blocking
# ---------------------------------------------------------------------------------------------


def merge_small_dims(shape: Sequence[int], max_dim: int,
                     target_dimensionality: int | float = 1) -> tuple[int, ...]:
    """Meta's dimension merging: drop size-1 dims, then walking from the last dim merge each
    dim into its right neighbour while the product stays <= ``max_dim`` and more than
    ``target_dimensionality`` dims would remain (Meta's ``target_parameter_dimensionality``:
    1 merges as far as the size allows, 2 keeps matrices, ``math.inf`` merges nothing and
    keeps the shape as it is). A shape with an empty dim is ``(0,)``.

    >>> merge_small_dims((32, 3, 64, 64), 1024)
    (32, 192, 64)
    >>> merge_small_dims((32, 3, 64, 64), 8192)
    (96, 4096)
    >>> merge_small_dims((32, 3, 64, 64), 10**6, target_dimensionality=2)
    (32, 12288)
    """
    max_dim = _limit(max_dim)
    if 0 in shape:
        return (0,)
    if target_dimensionality == math.inf:
        return tuple(shape) or (1,)
    dims = [d for d in reversed(shape) if d != 1] or [1]
    merged = [dims[0]]
    for i, d in enumerate(dims[1:], start=1):
        if len(merged) + len(dims) - i > target_dimensionality and merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(reversed(merged))


def block_shapes(shape: Sequence[int], max_dim: int,
                 target_dimensionality: int | float = 1) -> list[tuple[int, ...]]:
    """The shapes of the blocks of a tensor of ``shape``, in row-major block order."""
    max_dim = _limit(max_dim)
    merged = merge_small_dims(shape, max_dim, target_dimensionality)
    # an empty dim is one empty block (as torch.split gives)
    pieces: list[list[int]] = [[max_dim] * (m // max_dim) + ([m % max_dim] if m % max_dim else [])
                               if m else [0] for m in merged]
    shapes: list[tuple[int, ...]] = [()]
    for sizes in pieces:
        shapes = [s + (size,) for s in shapes for size in sizes]
    return shapes


def _limit(max_dim: float) -> int:
    """``max_preconditioner_dim`` as an int: ``math.inf`` (Meta's "never split") becomes a
    size no tensor reaches."""
    return sys.maxsize if max_dim == math.inf else int(max_dim)


def _split(x: torch.Tensor, max_dim: int, target: int | float = 1
           ) -> tuple[torch.Tensor, ...]:
    max_dim = _limit(max_dim)
    blocks = [x.reshape(merge_small_dims(x.shape, max_dim, target))]
    for dim in range(blocks[0].dim()):
        blocks = [piece for b in blocks for piece in torch.split(b, max_dim, dim=dim)]
    return tuple(blocks)


def _merge(blocks: Sequence[torch.Tensor], shape: Sequence[int], max_dim: int,
           target: int | float = 1) -> torch.Tensor:
    max_dim = _limit(max_dim)
    merged = merge_small_dims(shape, max_dim, target)
    counts = [max(1, math.ceil(m / max_dim)) for m in merged]
    parts = list(blocks)
    for dim in reversed(range(len(merged))):
        n = counts[dim]
        parts = [torch.cat(parts[i:i + n], dim=dim) if n > 1 else parts[i]
                 for i in range(0, len(parts), n)]
    return parts[0].reshape(shape)


@declare()
def block_by_dims(inner: GradientTransformation, max_preconditioner_dim: int | float = 1024,
                  target_parameter_dimensionality: int | float = 1) -> GradientTransformation:
    """Run ``inner`` on Meta's blocks of every leaf and reassemble its updates.

    Each leaf becomes a tuple of blocks (`block_shapes`); ``inner`` sees that tree, and its
    state is laid out by block. The blocks tile the leaf exactly and the round trip is the
    identity. ``max_preconditioner_dim=math.inf`` (as Meta's) merges every dim of size > 1
    into one and never splits: each leaf is one 1-D block (full-matrix Adagrad on it).
    ``target_parameter_dimensionality`` (Meta's, of its distributed config) stops the merging
    at that many dims (see `merge_small_dims`): with ``math.inf`` and
    ``target_parameter_dimensionality=2`` every leaf of 2 or more dims is one matrix.

    Example:
      >>> tx = opttx.block_by_dims(opttx.precondition_shampoo(), max_preconditioner_dim=1024)
    """
    if max_preconditioner_dim != math.inf:
        check_positive_int("max_preconditioner_dim", max_preconditioner_dim)
    target = target_parameter_dimensionality
    if target != math.inf:
        check_positive_int("target_parameter_dimensionality", target)
    # whole row blocks of a leaf split by rows are its blocks only when dims merge as usual
    rows = None if max_preconditioner_dim == math.inf or target != 1 \
        else int(max_preconditioner_dim)
    config = (f"block_by_dims(max_preconditioner_dim={max_preconditioner_dim}, "
              f"target_parameter_dimensionality={target})")
    max_preconditioner_dim = _limit(max_preconditioner_dim)

    def blocked(tree: PyTree) -> PyTree:
        return tree_map(lambda x: _split(x, max_preconditioner_dim, target), tree)

    def init(params: Params) -> Any:
        check_init_params(params)
        _check_row_blocks(params, current_reducer(), max_preconditioner_dim)
        with reducer_during_init(None):       # every block is whole
            return inner.init(blocked(params))

    def update(updates: Updates, state: Any, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, Any]:
        require_whole_leaves(updates, extra_args, "block_by_dims", block_rows=rows)
        _check_row_blocks(updates, current_reducer(extra_args), max_preconditioner_dim)
        spec, leaves = flatten_matching(updates)
        # None, sparse, integer or complex leaves, and (with params) shapes other than the
        # params': refused here, naming the leaf, before the blocks are cut (a transposed
        # gradient merged into one dim would otherwise pass as the same blocks)
        check_gradient_leaves(leaves, None if params is None
                              else flatten_matching(updates, params)[2], updates,
                              "block_by_dims")
        # leaves split by rows at block boundaries (zero's split_above_mb) give whole
        # blocks: inner sees no sharded reducer
        extra = {k: v for k, v in extra_args.items() if k != REDUCER_KEY}
        if PRECONDITION_INPUT in extra:
            extra[PRECONDITION_INPUT] = blocked(extra[PRECONDITION_INPUT])
        try:
            out, state = inner.update(blocked(updates), state,
                                      None if params is None else blocked(params), **extra)
        except (ValueError, TypeError) as err:
            _refuse_other_blocks(err, inner, state, leaves, spec, updates, config, blocked,
                                 lambda shape: block_shapes(shape, max_preconditioner_dim,
                                                            target))
            raise
        counts = [len(block_shapes(x.shape, max_preconditioner_dim, target)) for x in leaves]
        merged = [_merge(bs, x.shape, max_preconditioner_dim, target).to(x.dtype)
                  for bs, x in zip(_chunks(tree_flatten(out)[0], counts, "block_by_dims"),
                                   leaves)]
        return tree_unflatten(merged, spec), state

    return GradientTransformation(init, update, combine_traits(
        (inner,), elementwise=False, per_leaf=traits_of(inner).per_leaf, whole_leaves=True,
        takes_precondition_input=traits_of(inner).takes_precondition_input, block_rows=rows))


def _refuse_other_blocks(err: Exception, inner: GradientTransformation, state: Any,
                         leaves: list[torch.Tensor], spec: Any, updates: Updates,
                         config: str, blocked: Any, cut: Any) -> None:
    """After ``inner.update`` failed inside `block_by_dims`: when ``state`` does not have the
    structure ``inner.init`` gives on this configuration's blocks (computed on "meta" tensors:
    no memory, no numbers), raise a ``ValueError`` saying so, naming this configuration and
    the blocks it cuts, instead of the inner's structure error ("tuple vs tuple"). The state
    of `block_by_dims` is its inner's, with no stamp of its own (a root of its own would
    rename every checkpoint key of Shampoo), so the configuration that made it is
    not recorded; `opttx.Optimizer.load_state_dict` and `opttx.distributed.load_checkpoint`
    compare the whole configuration by identity. Otherwise (the same structure: another
    problem, or while tracing) returns, and the caller re-raises ``err``."""
    if is_tracing():
        return
    try:
        template = tree_unflatten([torch.empty(x.shape, dtype=x.dtype, device="meta")
                                   for x in leaves], spec)
        with reducer_during_init(None):
            expected = inner.init(blocked(template))
    except Exception:   # noqa: BLE001 - no diagnosis possible: the inner's own error stands
        return
    if tree_structure(expected) == tree_structure(state):
        return
    paths = tree_paths(updates)
    shown = []
    for path, x in zip(paths, leaves):
        blocks = cut(x.shape)
        if len(blocks) > 1 or tuple(blocks[0]) != tuple(x.shape):
            shown.append(f"{path or 'the leaf'} {tuple(x.shape)} into {len(blocks)} blocks "
                         f"{[tuple(b) for b in blocks[:3]]}{' ...' if len(blocks) > 3 else ''}")
    cuts = "; ".join(shown[:3]) if shown else "every leaf into one block (itself)"
    raise ValueError(
        f"{config}.update got a state that does not hold this configuration's blocks (it cuts "
        f"{cuts}): the state was made by another block configuration (another "
        "max_preconditioner_dim or target_parameter_dimensionality, which opttx.shampoo "
        "passes to block_by_dims) or for other parameters. A state of "
        "another configuration cannot be used: build it with this transform's init (or load "
        "a checkpoint made by the same configuration: opttx.Optimizer.load_state_dict and "
        f"opttx.distributed.load_checkpoint name both configurations). Inner error: {err}"
    ) from err


def _check_row_blocks(tree: PyTree, reducer: Any, max_dim: int) -> None:
    """Where a leaf is only this rank's rows of a larger one (zero's ``split_above_mb``), its
    blocks are those of the whole leaf only if dim 0 is merged with no other dim, here and in
    the whole leaf, and the other dims merge alike: else raise (the blocks would differ)."""
    starts = getattr(reducer, "row_starts", None)
    if starts is None or reducer.global_shapes is None:
        return                    # no rows split here (other shards: require_whole_leaves)
    try:
        flat = reducer.treespec.flatten_up_to(tree)
    except (ValueError, TypeError):
        return
    for x, start, whole in zip(flat, starts, reducer.global_shapes):
        if start is None or not isinstance(x, torch.Tensor):
            continue
        mine, theirs = merge_small_dims(x.shape, max_dim), merge_small_dims(whole, max_dim)
        if mine[0] != x.shape[0] or theirs[0] != whole[0] or mine[1:] != theirs[1:]:
            raise ValueError(
                f"block_by_dims: rows {tuple(x.shape)} of a {tuple(whole)} leaf block "
                f"differently from the whole leaf (merged dims {mine} vs {theirs} at "
                f"max_preconditioner_dim={max_dim}); give every rank at least one whole block "
                "of rows, or do not split this leaf.")


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
    eigenvalues, eigenvectors = torch.linalg.eigh(_ridge(a, epsilon, eye) if before else a)
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


def _ridge(a: torch.Tensor, epsilon: float | torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
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
    ridge = _ridge(a, epsilon, eye)
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


# ---------------------------------------------------------------------------------------------
# precondition_shampoo
# ---------------------------------------------------------------------------------------------


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


def _contract_factor(g: torch.Tensor, k: int) -> torch.Tensor:
    """The upper triangle of :math:`G \\otimes_k G`, the contraction of ``g`` with itself over
    every dim but ``k`` (zeros below the diagonal). A float32 ``G G^T`` is not bitwise
    symmetric; Meta keeps factors as packed upper triangles, so only the upper triangle
    counts: factors accumulate upper triangles and are read through `_from_upper` where a root
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


def _from_upper(m: torch.Tensor) -> torch.Tensor:
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


def _apply_roots(x: torch.Tensor, roots: Sequence[torch.Tensor]) -> torch.Tensor:
    """Multiply ``x`` by ``roots[k]`` along every dim ``k`` (mode products), as Meta does:
    each step contracts the leading dim with a (symmetric) root and appends the result as
    the last dim, so after one step per dim the dims are back in order."""
    for r in roots:
        if r.shape[0] != x.shape[0]:              # a dim not preconditioned: rotate it
            x = x.permute(*range(1, x.dim()), 0)
        else:
            x = torch.tensordot(x, r, dims=([0], [0]))
    return x


def meta_bias_correction(beta: float, count: torch.Tensor, shift: int = 0,
                         scale: float = 1.0) -> torch.Tensor:
    r"""Meta's bias-correction scalar :math:`1 - s\,\beta^{t - \text{shift}}`, computed as
    Distributed Shampoo computes it: a float32 ``torch.pow`` of :math:`\beta` (rounded to
    float32) and the step, even for float64 factors. For :math:`\beta = 0.999`, :math:`t = 1`
    it is :math:`1 - \mathrm{fl}_{32}(0.999) = 0.00099998713`, 1.3e-5 relative away from
    0.001; `precondition_shampoo` and `graft` use it so that their numbers equal Meta's."""
    power = torch.pow(beta, count - shift if shift else count)   # float32, as Meta's
    return 1.0 - (scale * power if isinstance(scale, torch.Tensor) or scale != 1.0 else power)


def _filtered_gradient(m: list[torch.Tensor], g: list[torch.Tensor], beta1: Any,
                       beta3: Any, count: torch.Tensor, bias_correction: bool
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    r"""Meta's filtered gradient, for the leaves ``m`` of its EMA and the gradients ``g``:
    :math:`\tilde G_t = \beta_1 \tilde G_{t-1} + (1 - \beta_1) G_t` (the new ``m``) and
    :math:`\bar G_t = (\beta_3 \tilde G_{t-1} + (1 - \beta_3) G_t) / (1 - \beta_3
    \beta_1^{t-1})` (:math:`\bar G_t = \tilde G_t / (1 - \beta_1^t)` when
    :math:`\beta_3 = \beta_1`; no division without ``bias_correction``), the correction
    computed as Meta's (`meta_bias_correction`). Used by `graft` and by
    `precondition_eigenvalue_corrected`'s own EMA (in whichever basis ``m`` and ``g`` are)."""
    g = cast_like(g, m)
    same = beta3 is beta1 or (not isinstance(beta3, torch.Tensor)
                              and not isinstance(beta1, torch.Tensor) and beta3 == beta1)
    bar = None if same else foreach("lerp", m, g, 1 - beta3)
    m = foreach_ema(m, g, beta1)
    bar = list(m) if bar is None else bar
    if bias_correction:
        bar = foreach("div", bar, meta_bias_correction(beta1, count, shift=1, scale=beta3))
    return m, bar


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
                         kl_shampoo: bool = False) -> GradientTransformation:
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
        kl_shampoo=kl_shampoo)

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
                    kl_shampoo: bool = False) -> _ShampooConfig:
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
    if isinstance(inverse_exponent_override, dict):
        for order, given in inverse_exponent_override.items():
            values = given.values() if isinstance(given, dict) else [given]
            if order < 0 or any(e < 0 for e in values) or (isinstance(given, dict) and any(
                    not 0 <= d <= max(order - 1, 0) for d in given)):
                raise ValueError(f"inverse_exponent_override[{order}]={given!r}: orders, dims "
                                 "(0 .. order - 1) and exponents must be >= 0.")
    elif inverse_exponent_override is not None:
        check_nonnegative("inverse_exponent_override", inverse_exponent_override)
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
    if eigendecomposed and root_method != "eigh":
        raise ValueError("eigendecomposed caching keeps eigendecompositions (root_method "
                         f"'eigh'), not roots by {root_method!r}.")
    if eigendecomposition not in ("eigh", "qr"):
        raise ValueError(f"eigendecomposition must be 'eigh' or 'qr', got "
                         f"{eigendecomposition!r}.")
    check_positive_int("qr_iterations", qr_iterations)
    check_unit_interval("eigendecomposition_tolerance", eigendecomposition_tolerance,
                        closed_right=True)
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
        kl_shampoo=bool(kl_shampoo))


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


def _update_factors(g: torch.Tensor, factors: tuple, cfg: _ShampooConfig,
                    kl_roots: tuple | None = None) -> tuple:
    """One block's factors after the gradient ``g``: L_k <- beta2 L_k + w G (x)_k G; with
    ``kl_roots`` (KL-Shampoo) G is first multiplied by the roots of every dim but k."""
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
        outer = _contract_factor(g if kl_roots is None else _by_other_roots(g, kl_roots, k), k)
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
    return _apply_roots(g.to(dtype), [skip if j == k else r for j, r in enumerate(roots)])


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
            inputs.append(_prepared_factor(f, scale, cfg))
            exps.append(p or 1.0)
    return inputs, exps


def _prepared_factor(f: torch.Tensor, scale: torch.Tensor | None, cfg: Any
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The matrix Meta decomposes for the factor ``f`` (of `precondition_shampoo` or
    `precondition_eigenvalue_corrected`): symmetric, read from its upper triangle (packed
    factors come unpacked, symmetric already), divided by the bias correction ``scale``,
    trace-scaled; zeros where it is not finite, with whether it was."""
    if not getattr(cfg, "symmetric_packing", False):
        f = _from_upper(f)
    a = f if scale is None else f / scale
    if cfg.use_trace_scaling:
        a = a * torch.pow(torch.clamp(torch.trace(a), min=cfg.epsilon),
                          -cfg.trace_scaling_exponent)
    finite = torch.isfinite(a).all()
    return torch.where(finite, a, torch.zeros_like(a)), finite


def _decomposed(a: torch.Tensor, finite: torch.Tensor, vectors: torch.Tensor,
                values: torch.Tensor | None, perturb_before: bool, epsilon: Any,
                method: str, qr_iterations: int, tolerance: Any
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    r"""Meta's eigendecomposition of a `_prepared_factor` ``a`` (plus :math:`\epsilon I` when
    perturbing before), from the previous ``vectors``, cast to the old dtypes and contiguous
    (Meta copies it into its buffers; eigh's column-major result would round the products
    differently); the old eigenvectors (and ``values``) where ``a`` or the result is not
    finite. Returns the eigenvalues (None without old ``values``), eigenvectors, success."""
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    v, q = matrix_eigendecomposition(_ridge(a, epsilon, eye) if perturb_before else a,
                                     vectors.to(a.dtype), method, qr_iterations, tolerance)
    q = q.to(vectors.dtype).contiguous()
    good = finite & torch.isfinite(q).all() & torch.isfinite(v).all()
    v = None if values is None else torch.where(good, v.to(values.dtype), values)
    return v, torch.where(good, q, vectors), good


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
    return pack_symmetric(root) if cfg.symmetric_packing else _from_upper(root)


def _retry_in_float64(inputs: list[tuple[torch.Tensor, torch.Tensor]], exps: list[float],
                      roots: list[torch.Tensor], oks: list[torch.Tensor],
                      cfg: _ShampooConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The roots with each failed one (``oks`` false) recomputed in float64, and which are
    finite now; in eager mode only the failed ones are recomputed."""
    out_r, out_ok = [], []
    for (a, finite_in), p, r, good in zip(inputs, exps, roots, oks):
        if not is_tracing() and bool(good):
            out_r.append(r)
            out_ok.append(good)
            continue
        r64 = _root_of(a.double(), p, r.dtype, cfg)
        good64 = finite_in & torch.isfinite(r64).all()
        out_r.append(torch.where(good, r, r64))
        out_ok.append(good | good64)
    return out_r, out_ok


def _compute_roots(factors: list[tuple], old_roots: list[tuple], count: torch.Tensor,
                   cfg: _ShampooConfig) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """New roots of every factor; a factor whose root is not finite in
    ``preconditioner_dtype`` is retried in float64, and keeps its old root when that fails
    too. Returns the roots (per block) and whether any factor kept its old root."""
    inputs, exps = _root_inputs(factors, count, cfg)
    fresh, ok = [], []
    for (a, finite_in), p in zip(inputs, exps):
        r = _root_of(a, p, cfg.root_dtype, cfg)
        fresh.append(r)
        ok.append(finite_in & torch.isfinite(r).all())
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
    return _chunks(kept, [len(rs) for rs in old_roots], "precondition_shampoo"), any_failed


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
    new_q, new_v, oks = [], [], []
    before = cfg.rank_options.get("rank_deficient", "perturb_before") == "perturb_before"
    for (a, finite_in), q_old, v_old in zip(inputs, flat_q, flat_v):
        if q_old.shape[0] == 0:                  # a dim not preconditioned
            new_q.append(q_old)
            new_v.append(v_old)
            continue
        v, q, good = _decomposed(a, finite_in, q_old, v_old, before, cfg.epsilon,
                                 **cfg.eigen_options)
        new_q.append(q)
        new_v.append(v)
        oks.append(good)
    failed = ~torch.stack(oks).all() if oks else torch.zeros((), dtype=torch.bool)
    failures = _count_failures(failed, failures, cfg, "eigendecomposition")
    counts = [len(qs) for qs in vectors]
    return ([tuple(c) for c in _chunks(new_q, counts, "precondition_shampoo")],
            [tuple(c) for c in _chunks(new_v, counts, "precondition_shampoo")], failures)


def _roots_from_eigen(vectors: tuple, values: tuple, cfg: _ShampooConfig) -> tuple:
    """One block's inverse roots formed from the cached eigendecompositions (this step's)."""
    exps = _roots_of_order(len(vectors), cfg.inverse_exponent_override)
    return tuple(q if q.shape[0] == 0 else
                 inverse_root_from_eigendecomposition(v, q, p, cfg.epsilon, **cfg.rank_options)
                 for q, v, p in zip(vectors, values, exps))


def _precondition(x: torch.Tensor, roots: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One block ``x`` multiplied by its roots along every dim, computed in ``dtype``."""
    return _apply_roots(x.reshape(x.shape or (1,)).to(dtype), roots) \
        .reshape(x.shape).to(x.dtype)


def _update_shampoo(updates: Updates, state: ShampooState, target: Updates,
                    cfg: _ShampooConfig) -> tuple[Updates, ShampooState]:
    """One step of `precondition_shampoo`: the factors take in ``updates``, the roots are
    recomputed when due, and ``target`` is preconditioned with them."""
    spec, g = flatten_matching(updates)
    check_gradient_leaves(g, None, updates, "precondition_shampoo")
    x = flatten_matching(target)[1]
    orders = [max(x.dim(), 1) for x in g]
    factors = [tuple(c) for c in _chunks(tree_flatten(state.factors)[0], orders,
                                         "precondition_shampoo")]
    check_block_shapes(g, factors, updates, "precondition_shampoo", cfg.symmetric_packing)
    roots = [tuple(c) for c in _chunks(tree_flatten(state.roots)[0], orders,
                                       "precondition_shampoo")]
    count = safe_increment(state.count)
    # packed factors and roots: full matrices only where needed, as temporaries (the
    # factors inside the root recomputation, the roots to precondition)
    full = (lambda ms: [_unpacked(m, gi) for m, gi in zip(ms, g)]) if cfg.symmetric_packing \
        else (lambda ms: ms)
    if cfg.eigen_options is not None:
        values = [tuple(c) for c in _chunks(tree_flatten(state.eigenvalues)[0], orders,
                                            "precondition_shampoo")]
    if cfg.kl_shampoo:       # the roots in use before this step's recomputation
        in_use = [_roots_from_eigen(qs, vs, cfg) for qs, vs in zip(roots, values)] \
            if cfg.eigen_options is not None else full(roots)
        new_factors = [_update_factors(gi, fs, cfg, rs)
                       for gi, fs, rs in zip(g, factors, in_use)]
    else:
        new_factors = [_update_factors(gi, fs, cfg) for gi, fs in zip(g, factors)]
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


# ---------------------------------------------------------------------------------------------
# grafting
# ---------------------------------------------------------------------------------------------


class GraftState(NamedTuple):
    """State of `graft`."""
    count: torch.Tensor    # shape (), int32: steps taken
    filtered: Updates      # like params (fp32 for 16-bit leaves): EMA of the gradient with
                           # beta1 (empty if beta1 = 0)
    magnitude: Any         # the magnitude (grafted) transform's state
    direction: Any         # the direction transform's state
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, filtered=Role.FIRST_MOMENT)


@declare(hyperparams={"beta1": HyperRole.B1, "beta3": None},
         runtime=("start_preconditioning_step",))
def graft(magnitude: GradientTransformation | None, direction: GradientTransformation,
          start_preconditioning_step: int = 0, beta1: float = 0.0,
          use_bias_correction: bool = True, rescale: bool = True,
          beta3: float | None = None) -> GradientTransformation:
    r"""Give ``direction``'s update, leaf by leaf, the norm of ``magnitude``'s.

    .. math::
        \tilde G_t = \beta_1 \tilde G_{t-1} + (1 - \beta_1) G_t, \quad
        \bar G_t = \frac{\beta_3 \tilde G_{t-1} + (1 - \beta_3) G_t}{1 - \beta_3 \beta_1^{t-1}},
        \quad
        P_t = \begin{cases} M(\bar G_t) & t < t_0 \\
        D(\bar G_t)\, \lVert M(\bar G_t) \rVert / (\lVert D(\bar G_t) \rVert + 10^{-16})
        & t \ge t_0 \end{cases}

    (:math:`\beta_3 = \beta_1` by default, when :math:`\bar G_t = \tilde G_t / (1 - \beta_1^t)`;
    no division without ``use_bias_correction``; :math:`\bar G_t = G_t` when
    :math:`\beta_1 = 0`.) This is Meta's filtered gradient and grafting, the bias correction
    computed as Meta computes it (`meta_bias_correction`). Both transforms update their
    statistics every step from the raw gradient :math:`G` (``updates``) and precondition the
    filtered gradient :math:`\bar G` (passed to them as ``extra_args[PRECONDITION_INPUT]``).
    ``magnitude=None`` grafts SGD (:math:`M = I`). Leaves are blocks when used inside
    `block_by_dims`, so norms are per block, as Meta's. The filtered gradient of 16-bit
    leaves is kept in float32 (docs/design.md, rule 3), and 16-bit gradients are cast to float32
    before both transforms see them, so the magnitude, the direction and the rescale are
    computed in float32 (a direction may hold entries far beyond float16's range that the
    rescale brings back); the update comes back in the gradient's dtype.

    Args:
      magnitude: the grafted method: ``scale_by_rms(decay=β2, eps, eps_in_sqrt=False,
        bias_correction=True)`` for Adam, without bias correction for RMSprop,
        ``scale_by_rss(0.0, eps, eps_in_sqrt=False)`` for Adagrad, None for SGD
        (`opttx.shampoo` uses the same methods computed op for op as Meta's).
      direction: the preconditioner, usually `precondition_shampoo`.
      start_preconditioning_step: :math:`t_0`; before it the grafted method runs alone.
      beta1: the EMA of the gradient (0: none).
      use_bias_correction: divide the EMA by :math:`1 - \beta_3 \beta_1^{t-1}`.
      rescale: False keeps the direction's own norm (Shampoo without grafting: before
        :math:`t_0` the update is then :math:`\bar G_t`).
      beta3: Meta's ``beta3``, the weight of the current gradient in the preconditioned
        average (default ``beta1``).

    Example:
      >>> tx = opttx.graft(None, opttx.precondition_shampoo(), beta1=0.9)
    """
    check_unit_interval("beta1", beta1)
    b3 = beta1 if beta3 is None else beta3
    check_unit_interval("beta3", b3)
    check_nonnegative("start_preconditioning_step", start_preconditioning_step)
    if beta1:
        # with a filter, the preconditioned input differs from the raw gradient: a transform
        # that does not read PRECONDITION_INPUT would silently precondition the raw gradient
        for role, tx in (("magnitude", magnitude), ("direction", direction)):
            if tx is not None and not traits_of(tx).takes_precondition_input:
                raise ValueError(
                    f"graft: the {role} transform does not declare "
                    "Traits(takes_precondition_input=True), so with beta1 > 0 it would "
                    "precondition the raw gradient instead of the filtered one. Use a "
                    "transform that reads opttx.base.precondition_target(updates, "
                    "extra_args) (and declares the trait), or beta1=0.")

    def init(params: Params) -> GraftState:
        count = zero_count(params)
        filtered = stats_like(params) if beta1 else ()
        return GraftState(count=count, filtered=filtered,
                          magnitude=magnitude.init(params) if magnitude is not None else (),
                          direction=direction.init(params))

    def update(updates: Updates, state: GraftState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, GraftState]:
        spec, g = flatten_matching(updates)
        if not g:             # a tree without leaves: only the step counters move
            return updates, advance_counts(state)
        leaves = g
        # an int gradient would give zero updates; complex, sparse or None ones torch errors
        check_gradient_leaves(g, None, updates, "graft")
        if any(x.dtype != state_dtype(x) for x in g):
            # 16-bit gradients: both methods and the rescale run in float32 and only the
            # grafted update is cast back. A direction of unit norm per element in exact
            # arithmetic may hold entries of 1e5 (Adam in an eigenbasis, where the squared
            # gradient is a rounding error): inf in float16, and inf times the rescale's 0 is
            # NaN, while the grafted update itself has the magnitude's (finite) norm.
            g = [x.to(state_dtype(x)) for x in g]
            updates = tree_unflatten(g, spec)
        count = safe_increment(state.count)
        filtered = state.filtered
        if beta1:
            _, m = flatten_matching(updates, state.filtered)[1:]
            check_gradient_leaves(g, m, updates, "graft")      # shaped like the blocks
            m, bar = _filtered_gradient(m, g, beta1, b3, count, use_bias_correction)
            filtered = tree_unflatten(m, spec)
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
        for g_i, m_i, d_i, ms, ds in zip(leaves, mag_l, dir_l, tree_flatten(m_sq)[0],
                                         tree_flatten(d_sq)[0]):
            scaled = d_i * (torch.sqrt(ms) / (torch.sqrt(ds) + 1e-16)).to(d_i.dtype) \
                if rescale else d_i
            out.append(torch.where(grafting, m_i, scaled).to(g_i.dtype))
        return tree_unflatten(out, spec), GraftState(count=count, filtered=filtered,
                                                     magnitude=mag_state, direction=dir_state,
                                                     made_by=state.made_by)

    return GradientTransformation(init, update, combine_traits(
        (direction,) if magnitude is None else (magnitude, direction),
        elementwise=False, per_leaf=True))


class DiagonalGraftState(NamedTuple):
    """State of `scale_by_grafted_diagonal`."""
    count: torch.Tensor    # shape (), int32: steps taken
    nu: Updates            # like params (fp32 for 16-bit leaves): sum or EMA of squares
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, nu=Role.SECOND_MOMENT)


@declare(hyperparams={"beta2": HyperRole.B2, "epsilon": HyperRole.EPS, "weighting_factor": None})
def scale_by_grafted_diagonal(beta2: float = 1.0, epsilon: float = 1e-10,
                              weighting_factor: float = 1.0,
                              use_bias_correction: bool = False) -> GradientTransformation:
    r"""Meta's diagonal grafting preconditioner (its ``AdagradPreconditionerList``), op for op.

    .. math::
        \nu_t = \beta_2 \nu_{t-1} + w\, g_t^2, \qquad
        u_t = \bar g_t / (\sqrt{\nu_t / b_t} + \epsilon)

    with :math:`b_t = 1 - \beta_2^t` computed as Meta does (`meta_bias_correction`) when
    ``use_bias_correction``, else 1. Adagrad: ``(1.0, eps, 1.0, False)``; RMSprop:
    ``(β2, eps, 1 − β2, False)``; Adam: ``(β2, eps, 1 − β2, True)``. The statistics come
    from ``updates``, the division applies to ``extra_args[PRECONDITION_INPUT]`` inside
    `graft`. Statistics of 16-bit leaves are float32 (Meta keeps them in the parameter's
    dtype).

    Example:
      >>> adam_graft = opttx.scale_by_grafted_diagonal(0.999, 1e-8, 0.001, True)
    """
    check_unit_interval("beta2", beta2, closed_right=True)
    check_nonnegative("epsilon", epsilon)
    injected = isinstance(beta2, torch.Tensor)     # inject_hyperparams: its value may change
    correct = use_bias_correction and (injected or beta2 < 1)

    def init(params: Params) -> DiagonalGraftState:
        check_init_params(params)
        return DiagonalGraftState(count=zero_count(params), nu=stats_like(params))

    def update(updates: Updates, state: DiagonalGraftState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, DiagonalGraftState]:
        spec, g = flatten_matching(updates)
        if not g:
            return updates, advance_counts(state)
        nu = flatten_matching(updates, state.nu)[2]
        check_gradient_leaves(g, nu, updates, "scale_by_grafted_diagonal")
        count = safe_increment(state.count)
        nu = foreach("mul", nu, beta2) if injected or beta2 != 1 else list(nu)
        nu = foreach("addcmul", nu, cast_like(g, nu), cast_like(g, nu), value=weighting_factor)
        if correct:
            b = meta_bias_correction(beta2, count)
            if injected:    # a sum (beta2 = 1) is not corrected
                b = torch.where(beta2 < 1, b, torch.ones_like(b))
            denom = foreach_("sqrt", foreach("div", nu, b))
        else:
            denom = foreach("sqrt", nu)      # new tensors: nu is the state
        foreach_("add", denom, epsilon)
        x = flatten_matching(precondition_target(updates, extra_args))[1]
        out = cast_like(foreach("div", cast_like(x, denom), denom), g)
        return tree_unflatten(out, spec), DiagonalGraftState(count=count,
                                                             nu=tree_unflatten(nu, spec),
                                                             made_by=state.made_by)

    return GradientTransformation(init, update, PRECONDITIONER)
