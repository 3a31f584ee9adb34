"""GaLore: any transform run on low-rank projections of the gradients (`project_lowrank`).

A projected leaf is read as a matrix :math:`G \\in \\mathbb{R}^{m \\times n}` over two named
axes (its other axes are a batch of matrices). Every ``update_proj_gap`` steps the SVD of the
gradient gives orthonormal bases, :math:`U_{:, :k}` (left, :math:`m \\times k`) and
:math:`V^\\top_{:k, :}` (right, :math:`k \\times n`), :math:`k = \\min(r, m, n)`; in between,
the gradient is projected on the stored bases, the inner transform runs on the small matrix,
and its output is mapped back to :math:`m \\times n`. The inner transform's statistics live in
the projected space, which is where GaLore's memory saving comes from.

The basis refresh is a ``torch.cond`` inside a compiled step (`opttx.tree.tree_cond`): the
graph holds both branches and does not recompile when a refresh comes round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch

from .._checks import check_gradient_leaves, check_number, check_positive_int, matrix_axes_of
from .._tracing import is_tracing
from ..base import (GradientTransformation, PRECONDITION_INPUT, Params, Role, State, Updates,
                    check_init_params, combine_traits, declare, declare_roles,
                    replace_state, require_whole_leaves, safe_increment, traits_of,
                    zero_count)
from ..kernels import mark_scratch
from ..tree import (MaskedNode, PyTree, Static, flatten_matching, leaf_labels, mask_leaves,
                    tree_cond, tree_flatten, tree_leaves, tree_paths, tree_structure,
                    tree_unflatten)
from .quantized import StateField, walk_state

__all__ = [
    "ProjectLowrankState",
    "project_lowrank",
]

ProjType = Literal["std", "reverse_std", "left", "right", "full"]
MatrixAxes = tuple[int, int] | PyTree | Callable[[Params], PyTree]
_PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")


# ---------------------------------------------------------------------------------------------
# static layout: which leaves are projected, on which side, to which shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """How one leaf is projected (decided from its shape and the configuration)."""
    axes: tuple[int, int]    # the leaf's (row, column) axes, non-negative
    side: str                # "left" (Uᵀ G), "right" (G Vᵀ) or "full" (Uᵀ G Vᵀ)
    batch: tuple[int, ...]   # sizes of the other axes, in order
    rows: int                # m
    cols: int                # n
    k: int                   # min(rank, m, n)
    ndim: int                # the leaf's number of dims

    @property
    def uses_left(self) -> bool:
        return self.side in ("left", "full")

    @property
    def uses_right(self) -> bool:
        return self.side in ("right", "full")

    @property
    def low_shape(self) -> tuple[int, ...]:
        rows = self.k if self.uses_left else self.rows
        cols = self.k if self.uses_right else self.cols
        return self.batch + (rows, cols)

    @property
    def left_shape(self) -> tuple[int, ...]:
        return self.batch + (self.rows, self.k)

    @property
    def right_shape(self) -> tuple[int, ...]:
        return self.batch + (self.k, self.cols)

    @property
    def moved(self) -> bool:
        return self.axes != (self.ndim - 2, self.ndim - 1)


def _side(proj_type: str, rows: int, cols: int) -> str:
    if proj_type == "std":
        return "right" if rows >= cols else "left"
    if proj_type == "reverse_std":
        return "left" if rows >= cols else "right"
    return proj_type


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(a, int) for a in x)


def _plans(tree: PyTree, rank: int, proj_type: str, mask: Any, matrix_axes: MatrixAxes
           ) -> list[_Plan | None]:
    """One `_Plan` per leaf of ``tree`` (None: not projected)."""
    leaves = tree_leaves(tree)
    per_leaf = not _is_axes(matrix_axes)
    axes_of = (leaf_labels(matrix_axes, tree, "matrix_axes", is_leaf=_is_axes) if per_leaf
               else [matrix_axes] * len(leaves))
    if mask is None:
        selected = ([a is not None for a in axes_of] if per_leaf
                    else [x.dim() == 2 for x in leaves])
    else:
        selected = mask_leaves(mask, tree)
    plans: list[_Plan | None] = []
    for i, (x, axes, keep) in enumerate(zip(leaves, axes_of, selected)):
        if not keep:
            plans.append(None)
            continue
        path = _LazyPath(tree, i)
        if x.dim() < 2:
            raise ValueError(f"project_lowrank: params{path} has {x.dim()} dims, but a "
                             "projected leaf needs two matrix axes. Leave it out of the mask "
                             "(it then goes through the inner transform at full size).")
        if axes is None or not _is_axes(axes):
            raise ValueError(f"project_lowrank: params{path} is projected but its matrix_axes "
                             f"is {axes!r}; give a pair of axes such as (0, 1).")
        a, b = matrix_axes_of(axes, x.shape, f"project_lowrank, params{path}")
        rows, cols = x.shape[a], x.shape[b]
        batch = tuple(s for i, s in enumerate(x.shape) if i not in (a, b))
        plans.append(_Plan(axes=(a, b), side=_side(proj_type, rows, cols), batch=batch,
                           rows=rows, cols=cols, k=min(rank, rows, cols), ndim=x.dim()))
    return plans


class _LazyPath:
    """The path of leaf ``i`` of ``tree``, computed only when an error message prints it."""

    def __init__(self, tree: PyTree, i: int) -> None:
        self.tree, self.i = tree, i

    def __str__(self) -> str:
        return tree_paths(self.tree)[self.i]


def _basis_dtype(x: torch.Tensor) -> torch.dtype:
    """The SVD, the bases and the projected gradients are at least float32."""
    return torch.promote_types(x.dtype, torch.float32)


def _as_matrix(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """``x`` with its matrix axes last, in the basis dtype."""
    if plan.moved:
        x = x.movedim(plan.axes, (-2, -1))
    return x.to(_basis_dtype(x))


def _from_matrix(y: torch.Tensor, plan: _Plan) -> torch.Tensor:
    return y.movedim((-2, -1), plan.axes) if plan.moved else y


def _project(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, side: str
             ) -> torch.Tensor:
    """:math:`G V^\\top`, :math:`U^\\top G` or :math:`U^\\top G V^\\top`."""
    if side == "right":
        return torch.matmul(x, right.mT)
    if side == "left":
        return torch.matmul(left.mT, x)
    return torch.matmul(left.mT, x) @ right.mT


def _project_back(y: torch.Tensor, left: torch.Tensor, right: torch.Tensor, side: str
                  ) -> torch.Tensor:
    """:math:`Y V`, :math:`U Y` or :math:`U Y V`."""
    if side == "right":
        return torch.matmul(y, right)
    if side == "left":
        return torch.matmul(left, y)
    return torch.matmul(left, y) @ right


# ---------------------------------------------------------------------------------------------
# the basis refresh
# ---------------------------------------------------------------------------------------------


def _svd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` and ``Vᴴ`` of the thin SVD. In eager mode a LAPACK failure gives NaN factors (so
    the caller keeps its old basis); a compiled step cannot catch it."""
    if is_tracing():
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        return u, vh
    try:
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
    except torch.linalg.LinAlgError:
        k = min(x.shape[-2], x.shape[-1])
        u = x.new_full(x.shape[:-1] + (k,), float("nan"))
        vh = x.new_full(x.shape[:-2] + (k, x.shape[-1]), float("nan"))
    return u, vh


def _all_finite(x: torch.Tensor) -> torch.Tensor:
    """Per matrix of the batch: every entry finite."""
    return torch.isfinite(x).all(dim=-1).all(dim=-1)


def _new_bases(x: torch.Tensor, plan: _Plan, old_left: torch.Tensor, old_right: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh bases from the SVD of ``x`` (matrix axes last), each matrix of the batch keeping
    its old bases when its gradient or its SVD is not finite."""
    ok = _all_finite(x)
    u, vh = _svd(torch.where(ok[..., None, None], x, torch.zeros_like(x)))
    left, right = old_left, old_right
    if plan.uses_left:
        left = u[..., :, :plan.k]
        ok = ok & _all_finite(left)
    if plan.uses_right:
        right = vh[..., :plan.k, :]
        ok = ok & _all_finite(right)
    keep = ok[..., None, None]
    if plan.uses_left:
        left = _column_major(torch.where(keep, left, old_left))
    if plan.uses_right:
        right = _column_major(torch.where(keep, right, old_right))
    return left, right


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each matrix stored column by column, the layout in which LAPACK returns
    ``U`` and ``Vᴴ``. The bases are kept that way from `init` on: torch.cond needs both
    branches to agree, and the products then round exactly as galore_torch's, which multiplies
    by views of the SVD's factors (another layout changes the last bits, and Adam turns the
    last bits of the near-zero entries of a projected gradient into visible differences)."""
    return x.mT.contiguous().mT


@dataclass(frozen=True)
class _Slot:
    """An inner-state leaf that holds a statistic of a projected leaf's low-rank gradient."""
    item: int          # index of its statistics tree, in the order `_stats_walk` visits them
    leaf: int          # index of the parameter leaf inside that statistics tree
    squared: bool      # a second moment (rotated with the squared change of basis)


def _stats_walk(fn: Callable[[Any, StateField], Any], inner_state: State, spec: Any) -> State:
    """Rebuild ``inner_state`` with ``fn(tree, where)`` at every sub-tree with the structure
    of the updates (a statistics tree: ``mu``, ``nu``, ``trace``, ...); ``where`` names the
    enclosing NamedTuple field and its declared role."""
    return walk_state(lambda node, _, where: fn(node, where) if tree_structure(node) == spec
                 else node, inner_state, is_leaf=lambda node: tree_structure(node) == spec)


def _check_rotatable(where: StateField, i: int, leaf: torch.Tensor, plan: _Plan) -> None:
    """Refuse a statistic of projected leaf ``i`` that re-projection cannot rotate."""
    if where.role is Role.FACTORED_MOMENT and leaf.numel() > 0:
        raise ValueError(
            f"project_lowrank(reproject_moments=True): {where.owner}.{where.name} is declared "
            f"FACTORED_MOMENT and holds a row or column statistic of projected leaf {i}; a "
            "factored moment cannot be carried into a new basis. Drop reproject_moments, or "
            "leave that leaf out of the projection (mask=...).")
    if (where.role is None and not where.declared and leaf.is_floating_point()
            and tuple(leaf.shape) == plan.low_shape):
        owner = (f"{where.owner}.{where.name}" if where.owner
                 else "a state that is no NamedTuple")
        raise TypeError(
            f"project_lowrank(reproject_moments=True): the inner state's {owner} holds a tree "
            f"shaped like the projected updates, but {where.owner or 'the state'} declares no "
            "roles, so it cannot tell a first moment (rotated) from a second moment (rotated "
            "as squares) or a parameter-like tensor (not rotated). Declare them in the state "
            "class body, for example __roles__ = opttx.extend.declare_roles(step=Role.COUNT, "
            "exp_avg=Role.FIRST_MOMENT, exp_avg_sq=Role.SECOND_MOMENT) (see opttx.extend.Role).")


def _moment_slots(inner_state: State, spec: Any, plans: Sequence[_Plan | None]
                  ) -> list[_Slot]:
    """The statistics of the projected leaves to rotate at a refresh, found by declared role:
    at the leaves of projected parameters of every statistics tree under a ``FIRST_MOMENT``
    (rotated linearly) or ``SECOND_MOMENT`` (rotated as squares) field whose shape is the
    low-rank shape. ``PARAMS_LIKE`` and the other roles are not rotated; ``FACTORED_MOMENT``
    at a projected leaf and statistics of a state without roles are refused."""
    slots: list[_Slot] = []
    count = [0]

    def visit(tree: Any, where: StateField) -> Any:
        n, count[0] = count[0], count[0] + 1
        for i, (plan, leaf) in enumerate(zip(plans, tree_leaves(tree))):
            if plan is None or not isinstance(leaf, torch.Tensor):
                continue
            _check_rotatable(where, i, leaf, plan)
            if (where.role in (Role.FIRST_MOMENT, Role.SECOND_MOMENT)
                    and leaf.is_floating_point() and tuple(leaf.shape) == plan.low_shape):
                slots.append(_Slot(item=n, leaf=i, squared=where.role is Role.SECOND_MOMENT))
        return tree

    _stats_walk(visit, inner_state, spec)
    return slots


def _moments_of(inner_state: State, spec: Any, slots: list[_Slot]) -> list[torch.Tensor]:
    """The tensors of ``slots``, in slot order."""
    trees: list[Any] = []
    _stats_walk(lambda tree, _: trees.append(tree) or tree, inner_state, spec)
    return [tree_leaves(trees[s.item])[s.leaf] for s in slots]


def _with_moments(inner_state: State, spec: Any, slots: list[_Slot],
                  moments: list[torch.Tensor]) -> State:
    """``inner_state`` with the tensors of ``slots`` replaced by ``moments``."""
    by_item: dict[int, dict[int, torch.Tensor]] = {}
    for s, m in zip(slots, moments):
        by_item.setdefault(s.item, {})[s.leaf] = m
    count = [0]

    def replace(tree: Any, _: StateField) -> Any:
        n, count[0] = count[0], count[0] + 1
        if n not in by_item:
            return tree
        leaves, tree_spec = tree_flatten(tree)
        for i, m in by_item[n].items():
            leaves[i] = m
        return tree_unflatten(leaves, tree_spec)

    return _stats_walk(replace, inner_state, spec)


def _rotate(moment: torch.Tensor, c_left: torch.Tensor | None, c_right: torch.Tensor | None,
            squared: bool) -> torch.Tensor:
    """A statistic in the old coordinates expressed in the new ones: :math:`C_L M C_R`, or
    :math:`(C_L \\circ C_L) V (C_R \\circ C_R)` for a second moment."""
    out = moment.to(c_left.dtype if c_left is not None else c_right.dtype)
    if c_left is not None:
        out = torch.matmul(c_left * c_left if squared else c_left, out)
    if c_right is not None:
        out = torch.matmul(out, c_right * c_right if squared else c_right)
    return out.to(moment.dtype).contiguous()


# ---------------------------------------------------------------------------------------------
# the steps of project_lowrank
# ---------------------------------------------------------------------------------------------


def _check_arguments(inner: Any, rank: Any, update_proj_gap: Any, scale: Any,
                     proj_type: Any) -> None:
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"project_lowrank: inner must be a GradientTransformation, got "
                        f"{type(inner).__name__} (did you forget to call the factory?).")
    check_positive_int("rank", rank)
    check_positive_int("update_proj_gap", update_proj_gap)
    check_number("scale", scale)
    if proj_type not in _PROJ_TYPES:
        raise ValueError(f"proj_type must be one of {', '.join(map(repr, _PROJ_TYPES))}, got "
                         f"{proj_type!r}.")


def _initial_bases(leaves: list[torch.Tensor], plans: Sequence[_Plan | None]
                   ) -> tuple[list, list, list]:
    """Zero bases (column-major) and zero low-rank stand-ins of every leaf: the stand-ins
    are what the inner transform's init sees (the leaf itself where it is not projected)."""
    lefts, rights, low = [], [], []
    for x, plan in zip(leaves, plans):
        kw = dict(dtype=_basis_dtype(x), device=x.device)
        empty = torch.zeros((0,), **kw)
        if plan is None:
            lefts.append(empty), rights.append(empty), low.append(x)
            continue
        lefts.append(_column_major(torch.zeros(plan.left_shape, **kw)) if plan.uses_left
                     else empty)
        rights.append(_column_major(torch.zeros(plan.right_shape, **kw)) if plan.uses_right
                      else empty)
        low.append(torch.zeros(plan.low_shape, **kw))
    return lefts, rights, low


def _refresh(due: torch.Tensor, mats: dict[int, torch.Tensor], plans: Sequence[_Plan | None],
             lefts: list, rights: list, inner_state: State, spec: Any, reproject: bool
             ) -> tuple[list, list, State]:
    """The bases after this step's refresh (new ones where ``due``, in one ``torch.cond``),
    and with ``reproject`` the inner statistics carried into them."""
    idx = list(mats)
    slots = _moment_slots(inner_state, spec, plans) if reproject else []
    moments = _moments_of(inner_state, spec, slots)

    def refresh(old_l: list, old_r: list, old_moments: list) -> tuple:
        new_l, new_r = [], []
        for i, ol, orr in zip(idx, old_l, old_r):
            nl, nr = _new_bases(mats[i], plans[i], ol, orr)
            new_l.append(nl), new_r.append(nr)
        pos = {i: j for j, i in enumerate(idx)}
        rotated = []
        for s, m in zip(slots, old_moments):
            j, plan = pos[s.leaf], plans[s.leaf]
            c_l = new_l[j].mT @ old_l[j] if plan.uses_left else None
            c_r = old_r[j] @ new_r[j].mT if plan.uses_right else None
            rotated.append(_rotate(m, c_l, c_r, s.squared))
        return new_l, new_r, rotated

    def keep(old_l: list, old_r: list, old_moments: list) -> tuple:
        return old_l, old_r, old_moments

    new_l, new_r, moments = tree_cond(due, refresh, keep, ([lefts[i] for i in idx],
                                                           [rights[i] for i in idx], moments))
    lefts, rights = list(lefts), list(rights)
    for j, i in enumerate(idx):
        lefts[i], rights[i] = new_l[j], new_r[j]
    if slots:
        inner_state = _with_moments(inner_state, spec, slots, moments)
    return lefts, rights, inner_state


def _projected(updates: Updates, tree: PyTree, spec: Any, plans: Sequence[_Plan | None],
               lefts: list, rights: list) -> PyTree:
    """``tree`` (like the updates) with its projected leaves projected on the bases."""
    leaves = list(flatten_matching(updates, tree, what="updates and params")[2])
    for i, plan in enumerate(plans):
        if plan is not None:
            leaves[i] = _project(_as_matrix(leaves[i], plan), lefts[i], rights[i], plan.side)
    return tree_unflatten(leaves, spec)


def _back_projected(out: PyTree, updates: Updates, g: list, plans: Sequence[_Plan | None],
                    lefts: list, rights: list, scale: float) -> list:
    """The inner's output leaves, projected ones mapped back to full size and scaled."""
    out_leaves = list(flatten_matching(updates, out, what="updates and inner updates")[2])
    idx = [i for i, plan in enumerate(plans) if plan is not None]
    back = []
    for i in idx:
        basis = lefts[i] if plans[i].uses_left else rights[i]
        y = _project_back(out_leaves[i].to(basis.dtype), lefts[i], rights[i],
                          plans[i].side) * scale
        back.append(_from_matrix(y, plans[i]).to(g[i].dtype))
    for i, y in zip(idx, mark_scratch(back)):
        out_leaves[i] = y
    return out_leaves


# ---------------------------------------------------------------------------------------------
# project_lowrank
# ---------------------------------------------------------------------------------------------


class ProjectLowrankState(NamedTuple):
    """State of `project_lowrank`."""
    count: torch.Tensor  # shape (), int32: steps taken; the bases refresh when count % gap == 0
    left: Updates        # like params: U[..., :, :k] (m × k per matrix) of leaves projected on
                         # the left or both sides, fp32 (fp64 for fp64 leaves); empty (0,) else
    right: Updates       # like params: Vᵀ[..., :k, :] (k × n per matrix) of leaves projected on
                         # the right or both sides, same dtype; empty (0,) elsewhere
    inner_state: State   # the inner transform's state over the projected tree
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, left=Role.PROJECTION, right=Role.PROJECTION)


@declare(hyperparams={"scale": None}, runtime=("update_proj_gap",))
def project_lowrank(inner: GradientTransformation, rank: int, update_proj_gap: int = 200,
                    scale: float = 1.0, proj_type: ProjType = "std", *,
                    mask: PyTree | Callable[[Params], PyTree] | None = None,
                    matrix_axes: MatrixAxes = (-2, -1),
                    reproject_moments: bool = False,
                    project_params: bool = False) -> GradientTransformation:
    r"""Run ``inner`` in GaLore's low-rank projected space.

    For a projected leaf read as a matrix :math:`G_t \in \mathbb{R}^{m \times n}` (axes
    ``matrix_axes``, other axes batched), every ``update_proj_gap`` (:math:`T`) steps, at
    :math:`t \equiv 0 \pmod T` with :math:`t` the 0-based step,

    .. math::
        U \Sigma V^\top = \mathrm{svd}(G_t) \ (\text{float32; float64 leaves: float64}), \qquad
        P_L = U_{:, :k}, \quad P_R = V^\top_{:k, :}, \quad k = \min(r, m, n),

    then at every step, with :math:`\mathcal{I}` the inner transform and :math:`\alpha`
    ``scale``,

    .. math::
        R_t = G_t P_R^\top \ (\text{right}), \quad P_L^\top G_t \ (\text{left}), \quad
        P_L^\top G_t P_R^\top \ (\text{full}); \qquad
        u_t = \alpha\, (N_t P_R \mid P_L N_t \mid P_L N_t P_R), \quad
        N_t = \mathcal{I}(R_t).

    ``proj_type`` picks the side as galore_torch's ``GaLoreProjector``: ``"std"`` projects on
    the right when :math:`m \ge n` and on the left otherwise (the state is
    :math:`\max(m, n) \times k`), ``"reverse_std"`` the opposite, ``"left"``/``"right"``
    force a side, ``"full"`` projects on both (:math:`k \times k`). The back-projection uses
    the side of the projection (galore_torch's ``reverse_std`` picks it again from the shape
    and fails on a wide matrix with :math:`r \ge m`).

    ``inner`` sees one tree with the structure of the updates in which projected leaves are
    replaced by their low-rank versions :math:`R_t` (shape ``batch + (m, k)``, ``(k, n)`` or
    ``(k, k)``, float32 for 16-bit and float32 leaves) and the other leaves are the full
    gradients; the other leaves' outputs come back unchanged (no :math:`\alpha`), so
    ``project_lowrank(scale_by_adam(...))`` runs Adam at full size on vectors, as GaLore runs
    plain AdamW on its non-projected parameters.

    The inner statistics are kept across a refresh unchanged, in the coordinates of the old
    basis (as galore_torch). With ``reproject_moments=True`` they are carried into the new
    basis at a refresh, with the change of basis :math:`C_L = P_L'^\top P_L` (left) and
    :math:`C_R = P_R P_R'^\top` (right). Which trees of the inner state are statistics is
    read from the roles its state classes declare (`opttx.extend.Role`), never from field names:
    a ``FIRST_MOMENT`` (any linear statistic) becomes :math:`C_L M C_R`, which is exactly the
    old moment :math:`P_L M P_R` seen in the full space and projected on the new basis. A
    ``SECOND_MOMENT`` is not linear in the basis; it becomes
    :math:`(C_L \circ C_L)\, V\, (C_R \circ C_R)` — the variance of the rotated coordinates if
    the old ones are uncorrelated — which stays non-negative with no clamp, is exact when the
    new basis permutes or flips the signs of the old vectors, and drops the mass of directions
    that leave the subspace, as the first moment does. With a transform linear in the
    gradients (momentum) and :math:`k = \min(m, n)` on the small side (``"std"``), the result
    is then the inner transform's own, whatever the refreshes. A ``PARAMS_LIKE`` tree (an
    iterate, an average of parameters) is not rotated: it is no statistic of the gradients'
    coordinates. A ``FACTORED_MOMENT`` at a projected leaf (Adafactor's row and column
    statistics) cannot be rotated and is refused, as is a tree shaped like the projected
    updates in a state that declares no roles (``TypeError``: declare them). Statistics trees
    are trees of plain tensors with the structure of the updates (anywhere in a ``chain``,
    ``named_chain`` or ``inject_hyperparams`` state); states of a `masked` inner transform or
    quantized moments are left as they are.

    A refresh whose gradient or SVD is not finite keeps the old bases, matrix by matrix (the
    non-finite input is not passed to the SVD). Before the first successful SVD the bases are
    zero, so the leaf does not move. In eager mode a LAPACK failure of the SVD also keeps the
    old bases; in a compiled step it raises.

    Args:
      inner: the transform to run in the projected space (usually ``scale_by_adam``).
      rank: :math:`r` >= 1; capped at :math:`\min(m, n)` per leaf.
      update_proj_gap: :math:`T`, steps between basis refreshes (galore_torch's default 200).
      scale: :math:`\alpha`, applied to the back-projected updates (galore_torch's default
        1.0; its README uses 0.25).
      proj_type: ``"std"`` (default), ``"reverse_std"``, ``"left"``, ``"right"``, ``"full"``.
      mask: which leaves are projected: a tree of Python booleans like the params, a prefix of
        it, or a function of the params returning one. Default: every 2-D leaf, or, when
        ``matrix_axes`` is given per leaf, every leaf whose axes are not None.
      matrix_axes: the (row, column) axes of the matrix of a projected leaf; the other axes
        are a batch of independent matrices, each with its own bases. A pair for all leaves
        (default ``(-2, -1)``, torch.linalg's convention; a conv weight ``(out, in, kh, kw)``
        wants ``(0, 1)``), or a tree/function giving a pair or None per leaf.
      reproject_moments: carry the inner statistics into each new basis (see above).
      project_params: give ``inner`` the parameters too, projected with the same bases
        (:math:`W P_R^\top`, ...), for inner transforms that read them; by default ``inner``
        gets ``params=None`` and saves that matmul. Transforms that act on the full weights
        (decoupled weight decay) belong after `project_lowrank` in a chain.

    Returns:
      A `GradientTransformation`. ``project_lowrank(scale_by_adam(b1, b2, eps,
      bias_correction=False), rank, T, alpha, proj_type)`` followed by the bias correction as a
      step size is galore_torch's ``GaLoreAdamW`` (see `opttx.galore_adamw`).

    Example:
      >>> tx = opttx.chain(
      ...     opttx.project_lowrank(opttx.scale_by_adam(), rank=128, update_proj_gap=200,
      ...                           scale=0.25),
      ...     opttx.add_decayed_weights(0.01), opttx.scale_by_learning_rate(1e-3))

    References:
      Zhao et al., GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection
      (arXiv 2403.03507).
    """
    _check_arguments(inner, rank, update_proj_gap, scale, proj_type)

    def plans_of(tree: PyTree) -> list[_Plan | None]:
        return _plans(tree, rank, proj_type, mask, matrix_axes)

    def init(params: Params) -> ProjectLowrankState:
        check_init_params(params)
        leaves, spec = tree_flatten(params)
        plans = plans_of(params)
        lefts, rights, low = _initial_bases(leaves, plans)
        inner_state = inner.init(tree_unflatten(low, spec))
        if reproject_moments and any(p is not None for p in plans) and not _moment_slots(
                inner_state, spec, plans):
            raise ValueError("project_lowrank(reproject_moments=True): the inner state holds no "
                             "statistic declared FIRST_MOMENT or SECOND_MOMENT shaped like the "
                             "projected gradients to re-project (a stateless, masked or "
                             "quantized inner transform?). Drop the flag, or give an inner "
                             "transform whose moments are trees like params.")
        return ProjectLowrankState(count=zero_count(params), left=tree_unflatten(lefts, spec),
                                   right=tree_unflatten(rights, spec), inner_state=inner_state)

    def update(updates: Updates, state: ProjectLowrankState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ProjectLowrankState]:
        spec, g, lefts, rights = flatten_matching(updates, state.left, state.right)
        # an integer gradient would be projected into a float64 update, silently
        check_gradient_leaves(g, None, updates, "project_lowrank")
        plans = plans_of(params if params is not None else updates)
        require_whole_leaves(tree_unflatten([x if plan is not None else MaskedNode()
                                             for x, plan in zip(g, plans)], spec),
                             extra_args, "project_lowrank")
        inner_state, lefts, rights = state.inner_state, list(lefts), list(rights)
        mats = {i: _as_matrix(x, plan) for i, (x, plan) in enumerate(zip(g, plans))
                if plan is not None}
        due = state.count % update_proj_gap == 0
        # compiled: one torch.cond holds the refresh; eager: nothing to do off refresh steps
        if mats and (is_tracing() or bool(due)):
            lefts, rights, inner_state = _refresh(due, mats, plans, lefts, rights, inner_state,
                                                  spec, reproject_moments)
        low = list(g)
        for i, m in mats.items():
            low[i] = _project(m, lefts[i], rights[i], plans[i].side)
        extra = dict(extra_args)
        if PRECONDITION_INPUT in extra:
            extra[PRECONDITION_INPUT] = _projected(updates, extra[PRECONDITION_INPUT], spec,
                                                   plans, lefts, rights)
        inner_params = (_projected(updates, params, spec, plans, lefts, rights)
                        if (project_params and params is not None) else None)
        out, inner_state = inner.update(tree_unflatten(low, spec), inner_state, inner_params,
                                        **extra)
        out_leaves = _back_projected(out, updates, g, plans, lefts, rights, scale)
        return tree_unflatten(out_leaves, spec), replace_state(
            state, count=safe_increment(state.count), left=tree_unflatten(lefts, spec),
            right=tree_unflatten(rights, spec), inner_state=inner_state)

    # an SVD of each whole leaf; per leaf as the inner transform is
    return GradientTransformation(init, update, combine_traits(
        (inner,), elementwise=False, whole_leaves=True,
        takes_precondition_input=traits_of(inner).takes_precondition_input))
